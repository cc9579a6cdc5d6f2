"""One-command GPU check and benchmark of every operation (``device="cuda"``).

Run on a machine with a GPU::

    python benchmarks/gpu_check.py            # check + benchmark, a few minutes
    NUMBA_ENABLE_CUDASIM=1 python benchmarks/gpu_check.py --tiny   # proves the script runs

1. Check against ``numattn.reference`` (float64), float32 and float64: decode on dense,
   continuous and paged caches, every mask kind, sinks, GQA, partition counts 1..32; flash
   attention (ragged queries over a paged cache, padded queries over dense K/V) with masks
   and sinks, and cross attention; ``store_kv`` into bfloat16 and int8 device caches (the
   host's bits), ``merge_states`` of device parts, and both plans (the plain call's bits).
   Prints the worst error per case and fails (exit status 1) on any mismatch.
2. Benchmark: decode over float32 paged caches (pages of 128), H=32, Hkv=8, D=128,
   B=8..64 and N=4k..32k, built on the device: the median time, the KV bytes per second
   (the K and V rows of the live cache, read once) and the fraction of the GPU's
   device-to-device copy bandwidth (read + write bytes per second), measured in the same
   run.  Then flash prefill (causal and not) and cross attention in float32: TFLOP/s, as a
   fraction of a float32 GEMM's rate on the same GPU, and torch's SDPA on the same shapes
   (both where torch with CUDA is installed).

``--tiny`` shrinks every shape (and checks one partition count) so that the CUDA simulator
gets through in a minute or two.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from functools import partial

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # numattn

import numattn
from numattn import (
    CausalMask,
    ChunkedCausalMask,
    MaterializedMask,
    MHAConfig,
    NullMask,
    PagedKVCache,
    SlidingWindowCausalMask,
)
from numattn.core.device import require_cuda
from numattn.core.jit import cuda_kernel
from numattn.decode import decode_attention
from numattn.tools.cli import at_least

TOLERANCE = {np.dtype(np.float32): 2e-4, np.dtype(np.float64): 1e-10}


def _fill_uniform(flat, seed):
    """``flat[i]`` = a pseudo-random value in [-1, 1) from a hash of ``i`` (device-side)."""
    i = cuda.grid(1)  # noqa: F821 - bound by cuda_kernel
    if i < flat.shape[0]:
        x = (i * 2654435761 + seed * 97531) % 4294967296
        x = (x ^ (x >> 13)) * 1274126177 % 4294967296
        flat[i] = (x % 2000003) / 1000001.5 - 1.0


def device_random(cuda, shape, dtype, seed):
    flat = cuda.device_array(int(np.prod(shape)), dtype)
    threads = 256
    cuda_kernel(_fill_uniform)[(flat.shape[0] + threads - 1) // threads, threads](flat, seed)
    return flat.reshape(shape)


def paged_host(rng, lengths, kv_heads, head_dim, dtype, page_size, fill=np.nan):
    """Paged K/V caches (shuffled pages, NaN in unused slots, sentinel table entries)."""
    lengths = np.asarray(lengths)
    pages_per_seq = -(-(lengths + 1) // page_size)
    num_pages = int(pages_per_seq.sum()) + 1
    shape = (num_pages, page_size, kv_heads, head_dim)
    blocks = [np.full(shape, fill, dtype) for _ in range(2)]
    table = np.full((len(lengths), int(pages_per_seq.max()) + 1), num_pages)
    order = iter(rng.permutation(num_pages))
    for b, n in enumerate(lengths + 1):
        for j in range(pages_per_seq[b]):
            table[b, j] = next(order)
        for blk in blocks:
            rows = rng.standard_normal((n, kv_heads, head_dim)).astype(dtype)
            for t in range(n):
                blk[table[b, t // page_size], t % page_size] = rows[t]
    return PagedKVCache(blocks[0], lengths, table), PagedKVCache(blocks[1], lengths, table)


def check(tiny):
    """Decode through CUDA against the reference; returns the number of failures."""
    rng = np.random.default_rng(0)
    config = MHAConfig(block_k=4, threads_per_block=32) if tiny else MHAConfig()
    if tiny:  # one partition count: the simulator tests cover the others
        lengths, heads, kv_heads, head_dim, page = [0, 9], 4, 2, 5, 4
        partitions = [3]
    else:
        lengths, heads, kv_heads, head_dim, page = [0, 1, 127, 128, 1024, 4999], 32, 8, 128, 128
        partitions = [1, 2, 5, 32, None]
    window = 3 if tiny else 512
    failures = 0
    print(f"{'check':<44}{'dtype':>9}{'partitions':>12}{'max error':>12}  result")
    for dtype in (np.dtype(np.float32), np.dtype(np.float64)):
        k, v = paged_host(rng, lengths, kv_heads, head_dim, dtype, page)
        dense_k = rng.standard_normal((2, lengths[-1] + 1, kv_heads, head_dim)).astype(dtype)
        dense_v = rng.standard_normal(dense_k.shape).astype(dtype)
        bias = rng.standard_normal((len(lengths), heads, 1, lengths[-1] + 1)).astype(dtype)
        bias[..., ::5] = -np.inf
        sinks = rng.standard_normal(heads).astype(dtype)
        cases = [
            ("paged, null mask", k, v, NullMask(), None),
            ("paged, causal, sinks", k, v, CausalMask(), sinks),
            (f"paged, sliding window {window}", k, v, SlidingWindowCausalMask(window), None),
            ("paged, chunked causal 64 | window", k, v,
             ChunkedCausalMask(64) | SlidingWindowCausalMask(window), None),
            ("paged, additive [B, H, 1, N] & causal", k, v,
             MaterializedMask(bias) & CausalMask(), sinks),
            ("dense [B, N, Hkv, D], causal", dense_k, dense_v, CausalMask(), None),
        ]
        for label, kk, vv, mask, sink in cases:
            batch = 2 if kk is dense_k else len(lengths)
            q = rng.standard_normal((batch, heads, head_dim)).astype(dtype)
            if kk is dense_k and isinstance(mask, MaterializedMask):
                continue
            ref_out, ref_lse = numattn.reference.decode_attention(
                q, kk, vv, mask, sink_weights=sink, return_lse=True)
            for parts in partitions:
                out, lse = decode_attention(q, kk, vv, mask, sink_weights=sink,
                                            num_partitions=parts, device="cuda",
                                            return_lse=True, config=config)
                err = max(_error(out, ref_out), _error(lse, ref_lse))
                ok = err <= TOLERANCE[dtype]
                failures += not ok
                print(f"{label:<44}{dtype.name:>9}{parts!s:>12}{err:>12.2e}  "
                      f"{'ok' if ok else 'FAIL'}")
    return failures


def check_other_operations(tiny):
    """Flash, cross, store_kv, merge_states and the plans through CUDA; returns failures."""
    rng = np.random.default_rng(1)
    cuda = require_cuda()
    if tiny:
        config = MHAConfig(block_q=2, block_k=4, threads_per_block=32)
        cache_lengths, q_lens, heads, kv_heads, head_dim, page = [3, 0], [2, 3], 4, 2, 5, 4
    else:
        config = MHAConfig()
        cache_lengths, q_lens = [0, 1, 100, 1000, 4000], [1, 128, 7, 300, 1]
        heads, kv_heads, head_dim, page = 32, 8, 128, 128
    window = 3 if tiny else 256
    failures = 0

    def report(label, dtype, err):
        nonlocal failures
        ok = err <= TOLERANCE[np.dtype(dtype)]
        failures += not ok
        print(f"{label:<44}{np.dtype(dtype).name:>9}{'':>12}{err:>12.2e}  "
              f"{'ok' if ok else 'FAIL'}")

    offsets = np.concatenate([[0], np.cumsum(q_lens)])
    for dtype in (np.dtype(np.float32), np.dtype(np.float64)):
        k, v = paged_host(rng, np.add(cache_lengths, q_lens) - 1, kv_heads, head_dim, dtype,
                          page)
        k, v = (x.with_cache_lengths(np.asarray(cache_lengths)) for x in (k, v))
        q = rng.standard_normal((int(offsets[-1]), heads, head_dim)).astype(dtype)
        sinks = rng.standard_normal(heads).astype(dtype)
        for label, mask, sink in [("flash ragged paged, causal, sinks", CausalMask(), sinks),
                                  (f"flash ragged paged, window {window}",
                                   SlidingWindowCausalMask(window), None)]:
            args = (q, k, v, mask)
            kwargs = dict(q_input_row_offsets=offsets, sink_weights=sink, return_lse=True)
            got = numattn.flash_attention_kv_cache(*args, device="cuda", config=config,
                                                   **kwargs)
            want = numattn.reference.flash_attention_kv_cache(*args, **kwargs)
            report(label, dtype, max(_error(g, w) for g, w in zip(got, want)))
        n = max(q_lens)
        qp = rng.standard_normal((2, n, heads, head_dim)).astype(dtype)
        kp = rng.standard_normal((2, n, kv_heads, head_dim)).astype(dtype)
        got = numattn.flash_attention_kv_cache(qp, kp, kp, CausalMask(), device="cuda",
                                               config=config)
        want = numattn.reference.flash_attention_kv_cache(qp, kp, kp, CausalMask())
        report("flash padded dense, causal", dtype, _error(got, want))
        kv_rows = rng.standard_normal((int(offsets[-1]), kv_heads, head_dim)).astype(dtype)
        args = (q, offsets, n, kv_rows, kv_rows, offsets, SlidingWindowCausalMask(window))
        got = numattn.cross_attention(*args, device="cuda", return_lse=True, config=config)
        want = numattn.reference.cross_attention(*args, return_lse=True)
        report("cross ragged, window", dtype, max(_error(g, w) for g, w in zip(got, want)))
        plan = numattn.FlashPlan(k, v, CausalMask(), q_input_row_offsets=offsets,
                                 device="cuda", config=config)
        same = np.array_equal(plan.run(q, k, v), numattn.flash_attention_kv_cache(
            q, k, v, CausalMask(), q_input_row_offsets=offsets, device="cuda",
            config=config))
        report("FlashPlan: the plain call's bits", dtype, 0.0 if same else np.inf)
        parts = [cuda.to_device(rng.standard_normal((4, heads, head_dim)).astype(dtype))
                 for _ in range(3)]
        lses = [cuda.to_device(rng.standard_normal((4, heads)).astype(dtype))
                for _ in range(3)]
        got = numattn.merge_states(parts, lses)
        want = numattn.merge_states([x.copy_to_host() for x in parts],
                                    [x.copy_to_host() for x in lses])
        report("merge_states of device parts", dtype, max(
            _error(g.copy_to_host(), w) for g, w in zip(got, want)))
    for name in ("bfloat16", "int8"):
        from numattn.core.dtypes import ml_dtype

        dtype = np.dtype(np.int8) if name == "int8" else ml_dtype(name)
        blocks = np.zeros((8, page, kv_heads, head_dim), dtype)
        scales = np.zeros(blocks.shape[:3], np.float32) if name == "int8" else None
        table = np.arange(8).reshape(2, 4)
        rows = rng.standard_normal((5, kv_heads, head_dim)).astype(np.float32)
        host = PagedKVCache(blocks.copy(), np.array([1, 2]), table, scales=scales)
        device = PagedKVCache(cuda.to_device(blocks), np.array([1, 2]), table,
                              scales=None if scales is None else cuda.to_device(scales))
        numattn.store_kv(host, rows, np.array([0, 2, 5]))
        numattn.store_kv(device, cuda.to_device(rows), np.array([0, 2, 5]))
        same = np.array_equal(device.blocks.copy_to_host().view(np.uint8),
                              host.blocks.view(np.uint8))
        report(f"store_kv into a {name} device cache: bits", np.float32,
               0.0 if same else np.inf)
    return failures


def _error(actual, expected):
    """Worst relative-to-(1 + |x|) error; inf when NaN/inf patterns differ."""
    a = np.asarray(actual, np.float64)
    special = ~np.isfinite(expected)
    if not np.array_equal(np.isnan(a), np.isnan(expected)) or not np.array_equal(
            a[special & ~np.isnan(expected)], expected[special & ~np.isnan(expected)]):
        return np.inf
    fin = ~special
    if not fin.any():
        return 0.0
    return float(np.max(np.abs(a[fin] - expected[fin]) / (1 + np.abs(expected[fin]))))


def timed(cuda, fn, repeat):
    fn()
    cuda.synchronize()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth_gbs(cuda, nbytes, repeat):
    """Device-to-device copy bandwidth: (read + write bytes) per second."""
    src = device_random(cuda, (nbytes // 4,), np.float32, 1)
    dst = cuda.device_array_like(src)
    seconds = timed(cuda, lambda: dst.copy_to_device(src), repeat)
    return 2 * src.nbytes / seconds / 1e9


def benchmark(cuda, tiny, repeat):
    if tiny:
        batches, lengths, heads, kv_heads, head_dim, page = [2], [8], 4, 2, 8, 4
        config = MHAConfig(block_k=4, threads_per_block=32)
        copy_bytes = 1 << 16
    else:
        batches, lengths, heads, kv_heads, head_dim, page = (
            [8, 16, 32, 64], [4096, 8192, 16384, 32768], 32, 8, 128, 128)
        config = MHAConfig()
        copy_bytes = 1 << 30
    bandwidth = copy_bandwidth_gbs(cuda, copy_bytes, repeat)
    print(f"\ndevice-to-device copy bandwidth (read + write, median): {bandwidth:.0f} GB/s")
    print(f"{'B':>4}{'N':>7}{'partitions':>12}{'ms':>10}{'KV GB/s':>10}{'of copy bw':>12}")
    dtype = np.dtype(np.float32)
    for num_keys in lengths:
        for batch in batches:
            pages_per_seq = -(-num_keys // page)
            shape = (batch * pages_per_seq, page, kv_heads, head_dim)
            table = np.random.default_rng(batch).permutation(shape[0]).reshape(batch, -1)
            lengths_b = np.full(batch, num_keys - 1)
            k = PagedKVCache(device_random(cuda, shape, dtype, 2), lengths_b, table)
            v = PagedKVCache(device_random(cuda, shape, dtype, 3), lengths_b, table)
            q = device_random(cuda, (batch, heads, head_dim), dtype, 4)
            out = cuda.device_array((batch, heads, head_dim), dtype)
            def run(q=q, k=k, v=v, out=out):
                decode_attention(q, k, v, out=out, config=config)

            seconds = timed(cuda, run, repeat)
            kv_bytes = 2 * batch * num_keys * kv_heads * head_dim * dtype.itemsize
            gbs = kv_bytes / seconds / 1e9
            parts = _auto_partitions(cuda, num_keys, batch * kv_heads, config)
            print(f"{batch:>4}{num_keys:>7}{parts:>12}{seconds * 1e3:>10.3f}{gbs:>10.0f}"
                  f"{gbs / bandwidth:>12.0%}")
            del k, v, q, out


def _torch_cuda():
    """torch, where it is installed with CUDA; else ``None``."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def gemm_tflops(torch, size, repeat):
    """A float32 GEMM's rate on the GPU (torch.matmul, TF32 off), in TFLOP/s."""
    torch.backends.cuda.matmul.allow_tf32 = False
    a = torch.randn(size, size, device="cuda")
    b = torch.randn(size, size, device="cuda")
    seconds = timed(torch.cuda, lambda: a @ b, repeat)
    return 2 * size**3 / seconds / 1e12


