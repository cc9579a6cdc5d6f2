"""The CUDA kernel of ``merge_states``: one block per row, threads over the head dimension,
with the shared merge body (:func:`numattn.kernels.shared.softmax.merge_partials`)."""

from __future__ import annotations

from ...core.device import require_cuda
from ...core.jit import cuda, cuda_kernel
from ..shared.softmax import merge_partials

#: Threads per block: a row's head dimension is split over them.
THREADS = 64


def run_merge_cuda(part_out, part_lse, out, lse, stream=0):
    """Merge ``part_out [P, R, D]`` / ``part_lse [P, R]`` into ``out [R, D]``, ``lse [R]``,
    device arrays all (C-contiguous), queued on ``stream``."""
    num_parts, rows, head_dim = part_out.shape
    if rows == 0:
        return
    require_cuda()
    cuda_kernel(_merge_cuda_kernel)[rows, THREADS, stream](
        part_out.reshape(1, num_parts, rows, head_dim), part_lse.reshape(1, num_parts, rows),
        out.reshape(1, rows, head_dim), lse)


def _merge_cuda_kernel(part_acc, part_m, out, lse):
    # finished parts (lse_p, out_p): states (lse_p, 1, out_p), without a sink, as a batch of 1
    r = cuda.blockIdx.x
    d0 = cuda.threadIdx.x
    row_lse = merge_partials(part_m, part_m, part_acc, 0, r, True, part_m[0, 0, r], False, d0,
                             cuda.blockDim.x, out)
    if d0 == 0:
        lse[r] = row_lse
