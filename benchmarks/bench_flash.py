"""Benchmark of ``flash_attention_kv_cache`` on the CPU: speed and memory.

Cases (float32 unless said):

1. prefill: dense causal, B=1, H=32, Hkv=8, S=2048, D=128, against PyTorch's CPU
   ``scaled_dot_product_attention(is_causal=True, enable_gqa=True)`` (BHSD copies made
   outside the timing) when torch is installed; target >= 0.9x torch's speed.
2. ragged: 8 sequences of 64..1024 tokens in a paged cache (page 128), causal; target
   within 10% of the dense case's GFLOP/s (timed in the prefill case's rounds).
3. window: sliding window 512 over causal at S=8192 (H=8, Hkv=2, D=128); the time ratio
   should be near the ratio of visible pairs, under 0.2.
4. memory: peak resident memory beyond inputs and outputs at S=16384 (H=8, D=64), causal,
   measured in a fresh subprocess; target < 256 MiB.
5. the prefill case in float64 (no target; its GEMM fraction is of the float64 GEMM rate).

GFLOP/s count useful work only, ``4 D`` flops per visible (query, key) pair per head.  The
machine is shared, so each case alternates numattn and torch for ``--repeat`` rounds and
reports medians; the speed ratio is the median of the per-round ratios.

Run: ``python benchmarks/bench_flash.py [--repeat 7] [--skip-memory] [--skip-window]
[--skip-float64]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # numattn

from numattn import CausalMask, PagedKVCache, SlidingWindowCausalMask
from numattn.flash import flash_attention_kv_cache
from numattn.tools.bench import gemm_gflops, interleaved_times, torch_or_none
from numattn.tools.cli import at_least


def alternate(fns, repeat):
    """Median seconds of each callable, run in alternation ``repeat`` times after a warm-up.

    Also returns the per-round times (``rounds[r][i]``), so ratios can be taken within a round.
    """
    times = interleaved_times(fns, repeat=repeat)
    return [statistics.median(t) for t in times], list(zip(*times))


def causal_pairs(q_len, num_keys):
    """Visible pairs of a bottom-right causal mask (queries at the last positions)."""
    first = num_keys - q_len
    return sum(min(first + r + 1, num_keys) for r in range(q_len))


def window_pairs(s, window):
    return sum(min(r + 1, window) for r in range(s))


def prefill_case(rng, repeat, torch, dtype=np.float32, ragged=None):
    """The prefill case; with ``ragged`` (a row of :func:`ragged_case`) that case's call
    runs in the same rounds, and its row gets ``dense_ratio``, the median per-round ratio of
    its GFLOP/s to the prefill's (a ratio of medians taken minutes apart is as noisy as the
    machine)."""
    b, h, hkv, s, d = 1, 32, 8, 2048, 128
    q = rng.standard_normal((b, s, h, d)).astype(dtype)
    k = rng.standard_normal((b, s, hkv, d)).astype(dtype)
    v = rng.standard_normal((b, s, hkv, d)).astype(dtype)
    out = np.empty_like(q)
    flops = 4 * d * h * b * causal_pairs(s, s)
    fns = [lambda: flash_attention_kv_cache(q, k, v, CausalMask(), out=out)]
    if torch is not None:
        tq, tk, tv = (torch.from_numpy(np.ascontiguousarray(x.transpose(0, 2, 1, 3)))
                      for x in (q, k, v))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        fns.append(lambda: sdpa(tq, tk, tv, is_causal=True, enable_gqa=True))
    if ragged is not None:
        fns.append(ragged.pop("call"))
    medians, rounds = alternate(fns, repeat)
    ratio = statistics.median(r[1] / r[0] for r in rounds) if torch is not None else None
    if ragged is not None:
        ragged["seconds"] = medians[-1]
        ragged["dense_ratio"] = statistics.median(
            ragged["flops"] / r[-1] / (flops / r[0]) for r in rounds)
    return {"case": f"prefill dense causal S=2048 {np.dtype(dtype).name}", "flops": flops,
            "seconds": medians[0], "torch_seconds": medians[1] if torch is not None else None,
            "ratio": ratio, "gemm": gemm_gflops(dtype)}


def ragged_case(rng):
    """The ragged case's row, its call under ``"call"`` (timed by :func:`prefill_case`)."""
    h, hkv, d, page = 32, 8, 128, 128
    lengths = np.linspace(64, 1024, 8).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    q = rng.standard_normal((offsets[-1], h, d)).astype(np.float32)
    pages_per_seq = -(-lengths // page)
    num_pages = int(pages_per_seq.sum())
    order = rng.permutation(num_pages)
    table = np.zeros((8, int(pages_per_seq.max())), np.int64)
    used = 0
    for b, n in enumerate(pages_per_seq):
        table[b, :n] = order[used:used + n]
        used += n
    k_pages = rng.standard_normal((num_pages, page, hkv, d)).astype(np.float32)
    v_pages = rng.standard_normal((num_pages, page, hkv, d)).astype(np.float32)
    zeros = np.zeros(8, np.int64)
    k = PagedKVCache(k_pages, zeros, table)
    v = PagedKVCache(v_pages, zeros, table)
    out = np.empty_like(q)
    flops = 4 * d * h * sum(causal_pairs(n, n) for n in lengths)
    return {"case": "ragged paged causal 8 x 64..1024", "flops": flops,
            "call": lambda: flash_attention_kv_cache(q, k, v, CausalMask(),
                                                     q_input_row_offsets=offsets, out=out)}


def window_case(rng, repeat):
    b, h, hkv, s, d, window = 1, 8, 2, 8192, 128, 512
    q = rng.standard_normal((b, s, h, d)).astype(np.float32)
    k = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
    v = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
    out = np.empty_like(q)
    masks = (CausalMask(), SlidingWindowCausalMask(window))
    (causal_s, window_s), rounds = alternate(
        [lambda m=m: flash_attention_kv_cache(q, k, v, m, out=out) for m in masks], repeat)
    pair_ratio = window_pairs(s, window) / causal_pairs(s, s)
    return [
        {"case": "causal S=8192 (H=8)", "flops": 4 * d * h * causal_pairs(s, s),
         "seconds": causal_s},
        {"case": f"sliding window {window} S=8192", "flops": 4 * d * h * window_pairs(s, window),
         "seconds": window_s,
         "note": f"time ratio {statistics.median(r[1] / r[0] for r in rounds):.3f} "
                 f"(visible pairs ratio {pair_ratio:.3f}; target < 0.2)"},
    ]


_MEMORY_SCRIPT = """
import json, sys
import numpy as np
sys.path.insert(0, {root!r})
from numattn import CausalMask
from numattn.flash import flash_attention_kv_cache

def status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

warm = np.ones((1, 512, 8, 64), np.float32)  # large enough for the worker threads
flash_attention_kv_cache(warm, warm, warm, CausalMask())  # compile / load first
rng = np.random.default_rng(0)
s, h, d = 16384, 8, 64
q, k, v = (rng.standard_normal((1, s, h, d), dtype=np.float32) for _ in range(3))
out = np.zeros_like(q)
before = status("VmRSS")  # inputs and output allocated and touched
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak (VmHWM) to the current RSS
flash_attention_kv_cache(q, k, v, CausalMask(), out=out)
print(json.dumps({{"extra": status("VmHWM") - before, "inputs": 4 * q.nbytes}}))
"""


def memory_case():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT.format(root=root)],
                            capture_output=True, text=True, check=True)
    data = json.loads(result.stdout.strip().splitlines()[-1])
    return data


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=at_least(1), default=7)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-window", action="store_true")
    parser.add_argument("--skip-float64", action="store_true")
    args = parser.parse_args(argv)
    torch = torch_or_none()
    rng = np.random.default_rng(0)
    gemm = gemm_gflops(np.float32)
    print(f"machine: BLAS float32 GEMM {gemm:.1f} GFLOP/s, float64 "
          f"{gemm_gflops(np.float64):.1f} GFLOP/s (medians of 5), "
          f"torch {'installed' if torch is not None else 'not installed'}, "
          f"numba threads {os.environ.get('NUMBA_NUM_THREADS', 'default')}")
    ragged = ragged_case(rng)
    rows = [prefill_case(rng, args.repeat, torch, ragged=ragged), ragged]
    if not args.skip_window:
        rows += window_case(rng, max(3, args.repeat // 2))
    if not args.skip_float64:
        rows.append(prefill_case(rng, max(3, args.repeat // 2), torch, np.float64))
    print(f"{'case':36} {'median ms':>10} {'GFLOP/s':>8} {'of GEMM':>8} {'torch ms':>9} "
          f"{'torch GF/s':>10} {'speed vs torch':>14}")
    for row in rows:
        gf = row["flops"] / row["seconds"] / 1e9
        frac = gf / row.get("gemm", gemm)
        line = f"{row['case']:36} {row['seconds'] * 1e3:10.1f} {gf:8.1f} {frac:8.0%}"
        if row.get("torch_seconds"):
            tgf = row["flops"] / row["torch_seconds"] / 1e9
            line += f" {row['torch_seconds'] * 1e3:9.1f} {tgf:10.1f} {row['ratio']:13.2f}x"
        print(line)
        if "note" in row:
            print(f"    {row['note']}")
    print(f"ragged / dense GFLOP/s: {ragged['dense_ratio']:.2f} (median of the rounds' "
          f"ratios; target >= 0.9)")
    if not args.skip_memory:
        mem = memory_case()
        print(f"memory S=16384 H=8 D=64: peak beyond inputs and outputs "
              f"{mem['extra'] / 2**20:.1f} MiB (inputs + output {mem['inputs'] / 2**20:.0f} MiB; "
              f"target < 256 MiB)")


if __name__ == "__main__":
    main()
