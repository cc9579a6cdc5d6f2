"""The LLVM code of :mod:`.simd`'s functions: one builder of Numba intrinsics per family.

Each builder returns a fresh ``@intrinsic`` whose code generator emits LLVM IR through
llvmlite: explicit vectors, masked loads and stores for a row's tail, ``llvm.fma`` and
``llvm.prefetch``.  :func:`.simd.build_intrinsics` calls them (this module imports Numba and
llvmlite, so it is imported only when a CPU kernel is first compiled); what each function
computes is said by its plain-NumPy definition in :mod:`.simd`.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba.core import cgutils, errors, types
from numba.extending import intrinsic

from ...core.dtypes import FORMAT_E5M2
from .simd import (
    BLOCK_KEYS,
    EXP_LN2,
    EXP_LOG2E,
    EXP_LOW,
    EXP_P,
    EXP_Q,
    EXPF_P,
    LINE_BYTES,
    PREFETCH_PAGE_BYTES,
    SUM_LANES,
    TILE_VECTORS,
    exponent_field,
)

I16 = ir.IntType(16)
I32 = ir.IntType(32)
I64 = ir.IntType(64)


# --------------------------------------------------------------------------------------
# IR helpers.
# --------------------------------------------------------------------------------------
def const(value):
    """An LLVM ``i64`` constant."""
    return ir.Constant(I64, value)


def vector_const(element, values):
    """An LLVM vector constant of ``element`` type holding ``values``."""
    return ir.Constant(ir.VectorType(element, len(values)), list(values))


def call(builder, name, return_type, args):
    """A call of the LLVM function (intrinsic) ``name``, declared on first use."""
    fnty = ir.FunctionType(return_type, [a.type for a in args])
    return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), args)


def prefetch_line(builder, pointer):
    """Ask for the line that holds ``pointer`` (``i8*``): a hint, which never faults."""
    # read, high temporal locality (prefetcht0 on x86), data cache
    call(builder, "llvm.prefetch.p0", ir.VoidType(),
         [pointer, ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])


def broadcast(builder, scalar, lanes):
    """A vector of ``lanes`` copies of ``scalar``."""
    one = builder.insert_element(ir.Constant(ir.VectorType(scalar.type, lanes), None),
                                 scalar, ir.Constant(I32, 0))
    return builder.shuffle_vector(one, one, vector_const(I32, [0] * lanes))


class Vectors:
    """Vector loads, stores and arithmetic on the rows of one array dtype.

    Vectors of ``vector_bytes`` (or ``lanes`` lanes).
    """

    def __init__(self, context, builder, dtype, vector_bytes=0, lanes=None):
        self.builder = builder
        self.itemsize = np.dtype(str(dtype)).itemsize
        self.lanes = lanes or max(1, vector_bytes // self.itemsize)
        element = context.get_data_type(dtype)
        self.type = ir.VectorType(element, self.lanes)
        letter = "f" if np.dtype(str(dtype)).kind == "f" else "i"
        self.name = f"v{self.lanes}{letter}{8 * self.itemsize}"

    def _ptr(self, ptr, offset):
        return self.builder.bitcast(self.builder.gep(ptr, [offset]), self.type.as_pointer())

    def load(self, ptr, offset, mask=None):
        if mask is None:
            return self.builder.load(self._ptr(ptr, offset), align=self.itemsize,
                                     typ=self.type)
        return call(self.builder, f"llvm.masked.load.{self.name}.p0", self.type,
                    [self._ptr(ptr, offset), ir.Constant(I32, self.itemsize), mask,
                     ir.Constant(self.type, None)])

    def store(self, value, ptr, offset, mask=None):
        if mask is None:
            self.builder.store(value, self._ptr(ptr, offset), align=self.itemsize)
        else:
            call(self.builder, f"llvm.masked.store.{self.name}.p0", ir.VoidType(),
                 [value, self._ptr(ptr, offset), ir.Constant(I32, self.itemsize), mask])

    def fma(self, a, b, c):
        return call(self.builder, f"llvm.fma.{self.name}", self.type, [a, b, c])

    def splat(self, scalar):
        return broadcast(self.builder, scalar, self.lanes)

    def first_lanes(self, count):
        """Mask of the lanes ``< count`` (the tail of a row)."""
        return self.builder.icmp_unsigned("<", vector_const(I64, range(self.lanes)),
                                          broadcast(self.builder, count, self.lanes))

    def over_row(self, length, step):
        """Run ``step(offset, mask)`` over the vectors of a row of ``length`` elements:
        whole vectors (``mask`` None), then the tail under a mask."""
        builder = self.builder
        whole = builder.udiv(length, const(self.lanes))
        with cgutils.for_range(builder, whole) as loop:
            step(builder.mul(loop.index, const(self.lanes)), None)
        tail = builder.urem(length, const(self.lanes))
        with builder.if_then(builder.icmp_unsigned("!=", tail, const(0))):
            step(builder.mul(whole, const(self.lanes)), self.first_lanes(tail))


class StoredRows:
    """Vector loads of K or V rows in their stored type, widened to ``vec``'s type.

    ``storage`` is the dtype of the kernel view of the blocks
    (:func:`numattn.core.dtypes.kernel_view`): float32/float64 are read as they are (or
    rounded to float32), uint16 holds bfloat16 bits (moved to a float32's upper half),
    int16 float16 bits (``fpext``), uint8 float8 bits of the format ``float8_format``
    names, ``"e5m2"`` or ``"e4m3fn"`` (made float16 bits, widened as float16 is: e5m2 is a
    float16's upper byte; e4m3fn's exponent is one bit narrower, so its bits go one place
    lower, the sign one place up, and the float16, whose bias is 8 more, is scaled by 2^8,
    with a compare for its NaN, which float16 reads as 480), int8 integers (``sitofp``).
    The rules are those of :func:`numattn.kernels.shared.storage.stored_value`; use
    :func:`for_each_format` to emit code per float8 format.
    """

    def __init__(self, context, builder, vec, storage, float8_format=None,
                 prefetch_bytes=0):
        self.builder = builder
        self.vec = vec
        self.kind = np.dtype(str(storage)).name
        self.itemsize = np.dtype(self.kind).itemsize
        self.prefetch_bytes = prefetch_bytes
        self.float8_format = float8_format
        self.raw = Vectors(context, builder, storage, lanes=vec.lanes)  # the stored vectors
        if self.kind == "uint8" and float8_format not in ("e5m2", "e4m3fn"):
            raise ValueError(f"uint8 rows need a float8 format, got {float8_format!r}")

    def load(self, ptr, offset, mask=None):
        """The ``vec.lanes`` elements of ``ptr[offset:]`` (those ``mask`` selects), widened."""
        builder = self.builder
        target = self.vec.type
        if self.raw.type == target:
            return self.vec.load(ptr, offset, mask)
        raw = self.raw.load(ptr, offset, mask)
        lanes = self.vec.lanes
        i16 = ir.VectorType(I16, lanes)
        halves = ir.VectorType(ir.HalfType(), lanes)
        if self.kind.startswith("float"):
            return builder.fptrunc(raw, target)
        if self.kind == "int8":
            return builder.sitofp(raw, target)
        if self.kind == "int16":  # float16
            return builder.fpext(builder.bitcast(raw, halves), target)
        if self.kind == "uint16":  # bfloat16
            wide = builder.zext(raw, ir.VectorType(I32, lanes))
            return builder.bitcast(builder.shl(wide, splat_int(I32, lanes, 16)), target)
        wide = builder.zext(raw, i16)
        if self.float8_format == "e5m2":  # a float16's upper byte
            half = builder.shl(wide, splat_int(I16, lanes, 8))
            return builder.fpext(builder.bitcast(half, halves), target)
        # e4m3fn as float16 bits (x + (x & 0x80)) << 7, whose float16 is 2^-8 of the value
        # (its subnormals too: float16 subnormals, normal in float32) and reads the NaN
        # code 0x7F as 480, which no e4m3fn value is
        half = builder.shl(builder.add(wide, builder.and_(wide, splat_int(I16, lanes, 0x80))),
                           splat_int(I16, lanes, 7))
        value = builder.fmul(builder.fpext(builder.bitcast(half, halves), target),
                             ir.Constant(target, [2.0 ** 8] * lanes))
        magnitude = call(builder, f"llvm.fabs.{self.vec.name}", target, [value])
        return builder.select(builder.fcmp_ordered("==", magnitude,
                                                   ir.Constant(target, [480.0] * lanes)),
                              ir.Constant(target, [float("nan")] * lanes), value)

    def prefetch_ahead(self, ptr, offset):
        """Ask for the line ``prefetch_bytes`` past element ``ptr[offset]`` (a hint, which
        never faults); nothing for ``prefetch_bytes = 0``.  One request per load, also where
        a line holds several loads' elements (docs/performance.rst: once per line gained
        nothing)."""
        if not self.prefetch_bytes:
            return
        ahead = self.builder.add(offset, const(self.prefetch_bytes // self.itemsize))
        prefetch_line(self.builder, self.builder.bitcast(self.builder.gep(ptr, [ahead]),
                                                         ir.IntType(8).as_pointer()))


def for_each_format(builder, storage, kv_format, emit):
    """``emit(float8_format)``: once (``None``) unless ``storage`` is uint8, else once per
    float8 format, each under a branch on the run-time ``kv_format``, so that each
    format's loops widen with their own operations (e5m2 a shift and a conversion, e4m3fn
    eight operations)."""
    if np.dtype(str(storage)).name != "uint8":
        emit(None)
        return
    with builder.if_else(builder.icmp_signed("==", kv_format, const(FORMAT_E5M2))) as (
            e5m2, e4m3fn):
        with e5m2:
            emit("e5m2")
        with e4m3fn:
            emit("e4m3fn")


def splat_int(element, lanes, value):
    """A vector constant of ``lanes`` copies of ``value`` (an ``element`` integer)."""
    return ir.Constant(ir.VectorType(element, lanes), [value] * lanes)


def sum_lanes(builder, vectors):
    """Horizontal sums of ``vectors`` (all of one width), by a tree of shuffles: vectors
    whose lanes, concatenated, hold the sums in order.

    Each step pairs two vectors whose lanes hold ``L`` partial sums of each of their
    sources and adds the first and second halves of every source: one vector with
    ``L / 2`` lanes per source for twice the sources.  A vector left without a partner is
    halved on its own (the vector counts here, 4, 8 or 16, leave only the last one so, and
    pairs always have one width).
    """
    items = [(v, 1, v.type.count) for v in vectors]  # (vector, sources, lanes each)
    while items[0][2] > 1:
        paired = []
        for t in range(0, len(items), 2):
            a, sources_a, lanes = items[t]
            b, sources_b, _ = items[t + 1] if t + 1 < len(items) else (a, 0, lanes)
            half = lanes // 2
            first = [s * lanes + x for s in range(sources_a) for x in range(half)]
            first += [sources_a * lanes + s * lanes + x
                      for s in range(sources_b) for x in range(half)]
            second = [m + half for m in first]
            paired.append((builder.fadd(
                builder.shuffle_vector(a, b, vector_const(I32, first)),
                builder.shuffle_vector(a, b, vector_const(I32, second))),
                sources_a + sources_b, half))
        items = paired
    return [v for v, _, _ in items]


def horizontal(builder, vector, op):
    """``op`` over the lanes of ``vector``: halves combined with halves, down to one."""
    width = vector.type.count
    while width > 1:
        width //= 2
        vector = op(builder.shuffle_vector(vector, vector, vector_const(I32, range(width))),
                    builder.shuffle_vector(vector, vector,
                                           vector_const(I32, range(width, 2 * width))))
    return builder.extract_element(vector, ir.Constant(I32, 0))


def row_pointer(context, builder, arrty, array, index):
    """Pointer to element ``array[index]`` (``index`` a list of LLVM integers)."""
    ary = context.make_array(arrty)(context, builder, array)
    return cgutils.get_item_pointer(context, builder, arrty, ary, index, wraparound=False)


def last_dim(context, builder, arrty, array):
    """The length of the last axis of ``array``."""
    ary = context.make_array(arrty)(context, builder, array)
    return cgutils.unpack_tuple(builder, ary.shape, arrty.ndim)[-1]


def key_rows(context, builder, blocks_ty, blocks, j, pages_ty, pages, slots_ty, slots,
             positions):
    """Pointers to row ``blocks[pages[p], slots[p], j]`` for each block position."""
    rows = []
    for p in positions:
        page = builder.load(row_pointer(context, builder, pages_ty, pages, [p]))
        slot = builder.load(row_pointer(context, builder, slots_ty, slots, [p]))
        rows.append(row_pointer(context, builder, blocks_ty, blocks,
                                [page, slot, j, const(0)]))
    return rows


def check_row(row, what):
    """A typing error unless ``row`` is a contiguous 1-D array."""
    if not isinstance(row, types.Array) or row.ndim != 1 or row.layout != "C":
        raise errors.TypingError(f"{what} takes a contiguous 1-D array")


# --------------------------------------------------------------------------------------
# Decode's blocks: scores, weighted V rows, whole-tile V sums.
# --------------------------------------------------------------------------------------
def over_row_in_passes(vec, length, keys_per_pass, step):
    """``step(offset, mask, keys)`` over a row (:meth:`Vectors.over_row`) once per pass:
    ``keys`` the block's keys of the pass, ``keys_per_pass`` of them."""
    for first in range(0, BLOCK_KEYS, keys_per_pass):
        keys = range(first, first + keys_per_pass)
        vec.over_row(length, lambda offset, mask, keys=keys: step(offset, mask, keys))


