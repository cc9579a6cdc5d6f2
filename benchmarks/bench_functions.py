"""Benchmark of mask and score functions written in Python against the built-in masks.

Run ``python benchmarks/bench_functions.py`` (``--repeat N``, ``--skip-compile``).

* Prefill, B=1 H=32 Hkv=8 S=N=8192 D=128 float32: a ``FunctionMask`` sliding window of 512
  (causal) against ``SlidingWindowCausalMask(512)``; document masking with 8 documents of
  1024 tokens (``CausalMask() & FunctionMask(same_document, doc_ids)``) against
  ``ChunkedCausalMask(1024)``, which shows the same pairs.  Target: at most 1.3x each.
* ``softcap(50)`` against no score modifier: causal prefill B=1 H=32 Hkv=8 S=2048 D=128
  (target: at most 15% more) and decode, paged, B=8 H=32 Hkv=8 N=4096 D=128 (at most 5%).
* Compile: a child process with an empty kernel cache times the first flash call with a new
  function (target < 15 s on 2 cores) and counts compilations on a second call with new
  capture values (target: none).

Every pair runs round by round in one process (:func:`numattn.tools.bench.interleaved_medians`);
printed are medians and ratios.  The machine may be shared: read ratios, not single runs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # numattn

from numattn.tools.bench import gemm_gflops, interleaved_medians

H, HKV, D = 32, 8, 128


def sliding_window(b, h, q_idx, kv_idx, window):
    return kv_idx <= q_idx and q_idx - kv_idx < window


def same_document(b, h, q_idx, kv_idx, doc_ids):
    return doc_ids[q_idx] == doc_ids[kv_idx]


def _pairs(label, call, variants, repeat, target):
    """Time ``call(variant)`` for the two variants round by round (each called once first:
    compiled or loaded) and print the ratio of the first to the second."""
    fns = []
    for variant in variants:
        call(variant)
        fns.append(lambda variant=variant: call(variant))
    (new, old) = interleaved_medians(fns, repeat=repeat)
    ratio = new / old
    verdict = "meets" if ratio <= target else "misses"
    print(f"  {label:<44} {new * 1e3:9.1f} ms vs {old * 1e3:9.1f} ms   {ratio:5.2f}x "
          f"({verdict} <= {target}x)")


def bench_masks(repeat):
    import numattn

    rng = np.random.default_rng(0)
    n = 8192
    q = rng.standard_normal((1, n, H, D), dtype=np.float32)
    k = rng.standard_normal((1, n, HKV, D), dtype=np.float32)
    v = rng.standard_normal((1, n, HKV, D), dtype=np.float32)
    out = np.empty_like(q)
    doc_ids = np.repeat(np.arange(8), n // 8)
    cases = [
        ("FunctionMask window 512 / built-in",
         numattn.FunctionMask(sliding_window, 512), numattn.SlidingWindowCausalMask(512)),
        ("8 documents (function) / ChunkedCausalMask",
         numattn.CausalMask() & numattn.FunctionMask(same_document, doc_ids),
         numattn.ChunkedCausalMask(n // 8)),
    ]
    print(f"Prefill B=1 H={H} Hkv={HKV} S=N={n} D={D} float32")
    for label, function, built_in in cases:
        _pairs(label, lambda mask: numattn.flash_attention_kv_cache(q, k, v, mask, out=out),
               (function, built_in), repeat, 1.3)


def bench_softcap(repeat):
    import numattn

    rng = np.random.default_rng(1)
    s = 2048
    q = rng.standard_normal((1, s, H, D), dtype=np.float32)
    k = rng.standard_normal((1, s, HKV, D), dtype=np.float32)
    v = rng.standard_normal((1, s, HKV, D), dtype=np.float32)
    out = np.empty_like(q)
    cap = numattn.softcap(50.0)
    print(f"softcap(50): causal prefill B=1 S={s}, decode paged B=8 N=4096")
    _pairs("prefill, softcap / none",
           lambda mod: numattn.flash_attention_kv_cache(q, k, v, numattn.CausalMask(),
                                                        score_mod=mod, out=out),
           (cap, None), repeat, 1.15)
    batch, n, page = 8, 4096, 128
    pages = batch * n // page
    table = rng.permutation(pages).reshape(batch, n // page)
    lengths = np.full(batch, n - 1)
    kc = numattn.PagedKVCache(rng.standard_normal((pages, page, HKV, D), dtype=np.float32),
                              lengths, table)
    vc = numattn.PagedKVCache(rng.standard_normal((pages, page, HKV, D), dtype=np.float32),
                              lengths, table)
    qd = rng.standard_normal((batch, H, D), dtype=np.float32)
    outd = np.empty_like(qd)
    _pairs("decode, softcap / none",
           lambda mod: numattn.decode_attention(qd, kc, vc, score_mod=mod, out=outd),
           (cap, None), repeat, 1.05)


COMPILE_CHILD = textwrap.dedent("""
    import time, numpy as np
    import numattn
    from numba.core import event

    def band(b, h, q_idx, kv_idx, lo, hi):
        return kv_idx <= q_idx and lo <= q_idx - kv_idx < hi

    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 256, 8, 64), dtype=np.float32)
    kv = rng.standard_normal((1, 256, 2, 64), dtype=np.float32)
    numattn.flash_attention_kv_cache(q, kv, kv, numattn.CausalMask())  # the plain kernels
    start = time.perf_counter()
    numattn.flash_attention_kv_cache(q, kv, kv, numattn.FunctionMask(band, 0, 64))
    first = time.perf_counter() - start
    with event.install_recorder("numba:compile") as recorder:
        start = time.perf_counter()
        numattn.flash_attention_kv_cache(q, kv, kv, numattn.FunctionMask(band, 3, 100))
        second = time.perf_counter() - start
    print(f"{first:.1f} {second * 1e3:.1f} {len(recorder.buffer)}")
""")


def bench_compile():
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        env["PYTHONPATH"] = os.pathsep.join(
            [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
             env.get("PYTHONPATH", "")])
        done = subprocess.run([sys.executable, "-c", COMPILE_CHILD], env=env, check=True,
                              capture_output=True, text=True)
    first, second, compiles = done.stdout.split()
    print("Compile (a fresh process and kernel cache, the plain kernels compiled first)")
    print(f"  first flash call with a new FunctionMask     {float(first):9.1f} s    "
          f"({'meets' if float(first) < 15 else 'misses'} < 15 s)")
    print(f"  next call, new capture values                {float(second):9.1f} ms   "
          f"{compiles} compilations ({'meets' if compiles == '0' else 'misses'} 0)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="rounds per pair (median)")
    parser.add_argument("--skip-compile", action="store_true",
                        help="leave out the cold-compile child process")
    args = parser.parse_args(argv)
    print(f"GEMM probe: {gemm_gflops():.0f} GFLOP/s float32")
    bench_masks(args.repeat)
    bench_softcap(args.repeat)
    if not args.skip_compile:
        bench_compile()


if __name__ == "__main__":
    main()
