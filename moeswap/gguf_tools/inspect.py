"""`moeswap inspect`: an MoE-aware summary of a GGUF file from its header and tensor index.

A split set is summarised as the one model it is, followed by its pieces.

Nothing beyond the header is read (tokenizer arrays stay undecoded byte spans), so this
takes well under a second on any file size.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from rich.console import Console
from rich.table import Table

from moeswap.formats.config import ARCH_TRAITS
from moeswap.formats.gguf_file import GGUFFile
from moeswap.formats.gguf_moe import (
    ATTENTION, DENSE_FFN, NORM, OTHER, ROUTED, ROUTER, SHARED_EXPERT,
    ByteTotals, MoEMetadata, MoEView,
)

LAYER_ROLES = (ROUTER, ROUTED, SHARED_EXPERT, ATTENTION, NORM, DENSE_FFN, OTHER)


@dataclass(frozen=True)
class TensorRow:
    name: str
    role: str
    layer: int | None
    type: str
    shape: list[int]  # ne order
    bytes: int
    piece: int  # which file of a split set holds it (0 for a single file)


@dataclass(frozen=True)
class PieceRow:
    """One file of a split set."""

    path: str
    file_size: int
    n_tensors: int
    tensor_bytes: int


@dataclass(frozen=True)
class LayerRow:
    index: int
    kind: str  # "moe" or "dense"
    bytes_by_role: dict[str, int]
    types_by_role: dict[str, list[str]]
    one_expert_bytes: int


@dataclass(frozen=True)
class InspectReport:
    path: str
    gguf_version: int
    file_size: int  # of every file of the model
    n_tensors: int
    n_kv: int
    metadata: MoEMetadata
    is_moe: bool
    expert_width: int | None  # n_ff_exp from the key, Mixtral's feed_forward_length or shapes
    layers: list[LayerRow]
    totals: ByteTotals
    type_mix: dict[str, tuple[int, int]]
    tensors: list[TensorRow]
    pieces: list[PieceRow]  # a split set's files, in order; empty for a single file

    def to_json(self, with_tensors: bool = False) -> dict:
        data = asdict(self)
        data["metadata"]["expert_gating_func_name"] = self.metadata.gating_func_name
        data["type_mix"] = {name: {"tensors": n, "bytes": b}
                            for name, (n, b) in self.type_mix.items()}
        if not with_tensors:
            del data["tensors"]
        return data


def inspect_file(path: str | os.PathLike) -> InspectReport:
    """Raises GGUFFormatError (with its doctor rule) when the header cannot be read."""
    gf = GGUFFile.open(path)
    try:
        return build_report(gf)
    finally:
        gf.close()


def build_report(gf: GGUFFile) -> InspectReport:
    view = MoEView(gf)
    layers = []
    for layer in view.layers:
        present = [role for role in LAYER_ROLES if layer.of(role)]
        layers.append(LayerRow(
            index=layer.index,
            kind="moe" if layer.is_moe else "dense",
            bytes_by_role={role: layer.bytes_of(role) for role in present},
            types_by_role={role: sorted({t.type_name for t in layer.of(role)}) for role in present},
            one_expert_bytes=view.expert_bytes(layer),
        ))
    tensors = [TensorRow(t.name, view.roles[t.name].role, view.roles[t.name].layer, t.type_name,
                         list(t.shape), t.n_bytes, t.piece) for t in gf.tensors]
    pieces = [PieceRow(str(piece.path), piece.file_size,
                       sum(t.piece == i for t in gf.tensors),
                       sum(max(t.n_bytes, 0) for t in gf.tensors if t.piece == i))
              for i, piece in enumerate(gf.pieces)]
    return InspectReport(str(gf.path), gf.version, gf.total_size, len(gf.tensors), len(gf.kv),
                         view.metadata, view.is_moe, view.expert_width, layers, view.totals(),
                         view.type_mix(), tensors, pieces)


def human_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.2f} {unit}"


def _show(value) -> str:
    return "-" if value is None else str(value)


# How ArchTraits.gating reads, and where one architecture's default says more.
_DEFAULT_GATING = {"softmax": "softmax", "sigmoid": "sigmoid",
                   "softmax_topk": "top-k logits, then softmax",
                   "llama4": "top-k logits, sigmoid weights on the expert input"}


def _gating_line(m) -> str:
    """The router's gating, renormalisation and scale; where a key is absent, llama.cpp's default
    for the architecture, marked as such."""
    traits = ARCH_TRAITS.get(m.architecture)
    gating, norm = m.gating_func_name, m.expert_weights_norm
    if gating is None and traits is not None:
        gating = _DEFAULT_GATING.get(m.architecture, _DEFAULT_GATING[traits.gating]) + " (default)"
    if norm is None and traits is not None:
        norm = f"{traits.expert_weights_norm} (default)"
    return f"{_show(gating)}, weights norm {_show(norm)}, scale {_show(m.expert_weights_scale)}"


def _shared_expert(report: InspectReport) -> tuple[str, str]:
    """(count, width) of the shared expert from the keys; where a file has shared-expert tensors
    but no keys (Llama 4, Qwen2-MoE), one expert as wide as its down projection's input."""
    m = report.metadata
    count, width = _show(m.expert_shared_count), _show(m.expert_shared_feed_forward_length)
    down = next((t for t in report.tensors if t.name.endswith(".ffn_down_shexp.weight")), None)
    if down is not None and m.expert_shared_count is None:
        count = "1 (tensors)"
    if down is not None and m.expert_shared_feed_forward_length is None:
        width = str(down.shape[0])
    return count, width


