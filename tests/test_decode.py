"""decode_attention against the float64 reference: every cache kind, mask, GQA group, dtype
and partition count; sinks, NaN in unused or hidden slots, lse, out=, errors.

Numeric tests take the ``device`` fixture: they run on the CPU and through CUDA (in the
simulator, ``tox -e cudasim``, or on a GPU), the CUDA cases on tiny shapes.  Then come the
CPU kernel's own promises (threads, schedule, tiles, bitwise repeatability), and CUDA's
(device arrays, launch geometry, every kernel compiled to PTX).
"""

from __future__ import annotations

import ml_dtypes
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
)
from numattn.decode import decode_attention

from . import internals
from .conftest import FLOAT32_FAST, requires_cuda
from .utils import CACHE_KINDS, assert_close, make_kv, no_functions_type, randn

DTYPES = [np.float32, np.float64]
PARTITIONS = [1, 2, 5, 32]
#: Several key tiles (and aligned partitions) on small caches; blocks of 32 CUDA threads keep
#: the simulator quick (the CPU ignores threads_per_block).
SMALL = MHAConfig(block_k=4, threads_per_block=32)
#: The default tiles, with blocks of 32 threads.
DEFAULT_TILES = MHAConfig(threads_per_block=32)


def masks_for(batch, num_heads, num_keys, dtype, rng):
    """Every kind of mask, with an additive tensor covering ``num_keys`` keys."""
    bias = randn(rng, (batch, num_heads, 1, num_keys), dtype)
    bias[..., ::3] = -np.inf
    return [
        NullMask(),
        CausalMask(),
        SlidingWindowCausalMask(5),
        ChunkedMask(6),
        ChunkedCausalMask(4),
        MaterializedMask(bias),
        MaterializedMask(bias[:, 0]) & SlidingWindowCausalMask(9),
        (CausalMask() & ChunkedMask(8)) | SlidingWindowCausalMask(3),
        bias[0, 0],  # a plain [S=1, N] array is an additive mask
    ]


def record_argument(monkeypatch, module, name, index):
    """Wrap ``module.name`` for the test: the list it returns gets argument ``index`` of
    every call."""
    seen = []
    real = getattr(module, name)

    def spy(*args):
        seen.append(args[index])
        return real(*args)

    monkeypatch.setattr(module, name, spy)
    return seen


def lengths_for(kind):
    # cache lengths 0 and 1, and sequences ending right before, on and after page boundaries
    return [12, 12, 12] if kind == "dense" else [0, 1, 7, 8, 16, 30]


@pytest.mark.parametrize("kind", CACHE_KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference_every_mask_and_partition_count(kind, dtype, device, rng):
    """With sinks.  On the CPU every mask with every partition count; on CUDA (tiny) two masks,
    a cache of length 0 and pages of 3 against tiles of 4 (tiles cross pages)."""
    if device == "cpu":
        lengths, head_dim, page_size = lengths_for(kind), 16, 8
    else:
        lengths, head_dim, page_size = [9, 9] if kind == "dense" else [0, 9], 5, 3
    batch, kv_heads, group = len(lengths), 2, 3
    k, v = make_kv(rng, kind, lengths, [1] * batch, kv_heads, head_dim, dtype,
                   page_size=page_size)
    q = randn(rng, (batch, kv_heads * group, head_dim), dtype)
    sinks = randn(rng, (kv_heads * group,), dtype)
    num_keys = (k.shape[1] if kind == "dense" else max(lengths) + 1)
    if device == "cpu":
        runs = [(mask, PARTITIONS)
                for mask in masks_for(batch, kv_heads * group, num_keys, dtype, rng)]
    else:
        runs = [(CausalMask(), [1]), (SlidingWindowCausalMask(3), [3])]
    for mask, partition_counts in runs:
        ref_out, ref_lse = numattn.reference.decode_attention(q, k, v, mask, sink_weights=sinks,
                                                              return_lse=True)
        for parts in partition_counts:
            out, lse = decode_attention(q, k, v, mask, sink_weights=sinks, num_partitions=parts,
                                        return_lse=True, device=device, config=SMALL)
            assert isinstance(out, np.ndarray) and out.dtype == dtype and lse.dtype == dtype
            assert_close(out, ref_out, dtype, what=f"{mask!r:.60} P={parts}")
            assert_close(lse, ref_lse, dtype, what=f"lse {mask!r:.60} P={parts}")


def test_additive_mask_partitions_and_out(device, rng):
    """An additive tensor hiding every fourth key, and all of sequence 0's keys (0 and lse
    -inf there), split in 2 and 5 partitions, written into out."""
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
        result, lse = decode_attention(q, k, v, mask, num_partitions=parts, device=device,
                                       out=out, return_lse=True, config=SMALL)
        assert result is out
        assert_close(out, ref_out, dtype)
        assert_close(lse, ref_lse, dtype)
        assert np.all(out[0] == 0) and np.all(lse[0] == -np.inf)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [4, 7])
def test_block_order_with_every_mask(dtype, group, rng):
    """Tiles of 12 and 22 keys: blocks take one key from each quarter of a tile (and the last
    keys one by one), with keys hidden anywhere in a block; groups of 7 query heads go in
    blocks of 4, 2 and 1."""
    lengths = [0, 5, 11, 12, 30, 47]
    batch, kv_heads, head_dim = len(lengths), 2, 16
    k, v = make_kv(rng, "paged", lengths, [1] * batch, kv_heads, head_dim, dtype, page_size=8)
    q = randn(rng, (batch, kv_heads * group, head_dim), dtype)
    for mask in masks_for(batch, kv_heads * group, max(lengths) + 1, dtype, rng):
        ref = numattn.reference.decode_attention(q, k, v, mask)
        for block_k in (12, 22):
            for parts in (1, 3):
                out = decode_attention(q, k, v, mask, num_partitions=parts,
                                       config=MHAConfig(block_k=block_k))
                assert_close(out, ref, dtype, what=f"{mask!r:.60} block_k={block_k} P={parts}")


