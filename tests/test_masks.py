"""Masks: element visibility and tile status against brute force, on every target."""

from __future__ import annotations

import numpy as np
import pytest

import numattn
from numattn.core import masks as M
from numattn.core.jit import cpu_jit
from numattn.kernels.shared import masks as KM

from .conftest import requires_cuda

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
    got = [KM.mask_visible(program, int(a), int(b)) for a, b in zip(q, k)]
    assert got == expected.tolist()


@pytest.mark.parametrize("mask", ALL_MASKS, ids=repr)
def test_tile_status_is_sound(mask, rng):
    program, _ = M.compile_mask(mask)
    for q0, q1, k0, k1 in _random_tiles(rng, 300):
        status = KM.mask_tile_status(program, q0, q1, k0, k1)
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
        assert KM.mask_tile_status(program, q0, q1, k0, k1) == expected, (mask, q0, q1, k0, k1)


def _grid_kernel(program, q0, k0, vis_out, status_out):
    for i in range(vis_out.shape[0]):
        for j in range(vis_out.shape[1]):
            vis_out[i, j] = mask_visible(program, q0 + i, k0 + j)
    status_out[0] = mask_tile_status(program, q0, q0 + vis_out.shape[0] - 1, k0,
                                     k0 + vis_out.shape[1] - 1)


# The kernels above and below call the shared bodies by name; cpu_jit / cuda_kernel rebind
# these names to the bodies compiled for the same target.
mask_visible = KM.mask_visible
mask_tile_status = KM.mask_tile_status


def test_compiled_cpu_bodies_agree(rng):
    kernel = cpu_jit(_grid_kernel)
    for mask in ALL_MASKS:
        program, _ = M.compile_mask(mask)
        for q0, q1, k0, k1 in _random_tiles(rng, 20):
            vis = np.zeros((q1 - q0 + 1, k1 - k0 + 1), dtype=np.bool_)
            status = np.zeros(1, dtype=np.int64)
            kernel(program, q0, k0, vis, status)
            expected = mask.visible(np.arange(q0, q1 + 1)[:, None], np.arange(k0, k1 + 1)[None, :])
            assert np.array_equal(vis, expected)
            assert status[0] == KM.mask_tile_status(program, q0, q1, k0, k1)


def _grid_cuda_kernel(program, q0, k0, vis_out, status_out):
    i, j = cuda.grid(2)  # noqa: F821 - bound by cuda_kernel
    if i < vis_out.shape[0] and j < vis_out.shape[1]:
        vis_out[i, j] = 1 if mask_visible(program, q0 + i, k0 + j) else 0
        if i == 0 and j == 0:
            status_out[0] = mask_tile_status(program, q0, q0 + vis_out.shape[0] - 1, k0,
                                             k0 + vis_out.shape[1] - 1)


@requires_cuda
def test_cuda_bodies_agree(rng):
    from numattn.core.jit import cuda_kernel

    kernel = cuda_kernel(_grid_cuda_kernel)
    for mask in [M.CausalMask(), M.SlidingWindowCausalMask(3), COMPOSED[2]]:
        program, _ = M.compile_mask(mask)
        vis = np.zeros((6, 7), dtype=np.int64)
        status = np.zeros(1, dtype=np.int64)
        kernel[(1, 1), (8, 8)](program, 3, 1, vis, status)
        expected = mask.visible(np.arange(3, 9)[:, None], np.arange(1, 8)[None, :])
        assert np.array_equal(vis.astype(bool), expected)
        assert status[0] == KM.mask_tile_status(program, 3, 8, 1, 7)


def test_mask_bodies_compile_to_ptx(ptx_compiler):
    from numba import types

    sig = (types.int64[:, :], types.int64, types.int64, types.int64[:, :], types.int64[:])
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
    assert program.tolist() == [[M.OP_NULL, 0], [M.OP_CAUSAL, 0], [M.OP_AND, 0]]
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
    kernel(program, 0, 0, vis, status)
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
        assert additive is t and program.tolist() == [[M.OP_NULL, 0], [M.OP_CAUSAL, 0],
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
    assert M.compile_mask(M.CausalMask())[0].tolist() == [[M.OP_CAUSAL, 0]]
    assert M.compile_mask(M.NullMask())[0].tolist() == [[M.OP_NULL, 0]]
