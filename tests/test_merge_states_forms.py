"""``merge_states``'s input forms: lists of parts and arrays stacked along a first axis, down
to the parts of a single row (1-d outputs, 0-d lses), against :mod:`numattn.reference`."""

from __future__ import annotations

import numpy as np
import pytest

import numattn
from numattn import reference

TOL = {np.dtype(np.float32): 2e-6, np.dtype(np.float64): 1e-13}


def _assert_merged(got, outs, lses, dtype):
    want_out, want_lse = reference.merge_states(list(outs), list(lses))
    out, lse = got
    assert out.dtype == dtype and lse.dtype == dtype
    assert out.shape == want_out.shape and lse.shape == want_lse.shape
    np.testing.assert_allclose(out, want_out, rtol=TOL[dtype], atol=TOL[dtype])
    np.testing.assert_allclose(lse, want_lse, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_stacked_parts_of_one_row(dtype, rng):
    """Two parts of one row of D=8, stacked: outs [2, 8] and lses [2] (whose entries, taken
    one by one, are NumPy scalars)."""
    dtype = np.dtype(dtype)
    outs = rng.standard_normal((2, 8)).astype(dtype)
    lses = rng.standard_normal(2).astype(dtype)
    got = numattn.merge_states(outs, lses)
    assert got[0].shape == (8,) and got[1].shape == ()
    _assert_merged(got, outs, lses, dtype)


def test_the_documented_call():
    outs, lses = np.random.default_rng(7).standard_normal((2, 8)), np.array([0.3, -1.2])
    out, lse = numattn.merge_states(outs, lses)
    want_out, want_lse = reference.merge_states(list(outs), list(lses))
    np.testing.assert_allclose(out, want_out, rtol=1e-13)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-13)


@pytest.mark.parametrize("outs_form", ["stacked", "list"])
@pytest.mark.parametrize("lses_form", ["stacked", "list of 0-d", "list of scalars"])
@pytest.mark.parametrize("parts", [1, 3])
def test_one_row_in_every_form(outs_form, lses_form, parts, rng):
    outs = rng.standard_normal((parts, 5))
    lses = rng.standard_normal(parts) * 4
    lses[0] = -np.inf  # an empty part weighs nothing
    o = outs if outs_form == "stacked" else list(outs)
    x = {"stacked": lses, "list of 0-d": [np.asarray(v) for v in lses],
         "list of scalars": list(lses)}[lses_form]
    assert all(isinstance(v, np.float64) for v in list(lses))  # what iteration gives
    _assert_merged(numattn.merge_states(o, x), outs, lses, np.dtype(np.float64))


@pytest.mark.parametrize("rows", [(), (3,), (2, 4), (0,), (2, 1, 3)])
def test_stacked_and_listed_agree_for_any_rows(rows, rng):
    outs = rng.standard_normal((3, *rows, 4)).astype(np.float32)
    lses = rng.standard_normal((3, *rows)).astype(np.float32)
    stacked = numattn.merge_states(outs, lses)
    listed = numattn.merge_states(list(outs), list(lses))
    assert np.array_equal(stacked[0], listed[0]) and np.array_equal(stacked[1], listed[1])
    _assert_merged(stacked, outs, lses, np.dtype(np.float32))


def test_all_parts_empty_gives_zero_and_minus_inf():
    out, lse = numattn.merge_states(np.full((2, 3), np.nan), np.full(2, -np.inf))
    assert out.tolist() == [0.0, 0.0, 0.0] and lse == -np.inf


def test_stacked_forms_are_checked():
    with pytest.raises(ValueError, match="lses.*0-d array"):
        numattn.merge_states(np.zeros((2, 4)), np.array(0.0))
    with pytest.raises(ValueError, match="lses\\[0\\] has shape \\[3\\], expected \\[\\]"):
        numattn.merge_states(np.zeros((2, 4)), np.zeros((2, 3)))
    with pytest.raises(TypeError,
                       match="outs\\[0\\] and lses\\[0\\] must have dtypes float64 and float64"):
        numattn.merge_states(np.zeros((2, 4)), np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="at least one part"):
        numattn.merge_states(np.zeros((0, 4)), np.zeros(0))
