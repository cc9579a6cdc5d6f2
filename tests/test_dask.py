"""numattn.dask: attention over K/V sharded across Dask workers, against the single-process
operations and the float64 reference, on a cluster of worker processes and on Dask's
threaded scheduler."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest

da = pytest.importorskip("dask.array", reason="numattn.dask needs dask: pip install .[dask]")
distributed = pytest.importorskip("distributed",
                                  reason="numattn.dask's tests need distributed")

import ml_dtypes  # noqa: E402

import numattn  # noqa: E402
import numattn.core.dtypes  # noqa: E402
import numattn.dask as nd  # noqa: E402
from numattn import (  # noqa: E402
    CausalMask,
    ChunkedCausalMask,
    ChunkedMask,
    FunctionMask,
    MaterializedMask,
    NullMask,
    SlidingWindowCausalMask,
    reference,
)

from .utils import assert_close, randn  # noqa: E402

B, S, H, HKV, D, N = 3, 5, 4, 2, 8, 23
#: Uneven chunks: a batch chunk of 2 and of 1; a key chunk of 1 key, boundaries at 1, 8 and
#: 17 (inside the sliding windows and the chunks of the chunked masks below).
CHUNKS = ((2, 1), (1, 7, 9, 6), (HKV,), (D,))

MASKS = {
    "null": NullMask(),
    "causal": CausalMask(),
    "window": SlidingWindowCausalMask(4),
    "chunked": ChunkedMask(6),
    "chunked causal": ChunkedCausalMask(5),
    "and": CausalMask() & ChunkedMask(7),
    "or": SlidingWindowCausalMask(3) | ChunkedCausalMask(4),
}


@pytest.fixture(scope="module")
def client():
    """Two worker processes of one thread each (the kernels load from the on-disk cache
    that the single-process calls of each test fill first), without work stealing (which
    moves a task, and its K/V chunk, to an idle worker)."""
    import dask

    with dask.config.set({"distributed.scheduler.work-stealing": False}), \
            distributed.LocalCluster(processes=True, n_workers=2, threads_per_worker=1,
                                  dashboard_address=":0") as cluster, \
            distributed.Client(cluster) as c:
        yield c


def _sharded(rng, dtype, *, decode=False):
    q = randn(rng, (B, H, D) if decode else (B, S, H, D), dtype)
    k, v = randn(rng, (B, N, HKV, D), dtype), randn(rng, (B, N, HKV, D), dtype)
    return q, k, v, da.from_array(k, chunks=CHUNKS), da.from_array(v, chunks=CHUNKS)


def _compute(result, client):
    if client is None:
        return da.compute(*result, scheduler="threads")
    return client.compute(list(result), sync=True)


def _check(got, single, expected, dtype):
    """Equal to the single-process operation up to rounding, and to the reference."""
    for g, s, e, what in zip(got, single, expected, ("out", "lse")):
        assert_close(g, s.astype(np.float64), dtype, tol=1e-5 if dtype == np.float32 else 1e-12,
                     what=f"{what} vs one process")
        assert_close(g, e, dtype, what=f"{what} vs reference")


def _case(rng, mask_name, sinks, dtype=np.float32, *, decode=False):
    """The sharded operation's (lazy) result, the single-process one and the reference."""
    q, k, v, kd, vd = _sharded(rng, dtype, decode=decode)
    sink_weights = randn(rng, H, dtype) if sinks else None
    mask = MASKS[mask_name]
    name = "decode_attention" if decode else "flash_attention_kv_cache"
    single = getattr(numattn, name)(q, k, v, mask, sink_weights=sink_weights, return_lse=True)
    expected = getattr(reference, name)(q.astype(np.float64), k.astype(np.float64),
                                        v.astype(np.float64), mask, sink_weights=sink_weights,
                                        return_lse=True)
    result = getattr(nd, name)(q, kd, vd, mask, sink_weights=sink_weights, return_lse=True)
    assert all(isinstance(x, da.Array) for x in result)
    return result, single, expected


@pytest.mark.parametrize("sinks", [False, True], ids=["no sinks", "sinks"])
@pytest.mark.parametrize("mask_name", list(MASKS))
def test_flash_on_worker_processes(client, rng, mask_name, sinks):
    result, single, expected = _case(rng, mask_name, sinks)
    _check(_compute(result, client), single, expected, np.float32)


