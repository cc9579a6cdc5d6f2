"""``python -m numattn demo``: the library's main job, end to end, as a serving loop uses it.

A small GPT-style decoder with random weights (NumPy, float32): a ragged batch of prompts
is prefilled into a paged KV cache with :func:`numattn.store_kv` and
:func:`numattn.flash_attention_kv_cache`, then tokens are generated one step at a time with
:func:`numattn.decode_attention`.  Every attention call is checked against
:mod:`numattn.reference`; the run reports tokens per second and the largest error.

:func:`run_dask_demo` (``python -m numattn demo --dask``) runs the decode with the prompts'
KV cache sharded over Dask worker processes (:mod:`numattn.dask`), checked against the
single-process result, and reports the bytes that moved.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .. import reference
from ..core.dtypes import ml_dtype
from ..kv_cache import PagedKVCache, store_kv
from ..masks import CausalMask

__all__ = ["DaskDemoResult", "DemoModel", "DemoResult", "run_dask_demo", "run_demo"]


@dataclass(frozen=True)
class DemoModel:
    """Shapes of the toy decoder (GQA attention, RMSNorm, rotary positions, GELU MLP)."""

    vocab: int = 512
    d_model: int = 256
    num_heads: int = 8
    num_kv_heads: int = 2
    num_layers: int = 2
    page_size: int = 16

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads


@dataclass
class DemoResult:
    """What :func:`run_demo` measured."""

    prompt_lengths: list
    generated: np.ndarray  # [B, new_tokens] token ids
    prefill_seconds: float
    step_seconds: list  # wall time of each decode step (the first one compiles)
    max_error: float
    attention_calls: int
    errors: list = field(default_factory=list)
    tolerance: float = 2e-4  # of max_error, for the results' dtype (TOLERANCE)

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second over the decode steps after the first (compiling) one."""
        steady = self.step_seconds[1:] or self.step_seconds
        total = self.generated.shape[0] * len(steady)
        return total / sum(steady) if sum(steady) > 0 else float("nan")  # nan: no steps


def _rms_norm(x):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def _rotary(x, positions):
    """Rotary position embedding of ``x [T, heads, D]`` at integer ``positions [T]``."""
    d = x.shape[-1]
    half = d // 2
    freqs = 1.0 / (10000.0 ** (np.arange(half, dtype=np.float64) / half))
    angles = positions[:, None].astype(np.float64) * freqs[None, :]
    cos = np.cos(angles)[:, None, :].astype(x.dtype)
    sin = np.sin(angles)[:, None, :].astype(x.dtype)
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    out = x.copy()
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half : 2 * half] = x1 * sin + x2 * cos
    return out


class _Decoder:
    def __init__(self, model, rng):
        m = model
        s = 1.0 / np.sqrt(m.d_model)
        self.m = m
        self.embed = rng.standard_normal((m.vocab, m.d_model)).astype(np.float32)
        self.unembed = (rng.standard_normal((m.d_model, m.vocab)) * s).astype(np.float32)
        self.layers = []
        for _ in range(m.num_layers):
            self.layers.append({
                "wq": (rng.standard_normal((m.d_model, m.num_heads * m.head_dim)) * s),
                "wk": (rng.standard_normal((m.d_model, m.num_kv_heads * m.head_dim)) * s),
                "wv": (rng.standard_normal((m.d_model, m.num_kv_heads * m.head_dim)) * s),
                "wo": (rng.standard_normal((m.num_heads * m.head_dim, m.d_model)) * s),
                "w1": (rng.standard_normal((m.d_model, 4 * m.d_model)) * s),
                "w2": (rng.standard_normal((4 * m.d_model, m.d_model)) * s / 2),
            })
            self.layers[-1] = {k: v.astype(np.float32) for k, v in self.layers[-1].items()}

    def qkv(self, layer, x, positions):
        m = self.m
        h = _rms_norm(x)
        q = (h @ layer["wq"]).reshape(-1, m.num_heads, m.head_dim)
        k = (h @ layer["wk"]).reshape(-1, m.num_kv_heads, m.head_dim)
        v = (h @ layer["wv"]).reshape(-1, m.num_kv_heads, m.head_dim)
        return _rotary(q, positions), np.ascontiguousarray(_rotary(k, positions)), v.copy()

    def finish(self, layer, x, attn):
        x = x + attn.reshape(x.shape[0], -1) @ layer["wo"]
        h = _rms_norm(x) @ layer["w1"]
        h = 0.5 * h * (1.0 + np.tanh(0.7978845608 * (h + 0.044715 * h**3)))
        return x + h @ layer["w2"]

    def logits(self, x):
        return _rms_norm(x) @ self.unembed


