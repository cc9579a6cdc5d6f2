"""``cross_attention``: ragged queries over the keys of their sequence (seed: MAX's
``mha_cross_gpu_naive``).

Ragged queries ``q [T, H, D]`` split by ``q_input_row_offsets`` attend over the keys of
their sequence: ragged new K/V rows split by ``kv_input_row_offsets``, or a dense,
continuous-batching or paged cache that already holds them after its cached tokens, so
that ``num_keys(b) = cache_len(b) + kv_len(b)``.  Unlike the other operations, query row
``r`` of a sequence sits at ``q_idx = r`` for the masks (it is not bottom-right aligned).

The arguments are checked and normalised by :func:`numattn.core.problem.attention_problem`.
On the CPU this is flash attention with every sequence's first query at position 0
(:func:`numattn.kernels.cpu.flash.run_flash_cpu`); on CUDA the tiled kernel of
:mod:`numattn.kernels.cuda.flash`.
"""

from __future__ import annotations

import numpy as np

from .core.device import check_stream, is_device_array, require_cuda
from .core.dtypes import lse_dtype
from .core.interop import as_arrays
from .core.masks import NullMask
from .core.problem import OUT_APART, OperationRules, attention_problem
from .kernels.flash import run_flash_problem

__all__ = ["cross_attention"]

#: The default mask (a frozen dataclass, safe to share).
NO_MASK = NullMask()

#: Queries at positions 0, 1, ..; dense K/V may serve ragged queries (the first kv_len(b)
#: rows of each sequence); a batch of no sequences reads nothing, so any cache will do; the
#: CUDA kernel accumulates in ``out`` (it shares memory with no input) and reads device
#: arrays as C-contiguous.
RULES = OperationRules(queries_at_start=True, dense_kv_prefix=True, any_cache_when_empty=True,
                       out_may_share=OUT_APART, device_contiguous=True)


