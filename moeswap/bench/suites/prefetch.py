"""``--suite prefetch``: prefetch off / depth 1 / 2 / 4 (adaptive) on a model run from disk at a
small budget (was scripts/bench_prefetch.py).

    moeswap bench --suite prefetch table [--model M] [--replay-routing TRACE] [--predictor gate]
                  [--link disk | --link simulated:GBPS] [--experts-share 0.25] [--tokens 32]
                  [--repeats 3] -o DIR
        every (setting, repeat) in its own worker, settings interleaved within each repeat;
        medians of decode tokens/s, stall seconds, the load time prefetch hid and its share,
        what prefetch cost the store's thread, recall per depth and the throttle's forwards
        on/off, each with the spread (min-max over repeats) as the noise band. Settings: off;
        depth 1, 2, 4 as shipped (adaptive: the throttle keeps prefetch only where, by the
        store's counts, it hides more read time than it costs); and depth 2 held on (the
        throttle bypassed: what prefetch hides and costs)
    moeswap bench --suite prefetch stress [--model M] [--steps 10000] -o DIR
        a tiny budget (10 % of the routed bytes: on the built-in model 9 host slots, below one
        token's 12 picks), prefetch both at depth 4 against off, adaptive and held on (throttle
        and precision rule bypassed: the worker reads at every step): the same tokens for every
        decode step, a constant thread count and RssAnon growth under 16 MiB after the first
        tenth; the report says whether it passed

Links: ``disk`` reads the file with cold reads (page cache dropped after every read);
``simulated:GBPS`` stands in for a slow link such as PCIe: reads come from the page cache and
then sleep until the expert's bytes / GBPS have passed (the sleep releases the GIL, like a DMA
wait). Rows on it say "simulated"; with ``--replay-routing`` they say "replayed".
--experts-share is the share of the routed experts' bytes the host budget holds beyond what the
store charges (moeswap.memory.HostCharge). A measurement for a quiet machine, not a test.
"""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path

from moeswap.bench.memory import process_memory
from moeswap.bench.worker import run_call
from moeswap.errors import MoeswapError

SETTINGS = {"off": (0, False), "depth 1": (1, False), "depth 2": (2, False),
            "depth 4": (4, False), "depth 2 held on": (2, True)}  # name: (depth, throttle bypassed)
DEPTHS = (1, 2, 4)
PROMPT = "import os\nimport sys\n\n\ndef main():\n"
HERE = "moeswap.bench.suites.prefetch"


def add_arguments(p) -> None:
    p.add_argument("mode", choices=["table", "stress"])
    p.add_argument("--model", help="a .gguf MoE file (default: the built-in model)")
    p.add_argument("--replay-routing", help="a trace (.npz) whose routing drives the model")
    p.add_argument("--predictor", choices=("gate", "history", "both"), default="gate")
    p.add_argument("--link", default="disk", help="disk, or simulated:GBPS")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--experts-share", type=float, default=0.25)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=10_000, help="stress: decode steps")
    p.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS),
                   help="table: the settings compared (off always)")


def load_with_prefetch(model: str, share: float, mode: str, depth: int, context_tokens: int,
                       threads: int, cold: bool = True, replay: str | None = None):
    """The runtime with a store holding ``share`` of the routed bytes beyond its charge, and
    the store's builder (its ``store`` is reached for the held-on settings)."""
    from moeswap.bench.scenarios import ModelFacts
    from moeswap.experts.build import load_options
    from moeswap.experts.settings import OffloadSettings
    from moeswap.experts.store import routed_bytes
    from moeswap.formats.gguf_file import GGUFFile
    from moeswap.memory import HostCharge
    from moeswap.runtime import load

    facts = ModelFacts.of(model)
    charge = HostCharge.for_sequence(context_tokens)
    budget = facts.budget(0, charge) + int(share * routed_bytes(GGUFFile.open(model),
                                                                facts.config.moe_layers))
    settings = OffloadSettings(host_bytes=budget, cold_reads=cold,
                               prefetch=mode if depth else "off", prefetch_depth=depth)
    options = load_options(settings, charge)
    return load(model, threads=threads, replay_routing=replay, **options), \
        options["expert_runner"]


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


