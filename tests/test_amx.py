"""The flash kernel's AMX tiles (bfloat16 queries and K/V on CPUs with AMX): instruction
encodings and packed layouts on every machine, results against the float64 reference where
the CPU has the tiles.

Results are compared as float32 (``out=`` of float32), so that the tolerance is float32's:
the tiles' products are exact and their sums float32, and the weights go in two bfloat16
parts (16 significant bits).
"""

from __future__ import annotations

import numpy as np
import pytest

import numattn
from numattn import (
    CausalMask,
    FunctionMask,
    MaterializedMask,
    NullMask,
    PagedKVCache,
    SlidingWindowCausalMask,
    reference,
    softcap,
)
from numattn.core import dtypes
from numattn.core.jit import body, cpu_jit
from numattn.kernels.cpu import amx, flash

from .test_functions import head_window
from .utils import assert_close

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = dtypes.ml_dtype("bfloat16")

needs_amx = pytest.mark.skipif(not amx.available(),
                               reason="this CPU (or its Linux) offers no AMX bfloat16 tiles")


# --------------------------------------------------------------------------------------
# On every machine.
# --------------------------------------------------------------------------------------
def test_instruction_encodings():
    """The bytes written for each instruction, as LLVM's assembler encodes them."""
    assert amx.config_text() == ".byte 0xc4,0xe2,0x78,0x49,0x00"  # ldtilecfg (%rax)
    assert amx.release_text() == ".byte 0xc4,0xe2,0x78,0x49,0xc0"
    assert amx.zero_text(3) == ".byte 0xc4,0xe2,0x7b,0x49,0xd8"  # tilezero %tmm3
    assert amx.load_text(0) == ".byte 0xc4,0xe2,0x7b,0x4b,0x04,0x08"  # (%rax,%rcx), %tmm0
    assert amx.load_text(7) == ".byte 0xc4,0xe2,0x7b,0x4b,0x3c,0x08"
    assert amx.store_text(3) == ".byte 0xc4,0xe2,0x7a,0x4b,0x1c,0x08"  # %tmm3, (%rax,%rcx)
    assert amx.dot_text(0, 1, 2) == ".byte 0xc4,0xe2,0x6a,0x5c,0xc1"  # %tmm2, %tmm1, %tmm0
    assert amx.dot_text(3, 5, 7) == ".byte 0xc4,0xe2,0x42,0x5c,0xdd"


def test_primitives_run_compiled_only():
    with pytest.raises(RuntimeError, match="runs only compiled"):
        amx.tile_dot(0, 4, 6)


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("NUMATTN_AMX", "0")
    assert amx.available.__wrapped__() is False


def _bits(rng, shape):
    return rng.standard_normal(shape).astype(BF16).view(np.uint16)


@body
def _pack_all(k_blocks, v_blocks, pages, slots, head, num_keys, k_pack, v_pack):
    finite = True
    for j in range(0, num_keys, 16):
        amx.pack_keys(k_blocks, pages, slots, j, head, k_pack, num_keys)
        finite &= amx.pack_values(v_blocks, pages, slots, j, head, v_pack)
    return finite


def _pack_all_plain(k_blocks, v_blocks, pages, slots, head, num_keys, k_pack, v_pack):
    finite = [amx.pack_values(v_blocks, pages, slots, j, head, v_pack)
              for j in range(0, num_keys, 16)]
    for j in range(0, num_keys, 16):
        amx.pack_keys(k_blocks, pages, slots, j, head, k_pack, num_keys)
    return all(finite)


