"""The expert store: routed experts kept in tiers under byte budgets, behind ``run``.

Residency (moeswap.experts.residency) decides which tier holds each expert and where its bytes
are; prefetch (moeswap.experts.lookahead) reads the next layers' likely experts ahead. This
module computes. A layer step's hits (experts whose bytes are held: device or host slot, or a
prefetched guess) are served first, and the hits of each slot pool run as one fused ggml graph
(moeswap.quant.moe_graph) over a view of the pool whose expert i is slot i. Then each miss runs
as its own graph as soon as its bytes are in (a later read may reuse its staging slot).

A step is a whole forward's tokens for the layer (a prefill chunk of up to ``--step-tokens``),
not one piece of it: each expert the step needs is served once, so a miss is read once however
many pieces of MAX_TOKENS_PER_CALL tokens pick it, and its picks are then computed piece by
piece (``picks_by_piece``), on the token groups the resident runner's pieces make.

Every pick goes through the resident runner's graph on the same token groups (ggml's
``mul_mat_id`` groups an expert's tokens wherever its bytes lie), and the picks' weighted rows
are summed in the graph's order, so logits are bit-identical to the fully resident model at any
budget and with any policy (docs/OFFLOAD.md). ``threshold`` (``--expert-threshold``) is an
opt-in approximation: picks with a routing weight under it are dropped and the rest rescaled,
and it is counted.
``miss_lowbit`` (``--miss-lowbit``) is the other: misses no tier admits are computed from
low-bit copies held in RAM instead of read from the file (moeswap.experts.lowbit); counted.

Legend: N tokens of a step, K picks per token, D model width, F expert width, P picks.
"""

from __future__ import annotations

import torch

from moeswap.experts.cost import Rates
from moeswap.experts.lookahead import Lookahead
from moeswap.experts.residency import Residency
from moeswap.experts.settings import OffloadSettings
from moeswap.experts.stats import LayerStats, total
from moeswap.experts.step_reads import FRONT, REST
from moeswap.experts.tiers import check_inside_file, piece_offsets, slot_bytes, slot_pieces
from moeswap.formats.config import config_from_gguf
from moeswap.formats.gguf_file import GGUFFile
from moeswap.formats.gguf_moe import MoEView
from moeswap.memory import HostCharge
from moeswap.models.quant_experts import (GLUS, ExpertLayout, combine, group_picks,
                                          per_matrix_step, picks_by_piece)
from moeswap.quant import CpuKernels
from moeswap.quant.moe_graph import MoeFfn, pool_stacks


def routed_bytes(gguf: GGUFFile, layers: list[int]) -> int:
    layouts = [ExpertLayout.from_file(gguf, i) for i in layers]
    return sum(layout.expert_bytes * layout.n_experts for layout in layouts)


def shared_bytes(gguf: GGUFFile, layers: list[int]) -> int:
    """Bytes of every tensor the model runs that is not a routed expert: they stay in fast
    memory (MTP layers, which the model does not run, are left out: gguf_moe.MoEView)."""
    run = MoEView(gguf, config_from_gguf(gguf).n_layer).tensors
    return sum(t.n_bytes for t in run) - routed_bytes(gguf, layers)


