"""The note on the first compile, and ``python -m numattn warmup``.

Each test runs fresh processes with a fresh ``NUMBA_CACHE_DIR``: what they check is what a
new process does with an empty (or warmed) disk cache.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

import numattn
from numattn.tools.warmup import progress_bar

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(numattn.__file__)))
NOTE = "numattn: compiling CPU kernels"

#: A child's first calls: every operation over every kind of K/V input, with other shapes
#: and masks than warmup's, small and large; prints how many numattn functions Numba
#: compiled (not loaded from the disk cache) while they ran.
FIRST_CALLS = r"""
import sys
import numpy as np
from numba.core import event
import numattn as na

compiled = []
class Count(event.Listener):
    def on_start(self, ev):
        func = ev.data["dispatcher"].py_func
        if func.__module__.startswith("numattn"):
            compiled.append(func.__module__ + "." + func.__name__)
    def on_end(self, ev):
        pass
event.register("numba:compile", Count())

rng = np.random.default_rng(1)
f = np.dtype(sys.argv[1])
r = lambda *s: rng.standard_normal(s).astype(f)
def caches(b, cached, new, hkv, d, ps=8):
    keys = cached + new
    pages = -(-keys // ps)
    table = rng.permutation(b * pages + 2)[: b * pages].reshape(b, pages)
    lengths = np.full(b, cached)
    paged = [na.PagedKVCache(r(b * pages + 2, ps, hkv, d), lengths, table) for _ in "kv"]
    rows = rng.permutation(b + 1)[:b]
    cont = [na.ContinuousBatchingKVCache(r(b + 1, keys + 3, hkv, d), lengths, rows)
            for _ in "kv"]
    return paged, cont
masks = [na.CausalMask(), na.NullMask(), na.SlidingWindowCausalMask(7) | na.ChunkedMask(5),
         na.ChunkedCausalMask(6)]
for b, s, cached, h, hkv, d in [(3, 7, 5, 6, 3, 16), (2, 128, 100, 16, 4, 64),
                                (4, 8, 1200, 16, 4, 64)]:
    paged, cont = caches(b, cached, s, hkv, d)
    for mask in masks:
        off = np.arange(b + 1) * s
        q = r(b, s, h, d)
        na.flash_attention_kv_cache(q, r(b, s + 3, hkv, d), r(b, s + 3, hkv, d), mask)
        na.flash_attention_kv_cache(q.reshape(b * s, h, d), r(b * s, hkv, d), r(b * s, hkv, d),
                                    mask, q_input_row_offsets=off, return_lse=True)
        bias = r(b, h, s, cached + s)
        for k, v in (paged, cont):
            na.flash_attention_kv_cache(q, k, v, mask, sink_weights=r(h))
            na.flash_attention_kv_cache(q, k, v, mask & na.MaterializedMask(bias))
            na.flash_attention_kv_cache(q, k, v, bias[:, 0])
            na.cross_attention(q.reshape(b * s, h, d), off, s, k, v, off, mask,
                               return_lse=True)
    dec_paged, dec_cont = caches(b, cached, 1, hkv, d)
    for mask in masks:
        q = r(b, h, d)
        for k, v in (dec_paged, dec_cont):
            na.decode_attention(q, k, v, mask, return_lse=True, sink_weights=r(h))
            na.decode_attention(q, k, v, r(b, h, 1, cached + 1), num_partitions=64,
                                config=na.MHAConfig(block_k=4))
        na.decode_attention(q, r(b, cached + 1, hkv, d), r(b, cached + 1, hkv, d), mask)
    na.store_kv(paged[0], r(b * s, hkv, d), np.arange(b + 1) * s)
    na.store_kv(cont[0], r(b * s, hkv, d), np.arange(b + 1) * s)
for parts, rows in ((3, 5), (2, 200000)):
    na.merge_states(r(parts, rows, 4), r(parts, rows))
print("compiled:", len(compiled), sorted(set(compiled)))
"""


def _env(cache_dir, **extra):
    env = dict(os.environ)
    env.pop("NUMATTN_CACHE", None)
    env.update(NUMBA_CACHE_DIR=str(cache_dir), **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return env


def _python(args, env, timeout=1800):
    return subprocess.run([sys.executable, "-W", "error", *args], capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=ROOT)


MERGE_TWICE = ("import numpy as np, numattn\n"
               "for dtype in (np.float64, np.float32):\n"
               "    numattn.merge_states(np.ones((2, 3, 4), dtype), np.zeros((2, 3), dtype))\n")


def test_first_compile_says_so_once_and_can_be_hidden(tmp_path):
    """One short note on stderr at the first compile (two kernels compile here), through
    logging (the child runs with warnings as errors); none once they are cached; none with
    the numattn logger set to ERROR."""
    env = _env(tmp_path / "cache")
    first = _python(["-c", MERGE_TWICE], env)
    assert first.returncode == 0, first.stderr
    notes = [line for line in first.stderr.splitlines() if line.startswith(NOTE)]
    assert len(notes) == 1, first.stderr
    assert "_merge_kernel" in notes[0] and "warmup" in notes[0]
    assert "logging.getLogger('numattn').setLevel(logging.ERROR)" in notes[0]
    again = _python(["-c", MERGE_TWICE], env)
    assert again.returncode == 0 and NOTE not in again.stderr, again.stderr
    hidden = _python(["-c", "import logging; logging.getLogger('numattn').setLevel("
                      "logging.ERROR)\n" + MERGE_TWICE], _env(tmp_path / "other"))
    assert hidden.returncode == 0 and hidden.stderr == "", hidden.stderr


@pytest.mark.slow
def test_after_warmup_first_calls_compile_nothing(tmp_path):
    """``python -m numattn warmup --dtype float32`` in a fresh cache directory (a few
    minutes on two cores: it compiles every CPU kernel), then a new process's first calls of
    every operation, cache kind, mask kind and path load everything from the cache."""
    env = _env(tmp_path / "cache")
    warm = _python(["-m", "numattn", "warmup", "--dtype", "float32"], env)
    assert warm.returncode == 0, warm.stderr[-3000:]
    assert warm.stdout.startswith("warmup: ") and " s; CPU kernels cached in " in warm.stdout
    bars = [line for line in warm.stderr.splitlines() if line.startswith("warmup [")]
    done, total = bars[-1].split("] ")[1].split()[0].split("/")
    assert done == total and len(bars) >= 10
    first = _python(["-c", FIRST_CALLS, "float32"], env)
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout.startswith("compiled: 0 "), first.stdout
    assert NOTE not in first.stderr


def test_warmup_refuses_without_a_disk_cache(tmp_path):
    env = _env(tmp_path / "cache", NUMATTN_CACHE="0")
    proc = _python(["-m", "numattn", "warmup"], env)
    assert proc.returncode == 1 and "NUMATTN_CACHE=0" in proc.stderr


def test_progress_bar_in_a_log():
    """Off a terminal the bar prints a line per tenth of the way, and the last one."""
    stream = io.StringIO()
    progress = progress_bar(stream, width=10)
    for done in range(1, 26):
        progress(done, 25, f"call {done}")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 10
    assert lines[0] == "warmup [#         ] 3/25 call 3"
    assert lines[-1] == "warmup [##########] 25/25 call 25"
