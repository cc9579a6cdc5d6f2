"""Calls from several Python threads at once: right results, BLAS settings kept, no abort.

Serving code calls attention from a thread per request; the kernels release the GIL, so
such calls overlap on the worker threads.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import numattn
from numattn import CausalMask, reference
from numattn.kernels.cpu import flash, split_k

from . import internals


def _on_worker_threads(set_value):
    """Sends every call of :func:`_run_concurrently` to the worker threads, through
    ``set_value`` (``setattr`` or ``monkeypatch.setattr``)."""
    for module, name in ((split_k, "SERIAL_KV_BYTES"), (flash, "SERIAL_MULTIPLY_ADDS"),
                         (flash, "MULTI_QUERY_MAX_LEN")):
        set_value(module, name, 0)


def _run_concurrently(rng, threads=4, rounds=6):
    """Threads that each run decode and flash problems ``rounds`` times; returns the errors
    they met."""
    problems = []
    for n in (300, 700):
        q = rng.standard_normal((3, 8, 32)).astype(np.float32)
        kv = rng.standard_normal((3, n, 2, 32)).astype(np.float32)
        problems.append((numattn.decode_attention, (q, kv, kv),
                         reference.decode_attention(q, kv, kv, CausalMask())))
        q = rng.standard_normal((1, n // 8, 8, 32)).astype(np.float32)
        kv = kv[:1, : n // 8]
        problems.append((numattn.flash_attention_kv_cache, (q, kv, kv),
                         reference.flash_attention_kv_cache(q, kv, kv, CausalMask())))
    errors = []

    def work(offset):
        try:
            for r in range(rounds * len(problems)):
                op, args, want = problems[(offset + r) % len(problems)]
                got = op(*args, CausalMask())
                if not np.allclose(got, want, rtol=2e-4, atol=2e-4):
                    raise AssertionError(f"{op.__name__}: wrong result")
        except Exception as exc:  # reported by the caller
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return errors


def _blas_threads():
    from threadpoolctl import threadpool_info

    return sorted((p["internal_api"], p["num_threads"]) for p in threadpool_info()
                  if p["user_api"] == "blas")


def test_overlapping_calls_agree_with_the_reference_and_keep_blas_threads(rng, monkeypatch):
    _on_worker_threads(monkeypatch.setattr)
    import scipy.linalg.cython_blas  # noqa: F401  (the BLAS flash calls, loaded beforehand)

    real_limit = internals.blas_single_thread
    seen_at_kernel_end = []

    @contextlib.contextmanager
    def recording_limit():
        with real_limit():
            yield
            seen_at_kernel_end.append(_blas_threads())

    monkeypatch.setattr(internals.cpu_flash, real_limit.__name__, recording_limit)
    before = _blas_threads()
    errors = _run_concurrently(rng)
    assert not errors, errors[:3]
    # every kernel ended with BLAS still on one thread, whichever Python thread set it and
    # whatever ended meanwhile (else its GEMMs ran on the whole pool, several times slower)
    assert seen_at_kernel_end and all(n == 1 for seen in seen_at_kernel_end for _, n in seen)
    # the counts read while no call held BLAS are back (a call that read them while
    # another held it would have restored one thread for good)
    assert _blas_threads() == before


def test_flash_holds_blas_to_one_thread_only_while_it_runs():
    import scipy.linalg.cython_blas  # noqa: F401
    from threadpoolctl import threadpool_limits

    before = _blas_threads()
    with internals.blas_single_thread():
        assert all(n == 1 for _, n in _blas_threads())
    assert _blas_threads() == before
    with threadpool_limits(limits=before[0][1] + 1, user_api="blas"):
        chosen = _blas_threads()  # the user's own setting is what a call restores
        with internals.blas_single_thread():
            pass
        assert _blas_threads() == chosen
    assert _blas_threads() == before


_WORKQUEUE_SCRIPT = f"""
import threading
import numba
import numpy as np
import pytest
import numattn
from numattn import CausalMask, reference
from numattn.kernels.cpu import flash, split_k
{inspect.getsource(_on_worker_threads)}
{inspect.getsource(_run_concurrently)}
_on_worker_threads(setattr)
errors = _run_concurrently(np.random.default_rng(0))
print(numba.threading_layer(), len(errors), *errors)
"""


@pytest.mark.last
@pytest.mark.slow
def test_workqueue_threading_layer_survives_overlapping_calls():
    """Numba's workqueue layer aborts the process on a second concurrent launch; numattn
    then runs the call that would overlap on its own thread."""
    env = dict(os.environ, NUMBA_THREADING_LAYER="workqueue")
    result = subprocess.run([sys.executable, "-c", _WORKQUEUE_SCRIPT],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["workqueue", "0"]
