"""16- and 8-bit storage: every operation, cache kind, mask, sinks and GQA group against the
float64 reference computed from the *stored* values, for every dtype pair; store_kv's
rounding bit for bit against ml_dtypes; arrays from other libraries read in place.

Tolerances go by the output's dtype (:data:`OUT_TOL`): float32 results are as close as with
float32 caches (the kernels compute in float32 from the exact stored values), 16-bit
results are off by their own rounding.  Unused slots hold NaN (float formats) or garbage
with NaN scales (quantized formats), which must never reach the output.
"""

from __future__ import annotations

import numpy as np
import pytest

import numattn
from numattn import (
    CausalMask,
    ChunkedCausalMask,
    ContinuousBatchingKVCache,
    DecodePlan,
    FlashPlan,
    NullMask,
    PagedKVCache,
    SlidingWindowCausalMask,
    reference,
)
from numattn.core import dtypes

from .conftest import CPU_PATHS, CUDA_MARKS, use_device
from .utils import assert_close, make_cache, randn

ml_dtypes = pytest.importorskip("ml_dtypes")

#: K/V storage: (dtype name, with scales)
STORAGES = [("float32", False), ("float64", False), ("float16", False), ("bfloat16", False),
            ("float8_e4m3fn", False), ("float8_e5m2", False), ("float8_e4m3fn", True),
            ("float8_e5m2", True), ("int8", True)]
Q_DTYPES = ["float32", "bfloat16", "float16", "float64"]
#: tolerance of results by their dtype (relative to 1 + |expected|)
OUT_TOL = {"float64": 2e-4, "float32": 2e-4, "float16": 2e-3, "bfloat16": 1.6e-2}
MASKS = [NullMask(), CausalMask(), SlidingWindowCausalMask(3), ChunkedCausalMask(4),
         CausalMask() | ChunkedCausalMask(2)]


def dtype_of(name):
    return dtypes.ml_dtype(name) if name in ("bfloat16", "float8_e4m3fn",
                                             "float8_e5m2") else np.dtype(name)


def stored(blocks, name, scaled, rng):
    """``blocks`` (float32 with NaN in unused slots) in the storage ``name``: float formats
    keep the NaN; quantized ones hold garbage there with NaN scales."""
    unused = np.isnan(blocks).any(axis=-1)
    if not scaled:
        return blocks.astype(dtype_of(name)), None
    limit = {"int8": 127.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}[name]
    scales = (np.abs(np.nan_to_num(blocks)).max(axis=-1) / limit).astype(np.float32)
    scales[scales == 0] = 1
    values = np.nan_to_num(blocks) / scales[..., None]
    quantized = (np.clip(np.rint(values), -127, 127).astype(np.int8) if name == "int8"
                 else values.astype(dtype_of(name)))
    garbage = rng.integers(-128, 128, quantized.shape, dtype=np.int8).view(quantized.dtype)
    quantized[unused] = garbage[unused]
    scales[unused] = np.nan
    return quantized, scales


def make_step(rng, kind, cache_lengths, kv_lens, hkv, d, storage, *, page_size=4):
    """K/V of one step in ``storage`` (``(name, scaled)``): caches of ``kind`` holding
    ``cache_lengths + kv_lens`` tokens (dense: plain arrays of floats)."""
    name, scaled = storage
    total = np.asarray(cache_lengths) + np.asarray(kv_lens)
    if kind == "dense":
        k, v, _, _ = make_cache(rng, "dense", total, hkv, d, np.float32)
        return k.astype(dtype_of(name)), v.astype(dtype_of(name))
    kb, vb, _, _, table = make_cache(rng, kind, total, hkv, d, np.float32,
                                     page_size=page_size)
    kb, k_scales = stored(kb, name, scaled, rng)
    vb, v_scales = stored(vb, name, scaled, rng)
    cls = PagedKVCache if kind == "paged" else ContinuousBatchingKVCache
    lengths = np.asarray(cache_lengths, dtype=np.int64)
    return cls(kb, lengths, table, k_scales), cls(vb, lengths, table, v_scales)


def storage_id(storage):
    return storage[0] + ("+scales" if storage[1] else "")


def kinds_for(storage):
    """Plain arrays carry no scales: quantized storage only in caches."""
    return ("continuous", "paged") if storage[1] else ("dense", "continuous", "paged")


