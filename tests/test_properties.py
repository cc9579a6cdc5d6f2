"""Property-based tests (hypothesis): every operation against :mod:`numattn.reference`.

Each example draws a whole problem, shapes, options and the seed of its arrays (the arrays
themselves are made from the seed, so examples stay small and shrink well): the operation
(flash attention over padded or ragged queries, decode, cross attention, ``merge_states``,
``store_kv``), the K/V input (plain arrays, a ``ContinuousBatchingKVCache``, or a
``PagedKVCache`` with its pages in random order, spare table entries holding sentinels and
sequences crossing pages), the mask (every mask object, ``&`` / ``|`` trees of them,
additive tensors of each rank, alone or combined; in float32 also a ``FunctionMask``, with
and without the score modifier ``softcap``), sinks, GQA groups of 1, 2, 3, 4 and 8,
partition counts, ``MHAConfig`` tile sizes and the dtype.  Edge cases come with them: empty
batches and sequences, a single key, rows with no visible key, and NaN, inf or huge values
in every cache slot that no token of the step uses (they must not reach the output; in some
examples one used slot holds NaN too, which must reach exactly the rows that see it).  The
result and, when asked for, the log-sum-exp are compared with the float64 reference.

Tolerances (:data:`TOL`): an entry passes when ``|got - want| <= tol * (1 + |want|)``,
with ``tol = 2e-4`` for float32 (inputs rounded to float32 and float32 arithmetic over a
handful of keys with scores up to ~100 in size, as large scales and additive biases give)
and ``1e-10`` for float64 (rounding only).  NaN must appear exactly where the reference has
it, and infinities must be equal.

Profiles (chosen by the environment variable ``NUMATTN_HYPOTHESIS_PROFILE``):

``ci`` (the default)
    About a thousand examples in all, derandomized (every run draws the same examples) and
    without an example database, so CI is repeatable: under a minute on two cores once the
    kernels are compiled.
``thorough``
    More than 10,000 examples in all, drawn afresh on each run (failures are kept in
    ``.hypothesis/`` and replayed first next time)::

        NUMATTN_HYPOTHESIS_PROFILE=thorough python -m pytest -p no:cacheprovider \\
            tests/test_properties.py -m "not cuda"

    (about five minutes on two cores once the kernels are compiled).  With
    ``NUMBA_ENABLE_CUDASIM=1`` (or a GPU) the ``cuda`` tests run decode and cross attention
    on the CUDA backend as well (``-m cuda``: 300 examples, about four minutes in the
    simulator).

A failure prints the drawn :class:`Problem`; it stays here as an ``@example`` of its test,
beside the edge cases every profile runs first.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import numattn
from numattn import (
    CausalMask,
    ChunkedCausalMask,
    ChunkedMask,
    ContinuousBatchingKVCache,
    FunctionMask,
    MaterializedMask,
    MHAConfig,
    NullMask,
    PagedKVCache,
    SlidingWindowCausalMask,
    reference,
    softcap,
)
from numattn.core import device as _device

from .utils import built_in_like

#: Per-dtype tolerance: ``|got - want| <= tol * (1 + |want|)`` (see the module docstring).
TOL = {np.dtype(np.float32): 2e-4, np.dtype(np.float64): 1e-10}

settings.register_profile(
    "ci", max_examples=100, deadline=None, derandomize=True, database=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "thorough", max_examples=1500, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
PROFILE = os.environ.get("NUMATTN_HYPOTHESIS_PROFILE", "ci")
BASE = settings.get_profile(PROFILE)


def examples(share):
    """This module's profile with ``share`` times its ``max_examples``."""
    return settings(BASE, max_examples=max(1, round(BASE.max_examples * share)))


#: The CUDA backend runs where numba.cuda has a GPU or the simulator (NUMBA_ENABLE_CUDASIM=1).
requires_cuda = pytest.mark.skipif(
    not _device.is_available(), reason="needs a CUDA GPU or the CUDA simulator "
                                       "(NUMBA_ENABLE_CUDASIM=1)")


