"""KV caches: construction checks, the shared addressing, store_kv, and every index check."""

from __future__ import annotations

import numpy as np
import pytest

import numattn
from numattn.core.kv_cache import resolve_kv
from numattn.kernels.shared.paging import kv_page_slot

from .utils import assert_close, make_cache

F32 = np.dtype(np.float32)


def _gather(layout, blocks, b, n):
    rows = []
    for t in range(n):
        page, slot = kv_page_slot(layout.lookup_table, layout.page_size, layout.row_base, b, t)
        rows.append(blocks[page, slot])
    return np.array(rows)


@pytest.mark.parametrize("kind", ["continuous", "paged"])
def test_resolve_cache_addresses_every_token(kind, rng):
    lengths = np.array([0, 5, 9, 1])
    new = np.array([2, 0, 3, 4])
    kb, vb, tk, tv, table = make_cache(rng, kind, lengths + new, 2, 3, np.float32, page_size=4)
    cls = numattn.PagedKVCache if kind == "paged" else numattn.ContinuousBatchingKVCache
    k, v = cls(kb, lengths, table), cls(vb, lengths, table)
    layout = resolve_kv(k, v, batch=4, kv_lens=new)
    assert layout.num_keys.tolist() == (lengths + new).tolist()
    for b in range(4):
        n = int(layout.num_keys[b])
        assert np.array_equal(_gather(layout, layout.k_blocks, b, n), tk[b])
        assert np.array_equal(_gather(layout, layout.v_blocks, b, n), tv[b])


def test_resolve_dense_and_ragged(rng):
    k = rng.standard_normal((3, 7, 2, 4)).astype(np.float32)
    layout = resolve_kv(k, k.copy(), batch=3)
    assert layout.num_keys.tolist() == [7, 7, 7]
    assert np.array_equal(_gather(layout, layout.k_blocks, 2, 7), k[2])
    rows = rng.standard_normal((9, 2, 4)).astype(np.float32)
    offsets = np.array([0, 4, 4, 9], dtype=np.uint32)
    layout = resolve_kv(rows, rows, batch=3, kv_offsets=offsets)
    assert layout.num_keys.tolist() == [4, 0, 5]
    assert np.array_equal(_gather(layout, layout.k_blocks, 2, 5), rows[4:9])
    empty = np.zeros((0, 2, 4), np.float32)
    layout = resolve_kv(empty, empty, batch=2, kv_offsets=[0, 0, 0])
    assert layout.page_size == 1 and layout.num_keys.tolist() == [0, 0]


def test_spare_table_entries_may_hold_sentinels(rng):
    kb, _, _, _, table = make_cache(rng, "paged", [5, 1], 1, 2, np.float32, page_size=4)
    table[0, 2:] = -7  # unused by a sequence of 5 tokens
    cache = numattn.PagedKVCache(kb, np.array([5, 1]), table)
    layout = resolve_kv(cache, cache, batch=2)
    assert layout.lookup_table.min() >= 0
    assert layout.lookup_table.max() < kb.shape[0]


def test_paged_index_errors(rng):
    kb, _, _, _, table = make_cache(rng, "paged", [5, 1], 1, 2, np.float32, page_size=4)
    bad = table.copy()
    bad[0, 1] = kb.shape[0]  # used by token 4
    cache = numattn.PagedKVCache(kb, np.array([5, 1]), bad)
    with pytest.raises(ValueError, match=r"lookup_table\[0, 1\]"):
        resolve_kv(cache, cache, batch=2)
    bad[0, 1] = -1
    with pytest.raises(ValueError, match="out of range"):
        resolve_kv(cache, cache, batch=2)
    cache = numattn.PagedKVCache(kb, np.array([5, 1]), table)
    with pytest.raises(ValueError, match="holds 3 pages of 4"):
        resolve_kv(cache, cache, batch=2, kv_lens=np.array([8, 0]))
    with pytest.raises(ValueError, match="2 sequences"):
        resolve_kv(cache, cache, batch=3)
    other = type(cache)(cache.blocks.astype(np.float16), cache.cache_lengths,
                        cache.lookup_table)
    with pytest.raises(TypeError, match="same dtype"):
        resolve_kv(cache, other, batch=2)


