"""Argument checks shared by every public function.

Each check raises ``TypeError`` (wrong kind of object or dtype) or ``ValueError`` (wrong
shape or value) with a message naming the argument, what was expected and what was
given.  They run on the host before any kernel is launched, so nothing is ever written
when an argument is rejected.
"""

from __future__ import annotations

import math

import numpy as np

from .device import is_device_array
from .dtypes import KV_DTYPE_NAMES, Q_DTYPE_NAMES

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
INT64 = np.dtype(np.int64)
INT64_MAX = int(np.iinfo(np.int64).max)


def shape_of(x):
    """Shape of a host or device array as a tuple of Python ints."""
    if isinstance(x, np.ndarray):
        return x.shape
    return tuple(int(n) for n in x.shape)


def dtype_of(x):
    """NumPy dtype of a host or device array (anything with a NumPy-like ``dtype``)."""
    if type(x) is np.ndarray:
        return x.dtype
    try:
        return np.dtype(x.dtype)
    except TypeError as exc:
        interface = getattr(x, "__cuda_array_interface__", None)  # e.g. a torch CUDA tensor
        if interface is not None:
            return np.dtype(interface["typestr"])
        raise TypeError(f"cannot interpret dtype {x.dtype!r} as a NumPy dtype") from exc


def check_array(name, x, *, ndim=None, dtype=None):
    """Check that ``x`` is an array (host or device) of the given ndim (int or tuple)."""
    if type(x) is np.ndarray and dtype is None and (ndim is None or x.ndim == ndim):
        return x  # the common case, in a few operations (every call checks several)
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if not isinstance(x, np.ndarray) and not is_device_array(x):
        kind = f"{type(x).__module__}.{type(x).__name__}"
        hint = " (pass tensor.numpy())" if kind.startswith("torch.") else ""
        raise TypeError(f"{name} must be a NumPy array or a CUDA device array, got {kind}{hint}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if len(x.shape) not in allowed:
            want = " or ".join(f"{n}-d" for n in allowed)
            raise ValueError(f"{name} must be {want}, got shape {shape_of(x)}")
    if dtype is not None and dtype_of(x) != np.dtype(dtype):
        raise TypeError(f"{name} must have dtype {np.dtype(dtype)}, got {dtype_of(x)}")
    return x


def check_q_dtype(name, x):
    """A dtype queries and outputs may have: float64, float32, float16 or bfloat16."""
    dt = x.dtype if type(x) is np.ndarray else dtype_of(x)
    if dt not in FLOAT_DTYPES and dt.name not in Q_DTYPE_NAMES:
        raise TypeError(f"{name} must be float64, float32, float16 or bfloat16, got {dt}")
    return dt


def check_kv_dtype(name, x):
    """A dtype K and V may be stored in: those of :func:`check_q_dtype`, float8_e4m3fn,
    float8_e5m2 or int8."""
    dt = x.dtype if type(x) is np.ndarray else dtype_of(x)
    if dt not in FLOAT_DTYPES and dt.name not in KV_DTYPE_NAMES:
        raise TypeError(f"{name} must be float64, float32, float16, bfloat16, float8_e4m3fn, "
                        f"float8_e5m2 or int8, got {dt}")
    return dt


def check_shape(name, x, expected, what=""):
    """``expected`` is a tuple whose ``None`` entries match anything."""
    shape = shape_of(x)
    ok = len(shape) == len(expected) and all(
        e is None or s == e for s, e in zip(shape, expected)
    )
    if not ok:
        want = "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
        suffix = f" ({what})" if what else ""
        raise ValueError(f"{name} must have shape {want}{suffix}, got {list(shape)}")


def to_host(x):
    """``x`` itself if it is not a device array, else a host (NumPy) copy of it: Numba's
    device arrays (also the CUDA simulator's) and anything with
    ``__cuda_array_interface__``."""
    if isinstance(x, np.ndarray) or not is_device_array(x):
        return x
    if hasattr(x, "copy_to_host"):
        return x.copy_to_host()
    from .device import get_cuda

    return get_cuda().as_cuda_array(x).copy_to_host()


def host_int_array(name, x, *, ndim=1):
    """A host int64 copy of an integer index array (host or device)."""
    if (type(x) is np.ndarray and x.dtype == INT64 and x.ndim == ndim
            and x.flags.c_contiguous):
        return x  # already one (as np.ascontiguousarray below would return it)
    x = to_host(x)
    if not isinstance(x, np.ndarray):
        if isinstance(x, (list, tuple)):
            try:
                x = np.asarray(x)
            except ValueError as exc:  # ragged nesting
                raise ValueError(
                    f"{name} must be a rectangular sequence of integers, got a ragged "
                    f"{type(x).__name__}"
                ) from exc
        else:
            raise TypeError(f"{name} must be an integer array, got {type(x).__name__}")
    if x.dtype.kind not in "iu":
        if x.size == 0 and x.dtype.kind == "f":
            x = x.astype(np.int64)
        else:
            raise TypeError(f"{name} must have an integer dtype, got {x.dtype}")
    if x.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-d, got shape {list(x.shape)}")
    if x.dtype.kind == "u" and x.size and int(x.max()) > INT64_MAX:
        raise ValueError(f"{name} holds values too large for int64")
    return np.ascontiguousarray(x, dtype=np.int64)


def check_row_offsets(name, offsets, total, total_name, *, batch=None):
    """Validate ragged row offsets: length B + 1, start 0, non-decreasing, end ``total``."""
    offsets = host_int_array(name, offsets)
    if offsets.shape[0] < 1:
        raise ValueError(f"{name} must have length B + 1 >= 1, got length 0")
    if batch is not None and offsets.shape[0] != batch + 1:
        raise ValueError(
            f"{name} must have length B + 1 = {batch + 1}, got length {offsets.shape[0]}"
        )
    if offsets[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {offsets[0]}")
    decreasing = offsets[1:] < offsets[:-1]
    if decreasing.any():
        bad = int(np.argmax(decreasing))
        raise ValueError(
            f"{name} must be non-decreasing, but {name}[{bad + 1}] = {offsets[bad + 1]} < "
            f"{name}[{bad}] = {offsets[bad]}"
        )
    if offsets[-1] != total:
        raise ValueError(
            f"{name}[-1] must equal {total_name} = {total}, got {offsets[-1]}"
        )
    return offsets


def row_counts(offsets):
    """Rows of each sequence, ``offsets[b + 1] - offsets[b]``, of int64 row offsets (what
    ``np.diff`` gives, without its few microseconds of Python on every call)."""
    return offsets[1:] - offsets[:-1]


def check_scale(scale, head_dim, dtype=np.float64):
    """``None`` means ``1 / sqrt(D)``; otherwise a real number, finite in ``dtype`` (the
    kernels scale in the queries' dtype)."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    if isinstance(scale, np.ndarray) and scale.ndim == 0 and scale.dtype.kind in "iuf":
        scale = scale.item()  # a 0-d array holding a number
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
    try:
        value = float(scale)
    except OverflowError:  # an int past the float64 range
        raise ValueError("scale must be finite, got an integer past the float64 range") from None
    if not np.isfinite(value):
        raise ValueError(f"scale must be finite, got {value}")
    if abs(value) > float(np.finfo(dtype).max):
        raise ValueError(f"scale {value} overflows {np.dtype(dtype)}, the queries' dtype")
    return value


def check_sink_weights(sink_weights, num_heads, dtype):
    """``None`` or a ``[H]`` float array; returned as a contiguous host array of ``dtype``."""
    if sink_weights is None:
        return None
    if isinstance(sink_weights, (list, tuple)):
        sink_weights = np.asarray(sink_weights, dtype=np.float64)
    sink_weights = to_host(sink_weights)
    check_array("sink_weights", sink_weights, ndim=1)
    check_q_dtype("sink_weights", sink_weights)
    check_shape("sink_weights", sink_weights, (num_heads,), "one logit per query head")
    return np.ascontiguousarray(sink_weights, dtype=dtype)


def check_heads(q_heads, kv_heads):
    if kv_heads < 1 or q_heads % kv_heads != 0:
        raise ValueError(
            f"the number of query heads ({q_heads}) must be a multiple of the number of "
            f"key/value heads ({kv_heads})"
        )
    return q_heads // kv_heads


def _address_range(x):
    """``(first, last + 1)``: the byte addresses a device array may touch, or ``None`` for
    an object that says nothing of its memory."""
    if hasattr(x, "__cuda_array_interface__"):
        interface = x.__cuda_array_interface__
        address, strides = interface["data"][0], interface.get("strides")
    elif isinstance(getattr(x, "_ary", None), np.ndarray):  # the CUDA simulator's arrays
        address, strides = x._ary.__array_interface__["data"][0], x._ary.strides
    else:
        return None
    shape = shape_of(x)
    itemsize = dtype_of(x).itemsize
    if strides is None:  # C-contiguous
        strides = np.cumprod((itemsize, *shape[:0:-1]))[::-1].tolist()
    if 0 in shape:
        return address, address
    first = last = address
    for n, stride in zip(shape, strides):
        if stride < 0:
            first += (n - 1) * stride
        else:
            last += (n - 1) * stride
    return first, last + itemsize


def spans_overlap(a, b):
    """Whether device arrays ``a`` and ``b`` span overlapping addresses (``False`` where one
    says nothing of its memory)."""
    ra, rb = _address_range(a), _address_range(b)
    return ra is not None and rb is not None and ra[0] < rb[1] and rb[0] < ra[1]


def same_elements(a, b):
    """Whether ``a`` and ``b`` are arrays over exactly the same elements, as ``q`` and
    ``out=q`` are: NumPy arrays of the same address, shape and strides, or C-contiguous
    device arrays over the same addresses (a padded ``q`` is read as its rows)."""
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
                and a.shape == b.shape and a.strides == b.strides)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return False
    ra, rb = _address_range(a), _address_range(b)
    return ra is not None and ra == rb and math.prod(shape_of(a)) == math.prod(shape_of(b))


def check_no_overlap(out, inputs):
    """``out`` must not share memory with any array in ``inputs`` (name -> array or None):
    the kernel would read what it has already overwritten.  Host and device arrays both
    (compared by the address ranges they span, as ``np.may_share_memory`` does)."""
    if out is None or all(x is None for x in inputs.values()):
        return
    if isinstance(out, np.ndarray):  # the same test, done by NumPy (most calls)
        for name, x in inputs.items():
            if isinstance(x, np.ndarray) and np.may_share_memory(out, x):
                raise ValueError(f"out must not overlap {name}")
        return  # device arrays are in another address space
    out_range = _address_range(out)
    if out_range is None:
        return
    out_first, out_last = out_range
    for name, x in inputs.items():  # host inputs are in another address space
        x_range = None if x is None or isinstance(x, np.ndarray) else _address_range(x)
        if x_range is None:
            continue
        first, last = x_range
        if max(first, out_first) < min(last, out_last):  # empty ranges overlap nothing
            raise ValueError(f"out must not overlap {name}")


def check_out(out, shape, dtype, name="out", *, or_float32=False):
    """``out=`` must be a C-contiguous array of exactly the result's shape and dtype (or
    float32, with ``or_float32``)."""
    if out is None:
        return None
    if type(out) is np.ndarray and out.shape == tuple(shape) and out.dtype == dtype:
        flags = out.flags
        if flags.c_contiguous and flags.writeable:
            return out  # the common case, in a few operations
    check_array(name, out)
    if shape_of(out) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(shape_of(out))}")
    allowed = {np.dtype(dtype)} | ({np.dtype(np.float32)} if or_float32 else set())
    if dtype_of(out) not in allowed:
        want = " or ".join(sorted(str(d) for d in allowed))
        raise TypeError(f"{name} must have dtype {want}, got {dtype_of(out)}")
    if isinstance(out, np.ndarray):
        if not out.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous")
        if not out.flags.writeable:
            raise ValueError(f"{name} must be writeable")
    return out
