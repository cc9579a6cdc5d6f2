"""Masks: every leaf's bodies, and the programs built from them, against brute force, on
every target."""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import numattn
from numattn.core import masks as M
from numattn.core.functions import kernel_functions
from numattn.core.jit import cpu_jit
from numattn.kernels.shared import masks as KM

from .conftest import requires_cuda

ROOT = Path(__file__).resolve().parent.parent

LEAVES = [
    M.NullMask(),
    M.CausalMask(),
    M.SlidingWindowCausalMask(1),
    M.SlidingWindowCausalMask(5),
    M.ChunkedMask(1),
    M.ChunkedMask(4),
    M.ChunkedCausalMask(3),
    M.ChunkedCausalMask(8),
]
COMPOSED = [
    M.CausalMask() & M.SlidingWindowCausalMask(6),
    M.ChunkedMask(4) | M.SlidingWindowCausalMask(3),
    (M.ChunkedMask(5) & M.CausalMask()) | (M.NullMask() & M.SlidingWindowCausalMask(2)),
    M.ChunkedCausalMask(4) | (M.CausalMask() & M.ChunkedMask(3)) | M.SlidingWindowCausalMask(7),
]
ALL_MASKS = LEAVES + COMPOSED

# The bodies are called by these names in the kernels of this file; cpu_jit / cuda_kernel
# rebind them to the bodies compiled for the same target.
mask_visible = KM.mask_visible
mask_tile_status = KM.mask_tile_status
visible_span = KM.visible_span
#: The kernels' ``functions`` argument of masks without a FunctionMask.
NO_FUNCTIONS = kernel_functions(None, np.zeros(1, np.int64))


# -- every registered leaf against brute force ------------------------------------------

#: Parameters every leaf is checked with, up to the largest int64 (where ``q - window + 1``
#: and the like would wrap).
LEAF_PARAMETERS = [1, 2, 3, 5, 8, 2**63 - 2, 2**63 - 1]
#: Query and key positions of the brute-force grids (queries sit at negative positions when
#: a sequence has more queries than keys).
GRID_Q = np.arange(-8, 20)
GRID_K = np.arange(-3, 32)
#: Key windows ``(k0, kw)`` of the span checks, inside GRID_K.
SPAN_WINDOWS = [(k0, kw) for k0 in range(-3, 20) for kw in range(13)]


def leaf_examples(cls, parameters=LEAF_PARAMETERS):
    """Instances of a leaf class: one per parameter, in every field (one if it has none)."""
    fields = dataclasses.fields(cls)
    if not fields:
        return [cls()]
    return [cls(*[value] * len(fields)) for value in parameters]


def _registered_leaf_examples():
    return [mask for cls in M.LEAF_TYPES for mask in leaf_examples(cls)]


def _grid_visible(program, functions, q_pos, k_pos, out):
    for i in range(q_pos.shape[0]):
        for j in range(k_pos.shape[0]):
            out[i, j] = mask_visible(program, functions, 0, 0, q_pos[i], k_pos[j])


def _tile_statuses(program, functions, tiles, out):
    for t in range(tiles.shape[0]):
        out[t] = mask_tile_status(program, functions, 0, tiles[t, 0], tiles[t, 1], tiles[t, 2],
                                  tiles[t, 3])


def _spans(program, q_pos, windows, out):
    for i in range(q_pos.shape[0]):
        for w in range(windows.shape[0]):
            jlo, jhi, is_span = visible_span(program, q_pos[i], windows[w, 0], windows[w, 1])
            out[i, w, 0] = jlo
            out[i, w, 1] = jhi
            out[i, w, 2] = 1 if is_span else 0


def _definition_grid(mask, q_pos, k_pos):
    """Visibility by the leaf's own definition, pair by pair on Python integers (no wrap)."""
    param = mask._parameter()
    return np.array([[bool(mask.leaf_visible(param, int(q), int(k))) for k in k_pos]
                     for q in q_pos])


