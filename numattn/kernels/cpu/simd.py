"""CPU micro-kernels of decode and of the online softmax, written as explicit LLVM vector code.

Decode reads each K and V row once, so its speed is how well a core overlaps arithmetic with
streaming the rows from memory; the less arithmetic per row, the closer it gets to the
memory's rate.  Two inner blocks do nearly all of it, and LLVM's loop vectoriser leaves
each with overhead that these versions do not have:

* :func:`scores_block_4` (and ``_2``, ``_1``): the dot products of ``rows`` query heads with
  the K rows of four keys, one vector accumulator per product.  The vectoriser ends every
  dot product with its own horizontal sum (eight instructions each, 128 for sixteen
  products); here one tree of two-input shuffles sums sixteen accumulators in 15 vector
  additions and leaves the sums in one vector, stored four keys at a time.
* :func:`values_block_4` (and ``_2``, ``_1``): the weighted V rows of four keys added to the
  accumulator rows of ``rows`` query heads, each vector of V loaded once for all of them
  (sixteen multiply-adds per four loads of V), and no run-time test of whether the
  accumulators overlap the cache (the vectoriser's version tests that on every call).
* Both ask for the line :data:`STREAM_PREFETCH_BYTES` past each vector they load of a K or
  V row (on Intel cores: :func:`stream_prefetch_bytes`), so that the memory keeps reading
  each stream of rows while the core does the multiply-adds.
* :func:`values_tile_4` (and ``_2``, ``_1``): the same sum over a whole tile of keys for
  rows of at most :data:`TILE_VECTORS` vectors (D <= 64 in float32 with AVX-512): the
  accumulators stay in registers from the first key to the last, where the block version
  loads and stores them every four keys; with short rows those loads and stores, not the
  multiply-adds, took most of the time.

Three more serve the online softmax of decode and flash attention, in vectors of sixteen lanes
whatever the machine:

* :func:`row_max`: the largest score of a row (NaN if it holds one), as the largest of
  integer images of the scores, in the floats' order.
* :func:`exp_row`: ``e^(s - m)`` over a row in place (Cephes' ``expf`` or ``exp``), and
  its sum in an order fixed here, not by the compiler (:func:`lane_sum`): sixteen running
  sums, lane ``u`` taking elements ``u``, ``u + 16``, ..., then halves added to halves.
  Numba's loop vectoriser sums a row only with the ``reassoc`` fast-math flag, which
  numattn does not use (see :data:`numattn.core.jit.FASTMATH`); the sum is then the same on
  every machine too.
* :func:`exp_split_row`: the same weights written as two bfloat16 parts for the AMX tiles
  (:mod:`.amx`), the row's scale and the split done in the same pass (rounded by
  AVX512-BF16's ``vcvtneps2bf16`` where the target has it: "Flash prefill on AMX tiles"
  in docs/performance.rst).

Written as plain loops, both passes got 256-bit vectors from LLVM on AVX-512 machines
whose tuning prefers those (measured: "Softmax in explicit vector code" in
docs/performance.rst).

And two convert 16-bit queries and results (:mod:`.convert`): :func:`widen_span` (as the
flash gather's :func:`widen_row` widens K/V rows) and :func:`round_span` (float32 to
bfloat16 or float16, to the nearest, ties to even).

Each function is plain NumPy here (its definition, and what runs uncompiled); :func:`register`
gives it its compiled form (LLVM vectors as wide as the target's registers: 64 bytes with
AVX-512, 32 with AVX, else 16; the softmax's three in sixteen lanes), and
:func:`prefetch_row` and :func:`prefetch_head` their ``llvm.prefetch``; the LLVM code of
each is generated in :mod:`.simd_llvm`.
:func:`numattn.core.jit.cpu_jit` calls :func:`register` before it binds any body (Numba is
imported lazily).  Vector loads need the last axis of every array contiguous, as the kernels
pass them.
"""

from __future__ import annotations

import functools
import threading

import numpy as np

from ...core.dtypes import FORMAT_BFLOAT16, FORMAT_E4M3, FORMAT_E5M2
from ...core.jit import before_cpu_compile, cpu_intrinsic

