"""Command line: ``python -m numattn {check,bench,demo,warmup}`` (also the ``numattn`` script).

Each command imports its tool only when it runs, so ``numattn --help`` stays fast."""

from __future__ import annotations

import argparse
import sys

#: K/V dtypes of ``bench --dtype`` and ``demo --dtype`` (queries too for the 16-bit ones)
STORAGE_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "int8")


def at_least(minimum):
    """An argparse type: an integer >= ``minimum`` (the command line's and the benchmark
    scripts' counts of runs, threads and sizes)."""

    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def _progress(step, total):
    if sys.stderr.isatty():
        bar = "#" * (30 * step // total)
        print(f"\rgenerating [{bar:<30}] {step}/{total}", end="", file=sys.stderr, flush=True)
        if step == total:
            print(file=sys.stderr)


def _dask_demo(args) -> int:
    try:
        from .. import dask  # noqa: F401  (its ImportError says how to install Dask)
        from .demo import run_dask_demo
    except ImportError as exc:
        print(f"numattn demo --dask: {exc}", file=sys.stderr)
        return 2
    print(f"decode with the prompts' KV cache sharded over a distributed.LocalCluster of "
          f"{args.workers} worker processes (1 thread each): {args.batch} prompts of "
          f"{args.prompt_length} tokens prefilled here, each layer's K/V cut along the keys "
          f"into {args.workers} chunks, one sent to each worker, where it stays; each step "
          "sends the queries and the new tokens' K/V rows, and every worker attends its "
          "chunk (numattn.dask.decode_attention); the partial results are merged with "
          "merge_states", flush=True)
    result = run_dask_demo(batch=args.batch, prompt_length=args.prompt_length,
                           new_tokens=args.new_tokens, seed=args.seed, workers=args.workers,
                           progress=_progress)
    steady = slice(1, None) if len(result.step_seconds) > 1 else slice(None)
    print(f"K/V held by the workers: {result.held_bytes} bytes")
    print(f"per step: the workers sent each other {max(result.worker_bytes[steady])} bytes at "
          f"most (a key chunk's partial output and LSE: {result.partial_bytes} bytes per "
          f"layer); the graph carried {result.sent_bytes[-1]} bytes at the last step "
          "(queries and the new tokens' K/V)")
    print(f"decode: {result.generated.shape[1]} tokens per sequence, "
          f"{result.tokens_per_second:.1f} tokens/s (steps after the first)")
    ok = result.max_difference <= 1e-5
    print(f"largest difference from single-process decode_attention over "
          f"{result.attention_calls} calls: {result.max_difference:.2e} "
          f"({'PASS' if ok else 'FAIL'}, tolerance 1e-05)")
    return 0 if ok else 1


def _demo(args) -> int:
    if args.dask:
        return _dask_demo(args)
    from .demo import run_demo

    progress = _progress
    result = run_demo(batch=args.batch, new_tokens=args.new_tokens, seed=args.seed,
                      check=not args.no_check, progress=progress, dtype=args.dtype)
    print(f"prompts: {len(result.prompt_lengths)} sequences of {result.prompt_lengths} tokens, "
          f"prefilled into a paged {args.dtype} KV cache with flash_attention_kv_cache")
    print(f"prefill: {result.prefill_seconds * 1e3:.1f} ms (a first call in a process compiles "
          "the kernels or loads them from the disk cache)")
    print(f"decode:  {result.generated.shape[1]} tokens per sequence with decode_attention, "
          f"{result.tokens_per_second:.1f} tokens/s (steps after the first)")
    for b, ids in enumerate(result.generated):
        print(f"  sequence {b}: {' '.join(str(int(t)) for t in ids[:16])}"
              f"{' ...' if ids.size > 16 else ''}")
    if args.no_check:
        print("reference check skipped (--no-check)")
        return 0
    ok = result.max_error <= result.tolerance
    print(f"largest error against numattn.reference over {result.attention_calls} attention "
          f"calls: {result.max_error:.2e} ({'PASS' if ok else 'FAIL'}, tolerance "
          f"{result.tolerance:.2g} for {args.dtype} results)")
    return 0 if ok else 1


def _check(args) -> int:
    from .check import main

    return main(args)


def _bench(args) -> int:
    from .bench import main

    return main(args)


def _warmup(args) -> int:
    from .warmup import main

    return main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="numattn",
        description="numattn: attention kernels for NumPy (CPU, optional CUDA).",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name, text):
        return sub.add_parser(name, help=text, description=text)  # in both listings

    check = command("check", "compare every operation and backend with the reference")
    check.add_argument("--seed", type=int, default=0,
                       help="seed of the random problems (default 0)")
    check.add_argument("--cpu-only", action="store_true", help="skip the CUDA backend")
    check.set_defaults(func=_check)

    bench = command("bench", "time the benchmark shapes against the machine's limits")
    bench.add_argument("--quick", action="store_true", help="small shapes, under a minute")
    bench.add_argument("--only", action="append", default=None,
                       help="run only cases whose name contains this (repeatable)")
    bench.add_argument("--repeat", type=at_least(1), default=None, help="timed runs per case")
    bench.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    bench.add_argument("--plot", metavar="FILE.png", help="draw the figures (needs matplotlib)")
    bench.add_argument("--dtype", choices=STORAGE_DTYPES, default="float32",
                       help="store K/V (and 16-bit queries) in this dtype; the baseline is "
                            "torch SDPA in it (float32 for the 8-bit ones)")
    bench.set_defaults(func=_bench)

    demo = command("demo", "prefill + generate with a toy GPT and a paged KV cache")
    demo.add_argument("--batch", type=at_least(1), default=4,
                      help="prompts generated side by side (default 4)")
    demo.add_argument("--new-tokens", type=at_least(2), default=32,
                      help="tokens to generate per sequence (the rate counts steps after the "
                           "first)")
    demo.add_argument("--seed", type=int, default=0,
                      help="seed of the toy model's weights and prompts (default 0)")
    demo.add_argument("--dtype", choices=STORAGE_DTYPES, default="float32",
                      help="the KV cache's dtype (bfloat16 and float16 also for the "
                           "activations; int8 and float8 caches are quantized by store_kv)")
    demo.add_argument("--no-check", action="store_true", help="skip the reference comparison")
    demo.add_argument("--dask", action="store_true",
                      help="decode with the KV cache sharded over Dask worker processes "
                           "(needs the dask extra, .[dask])")
    demo.add_argument("--workers", type=at_least(1), default=2,
                      help="worker processes with --dask")
    demo.add_argument("--prompt-length", type=at_least(1), default=2048,
                      help="tokens per prompt with --dask")
    demo.set_defaults(func=_demo)

    warmup = command("warmup", "compile every CPU kernel into the disk cache "
                               "(NUMBA_CACHE_DIR), for image builds and CI caches")
    warmup.add_argument("--dtype", nargs="+", choices=("float32", "float64"),
                        default=["float32", "float64"], help="compute dtypes (default: both)")
    warmup.add_argument("--cuda", action="store_true",
                        help="also launch the CUDA kernels (compiled in this process only)")
    warmup.set_defaults(func=_warmup)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