def scores_block_intrinsic(rows, vector_bytes, prefetch_bytes, keys_per_pass=BLOCK_KEYS):
    """The intrinsic of :func:`.simd.scores_block_4` (``_2``, ``_1``: ``rows`` heads), in
    passes over the rows of ``keys_per_pass`` keys each (:func:`.simd.keys_per_pass`)."""

    @intrinsic
    def scores_block(typingctx, qs, h, k_blocks, j, pages, slots, i, n, scores, kv_format):
        sig = types.none(qs, h, k_blocks, j, pages, slots, i, n, scores, kv_format)

        def codegen(context, builder, signature, args):
            qs_v, h_v, k_v, j_v, pages_v, slots_v, i_v, n_v, scores_v, format_v = args
            qs_ty, _, k_ty, _, pages_ty, slots_ty, _, _, scores_ty, _ = signature.args
            vec = Vectors(context, builder, qs_ty.dtype, vector_bytes)
            heads = [builder.add(h_v, const(a)) for a in range(rows)]
            last = builder.sub(n_v, const(1))
            positions = [builder.select(builder.icmp_signed("<", builder.add(i_v, const(b)),
                                                            n_v),
                                        builder.add(i_v, const(b)), last)
                         for b in range(BLOCK_KEYS)]
            k_rows = key_rows(context, builder, k_ty, k_v, j_v, pages_ty, pages_v,
                              slots_ty, slots_v, positions)
            q_rows = [row_pointer(context, builder, qs_ty, qs_v, [head, const(0)])
                      for head in heads]
            sums = [cgutils.alloca_once_value(builder, ir.Constant(vec.type, 0.0))
                    for _ in range(rows * BLOCK_KEYS)]
            head_dim = last_dim(context, builder, qs_ty, qs_v)

            def sum_products(float8_format):
                stored = StoredRows(context, builder, vec, k_ty.dtype, float8_format,
                                    prefetch_bytes)

                def step(offset, mask, keys):
                    for b in keys:
                        stored.prefetch_ahead(k_rows[b], offset)
                    q = [vec.load(p, offset, mask) for p in q_rows]
                    k = {b: stored.load(k_rows[b], offset, mask) for b in keys}
                    for a in range(rows):
                        for b in keys:
                            acc = sums[a * BLOCK_KEYS + b]
                            builder.store(vec.fma(q[a], k[b], builder.load(acc)), acc)

                over_row_in_passes(vec, head_dim, keys_per_pass, step)

            for_each_format(builder, k_ty.dtype, format_v, sum_products)
            # lane a * 4 + b of the concatenated result: head a, key b
            result = sum_lanes(builder, [builder.load(acc) for acc in sums])
            _store_scores(context, builder, vec, result, rows, heads, i_v, n_v, scores_ty,
                          scores_v)
            return context.get_dummy_value()

        return sig, codegen

    return scores_block


