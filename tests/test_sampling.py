"""Each sampling step on hand-computed inputs, and the composed sampler's determinism."""

from __future__ import annotations

import math

import pytest
import torch

from moeswap.errors import MoeswapError
from moeswap.sampling import (GREEDY, Sampler, SamplingParams, draw, min_p, repetition_penalty,
                              temperature, top_k, top_p)


def logits_for(probs):
    return torch.log(torch.tensor(probs, dtype=torch.float32))


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    out = repetition_penalty(logits, [0, 1, 1], 2.0)
    assert out.tolist() == [1.0, -2.0, 0.5, 3.0]
    assert logits.tolist() == [2.0, -1.0, 0.5, 3.0]  # the input is left alone


def test_top_k_keeps_the_k_best_sorted():
    ids, values = top_k(torch.tensor([0.1, 3.0, -1.0, 2.0, 2.5]), 3)
    assert ids.tolist() == [1, 4, 3] and values.tolist() == [3.0, 2.5, 2.0]
    ids, _ = top_k(torch.tensor([0.1, 3.0, -1.0]), 0)  # 0: off, everything sorted
    assert ids.tolist() == [1, 0, 2]


@pytest.mark.parametrize("p, kept", [(0.5, 1), (0.79, 2), (0.81, 3), (0.96, 4), (1.0, 4)])
def test_top_p_keeps_the_fewest_reaching_p(p, kept):
    candidates = top_k(logits_for([0.15, 0.5, 0.05, 0.3]), 0)
    ids, _ = top_p(candidates, p)
    assert ids.tolist() == [1, 3, 0, 2][:kept]


@pytest.mark.parametrize("p, kept", [(0.0, 4), (0.2, 3), (0.31, 2), (0.61, 1), (1.0, 1)])
def test_min_p_is_relative_to_the_best(p, kept):
    candidates = top_k(logits_for([0.15, 0.5, 0.05, 0.3]), 0)
    ids, _ = min_p(candidates, p)
    assert ids.tolist() == [1, 3, 0, 2][:kept]


def test_temperature_scales_logits():
    ids, logits = temperature((torch.tensor([4, 2]), torch.tensor([1.0, -3.0])), 0.5)
    assert ids.tolist() == [4, 2] and logits.tolist() == [2.0, -6.0]


def test_draw_follows_the_distribution():
    candidates = (torch.tensor([7, 8, 9]), logits_for([0.6, 0.3, 0.1]))
    generator = torch.Generator().manual_seed(0)
    counts = {7: 0, 8: 0, 9: 0}
    for _ in range(3000):
        counts[draw(candidates, generator)] += 1
    for token, prob in ((7, 0.6), (8, 0.3), (9, 0.1)):
        # 4.5 standard deviations of a binomial: fails only if draw is wrong.
        assert abs(counts[token] - 3000 * prob) < 4.5 * math.sqrt(3000 * prob * (1 - prob))


def test_greedy_is_argmax_after_the_penalty():
    logits = torch.tensor([0.0, 5.0, 4.0])
    assert Sampler(GREEDY).next_token(logits, [0]) == 1
    penalised = SamplingParams(temperature=0.0, repeat_penalty=2.0)
    assert Sampler(penalised).next_token(logits, [1]) == 2
    # repeat_last_n bounds the window: token 1 is older than the last 1 token.
    windowed = SamplingParams(temperature=0.0, repeat_penalty=2.0, repeat_last_n=1)
    assert Sampler(windowed).next_token(logits, [1, 0]) == 1


def test_top_k_one_is_greedy_whatever_the_temperature():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    sampler = Sampler(SamplingParams(temperature=5.0, top_k=1, seed=1))
    assert all(sampler.next_token(logits, []) == int(logits.argmax()) for _ in range(20))


def test_same_seed_same_tokens_other_seed_other_tokens():
    logits = torch.zeros(50_000)  # uniform: every draw is pure randomness
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1234)
    a, b = Sampler(params), Sampler(params)
    run_a = [a.next_token(logits, []) for _ in range(10)]
    run_b = [b.next_token(logits, []) for _ in range(10)]
    other = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=99))
    assert run_a == run_b
    assert run_a != [other.next_token(logits, []) for _ in range(10)]


