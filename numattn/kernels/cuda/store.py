"""The CUDA kernels of ``store_kv``: new rows written into a device cache's slots (the slots
are found on the host).  float32 and float64 caches take one thread per element; 16- and
8-bit caches one thread per (row, KV head), which finds the row's scale first where the
cache has scales and rounds each element to the format's bits as ``ml_dtypes`` does
(:func:`numattn.kernels.shared.storage.stored_bits`)."""

from __future__ import annotations

import numpy as np

from ...core.device import require_cuda
from ...core.dtypes import FORMAT_E4M3, FORMAT_NATIVE
from ...core.jit import cuda, cuda_kernel
from ..shared.storage import stored_bits

#: Threads per block.
THREADS = 256
#: The largest finite float8_e4m3fn: unscaled values past it are stored as it (saturated).
E4M3_MAX = 448.0


def run_store_cuda(blocks, pages, slots, new_rows, stream=0, kv_format=FORMAT_NATIVE,
                   scales=None, quant_max=0.0):
    """``blocks[pages[i], slots[i]] = new_rows[i]`` for every row ``i``, queued on
    ``stream``: converted to the cache's dtype (``kv_format`` ``FORMAT_NATIVE``), or rounded
    to the bits of a 16- or 8-bit format (``blocks`` its kernel view); with ``scales``
    ``[pages, page_size, Hkv]`` float32, each (row, head) is first divided by its scale,
    ``max |x| / quant_max``, which is stored there.  ``blocks`` ``[pages, page_size, Hkv,
    D]``, ``pages`` and ``slots`` int64 ``[T]``, ``new_rows`` ``[T, Hkv, D]`` float32 or
    float64 (float32 with scales), device arrays all."""
    rows, num_kv_heads, _ = new_rows.shape
    if new_rows.size == 0:
        return
    cuda_api = require_cuda()
    if kv_format == FORMAT_NATIVE:
        cuda_kernel(_store_cuda_kernel)[-(-new_rows.size // THREADS), THREADS, stream](
            blocks, pages, slots, new_rows)
        return
    has_scales = scales is not None
    if not has_scales:
        scales = cuda_api.device_array((1, 1, 1), np.float32, stream=stream)  # not read
        quant_max = 1.0
    cuda_kernel(_store_encoded_cuda_kernel)[-(-rows * num_kv_heads // THREADS), THREADS,
                                            stream](
        blocks, pages, slots, new_rows, np.int64(kv_format), scales, has_scales,
        np.float32(quant_max), kv_format == FORMAT_E4M3 and not has_scales,
        np.float32(E4M3_MAX))


def _store_cuda_kernel(blocks, pages, slots, new_rows):
    i = cuda.grid(1)
    rows, num_kv_heads, head_dim = new_rows.shape
    if i < rows * num_kv_heads * head_dim:
        row = i // (num_kv_heads * head_dim)
        head = i // head_dim % num_kv_heads
        d = i % head_dim
        blocks[pages[row], slots[row], head, d] = new_rows[row, head, d]


def _store_encoded_cuda_kernel(blocks, pages, slots, new_rows, kv_format, scales, has_scales,
                               quant_max, saturate, saturate_at):
    i = cuda.grid(1)
    rows, num_kv_heads, head_dim = new_rows.shape
    if i < rows * num_kv_heads:
        row = i // num_kv_heads
        head = i % num_kv_heads
        page = pages[row]
        slot = slots[row]
        safe = quant_max / quant_max  # 1, in float32
        if has_scales:
            largest = quant_max - quant_max  # 0, in float32; NaN once an element is NaN
            for d in range(head_dim):
                a = abs(new_rows[row, head, d])
                if a > largest or a != a:
                    largest = a
            scale = largest / quant_max
            scales[page, slot, head] = scale
            if scale > 0:
                safe = scale
        for d in range(head_dim):
            x = new_rows[row, head, d]
            if has_scales:
                x = min(max(x / safe, -quant_max), quant_max) if x == x else x
            elif saturate:
                x = min(max(x, -saturate_at), saturate_at) if x == x else x
            blocks[page, slot, head, d] = stored_bits(x, kv_format)
