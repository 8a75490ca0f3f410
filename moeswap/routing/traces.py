"""The routing-trace format: which experts each token chose at each MoE layer.

A trace is a handful of dense arrays in one ``.npz`` file (``numpy.savez_compressed``,
readable with ``allow_pickle=False``); docs/TRACES.md is the specification.

Legend for shape comments: T tokens (all prompts concatenated), L traced MoE layers,
k experts chosen per token, E routed experts per layer, P prompts.

``TraceBuilder`` is what a recorder fills: it is handed the router's decisions
explicitly (``append``) and turns them into a ``RoutingTrace`` at the end.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moeswap.errors import MoeswapError, write_or_raise
from moeswap.formats.gguf_file import GGUFFile

TRACE_FORMAT = "moeswap.trace.v1"
PHASES = ("prefill", "decode")
NO_EXPERT = -1  # an expert id slot that was not recorded (token dropped at that layer)


@dataclass
class RoutingTrace:
    """Router decisions of one or more prompts, token-major.

    ``expert_ids[t, l]`` are token t's chosen experts at traced layer l in the router's
    order (first choice first); ``NO_EXPERT`` marks a (token, layer) that was not recorded.
    ``layers[l]`` is the model's block index of traced layer l (MoE layers only).
    """

    model: str
    arch: str
    layers: np.ndarray  # [L] int32, model block index of each traced layer
    n_experts: int
    k: int
    prompt_offsets: np.ndarray  # [P+1] int64, prompt p is tokens offsets[p]:offsets[p+1]
    expert_ids: np.ndarray  # [T, L, k] int16
    weights: np.ndarray  # [T, L, k] float32, NaN where unknown
    router_probs: np.ndarray | None = None  # [T, L, E] float16, the full router distribution
    phase: np.ndarray | None = None  # [T] uint8, index into PHASES
    prompt_names: list[str] = field(default_factory=list)
    # [T] int32: the forward pass each token went through (tokens of one pass share it); None:
    # implied by ``phase`` (``forwards``)
    forward: np.ndarray | None = None
    source: str = ""  # provenance, free text

    def __post_init__(self) -> None:
        self.layers = np.asarray(self.layers, dtype=np.int32)
        self.prompt_offsets = np.asarray(self.prompt_offsets, dtype=np.int64)
        self.expert_ids = np.asarray(self.expert_ids, dtype=np.int16)
        self.weights = np.asarray(self.weights, dtype=np.float32)
        if self.forward is not None:
            self.forward = np.asarray(self.forward, dtype=np.int32)
        if not self.prompt_names:
            self.prompt_names = [f"prompt-{p}" for p in range(self.n_prompts)]
        problem = self._first_problem()
        if problem:
            raise ValueError(f"inconsistent routing trace: {problem}")

    @property
    def n_tokens(self) -> int:
        return int(self.expert_ids.shape[0])

    @property
    def n_layers(self) -> int:
        return int(self.expert_ids.shape[1])

    @property
    def n_prompts(self) -> int:
        return len(self.prompt_offsets) - 1

    @property
    def valid(self) -> np.ndarray:
        """[T, L] bool: the (token, layer) pairs that were recorded."""
        return self.expert_ids[:, :, 0] != NO_EXPERT

    def forwards(self) -> np.ndarray:
        """[T] the forward pass of each token: as recorded; else one pass per decode token and
        one per prompt's run of prefill tokens (one per token where phases are unknown)."""
        if self.forward is not None:
            return self.forward
        if self.phase is None:
            return np.arange(self.n_tokens, dtype=np.int32)
        prefill = self.phase == PHASES.index("prefill")  # [T]
        starts = np.ones(self.n_tokens, dtype=bool)
        starts[1:] = ~(prefill[1:] & prefill[:-1])
        starts[self.prompt_offsets[:-1][self.prompt_offsets[:-1] < self.n_tokens]] = True
        return (np.cumsum(starts) - 1).astype(np.int32)

    def prompt_of_token(self) -> np.ndarray:
        """[T] int: the prompt each token belongs to."""
        return np.repeat(np.arange(self.n_prompts), np.diff(self.prompt_offsets))

    def select_prompts(self, prompts: list[int]) -> RoutingTrace:
        """A trace of only the given prompts, in the given order."""
        spans = [np.arange(self.prompt_offsets[p], self.prompt_offsets[p + 1]) for p in prompts]
        rows = np.concatenate(spans) if spans else np.zeros(0, dtype=np.int64)
        lengths = [len(s) for s in spans]
        return RoutingTrace(
            model=self.model,
            arch=self.arch,
            layers=self.layers,
            n_experts=self.n_experts,
            k=self.k,
            prompt_offsets=np.concatenate([[0], np.cumsum(lengths)]),
            expert_ids=self.expert_ids[rows],
            weights=self.weights[rows],
            router_probs=None if self.router_probs is None else self.router_probs[rows],
            phase=None if self.phase is None else self.phase[rows],
            prompt_names=[self.prompt_names[p] for p in prompts],
            source=self.source,
            forward=None if self.forward is None else self.forward[rows],
        )

    def _first_problem(self) -> str:
        if self.expert_ids.ndim != 3:
            return f"expert_ids must be [T, L, k], got shape {self.expert_ids.shape}"
        T, L, k = self.expert_ids.shape
        if k != self.k or L != len(self.layers):
            return f"expert_ids shape {self.expert_ids.shape} does not match L={len(self.layers)}, k={self.k}"
        if self.weights.shape != self.expert_ids.shape:
            return f"weights shape {self.weights.shape} differs from expert_ids {self.expert_ids.shape}"
        ids = self.expert_ids
        if ids.size and (ids.min() < NO_EXPERT or ids.max() >= self.n_experts):
            return f"expert ids must lie in [0, {self.n_experts}) or be {NO_EXPERT}"
        offsets = self.prompt_offsets
        if len(offsets) < 1 or offsets[0] != 0 or offsets[-1] != T or np.any(np.diff(offsets) < 0):
            return f"prompt_offsets must rise from 0 to T={T}, got {offsets.tolist()}"
        if len(self.prompt_names) != self.n_prompts:
            return f"{len(self.prompt_names)} prompt names for {self.n_prompts} prompts"
        if self.router_probs is not None and self.router_probs.shape != (T, L, self.n_experts):
            return f"router_probs shape {self.router_probs.shape} is not (T, L, E) = {(T, L, self.n_experts)}"
        if self.phase is not None and self.phase.shape != (T,):
            return f"phase shape {self.phase.shape} is not (T,) = ({T},)"
        if self.forward is not None and self.forward.shape != (T,):
            return f"forward shape {self.forward.shape} is not (T,) = ({T},)"
        return ""

    def save(self, path: str | Path) -> None:
        meta = {
            "format": TRACE_FORMAT,
            "model": self.model,
            "arch": self.arch,
            "n_experts": self.n_experts,
            "k": self.k,
            "prompt_names": self.prompt_names,
            "source": self.source,
        }
        arrays = {
            "meta": np.array(json.dumps(meta)),
            "layers": self.layers,
            "prompt_offsets": self.prompt_offsets,
            "expert_ids": self.expert_ids,
            "weights": self.weights,
        }
        if self.router_probs is not None:
            arrays["router_probs"] = self.router_probs.astype(np.float16)
        if self.phase is not None:
            arrays["phase"] = self.phase.astype(np.uint8)
        if self.forward is not None:
            arrays["forward"] = self.forward
        with write_or_raise(path, "the trace"):
            with open(path, "wb") as f:  # a file object keeps numpy from appending ".npz"
                np.savez_compressed(f, **arrays)

    @classmethod
    def load(cls, path: str | Path) -> RoutingTrace:
        try:
            with np.load(path, allow_pickle=False) as z:
                arrays = {name: z[name] for name in z.files}
        except FileNotFoundError:
            raise MoeswapError(f"{path}: no such trace file") from None
        except (OSError, ValueError) as e:
            raise MoeswapError(
                f"{path}: not a moeswap trace (.npz) ({e}); convert it with `moeswap import-trace`"
            ) from None
        missing = {"meta", "layers", "prompt_offsets", "expert_ids", "weights"} - arrays.keys()
        if missing:
            raise MoeswapError(f"{path}: trace lacks arrays {sorted(missing)}; re-record or re-import it")
        meta = json.loads(str(arrays["meta"]))
        if meta.get("format") != TRACE_FORMAT:
            raise MoeswapError(f"{path}: trace format {meta.get('format')!r}, this moeswap reads {TRACE_FORMAT!r}")
        try:
            return cls(
                model=meta["model"],
                arch=meta["arch"],
                layers=arrays["layers"],
                n_experts=int(meta["n_experts"]),
                k=int(meta["k"]),
                prompt_offsets=arrays["prompt_offsets"],
                expert_ids=arrays["expert_ids"],
                weights=arrays["weights"],
                router_probs=arrays.get("router_probs"),
                phase=arrays.get("phase"),
                prompt_names=list(meta["prompt_names"]),
                source=meta.get("source", ""),
                forward=arrays.get("forward"),
            )
        except (KeyError, ValueError) as e:
            raise MoeswapError(f"{path}: damaged trace: {e}; re-record or re-import it") from None


