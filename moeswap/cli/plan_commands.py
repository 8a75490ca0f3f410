"""`moeswap plan`: the memory plan of a MoE GGUF for given budgets, and peers' command lines."""

from __future__ import annotations

import json
import shlex

from moeswap.cli.common_args import add_model_argument
from moeswap.cli.console import stdout_console
from moeswap.cli.offload_args import add_kv_type_argument, add_step_tokens_argument

RATE_FLAGS = {"disk_bw": "disk_read", "link_bw": "link", "ram_bw": "host_compute",
              "gpu_bw": "device_compute"}


def register(subparsers) -> None:
    p = subparsers.add_parser("plan", help="count the bytes before loading: tiers, KV cache, "
                                           "speed, and llama.cpp / Ollama / vLLM / SGLang flags")
    add_model_argument(p, "a .gguf file (only its header is read)")
    p.add_argument("--device-mem", metavar="SIZE", default="0",
                   help="GPU memory (or moeswap's device tier) to plan for, e.g. 12GiB (0)")
    p.add_argument("--host-mem", metavar="SIZE",
                   help="RAM to plan for, e.g. 32GiB (default: what this machine has free, "
                        "capped by the process's memory cgroup, less the runtime's reserve, "
                        "as --plan auto takes it)")
    p.add_argument("-c", "--ctx", type=int, required=True, help="context length in tokens")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together (1)")
    add_step_tokens_argument(p, " (as run, chat and serve take it)")
    add_kv_type_argument(p)
    p.add_argument("--profile", metavar="FILE",
                   help="a routing profile (`moeswap profile TRACE`: expected hit rate and the "
                        "llama.cpp layers to keep on the GPU) or a routing trace (.npz: the "
                        "store's LRU replayed over it gives the hit rate)")
    p.add_argument("--gpus", type=int, default=0, help="GPUs for a vLLM / SGLang launch line")
    p.add_argument("--gpu-mem", metavar="SIZE", help="memory of each of --gpus GPUs, e.g. 80GiB")
    g = p.add_argument_group("rates in GB/s (default: `moeswap probe`'s cache, else "
                             "conservative defaults)")
    g.add_argument("--disk-bw", type=float, help="cold reads of the model file")
    g.add_argument("--ram-bw", type=float, help="CPU products over stored weights")
    g.add_argument("--link-bw", type=float, help="host to GPU copies")
    g.add_argument("--gpu-bw", type=float, help="GPU products over stored weights")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(handler=run_plan)


def run_plan(args) -> int:
    from moeswap.errors import MoeswapError
    from moeswap.memory import parse_size
    from moeswap.generate import check_step_tokens
    from moeswap.planner import plan_model, report
    from moeswap.planner.placement import Budget
    from moeswap.planner.rates import plan_rates

    if args.gpus > 1 and not args.gpu_mem:
        raise MoeswapError("--gpus needs --gpu-mem, the memory of each GPU (e.g. 80GiB)")
    check_step_tokens(args.step_tokens)
    budget = Budget(parse_size(args.device_mem), _host_bytes(args.host_mem), args.ctx,
                    args.batch, args.step_tokens, args.kv_type)
    given = {field: getattr(args, flag) * 1e9 if getattr(args, flag) else None
             for flag, field in RATE_FLAGS.items()}
    full = plan_model(args.model, budget, plan_rates(given), args.profile, args.gpus,
                      parse_size(args.gpu_mem) if args.gpu_mem else 0)
    doc = report(full)
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print_plan(doc)
    return 0


def _host_bytes(given: str | None) -> int:
    from moeswap.memory import parse_size
    from moeswap.planner.auto import machine_memory

    if given is not None:
        return parse_size(given)
    machine = machine_memory()
    return max(machine.free_ram - machine.reserve, 0)


def print_plan(doc: dict) -> None:
    from rich.table import Table

    from moeswap.planner.placement import gib

    console = stdout_console(highlight=False)
    b, kv, m = doc["bytes"], doc["kv_cache"], doc["moeswap"]
    budget = doc["budget"]
    t = Table(title=f"{doc['model']} ({doc['architecture']}): ctx {budget['context']} x "
                    f"{budget['batch']}, device {gib(budget['device_bytes'])}, "
                    f"host {gib(budget['host_bytes'])}", show_header=False)
    t.add_column("what")
    t.add_column("value", justify="right")
    dense = not m["experts_total"]
    rows = [("weights, total", gib(b["total"]))]
    if not dense:
        rows += [
            ("shared (attention, norms, routers, shared experts, head)", gib(b["shared"])),
            ("routed experts, all", gib(b["routed"])),
            ("one expert of one layer", gib(b["one_expert"])),
            ("read per token (shared + top-k experts)", gib(b["active_per_token"]))]
    rows += [
        ("KV cache per token (16-bit)", gib(kv["bytes_per_token_f16"])),
        ("KV cache for the context (16-bit)", gib(kv["context_bytes_f16"])),
        (f"moeswap: KV cache for the context ({budget['kv_type']})",
         gib(kv["moeswap_charge_bytes"])),
        (f"moeswap: RAM for weights + KV ({budget['kv_type']}) + step" if dense else
         f"moeswap: RAM for shared + KV ({budget['kv_type']}) + step + staging",
         gib(m["host_charged_bytes"])),
        (f"moeswap: a step's working memory (--step-tokens {budget['step_tokens']})",
         gib(m["working_bytes"]))]
    if not dense:
        rows += [
            ("moeswap: expert slots device / host", f"{m['device_slots']} / {m['host_slots']} "
                                                    f"of {gib(m['slot_bytes'])}"),
            ("moeswap: experts resident", f"{m['experts_resident']} of {m['experts_total']}"),
            ("moeswap: experts left on disk", gib(m["experts_on_disk_bytes"])),
            ("moeswap: expected hit rate", f"{m['hit_rate']['total']:.1%} "
                                           f"(device {m['hit_rate']['device']:.1%})")]
    rows += [
        ("moeswap: predicted decode", f"{m['decode_tokens_per_second']:.2f} tokens/s"),
        ("moeswap: predicted prefill", f"{m['prefill_tokens_per_second']:.1f} tokens/s"),
        ("llama.cpp: GPU / CPU weights", f"{gib(doc['llama_cpp']['gpu_bytes'])} / "
                                         f"{gib(doc['llama_cpp']['cpu_bytes'])}"),
        ("llama.cpp: predicted decode",
         f"{doc['llama_cpp']['decode_tokens_per_second']:.2f} tokens/s"),
    ]
    for row in rows:
        t.add_row(*row)
    console.print(t)
    console.print(f"hit rate: {m['hit_rate']['source']}", markup=False)
    console.print(f"rates: {m['rates']['source']}", markup=False)
    console.print("\nmoeswap:\n  " + shlex.join(m["command"]), markup=False)
    console.print("llama.cpp:\n  " + shlex.join(doc["llama_cpp"]["command"]), markup=False)
    for note in doc["llama_cpp"]["notes"]:
        console.print(f"  note: {note}", markup=False)
    console.print("Ollama Modelfile:\n  " + doc["ollama"]["modelfile"].rstrip().replace("\n", "\n  "),
                  markup=False)
    for note in doc["ollama"]["notes"]:
        console.print(f"  note: {note}", markup=False)
    if "multi_gpu" in doc:
        g = doc["multi_gpu"]
        console.print(f"{g['gpus']} GPUs:\n  vLLM:   {shlex.join(g['vllm'])}\n"
                      f"  SGLang: {shlex.join(g['sglang'])}", markup=False)
        for note in g["notes"]:
            console.print(f"  note: {note}", markup=False)
