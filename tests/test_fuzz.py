"""Malformed input, fuzzed in child processes: errors, never crashes, nothing written.

A child process (this file run as a script) makes many calls built from a seed: a valid
call of a random operation (flash attention over padded or ragged queries, decode, cross
attention, ``merge_states``, ``store_kv``; plain, continuous-batching or paged K/V) with
one to three things broken: dtypes, shapes, negative, too large or non-monotonic offsets,
page-table entries outside the pool, cache lengths past the capacity, NaN and inf in slots
no key uses, ``out=`` buffers of the wrong shape, dtype or layout or overlapping an input,
bad masks, configs, partition counts, sinks and devices, and integers of overflowing sizes.
For each call the child checks that

* only ``ValueError``, ``TypeError`` or ``numattn.CudaUnavailableError`` is raised;
* when a call raises, ``out=``, the caches and every other input are unchanged (compared
  with copies made before the call); when it returns, its inputs are unchanged (but for
  ``out=`` and, for ``store_kv``, the cache), and where only unused slots were poisoned the
  result agrees with :mod:`numattn.reference`.

The parent checks the child's exit status, so that a crash (a segfault reading outside an
array, an abort) fails the test with the seed and the call that was running.  CI makes a
few hundred calls; a thorough run makes more::

    NUMATTN_FUZZ_CALLS=10000 python -m pytest -p no:cacheprovider tests/test_fuzz.py

A reported call reproduces on its own (it prints the call and its traceback)::

    python tests/test_fuzz.py SEED CALLS --only INDEX
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import traceback

import numpy as np
import pytest

#: Calls in all (shared by :data:`SEEDS` children); NUMATTN_FUZZ_CALLS sets it.
CALLS = int(os.environ.get("NUMATTN_FUZZ_CALLS", "400"))
SEEDS = (0, 1, 2, 3)

#: Values that break an integer: negative, past any small array, near the int32 / int64 /
#: uint64 limits.
BAD_INTS = (-1, -7, 10**5, 2**31 - 1, 2**31, 2**32, 2**62, 2**63 - 1, -(2**63), 2**63,
            2**64 - 1, 2**70)


# --------------------------------------------------------------------------------------
# A valid call, as named ingredients
# --------------------------------------------------------------------------------------
def _offsets(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def _cuda_available():
    from numattn.core import device

    return device.is_available()


def _valid_spec(rng):
    """Ingredients of a valid call of a random operation (tiny shapes)."""
    op = str(rng.choice(["flash", "flash", "decode", "decode", "cross", "merge", "store_kv"]))
    dtype = np.dtype(rng.choice([np.float32, np.float64]))
    batch, hkv = int(rng.integers(1, 4)), int(rng.integers(1, 3))
    heads, d = hkv * int(rng.choice([1, 2, 4])), int(rng.choice([1, 4, 8]))
    spec = {"op": op, "dtype": dtype, "heads": heads, "kv_heads": hkv, "head_dim": d,
            "scale": None, "sinks": None, "config": None, "return_lse": bool(rng.random() < .5),
            "mask": rng.choice(["null", "causal", "sliding", "chunked"]), "out": None,
            "num_partitions": None, "device": "cpu"}
    if op in ("decode", "cross") and _cuda_available() and rng.random() < 0.3:
        spec["device"] = "cuda"  # NumPy inputs copied over and back
    randn = lambda *shape: rng.standard_normal(shape).astype(dtype)  # noqa: E731
    if op == "merge":
        parts, rows = int(rng.integers(1, 4)), int(rng.integers(1, 5))
        spec.update(outs=randn(parts, rows, heads, d), lses=randn(parts, rows, heads))
        return spec
    kind = str(rng.choice(["paged", "continuous"] if op == "store_kv" else
                          ["paged", "continuous", "dense"]))
    cache_lens = rng.integers(0, 8, batch)
    q_lens = np.ones(batch, np.int64) if op == "decode" else rng.integers(0, 5, batch)
    if op == "flash" and kind == "dense":
        q_lens[:] = q_lens[0]
    kv_lens = q_lens.copy()
    spec.update(kind=kind, q_lens=q_lens, kv_lens=kv_lens,
                q_offsets=_offsets(q_lens), kv_offsets=_offsets(kv_lens))
    if kind == "dense":  # padded [B, N, Hkv, D]; decode and padded flash read all N keys
        n = int(rng.integers(1, 9))
        spec.update(k_blocks=randn(batch, n, hkv, d), v_blocks=randn(batch, n, hkv, d))
        if op == "cross":
            spec["kv_offsets"] = _offsets(np.minimum(kv_lens, n))
        num_keys = np.full(batch, n)
    else:
        num_keys = cache_lens + kv_lens
        _cache_ingredients(spec, rng, kind, cache_lens, num_keys, hkv, d, dtype)
    spec["num_keys"] = num_keys
    if op == "flash" and kind == "dense":
        spec["q"] = randn(batch, int(q_lens[0]), heads, d)
        spec["q_offsets"] = None
    elif op == "decode":
        spec["q"] = randn(batch, heads, d)
    elif op == "store_kv":
        spec["rows"] = randn(int(kv_lens.sum()), hkv, d)
    else:
        spec["q"] = randn(int(q_lens.sum()), heads, d)
    spec["q_max_seq_len"] = int(q_lens.max())
    return spec


def _cache_ingredients(spec, rng, kind, cache_lens, num_keys, hkv, d, dtype):
    """Blocks (unused slots NaN), lengths and table of a continuous or paged cache."""
    batch = len(cache_lens)
    if kind == "continuous":
        capacity = int(num_keys.max()) + int(rng.integers(0, 3))
        shape = (batch + 1, capacity, hkv, d)
        table = rng.permutation(batch + 1)[:batch]
        slots = [(table[b], t) for b in range(batch) for t in range(num_keys[b])]
    else:
        ps = int(rng.choice([1, 2, 4]))
        pages = -(-num_keys // ps)
        num_pages = int(pages.sum()) + 1
        shape = (num_pages, ps, hkv, d)
        table = np.full((batch, int(pages.max()) + 1), num_pages, np.int64)  # sentinels
        order = rng.permutation(num_pages)
        start = np.concatenate([[0], np.cumsum(pages)])
        for b in range(batch):
            table[b, :pages[b]] = order[start[b]:start[b + 1]]
        slots = [(table[b, t // ps], t % ps) for b in range(batch) for t in range(num_keys[b])]
    blocks = [np.full(shape, np.nan, dtype) for _ in range(2)]
    for x in blocks:
        for slot in slots:
            x[slot] = rng.standard_normal((hkv, d))
    spec.update(k_blocks=blocks[0], v_blocks=blocks[1], cache_lengths=cache_lens.copy(),
                lookup_table=table)


# --------------------------------------------------------------------------------------
# Breaking it
# --------------------------------------------------------------------------------------
def _int_array_entry(rng, x):
    """``x`` (an int array) with one entry set to a bad integer (in a wider dtype if the
    value does not fit)."""
    if x is not None and not isinstance(x, np.ndarray):  # broken already
        return x
    x = np.zeros(2, np.int64) if x is None else np.array(x)
    if x.size == 0:
        return x
    if x.dtype.kind not in "iu":  # a float array already: a value no index can take
        x.flat[int(rng.integers(x.size))] = rng.choice([np.nan, 1e300, -0.5])
        return x
    value = int(rng.choice(BAD_INTS))
    info = np.iinfo(x.dtype)
    if not info.min <= value <= info.max:
        x = x.astype(np.uint64 if value > 0 and value <= 2**64 - 1 else object)
        if x.dtype == object:
            return x
    x.flat[int(rng.integers(x.size))] = value
    return x


def _wrong_array(rng, x):
    """An array that is wrong for ``x``'s role: dtype, rank, shape, kind or layout."""
    if not isinstance(x, np.ndarray):  # broken already
        return None
    choice = int(rng.integers(8))
    if choice == 0:
        try:
            return x.astype(rng.choice([np.float16, np.int32, np.complex64, np.bool_]))
        except (ValueError, TypeError):  # an object array holding NaN
            return None
    if choice == 1:
        return x[..., None]
    if choice == 2:
        return x.reshape(-1) if x.ndim > 1 else x[None]
    if choice == 3:
        return np.concatenate([x, x], axis=-1) if x.ndim else x
    if choice == 4:
        return x.tolist()
    if choice == 5:
        return np.asfortranarray(np.repeat(x, 2, axis=-1))[..., ::2]
    if choice == 6:
        return "array"
    return x.astype(object)


