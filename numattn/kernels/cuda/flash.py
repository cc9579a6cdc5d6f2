"""Tiled (flash) attention of ragged query rows on CUDA: flash and cross attention.

One block per tile of query rows of one sequence x query heads sharing a KV head (at most
:data:`MAX_ROW_HEADS` row-heads).  Keys are visited in tiles with an online softmax: threads
over the keys of a tile compute the scores (each K row is loaded once for all the row-heads
of the block), the block takes each row's tile maximum, turns scores into probabilities and
accumulates ``P @ V`` with threads over row-heads x head dimension.  Shared memory holds one
tile of scores, so it does not grow with the number of keys.  Tiles that the mask hides
entirely are skipped without loading their keys.
"""

from __future__ import annotations

import math

import numpy as np

from ...core.device import is_device_array, require_cuda, synchronize
from ...core.dtypes import FORMAT_NATIVE
from ...core.jit import body, cuda, cuda_kernel
from ...core.masks import TILE_FULL, TILE_NONE
from ...core.validate import dtype_of, row_counts, shape_of, spans_overlap
from ..shared.masks import mask_tile_status, mask_visible
from ..shared.paging import kv_page_slot
from ..shared.scores import modified_score, read_score
from ..shared.softmax import accumulate, finish_row, key_weight, max_nan, rescale_factor
from ..shared.storage import stored_value
from .split_k import device_functions, device_scales, packed_to_device

#: Largest number of (query row, query head) pairs that a CUDA block serves.
MAX_ROW_HEADS = 32
#: Dynamic shared memory budget of a CUDA block, in bytes (under the 48 KiB default).
SHARED_BYTES = 40 * 1024


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


