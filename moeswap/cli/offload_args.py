"""The expert-offload flags every model-running command shares, and the stats it prints.

``--host-mem`` turns the expert store on; without it every routed expert is computed from the
mapped file (all resident).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from moeswap.experts.cost import MISS_MODES


def add_offload_arguments(p: argparse.ArgumentParser) -> None:
    from moeswap.experts.settings import COLD_READS_MODES, LOWBIT_TYPES, PREDICTORS
    from moeswap.routing.policy_specs import POLICY_HELP

    g = p.add_argument_group("expert offload (GGUF files)")
    g.add_argument("--host-mem", metavar="SIZE",
                   help="RAM budget, e.g. 8GiB, for shared weights, the KV cache and host-tier "
                        "experts; the others are read from the file when used "
                        "(default: all in RAM)")
    g.add_argument("--device-mem", metavar="SIZE",
                   help="device-tier budget for experts: GPU memory with CUDA (default 0: "
                        "none); without CUDA it is RAM holding the same form as --host-mem, so "
                        "the cost model computes misses in place and this tier stays empty")
    g.add_argument("--policy", default="lru", help=f"which experts stay: {POLICY_HELP} (lru)")
    g.add_argument("--miss", choices=MISS_MODES, default="auto",
                   help="on a miss: move the expert up a tier (transfer), compute it where it lies "
                        "(compute), or let the cost model choose from `moeswap probe` rates (auto)")
    g.add_argument("--expert-threshold", type=float, default=0.0, metavar="P",
                   help="APPROXIMATION: skip picked experts whose routing weight is under P and "
                        "rescale the rest (counted in the stats; default 0: off)")
    g.add_argument("--miss-lowbit", default="", metavar="TYPE",
                   help="APPROXIMATION: keep a TYPE copy (e.g. q4_0) of every routed expert in "
                        "RAM, charged to --host-mem, and compute a miss the host tier does not "
                        f"admit from it instead of reading the file; {', '.join(LOWBIT_TYPES)} "
                        "(counted in the stats; default: off)")
    g.add_argument("--cold-reads", nargs="?", const="on", default="auto",
                   choices=COLD_READS_MODES,
                   help="read experts past the page cache (O_DIRECT, else pread and "
                        "posix_fadvise DONTNEED): a memory cgroup is then not charged page cache, "
                        "and the disk tier measures the disk. auto: on where the process's memory "
                        "cgroup has less room than the model file and --host-mem, said in one "
                        "line (default auto; given bare: on)")
    g.add_argument("--read-depth", type=int, default=4, metavar="N",
                   help="expert disk reads in flight at once (default 4)")
    # On by default: adaptive prefetch was measured faster over a slow link and within
    # run-to-run noise of off elsewhere (docs/BENCHMARKS.md, "Prefetch measurements").
    g.add_argument("--prefetch", choices=PREDICTORS, default="gate",
                   help="read the next layers' likely experts from disk into a few host slots "
                        "reserved for them (from --host-mem) while a layer computes, guessed by "
                        "the next router on this layer's input (gate), by routing history "
                        "(history) or both; turned off by itself where, by the store's counts, it "
                        "hides less read time than it costs (default gate; off: never)")
    g.add_argument("--prefetch-depth", type=int, default=1, metavar="N",
                   help="how many MoE layers ahead to guess (default 1; 0: off)")
    g.add_argument("--replay-routing", metavar="TRACE",
                   help="MEASUREMENT: use a recorded trace's (.npz) expert choices and gate "
                        "weights instead of the router's; trace layer i drives MoE layer i, "
                        "position t takes trace token t, wrapping (docs/OFFLOAD.md)")


def bare_cold_reads_as_on(argv: list[str]) -> list[str]:
    """A bare ``--cold-reads`` as ``--cold-reads=on``: spelled as it was when the flag took no
    value (``run --cold-reads MODEL``), argparse would take the model for its value."""
    from moeswap.experts.settings import COLD_READS_MODES

    spelled = []
    for i, arg in enumerate(argv):
        value = argv[i + 1] if i + 1 < len(argv) else None
        spelled.append("--cold-reads=on" if arg == "--cold-reads" and value not in
                       COLD_READS_MODES else arg)
    return spelled


def add_step_tokens_argument(p: argparse.ArgumentParser, scope: str = "") -> None:
    """``--step-tokens``, as `moeswap run`, `chat` and `serve` (``scope``: its words on what a
    step carries) and `moeswap plan` share it."""
    from moeswap.memory import STEP_TOKENS

    p.add_argument("--step-tokens", type=int, default=STEP_TOKENS, metavar="N",
                   help=f"most tokens one forward feeds{scope}; longer prompts are prefilled in "
                        "chunks of this many. Bounds a step's working memory and what "
                        "sliding-window layers hold, both charged to --host-mem "
                        f"({STEP_TOKENS}: llama.cpp's n_ubatch)")


def add_exact_tiers_argument(p: argparse.ArgumentParser) -> None:
    """``--exact-tiers``, as `moeswap run`, `chat` and `serve` share it."""
    p.add_argument("--exact-tiers", action="store_true",
                   help="keep every weight in its stored layout: no ggml repacked layouts for "
                        "the shared matrices and a resident model's expert stacks (Q4_0, Q4_K, "
                        "IQ4_NL, MXFP4 on x86), and decode attention in llama.cpp's layout (one "
                        "product per query head), so logits are bit for bit those of the plain "
                        "kernels at any budget")


def add_kv_type_argument(p: argparse.ArgumentParser) -> None:
    """``--kv-type``, as `moeswap run`, `chat`, `serve` and `plan` share it."""
    from moeswap.memory import COMMAND_KV_TYPE, KV_TYPES

    p.add_argument("--kv-type", choices=list(KV_TYPES), default=COMMAND_KV_TYPE,
                   help="type of the KV cache's keys and values, charged to --host-mem "
                        "(f16: llama.cpp's default, half of f32's bytes; q8_0: 17/32 of f16's, "
                        "for GGUF models whose attention runs as ggml graphs)")


def offload_settings(args, budgets: tuple[int | None, int] | None = None, *,
                     model_path: str | Path, say: Callable[[str], None]):
    """The offload flags typed once for the model at ``model_path``: an OffloadSettings, or
    None for all-resident (no --host-mem). ``budgets``: (host, device) bytes a plan chose (host
    None: all resident), in place of --host-mem and --device-mem. ``say`` prints the one line
    `--cold-reads auto` has when it turns cold reads on under a memory cgroup's limit."""
    from moeswap.errors import MoeswapError
    from moeswap.experts.settings import OffloadSettings
    from moeswap.memory import parse_size
    from moeswap.planner.cold_reads import cold_reads_for

    host, device = budgets or (parse_size(args.host_mem) if args.host_mem is not None else None,
                               parse_size(args.device_mem or "0"))
    if host is None:
        if args.miss_lowbit:  # an approximation must not be asked for and silently skipped
            raise MoeswapError("--miss-lowbit needs the expert store: give --host-mem too")
        return None
    if args.read_depth < 1:
        raise MoeswapError(f"--read-depth must be 1 or more, got {args.read_depth}")
    if args.prefetch_depth < 0:
        raise MoeswapError(f"--prefetch-depth must be 0 or more, got {args.prefetch_depth}")
    import torch

    cold = cold_reads_for(args.cold_reads, host, model_path)
    if cold.note:
        say(cold.note)
    return OffloadSettings(
        host_bytes=host, device_bytes=device, policy=args.policy, miss=args.miss,
        threshold=args.expert_threshold, cold_reads=cold.on, read_depth=args.read_depth,
        device_backend="cuda" if device and torch.cuda.is_available() else "ram",
        prefetch=args.prefetch, prefetch_depth=args.prefetch_depth, miss_lowbit=args.miss_lowbit)


