"""KV caches (:class:`ContinuousBatchingKVCache`, :class:`PagedKVCache`) and ``store_kv``,
which writes a step's new K or V rows into one."""

from __future__ import annotations

import numpy as np

from .core.device import check_stream, is_device_array, require_cuda
from .core.dtypes import kernel_view, storage_format
from .core.interop import as_array
from .core.kv_cache import (
    ContinuousBatchingKVCache,
    KVCache,
    PagedKVCache,
    resolve_cache,
)
from .core.validate import (
    check_array,
    check_kv_dtype,
    check_row_offsets,
    dtype_of,
    row_counts,
    shape_of,
)

__all__ = ["ContinuousBatchingKVCache", "PagedKVCache", "store_kv"]


def store_kv(cache, new_rows, input_row_offsets, *, stream=None):
    """Write this step's new K (or V) rows into a cache, after its cached tokens.

    Row ``i`` of sequence ``b`` (``new_rows[input_row_offsets[b] + i]``) is stored at token
    position ``cache.cache_lengths[b] + i``.  ``cache_lengths`` itself is not changed: it
    keeps counting the tokens that were there before this step, as the attention
    operations expect.  Everything is validated before anything is written.

    Parameters
    ----------
    cache : ContinuousBatchingKVCache or PagedKVCache
        The cache to write into: host arrays, or device arrays of any storage dtype
        (written on the device by a CUDA kernel with the same bits as on the host;
        ``new_rows`` may be on the host or the device, float32 or float64 there, float32
        for a cache with scales; the lengths and tables stay on the host).
    new_rows : ndarray, shape [T, Hkv, D]
        New rows of all sequences, concatenated, of any float dtype (float64, float32,
        float16, bfloat16, float8): converted to the cache's dtype by rounding to nearest
        even (float8_e4m3fn saturating at +-448).  Into int8, and into float8 with scales,
        each (token, KV head) row gets the scale ``max|x| / 127`` (``/ 448`` for e4m3fn,
        ``/ 57344`` for e5m2) and stores ``x / scale`` rounded; rows stored before keep
        theirs.
    input_row_offsets : int array, shape [B + 1]
        Sequence ``b`` owns rows ``input_row_offsets[b]:input_row_offsets[b + 1]``.
    stream : numba.cuda stream, optional
        For a device cache: the stream the copies and the kernel are queued on (``None``:
        the default stream).  The write is then asynchronous: later work on that stream
        sees it; synchronize before reading the cache from another stream or the host.

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
        If ``cache`` is not a cache, ``new_rows`` is not of a float dtype or ``stream`` is
        not a stream (a ``ValueError`` if given with a host cache).

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
    new_rows = as_array("new_rows", new_rows)
    on_device = is_device_array(cache.blocks)
    stream = check_stream(stream, "cuda" if on_device else "cpu")
    check_array("new_rows", new_rows, ndim=3)
    _, _, hkv, d = shape_of(cache.blocks)
    if shape_of(new_rows)[1:] != (hkv, d):
        raise ValueError(
            f"new_rows must have shape [T, Hkv={hkv}, D={d}], got {list(shape_of(new_rows))}"
        )
    if dtype_of(new_rows) == np.int8:
        raise TypeError("new_rows must be of a float dtype (store_kv quantizes them into an "
                        "int8 cache), got int8")
    check_kv_dtype("new_rows", new_rows)
    if on_device and is_device_array(new_rows) and (
            dtype_of(new_rows) not in (np.float32, np.float64)
            or (cache.scales is not None and dtype_of(new_rows) != np.float32)):
        raise TypeError(f"device new_rows must be float32 or float64 (float32 for a cache "
                        f"with scales), got {dtype_of(new_rows)}: widen them on the device, "
                        f"or pass host rows")
    batch = cache.batch_size
    offsets = check_row_offsets(
        "input_row_offsets", input_row_offsets, new_rows.shape[0], "new_rows.shape[0]",
        batch=batch,
    )
    kv_lens = row_counts(offsets)
    layout = resolve_cache(cache, cache, batch=batch, kv_lens=kv_lens)
    seq = np.repeat(np.arange(batch), kv_lens)
    token = layout.cache_lengths[seq] + (np.arange(new_rows.shape[0]) - offsets[seq])
    pos = layout.row_base[seq] + token
    # the caller's pages (the K or V half of a fused pool is read through a view whose
    # page p * page_step is its page p)
    pages = layout.lookup_table[seq, pos // layout.page_size] // layout.page_step
    slots = pos % layout.page_size
    if on_device:
        _store_on_device(cache, pages, slots, new_rows, stream)
        return cache
    stored, scales = _stored_rows(new_rows, cache.blocks.dtype, cache.scales is not None)
    cache.blocks[pages, slots] = stored
    if scales is not None:
        cache.scales[pages, slots] = scales
    return cache


def _store_on_device(cache, pages, slots, new_rows, stream):
    """``cache.blocks[pages, slots] = new_rows`` on the device, rounded (and quantized) as
    :func:`_stored_rows` does, queued on ``stream`` (``new_rows`` copied over if on the host:
    16-bit ones widened first, exactly; float64 ones for a cache with scales rounded to
    float32 first, as on the CPU)."""
    cuda = require_cuda()

    def device_view(x):  # Numba's device arrays as they are; other libraries' wrapped
        return x if hasattr(x, "copy_to_host") else cuda.as_cuda_array(x)

    scaled = cache.scales is not None
    if is_device_array(new_rows):
        new_rows = device_view(new_rows)
    else:
        wide = np.float64 if new_rows.dtype == np.float64 and not scaled else np.float32
        new_rows = cuda.to_device(np.ascontiguousarray(new_rows, dtype=wide), stream=stream)
    dtype = dtype_of(cache.blocks)
    blocks = kernel_view(device_view(cache.blocks))
    from .kernels.cuda.store import run_store_cuda  # kernel modules load at the first call

    rows = np.ascontiguousarray(np.stack([pages, slots]), dtype=np.int64)
    rows = cuda.to_device(rows, stream=stream)
    run_store_cuda(blocks, rows[0], rows[1], new_rows, stream, storage_format(dtype),
                   device_view(cache.scales) if scaled else None,
                   _QUANT_MAX.get(dtype.name, 0.0))


#: The largest finite magnitude of each quantized format: a row's scale maps its largest
#: element there.
_QUANT_MAX = {"int8": 127.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


def _stored_rows(rows, dtype, scaled):
    """``(rows in dtype, scales or None)``: rounded to nearest even (e4m3fn saturating);
    quantized with one scale per (row, head) when ``scaled``."""
    rows = np.asarray(rows)
    if not scaled:
        if dtype.name == "float8_e4m3fn":  # saturate: past 464 the format has only NaN
            if rows.dtype not in (np.float32, np.float64):
                rows = rows.astype(np.float32)  # exact: every 16- or 8-bit float is one
            rows = np.clip(rows, -448.0, 448.0)
        from .kernels.cpu.convert import rounded

        return rounded(rows, dtype), None
    wide = rows.astype(np.float32)
    scales = np.abs(wide).max(axis=-1) / np.float32(_QUANT_MAX[dtype.name])
    safe = np.where(scales > 0, scales, np.float32(1))[..., None]
    if dtype == np.int8:
        return np.clip(np.rint(wide / safe), -127, 127).astype(np.int8), scales
    return np.clip(wide / safe, -_QUANT_MAX[dtype.name], _QUANT_MAX[dtype.name]).astype(
        dtype), scales
