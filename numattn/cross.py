"""Cross attention over ragged batches (seed: MAX's ``mha_cross_gpu_naive``).

Ragged queries ``q [T, H, D]`` split by ``q_input_row_offsets`` attend over the keys of
their sequence: ragged new K/V rows split by ``kv_input_row_offsets``, or a dense,
continuous-batching or paged cache that already holds them after its cached tokens, so
that ``num_keys(b) = cache_len(b) + kv_len(b)``.  Unlike the other operations, query row
``r`` of a sequence sits at ``q_idx = r`` for the masks (it is not bottom-right aligned).

Both backends share the online-softmax bodies of :mod:`numattn._softmax`, the mask bodies of
:mod:`numattn.masks` and the cache addressing body :func:`numattn.kv_cache.kv_page_slot`:

* CPU: this is flash attention with every sequence's first query at position 0, so it runs
  the flash kernel (:func:`numattn.flash.run_flash_cpu`) with ``q_start_pos = 0``.
* CUDA: one block per tile of query rows of one sequence x query heads sharing a KV head
  (at most :data:`MAX_ROW_HEADS` row-heads).  Keys are visited in tiles with an online
  softmax: threads over the keys of a tile compute the scores (each K row is loaded once for
  all the row-heads of the block), the block takes each row's tile maximum, turns scores into
  probabilities and accumulates ``P @ V`` with threads over row-heads x head dimension.
  Shared memory holds one tile of scores, so it does not grow with the number of keys (MAX's
  naive kernel materialises ``[B * H, S, N]`` scores).  Tiles that the mask hides entirely
  are skipped without loading their keys.
"""

from __future__ import annotations

import math

import numpy as np