def offload_load_options(settings, charge, threads: int | None, model_path=None,
                         mmap: bool = True) -> dict:
    """``moeswap.load``'s options for ``settings`` (None: all resident): the store paying
    ``charge``, with this machine's probed rates where the cost model needs them; a resident
    model's weights copied into RAM (``in_ram``) unless ``mmap`` or the RAM free cannot hold
    them."""
    from moeswap.experts.build import load_options
    from moeswap.planner.auto import fits_in_ram
    from moeswap.planner.probe import cost_model_rates

    options = load_options(settings, charge, cost_model_rates(settings, threads))
    if settings is None and not mmap and model_path is not None:
        options["in_ram"] = fits_in_ram(model_path, charge)
    return options


def add_mmap_argument(p: argparse.ArgumentParser) -> None:
    """``--mmap``, as `moeswap run`, `chat` and `serve` share it."""
    p.add_argument("--mmap", action="store_true",
                   help="compute a resident model from the mapped file (llama.cpp's default) "
                        "instead of a copy in RAM with huge pages, made where the free RAM "
                        "holds it (faster decode; the RAM is the process's own)")


def stats_lines(stats: dict) -> list[str]:
    """A few readable lines: replayed routing, totals, tiers, then one line per layer."""
    from moeswap.routing.replay import routing_line

    lines = [routing_line(stats["routing"])] if "routing" in stats else []
    if "total" not in stats:
        return lines
    t = stats["total"]
    lines += [f"experts: {t['requests']} used, hit rate {t['hit_rate']:.1%} "
             f"(device {t['device_hits']}, host {t['host_hits']}), disk misses {t['disk_misses']} "
             f"({t['disk_bytes'] / 2**20:.1f} MiB), transfers {t['transfers']}, "
             f"computed in place {t['computed_in_place']}, "
             f"evictions {t['device_evictions'] + t['host_evictions']}, "
             f"refetches {t['refetches']}, stalled {t['stall_seconds']:.2f} s"]
    if t["threshold_drops"]:
        lines.append(f"expert threshold (approximation): {t['threshold_drops']} picks dropped, "
                     f"{t['threshold_saved_bytes'] / 2**20:.1f} MiB not read")
    if "lowbit" in stats:
        s = stats["lowbit"]
        lines.append(f"miss-lowbit {s['type']} (approximation): {s['fires']} misses computed from "
                     f"low-bit copies, {s['saved_bytes'] / 2**20:.1f} MiB not read, copies hold "
                     f"{s['held_bytes'] / 2**20:.1f} MiB")
    for tier, s in stats["tiers"].items():
        lines.append(f"{tier} tier: {s['experts_resident']}/{s['slots']} slots of "
                     f"{s['slot_bytes']} bytes, holds {s['held_bytes'] / 2**20:.1f} MiB of "
                     f"{s['budget_bytes'] / 2**20:.1f} MiB budget")
    for layer, s in stats["layers"].items():
        lines.append(f"  layer {layer}: hit rate {s['hit_rate']:.1%}, "
                     f"disk misses {s['disk_misses']}, transfers {s['transfers']}, "
                     f"stalled {s['stall_seconds']:.3f} s")
    if "prefetch" in stats:
        lines += prefetch_lines(stats["prefetch"], t["stall_seconds"])
    return lines


