"""Functions written by users, compiled into every kernel: score modifiers, and the binding
of a call's :class:`~numattn.core.masks.FunctionMask` and :class:`ScoreMod` functions.

A call with such functions runs copies of the kernels in which the shared bodies
``_function_visible`` (:mod:`numattn.kernels.shared.masks`) and ``_score_mod``
(:mod:`numattn.kernels.shared.scores`) are replaced by bodies generated here that call the
user's functions (a :class:`~numattn.core.jit.Specialization`): the same Python source is
compiled by Numba for the CPU and by numba-cuda for CUDA, and inlined where the plain
kernels have nothing.  The captures travel in the kernels' ``functions`` tuple
(:func:`kernel_functions`), so new values compile nothing.

:func:`bind_functions` checks the functions before any work: each is compiled for the
CPU with the call's argument types (a function Numba cannot compile is a ``TypeError``
naming it), and it says whether a mask function reads the head ``h`` (then the tile table
of :func:`numattn.kernels.cpu.function_tiles.function_tile_table` is the union over heads).
"""

from __future__ import annotations

import dataclasses
import dis
import functools
import hashlib
import math
import types
from typing import NamedTuple

import numpy as np

from .device import is_device_array
from .jit import Specialization

__all__ = [
    "FUNCTION_TILE_KEYS",
    "FUNCTION_TILE_ROWS",
    "ScoreMod",
    "alibi",
    "bind_functions",
    "kernel_functions",
    "softcap",
]

#: Where the captured values start in the kernels' ``functions`` tuple (kernel_functions).
FIRST_CAPTURE = 7
#: A FunctionMask's tile table holds one entry per block of this many local query rows x
#: this many keys: bit 0 "some pair visible", bit 1 "some pair hidden".
FUNCTION_TILE_ROWS = 16
FUNCTION_TILE_KEYS = 16


@dataclasses.dataclass(frozen=True, eq=False, init=False)
class ScoreMod:
    """A score modifier: ``score = fn(score, b, h, q_idx, kv_idx, *captures)``.

    Applied to each scaled score ``scale * (q . k)`` before the mask and the softmax, on
    every operation and backend (``score_mod=``); the log-sum-exp is over the modified
    scores and sink logits are not modified.  ``fn`` is a plain Python function that Numba
    compiles into the kernels for the CPU and for CUDA (arithmetic, ``math``, indexing of
    the captured arrays); ``score`` has the compute dtype (float32, or float64 for float64
    queries and K/V).  ``captures`` (NumPy arrays and numbers) are handed to ``fn`` at each
    call: new values compile nothing.  Indexing is not bounds-checked.

    Parameters
    ----------
    fn : function
        ``fn(score, b, h, q_idx, kv_idx, *captures) -> score``.
    *captures : ndarray or number

    Examples
    --------
    >>> import numpy as np
    >>> from numattn import ScoreMod
    >>> def relative_bias(score, b, h, q_idx, kv_idx, table):
    ...     return score + table[h, min(q_idx - kv_idx, table.shape[1] - 1)]
    >>> mod = ScoreMod(relative_bias, np.zeros((8, 32), np.float32))
    >>> float(mod(1.5, 0, 3, 10, 4))
    1.5
    """

    fn: object
    captures: tuple

    def __init__(self, fn, *captures):
        if not callable(fn) or not hasattr(fn, "__code__"):
            raise TypeError(f"ScoreMod expects a plain Python function, got {type(fn).__name__}")
        object.__setattr__(self, "fn", fn)
        object.__setattr__(self, "captures", tuple(captures))

    def __call__(self, score, b, h, q_idx, kv_idx):
        """``fn`` evaluated in Python for one pair."""
        return self.fn(score, b, h, q_idx, kv_idx, *self.captures)