@pytest.mark.parametrize("sinks", [False, True], ids=["no sinks", "sinks"])
@pytest.mark.parametrize("mask_name", list(MASKS))
def test_decode_on_worker_processes(client, rng, mask_name, sinks):
    result, single, expected = _case(rng, mask_name, sinks, decode=True)
    _check(_compute(result, client), single, expected, np.float32)


def test_large_numpy_queries_go_straight_to_a_worker(client, rng):
    """NumPy queries of a megabyte or more are scattered to a worker (a future in the
    graph), not carried in the graph through the scheduler; the result is the same."""
    q = randn(rng, (1, 2048, 4, 32), np.float32)  # 1 MiB
    k, v = (randn(rng, (1, 40, 2, 32), np.float32) for _ in range(2))
    kd, vd = (da.from_array(x, chunks=(1, 20, 2, 32)) for x in (k, v))
    out = nd.flash_attention_kv_cache(q, kd, vd, CausalMask())
    assert distributed.futures_of(out), "q was not scattered"
    small = nd.flash_attention_kv_cache(q[:, :8], kd, vd, CausalMask())
    assert not distributed.futures_of(small)
    want = numattn.flash_attention_kv_cache(q, k, v, CausalMask())
    assert_close(client.compute(out, sync=True), want.astype(np.float64), tol=1e-5)


@pytest.mark.parametrize("operation", ["decode_attention", "flash_attention_kv_cache"])
def test_small_numpy_queries_go_into_the_tasks(rng, operation):
    """NumPy queries under the scatter threshold, and the chunks' positions, are part of
    the partial-state tasks: the graph holds K/V's layers, the partial states and the merge
    tree, and no task of the query's own (a decode step would run it on one worker and
    send it to the others)."""
    decode = operation == "decode_attention"
    q = randn(rng, (2, 4, 8) if decode else (2, 6, 4, 8), np.float32)
    k, v = (randn(rng, (2, 40, 2, 8), np.float32) for _ in range(2))
    kd, vd = (da.from_array(x, chunks=(1, 15, 2, 8)) for x in (k, v))
    sinks = randn(rng, 4, np.float32)
    out = getattr(nd, operation)(q, kd, vd, CausalMask(), sink_weights=sinks)
    layers = set(out.dask.layers) - {kd.name, vd.name}
    assert all(name.startswith((nd.PARTIAL_STATE_NAME, "keep_part", "_merge_parts",
                                "getitem")) for name in layers), layers
    want = getattr(numattn, operation)(q, k, v, CausalMask(), sink_weights=sinks)
    assert_close(out.compute(scheduler="threads"), want.astype(np.float64), tol=1e-5)


@pytest.mark.parametrize("mask_name", ["causal", "or"])
def test_threaded_scheduler(rng, mask_name):
    for decode in (False, True):
        result, single, expected = _case(rng, mask_name, True, decode=decode)
        _check(_compute(result, None), single, expected, np.float32)


@pytest.mark.slow
def test_float64(client, rng):
    for decode in (False, True):
        result, single, expected = _case(rng, "window", True, np.float64, decode=decode)
        got = _compute(result, client)
        assert got[0].dtype == np.float64 and got[1].dtype == np.float64
        _check(got, single, expected, np.float64)


@pytest.mark.parametrize("form", ["ndarray [S, N]", "dask [B, S, N]",
                                  "MaterializedMask [B, H, S, N] & causal"])
def test_additive_masks(client, rng, form):
    """Additive tensors, plain or Dask, cut per chunk like K/V (their columns past N unused)."""
    q, k, v, kd, vd = _sharded(rng, np.float32)
    shape = {"ndarray [S, N]": (S, N + 3), "dask [B, S, N]": (B, S, N),
             "MaterializedMask [B, H, S, N] & causal": (B, H, S, N)}[form]
    tensor = randn(rng, shape, np.float32)
    tensor[tensor < -1] = -np.inf
    if form.startswith("ndarray"):
        mask = given = tensor
    elif form.startswith("dask"):
        mask, given = tensor, da.from_array(tensor, chunks=(1, S, 11))
    else:
        mask = given = MaterializedMask(tensor) & CausalMask()
    single = numattn.flash_attention_kv_cache(q, k, v, mask, return_lse=True)
    expected = reference.flash_attention_kv_cache(
        q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
        mask.astype(np.float64) if isinstance(mask, np.ndarray) else
        MaterializedMask(tensor.astype(np.float64)) & CausalMask(), return_lse=True)
    got = _compute(nd.flash_attention_kv_cache(q, kd, vd, given, return_lse=True), client)
    _check(got, single, expected, np.float32)
    # decode: one query row
    qd = q[:, 0]
    row = tensor[..., :1, :] if tensor.ndim > 2 else tensor[:1]
    single = numattn.decode_attention(qd, k, v, row, return_lse=True)
    got = _compute(nd.decode_attention(qd, kd, vd, da.from_array(row), return_lse=True),
                   client)
    expected = reference.decode_attention(qd.astype(np.float64), k.astype(np.float64),
                                          v.astype(np.float64), row.astype(np.float64),
                                          return_lse=True)
    _check(got, single, expected, np.float32)


