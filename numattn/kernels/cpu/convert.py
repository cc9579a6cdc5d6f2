"""16-bit queries and results on the CPU: queries widened to float32 before a kernel runs,
results rounded to q's dtype after it, in vector code on the CPU's threads.

The kernels compute in float32 whatever q's dtype (:func:`numattn.core.dtypes.compute_dtype`).
NumPy's and ``ml_dtypes``' casts convert one element at a time on one thread, a sizeable
part of a prefill ("16-bit queries and results" in docs/performance.rst).  Here each
thread converts pieces of
:data:`PIECE_ELEMENTS` elements with :func:`.simd.widen_span` and :func:`.simd.round_span`
(the same values: widening is exact, rounding is to the nearest, ties to even), also the
float32 rows ``store_kv`` writes into a 16-bit cache (:func:`rounded`).  Arrays of fewer
than :data:`PARALLEL_ELEMENTS` elements (a decode step's queries) keep NumPy's casts.
"""

from __future__ import annotations

import numpy as np

from ...core.dtypes import SIXTEEN_BIT_NAMES, kernel_view, storage_format
from ...core.jit import cpu_jit, prange
from .simd import round_span, widen_span

#: Elements of the pieces the threads convert (128 KiB of float32).
PIECE_ELEMENTS = 1 << 15
#: Arrays of fewer elements convert with NumPy's casts, on the calling thread.
PARALLEL_ELEMENTS = 1 << 17


def on_cpu(driver, problem, *args, reads_16_bit=False):
    """``driver(problem, *args)`` (a CPU driver, returning ``(result, lse)``) with 16-bit
    queries given to it widened to the compute dtype and its result rounded to q's dtype
    (into the caller's ``out`` when that is of q's dtype).  A driver that ``reads_16_bit``
    takes the queries as they are and writes a result of q's dtype itself: it is given
    an ``out`` of that dtype (the caller's, or a new array) wherever the caller gave none
    of the compute dtype."""
    if reads_16_bit:
        final = _narrow_out(problem)
        if final is None:
            return driver(problem, *args)
        return final, driver(problem._replace(out=final), *args)[1]
    q = problem.q
    if q.dtype.name in SIXTEEN_BIT_NAMES:
        problem = problem._replace(queries=problem.queries._replace(q=widened(q, problem.dtype)))
    result, lse = driver(problem, *args)
    if result.dtype == np.float32 and result.size >= PARALLEL_ELEMENTS:
        final = _narrow_out(problem)
        if final is not None:
            _run(_round_kernel, result, kernel_view(final))
            return final, lse
    return result, lse


def _narrow_out(problem):
    """The array of q's 16-bit dtype a result goes into: the caller's ``out`` of that dtype
    (C-contiguous: checked) or a new one; None where the caller gave an ``out`` of the
    compute dtype or another kind of array, or where q is not 16-bit."""
    target, final = problem.result_dtype, problem.final_out
    if problem.out is not None or target.name not in SIXTEEN_BIT_NAMES:
        return None
    if final is None:
        return np.empty(problem.out_shape, target)
    return final if isinstance(final, np.ndarray) and final.dtype == target else None


def rounded(x, dtype):
    """A float32 array ``x`` as a new array of the 16-bit ``dtype``, rounded to the nearest,
    ties to even (``store_kv``'s rows for a 16-bit cache)."""
    if x.size < PARALLEL_ELEMENTS or x.dtype != np.float32 or dtype.name not in SIXTEEN_BIT_NAMES:
        with np.errstate(over="ignore"):  # past the largest finite value: inf, as rounding says
            return x.astype(dtype)
    narrow = np.empty(x.shape, dtype)
    _run(_round_kernel, np.ascontiguousarray(x), kernel_view(narrow))
    return narrow


def widened(x, dtype):
    """A C-contiguous 16-bit float array ``x`` as a new array of ``dtype`` (float32)."""
    if x.size < PARALLEL_ELEMENTS or dtype != np.float32:
        return x.astype(dtype)
    wide = np.empty(x.shape, dtype)
    _run(_widen_kernel, kernel_view(x), wide, storage_format(x.dtype))
    return wide


def _run(kernel, source, dest, *args):
    cpu_jit(kernel, parallel=True)(source.reshape(-1), dest.reshape(-1), *args)


def _widen_kernel(bits, dest, kv_format):
    """``dest = bits`` widened (1-D), piece by piece on the threads."""
    n = bits.shape[0]
    for piece in prange((n + PIECE_ELEMENTS - 1) // PIECE_ELEMENTS):
        start = piece * PIECE_ELEMENTS
        widen_span(bits, dest, start, min(PIECE_ELEMENTS, n - start), kv_format)


def _round_kernel(values, bits):
    """``bits = values`` rounded (1-D), piece by piece on the threads."""
    n = values.shape[0]
    for piece in prange((n + PIECE_ELEMENTS - 1) // PIECE_ELEMENTS):
        start = piece * PIECE_ELEMENTS
        round_span(values, bits, start, min(PIECE_ELEMENTS, n - start))
