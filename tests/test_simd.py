"""The explicit-vector CPU micro-kernels of decode (:mod:`numattn.kernels.cpu.simd`) against
NumPy in float64, built for every vector width (so this machine also checks the AVX and SSE/NEON
code), in both dtypes, for blocks of 1, 2 and 4 query heads, head dimensions with and
without a tail, and blocks cut short by the end of a tile (and the whole-tile sums of
short rows); the row max, exponentials and sum of the online softmax; and decode's block
order."""

from __future__ import annotations

import functools

import numba
import numpy as np
import pytest

from numattn.core import dtypes
from numattn.kernels.cpu import simd as _simd

from . import internals
from .utils import assert_close, randn

PREFETCH_KEYS = internals.cpu_split_k.PREFETCH_KEYS


#: This machine's (vector bytes, vector registers).
HERE = (_simd.target_vector_bytes(), _simd.target_vector_registers())


def _builds(*builds):
    """Parameter sets of intrinsic builds (a vector width and register count, with the bytes
    ahead the blocks ask for rows' lines, if given): those of this machine's width and
    registers run in the fast tier, the others (each a compile of its own, for other
    machines) are ``slow``."""
    return [pytest.param(*build, marks=() if tuple(build[:2]) == HERE else pytest.mark.slow)
            for build in builds]


WIDTHS = [16, 32, 64]
#: (vector bytes, vector registers) of the targets: SSE and AVX2 (16 registers: blocks of
#: four heads in two passes of two keys, tiles of two vectors), AVX-512 and NEON (32).
TARGETS = [(16, 16), (32, 16), (64, 32), (16, 32)]
#: (vector bytes, registers, bytes ahead the blocks ask for rows' lines): every target with
#: the requests (whatever this machine's default), and AVX-512 without them
BLOCK_BUILDS = _builds(*((*target, _simd.STREAM_PREFETCH_BYTES) for target in TARGETS),
                       (64, 32, 0))
DTYPES = [np.float32, np.float64]
#: (compute dtype, K/V storage dtype name): the native pairs, and float32 reading every
#: other storage format (in this machine's vector width; :func:`stored_pairs`)
NATIVE_PAIRS = [(np.float32, "float32"), (np.float64, "float64")]
STORED_PAIRS = [(np.float32, name) for name in
                ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "int8", "float64")]
HEAD_DIMS = [1, 5, 16, 37, 128]
GROUPS = [1, 2, 3, 4, 5, 6, 7, 8]  # query heads per KV head in blocks of 4, 2, 1 (7: 4+2+1)
NUM_KEYS = [1, 3, 4, 7, 12]  # the last block cut short, or not


@functools.cache
def kernels(vector_bytes, vector_registers, prefetch_bytes=_simd.STREAM_PREFETCH_BYTES):
    """Jitted loops over every block of a tile, calling the intrinsics of one width and
    register count (whose blocks ask for lines ``prefetch_bytes`` ahead of their loads)."""
    built = _simd.build_intrinsics(vector_bytes, prefetch_bytes, vector_registers)
    scores_4, scores_2, scores_1 = (built[f"scores_block_{r}"] for r in (4, 2, 1))
    values_4, values_2, values_1 = (built[f"values_block_{r}"] for r in (4, 2, 1))
    tile_4, tile_2, tile_1 = (built[f"values_tile_{r}"] for r in (4, 2, 1))
    prefetch = built["prefetch_row"]
    prefetch_head = built["prefetch_head"]

    widen = built["widen_row"]

    @numba.njit
    def all_scores(blocks, group, qs, k_blocks, pages, slots, n, scores, kv_format):
        for i in range(0, n, 4):
            prefetch(k_blocks, pages[i], slots[i], 1000)  # more lines than a row has
            for h, rows in blocks:
                j = h // group
                if rows == 4:
                    scores_4(qs, h, k_blocks, j, pages, slots, i, n, scores, kv_format)
                elif rows == 2:
                    scores_2(qs, h, k_blocks, j, pages, slots, i, n, scores, kv_format)
                else:
                    scores_1(qs, h, k_blocks, j, pages, slots, i, n, scores, kv_format)

    @numba.njit
    def all_values(blocks, group, weights, v_blocks, pages, slots, n, acc, kv_format):
        for i in range(0, n - n % 4, 4):
            for h, rows in blocks:
                j = h // group
                prefetch_head(v_blocks, pages[i + 3], slots[i + 3], j)  # (the flash gather's)
                if rows == 4:
                    values_4(weights, h, v_blocks, j, pages, slots, i, acc, kv_format)
                elif rows == 2:
                    values_2(weights, h, v_blocks, j, pages, slots, i, acc, kv_format)
                else:
                    values_1(weights, h, v_blocks, j, pages, slots, i, acc, kv_format)

    @numba.njit
    def tile_values(blocks, group, weights, v_blocks, pages, slots, n, acc, kv_format):
        for h, rows in blocks:
            j = h // group
            if rows == 4:
                tile_4(weights, h, v_blocks, j, pages, slots, n, acc, kv_format)
            elif rows == 2:
                tile_2(weights, h, v_blocks, j, pages, slots, n, acc, kv_format)
            else:
                tile_1(weights, h, v_blocks, j, pages, slots, n, acc, kv_format)

    @numba.njit
    def gather(blocks, pages, slots, j, dest, kv_format):
        for i in range(pages.shape[0]):
            widen(blocks, pages[i], slots[i], j, dest, i * blocks.shape[3], kv_format)

    return all_scores, all_values, tile_values, gather


