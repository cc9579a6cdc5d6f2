"""Split-K attention of a few query rows per sequence on the CPU: decode's kernel.

The keys of each sequence are cut into partitions aligned to ``block_k``
(:func:`numattn.kernels.shared.partitions.partition_bounds`); every (sequence, partition) is
one work item over *all* KV heads, so each token's contiguous ``[Hkv, D]`` K and V row is
read in one sweep, and one item computes a partial softmax state ``(m, l, acc)`` per state
row.  A reduction then merges the partitions of each row exactly and closes it with the sink
logit counted once (:func:`numattn.kernels.shared.softmax.merge_partials`).  Per tile of keys: a
tile the mask hides entirely is skipped without loading a row, a tile it leaves whole needs
no per-key test.

The same kernel serves a few query rows per sequence (:func:`run_multi_query_cpu`), which
flash and cross attention use for speculative decoding and short chunks over long caches.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np

from ...core.jit import body, cpu_jit, prange
from ...core.masks import TILE_FULL, TILE_NONE, TILE_PARTIAL
from ...core.validate import row_counts
from ..shared.masks import key_bias, mask_tile_status, mask_visible
from ..shared.paging import kv_page_slot
from ..shared.partitions import MIN_TILES_PER_PARTITION, partition_bounds, partition_count
from ..shared.scores import modified_score, read_score
from ..shared.softmax import merge_partials
from ..shared.storage import stored_value
from . import simd
from .function_tiles import with_tile_tables
from .schedule import zigzag_schedule
from .simd import (
    prefetch_row,
    scores_block_1,
    scores_block_2,
    scores_block_4,
    values_block_1,
    values_block_2,
    values_block_4,
    values_tile_1,
    values_tile_2,
    values_tile_4,
)
from .softmax import softmax_tile

#: CPU: calls that read up to this many K/V bytes run on the calling thread, and partial
#: outputs up to this many elements are merged there: waking the worker threads costs more
#: than it saves on such work ("Short calls" in docs/performance.rst).
SERIAL_KV_BYTES = 2**21
SERIAL_REDUCE_ELEMENTS = 2**18
#: CPU: the kernel asks for the first PREFETCH_LINES cache lines of the 4 KiB page that
#: holds the start of the K or V row it will read PREFETCH_KEYS block positions later (the
#: next row of the same stream, see :func:`_tile_rows`), when rows are at least
#: PREFETCH_MIN_ROW_BYTES long.  Such a stream enters a new page at every row, where the
#: hardware prefetcher starts cold; shorter rows share pages, which it follows on its own.
#: A few lines, as whole rows would crowd the L1 cache and its miss buffers; the page's
#: start, not the row's, as a cache need not start on a page.  Measured: "Decode
#: page-start hints" and "Alignment" in docs/performance.rst.
PREFETCH_KEYS = 4
PREFETCH_LINES = 2
PREFETCH_MIN_ROW_BYTES = 4096
#: CPU decode: tiles hold ``block_k`` keys or a multiple of it (at most MAX_TILE_MULTIPLE
#: times) up to :func:`tile_bytes` of K as stored, half a core's L2 cache within
#: [MIN_TILE_BYTES, MAX_TILE_BYTES]: longer streams for the hardware prefetcher and each
#: tile's own work shared by more keys ("Decode with short rows" and "Tiles of 16- and
#: 8-bit K/V" in docs/performance.rst).
MIN_TILE_BYTES = 2**18
MAX_TILE_BYTES = 2**20
MAX_TILE_MULTIPLE = 8
#: CPU: a tile's weighted V rows are summed over the whole tile per block of query heads
#: (accumulators in registers, :func:`.simd.values_tile_4`) when a token's row of all KV
#: heads is at most this long and a head's row fits the registers; with longer rows each
#: block's walk over its own KV head's part strides through memory ("Decode with short
#: rows" in docs/performance.rst).
WHOLE_TILE_MAX_ROW_BYTES = 512
#: :func:`run_multi_query_cpu` counts its key partitions for this many workers whatever the
#: machine, so that results do not depend on the number of threads.
MULTI_QUERY_WORKERS = 16


def _row_bytes(layout, dtype):
    """Bytes of one token's K (or V) row of all KV heads in ``dtype``."""
    return layout.num_kv_heads * layout.head_dim * dtype.itemsize


