"""The flash kernel's two products on Intel AMX tiles, for bfloat16 queries and K/V.

Where the CPU has AMX (``amx-tile`` and ``amx-bf16``: Sapphire Rapids and later Xeons) and
Linux grants the process the tile state, the flash kernel multiplies its tiles of keys (a
multiple of 32) with ``tdpbf16ps``: 16 x 16 float32 sums of products of bfloat16 pairs.

* ``S = Q K^T``: the stacked query rows as they are stored (bfloat16, not yet scaled: the
  scale multiplies the sums), against K packed per tile as the instruction reads it
  (:func:`pack_keys`: pairs of elements of 16 keys side by side).  Products of two bfloat16
  numbers are exact in float32 and the sums are float32's, so the arithmetic stays the
  float32 the contract asks for (in another order of the sums).
* ``P V``: the weights split into two bfloat16 parts, ``P = hi + lo`` to 16 significant
  bits (:func:`.simd.exp_split_row`), each multiplied into V packed in pairs of keys
  (:func:`pack_values`): a weight's error is at most ``2^-17`` of it, where rounding the
  weights to bfloat16 (as other libraries do) would leave ``2^-9``.

The hardware treats bfloat16 inputs below ``2^-126`` as zero and flushes such results to
zero.  Tile rows go 16 at a time, so the kernel pads the query rows to a multiple of 16
(zeros) and takes this path only for key tiles of a multiple of 32 keys.

Numba has no AMX types, so the instructions are inline assembly: their encodings as
``.byte`` (assembled the same on any x86 machine, whatever its features) with the operands
pinned to ``rax`` and ``rcx``; llvmlite's assembler parser is switched on before the first
CPU kernel compiles (:func:`register`).  The tile primitives exist compiled only; nothing
calls them where :func:`available` is false.
"""

from __future__ import annotations

import functools

import numpy as np

from ...core.jit import before_cpu_compile, body, cpu_intrinsic

#: Rows and bytes per row of every tile register as the kernel configures them.
TILE_ROWS = 16
TILE_BYTES_PER_ROW = 64
#: The palette and shape of the eight tiles (``ldtilecfg``'s 64-byte layout): palette 1,
#: bytes per row of tile ``t`` at offset ``16 + 2 t``, rows at ``48 + t``.
CONFIG_BYTES = 64


def _vex(opcode, pp, modrm, sib=None, vvvv=0):
    """``.byte`` text of a VEX-encoded AMX instruction (map 0F38, W0, L0; ``vvvv`` is a
    register number, stored inverted)."""
    encoded = [0xC4, 0xE2, ((~vvvv & 15) << 3) | pp, opcode, modrm]
    if sib is not None:
        encoded.append(sib)
    return ".byte " + ",".join(f"0x{x:02x}" for x in encoded)


def config_text():
    """``ldtilecfg (%rax)``."""
    return _vex(0x49, 0, 0x00)


def release_text():
    """``tilerelease``."""
    return _vex(0x49, 0, 0xC0)


def zero_text(t):
    """``tilezero %tmm<t>``."""
    return _vex(0x49, 3, 0xC0 | t << 3)


def load_text(t):
    """``tileloadd (%rax,%rcx,1), %tmm<t>``: rows ``rcx`` bytes apart."""
    return _vex(0x4B, 3, 0x04 | t << 3, 0x08)


def store_text(t):
    """``tilestored %tmm<t>, (%rax,%rcx,1)``."""
    return _vex(0x4B, 2, 0x04 | t << 3, 0x08)


def dot_text(c, a, b):
    """``tdpbf16ps %tmm<b>, %tmm<a>, %tmm<c>``: ``C += A B`` (bfloat16 pairs)."""
    return _vex(0x5C, 2, 0xC0 | c << 3 | a, vvvv=b)


def _compiled_only(name):
    def primitive(*args):
        raise RuntimeError(f"numattn.kernels.cpu.amx.{name} runs only compiled")

    primitive.__name__ = primitive.__qualname__ = name
    return primitive


