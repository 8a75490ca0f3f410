"""``--suite trained``: the expert store on the built-in trained model with its own, real routing,
on held-out text (was scripts/offload_trained.py and scripts/offload_lowbit.py).

    moeswap bench --suite trained profile -o DIR
        records the model's routing on windows of its *training* text and builds the routing
        profile the learned policy uses (DIR/train.profile.json: ``--policies
        learned:DIR/train.profile.json``), so that the text the policy learned from is not the
        text it is scored on
    moeswap bench --suite trained table --policies lru lfu learned:PROFILE -o DIR
        decode tokens/s and hit rate for expert RAM budgets of 0, 10, 25, 50, 100 % of the
        routed experts' slots (the rest read from the file, cold reads), per --policies entry
    moeswap bench --suite trained threshold -o DIR
        the quality cost of --expert-threshold P (an approximation): KL divergence from the
        fully resident model and perplexity, beside how often it fired and the bytes it saved
    moeswap bench --suite trained lowbit -o DIR
        the same for --miss-lowbit: each row's copy type, host policy and share of the routed
        experts in full-precision host slots; how often a copy served a request (the share of
        expert requests), the full-precision bytes those fires did not read, the copies' bytes

The model is a GGUF file (--model, default the built-in model). Its text is training's corpus
split (training/train.py: the Python standard library's files, every 20th held out), encoded
with the GGUF's own tokenizer, one end-of-text token after each file as training did. Scored
windows are fed one token at a time (teacher-forced, a fresh cache per window), so the router
sees real text. The host budget of a row is what the store charges (moeswap.memory.HostCharge,
no context: the windows' caches are not the budget's; the copies with --miss-lowbit) plus
the row's share of the routed experts' slots. Each mode runs in one worker.
"""

from __future__ import annotations

import math
import sysconfig
import time
from pathlib import Path

from moeswap.bench.worker import run_call
from moeswap.errors import MoeswapError

HERE = "moeswap.bench.suites.trained"
SHARES = (0.0, 0.10, 0.25, 0.50, 1.0)
HELD_OUT_EVERY = 20  # training/train.py's split: every 20th file held out
PROFILE_FILES_EVERY = 40  # the profile's text: every 40th training file (encoding all is slow)
SKIPPED = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}  # as training
# --miss-lowbit rows: (copy type, host policy, share of the routed experts in host slots)
LOWBIT_ROWS = [("q4_0", "lru", 0.0), ("q4_k", "lru", 0.0), ("q5_0", "lru", 0.0),
               ("q6_k", "lru", 0.0), ("q4_0", "admit:2", 0.25), ("q4_0", "admit:4", 0.25),
               ("q4_0", "lru", 0.25)]


def add_arguments(p) -> None:
    p.add_argument("mode", choices=["profile", "table", "threshold", "lowbit"])
    p.add_argument("--model", help="the trained model's GGUF (default: the built-in one)")
    p.add_argument("--windows", type=int, default=4, help="text windows (4)")
    p.add_argument("--length", type=int, default=64, help="tokens per window (64)")
    p.add_argument("--policies", nargs="+", default=["lru", "lfu"], help="table: host policies")
    p.add_argument("--thresholds", nargs="+", type=float, default=[0.02, 0.05, 0.1],
                   help="threshold: the --expert-threshold values")
    p.add_argument("--threads", type=int, default=1)


def corpus_texts(split: str) -> list[str]:
    """The held-out files' texts, or every PROFILE_FILES_EVERY-th training file's."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py")
                   if not SKIPPED & set(p.relative_to(stdlib).parts))
    chosen = files[::HELD_OUT_EVERY] if split == "held-out" else \
        [f for i, f in enumerate(files) if i % HELD_OUT_EVERY][::PROFILE_FILES_EVERY]
    return [p.read_text(encoding="utf-8", errors="replace") for p in chosen]


def text_windows(tokenizer, split: str, n_windows: int, length: int) -> list:
    """``n_windows`` evenly spaced windows of ``length`` tokens of the split's text."""
    import numpy as np
    import torch

    ids: list[int] = []
    for text in corpus_texts(split):
        ids += tokenizer.encode(text, add_special=False, parse_special=False) + [tokenizer.eos_id]
    starts = np.linspace(0, len(ids) - length - 1, n_windows).astype(np.int64)
    return [torch.tensor(ids[s:s + length]) for s in starts]


def teacher_forced(model, windows: list):
    """Logits [windows * length, V], one token per forward call."""
    import torch

    out = []
    for window in windows:
        cache = model.new_cache()
        out += [model.forward([window[i:i + 1]], [cache])[0] for i in range(len(window))]
    return torch.cat(out)


