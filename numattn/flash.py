"""``flash_attention_kv_cache``: blocked (flash) attention over KV caches.

Checks the arguments and normalises every input form (padded BSHD or ragged queries; dense,
ragged, continuous-batching or paged K/V) to one ragged problem over the paged addressing
of :func:`numattn.core.kv_cache.resolve_kv` (:func:`numattn.core.problem.attention_problem`),
and runs it through :func:`numattn.kernels.flash.run_flash_problem` (the CPU or the CUDA
kernel, shared with cross attention).
:class:`FlashPlan` does the work that depends only on a step's row offsets, caches and mask
once, for every layer of the step.
"""

from __future__ import annotations

import numpy as np

from .core.config import resolve_config
from .core.device import check_stream, resolve_device
from .core.interop import as_arrays
from .core.kv_cache import KVCache, PlannedKV
from .core.masks import as_mask, compile_mask, mask_functions
from .core.problem import (
    OUT_MAY_BE_Q,
    OperationRules,
    attention_problem,
    attention_step,
    check_device_contiguous,
    layer_problem,
    on_host,
    plan_q_dtype,
)
from .core.validate import (
    check_array,
    check_kv_dtype,
    check_row_offsets,
    dtype_of,
    host_int_array,
    row_counts,
    shape_of,
)
from .kernels.flash import run_flash_problem

__all__ = ["FlashPlan", "flash_attention_kv_cache"]

#: Bottom-right aligned queries; plain K/V as rows with ragged queries, dense with padded
#: ones; ``out`` may be q itself (a tile of queries is read before its outputs are written;
#: on CUDA the result goes there once every query was read); device arrays C-contiguous.
RULES = OperationRules(queries_at_start=False, dense_kv_prefix=False,
                       any_cache_when_empty=False, out_may_share=OUT_MAY_BE_Q,
                       device_contiguous=True)