def test_continuous_index_errors(rng):
    kb, _, _, _, table = make_cache(rng, "continuous", [4, 2], 1, 2, np.float32)
    cache = numattn.ContinuousBatchingKVCache(kb, np.array([4, 2]), table)
    with pytest.raises(ValueError, match="max_seq_len"):
        resolve_kv(cache, cache, batch=2, kv_lens=np.array([kb.shape[1], 0]))
    bad = table.copy()
    bad[1] = kb.shape[0]
    cache = numattn.ContinuousBatchingKVCache(kb, np.array([4, 2]), bad)
    with pytest.raises(ValueError, match=r"lookup_table\[1\]"):
        resolve_kv(cache, cache, batch=2)
    # a sequence with no tokens may hold any block index
    cache = numattn.ContinuousBatchingKVCache(kb, np.array([4, 0]), bad)
    resolve_kv(cache, cache, batch=2)


def test_k_and_v_must_agree(rng):
    kb, vb, _, _, table = make_cache(rng, "paged", [5, 1], 1, 2, np.float32)
    k = numattn.PagedKVCache(kb, np.array([5, 1]), table)
    v = numattn.PagedKVCache(vb, np.array([4, 1]), table)
    with pytest.raises(ValueError, match="share cache_lengths"):
        resolve_kv(k, v, batch=2)
    v = numattn.PagedKVCache(vb, np.array([5, 1]), table[::-1].copy())
    with pytest.raises(ValueError, match="share lookup_table"):
        resolve_kv(k, v, batch=2)
    with pytest.raises(TypeError, match="same kind"):
        resolve_kv(k, kb, batch=2)
    with pytest.raises(ValueError, match="same shape"):
        resolve_kv(kb, kb[:, :2], batch=2)
    dense = rng.standard_normal((2, 3, 1, 2)).astype(np.float32)
    with pytest.raises(ValueError, match="B=3"):
        resolve_kv(dense, dense, batch=3)
    with pytest.raises(ValueError, match="need row offsets"):
        resolve_kv(dense[0], dense[0], batch=1)


def test_cache_constructor_checks():
    blocks = np.zeros((2, 4, 1, 3), np.float32)
    with pytest.raises(ValueError, match="4-d"):
        numattn.PagedKVCache(blocks[0], np.array([1]), np.zeros((1, 1), int))
    with pytest.raises(TypeError, match="float64, float32, float16, bfloat16, float8"):
        numattn.PagedKVCache(blocks.astype(np.int32), np.array([1]), np.zeros((1, 1), int))
    with pytest.raises(ValueError, match=">= 0"):
        numattn.PagedKVCache(blocks, np.array([-1]), np.zeros((1, 1), int))
    with pytest.raises(TypeError, match="integer dtype"):
        numattn.PagedKVCache(blocks, np.array([1.5]), np.zeros((1, 1), int))
    with pytest.raises(ValueError, match="2-d"):
        numattn.PagedKVCache(blocks, np.array([1]), np.zeros(1, int))
    with pytest.raises(ValueError, match="1 sequences"):
        numattn.ContinuousBatchingKVCache(blocks, np.array([1]), np.zeros(2, int))
    cache = numattn.PagedKVCache(blocks, np.array([1]), np.zeros((1, 3), int))
    assert (cache.page_size, cache.capacity, cache.num_kv_heads, cache.head_dim) == (4, 12, 1, 3)
    assert cache.with_cache_lengths(np.array([2])).cache_lengths.tolist() == [2]