@pytest.mark.parametrize("group", [1, 3, 4, 5, 6, 7, 8])
def test_gqa_groups(group, rng):
    dtype = np.float32
    kv_heads = 8 // group if group < 8 else 1
    k, v = make_kv(rng, "paged", [5, 40, 129], [1, 1, 1], kv_heads, 24, dtype, page_size=16)
    q = randn(rng, (3, kv_heads * group, 24), dtype)
    scale = 0.3
    ref = numattn.reference.decode_attention(q, k, v, CausalMask(), scale)
    for parts in (1, 3):
        out = decode_attention(q, k, v, CausalMask(), scale, num_partitions=parts)
        assert_close(out, ref, dtype)


@pytest.mark.parametrize(("head_dim", "group", "kv_heads"), [(1, 5, 1), (63, 5, 2), (300, 2, 3)])
def test_odd_head_dims_and_groups(head_dim, group, kv_heads, rng):
    k, v = make_kv(rng, "paged", [0, 2, 6, 133], [1] * 4, kv_heads, head_dim, np.float64,
                   page_size=5)
    q = randn(rng, (4, kv_heads * group, head_dim), np.float64)
    ref = numattn.reference.decode_attention(q, k, v, SlidingWindowCausalMask(100))
    for parts in (1, 2):
        out = decode_attention(q, k, v, SlidingWindowCausalMask(100), num_partitions=parts)
        assert_close(out, ref, np.float64)


@pytest.mark.parametrize("dtype", FLOAT32_FAST)
def test_long_caches_and_default_config(dtype, rng):
    """Up to 5000 keys, pages of 128, the default block_k, partitions 1..32 and automatic."""
    lengths = [4999, 3000, 127, 128]
    k, v = make_kv(rng, "paged", lengths, [1] * 4, 2, 64, dtype, page_size=128)
    q = randn(rng, (4, 8, 64), dtype)
    for mask in (CausalMask(), SlidingWindowCausalMask(700)):
        ref = numattn.reference.decode_attention(q, k, v, mask)
        for parts in [*PARTITIONS, 64, None]:
            assert_close(decode_attention(q, k, v, mask, num_partitions=parts), ref, dtype)


@pytest.mark.parametrize("dtype", FLOAT32_FAST)
def test_sliding_window_512_at_1025_keys_with_nan_in_hidden_keys(dtype, rng):
    """The MAX case that once gave NaN; the hidden keys even hold NaN here."""
    k = randn(rng, (2, 1025, 2, 32), dtype)
    v = randn(rng, (2, 1025, 2, 32), dtype)
    q = randn(rng, (2, 4, 32), dtype)
    mask = SlidingWindowCausalMask(512)
    ref_out, ref_lse = numattn.reference.decode_attention(q, k, v, mask, return_lse=True)
    k[:, :1025 - 512] = np.nan
    v[:, :1025 - 512] = np.inf
    for parts in PARTITIONS:
        out, lse = decode_attention(q, k, v, mask, num_partitions=parts, return_lse=True)
        assert np.all(np.isfinite(out))
        assert_close(out, ref_out, dtype)
        assert_close(lse, ref_lse, dtype)


@pytest.mark.parametrize("fill", [np.nan, np.inf])
def test_unused_slots_never_reach_the_output(fill, device, rng):
    """NaN or inf in the slots no sequence uses; the same bits again on a second call."""
    kv_heads, head_dim = (2, 8) if device == "cpu" else (1, 4)  # tiny for the simulator
    for kind in ("continuous", "paged"):
        k, v = make_kv(rng, kind, [0, 5, 9], [1, 1, 1], kv_heads, head_dim, np.float64,
                       page_size=4, fill=fill)
        q = randn(rng, (3, 2 * kv_heads, head_dim), np.float64)
        for parts in (1, 4):
            out = decode_attention(q, k, v, NullMask(), num_partitions=parts, device=device,
                                   config=SMALL)
            assert np.all(np.isfinite(out))
            assert_close(out, numattn.reference.decode_attention(q, k, v), np.float64)
            again = decode_attention(q, k, v, NullMask(), num_partitions=parts, device=device,
                                     config=SMALL)
            assert np.array_equal(again, out)


def test_nan_in_a_visible_key_propagates_to_its_heads_only(device, rng):
    k = randn(rng, (2, 20, 2, 8), np.float64)
    v = randn(rng, (2, 20, 2, 8), np.float64)
    q = randn(rng, (2, 4, 8), np.float64)
    k[0, 13, 1, 2] = np.nan  # sequence 0, KV head 1 (query heads 2 and 3)
    v[1, 3, 0, 5] = np.nan  # sequence 1, KV head 0, dim 5 (query heads 0 and 1)
    for parts in (1, 3):
        out = decode_attention(q, k, v, num_partitions=parts, device=device, config=SMALL)
        assert np.all(np.isnan(out[0, 2:])) and np.all(np.isfinite(out[0, :2]))
        assert np.all(np.isnan(out[1, :2, 5])) and np.isfinite(out[1, :2, :5]).all()
        assert np.all(np.isfinite(out[1, 2:]))


