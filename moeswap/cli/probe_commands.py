"""`moeswap probe`: measure this machine's rates for the expert store's cost model."""

from __future__ import annotations

from moeswap.cli.common_args import add_threads_argument
from moeswap.cli.console import stdout_console


def register(subparsers) -> None:
    p = subparsers.add_parser("probe", help="measure disk, RAM and CPU-kernel rates (cached)")
    add_threads_argument(p, help="kernel threads (default: all cores)")
    p.add_argument("--refresh", action="store_true", help="measure again even if cached")
    p.set_defaults(handler=run_probe)


def run_probe(args) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    from moeswap.planner.probe import DEFAULT_CACHE, cached_overheads, cached_rates

    with Console(stderr=True).status("probing") as status:
        def on_step(step: str) -> None:
            status.update(f"measuring {step}")

        rates = cached_rates(args.threads, DEFAULT_CACHE, args.refresh, on_step)
        # the planner's fixed costs: cold-read latency by size, per-block and per-expert costs
        overheads = cached_overheads(args.threads, DEFAULT_CACHE, args.refresh, on_step)
    gpu = torch.cuda.is_available()
    table = Table(title=f"this machine ({args.threads or 'all'} threads)", show_header=False)
    table.add_column("what")
    table.add_column("measured", justify="right")
    table.add_row("cold disk reads", f"{rates.disk_read / 1e9:.2f} GB/s")
    table.add_row("CPU product over Q8_0 bytes (one token)", f"{rates.host_compute / 1e9:.2f} GB/s")
    if gpu:  # on a CPU-only machine the link is a RAM copy and the device is the CPU
        table.add_row("host to GPU copy (pinned)", f"{rates.link / 1e9:.2f} GB/s")
        table.add_row("GPU product over Q8_0 bytes", f"{rates.device_compute / 1e9:.2f} GB/s")
    else:
        table.add_row("RAM copy", f"{rates.link / 1e9:.2f} GB/s")
    for size, seconds in overheads.read_seconds:
        table.add_row(f"one cold read of {size >> 10} KiB", f"{1e3 * seconds:.3f} ms")
    table.add_row("decode step, per block", f"{1e3 * overheads.layer_step:.3f} ms")
    table.add_row("decode step, per expert served", f"{1e3 * overheads.expert_call:.3f} ms")
    console = stdout_console(highlight=False)
    console.print(table)
    console.print(f"cached in {DEFAULT_CACHE}{'' if gpu else '; no GPU here'}", markup=False)
    return 0
