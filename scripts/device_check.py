"""The device tier on a lent GPU: close enough to the resident CPU model, then how fast it is.

    bash scripts/device_check.sh                          # on the GPU machine (sets up a venv)
    python scripts/device_check.py --device cpu --quick   # the same logic on CPU tensors

1. Agreement: tiny Mixtral models (weights of std 0.02, Q8_0 and Q4_0, built in-process) run
   fully resident (ggml's CPU kernels) and with the device tier (moeswap/experts/device.py:
   slots in device memory, uploads through pinned buffers on a copy stream, events) holding one
   expert per layer, then every expert, ``--miss transfer``: logits within 1e-4 of the row's
   largest resident logit, and the same token wherever the resident run's top-1/top-2 margin
   exceeds 0.1; and one expert product each for Q8_0, Q4_0 and Q4_K (Q8_K-rounded activations)
   compared directly. A failure makes the exit status 1 (the measurements still run).
2. Upload bandwidth: host-to-device copies from pageable and from pinned memory, and the device
   tier's own upload path (a pinned ring of two buffers and a copy stream) with expert-sized
   slots.
3. Decode tokens/s versus the device budget (0, 10, 25, 50, 100 % of the routed bytes; the host
   tier holds every expert, so nothing is read from disk): the built-in trained model on Python
   source text (its real routing) and a generated Mixtral-shaped Q8_0 model (random weights:
   near-uniform routing; moeswap.bench.generated). ``--miss transfer``: a missed
   expert is uploaded whenever the device policy (LRU) admits it.

Prints markdown tables to paste into docs/BENCHMARKS.md; --markdown / --json write them too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import textwrap
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
for extra in (ROOT, ROOT / "tests", ROOT / "scripts"):  # tiny_models, bench_decode
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from moeswap.memory import kv_bytes_per_token  # noqa: E402
from moeswap.experts.build import build_store  # noqa: E402
from moeswap.experts.settings import OffloadSettings  # noqa: E402
from moeswap.experts.store import shared_bytes  # noqa: E402
from moeswap.memory import HostCharge  # noqa: E402
from moeswap.experts.tiers import slot_bytes  # noqa: E402
from moeswap.formats.config import config_from_gguf  # noqa: E402
from moeswap.formats.gguf_file import GGUFFile  # noqa: E402
from moeswap.models import load_model  # noqa: E402
from moeswap.models.quant_experts import ExpertLayout, QuantResidentExperts  # noqa: E402

RELATIVE_BOUND = 1e-4
MARGIN = 0.1
SHARES = (0.0, 0.10, 0.25, 0.50, 1.0)


def plan(path: Path) -> dict:
    """Host bytes every store of this file needs (shared weights, staging), slot size, layers."""
    gguf = GGUFFile.open(path)
    config = config_from_gguf(gguf)
    layers = config.moe_layers
    layouts = [ExpertLayout.from_file(gguf, i) for i in layers]
    slot = slot_bytes(layouts)
    return {"shared": shared_bytes(gguf, layers), "staging": config.n_expert_used * slot,
            "config": config, "slot": slot,
            "layers": layers, "experts": len(layers) * layouts[0].n_experts,
            "kv_per_token": kv_bytes_per_token(config)}


def store_model(path: Path, device: str, device_slots: int, n_tokens: int, threads: int,
                host_slots: int | None = None):
    """(model, its store's factory): the host tier holds ``host_slots`` experts (all: None)."""
    p = plan(path)
    host_slots = p["experts"] if host_slots is None else host_slots
    charge = HostCharge.for_sequence(n_tokens)
    settings = OffloadSettings(host_bytes=charge.bytes(p["config"], p["shared"], p["staging"])
                               + host_slots * p["slot"], device_bytes=device_slots * p["slot"],
                               miss="transfer", device_backend=device)
    factory = build_store(settings, charge)
    return load_model(path, threads=threads, expert_runner=factory, context_tokens=n_tokens,
                      step_tokens=0), factory


# -- 1. agreement ------------------------------------------------------------------------------

def tiny_models(folder: Path) -> list[tuple[str, Path]]:
    """tests/tiny_models.py's Mixtral with weights of std 0.02, built from its config alone:
    that module's table of every family needs a transformers as new as this repo's."""
    import tiny_models as tiny
    import transformers as tf

    from moeswap.gguf_tools.convert import convert

    torch.manual_seed(0)
    config = tf.MixtralConfig(**{**tiny.COMMON, "initializer_range": 0.02,
                                 "intermediate_size": 64, "num_local_experts": 4,
                                 "num_experts_per_tok": 2, "rope_theta": 10000.0})
    tf.MixtralForCausalLM(config).eval().save_pretrained(folder / "hf")
    tiny.save_tokenizer(folder / "hf")
    return [(t, convert(folder / "hf", folder / f"model.{t}.gguf", t)) for t in ("q8_0", "q4_0")]


def prompt_logits(model, prompt: torch.Tensor) -> torch.Tensor:
    """A prefill of 8 tokens, then single-token steps: [len(prompt), V]."""
    cache = model.new_cache()
    parts = [model.forward([prompt[:8]], [cache])[0]]
    parts += [model.forward([prompt[i:i + 1]], [cache])[0] for i in range(8, len(prompt))]
    return torch.cat(parts)


def compare(got: torch.Tensor, expected: torch.Tensor) -> dict:
    """Largest difference relative to its row's largest logit; tokens where the margin is clear."""
    relative = float(((got - expected).abs().amax(-1) / expected.abs().amax(-1)).max())
    top2 = expected.topk(2, dim=-1).values  # [T, 2]
    clear = (top2[:, 0] - top2[:, 1]) > MARGIN
    same = got.argmax(-1) == expected.argmax(-1)
    return {"relative": relative, "clear_rows": int(clear.sum()),
            "clear_equal": int((same & clear).sum()),
            "passed": relative <= RELATIVE_BOUND and bool(same[clear].all())}


def agreement(device: str, threads: int, folder: Path) -> list[dict]:
    import tiny_models as tiny

    prompt = torch.randint(0, tiny.VOCAB, (24,), generator=torch.Generator().manual_seed(5))
    rows = []
    for type_name, path in tiny_models(folder):
        expected = prompt_logits(load_model(path, threads=threads,
                                            expert_runner=QuantResidentExperts), prompt)
        p = plan(path)
        for device_slots in (len(p["layers"]), p["experts"]):
            model, factory = store_model(path, device, device_slots, len(prompt), threads,
                                         host_slots=1)
            result = compare(prompt_logits(model, prompt), expected)
            total = factory.stats()["total"]
            rows.append({"type": type_name, "device_slots": device_slots,
                         "transfers": total["transfers"], "device_hits": total["device_hits"],
                         **result})
            print(f"agreement {type_name} device slots {device_slots}: {rows[-1]}", flush=True)
    return rows


def product_agreement(device: str, threads: int) -> list[dict]:
    """One expert matrix (out 1024, in 4096, std-1 weights) times 8 rows, on the device and by
    ggml: on the calm tiny models the expert outputs are too small to move a logit at float32
    precision, so the products are compared directly too."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q

    from moeswap.experts.device import _DeviceMatrix
    from moeswap.quant import CpuKernels, quantize_rows

    kernels, rows = CpuKernels(threads), []
    x = torch.randn(8, 4096, generator=torch.Generator().manual_seed(3))
    ids = torch.zeros(8, 1, dtype=torch.int32)
    weights = np.random.default_rng(0).normal(0.0, 1.0, (1024, 4096)).astype(np.float32)
    for type_name, type_id in (("q8_0", int(Q.Q8_0)), ("q4_0", int(Q.Q4_0)),
                               ("q4_k", int(Q.Q4_K))):
        raw = quantize_rows(weights, type_id).reshape(-1)
        expected = kernels.experts(raw, type_id, (4096, 1024, 1)).matmul(x, ids)
        on_device = torch.from_numpy(raw.copy()).to(device)
        got = _DeviceMatrix(on_device, type_id, (4096, 1024)).matmul(x, ids)
        relative = float((got - expected).abs().max() / expected.abs().max())
        rows.append({"type": f"{type_name} product", "device_slots": "-", "transfers": 0,
                     "device_hits": 0, "relative": relative, "clear_rows": 0, "clear_equal": 0,
                     "passed": relative <= RELATIVE_BOUND})
        print(f"agreement {type_name} product: {rows[-1]}", flush=True)
    return rows


# -- 2. upload bandwidth -----------------------------------------------------------------------

def timed(device: torch.device, action, repeats: int) -> float:
    """Median seconds of ``action``; CUDA events on the current stream where there is CUDA."""
    action()  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            action()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            started = time.perf_counter()
            action()
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def bandwidth(device_name: str, sizes_mib: list[int], repeats: int) -> list[dict]:
    from moeswap.experts.device import TorchDeviceSlots

    device = torch.device(device_name)
    cuda = device.type == "cuda"
    rows = []
    for mib in sizes_mib:
        n = mib << 20
        target = torch.empty(n, dtype=torch.uint8, device=device)
        for kind in ("pageable", "pinned"):
            if kind == "pinned" and not cuda:
                continue  # pinning needs CUDA
            source = torch.ones(n, dtype=torch.uint8, pin_memory=kind == "pinned")
            seconds = timed(device, lambda: target.copy_(source, non_blocking=kind == "pinned"),
                            repeats)
            rows.append({"copy": f"{kind} host -> {device.type}", "mib": mib,
                         "gb_per_s": n / seconds / 1e9})
        # The device tier's path: numpy copy into the pinned ring, copy stream, event.
        slots = TorchDeviceSlots(device_name, 4, n)
        host = torch.ones(n, dtype=torch.uint8).numpy()

        def uploads() -> None:
            for index in range(4):
                slots.upload(index, host)
            if cuda:
                slots.copy_stream.synchronize()
        seconds = timed(device, uploads, repeats) / 4
        rows.append({"copy": "device tier upload (pinned ring, copy stream)", "mib": mib,
                     "gb_per_s": n / seconds / 1e9})
        print(f"bandwidth {mib} MiB: {rows[-3:] if cuda else rows[-2:]}", flush=True)
    return rows


# -- 3. decode tokens/s versus the device budget -----------------------------------------------

def decode_row(path: Path, tokens: torch.Tensor, device: str, share: float, threads: int) -> dict:
    p = plan(path)
    device_slots = round(share * p["experts"])
    model, factory = store_model(path, device, device_slots, len(tokens), threads)
    cache = model.new_cache()
    model.forward([tokens[:8]], [cache])
    started = time.perf_counter()
    for i in range(8, len(tokens)):
        model.forward([tokens[i:i + 1]], [cache])
    seconds = time.perf_counter() - started
    total = factory.stats()["total"]
    return {"share": share, "device_slots": device_slots,
            "decode_tokens_per_s": (len(tokens) - 8) / seconds,
            "device_hit_rate": total["device_hits"] / max(total["requests"], 1),
            "uploaded_mib": total["transfer_bytes"] / 2**20}


def resident_row(path: Path, tokens: torch.Tensor, threads: int) -> dict:
    model = load_model(path, threads=threads, expert_runner=QuantResidentExperts)
    cache = model.new_cache()
    model.forward([tokens[:8]], [cache])
    started = time.perf_counter()
    for i in range(8, len(tokens)):
        model.forward([tokens[i:i + 1]], [cache])
    return {"share": None, "device_slots": 0,
            "decode_tokens_per_s": (len(tokens) - 8) / (time.perf_counter() - started),
            "device_hit_rate": 0.0, "uploaded_mib": 0.0}


def source_text_tokens(path: Path, n: int) -> torch.Tensor:
    """Python source (the standard library's textwrap) tokenized by the model's tokenizer."""
    from moeswap.tokenizer import load_tokenizer

    ids = load_tokenizer(path).encode(Path(textwrap.__file__).read_text())
    return torch.tensor(ids[:n], dtype=torch.long)


def sweep(label: str, routing: str, path: Path, tokens: torch.Tensor, device: str,
          threads: int) -> list[dict]:
    rows = [{"model": label, "routing": routing, "budget": "resident (CPU, ggml)",
             **resident_row(path, tokens, threads)}]
    print(rows[-1], flush=True)
    for share in SHARES:
        rows.append({"model": label, "routing": routing, "budget": f"{share:.0%}",
                     **decode_row(path, tokens, device, share, threads)})
        print(rows[-1], flush=True)
    return rows


def generated_model(folder: Path, gb: float, quick: bool) -> Path:
    from moeswap.bench.generated import mixtral_shape, write_mixtral

    path = folder / "mixtral-generated.q8_0.gguf"
    write_mixtral(path, mixtral_shape(0.02 if quick else gb, tiny=quick))
    return path


# -- report ------------------------------------------------------------------------------------

def markdown(report: dict) -> str:
    lines = [f"Device check ({report['device']}, torch {report['torch']}, {report['date']}; "
             f"{report['threads']} CPU threads)", "",
             "| experts | device slots | max diff / row max | clear-margin tokens equal | "
             "transfers | result |", "|---|---:|---:|---:|---:|---|"]
    lines += [f"| {r['type']} | {r['device_slots']} | {r['relative']:.1e} | "
              f"{r['clear_equal']}/{r['clear_rows']} | {r['transfers']} | "
              f"{'pass' if r['passed'] else 'FAIL'} |" for r in report["agreement"]]
    lines += ["", "| copy | MiB | GB/s |", "|---|---:|---:|"]
    lines += [f"| {r['copy']} | {r['mib']} | {r['gb_per_s']:.1f} |" for r in report["bandwidth"]]
    lines += ["", "| model | routing | device budget (share of routed bytes) | decode tokens/s | "
              "device hit rate | uploaded MiB |", "|---|---|---|---:|---:|---:|"]
    lines += [f"| {r['model']} | {r['routing']} | {r['budget']} | {r['decode_tokens_per_s']:.1f} "
              f"| {r['device_hit_rate']:.1%} | {r['uploaded_mib']:.1f} |" for r in report["decode"]]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda",
                        help="torch device of the device tier (cpu: a dry run of the logic)")
    parser.add_argument("--threads", type=int, default=8, help="CPU kernel threads")
    parser.add_argument("--gb", type=float, default=1.0, help="generated model size")
    parser.add_argument("--tokens", type=int, default=72, help="8 prefill + decode steps")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes: a seconds-long run of every step")
    parser.add_argument("--markdown", help="write the tables here")
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu for a dry run", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    device_name = (torch.cuda.get_device_name(args.device) if args.device.startswith("cuda")
                   else "CPU tensors (dry run)")
    n_tokens = 24 if args.quick else args.tokens
    report = {"device": device_name, "torch": torch.__version__, "threads": args.threads,
              "date": time.strftime("%Y-%m-%d %H:%M")}
    builtin = ROOT / "moeswap" / "data" / "stdlib-moe-q8_0.gguf"
    with tempfile.TemporaryDirectory(prefix="device-check-") as folder:
        folder = Path(folder)
        report["agreement"] = (agreement(args.device, args.threads, folder)
                               + product_agreement(args.device, args.threads))
        report["bandwidth"] = bandwidth(args.device, [1, 8] if args.quick else [1, 16, 256],
                                        3 if args.quick else 10)
        report["decode"] = sweep("built-in stdlib-moe Q8_0", "real (Python source)", builtin,
                                 source_text_tokens(builtin, n_tokens), args.device, args.threads)
        generated = generated_model(folder, args.gb, args.quick)
        vocab = config_from_gguf(GGUFFile.open(generated)).n_vocab
        random_ids = torch.randint(0, vocab, (n_tokens,), generator=torch.Generator().manual_seed(0))
        size = f"{os.path.getsize(generated) / 1e9:.2f} GB"
        report["decode"] += sweep(f"generated Mixtral-shaped Q8_0, {size}", "random weights",
                                  generated, random_ids, args.device, args.threads)
    text = markdown(report)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    failed = [r for r in report["agreement"] if not r["passed"]]
    if failed:
        print(f"FAIL: {len(failed)} agreement rows outside the bounds", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
