"""The online-softmax step over a whole tile of scores, in explicit vector code (CPU only)."""

from __future__ import annotations

import math

from ...core.jit import body
from ..shared.scores import read_score
from ..shared.softmax import accumulate, rescale_factor
from .simd import exp_row, exp_split_row, row_max


@body
def softmax_tile(scores, m_run, l_run, alpha):
    """Online-softmax step of a tile of scores (CPU only), vectorised: ``scores`` become ``P``.

    For each row, the steps of :mod:`numattn.kernels.shared.softmax`: the row's maximum (NaN
    if it holds one) by :func:`.simd.row_max`, ``m_new`` and ``alpha`` by
    :func:`~numattn.kernels.shared.softmax.rescale_factor`, then every key's weight
    ``p_j = e^(s_j - m_new)`` and their sum by :func:`.simd.exp_row` (Cephes' ``expf`` or
    ``exp`` in vectors of sixteen lanes: ``e^x`` is exactly 0 below the dtype's range, so
    for ``-inf``, and NaN propagates), and ``l_run`` by
    :func:`~numattn.kernels.shared.softmax.accumulate`.  A row with nothing visible yet is
    left as it is (``alpha = 1``, ``p = 0``).  The caller rescales ``acc`` by ``alpha``.

    CPU only because the row's maximum and weights are explicit LLVM vector code
    (:mod:`.simd`), which has no CUDA counterpart: on CUDA the threads of a block share a
    tile's keys, and the same steps run per key with shared-memory reductions
    (:mod:`numattn.kernels.cuda.split_k`, :mod:`numattn.kernels.cuda.flash`).
    """
    kw = scores.shape[1]
    for i in range(scores.shape[0]):
        # rows as scores[i], no view of a row kept across the calls of the shared bodies:
        # Numba would then count the view's references at every row
        m_new = _moved_max(m_run, alpha, i, row_max(scores[i], kw))
        if m_new == -math.inf:  # nothing visible yet
            for j in range(kw):
                scores[i, j] = 0
            continue
        total = exp_row(scores[i], kw, m_new)
        m_run[i] = m_new
        l_run[i] = accumulate(l_run[i], alpha[i], total)


@body
def _moved_max(m_run, alpha, i, top):
    """Row ``i``'s running max moved to a tile whose largest score is ``top``
    (:func:`~numattn.kernels.shared.softmax.rescale_factor`): returns the new max and
    sets ``alpha[i]``, to 1 where nothing is visible yet, and without an exponential
    where the max stays (``e^0``: most tiles past the first few of a row)."""
    m = m_run[i]
    if top <= m and m != -math.inf:  # (neither NaN)
        alpha[i] = 1
        return m
    m_new, a = rescale_factor(m, top)
    alpha[i] = 1 if m_new == -math.inf else a
    return m_new


@body
def softmax_split_tile(scores, scale, raw, m_run, l_run, alpha, hi, lo):
    """:func:`softmax_tile` of ``scores [rows, K]``, the weights written as two bfloat16
    parts instead, ``hi + lo`` (bits, ``[rows, K]`` flattened,
    :func:`.simd.exp_split_row`), for the AMX tiles' ``P V`` (:mod:`.amx`); ``scores``
    are left as they are.  With ``raw``, ``scores`` hold the unscaled ``q . k`` and
    ``scale > 0`` (the row's maximum then is ``scale`` times that of the sums): the scale
    and :func:`~numattn.kernels.shared.scores.read_score` apply in the same pass."""
    kw = scores.shape[1]
    for i in range(scores.shape[0]):
        top = row_max(scores[i], kw)
        if raw:
            top = read_score(top * scale)
        m_new = _moved_max(m_run, alpha, i, top)
        if m_new == -math.inf:  # nothing visible yet
            for j in range(i * kw, (i + 1) * kw):
                hi[j] = 0
                lo[j] = 0
            continue
        total = exp_split_row(scores[i], kw, m_new, scale, raw, hi, lo, i * kw)
        m_run[i] = m_new
        l_run[i] = accumulate(l_run[i], alpha[i], total)