def _break(spec, rng):
    """Break one ingredient of ``spec``; returns a description (and whether only values
    in unused slots changed, so that the call must still succeed)."""
    op = spec["op"]
    names = ["dtype", "scale", "config", "num_partitions", "device", "mask", "sinks", "out",
             "return_lse", "q_max_seq_len", "mask", "out", "num_partitions"]
    if op == "merge":
        names = ["merge_outs", "merge_lses"] * 3 + ["merge_empty"]
    else:
        if spec.get("q_offsets") is not None:
            names += ["q_offsets"] * 3
        names += ["kv_offsets"] * 2
        if spec["kind"] != "dense":
            names += ["cache_lengths"] * 3 + ["lookup_table"] * 3 + ["hidden"] * 2
        names += [n for n in ("k_blocks", "v_blocks", "q", "rows") if n in spec]
    name = str(rng.choice(names))
    if name == "hidden":
        for x in (spec["k_blocks"], spec["v_blocks"]):
            if isinstance(x, np.ndarray) and x.dtype.kind == "f":
                x[np.isnan(x)] = rng.choice([np.inf, -np.inf, 1e30, np.nan])
        return "inf/huge in unused slots", True
    if name in ("q_offsets", "kv_offsets", "cache_lengths", "lookup_table"):
        how = int(rng.integers(4))
        x = spec.get(name)
        if how == 0 or not isinstance(x, np.ndarray):
            spec[name] = _int_array_entry(rng, x)
        elif how == 1 and x.size > 1:
            spec[name] = x[::-1].copy()  # non-monotonic (offsets), reordered (others)
        elif how == 2:
            spec[name] = x[:-1].copy() if x.size else x
        else:
            spec[name] = x.astype(rng.choice([np.float64, np.uint8, np.int8]))
        return f"{name} = {spec[name]!r}", False
    if name in ("q", "rows", "k_blocks", "v_blocks"):
        spec[name] = _wrong_array(rng, spec[name])
        return f"{name}: wrong array", False
    if name == "dtype":
        other = np.float32 if spec["dtype"] == np.float64 else np.float64
        target = str(rng.choice([n for n in ("q", "rows", "k_blocks", "v_blocks") if n in spec]))
        if isinstance(spec[target], np.ndarray):
            spec[target] = spec[target].astype(other)
        return f"{target} in {np.dtype(other)}", False
    return _break_option(spec, rng, name), False