def recall(layers: dict, depth: int) -> float | None:
    checks = [by_depth[depth] for by_depth in layers.values() if depth in by_depth]
    actual = sum(a["actual"] for a in checks)
    return sum(a["hits"] for a in checks) / actual if actual else None


def measure(model: str, setting: str, tokens: int, share: float, threads: int, link: str,
            predictor: str, prompt: str, replay: str | None) -> dict:
    """One setting, in a worker: decode speed, stalls and prefetch's counters."""
    from moeswap.generate import GenerationStats

    depth, held_on = SETTINGS[setting]
    simulated = link.startswith("simulated:")
    if simulated:
        simulate_link(float(link.split(":", 1)[1]))
    rt, builder = load_with_prefetch(model, share, predictor, depth, 64 + tokens, threads,
                                     cold=not simulated, replay=replay)
    if held_on and builder.store.lookahead.prefetch is not None:
        builder.store.lookahead.prefetch.throttle.forward = lambda: True
    stats = GenerationStats()
    out = list(rt.generate(prompt, tokens, temperature=0, stats=stats))
    s = rt.stats()
    row = {"setting": setting, "tokens": out, "tok_s": stats.decode_tokens_per_second,
           "stall_s": s["total"]["stall_seconds"], "disk_mib": s["total"]["disk_bytes"] / 2**20}
    if "prefetch" in s:
        p = s["prefetch"]
        row.update(hidden_s=p["hidden_seconds"], cost_s=p["cost_seconds"], used=p["used"],
                   reads=p["reads"], wasted_mib=p["bytes_wasted"] / 2**20,
                   on=p["adaptive"]["forwards_on"], off=p["adaptive"]["forwards_off"],
                   **{f"recall{d}": recall(p["layers"], d) for d in DEPTHS})
        row["hidden_share"] = row["hidden_s"] / (row["stall_s"] + row["hidden_s"] or 1.0)
    return row


def table(args, model: str, out_dir: Path) -> tuple[dict, str]:
    names = ["off", *(name for name in args.settings if name != "off")]
    rows: dict[str, list[dict]] = {name: [] for name in names}
    started = time.perf_counter()
    for repeat in range(args.repeats):
        for name in names:  # interleaved: slow drifts of the machine hit every setting alike
            r = run_call(f"{HERE}:measure", dict(
                model=model, setting=name, tokens=args.tokens, share=args.experts_share,
                threads=args.threads, link=args.link, predictor=args.predictor,
                prompt=args.prompt, replay=args.replay_routing),
                out_dir / "runs", f"{repeat}-{name.replace(' ', '-')}")
            if r["status"] != "ok":
                raise MoeswapError(f"{name}: {r['failure']}: {r['error']}")
            rows[name].append(r)
    reference = rows["off"][0]["tokens"]
    if any(r["tokens"] != reference for rs in rows.values() for r in rs):
        raise MoeswapError("prefetch changed the output: the settings' tokens differ")
    body = {"model": model, "link": args.link, "predictor": args.predictor,
            "experts_share": args.experts_share, "tokens": args.tokens,
            "repeats": args.repeats, "runs": rows}
    return body, table_text(args, model, rows, time.perf_counter() - started)