class TraceBuilder:
    """Collects router decisions as a run goes and builds a ``RoutingTrace``.

    The caller (an engine's recorder, or an importer) says when a prompt starts and hands
    over each layer's decisions for a run of consecutive tokens::

        builder = TraceBuilder(model="mixtral-8x7b", arch="llama", layers=range(32), n_experts=8, k=2)
        builder.begin_prompt("gsm8k-0")
        builder.append(layer=0, token_idx=0, expert_ids=ids, weights=w, phase="prefill")  # ids, w: [n, k]
        trace = builder.build()

    ``token_idx`` is the position of the first of the n tokens within the current prompt;
    positions never appended at a layer stay ``NO_EXPERT``. Appending only keeps
    references: the arrays are converted and assembled once, in ``build``.
    """

    def __init__(self, *, model: str, arch: str, layers, n_experts: int, k: int, source: str = ""):
        self.model, self.arch, self.n_experts, self.k, self.source = model, arch, n_experts, k, source
        self.layers = [int(layer) for layer in layers]
        self._column = {layer: i for i, layer in enumerate(self.layers)}
        self._prompts: list[tuple[str, list]] = []  # (name, chunks of one prompt)

    def begin_prompt(self, name: str = "") -> None:
        self._prompts.append((name or f"prompt-{len(self._prompts)}", []))

    def append(self, layer: int, token_idx: int, expert_ids, weights, router_probs=None,
               phase: str | None = None, forward: int | None = None):
        """Record ``n`` consecutive tokens at one layer: expert_ids and weights [n, k], router_probs [n, E];
        ``forward``: the forward pass they went through (numbered across the whole trace).

        The arrays (numpy, or CPU torch tensors) are kept as handed over and converted in
        ``build``, so recording costs about a microsecond; do not modify them afterwards.
        """
        if not self._prompts:
            raise ValueError("begin_prompt() must be called before append()")
        column = self._column.get(layer)
        if column is None:
            raise ValueError(f"layer {layer} is not one of the traced layers {self.layers}")
        if phase is not None and phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        self._prompts[-1][1].append((column, token_idx, expert_ids, weights, router_probs, phase,
                                     forward))

    def _converted(self, chunk) -> tuple:
        column, token_idx, expert_ids, weights, router_probs, phase, forward = chunk
        ids = np.asarray(expert_ids, dtype=np.int16).reshape(-1, self.k)  # [n, k]
        w = np.asarray(weights, dtype=np.float32).reshape(ids.shape)  # [n, k]
        probs = None if router_probs is None else np.asarray(router_probs, dtype=np.float16).reshape(len(ids), -1)
        return (column, int(token_idx), ids, w, probs, None if phase is None else PHASES.index(phase),
                forward)

    def build(self) -> RoutingTrace:
        prompts = [[self._converted(chunk) for chunk in chunks] for _, chunks in self._prompts]
        lengths = [max((t + len(ids) for _, t, ids, *_ in chunks), default=0) for chunks in prompts]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        T, L, k, E = int(offsets[-1]), len(self.layers), self.k, self.n_experts
        chunks = [(offsets[p] + t, c, ids, w, pr, ph, f) for p, cs in enumerate(prompts)
                  for c, t, ids, w, pr, ph, f in cs]
        expert_ids = np.full((T, L, k), NO_EXPERT, dtype=np.int16)
        weights = np.full((T, L, k), np.nan, dtype=np.float32)
        has_probs = any(pr is not None for *_, pr, _, _ in chunks)
        probs = np.full((T, L, E), np.nan, dtype=np.float16) if has_probs else None
        phase = np.zeros(T, dtype=np.uint8) if any(ph is not None for *_, ph, _ in chunks) else None
        forward = np.zeros(T, dtype=np.int32) if any(f is not None for *_, f in chunks) else None
        for start, column, ids, w, pr, ph, f in chunks:
            rows = slice(start, start + len(ids))
            expert_ids[rows, column] = ids
            weights[rows, column] = w
            if pr is not None:
                probs[rows, column] = pr
            if ph is not None:
                phase[rows] = ph
            if f is not None:
                forward[rows] = f
        return RoutingTrace(
            model=self.model,
            arch=self.arch,
            layers=np.asarray(self.layers),
            n_experts=E,
            k=k,
            prompt_offsets=offsets,
            expert_ids=expert_ids,
            weights=weights,
            router_probs=probs,
            phase=phase,
            prompt_names=[name for name, _ in self._prompts],
            source=self.source,
            forward=forward,
        )


def model_name(path: str | os.PathLike, source: GGUFFile | Path) -> str:
    """The name a trace records for a model: the GGUF's general.name when it has one, else
    the file or folder name."""
    name = source.get("general.name") if isinstance(source, GGUFFile) else None
    return str(name) if name else Path(path).stem
