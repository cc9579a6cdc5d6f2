"""Package-level promises: a light import, lazy CUDA, the write-once binding, PTX compile."""

from __future__ import annotations

import inspect
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import numattn
from numattn.core import jit as _jit
from numattn.kernels.shared.softmax import exp_diff, finish_row, max_nan

from . import internals
from .conftest import CUDASIM


def test_import_compiles_nothing_and_skips_numba():
    code = (
        "import sys, numattn; "
        "print('numba' in sys.modules, 'numba.cuda' in sys.modules)"
    )
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, check=True)
    assert result.stdout.split() == ["False", "False"]


def test_openmp_workers_spin_briefly_unless_the_user_chose():
    code = "import os, numattn; print(os.environ.get('GOMP_SPINCOUNT'))"
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True)
    assert run.stdout.strip() == "1000"
    env["OMP_WAIT_POLICY"] = "ACTIVE"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True)
    assert run.stdout.strip() == "None"


def test_public_names():
    for name in numattn.__all__:
        assert hasattr(numattn, name), name
    assert numattn.__version__


def _softmax_row(scores, values, sink, has_sink, out):
    m = -math.inf
    l = 0.0
    for d in range(out.shape[0]):
        out[d] = 0.0
    for j in range(scores.shape[0]):
        if scores[j] == -math.inf:
            continue  # a hidden key: its value row is never read (it may hold NaN)
        m_new = max_nan(m, scores[j])
        alpha = exp_diff(m, m_new)
        p = exp_diff(scores[j], m_new)
        m, l = m_new, l * alpha + p
        for d in range(out.shape[0]):
            out[d] = out[d] * alpha + p * values[j, d]
    out_scale, lse = finish_row(m, l, sink, has_sink)
    for d in range(out.shape[0]):
        out[d] = out[d] * out_scale
    return lse


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_online_softmax_bodies(dtype, rng):
    kernel = _jit.cpu_jit(_softmax_row)
    scores = rng.standard_normal(9).astype(dtype)
    scores[[2, 5]] = -np.inf
    values = rng.standard_normal((9, 4)).astype(dtype)
    values[2] = np.nan  # hidden key: must not leak
    for sink, has_sink in [(dtype(0.7), True), (dtype(0), False)]:
        out = np.empty(4, dtype)
        lse = kernel(scores, values, sink, has_sink, out)
        vis = np.isfinite(scores)
        big = max(scores[vis].max(), sink) if has_sink else scores[vis].max()
        w = np.exp(scores[vis].astype(np.float64) - big)
        denom = w.sum() + (np.exp(sink - big) if has_sink else 0)
        expected = w @ values[vis] / denom
        assert np.allclose(out, expected, rtol=1e-5)
        assert np.isclose(lse, big + np.log(denom), rtol=1e-5)
    # all hidden: 0 and -inf; with a sink: 0 and the sink
    hidden = np.full(3, -np.inf, dtype)
    out = np.empty(4, dtype)
    assert kernel(hidden, values[:3], dtype(0), False, out) == -np.inf and np.all(out == 0)
    assert kernel(hidden, values[:3], dtype(1.5), True, out) == 1.5 and np.all(out == 0)
    assert kernel(hidden, values[:3], dtype(-np.inf), True, out) == -np.inf
    assert np.all(out == 0)


def test_exp_diff_is_exact_for_empty_states():
    assert exp_diff(-math.inf, -math.inf) == 0.0
    assert exp_diff(-math.inf, 3.0) == 0.0
    assert exp_diff(2.0, 2.0) == 1.0


def test_cpu_binding_is_cached_and_prange_is_bound():
    f = _jit.cpu_jit(_softmax_row)
    assert _jit.cpu_jit(_softmax_row) is f
    assert f.py_func is not _softmax_row
    assert _jit.prange is range


def _add_one(x):
    return x + 1


