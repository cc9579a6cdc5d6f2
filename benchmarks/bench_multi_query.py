"""Benchmark of a few query rows per sequence over long caches (speculative decoding).

Run ``python benchmarks/bench_multi_query.py`` (``--repeat N``).  Each case is causal
``flash_attention_kv_cache`` with S new query rows per sequence after ``N - S`` cached tokens
(float32, H=32, Hkv=8, D=128, paged cache with pages of 128, shuffled).  Problems of at most
``numattn.kernels.cpu.flash.MULTI_QUERY_MAX_LEN`` rows per sequence run on decode's CPU kernel; the
script times that path and the flash kernel's tile GEMMs (the module constants switched for
the comparison) and PyTorch's CPU ``scaled_dot_product_attention`` on the same work (dense
K/V, ``enable_gqa=True``, a boolean causal mask), all taking turns in every round, and
prints medians, the K/V bytes read per second, and the ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # numattn

import numattn
from numattn import flash
from numattn.flash import flash_attention_kv_cache
from numattn.tools.bench import interleaved_times, torch_or_none
from numattn.tools.cli import at_least

HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 128
CASES = [(16, 4, 512), (8, 8, 2048), (4, 16, 4096), (1, 16, 32768), (4, 24, 4096)]


def problem(rng, batch, q_len, num_keys):
    pages_per_seq = -(-num_keys // PAGE_SIZE)
    shape = (batch * pages_per_seq, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    k_pages = rng.standard_normal(shape, dtype=np.float32)
    v_pages = rng.standard_normal(shape, dtype=np.float32)
    table = rng.permutation(batch * pages_per_seq).reshape(batch, pages_per_seq)
    lengths = np.full(batch, num_keys - q_len)
    k = numattn.PagedKVCache(k_pages, lengths, table)
    v = numattn.PagedKVCache(v_pages, lengths, table)
    q = rng.standard_normal((batch, q_len, HEADS, HEAD_DIM), dtype=np.float32)

    def dense(pages):
        rows = pages[table].reshape(batch, pages_per_seq * PAGE_SIZE, KV_HEADS, HEAD_DIM)
        return np.ascontiguousarray(rows[:, :num_keys].transpose(0, 2, 1, 3))

    return q, k, v, dense(k_pages), dense(v_pages)


def on_path(fn, decode_kernels):
    """``fn`` run with every problem sent to decode's kernels, or to the flash kernel."""
    def run():
        names = ("MULTI_QUERY_MAX_LEN", "MULTI_QUERY_MIN_WORK", "MULTI_QUERY_MIN_KEYS_PER_ROW")
        saved = [getattr(flash, name) for name in names]
        # every case has all its rows in use
        for name, value in zip(names, (2**62 if decode_kernels else 0, -1, 0)):
            setattr(flash, name, value)
        try:
            fn()
        finally:
            for name, value in zip(names, saved):
                setattr(flash, name, value)
    return run


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=at_least(1), default=9)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    torch = torch_or_none()
    print(f"float32 H={HEADS} Hkv={KV_HEADS} D={HEAD_DIM}, causal, pages of {PAGE_SIZE}; "
          f"{os.cpu_count()} cores; torch {'yes' if torch is not None else 'no'}; "
          f"decode's kernels for S <= {flash.MULTI_QUERY_MAX_LEN}")
    print(f"{'case':<22}{'decode k. ms':>13}{'flash k. ms':>12}{'ratio':>7}{'GB/s':>7}"
          f"{'torch ms':>10}{'vs torch':>9}")
    for batch, q_len, num_keys in CASES:
        q, k, v, k_dense, v_dense = problem(rng, batch, q_len, num_keys)
        out = np.empty_like(q)
        call = lambda: flash_attention_kv_cache(q, k, v, numattn.CausalMask(), out=out)  # noqa: E731, B023
        fns = [on_path(call, True), on_path(call, False)]
        if torch is not None:
            tq = torch.from_numpy(np.ascontiguousarray(q.transpose(0, 2, 1, 3)))
            tk, tv = torch.from_numpy(k_dense), torch.from_numpy(v_dense)
            visible = np.arange(num_keys)[None, :] <= np.arange(num_keys - q_len, num_keys)[:, None]
            tmask = torch.from_numpy(visible)
            sdpa = torch.nn.functional.scaled_dot_product_attention

            def torch_call():
                with torch.inference_mode():
                    sdpa(tq, tk, tv, attn_mask=tmask, enable_gqa=True)  # noqa: B023

            fns.append(torch_call)
        medians = [statistics.median(t) for t in interleaved_times(fns, repeat=args.repeat)]
        ours = medians[0] if q_len <= flash.MULTI_QUERY_MAX_LEN else medians[1]
        kv_bytes = 2 * batch * num_keys * KV_HEADS * HEAD_DIM * 4
        line = (f"{f'B={batch} S={q_len} N={num_keys}':<22}{medians[0] * 1e3:>13.2f}"
                f"{medians[1] * 1e3:>12.2f}{medians[1] / medians[0]:>7.2f}"
                f"{kv_bytes / ours / 1e9:>7.1f}")
        if torch is not None:
            line += f"{medians[2] * 1e3:>10.2f}{medians[2] / ours:>8.2f}x"
        print(line)
    print("ratio: flash kernel time / decode kernels time; GB/s and 'vs torch' for the path "
          "numattn takes")


if __name__ == "__main__":
    main()
