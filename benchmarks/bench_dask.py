"""Benchmark of ``numattn.dask``: attention over K/V held by Dask worker processes against
single-process numattn on the same data.

Run ``python benchmarks/bench_dask.py`` (``--repeat N`` rounds; ``--no-flash`` times decode
only).  It starts a ``distributed.LocalCluster`` of 2 worker processes x 1 thread (Numba on
one thread in each worker's task thread; work stealing off, so that no K/V chunk moves),
generates K/V on the workers as two key chunks (one per worker) and persists them there,
then fetches the same data into this process, where single-process numattn runs on 2
threads.  The two contenders take turns, round after round (the machine may be shared: the
load average is printed before and after).

* decode: B=1, H=32, Hkv=8, N=262144, D=128, float32, causal.  It prints the median step
  time of each (a Dask step: graph, scheduling, both chunks' tasks, the merge and the
  result's way back), their ratio (target: within 1.5x), and the bytes that moved between
  processes per step (read from the workers' transfer logs, plus the result) against the
  partial outputs and LSEs the design sends and the K/V bytes it does not.
* flash: B=1, S=N=8192, H=32, Hkv=8, D=128, float32, keys in two chunks; NullMask (the two
  chunks' work is equal) and CausalMask (the first chunk's keys are seen by every query,
  the second's by half of them: three quarters of the work on one worker).  Target: within
  1.3x (NullMask).
* the fixed cost of a step: the decode step at N=2048, where the attention itself takes
  well under a millisecond.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # numattn

import dask
import dask.array as da
import distributed
import numba

import numattn
import numattn.dask as nd
from numattn.tools.bench import interleaved_times
from numattn.tools.cli import at_least

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
DECODE_KEYS = 262144
FLASH_LEN = 8192
SMALL_KEYS = 2048


def one_numba_thread():
    """Numba's parallel loops on one thread, for the calling thread (a worker's task
    thread: setting ``NUMBA_NUM_THREADS`` in a worker's environment breaks compiling)."""
    numba.set_num_threads(1)


def received(dask_worker):
    """Bytes this worker has received from other workers so far: ``[K/V bytes, others]``."""
    kv = other = 0
    for entry in dask_worker.transfer_incoming_log:
        for key, size in entry["keys"].items():
            name = str(key[0] if isinstance(key, tuple) else key)
            if name.startswith("standard_normal"):
                kv += size
            else:
                other += size
    return [kv, other]


