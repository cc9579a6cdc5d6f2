"""The normalised description of an attention call: what every operation builds from its
arguments and every backend consumes.

:func:`attention_problem` checks the arguments of any call (padded ``[B, S, H, D]`` queries,
ragged ``[T, H, D]`` ones with row offsets, or one query row per sequence ``[B, H, D]``;
plain K/V arrays or either cache kind, with K/V row offsets; a mask object or an additive
tensor; sinks; scale; ``out``) and turns it into one :class:`AttentionProblem`.  It works in
two parts that plans call apart: :func:`attention_step` validates what the row offsets,
the cache tables and the mask fix for a whole step, the same for every layer
(an :class:`AttentionStep`), and :func:`layer_problem` adds one layer's queries, K/V pages,
scale, sinks and output.  Where the operations give their arguments different meanings,
an :class:`OperationRules` says which.

The kernels take the parts as the NamedTuples :class:`QueryRows`, :class:`PagedKV`,
:class:`MaskArgs` and :class:`SoftmaxArgs`, passed as plain tuples of their fields, in
this order: Numba types a plain tuple in C, but a NamedTuple in Python (slower, at every call).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from .config import MHAConfig, resolve_config
from .device import is_device_array, require_cuda, resolve_device
from .dtypes import Q_DTYPE_NAMES, SIXTEEN_BIT_NAMES, compute_dtype, lse_dtype
from .functions import bind_functions, kernel_functions
from .kv_cache import KVCache, KVLayout, resolve_kv
from .masks import additive_4d, as_mask, compile_mask, mask_functions
from .validate import (
    check_array,
    check_heads,
    check_no_overlap,
    check_out,
    check_q_dtype,
    check_row_offsets,
    check_scale,
    check_sink_weights,
    dtype_of,
    host_int_array,
    row_counts,
    same_elements,
    shape_of,
)

__all__ = [
    "AttentionProblem",
    "AttentionStep",
    "MaskArgs",
    "OperationRules",
    "PagedKV",
    "QueryRows",
    "SoftmaxArgs",
    "attention_problem",
    "attention_step",
    "finish_result",
    "layer_problem",
    "on_host",
    "plan_q_dtype",
]


# --------------------------------------------------------------------------------------
# The parts, as the kernels take them.
# --------------------------------------------------------------------------------------
class QueryRows(NamedTuple):
    """The queries, ragged: sequence ``b`` owns rows ``q[offsets[b]:offsets[b + 1]]``."""

    q: object  # [T, H, D] (C-contiguous on the host)
    offsets: np.ndarray  # int64 [B + 1]
    start_pos: np.ndarray  # int64 [B]: q_idx of each sequence's first row
    max_len: int  # the most rows a sequence may have (the additive mask's rows)


class PagedKV(NamedTuple):
    """K/V in the paged addressing of :func:`numattn.kernels.shared.paging.kv_page_slot`
    (the first fields of a :class:`~numattn.core.kv_cache.KVLayout`), in their stored
    format (:mod:`numattn.core.dtypes`)."""

    k_blocks: object  # [pages, page_size, Hkv, D]: kernel views
    v_blocks: object
    page_size: int
    lookup_table: np.ndarray  # int64 [B, max_pages]
    row_base: np.ndarray  # int64 [B]
    num_keys: np.ndarray  # int64 [B]
    k_scales: object  # float32 [pages, page_size, Hkv], or [0, 0, 0]: none
    v_scales: object
    kv_format: int  # FORMAT_*


class MaskArgs(NamedTuple):
    """A compiled mask (:func:`numattn.core.masks.compile_mask`)."""

    program: np.ndarray  # int64 [n_ops, 2]
    additive: object  # [Bm, Hm, Sm, N] view of the additive tensor, or a [1, 1, 1, 1] placeholder
    has_additive: bool
    functions: tuple  # the user functions' captures and tile tables (core.functions)


class SoftmaxArgs(NamedTuple):
    """Score scale and sink logits."""

    scale: np.floating  # in the queries' dtype
    sinks: np.ndarray  # [H] of the queries' dtype (zeros without sinks)
    has_sink: bool


# --------------------------------------------------------------------------------------
# The problem, in two parts.
# --------------------------------------------------------------------------------------
#: Values of :attr:`OperationRules.out_may_share`.
OUT_AFTER_READS = "after reads"  # written once every input was read: only the sinks are apart
OUT_MAY_BE_Q = "q itself"  # may be q itself, and share nothing else
OUT_APART = "apart"  # shares memory with no input


class OperationRules(NamedTuple):
    """What an operation's arguments mean where the operations differ."""

    queries_at_start: bool  # q_idx = r (cross attention), not num_keys - q_len + r
    dense_kv_prefix: bool  # ragged q may take dense [B, N, Hkv, D] K/V: first kv_len(b) rows
    any_cache_when_empty: bool  # a batch of no sequences takes a cache of any batch size
    out_may_share: str  # OUT_AFTER_READS, OUT_MAY_BE_Q or OUT_APART
    device_contiguous: bool  # device arrays must be C-contiguous