def render(report: InspectReport, console: Console, with_tensors: bool = False) -> None:
    m = report.metadata
    known = "known to llama.cpp" if m.known_to_llama_cpp else "NOT known to llama.cpp"
    split = f", split set of {len(report.pieces)} files" if report.pieces else ""
    summary = Table(title=f"{report.path} (GGUF v{report.gguf_version}, "
                          f"{human_bytes(report.file_size)}{split})", show_header=False)
    summary.add_column("key", style="bold")
    summary.add_column("value")
    summary.add_row("architecture", f"{_show(m.architecture)} ({known})")
    summary.add_row("layout", "MoE" if report.is_moe else "dense (no routed experts)")
    summary.add_row("blocks / n_embd", f"{_show(m.block_count)} / {_show(m.n_embd)}")
    if report.is_moe:
        shared_count, shared_width = _shared_expert(report)
        summary.add_row("experts (used / total / shared)", f"{_show(m.expert_used_count)} / "
                        f"{_show(m.expert_count)} / {shared_count}")
        summary.add_row("expert FFN width (shared)", f"{_show(report.expert_width)} "
                        f"({shared_width})")
        summary.add_row("gating", _gating_line(m))
        summary.add_row("leading dense layers", _show(m.leading_dense_block_count))
    totals = report.totals
    summary.add_row("tensors / keys", f"{report.n_tensors} / {report.n_kv}")
    summary.add_row("total bytes", human_bytes(totals.total))
    summary.add_row("shared bytes", human_bytes(totals.shared))
    summary.add_row("routed-expert bytes", human_bytes(totals.routed))
    summary.add_row("one expert (one layer)", human_bytes(totals.one_expert))
    summary.add_row("active per token", human_bytes(totals.active_per_token))
    console.print(summary)
    if report.pieces:
        _render_pieces(report, console)

    mix = Table(title="tensor types")
    for column in ("type", "tensors", "bytes"):
        mix.add_column(column, justify="left" if column == "type" else "right")
    for name, (count, size) in report.type_mix.items():
        mix.add_row(name, str(count), human_bytes(size))
    console.print(mix)

    layers = Table(title="layers")
    layers.add_column("layer", justify="right")
    layers.add_column("kind")
    roles = [r for r in LAYER_ROLES if any(r in row.bytes_by_role for row in report.layers)]
    for role in roles:
        layers.add_column(role)
    for row in report.layers:
        cells = [f"{human_bytes(row.bytes_by_role[r])} {'/'.join(row.types_by_role[r])}"
                 if r in row.bytes_by_role else "" for r in roles]
        layers.add_row(str(row.index), row.kind, *cells)
    console.print(layers)

    if with_tensors:
        table = Table(title="tensors")
        columns = ("name", "role", "type", "shape (ne)", "bytes") + (("piece",) if report.pieces
                                                                    else ())
        for column in columns:
            table.add_column(column, justify="right" if column in ("bytes", "piece") else "left")
        for t in report.tensors:
            piece = (str(t.piece + 1),) if report.pieces else ()
            table.add_row(t.name, t.role, t.type, "x".join(map(str, t.shape)), str(t.bytes),
                          *piece)
        console.print(table)


def _render_pieces(report: InspectReport, console: Console) -> None:
    table = Table(title="split set")
    for column in ("piece", "file", "tensors", "tensor bytes", "file size"):
        table.add_column(column, justify="left" if column == "file" else "right")
    for number, piece in enumerate(report.pieces, 1):
        table.add_row(f"{number}/{len(report.pieces)}", os.path.basename(piece.path),
                      str(piece.n_tensors), human_bytes(piece.tensor_bytes),
                      human_bytes(piece.file_size))
    console.print(table)

