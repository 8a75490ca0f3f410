"""Importers from routing traces recorded elsewhere into a ``RoutingTrace``.

Three sources, each one function (docs/TRACES.md describes their layouts):
- JSON lines, one row per (problem, layer, token), as recorded from Mixtral-8x7B under vLLM;
- the Switch Transformer router trace ``router-trace.v2.json`` (``selections[token][layer][k]``);
- a generic CSV ``phase,n_tokens,layer,token_idx,e0..e{k-1}`` in evaluation order.
"""

from __future__ import annotations

import csv
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from moeswap.errors import MoeswapError
from moeswap.routing.traces import PHASES, RoutingTrace, TraceBuilder


def import_trace(path: str | Path, *, model: str | None = None, arch: str | None = None,
                 n_experts: int | None = None) -> RoutingTrace:
    """Import a trace, choosing the reader by file name; model/arch/n_experts override what the file implies."""
    path = Path(path)
    if not path.is_file():
        raise MoeswapError(f"{path}: no such file; give a .jsonl, router-trace .json or .csv trace")
    readers = {".jsonl": read_expert_jsonl, ".json": read_switch_json, ".csv": read_routing_csv}
    reader = readers.get(path.suffix.lower())
    if reader is None:
        raise MoeswapError(f"{path}: unknown trace type {path.suffix!r}; expected one of {sorted(readers)}")
    return reader(path, model=model, arch=arch, n_experts=n_experts)


def _expert_count(path: Path, largest_id: int, n_experts: int | None) -> int:
    if n_experts is None:
        return largest_id + 1
    if largest_id >= n_experts:
        raise MoeswapError(f"{path}: expert id {largest_id} does not fit --experts {n_experts}")
    return n_experts


def read_expert_jsonl(path: Path, *, model=None, arch=None, n_experts=None) -> RoutingTrace:
    """Rows ``{"dataset", "problem_id", "layer", "token_idx", "experts": [..k], "gating_probs": [..k]}``.

    Each (dataset, problem_id) becomes one prompt, in order of first appearance. Tokens are
    aligned across layers by ``token_idx`` (in the Mixtral capture that alignment is only
    approximate: a few tokens were dropped per layer and the rest renumbered); a prompt is
    as long as its longest layer and the missing positions stay unrecorded.
    """
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                rows.append(((row["dataset"], row["problem_id"]), int(row["layer"]), int(row["token_idx"]),
                             [int(e) for e in row["experts"]], [float(p) for p in row["gating_probs"]]))
            except (ValueError, KeyError, TypeError) as e:
                raise MoeswapError(f"{path}:{line_no}: not a routing row ({e!r}); expected dataset, "
                                   "problem_id, layer, token_idx, experts, gating_probs") from None
    if not rows:
        raise MoeswapError(f"{path}: no routing rows")
    ks = {len(r[3]) for r in rows}
    if len(ks) != 1:
        raise MoeswapError(f"{path}: rows choose different numbers of experts {sorted(ks)}")
    largest = max(max(r[3]) for r in rows)
    builder = TraceBuilder(
        model=model or "mistralai/Mixtral-8x7B-Instruct-v0.1", arch=arch or "llama",
        layers=range(max(r[1] for r in rows) + 1), n_experts=_expert_count(path, largest, n_experts),
        k=ks.pop(), source=f"imported from {path.name}",
    )
    by_prompt = defaultdict(list)
    for prompt, layer, token_idx, experts, probs in rows:
        by_prompt[prompt].append((layer, token_idx, experts, probs))
    for (dataset, problem), prompt_rows in by_prompt.items():
        builder.begin_prompt(f"{dataset}-{problem}")
        for layer, token_idx, experts, probs in prompt_rows:
            builder.append(layer, token_idx, [experts], [probs])
    return builder.build()


