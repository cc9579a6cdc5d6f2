"""Plans (DecodePlan, FlashPlan): each layer's run gives the plain call's bits, for every
cache kind, mask, sinks and LSE; K/V that are not what the plan was made for are refused
before anything is written."""

from __future__ import annotations

import numpy as np
import pytest

import numattn
from numattn import (
    CausalMask,
    ContinuousBatchingKVCache,
    DecodePlan,
    FlashPlan,
    MaterializedMask,
    MHAConfig,
    NullMask,
    PagedKVCache,
    SlidingWindowCausalMask,
    reference,
)
from numattn.core.kv_cache import KVCache

from .conftest import requires_cuda
from .utils import CACHE_KINDS, assert_close, make_kv, randn

DTYPES = [np.float32, np.float64]
SMALL = MHAConfig(block_q=8, block_k=4)  # several tiles (and partitions) on small caches


def other_layer(rng, k, v):
    """K and V of another layer of the same step: fresh values in the same storage layout
    (NaN where the first layer's unused slots hold NaN), the same tables."""
    def fresh(x):
        blocks = x.blocks if isinstance(x, KVCache) else x
        values = np.where(np.isnan(blocks), np.nan, randn(rng, blocks.shape, blocks.dtype))
        if isinstance(x, KVCache):
            return type(x)(values, x.cache_lengths, x.lookup_table)
        return values

    return fresh(k), fresh(v)


def layers(rng, k, v, count=3):
    return [(k, v)] + [other_layer(rng, k, v) for _ in range(count - 1)]


def counted_calls(monkeypatch, module, name):
    """A list that grows by the arguments of each call of ``module.name`` from now on."""
    calls = []
    original = getattr(module, name)

    def counted(*args):
        calls.append(args)
        return original(*args)

    monkeypatch.setattr(module, name, counted)
    return calls


def assert_same(got, want):
    """Bitwise the same results (out, or (out, lse))."""
    if isinstance(want, tuple):
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
    else:
        np.testing.assert_array_equal(got, want)


def decode_masks(batch, num_heads, num_keys, dtype, rng):
    bias = randn(rng, (batch, num_heads, 1, num_keys), dtype)
    bias[..., ::3] = -np.inf
    return [NullMask(), CausalMask(), SlidingWindowCausalMask(5), MaterializedMask(bias),
            MaterializedMask(bias[:, 0]) & SlidingWindowCausalMask(9), bias[0, 0]]


# --------------------------------------------------------------------------------------
# DecodePlan
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", CACHE_KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_plan_runs_give_the_plain_calls_bits(kind, dtype, rng):
    lengths = [11, 11, 11] if kind == "dense" else [0, 7, 16]
    k, v = make_kv(rng, kind, lengths, [1] * 3, 2, 8, dtype, page_size=4)
    steps = layers(rng, k, v)
    num_keys = max(lengths) + 1
    sinks = randn(rng, (6,), dtype)
    for mask in decode_masks(3, 6, num_keys, dtype, rng):
        for parts in (None, 3):
            plan = DecodePlan(k, v, mask, num_partitions=parts, config=SMALL)
            for layer_k, layer_v in steps:
                q = randn(rng, (3, 6, 8), dtype)
                kwargs = dict(sink_weights=sinks, return_lse=True, scale=0.3)
                got = plan.run(q, layer_k, layer_v, **kwargs)
                want = numattn.decode_attention(q, layer_k, layer_v, mask, num_partitions=parts,
                                                config=SMALL, **kwargs)
                assert_same(got, want)
                ref = reference.decode_attention(q, layer_k, layer_v, mask, **kwargs)
                assert_close(got[0], ref[0], dtype)
                assert_close(got[1], ref[1], dtype, what="lse")


