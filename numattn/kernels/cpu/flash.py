"""Blocked (flash) attention on the CPU over the paged addressing of every K/V input.

The kernel splits the work into items ``(sequence, KV head, query tile)``; each item is
computed by one thread from start to end, so results do not depend on the thread count.
Inside an item the ``group`` query heads that share the KV head are stacked into one tall
tile of ``group * block_q`` rows, and for each tile of ``block_k`` keys:

1. the mask's tile status is looked up: a FULL tile (every pair hidden) is skipped before
   any key is read; a NONE tile (nothing hidden) skips the per-element mask;
2. the K and V rows of the tile are gathered through the page table into contiguous
   scratch, so every cache layout feeds the same BLAS calls;
3. ``S = Q K^T`` (one GEMM), the per-element mask and additive tensor where needed (as one
   run of visible keys per row when the mask has no ``|``), then the online-softmax update
   (:func:`.softmax.softmax_tile`) turns ``S`` into ``P``;
4. ``acc = alpha * acc + P V`` (a second GEMM).

With bfloat16 queries and K/V on a CPU with AMX, steps 2-4 run on tile registers instead
(:mod:`.amx`): K and V are packed as stored rather than widened, and both products are
``tdpbf16ps`` tiles (:func:`_tile_step_amx`).

Partially masked tiles are cut into runs of a few query positions, each trimmed to the keys it
can see, so causal and windowed masks cost about their visible pairs.  BLAS runs
single-threaded inside the parallel loop, each thread owns its scratch, items are dealt to
threads by estimated cost, and the sink logit enters each row's denominator exactly once,
when the row is finished.  Problems of at most :data:`MULTI_QUERY_MAX_LEN` query rows per
sequence (with enough work) go to the split-K kernel instead
(:func:`.split_k.run_multi_query_cpu`), which reads each token's K and V
row once for all heads.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading

import numpy as np

from ...core.dtypes import FORMAT_BFLOAT16, kernel_view, storage_format
from ...core.jit import Specialization, body, cpu_jit, prange
from ...core.masks import TILE_FULL, TILE_NONE, TILE_PARTIAL
from ...core.validate import row_counts
from ..shared.masks import add_bias, mask_tile_status, mask_visible, visible_span
from ..shared.paging import kv_page_slot
from ..shared.scores import modified_score, read_score
from ..shared.softmax import accumulate, finish_row
from . import amx
from .amx import (
    pack_keys,
    pack_values,
    tile_config,
    tile_configuration,
    tile_release,
    tile_scores,
    tile_values,
)
from .convert import widened
from .function_tiles import with_tile_tables
from .schedule import zigzag_schedule
from .simd import prefetch_head, round_span, widen_row
from .softmax import softmax_split_tile, softmax_tile
from .split_k import aligned_empty, run_multi_query_cpu

_BLAS_LIBRARIES = None  # threadpoolctl's controllers of the BLAS libraries loaded
_BLAS_LOCK = threading.Lock()
_BLAS_CALLS = 0  # calls inside _blas_single_thread, from every Python thread
_BLAS_ORIGINAL = []  # their thread counts, read while no call held BLAS to one thread


@contextlib.contextmanager
def _blas_single_thread():
    """Holds every BLAS thread pool to one thread while the flash kernel runs on the worker
    threads (each of its GEMMs then runs on the worker that calls it), then restores them.

    The limit is process-wide and calls may overlap from several Python threads: the first
    call in reads the thread counts and sets the limit, the last one out restores them (a
    call that read them while another held the limit would "restore" one thread for good,
    and one that restored them while another ran would leave that one's GEMMs to the whole
    pool, several times slower).  threadpoolctl (>= 3.8) lets only one Python thread change
    OpenBLAS's pool, the last one that did while it lives, so each change here gives that
    control back (:func:`_set_blas_threads`).
    """
    global _BLAS_LIBRARIES, _BLAS_CALLS, _BLAS_ORIGINAL
    with _BLAS_LOCK:
        if _BLAS_LIBRARIES is None:
            import scipy.linalg.cython_blas  # noqa: F401  (numba's np.dot calls SciPy's BLAS)
            from threadpoolctl import ThreadpoolController

            _BLAS_LIBRARIES = ThreadpoolController().select(user_api="blas").lib_controllers
        if _BLAS_CALLS == 0:
            _BLAS_ORIGINAL = [library.num_threads for library in _BLAS_LIBRARIES]
            _set_blas_threads([1] * len(_BLAS_LIBRARIES))
        _BLAS_CALLS += 1
    try:
        yield
    finally:
        with _BLAS_LOCK:
            _BLAS_CALLS -= 1
            if _BLAS_CALLS == 0:
                _set_blas_threads(_BLAS_ORIGINAL)


def _set_blas_threads(counts):
    """Sets the BLAS libraries' thread counts, then gives up threadpoolctl's control of
    OpenBLAS's pool if this thread holds it, so that the next change, from any thread,
    takes effect.  Another thread that holds that control (one of the application's own
    that set a limit and lives on) keeps it, and then these changes do nothing."""
    for library, num_threads in zip(_BLAS_LIBRARIES, counts):
        library.set_num_threads(num_threads)
        release = getattr(library, "clear_controlling_thread", None)  # threadpoolctl >= 3.8
        if release is not None:
            release()


def _work_items(q_offsets, q_start_pos, num_keys, num_kv_heads, program, functions, block_q,
               block_k, num_threads):
    """Work items ``(sequence, KV head, first row)``, their split among the threads, and
    the work they hold.

    Each query tile is costed (rows x keys of its key tiles that the mask does not hide
    entirely), and the items, most expensive first, are dealt to the threads in a zigzag
    (0, 1, .., T-1, T-1, .., 0, 0, ..), which balances them.  Thread ``t`` runs items
    ``starts[t]:starts[t + 1]``.  The split only decides which thread computes an item, never
    how, so results do not depend on the number of threads.  Returns ``items [4, n]`` (rows:
    each item's sequence, KV head, first row and width), ``starts`` and the total cost
    (query rows x keys, summed over the KV heads): two arrays, as Numba hands each array it
    returns to Python at a cost.  Compiled, because the same steps as NumPy array operations
    cost more than the kernel on small problems (docs/plans.rst).
    """
    batch = q_offsets.shape[0] - 1
    tiles = np.empty(batch, dtype=np.int64)
    size = np.empty(batch, dtype=np.int64)
    num_tiles = 0
    for b in range(batch):
        q_len = q_offsets[b + 1] - q_offsets[b]
        tiles[b] = -(-q_len // block_q)
        # equal tiles per sequence (a multiple of 16 rows), not block_q and a short remainder
        per_tile = -(-q_len // max(tiles[b], 1))
        size[b] = min(-(-per_tile // 16) * 16, block_q)
        num_tiles += tiles[b]
    seq = np.empty(num_tiles, dtype=np.int64)
    row0 = np.empty(num_tiles, dtype=np.int64)
    width = np.empty(num_tiles, dtype=np.int64)
    i = 0
    for b in range(batch):
        q_len = q_offsets[b + 1] - q_offsets[b]
        for t in range(tiles[b]):
            seq[i] = b
            row0[i] = t * size[b]
            width[i] = min(size[b], q_len - row0[i])
            i += 1
    cost = np.empty(num_tiles, dtype=np.int64)
    _tile_costs(q_start_pos, num_keys, seq, row0, width, program, functions, block_k, cost)
    # item i: query tile i // num_kv_heads, KV head i % num_kv_heads
    num_items = num_tiles * num_kv_heads
    item_cost = np.empty(num_items, dtype=np.int64)
    total_cost = 0
    for i in range(num_items):
        item_cost[i] = cost[i // num_kv_heads]
        total_cost += item_cost[i]
    order, starts = zigzag_schedule(item_cost, num_threads)
    items = np.empty((4, num_items), dtype=np.int64)
    for slot in range(num_items):
        item = order[slot]
        tile = item // num_kv_heads
        items[0, slot] = seq[tile]
        items[1, slot] = item % num_kv_heads
        items[2, slot] = row0[tile]
        items[3, slot] = width[tile]
    return items, starts, total_cost


def work_items(step):
    """The flash kernel's work items of a step (an :class:`~numattn.core.problem.AttentionStep`
    or :class:`~numattn.core.problem.AttentionProblem`: the same for every layer of a step,
    dealt to the threads there are now): :func:`_work_items`' ``(items, starts,
    total_cost)``."""
    import numba

    config = step.config
    return cpu_jit(_work_items)(
        step.q_offsets, step.q_start_pos, step.layout.num_keys, step.layout.num_kv_heads,
        step.mask.program, step.mask.functions, config.block_q, config.block_k,
        numba.get_num_threads(),
    )


def run_flash_cpu(problem, items=None):
    """Run the CPU flash kernel on a normalised problem (no validation here).

    Parameters
    ----------
    problem : AttentionProblem
        From :func:`numattn.core.problem.attention_problem` (host arrays).
    items : tuple, optional
        The step's :func:`work_items` (a plan's); made here when not given.

    Returns
    -------
    out, lse
        The result (``problem.out`` when given: of the compute dtype, or of q's 16-bit
        dtype, into which the kernel rounds) and, with ``problem.return_lse``, the LSE
        (else ``None``).
    """
    problem = with_tile_tables(problem)
    queries, layout, mask, softmax, config, out, out_shape, return_lse = problem[:8]
    q, q_offsets = queries[0], queries[1]
    dtype = problem.dtype  # the compute dtype (the kernel widens 16-bit queries as it reads)
    total, num_heads, head_dim = q.shape
    result = out if out is not None else np.empty(out_shape, dtype)
    lse = np.empty(out_shape[:-1], dtype) if return_lse else None
    if total == 0 or num_heads == 0:
        return result, lse
    out_rows = result.reshape(total, num_heads, head_dim)
    lse_rows = np.empty((1, 1), dtype) if lse is None else lse.reshape(total, num_heads)
    group = num_heads // layout.num_kv_heads
    q_lens = row_counts(q_offsets)
    max_q_len = int(q_lens.max())
    # multiply-adds of the Q K^T and P V products (before the mask)
    work = 2 * int(np.dot(q_lens, layout.num_keys)) * num_heads * head_dim
    batch = q_offsets.shape[0] - 1
    if (max_q_len <= MULTI_QUERY_MAX_LEN and work > MULTI_QUERY_MIN_WORK
            and total >= MULTI_QUERY_MIN_ACTIVE * batch * max_q_len
            and layout.max_keys >= MULTI_QUERY_MIN_KEYS_PER_ROW * max_q_len):
        # few rows a sequence: decode's kernels, over queries and a result of the compute
        # dtype
        if q.dtype != dtype:
            queries = queries._replace(q=widened(q, dtype))
        wide_rows = out_rows if out_rows.dtype == dtype else np.empty(out_rows.shape, dtype)
        run_multi_query_cpu(queries, layout, mask, max_q_len, softmax, config, wide_rows,
                            None if lse is None else lse_rows, work > SERIAL_MULTIPLY_ADDS,
                            problem.special)
        if wide_rows is not out_rows:
            out_rows[...] = wide_rows  # rounded to nearest, ties to even
        return result, lse
    if items is None:
        items = work_items(problem)
    schedule, total_cost = items[:2], items[2]
    # multiply-adds of the Q K^T and P V products
    parallel = 2 * total_cost * group * head_dim > SERIAL_MULTIPLY_ADDS
    # the queries in their stored type, a row per token as widen_row reads K/V rows
    q_rows = kernel_view(q).reshape(total, 1, num_heads, head_dim)
    q_format = storage_format(q.dtype)
    use_amx = _amx_tiles(q_format, layout, dtype)
    tiling = (group, config.block_q, config.block_k, _SUB_Q, use_amx)
    special = _with_amx(problem.special) if use_amx else problem.special
    # the parts go as plain tuples: Numba types those in C at each call, NamedTuples in Python
    with _blas_single_thread() if parallel else contextlib.nullcontext():
        cpu_jit(_flash_kernel, parallel=parallel, special=special)(
            (q_rows, *queries[1:3], q_format), schedule, layout[:9], tuple(mask[:3]),
            mask.functions,
            tuple(softmax), tiling,
            (kernel_view(out_rows), lse_rows, lse is not None),
        )
    return result, lse


def _amx_tiles(q_format, layout, dtype):
    """Whether the flash kernel multiplies its tiles (those of a multiple of 32 keys) on
    AMX (:mod:`.amx`, :func:`_tile_step_amx`): bfloat16 queries and K/V (no scales),
    float32 arithmetic, D a multiple of 32, on a CPU and system that offer the tiles."""
    return (q_format == FORMAT_BFLOAT16 and layout.kv_format == FORMAT_BFLOAT16
            and layout.k_scales.shape[0] == 0 and dtype == np.float32
            and layout.head_dim % 32 == 0 and amx.available())


@functools.lru_cache(maxsize=64)
def _with_amx(special):
    """``special`` (the call's functions, or ``None``) with :func:`_tile_on_amx` bound to
    :func:`_tile_on_amx_tiles`: the kernels that run tiles on AMX.  The others keep the
    stand-in, so that they compile none of the AMX code (first-call times: "Flash prefill
    on AMX tiles" in docs/performance.rst).  One object per ``special``, as the compiled
    kernels are cached by it."""
    overrides = {} if special is None else dict(special.overrides)
    overrides["_tile_on_amx"] = _tile_on_amx_tiles
    digest = "amx" if special is None else special.digest + "_amx"
    return Specialization(overrides, digest)


# --------------------------------------------------------------------------------------
# Kernel (CPU only) and its helpers.
# --------------------------------------------------------------------------------------
#: Calls with up to this many multiply-adds run on the calling thread: waking the worker
#: threads costs more than it saves on such work ("Short calls" in docs/performance.rst).
SERIAL_MULTIPLY_ADDS = 2**21
#: Problems with at most MULTI_QUERY_MAX_LEN query rows per sequence, more than
#: MULTI_QUERY_MIN_WORK multiply-adds, at least MULTI_QUERY_MIN_ACTIVE of their
#: ``B * max_q_len`` rows in use and at least MULTI_QUERY_MIN_KEYS_PER_ROW keys (longest
#: sequence) per query row run on decode's kernels
#: (:func:`.split_k.run_multi_query_cpu`, which computes every sequence as ``max_q_len``
#: rows long and reads each K and V row once for all of them); others on the kernel below,
#: which has fewer fixed costs, does no work on rows a sequence does not have, and is the
#: faster where the cache is short for the rows.  Measured: "A few query rows per sequence"
#: in docs/performance.rst.
MULTI_QUERY_MAX_LEN = 16
MULTI_QUERY_MIN_WORK = SERIAL_MULTIPLY_ADDS
MULTI_QUERY_MIN_ACTIVE = 0.5
MULTI_QUERY_MIN_KEYS_PER_ROW = 32
#: The gather of a work item reads one KV head's row from each token's row of all heads:
#: rows that stride through memory, which the hardware prefetcher does not follow.  It asks
#: for the rows this many keys ahead ("Flash gather prefetch" in docs/performance.rst).
GATHER_PREFETCH_KEYS = 4
_CHUNK = 16  # keys per mask sub-tile when a PARTIAL tile is resolved row by row
_SUB_Q = 16  # query positions per sub-tile of a PARTIAL tile (each trimmed to its keys)



@body
def _row_visibility(program, functions, b, h, q_idx, k0, kw, visible):
    """``visible[j]`` for keys ``k0 .. k0 + kw - 1`` of query ``q_idx`` (head ``h`` of
    sequence ``b``), by sub-tiles."""
    for c0 in range(0, kw, _CHUNK):
        c1 = min(c0 + _CHUNK, kw)
        status = mask_tile_status(program, functions, b, q_idx, q_idx, k0 + c0, k0 + c1 - 1)
        if status == TILE_PARTIAL:
            for j in range(c0, c1):
                visible[j] = mask_visible(program, functions, b, h, q_idx, k0 + j)
        else:
            for j in range(c0, c1):
                visible[j] = status == TILE_NONE


@body
def _pv_visible_only(p_tile, v_tile, mask, pos0, k0, group, b, bm, kv_head, row0, pv, visible):
    """``pv = P V`` reading only each row's visible keys (V holds a NaN or inf).

    Used instead of the GEMM when a partially masked tile's values are not all finite, so
    that a non-finite value behind the mask (``p = 0``) cannot reach the rows it is hidden
    from, while a row that sees it still gets NaN, as the reference does.  Rows of
    ``p_tile`` are stacked position-major: row ``r * group + hl`` is position ``pos0 + r``
    of head ``kv_head * group + hl``.  ``mask`` holds
    :class:`~numattn.core.problem.MaskArgs`' fields.
    """
    program, additive, has_additive, functions = mask
    per_head = functions[3]
    kw = v_tile.shape[0]
    head_dim = v_tile.shape[1]
    n_hm = additive.shape[1]
    for r in range(p_tile.shape[0] // group):
        if not per_head:
            _row_visibility(program, functions, b, kv_head * group, pos0 + r, k0, kw, visible)
        for hl in range(group):
            if per_head:
                _row_visibility(program, functions, b, kv_head * group + hl, pos0 + r, k0, kw,
                                visible)
            i = r * group + hl
            hm = kv_head * group + hl if n_hm > 1 else 0
            for d in range(head_dim):
                pv[i, d] = 0
            for j in range(kw):
                seen = visible[j]
                if seen and has_additive:
                    seen = additive[bm, hm, row0 + r, k0 + j] != -math.inf
                if seen:
                    p = p_tile[i, j]
                    for d in range(head_dim):
                        pv[i, d] += p * v_tile[j, d]


@body
def _key_extent(program, functions, b, q0, q1, k0, kw):
    """Keys ``[ka, kb)`` of a tile that queries ``[q0, q1]`` may see (FULL ends trimmed)."""
    ka = 0
    while ka < kw:
        end = min(ka + _CHUNK, kw)
        if mask_tile_status(program, functions, b, q0, q1, k0 + ka, k0 + end - 1) != TILE_FULL:
            break
        ka = end
    kb = kw
    while kb > ka:
        start = max(kb - _CHUNK, ka)
        if mask_tile_status(program, functions, b, q0, q1, k0 + start,
                            k0 + kb - 1) != TILE_FULL:
            break
        kb = start
    return ka, kb


@body
def _tile_step(scratch, head_dim, v_finite, r0, r1, ka, kb, elementwise, pos0, k0, group,
               mask, b, bm, kv_head, row0):
    """One online-softmax step of query positions ``[r0, r1)`` over tile keys ``[ka, kb)``.

    ``S = Q K^T`` and ``P V`` are two BLAS GEMMs on contiguous views of the stacked rows
    ``[r0 * group, r1 * group)``; the score modifier, if any, and with ``elementwise`` the
    mask (and the additive tensor) apply pair by pair in between.  The state moves as every
    tile loop's does (:mod:`numattn.kernels.shared.softmax`): :func:`.softmax.softmax_tile`
    turns ``S`` into ``P`` and updates ``m`` and ``l``, then ``acc = alpha acc + P V``
    (:func:`accumulate`).  ``scratch`` is the thread's buffers (:func:`_flash_kernel`),
    ``mask`` holds :class:`~numattn.core.problem.MaskArgs`' fields.
    """
    q_buf, acc_buf, pv_buf, s_buf = scratch[0], scratch[1], scratch[2], scratch[3]
    row_state, k_tile, v_tile, visible = scratch[4], scratch[5], scratch[6], scratch[7]
    functions = mask[3]
    m_run = row_state[0]
    l_run = row_state[1]
    alpha = row_state[2]
    i0 = r0 * group
    rows = (r1 - r0) * group
    nk = kb - ka
    q_rows = q_buf[i0 * head_dim: (i0 + rows) * head_dim].reshape(rows, head_dim)
    keys = k_tile[ka * head_dim: kb * head_dim].reshape(nk, head_dim)
    values = v_tile[ka * head_dim: kb * head_dim].reshape(nk, head_dim)
    scores = s_buf[: rows * nk].reshape(rows, nk)
    np.dot(q_rows, keys.T, scores)
    for i in range(rows):
        for j in range(nk):
            scores[i, j] = read_score(scores[i, j])
    h0 = kv_head * group
    if functions[2]:  # the score modifier
        _modify_scores(scores, functions, r0, r1, group, b, h0, pos0, k0 + ka)
    if elementwise:
        _mask_scores(scores, mask, r0, r1, pos0, k0 + ka, group, b, bm, h0, row0, visible)
    m_rows = m_run[i0: i0 + rows]
    l_rows = l_run[i0: i0 + rows]
    alpha_rows = alpha[:rows]
    softmax_tile(scores, m_rows, l_rows, alpha_rows)
    pv = pv_buf[: rows * head_dim].reshape(rows, head_dim)
    if elementwise and not v_finite:
        _pv_visible_only(scores, values, mask, pos0 + r0, k0 + ka, group, b, bm, kv_head,
                         row0 + r0, pv, visible)
    else:
        np.dot(scores, values, pv)
    _add_to_acc(acc_buf, pv, alpha_rows, i0, rows)


@body
def _tile_on_amx(k_blocks, v_blocks, pages, slots, kw, whole, scratch, width, pos0, k0, group,
                 mask, b, bm, kv_head, row0, scale, sub_q):
    """Whether a tile went on AMX: never in the kernels bound without AMX (a stand-in that
    compiles to nothing), :func:`_tile_on_amx_tiles` in those :func:`_with_amx` binds."""
    return False


@body
def _tile_on_amx_tiles(k_blocks, v_blocks, pages, slots, kw, whole, scratch, width, pos0, k0,
                       group, mask, b, bm, kv_head, row0, scale, sub_q):
    """A tile of ``kw`` keys (a multiple of 32) on AMX: K and V packed
    (:func:`_pack_tile`), then :func:`_tile_step_amx`, unless the mask cuts the tile and
    its V holds a NaN or inf (then ``False``: the vector path leaves hidden keys out)."""
    if _pack_tile(k_blocks, v_blocks, pages, slots, kw, kv_head, scratch) or whole:
        _tile_step_amx(scratch, k_blocks.shape[3], width, kw, not whole, pos0, k0, group,
                       mask, b, bm, kv_head, row0, scale, sub_q)
        return True
    return False


@body
def _tile_step_amx(scratch, head_dim, width, kw, elementwise, pos0, k0, group, mask, b, bm,
                   kv_head, row0, scale, sub_q):
    """:func:`_tile_step` of all the item's ``width`` query positions over a tile of ``kw``
    keys (a multiple of 32), its two products on AMX tiles (:mod:`.amx`): the stacked
    rows' bfloat16 bits against the packed K and V of the tile (``scratch[9:12]``,
    :func:`.amx.pack_keys`, :func:`.amx.pack_values`), the weights split in two bfloat16
    parts (``scratch[12:14]``, :func:`.softmax.softmax_split_tile`).  The scale multiplies
    the sums, in the softmax's pass where no mask, additive tensor or score modifier comes
    in between (and the scale is positive).  ``sub_q`` positions at a time (their scores
    stay in the L1/L2 caches from one pass to the next); with ``elementwise`` each block
    that the mask cuts goes through :func:`_mask_scores` and one it hides is skipped (the
    V of the tile must then be finite: a hidden NaN would reach the rows through a weight
    of 0)."""
    acc_buf, pv_buf, s_buf, row_state = scratch[1], scratch[2], scratch[3], scratch[4]
    q_bits, k_pack, v_pack = scratch[9], scratch[10], scratch[11]
    w_hi, w_lo = scratch[12], scratch[13]
    program, functions = mask[0], mask[3]
    h0 = kv_head * group
    for r0 in range(0, width, sub_q):
        r1 = min(r0 + sub_q, width)
        status = TILE_NONE
        if elementwise:
            status = mask_tile_status(program, functions, b, pos0 + r0, pos0 + r1 - 1, k0,
                                      k0 + kw - 1)
            if status == TILE_FULL:
                continue
        i0 = r0 * group
        rows = (r1 - r0) * group
        tile_scores(q_bits[i0 * head_dim:], rows, head_dim, k_pack, kw, s_buf)
        scores = s_buf[:rows * kw].reshape(rows, kw)
        masked = (elementwise and status != TILE_NONE) or mask[2]
        raw = not (masked or functions[2]) and scale > 0
        if not raw:
            for i in range(rows):
                for j in range(kw):
                    scores[i, j] = read_score(scores[i, j] * scale)
            if functions[2]:  # the score modifier
                _modify_scores(scores, functions, r0, r1, group, b, h0, pos0, k0)
            if masked:
                _mask_scores(scores, mask, r0, r1, pos0, k0, group, b, bm, h0, row0,
                             scratch[7])
        alpha_rows = row_state[2][i0:i0 + rows]
        softmax_split_tile(scores, scale, raw, row_state[0][i0:i0 + rows],
                           row_state[1][i0:i0 + rows], alpha_rows, w_hi, w_lo)
        for j in range(rows * kw, (rows + 15) // 16 * 16 * kw):  # the 16-row tiles' rest
            w_hi[j] = 0
            w_lo[j] = 0
        tile_values(w_hi, w_lo, rows, kw, v_pack, head_dim, pv_buf)
        _add_to_acc(acc_buf, pv_buf[:rows * head_dim].reshape(rows, head_dim), alpha_rows,
                    i0, rows)


@body
def _mask_scores(scores, mask, r0, r1, pos0, key0, group, b, bm, h0, row0, visible):
    """The mask and the additive tensor over ``scores`` (rows stacked as :func:`_tile_step`
    stacks them, column ``j`` for key ``key0 + j``): hidden pairs become ``-inf``.  As one
    run of visible keys per row where the mask gives it (:func:`visible_span`), else key
    by key through ``visible`` (scratch)."""
    program, additive, has_additive, functions = mask
    per_head = functions[3]
    nk = scores.shape[1]
    n_hm = additive.shape[1]
    for r in range(r0, r1):
        jlo, jhi, is_span = visible_span(program, pos0 + r, key0, nk)
        if not is_span and not per_head:
            _row_visibility(program, functions, b, h0, pos0 + r, key0, nk, visible)
        for hl in range(group):
            i = (r - r0) * group + hl
            hm = h0 + hl if n_hm > 1 else 0
            if not is_span and per_head:
                _row_visibility(program, functions, b, h0 + hl, pos0 + r, key0, nk, visible)
            if is_span:
                for j in range(jlo):
                    scores[i, j] = -np.inf
                for j in range(jhi, nk):
                    scores[i, j] = -np.inf
                if has_additive:
                    for j in range(jlo, jhi):
                        scores[i, j] = add_bias(scores[i, j],
                                                additive[bm, hm, row0 + r, key0 + j])
                continue
            for j in range(nk):
                if not visible[j]:
                    scores[i, j] = -np.inf
                elif has_additive:
                    scores[i, j] = add_bias(scores[i, j], additive[bm, hm, row0 + r, key0 + j])


@body
def _pack_tile(k_blocks, v_blocks, pages, slots, kw, kv_head, scratch):
    """The tile's bfloat16 K and V rows of KV head ``kv_head`` packed for the AMX tiles
    (``scratch[10]``, ``scratch[11]``: :func:`.amx.pack_keys`, :func:`.amx.pack_values`),
    16 keys at a time, asking for the next 16 keys' rows first; returns whether every V
    element is finite.  (``kw`` is a multiple of 16.)"""
    for j in range(min(16, kw)):
        prefetch_head(k_blocks, pages[j], slots[j], kv_head)
        prefetch_head(v_blocks, pages[j], slots[j], kv_head)
    finite = True
    for j in range(0, kw, 16):
        for ahead in range(j + 16, min(j + 32, kw)):
            prefetch_head(k_blocks, pages[ahead], slots[ahead], kv_head)
            prefetch_head(v_blocks, pages[ahead], slots[ahead], kv_head)
        pack_keys(k_blocks, pages, slots, j, kv_head, scratch[10], kw)
        finite &= pack_values(v_blocks, pages, slots, j, kv_head, scratch[11])
    return finite


@body
def _modify_scores(scores, functions, r0, r1, group, b, h0, pos0, key0):
    """The score modifier over ``scores``, row ``(r - r0) group + hl`` for position
    ``pos0 + r`` of head ``h0 + hl``, column ``j`` for key ``key0 + j``."""
    for r in range(r0, r1):
        for hl in range(group):
            i = (r - r0) * group + hl
            for j in range(scores.shape[1]):
                scores[i, j] = modified_score(functions, scores[i, j], b, h0 + hl, pos0 + r,
                                              key0 + j)


@body
def _add_to_acc(acc_buf, pv, alpha_rows, i0, rows):
    """``acc = alpha acc + P V`` (:func:`accumulate`) for the stacked rows ``[i0, i0 +
    rows)``."""
    head_dim = pv.shape[1]
    acc = acc_buf[i0 * head_dim: (i0 + rows) * head_dim].reshape(rows, head_dim)
    for i in range(rows):
        a = alpha_rows[i]
        for d in range(head_dim):
            acc[i, d] = accumulate(acc[i, d], a, pv[i, d])


@body
def _tile_costs(q_start_pos, num_keys, seq, row0, widths, program, functions, block_k, cost):
    """``cost[i]``: rows x keys of the key tiles that query tile ``i`` does not skip."""
    for i in range(seq.shape[0]):
        b = seq[i]
        width = widths[i]
        pos0 = q_start_pos[b] + row0[i]
        keys = 0
        for k0 in range(0, num_keys[b], block_k):
            kw = min(block_k, num_keys[b] - k0)
            if mask_tile_status(program, functions, b, pos0, pos0 + width - 1, k0,
                                k0 + kw - 1) != TILE_FULL:
                keys += kw
        cost[i] = width * (keys + 1)


def _flash_kernel(queries, schedule, kv, mask, functions, softmax, tiling, outputs):
    """Every work item of ``schedule = (items, starts)`` (:func:`_work_items`), thread ``t``
    those of ``starts[t]:starts[t + 1]``.

    ``queries = (q [T, 1, H, D], offsets, start_pos, q_format)``: the queries in their
    stored type (a kernel view, as K/V rows are read; ``q_format`` the ``FORMAT_*`` code)
    and fields of :class:`~numattn.core.problem.QueryRows`; ``kv``, ``mask`` and
    ``softmax`` are tuples of the fields of :class:`~numattn.core.problem.PagedKV`,
    :class:`~numattn.core.problem.MaskArgs` (but its ``functions``, apart: a parallel loop
    takes no tuple that holds a tuple) and :class:`~numattn.core.problem.SoftmaxArgs`;
    ``tiling = (group, block_q, block_k, sub_q, use_amx)`` (``use_amx``:
    :func:`_amx_tiles`); ``outputs = (out [T, H, D], lse [T, H], want_lse)``, ``out`` of
    the compute dtype or a kernel view of q's 16-bit dtype (rows rounded as
    :func:`.simd.round_span` rounds).
    """
    items, starts = schedule
    item_seq, item_head, item_row0, item_width = items[0], items[1], items[2], items[3]
    group, block_q, block_k, use_amx = tiling[0], tiling[1], tiling[2], tiling[4]
    head_dim = queries[0].shape[3]
    dtype = outputs[1].dtype
    widest = 0  # rows of the widest item (at most block_q): scratch for the stacked rows
    for item in range(item_width.shape[0]):
        widest = max(widest, item_width[item])
    max_rows = group * min(widest, block_q)
    padded_rows = (max_rows + 15) // 16 * 16  # AMX tiles go 16 rows at a time
    amx_rows = padded_rows if use_amx else 0
    amx_keys = block_k if use_amx else 0
    config = tile_configuration()
    for thread in prange(starts.shape[0] - 1):
        if starts[thread] == starts[thread + 1]:
            continue
        # Scratch of one thread, reused by its items: the stacked query tile, accumulator,
        # P V product, running max / sum / rescale factors, one tile of scores, K and V.
        q_buf = np.empty(max_rows * head_dim, dtype=dtype)
        acc_buf = np.empty(max_rows * head_dim, dtype=dtype)
        # (on 64-byte lines: an AMX tile row that crosses two loads or stores several
        # times slower)
        pv_buf = aligned_empty(padded_rows * head_dim, outputs[1])
        s_buf = aligned_empty(padded_rows * block_k, outputs[1])
        row_state = np.empty((3, max_rows), dtype=dtype)
        k_tile = np.empty(block_k * head_dim, dtype=dtype)
        v_tile = np.empty(block_k * head_dim, dtype=dtype)
        visible = np.empty(block_k, dtype=np.bool_)
        key_rows = np.empty((2, block_k), dtype=np.int64)  # page and slot of each key
        # AMX: the stacked query rows' bits, packed K and V, the weights' two parts
        bits = np.empty(0, dtype=np.uint16)
        q_bits = aligned_empty(amx_rows * head_dim, bits)
        k_pack = aligned_empty(amx_keys * head_dim, bits)
        v_pack = aligned_empty(amx_keys * head_dim, bits)
        w_hi = aligned_empty(amx_rows * amx_keys, bits)
        w_lo = aligned_empty(amx_rows * amx_keys, bits)
        scratch = (q_buf, acc_buf, pv_buf, s_buf, row_state, k_tile, v_tile, visible, key_rows,
                   q_bits, k_pack, v_pack, w_hi, w_lo)
        if use_amx:
            tile_config(config.ctypes.data)
        for item in range(starts[thread], starts[thread + 1]):
            _run_item(queries, item_seq[item], item_head[item], item_row0[item],
                      item_width[item], kv, (mask[0], mask[1], mask[2], functions), softmax,
                      tiling, outputs, scratch)
        if use_amx:
            tile_release()


@body
def _run_item(queries, b, kv_head, row0, width, kv, mask, softmax, tiling, outputs, scratch):
    """Compute one work item: ``width`` query rows from ``row0`` of sequence ``b``, one KV head
    (the arguments as :func:`_flash_kernel` takes them)."""
    q, q_offsets, q_start_pos, q_format = queries[0], queries[1], queries[2], queries[3]
    k_blocks, v_blocks, page_size, lookup_table, row_base, num_keys, k_scales, v_scales, \
        kv_format = kv
    has_scales = k_scales.shape[0] > 0
    program, additive, has_additive, functions = mask
    scale, sinks, has_sink = softmax
    group, block_k, sub_q, use_amx = tiling[0], tiling[2], tiling[3], tiling[4]
    out, lse, want_lse = outputs
    q_buf, acc_buf, row_state = scratch[0], scratch[1], scratch[4]
    k_tile, v_tile, key_rows = scratch[5], scratch[6], scratch[8]
    head_dim = q.shape[3]
    zero = scale - scale  # 0 of the compute dtype
    n_bm = additive.shape[0]
    q_base = q_offsets[b] + row0
    pos0 = q_start_pos[b] + row0
    n_keys = num_keys[b]
    bm = b if n_bm > 1 else 0
    rows = group * width
    h0 = kv_head * group
    q_widened = False  # the stacked query tile below, made at the first tile that needs it
    if use_amx:  # the rows as stored, then zeros to a multiple of 16 rows
        q_bits = scratch[9]
        for r in range(width):
            for hl in range(group):
                base = (r * group + hl) * head_dim
                row = q[q_base + r, 0, h0 + hl]
                for d in range(head_dim):
                    q_bits[base + d] = np.uint16(row[d])  # (bfloat16 bits: as stored)
        for i in range(rows * head_dim, (rows + 15) // 16 * 16 * head_dim):
            q_bits[i] = 0
    for i in range(rows * head_dim):
        acc_buf[i] = 0
    m_run = row_state[0]
    l_run = row_state[1]
    for i in range(rows):
        m_run[i] = -np.inf
        l_run[i] = 0
    # The calls to _tile_step pass variables where they would pass constants: Numba types
    # 0, -1, True and False as literal types of their own, and compiles a callee once per
    # signature (four signatures cost 8.6 s of compiling, one 4.4 s).
    first = width - width  # 0, as an int64
    elementwise = first == first  # True, as a bool
    for k0 in range(0, n_keys, block_k):
        kw = min(block_k, n_keys - k0)
        status = mask_tile_status(program, functions, b, pos0, pos0 + width - 1, k0, k0 + kw - 1)
        if status == TILE_FULL:
            continue
        # Gather the tile's keys and values through the page table (each key's page and
        # slot found once), asking for the rows GATHER_PREFETCH_KEYS keys ahead.
        whole = status == TILE_NONE and not has_additive
        pages = key_rows[0]
        slots = key_rows[1]
        for j in range(kw):
            pages[j], slots[j] = kv_page_slot(lookup_table, page_size, row_base, b, k0 + j)
        if use_amx and kw % 32 == 0 and _tile_on_amx(
                k_blocks, v_blocks, pages, slots, kw, whole, scratch, width, pos0, k0, group,
                mask, b, bm, kv_head, row0, scale, sub_q):
            continue
        if not q_widened:
            # Stacked, pre-scaled query tile, position-major: row r * group + hl holds
            # position pos0 + r of head h0 + hl (so a run of positions is a run of rows).
            for r in range(width):
                for hl in range(group):
                    base = (r * group + hl) * head_dim
                    widen_row(q, q_base + r, 0, h0 + hl, q_buf, base, q_format)
                    for d in range(base, base + head_dim):
                        q_buf[d] *= scale
            q_widened = True
        for j in range(min(GATHER_PREFETCH_KEYS, kw)):
            prefetch_head(k_blocks, pages[j], slots[j], kv_head)
            prefetch_head(v_blocks, pages[j], slots[j], kv_head)
        v_finite = elementwise  # True as a bool (a literal True: a second _tile_step)
        for j in range(kw):
            ahead = j + GATHER_PREFETCH_KEYS
            if ahead < kw:
                prefetch_head(k_blocks, pages[ahead], slots[ahead], kv_head)
                prefetch_head(v_blocks, pages[ahead], slots[ahead], kv_head)
            page = pages[j]
            slot = slots[j]
            # the rows in the compute dtype, whatever their stored format
            widen_row(k_blocks, page, slot, kv_head, k_tile, j * head_dim, kv_format)
            widen_row(v_blocks, page, slot, kv_head, v_tile, j * head_dim, kv_format)
            if has_scales:
                k_scale = k_scales[page, slot, kv_head]
                v_scale = v_scales[page, slot, kv_head]
                for d in range(j * head_dim, (j + 1) * head_dim):
                    k_tile[d] *= k_scale
                    v_tile[d] *= v_scale
            for d in range(j * head_dim, (j + 1) * head_dim):
                x = v_tile[d]
                v_finite &= x - x == zero  # NaN for NaN and inf
        if whole:
            _tile_step(scratch, head_dim, v_finite, first, width, first, kw, not elementwise,
                       pos0, k0, group, mask, b, bm, kv_head, row0)
            continue
        # Partially masked: blocks of sub_q positions, each trimmed to the keys it sees;
        # consecutive unmasked blocks run as one taller step.
        run0 = first - 1
        for r0 in range(0, width + sub_q, sub_q):
            r1 = min(r0 + sub_q, width)
            sub = TILE_FULL
            if r0 < width:
                sub = mask_tile_status(program, functions, b, pos0 + r0, pos0 + r1 - 1, k0,
                                       k0 + kw - 1)
                if sub == TILE_NONE and not has_additive:
                    run0 = r0 if run0 < 0 else run0
                    continue
            if run0 >= 0:  # flush the unmasked run [run0, r0)
                _tile_step(scratch, head_dim, v_finite, run0, min(r0, width), first, kw,
                           not elementwise, pos0, k0, group, mask, b, bm, kv_head, row0)
                run0 = first - 1
            if sub == TILE_FULL:
                continue
            ka, kb = _key_extent(program, functions, b, pos0 + r0, pos0 + r1 - 1, k0, kw)
            _tile_step(scratch, head_dim, v_finite, r0, r1, ka, kb, elementwise, pos0, k0,
                       group, mask, b, bm, kv_head, row0)
    row = scratch[2]  # (the P V product's scratch, free now)
    for r in range(width):
        for hl in range(group):
            h = h0 + hl
            i = r * group + hl
            sink = sinks[h] if has_sink else sinks[0]
            out_scale, row_lse = finish_row(m_run[i], l_run[i], sink, has_sink)
            for d in range(head_dim):
                row[d] = acc_buf[i * head_dim + d] * out_scale
            round_span(row, out[q_base + r, h], 0, head_dim)  # (or copied: of the same dtype)
            if want_lse:
                lse[q_base + r, h] = row_lse
