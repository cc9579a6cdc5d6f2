"""Median wall time of ``import numattn`` in fresh interpreters (target: under 0.3 s).

Also confirms that the import compiles nothing and imports neither numba nor numba.cuda.

    python benchmarks/import_time.py [--runs 15]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

CODE = (
    "import time, sys; t = time.perf_counter(); import numattn; "
    "dt = time.perf_counter() - t; "
    "print(dt, 'numba' in sys.modules, 'numba.cuda' in sys.modules)"
)
BASE = "import time; t = time.perf_counter(); import numpy; print(time.perf_counter() - t)"


def _runs(code, n):
    out = []
    for _ in range(n):
        line = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              check=True).stdout.split()
        out.append(line)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    runs = _runs(CODE, args.runs)
    numpy_alone = statistics.median(float(r[0]) for r in _runs(BASE, args.runs))
    median = statistics.median(float(r[0]) for r in runs)
    numba_loaded = any(r[1] == "True" for r in runs)
    cuda_loaded = any(r[2] == "True" for r in runs)
    print(f"import numattn: median {median * 1e3:.1f} ms over {args.runs} fresh interpreters "
          f"(numpy alone: {numpy_alone * 1e3:.1f} ms); numba imported: {numba_loaded}; "
          f"numba.cuda imported: {cuda_loaded}")
    return 0 if median < 0.3 and not numba_loaded and not cuda_loaded else 1


if __name__ == "__main__":
    sys.exit(main())