class ExpertStore:
    def __init__(self, gguf: GGUFFile, kernels: CpuKernels, layers: list[int], activation: str,
                 settings: OffloadSettings, charge: HostCharge = HostCharge(),
                 rates: Rates | None = None, routers: dict | None = None):
        """charge: what the host budget pays besides host-tier experts (moeswap.memory);
        rates: measured rates for the cost model (None: a CPU-only machine's);
        routers: MoE layer -> its Router (moeswap.models.moe), which the gate prefetch
        predictor applies ahead of time; needed for ``prefetch`` gate and both."""
        self.kernels, self.activation, self.settings = kernels, activation, settings
        self.layouts = {i: ExpertLayout.from_file(gguf, i) for i in layers}
        check_inside_file(gguf.piece_paths, list(self.layouts.values()))
        self.slot_size = slot_bytes(list(self.layouts.values()))
        config = config_from_gguf(gguf)
        self.residency = Residency(gguf, config, self.layouts, self.slot_size,
                                   shared_bytes(gguf, layers), settings, charge, rates)
        self.layer_stats = self.residency.layer_stats
        self.lookahead = (Lookahead(self.residency, settings, routers or {},
                                    config.n_expert_used)
                          if self.residency.prefetching else None)
        self._pool_ffn: dict[tuple[str, int], MoeFfn] = {}  # (pool, layout) -> its graphs
        self._layer_ffn: dict[tuple[int, str], MoeFfn] = {}  # (layer, pool) -> the same
        self.residency.prefill_policies()

    def run(self, layer: int, x: torch.Tensor, ids: torch.Tensor,
            weights: torch.Tensor) -> torch.Tensor:
        """x [N, D], ids/weights [N, K] -> [N, D]: one step, each expert it needs served once;
        the hits' graphs, then each miss's."""
        if self.lookahead is not None:
            self.lookahead.before_step(layer, x, ids)
        layout, stats = self.layouts[layer], self.layer_stats[layer]
        keep = None
        if self.settings.threshold > 0:
            weights, keep = self._threshold(layout, ids, weights, stats)
        groups = [(e, picks if keep is None else picks[keep[picks]])
                  for e, picks in group_picks(ids)]
        groups = [(e, picks) for e, picks in groups if picks.numel()]
        if not groups:  # every pick dropped: cannot happen, a token's top pick is always kept
            return torch.zeros_like(x)
        r = self.residency
        r.step.start(layer, [e for e, _ in groups])
        if r.pools["device"].n_slots:  # the cost model chooses only where a transfer can go
            r.planner.start_step([(layout.expert_bytes, picks.numel()) for e, picks in groups
                                  if (layer, e) not in r.policies["device"]])
        step, picks_of = _Step(x, ids, weights), dict(groups)
        requests = [(e, picks.numel()) for e, picks in groups]
        if r.step.split:
            self._in_halves(layer, requests, picks_of, step, stats)
        else:
            self._whole(layer, requests, picks_of, step, stats)
        return combine(step.picked.view(*ids.shape, -1))

    def _whole(self, layer: int, requests: list[tuple[int, int]],
               picks_of: dict[int, torch.Tensor], step: _Step, stats: LayerStats) -> None:
        """Each expert's whole feed-forward once its bytes are in: the hits together, one graph
        per pool, as soon as the last of them is served (before any miss's read is waited
        for); then each miss as it lands, its activation once its front is in (while its down
        matrix is read) and the rest when that lands. Without overlap (device slots) each
        expert is computed as it is served: a later one may take the slot an earlier one used."""
        r = self.residency
        hits = {e for e, _ in requests if r.ready((layer, e))} if r.overlapped else set()
        batch: list[tuple[int, tuple[str, int]]] = []
        hidden: dict[int, list[torch.Tensor]] = {}  # a miss whose front is in -> its activations
        for expert, place, stage in r.step.first_pass(requests, stats):
            if stage == FRONT:
                hidden[expert] = self._hidden(layer, place, picks_of[expert], step)
                continue
            if expert in hits:
                batch.append((expert, place))
                hits.discard(expert)
                if hits:
                    continue
            else:  # one evicted meanwhile (more experts than slots) is read again
                place = r.still_held((layer, expert), place, stats)
                if stage == REST:
                    self._finish(layer, place, picks_of[expert], hidden.pop(expert), step)
                else:
                    self._compute(layer, place[0], [(place[1], picks_of[expert])], step)
            self._compute_hits(layer, batch, picks_of, step, stats)
            batch = []
        self._compute_hits(layer, batch, picks_of, step, stats)

    def _compute_hits(self, layer: int, batch: list[tuple[int, tuple[str, int]]],
                      picks_of: dict[int, torch.Tensor], step: _Step,
                      stats: LayerStats) -> None:
        """The batched hits, one graph per pool; one evicted meanwhile (budgets smaller than a
        step's experts) is fetched again and computed alone."""
        by_pool: dict[str, list[tuple[int, torch.Tensor]]] = {}
        for expert, place in batch:
            now = self.residency.still_held((layer, expert), place, stats)
            if now != place:
                self._compute(layer, now[0], [(now[1], picks_of[expert])], step)
            else:
                by_pool.setdefault(place[0], []).append((place[1], picks_of[expert]))
        for pool, entries in by_pool.items():
            self._compute(layer, pool, entries, step)

    def _in_halves(self, layer: int, requests: list[tuple[int, int]],
                   picks_of: dict[int, torch.Tensor], step: _Step, stats: LayerStats) -> None:
        """A step whose misses stream through the staging ring, down matrices last
        (moeswap.experts.step_reads): each expert's graph cut at the activation, gate/up in
        the first pass, down in the second; the same bits as one graph."""
        r, hidden, places = self.residency, {}, {}
        for expert, place, _ in r.step.first_pass(requests, stats):  # whole: the step streams
            # one evicted meanwhile (more experts than slots) is read again
            places[expert] = place = r.still_held((layer, expert), place, stats)
            hidden[expert] = self._hidden(layer, place, picks_of[expert], step)
        for expert, place in r.step.second_pass(places, stats):
            self._finish(layer, place, picks_of[expert], hidden.pop(expert), step)

    def _hidden(self, layer: int, place: tuple[str, int], picks: torch.Tensor,
                step: _Step) -> list[torch.Tensor]:
        """The first half of an expert's graph: its picks' activations, [p, 1, F] a piece."""
        ffn = self._ffn(layer, place[0])
        return [ffn.hidden(step.rows(piece), _slots(piece, place[1]))
                for piece in step.pieces(picks)]

    def _finish(self, layer: int, place: tuple[str, int], picks: torch.Tensor,
                hidden: list[torch.Tensor], step: _Step) -> None:
        """The second half: the down products of ``_hidden``'s activations, weighted, written
        into ``step.picked``."""
        ffn, weights = self._ffn(layer, place[0]), step.weights.reshape(-1)  # [N*K]
        for piece, h in zip(step.pieces(picks), hidden):
            step.picked[piece] = ffn.finish(h, _slots(piece, place[1]), weights[piece, None])

    def _compute(self, layer: int, pool: str, entries: list[tuple[int, torch.Tensor]],
                 step: _Step) -> None:
        """The picks of experts held in ``pool`` (entries: slot, picks as indices into N*K), as
        one graph a piece (torch device slots: each expert's picks of the step at once) -> their
        weighted rows, written into ``step.picked``."""
        picks = (entries[0][1] if len(entries) == 1  # [P], tokens ascending
                 else torch.cat([p for _, p in entries]).sort().values)
        if pool == "device" and self.residency.on_torch_device:  # torch: no ggml token groups
            step.picked[picks] = self._device_rows(layer, entries, step.rows(picks),
                                                   step.weights.flatten()[picks, None], picks)
            return
        # one expert (a miss): every pick's slot is its own, no table of them to build
        slot_of = None if len(entries) == 1 else _slot_table(entries, step.ids.numel())
        ffn, weights = self._ffn(layer, pool), step.weights.reshape(-1)  # [N*K]
        for piece in step.pieces(picks):
            slots = _slots(piece, entries[0][0]) if slot_of is None else slot_of[piece, None]
            step.picked[piece] = ffn.run(step.rows(piece), slots, weights[piece, None])

    def _ffn(self, layer: int, pool: str) -> MoeFfn:
        """The fused graphs over ``pool``'s slots holding this layer's layout; one per layout
        (looked up by layer too: a miss's compute waits on it)."""
        if (layer, pool) not in self._layer_ffn:
            self._layer_ffn[layer, pool] = self._layout_ffn(layer, pool)
        return self._layer_ffn[layer, pool]

    def _layout_ffn(self, layer: int, pool: str) -> MoeFfn:
        r = self.residency
        layout = (r.lowbit if pool == "lowbit" else self).layouts[layer]
        names = tuple((q.name.split(".", 2)[2], q.ggml_type, q.ne) for q in layout.parts)
        key = (pool, hash((names, tuple(piece_offsets(layout)))))  # offsets follow file blocks
        if key not in self._pool_ffn:
            slots = r.pool(pool)
            pieces = [(kind, part.ggml_type, part.ne, offset) for (kind, part, _), offset
                      in zip(slot_pieces(layout, slots.slot(0)), piece_offsets(layout))]
            self._pool_ffn[key] = MoeFfn(
                self.kernels, pool_stacks(self.kernels, slots.buffer, slots.slot_size, pieces),
                GLUS[self.activation])
        return self._pool_ffn[key]

    def _device_rows(self, layer: int, entries: list[tuple[int, torch.Tensor]],
                     rows: torch.Tensor, weights: torch.Tensor,
                     picks: torch.Tensor) -> torch.Tensor:
        """Weighted rows [P, D] of picks whose experts are in torch device slots: the per-matrix
        path, one expert at a time (the device tier computes with torch)."""
        out = rows.new_empty(rows.shape[0], self.layouts[layer].matrices["down"].out_features)
        for index, p in entries:
            expert = self.residency.pools["device"].expert(index, self.layouts[layer])
            mine = torch.isin(picks, p)  # [P] this expert's picks
            n = int(mine.sum())
            vectors = {kind: v.float().expand(n, -1) for kind, v in expert.biases.items()}
            out[mine] = per_matrix_step(
                lambda kind, x, ids, expert=expert, n=n: expert.matrices[kind].matmul(
                    x.reshape(n, -1), ids),
                vectors, self.activation, self.layouts[layer].fused, rows[mine],
                torch.zeros(n, 1, dtype=torch.int32), weights[mine])
        return out

    def _threshold(self, layout: ExpertLayout, ids: torch.Tensor, weights: torch.Tensor,
                   stats: LayerStats) -> tuple[torch.Tensor, torch.Tensor]:
        """Drop picks weighted under the threshold (never a token's top pick); rescale the rest
        to the original sum. -> (weights [N, K], kept [N*K] bool)."""
        keep = weights >= self.settings.threshold  # [N, K]
        keep[torch.arange(ids.shape[0]), weights.argmax(dim=1)] = True
        kept = torch.where(keep, weights, torch.zeros_like(weights))
        scaled = kept * (weights.sum(dim=1, keepdim=True) / kept.sum(dim=1, keepdim=True))
        dropped = int((~keep).sum())
        if dropped:
            stats.threshold_drops += dropped
            before = set(ids.flatten().tolist())
            after = set(ids[keep].tolist())
            stats.threshold_saved_bytes += len(before - after) * layout.expert_bytes
        return scaled, keep.flatten()

    def close(self) -> None:
        """Stop the reader threads (also done when the store is collected)."""
        self.residency.close_reads()

    def held_bytes(self) -> dict[str, int]:
        return self.residency.held_bytes()

    def resident_tiers(self) -> dict[tuple[int, int], str]:
        """(layer, expert) -> the tier whose slot holds it; experts not listed are on disk."""
        return {key: tier for tier in ("host", "device") for key in self.residency.slots[tier]}

    def stats(self) -> dict:
        r = self.residency
        return {
            "total": total(self.layer_stats).as_dict(),
            "layers": {i: s.as_dict() for i, s in self.layer_stats.items()},
            "tiers": {tier: {"budget_bytes": r.budgets[tier], "held_bytes": held,
                             "slots": r.pools[tier].n_slots, "slot_bytes": self.slot_size,
                             "experts_resident": len(r.slots[tier])}
                      for tier, held in r.held_bytes().items()},
            **{name: r.charge[name] for name in ("shared_bytes", "kv_bytes", "working_bytes")},
            # the link's own record: bytes read and the wall time any read ran (busy)
            "disk": {"bytes": r.disk.stats.bytes, "busy_seconds": r.disk.stats.seconds,
                     "reads": r.disk.stats.reads},
            **({"prefetch": self.lookahead.prefetch.as_dict()}
               if self.lookahead is not None else {}),
            **({"lowbit": r.lowbit.as_dict()} if r.lowbit is not None else {}),
        }


