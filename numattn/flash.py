"""``flash_attention_kv_cache``: blocked (flash) attention over KV caches.

Checks the arguments, normalises every input form (padded BSHD or ragged queries; dense,
ragged, continuous-batching or paged K/V) to one ragged problem over the paged addressing
of :func:`numattn.core.kv_cache.resolve_kv`, and runs the CPU kernel
(:func:`numattn.kernels.cpu.flash.run_flash_cpu`).
"""

from __future__ import annotations

import numpy as np

from .core.config import resolve_config
from .core.kv_cache import KVCache, resolve_kv
from .core.masks import additive_4d, compile_mask
from .core.validate import (
    check_array,
    check_float_dtype,
    check_heads,
    check_no_overlap,
    check_out,
    check_row_offsets,
    check_scale,
    check_sink_weights,
    host_int_array,
    row_counts,
    same_elements,
    shape_of,
)

__all__ = ["flash_attention_kv_cache"]


def flash_attention_kv_cache(q, k, v, mask, scale=None, *, q_input_row_offsets=None,
                             kv_input_row_offsets=None, sink_weights=None, out=None,
                             return_lse=False, config=None):
    """Attention of new query tokens over a KV cache, on the CPU (flash attention).

    Query row ``r`` of sequence ``b`` sits at position
    ``q_idx = num_keys(b) - q_len(b) + r`` and attends over keys ``0 .. num_keys(b) - 1``
    that ``mask`` leaves visible: ``out = softmax(scale * q k^T [+ additive]) v``, with
    query head ``h`` reading KV head ``h // (H // Hkv)``.

    Parameters
    ----------
    q : ndarray, float32 or float64
        Padded queries ``[B, S, H, D]``, or ragged ``[T, H, D]`` together with
        ``q_input_row_offsets``.
    k, v : ndarray, ContinuousBatchingKVCache or PagedKVCache
        Keys and values, of ``q``'s dtype: dense ``[B, N, Hkv, D]`` arrays (padded queries;
        ``num_keys = N``), ragged ``[T_kv, Hkv, D]`` arrays (ragged queries; split by
        ``kv_input_row_offsets``, else by ``q_input_row_offsets``), or two caches that
        hold ``cache_lengths[b]`` earlier tokens followed by this step's ``kv_len(b)`` new
        rows (``kv_len = S`` for padded queries; for ragged ones the lengths given by
        ``kv_input_row_offsets``, else by ``q_input_row_offsets``).
    mask : Mask, ndarray or None
        A mask object (``None`` means :class:`~numattn.NullMask`) or an additive tensor
        ``[S, N]``, ``[B, S, N]`` or ``[B, H, S, N]`` indexed by local query row and key
        position: ``S`` is q's ``S`` for padded input (for ragged input, at least the largest
        ``q_len``), and ``N`` at least the largest ``num_keys``.
    scale : float, optional
        Score scale; ``None`` means ``1 / sqrt(D)``.
    q_input_row_offsets : int array [B + 1], optional
        Rows of sequence ``b`` in a ragged ``q``: ``offsets[b]:offsets[b + 1]``.
    kv_input_row_offsets : int array [B + 1], optional
        New K/V rows per sequence (ragged queries only).
    sink_weights : ndarray [H], optional
        One sink logit per query head, counted once in each row's softmax denominator.
    out : ndarray, optional
        C-contiguous array of ``q``'s shape and dtype, written in place and returned.  It
        may be ``q`` itself, but must not share memory with ``k``, ``v``, the mask's
        tensor or ``sink_weights``, nor overlap ``q`` otherwise (``ValueError``).
    return_lse : bool, default False
        Also return the natural-log log-sum-exp of every row, ``[B, S, H]`` or ``[T, H]``.
    config : MHAConfig, optional
        ``block_q`` (query positions per tile) and ``block_k`` (keys per tile).

    Returns
    -------
    out : ndarray
        Same shape and dtype as ``q``; rows with no visible key are 0.
    lse : ndarray
        Only with ``return_lse=True``: ``-inf`` (or the sink logit) for rows with no
        visible key.

    Raises
    ------
    TypeError
        If an argument has the wrong type or dtype.
    ValueError
        If shapes, offsets, cache tables or the mask do not fit together.

    Examples
    --------
    >>> import numpy as np
    >>> from numattn import CausalMask
    >>> from numattn.flash import flash_attention_kv_cache
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((1, 3, 2, 8)).astype(np.float32)
    >>> kv = rng.standard_normal((1, 5, 1, 8)).astype(np.float32)
    >>> out, lse = flash_attention_kv_cache(q, kv, kv, CausalMask(), return_lse=True)
    >>> out.shape, lse.shape
    ((1, 3, 2, 8), (1, 3, 2))
    """
    config = resolve_config(config)
    if not isinstance(q, np.ndarray):
        check_array("q", q)
        raise TypeError(
            f"q must be a NumPy array (flash_attention_kv_cache runs on the CPU), got "
            f"{type(q).__name__}"
        )
    dtype = check_float_dtype("q", q)
    for name, x in (("k", k), ("v", v)):
        data = x.blocks if isinstance(x, KVCache) else x
        if hasattr(data, "__cuda_array_interface__") and not isinstance(data, np.ndarray):
            raise TypeError(f"{name} must be held in NumPy arrays (this operation runs on the "
                            "CPU), got a device array")
    if q_input_row_offsets is None:
        check_array("q", q, ndim=4)
        if kv_input_row_offsets is not None:
            raise ValueError("kv_input_row_offsets needs ragged queries: pass "
                             "q_input_row_offsets with q of shape [T, H, D]")
        batch, s_len, num_heads, head_dim = shape_of(q)
        if not isinstance(k, KVCache):
            check_array("k", k)
            check_array("v", v)
            if len(shape_of(k)) != 4:
                raise ValueError(f"with padded q, k and v must be [B, N, Hkv, D] arrays or "
                                 f"caches, got k of shape {list(shape_of(k))}")
        q_offsets = np.arange(batch + 1, dtype=np.int64) * s_len
        q_lens = np.full(batch, s_len, dtype=np.int64)
        layout = resolve_kv(k, v, batch=batch, dtype=dtype, kv_lens=q_lens)
    else:
        check_array("q", q, ndim=3)
        total, num_heads, head_dim = shape_of(q)
        q_offsets = check_row_offsets("q_input_row_offsets", q_input_row_offsets, total,
                                      "q.shape[0]")
        batch = q_offsets.shape[0] - 1
        q_lens = row_counts(q_offsets)
        if isinstance(k, KVCache):
            if kv_input_row_offsets is None:
                kv_lens = q_lens
            else:
                kv_offsets = host_int_array("kv_input_row_offsets", kv_input_row_offsets)
                last = int(kv_offsets[-1]) if kv_offsets.size else 0
                kv_offsets = check_row_offsets("kv_input_row_offsets", kv_offsets, last,
                                               "its own last entry", batch=batch)
                kv_lens = row_counts(kv_offsets)
            layout = resolve_kv(k, v, batch=batch, dtype=dtype, kv_lens=kv_lens)
        else:
            check_array("k", k, ndim=(3, 4))
            if len(shape_of(k)) != 3:
                raise ValueError(f"with ragged q, k and v must be [T_kv, Hkv, D] arrays or "
                                 f"caches, got k of shape {list(shape_of(k))}")
            kv_offsets = q_offsets if kv_input_row_offsets is None else kv_input_row_offsets
            layout = resolve_kv(k, v, batch=batch, dtype=dtype, kv_offsets=kv_offsets)
        s_len = int(q_lens.max()) if batch else 0
    if head_dim < 1:
        raise ValueError(f"q must have a head dimension D >= 1, got shape {list(shape_of(q))}")
    if layout.head_dim != head_dim:
        raise ValueError(f"k and v must have head dim D = {head_dim} (q's), got "
                         f"{layout.head_dim}")
    check_heads(num_heads, layout.num_kv_heads)
    scale = check_scale(scale, head_dim, dtype)
    sinks = check_sink_weights(sink_weights, num_heads, dtype)
    program, additive = compile_mask(mask)
    if additive is not None and not isinstance(additive, np.ndarray):
        raise TypeError(f"the additive mask must be a NumPy array, got {type(additive).__name__}")
    max_keys = layout.max_keys
    additive4 = additive_4d(additive, batch=batch, num_heads=num_heads, max_q_len=s_len,
                            max_keys=max_keys, dtype=dtype,
                            exact_rows=q_input_row_offsets is None)
    check_out(out, shape_of(q), dtype)
    if out is not None and not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a NumPy array, got {type(out).__name__}")
    # out may be q itself (each tile of queries is read before its outputs are written),
    # not a view that overlaps q elsewhere (a tile's outputs would land on queries not read)
    inputs = {"k": layout.k_blocks, "v": layout.v_blocks, "mask": additive4,
              "sink_weights": sinks}
    if not same_elements(out, q):
        inputs["q (other than as q itself)"] = q
    check_no_overlap(out, inputs)
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")

    result = np.empty(q.shape, dtype=dtype) if out is None else out
    lse = np.empty(q.shape[:-1], dtype=dtype) if return_lse else None
    rows = q.shape[0] * q.shape[1] if q.ndim == 4 else q.shape[0]
    q_rows = np.ascontiguousarray(q).reshape(rows, num_heads, head_dim)
    q_start_pos = layout.num_keys - q_lens
    from .kernels.cpu.flash import run_flash_cpu  # kernel modules load at the first call

    run_flash_cpu(
        q_rows, q_offsets, q_start_pos, layout, program, additive4, additive is not None,
        scale, sinks, config, result.reshape(rows, num_heads, head_dim),
        None if lse is None else lse.reshape(rows, num_heads),
    )
    return (result, lse) if return_lse else result
