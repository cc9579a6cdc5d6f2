"""``flash_attention_kv_cache``: blocked (flash) attention over KV caches.

Checks the arguments and normalises every input form (padded BSHD or ragged queries; dense,
ragged, continuous-batching or paged K/V) to one ragged problem over the paged addressing
of :func:`numattn.core.kv_cache.resolve_kv` (:func:`numattn.core.problem.attention_problem`),
and runs the CPU kernel (:func:`numattn.kernels.cpu.flash.run_flash_cpu`).
"""

from __future__ import annotations

import numpy as np

from .core.kv_cache import KVCache
from .core.masks import compile_mask
from .core.problem import (
    OUT_MAY_BE_Q,
    OperationRules,
    attention_problem,
)
from .core.validate import (
    check_array,
    to_host,
)

__all__ = ["flash_attention_kv_cache"]

#: Bottom-right aligned queries; plain K/V as rows with ragged queries, dense with padded
#: ones; ``out`` may be q itself (a tile of queries is read before its outputs are written).
RULES = OperationRules(queries_at_start=False, dense_kv_prefix=False,
                       any_cache_when_empty=False, out_may_share=OUT_MAY_BE_Q,
                       device_contiguous=False)


def flash_attention_kv_cache(q, k, v, mask, scale=None, *, q_input_row_offsets=None,
                             kv_input_row_offsets=None, sink_weights=None, out=None,
                             return_lse=False, config=None):
    """Attention of new query tokens over a KV cache, on the CPU (flash attention).

    Query row ``r`` of sequence ``b`` sits at position
    ``q_idx = num_keys(b) - q_len(b) + r`` and attends over keys ``0 .. num_keys(b) - 1``
    that ``mask`` leaves visible: ``out = softmax(scale * q k^T [+ additive]) v``, with
    query head ``h`` reading KV head ``h // (H // Hkv)``.

    Parameters
    ----------
    q : ndarray, float32 or float64
        Padded queries ``[B, S, H, D]``, or ragged ``[T, H, D]`` together with
        ``q_input_row_offsets``.
    k, v : ndarray, ContinuousBatchingKVCache or PagedKVCache
        Keys and values, of ``q``'s dtype: dense ``[B, N, Hkv, D]`` arrays (padded queries;
        ``num_keys = N``), ragged ``[T_kv, Hkv, D]`` arrays (ragged queries; split by
        ``kv_input_row_offsets``, else by ``q_input_row_offsets``), or two caches that
        hold ``cache_lengths[b]`` earlier tokens followed by this step's ``kv_len(b)`` new
        rows (``kv_len = S`` for padded queries; for ragged ones the lengths given by
        ``kv_input_row_offsets``, else by ``q_input_row_offsets``).
    mask : Mask, ndarray or None
        A mask object (``None`` means :class:`~numattn.NullMask`) or an additive tensor
        ``[S, N]``, ``[B, S, N]`` or ``[B, H, S, N]`` indexed by local query row and key
        position: ``S`` is q's ``S`` for padded input (for ragged input, at least the largest
        ``q_len``), and ``N`` at least the largest ``num_keys``.
    scale : float, optional
        Score scale; ``None`` means ``1 / sqrt(D)``.
    q_input_row_offsets : int array [B + 1], optional
        Rows of sequence ``b`` in a ragged ``q``: ``offsets[b]:offsets[b + 1]``.
    kv_input_row_offsets : int array [B + 1], optional
        New K/V rows per sequence (ragged queries only).
    sink_weights : ndarray [H], optional
        One sink logit per query head, counted once in each row's softmax denominator.
    out : ndarray, optional
        C-contiguous array of ``q``'s shape and dtype, written in place and returned.  It
        may be ``q`` itself, but must not share memory with ``k``, ``v``, the mask's
        tensor or ``sink_weights``, nor overlap ``q`` otherwise (``ValueError``).
    return_lse : bool, default False
        Also return the natural-log log-sum-exp of every row, ``[B, S, H]`` or ``[T, H]``.
    config : MHAConfig, optional
        ``block_q`` (query positions per tile) and ``block_k`` (keys per tile).

    Returns
    -------
    out : ndarray
        Same shape and dtype as ``q``; rows with no visible key are 0.
    lse : ndarray
        Only with ``return_lse=True``: ``-inf`` (or the sink logit) for rows with no
        visible key.

    Raises
    ------
    TypeError
        If an argument has the wrong type or dtype.
    ValueError
        If shapes, offsets, cache tables or the mask do not fit together.

    Examples
    --------
    >>> import numpy as np
    >>> from numattn import CausalMask
    >>> from numattn.flash import flash_attention_kv_cache
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((1, 3, 2, 8)).astype(np.float32)
    >>> kv = rng.standard_normal((1, 5, 1, 8)).astype(np.float32)
    >>> out, lse = flash_attention_kv_cache(q, kv, kv, CausalMask(), return_lse=True)
    >>> out.shape, lse.shape
    ((1, 3, 2, 8), (1, 3, 2))
    """
    _check_on_host(q, k, v, mask)
    problem = attention_problem(
        q, k, v, mask, scale, rules=RULES, q_offsets=q_input_row_offsets,
        kv_offsets=kv_input_row_offsets,
        sink_weights=None if sink_weights is None else to_host(sink_weights), out=out,
        return_lse=return_lse, config=config, device="cpu",
    )
    from .kernels.cpu.flash import run_flash_cpu  # kernel modules load at the first call

    result, lse = run_flash_cpu(problem)
    return (result, lse) if return_lse else result


def _check_on_host(q, k, v, mask):
    """This operation runs on the CPU: its arrays must be NumPy arrays (sink weights are
    read back to the host).  ``q`` and ``mask`` may be ``None``: not checked."""
    if q is not None and not isinstance(q, np.ndarray):
        check_array("q", q)
        raise TypeError(
            f"q must be a NumPy array (flash_attention_kv_cache runs on the CPU), got "
            f"{type(q).__name__}"
        )
    for name, x in (("k", k), ("v", v)):
        data = x.blocks if isinstance(x, KVCache) else x
        if hasattr(data, "__cuda_array_interface__") and not isinstance(data, np.ndarray):
            raise TypeError(f"{name} must be held in NumPy arrays (this operation runs on the "
                            "CPU), got a device array")
    additive = None if mask is None else compile_mask(mask)[1]
    if additive is not None and not isinstance(additive, np.ndarray):
        raise TypeError(f"the additive mask must be a NumPy array, got {type(additive).__name__}")
