"""The sampling flags `moeswap run` and `chat` share, with llama.cpp's names and defaults."""

from __future__ import annotations

import argparse


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temp", type=float, default=0.8, help="temperature; 0 is greedy (0.8)")
    p.add_argument("--top-k", type=int, default=40, help="0 turns it off (40)")
    p.add_argument("--top-p", type=float, default=0.95, help="1 turns it off (0.95)")
    p.add_argument("--min-p", type=float, default=0.05, help="0 turns it off (0.05)")
    p.add_argument("--repeat-penalty", type=float, default=1.0, help="1 turns it off (1.0)")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: random)")


def sampling_params(args):
    """The sampling flags as a moeswap.sampling.SamplingParams."""
    from moeswap.sampling import SamplingParams

    return SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p,
                          min_p=args.min_p, repeat_penalty=args.repeat_penalty, seed=args.seed)
