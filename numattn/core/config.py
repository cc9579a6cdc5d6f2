"""Kernel configuration: tile sizes, key partitions and CUDA block size."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MHAConfig:
    """Tile and launch parameters shared by every attention kernel.

    Results never depend on a configuration beyond floating-point rounding; a fixed
    configuration (and thread count) gives bitwise-repeatable results.

    Parameters
    ----------
    block_q : int, default 256
        Query rows per CPU tile (flash and cross).  Rows of the ``group`` query heads that
        share a KV head are stacked, so a tile holds ``block_q`` positions x ``group`` heads.
    block_k : int, default 128
        Keys per tile: the unit of mask tile status, online-softmax rescaling and split-K
        partition alignment.
    num_partitions : int or None, default None
        Key partitions (split-K) for decode; ``None`` picks a count from the work size and
        the number of cores or streaming multiprocessors.
    threads_per_block : int, default 128
        CUDA threads per block; a power of two from 32 to 1024.

    Raises
    ------
    ValueError
        If a field is out of range.
    TypeError
        If a field is not an integer.

    Examples
    --------
    >>> from numattn import MHAConfig
    >>> MHAConfig(block_q=64, block_k=32)
    MHAConfig(block_q=64, block_k=32, num_partitions=None, threads_per_block=128)
    >>> MHAConfig(block_k=0)
    Traceback (most recent call last):
        ...
    ValueError: MHAConfig.block_k must be an integer in [1, 65536], got 0
    """

    block_q: int = 256
    block_k: int = 128
    num_partitions: int | None = None
    threads_per_block: int = 128

    def __post_init__(self):
        _check_int("block_q", self.block_q, 1, 65536)
        _check_int("block_k", self.block_k, 1, 65536)
        if self.num_partitions is not None:
            _check_int("num_partitions", self.num_partitions, 1, 4096)
        _check_int("threads_per_block", self.threads_per_block, 32, 1024)
        tpb = self.threads_per_block
        if tpb & (tpb - 1):
            raise ValueError(
                f"MHAConfig.threads_per_block must be a power of two in [32, 1024], got {tpb}"
            )


def _check_int(name, value, lo, hi):
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            import numpy as np

            ok = isinstance(value, np.integer)
        except ImportError:  # pragma: no cover
            ok = False
        if not ok:
            raise TypeError(f"MHAConfig.{name} must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise ValueError(f"MHAConfig.{name} must be an integer in [{lo}, {hi}], got {value}")


DEFAULT_CONFIG = MHAConfig()


def resolve_config(config) -> MHAConfig:
    """``None`` gives the defaults; anything but an :class:`MHAConfig` is a TypeError."""
    if config is None:
        return DEFAULT_CONFIG
    if not isinstance(config, MHAConfig):
        raise TypeError(f"config must be an MHAConfig or None, got {type(config).__name__}")
    return config
