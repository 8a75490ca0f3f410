"""Chunked prefill: a prompt fed ``step_tokens`` at a time gives the logits and tokens of one
forward over it (full attention and GPT-OSS's 4-token sliding window with sinks), in single and
batched generation and in chat; ``--step-tokens`` of run / chat / plan, its refusals, and what
run charges for a step (the KV cache and working memory of a chunk, as the planner counts)."""

from __future__ import annotations

import io

import pytest
import torch
from test_server import one_thread  # noqa: F401 (fixture)

import moeswap
from moeswap.chat import ChatOptions, ChatSession
from moeswap.cli import main
from moeswap.errors import MoeswapError
from moeswap.memory import HostCharge, forward_working_bytes, kv_cache_bytes, kv_widening_bytes
from moeswap.formats.config import config_from_gguf
from moeswap.formats.gguf_file import GGUFFile
from moeswap.generate import generate, generate_batch, prefill
from moeswap.sampling import GREEDY

PROMPT_TOKENS = 40
CHUNK = 7


class CountingModel:
    """The real model, with the tokens per sequence of every forward recorded."""

    def __init__(self, model):
        self.model = model
        self.calls: list[list[int]] = []

    def new_cache(self):
        return self.model.new_cache()

    def forward(self, tokens, caches, last_only=False):
        self.calls.append([int(t.numel()) for t in tokens])
        return self.model.forward(tokens, caches, last_only)


@pytest.fixture(scope="module", params=["mixtral", "gpt_oss"])
def tiny_gguf(request, tmp_path_factory):
    import tiny_models
    from moeswap.gguf_tools.convert import convert

    folder = tmp_path_factory.mktemp(request.param)
    tiny_models.save(request.param, folder / "hf")
    return convert(folder / "hf", folder / "model.gguf", "f32")


@pytest.fixture(scope="module")
def runtime(tiny_gguf):
    return moeswap.load(tiny_gguf, threads=1, tokenizer_cache_dir=tiny_gguf.parent / "cache")


def prompt_ids(seed: int, n: int = PROMPT_TOKENS) -> list[int]:
    import tiny_models

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, tiny_models.VOCAB, (n,), generator=generator).tolist()


def test_chunks_of_7_give_the_logits_of_one_forward(runtime):
    model, ids = CountingModel(runtime.model), prompt_ids(0)
    whole = prefill(model, [ids], [model.new_cache()], step_tokens=PROMPT_TOKENS)[0]
    assert model.calls == [[PROMPT_TOKENS]]
    model.calls.clear()
    chunked = prefill(model, [ids], [model.new_cache()], step_tokens=CHUNK)[0]
    assert model.calls == [[7]] * 5 + [[5]]  # 40 = 5 x 7 + 5
    assert (chunked - whole).abs().max() <= 1e-5 * whole.abs().max()
    assert chunked.argmax() == whole.argmax()



def test_last_only_runs_the_head_on_each_sequences_last_position(runtime):
    model = runtime.model
    short, long = prompt_ids(1, 3), prompt_ids(2, 9)
    full = model.forward([torch.tensor(short), torch.tensor(long)],
                         [model.new_cache(), model.new_cache()])  # [3, V], [9, V]
    # the layer-by-layer path's head (a token graph picks its last rows by get_rows:
    # tests/test_token_graph.py), ggml's head graph or the torch head
    where = "head_graph" if model.head_graph is not None else "output"
    rows_seen, head, steps = [], getattr(model, where), model.token_graph
    setattr(model, where, lambda x: rows_seen.append(x.shape[0]) or head(x))
    model.token_graph = None
    try:
        last = model.forward([torch.tensor(short), torch.tensor(long)],
                             [model.new_cache(), model.new_cache()], last_only=True)
    finally:
        setattr(model, where, head)
        model.token_graph = steps
    assert rows_seen == [2]  # two rows through the head, not twelve
    with pytest.raises(ValueError, match="at least one new token"):  # no last row to give
        model.forward([torch.tensor(short), torch.tensor([], dtype=torch.long)],
                      [model.new_cache(), model.new_cache()], last_only=True)
    assert [tuple(rows.shape) for rows in last] == [(1, model.config.n_vocab)] * 2
    for one, every in zip(last, full):  # the head on 1 row or on all: summation order only
        assert (one[0] - every[-1]).abs().max() <= 1e-5 * every[-1].abs().max()
        assert one[0].argmax() == every[-1].argmax()


def test_the_kept_rows_are_copies_not_views_of_a_chunks_logits(runtime):
    """prefill keeps each prompt's last row [V] in storage of its own: a view would keep the
    whole [T, V] logits of its chunk (of every prompt in that forward) alive."""
    model = runtime.model
    rows = prefill(model, [prompt_ids(6), prompt_ids(7, 9)], [model.new_cache(), model.new_cache()],
                   step_tokens=CHUNK)
    for row in rows:
        assert row.shape == (model.config.n_vocab,)
        assert row.untyped_storage().nbytes() == row.numel() * row.element_size()

def test_chunked_greedy_generation_gives_the_same_tokens(runtime):
    ids = prompt_ids(1)
    whole = list(generate(runtime.model, ids, max_tokens=12, step_tokens=PROMPT_TOKENS))
    chunked = list(generate(runtime.model, ids, max_tokens=12, step_tokens=CHUNK))
    assert len(whole) == 12 and chunked == whole