class AttentionStep(NamedTuple):
    """What the row offsets, the cache tables and the mask fix: the same for every layer of
    a step (:func:`attention_step`)."""

    q_offsets: np.ndarray  # int64 [B + 1]
    q_start_pos: np.ndarray  # int64 [B]
    max_q_len: int
    layout: KVLayout  # over the pages it was made from (a plan's: no pages)
    mask: MaskArgs
    mask_heads: int  # H of a [B, H, S, N] additive tensor, checked per layer; else 0
    config: MHAConfig
    dtype: np.dtype  # the compute dtype (numattn.core.dtypes.compute_dtype)
    rules: OperationRules
    q_dtype: np.dtype  # the queries' (and the result's)
    functions: object  # BoundFunctions of the mask's functions and score_mod, or None


class AttentionProblem(NamedTuple):
    """One attention call, normalised: what every backend consumes.

    The queries are ragged rows whatever their form was (a padded ``[B, S, H, D]`` call is
    ``B`` sequences of ``S`` rows), K/V any input kind in the paged addressing, the mask
    compiled, the scale in the compute dtype.  ``out`` is the caller's (checked) or
    ``None``; the backend allocates the result (of ``out_shape``) and the LSE.  The queries
    are of the compute dtype too, but for 16-bit ones on the CPU: those stay as given, and
    :func:`numattn.kernels.cpu.convert.on_cpu` widens them for the drivers (the flash
    driver reads them as they are, and writes its result in q's dtype).
    """

    queries: QueryRows
    layout: KVLayout
    mask: MaskArgs
    softmax: SoftmaxArgs
    config: MHAConfig
    out: object  # written by the kernels: the caller's out when of the compute dtype
    out_shape: tuple  # the result's shape: q's
    return_lse: bool
    device: str  # "cpu" or "cuda"
    result_dtype: np.dtype  # q's (the kernels compute in the compute dtype)
    final_out: object  # the caller's out of another dtype than the compute dtype, or None
    functions: object  # BoundFunctions, or None: the kernels' specialization

    # The parts' fields by name, for the drivers.
    q = property(lambda self: self.queries.q)
    q_offsets = property(lambda self: self.queries.offsets)
    q_start_pos = property(lambda self: self.queries.start_pos)
    max_q_len = property(lambda self: self.queries.max_len)
    program = property(lambda self: self.mask.program)
    additive = property(lambda self: self.mask.additive)
    has_additive = property(lambda self: self.mask.has_additive)
    scale = property(lambda self: self.softmax.scale)
    sinks = property(lambda self: self.softmax.sinks)
    has_sink = property(lambda self: self.softmax.has_sink)
    max_keys = property(lambda self: self.layout.max_keys)
    special = property(lambda self: None if self.functions is None else self.functions.special)
    dtype = property(lambda self: self.softmax.sinks.dtype)  # the compute dtype

    @property
    def group(self):
        """Query heads per KV head."""
        return self.queries.q.shape[1] // self.layout.num_kv_heads