def _softcap(score, b, h, q_idx, kv_idx, cap):
    """``cap * tanh(score / cap)``, in arithmetic the CPU kernels vectorise (a call of
    ``math.tanh`` per score would cost more than the attention), in the score's precision.

    float32: the rational function of Eigen's float ``tanh`` (odd degree 13 over even
    degree 6, argument clamped to 7.9053, ``tanh x = x`` below 4e-4), within 4e-7 of
    ``math.tanh``.  float64: ``tanh |x| = -a / (a + 2)`` with ``a = expm1(-2 |x|)``, found
    as ``expm1(-t)`` of ``t = 2 |x| / 64`` (Taylor, 15 terms) doubled six times by
    ``expm1(2u) = a (a + 2)``, which keeps its relative error: within 1e-15.  NaN
    propagates.
    """
    if isinstance(score, np.float32):  # a float32 kernel: float32 arithmetic throughout
        x = score / np.float32(cap)
        if abs(x) < np.float32(4e-4):
            return np.float32(cap) * x
        c = np.float32(7.90531110763549805)
        x = c if x > c else (-c if x < -c else x)  # NaN stays NaN
        x2 = x * x
        p = np.float32(-2.76076847742355e-16)
        p = p * x2 + np.float32(2.00018790482477e-13)
        p = p * x2 + np.float32(-8.60467152213735e-11)
        p = p * x2 + np.float32(5.12229709037114e-08)
        p = p * x2 + np.float32(1.48572235717979e-05)
        p = p * x2 + np.float32(6.37261928875436e-04)
        p = p * x2 + np.float32(4.89352455891786e-03)
        q = np.float32(1.19825839466702e-06)
        q = q * x2 + np.float32(1.18534705686654e-04)
        q = q * x2 + np.float32(2.26843463243900e-03)
        q = q * x2 + np.float32(4.89352518554385e-03)
        return np.float32(cap) * (p * x / q)
    x = score / cap
    y = abs(x)
    y = 20.0 if y > 20.0 else y
    t = y * (2.0 / 64.0)
    p = 1.0
    for n in range(15, 1, -1):
        p = 1.0 - t / n * p
    a = -t * p
    for _ in range(6):
        a = a * (a + 2.0)
    return cap * math.copysign(-a / (a + 2.0), x)


def softcap(cap):
    """Logit soft-capping (Gemma-2): ``cap * tanh(score / cap)``, as a :class:`ScoreMod`.

    Parameters
    ----------
    cap : float
        The cap (> 0): scores stay inside ``(-cap, cap)``.

    Returns
    -------
    ScoreMod
        The modifier, for the ``score_mod`` argument of every operation.  Its ``tanh`` is
        computed in arithmetic the kernels vectorise: within 4e-7 (relative) of
        ``math.tanh`` on float32 scores, 1e-15 on float64 ones.

    Examples
    --------
    >>> from numattn import softcap
    >>> round(float(softcap(50.0)(120.0, 0, 0, 0, 0)), 4)
    49.1837
    """
    if isinstance(cap, bool) or not isinstance(cap, (int, float, np.integer, np.floating)):
        raise TypeError(f"softcap: cap must be a number, got {type(cap).__name__}")
    if not (math.isfinite(cap) and cap > 0):
        raise ValueError(f"softcap: cap must be finite and > 0, got {cap}")
    return ScoreMod(_softcap, float(cap))


def _alibi(score, b, h, q_idx, kv_idx, slopes):
    return score + slopes[h] * (kv_idx - q_idx)


def alibi(slopes):
    """ALiBi position biases (BLOOM, MPT): ``score + slopes[h] * (kv_idx - q_idx)``.

    Parameters
    ----------
    slopes : ndarray, [H]
        One slope per query head (float32 or float64), e.g. ``2 ** (-8 * (h + 1) / H)``.

    Returns
    -------
    ScoreMod
        The modifier, for the ``score_mod`` argument of every operation.

    Examples
    --------
    >>> import numpy as np
    >>> from numattn import alibi
    >>> float(alibi(np.array([0.5, 0.25]))(1.0, 0, 1, 10, 6))
    0.0
    """
    if not isinstance(slopes, np.ndarray) and not is_device_array(slopes):
        raise TypeError(f"alibi: slopes must be an array [H], got {type(slopes).__name__}")
    if len(slopes.shape) != 1 or np.dtype(slopes.dtype).kind != "f":
        raise ValueError(f"alibi: slopes must be a float array [H], got {slopes.dtype} of "
                         f"shape {list(slopes.shape)}")
    return ScoreMod(_alibi, slopes)


