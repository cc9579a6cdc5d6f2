"""numattn as an attention backend of Hugging Face transformers (``attn_implementation="numattn"``).

:func:`register` adds the name ``"numattn"`` to transformers' ``AttentionInterface``; a model
built with ``attn_implementation="numattn"`` then runs its attention through
:func:`numattn_attention`, which maps what the model asks for onto numattn's operations:
causal attention to :class:`~numattn.CausalMask`, a sliding window to
:class:`~numattn.SlidingWindowCausalMask` (transformers' ``kv_idx > q_idx - window`` is numattn's
``q_idx - k_idx < window``), attention sinks (``s_aux``) to ``sink_weights``, ``scaling`` to
``scale``, logit soft-capping (``softcap``, Gemma-2's ``attn_logit_softcapping``) to
``score_mod=numattn.softcap(cap)``; grouped-query heads are read as they are (no
``repeat_kv``).

The name also goes into transformers' ``AttentionMaskInterface`` with :func:`numattn_mask`,
which hands the attention the 2-D padding mask (or none) instead of a dense ``[B, 1, S, N]``
tensor: numattn builds its masks from positions.  Padding (zeros in the
2-D ``attention_mask``) becomes a ragged batch: padded rows are left out, the real ones are
attended as sequences of their own lengths.

:class:`NumattnCache` is a transformers ``Cache`` that keeps every layer's keys and values in
:class:`~numattn.PagedKVCache` pages (token-major, as numattn reads them) and writes each
step's new rows with :func:`~numattn.store_kv`, so that generation reads the cache in place.
With transformers' own ``DynamicCache`` (head-major ``[B, Hkv, N, D]``) numattn reads a
transposed view in place, through its strides.

Refused with an error naming the option (never computed differently): dropout, gradients
(numattn has no backward pass), tensors that are not CPU tensors of float32, float64,
float16 or bfloat16 (16-bit models keep 16-bit caches, read as stored, and compute in
float32), position biases, packed sequences without an attention mask, caches whose keys
outnumber the positions (static caches), 4-D masks with a :class:`NumattnCache`, and
bidirectional sliding windows.
"""

from __future__ import annotations

import functools
import math
import threading
import weakref

import ml_dtypes
import numpy as np

try:
    import torch
    from transformers import AttentionInterface
    from transformers.cache_utils import Cache, CacheLayerMixin
    from transformers.masking_utils import (
        AttentionMaskInterface,
        bidirectional_mask_function,
        causal_mask_function,
    )
except ImportError as exc:  # pragma: no cover - exercised where transformers is absent
    raise ImportError(
        "numattn.integrations.transformers needs PyTorch and Hugging Face transformers: "
        "the transformers extra, pip install .[transformers] in numattn's checkout"
    ) from exc

from numattn import (
    CausalMask,
    MaterializedMask,
    NullMask,
    PagedKVCache,
    SlidingWindowCausalMask,
    decode_attention,
    flash_attention_kv_cache,
    store_kv,
)
from numattn import softcap as softcap_score_mod

__all__ = ["NAME", "NumattnCache", "numattn_attention", "numattn_mask", "register"]

#: The ``attn_implementation`` name :func:`register` adds.
NAME = "numattn"

#: Torch dtypes numattn reads in place, and the NumPy dtype each is read as (bfloat16 as
#: ``ml_dtypes.bfloat16``, through a view of its bits).
NUMPY_DTYPES = {torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64),
                torch.float16: np.dtype(np.float16), torch.bfloat16: np.dtype(ml_dtypes.bfloat16)}

#: Tokens per page of a :class:`NumattnCache` (the pages of all sequences of a layer share one
#: pool; a sequence takes a new page every ``page_size`` tokens).
DEFAULT_PAGE_SIZE = 128

#: The :class:`NumattnCache` whose ``update`` ran last on this thread: the attention function
#: finds the layer's pending rows there (transformers does not pass the cache to it).
_ACTIVE = threading.local()


