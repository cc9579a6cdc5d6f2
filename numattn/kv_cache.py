"""KV caches (:class:`ContinuousBatchingKVCache`, :class:`PagedKVCache`) and ``store_kv``,
which writes a step's new K or V rows into one."""

from __future__ import annotations

import numpy as np

from .core.kv_cache import (
    ContinuousBatchingKVCache,
    KVCache,
    PagedKVCache,
    resolve_cache,
)
from .core.validate import check_array, check_row_offsets, dtype_of, row_counts, shape_of

__all__ = ["ContinuousBatchingKVCache", "PagedKVCache", "store_kv"]


def store_kv(cache, new_rows, input_row_offsets):
    """Write this step's new K (or V) rows into a cache, after its cached tokens.

    Row ``i`` of sequence ``b`` (``new_rows[input_row_offsets[b] + i]``) is stored at token
    position ``cache.cache_lengths[b] + i``.  ``cache_lengths`` itself is not changed: it
    keeps counting the tokens that were there before this step, as the attention
    operations expect.  Everything is validated before anything is written.

    Parameters
    ----------
    cache : ContinuousBatchingKVCache or PagedKVCache
        The cache to write into (host arrays).
    new_rows : ndarray, shape [T, Hkv, D]
        New rows of all sequences, concatenated; the cache's dtype.
    input_row_offsets : int array, shape [B + 1]
        Sequence ``b`` owns rows ``input_row_offsets[b]:input_row_offsets[b + 1]``.

    Returns
    -------
    cache
        The same cache object, for chaining.

    Raises
    ------
    ValueError
        If a row would land past the sequence's capacity (checked without overflow, also
        for ``cache_lengths`` near the int64 limit) or on a page index out of range, or if
        shapes disagree.
    TypeError
        If ``cache`` is not a cache or dtypes disagree.

    Examples
    --------
    >>> import numpy as np
    >>> from numattn import PagedKVCache, store_kv
    >>> pages = np.zeros((4, 2, 1, 3), dtype=np.float32)
    >>> cache = PagedKVCache(pages, np.array([1]), np.array([[2, 0, 4]]))
    >>> rows = np.ones((2, 1, 3), dtype=np.float32)
    >>> _ = store_kv(cache, rows, np.array([0, 2]))
    >>> pages[2, 1, 0].tolist(), pages[0, 0, 0].tolist()
    ([1.0, 1.0, 1.0], [1.0, 1.0, 1.0])
    """
    if not isinstance(cache, KVCache):
        raise TypeError(
            "cache must be a ContinuousBatchingKVCache or PagedKVCache, got "
            f"{type(cache).__name__}"
        )
    if not isinstance(cache.blocks, np.ndarray):
        raise TypeError("store_kv writes host (NumPy) caches; cache.blocks is a device array")
    check_array("new_rows", new_rows, ndim=3)
    _, _, hkv, d = shape_of(cache.blocks)
    if shape_of(new_rows)[1:] != (hkv, d):
        raise ValueError(
            f"new_rows must have shape [T, Hkv={hkv}, D={d}], got {list(shape_of(new_rows))}"
        )
    if dtype_of(new_rows) != dtype_of(cache.blocks):
        raise TypeError(
            f"new_rows must have the cache's dtype {dtype_of(cache.blocks)}, got "
            f"{dtype_of(new_rows)}"
        )
    batch = cache.batch_size
    offsets = check_row_offsets(
        "input_row_offsets", input_row_offsets, new_rows.shape[0], "new_rows.shape[0]",
        batch=batch,
    )
    kv_lens = row_counts(offsets)
    layout = resolve_cache(cache, cache, batch=batch, dtype=dtype_of(cache.blocks),
                            kv_lens=kv_lens)
    seq = np.repeat(np.arange(batch), kv_lens)
    token = layout.cache_lengths[seq] + (np.arange(new_rows.shape[0]) - offsets[seq])
    pos = layout.row_base[seq] + token
    # the caller's pages (the K or V half of a fused pool is read through a view whose
    # page p * page_step is its page p)
    pages = layout.lookup_table[seq, pos // layout.page_size] // layout.page_step
    slots = pos % layout.page_size
    cache.blocks[pages, slots] = new_rows
    return cache
