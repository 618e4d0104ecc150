"""The torch.compile'd streaming generation script: ``streaming_generation.py --compile``.

::

    python examples/compiled_generation.py                    # tiny preset on CPU (compiling takes ~20 s)
    python examples/compiled_generation.py --preset wan2.1-1.3b --device cuda --chunks 8

Compiles the model step once with ``torch.compile(fullgraph=True)`` (inductor), runs the whole
Self-Forcing-style rollout (denoising and committing forwards, window eviction, plus any
``--switch-at`` / ``--reset-at``), prints the compile time, the steady-state step time and the number
of compiled frames counted by ``torch._dynamo.testing.CompileCounterWithBackend``, and exits with
status 1 if the step recompiled (the library's contract is one frame for the whole rollout).
Every other flag is ``streaming_generation.py``'s (see its docstring / ``--help``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import streaming_generation  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return streaming_generation.main(["--compile", *argv] if "--compile" not in argv else argv)


if __name__ == "__main__":
    sys.exit(main())
