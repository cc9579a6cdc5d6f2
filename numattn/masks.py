"""Attention masks: frozen dataclasses that say which ``(q_idx, k_idx)`` pairs are visible.

Build them from the classes below and combine them with ``&`` and ``|``; every backend
evaluates them the same way (see :mod:`numattn.core.masks` for how a mask becomes the
program the kernels read).
"""

from .core.masks import (
    AndMask,
    CausalMask,
    ChunkedCausalMask,
    ChunkedMask,
    Mask,
    MaterializedMask,
    NullMask,
    OrMask,
    SlidingWindowCausalMask,
    compile_mask,
)

__all__ = [
    "AndMask",
    "CausalMask",
    "ChunkedCausalMask",
    "ChunkedMask",
    "Mask",
    "MaterializedMask",
    "NullMask",
    "OrMask",
    "SlidingWindowCausalMask",
    "compile_mask",
]
