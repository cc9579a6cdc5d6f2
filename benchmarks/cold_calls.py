"""First calls of each operation in a new environment (cold) and in a new process (warm).

Run ``python benchmarks/cold_calls.py`` (``--rounds N``).

For each operation a child process with an empty ``NUMBA_CACHE_DIR`` times its first call
(what a user waits for once per environment: the kernels compile and are written to the
disk cache), then a second child with that cache times the first call again (every later
process: the kernels load).  Small float32 problems, so the times are compile and load
times, not work.  Printed: the median over ``--rounds`` of each, in seconds.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SETUP = textwrap.dedent("""
    import time
    import numpy as np
    import numattn
    rng = np.random.default_rng(0)
    lens = [5, 57, 5, 15]
    offsets = np.cumsum([0] + lens)
    H, HKV, D = 8, 2, 64
    pages = rng.standard_normal((2, 24, 16, HKV, D)).astype(np.float32)
    table = np.arange(24).reshape(4, 6)
    k = numattn.PagedKVCache(pages[0], np.array(lens) - 1, table)
    v = numattn.PagedKVCache(pages[1], np.array(lens) - 1, table)
    q_rows = rng.standard_normal((sum(lens), H, D)).astype(np.float32)
    q_one = rng.standard_normal((4, H, D)).astype(np.float32)
    kv_rows = rng.standard_normal((sum(lens), HKV, D)).astype(np.float32)
""")

#: (name, the first call)
OPERATIONS = [
    ("flash_attention_kv_cache (ragged, paged, causal)",
     "numattn.flash_attention_kv_cache(q_rows, k.with_cache_lengths(np.zeros(4, np.int64)), "
     "v.with_cache_lengths(np.zeros(4, np.int64)), numattn.CausalMask(), "
     "q_input_row_offsets=offsets)"),
    ("decode_attention (paged, causal)",
     "numattn.decode_attention(q_one, k, v, numattn.CausalMask())"),
    ("cross_attention (ragged)",
     "numattn.cross_attention(q_rows, offsets, max(lens), kv_rows, kv_rows, offsets)"),
    ("store_kv (paged)",
     "numattn.store_kv(k.with_cache_lengths(np.zeros(4, np.int64)), kv_rows, offsets)"),
]


def first_call_seconds(call, cache_dir):
    """Seconds of ``call``'s first run in a child process using ``cache_dir``."""
    code = SETUP + f"t = time.perf_counter()\n{call}\nprint(time.perf_counter() - t)\n"
    env = {**os.environ, "NUMBA_CACHE_DIR": cache_dir, "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, check=True)
    return float(done.stdout.split()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="cold caches per operation "
                        "(default 3)")
    args = parser.parse_args(argv)
    print(f"{'operation':<50} {'cold (s)':>9} {'warm (s)':>9}")
    for name, call in OPERATIONS:
        cold, warm = [], []
        for _ in range(args.rounds):
            with tempfile.TemporaryDirectory() as cache_dir:
                cold.append(first_call_seconds(call, cache_dir))
                warm.append(first_call_seconds(call, cache_dir))
        print(f"{name:<50} {np.median(cold):9.2f} {np.median(warm):9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
