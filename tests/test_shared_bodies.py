"""Every body of ``numattn.kernels.shared`` compiled for both targets: for the CPU (checked
against the same body run as plain Python) and to PTX for ``cc=(9, 0)`` (no GPU needed),
in float32 and float64 where it computes in floats.  The bodies are found by walking the
modules, so a new body without sample arguments here fails the first test.  The online
softmax's state steps are checked against a float64 brute-force softmax as well."""

from __future__ import annotations

import importlib
import math
import pkgutil

import numpy as np
import pytest

import numattn.kernels.shared as shared
from numattn.core import jit as _jit
from numattn.core.functions import kernel_functions
from numattn.core.masks import (
    OP_FUNCTION,
    TILE_FULL,
    TILE_NONE,
    TILE_PARTIAL,
    compile_mask,
)
from numattn.kernels.shared.softmax import (
    accumulate,
    key_weight,
    max_nan,
    merge_partials,
    rescale_factor,
)
from numattn.masks import (
    CausalMask,
    ChunkedCausalMask,
    ChunkedMask,
    NullMask,
    SlidingWindowCausalMask,
)

from .utils import assert_close

FLOATS = [np.float32, np.float64]
INF = math.inf
NAN = math.nan


def shared_bodies():
    """``{qualified name: body}`` of every ``@body`` function of numattn.kernels.shared."""
    found = {}
    for info in pkgutil.iter_modules(shared.__path__):
        module = importlib.import_module(f"{shared.__name__}.{info.name}")
        for name, obj in vars(module).items():
            if getattr(obj, "_numattn_body", False) and obj.__module__ == module.__name__:
                found[f"{info.name}.{name}"] = obj
    return found


BODIES = shared_bodies()


def _programs():
    masks = [NullMask(), CausalMask(), SlidingWindowCausalMask(5), ChunkedMask(4),
             ChunkedCausalMask(6), CausalMask() & SlidingWindowCausalMask(3),
             ChunkedMask(8) | SlidingWindowCausalMask(2)]
    # and with position offsets (the keys of a shard of a longer sequence, numattn.dask)
    return ([compile_mask(m)[0] for m in masks]
            + [compile_mask(m, positions=(7, 30))[0] for m in masks[1:]])


_LEAVES = [(NullMask.opcode, 0), (CausalMask.opcode, 0), (SlidingWindowCausalMask.opcode, 5),
           (ChunkedMask.opcode, 4), (ChunkedCausalMask.opcode, 6)]


def _positions(rng, count):
    return [tuple(int(x) for x in rng.integers(0, 40, 2)) for _ in range(count)]


def _ranges(rng, count):
    """``(q0, q1, k0, k1)``: query and key ranges of a tile (inclusive)."""
    out = []
    for _ in range(count):
        q0, k0 = (int(x) for x in rng.integers(0, 40, 2))
        out.append((q0, q0 + int(rng.integers(0, 9)), k0, k0 + int(rng.integers(0, 9))))
    return out


def _scalars(rng, dtype, count):
    return [dtype(x) for x in rng.standard_normal(count) * 3]


def _pairs(rng, f):
    """``(a, b)`` with ``a <= b``, and the edges: ``-inf``, equal, NaN, an underflow."""
    a, b = sorted(_scalars(rng, f, 2))
    return [(a, b), (f(-INF), b), (f(-INF), f(-INF)), (a, a), (f(NAN), b), (f(-40), f(60))]


def _max_samples(rng, f):
    return [pair for a, b in _pairs(rng, f) for pair in ((a, b), (b, a))]


def _rescale_samples(rng, f):
    return [*_pairs(rng, f), (f(1), f(-INF)), (f(NAN), f(NAN))]


def _accumulate_samples(rng, f):
    return [tuple(_scalars(rng, f, 3)), (f(0), f(0), f(2)), (f(NAN), f(0), f(1))]


def _finish_samples(rng, f):
    m, l, sink = _scalars(rng, f, 3)
    l = f(abs(l) + 0.1)
    return [(m, l, sink, True), (m, l, sink, False), (f(-INF), f(0), f(1.5), True),
            (f(-INF), f(0), f(NAN), True), (f(-INF), f(0), f(0), False),
            (f(2), f(0), f(0), False), (f(1), f(NAN), f(0), False),
            (f(-INF), f(0.5), f(0.25), True)]


