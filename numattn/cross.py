"""``cross_attention``: ragged queries over the keys of their sequence (seed: MAX's
``mha_cross_gpu_naive``).

Ragged queries ``q [T, H, D]`` split by ``q_input_row_offsets`` attend over the keys of
their sequence: ragged new K/V rows split by ``kv_input_row_offsets``, or a dense,
continuous-batching or paged cache that already holds them after its cached tokens, so
that ``num_keys(b) = cache_len(b) + kv_len(b)``.  Unlike the other operations, query row
``r`` of a sequence sits at ``q_idx = r`` for the masks (it is not bottom-right aligned).

On the CPU this is flash attention with every sequence's first query at position 0
(:func:`numattn.kernels.cpu.flash.run_flash_cpu`); on CUDA the tiled kernel of
:mod:`numattn.kernels.cuda.flash`.
"""

from __future__ import annotations

import numpy as np

from .core.config import resolve_config
from .core.device import is_device_array, require_cuda, resolve_device
from .core.kv_cache import KVCache, resolve_kv
from .core.masks import NullMask, additive_4d, compile_mask
from .core.validate import (
    check_array,
    check_float_dtype,
    check_heads,
    check_no_overlap,
    check_out,
    check_row_offsets,
    check_scale,
    dtype_of,
    host_int_array,
    row_counts,
    shape_of,
)

__all__ = ["cross_attention"]

#: The default mask (a frozen dataclass, safe to share).
NO_MASK = NullMask()


