"""Split-K partitions of a sequence's keys, for the CPU and CUDA drivers alike."""

from __future__ import annotations

from ...core.jit import body

#: Automatic split-K: aim for this many work items per CPU thread / blocks per SM, and keep
#: partitions at least this many tiles long.
ITEMS_PER_WORKER = 4
MIN_TILES_PER_PARTITION = 4
MAX_AUTO_PARTITIONS = 64


def partition_count(requested, max_keys, batch, block_k, workers,
                     min_tiles=MIN_TILES_PER_PARTITION):
    """Partitions to launch: the requested count, or one from the work size and workers
    (partitions of at least ``min_tiles`` tiles).

    More partitions than the longest sequence has tiles would all be empty, so the count is
    capped there; that changes no partition's keys, so results stay bitwise the same.
    """
    tiles = max(1, -(-max_keys // block_k))
    if requested is None:
        wanted = -(-ITEMS_PER_WORKER * workers // max(batch, 1))
        requested = max(1, min(wanted, tiles // min_tiles, MAX_AUTO_PARTITIONS))
    return min(requested, tiles)


@body
def partition_bounds(num_keys, part, num_partitions, block_k):
    """Keys ``[start, end)`` of partition ``part``: ``num_partitions`` equal spans, each a
    multiple of ``block_k`` (at least one tile); trailing partitions may be empty."""
    span = (num_keys + num_partitions - 1) // num_partitions
    span = max(block_k, (span + block_k - 1) // block_k * block_k)
    start = min(part * span, num_keys)
    return start, min(start + span, num_keys)
