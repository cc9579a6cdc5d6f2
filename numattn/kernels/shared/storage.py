"""Reading one stored K/V element in the compute dtype (both targets).

Caches of 16- and 8-bit floats reach the kernels as views of their bits
(:func:`numattn.core.dtypes.kernel_view`) with a format code; :func:`stored_value` widens
one element, exactly (every such value is a float32).  The CPU's vector code widens whole
rows with the same rules (:mod:`numattn.kernels.cpu.simd_llvm`); this body serves the
element-by-element paths and the CUDA kernels.
"""

from __future__ import annotations

import math

from ...core.dtypes import (
    FORMAT_BFLOAT16,
    FORMAT_E4M3,
    FORMAT_E5M2,
    FORMAT_FLOAT16,
)
from ...core.jit import body


@body
def minifloat(bits, exp_bits, man_bits, finite_only, like):
    """The value of the float whose ``1 + exp_bits + man_bits`` low bits are ``bits``
    (IEEE layout; ``finite_only``: no infinities, all ones is NaN, as float8_e4m3fn), in
    the dtype of the array ``like`` (exact: every 16- and 8-bit float is a float32)."""
    man_mask = (1 << man_bits) - 1
    exp_max = (1 << exp_bits) - 1
    sign = (bits >> (exp_bits + man_bits)) & 1
    e = (bits >> man_bits) & exp_max
    m = bits & man_mask
    bias = (1 << (exp_bits - 1)) - 1
    if finite_only:
        if e == exp_max and m == man_mask:
            return like.dtype.type(math.nan)
    elif e == exp_max:
        special = like.dtype.type(math.inf) if m == 0 else like.dtype.type(math.nan)
        return -special if sign else special
    if e == 0:
        value = math.ldexp(like.dtype.type(m), 1 - bias - man_bits)
    else:
        value = math.ldexp(like.dtype.type(m + (1 << man_bits)), e - bias - man_bits)
    return -value if sign else value


@body
def stored_value(x, kv_format, like):
    """Element ``x`` of a kernel view of K/V, in the dtype of the array ``like`` (the
    compute dtype): the value itself for float32/float64/int8 storage (int8's scale is
    applied by the caller), else the float its bits hold.  (``int(x)`` in every branch:
    Numba types the branches of float storage too, where no bit operation applies.)"""
    if kv_format == FORMAT_BFLOAT16:
        return minifloat(int(x) & 0xFFFF, 8, 7, False, like)
    if kv_format == FORMAT_FLOAT16:
        return minifloat(int(x) & 0xFFFF, 5, 10, False, like)
    if kv_format == FORMAT_E4M3:
        return minifloat(int(x) & 0xFF, 4, 3, True, like)
    if kv_format == FORMAT_E5M2:
        return minifloat(int(x) & 0xFF, 5, 2, False, like)
    return like.dtype.type(x)