@pytest.mark.parametrize("kind", ["continuous", "paged"])
def test_store_kv_writes_after_cached_tokens(kind, rng):
    lengths = np.array([3, 0, 6])
    new = np.array([2, 5, 0])
    kb, _, tk, _, table = make_cache(rng, kind, lengths + new, 2, 3, np.float32, page_size=4)
    cls = numattn.PagedKVCache if kind == "paged" else numattn.ContinuousBatchingKVCache
    cache = cls(kb, lengths, table)
    rows = np.concatenate([tk[b][lengths[b]:] for b in range(3)]) * 2 + 1
    offsets = np.concatenate([[0], np.cumsum(new)])
    assert numattn.store_kv(cache, rows, offsets) is cache
    layout = resolve_kv(cache, cache, batch=3, kv_lens=new)
    for b in range(3):
        got = _gather(layout, kb, b, int(layout.num_keys[b]))
        assert np.array_equal(got[: lengths[b]], tk[b][: lengths[b]])
        assert np.array_equal(got[lengths[b]:], tk[b][lengths[b]:] * 2 + 1)
    assert cache.cache_lengths.tolist() == [3, 0, 6]


def test_store_kv_validates_before_writing(rng):
    kb, _, _, _, table = make_cache(rng, "paged", [5, 1], 1, 2, np.float32, page_size=4)
    before = kb.copy()
    cache = numattn.PagedKVCache(kb, np.array([5, 1]), table)
    rows = np.ones((9, 1, 2), np.float32)
    with pytest.raises(ValueError, match="needs 13 tokens"):
        numattn.store_kv(cache, rows, [0, 8, 9])
    with pytest.raises(ValueError, match=r"input_row_offsets\[-1\]"):
        numattn.store_kv(cache, rows, [0, 1, 2])
    with pytest.raises(ValueError, match="non-decreasing"):
        numattn.store_kv(cache, rows, [0, 5, 3])
    with pytest.raises(TypeError, match="new_rows must be of a float dtype"):
        numattn.store_kv(cache, rows.astype(np.int8), [0, 4, 9])
    with pytest.raises(TypeError, match="new_rows must be float64"):
        numattn.store_kv(cache, rows.astype(np.int32), [0, 4, 9])
    with pytest.raises(ValueError, match="Hkv=1, D=2"):
        numattn.store_kv(cache, np.ones((9, 2, 2), np.float32), [0, 4, 9])
    with pytest.raises(TypeError, match="cache must be"):
        numattn.store_kv(kb, rows, [0, 4, 9])
    assert np.array_equal(kb, before, equal_nan=True)


HUGE = 2**63 - 1  # int64 max: adding this step's rows would wrap negative


def _capacity_message(kind):
    return "max_seq_len = " if kind == "continuous" else "pages of 4"


@pytest.mark.parametrize("huge", [HUGE, HUGE - 1, 2**62])
@pytest.mark.parametrize("kind", ["continuous", "paged"])
def test_cache_lengths_near_int64_limit_are_rejected_by_every_entry_point(kind, huge, rng):
    kb, vb, _, _, table = make_cache(rng, kind, [3, 2], 1, 4, np.float32, page_size=4)
    cls = numattn.PagedKVCache if kind == "paged" else numattn.ContinuousBatchingKVCache
    lengths = np.array([2, huge])
    k, v = cls(kb, lengths, table), cls(vb, lengths, table)
    k_before, v_before = kb.copy(), vb.copy()
    where = rf"sequence 1 needs .*cache_lengths\[1\] = {huge} .*{_capacity_message(kind)}"

    out = np.full((2, 2, 4), 3.0, np.float32)
    with pytest.raises(ValueError, match=where):
        numattn.decode_attention(rng.standard_normal((2, 2, 4)).astype(np.float32), k, v,
                                 out=out)
    assert np.all(out == 3.0)

    out = np.full((2, 3, 2, 4), 3.0, np.float32)
    with pytest.raises(ValueError, match=where):
        numattn.flash_attention_kv_cache(
            rng.standard_normal((2, 3, 2, 4)).astype(np.float32), k, v, None, out=out)
    assert np.all(out == 3.0)

    out = np.full((3, 2, 4), 3.0, np.float32)
    with pytest.raises(ValueError, match=where):
        numattn.cross_attention(rng.standard_normal((3, 2, 4)).astype(np.float32),
                                np.array([0, 1, 3]), 2, k, v, None, out=out)
    assert np.all(out == 3.0)

    with pytest.raises(ValueError, match=where):
        numattn.store_kv(k, rng.standard_normal((3, 1, 4)).astype(np.float32), [0, 1, 3])
    # even with no new row for that sequence: its length alone exceeds the capacity
    with pytest.raises(ValueError, match=where):
        numattn.store_kv(k, rng.standard_normal((1, 1, 4)).astype(np.float32), [0, 1, 1])
    assert np.array_equal(kb, k_before, equal_nan=True)
    assert np.array_equal(vb, v_before, equal_nan=True)