def check(out, lse, ref_out, ref_lse, q_name, what):
    assert out.dtype == dtype_of(q_name), what
    assert_close(out.astype(np.float64), ref_out, np.float64, tol=OUT_TOL[q_name], what=what)
    if lse is not None:
        assert lse.dtype == dtypes.lse_dtype(dtype_of(q_name)), what
        assert_close(lse, ref_lse, np.float64, tol=2e-4, what=what + " lse")


# --------------------------------------------------------------------------------------
# The operations.
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", CPU_PATHS)
@pytest.mark.parametrize("storage", STORAGES, ids=storage_id)
@pytest.mark.parametrize("q_name", Q_DTYPES)
def test_flash_every_dtype_pair(path, storage, q_name, rng, monkeypatch):
    use_device(path, monkeypatch)  # through the decode kernels, then the flash kernel
    for kind in kinds_for(storage):
        for group in (1, 4):
            hkv, d = 2, 16
            k, v = make_step(rng, kind, [3, 6] if kind != "dense" else [0, 0], [5, 5], hkv,
                             d, storage)
            q = randn(rng, (2, 5, hkv * group, d), np.float32).astype(dtype_of(q_name))
            sinks = randn(rng, hkv * group, np.float32)
            for mask in MASKS:
                what = f"{kind} {storage_id(storage)} q {q_name} group {group} {mask}"
                out, lse = numattn.flash_attention_kv_cache(
                    q, k, v, mask, sink_weights=sinks, return_lse=True)
                ref = reference.flash_attention_kv_cache(q, k, v, mask, sink_weights=sinks,
                                                         return_lse=True)
                check(out, lse, *ref, q_name, what)


@pytest.mark.parametrize("storage", STORAGES, ids=storage_id)
@pytest.mark.parametrize("q_name", Q_DTYPES)
def test_decode_every_dtype_pair(storage, q_name, rng):
    for kind in kinds_for(storage):
        for group in (1, 3, 4):
            hkv, d = 2, 40  # a vector tail
            lengths = [0, 9, 33] if kind != "dense" else [0, 0, 0]
            k, v = make_step(rng, kind, lengths, [1, 1, 1] if kind != "dense" else [37] * 3,
                             hkv, d, storage)
            q = randn(rng, (3, hkv * group, d), np.float32).astype(dtype_of(q_name))
            for mask in (NullMask(), SlidingWindowCausalMask(5), ChunkedCausalMask(8)):
                for parts in (1, 3):
                    what = f"{kind} {storage_id(storage)} q {q_name} g{group} {mask} P{parts}"
                    out, lse = numattn.decode_attention(q, k, v, mask, num_partitions=parts,
                                                        return_lse=True)
                    ref = reference.decode_attention(q, k, v, mask, return_lse=True)
                    check(out, lse, *ref, q_name, what)


@pytest.mark.parametrize("storage", STORAGES, ids=storage_id)
def test_decode_long_caches_take_the_vector_paths(storage, rng):
    """Tiles of many keys, all visible (the whole-tile and block sums) and partly masked."""
    k, v = make_step(rng, "paged", [300, 517], [1, 1], 2, 64, storage, page_size=32)
    q = randn(rng, (2, 8, 64), np.float32)
    for mask in (NullMask(), SlidingWindowCausalMask(200)):
        out = numattn.decode_attention(q, k, v, mask)
        assert_close(out, reference.decode_attention(q, k, v, mask), np.float32,
                     what=f"{storage_id(storage)} {mask}")


@pytest.mark.parametrize("storage", [("float32", False), ("bfloat16", False), ("int8", True)],
                         ids=storage_id)