__all__ = [
    "exp_row",
    "exp_split_row",
    "lane_sum",
    "prefetch_head",
    "prefetch_row",
    "register",
    "round_span",
    "row_max",
    "scores_block_1",
    "scores_block_2",
    "scores_block_4",
    "values_block_1",
    "values_block_2",
    "values_block_4",
    "values_tile_1",
    "values_tile_2",
    "values_tile_4",
    "values_tile_fits",
    "widen_row",
    "widen_span",
]

#: Keys per block: each block function handles four keys (four K or V rows).
BLOCK_KEYS = 4
#: Query heads per block that the functions come in (a KV head's group is cut into these).
BLOCK_ROWS = (4, 2, 1)
#: Vectors per row that :func:`values_tile_4` keeps in registers (4 rows of 4: sixteen)
#: on machines with 32 vector registers; half as many with 16 (:func:`tile_vectors`).
TILE_VECTORS = 4
#: Running sums of :func:`lane_sum` (lanes of its vector, on every machine).
SUM_LANES = 16
#: A cache line, what each prefetch request asks for.
LINE_BYTES = 64
#: The hardware prefetcher's page: it follows a stream of lines within one, and starts
#: again in the next (:func:`prefetch_row` warms that start).
PREFETCH_PAGE_BYTES = 4096
#: On Intel cores, :func:`scores_block_4` and :func:`values_block_4` (and ``_2``, ``_1``)
#: ask for the line this many bytes past each vector they load of a K or V row
#: (:func:`stream_prefetch_bytes`), so that each of a tile's streams of adjacent rows (see
#: :func:`.split_k._tile_rows`) is requested 1 KiB ahead of where it is read: the hardware
#: prefetcher alone left the core waiting on memory between the multiply-adds.  Measured:
#: "Decode stream prefetch" in docs/performance.rst.
STREAM_PREFETCH_BYTES = 1024
#: LLVM's names of AMD's x86 cores start so.  There software prefetches of every line of
#: the rows ahead made decode slower (the core's L1 miss buffers bound it), so
#: :func:`stream_prefetch_bytes` asks for none ("Where decode's time goes" in
#: docs/performance.rst).
AMD_CPU_PREFIXES = ("znver", "bdver", "btver", "amdfam", "barcelona", "athlon", "opteron",
                    "k8")


def lane_sum(row, n):
    """``row[0] + ... + row[n - 1]`` (1-D, contiguous) in a fixed order: lane ``u`` of
    :data:`SUM_LANES` running sums adds elements ``u``, ``u + 16``, ... in turn; then the
    first half of the lanes is added to the second, and again, down to one.

    The order in which :func:`exp_row` sums (plain NumPy only: compiled, the sum is part
    of :func:`exp_row`)."""
    lanes = np.zeros(SUM_LANES, dtype=row.dtype)
    whole = n - n % SUM_LANES
    for j in range(0, whole, SUM_LANES):
        lanes += row[j:j + SUM_LANES]
    lanes[:n - whole] += row[whole:n]
    while lanes.shape[0] > 1:
        half = lanes.shape[0] // 2
        lanes = lanes[:half] + lanes[half:]
    return lanes[0]


def row_max(row, n):
    """The largest of ``row[0] .. row[n - 1]`` (1-D, contiguous), NaN if one is NaN, ``-inf``
    for ``n = 0``.

    Compiled, it takes the maximum of order-preserving integer images of the elements (an
    integer maximum vectorises where a float one, which must respect NaN, does not; a NaN
    maps above ``+inf`` whatever its sign bit: ``inf - inf`` gives a NaN with the sign bit
    set on x86).
    """
    x = row[:n]
    if np.isnan(x).any():
        return row.dtype.type(np.nan)
    return x.max() if n else row.dtype.type(-np.inf)


#: Cephes' ``expf`` (float32) and ``exp`` (float64), as :func:`exp_row` computes them:
#: ``e^x = 2^k e^r`` with ``k = floor(x log2(e) + 1/2)`` and ``r = x - k ln(2)`` (``ln(2)`` in
#: two parts, :data:`EXP_LN2`); ``e^x`` is 0 below :data:`EXP_LOW` (the true value is below
#: the smallest normal number there).  float32: ``e^r = 1 + r + r^2 P(r)``; float64:
#: ``e^r = 1 + 2 r P(r^2) / (Q(r^2) - r P(r^2))``.  Keyed by the dtype's size in bytes.
EXP_LOW = {4: -87.33654, 8: -708.0}
EXP_LN2 = {4: (0.693359375, -2.12194440e-4), 8: (6.93145751953125e-1, 1.42860682030941723212e-6)}
EXP_LOG2E = 1.4426950408889634074
EXPF_P = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
          1.6666665459e-1, 5.0000001201e-1)