def register():
    """Register ``"numattn"`` as an attention implementation of transformers.

    It goes into transformers' ``AttentionInterface`` (:func:`numattn_attention`) and its
    ``AttentionMaskInterface`` (:func:`numattn_mask`, which hands the attention the 2-D
    padding mask instead of a dense 4-D one).  Idempotent: calling it again changes
    nothing.  Afterwards
    ``AutoModelForCausalLM.from_config(config, attn_implementation="numattn")`` (or
    ``from_pretrained``) runs the model's attention through :func:`numattn_attention`.

    Returns
    -------
    str
        The registered name, ``"numattn"``.

    Examples
    --------
    >>> from numattn.integrations.transformers import register
    >>> register()
    'numattn'
    >>> from transformers import AttentionInterface
    >>> "numattn" in AttentionInterface()
    True
    """
    AttentionInterface.register(NAME, numattn_attention)
    AttentionMaskInterface.register(NAME, numattn_mask)
    return NAME


# ---------------------------------------------------------------------------------------------
# torch tensors <-> NumPy arrays


def numpy_dtype(name, tensor):
    """The NumPy dtype numattn reads ``tensor`` as; a clear ``TypeError`` for the others."""
    dtype = NUMPY_DTYPES.get(tensor.dtype)
    if dtype is None:
        raise TypeError(f"the numattn attention takes float32, float64, float16 or bfloat16 "
                        f"tensors; {name} has dtype {tensor.dtype}")
    return dtype


def _host(name, tensor):
    """A CPU tensor as a NumPy array, without a copy."""
    if tensor.device.type != "cpu":
        raise ValueError(f"the numattn attention runs on the CPU here; {name} is on "
                         f"{tensor.device}")
    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:  # NumPy has no bfloat16 of its own: through its bits
        return tensor.view(torch.int16).numpy().view(NUMPY_DTYPES[torch.bfloat16])
    return tensor.numpy()


def _to_torch(array):
    """A NumPy result as a torch tensor over the same memory (bfloat16 through its bits)."""
    if array.dtype == NUMPY_DTYPES[torch.bfloat16]:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _check_tensors(query, key, value, dropout, kwargs):
    """Everything the attention cannot compute is refused here, before any work."""
    if dropout:
        raise ValueError(f"the numattn attention has no dropout (dropout={dropout}); "
                         f"call model.eval() or use attn_implementation='eager' to train")
    if kwargs.get("position_bias") is not None:
        raise ValueError("the numattn attention cannot add a position_bias tensor")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        raise ValueError("the numattn attention has no backward pass: run the model under "
                         "torch.no_grad() or torch.inference_mode() (generate() does)")
    dtype = numpy_dtype("query", query)
    for name, t in (("key", key), ("value", value)):
        if numpy_dtype(name, t) != dtype:
            raise TypeError(f"{name} must have query's dtype {query.dtype}, got {t.dtype}")
    if query.ndim != 4 or key.ndim != 4 or value.shape != key.shape:
        raise ValueError(f"query, key and value must be [B, H, S, D] and [B, Hkv, N, D], got "
                         f"{list(query.shape)}, {list(key.shape)} and {list(value.shape)}")
    return dtype


def layer_mask(module, sliding_window, kwargs):
    """The numattn mask of a layer: causal, sliding-window causal, or none (bidirectional).

    Parameters
    ----------
    module : torch.nn.Module
        The attention module (its ``is_causal`` attribute, ``True`` when absent).
    sliding_window : int or None
        The layer's window, as transformers passes it (``kv_idx > q_idx - window``).
    kwargs : dict
        The other keyword arguments of the call (an ``is_causal`` there wins).

    Returns
    -------
    Mask

    Examples
    --------
    >>> import torch
    >>> from numattn.integrations.transformers import layer_mask
    >>> layer_mask(torch.nn.Module(), 4, {})
    SlidingWindowCausalMask(window=4)
    """
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    if sliding_window is not None:
        if not is_causal:
            raise ValueError(f"the numattn attention has no bidirectional sliding window "
                             f"(sliding_window={sliding_window} with is_causal=False)")
        return SlidingWindowCausalMask(int(sliding_window))
    return CausalMask() if is_causal else NullMask()


@functools.lru_cache(maxsize=32)
def _softcap_mod(cap):
    """:func:`numattn.softcap` of ``cap``, one object per cap value, which every layer and
    call of a model then reuses."""
    return softcap_score_mod(cap)


def _score_mod(cap):
    """The score modifier of transformers' ``softcap`` argument (``None``: none); a cap that
    is not a number > 0 is refused by :func:`numattn.softcap`."""
    return None if cap is None else _softcap_mod(cap)