def _merge_samples(rng, f):
    batch, parts, rows, head_dim = 2, 4, 3, 5
    part_m = (rng.standard_normal((batch, parts, rows)) * 3).astype(f)
    part_m[1, 1, 0] = -INF  # an empty part
    part_m[1, :, 2] = -INF  # a row empty in every part
    part_l = rng.uniform(0.5, 4, (batch, parts, rows)).astype(f)
    part_l[1, 1, 0] = part_l[1, :, 2] = 0
    part_acc = rng.standard_normal((batch, parts, rows, head_dim)).astype(f)
    out = rng.standard_normal((batch, rows, head_dim)).astype(f)
    sink = f(rng.standard_normal())
    return [(part_m, part_l, part_acc, b, r, finished, sink, has_sink, d0, d_step, out)
            for b in range(batch) for r in range(rows)
            for finished, has_sink in [(False, True), (False, False), (True, False)]
            for d0, d_step in [(0, 1), (1, 2)]]


def _leaf_visible_samples(rng, f):
    return [(op, param, q, k) for op, param in _LEAVES for q, k in _positions(rng, 6)]


def _leaf_tile_samples(rng, f):
    return [(op, param, *r) for op, param in _LEAVES for r in _ranges(rng, 6)]


def _leaf_span_samples(rng, f):
    return [(op, param, q) for op, param in _LEAVES for q, _ in _positions(rng, 6)]


def _leaf_positions_samples(rng, f):
    return [(p, i, q, k) for p in _programs() for i in range(p.shape[0])
            for q, k in _positions(rng, 2)]


#: The kernels' ``functions`` tuple without functions, and one with a FunctionMask's tile
#: table (one function, two sequences, 3 x 4 blocks).
NO_FUNCTIONS = kernel_functions(None, np.array([0, 5]))


def _with_table(rng):
    table = rng.integers(0, 4, (1, 2, 3, 4)).astype(np.uint8)
    return (table, np.array([0, 5]), False, False, np.int64(0), np.int64(0), np.int64(0))


def _visible_samples(rng, f):
    return [(p, NO_FUNCTIONS, 1, 2, q, k) for p in _programs() for q, k in _positions(rng, 6)]


def _tile_status_samples(rng, f):
    return [(p, NO_FUNCTIONS, 1, *r) for p in _programs() for r in _ranges(rng, 6)]


def _function_visible_samples(rng, f):
    return [(0, NO_FUNCTIONS, b, h, q, k) for b, h in [(0, 0), (1, 3)]
            for q, k in _positions(rng, 3)]


def _function_tile_samples(rng, f):
    return [(functions, 0, b, q0 + 5 * b, q1 + 5 * b, k0, k1)
            for functions in (NO_FUNCTIONS, _with_table(rng)) for b in (0, 1)
            for q0, q1, k0, k1 in [(0, 0, 0, 0), (0, 40, 0, 60), (17, 33, 20, 40),
                                   (3, 9, 50, 70)]]


def _function_block_samples(rng, f):
    program = np.array([[OP_FUNCTION, 0]])
    return [(program, 0, _with_table(rng), b, q0, q1, k0, k1, heads)
            for b in (0, 1) for heads in (1, 3)
            for q0, q1, k0, k1 in [(0, 16, 0, 16), (5, 5, 0, 16), (2, 9, 4, 4), (3, 4, 7, 9)]]


def _score_samples(rng, f):
    return [(NO_FUNCTIONS, s, 1, 2, 9, 4) for s in (*_scalars(rng, f, 3), f(-INF), f(NAN))]


def _score_mod_samples(rng, f):
    return [(NO_FUNCTIONS, s, 0, 1, 9, 4) for s in (*_scalars(rng, f, 3), f(-INF), f(NAN))]


def _read_score_samples(rng, f):
    return [(s,) for s in (*_scalars(rng, f, 3), f(-INF), f(INF), f(NAN), f(-0.0))]


def _span_samples(rng, f):
    return [(p, q, k0, int(rng.integers(1, 20))) for p in _programs()
            for q, k0 in _positions(rng, 4)]


def _add_bias_samples(rng, f):
    return [tuple(_scalars(rng, f, 2)), (f(NAN), f(-INF)), (f(INF), f(-INF)),
            (f(1), f(-INF)), (f(NAN), f(1))]


def _additive(rng, f):
    additive = rng.standard_normal((2, 3, 4, 12)).astype(f)
    additive[..., ::3] = -INF
    return additive


def _key_bias_samples(rng, f):
    return [(_additive(rng, f), b, h, row, t)
            for b, h, row, t in [(0, 0, 0, 0), (1, 2, 3, 11), (1, 1, 2, 6)]]


