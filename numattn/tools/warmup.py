"""``python -m numattn warmup``: compile the kernels ahead, into Numba's disk cache.

A process's first call of an operation compiles its CPU kernels (seconds to a minute each)
unless an earlier process left them in the disk cache (``NUMBA_CACHE_DIR``).  Warmup makes
small calls of every operation over every kind of K/V input and mask, in each dtype, on the
serial and the parallel paths (tiny problems run on the calling thread, larger ones on the
worker threads, with kernels of their own), so that an image build or a CI cache step can
compile them all once.  With ``cuda`` it also launches the CUDA kernels of decode and cross
attention where CUDA is available; numattn does not keep those on disk, so that checks
that they compile here and warms only the running process.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from .. import (
    CausalMask,
    ChunkedCausalMask,
    ChunkedMask,
    ContinuousBatchingKVCache,
    MaterializedMask,
    MHAConfig,
    NullMask,
    PagedKVCache,
    SlidingWindowCausalMask,
    cross_attention,
    decode_attention,
    flash_attention_kv_cache,
    merge_states,
    store_kv,
)
from ..core import device as _device
from ..core.jit import CACHE

__all__ = ["progress_bar", "run_warmup", "warmup_calls"]

#: The K/V inputs warmup covers: plain arrays (dense for padded queries, ragged rows for
#: ragged ones) and the two cache kinds.
KV_KINDS = ("dense", "ragged", "continuous", "paged")


def _masks(batch, heads, rows, keys, dtype, rng):
    """One mask of every kind: the mask objects, their combinations, and additive tensors
    of each rank, plain and as a MaterializedMask combined with an object."""
    bias = rng.standard_normal((batch, heads, rows, keys)).astype(dtype)
    return [
        NullMask(), CausalMask(), SlidingWindowCausalMask(3), ChunkedMask(4),
        ChunkedCausalMask(4), CausalMask() & SlidingWindowCausalMask(5),
        ChunkedMask(3) | CausalMask(), bias[0, 0], bias[:, 0], bias,
        CausalMask() & MaterializedMask(bias),
    ]


def _kv(kind, rng, dtype, batch, cache_len, new_len, kv_heads, head_dim, page_size=4):
    """``(k, v)`` of one kind holding ``cache_len + new_len`` keys per sequence (plain
    arrays: ``new_len`` rows, no cache)."""
    if kind == "dense":
        shape = (batch, new_len, kv_heads, head_dim)
        return tuple(rng.standard_normal(shape).astype(dtype) for _ in range(2))
    if kind == "ragged":
        shape = (batch * new_len, kv_heads, head_dim)
        return tuple(rng.standard_normal(shape).astype(dtype) for _ in range(2))
    lengths = np.full(batch, cache_len, dtype=np.int64)
    keys = cache_len + new_len
    if kind == "continuous":
        shape = (batch + 1, keys + 1, kv_heads, head_dim)
        table = rng.permutation(batch + 1)[:batch]
        return tuple(ContinuousBatchingKVCache(rng.standard_normal(shape).astype(dtype),
                                               lengths, table) for _ in range(2))
    pages_per_seq = -(-keys // page_size)
    num_pages = batch * pages_per_seq + 1
    shape = (num_pages, page_size, kv_heads, head_dim)
    table = rng.permutation(num_pages)[: batch * pages_per_seq].reshape(batch, pages_per_seq)
    return tuple(PagedKVCache(rng.standard_normal(shape).astype(dtype), lengths, table)
                 for _ in range(2))


def _offsets(batch, length):
    return np.arange(batch + 1, dtype=np.int64) * length


def _flash_call(kind, rng, dtype, batch, cache_len, q_len, heads, kv_heads, head_dim, mask,
                config=None):
    """A flash call over ``kind`` (padded queries with dense K/V, ragged ones otherwise)."""
    new_len = q_len if kind != "dense" else cache_len + q_len
    k, v = _kv(kind, rng, dtype, batch, cache_len, new_len, kv_heads, head_dim)
    sinks = rng.standard_normal(heads).astype(dtype)
    if kind == "dense":
        q = rng.standard_normal((batch, q_len, heads, head_dim)).astype(dtype)
        return lambda: flash_attention_kv_cache(q, k, v, mask, sink_weights=sinks,
                                                return_lse=True, config=config)
    q = rng.standard_normal((batch * q_len, heads, head_dim)).astype(dtype)
    offsets = _offsets(batch, q_len)
    return lambda: flash_attention_kv_cache(q, k, v, mask, q_input_row_offsets=offsets,
                                            sink_weights=sinks, return_lse=True,
                                            config=config)


def _decode_call(kind, rng, dtype, batch, cache_len, heads, kv_heads, head_dim, mask,
                 device="cpu", num_partitions=None, config=None):
    k, v = _kv("dense" if kind == "dense" else kind, rng, dtype, batch, cache_len,
               1 if kind != "dense" else cache_len + 1, kv_heads, head_dim)
    q = rng.standard_normal((batch, heads, head_dim)).astype(dtype)
    sinks = rng.standard_normal(heads).astype(dtype)
    return lambda: decode_attention(q, k, v, mask, sink_weights=sinks, device=device,
                                    num_partitions=num_partitions, return_lse=True,
                                    config=config)


def _cross_call(kind, rng, dtype, batch, cache_len, q_len, kv_len, heads, kv_heads, head_dim,
                mask, device="cpu"):
    k, v = _kv(kind, rng, dtype, batch, cache_len, kv_len, kv_heads, head_dim)
    q = rng.standard_normal((batch * q_len, heads, head_dim)).astype(dtype)
    return lambda: cross_attention(q, _offsets(batch, q_len), q_len, k, v,
                                   _offsets(batch, kv_len), mask, device=device,
                                   return_lse=True)


def warmup_calls(dtypes=("float32", "float64"), cuda=False, seed=0):
    """The calls warmup makes, as ``(label, call)`` pairs (nothing runs until called).

    Parameters
    ----------
    dtypes : sequence of str
        Compute dtypes to compile for (``"float32"``, ``"float64"``).
    cuda : bool
        Add CUDA launches of decode and cross attention (only where CUDA is available).
    seed : int
        Seed of the random inputs.

    Returns
    -------
    list of (str, callable)
    """
    rng = np.random.default_rng(seed)
    calls = []
    b, h, hkv, d = 2, 4, 2, 8  # small: runs on the calling thread
    for name in dtypes:
        dtype = np.dtype(name)
        for kind in KV_KINDS:
            q_len, cache_len = 5, 0 if kind in ("dense", "ragged") else 6
            for i, mask in enumerate(_masks(b, h, q_len, cache_len + q_len, dtype, rng)):
                calls.append((f"flash {kind} mask {i} {name}",
                              _flash_call(kind, rng, dtype, b, cache_len, q_len, h, hkv, d,
                                          mask)))
            if kind != "ragged":
                for i, mask in enumerate(_masks(b, h, 1, 7, dtype, rng)):
                    calls.append((f"decode {kind} mask {i} {name}",
                                  _decode_call(kind, rng, dtype, b, 6, h, hkv, d, mask)))
            if kind != "dense":
                for i, mask in enumerate(_masks(b, h, 3, 6 + 4, dtype, rng)):
                    calls.append((f"cross {kind} mask {i} {name}",
                                  _cross_call(kind, rng, dtype, b, 0 if kind == "ragged" else 6,
                                              3, 4, h, hkv, d, mask)))
            # large enough for the worker threads (and, for flash, both of its CPU paths:
            # a long prefill and a few query rows over a long cache)
            big = (4, 16, 4, 64)
            calls.append((f"flash {kind} large prefill {name}",
                          _flash_call(kind, rng, dtype, 2, 0 if kind in ("dense", "ragged")
                                      else 64, 96, *big[1:], CausalMask())))
            if kind != "ragged":  # plain ragged rows hold no cache before the new rows
                calls.append((f"flash {kind} large few rows {name}",
                              _flash_call(kind, rng, dtype, 4, 1024, 4, *big[1:], CausalMask(),
                                          MHAConfig(block_k=8))))
            if kind != "ragged":
                calls.append((f"decode {kind} large {name}",
                              _decode_call(kind, rng, dtype, 4, 1024, *big[1:], CausalMask(),
                                           num_partitions=128, config=MHAConfig(block_k=8))))
            if kind != "dense":
                calls.append((f"cross {kind} large {name}",
                              _cross_call(kind, rng, dtype, 2, 0 if kind == "ragged" else 64,
                                          96, 96, *big[1:], CausalMask())))
        for parts, rows in ((2, 3), (4, 16384)):  # serial and parallel merges
            outs = rng.standard_normal((parts, rows, d)).astype(dtype)
            lses = rng.standard_normal((parts, rows)).astype(dtype)
            calls.append((f"merge_states {parts}x{rows} {name}",
                          lambda o=outs, x=lses: merge_states(o, x)))
        for kind in ("continuous", "paged"):
            k, _ = _kv(kind, rng, dtype, b, 2, 3, hkv, d)
            rows = rng.standard_normal((2 * 3, hkv, d)).astype(dtype)
            calls.append((f"store_kv {kind} {name}",
                          lambda c=k, r=rows: store_kv(c, r, _offsets(2, 3))))
        if cuda:
            for kind in ("dense", "continuous", "paged"):
                calls.append((f"decode cuda {kind} {name}",
                              _decode_call(kind, rng, dtype, b, 6, h, hkv, d, CausalMask(),
                                           device="cuda", num_partitions=2)))
            for kind in ("ragged", "continuous", "paged"):
                calls.append((f"cross cuda {kind} {name}",
                              _cross_call(kind, rng, dtype, b, 0 if kind == "ragged" else 6,
                                          3, 4, h, hkv, d, CausalMask(), device="cuda")))
    return calls


def run_warmup(dtypes=("float32", "float64"), cuda=False, progress=None):
    """Make every call of :func:`warmup_calls`, compiling what is not cached yet.

    Parameters
    ----------
    dtypes : sequence of str
        Compute dtypes (``"float32"``, ``"float64"``).
    cuda : bool
        Also launch the CUDA kernels; ``numattn.CudaUnavailableError`` where there is no
        CUDA.
    progress : callable, optional
        ``progress(done, total, label)`` after each call.

    Returns
    -------
    calls : int
        Calls made.
    seconds : float
        Wall time.
    """
    if cuda:
        _device.require_cuda()
    calls = warmup_calls(dtypes, cuda)
    start = time.perf_counter()
    for i, (label, call) in enumerate(calls):
        call()
        if progress is not None:
            progress(i + 1, len(calls), label)
    return len(calls), time.perf_counter() - start


def progress_bar(stream=None, width=30):
    """A ``progress(done, total, label)`` that draws a text bar on ``stream`` (stderr):
    redrawn in place on a terminal, one line per tenth of the way elsewhere (logs)."""

    def progress(done, total, label):
        out = sys.stderr if stream is None else stream
        bar = f"warmup [{'#' * (width * done // total):<{width}}] {done}/{total}"
        if out.isatty():
            print(f"\r{bar} {label[:40]:<40}", end="" if done < total else "\n", file=out,
                  flush=True)
        elif done == total or 10 * done // total != 10 * (done - 1) // total:
            print(f"{bar} {label}", file=out, flush=True)

    return progress


def cache_location():
    """Where Numba keeps the compiled kernels, in words."""
    where = os.environ.get("NUMBA_CACHE_DIR")
    return where if where else "__pycache__ folders next to numattn's sources"


def main(args):
    """The ``warmup`` command: returns the exit status."""
    if not CACHE:
        print("numattn warmup: NUMATTN_CACHE=0 switches the disk cache off; nothing would be "
              "kept", file=sys.stderr)
        return 1
    if args.cuda and not _device.is_available():
        print("numattn warmup: --cuda asked for, but CUDA is not available here (no GPU, no "
              "numba-cuda, and NUMBA_ENABLE_CUDASIM is not set)", file=sys.stderr)
        return 1
    calls, seconds = run_warmup(args.dtype, args.cuda, progress_bar())
    print(f"warmup: {calls} calls ({', '.join(args.dtype)}{', CUDA' if args.cuda else ''}) in "
          f"{seconds:.1f} s; CPU kernels cached in {cache_location()}")
    return 0
