"""numattn inside Hugging Face transformers (``attn_implementation="numattn"``).

Tiny random models of each supported family, built from configurations (nothing is
downloaded), run with numattn and with transformers' eager attention on the same weights:
prompt logits, chunked prefill over a cache, greedy generation with ``DynamicCache`` and
with :class:`NumattnCache`, left-padded batches, and the options numattn refuses.  The
attention function itself is compared with a float64 reference.
"""

from __future__ import annotations

import copy
import importlib
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from numattn.integrations.transformers import (  # noqa: E402
    NumattnCache,
    _softcap_mod,
    numattn_attention,
    numattn_mask,
    register,
)

register()

#: Relative tolerance of logits against eager attention (float32).
RTOL = 1e-4
#: Prompt length; every sliding window below is shorter.
PROMPT = 12
#: Gemma-2's attn_logit_softcapping in the tests (the models' default is 50).
SOFTCAP = 2.0


def _small(**extra):
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
                initializer_range=0.2, max_position_embeddings=256)
    base.update(extra)
    return base


FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**_small()),
    # a window shorter than the prompt, on every layer
    "mistral": lambda: transformers.MistralConfig(**_small(sliding_window=5)),
    # layer 0 full attention, layer 1 a sliding window
    "qwen2": lambda: transformers.Qwen2Config(**_small(use_sliding_window=True, sliding_window=4,
                                                       max_window_layers=1)),
    # sinks (s_aux) on every layer, sliding and full layers alternating
    "gpt_oss": lambda: transformers.GptOssConfig(**_small(
        intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=4)),
    # logit soft-capping on every layer (a cap these scores reach), layer 0 a sliding window
    # and layer 1 full attention
    "gemma2": lambda: transformers.Gemma2Config(**_small(
        sliding_window=4, attn_logit_softcapping=SOFTCAP, query_pre_attn_scalar=16)),
}


def pair(family, seed=0):
    """The same random model with eager attention and with numattn."""
    config = FAMILIES[family]()
    torch.manual_seed(seed)
    eager = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                          attn_implementation="eager")
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                         attn_implementation="numattn")
    ours.load_state_dict(eager.state_dict())
    if family == "gpt_oss":  # sinks start at zero: make them matter
        with torch.no_grad():
            for a, b in zip(eager.model.layers, ours.model.layers):
                a.self_attn.sinks.normal_(0.0, 1.0)
                b.self_attn.sinks.copy_(a.self_attn.sinks)
    return eager.eval(), ours.eval()


def assert_logits_close(actual, expected, where=None):
    if where is not None:
        actual, expected = actual[where], expected[where]
    err = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert err <= RTOL * scale, f"max error {err:.3g} against max |logit| {scale:.3g}"


def ids(rng, batch, length):
    return torch.from_numpy(rng.integers(1, 128, size=(batch, length)))


def make_cache(kind, model):
    return NumattnCache(model.config, page_size=4) if kind == "numattn" else \
        transformers.DynamicCache(config=model.config)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    return request.param


@pytest.fixture(scope="module")
def models(family):
    return pair(family)


# ---------------------------------------------------------------------------------------------
# registration and import


def test_register_is_idempotent():
    assert register() == register() == "numattn"
    assert transformers.AttentionInterface()["numattn"] is numattn_attention
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    assert ALL_MASK_ATTENTION_FUNCTIONS["numattn"] is numattn_mask


def test_import_without_transformers_names_the_extra(monkeypatch):
    monkeypatch.delitem(sys.modules, "numattn.integrations.transformers")
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"pip install \.\[transformers\]"):
        importlib.import_module("numattn.integrations.transformers")


# ---------------------------------------------------------------------------------------------
# numerics against eager attention


def test_prompt_logits_match_eager(models, rng):
    eager, ours = models
    x = ids(rng, 2, PROMPT)
    with torch.no_grad():
        assert_logits_close(ours(x).logits, eager(x).logits)


@pytest.mark.parametrize("cache", ["dynamic", "numattn"])
def test_chunked_prefill_over_a_cache_matches_one_pass(models, cache, rng):
    eager, ours = models
    x = ids(rng, 2, PROMPT + 2)
    with torch.no_grad():
        expected = eager(x).logits
        past = make_cache(cache, ours)
        chunks = [ours(x[:, a:b], cache=past, use_cache=True).logits
                  for a, b in ((0, 7), (7, 12), (12, 13), (13, 14))]
    assert past.get_seq_length() == PROMPT + 2
    assert_logits_close(torch.cat(chunks, dim=1), expected)


@pytest.mark.parametrize("cache", ["dynamic", "numattn"])
def test_greedy_generation_matches_eager(models, cache, rng):
    eager, ours = models
    x = ids(rng, 2, PROMPT)
    mask = torch.ones_like(x)
    kwargs = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    expected = eager.generate(x, **kwargs)
    extra = {"cache": make_cache("numattn", ours)} if cache == "numattn" else {}
    assert torch.equal(ours.generate(x, **kwargs, **extra), expected)


