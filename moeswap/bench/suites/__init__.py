"""``moeswap bench --suite NAME [options]``: measurements beside the scenarios, each a module here
with ``add_arguments(parser)`` and ``run(args, out_dir) -> (report body, markdown)``. They share
the scenarios' workers (moeswap.bench.worker), timing, memory sampling and report files
(moeswap.bench.report.write_suite_report: report.json and report.md in ``-o DIR``)."""

from __future__ import annotations

import importlib
from types import ModuleType

from moeswap.errors import MoeswapError

SUITES = {
    "decode": "prompt and decode tokens/s, moeswap beside llama.cpp, on real and generated models",
    "offload": "a generated model run from disk through the expert store: the RssAnon check, "
               "policies x budgets, replay preparation",
    "prefetch": "prefetch off / depth 1, 2, 4 on a model read from disk; a long soak (stress)",
    "server": "`moeswap serve` under concurrent requests, batched versus one at a time",
    "kernels": "quantized matrix products: GB/s against the memory roofline, accuracy",
    "plan": "the planner's predicted decode tokens/s against measured runs (measured); the "
            "seeds' worked cases from real published shapes (cases)",
    "recorder": "decode ms/token with the routing recorder off, on, and on with router "
                "probabilities",
    "trained": "the built-in trained model on held-out text: its routing profile, policies x "
               "budgets, the quality cost of --expert-threshold and --miss-lowbit",
    "traces": "cache policies simulated on the real routing traces in ../shared/traces "
              "(docs/TRACES.md's table)",
    "gap": "the decay policy against LRU, LFU, S3-FIFO, ARC, learned and Belady, out of sample, "
           "on the primary trace (tests/data/stdlib-moe-code) and the real traces",
}


def suite_module(name: str) -> ModuleType:
    if name not in SUITES:
        raise MoeswapError(f"unknown suite {name!r}; choose from {', '.join(SUITES)}")
    return importlib.import_module(f"moeswap.bench.suites.{name}")