EXP_P = (1.26177193074810590878e-4, 3.02994407707441961300e-2, 9.99999999999999999910e-1)
EXP_Q = (3.00198505138664455042e-6, 2.52448340349684104192e-3, 2.27265548208155028766e-1,
         2.00000000000000000009e0)


def exponent_field(dtype):
    """``(mantissa bits, exponent bias)`` of a float dtype: ``2^k`` has the bits
    ``(k + bias) << mantissa`` (for ``k`` in the normal range)."""
    info = np.finfo(dtype)
    return int(info.nmant), int(info.maxexp) - 1


def exp_row(row, n, m):
    """``row[j] = e^(row[j] - m)`` for ``j < n`` (1-D, contiguous, ``m`` of its dtype and at
    least every element that is not NaN), and the sum of the new elements as
    :func:`lane_sum` sums them.

    Cephes' ``expf`` or ``exp`` (:data:`EXPF_P`, :data:`EXP_P`): within about 1 ulp of
    ``e^x``, exactly 0 below :data:`EXP_LOW` (so for ``-inf``), NaN where ``row[j] - m`` is NaN.
    """
    dtype = row.dtype.type
    size = row.dtype.itemsize
    low = dtype(EXP_LOW[size])
    with np.errstate(invalid="ignore", over="ignore"):
        x = row[:n] - dtype(m)
        xc = np.where(x > low, x, low)
        k = np.floor(xc * dtype(EXP_LOG2E) + dtype(0.5))
        r = xc - k * dtype(EXP_LN2[size][0]) - k * dtype(EXP_LN2[size][1])
        if size == 4:
            y = np.full_like(r, EXPF_P[0])
            for c in EXPF_P[1:]:
                y = y * r + dtype(c)
            y = y * (r * r) + r + dtype(1)
        else:
            rr = r * r
            px = r * ((EXP_P[0] * rr + EXP_P[1]) * rr + EXP_P[2])
            qx = ((EXP_Q[0] * rr + EXP_Q[1]) * rr + EXP_Q[2]) * rr + EXP_Q[3]
            y = 1 + 2 * (px / (qx - px))
        mantissa, bias = exponent_field(row.dtype)
        int_type = np.dtype(f"i{size}").type
        scale = ((k.astype(int_type) + int_type(bias)) << int_type(mantissa)).view(row.dtype)
        scale = np.where(x < low, dtype(0), scale)
        row[:n] = np.where(np.isnan(x), x, y) * scale
    return lane_sum(row, n)


def exp_split_row(row, n, m, scale, raw, hi, lo, start):
    """The weights :func:`exp_row` makes of ``row[:n]`` (left as it is) written as two
    bfloat16 parts (bits), ``hi[start + j] + lo[start + j]``: ``hi`` the weight and ``lo``
    the rest, each rounded to the nearest, ties to even, values below float32's normal
    range counting as zero (as AVX512-BF16's ``vcvtneps2bf16`` rounds, which does it where
    the target has it, and as the AMX tiles read bfloat16): 16 significant bits.  Returns
    the weights' sum, as :func:`exp_row` sums them.  With ``raw`` the row holds sums
    ``q . k`` not yet scaled, and the scores are
    :func:`~numattn.kernels.shared.scores.read_score` of ``scale`` times them (the AMX
    tiles' scores, read in the same pass).  ``m`` is the scores' maximum."""
    from ...core.dtypes import ml_dtype

    bfloat16 = ml_dtype("bfloat16")

    def rounded(values):
        tiny = np.abs(values) < np.finfo(np.float32).tiny
        return np.where(tiny, np.copysign(np.float32(0), values), values).astype(bfloat16)

    x = row[:n].copy()
    if raw:
        x *= scale
        x[x == -np.inf] = np.nan
    total = exp_row(x, n, m)
    x = x.astype(np.float32)
    upper = rounded(x)
    hi[start:start + n] = upper.view(np.uint16)
    lo[start:start + n] = rounded(x - upper.astype(np.float32)).view(np.uint16)
    return total


