"""benchmark_elastic.py's KV series: a CSV (GiB) and a plot of committed bytes over time.

The plot has one row per (load, pattern) experiment and one column per shared mode
(elastic, static), one line per engine. It is drawn with matplotlib where installed,
else with Pillow (plainer: axes, lines, the maximum of each axis as text), else
only the CSV is written.
"""

from __future__ import annotations

import csv

GAUGES = {
    "committed_bytes": "vllm:kv_cache_committed_bytes",
    "in_use_bytes": "vllm:kv_cache_in_use_bytes",
    "reclaimable_bytes": "vllm:kv_cache_reclaimable_bytes",
    "limit_bytes": "vllm:kv_cache_limit_bytes",
}
_COLORS = ["#1f77b4", "#d62728", "#2ca02c"]


def _lines(experiment: dict, mode: str) -> list[tuple[str, list[float], list[float]]]:
    """(label, times s, committed GiB) per engine of one experiment's mode."""
    r = experiment["modes"].get(mode)
    if r is None:
        return []
    out = []
    for name, engine in r["engines"].items():
        points = [(row["t_s"], row[f"{name}_committed_bytes"] / 2**30) for row in r["series"]
                  if row.get(f"{name}_committed_bytes") is not None]
        out.append((f"{name} ({engine['shape']})", [p[0] for p in points],
                    [p[1] for p in points]))
    return out


def write_csv(experiments: list[dict], path: str) -> None:
    """One row per sample and engine: load, pattern, mode, t_s, engine, the gauges in GiB
    (empty where the server does not export one)."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["load", "pattern", "mode", "t_s", "engine",
                         *(k.replace("_bytes", "_gib") for k in GAUGES)])
        for exp in experiments:
            for mode, r in exp["modes"].items():
                for row in r["series"]:
                    for name in r["engines"]:
                        if f"{name}_committed_bytes" not in row:
                            continue
                        values = [row[f"{name}_{k}"] for k in GAUGES]
                        writer.writerow([exp["load"], exp["pattern"], mode, row["t_s"], name,
                                         *("" if v is None else round(v / 2**30, 3)
                                           for v in values)])


def _plot_matplotlib(plt, experiments: list[dict], modes: list[str], path: str) -> None:
    fig, axes = plt.subplots(len(experiments), len(modes), squeeze=False, sharey=True,
                             figsize=(6 * len(modes), 2.8 * len(experiments)))
    for row_axes, exp in zip(axes, experiments, strict=True):
        for ax, mode in zip(row_axes, modes, strict=True):
            ax.set_title(f"{exp['load']}, {exp['pattern']}: {mode}", fontsize=9)
            for label, t, gib in _lines(exp, mode):
                ax.plot(t, gib, label=label)
            ax.set_xlabel("time (s)")
            ax.set_ylabel("committed KV (GiB)")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_pillow(image_mod, draw_mod, experiments: list[dict], modes: list[str],
                 path: str) -> None:
    w, h, pad = 560, 240, 40
    image = image_mod.new("RGB", (w * len(modes), h * len(experiments)), "white")
    draw = draw_mod.Draw(image)
    top = max([g for exp in experiments for m in modes for _, _, gs in _lines(exp, m)
               for g in gs] or [1.0]) or 1.0
    for r, exp in enumerate(experiments):
        for c, mode in enumerate(modes):
            x0, y0 = c * w + pad, r * h + 20
            x1, y1 = (c + 1) * w - 10, (r + 1) * h - pad
            draw.rectangle([x0, y0, x1, y1], outline="black")
            draw.text((x0, r * h + 4), f"{exp['load']}, {exp['pattern']}: {mode} "
                      f"(committed KV, GiB; top {top:.3g})", fill="black")
            lines = _lines(exp, mode)
            end = max([t[-1] for _, t, _ in lines if t] or [1.0]) or 1.0
            draw.text((x1 - 60, y1 + 4), f"{end:.0f} s", fill="black")
            for k, (label, t, gib) in enumerate(lines):
                color = _COLORS[k % len(_COLORS)]
                xy = [(x0 + (x1 - x0) * ti / end, y1 - (y1 - y0) * g / top)
                      for ti, g in zip(t, gib, strict=True)]
                if len(xy) > 1:
                    draw.line(xy, fill=color, width=2)
                draw.text((x0 + 6, y0 + 4 + 12 * k), label, fill=color)
    image.save(path)


def write_series(experiments: list[dict], csv_path: str | None, png_path: str | None) -> str:
    """The CSV where asked, and the plot: its path, or why there is none."""
    if csv_path:
        write_csv(experiments, csv_path)
    if not png_path:
        return "no --png"
    modes = [m for m in ("elastic", "static") if any(m in e["modes"] for e in experiments)]
    if not modes:
        return "nothing to plot (no elastic or static run)"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        try:
            from PIL import Image, ImageDraw
        except ImportError:
            return "neither matplotlib nor Pillow installed: CSV only"
        _plot_pillow(Image, ImageDraw, experiments, modes, png_path)
        return png_path
    _plot_matplotlib(plt, experiments, modes, png_path)
    return png_path
