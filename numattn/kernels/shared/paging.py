"""Where a token's K/V row lives: the one addressing body every kernel reads caches with."""

from __future__ import annotations

from ...core.jit import body


@body
def kv_page_slot(lookup_table, page_size, row_base, b, t):
    """(page, slot) of token ``t`` of sequence ``b`` (kernel body for CPU and CUDA)."""
    p = row_base[b] + t
    return lookup_table[b, p // page_size], p % page_size
