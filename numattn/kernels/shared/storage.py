"""Reading and writing one stored K/V element (both targets).

Caches of 16- and 8-bit floats reach the kernels as views of their bits
(:func:`numattn.core.dtypes.kernel_view`) with a format code; :func:`stored_value` widens
one element, exactly (every such value is a float32).  The CPU's vector code widens whole
rows with the same rules (:mod:`numattn.kernels.cpu.simd_llvm`); this body serves the
element-by-element paths and the CUDA kernels.  :func:`stored_bits` rounds a value to a
format's bits as ``ml_dtypes`` does (the CUDA kernel of ``store_kv``; the CPU stores with
``ml_dtypes`` itself), in arithmetic only: CUDA has no view of a float's bits.
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


@body
def round_half_even(x):
    """``x`` rounded to the nearest integer, ties to even (as ``np.rint``), as a float."""
    whole = math.floor(x)
    rest = x - whole
    if rest > 0.5 or (rest == 0.5 and whole % 2 != 0):
        whole += 1
    return whole


@body
def minifloat_bits(x, exp_bits, man_bits, finite_only):
    """The ``1 + exp_bits + man_bits`` bits of the float nearest ``x`` (ties to even) in an
    IEEE-like format (``finite_only``: no infinities, all ones is NaN, as float8_e4m3fn, where
    a value past the largest rounds to NaN); NaN keeps its sign, as ``ml_dtypes`` does.
    Rounded from ``x`` itself (a float64 is not rounded to float32 first)."""
    man_mask = (1 << man_bits) - 1
    exp_max = (1 << exp_bits) - 1
    bias = (1 << (exp_bits - 1)) - 1
    sign = (1 << (exp_bits + man_bits)) if math.copysign(1.0, x) < 0 else 0
    nan = sign | ((exp_max << man_bits) | (man_mask if finite_only else 1 << (man_bits - 1)))
    if x != x:
        return nan
    a = abs(x)
    if a == math.inf:
        return nan if finite_only else sign | (exp_max << man_bits)
    if a == 0:
        return sign
    _, e = math.frexp(a)  # a = m * 2**e, 0.5 <= m < 1: its leading bit is 2**(e - 1)
    e = max(e - 1, 1 - bias)  # below the smallest normal: the subnormals' quantum
    n = round_half_even(math.ldexp(a, man_bits - e))  # significand, in units of the last bit
    if n >= 2 << man_bits:  # rounded up to the next power of two
        n, e = n / 2, e + 1
    n = int(n)
    field = e + bias if n >= 1 << man_bits else 0
    if finite_only:
        if field > exp_max or (field == exp_max and (n & man_mask) == man_mask):
            return nan
    elif field >= exp_max:
        return sign | (exp_max << man_bits)
    return sign | (field << man_bits) | (n & man_mask)


@body
def stored_bits(x, kv_format):
    """The value ``x`` as an element of a kernel view of K/V (:func:`stored_value`'s
    inverse, rounded to nearest even): the bits of a 16- or 8-bit float (float16's as a
    signed int16), or ``x`` rounded for int8 (scaled into [-127, 127] by the caller; NaN,
    whose row has a NaN scale, as 0)."""
    if kv_format == FORMAT_BFLOAT16:
        return minifloat_bits(x, 8, 7, False)
    if kv_format == FORMAT_FLOAT16:
        bits = minifloat_bits(x, 5, 10, False)
        return bits - 0x10000 if bits >= 0x8000 else bits
    if kv_format == FORMAT_E4M3:
        return minifloat_bits(x, 4, 3, True)
    if kv_format == FORMAT_E5M2:
        return minifloat_bits(x, 5, 2, False)
    return int(round_half_even(x)) if x == x else 0