def persisted_kv(client, num_keys, seed):
    """K and V ``[1, N, Hkv, D]`` float32 generated on the workers in two key chunks, chunk
    ``j`` held by worker ``j``; and the same arrays in this process."""
    workers = sorted(client.scheduler_info()["workers"])[:2]
    shape, chunks = (1, num_keys, KV_HEADS, HEAD_DIM), (1, num_keys // 2, KV_HEADS, HEAD_DIM)
    arrays = []
    def worker_of(key):  # chunk j on worker j; no place for a key of another shape
        return [workers[key[2]]] if isinstance(key, tuple) and key[2:3] in ((0,), (1,)) else None

    for part in range(2):
        with dask.annotate(workers=worker_of, allow_other_workers=False):
            x = da.random.default_rng(seed + part).standard_normal(shape, chunks=chunks,
                                                                   dtype=np.float32)
        arrays.append(client.persist(x, optimize_graph=False))
    distributed.wait(arrays)
    # the blocks straight to this process (x.compute() would first gather them on a worker)
    local = [np.concatenate(client.gather(sorted(distributed.futures_of(x),
                                                 key=lambda f: f.key[2])), axis=1)
             for x in arrays]
    placement = {f"keys {key[2]}": sorted(who)
                 for key, who in client.who_has(arrays[0]).items()}
    return arrays, local, placement


def step_bytes(client, fn):
    """Bytes the workers received from each other during one call of ``fn`` (which returns
    the result): ``([K/V bytes, other bytes], result)``."""
    before = np.sum(list(client.run(received).values()), axis=0)
    result = fn()
    return (np.sum(list(client.run(received).values()), axis=0) - before).tolist(), result


def report(label, times, single_label="one process, 2 threads"):
    dask_t, single_t = times
    ratios = [a / b for a, b in zip(dask_t, single_t)]
    print(f"  {label}: dask {statistics.median(dask_t) * 1e3:.1f} ms "
          f"(min {min(dask_t) * 1e3:.1f}, max {max(dask_t) * 1e3:.1f}), "
          f"{single_label} {statistics.median(single_t) * 1e3:.1f} ms "
          f"(min {min(single_t) * 1e3:.1f}, max {max(single_t) * 1e3:.1f}); "
          f"ratio dask / one process: median {statistics.median(ratios):.2f}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=at_least(1), default=7)
    parser.add_argument("--no-flash", action="store_true", help="time decode only")
    args = parser.parse_args(argv)
    print(f"load average before: {os.getloadavg()}")
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    rng = np.random.default_rng(0)
    with dask.config.set({"distributed.scheduler.work-stealing": False}), \
            distributed.LocalCluster(processes=True, n_workers=2, threads_per_worker=1,
                                     dashboard_address=":0") as cluster, \
            distributed.Client(cluster) as client:
        for worker in client.scheduler_info()["workers"]:  # each worker's one task thread
            client.submit(one_numba_thread, workers=[worker], pure=False).result()
        print(f"cluster: 2 worker processes x 1 thread; this process: numattn on "
              f"{numba.get_num_threads()} threads")

        # -- decode --
        (kd, vd), (k, v), placement = persisted_kv(client, DECODE_KEYS, 1)
        q = rng.standard_normal((1, HEADS, HEAD_DIM), dtype=np.float32)
        mask = numattn.CausalMask()
        kv_bytes = k.nbytes + v.nbytes
        print(f"decode B=1 H={HEADS} Hkv={KV_HEADS} N={DECODE_KEYS} D={HEAD_DIM} float32: "
              f"K/V {kv_bytes / 2**30:.2f} GiB in 2 key chunks, held by {placement}")

        def dask_decode():
            return nd.decode_attention(q, kd, vd, mask).compute()

        def single_decode():
            return numattn.decode_attention(q, k, v, mask)

        expected = single_decode()
        moved, got = step_bytes(client, dask_decode)  # the workers compile or load kernels
        moved, got = step_bytes(client, dask_decode)
        error = float(np.abs(got - expected).max())
        report("decode step", interleaved_times([dask_decode, single_decode],
                                                repeat=args.repeat))
        partial = HEADS * (HEAD_DIM + 1) * 4
        print(f"  bytes between workers per step: {moved[1]} (one key chunk's partial output "
              f"and LSE: {partial}; q: {q.nbytes}) and {moved[0]} of K/V (of {kv_bytes}); "
              f"result to the client: {got.nbytes}; max |dask - one process| = {error:.2e}")
        del kd, vd, k, v

        # -- the fixed cost of a step: graph, scheduling, the merge, the way back --
        (kd, vd), (k, v), _ = persisted_kv(client, SMALL_KEYS, 3)
        times = interleaved_times([lambda: nd.decode_attention(q, kd, vd, mask).compute(),
                                   lambda: numattn.decode_attention(q, k, v, mask)],
                                  repeat=5 * args.repeat)
        report(f"decode step, N={SMALL_KEYS} (the fixed cost of a Dask step)", times)
        del kd, vd, k, v

        if not args.no_flash:
            (kd, vd), (k, v), placement = persisted_kv(client, FLASH_LEN, 2)
            q = rng.standard_normal((1, FLASH_LEN, HEADS, HEAD_DIM), dtype=np.float32)
            print(f"flash B=1 S=N={FLASH_LEN} H={HEADS} Hkv={KV_HEADS} D={HEAD_DIM} float32, "
                  f"keys in 2 chunks held by {placement}")
            for mask in (numattn.NullMask(), numattn.CausalMask()):
                def dask_flash(mask=mask):
                    return nd.flash_attention_kv_cache(q, kd, vd, mask).compute()

                def single_flash(mask=mask):
                    return numattn.flash_attention_kv_cache(q, k, v, mask)

                expected = single_flash()
                moved, got = step_bytes(client, dask_flash)
                error = float(np.abs(got - expected).max())
                report(f"flash {type(mask).__name__}",
                       interleaved_times([dask_flash, single_flash],
                                         repeat=max(1, args.repeat // 2), warmup=0))
                print(f"  bytes between workers per call: {moved[1]} (q: {q.nbytes}; the "
                      f"partial states of one key chunk: "
                      f"{FLASH_LEN * HEADS * (HEAD_DIM + 1) * 4}) and {moved[0]} of K/V (of "
                      f"{k.nbytes + v.nbytes}); max |dask - one process| = {error:.2e}")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
