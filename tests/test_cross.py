"""cross_attention against the float64 reference (queries at ``q_idx = r``).

Numeric tests take the ``device`` fixture: they run on the CPU, through each of its two
paths, and through CUDA (in the simulator, ``tox -e cudasim``, or on a GPU) on tiny shapes
with 32 threads per block.  CUDA's own tests follow: host-side tiling, device arrays,
launch geometry, and the kernel compiled to PTX for ``cc=(9, 0)`` without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

import numattn
from numattn import reference
from numattn.core.device import CudaUnavailableError, is_available
from numattn.cross import cross_attention
from numattn.masks import (
    CausalMask,
    ChunkedCausalMask,
    ChunkedMask,
    MaterializedMask,
    NullMask,
    SlidingWindowCausalMask,
)

from . import internals
from .conftest import CPU_PATHS, cuda_param, on_devices, requires_cuda, use_device
from .utils import assert_close, make_kv, no_functions_type, randn

KINDS = ("ragged", "dense", "continuous", "paged")
MASKS = ("null", "causal", "sliding", "chunked", "chunked_causal", "additive_sn",
         "additive_bss", "additive_bhss", "causal_and_additive", "chunked_or_sliding")
DTYPES = (np.float32, np.float64)

#: Small tiles and blocks of 32 threads keep the simulator quick (the CPU ignores the threads).
SIM = numattn.MHAConfig(block_k=4, threads_per_block=32)
#: The default tiles, with blocks of 32 threads.
DEFAULT_TILES = numattn.MHAConfig(threads_per_block=32)


@pytest.fixture(params=[*CPU_PATHS, cuda_param()])
def device(request, monkeypatch):
    """Every numeric test runs through both CPU paths and through CUDA."""
    return use_device(request.param, monkeypatch)


# --------------------------------------------------------------------------------------
# Problem builders.
# --------------------------------------------------------------------------------------
def make_problem(rng, kind, q_lens, kv_lens, cache_lens, num_heads, num_kv_heads, head_dim,
                 dtype, *, page_size=4, q_pad=1):
    """Keyword arguments of one cross_attention call, with NaN in every unused slot.

    ``kind``: "ragged" ([T_kv, Hkv, D] rows, no cache), "dense" ([B, N, Hkv, D] padded with
    NaN past each sequence's kv_len), "continuous" or "paged" (caches holding
    ``cache_lens[b]`` old tokens followed by the ``kv_lens[b]`` new ones).
    """
    q_lens = np.asarray(q_lens, np.int64)
    kv_lens = np.asarray(kv_lens, np.int64)
    cache_lens = np.asarray(cache_lens, np.int64)
    batch = q_lens.shape[0]
    q_offsets = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    kv_offsets = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int64)
    q = randn(rng, (int(q_offsets[-1]), num_heads, head_dim), dtype)
    if kind == "ragged":
        assert not cache_lens.any()
        k = randn(rng, (int(kv_offsets[-1]), num_kv_heads, head_dim), dtype)
        v = randn(rng, (int(kv_offsets[-1]), num_kv_heads, head_dim), dtype)
    elif kind == "dense":
        assert not cache_lens.any()
        n = int(kv_lens.max(initial=0)) + 2
        k = np.full((batch, n, num_kv_heads, head_dim), np.nan, dtype)
        v = np.full_like(k, np.nan)
        for b in range(batch):
            k[b, : kv_lens[b]] = randn(rng, (kv_lens[b], num_kv_heads, head_dim), dtype)
            v[b, : kv_lens[b]] = randn(rng, (kv_lens[b], num_kv_heads, head_dim), dtype)
    else:
        k, v = make_kv(rng, kind, cache_lens, kv_lens, num_kv_heads, head_dim, dtype,
                       page_size=page_size)
    return {
        "q": q, "q_input_row_offsets": q_offsets,
        "q_max_seq_len": int(q_lens.max(initial=0)) + q_pad, "k": k, "v": v,
        "kv_input_row_offsets": kv_offsets,
    }


def num_keys_of(problem):
    k = problem["k"]
    kv_lens = np.diff(problem["kv_input_row_offsets"])
    cache = k.cache_lengths if hasattr(k, "cache_lengths") else 0
    return cache + kv_lens


def make_mask(rng, name, problem, num_heads):
    """A mask by name; additive tensors are padded to q_max_seq_len and the largest key count."""
    batch = problem["q_input_row_offsets"].shape[0] - 1
    dtype = problem["q"].dtype
    s = problem["q_max_seq_len"]
    n = int(num_keys_of(problem).max(initial=0)) + 1

    def additive(shape):
        t = randn(rng, shape, dtype)
        t[rng.random(shape) < 0.25] = -np.inf
        return t

    return {
        "null": NullMask(),
        "causal": CausalMask(),
        "sliding": SlidingWindowCausalMask(3),
        "chunked": ChunkedMask(4),
        "chunked_causal": ChunkedCausalMask(3),
        "additive_sn": additive((s, n)),
        "additive_bss": additive((batch, s, n)),
        "additive_bhss": MaterializedMask(additive((batch, num_heads, s, n))),
        "causal_and_additive": CausalMask() & MaterializedMask(additive((batch, s, n))),
        "chunked_or_sliding": ChunkedMask(4) | SlidingWindowCausalMask(2),
    }[name]


def check(problem, mask=None, *, device="cpu", config=None, **kwargs):
    """Run cross_attention and compare out and lse with the reference; returns (out, lse)."""
    mask = NullMask() if mask is None else mask
    out, lse = cross_attention(**problem, mask=mask, device=device, config=config,
                               return_lse=True, **kwargs)
    ref_out, ref_lse = reference.cross_attention(**problem, mask=mask, return_lse=True)
    dtype = problem["q"].dtype
    out = out.copy_to_host() if hasattr(out, "copy_to_host") else out
    lse = lse.copy_to_host() if hasattr(lse, "copy_to_host") else lse
    assert out.dtype == dtype and lse.dtype == dtype
    assert_close(out, ref_out, dtype)
    assert_close(lse, ref_lse, dtype, what="lse")
    return out, lse


# Sequences: some with zero queries, one with zero keys, caches crossing pages of 4.
Q_LENS = (3, 0, 5, 2, 4)
KV_LENS = (4, 3, 0, 6, 2)
CACHE_LENS = (9, 2, 0, 6, 0)


def standard_problem(rng, kind, dtype, num_heads=6, num_kv_heads=2, head_dim=5):
    cache = (0,) * len(CACHE_LENS) if kind in ("ragged", "dense") else CACHE_LENS
    return make_problem(rng, kind, Q_LENS, KV_LENS, cache, num_heads, num_kv_heads, head_dim,
                        dtype)


# --------------------------------------------------------------------------------------
# Numerics.
# --------------------------------------------------------------------------------------
CUDA_CASES = [  # (kind, mask, dtype): every kind, mask and dtype appears
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


@pytest.mark.parametrize(("device", "kind", "mask_name", "dtype"), on_devices(
    [(kind, mask, dtype) for kind in KINDS for mask in MASKS for dtype in DTYPES], CUDA_CASES,
    cpu=CPU_PATHS), indirect=["device"])
def test_matches_reference(kind, mask_name, dtype, device, rng):
    """Every kind, mask and dtype on the CPU; on CUDA the chosen few, float32 with each
    sequence's rows in one block and float64 in blocks of 2 rows."""
    if device == "cpu":
        problem = standard_problem(rng, kind, dtype)
        config = numattn.MHAConfig(block_q=2, block_k=3)
    else:
        problem = standard_problem(rng, kind, dtype, num_heads=4, num_kv_heads=2, head_dim=3)
        config = numattn.MHAConfig(block_q=256 if dtype == np.float32 else 2, block_k=4,
                                   threads_per_block=32)
    num_heads = problem["q"].shape[1]
    out, lse = check(problem, make_mask(rng, mask_name, problem, num_heads), device=device,
                     config=config)
    assert isinstance(out, np.ndarray)
    # The sequence with zero keys (index 2, rows 3..7) gives 0 and -inf, never NaN.
    assert np.all(out[3:8] == 0) and np.all(lse[3:8] == -np.inf)


