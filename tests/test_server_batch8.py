"""Issue 11's batching check on a quantized model: 8 concurrent greedy streaming requests to
the server, on a tiny Mixtral-layout Q8_0 model whose expert store holds fewer experts than
the model has. Teacher-forced, each request's argmax equals its solo run's wherever the solo
top-1/top-2 margin exceeds 0.1 (batching may change the order of sums, so near-ties may break
differently), and the store reads fewer expert bytes for the batch than for the same 8
requests one after another."""

from __future__ import annotations

import json
import threading

import torch
from fastapi.testclient import TestClient

import moeswap
import tiny_models
from moeswap.memory import HostCharge
from moeswap.experts.store import shared_bytes
from moeswap.experts.build import build_store
from moeswap.experts.settings import OffloadSettings
from moeswap.experts.tiers import slot_bytes
from moeswap.formats.config import config_from_gguf
from moeswap.formats.gguf_file import GGUFFile
from moeswap.models.quant_experts import ExpertLayout
from moeswap.server.app import ServerOptions, create_app
from moeswap.server.batching import BatchOptions
from test_server import LOCAL, WrappedRuntime, one_thread  # noqa: F401 (fixture)

N_REQUESTS, MAX_TOKENS, CTX, MARGIN = 8, 12, 48, 0.1
# Host-tier experts, of 2 layers x 8. With 5, one request's working set fits and a batch's
# does not: the batch then reads more (docs/SERVER.md, "Batching").
EXPERT_SLOTS = 3
CHARGE = HostCharge.for_sequence(CTX * N_REQUESTS)  # every request's cache at once


def host_budget(path) -> tuple[int, int]:
    """(a host budget with room for EXPERT_SLOTS experts beside the shared weights, staging and
    every slot's KV cache, the bytes that would hold all experts)."""
    gguf = GGUFFile.open(path)
    config = config_from_gguf(gguf)
    layouts = [ExpertLayout.from_file(gguf, i) for i in config.moe_layers]
    slot = slot_bytes(layouts)
    fixed = CHARGE.bytes(config, shared_bytes(gguf, config.moe_layers),
                         config.n_expert_used * slot)
    return fixed + EXPERT_SLOTS * slot, fixed + sum(lay.n_experts for lay in layouts) * slot


class RecordingModel:
    """The model, recording each request's last-row logits per step, by its prompt (the
    tokens its cache first saw)."""

    def __init__(self, model):
        self.model = model
        self.rows: dict[tuple[int, ...], list[torch.Tensor]] = {}
        self.batch_sizes: list[int] = []
        self._prompts: dict[int, tuple[int, ...]] = {}  # id(cache) -> prompt
        self._caches = []  # kept alive, so that no two caches share an id

    def new_cache(self):
        cache = self.model.new_cache()
        self._caches.append(cache)
        return cache

    def forward(self, tokens, caches, last_only=False):
        self.batch_sizes.append(len(tokens))
        logits = self.model.forward(tokens, caches, last_only)
        for fed, cache, rows in zip(tokens, caches, logits):
            prompt = self._prompts.setdefault(id(cache), tuple(fed.tolist()))
            self.rows.setdefault(prompt, []).append(rows[-1].clone())
        return logits


def prompts() -> list[list[int]]:
    """Different lengths, so that every prompt is different."""
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, tiny_models.VOCAB, (3 + i,), generator=g).tolist()
            for i in range(N_REQUESTS)]


def stream_text(client, prompt_ids: list[int]) -> str:
    with client.stream("POST", "/v1/completions", json={
            "model": "tiny", "prompt": prompt_ids, "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return "".join(json.loads(line[len("data: "):])["choices"][0]["text"] for line in lines[:-1])


def serve(path, host: int, together: bool):
    """Stream the 8 requests, all at once or one after another, from a fresh store-backed
    server: (streamed texts, each request's recorded logit rows, batch sizes, disk bytes)."""
    factory = build_store(OffloadSettings(host_bytes=host), CHARGE)
    loaded = moeswap.load(path, threads=1, expert_runner=factory,
                          tokenizer_cache_dir=path.parent / "cache")
    runtime = WrappedRuntime(loaded, RecordingModel)
    ids = prompts()
    texts: dict[int, str] = {}
    batch = BatchOptions(max_batch=N_REQUESTS, queue_size=N_REQUESTS, ctx=CTX)
    with TestClient(create_app(runtime, ServerOptions("tiny", batch)), base_url=LOCAL) as client:
        if together:
            start = threading.Barrier(N_REQUESTS)

            def ask(i):
                start.wait()
                texts[i] = stream_text(client, ids[i])

            threads = [threading.Thread(target=ask, args=(i,)) for i in range(N_REQUESTS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        else:
            for i in range(N_REQUESTS):
                texts[i] = stream_text(client, ids[i])
    rows = [runtime.model.rows[tuple(p)] for p in ids]
    return texts, rows, runtime.model.batch_sizes, runtime.stats()["total"]["disk_bytes"]


def test_eight_concurrent_streams_match_solo_runs_and_share_expert_reads(mixtral_q8):
    host, all_experts = host_budget(mixtral_q8)
    assert host < all_experts  # the budget cannot hold every expert
    texts, rows, batch_sizes, batched_bytes = serve(mixtral_q8, host, together=True)
    _, _, sequential_sizes, sequential_bytes = serve(mixtral_q8, host, together=False)
    assert max(batch_sizes) >= N_REQUESTS // 2 and max(sequential_sizes) == 1
    assert 0 < batched_bytes < sequential_bytes

    solo = moeswap.load(mixtral_q8, threads=1, tokenizer_cache_dir=mixtral_q8.parent / "cache")
    checked = compared = 0
    for i, prompt in enumerate(prompts()):
        tokens = [int(r.argmax()) for r in rows[i]]  # greedy: what the batch chose
        # fewer than max_tokens rows: the last chose a stop token, which is not streamed
        emitted = tokens if len(tokens) == MAX_TOKENS else tokens[:-1]
        stream = solo.tokenizer.stream(prompt)
        assert "".join(stream.push(t) for t in emitted) == texts[i], i
        # teacher-forced solo run over the batch's tokens: the logits that predict each one
        logits = solo.model.forward([torch.tensor(prompt + tokens[:-1])],
                                    [solo.model.new_cache()])[0][len(prompt) - 1:]
        for position, (token, row) in enumerate(zip(tokens, logits)):
            top2 = row.topk(2).values
            compared += 1
            if top2[0] - top2[1] > MARGIN:
                checked += 1
                assert int(row.argmax()) == token, (i, position)
    assert checked >= compared // 2  # the margin left most positions to check
