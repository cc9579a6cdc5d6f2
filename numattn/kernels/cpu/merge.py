"""The CPU kernel of ``merge_states``: rows merged in parallel with the shared merge body
(:func:`numattn.kernels.shared.softmax.merge_partials`)."""

from __future__ import annotations

from ...core.jit import cpu_jit, prange
from ..shared.softmax import merge_partials

#: Merges of up to this many partial-output elements run on the calling thread: waking the
#: worker threads costs more than it saves on such work.
SERIAL_ELEMENTS = 2**18


def run_merge_cpu(part_out, part_lse, out, lse):
    """Merge ``part_out [P, R, D]`` / ``part_lse [P, R]`` into ``out [R, D]``, ``lse [R]``."""
    parallel = part_out.size > SERIAL_ELEMENTS
    cpu_jit(_merge_kernel, parallel=parallel)(part_out, part_lse, out, lse)


def _merge_kernel(part_out, part_lse, out, lse):
    # finished parts (lse_p, out_p): states (lse_p, 1, out_p), without a sink, as a batch of 1
    num_parts, rows, head_dim = part_out.shape
    part_m = part_lse.reshape(1, num_parts, rows)
    part_acc = part_out.reshape(1, num_parts, rows, head_dim)
    out_rows = out.reshape(1, rows, head_dim)
    for r in prange(rows):
        lse[r] = merge_partials(part_m, part_m, part_acc, 0, r, True, part_m[0, 0, r], False,
                                0, 1, out_rows)