# --------------------------------------------------------------------------------------
# Binding a call's functions to the kernels.
# --------------------------------------------------------------------------------------
class BoundFunctions(NamedTuple):
    """A call's user functions, checked (:func:`bind_functions`)."""

    special: Specialization  # the kernels' copies that call them
    masks: tuple  # FunctionMask leaves, in program order (their captures in this order)
    score_mod: object  # ScoreMod or None
    per_head: bool  # some mask function reads h


def bind_functions(mask_functions, score_mod, dtype, device):
    """Check the functions of a call and bind them (``None`` when there are none).

    Parameters
    ----------
    mask_functions : tuple of FunctionMask
        The mask's function leaves (:func:`numattn.core.masks.mask_functions`).
    score_mod : ScoreMod or None
    dtype : numpy.dtype
        The compute dtype: the type of ``score``.
    device : str
        ``"cpu"`` or ``"cuda"``: where the captured arrays must be.

    Raises
    ------
    TypeError
        ``score_mod`` is not a :class:`ScoreMod`, a capture is not an array or number (or
        not where the call runs), or Numba cannot compile a function for these argument
        types (or it returns no number).
    """
    if score_mod is not None and not isinstance(score_mod, ScoreMod):
        raise TypeError(
            f"score_mod must be a numattn.ScoreMod (or softcap(...), alibi(...)) or None, got "
            f"{type(score_mod).__name__}"
        )
    if not mask_functions and score_mod is None:
        return None
    import numba

    index = numba.int64
    for leaf in mask_functions:
        _check_compiles("FunctionMask", leaf.fn, (index,) * 4,
                        _capture_types("FunctionMask", leaf.fn, leaf.captures, device),
                        (numba.types.Boolean, numba.types.Integer))
    if score_mod is not None:
        _check_compiles("ScoreMod", score_mod.fn, (numba.from_dtype(dtype),) + (index,) * 4,
                        _capture_types("ScoreMod", score_mod.fn, score_mod.captures, device),
                        (numba.types.Float, numba.types.Integer))
    special = _specialization(
        tuple((leaf.fn, len(leaf.captures)) for leaf in mask_functions),
        None if score_mod is None else (score_mod.fn, len(score_mod.captures)))
    per_head = any(_reads_argument(leaf.fn, 1) for leaf in mask_functions)
    return BoundFunctions(special, tuple(mask_functions), score_mod, per_head)


@functools.cache
def _no_tables():
    return np.zeros((0, 1, 1, 1), dtype=np.uint8)


def kernel_functions(bound, q_start_pos, offsets=(0, 0, 0)):
    """The kernels' ``functions`` tuple of ``bound`` (``None``: no functions):
    ``(tables, q_start_pos, has_score_mod, per_head, batch_offset, q_offset, k_offset,
    *captures)``.

    Flat, as Numba's parallel loops take no tuple that holds a tuple: the captures of the
    mask functions, in order, then the score modifier's, from index
    :data:`FIRST_CAPTURE` (the generated bodies know where each function's are).
    ``tables`` is a placeholder: :func:`numattn.kernels.cpu.function_tiles.with_tile_tables`
    puts in the uint8 ``[functions, B, row blocks, key blocks]`` tile table of a call
    (without it every tile of a function is partial).  ``offsets = (batch_offset, q_offset,
    k_offset)`` are added to the sequence and positions a score function sees (internal: a
    shard of :mod:`numattn.dask`; mask functions see their positions shifted by the mask
    program, the sequence by ``batch_offset``).
    """
    offsets = tuple(np.int64(x) for x in offsets)
    if bound is None:
        return (_no_tables(), q_start_pos, False, False, *offsets)
    captures = [c for leaf in bound.masks for c in leaf.captures]
    if bound.score_mod is not None:
        captures += bound.score_mod.captures
    return (_no_tables(), q_start_pos, bound.score_mod is not None, bound.per_head, *offsets,
            *captures)


