"""What `run`, `chat` and `serve` show while and after a model loads: a progress line on a
terminal (tensors mapped, time), then one summary of where the memory goes — the budget's
split (shared weights, KV cache, a step's working memory, experts) and the experts each tier
holds."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from moeswap.memory import HostCharge, format_size


@contextmanager
def load_progress(model_path, console: Console,
                  verbose: bool = False) -> Iterator[tuple[Progress, Callable[[str], None]]]:
    """(the progress, the loader's ``verbose_log``): each mapped tensor advances the line
    (printed too when ``verbose``); rich draws it only on a terminal and clears it after."""
    with Progress(SpinnerColumn(), TextColumn("{task.description}"),
                  TextColumn("{task.completed} tensors mapped"), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task(f"loading {model_path}", total=None)

        def on_tensor(line: str) -> None:
            progress.advance(task)
            if verbose:
                progress.console.print(line, markup=False)

        yield progress, on_tensor
        loaded = progress.tasks[0]
        console.print(f"loaded {model_path}: {int(loaded.completed)} tensors in "
                      f"{loaded.elapsed:.1f} s", markup=False)


def memory_summary(runtime, model_path, charge: HostCharge) -> list[str]:
    """The budget's split and the experts per tier, from the store's own figures; without a
    store (every weight in RAM), from the file's sizes and ``charge`` (what the caches and a
    step take)."""
    stats = runtime.stats()
    config = runtime.config
    n_experts = len(config.moe_layers) * config.n_expert
    if "tiers" in stats:
        return _store_summary(stats, n_experts)
    shared, routed = _weight_bytes(model_path)
    budget = [f"shared weights {format_size(shared)}" if shared is not None else "weights",
              f"KV cache {format_size(charge.kv_bytes(config))} ({charge.kv_type})",
              f"working memory {format_size(charge.working_bytes(config))}"]
    if not n_experts:
        return ["memory: a dense model, every weight in RAM (no expert store): "
                + ", ".join(budget)]
    experts = f"experts {format_size(routed)}" if routed is not None else "experts"
    return ["memory: every weight in RAM (no --host-mem): " + ", ".join(budget + [experts]),
            f"experts: all {n_experts} in RAM ("
            + ("copied from the file)" if runtime.model.weights_in_ram else "the mapped file)")]


def _store_summary(stats: dict, n_experts: int) -> list[str]:
    tiers = stats["tiers"]
    host = tiers["host"]
    charged = sum(stats[k] for k in ("shared_bytes", "kv_bytes", "working_bytes"))
    lines = [f"memory: --host-mem {format_size(host['budget_bytes'])}: shared weights "
             f"{format_size(stats['shared_bytes'])}, KV cache {format_size(stats['kv_bytes'])}, "
             f"working memory {format_size(stats['working_bytes'])}, experts and staging "
             f"{format_size(host['held_bytes'] - charged)}"]
    held = [f"{tier} {s['slots']} ({format_size(s['slots'] * s['slot_bytes'])})"
            for tier, s in tiers.items() if s["slots"]]
    on_disk = max(n_experts - sum(s["slots"] for s in tiers.values()), 0)
    lines.append(f"experts: {n_experts} in all; slots per tier: {', '.join(held)}; at least "
                 f"{on_disk} read from the file when used")
    return lines


def _weight_bytes(model_path) -> tuple[int | None, int | None]:
    """(shared, routed) bytes of a GGUF file; (None, None) for a Hugging Face folder."""
    if Path(model_path).is_dir():
        return None, None
    from moeswap.formats.gguf_file import GGUFFile
    from moeswap.planner.sizes import model_sizes

    gf = GGUFFile.open(model_path)
    try:
        sizes = model_sizes(gf)
    finally:
        gf.close()
    return sizes.shared_bytes, sizes.routed_bytes
