"""`moeswap probe`: measure this machine's rates for the expert store's cost model."""

from __future__ import annotations

import json


def register(subparsers) -> None:
    p = subparsers.add_parser("probe", help="measure disk, RAM and CPU-kernel rates (cached)")
    p.add_argument("--threads", type=int, default=None, help="kernel threads (default: all cores)")
    p.add_argument("--refresh", action="store_true", help="measure again even if cached")
    p.set_defaults(handler=run_probe)


def run_probe(args) -> int:
    from dataclasses import asdict

    from moeswap.planner.probe import DEFAULT_CACHE, cached_overheads, cached_rates

    rates = cached_rates(args.threads, refresh=args.refresh)
    print(json.dumps({name: f"{value / 1e9:.2f} GB/s" for name, value in asdict(rates).items()},
                     indent=1))
    # The planner's fixed costs: cold-read latency by size, per-block and per-expert overheads.
    overheads = cached_overheads(args.threads, refresh=args.refresh)
    print(json.dumps({"cold_read_ms": {str(size): round(1e3 * seconds, 3)
                                       for size, seconds in overheads.read_seconds},
                      "layer_step_ms": round(1e3 * overheads.layer_step, 3),
                      "expert_call_ms": round(1e3 * overheads.expert_call, 3)}, indent=1))
    print(f"cached in {DEFAULT_CACHE}")
    return 0
