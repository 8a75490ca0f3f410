"""The ``decay`` policy: hits worked out by hand, its fit made out of sample, its profile round
trip, its name in the simulator and the store (logits exact), and the gap suite's report."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tiny_models
import torch

from moeswap.cli import main
from moeswap.errors import MoeswapError
from moeswap.routing.decay import (
    HALF_LIVES,
    PRIOR_WEIGHTS,
    DecayAdmit,
    DecayFit,
    decay_factory,
    fit_decay,
    head,
    popularity_prior,
)
from moeswap.routing.policy_specs import live_policy, simulate_grid
from moeswap.routing.profile import Profile, build_profile, halves, scored_capacities
from moeswap.routing.simulate import simulate
from moeswap.routing.stats import popularity
from moeswap.routing.traces import RoutingTrace

FOREVER = 1e9  # a half-life so long that scores are use counts (less a hair for age)


def replay(policy, keys):
    return [policy.access(key) for key in keys]


def test_admission_keeps_the_frequent_pair_and_lets_a_rare_one_bypass():
    steps = replay(DecayAdmit(2, 1, FOREVER), "ababccdcaca")
    # t0 a, t1 b fill the slots; t2 a, t3 b hit (2 uses each); t4 c (1 use) scores below its
    # victim a (2 uses, the oldest): bypass; t5 c has 2 uses, newer than a's: admitted, a out;
    # t6 d (1 use) bypasses (b, c: 2); t7 c hits (3); t8 a (3 uses) beats b (2): a in, b out;
    # t9 c, t10 a hit.
    assert [s.hit for s in steps] == [False, False, True, True, False, False, False, True,
                                      False, True, True]
    assert [s.admitted for s in steps if not s.hit] == [True, True, False, True, False, True]
    assert [s.evicted for s in steps if s.admitted] == [None, None, "a", "b"]


def test_a_short_half_life_forgets_and_a_long_one_remembers():
    # half-life 1 token: a's two uses are worth 0.5 + 1 = 1.5 at t1 and 0.75 at t2, below b's
    # 1: b is admitted and hits at t3. Remembered (half-life FOREVER), a's 2 uses keep b out at
    # t2; at t3 b's 2 uses are newer than a's 2, so b comes in then.
    forgetful = [s.hit for s in replay(DecayAdmit(1, 1, 1.0), "aabb")]
    remembering = replay(DecayAdmit(1, 1, FOREVER), "aabb")
    assert forgetful == [False, True, False, True]
    assert [s.hit for s in remembering] == [False, True, False, False]
    assert [s.admitted for s in remembering] == [True, False, False, True]


def test_the_clock_counts_tokens_of_k_requests():
    # half-life 1 token, one slot, "aaab". k=2: "aa" is token 0 (a = 2 uses, undecayed), "ab"
    # token 1 (a = 2 x 0.5 + 1 = 2): b (1) bypasses. k=1: four tokens, a = 1.75 at t2 and
    # 0.875 at t3, below b's 1: b is admitted.
    assert not replay(DecayAdmit(1, 2, 1.0), "aaab")[-1].admitted
    assert replay(DecayAdmit(1, 1, 1.0), "aaab")[-1].evicted == "a"


def test_the_prior_credits_popular_experts():
    prior = {"a": 5.0, "b": 0.0}.__getitem__
    steps = replay(DecayAdmit(1, 1, FOREVER, prior), "a" + "b" * 7)
    # a: 1 use + 5 of prior; b's 6th use ties that count but its uses are older on the whole,
    # so b gets in at its 7th request
    assert [s.admitted for s in steps] == [True] + [False] * 6 + [True]
    assert popularity_prior([[3, 1], [0, 0]], 0.5).tolist() == [[0.75, 0.25], [0.0, 0.0]]


def test_capacity_zero_bypasses_everything():
    assert [s.admitted for s in replay(DecayAdmit(0, 1, 16.0), "aa")] == [False, False]
    with pytest.raises(ValueError, match="half_life"):
        DecayAdmit(1, 1, 0.0)


def synthetic_trace(tokens: int = 240, prompts: int = 4, experts: int = 8, k: int = 2,
                    seed: int = 0) -> RoutingTrace:
    """Sticky routing: each token keeps its layer's previous pair with probability 0.6."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((tokens, 2, k), dtype=np.int16)  # [T, L, k]
    for t in range(tokens):
        for layer in range(2):
            skewed = rng.choice(experts, k, replace=False, p=np.arange(experts, 0, -1) / (experts * (experts + 1) / 2))
            ids[t, layer] = ids[t - 1, layer] if t and rng.random() < 0.6 else skewed
    return RoutingTrace(model="m", arch="mixtral", layers=np.array([0, 1]), n_experts=experts, k=k,
                        prompt_offsets=np.linspace(0, tokens, prompts + 1).astype(np.int64),
                        expert_ids=ids, weights=np.full(ids.shape, np.nan, dtype=np.float32))