def _key_hidden_samples(rng, f):
    return [(p, NO_FUNCTIONS, status, q, has_additive, _additive(rng, f), 1, 2, t)
            for p in _programs()[:4] for status in (TILE_NONE, TILE_PARTIAL, TILE_FULL)
            for has_additive in (True, False) for q, t in [(5, 3), (5, 6), (9, 11)]]


def _page_slot_samples(rng, f):
    table = np.array([[3, 0, 2], [1, 4, 5]])
    return [(table, 4, np.array([0, 2]), b, t)
            for b, t in [(0, 0), (0, 5), (0, 11), (1, 0), (1, 2), (1, 9)]]


def _partition_samples(rng, f):
    return [(n, p, parts, block) for n in (0, 1, 7, 64, 1000) for parts in (1, 3, 8)
            for p in range(parts) for block in (1, 16)]


#: bit patterns of each 16- and 8-bit format: zeros, subnormals, normals, the largest, inf, NaN
_PATTERNS = {
    "bfloat16": (np.uint16, [0x0000, 0x8000, 0x0001, 0x807F, 0x3F80, 0xC0A0, 0x7F7F, 0x7F80,
                             0xFF80, 0x7FC0]),
    "float16": (np.int16, [0x0000, -0x8000, 0x0001, 0x03FF, 0x3C00, -0x3B00, 0x7BFF, 0x7C00,
                           -0x0400, 0x7E00]),
    "float8_e4m3fn": (np.uint8, [0x00, 0x80, 0x01, 0x07, 0x38, 0xC4, 0x7E, 0x7F, 0xFF]),
    "float8_e5m2": (np.uint8, [0x00, 0x80, 0x01, 0x03, 0x3C, 0xC1, 0x7B, 0x7C, 0xFC, 0x7D]),
    "int8": (np.int8, [0, 1, -1, 127, -128]),
}
_LAYOUTS = {"bfloat16": (8, 7, False), "float16": (5, 10, False),
            "float8_e4m3fn": (4, 3, True), "float8_e5m2": (5, 2, False)}


def _minifloat_samples(rng, f):
    like = np.zeros(1, f)
    return [(int(bits) & 0xFFFF, *_LAYOUTS[name], like) for name, (_, patterns)
            in _PATTERNS.items() if name in _LAYOUTS for bits in patterns]


def _stored_value_samples(rng, f):
    from numattn.core import dtypes

    like = np.zeros(1, f)
    samples = [(np.asarray(x, f)[()], dtypes.FORMAT_NATIVE, like) for x in (1.5, -0.0, INF)]
    for name, (view, patterns) in _PATTERNS.items():
        samples += [(view(bits), dtypes.storage_format(name if name in ("int8", "float16")
                                                       else dtypes.ml_dtype(name)), like)
                    for bits in patterns]
    return samples


def _rounding_samples(rng, f):
    return [(f(x),) for x in (0.5, 1.5, 2.5, -0.5, -2.5, 126.49, -127.5, 0.0, 3.7)]


def _minifloat_bits_samples(rng, f):
    values = (1 + 2**-8, 1 + 3 * 2**-8, 2**-133, 460.0, 1e6, -0.0, INF, -INF, NAN, 0.3)
    return [(f(x), *_LAYOUTS[name][:3]) for name in _LAYOUTS for x in values]


def _stored_bits_samples(rng, f):
    from numattn.core import dtypes

    formats = [dtypes.storage_format(name if name in ("int8", "float16") else
                                     dtypes.ml_dtype(name)) for name in _PATTERNS]
    return [(f(x), code) for code in formats for x in (1 + 2**-8, -0.0, 100.5, 3.0e4, NAN)]