def prefetch_row(blocks, page, slot, num_lines):
    """Ask the CPU to start loading the first ``num_lines`` 64-byte lines (at most a row's
    worth) of the :data:`PREFETCH_PAGE_BYTES` page that holds the start of row
    ``blocks[page, slot]``: the page a stream of rows enters next, wherever in it the row
    starts (a hint, which never faults: nothing happens in plain Python).  Nothing for
    strided (head-major) ``blocks``, where each KV head's rows are a stream of their own
    that the hardware prefetcher follows better without them ("Head-major K/V" in
    docs/performance.rst)."""


def prefetch_head(blocks, page, slot, head):
    """Ask the CPU to start loading the lines of one KV head's row ``blocks[page, slot,
    head]`` (a hint, which never faults: nothing happens in plain Python).  The flash
    kernel's gather reads one head's row from each token's row of all heads, rows that
    stride through memory and that the hardware prefetcher does not follow."""


def widened(rows, kv_format, like):
    """Stored K/V ``rows`` (a kernel view) as values of ``like``'s dtype (plain NumPy: the
    definition the compiled block functions widen by)."""
    from ...core.dtypes import FORMAT_NATIVE, ml_dtype

    if kv_format == FORMAT_NATIVE or rows.dtype == np.int8:
        return rows.astype(like.dtype)
    name = {FORMAT_BFLOAT16: "bfloat16", FORMAT_E4M3: "float8_e4m3fn",
            FORMAT_E5M2: "float8_e5m2"}.get(kv_format)
    view = rows.view(np.float16) if name is None else rows.view(ml_dtype(name))
    return view.astype(like.dtype)


def widen_row(blocks, page, slot, head, dest, start, kv_format):
    """``dest[start:start + D] = blocks[page, slot, head]`` widened to ``dest``'s dtype (a
    row of a kernel view of K or V, in its stored format ``kv_format``): the flash kernel's
    gather of a tile."""
    row = blocks[page, slot, head]
    dest[start:start + row.shape[0]] = widened(row, kv_format, dest)


def widen_span(bits, dest, start, count, kv_format):
    """``dest[start:start + count]`` = ``bits[start:start + count]`` widened to ``dest``'s
    dtype (1-D and contiguous, ``bits`` a kernel view in the format ``kv_format``): 16-bit
    queries made the compute dtype."""
    dest[start:start + count] = widened(bits[start:start + count], kv_format, dest)


def round_span(values, bits, start, count):
    """``bits[start:start + count]`` = ``values[start:start + count]`` (float32) rounded
    to the nearest 16-bit float, ties to even, as the bits of a kernel view (1-D and
    contiguous): ``uint16`` holds bfloat16 (NaN becomes the quiet NaN of its sign, as
    ``ml_dtypes`` gives), ``int16`` float16 (as NumPy rounds; a NaN stays a quiet NaN):
    results of the compute dtype made q's dtype.  ``bits`` of ``values``' dtype get the
    values as they are."""
    from ...core.dtypes import ml_dtype

    if bits.dtype == values.dtype:
        bits[start:start + count] = values[start:start + count]
        return
    dtype = np.float16 if bits.dtype == np.int16 else ml_dtype("bfloat16")
    bits[start:start + count] = values[start:start + count].astype(dtype).view(bits.dtype)


def _scores_block(rows):
    def scores_block(qs, h, k_blocks, j, pages, slots, i, n, scores, kv_format):
        for b in range(BLOCK_KEYS):
            if i + b < n:
                key_row = widened(k_blocks[pages[i + b], slots[i + b], j], kv_format, qs)
                scores[h:h + rows, i + b] = qs[h:h + rows] @ key_row

    scores_block.__name__ = scores_block.__qualname__ = f"scores_block_{rows}"
    scores_block.__doc__ = f"""Dot products of query heads ``h .. h + {rows - 1}`` with the K rows
    of block positions ``i .. i + 3``: ``scores[h + a, i + b] = qs[h + a] . K_b`` with
    ``K_b = k_blocks[pages[i + b], slots[i + b], j]``, for the positions ``i + b < n``.
    Positions past ``n`` are neither written nor read (the compiled form reads the row of
    position ``n - 1`` in their place)."""
    return scores_block