def test_decode_plan_on_the_worker_threads_and_with_out(rng, monkeypatch):
    """A plan made for the worker threads (split-K partitions on every thread) gives the
    plain call's bits; out= is written and returned, also when it is q."""
    from numattn.kernels.cpu import split_k

    monkeypatch.setattr(split_k, "SERIAL_KV_BYTES", 0)
    monkeypatch.setattr(split_k, "SERIAL_REDUCE_ELEMENTS", 0)
    k, v = make_kv(rng, "paged", [300, 41, 0, 129], [1] * 4, 2, 16, np.float32, page_size=8)
    plan = DecodePlan(k, v, CausalMask(), config=SMALL)
    for layer_k, layer_v in layers(rng, k, v):
        q = randn(rng, (4, 8, 16), np.float32)
        want = numattn.decode_attention(q, layer_k, layer_v, CausalMask(), config=SMALL)
        out = np.full_like(q, 7.0)
        assert plan.run(q, layer_k, layer_v, out=out) is out
        np.testing.assert_array_equal(out, want)
        in_place = q.copy()
        plan.run(in_place, layer_k, layer_v, out=in_place)
        np.testing.assert_array_equal(in_place, want)
        assert_close(want, reference.decode_attention(q, layer_k, layer_v, CausalMask()),
                     np.float32)


def test_decode_plan_takes_equal_tables_and_arrays_of_other_flags(rng):
    """Tables equal to the plan's (not the same objects) are accepted; queries and sinks
    that are read-only, and pages that are views of a fused K/V pool, get the plain call's
    bits too."""
    k, v = make_kv(rng, "paged", [5, 9], [1, 1], 2, 8, np.float32, page_size=4)
    plan = DecodePlan(k, v, CausalMask())
    copies = PagedKVCache(k.blocks, k.cache_lengths.copy(), k.lookup_table.copy())
    q = randn(rng, (2, 4, 8), np.float32)
    sinks = randn(rng, (4,), np.float32)
    frozen_q, frozen_sinks = q.copy(), sinks.copy()
    frozen_q.flags.writeable = frozen_sinks.flags.writeable = False
    for query, layer_k, sink in [(q, k, sinks), (q, copies, sinks), (frozen_q, k, frozen_sinks),
                                 (q, k, None), (frozen_q, k, sinks)]:
        got = plan.run(query, layer_k, v, sink_weights=sink)
        want = numattn.decode_attention(query, layer_k, v, CausalMask(), sink_weights=sink)
        np.testing.assert_array_equal(got, want)
    # a fused pool [pages, 2, page_size, Hkv, D]: K and V are views with a page stride of 2
    pool = np.stack([k.blocks, v.blocks], axis=1)
    fused_k = PagedKVCache(pool[:, 0], k.cache_lengths, k.lookup_table)
    fused_v = PagedKVCache(pool[:, 1], k.cache_lengths, k.lookup_table)
    fused_plan = DecodePlan(fused_k, fused_v, CausalMask())
    got = fused_plan.run(q, fused_k, fused_v)
    np.testing.assert_array_equal(got, numattn.decode_attention(q, fused_k, fused_v,
                                                                CausalMask()))
    assert_close(got, reference.decode_attention(q, k, v, CausalMask()), np.float32)
    with pytest.raises(ValueError, match="page stride"):  # contiguous pages: another layout
        fused_plan.run(q, k, v)


def test_decode_plan_computes_the_step_it_was_made_for(rng):
    """A plan does not notice tables changed in place after it was made: it keeps computing
    the planned step (and reads inside the pages)."""
    k, v = make_kv(rng, "paged", [5, 9], [1, 1], 2, 8, np.float64, page_size=4)
    q = randn(rng, (2, 4, 8), np.float64)
    plan = DecodePlan(k, v)
    want = numattn.decode_attention(q, k, v)
    k.cache_lengths[:] = [1, 2]  # shared by v
    np.testing.assert_array_equal(plan.run(q, k, v), want)