#: Sample arguments of every shared body: ``name -> (float_typed, samples(rng, dtype))``;
#: float-typed bodies are compiled and checked in float32 and float64.
SAMPLES = {
    "softmax.exp_diff": (True, _pairs),
    "softmax.max_nan": (True, _max_samples),
    "softmax.rescale_factor": (True, _rescale_samples),
    "softmax.key_weight": (True, _pairs),
    "softmax.accumulate": (True, _accumulate_samples),
    "softmax.finish_row": (True, _finish_samples),
    "softmax.merge_weight": (True, _pairs),
    "softmax.merge_partials": (True, _merge_samples),
    "masks._leaf_visible": (False, _leaf_visible_samples),
    "masks._leaf_tile": (False, _leaf_tile_samples),
    "masks._leaf_span": (False, _leaf_span_samples),
    "masks._leaf_positions": (False, _leaf_positions_samples),
    "masks.mask_visible": (False, _visible_samples),
    "masks.mask_tile_status": (False, _tile_status_samples),
    "masks.visible_span": (False, _span_samples),
    "masks.add_bias": (True, _add_bias_samples),
    "masks.key_bias": (True, _key_bias_samples),
    "masks.key_hidden": (True, _key_hidden_samples),
    "masks._function_visible": (False, _function_visible_samples),
    "masks.function_tile": (False, _function_tile_samples),
    "masks.function_block": (False, _function_block_samples),
    "scores.modified_score": (True, _score_samples),
    "scores._score_mod": (True, _score_mod_samples),
    "scores.read_score": (True, _read_score_samples),
    "paging.kv_page_slot": (False, _page_slot_samples),
    "partitions.partition_bounds": (False, _partition_samples),
    "storage.minifloat": (True, _minifloat_samples),
    "storage.stored_value": (True, _stored_value_samples),
    "storage.round_half_even": (True, _rounding_samples),
    "storage.minifloat_bits": (True, _minifloat_bits_samples),
    "storage.stored_bits": (True, _stored_bits_samples),
}


def test_every_shared_body_has_samples():
    assert BODIES, "found no body in numattn.kernels.shared"
    assert sorted(SAMPLES) == sorted(BODIES), (
        "sample arguments missing for: " + ", ".join(sorted(set(BODIES) - set(SAMPLES)))
        + "; stale entries: " + ", ".join(sorted(set(SAMPLES) - set(BODIES))))


def _cases():
    for name in sorted(SAMPLES):
        float_typed = SAMPLES[name][0]
        for dtype in FLOATS if float_typed else [np.int64]:
            yield pytest.param(name, dtype, id=f"{name}-{np.dtype(dtype).name}")


def _copy(args):
    return tuple(np.copy(a) if isinstance(a, np.ndarray) else a for a in args)


def _assert_same(got, expected, dtype, what):
    """Compiled against plain Python: ints and bools exactly, floats to the dtype's
    rounding (the compiled float32 code stays in float32 where plain Python's ``math``
    computes in float64) with the same NaN and inf."""
    if isinstance(expected, tuple):
        assert isinstance(got, tuple) and len(got) == len(expected), what
        for i, (g, e) in enumerate(zip(got, expected)):
            _assert_same(g, e, dtype, f"{what}[{i}]")
        return
    got, expected = np.asarray(got), np.asarray(expected)
    if expected.dtype.kind in "biu":
        assert np.array_equal(got, expected), what
        return
    tol = 1e-5 if dtype == np.float32 else 1e-14
    assert_close(got, expected.astype(np.float64), np.float64, tol=tol, what=what)


@pytest.mark.parametrize(("name", "dtype"), list(_cases()))
def test_body_on_the_cpu_matches_plain_python(name, dtype, rng):
    func = BODIES[name]
    compiled = _jit.cpu_jit(func)
    for n, args in enumerate(SAMPLES[name][1](rng, dtype)):
        expected_args = _copy(args)
        got_args = _copy(args)
        with np.errstate(invalid="ignore"):  # inf - inf on NumPy scalars: NaN, on purpose
            expected = func(*expected_args)
        got = compiled(*got_args)
        _assert_same(got, expected, dtype, f"{name} sample {n}: result")
        for i, (g, e) in enumerate(zip(got_args, expected_args)):
            if isinstance(e, np.ndarray):  # what the body wrote
                _assert_same(g, e, dtype, f"{name} sample {n}: argument {i}")


@pytest.mark.parametrize(("name", "dtype"), list(_cases()))
def test_body_compiles_to_ptx(name, dtype, ptx_compiler, rng):
    import numba
    from numba.cuda import compile_ptx

    args = SAMPLES[name][1](rng, dtype)[0]
    signature = tuple(numba.typeof(a) for a in args)
    ptx, _ = compile_ptx(_jit.cuda_source(BODIES[name]), signature, device=True, cc=(9, 0))
    assert ".target sm_90" in ptx


def _brute_force(scores, values, sink, has_sink):
    """float64 softmax of the visible (finite) scores, with the sink counted once."""
    s = scores.astype(np.float64)
    big = max(s.max(initial=-INF), float(sink) if has_sink else -INF)
    if big == -INF:
        return np.zeros(values.shape[1]), float(sink) if has_sink else -INF
    w = np.exp(s - big)
    denom = w.sum() + (np.exp(float(sink) - big) if has_sink else 0)
    return w @ values.astype(np.float64) / denom, big + np.log(denom)