# --------------------------------------------------------------------------------------
# The front-end.
# --------------------------------------------------------------------------------------
def attention_problem(q, k, v, mask, scale, *, rules, q_offsets=None, kv_offsets=None,
                      q_max_seq_len=None, one_row=False, sink_weights=None, out=None,
                      return_lse=False, config=None, device="cpu", positions=None,
                      score_mod=None):
    """Check an attention call's arguments and normalise them into an :class:`AttentionProblem`.

    Parameters
    ----------
    q : array
        Padded ``[B, S, H, D]``; ragged ``[T, H, D]`` with ``q_offsets``; or, with
        ``one_row``, ``[B, H, D]`` (one row per sequence: decode).
    k, v : arrays or caches
        Caches, dense ``[B, N, Hkv, D]`` arrays (padded or one-row queries, or ragged ones
        with ``rules.dense_kv_prefix``) or ragged ``[T_kv, Hkv, D]`` rows (ragged queries).
    mask : Mask, ndarray or None
    scale : float or None
    rules : OperationRules
    q_offsets, kv_offsets : int arrays [B + 1] or None
        ``q_input_row_offsets`` and ``kv_input_row_offsets``.
    q_max_seq_len : int or None
        Rows of the additive mask for ragged queries (at least the longest sequence's; by
        default that).
    sink_weights, out, return_lse, config, device, score_mod
        As the operations take them.
    positions : (int, int) or (int, int, int), optional
        Internal: the mask's ``(q_offset, k_offset)`` (:func:`~numattn.core.masks.compile_mask`),
        and the offset added to the sequence index that mask and score functions see.

    Returns
    -------
    AttentionProblem

    Raises
    ------
    TypeError, ValueError
        Naming the argument, before anything is written.
    """
    config = resolve_config(config)
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    ragged = q_offsets is not None
    check_array("q", q, ndim=3 if ragged or one_row else 4)
    dtype = check_q_dtype("q", q)
    q_shape = shape_of(q)
    num_heads, head_dim = q_shape[-2:]
    if head_dim < 1:
        raise ValueError(f"q must have a head dimension D >= 1, got shape {list(q_shape)}")
    if kv_offsets is not None and not ragged:
        raise ValueError("kv_input_row_offsets needs ragged queries: pass "
                         "q_input_row_offsets with q of shape [T, H, D]")
    mask = as_mask(mask)
    offsets = (0, 0, 0)  # what score functions add to b, q_idx and k_idx
    if isinstance(positions, tuple) and len(positions) == 3:
        positions, offsets = positions[:2], (positions[2], *positions[:2])
    elif positions is not None:
        offsets = (0, *positions)
    program, tensor = compile_mask(mask, positions=positions)
    arrays = (q, k.blocks if isinstance(k, KVCache) else k,
              v.blocks if isinstance(v, KVCache) else v, out, tensor, sink_weights)
    device = "cpu" if device in ("auto", "cpu") and on_host(arrays) else resolve_device(
        device, arrays)
    if device == "cuda":
        require_cuda()  # says so where there is none
    if device == "cuda" and rules.device_contiguous:
        for name, x in (("q", q), ("k", k), ("v", v), ("out", out), ("mask", tensor)):
            check_device_contiguous(name, x.blocks if isinstance(x, KVCache) else x)
    if ragged:
        q_offsets = check_row_offsets("q_input_row_offsets", q_offsets, q_shape[0],
                                      "q.shape[0]")
        q_lens = row_counts(q_offsets)
        longest = int(q_lens.max(initial=0))
        max_q_len = longest if q_max_seq_len is None else _check_q_max_seq_len(
            q_max_seq_len, longest)
    elif one_row:
        q_offsets = _one_row_each(q_shape[0])
        q_lens = _ones(q_shape[0])
        max_q_len = 1
    else:
        batch, max_q_len = q_shape[:2]
        q_offsets = np.arange(batch + 1, dtype=np.int64) * max_q_len
        q_lens = np.full(batch, max_q_len, dtype=np.int64)
    step = attention_step(k, v, program, tensor, q_offsets=q_offsets, q_lens=q_lens,
                          max_q_len=max_q_len, kv_offsets=kv_offsets, ragged=ragged,
                          dtype=dtype, num_heads=num_heads, config=config, rules=rules,
                          mask_functions=mask_functions(mask), score_mod=score_mod,
                          device=device, offsets=offsets)
    return layer_problem(step, q, step.layout, scale, sink_weights, out, return_lse, device)