@functools.cache
def _all_tiles():
    """Every tile [q0, q1] x [k0, k1] of GRID_Q x GRID_K[:23]."""
    q = [(a, b) for a in range(len(GRID_Q)) for b in range(a, len(GRID_Q))]
    k = [(a, b) for a in range(23) for b in range(a, 23)]
    index = np.array([(qa, qb, ka, kb) for qa, qb in q for ka, kb in k])
    positions = np.stack([GRID_Q[index[:, 0]], GRID_Q[index[:, 1]], GRID_K[index[:, 2]],
                          GRID_K[index[:, 3]]], axis=1)
    return index, positions


def _tile_counts(truth, index):
    """Visible pairs and all pairs of every tile (by 2-D prefix sums of the grid)."""
    s = np.zeros((truth.shape[0] + 1, truth.shape[1] + 1), np.int64)
    s[1:, 1:] = truth.cumsum(0).cumsum(1)
    qa, qb, ka, kb = index.T
    visible = s[qb + 1, kb + 1] - s[qa, kb + 1] - s[qb + 1, ka] + s[qa, ka]
    return visible, (qb - qa + 1) * (kb - ka + 1)


def _check_spans(program_mask, truth, positions=None):
    """The compiled run of keys of every grid query and SPAN_WINDOWS window is exactly the
    visible keys there (``truth``, whose rows must each be one run; the program compiled
    with ``positions``)."""
    k0, kw = np.array(SPAN_WINDOWS).T
    lo = np.zeros((len(GRID_Q), len(SPAN_WINDOWS)), np.int64)  # expected, as positions
    hi = np.zeros_like(lo)
    for i, row in enumerate(truth):
        shown = GRID_K[row]
        assert shown.size == 0 or np.all(np.diff(shown) == 1), ("not one run", GRID_Q[i])
        first, end = (shown[0], shown[-1] + 1) if shown.size else (0, 0)
        lo[i] = np.maximum(first, k0)
        hi[i] = np.maximum(np.minimum(end, k0 + kw), lo[i])
    spans = np.zeros((len(GRID_Q), len(SPAN_WINDOWS), 3), np.int64)
    cpu_jit(_spans)(M.compile_mask(program_mask, positions=positions)[0], GRID_Q,
                    np.array(SPAN_WINDOWS), spans)
    jlo, jhi, is_span = spans[..., 0], spans[..., 1], spans[..., 2]
    assert np.all(is_span == 1), program_mask
    assert np.all((0 <= jlo) & (jlo <= jhi) & (jhi <= kw)), program_mask
    shown = lo < hi
    assert np.array_equal(jlo < jhi, shown), program_mask
    assert np.array_equal((jlo + k0)[shown], lo[shown]), program_mask
    assert np.array_equal((jhi + k0)[shown], hi[shown]), program_mask


#: Masks a leaf is intersected with in the span checks.
SPAN_PARTNERS = [M.CausalMask(), M.SlidingWindowCausalMask(4), M.ChunkedMask(6)]


