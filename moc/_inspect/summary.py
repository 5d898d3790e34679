"""What ``moc inspect`` reports about a store: a screen-sized summary (one line per MoE
layer) and the per-unit table. Pure functions over a :class:`moc._store.format.Manifest`; no
tensor is read.

Terms used in the output:

* age of an expert: steps between the manifest's step and the step its saved version was
  taken (partial checkpoints leave experts at older versions);
* PLT of a layer: expert slots lost by the recoveries so far / slots the layer was routed
  (tokens processed * top_k in checkpoints that predate the per-layer count); the run's
  PLT is the mean over layers;
* unsaved tokens of a layer: tokens routed to its experts since their saved versions: what
  a restore from this step would lose.
"""

from __future__ import annotations

import re
import statistics
import time
from typing import Any, Sequence

from .._store import Manifest

__all__ = ["summarize", "layer_summary", "layer_labels", "format_summary", "format_units", "human",
           "natural_key", "MAX_ROWS"]

MAX_ROWS = 60  # at most this many layer rows; more layers are grouped, so output fits a screen
DEFAULT_LAYOUT = "per-expert modules"


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def natural_key(s: str) -> list[Any]:
    """Sort key putting ``layers.2`` before ``layers.10``."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def layer_labels(names: Sequence[str]) -> tuple[str, list[str]]:
    """A pattern for the layer names (``layers.*.moe``) and each name's varying part.

    The common prefix and suffix are cut at a non-alphanumeric character, so ``l1`` and
    ``l10`` keep their digits. Without a useful common part: ``("", names)``.
    """
    names = list(names)
    if len(names) < 2:
        return "", names

    def cut(common: str) -> str:
        marks = [i for i, c in enumerate(common) if not c.isalnum()]
        return common[: marks[-1] + 1] if marks else ""

    pre = cut(_common_prefix(names))
    suf = cut(_common_prefix([n[len(pre):][::-1] for n in names]))[::-1]
    labels = [n[len(pre): len(n) - len(suf)] for n in names]
    if not (pre or suf) or any(not lab for lab in labels):
        return "", names
    return f"{pre}*{suf}", labels


def _common_prefix(names: Sequence[str]) -> str:
    first, last = min(names), max(names)
    i = 0
    while i < min(len(first), len(last)) and first[i] == last[i]:
        i += 1
    return first[:i]


def _layout(m: Manifest) -> dict[str, Any]:
    layout = m.meta.get("layout")
    layout = dict(layout) if isinstance(layout, dict) else {}
    return {"kind": layout.get("kind", "per_expert"),
            "description": layout.get("description") or DEFAULT_LAYOUT,
            "experts_per_layer": layout.get("experts_per_layer")}


def layer_summary(m: Manifest) -> dict[str, Any]:
    """Per MoE layer (natural order): experts, ages, bytes, recorded PLT, unsaved tokens;
    plus totals for the non-expert units and the layout the writer recorded."""
    plt = m.plt or {}
    flat = max(1, int(plt.get("total_tokens", 0) or 0)) * max(1, int(plt.get("top_k", 1) or 1))
    routed = plt.get("routed") or {}
    lost = plt.get("lost_tokens") or {}
    unsaved = plt.get("unsaved") or {}
    layers = m.layers()
    rows = []
    for layer in sorted(layers, key=natural_key):
        recs = layers[layer]
        ages = sorted(m.step - r.step for r in recs.values())
        lost_l = int(lost.get(layer, 0) or 0)
        unsaved_l = int(sum(unsaved.get(layer) or []))
        denom = max(1, int(routed[layer])) if layer in routed else flat
        has_tokens = int(routed[layer]) > 0 if layer in routed else int(plt.get("total_tokens", 0) or 0) > 0
        rows.append({
            "layer": layer, "experts": len(recs),
            "age_min": ages[0], "age_median": statistics.median(ages), "age_max": ages[-1],
            "version_steps": sorted({r.step for r in recs.values()}),
            "nbytes": sum(r.nbytes for r in recs.values()),
            "stored_nbytes": sum(r.stored_nbytes for r in recs.values()),
            "lost_tokens": lost_l, "plt": lost_l / denom if has_tokens else 0.0,
            "unsaved_tokens": unsaved_l, "unsaved_fraction": unsaved_l / denom if has_tokens else 0.0,
        })
    modules = [r for r in m.units.values() if r.kind == "module"]
    extras = [r for r in m.units.values() if r.kind == "extra"]
    experts = [r for r in m.units.values() if r.kind == "expert"]
    return {
        "layout": _layout(m),
        "layers": rows,
        "experts": {"units": len(experts), "nbytes": sum(r.nbytes for r in experts),
                    "stored_nbytes": sum(r.stored_nbytes for r in experts)},
        "non_expert": {"modules": len(modules), "extra": len(extras),
                       "nbytes": sum(r.nbytes for r in modules + extras),
                       "stored_nbytes": sum(r.stored_nbytes for r in modules + extras),
                       "version_steps": sorted({r.step for r in modules + extras})},
        "plt": {"value": float(plt.get("value", 0.0) or 0.0), "lost_tokens": int(sum(int(v) for v in lost.values())),
                "total_tokens": int(plt.get("total_tokens", 0) or 0), "top_k": int(plt.get("top_k", 1) or 1)},
    }


def summarize(cs: Any, m: Manifest) -> dict[str, Any]:
    """Everything ``moc inspect --json`` prints: per-unit records, per-layer ages, PLT,
    the writer's metadata, and the per-layer ``summary``."""
    units = []
    for name, rec in sorted(m.units.items()):
        units.append({"name": name, "kind": rec.kind, "version_step": rec.step, "age": m.step - rec.step,
                      "nbytes": rec.nbytes, "stored_nbytes": rec.stored_nbytes,
                      "codec": sorted({c.codec for c in rec.chunks})})
    layers = {layer: {"experts": list(recs), "version_steps": [r.step for r in recs.values()],
                      "ages": [m.step - r.step for r in recs.values()]}
              for layer, recs in m.layers().items()}
    saved_now = [u for u in units if u["version_step"] == m.step]
    return {
        "url": cs.store.url, "steps": cs.steps(), "step": m.step, "format_version": m.format_version,
        "created_at": m.created_at,
        "nbytes": sum(u["nbytes"] for u in units), "stored_nbytes": sum(u["stored_nbytes"] for u in units),
        "saved_at_step_nbytes": sum(u["nbytes"] for u in saved_now),
        "units": units, "layers": layers, "plt": m.plt, "meta": m.meta,
        "summary": layer_summary(m),
    }


