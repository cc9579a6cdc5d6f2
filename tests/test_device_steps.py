"""store_kv and merge_states on the device, and a generation loop that stays there: prefill
into a device cache, store each step's rows and decode, all on CUDA, against the same loop
on the CPU.  Semantics in the simulator (tiny shapes), typing by PTX for a real target."""

from __future__ import annotations

import numpy as np
import pytest

import numattn
from numattn import CausalMask

from .conftest import requires_cuda
from .utils import assert_close, make_cache, randn

CUDA = (pytest.mark.cuda, requires_cuda)


def _cuda():
    from numattn.core.device import get_cuda

    return get_cuda()


@pytest.mark.parametrize("kind", ["continuous", "paged"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.cuda
@requires_cuda
def test_store_kv_on_the_device_writes_what_the_host_writes(kind, dtype, rng):
    cuda = _cuda()
    kb, _, _, _, table = make_cache(rng, kind, [5, 1, 8], 2, 4, dtype, page_size=3)
    lengths = np.array([3, 0, 6])
    cls = numattn.PagedKVCache if kind == "paged" else numattn.ContinuousBatchingKVCache
    host = cls(kb.copy(), lengths, table)
    device = cls(cuda.to_device(kb), lengths, table)
    offsets = np.array([0, 2, 3, 5])
    rows = randn(rng, (5, 2, 4), np.float32)  # converted to the cache's dtype
    numattn.store_kv(host, rows, offsets)
    assert numattn.store_kv(device, rows, offsets) is device  # host rows, copied over
    np.testing.assert_array_equal(device.blocks.copy_to_host(), host.blocks)
    numattn.store_kv(device, cuda.to_device(rows * 2), offsets)  # device rows
    numattn.store_kv(host, rows * 2, offsets)
    np.testing.assert_array_equal(device.blocks.copy_to_host(), host.blocks)


def _awkward_rows(rng, shape, dtype):
    """Rows of every magnitude, with the values rounding finds hard: ties between two
    16- and 8-bit floats, the edges of the subnormals, values past the largest of each
    format, signed zeros and inf."""
    rows = rng.standard_normal(shape) * np.exp(rng.uniform(-25, 25, shape))
    flat = rows.reshape(-1)
    edges = [1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-11, 1 + 2**-4, 1 + 3 * 2**-3, 2**-133,
             2**-149, 2**-24, 2**-25 * 3, 2**-9, 2**-17, 448.0, 460.0, 470.0, 57344.0,
             61440.0, 65520.0, 1e6, -0.0, 0.0, np.inf, -np.inf, 3.0e38]
    flat[:len(edges)] = edges
    flat[len(edges):2 * len(edges)] = np.negative(edges)
    return rows.astype(dtype)


@pytest.mark.parametrize("storage", ["bfloat16", "float16", "float8_e4m3fn", "float8_e5m2",
                                     "float8_e4m3fn+scales", "float8_e5m2+scales",
                                     "int8+scales"])
@pytest.mark.cuda
@requires_cuda
def test_store_kv_rounds_16_and_8_bit_device_caches_as_the_host(storage, rng):
    """16- and 8-bit device caches (with scales where quantized) get the host's bits: rows
    rounded to nearest even as ml_dtypes does, e4m3fn saturated, int8 and scaled float8
    quantized per (row, head); from host rows of several dtypes and device float32 rows."""
    from numattn.core.dtypes import ml_dtype

    cuda = _cuda()
    name, _, scaled = storage.partition("+")
    dtype = np.dtype(np.int8) if name == "int8" else np.dtype(
        np.float16 if name == "float16" else ml_dtype(name))
    pages, page_size, kv_heads, head_dim = 4, 8, 2, 48
    blocks = np.zeros((pages, page_size, kv_heads, head_dim), dtype)
    scales = np.zeros((pages, page_size, kv_heads), np.float32) if scaled else None
    lengths, table = np.array([3, 0]), np.array([[1, 3], [0, 2]])
    offsets = np.array([0, 5, 12])

    def cache(on_device):
        place = cuda.to_device if on_device else np.copy
        return numattn.PagedKVCache(place(blocks), lengths, table,
                                    scales=None if scales is None else place(scales))

    def same(device, host):
        np.testing.assert_array_equal(device.blocks.copy_to_host().view(np.uint8),
                                      host.blocks.view(np.uint8))
        if scaled:
            np.testing.assert_array_equal(device.scales.copy_to_host(), host.scales)

    row_dtypes = [np.float32, ml_dtype("bfloat16")] + ([] if scaled else [np.float64])
    for row_dtype in row_dtypes:
        rows = _awkward_rows(rng, (12, kv_heads, head_dim), np.float64)
        if scaled:  # finite: a row with inf has an inf scale, and inf / inf is NaN
            rows = np.where(np.abs(rows) < 1e30, rows, 0.0)
        rows = rows.astype(row_dtype)
        host, device = cache(False), cache(True)
        with np.errstate(over="ignore", invalid="ignore"):
            numattn.store_kv(host, rows, offsets)
        numattn.store_kv(device, rows, offsets)  # host rows, copied over
        same(device, host)
        if row_dtype == np.float32:
            device = cache(True)
            numattn.store_kv(device, cuda.to_device(rows), offsets)  # device rows
            same(device, host)


@pytest.mark.cuda
@requires_cuda
def test_store_kv_refuses_device_rows_it_cannot_read(rng):
    cuda = _cuda()
    blocks = cuda.to_device(np.zeros((2, 4, 1, 4), np.int8))
    cache = numattn.PagedKVCache(blocks, np.array([0]), np.array([[0, 1]]),
                                 scales=(cuda.to_device(np.ones((2, 4, 1), np.float32))))
    with pytest.raises(TypeError, match="float32 for a cache with scales"):
        numattn.store_kv(cache, cuda.to_device(randn(rng, (1, 1, 4), np.float64)),
                         np.array([0, 1]))
    assert (blocks.copy_to_host() == 0).all()


@pytest.mark.cuda
@requires_cuda
def test_merge_states_on_the_device(rng):
    cuda = _cuda()
    outs = [randn(rng, (2, 3, 4, 8), np.float32) for _ in range(3)]
    lses = [randn(rng, (2, 3, 4), np.float32) for _ in range(3)]
    lses[1][0, 0, 0] = -np.inf  # an empty part
    for part in lses:
        part[1, 2, 3] = -np.inf  # a row empty in every part
    want, want_lse = numattn.merge_states(outs, lses)
    got, lse = numattn.merge_states([cuda.to_device(o) for o in outs[:2]] + outs[2:],
                                    [cuda.to_device(x) for x in lses])
    assert not isinstance(got, np.ndarray)  # the result stays on the device
    assert_close(got.copy_to_host(), want, np.float32)
    got_lse = lse.copy_to_host()
    assert np.array_equal(np.isinf(got_lse), np.isinf(want_lse))
    assert_close(got_lse[np.isfinite(want_lse)], want_lse[np.isfinite(want_lse)], np.float32,
                 what="lse")
    with pytest.raises(TypeError, match="float32 or float64"):
        numattn.merge_states([cuda.to_device(np.zeros((2, 4), np.float16))],
                             [cuda.to_device(np.zeros(2, np.float32))])


@pytest.mark.cuda
@requires_cuda
def test_streams_with_host_results_and_device_parts(rng):
    """Host inputs on a stream come back complete (the call synchronizes before it
    returns); device parts merge on the stream; a plan runs on one."""
    cuda = _cuda()
    stream = cuda.stream()
    q = randn(rng, (5, 2, 4), np.float32)
    kv = randn(rng, (6, 1, 4), np.float32)
    q_offsets, kv_offsets = np.array([0, 2, 5]), np.array([0, 4, 6])
    args = (q, q_offsets, 3, kv, kv, kv_offsets, CausalMask())
    got, lse = numattn.cross_attention(*args, device="cuda", stream=stream, return_lse=True)
    want, want_lse = numattn.cross_attention(*args, return_lse=True)
    assert isinstance(got, np.ndarray)
    assert_close(got, want, np.float32)
    assert_close(lse, want_lse, np.float32, what="lse")
    parts = [cuda.to_device(randn(rng, (3, 2, 4), np.float32)) for _ in range(2)]
    lses = [cuda.to_device(randn(rng, (3, 2), np.float32)) for _ in range(2)]
    out, merged = numattn.merge_states(parts, lses, stream=stream)
    host = numattn.merge_states([p.copy_to_host() for p in parts],
                                [x.copy_to_host() for x in lses])
    stream.synchronize()
    assert_close(out.copy_to_host(), host[0], np.float32)
    assert_close(merged.copy_to_host(), host[1], np.float32, what="lse")
    k, v = (numattn.PagedKVCache(randn(rng, (3, 4, 1, 4), np.float32), np.array([5, 2]),
                                 np.array([[0, 1], [2, 0]])) for _ in range(2))
    plan = numattn.DecodePlan(k, v, CausalMask(), device="cuda")
    q1 = randn(rng, (2, 2, 4), np.float32)
    assert_close(plan.run(q1, k, v, stream=stream), numattn.decode_attention(q1, k, v,
                                                                            CausalMask()),
                 np.float32)
    with pytest.raises(TypeError, match="stream must be a numba.cuda stream"):
        numattn.decode_attention(q1, k, v, device="cuda", stream="stream 1")


def test_a_stream_with_a_call_on_the_cpu_is_refused(rng):
    q = randn(rng, (2, 2, 4), np.float32)
    kv = randn(rng, (2, 3, 1, 4), np.float32)
    with pytest.raises(ValueError, match="this call runs on the CPU"):
        numattn.decode_attention(q, kv, kv, stream=object())
    cache = numattn.PagedKVCache(np.zeros((2, 4, 1, 4), np.float32), np.array([0]),
                                 np.array([[0, 1]]))
    with pytest.raises(ValueError, match="this call runs on the CPU"):
        numattn.store_kv(cache, randn(rng, (1, 1, 4), np.float32), np.array([0, 1]),
                         stream=object())
    assert not cache.blocks.any()
    with pytest.raises(ValueError, match="this call runs on the CPU"):
        numattn.merge_states([q, q], [q[..., 0], q[..., 0]], stream=object())


@pytest.mark.parametrize("on_stream", [False, True])
@pytest.mark.cuda
@requires_cuda
def test_a_generation_loop_stays_on_the_device(rng, on_stream):
    """Prefill a ragged batch into a paged device cache (store_kv + flash), then decode three
    tokens (store_kv + decode) with device queries: the same numbers as on the CPU.  With
    ``on_stream`` every call is queued on one stream, synchronized only to read results."""
    cuda = _cuda()
    stream = cuda.stream() if on_stream else None
    heads, kv_heads, head_dim, page_size = 2, 1, 4, 4
    prompt_lens = np.array([3, 5])
    table = np.array([[0, 2, 4], [1, 3, 5]])
    blocks = np.full((6, page_size, kv_heads, head_dim), np.nan, np.float32)
    caches = {}
    for where in ("cpu", "cuda"):
        kb = blocks.copy() if where == "cpu" else cuda.to_device(blocks)
        vb = blocks.copy() if where == "cpu" else cuda.to_device(blocks)
        caches[where] = [kb, vb]
    prompt = randn(rng, (int(prompt_lens.sum()), heads, head_dim), np.float32)
    new_k = randn(rng, (int(prompt_lens.sum()), kv_heads, head_dim), np.float32)
    new_v = randn(rng, (int(prompt_lens.sum()), kv_heads, head_dim), np.float32)
    offsets = np.array([0, 3, 8])
    steps = [(randn(rng, (2, heads, head_dim), np.float32),
              randn(rng, (2, kv_heads, head_dim), np.float32),
              randn(rng, (2, kv_heads, head_dim), np.float32)) for _ in range(3)]
    results = {}
    for where, (kb, vb) in caches.items():
        on = {} if where == "cpu" else {"stream": stream}

        def to_host(out, where=where):
            if where == "cpu":
                return out
            host = out.copy_to_host(stream=stream or 0)
            if stream is not None:
                stream.synchronize()
            return host

        lengths = np.zeros(2, np.int64)
        k = numattn.PagedKVCache(kb, lengths, table)
        v = numattn.PagedKVCache(vb, lengths, table)
        numattn.store_kv(k, new_k, offsets, **on)
        numattn.store_kv(v, new_v, offsets, **on)
        q = prompt if where == "cpu" else cuda.to_device(prompt)
        out = numattn.flash_attention_kv_cache(q, k, v, CausalMask(), q_input_row_offsets=offsets,
                                               **on)
        outs = [to_host(out)]
        lengths = prompt_lens.copy()
        for q1, k1, v1 in steps:
            k = numattn.PagedKVCache(kb, lengths, table)
            v = numattn.PagedKVCache(vb, lengths, table)
            one = np.array([0, 1, 2])
            numattn.store_kv(k, k1 if where == "cpu" else cuda.to_device(k1), one, **on)
            numattn.store_kv(v, v1 if where == "cpu" else cuda.to_device(v1), one, **on)
            q1 = q1 if where == "cpu" else cuda.to_device(q1)
            out = numattn.decode_attention(q1, k, v, CausalMask(), **on)
            outs.append(to_host(out))
            lengths = lengths + 1
        results[where] = outs
    for cpu_out, cuda_out in zip(results["cpu"], results["cuda"]):
        assert_close(cuda_out, cpu_out, np.float32)


def test_merge_and_store_kernels_compile_to_ptx(ptx_compiler):
    from numba import types

    from numattn.kernels.cuda import merge, store

    for real in (types.float32, types.float64):
        ptx_compiler(merge._merge_cuda_kernel,
                     (real[:, :, :, ::1], real[:, :, ::1], real[:, :, ::1], real[::1]))
        ptx_compiler(store._store_cuda_kernel,
                     (real[:, :, :, ::1], types.int64[::1], types.int64[::1],
                      types.float32[:, :, ::1]))
    # 16- and 8-bit caches: their kernel views (bfloat16, float16, float8, int8)
    for view in (types.uint16, types.int16, types.uint8, types.int8):
        for real in (types.float32, types.float64):
            ptx_compiler(store._store_encoded_cuda_kernel,
                         (view[:, :, :, ::1], types.int64[::1], types.int64[::1],
                          real[:, :, ::1], types.int64, types.float32[:, :, ::1],
                          types.boolean, types.float32, types.boolean, types.float32))
