"""Test configuration: seeded RNG per test, CUDA availability, PTX compilation without a GPU."""

from __future__ import annotations

import os

import numpy as np
import pytest

CUDASIM = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded from the test's name (reproducible, not zeros)."""
    seed = abs(hash(request.node.nodeid)) % (2**32)
    return np.random.default_rng(seed)


@pytest.fixture(params=["decode kernels", "flash kernel"])
def both_cpu_paths(request, monkeypatch):
    """Runs a flash or cross test through each CPU path: decode's kernels (which take
    problems of at most ``flash.MULTI_QUERY_MAX_LEN`` query rows per sequence; here every
    problem) and the flash kernel's tile GEMMs (here every problem)."""
    from numattn.kernels.cpu import flash

    everything = request.param == "decode kernels"
    monkeypatch.setattr(flash, "MULTI_QUERY_MAX_LEN", 2**62 if everything else 0)
    monkeypatch.setattr(flash, "MULTI_QUERY_MIN_WORK", -1)
    monkeypatch.setattr(flash, "MULTI_QUERY_MIN_ACTIVE", 0)
    monkeypatch.setattr(flash, "MULTI_QUERY_MIN_KEYS_PER_ROW", 0)
    return request.param


def cuda_runnable() -> bool:
    from numattn.core import device as _cuda

    return _cuda.is_available()


_REQUIRES_CUDA_REASON = "needs a CUDA GPU or the CUDA simulator (tox -e cudasim runs these)"

#: CUDA semantics tests: they run under the simulator (tox -e cudasim) or on a GPU.  Tests
#: carrying it (and PTX tests using ``ptx_compiler``) also get the ``cuda`` marker, which is
#: what ``tox -e cudasim`` selects.
requires_cuda = pytest.mark.skipif(not cuda_runnable(), reason=_REQUIRES_CUDA_REASON)


def pytest_collection_modifyitems(config, items):
    for item in items:
        skips = item.iter_markers("skipif")
        if any(m.kwargs.get("reason") == _REQUIRES_CUDA_REASON for m in skips):
            item.add_marker(pytest.mark.cuda)
        elif "ptx_compiler" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ptx)


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
