"""The online-softmax step over a whole tile of scores, in explicit vector code (CPU only)."""

from __future__ import annotations

import math

from ...core.jit import body
from .simd import exp_row, row_max


@body
def softmax_tile(scores, m_run, l_run, alpha):
    """Online-softmax step of a tile of scores (CPU only), vectorised: ``scores`` become ``P``.

    For each row: ``m_new = max(m_run, max_j s_j)``, ``p_j = e^(s_j - m_new)``,
    ``alpha = e^(m_run - m_new)`` and ``l_run = alpha l_run + sum_j p_j``: the row's maximum
    (NaN if it holds one) by :func:`.simd.row_max`, then ``p`` and its sum by
    :func:`.simd.exp_row` (Cephes' ``expf`` or ``exp`` in vectors of sixteen lanes:
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