@pytest.mark.parametrize("cache", ["dynamic", "numattn"])
def test_left_padded_batch(models, cache, rng):
    eager, ours = models
    x = ids(rng, 3, PROMPT)
    mask = torch.ones_like(x)
    mask[0, :5] = 0
    mask[2, :1] = 0
    x[mask == 0] = 0
    with torch.no_grad():  # logits of the real positions
        assert_logits_close(ours(x, attention_mask=mask).logits,
                            eager(x, attention_mask=mask).logits, where=mask.bool())
    kwargs = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    expected = eager.generate(x, **kwargs)
    extra = {"cache": make_cache("numattn", ours)} if cache == "numattn" else {}
    assert torch.equal(ours.generate(x, **kwargs, **extra), expected)


def test_numattn_cache_holds_the_real_tokens_in_pages(rng):
    eager, ours = pair("llama", seed=1)
    x = ids(rng, 2, PROMPT)
    mask = torch.ones_like(x)
    mask[1, :4] = 0
    past = NumattnCache(ours.config, page_size=4, max_cache_len=40)
    reference = transformers.DynamicCache(config=eager.config)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    first = past.layers[0]
    out = ours.generate(x, cache=past, **kwargs)
    assert torch.equal(out, eager.generate(x, cache=reference, **kwargs))
    k, v = past.kv_caches(0)
    assert k.blocks.base is first._pool and v.blocks.base is first._pool  # never reallocated
    lengths = mask.sum(dim=1).numpy() + 6 - 1  # the last token is not fed back
    assert k.cache_lengths.tolist() == lengths.tolist()
    assert past.get_seq_length() == reference.get_seq_length() == PROMPT + 5
    dense = reference.layers[0].keys.numpy()  # [B, Hkv, positions, D], padding included
    for b in range(2):
        n = lengths[b]
        pos = np.arange(n)
        rows = k.blocks[k.lookup_table[b, pos // k.page_size], pos % k.page_size]
        np.testing.assert_allclose(rows, dense[b, :, -n:].transpose(1, 0, 2), rtol=1e-5,
                                   atol=1e-6)


def test_numattn_cache_pool_grows_page_by_page_and_keeps_its_rows(rng):
    _, ours = pair("llama")
    past = NumattnCache(ours.config, page_size=4)
    k1 = torch.from_numpy(rng.standard_normal((2, 2, 6, 16), dtype=np.float32))
    k2 = torch.from_numpy(rng.standard_normal((2, 2, 9, 16), dtype=np.float32))
    past.append(k1, -k1, 0)
    past.append(k2, -k2, 0)
    k, v = past.kv_caches(0)
    assert k.cache_lengths.tolist() == [15, 15] and k.capacity >= 15
    for b in range(2):
        pos = np.arange(15)
        rows = k.blocks[k.lookup_table[b, pos // 4], pos % 4]
        want = torch.cat([k1, k2], dim=2)[b].numpy().transpose(1, 0, 2)
        np.testing.assert_array_equal(rows, want)
        np.testing.assert_array_equal(v.blocks[k.lookup_table[b, pos // 4], pos % 4], -want)


# ---------------------------------------------------------------------------------------------
# the attention function against a float64 reference


def reference_attention(q, k, v, real, scale, window, sinks, softcap=None):
    """float64 attention of ``q`` [B, H, S, D] over ``k``, ``v`` [B, Hkv, N, D]: query row
    ``r`` at position ``N - S + r``, keys hidden where ``real`` is false, causal, windowed,
    scores soft-capped at ``softcap``."""
    q, k, v = (np.asarray(t, dtype=np.float64) for t in (q, k, v))
    b, h, s, d = q.shape
    n, group = k.shape[2], h // k.shape[1]
    out = np.zeros((b, s, h, d))
    for bi in range(b):
        for hi in range(h):
            for r in range(s):
                i = n - s + r
                j = np.arange(n)
                seen = real[bi] & (j <= i)
                if window is not None:
                    seen &= i - j < window
                if not real[bi, i] or not seen.any():
                    continue
                scores = scale * k[bi, hi // group, seen] @ q[bi, hi, r]
                if softcap is not None:
                    scores = softcap * np.tanh(scores / softcap)
                top = scores.max() if sinks is None else max(scores.max(), sinks[hi])
                w = np.exp(scores - top)
                den = w.sum() + (0.0 if sinks is None else np.exp(sinks[hi] - top))
                out[bi, r, hi] = w @ v[bi, hi // group, seen] / den
    return out


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_attention_function_matches_reference(rng, window, with_sinks, dtype):
    b, h, hkv, s, n, d = 3, 4, 2, 5, 9, 16
    q, k, v = (torch.from_numpy(rng.standard_normal(shape)).to(dtype)
               for shape in ((b, h, s, d), (b, hkv, n, d), (b, hkv, n, d)))
    real = np.ones((b, n), dtype=bool)
    real[0, :3] = False  # left padding
    real[2, 4] = False  # a hole inside the sequence
    sinks = rng.standard_normal(h) if with_sinks else None
    module = torch.nn.Module()
    out, weights = numattn_attention(
        module, q, k, v, torch.from_numpy(real), scaling=0.3, sliding_window=window,
        s_aux=None if sinks is None else torch.from_numpy(sinks).to(dtype))
    assert weights is None and out.dtype == dtype and out.shape == (b, s, h, d)
    expected = reference_attention(q, k, v, real, 0.3, window, sinks)
    tol = 2e-5 if dtype == torch.float32 else 1e-10
    np.testing.assert_allclose(out.numpy(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("window", [None, 3])
def test_attention_function_soft_caps_the_scores(rng, window):
    """``softcap`` as numattn.softcap on the dense paths: padded and ragged rows (no window)
    and the additive mask of a hole inside a windowed sequence; one score modifier per cap."""
    b, h, hkv, s, n, d = 3, 4, 2, 5, 9, 16
    q, k, v = (torch.from_numpy(rng.standard_normal(shape, dtype=np.float32))
               for shape in ((b, h, s, d), (b, hkv, n, d), (b, hkv, n, d)))
    real = np.ones((b, n), dtype=bool)
    real[0, :3] = False
    real[2, 4] = False
    sinks = rng.standard_normal(h).astype(np.float32)
    for mask in (None, real):
        out, _ = numattn_attention(
            torch.nn.Module(), 3 * q, k, v, None if mask is None else torch.from_numpy(mask),
            scaling=0.3, sliding_window=window, softcap=SOFTCAP, s_aux=torch.from_numpy(sinks))
        expected = reference_attention(3 * q, k, v, np.ones_like(real) if mask is None else mask,
                                       0.3, window, sinks, SOFTCAP)
        np.testing.assert_allclose(out.numpy(), expected, rtol=2e-5, atol=2e-5)
    assert _softcap_mod(SOFTCAP) is _softcap_mod(SOFTCAP)
    with pytest.raises(ValueError, match="cap must be finite and > 0"):
        numattn_attention(torch.nn.Module(), q, k, v, None, softcap=0.0)


def test_gemma2_soft_capping_is_applied_with_one_score_modifier(rng):
    """The cap of the Gemma-2 tests changes the logits far beyond the tolerance (so the
    family's tests see it), and a model's calls reuse one score modifier."""
    eager, ours = pair("gemma2")
    x = ids(rng, 2, PROMPT)
    with torch.no_grad():
        capped = eager(x).logits
        for layer in eager.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        try:
            uncapped = eager(x).logits
        finally:
            for layer in eager.model.layers:
                layer.self_attn.attn_logit_softcapping = SOFTCAP
        assert (capped - uncapped).abs().max() > 100 * RTOL * capped.abs().max()
        ours(x)
        before = _softcap_mod.cache_info()
        ours(x)
        after = _softcap_mod.cache_info()
    assert after.misses == before.misses and after.hits > before.hits


def test_attention_function_reads_a_4d_mask_as_additive(rng):
    b, h, hkv, s, n, d = 2, 4, 2, 3, 6, 8
    q, k, v = (torch.from_numpy(rng.standard_normal(shape, dtype=np.float32))
               for shape in ((b, h, s, d), (b, hkv, n, d), (b, hkv, n, d)))
    allowed = rng.random((b, 1, s, n)) < 0.7
    allowed[..., 0] = True
    out, _ = numattn_attention(torch.nn.Module(), q, k, v, torch.from_numpy(allowed), scaling=0.5)
    group = h // hkv
    kk = k.numpy().astype(np.float64).repeat(group, axis=1)
    vv = v.numpy().astype(np.float64).repeat(group, axis=1)
    scores = 0.5 * np.einsum("bhsd,bhnd->bhsn", q.numpy().astype(np.float64), kk)
    scores = np.where(allowed, scores, -np.inf)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    expected = np.einsum("bhsn,bhnd->bshd", p / p.sum(axis=-1, keepdims=True), vv)
    np.testing.assert_allclose(out.numpy(), expected, rtol=2e-5, atol=2e-5)


# ---------------------------------------------------------------------------------------------
# what numattn refuses


@pytest.mark.parametrize("family, dtype", [("gpt_oss", "bfloat16"), ("gpt_oss", "float16"),
                                           ("gemma2", "bfloat16")])
def test_16_bit_models_run_with_16_bit_caches(family, dtype):
    """A 16-bit model: its K/V stay 16-bit in the cache (read as stored, computed in float32),
    logits as close to eager attention's as 16-bit rounding allows, and generation runs."""
    eager, ours = pair(family)
    eager, ours = eager.to(getattr(torch, dtype)), ours.to(getattr(torch, dtype))
    ids = torch.randint(0, 128, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = eager(ids).logits.float()
        got = ours(ids).logits.float()
        assert torch.allclose(got, want, atol=0.05 * float(want.abs().max()), rtol=0)
        cache = NumattnCache(ours.config)
        out = ours.generate(ids, max_new_tokens=4, do_sample=False, cache=cache)
    assert out.shape == (2, PROMPT + 4)
    assert cache.layers[0].k.blocks.dtype.name == dtype


def test_other_dtypes_are_refused():
    from numattn.integrations.transformers import numpy_dtype

    with pytest.raises(TypeError, match="float32, float64, float16 or bfloat16"):
        numpy_dtype("query", torch.ones(2, dtype=torch.int32))


def test_dropout_and_gradients_are_refused():
    config = transformers.LlamaConfig(**_small(attention_dropout=0.1))
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="numattn")
    with torch.no_grad(), pytest.raises(ValueError, match="dropout"):
        model.train()(torch.ones(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="no_grad"):
        model.eval()(torch.ones(1, 4, dtype=torch.long))


def test_static_cache_is_refused():
    _, ours = pair("llama")
    x = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="StaticCache"):
        ours.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=2, do_sample=False,
                      cache_implementation="static", pad_token_id=0)


def test_numattn_cache_refusals():
    eager, ours = pair("llama")
    with pytest.raises(ValueError, match="attn_implementation='numattn'"):
        NumattnCache(eager.config)
    with pytest.raises(ValueError, match="page_size"):
        NumattnCache(ours.config, page_size=0)
    x = torch.ones(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="beam search"):
        ours.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=3, num_beams=2,
                      do_sample=False, cache=NumattnCache(ours.config), pad_token_id=0)
    past = NumattnCache(ours.config)
    with torch.no_grad(), pytest.raises(ValueError, match="4-D mask"):
        ours(x, attention_mask=torch.ones(2, 1, 4, 4, dtype=torch.bool), cache=past)


def test_custom_mask_functions_are_refused():
    def no_first_key(batch_idx, head_idx, q_idx, kv_idx):
        return kv_idx > 0

    with pytest.raises(ValueError, match="or_mask_function"):
        numattn_mask(1, 4, 4, mask_function=no_first_key)
    with pytest.raises(ValueError, match="StaticCache"):
        numattn_mask(1, 1, 16, q_offset=3)


def test_bidirectional_attention_sees_every_key(rng):
    from transformers.masking_utils import bidirectional_mask_function

    b, h, hkv, s, n, d = 2, 4, 2, 3, 7, 8
    q, k, v = (torch.from_numpy(rng.standard_normal(shape, dtype=np.float32))
               for shape in ((b, h, s, d), (b, hkv, n, d), (b, hkv, n, d)))
    # an encoder's keys may outnumber its queries (cross attention): not a static cache
    assert numattn_mask(b, s, n, mask_function=bidirectional_mask_function) is None
    out, _ = numattn_attention(torch.nn.Module(), q, k, v, None, scaling=0.4, is_causal=False)
    group = h // hkv
    kk = k.numpy().astype(np.float64).repeat(group, axis=1)
    vv = v.numpy().astype(np.float64).repeat(group, axis=1)
    scores = 0.4 * np.einsum("bhsd,bhnd->bhsn", q.numpy().astype(np.float64), kk)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    expected = np.einsum("bhsn,bhnd->bshd", p / p.sum(axis=-1, keepdims=True), vv)
    np.testing.assert_allclose(out.numpy(), expected, rtol=2e-5, atol=2e-5)


def test_benchmark_script_runs_a_small_case(capsys):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_transformers.py"
    spec = importlib.util.spec_from_file_location("bench_transformers", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--contexts", "24", "--batches", "2", "--tokens", "2", "--repeats", "1",
                "--hidden", "64"])
    lines = capsys.readouterr().out.strip().splitlines()
    row = lines[-1].split()
    assert row[:2] == ["2", "24"] and len(row) == 2 + 4 + 2
    assert all(float(x) > 0 for x in row[2:])
    with pytest.raises(SystemExit):
        bench.main(["--tokens", "0"])


def test_mask_function_takes_the_cache_positions_of_transformers_4():
    padding = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    got = numattn_mask(2, kv_length=4, cache_position=torch.arange(3, 4), attention_mask=padding)
    assert got.tolist() == (padding == 1).tolist()
    with pytest.raises(ValueError, match="StaticCache"):
        numattn_mask(2, kv_length=9, cache_position=torch.arange(3, 4))
