"""The flash kernel of a checked problem's device: flash and cross attention share it."""

from __future__ import annotations

import functools

from ..core.problem import finish_result


def run_flash_problem(problem, stream, step_tables=None, items=None):
    """(result, lse) of a checked problem through the flash kernel of its device: on CUDA
    with a plan's ``step_tables`` (its tables on the GPU, filled at need), on the CPU with a
    plan's work ``items`` (``None``: dealt for this call)."""
    if problem.device == "cuda":
        # kernel modules load at the first call; the function tile tables are made on the CPU
        from .cpu.function_tiles import with_tile_tables
        from .cuda.flash import run_flash_cuda

        result, lse = run_flash_cuda(with_tile_tables(problem), stream, step_tables)
    else:
        result, lse = _cpu_driver()(problem, items)
    return finish_result(problem, result, lse)


@functools.cache
def _cpu_driver():
    """The CPU flash driver with its 16-bit conversions, imported at the first call only (an
    import statement at every call costs about 1 us)."""
    from .cpu.convert import on_cpu
    from .cpu.flash import run_flash_cpu

    return functools.partial(on_cpu, run_flash_cpu, reads_16_bit=True)