@pytest.mark.parametrize("kind", ["continuous", "paged"])
def test_table_checks_follow_the_rule_on_random_tables(kind, rng):
    """The compiled check of every call against the rule, written in NumPy: the first
    out-of-range entry (row-major) of a page some token uses is named; entries no token uses
    may hold anything and reach the kernels as page 0."""
    cls = numattn.PagedKVCache if kind == "paged" else numattn.ContinuousBatchingKVCache
    for _ in range(300):
        batch, page_size, num_pages = (int(x) for x in rng.integers(1, 6, 3))
        pages_per_row = int(rng.integers(1, 5)) if kind == "paged" else 1
        capacity = pages_per_row * page_size
        kv_lens = rng.integers(0, 3, batch)
        lengths = rng.integers(0, capacity + 1, batch)
        table = rng.integers(-2, num_pages + 2, (batch, pages_per_row))
        blocks = np.zeros((num_pages, page_size, 1, 2), np.float32)
        cache = cls(blocks, lengths, table if kind == "paged" else table[:, 0])
        num_keys = lengths + kv_lens
        if np.any(num_keys > capacity):
            with pytest.raises(ValueError, match="needs"):
                resolve_kv(cache, cache, batch=batch, kv_lens=kv_lens)
            continue
        used = np.arange(pages_per_row) * page_size < num_keys[:, None]
        bad = used & ((table < 0) | (table >= num_pages))
        if bad.any():
            b, j = np.argwhere(bad)[0]
            where = rf"lookup_table\[{b}, {j}\]" if kind == "paged" else rf"lookup_table\[{b}\]"
            with pytest.raises(ValueError, match=where + " = .* is out of range"):
                resolve_kv(cache, cache, batch=batch, kv_lens=kv_lens)
            continue
        layout = resolve_kv(cache, cache, batch=batch, kv_lens=kv_lens)
        assert layout.num_keys.tolist() == num_keys.tolist()
        assert np.array_equal(layout.lookup_table, np.where(used, table, 0))


@pytest.mark.parametrize("kind", ["continuous", "paged"])
def test_cache_lengths_made_negative_after_construction_are_rejected(kind, rng):
    """Callers update cache_lengths in place between steps: every call checks it again."""
    kb, vb, _, _, table = make_cache(rng, kind, [3, 2], 1, 4, np.float32, page_size=4)
    cls = numattn.PagedKVCache if kind == "paged" else numattn.ContinuousBatchingKVCache
    lengths = np.array([2, 1])
    k, v = cls(kb, lengths, table), cls(vb, lengths, table)
    lengths[1] = -3
    k_before = kb.copy()
    where = rf"{cls.__name__}.cache_lengths\[1\] must be >= 0, got -3"
    calls = [
        lambda out: numattn.decode_attention(np.ones((2, 2, 4), np.float32), k, v, out=out),
        lambda out: numattn.flash_attention_kv_cache(np.ones((2, 1, 2, 4), np.float32), k, v,
                                                     None, out=out),
        lambda out: numattn.cross_attention(np.ones((2, 2, 4), np.float32),
                                            np.array([0, 1, 2]), 1, k, v, None, out=out),
    ]
    for call, shape in zip(calls, [(2, 2, 4), (2, 1, 2, 4), (2, 2, 4)]):
        out = np.full(shape, 3.0, np.float32)
        with pytest.raises(ValueError, match=where):
            call(out)
        assert np.all(out == 3.0)
    with pytest.raises(ValueError, match=where):
        numattn.store_kv(k, np.ones((2, 1, 4), np.float32), [0, 1, 2])
    assert np.array_equal(kb, k_before, equal_nan=True)


