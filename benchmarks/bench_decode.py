"""Benchmark of ``decode_attention`` on the CPU against the machine's read bandwidth and torch.

Run ``python benchmarks/bench_decode.py`` (``--repeat N`` for more repeats; ``--case
B,H,HKV,N,D``, repeatable, runs those shapes instead, e.g. ``--case 4,28,4,8192,128`` for a
model with 28 query and 4 KV heads).  For each case it prints the median time of numattn
(paged cache, pages of 128) and of PyTorch's CPU ``scaled_dot_product_attention`` (q of
length 1, ``enable_gqa=True``, dense K/V), the KV bytes per second (the K and V rows of the
live cache, each read once), the fraction of the read bandwidth measured in the same rounds
(numattn, the bandwidth probe and torch take turns, so that all see the same machine), and
the speed ratio against torch.  Targets: >= 80% of the read bandwidth and >= 1.5x torch for
the first case, and the same bandwidth for the long single sequence (split-K keeps every
core busy).

The machine may be shared: every figure is a median of several repeats; the spread of
numattn's repeats is printed too, as the noise to read the figures against.

``--threads N`` runs numattn, torch and the bandwidth probe on N threads (default: all
cores).  ``--threads 1`` shows how much of one core's own read rate the kernel reaches:
where one core alone can read nearly as fast as all of them (a core then waits for memory
less than when the cores share a link), the kernel's arithmetic, not the memory, sets
its pace (figures: "Decode" and "Decode stream prefetch" in docs/performance.rst).

The probe is :func:`numattn.tools.bench.read_all_fn` (eight sequential streams per thread).
torch is imported before Numba starts its threads (see
:func:`numattn.tools.bench.torch_or_none`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # numattn

import numattn
from numattn.decode import decode_attention
from numattn.tools.bench import interleaved_times, read_all_fn, torch_or_none
from numattn.tools.cli import at_least

CASES = [
    # (label, B, H, Hkv, N, D)
    ("B=8 N=4096", 8, 32, 8, 4096, 128),
    ("B=1 N=32768", 1, 32, 8, 32768, 128),
]
PAGE_SIZE = 128


def paged_problem(rng, batch, num_heads, num_kv_heads, num_keys, head_dim, dtype):
    """q, paged K/V caches holding ``num_keys`` tokens per sequence (shuffled pages), and
    the same keys and values as dense ``[B, Hkv, N, D]`` arrays for torch."""
    pages_per_seq = -(-num_keys // PAGE_SIZE)
    num_pages = batch * pages_per_seq
    shape = (num_pages, PAGE_SIZE, num_kv_heads, head_dim)
    k_pages = rng.standard_normal(shape, dtype=np.float32).astype(dtype)
    v_pages = rng.standard_normal(shape, dtype=np.float32).astype(dtype)
    table = rng.permutation(num_pages).reshape(batch, pages_per_seq)
    lengths = np.full(batch, num_keys - 1)  # the new token is the last of the num_keys
    k = numattn.PagedKVCache(k_pages, lengths, table)
    v = numattn.PagedKVCache(v_pages, lengths, table)
    q = rng.standard_normal((batch, num_heads, head_dim), dtype=np.float32).astype(dtype)

    def dense(pages):
        rows = pages[table].reshape(batch, pages_per_seq * PAGE_SIZE, num_kv_heads, head_dim)
        return np.ascontiguousarray(rows[:, :num_keys].transpose(0, 2, 1, 3))

    return q, k, v, dense(k_pages), dense(v_pages)


def parse_case(text):
    """``"B,H,HKV,N,D"`` -> a case tuple like those of :data:`CASES`."""
    try:
        batch, heads, kv_heads, num_keys, head_dim = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected B,H,HKV,N,D (5 integers), got {text!r}") from None
    if min(batch, heads, kv_heads, num_keys, head_dim) < 1 or heads % kv_heads:
        raise argparse.ArgumentTypeError(f"need positive sizes and H % HKV == 0, got {text!r}")
    label = f"B={batch} H={heads}/{kv_heads} N={num_keys} D={head_dim}"
    return label, batch, heads, kv_heads, num_keys, head_dim


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=at_least(1), default=15)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--case", type=parse_case, action="append", metavar="B,H,HKV,N,D",
                        help="run this shape instead of the named ones (repeatable)")
    parser.add_argument("--threads", type=at_least(1), default=os.cpu_count() or 1,
                        help="threads for numattn, torch and the bandwidth probe "
                             "(default: all cores)")
    args = parser.parse_args(argv)
    # torch first: see torch_or_none
    torch = torch_or_none()
    import numba

    threads = min(args.threads, numba.config.NUMBA_NUM_THREADS)  # Numba's pool is the cap
    numba.set_num_threads(threads)
    cases = args.case or CASES
    width = max(14, 2 + max(len(case[0]) for case in cases))
    dtype = np.dtype(args.dtype)
    rng = np.random.default_rng(0)
    if torch is not None:
        torch.set_num_threads(threads)
    read_all, read_bytes = read_all_fn(threads=threads)
    print(f"dtype {dtype}; {os.cpu_count()} cores, {threads} threads; "
          f"torch {'yes' if torch is not None else 'no'}")
    header = (f"{'case':<{width}}{'numattn ms':>11}{'(min..max)':>16}{'GB/s':>7}{'read bw':>9}"
              f"{'of bw':>7}{'torch ms':>10}{'GB/s':>7}{'speedup':>9}")
    print(header)
    for label, batch, heads, kv_heads, num_keys, head_dim in cases:
        q, k, v, k_dense, v_dense = paged_problem(rng, batch, heads, kv_heads, num_keys,
                                                  head_dim, dtype)
        out = np.empty(q.shape, dtype)
        kv_bytes = 2 * batch * num_keys * kv_heads * head_dim * dtype.itemsize
        fns = [lambda: decode_attention(q, k, v, out=out), read_all]  # noqa: B023
        if torch is not None:
            tq = torch.from_numpy(q[:, :, None, :])
            tk = torch.from_numpy(k_dense)
            tv = torch.from_numpy(v_dense)
            sdpa = torch.nn.functional.scaled_dot_product_attention

            def torch_decode():
                with torch.inference_mode():
                    sdpa(tq, tk, tv, enable_gqa=True)  # noqa: B023

            fns.append(torch_decode)
        # numattn, the read-bandwidth probe and torch take turns in every round, so that
        # all of them see the same state of this (shared, virtual) machine
        times = interleaved_times(fns, repeat=args.repeat)
        med, lo, hi = statistics.median(times[0]), min(times[0]), max(times[0])
        bandwidth = read_bytes / statistics.median(times[1]) / 1e9
        gbs = kv_bytes / med / 1e9
        line = (f"{label:<{width}}{med * 1e3:>11.2f}{f'({lo * 1e3:.1f}..{hi * 1e3:.1f})':>16}"
                f"{gbs:>7.1f}{bandwidth:>9.1f}{gbs / bandwidth:>7.0%}")
        if torch is not None:
            t_med = statistics.median(times[2])
            line += (f"{t_med * 1e3:>10.2f}{kv_bytes / t_med / 1e9:>7.1f}"
                     f"{t_med / med:>8.2f}x")
        print(line)


if __name__ == "__main__":
    main()