def check_leaf(mask):
    """Every consumer of a leaf's definition against brute force over the grids."""
    truth = _definition_grid(mask, GRID_Q, GRID_K)
    # the NumPy form, on arrays (and on int32 arrays, which must not overflow)
    assert np.array_equal(mask.visible(GRID_Q[:, None], GRID_K[None, :]), truth)
    assert np.array_equal(mask.visible(GRID_Q.astype(np.int32)[:, None], GRID_K), truth)
    program, _ = M.compile_mask(mask)
    # the compiled pair test
    got = np.zeros(truth.shape, np.bool_)
    cpu_jit(_grid_visible)(program, NO_FUNCTIONS, GRID_Q, GRID_K, got)
    assert np.array_equal(got, truth), mask
    # the compiled tile status of every tile: sound, and exact for an exact leaf_tile
    index, tiles = _all_tiles()
    status = np.zeros(len(tiles), np.int64)
    cpu_jit(_tile_statuses)(program, NO_FUNCTIONS, tiles, status)
    visible, pairs = _tile_counts(truth, index)
    exact = np.where(visible == 0, M.TILE_FULL,
                     np.where(visible == pairs, M.TILE_NONE, M.TILE_PARTIAL))
    wrong = (status != exact) & (status != M.TILE_PARTIAL)  # never FULL or NONE wrongly
    if type(mask).leaf_tile_exact:
        wrong |= status != exact
    assert not wrong.any(), (mask, tiles[wrong][:5], status[wrong][:5], exact[wrong][:5])
    # the compiled run of keys of every row, alone and under '&' (in both orders)
    _check_spans(mask, truth)
    for other in SPAN_PARTNERS:
        both = truth & _definition_grid(other, GRID_Q, GRID_K)
        _check_spans(mask & other, both)
        _check_spans(other & mask, both)
    # under '|' a program is no run: the caller tests each key
    spans = np.ones((len(GRID_Q), len(SPAN_WINDOWS), 3), np.int64)
    cpu_jit(_spans)(M.compile_mask(mask | M.CausalMask())[0], GRID_Q, np.array(SPAN_WINDOWS),
                    spans)
    assert np.all(spans == 0)


@pytest.mark.parametrize("mask", _registered_leaf_examples(), ids=repr)
def test_every_leaf_against_brute_force(mask):
    check_leaf(mask)


#: What API.md says each built-in leaf shows (Python integers: no wrap).
DOCUMENTED = {
    M.NullMask: lambda p, q, k: True,
    M.CausalMask: lambda p, q, k: k <= q,
    M.SlidingWindowCausalMask: lambda p, q, k: k <= q and q - k < p,
    M.ChunkedMask: lambda p, q, k: q // p == k // p,
    M.ChunkedCausalMask: lambda p, q, k: k <= q and q // p == k // p,
}


@pytest.mark.parametrize("cls", list(DOCUMENTED), ids=lambda cls: cls.__name__)
def test_builtin_leaves_mean_what_the_contract_says(cls):
    for mask in leaf_examples(cls):
        param = mask._parameter()
        documented = np.array([[DOCUMENTED[cls](param, int(q), int(k)) for k in GRID_K]
                               for q in GRID_Q])
        assert np.array_equal(_definition_grid(mask, GRID_Q, GRID_K), documented), mask


#: Position offsets ``(q_offset, k_offset)`` of the shifted-program checks (a shard of
#: keys at ``k_offset`` of a longer sequence), up to where INT64_MIN spans would wrap.
POSITIONS = [(0, 0), (3, 0), (0, 7), (11, 5), (-6, 9), (40, 33), (2**62, 2**62)]


@pytest.mark.parametrize("positions", POSITIONS, ids=str)
@pytest.mark.parametrize("mask", ALL_MASKS, ids=repr)
def test_program_positions_shift_what_every_leaf_sees(mask, positions):
    """A program compiled with ``positions`` shows, tiles and spans at local positions
    exactly what the mask shows at the shifted (global) positions."""
    q_offset, k_offset = positions
    program, _ = M.compile_mask(mask, positions=positions)
    assert program.shape == (M.compile_mask(mask)[0].shape[0], 4)
    assert np.all(program[:, 2] == q_offset) and np.all(program[:, 3] == k_offset)
    q_global = [int(q) + q_offset for q in GRID_Q]
    k_global = [int(k) + k_offset for k in GRID_K]
    truth = np.array([[bool(mask.visible(q, k)) for k in k_global] for q in q_global])
    got = np.zeros(truth.shape, np.bool_)
    cpu_jit(_grid_visible)(program, NO_FUNCTIONS, GRID_Q, GRID_K, got)
    assert np.array_equal(got, truth), (mask, positions)
    index, tiles = _all_tiles()
    status = np.zeros(len(tiles), np.int64)
    cpu_jit(_tile_statuses)(program, NO_FUNCTIONS, tiles, status)
    visible, pairs = _tile_counts(truth, index)
    assert not np.any((visible > 0) & (status == M.TILE_FULL)), (mask, positions)
    assert not np.any((visible < pairs) & (status == M.TILE_NONE)), (mask, positions)
    if "OrMask" not in repr(mask):  # a program with '|' gives no span
        _check_spans(mask, truth, positions)


