"""``python -m numattn check``: every operation, on every backend here, against the reference.

Runs random problems covering masks, cache types, GQA, sinks, float32 and float64, and
bfloat16, float8 and int8 caches read as stored, through each operation on the CPU, and
through the CUDA kernels when a GPU or the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) is
present; compares each result with :mod:`numattn.reference` and prints a table.  Exit
status 1 on any failure.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from .. import reference
from ..core import device as _cuda
from ..core.dtypes import ml_dtype
from ..kv_cache import ContinuousBatchingKVCache, PagedKVCache
from ..masks import (
    CausalMask,
    ChunkedCausalMask,
    ChunkedMask,
    NullMask,
    SlidingWindowCausalMask,
)

__all__ = ["CheckResult", "run_checks"]

#: relative tolerance by the result's dtype
TOLERANCE = {"float32": 2e-4, "float64": 1e-9, "bfloat16": 1.6e-2}


@dataclass(frozen=True)
class CheckResult:
    """One row of the check table."""

    operation: str
    backend: str
    case: str
    max_error: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return bool(self.max_error <= self.tolerance)


def _error(got, expected):
    """Largest error relative to ``1 + |expected|``; mismatched NaN/inf patterns are inf."""
    got = np.asarray(got, dtype=np.float64)
    if got.shape != expected.shape:
        return float("inf")
    if not np.array_equal(np.isnan(got), np.isnan(expected)):
        return float("inf")
    inf = np.isinf(expected)
    if not np.array_equal(got[inf], expected[inf]):
        return float("inf")
    ok = np.isfinite(expected)
    if not ok.any():
        return 0.0
    return float(np.max(np.abs(got[ok] - expected[ok]) / (1 + np.abs(expected[ok]))))


def _paged(rng, lengths, hkv, d, dtype, page_size):
    """K and V paged caches holding ``lengths[b]`` tokens, pages shuffled, NaN elsewhere."""
    pages_per_seq = [-(-int(n) // page_size) for n in lengths]
    max_pages = max(pages_per_seq) + 1
    num_pages = sum(pages_per_seq) + 1
    order = rng.permutation(num_pages)
    table = np.full((len(lengths), max_pages), num_pages, dtype=np.int64)
    used = 0
    for b, n in enumerate(pages_per_seq):
        table[b, :n] = order[used : used + n]
        used += n
    shape = (num_pages, page_size, hkv, d)
    kb = np.full(shape, np.nan, dtype)
    vb = np.full(shape, np.nan, dtype)
    for b, n in enumerate(lengths):
        t = np.arange(n)
        kb[table[b, t // page_size], t % page_size] = rng.standard_normal((n, hkv, d))
        vb[table[b, t // page_size], t % page_size] = rng.standard_normal((n, hkv, d))
    return kb, vb, table


def _caches(rng, kind, cache_lengths, kv_lens, hkv, d, dtype, page_size=8):
    cache_lengths = np.asarray(cache_lengths, dtype=np.int64)
    total = cache_lengths + np.asarray(kv_lens)
    kb, vb, table = _paged(rng, total, hkv, d, dtype, page_size)
    if kind == "paged":
        return (PagedKVCache(kb, cache_lengths, table), PagedKVCache(vb, cache_lengths, table))
    # continuous: copy each sequence into its own block
    cap = int(total.max()) + 2
    kc = np.full((len(total) + 1, cap, hkv, d), np.nan, dtype)
    vc = np.full_like(kc, np.nan)
    blocks = rng.permutation(len(total) + 1)[: len(total)]
    for b, n in enumerate(total):
        t = np.arange(n)
        kc[blocks[b], :n] = kb[table[b, t // page_size], t % page_size]
        vc[blocks[b], :n] = vb[table[b, t // page_size], t % page_size]
    return (ContinuousBatchingKVCache(kc, cache_lengths, blocks),
            ContinuousBatchingKVCache(vc, cache_lengths, blocks))


def _stored_caches(k, v, name):
    """``k`` and ``v`` (float32 caches) stored as ``name``: rounded, or for int8 quantized
    with one scale per (slot, KV head); NaN in unused slots stays NaN (garbage with a NaN
    scale for int8)."""
    caches = []
    for c in (k, v):
        if name == "int8":
            scales = (np.abs(np.nan_to_num(c.blocks)).max(axis=-1) / 127).astype(np.float32)
            scales[scales == 0] = 1
            blocks = np.rint(np.nan_to_num(c.blocks) / scales[..., None]).astype(np.int8)
            scales[np.isnan(c.blocks).any(axis=-1)] = np.nan
        else:
            blocks, scales = c.blocks.astype(ml_dtype(name)), None
        caches.append(type(c)(blocks, c.cache_lengths, c.lookup_table, scales))
    return caches


def _flash_cases(rng):
    from .. import flash_attention_kv_cache as op

    f32, f64 = np.float32, np.float64
    # padded, dense K/V, causal, GQA 4
    q = rng.standard_normal((2, 37, 8, 32)).astype(f32)
    k = rng.standard_normal((2, 53, 2, 32)).astype(f32)
    v = rng.standard_normal((2, 53, 2, 32)).astype(f32)
    yield "padded dense causal GQA4 f32", f32, (lambda: op(q, k, v, CausalMask())), (
        lambda: reference.flash_attention_kv_cache(q, k, v, CausalMask()))
    # ragged, paged, sliding window + sinks, empty sequence
    offsets = np.array([0, 20, 20, 149])
    qr = rng.standard_normal((149, 6, 24)).astype(f32)
    kc, vc = _caches(rng, "paged", [5, 0, 140], np.diff(offsets), 3, 24, f32)
    sinks = rng.standard_normal(6).astype(f32)
    mask = SlidingWindowCausalMask(40)
    yield "ragged paged window+sinks f32", f32, (
        lambda: op(qr, kc, vc, mask, q_input_row_offsets=offsets, sink_weights=sinks)), (
        lambda: reference.flash_attention_kv_cache(qr, kc, vc, mask, q_input_row_offsets=offsets,
                                                   sink_weights=sinks))
    # continuous, chunked causal | window, float64
    q6 = rng.standard_normal((3, 9, 4, 16))
    kc6, vc6 = _caches(rng, "continuous", [0, 31, 200], [9, 9, 9], 1, 16, f64)
    mask6 = ChunkedCausalMask(16) | SlidingWindowCausalMask(5)
    yield "padded continuous chunked|window f64", f64, (lambda: op(q6, kc6, vc6, mask6)), (
        lambda: reference.flash_attention_kv_cache(q6, kc6, vc6, mask6))
    # additive [B, H, S, N] mask with fully masked rows
    bias = rng.standard_normal((2, 8, 37, 53)).astype(f32)
    bias[:, :, 3] = -np.inf
    yield "padded dense additive BHSN f32", f32, (lambda: op(q, k, v, bias)), (
        lambda: reference.flash_attention_kv_cache(q, k, v, bias))
    # large enough for the worker threads (small calls run on the calling thread)
    offsets_w = np.array([0, 300, 520])
    qw = rng.standard_normal((520, 8, 32)).astype(f32)
    kw, vw = _caches(rng, "paged", [100, 180], np.diff(offsets_w), 2, 32, f32, page_size=64)
    yield "ragged paged causal, worker threads f32", f32, (
        lambda: op(qw, kw, vw, CausalMask(), q_input_row_offsets=offsets_w)), (
        lambda: reference.flash_attention_kv_cache(qw, kw, vw, CausalMask(),
                                                   q_input_row_offsets=offsets_w))
    # 16-bit queries over a bfloat16 cache, and float32 ones over an int8 cache with scales
    bf16 = ml_dtype("bfloat16")
    kb, vb = _stored_caches(kc, vc, "bfloat16")
    qb = qr.astype(bf16)
    yield "ragged paged window+sinks bf16/bf16", bf16, (
        lambda: op(qb, kb, vb, mask, q_input_row_offsets=offsets, sink_weights=sinks)), (
        lambda: reference.flash_attention_kv_cache(qb, kb, vb, mask, q_input_row_offsets=offsets,
                                                   sink_weights=sinks))
    k8, v8 = _stored_caches(kc, vc, "int8")
    yield "ragged paged window f32/int8", f32, (
        lambda: op(qr, k8, v8, mask, q_input_row_offsets=offsets)), (
        lambda: reference.flash_attention_kv_cache(qr, k8, v8, mask, q_input_row_offsets=offsets))


def _decode_cases(rng, device):
    from .. import decode_attention as op

    f32, f64 = np.float32, np.float64
    q = rng.standard_normal((3, 8, 32)).astype(f32)
    kc, vc = _caches(rng, "paged", [0, 61, 300], [1, 1, 1], 2, 32, f32)
    sinks = rng.standard_normal(8).astype(f32)
    mask = SlidingWindowCausalMask(100)
    yield "paged window+sinks split-K=4 f32", f32, (
        lambda: op(q, kc, vc, mask, sink_weights=sinks, num_partitions=4, device=device)), (
        lambda: reference.decode_attention(q, kc, vc, mask, sink_weights=sinks))
    q6 = rng.standard_normal((2, 4, 16))
    kc6, vc6 = _caches(rng, "continuous", [17, 129], [1, 1], 4, 16, f64)
    yield "continuous causal f64", f64, (lambda: op(q6, kc6, vc6, CausalMask(), device=device)), (
        lambda: reference.decode_attention(q6, kc6, vc6, CausalMask()))
    k = rng.standard_normal((2, 70, 1, 16)).astype(f32)
    v = rng.standard_normal((2, 70, 1, 16)).astype(f32)
    q1 = rng.standard_normal((2, 3, 16)).astype(f32)
    yield "dense null MQA f32", f32, (lambda: op(q1, k, v, NullMask(), device=device)), (
        lambda: reference.decode_attention(q1, k, v, NullMask()))
    if device == "cuda" and _cuda.simulator_enabled():  # minutes over this many keys
        return
    # on the CPU, large enough for the worker threads (small calls run on the calling thread)
    qw = rng.standard_normal((2, 8, 64)).astype(f32)
    kw, vw = _caches(rng, "paged", [2100, 1500], [1, 1], 2, 64, f32, page_size=64)
    yield "paged causal, worker threads f32", f32, (
        lambda: op(qw, kw, vw, CausalMask(), device=device)), (
        lambda: reference.decode_attention(qw, kw, vw, CausalMask()))
    if device != "cpu":
        return
    for name, short in (("bfloat16", "bf16"), ("float8_e4m3fn", "e4m3"),
                        ("float8_e5m2", "e5m2"), ("int8", "int8")):  # read as stored
        ks, vs = _stored_caches(kw, vw, name)
        yield f"paged causal, worker threads f32/{short}", f32, (
            lambda ks=ks, vs=vs: op(qw, ks, vs, CausalMask(), device=device)), (
            lambda ks=ks, vs=vs: reference.decode_attention(qw, ks, vs, CausalMask()))


def _cross_cases(rng, device):
    from .. import cross_attention as op

    f32, f64 = np.float32, np.float64
    qo = np.array([0, 7, 7, 19])
    q = rng.standard_normal((19, 4, 16)).astype(f32)
    ko = np.array([0, 5, 9, 9])
    kc, vc = _caches(rng, "paged", [3, 0, 40], np.diff(ko), 2, 16, f32, page_size=4)
    yield "paged causal f32", f32, (
        lambda: op(q, qo, 12, kc, vc, ko, CausalMask(), device=device)), (
        lambda: reference.cross_attention(q, qo, 12, kc, vc, ko, CausalMask()))
    kr = rng.standard_normal((30, 1, 16))
    vr = rng.standard_normal((30, 1, 16))
    q6 = q.astype(f64)
    ko6 = np.array([0, 10, 10, 30])
    yield "ragged chunked MQA f64", f64, (
        lambda: op(q6, qo, 12, kr, vr, ko6, ChunkedMask(4), device=device)), (
        lambda: reference.cross_attention(q6, qo, 12, kr, vr, ko6, ChunkedMask(4)))
    bias = rng.standard_normal((3, 12, 43)).astype(f32)
    yield "paged additive BSN f32", f32, (
        lambda: op(q, qo, 12, kc, vc, ko, bias, device=device)), (
        lambda: reference.cross_attention(q, qo, 12, kc, vc, ko, bias))


def _merge_cases(rng):
    from ..merge import merge_states

    outs = [rng.standard_normal((5, 4, 8)).astype(np.float32) for _ in range(3)]
    lses = [rng.standard_normal((5, 4)).astype(np.float32) for _ in range(3)]
    lses[0][0] = -np.inf
    yield "3 parts with empty rows f32", np.float32, (lambda: merge_states(outs, lses)[0]), (
        lambda: reference.merge_states(outs, lses)[0])
    outs_w = [rng.standard_normal((64, 32, 128)).astype(np.float32) for _ in range(3)]
    lses_w = [rng.standard_normal((64, 32)).astype(np.float32) for _ in range(3)]
    yield "3 parts, worker threads f32", np.float32, (
        lambda: merge_states(outs_w, lses_w)[0]), (
        lambda: reference.merge_states(outs_w, lses_w)[0])


def _to_host(x):
    if isinstance(x, tuple):
        x = x[0]
    if hasattr(x, "copy_to_host"):
        return x.copy_to_host()
    return np.asarray(x)


def run_checks(seed=0, *, cuda=None, report=None):
    """Run every check; return the list of :class:`CheckResult` rows.

    Parameters
    ----------
    seed : int
        Seed of the random problems.
    cuda : bool or None
        Include the CUDA backend; ``None`` includes it when a GPU or the simulator is present.
    report : callable, optional
        Called with each :class:`CheckResult` as soon as it is known.

    Returns
    -------
    list of CheckResult

    Examples
    --------
    >>> from numattn.tools.check import run_checks
    >>> rows = run_checks(cuda=False)
    >>> all(row.passed for row in rows)
    True
    """
    if cuda is None:
        cuda = _cuda.is_available()
    suites = [("flash_attention_kv_cache", "cpu", _flash_cases),
              ("decode_attention", "cpu", lambda r: _decode_cases(r, "cpu")),
              ("cross_attention", "cpu", lambda r: _cross_cases(r, "cpu")),
              ("merge_states", "cpu", _merge_cases)]
    if cuda:
        suites += [("decode_attention", "cuda", lambda r: _decode_cases(r, "cuda")),
                   ("cross_attention", "cuda", lambda r: _cross_cases(r, "cuda"))]
    rows = []
    for operation, backend, cases in suites:
        rng = np.random.default_rng(seed)
        for case, dtype, run, expect in cases(rng):
            try:
                err = _error(_to_host(run()), np.asarray(expect(), dtype=np.float64))
            except Exception as exc:  # a crash is a failure with its reason
                case = f"{case} [{type(exc).__name__}: {exc}]"
                err = float("inf")
            row = CheckResult(operation, backend, case, err, TOLERANCE[np.dtype(dtype).name])
            rows.append(row)
            if report is not None:
                report(row)
    return rows


def format_row(row, widths=(26, 7, 40)):
    status = "PASS" if row.passed else "FAIL"
    return (f"{row.operation:<{widths[0]}} {row.backend:<{widths[1]}} {row.case:<{widths[2]}} "
            f"{row.max_error:>10.2e} {row.tolerance:>9.0e}  {status}")


def main(args) -> int:
    header = (f"{'operation':<26} {'backend':<7} {'case':<40} {'max error':>10} "
              f"{'tolerance':>9}  result")
    print(header)
    print("-" * len(header))
    rows = run_checks(args.seed, cuda=None if not args.cpu_only else False,
                      report=lambda row: print(format_row(row), flush=True))
    failed = sum(not row.passed for row in rows)
    print("-" * len(header))
    print(f"{len(rows) - failed} passed, {failed} failed")
    if not _cuda.is_available() and not args.cpu_only:
        print("(CUDA backend not checked: no GPU here; NUMBA_ENABLE_CUDASIM=1 runs it in the "
              "simulator, with the cuda extra installed: pip install '.[cuda]' in numattn's "
              "checkout)", file=sys.stderr)
    return 1 if failed else 0