def attention_step(k, v, program, tensor, *, q_offsets, q_lens, max_q_len, kv_offsets, ragged,
                   dtype, num_heads, config, rules, mask_functions=(), score_mod=None,
                   device="cpu", offsets=(0, 0, 0)):
    """The part of a problem that a step's row offsets, cache tables and mask fix.

    ``program, tensor`` are :func:`~numattn.core.masks.compile_mask`'s, ``mask_functions``
    the mask's :func:`~numattn.core.masks.mask_functions` and ``score_mod`` the call's
    (checked here, their captures where ``device`` runs the call); ``q_offsets`` and
    ``q_lens`` the checked int64 row offsets and lengths of the queries (``ragged``: given
    as offsets; else padded, each sequence ``max_q_len`` rows); ``dtype`` that of the
    queries; ``num_heads`` theirs, or ``None`` when not known yet (a plan: a
    ``[B, H, S, N]`` additive tensor's ``H`` is then checked per layer by
    :func:`layer_problem`).
    """
    batch = q_offsets.shape[0] - 1
    layout = _resolve_kv(k, v, batch=batch, q_offsets=q_offsets, q_lens=q_lens,
                         kv_offsets=kv_offsets, ragged=ragged, rules=rules)
    q_dtype = dtype
    dtype = compute_dtype(q_dtype, layout.dtype)
    mask_heads = 0
    if num_heads is None and tensor is not None and len(shape_of(tensor)) == 4:
        num_heads = mask_heads = shape_of(tensor)[1]
    if tensor is None:
        additive = _no_additive(dtype)
    else:
        additive = additive_4d(tensor, batch=batch, num_heads=num_heads, max_q_len=max_q_len,
                               max_keys=layout.max_keys, dtype=dtype, exact_rows=not ragged,
                               q_dtype=q_dtype)
    if rules.queries_at_start:
        q_start_pos = np.zeros(batch, dtype=np.int64)
    else:
        q_start_pos = layout.num_keys - q_lens
    functions = bind_functions(mask_functions, score_mod, dtype, device)
    mask = MaskArgs(program, additive, tensor is not None,
                    kernel_functions(functions, q_start_pos, offsets))
    return AttentionStep(q_offsets, q_start_pos, max_q_len, layout, mask, mask_heads, config,
                         dtype, rules, q_dtype, functions)


def layer_problem(step, q, layout, scale, sink_weights, out, return_lse, device):
    """The :class:`AttentionProblem` of one layer of ``step``: its queries ``q`` (checked by
    the caller against the step's form and dtype), ``layout`` (the step's over this layer's
    K/V pages), scale, sinks and ``out``, on ``device`` ("cpu" or "cuda")."""
    # (a plan calls this for every layer: the common cases skip a few calls)
    q_shape = q.shape if type(q) is np.ndarray else shape_of(q)
    num_heads, head_dim = q_shape[-2:]
    if layout.head_dim != head_dim:
        raise ValueError(f"k and v must have head dimension D = {head_dim} (q's), got "
                         f"{layout.head_dim}")
    if layout.num_kv_heads < 1 or num_heads % layout.num_kv_heads:
        check_heads(num_heads, layout.num_kv_heads)
    if step.mask_heads and step.mask_heads != num_heads:
        raise ValueError(f"mask: a [B, H, S, N] additive mask must have H = {num_heads}, "
                         f"got shape {list(shape_of(step.mask.additive))}")
    dtype = step.dtype
    scale = _default_scale(head_dim, dtype) if scale is None else dtype.type(
        check_scale(scale, head_dim, dtype))
    sinks = None if sink_weights is None else check_sink_weights(sink_weights, num_heads, dtype)
    out = check_out(out, q_shape, step.q_dtype, or_float32=True)
    final_out = None
    if out is not None and dtype_of(out) != dtype:
        final_out, out = out, None  # the kernels write a result of the compute dtype
    if device == "cuda" and step.q_dtype != dtype and is_device_array(q):
        raise TypeError(f"device queries must be float32 or float64 (the compute dtype), got "
                        f"{step.q_dtype}: widen them on the device, or pass host queries")
    if device == "cuda" and final_out is not None and is_device_array(final_out):
        raise TypeError(f"a device out must have the compute dtype {dtype}, got "
                        f"{dtype_of(final_out)}")
    if out is not None:
        if device == "cpu" and not isinstance(out, np.ndarray):
            raise TypeError(f"out must be a NumPy array (this call runs on the CPU), got "
                            f"{type(out).__name__}")
        if sinks is not None or step.rules.out_may_share != OUT_AFTER_READS:
            _check_out_overlap(out, q, layout, step.mask, sinks, step.rules.out_may_share)
    if device == "cpu" and q.dtype.name in SIXTEEN_BIT_NAMES:
        q = np.ascontiguousarray(q)  # widened by the CPU's threads (kernels.cpu.convert)
    elif device == "cpu" or (isinstance(q, np.ndarray) and q.dtype != dtype):
        q = np.ascontiguousarray(q, dtype=dtype)  # host queries for the device: a copy
    if len(q_shape) == 4:  # padded: B sequences of S rows (device arrays are C-contiguous)
        q = q.reshape(q_shape[0] * q_shape[1], num_heads, head_dim)
    has_sink = sinks is not None
    softmax = SoftmaxArgs(scale, sinks if has_sink else _no_sinks(num_heads, dtype), has_sink)
    queries = QueryRows(q, step.q_offsets, step.q_start_pos, step.max_q_len)
    return AttentionProblem(queries, layout, step.mask, softmax, step.config, out, q_shape,
                            bool(return_lse), device, step.q_dtype, final_out, step.functions)