def _values_block(rows):
    def values_block(weights, h, v_blocks, j, pages, slots, i, acc, kv_format):
        for b in range(BLOCK_KEYS):
            value_row = widened(v_blocks[pages[i + b], slots[i + b], j], kv_format, acc)
            acc[h:h + rows] += weights[h:h + rows, i + b, None] * value_row

    values_block.__name__ = values_block.__qualname__ = f"values_block_{rows}"
    values_block.__doc__ = f"""Weighted V rows of block positions ``i .. i + 3`` (all in range)
    added to query heads ``h .. h + {rows - 1}``: ``acc[h + a] += sum_b weights[h + a, i + b]
    * V_b`` with ``V_b = v_blocks[pages[i + b], slots[i + b], j]``."""
    return values_block


def _values_tile(rows):
    def values_tile(weights, h, v_blocks, j, pages, slots, n, acc, kv_format):
        value_rows = widened(v_blocks[pages[:n], slots[:n], j], kv_format, acc)  # [n, D]
        acc[h:h + rows] += weights[h:h + rows, :n] @ value_rows

    values_tile.__name__ = values_tile.__qualname__ = f"values_tile_{rows}"
    values_tile.__doc__ = f"""Weighted V rows of block positions ``0 .. n - 1`` added to query
    heads ``h .. h + {rows - 1}``: ``acc[h + a] += sum_p weights[h + a, p] * V_p`` with
    ``V_p = v_blocks[pages[p], slots[p], j]``, the accumulators held in registers over all
    ``n`` positions.  Only for rows of at most :data:`TILE_VECTORS` vectors
    (:func:`values_tile_fits`)."""
    return values_tile


def values_tile_fits(head_dim, itemsize, vector_bytes=None, vector_registers=None):
    """Whether rows of ``head_dim`` elements of ``itemsize`` bytes fit the registers of
    :func:`values_tile_4` (:func:`tile_vectors` vectors of this machine's width)."""
    vector_bytes = vector_bytes or target_vector_bytes()
    vector_registers = vector_registers or target_vector_registers()
    return head_dim * itemsize <= tile_vectors(vector_registers) * vector_bytes


def tile_vectors(vector_registers):
    """Vectors per row :func:`values_tile_4` keeps in registers: :data:`TILE_VECTORS` with
    32 vector registers, half as many with 16 (four rows' sums, four weights and a row of V
    must fit them)."""
    return TILE_VECTORS if vector_registers >= 32 else TILE_VECTORS // 2


def keys_per_pass(rows, vector_registers):
    """Keys of a block that one pass over the rows of :func:`scores_block_4` (and
    :func:`values_block_4`, ``_2``, ``_1``) handles: as many of the four as keep the pass's
    ``rows * keys`` sums (or weights), ``rows`` query vectors and ``keys`` K or V vectors
    in ``vector_registers`` registers, with two to spare (a block that does not fit spills
    vectors on every step).  Four heads by four keys need 24: with AVX2's or SSE's 16
    registers they take two passes of two keys."""
    keys = BLOCK_KEYS
    while keys > 1 and rows * keys + rows + keys > vector_registers - 2:
        keys //= 2
    return keys


scores_block_4 = _scores_block(4)
scores_block_2 = _scores_block(2)
scores_block_1 = _scores_block(1)
values_block_4 = _values_block(4)
values_block_2 = _values_block(2)
values_block_1 = _values_block(1)
values_tile_4 = _values_tile(4)
values_tile_2 = _values_tile(2)
values_tile_1 = _values_tile(1)

_REGISTERED = []
_REGISTER_LOCK = threading.Lock()


def register():
    """Give the functions of this module their compiled forms (once per process, also when
    several threads make their first call at once)."""
    if _REGISTERED:
        return
    with _REGISTER_LOCK:
        if _REGISTERED:
            return
        from numba.extending import overload

        intrinsics = build_intrinsics(target_vector_bytes())
        for name, intrinsic in intrinsics.items():
            function = globals()[name]
            # for other jitted callers (tests): inlined into the caller (as Numba IR), as a
            # call would pass every array field by field, a few hundred bytes of arguments
            overload(function, inline="always")(_FORWARDERS[name](intrinsic))
            cpu_intrinsic(function, intrinsic)  # numattn's kernels: no reference counts
        _REGISTERED.append(True)