tile_config = _compiled_only("tile_config")  # (address of the 64-byte configuration)
tile_release = _compiled_only("tile_release")  # ()
tile_zero = _compiled_only("tile_zero")  # (t)
tile_load = _compiled_only("tile_load")  # (t, address, row stride in bytes)
tile_store = _compiled_only("tile_store")  # (t, address, row stride in bytes)
tile_dot = _compiled_only("tile_dot")  # (c, a, b): tile numbers, constants


@functools.cache
def available():
    """Whether this process can use AMX bfloat16 tiles: an x86-64 Linux CPU with
    ``amx-tile`` and ``amx-bf16`` (as LLVM reports it, following ``NUMBA_CPU_NAME``
    where set to another CPU: then no), and Linux granting the tile state
    (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``, asked once here).
    ``NUMATTN_AMX=0`` says no."""
    import ctypes
    import os
    import platform

    if os.environ.get("NUMATTN_AMX", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    import llvmlite.binding as llvm
    from numba.core import config

    if config.CPU_NAME and config.CPU_NAME != "host":
        return False
    features = llvm.get_host_cpu_features()
    if not (features.get("amx-tile") and features.get("amx-bf16")):
        return False
    arch_prctl, req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(arch_prctl, req_xcomp_perm, xfeature_xtiledata) == 0
    except (OSError, AttributeError):
        return False


@body
def tile_configuration():
    """The 64 bytes :func:`tile_config` loads: eight tiles of 16 rows of 64 bytes."""
    config = np.zeros(CONFIG_BYTES, dtype=np.uint8)
    config[0] = 1  # palette 1
    for t in range(8):
        config[16 + 2 * t] = TILE_BYTES_PER_ROW
        config[48 + t] = TILE_ROWS
    return config


def pack_keys(k_blocks, pages, slots, j, head, k_pack, num_keys):
    """Put the bfloat16 K rows (bits) of keys ``j .. j + 15`` (``j`` a multiple of 16) of
    KV head ``head``, rows ``k_blocks[pages[n], slots[n], head]``, into ``k_pack``, the K
    of a tile of ``num_keys`` keys as ``tdpbf16ps`` reads its second operand: for elements
    ``32 c .. 32 c + 31`` of keys ``16 g .. 16 g + 15``, a block of 16 rows of 32 numbers,
    row ``p`` holding elements ``32 c + 2 p`` and ``32 c + 2 p + 1`` of each key: the
    transpose of the keys' 16 pairs of elements as 32-bit words (plain NumPy here, vector
    code compiled: :func:`register`)."""
    rows = np.stack([k_blocks[pages[n], slots[n], head] for n in range(j, j + 16)])
    pairs = rows.view(np.uint32)  # [16 keys, D / 2 pairs]
    k_words = k_pack.view(np.uint32)
    for c in range(rows.shape[1] // 32):
        at = (c * (num_keys // 16) + j // 16) * 256
        k_words[at:at + 256] = pairs[:, 16 * c:16 * c + 16].T.reshape(-1)


def pack_values(v_blocks, pages, slots, j, head, v_pack):
    """Put the bfloat16 V rows (bits) of keys ``j .. j + 15`` (``j`` a multiple of 16) of
    KV head ``head`` into ``v_pack``, as ``tdpbf16ps`` reads its second operand: for keys
    ``32 c .. 32 c + 31`` and elements ``16 e .. 16 e + 15``, a block of 16 rows of 32
    numbers, row ``p`` holding keys ``32 c + 2 p`` and ``32 c + 2 p + 1`` of each element
    (the pair as one 32-bit word).  Returns whether the rows are finite (no NaN or inf:
    exponent bits not all set).  (Plain NumPy here, vector code compiled.)"""
    rows = np.stack([v_blocks[pages[n], slots[n], head] for n in range(j, j + 16)])
    element_groups = rows.shape[1] // 16
    v_words = v_pack.view(np.uint32)
    for pair in range(8):
        words = rows[2 * pair].astype(np.uint32) | (rows[2 * pair + 1].astype(np.uint32) << 16)
        p = (j + 2 * pair) % 32 // 2
        for e in range(element_groups):
            at = ((j // 32 * element_groups + e) * 16 + p) * 16
            v_words[at:at + 16] = words[16 * e:16 * e + 16]
    return not ((rows & 0x7F80) == 0x7F80).any()


@body
def tile_scores(q_bits, rows, head_dim, k_pack, num_keys, scores_flat):
    """``scores[r, n] = q[r] . k[n]`` (unscaled) for the first ``rows`` rounded up to 16
    rows of ``q_bits [rows, D]`` (bfloat16 bits) and the ``num_keys`` keys of ``k_pack``
    (:func:`pack_keys`), into ``scores_flat`` as ``[rows, num_keys]`` (rows past ``rows``
    too)."""
    key_groups = num_keys // 16
    chunks = head_dim // 32
    q_base = q_bits.ctypes.data
    k_base = k_pack.ctypes.data
    s_base = scores_flat.ctypes.data
    q_stride = 2 * head_dim
    s_stride = 4 * num_keys
    block = 16 * 32 * 2  # bytes of one packed block
    for r in range(0, rows, 16):
        for g in range(0, key_groups, 4):
            wide = key_groups - g >= 4  # four groups of keys, else two
            _zero_accumulators(wide)
            for c in range(chunks):
                tile_load(4, q_base + r * q_stride + 64 * c, q_stride)
                k_at = k_base + (c * key_groups + g) * block
                tile_load(6, k_at, 64)
                tile_dot(0, 4, 6)
                tile_load(7, k_at + block, 64)
                tile_dot(1, 4, 7)
                if wide:
                    tile_load(6, k_at + 2 * block, 64)
                    tile_dot(2, 4, 6)
                    tile_load(7, k_at + 3 * block, 64)
                    tile_dot(3, 4, 7)
            _store_accumulators(s_base + r * s_stride + 64 * g, s_stride, wide)


@body
def tile_values(hi, lo, rows, num_keys, v_pack, head_dim, pv_flat):
    """``pv[r] = sum_n (hi + lo)[r, n] v[n]`` for the first ``rows`` rounded up to 16 rows
    of the split weights ``[rows, num_keys]`` (:func:`.simd.exp_split_row`) and the V of ``v_pack``
    (:func:`pack_values`), into ``pv_flat`` as ``[rows, D]``."""
    element_groups = head_dim // 16
    chunks = num_keys // 32
    hi_base = hi.ctypes.data
    lo_base = lo.ctypes.data
    v_base = v_pack.ctypes.data
    pv_base = pv_flat.ctypes.data
    w_stride = 2 * num_keys
    pv_stride = 4 * head_dim
    block = 16 * 32 * 2
    for r in range(0, rows, 16):
        for e in range(0, element_groups, 4):
            wide = element_groups - e >= 4
            _zero_accumulators(wide)
            for c in range(chunks):
                tile_load(4, hi_base + r * w_stride + 64 * c, w_stride)
                tile_load(5, lo_base + r * w_stride + 64 * c, w_stride)
                v_at = v_base + (c * element_groups + e) * block
                tile_load(6, v_at, 64)
                tile_dot(0, 4, 6)
                tile_dot(0, 5, 6)
                tile_load(7, v_at + block, 64)
                tile_dot(1, 4, 7)
                tile_dot(1, 5, 7)
                if wide:
                    tile_load(6, v_at + 2 * block, 64)
                    tile_dot(2, 4, 6)
                    tile_dot(2, 5, 6)
                    tile_load(7, v_at + 3 * block, 64)
                    tile_dot(3, 4, 7)
                    tile_dot(3, 5, 7)
            _store_accumulators(pv_base + r * pv_stride + 64 * e, pv_stride, wide)


@body
def _zero_accumulators(wide):
    """Zero accumulator tiles 0 and 1, and 2 and 3 if ``wide``."""
    tile_zero(0)
    tile_zero(1)
    if wide:
        tile_zero(2)
        tile_zero(3)


@body
def _store_accumulators(address, stride, wide):
    """Store accumulator tiles 0, 1 (and 2, 3 if ``wide``) side by side from ``address``:
    16 float32 columns each, rows ``stride`` bytes apart."""
    tile_store(0, address, stride)
    tile_store(1, address + 64, stride)
    if wide:
        tile_store(2, address + 128, stride)
        tile_store(3, address + 192, stride)


_REGISTERED = []


def _forward_pack_keys(packing):
    def typer(blocks, pages, slots, j, head, pack, num_keys):
        return lambda blocks, pages, slots, j, head, pack, num_keys: packing(
            blocks, pages, slots, j, head, pack, num_keys)

    return typer


def _forward_pack_values(packing):
    def typer(blocks, pages, slots, j, head, pack):
        return lambda blocks, pages, slots, j, head, pack: packing(
            blocks, pages, slots, j, head, pack)

    return typer


def register():
    """Give the tile primitives their compiled forms (inline assembly), once per process."""
    if _REGISTERED:
        return
    import llvmlite.binding as llvm
    from llvmlite import ir
    from numba.core import types
    from numba.extending import intrinsic, overload

    llvm.initialize_native_asmparser()

    def emit_asm(context, builder, sig, args, text):
        args = [context.cast(builder, v, t, types.int64) for v, t in zip(args, sig.args)]
        fnty = ir.FunctionType(ir.VoidType(), [a.type for a in args])
        registers = ["{rax}", "{rcx}"][:len(args)]
        builder.asm(fnty, text, ",".join([*registers, "~{memory}"]), args, side_effect=True)
        return context.get_dummy_value()

    @functools.cache
    def instruction(text, num_args):
        def codegen(context, builder, sig, args):
            return emit_asm(context, builder, sig, args, text)

        if num_args == 0:
            @intrinsic
            def emit(typingctx):
                return types.void(), codegen
        elif num_args == 1:
            @intrinsic
            def emit(typingctx, address):
                return types.void(address), codegen
        else:
            @intrinsic
            def emit(typingctx, address, stride):
                return types.void(address, stride), codegen
        return emit

    def constant(t):
        if not isinstance(t, types.IntegerLiteral):
            raise TypeError("AMX tile numbers must be constants")
        return t.literal_value

    from . import simd_llvm

    # (``@overload`` typing functions whose implementations call the intrinsics, for other
    # jitted callers; numattn's kernels call the intrinsics: see core.jit.cpu_intrinsic)
    for function, forward, packing in (
            (pack_keys, _forward_pack_keys, simd_llvm.pack_keys_intrinsic()),
            (pack_values, _forward_pack_values, simd_llvm.pack_values_intrinsic())):
        overload(function, inline="always")(forward(packing))
        cpu_intrinsic(function, packing)

    @overload(tile_config, inline="always")
    def _config(address):
        emit = instruction(config_text(), 1)
        return lambda address: emit(address)

    @overload(tile_release, inline="always")
    def _release():
        emit = instruction(release_text(), 0)
        return lambda: emit()

    @overload(tile_zero, inline="always", prefer_literal=True)
    def _zero(t):
        emit = instruction(zero_text(constant(t)), 0)
        return lambda t: emit()

    @overload(tile_load, inline="always", prefer_literal=True)
    def _load(t, address, stride):
        emit = instruction(load_text(constant(t)), 2)
        return lambda t, address, stride: emit(address, stride)

    @overload(tile_store, inline="always", prefer_literal=True)
    def _store(t, address, stride):
        emit = instruction(store_text(constant(t)), 2)
        return lambda t, address, stride: emit(address, stride)

    @overload(tile_dot, inline="always", prefer_literal=True)
    def _dot(c, a, b):
        emit = instruction(dot_text(constant(c), constant(a), constant(b)), 0)
        return lambda c, a, b: emit()

    _REGISTERED.append(True)


before_cpu_compile(register)
