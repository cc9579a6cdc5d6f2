"""Benchmark of 16- and 8-bit K/V storage on the CPU, side by side with float32 in one run.

Run ``python benchmarks/bench_dtypes.py`` (``--repeat N``; ``--skip-decode``,
``--skip-prefill``, ``--skip-memory``, ``--only-memory``).

* Decode, paged (pages of 128), B=8 H=32 Hkv=8 N=4096 D=128 and B=1 N=32768: numattn with
  K/V stored as float32, bfloat16, float16, float8_e4m3fn, float8_e5m2 and int8 (with
  per-(slot, head) scales), float32 queries (bfloat16 and float16 queries for the 16-bit
  caches), all timed round by round with the read-bandwidth probe; printed: the median,
  the stored K/V bytes read per second, the fraction of the probe, and the speed-up over
  numattn's own float32 in the same rounds.  Targets: bfloat16 >= 1.8x float32 and >= 80%
  of the probe; int8 and float8 >= 3.2x float32.
* Prefill, causal, B=1 H=32 Hkv=8 S=2048 D=128: numattn float32 and bfloat16 against torch
  SDPA in float32 and bfloat16 (where torch is installed), in the same rounds.  On a CPU
  with AMX, numattn's bfloat16 runs on the tiles (:mod:`numattn.kernels.cpu.amx`), and
  a row "bfloat16, vector" shows the same call with the tiles switched off.
* Memory: the peak resident memory a bfloat16 decode over a 1 GiB cache adds (a child
  process: ``ru_maxrss`` after building the cache and loading the kernels with a call over
  a small cache, after the first call over the whole cache and after ten more); the target
  is < 64 MiB.

The machine may be shared: read medians and ratios, not single runs.
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # numattn

from numattn.kernels.cpu import amx, flash
from numattn.tools.bench import (
    interleaved_medians,
    read_all_fn,
    stored_array,
    torch_or_none,
)
from numattn.tools.cli import STORAGE_DTYPES, at_least

DECODE_CASES = [("B=8 N=4096", 8, 4096), ("B=1 N=32768", 1, 32768)]
H, HKV, D, PAGE = 32, 8, 128, 128


def decode_problems(rng, batch, num_keys):
    """``{dtype: (q, k, v, stored bytes)}`` over the same float32 values."""
    import numattn

    pages_per_seq = num_keys // PAGE
    num_pages = batch * pages_per_seq
    table = rng.permutation(num_pages).reshape(batch, pages_per_seq)
    lengths = np.full(batch, num_keys - 1, np.int64)
    base = rng.standard_normal((2, num_pages, PAGE, HKV, D), dtype=np.float32)
    q32 = rng.standard_normal((batch, H, D), dtype=np.float32)
    problems = {}
    for name in STORAGE_DTYPES:
        (kb, ks), (vb, vs) = stored_array(base[0], name), stored_array(base[1], name)
        k = numattn.PagedKVCache(kb, lengths, table, ks)
        v = numattn.PagedKVCache(vb, lengths, table, vs)
        q = q32.astype(kb.dtype) if name in ("bfloat16", "float16") else q32
        problems[name] = (q, k, v, 2 * batch * num_keys * HKV * D * kb.itemsize)
    return problems


def bench_decode(repeat):
    import numattn

    read_all, read_bytes = read_all_fn(1024)
    rng = np.random.default_rng(0)
    for label, batch, num_keys in DECODE_CASES:
        problems = decode_problems(rng, batch, num_keys)
        fns = []
        for q, k, v, _ in problems.values():
            out = np.empty_like(q)
            numattn.decode_attention(q, k, v, out=out)  # compile (or load) first

            def run(q=q, k=k, v=v, out=out):
                numattn.decode_attention(q, k, v, out=out)

            fns.append(run)
        times = interleaved_medians([*fns, read_all], repeat=repeat)
        probe = read_bytes / times[-1] / 1e9
        print(f"\ndecode {label} (H={H} Hkv={HKV} D={D}, pages of {PAGE}); read probe "
              f"{probe:.1f} GB/s in the same rounds")
        print(f"{'K/V dtype':<14} {'median ms':>10} {'GB/s':>7} {'of probe':>9} "
              f"{'vs float32':>11}")
        for (name, (_, _, _, stored)), t in zip(problems.items(), times):
            print(f"{name:<14} {t * 1e3:>10.2f} {stored / t / 1e9:>7.1f} "
                  f"{100 * stored / t / 1e9 / probe:>8.0f}% {times[0] / t:>10.2f}x")


def bench_prefill(repeat):
    import numattn

    torch = torch_or_none()
    rng = np.random.default_rng(1)
    s = 2048
    q = rng.standard_normal((1, s, H, D), dtype=np.float32)
    k = rng.standard_normal((1, s, HKV, D), dtype=np.float32)
    v = rng.standard_normal((1, s, HKV, D), dtype=np.float32)
    runs = {}
    for name in ("float32", "bfloat16"):
        qs, ks, vs = (stored_array(x, name)[0] for x in (q, k, v))
        out = np.empty_like(qs)
        runs[f"numattn {name}"] = (lambda qs=qs, ks=ks, vs=vs, out=out:
                                   numattn.flash_attention_kv_cache(qs, ks, vs,
                                                                    numattn.CausalMask(),
                                                                    out=out))
    if amx.available():
        runs["numattn bf16, vector"] = functools.partial(_without_tiles,
                                                         runs["numattn bfloat16"])
    if torch is not None:
        sdpa = torch.nn.functional.scaled_dot_product_attention
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            qt, kt, vt = (torch.from_numpy(np.ascontiguousarray(x.transpose(0, 2, 1, 3)))
                          .to(dtype) for x in (q, k, v))

            def run(qt=qt, kt=kt, vt=vt):
                with torch.no_grad():
                    sdpa(qt, kt, vt, is_causal=True, enable_gqa=True)

            runs[f"torch SDPA {name}"] = run
    for fn in runs.values():
        fn()  # compile (or load) first
    times = interleaved_medians(list(runs.values()), repeat=repeat)
    flops = 4.0 * H * D * (s * (s + 1) // 2)
    print(f"\nprefill causal B=1 H={H} Hkv={HKV} S={s} D={D}")
    print(f"{'run':<22} {'median ms':>10} {'GFLOP/s':>9} {'vs numattn float32':>19}")
    for (name, _), t in zip(runs.items(), times):
        print(f"{name:<22} {t * 1e3:>10.1f} {flops / t / 1e9:>9.1f} {times[0] / t:>18.2f}x")


def _without_tiles(run):
    """``run()`` with the flash kernel's AMX tiles switched off."""
    choose = flash._amx_tiles
    flash._amx_tiles = lambda *args: False
    try:
        run()
    finally:
        flash._amx_tiles = choose