# --------------------------------------------------------------------------------------
# What an example draws
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Problem:
    """One drawn problem: every shape and option, and the seed of its arrays."""

    dtype: str = "float32"
    padded: bool = False  # flash: padded [B, S, H, D] queries (else ragged [T, H, D])
    kind: str = "dense"  # K/V: "dense" [B, N, Hkv, D], "ragged" [T, Hkv, D], or a cache
    heads: int = 1
    kv_heads: int = 1
    head_dim: int = 4
    q_lens: tuple = (1,)  # query rows per sequence (padded: all equal)
    kv_lens: tuple = (1,)  # new K/V rows per sequence (dense: N rows, all equal)
    cache_lens: tuple = (0,)  # tokens cached before this step (caches only)
    kv_offsets: bool = False  # pass kv_input_row_offsets
    mask: object = None  # a Mask tree, or None
    additive: str | None = None  # None, "plain", "materialized", "and" (with the tree)
    additive_rank: int = 2
    neg_inf: float = 0.0  # share of -inf entries in the additive tensor
    bias_size: float = 1.0
    extra: int = 0  # spare rows / keys of additive tensors, rows of dense arrays
    sinks: str | None = None  # None, "normal", "extreme"
    scale: float | None = None
    config: MHAConfig | None = None
    num_partitions: int | None = None
    page_size: int = 4
    spare_pages: int = 0
    spare_entries: int = 0  # table entries past the ones in use / capacity past the keys
    sentinel: str = "past"  # what spare table entries hold: "past", "neg", "huge", "alias"
    table_dtype: str = "int64"
    offsets_dtype: str = "int64"
    poison: str = "nan"  # what unused slots hold: "nan", "inf", "-inf", "huge"
    poison_used: bool = False  # one used K or V slot holds NaN as well
    return_lse: bool = True
    out: str | None = None  # None, "buffer", or "q" (in place)
    functions: str | None = None  # None, "mask", "mask+softcap" (float32 only)
    seed: int = 0

    @property
    def batch(self):
        return len(self.q_lens)


def _leaf_masks():
    size = st.integers(1, 9)
    return st.one_of(st.just(NullMask()), st.just(CausalMask()),
                     st.builds(SlidingWindowCausalMask, size), st.builds(ChunkedMask, size),
                     st.builds(ChunkedCausalMask, size))


MASK_TREES = st.recursive(
    _leaf_masks(),
    lambda children: st.tuples(children, children, st.booleans()).map(
        lambda t: t[0] & t[1] if t[2] else t[0] | t[1]),
    max_leaves=4,
)


