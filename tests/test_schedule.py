"""Work items dealt to the CPU threads by cost (``numattn.kernels.cpu.schedule``)."""

from __future__ import annotations

import numpy as np
import pytest

from numattn.core.jit import cpu_jit
from numattn.kernels.cpu.schedule import by_decreasing_cost, zigzag_schedule


@pytest.mark.parametrize("num_items", [0, 1, 5, 64, 257])
@pytest.mark.parametrize("num_threads", [1, 2, 3, 16])
@pytest.mark.parametrize("compiled", [False, True])
def test_zigzag_schedule_deals_every_item_once_and_balances(num_items, num_threads,
                                                            compiled, rng):
    cost = rng.integers(0, 1000, num_items).astype(np.int64)
    cost[: num_items // 3] = rng.integers(0, 10, num_items // 3)  # some far cheaper items
    deal = cpu_jit(zigzag_schedule) if compiled else zigzag_schedule
    order, starts = deal(cost, num_threads)
    assert sorted(order.tolist()) == list(range(num_items))
    assert starts[0] == 0 and starts[-1] == num_items and np.all(np.diff(starts) >= 0)
    assert np.diff(starts).max() - np.diff(starts).min() <= 1  # counts differ by one at most
    loads = []
    for t in range(num_threads):
        mine = cost[order[starts[t]:starts[t + 1]]]
        assert np.all(np.diff(mine) <= 0)  # each thread's items in decreasing cost
        loads.append(int(mine.sum()))
    # a zigzag over items sorted by cost: no thread holds more than another plus one item
    assert max(loads) - min(loads) <= cost.max(initial=0)


def test_zigzag_schedule_keeps_ties_in_index_order():
    order, starts = zigzag_schedule(np.array([5, 5, 5, 5, 9], dtype=np.int64), 2)
    assert order.tolist() == [4, 2, 3, 0, 1] and starts.tolist() == [0, 3, 5]


@pytest.mark.parametrize("num_items", [0, 1, 2, 7, 64, 1000])
@pytest.mark.parametrize("compiled", [False, True])
def test_by_decreasing_cost_is_a_stable_argsort(num_items, compiled, rng):
    cost = rng.integers(0, 6, num_items).astype(np.int64)  # many ties
    cost[::7] = rng.integers(-2**40, 2**40, cost[::7].shape[0])
    order = (cpu_jit(by_decreasing_cost) if compiled else by_decreasing_cost)(cost)
    assert order.tolist() == np.argsort(-cost, kind="mergesort").tolist()
