"""Attention over KV caches sharded across Dask workers.

``numattn.dask`` runs :func:`numattn.flash_attention_kv_cache` and
:func:`numattn.decode_attention` on padded dense inputs held as :mod:`dask.array` arrays,
chunked along the batch ``B`` and the keys ``N``: every chunk of keys is attended where it
lives (one task per (batch chunk, key chunk), and per piece of the queries for flash, that
calls the single-process CPU operation on its blocks, with ``return_lse=True``), and the
partial results are combined with :func:`numattn.merge_states` in a tree of pairs
(``ceil(log2(key chunks))`` levels deep).  K and V never move (:class:`KVPlacement` runs
each task where its chunk is): what travels is each task's partial output and log-sum-exp,
``B S H (D + 1)`` numbers per key chunk, and the queries (NumPy queries of a megabyte or
more sent straight to a worker when a distributed ``Client`` is the default scheduler).

The masks see the global positions: the task over keys ``[n0, n1)`` of ``N`` shifts its
keys by ``n0`` and its queries to ``N - S + r`` (decode: ``N - 1``), so a mask whose
windows or chunks cross a chunk boundary gives what it gives on one machine.  The
functions of :class:`~numattn.FunctionMask` masks and of ``score_mod`` see them too, and
the global sequence index ``b`` (the task over a batch chunk that starts at ``b0`` shifts
its sequences by ``b0``), so a function that reads a captured ``[B, ...]`` array by ``b``
reads the row of its sequence.  The functions and their captures travel to the workers
with the tasks (pickled by Dask, functions by reference to their module where it can be
imported there, by value otherwise).

Dask is an optional dependency (``pip install .[dask]``); ``import numattn`` does not
import this module.  See the documentation page "Beyond one machine".
"""

from __future__ import annotations

try:
    import dask
    import dask.array as da
    from dask.base import tokenize
    from dask.highlevelgraph import HighLevelGraph
except ImportError as exc:  # pragma: no cover - exercised without dask
    raise ImportError(
        "numattn.dask needs Dask's arrays and distributed scheduler: the dask extra, "
        "pip install .[dask] in numattn's checkout"
    ) from exc

import functools
import warnings

import numpy as np

try:
    from distributed.diagnostics.plugin import SchedulerPlugin
except ImportError:  # pragma: no cover - dask without distributed: no Client, no plugin
    SchedulerPlugin = object

from .core.dtypes import SIXTEEN_BIT_NAMES, compute_dtype, lse_dtype
from .core.functions import bind_functions
from .core.masks import (
    AndMask,
    MaterializedMask,
    NullMask,
    OrMask,
    additive_4d,
    as_mask,
    compile_mask,
    mask_functions,
)
from .core.validate import (
    check_heads,
    check_kv_dtype,
    check_q_dtype,
    check_scale,
    check_sink_weights,
)
from .decode import decode_attention as _decode_attention
from .flash import flash_attention_kv_cache as _flash_attention_kv_cache
from .merge import merge_states

__all__ = ["KVPlacement", "decode_attention", "flash_attention_kv_cache"]

#: The default mask of decode (a frozen dataclass, safe to share).
NO_MASK = NullMask()
#: NumPy inputs this large are scattered to a worker rather than put in the graph
#: (figures: "Beyond one machine" in docs/performance.rst).
SCATTER_BYTES = 1 << 20
#: The name of the partial-state tasks (fused tasks' names start with it too), which
#: :class:`KVPlacement` places where their K/V chunks are.
PARTIAL_STATE_NAME = "numattn-partial-state"
#: The ids of the clients whose schedulers have :class:`KVPlacement`.
_PLACED_CLIENTS = set()