def _capture_types(kind, fn, captures, device):
    import numba

    kinds = []
    for i, value in enumerate(captures):
        is_number = isinstance(value, (int, float, bool, np.number, np.bool_))
        if not (is_number or isinstance(value, np.ndarray) or is_device_array(value)):
            raise TypeError(f"{kind} {_name(fn)}: capture {i} must be a NumPy array or a "
                            f"number, got {type(value).__name__}")
        if device == "cpu" and is_device_array(value):
            raise TypeError(f"{kind} {_name(fn)}: capture {i} is a device array, but this call "
                            f"runs on the CPU")
        kinds.append(numba.typeof(value))
    return tuple(kinds)


def _name(fn):
    return getattr(fn, "__qualname__", repr(fn))


#: ``(function digest, argument types)`` that :func:`_check_compiles` has passed.
_CHECKED = set()


def _check_compiles(kind, fn, position_types, capture_types, returns):
    """Compile ``fn`` for the CPU with these argument types, or raise ``TypeError`` (once per
    function and types: later calls find them in :data:`_CHECKED`)."""
    signature = tuple(position_types) + tuple(capture_types)
    key = (_digest(fn), signature)
    if key in _CHECKED:
        return
    dispatcher = _cpu_binding(fn)
    try:
        dispatcher.compile(signature)
        result = dispatcher.overloads[signature].signature.return_type
    except Exception as exc:  # Numba's typing and lowering errors
        first = str(exc).strip().splitlines()
        raise TypeError(
            f"{kind} function {_name(fn)} cannot be compiled by Numba for arguments "
            f"({', '.join(map(str, signature))}): {first[0] if first else type(exc).__name__}"
        ) from exc
    if not isinstance(result, returns):
        raise TypeError(f"{kind} function {_name(fn)} must return a "
                        f"{'bool' if kind == 'FunctionMask' else 'number'}, returns {result}")
    _CHECKED.add(key)


#: The bodies and kernel specializations of user functions, by what their compiled code
#: depends on (:func:`_function_digest`), not by function object: a function made afresh
#: for each call (a lambda, a closure, one unpickled by a Dask worker) finds the kernels
#: compiled for the first one.
_BODIES = {}
_SPECIALIZATIONS = {}


@functools.lru_cache(maxsize=1024)
def _digest(fn):
    return _function_digest(fn)


def _user_body(fn):
    """A copy of the user's function marked as a body, compiled like one but never cached
    on disk by itself (it may live in no file); the kernels that call it are."""
    key = _digest(fn)
    found = _BODIES.get(key)
    if found is not None:
        return found
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                              fn.__closure__)
    copy.__qualname__ = fn.__qualname__
    copy.__module__ = fn.__module__
    copy._numattn_body = True
    copy._numattn_uncached = True
    return _BODIES.setdefault(key, copy)


def _cpu_binding(fn):
    from .jit import cpu_jit

    return cpu_jit(_user_body(fn))


def _reads_argument(fn, position):
    """Whether ``fn`` reads its argument ``position`` (else no value of it matters)."""
    return _code_reads_argument(fn.__code__, position)


@functools.lru_cache(maxsize=1024)
def _code_reads_argument(code, position):
    if position >= code.co_argcount:
        return False
    name = code.co_varnames[position]
    if name in code.co_cellvars:  # an inner function reads it
        return True
    for instruction in dis.get_instructions(code):
        if instruction.opname.startswith("LOAD_FAST") or instruction.opname == "DELETE_FAST":
            value = instruction.argval
            if value == name or (isinstance(value, tuple) and name in value):
                return True
    return False


