"""The online-softmax arithmetic, written once for every kernel and backend.

Plain-Python bodies, compiled with :func:`numattn.core.jit.cpu_jit` for the CPU and
:func:`numattn.core.jit.cuda_device` for CUDA.  One exponent base (e) everywhere.

A partial softmax state over a set of keys is ``(m, l, acc)``: the largest visible score
``m`` (``-inf`` when no key is visible), ``l = sum_j e^(s_j - m)`` and
``acc = sum_j e^(s_j - m) v_j``.  States over disjoint key sets merge exactly by rescaling
to the larger ``m``; the sink logit enters once, when a row is finished.
"""

from __future__ import annotations

import math

from ...core.jit import body


@body
def exp_diff(a, b):
    """``e^(a - b)`` for ``a <= b``, exactly 0 when ``a`` is ``-inf`` (also if ``b`` is).

    Keeps the type of its arguments (float32 stays float32).
    """
    if a == -math.inf:
        return math.exp(a)
    return math.exp(a - b)


@body
def max_nan(a, b):
    """The larger of ``a`` and ``b``, NaN if either is NaN (``max`` keeps whichever argument
    compares larger, and CUDA's ``fmax`` drops a NaN: either could hide a NaN score)."""
    return a if (a > b or a != a) else b


@body
def finish_row(m, l, sink, has_sink):
    """Close a row: ``out = acc * out_scale`` and its log-sum-exp.

    With a sink logit ``sigma`` the denominator gains ``e^(sigma - M)`` with
    ``M = max(m, sigma)``, exactly once.  A row with no visible key gives ``out_scale = 0``
    and ``lse = -inf``, or ``sigma`` with a sink, whatever it holds (even NaN or inf: the
    output of such a row is 0, never NaN).

    Returns
    -------
    out_scale, lse : float
    """
    if m == -math.inf and l == 0:  # no visible key: nothing to divide, whatever the sink
        return 0.0, (sink if has_sink else m)
    if has_sink:
        big = max_nan(m, sink)
        w = exp_diff(m, big)
        denom = l * w + math.exp(sink - big)
        return w / denom, big + math.log(denom)
    if l > 0:
        return 1.0 / l, m + math.log(l)
    if l == 0:
        return 0.0, -math.inf
    return l, l  # NaN propagates


@body
def merge_weight(m_part, m_max):
    """Weight ``e^(m_part - m_max)`` of a partial state in a merge (0 for an empty part)."""
    return exp_diff(m_part, m_max)


@body
def rescale_state(m, l, tile_max):
    """Move a partial state to the max of a new tile of scores.

    Returns ``(m_new, l * alpha, alpha)``: the accumulator is rescaled by ``alpha`` and each
    new key then weighs ``exp_diff(s, m_new)``.  A tile with no visible key leaves the
    state unchanged (``alpha`` is 1 unless ``m`` was ``-inf``, when ``l`` and ``acc`` are 0).
    """
    m_new = max_nan(m, tile_max)
    alpha = exp_diff(m, m_new)
    return m_new, l * alpha, alpha


@body
def reduce_row(part_m, part_l, part_acc, sinks, has_sink, b, h, d0, d_step, out, lse):
    """Merge the partitions of row ``(b, h)`` and finish it: ``out[b, h, d]`` for
    ``d = d0, d0 + d_step, ...`` and ``lse[b, h]`` (written when ``d0 == 0``).

    ``M = max_p m_p``, ``w_p = e^(m_p - M)``, ``L = sum w_p l_p``, ``acc = sum w_p acc_p``;
    the sink enters once, in :func:`finish_row`.  A partition with ``m_p = -inf`` weighs
    exactly 0: its ``acc_p`` is 0 when it saw no visible key, and ``0 * acc_p`` still
    carries NaN from a visible row of weight 0 (as does a partition whose weight
    underflows), so the result does not depend on how the keys were split.
    """
    num_parts = part_m.shape[1]
    big = part_m[b, 0, h]
    for p in range(1, num_parts):
        x = part_m[b, p, h]
        if x > big or x != x:
            big = x
    total = 0.0
    for p in range(num_parts):
        total += merge_weight(part_m[b, p, h], big) * part_l[b, p, h]
    out_scale, row_lse = finish_row(big, total, sinks[h], has_sink)
    head_dim = part_acc.shape[3]
    out_row = out[b, h]
    for p in range(num_parts):  # one weight per partition (out_scale folded in), its row
        w = merge_weight(part_m[b, p, h], big) * out_scale
        acc_row = part_acc[b, p, h]
        if p == 0:
            for d in range(d0, head_dim, d_step):
                out_row[d] = w * acc_row[d]
        else:
            for d in range(d0, head_dim, d_step):
                out_row[d] += w * acc_row[d]
    if d0 == 0:
        lse[b, h] = row_lse


@body
def merge_row(part_out, part_lse, r, out, lse):
    """Merge row ``r`` of ``part_out [P, R, D]`` / ``part_lse [P, R]`` into ``out[r]``, ``lse[r]``.

    Parts whose lse is ``-inf`` (no visible key) weigh exactly 0, and their outputs are not
    read.  Plain body, shared by the CPU and CUDA reductions.
    """
    num_parts = part_lse.shape[0]
    big = -math.inf
    for p in range(num_parts):
        x = part_lse[p, r]
        if x > big or x != x:
            big = x
    total = big - big  # 0 of the right type when big is finite
    if big == -math.inf:
        for d in range(out.shape[1]):
            out[r, d] = 0.0
        lse[r] = big
        return
    for p in range(num_parts):
        total += merge_weight(part_lse[p, r], big)
    for d in range(out.shape[1]):
        out[r, d] = 0.0
    for p in range(num_parts):  # one weight per part, then its whole row
        if part_lse[p, r] != -math.inf:  # (a weight that underflowed to 0 still counts)
            w = merge_weight(part_lse[p, r], big)
            for d in range(out.shape[1]):
                out[r, d] += w * part_out[p, r, d]
    for d in range(out.shape[1]):
        out[r, d] /= total
    lse[r] = big + math.log(total)
