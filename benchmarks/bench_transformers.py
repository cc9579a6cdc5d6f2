"""Benchmark: greedy generation in Hugging Face transformers, numattn against sdpa and eager.

Run ``python benchmarks/bench_transformers.py`` (``--small`` for a quick run on short
contexts).  A Llama-shaped model of 2 layers with H = 32 query heads, Hkv = 8 KV heads and
D = 128 (hidden size 4096; MLP width and vocabulary kept small so that attention is a
visible share of a step), float32 on the CPU, generates greedily from contexts of 512, 4k
and 16k tokens with batches of 1 and 8.  Each context is loaded into the caches as random
keys and values (a prefill of 16k tokens by eager attention would need a 16k x 16k score
matrix per head), then ``--tokens`` tokens are generated one by one (the model's forward with
the cache, argmax of the last logits), and the median over ``--repeats`` rounds of tokens per
second is printed for:

* ``numattn``: ``attn_implementation="numattn"`` with :class:`NumattnCache` (token-major pages
  read in place, new rows written with ``store_kv``);
* ``numattn+dyn``: the same attention over transformers' ``DynamicCache`` (head-major: numattn
  copies a transposed view each call);
* ``sdpa`` and ``eager``: transformers' own implementations with ``DynamicCache``.

The ratios are numattn's tokens per second over sdpa's and eager's (above 1: numattn is
faster).  The implementations take turns within each round, so that all see the same state
of a shared machine.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # numattn

# numattn first: its import sets GOMP_SPINCOUNT (docs/performance.rst, "Sharing the cores with
# NumPy"), which torch's OpenMP runtime reads when torch is imported; without it torch's
# threads spin for milliseconds after each operation and take the cores from numattn's
import numattn  # noqa: F401

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 32, 8, 128, 2
#: The model's hidden size: the attention's shape does not depend on it (transformers projects
#: to H * D = 4096 and back), and a small one keeps the projections from hiding the
#: attention's share of a step (``--hidden 4096`` for the square model).
HIDDEN = 1024
CONTEXTS = (512, 4096, 16384)
SMALL_CONTEXTS = (128, 512)
BATCHES = (1, 8)
IMPLS = ("numattn", "numattn+dyn", "sdpa", "eager")


def build_models(torch, transformers, hidden=HIDDEN):
    """One model per attention implementation, sharing the same weights."""
    from numattn.integrations.transformers import register

    register()
    config = transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=1024, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        vocab_size=1024, max_position_embeddings=32768,
    )
    torch.manual_seed(0)
    models = {}
    for impl in ("numattn", "sdpa", "eager"):
        model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                              attn_implementation=impl)
        if models:
            model.load_state_dict(next(iter(models.values())).state_dict())
        models[impl] = model.eval()
    models["numattn+dyn"] = models["numattn"]
    return models


def filled_cache(torch, transformers, impl, model, batch, context, seed):
    """A cache holding ``context`` random tokens per sequence in every layer."""
    from numattn.integrations.transformers import NumattnCache

    gen = torch.Generator().manual_seed(seed)
    if impl == "numattn":
        cache = NumattnCache(model.config, max_cache_len=context + 1024)
    else:
        cache = transformers.DynamicCache(config=model.config)
    for layer in range(LAYERS):
        k = torch.randn(batch, KV_HEADS, context, HEAD_DIM, generator=gen)
        v = torch.randn(batch, KV_HEADS, context, HEAD_DIM, generator=gen)
        if impl == "numattn":
            cache.append(k, v, layer)
        else:
            cache.update(k, v, layer)
    return cache


def decode_seconds(torch, model, cache, batch, tokens):
    """Seconds to generate ``tokens`` tokens greedily, one forward per token."""
    ids = torch.ones(batch, 1, dtype=torch.long)
    start = time.perf_counter()
    for _ in range(tokens):
        logits = model(ids, cache=cache, use_cache=True).logits
        ids = logits[:, -1:].argmax(dim=-1)
    return time.perf_counter() - start


def run_case(torch, transformers, models, impls, batch, context, tokens, repeats):
    """Median tokens per second of each implementation, taking turns round by round."""
    rates = {impl: [] for impl in impls}
    with torch.inference_mode():
        for r in range(repeats):
            for impl in impls:
                cache = filled_cache(torch, transformers, impl, models[impl], batch, context, r)
                decode_seconds(torch, models[impl], cache, batch, 1)  # first call: compile
                seconds = decode_seconds(torch, models[impl], cache, batch, tokens)
                rates[impl].append(batch * tokens / seconds)
                del cache
    return {impl: statistics.median(v) for impl, v in rates.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true",
                        help=f"contexts {SMALL_CONTEXTS} instead of {CONTEXTS}")
    parser.add_argument("--contexts", type=int, nargs="+", help="context lengths to run")
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--tokens", type=int, default=8, help="tokens generated per round")
    parser.add_argument("--repeats", type=int, default=3, help="rounds (the median is shown)")
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--hidden", type=int, default=HIDDEN,
                        help=f"the model's hidden size (default {HIDDEN})")
    parser.add_argument("--torch-threads", type=int,
                        help="torch's thread count (by default its own)")
    args = parser.parse_args(argv)
    for name in ("tokens", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.hidden < 1:
        parser.error("--hidden must be >= 1")
    if any(n < 1 for n in args.batches) or any(n < 1 for n in args.contexts or [1]):
        parser.error("--batches and --contexts must be >= 1")
    try:
        import torch
        import transformers
    except ImportError:
        parser.error("this benchmark needs torch and transformers: pip install "
                     ".[transformers]")
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    contexts = args.contexts or (SMALL_CONTEXTS if args.small else CONTEXTS)
    models = build_models(torch, transformers, args.hidden)
    print(f"greedy decode, {LAYERS} layers, H={HEADS} Hkv={KV_HEADS} D={HEAD_DIM}, hidden "
          f"{args.hidden}, float32, "
          f"{args.tokens} tokens x {args.repeats} rounds (median tokens/s), torch threads "
          f"{torch.get_num_threads()}")
    names = "".join(f"{impl:>12}" for impl in args.impls)
    ratios = "".join(f"{'/' + impl:>10}" for impl in ("sdpa", "eager") if impl in args.impls)
    print(f"{'batch':>5} {'context':>7}{names}{ratios}")
    for batch in args.batches:
        for context in contexts:
            rate = run_case(torch, transformers, models, args.impls, batch, context,
                            args.tokens, args.repeats)
            cells = "".join(f"{rate[impl]:12.1f}" for impl in args.impls)
            ratio = "".join(f"{rate['numattn'] / rate[impl]:10.2f}"
                            for impl in ("sdpa", "eager")
                            if impl in args.impls and "numattn" in rate)
            print(f"{batch:>5} {context:>7}{cells}{ratio}", flush=True)


if __name__ == "__main__":
    main()