@pytest.mark.parametrize("kind", ["continuous", "paged"])
def test_capacity_check_cannot_wrap_and_accepts_a_full_cache(kind, rng):
    kb, _, _, _, table = make_cache(rng, kind, [4, 1], 1, 2, np.float32, page_size=4)
    cls = numattn.PagedKVCache if kind == "paged" else numattn.ContinuousBatchingKVCache
    table = np.where(table < kb.shape[0], table, 0)  # a full sequence uses every page
    capacity = cls(kb, np.array([0, 0]), table).capacity
    cache = cls(kb, np.array([capacity, 1]), table)
    # a full cache with no new rows is fine; one more row is not
    layout = resolve_kv(cache, cache, batch=2, kv_lens=np.array([0, 0]))
    assert layout.num_keys.tolist() == [capacity, 1]
    with pytest.raises(ValueError, match=rf"sequence 0 needs {capacity + 1} tokens"):
        resolve_kv(cache, cache, batch=2, kv_lens=np.array([1, 0]))
    # huge new-row counts (e.g. from kv_input_row_offsets) must not wrap either
    with pytest.raises(ValueError, match=rf"sequence 1 needs {HUGE + 1} tokens"):
        resolve_kv(cache, cache, batch=2, kv_lens=np.array([0, HUGE]))


@pytest.mark.parametrize("as_seq", [list, tuple])
@pytest.mark.parametrize("kind", ["continuous", "paged"])
def test_caches_built_from_sequences_work_like_array_caches(kind, as_seq, rng):
    lengths = np.array([3, 0, 6])
    new = np.array([1, 1, 1])
    kb, vb, _, _, table = make_cache(rng, kind, lengths + new, 2, 4, np.float32, page_size=4)
    cls = numattn.PagedKVCache if kind == "paged" else numattn.ContinuousBatchingKVCache
    seq_table = as_seq(as_seq(row) for row in table.tolist()) if table.ndim == 2 else as_seq(
        table.tolist())
    k_arr, v_arr = cls(kb, lengths, table), cls(vb, lengths, table)
    k_seq = cls(kb.copy(), as_seq(lengths.tolist()), seq_table)
    v_seq = cls(vb.copy(), as_seq(lengths.tolist()), seq_table)
    for cache in (k_seq, v_seq):
        assert isinstance(cache.cache_lengths, np.ndarray)
        assert cache.cache_lengths.dtype == np.int64
        assert cache.lookup_table.dtype == np.int64
        assert np.array_equal(cache.lookup_table, table)
        assert cache.batch_size == 3
    # array arguments are kept as the very same objects
    assert k_arr.cache_lengths is lengths and k_arr.lookup_table is table

    q = rng.standard_normal((3, 4, 4)).astype(np.float32)
    want, want_lse = numattn.decode_attention(q, k_arr, v_arr, return_lse=True)
    got, got_lse = numattn.decode_attention(q, k_seq, v_seq, return_lse=True)
    assert np.array_equal(got, want) and np.array_equal(got_lse, want_lse)
    assert np.all(np.isfinite(got))

    rows = rng.standard_normal((3, 2, 4)).astype(np.float32)
    numattn.store_kv(k_arr, rows, np.arange(4))
    assert numattn.store_kv(k_seq, rows, [0, 1, 2, 3]) is k_seq
    assert np.array_equal(k_seq.blocks, kb, equal_nan=True)
    assert k_seq.with_cache_lengths(as_seq([4, 1, 7])).cache_lengths.tolist() == [4, 1, 7]


