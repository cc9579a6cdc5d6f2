"""Benchmark of K/V layouts: token-major against head-major read in place and copied.

Run ``python benchmarks/bench_layouts.py`` (``--repeat N``).

numattn's own layout is token-major (``[pages, page_size, Hkv, D]``, dense
``[B, N, Hkv, D]``).  Head-major K/V (``[pages, Hkv, page_size, D]``, vLLM's and
FlashInfer's HND, and transformers' ``[B, Hkv, N, D]``) is given as a ``swapaxes(1, 2)``
view and read in place through its strides; the third column copies it into token-major
order first (``np.ascontiguousarray``), what a caller had to do before.  Same values in all
three, float32:

* decode, paged (16-token pages in a shuffled pool), B=8 H=32 Hkv=8 N=4096 D=128, and
  dense B=1 N=32768: stored bytes over time as a fraction of the read probe;
* causal prefill, dense, B=1 H=32 Hkv=8 S=N=2048 D=128.

Each case runs its variants round by round in one process
(:func:`numattn.tools.bench.interleaved_medians`); printed are medians and ratios to
token-major.  The machine may be shared: read ratios, not single runs.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # numattn

from numattn.tools.bench import interleaved_medians, read_all_fn

H, HKV, D, PAGE = 32, 8, 128, 16


def paged_decode(rng, batch, num_keys):
    """``(q, token-major caches, head-major caches, head-major pools)``, the same values."""
    import numattn

    pages_per_seq = num_keys // PAGE
    num_pages = batch * pages_per_seq
    table = rng.permutation(num_pages).reshape(batch, pages_per_seq)
    lengths = np.full(batch, num_keys - 1, np.int64)
    pools = rng.standard_normal((2, num_pages, HKV, PAGE, D), dtype=np.float32)  # HND
    token_major = [numattn.PagedKVCache(np.ascontiguousarray(p.swapaxes(1, 2)), lengths, table)
                   for p in pools]
    head_major = [numattn.PagedKVCache(p.swapaxes(1, 2), lengths, table) for p in pools]
    q = rng.standard_normal((batch, H, D), dtype=np.float32)
    return q, token_major, head_major, pools


def dense(rng, batch, num_keys):
    """``(k, v)`` as ``[B, Hkv, N, D]`` arrays (head-major)."""
    return rng.standard_normal((2, batch, HKV, num_keys, D), dtype=np.float32)


def report(label, times, stored_bytes=None, read_gbs=None):
    base = times[0]
    cells = []
    for name, t in zip(("token-major", "head-major in place", "head-major copied"), times):
        cell = f"{name} {t * 1e3:8.2f} ms ({t / base:4.2f}x"
        if stored_bytes:
            cell += f", {stored_bytes / t / 1e9 / read_gbs:4.0%} of read probe"
        cells.append(cell + ")")
    print(f"  {label}")
    for cell in cells:
        print(f"    {cell}")


def _run(label, fns, repeat, stored_bytes=None, read_gbs=None):
    for fn in fns:  # compiled or loaded
        fn()
    report(label, interleaved_medians(fns, repeat=repeat), stored_bytes, read_gbs)


def decode_paged_case(rng, repeat, read_gbs, batch=8, num_keys=4096):
    import numattn

    q, tm, hm, pools = paged_decode(rng, batch, num_keys)
    lengths, table = tm[0].cache_lengths, tm[0].lookup_table

    def copied():
        k, v = (numattn.PagedKVCache(np.ascontiguousarray(p.swapaxes(1, 2)), lengths, table)
                for p in pools)
        return numattn.decode_attention(q, k, v)

    _run(f"paged B={batch} N={num_keys}",
         [lambda: numattn.decode_attention(q, *tm), lambda: numattn.decode_attention(q, *hm),
          copied], repeat, 2 * batch * num_keys * HKV * D * 4, read_gbs)


def decode_dense_case(rng, repeat, read_gbs, batch=1, num_keys=32768):
    import numattn

    k, v = dense(rng, batch, num_keys)
    q = rng.standard_normal((batch, H, D), dtype=np.float32)
    kt, vt = np.ascontiguousarray(k.swapaxes(1, 2)), np.ascontiguousarray(v.swapaxes(1, 2))
    _run(f"dense B={batch} N={num_keys}",
         [lambda: numattn.decode_attention(q, kt, vt),
          lambda: numattn.decode_attention(q, k.swapaxes(1, 2), v.swapaxes(1, 2)),
          lambda: numattn.decode_attention(q, np.ascontiguousarray(k.swapaxes(1, 2)),
                                           np.ascontiguousarray(v.swapaxes(1, 2)))],
         repeat, 2 * batch * num_keys * HKV * D * 4, read_gbs)


def prefill_case(rng, repeat, s=2048):
    import numattn

    k, v = dense(rng, 1, s)
    q = rng.standard_normal((1, s, H, D), dtype=np.float32)
    kt, vt = np.ascontiguousarray(k.swapaxes(1, 2)), np.ascontiguousarray(v.swapaxes(1, 2))
    mask = numattn.CausalMask()
    _run(f"dense S=N={s}",
         [lambda: numattn.flash_attention_kv_cache(q, kt, vt, mask),
          lambda: numattn.flash_attention_kv_cache(q, k.swapaxes(1, 2), v.swapaxes(1, 2), mask),
          lambda: numattn.flash_attention_kv_cache(
              q, np.ascontiguousarray(k.swapaxes(1, 2)), np.ascontiguousarray(v.swapaxes(1, 2)),
              mask)], repeat)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=9, help="rounds per case (default 9)")
    args = parser.parse_args(argv)

    read_all, read_bytes = read_all_fn(1024)
    read_gbs = read_bytes / interleaved_medians([read_all], repeat=args.repeat)[0] / 1e9
    print(f"read probe {read_gbs:.1f} GB/s")
    rng = np.random.default_rng(0)
    print(f"Decode H={H} Hkv={HKV} D={D} float32")
    decode_paged_case(rng, args.repeat, read_gbs)
    decode_dense_case(rng, args.repeat, read_gbs)
    print(f"Causal prefill B=1 H={H} Hkv={HKV} D={D} float32")
    prefill_case(rng, args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