def prefetch_lines(s: dict, stalled: float) -> list[str]:
    lines = [f"prefetch ({s['mode']}, depth {s['depth']}): {s['reads']} reads, "
             f"{s['bytes_prefetched'] / 2**20:.1f} MiB read, {s['used']} used, "
             f"{s['bytes_wasted'] / 2**20:.1f} MiB wasted, {s['cancelled']} stale cancelled; "
             f"stalled {stalled:.2f} s (waiting on prefetch {s['wait_seconds']:.2f} s), "
             f"without prefetch about {stalled + s['hidden_seconds']:.2f} s; prefetch cost "
             f"{s['cost_seconds']:.2f} s, step reads behind guesses {s['delay_seconds']:.2f} s"]
    a = s["adaptive"]
    lines.append(f"prefetch throttle: on in {a['forwards_on']} forwards, off in "
                 f"{a['forwards_off']}; {a['windows_won']} of {a['windows']} windows kept it on"
                 + (f" (last: hid {a['last_hidden_seconds'] * 1e3:.1f} ms, cost "
                    f"{a['last_cost_seconds'] * 1e3:.1f} ms)" if a["windows"] else ""))
    for layer, by_depth in s["layers"].items():
        parts = [f"depth {d}: recall {a['recall']:.0%} precision {a['precision']:.0%}"
                 f"{'' if a['reads_enabled'] else ' (reads off)'}"
                 for d, a in by_depth.items() if a["actual"]]
        if parts:
            lines.append(f"  prefetch layer {layer}: " + ", ".join(parts))
    return lines