def flash_attention_kv_cache(q, k, v, mask, scale=None, *, sink_weights=None, score_mod=None,
                             return_lse=False):
    """Flash attention of padded queries over keys and values sharded as Dask arrays.

    Computes what :func:`numattn.flash_attention_kv_cache` computes on the same data: query
    row ``r`` sits at position ``N - S + r`` and attends over keys ``0 .. N - 1`` that
    ``mask`` leaves visible.  Each chunk of keys is attended by a task on the worker that
    holds it, and the parts are merged with :func:`numattn.merge_states`.

    Parameters
    ----------
    q : dask.array.Array or ndarray, shape [B, S, H, D]
        float64, float32, float16 or bfloat16 (the result's dtype).
        The queries.  Rechunked to K/V's chunks along ``B`` and whole along ``H`` and
        ``D``; along ``S`` chunked as given or, given whole, cut into pieces of at most
        half a key chunk's K and V bytes (so that each task runs where its K/V chunk is,
        and the queries travel to it).
    k, v : dask.array.Array, shape [B, N, Hkv, D]
        Keys and values of one dtype (a query dtype, float8_e4m3fn or float8_e5m2; int8
        needs the scales of a cache object) with the same chunks, chunked along ``B``
        and/or ``N`` only (one chunk along ``Hkv`` and ``D``).  NumPy arrays are taken as
        one chunk.  Each task reads its chunk in the stored type; partial states are
        float32 (float64 for float64 queries) and the merged result is rounded to ``q``'s
        dtype once.
    mask : Mask, ndarray, dask.array.Array or None
        As :func:`numattn.flash_attention_kv_cache` takes it, evaluated at global
        positions (a :class:`~numattn.FunctionMask` also at global sequence indices
        ``b``).  An additive tensor (``[S, N]``, ``[B, S, N]`` or ``[B, H, S, N]``; plain,
        Dask or in a :class:`~numattn.MaterializedMask`) is cut along ``B`` and ``N`` like
        K/V, each task reading its own block.
    scale : float, optional
        Score scale; ``None`` means ``1 / sqrt(D)``.
    sink_weights : array [H], optional
        One sink logit per query head, counted once (given to the task of the first key
        chunk of each batch chunk).
    score_mod : ScoreMod, optional
        As :func:`numattn.flash_attention_kv_cache` takes it (``softcap(cap)``,
        ``alibi(slopes)`` or a :class:`~numattn.ScoreMod` of your own), its function
        evaluated at global positions and sequence indices like the mask's functions.
    return_lse : bool, default False
        Also return the log-sum-exp of each row, ``[B, S, H]``.

    Returns
    -------
    out : dask.array.Array, shape [B, S, H, D]
        Lazy; chunked along ``B`` like K/V.
    lse : dask.array.Array, shape [B, S, H]
        Only with ``return_lse=True``.

    Raises
    ------
    TypeError
        If an argument has the wrong type or dtype, ``score_mod`` is not a
        :class:`~numattn.ScoreMod`, or Numba cannot compile a :class:`~numattn.FunctionMask`
        or ``score_mod`` function for the call's argument types; before any task runs.
    ValueError
        If shapes disagree, K/V are chunked along ``Hkv`` or ``D``, or ``k`` and ``v`` have
        different chunks; before any task runs.

    Examples
    --------
    >>> import dask.array as da
    >>> import numpy as np
    >>> import numattn
    >>> import numattn.dask
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((2, 3, 4, 8), dtype=np.float32)
    >>> k, v = rng.standard_normal((2, 2, 10, 2, 8), dtype=np.float32)
    >>> kd, vd = (da.from_array(x, chunks=(1, 4, 2, 8)) for x in (k, v))
    >>> mask = numattn.SlidingWindowCausalMask(5)
    >>> out = numattn.dask.flash_attention_kv_cache(q, kd, vd, mask)
    >>> out
    dask.array<getitem, shape=(2, 3, 4, 8), dtype=float32, chunksize=(1, 2, 4, 8), ...>
    >>> expected = numattn.flash_attention_kv_cache(q, k, v, mask)
    >>> bool(np.allclose(out.compute(scheduler="threads"), expected, atol=1e-6))
    True
    """
    return _sharded("flash", q, k, v, mask, scale, sink_weights, score_mod, return_lse)