def _decode_misuse(rng):
    """(change to the run's arguments, error, message) for a plan made of paged caches."""
    k, v = make_kv(rng, "paged", [5, 9], [1, 1], 2, 8, np.float32, page_size=4)
    q = randn(rng, (2, 4, 8), np.float32)
    lengths, table = k.cache_lengths, k.lookup_table
    longer = PagedKVCache(k.blocks, lengths + 1, table)
    moved = table.copy()
    moved[0, 0] = table[1, 0]
    continuous = ContinuousBatchingKVCache(k.blocks[:, :4].copy(), lengths, table[:, 0])
    cases = [
        ({"k": longer, "v": PagedKVCache(v.blocks, lengths + 1, table)}, ValueError,
         "cache_lengths differs from the plan's"),
        ({"v": PagedKVCache(v.blocks, lengths, moved)}, ValueError,
         "v.lookup_table differs from the plan's"),
        ({"k": PagedKVCache(k.blocks[:-1], lengths, table)}, ValueError,
         "k.blocks must have the plan's shape"),
        ({"k": PagedKVCache(k.blocks.astype(np.float64), lengths, table)}, ValueError,
         "dtype float32"),
        ({"k": continuous}, ValueError, "k must be a PagedKVCache"),
        ({"v": v.blocks}, ValueError, "v must be a PagedKVCache"),
        ({"q": q[:1]}, ValueError, "B = 2 rows"),
        ({"q": q.astype(np.float64)}, TypeError, "plan's q_dtype float32"),
        ({"q": q[:, :3]}, ValueError, "multiple of the number of key/value heads"),
        ({"q": q[:, :, :6].copy()}, ValueError, "head dimension"),
        ({"q": q[:, None]}, ValueError, "q must be 3-d"),
        ({"scale": float("nan")}, ValueError, "scale must be finite"),
        ({"sink_weights": np.zeros(3, np.float32)}, ValueError, "sink_weights"),
        ({"return_lse": "yes"}, TypeError, "return_lse"),
        ({"out": np.zeros((2, 4, 7), np.float32)}, ValueError, "out must have shape"),
    ]
    return k, v, q, cases


def test_decode_plan_refuses_what_it_was_not_made_for_and_writes_nothing(rng):
    k, v, q, cases = _decode_misuse(rng)
    plan = DecodePlan(k, v, CausalMask())
    for change, error, match in cases:
        args = {"q": q, "k": k, "v": v, **change}
        out = np.full((2, 4, 8), 3.0, np.float32)
        kwargs = {key: args.pop(key) for key in ("scale", "sink_weights", "return_lse", "out")
                  if key in args}
        kwargs.setdefault("out", out)
        with pytest.raises(error, match=match):
            plan.run(args["q"], args["k"], args["v"], **kwargs)
        assert np.all(out == 3.0), change.keys()
    # the plan is still good
    np.testing.assert_array_equal(plan.run(q, k, v), numattn.decode_attention(q, k, v,
                                                                              CausalMask()))


def test_decode_plan_checks_a_per_head_additive_mask_per_layer(rng):
    k, v = make_kv(rng, "continuous", [4, 6], [1, 1], 2, 8, np.float32)
    bias = randn(rng, (2, 4, 1, 7), np.float32)
    plan = DecodePlan(k, v, bias)
    q = randn(rng, (2, 4, 8), np.float32)
    np.testing.assert_array_equal(plan.run(q, k, v), numattn.decode_attention(q, k, v, bias))
    with pytest.raises(ValueError, match="H = 6"):
        plan.run(randn(rng, (2, 6, 8), np.float32), k, v)


def test_decode_plan_refuses_what_decode_refuses(rng):
    k, v = make_kv(rng, "paged", [3, 4], [1, 1], 2, 8, np.float32, page_size=4)
    with pytest.raises(ValueError, match="num_partitions must be an integer >= 1"):
        DecodePlan(k, v, num_partitions=0)
    with pytest.raises(ValueError, match="device must be"):
        DecodePlan(k, v, device="gpu")
    with pytest.raises(TypeError, match="config must be an MHAConfig"):
        DecodePlan(k, v, config={"block_k": 4})
    with pytest.raises(ValueError, match="must cover"):
        DecodePlan(k, v, np.zeros((1, 3), np.float32))
    with pytest.raises(ValueError, match="sequence 1 needs 41 tokens"):
        too_long = PagedKVCache(k.blocks, np.array([3, 40]), k.lookup_table)
        DecodePlan(too_long, too_long)
    with pytest.raises(ValueError, match="k must be 4-d"):
        DecodePlan(k.blocks[:, 0], v.blocks[:, 0])