@_jit.body
def _tiled_states(scores, values, tile, part_m, part_l, part_acc, part):
    """State ``(m, l, acc)`` of ``scores`` tile by tile, with the shared state steps."""
    m = -math.inf
    l = values[0, 0] - values[0, 0]  # 0 of the dtype
    acc = part_acc[0, part, 0]
    for d in range(acc.shape[0]):
        acc[d] = 0
    for k0 in range(0, scores.shape[0], tile):
        k1 = min(k0 + tile, scores.shape[0])
        tile_max = -math.inf
        for j in range(k0, k1):
            tile_max = max_nan(tile_max, scores[j])
        m, alpha = rescale_factor(m, tile_max)
        tile_sum = l - l
        for d in range(acc.shape[0]):
            added = l - l
            for j in range(k0, k1):
                added += key_weight(scores[j], m) * values[j, d]
            acc[d] = accumulate(acc[d], alpha, added)
        for j in range(k0, k1):
            tile_sum += key_weight(scores[j], m)
        l = accumulate(l, alpha, tile_sum)
    part_m[0, part, 0] = m
    part_l[0, part, 0] = l


def _split_softmax(scores, values, splits, tile, sink, has_sink, part_m, part_l, part_acc,
                   out):
    """One row's softmax over ``len(splits) - 1`` partitions of its keys, merged."""
    for p in range(splits.shape[0] - 1):
        _tiled_states(scores[splits[p]:splits[p + 1]], values[splits[p]:splits[p + 1]], tile,
                      part_m, part_l, part_acc, p)
    return merge_partials(part_m, part_l, part_acc, 0, 0, False, sink, has_sink, 0, 1, out)


@pytest.mark.parametrize("dtype", FLOATS)
def test_state_steps_match_a_brute_force_softmax(dtype, rng):
    """Tiles, partitions and their merge, written with the shared state steps and compiled
    for the CPU, against a float64 softmax, for every split of the keys."""
    kernel = _jit.cpu_jit(_split_softmax)
    n, head_dim = 23, 6
    scores = (rng.standard_normal(n) * 3).astype(dtype)
    scores[[0, 1, 2, 9]] = -np.inf  # hidden keys: a partition may see none
    values = rng.standard_normal((n, head_dim)).astype(dtype)
    sink = dtype(rng.standard_normal())
    for splits in ([0, n], [0, 3, n], [0, 2, 11, 12, n]):
        splits = np.array(splits, np.int64)
        parts = splits.shape[0] - 1
        for tile in (1, 4, 64):
            for has_sink in (True, False):
                part_m = np.empty((1, parts, 1), dtype)
                part_l = np.empty((1, parts, 1), dtype)
                part_acc = np.empty((1, parts, 1, head_dim), dtype)
                out = np.empty((1, 1, head_dim), dtype)
                lse = kernel(scores, values, splits, tile, sink, has_sink, part_m, part_l,
                             part_acc, out)
                visible = np.isfinite(scores)
                ref_out, ref_lse = _brute_force(scores[visible], values[visible], sink,
                                                has_sink)
                assert_close(out[0, 0], ref_out, dtype)
                assert_close(np.array(lse), np.array(ref_lse), dtype, what="lse")


@pytest.mark.parametrize("dtype", FLOATS)
def test_merge_of_finished_parts_matches_a_brute_force_softmax(dtype, rng):
    """Finished results ``(lse_p, out_p)`` merge into the softmax over all keys; an empty
    part's output (NaN here) is never read."""
    kernel = _jit.cpu_jit(merge_partials)
    n, head_dim, splits = 17, 4, [0, 5, 5, 12, 17]
    scores = (rng.standard_normal(n) * 3).astype(dtype)
    values = rng.standard_normal((n, head_dim)).astype(dtype)
    parts = len(splits) - 1
    part_lse = np.empty((1, parts, 1), dtype)
    part_out = np.empty((1, parts, 1, head_dim), dtype)
    for p in range(parts):
        part_out[0, p, 0], part_lse[0, p, 0] = _brute_force(
            scores[splits[p]:splits[p + 1]], values[splits[p]:splits[p + 1]], 0, False)
    part_out[0, 1, 0] = np.nan  # part 1 holds no key: lse -inf
    out = np.empty((1, 1, head_dim), dtype)
    lse = kernel(part_lse, part_lse, part_out, 0, 0, True, dtype(0), False, 0, 1, out)
    ref_out, ref_lse = _brute_force(scores, values, 0, False)
    assert part_lse[0, 1, 0] == -np.inf
    assert_close(out[0, 0], ref_out, dtype)
    assert_close(np.array(lse), np.array(ref_lse), dtype, what="lse")
