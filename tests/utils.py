"""Shared test helpers: tolerances, random problems and KV caches in every layout."""

from __future__ import annotations

import numpy as np

import numattn

#: Absolute/relative tolerances against the float64 reference, per dtype.
TOL = {np.dtype(np.float32): 2e-4, np.dtype(np.float64): 1e-10}

CACHE_KINDS = ("dense", "continuous", "paged")


def assert_close(actual, expected, dtype=None, *, tol=None, what="output"):
    """Compare with the float64 reference; inf/-inf/NaN must match exactly."""
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    dtype = np.dtype(dtype if dtype is not None else actual.dtype)
    tol = TOL[dtype] if tol is None else tol
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    a = actual.astype(np.float64)
    nan_a, nan_e = np.isnan(a), np.isnan(expected)
    assert np.array_equal(nan_a, nan_e), f"{what}: NaN pattern differs"
    inf_e = np.isinf(expected)
    assert np.array_equal(a[inf_e], expected[inf_e]), f"{what}: inf entries differ"
    ok = ~(nan_e | inf_e)
    err = np.abs(a[ok] - expected[ok])
    bound = tol * (1 + np.abs(expected[ok]))
    if err.size:
        worst = int(np.argmax(err - bound))
        assert np.all(err <= bound), (
            f"{what}: max error {err.max():.3g} (tolerance {tol:g}); worst at flat index "
            f"{worst}: got {a[ok][worst]!r}, expected {expected[ok][worst]!r}"
        )


def randn(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


def make_cache(rng, kind, rows_per_seq, num_kv_heads, head_dim, dtype, *, page_size=4,
               fill=np.nan, extra_capacity=3):
    """K and V holding ``rows_per_seq[b]`` random tokens per sequence, in one layout.

    ``kind`` is "dense" (returns plain ``[B, N, Hkv, D]`` arrays, all sequences of the same
    length), "continuous" or "paged".  Unused slots hold ``fill`` (NaN by default) so that a
    stray read shows; pages are shuffled and spare table entries hold the sentinel
    ``num_pages``.  Returns ``(k, v, tokens_k, tokens_v)`` where ``tokens_*[b]`` are the
    float arrays ``[rows_per_seq[b], Hkv, D]`` that were stored.
    """
    rows_per_seq = [int(n) for n in rows_per_seq]
    batch = len(rows_per_seq)
    tokens_k = [randn(rng, (n, num_kv_heads, head_dim), dtype) for n in rows_per_seq]
    tokens_v = [randn(rng, (n, num_kv_heads, head_dim), dtype) for n in rows_per_seq]
    if kind == "dense":
        n = rows_per_seq[0] if batch else 0
        assert all(r == n for r in rows_per_seq), "dense inputs need equal lengths"
        shape = (batch, n, num_kv_heads, head_dim)
        k = np.stack(tokens_k) if batch else np.zeros(shape, dtype)
        v = np.stack(tokens_v) if batch else np.zeros(shape, dtype)
        return k, v, tokens_k, tokens_v
    if kind == "continuous":
        capacity = max(rows_per_seq, default=0) + extra_capacity
        num_blocks = batch + 2
        kb = np.full((num_blocks, capacity, num_kv_heads, head_dim), fill, dtype=dtype)
        vb = np.full_like(kb, fill)
        table = rng.permutation(num_blocks)[:batch]
        for b in range(batch):
            kb[table[b], : rows_per_seq[b]] = tokens_k[b]
            vb[table[b], : rows_per_seq[b]] = tokens_v[b]
        return kb, vb, tokens_k, tokens_v, table
    assert kind == "paged"
    pages_per_seq = [-(-n // page_size) for n in rows_per_seq]
    max_pages = max(pages_per_seq, default=0) + 1
    num_pages = sum(pages_per_seq) + 2
    kb = np.full((num_pages, page_size, num_kv_heads, head_dim), fill, dtype=dtype)
    vb = np.full_like(kb, fill)
    order = rng.permutation(num_pages)
    table = np.full((batch, max_pages), num_pages, dtype=np.int64)  # sentinel
    used = 0
    for b in range(batch):
        for j in range(pages_per_seq[b]):
            table[b, j] = order[used]
            used += 1
        for t in range(rows_per_seq[b]):
            kb[table[b, t // page_size], t % page_size] = tokens_k[b][t]
            vb[table[b, t // page_size], t % page_size] = tokens_v[b][t]
    return kb, vb, tokens_k, tokens_v, table


def make_kv(rng, kind, cache_lengths, kv_lens, num_kv_heads, head_dim, dtype, *,
            page_size=4, fill=np.nan):
    """K/V inputs for one step: caches holding ``cache_lengths[b] + kv_lens[b]`` tokens.

    For "dense" returns plain ``[B, N, Hkv, D]`` arrays.  For cache kinds returns
    ``ContinuousBatchingKVCache`` / ``PagedKVCache`` pairs whose ``cache_lengths`` are
    ``cache_lengths`` (the new rows already stored after them).
    """
    cache_lengths = np.asarray(cache_lengths, dtype=np.int64)
    kv_lens = np.asarray(kv_lens, dtype=np.int64)
    total = cache_lengths + kv_lens
    if kind == "dense":
        k, v, _, _ = make_cache(rng, "dense", total, num_kv_heads, head_dim, dtype)
        return k, v
    kb, vb, _, _, table = make_cache(rng, kind, total, num_kv_heads, head_dim, dtype,
                                     page_size=page_size, fill=fill)
    cls = numattn.PagedKVCache if kind == "paged" else numattn.ContinuousBatchingKVCache
    lengths = cache_lengths.copy()
    return cls(kb, lengths, table), cls(vb, lengths, table)


def no_functions_type():
    """The Numba type of the kernels' ``functions`` argument without user functions (for
    the CUDA kernels' PTX signatures)."""
    import numba

    from numattn.core.functions import kernel_functions

    return numba.typeof(kernel_functions(None, np.zeros(1, np.int64)))


#: Opcodes of :func:`built_in_like`'s ``kind``.
NULL, CAUSAL, WINDOW, CHUNKED, CHUNKED_CAUSAL = range(5)


def built_in_like(b, h, q_idx, kv_idx, kind, param):
    """A FunctionMask function that is every built-in mask, chosen by the captured ``kind``
    (and its window or chunk ``param``): one function, so one set of compiled kernels, for
    the tests of every mask."""
    if kind == NULL:
        return True
    if kind == CAUSAL:
        return kv_idx <= q_idx
    if kind == WINDOW:
        return kv_idx <= q_idx and q_idx - kv_idx < param
    if kind == CHUNKED:
        return q_idx // param == kv_idx // param
    return kv_idx <= q_idx and q_idx // param == kv_idx // param