#: (q, K/V) dtype pairs of the storage dtypes (as numattn.core.dtypes names them), and the
#: tolerance of each output dtype (relative to 1 + |expected|) against the reference.
STORAGE_PAIRS = [("bfloat16", "bfloat16"), ("float16", "float16"),
                 ("float32", "float8_e4m3fn"), ("bfloat16", "float8_e5m2"),
                 pytest.param("float64", "bfloat16", marks=pytest.mark.slow)]
OUT_TOL = {"float64": 2e-4, "float32": 2e-4, "float16": 2e-3, "bfloat16": 1.6e-2}


@pytest.mark.parametrize("q_name, kv_name", STORAGE_PAIRS)
def test_storage_dtypes_on_worker_processes(client, rng, q_name, kv_name):
    """16-bit queries and 16- or 8-bit K/V, read in their stored type by the tasks: partial
    states in float32, the merged result rounded to q's dtype once, as one process rounds
    it (at most one unit in the last place apart), the LSE float32; with a window mask, an
    additive tensor of q's dtype and sinks."""
    q_dtype, kv_dtype = (np.dtype(getattr(ml_dtypes, n, n)) for n in (q_name, kv_name))
    q = randn(rng, (B, S, H, D), q_dtype)
    k, v = randn(rng, (B, N, HKV, D), kv_dtype), randn(rng, (B, N, HKV, D), kv_dtype)
    kd, vd = da.from_array(k, chunks=CHUNKS), da.from_array(v, chunks=CHUNKS)
    tensor = randn(rng, (S, N), q_dtype)
    sinks = randn(rng, H, q_dtype)
    wide = [x.astype(np.float64) for x in (q, k, v, tensor, sinks)]
    for decode in (False, True):
        name = "decode_attention" if decode else "flash_attention_kv_cache"
        qs, rows, wq, wrows = ((q[:, 0], tensor[:1], wide[0][:, 0], wide[3][:1]) if decode
                               else (q, tensor, wide[0], wide[3]))
        mask = SlidingWindowCausalMask(4) & MaterializedMask(rows)
        single = getattr(numattn, name)(qs, k, v, mask, sink_weights=sinks, return_lse=True)
        got = _compute(getattr(nd, name)(qs, kd, vd, mask, sink_weights=sinks,
                                         return_lse=True), client)
        expected = getattr(reference, name)(
            wq, wide[1], wide[2], SlidingWindowCausalMask(4) & MaterializedMask(wrows),
            sink_weights=wide[4], return_lse=True)
        assert got[0].dtype == single[0].dtype == q_dtype
        assert got[1].dtype == single[1].dtype == numattn.core.dtypes.lse_dtype(q_dtype)
        ulp = {"bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}.get(q_name, 1e-5)
        assert_close(got[0], single[0].astype(np.float64), tol=ulp, what="out vs one process")
        assert_close(got[1], single[1].astype(np.float64), tol=1e-5, what="lse vs one process")
        assert_close(got[0], expected[0], tol=OUT_TOL[q_name], what="out vs reference")
        assert_close(got[1], expected[1], tol=OUT_TOL["float32"], what="lse vs reference")


def test_gqa_groups_and_queries_chunked_along_s_and_h(rng):
    """H = 8 query heads over Hkv = 2 (groups of 4); q given chunked along S keeps its
    pieces (each attends every key chunk at its own positions) and is rechunked whole
    along H, with K/V's batch chunks."""
    q = randn(rng, (B, S, 8, D), np.float32)
    k, v = randn(rng, (B, N, HKV, D), np.float32), randn(rng, (B, N, HKV, D), np.float32)
    qd = da.from_array(q, chunks=(1, 2, 3, D))
    mask = SlidingWindowCausalMask(6)
    out = nd.flash_attention_kv_cache(qd, da.from_array(k, chunks=CHUNKS),
                                      da.from_array(v, chunks=CHUNKS), mask)
    assert out.chunks[:3] == (CHUNKS[0], (2, 2, 1), (8,))
    got = out.compute(scheduler="threads")
    assert_close(got, numattn.flash_attention_kv_cache(q, k, v, mask).astype(np.float64),
                 tol=1e-5)
    assert_close(got, reference.flash_attention_kv_cache(
        q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), mask))