def cross_attention(q, q_input_row_offsets, q_max_seq_len, k, v, kv_input_row_offsets,
                    mask=NO_MASK, scale=None, *, score_mod=None, device="auto", out=None,
                    return_lse=False, config=None, stream=None):
    """Attention of ragged queries over ragged K/V rows or a KV cache, with ``q_idx = r``.

    Sequence ``b`` owns query rows ``q_input_row_offsets[b]:q_input_row_offsets[b + 1]``
    and attends over its ``num_keys(b) = cache_len(b) + kv_len(b)`` keys, where
    ``kv_len(b)`` comes from ``kv_input_row_offsets``.  Query row ``r`` of a sequence is at
    position ``q_idx = r`` for the mask (not bottom-right aligned).  GQA: query head ``h``
    reads KV head ``h // (H // Hkv)``.

    Parameters
    ----------
    q : array [T, H, D]
        Queries of all sequences, concatenated; float64, float32, float16 or bfloat16.
    q_input_row_offsets : int array [B + 1]
        Ragged split of ``q`` (``0``, non-decreasing, ending at ``T``).
    q_max_seq_len : int
        Longest query sequence; must be at least every ``q_len(b)``.  Additive masks are
        padded to it.
    k, v : arrays [T_kv, Hkv, D] or [B, N, Hkv, D], or ContinuousBatchingKVCache / PagedKVCache
        Ragged new rows split by ``kv_input_row_offsets``; a dense array whose first
        ``kv_len(b)`` rows of sequence ``b`` are its keys (all ``N`` without offsets); or a
        cache whose ``cache_lengths`` count the tokens before this step, the new rows being
        stored right after them.  Both of one dtype: q's, float8 or int8 (in a cache with
        scales), read as stored.
    kv_input_row_offsets : int array [B + 1] or None
        Ragged split of the new K/V rows, giving ``kv_len(b)``; ``None`` means
        ``kv_len = q_len`` (for dense arrays: all ``N`` rows).
    mask : Mask or ndarray, default NullMask()
        A mask object (seen with ``q_idx = r``) or an additive tensor ``[S, N]``,
        ``[B, S, N]`` or ``[B, H, S, N]`` with ``S >= q_max_seq_len`` and ``N`` at least the
        largest key count (indexed with the local row ``r`` and the key position).
    scale : float, optional
        Score scale; ``None`` means ``1 / sqrt(D)``.
    score_mod : ScoreMod, optional
        Applied to each scaled score before the mask and the softmax
        (:class:`~numattn.ScoreMod`, :func:`~numattn.softcap`, :func:`~numattn.alibi`);
        the LSE is over the modified scores, sink logits are not modified.
    device : {"auto", "cpu", "cuda"}, default "auto"
        ``"auto"`` runs on CUDA when an input is a device array.  Device arrays are used in
        place; NumPy inputs with ``device="cuda"`` are copied over and the result back.
    stream : numba.cuda stream, optional
        For a call that runs on CUDA: the stream its copies and kernels are queued on
        (``None``: the default stream).  Results on the device are ready in that stream's
        order (the call returns without waiting); results on the host are complete when it
        returns.  A stream with a call that runs on the CPU is a ``ValueError``.
    out : array [T, H, D], optional
        Written in place and returned (C-contiguous, ``q``'s dtype or float32).  It must
        not share
        memory with ``q``, ``k``, ``v`` or the mask's tensor (``ValueError``).
    return_lse : bool, default False
        Also return the natural-log log-sum-exp of the scores, ``[T, H]``.
    config : MHAConfig, optional
        Tile sizes (``block_q``, ``block_k``) and CUDA ``threads_per_block``.

    Returns
    -------
    out : array [T, H, D]
        A device array when ``q`` is one, else NumPy (``out`` itself when given).  Rows with
        no visible key are 0.
    lse : array [T, H]
        Only with ``return_lse=True``; ``-inf`` for rows with no visible key.

    Raises
    ------
    TypeError
        If an argument has the wrong type or dtype.
    ValueError
        If shapes, offsets, ``q_max_seq_len``, the cache tables or the mask disagree.
    numattn.CudaUnavailableError
        If CUDA is asked for where there is none.

    Notes
    -----
    A batch of zero sequences returns at once (leaving ``out`` untouched); nothing is read
    then, so the K/V caches may describe any number of sequences.  A sequence with zero
    keys gives 0 (never NaN) and ``lse = -inf``.

    Examples
    --------
    >>> import numpy as np
    >>> from numattn import CausalMask
    >>> from numattn.cross import cross_attention
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((5, 4, 8)).astype(np.float32)  # 2 sequences: 2 + 3 rows
    >>> kv = rng.standard_normal((7, 2, 8)).astype(np.float32)  # 4 + 3 key rows
    >>> out = cross_attention(q, [0, 2, 5], 3, kv, kv, [0, 4, 7], CausalMask())
    >>> out.shape
    (5, 4, 8)
    >>> bool(np.allclose(out[0, :, :], kv[0, [0, 0, 1, 1], :]))  # row 0 sees key 0 only
    True
    """
    if isinstance(q_max_seq_len, (bool, np.bool_)) or not isinstance(
        q_max_seq_len, (int, np.integer)
    ):
        raise TypeError(
            f"q_max_seq_len must be an integer, got {type(q_max_seq_len).__name__}"
        )
    q, k, v, mask, out = as_arrays(q=q, k=k, v=v, mask=mask, out=out)
    problem = attention_problem(
        q, k, v, mask, scale, rules=RULES, q_offsets=q_input_row_offsets,
        kv_offsets=kv_input_row_offsets, q_max_seq_len=q_max_seq_len, out=out,
        return_lse=return_lse, config=config, device=device, score_mod=score_mod,
    )
    stream = check_stream(stream, problem.device)
    if problem.q_offsets.shape[0] == 1:  # no sequence: return at once, out untouched
        return _empty_result(problem)
    result, lse = run_flash_problem(problem, stream)
    return (result, lse) if return_lse else result


def _empty_result(problem):
    """The result of a batch of zero sequences (nothing launched, ``out`` untouched)."""
    shape, dtype = problem.out_shape, problem.result_dtype
    out = problem.out if problem.final_out is None else problem.final_out
    on_device = is_device_array(problem.q if out is None else out)
    empty = require_cuda().device_array if on_device else np.empty
    result = out if out is not None else empty(shape, dtype=dtype)
    return (result, empty(shape[:2], dtype=lse_dtype(dtype))) if problem.return_lse else result