def test_kernels_compile_uncached_with_a_warning_where_nothing_is_writable(monkeypatch):
    """Numba raises "cannot cache function" when it finds no writable cache directory (a
    read-only install and home); numattn then compiles without the disk cache, and says so
    once."""
    from numba.core import caching

    monkeypatch.setattr(caching.CacheImpl, "_locator_classes", [])  # no writable place
    monkeypatch.setitem(_jit.CPU_OPTS, "cache", True)
    monkeypatch.setattr(_jit, "_UNCACHED_WARNED", [])
    with pytest.warns(RuntimeWarning, match="cannot be cached on disk"):
        f = _jit._cpu_jit.__wrapped__(_add_one, False)
    assert f(41) == 42 and not f._cache_hits and f._cache.__class__.__name__ == "NullCache"


def test_trivial_cuda_kernel_with_shared_body_compiles_to_ptx(ptx_compiler):
    from numba import types

    ptx = ptx_compiler(_trivial_cuda_kernel, (types.float32[:], types.float32[:]))
    assert "ex2.approx" in ptx or "exp" in ptx.lower()


def _trivial_cuda_kernel(x, y):
    i = cuda.grid(1)  # noqa: F821 - bound by cuda_kernel / cuda_source
    if i < x.shape[0]:
        y[i] = exp_diff(x[i], x[0])


@pytest.mark.skipif(CUDASIM, reason="checks the error raised where there is no GPU")
def test_cuda_request_without_gpu_is_a_clear_error():
    from numattn.core.device import CudaUnavailableError, get_cuda, require_cuda

    try:
        if get_cuda().is_available():
            pytest.skip("a GPU is present")
    except CudaUnavailableError:
        pytest.skip("numba-cuda is not installed (test_cuda_needs_numba_cuda)")
    with pytest.raises(CudaUnavailableError, match="no CUDA GPU"):
        require_cuda()


def test_cuda_needs_numba_cuda(monkeypatch):
    """Without the numba-cuda package, CUDA is unavailable with a message that says what to
    install (Numba's own deprecated ``numba.cuda`` cannot compile the kernels)."""
    import importlib.util

    from numattn.core import device as _cuda

    find_spec = importlib.util.find_spec

    def without_numba_cuda(name, *args):
        return None if name == "numba_cuda" else find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", without_numba_cuda)
    _cuda.get_cuda.cache_clear()
    try:
        with pytest.raises(_cuda.CudaUnavailableError, match=r"pip install '\.\[cuda\]'"):
            _cuda.get_cuda()
        assert not _cuda.is_available()
        with pytest.raises(_cuda.CudaUnavailableError, match="numba-cuda"):
            _cuda.require_cuda()
    finally:
        monkeypatch.undo()
        _cuda.get_cuda.cache_clear()


_REDUCE = internals.decode_reduce_cpu
_REDUCE_ONCE = f"""
import sys
import numpy as np
from numattn.core.jit import cpu_jit
from {_REDUCE.__module__} import {_REDUCE.__name__} as reduce
kernel = cpu_jit(reduce, parallel=sys.argv[1] == "parallel")
m = np.zeros((1, 2, 3), np.float32)
kernel(m, np.ones_like(m), np.ones((1, 2, 3, 4), np.float32), np.zeros(3, np.float32), False,
       np.empty((1, 3, 4), np.float32), np.empty((1, 3), np.float32))
print(sum(kernel.stats.cache_hits.values()))
"""


@pytest.mark.slow
def test_serial_and_parallel_bindings_keep_apart_in_the_disk_cache(tmp_path):
    # Numba keys its cache by argument types only: a serial binding cached first must not
    # be loaded for the parallel one in a later process (which would then use one thread).
    env = {k: v for k, v in os.environ.items() if k != "NUMATTN_CACHE"}
    env["NUMBA_CACHE_DIR"] = str(tmp_path)

    def run(mode):
        result = subprocess.run([sys.executable, "-c", _REDUCE_ONCE, mode], capture_output=True,
                                text=True, env=env, check=True)
        return int(result.stdout.split()[-1])

    assert run("serial") == 0  # compiled and written to the cache
    assert run("parallel") == 0  # not the serial entry
    assert run("parallel") == 1 and run("serial") == 1  # each finds its own


