"""Arrays from other libraries: CPU objects with ``__dlpack__`` read in place.

PyTorch CPU tensors, JAX CPU arrays and anything else that speaks DLPack become NumPy
arrays over the same memory (``np.from_dlpack``), so a cache held by another library is
read, and written by ``store_kv``, where it lives.  NumPy's DLPack importer has no
bfloat16; such a tensor is imported through an int16 view of its bits and viewed back as
``ml_dtypes.bfloat16`` (PyTorch's ``Tensor.view(dtype)``, or any object with the same
method), still without a copy.  Objects with ``__cuda_array_interface__`` are device arrays
(and the CUDA simulator's) and are left to the CUDA backend.
"""

from __future__ import annotations

import numpy as np

from .device import is_device_array

__all__ = ["as_array", "as_arrays"]

_DLPACK_CPU = 1  # kDLCPU


def as_array(name, x):
    """``x`` as an array numattn reads: NumPy arrays, device arrays and everything that is
    not an array are returned as they are (the checks that follow name them); a CPU object
    with ``__dlpack__`` becomes a NumPy array over its memory.

    Raises
    ------
    TypeError
        If ``x`` has ``__dlpack__`` but lives on another device, or has a dtype NumPy
        cannot take even through a view of its bits.
    """
    if type(x) is np.ndarray or not hasattr(x, "__dlpack__") or is_device_array(x):
        return x
    device = x.__dlpack_device__()[0] if hasattr(x, "__dlpack_device__") else _DLPACK_CPU
    if int(device) != _DLPACK_CPU:
        kind = f"{type(x).__module__}.{type(x).__name__}"
        raise TypeError(f"{name}: a {kind} on DLPack device {int(device)} is neither a CPU "
                        "array nor a CUDA device array numattn can read")
    try:
        return np.from_dlpack(x)
    except (BufferError, RuntimeError, TypeError, ValueError) as exc:
        if "bfloat16" not in str(getattr(x, "dtype", "")):
            raise TypeError(f"{name}: cannot read {type(x).__name__} of dtype "
                            f"{getattr(x, 'dtype', '?')} through DLPack ({exc})") from exc
    return _bfloat16_from_bits(x)


def as_arrays(**named):
    """:func:`as_array` of each keyword argument, in their order (a tuple)."""
    return tuple(as_array(name, x) for name, x in named.items())


def _bfloat16_from_bits(x):
    """A bfloat16 array through its bits (the same memory): a PyTorch tensor's int16 view,
    else ``np.asarray`` (JAX hands NumPy ``ml_dtypes.bfloat16`` arrays itself)."""
    from .dtypes import ml_dtype

    if not type(x).__module__.startswith("torch"):
        return np.asarray(x)
    import torch

    return np.from_dlpack(x.view(torch.int16)).view(ml_dtype("bfloat16"))