def _break_option(spec, rng, name):
    """Break a keyword argument (or a merge input)."""
    value = {
        "scale": lambda: rng.choice([np.inf, np.nan, 1e300, 10**400, "0.5", True, -1e39]),
        "config": lambda: [{"block_k": 4}, "MHAConfig", 7, ("block_k", 0), ("block_q", -1),
                           ("block_k", 2**40), ("block_q", 1.5), ("threads_per_block", 48),
                           ("num_partitions", 0), ("block_k", "8")][int(rng.integers(10))],
        "num_partitions": lambda: rng.choice([0, -1, 2**40, 1.5, True, "3", 2**70, 2**63]),
        "device": lambda: rng.choice(["gpu", "cuda", None, 1, "CPU"]),
        "return_lse": lambda: rng.choice(["yes", None, 1]),
        "q_max_seq_len": lambda: rng.choice([-1, 2**63, 2**70, 1.0, "4", None]),
    }
    if name in value:
        spec[name] = value[name]()
        return f"{name} = {spec[name]!r}"
    heads, d, dtype = spec["heads"], spec["head_dim"], spec["dtype"]
    if name == "mask":
        keys = int(np.max(spec.get("num_keys", [1]), initial=1))
        rows = 1 if spec["op"] == "decode" else int(np.max(spec.get("q_lens", [1]), initial=1))
        spec["mask"] = [
            "causal", 3, None, np.zeros((rows, keys), np.float16),
            np.zeros((rows, keys, 1, 1, 1), dtype), np.zeros((rows, max(keys - 1, 0)), dtype),
            np.zeros((rows + 5, keys), dtype) if spec["op"] == "flash" else np.zeros(3, dtype),
            "two materialized", "window 0",
        ][int(rng.integers(9))]
        if isinstance(spec["mask"], str) and spec["mask"] not in ("causal",):
            spec["mask"] = "bad:" + spec["mask"]
        return f"mask = {spec['mask']!r:.60}"
    if name == "sinks":
        spec["sinks"] = [np.zeros(heads + 1, dtype), np.zeros((1, heads), dtype), 0.5,
                         np.zeros(heads, np.int32), [0.0] * (heads - 1), "sinks",
                         np.zeros(heads, np.complex128)][int(rng.integers(7))]
        return f"sink_weights = {spec['sinks']!r:.60}"
    if name == "out":
        shape = np.shape(spec.get("q", spec.get("rows")))
        spec["out"] = [
            np.zeros((*shape[:-1], d + 1), dtype), np.zeros(shape, np.float16),
            np.zeros(shape[::-1], dtype), np.zeros((*shape, 2), dtype)[..., 0],
            "q-view", "k-view", "readonly", [0.0],
        ][int(rng.integers(8))]
        return f"out = {spec['out']!r:.60}"
    # merge_states
    outs, lses = spec["outs"], spec["lses"]
    sequences = all(isinstance(x, (list, np.ndarray)) and len(x) for x in (outs, lses))
    if name == "merge_outs" and sequences:
        spec["outs"] = [*outs, _wrong_array(rng, np.asarray(outs[0]))]
        spec["lses"] = [*lses, lses[0]]
    elif name == "merge_lses":
        spec["lses"] = _wrong_array(rng, lses)
    else:
        spec["outs"], spec["lses"] = [], []
    return name


