"""`moeswap convert`: parse arguments, call gguf_tools.convert with a progress bar."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn



def register(subparsers) -> None:
    p = subparsers.add_parser("convert", help="convert a Hugging Face folder to GGUF "
                                              "(llama.cpp's names, layout and metadata)")
    p.add_argument("folder", help="HF model folder (config.json, *.safetensors, tokenizer)")
    p.add_argument("-o", "--output", required=True, help="path of the .gguf file to write")
    p.add_argument("--type", default="f16",
                   help="type of the weight matrices: f32, f16, q8_0 or q4_0 (norms and routers "
                        "stay f32); default f16")
    p.set_defaults(handler=run_convert)


def run_convert(args) -> int:
    from moeswap.gguf_tools.convert import convert  # loads torch: only when converting

    bar = Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                   TimeRemainingColumn(), console=Console(stderr=True), transient=True)
    with bar:
        task = bar.add_task("converting", total=None)

        def report(name: str, done: int, total: int) -> None:
            bar.update(task, completed=done, total=total, description=name)

        path = convert(args.folder, args.output, args.type, on_tensor=report)
    print(f"wrote {path}")
    return 0
