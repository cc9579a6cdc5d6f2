"""Scores in the kernels (CPU and CUDA): :func:`read_score` and :func:`modified_score`.

Every kernel passes each scaled score ``q . k`` through :func:`read_score`; the plain
kernels leave it at that, and the kernels specialized for a call's
:class:`~numattn.core.functions.ScoreMod` replace ``_score_mod`` by a body that calls its
function (:mod:`numattn.core.functions`).
"""

from __future__ import annotations

import math

from ...core.jit import body


@body
def _score_mod(functions, score, b, h, q_idx, k_idx):
    """The score as it is: replaced in the kernels specialized for a ScoreMod."""
    return score


@body
def modified_score(functions, score, b, h, q_idx, k_idx):
    """The scaled score of query ``q_idx`` (head ``h`` of sequence ``b``) and key ``k_idx``
    after the call's score modifier; kernels call it only where ``functions[2]``
    (``has_score_mod``) is set."""
    # b and the positions shifted by the offsets of a shard (numattn.dask), as masks see them
    return _score_mod(functions, score, b + functions[4], h, q_idx + functions[5],
                      k_idx + functions[6])


@body
def read_score(score):
    """The scaled score ``q . k`` as the softmax reads it: ``-inf`` (inf in the query or the
    key, or an overflow) becomes NaN, so the row reports NaN in ``out`` and ``lse`` rather
    than the "no visible key" pair; masks, additive ``-inf`` and score modifiers still give
    keys a weight of exactly 0."""
    return score - score if score == -math.inf else score
