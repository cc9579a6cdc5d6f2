"""Mask evaluation in the kernels: the bodies that read a mask program (CPU and CUDA).

A mask program (:func:`numattn.core.masks.compile_mask`) is an ``int64`` array ``[n_ops, 2]``
of ``(opcode, parameter)`` rows in postfix order.  :func:`mask_visible` evaluates it for one
pair, :func:`mask_tile_status` for a query range x key range, :func:`visible_span` as one
run of keys per query; :func:`key_bias` and :func:`add_bias` read an additive tensor.
"""

from __future__ import annotations

import math

from ...core.jit import body
from ...core.masks import (
    OP_AND,
    OP_CAUSAL,
    OP_CHUNKED,
    OP_CHUNKED_CAUSAL,
    OP_NULL,
    OP_OR,
    OP_SLIDING_WINDOW_CAUSAL,
    TILE_FULL,
    TILE_NONE,
    TILE_PARTIAL,
)


@body
def _leaf_visible(op, param, q_idx, k_idx):
    if op == OP_NULL:
        return 1
    if op == OP_CAUSAL:
        return 1 if k_idx <= q_idx else 0
    if op == OP_SLIDING_WINDOW_CAUSAL:
        return 1 if (k_idx <= q_idx and q_idx - k_idx < param) else 0
    if op == OP_CHUNKED:
        return 1 if q_idx // param == k_idx // param else 0
    # OP_CHUNKED_CAUSAL
    return 1 if (k_idx <= q_idx and q_idx // param == k_idx // param) else 0


@body
def _leaf_tile(op, param, q0, q1, k0, k1):
    """(some pair visible, some pair hidden) for queries [q0, q1] x keys [k0, k1]."""
    if op == OP_NULL:
        return 1, 0
    if op == OP_CAUSAL:
        return (1 if k0 <= q1 else 0), (1 if k1 > q0 else 0)
    if op == OP_SLIDING_WINDOW_CAUSAL:
        vis = 1 if (k0 <= q1 and q0 - k1 < param) else 0  # no q0 - param: it may wrap
        hid = 1 if (k1 > q0 or q1 - k0 >= param) else 0
        return vis, hid
    cq0 = q0 // param
    cq1 = q1 // param
    ck0 = k0 // param
    ck1 = k1 // param
    share_chunk = 1 if (max(cq0, ck0) <= min(cq1, ck1)) else 0
    one_chunk = cq0 == cq1 and cq1 == ck0 and ck0 == ck1
    if op == OP_CHUNKED:
        return share_chunk, (0 if one_chunk else 1)
    # OP_CHUNKED_CAUSAL
    vis = 1 if (share_chunk == 1 and k0 <= q1) else 0
    hid = 1 if (k1 > q0 or not one_chunk) else 0
    return vis, hid


@body
def mask_visible(program, q_idx, k_idx):
    """True when key ``k_idx`` is visible from query ``q_idx`` under ``program``."""
    stack = 0
    for i in range(program.shape[0]):
        op = program[i, 0]
        if op == OP_AND or op == OP_OR:
            a = stack & 1
            b = (stack >> 1) & 1
            stack = stack >> 2
            c = (a & b) if op == OP_AND else (a | b)
            stack = (stack << 1) | c
        else:
            stack = (stack << 1) | _leaf_visible(op, program[i, 1], q_idx, k_idx)
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
        if op == OP_AND or op == OP_OR:
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
            v, h = _leaf_tile(op, program[i, 1], q0, q1, k0, k1)
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
        param = program[i, 1]
        if op == OP_OR:
            return 0, 0, False
        if op == OP_CAUSAL:
            hi = min(hi, q_idx + 1)
        elif op == OP_SLIDING_WINDOW_CAUSAL:
            lo = max(lo, q_idx - param + 1)
            hi = min(hi, q_idx + 1)
        elif op == OP_CHUNKED:
            start = (q_idx // param) * param
            lo = max(lo, start)
            hi = min(hi, start + param)
        elif op == OP_CHUNKED_CAUSAL:
            lo = max(lo, (q_idx // param) * param)
            hi = min(hi, q_idx + 1)
    lo = min(max(lo - k0, 0), kw)
    hi = max(min(hi - k0, kw), lo)
    return lo, hi, True
