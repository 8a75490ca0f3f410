"""The quality cost of --miss-lowbit (an approximation) on the built-in trained model.

    python scripts/offload_lowbit.py --markdown lowbit.md

Same text and scoring as ``scripts/offload_trained.py threshold`` (held-out windows, fed one
token at a time): KL divergence of each run's next-token distribution from the fully resident
model's and perplexity on the held-out next tokens, beside how often the approximation fired
(share of expert requests computed from a low-bit copy), the full-precision bytes those fires
did not read and the bytes the copies hold. The host budget of each row is the shared weights,
the staging ring and the copies, plus full-precision host slots for a share of the routed bytes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from offload_trained import ResidentReference  # noqa: E402

# (copy type, host policy, share of the routed bytes in full-precision host slots)
ROWS = [("q4_0", "lru", 0.0), ("q4_k", "lru", 0.0), ("q5_0", "lru", 0.0), ("q6_k", "lru", 0.0),
        ("q4_0", "admit:2", 0.25), ("q4_0", "admit:4", 0.25), ("q4_0", "lru", 0.25)]


def lowbit_model(path: Path, type_name: str, policy: str, share: float, threads: int):
    """(model, its store's factory) with the copies charged and ``share`` of the experts' bytes
    in host slots."""
    from moeswap.experts.lowbit import lowbit_layout, lowbit_type
    from moeswap.experts.build import build_store
    from moeswap.experts.settings import OffloadSettings
    from moeswap.experts.store import shared_bytes
    from moeswap.memory import HostCharge
    from moeswap.experts.tiers import slot_bytes
    from moeswap.formats.config import config_from_gguf
    from moeswap.formats.gguf_file import GGUFFile
    from moeswap.models import load_model
    from moeswap.models.quant_experts import ExpertLayout

    gguf = GGUFFile.open(path)
    config = config_from_gguf(gguf)
    layouts = [ExpertLayout.from_file(gguf, i) for i in config.moe_layers]
    n_experts = len(layouts) * config.n_expert
    copies = slot_bytes([lowbit_layout(layout, lowbit_type(type_name)) for layout in layouts])
    slot = slot_bytes(layouts)
    host = HostCharge().bytes(config, shared_bytes(gguf, config.moe_layers),
                              config.n_expert_used * slot, copies * n_experts) \
        + int(share * n_experts) * slot
    factory = build_store(OffloadSettings(host_bytes=host, policy=policy, miss_lowbit=type_name))
    return load_model(path, threads=threads, expert_runner=factory), factory


def main() -> None:
    from moeswap.errors import MoeswapError

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "moeswap" / "data" / "stdlib-moe-q8_0.gguf"))
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--length", type=int, default=64, help="tokens per window")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--markdown", help="write the table here too")
    args = parser.parse_args()
    path = Path(args.model)
    reference = ResidentReference(path, args.windows, args.length, args.threads)
    lines = ["| --miss-lowbit | host policy | full-precision expert RAM | KL(resident ‖ approx) "
             "nats/token | perplexity | fired (share of expert requests) | full-precision MiB "
             "not read | copies MiB |", "|---|---|---:|---:|---:|---:|---:|---:|",
             f"| off (resident) | - | 100% | 0 | {reference.perplexity:.3f} | 0 | 0 | 0 |"]
    for type_name, policy, share in ROWS:
        try:
            model, factory = lowbit_model(path, type_name, policy, share, args.threads)
        except MoeswapError as e:
            print(f"{type_name}: refused: {e}", flush=True)
            continue
        kl, ppl = reference.compare(model)
        s = factory.stats()
        fired = s["lowbit"]["fires"] / max(s["total"]["requests"], 1)
        lines.append(f"| {type_name} | {policy} | {share:.0%} | {kl:.2e} | {ppl:.3f} | "
                     f"{fired:.1%} | {s['lowbit']['saved_bytes'] / 2**20:.1f} | "
                     f"{s['lowbit']['held_bytes'] / 2**20:.1f} |")
        print(lines[-1], flush=True)
    print("\n".join(lines))
    if args.markdown:
        Path(args.markdown).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
