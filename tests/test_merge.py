"""merge_states against the reference, with empty parts and NaN-free -inf handling."""

from __future__ import annotations

import numpy as np
import pytest

import numattn

from .utils import assert_close


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_merge_states_matches_reference(dtype, rng):
    outs = [rng.standard_normal((3, 5, 7)).astype(dtype) for _ in range(4)]
    lses = [(rng.standard_normal((3, 5)) * 3).astype(dtype) for _ in range(4)]
    lses[1][0, 0] = -np.inf
    outs[1][0, 0] = np.nan  # an empty part's output is never read
    for part in lses:
        part[2, 4] = -np.inf  # a row empty in every part
    out, lse = numattn.merge_states(outs, lses)
    ref_out, ref_lse = numattn.reference.merge_states(
        [np.where(np.isinf(x)[..., None], 0, o) for o, x in zip(outs, lses)], lses)
    assert out.dtype == dtype and lse.dtype == dtype
    assert_close(out, ref_out, dtype)
    assert_close(lse, ref_lse, dtype)
    assert np.all(out[2, 4] == 0) and lse[2, 4] == -np.inf
    stacked = numattn.merge_states(np.stack(outs), np.stack(lses))
    assert np.array_equal(stacked[0], out)


@pytest.mark.parametrize("shape", [(0, 4, 8), (3, 0, 8), (2, 3, 0), (0,)])
def test_merge_of_empty_batches_keeps_the_shape(shape):
    """No rows (an empty batch or no heads) or D = 0: results of the parts' shape."""
    outs = [np.zeros(shape, np.float32) for _ in range(3)]
    lses = [np.zeros(shape[:-1], np.float32) for _ in range(3)]
    out, lse = numattn.merge_states(outs, lses)
    assert out.shape == shape and lse.shape == shape[:-1]
    assert out.dtype == lse.dtype == np.float32

def test_calling_thread_and_worker_threads_agree_bitwise(rng, monkeypatch):
    from numattn.kernels.cpu import merge as merge_module

    outs = [rng.standard_normal((6, 5, 7)).astype(np.float32) for _ in range(3)]
    lses = [rng.standard_normal((6, 5)).astype(np.float32) for _ in range(3)]
    results = []
    for threshold in (0, 2**62):  # worker threads, then the calling thread
        monkeypatch.setattr(merge_module, "SERIAL_ELEMENTS", threshold)
        results.append(numattn.merge_states(outs, lses))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])


def test_nan_in_a_part_whose_weight_underflows_propagates():
    """A part far below the others weighs exactly 0 but is not empty: its NaN still counts."""
    outs = [np.ones((1, 2)), np.array([[np.nan, 1.0]])]
    lses = [np.zeros(1), np.full(1, -1e5)]
    out, lse = numattn.merge_states(outs, lses)
    assert np.isnan(out[0, 0]) and out[0, 1] == 1 and lse[0] == 0


def test_nan_and_inf_lse_agree_with_the_reference():
    """A NaN lse makes its rows NaN, and so does +inf (its weight is e^(inf - inf)): the
    kernel and the reference agree; an empty (-inf) part is never read."""
    outs = [np.ones((3, 2)), np.full((3, 2), 2.0), np.full((3, 2), np.nan)]
    lses = [np.array([0.0, np.nan, np.inf]), np.zeros(3), np.full(3, -np.inf)]
    out, lse = numattn.merge_states(outs, lses)
    ref_out, ref_lse = numattn.reference.merge_states(outs, lses)
    assert np.array_equal(out[0], [1.5, 1.5]) and np.isnan(out[1:]).all()
    assert np.isnan(lse[1:]).all()
    assert_close(out, ref_out, np.float64)
    assert_close(lse, ref_lse, np.float64, what="lse")


def test_merge_states_errors():
    o = np.zeros((2, 3), np.float32)
    x = np.zeros(2, np.float32)
    with pytest.raises(ValueError, match="at least one"):
        numattn.merge_states([], [])
    with pytest.raises(ValueError, match="2 outputs but 1"):
        numattn.merge_states([o, o], [x])
    with pytest.raises(TypeError, match="dtypes float32 and float32"):
        numattn.merge_states([o, o.astype(np.float64)], [x, x])
    with pytest.raises(ValueError, match=r"lses\[1\] has shape"):
        numattn.merge_states([o, o], [x, np.zeros(3, np.float32)])
    with pytest.raises(TypeError, match="float64, float32, float16 or bfloat16"):
        numattn.merge_states([o.astype(int)], [x.astype(int)])
    with pytest.raises(TypeError, match=r"outs\[1\] must be an array"):
        numattn.merge_states([o, 2], [x, x])
    with pytest.raises(TypeError, match=r"lses\[0\] must be an array"):
        numattn.merge_states([o], [[0.0, 0.0]])
    with pytest.raises(TypeError, match="outs must be a sequence of arrays, got NoneType"):
        numattn.merge_states(None, [x])
    with pytest.raises(TypeError, match="lses must be a sequence of arrays, got float"):
        numattn.merge_states([o], 1.0)