@pytest.mark.parametrize(("device", "group"), on_devices(
    [(1,), (2,), (3,), (4,), (5,), (8,)], [(1,), (2,), (3,), (8,)], cpu=CPU_PATHS),
    indirect=["device"])
def test_gqa_groups(group, device, rng):
    if device == "cpu":
        problem = make_problem(rng, "paged", (3, 5), (2, 4), (7, 1), 2 * group, 2, 8,
                               np.float32)
        config = numattn.MHAConfig(block_q=2, block_k=4)
    else:
        problem = make_problem(rng, "paged", (2, 1), (3, 2), (2, 5), group, 1, 3, np.float32)
        config = SIM
    check(problem, CausalMask(), device=device, config=config)


@pytest.mark.parametrize(("device", "dtype"), on_devices(
    [(np.float32,), pytest.param(np.float64, marks=pytest.mark.slow)], [(np.float32,)],
    cpu=CPU_PATHS), indirect=["device"])
def test_max_shapes_paged_128(dtype, device, rng):
    """MAX's test: 16 query heads, 4 KV heads, D = 128, pages of 128, caches of 37 and 129
    (on CUDA a row or two per sequence, without a mask)."""
    q_lens, kv_lens = ((5, 33), (7, 40)) if device == "cpu" else ((1, 2), (1, 2))
    problem = make_problem(rng, "paged", q_lens, kv_lens, (37, 129), 16, 4, 128, dtype,
                           page_size=128)
    check(problem, NullMask(), device=device)
    if device == "cpu":
        check(problem, CausalMask())


