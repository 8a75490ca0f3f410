"""PNG plots of a benchmark report: decode tokens/s versus the RAM budget (the sweeps) and
memory over time, sample by sample, for each scenario."""

from __future__ import annotations

import math
from pathlib import Path


def write_plots(report: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    written = []
    runs = [r for r in report["runs"] if r["status"] == "ok"]
    sweeps = [s for s in ("resident-sweep", "window-sweep") if any(r["scenario"] == s for r in runs)]
    if sweeps:
        fig, axes = plt.subplots(1, len(sweeps), figsize=(6 * len(sweeps), 4), squeeze=False)
        for ax, scenario in zip(axes[0], sweeps):
            sweep_axes(ax, [r for r in runs if r["scenario"] == scenario], scenario)
        fig.suptitle(Path(report["model"]["path"]).name)
        fig.tight_layout()
        written.append(save(fig, out_dir / "bench-tokens-vs-budget.png"))
    for scenario in dict.fromkeys(r["scenario"] for r in runs):
        fig, ax = plt.subplots(figsize=(7, 4))
        memory_axes(ax, [r for r in runs if r["scenario"] == scenario])
        ax.set_title(f"{scenario}: memory, sampled after each step "
                     f"({Path(report['model']['path']).name})", fontsize=9)
        fig.tight_layout()
        written.append(save(fig, out_dir / f"bench-memory-{scenario}.png"))
    return written


def save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def sweep_axes(ax, runs: list[dict], scenario: str) -> None:
    """x: RAM budget in MiB (resident sweep) or window N (window sweep); runs without a budget
    are horizontal lines."""
    key = "resident_per_layer" if scenario == "resident-sweep" else "window"
    points = sorted((r for r in runs if r[key] is not None), key=lambda r: r[key])
    if key == "resident_per_layer":
        xs = [r["budget_bytes"] / 2**20 for r in points]
        ax.set_xlabel("RAM budget, MiB (shared weights + KV + N experts/layer)")
    else:
        xs = [r["window"] for r in points]
        ax.set_xscale("log", base=2)
        ax.set_xlabel("window N (--policy window:N), same budget")
    ax.plot(xs, [r["decode_tok_s"] for r in points], "o-", label="moeswap")
    for r, x in zip(points, xs):
        label = f"{r[key]}" if key == "window" else f"{r[key]}/layer"
        if r["hit_rate"] is not None:
            label += f", hit {r['hit_rate']:.0%}"
        ax.annotate(label, (x, r["decode_tok_s"]), fontsize=7, textcoords="offset points",
                    xytext=(3, 4))
    for r in runs:
        if r[key] is None:
            ax.axhline(r["decode_tok_s"], linestyle="--", color="C1" if r["engine"] != "moeswap"
                       else "C2", label=f"{r['label']} (no budget)")
    ax.set_ylabel("decode tokens/s")
    ax.set_ylim(bottom=0)
    ax.set_title(scenario, fontsize=9)
    ax.legend(fontsize=7)


def memory_axes(ax, runs: list[dict]) -> None:
    """RssAnon of each run (solid) and each store tier's bytes (dashed), sample by sample."""
    for i, r in enumerate(runs):
        samples = r["memory_trace"]
        anon = [s.get("rss_anon") for s in samples]
        if all(a is not None for a in anon):
            ax.plot([a / 2**20 for a in anon], color=f"C{i}", label=f"{r['label']}: RssAnon")
        held = sorted({t for s in samples for t, b in s.get("tiers", {}).items() if b})
        for j, tier in enumerate(held):  # gaps where the store did not exist yet
            ax.plot([s["tiers"][tier] / 2**20 if "tiers" in s else math.nan for s in samples],
                    color=f"C{i}", linestyle=("--", ":")[j % 2], label=f"{r['label']}: {tier} tier")
    ax.set_xlabel("sample (after load, each prompt piece, each decode step)")
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=6)
