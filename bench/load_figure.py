"""The serving load's rate curve as a figure: per rate the median of the repeats, bars from the lowest
to the highest repeat; one line per start (and prefix-cache mode). Only measured points are drawn."""

from __future__ import annotations

from typing import Any

PANELS = (  # (title, [(key, label suffix, marker)])
    ("output tokens/s", [("offered_tok_per_s", "offered", "x:"), ("achieved_tok_per_s", "achieved", "o-")]),
    ("TTFT (ms)", [("ttft_p50_ms", "p50", "o-"), ("ttft_p99_ms", "p99", "s--")]),
    ("TPOT, per request (ms)", [("tpot_p50_ms", "p50", "o-"), ("tpot_p99_ms", "p99", "s--")]),
    ("per-token ITL p99 and message cadence p99 (ms)", [("itl_p99_ms", "ITL p99", "o-"),
                                                        ("msg_gap_p99_ms", "message p99", "^:")]),
)


def curve_figure(points: list[dict[str, Any]], slo_lines: dict[str, float] | None = None) -> Any | None:
    """points: the curve's aggregates ({start, rate, prefix_cache, spread}). None with fewer than two rates."""
    series: dict[str, list[dict[str, Any]]] = {}
    both_modes = len({p.get("prefix_cache") for p in points}) > 1
    for point in sorted(points, key=lambda p: p["rate"]):
        name = point["start"] + (f", prefix cache {point['prefix_cache']}" if both_modes else "")
        series.setdefault(name, []).append(point)
    if not any(len(s) > 1 for s in series.values()):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4.2))
    for ax, (title, keys) in zip(axes, PANELS):
        for name, pts in series.items():
            for key, suffix, style in keys:
                have = [p for p in pts if key in p["spread"]]
                if not have:
                    continue
                med = [p["spread"][key]["median"] for p in have]
                low = [m - p["spread"][key]["min"] for m, p in zip(med, have)]
                high = [p["spread"][key]["max"] - m for m, p in zip(med, have)]
                ax.errorbar([p["rate"] for p in have], med, yerr=[low, high], fmt=style, capsize=3,
                            label=f"{name} {suffix}")
        for key, limit in (slo_lines or {}).items():
            if any(key == k for k, _, _ in keys):
                ax.axhline(limit, color="red", linestyle="-.", linewidth=1, label=f"SLO {limit:g} ms")
        ax.set_xlabel("requests/s (Poisson)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        if "ms" in title:
            ax.set_yscale("log")
    fig.tight_layout()
    return fig