def test_program_positions_are_checked():
    for bad, exc in [((0, -1), ValueError), ((-2**63, 0), ValueError), ((1.5, 0), ValueError),
                     ([1, 2], TypeError), ((1, 2, 3), TypeError)]:
        with pytest.raises(exc, match="positions"):
            M.compile_mask(M.CausalMask(), positions=bad)
    # the shared, unshifted program is left as it was
    assert M.compile_mask(M.CausalMask())[0].shape == (1, 2)


def test_built_in_leaves_keep_their_opcodes():
    assert M.LEAF_TYPES[:5] == [M.NullMask, M.CausalMask, M.SlidingWindowCausalMask,
                                M.ChunkedMask, M.ChunkedCausalMask]
    assert [cls.opcode for cls in M.LEAF_TYPES] == list(range(len(M.LEAF_TYPES)))
    assert M.OP_AND < 0 and M.OP_OR < 0


def test_register_leaf_refuses_what_it_cannot_dispatch():
    class NotALeaf(M.Mask):
        pass

    with pytest.raises(TypeError, match="LeafMask subclass"):
        M.register_leaf(NotALeaf)

    @dataclasses.dataclass
    class Mutable(M.LeafMask):
        pass

    with pytest.raises(TypeError, match="frozen dataclass, got Mutable"):
        M.register_leaf(Mutable)

    @dataclasses.dataclass(frozen=True)
    class NoSpan(M.LeafMask):
        @staticmethod
        def leaf_visible(param, q_idx, k_idx):
            return k_idx == q_idx

        @staticmethod
        def leaf_tile(param, q0, q1, k0, k1):
            return True, True

    with pytest.raises(TypeError, match="NoSpan.leaf_span must be defined"):
        M.register_leaf(NoSpan)
    with pytest.raises(ValueError, match="CausalMask is registered already"):
        M.register_leaf(M.CausalMask)
    NoSpan.leaf_span = staticmethod(lambda param, q_idx: (q_idx, q_idx + 1))
    count = len(M.LEAF_TYPES)
    # the kernels' dispatch was built when this module imported them: too late now
    with pytest.raises(RuntimeError, match="before the process compiles its first kernel"):
        M.register_leaf(NoSpan)
    assert len(M.LEAF_TYPES) == count and NoSpan.opcode is None
    with pytest.raises(TypeError, match="NoSpan is not registered"):
        M.compile_mask(NoSpan())


def _python_blocks(text):
    blocks = []
    for match in re.finditer(r"\.\. code-block:: python\n\n((?:   .*\n|\n)+)", text):
        blocks.append("\n".join(line[3:] for line in match.group(1).splitlines()))
    return blocks