def _prefetch_lines(layout, dtype):
    """Lines of each K/V row the CPU kernel prefetches: :data:`PREFETCH_LINES` for rows of
    at least :data:`PREFETCH_MIN_ROW_BYTES` in the compute ``dtype`` (16- and 8-bit rows of
    such a layout keep the hints: 1.65 -> 1.77x float32 for bfloat16, "16- and 8-bit K/V"
    in docs/performance.rst), none for shorter rows."""
    return PREFETCH_LINES if _row_bytes(layout, dtype) >= PREFETCH_MIN_ROW_BYTES else 0


def _cpu_tile_keys(layout, block_k):
    """Keys per tile of the CPU decode kernel: the multiple of ``block_k`` (1 to
    :data:`MAX_TILE_MULTIPLE` times) nearest below :func:`tile_bytes` of K per tile as
    stored (a bfloat16 tile holds twice the keys of a float32 one).  Partitions stay aligned
    to ``block_k``."""
    multiple = tile_bytes() // (block_k * max(1, _row_bytes(layout, layout.dtype)))
    return block_k * max(1, min(MAX_TILE_MULTIPLE, multiple))


@functools.cache
def tile_bytes(cache_dir="/sys/devices/system/cpu/cpu0/cache"):
    """Bytes of K per CPU decode tile (:func:`_cpu_tile_keys`): half the L2 cache of a core
    as Linux reports it in ``cache_dir``, within :data:`MIN_TILE_BYTES` and
    :data:`MAX_TILE_BYTES`; :data:`MIN_TILE_BYTES` where it is not reported."""
    import glob

    for cache in sorted(glob.glob(f"{cache_dir}/index*")):
        try:
            with open(f"{cache}/level") as f:
                if f.read().strip() != "2":
                    continue
            with open(f"{cache}/size") as f:
                size = f.read().strip()  # "2048K"
            l2 = int(size[:-1]) * {"K": 2**10, "M": 2**20}[size[-1]]
        except (OSError, ValueError, KeyError, IndexError):
            continue
        return min(MAX_TILE_BYTES, max(MIN_TILE_BYTES, l2 // 2))
    return MIN_TILE_BYTES


def _whole_tile_values(layout, dtype):
    """Whether the CPU kernel sums the weighted V rows of an all-visible tile over the whole
    tile (:func:`.simd.values_tile_4`): rows of at most
    :data:`WHOLE_TILE_MAX_ROW_BYTES` whose heads fit the registers."""
    return (_row_bytes(layout, dtype) <= WHOLE_TILE_MAX_ROW_BYTES
            and simd.values_tile_fits(layout.head_dim, dtype.itemsize))



class DecodeLaunch(NamedTuple):
    """How the CPU runs decode over one step's caches (:func:`decode_launch`): the same for
    every layer of the step, so that a plan computes it once."""

    tiling: tuple  # (block_k, tile_keys, prefetch_lines, tile_values): :func:`_tiling`
    parts: int  # key partitions per sequence
    parallel: bool  # partial states on the worker threads
    schedule: tuple  # (item_order, thread_starts) of :func:`_decode_partitions_cpu`


def decode_launch(layout, q_offsets, dtype, config, num_partitions):
    """The :class:`DecodeLaunch` of decode over ``layout`` (one query row per sequence,
    ``q_offsets``), in ``dtype``, for ``num_partitions`` (``None``: automatic).

    Little work, or a single work item, runs on the calling thread (waking the worker
    threads costs more), and there an automatic count is one partition per sequence.
    """
    block_k = config.block_k
    batch = q_offsets.shape[0] - 1
    serial = 2 * layout.total_keys * _row_bytes(layout, dtype) <= SERIAL_KV_BYTES
    if serial and num_partitions is None:
        parts = 1
    else:
        import numba

        parts = partition_count(num_partitions, layout.max_keys, batch, block_k,
                                numba.get_num_threads())
    parallel = not serial and batch * parts > 1
    return DecodeLaunch(_tiling(layout, dtype, block_k, _cpu_tile_keys(layout, block_k)),
                        parts, parallel,
                        _schedule(q_offsets, layout.num_keys, parts, block_k, parallel))


def run_decode_cpu(problem, launch):
    """Decode of a normalised problem (:class:`numattn.core.problem.AttentionProblem`, one
    query row per sequence) as ``launch`` says; returns ``(out, lse)``."""
    queries, layout, mask, softmax, _, out, out_shape = problem[:7]
    q, q_offsets, q_start_pos, _ = queries
    batch, num_heads, _ = q.shape
    dtype = q.dtype
    result = out if out is not None else np.empty(out_shape, dtype)
    lse = np.empty((batch, num_heads), dtype)
    if batch == 0 or num_heads == 0:
        return result, lse
    mask = with_tile_tables(problem).mask
    scale, sinks, has_sink = softmax
    tiling = launch.tiling
    part_m, part_l, part_acc = _partial_states_cpu(
        q, q_offsets, q_start_pos, 1, layout, mask, problem.special, scale,
        tiling[0], tiling[1], launch.parts, launch.parallel, tiling, launch.schedule,
    )
    cpu_jit(_decode_reduce_cpu, parallel=part_acc.size > SERIAL_REDUCE_ELEMENTS)(
        part_m, part_l, part_acc, sinks, has_sink, result, lse
    )
    return result, lse


def _partial_states_cpu(q, q_offsets, q_start_pos, max_q_len, layout, mask, special, scale,
                        block_k, tile_keys, parts, parallel, tiling=None, schedule=None):
    """``part_m, part_l, part_acc`` of every (sequence, partition) from
    :func:`_decode_partitions_cpu` (specialized by ``special`` for the call's functions,
    on the worker threads if ``parallel``), tiled as
    ``tiling`` says (else as :func:`_tiling` says for ``block_k`` and ``tile_keys``), the
    items dealt by ``schedule`` (else by :func:`_schedule`).  The structured arguments go
    as plain tuples: Numba types those in C at each call, NamedTuples in Python."""
    batch = q_offsets.shape[0] - 1
    num_rows = max_q_len * q.shape[1]
    dtype = q.dtype
    part_m = np.empty((batch, parts, num_rows), dtype)
    part_l = np.empty((batch, parts, num_rows), dtype)
    shape = (batch, parts, num_rows, q.shape[2])
    if parallel:
        # on a cache line for the worker threads' items; a call on the calling thread
        # (short, as a rule) keeps np.empty: aligning costs more than it saves there
        part_acc = aligned_empty(math.prod(shape), q).reshape(shape)
    else:
        part_acc = np.empty(shape, dtype)
    if tiling is None:
        tiling = _tiling(layout, dtype, block_k, tile_keys)
    if schedule is None:
        schedule = _schedule(q_offsets, layout.num_keys, parts, block_k, parallel)
    # QueryRows', PagedKV's (layout[:9]) and MaskArgs' fields
    cpu_jit(_decode_partitions_cpu, parallel=parallel, special=special)(
        (q, q_offsets, q_start_pos, max_q_len), layout[:9], tuple(mask[:3]), mask.functions,
        scale, tiling, schedule, (part_m, part_l, part_acc),
    )
    return part_m, part_l, part_acc


def _tiling(layout, dtype, block_k, tile_keys):
    """``(block_k, tile_keys, prefetch_lines, tile_values)`` of :func:`_decode_partitions_cpu`:
    rows read the way their length asks for (:func:`_prefetch_lines`,
    :func:`_whole_tile_values`)."""
    return (block_k, tile_keys, _prefetch_lines(layout, dtype),
            _whole_tile_values(layout, dtype))


def _schedule(q_offsets, num_keys, parts, block_k, parallel):
    """``(item_order, thread_starts)`` of :func:`_decode_partitions_cpu`: on the worker
    threads, :func:`_partition_schedule`; on the calling thread, every item in order."""
    if parallel:
        import numba

        return cpu_jit(_partition_schedule)(q_offsets, num_keys, parts, block_k,
                                            numba.get_num_threads())
    return _in_order((q_offsets.shape[0] - 1) * parts)


@functools.lru_cache(maxsize=64)
def _in_order(items):
    """``(item_order, thread_starts)``: ``items`` work items in order on one thread (shared
    by the calls that need it: the kernel only reads it)."""
    return np.arange(items, dtype=np.int64), np.array([0, items], dtype=np.int64)


def _partition_schedule(q_offsets, num_keys, num_partitions, block_k, num_threads):
    """``item_order, thread_starts`` of :func:`_decode_partitions_cpu`: its (sequence,
    partition) items dealt to ``num_threads`` threads by their keys
    (:func:`.schedule.zigzag_schedule`; a sequence without query rows costs 0), so
    that sequences of different lengths leave no thread idle (compiled)."""
    batch = num_keys.shape[0]
    cost = np.zeros(batch * num_partitions, dtype=np.int64)
    for b in range(batch):
        if q_offsets[b + 1] > q_offsets[b]:
            for part in range(num_partitions):
                start, end = partition_bounds(num_keys[b], part, num_partitions, block_k)
                cost[b * num_partitions + part] = end - start
    return zigzag_schedule(cost, num_threads)


def run_multi_query_cpu(queries, layout, mask, max_q_len, softmax, config, out, lse, parallel,
                        special=None):
    """Attention of a few query rows per sequence with decode's CPU kernels (no validation).

    :func:`.flash.run_flash_cpu` sends problems of at most
    :data:`.flash.MULTI_QUERY_MAX_LEN` rows per sequence (with enough work and most
    rows in use: every sequence is computed as ``max_q_len`` rows long) here
    (speculative decoding, short chunks over a long cache): the ``S group`` rows of a KV
    head read each token's ``[Hkv, D]`` K and V row once, where the flash kernel's items
    (one KV head each) stride through the rows.
    The arguments are parts of a :class:`~numattn.core.problem.AttentionProblem`, plus
    ``max_q_len`` (the longest sequence's rows), ``out [T, H, D]`` and ``lse [T, H]`` (or
    ``None``) to write, ``parallel`` (use the worker threads) and ``special`` (the
    problem's specialization for its functions).  The key partitions do not
    depend on the number of threads (:data:`MULTI_QUERY_WORKERS`), so neither do the results.
    """
    q, q_offsets, q_start_pos, _ = queries
    scale, sinks, has_sink = softmax
    total, num_heads, head_dim = q.shape
    batch = q_offsets.shape[0] - 1
    num_kv_heads = layout.num_kv_heads
    group = num_heads // num_kv_heads
    dtype = q.dtype
    num_rows = max_q_len * num_heads
    max_keys = layout.max_keys
    # a tile holds max_q_len times decode's work: shorter partitions pay off as well
    parts = partition_count(None, max_keys, batch, config.block_k, MULTI_QUERY_WORKERS,
                             max(1, MIN_TILES_PER_PARTITION // max_q_len))
    part_m, part_l, part_acc = _partial_states_cpu(
        q, q_offsets, q_start_pos, max_q_len, layout, mask, special, scale,
        config.block_k, config.block_k, parts, parallel,
    )
    # state row (j S + s) group + g is local row s of head j group + g
    row_sinks = np.ascontiguousarray(np.broadcast_to(
        sinks.reshape(num_kv_heads, 1, group), (num_kv_heads, max_q_len, group)).reshape(-1))
    rows_out = np.empty((batch, num_rows, head_dim), dtype)
    rows_lse = np.empty((batch, num_rows), dtype)
    cpu_jit(_decode_reduce_cpu, parallel=parallel and part_acc.size > SERIAL_REDUCE_ELEMENTS)(
        part_m, part_l, part_acc, row_sinks, has_sink, rows_out, rows_lse
    )
    # back to [T, H(, D)]: query row t is local row t - q_offsets[b] of its sequence b
    q_lens = row_counts(q_offsets)
    seq = np.repeat(np.arange(batch), q_lens)
    local = np.arange(total) - np.repeat(q_offsets[:-1], q_lens)
    shape = (batch, num_kv_heads, max_q_len, group)
    out[...] = rows_out.reshape(*shape, head_dim).transpose(0, 2, 1, 3, 4).reshape(
        batch, max_q_len, num_heads, head_dim)[seq, local]
    if lse is not None:
        lse[...] = rows_lse.reshape(shape).transpose(0, 2, 1, 3).reshape(
            batch, max_q_len, num_heads)[seq, local]



def _decode_partitions_cpu(queries, kv, mask, functions, scale, tiling, schedule, states):
    """Partial states ``part_* [B, P, R(, D)]``: one work item ``b P + p`` per (sequence
    ``b``, partition ``p``); thread ``t`` computes items
    ``item_order[thread_starts[t]:thread_starts[t + 1]]`` (:func:`_partition_schedule`).

    The arguments are tuples: ``queries`` of :class:`~numattn.core.problem.QueryRows`'
    fields, ``kv`` of :class:`~numattn.core.problem.PagedKV`'s, ``mask`` of
    :class:`~numattn.core.problem.MaskArgs`' (``functions`` apart: a parallel loop takes no
    tuple that holds a tuple), ``tiling = (block_k, tile_keys,
    prefetch_lines, tile_values)``, ``schedule = (item_order, thread_starts)`` and
    ``states = (part_m, part_l, part_acc)``.

    Sequence ``b`` has query rows ``q[q_offsets[b]:q_offsets[b + 1]]`` (at most
    ``max_q_len`` = S; one for decode) at positions ``q_start_pos[b] + s``.  Its ``R = S H``
    state rows go KV head by KV head: row ``(j S + s) group + g`` is local query row ``s``
    of head ``j group + g``, so that the ``S group`` rows of a KV head read each of its K and
    V rows once (rows past a sequence's own length are computed and never read).  Per tile
    of keys: the scores of all rows (:func:`_tile_scores`: each token's ``[Hkv, D]`` K row
    read in one sweep), the mask, a vectorised online-softmax step
    (:func:`.softmax.softmax_tile`, Cephes' ``exp`` over the whole tile), then the
    weighted V rows (:func:`_tile_values`).  Scores use ``q * scale`` (scaled once).

    Partitions are aligned to ``block_k`` keys, tiles hold ``tile_keys`` (a multiple of it:
    :func:`_cpu_tile_keys`), or ``block_k`` where the mask hides part of a tile (its hidden
    blocks are then skipped, not scored); ``prefetch_lines`` (:func:`_prefetch_lines`) and
    ``tile_values`` (:func:`_whole_tile_values`) choose how rows are read for their length.
    """
    q, q_offsets, q_start_pos, max_q_len = queries
    k_blocks, v_blocks, page_size, lookup_table, row_base, num_keys, k_scales, v_scales, \
        kv_format = kv
    has_scales = k_scales.shape[0] > 0
    program, additive, has_additive = mask
    has_score_mod, per_head = functions[2], functions[3]
    block_k, tile_keys, prefetch_lines, tile_values = tiling
    item_order, thread_starts = schedule
    part_m, part_l, part_acc = states
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_blocks.shape[2]
    group = num_heads // num_kv_heads
    kv_rows = max_q_len * group  # state rows per KV head
    num_rows = num_kv_heads * kv_rows
    num_partitions = part_m.shape[1]
    zero = scale - scale  # 0 of q's dtype
    for thread in prange(thread_starts.shape[0] - 1):
        # scratch of this thread's items (each item writes what it reads)
        qs = aligned_empty(num_rows * head_dim, q).reshape(num_rows, head_dim)
        s_buf = aligned_empty(num_rows * tile_keys, q)
        h_buf = np.empty(num_rows * tile_keys, dtype=np.bool_)
        seen_buf = np.empty(max_q_len * tile_keys, dtype=np.bool_)
        alpha = np.empty(num_rows, dtype=q.dtype)
        key_scales = np.empty(num_kv_heads * tile_keys if has_scales else 0, dtype=q.dtype)
        pages = np.empty(tile_keys + PREFETCH_KEYS, dtype=np.int64)
        slots = np.empty(tile_keys + PREFETCH_KEYS, dtype=np.int64)
        keys = np.empty(tile_keys, dtype=np.int64)
        for slot in range(thread_starts[thread], thread_starts[thread + 1]):
            item = item_order[slot]
            b = item // num_partitions
            part = item % num_partitions
            q_len = q_offsets[b + 1] - q_offsets[b]
            q0 = q_start_pos[b]
            start, end = partition_bounds(num_keys[b], part, num_partitions, block_k)
            m = part_m[b, part]
            l = part_l[b, part]
            acc = part_acc[b, part]
            for r in range(num_rows):
                m[r] = -math.inf
                l[r] = 0
                s = r % kv_rows // group
                h = r // kv_rows * group + r % group
                q_row = q_offsets[b] + s  # read once: the stores below may alias q_offsets
                for d in range(head_dim):
                    acc[r, d] = 0
                    qs[r, d] = q[q_row, h, d] * scale if s < q_len else zero
            if q_len == 0:
                continue
            next_k0 = start
            while next_k0 < end:
                k0 = next_k0
                k1 = min(k0 + tile_keys, end)
                status = mask_tile_status(program, functions, b, q0, q0 + q_len - 1, k0, k1 - 1)
                if status == TILE_PARTIAL and k1 - k0 > block_k:
                    # a tile the mask cuts goes block_k keys at a time: hidden ones skipped
                    k1 = k0 + block_k
                    status = mask_tile_status(program, functions, b, q0, q0 + q_len - 1, k0,
                                              k1 - 1)
                next_k0 = k1
                if status == TILE_FULL:
                    continue
                n = k1 - k0
                # the tile's rows in block order, and the first block of the next tile
                ahead = n + _tile_rows(lookup_table, page_size, row_base, b, k0, n,
                                       min(tile_keys, end - k1), status == TILE_NONE, pages,
                                       slots, keys)
                scores = s_buf[:num_rows * n].reshape(num_rows, n)
                hidden = h_buf[:num_rows * n].reshape(num_rows, n)  # filled for masked tiles
                # Hidden keys are scored too (their rows are in range) and then replaced by
                # -inf below, so nothing they hold is used.
                _tile_scores(qs, k_blocks, v_blocks, pages, slots, n, kv_rows, prefetch_lines,
                             kv_format, scores)
                if has_scales:  # q . (k s) = (q . k) s
                    _scale_keys(scores, k_scales, pages, slots, n, kv_rows, key_scales)
                for r in range(num_rows):
                    for i in range(n):
                        scores[r, i] = read_score(scores[r, i])
                if has_score_mod:
                    for r in range(num_rows):
                        s = r % kv_rows // group
                        h = r // kv_rows * group + r % group
                        if s < q_len:  # the function sees the call's positions only
                            for i in range(n):
                                scores[r, i] = modified_score(functions, scores[r, i], b, h,
                                                              q0 + s, k0 + keys[i])
                all_visible = status == TILE_NONE and not has_additive
                if not all_visible:
                    # the mask once per (query row, key) (per head for a function that
                    # reads it), then each state row
                    seen = seen_buf[:max_q_len * n].reshape(max_q_len, n)
                    each_head = per_head and status != TILE_NONE
                    if not each_head:
                        _seen_keys(program, functions, status, b, 0, q0, q_len, k0, keys, seen,
                                   0, max_q_len)
                    for r in range(num_rows):
                        s = r % kv_rows // group
                        h = r // kv_rows * group + r % group
                        if each_head:
                            _seen_keys(program, functions, status, b, h, q0, q_len, k0, keys,
                                       seen, s, s + 1)
                        for i in range(n):
                            bias = zero
                            if has_additive and seen[s, i]:
                                bias = key_bias(additive, b, h, s, k0 + keys[i])
                            hidden[r, i] = not seen[s, i] or bias == -math.inf
                            scores[r, i] = -math.inf if hidden[r, i] else scores[r, i] + bias
                softmax_tile(scores, m, l, alpha)
                if has_scales:  # p (v s) = (p s) v, for the keys taken
                    _scale_keys(scores, v_scales, pages, slots, n, kv_rows, key_scales)
                # acc's share of accumulate(acc, alpha, P V): rescaled here, the weighted V
                # rows added by the explicit vector code of _tile_values
                for r in range(num_rows):
                    a = alpha[r]
                    if a != 1:
                        for d in range(head_dim):
                            acc[r, d] *= a
                _tile_values(scores, k_blocks, v_blocks, pages, slots, n, ahead, kv_rows,
                             prefetch_lines, tile_values and all_visible, all_visible, hidden,
                             kv_format, acc)


@body
def _seen_keys(program, functions, status, b, h, q0, q_len, k0, keys, seen, s0, s1):
    """``seen[s, i]`` for rows ``s0 <= s < s1``: key ``k0 + keys[i]`` visible from local query
    row ``s`` (head ``h``)."""
    for s in range(s0, s1):
        for i in range(seen.shape[1]):
            seen[s, i] = s < q_len and (status == TILE_NONE or mask_visible(
                program, functions, b, h, q0 + s, k0 + keys[i]))


@body
def aligned_empty(size, like):
    """An uninitialised 1-D array of ``size`` elements of ``like``'s dtype that starts on a
    64-byte boundary (CPU only; plain Python or compiled).

    NumPy's large arrays start 16 bytes past one (the allocator's header) and Numba's on a
    32-byte one, where every other 64-byte vector load or store of a row crosses two cache
    lines.  Used for the queries and scores of the CPU decode kernel, and by its driver
    for the partial outputs of the worker threads' items: from memory, old against new in the same
    rounds, one thread 1.01-1.05x (varying between processes), chunks of 8 query rows
    1.07x, two threads 1.00-1.02x.
    """
    pad = 64 // like.itemsize
    buf = np.empty(size + pad, dtype=like.dtype)
    skip = (64 - buf.ctypes.data % 64) % 64 // like.itemsize
    return buf[skip:skip + size]


@body
def _tile_rows(lookup_table, page_size, row_base, b, k0, n, next_n, interleave, pages, slots,
               keys):
    """Block order of a tile of ``n`` keys from ``k0``: position ``r`` holds key
    ``k0 + keys[r]``, whose row is ``(pages[r], slots[r])`` (CPU only).

    The kernels take four positions (a block) at a time.  With ``interleave`` (a tile
    the mask shows whole), block ``r`` holds keys ``r``, ``r + n/4``, ``r + n/2`` and
    ``r + 3n/4``: four streams, each walking a quarter of the tile row after row (adjacent
    keys are adjacent rows).  Four adjacent rows read interleaved are read at about half
    the rate on this hardware, as each row is a page of its own where the hardware
    prefetcher starts again.  The last ``n % 4`` keys keep their order.  A tile the mask
    hides in part keeps the keys in order instead: its hidden keys then share a few blocks
    (the causal tail, the start of a window), where in four streams every block would hold
    one and go through the key-by-key path of :func:`_tile_values`.  The order changes
    which keys share a block, not the result up to rounding (softmax and the weighted sum
    do not depend on the order of the keys).

    The positions from ``n`` on hold the rows of the next tile's first block (the next tile
    has ``next_n`` keys), whose first lines the end of this tile prefetches.  Returns how
    many.
    """
    quarter = n // 4
    page, slot = kv_page_slot(lookup_table, page_size, row_base, b, k0)
    page_idx = (row_base[b] + k0) // page_size
    step = 0  # i % quarter and i // quarter, counted (no division per key)
    stream = 0
    for i in range(n):  # walk the slots page by page
        r = step * 4 + stream if interleave and i < 4 * quarter else i
        pages[r] = page
        slots[r] = slot
        keys[r] = i
        slot += 1
        if slot == page_size and i + 1 < n:
            slot = 0
            page_idx += 1
            page = lookup_table[b, page_idx]
        step += 1
        if step == quarter:
            step = 0
            stream += 1
    next_quarter = max(next_n // 4, 1)
    ahead = min(PREFETCH_KEYS, next_n)
    for r in range(ahead):
        pages[n + r], slots[n + r] = kv_page_slot(lookup_table, page_size, row_base, b,
                                                  k0 + n + r * next_quarter)
    return ahead


@body
def _scale_keys(scores, scales, pages, slots, n, group, key_scales):
    """``scores[r, i] *= scales[pages[i], slots[i], r // group]``: a quantized cache's
    scale of each key's row (``group`` state rows per KV head).  -inf stays -inf, and a
    weight of 0 stays 0 whatever the scale of a slot that is not read (NaN included).

    The scales are gathered first into ``key_scales`` (scratch of at least ``n`` elements
    per KV head), so that each row of scores is scaled in one vectorised pass ("8-bit
    scales" in docs/performance.rst)."""
    num_kv_heads = scores.shape[0] // group
    for i in range(n):
        row_scales = scales[pages[i], slots[i]]
        for j in range(num_kv_heads):
            key_scales[j * n + i] = row_scales[j]
    for r in range(scores.shape[0]):
        j = r // group
        row = scores[r]  # (row views: the loop below vectorises)
        row_scales = key_scales[j * n:(j + 1) * n]
        for i in range(n):
            x = row[i]
            keep = (x == 0) | (x == -math.inf)  # (| not or: a select, not a branch)
            row[i] = x if keep else x * row_scales[i]


@body
def _block_rows(heads_left):
    """Query heads in the next block of the CPU kernels: 4, 2 or 1, the most that fit in
    ``heads_left`` (a KV head's ``group`` query heads go in blocks of 4, then 2, then 1:
    seven as 4 + 2 + 1)."""
    return 4 if heads_left >= 4 else 2 if heads_left >= 2 else 1


@body
def _tile_scores(qs, k_blocks, v_blocks, pages, slots, n, group, prefetch_lines, kv_format,
                 scores):
    """``scores[h, r] = qs[h] . K[r, h // group]`` for the ``n`` positions of a tile (CPU only).

    A block of four positions at a time, and per KV head its query heads in blocks of
    :func:`_block_rows`: one sweep over D loads each K element once for up to sixteen dot
    products (:func:`.simd.scores_block_4`).  The rows of the positions
    :data:`PREFETCH_KEYS` ahead are asked for (then the tile's first V rows).
    """
    num_kv_heads = k_blocks.shape[2]
    for i in range(0, n, 4):
        if prefetch_lines:
            for t in range(i + PREFETCH_KEYS, i + PREFETCH_KEYS + 4):
                if t < n:
                    prefetch_row(k_blocks, pages[t], slots[t], prefetch_lines)
                elif t < 2 * n:  # then the tile's first V rows
                    prefetch_row(v_blocks, pages[t - n], slots[t - n], prefetch_lines)
        for j in range(num_kv_heads):
            h = j * group
            while h < (j + 1) * group:
                rows = _block_rows((j + 1) * group - h)
                if rows == 4:
                    scores_block_4(qs, h, k_blocks, j, pages, slots, i, n, scores, kv_format)
                elif rows == 2:
                    scores_block_2(qs, h, k_blocks, j, pages, slots, i, n, scores, kv_format)
                else:
                    scores_block_1(qs, h, k_blocks, j, pages, slots, i, n, scores, kv_format)
                h += rows


@body
def _tile_values(weights, k_blocks, v_blocks, pages, slots, n, ahead, group, prefetch_lines,
                 whole_tile, all_visible, hidden, kv_format, acc):
    """``acc[h] += sum_r weights[h, r] V[r, h // group]`` over a tile (CPU only).

    A block of four positions at a time, and the query heads in blocks of
    :func:`_block_rows`: one sweep over D adds four weighted V rows to the accumulators of
    up to four heads of a KV head, each V element loaded once for all
    (:func:`.simd.values_block_4`); the last ``n % 4`` positions one by one.  Unless
    the tile is ``all_visible``, the keys ``hidden[h, r]`` marks are left out, so no NaN
    their slots hold reaches ``acc`` (a visible key whose weight underflowed to 0 still adds
    ``0 * V``: NaN in a visible row propagates).  The rows of the positions
    :data:`PREFETCH_KEYS` ahead are asked for (then the next tile's first K rows).

    With ``whole_tile`` (an all-visible tile of short rows: see :func:`_whole_tile_values`)
    each block of query heads instead runs over the
    whole tile at once (:func:`.simd.values_tile_4`), its accumulators in registers.
    """
    head_dim = acc.shape[1]
    num_heads = weights.shape[0]
    if whole_tile:
        h = 0
        while h < num_heads:
            j = h // group
            rows = _block_rows((j + 1) * group - h)
            if rows == 4:
                values_tile_4(weights, h, v_blocks, j, pages, slots, n, acc, kv_format)
            elif rows == 2:
                values_tile_2(weights, h, v_blocks, j, pages, slots, n, acc, kv_format)
            else:
                values_tile_1(weights, h, v_blocks, j, pages, slots, n, acc, kv_format)
            h += rows
        return
    i = 0
    while i + 4 <= n:
        if prefetch_lines:
            for t in range(i + PREFETCH_KEYS, i + PREFETCH_KEYS + 4):
                if t < n:
                    prefetch_row(v_blocks, pages[t], slots[t], prefetch_lines)
                elif t < ahead:  # then the next tile's first K rows
                    prefetch_row(k_blocks, pages[t], slots[t], prefetch_lines)
        h = 0
        while h < num_heads:
            j = h // group
            rows = _block_rows((j + 1) * group - h)
            some_hidden = False
            if not all_visible:
                for g in range(h, h + rows):
                    for r in range(i, i + 4):
                        some_hidden |= hidden[g, r]
            if some_hidden:
                for g in range(h, h + rows):  # key by key, leaving out hidden keys
                    for r in range(i, i + 4):
                        if not hidden[g, r]:
                            w = weights[g, r]
                            page = pages[r]
                            slot = slots[r]
                            for d in range(head_dim):
                                acc[g, d] += w * stored_value(v_blocks[page, slot, j, d],
                                                              kv_format, acc)
            elif rows == 4:
                values_block_4(weights, h, v_blocks, j, pages, slots, i, acc, kv_format)
            elif rows == 2:
                values_block_2(weights, h, v_blocks, j, pages, slots, i, acc, kv_format)
            else:
                values_block_1(weights, h, v_blocks, j, pages, slots, i, acc, kv_format)
            h += rows
        i += 4
    while i < n:
        page = pages[i]
        slot = slots[i]
        for h in range(num_heads):
            w = weights[h, i]
            if all_visible or not hidden[h, i]:
                j = h // group
                for d in range(head_dim):
                    acc[h, d] += w * stored_value(v_blocks[page, slot, j, d], kv_format, acc)
        i += 1


def _decode_reduce_cpu(part_m, part_l, part_acc, sinks, has_sink, out, lse):
    """Merge the partitions of every state row ``(b, h)`` of ``part_* [B, P, R(, D)]`` and
    finish it (:func:`.merge_partials`): ``out[b, h]``, ``lse[b, h]``."""
    num_heads = part_m.shape[2]
    for row in prange(part_m.shape[0] * num_heads):
        b = row // num_heads
        h = row % num_heads
        lse[b, h] = merge_partials(part_m, part_l, part_acc, b, h, False, sinks[h], has_sink,
                                   0, 1, out)
