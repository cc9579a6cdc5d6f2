"""``merge_states``: combine attention results over disjoint key sets (split-K)."""

from __future__ import annotations

import numpy as np

from .core.device import check_stream, is_device_array, require_cuda
from .core.dtypes import lse_dtype
from .core.interop import as_array
from .core.validate import check_array, check_q_dtype, dtype_of, shape_of

__all__ = ["merge_states"]


def _parts(name, parts):
    """``parts`` (a sequence of arrays, or one array whose first axis counts them) as a
    list of arrays."""
    if isinstance(parts, np.ndarray):
        if parts.ndim == 0:
            raise ValueError(f"{name} as one array must be stacked along a first axis that "
                             "counts the parts, got a 0-d array")
        # parts[i, ...] keeps 0-d parts as arrays (iterating a 1-d array gives NumPy scalars)
        return [parts[i, ...] for i in range(parts.shape[0])]
    if isinstance(parts, (str, bytes)) or not hasattr(parts, "__iter__"):
        raise TypeError(f"{name} must be a sequence of arrays, got {type(parts).__name__}")
    # a NumPy scalar (a part of one row's lse) is taken as the 0-d array it stands for
    return [np.asarray(p) if isinstance(p, np.generic) else p for p in parts]


def merge_states(outs, lses, *, stream=None):
    """Combine attention results over disjoint key sets into the result over their union.

    Given partial outputs ``O_p`` and log-sum-exps ``lse_p`` (natural log) of the same
    queries over disjoint key sets, returns::

        lse = log(sum_p e^lse_p),   out = sum_p e^(lse_p - lse) O_p

    A part with ``lse_p = -inf`` (no visible key) contributes exactly nothing, and a row
    whose parts are all empty gives 0 and ``-inf``.

    Parameters
    ----------
    outs : sequence of ndarray [..., D], or ndarray [P, ..., D]
        Partial outputs, all of one shape and dtype: float64, float32, float16 or bfloat16
        (merged in float32, then rounded to their dtype).  Device arrays (float32 or
        float64, C-contiguous) are merged on the device, and the results stay there.
    lses : sequence of ndarray [...], or ndarray [P, ...]
        Their log-sum-exps: float64 for float64 outputs, else float32 (as the operations
        return them).
    stream : numba.cuda stream, optional
        For device parts: the stream the merge is queued on (``None``: the default
        stream); the results are ready in that stream's order.

    Returns
    -------
    out : ndarray [..., D]
    lse : ndarray [...]

    Raises
    ------
    ValueError
        If there are no parts or the shapes disagree.
    TypeError
        If dtypes are not those above or disagree, or ``stream`` is not a stream (a
        ``ValueError`` with host parts only).

    Examples
    --------
    >>> import numpy as np
    >>> import numattn
    >>> q = np.random.default_rng(0).standard_normal((1, 1, 2, 8))
    >>> kv = np.random.default_rng(1).standard_normal((1, 6, 2, 8))
    >>> full = numattn.reference.flash_attention_kv_cache(q, kv, kv, None, return_lse=True)
    >>> a = numattn.reference.flash_attention_kv_cache(q, kv[:, :4], kv[:, :4], None,
    ...                                                return_lse=True)
    >>> b = numattn.reference.flash_attention_kv_cache(q, kv[:, 4:], kv[:, 4:], None,
    ...                                                return_lse=True)
    >>> out, lse = numattn.merge_states([a[0], b[0]], [a[1], b[1]])
    >>> bool(np.allclose(out, full[0]) and np.allclose(lse, full[1]))
    True
    """
    outs = [as_array(f"outs[{i}]", o) for i, o in enumerate(_parts("outs", as_array("outs", outs)))]
    lses = [as_array(f"lses[{i}]", x) for i, x in enumerate(_parts("lses", as_array("lses", lses)))]
    if not outs:
        raise ValueError("merge_states needs at least one part, got none")
    if len(outs) != len(lses):
        raise ValueError(f"got {len(outs)} outputs but {len(lses)} lses")
    for i, (o, x) in enumerate(zip(outs, lses)):
        check_array(f"outs[{i}]", o)
        check_array(f"lses[{i}]", x)
    dtype = check_q_dtype("outs[0]", outs[0])
    out_shape = shape_of(outs[0])
    if len(out_shape) < 1:
        raise ValueError("each output must have at least one dimension (the head dim D)")
    lse_type = lse_dtype(dtype)
    for i, (o, x) in enumerate(zip(outs, lses)):
        if dtype_of(o) != dtype or dtype_of(x) != lse_type:
            raise TypeError(
                f"outs[{i}] and lses[{i}] must have dtypes {dtype} and {lse_type} (as the "
                f"operations return them), got {dtype_of(o)} and {dtype_of(x)}"
            )
        if shape_of(o) != out_shape:
            raise ValueError(f"outs[{i}] has shape {list(shape_of(o))}, expected "
                             f"{list(out_shape)}")
        if shape_of(x) != out_shape[:-1]:
            raise ValueError(f"lses[{i}] has shape {list(shape_of(x))}, expected "
                             f"{list(out_shape[:-1])}")
    rows = int(np.prod(out_shape[:-1], dtype=np.int64))
    d = out_shape[-1]
    parts = len(outs)  # not -1 in the reshapes: rows may be 0
    on_device = any(is_device_array(x) for x in (*outs, *lses))
    stream = check_stream(stream, "cuda" if on_device else "cpu")
    if on_device:
        return _merge_on_device(outs, lses, dtype, out_shape, rows, stream)
    # 16-bit outputs merge in float32 (lse_type), then round to their dtype
    part_out = np.ascontiguousarray(
        np.stack([np.asarray(o) for o in outs]).reshape(parts, rows, d), dtype=lse_type)
    part_lse = np.ascontiguousarray(np.stack([np.asarray(x) for x in lses]).reshape(parts, rows))
    out = np.empty((rows, d), dtype=lse_type)
    lse = np.empty(rows, dtype=lse_type)
    from .kernels.cpu.merge import run_merge_cpu  # kernel modules load at the first call

    run_merge_cpu(part_out, part_lse, out, lse)
    return out.astype(dtype, copy=False).reshape(out_shape), lse.reshape(out_shape[:-1])


