"""K/V in head-major and other strided layouts, read in place through their strides.

Head-major storage (``[B, Hkv, N, D]``, pages ``[pages, Hkv, page_size, D]``) is given as a
``swapaxes(1, 2)`` view; every operation must read it without a copy and agree with the
reference (and with the same values stored token-major), on both CPU paths and the
simulator, unused slots holding NaN.  float32 only: the strided kernels compile per dtype.
"""

from __future__ import annotations

import numpy as np
import pytest

import numattn
from numattn import (
    CausalMask,
    ContinuousBatchingKVCache,
    PagedKVCache,
    SlidingWindowCausalMask,
    reference,
)
from numattn.core.interop import as_array
from numattn.core.kv_cache import kv_storage

from .conftest import CPU_PATHS, cuda_param, use_device
from .utils import CACHE_KINDS, assert_close, make_kv, randn

F32 = np.float32
SIM = numattn.MHAConfig(block_k=4, threads_per_block=32)


@pytest.fixture(params=(*CPU_PATHS, cuda_param()))
def device(request, monkeypatch):
    return use_device(request.param, monkeypatch)


def head_major(x, axis=1):
    """The values of token-major ``x`` stored head-major (axes ``axis`` and ``axis + 1``
    swapped in memory), seen again in token-major axis order: a strided view."""
    return np.ascontiguousarray(np.swapaxes(x, axis, axis + 1)).swapaxes(axis, axis + 1)


def as_head_major(k):
    """A cache (or dense array) with the same values in head-major blocks."""
    if isinstance(k, np.ndarray):
        return head_major(k)
    return type(k)(head_major(k.blocks), k.cache_lengths, k.lookup_table)


def assert_read_in_place(k, v):
    """The kernels' pages are views of ``k``'s and ``v``'s memory, not copies."""
    storage = kv_storage(k, v)
    for given, pages in ((k, storage.k_pages), (v, storage.v_pages)):
        blocks = given if isinstance(given, np.ndarray) else given.blocks
        assert not pages.flags.c_contiguous and np.shares_memory(pages, blocks)


