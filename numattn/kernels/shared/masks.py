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

A :class:`~numattn.core.masks.FunctionMask` leaf (``OP_FUNCTION``, its parameter the
function's index) calls ``_function_visible``, which kernels specialized for the call's
functions replace (:mod:`numattn.core.functions`); its tile status comes from the table of
``functions`` (:data:`numattn.core.functions.FUNCTION_TILE_ROWS`).  Every body here takes
``functions``, the flat tuple ``(tables, q_start_pos, has_score_mod, per_head,
batch_offset, q_offset, k_offset, *captures)`` of
:func:`numattn.core.functions.kernel_functions`, and the sequence ``b`` (plus
``batch_offset``) and query head ``h`` a function reads.
"""

from __future__ import annotations

import math

from ...core.functions import FUNCTION_TILE_KEYS, FUNCTION_TILE_ROWS
from ...core.jit import body
from ...core.masks import (
    INT64_MIN,
    OP_AND,
    OP_FUNCTION,
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
def _function_visible(index, functions, b, h, q_idx, k_idx):
    """1 when function ``index`` of the mask shows the pair, else 0: never called by the
    plain kernels (no FunctionMask), replaced in the kernels specialized for one."""
    return 1


@body
def function_tile(functions, index, b, q0, q1, k0, k1):
    """``(some pair visible, some pair hidden)``, as 1 or 0, under function ``index`` for
    queries ``[q0, q1]`` x keys ``[k0, k1]`` of sequence ``b``, from the table of
    ``functions`` (both 1 where there is none: every tile partial)."""
    tables = functions[0]
    if tables.shape[0] == 0:
        return 1, 1
    first_row = functions[1][b]
    r0 = max((q0 - first_row) // FUNCTION_TILE_ROWS, 0)
    r1 = min((q1 - first_row) // FUNCTION_TILE_ROWS, tables.shape[2] - 1)
    c0 = max(k0 // FUNCTION_TILE_KEYS, 0)
    c1 = min(k1 // FUNCTION_TILE_KEYS, tables.shape[3] - 1)
    some_visible = 0
    some_hidden = 0
    for r in range(r0, r1 + 1):
        for c in range(c0, c1 + 1):
            entry = tables[index, b, r, c]
            some_visible |= entry & 1
            some_hidden |= entry >> 1
        if some_visible & some_hidden:
            break
    return some_visible, some_hidden


@body
def mask_visible(program, functions, b, h, q_idx, k_idx):
    """True when key ``k_idx`` is visible from query ``q_idx`` (head ``h`` of sequence
    ``b``) under ``program``."""
    stack = 0
    for i in range(program.shape[0]):
        op = program[i, 0]
        if op == OP_FUNCTION:
            qi, ki = _leaf_positions(program, i, q_idx, k_idx)
            shown = _function_visible(program[i, 1], functions, b + functions[4], h, qi, ki)
            stack = (stack << 1) | shown
        elif op < 0:  # OP_AND or OP_OR
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
def function_block(program, row, functions, b, q0, q1, k0, k1, num_heads):
    """Tile-table entry of the function at ``program[row]`` for queries ``[q0, q1)`` x keys
    ``[k0, k1)`` of sequence ``b``, heads ``0 .. num_heads - 1``: bit 0 "some pair
    visible", bit 1 "some pair hidden" (0 for no pair)."""
    index = program[row, 1]
    b_seen = b + functions[4]
    shown = 0
    pairs = 0
    for h in range(num_heads):
        for q_idx in range(q0, q1):
            for k_idx in range(k0, k1):
                qi, ki = _leaf_positions(program, row, q_idx, k_idx)
                shown += _function_visible(index, functions, b_seen, h, qi, ki)
            pairs += k1 - k0
            if 0 < shown < pairs:
                return 3
    return (1 if shown > 0 else 0) | (2 if shown < pairs else 0)


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
def mask_tile_status(program, functions, b, q0, q1, k0, k1):
    """TILE_NONE, TILE_PARTIAL or TILE_FULL for queries [q0, q1] x keys [k0, k1] (inclusive)
    of sequence ``b``, whatever the query head.

    Two bit stacks track, for each sub-expression, whether some pair of the tile can be
    visible and whether some pair can be hidden; both are sound over-approximations.
    """
    vis = 0
    hid = 0
    for i in range(program.shape[0]):
        op = program[i, 0]
        if op == OP_FUNCTION:  # its table holds the positions it was evaluated at
            shown, hidden = function_tile(functions, program[i, 1], b, q0, q1, k0, k1)
            vis = (vis << 1) | shown
            hid = (hid << 1) | hidden
        elif op < 0:  # OP_AND or OP_OR
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
def key_hidden(program, functions, status, q_idx, has_additive, additive, b, h, t):
    """True when the mask (tile ``status``) or the additive tensor hides key ``t`` from head
    ``h`` of sequence ``b``."""
    if status != TILE_NONE and not mask_visible(program, functions, b, h, q_idx, t):
        return True
    return has_additive and key_bias(additive, b, h, 0, t) == -math.inf


@body
def visible_span(program, q_idx, k0, kw):
    """Keys ``[jlo, jhi)`` of ``k0 .. k0 + kw - 1`` that ``q_idx`` sees, as one run.

    Every leaf mask shows a query one run of keys, and ``&`` intersects runs, so a program
    without ``|`` gives ``(jlo, jhi, True)``, exactly what :func:`mask_visible` says key by
    key; with a ``|`` or a function it gives ``(0, 0, False)`` and the caller tests each key.
    """
    lo = k0
    hi = k0 + kw
    for i in range(program.shape[0]):
        op = program[i, 0]
        if op == OP_OR or op == OP_FUNCTION:
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