# The simulator warns at -inf - -inf (a GPU gives NaN quietly).
@pytest.mark.filterwarnings("ignore:.*invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES)
def test_inf_in_a_visible_key_makes_its_rows_nan(device, rng, dtype):
    """A visible key holding +inf scores -inf against a negative query: the rows that read it
    return NaN in out and lse (never 0 and -inf, the "no visible key" pair), whether it is
    one key among finite ones or every key, in every partition; other heads stay finite."""
    q = -np.abs(randn(rng, (2, 4, 8), dtype))
    k = randn(rng, (2, 9, 2, 8), dtype)
    v = randn(rng, (2, 9, 2, 8), dtype)
    k[0, 5, 1] = np.inf  # sequence 0, KV head 1 (query heads 2 and 3): one key of nine
    k[1, :, 0] = np.inf  # sequence 1, KV head 0 (query heads 0 and 1): every key
    for parts in (1, 3):
        out, lse = decode_attention(q, k, v, num_partitions=parts, device=device, config=SMALL,
                                    return_lse=True)
        want, want_lse = numattn.reference.decode_attention(q, k, v, return_lse=True)
        for b, heads in ((0, slice(2, 4)), (1, slice(0, 2))):
            assert np.isnan(out[b, heads]).all() and np.isnan(lse[b, heads]).all()
        assert np.isfinite(out[0, :2]).all() and np.isfinite(out[1, 2:]).all()
        assert_close(out, want, dtype)
        assert_close(lse, want_lse, dtype, what="lse")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["none", "window", "additive", "window_and_additive"])
def test_nan_in_a_visible_value_propagates_when_its_weight_underflows(dtype, kind, device,
                                                                      rng):
    """A visible key whose weight is exactly 0 still adds 0 * V (NaN stays NaN), on tiles
    with and without hidden keys; keys hidden by the window or by a -inf additive entry
    hold NaN and must not show."""
    hidden_bias = np.zeros((1, 1, 1, 8), dtype)
    hidden_bias[..., 5] = -np.inf
    mask, hidden = {
        "none": (NullMask(), []),
        "window": (SlidingWindowCausalMask(6), [0]),
        "additive": (MaterializedMask(np.zeros((1, 1, 1, 8), dtype)), []),
        "window_and_additive": (SlidingWindowCausalMask(7) & MaterializedMask(hidden_bias),
                                [0, 5]),
    }[kind]
    q = np.zeros((1, 1, 4), dtype)
    q[0, 0, 0] = 1
    k = randn(rng, (1, 8, 1, 4), dtype) * 0.1
    k[0, 3, 0, 0] = -1e5  # score -1e5: weight e^(s - M) == 0 exactly
    v = randn(rng, (1, 8, 1, 4), dtype)
    v[0, 3, 0, 1] = np.nan
    k[0, hidden] = np.nan
    v[0, hidden] = np.nan
    for parts in (1, 2):
        out = decode_attention(q, k, v, mask, scale=1.0, num_partitions=parts, device=device,
                               config=SMALL)
        assert np.isnan(out[0, 0, 1]) and np.isfinite(out[0, 0, [0, 2, 3]]).all()
        ref = numattn.reference.decode_attention(q, k, v, mask, scale=1.0)
        assert np.isnan(ref[0, 0, 1])


def test_nan_in_a_partition_whose_weight_underflows_propagates(device, rng):
    """Split-K: a whole partition whose max is far below the others weighs exactly 0 in the
    merge; NaN in its visible rows must still reach the output."""
    q = np.zeros((1, 1, 4))
    q[0, 0, 0] = 1
    k = randn(rng, (1, 8, 1, 4), np.float64) * 0.1
    k[0, :4, 0, 0] = -1e5  # partition 0 (keys 0..3): every weight underflows
    v = randn(rng, (1, 8, 1, 4), np.float64)
    v[0, 2, 0, 3] = np.nan
    out = decode_attention(q, k, v, scale=1.0, num_partitions=2, device=device, config=SMALL)
    assert np.isnan(out[0, 0, 3]) and np.isfinite(out[0, 0, :3]).all()