@pytest.mark.parametrize("kind", CACHE_KINDS)
def test_flash_reads_head_major_caches_in_place(device, rng, kind):
    hkv, group, d = 2, 2, 8
    cache_lengths, q_len = ([0, 0], 8) if kind == "dense" else ([3, 6], 5)
    k, v = make_kv(rng, kind, cache_lengths, [q_len, q_len], hkv, d, F32)
    q = randn(rng, (2, q_len, hkv * group, d), F32)
    sinks = randn(rng, (hkv * group,), F32)
    kh, vh = as_head_major(k), as_head_major(v)
    assert_read_in_place(kh, vh)
    for mask in (CausalMask(), SlidingWindowCausalMask(3)):
        got, lse = numattn.flash_attention_kv_cache(q, kh, vh, mask, sink_weights=sinks,
                                                    return_lse=True, device=device, config=SIM)
        want, want_lse = reference.flash_attention_kv_cache(q, k, v, mask, sink_weights=sinks,
                                                            return_lse=True)
        assert_close(got, want, F32)
        assert_close(lse, want_lse, F32, what="lse")
        token_major = numattn.flash_attention_kv_cache(q, k, v, mask, sink_weights=sinks,
                                                       device=device, config=SIM)
        np.testing.assert_allclose(got, token_major, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", CACHE_KINDS)
@pytest.mark.parametrize("parts", [1, 3])
def test_decode_reads_head_major_caches_in_place(device, rng, kind, parts):
    hkv, group, d = 2, 4, 16
    k, v = make_kv(rng, kind, [9, 9] if kind == "dense" else [9, 14], [1, 1], hkv, d, F32)
    q = randn(rng, (2, hkv * group, d), F32)
    kh, vh = as_head_major(k), as_head_major(v)
    assert_read_in_place(kh, vh)
    mask = SlidingWindowCausalMask(6)
    got, lse = numattn.decode_attention(q, kh, vh, mask, num_partitions=parts,
                                        return_lse=True, device=device, config=SIM)
    want, want_lse = reference.decode_attention(q, k, v, mask, return_lse=True)
    assert_close(got, want, F32)
    assert_close(lse, want_lse, F32, what="lse")


def test_cross_reads_head_major_ragged_rows_in_place(device, rng):
    """Ragged K/V ``[T, Hkv, D]`` given as a view of ``[Hkv, T, D]``."""
    kv_lens, q_lens, hkv, d = [4, 7], [3, 2], 2, 8
    k = randn(rng, (sum(kv_lens), hkv, d), F32)
    v = randn(rng, (sum(kv_lens), hkv, d), F32)
    q = randn(rng, (sum(q_lens), 2 * hkv, d), F32)
    q_offsets, kv_offsets = np.cumsum([0, *q_lens]), np.cumsum([0, *kv_lens])
    kh, vh = head_major(k, 0), head_major(v, 0)
    assert_read_in_place(kh, vh)
    args = (q_offsets, max(q_lens))
    got = numattn.cross_attention(q, *args, kh, vh, kv_offsets, CausalMask(), device=device,
                                  config=SIM)
    want = reference.cross_attention(q, *args, k, v, kv_offsets, CausalMask())
    assert_close(got, want, F32)


def test_store_kv_writes_head_major_pages_in_place(rng):
    """A decode loop over HND pages: store_kv writes through the view, decode reads it,
    both agree with the same steps on token-major pages."""
    hkv, d, page_size = 2, 8, 4
    pool_shape = (6, hkv, page_size, d)
    pools = [np.full(pool_shape, np.nan, F32) for _ in range(2)]  # unused slots: NaN
    table = np.array([[4, 1, 5], [0, 2, 3]])
    lengths = np.array([0, 0])
    prompts = [randn(rng, (7, hkv, d), F32), randn(rng, (3, hkv, d), F32)]
    rows = np.concatenate(prompts)
    offsets = np.array([0, 7, 10])
    caches = [PagedKVCache(p.swapaxes(1, 2), lengths, table) for p in pools]
    for cache in caches:
        numattn.store_kv(cache, rows, offsets)
    k_tokens = np.stack([p.swapaxes(1, 2) for p in pools])  # what the pages hold
    assert np.array_equal(k_tokens[0][1, :3], rows[4:7])  # sequence 0: its second page, 1
    token_major = [PagedKVCache(np.ascontiguousarray(p.swapaxes(1, 2)), lengths, table)
                   for p in pools]
    q = randn(rng, (2, 2 * hkv, d), F32)
    k, v = (c.with_cache_lengths(np.array([6, 2])) for c in caches)
    kt, vt = (c.with_cache_lengths(np.array([6, 2])) for c in token_major)
    got = numattn.decode_attention(q, k, v, CausalMask(), num_partitions=2)
    assert np.array_equal(got, numattn.decode_attention(q, kt, vt, CausalMask(),
                                                        num_partitions=2))
    assert_close(got, reference.decode_attention(q, kt, vt, CausalMask()), F32)


def test_fused_head_major_pool_and_strided_last_axis(rng):
    """The K half of a fused HND pool ``[pages, 2, Hkv, page_size, D]`` is read in place;
    a view whose last axis is strided is copied (the vector loads read rows of D whole) and
    still gives the right result."""
    hkv, d, page_size = 2, 8, 4
    pool = randn(rng, (5, 2, hkv, page_size, d), F32)
    lengths, table = np.array([3, 7]), np.array([[2, 0], [4, 1]])
    k = PagedKVCache(pool[:, 0].swapaxes(1, 2), lengths, table)
    v = PagedKVCache(pool[:, 1].swapaxes(1, 2), lengths, table)
    assert_read_in_place(k, v)
    q = randn(rng, (2, 2 * hkv, d), F32)
    assert_close(numattn.decode_attention(q, k, v),
                 reference.decode_attention(q, k, v), F32)
    wide = randn(rng, (2, 9, hkv, 2 * d), F32)
    ks, vs = wide[..., ::2], wide[..., 1::2]
    storage = kv_storage(ks, vs)
    assert storage.k_pages.flags.c_contiguous and not np.shares_memory(storage.k_pages, wide)
    qd = randn(rng, (2, 2 * hkv, d), F32)
    assert_close(numattn.decode_attention(qd, ks, vs), reference.decode_attention(qd, ks, vs),
                 F32)


def test_continuous_batching_head_major_with_nan_in_unused_slots(rng):
    hkv, d = 2, 8
    blocks = [np.full((3, hkv, 12, d), np.nan, F32) for _ in range(2)]
    for b in blocks:
        b[:, :, :7] = randn(rng, (3, hkv, 7, d), F32)
    lengths, table = np.array([6, 2]), np.array([2, 0])
    k, v = (ContinuousBatchingKVCache(b.swapaxes(1, 2), lengths, table) for b in blocks)
    q = randn(rng, (2, 2 * hkv, d), F32)
    got = numattn.decode_attention(q, k, v)
    assert np.isfinite(got).all()
    assert_close(got, reference.decode_attention(q, k, v), F32)


def test_torch_head_major_tensors_are_read_in_place(rng):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    k = torch.from_numpy(randn(rng, (2, 2, 10, 8), F32))  # [B, Hkv, N, D]
    v = torch.from_numpy(randn(rng, (2, 2, 10, 8), F32))
    q = randn(rng, (2, 4, 8), F32)
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)
    storage = kv_storage(as_array("k", kt), as_array("v", vt))
    assert np.shares_memory(storage.k_pages, k.numpy())
    got = numattn.decode_attention(q, kt, vt)
    want = reference.decode_attention(q, np.asarray(kt), np.asarray(vt))
    assert_close(got, want, F32)
