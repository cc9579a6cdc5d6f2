"""flash_attention_kv_cache (CPU) against the float64 reference.

Every kernel argument is normalised on the host, so the CPU kernel compiles once per dtype
whatever the mask, cache kind, head dim or configuration: the tests vary data, not types.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest

from numattn import (
    CausalMask,
    ChunkedCausalMask,
    ChunkedMask,
    ContinuousBatchingKVCache,
    MaterializedMask,
    MHAConfig,
    NullMask,
    PagedKVCache,
    SlidingWindowCausalMask,
    reference,
)
from numattn.flash import flash_attention_kv_cache

from . import internals
from .conftest import CPU_PATHS, CUDA_MARKS, use_device
from .utils import CACHE_KINDS, assert_close, make_kv, randn

DTYPES = (np.float32, np.float64)


@pytest.fixture(params=CPU_PATHS)
def device(request, monkeypatch):
    """Numeric tests run through both CPU paths; the CUDA kernel's tests are at the end (tiny
    shapes: the simulator runs kernels as Python)."""
    return use_device(request.param, monkeypatch)


MASKS = {
    "null": lambda s, n: NullMask(),
    "causal": lambda s, n: CausalMask(),
    "sliding": lambda s, n: SlidingWindowCausalMask(5),
    "chunked": lambda s, n: ChunkedMask(4),
    "chunked_causal": lambda s, n: ChunkedCausalMask(6),
    "or": lambda s, n: SlidingWindowCausalMask(3) | ChunkedMask(8),
    "additive": None,  # built per case: a random [B, H, S, N] tensor with -inf entries
}


def _additive(rng, shape, dtype):
    t = randn(rng, shape, dtype)
    t[rng.random(shape) < 0.2] = -np.inf
    return t


def flash(device, *args, **kwargs):
    """flash_attention_kv_cache on ``device`` ("cpu" or "cuda")."""
    return flash_attention_kv_cache(*args, device=device, **kwargs)


def _check(device, rng, q, k, v, mask, dtype, *, q_offsets=None, kv_offsets=None, sinks=None,
           config=None, scale=None):
    got, lse = flash(
        device, q, k, v, mask, scale, q_input_row_offsets=q_offsets,
        kv_input_row_offsets=kv_offsets, sink_weights=sinks, return_lse=True, config=config,
    )
    want, want_lse = reference.flash_attention_kv_cache(
        q, k, v, mask, scale, q_input_row_offsets=q_offsets, kv_input_row_offsets=kv_offsets,
        sink_weights=sinks, return_lse=True,
    )
    assert got.dtype == dtype and lse.dtype == dtype
    assert_close(got, want, dtype)
    assert_close(lse, want_lse, dtype, what="lse")
    return got, lse


# ------------------------------------------------------------------------------------------
# Masks x cache kinds x dtypes x GQA groups
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", CACHE_KINDS)
@pytest.mark.parametrize("mask_name", list(MASKS))
def test_masks_caches_dtypes(device, rng, mask_name, kind, dtype):
    group = [1, 2, 3, 4][(len(mask_name) + len(kind)) % 4]
    hkv, d = 2, 16
    h = hkv * group
    sinks = randn(rng, (h,), dtype) if mask_name in ("causal", "or") else None
    config = MHAConfig(block_q=4, block_k=5)  # many tiles: FULL, NONE and PARTIAL ones
    if kind == "dense":
        b, s, n = 2, 9, 14
        q = randn(rng, (b, s, h, d), dtype)
        k, v = make_kv(rng, "dense", [0] * b, [n] * b, hkv, d, dtype)
        mask = (_additive(rng, (b, h, s, n), dtype) if mask_name == "additive"
                else MASKS[mask_name](s, n))
        _check(device, rng, q, k, v, mask, dtype, sinks=sinks, config=config)
        return
    cache_lengths = [0, 5, 13]
    q_lens = [3, 0, 8]
    offsets = np.concatenate([[0], np.cumsum(q_lens)])
    q = randn(rng, (offsets[-1], h, d), dtype)
    k, v = make_kv(rng, kind, cache_lengths, q_lens, hkv, d, dtype, page_size=4)
    n_max = max(c + ql for c, ql in zip(cache_lengths, q_lens))
    if mask_name == "additive":  # padded to the largest q_len and num_keys, and composed
        mask = MaterializedMask(_additive(rng, (3, h, max(q_lens), n_max), dtype)) & CausalMask()
    else:
        mask = MASKS[mask_name](max(q_lens), n_max)
    _check(device, rng, q, k, v, mask, dtype, q_offsets=offsets, sinks=sinks, config=config)


@pytest.mark.parametrize("shape", ["sn", "bsn", "bhsn"])
def test_additive_mask_shapes_padded(device, rng, shape):
    dtype = np.float32
    b, s, n, h, hkv, d = 2, 5, 11, 4, 2, 8
    q = randn(rng, (b, s, h, d), dtype)
    k, v = make_kv(rng, "paged", [6, 2], [s, s], hkv, d, dtype, page_size=3)
    dims = {"sn": (s, n), "bsn": (b, s, n), "bhsn": (b, h, s, n)}[shape]
    _check(device, rng, q, k, v, _additive(rng, dims, dtype), dtype)


def test_padded_additive_mask_must_have_q_rows(rng):
    q = randn(rng, (2, 3, 2, 4), np.float32)
    kv = randn(rng, (2, 5, 1, 4), np.float32)
    with pytest.raises(ValueError, match="S = 3 query rows"):
        flash_attention_kv_cache(q, kv, kv, randn(rng, (2, 4, 5), np.float32))


def test_ragged_kv_arrays_with_own_offsets(device, rng):
    dtype = np.float64
    q_lens, kv_lens = [2, 0, 5, 3], [7, 3, 5, 0]
    qo = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    ko = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.uint16)
    q = randn(rng, (qo[-1], 6, 12), dtype)
    k = randn(rng, (ko[-1], 3, 12), dtype)
    v = randn(rng, (ko[-1], 3, 12), dtype)
    for mask in (CausalMask(), NullMask(), SlidingWindowCausalMask(2)):
        _check(device, rng, q, k, v, mask, dtype, q_offsets=qo, kv_offsets=ko)
    # Without kv offsets the q offsets split K/V.
    k2 = randn(rng, (qo[-1], 3, 12), dtype)
    _check(device, rng, q, k2, k2, CausalMask(), dtype, q_offsets=qo)


def test_caches_with_kv_offsets(device, rng):
    dtype = np.float32
    q_lens, kv_lens, cache_lengths = [1, 4], [3, 4], [2, 9]
    qo = np.concatenate([[0], np.cumsum(q_lens)])
    ko = np.concatenate([[0], np.cumsum(kv_lens)])
    q = randn(rng, (qo[-1], 2, 8), dtype)
    k, v = make_kv(rng, "paged", cache_lengths, kv_lens, 1, 8, dtype, page_size=2)
    _check(device, rng, q, k, v, CausalMask(), dtype, q_offsets=qo, kv_offsets=ko)


# ------------------------------------------------------------------------------------------
# Shapes: head dims, cache lengths crossing pages, empty sequences and batches
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("d", [1, 63, 80, 128, 300])
def test_head_dims(device, rng, d):
    dtype = np.float32
    q = randn(rng, (2, 6, 4, d), dtype)
    k, v = make_kv(rng, "continuous", [0, 19], [6, 6], 4, d, dtype)
    _check(device, rng, q, k, v, CausalMask(), dtype)


def test_long_paged_sequences_cross_pages(device, rng):
    """Cache lengths 0 and several pages, default tiles, GQA 4 (the one larger case)."""
    dtype = np.float32
    cache_lengths, q_lens = [0, 700, 131], [300, 5, 129]
    offsets = np.concatenate([[0], np.cumsum(q_lens)])
    q = randn(rng, (offsets[-1], 8, 64), dtype)
    k, v = make_kv(rng, "paged", cache_lengths, q_lens, 2, 64, dtype, page_size=128)
    _check(device, rng, q, k, v, CausalMask(), dtype, q_offsets=offsets,
           sinks=randn(rng, (8,), dtype))
    _check(device, rng, q, k, v, SlidingWindowCausalMask(200), dtype, q_offsets=offsets)


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_page_sizes(device, rng, page_size):
    dtype = np.float64
    q = randn(rng, (2, 7, 2, 5), dtype)
    k, v = make_kv(rng, "paged", [10, 0], [7, 7], 1, 5, dtype, page_size=page_size)
    _check(device, rng, q, k, v, ChunkedCausalMask(4), dtype)


def test_empty_inputs(device, rng):
    dtype = np.float32
    # No sequences at all.
    q = np.zeros((0, 4, 2, 8), dtype)
    k = np.zeros((0, 3, 1, 8), dtype)
    out, lse = flash(device, q, k, k, CausalMask(), return_lse=True)
    assert out.shape == (0, 4, 2, 8) and lse.shape == (0, 4, 2)
    # Ragged batch whose every sequence is empty, over a cache with tokens.
    k, v = make_kv(rng, "paged", [4, 0], [0, 0], 1, 8, dtype)
    q = np.zeros((0, 2, 8), dtype)
    out = flash(device, q, k, v, None, q_input_row_offsets=[0, 0, 0])
    assert out.shape == (0, 2, 8)
    # Zero keys: output 0 and lse -inf; with a sink, lse is the sink logit.
    q = randn(rng, (2, 1, 8), dtype)
    kv = np.zeros((0, 1, 8), dtype)
    out, lse = flash(device, q, kv, kv, None, q_input_row_offsets=[0, 2],
                     kv_input_row_offsets=[0, 0], return_lse=True)
    assert np.array_equal(out, np.zeros_like(out)) and np.all(lse == -np.inf)
    sinks = np.array([1.5], dtype)
    out, lse = flash(device, q, kv, kv, None, q_input_row_offsets=[0, 2],
                     kv_input_row_offsets=[0, 0], sink_weights=sinks, return_lse=True)
    assert np.array_equal(out, np.zeros_like(out)) and np.all(lse == dtype(1.5))


# ------------------------------------------------------------------------------------------
# Sinks
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_keys", [1, 127, 128, 129, 700])
def test_sinks_counted_once(device, rng, n_keys):
    dtype = np.float64
    q = randn(rng, (1, 3, 4, 16), dtype)
    q_len = min(3, n_keys)
    q = q[:, :q_len]
    k, v = make_kv(rng, "paged", [n_keys - q_len], [q_len], 2, 16, dtype, page_size=128)
    sinks = np.array([0.5, -2.0, 3.0, 8.0])
    _check(device, rng, q, k, v, CausalMask(), dtype, sinks=sinks)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sink_closed_form(device, dtype):
    """scale = 0 and V = 1 over 64 keys: each head gives 64 / (64 + e^sigma)."""
    q = np.ones((1, 1, 2, 8), dtype)
    k = np.ones((1, 64, 1, 8), dtype)
    sinks = np.array([5.0, 3.0], dtype)
    out, lse = flash(device, q, k, k, None, 0.0, sink_weights=sinks, return_lse=True,
                     config=MHAConfig(block_k=16))
    expected = 64 / (64 + np.exp([5.0, 3.0]))
    np.testing.assert_allclose(expected, [0.3013, 0.7611], atol=1e-4)
    np.testing.assert_allclose(out[0, 0, :, 0], expected, rtol=1e-6)
    assert np.all(out[0, 0] == out[0, 0, :, :1])
    np.testing.assert_allclose(lse[0, 0], np.log(64 + np.exp([5.0, 3.0])), rtol=1e-6)


# ------------------------------------------------------------------------------------------
# NaN and inf: unused, hidden and visible slots; fully masked rows
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["continuous", "paged"])
def test_nan_in_unused_and_hidden_slots(device, rng, kind):
    dtype = np.float32
    cache_lengths, q_lens = [20, 9], [6, 6]
    q = randn(rng, (2, 6, 2, 8), dtype)
    k, v = make_kv(rng, kind, cache_lengths, q_lens, 1, 8, dtype, page_size=4, fill=np.inf)
    # Keys 0..7 of sequence 0 are out of every query's window of 4 (queries at 20..25):
    # poison them in K and V; they share tiles (block_k = 5) with visible keys.
    for x in (k, v):
        blocks = x.blocks
        for t in range(8):
            if kind == "paged":
                blocks[x.lookup_table[0, t // 4], t % 4] = np.nan
            else:
                blocks[x.lookup_table[0], t] = np.nan
    out, _ = _check(device, rng, q, k, v, SlidingWindowCausalMask(4), dtype,
                    config=MHAConfig(block_q=3, block_k=5))
    assert np.all(np.isfinite(out))


@pytest.mark.parametrize("config", [None, MHAConfig(block_q=3, block_k=5)])
def test_nan_shared_tile_reaches_only_rows_that_see_it(device, rng, config):
    """A NaN key/value in a partially masked tile: rows that see it give NaN, others not."""
    dtype = np.float32
    q = randn(rng, (1, 6, 2, 8), dtype)
    k, v = make_kv(rng, "paged", [20], [6], 1, 8, dtype, page_size=4)
    for x, t in ((v, 18), (k, 15)):  # V of key 18 (seen by queries 20, 21), K of key 15
        x.blocks[x.lookup_table[0, t // 4], t % 4, 0, 3] = np.nan
    out, _ = _check(device, rng, q, k, v, SlidingWindowCausalMask(4), dtype, config=config)
    assert np.all(np.isnan(out[0, :2, :, 3])) and np.all(np.isfinite(out[0, 2:]))


def test_nan_in_visible_value_propagates(device, rng):
    dtype = np.float64
    q = randn(rng, (1, 6, 2, 4), dtype)
    k = randn(rng, (1, 6, 1, 4), dtype)
    v = randn(rng, (1, 6, 1, 4), dtype)
    v[0, 3, 0, 1] = np.nan
    for config in (MHAConfig(), MHAConfig(block_q=2, block_k=2)):
        out, _ = _check(device, rng, q, k, v, CausalMask(), dtype, config=config)
        assert np.all(np.isnan(out[0, 3:, :, 1])) and np.all(np.isfinite(out[0, :3]))
        assert np.all(np.isfinite(out[..., [0, 2, 3]]))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nan_scores_of_either_sign_propagate(device, rng, dtype):
    """``inf - inf`` in a dot product gives a NaN with the sign bit set on x86: the tile
    maximum (taken on integer images of the scores) once ranked it below -inf, so a row
    whose only visible scores were such NaNs came out as a row with no visible key."""
    q = randn(rng, (1, 3, 2, 4), dtype)
    k = randn(rng, (1, 3, 1, 4), dtype)
    v = randn(rng, (1, 3, 1, 4), dtype)
    q[0, 0, 0, :2] = np.inf, -np.inf  # query 0 (sees key 0 only): its one score is NaN
    k[0, 0, 0, :2] = 1.0
    with np.errstate(invalid="ignore"):
        assert np.isnan(q[0, 0, 0] @ k[0, 0, 0])
    for sinks in (None, np.array([0.5, -1.0], dtype)):
        out, lse = _check(device, rng, q, k, v, CausalMask(), dtype, sinks=sinks)
        assert np.isnan(out[0, 0, 0]).all() and np.isnan(lse[0, 0, 0])
        assert np.isfinite(out[0, 0, 1]).all() and np.isfinite(out[0, 1:]).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_inf_in_a_visible_key_makes_the_rows_that_see_it_nan(device, rng, dtype):
    """Key 2 holds +inf and the queries are negative: its score is -inf.  Rows that see it
    (causal: queries 2 and up) return NaN in out and lse, with or without sinks; rows
    before it are untouched."""
    q = -np.abs(randn(rng, (1, 5, 2, 4), dtype))
    k = randn(rng, (1, 5, 1, 4), dtype)
    v = randn(rng, (1, 5, 1, 4), dtype)
    k[0, 2] = np.inf
    for sinks in (None, np.array([0.5, -1.0], dtype)):
        out, lse = _check(device, rng, q, k, v, CausalMask(), dtype, sinks=sinks)
        assert np.isnan(out[0, 2:]).all() and np.isnan(lse[0, 2:]).all()
        assert np.isfinite(out[0, :2]).all() and np.isfinite(lse[0, :2]).all()


@pytest.mark.parametrize("form", ["materialized", "plain", "and_causal"])
def test_additive_minus_inf_hides_nan_and_inf_keys(device, rng, form):
    """-inf in an additive mask hides a key even when its K row holds NaN or inf (the score
    plus -inf would be NaN)."""
    dtype = np.float64
    q = randn(rng, (2, 5, 4, 8), dtype)
    k = randn(rng, (2, 7, 2, 8), dtype)
    v = randn(rng, (2, 7, 2, 8), dtype)
    bias = randn(rng, (2, 4, 5, 7), dtype)
    bias[:, :, :, 2] = -np.inf  # key 2: hidden everywhere
    bias[1, 2:, :, 5] = -np.inf  # key 5 of sequence 1: hidden from KV head 1's query heads
    mask = {"materialized": MaterializedMask(bias), "plain": bias,
            "and_causal": MaterializedMask(bias) & CausalMask()}[form]
    want = reference.flash_attention_kv_cache(q, k, v, mask)
    k[:, 2] = np.nan
    v[:, 2] = np.inf
    k[1, 5, 1] = np.inf
    v[1, 5, 1] = np.nan
    assert np.isfinite(reference.flash_attention_kv_cache(q, k, v, mask)).all()
    for config in (None, MHAConfig(block_q=2, block_k=3)):
        assert_close(flash(device, q, k, v, mask, config=config), want, dtype)


def test_zero_head_dim_is_rejected():
    q = np.zeros((1, 2, 1, 0))
    with pytest.raises(ValueError, match="D >= 1"):
        flash_attention_kv_cache(q, q, q, None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_masked_rows(device, rng, dtype):
    # Padded dense K shorter than the queries: the first rows sit at negative positions.
    q = randn(rng, (1, 6, 2, 8), dtype)
    k = randn(rng, (1, 3, 2, 8), dtype)
    out, lse = _check(device, rng, q, k, k, CausalMask(), dtype)
    assert np.all(out[0, :3] == 0) and np.all(lse[0, :3] == -np.inf)
    # An additive mask that hides a whole row, with a sink on head 1.
    bias = np.zeros((6, 3), dtype)
    bias[4] = -np.inf
    sinks = np.array([-1.5, 0.25], dtype)
    out, lse = _check(device, rng, q, k, k, bias, dtype, sinks=sinks)
    assert np.all(out[0, 4] == 0)
    assert np.array_equal(lse[0, 4], sinks)


# ------------------------------------------------------------------------------------------
# out=, configurations, scale, determinism
# ------------------------------------------------------------------------------------------
def test_out_and_return_lse(device, rng):
    dtype = np.float32
    q = randn(rng, (2, 5, 4, 8), dtype)
    k, v = make_kv(rng, "continuous", [3, 0], [5, 5], 2, 8, dtype)
    out = np.full_like(q, 7.0)
    got = flash(device, q, k, v, CausalMask(), out=out)
    assert got is out
    assert_close(out, reference.flash_attention_kv_cache(q, k, v, CausalMask()), dtype)
    got, lse = flash(device, q, k, v, CausalMask(), out=out, return_lse=True)
    assert got is out and lse.shape == (2, 5, 4)


@pytest.mark.parametrize(
    "bad_out, error",
    [
        (np.zeros((2, 5, 4, 7), np.float32), ValueError),
        (np.zeros((2, 5, 4, 8), np.float64), TypeError),
        (np.zeros((2, 5, 8, 4), np.float32).transpose(0, 1, 3, 2), ValueError),
        ([[0.0]], TypeError),
    ],
)
def test_bad_out(rng, bad_out, error):
    dtype = np.float32
    q = randn(rng, (2, 5, 4, 8), dtype)
    k, v = make_kv(rng, "dense", [0, 0], [5, 5], 2, 8, dtype)
    before = np.array(bad_out, copy=True)
    with pytest.raises(error, match="out"):
        flash_attention_kv_cache(q, k, v, CausalMask(), out=bad_out)
    assert np.array_equal(np.asarray(bad_out), before)


def test_out_may_be_q_but_not_what_the_kernel_reads_while_writing(device, rng):
    """out=q computes in place (a tile of queries is read before its outputs are written);
    out sharing memory with K, V, the additive mask or the sinks is refused, as the kernel
    would read values it has overwritten (it did: out=k gave errors of 0.6)."""
    dtype = np.float32
    b, s, h, d = 1, 70, 2, 70  # q, dense K/V and a [B, H, S, N] mask all hold B*S*H*D
    q = randn(rng, (b, s, h, d), dtype)
    k, v = make_kv(rng, "dense", [0], [s], h, d, dtype)
    bias = randn(rng, (b, h, s, s), dtype)
    config = MHAConfig(block_q=16, block_k=16)
    expected = reference.flash_attention_kv_cache(q, k, v, CausalMask())
    in_place = q.copy()
    got = flash(device, in_place, k, v, CausalMask(), out=in_place, config=config)
    assert got is in_place
    assert_close(got, expected, dtype)
    for name, out, kwargs in [
        ("k", k, {}),
        ("v", v[:, ::-1][:, ::-1], {}),  # a view of v
        ("mask", bias.reshape(q.shape), {"mask": bias}),
        ("sink_weights", q.copy(), {}),
    ]:
        if name == "sink_weights":
            kwargs = {"sink_weights": out.reshape(-1)[5:5 + h]}
        before = out.copy()
        with pytest.raises(ValueError, match=f"out must not overlap {name}"):
            flash(device, q, k, v, kwargs.pop("mask", CausalMask()), out=out, config=config,
                  **kwargs)
        assert np.array_equal(out, before)
    # q itself, but not a view of q's memory shifted by a row (the outputs of a tile would
    # land on queries not yet read: errors of 2.7 before this was checked)
    memory = randn(rng, (q.size + d,), dtype)
    shifted_q, shifted_out = memory[:q.size].reshape(q.shape), memory[d:].reshape(q.shape)
    before = memory.copy()
    with pytest.raises(ValueError, match=r"out must not overlap q \(other than as q itself"):
        flash(device, shifted_q, k, v, CausalMask(), out=shifted_out, config=config)
    assert np.array_equal(memory, before)
    same_q = q.copy()
    got = flash(device, same_q, k, v, CausalMask(), out=same_q[...], config=config)
    assert_close(got, expected, dtype)


def test_configs_agree(device, rng):
    dtype = np.float64
    q = randn(rng, (2, 37, 6, 16), dtype)
    k, v = make_kv(rng, "paged", [50, 3], [37, 37], 2, 16, dtype, page_size=8)
    sinks = randn(rng, (6,), dtype)
    masks = (SlidingWindowCausalMask(20) | ChunkedMask(16),
             ChunkedCausalMask(24) & SlidingWindowCausalMask(20) & ChunkedMask(32))
    for mask in masks:
        _check_configs(device, q, k, v, mask, sinks, dtype)
    # An additive tensor composed with a window, split into sub-tiles by a tall block_q.
    bias = MaterializedMask(_additive(rng, (2, 37, 87), dtype)) & SlidingWindowCausalMask(40)
    want = reference.flash_attention_kv_cache(q, k, v, bias)
    for config in (None, MHAConfig(block_q=64, block_k=16)):
        assert_close(flash(device, q, k, v, bias, config=config), want, dtype)


def _check_configs(device, q, k, v, mask, sinks, dtype):
    results = [
        flash(device, q, k, v, mask, 0.3, sink_weights=sinks, config=config)
        for config in (None, MHAConfig(block_q=1, block_k=1), MHAConfig(block_q=7, block_k=5),
                       MHAConfig(block_q=64, block_k=200))
    ]
    want = reference.flash_attention_kv_cache(q, k, v, mask, 0.3, sink_weights=sinks)
    for got in results:
        assert_close(got, want, dtype)


_DETERMINISM_SCRIPT = """
import hashlib, numpy as np
from numattn import CausalMask, PagedKVCache
from numattn.flash import flash_attention_kv_cache
rng = np.random.default_rng(5)
q = rng.standard_normal((3, 300, 8, 32)).astype(np.float32)
pages = rng.standard_normal((40, 32, 2, 32)).astype(np.float32)
table = rng.permutation(40)[:39].reshape(3, 13)
k = PagedKVCache(pages, np.array([50, 0, 100]), table)
out, lse = flash_attention_kv_cache(q, k, k, CausalMask(), return_lse=True)
# a few rows per sequence over long caches (decode's kernels, split-K)
k2 = PagedKVCache(pages, np.array([400, 140, 300]), table)
out2, lse2 = flash_attention_kv_cache(q[:, :4], k2, k2, CausalMask(), return_lse=True)
print(hashlib.sha256(out.tobytes() + lse.tobytes() + out2.tobytes() + lse2.tobytes()).hexdigest())
"""


@pytest.mark.slow
def test_bitwise_deterministic_across_thread_counts():
    import numattn

    digests = []
    # The child imports the very numattn this process runs (and so shares its kernel cache).
    root = os.path.dirname(os.path.dirname(os.path.abspath(numattn.__file__)))
    for threads in ("1", "2"):
        env = dict(os.environ, NUMBA_NUM_THREADS=threads)
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        result = subprocess.run([sys.executable, "-c", _DETERMINISM_SCRIPT], env=env,
                                capture_output=True, text=True, timeout=300, check=True)
        digests.append(result.stdout.strip().splitlines()[-1])
    assert digests[0] == digests[1]
    assert len(digests[0]) == len(hashlib.sha256().hexdigest())


@pytest.mark.usefixtures("both_cpu_paths")
@pytest.mark.parametrize("mask", [CausalMask(), SlidingWindowCausalMask(9)], ids=repr)
def test_calling_thread_and_worker_threads_agree_bitwise(rng, monkeypatch, mask):
    """Small calls run on the calling thread (waking the workers would cost more than the
    work); the kernel and the split of the work are the same, and so are the results."""
    flash_module = internals.cpu_flash
    dtype = np.float32
    cache_lengths, q_lens = [0, 40, 7], [9, 3, 70]
    offsets = np.concatenate([[0], np.cumsum(q_lens)])
    q = randn(rng, (offsets[-1], 8, 16), dtype)
    k, v = make_kv(rng, "paged", cache_lengths, q_lens, 2, 16, dtype, page_size=8)
    sinks = randn(rng, (8,), dtype)
    results = []
    for threshold in (0, 2**62):  # worker threads, then the calling thread
        monkeypatch.setattr(flash_module, "SERIAL_MULTIPLY_ADDS", threshold)
        results.append(flash_attention_kv_cache(q, k, v, mask, q_input_row_offsets=offsets,
                                                sink_weights=sinks, return_lse=True,
                                                config=MHAConfig(block_q=16, block_k=8)))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])
    want, want_lse = reference.flash_attention_kv_cache(
        q, k, v, mask, q_input_row_offsets=offsets, sink_weights=sinks, return_lse=True)
    assert_close(results[1][0], want, dtype)
    assert_close(results[1][1], want_lse, dtype, what="lse")


def test_scale_default_and_explicit(device, rng):
    dtype = np.float32
    q = randn(rng, (1, 4, 2, 9), dtype)
    k = randn(rng, (1, 4, 2, 9), dtype)
    a = flash(device, q, k, k, None)
    b = flash(device, q, k, k, None, 1 / 3)
    assert_close(a, reference.flash_attention_kv_cache(q, k, k, None), dtype)
    np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------------------------------
# Validation: every bad argument is rejected before any work, naming the argument
# ------------------------------------------------------------------------------------------
def _valid(dtype=np.float32):
    rng = np.random.default_rng(0)
    q = randn(rng, (2, 3, 4, 8), dtype)
    k = randn(rng, (2, 5, 2, 8), dtype)
    return q, k, k.copy()


def _ragged():
    rng = np.random.default_rng(1)
    q = randn(rng, (5, 4, 8), np.float32)
    k = randn(rng, (5, 2, 8), np.float32)
    return q, k


@pytest.mark.parametrize(
    "case, error, match",
    [
        ("q_list", TypeError, "q"),
        ("q_int", TypeError, "q"),
        ("q_ndim", ValueError, "q"),
        ("k_dtype", TypeError, "k"),
        ("k_none", TypeError, "k must be an array"),
        ("v_list", TypeError, "v must be an array"),
        ("kv_shapes", ValueError, "same shape"),
        ("heads", ValueError, "multiple"),
        ("head_dim", ValueError, "head dim"),
        ("dense_batch", ValueError, "k"),
        ("ragged_k_padded_q", ValueError, "k"),
        ("kv_offsets_padded_q", ValueError, "kv_input_row_offsets"),
        ("offsets_start", ValueError, r"q_input_row_offsets\[0\]"),
        ("offsets_decreasing", ValueError, "non-decreasing"),
        ("offsets_end", ValueError, r"q_input_row_offsets\[-1\]"),
        ("offsets_float", TypeError, "q_input_row_offsets"),
        ("kv_offsets_end", ValueError, "kv_input_row_offsets"),
        ("kv_offsets_length", ValueError, "kv_input_row_offsets"),
        ("dense_k_ragged_q", ValueError, "k"),
        ("scale_inf", ValueError, "scale"),
        ("scale_str", TypeError, "scale"),
        ("sinks_shape", ValueError, "sink_weights"),
        ("sinks_int", TypeError, "sink_weights"),
        ("mask_type", TypeError, "mask"),
        ("mask_small", ValueError, "mask"),
        ("mask_dtype", TypeError, "mask"),
        ("mask_batch", ValueError, "mask"),
        ("config", TypeError, "config"),
        ("return_lse", TypeError, "return_lse"),
        ("cache_batch", ValueError, "sequences"),
        ("cache_table", ValueError, "lookup_table"),
        ("cache_capacity", ValueError, "needs"),
        ("cache_mixed", TypeError, "same kind"),
    ],
)
def test_validation(case, error, match):
    q, k, v = _valid()
    kw = {}
    mask = CausalMask()
    if case == "q_list":
        q = q.tolist()
    elif case == "q_int":
        q = q.astype(np.int32)
    elif case == "q_ndim":
        q = q[0, 0]
    elif case == "k_dtype":  # int8 needs a cache with scales
        k, v = k.astype(np.int8), v.astype(np.int8)
    elif case == "k_none":
        k = None
    elif case == "v_list":
        v = v.tolist()
    elif case == "kv_shapes":
        v = v[:, :4]
    elif case == "heads":
        q = np.zeros((2, 3, 3, 8), np.float32)
    elif case == "head_dim":
        q = np.zeros((2, 3, 4, 6), np.float32)
    elif case == "dense_batch":
        k, v = k[:1], v[:1]
    elif case == "ragged_k_padded_q":
        k, v = k[0], v[0]
    elif case == "kv_offsets_padded_q":
        kw["kv_input_row_offsets"] = [0, 3, 6]
    elif case.startswith("offsets") or case.startswith("kv_offsets") or case == "dense_k_ragged_q":
        q, k = _ragged()
        v = k
        offsets = {"offsets_start": [1, 5], "offsets_decreasing": [0, 4, 2, 5],
                   "offsets_end": [0, 4], "offsets_float": np.array([0.0, 5.0])}
        kw["q_input_row_offsets"] = offsets.get(case, [0, 2, 5])
        if case == "kv_offsets_end":
            kw["kv_input_row_offsets"] = [0, 2, 4]
        elif case == "kv_offsets_length":
            kw["kv_input_row_offsets"] = [0, 5]
        elif case == "dense_k_ragged_q":
            _, k, v = _valid()
    elif case == "scale_inf":
        kw["scale"] = np.inf
    elif case == "scale_str":
        kw["scale"] = "0.5"
    elif case == "sinks_shape":
        kw["sink_weights"] = np.zeros(3, np.float32)
    elif case == "sinks_int":
        kw["sink_weights"] = np.zeros(4, np.int64)
    elif case == "mask_type":
        mask = "causal"
    elif case == "mask_small":
        mask = np.zeros((3, 4), np.float32)
    elif case == "mask_dtype":
        mask = np.zeros((3, 5), np.float64)
    elif case == "mask_batch":
        mask = np.zeros((3, 3, 5), np.float32)
    elif case == "config":
        kw["config"] = {"block_q": 4}
    elif case == "return_lse":
        kw["return_lse"] = "yes"
    elif case.startswith("cache"):
        pages = np.zeros((4, 4, 2, 8), np.float32)
        lengths = np.array([1, 2])
        table = np.array([[0, 1], [2, 3]])
        if case == "cache_batch":
            lengths, table = np.array([1, 2, 0]), np.array([[0, 1], [2, 3], [0, 0]])
        elif case == "cache_table":
            table = np.array([[0, 1], [9, 3]])
        elif case == "cache_capacity":
            lengths = np.array([1, 6])
        k = PagedKVCache(pages, lengths, table)
        v = PagedKVCache(pages.copy(), lengths, table)
        if case == "cache_mixed":
            v = ContinuousBatchingKVCache(pages.copy(), lengths, np.array([0, 1]))
    out = np.full(np.shape(q), 3.0, np.float32) if isinstance(q, np.ndarray) else None
    if out is not None and np.asarray(q).dtype != np.float32:
        out = None
    with pytest.raises(error, match=match):
        flash_attention_kv_cache(q, k, v, mask, out=out, **kw)
    if out is not None:
        assert np.all(out == 3.0)


def test_visible_span_matches_mask_visible():
    """The per-row run of visible keys used on partial tiles agrees with the mask program."""
    from numattn.core.functions import kernel_functions
    from numattn.core.jit import cpu_jit
    from numattn.core.masks import OP_OR, compile_mask
    from numattn.kernels.shared.masks import mask_visible
    from numattn.kernels.shared.masks import visible_span as _visible_span

    span = cpu_jit(_visible_span)
    visible = cpu_jit(mask_visible)
    no_functions = kernel_functions(None, np.zeros(1, np.int64))
    masks = [NullMask(), CausalMask(), SlidingWindowCausalMask(3), ChunkedMask(4),
             ChunkedCausalMask(5), SlidingWindowCausalMask(6) & ChunkedMask(4) & CausalMask(),
             ChunkedCausalMask(3) | SlidingWindowCausalMask(2)]
    for mask in masks:
        program, _ = compile_mask(mask)
        for q_idx in range(-3, 14):
            for k0, kw in ((0, 9), (4, 5), (11, 3)):
                jlo, jhi, exact = span(program, q_idx, k0, kw)
                want = [bool(visible(program, no_functions, 0, 0, q_idx, k0 + j))
                        for j in range(kw)]
                if exact:
                    assert want == [jlo <= j < jhi for j in range(kw)], (mask, q_idx, k0)
                else:  # only programs with '|' fall back to testing each key
                    assert OP_OR in program[:, 0]


def test_a_fully_masked_row_gives_0_and_its_sink_logit_whatever_it_holds(device, rng):
    """No visible key: output 0 (never NaN) and lse = the sink logit, even -inf, NaN or
    inf (a -inf sink is no sink); rows with visible keys and such a sink follow the formula
    (NaN and inf propagate)."""
    q = rng.standard_normal((1, 3, 4, 4)).astype(np.float32)
    kv = rng.standard_normal((1, 3, 2, 4)).astype(np.float32)
    bias = np.zeros((3, 3), np.float32)
    bias[1] = -np.inf
    sinks = np.array([-np.inf, 0.5, np.nan, np.inf], np.float32)
    out, lse = flash(device, q, kv, kv, bias, sink_weights=sinks, return_lse=True)
    assert np.all(out[0, 1] == 0) and np.array_equal(lse[0, 1], sinks, equal_nan=True)
    ref, ref_lse = reference.flash_attention_kv_cache(q, kv, kv, bias, sink_weights=sinks,
                                                      return_lse=True)
    assert_close(out, ref, np.float32)
    assert_close(lse, ref_lse, np.float32)


# --------------------------------------------------------------------------------------
# CUDA (the simulator under tox -e cudasim, or a GPU): the tiled kernel cross attention
# shares, at the queries' own positions, on tiny shapes.
# --------------------------------------------------------------------------------------
CUDA_CONFIG = MHAConfig(block_q=2, block_k=4, threads_per_block=32)


@pytest.mark.parametrize("kind", CACHE_KINDS)
@pytest.mark.parametrize("mask_name", ["causal", "sliding", "chunked", "or", "additive"])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA_MARKS)])
def test_cuda_matches_reference(device, kind, mask_name, rng):
    """Padded queries over every K/V kind, ragged ones over caches, sinks and the LSE."""
    dtype = np.float32
    lengths = [2, 5] if kind != "dense" else [0, 0]
    k, v = make_kv(rng, kind, lengths, [3, 3], 2, 4, dtype, page_size=3)
    q = randn(rng, (2, 3, 4, 4), dtype)
    n = 3 + max(lengths)
    mask = (_additive(rng, (2, 4, 3, n), dtype) if mask_name == "additive"
            else MASKS[mask_name](3, n))
    sinks = randn(rng, 4, dtype)
    _check(device, rng, q, k, v, mask, dtype, sinks=sinks, config=CUDA_CONFIG)
    if kind != "dense":  # ragged: one sequence without query rows
        offsets = np.array([0, 0, 3])
        kv_offsets = np.array([0, 0, 3])
        k2, v2 = make_kv(rng, kind, [4, 1], [0, 3], 2, 4, dtype, page_size=3)
        mask = CausalMask() if mask_name == "additive" else mask
        _check(device, rng, q[1], k2, v2, mask, dtype, q_offsets=offsets,
               kv_offsets=kv_offsets, sinks=sinks, config=CUDA_CONFIG)


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA_MARKS)])
def test_cuda_device_arrays_and_out_q(device, rng):
    """Device inputs stay on the device; ``out=q`` on the device gets the result once every
    query was read; fully masked rows give 0 and the sink logit."""
    from numattn.core.device import get_cuda

    cuda = get_cuda()
    q = randn(rng, (1, 5, 2, 4), np.float32)
    kv = randn(rng, (1, 7, 1, 4), np.float32)
    bias = np.zeros((5, 7), np.float32)
    bias[2] = -np.inf
    sinks = np.array([0.5, -1.0], np.float32)
    expected, expected_lse = reference.flash_attention_kv_cache(
        q, kv, kv, bias, sink_weights=sinks, return_lse=True)
    d_q, d_kv = cuda.to_device(q), cuda.to_device(kv)
    out, lse = flash_attention_kv_cache(d_q, d_kv, d_kv, cuda.to_device(bias),
                                        sink_weights=sinks, out=d_q, return_lse=True,
                                        config=CUDA_CONFIG)
    assert out is d_q
    assert_close(out.copy_to_host(), expected, np.float32)
    assert_close(lse.copy_to_host(), expected_lse, np.float32)
    assert np.all(out.copy_to_host()[0, 2] == 0)
