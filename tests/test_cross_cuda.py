"""cross_attention through numba.cuda: the simulator against the reference, and PTX builds.

The simulator tests (``NUMBA_ENABLE_CUDASIM=1``, e.g. ``tox -e cudasim``) use tiny shapes and
32 threads per block; the PTX tests compile the kernel for ``cc=(9, 0)`` without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

import numattn
from numattn.cross import cross_attention
from numattn.kernels.cuda import flash as cross
from numattn.kernels.cuda.flash import (
    _cross_attention_cuda_kernel,
    _cuda_tiles,
    _shared_bytes,
)
from numattn.masks import CausalMask, NullMask

from .conftest import requires_cuda
from .test_cross import (
    check,
    check_additive_minus_inf_hides_nan_keys,
    check_zero_heads,
    make_mask,
    make_problem,
    num_keys_of,
    standard_problem,
)
from .utils import assert_close

SIM = numattn.MHAConfig(block_k=4, threads_per_block=32)


def _to_device(x):
    from numba import cuda

    return cuda.to_device(x)


# --------------------------------------------------------------------------------------
# Host-side tiling (no CUDA needed).
# --------------------------------------------------------------------------------------
def test_tiles_fit_shared_memory():
    for group in (1, 3, 4, 8, 12, 16, 17, 48, 128):
        for itemsize in (4, 8):
            for block_q, block_k in ((1, 1), (256, 128), (7, 65536)):
                heads, rows, keys = _cuda_tiles(group, itemsize, block_q, block_k, 100)
                assert group % heads == 0 and 1 <= heads * rows <= cross.MAX_ROW_HEADS
                assert 1 <= rows <= block_q and 1 <= keys <= block_k
                assert _shared_bytes(heads * rows, keys, itemsize) <= cross.SHARED_BYTES
    assert _cuda_tiles(4, 4, 256, 128, 100) == (4, 8, 128)
    assert _cuda_tiles(4, 4, 256, 128, 3)[1] == 3  # no longer than the longest sequence
    assert _cuda_tiles(12, 8, 256, 128, 100)[:2] == (12, 2)


# --------------------------------------------------------------------------------------
# Simulator.
# --------------------------------------------------------------------------------------
CASES = [  # (kind, mask, dtype): every kind, mask and dtype appears
    ("ragged", "causal", np.float32),
    ("ragged", "additive_bhss", np.float64),
    ("dense", "chunked", np.float64),
    ("dense", "additive_sn", np.float32),
    ("continuous", "additive_bss", np.float32),
    ("continuous", "sliding", np.float64),
    ("paged", "null", np.float64),
    ("paged", "causal_and_additive", np.float32),
    ("paged", "chunked_or_sliding", np.float64),
    ("paged", "chunked_causal", np.float32),
]


@requires_cuda
@pytest.mark.parametrize(("kind", "mask_name", "dtype"), CASES)
def test_cuda_matches_reference(kind, mask_name, dtype, rng):
    problem = standard_problem(rng, kind, dtype, num_heads=4, num_kv_heads=2, head_dim=3)
    # float32 puts each sequence's rows in one block, float64 in blocks of 2 rows.
    config = numattn.MHAConfig(block_q=256 if dtype == np.float32 else 2, block_k=4,
                               threads_per_block=32)
    out, lse = check(problem, make_mask(rng, mask_name, problem, 4), device="cuda",
                     config=config)
    assert isinstance(out, np.ndarray)
    assert np.all(out[3:8] == 0) and np.all(lse[3:8] == -np.inf)  # the key-less sequence


@requires_cuda
@pytest.mark.parametrize("group", [1, 2, 3, 8])
def test_cuda_gqa_groups(group, rng):
    problem = make_problem(rng, "paged", (2, 1), (3, 2), (2, 5), group, 1, 3, np.float32)
    check(problem, CausalMask(), device="cuda", config=SIM)


@requires_cuda
def test_cuda_group_split_over_blocks(rng, monkeypatch):
    """A group larger than a block's head count is served by several blocks."""
    monkeypatch.setattr(cross, "MAX_ROW_HEADS", 2)
    problem = make_problem(rng, "continuous", (2, 1), (1, 3), (3, 0), 8, 2, 2, np.float64)
    check(problem, CausalMask(), device="cuda", config=SIM)


@requires_cuda
def test_cuda_max_shapes_paged_128(rng):
    """MAX's test: 16 query heads, 4 KV heads, D = 128, pages of 128, caches of 37 and 129."""
    problem = make_problem(rng, "paged", (1, 2), (1, 2), (37, 129), 16, 4, 128, np.float32,
                           page_size=128)
    check(problem, NullMask(), device="cuda",
          config=numattn.MHAConfig(threads_per_block=128))