def test_additive_minus_inf_hides_nan_and_inf_keys(device, rng):
    """-inf in an additive mask hides the key even when its score is NaN or inf."""
    q = randn(rng, (2, 4, 8), np.float64)
    k = randn(rng, (2, 9, 2, 8), np.float64)
    v = randn(rng, (2, 9, 2, 8), np.float64)
    bias = randn(rng, (2, 4, 1, 9), np.float64)
    bias[:, :, 0, 4] = -np.inf
    bias[1, 2:, 0, 6] = -np.inf  # sequence 1, heads 2-3 (KV head 1) only
    ref = numattn.reference.decode_attention(q, k, v, MaterializedMask(bias))
    k[:, 4] = np.nan
    v[:, 4] = np.inf
    k[1, 6, 1] = np.inf
    v[1, 6, 1] = np.nan
    for parts in (1, 3):
        out = decode_attention(q, k, v, MaterializedMask(bias), num_partitions=parts,
                               device=device, config=SMALL)
        assert_close(out, ref, np.float64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sinks_counted_once(dtype, rng):
    lengths = [0, 3, 40, 200]
    k, v = make_kv(rng, "paged", lengths, [1] * 4, 2, 16, dtype, page_size=16)
    q = randn(rng, (4, 4, 16), dtype)
    sinks = (randn(rng, (4,), dtype) * 2).astype(dtype)
    for mask in (CausalMask(), SlidingWindowCausalMask(30)):
        ref_out, ref_lse = numattn.reference.decode_attention(q, k, v, mask, sink_weights=sinks,
                                                              return_lse=True)
        for parts in PARTITIONS:
            out, lse = decode_attention(q, k, v, mask, sink_weights=sinks, num_partitions=parts,
                                        return_lse=True, config=SMALL)
            assert_close(out, ref_out, dtype)
            assert_close(lse, ref_lse, dtype)


def test_sink_closed_form(device):
    """scale = 0 and V = 1 at 64 keys: each head gives 64 / (64 + e^sigma)."""
    k = np.random.default_rng(1).standard_normal((1, 64, 1, 8))
    v = np.ones((1, 64, 1, 8))
    q = np.random.default_rng(2).standard_normal((1, 2, 8))
    for parts in (1, 2, 5, 32) if device == "cpu" else (1, 5):
        out = decode_attention(q, k, v, scale=0.0, sink_weights=np.array([5.0, 3.0]),
                               num_partitions=parts, device=device, config=SMALL)
        np.testing.assert_allclose(out[0, :, 0], [64 / (64 + np.e**5), 64 / (64 + np.e**3)])
        np.testing.assert_allclose(out[0, :, 0], [0.3013, 0.7611], atol=5e-5)


def test_rows_with_no_visible_key(device, rng):
    q = randn(rng, (2, 2, 4), np.float32)
    k = randn(rng, (2, 6, 1, 4), np.float32)
    bias = np.full((2, 1, 6), -np.inf, np.float32)
    bias[1, 0, 2] = 0.5  # sequence 1 sees one key
    sinks = np.array([0.25, -1.0], np.float32)
    for parts in (1, 2):
        out, lse = decode_attention(q, k, k, bias, num_partitions=parts, return_lse=True,
                                    device=device, config=SMALL)
        assert np.all(out[0] == 0) and np.all(lse[0] == -np.inf)
        np.testing.assert_allclose(out[1], np.broadcast_to(k[1, 2, 0], (2, 4)), rtol=1e-6)
        out, lse = decode_attention(q, k, k, bias, sink_weights=sinks, return_lse=True,
                                    device=device, config=DEFAULT_TILES)
        assert np.all(out[0] == 0) and np.array_equal(lse[0], sinks)
    empty = np.zeros((2, 0, 1, 4), np.float32)  # dense with N = 0 keys
    out, lse = decode_attention(q, empty, empty, return_lse=True, device=device,
                                config=DEFAULT_TILES)
    assert np.all(out == 0) and np.all(lse == -np.inf)


def test_empty_batch(device):
    q = np.zeros((0, 4, 8), np.float32)
    k = np.zeros((0, 5, 2, 8), np.float32)
    out, lse = decode_attention(q, k, k, return_lse=True, device=device)
    assert out.shape == (0, 4, 8) and lse.shape == (0, 4)


@pytest.mark.parametrize("kind", ["continuous", "paged"])
def test_additive_mask_shapes(kind, device, rng):
    k, v = make_kv(rng, kind, [3, 10], [1, 1], 2, 8, np.float32, page_size=4)
    q = randn(rng, (2, 4, 8), np.float32)
    for shape in [(1, 11), (2, 1, 12), (2, 4, 1, 11)]:
        bias = randn(rng, shape, np.float32)
        bias[..., 1] = -np.inf
        ref = numattn.reference.decode_attention(q, k, v, MaterializedMask(bias))
        out = decode_attention(q, k, v, MaterializedMask(bias), num_partitions=2,
                               device=device, config=SMALL)
        assert_close(out, ref, np.float32)


def test_additive_mask_must_have_one_query_row(rng):
    """A [B, N] tensor would read as [S=B, N] (row 0 for every sequence): it is rejected."""
    k, v = make_kv(rng, "paged", [3, 10], [1, 1], 2, 8, np.float32, page_size=4)
    q = randn(rng, (2, 4, 8), np.float32)
    out = np.zeros_like(q)
    for shape in [(2, 11), (2, 2, 11), (2, 4, 3, 11)]:
        with pytest.raises(ValueError, match="S = 1 query rows"):
            decode_attention(q, k, v, randn(rng, shape, np.float32), out=out)
    assert not out.any()


def test_calling_thread_and_worker_threads_agree_bitwise(rng, monkeypatch):
    """Small calls run the partition kernel and the reduction on the calling thread; the
    results are the same bits as on the worker threads."""
    decode_module = internals.cpu_split_k
    k, v = make_kv(rng, "paged", [100, 0, 64], [1, 1, 1], 2, 32, np.float32, page_size=16)
    q = randn(rng, (3, 8, 32), np.float32)
    sinks = randn(rng, (8,), np.float32)
    results = []
    for threshold in (0, 2**62):  # worker threads, then the calling thread
        monkeypatch.setattr(decode_module, "SERIAL_KV_BYTES", threshold)
        monkeypatch.setattr(decode_module, "SERIAL_REDUCE_ELEMENTS", threshold)
        results.append(decode_attention(q, k, v, CausalMask(), sink_weights=sinks,
                                        num_partitions=3, return_lse=True, config=SMALL))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])
    want, want_lse = numattn.reference.decode_attention(q, k, v, CausalMask(),
                                                        sink_weights=sinks, return_lse=True)
    assert_close(results[1][0], want, np.float32)
    assert_close(results[1][1], want_lse, np.float32, what="lse")


def test_automatic_partition_count_follows_the_threads_that_run_it(rng, monkeypatch):
    """num_partitions=None: one partition per sequence for a call on the calling thread
    (more would only add merge work), several on the worker threads; right either way."""
    decode_module = internals.cpu_split_k
    counts = record_argument(monkeypatch, decode_module, internals.partial_states_cpu.__name__,
                             10)  # num_partitions
    k, v = make_kv(rng, "paged", [300, 250], [1, 1], 2, 32, np.float32, page_size=16)
    q = randn(rng, (2, 8, 32), np.float32)
    want = numattn.reference.decode_attention(q, k, v, CausalMask())
    for threshold in (2**62, 0):  # the calling thread, then the worker threads
        monkeypatch.setattr(decode_module, "SERIAL_KV_BYTES", threshold)
        assert_close(decode_attention(q, k, v, CausalMask(), config=SMALL), want, np.float32)
    assert counts[0] == 1 and counts[1] > 1
    assert_close(decode_attention(q, k, v, CausalMask(), num_partitions=3, config=SMALL), want,
                 np.float32)
    assert counts[2] == 3  # a requested count is kept as it is


