"""The torch-free core: page bookkeeping on plain ints, property-tested without a device.

- :mod:`~ardiff_modules.core.allocator`: page ids, the free queue, refcounts, the peak (the only
  code that changes them);
- :mod:`~ardiff_modules.core.retention`: retention policies (sink + window, memory frames);
- :mod:`~ardiff_modules.core.branch`: one branch's pages (history, pending chunks, extent);
- :mod:`~ardiff_modules.core.reservation`: a forward's page reservation and its exact undo;
- :mod:`~ardiff_modules.core.transaction`: one forward's commit / abort over all its streams;
- :mod:`~ardiff_modules.core.admission`: admission arithmetic (pages per session, the re-cache reserve).

Nothing here imports torch (an import-linter contract checks it in CI).
"""