def read_switch_json(path: Path, *, model=None, arch=None, n_experts=None) -> RoutingTrace:
    """``router-trace.v2.json``: ``selections[token][layer][k]``, tokens of all prompts concatenated.

    Prompt spans and the sparse blocks' indices come from ``capture-metadata.json`` beside it
    when present; otherwise the whole trace is one prompt and layers are numbered 0..L-1.
    """
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        selections = np.asarray(doc["selections"], dtype=np.int64)  # [T, L, k]
    except (ValueError, KeyError, TypeError) as e:
        raise MoeswapError(f"{path}: not a router-trace JSON ({e!r}); expected selections[token][layer][k]") from None
    if selections.ndim != 3:
        raise MoeswapError(f"{path}: selections must be [token][layer][k], got shape {selections.shape}")
    T, L, k = selections.shape
    layers, offsets, names = list(range(L)), [0, T], ["prompt-0"]
    meta_path = path.with_name("capture-metadata.json")
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        layers = meta.get("sparse_encoder_block_indices", layers)
        spans = meta.get("prompt_spans", [])
        if spans:
            offsets = [spans[0]["token_start"]] + [s["token_end_exclusive"] for s in spans]
            names = [s["id"] for s in spans]
    if offsets[0] != 0 or offsets[-1] != T or len(layers) != L:
        raise MoeswapError(f"{meta_path}: prompt spans {offsets} or blocks {layers} do not fit the trace's "
                           f"{T} tokens and {L} layers; remove or fix the metadata file")
    experts = _expert_count(path, int(selections.max()), n_experts or doc.get("expertsPerLayer"))
    model_id = doc.get("source", {}).get("model", {}).get("id", "google/switch-base-8")
    return RoutingTrace(
        model=model or model_id, arch=arch or "switch_transformers", layers=layers, n_experts=experts, k=k,
        prompt_offsets=offsets, expert_ids=selections, weights=np.full(selections.shape, np.nan),
        prompt_names=names, source=f"imported from {path.name}",
    )


CSV_FIXED_COLUMNS = ["phase", "n_tokens", "layer", "token_idx"]


def read_routing_csv(path: Path, *, model=None, arch=None, n_experts=None) -> RoutingTrace:
    """Rows ``phase,n_tokens,layer,token_idx,e0..e{k-1}`` in the order the model evaluated them,
    under a header of those names (a leading ``# `` on it is accepted).

    One evaluation batch holds ``n_tokens`` tokens and ``token_idx`` is a token's place in
    it. A batch ends when a (layer, token_idx) repeats or phase / n_tokens change; the next
    batch's tokens follow the previous ones. A prefill batch after a decode batch starts a
    new prompt. The file must describe one sequence: batches that mix sequences cannot be
    told apart from consecutive tokens.
    """
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = [h.strip() for h in next(reader, [])]
        if header and header[0].startswith("#"):  # many tools write "# phase,n_tokens,..."
            header[0] = header[0].lstrip("#").strip()
        k = len(header) - len(CSV_FIXED_COLUMNS)
        if header[:4] != CSV_FIXED_COLUMNS or k < 1 or header[4:] != [f"e{i}" for i in range(k)]:
            raise MoeswapError(f"{path}: header {header} is not phase,n_tokens,layer,token_idx,e0..e<k-1>")
        records = []
        for line_no, row in enumerate(reader, 2):
            try:
                phase, n_tok, layer, tok, *experts = (c.strip() for c in row)
                if phase not in PHASES or len(experts) != k:
                    raise ValueError(f"phase must be one of {PHASES} and {k} expert columns follow")
                records.append((phase, int(n_tok), int(layer), int(tok), [int(e) for e in experts]))
            except ValueError as e:
                raise MoeswapError(f"{path}:{line_no}: bad row {row}: {e}") from None
    if not records:
        raise MoeswapError(f"{path}: no routing rows after the header")
    builder = TraceBuilder(
        model=model or path.stem, arch=arch or "unknown", layers=sorted({r[2] for r in records}),
        n_experts=_expert_count(path, max(max(r[4]) for r in records), n_experts), k=k,
        source=f"imported from {path.name}",
    )
    batch_start, batch_key, seen, prompt_phase, batch = 0, None, set(), None, -1
    for phase, n_tok, layer, tok, experts in records:
        if not 0 <= tok < n_tok:
            raise MoeswapError(f"{path}: token_idx {tok} outside its batch of n_tokens {n_tok}")
        if (phase, n_tok) != batch_key or (layer, tok) in seen:
            if batch_key is not None:
                batch_start += batch_key[1]
            if prompt_phase is None or (phase == "prefill" and prompt_phase == "decode"):
                builder.begin_prompt()
                batch_start = 0
            batch_key, seen, prompt_phase, batch = (phase, n_tok), set(), phase, batch + 1
        seen.add((layer, tok))
        # each batch was one forward pass: kept, so a replay can request as a batched engine does
        builder.append(layer, batch_start + tok, [experts], [[np.nan] * k], phase=phase,
                       forward=batch)
    return builder.build()