def plan_q_dtype(q_dtype, kv_dtype):
    """The queries' dtype a plan is made for: ``q_dtype`` (checked), or by default K/V's
    for K/V of a query dtype and float32 for 8-bit K/V."""
    if q_dtype is not None:
        return check_q_dtype("q_dtype", np.empty(0, dtype=q_dtype))
    kv_dtype = np.dtype(kv_dtype)
    return kv_dtype if kv_dtype.name in Q_DTYPE_NAMES else np.dtype(np.float32)


def finish_result(problem, result, lse):
    """The result as the caller asked for it: of q's dtype (rounded to nearest), or the
    caller's ``out``, the LSE float32 (float64 for float64 queries).  Device results stay
    as the kernels wrote them (device queries and ``out`` have the compute dtype)."""
    if problem.final_out is not None:
        if result is not problem.final_out:  # (the CPU's drivers may have written it)
            problem.final_out[...] = result
        result = problem.final_out
    elif (problem.out is None and isinstance(result, np.ndarray)
          and result.dtype != problem.result_dtype):
        result = result.astype(problem.result_dtype)
    if (isinstance(lse, np.ndarray) and lse.dtype != lse_dtype(problem.result_dtype)):
        lse = lse.astype(lse_dtype(problem.result_dtype))
    return result, lse


# --------------------------------------------------------------------------------------
# Helpers.
# --------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=64)
def _default_scale(head_dim, dtype):
    """``1 / sqrt(D)`` in the queries' dtype (:func:`~numattn.core.validate.check_scale`'s)."""
    return dtype.type(check_scale(None, head_dim, dtype))


# Arrays that many calls share (nothing writes to them), made once.
@functools.lru_cache(maxsize=64)
def _no_sinks(num_heads, dtype):
    """The kernels' sink logits without sinks: zeros."""
    return np.zeros(num_heads, dtype)


@functools.lru_cache(maxsize=8)
def _no_additive(dtype):
    """The kernels' additive tensor without one: a [1, 1, 1, 1] zero
    (:func:`~numattn.core.masks.additive_4d`'s placeholder)."""
    return np.zeros((1, 1, 1, 1), dtype)


@functools.lru_cache(maxsize=64)
def _ones(batch):
    """One query row (and one new key) per sequence: decode's ``q_lens``."""
    return np.ones(batch, dtype=np.int64)


@functools.lru_cache(maxsize=64)
def _one_row_each(batch):
    """Row offsets of one query row per sequence: decode's ``q_offsets``."""
    return np.arange(batch + 1, dtype=np.int64)


def on_host(arrays):
    """Whether each of ``arrays`` is a NumPy array or ``None`` (then a call runs on the CPU
    without asking :func:`~numattn.core.device.resolve_device`)."""
    for x in arrays:
        if x is not None and type(x) is not np.ndarray:
            return False
    return True


def check_device_contiguous(name, x):
    """Device arrays are used in place; where a kernel needs them C-contiguous, say so."""
    if x is None or not is_device_array(x):
        return
    view = x if hasattr(x, "is_c_contiguous") else require_cuda().as_cuda_array(x)
    if not view.is_c_contiguous():
        raise ValueError(f"{name} must be C-contiguous on the device")


def _check_q_max_seq_len(q_max_seq_len, longest_query):
    if isinstance(q_max_seq_len, (bool, np.bool_)) or not isinstance(
        q_max_seq_len, (int, np.integer)
    ):
        raise TypeError(
            f"q_max_seq_len must be an integer, got {type(q_max_seq_len).__name__}"
        )
    if q_max_seq_len < longest_query:
        raise ValueError(
            f"q_max_seq_len must be >= every query sequence length ({longest_query} by "
            f"q_input_row_offsets), got {q_max_seq_len}"
        )
    return int(q_max_seq_len)