@st.composite
def _common(draw, *, small=False):
    """The fields every operation draws (``small`` for the CUDA simulator)."""
    kv_heads = draw(st.integers(1, 2 if small else 3))
    group = draw(st.sampled_from([1, 2, 3, 4, 8]))
    if small:
        group = min(group, 4)
    head_dim = draw(st.sampled_from([4, 1, 2, 3, 8] if small else
                                    [4, 1, 2, 3, 7, 8, 16, 17, 32, 64]))
    # (``mask | MaterializedMask`` is refused by the operations: a ValueError, not drawn)
    additive = draw(st.sampled_from([None, None, None, "plain", "materialized", "and"]))
    config = draw(st.one_of(
        st.none(),
        st.builds(MHAConfig, block_q=st.sampled_from([1, 2, 3, 8, 256]),
                  block_k=st.sampled_from([1, 2, 3, 5, 8, 128]),
                  threads_per_block=st.just(32)),
    ))
    dtype = draw(st.sampled_from(["float32", "float64"]))
    # mask and score functions: float32 only, two sets of functions (each compiles kernels)
    functions = draw(st.sampled_from([None] * 5 + ["mask", "mask+softcap"]))
    return dict(
        dtype=dtype, functions=functions if dtype == "float32" else None,
        heads=kv_heads * group, kv_heads=kv_heads, head_dim=head_dim,
        mask=draw(st.one_of(st.none(), MASK_TREES)) if additive != "plain" else None,
        additive=additive,
        additive_rank=draw(st.sampled_from([2, 3, 4])),
        neg_inf=draw(st.sampled_from([0.0, 0.3, 1.0])),
        bias_size=draw(st.sampled_from([1.0, 0.1, 5.0])),
        extra=draw(st.integers(0, 2)),
        scale=draw(st.sampled_from([None, 0.5, 0.01, 3.0, -0.7])),
        config=config,
        page_size=draw(st.sampled_from([4, 1, 2, 3, 5, 16])),
        spare_pages=draw(st.integers(0, 3)),
        spare_entries=draw(st.integers(0, 2)),
        sentinel=draw(st.sampled_from(["past", "neg", "huge", "alias"])),
        table_dtype=draw(st.sampled_from(["int64", "int32"])),
        offsets_dtype=draw(st.sampled_from(["int64", "int32", "uint32", "uint64"])),
        poison=draw(st.sampled_from(["nan", "inf", "-inf", "huge"])),
        poison_used=draw(st.integers(0, 9)) == 0,
        return_lse=draw(st.booleans()),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def _lengths(max_batch, high, min_batch=0):
    return st.integers(min_batch, max_batch).flatmap(
        lambda b: st.lists(st.integers(0, high), min_size=b, max_size=b).map(tuple))


@st.composite
def flash_padded_problems(draw):
    fields = draw(_common())
    batch = draw(st.integers(0, 3))
    s_len = draw(st.integers(0, 6))
    kind = draw(st.sampled_from(["dense", "continuous", "paged"]))
    if kind == "dense":  # N keys per sequence, fewer or more than the S queries
        n = draw(st.integers(0, 10))
        cache_lens, kv_lens = (0,) * batch, (n,) * batch
    else:
        cache_lens = tuple(draw(st.lists(st.integers(0, 12), min_size=batch, max_size=batch)))
        kv_lens = (s_len,) * batch
    return Problem(**fields, padded=True, kind=kind, q_lens=(s_len,) * batch, kv_lens=kv_lens,
                   cache_lens=cache_lens, sinks=draw(st.sampled_from([None, "normal", "extreme"])),
                   out=draw(st.sampled_from([None, "buffer", "q"])))


@st.composite
def flash_ragged_problems(draw):
    fields = draw(_common())
    q_lens = draw(_lengths(4, 6))
    batch = len(q_lens)
    kind = draw(st.sampled_from(["ragged", "continuous", "paged"]))
    kv_offsets = draw(st.booleans())
    kv_lens = (tuple(draw(st.lists(st.integers(0, 8), min_size=batch, max_size=batch)))
               if kv_offsets else q_lens)
    cache_lens = ((0,) * batch if kind == "ragged" else
                  tuple(draw(st.lists(st.integers(0, 12), min_size=batch, max_size=batch))))
    return Problem(**fields, kind=kind, q_lens=q_lens, kv_lens=kv_lens, cache_lens=cache_lens,
                   kv_offsets=kv_offsets, sinks=draw(st.sampled_from([None, "normal", "extreme"])),
                   out=draw(st.sampled_from([None, "buffer", "q"])))


@st.composite
def decode_problems(draw, small=False):
    fields = draw(_common(small=small))
    batch = draw(st.integers(0, 2 if small else 4))
    kind = draw(st.sampled_from(["dense", "continuous", "paged"]))
    if kind == "dense":
        n = draw(st.integers(0, 12))
        cache_lens, kv_lens = (0,) * batch, (n,) * batch
    else:
        cache_lens = tuple(draw(st.lists(st.integers(0, 12 if small else 40), min_size=batch,
                                         max_size=batch)))
        kv_lens = (1,) * batch
    return Problem(**fields, kind=kind, q_lens=(1,) * batch, kv_lens=kv_lens,
                   cache_lens=cache_lens, sinks=draw(st.sampled_from([None, "normal", "extreme"])),
                   num_partitions=draw(st.one_of(st.none(), st.integers(1, 9),
                                                 st.just(64))),
                   out=draw(st.sampled_from([None, "buffer", "q"])))


@st.composite
def cross_problems(draw, small=False):
    fields = draw(_common(small=small))
    q_lens = draw(_lengths(2 if small else 4, 4 if small else 6))
    batch = len(q_lens)
    kind = draw(st.sampled_from(["ragged", "dense", "continuous", "paged"]))
    kv_offsets = kind != "ragged" or draw(st.booleans())
    if kind == "dense" and not draw(st.booleans()):
        kv_offsets = False  # every sequence reads all N rows
    high = 6 if small else 10
    kv_lens = tuple(draw(st.lists(st.integers(0, high), min_size=batch, max_size=batch)))
    if kind == "ragged" and not kv_offsets:
        kv_lens = q_lens
    if kind == "dense" and not kv_offsets:
        kv_lens = (max(kv_lens, default=0),) * batch
    cache_lens = ((0,) * batch if kind in ("ragged", "dense") else
                  tuple(draw(st.lists(st.integers(0, high), min_size=batch, max_size=batch))))
    return Problem(**fields, kind=kind, q_lens=q_lens, kv_lens=kv_lens, cache_lens=cache_lens,
                   kv_offsets=kv_offsets, out=draw(st.sampled_from([None, "buffer"])))


# --------------------------------------------------------------------------------------
# Building the arrays of a problem
# --------------------------------------------------------------------------------------
POISON = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf, "huge": 1e30}


