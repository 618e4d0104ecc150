"""The picture of a streaming run: KV memory, visibility, time per chunk and the latent frames.

Used by ``streaming_generation.py``; draws only what the run recorded (its ``report`` dict, also written
as JSON), with matplotlib's object API (``Figure`` + ``FigureCanvasAgg``, no pyplot state)::

    (a) KV memory per chunk      |  (b) visibility: which key chunks
    (c) wall time per chunk      |      each query chunk attended to
    (d) latent frames (the PNG strip), full width

Panel (a) compares the paged pool (pages in use while a chunk is denoised, per branch, from
``state.branch_pages(branch)``; total pool use from ``cache.stats()``) with a contiguous rolling buffer of
the same visible context (per layer and branch ``sink + window + 1`` chunks, the current one included,
allocated up front), in tokens per layer (left axis) and MiB over all layers, K and V (right axis).
Panel (b) has one row per chunk: the keys its forward gathered and saw (``ForwardContext.to_dense()``
and ``key_positions()``), mapped to chunks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

# Visibility categories of panel (b), in colour-map order.
NOT_YET, EVICTED, SINK, WINDOW, PENDING = range(5)
VIS_COLOURS = ("#ffffff", "#d9d9d9", "#6a3d9a", "#33a02c", "#e31a1c")
VIS_LABELS = ("not generated yet", "evicted: not seen", "sink: seen", "window: seen", "pending: the query chunk itself")
COND, UNCOND, POOL, ROLLING, EVENT = "#1f78b4", "#ff7f00", "#222222", "#8c8c8c", "#6a3d9a"


def visibility_categories(report: dict[str, Any]) -> np.ndarray:
    """``[chunks, chunks]`` int: the category (``NOT_YET`` .. ``PENDING``) of key chunk ``j`` for query chunk ``k``.

    Seen / not seen comes from the recorded forwards; a seen history chunk is called a sink when it is one of
    the first ``sink_chunks`` chunks since the stream (re)started, else window.
    """
    rows = report["per_chunk"]
    n = len(rows)
    sink = report["geometry"]["sink_chunks"]
    out = np.full((n, n), NOT_YET, dtype=np.int64)
    for k, row in enumerate(rows):
        start = row["stream_start_chunk"]
        out[k, : k + 1] = EVICTED
        for j in row["visible_key_chunks"]["cond"]:
            out[k, j] = PENDING if j == k else SINK if j < start + sink else WINDOW
    return out


def first_gap_chunk(report: dict[str, Any]) -> int | None:
    """The first chunk whose forward saw a gap (an evicted chunk between the seen ones), or ``None``."""
    for k, row in enumerate(report["per_chunk"]):
        seen = row["visible_key_chunks"]["cond"]
        if seen and seen[-1] - seen[0] + 1 != len(seen):
            return k
    return None


def draw_report(report: dict[str, Any], strip: np.ndarray, path: str | Path, *, dpi: int = 110) -> Path:
    """Draw the run's picture to ``path`` (PNG); ``strip`` is the latent strip image ``[H, W, 3]`` in 0..1."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    from matplotlib.ticker import LogLocator, NullFormatter

    geo, rows = report["geometry"], report["per_chunk"]
    n = len(rows)
    chunks = np.arange(n)
    branches = geo["branches"]
    colours = dict(zip(branches, (COND, UNCOND, "#33a02c", "#e31a1c")))
    gap = first_gap_chunk(report)
    events = report.get("events_at", [])

    fig = Figure(figsize=(12.5, 9.2), layout="constrained")
    FigureCanvasAgg(fig)
    fig.get_layout_engine().set(h_pad=0.06, w_pad=0.06, hspace=0.04, wspace=0.04)
    gs = fig.add_gridspec(3, 2, height_ratios=(1.15, 0.9, 0.5), width_ratios=(1.12, 1.0))
    ax_mem = fig.add_subplot(gs[0, 0])
    ax_time = fig.add_subplot(gs[1, 0], sharex=ax_mem)
    ax_vis = fig.add_subplot(gs[0:2, 1])
    ax_strip = fig.add_subplot(gs[2, :])
    fig.suptitle(
        f"Streaming generation over the paged sink + window KV cache ({report['preset']} preset, {report['device']}): "
        f"sink {geo['sink_chunks']} + window {geo['window_chunks']} chunks,\n"
        f"{len(branches)} CFG branches ({', '.join(branches)}) in one forward, "
        f"{geo['frames_per_chunk']} latent frames per chunk, {report['chunks']} chunks",
        fontsize=12,
    )

    # ---- (a) KV memory per chunk
    page_tokens = geo["page_size"]
    mib_per_token = geo["bytes_per_page"] / geo["page_size"] / 2**20
    bottom = np.zeros(n)
    for branch in branches:
        resident = np.array([r["pages"][branch]["resident"] for r in rows]) * page_tokens
        pending = np.array([r["pages"][branch]["pending"] for r in rows]) * page_tokens
        ax_mem.bar(chunks, resident, 0.62, bottom=bottom, color=colours[branch], edgecolor="white",
                   label=f"{branch}: committed history (sink + window)")
        bottom += resident
        ax_mem.bar(chunks, pending, 0.62, bottom=bottom, color=colours[branch], alpha=0.4,
                   edgecolor="white", label=f"{branch}: pending chunk (being denoised)")
        bottom += pending
    pool = np.array([r["pool_pages_used"] for r in rows]) * page_tokens
    reserved = any(r["pages"][b]["extent_reserved"] for r in rows for b in branches)
    ax_mem.plot(chunks, pool, color=POOL, marker="o", ms=5, lw=1.6,
                label="paged pool: pages in use, all branches"
                + ("\n(contiguous extents reserved)" if reserved else ""))
    rolling = geo["rolling_buffer_tokens_per_branch"]
    ax_mem.axhline(rolling * len(branches), color=ROLLING, ls="--", lw=2, zorder=0,
                   label=f"contiguous rolling buffer, {len(branches)} branches (upfront)")
    ax_mem.axhline(rolling, color=ROLLING, ls=":", lw=2, zorder=0, label="contiguous rolling buffer, 1 branch")
    ax_mem.set_ylim(0, 1.3 * max(rolling * len(branches), float(pool.max()), float(bottom.max())))
    ax_mem.set_ylabel(f"KV tokens held per layer\n(1 page = {page_tokens} tokens)")
    secondary = ax_mem.secondary_yaxis(
        "right", functions=(lambda t: t * mib_per_token, lambda m: m / mib_per_token)
    )
    secondary.set_ylabel("MiB (all layers, K + V)")
    ax_mem.set_title(
        "(a) KV memory while each chunk is denoised: paged pool vs. a rolling buffer\n"
        f"rolling buffer = (sink + window + current) = {rolling // geo['chunk_size']} chunks per branch, "
        "allocated upfront",
        fontsize=10.5,
    )
    handles, labels = ax_mem.get_legend_handles_labels()
    lines = [i for i, label in enumerate(labels) if not label.startswith(tuple(branches))]
    order = [i for i in range(len(labels)) if i not in lines] + lines  # bars in the first column, lines next
    ax_mem.legend([handles[i] for i in order], [labels[i] for i in order], loc="upper left",
                  bbox_to_anchor=(0.0, -0.02), ncol=2, fontsize=8.5, frameon=False)
    ax_mem.tick_params(labelbottom=False)
    if gap is not None:
        row = rows[gap]
        evicted = min(set(range(row["stream_start_chunk"], gap)) - set(row["visible_key_chunks"]["cond"]))
        ax_mem.axvline(gap - 0.5, color="k", lw=0.8, ls="-.")
        right = gap < n / 2  # the text goes where there is room
        ax_mem.annotate(f"chunk {gap - 1}'s commit evicted chunk {evicted}: from here on\n"
                        "each commit frees one chunk's pages, use stays flat",
                        (gap - 0.5, ax_mem.get_ylim()[1]), xytext=(4 if right else -4, -4), textcoords="offset points",
                        fontsize=8, va="top", ha="left" if right else "right",
                        bbox={"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.85})

    # ---- (c) wall time per chunk
    ms = np.array([r["chunk_ms"] for r in rows])
    warm = set(report["warmup_chunks"])
    # Window full: the chunk's forwards see as many history chunks as the rule ever allows (pages flat).
    resident = [r["pages"][branches[0]]["resident"] for r in rows]
    full = {k for k in range(n) if k not in warm and resident[k] == max(resident)}
    filling = set(range(n)) - warm - full
    steady = np.array([ms[k] for k in sorted(full or (set(range(n)) - warm))])
    bar_colours = ["#e6550d" if k in warm else "#bdbdbd" if k in filling else "#636363" for k in range(n)]
    ax_time.bar(chunks, ms, 0.62, color=bar_colours)
    ax_time.set_yscale("log")
    ax_time.yaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))  # few minor ticks: a log axis's default is costly
    ax_time.yaxis.set_minor_formatter(NullFormatter())
    ax_time.set_ylim(min(ms.min(), steady.min() if steady.size else ms.min()) / 2, ms.max() * 8)  # legend room
    for k in sorted(warm):
        ax_time.annotate(f"{ms[k]:.0f} ms", (k + 0.31, ms[k]), xytext=(3, 0), textcoords="offset points",
                         fontsize=8.5, va="center", ha="left", color="#e6550d")
    handles = [Patch(color="#e6550d", label="warm-up (first forward: lazy init / compile)")]
    if filling:
        handles.append(Patch(color="#bdbdbd", label="window filling (more keys each chunk)"))
    handles.append(Patch(color="#636363", label="window full: steady state"))
    if steady.size:
        median = float(np.median(steady))
        label = f"median, {'window full' if full else 'after warm-up'}: {median:.1f} ms"
        handles.append(ax_time.axhline(median, color="k", ls="--", lw=1, label=label))
    for k, _ in events:
        for ax in (ax_mem, ax_time):
            ax.axvline(k - 0.5, color=EVENT, lw=1.2)
    if events:  # named on a top axis, clear of the data and the legend
        top = ax_time.secondary_xaxis("top")
        top.set_xticks([k - 0.5 for k, _ in events], [f"{label} ->" for _, label in events])
        top.tick_params(labelsize=8, colors=EVENT, length=3)
    ax_time.legend(handles=handles, loc="upper right", fontsize=8.5, frameon=False)
    ax_time.set_ylabel("wall ms per chunk (log)")
    ax_time.set_xlabel(f"chunk (each: {report['steps']} denoising + 1 committing forward, both branches batched)")
    ax_time.set_title("(c) Time per chunk", fontsize=10.5)
    ax_time.set_xticks(chunks)
    ax_time.set_xlim(-0.6, max(n, 6) - 0.4)  # short runs: narrow bars, room for the labels

    # ---- (b) visibility
    from matplotlib.colors import BoundaryNorm, ListedColormap

    cats = visibility_categories(report)
    ax_vis.imshow(cats, cmap=ListedColormap(VIS_COLOURS), norm=BoundaryNorm(np.arange(-0.5, 5.5), 5),
                  aspect="equal", interpolation="nearest")
    ax_vis.set_xticks(chunks)
    ax_vis.set_yticks(chunks)
    edges = np.arange(-0.5, n)
    ax_vis.hlines(edges, -0.5, n - 0.5, color="#bbbbbb", lw=0.6)  # cell borders (cheaper than minor ticks)
    ax_vis.vlines(edges, -0.5, n - 0.5, color="#bbbbbb", lw=0.6)
    ax_vis.set_xlabel(f"key chunk (absolute index; {geo['frames_per_chunk']} latent frames each)")
    ax_vis.set_ylabel("query chunk (one forward per row)")
    focus = n - 1
    ax_vis.add_patch(_rect(focus, n))
    seen = rows[focus]["visible_key_chunks"]["cond"]
    gone = [j for j in range(rows[focus]["stream_start_chunk"], focus) if j not in seen]
    dense = all(r["visibility_source"] == "to_dense" for r in rows)
    ax_vis.set_title(
        "(b) Visibility: which key chunks each query chunk saw\n"
        + ("(a row = a forward of the run: its to_dense(), key_positions())" if dense
           else "(a row = a forward of the run: its branch's history spans)"),
        fontsize=10.5,
    )
    note = f"outlined row: chunk {focus}'s forward\nsees chunks {_spans(seen)}"
    if gone:
        note += f"\n(chunks {_spans(gone)} evicted)"
    if n >= 6:  # in the empty upper-right triangle (chunks not generated yet)
        ax_vis.text(n - 0.7, -0.3, note, fontsize=8.5, ha="right", va="top",
                    bbox={"boxstyle": "round,pad=0.3", "fc": "white", "ec": "#888888"})
    else:
        ax_vis.set_title(ax_vis.get_title() + "\n" + note.replace("\n", " "), fontsize=10.5)
    labels = list(VIS_LABELS)
    if any(label == "reset" for _, label in events):
        labels[EVICTED] = "evicted or reset: not seen"
    ax_vis.legend(
        handles=[Patch(facecolor=c, edgecolor="#888888", label=label) for c, label in zip(VIS_COLOURS, labels)],
        loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, fontsize=8.5, frameon=False,
    )

    # ---- (d) latent strip
    ax_strip.imshow(strip, interpolation="nearest")
    spans = report.get("strip_chunk_spans") or []
    if spans and all(row == 0 for row, _, _ in spans):
        ax_strip.set_xticks([(x0 + x1) / 2 for _, x0, x1 in spans], [str(k) for k in range(len(spans))])
        ax_strip.set_xlabel("chunk")
    else:
        ax_strip.set_xticks([])
    ax_strip.set_yticks([])
    ax_strip.set_title(
        f"(d) Latent frames (channels 0-2 as RGB, {report['frames']} frames, white bar between chunks; "
        f"random weights, so noise: the PNG strip {Path(report['png']).name})",
        fontsize=10.5,
    )

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return path


def _rect(row: int, n: int) -> Any:
    from matplotlib.patches import Rectangle

    return Rectangle((-0.5, row - 0.5), n, 1, fill=False, edgecolor="k", lw=2.2)


def _spans(chunks: list[int]) -> str:
    """``[0, 5, 6, 7]`` -> ``"0, 5-7"``."""
    parts: list[tuple[int, int]] = []
    for c in chunks:
        if parts and parts[-1][1] == c - 1:
            parts[-1] = (parts[-1][0], c)
        else:
            parts.append((c, c))
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in parts)
