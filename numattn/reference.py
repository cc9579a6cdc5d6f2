"""Float64 NumPy reference implementations: simple, slow and obviously right.

These are the oracle the tests and ``python -m numattn check`` compare every kernel
with.  They follow ``API.md`` literally: every key is gathered from its cache slot one
sequence at a time, scores are ``scale * (q . k)``, invisible pairs are removed before the
softmax (so NaN in a hidden or unused slot can never reach the output), sinks enter the
denominator once, rows with no visible key give 0 and ``lse = -inf`` (or the sink logit).

All results are float64, whatever the input dtype; 16- and 8-bit K/V are read as the
values they store (times a quantized cache's scales).
"""

from __future__ import annotations

import numpy as np

from .core.kv_cache import ContinuousBatchingKVCache, PagedKVCache
from .core.masks import AndMask, MaterializedMask, NullMask, OrMask, as_mask, mask_functions

__all__ = ["cross_attention", "decode_attention", "flash_attention_kv_cache", "merge_states"]


def _tokens(x, b, start, count, kv_offsets=None):
    """Rows ``start .. start + count - 1`` of sequence ``b`` of a K or V input, float64: the
    stored values (times a quantized cache's scales)."""
    t = np.arange(start, start + count)
    scales = None
    if isinstance(x, PagedKVCache):
        ps = x.blocks.shape[1]
        pages = np.asarray(x.lookup_table)[b, t // ps]
        rows = x.blocks[pages, t % ps]
        if x.scales is not None:
            scales = x.scales[pages, t % ps]
    elif isinstance(x, ContinuousBatchingKVCache):
        if count == 0:  # the table entry of a sequence that reads no row may hold anything
            return np.empty((0, *x.blocks.shape[2:]))
        block = int(np.asarray(x.lookup_table)[b])
        rows = x.blocks[block, t]
        if x.scales is not None:
            scales = x.scales[block, t]
    elif x.ndim == 4:  # dense [B, N, Hkv, D]
        rows = x[b, t]
    else:  # ragged [T, Hkv, D]
        rows = x[kv_offsets[b] + t]
    rows = np.asarray(rows).astype(np.float64)
    return rows if scales is None else rows * np.asarray(scales, np.float64)[..., None]


def _additive_tensor(mask):
    """The additive tensor of a mask (None if it has none)."""
    if isinstance(mask, MaterializedMask):
        return mask.tensor
    if isinstance(mask, (AndMask, OrMask)):
        for part in (mask.left, mask.right):
            t = _additive_tensor(part)
            if t is not None:
                return t
    return None


def _attend(q, keys, values, q_pos, rows, b, mask, scale, sink_weights, score_mod=None):
    """Attention of queries ``q [S, H, D]`` over ``keys/values [N, Hkv, D]`` (float64).

    ``q_pos[i]`` is the absolute position of query ``i`` and ``rows[i]`` its local row
    (for additive tensors); ``score_mod`` (a :class:`~numattn.ScoreMod`) is evaluated in
    Python for each pair.  Returns ``out [S, H, D]`` and ``lse [S, H]``.
    """
    s_len, h, d = q.shape
    n, hkv = keys.shape[0], keys.shape[1]
    group = h // hkv
    out = np.zeros((s_len, h, d))
    lse = np.full((s_len, h), -np.inf)
    k_idx = np.arange(n)
    per_head = bool(mask_functions(mask))
    visible = mask.visible(q_pos[:, None], k_idx[None, :], b=b) if n else np.zeros((s_len, 0), bool)
    additive = _additive_tensor(mask)
    # NaN and inf may sit in hidden slots (and in visible ones): no warnings for them
    with np.errstate(invalid="ignore", over="ignore"):
        for head in range(h):
            kv = head // group
            scores = scale * (q[:, head, :] @ keys[:, kv, :].T)  # [S, N]
            # a score of -inf reads inf in q or k: NaN, not a key of weight 0
            scores[scores == -np.inf] = np.nan
            if score_mod is not None:
                for i, j in np.ndindex(scores.shape):
                    scores[i, j] = score_mod(scores[i, j], b, head, int(q_pos[i]), j)
            seen = visible
            if per_head and n:
                seen = mask.visible(q_pos[:, None], k_idx[None, :], b=b, h=head)
            if additive is not None and n:
                t = np.asarray(additive, dtype=np.float64)
                if t.ndim == 2:
                    bias = t[rows][:, :n]
                elif t.ndim == 3:
                    bias = t[b][rows][:, :n]
                else:
                    bias = t[b, head][rows][:, :n]
                scores = scores + bias
                seen = seen & (bias != -np.inf)  # -inf hides the key, whatever its score
            for i in range(s_len):
                sel = seen[i]
                s = scores[i, sel]
                sink = None if sink_weights is None else float(sink_weights[head])
                if s.size == 0 or s.max() == -np.inf:
                    # Nothing visible, or only keys of weight 0: the output is 0 (0 * V,
                    # so NaN in a visible V row still propagates), lse the sink logit.
                    out[i, head] = 0.0 * (np.zeros(s.size) @ values[sel, kv, :])
                    if sink is not None:
                        lse[i, head] = sink
                    continue
                m = np.max(np.append(s, -np.inf if sink is None else sink))  # NaN propagates
                p = np.exp(s - m)
                denom = p.sum() + (0.0 if sink is None else np.exp(sink - m))
                out[i, head] = (p @ values[sel, kv, :]) / denom
                lse[i, head] = m + np.log(denom)
    return out, lse


def _scale(scale, d):
    return 1.0 / np.sqrt(d) if scale is None else float(scale)


def _cache_lengths(k, batch):
    if isinstance(k, (PagedKVCache, ContinuousBatchingKVCache)):
        return np.asarray(k.cache_lengths, dtype=np.int64)
    return np.zeros(batch, dtype=np.int64)


def flash_attention_kv_cache(q, k, v, mask, scale=None, *, q_input_row_offsets=None,
                             kv_input_row_offsets=None, sink_weights=None, score_mod=None,
                             return_lse=False):
    """Reference for :func:`numattn.flash_attention_kv_cache` (float64 results).

    Parameters
    ----------
    q : ndarray
        Padded ``[B, S, H, D]`` or ragged ``[T, H, D]`` queries.
    k, v : ndarray or cache
        Dense ``[B, N, Hkv, D]``, ragged ``[T_kv, Hkv, D]``, or cache objects.
    mask : Mask, ndarray or None
        A mask object, an additive tensor, or None (no mask).
    scale : float, optional
        Score scale; ``None`` means ``1 / sqrt(D)``.
    q_input_row_offsets, kv_input_row_offsets : int arrays [B + 1], optional
        Ragged splits of the queries and of plain K/V rows.
    sink_weights : ndarray [H], optional
        One sink logit per query head.
    score_mod : ScoreMod, optional
        Applied to each scaled score (in Python, pair by pair).
    return_lse : bool
        Also return the log-sum-exp.

    Returns
    -------
    out : ndarray of float64, shaped like ``q``
    lse : ndarray of float64, ``[B, S, H]`` or ``[T, H]`` (with ``return_lse``)

    Examples
    --------
    >>> import numpy as np
    >>> from numattn import CausalMask, reference
    >>> q = np.ones((1, 2, 1, 4)); k = np.ones((1, 3, 1, 4)); v = np.arange(12.).reshape(1, 3, 1, 4)
    >>> reference.flash_attention_kv_cache(q, k, v, CausalMask())[0, 0, 0].tolist()
    [2.0, 3.0, 4.0, 5.0]
    """
    mask = as_mask(mask)
    q = np.asarray(q, dtype=np.float64)
    sinks = None if sink_weights is None else np.asarray(sink_weights, np.float64)
    d = q.shape[-1]
    sc = _scale(scale, d)
    if q_input_row_offsets is None:  # padded [B, S, H, D]
        batch, s_len = q.shape[:2]
        cl = _cache_lengths(k, batch)
        out = np.zeros(q.shape)
        lse = np.full(q.shape[:3], -np.inf)
        for b in range(batch):
            n = (k.shape[1] if isinstance(k, np.ndarray) else cl[b] + s_len)
            keys, vals = _tokens(k, b, 0, n), _tokens(v, b, 0, n)
            rows = np.arange(s_len)
            out[b], lse[b] = _attend(q[b], keys, vals, n - s_len + rows, rows, b, mask, sc,
                                     sinks, score_mod)
    else:
        qo = np.asarray(q_input_row_offsets, dtype=np.int64)
        ko = qo if kv_input_row_offsets is None else np.asarray(kv_input_row_offsets, np.int64)
        batch = len(qo) - 1
        cl = _cache_lengths(k, batch)
        out = np.zeros(q.shape)
        lse = np.full(q.shape[:2], -np.inf)
        for b in range(batch):
            q_len = qo[b + 1] - qo[b]
            n = cl[b] + ko[b + 1] - ko[b]
            keys, vals = _tokens(k, b, 0, n, ko), _tokens(v, b, 0, n, ko)
            rows = np.arange(q_len)
            sl = slice(qo[b], qo[b + 1])
            out[sl], lse[sl] = _attend(q[sl], keys, vals, n - q_len + rows, rows, b, mask, sc,
                                       sinks, score_mod)
    return (out, lse) if return_lse else out


def decode_attention(q, k, v, mask=None, scale=None, *, sink_weights=None, score_mod=None,
                     return_lse=False):
    """Reference for :func:`numattn.decode_attention`: ``q [B, H, D]``, one token each.

    Parameters
    ----------
    q : ndarray [B, H, D]
        One query per sequence, at position ``num_keys - 1``.
    k, v : ndarray [B, N, Hkv, D] or cache
        Dense keys/values or caches (``num_keys = cache_len + 1``).
    mask : Mask, ndarray or None
        A mask object, an additive tensor, or None (no mask).
    scale : float, optional
        Score scale; ``None`` means ``1 / sqrt(D)``.
    sink_weights : ndarray [H], optional
        One sink logit per query head.
    score_mod : ScoreMod, optional
        Applied to each scaled score (in Python, pair by pair).
    return_lse : bool
        Also return the log-sum-exp.

    Returns
    -------
    out : ndarray of float64 [B, H, D]
    lse : ndarray of float64 [B, H] (with ``return_lse``)

    Examples
    --------
    >>> import numpy as np
    >>> from numattn import reference
    >>> q = np.zeros((1, 1, 2)); k = np.zeros((1, 4, 1, 2)); v = np.arange(8.).reshape(1, 4, 1, 2)
    >>> reference.decode_attention(q, k, v).tolist()
    [[[3.0, 4.0]]]
    """
    mask = as_mask(mask if mask is not None else NullMask())
    q = np.asarray(q, dtype=np.float64)
    batch, h, d = q.shape
    sc = _scale(scale, d)
    sinks = None if sink_weights is None else np.asarray(sink_weights, np.float64)
    cl = _cache_lengths(k, batch)
    out = np.zeros(q.shape)
    lse = np.full((batch, h), -np.inf)
    for b in range(batch):
        n = k.shape[1] if isinstance(k, np.ndarray) else cl[b] + 1
        keys, vals = _tokens(k, b, 0, n), _tokens(v, b, 0, n)
        o, l_ = _attend(q[b][None], keys, vals, np.array([n - 1]), np.array([0]), b, mask, sc,
                        sinks, score_mod)
        out[b], lse[b] = o[0], l_[0]
    return (out, lse) if return_lse else out


def cross_attention(q, q_input_row_offsets, q_max_seq_len, k, v, kv_input_row_offsets,
                    mask=None, scale=None, *, score_mod=None, return_lse=False):
    """Reference for :func:`numattn.cross_attention`: queries at ``q_idx = r``.

    Parameters
    ----------
    q : ndarray [T, H, D]
        Ragged queries.
    q_input_row_offsets : int array [B + 1]
        Ragged split of the queries.
    q_max_seq_len : int
        Longest query sequence (rows of a padded additive mask).
    k, v : ndarray [T_kv, Hkv, D] or cache
        Ragged new K/V rows or caches (``num_keys = cache_len + kv_len``).
    kv_input_row_offsets : int array [B + 1] or None
        Ragged split of the new K/V rows; ``None`` means ``kv_len = q_len`` (for dense
        ``[B, N, Hkv, D]`` arrays: all ``N`` rows).
    mask : Mask, ndarray or None
        A mask object (``q_idx = r``), an additive tensor, or None (no mask).
    scale : float, optional
        Score scale; ``None`` means ``1 / sqrt(D)``.
    score_mod : ScoreMod, optional
        Applied to each scaled score (in Python, pair by pair).
    return_lse : bool
        Also return the log-sum-exp.

    Returns
    -------
    out : ndarray of float64 [T, H, D]
    lse : ndarray of float64 [T, H] (with ``return_lse``)

    Examples
    --------
    >>> import numpy as np
    >>> from numattn import reference
    >>> q = np.zeros((2, 1, 2)); kv = np.arange(6.).reshape(3, 1, 2)
    >>> reference.cross_attention(q, [0, 2], 2, kv, kv, [0, 3])[0, 0].tolist()
    [2.0, 3.0]
    """
    mask = as_mask(mask if mask is not None else NullMask())
    q = np.asarray(q, dtype=np.float64)
    qo = np.asarray(q_input_row_offsets, dtype=np.int64)
    batch = len(qo) - 1
    if kv_input_row_offsets is not None:
        ko = np.asarray(kv_input_row_offsets, dtype=np.int64)
    elif isinstance(k, np.ndarray) and k.ndim == 4:  # dense: all N rows
        ko = np.arange(batch + 1, dtype=np.int64) * k.shape[1]
    else:
        ko = qo
    sc = _scale(scale, q.shape[-1])
    cl = _cache_lengths(k, batch)
    out = np.zeros(q.shape)
    lse = np.full(q.shape[:2], -np.inf)
    for b in range(batch):
        q_len = qo[b + 1] - qo[b]
        n = cl[b] + ko[b + 1] - ko[b]
        keys, vals = _tokens(k, b, 0, n, ko), _tokens(v, b, 0, n, ko)
        rows = np.arange(q_len)
        sl = slice(qo[b], qo[b + 1])
        out[sl], lse[sl] = _attend(q[sl], keys, vals, rows, rows, b, mask, sc, None, score_mod)
    return (out, lse) if return_lse else out


def merge_states(outs, lses):
    """Reference for :func:`numattn.merge_states` (float64).

    Parameters
    ----------
    outs : sequence of ndarray [..., D]
        Partial outputs over disjoint key sets.
    lses : sequence of ndarray [...]
        Their log-sum-exps.

    Returns
    -------
    out : ndarray of float64 [..., D]
    lse : ndarray of float64 [...]

    Examples
    --------
    >>> import numpy as np
    >>> from numattn import reference
    >>> o, l = reference.merge_states([np.ones((1, 2)), np.zeros((1, 2))],
    ...                               [np.zeros(1), np.zeros(1)])
    >>> o.tolist(), np.round(l, 4).tolist()
    ([[0.5, 0.5]], [0.6931])
    """
    outs = [np.asarray(o, dtype=np.float64) for o in outs]
    lse_all = np.stack([np.asarray(x, dtype=np.float64) for x in lses])
    m = lse_all.max(axis=0)  # NaN propagates
    empty = m == -np.inf  # every part empty: 0 and -inf
    skip = lse_all == -np.inf  # empty parts weigh exactly 0 and are not read
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        w = np.where(skip, 0.0, np.exp(lse_all - np.where(empty, 0.0, m)))
        total = w.sum(axis=0)
        out = np.zeros(outs[0].shape)
        for wi, oi, si in zip(w, outs, skip):
            # a weight that underflowed to 0 still counts: 0 * NaN propagates
            out = out + np.where(si[..., None], 0.0, wi[..., None] * oi)
        out = np.where(empty[..., None], 0.0, out / total[..., None])
        lse = np.where(empty, -np.inf, m + np.log(total))
    return out, lse