def test_tiles_the_mask_cuts_go_block_by_block(storage, rng, monkeypatch):
    """A tile of several blocks that the mask cuts is computed block_k keys at a time (its
    hidden blocks skipped), right as tiles of one block are, with windows that start and
    end inside tiles (NaN in the slots past each sequence)."""
    from numattn.kernels.cpu import split_k

    k, v = make_step(rng, "paged", [300, 0, 129, 77], [1, 1, 1, 1], 2, 16, storage,
                     page_size=16)
    q = randn(rng, (4, 8, 16), np.float32)
    mask = SlidingWindowCausalMask(37)
    want = reference.decode_attention(q, k, v, mask)
    for tile_keys in (4, 32):  # one block of block_k=4, then eight
        monkeypatch.setattr(split_k, "_cpu_tile_keys",
                            lambda layout, block_k, tile_keys=tile_keys: tile_keys)
        got = numattn.decode_attention(q, k, v, mask, config=numattn.MHAConfig(block_k=4))
        assert_close(got, want, np.float32, what=f"{storage_id(storage)} tiles {tile_keys}")


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_cross_attention_reads_stored_kv(name, rng):
    """Plain K/V rows (which carry no scales) of every unscaled format."""
    q = randn(rng, (7, 4, 16), np.float32)
    kv = randn(rng, (2, 9, 2, 16), np.float32).astype(dtype_of(name))
    q_offsets = np.array([0, 3, 7])
    kv_offsets = np.array([0, 5, 9])
    k, v = kv[0], kv[1]
    out, lse = numattn.cross_attention(q, q_offsets, 4, k, v, kv_offsets, return_lse=True)
    ref = reference.cross_attention(q, q_offsets, 4, k, v, kv_offsets, return_lse=True)
    check(out, lse, *ref, "float32", name)


