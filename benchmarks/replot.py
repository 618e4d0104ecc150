"""Redraw every benchmark PNG from the JSON already in a results folder (no GPU, no re-measuring).

Writes one PNG per known JSON, next to it (or into ``--out``), drawn by the ``plot(payload, path)`` of the
benchmark module its name starts with:

    attention*.json     -> attention*.png     (attention.plot)
    end_to_end*.json    -> end_to_end*.png    (end_to_end.plot: every configuration, e.g. end_to_end_compiled_h200)
    multi_gpu*.json     -> multi_gpu*.png     (multi_gpu.plot)
    sessions*.json      -> sessions*.png      (sessions.plot)
    serving*.json       -> serving*.png       (serving.plot)
    warm_start*.json    -> warm_start*.png    (warm_start.plot)

Results written before the timing helper recorded spreads are drawn without error bars (``end_to_end``
results, which kept every timed step, get their IQR from those steps). Needs matplotlib; runs on the CPU.

    python -m benchmarks.replot                                  # benchmarks/results in place
    python -m benchmarks.replot --results DIR --out /tmp/plots
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks._timing import RESULTS, fail, parser

#: JSON stem prefix -> the benchmark module whose ``plot(payload, path)`` draws it.
PLOTTERS = (("attention", "benchmarks.attention"), ("sessions", "benchmarks.sessions"),
            ("end_to_end", "benchmarks.end_to_end"), ("multi_gpu", "benchmarks.multi_gpu"),
            ("serving", "benchmarks.serving"), ("warm_start", "benchmarks.warm_start"))


def replot(results: Path, out: Path | None = None) -> list[Path]:
    """Redraw the PNG of every known JSON in ``results`` into ``out`` (default: next to the JSON)."""
    written: list[Path] = []
    for path in sorted(results.glob("*.json")):
        module_name = next((mod for prefix, mod in PLOTTERS if path.stem.startswith(prefix)), None)
        if module_name is None:
            continue
        module = importlib.import_module(module_name)
        png = module.plot(json.loads(path.read_text()), (out or results) / f"{path.stem}.png")
        if png is not None:
            written.append(Path(png))
    return written


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--results", type=Path, default=RESULTS, help="folder holding the JSON (default benchmarks/results)")
    p.add_argument("--out", type=Path, default=None, help="folder for the PNGs (default: the results folder)")
    args = p.parse_args(argv)
    if not args.results.is_dir():
        fail(p.prog, f"--results {args.results}: not a folder")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        fail(p.prog, "needs matplotlib (pip install matplotlib)")
    written = replot(args.results, args.out)
    if not written:
        fail(p.prog, f"no benchmark JSON in {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
