"""Split-K decode on CUDA.

One block per (partition, KV head, sequence); threads split each tile's keys and the head
dimension, with shared-memory reductions for the dot products and the tile max and sum; then
a reduction kernel with one block per (sequence, head), threads over D.
"""

from __future__ import annotations

import math

import numpy as np

from ...core.device import is_device_array, require_cuda, synchronize
from ...core.dtypes import FORMAT_NATIVE
from ...core.jit import body, cuda, cuda_kernel
from ...core.masks import TILE_FULL, TILE_NONE
from ...core.validate import shape_of
from ..shared.masks import key_bias, key_hidden, mask_tile_status, mask_visible
from ..shared.paging import kv_page_slot
from ..shared.partitions import partition_bounds, partition_count
from ..shared.scores import modified_score, read_score
from ..shared.softmax import (
    accumulate,
    key_weight,
    max_nan,
    merge_partials,
    rescale_factor,
)
from ..shared.storage import stored_value

#: CUDA: threads that split the head dimension of one key's dot product (the rest of the
#: block's threads take different keys), and the largest key tile one block holds.
CUDA_DOT_LANES = 8
CUDA_MAX_TILE = 1024
#: CUDA: dynamic shared memory one block may use without an opt-in.
CUDA_SHARED_BYTES = 48 * 1024