@pytest.mark.parametrize("storage", STORAGES[2:], ids=storage_id)
@pytest.mark.parametrize("q_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA_MARKS)])
def test_cuda_kernels_read_stored_kv(device, storage, q_name, rng):
    """Decode, cross and flash attention on CUDA (tiny: the simulator runs kernels as Python)
    read every format as stored; host 16-bit queries are widened before the copy to the
    GPU."""
    k, v = make_step(rng, "paged", [3, 6], [1, 1], 2, 8, storage)
    q = randn(rng, (2, 4, 8), np.float32).astype(dtype_of(q_name))
    sinks = randn(rng, 4, np.float32)
    out, lse = numattn.decode_attention(q, k, v, CausalMask(), sink_weights=sinks,
                                        num_partitions=2, device=device, return_lse=True)
    ref = reference.decode_attention(q, k, v, CausalMask(), sink_weights=sinks,
                                     return_lse=True)
    check(out, lse, *ref, q_name, f"decode {storage_id(storage)}")
    offsets = np.array([0, 1, 2])
    out, lse = numattn.cross_attention(q, offsets, 1, k, v, offsets, CausalMask(),
                                       device=device, return_lse=True)
    ref = reference.cross_attention(q, offsets, 1, k, v, offsets, CausalMask(),
                                    return_lse=True)
    check(out, lse, *ref, q_name, f"cross {storage_id(storage)}")
    k, v = make_step(rng, "paged", [3, 6], [2, 2], 2, 8, storage)
    q = randn(rng, (2, 2, 4, 8), np.float32).astype(dtype_of(q_name))
    out, lse = numattn.flash_attention_kv_cache(q, k, v, CausalMask(), sink_weights=sinks,
                                                device=device, return_lse=True)
    ref = reference.flash_attention_kv_cache(q, k, v, CausalMask(), sink_weights=sinks,
                                             return_lse=True)
    check(out, lse, *ref, q_name, f"flash {storage_id(storage)}")


@pytest.mark.parametrize("name", ["bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"])
def test_stored_value_is_exact_for_every_bit_pattern(name):
    """The shared body that widens one stored element (the CPU's element-by-element paths,
    the CUDA kernels) gives ml_dtypes' value for every bit pattern, NaN and inf included."""
    from numattn.core.jit import cpu_jit
    from numattn.kernels.shared.storage import stored_value

    widen = cpu_jit(stored_value)
    dtype = dtype_of(name)
    view = {1: np.uint8, 2: np.uint16 if name == "bfloat16" else np.int16}[dtype.itemsize]
    bits = np.arange(1 << (8 * dtype.itemsize), dtype=np.uint32).astype(view)
    like = np.zeros(1, np.float32)
    got = np.array([widen(b, dtypes.storage_format(dtype), like) for b in bits], np.float32)
    assert np.array_equal(got, bits.view(dtype).astype(np.float32), equal_nan=True)


def test_fully_masked_rows_and_empty_sequences(rng):
    """No visible key: 0 and -inf (the sink with sinks), in every output dtype."""
    k, v = make_step(rng, "paged", [0, 4], [2, 2], 1, 8, ("int8", True))
    q = randn(rng, (2, 2, 2, 8), np.float32).astype(dtype_of("bfloat16"))
    additive = np.zeros((2, 2, 6), np.float32)
    additive[1, 0] = -np.inf
    out, lse = numattn.flash_attention_kv_cache(q, k, v, additive, return_lse=True)
    assert np.all(out[1, 0].astype(np.float32) == 0) and np.all(lse[1, 0] == -np.inf)
    ref = reference.flash_attention_kv_cache(q, k, v, additive, return_lse=True)
    check(out, lse, *ref, "bfloat16", "fully masked row")


def test_outputs_go_where_asked(rng):
    """``out=`` of q's dtype or float32; another dtype is refused before any work."""
    k, v = make_step(rng, "paged", [5, 2], [1, 1], 2, 8, ("bfloat16", False))
    q = randn(rng, (2, 4, 8), np.float32).astype(dtype_of("bfloat16"))
    ref = numattn.decode_attention(q, k, v)
    for dtype in (dtype_of("bfloat16"), np.float32):
        out = np.full(q.shape, 7, dtype)
        assert numattn.decode_attention(q, k, v, out=out) is out
        assert_close(out.astype(np.float64), ref.astype(np.float64), np.float64, tol=1e-2)
    out = np.full(q.shape, 7, np.float16)
    with pytest.raises(TypeError, match="out must have dtype bfloat16 or float32"):
        numattn.decode_attention(q, k, v, out=out)
    assert np.all(out == 7)


@pytest.mark.parametrize("q_name", ["bfloat16", "float16"])
def test_large_16_bit_queries_convert_on_the_threads(q_name, rng):
    """Queries and results of :data:`~numattn.kernels.cpu.convert.PARALLEL_ELEMENTS` or more
    elements are converted by the CPU's threads (the flash kernel reads the queries and
    rounds its rows itself): the same bits as the float32 call's result rounded by ml_dtypes
    and NumPy (an ``out`` of q's dtype written in place; one of float32 takes the kernel's
    result as it is)."""
    from numattn.kernels.cpu.convert import PARALLEL_ELEMENTS

    dtype = dtype_of(q_name)
    q = randn(rng, (2, 128, 8, 64), np.float32).astype(dtype)
    assert q.size >= PARALLEL_ELEMENTS
    k, v = make_step(rng, "dense", [0, 0], [40, 40], 2, 64, ("bfloat16", False))
    mask = CausalMask()
    expected = numattn.flash_attention_kv_cache(q.astype(np.float32), k, v, mask).astype(dtype)
    got = numattn.flash_attention_kv_cache(q, k, v, mask)
    assert got.dtype == dtype and np.array_equal(got.view(np.uint16), expected.view(np.uint16))
    out = np.full(q.shape, 7, dtype)
    assert numattn.flash_attention_kv_cache(q, k, v, mask, out=out) is out
    assert np.array_equal(out.view(np.uint16), expected.view(np.uint16))
    wide = np.full(q.shape, 7, np.float32)  # the kernel's own result, not rounded
    assert numattn.flash_attention_kv_cache(q, k, v, mask, out=wide) is wide
    assert np.array_equal(wide.astype(dtype).view(np.uint16), expected.view(np.uint16))
    ragged, kv_offsets = q.reshape(-1, 8, 64), np.array([0, 40, 80])
    k_rows, v_rows = k.reshape(-1, 2, 64), v.reshape(-1, 2, 64)
    q_offsets = np.array([0, 100, 256])
    got = numattn.cross_attention(ragged, q_offsets, 156, k_rows, v_rows, kv_offsets)
    expected = numattn.cross_attention(
        ragged.astype(np.float32), q_offsets, 156, k_rows, v_rows, kv_offsets).astype(dtype)
    assert np.array_equal(got.view(np.uint16), expected.view(np.uint16))


@pytest.mark.parametrize("storage", [("bfloat16", False), ("int8", True)], ids=storage_id)
def test_plans_take_stored_caches(storage, rng):
    """Plans over stored caches: queries of the plan's q_dtype (by default K/V's dtype for
    16-bit K/V, float32 for 8-bit), results equal to the plain calls'."""
    k, v = make_step(rng, "paged", [4, 11], [1, 1], 2, 16, storage)

    def other(c):  # another layer's cache: new contents, the step's tables
        return type(c)(np.ascontiguousarray(c.blocks[..., ::-1]), c.cache_lengths,
                       c.lookup_table, c.scales)

    layers = [(k, v), (other(k), other(v))]
    q = randn(rng, (2, 4, 16), np.float32)
    plan = DecodePlan(*layers[0], CausalMask(), q_dtype=np.float32)
    for k, v in layers:
        assert np.array_equal(plan.run(q, k, v), numattn.decode_attention(q, k, v, CausalMask()))
    default = DecodePlan(*layers[0])
    expected = dtype_of(storage[0]) if storage[0] == "bfloat16" else np.dtype(np.float32)
    assert default._step.q_dtype == expected
    if storage[0] == "bfloat16":
        with pytest.raises(TypeError, match="plan's q_dtype bfloat16"):
            default.run(q, *layers[0])
    offsets = np.array([0, 1, 2])
    flash = FlashPlan(*layers[0], CausalMask(), q_input_row_offsets=offsets, q_dtype=np.float32)
    for k, v in layers:
        assert np.array_equal(
            flash.run(q, k, v),
            numattn.flash_attention_kv_cache(q, k, v, CausalMask(), q_input_row_offsets=offsets))
    k, v = layers[0]
    if storage[1]:  # a layer without the plan's scales is refused
        f8 = k.blocks.view(dtype_of("float8_e4m3fn"))
        scaled = type(k)(f8, k.cache_lengths, k.lookup_table, k.scales)
        bare = type(k)(f8, k.cache_lengths, k.lookup_table)
        with pytest.raises(ValueError, match="k must have scales, as the plan's k had"):
            DecodePlan(scaled, scaled, q_dtype=np.float32).run(q, bare, bare)


def test_merge_states_of_16_bit_parts(rng):
    q = randn(rng, (1, 3, 2, 8), np.float64).astype(dtype_of("bfloat16"))
    kv = randn(rng, (2, 1, 10, 2, 8), np.float64)
    full = reference.flash_attention_kv_cache(q, kv[0], kv[1], None, return_lse=True)
    parts = [numattn.flash_attention_kv_cache(q, kv[0][:, a:b],
                                              kv[1][:, a:b], None, return_lse=True)
             for a, b in ((0, 4), (4, 10))]
    out, lse = numattn.merge_states([p[0] for p in parts], [p[1] for p in parts])
    assert out.dtype == dtype_of("bfloat16") and lse.dtype == np.float32
    check(out, lse, *full, "bfloat16", "merged")


# --------------------------------------------------------------------------------------
# store_kv.
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("cache_name", ["float32", "float16", "bfloat16", "float8_e4m3fn",
                                        "float8_e5m2"])
@pytest.mark.parametrize("rows_name", ["float64", "float32", "float16", "bfloat16"])
def test_store_kv_rounds_as_ml_dtypes(cache_name, rows_name, rng):
    """Round to nearest even, bit for bit as ml_dtypes casts; e4m3fn saturates at +-448."""
    blocks = np.zeros((3, 4, 2, 8), dtype_of(cache_name))
    cache = PagedKVCache(blocks, np.array([1, 0]), np.array([[0, 1], [2, 1]]))
    wide = rng.standard_normal((5, 2, 8)) * np.array([1e-3, 1, 30, 500, 1e5, 1, 1, 2])
    wide[0, 0, :3] = [np.inf, -np.inf, np.nan]
    with np.errstate(over="ignore"):
        rows = wide.astype(dtype_of(rows_name))
    numattn.store_kv(cache, rows, np.array([0, 3, 5]))
    expected = rows
    if cache_name == "float8_e4m3fn":
        expected = np.clip(rows.astype(np.float64), -448, 448)
    with np.errstate(over="ignore"):
        expected = np.asarray(expected).astype(dtype_of(cache_name))
    got = np.concatenate([blocks[0, 1:4], blocks[2, 0:2]])
    assert np.array_equal(got.view(np.uint8), expected.view(np.uint8))


@pytest.mark.parametrize("cache_name", ["float16", "bfloat16"])
def test_store_kv_rounds_large_rows_on_the_threads(cache_name, rng):
    """float32 rows of :data:`~numattn.kernels.cpu.convert.PARALLEL_ELEMENTS` or more
    elements are rounded by the CPU's threads: the same bits as ml_dtypes' and NumPy's
    casts (NaN: a NaN; bfloat16's bit for bit), overflow to inf included."""
    from numattn.kernels.cpu.convert import PARALLEL_ELEMENTS

    dtype = dtype_of(cache_name)
    blocks = np.zeros((2, 512, 4, 64), dtype)
    cache = ContinuousBatchingKVCache(blocks, np.array([0, 0]), np.array([0, 1]))
    rows = randn(rng, (1024, 4, 64), np.float32) * np.float32(3e4)
    rows[0, 0, :4] = [np.inf, -np.inf, np.nan, 1e6]
    assert rows.size >= PARALLEL_ELEMENTS
    numattn.store_kv(cache, rows, np.array([0, 512, 1024]))
    with np.errstate(over="ignore"):
        expected = rows.astype(dtype).reshape(blocks.shape)
    nan = np.isnan(rows.reshape(blocks.shape))
    assert np.array_equal(blocks.view(np.uint16)[~nan], expected.view(np.uint16)[~nan])
    assert np.isnan(blocks[nan].astype(np.float32)).all()
    if cache_name == "bfloat16":
        assert np.array_equal(blocks.view(np.uint16)[nan], expected.view(np.uint16)[nan])


@pytest.mark.parametrize("name", ["int8", "float8_e4m3fn", "float8_e5m2"])
def test_store_kv_quantizes_per_token_and_head(name, rng):
    blocks = np.zeros((3, 4, 2, 8), dtype_of(name))
    scales = np.full((3, 4, 2), np.nan, np.float32)
    cache = PagedKVCache(blocks, np.array([1, 0]), np.array([[0, 1], [2, 1]]), scales)
    before = blocks[0, 0].copy(), scales[0, 0].copy()
    rows = randn(rng, (5, 2, 8), np.float32) * np.float32(3)
    rows[1, 1] = 0  # an all-zero row: scale 0, stored zeros
    numattn.store_kv(cache, rows, np.array([0, 3, 5]))
    got = np.concatenate([blocks[0, 1:4], blocks[2, 0:2]]).astype(np.float64)
    got_scales = np.concatenate([scales[0, 1:4], scales[2, 0:2]]).astype(np.float64)
    limit = {"int8": 127, "float8_e4m3fn": 448, "float8_e5m2": 57344}[name]
    assert np.allclose(got_scales, np.abs(rows).max(-1) / limit, rtol=1e-6)
    step = {"int8": 0.5 / 127, "float8_e4m3fn": 2.0 ** -4, "float8_e5m2": 2.0 ** -3}[name]
    assert np.all(np.abs(got * got_scales[..., None] - rows)
                  <= step * np.abs(rows).max(-1, keepdims=True) + 1e-12)
    assert np.array_equal(blocks[0, 0], before[0]) and np.isnan(scales[0, 0]).all()
    k = PagedKVCache(blocks, np.array([4, 2]), np.array([[0, 1], [2, 1]]), scales)
    q = randn(rng, (2, 2, 8), np.float32)
    kk = PagedKVCache(blocks, np.array([3, 1]), np.array([[0, 1], [2, 1]]), scales)
    assert_close(numattn.decode_attention(q, kk, kk), reference.decode_attention(q, kk, kk),
                 np.float32)
    assert k.scales is scales


# --------------------------------------------------------------------------------------
# Refusals.
# --------------------------------------------------------------------------------------
def test_refusals(rng):
    blocks = np.zeros((2, 4, 1, 8), np.int8)
    lengths, table = np.array([2]), np.array([[0, 1]])
    with pytest.raises(ValueError, match="int8 blocks needs scales"):
        PagedKVCache(blocks, lengths, table)
    with pytest.raises(ValueError, match="scales are for int8 and float8"):
        PagedKVCache(blocks.astype(np.float32), lengths, table, np.ones((2, 4, 1), np.float32))
    with pytest.raises(TypeError, match="scales must be float32"):
        PagedKVCache(blocks, lengths, table, np.ones((2, 4, 1)))
    with pytest.raises(ValueError, match="scales must be 3-d"):
        PagedKVCache(blocks, lengths, table, np.ones((2, 4), np.float32))
    with pytest.raises(ValueError, match=r"shape blocks.shape\[:3\]"):
        PagedKVCache(blocks, lengths, table, np.ones((2, 4, 2), np.float32))
    q = randn(rng, (1, 2, 8), np.float32)
    with pytest.raises(TypeError, match="int8 k and v need scales"):
        numattn.decode_attention(q, np.zeros((1, 3, 1, 8), np.int8), np.zeros((1, 3, 1, 8),
                                                                          np.int8))
    k = PagedKVCache(blocks, lengths, table, np.ones((2, 4, 1), np.float32))
    v = PagedKVCache(blocks.view(dtype_of("float8_e4m3fn")), lengths, table)
    with pytest.raises(TypeError, match="same dtype"):
        numattn.decode_attention(q, k, v)
    with pytest.raises(TypeError, match="q must be float64, float32, float16 or bfloat16"):
        numattn.decode_attention(q.astype(np.int8), k, k)
    with pytest.raises(TypeError, match="new_rows must be of a float dtype"):
        numattn.store_kv(k, np.zeros((1, 1, 8), np.int8), [0, 1])


# --------------------------------------------------------------------------------------
# Arrays from other libraries.
# --------------------------------------------------------------------------------------
def test_torch_tensors_are_read_in_place(rng):
    torch = pytest.importorskip("torch", reason="needs torch (pip install .[bench])")
    for torch_dtype, name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
        pages = torch.from_numpy(randn(rng, (2, 5, 4, 2, 16), np.float32)).to(torch_dtype)
        lengths, table = np.array([6, 9]), np.array([[0, 2, 4], [1, 3, 4]])
        k = PagedKVCache(pages[0], lengths, table)
        v = PagedKVCache(pages[1], lengths, table)
        assert k.blocks.dtype == dtype_of(name)
        assert k.blocks.ctypes.data == pages[0].data_ptr()  # the tensor's memory
        q = torch.from_numpy(randn(rng, (2, 4, 16), np.float32)).to(torch_dtype)
        out = numattn.decode_attention(q, k, v, CausalMask())
        ref = reference.decode_attention(np.asarray(q.float()), k, v, CausalMask())
        check(out, None, ref, None, name, f"torch {name}")
        new = torch.from_numpy(randn(rng, (2, 2, 16), np.float32)).to(torch_dtype)
        numattn.store_kv(k, new, np.array([0, 1, 2]))  # writes the tensor itself
        assert torch.equal(pages[0][2, 2], new[0])  # sequence 0, token 6: page table[0, 1], slot 2
        outs = numattn.flash_attention_kv_cache(q[:, None], k, v, CausalMask(),
                                                q_input_row_offsets=None)
        assert outs.shape == (2, 1, 4, 16)


def test_a_strided_torch_view_is_read_through_its_strides(rng):
    torch = pytest.importorskip("torch", reason="needs torch (pip install .[bench])")
    pool = torch.from_numpy(randn(rng, (5, 2, 4, 2, 16), np.float32))
    k = PagedKVCache(pool[:, 0], np.array([6]), np.array([[3, 1]]))
    v = PagedKVCache(pool[:, 1], np.array([6]), np.array([[3, 1]]))
    assert k.blocks.ctypes.data == pool.data_ptr()
    q = randn(rng, (1, 4, 16), np.float32)
    assert_close(numattn.decode_attention(q, k, v), reference.decode_attention(q, k, v),
                 np.float32)


@pytest.mark.parametrize("name", ["bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("source", [np.float32, np.float64])
def test_stored_bits_round_as_ml_dtypes(name, source, rng):
    """The shared body that rounds a value to a format's bits (the CUDA store_kv) gives
    ml_dtypes' bits for every value of the format, every midpoint between two of them
    (ties to even), values past the largest (inf, or NaN for e4m3fn), random magnitudes,
    signed zeros, inf and NaN; a float64 is rounded once, not through float32."""
    from numattn.core.jit import cpu_jit
    from numattn.kernels.shared.storage import stored_bits

    encode = cpu_jit(stored_bits)
    dtype = dtype_of(name)
    view = {1: np.uint8, 2: np.uint16}[dtype.itemsize]
    grid = np.arange(1 << (8 * dtype.itemsize), dtype=np.uint32).astype(view).view(dtype)
    grid = np.unique(grid[np.isfinite(grid)].astype(np.float64))
    values = np.concatenate([grid, (grid[:-1] + grid[1:]) / 2,
                             rng.standard_normal(4000) * np.exp(rng.uniform(-40, 40, 4000)),
                             [np.inf, -np.inf, np.nan, -np.nan, 0.0, -0.0, 1e38]])
    values = values.astype(source)
    with np.errstate(over="ignore", invalid="ignore"):
        want = values.astype(dtype).view(view)
    code = dtypes.storage_format(dtype)
    got = np.array([encode(x, code) for x in values]).astype(view)  # float16's: signed
    assert np.array_equal(got, want), values[got != want][:5]
