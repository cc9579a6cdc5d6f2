"""Seeded random cases that combine features: every operation against the reference.

The other modules test each feature on its own.  Here each case draws all of them at
once (mask trees and additive tensors, cache kinds and page sizes, GQA groups, head dims,
dtypes, sinks, scales, partition counts, tile sizes, empty sequences, NaN in unused slots)
so that their interactions are covered too; other cases corrupt one index entry (cache
lengths, page table, offsets), which must be refused before anything is written or be
harmless.  A case is named by its device, operation and seed, which reproduce it:
``pytest "tests/test_random_cases.py::test_random_case[cpu-decode-17]"``.  After a change to
a kernel, run many more: ``NUMATTN_RANDOM_CASES=5000 pytest tests/test_random_cases.py``.
CUDA runs a tenth of the seeds, on tiny shapes (the simulator runs kernels as Python).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import numattn
from numattn import (
    CausalMask,
    ChunkedCausalMask,
    ChunkedMask,
    MaterializedMask,
    MHAConfig,
    NullMask,
    SlidingWindowCausalMask,
    reference,
)

from .conftest import CPU_PATHS, on_devices
from .utils import assert_close, make_kv, randn

SEEDS = range(int(os.environ.get("NUMATTN_RANDOM_CASES", "100")))
CUDA_SEEDS = range(max(1, len(SEEDS) // 10))


class _Draw:
    """Random choices for one case (``small`` keeps shapes tiny for the CUDA simulator)."""

    def __init__(self, seed, small=False):
        self.rng = np.random.default_rng(seed)
        self.small = small

    def pick(self, options):
        return options[int(self.rng.integers(len(options)))]

    def lengths(self, count, high, big_high):
        big = not self.small and self.rng.random() < 0.15
        return self.rng.integers(0, big_high if big else high, count).astype(np.int64)

    def dtype(self):
        return np.dtype(self.pick([np.float32, np.float64]))

    def heads(self):
        kv_heads = self.pick([1, 2] if self.small else [1, 2, 3])
        group = self.pick([1, 2, 3] if self.small else [1, 2, 3, 4, 5, 8])
        head_dim = self.pick([1, 3, 8, 17] if self.small else [1, 3, 8, 16, 17, 64, 128])
        return kv_heads * group, kv_heads, head_dim

    def mask_tree(self, depth=0):
        if depth < 2 and self.rng.random() < 0.3:
            a, b = self.mask_tree(depth + 1), self.mask_tree(depth + 1)
            return a & b if self.rng.random() < 0.5 else a | b
        size = int(self.rng.integers(1, 40))
        return self.pick([NullMask(), CausalMask(), SlidingWindowCausalMask(size),
                          ChunkedMask(size), ChunkedCausalMask(size)])

    def additive(self, shape, dtype):
        t = randn(self.rng, shape, dtype) * dtype.type(self.pick([0.1, 1.0, 5.0]))
        t[self.rng.random(shape) < 0.3] = -np.inf
        return t

    def mask(self, batch, heads, rows, keys, dtype):
        """A mask tree, or an additive tensor (plain or materialized, alone or combined)."""
        r = self.rng.random()
        if r < 0.1 and batch:
            return MaterializedMask(self.additive((batch, heads, rows, keys), dtype))
        if r < 0.15:
            return self.additive((rows, keys), dtype)
        if r < 0.2 and batch:
            return self.mask_tree() & MaterializedMask(self.additive((batch, rows, keys), dtype))
        return self.mask_tree()

    def sinks(self, heads, dtype):
        return randn(self.rng, (heads,), dtype) * dtype.type(3) if self.rng.random() < 0.3 else None

    def config(self):
        if self.small:  # the CUDA simulator runs each thread in Python: few of them
            return MHAConfig(block_k=self.pick([1, 2, 5, 16, 128]), threads_per_block=32)
        if self.rng.random() < 0.4:
            return None
        return MHAConfig(block_q=self.pick([1, 3, 8, 64, 256]),
                         block_k=self.pick([1, 2, 5, 16, 64, 128]))

    def num_partitions(self):
        if self.rng.random() < 0.4:
            return None
        return self.pick([1, 2, 5]) if self.small else int(self.rng.integers(1, 65))

    def cache(self, kind, cache_lengths, kv_lens, kv_heads, head_dim, dtype):
        return make_kv(self.rng, kind, cache_lengths, kv_lens, kv_heads, head_dim, dtype,
                       page_size=self.pick([1, 3, 4, 16, 128]))


def _compare(got, want, dtype):
    for g, w, what in zip(got, want, ("out", "lse")):
        assert_close(g, w, dtype, what=what)


def _decode_case(seed, device="cpu"):
    draw = _Draw(seed, small=device == "cuda")
    dtype = draw.dtype()
    batch = int(draw.rng.integers(0, 3 if draw.small else 5))
    heads, kv_heads, head_dim = draw.heads()
    kind = draw.pick(["dense", "continuous", "paged"])
    cache_lengths = draw.lengths(batch, 20 if draw.small else 60, 3000)
    if kind == "dense":
        cache_lengths[:] = cache_lengths[0] if batch else 0
    k, v = draw.cache(kind, cache_lengths, np.ones(batch, np.int64), kv_heads, head_dim, dtype)
    q = randn(draw.rng, (batch, heads, head_dim), dtype)
    mask = draw.mask(batch, heads, 1, int(cache_lengths.max(initial=-1)) + 1, dtype)
    sinks = draw.sinks(heads, dtype)
    scale = None if draw.rng.random() < 0.7 else draw.pick([0.01, 0.5, 3.0])
    got = numattn.decode_attention(q, k, v, mask, scale, sink_weights=sinks,
                                   num_partitions=draw.num_partitions(), device=device,
                                   return_lse=True, config=draw.config())
    want = reference.decode_attention(q, k, v, mask, scale, sink_weights=sinks,
                                      return_lse=True)
    _compare(got, want, dtype)


def _flash_case(seed, device="cpu"):
    draw = _Draw(seed, small=device == "cuda")
    dtype = draw.dtype()
    batch = int(draw.rng.integers(0, 3 if draw.small else 4))
    heads, kv_heads, head_dim = draw.heads()
    kind = draw.pick(["dense", "continuous", "paged"])
    ragged = kind != "dense" and draw.rng.random() < 0.6
    q_lens = draw.lengths(batch, 6 if draw.small else 12, 40)
    if not ragged:
        q_lens[:] = q_lens[0] if batch else 0
    if kind == "dense":  # plain arrays: every sequence has the same N >= S keys
        cache_lengths = np.zeros(batch, np.int64)
        kv_lens = q_lens + int(draw.rng.integers(0, 20))
    else:
        cache_lengths = draw.lengths(batch, 10 if draw.small else 50, 1500)
        kv_lens = q_lens
    k, v = draw.cache(kind, cache_lengths, kv_lens, kv_heads, head_dim, dtype)
    q_offsets = None
    if ragged:
        q_offsets = np.concatenate([[0], np.cumsum(q_lens)]).astype(draw.pick([np.int32,
                                                                               np.int64]))
        q = randn(draw.rng, (int(q_lens.sum()), heads, head_dim), dtype)
    else:
        q = randn(draw.rng, (batch, int(q_lens[0]) if batch else 0, heads, head_dim), dtype)
    mask = draw.mask(batch, heads, int(q_lens.max(initial=0)),
                     int((cache_lengths + kv_lens).max(initial=0)), dtype)
    sinks = draw.sinks(heads, dtype)
    got = numattn.flash_attention_kv_cache(q, k, v, mask, q_input_row_offsets=q_offsets,
                                           sink_weights=sinks, device=device,
                                           return_lse=True, config=draw.config())
    want = reference.flash_attention_kv_cache(q, k, v, mask, q_input_row_offsets=q_offsets,
                                              sink_weights=sinks, return_lse=True)
    _compare(got, want, dtype)


def _cross_case(seed, device="cpu"):
    draw = _Draw(seed, small=device == "cuda")
    dtype = draw.dtype()
    batch = int(draw.rng.integers(0, 3 if draw.small else 4))
    heads, kv_heads, head_dim = draw.heads()
    kind = draw.pick(["ragged", "continuous", "paged"])
    q_lens = draw.lengths(batch, 6 if draw.small else 10, 30)
    kv_lens = draw.lengths(batch, 10 if draw.small else 20, 300)
    q_offsets = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    kv_offsets = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int64)
    q = randn(draw.rng, (int(q_offsets[-1]), heads, head_dim), dtype)
    if kind == "ragged":
        cache_lengths = np.zeros(batch, np.int64)
        k = randn(draw.rng, (int(kv_offsets[-1]), kv_heads, head_dim), dtype)
        v = randn(draw.rng, (int(kv_offsets[-1]), kv_heads, head_dim), dtype)
    else:
        cache_lengths = draw.lengths(batch, 10 if draw.small else 30, 1000)
        k, v = draw.cache(kind, cache_lengths, kv_lens, kv_heads, head_dim, dtype)
    q_max_seq_len = int(q_lens.max(initial=0)) + int(draw.rng.integers(0, 3))
    mask = draw.mask(batch, heads, q_max_seq_len,
                     int((cache_lengths + kv_lens).max(initial=0)) + 1, dtype)
    got = numattn.cross_attention(q, q_offsets, q_max_seq_len, k, v, kv_offsets, mask,
                                  device=device, return_lse=True, config=draw.config())
    want = reference.cross_attention(q, q_offsets, q_max_seq_len, k, v, kv_offsets, mask,
                                     return_lse=True)
    _compare(got, want, dtype)


#: Values a corrupted index entry takes: negative, past the end, near the int32 and int64
#: limits.
_BAD_INDICES = (-1, -5, 10**5, 2**31, 2**40, 2**62, -(2**62))


def _corrupted_case(seed, device="cpu"):
    """One entry of the cache lengths, the page table or an offset array set to a bad value:
    the call raises ValueError or TypeError and leaves ``out`` as it was, or (when no token
    needs the entry) agrees with the reference."""
    draw = _Draw(seed, small=device == "cuda")
    op = draw.pick(["decode", "flash", "cross"] if device == "cpu" else ["decode", "cross"])
    batch, heads, kv_heads, head_dim = int(draw.rng.integers(1, 4)), 4, 2, 8
    kind = draw.pick(["continuous", "paged"])
    cache_lengths = draw.lengths(batch, 30, 30)
    q_lens = np.ones(batch, np.int64) if op == "decode" else draw.lengths(batch, 5, 5)
    k, v = draw.cache(kind, cache_lengths, q_lens, kv_heads, head_dim, np.float32)
    arrays = {"cache_lengths": k.cache_lengths.copy(), "lookup_table": k.lookup_table.copy(),
              "q_offsets": np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)}
    arrays["kv_offsets"] = arrays["q_offsets"].copy()
    bad = arrays[draw.pick(sorted(arrays))]
    bad[tuple(int(draw.rng.integers(n)) for n in bad.shape)] = draw.pick(_BAD_INDICES)
    try:
        k = type(k)(k.blocks, arrays["cache_lengths"], arrays["lookup_table"])
        v = type(v)(v.blocks, arrays["cache_lengths"], arrays["lookup_table"])
    except (ValueError, TypeError):
        return
    q_offsets, kv_offsets = arrays["q_offsets"], arrays["kv_offsets"]
    q = randn(draw.rng, (batch, heads, head_dim) if op == "decode"
              else (int(q_lens.sum()), heads, head_dim), np.float32)
    out = np.full(q.shape, 7.0, np.float32)

    def call(module, **options):  # numattn (with out=) or its reference
        if op == "decode":
            return module.decode_attention(q, k, v, CausalMask(), **options)
        if op == "flash":
            return module.flash_attention_kv_cache(q, k, v, CausalMask(),
                                                   q_input_row_offsets=q_offsets, **options)
        return module.cross_attention(q, q_offsets, int(q_lens.max()), k, v, kv_offsets,
                                      CausalMask(), **options)

    options = {"out": out} if device == "cpu" else {"out": out, "device": device}
    try:
        got = call(numattn, **options)
    except (ValueError, TypeError):
        assert np.all(out == 7.0), "out written before the error"
        return
    assert_close(got, call(reference), np.float32)


CASES = {"decode": _decode_case, "flash": _flash_case, "cross": _cross_case,
         "corrupted_indices": _corrupted_case}


def _cpu_case(name, seed):
    """A CPU case; those of decode, flash and cross that draw float64 are ``slow`` (large
    ones run on the worker threads: float64 specialisations the fast tier leaves out)."""
    float64 = name != "corrupted_indices" and _Draw(seed).dtype() == np.float64
    return pytest.param(name, seed, marks=pytest.mark.slow if float64 else ())


def _cases(names, cpu):
    """(device, case, seed) for the cases ``names``: every seed on each CPU device of ``cpu``,
    a tenth of them on CUDA."""
    return on_devices([_cpu_case(name, seed) for name in names for seed in SEEDS],
                      [(name, seed) for name in names for seed in CUDA_SEEDS], cpu=cpu)


@pytest.mark.parametrize(("device", "case", "seed"), [
    *_cases(["decode", "corrupted_indices"], cpu=["cpu"]),
    *_cases(["flash", "cross"], cpu=CPU_PATHS),  # through both CPU paths
], indirect=["device"])
def test_random_case(case, seed, device):
    CASES[case](seed, device=device)
