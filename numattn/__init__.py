"""numattn: production attention kernels for NumPy.

Flash attention over KV caches (dense, continuous-batching or paged), decode attention
with split-K, and cross attention over ragged batches, with GQA, mask objects, additive
masks and attention sinks; plans (:class:`DecodePlan`, :class:`FlashPlan`) do the work of
a step once for all its layers.  CPU-first (Numba ``parallel=True``) with optional CUDA
through ``numba.cuda``; each operation's math is written once and shared by both backends.

Importing numattn compiles nothing and does not import ``numba.cuda``.
"""

from . import reference
from .core.config import MHAConfig
from .core.device import CudaUnavailableError
from .core.functions import ScoreMod, alibi, softcap
from .cross import cross_attention
from .decode import DecodePlan, decode_attention
from .flash import FlashPlan, flash_attention_kv_cache
from .kv_cache import ContinuousBatchingKVCache, PagedKVCache, store_kv
from .masks import (
    AndMask,
    CausalMask,
    ChunkedCausalMask,
    ChunkedMask,
    FunctionMask,
    Mask,
    MaterializedMask,
    NullMask,
    OrMask,
    SlidingWindowCausalMask,
)
from .merge import merge_states

__version__ = "0.1.0"

__all__ = [
    "AndMask",
    "CausalMask",
    "ChunkedCausalMask",
    "ChunkedMask",
    "ContinuousBatchingKVCache",
    "CudaUnavailableError",
    "DecodePlan",
    "FlashPlan",
    "FunctionMask",
    "MHAConfig",
    "Mask",
    "MaterializedMask",
    "NullMask",
    "OrMask",
    "PagedKVCache",
    "ScoreMod",
    "SlidingWindowCausalMask",
    "alibi",
    "cross_attention",
    "decode_attention",
    "flash_attention_kv_cache",
    "merge_states",
    "reference",
    "softcap",
    "store_kv",
]