def decode_attention(q, k, v, mask=NO_MASK, scale=None, *, sink_weights=None,
                     score_mod=None, return_lse=False):
    """Decode attention of one query per sequence over keys and values sharded as Dask
    arrays.

    Computes what :func:`numattn.decode_attention` computes on the same data: sequence
    ``b``'s query sits at position ``N - 1`` and attends over keys ``0 .. N - 1`` that
    ``mask`` leaves visible.  Each chunk of keys is attended by a task on the worker that
    holds it (the single-process operation, with its split-K inside the chunk), and the
    parts are merged with :func:`numattn.merge_states`; only ``B H (D + 1)`` numbers per key
    chunk travel.

    Parameters
    ----------
    q : dask.array.Array or ndarray, shape [B, H, D]
        float64, float32, float16 or bfloat16 (the result's dtype).  The queries,
        rechunked to K/V's chunks along ``B`` (whole along ``H`` and ``D``).
    k, v : dask.array.Array, shape [B, N, Hkv, D]
        Keys and values of one dtype with the same chunks, as
        :func:`flash_attention_kv_cache` takes them.
    mask : Mask, ndarray, dask.array.Array, default NullMask()
        As :func:`numattn.decode_attention` takes it, evaluated at global positions (a
        :class:`~numattn.FunctionMask` also at global sequence indices ``b``); an
        additive tensor is ``[1, N]``, ``[B, 1, N]`` or ``[B, H, 1, N]``.
    scale : float, optional
        Score scale; ``None`` means ``1 / sqrt(D)``.
    sink_weights : array [H], optional
        One sink logit per query head, counted once.
    score_mod : ScoreMod, optional
        As :func:`numattn.decode_attention` takes it, its function evaluated at global
        positions and sequence indices like the mask's functions.
    return_lse : bool, default False
        Also return the log-sum-exp of each row, ``[B, H]``.

    Returns
    -------
    out : dask.array.Array, shape [B, H, D]
    lse : dask.array.Array, shape [B, H]
        Only with ``return_lse=True``.

    Raises
    ------
    TypeError
        If an argument has the wrong type or dtype, ``score_mod`` is not a
        :class:`~numattn.ScoreMod`, or Numba cannot compile a :class:`~numattn.FunctionMask`
        or ``score_mod`` function for the call's argument types; before any task runs.
    ValueError
        If shapes disagree, K/V are chunked along ``Hkv`` or ``D``, or ``k`` and ``v`` have
        different chunks; before any task runs.

    Examples
    --------
    >>> import dask.array as da
    >>> import numpy as np
    >>> import numattn
    >>> import numattn.dask
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((1, 4, 8), dtype=np.float32)
    >>> k, v = rng.standard_normal((2, 1, 1000, 2, 8), dtype=np.float32)
    >>> kd, vd = (da.from_array(x, chunks=(1, 250, 2, 8)) for x in (k, v))
    >>> out, lse = numattn.dask.decode_attention(q, kd, vd, return_lse=True)
    >>> out.shape, lse.shape
    ((1, 4, 8), (1, 4))
    >>> expected = numattn.decode_attention(q, k, v)
    >>> bool(np.allclose(out.compute(scheduler="threads"), expected, atol=1e-6))
    True
    """
    return _sharded("decode", q, k, v, mask, scale, sink_weights, score_mod, return_lse)


# --------------------------------------------------------------------------------------
# Checks and the graph.
# --------------------------------------------------------------------------------------
def _as_dask(name, x):
    """A Dask array, NumPy arrays as one chunk; anything else is refused.  A NumPy array of
    :data:`SCATTER_BYTES` or more, when a distributed ``Client`` is the default scheduler,
    goes straight to a worker (``client.scatter``) instead of into the graph, which would
    carry it through the scheduler."""
    if isinstance(x, da.Array):
        return x
    if isinstance(x, np.ndarray):
        client = _default_client() if x.nbytes >= SCATTER_BYTES else None
        if client is not None:
            return da.from_delayed(dask.delayed(client.scatter(x)), x.shape, x.dtype)
        return da.from_array(x, chunks=x.shape or ())
    raise TypeError(f"{name} must be a dask.array.Array (or a NumPy array), got "
                    f"{type(x).__module__}.{type(x).__name__}")


