"""The float64 oracle: against PyTorch where it can express the case, and closed forms."""

from __future__ import annotations

import numpy as np
import pytest

import numattn
from numattn import reference

from .utils import assert_close, make_kv


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


def _sdpa(q, k, v, causal):
    torch = _torch()
    qt = torch.from_numpy(np.ascontiguousarray(q.transpose(0, 2, 1, 3)))
    kt = torch.from_numpy(np.ascontiguousarray(k.transpose(0, 2, 1, 3)))
    vt = torch.from_numpy(np.ascontiguousarray(v.transpose(0, 2, 1, 3)))
    s, n = q.shape[1], k.shape[1]
    mask = None
    if causal:  # bottom-right aligned
        mask = torch.from_numpy(np.tril(np.ones((s, n), bool), k=n - s))
    o = torch.nn.functional.scaled_dot_product_attention(
        qt, kt, vt, attn_mask=mask, enable_gqa=True)
    return o.numpy().transpose(0, 2, 1, 3)


@pytest.mark.skipif(_torch() is None, reason="torch is not installed (pip install .[bench])")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2)])
def test_reference_matches_torch(causal, heads, kv_heads, rng):
    q = rng.standard_normal((2, 5, heads, 8))
    k = rng.standard_normal((2, 9, kv_heads, 8))
    v = rng.standard_normal((2, 9, kv_heads, 8))
    mask = numattn.CausalMask() if causal else numattn.NullMask()
    got = reference.flash_attention_kv_cache(q, k, v, mask)
    assert_close(got, _sdpa(q, k, v, causal), np.float64, tol=1e-12)


def test_sink_closed_form():
    q = np.random.default_rng(0).standard_normal((1, 1, 2, 4))
    k = np.random.default_rng(1).standard_normal((1, 64, 1, 4))
    v = np.ones((1, 64, 1, 4))
    out = reference.flash_attention_kv_cache(q, k, v, None, 0.0, sink_weights=np.array([5.0, 3.0]))
    expected = 64 / (64 + np.exp([5.0, 3.0]))
    assert np.allclose(out[0, 0, :, 0], expected)
    assert np.allclose(expected, [0.3013, 0.7611], atol=1e-4)


def test_fully_masked_rows_give_zero_and_minus_inf(rng):
    q = rng.standard_normal((1, 3, 2, 4))
    kv = rng.standard_normal((1, 3, 2, 4))
    bias = np.zeros((3, 3))
    bias[1] = -np.inf
    out, lse = reference.flash_attention_kv_cache(q, kv, kv, bias, return_lse=True)
    assert np.all(out[0, 1] == 0) and np.all(lse[0, 1] == -np.inf)
    sinks = np.array([0.5, -1.0])
    out, lse = reference.flash_attention_kv_cache(q, kv, kv, bias, sink_weights=sinks,
                                                  return_lse=True)
    assert np.all(out[0, 1] == 0) and np.array_equal(lse[0, 1], sinks)
    out, lse = reference.flash_attention_kv_cache(q, kv, kv, bias, sink_weights=np.full(2, -np.inf),
                                                  return_lse=True)
    assert np.all(out[0, 1] == 0) and np.all(lse[0, 1] == -np.inf)


def test_nan_in_unused_and_hidden_slots_never_reaches_output(rng):
    k, v = make_kv(rng, "paged", [3, 6], [2, 1], 2, 4, np.float64, fill=np.nan)
    k.blocks[k.lookup_table[1, 1], 2] = np.nan  # token 6 of sequence 1 is past num_keys = 7?
    q = rng.standard_normal((3, 4, 4))
    out = reference.flash_attention_kv_cache(q, k, v, numattn.CausalMask(),
                                             q_input_row_offsets=[0, 2, 3])
    # sequence 1 has 7 keys: tokens 0..6; slot (page 1, 2) is token 6 -> visible -> NaN row
    assert np.isnan(out[2]).all()
    assert np.isfinite(out[:2]).all()