def offloaded(path: str, threads: int, share: float, lowbit: str = "", **settings):
    """The model run through a store whose host budget is the charge (with ``lowbit`` copies of
    every routed expert) plus ``share`` of the routed experts' slots -> (runtime, budget)."""
    from moeswap.bench.scenarios import ModelFacts
    from moeswap.experts.build import load_options
    from moeswap.experts.lowbit import lowbit_layout, lowbit_type
    from moeswap.experts.settings import OffloadSettings
    from moeswap.experts.tiers import slot_bytes
    from moeswap.formats.gguf_file import GGUFFile
    from moeswap.memory import HostCharge
    from moeswap.models.quant_experts import ExpertLayout
    from moeswap.runtime import load

    facts, charge = ModelFacts.of(path), HostCharge()
    n_experts = facts.moe_layers * facts.n_expert
    copies = 0
    if lowbit:
        gguf = GGUFFile.open(path)
        layouts = [ExpertLayout.from_file(gguf, i) for i in facts.config.moe_layers]
        copies = n_experts * slot_bytes([lowbit_layout(layout, lowbit_type(lowbit))
                                         for layout in layouts])
    budget = charge.bytes(facts.config, facts.shared_bytes, facts.n_used * facts.slot_bytes,
                          copies) + int(share * n_experts) * facts.slot_bytes
    offload = OffloadSettings(host_bytes=budget, miss_lowbit=lowbit, **settings)
    return load(path, threads=threads, **load_options(offload, charge)), budget


def profile(path: str, n_windows: int, length: int, threads: int, output: str) -> dict:
    """In a worker: record the routing of training-text windows (one forward per window) and
    save its profile at ``output``."""
    from moeswap.routing.profile import build_profile
    from moeswap.routing.recorder import RoutingRecorder
    from moeswap.runtime import load

    recorder = RoutingRecorder()
    runtime = load(path, threads=threads, recorder=recorder)
    windows = text_windows(runtime.tokenizer, "train", n_windows, length)
    for window in windows:
        runtime.model.forward([window], [runtime.model.new_cache()])
    c, name = runtime.config, Path(path).name
    trace = recorder.trace(model=name, arch=c.arch, layers=c.moe_layers, n_experts=c.n_expert,
                           k=c.n_expert_used, source=f"{name} on training text")
    budget = len(c.moe_layers) * c.n_expert // 4  # the hot set (used by pinned:, not by learned:)
    built = build_profile(trace, budget, per_layer=False,
                          source=f"{len(windows)} x {length} tokens of training text "
                                 f"(every {PROFILE_FILES_EVERY}th training file)")
    built.save(output)
    return {"profile": output, "reuse_window": built.reuse.window, "tokens": trace.n_tokens}


def speed(path: str, n_windows: int, length: int, threads: int, policies: list[str]) -> dict:
    """In a worker: every (policy, share) on held-out windows, each with a fresh store."""
    from moeswap.tokenizer import load_tokenizer

    windows = text_windows(load_tokenizer(Path(path)), "held-out", n_windows, length)
    n_tokens, rows = sum(len(w) for w in windows), []
    for policy in policies:
        for share in SHARES:
            runtime, budget = offloaded(path, threads, share, policy=policy, cold_reads=True)
            started = time.perf_counter()
            teacher_forced(runtime.model, windows)
            seconds = time.perf_counter() - started
            t = runtime.stats()["total"]
            rows.append({"policy": policy, "experts_share": share, "host_budget": budget,
                         "tokens_per_s": n_tokens / seconds, "hit_rate": t["hit_rate"],
                         "disk_bytes": t["disk_bytes"]})
    return {"tokens": n_tokens, "results": rows}


class ResidentReference:
    """Held-out windows, fed one token at a time, scored by the fully resident model: an
    approximation's KL divergence from it and perplexity on the next tokens."""

    def __init__(self, path: str, n_windows: int, length: int, threads: int):
        import torch

        from moeswap.models.quant_experts import QuantResidentExperts
        from moeswap.runtime import load

        resident = load(path, threads=threads, expert_runner=QuantResidentExperts)
        self.windows = text_windows(resident.tokenizer, "held-out", n_windows, length)
        c = resident.config
        self.picks_per_token = c.n_expert_used * len(c.moe_layers)  # expert requests per token
        self._targets = torch.cat([w[1:] for w in self.windows])  # next tokens
        self._keep = torch.cat([torch.arange(len(w) - 1) + sum(len(v) for v in self.windows[:i])
                                for i, w in enumerate(self.windows)])  # positions with a next token
        self._logp, self.perplexity = self._scores(resident.model)

    def _scores(self, model):
        import torch

        logp = torch.log_softmax(teacher_forced(model, self.windows)[self._keep].double(), dim=-1)
        return logp, math.exp(-float(logp.gather(1, self._targets[:, None]).mean()))

    def compare(self, model) -> tuple[float, float]:
        """(KL(resident || model) nats per token, model's perplexity)."""
        logp, ppl = self._scores(model)
        return float((self._logp.exp() * (self._logp - logp)).sum(-1).mean()), ppl


