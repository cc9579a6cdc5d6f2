"""Mask evaluation in the kernels: the bodies that read a mask program (CPU and CUDA).

A mask program (:func:`numattn.core.masks.compile_mask`) is an ``int64`` array ``[n_ops, 2]``
of ``(opcode, parameter)`` rows in postfix order, or ``[n_ops, 4]`` rows ``(opcode, parameter,
q_offset, k_offset)`` whose offsets are added to the positions each leaf reads (a shard of a
sequence's keys attended apart: :func:`_leaf_positions`).  :func:`mask_visible` evaluates it for one
pair, :func:`mask_tile_status` for a query range x key range, :func:`visible_span` as one
run of keys per query; :func:`key_bias` and :func:`add_bias` read an additive tensor.

What each leaf means comes from its class (:class:`numattn.core.masks.LeafMask`): the
dispatchers ``_leaf_visible``, ``_leaf_tile`` and ``_leaf_span`` that call the leaf bodies by
opcode are generated here from the registered leaves.
"""

from __future__ import annotations

import math

from ...core.jit import body
from ...core.masks import (
    INT64_MIN,
    OP_AND,
    OP_OR,
    TILE_FULL,
    TILE_NONE,
    TILE_PARTIAL,
    fixed_leaf_types,
)


def _dispatcher_source(count):
    """Source of the three dispatchers over leaves ``0 .. count - 1``: a branch per opcode
    that calls ``_visible_<op>``, ``_tile_<op>`` or ``_span_<op>`` (the last one unguarded)."""
    visible = ["def _leaf_visible(op, param, q_idx, k_idx):",
               '    """1 when key k_idx is visible from query q_idx, else 0."""']
    tile = ["def _leaf_tile(op, param, q0, q1, k0, k1):",
            '    """(some pair visible, some pair hidden), as 1 or 0, for queries [q0, q1] x '
            'keys [k0, k1]."""']
    span = ["def _leaf_span(op, param, q_idx):",
            '    """The run of keys [lo, hi) that query q_idx sees."""']
    for op in range(count):
        last = op == count - 1
        pad = "    " if last else "        "
        if not last:
            for lines in (visible, tile, span):
                lines.append(f"    if op == {op}:")
        visible.append(f"{pad}return 1 if _visible_{op}(param, q_idx, k_idx) else 0")
        tile.append(f"{pad}some_visible, some_hidden = _tile_{op}(param, q0, q1, k0, k1)")
        tile.append(f"{pad}return (1 if some_visible else 0), (1 if some_hidden else 0)")
        span.append(f"{pad}return _span_{op}(param, q_idx)")
    return "\n\n".join("\n".join(lines) for lines in (visible, tile, span)) + "\n"


def _build_dispatchers():
    scope = {"__name__": __name__}
    leaves = fixed_leaf_types()
    for op, leaf in enumerate(leaves):
        scope[f"_visible_{op}"] = leaf.leaf_visible
        scope[f"_tile_{op}"] = leaf.leaf_tile
        scope[f"_span_{op}"] = leaf.leaf_span
    # Numba cannot index a tuple of functions at run time: the dispatch on the opcode is
    # source generated from the registered leaves, compiled once, here (under this file's
    # name, which Numba's disk cache needs; the package's digest covers what it holds).
    # Its lines are placed past this file's end: asked for their source (as Numba's cache
    # does), inspect then says there is none, where lines of this file would be read as
    # theirs (and tokenizing from inside a docstring fails on Python 3.13).
    with open(__file__, encoding="utf-8") as source_file:
        past_end = "\n" * (sum(1 for _ in source_file) + 1)
    exec(compile(past_end + _dispatcher_source(len(leaves)), __file__, "exec"), scope)
    return tuple(body(scope[name]) for name in ("_leaf_visible", "_leaf_tile", "_leaf_span"))


_leaf_visible, _leaf_tile, _leaf_span = _build_dispatchers()


@body
def _leaf_positions(program, i, q_idx, k_idx):
    """The positions row ``i`` of ``program`` reads: shifted by its offsets, if it has them."""
    if program.shape[1] < 4:
        return q_idx, k_idx
    return q_idx + program[i, 2], k_idx + program[i, 3]