def _sinks(s_aux, heads, dtype):
    sinks = np.asarray(_host("s_aux", s_aux), dtype=dtype).reshape(-1)
    if sinks.shape[0] != heads:
        raise ValueError(f"s_aux must hold one sink logit per query head ({heads}), got shape "
                         f"{list(s_aux.shape)}")
    return sinks


def _offsets(counts):
    out = np.zeros(counts.shape[0] + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def _has_holes(real):
    """Rows whose real (unpadded) positions are not one contiguous run."""
    n = real.shape[1]
    count = real.sum(axis=1)
    first = np.argmax(real, axis=1)
    last = n - 1 - np.argmax(real[:, ::-1], axis=1)
    return (count > 0) & (last - first + 1 != count)


def _padding(attention_mask, num_positions, what):
    """The real positions ``[B, num_positions]`` of a 2-D mask's last columns, or ``None``
    when nothing is padded."""
    if attention_mask.ndim != 2:
        raise ValueError(f"attention_mask must be 2-D [B, positions] here, got shape "
                         f"{list(attention_mask.shape)}")
    if attention_mask.shape[1] < num_positions:
        raise ValueError(
            f"attention_mask covers {attention_mask.shape[1]} positions but {what} "
            f"{num_positions}: the mask must cover every key position (a mask of the new "
            f"tokens only, or a StaticCache whose key positions are unknown; use DynamicCache "
            f"or NumattnCache with numattn)"
        )
    real = _host("attention_mask", attention_mask[:, attention_mask.shape[1] - num_positions:])
    real = real != 0
    return None if real.all() else real


def _check_positions(position_ids, num_keys):
    """Without an attention mask, the position ids tell the keys' positions: refuse caches
    holding more keys than positions."""
    if position_ids is None or position_ids.ndim != 2 or position_ids.shape[1] == 0:
        return
    pos = _host("position_ids", position_ids)
    if num_keys > int(pos[:, -1].max()) + 1:
        raise ValueError(
            f"{num_keys} keys for queries up to position {int(pos[:, -1].max())}: the keys' "
            f"positions are unknown (a StaticCache or another fixed-size cache); use "
            f"DynamicCache or NumattnCache with numattn"
        )


def _additive_4d(attention_mask, shape, dtype):
    """A 4-D boolean or additive mask ``[B, 1 or H, S, N]`` as numattn's additive tensor."""
    b, h, s, n = shape
    m = attention_mask
    if (m.ndim != 4 or m.shape[0] not in (1, b) or m.shape[1] not in (1, h)
            or m.shape[2] != s or m.shape[3] != n):
        raise ValueError(f"a 4-D attention_mask must be [B, 1 or H, S, N] = [{b}, 1 or {h}, "
                         f"{s}, {n}], got {list(m.shape)}")
    a = _host("attention_mask", m)
    if a.dtype == np.bool_:
        a = np.where(a, dtype.type(0), dtype.type(-np.inf))
    elif a.dtype.kind != "f":
        raise TypeError(f"a 4-D attention_mask must be boolean or floating, got {m.dtype}")
    a = np.ascontiguousarray(np.broadcast_to(a.astype(dtype, copy=False),
                                             (b, m.shape[1], s, n)))
    return a[:, 0] if m.shape[1] == 1 else a


# ---------------------------------------------------------------------------------------------
# the mask function


def _closure(fn):
    cells = fn.__closure__ or ()
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in cells)))


def _is_sliding_causal(fn):
    """Whether ``fn`` is transformers' ``sliding_window_causal_mask_function(window)``."""
    if getattr(fn, "__qualname__", "") != "and_masks.<locals>.and_mask":
        return False
    parts = _closure(fn).get("mask_functions", ())
    overlay = "sliding_window_overlay.<locals>.inner_mask"
    return (len(parts) == 2 and parts[1] is causal_mask_function
            and getattr(parts[0], "__qualname__", "") == overlay)