def table_text(args, model: str, rows: dict[str, list[dict]], seconds: float) -> str:
    def cell(name: str, key: str, fmt: str) -> str:
        values = [r[key] for r in rows[name] if r.get(key) is not None]
        if not values:
            return "-"
        return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"

    def median(name: str, key: str) -> str:
        return f"{statistics.median(r[key] for r in rows[name]):.0f}"

    off_speed = statistics.median(r["tok_s"] for r in rows["off"])
    labels = [label for label, on in (("replayed", args.replay_routing), ("simulated",
              args.link.startswith("simulated:"))) if on]
    tag = f" ({', '.join(labels)})" if labels else ""
    link = ("cold disk reads" if args.link == "disk" else
            f"simulated link {args.link.split(':', 1)[1]} GB/s (page cache + sleep)")
    lines = [f"model {Path(model).name}{tag}, {link}, predictor {args.predictor}, experts share "
             f"{args.experts_share:.0%}, prompt {args.prompt!r}, {args.tokens} tokens, medians "
             f"of {args.repeats} interleaved repeats (min-max)", "",
             "| prefetch | decode tok/s | vs off | stall s | load s hidden (share) | "
             "main-thread cost s | recall d1 / d2 / d4 | forwards on / off | "
             "reads used / issued |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name in rows:
        speed = statistics.median(r["tok_s"] for r in rows[name])
        extra = ["-", "-", "-", "-"]
        hidden = "-"
        if name != "off":
            extra = [cell(name, "cost_s", ".3f"),
                     " / ".join(cell(name, f"recall{d}", ".0%").split(" (")[0] for d in DEPTHS),
                     "all (held)" if SETTINGS[name][1] else
                     f"{median(name, 'on')} / {median(name, 'off')}",
                     f"{median(name, 'used')} / {median(name, 'reads')}"]
            hidden = (f"{cell(name, 'hidden_s', '.3f')} "
                      f"({cell(name, 'hidden_share', '.0%').split(' (')[0]})")
        lines.append(f"| {name}{tag} | {cell(name, 'tok_s', '.2f')} | {speed / off_speed - 1:+.1%} "
                     f"| {cell(name, 'stall_s', '.3f')} | {hidden} | {' | '.join(extra)} |")
    return "\n".join(lines + ["", f"({seconds:.0f} s)"])


def stress_run(model: str, name: str, steps: int, prompt: str, threads: int) -> dict:
    """One stress setting, in a worker: its tokens, thread counts and RssAnon after each
    generation of 64 tokens."""
    rt, builder = load_with_prefetch(model, 0.10, name.split()[0], 4, 128, threads)
    if name.endswith("held on"):  # neither the throttle nor the precision rule stops it
        builder.store.lookahead.prefetch.throttle.forward = lambda: True
        builder.store.lookahead.prefetch._reads_wanted = lambda target, depth: True
    tokens, thread_counts, rss = [], [], []
    for generation in range(steps // 64):
        tokens += list(rt.generate(f"{prompt}    # {generation}\n", 64, temperature=0))
        thread_counts.append(threading.active_count())
        rss.append(process_memory().get("rss_anon", 0))
    return {"tokens": tokens, "threads": thread_counts, "rss_anon": rss,
            "reads": rt.stats().get("prefetch", {}).get("reads", 0)}


def stress(args, model: str, out_dir: Path) -> tuple[dict, str]:
    runs, lines, passed = {}, [], True
    for name in ("off", "both", "both held on"):  # held on: the worker reads at every step
        r = run_call(f"{HERE}:stress_run", dict(model=model, name=name, steps=args.steps,
                                                prompt=args.prompt, threads=args.threads),
                     out_dir / "runs", name.replace(" ", "-"))
        if r["status"] != "ok":
            raise MoeswapError(f"{name}: {r['failure']}: {r['error']}")
        runs[name] = r
        settled = r["rss_anon"][len(r["rss_anon"]) // 10]
        growth = max(r["rss_anon"]) - settled
        steady = len(set(r["threads"])) == 1 and growth < 16 * 2**20
        passed &= steady
        lines.append(f"{name}: {len(r['tokens'])} decode steps, threads {min(r['threads'])}-"
                     f"{max(r['threads'])}, RssAnon growth after the first tenth "
                     f"{growth / 2**20:.1f} MiB, prefetch reads {r['reads']}"
                     + ("" if steady else " (FAIL: threads or memory grew)"))
    same = runs["off"]["tokens"] == runs["both"]["tokens"] == runs["both held on"]["tokens"]
    passed &= same
    lines.append("identical output" if same else "FAIL: prefetch changed the output")
    body = {"model": model, "steps": args.steps, "passed": passed,
            "runs": {n: {k: v for k, v in r.items() if k != "tokens"} for n, r in runs.items()}}
    return body, "\n".join(lines)


def run(args, out_dir: Path) -> tuple[dict, str]:
    model = args.model or args.default_model
    return (table if args.mode == "table" else stress)(args, model, out_dir)
