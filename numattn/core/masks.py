"""Attention masks: frozen dataclasses for users, a flat program for the kernels.

A mask decides which ``(q_idx, k_idx)`` pairs of absolute positions are visible.  Users
build masks from the dataclasses below and combine them with ``&`` and ``|``.  At the
host boundary :func:`compile_mask` turns a mask into

* a *mask program*: an ``int64`` array ``[n_ops, 2]`` of ``(opcode, parameter)`` rows in
  postfix order, which every kernel evaluates with the plain bodies of
  :mod:`numattn.kernels.shared.masks` (``mask_visible`` for one pair, ``mask_tile_status``
  for a query range x key range, ``visible_span`` for one query's run of keys), compiled
  for the CPU with ``njit`` and for CUDA as device functions; and
* the additive tensor of a :class:`MaterializedMask`, if the mask has one.

Because the program is data, one compiled kernel serves every mask.

Each kind of leaf (:class:`NullMask`, :class:`CausalMask`, ...) is a :class:`LeafMask`
that says in its own class all the kernels need: its parameter and three bodies (one
pair, one tile, one query's run of keys).  :func:`register_leaf` gives it its opcode, and
the kernels' dispatch on opcodes is generated from the registered leaves, so a new leaf is
one class and nothing else.

Tile status is one of :data:`TILE_NONE` (no pair of the tile is hidden: no per-element test
is needed), :data:`TILE_FULL` (every pair is hidden: the tile is skipped and its keys are
never loaded) and :data:`TILE_PARTIAL`.  It is exact in the sense the kernels rely on: never
FULL when a pair is visible, never NONE when a pair is hidden.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import marshal
import sys

import numpy as np

from .device import is_device_array
from .jit import DIGEST_SOURCES, body
from .validate import INT64_MAX, dtype_of, shape_of

__all__ = [
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

# Opcodes of the two combinators and of a FunctionMask leaf (its parameter: which of the
# mask's functions); a registered leaf's opcode is its index in LEAF_TYPES (>= 0).
OP_AND = -1
OP_OR = -2
OP_FUNCTION = -3

# Tile status.
TILE_NONE = 0  # nothing hidden
TILE_PARTIAL = 1  # some pairs hidden, some visible
TILE_FULL = 2  # every pair hidden

INT64_MIN = -INT64_MAX - 1


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

    def visible(self, q_idx, k_idx, *, b=0, h=0):  # pragma: no cover - overridden
        """Boolean visibility of positions ``q_idx`` and ``k_idx`` (NumPy broadcasting) for
        query head ``h`` of sequence ``b`` (which only a :class:`FunctionMask` reads)."""
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


class LeafMask(Mask):
    """Base class of the masks that are one leaf of a mask program.

    A leaf is a frozen dataclass registered with :func:`register_leaf`, and says in its own
    class all that the kernels need: :meth:`leaf_parameter`, and three static methods,
    plain Python that Numba compiles for the CPU and for CUDA (integer arithmetic with
    ``//`` and ``%``, comparisons, ``min``, ``max``; no Python objects), each taking the
    parameter first.  :meth:`visible` is derived from ``leaf_visible``.

    Examples
    --------
    >>> from numattn.masks import LeafMask, SlidingWindowCausalMask
    >>> issubclass(SlidingWindowCausalMask, LeafMask), SlidingWindowCausalMask.opcode
    (True, 2)
    >>> SlidingWindowCausalMask.leaf_span(3, 10)  # query 10 sees keys 8, 9 and 10
    (8, 11)
    """

    #: Set by :func:`register_leaf`: the leaf's opcode in mask programs.
    opcode = None
    #: Whether :meth:`leaf_tile` is exact (answers True only where such a pair exists);
    #: the tests hold every exact leaf to it.
    leaf_tile_exact = True

    def leaf_parameter(self):
        """The integer the kernels read for this mask (0 when the leaf has none).

        Values past the int64 range are read as the largest int64.
        """
        return 0

    @staticmethod
    def leaf_visible(param, q_idx, k_idx):  # pragma: no cover - each leaf defines it
        """Whether key ``k_idx`` is visible from query ``q_idx``.

        Written with ``&`` and ``|`` on comparisons, the same body also runs on NumPy
        arrays (:meth:`visible`).
        """
        raise NotImplementedError

    @staticmethod
    def leaf_tile(param, q0, q1, k0, k1):  # pragma: no cover - each leaf defines it
        """``(some pair visible, some pair hidden)`` for queries ``q0 .. q1`` x keys
        ``k0 .. k1`` (inclusive).

        Sound: neither may be False when such a pair exists (a visible pair in a tile
        called fully hidden would be lost; a hidden pair in a tile called fully visible
        would be shown).
        """
        raise NotImplementedError

    @staticmethod
    def leaf_span(param, q_idx):  # pragma: no cover - each leaf defines it
        """The keys ``[lo, hi)`` that query ``q_idx`` sees: one run (``INT64_MIN`` and
        ``INT64_MAX`` for an open end), exactly the keys ``leaf_visible`` shows."""
        raise NotImplementedError

    def visible(self, q_idx, k_idx, *, b=0, h=0):
        """Boolean visibility of positions ``q_idx`` and ``k_idx`` (NumPy broadcasting)."""
        q = np.asarray(q_idx)
        k = np.asarray(k_idx)
        shown = np.asarray(self.leaf_visible(np.int64(self._parameter()), q, k), dtype=bool)
        shape = np.broadcast_shapes(q.shape, k.shape)
        return shown if shown.shape == shape else np.broadcast_to(shown, shape).copy()

    def _parameter(self):
        return _program_size(self.leaf_parameter())

    def _program(self):
        if type(self).opcode is None:
            raise TypeError(f"{type(self).__name__} is not registered: use register_leaf")
        return [(type(self).opcode, self._parameter())]


#: The registered leaf types; a leaf's opcode is its index here.
LEAF_TYPES = []
_LEAF_BODIES = ("leaf_visible", "leaf_tile", "leaf_span")
_LEAF_TYPES_FIXED = []  # [True] once the kernels' dispatch on opcodes is built from them


def register_leaf(cls):
    """Register a :class:`LeafMask` subclass: give it the next opcode and mark its three
    bodies for compilation (a class decorator; returns ``cls``).

    The kernels' dispatch on opcodes is built from the registered leaves when the
    process first compiles a kernel, so a leaf is registered before that.

    Parameters
    ----------
    cls : type
        A :class:`LeafMask` subclass, a frozen dataclass, that defines ``leaf_visible``,
        ``leaf_tile`` and ``leaf_span`` as static methods.

    Returns
    -------
    type
        ``cls``, with its ``opcode`` set.

    Raises
    ------
    TypeError
        If ``cls`` is not a :class:`LeafMask` subclass and frozen dataclass, or lacks one
        of the three bodies.
    ValueError
        If ``cls`` is registered already.
    RuntimeError
        If the process has compiled a kernel already.

    Examples
    --------
    >>> from numattn.core.masks import LEAF_TYPES, CausalMask
    >>> LEAF_TYPES.index(CausalMask) == CausalMask.opcode
    True
    """
    if not (isinstance(cls, type) and issubclass(cls, LeafMask)):
        raise TypeError(f"register_leaf expects a LeafMask subclass, got {cls!r}")
    if not (dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen):
        # equal masks share one program (compile_mask): they must be immutable values
        raise TypeError(f"register_leaf expects a frozen dataclass, got {cls.__name__} (put "
                        f"@register_leaf above @dataclasses.dataclass(frozen=True))")
    if cls in LEAF_TYPES:
        raise ValueError(f"{cls.__name__} is registered already (opcode {cls.opcode})")
    for name in _LEAF_BODIES:
        member = inspect.getattr_static(cls, name)
        if not isinstance(member, staticmethod) or member is LeafMask.__dict__[name]:
            raise TypeError(f"{cls.__name__}.{name} must be defined, as a static method")
    if _LEAF_TYPES_FIXED:
        raise RuntimeError(
            f"register_leaf({cls.__name__}): leaves must be registered before the process "
            f"compiles its first kernel or imports numattn.kernels (the kernels' dispatch "
            f"on opcodes is built from the leaves then, once)"
        )
    for name in _LEAF_BODIES:
        body(getattr(cls, name))
    cls.opcode = len(LEAF_TYPES)
    LEAF_TYPES.append(cls)
    return cls


def fixed_leaf_types():
    """The registered leaf types in opcode order; none may be registered after this call
    (the kernels' dispatch on opcodes is built from them, once)."""
    if not _LEAF_TYPES_FIXED:
        _LEAF_TYPES_FIXED.append(True)
    return tuple(LEAF_TYPES)


def _foreign_leaf_sources():
    """The code of the leaves registered from outside the package, as text: compiled into
    every kernel, so it belongs in the key under which kernels are cached on disk (the
    package's own sources are in it already)."""
    parts = []
    for cls in fixed_leaf_types():
        if cls.__module__.partition(".")[0] == __name__.partition(".")[0]:
            continue
        module = sys.modules.get(cls.__module__)
        try:
            parts.append(inspect.getsource(module))
        except (OSError, TypeError):  # no source file: the bodies' code objects
            parts.append(repr([marshal.dumps(getattr(cls, n).__code__) for n in _LEAF_BODIES]))
    return "\n".join(parts)


DIGEST_SOURCES.append(_foreign_leaf_sources)


@register_leaf
@dataclasses.dataclass(frozen=True)
class NullMask(LeafMask):
    """Every key is visible.

    Examples
    --------
    >>> from numattn import NullMask
    >>> bool(NullMask().visible(0, 5))
    True
    """

    @staticmethod
    def leaf_visible(param, q_idx, k_idx):
        return True

    @staticmethod
    def leaf_tile(param, q0, q1, k0, k1):
        return True, False

    @staticmethod
    def leaf_span(param, q_idx):
        return INT64_MIN, INT64_MAX


@register_leaf
@dataclasses.dataclass(frozen=True)
class CausalMask(LeafMask):
    """Key ``k_idx`` is visible from query ``q_idx`` iff ``k_idx <= q_idx``.

    Queries sit at the last positions of their sequence, so this is the bottom-right
    aligned causal mask of a KV cache.

    Examples
    --------
    >>> from numattn import CausalMask
    >>> CausalMask().visible(2, [1, 2, 3]).tolist()
    [True, True, False]
    """

    @staticmethod
    def leaf_visible(param, q_idx, k_idx):
        return k_idx <= q_idx

    @staticmethod
    def leaf_tile(param, q0, q1, k0, k1):
        return k0 <= q1, k1 > q0

    @staticmethod
    def leaf_span(param, q_idx):
        return INT64_MIN, q_idx + 1


@register_leaf
@dataclasses.dataclass(frozen=True)
class SlidingWindowCausalMask(LeafMask):
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

    def leaf_parameter(self):
        return self.window

    @staticmethod
    def leaf_visible(window, q_idx, k_idx):
        return (k_idx <= q_idx) & (q_idx - k_idx < window)

    @staticmethod
    def leaf_tile(window, q0, q1, k0, k1):
        # the differences q - k of the tile are every integer of [q0 - k1, q1 - k0]; no
        # q0 - window here: it may wrap past the int64 range
        return k0 <= q1 and q0 - k1 < window, k1 > q0 or q1 - k0 >= window

    @staticmethod
    def leaf_span(window, q_idx):
        # q_idx - window + 1, held at INT64_MIN where it would wrap
        return max(q_idx, INT64_MIN + window - 1) - (window - 1), q_idx + 1


@body
def _chunk_tile(chunk, q0, q1, k0, k1):
    """(some chunk holds queries and keys of the tile, the whole tile is in one chunk)."""
    cq0 = q0 // chunk
    cq1 = q1 // chunk
    ck0 = k0 // chunk
    ck1 = k1 // chunk
    return max(cq0, ck0) <= min(cq1, ck1), cq0 == cq1 and cq1 == ck0 and ck0 == ck1


@register_leaf
@dataclasses.dataclass(frozen=True)
class ChunkedMask(LeafMask):
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

    def leaf_parameter(self):
        return self.chunk

    @staticmethod
    def leaf_visible(chunk, q_idx, k_idx):
        return q_idx // chunk == k_idx // chunk

    @staticmethod
    def leaf_tile(chunk, q0, q1, k0, k1):
        share_chunk, one_chunk = _chunk_tile(chunk, q0, q1, k0, k1)
        return share_chunk, not one_chunk

    @staticmethod
    def leaf_span(chunk, q_idx):
        start = (q_idx // chunk) * chunk
        return start, start + chunk


@register_leaf
@dataclasses.dataclass(frozen=True)
class ChunkedCausalMask(LeafMask):
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

    def leaf_parameter(self):
        return self.chunk

    @staticmethod
    def leaf_visible(chunk, q_idx, k_idx):
        # causal, and at most q_idx % chunk keys back (where the query's chunk starts): one
        # division per pair, where '&' (which evaluates both sides) with
        # q // chunk == k // chunk would take two
        return (k_idx <= q_idx) & (q_idx - k_idx <= q_idx % chunk)

    @staticmethod
    def leaf_tile(chunk, q0, q1, k0, k1):
        # a chunk shared by queries and keys with k0 <= q1 holds a key <= a query
        share_chunk, one_chunk = _chunk_tile(chunk, q0, q1, k0, k1)
        return share_chunk and k0 <= q1, k1 > q0 or not one_chunk

    @staticmethod
    def leaf_span(chunk, q_idx):
        return (q_idx // chunk) * chunk, q_idx + 1


@dataclasses.dataclass(frozen=True, eq=False, init=False)
class FunctionMask(Mask):
    """Key ``kv_idx`` is visible from query ``q_idx`` iff ``fn(b, h, q_idx, kv_idx, *captures)``.

    ``fn`` is a plain Python function that Numba compiles into the kernels, for the CPU and
    for CUDA, from the same source: integer and float arithmetic, comparisons, ``math``,
    indexing of the captured arrays (no Python objects).  ``b`` is the sequence, ``h`` the
    query head, ``q_idx`` and ``kv_idx`` the positions of the section "Positions and masks"
    of the API.  ``captures`` (NumPy arrays and numbers; device arrays for CUDA calls) are
    handed to ``fn`` at each call: new values compile nothing, a new function (or new
    capture types) compiles the kernels once per process, and they are cached on disk.
    Indexing is not bounds-checked: the captures must cover every position ``fn`` is asked
    about (``fn`` only sees the queries and keys of the call).  Combine with ``&`` and ``|``
    like every mask.

    Whole tiles that ``fn`` hides are skipped and whole visible ones need no test per pair:
    the tile status is found by evaluating ``fn`` over every pair of the call once, shared
    by all heads when ``fn`` does not read ``h``.

    Parameters
    ----------
    fn : function
        ``fn(b, h, q_idx, kv_idx, *captures) -> bool``.
    *captures : ndarray or number
        Passed to ``fn`` after the positions.

    Examples
    --------
    >>> import numpy as np
    >>> from numattn import CausalMask, FunctionMask
    >>> def same_document(b, h, q_idx, kv_idx, doc_ids):
    ...     return doc_ids[q_idx] == doc_ids[kv_idx]
    >>> mask = CausalMask() & FunctionMask(same_document, np.array([0, 0, 1, 1, 1]))
    >>> mask.visible(3, [0, 1, 2, 3, 4]).tolist()
    [False, False, True, True, False]
    """

    fn: object
    captures: tuple

    def __init__(self, fn, *captures):
        if not callable(fn) or not hasattr(fn, "__code__"):
            raise TypeError(
                f"FunctionMask expects a plain Python function, got {type(fn).__name__}"
            )
        object.__setattr__(self, "fn", fn)
        object.__setattr__(self, "captures", tuple(captures))

    def visible(self, q_idx, k_idx, *, b=0, h=0):
        """``fn`` evaluated in Python for each pair (NumPy broadcasting)."""
        q, k = np.broadcast_arrays(np.asarray(q_idx), np.asarray(k_idx))
        shown = np.empty(q.shape, dtype=bool)
        for index in np.ndindex(q.shape):
            shown[index] = bool(self.fn(b, h, int(q[index]), int(k[index]), *self.captures))
        return shown

    def _program(self):
        return [(OP_FUNCTION, 0, self)]


@dataclasses.dataclass(frozen=True, eq=False)
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

    # In the program, an always-visible leaf; its tensor goes to the kernels beside it.
    def visible(self, q_idx, k_idx, *, b=0, h=0):
        return NullMask().visible(q_idx, k_idx)

    def _program(self):
        return NullMask()._program()


@dataclasses.dataclass(frozen=True, eq=False)
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

    def visible(self, q_idx, k_idx, *, b=0, h=0):
        return (self.left.visible(q_idx, k_idx, b=b, h=h)
                & self.right.visible(q_idx, k_idx, b=b, h=h))

    def _program(self):
        return _binary_program(self.left, self.right, OP_AND)


@dataclasses.dataclass(frozen=True, eq=False)
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

    def visible(self, q_idx, k_idx, *, b=0, h=0):
        return (self.left.visible(q_idx, k_idx, b=b, h=h)
                | self.right.visible(q_idx, k_idx, b=b, h=h))

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
    for op, *_ in program:
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
    """Accept a :class:`Mask`, ``None`` (no mask) or an array, host or device (a
    materialized mask)."""
    if mask is None:
        return NullMask()
    if isinstance(mask, Mask):
        return mask
    if isinstance(mask, np.ndarray) or is_device_array(mask):
        return MaterializedMask(mask)
    raise TypeError(
        f"{name} must be a numattn mask (NullMask, CausalMask, ...) or an additive array, "
        f"got {type(mask).__name__}"
    )


def compile_mask(mask, name="mask", *, positions=None):
    """Split a mask into ``(program, additive)`` for the kernels.

    Parameters
    ----------
    mask : Mask, ndarray or None
    name : str
        The argument's name, for error messages.
    positions : (int, int), optional
        Internal: ``(q_offset, k_offset)``, ``k_offset >= 0``, added to the kernels' query and key
        positions before each leaf reads them (the kernels see the keys of one shard of a
        sequence from 0, the mask the positions of the whole sequence).  The program then
        has two more columns: rows ``(opcode, parameter, q_offset, k_offset)``, made
        afresh at each call.

    Returns
    -------
    program : ndarray of int64, shape [n_ops, 2] (or [n_ops, 4] with ``positions``)
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
    ([[1, 0], [2, 8], [-1, 0]], None)
    """
    mask = as_mask(mask, name)
    program, leaf = _compiled(mask, name)[:2]
    if positions is not None:
        program = _shifted_program(program, positions)
    return program, (None if leaf is None else leaf.tensor)


def _compiled(mask, name="mask"):
    """``(program, materialized leaf or None, function leaves)`` of ``mask``, kept on it."""
    # Masks are immutable: the program is built once per mask object and kept on it (shared
    # by every call: the kernels only read it), which saves building it at every call; a
    # leaf mask made afresh for each call (``CausalMask()``) finds the program of an equal
    # one.
    compiled = mask.__dict__.get("_compiled")
    if compiled is None:
        if type(mask) in LEAF_TYPES:
            compiled = (_leaf_program(mask), None, ())
        else:
            leaves = _materialized_leaves(mask)
            if len(leaves) > 1:
                raise ValueError(
                    f"{name} may hold at most one MaterializedMask, found {len(leaves)}"
                )
            rows = mask._program()
            # a FunctionMask's row names itself: its parameter becomes its index among the
            # program's functions, in program order
            functions = tuple(row[2] for row in rows if row[0] == OP_FUNCTION)
            numbered = []
            for row in rows:
                if row[0] == OP_FUNCTION:
                    row = (OP_FUNCTION, functions.index(row[2]))
                numbered.append(row)
            program = np.asarray(numbered, dtype=np.int64).reshape(-1, 2)
            compiled = (program, leaves[0] if leaves else None, functions)
        object.__setattr__(mask, "_compiled", compiled)
    return compiled


def mask_functions(mask):
    """The :class:`FunctionMask` leaves of ``mask`` (a :class:`Mask`), in the order of the
    indices its program gives them."""
    return _compiled(mask)[2]


def _shifted_program(program, positions):
    """``program`` with the columns ``q_offset, k_offset`` of ``positions`` on every row."""
    if not (isinstance(positions, tuple) and len(positions) == 2):
        raise TypeError(f"positions must be a tuple (q_offset, k_offset), got {positions!r}")
    for what, value, least in zip(("q_offset", "k_offset"), positions, (-INT64_MAX, 0)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
            raise ValueError(f"positions: {what} must be an integer >= {least}, got {value!r}")
    shifted = np.empty((program.shape[0], 4), dtype=np.int64)
    shifted[:, :2] = program
    shifted[:, 2:] = positions
    return shifted


def _program_array(mask):
    return np.asarray(mask._program(), dtype=np.int64).reshape(-1, 2)


@functools.lru_cache(maxsize=256)
def _leaf_program(mask):
    """The program of a registered leaf mask (a frozen dataclass, compared by value),
    shared by every mask equal to it."""
    return _program_array(mask)


def additive_4d(tensor, *, batch, num_heads, max_q_len, max_keys, dtype, name="mask",
                exact_rows=False, q_dtype=None):
    """Validate an additive mask tensor and view it as ``[Bm, Hm, Sm, Nm]`` for the kernels.

    ``[S, N]`` becomes ``[1, 1, S, N]`` and ``[B, S, N]`` becomes ``[B, 1, S, N]``; kernels
    read ``t[b if Bm > 1 else 0, h if Hm > 1 else 0, r, k_idx]``.  ``None`` gives a
    ``[1, 1, 1, 1]`` placeholder (and the caller passes ``has_additive=False``).  The tensor
    must cover every local query row (``max_q_len``) and key position (``max_keys``);
    with ``exact_rows`` (padded queries, decode) it must have exactly ``max_q_len``
    rows, so that a tensor laid out otherwise (one row per sequence or per token) is not
    read as rows it is not.  ``dtype`` is the compute dtype; a host tensor of the queries'
    ``q_dtype`` (16-bit queries) is widened to it.
    """
    if tensor is None:
        return np.zeros((1, 1, 1, 1), dtype=dtype)
    shape = shape_of(tensor)
    q_dtype = np.dtype(dtype) if q_dtype is None else np.dtype(q_dtype)
    if dtype_of(tensor) not in (np.dtype(dtype), q_dtype):
        want = " or ".join(sorted({str(np.dtype(dtype)), str(q_dtype)}))
        raise TypeError(
            f"{name}: the additive mask tensor must have the queries' dtype {want}, "
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
        tensor = np.ascontiguousarray(tensor, dtype=dtype)
    return tensor
