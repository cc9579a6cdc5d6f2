"""``decode_attention``: one new query token per sequence against its KV cache, with split-K.

Token generation attends one query per sequence to a long cache, so the cost is reading the
K and V rows of the live cache once; the arithmetic is light.  The keys of each sequence are
cut into ``num_partitions`` spans aligned to ``config.block_k`` (split-K, "flash-decoding"):
every (sequence, partition) computes a partial softmax state, and a reduction merges them
exactly, with the sink logit counted once.  GQA: each K/V row is read once per KV head and
serves all ``group`` query heads of that head.

This module checks the arguments (:func:`numattn.core.problem.attention_problem`) and
dispatches: the CPU kernels are in :mod:`numattn.kernels.cpu.split_k`, the CUDA kernels in
:mod:`numattn.kernels.cuda.split_k`.  :class:`DecodePlan` does the work that depends only
on a step's caches and mask once, for every layer of the step.
"""

from __future__ import annotations

import functools

import numpy as np

from .core.config import resolve_config
from .core.device import check_stream, require_cuda, resolve_device
from .core.interop import as_arrays
from .core.kv_cache import KVCache, PlannedKV
from .core.masks import NullMask, as_mask, compile_mask, mask_functions
from .core.problem import (
    OUT_AFTER_READS,
    OperationRules,
    attention_problem,
    attention_step,
    finish_result,
    layer_problem,
    plan_q_dtype,
)
from .core.validate import check_array, check_kv_dtype, check_q_dtype, shape_of

__all__ = ["DecodePlan", "decode_attention"]

#: The default mask (a frozen dataclass, safe to share).
NO_MASK = NullMask()

#: Bottom-right aligned queries; dense K/V only with one row per sequence; ``out`` is written
#: by the reduction, after every key was read, so it may be q, k or v (not the sinks).
RULES = OperationRules(queries_at_start=False, dense_kv_prefix=False,
                       any_cache_when_empty=False, out_may_share=OUT_AFTER_READS,
                       device_contiguous=False)