def _store_scores(context, builder, vec, result, rows, heads, i_v, n_v, scores_ty, scores_v):
    """Store the sums of :func:`scores_block_intrinsic` (lane ``a * 4 + b`` of ``result``,
    concatenated: head ``a``, key ``b``) into ``scores[heads[a], i + b]``, four keys at a
    time in a whole block, key by key for the keys ``< n`` of a block cut short."""
    width = result[0].type.count

    def lane(index):
        return result[index // width], index % width

    block_ty = ir.VectorType(vec.type.element, BLOCK_KEYS)
    whole = builder.icmp_signed("<=", builder.add(i_v, const(BLOCK_KEYS)), n_v)
    with builder.if_else(whole) as (four_keys, fewer_keys):
        with four_keys:
            for a in range(rows):
                if width >= BLOCK_KEYS:
                    part, first = lane(a * BLOCK_KEYS)
                    keys = builder.shuffle_vector(
                        part, part, vector_const(I32, range(first, first + 4)))
                else:
                    keys = ir.Constant(block_ty, None)
                    for b in range(BLOCK_KEYS):
                        part, x = lane(a * BLOCK_KEYS + b)
                        keys = builder.insert_element(
                            keys, builder.extract_element(part, ir.Constant(I32, x)),
                            ir.Constant(I32, b))
                ptr = row_pointer(context, builder, scores_ty, scores_v, [heads[a], i_v])
                builder.store(keys, builder.bitcast(ptr, block_ty.as_pointer()),
                              align=vec.itemsize)
        with fewer_keys:
            for b in range(BLOCK_KEYS):
                key = builder.add(i_v, const(b))
                with builder.if_then(builder.icmp_signed("<", key, n_v)):
                    for a in range(rows):
                        part, x = lane(a * BLOCK_KEYS + b)
                        builder.store(
                            builder.extract_element(part, ir.Constant(I32, x)),
                            row_pointer(context, builder, scores_ty, scores_v,
                                        [heads[a], key]))


def values_block_intrinsic(rows, vector_bytes, prefetch_bytes, keys_per_pass=BLOCK_KEYS):
    """The intrinsic of :func:`.simd.values_block_4` (``_2``, ``_1``: ``rows`` heads), in
    passes over the rows of ``keys_per_pass`` keys each, a pass adding its keys' products
    to what the pass before stored (the sums in the same order as in one pass)."""

    @intrinsic
    def values_block(typingctx, weights, h, v_blocks, j, pages, slots, i, acc, kv_format):
        sig = types.none(weights, h, v_blocks, j, pages, slots, i, acc, kv_format)

        def codegen(context, builder, signature, args):
            w_v, h_v, v_v, j_v, pages_v, slots_v, i_v, acc_v, format_v = args
            w_ty, _, v_ty, _, pages_ty, slots_ty, _, acc_ty, _ = signature.args
            vec = Vectors(context, builder, acc_ty.dtype, vector_bytes)
            heads = [builder.add(h_v, const(a)) for a in range(rows)]
            positions = [builder.add(i_v, const(b)) for b in range(BLOCK_KEYS)]
            v_rows = key_rows(context, builder, v_ty, v_v, j_v, pages_ty, pages_v,
                              slots_ty, slots_v, positions)
            acc_rows = [row_pointer(context, builder, acc_ty, acc_v, [head, const(0)])
                        for head in heads]
            weight = [[vec.splat(builder.load(row_pointer(context, builder, w_ty, w_v,
                                                          [head, p])))
                       for p in positions] for head in heads]
            head_dim = last_dim(context, builder, acc_ty, acc_v)

            def add_products(float8_format):
                stored = StoredRows(context, builder, vec, v_ty.dtype, float8_format,
                                    prefetch_bytes)

                def step(offset, mask, keys):
                    for b in keys:
                        stored.prefetch_ahead(v_rows[b], offset)
                    v = {b: stored.load(v_rows[b], offset, mask) for b in keys}
                    for a in range(rows):
                        total = vec.load(acc_rows[a], offset, mask)
                        for b in keys:
                            total = vec.fma(weight[a][b], v[b], total)
                        vec.store(total, acc_rows[a], offset, mask)

                over_row_in_passes(vec, head_dim, keys_per_pass, step)

            for_each_format(builder, v_ty.dtype, format_v, add_products)
            return context.get_dummy_value()

        return sig, codegen

    return values_block


def values_tile_intrinsic(rows, vector_bytes, tile_vectors=TILE_VECTORS):
    """The intrinsic of :func:`.simd.values_tile_4` (``_2``, ``_1``: ``rows`` heads), for
    rows of at most ``tile_vectors`` vectors (:func:`.simd.tile_vectors`)."""

    @intrinsic
    def values_tile(typingctx, weights, h, v_blocks, j, pages, slots, n, acc, kv_format):
        sig = types.none(weights, h, v_blocks, j, pages, slots, n, acc, kv_format)

        def codegen(context, builder, signature, args):
            w_v, h_v, v_v, j_v, pages_v, slots_v, n_v, acc_v, format_v = args
            w_ty, _, v_ty, _, pages_ty, slots_ty, _, acc_ty, _ = signature.args
            vec = Vectors(context, builder, acc_ty.dtype, vector_bytes)
            heads = [builder.add(h_v, const(a)) for a in range(rows)]
            head_dim = last_dim(context, builder, acc_ty, acc_v)
            # vector c holds elements c * lanes ..; its lanes past head_dim are masked
            masks = []
            for c in range(tile_vectors):
                left = builder.sub(head_dim, const(c * vec.lanes))
                left = builder.select(builder.icmp_signed("<", left, const(0)), const(0),
                                      left)
                masks.append(vec.first_lanes(left))
            acc_rows = [row_pointer(context, builder, acc_ty, acc_v, [head, const(0)])
                        for head in heads]
            sums = [[cgutils.alloca_once_value(
                builder, vec.load(acc_rows[a], const(c * vec.lanes), masks[c]))
                for c in range(tile_vectors)] for a in range(rows)]

            def add_products(float8_format):
                stored = StoredRows(context, builder, vec, v_ty.dtype, float8_format)
                with cgutils.for_range(builder, n_v) as loop:
                    position = loop.index
                    (v_row,) = key_rows(context, builder, v_ty, v_v, j_v, pages_ty, pages_v,
                                        slots_ty, slots_v, [position])
                    weight = [vec.splat(builder.load(row_pointer(context, builder, w_ty, w_v,
                                                                 [head, position])))
                              for head in heads]
                    for c in range(tile_vectors):
                        value = stored.load(v_row, const(c * vec.lanes), masks[c])
                        for a in range(rows):
                            total = sums[a][c]
                            builder.store(vec.fma(weight[a], value, builder.load(total)),
                                          total)

            for_each_format(builder, v_ty.dtype, format_v, add_products)
            for a in range(rows):
                for c in range(tile_vectors):
                    vec.store(builder.load(sums[a][c]), acc_rows[a], const(c * vec.lanes),
                              masks[c])
            return context.get_dummy_value()

        return sig, codegen

    return values_tile


# --------------------------------------------------------------------------------------
# The online softmax's rows: maximum, exponentials and their sum.
# --------------------------------------------------------------------------------------
def row_max_intrinsic():
    """The intrinsic of :func:`.simd.row_max`."""

    @intrinsic
    def row_max(typingctx, row, n):
        check_row(row, "row_max")
        sig = row.dtype(row, n)

        def codegen(context, builder, signature, args):
            row_v, n_v = args
            row_ty = signature.args[0]
            vec = Vectors(context, builder, row_ty.dtype, lanes=SUM_LANES)
            int_dtype = np.dtype(f"i{vec.itemsize}")
            int_type = ir.VectorType(ir.IntType(8 * vec.itemsize), SUM_LANES)

            def splat(value):
                return ir.Constant(int_type, [int(value)] * SUM_LANES)

            magnitude = splat(np.iinfo(int_dtype).max)  # all bits but the sign
            inf_bits = splat(np.array(np.inf, dtype=f"f{vec.itemsize}").view(int_dtype))

            def flip_negative(x):
                """Negative floats' bits, all but the sign flipped: then integers order
                the floats as floats order them (and the step undoes itself)."""
                sign = builder.ashr(x, splat(8 * vec.itemsize - 1))
                return builder.xor(x, builder.and_(sign, magnitude))

            def image(values):
                x = builder.bitcast(values, int_type)
                size = builder.and_(x, magnitude)  # a NaN of either sign: above +inf
                return flip_negative(
                    builder.select(builder.icmp_signed(">", size, inf_bits), size, x))

            def larger(a, b):
                return builder.select(builder.icmp_signed(">", a, b), a, b)

            start = row_pointer(context, builder, row_ty, row_v, [const(0)])
            lowest = image(ir.Constant(vec.type, [-np.inf] * SUM_LANES))
            best = cgutils.alloca_once_value(builder, lowest)

            def step(offset, mask):
                x = image(vec.load(start, offset, mask))
                if mask is not None:
                    x = builder.select(mask, x, lowest)
                builder.store(larger(x, builder.load(best)), best)

            vec.over_row(n_v, step)
            top = horizontal(builder, builder.load(best), larger)
            top = builder.insert_element(ir.Constant(int_type, None), top, ir.Constant(I32, 0))
            value = builder.bitcast(flip_negative(top), vec.type)
            return builder.extract_element(value, ir.Constant(I32, 0))

        return sig, codegen

    return row_max


def exp_row_intrinsic():
    """The intrinsic of :func:`.simd.exp_row`."""

    @intrinsic
    def exp_row(typingctx, row, n, m):
        check_row(row, "exp_row")
        if row.dtype not in (types.float32, types.float64) or m != row.dtype:
            raise errors.TypingError("exp_row takes a float row and an m of its dtype")
        sig = row.dtype(row, n, m)

        def codegen(context, builder, signature, args):
            row_v, n_v, m_v = args
            row_ty = signature.args[0]
            vec = Vectors(context, builder, row_ty.dtype, lanes=SUM_LANES)
            start = row_pointer(context, builder, row_ty, row_v, [const(0)])
            m = vec.splat(m_v)
            lanes = cgutils.alloca_once_value(builder, ir.Constant(vec.type, 0.0))

            def step(offset, mask):
                x = builder.fsub(vec.load(start, offset, mask), m)
                p = _exp_lanes(builder, vec, x)
                vec.store(p, start, offset, mask)
                total = builder.fadd(builder.load(lanes), p)
                if mask is not None:  # lanes past the row keep their sums (even a -0)
                    total = builder.select(mask, total, builder.load(lanes))
                builder.store(total, lanes)

            vec.over_row(n_v, step)
            return horizontal(builder, builder.load(lanes), builder.fadd)

        return sig, codegen

    return exp_row


def exp_split_row_intrinsic(converts_bfloat16):
    """The intrinsic of :func:`.simd.exp_split_row`: one pass over the row (the unscaled
    sums read with the scale in a loop of their own, chosen once per call).  With
    ``converts_bfloat16`` (AVX512-BF16) the parts are rounded by ``vcvtneps2bf16`` (one
    instruction, where :func:`bfloat16_bits` takes eleven), else by :func:`bfloat16_bits`
    of the values with those below float32's normal range made zero, as the instruction
    reads them."""

    def split_part(builder, x):
        if converts_bfloat16:
            fnty = ir.FunctionType(ir.VectorType(I16, SUM_LANES), [x.type])
            return builder.asm(fnty, "vcvtneps2bf16 $1, $0", "=v,v", [x], False)
        i32 = ir.VectorType(I32, SUM_LANES)
        u = builder.bitcast(x, i32)
        tiny = builder.icmp_unsigned("<", builder.and_(u, splat_int(I32, SUM_LANES, 0x7FFFFFFF)),
                                     splat_int(I32, SUM_LANES, 0x00800000))
        sign = builder.and_(u, splat_int(I32, SUM_LANES, 0x80000000))
        return bfloat16_bits(builder, builder.bitcast(builder.select(tiny, sign, u), x.type))

    @intrinsic
    def exp_split_row(typingctx, row, n, m, scale, raw, hi, lo, start):
        for array in (row, hi, lo):
            check_row(array, "exp_split_row")
        if (row.dtype not in (types.float32, types.float64)
                or not isinstance(m, types.Float) or not isinstance(scale, types.Float)
                or not isinstance(raw, types.Boolean)
                or hi.dtype != types.uint16 or lo.dtype != types.uint16):
            raise errors.TypingError("exp_split_row takes a float row, a float m and scale, "
                                     "a boolean and two uint16 arrays")
        sig = row.dtype(row, n, m, scale, raw, hi, lo, start)

        def codegen(context, builder, signature, args):
            row_v, n_v, m_v, scale_v, raw_v, hi_v, lo_v, start_v = args
            row_ty, hi_ty, lo_ty = signature.args[0], signature.args[5], signature.args[6]
            vec = Vectors(context, builder, row_ty.dtype, lanes=SUM_LANES)
            bits = Vectors(context, builder, types.uint16, lanes=SUM_LANES)
            float32 = ir.VectorType(ir.FloatType(), SUM_LANES)
            source = row_pointer(context, builder, row_ty, row_v, [const(0)])
            hi_at = row_pointer(context, builder, hi_ty, hi_v, [start_v])
            lo_at = row_pointer(context, builder, lo_ty, lo_v, [start_v])
            m, scale = (vec.splat(context.cast(builder, value, ty, row_ty.dtype))
                        for value, ty in zip((m_v, scale_v), signature.args[2:4]))
            minus_inf = ir.Constant(vec.type, [-np.inf] * SUM_LANES)
            nan = ir.Constant(vec.type, [np.nan] * SUM_LANES)
            lanes = cgutils.alloca_once_value(builder, ir.Constant(vec.type, 0.0))

            def over_row(raw):
                def step(offset, mask):
                    s = vec.load(source, offset, mask)
                    if raw:  # read_score(scale * s)
                        s = builder.fmul(s, scale)
                        s = builder.select(builder.fcmp_ordered("==", s, minus_inf), nan, s)
                    p = _exp_lanes(builder, vec, builder.fsub(s, m))
                    total = builder.fadd(builder.load(lanes), p)
                    if mask is not None:  # lanes past the row keep their sums (even a -0)
                        total = builder.select(mask, total, builder.load(lanes))
                    builder.store(total, lanes)
                    if vec.itemsize == 8:
                        p = builder.fptrunc(p, float32)
                    upper = split_part(builder, p)
                    upper_value = builder.bitcast(
                        builder.shl(builder.zext(upper, ir.VectorType(I32, SUM_LANES)),
                                    splat_int(I32, SUM_LANES, 16)), float32)
                    bits.store(upper, hi_at, offset, mask)
                    bits.store(split_part(builder, builder.fsub(p, upper_value)), lo_at,
                               offset, mask)

                vec.over_row(n_v, step)

            with builder.if_else(raw_v) as (scaled_here, scaled_before):
                with scaled_here:
                    over_row(True)
                with scaled_before:
                    over_row(False)
            return horizontal(builder, builder.load(lanes), builder.fadd)

        return sig, codegen

    return exp_split_row


def _exp_lanes(builder, vec, x):
    """``e^x`` in each lane of ``x`` (Cephes' ``expf`` or ``exp``, as :func:`.simd.exp_row`
    computes it: 0 below :data:`.simd.EXP_LOW`, NaN for NaN)."""
    size = vec.itemsize
    int_type = ir.VectorType(ir.IntType(8 * size), SUM_LANES)
    mantissa, bias = exponent_field(np.dtype(f"f{size}"))

    def splat(value):
        return ir.Constant(vec.type, [value] * SUM_LANES)

    def polynomial(x, coefficients):
        y = splat(coefficients[0])
        for c in coefficients[1:]:
            y = vec.fma(y, x, splat(c))
        return y

    low = splat(EXP_LOW[size])
    xc = builder.select(builder.fcmp_ordered(">", x, low), x, low)  # NaN: low
    k = call(builder, f"llvm.floor.{vec.name}", vec.type,
             [vec.fma(xc, splat(EXP_LOG2E), splat(0.5))])
    r = vec.fma(k, splat(-EXP_LN2[size][0]), xc)
    r = vec.fma(k, splat(-EXP_LN2[size][1]), r)
    if size == 4:
        y = vec.fma(polynomial(r, EXPF_P), builder.fmul(r, r), r)
        y = builder.fadd(y, splat(1.0))
    else:
        rr = builder.fmul(r, r)
        px = builder.fmul(r, polynomial(rr, EXP_P))
        ratio = builder.fdiv(px, builder.fsub(polynomial(rr, EXP_Q), px))
        y = vec.fma(splat(2.0), ratio, splat(1.0))
    exponent = builder.shl(
        builder.add(builder.fptosi(k, int_type), ir.Constant(int_type, [bias] * SUM_LANES)),
        ir.Constant(int_type, [mantissa] * SUM_LANES))
    scale = builder.select(builder.fcmp_ordered("<", x, low), splat(0.0),
                           builder.bitcast(exponent, vec.type))
    return builder.fmul(builder.select(builder.fcmp_unordered("uno", x, x), x, y), scale)


# --------------------------------------------------------------------------------------
# K and V packed for the AMX tiles (:mod:`.amx`).
# --------------------------------------------------------------------------------------
def _check_pack(blocks, pack, what):
    if (not isinstance(blocks, types.Array) or blocks.ndim != 4
            or blocks.dtype != types.uint16):
        raise errors.TypingError(f"{what} takes 4-D uint16 (bfloat16) blocks")
    check_row(pack, what)
    if pack.dtype != types.uint16:
        raise errors.TypingError(f"{what} packs into a uint16 array")


def _pack_args(context, builder, signature, args):
    """The rows of keys ``j .. j + 15`` (pointers), ``j``, the row length, and the pack's
    start as 32-bit words, of a packing intrinsic's arguments ``(blocks, pages, slots, j,
    head, pack, ...)``."""
    blocks_ty, pages_ty, slots_ty = signature.args[:3]
    blocks_v, pages_v, slots_v, j_v, head_v, pack_v = args[:6]
    j = context.cast(builder, j_v, signature.args[3], types.int64)
    head = context.cast(builder, head_v, signature.args[4], types.int64)
    rows = key_rows(context, builder, blocks_ty, blocks_v, head, pages_ty, pages_v, slots_ty,
                    slots_v, [builder.add(j, const(n)) for n in range(16)])
    head_dim = last_dim(context, builder, blocks_ty, blocks_v)
    words = builder.bitcast(row_pointer(context, builder, signature.args[5], pack_v,
                                        [const(0)]), I32.as_pointer())
    return rows, j, head_dim, words


def _load_at(builder, row, offset, vector_type):
    """The ``vector_type`` at element ``offset`` of ``row`` (a ``uint16`` pointer)."""
    return builder.load(builder.bitcast(builder.gep(row, [offset]), vector_type.as_pointer()),
                        align=2)


def _store_words(builder, value, words, offset):
    builder.store(value, builder.bitcast(builder.gep(words, [offset]),
                                         value.type.as_pointer()), align=4)


def transpose_16(builder, vectors):
    """The 16 x 16 transpose of 16 vectors of 16 lanes: for each bit ``h`` of an index, one
    two-vector shuffle per vector swaps that bit between row and column (the blocks off the
    diagonal at each scale), 64 shuffles in all."""
    rows = list(vectors)
    for h in (8, 4, 2, 1):
        low = [k if k & h == 0 else 16 + k - h for k in range(16)]
        high = [k + h if k & h == 0 else 16 + k for k in range(16)]
        for i in range(16):
            if i & h == 0:
                a, b = rows[i], rows[i + h]
                rows[i] = builder.shuffle_vector(a, b, vector_const(I32, low))
                rows[i + h] = builder.shuffle_vector(a, b, vector_const(I32, high))
    return rows


def pack_keys_intrinsic():
    """The intrinsic of :func:`.amx.pack_keys`: per 32 elements, the 16 keys' rows loaded
    as vectors of 16 pairs (32-bit words), transposed in registers
    (:func:`transpose_16`), stored as one 1 KiB block."""

    @intrinsic
    def pack_keys(typingctx, k_blocks, pages, slots, j, head, k_pack, num_keys):
        _check_pack(k_blocks, k_pack, "pack_keys")
        sig = types.none(k_blocks, pages, slots, j, head, k_pack, num_keys)

        def codegen(context, builder, signature, args):
            rows, j, head_dim, words = _pack_args(context, builder, signature, args)
            num_keys = context.cast(builder, args[6], signature.args[6], types.int64)
            word_vector = ir.VectorType(I32, 16)
            key_groups = builder.udiv(num_keys, const(16))
            group = builder.udiv(j, const(16))
            with cgutils.for_range(builder, builder.udiv(head_dim, const(32))) as loop:
                c = loop.index
                columns = [_load_at(builder, row, builder.mul(c, const(32)), word_vector)
                           for row in rows]
                block = builder.mul(builder.add(builder.mul(c, key_groups), group),
                                    const(256))
                for p, row in enumerate(transpose_16(builder, columns)):
                    _store_words(builder, row, words, builder.add(block, const(16 * p)))
            return context.get_dummy_value()

        return sig, codegen

    return pack_keys


def pack_values_intrinsic():
    """The intrinsic of :func:`.amx.pack_values`: per 16 elements and pair of keys, the
    two rows' vectors widened to 32 bits and merged into one vector of words; the
    exponents of all checked on the way (an OR of per-lane flags, reduced at the end)."""

    @intrinsic
    def pack_values(typingctx, v_blocks, pages, slots, j, head, v_pack):
        _check_pack(v_blocks, v_pack, "pack_values")
        sig = types.boolean(v_blocks, pages, slots, j, head, v_pack)

        def codegen(context, builder, signature, args):
            rows, j, head_dim, words = _pack_args(context, builder, signature, args)
            bits_vector = ir.VectorType(I16, 16)
            word_vector = ir.VectorType(I32, 16)
            exponent = splat_int(I16, 16, 0x7F80)
            element_groups = builder.udiv(head_dim, const(16))
            first = builder.add(  # (c e_groups + e) 256 + p 16, for e = 0
                builder.mul(builder.mul(builder.udiv(j, const(32)), element_groups),
                            const(256)),
                builder.mul(builder.udiv(builder.urem(j, const(32)), const(2)), const(16)))
            special = cgutils.alloca_once_value(builder, splat_int(I16, 16, 0))
            with cgutils.for_range(builder, element_groups) as loop:
                e = loop.index
                base = builder.add(first, builder.mul(e, const(256)))
                flags = builder.load(special)
                for pair in range(8):
                    even, odd = (_load_at(builder, rows[2 * pair + side],
                                          builder.mul(e, const(16)), bits_vector)
                                 for side in (0, 1))
                    word = builder.or_(builder.zext(even, word_vector),
                                       builder.shl(builder.zext(odd, word_vector),
                                                   splat_int(I32, 16, 16)))
                    _store_words(builder, word, words, builder.add(base, const(16 * pair)))
                    for half in (even, odd):
                        flags = builder.or_(flags, builder.zext(
                            builder.icmp_unsigned("==", builder.and_(half, exponent),
                                                  exponent), bits_vector))
                builder.store(flags, special)
            any_special = call(builder, "llvm.vector.reduce.or.v16i16", I16,
                               [builder.load(special)])
            return builder.icmp_unsigned("==", any_special, ir.Constant(I16, 0))

        return sig, codegen

    return pack_values


# --------------------------------------------------------------------------------------
# Prefetch hints.
# --------------------------------------------------------------------------------------
def prefetch_row_intrinsic():
    """The intrinsic of :func:`.simd.prefetch_row`."""

    @intrinsic
    def prefetch(typingctx, blocks, page, slot, num_lines):
        sig = types.none(blocks, page, slot, num_lines)

        def codegen(context, builder, signature, args):
            blocks_ty = signature.args[0]
            if blocks_ty.layout != "C":
                return context.get_dummy_value()  # strided (head-major): no hint
            blocks_v, page_v, slot_v, lines_v = args
            row = row_pointer(context, builder, blocks_ty, blocks_v,
                              [page_v, slot_v, const(0), const(0)])
            # from the start of the page that holds the row's start (mapped: the row is)
            page_start = builder.and_(builder.ptrtoint(row, I64), const(-PREFETCH_PAGE_BYTES))
            row = builder.inttoptr(page_start, ir.IntType(8).as_pointer())
            itemsize = np.dtype(str(blocks_ty.dtype)).itemsize
            shape = cgutils.unpack_tuple(
                builder, context.make_array(blocks_ty)(context, builder, blocks_v).shape, 4)
            row_elems = builder.mul(shape[2], shape[3])
            row_lines = builder.udiv(builder.add(builder.mul(row_elems, const(itemsize)),
                                                 const(LINE_BYTES - 1)), const(LINE_BYTES))
            lines = builder.select(builder.icmp_signed("<", lines_v, row_lines), lines_v,
                                   row_lines)
            with cgutils.for_range(builder, lines) as loop:
                prefetch_line(builder,
                              builder.gep(row, [builder.mul(loop.index, const(LINE_BYTES))]))
            return context.get_dummy_value()

        return sig, codegen

    return prefetch


def widen_row_intrinsic(vector_bytes):
    """The intrinsic of :func:`.simd.widen_row`."""

    @intrinsic
    def widen_row(typingctx, blocks, page, slot, head, dest, start, kv_format):
        check_row(dest, "widen_row")
        sig = types.none(blocks, page, slot, head, dest, start, kv_format)

        def codegen(context, builder, signature, args):
            blocks_v, page_v, slot_v, head_v, dest_v, start_v, format_v = args
            blocks_ty, dest_ty = signature.args[0], signature.args[4]
            source = row_pointer(context, builder, blocks_ty, blocks_v,
                                 [page_v, slot_v, head_v, const(0)])
            target = row_pointer(context, builder, dest_ty, dest_v, [start_v])
            copy_widened(context, builder, vector_bytes, blocks_ty.dtype, source,
                         dest_ty.dtype, target, last_dim(context, builder, blocks_ty, blocks_v),
                         format_v)
            return context.get_dummy_value()

        return sig, codegen

    return widen_row


def copy_widened(context, builder, vector_bytes, storage, source, dtype, target, length,
                 kv_format):
    """``target[:length]`` (of ``dtype``) = ``source[:length]`` (stored as ``storage``
    holds ``kv_format``) widened: whole vectors, then the tail under a mask."""
    vec = Vectors(context, builder, dtype, vector_bytes)

    def copy(float8_format):
        stored = StoredRows(context, builder, vec, storage, float8_format)
        vec.over_row(length, lambda offset, mask: vec.store(stored.load(source, offset, mask),
                                                            target, offset, mask))

    for_each_format(builder, storage, kv_format, copy)


def widen_span_intrinsic(vector_bytes):
    """The intrinsic of :func:`.simd.widen_span`."""

    @intrinsic
    def widen_span(typingctx, bits, dest, start, count, kv_format):
        check_row(bits, "widen_span")
        check_row(dest, "widen_span")
        sig = types.none(bits, dest, start, count, kv_format)

        def codegen(context, builder, signature, args):
            bits_v, dest_v, start_v, count_v, format_v = args
            bits_ty, dest_ty = signature.args[:2]
            copy_widened(context, builder, vector_bytes, bits_ty.dtype,
                         row_pointer(context, builder, bits_ty, bits_v, [start_v]),
                         dest_ty.dtype, row_pointer(context, builder, dest_ty, dest_v, [start_v]),
                         count_v, format_v)
            return context.get_dummy_value()

        return sig, codegen

    return widen_span


def bfloat16_bits(builder, x):
    """The bfloat16 bits (``i16`` lanes) nearest the float32 lanes ``x``, in integer
    arithmetic: ``(u + 0x7FFF + (u >> 16 & 1)) >> 16`` of the float's bits ``u`` (ties to
    even), a NaN made ``0x7FC0`` with its sign."""
    lanes = x.type.count

    def splat(value):
        return splat_int(I32, lanes, value)

    u = builder.bitcast(x, ir.VectorType(I32, lanes))
    upper = builder.lshr(u, splat(16))
    nearest = builder.lshr(builder.add(builder.add(u, splat(0x7FFF)),
                                       builder.and_(upper, splat(1))), splat(16))
    nan = builder.or_(builder.and_(upper, splat(0x8000)), splat(0x7FC0))
    is_nan = builder.fcmp_unordered("uno", x, x)
    return builder.trunc(builder.select(is_nan, nan, nearest), ir.VectorType(I16, lanes))


def round_span_intrinsic(vector_bytes):
    """The intrinsic of :func:`.simd.round_span`: float16 by ``fptrunc`` (the hardware's
    conversion, ties to even), bfloat16 by :func:`bfloat16_bits`; ``bits`` of the values'
    dtype get a copy."""

    @intrinsic
    def round_span(typingctx, values, bits, start, count):
        check_row(values, "round_span")
        check_row(bits, "round_span")
        copy = bits.dtype == values.dtype and values.dtype in (types.float32, types.float64)
        if not copy and (values.dtype != types.float32
                         or bits.dtype not in (types.uint16, types.int16)):
            raise errors.TypingError("round_span takes float32 values and uint16 (bfloat16) "
                                     "or int16 (float16) bits, or two arrays of one float "
                                     "dtype")
        sig = types.none(values, bits, start, count)

        def codegen(context, builder, signature, args):
            values_v, bits_v, start_v, count_v = args
            values_ty, bits_ty = signature.args[:2]
            vec = Vectors(context, builder, values_ty.dtype, vector_bytes)
            out = Vectors(context, builder, bits_ty.dtype, lanes=vec.lanes)
            source = row_pointer(context, builder, values_ty, values_v, [start_v])
            target = row_pointer(context, builder, bits_ty, bits_v, [start_v])
            lanes = vec.lanes
            float16 = bits_ty.dtype == types.int16

            def step(offset, mask):
                x = vec.load(source, offset, mask)
                if copy:
                    rounded = x
                elif float16:
                    rounded = builder.bitcast(
                        builder.fptrunc(x, ir.VectorType(ir.HalfType(), lanes)), out.type)
                else:
                    rounded = bfloat16_bits(builder, x)
                out.store(rounded, target, offset, mask)

            vec.over_row(count_v, step)
            return context.get_dummy_value()

        return sig, codegen

    return round_span


def prefetch_head_intrinsic():
    """The intrinsic of :func:`.simd.prefetch_head`."""

    @intrinsic
    def prefetch_head(typingctx, blocks, page, slot, head):
        sig = types.none(blocks, page, slot, head)

        def codegen(context, builder, signature, args):
            blocks_ty = signature.args[0]
            blocks_v, page_v, slot_v, head_v = args
            row = row_pointer(context, builder, blocks_ty, blocks_v,
                              [page_v, slot_v, head_v, const(0)])
            itemsize = np.dtype(str(blocks_ty.dtype)).itemsize
            head_dim = last_dim(context, builder, blocks_ty, blocks_v)
            start = builder.ptrtoint(row, I64)
            end = builder.add(start, builder.mul(head_dim, const(itemsize)))
            first = builder.and_(start, const(-LINE_BYTES))  # the line of the row's start
            lines = builder.udiv(builder.sub(builder.add(end, const(LINE_BYTES - 1)), first),
                                 const(LINE_BYTES))
            base = builder.inttoptr(first, ir.IntType(8).as_pointer())
            with cgutils.for_range(builder, lines) as loop:
                prefetch_line(builder,
                              builder.gep(base, [builder.mul(loop.index, const(LINE_BYTES))]))
            return context.get_dummy_value()

        return sig, codegen

    return prefetch_head