# -- text ----------------------------------------------------------------------------------
def _steps_text(steps: Sequence[int]) -> str:
    if len(steps) <= 8:
        return ", ".join(map(str, steps))
    return f"{', '.join(map(str, steps[:3]))}, ..., {', '.join(map(str, steps[-3:]))} ({len(steps)} steps)"


def _span(values: Sequence[int]) -> str:
    values = sorted(set(values))
    if not values:
        return "-"
    return str(values[0]) if len(values) == 1 else f"{values[0]}..{values[-1]}"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.1f}"


def header_lines(info: dict[str, Any]) -> list[str]:
    """store, steps, step, size: the first lines of every text view."""
    return [
        f"store    {info['url']}",
        f"steps    {_steps_text(info['steps'])}",
        f"step     {info['step']} (format_version {info['format_version']}, "
        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(info['created_at']))})",
        f"size     {human(info['nbytes'])} raw, {human(info['stored_nbytes'])} stored; "
        f"{human(info['saved_at_step_nbytes'])} written at this step",
    ]


def group_rows(rows: list[dict[str, Any]], max_rows: int = MAX_ROWS) -> tuple[int, list[list[dict[str, Any]]]]:
    """Consecutive rows grouped so that at most ``max_rows`` remain: (group size, groups)."""
    size = max(1, -(-len(rows) // max_rows))
    return size, [rows[i: i + size] for i in range(0, len(rows), size)]


def format_summary(info: dict[str, Any], max_rows: int = MAX_ROWS) -> list[str]:
    """The default view: at most ``max_rows`` layer rows whatever the model size."""
    s = info["summary"]
    rows = s["layers"]
    meta = info.get("meta") or {}
    out = header_lines(info)
    counts = sorted({r["experts"] for r in rows})
    shape = (f"{len(rows)} MoE layers x {_span(counts)} experts" if rows else "no MoE layers")
    desc = s["layout"]["description"]
    out.append(f"layout   {desc}" if "MoE layers" in desc else f"layout   {desc} ({shape})")
    knobs = [f"{k} {meta[k]}" for k in ("k_snapshot", "k_persist", "interval", "world") if k in meta]
    if knobs:
        out.append(f"config   {', '.join(knobs)}" + (f"; run {meta['run_id']}" if meta.get("run_id") else ""))
    p = s["plt"]
    out.append(f"PLT      {p['value']:.4%} (lost tokens {p['lost_tokens']}, tokens processed {p['total_tokens']}, "
               f"top_k {p['top_k']})")
    if rows:
        pattern, labels = layer_labels([r["layer"] for r in rows])
        size, groups = group_rows([dict(r, label=lab) for r, lab in zip(rows, labels)], max_rows)
        width = max(10, min(28, max(len(_group_label(g)) for g in groups)))
        out.append("")
        note = f" ({size} layers per row; --units for every expert)" if size > 1 else ""
        out.append(f"MoE layers{': ' + pattern if pattern else ''}{note}")
        out.append(f"{'layer':<{width}} {'experts':>7} {'age min':>8} {'median':>7} {'max':>6} "
                   f"{'raw':>10} {'stored':>10} {'PLT':>8} {'unsaved tok':>12}")
        for g in groups:
            ages_min = min(r["age_min"] for r in g)
            ages_max = max(r["age_max"] for r in g)
            median = statistics.median([r["age_median"] for r in g]) if len(g) > 1 else g[0]["age_median"]
            label = _group_label(g)
            label = label if len(label) <= width else label[: width - 3] + "..."
            out.append(
                f"{label:<{width}} {sum(r['experts'] for r in g):>7} {ages_min:>8} {_num(median):>7} {ages_max:>6} "
                f"{human(sum(r['nbytes'] for r in g)):>10} {human(sum(r['stored_nbytes'] for r in g)):>10} "
                f"{sum(r['plt'] for r in g) / len(g):>8.3%} {sum(r['unsaved_tokens'] for r in g):>12}")
        e = s["experts"]
        out.append(f"{'all':<{width}} {e['units']:>7} {min(r['age_min'] for r in rows):>8} "
                   f"{'':>7} {max(r['age_max'] for r in rows):>6} {human(e['nbytes']):>10} "
                   f"{human(e['stored_nbytes']):>10} {p['value']:>8.3%} "
                   f"{sum(r['unsaved_tokens'] for r in rows):>12}")
    ne = s["non_expert"]
    out.append("")
    out.append(f"non-expert  {ne['modules']} modules + {ne['extra']} extra state, {human(ne['nbytes'])} raw, "
               f"{human(ne['stored_nbytes'])} stored, version step {_span(ne['version_steps'])}")
    out.append("age: steps since an expert's saved version; PLT: tokens lost by past recoveries / tokens")
    out.append("processed; unsaved tok: tokens routed since the saved versions (a restore from here loses them)")
    return out


def _group_label(g: list[dict[str, Any]]) -> str:
    return g[0]["label"] if len(g) == 1 else f"{g[0]['label']}-{g[-1]['label']}"


def format_units(info: dict[str, Any]) -> list[str]:
    """``--units``: one line per unit, then every expert's age, then PLT."""
    out = header_lines(info) + [""]
    out.append(f"{'unit':<40}{'kind':<8}{'version':>8}{'age':>6}{'raw':>12}{'stored':>12}")
    for u in info["units"]:
        out.append(f"{u['name']:<40.40}{u['kind']:<8}{u['version_step']:>8}{u['age']:>6}"
                   f"{human(u['nbytes']):>12}{human(u['stored_nbytes']):>12}")
    if info["layers"]:
        out.append("")
        out.append("expert ages (steps since each expert's saved version):")
        for layer in sorted(info["layers"], key=natural_key):
            d = info["layers"][layer]
            out.append(f"  {layer}: " + " ".join(f"{e}:{a}" for e, a in zip(d["experts"], d["ages"])))
    plt = info["plt"]
    if plt:
        lost = sum((plt.get("lost_tokens") or {}).values())
        out.append("")
        out.append(f"PLT {plt.get('value', 0.0):.4%} (lost tokens {lost}, tokens processed "
                   f"{plt.get('total_tokens', 0)}, top_k {plt.get('top_k', 1)})")
    return out
