"""Evaluate the built-in model as shipped (its GGUF, through moeswap) for the model card.

Held-out loss on the same fixed windows training used, the unigram and dense baselines from
the training logs, both final checkpoints compared on every held-out token (with a paired
bootstrap interval over windows), routing measured on held-out text with moeswap's recorder, and greedy
completions. Writes JSON and prints markdown.

    python training/evaluate.py --gguf moeswap/data/stdlib-moe-q8_0.gguf \
        --moe-run training/runs/moe-cont2 --dense-run training/runs/dense-cont2 \
        -o training/evaluation.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

import moeswap
from moeswap.routing import stats
from moeswap.routing.recorder import RoutingRecorder

from train import corpus_files, encode, split_corpus

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n\ndef main(", "class Stack:\n    def __init__(self):"]


def read_log(run: Path) -> tuple[dict, list[dict]]:
    rows = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    return rows[0], [r for r in rows[1:] if "held_out_loss" in r]


def held_out_windows(run: Path, seq_len: int, n_windows: int = 48) -> list[np.ndarray]:
    """The exact windows training's held_out_loss scored."""
    tokenizer = Tokenizer.from_file(str(run / "hf" / "tokenizer.json"))
    _, held_texts = split_corpus(corpus_files())
    ids = encode(tokenizer, held_texts)
    starts = np.linspace(0, len(ids) - seq_len - 1, n_windows).astype(np.int64)
    return [ids[s: s + seq_len + 1] for s in starts]


@torch.no_grad()
def window_losses(hf_folder: Path, ids: np.ndarray, seq_len: int) -> np.ndarray:
    """Mean next-token loss of each consecutive, non-overlapping window of ``ids``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_folder).eval()
    n_windows = (len(ids) - 1) // seq_len
    ids = torch.from_numpy(ids)
    inputs = ids[: n_windows * seq_len].view(n_windows, seq_len)  # [W, S]
    targets = ids[1: n_windows * seq_len + 1].view(n_windows, seq_len)  # [W, S]
    losses = []
    for rows in torch.split(torch.arange(n_windows), 32):
        logits = model(input_ids=inputs[rows]).logits  # [B, S, V]
        losses.append(torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), targets[rows], reduction="none").mean(1))  # [B]
    return torch.cat(losses).numpy()


def full_held_out_comparison(moe_run: Path, dense_run: Path, seq_len: int) -> dict:
    """MoE versus dense on all held-out tokens; the difference's 95 % interval comes from a
    paired bootstrap over windows (tokens within a window are not independent)."""
    tokenizer = Tokenizer.from_file(str(moe_run / "hf" / "tokenizer.json"))
    ids = encode(tokenizer, split_corpus(corpus_files())[1])
    moe = window_losses(moe_run / "hf", ids, seq_len)  # [W]
    dense = window_losses(dense_run / "hf", ids, seq_len)  # [W]
    rng = np.random.default_rng(0)
    picks = rng.integers(0, len(moe), size=(2000, len(moe)))  # [R, W]
    gaps = (dense - moe)[picks].mean(axis=1)  # [R]
    return dict(windows=len(moe), tokens=len(moe) * seq_len, moe=float(moe.mean()),
                dense=float(dense.mean()), dense_minus_moe=float((dense - moe).mean()),
                dense_minus_moe_95ci=np.percentile(gaps, [2.5, 97.5]).round(5).tolist())


def routing_summary(trace) -> dict:
    counts = stats.popularity(trace)  # [L, E]
    n_experts = trace.n_experts
    shares = counts / counts.sum(axis=1, keepdims=True)
    top10 = stats.top_share(counts, 0.1)  # [L]
    first, any_k = stats.consecutive_reuse(trace)  # [L] each
    random_first, random_any = stats.random_reuse(n_experts, trace.k)
    return dict(
        top10_share=top10.round(4).tolist(),
        layers_top10_in_15_60pct=int(((top10 >= 0.15) & (top10 <= 0.60)).sum()),
        min_expert_share=shares.min(axis=1).round(4).tolist(),
        min_share_bound=1 / (4 * n_experts),
        reuse_first=first.round(4).tolist(), reuse_any=any_k.round(4).tolist(),
        random_first=random_first, random_any=random_any,
        reuse_any_over_random=(any_k / random_any).round(3).tolist(),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--moe-run", type=Path, required=True)
    parser.add_argument("--dense-run", type=Path, required=True)
    parser.add_argument("-o", "--output", type=Path, required=True)
    args = parser.parse_args()

    moe_meta, moe_evals = read_log(args.moe_run)
    dense_meta, dense_evals = read_log(args.dense_run)
    recorder = RoutingRecorder()
    model = moeswap.load(args.gguf, recorder=recorder)
    losses = []
    for window in held_out_windows(args.moe_run, moe_meta["seq_len"]):
        logits = model.forward_logits(torch.from_numpy(window[:-1]))  # [S, V]
        losses.append(torch.nn.functional.cross_entropy(logits, torch.from_numpy(window[1:])).item())
    config = model.config
    trace = recorder.trace(model="stdlib-moe", arch=config.arch, layers=config.moe_layers,
                           n_experts=config.n_expert, k=config.n_expert_used)
    completions = {p: model.tokenizer.decode(list(model.generate(p, max_tokens=48, temperature=0)))
                   for p in PROMPTS}
    result = dict(
        gguf=str(args.gguf), gguf_bytes=args.gguf.stat().st_size,
        held_out_loss_gguf=float(np.mean(losses)),
        held_out_loss_hf_final=moe_evals[-1]["held_out_loss"],
        dense_held_out_loss_final=dense_evals[-1]["held_out_loss"],
        unigram_held_out_loss=moe_meta["unigram_held_out_loss"],
        all_held_out=full_held_out_comparison(args.moe_run, args.dense_run, moe_meta["seq_len"]),
        moe_steps=moe_evals[-1]["step"], dense_steps=dense_evals[-1]["step"],
        minutes=moe_evals[-1]["minutes"], moe_params=moe_meta["params"],
        dense_params=dense_meta["params"], train_tokens=moe_meta["train_tokens"],
        held_out_tokens=moe_meta["held_out_tokens"],
        routing=routing_summary(trace), completions=completions,
    )
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "routing"}, indent=2))
    print(json.dumps(result["routing"], indent=1))


if __name__ == "__main__":
    main()