def head_blocks(num_heads, group):
    """``[first head, rows]`` of each block, as decode forms them (``internals.block_rows``)."""
    blocks = []
    for first in range(0, num_heads, group):
        h = first
        while h < first + group:
            rows = internals.block_rows(first + group - h)
            blocks.append((h, rows))
            h += rows
    return np.array(blocks, dtype=np.int64)


@pytest.mark.parametrize("group, sizes", [(1, [1]), (2, [2]), (3, [2, 1]), (4, [4]),
                                          (5, [4, 1]), (6, [4, 2]), (7, [4, 2, 1]),
                                          (8, [4, 4]), (11, [4, 4, 2, 1])])
def test_head_blocks(group, sizes):
    """A KV head's query heads go in blocks of 4, then 2, then 1."""
    blocks = head_blocks(2 * group, group)
    assert blocks[:, 1].tolist() == sizes * 2
    assert blocks[:, 0].tolist() == (np.cumsum([0] + sizes * 2)[:-1]).tolist()


def problem(rng, group, head_dim, num_keys, dtype, storage=None):
    """Query rows, a shuffled pool of K/V rows of ``storage`` (NaN in the rows no key uses;
    int8: extreme values), and the (page, slot) of each of ``num_keys`` block positions.
    The pool is returned as the kernels read it (:func:`stored`)."""
    kv_heads = 2
    storage = np.dtype(dtype).name if storage is None else storage
    wide = randn(rng, (2, 3, 5, kv_heads, head_dim), np.float32)
    if storage == "int8":
        blocks = np.clip(np.rint(wide * 40), -127, 127).astype(np.int8)
    else:
        blocks = wide.astype(storage_dtype(storage))
    rows = rng.permutation(15)[:num_keys]
    unused = np.setdiff1d(np.arange(15), rows)
    blocks[:, unused // 5, unused % 5] = -128 if storage == "int8" else np.nan
    qs = randn(rng, (kv_heads * group, head_dim), dtype)
    return qs, stored(blocks[0]), stored(blocks[1]), rows // 5, rows % 5


def storage_dtype(name):
    return dtypes.ml_dtype(name) if name in ("bfloat16", "float8_e4m3fn",
                                                "float8_e5m2") else np.dtype(name)


class Stored:
    """A K/V pool as a kernel reads it (``view``, ``kv_format``) and its values (float64)."""

    def __init__(self, blocks):
        self.view = dtypes.kernel_view(blocks)
        self.kv_format = dtypes.storage_format(blocks.dtype)
        self.values = blocks.astype(np.float64)


def stored(blocks):
    return Stored(blocks)


def cases(rng, dtype, vector_bytes, key_counts, storage=None):
    """Every (group, head dim, key count): a problem and a label for failures."""
    for group in GROUPS:
        for head_dim in HEAD_DIMS:
            for n in key_counts:
                what = (f"{vector_bytes}-byte vectors, {storage} storage, group {group}, "
                        f"D={head_dim}, n={n}")
                yield group, n, problem(rng, group, head_dim, n, dtype, storage), what


@pytest.mark.parametrize("dtype, storage", NATIVE_PAIRS + STORED_PAIRS)
def test_widen_row(dtype, storage, rng):
    """The flash gather's widening copy of rows: exactly the stored values, every bit
    pattern of the 8-bit formats included (tails masked: nothing past D written)."""
    gather = kernels(*HERE)[3]
    for head_dim in HEAD_DIMS:
        _, k_blocks, _, pages, slots = problem(rng, 1, head_dim, 9, dtype, storage)
        if storage.startswith("float8") or storage == "int8":  # all 256 patterns
            bits = np.arange(256, dtype=np.uint8)
            size = k_blocks.view.size
            k_blocks.view.reshape(-1).view(np.uint8)[:] = np.resize(bits, size)
            k_blocks.values = k_blocks.view.view(storage_dtype(storage)).astype(np.float64)
        buffer = np.full(9 * head_dim + 3, np.nan, dtype)
        gather(k_blocks.view, pages, slots, 1, buffer, k_blocks.kv_format)
        expected = k_blocks.values[pages, slots, 1].reshape(-1)
        assert np.array_equal(buffer[:-3], expected.astype(dtype), equal_nan=True), storage
        assert np.isnan(buffer[-3:]).all()


@functools.cache
def spans(vector_bytes):
    """Jitted calls of :func:`.simd.widen_span` and :func:`.simd.round_span` of one width."""
    built = _simd.build_intrinsics(vector_bytes)
    widen, round_ = built["widen_span"], built["round_span"]

    @numba.njit
    def widen_span(bits, dest, start, count, kv_format):
        widen(bits, dest, start, count, kv_format)

    @numba.njit
    def round_span(values, bits, start, count):
        round_(values, bits, start, count)

    return widen_span, round_span


def hard_to_round(rng):
    """float32 values whose rounding to bfloat16 and float16 is hard: random bit patterns,
    both formats' halfway points (ties), their overflow and subnormal ranges, NaN with and
    without payloads, infinities, zeros."""
    random = rng.integers(0, 2**32, 40000, dtype=np.uint64).astype(np.uint32)
    bf16_ties = rng.integers(0, 2**16, 4000, dtype=np.uint64).astype(np.uint32) << 16 | 0x8000
    f16_ties = rng.integers(0, 2**19, 4000, dtype=np.uint64).astype(np.uint32) << 13 | 0x1000
    specials = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000,
                         0x7F800001, 0xFFBFFFFF, 1, 0x807FFFFF, 0x477FEFFF, 0x477FF000,
                         0x477FE000, 0x33000000, 0x33000001, 0x387FC000, 0x38800000,
                         0x7F7FFFFF, 0x7F7F8000], dtype=np.uint32)
    return np.concatenate([random, bf16_ties, f16_ties, specials]).view(np.float32)


