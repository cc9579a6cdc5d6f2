"""Benchmark of small calls: the fixed cost of one call of each operation, against torch.

Run ``python benchmarks/bench_overhead.py`` (``--calls N`` calls per round).  A model runs
one attention call per layer and token, so on short contexts the fixed cost of a call (its
argument checks, cache-table checks, kernel launches) is what a user waits for, not the
memory or arithmetic.  Each case is tiny (float32, H = 32, Hkv = 8, D = 128, paged caches with
pages of 16); it prints the median microseconds per call of numattn's plain call, of a
layer's run of a plan made once for the step (:class:`numattn.DecodePlan`,
:class:`numattn.FlashPlan`; the layers of a step share its cache tables, so the plan's cost
is spread over them and left out here), and of PyTorch's CPU
``scaled_dot_product_attention`` on the same work (dense K/V, ``enable_gqa=True``; a padded
causal mask for the prefill cases), then torch's time over each of numattn's (above 1:
numattn is faster).  The contenders take turns in blocks of calls, round after round, so
that all see the same state of a shared machine.  ``--torch-threads N`` sets torch's thread
count (by default its own): on a busy virtual machine, waking its workers for every call
costs torch more than the call's work.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # numattn

import numattn
from numattn.cross import cross_attention
from numattn.decode import decode_attention
from numattn.flash import flash_attention_kv_cache
from numattn.tools.bench import torch_or_none
from numattn.tools.cli import at_least

HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16


def cache_pair(rng, batch, num_keys):
    """Paged K/V caches of ``num_keys`` tokens per sequence, and the same rows as dense
    ``[B, Hkv, N, D]`` arrays for torch."""
    pages_per_seq = -(-num_keys // PAGE_SIZE)
    shape = (batch * pages_per_seq, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    k_pages = rng.standard_normal(shape, dtype=np.float32)
    v_pages = rng.standard_normal(shape, dtype=np.float32)
    table = rng.permutation(batch * pages_per_seq).reshape(batch, pages_per_seq)

    def dense(pages):
        rows = pages[table].reshape(batch, pages_per_seq * PAGE_SIZE, KV_HEADS, HEAD_DIM)
        return np.ascontiguousarray(rows[:, :num_keys].transpose(0, 2, 1, 3))

    return k_pages, v_pages, table, dense(k_pages), dense(v_pages)


def decode_case(rng, torch, batch, num_keys):
    """The plain call, a plan's run and torch's call (``None`` without torch)."""
    k_pages, v_pages, table, k_dense, v_dense = cache_pair(rng, batch, num_keys)
    lengths = np.full(batch, num_keys - 1)
    k = numattn.PagedKVCache(k_pages, lengths, table)
    v = numattn.PagedKVCache(v_pages, lengths, table)
    q = rng.standard_normal((batch, HEADS, HEAD_DIM), dtype=np.float32)
    out = np.empty_like(q)
    plan = numattn.DecodePlan(k, v)
    ours = lambda: decode_attention(q, k, v, out=out)  # noqa: E731
    planned = lambda: plan.run(q, k, v, out=out)  # noqa: E731
    if torch is None:
        return ours, planned, None
    tq, tk, tv = (torch.from_numpy(x) for x in (q[:, :, None], k_dense, v_dense))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return ours, planned, lambda: sdpa(tq, tk, tv, enable_gqa=True)


def prefill_case(rng, torch, batch, q_len, num_keys, operation):
    """``q_len`` new tokens per sequence after ``num_keys - q_len`` cached ones, causal: the
    plain call, a plan's run (flash; ``None`` for cross) and torch's call."""
    k_pages, v_pages, table, k_dense, v_dense = cache_pair(rng, batch, num_keys)
    lengths = np.full(batch, num_keys - q_len)
    k = numattn.PagedKVCache(k_pages, lengths, table)
    v = numattn.PagedKVCache(v_pages, lengths, table)
    q = rng.standard_normal((batch * q_len, HEADS, HEAD_DIM), dtype=np.float32)
    offsets = np.arange(batch + 1, dtype=np.int64) * q_len
    out = np.empty_like(q)
    planned = None
    if operation == "flash":
        def ours():
            flash_attention_kv_cache(q, k, v, numattn.CausalMask(), q_input_row_offsets=offsets,
                                     out=out)

        plan = numattn.FlashPlan(k, v, numattn.CausalMask(), q_input_row_offsets=offsets)

        def planned():
            plan.run(q, k, v, out=out)
    else:
        # cross attention's queries sit at 0 .. q_len - 1: the same keys, no mask
        def ours():
            cross_attention(q, offsets, q_len, k, v, offsets, out=out)
    if torch is None:
        return ours, planned, None
    tq = torch.from_numpy(np.ascontiguousarray(
        q.reshape(batch, q_len, HEADS, HEAD_DIM).transpose(0, 2, 1, 3)))
    tk, tv = torch.from_numpy(k_dense), torch.from_numpy(v_dense)
    q_idx = np.arange(num_keys - q_len, num_keys)[:, None]
    visible = np.arange(num_keys)[None, :] <= q_idx
    if operation != "flash":
        visible = np.ones_like(visible)
    tmask = torch.from_numpy(visible)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return ours, planned, lambda: sdpa(tq, tk, tv, attn_mask=tmask, enable_gqa=True)


def per_call_times(fns, *, calls, rounds):
    """Median seconds per call of each callable: blocks of ``calls`` calls, taking turns."""
    for fn in fns:
        for _ in range(20):
            fn()
    times = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            for _ in range(calls):
                start = time.perf_counter()
                fn()
                times[i].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=at_least(1), default=200, help="calls per block")
    parser.add_argument("--rounds", type=at_least(1), default=15)
    parser.add_argument("--torch-threads", type=at_least(1), default=None,
                        help="torch's thread count (default: its own)")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    torch = torch_or_none()
    if torch is not None and args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    cases = [
        ("decode B=1 N=16", decode_case(rng, torch, 1, 16)),
        ("decode B=4 N=64", decode_case(rng, torch, 4, 64)),
        ("flash B=1 S=4 N=20", prefill_case(rng, torch, 1, 4, 20, "flash")),
        ("cross B=2 S=4 N=16", prefill_case(rng, torch, 2, 4, 16, "cross")),
    ]
    threads = f"{torch.get_num_threads()} threads" if torch is not None else "no"
    print(f"float32 H={HEADS} Hkv={KV_HEADS} D={HEAD_DIM}; {os.cpu_count()} cores; "
          f"torch {threads}")
    print(f"{'case':<22}{'call us':>9}{'plan us':>9}{'torch us':>10}{'torch/call':>12}"
          f"{'torch/plan':>12}{'call/plan':>11}")
    for label, fns in cases:
        medians = per_call_times([fn for fn in fns if fn is not None], calls=args.calls,
                                 rounds=args.rounds)
        call, plan, torch_time = (medians.pop(0) if fn is not None else None for fn in fns)
        line = f"{label:<22}{call * 1e6:>9.1f}" + _us(plan) + _us(torch_time, 10)
        line += _ratio(torch_time, call) + _ratio(torch_time, plan) + _ratio(call, plan, 11)
        print(line)


def _us(seconds, width=9):
    return f"{'-' if seconds is None else f'{seconds * 1e6:.1f}':>{width}}"


def _ratio(a, b, width=12):
    return f"{'-' if a is None or b is None else f'{a / b:.2f}x':>{width}}"


if __name__ == "__main__":
    main()