# --------------------------------------------------------------------------------------
# Making the call
# --------------------------------------------------------------------------------------
def _mask(spec, numattn):
    m = spec["mask"]
    if isinstance(m, np.ndarray) or not isinstance(m, str):
        return m
    named = {"null": numattn.NullMask(), "causal": numattn.CausalMask(),
             "sliding": numattn.SlidingWindowCausalMask(3), "chunked": numattn.ChunkedMask(2)}
    if m in named:
        return named[m]
    if m == "bad:two materialized":
        t = np.zeros((1, 1), spec["dtype"])
        return numattn.MaterializedMask(t) & numattn.MaterializedMask(t)
    if m == "bad:window 0":
        return numattn.SlidingWindowCausalMask(0)
    return m


def _kv(spec, numattn):
    if spec["kind"] == "dense":
        return spec["k_blocks"], spec["v_blocks"]
    cls = numattn.PagedKVCache if spec["kind"] == "paged" else numattn.ContinuousBatchingKVCache
    return (cls(spec["k_blocks"], spec["cache_lengths"], spec["lookup_table"]),
            cls(spec["v_blocks"], spec["cache_lengths"], spec["lookup_table"]))


def _out(spec):
    out = spec["out"]
    if not isinstance(out, str):
        return out
    q = spec.get("q", spec.get("rows"))
    if out == "q-view":
        return q[::-1] if isinstance(q, np.ndarray) else None
    if out == "k-view":
        blocks = spec["k_blocks"]
        shape = np.shape(q)
        size = int(np.prod(shape))
        if isinstance(blocks, np.ndarray) and blocks.size >= size and blocks.flags.c_contiguous:
            return blocks.reshape(-1)[:size].reshape(shape)
        return None
    x = np.zeros(np.shape(q), spec["dtype"])
    x.flags.writeable = False
    return x