def decode_attention(q, k, v, mask=NO_MASK, scale=None, *, sink_weights=None,
                     score_mod=None, num_partitions=None, device="auto", out=None,
                     return_lse=False, config=None, stream=None, _positions=None):
    """Attention of one new query token per sequence over its KV cache (split-K).

    The new token's K and V rows are already in the cache, so sequence ``b`` attends over
    ``num_keys = cache_lengths[b] + 1`` keys (``N`` for dense arrays) and its query sits at
    position ``q_idx = num_keys - 1`` for the mask.

    Parameters
    ----------
    q : ndarray, shape [B, H, D]
        The queries: float64, float32, float16 or bfloat16 (float32 or float64 as a CUDA
        device array with ``device="cuda"``).
    k, v : PagedKVCache, ContinuousBatchingKVCache, or ndarray [B, N, Hkv, D]
        Keys and values: two cache objects sharing ``cache_lengths`` and ``lookup_table``,
        or dense arrays (every sequence has ``N`` keys).  ``H % Hkv == 0``; query head ``h``
        reads KV head ``h // (H // Hkv)``.  Both of one dtype: q's, float8 or int8 (in a
        cache with scales), read as stored ("Storage dtypes" in the concepts page).
    mask : Mask or ndarray, default NullMask()
        Which keys each query sees.  An additive tensor (``MaterializedMask`` or a plain
        array) is ``[1, N]``, ``[B, 1, N]`` or ``[B, H, 1, N]``: one query row per sequence.
    scale : float, optional
        Score scale; ``None`` means ``1 / sqrt(D)``.
    sink_weights : ndarray, shape [H], optional
        One sink logit per query head, counted once in each row's softmax denominator.
    score_mod : ScoreMod, optional
        Applied to each scaled score before the mask and the softmax
        (:class:`~numattn.ScoreMod`, :func:`~numattn.softcap`, :func:`~numattn.alibi`);
        the LSE is over the modified scores, sink logits are not modified.
    num_partitions : int, optional
        Key partitions per sequence (split-K).  ``None`` takes ``config.num_partitions`` or,
        if that is ``None`` too, picks a count from the work size and the number of CPU
        threads or GPU multiprocessors.  A fixed count gives bitwise-repeatable results.
    device : {"auto", "cpu", "cuda"}, default "auto"
        ``"auto"`` runs on CUDA when an input is a device array.  With ``"cuda"``, NumPy
        inputs are copied to the GPU and the results back; device arrays are used in place
        and the results stay on the device.
    stream : numba.cuda stream, optional
        For a call that runs on CUDA: the stream its copies and kernels are queued on
        (``None``: the default stream).  Results on the device are ready in that stream's
        order (the call returns without waiting); results on the host are complete when it
        returns.  A stream with a call that runs on the CPU is a ``ValueError``.
    out : ndarray, shape [B, H, D], optional
        Written in place and returned (C-contiguous, the queries' dtype or float32), once
        every key has
        been read: it may be ``q`` or share memory with ``k`` and ``v``, but not with
        ``sink_weights`` (``ValueError``).
    return_lse : bool, default False
        Also return the log-sum-exp of each row (natural log).
    config : MHAConfig, optional
        ``block_k`` (tile and partition alignment), ``num_partitions`` (default for the
        argument), ``threads_per_block`` (CUDA).
    _positions : (int, int) or (int, int, int), optional
        Internal (:mod:`numattn.dask`): ``(q_offset, k_offset)`` added to the query and key
        positions the mask and score functions see, when ``k`` and ``v`` are a shard of
        longer sequences; a third entry is added to the sequence index they see (a chunk of
        the batch).

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
    q, k, v, mask, out, sink_weights = as_arrays(q=q, k=k, v=v, mask=mask, out=out,
                                                 sink_weights=sink_weights)
    num_partitions = _check_num_partitions(
        config.num_partitions if num_partitions is None else num_partitions
    )
    problem = attention_problem(q, k, v, mask, scale, rules=RULES, one_row=True,
                                sink_weights=sink_weights, out=out, return_lse=return_lse,
                                config=config, device=device, positions=_positions,
                                score_mod=score_mod)
    result, lse = _run(problem, num_partitions, None, check_stream(stream, problem.device))
    return (result, lse) if return_lse else result


class DecodePlan:
    """Decode attention over one step's caches, planned once and run for every layer.

    The layers of a model attend over caches that share one step's ``cache_lengths`` and
    ``lookup_table``.  A plan does once what depends only on those, on the mask and on the
    configuration (as FlashInfer's ``plan()`` does): it checks the tables and the mask,
    fixes the key partitions and the order of the work items.  :meth:`run` then checks only
    what a layer brings (queries, the K/V storage, scale, sinks, ``out``) and runs the
    kernels: the same bits as
    :func:`decode_attention` with the same arguments, configuration and thread count.

    Parameters
    ----------
    k, v : PagedKVCache, ContinuousBatchingKVCache, or ndarray [B, N, Hkv, D]
        The keys and values of any layer of the step.  Every layer's must be of the same
        kind, with storage of the same shape and dtype and, for caches, the same
        ``cache_lengths`` and ``lookup_table`` (the same objects, or equal ones).
    mask : Mask or ndarray, default NullMask()
        As :func:`decode_attention` takes it, for every layer.  A ``[B, H, 1, N]`` additive
        tensor's ``H`` is checked against each layer's queries.
    score_mod : ScoreMod, optional
        As :func:`decode_attention` takes it, for every layer (captured values are read at
        each run).
    num_partitions : int, optional
        Key partitions per sequence, as :func:`decode_attention` takes it.
    device : {"auto", "cpu", "cuda"}, default "auto"
        Where the runs compute; ``"auto"`` decides per run from its arrays, as
        :func:`decode_attention` does.
    config : MHAConfig, optional
        As :func:`decode_attention` takes it.
    q_dtype : dtype, optional
        The dtype of every layer's queries; by default K/V's dtype for float64, float32,
        float16 and bfloat16 K/V, and float32 for float8 and int8 ones.

    Raises
    ------
    TypeError, ValueError
        As :func:`decode_attention` raises them for the same arguments.

    Notes
    -----
    A plan holds one step: once the tables change (the next token, a new page), make a new
    one.  It does not notice tables changed in place after it was made: its runs then keep
    computing the step it was made for (they never read outside the pages).  The split of
    the work among threads is fixed when the plan is made, from the number of threads then.
    On CUDA the step's tables and mask go to the device at the first run and serve every
    later one: a run transfers no table.

    Examples
    --------
    >>> import numpy as np
    >>> from numattn import CausalMask, DecodePlan, PagedKVCache, decode_attention
    >>> rng = np.random.default_rng(0)
    >>> lengths, table = np.array([5, 11]), np.array([[0, 1], [2, 3]])
    >>> def cache():
    ...     return PagedKVCache(rng.standard_normal((4, 8, 2, 16), dtype=np.float32),
    ...                         lengths, table)
    >>> layers = [(cache(), cache()) for _ in range(3)]
    >>> plan = DecodePlan(*layers[0], CausalMask())
    >>> q = rng.standard_normal((2, 4, 16), dtype=np.float32)
    >>> outs = [plan.run(q, k, v) for k, v in layers]
    >>> all(np.array_equal(out, decode_attention(q, k, v, CausalMask()))
    ...     for out, (k, v) in zip(outs, layers))
    True
    """

    def __init__(self, k, v, mask=NO_MASK, *, score_mod=None, num_partitions=None,
                 device="auto", config=None, q_dtype=None):
        config = resolve_config(config)
        k, v, mask = as_arrays(k=k, v=v, mask=mask)
        self._num_partitions = _check_num_partitions(
            config.num_partitions if num_partitions is None else num_partitions
        )
        resolve_device(device, [])  # the name only: the arrays decide per run
        self._device = device
        if isinstance(k, KVCache):
            batch, kv_dtype = k.batch_size, k.dtype
        else:
            check_array("k", k, ndim=4)
            batch, kv_dtype = shape_of(k)[0], check_kv_dtype("k", k)
        mask = as_mask(mask)
        program, tensor = compile_mask(mask)
        step = attention_step(
            k, v, program, tensor, q_offsets=np.arange(batch + 1, dtype=np.int64),
            q_lens=np.ones(batch, dtype=np.int64), max_q_len=1, kv_offsets=None,
            ragged=False, dtype=plan_q_dtype(q_dtype, kv_dtype), num_heads=None,
            config=config, rules=RULES, mask_functions=mask_functions(mask),
            score_mod=score_mod, device="cuda" if device == "cuda" else "cpu",
        )
        self._kv = PlannedKV(k, v, step.layout)
        self._step = step._replace(layout=self._kv.layout)
        self._batch = batch
        self._launch = None
        self._device_tables = None  # the step's tables on the GPU, at the first CUDA run
        if device != "cuda" and isinstance(step.layout.k_blocks, np.ndarray):
            self._cpu_launch(step.layout)

    def _cpu_launch(self, layout):
        """The CPU's :class:`~numattn.kernels.cpu.split_k.DecodeLaunch` of this step, made
        at the first need."""
        if self._launch is None:
            from .kernels.cpu.split_k import decode_launch

            step = self._step
            self._launch = decode_launch(layout, step.q_offsets, step.dtype, step.config,
                                         self._num_partitions)
        return self._launch

    def _cuda_tables(self, layout):
        """The step's cache tables and mask program on the device, copied at the first CUDA
        run and used by every later one (no per-layer transfer)."""
        if self._device_tables is None:
            from .kernels.cuda.split_k import step_tables_to_device

            cuda = require_cuda()
            self._device_tables = step_tables_to_device(layout, self._step.mask.program,
                                                        cuda.to_device)
        return self._device_tables

    def _check_queries(self, q):
        """Refuse queries that are not ``[B, H, D]`` of the plan's dtype and batch."""
        check_array("q", q, ndim=3)
        dtype = check_q_dtype("q", q)
        if dtype != self._step.q_dtype:
            raise TypeError(f"q must have the plan's q_dtype {self._step.q_dtype}, got {dtype}")
        if shape_of(q)[0] != self._batch:
            raise ValueError(f"q must have B = {self._batch} rows, one per sequence of the "
                             f"plan, got shape {list(shape_of(q))}")
        if shape_of(q)[2] < 1:
            raise ValueError(f"q must have a head dimension D >= 1, got shape "
                             f"{list(shape_of(q))}")

    def run(self, q, k, v, *, scale=None, sink_weights=None, out=None, return_lse=False,
            stream=None):
        """Decode attention of one layer.

        Parameters
        ----------
        q : ndarray, shape [B, H, D]
            The layer's queries, of the plan's dtype.
        k, v : caches or arrays
            The layer's keys and values, as the plan's (see :class:`DecodePlan`).
        scale, sink_weights, out, return_lse, stream
            As :func:`decode_attention` takes them.

        Returns
        -------
        out : ndarray, shape [B, H, D]
        lse : ndarray, shape [B, H]
            Only with ``return_lse=True``.

        Raises
        ------
        TypeError, ValueError
            As :func:`decode_attention` raises them; ``ValueError`` also if ``k`` or ``v``
            is not what the plan was made for.  Nothing is written then.
        """
        step = self._step
        q, k, v, out, sink_weights = as_arrays(q=q, k=k, v=v, out=out,
                                               sink_weights=sink_weights)
        if not (type(q) is np.ndarray and q.ndim == 3 and q.dtype == step.q_dtype
                and q.shape[0] == self._batch and q.shape[2] > 0):
            self._check_queries(q)
        if return_lse is not False and return_lse is not True and not isinstance(
                return_lse, np.bool_):
            raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
        layout = self._kv.layout_of(k, v)
        device = "cpu"
        if self._device == "cuda" or not (
                type(q) is np.ndarray and type(layout.k_blocks) is np.ndarray
                and (out is None or type(out) is np.ndarray)
                and (sink_weights is None or type(sink_weights) is np.ndarray)
                and type(step.mask.additive) is np.ndarray):
            device = resolve_device(self._device, [q, layout.k_blocks, layout.v_blocks, out,
                                                   sink_weights, step.mask.additive])
        problem = layer_problem(step, q, layout, scale, sink_weights, out, return_lse, device)
        stream = check_stream(stream, device)
        if device == "cuda":
            result, lse = _run(problem, self._num_partitions, None, stream,
                               self._cuda_tables(layout))
        else:
            result, lse = _run(problem, self._num_partitions,
                               self._launch or self._cpu_launch(layout))
        return (result, lse) if return_lse else result


def _run(problem, num_partitions, launch, stream=0, device_tables=None):
    """Run a checked problem on its device; on the CPU as ``launch`` says (``None``: as
    :func:`~numattn.kernels.cpu.split_k.decode_launch` says for it), on CUDA queued on
    ``stream`` (with a plan's ``device_tables``, if any).  Returns ``(out, lse)``."""
    if problem.device == "cuda":
        from .kernels.cpu.function_tiles import with_tile_tables
        from .kernels.cuda.split_k import run_decode_cuda

        return finish_result(problem, *run_decode_cuda(with_tile_tables(problem),
                                                       num_partitions, stream, device_tables))
    if launch is None:
        from .kernels.cpu.split_k import decode_launch

        launch = decode_launch(problem.layout, problem.q_offsets, problem.dtype,
                               problem.config, num_partitions)
    return finish_result(problem, *_cpu_driver()(problem, launch))


@functools.cache
def _cpu_driver():
    """The CPU decode driver with its 16-bit conversions, imported at the first call only
    (an import statement at every call costs about 1 us)."""
    from .kernels.cpu.convert import on_cpu
    from .kernels.cpu.split_k import run_decode_cpu

    return functools.partial(on_cpu, run_decode_cpu)


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