def run_decode_cuda(problem, num_partitions, stream=0, step_tables=None):
    """Decode of a normalised problem (:class:`numattn.core.problem.AttentionProblem`, one
    query row per sequence) in ``num_partitions`` key partitions (``None``: automatic),
    queued on ``stream``; returns ``(out, lse)``, on the device where the queries or ``out``
    are (ready in the stream's order), else on the host (the stream synchronized).
    ``step_tables``: the problem's :func:`step_tables_to_device`, held by a plan (``None``:
    copied in this call)."""
    q, out, args = problem.q, problem.out, problem  # args: the problem's fields by name
    cuda = require_cuda()
    layout = args.layout
    batch, num_heads, head_dim = shape_of(q)
    dtype = np.dtype(q.dtype)
    on_device = is_device_array(q) or (out is not None and is_device_array(out))
    if batch > 65535:
        raise ValueError(f"device='cuda' supports at most 65535 sequences, got {batch}")

    def to_device(x):
        if not is_device_array(x):
            return cuda.to_device(np.ascontiguousarray(x), stream=stream)
        # Numba's own device arrays (and the simulator's) are used as they are; others
        # (CuPy, PyTorch, ...) are wrapped without a copy.
        return x if hasattr(x, "copy_to_host") else cuda.as_cuda_array(x)

    if out is not None and is_device_array(out):
        d_out = to_device(out)
    else:
        d_out = cuda.device_array((batch, num_heads, head_dim), dtype, stream=stream)
    if not (batch and num_heads):
        d_lse = cuda.device_array((batch, num_heads), dtype, stream=stream)
    else:
        config = args.config
        block_k = config.block_k
        threads = config.threads_per_block
        tile = min(block_k, CUDA_MAX_TILE)
        group = num_heads // layout.num_kv_heads
        per_head = (tile + threads + 1) * dtype.itemsize
        # at most one head per thread: the kernel's per-head steps run on threads 0 .. gn-1
        heads_per_pass = max(1, min(group, threads, CUDA_SHARED_BYTES // per_head))
        parts = partition_count(num_partitions, args.max_keys, batch * layout.num_kv_heads,
                                 block_k, _multiprocessors(cuda))
        # Few transfers and allocations per call: the small host arrays travel packed by
        # dtype, and the partial states and lse share one allocation.
        table, row_base, num_keys, program = step_tables or step_tables_to_device(
            layout, args.program, to_device)
        floats = [args.sinks] + ([] if is_device_array(args.additive) else [args.additive])
        sinks, *additive = packed_to_device(to_device, floats, dtype)
        additive = additive[0] if additive else args.additive
        part_m, part_l, part_acc, d_lse = _split(
            cuda.device_array(batch * num_heads * (parts * (head_dim + 2) + 1), dtype,
                              stream=stream),
            [(batch, parts, num_heads), (batch, parts, num_heads),
             (batch, parts, num_heads, head_dim), (batch, num_heads)])
        grid = (parts, layout.num_kv_heads, batch)
        k_scales, v_scales, has_scales = device_scales(layout, to_device)
        kernel = cuda_kernel(_decode_partitions_cuda, problem.special)
        kernel[grid, threads, stream, heads_per_pass * per_head](
            to_device(q), to_device(layout.k_blocks), to_device(layout.v_blocks),
            layout.page_size, table, row_base, num_keys, k_scales, v_scales,
            np.int64(layout.kv_format), has_scales, program,
            device_functions(args.mask.functions, to_device), additive, args.has_additive,
            args.scale, block_k, tile, heads_per_pass, part_m, part_l, part_acc,
        )
        cuda_kernel(_decode_reduce_cuda)[batch * num_heads, threads, stream](
            part_m, part_l, part_acc, sinks, args.has_sink, d_out, d_lse
        )
    if on_device:
        return d_out, d_lse
    if out is not None:
        result = d_out.copy_to_host(out, stream=stream)
    else:
        result = d_out.copy_to_host(stream=stream)
    lse = d_lse.copy_to_host(stream=stream)
    synchronize(stream)
    return result, lse


def step_tables_to_device(layout, program, to_device):
    """``(lookup_table, row_base, num_keys, program)`` of a step on the device, in one
    transfer (``to_device``): what the decode kernel reads of the cache tables and the
    mask, the same for every layer of a step."""
    return tuple(packed_to_device(to_device, [layout.lookup_table, layout.row_base,
                                               layout.num_keys, program], np.int64))


def device_scales(layout, to_device):
    """``(k_scales, v_scales, has_scales)`` for the CUDA kernels: a quantized cache's scales
    on the device, or ``[1, 1, 1]`` placeholders (the kernels read them only with
    ``has_scales``)."""
    if layout.k_scales.shape[0] == 0:
        placeholder = to_device(np.ones((1, 1, 1), np.float32))
        return placeholder, placeholder, False
    return to_device(layout.k_scales), to_device(layout.v_scales), True


def device_functions(functions, to_device):
    """The kernels' ``functions`` tuple (:func:`numattn.core.functions.kernel_functions`)
    with its arrays on the device (captured numbers as they are)."""
    def moved(x):
        return to_device(x) if isinstance(x, np.ndarray) or is_device_array(x) else x

    return tuple(moved(x) for x in functions)


def packed_to_device(to_device, arrays, dtype):
    """Copy small host arrays to the device in one transfer (``to_device``); returns a view
    of each."""
    flat = np.concatenate([np.ravel(x).astype(dtype, copy=False) for x in arrays])
    return _split(to_device(flat), [x.shape for x in arrays])


def _split(flat, shapes):
    """C-contiguous views of consecutive pieces of a 1-d (device) array."""
    views = []
    start = 0
    for shape in shapes:
        size = int(np.prod(shape, dtype=np.int64))
        views.append(flat[start:start + size].reshape(shape))
        start += size
    return views


def _multiprocessors(cuda):
    try:
        return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)
    except Exception:  # the simulator's fake device may not say
        return 1


def _decode_partitions_cuda(q, k_blocks, v_blocks, page_size, lookup_table, row_base,
                            num_keys, k_scales, v_scales, kv_format, has_scales, program,
                            functions, additive, has_additive, scale, block_k, tile,
                            heads_per_pass, part_m, part_l, part_acc):
    """One block per (partition, KV head, sequence); ``tile`` keys at a time.

    Dynamic shared memory holds, per head of a pass, the tile's scores (then weights)
    ``[tile]``, a reduction buffer ``[threads]`` and the tile's rescale factor.  Per tile:
    the scores (:func:`_tile_scores_cuda`), the running max and rescale factor
    (:func:`_tile_rescale_cuda`), the keys' weights and ``l`` (:func:`_tile_weights_cuda`),
    then ``acc`` (:func:`_tile_values_cuda`): the steps of
    :mod:`numattn.kernels.shared.softmax`, with shared-memory reductions over the block.
    K/V are read in their stored format ``kv_format`` (times their scales with
    ``has_scales``): :func:`numattn.kernels.shared.storage.stored_value`.
    """
    part = cuda.blockIdx.x
    j = cuda.blockIdx.y
    b = cuda.blockIdx.z
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    head_dim = q.shape[2]
    group = q.shape[1] // k_blocks.shape[2]
    zero = scale - scale
    shared = cuda.shared.array(0, dtype=q.dtype)
    red = heads_per_pass * tile
    alphas = red + heads_per_pass * threads
    q_idx = num_keys[b] - 1
    start, end = partition_bounds(num_keys[b], part, cuda.gridDim.x, block_k)
    m = part_m[b, part]  # this partition's state rows, one per query head
    l = part_l[b, part]
    acc = part_acc[b, part]
    for g0 in range(0, group, heads_per_pass):
        gn = min(heads_per_pass, group - g0)
        h0 = j * group + g0
        for idx in range(tid, gn * head_dim, threads):
            acc[h0 + idx // head_dim, idx % head_dim] = zero
        if tid < gn:
            m[h0 + tid] = -math.inf
            l[h0 + tid] = zero
        cuda.syncthreads()
        for k0 in range(start, end, tile):
            n = min(k0 + tile, end) - k0
            status = mask_tile_status(program, functions, b, q_idx, q_idx, k0, k0 + n - 1)
            if status == TILE_FULL:
                continue
            _tile_scores_cuda(q, k_blocks, page_size, lookup_table, row_base, k_scales,
                              kv_format, has_scales, program, functions, additive, has_additive,
                              scale, b, j, h0, gn, q_idx, k0, n, status, tile, red, shared)
            _tile_rescale_cuda(m, h0, gn, n, tile, red, alphas, shared)
            _tile_weights_cuda(m, l, h0, gn, n, tile, red, alphas, zero, shared)
            _tile_values_cuda(v_blocks, page_size, lookup_table, row_base, v_scales,
                              kv_format, has_scales, program, functions, additive, has_additive,
                              b, j, h0, gn, q_idx, k0, n, status, tile, alphas, zero, shared,
                              acc)
            cuda.syncthreads()


@body
def _tile_scores_cuda(q, k_blocks, page_size, lookup_table, row_base, k_scales, kv_format,
                      has_scales, program, functions, additive, has_additive, scale, b, j, h0,
                      gn, q_idx, k0, n, status, tile, red, shared):
    """``shared[g * tile + i]``: the (modified) score of key ``k0 + i`` for query head
    ``h0 + g`` (``-inf`` where the mask or the additive tensor hides it).

    ``key_slots = threads / CUDA_DOT_LANES`` keys per round: threads ``(key_slot, lane)``
    sum a slice of D each (coalesced rows) into the reduction buffer from ``red``, then one
    thread per (head, key) adds the lanes and applies the mask.
    """
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    head_dim = q.shape[2]
    lane = tid % CUDA_DOT_LANES
    key_slot = tid // CUDA_DOT_LANES
    key_slots = threads // CUDA_DOT_LANES
    zero = scale - scale
    real = q.dtype.type  # the compute dtype: a no-op on float storage, typed for the others
    for r0 in range(0, n, key_slots):
        t = k0 + r0 + key_slot
        if r0 + key_slot < n:
            page, slot = kv_page_slot(lookup_table, page_size, row_base, b, t)
            for g in range(gn):
                dot = zero
                if kv_format == FORMAT_NATIVE:  # plain reads (the simulator's pace)
                    for d in range(lane, head_dim, CUDA_DOT_LANES):
                        dot += q[b, h0 + g, d] * real(k_blocks[page, slot, j, d])
                else:
                    for d in range(lane, head_dim, CUDA_DOT_LANES):
                        dot += q[b, h0 + g, d] * stored_value(k_blocks[page, slot, j, d],
                                                              kv_format, q)
                if has_scales:  # q . (k s) = (q . k) s
                    dot *= k_scales[page, slot, j]
                shared[red + g * threads + tid] = dot
        cuda.syncthreads()
        for idx in range(tid, gn * key_slots, threads):
            g = idx // key_slots
            ks = idx % key_slots
            i = r0 + ks
            if i < n:
                s = -math.inf
                if status == TILE_NONE or mask_visible(program, functions, b, h0 + g, q_idx,
                                                        k0 + i):
                    bias = zero
                    if has_additive:
                        bias = key_bias(additive, b, h0 + g, 0, k0 + i)
                    if bias != -math.inf:
                        dot = zero
                        base = red + g * threads + ks * CUDA_DOT_LANES
                        for ln in range(CUDA_DOT_LANES):
                            dot += shared[base + ln]
                        s = read_score(dot * scale)
                        if functions[2]:  # the score modifier
                            s = modified_score(functions, s, b, h0 + g, q_idx, k0 + i)
                        s += bias
                shared[g * tile + i] = s
        cuda.syncthreads()


@body
def _block_reduce(shared, red, gn, take_max):
    """Per head ``g < gn``: ``shared[red + g * threads]`` becomes the largest (``take_max``,
    :func:`.max_nan`) or the sum of ``shared[red + g * threads + t]`` over the block's
    threads ``t`` (a tree reduction: the block's threads a power of two)."""
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    stride = threads // 2
    while stride > 0:
        if tid < stride:
            for g in range(gn):
                a = shared[red + g * threads + tid]
                other = shared[red + g * threads + tid + stride]
                shared[red + g * threads + tid] = max_nan(a, other) if take_max else a + other
        cuda.syncthreads()
        stride //= 2


@body
def _tile_rescale_cuda(m, h0, gn, n, tile, red, alphas, shared):
    """Running max: each head's largest score of the tile (:func:`_block_reduce`), then
    ``m[h0 + g]`` and its rescale factor ``shared[alphas + g]`` (:func:`.rescale_factor`)."""
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    for g in range(gn):
        best = -math.inf
        for i in range(tid, n, threads):
            best = max_nan(best, shared[g * tile + i])
        shared[red + g * threads + tid] = best
    cuda.syncthreads()
    _block_reduce(shared, red, gn, True)
    if tid < gn:
        m_new, alpha = rescale_factor(m[h0 + tid], shared[red + tid * threads])
        m[h0 + tid] = m_new
        shared[alphas + tid] = alpha
    cuda.syncthreads()


@body
def _tile_weights_cuda(m, l, h0, gn, n, tile, red, alphas, zero, shared):
    """The tile's scores become the keys' weights (:func:`.key_weight`), and ``l[h0 + g]``
    takes their sum (:func:`_block_reduce`, :func:`.accumulate`)."""
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    for g in range(gn):
        m_new = m[h0 + g]
        total = zero
        for i in range(tid, n, threads):
            p = key_weight(shared[g * tile + i], m_new)
            shared[g * tile + i] = p
            total += p
        shared[red + g * threads + tid] = total
    cuda.syncthreads()
    _block_reduce(shared, red, gn, False)
    if tid < gn:
        l[h0 + tid] = accumulate(l[h0 + tid], shared[alphas + tid], shared[red + tid * threads])


@body
def _tile_values_cuda(v_blocks, page_size, lookup_table, row_base, v_scales, kv_format,
                      has_scales, program, functions, additive, has_additive, b, j, h0, gn,
                      q_idx, k0, n, status, tile, alphas, zero, shared, acc):
    """``acc[h0 + g, d]`` takes the tile's weighted V rows (:func:`.accumulate`), threads
    over (head, d)."""
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    head_dim = acc.shape[1]
    real = acc.dtype.type  # the compute dtype: a no-op on float storage, typed for the others
    for idx in range(tid, gn * head_dim, threads):
        g = idx // head_dim
        d = idx % head_dim
        total = zero
        # walk the tile's slots page by page (no division per key)
        row = row_base[b] + k0
        page_idx = row // page_size
        slot = row - page_idx * page_size
        page = lookup_table[b, page_idx]
        for i in range(n):
            p = shared[g * tile + i]
            # a weight of 0 is a hidden key (left out: its slot may hold NaN) or a visible
            # one whose weight underflowed (0 * V: NaN propagates)
            if p != 0 or not key_hidden(program, functions, status, q_idx, has_additive,
                                        additive, b, h0 + g, k0 + i):
                if kv_format == FORMAT_NATIVE:
                    total += p * real(v_blocks[page, slot, j, d])
                else:
                    value = stored_value(v_blocks[page, slot, j, d], kv_format, acc)
                    if has_scales:
                        value *= v_scales[page, slot, j]
                    total += p * value
            slot += 1
            if slot == page_size and i + 1 < n:
                slot = 0
                page_idx += 1
                page = lookup_table[b, page_idx]
        acc[h0 + g, d] = accumulate(acc[h0 + g, d], shared[alphas + g], total)


def _decode_reduce_cuda(part_m, part_l, part_acc, sinks, has_sink, out, lse):
    """One block per (sequence, head) row, threads over the head dimension
    (:func:`.merge_partials`)."""
    num_heads = part_m.shape[2]
    row = cuda.blockIdx.x
    b = row // num_heads
    h = row % num_heads
    d0 = cuda.threadIdx.x
    row_lse = merge_partials(part_m, part_l, part_acc, b, h, False, sinks[h], has_sink, d0,
                             cuda.blockDim.x, out)
    if d0 == 0:
        lse[b, h] = row_lse