# ``@overload`` typing functions whose implementations call an intrinsic (Numba wants the
# parameters of the function, the typing function and the implementation to agree).
def _forward_scores(intrinsic):
    def typer(qs, h, k_blocks, j, pages, slots, i, n, scores, kv_format):
        def impl(qs, h, k_blocks, j, pages, slots, i, n, scores, kv_format):
            intrinsic(qs, h, k_blocks, j, pages, slots, i, n, scores, kv_format)

        return impl

    return typer


def _forward_values(intrinsic):
    def typer(weights, h, v_blocks, j, pages, slots, i, acc, kv_format):
        def impl(weights, h, v_blocks, j, pages, slots, i, acc, kv_format):
            intrinsic(weights, h, v_blocks, j, pages, slots, i, acc, kv_format)

        return impl

    return typer


def _forward_values_tile(intrinsic):
    def typer(weights, h, v_blocks, j, pages, slots, n, acc, kv_format):
        def impl(weights, h, v_blocks, j, pages, slots, n, acc, kv_format):
            intrinsic(weights, h, v_blocks, j, pages, slots, n, acc, kv_format)

        return impl

    return typer


def _forward_widen_row(intrinsic):
    def typer(blocks, page, slot, head, dest, start, kv_format):
        def impl(blocks, page, slot, head, dest, start, kv_format):
            intrinsic(blocks, page, slot, head, dest, start, kv_format)

        return impl

    return typer


def _forward_widen_span(intrinsic):
    def typer(bits, dest, start, count, kv_format):
        def impl(bits, dest, start, count, kv_format):
            intrinsic(bits, dest, start, count, kv_format)

        return impl

    return typer


def _forward_round_span(intrinsic):
    def typer(values, bits, start, count):
        def impl(values, bits, start, count):
            intrinsic(values, bits, start, count)

        return impl

    return typer


def _forward_row(intrinsic):
    def typer(row, n):
        def impl(row, n):
            return intrinsic(row, n)

        return impl

    return typer


def _forward_prefetch_head(intrinsic):
    def typer(blocks, page, slot, head):
        def impl(blocks, page, slot, head):
            intrinsic(blocks, page, slot, head)

        return impl

    return typer


def _forward_prefetch(intrinsic):
    def typer(blocks, page, slot, num_lines):
        def impl(blocks, page, slot, num_lines):
            intrinsic(blocks, page, slot, num_lines)

        return impl

    return typer


def _forward_exp_row(intrinsic):
    def typer(row, n, m):
        def impl(row, n, m):
            return intrinsic(row, n, m)

        return impl

    return typer


def _forward_exp_split_row(intrinsic):
    def typer(row, n, m, scale, raw, hi, lo, start):
        def impl(row, n, m, scale, raw, hi, lo, start):
            return intrinsic(row, n, m, scale, raw, hi, lo, start)

        return impl

    return typer


#: The forwarder of each function, by its name.
_FORWARDERS = {
    "prefetch_row": _forward_prefetch, "prefetch_head": _forward_prefetch_head,
    "row_max": _forward_row, "exp_row": _forward_exp_row,
    "exp_split_row": _forward_exp_split_row, "widen_row": _forward_widen_row,
    "widen_span": _forward_widen_span, "round_span": _forward_round_span,
    **{f"scores_block_{rows}": _forward_scores for rows in BLOCK_ROWS},
    **{f"values_block_{rows}": _forward_values for rows in BLOCK_ROWS},
    **{f"values_tile_{rows}": _forward_values_tile for rows in BLOCK_ROWS},
}


@functools.cache
def target_vector_bytes():
    """Width of the vector registers Numba compiles for: 64 bytes with AVX-512, 32 with
    AVX, else 16 (SSE, NEON).  Follows ``NUMBA_CPU_FEATURES`` when it is set (read once per
    process, as Numba does: asking LLVM for the host's features takes ~0.3 ms)."""
    import llvmlite.binding as llvm
    from numba.core import config

    features = config.CPU_FEATURES
    if features is None:
        features = llvm.get_host_cpu_features().flatten()
    enabled = {f[1:] for f in features.split(",") if f.startswith("+")}
    if "avx512f" in enabled:
        return 64
    return 32 if "avx" in enabled else 16