def numattn_mask(batch_size, q_length=None, kv_length=None, q_offset=0, kv_offset=0,
                 mask_function=causal_mask_function, attention_mask=None, use_vmap=False,
                 cache_position=None, **kwargs):
    """transformers' mask interface for numattn: the 2-D padding mask, not a 4-D tensor.

    numattn builds causal and sliding-window masks from positions, so the attention only
    needs to know which key positions are padding.  Patterns it cannot build (custom
    ``or``/``and`` mask functions, packed sequences, chunked or bidirectional windows) are
    refused here, before the model runs.

    Parameters
    ----------
    batch_size, q_length, kv_length : int
        Sequences, query positions and key positions of the call.
    q_offset, kv_offset : int
        Position of the first query and of the first key (a tensor ``q_offset`` comes from
        a static cache, whose key positions are unknown to numattn: refused).
    cache_position : torch.Tensor, optional
        The query positions, which transformers 4.x passes instead of ``q_length`` and
        ``q_offset``.
    mask_function : callable
        transformers' description of the pattern: causal, sliding-window causal or
        bidirectional.
    attention_mask : torch.Tensor, optional
        The 2-D mask ``[B, positions]``, zeros marking padding.
    use_vmap : bool
        ``True`` when transformers was given custom mask functions: refused.
    **kwargs
        The other arguments transformers passes (ignored).

    Returns
    -------
    torch.Tensor or None
        The boolean mask of the ``kv_length`` key positions ``[B, kv_length]``, or ``None``
        when none is padding.

    Raises
    ------
    ValueError
        For a pattern or a cache numattn cannot map.

    Examples
    --------
    >>> import torch
    >>> from numattn.integrations.transformers import numattn_mask
    >>> numattn_mask(2, 1, 4, q_offset=3, attention_mask=torch.tensor([[0, 1, 1, 1], [1] * 4]))
    tensor([[False,  True,  True,  True],
            [ True,  True,  True,  True]])
    """
    known = (mask_function is causal_mask_function or mask_function is bidirectional_mask_function
             or _is_sliding_causal(mask_function))
    if use_vmap or not known:
        name = getattr(mask_function, "__qualname__", type(mask_function).__name__)
        raise ValueError(
            f"the numattn attention builds causal, sliding-window causal and bidirectional "
            f"masks only; this model asks for another pattern ({name}: custom or_mask_function/"
            f"and_mask_function, packed sequences or chunked attention): use another "
            f"attn_implementation"
        )
    if q_length is None:  # transformers 4.x
        q_length = 0 if cache_position is None else int(cache_position.shape[0])
        q_offset = int(cache_position[0]) if q_length else 0
    causal = mask_function is not bidirectional_mask_function  # (encoders may attend to more)
    if isinstance(q_offset, torch.Tensor) or (causal and kv_length > q_offset + q_length):
        raise ValueError(
            f"the cache holds {kv_length} key slots for positions up to "
            f"{q_offset} + {q_length}: the positions of its keys are unknown to numattn (a "
            f"StaticCache or another fixed-size cache); use DynamicCache or NumattnCache"
        )
    if attention_mask is None:
        return None
    if attention_mask.ndim != 2:
        raise ValueError(f"attention_mask must be 2-D [B, positions], got shape "
                         f"{list(attention_mask.shape)}")
    mask = attention_mask[:, -kv_length:].to(torch.bool)
    return None if bool(mask.all()) else mask


# ---------------------------------------------------------------------------------------------
# the attention function