def invoke(spec):
    """Make the call that ``spec`` describes."""
    import numattn

    op = spec["op"]
    if op == "merge":
        return numattn.merge_states(spec["outs"], spec["lses"])
    config = spec["config"]
    if isinstance(config, tuple):  # an MHAConfig field out of range
        config = numattn.MHAConfig(**{config[0]: config[1]})
    k, v = _kv(spec, numattn)
    if op == "store_kv":
        return numattn.store_kv(k, spec["rows"], spec["kv_offsets"])
    mask, out = _mask(spec, numattn), _out(spec)
    common = {"out": out, "return_lse": spec["return_lse"], "config": config}
    if op == "flash":
        return numattn.flash_attention_kv_cache(
            spec["q"], k, v, mask, spec["scale"], q_input_row_offsets=spec["q_offsets"],
            kv_input_row_offsets=spec["kv_offsets"] if spec["q_offsets"] is not None else None,
            sink_weights=spec["sinks"], **common)
    if op == "decode":
        return numattn.decode_attention(spec["q"], k, v, mask, spec["scale"],
                                        sink_weights=spec["sinks"],
                                        num_partitions=spec["num_partitions"],
                                        device=spec["device"], **common)
    return numattn.cross_attention(spec["q"], spec["q_offsets"], spec["q_max_seq_len"], k, v,
                                   spec["kv_offsets"], mask, spec["scale"],
                                   device=spec["device"], **common)


def reference_of(spec):
    """What :mod:`numattn.reference` computes for ``spec`` (a call that must succeed)."""
    import numattn
    from numattn import reference

    k, v = _kv(spec, numattn)
    mask, op = _mask(spec, numattn), spec["op"]
    if op == "flash":
        return reference.flash_attention_kv_cache(
            spec["q"], k, v, mask, spec["scale"], q_input_row_offsets=spec["q_offsets"],
            kv_input_row_offsets=spec["kv_offsets"] if spec["q_offsets"] is not None else None,
            sink_weights=spec["sinks"], return_lse=True)
    if op == "decode":
        return reference.decode_attention(spec["q"], k, v, mask, spec["scale"],
                                          sink_weights=spec["sinks"], return_lse=True)
    if op == "cross":
        return reference.cross_attention(spec["q"], spec["q_offsets"], spec["q_max_seq_len"],
                                         k, v, spec["kv_offsets"], mask, spec["scale"],
                                         return_lse=True)
    return None


def _snapshot(spec):
    """Copies of every array among the ingredients (to compare after the call)."""
    arrays = {name: x for name, x in spec.items() if isinstance(x, np.ndarray)}
    out = _out(spec)
    if isinstance(out, np.ndarray):
        arrays["out"] = out
    return {name: (x, x.copy()) for name, x in arrays.items()}


def _changed(snapshot, skip=()):
    """The arrays whose bytes differ from their copies (bitwise: NaN equals itself)."""
    return sorted(name for name, (x, before) in snapshot.items() if name not in skip
                  and x.tobytes() != before.tobytes())


def _close(got, want, dtype):
    tol = 2e-4 if dtype == np.float32 else 1e-10
    g, w = np.asarray(got, np.float64), np.asarray(want)
    same = (np.isnan(g) == np.isnan(w)) & ((g == w) | (np.abs(g - w) <= tol * (1 + np.abs(w))))
    return bool(np.all(same | (np.isnan(g) & np.isnan(w))))