def quality(path: str, n_windows: int, length: int, threads: int, rows: list[dict]) -> dict:
    """In a worker: the resident reference, then each row (``offloaded``'s share, lowbit and
    settings) scored against it; a row whose store is refused says why."""
    reference = ResidentReference(path, n_windows, length, threads)
    results = []
    for row in rows:
        try:
            runtime, budget = offloaded(path, threads, **row)
        except MoeswapError as e:
            results.append({**row, "refused": str(e)})
            continue
        kl, ppl = reference.compare(runtime.model)
        s = runtime.stats()
        t, low = s["total"], s.get("lowbit", {})
        results.append({**row, "host_budget": budget, "kl": kl, "perplexity": ppl,
                        "requests": t["requests"], "threshold_drops": t["threshold_drops"],
                        "threshold_saved_bytes": t["threshold_saved_bytes"],
                        "lowbit_fires": low.get("fires", 0),
                        "lowbit_saved_bytes": low.get("saved_bytes", 0),
                        "lowbit_held_bytes": low.get("held_bytes", 0)})
    return {"tokens": sum(len(w) for w in reference.windows),
            "picks_per_token": reference.picks_per_token,
            "resident_perplexity": reference.perplexity, "results": results}


def table_text(body: dict) -> str:
    lines = ["| policy | expert RAM budget | decode tokens/s | hit rate | disk read MiB |",
             "|---|---:|---:|---:|---:|"]
    for r in body["results"]:
        name = r["policy"].split(":")[0] if r["policy"].startswith("learned:") else r["policy"]
        lines.append(f"| {name} | {r['experts_share']:.0%} | {r['tokens_per_s']:.1f} | "
                     f"{r['hit_rate']:.1%} | {r['disk_bytes'] / 2**20:.1f} |")
    return "\n".join(lines)


def threshold_text(body: dict) -> str:
    picks = body["picks_per_token"] * body["tokens"]
    lines = ["| --expert-threshold | KL(resident ‖ approx) nats/token | perplexity | "
             "picks dropped | expert bytes not read |", "|---:|---:|---:|---:|---:|",
             f"| off (resident) | 0 | {body['resident_perplexity']:.3f} | 0 | 0 |"]
    for r in body["results"]:
        lines.append(f"| {r['threshold']} | {r['kl']:.2e} | {r['perplexity']:.3f} | "
                     f"{r['threshold_drops'] / max(picks, 1):.1%} | "
                     f"{r['threshold_saved_bytes'] / 2**20:.1f} MiB |")
    return "\n".join(lines)


def lowbit_text(body: dict) -> str:
    lines = ["| --miss-lowbit | host policy | full-precision expert RAM | KL(resident ‖ approx) "
             "nats/token | perplexity | fired (share of expert requests) | full-precision MiB "
             "not read | copies MiB |", "|---|---|---:|---:|---:|---:|---:|---:|",
             f"| off (resident) | - | 100% | 0 | {body['resident_perplexity']:.3f} | 0 | 0 | 0 |"]
    refused = []
    for r in body["results"]:
        if "refused" in r:
            refused.append(f"{r['lowbit']} ({r['policy']}, {r['share']:.0%}): refused: "
                           f"{r['refused']}")
            continue
        lines.append(f"| {r['lowbit']} | {r['policy']} | {r['share']:.0%} | {r['kl']:.2e} | "
                     f"{r['perplexity']:.3f} | {r['lowbit_fires'] / max(r['requests'], 1):.1%} | "
                     f"{r['lowbit_saved_bytes'] / 2**20:.1f} | "
                     f"{r['lowbit_held_bytes'] / 2**20:.1f} |")
    return "\n".join(lines + ([""] + refused if refused else []))


def profile_text(body: dict) -> str:
    return (f"profile: {body['profile']} (reuse window {body['reuse_window']} tokens, from "
            f"{body['tokens']} training-text tokens); use --policies learned:{body['profile']}")


def run(args, out_dir: Path) -> tuple[dict, str]:
    model = str(args.model or args.default_model)
    common = dict(path=model, n_windows=args.windows, length=args.length, threads=args.threads)
    lowbit_rows = [dict(share=share, lowbit=type_name, policy=policy)
                   for type_name, policy, share in LOWBIT_ROWS]
    function, extra, text = {
        "profile": (profile, dict(output=str((out_dir / "train.profile.json").resolve())),
                    profile_text),
        "table": (speed, dict(policies=args.policies), table_text),
        "threshold": (quality, dict(rows=[dict(share=1.0, threshold=p) for p in args.thresholds]),
                      threshold_text),
        "lowbit": (quality, dict(rows=lowbit_rows), lowbit_text)}[args.mode]
    body = run_call(f"{HERE}:{function.__name__}", {**common, **extra}, out_dir / "runs", args.mode)
    if body.pop("status") != "ok":
        raise MoeswapError(f"the {args.mode} worker failed ({body['failure']}): {body['error']}")
    body = {"model": model, "windows": args.windows, "length": args.length, **body}
    return body, text(body)