#: Largest error against the reference by the cache's dtype: 16-bit caches give 16-bit
#: results (the attention's inputs are the activations rounded to them).
TOLERANCE = {"bfloat16": 1.6e-2, "float16": 2e-3}


def run_demo(*, batch=4, new_tokens=32, seed=0, model=None, check=True, progress=None,
             dtype="float32"):
    """Prefill a ragged batch of prompts into a paged cache and generate ``new_tokens`` each.

    Parameters
    ----------
    batch : int
        Number of prompts (their lengths are drawn between 5 and 70 tokens).
    new_tokens : int
        Tokens generated per sequence with :func:`numattn.decode_attention`.
    seed : int
        Seed of the random weights and prompts.
    model : DemoModel, optional
        Shapes of the toy decoder.
    check : bool
        Compare every attention call with :mod:`numattn.reference`.
    progress : callable, optional
        Called as ``progress(step, total)`` after each generated token.
    dtype : str
        The KV cache's dtype: float32, bfloat16 or float16 (then also the queries'), or
        float8_e4m3fn, float8_e5m2 or int8 (quantized by :func:`numattn.store_kv`, with
        scales; float32 queries).  The reference reads the stored values.

    Returns
    -------
    DemoResult

    Examples
    --------
    >>> from numattn.tools.demo import run_demo
    >>> result = run_demo(batch=2, new_tokens=2)
    >>> result.generated.shape, result.max_error < 1e-3
    ((2, 2), True)
    """
    from .. import decode_attention, flash_attention_kv_cache

    if batch < 1 or new_tokens < 0:
        raise ValueError(f"run_demo needs batch >= 1 and new_tokens >= 0, got {batch} and "
                         f"{new_tokens}")

    m = model or DemoModel()
    rng = np.random.default_rng(seed)
    net = _Decoder(m, rng)
    prompt_lengths = [int(n) for n in rng.integers(5, 71, size=batch)]
    offsets = np.concatenate([[0], np.cumsum(prompt_lengths)]).astype(np.int64)
    tokens = rng.integers(0, m.vocab, size=int(offsets[-1]))

    # One paged pool per layer for K and one for V; all share the page table and lengths.
    capacity = max(prompt_lengths) + new_tokens
    pages_per_seq = -(-capacity // m.page_size)
    num_pages = batch * pages_per_seq
    table = rng.permutation(num_pages).reshape(batch, pages_per_seq)  # pages in any order
    cache_lengths = np.zeros(batch, dtype=np.int64)
    shape = (num_pages, m.page_size, m.num_kv_heads, m.head_dim)
    storage = np.dtype(dtype) if dtype in ("float32", "float16", "int8") else ml_dtype(dtype)
    scaled = dtype == "int8"  # float8 caches store the rounded values, int8 quantizes
    q_dtype = storage if dtype in ("bfloat16", "float16") else np.dtype(np.float32)

    def pool():  # unused slots: NaN (garbage with NaN scales for int8)
        blocks = np.zeros(shape, storage) if scaled else np.full(shape, np.nan, storage)
        scales = np.full(shape[:3], np.nan, np.float32) if scaled else None
        return PagedKVCache(blocks, cache_lengths, table, scales)

    caches = [(pool(), pool()) for _ in range(m.num_layers)]
    mask = CausalMask()
    errors = []

    def compare(got, ref):
        if check:
            errors.append(float(np.max(np.abs(got.astype(np.float64) - ref), initial=0.0)))

    # Prefill: all prompts at once, ragged.
    start = time.perf_counter()
    positions = np.concatenate([np.arange(n) for n in prompt_lengths])
    x = net.embed[tokens]
    for layer, (k_cache, v_cache) in zip(net.layers, caches):
        q, k_new, v_new = net.qkv(layer, x, positions)
        q = q.astype(q_dtype)
        store_kv(k_cache, k_new, offsets)
        store_kv(v_cache, v_new, offsets)
        attn = flash_attention_kv_cache(q, k_cache, v_cache, mask, q_input_row_offsets=offsets)
        if check:
            compare(attn, reference.flash_attention_kv_cache(
                q, k_cache, v_cache, mask, q_input_row_offsets=offsets))
        x = net.finish(layer, x, attn.astype(np.float32))
    cache_lengths += np.asarray(prompt_lengths)
    last = x[offsets[1:] - 1]
    next_token = np.argmax(net.logits(last), axis=-1)
    prefill_seconds = time.perf_counter() - start

    # Decode: one token per sequence per step.
    generated = np.zeros((batch, new_tokens), dtype=np.int64)
    step_offsets = np.arange(batch + 1, dtype=np.int64)
    step_seconds = []
    for step in range(new_tokens):
        generated[:, step] = next_token
        elapsed = 0.0  # the reference checks are not timed
        start = time.perf_counter()
        x = net.embed[next_token]
        positions = cache_lengths.copy()
        for layer, (k_cache, v_cache) in zip(net.layers, caches):
            q, k_new, v_new = net.qkv(layer, x, positions)
            q = q.astype(q_dtype)
            store_kv(k_cache, k_new, step_offsets)
            store_kv(v_cache, v_new, step_offsets)
            attn = decode_attention(q, k_cache, v_cache, mask)
            elapsed += time.perf_counter() - start
            if check:
                compare(attn, reference.decode_attention(q, k_cache, v_cache, mask))
            start = time.perf_counter()
            x = net.finish(layer, x, attn.astype(np.float32))
        cache_lengths += 1
        next_token = np.argmax(net.logits(x), axis=-1)
        step_seconds.append(elapsed + time.perf_counter() - start)
        if progress is not None:
            progress(step + 1, new_tokens)

    return DemoResult(
        prompt_lengths=prompt_lengths,
        generated=generated,
        prefill_seconds=prefill_seconds,
        step_seconds=step_seconds,
        max_error=max(errors, default=0.0),
        attention_calls=m.num_layers * (1 + new_tokens),
        errors=errors,
        tolerance=TOLERANCE.get(dtype, 2e-4),
    )


@dataclass
class DaskDemoResult:
    """What :func:`run_dask_demo` measured."""

    workers: int
    prompt_length: int
    generated: np.ndarray  # [B, new_tokens] token ids
    step_seconds: list  # wall time of each decode step (the first one loads the kernels)
    max_difference: float  # largest |sharded - single-process| over the attention calls
    attention_calls: int
    held_bytes: int  # K/V of the prompts, held by the workers (all layers)
    worker_bytes: list  # bytes the workers received from each other, per step
    sent_bytes: list  # bytes sent with each step's graph: queries and the new tokens' K/V
    partial_bytes: int  # one key chunk's partial output and LSE, per layer

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second over the decode steps after the first one."""
        steady = self.step_seconds[1:] or self.step_seconds
        total = self.generated.shape[0] * len(steady)
        return total / sum(steady) if sum(steady) > 0 else float("nan")


def run_dask_demo(*, batch=2, prompt_length=2048, new_tokens=8, seed=0, workers=2,
                  model=None, progress=None):
    """The demo's decode with the prompts' KV cache sharded over Dask worker processes.

    Equal-length prompts are prefilled in this process (:func:`numattn.flash_attention_kv_cache`
    on dense ``[B, N, Hkv, D]`` K/V), and each layer's K/V are cut along the keys into
    ``workers`` chunks, one sent to each worker of a ``distributed.LocalCluster`` (worker
    processes of one thread), where they stay.  Each generated token's K/V row is kept here
    and sent with the step's graph (a last, short key chunk).  Every decode call runs
    through :func:`numattn.dask.decode_attention` and is compared with the single-process
    :func:`numattn.decode_attention` on the same data; the bytes the workers send each other
    are read from their transfer logs.

    Parameters
    ----------
    batch, prompt_length, new_tokens, seed : int
        Sequences, tokens per prompt, tokens generated per sequence, seed.
    workers : int
        Worker processes (and key chunks of the prompts' cache).
    model : DemoModel, optional
        Shapes of the toy decoder.
    progress : callable, optional
        Called as ``progress(step, total)`` after each generated token.

    Returns
    -------
    DaskDemoResult

    Raises
    ------
    ImportError
        Without Dask (``pip install .[dask]``).
    """
    import distributed

    from .. import dask as sharded
    from .. import decode_attention, flash_attention_kv_cache

    if min(batch, prompt_length, workers) < 1 or new_tokens < 0:
        raise ValueError(f"run_dask_demo needs batch, prompt_length and workers >= 1 and "
                         f"new_tokens >= 0, got {batch}, {prompt_length}, {workers} and "
                         f"{new_tokens}")
    import dask.array as da

    m = model or DemoModel()
    rng = np.random.default_rng(seed)
    net = _Decoder(m, rng)
    tokens = rng.integers(0, m.vocab, size=(batch, prompt_length))
    mask = CausalMask()

    # Prefill here, dense: K/V [B, N, Hkv, D] per layer.
    positions = np.tile(np.arange(prompt_length), batch)
    x = net.embed[tokens.reshape(-1)]
    prompt_kv = []
    for layer in net.layers:
        q, k, v = net.qkv(layer, x, positions)
        shape = (batch, prompt_length, m.num_kv_heads, m.head_dim)
        k, v = k.reshape(shape), v.reshape(shape)
        attn = flash_attention_kv_cache(q.reshape(batch, prompt_length, m.num_heads, -1),
                                        k, v, mask)
        prompt_kv.append((k, v))
        x = net.finish(layer, x, attn.reshape(batch * prompt_length, m.num_heads, -1))
    next_token = np.argmax(net.logits(x.reshape(batch, prompt_length, -1)[:, -1]), axis=-1)

    def received(dask_worker):
        return sum(entry["total"] for entry in dask_worker.transfer_incoming_log)

    with distributed.LocalCluster(processes=True, n_workers=workers, threads_per_worker=1,
                                  dashboard_address=":0") as cluster, \
            distributed.Client(cluster) as client:
        addresses = sorted(client.scheduler_info()["workers"])
        bounds = np.linspace(0, prompt_length, workers + 1).astype(int)

        def shard(x):
            """``x`` cut along the keys, one chunk held by each worker."""
            parts = []
            for address, n0, n1 in zip(addresses, bounds[:-1], bounds[1:]):
                part = np.ascontiguousarray(x[:, n0:n1])
                future = client.scatter(part, workers=[address], direct=True)
                parts.append(da.from_delayed(future, part.shape, dtype=part.dtype))
            return parts

        held = [(shard(k), shard(v)) for k, v in prompt_kv]
        held_bytes = sum(k.nbytes + v.nbytes for k, v in prompt_kv)
        tails = [([], []) for _ in net.layers]  # the generated tokens' K/V rows, here
        generated = np.zeros((batch, new_tokens), dtype=np.int64)
        step_seconds, worker_bytes, sent_bytes, differences = [], [], [], []
        for step in range(new_tokens):
            generated[:, step] = next_token
            before = sum(client.run(received).values())
            sent = 0
            start = time.perf_counter()
            x = net.embed[next_token]
            position = np.full(batch, prompt_length + step)
            for layer, (k_parts, v_parts), (k_tail, v_tail), (k_prompt, v_prompt) in zip(
                    net.layers, held, tails, prompt_kv):
                q, k_new, v_new = net.qkv(layer, x, position)
                k_tail.append(k_new[:, None])
                v_tail.append(v_new[:, None])
                k_rows, v_rows = np.concatenate(k_tail, axis=1), np.concatenate(v_tail, axis=1)
                k = da.concatenate([*k_parts, da.from_array(k_rows)], axis=1)
                v = da.concatenate([*v_parts, da.from_array(v_rows)], axis=1)
                attn = sharded.decode_attention(q, k, v, mask).compute()
                sent += q.nbytes + k_rows.nbytes + v_rows.nbytes
                check_start = time.perf_counter()  # the check is not timed
                single = decode_attention(q, np.concatenate([k_prompt, k_rows], axis=1),
                                          np.concatenate([v_prompt, v_rows], axis=1), mask)
                differences.append(float(np.max(np.abs(attn - single), initial=0.0)))
                start += time.perf_counter() - check_start
                x = net.finish(layer, x, attn)
            next_token = np.argmax(net.logits(x), axis=-1)
            step_seconds.append(time.perf_counter() - start)
            worker_bytes.append(sum(client.run(received).values()) - before)
            sent_bytes.append(sent)
            if progress is not None:
                progress(step + 1, new_tokens)

    return DaskDemoResult(
        workers=workers, prompt_length=prompt_length, generated=generated,
        step_seconds=step_seconds, max_difference=max(differences, default=0.0),
        attention_calls=m.num_layers * new_tokens, held_bytes=held_bytes,
        worker_bytes=worker_bytes, sent_bytes=sent_bytes,
        partial_bytes=batch * m.num_heads * (m.head_dim + 1) * 4,
    )
