"""The expert store: routed experts kept in tiers under byte budgets, behind ``run``.

Residency (moeswap.experts.residency) decides which tier holds each expert and where its bytes
are; prefetch (moeswap.experts.lookahead) reads the next layers' likely experts ahead. This
module computes: for every expert a layer step needs, in ascending id order, residency serves
its bytes and the store computes it at once, as a one-expert stack, on exactly the tokens that
picked it.

Every product goes through ggml's ``mul_mat_id`` on the same token groups as the resident
runner, so logits are bit-identical to the fully resident model at any budget and with any
policy (docs/OFFLOAD.md). ``threshold`` (``--expert-threshold``) is an opt-in approximation:
picks with a routing weight under it are dropped and the rest rescaled, and it is counted.
``miss_lowbit`` (``--miss-lowbit``) is the other: misses no tier admits are computed from
low-bit copies held in RAM instead of read from the file (moeswap.experts.lowbit); counted.

Legend: N tokens, T tokens of one piece, K picks per token, D model width, F expert width,
M picks of one expert.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

from moeswap.experts.cost import Rates
from moeswap.experts.lookahead import Lookahead
from moeswap.experts.residency import Residency
from moeswap.experts.settings import OffloadSettings
from moeswap.experts.stats import LayerStats, total
from moeswap.experts.tiers import check_inside_file, slot_bytes, slot_pieces
from moeswap.formats.config import config_from_gguf
from moeswap.formats.gguf_file import GGUFFile
from moeswap.formats.gguf_moe import MoEView
from moeswap.memory import HostCharge
from moeswap.models.quant_experts import (VECTOR_DTYPES, ExpertLayout, combine, group_picks,
                                          hidden, output, run_in_pieces)
from moeswap.quant import CpuKernels, QuantExperts


def routed_bytes(gguf: GGUFFile, layers: list[int]) -> int:
    layouts = [ExpertLayout.from_file(gguf, i) for i in layers]
    return sum(layout.expert_bytes * layout.n_experts for layout in layouts)


def shared_bytes(gguf: GGUFFile, layers: list[int]) -> int:
    """Bytes of every tensor the model runs that is not a routed expert: they stay in fast
    memory (MTP layers, which the model does not run, are left out: gguf_moe.MoEView)."""
    run = MoEView(gguf, config_from_gguf(gguf).n_layer).tensors
    return sum(t.n_bytes for t in run) - routed_bytes(gguf, layers)


class _Slot:
    """An expert's pieces bound in one slot: one-expert stacks and bias vectors (views)."""

    def __init__(self, kernels: CpuKernels, layout: ExpertLayout, slot: np.ndarray):
        self.matrices: dict[str, QuantExperts] = {}
        self.biases: dict[str, torch.Tensor] = {}
        for kind, part, raw in slot_pieces(layout, slot):
            if part.is_matrix:
                self.matrices[kind] = kernels.experts(raw, part.ggml_type, (*part.ne, 1), part.name)
            else:
                vector = torch.from_numpy(raw).view(VECTOR_DTYPES[part.ggml_type])
                self.biases[kind] = vector.view(-1)


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
        self._bound: dict[tuple[str, int, int], _Slot] = {}
        self.residency.prefill_policies()

    def run(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor,
            weights: torch.Tensor) -> torch.Tensor:
        """x [N, D], expert_ids/weights [N, K] -> [N, D]."""
        if self.lookahead is not None:
            self.lookahead.before_step(layer, x, expert_ids)
        return run_in_pieces(partial(self._piece, layer), x, expert_ids, weights)

    def _piece(self, layer: int, x: torch.Tensor, ids: torch.Tensor,
               weights: torch.Tensor) -> torch.Tensor:
        """x [T, D], ids/weights [T, K] -> [T, D].

        Two passes over the step's experts, as the resident runner's two products: gate/up for
        all, the activation on the whole [T*K, F] tensor, then down for all. An expert evicted
        between the passes (budgets smaller than one step's experts) is fetched again.
        """
        layout, stats, top_k = self.layouts[layer], self.layer_stats[layer], ids.shape[1]
        n_picks = ids.numel()
        keep = None
        if self.settings.threshold > 0:
            weights, keep = self._threshold(layout, ids, weights, stats)
        groups = [(e, picks if keep is None else picks[keep[picks]])
                  for e, picks in group_picks(ids)]
        groups = [(e, picks) for e, picks in groups if picks.numel()]
        r = self.residency
        r.step_keys = {(layer, e) for e, _ in groups}
        r.planner.start_step([(layout.expert_bytes, picks.numel()) for e, picks in groups
                              if (layer, e) not in r.policies["device"]])
        kinds = ("gate_up",) if layout.fused else ("gate", "up")
        firsts, vectors, places = {}, {}, {}
        for expert, picks in groups:
            stats.requests += 1
            places[expert] = r.serve(layer, expert, picks.numel(), stats)
            bound = self._bound_slot(*places[expert], layer)
            rows = x[picks // top_k]  # [M, D]
            zeros = torch.zeros(rows.shape[0], 1, dtype=torch.int32)  # [M, 1]: the only expert
            for kind in kinds:
                y = bound.matrices[kind].matmul(rows, zeros)[:, 0]  # [M, F] or [M, 2F]
                firsts.setdefault(kind, x.new_zeros(n_picks, y.shape[1]))[picks] = y
            for kind, vector in bound.biases.items():
                rows_of = vectors.setdefault(kind, x.new_zeros(n_picks, vector.numel()))
                rows_of[picks] = vector.float()
        if not groups:  # every pick dropped: cannot happen, a token's top pick is always kept
            return torch.zeros_like(x)
        h = hidden(self.activation, firsts[kinds[0]], firsts.get("up"), vectors)  # [T*K, F]
        y = x.new_zeros(n_picks, x.shape[1])  # [T*K, D]
        for expert, picks in groups:
            place = r.still_held((layer, expert), places[expert], stats)
            zeros = torch.zeros(picks.numel(), 1, dtype=torch.int32)
            down = self._bound_slot(*place, layer).matrices["down"]
            y[picks] = down.matmul(h[picks], zeros)[:, 0]  # [M, D]
        return combine(output(y, vectors).view(*ids.shape, -1), weights)

    def _threshold(self, layout: ExpertLayout, ids: torch.Tensor, weights: torch.Tensor,
                   stats: LayerStats) -> tuple[torch.Tensor, torch.Tensor]:
        """Drop picks weighted under the threshold (never a token's top pick); rescale the rest
        to the original sum. -> (weights [T, K], kept [T*K] bool)."""
        keep = weights >= self.settings.threshold  # [T, K]
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

    def _bound_slot(self, pool: str, index: int, layer: int) -> _Slot:
        """The slot's bytes bound as this layer's expert layout; bound once per slot and layout."""
        r = self.residency
        layout = (r.lowbit if pool == "lowbit" else self).layouts[layer]
        if pool == "device" and r.on_torch_device:
            return r.pools["device"].expert(index, layout)
        signature = hash(tuple((q.name.split(".", 2)[2], q.ggml_type, q.ne) for q in layout.parts))
        key = (pool, index, signature)
        if key not in self._bound:
            self._bound[key] = _Slot(self.kernels, layout, r.slot_array(pool, index))
        return self._bound[key]

    def close(self) -> None:
        """Stop the prefetch worker (also done when the store is collected)."""
        if self.lookahead is not None:
            self.lookahead.close()

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
            **({"prefetch": self.lookahead.prefetch.as_dict()}
               if self.lookahead is not None else {}),
            **({"lowbit": r.lowbit.as_dict()} if r.lowbit is not None else {}),
        }