def test_empty_key_chunks_and_sinks_counted_once(rng):
    """A key chunk of no keys gives nothing (and the sink still counts once, though the
    first chunk is empty); a single chunk is the single-process operation itself."""
    q, k, v, _, _ = _sharded(rng, np.float32, decode=True)
    sinks = randn(rng, H, np.float32)
    expected = numattn.decode_attention(q, k, v, CausalMask(), sink_weights=sinks,
                                        return_lse=True)
    for chunks in [((B,), (0, 5, 0, 18), (HKV,), (D,)), ((B,), (N,), (HKV,), (D,))]:
        kd, vd = da.from_array(k, chunks=chunks), da.from_array(v, chunks=chunks)
        got = _compute(nd.decode_attention(q, kd, vd, CausalMask(), sink_weights=sinks,
                                           return_lse=True), None)
        for g, e in zip(got, expected):
            assert_close(g, e.astype(np.float64), tol=1e-5)


def test_merges_form_a_tree_of_pairs(rng):
    """The partial states of J key chunks are merged two at a time: ceil(log2 J) levels."""
    q, k, v, _, _ = _sharded(rng, np.float32, decode=True)
    for parts in (1, 2, 5, 8, 23):
        chunks = ((B,), tuple(np.diff(np.linspace(0, N, parts + 1).astype(int))), (HKV,),
                  (D,))
        out = nd.decode_attention(q, da.from_array(k, chunks=chunks),
                                  da.from_array(v, chunks=chunks))
        merges = [name for name in out.dask.layers if name.startswith("_merge_parts")]
        assert len(merges) == max(1, math.ceil(math.log2(parts))), (parts, merges)
        assert_close(out.compute(scheduler="threads"),
                     numattn.decode_attention(q, k, v).astype(np.float64), tol=1e-5)


@pytest.mark.filterwarnings("ignore:Sending large graph:UserWarning")  # 16 MiB of K/V, once
@pytest.mark.parametrize("operation", ["decode_attention", "flash_attention_kv_cache"])
def test_kv_chunks_stay_where_they_live(client, rng, operation):
    """With K/V persisted on the workers, every task runs where its chunk lives: a step
    moves partial states and queries, not the cache.  Without the placement plugin, Dask's
    scheduler fetched up to half of these chunks to balance the workers' load."""
    heads, kv_heads, head_dim = 16, 8, 64
    decode = operation == "decode_attention"
    q = randn(rng, (2, heads, head_dim) if decode else (2, 256, heads, head_dim), np.float32)
    k, v = (randn(rng, (2, 2048, kv_heads, head_dim), np.float32) for _ in range(2))
    chunks = (1, 128, kv_heads, head_dim)  # 256 KiB chunks, 16 per sequence
    # chunk (b, n) of K and of V on one worker, as a cache sharded by sequence and position
    # would be (persisted apart, they could land on different workers, and a task would
    # fetch one of them)
    workers = sorted(client.scheduler_info()["workers"])[:2]

    def placed(x):
        import dask

        with dask.annotate(workers=lambda key: [workers[(key[1] + key[2]) % 2]],
                           allow_other_workers=False):
            return da.from_array(x, chunks=chunks)

    kd, vd = client.persist([placed(k), placed(v)], optimize_graph=False)
    distributed.wait([kd, vd])
    names = {kd.name, vd.name}

    def received(dask_worker, names=names):
        return sum(size for entry in dask_worker.transfer_incoming_log
                   for key, size in entry["keys"].items() if key[0] in names)

    single = getattr(numattn, operation)(q, k, v, CausalMask())
    for _ in range(3):  # the first call loads the kernels, the later ones know their times
        before = sum(client.run(received).values())
        got = getattr(nd, operation)(q, kd, vd, CausalMask()).compute()
        assert sum(client.run(received).values()) == before
        assert_close(got, single.astype(np.float64), tol=1e-5)


