"""``--suite kernels``: moeswap's quantized CPU kernels, matrix-vector GB/s against the memory
roofline (was scripts/bench_kernels.py).

For each weight type: time ``QuantMatrix.matmul`` on one random [out, in] matrix for 1..N
tokens, versus torch's fp32 product with the dequantized matrix (the form it would otherwise
take); bandwidth = bytes of the weight as stored / time. The roofline is the read bandwidth of
a torch sum over a buffer larger than the caches. Also reported: the per-call overhead of a
tiny product, and the accuracy cost of quantizing activations (NMSE against the fp32 product
of the dequantized matrix, and against float64). The whole measurement runs in one worker.
"""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType

from moeswap.bench.timing import median_seconds
from moeswap.bench.worker import run_call
from moeswap.errors import MoeswapError
from moeswap.quant import SUPPORTED_TYPES, CpuKernels, needs_importance, quantize_rows
from moeswap.quant.kernels import default_thread_count
from moeswap.quant.reference import dequantize_matrix

DEFAULT_TYPES = ("Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4", "F16")
SIZES = {"full": dict(shape="14336x4096", tokens="1,4,32", repeats=20),
         "smoke": dict(shape="256x256", tokens="1,4", repeats=2)}


def add_arguments(p) -> None:
    p.add_argument("--size", choices=SIZES, default="full",
                   help="full: a 14336x4096 matrix, 1/4/32 tokens, 20 repeats; smoke: tiny")
    p.add_argument("--shape", help="OUTxIN of the matrix (the size's unless given)")
    p.add_argument("--types", default=",".join(DEFAULT_TYPES))
    p.add_argument("--tokens", help="token counts to time, e.g. 1,4,32 (the size's unless given)")
    p.add_argument("--threads", type=int, default=default_thread_count())
    p.add_argument("--repeats", type=int, help="timed calls per figure (the size's unless given)")


def read_roofline_gbs(n_threads: int, repeats: int) -> float:
    """Read bandwidth of a sum over 512 MiB of fp32, with the benchmark's thread count."""
    buffer = torch.ones(128 << 20)
    seconds = median_seconds(lambda: buffer.sum(), repeats)
    return buffer.numel() * 4 / seconds / 1e9


def nmse(result: torch.Tensor, reference: torch.Tensor) -> float:
    return float(((result.double() - reference.double()) ** 2).mean()
                 / (reference.double() ** 2).mean())


def bench_type(kernels: CpuKernels, type_name: str, shape: tuple[int, int],
               token_counts: list[int], repeats: int) -> dict:
    height, width = shape
    ggml_type = GGMLQuantizationType[type_name]
    values = np.random.default_rng(0).standard_normal((height, width)).astype(np.float32)
    # A uniform importance matrix where ggml demands one (IQ1_S, IQ2_XXS, IQ2_XS).
    importance = np.ones(width, np.float32) if needs_importance(ggml_type) else None
    raw = quantize_rows(values, ggml_type, importance)  # [out, row bytes]
    matrix = kernels.matrix(raw, ggml_type, (width, height))
    dequantized64 = torch.from_numpy(dequantize_matrix(raw, ggml_type, (width, height)))
    dequantized = dequantized64.float()  # [out, in] the fp32 alternative
    row = {"type": type_name, "stored_bytes": raw.nbytes, "fp32_bytes": dequantized.nbytes,
           "tokens": {}}
    for n_tokens in token_counts:
        x = torch.randn(n_tokens, width)
        ours = median_seconds(lambda: matrix.matmul(x), repeats)
        fp32 = median_seconds(lambda: x @ dequantized.T, repeats)
        result, reference32 = matrix.matmul(x), x @ dequantized.T
        reference64 = x.double() @ dequantized64.T
        row["tokens"][n_tokens] = {
            "ms": ours * 1e3, "gbs": raw.nbytes / ours / 1e9,
            "torch_fp32_ms": fp32 * 1e3, "torch_fp32_gbs": dequantized.nbytes / fp32 / 1e9,
            "speedup_vs_torch_fp32": fp32 / ours,
            "nmse_vs_fp32_dequantized": nmse(result, reference32),
            "nmse_vs_float64": nmse(result, reference64),
        }
    return row


def call_overhead_us(kernels: CpuKernels, repeats: int) -> float:
    """One token through a 256x256 Q8_0 matrix (64 KiB): all but the arithmetic is overhead."""
    raw = quantize_rows(np.ones((256, 256), dtype=np.float32), GGMLQuantizationType.Q8_0)
    matrix = kernels.matrix(raw, GGMLQuantizationType.Q8_0, (256, 256))
    x = torch.randn(1, 256)
    return median_seconds(lambda: [matrix.matmul(x) for _ in range(100)], repeats) / 100 * 1e6


def markdown(report: dict) -> str:
    lines = [f"Matrix {report['shape'][0]}x{report['shape'][1]}, {report['threads']} threads, "
             f"{report['cpu_arch']}; read roofline {report['roofline_gbs']:.1f} GB/s; "
             f"per-call overhead {report['call_overhead_us']:.1f} us.", "",
             "| type | tokens | ms | GB/s | % roofline | torch fp32 ms | speed-up | "
             "NMSE vs fp32 | NMSE vs f64 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in report["types"]:
        for n_tokens, cell in row["tokens"].items():
            lines.append(
                f"| {row['type']} | {n_tokens} | {cell['ms']:.3f} | {cell['gbs']:.1f} | "
                f"{100 * cell['gbs'] / report['roofline_gbs']:.0f} | {cell['torch_fp32_ms']:.3f} | "
                f"{cell['speedup_vs_torch_fp32']:.2f}x | {cell['nmse_vs_fp32_dequantized']:.1e} | "
                f"{cell['nmse_vs_float64']:.1e} |")
    return "\n".join(lines) + "\n"


def measure(shape: list[int], type_names: list[str], token_counts: list[int], threads: int,
            repeats: int) -> dict:
    """In a worker: the roofline, the call overhead and every type's figures."""
    torch.set_num_threads(threads)
    kernels = CpuKernels(n_threads=threads)
    return {"cpu_arch": f"{platform.machine()} {platform.processor() or ''}".strip(),
            "ggml": kernels.ggml.version, "threads": threads, "shape": shape,
            "roofline_gbs": read_roofline_gbs(threads, repeats),
            "call_overhead_us": call_overhead_us(kernels, repeats),
            "types": [bench_type(kernels, name, tuple(shape), token_counts, repeats)
                      for name in type_names]}


def run(args, out_dir: Path) -> tuple[dict, str]:
    size = SIZES[args.size]
    height, width = (int(n) for n in (args.shape or size["shape"]).lower().split("x"))
    type_names = args.types.split(",")
    unknown = [name for name in type_names
               if name not in GGMLQuantizationType.__members__
               or GGMLQuantizationType[name] not in SUPPORTED_TYPES]
    if unknown:
        raise MoeswapError(f"no kernel for {', '.join(unknown)}")
    token_counts = [int(n) for n in (args.tokens or size["tokens"]).split(",")]
    report = run_call("moeswap.bench.suites.kernels:measure", dict(
        shape=[height, width], type_names=type_names, token_counts=token_counts,
        threads=args.threads, repeats=args.repeats or size["repeats"]), out_dir / "runs", "kernels")
    if report.pop("status") != "ok":
        raise MoeswapError(f"the kernels' worker failed ({report['failure']}): {report['error']}")
    return report, markdown(report)