def test_page_size_4_many_crossings(device, rng):
    """Pages of 4 crossed many times; then NaN in the keys the causal mask hides from every
    row never shows, and where no mask hides them it propagates as in the reference."""
    if device == "cpu":
        problem = make_problem(rng, "paged", (9, 1, 14), (13, 2, 30), (29, 3, 41), 4, 2, 7,
                               np.float64, page_size=4)
    else:
        problem = make_problem(rng, "paged", (3, 2), (6, 1), (11, 14), 2, 1, 2, np.float64)
    check(problem, NullMask(), device=device,
          config=numattn.MHAConfig(block_q=4, block_k=5, threads_per_block=32))
    check(problem, ChunkedCausalMask(5), device=device,
          config=numattn.MHAConfig(block_q=3, block_k=8, threads_per_block=32))
    k, v = problem["k"], problem["v"]
    q_lens = np.diff(problem["q_input_row_offsets"])
    for b, q_len in enumerate(q_lens):
        for t in range(int(q_len), int(num_keys_of(problem)[b])):  # hidden: q_idx = r < t
            for x in (k, v):
                x.blocks[x.lookup_table[b, t // 4], t % 4] = np.nan
    out, _ = check(problem, CausalMask(), device=device, config=SIM)
    assert np.all(np.isfinite(out))
    check(problem, NullMask(), device=device,
          config=numattn.MHAConfig(block_k=5, threads_per_block=32))


@pytest.mark.parametrize("cache_batch", [0, 2])
def test_zero_sequence_batch_leaves_out_untouched(cache_batch, device, rng):
    """No sequences: returns at once; the caches may describe any number of sequences."""
    h, hkv, d = 16, 4, 128
    kb = np.full((3, 128, hkv, d), np.nan, np.float32)
    lengths = np.array([37, 129][:cache_batch], np.int64)
    table = np.zeros((cache_batch, 2), np.int64)
    k = numattn.PagedKVCache(kb, lengths, table)
    v = numattn.PagedKVCache(kb.copy(), lengths, table)
    q = np.empty((0, h, d), np.float32)
    out = np.full((0, h, d), 7.0, np.float32)
    result = cross_attention(q, np.array([0]), 0, k, v, np.array([0]), out=out, device=device)
    assert result is out
    res, lse = cross_attention(q, np.array([0], np.uint32), 4, k, v, np.array([0]),
                               return_lse=True, device=device)
    assert res.shape == (0, h, d) and lse.shape == (0, h)


def test_zero_query_rows_and_zero_keys(device, rng):
    # Every sequence without queries: nothing is written.
    problem = make_problem(rng, "paged", (0, 0), (3, 0), (2, 0), 4, 2, 3, np.float32)
    out = np.full((0, 4, 3), 5.0, np.float32)
    assert cross_attention(**problem, out=out, device=device) is out
    # Queries whose sequence has no keys at all: 0 and lse -inf, even with an additive mask.
    problem = make_problem(rng, "ragged", (2, 3), (0, 0), (0, 0), 4, 2, 3, np.float32)
    out, lse = check(problem, make_mask(rng, "additive_bss", problem, 4), device=device,
                     config=DEFAULT_TILES)
    assert np.all(out == 0) and np.all(lse == -np.inf)


def test_zero_heads(device, rng):
    problem = make_problem(rng, "paged", (2, 1), (1, 2), (3, 0), 0, 2, 3, np.float32)
    out, lse = cross_attention(**problem, device=device, return_lse=True)
    assert out.shape == (3, 0, 3) and lse.shape == (3, 0)


@pytest.mark.parametrize("kind", ["ragged", "paged"])
def test_nan_in_hidden_keys_never_reaches_output(kind, device, rng):
    """Causal with q_idx = r: keys at positions >= q_len are hidden from every row."""
    cache = (0, 0) if kind == "ragged" else (4, 6)
    problem = make_problem(rng, kind, (3, 4), (5, 2), cache, 4, 2, 6, np.float64)
    q_lens = np.diff(problem["q_input_row_offsets"])
    num_keys = num_keys_of(problem)
    for b in range(2):
        for t in range(int(q_lens[b]), int(num_keys[b])):
            for x in (problem["k"], problem["v"]):
                if kind == "ragged":
                    x[problem["kv_input_row_offsets"][b] + t] = np.nan
                else:
                    page = x.lookup_table[b, t // x.page_size]
                    x.blocks[page, t % x.page_size] = np.nan
    out, _ = check(problem, CausalMask(), device=device,
                   config=numattn.MHAConfig(block_q=2, block_k=2, threads_per_block=32))
    assert np.all(np.isfinite(out))


def test_additive_minus_inf_hides_nan_and_inf_keys(device, rng):
    """-inf in an additive mask hides a key even when its K row holds NaN or inf."""
    problem = make_problem(rng, "ragged", (3, 2), (5, 4), (0, 0), 4, 2, 6, np.float64)
    bias = randn(rng, (2, 4, problem["q_max_seq_len"], 5), np.float64)
    bias[:, :, :, 1] = -np.inf  # key 1 of each sequence: hidden everywhere
    bias[1, 2:, :, 3] = -np.inf  # key 3 of sequence 1: hidden from KV head 1's heads
    want = reference.cross_attention(**problem, mask=bias)
    k, v, kv_offsets = problem["k"], problem["v"], problem["kv_input_row_offsets"]
    for b in range(2):
        k[kv_offsets[b] + 1] = np.nan
        v[kv_offsets[b] + 1] = np.inf
    k[kv_offsets[1] + 3, 1] = np.inf
    v[kv_offsets[1] + 3, 1] = np.nan
    out = cross_attention(**problem, mask=bias, device=device,
                          config=numattn.MHAConfig(block_k=2, threads_per_block=32))
    assert_close(out, want, np.float64)


def test_nan_in_visible_input_propagates(device, rng):
    problem = make_problem(rng, "ragged", (2, 3), (4, 4), (0, 0), 2, 1, 4, np.float32)
    problem["q"][3, 1, 2] = np.nan  # second sequence, row 1, head 1
    out, lse = check(problem, device=device, config=DEFAULT_TILES)
    assert np.all(np.isnan(out[3, 1])) and np.isnan(lse[3, 1])
    assert np.all(np.isfinite(np.delete(out.reshape(-1, 4), 3 * 2 + 1, axis=0)))


# The simulator warns at -inf - -inf (a GPU gives NaN quietly).
@pytest.mark.filterwarnings("ignore:.*invalid value encountered:RuntimeWarning")
def test_a_row_that_reads_inf_in_its_query_is_nan(device):
    """inf in a query makes its visible keys' scores -inf: the row returns NaN in out and
    lse (it read inf), not the "no visible key" pair; NaN in a visible V row reaches every
    row that sees it, and hidden keys are never read."""
    q = np.ones((3, 2, 4), np.float32)
    q[0, :, 0] = -np.inf  # token 0 sees key 0 only (causal): a score of -inf
    k = np.ones((4, 1, 4), np.float32)
    v = np.ones((4, 1, 4), np.float32)
    v[0, 0, 1] = np.nan  # key 0: visible to every token
    v[3, 0, 2] = np.inf  # key 3: hidden from every token (causal, q_idx = r < 3)
    args = (q, np.array([0, 3]), 3, k, v, np.array([0, 4]), CausalMask())
    out, lse = cross_attention(*args, device=device, config=SIM, return_lse=True)
    assert np.isnan(out[0]).all() and np.isnan(lse[0]).all()
    assert np.isnan(out[1:, :, 1]).all() and np.isfinite(out[1:, :, [0, 2, 3]]).all()
    assert np.isfinite(lse[1:]).all()
    want, want_lse = reference.cross_attention(*args, return_lse=True)
    assert_close(out, want, np.float32)
    assert_close(lse, want_lse, np.float32, what="lse")


def test_dense_keys_with_and_without_offsets(device, rng):
    problem = make_problem(rng, "dense", (2, 3), (4, 1), (0, 0), 4, 4, 5, np.float64)
    check(problem, CausalMask(), device=device, config=DEFAULT_TILES)
    k = problem["k"]
    k[np.isnan(k)] = 0.5
    problem["v"][np.isnan(problem["v"])] = -0.25
    problem["kv_input_row_offsets"] = None  # all N rows are keys
    out = cross_attention(**problem, device=device, config=DEFAULT_TILES)
    n = k.shape[1]
    ref = reference.cross_attention(**{**problem, "kv_input_row_offsets": [0, n, 2 * n]})
    assert_close(out, ref, np.float64)


def test_cache_without_kv_offsets_uses_q_lengths(device, rng):
    problem = make_problem(rng, "continuous", (2, 3), (2, 3), (4, 1), 4, 2, 5, np.float64)
    expected = reference.cross_attention(**problem)
    out = cross_attention(**{**problem, "kv_input_row_offsets": None}, device=device,
                          config=DEFAULT_TILES)
    assert_close(out, expected, np.float64)


def test_out_scale_and_lse(device, rng):
    problem = make_problem(rng, "paged", (3, 2), (2, 5), (3, 0), 4, 2, 6, np.float32)
    out = np.full((5, 4, 6), np.nan, np.float32)
    result, lse = cross_attention(**problem, scale=0.3, out=out, return_lse=True,
                                  device=device, config=DEFAULT_TILES)
    assert result is out
    ref_out, ref_lse = reference.cross_attention(**problem, scale=0.3, return_lse=True)
    assert_close(out, ref_out, np.float32)
    assert_close(lse, ref_lse, np.float32, what="lse")
    plain = cross_attention(**problem, scale=0.3, device=device, config=DEFAULT_TILES)
    assert isinstance(plain, np.ndarray) and plain.shape == (5, 4, 6)


def test_config_does_not_change_results(device, rng):
    problem = standard_problem(rng, "paged", np.float64)
    mask = SlidingWindowCausalMask(4)
    base = cross_attention(**problem, mask=mask, device=device, config=DEFAULT_TILES)
    for cfg in (numattn.MHAConfig(block_q=1, block_k=1, threads_per_block=32),
                numattn.MHAConfig(block_q=7, block_k=2, threads_per_block=32)):
        assert_close(cross_attention(**problem, mask=mask, device=device, config=cfg), base,
                     np.float64, tol=1e-12)


# --------------------------------------------------------------------------------------
# Errors: raised before any work, nothing written to out.
# --------------------------------------------------------------------------------------
def _bad_cases(problem):
    q = problem["q"]
    k = problem["k"]
    return [
        ({"q": q[:, :, :, None]}, ValueError, "q must be 3-d"),
        ({"q": q.astype(np.int32)}, TypeError, "q must be float64, float32, float16 or bfloat16"),
        ({"q": q[:, :, :0]}, ValueError, "D >= 1"),
        ({"q_input_row_offsets": [0, 2, 1, 5]}, ValueError, "non-decreasing"),
        ({"q_input_row_offsets": [0, 3]}, ValueError, r"q_input_row_offsets\[-1\]"),
        ({"q_input_row_offsets": [1, 3, 5]}, ValueError, r"q_input_row_offsets\[0\]"),
        ({"q_input_row_offsets": np.array([0.0, 2.0, 5.0])}, TypeError, "integer dtype"),
        ({"q_max_seq_len": 2}, ValueError, "q_max_seq_len must be >= every"),
        ({"q_max_seq_len": 3.0}, TypeError, "q_max_seq_len must be an integer"),
        ({"kv_input_row_offsets": [0, 3]}, ValueError, "length B \\+ 1 = 3"),
        ({"kv_input_row_offsets": [0, 4, 3]}, ValueError, "non-decreasing"),
        ({"kv_input_row_offsets": [0, 2, 30]}, ValueError, "sequence 1 needs"),
        ({"k": k.with_cache_lengths(k.cache_lengths + 1)}, ValueError, "share cache_lengths"),
        ({"v": numattn.PagedKVCache(k.blocks.astype(np.float64), k.cache_lengths,
                                    k.lookup_table)}, TypeError, "same shape|dtype"),
        ({"k": np.zeros((5, 2, 3), np.float32)}, TypeError, "same kind"),
        ({"mask": np.zeros((2, 3), np.float32)}, ValueError, "must cover"),
        ({"mask": np.zeros((3, 9, 9), np.float32)}, ValueError, "B = 2"),
        ({"mask": np.zeros((9, 9), np.float64)}, TypeError, "dtype float32"),
        ({"mask": "causal"}, TypeError, "mask must be a numattn mask"),
        ({"scale": float("nan")}, ValueError, "scale must be finite"),
        ({"device": "gpu"}, ValueError, "device must be"),
        ({"config": {"block_k": 4}}, TypeError, "config must be an MHAConfig"),
        ({"return_lse": "yes"}, TypeError, "return_lse must be a bool"),
        ({"out": np.zeros((5, 4, 6), np.float32)}, ValueError, "out must have shape"),
        ({"out": np.zeros((5, 4, 3), np.float64)}, TypeError, "out must have dtype"),
        ({"out": np.zeros((5, 3, 4), np.float32).transpose(0, 2, 1)}, ValueError,
         "C-contiguous"),
        ({"out": q}, ValueError, "out must not overlap q"),
    ]


@pytest.mark.parametrize("device", ["cpu", cuda_param()])
def test_errors_leave_out_untouched(device, rng):
    problem = make_problem(rng, "paged", (2, 3), (1, 2), (3, 4), 4, 2, 3, np.float32)
    sentinel = np.full((5, 4, 3), 123.0, np.float32)
    for change, exc, match in _bad_cases(problem):
        out = sentinel.copy() if "out" not in change else change["out"]
        kwargs = {**problem, "out": out, "device": device, **change}
        before = np.array(out, copy=True)
        with pytest.raises(exc, match=match):
            cross_attention(**kwargs)
        assert np.array_equal(np.asarray(out), before, equal_nan=True), change.keys()


def test_head_count_errors(rng):
    problem = make_problem(rng, "ragged", (2, 3), (1, 2), (0, 0), 3, 2, 4, np.float64)
    with pytest.raises(ValueError, match="multiple of the number of key/value heads"):
        cross_attention(**problem)
    problem = make_problem(rng, "ragged", (2, 3), (1, 2), (0, 0), 4, 2, 4, np.float64)
    with pytest.raises(ValueError, match="head dimension D = 5"):
        cross_attention(**{**problem, "q": randn(rng, (5, 4, 5), np.float64)})
    with pytest.raises(ValueError, match="kv_input_row_offsets"):
        cross_attention(**{**problem, "kv_input_row_offsets": None})


@pytest.mark.skipif(is_available(), reason="CUDA (or the simulator) is available here")
def test_cuda_requested_without_cuda(rng):
    problem = make_problem(rng, "ragged", (2,), (3,), (0,), 2, 1, 4, np.float32)
    with pytest.raises(CudaUnavailableError, match="no CUDA GPU"):
        cross_attention(**problem, device="cuda")


# --------------------------------------------------------------------------------------
# CUDA only.  Host-side tiling (no CUDA needed), device arrays, launch geometry.
# --------------------------------------------------------------------------------------
def test_cuda_tiles_fit_shared_memory():
    cross = internals.cuda_flash
    for group in (1, 3, 4, 8, 12, 16, 17, 48, 128):
        for itemsize in (4, 8):
            for block_q, block_k in ((1, 1), (256, 128), (7, 65536)):
                heads, rows, keys = internals.cuda_cross_tiles(group, itemsize, block_q,
                                                               block_k, 100)
                assert group % heads == 0 and 1 <= heads * rows <= cross.MAX_ROW_HEADS
                assert 1 <= rows <= block_q and 1 <= keys <= block_k
                assert (internals.cuda_cross_shared_bytes(heads * rows, keys, itemsize)
                        <= cross.SHARED_BYTES)
    assert internals.cuda_cross_tiles(4, 4, 256, 128, 100) == (4, 8, 128)
    # no longer than the longest sequence
    assert internals.cuda_cross_tiles(4, 4, 256, 128, 3)[1] == 3
    assert internals.cuda_cross_tiles(12, 8, 256, 128, 100)[:2] == (12, 2)


@requires_cuda
def test_cuda_group_split_over_blocks(rng, monkeypatch):
    """A group larger than a block's head count is served by several blocks."""
    monkeypatch.setattr(internals.cuda_flash, "MAX_ROW_HEADS", 2)
    problem = make_problem(rng, "continuous", (2, 1), (1, 3), (3, 0), 8, 2, 2, np.float64)
    check(problem, CausalMask(), device="cuda", config=SIM)


def _to_device(x):
    from numba import cuda

    return cuda.to_device(x)


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
def test_cuda_zero_sequence_batch_of_device_arrays_leaves_out_untouched():
    h, hkv, d = 16, 4, 128
    blocks = np.full((2, 128, hkv, d), np.nan, np.float32)
    k = numattn.PagedKVCache(blocks, np.array([37, 129]), np.zeros((2, 2), np.int64))
    q = _to_device(np.empty((0, h, d), np.float32))
    out = _to_device(np.full((0, h, d), 3.0, np.float32))
    assert cross_attention(q, [0], 0, k, k, [0], out=out) is out


@requires_cuda
def test_cuda_rejects_non_contiguous_device_arrays(rng):
    problem = make_problem(rng, "ragged", (2,), (2,), (0,), 2, 1, 4, np.float32)
    wide = _to_device(np.zeros((2, 2, 8), np.float32))
    with pytest.raises(ValueError, match="q must be C-contiguous"):
        cross_attention(**{**problem, "q": wide[:, :, ::2]}, device="cuda")


# --------------------------------------------------------------------------------------
# PTX for a real target (cc 9.0): catches typing errors the simulator cannot see.
# --------------------------------------------------------------------------------------
# float32 covers the kernels' paths, uint8 (float8 bits) the widening of stored K/V; the
# other dtypes compile them again (slow)
@pytest.mark.parametrize("dtype, storage", [
    ("float32", "float32"), ("float32", "uint8"),
    *(pytest.param("float32", storage, marks=pytest.mark.slow)
      for storage in ("uint16", "int16", "int8")),
    pytest.param("float64", "float64", marks=pytest.mark.slow)])
def test_kernel_compiles_to_ptx(dtype, storage, ptx_compiler):
    from numba import types

    ft = getattr(types, dtype)
    kv = getattr(types, storage)[:, :, ::1]
    idx1, idx2 = types.int64[::1], types.int64[:, ::1]
    scales = types.float32[:, ::1]
    signature = (
        ft[:, :, ::1], idx1, idx1, idx1, idx1, kv, kv, types.int64, idx2, idx1, idx1, scales,
        scales, types.int64, types.boolean, idx2, no_functions_type(), ft[:, :, :, ::1],
        types.boolean, ft, ft[::1],
        types.boolean, types.int64, types.int64, types.int64, types.int64, ft[:, :, ::1],
        ft[:, ::1], types.boolean,
    )
    ptx = ptx_compiler(internals.flash_cuda_kernel, signature)
    assert "bar.sync" in ptx
    if dtype == "float32":  # the tile loops stay in float32 (only the row's 1/l is float64)
        assert ptx.count(".f64") < 40
