"""Mask and score functions written in Python (FunctionMask, ScoreMod, softcap, alibi),
compiled into every kernel: against the float64 reference and against the built-in masks
they stand for, on every operation, cache kind and backend, with GQA, sinks, LSE and
additive masks; captures changed between calls compile nothing; bad functions are refused
before any work.

The functions are few and shared by the tests (each new set of functions compiles the
kernels once per process): :func:`tests.utils.built_in_like` stands for every built-in
mask through its captured ``kind`` and ``param``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import numattn
from numattn import (
    CausalMask,
    ChunkedCausalMask,
    ChunkedMask,
    FunctionMask,
    NullMask,
    ScoreMod,
    SlidingWindowCausalMask,
    alibi,
    reference,
    softcap,
)

from .conftest import CPU_PATHS, on_devices
from .utils import (
    CACHE_KINDS,
    CAUSAL,
    CHUNKED,
    CHUNKED_CAUSAL,
    NULL,
    WINDOW,
    assert_close,
    built_in_like,
    make_kv,
    no_functions_type,
    randn,
)

BUILT_IN = {NULL: lambda p: NullMask(), CAUSAL: lambda p: CausalMask(),
            WINDOW: SlidingWindowCausalMask, CHUNKED: ChunkedMask,
            CHUNKED_CAUSAL: ChunkedCausalMask}


def same_document(b, h, q_idx, kv_idx, doc_ids):
    return doc_ids[b, q_idx] == doc_ids[b, kv_idx]


def head_window(b, h, q_idx, kv_idx, windows):
    """A causal window of its own for every query head (a function that reads ``h``)."""
    return kv_idx <= q_idx and q_idx - kv_idx < windows[h]


def relative_bias(score, b, h, q_idx, kv_idx, table):
    return score + table[h, min(abs(q_idx - kv_idx), table.shape[1] - 1)]


def _doc_ids(rng, batch, n):
    return np.sort(rng.integers(0, 4, (batch, n)), axis=1)


def _bias_table(rng, num_heads):
    return rng.standard_normal((num_heads, 9)).astype(np.float32)


def _cases(rng, batch, n, num_heads):
    """(name, mask, score_mod): function masks alone and combined with built-in masks, each
    with a score modifier.  Three sets of functions in all, which most tests share (each
    set compiles the kernels of an operation once per process)."""
    return [
        ("document & causal, alibi",
         CausalMask() & FunctionMask(same_document, _doc_ids(rng, batch, n)), _alibi(num_heads)),
        ("window per head, softcap",
         FunctionMask(head_window, np.arange(1, num_heads + 1) * 2), softcap(1.5)),
        ("document | window, relative bias",
         FunctionMask(same_document, _doc_ids(rng, batch, n)) | SlidingWindowCausalMask(3),
         ScoreMod(relative_bias, _bias_table(rng, num_heads))),
    ]


def _alibi(num_heads):
    return alibi(np.linspace(0.05, 1.0, num_heads))


# --------------------------------------------------------------------------------------
# A function mask equal to a built-in one gives the built-in's output.
# --------------------------------------------------------------------------------------
EQUIVALENT_CASES = [(NULL, 1), (CAUSAL, 1), (WINDOW, 1), (WINDOW, 5), (CHUNKED, 4),
                    (CHUNKED_CAUSAL, 3)]


@pytest.mark.parametrize(
    ("device", "kind", "param", "cache_kind"),
    on_devices([(*case, cache) for case in EQUIVALENT_CASES for cache in CACHE_KINDS],
               [(WINDOW, 2, "paged"), (CHUNKED, 3, "continuous")], cpu=CPU_PATHS),
    indirect=["device"])
def test_function_mask_equals_the_built_in_mask(device, kind, param, cache_kind, rng):
    if device == "cuda":  # the simulator runs each thread in Python: a tiny problem
        batch, s_len, num_heads, num_kv_heads, head_dim, cache_lengths = 2, 3, 2, 1, 4, [1, 4]
    else:
        batch, s_len, num_heads, num_kv_heads, head_dim = 2, 9, 4, 2, 16
        cache_lengths = [0, 0] if cache_kind == "dense" else [5, 23]
    k, v = make_kv(rng, cache_kind, cache_lengths, [s_len] * batch, num_kv_heads, head_dim,
                   np.float32)
    q = randn(rng, (batch, s_len, num_heads, head_dim), np.float32)
    sinks = randn(rng, (num_heads,), np.float32)
    function = FunctionMask(built_in_like, kind, param)
    got, got_lse = numattn.flash_attention_kv_cache(q, k, v, function, sink_weights=sinks,
                                                    return_lse=True, device=device)
    want, want_lse = numattn.flash_attention_kv_cache(q, k, v, BUILT_IN[kind](param),
                                                      sink_weights=sinks, return_lse=True,
                                                      device=device)
    assert_close(got, want, np.float32)
    assert_close(got_lse, want_lse, np.float32, what="lse")
    q1 = q[:, 0]
    if cache_kind != "dense":  # decode: one new row per sequence
        k, v = make_kv(rng, cache_kind, cache_lengths, [1] * batch, num_kv_heads, head_dim,
                       np.float32)
    got = numattn.decode_attention(q1, k, v, function, sink_weights=sinks, device=device)
    want = numattn.decode_attention(q1, k, v, BUILT_IN[kind](param), sink_weights=sinks,
                                    device=device)
    assert_close(got, want, np.float32)


def test_new_capture_values_compile_nothing(rng):
    from numba.core import event

    q = randn(rng, (2, 7, 4, 8), np.float32)
    kv = randn(rng, (2, 12, 2, 8), np.float32)
    numattn.flash_attention_kv_cache(q, kv, kv, FunctionMask(built_in_like, WINDOW, 2))
    numattn.decode_attention(q[:, 0], kv, kv, FunctionMask(built_in_like, WINDOW, 2))
    with event.install_recorder("numba:compile") as recorder:
        for kind, param in EQUIVALENT_CASES:
            mask = FunctionMask(built_in_like, kind, param)
            got = numattn.flash_attention_kv_cache(q, kv, kv, mask)
            assert_close(got, reference.flash_attention_kv_cache(q, kv, kv, BUILT_IN[kind](
                param)), np.float32)
            numattn.decode_attention(q[:, 0], kv, kv, mask)
    assert recorder.buffer == [], [ev.data["dispatcher"] for _, ev in recorder.buffer]


# --------------------------------------------------------------------------------------
# Against the reference: operations x cache kinds x functions x score mods.
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("cache_kind", ["dense", "paged"])
def test_flash_against_the_reference(cache_kind, rng):
    batch, s_len, num_heads, num_kv_heads, head_dim = 3, 11, 4, 2, 16
    cache_lengths = [0] * batch if cache_kind == "dense" else [0, 9, 30]
    k, v = make_kv(rng, cache_kind, cache_lengths, [s_len] * batch, num_kv_heads, head_dim,
                   np.float32)
    n = max(cache_lengths) + s_len
    q = randn(rng, (batch, s_len, num_heads, head_dim), np.float32)
    sinks = randn(rng, (num_heads,), np.float32)
    for name, mask, mod in _cases(rng, batch, n, num_heads):
        got, lse = numattn.flash_attention_kv_cache(q, k, v, mask, sink_weights=sinks,
                                                    score_mod=mod, return_lse=True)
        want, want_lse = reference.flash_attention_kv_cache(
            q, k, v, mask, sink_weights=sinks, score_mod=mod, return_lse=True)
        assert_close(got, want, np.float32, what=name)
        assert_close(lse, want_lse, np.float32, what=f"lse: {name}")


@pytest.mark.parametrize("cache_kind", CACHE_KINDS)
def test_decode_against_the_reference(cache_kind, rng):
    batch, num_heads, num_kv_heads, head_dim = 3, 8, 2, 16
    cache_lengths = [40] * batch if cache_kind == "dense" else [0, 17, 70]
    k, v = make_kv(rng, cache_kind, cache_lengths, [1] * batch, num_kv_heads, head_dim,
                   np.float32)
    n = max(cache_lengths) + 1
    q = randn(rng, (batch, num_heads, head_dim), np.float32)
    for name, mask, mod in _cases(rng, batch, n, num_heads):
        for partitions in (1, 3):
            got, lse = numattn.decode_attention(q, k, v, mask, score_mod=mod, return_lse=True,
                                                num_partitions=partitions)
            want, want_lse = reference.decode_attention(q, k, v, mask, score_mod=mod,
                                                        return_lse=True)
            assert_close(got, want, np.float32, what=name)
            assert_close(lse, want_lse, np.float32, what=f"lse: {name}")


def test_cross_against_the_reference(rng):
    num_heads, num_kv_heads, head_dim = 4, 1, 8
    q_offsets = np.array([0, 5, 5, 12])
    kv_offsets = np.array([0, 9, 10, 26])
    q = randn(rng, (12, num_heads, head_dim), np.float32)
    k = randn(rng, (26, num_kv_heads, head_dim), np.float32)
    v = randn(rng, (26, num_kv_heads, head_dim), np.float32)
    _, mask, mod = _cases(rng, 3, 16, num_heads)[0]
    got = numattn.cross_attention(q, q_offsets, 7, k, v, kv_offsets, mask, score_mod=mod)
    want = reference.cross_attention(q, q_offsets, 7, k, v, kv_offsets, mask, score_mod=mod)
    assert_close(got, want, np.float32)


def test_additive_mask_and_function_mask_together(rng):
    batch, s_len, num_heads, head_dim = 2, 6, 2, 8
    q = randn(rng, (batch, s_len, num_heads, head_dim), np.float32)
    kv = randn(rng, (batch, 10, 1, head_dim), np.float32)
    additive = randn(rng, (batch, s_len, 10), np.float32)
    additive[:, :, ::4] = -np.inf
    mask = numattn.MaterializedMask(additive) & FunctionMask(same_document,
                                                             _doc_ids(rng, batch, 10))
    mod = _alibi(num_heads)
    got = numattn.flash_attention_kv_cache(q, kv, kv, mask, score_mod=mod)
    assert_close(got, reference.flash_attention_kv_cache(q, kv, kv, mask, score_mod=mod),
                 np.float32)


@pytest.mark.parametrize("dtype", [np.float64, "bfloat16", "int8"])
def test_stored_dtypes(dtype, rng):
    """float64 stays float64; 16- and 8-bit K/V are read as stored, with the functions."""
    from numattn.core.dtypes import ml_dtype

    batch, num_heads, head_dim = 2, 4, 8
    mask = CausalMask() & FunctionMask(same_document, _doc_ids(rng, batch, 14))
    mod = alibi(np.linspace(0.1, 0.5, num_heads))
    if dtype == np.float64:
        q = randn(rng, (batch, 5, num_heads, head_dim), np.float64)
        kv = randn(rng, (batch, 14, 2, head_dim), np.float64)
        got = numattn.flash_attention_kv_cache(q, kv, kv, mask, score_mod=mod)
        assert_close(got, reference.flash_attention_kv_cache(q, kv, kv, mask, score_mod=mod),
                     np.float64)
        return
    q = randn(rng, (batch, num_heads, head_dim), np.float32)
    if dtype == "int8":
        blocks = rng.integers(-100, 100, (2, 4, 4, 2, head_dim)).astype(np.int8)
        scales = rng.uniform(0.01, 0.02, (2, 4, 4, 2)).astype(np.float32)
    else:
        blocks = randn(rng, (2, 4, 4, 2, head_dim), np.float32).astype(ml_dtype(dtype))
        scales = (None, None)
    table = np.array([[0, 1, 2], [3, 2, 1]])
    lengths = np.array([9, 11])
    k = numattn.PagedKVCache(blocks[0], lengths, table, scales=scales[0])
    v = numattn.PagedKVCache(blocks[1], lengths, table, scales=scales[1])
    got = numattn.decode_attention(q, k, v, mask, score_mod=mod)
    assert_close(got, reference.decode_attention(q, k, v, mask, score_mod=mod), np.float32)


# --------------------------------------------------------------------------------------
# Edge cases: nothing visible, NaN behind a function mask, zero-length sequences.
# --------------------------------------------------------------------------------------
def test_rows_a_function_hides_entirely_and_nan_in_hidden_slots(rng):
    batch, s_len, num_heads, head_dim = 2, 20, 2, 8
    q = randn(rng, (batch, s_len, num_heads, head_dim), np.float32)
    k = randn(rng, (batch, 40, 1, head_dim), np.float32)
    v = randn(rng, (batch, 40, 1, head_dim), np.float32)
    doc_ids = np.zeros((batch, 40), dtype=np.int64)
    doc_ids[:, 20:] = 1  # the queries (positions 20..39) never see keys 0..19
    k[:, :20] = np.nan
    v[:, :20] = np.inf
    mask = CausalMask() & FunctionMask(same_document, doc_ids)
    mod = _alibi(num_heads)
    got, lse = numattn.flash_attention_kv_cache(q, k, v, mask, score_mod=mod, return_lse=True)
    want, want_lse = reference.flash_attention_kv_cache(q, k, v, mask, score_mod=mod,
                                                        return_lse=True)
    assert np.isfinite(got).all()
    assert_close(got, want, np.float32)
    assert_close(lse, want_lse, np.float32, what="lse")
    nothing = FunctionMask(head_window, np.zeros(num_heads, np.int64))  # no key at all
    got, lse = numattn.flash_attention_kv_cache(q, k, v, nothing, sink_weights=np.ones(
        num_heads, np.float32), score_mod=softcap(1.5), return_lse=True)
    assert (got == 0).all() and (lse == 1).all()  # the sink logit, not soft-capped
    got, lse = numattn.decode_attention(q[:, 0], k, v, nothing, score_mod=softcap(1.5),
                                        return_lse=True)
    assert (got == 0).all() and (lse == -np.inf).all()


def test_sequences_without_queries_and_empty_batches(rng):
    k, v = make_kv(rng, "paged", [3, 0], [2, 0], 1, 8, np.float32)
    q = randn(rng, (2, 2, 8), np.float32)
    offsets = np.array([0, 2, 2])  # the second sequence has no query and no key
    mask = FunctionMask(same_document, np.zeros((2, 8), np.int64))
    got = numattn.flash_attention_kv_cache(q, k, v, mask, q_input_row_offsets=offsets,
                                           score_mod=_alibi(2))
    want = reference.flash_attention_kv_cache(q, k, v, mask, q_input_row_offsets=offsets,
                                              score_mod=_alibi(2))
    assert_close(got, want, np.float32)
    empty = numattn.decode_attention(np.zeros((0, 2, 8), np.float32),
                                     np.zeros((0, 4, 1, 8), np.float32),
                                     np.zeros((0, 4, 1, 8), np.float32), mask,
                                     score_mod=_alibi(2))
    assert empty.shape == (0, 2, 8)


# --------------------------------------------------------------------------------------
# The tile table: sound against brute force.
# --------------------------------------------------------------------------------------
def test_tile_table_is_sound(rng):
    from numattn.core.functions import (
        FUNCTION_TILE_KEYS,
        FUNCTION_TILE_ROWS,
        bind_functions,
        kernel_functions,
    )
    from numattn.core.masks import compile_mask, mask_functions
    from numattn.kernels.cpu.function_tiles import function_tile_table

    batch, num_heads = 2, 3
    q_lens = np.array([37, 5])
    num_keys = np.array([70, 40])
    q_start_pos = num_keys - q_lens
    for mask in (FunctionMask(same_document, _doc_ids(rng, batch, 70)),
                 FunctionMask(head_window, np.array([1, 20, 33]))):
        program, _ = compile_mask(mask)
        bound = bind_functions(mask_functions(mask), None, np.dtype(np.float32), "cpu")
        heads = num_heads if bound.per_head else 1
        table = function_tile_table(program, kernel_functions(bound, q_start_pos),
                                    bound.special, q_lens, num_keys, heads)
        for b in range(batch):
            for r in range(table.shape[2]):
                rows = np.arange(r * FUNCTION_TILE_ROWS,
                                 min((r + 1) * FUNCTION_TILE_ROWS, q_lens[b]))
                for c in range(table.shape[3]):
                    keys = np.arange(c * FUNCTION_TILE_KEYS,
                                     min((c + 1) * FUNCTION_TILE_KEYS, num_keys[b]))
                    shown = np.array([mask.visible(q_start_pos[b] + rows[:, None],
                                                   keys[None, :], b=b, h=h)
                                      for h in range(heads)])
                    want = int(shown.any()) | 2 * int((~shown).any())
                    assert table[0, b, r, c] == want, (mask, b, r, c)


# --------------------------------------------------------------------------------------
# Plans, threads and refusals.
# --------------------------------------------------------------------------------------
def test_plans_read_captured_values_at_each_run(rng):
    batch, num_heads, head_dim = 2, 4, 8
    k, v = make_kv(rng, "paged", [20, 31], [1, 1], 2, head_dim, np.float32)
    doc_ids = _doc_ids(rng, batch, 40)
    mask = CausalMask() & FunctionMask(same_document, doc_ids)
    table = _bias_table(rng, num_heads)
    mod = ScoreMod(relative_bias, table)
    plan = numattn.DecodePlan(k, v, mask, score_mod=mod)
    q = randn(rng, (batch, num_heads, head_dim), np.float32)
    for _ in range(2):
        assert_close(plan.run(q, k, v), reference.decode_attention(q, k, v, mask, score_mod=mod),
                     np.float32)
        doc_ids[:] = _doc_ids(rng, batch, 40)  # new values, in place
        table[:] = _bias_table(rng, num_heads)
    kf, vf = make_kv(rng, "paged", [20, 31], [3, 2], 2, head_dim, np.float32)
    offsets = np.array([0, 3, 5])
    qf = randn(rng, (5, num_heads, head_dim), np.float32)
    flash_plan = numattn.FlashPlan(kf, vf, mask, q_input_row_offsets=offsets, score_mod=mod)
    for _ in range(2):
        assert_close(flash_plan.run(qf, kf, vf), reference.flash_attention_kv_cache(
            qf, kf, vf, mask, q_input_row_offsets=offsets, score_mod=mod), np.float32)
        doc_ids[:] = _doc_ids(rng, batch, 40)


def test_worker_threads_run_the_functions(rng, monkeypatch):
    """Large enough for the worker threads (a parallel loop takes only flat tuples)."""
    from numattn.kernels.cpu import flash, split_k

    monkeypatch.setattr(flash, "SERIAL_MULTIPLY_ADDS", 0)
    monkeypatch.setattr(split_k, "SERIAL_KV_BYTES", 0)
    batch, num_heads, head_dim = 2, 4, 16
    q = randn(rng, (batch, 40, num_heads, head_dim), np.float32)
    kv = randn(rng, (batch, 90, 2, head_dim), np.float32)
    mask = CausalMask() & FunctionMask(same_document, _doc_ids(rng, batch, 90))
    mod = _alibi(num_heads)
    got = numattn.flash_attention_kv_cache(q, kv, kv, mask, score_mod=mod)
    assert_close(got, reference.flash_attention_kv_cache(q, kv, kv, mask, score_mod=mod),
                 np.float32)
    got = numattn.decode_attention(q[:, 0], kv, kv, mask, score_mod=mod)
    assert_close(got, reference.decode_attention(q[:, 0], kv, kv, mask, score_mod=mod),
                 np.float32)


class _Box:
    """A Python object: nothing Numba compiles."""


def not_compilable(b, h, q_idx, kv_idx):
    return _Box() is not None


def returns_text(score, b, h, q_idx, kv_idx):
    return "no"


def test_functions_numba_cannot_compile_are_refused_before_any_work(rng):
    q = randn(rng, (1, 3, 2, 8), np.float32)
    kv = randn(rng, (1, 5, 1, 8), np.float32)
    out = np.full_like(q, 7.0)
    with pytest.raises(TypeError, match="not_compilable"):
        numattn.flash_attention_kv_cache(q, kv, kv, FunctionMask(not_compilable), out=out)
    with pytest.raises(TypeError, match="returns_text"):
        numattn.decode_attention(q[:, 0], kv, kv, score_mod=ScoreMod(returns_text),
                                 out=out[:, 0])
    with pytest.raises(TypeError, match="capture 0"):
        numattn.flash_attention_kv_cache(q, kv, kv, FunctionMask(same_document, "ids"), out=out)
    with pytest.raises(TypeError, match="score_mod"):
        numattn.flash_attention_kv_cache(q, kv, kv, CausalMask(), score_mod=math.tanh, out=out)
    with pytest.raises(TypeError, match="plain Python function"):
        FunctionMask(np.tanh)
    with pytest.raises(ValueError, match="cap"):
        softcap(0.0)
    with pytest.raises(ValueError, match="slopes"):
        alibi(np.zeros((2, 2)))
    assert (out == 7.0).all()


def test_built_in_score_mods_evaluate_in_python():
    assert softcap(2.0)(100.0, 0, 0, 0, 0) == pytest.approx(2.0 * math.tanh(50.0))
    assert alibi(np.array([0.5, 0.25]))(1.0, 0, 1, 10, 6) == pytest.approx(0.0)
    mask = FunctionMask(head_window, np.array([1, 3]))
    assert mask.visible(5, np.arange(7), h=1).tolist() == [False] * 3 + [True] * 3 + [False]


# --------------------------------------------------------------------------------------
# CUDA: the simulator's semantics (tiny shapes) and PTX for a real target.
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", on_devices([], [()]), indirect=True)
def test_cuda_operations_with_functions(device, rng):
    batch, s_len, num_heads, head_dim = 2, 3, 4, 4
    q = randn(rng, (batch, s_len, num_heads, head_dim), np.float32)
    kv = randn(rng, (batch, 7, 2, head_dim), np.float32)
    mask = CausalMask() & FunctionMask(same_document, _doc_ids(rng, batch, 7))
    per_head = FunctionMask(head_window, np.array([1, 2, 3, 4]))
    mod = ScoreMod(relative_bias, _bias_table(rng, num_heads))
    for m in (mask, per_head):
        got = numattn.flash_attention_kv_cache(q, kv, kv, m, score_mod=mod, device=device)
        assert_close(got, reference.flash_attention_kv_cache(q, kv, kv, m, score_mod=mod),
                     np.float32)
        got = numattn.decode_attention(q[:, 0], kv, kv, m, score_mod=mod, device=device)
        assert_close(got, reference.decode_attention(q[:, 0], kv, kv, m, score_mod=mod),
                     np.float32)
    offsets = np.array([0, 2, 3])
    rows, keys = q[0, :3], kv[0]
    got = numattn.cross_attention(rows, offsets, 2, keys, keys, np.array([0, 4, 7]), mask,
                                  score_mod=mod, device=device)
    assert_close(got, reference.cross_attention(rows, offsets, 2, keys, keys,
                                                np.array([0, 4, 7]), mask, score_mod=mod),
                 np.float32)


def test_specialized_cuda_kernels_compile_to_ptx(ptx_compiler, rng):
    import numba

    from numattn.core.functions import bind_functions, kernel_functions
    from numattn.core.jit import cuda_source
    from numattn.core.masks import mask_functions

    from . import internals

    mask = CausalMask() & FunctionMask(same_document, _doc_ids(rng, 2, 9))
    bound = bind_functions(mask_functions(mask), softcap(30.0), np.dtype(np.float32), "cpu")
    functions = numba.typeof(kernel_functions(bound, np.zeros(2, np.int64)))
    plain = no_functions_type()
    from numba import types
    from numba.cuda import compile_ptx

    ft, idx1, idx2 = types.float32, types.int64[::1], types.int64[:, ::1]
    kv = types.float32[:, :, ::1]
    flash = (ft[:, :, ::1], idx1, idx1, idx1, idx1, kv, kv, types.int64, idx2, idx1, idx1,
             types.float32[:, ::1], types.float32[:, ::1], types.int64, types.boolean, idx2,
             functions, ft[:, :, :, ::1], types.boolean, ft, ft[::1], types.boolean,
             types.int64, types.int64, types.int64, types.int64, ft[:, :, ::1], ft[:, ::1],
             types.boolean)
    kv4 = types.float32[:, :, :, ::1]
    decode = (ft[:, :, ::1], kv4, kv4, types.int64, idx2, idx1, idx1, types.float32[:, :, ::1],
              types.float32[:, :, ::1], types.int64, types.boolean, idx2, functions,
              ft[:, :, :, ::1], types.boolean, ft, types.int64, types.int64, types.int64,
              ft[:, :, ::1], ft[:, :, ::1], ft[:, :, :, ::1])
    assert plain != functions
    for kernel, signature in ((internals.flash_cuda_kernel, flash),
                              (internals.decode_partitions_cuda, decode)):
        ptx, _ = compile_ptx(cuda_source(kernel, bound.special), signature, cc=(9, 0))
        assert ".target sm_90" in ptx