def test_row_prefetch_changes_no_bit(rng, monkeypatch):
    """The CPU kernel prefetches the first lines of rows of at least PREFETCH_MIN_ROW_BYTES
    (a hint): with and without it the results are the same bits, and right."""
    decode_module = internals.cpu_split_k
    k, v = make_kv(rng, "paged", [300, 0, 129], [1, 1, 1], 2, 32, np.float32, page_size=16)
    q = randn(rng, (3, 8, 32), np.float32)
    results = []
    for min_row_bytes in (0, 2**62):  # every row prefetched, then none
        monkeypatch.setattr(decode_module, "PREFETCH_MIN_ROW_BYTES", min_row_bytes)
        results.append(decode_attention(q, k, v, SlidingWindowCausalMask(100),
                                        num_partitions=2, config=SMALL))
    np.testing.assert_array_equal(results[0], results[1])
    assert_close(results[0], numattn.reference.decode_attention(
        q, k, v, SlidingWindowCausalMask(100)), np.float32)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_whole_tile_and_block_sums_agree(dtype, rng, monkeypatch):
    """Short rows sum an all-visible tile's weighted V rows over the whole tile, others
    block by block; both are right, with masked tiles (which always go block by block)
    among them."""
    decode_module = internals.cpu_split_k
    k, v = make_kv(rng, "paged", [300, 1, 129], [1, 1, 1], 2, 16, dtype, page_size=16)
    q = randn(rng, (3, 12, 16), dtype)
    want = numattn.reference.decode_attention(q, k, v, SlidingWindowCausalMask(200))
    for max_row_bytes in (2**30, -1):  # whole tiles, then blocks only
        monkeypatch.setattr(decode_module, "WHOLE_TILE_MAX_ROW_BYTES", max_row_bytes)
        got = decode_attention(q, k, v, SlidingWindowCausalMask(200), num_partitions=2,
                               config=SMALL)
        assert_close(got, want, dtype)


def test_cpu_tiles_hold_up_to_tile_bytes_of_stored_k(monkeypatch):
    """CPU tiles hold block_k keys, or a multiple of it up to tile_bytes() of K as stored
    (at most MAX_TILE_MULTIPLE times); partitions stay aligned to block_k."""
    from types import SimpleNamespace

    decode_module = internals.cpu_split_k
    MAX_TILE_MULTIPLE = decode_module.MAX_TILE_MULTIPLE

    def tile(kv_heads, head_dim, dtype, block_k=128):
        layout = SimpleNamespace(num_kv_heads=kv_heads, head_dim=head_dim, dtype=np.dtype(dtype))
        return internals.cpu_tile_keys(layout, block_k)

    monkeypatch.setattr(decode_module, "tile_bytes", lambda: 2**18)
    assert tile(8, 128, np.float32) == 128  # rows of 4 KiB
    assert tile(1, 64, np.float32) == 1024  # 256 B: 1024 keys of 256 KiB
    assert tile(2, 64, np.float32) == 512
    assert tile(2, 64, np.float64) == 256
    assert tile(1, 1, np.float32) == 128 * MAX_TILE_MULTIPLE
    assert tile(1, 1, np.float32, block_k=4) == 4 * MAX_TILE_MULTIPLE
    assert tile(1, 64, np.float32, block_k=2**18) == 2**18
    monkeypatch.setattr(decode_module, "tile_bytes", lambda: 2**20)
    assert tile(8, 128, np.float32) == 256  # 1 MiB of K
    assert tile(8, 128, ml_dtypes.bfloat16) == 512  # counted as stored
    assert tile(8, 128, np.int8) == 1024
    assert tile(8, 128, np.float64) == 128


def test_tile_bytes_are_half_the_l2_cache(tmp_path):
    """tile_bytes() reads the L2 cache's size where Linux reports it (the level-2 entry,
    whichever its index), halves it and keeps it within [MIN_TILE_BYTES, MAX_TILE_BYTES]."""
    decode_module = internals.cpu_split_k

    def caches(name, **levels):
        root = tmp_path / name
        for index, (level, size) in enumerate(levels.values()):
            entry = root / f"index{index}"
            entry.mkdir(parents=True)
            (entry / "level").write_text(f"{level}\n")
            (entry / "size").write_text(f"{size}\n")
        return str(root)

    intel = caches("intel", l1d=(1, "48K"), l1i=(1, "32K"), l2=(2, "2048K"), l3=(3, "480M"))
    assert decode_module.tile_bytes(intel) == 2**20
    assert decode_module.tile_bytes(caches("zen3", l1d=(1, "32K"), l2=(2, "512K"))) == 2**18
    assert decode_module.tile_bytes(caches("zen4", l1d=(1, "32K"), l2=(2, "1M"))) == 2**19
    assert decode_module.tile_bytes(caches("huge", l2=(2, "16M"))) == 2**20
    assert decode_module.tile_bytes(caches("odd", l2=(2, "lots"))) == 2**18
    assert decode_module.tile_bytes(str(tmp_path / "none")) == 2**18