class _Step:
    """A layer step's inputs and the weighted output rows of its picks, filled pool by pool."""

    def __init__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
        self.x, self.ids, self.weights = x, ids, weights  # [N, D], [N, K], [N, K]
        self.picked = x.new_zeros(ids.numel(), x.shape[1])  # [N*K, D]

    def rows(self, picks: torch.Tensor) -> torch.Tensor:
        """picks [P] (indices into N*K) -> their tokens' rows [P, D]."""
        if self.x.shape[0] == 1:  # decode: every pick is the one token's (a view, no gather)
            return self.x.expand(picks.numel(), -1)
        return self.x[picks // self.ids.shape[1]]

    def pieces(self, picks: torch.Tensor) -> list[torch.Tensor]:
        """picks [P] ascending -> those of each piece of MAX_TOKENS_PER_CALL tokens."""
        return picks_by_piece(picks, self.ids.shape[1])


def _slot_table(entries: list[tuple[int, torch.Tensor]], n_picks: int) -> torch.Tensor:
    """entries (slot, picks) -> [N*K]: each pick's slot."""
    slot_of = torch.empty(n_picks, dtype=torch.int32)
    for index, picks in entries:
        slot_of[picks] = index
    return slot_of


def _slots(picks: torch.Tensor, index: int) -> torch.Tensor:
    """[P, 1]: every pick's expert in slot ``index``."""
    return torch.full((picks.numel(), 1), index, dtype=torch.int32)