def _default_client():
    """The ``distributed.Client`` that computes Dask collections by default, or ``None``."""
    try:
        from distributed import default_client

        client = default_client()
    except (ImportError, ValueError):  # no distributed, or no client
        return None
    return client if dask.base.get_scheduler() == client.get else None


def _place_tasks_with_their_chunks(client):
    """Install :class:`KVPlacement` on ``client``'s scheduler (once per client)."""
    if client.id in _PLACED_CLIENTS:
        return
    _PLACED_CLIENTS.add(client.id)
    try:
        client.register_plugin(KVPlacement(), name=KVPlacement.name)
    except Exception as exc:  # e.g. a scheduler without numattn installed
        warnings.warn(f"numattn.dask could not install its task placement on the scheduler "
                      f"({type(exc).__name__}: {exc}); tasks run where Dask's scheduler "
                      f"puts them, which may move K/V chunks between workers (install "
                      f"numattn where the scheduler runs)", RuntimeWarning, stacklevel=4)


class KVPlacement(SchedulerPlugin):
    """A scheduler plugin that runs each partial-state task of ``numattn.dask`` on the
    workers that already hold the most bytes of its inputs: its K/V chunk, when the cache
    is persisted on the cluster.

    Left to itself, Dask's scheduler weighs a chunk's transfer against the workers' load
    and fetched up to half of the K/V chunks of a prefill to balance it (measured: "Beyond one
    machine" in docs/performance.rst).  Layer annotations (``dask.annotate(workers=...)``)
    would say the same but do not reach the scheduler: Dask's low-level graph fusion drops
    them.  This sets the restriction on the scheduler's task itself as the graph arrives,
    before any task of it runs.  The restriction is loose: should those workers be gone,
    the task runs elsewhere rather than wait.  Tasks whose inputs are not yet in memory
    anywhere (a cache still to be computed) are left to the scheduler.
    """

    name = "numattn-kv-placement"

    def update_graph(self, scheduler, *, tasks, **kwargs):
        for key in tasks:
            name = key[0] if isinstance(key, tuple) else key
            ts = scheduler.tasks.get(key)
            if (not isinstance(name, str) or not name.startswith(PARTIAL_STATE_NAME)
                    or ts is None or ts.worker_restrictions):
                continue
            held = {}
            for dependency in ts.dependencies:
                for worker in dependency.who_has or ():
                    held[worker.address] = held.get(worker.address, 0) + dependency.nbytes
            if held:
                most = max(held.values())
                ts.worker_restrictions = {w for w, size in held.items() if size == most}
                ts.loose_restrictions = True


def _check_kv_chunks(k, v):
    """K/V chunked along B and N only, both alike."""
    if k.chunks != v.chunks:
        raise ValueError(f"k and v must have the same chunks, got {k.chunks} and {v.chunks}")
    for axis, what in ((2, "Hkv"), (3, "D")):
        if len(k.chunks[axis]) != 1:
            raise ValueError(
                f"k and v may be chunked along B and N only, not along {what} (axis {axis}): "
                f"got chunks {k.chunks[axis]}; rechunk with "
                f"k.rechunk({{{axis}: -1}})"
            )


def _travels_as_is(dtype):
    """Whether distributed rebuilds NumPy arrays of ``dtype`` sent between processes: it
    sends ``dtype.str`` for dtypes that are not of kind ``V``, and ml_dtypes'
    float8_e5m2 says ``'<f1'``, which NumPy does not read back."""
    if dtype.kind == "V":
        return True
    try:
        return np.dtype(dtype.str) == dtype
    except TypeError:
        return False


def _split_tensor(mask):
    """``mask`` with its :class:`MaterializedMask` (if any) replaced by :class:`NullMask`
    (what it is in the program), and that leaf's tensor."""
    if isinstance(mask, MaterializedMask):
        return NullMask(), mask.tensor
    if isinstance(mask, (AndMask, OrMask)):
        left, left_tensor = _split_tensor(mask.left)
        right, right_tensor = _split_tensor(mask.right)
        return type(mask)(left, right), (right_tensor if left_tensor is None else left_tensor)
    return mask, None