def flash_attention_kv_cache(q, k, v, mask, scale=None, *, q_input_row_offsets=None,
                             kv_input_row_offsets=None, sink_weights=None, score_mod=None,
                             out=None, return_lse=False, config=None, device="auto",
                             stream=None, _positions=None):
    """Attention of new query tokens over a KV cache, on the CPU (flash attention).

    Query row ``r`` of sequence ``b`` sits at position
    ``q_idx = num_keys(b) - q_len(b) + r`` and attends over keys ``0 .. num_keys(b) - 1``
    that ``mask`` leaves visible: ``out = softmax(scale * q k^T [+ additive]) v``, with
    query head ``h`` reading KV head ``h // (H // Hkv)``.

    Parameters
    ----------
    q : ndarray, float64, float32, float16 or bfloat16
        Padded queries ``[B, S, H, D]``, or ragged ``[T, H, D]`` together with
        ``q_input_row_offsets``.  (Tensors of other libraries: see "Storage dtypes" in
        the concepts page.)
    k, v : ndarray, ContinuousBatchingKVCache or PagedKVCache
        Keys and values, both of one dtype: q's, float8 or int8 (in a cache with scales),
        read as stored (float32 arithmetic unless q and K/V are float64): dense
        ``[B, N, Hkv, D]`` arrays (padded queries; ``num_keys = N``), ragged
        ``[T_kv, Hkv, D]`` arrays (ragged queries; split by ``kv_input_row_offsets``, else
        by ``q_input_row_offsets``), or two caches that
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
    score_mod : ScoreMod, optional
        Applied to each scaled score before the mask and the softmax
        (:class:`~numattn.ScoreMod`, :func:`~numattn.softcap`, :func:`~numattn.alibi`);
        the LSE is over the modified scores, sink logits are not modified.
    out : ndarray, optional
        C-contiguous array of ``q``'s shape and dtype (or float32), written in place and
        returned.  It
        may be ``q`` itself, but must not share memory with ``k``, ``v``, the mask's
        tensor or ``sink_weights``, nor overlap ``q`` otherwise (``ValueError``).
    return_lse : bool, default False
        Also return the natural-log log-sum-exp of every row, ``[B, S, H]`` or ``[T, H]``.
    config : MHAConfig, optional
        ``block_q`` (query positions per tile) and ``block_k`` (keys per tile).
    device : {"auto", "cpu", "cuda"}, default "auto"
        ``"auto"`` runs on CUDA when an input is a device array (C-contiguous there).  With
        ``"cuda"``, NumPy inputs are copied to the GPU and the results back; device arrays
        are used in place and the results stay on the device.
    stream : numba.cuda stream, optional
        For a call that runs on CUDA: the stream its copies and kernels are queued on
        (``None``: the default stream).  Results on the device are ready in that stream's
        order (the call returns without waiting); results on the host are complete when it
        returns.  A stream with a call that runs on the CPU is a ``ValueError``.
    _positions : (int, int) or (int, int, int), optional
        Internal (:mod:`numattn.dask`): ``(q_offset, k_offset)`` added to the query and key
        positions the mask and score functions see, when ``k`` and ``v`` are a shard of
        longer sequences; a third entry is added to the sequence index they see (a chunk of
        the batch).

    Returns
    -------
    out : ndarray
        Same shape and dtype as ``q``; rows with no visible key are 0.  Float32 or float64
        arithmetic rounded to q's dtype.
    lse : ndarray
        Only with ``return_lse=True``: ``-inf`` (or the sink logit) for rows with no
        visible key.

    Raises
    ------
    TypeError
        If an argument has the wrong type or dtype.
    ValueError
        If shapes, offsets, cache tables or the mask do not fit together.
    numattn.CudaUnavailableError
        If ``device="cuda"`` and no GPU (or simulator) is available.

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
    q, k, v, mask, out, sink_weights = as_arrays(q=q, k=k, v=v, mask=mask, out=out,
                                                 sink_weights=sink_weights)
    problem = attention_problem(
        q, k, v, mask, scale, rules=RULES, q_offsets=q_input_row_offsets,
        kv_offsets=kv_input_row_offsets, sink_weights=sink_weights, out=out,
        return_lse=return_lse, config=config, device=device, positions=_positions,
        score_mod=score_mod,
    )
    result, lse = run_flash_problem(problem, check_stream(stream, problem.device))
    return (result, lse) if return_lse else result


class FlashPlan:
    """Flash attention over one step's ragged queries and caches, planned once and run for
    every layer.

    The layers of a model attend with the same row offsets over caches that share one
    step's ``cache_lengths`` and ``lookup_table``.  A plan does once what depends only on
    those, on the mask and on the configuration (as FlashInfer's ``plan()`` does): it checks
    the offsets, the tables and the mask, and deals the work items to the threads.
    :meth:`run` then checks only what a layer brings
    (queries, the K/V storage, scale, sinks, ``out``) and runs the kernel: the same bits as
    :func:`flash_attention_kv_cache` with the same arguments, configuration and thread
    count.

    Parameters
    ----------
    k, v : PagedKVCache, ContinuousBatchingKVCache, or ndarray [T_kv, Hkv, D]
        The keys and values of any layer of the step (caches that hold this step's rows
        already, or the step's ragged rows).  Every layer's must be of the same kind, with
        storage of the same shape and dtype and, for caches, the same ``cache_lengths`` and
        ``lookup_table`` (the same objects, or equal ones).
    mask : Mask, ndarray or None
        As :func:`flash_attention_kv_cache` takes it, for every layer.
    q_input_row_offsets : int array [B + 1]
        Rows of each sequence in the ragged queries ``[T, H, D]`` of every layer.
    kv_input_row_offsets : int array [B + 1], optional
        New K/V rows per sequence, as :func:`flash_attention_kv_cache` takes them.
    score_mod : ScoreMod, optional
        As :func:`flash_attention_kv_cache` takes it, for every layer (captured values are
        read at each run).
    device : {"auto", "cpu", "cuda"}, default "auto"
        Where the runs compute; ``"auto"`` decides per run from its arrays, as
        :func:`flash_attention_kv_cache` does.
    config : MHAConfig, optional
        As :func:`flash_attention_kv_cache` takes it.
    q_dtype : dtype, optional
        The dtype of every layer's queries; by default K/V's dtype for float64, float32,
        float16 and bfloat16 K/V, and float32 for float8 and int8 ones.

    Raises
    ------
    TypeError, ValueError
        As :func:`flash_attention_kv_cache` raises them for the same arguments.

    Notes
    -----
    A plan holds one step: once the offsets or tables change, make a new one.  It does not
    notice tables changed in place after it was made: its runs then keep computing the step
    it was made for (they never read outside the pages).  The split of the work among
    threads is fixed when the plan is made, from the number of threads then.  On CUDA the
    step's offsets, work items, tables and mask go to the device at the first run and serve
    every later one: a run transfers no table.

    Examples
    --------
    >>> import numpy as np
    >>> from numattn import CausalMask, FlashPlan, PagedKVCache, flash_attention_kv_cache
    >>> rng = np.random.default_rng(0)
    >>> offsets = np.array([0, 3, 5])  # 3 and 2 new tokens after 4 and 9 cached ones
    >>> lengths, table = np.array([4, 9]), np.array([[0, 1], [2, 3]])
    >>> def cache():
    ...     return PagedKVCache(rng.standard_normal((4, 8, 2, 16), dtype=np.float32),
    ...                         lengths, table)
    >>> layers = [(cache(), cache()) for _ in range(3)]
    >>> plan = FlashPlan(*layers[0], CausalMask(), q_input_row_offsets=offsets)
    >>> q = rng.standard_normal((5, 4, 16), dtype=np.float32)
    >>> outs = [plan.run(q, k, v) for k, v in layers]
    >>> all(np.array_equal(out, flash_attention_kv_cache(q, k, v, CausalMask(),
    ...                                                  q_input_row_offsets=offsets))
    ...     for out, (k, v) in zip(outs, layers))
    True
    """

    def __init__(self, k, v, mask, *, q_input_row_offsets, kv_input_row_offsets=None,
                 score_mod=None, device="auto", config=None, q_dtype=None):
        config = resolve_config(config)
        k, v, mask = as_arrays(k=k, v=v, mask=mask)
        resolve_device(device, [])  # the name only: the arrays decide per run
        self._device = device
        if isinstance(k, KVCache):
            kv_dtype = k.dtype
        else:
            check_array("k", k)
            kv_dtype = check_kv_dtype("k", k)
        dtype = plan_q_dtype(q_dtype, kv_dtype)
        offsets = host_int_array("q_input_row_offsets", q_input_row_offsets)
        self._total = int(offsets[-1]) if offsets.shape[0] else 0
        q_offsets = check_row_offsets("q_input_row_offsets", offsets, self._total,
                                      "its last entry")
        q_lens = row_counts(q_offsets)
        mask = as_mask(mask)
        program, tensor = compile_mask(mask)
        step = attention_step(
            k, v, program, tensor, q_offsets=q_offsets, q_lens=q_lens,
            max_q_len=int(q_lens.max(initial=0)), kv_offsets=kv_input_row_offsets,
            ragged=True, dtype=dtype, num_heads=None, config=config, rules=RULES,
            mask_functions=mask_functions(mask), score_mod=score_mod,
            device="cuda" if device == "cuda" else "cpu",
        )
        self._kv = PlannedKV(k, v, step.layout)
        self._step = step._replace(layout=self._kv.layout)
        self._items = None
        self._device_tables = {}  # the step's tables on the GPU, by tile rows, at need
        if device != "cuda" and isinstance(step.layout.k_blocks, np.ndarray):
            self._cpu_items()

    def _cpu_items(self):
        """The CPU kernel's work items of this step, dealt at the first need."""
        if self._items is None:
            from .kernels.cpu.flash import work_items

            self._items = work_items(self._step)
        return self._items

    def run(self, q, k, v, *, scale=None, sink_weights=None, out=None, return_lse=False,
            stream=None):
        """Flash attention of one layer.

        Parameters
        ----------
        q : ndarray, shape [T, H, D]
            The layer's ragged queries, of the plan's dtype, split by the plan's
            ``q_input_row_offsets``.
        k, v : caches or arrays
            The layer's keys and values, as the plan's (see :class:`FlashPlan`).
        scale, sink_weights, out, return_lse, stream
            As :func:`flash_attention_kv_cache` takes them.

        Returns
        -------
        out : ndarray, shape [T, H, D]
        lse : ndarray, shape [T, H]
            Only with ``return_lse=True``.

        Raises
        ------
        TypeError, ValueError
            As :func:`flash_attention_kv_cache` raises them; ``ValueError`` also if ``k``
            or ``v`` is not what the plan was made for.  Nothing is written then.
        """
        step = self._step
        q, k, v, out, sink_weights = as_arrays(q=q, k=k, v=v, out=out,
                                               sink_weights=sink_weights)
        check_array("q", q, ndim=3)
        if dtype_of(q) != step.q_dtype:
            raise TypeError(f"q must have the plan's q_dtype {step.q_dtype}, got {dtype_of(q)}")
        if shape_of(q)[0] != self._total:
            raise ValueError(f"q must have T = {self._total} rows, as the plan's "
                             f"q_input_row_offsets, got shape {list(shape_of(q))}")
        if shape_of(q)[2] < 1:
            raise ValueError(f"q must have a head dimension D >= 1, got shape "
                             f"{list(shape_of(q))}")
        if not isinstance(return_lse, (bool, np.bool_)):
            raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
        layout = self._kv.layout_of(k, v)
        arrays = [q, layout.k_blocks, layout.v_blocks, out, sink_weights, step.mask.additive]
        device = "cpu" if self._device != "cuda" and on_host(arrays) else resolve_device(
            self._device, arrays)
        stream = check_stream(stream, device)
        if device == "cuda":
            for name, x in (("q", q), ("k", layout.k_blocks), ("v", layout.v_blocks),
                            ("out", out), ("mask", step.mask.additive)):
                check_device_contiguous(name, x)
        problem = layer_problem(step, q, layout, scale, sink_weights, out, return_lse, device)
        items = self._cpu_items() if device != "cuda" else None
        result, lse = run_flash_problem(problem, stream, self._device_tables, items)
        return (result, lse) if return_lse else result
