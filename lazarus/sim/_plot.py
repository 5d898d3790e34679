"""PNG timelines: one row of coloured time buckets per system, nodes in use above it."""

from __future__ import annotations

from pathlib import Path

COLORS = {
    "compute": "#4c9a2a",
    "checkpoint": "#f2b134",
    "restart": "#d1495b",
    "reconfiguration": "#2e86ab",
    "lost": "#8c2f39",
    "idle": "#bbbbbb",
}


def plot_timelines(timelines: dict[str, list[tuple[float, float, str, int]]], path: str | Path,
                   title: str = "") -> None:
    """Write ``path``: per system a bar of buckets over time and the nodes computing."""
    from moc.elastic import import_optional

    matplotlib = import_optional("matplotlib", "lazarus simulate --png")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    names = list(timelines)
    fig, axes = plt.subplots(len(names), 1, figsize=(10, 1.6 * len(names) + 0.8), sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        segs = timelines[name]
        for t0, t1, bucket, _ in segs:
            ax.broken_barh([(t0 / 60, (t1 - t0) / 60)], (0, 1), color=COLORS[bucket], linewidth=0)
        twin = ax.twinx()
        xs: list[float] = []
        ys: list[float] = []
        for t0, t1, bucket, n in segs:
            xs += [t0 / 60, t1 / 60]
            ys += [n if bucket == "compute" else 0, n if bucket == "compute" else 0]
        twin.plot(xs, ys, color="black", linewidth=0.8)
        twin.set_ylabel("nodes", fontsize=8)
        twin.set_ylim(0, max(ys + [1]) * 1.15)
        ax.set_yticks([])
        ax.set_ylabel(name, rotation=0, ha="right", va="center")
    axes[-1, 0].set_xlabel("minutes")
    handles = [Patch(color=c, label=b) for b, c in COLORS.items()]
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.955), ncol=6, fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, y=0.995, fontsize=9, va="top", x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
