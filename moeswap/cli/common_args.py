"""Flags most commands share, spelled as llama.cpp spells them: the model (positional, or
``-m/--model``), ``-t/--threads``, and the check of ``-c/--ctx`` against the model."""

from __future__ import annotations

import argparse


def add_model_argument(p: argparse.ArgumentParser, help: str, required: bool = True) -> None:
    """``MODEL`` or ``-m MODEL``; ``resolve_model`` checks them after parsing."""
    p.add_argument("model", nargs="?", help=help)
    p.add_argument("-m", "--model", dest="model_option", metavar="MODEL",
                   help="the model, as llama.cpp's -m gives it (instead of the positional)")
    p.set_defaults(model_required=required)


def resolve_model(args, parser: argparse.ArgumentParser) -> None:
    """One model from the positional or -m; a required one given neither way is a usage error
    of the command's own parser."""
    if args.model_option is not None:
        if args.model is not None and args.model != args.model_option:
            parser.error(f"two models given: {args.model} and -m {args.model_option}")
        args.model = args.model_option
    if args.model is None and args.model_required:
        parser.error("the model is required: give it as MODEL or -m MODEL")


def add_threads_argument(p: argparse.ArgumentParser, default: int | None = None,
                         help: str = "CPU threads (default: torch's)") -> None:
    p.add_argument("-t", "--threads", type=int, default=default, help=help)


def add_force_argument(p: argparse.ArgumentParser) -> None:
    """``--force``, as `run`, `chat` and `serve` share it."""
    p.add_argument("--force", action="store_true",
                   help="load a GGUF file even when `moeswap doctor` reports an error in it "
                        "(default: refuse it in one line)")


def warn_beyond_training(runtime, ctx: int) -> None:
    """One line when ``ctx`` passes the positions the model was trained for (as llama.cpp's
    n_ctx_train warning): replies past them may degrade."""
    import sys

    trained = runtime.config.n_ctx_train
    if trained and ctx > trained:
        print(f"moeswap: warning: --ctx {ctx} is more than the {trained} positions this model "
              "was trained for; text past them may degrade", file=sys.stderr)


DEFAULT_CTX = 4096


def default_ctx(model) -> int:
    """--ctx when none is given: 4096, or the model's trained context when shorter (read from
    the GGUF header or config.json; a model that states none gets 4096)."""
    from pathlib import Path

    from moeswap.formats.config import config_from_hf
    from moeswap.formats.gguf_file import GGUFFile

    path = Path(model)
    if path.is_dir():
        trained = config_from_hf(path).n_ctx_train
    elif path.is_file():
        gguf = GGUFFile.open(path)
        try:  # the one key: a damaged file (--force) is the loader's to refuse
            trained = gguf.get(f"{gguf.architecture}.context_length")
        finally:
            gguf.close()
        trained = trained if isinstance(trained, int) and not isinstance(trained, bool) else 0
    else:
        return DEFAULT_CTX  # the loader names the missing file
    return min(DEFAULT_CTX, trained) if trained else DEFAULT_CTX