def _resolve_kv(k, v, *, batch, q_offsets, q_lens, kv_offsets, ragged, rules):
    """The :class:`KVLayout` of K/V for queries split by ``q_offsets``: ``num_keys(b) =
    cache_len(b) + kv_len(b)``, ``kv_len`` from ``kv_offsets`` (else ``q_lens``); dense
    arrays give ``N`` keys (with ``rules.dense_kv_prefix`` and ``kv_offsets``, the first
    ``kv_len(b)`` of them)."""
    if kv_offsets is not None:
        kv_offsets = host_int_array("kv_input_row_offsets", kv_offsets)
        last = int(kv_offsets[-1]) if kv_offsets.shape[0] else 0
        kv_offsets = check_row_offsets("kv_input_row_offsets", kv_offsets, last,
                                       "its last entry", batch=batch)
    if isinstance(k, KVCache):
        if batch == 0 and rules.any_cache_when_empty:  # nothing is read
            return resolve_kv(k, v, batch=k.batch_size)
        kv_lens = q_lens if kv_offsets is None else row_counts(kv_offsets)
        return resolve_kv(k, v, batch=batch, kv_lens=kv_lens)
    for name, x in (("k", k), ("v", v)):
        if not isinstance(x, KVCache):
            check_array(name, x)
    if not isinstance(v, KVCache):
        _check_kv_ndim(k, ragged, rules.dense_kv_prefix)
    if ragged and len(shape_of(k)) == 3:
        offsets = q_offsets if kv_offsets is None else kv_offsets
        if kv_offsets is None and shape_of(k)[0] != offsets[-1]:
            raise ValueError(
                f"ragged k of shape {list(shape_of(k))} needs kv_input_row_offsets (without "
                f"them the queries' split is used, which covers {offsets[-1]} rows)"
            )
        return resolve_kv(k, v, batch=batch, kv_offsets=offsets)
    layout = resolve_kv(k, v, batch=batch)
    if kv_offsets is not None:  # dense with ragged queries: the first kv_len(b) rows
        kv_lens = row_counts(kv_offsets)
        n = shape_of(k)[1]
        if np.any(kv_lens > n):
            b = int(np.argmax(kv_lens > n))
            raise ValueError(
                f"kv_input_row_offsets gives sequence {b} {kv_lens[b]} key rows but the dense "
                f"k holds N = {n} per sequence"
            )
        layout = layout._replace(num_keys=kv_lens, max_keys=int(kv_lens.max(initial=0)),
                                 total_keys=int(kv_lens.sum()))
    return layout


def _check_kv_ndim(k, ragged, dense_kv_prefix):
    """Plain K/V arrays: ``[T_kv, Hkv, D]`` rows with ragged queries (or dense with
    ``dense_kv_prefix``), dense ``[B, N, Hkv, D]`` with padded ones."""
    if not ragged:
        allowed, what = (4,), "4-d ([B, N, Hkv, D]) with padded queries"
    elif dense_kv_prefix:
        allowed, what = (3, 4), "3-d ([T_kv, Hkv, D]) or 4-d ([B, N, Hkv, D]) with ragged queries"
    else:
        allowed, what = (3,), "3-d ([T_kv, Hkv, D]) with ragged queries"
    if len(shape_of(k)) not in allowed:
        raise ValueError(f"k must be {what}, or a cache; got shape {list(shape_of(k))}")


def _check_out_overlap(out, q, layout, mask, sinks, out_may_share):
    """``out`` must not share memory with what the kernels read after writing some of it
    (the rule an operation's kernels allow, :attr:`OperationRules.out_may_share`)."""
    inputs = {}
    if out_may_share == OUT_APART:
        inputs["q"] = q
    if out_may_share != OUT_AFTER_READS:
        inputs.update(k=layout.k_blocks, v=layout.v_blocks,
                      mask=mask.additive if mask.has_additive else None)
    inputs["sink_weights"] = sinks
    # out may be q itself (each tile of queries is read before its outputs are written),
    # not a view that overlaps q elsewhere (a tile's outputs would land on queries not read)
    if out_may_share == OUT_MAY_BE_Q and not same_elements(out, q):
        inputs["q (other than as q itself)"] = q
    check_no_overlap(out, inputs)
