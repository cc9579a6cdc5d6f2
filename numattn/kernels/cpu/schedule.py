"""Dealing costed work items to the CPU threads.

Numba's ``prange`` splits its range into equal *counts* of iterations per thread (the
OpenMP layer ignores ``numba.set_parallel_chunksize``), so items of unequal cost in a
plain ``prange`` leave threads idle: a batch of sequences of different lengths gives the
threads that hold the long ones most of the work.  The kernels instead run ``prange`` over
the threads, thread ``t`` taking the items ``order[starts[t]:starts[t + 1]]`` that
:func:`zigzag_schedule` dealt it.  Which thread computes an item never changes how it is
computed, so results do not depend on the schedule or the number of threads.
"""

from __future__ import annotations

import numpy as np

from ...core.jit import body


@body
def zigzag_schedule(cost, num_threads):
    """Deal items to threads, most expensive first, in a zigzag (0, 1, .., T-1, T-1, .., 0,
    0, ..), which balances their costs (plain CPU body).

    Parameters
    ----------
    cost : int64 array [N]
        Cost of each item.
    num_threads : int
        Threads T (>= 1).

    Returns
    -------
    order : int64 array [N]
        Item indices, thread by thread; each thread's items in decreasing cost (ties in
        index order).
    starts : int64 array [T + 1]
        Thread ``t`` runs ``order[starts[t]:starts[t + 1]]``.
    """
    num_items = cost.shape[0]
    by_cost = by_decreasing_cost(cost)
    thread = np.empty(num_items, dtype=np.int64)
    starts = np.zeros(num_threads + 1, dtype=np.int64)
    for r in range(num_items):
        lane = r % num_threads
        thread[r] = lane if (r // num_threads) % 2 == 0 else num_threads - 1 - lane
        starts[thread[r] + 1] += 1
    for t in range(num_threads):
        starts[t + 1] += starts[t]
    fill = starts[:-1].copy()
    order = np.empty(num_items, dtype=np.int64)
    for r in range(num_items):
        order[fill[thread[r]]] = by_cost[r]
        fill[thread[r]] += 1
    return order, starts


@body
def by_decreasing_cost(cost):
    """Item indices by decreasing ``cost``, ties in index order: ``np.argsort(-cost,
    kind="mergesort")`` as a bottom-up merge sort of its own, which compiles in half the
    time of Numba's ("Compiling and importing" in docs/performance.rst)."""
    n = cost.shape[0]
    order = np.arange(n)
    spare = np.empty(n, dtype=order.dtype)
    width = 1
    while width < n:
        for lo in range(0, n, 2 * width):
            mid = min(lo + width, n)
            hi = min(lo + 2 * width, n)
            i, j = lo, mid
            for o in range(lo, hi):
                # the right run's item first only if it costs more: stable
                if j < hi and (i >= mid or cost[order[j]] > cost[order[i]]):
                    spare[o] = order[j]
                    j += 1
                else:
                    spare[o] = order[i]
                    i += 1
        order, spare = spare, order
        width *= 2
    return order