def test_a_batch_feeds_each_unfinished_prompts_next_chunk(runtime):
    prompts = [prompt_ids(2, 40), prompt_ids(3, 9), prompt_ids(4, 16)]
    model = CountingModel(runtime.model)
    batch: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for step in generate_batch(model, prompts, max_tokens=6, step_tokens=CHUNK):
        for index, token in step:
            batch[index].append(token)
    # chunk by chunk, only the prompts with tokens left (and their caches) ride along
    prefill_calls = [[7, 7, 7], [7, 2, 7], [7, 2], [7], [7], [5]]
    assert model.calls[:6] == prefill_calls
    assert model.calls[6] == [1, 1, 1]  # then one decode token each
    for index, prompt in enumerate(prompts):
        alone = list(generate(runtime.model, prompt, max_tokens=6, step_tokens=PROMPT_TOKENS))
        assert batch[index] == alone, index


def test_a_step_larger_than_the_prompt_is_one_forward(runtime):
    model = CountingModel(runtime.model)
    list(generate(model, prompt_ids(5), max_tokens=3, step_tokens=512))
    assert model.calls == [[PROMPT_TOKENS], [1], [1]]
    model.calls.clear()
    list(generate(model, prompt_ids(5), max_tokens=1))  # the default: llama.cpp's 512
    assert model.calls == [[PROMPT_TOKENS]]


def test_prefill_refuses_a_step_below_one(runtime):
    for bad in (0, -3):
        with pytest.raises(MoeswapError, match=rf"--step-tokens must be >= 1, got {bad}"):
            prefill(runtime.model, [[1, 2]], [runtime.model.new_cache()], step_tokens=bad)


@pytest.mark.parametrize("command", [
    ["run", "MODEL", "-p", "hi", "-n", "1"],
    ["chat", "MODEL"],
    ["plan", "MODEL", "--host-mem", "1GiB", "--ctx", "64"],
])
@pytest.mark.parametrize("bad", ["0", "-1"])
def test_a_bad_step_tokens_flag_is_one_line(tiny_gguf, command, bad, capsys):
    argv = [str(tiny_gguf) if a == "MODEL" else a for a in command]
    assert main([*argv, "--step-tokens", bad]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"moeswap: error: --step-tokens must be >= 1, got {bad}\n"
    assert captured.out == ""


def test_run_with_small_steps_prints_what_one_forward_does(tiny_gguf, capsys):
    text = "The quick brown fox jumps over the lazy dog."
    base = ["run", str(tiny_gguf), "-p", text, "-n", "6", "--temp", "0", "--threads", "1"]
    assert main(base) == 0
    whole = capsys.readouterr().out
    assert main(base + ["--step-tokens", "3"]) == 0
    assert capsys.readouterr().out == whole


def test_run_charges_a_chunk_and_the_plan_counts_the_same(tiny_gguf, monkeypatch, capsys):
    """`run` hands the store the KV cache and working memory of a --step-tokens chunk (not the
    prompt), and `moeswap plan` at that context and step charges the same bytes."""
    from moeswap.experts import build

    charged = {}

    def capture(settings, charge, rates=None):
        charged.update(charge=charge)
        return {}  # all resident: the charge is what is checked

    monkeypatch.setattr(build, "load_options", capture)
    text = "The quick brown fox jumps over the lazy dog."
    assert main(["run", str(tiny_gguf), "-p", text, "-n", "4", "--temp", "0", "--threads", "1",
                 "--host-mem", "1GiB", "--step-tokens", "5"]) == 0
    capsys.readouterr()
    context = len(text.encode()) + 1 + 4  # run's bound: a token per byte, BOS, -n
    gguf = GGUFFile.open(tiny_gguf)
    config = config_from_gguf(gguf)
    gguf.close()
    # the command line's f16 cache: one layer of it widened to f32 while attending
    working = forward_working_bytes(config, 5, context) + kv_widening_bytes(config, context, "f16")
    assert charged == dict(charge=HostCharge(context_tokens=context, step_tokens=5, kv_type="f16"))
    assert charged["charge"].working_bytes(config) == working
    # one logits row (V 128); per fed token: 4 heads' scores, D 64 activations
    assert forward_working_bytes(config, 5, context) == 4 * (2 * 128 + 5 * (2 * 4 * context
                                                                         + 16 * 64))

    assert main(["plan", str(tiny_gguf), "--host-mem", "1GiB", "--ctx", str(context),
                 "--step-tokens", "5", "--json"]) == 0
    import json

    doc = json.loads(capsys.readouterr().out)
    assert doc["moeswap"]["working_bytes"] == working
    assert doc["kv_cache"]["moeswap_charge_bytes"] == kv_cache_bytes(config, context, 1, 5, "f16")
    assert doc["moeswap"]["command"][-2:] == ["--step-tokens", "5"]


def test_chat_prefills_a_turn_in_chunks(tmp_path, monkeypatch):
    from gguf import GGUFValueType as T

    from gguf_builders import mixtral

    with pytest.raises(MoeswapError, match="--step-tokens must be >= 1, got 0"):
        ChatOptions(step_tokens=0)
    spec = mixtral()
    spec.kv["tokenizer.chat_template"] = (
        "{{ bos_token }}{% for m in messages %}{{ m['role'][0] }}{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}a{% endif %}", T.STRING)
    path = spec.write(tmp_path / "tiny.gguf")
    rt = moeswap.load(path, threads=1, tokenizer_cache_dir=tmp_path / "cache")
    resident = rt.model
    replies, calls = [], []
    for step in (512, 2):
        model = CountingModel(resident)
        monkeypatch.setattr(rt, "model", model)
        session = ChatSession(rt, ChatOptions(max_tokens=4, step_tokens=step), GREEDY)
        out = io.StringIO()
        session.turn("abcab", out)
        replies.append(out.getvalue())
        calls.append(model.calls)
    n = sum(calls[0][0])  # the turn's prompt, in one forward at 512
    assert calls[0][0] == [n] and n > 2
    assert calls[1][:(n + 1) // 2] == [[2]] * (n // 2) + [[1]] * (n % 2)
    assert replies[1] == replies[0]