def numattn_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      sliding_window=None, softcap=None, s_aux=None, **kwargs):
    """transformers' attention interface, computed by numattn.

    Parameters
    ----------
    module : torch.nn.Module
        The attention module (``layer_idx`` finds the layer of a :class:`NumattnCache`,
        ``is_causal`` says whether the layer is causal).
    query : torch.Tensor, shape [B, H, S, D]
    key, value : torch.Tensor, shape [B, Hkv, N, D]
        What the cache's ``update`` returned: all the keys of a ``DynamicCache`` layer
        (head-major, read through a transposed view), or the new rows a
        :class:`NumattnCache` keeps in its pages.  ``H % Hkv == 0``.
    attention_mask : torch.Tensor or None
        The 2-D padding mask ``[B, positions]`` (zeros mark padding) that transformers passes
        to an implementation without a mask function, or a 4-D boolean or additive mask
        ``[B, 1 or H, S, N]`` (read as numattn's additive mask, without any other mask).
    dropout : float, default 0.0
        Must be 0.
    scaling : float, optional
        The score scale (``None``: ``1 / sqrt(D)``).
    sliding_window : int, optional
        Keys with ``q_idx - k_idx >= sliding_window`` are hidden.
    softcap : float, optional
        Logit soft-capping (Gemma-2's ``attn_logit_softcapping``): each scaled score ``x``
        becomes ``softcap * tanh(x / softcap)`` before the mask and the softmax
        (``score_mod=numattn.softcap(softcap)``); ``None``: none.
    s_aux : torch.Tensor, shape [H], optional
        One sink logit per query head (gpt-oss).
    **kwargs
        ``is_causal`` and ``position_ids`` are read; the others are ignored.

    Returns
    -------
    out : torch.Tensor, shape [B, S, H, D]
        Rows of padded query positions are 0.
    weights : None

    Raises
    ------
    TypeError, ValueError
        For what numattn cannot compute (see the module's description).
    """
    dtype = _check_tensors(query, key, value, dropout, kwargs)
    mask = layer_mask(module, sliding_window, kwargs)
    sinks = None if s_aux is None else _sinks(s_aux, query.shape[1], dtype)
    score_mod = _score_mod(softcap)
    scale = None if scaling is None else float(scaling)
    layer = _pending_layer(module, key)
    if layer is not None:
        out = layer.attend(query, attention_mask, mask, scale, sinks, score_mod, sliding_window)
    else:
        out = _attend_dense(query, key, value, attention_mask, mask, scale, sinks, score_mod,
                            sliding_window, kwargs.get("position_ids"), dtype)
    return _to_torch(out), None


def _attend_dense(query, key, value, attention_mask, mask, scale, sinks, score_mod, window,
                  position_ids, dtype):
    """Attention over head-major ``[B, Hkv, N, D]`` keys and values (a ``DynamicCache`` layer
    or no cache), bottom-right aligned: query row ``r`` sits at position ``N - S + r``.
    ``sinks`` and ``score_mod`` go to every operation as ``sink_weights`` and
    ``score_mod``."""
    b, h, s, d = query.shape
    n = key.shape[2]
    q = _host("query", query).transpose(0, 2, 1, 3)  # [B, S, H, D]
    k = _host("key", key).transpose(0, 2, 1, 3)  # [B, N, Hkv, D], read through its strides
    v = _host("value", value).transpose(0, 2, 1, 3)
    if attention_mask is not None and attention_mask.ndim == 4:
        additive = _additive_4d(attention_mask, (b, h, s, n), dtype)
        return flash_attention_kv_cache(np.ascontiguousarray(q), k, v,
                                        MaterializedMask(additive), scale, sink_weights=sinks,
                                        score_mod=score_mod)
    if n < s:
        raise ValueError(f"key holds {n} positions for {s} queries: the queries must be the "
                         f"last positions of the keys")
    if attention_mask is None:
        _check_positions(position_ids, n)
        real = None
    else:
        real = _padding(attention_mask, n, "key holds")
    if real is None:
        if s == 1:
            out = decode_attention(np.ascontiguousarray(q[:, 0]), k, v, mask, scale,
                                   sink_weights=sinks, score_mod=score_mod)
            return out.reshape(b, 1, h, d)
        return flash_attention_kv_cache(np.ascontiguousarray(q), k, v, mask, scale,
                                        sink_weights=sinks, score_mod=score_mod)
    if window is not None and _has_holes(real).any():
        # padding inside a sequence changes distances: hide it with an additive mask instead
        additive = np.where(real, dtype.type(0), dtype.type(-np.inf))
        additive = np.ascontiguousarray(np.broadcast_to(additive[:, None, :], (b, s, n)))
        out = flash_attention_kv_cache(np.ascontiguousarray(q), k, v,
                                       mask & MaterializedMask(additive), scale,
                                       sink_weights=sinks, score_mod=score_mod)
        out[~real[:, n - s:]] = 0  # padded query rows, as on the ragged path
        return out
    # padding only outside each sequence's run of real positions (or a causal mask, which
    # depends on order only): a ragged batch of the real rows
    q_real = real[:, n - s:]
    rows = flash_attention_kv_cache(
        q[q_real], k[real], v[real], mask, scale,
        q_input_row_offsets=_offsets(q_real.sum(axis=1)),
        kv_input_row_offsets=_offsets(real.sum(axis=1)), sink_weights=sinks,
        score_mod=score_mod,
    )
    out = np.zeros((b, s, h, d), dtype=dtype)
    out[q_real] = rows
    return out


