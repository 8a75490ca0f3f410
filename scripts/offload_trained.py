"""The expert store on the built-in trained model with its own, real routing: held-out text.

    python scripts/offload_trained.py profile -o /tmp/moeswap-models/stdlib-moe-train.profile.json
        records the model's routing on windows of its *training* text and builds the routing
        profile the learned policy uses (`--policies learned:PROFILE`), so that the text the
        policy learned from is not the text it is scored on
    python scripts/offload_trained.py table --policies lru lfu learned:PROFILE --markdown t.md
        decode tokens/s and hit rate for expert RAM budgets of 0, 10, 25, 50, 100 % of the
        routed bytes (the rest read from the file, cold reads), per --policies entry, on
        windows of the *held-out* text
    python scripts/offload_trained.py threshold --markdown q.md
        the quality cost of --expert-threshold P (an approximation): KL divergence from the
        fully resident model and perplexity, beside how often it fired and the bytes it saved

The model is a GGUF file (--model, default the built-in moeswap/data/stdlib-moe-q8_0.gguf). Its
text is training's corpus split (training/train.py: every 20th stdlib file held out), encoded
with the GGUF's own tokenizer, one end-of-text token after each file as training did. Scored
windows are fed one token at a time (teacher-forced, a fresh cache per window), so the router
sees real text.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "training"))

PROFILE_FILES_EVERY = 40  # the profile's text: every 40th training file (encoding all is slow)


def text_windows(model_path: Path, split: str, n_windows: int, length: int) -> list[torch.Tensor]:
    """``n_windows`` evenly spaced windows of ``length`` tokens of the training or held-out text."""
    from train import corpus_files, split_corpus

    from moeswap.tokenizer import load_tokenizer

    train, held_out = split_corpus(corpus_files())
    texts = held_out if split == "held-out" else train[::PROFILE_FILES_EVERY]
    tokenizer = load_tokenizer(model_path)
    ids: list[int] = []
    for text in texts:
        ids += tokenizer.encode(text, add_special=False, parse_special=False) + [tokenizer.eos_id]
    starts = np.linspace(0, len(ids) - length - 1, n_windows).astype(np.int64)
    return [torch.tensor(ids[s:s + length]) for s in starts]


def teacher_forced(model, windows: list[torch.Tensor]) -> torch.Tensor:
    """Logits [windows * length, V], one token per forward call."""
    out = []
    for window in windows:
        cache = model.new_cache()
        out += [model.forward([window[i:i + 1]], [cache])[0] for i in range(len(window))]
    return torch.cat(out)


def store(path: Path, share: float, threads: int, **options):
    from moeswap.experts.build import build_store
    from moeswap.experts.settings import OffloadSettings
    from moeswap.experts.store import shared_bytes
    from moeswap.experts.tiers import slot_bytes
    from moeswap.formats.config import config_from_gguf
    from moeswap.formats.gguf_file import GGUFFile
    from moeswap.memory import HostCharge
    from moeswap.models import load_model
    from moeswap.models.quant_experts import ExpertLayout

    gguf = GGUFFile.open(path)
    config = config_from_gguf(gguf)
    layers = config.moe_layers
    slot = slot_bytes([ExpertLayout.from_file(gguf, i) for i in layers])
    n_experts = len(layers) * config.n_expert
    # no context charged: the windows' caches are not the budget's (as before)
    host = HostCharge().bytes(config, shared_bytes(gguf, layers), config.n_expert_used * slot) \
        + int(share * n_experts) * slot
    factory = build_store(OffloadSettings(host_bytes=host, **options))
    picks_per_token = config.n_expert_used * len(layers)
    return load_model(path, threads=threads, expert_runner=factory), factory, picks_per_token


def profile(args, path: Path) -> list[str]:
    """Record the routing of training-text windows (one forward per window) and profile it."""
    from moeswap.models import load_model
    from moeswap.routing.profile import build_profile
    from moeswap.routing.recorder import RoutingRecorder

    windows = text_windows(path, "train", args.windows, args.length)
    recorder = RoutingRecorder()
    model = load_model(path, threads=args.threads, recorder=recorder)
    for window in windows:
        model.forward([window], [model.new_cache()])
    c = model.config
    trace = recorder.trace(model=path.name, arch=c.arch, layers=c.moe_layers, n_experts=c.n_expert,
                           k=c.n_expert_used, source=f"{path.name} on training text")
    budget = len(c.moe_layers) * c.n_expert // 4  # the hot set (used by pinned:, not by learned:)
    built = build_profile(trace, budget, per_layer=False,
                          source=f"{len(windows)} x {args.length} tokens of training text "
                                 f"(every {PROFILE_FILES_EVERY}th training file)")
    built.save(args.output)
    return [f"profile: {args.output} (reuse window {built.reuse.window} tokens, from "
            f"{trace.n_tokens} training-text tokens); use --policies learned:{args.output}"]


def table(args, path: Path) -> list[str]:
    windows = text_windows(path, "held-out", args.windows, args.length)
    n_tokens = sum(len(w) for w in windows)
    lines = ["| policy | expert RAM budget | decode tokens/s | hit rate | disk read MiB |",
             "|---|---:|---:|---:|---:|"]
    for policy in args.policies:
        for share in (0.0, 0.10, 0.25, 0.50, 1.0):
            model, factory, _ = store(path, share, args.threads, policy=policy, cold_reads=True)
            started = time.perf_counter()
            teacher_forced(model, windows)
            seconds = time.perf_counter() - started
            t = factory.stats()["total"]
            name = policy.split(":")[0] if policy.startswith("learned:") else policy
            lines.append(f"| {name} | {share:.0%} | {n_tokens / seconds:.1f} | "
                         f"{t['hit_rate']:.1%} | {t['disk_bytes'] / 2**20:.1f} |")
            print(lines[-1], flush=True)
    return lines


class ResidentReference:
    """Held-out windows, fed one token at a time, scored by the fully resident model: an
    approximation's KL divergence from it and perplexity on the next tokens."""

    def __init__(self, path: Path, n_windows: int, length: int, threads: int):
        from moeswap.models import load_model
        from moeswap.models.quant_experts import QuantResidentExperts

        self.windows = text_windows(path, "held-out", n_windows, length)
        self._targets = torch.cat([w[1:] for w in self.windows])  # next tokens
        self._keep = torch.cat([torch.arange(len(w) - 1) + sum(len(v) for v in self.windows[:i])
                                for i, w in enumerate(self.windows)])  # positions with a next token
        resident = load_model(path, threads=threads, expert_runner=QuantResidentExperts)
        self._logp, self.perplexity = self._scores(resident)

    def _scores(self, model) -> tuple[torch.Tensor, float]:
        logp = torch.log_softmax(teacher_forced(model, self.windows)[self._keep].double(), dim=-1)
        return logp, math.exp(-float(logp.gather(1, self._targets[:, None]).mean()))

    def compare(self, model) -> tuple[float, float]:
        """(KL(resident || model) nats per token, model's perplexity)."""
        logp, ppl = self._scores(model)
        return float((self._logp.exp() * (self._logp - logp)).sum(-1).mean()), ppl