@pytest.mark.parametrize("dtype", FLOAT32_FAST)
def test_scratch_starts_on_a_64_byte_boundary(dtype, rng, monkeypatch):
    """The partial outputs of the worker threads' items (allocated by the driver) and the
    kernel's queries and scores start on a cache line (NumPy's large arrays start 16 bytes
    past one, Numba's 32)."""
    from numattn.core.jit import cpu_jit
    from numattn.kernels.cpu.split_k import aligned_empty

    decode_module = internals.cpu_split_k
    like = np.zeros(1, dtype)
    compiled = cpu_jit(aligned_empty)
    for size in (1, 7, 4096, 3 * 2**18 + 5):
        for make in (aligned_empty, compiled):
            scratch = make(size, like)
            assert scratch.shape == (size,) and scratch.dtype == dtype
            assert scratch.ctypes.data % 64 == 0
    states = []
    partial_states = internals.partial_states_cpu

    def keep(*args):
        states.append(partial_states(*args))
        return states[-1]

    monkeypatch.setattr(decode_module, partial_states.__name__, keep)
    k, v = (randn(rng, (2, 1100, 8, 64), dtype) for _ in range(2))  # > SERIAL_KV_BYTES
    decode_attention(randn(rng, (2, 32, 64), dtype), k, v, num_partitions=3)
    part_acc = states[0][2]
    assert part_acc.shape == (2, 3, 32, 64) and part_acc.flags.c_contiguous
    assert part_acc.ctypes.data % 64 == 0


def test_flash_sends_a_few_rows_per_sequence_to_these_kernels(rng, monkeypatch):
    """Flash runs problems of <= flash.MULTI_QUERY_MAX_LEN rows per sequence, with enough work,
    most rows in use and a cache long for the rows, on decode's kernels; others on its own
    kernel.  Both agree with the reference (every flash and cross test also runs through
    both paths)."""
    routed = record_argument(monkeypatch, internals.cpu_flash, "run_multi_query_cpu",
                             3)  # max_q_len

    def run(q_lens, cache_len):
        offsets = np.concatenate([[0], np.cumsum(q_lens)])
        q = randn(rng, (offsets[-1], 8, 64), np.float32)
        k, v = make_kv(rng, "paged", [cache_len] * len(q_lens), q_lens, 2, 64, np.float32,
                       page_size=16)
        got = numattn.flash_attention_kv_cache(q, k, v, CausalMask(),
                                               q_input_row_offsets=offsets)
        want = numattn.reference.flash_attention_kv_cache(q, k, v, CausalMask(),
                                                          q_input_row_offsets=offsets)
        assert_close(got, want, np.float32)

    run([4, 4], 600)  # speculative decoding: decode's kernels
    assert routed == [4]
    run([1] * 6 + [16], 600)  # 22 of 7 x 16 rows in use: the flash kernel
    run([4, 4], 10)  # tiny: the flash kernel (fewer fixed costs)
    run([17, 17], 600)  # more rows: the flash kernel's GEMMs
    run([16, 16], 300)  # 316 keys, under 32 per row: the flash kernel
    assert routed == [4]
    run([16, 16], 600)  # 616 keys, 38 per row: decode's kernels
    assert routed == [4, 16]


def _on_one_thread(call):
    """``call()`` with Numba's thread count set to one, then restored."""
    import numba

    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        return call()
    finally:
        numba.set_num_threads(threads)


def test_out_and_repeatability(rng):
    k, v = make_kv(rng, "paged", [100, 37, 64], [1, 1, 1], 2, 32, np.float32, page_size=16)
    q = randn(rng, (3, 8, 32), np.float32)
    out = np.full((3, 8, 32), 7.0, np.float32)
    result = decode_attention(q, k, v, CausalMask(), num_partitions=5, out=out, config=SMALL)
    assert result is out
    again = decode_attention(q, k, v, CausalMask(), num_partitions=5, config=SMALL)
    assert np.array_equal(again, out)  # bitwise, for a fixed partition count
    single = _on_one_thread(
        lambda: decode_attention(q, k, v, CausalMask(), num_partitions=5, config=SMALL))
    assert np.array_equal(single, out)
    # config.num_partitions is the default for the argument; an explicit argument wins
    from_config = decode_attention(q, k, v, CausalMask(),
                                   config=MHAConfig(block_k=4, num_partitions=5))
    assert np.array_equal(from_config, out)
    explicit = decode_attention(q, k, v, CausalMask(), num_partitions=1,
                                config=MHAConfig(block_k=4, num_partitions=5))
    assert_close(explicit, numattn.reference.decode_attention(q, k, v, CausalMask()),
                 np.float32)


def test_ragged_batch_on_the_worker_threads_is_dealt_by_keys(rng, monkeypatch):
    """On the worker threads the (sequence, partition) items go to the threads by their keys
    (sequences of very different lengths, one of a single key): each thread's share is
    within one item of the others', and the results agree with the reference and bitwise
    with one thread and with the calling thread."""
    from numattn.core.jit import cpu_jit
    from numattn.kernels.cpu.split_k import partition_bounds

    decode_module = internals.cpu_split_k
    lengths = [700, 12, 0, 150, 333, 41]
    k, v = make_kv(rng, "paged", lengths, [1] * 6, 2, 32, np.float32, page_size=16)
    q = randn(rng, (6, 8, 32), np.float32)
    num_keys = np.array(lengths) + 1
    order, starts = cpu_jit(internals.partition_schedule)(np.arange(7), num_keys, 3, 4, 4)
    assert sorted(order) == list(range(18))
    cost = np.array([np.subtract(*partition_bounds(n, p, 3, 4)[::-1])
                     for n in num_keys for p in range(3)])
    loads = [cost[order[starts[t]:starts[t + 1]]].sum() for t in range(4)]
    assert max(loads) - min(loads) <= cost.max()
    monkeypatch.setattr(decode_module, "SERIAL_KV_BYTES", 0)  # the worker threads
    parallel = decode_attention(q, k, v, CausalMask(), num_partitions=3, config=SMALL)
    assert_close(parallel, numattn.reference.decode_attention(q, k, v, CausalMask()),
                 np.float32)
    single = _on_one_thread(
        lambda: decode_attention(q, k, v, CausalMask(), num_partitions=3, config=SMALL))
    assert np.array_equal(single, parallel)
    monkeypatch.setattr(decode_module, "SERIAL_KV_BYTES", 2**62)  # the calling thread
    serial = decode_attention(q, k, v, CausalMask(), num_partitions=3, config=SMALL)
    assert np.array_equal(serial, parallel)