# --------------------------------------------------------------------------------------
# FlashPlan
# --------------------------------------------------------------------------------------
def flash_step(rng, kind, dtype, q_lens=(3, 0, 6), cache_lens=(4, 2, 9), kv_lens=None):
    """Ragged queries' offsets, K/V of one layer (caches holding the new rows, or the rows
    themselves) and the K/V offsets to pass."""
    offsets = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    kv_lens = q_lens if kv_lens is None else kv_lens
    kv_offsets = None if kv_lens is q_lens else np.concatenate([[0], np.cumsum(kv_lens)])
    if kind == "rows":
        rows = int(np.sum(kv_lens))
        k, v = randn(rng, (rows, 2, 8), dtype), randn(rng, (rows, 2, 8), dtype)
    else:
        k, v = make_kv(rng, kind, cache_lens, kv_lens, 2, 8, dtype, page_size=4)
    return offsets, kv_offsets, k, v


@pytest.mark.parametrize("kind", ["paged", "continuous", "rows"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_flash_plan_runs_give_the_plain_calls_bits(kind, dtype, rng, both_cpu_paths):
    offsets, kv_offsets, k, v = flash_step(rng, kind, dtype)
    bias = randn(rng, (3, 6, 6, 16), dtype)
    bias[..., ::4] = -np.inf
    sinks = randn(rng, (6,), dtype)
    for mask in [CausalMask(), SlidingWindowCausalMask(3), MaterializedMask(bias), None]:
        plan = FlashPlan(k, v, mask, q_input_row_offsets=offsets,
                         kv_input_row_offsets=kv_offsets, config=SMALL)
        for layer_k, layer_v in layers(rng, k, v):
            q = randn(rng, (offsets[-1], 6, 8), dtype)
            kwargs = dict(q_input_row_offsets=offsets, kv_input_row_offsets=kv_offsets)
            got = plan.run(q, layer_k, layer_v, sink_weights=sinks, return_lse=True)
            want = numattn.flash_attention_kv_cache(q, layer_k, layer_v, mask, config=SMALL,
                                                    sink_weights=sinks, return_lse=True,
                                                    **kwargs)
            assert_same(got, want)
            ref = reference.flash_attention_kv_cache(q, layer_k, layer_v, mask,
                                                     sink_weights=sinks, return_lse=True,
                                                     **kwargs)
            assert_close(got[0], ref[0], dtype)
            assert_close(got[1], ref[1], dtype, what="lse")


def test_flash_plan_with_new_rows_apart_from_the_queries_and_out(rng, monkeypatch):
    """K/V offsets of their own, out= (also q itself), and the worker threads."""
    from numattn.kernels.cpu import flash

    monkeypatch.setattr(flash, "SERIAL_MULTIPLY_ADDS", 0)
    offsets, kv_offsets, k, v = flash_step(rng, "paged", np.float32, q_lens=(2, 5),
                                           cache_lens=(3, 1), kv_lens=(4, 5))
    plan = FlashPlan(k, v, CausalMask(), q_input_row_offsets=offsets,
                     kv_input_row_offsets=kv_offsets, config=SMALL)
    for layer_k, layer_v in layers(rng, k, v):
        q = randn(rng, (7, 4, 8), np.float32)
        want = numattn.flash_attention_kv_cache(q, layer_k, layer_v, CausalMask(),
                                                q_input_row_offsets=offsets,
                                                kv_input_row_offsets=kv_offsets, config=SMALL)
        out = np.full_like(q, 5.0)
        assert plan.run(q, layer_k, layer_v, out=out) is out
        np.testing.assert_array_equal(out, want)
        plan.run(q, layer_k, layer_v, out=q)
        np.testing.assert_array_equal(q, want)


def test_flash_plan_refuses_what_it_was_not_made_for_and_writes_nothing(rng):
    offsets, _, k, v = flash_step(rng, "paged", np.float32)
    plan = FlashPlan(k, v, CausalMask(), q_input_row_offsets=offsets)
    q = randn(rng, (9, 4, 8), np.float32)
    other = PagedKVCache(k.blocks, k.cache_lengths + 1, k.lookup_table)
    cases = [
        ((q, other, PagedKVCache(v.blocks, other.cache_lengths, k.lookup_table)), ValueError,
         "cache_lengths differs"),
        ((q[:8], k, v), ValueError, "T = 9 rows"),
        ((q.astype(np.float64), k, v), TypeError, "plan's q_dtype float32"),
        ((q, k, PagedKVCache(v.blocks[:, :2].copy(), k.cache_lengths, k.lookup_table)),
         ValueError, "v.blocks must have the plan's shape"),
        ((q, k, v, {"out": k.blocks.reshape(-1)[:q.size].reshape(q.shape)}), ValueError,
         "out must not overlap k"),
        ((q, k, v, {"out": q[::-1]}), ValueError, "C-contiguous"),
    ]
    for args, error, match in cases:
        kwargs = args[3] if len(args) > 3 else {"out": np.full_like(q, 3.0)}
        before = {key: value.copy() for key, value in kwargs.items()}
        with pytest.raises(error, match=match):
            plan.run(*args[:3], **kwargs)
        for key, value in kwargs.items():
            np.testing.assert_array_equal(value, before[key])
    with pytest.raises(ValueError, match="q_input_row_offsets"):
        FlashPlan(k, v, CausalMask(), q_input_row_offsets=[0, 3, 2])
    with pytest.raises(TypeError, match="mask"):
        FlashPlan(k, v, "causal", q_input_row_offsets=offsets)


# --------------------------------------------------------------------------------------
# The kernels' structured arguments
# --------------------------------------------------------------------------------------
def test_kernels_take_plain_tuples(rng):
    """The structured arguments reach the kernels as plain tuples (Numba types those in C
    at each call, a NamedTuple in Python), so every kernel has tuple signatures only."""
    from numattn.core.jit import cpu_jit
    from numattn.kernels.cpu.flash import _flash_kernel
    from numattn.kernels.cpu.split_k import _decode_partitions_cpu

    k, v = make_kv(rng, "paged", [5, 9], [1, 1], 2, 8, np.float32, page_size=4)
    numattn.decode_attention(randn(rng, (2, 4, 8), np.float32), k, v)
    q = randn(rng, (2, 40, 4, 8), np.float32)
    kv = randn(rng, (2, 40, 2, 8), np.float32)
    numattn.flash_attention_kv_cache(q, kv, kv, CausalMask())
    for kernel in (_decode_partitions_cpu, _flash_kernel):
        signatures = [str(s) for s in cpu_jit(kernel).signatures]
        assert signatures and not any("NamedTuple" in s for s in signatures), signatures


@requires_cuda
def test_decode_plan_on_cuda_gives_the_plain_calls_bits(rng):
    tiny = MHAConfig(block_k=4, threads_per_block=32)
    k, v = make_kv(rng, "paged", [5, 2], [1, 1], 1, 3, np.float32, page_size=3)
    plan = DecodePlan(k, v, CausalMask(), num_partitions=2, device="cuda", config=tiny)
    q = randn(rng, (2, 2, 3), np.float32)
    got = plan.run(q, k, v, return_lse=True)
    want = numattn.decode_attention(q, k, v, CausalMask(), num_partitions=2, device="cuda",
                                    config=tiny, return_lse=True)
    assert_same(got, want)
    assert_close(got[0], reference.decode_attention(q, k, v, CausalMask()), np.float32)


@requires_cuda
def test_decode_plan_on_cuda_copies_the_step_tables_once(rng, monkeypatch):
    """The tables and the mask program go to the device at the plan's first CUDA run and
    serve every layer after it; each layer still gives the plain call's bits."""
    from numattn.kernels.cuda import split_k

    copies = counted_calls(monkeypatch, split_k, "step_tables_to_device")
    tiny = MHAConfig(block_k=4, threads_per_block=32)
    k, v = make_kv(rng, "paged", [6, 3], [1, 1], 1, 4, np.float32, page_size=3)
    mask = SlidingWindowCausalMask(3)
    plan = DecodePlan(k, v, mask, num_partitions=2, device="cuda", config=tiny)
    for layer in range(3):
        k_layer, v_layer = (k, v) if layer == 0 else other_layer(rng, k, v)
        q = randn(rng, (2, 4, 4), np.float32)
        before = len(copies)
        got = plan.run(q, k_layer, v_layer)
        assert len(copies) == before + (layer == 0)  # copied at the first run only
        want = numattn.decode_attention(q, k_layer, v_layer, mask, num_partitions=2,
                                        device="cuda", config=tiny)
        assert_same(got, want)
    assert len(copies) == 4  # the plan's copy and one per plain call


@requires_cuda
@pytest.mark.parametrize("on_device", [False, True])
def test_flash_plan_on_cuda_copies_the_step_tables_once(rng, monkeypatch, on_device):
    """A FlashPlan on CUDA (asked for, or for device arrays under "auto") gives the plain
    call's bits for every layer; the step's tables go to the device at its first run only."""
    from numattn.kernels.cuda import flash

    cuda = pytest.importorskip("numba.cuda")
    copies = counted_calls(monkeypatch, flash, "flash_tables_to_device")
    tiny = MHAConfig(block_q=2, block_k=4, threads_per_block=32)
    offsets = np.array([0, 3, 4, 7])
    k, v = make_kv(rng, "paged", [5, 0, 6], [3, 1, 3], 1, 4, np.float32, page_size=3)
    sinks = randn(rng, 2, np.float32)
    mask = SlidingWindowCausalMask(4)
    plan = FlashPlan(k, v, mask, q_input_row_offsets=offsets, config=tiny,
                     device="auto" if on_device else "cuda")
    for layer in range(3):
        k_layer, v_layer = (k, v) if layer == 0 else other_layer(rng, k, v)
        q = randn(rng, (7, 2, 4), np.float32)
        if on_device:
            k_layer, v_layer = (type(x)(cuda.to_device(x.blocks), x.cache_lengths,
                                        x.lookup_table) for x in (k_layer, v_layer))
        before = len(copies)
        got = plan.run(cuda.to_device(q) if on_device else q, k_layer, v_layer,
                       sink_weights=sinks, return_lse=True)
        assert len(copies) == before + (layer == 0)  # copied at the first run only
        if on_device:
            got = tuple(x.copy_to_host() for x in got)
        want = numattn.flash_attention_kv_cache(q, k_layer, v_layer, mask,
                                                q_input_row_offsets=offsets,
                                                sink_weights=sinks, device="cuda",
                                                config=tiny, return_lse=True)
        assert_same(got, want)
        assert_close(got[0], reference.flash_attention_kv_cache(
            q, k_layer, v_layer, mask, q_input_row_offsets=offsets, sink_weights=sinks),
            np.float32)


def test_flash_plan_refuses_a_stream_on_the_cpu(rng):
    k, v = make_kv(rng, "paged", [5], [2], 1, 4, np.float32, page_size=3)
    plan = FlashPlan(k, v, CausalMask(), q_input_row_offsets=np.array([0, 2]))
    with pytest.raises(ValueError, match="this call runs on the CPU"):
        plan.run(randn(rng, (2, 2, 4), np.float32), k, v, stream=object())


@requires_cuda
def test_decode_plan_takes_tables_held_on_the_device(rng):
    """Cache lengths and page tables that are device arrays are read back once, when the
    plan is made, and give the host tables' results."""
    cuda = pytest.importorskip("numba.cuda")
    k, v = make_kv(rng, "paged", [5, 2], [1, 1], 1, 8, np.float32, page_size=4)
    on_device = [type(x)(cuda.to_device(x.blocks), cuda.to_device(x.cache_lengths),
                         cuda.to_device(x.lookup_table)) for x in (k, v)]
    on_device[1] = type(v)(on_device[1].blocks, on_device[0].cache_lengths,
                           on_device[0].lookup_table)  # K and V share the step's tables
    q = randn(rng, (2, 2, 8), np.float32)
    plan = numattn.DecodePlan(*on_device, CausalMask())
    got = plan.run(cuda.to_device(q), *on_device).copy_to_host()
    assert_close(got, reference.decode_attention(q, k, v, CausalMask()), np.float32)
    plain = numattn.decode_attention(cuda.to_device(q), *on_device, CausalMask())
    assert_same(got, plain.copy_to_host())