def test_placement_that_cannot_be_installed_warns_once(rng, monkeypatch):
    """A scheduler that cannot load the placement plugin (numattn not installed there)
    gets a warning naming the cause, once per client, and the graph is still built."""

    class Client:
        id = "client without a placement"

        def register_plugin(self, plugin, name):
            raise ModuleNotFoundError("No module named 'numattn'")

    monkeypatch.setattr(nd, "_default_client", lambda: Client())
    monkeypatch.setattr(nd, "_PLACED_CLIENTS", set())
    q, _, _, kd, vd = _sharded(rng, np.float32, decode=True)
    with pytest.warns(RuntimeWarning, match="No module named 'numattn'.*install numattn "
                                            "where the scheduler runs"):
        nd.decode_attention(q, kd, vd)
    out = nd.decode_attention(q, kd, vd)  # no second warning (warnings are errors here)
    assert isinstance(out, da.Array)


# -- FunctionMask and score_mod ------------------------------------------------------------
def same_document(b, h, q_idx, kv_idx, documents):
    """Query and key in the same document of sequence ``b`` (``documents``: [B, N] ids)."""
    return documents[b, q_idx] == documents[b, kv_idx]


@pytest.mark.parametrize("score_mod_name", ["softcap", "alibi"])
def test_function_mask_and_score_mod_on_worker_processes(client, rng, score_mod_name):
    """A FunctionMask that reads its sequence's document ids by ``b`` (a batch chunk starting
    at b = 2 sees b = 2), with CausalMask, and a score modifier that reads the positions:
    the functions see global sequences and positions on every task, and travel to the
    worker processes (``same_document`` by reference to this module)."""
    q, k, v, kd, vd = _sharded(rng, np.float32)
    q *= 3  # scores of a few units, which a cap of 2 bends
    sinks = randn(rng, H, np.float32)
    # document boundaries inside the key chunks, and different in each sequence
    documents = np.sort(rng.integers(0, 4, (B, N)), axis=1)
    mask = CausalMask() & FunctionMask(same_document, documents)
    score_mod = {"softcap": lambda: numattn.softcap(2.0),
                 "alibi": lambda: numattn.alibi(randn(rng, H, np.float32) ** 2)}[
        score_mod_name]()
    f64 = [x.astype(np.float64) for x in (q, k, v)]
    for decode in (False, True):
        if decode:
            queries, expected_queries = q[:, -1], f64[0][:, -1]
            single_op, reference_op, sharded_op = (numattn.decode_attention,
                                                   reference.decode_attention,
                                                   nd.decode_attention)
        else:
            queries, expected_queries = q, f64[0]
            single_op, reference_op, sharded_op = (numattn.flash_attention_kv_cache,
                                                   reference.flash_attention_kv_cache,
                                                   nd.flash_attention_kv_cache)
        kwargs = dict(sink_weights=sinks, score_mod=score_mod, return_lse=True)
        single = single_op(queries, k, v, mask, **kwargs)
        expected = reference_op(expected_queries, *f64[1:], mask, **kwargs)
        got = _compute(sharded_op(queries, kd, vd, mask, **kwargs), client)
        _check(got, single, expected, np.float32)


def _kernel_bindings():
    """The kernels bound in this process (one per body, target and specialization)."""
    from numattn.core import jit

    return jit._cpu_jit.cache_info().currsize


def test_functions_sent_by_value_bind_the_kernels_once(client, rng):
    """A function that Dask sends by value (one defined inside a function, in ``__main__``
    or in a notebook) arrives as a new object with every graph: the workers bind the
    kernels for it once, not at every call."""
    def before_limit(b, h, q_idx, kv_idx, limits):
        return kv_idx < limits[b]

    q, k, v, kd, vd = _sharded(rng, np.float32, decode=True)
    mask = FunctionMask(before_limit, rng.integers(1, N, B))
    single = numattn.decode_attention(q, k, v, mask)
    bound = []
    for _ in range(3):
        got = nd.decode_attention(q, kd, vd, mask).compute()
        assert_close(got, single.astype(np.float64), tol=1e-5)
        bound.append(client.run(_kernel_bindings))
    assert bound[1] == bound[2], bound


def _plain_python(q_idx):
    return q_idx


def calls_plain_python(b, h, q_idx, kv_idx):
    """A mask function that Numba cannot compile: it calls a function it does not know."""
    return _plain_python(q_idx) >= kv_idx