def run_one(seed, index):
    """Build and make call ``index`` of ``seed``; returns a problem (str) or None."""
    import numattn

    rng = np.random.default_rng([seed, index])
    spec = _valid_spec(rng)
    what, harmless = [], True
    for _ in range(int(rng.choice([1, 1, 1, 2, 3]))):  # mostly one thing broken
        text, only_values = _break(spec, rng)
        what.append(text)
        harmless &= only_values
    snapshot = _snapshot(spec)
    allowed = (ValueError, TypeError, numattn.CudaUnavailableError)
    try:
        result = invoke(spec)
    except allowed as exc:
        if harmless:
            return f"{what}: a valid call raised {type(exc).__name__}: {exc}"
        changed = _changed(snapshot)
        if changed:
            return f"{what}: raised {type(exc).__name__} but changed {changed}"
        return None
    except Exception as exc:
        return (f"{what}: raised {type(exc).__name__} (only ValueError, TypeError, "
                f"CudaUnavailableError allowed): {exc!s:.300}\n{traceback.format_exc()}")
    # out= may be q (in place) and, for decode, share memory with k and v
    written = {"out", "q", "k_blocks"} if spec["out"] is not None else set()
    if spec["op"] == "store_kv":
        written |= {"k_blocks"}
    changed = _changed(snapshot, skip=written)
    if changed:
        return f"{what}: returned but changed its inputs {changed}"
    if harmless and spec["op"] in ("flash", "decode", "cross") and spec["return_lse"]:
        want = reference_of(spec)
        for got, expected, part in zip(result, want, ("out", "lse")):
            if not _close(got, expected, spec["dtype"]):
                return f"{what}: {part} differs from the reference"
    return None


def child_main(argv=None):
    """Run calls ``0 .. calls - 1`` of a seed; print one JSON line per problem; exit 1 if
    any."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("seed", type=int)
    parser.add_argument("calls", type=int)
    parser.add_argument("--only", type=int, default=None, help="make only this call")
    args = parser.parse_args(argv)
    import warnings

    warnings.simplefilter("ignore")  # NaN/inf inputs make NumPy warn; errors are the subject
    indices = range(args.calls) if args.only is None else [args.only]
    problems = 0
    for index in indices:
        print(f"call {index}", file=sys.stderr, flush=True)  # the last one names a crash
        problem = run_one(args.seed, index)
        if problem is not None:
            problems += 1
            print(json.dumps({"seed": args.seed, "index": index, "problem": problem}),
                  flush=True)
    return 1 if problems else 0


# --------------------------------------------------------------------------------------
# The test (parent side)
# --------------------------------------------------------------------------------------
def _child_env():
    import numattn

    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(numattn.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _calls_per_seed():
    return max(1, -(-CALLS // len(SEEDS)))


def _run_child(seed):
    calls = _calls_per_seed()
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), str(seed), str(calls)],
                          capture_output=True, text=True, env=_child_env(), timeout=3600)
    return proc, calls


@pytest.mark.parametrize("seed", SEEDS)
def test_fuzz_malformed_calls(seed):
    proc, calls = _run_child(seed)
    last = [line for line in proc.stderr.splitlines() if line.startswith("call ")]
    running = last[-1].split()[1] if last else "?"
    reproduce = f"python tests/test_fuzz.py {seed} {calls} --only {running}"
    assert proc.returncode >= 0, (
        f"the child crashed (signal {-proc.returncode}) in call {running} of seed {seed}: "
        f"{reproduce}\n{proc.stderr[-2000:]}")
    problems = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and not problems, "\n".join(
        [f"seed {seed}: {len(problems)} of {calls} calls went wrong (reproduce one with "
         f"python tests/test_fuzz.py {seed} {calls} --only INDEX)"]
        + [f"call {p['index']}: {p['problem']}" for p in problems[:20]]
        + ([] if problems else [proc.stderr[-2000:]]))


if __name__ == "__main__":
    sys.exit(child_main())