def _offsets(lengths, dtype="int64"):
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(dtype)


def _sentinel(p, rng, table, num_pages):
    info = np.iinfo(p.table_dtype)
    if p.sentinel == "past":
        return num_pages
    if p.sentinel == "neg":
        return -1
    if p.sentinel == "huge":
        return int(info.max)
    return int(rng.integers(0, max(num_pages, 1)))  # "alias": another sequence's page


def _kv_pair(p, rng, dtype, num_keys):
    """K and V of the problem's kind holding ``num_keys[b]`` keys of sequence ``b``; every
    slot no key uses holds the poison value."""
    batch, hkv, d = p.batch, p.kv_heads, p.head_dim
    poison = POISON[p.poison]
    if p.kind == "dense":
        n = max(p.kv_lens, default=0) + (p.extra if p.kv_offsets else 0)
        arrays = [np.full((batch, n, hkv, d), poison, dtype) for _ in range(2)]
        for x in arrays:
            for b in range(batch):
                x[b, :num_keys[b]] = rng.standard_normal((num_keys[b], hkv, d))
        return arrays
    if p.kind == "ragged":
        return [rng.standard_normal((int(sum(p.kv_lens)), hkv, d)).astype(dtype)
                for _ in range(2)]
    lengths = np.asarray(p.cache_lens, dtype=np.int64)
    if p.kind == "continuous":
        capacity = max(num_keys, default=0) + p.spare_entries
        blocks = [np.full((batch + p.spare_pages, capacity, hkv, d), poison, dtype)
                  for _ in range(2)]
        table = rng.permutation(batch + p.spare_pages)[:batch].astype(p.table_dtype)
        for x in blocks:
            for b in range(batch):
                x[table[b], :num_keys[b]] = rng.standard_normal((num_keys[b], hkv, d))
        return [ContinuousBatchingKVCache(x, lengths, table) for x in blocks]
    ps = p.page_size
    pages = [-(-n // ps) for n in num_keys]
    num_pages = sum(pages) + p.spare_pages
    order = rng.permutation(num_pages)  # pages in any order
    table = np.zeros((batch, max(pages, default=0) + p.spare_entries), dtype=p.table_dtype)
    table[:] = _sentinel(p, rng, table, num_pages)
    blocks = [np.full((num_pages, ps, hkv, d), poison, dtype) for _ in range(2)]
    used = 0
    for b in range(batch):
        table[b, :pages[b]] = order[used:used + pages[b]]
        used += pages[b]
        for x in blocks:
            for t in range(num_keys[b]):
                x[table[b, t // ps], t % ps] = rng.standard_normal((hkv, d))
    return [PagedKVCache(x, lengths, table) for x in blocks]


def _poison_one_used(p, rng, kv, num_keys):
    """NaN in one K or V element of a used slot (the reference shows which rows see it)."""
    live = [b for b in range(p.batch) if num_keys[b] > 0]
    if not live:
        return
    b = live[int(rng.integers(len(live)))]
    t = int(rng.integers(num_keys[b]))
    x = kv[int(rng.integers(2))]
    head, i = int(rng.integers(p.kv_heads)), int(rng.integers(p.head_dim))
    if p.kind == "dense":
        x[b, t, head, i] = np.nan
    elif p.kind == "ragged":
        x[int(sum(p.kv_lens[:b])) + t, head, i] = np.nan
    elif p.kind == "continuous":
        x.blocks[int(x.lookup_table[b]), t, head, i] = np.nan
    else:
        page = int(x.lookup_table[b, t // p.page_size])
        x.blocks[page, t % p.page_size, head, i] = np.nan


def _mask_arg(p, rng, dtype, rows, keys):
    """The ``mask`` argument: the tree, an additive tensor, or both combined, and with
    ``p.functions`` a FunctionMask standing for a random built-in mask."""
    mask = _tree_and_tensor(p, rng, dtype, rows, keys)
    if p.functions is None or "mask" not in p.functions:
        return mask
    function = FunctionMask(built_in_like, int(rng.integers(0, 5)), int(rng.integers(1, 6)))
    if mask is None:
        return function
    return (MaterializedMask(mask) if isinstance(mask, np.ndarray) else mask) & function


def _score_mod(p, rng):
    if p.functions is None or p.functions == "mask":
        return None
    return softcap(float(rng.choice([0.5, 5.0, 50.0])))


def _tree_and_tensor(p, rng, dtype, rows, keys):
    if p.additive is None:
        return p.mask
    batch, heads = p.batch, p.heads
    shape = {2: (rows, keys), 3: (batch, rows, keys), 4: (batch, heads, rows, keys)}
    tensor = (rng.standard_normal(shape[p.additive_rank]) * p.bias_size).astype(dtype)
    tensor[rng.random(tensor.shape) < p.neg_inf] = -np.inf
    if p.additive == "plain":
        return tensor
    if p.additive == "materialized" or p.mask is None:
        return MaterializedMask(tensor)
    return p.mask & MaterializedMask(tensor)


def _sinks(p, rng, dtype):
    if p.sinks is None:
        return None
    sinks = (rng.standard_normal(p.heads) * 3).astype(dtype)
    if p.sinks == "extreme":
        sinks[rng.random(p.heads) < 0.5] = rng.choice([-np.inf, 40.0, -40.0])
    return sinks


# --------------------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------------------
def assert_matches(got, want, dtype, what):
    """``got`` equals the float64 reference ``want`` within :data:`TOL`; NaN exactly where
    ``want`` has it, infinities equal."""
    got = np.asarray(got)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert got.dtype == dtype, (what, got.dtype)
    g = got.astype(np.float64)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(g), nan), f"{what}: NaN at {np.argwhere(np.isnan(g) != nan)[:5]}"
    inf = np.isinf(want)
    assert np.array_equal(g[inf], want[inf]), f"{what}: infinities differ"
    ok = ~(nan | inf)
    err = np.abs(g[ok] - want[ok])
    bound = TOL[np.dtype(dtype)] * (1 + np.abs(want[ok]))
    assert np.all(err <= bound), (
        f"{what}: error {err.max():.3g} over the tolerance {TOL[np.dtype(dtype)]:g}")


def _check(p, got, want, dtype, out_buffer):
    if p.return_lse:
        (got_out, got_lse), (want_out, want_lse) = got, want
        assert_matches(got_lse, want_lse, dtype, "lse")
    else:
        got_out, want_out = got, want
    if out_buffer is not None:
        assert got_out is out_buffer, "out= must be returned"
    assert_matches(got_out, want_out, dtype, "out")


def _out_buffer(p, q):
    if p.out == "buffer":
        return np.full(q.shape, 123.0, q.dtype)
    return q if p.out == "q" else None


# --------------------------------------------------------------------------------------
# Properties
# --------------------------------------------------------------------------------------
def _run_flash(p):
    dtype = np.dtype(p.dtype)
    rng = np.random.default_rng(p.seed)
    batch, s_len = p.batch, max(p.q_lens, default=0)
    if p.kind == "dense":
        num_keys = list(p.kv_lens)
    else:
        num_keys = [c + n for c, n in zip(p.cache_lens, p.kv_lens)]
    k, v = _kv_pair(p, rng, dtype, num_keys)
    if p.poison_used:
        _poison_one_used(p, rng, (k, v), num_keys)
    options = {}
    if p.padded:
        q = rng.standard_normal((batch, s_len, p.heads, p.head_dim)).astype(dtype)
        rows = s_len
    else:
        q = rng.standard_normal((sum(p.q_lens), p.heads, p.head_dim)).astype(dtype)
        options["q_input_row_offsets"] = _offsets(p.q_lens, p.offsets_dtype)
        if p.kv_offsets:
            options["kv_input_row_offsets"] = _offsets(p.kv_lens, p.offsets_dtype)
        rows = s_len + p.extra
    mask = _mask_arg(p, rng, dtype, rows, max(num_keys, default=0) + p.extra)
    options["sink_weights"] = _sinks(p, rng, dtype)
    options["score_mod"] = _score_mod(p, rng)
    want = reference.flash_attention_kv_cache(q, k, v, mask, p.scale, return_lse=p.return_lse,
                                              **options)
    out = _out_buffer(p, q)
    got = numattn.flash_attention_kv_cache(q, k, v, mask, p.scale, out=out,
                                           return_lse=p.return_lse, config=p.config,
                                           **options)
    _check(p, got, want, dtype, out)


@examples(1.5)
@given(flash_padded_problems())
@example(Problem(padded=True, q_lens=(), kv_lens=(), cache_lens=()))  # no sequences
@example(Problem(padded=True, kind="paged", q_lens=(0, 0), kv_lens=(0, 0), cache_lens=(3, 0),
                 out="buffer"))  # no query rows
@example(Problem(padded=True, q_lens=(1,), kv_lens=(1,), sinks="normal"))  # a single key
@example(Problem(padded=True, q_lens=(5,), kv_lens=(2,), mask=CausalMask()))  # N < S
@example(Problem(padded=True, kind="paged", heads=2, q_lens=(3, 3), kv_lens=(3, 3),
                 cache_lens=(0, 5), additive="plain", neg_inf=1.0, sinks="extreme"))
def test_flash_padded(p):
    _run_flash(p)


@examples(1.5)
@given(flash_ragged_problems())
@example(Problem(kind="paged", q_lens=(2, 0, 3), kv_lens=(2, 0, 3), cache_lens=(0, 4, 1),
                 sentinel="huge", spare_entries=2, mask=CausalMask()))
@example(Problem(kind="ragged", q_lens=(2, 1), kv_lens=(0, 3), cache_lens=(0, 0),
                 kv_offsets=True, mask=CausalMask()))  # a sequence without keys
def test_flash_ragged(p):
    _run_flash(p)


def _run_decode(p, device="cpu"):
    dtype = np.dtype(p.dtype)
    rng = np.random.default_rng(p.seed)
    num_keys = list(p.kv_lens) if p.kind == "dense" else [c + 1 for c in p.cache_lens]
    k, v = _kv_pair(p, rng, dtype, num_keys)
    if p.poison_used:
        _poison_one_used(p, rng, (k, v), num_keys)
    q = rng.standard_normal((p.batch, p.heads, p.head_dim)).astype(dtype)
    mask = _mask_arg(p, rng, dtype, 1, max(num_keys, default=0) + p.extra)
    if mask is None:
        mask = NullMask()
    sinks = _sinks(p, rng, dtype)
    score_mod = _score_mod(p, rng)
    want = reference.decode_attention(q, k, v, mask, p.scale, sink_weights=sinks,
                                      score_mod=score_mod, return_lse=p.return_lse)
    out = _out_buffer(p, q)
    got = numattn.decode_attention(q, k, v, mask, p.scale, sink_weights=sinks,
                                   score_mod=score_mod,
                                   num_partitions=p.num_partitions, device=device, out=out,
                                   return_lse=p.return_lse, config=p.config)
    _check(p, got, want, dtype, out)


@examples(2)
@given(decode_problems())
@example(Problem(kind="paged", q_lens=(1, 1), kv_lens=(1, 1), cache_lens=(0, 0), page_size=1,
                 num_partitions=64, sentinel="neg", spare_entries=2, out="q"))  # one key
@example(Problem(q_lens=(), kv_lens=(), cache_lens=()))  # no sequences
@example(Problem(q_lens=(1,), kv_lens=(0,), sinks="normal"))  # no keys: 0, lse = the sink
def test_decode(p):
    _run_decode(p)


def _run_cross(p, device="cpu"):
    dtype = np.dtype(p.dtype)
    rng = np.random.default_rng(p.seed)
    num_keys = [c + n for c, n in zip(p.cache_lens, p.kv_lens)]
    k, v = _kv_pair(p, rng, dtype, num_keys)
    if p.poison_used:
        _poison_one_used(p, rng, (k, v), num_keys)
    q = rng.standard_normal((sum(p.q_lens), p.heads, p.head_dim)).astype(dtype)
    q_offsets = _offsets(p.q_lens, p.offsets_dtype)
    kv_offsets = _offsets(p.kv_lens, p.offsets_dtype) if p.kv_offsets else None
    q_max_seq_len = max(p.q_lens, default=0) + p.extra
    mask = _mask_arg(p, rng, dtype, q_max_seq_len, max(num_keys, default=0) + p.extra)
    if mask is None:
        mask = NullMask()
    score_mod = _score_mod(p, rng)
    want = reference.cross_attention(q, q_offsets, q_max_seq_len, k, v, kv_offsets, mask,
                                     p.scale, score_mod=score_mod, return_lse=p.return_lse)
    out = _out_buffer(p, q)
    got = numattn.cross_attention(q, q_offsets, q_max_seq_len, k, v, kv_offsets, mask, p.scale,
                                  score_mod=score_mod, device=device, out=out,
                                  return_lse=p.return_lse, config=p.config)
    if p.batch == 0:  # returns at once: out untouched, nothing else to compare
        if out is not None:
            assert (got[0] if p.return_lse else got) is out
            assert np.all(out == 123.0)
        return
    _check(p, got, want, dtype, out)


@examples(2)
@given(cross_problems())
@example(Problem(kind="paged", q_lens=(), kv_lens=(), cache_lens=(), kv_offsets=True,
                 out="buffer"))  # no sequences: out untouched
@example(Problem(kind="continuous", q_lens=(2, 1), kv_lens=(0, 2), cache_lens=(0, 0),
                 kv_offsets=True))  # a sequence without keys
def test_cross(p):
    _run_cross(p)


@pytest.mark.cuda
@requires_cuda
@examples(0.1)
@given(decode_problems(small=True))
def test_decode_cuda(p):
    _run_decode(p, device="cuda")


@pytest.mark.cuda
@requires_cuda
@examples(0.1)
@given(cross_problems(small=True))
def test_cross_cuda(p):
    _run_cross(p, device="cuda")


@st.composite
def longer_problems(draw):
    """Problems with enough work for the worker threads: flash over a long paged cache with
    a few query rows per sequence, or a longer prefill, or decode over long caches."""
    op = draw(st.sampled_from(["flash few rows", "flash prefill", "decode"]))
    batch = draw(st.integers(1, 3))
    q_len = {"flash few rows": draw(st.integers(1, 16)), "flash prefill": 64, "decode": 1}[op]
    cache_lens = tuple(draw(st.lists(st.integers(300, 700), min_size=batch, max_size=batch)))
    kv_heads = draw(st.sampled_from([1, 2]))
    return op, Problem(
        dtype=draw(st.sampled_from(["float32", "float64"])), padded=op == "flash prefill",
        kind="paged", heads=kv_heads * draw(st.sampled_from([1, 4, 8])), kv_heads=kv_heads,
        head_dim=64, q_lens=(q_len,) * batch, kv_lens=(q_len,) * batch, cache_lens=cache_lens,
        mask=draw(st.sampled_from([NullMask(), CausalMask(), SlidingWindowCausalMask(200),
                                   ChunkedCausalMask(128)])),
        sinks=draw(st.sampled_from([None, "normal"])),
        config=draw(st.sampled_from([None, MHAConfig(block_k=16)])),
        num_partitions=draw(st.sampled_from([None, 3, 16])), page_size=16,
        sentinel="past", return_lse=True, seed=draw(st.integers(0, 2**32 - 1)))


@examples(0.25)
@given(longer_problems())
def test_longer_problems(case):
    op, p = case
    if op == "decode":
        _run_decode(dataclasses.replace(p, kv_lens=(1,) * p.batch))
    else:
        _run_flash(p)


@st.composite
def key_splits(draw):
    """A dense problem and a split of its keys into parts (some possibly empty)."""
    kv_heads = draw(st.integers(1, 2))
    n = draw(st.integers(0, 12))
    problem = Problem(
        dtype=draw(st.sampled_from(["float32", "float64"])), padded=True, kind="dense",
        heads=kv_heads * draw(st.sampled_from([1, 2, 3, 4, 8])), kv_heads=kv_heads,
        head_dim=draw(st.sampled_from([4, 1, 8, 17])),
        q_lens=(draw(st.integers(0, 4)),) * draw(st.integers(0, 2)), kv_lens=(n,),
        additive=draw(st.sampled_from([None, "plain"])),
        neg_inf=draw(st.sampled_from([0.0, 0.5, 1.0])),
        scale=draw(st.sampled_from([None, 3.0])), seed=draw(st.integers(0, 2**32 - 1)))
    return problem, draw(st.integers(1, 4)), draw(st.sampled_from(["list", "stacked"]))


@examples(1)
@given(key_splits())
def test_merge_states_of_key_splits(case):
    """Flash attention over disjoint subsets of the keys (``parts`` of them, some possibly
    empty), merged, is attention over all of them (an additive mask goes with its keys)."""
    p, parts, form = case
    dtype = np.dtype(p.dtype)
    rng = np.random.default_rng(p.seed)
    batch, s_len, n = p.batch, max(p.q_lens, default=0), p.kv_lens[0]
    q = rng.standard_normal((batch, s_len, p.heads, p.head_dim)).astype(dtype)
    k, v = (rng.standard_normal((batch, n, p.kv_heads, p.head_dim)).astype(dtype)
            for _ in range(2))
    bias = None
    if p.additive:
        bias = rng.standard_normal((batch, p.heads, s_len, n)).astype(dtype)
        bias[rng.random(bias.shape) < p.neg_inf] = -np.inf
    owner = rng.integers(0, parts, n)
    outs, lses = [], []
    for part in range(parts):
        keys = np.flatnonzero(owner == part)
        mask = NullMask() if bias is None else np.ascontiguousarray(bias[..., keys])
        out, lse = numattn.flash_attention_kv_cache(
            q, np.ascontiguousarray(k[:, keys]), np.ascontiguousarray(v[:, keys]), mask,
            p.scale, return_lse=True)
        outs.append(out)
        lses.append(lse)
    if form == "stacked":
        outs, lses = np.stack(outs), np.stack(lses)
    got = numattn.merge_states(outs, lses)
    want = reference.flash_attention_kv_cache(q, k, v, NullMask() if bias is None else bias,
                                              p.scale, return_lse=True)
    assert_matches(got[1], want[1], dtype, "lse")
    assert_matches(got[0], want[0], dtype, "out")


@st.composite
def merge_inputs(draw):
    rows = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
    return (draw(st.sampled_from(["float32", "float64"])), draw(st.integers(1, 4)), rows,
            draw(st.sampled_from([1, 3, 8])), draw(st.sampled_from(["list", "stacked"])),
            draw(st.integers(0, 2**32 - 1)))


@examples(1)
@given(merge_inputs())
def test_merge_states_matches_reference(case):
    """Any partial states, with empty parts (-inf) and NaN among them, in the list and the
    stacked forms (parts of one row: 0-d lses, 1-d outputs)."""
    name, parts, rows, d, form, seed = case
    dtype = np.dtype(name)
    rng = np.random.default_rng(seed)
    outs = rng.standard_normal((parts, *rows, d)).astype(dtype)
    lses = (rng.standard_normal((parts, *rows)) * 5).astype(dtype)
    lses[rng.random(lses.shape) < 0.3] = -np.inf
    lses[rng.random(lses.shape) < 0.05] = np.nan
    outs[rng.random(outs.shape) < 0.05] = np.nan
    want = reference.merge_states(list(outs), list(lses))
    got = numattn.merge_states(*((outs, lses) if form == "stacked" else (list(outs), list(lses))))
    assert_matches(got[0], want[0], dtype, "out")
    assert_matches(got[1], want[1], dtype, "lse")


@st.composite
def store_problems(draw):
    fields = draw(_common())
    cache_lens = draw(_lengths(4, 10))
    batch = len(cache_lens)
    kv_lens = tuple(draw(st.lists(st.integers(0, 6), min_size=batch, max_size=batch)))
    return Problem(**{**fields, "poison_used": False},
                   kind=draw(st.sampled_from(["continuous", "paged"])),
                   q_lens=kv_lens, kv_lens=kv_lens, cache_lens=cache_lens)


@examples(1)
@given(store_problems())
def test_store_kv(p):
    """store_kv puts row i of sequence b at token cache_lengths[b] + i and changes nothing
    else (spare table entries hold sentinels, pages are in any order)."""
    dtype = np.dtype(p.dtype)
    rng = np.random.default_rng(p.seed)
    num_keys = [c + n for c, n in zip(p.cache_lens, p.kv_lens)]
    cache, _ = _kv_pair(p, rng, dtype, num_keys)
    rows = rng.standard_normal((sum(p.kv_lens), p.kv_heads, p.head_dim)).astype(dtype)
    want = cache.blocks.copy()
    offsets = _offsets(p.kv_lens, p.offsets_dtype)
    for b in range(p.batch):
        for i in range(p.kv_lens[b]):
            t = p.cache_lens[b] + i
            if p.kind == "continuous":
                want[int(cache.lookup_table[b]), t] = rows[int(offsets[b]) + i]
            else:
                page = int(cache.lookup_table[b, t // p.page_size])
                want[page, t % p.page_size] = rows[int(offsets[b]) + i]
    assert numattn.store_kv(cache, rows, offsets) is cache
    assert np.array_equal(cache.blocks, want, equal_nan=True)