@pytest.mark.parametrize("cls", [numattn.ContinuousBatchingKVCache, numattn.PagedKVCache])
def test_cache_sequences_must_hold_integers_and_blocks_an_array(cls):
    blocks = np.zeros((2, 4, 1, 3), np.float32)
    table = [0, 1] if cls is numattn.ContinuousBatchingKVCache else [[0], [1]]
    name = cls.__name__
    for bad in ([1.0, 2.0], [True, False], ["1", "2"], [1, None]):
        with pytest.raises(TypeError, match=rf"{name}\.cache_lengths must have an integer"):
            cls(blocks, bad, table)
    bad_table = [0.0, 1.0] if cls is numattn.ContinuousBatchingKVCache else [[0.0], [1.0]]
    with pytest.raises(TypeError, match=rf"{name}\.lookup_table must have an integer dtype"):
        cls(blocks, [1, 2], bad_table)
    if cls is numattn.PagedKVCache:
        with pytest.raises(ValueError, match="rectangular sequence"):
            cls(blocks, [1, 2], [[0], [1, 0]])
    with pytest.raises(ValueError, match=">= 0"):
        cls(blocks, (1, -2), table)
    with pytest.raises(TypeError, match=rf"{name}\.blocks must be a NumPy or CUDA.*in place"):
        cls(blocks.tolist(), [1, 2], table)


def _fused_pool(kind, rng):
    """K and V as slices of one fused pool (FlashInfer's [pages, 2, page_size, Hkv, D]
    layout, here with a third slot of NaN between them), and the same on contiguous copies:
    ``(pool, fused, plain)``."""
    lengths = np.array([5, 9])
    if kind == "paged":
        pool = rng.standard_normal((6, 3, 4, 2, 8))
        pool[:, 1] = np.nan  # never read
        table = np.array([[4, 1, 99], [0, 5, 2]])  # 99: a spare entry
        fused = [numattn.PagedKVCache(pool[:, i], lengths, table) for i in (0, 2)]
        plain = [numattn.PagedKVCache(pool[:, i].copy(), lengths, table) for i in (0, 2)]
    elif kind == "continuous":
        pool = rng.standard_normal((3, 3, 12, 2, 8))
        pool[:, 1] = np.nan
        table = np.array([2, 0])
        fused = [numattn.ContinuousBatchingKVCache(pool[:, i], lengths, table) for i in (0, 2)]
        plain = [numattn.ContinuousBatchingKVCache(pool[:, i].copy(), lengths, table)
                 for i in (0, 2)]
    else:
        pool = rng.standard_normal((2, 3, 7, 2, 8))
        pool[:, 1] = np.nan
        fused = [pool[:, 0], pool[:, 2]]
        plain = [x.copy() for x in fused]
    return pool, fused, plain


@pytest.mark.parametrize("kind", ["paged", "continuous", "dense"])
def test_fused_pools_are_read_in_place(kind, rng):
    """K and V as slices of a fused pool are read without a copy."""
    pool, fused, _ = _fused_pool(kind, rng)
    layout = resolve_kv(*fused, batch=2, kv_lens=None if kind == "dense"
                        else np.ones(2, np.int64))
    assert np.shares_memory(layout.k_blocks, pool) and np.shares_memory(layout.v_blocks, pool)
    assert layout.k_blocks.flags.c_contiguous and not layout.k_blocks.flags.writeable


# Read-only blocks are a kernel specialisation of their own (compiled once per dtype).
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["paged", "continuous", "dense"])
def test_operations_on_fused_pools_give_what_they_give_on_copies(kind, rng):
    _, fused, plain = _fused_pool(kind, rng)
    q = rng.standard_normal((2, 4, 8))
    out = numattn.decode_attention(q, *fused, numattn.CausalMask(), num_partitions=2)
    want = numattn.decode_attention(q, *plain, numattn.CausalMask(), num_partitions=2)
    assert np.isfinite(out).all() and np.array_equal(out, want)
    q4 = rng.standard_normal((2, 1, 4, 8))
    out = numattn.flash_attention_kv_cache(q4, *fused, numattn.CausalMask())
    want = numattn.flash_attention_kv_cache(q4, *plain, numattn.CausalMask())
    assert np.isfinite(out).all() and np.array_equal(out, want)


