"""Attention masks: frozen dataclasses for users, a flat program for the kernels.

A mask decides which ``(q_idx, k_idx)`` pairs of absolute positions are visible.  Users
build masks from the dataclasses below and combine them with ``&`` and ``|``.  At the
host boundary :func:`compile_mask` turns a mask into

* a *mask program*: an ``int64`` array ``[n_ops, 2]`` of ``(opcode, parameter)`` rows in
  postfix order, which every kernel evaluates with the two plain bodies
  :func:`mask_visible` (one pair) and :func:`mask_tile_status` (a query range x key range),
  compiled for the CPU with ``njit`` and for CUDA as device functions; and
* the additive tensor of a :class:`MaterializedMask`, if the mask has one.

Because the program is data, one compiled kernel serves every mask.

Tile status is one of :data:`TILE_NONE` (no pair of the tile is hidden: no per-element test
is needed), :data:`TILE_FULL` (every pair is hidden: the tile is skipped and its keys are
never loaded) and :data:`TILE_PARTIAL`.  It is exact in the sense the kernels rely on: never
FULL when a pair is visible, never NONE when a pair is hidden.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from .validate import INT64_MAX, dtype_of, shape_of

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

# Opcodes of the mask program (leaves, then the two combinators).
OP_NULL = 0
OP_CAUSAL = 1
OP_SLIDING_WINDOW_CAUSAL = 2
OP_CHUNKED = 3
OP_CHUNKED_CAUSAL = 4
OP_AND = 5
OP_OR = 6


# Tile status.
TILE_NONE = 0  # nothing hidden
TILE_PARTIAL = 1  # some pairs hidden, some visible
TILE_FULL = 2  # every pair hidden


class Mask:
    """Base class of every mask; supports ``a & b`` (both visible) and ``a | b`` (either).

    Examples
    --------
    >>> from numattn import CausalMask, Mask, SlidingWindowCausalMask
    >>> mask = CausalMask() & SlidingWindowCausalMask(3)
    >>> isinstance(mask, Mask), mask.visible(4, [1, 2, 4]).tolist()
    (True, [False, True, True])
    """

    def __and__(self, other):
        _check_mask_operand(other, "&")
        return AndMask(self, other)

    def __or__(self, other):
        _check_mask_operand(other, "|")
        return OrMask(self, other)

    def visible(self, q_idx, k_idx):  # pragma: no cover - overridden
        """Boolean visibility of positions ``q_idx`` and ``k_idx`` (NumPy broadcasting)."""
        raise NotImplementedError

    def _program(self):  # pragma: no cover - overridden
        raise NotImplementedError


def _check_mask_operand(other, op):
    if not isinstance(other, Mask):
        raise TypeError(f"cannot combine a mask with {type(other).__name__} using {op!r}")


def _program_size(value):
    """A window or chunk as the int64 the kernels read.  Sizes past the int64 range act
    like the largest int64: no position reaches them."""
    return min(int(value), INT64_MAX)


def _check_positive(cls, name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{cls}.{name} must be an integer, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{cls}.{name} must be >= 1, got {value}")


@dataclass(frozen=True)
class NullMask(Mask):
    """Every key is visible.

    Examples
    --------
    >>> from numattn import NullMask
    >>> bool(NullMask().visible(0, 5))
    True
    """

    def visible(self, q_idx, k_idx):
        return np.ones(np.broadcast_shapes(np.shape(q_idx), np.shape(k_idx)), dtype=bool)

    def _program(self):
        return [(OP_NULL, 0)]


@dataclass(frozen=True)
class CausalMask(Mask):
    """Key ``k_idx`` is visible from query ``q_idx`` iff ``k_idx <= q_idx``.

    Queries sit at the last positions of their sequence, so this is the bottom-right
    aligned causal mask of a KV cache.

    Examples
    --------
    >>> from numattn import CausalMask
    >>> CausalMask().visible(2, [1, 2, 3]).tolist()
    [True, True, False]
    """

    def visible(self, q_idx, k_idx):
        return np.asarray(k_idx) <= np.asarray(q_idx)

    def _program(self):
        return [(OP_CAUSAL, 0)]


@dataclass(frozen=True)
class SlidingWindowCausalMask(Mask):
    """Causal, and only the last ``window`` keys: ``k <= q`` and ``q - k < window``.

    Parameters
    ----------
    window : int
        Number of visible keys ending at the query itself (>= 1).

    Examples
    --------
    >>> from numattn import SlidingWindowCausalMask
    >>> SlidingWindowCausalMask(2).visible(5, [3, 4, 5, 6]).tolist()
    [False, True, True, False]
    """

    window: int

    def __post_init__(self):
        _check_positive("SlidingWindowCausalMask", "window", self.window)

    def visible(self, q_idx, k_idx):
        q = np.asarray(q_idx)
        k = np.asarray(k_idx)
        return (k <= q) & (q - k < _program_size(self.window))

    def _program(self):
        return [(OP_SLIDING_WINDOW_CAUSAL, _program_size(self.window))]


@dataclass(frozen=True)
class ChunkedMask(Mask):
    """Keys in the same ``chunk``-aligned chunk as the query: ``q // chunk == k // chunk``.

    Parameters
    ----------
    chunk : int
        Chunk length (>= 1); chunks start at positions that are multiples of it.

    Examples
    --------
    >>> from numattn import ChunkedMask
    >>> ChunkedMask(4).visible(5, [3, 4, 7, 8]).tolist()
    [False, True, True, False]
    """

    chunk: int

    def __post_init__(self):
        _check_positive("ChunkedMask", "chunk", self.chunk)

    def visible(self, q_idx, k_idx):
        chunk = _program_size(self.chunk)
        return np.asarray(q_idx) // chunk == np.asarray(k_idx) // chunk

    def _program(self):
        return [(OP_CHUNKED, _program_size(self.chunk))]


@dataclass(frozen=True)
class ChunkedCausalMask(Mask):
    """Causal within the query's chunk: ``k <= q`` and ``q // chunk == k // chunk``.

    Parameters
    ----------
    chunk : int
        Chunk length (>= 1).

    Examples
    --------
    >>> from numattn import ChunkedCausalMask
    >>> ChunkedCausalMask(4).visible(5, [3, 4, 5, 6]).tolist()
    [False, True, True, False]
    """

    chunk: int

    def __post_init__(self):
        _check_positive("ChunkedCausalMask", "chunk", self.chunk)

    def visible(self, q_idx, k_idx):
        q = np.asarray(q_idx)
        k = np.asarray(k_idx)
        chunk = _program_size(self.chunk)
        return (k <= q) & (q // chunk == k // chunk)

    def _program(self):
        return [(OP_CHUNKED_CAUSAL, _program_size(self.chunk))]


@dataclass(frozen=True, eq=False)
class MaterializedMask(Mask):
    """An additive mask tensor: scores become ``s + tensor[b, (h,) r, k_idx]``.

    ``r`` is the query's row inside its sequence and ``k_idx`` the absolute key position;
    ``-inf`` entries hide a key exactly.  The tensor is ``[S, N]`` (shared by the batch),
    ``[B, S, N]`` or ``[B, H, S, N]``; its dtype must match the queries'.  A materialized
    mask may be combined with ``&`` (the pairs that the other masks hide stay hidden) but
    not with ``|``.

    Parameters
    ----------
    tensor : ndarray
        The additive tensor, ``[S, N]``, ``[B, S, N]`` or ``[B, H, S, N]``.

    Examples
    --------
    >>> import numpy as np
    >>> from numattn import CausalMask, MaterializedMask
    >>> bias = np.zeros((4, 4), dtype=np.float32)
    >>> mask = MaterializedMask(bias) & CausalMask()
    """

    tensor: np.ndarray

    def __post_init__(self):
        t = self.tensor
        if not hasattr(t, "shape") or not hasattr(t, "dtype"):
            raise TypeError(
                f"MaterializedMask.tensor must be an array, got {type(t).__name__}"
            )
        if len(t.shape) not in (2, 3, 4):
            raise ValueError(
                "MaterializedMask.tensor must be [S, N], [B, S, N] or [B, H, S, N], "
                f"got shape {tuple(t.shape)}"
            )

    def visible(self, q_idx, k_idx):
        return np.ones(np.broadcast_shapes(np.shape(q_idx), np.shape(k_idx)), dtype=bool)

    def _program(self):
        return [(OP_NULL, 0)]


@dataclass(frozen=True, eq=False)
class AndMask(Mask):
    """Visible iff visible under both ``left`` and ``right`` (``left & right``).

    Parameters
    ----------
    left, right : Mask
        The combined masks.

    Examples
    --------
    >>> from numattn import CausalMask, ChunkedMask
    >>> (CausalMask() & ChunkedMask(4)).visible(5, [2, 4, 5, 6]).tolist()
    [False, True, True, False]
    """

    left: Mask
    right: Mask

    def visible(self, q_idx, k_idx):
        return self.left.visible(q_idx, k_idx) & self.right.visible(q_idx, k_idx)

    def _program(self):
        return _binary_program(self.left, self.right, OP_AND)


@dataclass(frozen=True, eq=False)
class OrMask(Mask):
    """Visible iff visible under ``left`` or ``right`` (``left | right``).

    Parameters
    ----------
    left, right : Mask
        The combined masks.

    Examples
    --------
    >>> from numattn import ChunkedCausalMask, SlidingWindowCausalMask
    >>> mask = ChunkedCausalMask(4) | SlidingWindowCausalMask(3)
    >>> mask.visible(5, [2, 3, 4, 5, 6]).tolist()
    [False, True, True, True, False]
    """

    left: Mask
    right: Mask

    def visible(self, q_idx, k_idx):
        return self.left.visible(q_idx, k_idx) | self.right.visible(q_idx, k_idx)

    def _program(self):
        return _binary_program(self.left, self.right, OP_OR)


def _materialized_leaves(mask, under_or=False):
    if isinstance(mask, MaterializedMask):
        if under_or:
            raise ValueError("a MaterializedMask cannot be combined with '|'; use '&'")
        return [mask]
    if isinstance(mask, AndMask):
        return _materialized_leaves(mask.left, under_or) + _materialized_leaves(
            mask.right, under_or
        )
    if isinstance(mask, OrMask):
        return _materialized_leaves(mask.left, True) + _materialized_leaves(mask.right, True)
    return []


def _program_depth(program):
    """The most operands a postfix program keeps on the evaluation stack at once."""
    depth = best = 0
    for op, _ in program:
        depth = depth - 1 if op in (OP_AND, OP_OR) else depth + 1
        best = max(best, depth)
    return best


def _binary_program(left, right, op):
    """Postfix program of ``left op right``, the operand that needs the deeper stack first.

    ``&`` and ``|`` commute, so this order is free, and it keeps the evaluation stacks
    (the bits of one int64 in :func:`mask_visible` and :func:`mask_tile_status`) at most
    ``log2(leaves) + 1`` deep however the expression is nested; a right-nested chain would
    otherwise keep one operand per level and overflow past 60 levels.
    """
    first, second = left._program(), right._program()
    if _program_depth(second) > _program_depth(first):
        first, second = second, first
    return first + second + [(op, 0)]


def as_mask(mask, name="mask"):
    """Accept a :class:`Mask`, ``None`` (no mask) or an ndarray (a materialized mask)."""
    if mask is None:
        return NullMask()
    if isinstance(mask, Mask):
        return mask
    if isinstance(mask, np.ndarray):
        return MaterializedMask(mask)
    raise TypeError(
        f"{name} must be a numattn mask (NullMask, CausalMask, ...) or an additive ndarray, "
        f"got {type(mask).__name__}"
    )


def compile_mask(mask, name="mask"):
    """Split a mask into ``(program, additive)`` for the kernels.

    Returns
    -------
    program : ndarray of int64, shape [n_ops, 2]
        The postfix mask program evaluated by :func:`mask_visible` and
        :func:`mask_tile_status` (a materialized mask contributes an always-visible leaf).
        Built once per mask object and shared by later calls: read it, do not change it.
    additive : ndarray or None
        The tensor of the mask's :class:`MaterializedMask`, if it has one.

    Examples
    --------
    >>> from numattn.masks import CausalMask, SlidingWindowCausalMask, compile_mask
    >>> program, additive = compile_mask(CausalMask() & SlidingWindowCausalMask(8))
    >>> program.tolist(), additive
    ([[1, 0], [2, 8], [5, 0]], None)
    """
    mask = as_mask(mask, name)
    # Masks are immutable: the program is built once per mask object and kept on it (shared
    # by every call: the kernels only read it), which saves building it at every call; a
    # leaf mask made afresh for each call (``CausalMask()``) finds the program of an equal
    # one.
    compiled = mask.__dict__.get("_compiled")
    if compiled is None:
        if type(mask) in _VALUE_MASKS:
            compiled = (_leaf_program(mask), None)
        else:
            leaves = _materialized_leaves(mask)
            if len(leaves) > 1:
                raise ValueError(
                    f"{name} may hold at most one MaterializedMask, found {len(leaves)}"
                )
            compiled = (_program_array(mask), leaves[0] if leaves else None)
        object.__setattr__(mask, "_compiled", compiled)
    program, leaf = compiled
    return program, (None if leaf is None else leaf.tensor)


#: Masks compared by value (frozen dataclasses of integers): equal ones of exactly these
#: types share a program.
_VALUE_MASKS = (NullMask, CausalMask, SlidingWindowCausalMask, ChunkedMask, ChunkedCausalMask)


def _program_array(mask):
    return np.asarray(mask._program(), dtype=np.int64).reshape(-1, 2)


@functools.lru_cache(maxsize=256)
def _leaf_program(mask):
    """The program of a leaf mask, shared by every mask equal to it."""
    return _program_array(mask)


def additive_4d(tensor, *, batch, num_heads, max_q_len, max_keys, dtype, name="mask",
                exact_rows=False):
    """Validate an additive mask tensor and view it as ``[Bm, Hm, Sm, Nm]`` for the kernels.

    ``[S, N]`` becomes ``[1, 1, S, N]`` and ``[B, S, N]`` becomes ``[B, 1, S, N]``; kernels
    read ``t[b if Bm > 1 else 0, h if Hm > 1 else 0, r, k_idx]``.  ``None`` gives a
    ``[1, 1, 1, 1]`` placeholder (and the caller passes ``has_additive=False``).  The tensor
    must cover every local query row (``max_q_len``) and key position (``max_keys``);
    with ``exact_rows`` (padded queries, decode) it must have exactly ``max_q_len``
    rows, so that a tensor laid out otherwise (one row per sequence or per token) is not
    read as rows it is not.
    """
    if tensor is None:
        return np.zeros((1, 1, 1, 1), dtype=dtype)
    shape = shape_of(tensor)
    if dtype_of(tensor) != np.dtype(dtype):
        raise TypeError(
            f"{name}: the additive mask tensor must have the queries' dtype {np.dtype(dtype)}, "
            f"got {dtype_of(tensor)}"
        )
    if len(shape) == 2:
        tensor = tensor.reshape((1, 1, *shape))
    elif len(shape) == 3:
        if shape[0] != batch:
            raise ValueError(
                f"{name}: a [B, S, N] additive mask must have B = {batch}, got shape {list(shape)}"
            )
        tensor = tensor.reshape((shape[0], 1, shape[1], shape[2]))
    elif len(shape) == 4:
        if shape[0] != batch or shape[1] != num_heads:
            raise ValueError(
                f"{name}: a [B, H, S, N] additive mask must have B = {batch} and H = "
                f"{num_heads}, got shape {list(shape)}"
            )
    else:
        raise ValueError(
            f"{name}: an additive mask must be [S, N], [B, S, N] or [B, H, S, N], got shape "
            f"{list(shape)}"
        )
    s_dim, n_dim = shape_of(tensor)[2:]
    if exact_rows and s_dim != max_q_len:
        hint = " (one row per sequence is [B, 1, N])" if max_q_len == 1 else ""
        raise ValueError(
            f"{name}: the additive mask must have S = {max_q_len} query rows, got shape "
            f"{list(shape)}{hint}"
        )
    if s_dim < max_q_len or n_dim < max_keys:
        raise ValueError(
            f"{name}: the additive mask must cover S >= {max_q_len} query rows and N >= "
            f"{max_keys} keys, got shape {list(shape)}"
        )
    if isinstance(tensor, np.ndarray):
        tensor = np.ascontiguousarray(tensor)
    return tensor