def _sharded(kind, q, k, v, mask, scale, sink_weights, score_mod, return_lse):
    """Check everything, then build the graph: partial states per (batch chunk, key chunk)
    and their tree of merges."""
    decode = kind == "decode"
    operation = _decode_attention if decode else _flash_attention_kv_cache
    if not (isinstance(q, np.ndarray)
            and (q.nbytes < SCATTER_BYTES or _default_client() is None)):
        q = _as_dask("q", q)  # (NumPy queries otherwise go into the tasks in pieces)
    k, v = _as_dask("k", k), _as_dask("v", v)
    if q.ndim != (3 if decode else 4):
        want = "[B, H, D]" if decode else "[B, S, H, D]"
        raise ValueError(f"q must be {want} ({3 if decode else 4}-d), got shape "
                         f"{list(q.shape)}")
    for name, x in (("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must be 4-d [B, N, Hkv, D], got shape {list(x.shape)}")
    q_dtype = check_q_dtype("q", q)
    kv_dtype = check_kv_dtype("k", k)
    if v.dtype != kv_dtype:
        raise TypeError(f"v must have k's dtype {kv_dtype}, got {v.dtype}")
    if kv_dtype.name == "int8":
        raise TypeError("int8 k and v need scales, which dense arrays do not carry: shard "
                        "float8 (scale 1), 16-bit or float32 K/V")
    dtype = compute_dtype(q_dtype, kv_dtype)  # of the scores (and of scale and sinks)
    part_dtype = lse_dtype(q_dtype)  # of the partial states: float32 unless q is float64
    if not _travels_as_is(kv_dtype):  # the tasks read integer views and view them back
        bits = np.dtype(f"u{kv_dtype.itemsize}")
        k, v = k.view(bits), v.view(bits)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {list(k.shape)} and "
                         f"{list(v.shape)}")
    batch, num_keys, num_kv_heads, head_dim = k.shape
    q_rows = 1 if decode else q.shape[1]
    num_heads = q.shape[-2]
    if q.shape[0] != batch:
        raise ValueError(f"q must have B = {batch} sequences (k's), got shape {list(q.shape)}")
    if q.shape[-1] != head_dim or head_dim < 1:
        raise ValueError(f"q, k and v must have one head dimension D >= 1, got q "
                         f"{list(q.shape)} and k {list(k.shape)}")
    check_heads(num_heads, num_kv_heads)
    _check_kv_chunks(k, v)
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    scale = check_scale(scale, head_dim, dtype)
    if sink_weights is not None:
        sink_weights = check_sink_weights(np.asarray(sink_weights), num_heads, dtype)
    if isinstance(mask, da.Array):
        mask = MaterializedMask(mask)
    mask = as_mask(mask)
    compile_mask(mask)  # the mask's own checks: one MaterializedMask, none under '|'
    # The functions of FunctionMask leaves and score_mod, compiled here for the call's
    # argument types (the function alone, not the kernels): a type or a function that the
    # tasks could not compile is refused now, not by every task on its worker.
    bind_functions(mask_functions(mask), score_mod, dtype, "cpu")
    mask, tensor = _split_tensor(mask)

    # The blocks each task reads: q cut like K/V along B and whole along H and D; along S,
    # as given, or (given whole) in pieces smaller than a key chunk's K and V, so that the
    # scheduler, which runs a task where most of its input bytes are, runs each where its
    # K/V chunk is and sends it the queries.  An additive tensor is cut like q and K/V.
    b_chunks, n_chunks = k.chunks[0], k.chunks[1]
    if decode:
        s_chunks = (1,)
    elif isinstance(q, da.Array) and len(q.chunks[1]) > 1:
        s_chunks = q.chunks[1]
    else:
        s_chunks = _query_pieces(q_rows, max(n_chunks, default=0), num_heads, num_kv_heads)
    if isinstance(q, da.Array):
        q = q.rechunk((b_chunks, num_heads, head_dim) if decode
                      else (b_chunks, s_chunks, num_heads, head_dim))
    if tensor is not None:
        tensor = _tensor_blocks(tensor, dtype, q_dtype, batch, num_heads, q_rows, num_keys,
                                b_chunks, n_chunks, None if decode else s_chunks)
    client = _default_client()
    if client is not None:
        _place_tasks_with_their_chunks(client)
    parts = _partial_states(
        q, k, v, tensor, (b_chunks, n_chunks, s_chunks), num_heads, head_dim, part_dtype,
        operation=operation, mask=mask, num_keys=num_keys, num_rows=q_rows, scale=scale,
        sink_weights=sink_weights, score_mod=score_mod, decode=decode, kv_dtype=kv_dtype)
    merged = da.reduction(parts, _keep_part, _merge_parts, combine=_merge_parts, axis=1,
                          split_every=2, dtype=part_dtype, concatenate=True,
                          meta=np.empty((0,) * (parts.ndim - 1), dtype=part_dtype))
    out = merged[..., :head_dim]
    if out.dtype != q_dtype:  # 16-bit queries: the merged result rounded to their dtype
        out = out.astype(q_dtype)
    return (out, merged[..., head_dim]) if return_lse else out