def cross_attention(q, q_input_row_offsets, q_max_seq_len, k, v, kv_input_row_offsets,
                    mask=NO_MASK, scale=None, *, device="auto", out=None, return_lse=False,
                    config=None):
    """Attention of ragged queries over ragged K/V rows or a KV cache, with ``q_idx = r``.

    Sequence ``b`` owns query rows ``q_input_row_offsets[b]:q_input_row_offsets[b + 1]``
    and attends over its ``num_keys(b) = cache_len(b) + kv_len(b)`` keys, where
    ``kv_len(b)`` comes from ``kv_input_row_offsets``.  Query row ``r`` of a sequence is at
    position ``q_idx = r`` for the mask (not bottom-right aligned).  GQA: query head ``h``
    reads KV head ``h // (H // Hkv)``.

    Parameters
    ----------
    q : array [T, H, D]
        Queries of all sequences, concatenated; float32 or float64.
    q_input_row_offsets : int array [B + 1]
        Ragged split of ``q`` (``0``, non-decreasing, ending at ``T``).
    q_max_seq_len : int
        Longest query sequence; must be at least every ``q_len(b)``.  Additive masks are
        padded to it.
    k, v : arrays [T_kv, Hkv, D] or [B, N, Hkv, D], or ContinuousBatchingKVCache / PagedKVCache
        Ragged new rows split by ``kv_input_row_offsets``; a dense array whose first
        ``kv_len(b)`` rows of sequence ``b`` are its keys (all ``N`` without offsets); or a
        cache whose ``cache_lengths`` count the tokens before this step, the new rows being
        stored right after them.  Same dtype as ``q``.
    kv_input_row_offsets : int array [B + 1] or None
        Ragged split of the new K/V rows, giving ``kv_len(b)``; ``None`` means
        ``kv_len = q_len`` (for dense arrays: all ``N`` rows).
    mask : Mask or ndarray, default NullMask()
        A mask object (seen with ``q_idx = r``) or an additive tensor ``[S, N]``,
        ``[B, S, N]`` or ``[B, H, S, N]`` with ``S >= q_max_seq_len`` and ``N`` at least the
        largest key count (indexed with the local row ``r`` and the key position).
    scale : float, optional
        Score scale; ``None`` means ``1 / sqrt(D)``.
    device : {"auto", "cpu", "cuda"}, default "auto"
        ``"auto"`` runs on CUDA when an input is a device array.  Device arrays are used in
        place; NumPy inputs with ``device="cuda"`` are copied over and the result back.
    out : array [T, H, D], optional
        Written in place and returned (C-contiguous, ``q``'s dtype).  It must not share
        memory with ``q``, ``k``, ``v`` or the mask's tensor (``ValueError``).
    return_lse : bool, default False
        Also return the natural-log log-sum-exp of the scores, ``[T, H]``.
    config : MHAConfig, optional
        Tile sizes (``block_q``, ``block_k``) and CUDA ``threads_per_block``.

    Returns
    -------
    out : array [T, H, D]
        A device array when ``q`` is one, else NumPy (``out`` itself when given).  Rows with
        no visible key are 0.
    lse : array [T, H]
        Only with ``return_lse=True``; ``-inf`` for rows with no visible key.

    Raises
    ------
    TypeError
        If an argument has the wrong type or dtype.
    ValueError
        If shapes, offsets, ``q_max_seq_len``, the cache tables or the mask disagree.
    numattn.CudaUnavailableError
        If CUDA is asked for where there is none.

    Notes
    -----
    A batch of zero sequences returns at once (leaving ``out`` untouched); nothing is read
    then, so the K/V caches may describe any number of sequences.  A sequence with zero
    keys gives 0 (never NaN) and ``lse = -inf``.

    Examples
    --------
    >>> import numpy as np
    >>> from numattn import CausalMask
    >>> from numattn.cross import cross_attention
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((5, 4, 8)).astype(np.float32)  # 2 sequences: 2 + 3 rows
    >>> kv = rng.standard_normal((7, 2, 8)).astype(np.float32)  # 4 + 3 key rows
    >>> out = cross_attention(q, [0, 2, 5], 3, kv, kv, [0, 4, 7], CausalMask())
    >>> out.shape
    (5, 4, 8)
    >>> bool(np.allclose(out[0, :, :], kv[0, [0, 0, 1, 1], :]))  # row 0 sees key 0 only
    True
    """
    # ---- validate everything before any work -------------------------------------------
    config = resolve_config(config)
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    check_array("q", q, ndim=3)
    dtype = check_float_dtype("q", q)
    num_tokens, num_heads, head_dim = shape_of(q)
    if head_dim < 1:
        raise ValueError(f"q must have a head dimension D >= 1, got shape {[*shape_of(q)]}")
    program, additive = compile_mask(mask)
    device = resolve_device(device, [q, *_kv_arrays(k), *_kv_arrays(v), out, additive])
    q_offsets = check_row_offsets("q_input_row_offsets", q_input_row_offsets, num_tokens,
                                  "q.shape[0]")
    batch = q_offsets.shape[0] - 1
    q_lens = row_counts(q_offsets)
    longest_query = int(q_lens.max(initial=0))
    q_max_seq_len = _check_q_max_seq_len(q_max_seq_len, longest_query)
    scale = check_scale(scale, head_dim, dtype)
    layout = _resolve_kv(k, v, kv_input_row_offsets, q_offsets, batch, dtype, device)
    if layout.head_dim != head_dim:
        raise ValueError(
            f"k and v must have head dimension D = {head_dim} (q.shape[2]), got "
            f"{layout.head_dim}"
        )
    group = check_heads(num_heads, layout.num_kv_heads)
    max_keys = layout.max_keys
    additive4 = additive_4d(additive, batch=batch, num_heads=num_heads,
                            max_q_len=q_max_seq_len, max_keys=max_keys, dtype=dtype)
    out = check_out(out, (num_tokens, num_heads, head_dim), dtype)
    # unlike flash's, the CUDA kernel accumulates in out: out must not be q either
    check_no_overlap(out, {"q": q, "k": layout.k_blocks, "v": layout.v_blocks,
                           "mask": additive4})
    if device == "cuda":
        cuda = require_cuda()
        for name, x in (("q", q), ("out", out), ("mask", additive)):
            _check_device_contiguous(cuda, name, x)

    # ---- dispatch ------------------------------------------------------------------------
    if batch == 0:  # nothing to compute: return at once, leaving ``out`` untouched
        return _empty_result(q, out, (num_tokens, num_heads, head_dim), dtype, return_lse)
    if device == "cpu":
        return _cross_cpu(q, q_offsets, layout, program, additive4, additive is not None,
                          scale, config, out, return_lse)
    from .kernels.cuda.flash import run_cross_cuda

    return run_cross_cuda(q, q_offsets, layout, program, additive4, additive is not None, scale,
                       group, config, out, return_lse)


# --------------------------------------------------------------------------------------
# Validation helpers.
# --------------------------------------------------------------------------------------
def _kv_arrays(x):
    """The arrays of a K or V input (for device detection)."""
    return (x.blocks,) if isinstance(x, KVCache) else (x,)