def threshold(args, path: Path) -> list[str]:
    reference = ResidentReference(path, args.windows, args.length, args.threads)
    lines = ["| --expert-threshold | KL(resident ‖ approx) nats/token | perplexity | "
             "picks dropped | expert bytes not read |", "|---:|---:|---:|---:|---:|",
             f"| off (resident) | 0 | {reference.perplexity:.3f} | 0 | 0 |"]
    for p in args.thresholds:
        model, factory, picks_per_token = store(path, 1.0, args.threads, threshold=p)
        kl, ppl = reference.compare(model)
        t = factory.stats()["total"]
        picks = picks_per_token * sum(len(w) for w in reference.windows)
        lines.append(f"| {p} | {kl:.2e} | {ppl:.3f} | {t['threshold_drops'] / max(picks, 1):.1%} "
                     f"| {t['threshold_saved_bytes'] / 2**20:.1f} MiB |")
        print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["profile", "table", "threshold"])
    parser.add_argument("--model", default=str(ROOT / "moeswap" / "data" / "stdlib-moe-q8_0.gguf"),
                        help="the trained model's GGUF (default: the built-in one)")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--length", type=int, default=64, help="tokens per window")
    parser.add_argument("--policies", nargs="+", default=["lru", "lfu"])
    parser.add_argument("--thresholds", nargs="+", type=float, default=[0.02, 0.05, 0.1])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("-o", "--output", help="profile mode: the profile .json to write")
    parser.add_argument("--markdown", help="write the table here too")
    args = parser.parse_args()
    if args.mode == "profile" and not args.output:
        parser.error("profile mode needs -o PROFILE.json")
    modes = {"profile": profile, "table": table, "threshold": threshold}
    lines = modes[args.mode](args, Path(args.model))
    print("\n".join(lines))
    if args.markdown:
        Path(args.markdown).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