# -- refusals, before any task runs ------------------------------------------------------
def _unreadable(shape, chunks, dtype=np.float32):
    """A Dask array whose blocks raise when computed: a call that refuses it before any
    task runs raises its own error instead."""
    def fail(block):
        raise RuntimeError("a task ran")

    return da.zeros(shape, chunks=chunks, dtype=dtype).map_blocks(fail, dtype=dtype)


@pytest.mark.parametrize("bad, match", [
    ("chunked along Hkv", "not along Hkv"),
    ("chunked along D", "not along D"),
    ("k and v chunked apart", "same chunks"),
    ("dtype", "dtype"),
    ("int8", "int8 k and v need scales"),
    ("B", "B = "),
    ("D", "head dimension"),
    ("heads", "query heads"),
    ("cache object", "dask.array"),
    ("additive rows", "S = "),
    ("sinks", "sink_weights"),
    ("score_mod", "score_mod must be a numattn.ScoreMod"),
    ("mask function", "FunctionMask function calls_plain_python cannot be compiled"),
    ("score_mod capture", "capture 0 must be a NumPy array or a number"),
])
def test_bad_input_refused_before_any_task(rng, bad, match):
    q = randn(rng, (B, S, H, D), np.float32)
    kv_chunks = {"chunked along Hkv": (1, 8, 1, D), "chunked along D": (1, 8, HKV, 4)}.get(
        bad, (1, 8, HKV, D))
    k = _unreadable((B, N, HKV, D), kv_chunks)
    v = _unreadable((B, N, HKV, D), (1, 4, HKV, D) if bad == "k and v chunked apart" else
                    kv_chunks)
    mask, sinks, score_mod = CausalMask(), None, None
    if bad == "dtype":
        v = _unreadable((B, N, HKV, D), kv_chunks, np.float64)
    elif bad == "int8":
        k = v = _unreadable((B, N, HKV, D), kv_chunks, np.int8)
    elif bad == "B":
        q = q[:2]
    elif bad == "D":
        q = q[..., :4]
    elif bad == "heads":
        q = randn(rng, (B, S, 3, D), np.float32)
    elif bad == "cache object":
        k = numattn.PagedKVCache(np.zeros((1, 4, HKV, D), np.float32), np.zeros(B, int),
                                 np.zeros((B, 1), int))
    elif bad == "additive rows":
        mask = _unreadable((S + 1, N), (2, 8))
    elif bad == "sinks":
        sinks = np.zeros(H + 1, np.float32)
    elif bad == "score_mod":
        score_mod = lambda score, b, h, q_idx, kv_idx: score  # noqa: E731
    elif bad == "mask function":
        mask = CausalMask() & FunctionMask(calls_plain_python)
    elif bad == "score_mod capture":
        score_mod = numattn.ScoreMod(same_document, [1, 2])
    with pytest.raises((ValueError, TypeError), match=match):
        nd.flash_attention_kv_cache(q, k, v, mask, sink_weights=sinks, score_mod=score_mod)


def test_decode_refuses_padded_queries(rng):
    k = _unreadable((B, N, HKV, D), (1, 8, HKV, D))
    with pytest.raises(ValueError, match=r"\[B, H, D\]"):
        nd.decode_attention(randn(rng, (B, S, H, D), np.float32), k, k)


def test_import_without_dask_says_how_to_install():
    """``import numattn`` does not import dask; ``import numattn.dask`` without dask says
    ``pip install .[dask]``."""
    code = ("import sys; import numattn; assert 'dask' not in sys.modules, 'dask imported'\n"
            "sys.modules['dask'] = None; sys.modules['dask.array'] = None\n"
            "try:\n    import numattn.dask\nexcept ImportError as e:\n    print(e)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, check=True)
    assert "pip install .[dask]" in result.stdout, result.stdout + result.stderr


def test_dask_demo_matches_one_process():
    """``numattn demo --dask``'s loop: every sharded decode call equals the single-process
    one, and a step moves a few partial states, not the cache."""
    from numattn.tools.demo import run_dask_demo

    result = run_dask_demo(batch=2, prompt_length=64, new_tokens=3, workers=2)
    assert result.generated.shape == (2, 3)
    assert 0 <= result.max_difference <= 1e-5
    assert len(result.worker_bytes) == 3 and max(result.worker_bytes[1:]) < result.held_bytes
    assert result.partial_bytes == 2 * 8 * (32 + 1) * 4