def _store_into_fused_pool(kind, rng):
    """store_kv of random K and V rows into the two halves of a fused pool: ``(pool, caches,
    offsets, keys, values, token_rows)``, ``token_rows[b]`` the (page, slot) of each row of
    sequence ``b``."""
    pool = np.zeros((4, 2, 3, 1, 2), np.float32)  # [pages, K/V, page_size, Hkv, D]
    k_blocks, v_blocks = pool[:, 0], pool[:, 1]
    if kind == "paged":
        lengths, table = np.array([0, 2]), np.array([[1, 3], [2, 0]])
        caches = [numattn.PagedKVCache(x, lengths, table) for x in (k_blocks, v_blocks)]
        token_rows = [[(1, 0), (1, 1), (1, 2), (3, 0)], [(2, 2), (0, 0)]]  # (page, slot)
    else:
        lengths, table = np.array([0, 1]), np.array([3, 1])
        caches = [numattn.ContinuousBatchingKVCache(x, lengths, table)
                  for x in (k_blocks, v_blocks)]
        token_rows = [[(3, 0), (3, 1), (3, 2)], [(1, 1), (1, 2)]]
    offsets = np.concatenate([[0], np.cumsum([len(rows) for rows in token_rows])])
    keys = rng.standard_normal((offsets[-1], 1, 2)).astype(np.float32)
    values = rng.standard_normal(keys.shape).astype(np.float32)
    numattn.store_kv(caches[0], keys, offsets)
    numattn.store_kv(caches[1], values, offsets)
    return pool, caches, offsets, keys, values, token_rows


@pytest.mark.parametrize("kind", ["paged", "continuous"])
def test_store_kv_writes_the_pages_of_a_fused_pool(kind, rng):
    """store_kv into the K and V halves of a fused pool writes the pages the table names
    (it wrote page p * 2 of the pool, another sequence's, for table entry p)."""
    pool, _, offsets, keys, values, token_rows = _store_into_fused_pool(kind, rng)
    written = np.zeros(pool.shape[:3], bool)
    for b, rows in enumerate(token_rows):
        for i, (page, slot) in enumerate(rows):
            row = offsets[b] + i
            assert np.array_equal(pool[page, 0, slot], keys[row])
            assert np.array_equal(pool[page, 1, slot], values[row])
            written[page, :, slot] = True
    assert not pool[~written].any()  # nothing else was touched


# Read-only blocks are a kernel specialisation of their own (compiled once per dtype).
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["paged", "continuous"])
def test_operations_read_what_store_kv_wrote_into_a_fused_pool(kind, rng):
    _, caches, offsets, _, _, _ = _store_into_fused_pool(kind, rng)
    q = rng.standard_normal((offsets[-1], 2, 2)).astype(np.float32)
    q_max = int(np.diff(offsets).max())
    out = numattn.cross_attention(q, offsets, q_max, *caches, offsets)
    want = numattn.reference.cross_attention(q, offsets, q_max, *caches, offsets)
    assert_close(out, want, np.float32)


def test_k_and_v_with_different_page_strides_are_read_in_place(rng):
    pool = rng.standard_normal((4, 2, 3, 1, 4))
    k_blocks, v_blocks = pool[:, 0], rng.standard_normal((4, 3, 1, 4))
    lengths, table = np.array([5]), np.array([[2, 0]])
    k = numattn.PagedKVCache(k_blocks, lengths, table)
    v = numattn.PagedKVCache(v_blocks, lengths, table)
    layout = resolve_kv(k, v, batch=1, kv_lens=np.ones(1, np.int64))
    assert np.shares_memory(layout.k_blocks, pool)  # strided rows, no copy
    q = rng.standard_normal((1, 2, 4))
    want = numattn.reference.decode_attention(q, k, v)
    np.testing.assert_allclose(numattn.decode_attention(q, k, v), want, rtol=1e-12, atol=1e-12)