@functools.cache
def target_vector_registers():
    """Vector registers of the target: 32 with AVX-512 and on 64-bit Arm, else 16 (AVX,
    AVX2, SSE).  Follows ``NUMBA_CPU_FEATURES`` when it is set."""
    import platform

    if platform.machine().lower() in ("aarch64", "arm64"):
        return 32
    return 32 if target_vector_bytes() == 64 else 16


@functools.cache
def stream_prefetch_bytes():
    """How far ahead of each vector load of a K or V row the block functions ask for a line:
    :data:`STREAM_PREFETCH_BYTES` on x86 cores other than AMD's (it was measured on Intel's),
    0 (no requests) on AMD's (:data:`AMD_CPU_PREFIXES`) and other architectures.  Follows
    ``NUMBA_CPU_NAME`` when it is set, as Numba does."""
    import platform

    import llvmlite.binding as llvm
    from numba.core import config

    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return 0
    name = (config.CPU_NAME or llvm.get_host_cpu_name()).lower()
    return 0 if name.startswith(AMD_CPU_PREFIXES) else STREAM_PREFETCH_BYTES


@functools.cache
def target_converts_bfloat16():
    """Whether the target has AVX512-BF16's conversions (``vcvtneps2bf16``): every CPU
    with AMX does.  Follows ``NUMBA_CPU_FEATURES`` when it is set."""
    import llvmlite.binding as llvm
    from numba.core import config

    features = config.CPU_FEATURES
    if features is None:
        features = llvm.get_host_cpu_features().flatten()
    return "+avx512bf16" in features.split(",")


def build_intrinsics(vector_bytes, prefetch_bytes=None, vector_registers=None,
                     converts_bfloat16=None):
    """The Numba intrinsics of this module's functions, for vectors of ``vector_bytes``
    (their LLVM code is in :mod:`.simd_llvm`).

    ``prefetch_bytes`` (default :func:`stream_prefetch_bytes`) is how far ahead of its
    loads of K and V rows each block function asks for lines, 0 for not at all;
    ``vector_registers`` (default :func:`target_vector_registers`) how many vector
    registers the blocks may keep busy (:func:`keys_per_pass`, :func:`tile_vectors`);
    ``converts_bfloat16`` (default :func:`target_converts_bfloat16`) whether
    :func:`exp_split_row` rounds with AVX512-BF16's instruction.  Returns ``{function
    name: intrinsic}``.  (:func:`register` installs them; tests also build them for other
    machines' widths, register counts and roundings, with and without the requests.)
    """
    from . import simd_llvm

    if prefetch_bytes is None:
        prefetch_bytes = stream_prefetch_bytes()
    if vector_registers is None:
        vector_registers = target_vector_registers()
    if converts_bfloat16 is None:
        converts_bfloat16 = target_converts_bfloat16()
    if converts_bfloat16:  # (its inline assembly)
        import llvmlite.binding as llvm

        llvm.initialize_native_asmparser()
    built = {"prefetch_row": simd_llvm.prefetch_row_intrinsic(),
             "prefetch_head": simd_llvm.prefetch_head_intrinsic(),
             "row_max": simd_llvm.row_max_intrinsic(),
             "exp_row": simd_llvm.exp_row_intrinsic(),
             "exp_split_row": simd_llvm.exp_split_row_intrinsic(converts_bfloat16),
             "widen_row": simd_llvm.widen_row_intrinsic(vector_bytes),
             "widen_span": simd_llvm.widen_span_intrinsic(vector_bytes),
             "round_span": simd_llvm.round_span_intrinsic(vector_bytes)}
    for rows in BLOCK_ROWS:
        keys = keys_per_pass(rows, vector_registers)
        built[f"scores_block_{rows}"] = simd_llvm.scores_block_intrinsic(
            rows, vector_bytes, prefetch_bytes, keys)
        built[f"values_block_{rows}"] = simd_llvm.values_block_intrinsic(
            rows, vector_bytes, prefetch_bytes, keys)
        built[f"values_tile_{rows}"] = simd_llvm.values_tile_intrinsic(
            rows, vector_bytes, tile_vectors(vector_registers))
    return built


before_cpu_compile(register)
