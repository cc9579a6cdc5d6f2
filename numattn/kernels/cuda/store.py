"""The CUDA kernel of ``store_kv``: new rows copied into a device cache's slots, one thread
per element (float32 and float64 caches; the slots are found on the host)."""

from __future__ import annotations

from ...core.device import require_cuda
from ...core.jit import cuda, cuda_kernel

#: Threads per block.
THREADS = 256


def run_store_cuda(blocks, pages, slots, new_rows, stream=0):
    """``blocks[pages[i], slots[i]] = new_rows[i]`` (converted to the cache's dtype) for every
    row ``i``; ``blocks`` ``[pages, page_size, Hkv, D]``, ``pages`` and ``slots`` int64
    ``[T]``, ``new_rows`` ``[T, Hkv, D]``, device arrays all; queued on ``stream``."""
    size = new_rows.size
    if size == 0:
        return
    require_cuda()
    cuda_kernel(_store_cuda_kernel)[-(-size // THREADS), THREADS, stream](blocks, pages, slots,
                                                                         new_rows)


def _store_cuda_kernel(blocks, pages, slots, new_rows):
    i = cuda.grid(1)
    rows, num_kv_heads, head_dim = new_rows.shape
    if i < rows * num_kv_heads * head_dim:
        row = i // (num_kv_heads * head_dim)
        head = i // head_dim % num_kv_heads
        d = i % head_dim
        blocks[pages[row], slots[row], head, d] = new_rows[row, head, d]
