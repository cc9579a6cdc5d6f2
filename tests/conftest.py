"""Test configuration: a seeded generator per test, the backends a numeric test runs on
(the ``device`` fixture), CUDA availability, PTX compilation without a GPU."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest

CUDASIM = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded from the test's name (reproducible, not zeros)."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def cuda_runnable() -> bool:
    from numattn.core import device as _cuda

    return _cuda.is_available()


_REQUIRES_CUDA_REASON = "needs a CUDA GPU or the CUDA simulator (tox -e cudasim runs these)"

#: CUDA semantics tests: they run under the simulator (tox -e cudasim) or on a GPU.  Tests
#: carrying it also get the ``cuda`` marker, which is what ``tox -e cudasim`` selects (and
#: tests using ``ptx_compiler`` get the ``ptx`` marker).
requires_cuda = pytest.mark.skipif(not cuda_runnable(), reason=_REQUIRES_CUDA_REASON)

#: The marks of a parameter set that runs CUDA kernels.
CUDA_MARKS = (pytest.mark.cuda, requires_cuda)

#: The CPU runs flash and cross attention through either of two kernels (see
#: :func:`route_cpu_path`): their tests run through each, on these ``device`` parameters.
CPU_PATHS = ("cpu:decode kernels", "cpu:flash kernel")


def cuda_param(*values):
    """The parameter set ``("cuda", *values)``, marked ``cuda`` and skipped (with the reason)
    where neither a GPU nor the simulator is present."""
    return pytest.param("cuda", *values, marks=CUDA_MARKS)


#: The ``device`` fixture's parameters: every numeric test runs on each backend.
DEVICES = ("cpu", cuda_param())


def on_devices(cpu_cases, cuda_cases, *, cpu=("cpu",)):
    """Parameter sets ``(device, *case)`` for ``parametrize(..., indirect=["device"])``:
    every case of ``cpu_cases`` on each device of ``cpu`` (``"cpu"`` or :data:`CPU_PATHS`),
    and every case of ``cuda_cases`` on CUDA (tiny ones: the simulator runs kernels as
    Python, so the CUDA cases are a chosen few where the CPU's are a full product).  A case
    is a tuple, or a ``pytest.param`` whose marks (``slow``) the parameter sets keep."""
    def values_and_marks(case):
        if hasattr(case, "marks"):  # a pytest.param
            return case.values, case.marks
        return case, ()

    cpu_sets = [pytest.param(device, *values, marks=marks)
                for values, marks in map(values_and_marks, cpu_cases) for device in cpu]
    cuda_sets = [pytest.param("cuda", *values, marks=(*CUDA_MARKS, *marks))
                 for values, marks in map(values_and_marks, cuda_cases)]
    return cpu_sets + cuda_sets


#: float32, and float64 marked ``slow``: for tests whose float64 case would compile, in the
#: fast tier, a specialisation that nothing else there needs (float64 on the worker threads,
#: say), while float32 takes the same path.
FLOAT32_FAST = (np.float32, pytest.param(np.float64, marks=pytest.mark.slow))


def route_cpu_path(monkeypatch, path):
    """Sends every flash and cross problem of the test through one CPU path: ``"decode
    kernels"`` (which take problems of at most ``flash.MULTI_QUERY_MAX_LEN`` query rows per
    sequence; here every problem) or ``"flash kernel"`` (its tile GEMMs; here every one)."""
    from numattn.kernels.cpu import flash

    everything = path == "decode kernels"
    monkeypatch.setattr(flash, "MULTI_QUERY_MAX_LEN", 2**62 if everything else 0)
    monkeypatch.setattr(flash, "MULTI_QUERY_MIN_WORK", -1)
    monkeypatch.setattr(flash, "MULTI_QUERY_MIN_ACTIVE", 0)
    monkeypatch.setattr(flash, "MULTI_QUERY_MIN_KEYS_PER_ROW", 0)


def use_device(param, monkeypatch):
    """The ``device`` argument for an operation, from a ``device`` parameter: ``"cpu"``,
    ``"cuda"``, or one of :data:`CPU_PATHS` (routed there, and ``"cpu"`` returned)."""
    device, _, path = param.partition(":")
    if path:
        route_cpu_path(monkeypatch, path)
    return device


@pytest.fixture(params=CPU_PATHS)
def both_cpu_paths(request, monkeypatch):
    """Runs a CPU-only test of flash or cross attention through each CPU path."""
    return use_device(request.param, monkeypatch)


@pytest.fixture(params=DEVICES)
def device(request, monkeypatch):
    """The backend a numeric test runs on: ``"cpu"`` or ``"cuda"``.  Modules whose
    operations run through both CPU paths override it with :data:`CPU_PATHS`; a test whose
    CUDA cases differ from its CPU ones parametrises it with :func:`on_devices`."""
    return use_device(request.param, monkeypatch)


def pytest_collection_modifyitems(config, items):
    for item in items:
        skips = item.iter_markers("skipif")
        if any(m.kwargs.get("reason") == _REQUIRES_CUDA_REASON for m in skips):
            item.add_marker(pytest.mark.cuda)
        elif "ptx_compiler" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ptx)
    # Tests marked ``last`` start processes that load the kernels the other tests compiled
    # from the shared disk cache: run after them, `numattn check` takes 5 s instead of 110.
    items.sort(key=lambda item: item.get_closest_marker("last") is not None)


def _nvvm_available() -> bool:
    if CUDASIM:
        return False
    try:
        from numattn.core.device import get_cuda

        get_cuda()  # numba-cuda, not numba's own numba.cuda
        from numba.cuda.cudadrv import nvvm

        return nvvm.is_available()
    except Exception:
        return False


@pytest.fixture
def ptx_compiler(monkeypatch):
    """``compile(kernel_pyfunc, signature)`` -> PTX for ``cc=(9, 0)``, with no GPU present.

    Compiling a kernel that calls device functions asks numba for the current device's
    compute capability; a fake device answers (9, 0) so the compile-check runs on a
    GPU-less machine.  Skips (with the reason) where NVVM is missing or under the simulator.
    """
    if not _nvvm_available():
        pytest.skip("needs numba-cuda and NVVM from the 'cuda' extra (numba-cuda[cu12]) and "
                    "no simulator")
    from numba.cuda import compile_ptx
    from numba.cuda import dispatcher as cuda_dispatcher

    from numattn.core.jit import cuda_source

    class _FakeDevice:
        compute_capability = (9, 0)

    monkeypatch.setattr(cuda_dispatcher, "get_current_device", lambda: _FakeDevice())

    def compile(kernel, signature):
        ptx, _ = compile_ptx(cuda_source(kernel), signature, cc=(9, 0))
        assert ".target sm_90" in ptx
        return ptx

    return compile