@requires_cuda
def test_cuda_many_page_crossings_and_hidden_nan(rng):
    """Pages of 4 crossed many times; NaN in keys hidden from every row never shows."""
    problem = make_problem(rng, "paged", (3, 2), (6, 1), (11, 14), 2, 1, 2, np.float64)
    k, v = problem["k"], problem["v"]
    num_keys = num_keys_of(problem)
    for b, q_len in enumerate((3, 2)):
        for t in range(q_len, int(num_keys[b])):  # causal with q_idx = r hides these
            for x in (k, v):
                x.blocks[x.lookup_table[b, t // 4], t % 4] = np.nan
    out, _ = check(problem, CausalMask(), device="cuda", config=SIM)
    assert np.all(np.isfinite(out))
    check(problem, NullMask(), device="cuda", config=numattn.MHAConfig(block_k=5,
                                                                      threads_per_block=32))


@requires_cuda
def test_cuda_additive_minus_inf_hides_nan_and_inf_keys(rng):
    check_additive_minus_inf_hides_nan_keys(rng, "cuda")


@requires_cuda
def test_cuda_device_arrays_in_place(rng):
    problem = make_problem(rng, "paged", (2, 3), (2, 1), (3, 5), 4, 2, 3, np.float32)
    expected, expected_lse = numattn.reference.cross_attention(**problem, return_lse=True)
    k, v = problem["k"], problem["v"]
    blocks_k, blocks_v = _to_device(k.blocks), _to_device(v.blocks)
    d_k = numattn.PagedKVCache(blocks_k, k.cache_lengths, k.lookup_table)
    d_v = numattn.PagedKVCache(blocks_v, v.cache_lengths, v.lookup_table)
    d_q = _to_device(problem["q"])
    d_out = _to_device(np.full((5, 4, 3), np.nan, np.float32))
    args = {**problem, "q": d_q, "k": d_k, "v": d_v}
    result, lse = cross_attention(**args, out=d_out, return_lse=True, config=SIM)
    assert result is d_out
    assert_close(d_out.copy_to_host(), expected, np.float32)
    assert_close(lse.copy_to_host(), expected_lse, np.float32, what="lse")
    # Device inputs and a host out: the result lands in the NumPy array.
    host_out = np.zeros((5, 4, 3), np.float32)
    assert cross_attention(**args, out=host_out, config=SIM) is host_out
    assert_close(host_out, expected, np.float32)
    with pytest.raises(TypeError, match="device='cpu'"):
        cross_attention(**args, device="cpu")


@requires_cuda
def test_cuda_zero_sequence_batch_leaves_out_untouched():
    h, hkv, d = 16, 4, 128
    blocks = np.full((2, 128, hkv, d), np.nan, np.float32)
    k = numattn.PagedKVCache(blocks, np.array([37, 129]), np.zeros((2, 2), np.int64))
    q = _to_device(np.empty((0, h, d), np.float32))
    out = _to_device(np.full((0, h, d), 3.0, np.float32))
    assert cross_attention(q, [0], 0, k, k, [0], out=out) is out
    host_out = np.full((0, h, d), 3.0, np.float32)
    result = cross_attention(np.empty((0, h, d), np.float32), [0], 1, k, k, [0],
                             out=host_out, device="cuda")
    assert result is host_out


@requires_cuda
def test_cuda_zero_heads(rng):
    check_zero_heads(rng, "cuda")


@requires_cuda
def test_cuda_rejects_non_contiguous_device_arrays(rng):
    problem = make_problem(rng, "ragged", (2,), (2,), (0,), 2, 1, 4, np.float32)
    wide = _to_device(np.zeros((2, 2, 8), np.float32))
    with pytest.raises(ValueError, match="q must be C-contiguous"):
        cross_attention(**{**problem, "q": wide[:, :, ::2]}, device="cuda")


# --------------------------------------------------------------------------------------
# PTX for a real target (cc 9.0): catches typing errors the simulator cannot see.
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_kernel_compiles_to_ptx(dtype, ptx_compiler):
    from numba import types

    ft = getattr(types, dtype)
    idx1, idx2 = types.int64[::1], types.int64[:, ::1]
    signature = (
        ft[:, :, ::1], idx1, idx1, idx1, ft[:, :, ::1], ft[:, :, ::1], types.int64, idx2,
        idx1, idx1, idx2, ft[:, :, :, ::1], types.boolean, ft, types.int64, types.int64,
        types.int64, types.int64, ft[:, :, ::1], ft[:, ::1], types.boolean,
    )
    ptx = ptx_compiler(_cross_attention_cuda_kernel, signature)
    assert "bar.sync" in ptx
    if dtype == "float32":  # the tile loops stay in float32 (only the row's 1/l is float64)
        assert ptx.count(".f64") < 40


@requires_cuda
def test_cuda_visible_key_of_score_minus_inf_still_adds_0_times_v():
    """inf in q makes a visible key's score -inf: its weight is 0, and 0 * V still counts
    (NaN or inf in its V row propagates), as on the CPU; hidden keys are never read."""
    q = np.ones((3, 2, 4), np.float32)
    q[0, :, 0] = -np.inf  # token 0 sees key 0 only (causal): a score of -inf
    k = np.ones((4, 1, 4), np.float32)
    v = np.ones((4, 1, 4), np.float32)
    v[0, 0, 1] = np.nan  # key 0: visible to every token
    v[3, 0, 2] = np.inf  # key 3: hidden from every token (causal, q_idx = r < 3)
    offsets = np.array([0, 3])
    kv_offsets = np.array([0, 4])
    args = (q, offsets, 3, k, v, kv_offsets, CausalMask())
    cpu = cross_attention(*args)
    gpu = cross_attention(*args, device="cuda", config=SIM)
    assert np.isnan(cpu[:, :, 1]).all() and np.isfinite(cpu[:, :, [0, 2, 3]]).all()
    assert_close(gpu, cpu, np.float32)
