"""Lazy access to ``numba.cuda``: nothing here imports it until CUDA is actually used."""

from __future__ import annotations

import functools
import importlib.util
import os

import numpy as np


class CudaUnavailableError(RuntimeError):
    """Raised when CUDA is asked for on a machine (or environment) that has none."""


def simulator_enabled() -> bool:
    """True when ``NUMBA_ENABLE_CUDASIM=1``: kernels run in Numba's CUDA simulator."""
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"


@functools.cache
def get_cuda():
    """Import and return ``numba.cuda`` from numba-cuda; raise :class:`CudaUnavailableError`
    where that is not installed.

    The ``numba.cuda`` that Numba itself still ships (deprecated since Numba 0.61, replaced
    by the numba-cuda package of the ``cuda`` extra) cannot compile numattn's kernels: with
    Numba 0.68 the decode and cross attention kernels failed to compile with a ``TypeError``
    from inside its compiler, so it is not used.
    """
    if importlib.util.find_spec("numba_cuda") is None:
        raise CudaUnavailableError(
            "CUDA support needs numba-cuda: the cuda extra, pip install '.[cuda]' in "
            "numattn's checkout (the numba.cuda that numba itself ships, deprecated, "
            "cannot compile numattn's kernels)"
        )
    try:
        from numba import cuda
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise CudaUnavailableError(
            "CUDA support needs numba-cuda: the cuda extra, pip install '.[cuda]' in "
            "numattn's checkout"
        ) from exc
    return cuda


def is_available() -> bool:
    """True when CUDA kernels can run here: a usable GPU, or the CUDA simulator."""
    try:
        cuda = get_cuda()
    except CudaUnavailableError:
        return False
    try:
        return bool(cuda.is_available())
    except Exception:  # pragma: no cover - driver problems surface as many types
        return False


def require_cuda():
    """Return ``numba.cuda`` if kernels can run, else raise a clear error."""
    cuda = get_cuda()
    if not is_available():
        raise CudaUnavailableError(
            "device='cuda' was requested but no CUDA GPU is available here "
            "(set NUMBA_ENABLE_CUDASIM=1 to run the CUDA kernels in the simulator)"
        )
    return cuda


def is_device_array(x) -> bool:
    """True for any object exposing ``__cuda_array_interface__`` (Numba, CuPy, PyTorch...).

    The CUDA simulator's device arrays lack that interface but carry ``__cuda_ndarray__``.
    """
    return hasattr(x, "__cuda_array_interface__") or hasattr(x, "__cuda_ndarray__")


def resolve_device(device, arrays) -> str:
    """Turn ``device`` ("auto", "cpu", "cuda") into "cpu" or "cuda" given the inputs."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    on_device = any(is_device_array(a) for a in arrays
                    if a is not None and not isinstance(a, np.ndarray))
    if device == "auto":
        return "cuda" if on_device else "cpu"
    if device == "cpu" and on_device:
        raise TypeError(
            "device='cpu' was requested but some inputs are CUDA device arrays; "
            "copy them to the host (e.g. .copy_to_host()) or use device='cuda'"
        )
    return device


def check_stream(stream, device):
    """The CUDA stream a call runs on: ``stream`` (a ``numba.cuda`` stream: ``cuda.stream()``,
    or ``cuda.external_stream(ptr)`` over another library's), or ``0``, the default stream,
    for ``None``.  Checked before any work: ``TypeError`` for another object, ``ValueError``
    for a stream given to a call that runs on the CPU."""
    if stream is None:
        return 0
    if device != "cuda":
        raise ValueError("stream is for calls that run on CUDA (device='cuda', or device "
                         "arrays with device='auto'); this call runs on the CPU")
    cuda = require_cuda()
    if not isinstance(stream, type(cuda.default_stream())):
        raise TypeError(f"stream must be a numba.cuda stream (cuda.stream(), or "
                        f"cuda.external_stream(ptr) for another library's), got "
                        f"{type(stream).__name__}")
    return stream


def synchronize(stream):
    """Wait for ``stream`` (``0``: nothing to wait for, the default stream's copies to the
    host return when done), before results on the host are handed back."""
    if not isinstance(stream, int):
        stream.synchronize()
