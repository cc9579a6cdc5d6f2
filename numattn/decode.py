"""``decode_attention``: one new query token per sequence against its KV cache, with split-K.

Token generation attends one query per sequence to a long cache, so the cost is reading the
K and V rows of the live cache once; the arithmetic is light.  The keys of each sequence are
cut into ``num_partitions`` spans aligned to ``config.block_k`` (split-K, "flash-decoding"):
every (sequence, partition) computes a partial softmax state, and a reduction merges them
exactly, with the sink logit counted once.  GQA: each K/V row is read once per KV head and
serves all ``group`` query heads of that head.

This module checks the arguments (:func:`numattn.core.problem.attention_problem`) and
dispatches: the CPU kernels are in :mod:`numattn.kernels.cpu.split_k`, the CUDA kernels in
:mod:`numattn.kernels.cuda.split_k`.
"""

from __future__ import annotations

import numpy as np

from .core.config import resolve_config
from .core.masks import NullMask
from .core.problem import (
    OUT_AFTER_READS,
    OperationRules,
    attention_problem,
)

__all__ = ["decode_attention"]

#: The default mask (a frozen dataclass, safe to share).
NO_MASK = NullMask()

#: Bottom-right aligned queries; dense K/V only with one row per sequence; ``out`` is written
#: by the reduction, after every key was read, so it may be q, k or v (not the sinks).
RULES = OperationRules(queries_at_start=False, dense_kv_prefix=False,
                       any_cache_when_empty=False, out_may_share=OUT_AFTER_READS,
                       device_contiguous=False)


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
    config = resolve_config(config)
    num_partitions = _check_num_partitions(
        config.num_partitions if num_partitions is None else num_partitions
    )
    problem = attention_problem(q, k, v, mask, scale, rules=RULES, one_row=True,
                                sink_weights=sink_weights, out=out, return_lse=return_lse,
                                config=config, device=device)
    result, lse = _run(problem, num_partitions, None)
    return (result, lse) if return_lse else result


def _run(problem, num_partitions, launch):
    """Run a checked problem on its device; on the CPU as ``launch`` says (``None``: as
    :func:`~numattn.kernels.cpu.split_k.decode_launch` says for it).  Returns ``(out, lse)``."""
    if problem.device == "cuda":
        from .kernels.cuda.split_k import run_decode_cuda

        return run_decode_cuda(problem, num_partitions)
    from .kernels.cpu.split_k import decode_launch, run_decode_cpu

    if launch is None:
        launch = decode_launch(problem.layout, problem.q_offsets, problem.q.dtype,
                               problem.config, num_partitions)
    return run_decode_cpu(problem, launch)


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
