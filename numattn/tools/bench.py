"""``python -m numattn bench``: the benchmark shapes, against this machine's own limits.

Each case times numattn (median of several runs, after a warm-up that compiles) and, round
by round with it, a baseline: PyTorch's CPU ``scaled_dot_product_attention`` when torch is
installed (``pip install .[bench]``), NumPy otherwise.  Figures are reported as
useful GFLOP/s (attention FLOPs over visible pairs only) or GB/s (K/V bytes of the live
cache, read once), as fractions of this machine's own limits measured in the same run
(float32 GEMM rate of the BLAS NumPy uses; memory read bandwidth of all cores, measured
in the same rounds as the case), and as the ratio ``baseline time / numattn time`` (above
1: numattn is faster).

The machine is shared and noisy: compare ratios and medians, not single runs.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import json
import os
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

from ..core.dtypes import ml_dtype
from ..core.jit import body, cpu_jit, prange
from .cli import STORAGE_DTYPES

__all__ = [
    "BenchResult",
    "gemm_gflops",
    "interleaved_medians",
    "interleaved_times",
    "median_time",
    "read_all_fn",
    "read_bandwidth_gbs",
    "run_bench",
    "torch_or_none",
]


# --------------------------------------------------------------------------------------
# Machine limits and timing.
# --------------------------------------------------------------------------------------
def median_time(fn, *, repeat=5, warmup=1):
    """Median wall time of ``fn()`` in seconds over ``repeat`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def interleaved_times(fns, *, repeat=5, warmup=1, rotate=False):
    """Wall times (seconds) of each callable over ``repeat`` rounds that call each in turn.

    Returns one list per callable; entry ``r`` of every list comes from round ``r``, so
    ratios can be taken within a round.  ``rotate`` starts each round with the next
    callable, so that none always runs right after the same neighbour.

    Interleaving lets every contender see the same machine: on a shared virtual machine
    the speed of memory moves between runs (the two virtual cores may share one chiplet's
    link to memory or not), and a bandwidth measured minutes before a kernel is no limit
    for it.
    """
    for fn in fns:
        for _ in range(warmup):
            fn()
    times = [[] for _ in fns]
    order = list(range(len(fns)))
    for r in range(repeat):
        shift = r % len(fns) if rotate and fns else 0
        for i in order[shift:] + order[:shift]:
            start = time.perf_counter()
            fns[i]()
            times[i].append(time.perf_counter() - start)
    return times


def interleaved_medians(fns, *, repeat=5, warmup=1):
    """Median of each callable's :func:`interleaved_times`."""
    return [float(np.median(t)) for t in interleaved_times(fns, repeat=repeat, warmup=warmup)]


@functools.cache
def gemm_gflops(dtype=np.float32, n=2048, repeat=5):
    """GEMM rate (GFLOP/s) of the BLAS behind NumPy on all cores, ``n x n x n`` products."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n)).astype(dtype)
    b = rng.standard_normal((n, n)).astype(dtype)
    c = np.empty((n, n), dtype)
    t = median_time(lambda: np.matmul(a, b, out=c), repeat=repeat)
    return 2.0 * n**3 / t / 1e9


#: Sequential streams each thread of the read-bandwidth probe walks at once (written out in
#: :func:`_read_words`).
READ_STREAMS = 8
#: The probe's streams start this many 8-byte words short of a power of two apart.
READ_STREAM_SKEW = 104


def read_all_fn(megabytes=1024, threads=None):
    """A callable reading about ``megabytes`` MiB with one thread per core (it returns the
    bytes it read), and that count.

    Each thread sums its share of a large array of 64-bit integers as
    :data:`READ_STREAMS` sequential streams at once (:func:`_read_words`, compiled:
    integer sums vectorise without fast-math), so that the probe reads as fast as the cores
    can: on some machines one stream per thread reads half of that.  The streams start
    :data:`READ_STREAM_SKEW` words short of a power of two apart, as streams a power of two
    apart share cache sets.  Measured: "How it is measured" in docs/performance.rst.
    """
    threads = threads or os.cpu_count() or 1
    words = np.ones(megabytes * 2**20 // 8, dtype=np.int64)
    stream_words = _stream_words(words.size, threads)
    if stream_words < 1:
        raise ValueError(f"read_all_fn: {megabytes} MiB is too little for {threads} threads")
    read_words = cpu_jit(_read_words, parallel=True)
    read_words(words[:READ_STREAMS * (READ_STREAM_SKEW + 1)], 1)  # compile (or load) first

    def read_all():
        return int(read_words(words, threads)) * words.itemsize  # bytes read (words of 1)

    return read_all, threads * READ_STREAMS * stream_words * words.itemsize


@body
def _stream_words(num_words, threads):
    """Words per stream of :func:`_read_words` over ``num_words`` words."""
    return num_words // threads // READ_STREAMS - READ_STREAM_SKEW


def _read_words(words, num_threads):
    """Sum of the words the read-bandwidth probe reads: ``num_threads`` equal shares of
    ``words``, each read as :data:`READ_STREAMS` streams of :func:`_stream_words` words."""
    per_thread = words.size // num_threads
    n = _stream_words(words.size, num_threads)
    sums = np.zeros(num_threads, dtype=np.int64)
    for t in prange(num_threads):
        w = words[t * per_thread:]
        w0, w1, w2, w3 = w[:n], w[n:2 * n], w[2 * n:3 * n], w[3 * n:4 * n]
        w4, w5, w6, w7 = w[4 * n:5 * n], w[5 * n:6 * n], w[6 * n:7 * n], w[7 * n:8 * n]
        s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = 0
        for i in range(n):
            s0 += w0[i]
            s1 += w1[i]
            s2 += w2[i]
            s3 += w3[i]
            s4 += w4[i]
            s5 += w5[i]
            s6 += w6[i]
            s7 += w7[i]
        sums[t] = s0 + s1 + s2 + s3 + s4 + s5 + s6 + s7
    return sums.sum()


@functools.cache
def read_bandwidth_gbs(megabytes=1024, repeat=9, threads=None):
    """Memory read bandwidth (GB/s) of all cores together (see :func:`read_all_fn`)."""
    read_all, nbytes = read_all_fn(megabytes, threads)
    return nbytes / median_time(read_all, repeat=repeat) / 1e9


def torch_or_none():
    """``torch`` (using every core) when it is installed, else ``None``.

    Call it before anything starts Numba's threads (a parallel kernel, or
    ``numba.set_num_threads``).  PyTorch's wheels carry their own ``libgomp.so.1``; where
    Numba's OpenMP layer has loaded the system's first, torch runs on that one, several
    times slower (pytorch/pytorch#98836): a baseline no user who imports torch first would
    see ("PyTorch in the same process" in docs/performance.rst).
    """
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(os.cpu_count() or 1)
    return torch


# --------------------------------------------------------------------------------------
# Cases.
# --------------------------------------------------------------------------------------
@dataclass
class BenchResult:
    """One row of the benchmark table."""

    name: str
    seconds: float
    metric: str  # "GFLOP/s" or "GB/s"
    rate: float
    fraction_of_limit: float
    limit: float  # GEMM GFLOP/s, or the read bandwidth measured in the case's rounds
    baseline: str
    baseline_seconds: float | None
    note: str = ""

    @property
    def speedup(self) -> float | None:
        """Baseline time over numattn time (above 1: numattn is faster)."""
        if self.baseline_seconds is None:
            return None
        return self.baseline_seconds / self.seconds


def _attention_flops(num_heads, head_dim, visible_pairs):
    return 4.0 * num_heads * head_dim * visible_pairs


def _causal_pairs(q_len, num_keys, window=None):
    q_idx = np.arange(num_keys - q_len, num_keys)
    lo = np.zeros_like(q_idx) if window is None else np.maximum(q_idx - window + 1, 0)
    return int(np.sum(q_idx - lo + 1))


def _paged_copy(rng, rows, page_size, dtype=np.float32):
    """K and V paged caches (pages shuffled) holding ``rows[b]`` = [n_b, Hkv, D] each."""
    from ..kv_cache import PagedKVCache

    hkv, d = rows[0][0].shape[1:]
    pages_per_seq = [-(-r[0].shape[0] // page_size) for r in rows]
    num_pages = sum(pages_per_seq)
    order = rng.permutation(num_pages)
    table = np.zeros((len(rows), max(pages_per_seq)), dtype=np.int64)
    kb = np.zeros((num_pages, page_size, hkv, d), dtype)
    vb = np.zeros_like(kb)
    used = 0
    for b, (k, v) in enumerate(rows):
        n = k.shape[0]
        table[b, : pages_per_seq[b]] = order[used : used + pages_per_seq[b]]
        used += pages_per_seq[b]
        t = np.arange(n)
        kb[table[b, t // page_size], t % page_size] = k
        vb[table[b, t // page_size], t % page_size] = v
    return kb, vb, table, PagedKVCache


def _numpy_attention(q, k, v, causal):
    """Baseline without torch: per-head NumPy attention with a full score matrix (BHSD)."""
    b, h, s, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    out = np.empty_like(q)
    allowed = np.tril(np.ones((s, n), bool), k=n - s) if causal else None
    for i in range(b):
        for j in range(h):
            scores = (q[i, j] @ k[i, j // (h // hkv)].T) / np.sqrt(d)
            if allowed is not None:
                scores = np.where(allowed, scores, -np.inf)
            scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
            out[i, j] = (scores / scores.sum(axis=-1, keepdims=True)) @ v[i, j // (h // hkv)]
    return out


def _baseline(torch, q_bhsd, k_bhsd, v_bhsd, *, causal=False, mask=None, dtype="float32"):
    """``(name, callable)`` running the baseline on BHSD copies made here, outside the
    timing: torch SDPA in ``dtype`` (float32 for the 8-bit dtypes, which it lacks)."""
    if torch is not None:
        torch_dtype = _torch_dtype(torch, dtype) or torch.float32
        qt, kt, vt = (torch.from_numpy(np.ascontiguousarray(x)).to(torch_dtype)
                      for x in (q_bhsd, k_bhsd, v_bhsd))
        mt = None if mask is None else torch.from_numpy(mask)
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def run():
            with torch.no_grad():
                return sdpa(qt, kt, vt, attn_mask=mt, is_causal=causal and mt is None,
                            enable_gqa=True)

        return f"torch SDPA {str(torch_dtype).removeprefix('torch.')}", run
    return "NumPy float32", lambda: _numpy_attention(q_bhsd, k_bhsd, v_bhsd, causal)


#: ``--dtype`` choices: K/V storage (queries too for the 16-bit formats)
DTYPES = STORAGE_DTYPES


def stored_array(x, name):
    """Float32 ``x`` stored as ``name``: ``(array, scales or None)``; int8 quantized with one
    scale per row of the last axis."""
    if name == "int8":
        scales = (np.abs(x).max(axis=-1) / 127).astype(np.float32)
        scales[scales == 0] = 1
        return np.rint(x / scales[..., None]).astype(np.int8), scales
    return x.astype(ml_dtype(name) if name not in ("float32", "float16") else name), None


def _query_dtype(name):
    """Queries go with 16-bit K/V in their dtype, else float32."""
    return ml_dtype(name) if name == "bfloat16" else np.dtype(
        "float16" if name == "float16" else "float32")


def _torch_dtype(torch, name):
    """torch's dtype for ``name``, or None where SDPA has none (8-bit)."""
    return {"float32": torch.float32, "bfloat16": torch.bfloat16,
            "float16": torch.float16}.get(name)


def _cases(quick, dtype="float32"):
    """(name, builder) pairs; a builder returns (numattn fn, baseline (name, fn) or None,
    work, metric, note).  K/V are stored as ``dtype`` (queries too for 16-bit dtypes)."""
    import numattn

    rng = np.random.default_rng(0)
    f32 = np.float32
    q_dtype = _query_dtype(dtype)
    itemsize = stored_array(np.ones((1, 1), f32), dtype)[0].itemsize  # bytes per stored element

    def store(blocks):
        """K or V blocks ``[pages, page_size, Hkv, D]`` (float32) as stored."""
        return stored_array(blocks, dtype)

    def dense_kv(k, v):
        """Plain K/V, or for int8 (which needs scales) a one-block cache of each."""
        (kb, ks), (vb, vs) = store(k), store(v)
        if ks is None:
            return kb, vb
        lengths, table = np.zeros(k.shape[0], np.int64), np.arange(k.shape[0])
        return (numattn.ContinuousBatchingKVCache(kb, lengths, table, ks),
                numattn.ContinuousBatchingKVCache(vb, lengths, table, vs))

    def prefill(s, window=None, baseline=True):
        def build(torch):
            h, hkv, d = (32, 8, 128) if not quick else (8, 2, 64)
            q = rng.standard_normal((1, s, h, d)).astype(f32)
            k = rng.standard_normal((1, s, hkv, d)).astype(f32)
            v = rng.standard_normal((1, s, hkv, d)).astype(f32)
            mask = numattn.CausalMask() if window is None else numattn.SlidingWindowCausalMask(
                window)
            qs = q.astype(q_dtype)
            ks, vs = dense_kv(k, v)
            out = np.empty_like(qs)
            fn = lambda: numattn.flash_attention_kv_cache(qs, ks, vs, mask, out=out)  # noqa: E731
            flops = _attention_flops(h, d, _causal_pairs(s, s, window))
            base = None
            if baseline:
                bool_mask = None
                if window is not None:
                    i = np.arange(s)
                    bool_mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)
                base = _baseline(torch, q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3),
                                 v.transpose(0, 2, 1, 3), causal=True, mask=bool_mask,
                                 dtype=dtype)
            return fn, base, flops, "GFLOP/s", f"B=1 H={h} Hkv={hkv} S={s} D={d}"
        return build

    def ragged_paged(torch):
        h, hkv, d = (32, 8, 128) if not quick else (8, 2, 64)
        lengths = np.linspace(64, 1024 if not quick else 256, 8).astype(int)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        q = rng.standard_normal((offsets[-1], h, d)).astype(f32)
        rows = [(rng.standard_normal((n, hkv, d)).astype(f32),
                 rng.standard_normal((n, hkv, d)).astype(f32)) for n in lengths]
        kb, vb, table, cls = _paged_copy(rng, rows, 128)
        zeros = np.zeros(len(lengths), np.int64)
        (kb, k_scales), (vb, v_scales) = store(kb), store(vb)
        k, v = cls(kb, zeros, table, k_scales), cls(vb, zeros, table, v_scales)
        qs = q.astype(q_dtype)
        out = np.empty_like(qs)
        fn = lambda: numattn.flash_attention_kv_cache(  # noqa: E731
            qs, k, v, numattn.CausalMask(), q_input_row_offsets=offsets, out=out)
        flops = sum(_attention_flops(h, d, _causal_pairs(n, n)) for n in lengths)
        base = None
        if torch is not None:
            per_seq = [_baseline(torch, q[a:b][None].transpose(0, 2, 1, 3),
                                 rows[i][0][None].transpose(0, 2, 1, 3),
                                 rows[i][1][None].transpose(0, 2, 1, 3), causal=True,
                                 dtype=dtype)
                       for i, (a, b) in enumerate(itertools.pairwise(offsets))]
            base = (per_seq[0][0] + " per sequence", lambda: [f() for _, f in per_seq])
        return fn, base, flops, "GFLOP/s", f"8 seqs {lengths[0]}..{lengths[-1]}, pages of 128"

    def decode(batch, n):
        def build(torch):
            h, hkv, d = (32, 8, 128) if not quick else (8, 2, 64)
            q = rng.standard_normal((batch, h, d)).astype(f32)
            rows = [(rng.standard_normal((n, hkv, d)).astype(f32),
                     rng.standard_normal((n, hkv, d)).astype(f32)) for _ in range(batch)]
            kb, vb, table, cls = _paged_copy(rng, rows, 128)
            lengths = np.full(batch, n - 1, np.int64)
            (kb, k_scales), (vb, v_scales) = store(kb), store(vb)
            k, v = cls(kb, lengths, table, k_scales), cls(vb, lengths, table, v_scales)
            qs = q.astype(q_dtype)
            out = np.empty_like(qs)
            fn = lambda: numattn.decode_attention(qs, k, v, out=out)  # noqa: E731
            bytes_read = 2.0 * batch * n * hkv * d * itemsize
            kd = np.stack([r[0] for r in rows]).transpose(0, 2, 1, 3)
            vd = np.stack([r[1] for r in rows]).transpose(0, 2, 1, 3)
            base = _baseline(torch, q[:, :, None, :], kd, vd, dtype=dtype)
            return fn, base, bytes_read, "GB/s", f"B={batch} H={h} Hkv={hkv} N={n} D={d} paged 128"
        return build

    def cross(torch):
        h, hkv, d = 16, 4, 64
        nq, nk, batch = (128, 1500, 8) if not quick else (64, 500, 4)
        q = rng.standard_normal((batch * nq, h, d)).astype(f32)
        k = rng.standard_normal((batch * nk, hkv, d)).astype(f32)
        v = rng.standard_normal((batch * nk, hkv, d)).astype(f32)
        qo = np.arange(batch + 1) * nq
        ko = np.arange(batch + 1) * nk
        qs = q.astype(q_dtype)
        ks, vs = (k, v) if dtype == "int8" else (store(k)[0], store(v)[0])
        out = np.empty_like(qs)
        fn = lambda: numattn.cross_attention(qs, qo, nq, ks, vs, ko, out=out)  # noqa: E731
        flops = batch * _attention_flops(h, d, nq * nk)
        keep = np.ones((batch, 1, nq, nk), bool)  # padded batch with a boolean mask
        base = _baseline(torch, q.reshape(batch, nq, h, d).transpose(0, 2, 1, 3),
                         k.reshape(batch, nk, hkv, d).transpose(0, 2, 1, 3),
                         v.reshape(batch, nk, hkv, d).transpose(0, 2, 1, 3),
                         mask=keep if torch is not None else None, dtype=dtype)
        return fn, base, flops, "GFLOP/s", f"{batch} x {nq} queries, {nk} keys, H=16 Hkv=4 D=64"

    s = 2048 if not quick else 512
    long_s = 8192 if not quick else 2048
    return [
        ("flash prefill causal", prefill(s)),
        ("flash ragged paged causal", ragged_paged),
        (f"flash causal S={long_s}", prefill(long_s, baseline=False)),
        (f"flash sliding window 512 S={long_s}", prefill(long_s, window=512, baseline=False)),
        ("decode B=8 N=4096" if not quick else "decode B=8 N=1024",
         decode(8, 4096 if not quick else 1024)),
        ("decode B=1 N=32768" if not quick else "decode B=1 N=8192",
         decode(1, 32768 if not quick else 8192)),
        ("cross ragged", cross),
    ]


def run_bench(*, quick=False, only=None, repeat=None, progress=None, dtype="float32"):
    """Run the benchmark cases and measure this machine's limits in the same run.

    Parameters
    ----------
    quick : bool
        Smaller shapes and fewer repeats (under a minute).
    only : list of str, optional
        Keep the cases whose name contains one of these strings.
    repeat : int, optional
        Timed runs per case (the median is reported).
    progress : callable, optional
        Called as ``progress(done, total, case_name)``.
    dtype : str
        K/V storage of every case (one of :data:`DTYPES`; queries too for 16-bit dtypes);
        GB/s count the stored bytes.  The baseline runs torch SDPA in that dtype (float32
        for the 8-bit ones, which it lacks).

    Returns
    -------
    limits : dict
        ``gemm_gflops``, ``read_gbs`` (before the cases; each GB/s case also measures the
        read bandwidth in its own rounds, its ``limit``), ``cores`` and the torch version.
    results : list of BenchResult

    Raises
    ------
    ValueError
        If ``only`` matches no case (before anything is measured).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    all_cases = _cases(quick, dtype)
    cases = [(n, b) for n, b in all_cases if not only or any(o in n for o in only)]
    if not cases:
        names = ", ".join(repr(n) for n, _ in all_cases)
        raise ValueError(f"no benchmark case matches --only {only}; the cases are {names}")
    torch = torch_or_none()
    repeat = repeat or (2 if quick else 5)
    limits = {
        "gemm_gflops": gemm_gflops(np.float32, 1024 if quick else 2048, repeat=5),
        "read_gbs": read_bandwidth_gbs(256 if quick else 1024, repeat=9),
        "cores": os.cpu_count(),
        "torch": None if torch is None else torch.__version__,
    }
    read_all, read_bytes = read_all_fn(256 if quick else 1024)
    results = []
    for i, (name, build) in enumerate(cases):
        if progress is not None:
            progress(i, len(cases), name)
        fn, base, work, metric, note = build(torch)
        base_name, base_fn = base if base is not None else ("-", None)
        # numattn, the baseline and (for GB/s) the read bandwidth, timed round by round
        fns = [fn] + ([base_fn] if base_fn else []) + ([read_all] if metric == "GB/s" else [])
        times = interleaved_medians(fns, repeat=repeat)
        t = times[0]
        base_t = times[1] if base_fn else None
        rate = work / t / 1e9
        limit = limits["gemm_gflops"] if metric == "GFLOP/s" else read_bytes / times[-1] / 1e9
        results.append(BenchResult(name, t, metric, rate, rate / limit, limit, base_name,
                                   base_t, note))
    if progress is not None:
        progress(len(cases), len(cases), "done")
    return limits, results


def _plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.5 + 0.45 * len(results)))
    names = [r.name for r in results]
    fractions = [100 * r.fraction_of_limit for r in results]
    bars = ax.barh(names, fractions, color="#3b6ea8")
    for bar, r in zip(bars, results):
        label = f"{r.rate:.0f} {r.metric}"
        if r.speedup is not None:
            label += f", {r.speedup:.2f}x {r.baseline}"
        ax.text(bar.get_width() + 1, bar.get_y() + bar.get_height() / 2, label, va="center",
                fontsize=8)
    ax.set_xlabel("% of this machine's limit (GEMM rate or read bandwidth)")
    ax.set_xlim(0, 140)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _output_problem(json_path, plot_path):
    """Why ``--json``/``--plot`` could not be written, or ``None``: asked before the cases run
    (minutes), not found out after them."""
    for flag, path in (("--json", json_path), ("--plot", plot_path)):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            return f"{flag} {path}: no such directory"
    if plot_path and importlib.util.find_spec("matplotlib") is None:
        return "--plot needs matplotlib (pip install matplotlib, or the [plot] extra)"
    return None


def main(args) -> int:
    problem = _output_problem(args.json, args.plot)
    if problem is not None:
        print(f"numattn bench: error: {problem}", file=sys.stderr)
        return 2

    def progress(done, total, name):
        if sys.stderr.isatty():
            bar = "#" * (30 * done // max(total, 1))
            print(f"\r[{bar:<30}] {done}/{total} {name:<40}", end="", file=sys.stderr,
                  flush=True)
            if done == total:
                print(file=sys.stderr)

    try:
        limits, results = run_bench(quick=args.quick, only=args.only, repeat=args.repeat,
                                    progress=progress, dtype=args.dtype)
    except ValueError as exc:
        print(f"numattn bench: error: {exc}", file=sys.stderr)
        return 2
    print(f"machine: {limits['cores']} cores, float32 GEMM {limits['gemm_gflops']:.0f} GFLOP/s, "
          f"read bandwidth {limits['read_gbs']:.1f} GB/s, torch {limits['torch'] or 'absent'}; "
          f"K/V stored as {args.dtype}")
    print("limit: the machine's float32 GEMM GFLOP/s for GFLOP/s cases, its read GB/s (measured "
          "in the case's rounds) for GB/s cases; speedup: baseline time / numattn time")
    header = (f"{'case':<34} {'median ms':>10} {'rate':>14} {'of limit':>9} {'limit':>7} "
              f"{'baseline':>32} {'speedup':>8}")
    print(header)
    print("-" * len(header))
    for r in results:
        speed = "-" if r.speedup is None else f"{r.speedup:.2f}x"
        print(f"{r.name:<34} {r.seconds * 1e3:>10.2f} {r.rate:>8.1f} {r.metric:<5} "
              f"{100 * r.fraction_of_limit:>8.0f}% {r.limit:>7.1f} {r.baseline:>32} {speed:>8}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"limits": limits,
                       "results": [dict(asdict(r), speedup=r.speedup) for r in results]},
                      fh, indent=2)
        print(f"wrote {args.json}")
    if args.plot:
        _plot(results, args.plot)
        print(f"wrote {args.plot}")
    return 0