@pytest.mark.parametrize("vector_bytes", [pytest.param(
    width, marks=() if width == HERE[0] else pytest.mark.slow) for width in WIDTHS])
@pytest.mark.parametrize("name", ["bfloat16", "float16"])
def test_widen_and_round_spans(vector_bytes, name, rng):
    """16-bit queries widened and results rounded (:mod:`numattn.kernels.cpu.convert`):
    every bit pattern widened exactly; float32 values rounded as ``ml_dtypes`` (bfloat16,
    NaN included) and NumPy (float16; a NaN stays a NaN) round them; spans that start and
    end inside a vector write nothing outside."""
    widen_span, round_span = spans(vector_bytes)
    dtype = storage_dtype(name)
    every = np.arange(2**16, dtype=np.uint16).view(dtype)
    wide = np.full(every.shape, -7.0, np.float32)
    widen_span(dtypes.kernel_view(every), wide, 3, every.size - 8, dtypes.storage_format(dtype))
    assert np.array_equal(wide[3:-5], every[3:-5].astype(np.float32), equal_nan=True)
    assert np.all(wide[:3] == -7) and np.all(wide[-5:] == -7)

    values = hard_to_round(rng)
    rounded = np.full(values.shape, 7, dtype)
    round_span(values, dtypes.kernel_view(rounded), 3, values.size - 8)
    with np.errstate(over="ignore", invalid="ignore"):
        expected = values.astype(dtype)
    got_bits, expected_bits = rounded.view(np.uint16)[3:-5], expected.view(np.uint16)[3:-5]
    nan = np.isnan(values[3:-5])
    assert np.array_equal(got_bits[~nan], expected_bits[~nan])
    assert np.isnan(rounded[3:-5][nan].astype(np.float32)).all()
    if name == "bfloat16":  # ml_dtypes' NaN: the quiet NaN of the value's sign
        assert np.array_equal(got_bits[nan], expected_bits[nan])
    assert np.all(rounded[:3] == 7) and np.all(rounded[-5:] == 7)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_round_span_copies_a_result_of_its_dtype(dtype, rng):
    """Results of the compute dtype itself are copied, NaN and its payload included, and
    nothing outside the span is written."""
    _, round_span = spans(HERE[0])
    values = np.concatenate([rng.standard_normal(37), [np.nan, -np.inf, -0.0]]).astype(dtype)
    values[-3] = np.frombuffer(np.array([0x7FC01234], np.uint32).tobytes(), np.float32)[0]
    copied = np.full(values.shape, 7, dtype)
    round_span(values, copied, 2, values.size - 3)
    assert np.array_equal(copied[2:-1].view(f"u{values.itemsize}"),
                          values[2:-1].view(f"u{values.itemsize}"))
    assert np.all(copied[:2] == 7) and copied[-1] == 7


