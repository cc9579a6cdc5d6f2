"""``decode_attention``: one new query token per sequence against its KV cache, with split-K.

Token generation attends one query per sequence to a long cache, so the cost is reading the
K and V rows of the live cache once; the arithmetic is light.  The keys of each sequence are
cut into ``num_partitions`` spans aligned to ``config.block_k`` (split-K, "flash-decoding"):
every (sequence, partition) computes a partial softmax state, and a reduction merges them
exactly, with the sink logit counted once.  GQA: each K/V row is read once per KV head and
serves all ``group`` query heads of that head.

This module checks the arguments and dispatches: the CPU kernels are in
:mod:`numattn.kernels.cpu.split_k`, the CUDA kernels in :mod:`numattn.kernels.cuda.split_k`.
"""

from __future__ import annotations

import numpy as np

from .core.config import resolve_config
from .core.device import resolve_device
from .core.kv_cache import KVCache, resolve_kv
from .core.masks import NullMask, additive_4d, compile_mask
from .core.problem import DecodeArgs
from .core.validate import (
    check_array,
    check_float_dtype,
    check_heads,
    check_no_overlap,
    check_out,
    check_scale,
    check_sink_weights,
    shape_of,
)

__all__ = ["decode_attention"]

#: The default mask (a frozen dataclass, safe to share).
NO_MASK = NullMask()


def decode_attention(q, k, v, mask=NO_MASK, scale=None, *, sink_weights=None,
                     num_partitions=None, device="auto", out=None, return_lse=False,
                     config=None):
    """Attention of one new query token per sequence over its KV cache (split-K).

    The new token's K and V rows are already in the cache, so sequence ``b`` attends over
    ``num_keys = cache_lengths[b] + 1`` keys (``N`` for dense arrays) and its query sits at
    position ``q_idx = num_keys - 1`` for the mask.

    Parameters
    ----------
    q : ndarray, shape [B, H, D]
        The queries, float32 or float64 (a CUDA device array with ``device="cuda"``).
    k, v : PagedKVCache, ContinuousBatchingKVCache, or ndarray [B, N, Hkv, D]
        Keys and values: two cache objects sharing ``cache_lengths`` and ``lookup_table``,
        or dense arrays (every sequence has ``N`` keys).  ``H % Hkv == 0``; query head ``h``
        reads KV head ``h // (H // Hkv)``.  Same dtype as ``q``.
    mask : Mask or ndarray, default NullMask()
        Which keys each query sees.  An additive tensor (``MaterializedMask`` or a plain
        array) is ``[1, N]``, ``[B, 1, N]`` or ``[B, H, 1, N]``: one query row per sequence.
    scale : float, optional
        Score scale; ``None`` means ``1 / sqrt(D)``.
    sink_weights : ndarray, shape [H], optional
        One sink logit per query head, counted once in each row's softmax denominator.
    num_partitions : int, optional
        Key partitions per sequence (split-K).  ``None`` takes ``config.num_partitions`` or,
        if that is ``None`` too, picks a count from the work size and the number of CPU
        threads or GPU multiprocessors.  A fixed count gives bitwise-repeatable results.
    device : {"auto", "cpu", "cuda"}, default "auto"
        ``"auto"`` runs on CUDA when an input is a device array.  With ``"cuda"``, NumPy
        inputs are copied to the GPU and the results back; device arrays are used in place
        and the results stay on the device.
    out : ndarray, shape [B, H, D], optional
        Written in place and returned (C-contiguous, the queries' dtype), once every key has
        been read: it may be ``q`` or share memory with ``k`` and ``v``, but not with
        ``sink_weights`` (``ValueError``).
    return_lse : bool, default False
        Also return the log-sum-exp of each row (natural log).
    config : MHAConfig, optional
        ``block_k`` (tile and partition alignment), ``num_partitions`` (default for the
        argument), ``threads_per_block`` (CUDA).

    Returns
    -------
    out : ndarray, shape [B, H, D]
    lse : ndarray, shape [B, H]
        Only with ``return_lse=True``: ``-inf`` for a row with no visible key (the sink
        logit with sinks).

    Raises
    ------
    TypeError
        If an argument has the wrong type or dtype.
    ValueError
        If shapes disagree, ``num_partitions`` is not >= 1, or a cache cannot hold the
        keys it is asked for.
    numattn.CudaUnavailableError
        If ``device="cuda"`` and no GPU (or simulator) is available.

    Examples
    --------
    >>> import numpy as np
    >>> from numattn import CausalMask, PagedKVCache, reference
    >>> from numattn.decode import decode_attention
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((2, 4, 8)).astype(np.float32)
    >>> pages = rng.standard_normal((2, 5, 6, 2, 8)).astype(np.float32)
    >>> table = np.array([[0, 1], [3, 4]])
    >>> k = PagedKVCache(pages[0], np.array([7, 10]), table)
    >>> v = PagedKVCache(pages[1], np.array([7, 10]), table)
    >>> out = decode_attention(q, k, v, CausalMask(), num_partitions=2)
    >>> bool(np.allclose(out, reference.decode_attention(q, k, v, CausalMask()), atol=1e-5))
    True
    """
    check_array("q", q, ndim=3)
    dtype = check_float_dtype("q", q)
    batch, num_heads, head_dim = shape_of(q)
    if head_dim < 1:
        raise ValueError(f"q must be [B, H, D] with D >= 1, got shape {list(shape_of(q))}")
    config = resolve_config(config)
    num_partitions = _check_num_partitions(
        config.num_partitions if num_partitions is None else num_partitions
    )
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if not isinstance(k, KVCache):
        check_array("k", k, ndim=4)
        check_array("v", v, ndim=4)
    layout = resolve_kv(k, v, batch=batch, dtype=dtype, kv_lens=np.ones(batch, np.int64))
    if layout.head_dim != head_dim:
        raise ValueError(
            f"k and v must have head dimension D = {head_dim} (from q), got {layout.head_dim}"
        )
    check_heads(num_heads, layout.num_kv_heads)
    scale = check_scale(scale, head_dim, dtype)
    sinks = check_sink_weights(sink_weights, num_heads, dtype)
    program, tensor = compile_mask(mask)
    max_keys = layout.max_keys
    additive = additive_4d(tensor, batch=batch, num_heads=num_heads, max_q_len=1,
                           max_keys=max_keys, dtype=dtype, exact_rows=True)
    device = resolve_device(
        device, [q, layout.k_blocks, layout.v_blocks, tensor, out, sink_weights]
    )
    out = check_out(out, (batch, num_heads, head_dim), dtype)
    # out may be q, k or v: every key is read before the reduction writes out
    check_no_overlap(out, {"sink_weights": sinks})
    args = DecodeArgs(layout, program, tensor is not None, additive,
                       sinks if sinks is not None else np.zeros(num_heads, dtype),
                       sinks is not None, dtype.type(scale), config, max_keys)
    if device == "cuda":
        from .kernels.cuda.split_k import run_decode_cuda as run
    else:
        from .kernels.cpu.split_k import run_decode_cpu as run
    result, lse = run(q, args, num_partitions, out)
    return (result, lse) if return_lse else result



def _check_num_partitions(num_partitions):
    if num_partitions is None:
        return None
    if isinstance(num_partitions, (bool, np.bool_)) or not isinstance(
        num_partitions, (int, np.integer)
    ):
        raise TypeError(
            f"num_partitions must be an integer >= 1 or None, got "
            f"{type(num_partitions).__name__}"
        )
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be an integer >= 1, got {num_partitions}")
    return int(num_partitions)
