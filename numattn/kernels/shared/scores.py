"""Score modifiers in the kernels (CPU and CUDA): :func:`modified_score`.

The plain kernels leave scores as they are; the kernels specialized for a call's
:class:`~numattn.core.functions.ScoreMod` replace ``_score_mod`` by a body that calls its
function (:mod:`numattn.core.functions`).
"""

from __future__ import annotations

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