@body
def mask_visible(program, q_idx, k_idx):
    """True when key ``k_idx`` is visible from query ``q_idx`` under ``program``."""
    stack = 0
    for i in range(program.shape[0]):
        op = program[i, 0]
        if op < 0:  # OP_AND or OP_OR
            a = stack & 1
            b = (stack >> 1) & 1
            stack = stack >> 2
            c = (a & b) if op == OP_AND else (a | b)
            stack = (stack << 1) | c
        else:
            qi, ki = _leaf_positions(program, i, q_idx, k_idx)
            stack = (stack << 1) | _leaf_visible(op, program[i, 1], qi, ki)
    return (stack & 1) == 1


@body
def add_bias(score, bias):
    """``score + bias`` (an additive mask's entry), or ``-inf`` when ``bias`` is ``-inf``.

    A ``-inf`` entry hides the key whatever its score: a NaN or inf score (from NaN or inf
    in a hidden cache slot) would make ``score + bias`` NaN.
    """
    if bias == -math.inf:
        return bias
    return score + bias


@body
def mask_tile_status(program, q0, q1, k0, k1):
    """TILE_NONE, TILE_PARTIAL or TILE_FULL for queries [q0, q1] x keys [k0, k1] (inclusive).

    Two bit stacks track, for each sub-expression, whether some pair of the tile can be
    visible and whether some pair can be hidden; both are sound over-approximations.
    """
    vis = 0
    hid = 0
    for i in range(program.shape[0]):
        op = program[i, 0]
        if op < 0:  # OP_AND or OP_OR
            va = vis & 1
            vb = (vis >> 1) & 1
            ha = hid & 1
            hb = (hid >> 1) & 1
            vis = vis >> 2
            hid = hid >> 2
            if op == OP_AND:
                vis = (vis << 1) | (va & vb)
                hid = (hid << 1) | (ha | hb)
            else:
                vis = (vis << 1) | (va | vb)
                hid = (hid << 1) | (ha & hb)
        else:
            qa, ka = _leaf_positions(program, i, q0, k0)
            qb, kb = _leaf_positions(program, i, q1, k1)
            v, h = _leaf_tile(op, program[i, 1], qa, qb, ka, kb)
            vis = (vis << 1) | v
            hid = (hid << 1) | h
    if (vis & 1) == 0:
        return TILE_FULL
    if (hid & 1) == 0:
        return TILE_NONE
    return TILE_PARTIAL


@body
def key_bias(additive, b, h, row, t):
    """Additive-mask term of key ``t`` for head ``h`` of local query row ``row`` of
    sequence ``b`` (``-inf`` hides it).

    ``additive`` is the ``[Bm, Hm, S, N]`` view of :func:`numattn.core.masks.additive_4d`.
    """
    bm = b if additive.shape[0] > 1 else 0
    hm = h if additive.shape[1] > 1 else 0
    return additive[bm, hm, row, t]


@body
def key_hidden(program, status, q_idx, has_additive, additive, b, h, t):
    """True when the mask (tile ``status``) or the additive tensor hides key ``t`` from head
    ``h`` of sequence ``b``."""
    if status != TILE_NONE and not mask_visible(program, q_idx, t):
        return True
    return has_additive and key_bias(additive, b, h, 0, t) == -math.inf


@body
def visible_span(program, q_idx, k0, kw):
    """Keys ``[jlo, jhi)`` of ``k0 .. k0 + kw - 1`` that ``q_idx`` sees, as one run.

    Every leaf mask shows a query one run of keys, and ``&`` intersects runs, so a program
    without ``|`` gives ``(jlo, jhi, True)``, exactly what :func:`mask_visible` says key by
    key; with a ``|`` it gives ``(0, 0, False)`` and the caller tests each key.
    """
    lo = k0
    hi = k0 + kw
    for i in range(program.shape[0]):
        op = program[i, 0]
        if op == OP_OR:
            return 0, 0, False
        if op >= 0:  # a leaf (OP_AND only pairs runs already intersected)
            qi, shift = _leaf_positions(program, i, q_idx, 0)
            leaf_lo, leaf_hi = _leaf_span(op, program[i, 1], qi)
            # back to unshifted keys (shift >= 0), held at INT64_MIN where it would wrap
            lo = max(lo, max(leaf_lo, INT64_MIN + shift) - shift)
            hi = min(hi, max(leaf_hi, INT64_MIN + shift) - shift)
    lo = min(max(lo - k0, 0), kw)
    hi = max(min(hi - k0, kw), lo)
    return lo, hi, True
