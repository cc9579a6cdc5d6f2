"""The tile table of a call's FunctionMask functions, evaluated on the CPU before the kernels.

Built-in masks know the status of a whole tile from its corners; a function is evaluated
for every pair of the call once (FlexAttention's block masks), once for all heads where it
does not read ``h`` (else the table holds the union over heads), so that the kernels skip
the tiles it hides and test no pair of the tiles it shows whole.  Costs about one function
call per (query, key) pair, against the ``2 H D`` multiply-adds of the pair's attention.
"""

from __future__ import annotations

import numpy as np

from ...core.device import is_device_array, require_cuda
from ...core.functions import FUNCTION_TILE_KEYS, FUNCTION_TILE_ROWS
from ...core.jit import cpu_jit, prange
from ...core.masks import OP_FUNCTION
from ...core.validate import row_counts
from ..shared.masks import function_block

#: Tables of up to this many entries are filled on the calling thread.
SERIAL_ENTRIES = 4096


def with_tile_tables(problem):
    """``problem`` with the tile tables of its mask functions, evaluated now (captured
    values may change between calls) on the CPU, for either backend (on CUDA copied to the
    device); as it is without mask functions.  Captured device arrays cannot be read here:
    then every function tile is partial."""
    bound = problem.functions
    if bound is None or not bound.masks:
        return problem
    if any(is_device_array(c) for leaf in bound.masks for c in leaf.captures):
        return problem
    mask = problem.mask
    num_heads = problem.q.shape[1] if bound.per_head else 1
    tables = function_tile_table(mask.program, mask.functions, bound.special,
                                 row_counts(problem.q_offsets), problem.layout.num_keys,
                                 num_heads)
    if problem.device == "cuda":
        tables = require_cuda().to_device(tables)
    return problem._replace(mask=mask._replace(functions=(tables, *mask.functions[1:])))


def function_tile_table(program, functions, special, q_lens, num_keys, num_heads):
    """The uint8 table ``[functions, B, row blocks, key blocks]`` of
    :func:`numattn.kernels.shared.masks.function_tile` for a call.

    ``functions`` is the kernels' tuple (:func:`numattn.core.functions.kernel_functions`)
    without tables, ``special`` the call's specialization, ``num_heads`` the heads to
    evaluate (1 when no function reads ``h``).
    """
    count = int(np.count_nonzero(program[:, 0] == OP_FUNCTION))
    batch = num_keys.shape[0]
    row_blocks = max(-(-int(q_lens.max(initial=0)) // FUNCTION_TILE_ROWS), 1)
    key_blocks = max(-(-int(num_keys.max(initial=0)) // FUNCTION_TILE_KEYS), 1)
    table = np.zeros((count, batch, row_blocks, key_blocks), dtype=np.uint8)
    parallel = table.size > SERIAL_ENTRIES
    cpu_jit(_fill_table, parallel=parallel, special=special)(
        program, functions, q_lens, num_keys, num_heads, table)
    return table


def _fill_table(program, functions, q_lens, num_keys, num_heads, table):
    count, batch, row_blocks, key_blocks = table.shape
    q_start_pos = functions[1]
    for item in prange(count * batch * row_blocks):
        index = item // (batch * row_blocks)
        b = item // row_blocks % batch
        r0 = item % row_blocks * FUNCTION_TILE_ROWS
        r1 = min(r0 + FUNCTION_TILE_ROWS, q_lens[b])
        row = 0  # the program row of function `index`
        for i in range(program.shape[0]):
            if program[i, 0] == OP_FUNCTION and program[i, 1] == index:
                row = i
        for c in range(key_blocks):
            k0 = c * FUNCTION_TILE_KEYS
            k1 = min(k0 + FUNCTION_TILE_KEYS, num_keys[b])
            table[index, b, item % row_blocks, c] = function_block(
                program, row, functions, b, q_start_pos[b] + r0, q_start_pos[b] + r1, k0, k1,
                num_heads)