def test_sampled_tokens_stay_inside_the_filters():
    logits = logits_for([0.4, 0.3, 0.2, 0.06, 0.04])
    sampler = Sampler(SamplingParams(temperature=1.5, top_k=4, top_p=0.85, min_p=0.0, seed=5))
    assert {sampler.next_token(logits, []) for _ in range(200)} == {0, 1, 2}


@pytest.mark.parametrize("bad, message", [
    (dict(top_k=-1), "top_k must be >= 0"),
    (dict(top_p=0.0), "top_p must be in"),
    (dict(min_p=1.5), "min_p must be in"),
    (dict(repeat_penalty=0.0), "repeat_penalty must be > 0"),
])
def test_invalid_settings_are_rejected(bad, message):
    with pytest.raises(MoeswapError, match=message):
        SamplingParams(**bad)


def test_cutoffs_see_the_untempered_distribution():
    """llama.cpp's order: top-p on [0.5, 0.3, 0.15, 0.05] keeps three tokens (0.95 >= 0.9),
    then temperature 3 flattens them. Tempering first (transformers' order) would flatten to
    [0.34, 0.28, 0.22, 0.16], whose first three sum to 0.84 < 0.9, and token 3 would be drawn."""
    logits = logits_for([0.5, 0.3, 0.15, 0.05])
    sampler = Sampler(SamplingParams(temperature=3.0, top_k=0, top_p=0.9, min_p=0.0, seed=2))
    assert {sampler.next_token(logits, []) for _ in range(400)} == {0, 1, 2}
    # min-p likewise: 0.05 / 0.5 = 0.1 < 0.2 drops token 3; tempered, 0.16 / 0.34 would keep it.
    sampler = Sampler(SamplingParams(temperature=3.0, top_k=0, top_p=1.0, min_p=0.2, seed=2))
    assert {sampler.next_token(logits, []) for _ in range(400)} == {0, 1, 2}


@pytest.mark.llama_cpp
@pytest.mark.parametrize("top_k_, top_p_, min_p_", [(40, 0.9, 0.05), (0, 0.6, 0.0), (100, 1.0, 0.1)])
def test_filters_and_temperature_equal_llama_cpps_sampler_chain(top_k_, top_p_, min_p_):
    """llama.cpp's own chain (top-k, top-p, min-p, temperature, as llama-cpp-python builds it)
    on the built-in model's next-token logits, computed by llama.cpp from the shipped GGUF:
    the same candidates survive, with the same tempered logits."""
    import ctypes

    import llama_cpp

    import moeswap

    llm = llama_cpp.Llama(str(moeswap.DEFAULT_MODEL), n_ctx=64, logits_all=True, verbose=False)
    prompt = llm.tokenize(b"import os\nfor name in")
    llm.eval(prompt)
    logits = torch.tensor(llm.scores[len(prompt) - 1], dtype=torch.float32)
    llm.close()
    t = 3.0
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    for sampler in (llama_cpp.llama_sampler_init_top_k(top_k_),
                    llama_cpp.llama_sampler_init_top_p(top_p_, 1),
                    llama_cpp.llama_sampler_init_min_p(min_p_, 1),
                    llama_cpp.llama_sampler_init_temp(t)):
        llama_cpp.llama_sampler_chain_add(chain, sampler)
    data = (llama_cpp.llama_token_data * logits.numel())(
        *[llama_cpp.llama_token_data(i, float(v), 0.0) for i, v in enumerate(logits.tolist())])
    array = llama_cpp.llama_token_data_array(data, logits.numel(), -1, False)
    llama_cpp.llama_sampler_apply(chain, ctypes.byref(array))
    theirs = {data[i].id: data[i].logit for i in range(array.size)}
    llama_cpp.llama_sampler_free(chain)
    params = SamplingParams(temperature=t, top_k=top_k_, top_p=top_p_, min_p=min_p_)
    ids, tempered = Sampler(params).candidates(logits, [])
    ours = dict(zip(ids.tolist(), tempered.tolist()))
    assert 1 < len(ours) < logits.numel()  # the cut-offs did cut
    assert set(ours) == set(theirs)
    assert all(ours[i] == pytest.approx(theirs[i], rel=1e-6) for i in ours)
