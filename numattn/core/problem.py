"""The normalised description of an attention call that the backends' drivers consume."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .config import MHAConfig
from .kv_cache import KVLayout


class DecodeArgs(NamedTuple):
    """The normalised inputs every driver passes on (host or device arrays)."""

    layout: KVLayout
    program: np.ndarray  # int64 [n_ops, 2] mask program
    has_additive: bool
    additive: object  # [Bm, Hm, 1, N] additive tensor, or a [1, 1, 1, 1] placeholder
    sinks: np.ndarray  # [H] sink logits (zeros without sinks)
    has_sink: bool
    scale: np.floating  # in the queries' dtype
    config: MHAConfig
    max_keys: int  # keys of the longest sequence