def _check_q_max_seq_len(q_max_seq_len, longest_query):
    if isinstance(q_max_seq_len, (bool, np.bool_)) or not isinstance(
        q_max_seq_len, (int, np.integer)
    ):
        raise TypeError(
            f"q_max_seq_len must be an integer, got {type(q_max_seq_len).__name__}"
        )
    if q_max_seq_len < longest_query:
        raise ValueError(
            f"q_max_seq_len must be >= every query sequence length ({longest_query} by "
            f"q_input_row_offsets), got {q_max_seq_len}"
        )
    return int(q_max_seq_len)


def _resolve_kv(k, v, kv_input_row_offsets, q_offsets, batch, dtype, device):
    """The :class:`KVLayout` of K/V, with ``num_keys = cache_len + kv_len`` per sequence."""
    if kv_input_row_offsets is None:
        kv_offsets = None
    else:
        kv_offsets = host_int_array("kv_input_row_offsets", kv_input_row_offsets)
        total = int(kv_offsets[-1]) if kv_offsets.shape[0] else 0
        kv_offsets = check_row_offsets("kv_input_row_offsets", kv_offsets, total,
                                       "its last entry", batch=batch)
    if device == "cuda":
        cuda = require_cuda()
        for name, x in (("k", k), ("v", v)):
            for arr in _kv_arrays(x):
                _check_device_contiguous(cuda, name, arr)
    if isinstance(k, KVCache):
        if batch == 0:  # nothing is read: accept a cache of any batch size
            return resolve_kv(k, v, batch=k.batch_size, dtype=dtype)
        kv_lens = row_counts(q_offsets if kv_offsets is None else kv_offsets)
        return resolve_kv(k, v, batch=batch, dtype=dtype, kv_lens=kv_lens)
    if hasattr(k, "shape") and len(k.shape) == 3:
        offsets = q_offsets if kv_offsets is None else kv_offsets
        if kv_offsets is None and shape_of(k)[0] != offsets[-1]:
            raise ValueError(
                f"ragged k of shape {list(shape_of(k))} needs kv_input_row_offsets (without "
                f"them the queries' split is used, which covers {offsets[-1]} rows)"
            )
        return resolve_kv(k, v, batch=batch, dtype=dtype, kv_offsets=offsets)
    layout = resolve_kv(k, v, batch=batch, dtype=dtype)
    if kv_offsets is not None and len(shape_of(k)) == 4:  # dense: first kv_len(b) rows
        kv_lens = row_counts(kv_offsets)
        n = shape_of(k)[1]
        if np.any(kv_lens > n):
            b = int(np.argmax(kv_lens > n))
            raise ValueError(
                f"kv_input_row_offsets gives sequence {b} {kv_lens[b]} key rows but the dense "
                f"k holds N = {n} per sequence"
            )
        layout = layout._replace(num_keys=kv_lens, max_keys=int(kv_lens.max(initial=0)),
                                 total_keys=int(kv_lens.sum()))
    return layout


def _check_device_contiguous(cuda, name, x):
    """Device arrays are used in place, so they must be C-contiguous."""
    if x is None or not is_device_array(x):
        return
    view = x if hasattr(x, "is_c_contiguous") else cuda.as_cuda_array(x)
    if not view.is_c_contiguous():
        raise ValueError(f"{name} must be C-contiguous on the device")


def _empty_result(q, out, shape, dtype, return_lse):
    """The result of a batch of zero sequences (nothing launched, ``out`` untouched)."""
    on_device = is_device_array(q if out is None else out)
    empty = require_cuda().device_array if on_device else np.empty
    result = out if out is not None else empty(shape, dtype=dtype)
    return (result, empty(shape[:2], dtype=dtype)) if return_lse else result


# --------------------------------------------------------------------------------------
# CPU: the flash kernel with every sequence's first query at position 0.
# --------------------------------------------------------------------------------------
def _cross_cpu(q, q_offsets, layout, program, additive, has_additive, scale, config, out,
               return_lse):
    num_tokens, num_heads, head_dim = shape_of(q)
    dtype = dtype_of(q)
    result = out if out is not None else np.empty((num_tokens, num_heads, head_dim), dtype)
    lse = np.empty((num_tokens, num_heads), dtype) if return_lse else None
    batch = q_offsets.shape[0] - 1
    from .kernels.cpu.flash import run_flash_cpu

    run_flash_cpu(np.ascontiguousarray(q), q_offsets, np.zeros(batch, np.int64), layout,
                  program, additive, has_additive, scale, None, config, result, lse)
    return (result, lse) if return_lse else result
