"""The online softmax, written once for every kernel and backend.

Plain-Python bodies, compiled with :func:`numattn.core.jit.cpu_jit` for the CPU and
:func:`numattn.core.jit.cuda_device` for CUDA.  One exponent base (e) everywhere.

A partial softmax state over a set of keys is ``(m, l, acc)``: the largest visible score
``m`` (``-inf`` when no key is visible), ``l = sum_j e^(s_j - m)`` and
``acc = sum_j e^(s_j - m) v_j``.  It starts as ``(-inf, 0, 0)``.  Every tile loop, CPU and
CUDA, moves it through the same steps:

* running max: the tile's largest score, reduced with :func:`max_nan`;
* rescale: :func:`rescale_factor` gives the new ``m`` and ``alpha = e^(m_old - m_new)``;
* accumulate: each key weighs :func:`key_weight` (``e^(s - m_new)``), and ``l`` and every
  element of ``acc`` become :func:`accumulate` ``(x, alpha, tile's sum)``;
* finish: :func:`finish_row` gives ``out = acc * out_scale`` and the row's log-sum-exp,
  with the sink logit counted exactly once;
* merge: states over disjoint key sets merge exactly by rescaling to the larger ``m``
  (:func:`merge_weight`, :func:`merge_partials`), and so do finished results.

The CPU computes the first steps over a whole tile at once in explicit vector code
(:func:`numattn.kernels.cpu.softmax.softmax_tile`), which calls these bodies per row.
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
    compares larger, and CUDA's ``fmax`` drops a NaN: either could hide a NaN score).

    The step of every running max: a tile's largest score, a state's new ``m``, the largest
    ``m`` of the parts of a merge."""
    return a if (a > b or a != a) else b


@body
def rescale_factor(m, tile_max):
    """Move a running max ``m`` to a tile whose largest score is ``tile_max``.

    Returns ``(m_new, alpha)``: ``m_new = max(m, tile_max)`` (NaN if either is) and
    ``alpha = e^(m - m_new)``, the factor that rescales ``l`` and ``acc``
    (:func:`accumulate`).  A tile with no visible key leaves ``m`` as it is (``alpha`` is 1
    unless ``m`` is ``-inf``: then 0, and ``l`` and ``acc`` are 0).
    """
    m_new = max_nan(m, tile_max)
    return m_new, exp_diff(m, m_new)


@body
def key_weight(score, m):
    """Weight ``e^(score - m)`` of a key in a state of running max ``m`` (``score <= m``):
    exactly 0 for a hidden key (``-inf``), NaN for a NaN score."""
    return exp_diff(score, m)


@body
def accumulate(x, alpha, added):
    """``x * alpha + added``: a state's sum ``l`` or an element of its ``acc``, rescaled by
    :func:`rescale_factor`'s ``alpha``, plus the tile's sum of weights (or of weighted
    values)."""
    return x * alpha + added


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
def merge_partials(part_m, part_l, part_acc, b, r, finished, sink, has_sink, d0, d_step, out):
    """Merge the partial states of row ``r`` of batch ``b`` and finish it: ``out[b, r, d]``
    for ``d = d0, d0 + d_step, ...``; returns the row's log-sum-exp.

    Part ``p`` of the row is ``(part_m[b, p, r], part_l[b, p, r], part_acc[b, p, r])``.
    ``M = max_p m_p``, ``w_p = e^(m_p - M)``, ``L = sum w_p l_p``, ``acc = sum w_p acc_p``;
    the sink enters once, in :func:`finish_row`.  A part with ``m_p = -inf`` weighs exactly
    0: a partial state's ``acc_p`` is 0 when it saw no visible key, and ``0 * acc_p`` still
    carries NaN from a visible key of weight 0 (as does a part whose weight underflows), so
    the result does not depend on how the keys were split.

    With ``finished`` the parts are finished results ``(lse_p, out_p)`` in ``part_m`` and
    ``part_acc``, that is states ``(lse_p, 1, out_p)``: ``part_l`` is not read, and neither
    is the output of a part whose ``lse_p`` is ``-inf`` (an empty part may hold anything).

    ``L`` is summed in float64 whatever the dtype.
    """
    num_parts = part_m.shape[1]
    big = part_m[b, 0, r]
    for p in range(1, num_parts):
        big = max_nan(part_m[b, p, r], big)
    total = 0.0
    for p in range(num_parts):
        w = merge_weight(part_m[b, p, r], big)
        total += w if finished else w * part_l[b, p, r]
    out_scale, row_lse = finish_row(big, total, sink, has_sink)
    head_dim = part_acc.shape[3]
    out_row = out[b, r]
    for p in range(num_parts):  # one weight per part (out_scale folded in), then its row
        w = merge_weight(part_m[b, p, r], big) * out_scale
        acc_row = part_acc[b, p, r]
        if finished and part_m[b, p, r] == -math.inf:  # an empty result: not read
            if p == 0:
                for d in range(d0, head_dim, d_step):
                    out_row[d] = 0
        elif p == 0:
            for d in range(d0, head_dim, d_step):
                out_row[d] = w * acc_row[d]
        else:
            for d in range(d0, head_dim, d_step):
                out_row[d] += w * acc_row[d]
    return row_lse