from ._cuda import is_device_array, require_cuda, resolve_device
from ._jit import body, cuda, cuda_kernel
from ._softmax import exp_diff, finish_row
from ._validate import (
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
from .config import resolve_config
from .flash import run_flash_cpu
from .kv_cache import KVCache, kv_page_slot, resolve_kv
from .masks import (
    TILE_FULL,
    TILE_NONE,
    NullMask,
    additive_4d,
    compile_mask,
    mask_tile_status,
    mask_visible,
)

__all__ = ["cross_attention"]

#: The default mask (a frozen dataclass, safe to share).
NO_MASK = NullMask()
#: Largest number of (query row, query head) pairs that a CUDA block serves.
MAX_ROW_HEADS = 32
#: Dynamic shared memory budget of a CUDA block, in bytes (under the 48 KiB default).
SHARED_BYTES = 40 * 1024


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
    numattn._cuda.CudaUnavailableError
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
    return _cross_cuda(q, q_offsets, layout, program, additive4, additive is not None, scale,
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
    run_flash_cpu(np.ascontiguousarray(q), q_offsets, np.zeros(batch, np.int64), layout,
                  program, additive, has_additive, scale, None, config, result, lse)
    return (result, lse) if return_lse else result


# --------------------------------------------------------------------------------------
# CUDA: host side.
# --------------------------------------------------------------------------------------
def _cuda_tiles(group, itemsize, block_q, block_k, longest_query):
    """(query heads, query rows, keys) of a block's tile, within the shared-memory budget.

    A block serves ``heads x rows`` row-heads (at most :data:`MAX_ROW_HEADS`): every K and V
    row it loads is used by all of them.
    """
    heads = max(h for h in range(1, min(group, MAX_ROW_HEADS) + 1) if group % h == 0)
    rows = max(1, min(block_q, MAX_ROW_HEADS // heads, longest_query))
    width = heads * rows
    # Per key of a tile: its cache row (int64) and one score per row-head; plus 3 floats a
    # row-head (running max, sum and rescale factor).
    keys = (SHARED_BYTES - 3 * width * itemsize) // (8 + width * itemsize)
    return heads, rows, max(1, min(block_k, keys))


def _shared_bytes(width, keys, itemsize):
    return keys * 8 + width * (keys + 3) * itemsize


def _cross_cuda(q, q_offsets, layout, program, additive, has_additive, scale, group, config,
                out, return_lse):
    cuda = require_cuda()
    num_tokens, num_heads, head_dim = shape_of(q)
    dtype = dtype_of(q)

    def on_device(x):
        if is_device_array(x):
            return x if hasattr(x, "is_c_contiguous") else cuda.as_cuda_array(x)
        return cuda.to_device(np.ascontiguousarray(x))

    def rows_view(blocks):  # [pages, page_size, Hkv, D] -> [pages * page_size, Hkv, D]
        pages, page_size, hkv, d = shape_of(blocks)
        return on_device(blocks).reshape(pages * page_size, hkv, d)

    q_lens = row_counts(q_offsets)
    heads, rows, keys = _cuda_tiles(max(group, 1), dtype.itemsize, config.block_q,
                                    config.block_k, int(q_lens.max(initial=1)))
    # Work items: (sequence, first row) of every tile of ``rows`` query rows.
    tiles = -(-q_lens // rows)
    tile_seq = np.repeat(np.arange(q_lens.shape[0], dtype=np.int64), tiles)
    tile_row0 = (np.arange(tile_seq.shape[0], dtype=np.int64)
                 - np.repeat(np.cumsum(tiles) - tiles, tiles)) * rows
    d_out = on_device(out) if out is not None and is_device_array(out) else None
    if d_out is None:
        d_out = cuda.device_array((num_tokens, num_heads, head_dim), dtype=dtype)
    d_lse = cuda.device_array((num_tokens, num_heads) if return_lse else (1, 1), dtype=dtype)
    if tile_seq.shape[0] and num_heads:
        kernel = cuda_kernel(_cross_attention_cuda_kernel)
        grid = (tile_seq.shape[0], num_heads // heads)
        shared = _shared_bytes(heads * rows, keys, dtype.itemsize)
        kernel[grid, config.threads_per_block, 0, shared](
            on_device(q), on_device(q_offsets), on_device(tile_seq), on_device(tile_row0),
            rows_view(layout.k_blocks), rows_view(layout.v_blocks), np.int64(layout.page_size),
            on_device(layout.lookup_table), on_device(layout.row_base),
            on_device(layout.num_keys), on_device(program), on_device(additive),
            bool(has_additive), dtype.type(scale), np.int64(group), np.int64(heads),
            np.int64(rows), np.int64(keys), d_out, d_lse, bool(return_lse),
        )
    if out is not None and not is_device_array(out):
        d_out.copy_to_host(out)  # a NumPy ``out``: the result lands there
    on_host = not is_device_array(q if out is None else out)
    result = out if out is not None else (d_out.copy_to_host() if on_host else d_out)
    if not return_lse:
        return result
    return result, (d_lse.copy_to_host() if on_host else d_lse)


# --------------------------------------------------------------------------------------
# CUDA kernel (bound with ``cuda_kernel``; plain Python so the simulator can run it).
# --------------------------------------------------------------------------------------
@body
def _visible_key(program, status, additive, has_additive, mask_b, mask_h, r, key, k_last):
    """True when key ``key`` (of a tile ending at ``k_last``) is visible from query row
    ``r``: inside the tile, shown by the mask program and not hidden by the additive
    tensor (head ``mask_h`` of its sequence ``mask_b``)."""
    if key > k_last:
        return False
    if status != TILE_NONE and not mask_visible(program, r, key):
        return False
    return not has_additive or additive[mask_b, mask_h, r, key] != -math.inf


@body
def _row_head_of(i, heads_per_block, token0, h0):
    """(query token, query head) of row-head ``i`` of a block: its rows are the block's
    query tokens, each with ``heads_per_block`` consecutive heads from ``h0``."""
    local_row = i // heads_per_block
    return token0 + local_row, h0 + i - local_row * heads_per_block


def _cross_attention_cuda_kernel(q, q_offsets, tile_seq, tile_row0, k_rows, v_rows, page_size,
                                 lookup_table, row_base, num_keys, program, additive,
                                 has_additive, scale, group, heads_per_block, rows_per_block,
                                 block_k, out, lse, write_lse):
    """One block: query rows ``r0 ..`` of sequence ``b`` x query heads ``h0 ..``.

    The block's row-heads are ``i = local_row * heads_per_block + local_head``.
    ``k_rows``/``v_rows`` are the cache blocks viewed as ``[pages * page_size, Hkv, D]``.
    Dynamic shared memory holds, per tile of ``block_k`` keys, the cache row of each key
    (int64) and, per row-head, the keys' scores, then their probabilities (``-inf`` marks a
    hidden key, whose V is never read), and the running max, sum and rescale factor.  The
    running output accumulates in ``out`` itself (each element has one owner thread).
    """
    b = tile_seq[cuda.blockIdx.x]
    r0 = tile_row0[cuda.blockIdx.x]
    h0 = cuda.blockIdx.y * heads_per_block
    tid = cuda.threadIdx.x
    num_threads = cuda.blockDim.x
    token0 = q_offsets[b] + r0
    rows = min(rows_per_block, q_offsets[b + 1] - token0)
    width = rows * heads_per_block
    kv_head = h0 // group
    n = num_keys[b]
    head_dim = q.shape[2]
    mask_b = b if additive.shape[0] > 1 else 0
    per_head_mask = additive.shape[1] > 1
    zero = scale - scale  # 0 in the kernel's float type (float literals would be float64)

    key_row = cuda.shared.array(0, dtype=row_base.dtype)
    floats = cuda.shared.array(0, dtype=q.dtype)
    base = block_k * 8 // floats.itemsize  # the floats follow the int64 key rows
    stride = rows_per_block * heads_per_block
    scores = floats[base:base + stride * block_k]
    stats = base + stride * block_k
    row_max = floats[stats:stats + stride]
    row_sum = floats[stats + stride:stats + 2 * stride]
    rescale = floats[stats + 2 * stride:stats + 3 * stride]
    for i in range(tid, width, num_threads):
        row_max[i] = -math.inf
        row_sum[i] = zero
    cuda.syncthreads()

    started = False
    for k0 in range(0, n, block_k):
        k_last = min(k0 + block_k, n) - 1
        status = mask_tile_status(program, r0, r0 + rows - 1, k0, k_last)
        if status == TILE_FULL:
            continue
        # 1. Scores: threads over the tile's keys; each K row serves all the row-heads.
        for j in range(tid, block_k, num_threads):
            key = k0 + j
            row = -1
            if key <= k_last:
                page, slot = kv_page_slot(lookup_table, page_size, row_base, b, key)
                row = page * page_size + slot
                key_row[j] = row
            for lr in range(rows):
                r = r0 + lr
                visible = key <= k_last
                if visible and status != TILE_NONE:
                    visible = mask_visible(program, r, key)
                for hl in range(heads_per_block):
                    i = lr * heads_per_block + hl
                    h = h0 + hl
                    bias = zero
                    if visible and has_additive:  # -inf hides the key, whatever it holds
                        bias = additive[mask_b, h if per_head_mask else 0, r, key]
                    if visible and bias != -math.inf:
                        dot = zero
                        for d in range(head_dim):
                            dot += q[token0 + lr, h, d] * k_rows[row, kv_head, d]
                        scores[i * block_k + j] = dot * scale + bias
                    else:
                        scores[i * block_k + j] = -math.inf
        cuda.syncthreads()
        # 2. The tile's max per row-head, and the factor that rescales the running state.
        for i in range(tid, width, num_threads):
            m_old = row_max[i]
            m_new = m_old
            for j in range(k_last - k0 + 1):
                s = scores[i * block_k + j]
                if s > m_new or s != s:
                    m_new = s
                    if s != s:
                        break  # NaN propagates
            rescale[i] = exp_diff(m_old, m_new)
            row_max[i] = m_new
        cuda.syncthreads()
        # 3. Probabilities; hidden keys stay -inf.  A visible key whose score is -inf (inf
        # in q or K) gets weight 0: 0 * V still counts, so NaN in its V row propagates.
        for idx in range(tid, width * block_k, num_threads):
            s = scores[idx]
            i = idx // block_k
            mask_h = h0 + i % heads_per_block if per_head_mask else 0
            if s != -math.inf or _visible_key(program, status, additive, has_additive, mask_b,
                                              mask_h, r0 + i // heads_per_block,
                                              k0 + idx % block_k, k_last):
                scores[idx] = exp_diff(s, row_max[i])
        cuda.syncthreads()
        # 4. Running sums, and P @ V with threads over row-heads x head dim.
        for i in range(tid, width, num_threads):
            tile_sum = zero
            for j in range(k_last - k0 + 1):
                p = scores[i * block_k + j]
                if p != -math.inf:
                    tile_sum += p
            row_sum[i] = row_sum[i] * rescale[i] + tile_sum
        for idx in range(tid, width * head_dim, num_threads):
            i = idx // head_dim
            d = idx - i * head_dim
            token, h = _row_head_of(i, heads_per_block, token0, h0)
            acc = zero
            if started:
                acc = out[token, h, d] * rescale[i]
            for j in range(k_last - k0 + 1):
                p = scores[i * block_k + j]
                if p != -math.inf:
                    acc += p * v_rows[key_row[j], kv_head, d]
            out[token, h, d] = acc
        started = True
        cuda.syncthreads()

    # Finish: out = acc / l (0 for a row with no visible key), lse = m + log(l).
    for i in range(tid, width, num_threads):
        out_scale, row_lse = finish_row(row_max[i], row_sum[i], zero, False)
        rescale[i] = out_scale
        if write_lse:
            token, h = _row_head_of(i, heads_per_block, token0, h0)
            lse[token, h] = row_lse
    cuda.syncthreads()
    for idx in range(tid, width * head_dim, num_threads):
        i = idx // head_dim
        d = idx - i * head_dim
        token, h = _row_head_of(i, heads_per_block, token0, h0)
        if started:
            out[token, h, d] = out[token, h, d] * rescale[i]
        else:
            out[token, h, d] = zero