@pytest.mark.slow
def test_a_changed_callee_source_makes_cached_kernels_compile_again(tmp_path):
    """Numba checks a cached kernel against its own file only: after an edit of a module
    whose bodies it calls (here that of the reduction's rows and merge weights), a later
    process must compile the kernel again, not load it as it was."""
    package = tmp_path / "pkg" / "numattn"
    shutil.copytree(Path(numattn.__file__).parent, package,
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k != "NUMATTN_CACHE"}
    env["NUMBA_CACHE_DIR"] = str(tmp_path / "cache")
    env["PYTHONPATH"] = str(package.parent)

    def cache_hits():
        result = subprocess.run([sys.executable, "-c", _REDUCE_ONCE, "serial"],
                                capture_output=True, text=True, env=env, check=True,
                                cwd=tmp_path)  # not this checkout's numattn
        return int(result.stdout.split()[-1])

    assert cache_hits() == 0 and cache_hits() == 1  # compiled, then loaded
    callee = Path(inspect.getfile(finish_row)).relative_to(Path(numattn.__file__).parent)
    assert callee != Path(inspect.getfile(_REDUCE)).relative_to(Path(numattn.__file__).parent)
    with open(package / callee, "a") as source:
        source.write("\n# an edit\n")
    assert cache_hits() == 0  # compiled again
    assert cache_hits() == 1


_DIGEST_OF_RESULTS = """
import hashlib
import numpy as np
import numattn

def digest():
    rng = np.random.default_rng(0)
    digest = hashlib.sha1()
    # decode on the calling thread, then split-K on the worker threads
    for batch, num_keys, kv_heads, head_dim in [(1, 200, 2, 32), (2, 1100, 8, 64)]:
        k, v = (rng.standard_normal((batch, num_keys, kv_heads, head_dim), dtype=np.float32)
                for _ in range(2))
        q = rng.standard_normal((batch, 4 * kv_heads, head_dim), dtype=np.float32)
        digest.update(numattn.decode_attention(q, k, v, num_partitions=3).tobytes())
    # causal prefill (the flash kernel) and a short chunk over a long cache (decode's)
    for rows, num_keys, dtype in [(40, 40, np.float32), (4, 3000, np.float64)]:
        q = rng.standard_normal((1, rows, 8, 32)).astype(dtype)
        k, v = (rng.standard_normal((1, num_keys, 2, 32)).astype(dtype) for _ in range(2))
        digest.update(numattn.flash_attention_kv_cache(q, k, v, numattn.CausalMask()).tobytes())
    return digest.hexdigest()

if __name__ == "__main__":
    print(digest())
"""


@pytest.mark.slow
def test_results_do_not_depend_on_whether_the_kernels_were_compiled_or_loaded():
    """A process that compiled the kernels and one that loaded them from the disk cache give
    bitwise the same results.  (Numba links each body into every kernel that calls it as a
    weak symbol, bound to the first copy a process loaded: the body's own when it compiled
    the kernels, else the kernel's.  With the ``reassoc`` fast-math flag the copies summed in
    different orders.)  In CI (a fresh clone) this process compiles the kernels and the
    child loads them."""
    scope = {}
    exec(compile(_DIGEST_OF_RESULTS, "<digest>", "exec"), scope)
    here = scope["digest"]()
    env = {k: v for k, v in os.environ.items() if k != "NUMATTN_CACHE"}
    child = subprocess.run([sys.executable, "-c", _DIGEST_OF_RESULTS], capture_output=True,
                           text=True, env=env, check=True)
    assert child.stdout.split()[-1] == here