def test_out_may_be_q_k_or_v_but_not_the_sinks(rng):
    """The reduction writes out after every key was read: out may share memory with q, K
    or V; the sink logits are read by the reduction itself, so out must not hold them."""
    batch, heads, head_dim = 4, 2, 8
    k_blocks = randn(rng, (batch, 4, heads, head_dim), np.float32)  # a page [4, Hkv, D]
    v_blocks = randn(rng, (batch, 4, heads, head_dim), np.float32)  # is shaped like q
    lengths, table = np.full(batch, 3), np.arange(batch).reshape(batch, 1)
    k = numattn.PagedKVCache(k_blocks, lengths, table)
    v = numattn.PagedKVCache(v_blocks, lengths, table)
    q = randn(rng, (batch, heads, head_dim), np.float32)
    expected = numattn.reference.decode_attention(q, k, v, CausalMask())
    k_saved, v_saved = k_blocks.copy(), v_blocks.copy()
    for target in ("q", "k", "v"):
        k_blocks[...], v_blocks[...] = k_saved, v_saved
        query = q.copy()
        out = {"q": query, "k": k_blocks[0], "v": v_blocks[1]}[target]
        got = decode_attention(query, k, v, CausalMask(), out=out, num_partitions=2)
        assert got is out
        assert_close(got, expected, np.float32, what=f"out={target}")
    out = np.zeros((batch, heads, head_dim), np.float32)
    with pytest.raises(ValueError, match="out must not overlap sink_weights"):
        decode_attention(q, k, v, out=out, sink_weights=out[0, 0, :heads])
    assert not out.any()


# The simulator multiplies NumPy scalars, which warn at 0 * inf (a GPU gives NaN quietly).
@pytest.mark.filterwarnings("ignore:.*invalid value encountered:RuntimeWarning")
def test_a_partition_of_minus_inf_scores_carries_nan(device, rng):
    """Keys 4..7 are visible but score -inf (K holds +inf, q is negative there): every row
    reads inf, so out and lse are NaN, whether or not split-K gives those keys a partition
    of their own (whose state must then outweigh the finite partition's in the merge)."""
    q = randn(rng, (1, 2, 4), np.float32)
    q[:, :, 0] = -1.0
    k = randn(rng, (1, 8, 1, 4), np.float32)
    v = randn(rng, (1, 8, 1, 4), np.float32)
    k[0, 4:, 0, 0] = np.inf
    ref, ref_lse = numattn.reference.decode_attention(q, k, v, return_lse=True)
    assert np.isnan(ref).all() and np.isnan(ref_lse).all()
    for parts in (1, 2):
        out, lse = decode_attention(q, k, v, num_partitions=parts, device=device, config=SMALL,
                                    return_lse=True)
        assert np.isnan(out).all() and np.isnan(lse).all(), f"{parts} partitions"


def test_errors_write_nothing(rng):
    k, v = make_kv(rng, "paged", [3, 4], [1, 1], 2, 8, np.float32, page_size=4)
    q = randn(rng, (2, 4, 8), np.float32)
    out = np.full((2, 4, 8), 3.0, np.float32)
    cases = [
        (ValueError, "num_partitions must be an integer >= 1", dict(num_partitions=0)),
        (TypeError, "num_partitions must be an integer", dict(num_partitions=2.5)),
        (TypeError, "num_partitions must be an integer", dict(num_partitions=True)),
        (ValueError, "device must be", dict(device="gpu")),
        (TypeError, "sink_weights", dict(sink_weights=np.zeros(4, np.int32))),
        (ValueError, "sink_weights", dict(sink_weights=np.zeros(3, np.float32))),
        (TypeError, "scale", dict(scale="big")),
        (ValueError, "scale 1e\\+300 overflows float32", dict(scale=1e300)),
        (TypeError, "config", dict(config={"block_k": 4})),
        (TypeError, "return_lse", dict(return_lse="yes")),
        (ValueError, "additive mask must cover", dict(mask=np.zeros((1, 3), np.float32))),
        (TypeError, "dtype float32", dict(mask=np.zeros((1, 5), np.float64))),
    ]
    for exc, match, kwargs in cases:
        with pytest.raises(exc, match=match):
            decode_attention(q, k, v, out=out, **kwargs)
    with pytest.raises(ValueError, match="out must have shape"):
        decode_attention(q, k, v, out=np.zeros((2, 4, 7), np.float32))
    with pytest.raises(TypeError, match="out must have dtype"):
        decode_attention(q, k, v, out=np.zeros((2, 4, 8), np.float64))
    with pytest.raises(ValueError, match="C-contiguous"):
        decode_attention(q, k, v, out=np.zeros((2, 8, 4), np.float32).transpose(0, 2, 1))
    with pytest.raises(ValueError, match="q must be 3-d"):
        decode_attention(q[:, None], k, v, out=out)
    with pytest.raises(TypeError, match="q must be float64, float32, float16 or bfloat16"):
        decode_attention(q.astype(np.int32), k, v)
    with pytest.raises(TypeError, match="same dtype"):
        decode_attention(q, k.blocks, v.blocks.astype(np.float64))
    with pytest.raises(ValueError, match="multiple of the number of key/value heads"):
        decode_attention(q[:, :3], k, v)
    with pytest.raises(ValueError, match="head dimension"):
        decode_attention(q[:, :, :6].copy(), k, v, out=out)
    with pytest.raises(ValueError, match="k must be 4-d"):
        decode_attention(q, k.blocks[:, 0], v.blocks[:, 0], out=out)
    with pytest.raises(ValueError, match=r"k must have shape \[B=2"):
        decode_attention(q, k.blocks[:1], v.blocks[:1], out=out)
    too_long = numattn.PagedKVCache(k.blocks, np.array([3, 40]), k.lookup_table)
    with pytest.raises(ValueError, match="sequence 1 needs 41 tokens"):
        decode_attention(q, too_long, too_long, out=out)
    assert np.all(out == 3.0)