def expected_scores(qs, k_blocks, pages, slots, group):
    keys = k_blocks.values[pages, slots]  # [n, Hkv, D]
    heads = np.arange(qs.shape[0])
    return np.einsum("hd,nhd->hn", qs.astype(np.float64), keys[:, heads // group])


def block_cases():
    """(vector bytes, registers, bytes ahead, compute dtype, storage): every build in the
    native pairs, the other storage formats in this machine's build."""
    return ([pytest.param(*build.values, *pair, marks=build.marks)
             for build in BLOCK_BUILDS for pair in NATIVE_PAIRS]
            + [(*HERE, _simd.STREAM_PREFETCH_BYTES, *pair) for pair in STORED_PAIRS])


BLOCK_PARAMETERS = "vector_bytes, vector_registers, prefetch_bytes, dtype, storage"


@pytest.mark.parametrize(BLOCK_PARAMETERS, block_cases())
def test_scores_blocks(vector_bytes, vector_registers, prefetch_bytes, dtype, storage, rng):
    all_scores = kernels(vector_bytes, vector_registers, prefetch_bytes)[0]
    for group, n, (qs, k_blocks, _, pages, slots), what in cases(rng, dtype, vector_bytes,
                                                                 NUM_KEYS, storage):
        # a strided view: positions past n, if written, would land in the margin
        buffer = np.full((qs.shape[0], n + 4), np.nan, dtype)
        scores = buffer[:, :n]
        all_scores(head_blocks(qs.shape[0], group), group, qs, k_blocks.view, pages, slots, n,
                   scores, k_blocks.kv_format)
        expected = expected_scores(qs, k_blocks, pages, slots, group)
        assert_close(scores, expected, dtype, what=what)
        assert np.isnan(buffer[:, n:]).all(), what


@pytest.mark.parametrize(BLOCK_PARAMETERS, block_cases())
def test_values_blocks(vector_bytes, vector_registers, prefetch_bytes, dtype, storage, rng):
    all_values = kernels(vector_bytes, vector_registers, prefetch_bytes)[1]
    for group, n, (qs, _, v_blocks, pages, slots), what in cases(rng, dtype, vector_bytes,
                                                                 (4, 8, 12), storage):
        weights = randn(rng, (qs.shape[0], n), dtype)
        acc = randn(rng, qs.shape, dtype)
        values = v_blocks.values[pages, slots]  # [n, Hkv, D]
        heads = np.arange(qs.shape[0])
        expected = acc + np.einsum("hn,nhd->hd", weights.astype(np.float64),
                                   values[:, heads // group])
        all_values(head_blocks(qs.shape[0], group), group, weights, v_blocks.view, pages, slots,
                   n, acc, v_blocks.kv_format)
        assert_close(acc, expected, dtype, what=what)


def tile_cases():
    """(vector bytes, registers, compute dtype, storage): as :func:`block_cases`."""
    return ([pytest.param(*build.values, *pair, marks=build.marks)
             for build in _builds(*TARGETS) for pair in NATIVE_PAIRS]
            + [(*HERE, *pair) for pair in STORED_PAIRS])


@pytest.mark.parametrize("vector_bytes, vector_registers, dtype, storage", tile_cases())
def test_values_tiles(vector_bytes, vector_registers, dtype, storage, rng):
    """The whole-tile sums, for every row short enough for them (tails masked, no element
    past D read or written: the rows no key uses hold NaN, and acc sits in a NaN margin)."""
    tile_values = kernels(vector_bytes, vector_registers)[2]
    tested = 0
    for head_dim in [1, 3, 4, 5, 16, 37, 64, 65]:
        if not _simd.values_tile_fits(head_dim, np.dtype(dtype).itemsize, vector_bytes,
                                      vector_registers):
            continue
        for group in GROUPS:
            for n in NUM_KEYS:
                what = (f"{vector_bytes}-byte vectors, {vector_registers} registers, "
                        f"group {group}, D={head_dim}, n={n}")
                qs, _, v_blocks, pages, slots = problem(rng, group, head_dim, n, dtype,
                                                        storage)
                weights = randn(rng, (qs.shape[0], n), dtype)
                buffer = np.full((qs.shape[0], head_dim + 3), np.nan, dtype)
                acc = buffer[:, :head_dim]
                acc[...] = randn(rng, qs.shape, dtype)
                values = v_blocks.values[pages, slots]  # [n, Hkv, D]
                heads = np.arange(qs.shape[0])
                expected = acc + np.einsum("hn,nhd->hd", weights.astype(np.float64),
                                           values[:, heads // group])
                tile_values(head_blocks(qs.shape[0], group), group, weights, v_blocks.view,
                            pages, slots, n, acc, v_blocks.kv_format)
                assert_close(acc, expected, dtype, what=what)
                assert np.isnan(buffer[:, head_dim:]).all(), what
                tested += 1
    assert tested >= len(GROUPS) * len(NUM_KEYS) * 2  # at least two head dims per width


@pytest.mark.parametrize("dtype", DTYPES)
def test_lane_sum(dtype, rng):
    """The order of the online softmax's row sums (:func:`test_exp_row` checks that the
    compiled sums follow it bitwise): the sum of the first ``n`` elements, in the dtype."""
    for n in [0, 1, 15, 16, 17, 100, 128, 1000]:
        row = randn(rng, n + 5, dtype)  # elements past n must not count
        total = _simd.lane_sum(row, n)
        assert total.dtype == dtype
        assert abs(total - row[:n].astype(np.float64).sum()) <= 1e-5 * (n + 1)
    row = randn(rng, 40, dtype) * dtype(1000)
    lanes = row[:16] + row[16:32]  # lane u: elements u, u + 16, u + 32 in turn
    lanes[:8] += row[32:]
    for width in [8, 4, 2, 1]:  # then halves added to halves
        lanes = lanes[:width] + lanes[width:2 * width]
    assert _simd.lane_sum(row, 40).tobytes() == lanes[0].tobytes()


@functools.cache
def compiled_row_functions(vector_bytes):
    """``row_max`` and ``exp_row`` built for ``vector_bytes`` (their lanes are sixteen
    whatever the width), jitted."""
    built = _simd.build_intrinsics(vector_bytes)
    row_max, exp_row = built["row_max"], built["exp_row"]
    return (numba.njit(lambda row, n: row_max(row, n)),
            numba.njit(lambda row, n, m: exp_row(row, n, m)))


def softmax_row(rng, n, dtype, special):
    """A row of ``n`` scores of ``dtype`` (``special``: with -inf, a large, a tiny and, past
    the first, a NaN of either sign among them), followed by five elements that must not
    count."""
    row = randn(rng, n + 5, dtype) * dtype(20)
    row[n:] = dtype(1e30)  # past the row: neither its max nor its sum may see these
    if special and n >= 4:
        row[rng.integers(n)] = -np.inf
        row[rng.integers(n)] = dtype(-1e4)  # e^x far below the dtype's range: exactly 0
        row[rng.integers(n)] = dtype(np.finfo(dtype).tiny)
    return row


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_max(dtype, rng):
    """The largest element, NaN (either sign) above everything, -inf for an empty row;
    compiled for every vector width and uncompiled alike."""
    for vector_bytes in WIDTHS:
        compiled, _ = compiled_row_functions(vector_bytes)
        for n in [0, 1, 15, 16, 17, 40, 128, 1000]:
            for special in [False, True]:
                row = softmax_row(rng, n, dtype, special)
                expected = row[:n].max() if n else -np.inf
                for got in compiled(row, n), _simd.row_max(row, n):
                    assert got == expected, (vector_bytes, n, special)
                if n >= 2:
                    for nan in [np.nan, -np.nan, -(np.inf - np.inf)]:
                        with_nan = row.copy()
                        with_nan[n - 2] = nan
                        assert np.isnan(compiled(with_nan, n)) and np.isnan(
                            _simd.row_max(with_nan, n))
        all_hidden = np.full(20, -np.inf, dtype)
        assert compiled(all_hidden, 20) == -np.inf
        assert compiled(np.array([np.inf, 1], dtype), 2) == np.inf
    with pytest.raises(numba.core.errors.TypingError, match="contiguous"):
        compiled_row_functions(64)[0](randn(rng, 8, dtype)[::2], 4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_exp_row(dtype, rng):
    """``e^(s - m)`` in place within 2 ulp of float64 ``exp`` of the rounded ``s - m``
    (exactly 0 below the dtype's range, NaN where ``s`` is NaN), elements past ``n``
    untouched, and the sum of the new row in :func:`numattn.kernels.cpu.simd.lane_sum`'s order,
    bitwise; compiled for every vector width and uncompiled alike."""
    ulp = np.finfo(dtype).eps
    smallest = np.finfo(dtype).tiny
    for vector_bytes in WIDTHS:
        _, compiled = compiled_row_functions(vector_bytes)
        for n in [0, 1, 15, 16, 17, 40, 128, 1000]:
            for special in [False, True]:
                row = softmax_row(rng, n, dtype, special)
                if special and n >= 2:
                    row[n - 1] = np.nan
                m = row[:n][~np.isnan(row[:n])].max() if n else dtype(0)
                with np.errstate(invalid="ignore"):
                    x = row[:n] - dtype(m)  # rounded as the kernel rounds it
                expected = np.exp(x.astype(np.float64))
                for run in compiled, _simd.exp_row:
                    got = row.copy()
                    total = run(got, n, dtype(m))
                    assert dtype(total).tobytes() == dtype(_simd.lane_sum(got, n)).tobytes()
                    assert np.array_equal(got[n:], row[n:])
                    assert np.array_equal(np.isnan(got[:n]), np.isnan(row[:n]))
                    normal = expected >= smallest
                    assert np.all(np.abs(got[:n][normal] - expected[normal])
                                  <= 2 * ulp * expected[normal]), (vector_bytes, n, run)
                    assert np.all(got[:n][expected < smallest * 2**-30] == 0)
    with pytest.raises(numba.core.errors.TypingError, match="dtype"):
        compiled_row_functions(64)[1](randn(rng, 8, np.float32), 4, 0.0)


@functools.cache
def compiled_exp_split_row(converts_bfloat16):
    """``exp_split_row`` (sixteen lanes whatever the width), jitted."""
    split = _simd.build_intrinsics(64, converts_bfloat16=converts_bfloat16)["exp_split_row"]
    return numba.njit(lambda row, n, m, scale, raw, hi, lo, start: split(
        row, n, m, scale, raw, hi, lo, start))


#: exp_split_row's roundings: in integer arithmetic, and with AVX512-BF16's instruction
#: where this machine has it.
SPLIT_ROUNDINGS = [False] + [True] * _simd.target_converts_bfloat16()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("raw", [False, True])
@pytest.mark.parametrize("converts_bfloat16", SPLIT_ROUNDINGS)
def test_exp_split_row(dtype, raw, converts_bfloat16, rng):
    """The weights of :func:`test_exp_row` (of ``scale`` times the row, ``-inf`` made NaN,
    with ``raw``) as two bfloat16 parts: ``hi`` the weight rounded to nearest, ``lo`` the
    rest rounded to nearest (bitwise as ``ml_dtypes`` rounds, values below float32's normal
    range as zero), ``hi + lo`` within 2^-16 of the weight; the weights and their sum
    bitwise :func:`.simd.exp_row`'s; the row and the parts' other elements untouched;
    compiled (either rounding) and uncompiled alike."""
    bfloat16 = dtypes.ml_dtype("bfloat16")
    tiny = np.finfo(np.float32).tiny
    _, compiled_exp_row = compiled_row_functions(64)
    scale = dtype(0.125) if raw else dtype(1)
    start = 3
    for n in [0, 1, 15, 16, 17, 40, 128, 1000]:
        for special in [False, True]:
            row = softmax_row(rng, n, dtype, special)
            if special and n >= 2:
                row[n - 1] = np.nan
            scores = row.copy()
            if raw:
                scores *= scale
                scores[scores == -np.inf] = np.nan
            finite = scores[:n][~np.isnan(scores[:n])]
            m = finite.max() if finite.size else dtype(0)
            for run, exp_row in [(compiled_exp_split_row(converts_bfloat16), compiled_exp_row),
                                 (_simd.exp_split_row, _simd.exp_row)]:
                weights = scores.copy()
                total = exp_row(weights, n, dtype(m))
                weights = weights[:n].astype(np.float32)
                hi_expected = np.where(weights < tiny, 0, weights).astype(bfloat16)
                rest = weights - hi_expected.astype(np.float32)
                lo_expected = np.where(np.abs(rest) < tiny, 0 * rest, rest).astype(bfloat16)
                got_row = row.copy()
                hi = np.full(n + 6, 0xABCD, np.uint16)
                lo = np.full(n + 6, 0xABCD, np.uint16)
                got = run(got_row, n, dtype(m), scale, raw, hi, lo, start)
                assert dtype(got).tobytes() == dtype(total).tobytes(), (n, run)
                assert got_row.tobytes() == row.tobytes()
                assert (hi[:start] == 0xABCD).all() and (hi[start + n:] == 0xABCD).all()
                assert (lo[:start] == 0xABCD).all() and (lo[start + n:] == 0xABCD).all()
                parts = [x[start:start + n].view(bfloat16) for x in (hi, lo)]
                np.testing.assert_array_equal(parts[0].view(np.uint16),
                                              hi_expected.view(np.uint16))
                np.testing.assert_array_equal(np.isnan(parts[1]), np.isnan(lo_expected))
                ok = ~np.isnan(lo_expected)
                np.testing.assert_array_equal(parts[1][ok].view(np.uint16),
                                              lo_expected[ok].view(np.uint16))
                split = parts[0].astype(np.float64) + parts[1].astype(np.float64)
                error = np.abs(split - weights)
                assert (error <= np.maximum(2.0**-16 * weights, tiny))[~np.isnan(weights)].all()
    with pytest.raises(numba.core.errors.TypingError, match="uint16"):
        compiled_exp_split_row(False)(randn(rng, 8, np.float32), 4, 0.0, 1.0, False,
                                 np.zeros(8, np.int16), np.zeros(8, np.uint16), 0)


def test_values_tile_fits():
    """Up to TILE_VECTORS vectors per row with 32 registers, half as many with 16."""
    assert _simd.values_tile_fits(64, 4, 64, 32) and not _simd.values_tile_fits(65, 4, 64, 32)
    assert _simd.values_tile_fits(32, 8, 64, 32) and not _simd.values_tile_fits(33, 8, 64, 32)
    assert _simd.values_tile_fits(16, 4, 16, 32) and not _simd.values_tile_fits(17, 4, 16, 32)
    assert _simd.values_tile_fits(16, 4, 32, 16) and not _simd.values_tile_fits(17, 4, 32, 16)
    assert _simd.values_tile_fits(8, 4, 16, 16) and not _simd.values_tile_fits(9, 4, 16, 16)


@pytest.mark.parametrize("rows, vector_registers, expected", [
    (4, 32, 4), (2, 32, 4), (1, 32, 4), (4, 16, 2), (2, 16, 4), (1, 16, 4)])
def test_keys_per_pass_fit_the_registers(rows, vector_registers, expected):
    """Four heads by four keys in one pass with 32 registers, in two passes of two with
    16 (sixteen sums, four query vectors and four K rows would not fit them)."""
    assert _simd.keys_per_pass(rows, vector_registers) == expected


@pytest.mark.parametrize("dtype, storage", [(np.float64, "float64"), (np.float32, "bfloat16"),
                                            (np.float32, "float8_e4m3fn"),
                                            (np.float32, "int8")])
def test_plain_python_definitions_match(dtype, storage, rng):
    """The NumPy definitions (what runs uncompiled) compute the same blocks."""
    group, n = 4, 7
    qs, k_blocks, v_blocks, pages, slots = problem(rng, group, 9, n, dtype, storage)
    scores = np.full((qs.shape[0], n), np.nan, dtype)
    for i in range(0, n, 4):
        for h in range(0, qs.shape[0], 4):
            _simd.scores_block_4(qs, h, k_blocks.view, h // group, pages, slots, i, n, scores,
                                 k_blocks.kv_format)
    assert_close(scores, expected_scores(qs, k_blocks, pages, slots, group), dtype)
    acc = np.zeros(qs.shape, dtype)
    for h in range(0, qs.shape[0], 2):
        _simd.values_block_2(scores, h, v_blocks.view, h // group, pages, slots, 0, acc,
                             v_blocks.kv_format)
    values = v_blocks.values[pages[:4], slots[:4]][:, np.arange(qs.shape[0]) // group]
    assert_close(acc, np.einsum("hn,nhd->hd", scores[:, :4], values), dtype)
    tiled = np.zeros(qs.shape, dtype)
    for h in range(0, qs.shape[0], 4):
        _simd.values_tile_4(scores, h, v_blocks.view, h // group, pages, slots, n, tiled,
                            v_blocks.kv_format)
    values = v_blocks.values[pages, slots][:, np.arange(qs.shape[0]) // group]
    assert_close(tiled, np.einsum("hn,nhd->hd", scores, values), dtype)
    row = np.full(9, np.nan, dtype)
    _simd.widen_row(k_blocks.view, pages[0], slots[0], 1, row, 0, k_blocks.kv_format)
    assert np.array_equal(row, k_blocks.values[pages[0], slots[0], 1].astype(dtype))


@pytest.mark.parametrize("num_keys", [1, 3, 4, 9, 128, 130])
@pytest.mark.parametrize("next_keys", [0, 2, 128])
@pytest.mark.parametrize("interleave", [True, False])
def test_block_order_is_a_permutation_in_quarters_or_in_order(num_keys, next_keys, interleave,
                                                              rng):
    """Four streams (a quarter of the tile each) for a tile the mask shows whole, the keys in
    order for one it hides in part."""
    page_size, k0 = 5, 7
    pages_per_seq = -(-(k0 + num_keys + next_keys + 3) // page_size)
    table = rng.permutation(2 * pages_per_seq).reshape(2, pages_per_seq)
    row_base = np.array([0, 3])
    size = num_keys + PREFETCH_KEYS
    pages, slots = np.full(size, -1), np.full(size, -1)
    keys = np.full(num_keys, -1)
    ahead = internals.tile_rows(table, page_size, row_base, 1, k0, num_keys, next_keys,
                                interleave, pages, slots, keys)

    def row_of(key):
        p = row_base[1] + k0 + key
        return table[1, p // page_size], p % page_size

    assert sorted(keys) == list(range(num_keys))
    for r in range(num_keys):
        assert (pages[r], slots[r]) == row_of(keys[r])
    quarter = num_keys // 4 if interleave else 0
    for m in range(quarter):  # block m: one key from each quarter of the tile
        assert list(keys[4 * m:4 * m + 4]) == [m, m + quarter, m + 2 * quarter, m + 3 * quarter]
    assert list(keys[4 * quarter:]) == list(range(4 * quarter, num_keys))
    # then the first block of the next tile
    assert ahead == min(PREFETCH_KEYS, next_keys)
    step = max(next_keys // 4, 1)
    for r in range(ahead):
        assert (pages[num_keys + r], slots[num_keys + r]) == row_of(num_keys + r * step)


@pytest.mark.parametrize("cpu_name, machine, expected", [
    ("rocketlake", "x86_64", _simd.STREAM_PREFETCH_BYTES),
    ("sapphirerapids", "x86_64", _simd.STREAM_PREFETCH_BYTES),
    ("znver4", "x86_64", 0),
    ("znver2", "AMD64", 0),
    ("neoverse-v1", "aarch64", 0),
])
def test_stream_prefetch_follows_the_target_cpu(cpu_name, machine, expected, monkeypatch):
    """The block functions ask for rows' lines ahead on the x86 cores where that was
    measured faster, not on AMD's (slower there) nor on other architectures; the CPU
    named by ``NUMBA_CPU_NAME`` counts, as it does for Numba."""
    import platform

    from numba.core import config

    monkeypatch.setattr(config, "CPU_NAME", cpu_name)
    monkeypatch.setattr(platform, "machine", lambda: machine)
    _simd.stream_prefetch_bytes.cache_clear()
    try:
        assert _simd.stream_prefetch_bytes() == expected
    finally:
        _simd.stream_prefetch_bytes.cache_clear()


def test_kernel_bindings_call_the_intrinsics():
    """numattn's CPU bindings name the intrinsics themselves in place of the plain
    functions, whose inlined overloads would count the references of their array arguments
    at every call (``numattn.core.jit.cpu_intrinsic``)."""
    from numattn.core import jit
    from numattn.kernels.cpu import amx, flash, softmax, split_k

    _simd.register()
    amx.register()
    calls = [(split_k._tile_scores, _simd, ["prefetch_row", "scores_block_4", "scores_block_1"]),
             (split_k._tile_values, _simd, ["prefetch_row", "values_block_2", "values_tile_4"]),
             (softmax.softmax_tile, _simd, ["row_max", "exp_row"]),
             (softmax.softmax_split_tile, _simd, ["row_max", "exp_split_row"]),
             (flash._pack_tile, amx, ["prefetch_head", "pack_keys", "pack_values"])]
    for func, module, names in calls:
        scope = jit._rebind(func, "cpu").__globals__
        for name in names:
            plain = getattr(module, name, None) or getattr(_simd, name)
            assert scope[name] is jit._CPU_INTRINSICS[id(plain)][1], (func.__name__, name)
    flash_scope = jit._rebind(flash._run_item, "cpu").__globals__
    assert flash_scope["round_span"] is jit._CPU_INTRINSICS[id(_simd.round_span)][1]