def _captured(first, count):
    """The source of ``count`` captures from ``functions[first]`` on, as call arguments."""
    return "".join(f", functions[{i}]" for i in range(first, first + count))


def _specialization(mask_fns, score_fn):
    """The kernels' copies for these functions (``(fn, number of captures)`` each):
    generated ``_function_visible`` and ``_score_mod`` bodies that call them."""
    key = tuple((_digest(fn), count) for fn, count in mask_fns), (
        None if score_fn is None else (_digest(score_fn[0]), score_fn[1]))
    found = _SPECIALIZATIONS.get(key)
    if found is None:
        found = _SPECIALIZATIONS.setdefault(key, _new_specialization(mask_fns, score_fn))
    return found


def _new_specialization(mask_fns, score_fn):
    lines = []
    scope = {"__name__": __name__}
    overrides = {}
    first = FIRST_CAPTURE
    if mask_fns:
        lines.append("def _function_visible(index, functions, b, h, q_idx, k_idx):")
        for i, (fn, count) in enumerate(mask_fns):
            scope[f"_mask_{i}"] = _user_body(fn)
            call = (f"return 1 if _mask_{i}(b, h, q_idx, k_idx{_captured(first, count)}) "
                    f"else 0")
            first += count
            if i < len(mask_fns) - 1:
                lines += [f"    if index == {i}:", f"        {call}"]
            else:
                lines.append(f"    {call}")
    if score_fn is not None:
        fn, count = score_fn
        scope["_score_fn"] = _user_body(fn)
        lines += ["def _score_mod(functions, score, b, h, q_idx, k_idx):",
                  f"    return _score_fn(score, b, h, q_idx, k_idx{_captured(first, count)})"]
    exec(compile("\n".join(lines) + "\n", "<numattn user functions>", "exec"), scope)
    for name in ("_function_visible", "_score_mod"):
        if name in scope:
            scope[name]._numattn_body = True
            scope[name]._numattn_uncached = True
            overrides[name] = scope[name]
    digest = hashlib.sha1()
    for entry in (*mask_fns, None, score_fn):
        digest.update(b"-" if entry is None else _digest(entry[0]) + bytes(entry[1]))
    return Specialization(overrides, "f" + digest.hexdigest()[:12])


def _code_digest(code, digest):
    """Add what ``code`` computes to ``digest``: its bytecode, constants (nested code
    included) and names, not its file and line (a function moved or copied is the same)."""
    digest.update(code.co_code + repr((code.co_names, code.co_varnames, code.co_argcount,
                                       code.co_freevars)).encode())
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _code_digest(const, digest)
        else:
            digest.update(repr((type(const).__name__, const)).encode())


def _function_digest(fn, depth=0):
    """What the compiled code of ``fn`` depends on: its code, and the values it reads from
    globals and closures (Numba freezes them), for the names of cached kernels."""
    digest = hashlib.sha1()
    _code_digest(fn.__code__, digest)
    digest.update(fn.__qualname__.encode())
    values = [fn.__globals__.get(name) for name in fn.__code__.co_names]
    values += [cell.cell_contents for cell in fn.__closure__ or ()]
    for value in values:
        if isinstance(value, (int, float, complex, str, bytes, bool, np.number)) or value is None:
            digest.update(repr(value).encode())
        elif isinstance(value, np.ndarray):
            digest.update(repr((value.dtype, value.shape)).encode() + value.tobytes())
        elif isinstance(value, types.ModuleType):
            digest.update(value.__name__.encode())
        elif hasattr(value, "py_func") and depth < 4:  # a jitted helper
            digest.update(_function_digest(value.py_func, depth + 1))
        elif isinstance(value, types.FunctionType) and depth < 4:
            digest.update(_function_digest(value, depth + 1))
        else:
            digest.update(type(value).__qualname__.encode())
    return digest.digest()
