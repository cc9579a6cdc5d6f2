"""decode_attention through CUDA: semantics in the simulator (tiny shapes), and every CUDA
kernel of numattn.decode compiled to PTX for cc=(9, 0) without a GPU."""

from __future__ import annotations

import numpy as np
import pytest

import numattn
from numattn import CausalMask, MaterializedMask, MHAConfig, SlidingWindowCausalMask
from numattn.decode import decode_attention
from numattn.kernels.cuda import split_k as decode_module

from .conftest import requires_cuda
from .utils import CACHE_KINDS, assert_close, make_kv, randn

#: Small tiles and blocks keep the simulator quick while crossing several tiles.
TINY = MHAConfig(block_k=4, threads_per_block=32)


@requires_cuda
@pytest.mark.parametrize("kind", CACHE_KINDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cuda_matches_reference(kind, dtype, rng):
    lengths = [9, 9] if kind == "dense" else [0, 9]  # cache length 0; page boundaries
    # pages of 3 against tiles of 4: tiles cross pages
    k, v = make_kv(rng, kind, lengths, [1, 1], 2, 5, dtype, page_size=3)
    q = randn(rng, (2, 6, 5), dtype)  # GQA group 3
    sinks = randn(rng, (6,), dtype)
    for mask, parts in [(CausalMask(), 1), (SlidingWindowCausalMask(3), 3)]:
        ref_out, ref_lse = numattn.reference.decode_attention(q, k, v, mask, sink_weights=sinks,
                                                              return_lse=True)
        out, lse = decode_attention(q, k, v, mask, sink_weights=sinks, num_partitions=parts,
                                    device="cuda", return_lse=True, config=TINY)
        assert isinstance(out, np.ndarray) and out.dtype == dtype
        assert_close(out, ref_out, dtype)
        assert_close(lse, ref_lse, dtype)


@requires_cuda
def test_cuda_additive_mask_partitions_and_out(rng):
    dtype = np.float32
    k, v = make_kv(rng, "paged", [6, 13], [1, 1], 1, 4, dtype, page_size=4)
    q = randn(rng, (2, 2, 4), dtype)
    bias = randn(rng, (2, 2, 1, 14), dtype)
    bias[..., ::4] = -np.inf
    bias[0] = -np.inf  # sequence 0 sees no key: 0 and lse -inf
    mask = MaterializedMask(bias)
    ref_out, ref_lse = numattn.reference.decode_attention(q, k, v, mask, return_lse=True)
    out = np.full((2, 2, 4), 9.0, dtype)
    for parts in (2, 5):
        result, lse = decode_attention(q, k, v, mask, num_partitions=parts, device="cuda",
                                       out=out, return_lse=True, config=TINY)
        assert result is out
        assert_close(out, ref_out, dtype)
        assert_close(lse, ref_lse, dtype)
        assert np.all(out[0] == 0) and np.all(lse[0] == -np.inf)


@requires_cuda
def test_cuda_device_arrays_in_place_and_head_passes(rng, monkeypatch):
    """Device inputs stay on the device; a tiny shared-memory budget forces one query head
    per pass of a block (the path for very large GQA groups)."""
    from numba import cuda

    dtype = np.float64
    k, v = make_kv(rng, "paged", [2, 7], [1, 1], 1, 3, dtype, page_size=4)
    q = randn(rng, (2, 3, 3), dtype)
    ref = numattn.reference.decode_attention(q, k, v, CausalMask())
    per_head = (TINY.block_k + TINY.threads_per_block + 1) * 8
    monkeypatch.setattr(decode_module, "CUDA_SHARED_BYTES", per_head)
    dk = numattn.PagedKVCache(cuda.to_device(k.blocks), k.cache_lengths, k.lookup_table)
    dv = numattn.PagedKVCache(cuda.to_device(v.blocks), v.cache_lengths, v.lookup_table)
    d_out = cuda.device_array((2, 3, 3), dtype)
    result = decode_attention(cuda.to_device(q), dk, dv, CausalMask(), out=d_out,
                              num_partitions=2, config=TINY)
    assert result is d_out
    assert_close(d_out.copy_to_host(), ref, dtype)
    # cache lengths, page table and sinks as device arrays too (read back to the host for
    # the checks; the simulator's arrays have no __cuda_array_interface__)
    sinks = randn(rng, (3,), dtype)
    ref = numattn.reference.decode_attention(q, k, v, CausalMask(), sink_weights=sinks)
    d_lengths, d_table = cuda.to_device(k.cache_lengths), cuda.to_device(k.lookup_table)
    dk = numattn.PagedKVCache(cuda.to_device(k.blocks), d_lengths, d_table)
    dv = numattn.PagedKVCache(cuda.to_device(v.blocks), d_lengths, d_table)
    result = decode_attention(cuda.to_device(q), dk, dv, CausalMask(),
                              sink_weights=cuda.to_device(sinks), config=TINY)
    assert_close(result.copy_to_host(), ref, dtype)


@requires_cuda
def test_cuda_groups_larger_than_a_block_of_threads(rng):
    """A KV head's query heads go through a block at most ``threads_per_block`` at a time:
    with 34 query heads per KV head and 32 threads, heads 32 and 33 were never started
    (garbage there, in the order of 1e300)."""
    dtype = np.float64
    k, v = make_kv(rng, "paged", [5, 0], [1, 1], 1, 2, dtype, page_size=4)
    q = randn(rng, (2, 34, 2), dtype)
    ref, ref_lse = numattn.reference.decode_attention(q, k, v, CausalMask(), return_lse=True)
    out, lse = decode_attention(q, k, v, CausalMask(), device="cuda", return_lse=True,
                                num_partitions=2, config=TINY)
    assert_close(out, ref, dtype)
    assert_close(lse, ref_lse, dtype, what="lse")


@requires_cuda
def test_cuda_nan_in_a_visible_value_propagates_when_its_weight_underflows(rng):
    """As on the CPU: a visible key of weight exactly 0 adds 0 * V (NaN stays NaN), while
    keys hidden by the window or by a -inf additive entry hold NaN and never show."""
    q = np.zeros((1, 1, 4))
    q[0, 0, 0] = 1
    k = randn(rng, (1, 8, 1, 4), np.float64) * 0.1
    k[0, 3, 0, 0] = -1e5  # weight e^(s - M) == 0 exactly
    v = randn(rng, (1, 8, 1, 4), np.float64)
    v[0, 3, 0, 1] = np.nan
    k[0, 0] = v[0, 0] = np.nan  # hidden by the window
    k[0, 5] = v[0, 5] = np.nan  # hidden by the additive tensor
    bias = np.zeros((1, 1, 1, 8))
    bias[..., 5] = -np.inf
    for mask in (SlidingWindowCausalMask(7) & MaterializedMask(bias),):
        out = decode_attention(q, k, v, mask, scale=1.0, num_partitions=2, device="cuda",
                               config=TINY)
        assert np.isnan(out[0, 0, 1]) and np.isfinite(out[0, 0, [0, 2, 3]]).all()


@requires_cuda
def test_cuda_nan_in_unused_slots_and_repeatability(rng):
    dtype = np.float32
    k, v = make_kv(rng, "continuous", [3, 10], [1, 1], 1, 4, dtype, fill=np.nan)
    q = randn(rng, (2, 1, 4), dtype)
    first = decode_attention(q, k, v, num_partitions=3, device="cuda", config=TINY)
    again = decode_attention(q, k, v, num_partitions=3, device="cuda", config=TINY)
    assert np.all(np.isfinite(first)) and np.array_equal(first, again)
    assert_close(first, numattn.reference.decode_attention(q, k, v), dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_every_cuda_kernel_compiles_to_ptx(ptx_compiler, dtype):
    from numba import types

    real = getattr(types, dtype)

    def arr(ndim, of=real):
        return types.Array(of, ndim, "C")

    index = types.int64
    partitions = (
        arr(3), arr(4), arr(4), index, arr(2, index), arr(1, index), arr(1, index),
        arr(2, index), arr(4), types.boolean, real, index, index, index, arr(3), arr(3), arr(4),
    )
    ptx_compiler(decode_module._decode_partitions_cuda, partitions)
    reduce = (arr(3), arr(3), arr(4), arr(1), types.boolean, arr(3), arr(2))
    ptx_compiler(decode_module._decode_reduce_cuda, reduce)


@requires_cuda
def test_gpu_check_script_runs_end_to_end(capsys):
    """benchmarks/gpu_check.py, the one command to run when a GPU is lent, gets through its
    check and its benchmark table (tiny shapes here), and counts partitions as integers for
    the full-size shapes too."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    assert gpu_check.main(["--tiny"]) == 0
    printed = capsys.readouterr().out
    assert "check: all ok" in printed and "of copy bw" in printed
    from numattn.core.device import require_cuda

    for num_keys in (4096, 32768):
        parts = gpu_check._auto_partitions(require_cuda(), num_keys, 8 * 8, MHAConfig())
        assert type(parts) is int and parts >= 1