def test_the_fit_is_the_candidate_with_most_hits_on_the_other_half():
    trace = synthetic_trace()
    learn, score = halves(trace)
    caps = [3, 5]
    fit = fit_decay(learn, score, caps)
    counts = popularity(learn)  # the prior comes from the learning half only

    def hits(candidate):
        return sum(int(simulate(score, "d", decay_factory(candidate, counts), c, "per-layer").hits.sum())
                   for c in caps)

    candidates = [DecayFit(h, w) for h in HALF_LIVES for w in PRIOR_WEIGHTS]
    assert hits(fit) == max(map(hits, candidates))
    assert fit == next(c for c in candidates if hits(c) == hits(fit))  # ties: the earlier one
    assert head(score, 10).n_tokens == 10 and head(score, 10**6) is score
    assert fit_decay(learn, score, []) == DecayFit()


def test_the_profile_keeps_the_fit_and_the_simulator_uses_it(tmp_path):
    trace = synthetic_trace()
    profile = build_profile(trace, budget=0, per_layer=True)
    expected = fit_decay(*halves(trace), scored_capacities(trace.k, trace.n_experts)[::2])
    assert profile.decay == expected
    profile.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json").decay == expected
    doc = json.loads((tmp_path / "p.json").read_text())
    del doc["decay"]  # a profile from before the decay policy: an untrained decay
    (tmp_path / "old.json").write_text(json.dumps(doc))
    assert Profile.load(tmp_path / "old.json").decay == DecayFit()
    for damaged in ([16], {"half_life": 0}, {"half_life": 16, "prior_weight": -1}, {"window": 3}):
        (tmp_path / "bad.json").write_text(json.dumps({**doc, "decay": damaged}))
        with pytest.raises(MoeswapError, match="damaged profile"):
            Profile.load(tmp_path / "bad.json")
    other = synthetic_trace(seed=1)
    by_name = [int(r.hits.sum()) for r in simulate_grid(other, [f"decay:{tmp_path / 'p.json'}"], [3, 4],
                                                          "per-layer")]
    factory = decay_factory(expected, profile.counts)
    assert by_name == [int(simulate(other, "d", factory, c, "per-layer").hits.sum()) for c in (3, 4)]
    plain = [int(r.hits.sum()) for r in simulate_grid(other, ["decay"], [3], "global")]
    assert plain == [int(simulate(other, "d", decay_factory(DecayFit(), None), 3, "global").hits.sum())]


def test_the_live_policy_keys_the_prior_by_model_block(tmp_path):
    trace = synthetic_trace()
    trace.layers = np.array([1, 3], dtype=np.int32)  # MoE blocks 1 and 3
    profile = build_profile(trace, budget=0, per_layer=True)
    profile.decay = DecayFit(16.0, 0.5)
    profile.save(tmp_path / "p.json")
    policy = live_policy(f"decay:{tmp_path / 'p.json'}", 4, 2, [1, 3], 8, "m.gguf")
    prior = popularity_prior(profile.counts, 0.5)
    assert isinstance(policy, DecayAdmit)
    assert policy.prior_of((3, 2)) == pytest.approx(prior[1, 2])
    assert isinstance(live_policy("decay", 4, 2, [1, 3], 8, "m.gguf"), DecayAdmit)


def test_decay_in_the_store_gives_the_logits_of_lru_and_of_the_resident_model(tmp_path):
    from test_expert_store import decode_logits, plan, store_model

    from moeswap.gguf_tools.convert import convert
    from moeswap.models import load_model
    from moeswap.models.quant_experts import QuantResidentExperts

    folder = tmp_path / "m"
    tiny_models.save("deepseek2", folder / "hf")
    path = convert(folder / "hf", folder / "model.q8_0.gguf", "q8_0")
    _, _, layers, n_experts = plan(path)
    Profile("tiny", "deepseek2", layers, n_experts, 3, 0, [], [list(range(n_experts))] * len(layers),
            build_profile(synthetic_trace(), 0, True).reuse, "test",
            DecayFit(64.0, 0.5)).save(tmp_path / "profile.json")
    expected = decode_logits(load_model(path, threads=1, expert_runner=QuantResidentExperts))
    lru_model, _ = store_model(path, 3, policy="lru")
    assert torch.equal(decode_logits(lru_model), expected)
    for spec in ("decay", f"decay:{tmp_path / 'profile.json'}"):
        model, factory = store_model(path, 3, policy=spec)
        assert isinstance(factory.store.residency.policies["host"], DecayAdmit)
        assert torch.equal(decode_logits(model), expected), spec
        total = factory.stats()["total"]
        # misses beyond the 3 first fills and the evictions bypassed the cache
        assert total["disk_misses"] > 3 + total["host_evictions"] > 3, total


def test_gap_suite_reports_the_primary_halves_and_says_what_it_skipped(tmp_path, capsys):
    trace = synthetic_trace(tokens=120)
    trace.save(tmp_path / "primary.npz")
    out = tmp_path / "out"
    assert main(["bench", "--suite", "gap", "--primary", str(tmp_path / "primary.npz"),
                 "--traces", str(tmp_path / "nowhere"), "-o", str(out)]) == 0
    body = json.loads((out / "report.json").read_text())
    pairs = body["pairs"]
    assert [p["capacities"] for p in pairs] == [[3, 4], [3, 4]]
    assert "real traces skipped" in body["skipped"]
    for pair in pairs:
        for c in map(str, pair["capacities"]):
            lru, belady, decay = (pair["hits"][p][c] for p in ("lru", "belady", "decay"))
            assert pair["gap_closed"][c]["decay"] == pytest.approx((decay - lru) / (belady - lru))
    text = (out / "report.md").read_text()
    assert "| gap closed: decay |" in text and "| decay | " in text