def _pending_layer(module, key):
    """The :class:`NumattnCache` layer whose new rows ``key`` is, or ``None``."""
    ref = getattr(_ACTIVE, "cache", None)
    cache = None if ref is None else ref()
    idx = getattr(module, "layer_idx", None)
    if cache is None or idx is None or idx >= len(cache.layers):
        return None
    layer = cache.layers[idx]
    if layer.pending is None:
        return None
    if layer.pending[0] is not key:
        raise ValueError(
            f"layer {idx}: the keys given to the attention are not the rows NumattnCache.update "
            f"returned (the model changed them in between); use DynamicCache with this model"
        )
    return layer


# ---------------------------------------------------------------------------------------------
# the cache


class NumattnLayer(CacheLayerMixin):
    """One layer of a :class:`NumattnCache`: K and V in :class:`~numattn.PagedKVCache` pages.

    ``update`` keeps the step's new rows aside and returns them; the attention
    (:func:`numattn_attention`) then stores the unpadded ones with :func:`~numattn.store_kv`
    and attends over the pages.  Sequence ``b``'s page ``j`` is page ``j * B + b`` of the
    pool, so the pool grows by ``B`` pages at a time, the old pages keeping their place.

    Parameters
    ----------
    page_size : int
        Tokens per page.
    max_cache_len : int, optional
        Tokens per sequence to reserve at the first update (the memory is only touched
        page by page as tokens arrive); without it the pool doubles when full (a copy of
        the layer's pages each time).
    """

    is_sliding = False
    is_croppable = False

    def __init__(self, page_size=DEFAULT_PAGE_SIZE, max_cache_len=None):
        super().__init__()
        self.page_size = int(page_size)
        self.max_cache_len = max_cache_len
        self.positions = 0  # positions seen, padding included (what transformers counts)
        self.pending = None
        self.k = self.v = None

    def lazy_initialization(self, key_states, value_states):
        b, hkv, _, d = key_states.shape
        self.dtype = numpy_dtype("key_states", key_states)
        self.batch_size, self.num_kv_heads, self.head_dim = int(b), int(hkv), int(d)
        self.device = key_states.device
        self.lengths = np.zeros(b, dtype=np.int64)  # stored (unpadded) tokens per sequence
        self._pool = None
        pages = math.ceil(self.max_cache_len / self.page_size) if self.max_cache_len else 1
        self._allocate(max(pages, 1))
        self.is_initialized = True

    def _allocate(self, pages_per_seq):
        """A pool for ``pages_per_seq`` pages per sequence, holding the old pages."""
        b = self.batch_size
        pool = np.empty((2, pages_per_seq * b, self.page_size, self.num_kv_heads, self.head_dim),
                        dtype=self.dtype)
        if self._pool is not None:
            pool[:, :self._pool.shape[1]] = self._pool
        self._pool = pool
        table = np.arange(pages_per_seq)[None, :] * b + np.arange(b)[:, None]
        self.k = PagedKVCache(pool[0], self.lengths, table)
        self.v = PagedKVCache(pool[1], self.lengths, table)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.pending is not None:
            raise ValueError("NumattnCache: the previous rows of this layer were never read "
                             "by the numattn attention; build the model with "
                             "attn_implementation='numattn' to use NumattnCache")
        b, hkv, _, d = key_states.shape
        if (b, hkv, d) != (self.batch_size, self.num_kv_heads, self.head_dim):
            raise ValueError(f"key_states must be [B={self.batch_size}, Hkv={self.num_kv_heads}, "
                             f"S, D={self.head_dim}] like the cache's, got "
                             f"{list(key_states.shape)}")
        if value_states.shape != key_states.shape:
            raise ValueError(f"value_states must have key_states' shape "
                             f"{list(key_states.shape)}, got {list(value_states.shape)}")
        self.pending = (key_states, value_states)
        self.positions += int(key_states.shape[2])
        return key_states, value_states

    def attend(self, query, attention_mask, mask, scale, sinks, score_mod, window):
        """Store the pending rows (those not padded) and attend ``query`` over the pages
        (``sinks`` and ``score_mod`` as every operation's ``sink_weights`` and
        ``score_mod``)."""
        key_states, value_states = self.pending
        self.pending = None
        b, h, s, d = query.shape
        new = None
        if attention_mask is not None:
            if attention_mask.ndim != 2:
                raise ValueError(f"NumattnCache takes a 2-D attention_mask [B, positions]; a "
                                 f"{attention_mask.ndim}-D mask cannot be mapped onto its pages")
            if attention_mask.shape[1] != self.positions:
                raise ValueError(f"attention_mask covers {attention_mask.shape[1]} positions, "
                                 f"the cache {self.positions}")
            full = _padding(attention_mask, self.positions, "the cache holds")
            if full is not None:
                if window is not None and _has_holes(full).any():
                    raise ValueError(
                        "NumattnCache stores only the real (unpadded) tokens, so padding "
                        "between real tokens of a sequence would shorten its sliding window "
                        f"(sliding_window={window}); pad on one side only, or use DynamicCache"
                    )
                new = full[:, self.positions - s:]
                if new.all():
                    new = None
        offsets = self._store(key_states, value_states, new)
        q = _host("query", query).transpose(0, 2, 1, 3)  # [B, S, H, D]
        if new is None:
            if s == 1:
                out = decode_attention(np.ascontiguousarray(q[:, 0]), self.k, self.v, mask, scale,
                                       sink_weights=sinks, score_mod=score_mod
                                       ).reshape(b, 1, h, d)
            else:
                out = flash_attention_kv_cache(
                    np.ascontiguousarray(q).reshape(b * s, h, d), self.k, self.v, mask, scale,
                    q_input_row_offsets=offsets, sink_weights=sinks, score_mod=score_mod,
                ).reshape(b, s, h, d)
        else:
            rows = flash_attention_kv_cache(q[new], self.k, self.v, mask, scale,
                                            q_input_row_offsets=offsets, sink_weights=sinks,
                                            score_mod=score_mod)
            out = np.zeros((b, s, h, d), dtype=self.dtype)
            out[new] = rows
        self.lengths += np.diff(offsets)  # in place: the PagedKVCache objects share the array
        return out

    def _store(self, key_states, value_states, new):
        """Write the rows ``new`` marks (all when ``None``) after each sequence's tokens;
        returns their row offsets.  ``lengths`` still counts the tokens before them."""
        b, _, s, _ = key_states.shape
        counts = np.full(b, s, dtype=np.int64) if new is None else new.sum(axis=1)
        offsets = _offsets(counts)
        self._reserve(int((self.lengths + counts).max(initial=0)))
        k_new = _host("key", key_states).transpose(0, 2, 1, 3)  # [B, S, Hkv, D]
        v_new = _host("value", value_states).transpose(0, 2, 1, 3)
        if new is None:
            shape = (b * s, *k_new.shape[2:])
            store_kv(self.k, np.ascontiguousarray(k_new).reshape(shape), offsets)
            store_kv(self.v, np.ascontiguousarray(v_new).reshape(shape), offsets)
        else:
            store_kv(self.k, k_new[new], offsets)
            store_kv(self.v, v_new[new], offsets)
        return offsets

    def _reserve(self, tokens):
        """Enough pages for ``tokens`` tokens per sequence."""
        pages = self.k.lookup_table.shape[1]
        if tokens > pages * self.page_size:
            self._allocate(max(math.ceil(tokens / self.page_size), 2 * pages))

    def get_mask_sizes(self, query_length):
        if isinstance(query_length, torch.Tensor):  # transformers 4.x passes cache_position
            query_length = int(query_length.shape[0])
        return self.positions + query_length, 0

    def get_seq_length(self):
        return self.positions

    def get_max_length(self):
        return -1

    def get_max_cache_shape(self):  # transformers 4.x's name
        return -1

    def reset(self):
        self.positions = 0
        self.pending = None
        if self.is_initialized:
            self.lengths[:] = 0

    def offload(self):
        """The pages stay on the CPU."""

    def prefetch(self):
        """The pages stay on the CPU."""

    def crop(self, tokens_to_remove):
        raise ValueError("NumattnCache cannot be cropped (assisted or speculative decoding); "
                         "use DynamicCache for those")

    def reorder_cache(self, beam_idx):
        raise ValueError("NumattnCache does not reorder sequences (beam search, num_beams > 1); "
                         "use DynamicCache for beam search")

    def batch_repeat_interleave(self, repeats):
        raise ValueError("NumattnCache does not repeat sequences (num_return_sequences > 1 "
                         "after the prompt); use DynamicCache for that")

    def batch_select_indices(self, indices):
        raise ValueError("NumattnCache does not select sequences; use DynamicCache for that")


