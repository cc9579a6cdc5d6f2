"""Attention masks: frozen dataclasses that say which ``(q_idx, k_idx)`` pairs are visible.

Build them from the classes below and combine them with ``&`` and ``|``; every backend
evaluates them the same way (see :mod:`numattn.core.masks` for how a mask becomes the
program the kernels read).  A new kind of mask is one :class:`LeafMask` subclass,
registered with :func:`register_leaf` (the documentation's page "Adding a mask").
"""

from .core.masks import (
    INT64_MAX,
    INT64_MIN,
    AndMask,
    CausalMask,
    ChunkedCausalMask,
    ChunkedMask,
    FunctionMask,
    LeafMask,
    Mask,
    MaterializedMask,
    NullMask,
    OrMask,
    SlidingWindowCausalMask,
    compile_mask,
    register_leaf,
)

__all__ = [
    "INT64_MAX",
    "INT64_MIN",
    "AndMask",
    "CausalMask",
    "ChunkedCausalMask",
    "ChunkedMask",
    "FunctionMask",
    "LeafMask",
    "Mask",
    "MaterializedMask",
    "NullMask",
    "OrMask",
    "SlidingWindowCausalMask",
    "compile_mask",
    "register_leaf",
]
