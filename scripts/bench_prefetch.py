"""Prefetch off / depth 1 / 2 / 4 (adaptive) on a model run from disk at a small budget.

    python scripts/bench_prefetch.py table [--model M] [--replay-routing TRACE] [--predictor gate]
                                           [--link disk | --link simulated:GBPS]
                                           [--experts-share 0.25] [--tokens 32] [--repeats 3]
                                           [--markdown out.md]
        every (setting, repeat) in a fresh subprocess, settings interleaved within each repeat;
        prints medians of decode tokens/s, stall seconds, the load time prefetch hid and its
        share, what prefetch cost the store's thread, recall per depth and the throttle's forwards on/off, each with the spread
        (min-max over repeats) as the noise band. Settings: off; depth 1, 2, 4 as shipped
        (adaptive: the throttle keeps prefetch only where measured faster); and depth 2 held on
        (the throttle bypassed: what prefetch itself hides and costs)
    python scripts/bench_prefetch.py stress [--model M] [--steps 10000]
        a tiny budget (10 % of the routed bytes: on the built-in model 9 host slots, below one
        token's 12 picks, one of them reserved for guesses), prefetch both at depth 4 against
        off, adaptive and held on (throttle and precision rule bypassed: the worker reads at
        every step): the same tokens for every decode step, a constant thread count and RssAnon
        growth under 16 MiB after the first tenth

Links: ``disk`` reads the file with cold reads (page cache dropped after every read);
``simulated:GBPS`` stands in for a slow link such as PCIe: reads come from the page cache and
then sleep until the expert's bytes / GBPS have passed (the sleep releases the GIL, like a DMA
wait). Rows on it are labelled "simulated". With ``--replay-routing`` the rows are labelled
"replayed": a recorded trace's routing drives the model (docs/OFFLOAD.md, "Replayed routing").

The default model is the shipped moeswap/data/stdlib-moe-q8_0.gguf. --experts-share is the share
of the routed experts' bytes the host budget holds beyond shared weights, KV cache and staging.
Run it on a quiet machine: it is a measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "moeswap" / "data" / "stdlib-moe-q8_0.gguf"
SETTINGS = {"off": (0, False), "depth 1": (1, False), "depth 2": (2, False),
            "depth 4": (4, False), "depth 2 held on": (2, True)}  # name: (depth, throttle bypassed)
DEPTHS = (1, 2, 4)
PROMPT = "import os\nimport sys\n\n\ndef main():\n"


def host_budget(model: Path, share: float, context_tokens: int) -> int:
    from moeswap.memory import kv_bytes_per_token
    from moeswap.experts.store import routed_bytes, shared_bytes
    from moeswap.experts.tiers import slot_bytes
    from moeswap.formats.config import config_from_gguf
    from moeswap.formats.gguf_file import GGUFFile
    from moeswap.models.quant_experts import ExpertLayout

    gguf = GGUFFile.open(model)
    config = config_from_gguf(gguf)
    layers = config.moe_layers
    slot = slot_bytes([ExpertLayout.from_file(gguf, i) for i in layers])
    fixed = (shared_bytes(gguf, layers) + kv_bytes_per_token(config) * context_tokens
             + config.n_expert_used * slot)
    return fixed + int(share * routed_bytes(gguf, layers))


def simulate_link(gbps: float) -> None:
    """Every expert read lasts at least its bytes / gbps: the rest of the time is slept."""
    from moeswap.experts.tiers import DiskReader

    read = DiskReader.read_expert

    def slow_read(self, layout, expert, slot):
        started = time.perf_counter()
        read(self, layout, expert, slot)
        left = layout.expert_bytes / (gbps * 1e9) - (time.perf_counter() - started)
        if left > 0:
            time.sleep(left)
            self.stats.seconds += left

    DiskReader.read_expert = slow_read


def runtime(model: Path, budget: int, mode: str, depth: int, context_tokens: int, threads: int,
            cold: bool = True, replay: str | None = None):
    import moeswap
    from moeswap.experts.store import ExpertStore, StoreOptions

    factory = ExpertStore.factory(StoreOptions(
        host_bytes=budget, context_tokens=context_tokens, cold_reads=cold,
        prefetch=mode if depth else "off", prefetch_depth=depth))
    return moeswap.load(model, threads=threads, expert_runner=factory,
                        replay_routing=replay), factory


def recall(layers: dict, depth: int) -> float | None:
    checks = [by_depth[depth] for by_depth in layers.values() if depth in by_depth]
    actual = sum(a["actual"] for a in checks)
    return sum(a["hits"] for a in checks) / actual if actual else None


def worker(args) -> None:
    """One measurement: prints one JSON line."""
    from moeswap.generate import GenerationStats

    depth, held_on = SETTINGS[args.setting]
    simulated = args.link.startswith("simulated:")
    if simulated:
        simulate_link(float(args.link.split(":", 1)[1]))
    context = 64 + args.tokens
    rt, factory = runtime(args.model, host_budget(args.model, args.experts_share, context),
                          args.predictor, depth, context, args.threads, cold=not simulated,
                          replay=args.replay_routing)
    if held_on and factory.store.lookahead.prefetch is not None:
        factory.store.lookahead.prefetch.throttle.forward = lambda n_tokens: True
    stats = GenerationStats()
    tokens = list(rt.generate(args.prompt, args.tokens, temperature=0, stats=stats))
    s = rt.stats()
    row = {"setting": args.setting, "tokens": tokens, "tok_s": stats.decode_tokens_per_second,
           "stall_s": s["total"]["stall_seconds"], "disk_mib": s["total"]["disk_bytes"] / 2**20}
    if "prefetch" in s:
        p = s["prefetch"]
        row.update(hidden_s=p["hidden_seconds"], cost_s=p["cost_seconds"], used=p["used"],
                   reads=p["reads"],
                   wasted_mib=p["bytes_wasted"] / 2**20,
                   on=p["adaptive"]["forwards_on"], off=p["adaptive"]["forwards_off"],
                   **{f"recall{d}": recall(p["layers"], d) for d in DEPTHS})
        row["hidden_share"] = row["hidden_s"] / (row["stall_s"] + row["hidden_s"] or 1.0)
    print(json.dumps(row))


def table(args) -> None:
    names = ["off", *(name for name in args.settings if name != "off")]
    rows: dict[str, list[dict]] = {name: [] for name in names}
    started = time.perf_counter()
    for repeat in range(args.repeats):
        for name in names:  # interleaved: slow drifts of the machine hit every setting alike
            command = [sys.executable, __file__, "worker", "--model", str(args.model),
                       "--setting", name, "--tokens", str(args.tokens), "--experts-share",
                       str(args.experts_share), "--threads", str(args.threads), "--link",
                       args.link, "--predictor", args.predictor, "--prompt", args.prompt]
            if args.replay_routing:
                command += ["--replay-routing", args.replay_routing]
            done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
            if done.returncode:
                sys.exit(f"{name}: {done.stderr[-2000:]}")
            rows[name].append(json.loads(done.stdout.splitlines()[-1]))
            print(f"repeat {repeat + 1}/{args.repeats} {name}: {rows[name][-1]['tok_s']:.2f} "
                  f"tok/s ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    reference = rows["off"][0]["tokens"]
    assert all(r["tokens"] == reference for rs in rows.values() for r in rs), "outputs differ"

    def cell(name: str, key: str, fmt: str) -> str:
        values = [r[key] for r in rows[name] if r.get(key) is not None]
        if not values:
            return "-"
        return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"

    off_speed = statistics.median(r["tok_s"] for r in rows["off"])
    labels = [label for label, on in (("replayed", args.replay_routing), ("simulated",
              args.link.startswith("simulated:"))) if on]
    tag = f" ({', '.join(labels)})" if labels else ""
    link = ("cold disk reads" if args.link == "disk" else
            f"simulated link {args.link.split(':', 1)[1]} GB/s (page cache + sleep)")
    lines = [f"model {args.model.name}{tag}, {link}, predictor {args.predictor}, experts share "
             f"{args.experts_share:.0%}, prompt {args.prompt!r}, {args.tokens} tokens, "
             f"medians of {args.repeats} "
             "interleaved repeats (min-max)", "",
             "| prefetch | decode tok/s | vs off | stall s | load s hidden (share) | "
             "main-thread cost s | recall d1 / d2 / d4 | forwards on / off | "
             "reads used / issued |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name in names:
        speed = statistics.median(r["tok_s"] for r in rows[name])
        extra = ["-", "-", "-", "-"]
        if name != "off":
            extra = [cell(name, "cost_s", ".3f"), " / ".join(cell(name, f"recall{d}", ".0%").split(" (")[0]
                                for d in DEPTHS),
                     "all (held)" if SETTINGS[name][1] else
                     " / ".join(f"{statistics.median(r[k] for r in rows[name]):.0f}"
                                for k in ("on", "off")),
                     " / ".join(f"{statistics.median(r[k] for r in rows[name]):.0f}"
                                for k in ("used", "reads"))]
        hidden = "-" if name == "off" else (f"{cell(name, 'hidden_s', '.3f')} "
                                            f"({cell(name, 'hidden_share', '.0%').split(' (')[0]})")
        lines.append(f"| {name}{tag} | {cell(name, 'tok_s', '.2f')} | {speed / off_speed - 1:+.1%} "
                     f"| {cell(name, 'stall_s', '.3f')} | {hidden} | {' | '.join(extra)} |")
    lines.append("")
    lines.append(f"({time.perf_counter() - started:.0f} s)")
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")


def rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def stress(args) -> None:
    runs = {}
    for name in ("off", "both", "both held on"):  # held on: the worker reads at every step
        mode = name.split()[0]
        rt, factory = runtime(args.model, host_budget(args.model, 0.10, 128), mode, 4, 128,
                              args.threads)
        if name.endswith("held on"):  # neither the throttle nor the precision rule stops it
            factory.store.lookahead.prefetch.throttle.forward = lambda n_tokens: True
            factory.store.lookahead.prefetch._reads_wanted = lambda target, depth: True
        tokens, threads, rss = [], [], []
        for generation in range(args.steps // 64):
            tokens += list(rt.generate(f"{args.prompt}    # {generation}\n", 64,
                                       temperature=0))
            threads.append(threading.active_count())
            rss.append(rss_anon())
        runs[name] = tokens
        settled = rss[len(rss) // 10]
        reads = rt.stats().get("prefetch", {}).get("reads", 0)
        print(f"{name}: {len(tokens)} decode steps, threads {min(threads)}-{max(threads)}, "
              f"RssAnon growth after the first tenth {(max(rss) - settled) / 2**20:.1f} MiB, "
              f"prefetch reads {reads}")
        assert len(set(threads)) == 1, threads
        assert max(rss) - settled < 16 * 2**20
    assert runs["off"] == runs["both"] == runs["both held on"], "prefetch changed the output"
    print("identical output, no thread or memory growth")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    for name in ("table", "worker", "stress"):
        p = sub.add_parser(name)
        p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
        p.add_argument("--replay-routing", help="a trace (.npz) whose routing drives the model")
        p.add_argument("--predictor", choices=("gate", "history", "both"), default="gate")
        p.add_argument("--link", default="disk", help="disk, or simulated:GBPS")
        p.add_argument("--threads", type=int, default=2)
        p.add_argument("--tokens", type=int, default=32)
        p.add_argument("--prompt", default=PROMPT)
        p.add_argument("--experts-share", type=float, default=0.25)
        p.add_argument("--repeats", type=int, default=3)
        p.add_argument("--steps", type=int, default=10_000)
        p.add_argument("--setting", choices=SETTINGS, default="depth 2")
        p.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS),
                       help="table: the settings compared (off always)")
        p.add_argument("--markdown")
    args = ap.parse_args()
    {"table": table, "worker": worker, "stress": stress}[args.command](args)


if __name__ == "__main__":
    main()