_MEMORY_CHILD = """
import resource, sys
import numpy as np
sys.path.insert(0, {root!r})
import numattn
from numattn.tools.bench import stored_array
batch, pages_per_seq = 4, 512  # 4 sequences of 65536 tokens: 2 x 512 MiB of bfloat16
rng = np.random.default_rng(0)
table = rng.permutation(batch * pages_per_seq).reshape(batch, pages_per_seq)
lengths = np.full(batch, pages_per_seq * {page} - 1)
shape = (batch * pages_per_seq, {page}, {hkv}, {d})
bf16 = stored_array(np.ones(1, np.float32), "bfloat16")[0].dtype
k = numattn.PagedKVCache(np.full(shape, 0.5, bf16), lengths, table)  # no float32 copy made
v = numattn.PagedKVCache(np.full(shape, 0.25, bf16), lengths, table)
q = stored_array(rng.standard_normal((batch, {h}, {d}), dtype=np.float32), "bfloat16")[0]
# the same kernels (the parallel binding) loaded first, over a small cache of this layout
small = [numattn.PagedKVCache(c.blocks[:8 * batch], np.full(batch, 8 * {page} - 1),
                              np.arange(8 * batch).reshape(batch, 8)) for c in (k, v)]
numattn.decode_attention(q, *small)
start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
numattn.decode_attention(q, k, v)
first = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for _ in range(10):
    numattn.decode_attention(q, k, v)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((k.blocks.nbytes + v.blocks.nbytes) / 2**30, (first - start) / 1024, (after - first) / 1024)
"""


def bench_memory():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = _MEMORY_CHILD.format(root=root, page=PAGE, hkv=HKV, d=D, h=H)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    cache_gib, first_mib, more_mib = (float(x) for x in result.stdout.split())
    print(f"\nmemory: bfloat16 decode over a {cache_gib:.2f} GiB cache (its kernels loaded "
          f"by a call over a small cache first): the first call raised the peak resident "
          f"memory by {first_mib:.1f} MiB, ten more by {more_mib:.1f} MiB (target: < 64 MiB)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=at_least(1), default=7)
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--skip-prefill", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--only-memory", action="store_true")
    args = parser.parse_args(argv)
    torch_or_none()  # torch before Numba's threads (see torch_or_none)
    if args.only_memory:
        bench_memory()
        return
    if not args.skip_decode:
        bench_decode(args.repeat)
    if not args.skip_prefill:
        bench_prefill(args.repeat)
    if not args.skip_memory:
        bench_memory()


if __name__ == "__main__":
    main()