def test_additive_minus_inf_hides_nan_keys(rng):
    """A -inf entry hides the key even when its score is NaN (NaN + -inf would be NaN)."""
    q = rng.standard_normal((1, 3, 2, 4))
    k = rng.standard_normal((1, 5, 1, 4))
    v = rng.standard_normal((1, 5, 1, 4))
    bias = rng.standard_normal((3, 5))
    bias[:, 1] = -np.inf
    want = reference.flash_attention_kv_cache(q, np.delete(k, 1, axis=1),
                                              np.delete(v, 1, axis=1), np.delete(bias, 1, axis=1))
    k[0, 1] = np.nan
    v[0, 1] = np.inf
    assert_close(reference.flash_attention_kv_cache(q, k, v, bias), want, np.float64)


def test_merge_of_split_keys_is_the_whole(rng):
    q = rng.standard_normal((2, 4, 4))
    kv = rng.standard_normal((2, 10, 2, 4))
    full, full_lse = reference.decode_attention(q, kv, kv, return_lse=True)
    parts = [reference.flash_attention_kv_cache(q[:, None], kv[:, a:b], kv[:, a:b], None,
                                                return_lse=True) for a, b in [(0, 4), (4, 10)]]
    out, lse = reference.merge_states([p[0][:, 0] for p in parts], [p[1][:, 0] for p in parts])
    assert_close(out, full, np.float64)
    assert_close(lse, full_lse, np.float64)


def test_cross_positions_are_local_rows(rng):
    q = rng.standard_normal((4, 2, 4))
    kv = rng.standard_normal((5, 2, 4))
    out = reference.cross_attention(q, [0, 4], 4, kv, kv, [0, 5], numattn.CausalMask())
    # row 0 sees key 0 only
    assert np.allclose(out[0], kv[0])


def test_cross_without_kv_offsets_reads_all_dense_rows_or_q_len_ragged_rows(rng):
    """kv_input_row_offsets=None: every row of a dense [B, N, Hkv, D] input (it raised a
    TypeError), or kv_len = q_len for ragged rows, as numattn.cross_attention reads them."""
    q = rng.standard_normal((5, 2, 4))
    q_offsets = np.array([0, 2, 5])
    dense = rng.standard_normal((2, 3, 1, 4))
    out = reference.cross_attention(q, q_offsets, 3, dense, dense, None)
    ragged = dense.reshape(6, 1, 4)
    assert np.allclose(out, reference.cross_attention(q, q_offsets, 3, ragged, ragged,
                                                      [0, 3, 6]))
    assert np.allclose(out, numattn.cross_attention(q, q_offsets, 3, dense, dense, None))
    rows = rng.standard_normal((5, 1, 4))
    assert np.allclose(reference.cross_attention(q, q_offsets, 3, rows, rows, None),
                       reference.cross_attention(q, q_offsets, 3, rows, rows, q_offsets))


@pytest.mark.parametrize("sentinel", [-5, 99])
def test_sequence_without_keys_ignores_its_table_entry(rng, sentinel):
    """A sequence that reads no row may hold any value in its continuous-batching table
    entry (as numattn's kernels accept), and the reference must not index with it."""
    blocks = rng.standard_normal((2, 6, 1, 4))
    k = numattn.ContinuousBatchingKVCache(blocks, np.array([3, 0]), np.array([1, sentinel]))
    q = rng.standard_normal((2, 2, 4))  # two queries of sequence 0, none of sequence 1
    want = reference.cross_attention(q, [0, 2, 2], 2, k, k, [0, 0, 0])
    assert_close(want, reference.cross_attention(q, [0, 2], 2, blocks[1:], blocks[1:],
                                                 [0, 3]), np.float64)
    got = numattn.cross_attention(q, np.array([0, 2, 2]), 2, k, k, np.array([0, 0, 0]))
    assert_close(got, want, np.float64)
