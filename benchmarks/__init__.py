"""The benchmarks of ``ardiff_modules``, a package: run each from the repository root as a module.

    python -m benchmarks.attention --help
    python -m benchmarks.end_to_end --preset tiny --device cpu --dtype float32 --out /tmp/e2e

Modules (``benchmarks/README.md`` has what each measures and the recorded results):

* ``attention``, ``end_to_end``, ``sessions``, ``multi_gpu``, ``ulysses_rank``, ``host_time``,
  ``first_use``, ``warm_start``, ``compile_vs_eager``, ``nccl_graph_probe``: the scripts;
* ``replot``: redraws the PNGs in ``results/`` from their JSON;
* ``baselines``: the peers this library is timed against (the Self-Forcing / LongLive rolling buffer,
  attention over contiguous K/V), in one place;
* ``_timing`` (the one timing helper, run metadata, JSON output, result paths), ``_plotting`` (error
  bars, labels, legends) and ``_models`` (the small test-style model of ``compile_vs_eager`` and
  ``nccl_graph_probe``): shared helpers.

Importing this package imports nothing else (no torch), so every script's ``--help`` stays fast.
"""
