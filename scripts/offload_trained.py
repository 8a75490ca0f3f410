"""The expert store on the trained model with its real routing: held-out text, token by token.

    python scripts/offload_trained.py table --run training/runs/moe --markdown table.md
        decode tokens/s and hit rate for expert RAM budgets of 0, 10, 25, 50, 100 % of the
        routed bytes (the rest read from the file, cold reads), per --policies entry
    python scripts/offload_trained.py threshold --run training/runs/moe --markdown q.md
        the quality cost of --expert-threshold P (an approximation): KL divergence from the
        fully resident model and perplexity, beside how often it fired and the bytes it saved

The run's HF folder is converted to Q8_0 once, into --work-dir. Held-out text is
training's own held-out split (training/train.py), fed one token at a time (teacher-forced), so
the router sees real text; each window starts with a fresh cache.
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


def quantized_model(run: Path, work_dir: Path) -> Path:
    from moeswap.gguf_tools.convert import convert

    path = work_dir / f"{run.resolve().name}.q8_0.gguf"
    if not path.exists():
        work_dir.mkdir(parents=True, exist_ok=True)
        convert(run / "hf", path, "q8_0")
    return path


def held_out_windows(run: Path, n_windows: int, length: int) -> list[torch.Tensor]:
    from tokenizers import Tokenizer
    from train import corpus_files, encode, split_corpus

    ids = encode(Tokenizer.from_file(str(run / "hf" / "tokenizer.json")),
                 split_corpus(corpus_files())[1])
    starts = np.linspace(0, len(ids) - length - 1, n_windows).astype(np.int64)
    return [torch.from_numpy(ids[s:s + length]) for s in starts]


def teacher_forced(model, windows: list[torch.Tensor]) -> torch.Tensor:
    """Logits [windows * length, V], one token per forward call."""
    out = []
    for window in windows:
        cache = model.new_cache()
        out += [model.forward([window[i:i + 1]], [cache])[0] for i in range(len(window))]
    return torch.cat(out)


def store(path: Path, share: float, threads: int, **options):
    from moeswap.experts.store import ExpertStore, StoreOptions, shared_bytes
    from moeswap.experts.tiers import slot_bytes
    from moeswap.formats.config import config_from_gguf
    from moeswap.formats.gguf_file import GGUFFile
    from moeswap.models import load_model
    from moeswap.models.quant_experts import ExpertLayout

    gguf = GGUFFile.open(path)
    config = config_from_gguf(gguf)
    layers = config.moe_layers
    slot = slot_bytes([ExpertLayout.from_file(gguf, i) for i in layers])
    n_experts = len(layers) * config.n_expert
    host = shared_bytes(gguf, layers) + (config.n_expert_used + int(share * n_experts)) * slot
    factory = ExpertStore.factory(StoreOptions(host_bytes=host, **options))
    picks_per_token = config.n_expert_used * len(layers)
    return load_model(path, threads=threads, expert_runner=factory), factory, picks_per_token


def table(args, path: Path, windows: list[torch.Tensor]) -> list[str]:
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
            lines.append(f"| {policy} | {share:.0%} | {n_tokens / seconds:.1f} | "
                         f"{t['hit_rate']:.1%} | {t['disk_bytes'] / 2**20:.1f} |")
            print(lines[-1], flush=True)
    return lines


def threshold(args, path: Path, windows: list[torch.Tensor]) -> list[str]:
    from moeswap.models import load_model
    from moeswap.models.quant_experts import QuantResidentExperts

    targets = torch.cat([w[1:] for w in windows])  # next tokens
    keep = torch.cat([torch.arange(len(w) - 1) + sum(len(v) for v in windows[:i])
                      for i, w in enumerate(windows)])  # positions that have a next token

    def scores(logits: torch.Tensor) -> tuple[torch.Tensor, float]:
        logp = torch.log_softmax(logits[keep].double(), dim=-1)
        return logp, math.exp(-float(logp.gather(1, targets[:, None]).mean()))

    resident = load_model(path, threads=args.threads, expert_runner=QuantResidentExperts)
    base, base_ppl = scores(teacher_forced(resident, windows))
    lines = ["| --expert-threshold | KL(resident ‖ approx) nats/token | perplexity | "
             "picks dropped | expert bytes not read |", "|---:|---:|---:|---:|---:|",
             f"| off (resident) | 0 | {base_ppl:.3f} | 0 | 0 |"]
    for p in args.thresholds:
        model, factory, picks_per_token = store(path, 1.0, args.threads, threshold=p)
        logp, ppl = scores(teacher_forced(model, windows))
        kl = float((base.exp() * (base - logp)).sum(-1).mean())
        t = factory.stats()["total"]
        picks = picks_per_token * sum(len(w) for w in windows)
        lines.append(f"| {p} | {kl:.2e} | {ppl:.3f} | {t['threshold_drops'] / max(picks, 1):.1%} "
                     f"| {t['threshold_saved_bytes'] / 2**20:.1f} MiB |")
        print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["table", "threshold"])
    parser.add_argument("--run", default="training/runs/moe", help="a training run folder")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--length", type=int, default=64, help="tokens per window")
    parser.add_argument("--policies", nargs="+", default=["lru", "lfu", "window:64"])
    parser.add_argument("--thresholds", nargs="+", type=float, default=[0.02, 0.05, 0.1])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--work-dir", default="~/.cache/moeswap/offload")
    parser.add_argument("--markdown", help="write the table here too")
    args = parser.parse_args()
    run = Path(args.run)
    path = quantized_model(run, Path(args.work_dir).expanduser())
    windows = held_out_windows(run, args.windows, args.length)
    lines = (table if args.mode == "table" else threshold)(args, path, windows)
    print("\n".join(lines))
    if args.markdown:
        Path(args.markdown).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
