"""Prefetch orchestration: before each layer step the guesses made for it are checked and stale
reads stopped; once the step has issued its own reads, guesses for the next layers are made
(the predictor runs while the disk reads the step's misses) and read into host slots reserved
for them in the disk's idle time (moeswap.experts.guesses); on a CUDA device tier the guesses
worth moving are uploaded on the copy stream. The throttle turns all of it off where, by the
store's counts, it does not pay (moeswap.experts.prefetch; docs/OFFLOAD.md, "Prefetch").
A wrong guess costs a read and a slot, never a different output.
"""

from __future__ import annotations

import time

import torch

from moeswap.experts.guesses import HostGuesses
from moeswap.experts.prefetch import Prefetcher
from moeswap.experts.residency import Key, Residency
from moeswap.experts.settings import OffloadSettings


class Lookahead:
    def __init__(self, residency: Residency, settings: OffloadSettings, routers: dict,
                 top_k: int):
        """routers: MoE layer -> its Router, which the gate predictor applies ahead of time."""
        r = self.residency = residency
        layers = list(r.layouts)
        self.first_layer = layers[0]
        self.prefetch = Prefetcher(settings.prefetch, settings.prefetch_depth, layers, routers,
                                   r.layouts[layers[0]].n_experts, top_k)
        self.guesses = r.guesses = HostGuesses(r.pools["host"], r.reads, self.prefetch,
                                               r.layer_stats)
        self._to_upload: set[Key] = set()  # device guesses waiting for their read
        self._on = False  # the throttle's word for the current forward
        self._step: tuple[int, torch.Tensor, torch.Tensor] | None = None  # the step whose
        # reads are being issued, if it guesses ahead: (layer, x [N, D], ids [N, K])
        residency.step.issued = self.reads_issued

    def before_step(self, layer: int, x: torch.Tensor, ids: torch.Tensor) -> None:
        """x [N, D], ids [N, K]: a layer step is about to run. No guess starts reading until
        the step has issued its own reads (``reads_issued``); if the throttle lets prefetch
        run in this forward, the guesses made for this layer are checked and stale ones
        stopped now (counting its time), and the next layers' are made once the step's reads
        are issued, while the disk is busy with them."""
        self.residency.reads.hold()
        self._step = None
        if self._running(layer):
            started = time.perf_counter()
            self.check(layer, ids)
            self._step = layer, x, ids
            self.prefetch.spent(time.perf_counter() - started)

    def reads_issued(self) -> None:
        """The step's reads are issued (moeswap.experts.step_reads): guesses may read in the
        disk's idle time; the next layers' are made now. Their time costs the store nothing
        while the disk reads the step's misses (the store would wait for them): it is counted
        only for a step that reads nothing."""
        reads = self.residency.reads
        reads.release()
        if self._step is not None:
            hidden, started = reads.step_reads_in_flight(), time.perf_counter()
            self.ahead(*self._step)
            self._step = None
            if not hidden:
                self.prefetch.spent(time.perf_counter() - started)

    def _running(self, layer: int) -> bool:
        """The throttle decides at each forward's first MoE layer, for the whole forward."""
        if layer == self.first_layer:
            was, self._on = self._on, self.prefetch.throttle.forward()
            if was and not self._on:
                self.guesses.pause()
                self._to_upload.clear()
                self.prefetch.pause()
        return self._on

    def check(self, layer: int, ids: torch.Tensor) -> None:
        """Before a layer step: check the guesses made for it against ids [N, K]; stop and
        drop the reads it does not need."""
        self.prefetch.observe(layer, ids)
        self.guesses.collect(layer, {(layer, e) for e in ids.flatten().tolist()})

    def ahead(self, layer: int, x: torch.Tensor, ids: torch.Tensor) -> None:
        """During a layer step: give the next layers' guesses free host slots (or those of
        kept victims, then of older unused guesses) and hand their reads to the readers. With
        no such slot, nothing is predicted."""
        r = self.residency
        needed = {(layer, e) for e in ids.flatten().tolist()}
        device_ahead = r.on_torch_device and r.pools["device"].n_slots
        if not (self.guesses.has_room(needed) or device_ahead):
            return
        pinned = set(needed)
        guesses = self.prefetch.guesses(layer, x, ids)
        for key in guesses:
            if r.holds(key):
                pinned.add(key)
            elif self.guesses.queue_full() or \
                    not self.guesses.reserve(key, r.layouts[key[0]], pinned):
                break  # the readers have enough guesses waiting, or no slot is left
            else:
                pinned.add(key)
        if device_ahead:
            self._upload_ahead(layer, guesses, pinned)

    def _upload_ahead(self, layer: int, guesses: list[Key], pinned: set) -> None:
        """Guesses the cost model would move to the device go there now, on the copy stream,
        once their host bytes are in (a read in flight: at a later step, if still ahead)."""
        r = self.residency
        self._to_upload = {k for k in self._to_upload if k[0] > layer}  # the rest is stale
        for key in [*sorted(self._to_upload), *guesses]:
            if key in r.policies["device"] or not self._worth_uploading(key[0]):
                continue
            if self.guesses.reading(key):
                self._to_upload.add(key)
                continue
            index = r.slots["host"].get(key)
            if index is None:
                index = self.guesses.landed_slot(key)
            if index is not None and r.admit("device", key, pinned):
                self._to_upload.discard(key)
                r.load("device", key, r.pools["host"].slot(index))
                self.prefetch.uploaded()
                pinned.add(key)

    def _worth_uploading(self, layer: int) -> bool:
        """Would the cost model move this layer's expert for one token?"""
        planner = self.residency.planner
        mode, rates, size = planner.mode, planner.rates, self.residency.layouts[layer].expert_bytes
        return mode == "transfer" or (
            mode == "auto" and rates.transfer_seconds(size, 1) < rates.compute_seconds(size, 1))