def run_flash_cuda(problem, stream=0, step_tables=None):
    """Flash or cross attention of a normalised problem
    (:class:`numattn.core.problem.AttentionProblem`) on CUDA, queued on ``stream``: queries
    at their positions ``q_start_pos[b] + r``, sinks counted once; returns ``(out, lse)``
    (``lse`` ``None`` without ``problem.return_lse``), on the device where the queries or
    ``out`` are (ready in the stream's order), else on the host (the stream synchronized).
    An ``out`` that is a device array over ``q``'s memory gets the result once every query
    was read (the kernel accumulates in its output).  ``step_tables``: a plan's dict of
    :func:`flash_tables_to_device` by tile rows, filled at need (``None``: copied in this
    call)."""
    q, q_offsets, layout, config = problem.q, problem.q_offsets, problem.layout, problem.config
    _, additive, has_additive, functions = problem.mask  # the program: in the tables
    scale, group, out, return_lse = problem.scale, problem.group, problem.out, problem.return_lse
    cuda = require_cuda()
    num_tokens, num_heads, head_dim = shape_of(q)
    dtype = dtype_of(q)
    caller_out = out
    if out is not None:  # padded [B, S, H, D]: its rows
        out = out.reshape(num_tokens, num_heads, head_dim)

    def on_device(x):
        if is_device_array(x):
            return x if hasattr(x, "is_c_contiguous") else cuda.as_cuda_array(x)
        return cuda.to_device(np.ascontiguousarray(x), stream=stream)

    def rows_view(blocks):  # [pages, page_size, Hkv(, D)] -> [pages * page_size, Hkv(, D)]
        shape = shape_of(blocks)
        return on_device(blocks).reshape(shape[0] * shape[1], *shape[2:])

    heads, rows, keys = _cuda_tiles(max(group, 1), dtype.itemsize, config.block_q,
                                    config.block_k, int(row_counts(q_offsets).max(initial=1)))
    tables = None if step_tables is None else step_tables.get(rows)
    if tables is None:
        if step_tables is None:
            tables = flash_tables_to_device(problem, rows, on_device)
        else:  # a plan's, for later runs on any stream: copied before this call returns
            tables = step_tables[rows] = flash_tables_to_device(problem, rows, cuda.to_device)
    d_q_offsets, d_q_start_pos, tile_seq, tile_row0, table, row_base, num_keys, d_program = (
        tables)
    d_out = on_device(out) if out is not None and is_device_array(out) else None
    deferred = d_out is not None and spans_overlap(out, q)  # out=q: written at the end
    if d_out is None or deferred:
        d_out = cuda.device_array((num_tokens, num_heads, head_dim), dtype=dtype, stream=stream)
    d_lse = cuda.device_array((num_tokens, num_heads) if return_lse else (1, 1), dtype=dtype,
                              stream=stream)
    if tile_seq.shape[0] and num_heads:
        kernel = cuda_kernel(_flash_cuda_kernel, problem.special)
        grid = (tile_seq.shape[0], num_heads // heads)
        k_scales, v_scales, has_scales = device_scales(layout, on_device)
        if has_scales:
            k_scales, v_scales = rows_view(k_scales), rows_view(v_scales)
        shared = _shared_bytes(heads * rows, keys, dtype.itemsize)
        kernel[grid, config.threads_per_block, stream, shared](
            on_device(q), d_q_offsets, d_q_start_pos, tile_seq, tile_row0,
            rows_view(layout.k_blocks), rows_view(layout.v_blocks), np.int64(layout.page_size),
            table, row_base, num_keys, k_scales, v_scales, np.int64(layout.kv_format),
            has_scales, d_program, device_functions(functions, on_device),
            on_device(additive),
            bool(has_additive), dtype.type(scale), on_device(problem.sinks),
            bool(problem.has_sink), np.int64(group), np.int64(heads), np.int64(rows),
            np.int64(keys), d_out, d_lse, bool(return_lse),
        )
    if deferred:
        on_device(out).copy_to_device(d_out, stream=stream)
    elif out is not None and not is_device_array(out):
        d_out.copy_to_host(out, stream=stream)  # a NumPy ``out``: the result lands there
    on_host = not is_device_array(q if out is None else out)
    if caller_out is not None:
        result = caller_out
    elif on_host:
        result = d_out.copy_to_host(stream=stream).reshape(problem.out_shape)
    else:
        result = d_out.reshape(problem.out_shape)
    lse = None
    if return_lse:
        lse = (d_lse.copy_to_host(stream=stream) if on_host else d_lse).reshape(
            problem.out_shape[:-1])
    if on_host:  # host results (a NumPy ``out`` too) are complete when they return
        synchronize(stream)
    return result, lse


def flash_tables_to_device(problem, rows, to_device):
    """The int64 tables the flash kernel reads, on the device in one transfer
    (``to_device``): the query offsets and start positions, the work items (sequence and
    first row of every tile of ``rows`` query rows), the cache tables and the mask program:
    the same for every layer of a step."""
    q_lens = row_counts(problem.q_offsets)
    tiles = -(-q_lens // rows)
    tile_seq = np.repeat(np.arange(q_lens.shape[0], dtype=np.int64), tiles)
    tile_row0 = (np.arange(tile_seq.shape[0], dtype=np.int64)
                 - np.repeat(np.cumsum(tiles) - tiles, tiles)) * rows
    layout = problem.layout
    return packed_to_device(to_device, [problem.q_offsets, problem.q_start_pos, tile_seq,
                                        tile_row0, layout.lookup_table, layout.row_base,
                                        layout.num_keys, problem.program], np.int64)


# --------------------------------------------------------------------------------------
# CUDA kernel (bound with ``cuda_kernel``; plain Python so the simulator can run it).
# --------------------------------------------------------------------------------------
@body
def _visible_key(program, functions, status, additive, has_additive, b, h, mask_b, mask_h, q0, r,
                 key, k_last):
    """True when key ``key`` (of a tile ending at ``k_last``) is visible from query row
    ``r`` (at position ``q0 + r``, head ``h`` of sequence ``b``): inside the tile, shown by
    the mask program and not hidden by the additive tensor (row ``r`` of head ``mask_h`` of
    its sequence ``mask_b``)."""
    if key > k_last:
        return False
    if status != TILE_NONE and not mask_visible(program, functions, b, h, q0 + r, key):
        return False
    return not has_additive or additive[mask_b, mask_h, r, key] != -math.inf


@body
def _row_head_of(i, heads_per_block, token0, h0):
    """(query token, query head) of row-head ``i`` of a block: its rows are the block's
    query tokens, each with ``heads_per_block`` consecutive heads from ``h0``."""
    local_row = i // heads_per_block
    return token0 + local_row, h0 + i - local_row * heads_per_block


def _flash_cuda_kernel(q, q_offsets, q_start_pos, tile_seq, tile_row0, k_rows, v_rows,
                       page_size, lookup_table, row_base, num_keys, k_scales, v_scales,
                       kv_format, has_scales, program, functions, additive, has_additive, scale,
                       sinks, has_sink, group, heads_per_block, rows_per_block, block_k, out,
                       lse, write_lse):
    """One block: query rows ``r0 ..`` of sequence ``b`` (at positions ``q_start_pos[b] +
    r``) x query heads ``h0 ..``.

    The block's row-heads are ``i = local_row * heads_per_block + local_head``.
    ``k_rows``/``v_rows`` are the cache blocks viewed as ``[pages * page_size, Hkv, D]``.
    Dynamic shared memory holds, per tile of ``block_k`` keys, the cache row of each key
    (int64) and, per row-head, the keys' scores, then their probabilities (``-inf`` marks a
    hidden key, whose V is never read), and the running max, sum and rescale factor.  The
    running output accumulates in ``out`` itself (each element has one owner thread).
    Per tile, the steps of :mod:`numattn.kernels.shared.softmax`: the scores
    (:func:`_tile_scores_cuda`), the running max and rescale factor
    (:func:`_tile_rescale_cuda`), the keys' weights (:func:`_tile_weights_cuda`), then ``l``
    and ``acc`` (:func:`_tile_values_cuda`); at the end :func:`_finish_rows_cuda`.
    """
    b = tile_seq[cuda.blockIdx.x]
    r0 = tile_row0[cuda.blockIdx.x]
    h0 = cuda.blockIdx.y * heads_per_block
    tid = cuda.threadIdx.x
    num_threads = cuda.blockDim.x
    token0 = q_offsets[b] + r0
    q0 = q_start_pos[b]
    rows = min(rows_per_block, q_offsets[b + 1] - token0)
    width = rows * heads_per_block
    n = num_keys[b]
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
        status = mask_tile_status(program, functions, b, q0 + r0, q0 + r0 + rows - 1, k0, k_last)
        if status == TILE_FULL:
            continue
        _tile_scores_cuda(q, k_rows, page_size, lookup_table, row_base, k_scales, kv_format,
                          has_scales, program, functions, additive, has_additive, scale, b,
                          token0, q0, r0, rows, h0, heads_per_block, group, block_k, k0, k_last,
                          status, key_row, scores)
        cuda.syncthreads()
        _tile_rescale_cuda(scores, row_max, rescale, width, block_k, k_last - k0 + 1)
        cuda.syncthreads()
        _tile_weights_cuda(program, functions, additive, has_additive, b, q0, r0, h0,
                           heads_per_block, width, block_k, k0, k_last, status, row_max, scores)
        cuda.syncthreads()
        _tile_values_cuda(v_rows, v_scales, kv_format, has_scales, key_row, scores, rescale,
                          token0, h0, heads_per_block, group, width, block_k, k_last - k0 + 1,
                          started, zero, row_sum, out)
        started = True
        cuda.syncthreads()
    _finish_rows_cuda(row_max, row_sum, rescale, sinks, has_sink, token0, h0, heads_per_block,
                      width, started, zero, out, lse, write_lse)


@body
def _tile_scores_cuda(q, k_rows, page_size, lookup_table, row_base, k_scales, kv_format,
                      has_scales, program, functions, additive, has_additive, scale, b, token0,
                      q0, r0, rows, h0, heads_per_block, group, block_k, k0, k_last, status,
                      key_row, scores):
    """``scores[i * block_k + j]``: the (modified) score of key ``k0 + j`` for row-head ``i``
    (``-inf`` where the mask or the additive tensor hides it) and ``key_row[j]``: its cache
    row.

    Threads over the tile's keys: each K row is loaded once for all the row-heads.
    """
    tid = cuda.threadIdx.x
    num_threads = cuda.blockDim.x
    head_dim = q.shape[2]
    kv_head = h0 // group
    mask_b = b if additive.shape[0] > 1 else 0
    per_head_mask = additive.shape[1] > 1
    zero = scale - scale
    real = q.dtype.type  # the compute dtype: a no-op on float storage, typed for the others
    has_score_mod, per_head = functions[2], functions[3]
    for j in range(tid, block_k, num_threads):
        key = k0 + j
        row = -1
        if key <= k_last:
            page, slot = kv_page_slot(lookup_table, page_size, row_base, b, key)
            row = page * page_size + slot
            key_row[j] = row
        for lr in range(rows):
            r = r0 + lr
            in_tile = key <= k_last
            visible = in_tile
            if in_tile and status != TILE_NONE and not per_head:
                visible = mask_visible(program, functions, b, h0, q0 + r, key)
            for hl in range(heads_per_block):
                i = lr * heads_per_block + hl
                h = h0 + hl
                if in_tile and status != TILE_NONE and per_head:
                    visible = mask_visible(program, functions, b, h, q0 + r, key)
                bias = zero
                if visible and has_additive:  # -inf hides the key, whatever it holds
                    bias = additive[mask_b, h if per_head_mask else 0, r, key]
                if visible and bias != -math.inf:
                    dot = zero
                    if kv_format == FORMAT_NATIVE:  # plain reads (the simulator's pace)
                        for d in range(head_dim):
                            dot += q[token0 + lr, h, d] * real(k_rows[row, kv_head, d])
                    else:
                        for d in range(head_dim):
                            dot += q[token0 + lr, h, d] * stored_value(
                                k_rows[row, kv_head, d], kv_format, q)
                    if has_scales:  # q . (k s) = (q . k) s
                        dot *= k_scales[row, kv_head]
                    score = read_score(dot * scale)
                    if has_score_mod:
                        score = modified_score(functions, score, b, h, q0 + r, key)
                    scores[i * block_k + j] = score + bias
                else:
                    scores[i * block_k + j] = -math.inf


@body
def _tile_rescale_cuda(scores, row_max, rescale, width, block_k, num_keys):
    """Running max: each row-head's largest score of the tile (the first ``num_keys`` of
    its ``block_k``), then ``row_max[i]`` and its rescale factor ``rescale[i]``
    (:func:`.rescale_factor`); threads over row-heads."""
    for i in range(cuda.threadIdx.x, width, cuda.blockDim.x):
        tile_max = scores[i * block_k]
        for j in range(1, num_keys):
            tile_max = max_nan(tile_max, scores[i * block_k + j])
            if tile_max != tile_max:
                break  # NaN propagates
        m_new, alpha = rescale_factor(row_max[i], tile_max)
        row_max[i] = m_new
        rescale[i] = alpha


@body
def _tile_weights_cuda(program, functions, additive, has_additive, b, q0, r0, h0,
                       heads_per_block, width, block_k, k0, k_last, status, row_max, scores):
    """Scores become the keys' weights (:func:`.key_weight`); hidden keys stay ``-inf``.

    A visible key whose score is ``-inf`` (inf in q or K) gets weight 0: ``0 * V`` still
    counts, so NaN in its V row propagates.  Threads over (row-head, key).
    """
    mask_b = b if additive.shape[0] > 1 else 0
    per_head_mask = additive.shape[1] > 1
    for idx in range(cuda.threadIdx.x, width * block_k, cuda.blockDim.x):
        s = scores[idx]
        i = idx // block_k
        h = h0 + i % heads_per_block
        mask_h = h if per_head_mask else 0
        if s != -math.inf or _visible_key(program, functions, status, additive, has_additive,
                                          b, h, mask_b, mask_h, q0, r0 + i // heads_per_block,
                                          k0 + idx % block_k, k_last):
            scores[idx] = key_weight(s, row_max[i])


@body
def _tile_values_cuda(v_rows, v_scales, kv_format, has_scales, key_row, weights, rescale, token0,
                      h0, heads_per_block, group, width, block_k, num_keys, started, zero,
                      row_sum, out):
    """``l`` (``row_sum``) and ``acc`` (``out``) take the tile's weights and weighted V rows
    (:func:`.accumulate`; ``acc`` starts at the first tile); threads over row-heads, then
    over row-heads x head dimension."""
    tid = cuda.threadIdx.x
    num_threads = cuda.blockDim.x
    head_dim = out.shape[2]
    kv_head = h0 // group
    real = out.dtype.type  # the compute dtype: a no-op on float storage, typed for the others
    for i in range(tid, width, num_threads):
        tile_sum = zero
        for j in range(num_keys):
            p = weights[i * block_k + j]
            if p != -math.inf:
                tile_sum += p
        row_sum[i] = accumulate(row_sum[i], rescale[i], tile_sum)
    for idx in range(tid, width * head_dim, num_threads):
        i = idx // head_dim
        d = idx - i * head_dim
        token, h = _row_head_of(i, heads_per_block, token0, h0)
        total = zero
        for j in range(num_keys):
            p = weights[i * block_k + j]
            if p != -math.inf and kv_format == FORMAT_NATIVE:
                total += p * real(v_rows[key_row[j], kv_head, d])
            elif p != -math.inf:
                value = stored_value(v_rows[key_row[j], kv_head, d], kv_format, out)
                if has_scales:
                    value *= v_scales[key_row[j], kv_head]
                total += p * value
        out[token, h, d] = accumulate(out[token, h, d], rescale[i], total) if started else total


@body
def _finish_rows_cuda(row_max, row_sum, rescale, sinks, has_sink, token0, h0, heads_per_block,
                      width, started, zero, out, lse, write_lse):
    """Finish the rows (:func:`.finish_row`, the head's sink counted once): ``out = acc / l``
    (0 for a row with no visible key), ``lse = m + log(l)``; the row's factor goes through
    ``rescale``."""
    tid = cuda.threadIdx.x
    num_threads = cuda.blockDim.x
    head_dim = out.shape[2]
    for i in range(tid, width, num_threads):
        token, h = _row_head_of(i, heads_per_block, token0, h0)
        sink = sinks[h] if has_sink else zero
        out_scale, row_lse = finish_row(row_max[i], row_sum[i], sink, has_sink)
        rescale[i] = out_scale
        if write_lse:
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
