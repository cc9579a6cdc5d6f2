"""Project-wide Numba options, and the binding of one plain-Python body to each target.

Every piece of kernel math in numattn is written once as a plain Python function that
uses only ``math``, scalars and arrays passed in, and is marked with :func:`body`.  Bodies
call each other by their ordinary names.  :func:`cpu_jit` compiles a body for the CPU
and :func:`cuda_device` / :func:`cuda_kernel` for CUDA; each rebinds the names of the
bodies it calls to their compiled versions *for the same target*, so a CUDA kernel never
calls an ``njit`` function (which the CUDA simulator could not run) and vice versa.
CUDA kernels also get the name ``cuda`` bound to ``numba.cuda`` (the simulator's when
``NUMBA_ENABLE_CUDASIM=1``); ``numba.cuda`` is imported only when a CUDA binding is first
asked for, and ``numba`` itself only when a CPU kernel is first compiled.

Environment
-----------
NUMATTN_CACHE
    ``0`` switches off Numba's on-disk cache of compiled CPU kernels (on by default so that
    first calls in a new process are short).  ``NUMBA_CACHE_DIR`` chooses where it lives.
    Where Numba finds no writable place for it (a read-only install and home directory),
    the kernels compile uncached, with one ``RuntimeWarning`` saying so.  A cached kernel
    is used only by the sources it was compiled from (:func:`source_digest`).
NUMATTN_AMX
    ``0`` keeps the flash kernel off Intel AMX tiles (bfloat16 queries and K/V on CPUs that
    have them: :mod:`numattn.kernels.cpu.amx`); read once per process.
GOMP_SPINCOUNT
    Unless the user set it (or ``OMP_WAIT_POLICY``), ``import numattn`` sets it to ``1000``,
    so that it is in place when Numba's OpenMP thread pool starts.  By default that pool's
    idle threads busy-wait for a long while (300,000 spins) after every parallel loop, and
    on a machine with as many threads as cores they then starve the BLAS threads of the
    NumPy code around the kernels.  A thousand spins (a few microseconds) keep a loop of
    NumPy and attention calls as fast as passive waiting does, while a parallel loop that
    follows another at once still finds the workers awake.  Measured: "Sharing the cores
    with NumPy" in docs/performance.rst.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import threading
import types
import warnings

#: Kernels write ``for i in prange(n)``; it runs as ``range`` in plain Python and is bound
#: to ``numba.prange`` when a body is compiled for the CPU (numba is imported lazily, so
#: ``import numattn`` stays fast).
prange = range


class _UnboundCuda:
    """Stands for ``numba.cuda`` in the source of CUDA kernels and device bodies.

    Kernels write ``cuda.threadIdx.x`` and so on; :func:`cuda_kernel` and
    :func:`cuda_device` compile a copy whose ``cuda`` is the real module (the simulator's
    under ``NUMBA_ENABLE_CUDASIM=1``).  Used any other way, it says so.
    """

    def __getattr__(self, name):
        if name.startswith("_"):  # introspection (doctest, inspect, _rebind) looks for these
            raise AttributeError(name)
        raise RuntimeError(
            f"cuda.{name}: numattn CUDA kernels run only as compiled by cuda_kernel()"
        )


#: Placeholder for ``numba.cuda`` in kernel source (see :class:`_UnboundCuda`).
cuda = _UnboundCuda()

#: Fast-math flags: contraction and reciprocal approximations, but not ``nnan``/``ninf``
#: (masking relies on ``-inf``, and NaN must propagate) and not ``reassoc``: under it each
#: compiled copy of a body may sum in its own order, and which copy a kernel runs depends on
#: what the process compiled or loaded first (Numba links callees as weak symbols), so
#: results changed in the last bits between processes.  Sums that must run fast use a fixed
#: lane order instead (:func:`numattn.kernels.cpu.simd.lane_sum`).
FASTMATH = frozenset({"contract", "arcp", "nsz"})

# Idle OpenMP workers spin only briefly before they sleep (see GOMP_SPINCOUNT above).
# libgomp reads this when Numba starts its thread pool, which may be before any kernel is
# compiled.
if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "1000"

CACHE = os.environ.get("NUMATTN_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")

#: Options every CPU kernel is compiled with.
CPU_OPTS = {"fastmath": set(FASTMATH), "error_model": "numpy", "cache": CACHE, "nogil": True}


def body(func):
    """Mark ``func`` as a shared kernel body (callable from CPU and CUDA kernels)."""
    func._numattn_body = True
    return func


class Specialization:
    """Bodies that replace others of the same name in a copy of the kernels: how functions
    written by users (:class:`numattn.masks.FunctionMask`, :class:`numattn.ScoreMod`) are
    compiled into every kernel, and how the flash kernel binds its AMX tiles
    (:func:`numattn.kernels.cpu.flash._with_amx`).

    ``overrides`` maps a global name that shared bodies call (``_function_visible``,
    ``_score_mod``, ``_tile_on_amx``) to the body that replaces it; ``digest`` names the
    copy (and its disk cache entries).  A kernel bound with a specialization rebinds only
    the bodies that reach one of the names (a replacing body too): the others are shared
    with the plain kernels.
    """

    def __init__(self, overrides, digest):
        self.overrides = dict(overrides)
        self.names = frozenset(self.overrides)
        self.digest = digest

    def __repr__(self):
        return f"Specialization({sorted(self.names)}, {self.digest})"


@functools.cache
def _reaches(func, names):
    """Whether ``func`` or a body it calls (transitively) reads one of ``names``."""
    code_names = func.__code__.co_names
    if names.intersection(code_names):
        return True
    scope = func.__globals__
    return any(
        getattr(scope.get(name), "_numattn_body", False) and scope[name] is not func
        and _reaches(scope[name], names) for name in code_names
    )


def _rebind(func, target, special=None):
    """A copy of ``func`` whose globals name the ``target`` bindings of the bodies it calls
    (specialized by ``special``, a :class:`Specialization`, where they reach its names),
    and on the CPU the intrinsics registered for the functions it calls
    (:func:`cpu_intrinsic`)."""
    scope = dict(func.__globals__)
    bind = cpu_jit if target == "cpu" else cuda_device
    for name in func.__code__.co_names:
        if special is not None and name in special.names:
            override = special.overrides[name]  # (itself specialized where it reaches one)
            scope[name] = (bind(override, special=special)
                           if _reaches(override, special.names) else bind(override))
            continue
        callee = scope.get(name)
        registered = _CPU_INTRINSICS.get(id(callee)) if target == "cpu" else None
        if registered is not None and registered[0] is callee:
            scope[name] = registered[1]
            continue
        if getattr(callee, "_numattn_body", False):
            if special is not None and _reaches(callee, special.names):
                scope[name] = bind(callee, special=special)
            else:
                scope[name] = bind(callee)
    if target == "cpu" and "prange" in func.__code__.co_names:
        import numba

        scope["prange"] = numba.prange
    if target == "cuda":
        from .device import get_cuda

        scope["cuda"] = get_cuda()
    clone = types.FunctionType(
        func.__code__, scope, func.__name__, func.__defaults__, func.__closure__
    )
    clone.__qualname__ = func.__qualname__
    clone.__module__ = func.__module__
    clone.__doc__ = func.__doc__
    return clone


_BEFORE_CPU_COMPILE = []
_CPU_INTRINSICS = {}  # id(function): (function, intrinsic), from cpu_intrinsic


def before_cpu_compile(hook):
    """Run ``hook()`` before any CPU binding is compiled (once per binding; the hook must be
    cheap after its first call).  A kernel module that provides Numba extensions (typed
    intrinsics, overloads) registers itself here when it is imported, so that the core never
    imports a kernel module."""
    if hook not in _BEFORE_CPU_COMPILE:
        _BEFORE_CPU_COMPILE.append(hook)
    return hook


def cpu_intrinsic(function, intrinsic):
    """Have the CPU bindings of the bodies that call the plain-Python ``function`` call
    ``intrinsic`` (a Numba ``@intrinsic`` taking the same arguments) in its place; for kernel
    modules' ``before_cpu_compile`` hooks.

    Other jitted code reaches the same compiled form through an ``@overload`` of
    ``function`` inlined into its caller, but an inlined overload binds its array arguments
    to variables of its own, whose references Numba counts at every call with atomic
    increments and decrements that LLVM does not always remove, and an atomic operation
    also waits for the loads before it ("Reference counts in the hot loops" in
    docs/performance.rst).  A call of the intrinsic counts nothing."""
    _CPU_INTRINSICS[id(function)] = (function, intrinsic)


@functools.cache
def _cpu_jit(func, parallel, special=None):
    import numba

    watch_compiles("cpu")
    for hook in _BEFORE_CPU_COMPILE:  # e.g. the explicit-vector functions bodies call
        hook()
    clone = _rebind(func, "cpu", special)
    if special is not None:
        clone.__qualname__ += "_" + special.digest
    if not parallel:
        # Numba's on-disk cache names its files after the function and keys them by
        # argument types only, not by ``parallel``: without a name of its own, a serial
        # binding cached first would be loaded for the parallel one in later processes.
        clone.__qualname__ += "_serial"
    clone.__qualname__ += "_" + source_digest()
    if getattr(func, "_numattn_uncached", False):  # a user's function: cached in its callers
        clone._numattn_uncached = True  # and not announced as numattn's compile
        return numba.njit(parallel=parallel, **{**CPU_OPTS, "cache": False})(clone)
    try:
        return numba.njit(parallel=parallel, **CPU_OPTS)(clone)
    except RuntimeError as exc:  # Numba found no writable directory for the cache
        if not CPU_OPTS["cache"] or "cannot cache" not in str(exc):
            raise
        _warn_uncached(exc)
        return numba.njit(parallel=parallel, **{**CPU_OPTS, "cache": False})(clone)


#: Callables giving more text for :func:`source_digest`: code from outside the package that
#: kernels compile in (mask leaves registered by an application).
DIGEST_SOURCES = []


@functools.cache
def source_digest():
    """A digest of the sources of every module of the package, part of the name under
    which Numba caches each CPU kernel on disk.

    Numba checks a cached kernel against the file that defines it, not against the files of
    the bodies and intrinsics it calls (and compiles into it): after an edit of
    :mod:`numattn.kernels.cpu.simd` or :mod:`numattn.kernels.shared.masks` alone, a process
    would load the kernels of :mod:`numattn.kernels.cpu.split_k` as they were before.  With
    the digest in their names, any change to the package's sources makes every kernel
    compile anew (read once per process, at the first kernel binding: ~1 ms).
    """
    digest = hashlib.sha1()
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for folder, _, files in sorted(os.walk(package)):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, "rb") as source:
                    relative = os.path.relpath(path, package).encode()
                    digest.update(relative + b"\0" + source.read() + b"\0")
    for extra in DIGEST_SOURCES:
        digest.update(extra().encode() + b"\0")
    return digest.hexdigest()[:16]


_UNCACHED_WARNED = []


def _warn_uncached(exc):
    if not _UNCACHED_WARNED:
        _UNCACHED_WARNED.append(True)
        warnings.warn(
            f"numattn: compiled kernels cannot be cached on disk here ({exc}); every new "
            f"process compiles them again (seconds at its first call).  Set NUMBA_CACHE_DIR "
            f"to a writable directory, or NUMATTN_CACHE=0 to compile uncached without this "
            f"warning.",
            RuntimeWarning,
            stacklevel=4,
        )


#: The first compile of a numattn kernel in a process is announced once on this logger, at
#: WARNING level so that it reaches stderr with no logging set up (a log record, not a
#: warning: it never becomes an error under ``-W error``).  To hide it:
#: ``logging.getLogger("numattn").setLevel(logging.ERROR)``.
COMPILE_LOG = logging.getLogger("numattn.compile")
_COMPILE_ANNOUNCED = []  # [True] once announced
_COMPILE_WATCHED = set()  # the targets ("cpu", "cuda") whose compiles are listened to
_COMPILE_WATCH_LOCK = threading.Lock()  # bindings are made from any thread


def _announce_compile(target, name, argtypes):
    """Log (once per process) that numattn compiles ``name`` for ``target``."""
    if _COMPILE_ANNOUNCED:
        return
    _COMPILE_ANNOUNCED.append(True)
    text = argtypes if isinstance(argtypes, str) else ", ".join(map(str, argtypes))
    dtypes = sorted(set(re.findall(r"array\((float\d+)", text)))
    # on 2 cores ("Compiling and importing" in docs/performance.rst)
    cost = "about 10-20 s at each operation's first call"
    if target == "cuda":
        cost, later = "seconds at each kernel's first launch", "not cached on disk"
    elif CPU_OPTS["cache"] and not _UNCACHED_WARNED:
        later = "cached on disk for later processes; `python -m numattn warmup` compiles all ahead"
    else:
        later = "not cached on disk"
    COMPILE_LOG.warning(
        "numattn: compiling %s kernels (first %s%s), %s; %s; "
        "logging.getLogger('numattn').setLevel(logging.ERROR) hides this note",
        target.upper(), name, f", {'/'.join(dtypes)}" if dtypes else "", cost, later,
    )


def watch_compiles(target):
    """Listen (from now on, once per target) for Numba compiling a numattn function, to
    announce the first such compile in the process (:data:`COMPILE_LOG`).

    On the CPU a dispatcher's ``numba:compile`` event fires only on a miss of the disk cache;
    numba-cuda, which has no such event for kernels, runs its compiler passes under
    ``numba-cuda:run_pass`` events.  The CUDA simulator compiles nothing.
    """
    with _COMPILE_WATCH_LOCK:
        if target in _COMPILE_WATCHED:
            return
        _COMPILE_WATCHED.add(target)
    if target == "cpu":
        from numba.core import event

        def source(data):  # (module, name, argument types) of what is being compiled
            func = data["dispatcher"].py_func
            if getattr(func, "_numattn_uncached", False):  # a user's function alone
                return "", func.__name__, data["args"]
            return func.__module__, func.__name__, data["args"]

        kind = "numba:compile"
    else:
        from .device import simulator_enabled

        if simulator_enabled():
            return
        try:
            from numba.cuda.core import event
        except ImportError:  # a numba-cuda without these events: no announcement
            return

        def source(data):
            return data["module"], data["qualname"], data["args"]

        kind = "numba-cuda:run_pass"

    class _Announce(event.Listener):
        def on_start(self, ev):
            if _COMPILE_ANNOUNCED:
                return
            try:
                module, name, argtypes = source(ev.data)
            except (KeyError, AttributeError):  # a note must never stop a compile
                return
            if (module or "").startswith("numattn."):
                _announce_compile(target, name, argtypes)

        def on_end(self, ev):
            pass

    event.register(kind, _Announce())


def cpu_jit(func=None, *, parallel=False, special=None):
    """Compile ``func`` for the CPU with :data:`CPU_OPTS` (lazily, at its first call),
    specialized by ``special`` (a :class:`Specialization`) if given.

    A ``parallel=True`` binding comes as a :class:`ParallelBinding`, which calls the Numba
    dispatcher (its attributes are the dispatcher's).
    """
    if func is None:
        return functools.partial(cpu_jit, parallel=parallel, special=special)
    if parallel:
        return _parallel_binding(func, special)
    return _cpu_jit(func, False, special)


@functools.cache
def _parallel_binding(func, special=None):
    return ParallelBinding(func, _cpu_jit(func, True, special), special)


_LAUNCH_LOCK = threading.Lock()
_ONE_LAUNCH_AT_A_TIME = []  # [bool], once Numba's threading layer is known


def _one_launch_at_a_time():
    """Whether Numba's threading layer takes a single parallel launch at a time."""
    if not _ONE_LAUNCH_AT_A_TIME:
        import numba

        numba.get_num_threads()  # starts the threading layer
        _ONE_LAUNCH_AT_A_TIME.append(numba.threading_layer() == "workqueue")
    return _ONE_LAUNCH_AT_A_TIME[0]


class ParallelBinding:
    """The ``parallel=True`` binding of a body, launched the way Numba's threading layer
    can take it when several Python threads call numattn at once.

    The ``omp`` and ``tbb`` layers take concurrent launches.  The ``workqueue`` layer (the
    one Numba falls back to where it finds neither OpenMP nor TBB) terminates the process
    when a second launch starts while one runs; there a call that finds another numattn
    launch running computes on its own thread with the serial binding instead (the same
    work, and the same results up to rounding).  Parallel Numba code of the application's
    own that runs beside numattn's is beyond this guard.
    """

    def __init__(self, func, dispatcher, special=None):
        self._func = func
        self._dispatcher = dispatcher
        self._special = special

    def __call__(self, *args):
        if not _one_launch_at_a_time():
            return self._dispatcher(*args)
        if not _LAUNCH_LOCK.acquire(blocking=False):
            return _cpu_jit(self._func, False, self._special)(*args)
        try:
            return self._dispatcher(*args)
        finally:
            _LAUNCH_LOCK.release()

    def __getattr__(self, name):  # signatures, stats, ... of the Numba dispatcher
        return getattr(self._dispatcher, name)


@functools.cache
def cuda_device(func, special=None):
    """The CUDA device-function binding of a body (imports ``numba.cuda`` lazily)."""
    from .device import get_cuda

    watch_compiles("cuda")
    return get_cuda().jit(device=True)(_rebind(func, "cuda", special))


@functools.cache
def cuda_kernel(func, special=None):
    """The CUDA kernel binding of a plain kernel function (lazy, compiled at first launch)."""
    from .device import get_cuda

    watch_compiles("cuda")
    return get_cuda().jit(_rebind(func, "cuda", special))


def cuda_source(func, special=None):
    """The plain function as :func:`cuda_kernel` compiles it (for ``cuda.compile_ptx``)."""
    return _rebind(func, "cuda", special)
