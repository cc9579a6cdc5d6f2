"""The online-softmax arithmetic, written once for every kernel and backend.

Plain-Python bodies, compiled with :func:`numattn._jit.cpu_jit` for the CPU and
:func:`numattn._jit.cuda_device` for CUDA (:func:`softmax_tile`, the step of the CPU
kernels over a whole tile of scores, for the CPU only).  One exponent base (e) everywhere.

A partial softmax state over a set of keys is ``(m, l, acc)``: the largest visible score
``m`` (``-inf`` when no key is visible), ``l = sum_j e^(s_j - m)`` and
``acc = sum_j e^(s_j - m) v_j``.  States over disjoint key sets merge exactly by rescaling
to the larger ``m``; the sink logit enters once, when a row is finished.
"""

from __future__ import annotations

import math

from ._jit import body
from ._simd import exp_row, row_max


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
def softmax_tile(scores, m_run, l_run, alpha):
    """Online-softmax step of a tile of scores (CPU only), vectorised: ``scores`` become ``P``.

    For each row: ``m_new = max(m_run, max_j s_j)``, ``p_j = e^(s_j - m_new)``,
    ``alpha = e^(m_run - m_new)`` and ``l_run = alpha l_run + sum_j p_j``: the row's maximum
    (NaN if it holds one) by :func:`numattn._simd.row_max`, then ``p`` and its sum by
    :func:`numattn._simd.exp_row` (Cephes' ``expf`` or ``exp`` in vectors of sixteen lanes:
    ``e^x`` is exactly 0 below the dtype's range, so for ``-inf``, and NaN propagates).
    """
    kw = scores.shape[1]
    for i in range(scores.shape[0]):
        row = scores[i]
        tile_max = row_max(row, kw)
        m_old = m_run[i]
        m_new = m_old if m_old >= tile_max else tile_max
        if m_new == -math.inf:  # nothing visible yet
            for j in range(kw):
                row[j] = 0
            alpha[i] = 1
            continue
        total = exp_row(row, kw, m_new)
        a = math.exp(m_old - m_new)
        alpha[i] = a
        m_run[i] = m_new
        l_run[i] = l_run[i] * a + total