def _partial_states(q, k, v, tensor, chunks, num_heads, head_dim, dtype, **kwargs):
    """The layer of partial states, ``[B, key chunks, (S,) H, D + 1]``: one task per
    (batch chunk, key chunk(, query piece)) that reads its blocks of q, K, V (and the
    additive tensor) and is given where they sit (the key chunk's index and first key, the
    first sequence and row) as numbers in the task.  q given as a NumPy array goes into
    the tasks in pieces too.  (Built by hand: Dask's ``blockwise`` would make those numbers
    and a small q tasks of their own, each sent from one worker to the others: "Fewer tasks
    per step" in docs/performance.rst.)"""
    b_chunks, n_chunks, s_chunks = chunks
    decode = kwargs["decode"]
    name = f"{PARTIAL_STATE_NAME}-" + tokenize(
        q if isinstance(q, np.ndarray) else q.name, k.name, v.name,
        None if tensor is None else tensor.name, chunks, num_heads, head_dim, dtype, **kwargs)
    task = functools.partial(_partial_state, **kwargs)
    b_starts = np.cumsum((0, *b_chunks[:-1]))
    n_starts = np.cumsum((0, *n_chunks[:-1]))
    s_starts = np.cumsum((0, *s_chunks[:-1]))
    graph = {}
    for bi, b0 in enumerate(b_starts.tolist()):
        for ni, n0 in enumerate(n_starts.tolist()):
            for si, s0 in enumerate(s_starts.tolist()):
                if isinstance(q, np.ndarray):
                    rows = slice(b0, b0 + b_chunks[bi])
                    q_block = q[rows] if decode else q[rows, s0:s0 + s_chunks[si]]
                else:
                    q_block = (q.name, bi, 0, 0) if decode else (q.name, bi, si, 0, 0)
                args = [q_block, (k.name, bi, ni, 0, 0), (v.name, bi, ni, 0, 0), ni, n0, b0,
                        s0]
                if tensor is not None:
                    args.append((tensor.name, *{2: (si, ni), 3: (bi, si, ni),
                                                4: (bi, 0, si, ni)}[tensor.ndim]))
                key = (name, bi, ni, 0, 0) if decode else (name, bi, ni, si, 0, 0)
                graph[key] = (task, *args)
    inputs = [x for x in (q, k, v, tensor) if isinstance(x, da.Array)]
    out_chunks = (b_chunks, (1,) * len(n_chunks), *(() if decode else (s_chunks,)),
                  (num_heads,), (head_dim + 1,))
    return da.Array(HighLevelGraph.from_collections(name, graph, dependencies=inputs), name,
                    out_chunks, meta=np.empty((0,) * len(out_chunks), dtype=dtype))


