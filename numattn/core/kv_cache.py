"""KV caches, the single addressing scheme the kernels read them through.

Two cache types hold one layer's keys *or* values (k and v are two objects that share
``cache_lengths`` and ``lookup_table``):

* :class:`ContinuousBatchingKVCache`: ``blocks[num_blocks, max_seq_len, Hkv, D]``; token
  ``t`` of sequence ``b`` lives at ``blocks[lookup_table[b], t]``.
* :class:`PagedKVCache`: ``blocks[num_pages, page_size, Hkv, D]``; token ``t`` of sequence
  ``b`` lives at ``blocks[lookup_table[b, t // page_size], t % page_size]``.

Plain arrays are accepted too (dense ``[B, N, Hkv, D]`` or ragged ``[T, Hkv, D]``).  All four
become one :class:`KVLayout`: a paged view ``blocks[pages, page_size, Hkv, D]`` with a lookup
table and a per-sequence ``row_base``, so that every kernel locates token ``t`` of sequence
``b`` with the same body, :func:`numattn.kernels.shared.paging.kv_page_slot`::

    p = row_base[b] + t
    page, slot = lookup_table[b, p // page_size], p % page_size

Every table entry a needed token uses is checked against the array bounds on the host
before a kernel runs; spare entries may hold any sentinel.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np

from .dtypes import is_quantized, kernel_view, storage_format
from .interop import as_array
from .jit import cpu_jit
from .validate import (
    FLOAT_DTYPES,
    INT64_MAX,
    check_array,
    check_kv_dtype,
    check_row_offsets,
    dtype_of,
    host_int_array,
    row_counts,
    shape_of,
)

__all__ = [
    "ContinuousBatchingKVCache",
    "KVCache",
    "KVLayout",
    "PagedKVCache",
    "PlannedKV",
    "kv_storage",
    "resolve_kv",
]


def _check_scales(cls, scales, blocks, dtype):
    """``scales`` of a cache: float32 ``blocks.shape[:3]`` for int8 (required) and float8."""
    if scales is None:
        if dtype == np.int8:
            raise ValueError(f"{cls} of int8 blocks needs scales (float32, shaped "
                             f"blocks.shape[:3] = {list(shape_of(blocks)[:3])})")
        return
    if not is_quantized(dtype):
        raise ValueError(f"{cls}.scales are for int8 and float8 blocks, not {dtype}")
    check_array(f"{cls}.scales", scales, ndim=3)
    if dtype_of(scales) != np.float32:
        raise TypeError(f"{cls}.scales must be float32, got {dtype_of(scales)}")
    if tuple(shape_of(scales)) != tuple(shape_of(blocks)[:3]):
        raise ValueError(f"{cls}.scales must have shape blocks.shape[:3] = "
                         f"{list(shape_of(blocks)[:3])}, got {list(shape_of(scales))}")


class _CacheBase:
    def __post_init__(self):
        cls = type(self).__name__
        for name in ("blocks", "scales", "cache_lengths", "lookup_table"):
            # a tensor of another library: the NumPy array over its memory, kept
            object.__setattr__(self, name, as_array(f"{cls}.{name}", getattr(self, name)))
        if not (hasattr(self.blocks, "shape") and hasattr(self.blocks, "dtype")):
            raise TypeError(
                f"{cls}.blocks must be a NumPy or CUDA device array (store_kv writes the cache "
                f"in place, so it is never copied), got {type(self.blocks).__name__}"
            )
        check_array(f"{cls}.blocks", self.blocks, ndim=4)
        dtype = check_kv_dtype(f"{cls}.blocks", self.blocks)
        _check_scales(cls, self.scales, self.blocks, dtype)
        lengths = host_int_array(f"{cls}.cache_lengths", self.cache_lengths)
        if np.any(lengths < 0):
            raise ValueError(f"{cls}.cache_lengths must be >= 0, got min {lengths.min()}")
        table = host_int_array(f"{cls}.lookup_table", self.lookup_table, ndim=self._table_ndim)
        # Index sequences become int64 arrays, so the attributes always have a shape;
        # arrays (host or device) are kept as given.
        if isinstance(self.cache_lengths, (list, tuple)):
            object.__setattr__(self, "cache_lengths", lengths)
        if isinstance(self.lookup_table, (list, tuple)):
            object.__setattr__(self, "lookup_table", table)
        if table.shape[0] != lengths.shape[0]:
            raise ValueError(
                f"{cls}.lookup_table has {table.shape[0]} rows but cache_lengths has "
                f"{lengths.shape[0]} sequences"
            )

    @property
    def batch_size(self) -> int:
        """Number of sequences (the length of ``cache_lengths``)."""
        return int(self.cache_lengths.shape[0])

    @property
    def num_kv_heads(self) -> int:
        return int(self.blocks.shape[2])

    @property
    def head_dim(self) -> int:
        return int(self.blocks.shape[3])

    @property
    def dtype(self):
        return dtype_of(self.blocks)

    def with_cache_lengths(self, cache_lengths):
        """The same storage with new ``cache_lengths`` (e.g. after a step's tokens)."""
        return replace(self, cache_lengths=cache_lengths)


@dataclass(frozen=True, eq=False)
class ContinuousBatchingKVCache(_CacheBase):
    """One contiguous block of ``max_seq_len`` token slots per sequence.

    Parameters
    ----------
    blocks : ndarray, shape [num_blocks, max_seq_len, Hkv, D]
        Key (or value) storage in any K/V dtype (float64, float32, float16, bfloat16,
        float8_e4m3fn, float8_e5m2, int8 with ``scales``): a NumPy or CUDA device array,
        never copied (:func:`store_kv` writes into it).  A NumPy view whose rows of ``D``
        are contiguous is read in place through its strides: head-major blocks
        ``[num_blocks, Hkv, max_seq_len, D]`` given as ``blocks.swapaxes(1, 2)``, the K half
        of a fused ``[num_blocks, 2, max_seq_len, Hkv, D]`` pool.  Only a view whose last
        axis is strided is copied, on every call ("Head-major K/V" in the concepts page).
    cache_lengths : int array or sequence of ints, shape [B]
        Tokens cached for each sequence *before* this step.  A list or tuple is stored as
        an int64 array; an array is kept as given.
    lookup_table : int array or sequence of ints, shape [B]
        The block of each sequence (a list or tuple is stored as an int64 array).
    scales : float32 ndarray, shape blocks.shape[:3], optional
        Quantized storage (int8, or float8 with a scale): one scale per slot and KV head;
        the value a kernel uses is ``stored * scale``.  Required for int8, optional for
        float8 (none means 1), refused for other dtypes.  :func:`store_kv` sets them.

    Raises
    ------
    TypeError
        If ``blocks`` is not an array of a K/V dtype, ``scales`` not float32, or the index
        arguments are not integer.
    ValueError
        If shapes disagree or a cache length is negative.

    Examples
    --------
    >>> import numpy as np
    >>> from numattn import ContinuousBatchingKVCache
    >>> blocks = np.zeros((4, 16, 2, 8), dtype=np.float32)
    >>> cache = ContinuousBatchingKVCache(blocks, np.array([3, 0]), np.array([2, 0]))
    >>> cache.capacity, cache.batch_size
    (16, 2)
    """

    blocks: np.ndarray
    cache_lengths: np.ndarray
    lookup_table: np.ndarray
    scales: np.ndarray | None = None
    _table_ndim = 1

    @property
    def capacity(self) -> int:
        """Token slots per sequence (``max_seq_len``)."""
        return int(self.blocks.shape[1])


@dataclass(frozen=True, eq=False)
class PagedKVCache(_CacheBase):
    """Fixed-size pages shared by all sequences, found through a per-sequence page table.

    Parameters
    ----------
    blocks : ndarray, shape [num_pages, page_size, Hkv, D]
        Key (or value) pages in any K/V dtype (float64, float32, float16, bfloat16,
        float8_e4m3fn, float8_e5m2, int8 with ``scales``): a NumPy or CUDA device array,
        never copied (:func:`store_kv` writes into it).  A NumPy view whose rows of ``D``
        are contiguous is read in place through its strides: head-major pages
        ``[num_pages, Hkv, page_size, D]`` (vLLM's and FlashInfer's HND layout) given as
        ``pages.swapaxes(1, 2)``, the K half of a fused ``[pages, 2, page_size, Hkv, D]``
        pool.  Only a view whose last axis is strided is copied, on every call
        ("Head-major K/V" in the concepts page).
    cache_lengths : int array or sequence of ints, shape [B]
        Tokens cached for each sequence *before* this step.  A list or tuple is stored as
        an int64 array; an array is kept as given.
    lookup_table : int array or nested sequence of ints, shape [B, max_pages]
        Page ``j`` of sequence ``b`` is ``blocks[lookup_table[b, j]]``.  Entries that no
        needed token uses may hold any value (a sentinel such as ``num_pages``).  A list or
        tuple is stored as an int64 array.
    scales : float32 ndarray, shape blocks.shape[:3], optional
        Quantized storage (int8, or float8 with a scale): one scale per slot and KV head;
        the value a kernel uses is ``stored * scale``.  Required for int8, optional for
        float8 (none means 1), refused for other dtypes.  :func:`store_kv` sets them.

    Raises
    ------
    TypeError
        If ``blocks`` is not an array of a K/V dtype, ``scales`` not float32, or the index
        arguments are not integer.
    ValueError
        If shapes disagree or a cache length is negative.

    Examples
    --------
    >>> import numpy as np
    >>> from numattn import PagedKVCache
    >>> pages = np.zeros((8, 4, 2, 16), dtype=np.float32)
    >>> table = np.array([[5, 1, 8], [0, 8, 8]])  # 8 = unused
    >>> cache = PagedKVCache(pages, np.array([6, 2]), table)
    >>> cache.page_size, cache.capacity
    (4, 12)
    """

    blocks: np.ndarray
    cache_lengths: np.ndarray
    lookup_table: np.ndarray
    scales: np.ndarray | None = None
    _table_ndim = 2

    @property
    def page_size(self) -> int:
        return int(self.blocks.shape[1])

    @property
    def capacity(self) -> int:
        """Token slots per sequence (``max_pages * page_size``)."""
        return int(self.lookup_table.shape[1]) * self.page_size


KVCache = (ContinuousBatchingKVCache, PagedKVCache)


class KVLayout(NamedTuple):
    """K and V of one call, normalised to the paged addressing every kernel uses.

    The first nine fields, in this order, are what the kernels take: ``layout[:9]`` is a
    plain tuple of :class:`numattn.core.problem.PagedKV`'s fields (Numba types a plain
    tuple in C, a NamedTuple in Python, slower at every call).
    """

    k_blocks: object  # [pages, page_size, Hkv, D], host or device: the kernel view (dtypes)
    v_blocks: object
    page_size: int
    lookup_table: np.ndarray  # int64 [B, max_pages]
    row_base: np.ndarray  # int64 [B]
    num_keys: np.ndarray  # int64 [B]: keys each sequence attends over
    k_scales: object  # float32 [pages, page_size, Hkv], or [0, 0, 0] without scales
    v_scales: object
    kv_format: int  # numattn.core.dtypes.FORMAT_*
    cache_lengths: np.ndarray  # int64 [B]: tokens before this step (0 for plain arrays)
    num_kv_heads: int
    head_dim: int
    max_keys: int  # num_keys.max() (0 for no sequence)
    total_keys: int  # num_keys.sum()
    page_step: int  # lookup_table holds the caller's page p as p * page_step (_page_view)
    dtype: np.dtype  # K and V's stored dtype

    def with_storage(self, storage):
        """The same addressing over another layer's :class:`KVStorage` (of the same shape,
        dtype and page step, as :func:`kv_storage` gives them)."""
        return KVLayout(storage.k_pages, storage.v_pages, *self[2:6], storage.k_scales,
                        storage.v_scales, *self[8:])


class KVStorage(NamedTuple):
    """What :func:`kv_storage` gives: the pages as kernels read them and their scales."""

    k_pages: object
    v_pages: object
    k_scales: object
    v_scales: object
    step: int


#: Scales of storage without them.
NO_SCALES = np.ones((0, 0, 0), dtype=np.float32)
NO_SCALES.flags.writeable = False


def _page_view(blocks):
    """``(pages, step)``: a C-contiguous array whose page ``p * step`` is page ``p`` of the
    4-d ``blocks``, sharing its memory when only the page stride is uneven, as in the K or
    V half of a fused pool (FlashInfer's ``[pages, 2, page_size, Hkv, D]``); otherwise
    ``(a contiguous copy, 1)``.  Device arrays are returned as they are.

    The view spans exactly the bytes from the first page of ``blocks`` to the end of its
    last one, all inside the array ``blocks`` is a view of, and is read-only.

    Other layouts whose rows of ``D`` are contiguous (head-major ``[pages, Hkv, page_size,
    D]`` seen through ``swapaxes(1, 2)``, torch's ``[B, Hkv, N, D]`` transposed) are
    returned as they are, step 1: the kernels read them through their strides (a strided
    compile of each kernel).  Only a layout whose last axis is not contiguous is copied.
    """
    if not isinstance(blocks, np.ndarray) or blocks.flags.c_contiguous:
        return blocks, 1
    num_pages, page_size, heads, dim = blocks.shape
    page_bytes = page_size * heads * dim * blocks.itemsize
    stride = blocks.strides[0]
    if num_pages and page_bytes and stride > 0 and stride % page_bytes == 0 \
            and blocks[:1].flags.c_contiguous:
        step = stride // page_bytes
        view = np.lib.stride_tricks.as_strided(
            blocks, shape=((num_pages - 1) * step + 1, page_size, heads, dim),
            strides=(page_bytes, *blocks.strides[1:]), writeable=False)
        return view, step
    return _as_strided_pages(blocks), 1


def strided_rows(blocks):
    """Whether the kernels read 4-d ``blocks`` in place through its strides: its rows of
    ``D`` are contiguous (the vector loads read them whole)."""
    return blocks.ndim == 4 and (blocks.shape[3] <= 1 or blocks.strides[3] == blocks.itemsize)


def _paged_views(k_blocks, v_blocks):
    """K and V pages for the kernels and the page step they share (see :func:`_page_view`);
    K and V with different page strides are read through their strides (step 1), or
    copied where their rows of ``D`` are not contiguous."""
    k_pages, k_step = _page_view(k_blocks)
    v_pages, v_step = _page_view(v_blocks)
    if k_step != v_step:
        return _as_strided_pages(k_blocks), _as_strided_pages(v_blocks), 1
    return k_pages, v_pages, k_step


def _as_strided_pages(blocks):
    if not isinstance(blocks, np.ndarray) or strided_rows(blocks):
        return blocks
    return np.ascontiguousarray(blocks)


def _check_pair(k, v):
    if type(k) is not type(v):
        raise TypeError(
            f"k and v must be the same kind of input, got {type(k).__name__} and "
            f"{type(v).__name__}"
        )
    if not isinstance(k, KVCache):  # dense [B, N, Hkv, D] or ragged [T, Hkv, D] arrays
        check_array("k", k, ndim=(3, 4))
        check_array("v", v, ndim=(3, 4))
    ks = shape_of(k.blocks if isinstance(k, KVCache) else k)
    vs = shape_of(v.blocks if isinstance(v, KVCache) else v)
    if ks != vs:
        raise ValueError(f"k and v must have the same shape, got {list(ks)} and {list(vs)}")


def resolve_kv(k, v, *, batch, kv_lens=None, kv_offsets=None):
    """Validate K/V and describe them as a :class:`KVLayout`.

    Parameters
    ----------
    k, v : cache objects, dense ``[B, N, Hkv, D]`` or ragged ``[T, Hkv, D]`` arrays
    batch : int
        Number of sequences B.
    kv_lens : int64 array [B] or None
        New K/V rows of this step per sequence (cache inputs), so that
        ``num_keys = cache_lengths + kv_lens``.  ``None`` means 0.
    kv_offsets : int64 array [B + 1] or None
        Ragged split of plain ``[T, Hkv, D]`` arrays (required for them).  Dense
        ``[B, N, Hkv, D]`` arrays give ``num_keys = N`` for every sequence.
    """
    _check_pair(k, v)
    if isinstance(k, KVCache):
        return resolve_cache(k, v, batch=batch, kv_lens=kv_lens)
    dtype = _check_kv_dtypes(k, v, plain=True)
    storage = kv_storage(k, v)
    step = storage.step
    if len(k.shape) == 4:
        b, n, hkv, d = shape_of(k)
        if b != batch:
            raise ValueError(f"k must have shape [B={batch}, N, Hkv, D], got {list(shape_of(k))}")
        table = (np.arange(batch, dtype=np.int64) * step).reshape(batch, 1)
        return KVLayout(
            storage.k_pages, storage.v_pages, max(n, 1), table, np.zeros(batch, np.int64),
            np.full(batch, n, np.int64), NO_SCALES, NO_SCALES, storage_format(dtype),
            np.zeros(batch, np.int64), hkv, d, n if batch else 0, batch * n, step, dtype,
        )
    t, hkv, d = shape_of(k)
    if kv_offsets is None:
        raise ValueError("ragged k and v of shape [T, Hkv, D] need row offsets")
    kv_offsets = check_row_offsets("kv_input_row_offsets", kv_offsets, t, "k.shape[0]",
                                   batch=batch)
    table = np.zeros((batch, 1), dtype=np.int64)
    num_keys = row_counts(kv_offsets)
    return KVLayout(
        storage.k_pages, storage.v_pages, max(t, 1), table, kv_offsets[:-1].copy(), num_keys,
        NO_SCALES, NO_SCALES, storage_format(dtype), np.zeros(batch, np.int64), hkv, d,
        int(num_keys.max(initial=0)), int(kv_offsets[-1] - kv_offsets[0]), 1, dtype,
    )


def kv_storage(k, v):
    """The :class:`KVStorage` of K and V of any kind (a cache's blocks, a dense
    ``[B, N, Hkv, D]`` array, or ragged ``[T, Hkv, D]`` rows as one page of ``T`` slots): the
    4-d pages the kernels read, as kernel views of their bits
    (:func:`numattn.core.dtypes.kernel_view`), sharing their memory where they can
    (:func:`_paged_views`), and a cache's scales.

    :func:`resolve_kv` takes its pages from here, and so does a plan for each layer's K/V.
    Shapes and dtypes are not checked here.
    """
    k_blocks, v_blocks = (k.blocks, v.blocks) if isinstance(k, KVCache) else (k, v)
    if (type(k_blocks) is np.ndarray and type(v_blocks) is np.ndarray and k_blocks.ndim == 4
            and k_blocks.flags.c_contiguous and v_blocks.flags.c_contiguous):
        k_pages, v_pages, step = k_blocks, v_blocks, 1  # the common case
    elif isinstance(k, KVCache) or len(k.shape) == 4:
        k_pages, v_pages, step = _paged_views(k_blocks, v_blocks)
    elif type(k_blocks) is np.ndarray and type(v_blocks) is np.ndarray:
        k_pages, v_pages, step = _paged_views(k_blocks[None], v_blocks[None])  # one page
    else:
        t, hkv, d = shape_of(k)
        k_pages = k.reshape(1, t, hkv, d)  # device rows (C-contiguous)
        v_pages = v.reshape(1, t, hkv, d)
        step = 1
    if dtype_of(k_pages) not in FLOAT_DTYPES:
        k_pages, v_pages = kernel_view(k_pages), kernel_view(v_pages)
    k_scales = v_scales = NO_SCALES
    if isinstance(k, KVCache) and k.scales is not None:
        k_scales, v_scales = _paged_scales(k.scales, step), _paged_scales(v.scales, step)
    return KVStorage(k_pages, v_pages, k_scales, v_scales, step)


def _paged_scales(scales, step):
    """Scales for pages seen with a page step (:func:`_page_view`): page ``p * step``."""
    if not isinstance(scales, np.ndarray):
        return scales  # a device array
    scales = np.ascontiguousarray(scales)
    if step == 1:
        return scales
    spread = np.zeros(((scales.shape[0] - 1) * step + 1, *scales.shape[1:]), np.float32)
    spread[::step] = scales
    return spread


def _check_kv_dtypes(k_blocks, v_blocks, plain):
    """K and V's stored dtype (the same for both); int8 only in a cache (with scales)."""
    k_dtype = check_kv_dtype("k", k_blocks)
    v_dtype = check_kv_dtype("v", v_blocks)
    if k_dtype != v_dtype:
        raise TypeError(f"k and v must have the same dtype, got {k_dtype} and {v_dtype}")
    if plain and k_dtype == np.int8:
        raise TypeError("int8 k and v need scales: hold them in a cache object "
                        "(PagedKVCache or ContinuousBatchingKVCache with scales=)")
    return k_dtype


def resolve_cache(k, v, *, batch, kv_lens):
    cls = type(k).__name__
    dtype = _check_kv_dtypes(k.blocks, v.blocks, plain=False)
    if (k.scales is None) != (v.scales is None):
        raise ValueError("k and v caches must both have scales or both have none")
    lengths = host_int_array(f"{cls}.cache_lengths", k.cache_lengths)
    table = host_int_array(f"{cls}.lookup_table", k.lookup_table, ndim=k._table_ndim)
    if k.cache_lengths is not v.cache_lengths and not np.array_equal(
        lengths, host_int_array("v.cache_lengths", v.cache_lengths)
    ):
        raise ValueError("k and v caches must share cache_lengths")
    if k.lookup_table is not v.lookup_table and not np.array_equal(
        table, host_int_array("v.lookup_table", v.lookup_table, ndim=k._table_ndim)
    ):
        raise ValueError("k and v caches must share lookup_table")
    if lengths.shape[0] != batch:
        raise ValueError(
            f"the cache holds {lengths.shape[0]} sequences (cache_lengths) but the queries "
            f"hold {batch}"
        )
    pages, page_size, hkv, d = shape_of(k.blocks)
    if isinstance(k, ContinuousBatchingKVCache):
        capacity = page_size
    else:
        capacity = min(table.shape[1] * page_size, INT64_MAX)
    # The constructor checked cache_lengths, but callers update it in place between steps.
    kv_lens = np.zeros(batch, np.int64) if kv_lens is None else kv_lens
    storage = kv_storage(k, v)
    step = storage.step
    if table.shape[0] != batch:  # fixed at construction; checked again before reading it
        raise ValueError(f"{cls}.lookup_table has {table.shape[0]} rows for {batch} sequences")
    table_2d = table if table.ndim == 2 else table.reshape(batch, 1)
    num_keys = np.empty(batch, dtype=np.int64)
    kernel_table = np.zeros(table_2d.shape, dtype=np.int64)
    error, b, j, max_keys, total_keys = cpu_jit(_check_cache_tables)(
        lengths, kv_lens, table_2d, capacity, pages, page_size, step, num_keys, kernel_table,
    )
    if error == _NEGATIVE_LENGTH:
        raise ValueError(f"{cls}.cache_lengths[{b}] must be >= 0, got {lengths[b]}")
    if error == _OVER_CAPACITY:
        length, new = int(lengths[b]), int(kv_lens[b])
        if isinstance(k, ContinuousBatchingKVCache):
            limit = f"the cache holds max_seq_len = {page_size}"
        else:
            limit = f"its lookup_table row holds {table.shape[1]} pages of {page_size}"
        raise ValueError(
            f"sequence {b} needs {length + new} tokens ({cls}.cache_lengths[{b}] = {length} "
            f"plus {new} new rows) but {limit}"
        )
    if error == _BAD_PAGE and isinstance(k, ContinuousBatchingKVCache):
        raise ValueError(
            f"lookup_table[{b}] = {table[b]} is out of range [0, {pages}) for a sequence "
            "with tokens"
        )
    if error == _BAD_PAGE:
        raise ValueError(
            f"lookup_table[{b}, {j}] = {table[b, j]} is out of range [0, {pages}) but "
            f"sequence {b} uses that page"
        )
    return KVLayout(
        storage.k_pages, storage.v_pages, max(page_size, 1), kernel_table, _zeros(batch),
        num_keys, storage.k_scales, storage.v_scales, storage_format(dtype), lengths, hkv, d,
        max_keys, total_keys, step, dtype,
    )


_NEGATIVE_LENGTH, _OVER_CAPACITY, _BAD_PAGE = 1, 2, 3


@functools.lru_cache(maxsize=64)
def _zeros(batch):
    """A cache's ``row_base``: zeros, shared by the calls (nothing writes to it)."""
    return np.zeros(batch, dtype=np.int64)


def _check_cache_tables(lengths, kv_lens, table, capacity, num_pages, page_size, step,
                        num_keys, kernel_table):
    """Check a cache's lengths and table in one compiled pass (a dozen NumPy steps on these
    small arrays would cost more than the kernel); nothing here raises.

    ``table`` is ``[B, P]`` (continuous batching: ``P = 1``, a sequence's page is its slot).
    Returns ``(error, b, j, max_keys, total_keys)``: ``error`` 0, or ``_NEGATIVE_LENGTH`` /
    ``_OVER_CAPACITY`` for sequence ``b`` (``cache_lengths[b] + kv_lens[b]`` past
    ``capacity``, compared with the room left so that lengths near the int64 limit cannot
    wrap), or ``_BAD_PAGE`` for entry ``(b, j)`` of a page the sequence uses that is outside
    ``[0, num_pages)``.  Fills ``num_keys [B] = cache_lengths + kv_lens`` (returning its
    largest entry and its sum, 0 for no sequence) and ``kernel_table [B, P]`` (zeros on
    entry): the table times ``step`` (see :func:`_page_view`), 0 in the entries no token
    uses, which may hold any sentinel.  The caller allocates them, as Numba hands each
    array it returns to Python at a cost.
    """
    batch, pages_per_row = table.shape
    max_keys = 0
    total_keys = 0
    for b in range(batch):
        length = lengths[b]
        if length < 0:
            return _NEGATIVE_LENGTH, b, 0, 0, 0
        if length > capacity or kv_lens[b] > capacity - length:
            return _OVER_CAPACITY, b, 0, 0, 0
        num_keys[b] = length + kv_lens[b]
        max_keys = max(max_keys, num_keys[b])
        total_keys += num_keys[b]
    for b in range(batch):
        if page_size == 0:
            used_pages = pages_per_row if num_keys[b] > 0 else 0
        else:
            used_pages = min(-(-num_keys[b] // page_size), pages_per_row)
        for j in range(used_pages):
            page = table[b, j]
            if page < 0 or page >= num_pages:
                return _BAD_PAGE, b, j, 0, 0
            kernel_table[b, j] = page * step
    return 0, 0, 0, max_keys, total_keys


class PlannedKV:
    """What a plan checks of each layer's K and V against those it was made from: the kind
    of input, the shape and dtype of the storage, and, for caches, the ``cache_lengths``
    and ``lookup_table`` (the same objects, or equal ones).

    Parameters
    ----------
    k, v : caches or arrays
        The K and V the plan was made from (checked already).
    layout : KVLayout
        Their layout (:func:`resolve_kv`); the plan keeps it without the pages.
    """

    def __init__(self, k, v, layout):
        self.kind = type(k)
        self.is_cache = isinstance(k, KVCache)
        storage = k.blocks if self.is_cache else k
        self.shape = tuple(shape_of(storage))
        self.dtype = dtype_of(storage)
        self.scaled = self.is_cache and k.scales is not None
        self.native = self.dtype in FLOAT_DTYPES and not self.scaled  # read as given
        self.layout = layout.with_storage(KVStorage(None, None, None, None, layout.page_step))
        # whether contiguous storage is read as it is (not ragged rows, nor pages of a pool)
        self.pages_as_given = len(self.shape) == 4 and layout.page_step == 1
        self.lengths = self.table = None
        if self.is_cache:
            cls = type(k).__name__
            self.lengths, self.table = k.cache_lengths, k.lookup_table  # the planned objects
            self.values = {  # host copies of their values
                name: host_int_array(f"{cls}.{name}", getattr(k, name), ndim=ndim).copy()
                for name, ndim in (("cache_lengths", 1), ("lookup_table", k._table_ndim))
            }

    def layout_of(self, k, v):
        """The planned layout over ``k`` and ``v``'s pages (:func:`kv_storage`).

        Raises
        ------
        ValueError
            If ``k`` or ``v`` is not of the planned kind, shape and dtype, or holds other
            cache tables than the plan's, or pages of another stride.
        """
        kind = self.kind
        if type(k) is kind and type(v) is kind:
            if self.is_cache:
                k_blocks, v_blocks = k.blocks, v.blocks
                same_tables = (k.cache_lengths is self.lengths and v.cache_lengths is self.lengths
                               and k.lookup_table is self.table and v.lookup_table is self.table
                               and (k.scales is not None) == self.scaled
                               and (v.scales is not None) == self.scaled)
            else:
                k_blocks, v_blocks, same_tables = k, v, True
            # the common case, in a few operations: the planned tables, contiguous host pages
            if (same_tables and self.pages_as_given and type(k_blocks) is np.ndarray
                    and type(v_blocks) is np.ndarray and k_blocks.shape == self.shape
                    and v_blocks.shape == self.shape and k_blocks.dtype == self.dtype
                    and v_blocks.dtype == self.dtype and k_blocks.flags.c_contiguous
                    and v_blocks.flags.c_contiguous):
                if self.native:
                    return self.layout.with_storage(
                        KVStorage(k_blocks, v_blocks, NO_SCALES, NO_SCALES, 1))
                return self.layout.with_storage(kv_storage(k, v))
        for name, x in (("k", k), ("v", v)):
            self._check(name, x)
        storage = kv_storage(k, v)
        if storage.step != self.layout.page_step:
            raise ValueError("k and v pages are laid out with another page stride than the "
                             "plan's: make a plan for this layout")
        return self.layout.with_storage(storage)

    def _check(self, name, x):
        """Refuse a K or V that is not what the plan was made for."""
        if type(x) is not self.kind:
            raise ValueError(f"{name} must be a {self.kind.__name__} as the plan's K/V "
                             f"were, got {type(x).__name__}")
        storage = x.blocks if self.is_cache else x
        dtype = dtype_of(storage)
        if tuple(shape_of(storage)) != self.shape or dtype != self.dtype:
            what = f"{name}.blocks" if self.is_cache else name
            raise ValueError(
                f"{what} must have the plan's shape {list(self.shape)} and dtype "
                f"{self.dtype}, got {list(shape_of(storage))} and {dtype}")
        if self.is_cache and (x.scales is not None) != self.scaled:
            raise ValueError(f"{name} must {'have' if self.scaled else 'have no'} scales, as "
                             f"the plan's {name} had")
        if self.is_cache:
            for attribute, planned in (("cache_lengths", self.lengths),
                                       ("lookup_table", self.table)):
                given = getattr(x, attribute)
                values = self.values[attribute]
                if given is not planned and not np.array_equal(
                        host_int_array(f"{name}.{attribute}", given, ndim=values.ndim), values):
                    raise ValueError(
                        f"{name}.{attribute} differs from the plan's (a plan holds one "
                        f"step's cache tables: make a new plan for new ones)")
