"""PNG plots of a trace's statistics: popularity heatmap, reuse distances, hit rate versus cache size."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never a window
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from moeswap.routing.simulate import SimResult  # noqa: E402
from moeswap.routing.stats import TraceStats  # noqa: E402


def write_plots(stats: TraceStats, curves: list[SimResult], out_dir: str | Path) -> list[Path]:
    """Write the three plots into out_dir; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [
        _popularity_heatmap(stats, out / "popularity.png"),
        _reuse_distance_histogram(stats, out / "reuse_distance.png"),
        _hit_rate_curves(stats, curves, out / "hit_rate.png"),
    ]


def _popularity_heatmap(stats: TraceStats, path: Path) -> Path:
    counts = np.asarray(stats.counts, dtype=np.float64)  # [L, E]
    share = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    fig, ax = plt.subplots(figsize=(max(4, 0.25 * stats.n_experts + 2), max(3, 0.2 * len(stats.layers) + 1.5)))
    image = ax.imshow(share, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xlabel("expert")
    ax.set_ylabel("layer (model block)")
    ax.set_yticks(range(len(stats.layers)), [str(b) for b in stats.layers], fontsize=6)
    ax.set_title(f"{stats.model}: share of each layer's routes")
    fig.colorbar(image, ax=ax)
    return _save(fig, path)


def _reuse_distance_histogram(stats: TraceStats, path: Path) -> Path:
    counts = np.asarray(stats.reuse_distance_counts)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(np.arange(1, len(counts)), counts[1:], width=1.0)
    ax.set_xscale("log")
    ax.set_xlabel("tokens since the same layer last chose the expert")
    ax.set_ylabel("requests")
    ax.set_title(f"{stats.model}: reuse distance")
    return _save(fig, path)


def _hit_rate_curves(stats: TraceStats, curves: list[SimResult], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for policy in dict.fromkeys(r.policy for r in curves):
        points = sorted((r.capacity, r.hit_rate) for r in curves if r.policy == policy)
        ax.plot(*zip(*points), marker="o", label=policy)
    ax.set_xlabel(f"cache size (experts per layer, of {stats.n_experts})")
    ax.set_ylabel("hit rate")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"{stats.model}: hit rate versus cache size")
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
