"""The kernel modules, and the private names in them, that tests reach into: named here
once, so that a rename inside :mod:`numattn.kernels` is followed in this file only.

Tests patch the modules' tuning constants (``monkeypatch.setattr(cpu_split_k,
"SERIAL_KV_BYTES", 0)``), spy on their drivers by the function's ``__name__``, compile
CUDA kernels to PTX and call helpers on their own.
"""

from __future__ import annotations

from numattn.kernels.cpu import flash as cpu_flash
from numattn.kernels.cpu import split_k as cpu_split_k
from numattn.kernels.cuda import flash as cuda_flash
from numattn.kernels.cuda import split_k as cuda_split_k

# CPU split-K decode: the driver of the partition kernel, the tile length, the schedule of
# (sequence, partition) items over threads, the reduction kernel, and the block helpers.
partial_states_cpu = cpu_split_k._partial_states_cpu
cpu_tile_keys = cpu_split_k._cpu_tile_keys
partition_schedule = cpu_split_k._partition_schedule
decode_reduce_cpu = cpu_split_k._decode_reduce_cpu
block_rows = cpu_split_k._block_rows
tile_rows = cpu_split_k._tile_rows

# CPU flash: the context that holds BLAS to one thread while a kernel runs.
blas_single_thread = cpu_flash._blas_single_thread

# CUDA kernels (compiled to PTX by the tests) and the host-side tiling of cross attention.
decode_partitions_cuda = cuda_split_k._decode_partitions_cuda
decode_reduce_cuda = cuda_split_k._decode_reduce_cuda
flash_cuda_kernel = cuda_flash._flash_cuda_kernel
cuda_cross_tiles = cuda_flash._cuda_tiles
cuda_cross_shared_bytes = cuda_flash._shared_bytes

