"""``moc inspect --png FILE``: expert ages as a heatmap (MoE layers x experts, colour =
steps since the saved version) with PLT per layer beside it.

The figure's pixel size follows from the shape (:func:`heatmap_geometry`): every expert
gets at least 4 px and every layer 12 px, so 58 layers x 256 experts stay readable.
"""

from __future__ import annotations

import math
import os

from .._optional import import_optional
from .._store import Manifest
from .summary import layer_labels, layer_summary, natural_key

__all__ = ["heatmap_geometry", "write_heatmap", "age_matrix"]

DPI = 100
LEFT, RIGHT, TOP, BOTTOM = 120, 30, 70, 60     # margins, px
GAP, CBAR, CBAR_LABELS, PLT_W = 14, 18, 90, 300  # heatmap | colour bar | its labels | PLT panel
MIN_CELL_W, MIN_CELL_H = 4, 12


def heatmap_geometry(layers: int, experts: int) -> dict[str, int]:
    """Pixel sizes of the figure: ``width``, ``height``, ``cell_w``, ``cell_h`` (at least)."""
    if layers < 1 or experts < 1:
        raise ValueError(f"a heatmap needs at least one MoE layer and one expert, got {layers} x {experts}")
    map_w = max(720, MIN_CELL_W * experts)
    map_h = max(360, MIN_CELL_H * layers)
    width = LEFT + map_w + GAP + CBAR + CBAR_LABELS + PLT_W + RIGHT
    height = TOP + map_h + BOTTOM
    return {"width": width, "height": height, "map_w": map_w, "map_h": map_h,
            "cell_w": map_w // experts, "cell_h": map_h // layers}


def age_matrix(m: Manifest) -> tuple[list[str], list[list[float]]]:
    """Layers in natural order and, per layer, every expert's age (NaN where a layer has
    fewer experts than the widest)."""
    layers = m.layers()
    names = sorted(layers, key=natural_key)
    width = max((max(recs) + 1 for recs in layers.values()), default=0)
    rows = []
    for name in names:
        row = [math.nan] * width
        for e, rec in layers[name].items():
            row[e] = float(m.step - rec.step)
        rows.append(row)
    return names, rows


def write_heatmap(m: Manifest, path: str, *, url: str = "") -> dict[str, int]:
    """Write the PNG; return its geometry. ``path`` must end in .png in an existing folder."""
    folder = os.path.dirname(os.path.abspath(path))
    if not path.lower().endswith(".png"):
        raise ValueError(f"--png {path}: the file name must end in .png")
    if not os.path.isdir(folder):
        raise ValueError(f"--png {path}: directory {folder} does not exist")
    names, ages = age_matrix(m)
    if not names:
        raise ValueError(f"--png {path}: step {m.step} has no MoE layers to plot")
    matplotlib = import_optional("matplotlib", "--png")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    geo = heatmap_geometry(len(names), len(ages[0]))
    W, H = geo["width"], geo["height"]
    summary = layer_summary(m)
    rows = {r["layer"]: r for r in summary["layers"]}
    pattern, labels = layer_labels(names)

    fig = plt.figure(figsize=(W / DPI, H / DPI), dpi=DPI)

    def box(x: int, w: int) -> tuple[float, float, float, float]:  # pixel box -> figure fraction (same height)
        return (x / W, BOTTOM / H, w / W, geo["map_h"] / H)

    ax = fig.add_axes(box(LEFT, geo["map_w"]))
    data = np.ma.masked_invalid(np.array(ages, dtype=float))
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#d0d0d0")
    vmax = max(1.0, float(data.max()) if data.count() else 1.0)
    im = ax.imshow(data, aspect="auto", interpolation="nearest", cmap=cmap, vmin=0, vmax=vmax)
    n_layers, n_experts = data.shape
    ax.set_xlabel("expert")
    xstep = max(1, 2 ** math.ceil(math.log2(max(1, n_experts / 16))))
    ax.set_xticks(range(0, n_experts, xstep))
    ystep = max(1, math.ceil(n_layers / 60))
    ax.set_yticks(range(0, n_layers, ystep))
    ax.set_yticklabels([labels[i] for i in range(0, n_layers, ystep)], fontsize=7 if n_layers > 24 else 9)
    ax.set_ylabel(f"MoE layer ({pattern})" if pattern else "MoE layer")
    ax.tick_params(axis="x", labelsize=8)

    cax = fig.add_axes(box(LEFT + geo["map_w"] + GAP, CBAR))
    cb = fig.colorbar(im, cax=cax)
    cb.set_label(f"steps since saved version (manifest step {m.step})")

    pax = fig.add_axes(box(LEFT + geo["map_w"] + GAP + CBAR + CBAR_LABELS, PLT_W), sharey=ax)
    y = np.arange(n_layers)
    recorded = np.array([100 * rows[n]["plt"] for n in names])
    at_risk = np.array([100 * rows[n]["unsaved_fraction"] for n in names])
    h = 0.4 if n_layers <= 60 else 0.8
    pax.barh(y - h / 2, recorded, height=h, color="#c0392b", label="PLT recorded")
    pax.barh(y + h / 2, at_risk, height=h, color="#f0b27a", label="unsaved (lost if restored now)")
    pax.set_xlabel(f"% of tokens processed (run PLT {100 * summary['plt']['value']:.2f}%)")
    pax.set_xlim(0, max(1e-3, float(max(recorded.max(), at_risk.max()))) * 1.1)
    pax.tick_params(axis="y", labelleft=False)
    pax.tick_params(axis="x", labelsize=8)
    pax.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), fontsize=8, frameon=False, borderaxespad=0.2)
    ax.set_ylim(n_layers - 0.5, -0.5)

    layout = summary["layout"]["description"]
    title = f"expert ages at step {m.step}: {n_layers} MoE layers x {n_experts} experts, {layout}"
    fig.text(LEFT / W, 1 - 22 / H, title, fontsize=12, va="top")
    if url:
        fig.text(LEFT / W, 1 - 44 / H, url, fontsize=9, va="top", color="#555555")
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return geo