def benchmark_tiled(cuda, tiny, repeat):
    """Flash prefill and cross attention in float32: TFLOP/s against a GEMM and torch."""
    torch = _torch_cuda()
    if tiny:
        lengths, heads, kv_heads, head_dim = [16], 4, 2, 8
        config = MHAConfig(block_q=2, block_k=4, threads_per_block=32)
    else:
        lengths, heads, kv_heads, head_dim = [2048, 8192], 32, 8, 128
        config = MHAConfig()
    gemm = gemm_tflops(torch, 8192, repeat) if torch is not None else None
    print("\nfloat32 GEMM (torch.matmul): " + (f"{gemm:.1f} TFLOP/s" if gemm else
                                               "not measured (no torch with CUDA)"))
    print(f"{'case':<36}{'ms':>10}{'TFLOP/s':>9}{'of GEMM':>9}{'torch ms':>10}{'ratio':>7}")
    dtype = np.dtype(np.float32)
    for n in lengths:
        q = device_random(cuda, (1, n, heads, head_dim), dtype, 5)
        k = device_random(cuda, (1, n, kv_heads, head_dim), dtype, 6)
        v = device_random(cuda, (1, n, kv_heads, head_dim), dtype, 7)
        rows = [x.reshape(n, x.shape[2], head_dim) for x in (q, k, v)]
        offsets = np.array([0, n])
        flash = partial(numattn.flash_attention_kv_cache, q, k, v, device="cuda",
                        config=config)
        cases = [  # (label, causal, the call)
            (f"flash S=N={n}, causal", True, partial(flash, CausalMask())),
            (f"flash S=N={n}", False, partial(flash, NullMask())),
            (f"cross S=N={n}", False, partial(numattn.cross_attention, rows[0], offsets, n,
                                              rows[1], rows[2], offsets, device="cuda",
                                              config=config)),
        ]
        for label, causal, run in cases:
            seconds = timed(cuda, run, repeat)
            flops = 4 * n * n * heads * head_dim * (0.5 if causal else 1.0)
            rate = flops / seconds / 1e12
            line = (f"{label:<36}{seconds * 1e3:>10.3f}{rate:>9.2f}"
                    f"{(f'{rate / gemm:.0%}' if gemm else '-'):>9}")
            if torch is not None:
                tq, tk, tv = (torch.as_tensor(x, device="cuda").transpose(1, 2)
                              for x in (q, k, v))
                sdpa = partial(torch.nn.functional.scaled_dot_product_attention, tq, tk, tv,
                               is_causal=causal, enable_gqa=True)
                torch_s = timed(torch.cuda, sdpa, repeat)
                line += f"{torch_s * 1e3:>10.3f}{torch_s / seconds:>7.2f}"
            print(line)
        del q, k, v, rows


def _auto_partitions(cuda, num_keys, blocks, config):
    from numattn.kernels.cuda.split_k import _multiprocessors
    from numattn.kernels.shared.partitions import partition_count as _partition_count

    return _partition_count(config.num_partitions, num_keys, blocks,
                            config.block_k, _multiprocessors(cuda))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CUDA simulator)")
    parser.add_argument("--repeat", type=at_least(1), default=None)
    args = parser.parse_args(argv)
    cuda = require_cuda()
    repeat = args.repeat or (1 if args.tiny else 10)
    device = cuda.get_current_device()
    print(f"device: {getattr(device, 'name', device)!s}; "
          f"multiprocessors: {getattr(device, 'MULTIPROCESSOR_COUNT', '?')}")
    t0 = time.perf_counter()
    failures = check(args.tiny) + check_other_operations(args.tiny)
    print(f"check: {'all ok' if not failures else f'{failures} FAILED'} "
          f"({time.perf_counter() - t0:.0f} s)")
    t0 = time.perf_counter()
    benchmark(cuda, args.tiny, repeat)
    benchmark_tiled(cuda, args.tiny, repeat)
    print(f"benchmark: {time.perf_counter() - t0:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