class NumattnCache(Cache):
    """A transformers ``Cache`` whose layers keep K and V in numattn's paged layout.

    Each layer's keys and values live in a :class:`~numattn.PagedKVCache` pair
    (token-major pages ``[num_pages, page_size, Hkv, D]``, grown a page per sequence at a
    time) that numattn's kernels read in place; the new rows of a step are written with
    :func:`~numattn.store_kv`, padding left out, so generation never copies the cache.  It
    works with models built with ``attn_implementation="numattn"`` (see :func:`register`).

    Parameters
    ----------
    config : transformers.PretrainedConfig
        The model's configuration (``model.config``), built with
        ``attn_implementation="numattn"``.
    page_size : int, default DEFAULT_PAGE_SIZE
        Tokens per page.
    max_cache_len : int, optional
        Tokens per sequence to reserve at the first step (memory the operating system maps
        page by page as it is written).  Without it a layer's pool doubles when full.

    Raises
    ------
    ValueError
        If the model does not use the numattn attention, has layers that are not attention
        layers, or ``page_size`` or ``max_cache_len`` is not positive.

    Notes
    -----
    ``get_seq_length`` counts positions as transformers does (padding included); the pages
    hold only the real tokens.  Beam search, cropping (assisted decoding) and selecting or
    repeating sequences are refused: use ``DynamicCache`` for those.

    Examples
    --------
    >>> import torch
    >>> from transformers import AutoModelForCausalLM, LlamaConfig
    >>> from numattn.integrations.transformers import NumattnCache, register
    >>> _ = register()
    >>> config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    ...                      num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    >>> model = AutoModelForCausalLM.from_config(config, attn_implementation="numattn")
    >>> ids = torch.tensor([[1, 5, 7, 9]])
    >>> out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3,
    ...                      do_sample=False, cache=NumattnCache(model.config),
    ...                      pad_token_id=0)
    >>> out.shape
    torch.Size([1, 7])
    """

    def __init__(self, config, *, page_size=DEFAULT_PAGE_SIZE, max_cache_len=None):
        impl = getattr(config, "_attn_implementation", None)
        if impl != NAME:
            raise ValueError(f"NumattnCache needs a model built with attn_implementation="
                             f"'{NAME}' (call numattn.integrations.transformers.register() "
                             f"first); this config has {impl!r}")
        if int(page_size) < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if max_cache_len is not None and int(max_cache_len) < 1:
            raise ValueError(f"max_cache_len must be >= 1 or None, got {max_cache_len}")
        text = config.get_text_config(decoder=True)
        kinds = getattr(text, "layer_types", None) or ["full_attention"]
        other = sorted(set(kinds) - {"full_attention", "sliding_attention"})
        if other:
            raise ValueError(f"NumattnCache holds attention layers only; this model also has "
                             f"{other} layers")
        layers = [NumattnLayer(page_size, max_cache_len) for _ in range(text.num_hidden_layers)]
        super().__init__(layers=layers)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        _ACTIVE.cache = weakref.ref(self)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def append(self, key_states, value_states, layer_idx):
        """Store a layer's K/V rows without attending (to load keys computed elsewhere).

        Parameters
        ----------
        key_states, value_states : torch.Tensor, shape [B, Hkv, S, D]
            New rows of every sequence (none padded), in transformers' head-major layout.
        layer_idx : int
            The layer.

        Raises
        ------
        TypeError, ValueError
            If the rows do not fit the layer (dtype, shape) or the layer has rows pending.
        """
        layer = self.layers[layer_idx]
        layer.update(key_states, value_states)
        layer.pending = None
        layer.lengths += np.diff(layer._store(key_states, value_states, None))

    def kv_caches(self, layer_idx):
        """The :class:`~numattn.PagedKVCache` pair of a layer (``None`` before its first step).

        Their ``cache_lengths`` count each sequence's stored (unpadded) tokens.
        """
        layer = self.layers[layer_idx]
        return (layer.k, layer.v) if layer.is_initialized else None