@pytest.mark.slow
def test_the_documented_new_leaf_works_everywhere(tmp_path):
    """The docs' example leaf, registered by an application in a fresh process: attention
    with it matches the reference, and every consumer matches brute force."""
    blocks = _python_blocks((ROOT / "docs" / "extending.rst").read_text())
    assert len(blocks) == 2
    script = tmp_path / "prefix_lm.py"
    script.write_text("\n".join(blocks) + (
        "\nfrom tests.test_masks import check_leaf, leaf_examples\n"
        "for mask in leaf_examples(PrefixLMMask) + leaf_examples(PrefixLMMask, [0, -4]):\n"
        "    check_leaf(mask)\n"
        "print('checked', PrefixLMMask.opcode)\n"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            cwd=ROOT, env=env, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"checked {len(M.LEAF_TYPES)}" in result.stdout
    assert "[ True  True  True False False False]" in result.stdout


# -- programs: composed masks, tile status, both targets ----------------------------------


def _brute_status(mask, q0, q1, k0, k1):
    q = np.arange(q0, q1 + 1)[:, None]
    k = np.arange(k0, k1 + 1)[None, :]
    vis = mask.visible(q, k)
    if vis.all():
        return {M.TILE_NONE, M.TILE_PARTIAL}  # exact would be NONE; PARTIAL is allowed
    if not vis.any():
        return {M.TILE_FULL, M.TILE_PARTIAL}
    return {M.TILE_PARTIAL}


def _random_tiles(rng, count):
    for _ in range(count):
        q0 = int(rng.integers(-5, 40))
        k0 = int(rng.integers(-5, 40))
        yield q0, q0 + int(rng.integers(0, 12)), k0, k0 + int(rng.integers(0, 12))


@pytest.mark.parametrize("mask", ALL_MASKS, ids=repr)
def test_visible_body_matches_dataclass(mask, rng):
    program, additive = M.compile_mask(mask)
    assert additive is None
    q = rng.integers(-10, 60, 300)
    k = rng.integers(-10, 60, 300)
    expected = mask.visible(q, k)
    got = [KM.mask_visible(program, NO_FUNCTIONS, 0, 0, int(a), int(b)) for a, b in zip(q, k)]
    assert got == expected.tolist()


@pytest.mark.parametrize("mask", ALL_MASKS, ids=repr)
def test_tile_status_is_sound(mask, rng):
    program, _ = M.compile_mask(mask)
    for q0, q1, k0, k1 in _random_tiles(rng, 300):
        status = KM.mask_tile_status(program, NO_FUNCTIONS, 0, q0, q1, k0, k1)
        assert status in _brute_status(mask, q0, q1, k0, k1), (mask, q0, q1, k0, k1, status)


#: Sizes no position reaches, read as the largest int64 (a window of it once wrapped
#: ``q0 - window + 1`` past the int64 range for negative query positions, hiding the tile).
HUGE_LEAVES = [M.SlidingWindowCausalMask(2**63 - 1), M.ChunkedMask(2**63 - 1),
               M.ChunkedCausalMask(2**63 - 1)]


@pytest.mark.parametrize("mask", LEAVES + HUGE_LEAVES, ids=repr)
def test_leaf_tile_status_is_exact(mask, rng):
    """For single masks the status is exact: NONE/FULL whenever the tile is all/none visible."""
    program, _ = M.compile_mask(mask)
    for q0, q1, k0, k1 in _random_tiles(rng, 400):
        vis = mask.visible(np.arange(q0, q1 + 1)[:, None], np.arange(k0, k1 + 1)[None, :])
        expected = M.TILE_NONE if vis.all() else M.TILE_FULL if not vis.any() else M.TILE_PARTIAL
        got = KM.mask_tile_status(program, NO_FUNCTIONS, 0, q0, q1, k0, k1)
        assert got == expected, (mask, q0, q1, k0, k1)


def _grid_kernel(program, functions, q0, k0, vis_out, status_out):
    for i in range(vis_out.shape[0]):
        for j in range(vis_out.shape[1]):
            vis_out[i, j] = mask_visible(program, functions, 0, 0, q0 + i, k0 + j)
    status_out[0] = mask_tile_status(program, functions, 0, q0, q0 + vis_out.shape[0] - 1, k0,
                                     k0 + vis_out.shape[1] - 1)


def test_compiled_cpu_bodies_agree(rng):
    kernel = cpu_jit(_grid_kernel)
    for mask in ALL_MASKS:
        program, _ = M.compile_mask(mask)
        for q0, q1, k0, k1 in _random_tiles(rng, 20):
            vis = np.zeros((q1 - q0 + 1, k1 - k0 + 1), dtype=np.bool_)
            status = np.zeros(1, dtype=np.int64)
            kernel(program, NO_FUNCTIONS, q0, k0, vis, status)
            expected = mask.visible(np.arange(q0, q1 + 1)[:, None], np.arange(k0, k1 + 1)[None, :])
            assert np.array_equal(vis, expected)
            assert status[0] == KM.mask_tile_status(program, NO_FUNCTIONS, 0, q0, q1, k0, k1)


def _grid_cuda_kernel(program, functions, q0, k0, vis_out, status_out, span_out):
    i, j = cuda.grid(2)  # noqa: F821 - bound by cuda_kernel
    if i < vis_out.shape[0] and j < vis_out.shape[1]:
        vis_out[i, j] = 1 if mask_visible(program, functions, 0, 0, q0 + i, k0 + j) else 0
        if i == 0 and j == 0:
            status_out[0] = mask_tile_status(program, functions, 0, q0,
                                             q0 + vis_out.shape[0] - 1, k0,
                                             k0 + vis_out.shape[1] - 1)
        if j == 0:
            jlo, jhi, is_span = visible_span(program, q0 + i, k0, vis_out.shape[1])
            span_out[i, 0] = jlo
            span_out[i, 1] = jhi
            span_out[i, 2] = 1 if is_span else 0


@requires_cuda
def test_cuda_bodies_agree():
    """Every registered leaf (and programs with '&' and '|') through the CUDA bindings."""
    from numattn.core.jit import cuda_kernel

    kernel = cuda_kernel(_grid_cuda_kernel)
    leaves = [mask for cls in M.LEAF_TYPES for mask in leaf_examples(cls, [3, 2**63 - 1])]
    for mask in [*leaves, COMPOSED[0], COMPOSED[2]]:
        program, _ = M.compile_mask(mask)
        q0, k0 = -2, 1
        vis = np.zeros((6, 7), dtype=np.int64)
        status = np.zeros(1, dtype=np.int64)
        spans = np.zeros((6, 3), dtype=np.int64)
        kernel[(1, 1), (8, 8)](program, NO_FUNCTIONS, q0, k0, vis, status, spans)
        expected = mask.visible(np.arange(q0, q0 + 6)[:, None], np.arange(k0, k0 + 7)[None, :])
        assert np.array_equal(vis.astype(bool), expected), mask
        assert status[0] == KM.mask_tile_status(program, NO_FUNCTIONS, 0, q0, q0 + 5, k0,
                                                k0 + 6), mask
        for i in range(6):
            assert tuple(spans[i]) == KM.visible_span(program, q0 + i, k0, 7), mask


def test_mask_bodies_compile_to_ptx(ptx_compiler):
    """The generated dispatchers and every leaf's bodies compile for a GPU."""
    import numba
    from numba import types

    sig = (types.int64[:, :], numba.typeof(NO_FUNCTIONS), types.int64, types.int64,
           types.int64[:, :], types.int64[:], types.int64[:, :])
    ptx = ptx_compiler(_grid_cuda_kernel, sig)
    assert "mask_visible" in ptx or ".func" in ptx


@pytest.mark.parametrize(
    "factory, value, exc",
    [
        (M.SlidingWindowCausalMask, 0, ValueError),
        (M.ChunkedMask, 0, ValueError),
        (M.ChunkedCausalMask, -3, ValueError),
        (M.SlidingWindowCausalMask, 2.5, TypeError),
        (M.ChunkedMask, True, TypeError),
    ],
)
def test_invalid_parameters(factory, value, exc):
    with pytest.raises(exc, match=factory.__name__):
        factory(value)


@pytest.mark.parametrize("size", [2**62, 2**63 - 1, 2**63, 2**80])
def test_sizes_past_every_position_act_as_no_limit(size, rng):
    """A window or chunk larger than any position (even past int64) hides nothing more than
    causality does; the kernels read it as the largest int64."""
    q = rng.standard_normal((2, 6, 2, 4)).astype(np.float32)
    k = rng.standard_normal((2, 9, 2, 4)).astype(np.float32)
    v = rng.standard_normal((2, 9, 2, 4)).astype(np.float32)
    for mask, same_as in [(M.SlidingWindowCausalMask(size), M.CausalMask()),
                          (M.ChunkedCausalMask(size), M.CausalMask()),
                          (M.ChunkedMask(size), M.NullMask())]:
        assert np.array_equal(mask.visible(np.arange(9)[:, None], np.arange(9)),
                              same_as.visible(np.arange(9)[:, None], np.arange(9)))
        expected = numattn.reference.flash_attention_kv_cache(q, k, v, same_as)
        got = numattn.flash_attention_kv_cache(q, k, v, mask)
        assert np.allclose(got, expected, atol=1e-5), mask
        expected = numattn.reference.decode_attention(q[:, 0], k, v, same_as)
        got = numattn.decode_attention(q[:, 0], k, v, mask)
        assert np.allclose(got, expected, atol=1e-5), mask
        # more queries than keys: the first query rows sit at negative positions (where
        # chunk -1 is not chunk 0: against the reference with the mask itself)
        ragged = q.reshape(12, 2, 4)
        expected = numattn.reference.flash_attention_kv_cache(
            ragged, k[0], v[0], mask, q_input_row_offsets=[0, 12], kv_input_row_offsets=[0, 9])
        got = numattn.flash_attention_kv_cache(
            ragged, k[0], v[0], mask, q_input_row_offsets=[0, 12], kv_input_row_offsets=[0, 9])
        assert np.allclose(got, expected, atol=1e-5), mask


def test_materialized_mask_rules():
    t = np.zeros((3, 4), np.float32)
    program, additive = M.compile_mask(M.MaterializedMask(t) & M.CausalMask())
    assert additive is t
    assert program.tolist() == [[M.NullMask.opcode, 0], [M.CausalMask.opcode, 0], [M.OP_AND, 0]]
    program, additive = M.compile_mask(t)  # a plain ndarray is an additive mask
    assert additive is t
    with pytest.raises(ValueError, match="'\\|'"):
        M.compile_mask(M.MaterializedMask(t) | M.CausalMask())
    with pytest.raises(ValueError, match="at most one"):
        M.compile_mask(M.MaterializedMask(t) & M.MaterializedMask(t))
    with pytest.raises(ValueError, match="MaterializedMask.tensor"):
        M.MaterializedMask(np.zeros(3))
    with pytest.raises(TypeError, match="MaterializedMask.tensor"):
        M.MaterializedMask([[0.0]])
    with pytest.raises(TypeError, match="mask must be"):
        M.compile_mask("causal")
    with pytest.raises(TypeError, match="cannot combine"):
        M.CausalMask() & 3


@pytest.mark.parametrize("nesting", ["left", "right"])
def test_long_chains_evaluate_however_nested(nesting, rng):
    """200 leaves chained to the left or to the right: the compiled bodies keep their bit
    stacks in one int64, and the program's operand order keeps them shallow either way."""
    leaves = [M.SlidingWindowCausalMask(int(w)) for w in rng.integers(1, 30, 100)]
    leaves += [M.ChunkedMask(int(c)) for c in rng.integers(1, 30, 100)]
    mask = leaves[0]
    for leaf in leaves[1:]:
        mask = (mask | leaf) if nesting == "left" else (leaf | mask)
    mask = mask & M.CausalMask()
    program, _ = M.compile_mask(mask)
    assert M._program_depth(program.tolist()) <= 9  # log2(201) + 1
    kernel = cpu_jit(_grid_kernel)
    vis = np.zeros((40, 40), dtype=np.bool_)
    status = np.zeros(1, dtype=np.int64)
    kernel(program, NO_FUNCTIONS, 0, 0, vis, status)
    assert np.array_equal(vis, mask.visible(np.arange(40)[:, None], np.arange(40)[None, :]))
    assert status[0] == M.TILE_PARTIAL


def test_program_is_built_once_per_mask():
    mask = M.CausalMask() & M.SlidingWindowCausalMask(4)
    program, additive = M.compile_mask(mask)
    again, _ = M.compile_mask(mask)
    assert again is program and additive is None
    causal = M.CausalMask()
    M.compile_mask(causal)  # what it keeps is no field: equality, hash and repr as before
    assert causal == M.CausalMask() and hash(causal) == hash(M.CausalMask())
    assert repr(causal) == "CausalMask()"
    t = np.zeros((2, 3), np.float32)
    materialized = M.MaterializedMask(t) & M.CausalMask()
    for _ in range(2):
        program, additive = M.compile_mask(materialized)
        assert additive is t
        assert program.tolist() == [[M.NullMask.opcode, 0], [M.CausalMask.opcode, 0],
                                    [M.OP_AND, 0]]


def test_additive_4d_shapes_and_errors():
    f32 = np.float32
    t = np.zeros((3, 5), f32)
    assert M.additive_4d(t, batch=2, num_heads=4, max_q_len=3, max_keys=5, dtype=f32).shape == (
        1, 1, 3, 5)
    t3 = np.zeros((2, 3, 5), f32)
    assert M.additive_4d(t3, batch=2, num_heads=4, max_q_len=2, max_keys=5, dtype=f32).shape == (
        2, 1, 3, 5)
    t4 = np.zeros((2, 4, 3, 5), f32)
    assert M.additive_4d(t4, batch=2, num_heads=4, max_q_len=3, max_keys=5, dtype=f32).shape == (
        2, 4, 3, 5)
    assert M.additive_4d(None, batch=2, num_heads=4, max_q_len=3, max_keys=5,
                         dtype=f32).shape == (1, 1, 1, 1)
    with pytest.raises(TypeError, match="dtype float32"):
        M.additive_4d(t.astype(np.float64), batch=2, num_heads=4, max_q_len=3, max_keys=5,
                      dtype=f32)
    with pytest.raises(ValueError, match="B = 3"):
        M.additive_4d(t3, batch=3, num_heads=4, max_q_len=3, max_keys=5, dtype=f32)
    with pytest.raises(ValueError, match="H = 2"):
        M.additive_4d(t4, batch=2, num_heads=2, max_q_len=3, max_keys=5, dtype=f32)
    with pytest.raises(ValueError, match="N >= 6"):
        M.additive_4d(t, batch=2, num_heads=4, max_q_len=3, max_keys=6, dtype=f32)


def test_masks_are_frozen_and_exported():
    mask = numattn.SlidingWindowCausalMask(4)
    with pytest.raises(AttributeError):
        mask.window = 5
    assert numattn.CausalMask() == numattn.CausalMask()
    assert isinstance(numattn.CausalMask() & numattn.NullMask(), numattn.AndMask)
    assert isinstance(numattn.CausalMask() | numattn.NullMask(), numattn.OrMask)


def test_programs_are_built_once_per_mask_and_shared_by_equal_leaf_masks():
    mask = M.CausalMask() & M.SlidingWindowCausalMask(8)
    assert M.compile_mask(mask)[0] is M.compile_mask(mask)[0]  # kept on the object
    # a leaf mask made afresh for every call finds the program of an equal one
    assert M.compile_mask(M.SlidingWindowCausalMask(8))[0] is \
        M.compile_mask(M.SlidingWindowCausalMask(np.int64(8)))[0]
    for make in (M.SlidingWindowCausalMask, M.ChunkedMask, M.ChunkedCausalMask):
        four, five = M.compile_mask(make(4))[0], M.compile_mask(make(5))[0]
        assert four.tolist() != five.tolist()
        assert four.tolist() == M.compile_mask(make(4))[0].tolist()
    assert M.compile_mask(M.CausalMask())[0].tolist() == [[M.CausalMask.opcode, 0]]
    assert M.compile_mask(M.NullMask())[0].tolist() == [[M.NullMask.opcode, 0]]