def test_cuda_request_without_a_gpu_says_so(rng):
    from numattn.core import device as _cuda

    if _cuda.is_available():
        pytest.skip("CUDA (or its simulator) is available here")
    q = randn(rng, (1, 2, 4), np.float32)
    k = randn(rng, (1, 3, 1, 4), np.float32)
    with pytest.raises(_cuda.CudaUnavailableError, match="no CUDA GPU"):
        decode_attention(q, k, k, device="cuda")


def test_a_fully_masked_row_gives_0_and_its_sink_logit_whatever_it_holds(device, rng):
    """No visible key: output 0 (never NaN) and lse = the sink logit, even -inf, NaN or
    inf (a -inf sink is no sink)."""
    q = rng.standard_normal((1, 4, 4)).astype(np.float32)
    kv = rng.standard_normal((1, 3, 2, 4)).astype(np.float32)
    hidden = np.full((1, 1, 3), -np.inf, np.float32)
    sinks = np.array([-np.inf, 0.5, np.nan, np.inf], np.float32)
    for parts in (1, 2):
        out, lse = decode_attention(q, kv, kv, hidden, sink_weights=sinks, return_lse=True,
                                    num_partitions=parts, device=device, config=SMALL)
        assert np.all(out == 0)
        assert np.array_equal(lse[0], sinks, equal_nan=True)
    ref, ref_lse = numattn.reference.decode_attention(q, kv, kv, hidden, sink_weights=sinks,
                                                      return_lse=True)
    assert np.all(ref == 0) and np.array_equal(ref_lse[0], sinks, equal_nan=True)


# ------------------------------------------------------------------------------------------
# CUDA only: device arrays in place, launch geometry, every kernel compiled to PTX.
# ------------------------------------------------------------------------------------------
@requires_cuda
def test_cuda_device_arrays_in_place_and_head_passes(rng, monkeypatch):
    """Device inputs stay on the device; a tiny shared-memory budget forces one query head
    per pass of a block (the path for very large GQA groups)."""
    from numba import cuda

    dtype = np.float64
    k, v = make_kv(rng, "paged", [2, 7], [1, 1], 1, 3, dtype, page_size=4)
    q = randn(rng, (2, 3, 3), dtype)
    ref = numattn.reference.decode_attention(q, k, v, CausalMask())
    per_head = (SMALL.block_k + SMALL.threads_per_block + 1) * 8
    monkeypatch.setattr(internals.cuda_split_k, "CUDA_SHARED_BYTES", per_head)
    dk = numattn.PagedKVCache(cuda.to_device(k.blocks), k.cache_lengths, k.lookup_table)
    dv = numattn.PagedKVCache(cuda.to_device(v.blocks), v.cache_lengths, v.lookup_table)
    d_out = cuda.device_array((2, 3, 3), dtype)
    result = decode_attention(cuda.to_device(q), dk, dv, CausalMask(), out=d_out,
                              num_partitions=2, config=SMALL)
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
                              sink_weights=cuda.to_device(sinks), config=SMALL)
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
                                num_partitions=2, config=SMALL)
    assert_close(out, ref, dtype)
    assert_close(lse, ref_lse, dtype, what="lse")


# float32 covers the kernels' paths, uint8 (float8 bits) the widening of stored K/V; the
# other dtypes compile them again (slow)
@pytest.mark.parametrize("dtype, storage", [
    ("float32", "float32"), ("float32", "uint8"),
    *(pytest.param("float32", storage, marks=pytest.mark.slow)
      for storage in ("uint16", "int16", "int8")),
    pytest.param("float64", "float64", marks=pytest.mark.slow)])
def test_every_cuda_kernel_compiles_to_ptx(ptx_compiler, dtype, storage):
    from numba import types

    real = getattr(types, dtype)
    NO_FUNCTIONS_TYPE = no_functions_type()

    def arr(ndim, of=real):
        return types.Array(of, ndim, "C")

    index = types.int64
    kv, scales = arr(4, getattr(types, storage)), arr(3, types.float32)
    partitions = (
        arr(3), kv, kv, index, arr(2, index), arr(1, index), arr(1, index), scales, scales,
        index, types.boolean, arr(2, index), NO_FUNCTIONS_TYPE, arr(4), types.boolean, real,
        index, index, index, arr(3), arr(3), arr(4),
    )
    ptx_compiler(internals.decode_partitions_cuda, partitions)
    reduce = (arr(3), arr(3), arr(4), arr(1), types.boolean, arr(3), arr(2))
    ptx_compiler(internals.decode_reduce_cuda, reduce)
