"""The dtypes numattn computes in and the storage formats it reads K/V in.

Queries and outputs are float64, float32, float16 or ``ml_dtypes.bfloat16``; K/V may also
be ``ml_dtypes.float8_e4m3fn``, ``ml_dtypes.float8_e5m2`` or int8 (with per-(slot, KV head)
float32 scales held by a cache).  float64 queries with float64 K/V compute in float64,
everything else in float32.  Numba has no 16- or 8-bit float types, so the kernels read
K/V through an integer view of their bits (:func:`kernel_view`) and a format code
(``FORMAT_*``), and widen each element in registers
(:mod:`numattn.kernels.shared.storage`); no widened copy of a cache is ever made.

``ml_dtypes`` (the NumPy dtypes JAX and others use for bfloat16 and float8) is imported only
when a name here needs its dtype objects; the checks compare dtype names.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "FORMAT_BFLOAT16",
    "FORMAT_E4M3",
    "FORMAT_E5M2",
    "FORMAT_FLOAT16",
    "FORMAT_INT8",
    "FORMAT_NATIVE",
    "KV_DTYPE_NAMES",
    "Q_DTYPE_NAMES",
    "SIXTEEN_BIT_NAMES",
    "compute_dtype",
    "is_quantized",
    "kernel_view",
    "lse_dtype",
    "ml_dtype",
    "storage_format",
]

#: Format codes the kernels branch on (:func:`numattn.kernels.shared.storage.stored_value`).
FORMAT_NATIVE = 0  # float32 or float64, read as it is
FORMAT_BFLOAT16 = 1  # bits viewed as uint16
FORMAT_FLOAT16 = 2  # bits viewed as int16
FORMAT_E4M3 = 3  # float8_e4m3fn, bits viewed as uint8
FORMAT_E5M2 = 4  # float8_e5m2, bits viewed as uint8
FORMAT_INT8 = 5  # int8, with scales

#: q and ``out`` dtypes, by name.
Q_DTYPE_NAMES = ("float64", "float32", "float16", "bfloat16")
#: The 16-bit ones among them, which compute in float32.
SIXTEEN_BIT_NAMES = ("float16", "bfloat16")
#: K/V dtypes, by name.
KV_DTYPE_NAMES = (*Q_DTYPE_NAMES, "float8_e4m3fn", "float8_e5m2", "int8")

_FORMATS = {
    "float64": (FORMAT_NATIVE, None),
    "float32": (FORMAT_NATIVE, None),
    "bfloat16": (FORMAT_BFLOAT16, np.uint16),
    "float16": (FORMAT_FLOAT16, np.int16),
    "float8_e4m3fn": (FORMAT_E4M3, np.uint8),
    "float8_e5m2": (FORMAT_E5M2, np.uint8),
    "int8": (FORMAT_INT8, None),
}

FLOAT64 = np.dtype(np.float64)
FLOAT32 = np.dtype(np.float32)


def compute_dtype(q_dtype, kv_dtype):
    """float64 for float64 queries with float64 K/V, else float32: the dtype of scores,
    softmax state, accumulators and the kernels' results."""
    both_64 = np.dtype(q_dtype) == FLOAT64 and np.dtype(kv_dtype) == FLOAT64
    return FLOAT64 if both_64 else FLOAT32


def lse_dtype(q_dtype):
    """The LSE's dtype: float64 for float64 queries, else float32."""
    return FLOAT64 if np.dtype(q_dtype) == FLOAT64 else FLOAT32


def storage_format(dtype):
    """The ``FORMAT_*`` code of a K/V dtype (``KeyError`` for one that is not)."""
    return _FORMATS[np.dtype(dtype).name][0]


def is_quantized(dtype):
    """Whether K/V of this dtype may carry scales (int8 must; float8 may)."""
    return np.dtype(dtype).name in ("int8", "float8_e4m3fn", "float8_e5m2")


def kernel_view(blocks):
    """``blocks`` as the kernels read it: float32/float64/int8 as they are, the 16- and 8-bit
    float formats as a view of their bits (the same memory, never a copy)."""
    view = _FORMATS[blocks.dtype.name][1]
    return blocks if view is None else blocks.view(view)


def ml_dtype(name):
    """The ``ml_dtypes`` dtype called ``name`` (``bfloat16``, ``float8_e4m3fn``, ...)."""
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, name))