@pytest.mark.parametrize("head_major", [False, True])
def test_packed_layouts(head_major, rng):
    """pack_keys and pack_values put each element where tdpbf16ps reads it: operand B of 16
    rows of 32 numbers, row p holding the pair (2p, 2p + 1) of the reduced axis for each of
    its 16 columns; keys from shuffled pages (token-major or head-major blocks), compiled
    (vector code) and plain alike; a NaN or inf in any V row is reported."""
    num_keys, head_dim, num_heads, page_size, head = 64, 96, 3, 8, 1
    pages = rng.permutation(num_keys // page_size + 2)
    shape = (num_heads, len(pages), page_size, head_dim)
    k_blocks, v_blocks = (_bits(rng, shape) if head_major else
                          _bits(rng, shape).transpose(1, 2, 0, 3).copy() for _ in range(2))
    if head_major:
        k_blocks, v_blocks = (x.transpose(1, 2, 0, 3) for x in (k_blocks, v_blocks))
    key_pages = np.repeat(pages[:num_keys // page_size], page_size).astype(np.int64)
    key_slots = np.tile(np.arange(page_size), num_keys // page_size).astype(np.int64)
    keys = k_blocks[key_pages, key_slots, head]
    values = v_blocks[key_pages, key_slots, head]

    def operand_b(pack, block):  # [reduced index, column] of one 16 x 32 block
        rows = pack[block * 512:(block + 1) * 512].reshape(16, 16, 2)  # [p, column, side]
        return rows.transpose(0, 2, 1).reshape(32, 16)

    for pack_all in cpu_jit(_pack_all), _pack_all_plain:
        k_pack = np.zeros(num_keys * head_dim, np.uint16)
        v_pack = np.zeros(num_keys * head_dim, np.uint16)
        args = (k_blocks, v_blocks, key_pages, key_slots, head, num_keys, k_pack, v_pack)
        assert pack_all(*args)
        key_groups = num_keys // 16
        for c in range(head_dim // 32):  # K^T: reduced over D, columns are keys
            for g in range(key_groups):
                np.testing.assert_array_equal(operand_b(k_pack, c * key_groups + g),
                                              keys[16 * g:16 * g + 16, 32 * c:32 * c + 32].T)
        element_groups = head_dim // 16
        for c in range(num_keys // 32):  # V: reduced over keys, columns are elements
            for e in range(element_groups):
                np.testing.assert_array_equal(operand_b(v_pack, c * element_groups + e),
                                              values[32 * c:32 * c + 32, 16 * e:16 * e + 16])
        for n in [36, 37]:  # either row of a pair
            for special in [0x7FC0, 0xFF80]:  # NaN, -inf
                element = (key_pages[n], key_slots[n], head, 7)
                v_blocks[element] = special
                assert not pack_all(*args)
                v_blocks[element] = values[n, 7]


# --------------------------------------------------------------------------------------
# Where the CPU has the tiles.
# --------------------------------------------------------------------------------------
def _paged(rng, batch, num_keys, num_kv_heads, head_dim, page_size):
    """bfloat16 K and V in shuffled pages (NaN in unused slots) and the float32 values."""
    pages_per_seq = -(-max(num_keys) // page_size) + 1
    num_pages = batch * pages_per_seq
    blocks = rng.standard_normal((2, num_pages, page_size, num_kv_heads, head_dim))
    for b, n in enumerate(num_keys):  # unused slots of each sequence's pages
        seq_pages = np.arange(b * pages_per_seq, (b + 1) * pages_per_seq)
        flat = blocks[:, seq_pages].reshape(2, -1, num_kv_heads, head_dim)
        flat[:, n:] = np.nan
        blocks[:, seq_pages] = flat.reshape(2, pages_per_seq, page_size, num_kv_heads,
                                            head_dim)
    order = rng.permutation(num_pages)
    table = order.reshape(batch, pages_per_seq)
    shuffled = np.empty_like(blocks)
    shuffled[:, order] = blocks
    stored = shuffled.astype(BF16)
    return stored[0], stored[1], table


CASES = {
    # name: (mask builder, H, Hkv, D, cache lengths, query rows, score_mod)
    "causal, group 4": (lambda: CausalMask(), 8, 2, 128, [0, 150], [200, 70], None),
    "null, group 1, D=32": (lambda: NullMask(), 2, 2, 32, [100, 0], [60, 256], None),
    "window, group 3, D=96": (lambda: SlidingWindowCausalMask(40), 6, 2, 96, [90, 300],
                              [45, 33], None),
    "function per head, softcap": (
        lambda: FunctionMask(head_window, np.arange(2, 18) * 9), 16, 4, 64, [64, 0],
        [40, 160], softcap(3.0)),
    "additive & causal": ("additive", 4, 4, 64, [0, 64], [160, 96], None),
}


@needs_amx
@pytest.mark.parametrize("case", list(CASES))
def test_flash_on_tiles_matches_reference(rng, monkeypatch, case):
    """Paged bfloat16 caches crossed by tiles of 128 keys (whole, cut by the mask, and
    tails shorter than 32 keys, which take the vector path), query rows not a multiple of
    16, sinks, lse; float32 results within float32's tolerance."""
    make_mask, num_heads, num_kv_heads, head_dim, cache_lengths, q_lens, score_mod = CASES[case]
    total = [c + s for c, s in zip(cache_lengths, q_lens)]
    k_blocks, v_blocks, table = _paged(rng, 2, total, num_kv_heads, head_dim, page_size=48)
    lengths = np.asarray(cache_lengths)
    k = PagedKVCache(k_blocks, lengths, table)
    v = PagedKVCache(v_blocks, lengths, table)
    offsets = np.concatenate([[0], np.cumsum(q_lens)])
    q = rng.standard_normal((offsets[-1], num_heads, head_dim)).astype(BF16)
    sinks = rng.standard_normal(num_heads).astype(np.float32)
    if make_mask == "additive":
        bias = rng.standard_normal((2, num_heads, max(q_lens), max(total))).astype(np.float32)
        bias[rng.random(bias.shape) < 0.2] = -np.inf
        mask = MaterializedMask(bias) & CausalMask()
    else:
        mask = make_mask()
    kwargs = dict(q_input_row_offsets=offsets, sink_weights=sinks, score_mod=score_mod,
                  return_lse=True)
    _check_both_paths(monkeypatch, numattn.flash_attention_kv_cache,
                      reference.flash_attention_kv_cache, (q, k, v, mask), kwargs, q.shape,
                      case)


@needs_amx
def test_cross_attention_on_tiles(rng, monkeypatch):
    """Ragged K/V rows (no cache), a padded additive mask: cross attention's tiles."""
    num_heads, num_kv_heads, head_dim = 4, 2, 64
    q_lens, kv_lens = [70, 20], [96, 200]
    q_offsets = np.concatenate([[0], np.cumsum(q_lens)])
    kv_offsets = np.concatenate([[0], np.cumsum(kv_lens)])
    q = rng.standard_normal((q_offsets[-1], num_heads, head_dim)).astype(BF16)
    k = rng.standard_normal((kv_offsets[-1], num_kv_heads, head_dim)).astype(BF16)
    v = rng.standard_normal((kv_offsets[-1], num_kv_heads, head_dim)).astype(BF16)
    args = (q, q_offsets, max(q_lens), k, v, kv_offsets, NullMask())
    _check_both_paths(monkeypatch, numattn.cross_attention, reference.cross_attention, args,
                      dict(return_lse=True), q.shape, "cross")


def _check_both_paths(monkeypatch, operation, reference_operation, args, kwargs, shape, what):
    """``operation`` on the tiles (checked to be chosen) and on the vector path, float32
    results against the reference; the two differ in their last bits (sums in another
    order), which shows that the tiles ran."""
    chosen = []
    choose = flash._amx_tiles

    def spy(*spied):
        chosen.append(choose(*spied))
        return chosen[-1]

    monkeypatch.setattr(flash, "_amx_tiles", spy)
    got, lse = operation(*args, out=np.empty(shape, np.float32), **kwargs)
    assert chosen == [True]
    want, want_lse = reference_operation(*args, **kwargs)
    assert_close(got, want, np.float32, what=what)
    assert_close(lse, want_lse, np.float32, what=what + " lse")
    monkeypatch.setattr(flash, "_amx_tiles", lambda *spied: False)
    vector, _ = operation(*args, out=np.empty(shape, np.float32), **kwargs)
    assert_close(vector, want, np.float32, what=what + " (vector path)")
    assert not np.array_equal(vector, got)


@needs_amx
def test_flash_on_tiles_nan_values(rng):
    """A NaN in a V row behind the mask stays out of every row (the tile the mask cuts goes
    by the vector path); one in a visible row reaches the rows that see it."""
    num_heads = num_kv_heads = 2
    head_dim, n = 64, 256
    q = rng.standard_normal((1, n, num_heads, head_dim)).astype(BF16)
    k = rng.standard_normal((1, n, num_kv_heads, head_dim)).astype(BF16)
    v = rng.standard_normal((1, n, num_kv_heads, head_dim)).astype(BF16)
    v[0, 200, 1, 5] = np.nan  # hidden from the causal rows before 200
    out = numattn.flash_attention_kv_cache(q, k, v, CausalMask(),
                                           out=np.empty(q.shape, np.float32))
    want = reference.flash_attention_kv_cache(q, k, v, CausalMask())
    assert np.isfinite(out[0, :200]).all() and np.isfinite(out[0, :, 0]).all()
    assert np.isnan(out[0, 200:, 1]).any(axis=-1).all()
    assert_close(out, want, np.float32)