def _merge_on_device(outs, lses, dtype, out_shape, rows, stream):
    """:func:`merge_states` of parts of which some are device arrays: stacked and merged on
    the device, queued on ``stream`` (host parts are copied over); returns device arrays."""
    cuda = require_cuda()
    if dtype not in (np.float32, np.float64):
        raise TypeError(f"merge_states on the device takes float32 or float64 parts, got {dtype}")
    d = out_shape[-1]

    def on_device(name, x, shape):
        if not is_device_array(x):
            return cuda.to_device(np.ascontiguousarray(x).reshape(shape), stream=stream)
        x = x if hasattr(x, "copy_to_host") else cuda.as_cuda_array(x)
        if not x.is_c_contiguous():
            raise ValueError(f"{name} must be C-contiguous on the device")
        return x.reshape(shape)

    part_out = cuda.device_array((len(outs), rows, d), dtype, stream=stream)
    part_lse = cuda.device_array((len(outs), rows), dtype, stream=stream)
    for i, (o, x) in enumerate(zip(outs, lses)):
        if rows:
            part_out[i].copy_to_device(on_device(f"outs[{i}]", o, (rows, d)), stream=stream)
            part_lse[i].copy_to_device(on_device(f"lses[{i}]", x, (rows,)), stream=stream)
    out = cuda.device_array((rows, d), dtype, stream=stream)
    lse = cuda.device_array(rows, dtype, stream=stream)
    from .kernels.cuda.merge import run_merge_cuda  # kernel modules load at the first call

    run_merge_cuda(part_out, part_lse, out, lse, stream)
    return out.reshape(out_shape), lse.reshape(out_shape[:-1])
