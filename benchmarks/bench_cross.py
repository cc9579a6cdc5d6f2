"""Benchmark of ``cross_attention`` on the CPU against ``flash_attention_kv_cache`` and torch.

Run ``python benchmarks/bench_cross.py`` (``--repeat N`` for more repeats).  The case:
8 sequences of 128 queries, each attending over 1500 keys (H = 16, Hkv = 4, D = 64, float32),
no mask.  The keys live in a paged cache (pages of 128, shuffled): 1372 cached tokens plus the
128 new rows of this step.  It prints the median time and GFLOP/s (``4 B H S N D`` flops) of

* ``cross_attention`` over the paged cache, and over ragged K/V rows ``[T_kv, Hkv, D]``;
* ``flash_attention_kv_cache`` on the same work (same q, same cache, ragged rows);
* PyTorch's CPU ``scaled_dot_product_attention`` on the padded batch ``[B, H, S, D]`` with
  dense K/V ``[B, Hkv, N, D]``, ``enable_gqa=True`` and a boolean ``[B, 1, S, N]`` mask
  (what a padded ragged batch needs);

with the fraction of the machine's BLAS GEMM rate (``1024^3``, all cores) measured in the same
run (median and best time).  Targets: cross within 15% of flash's GFLOP/s, and faster than
torch.

The machine may be shared: the contenders run interleaved call by call, every figure is a
median of several repeats, the ratios are medians of per-round ratios, and the spread
(min..max) is printed as the noise to read the figures against.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # numattn

import numattn
from numattn.cross import cross_attention
from numattn.flash import flash_attention_kv_cache
from numattn.tools.bench import interleaved_times, torch_or_none
from numattn.tools.cli import at_least

BATCH, Q_LEN, NUM_KEYS, HEADS, KV_HEADS, HEAD_DIM = 8, 128, 1500, 16, 4, 64
PAGE_SIZE = 128


def problem(rng, dtype):
    """q, paged caches, ragged K/V rows and dense K/V (for torch) of the same keys."""
    cache_len = NUM_KEYS - Q_LEN
    pages_per_seq = -(-NUM_KEYS // PAGE_SIZE)
    num_pages = BATCH * pages_per_seq
    shape = (num_pages, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    k_pages = rng.standard_normal(shape, dtype=np.float32).astype(dtype)
    v_pages = rng.standard_normal(shape, dtype=np.float32).astype(dtype)
    table = rng.permutation(num_pages).reshape(BATCH, pages_per_seq)
    lengths = np.full(BATCH, cache_len)
    k = numattn.PagedKVCache(k_pages, lengths, table)
    v = numattn.PagedKVCache(v_pages, lengths, table)
    q = rng.standard_normal((BATCH * Q_LEN, HEADS, HEAD_DIM), dtype=np.float32).astype(dtype)

    def rows(pages):  # [B, N, Hkv, D]
        flat = pages[table].reshape(BATCH, pages_per_seq * PAGE_SIZE, KV_HEADS, HEAD_DIM)
        return np.ascontiguousarray(flat[:, :NUM_KEYS])

    return q, k, v, rows(k_pages), rows(v_pages)


def gemm_rate(dtype, n=1024, repeat=7):
    """BLAS GEMM GFLOP/s (all cores): the best of ``repeat`` products of ``n x n`` matrices.

    Measured apart from the attention rounds: BLAS threads spin for a while after a call and
    would slow down whichever contender ran next.
    """
    a = np.random.default_rng(1).standard_normal((n, n)).astype(dtype)
    c = np.empty_like(a)
    best = math.inf
    for _ in range(repeat + 1):
        t0 = time.perf_counter()
        np.dot(a, a, out=c)
        best = min(best, time.perf_counter() - t0)
    time.sleep(0.2)  # let the BLAS threads go idle
    return 2.0 * n**3 / best / 1e9


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=at_least(1), default=15)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    args = parser.parse_args(argv)
    dtype = np.dtype(args.dtype)
    rng = np.random.default_rng(0)
    q, k, v, k_rows, v_rows = problem(rng, dtype)
    q_offsets = np.arange(BATCH + 1) * Q_LEN
    new_offsets = np.arange(BATCH + 1) * Q_LEN  # the new rows of this step
    all_offsets = np.arange(BATCH + 1) * NUM_KEYS
    k_ragged = k_rows.reshape(-1, KV_HEADS, HEAD_DIM)
    v_ragged = v_rows.reshape(-1, KV_HEADS, HEAD_DIM)
    out = np.empty(q.shape, dtype)
    flops = 4.0 * BATCH * HEADS * Q_LEN * NUM_KEYS * HEAD_DIM
    torch = torch_or_none()
    print(f"B={BATCH} S={Q_LEN} N={NUM_KEYS} H={HEADS} Hkv={KV_HEADS} D={HEAD_DIM} {dtype}; "
          f"torch {'yes' if torch else 'no'}")

    runs = {
        "cross, paged cache": lambda: cross_attention(
            q, q_offsets, Q_LEN, k, v, new_offsets, out=out),
        "cross, ragged K/V": lambda: cross_attention(
            q, q_offsets, Q_LEN, k_ragged, v_ragged, all_offsets, out=out),
        "flash, paged cache": lambda: flash_attention_kv_cache(
            q, k, v, numattn.NullMask(), q_input_row_offsets=q_offsets,
            kv_input_row_offsets=new_offsets, out=out),
    }
    if torch is not None:
        sdpa = torch.nn.functional.scaled_dot_product_attention
        tq = torch.from_numpy(np.ascontiguousarray(
            q.reshape(BATCH, Q_LEN, HEADS, HEAD_DIM).transpose(0, 2, 1, 3)))
        tk = torch.from_numpy(np.ascontiguousarray(k_rows.transpose(0, 2, 1, 3)))
        tv = torch.from_numpy(np.ascontiguousarray(v_rows.transpose(0, 2, 1, 3)))
        valid = torch.ones((BATCH, 1, Q_LEN, NUM_KEYS), dtype=torch.bool)

        def torch_run():
            with torch.inference_mode():
                sdpa(tq, tk, tv, attn_mask=valid, enable_gqa=True)

        runs["torch SDPA, padded + bool mask"] = torch_run

    # Interleave the contenders call by call (rotating their order), so that load from other
    # processes on the shared machine hits them alike; ratios are medians of per-round ratios.
    names = list(runs)
    gemm_before = gemm_rate(dtype)
    times = dict(zip(names, interleaved_times(list(runs.values()), repeat=args.repeat,
                                              rotate=True)))

    def ratio(slow, fast):  # median over rounds of time(slow) / time(fast)
        return statistics.median(x / y for x, y in zip(times[slow], times[fast]))

    gemm = max(gemm_before, gemm_rate(dtype))
    print(f"BLAS GEMM (all cores), best of before/after the rounds: {gemm:.1f} GFLOP/s")
    print(f"{'':<32}{'ms':>9}{'(min..max)':>18}{'GFLOP/s':>9}{'of GEMM':>9}{'best':>9}")
    for name in names:
        med, lo, hi = statistics.median(times[name]), min(times[name]), max(times[name])
        print(f"{name:<32}{med * 1e3:>9.2f}{f'({lo * 1e3:.1f}..{hi * 1e3:.1f})':>18}"
              f"{flops / med / 1e9:>9.1f}{flops / med / 1e9 / gemm:>9.0%}"
              f"{flops / lo / 1e9 / gemm:>9.0%}")

    def best_ratio(slow, fast):  # noise on a shared machine only adds time: compare minima
        return min(times[slow]) / min(times[fast])

    cross = "cross, paged cache"
    pairs = [("cross / flash GFLOP/s", "flash, paged cache", "(target >= 0.85)")]
    if torch is not None:
        pairs.append(("cross speedup over torch", "torch SDPA, padded + bool mask",
                      "(target > 1)"))
    for label, other, target in pairs:
        print(f"{label}: {ratio(other, cross):.3f} (median of rounds), "
              f"{best_ratio(other, cross):.3f} (best of each) {target}")

if __name__ == "__main__":
    main()
