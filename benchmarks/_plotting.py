"""Plot helpers shared by the benchmark scripts: spreads from the JSON, bars with error bars and labels.

Error bars are the interquartile range (p25..p75) of the samples. Results written before the timing
helper recorded spreads have none: :func:`spread` returns ``None`` and the bars are drawn without.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def pyplot() -> Any | None:
    """``matplotlib.pyplot`` on the Agg backend, or ``None`` (with a note) when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed: no PNG")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def spread(
    stats: Mapping[str, Any] | None = None, samples: Sequence[float] | None = None
) -> tuple[float, float] | None:
    """``(p25, p75)`` from a :class:`_timing.Stats` dict, else from raw samples (>= 2), else ``None``."""
    if stats and "p25_ms" in stats and "p75_ms" in stats:
        return float(stats["p25_ms"]), float(stats["p75_ms"])
    if samples is not None and len(samples) >= 2:
        p25, _, p75 = statistics.quantiles([float(s) for s in samples], n=4, method="inclusive")
        return p25, p75
    return None


def yerr(values: Sequence[float], bounds: Sequence[tuple[float, float] | None]) -> list[list[float]] | None:
    """Asymmetric ``yerr`` for ``ax.bar`` / ``ax.errorbar`` (``None`` when no bound is known)."""
    if all(b is None for b in bounds):
        return None
    low = [max(0.0, v - b[0]) if b else 0.0 for v, b in zip(values, bounds)]
    high = [max(0.0, b[1] - v) if b else 0.0 for v, b in zip(values, bounds)]
    return [low, high]


def bars(ax: Any, xs: Sequence[float], values: Sequence[float], width: float, *,
         bounds: Sequence[tuple[float, float] | None] | None = None, labels: Sequence[str] | None = None,
         fontsize: float = 7, **kwargs: Any) -> Any:
    """Bars with IQR error bars (where ``bounds`` are known) and ``labels`` written above the error bars."""
    bounds = list(bounds) if bounds is not None else [None] * len(values)
    err = yerr(values, bounds)
    container = ax.bar(xs, values, width, yerr=err, capsize=2 if err else 0,
                       error_kw={"elinewidth": 0.8, "ecolor": "0.2"}, **kwargs)
    if labels:
        for x, v, b, text in zip(xs, values, bounds, labels):
            top = max(v, b[1]) if b else v
            ax.annotate(text, (x, top), xytext=(0, 2), textcoords="offset points", ha="center", va="bottom",
                        fontsize=fontsize, linespacing=1.0, zorder=5,
                        bbox={"boxstyle": "square,pad=0.05", "fc": "white", "ec": "none", "alpha": 0.85})
    return container


def wrap(text: str, fig: Any, fontsize: float = 10) -> str:
    """``text`` wrapped to the figure's width (about 0.6 em per character), each line kept."""
    import textwrap

    width = max(20, int(fig.get_figwidth() * 72 / (0.6 * fontsize)))
    return "\n".join(textwrap.fill(line, width) for line in text.split("\n"))


def legend_below(fig: Any, ax: Any, ncol: int, fontsize: float = 8) -> None:
    """One legend under the plot, outside every axes (figure needs ``layout="constrained"``)."""
    handles, labels = ax.get_legend_handles_labels()
    try:  # matplotlib >= 3.7: constrained layout makes room for it
        fig.legend(handles, labels, loc="outside lower center", ncol=ncol, fontsize=fontsize, frameon=False)
    except ValueError:
        ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=ncol, fontsize=fontsize,
                  frameon=False)


def save(plt: Any, fig: Any, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")
    return path