def _query_pieces(rows, kv_chunk_keys, num_heads, num_kv_heads):
    """Chunks along S of q pieces of at most half a key chunk's K and V bytes:
    ``kv_chunk_keys * Hkv / H`` rows (at least one)."""
    piece = max(1, kv_chunk_keys * num_kv_heads // num_heads)
    return (piece,) * (rows // piece) + ((rows % piece,) if rows % piece or not rows else ())


def _tensor_blocks(tensor, dtype, q_dtype, batch, num_heads, q_rows, num_keys, b_chunks,
                   n_chunks, s_chunks):
    """The additive tensor, checked as the operation checks it, as a Dask array of its first
    ``N`` columns cut like K/V along ``B`` and ``N`` and its rows like q's (``s_chunks``;
    ``None``: decode's one row), whole along ``H``."""
    additive_4d(tensor, batch=batch, num_heads=num_heads, max_q_len=q_rows, max_keys=num_keys,
                dtype=dtype, exact_rows=True, q_dtype=q_dtype)
    tensor = _as_dask("mask", tensor)[..., :num_keys]
    rows = (q_rows,) if s_chunks is None else s_chunks
    if tensor.ndim == 2:
        return tensor.rechunk((rows, n_chunks))
    if tensor.ndim == 3:
        return tensor.rechunk((b_chunks, rows, n_chunks))
    return tensor.rechunk((b_chunks, num_heads, rows, n_chunks))


# --------------------------------------------------------------------------------------
# The tasks.  A partial state is out and lse side by side: [..., D + 1], lse last.
# --------------------------------------------------------------------------------------
def _partial_state(q, k, v, index, n0, b0, s0, tensor=None, *, operation, mask, num_keys,
                   num_rows, scale, sink_weights, score_mod, decode, kv_dtype):
    """One (batch chunk, key chunk(, query piece)) task: the single-process operation over
    the chunk's keys and the piece's queries at their global positions; returns
    ``[b, 1, (s,) H, D + 1]``.  ``index`` and ``n0`` are the key chunk's index and first
    key, ``b0`` the batch chunk's first sequence, ``s0`` the piece's first row.  K/V are
    read as ``kv_dtype`` (they may come as integer views of it: :func:`_travels_as_is`)."""
    q = _widened(q)  # the operation's result and LSE are then the partial state's dtype
    k, v = k.view(kv_dtype), v.view(kv_dtype)
    rows = 1 if decode else q.shape[1]
    n = k.shape[1]
    sinks = sink_weights if index == 0 else None  # counted once: in the first key chunk
    if n == 0 or q.shape[0] == 0:
        out = np.zeros(q.shape, dtype=q.dtype)
        lse = np.full(q.shape[:-1], -np.inf, dtype=q.dtype)
        if sinks is not None:
            lse[...] = sinks
    else:
        if tensor is not None:
            mask = mask & MaterializedMask(_widened(tensor))
        extra = {} if score_mod is None else {"score_mod": score_mod}
        # the kernels' query position n - rows + r, made global: N - S + s0 + r
        q_offset = (num_keys - num_rows + s0) - (n - rows)
        out, lse = operation(np.ascontiguousarray(q), np.ascontiguousarray(k),
                             np.ascontiguousarray(v), mask, scale, sink_weights=sinks,
                             return_lse=True, _positions=(q_offset, n0, b0), **extra)
    return _pack(out, lse)[:, None]


def _widened(x):
    """``x`` contiguous, 16-bit values widened to float32."""
    return np.ascontiguousarray(x, dtype=np.float32 if x.dtype.name in SIXTEEN_BIT_NAMES
                                else x.dtype)


def _pack(out, lse):
    packed = np.empty((*out.shape[:-1], out.shape[-1] + 1), dtype=out.dtype)
    packed[..., :-1] = out
    packed[..., -1] = lse
    return packed


def _keep_part(x, axis=None, keepdims=True, **kwargs):
    """The reduction's first step: a task's partial state as it is."""
    return x


def _merge_parts(x, axis=None, keepdims=True, **kwargs):
    """Merge the partial states stacked along axis 1 of ``x`` (two, in the tree) with
    :func:`numattn.merge_states`."""
    if x.shape[1] == 1 or x.size == 0:
        merged = x[:, :1]
    else:
        parts = range(x.shape[1])
        out, lse = merge_states([x[:, i, ..., :-1] for i in parts],
                                [x[:, i, ..., -1] for i in parts])
        merged = _pack(out, lse)[:, None]
    return merged if keepdims else merged[:, 0]
