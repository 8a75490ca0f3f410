"""The ``moeswap`` command line: parse arguments, call the library, print one line on error.

Each command group lives in its own module and exposes ``register(subparsers)``; a
subcommand is one function that parses nothing itself and calls into the library.
"""

from __future__ import annotations

import argparse
import re
import sys

from moeswap.errors import MoeswapError

COMMAND_MODULES = ("gguf_commands", "trace_commands", "run_commands", "convert_commands",
                   "probe_commands", "serve_commands", "plan_commands", "bench_commands")


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(
        prog="moeswap", description="Run Mixture-of-Experts models whose experts do not all fit in "
                                    "fast memory, and the tools around them.")
    parser.add_argument("--version", action="version", version=f"moeswap {package_version()}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"moeswap.cli.{name}").register(subparsers)
    for command in subparsers.choices.values():  # a bad flag prints its own command's usage
        command.set_defaults(parser=command)
    return parser


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("moeswap")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def main(argv: list[str] | None = None) -> int:
    from moeswap.cli.common_args import resolve_model
    from moeswap.cli.offload_args import bare_cold_reads_as_on

    parser = build_parser()
    args, unknown = parser.parse_known_args(bare_cold_reads_as_on(join_negative_sizes(
        sys.argv[1:] if argv is None else argv)))
    if unknown:
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if hasattr(args, "model_option"):
        resolve_model(args, args.parser)
    try:
        if getattr(args, "force", None) is False:  # run, chat, serve: before any planning
            refuse_damaged_model(args.model)
        return int(args.handler(args) or 0)
    except MoeswapError as e:
        print(f"moeswap: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("moeswap: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


_NEGATIVE_SIZE = re.compile(r"-[0-9][0-9.]*[a-zA-Z]+")


def join_negative_sizes(argv: list[str]) -> list[str]:
    """``--host-mem -5GiB`` as ``--host-mem=-5GiB``: argparse takes '-5GiB' for an option
    (it is no plain negative number) and would say the flag has no value; joined, the size
    parser says the size is negative."""
    joined: list[str] = []
    for arg in argv:
        if joined and joined[-1].startswith("--") and "=" not in joined[-1] \
                and _NEGATIVE_SIZE.fullmatch(arg):
            joined[-1] = f"{joined[-1]}={arg}"
        else:
            joined.append(arg)
    return joined


def refuse_damaged_model(model: str | None) -> None:
    """One line and exit 2 for a GGUF file moeswap doctor reports an error in (--force skips)."""
    from pathlib import Path

    import moeswap
    from moeswap.runtime import refuse_invalid_file

    path = Path(model or moeswap.DEFAULT_MODEL)
    if path.is_file():
        refuse_invalid_file(path)


if __name__ == "__main__":
    sys.exit(main())
