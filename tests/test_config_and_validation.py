"""MHAConfig ranges and the shared argument checks."""

from __future__ import annotations

import numpy as np
import pytest

import numattn
from numattn import MHAConfig
from numattn.core import validate as V
from numattn.core.config import resolve_config
from numattn.core.device import CudaUnavailableError, is_device_array, resolve_device


def test_config_defaults_and_ranges():
    cfg = MHAConfig()
    assert (cfg.block_q, cfg.block_k, cfg.num_partitions, cfg.threads_per_block) == (
        256, 128, None, 128)
    assert MHAConfig(block_q=np.int64(8)).block_q == 8
    for kwargs, exc, match in [
        ({"block_q": 0}, ValueError, "block_q"),
        ({"block_k": 70000}, ValueError, "block_k"),
        ({"num_partitions": 0}, ValueError, "num_partitions"),
        ({"threads_per_block": 96}, ValueError, "power of two"),
        ({"threads_per_block": 16}, ValueError, "threads_per_block"),
        ({"block_q": 2.0}, TypeError, "integer"),
        ({"block_k": True}, TypeError, "integer"),
    ]:
        with pytest.raises(exc, match=match):
            MHAConfig(**kwargs)
    with pytest.raises(AttributeError):
        cfg.block_q = 4
    assert resolve_config(None) is resolve_config(None)
    with pytest.raises(TypeError, match="config must be an MHAConfig"):
        resolve_config({"block_q": 4})


def test_row_offsets_checks():
    assert V.check_row_offsets("o", np.array([0, 2, 2, 5], np.uint8), 5, "T").dtype == np.int64
    with pytest.raises(ValueError, match=r"o\[0\] must be 0"):
        V.check_row_offsets("o", [1, 2], 2, "T")
    with pytest.raises(ValueError, match="non-decreasing"):
        V.check_row_offsets("o", [0, 3, 2], 2, "T")
    with pytest.raises(ValueError, match=r"o\[-1\] must equal T = 4"):
        V.check_row_offsets("o", [0, 3], 4, "T")
    with pytest.raises(ValueError, match="length B \\+ 1 = 3"):
        V.check_row_offsets("o", [0, 3], 3, "T", batch=2)
    with pytest.raises(TypeError, match="integer dtype"):
        V.check_row_offsets("o", np.array([0.0, 1.0]), 1, "T")
    with pytest.raises(ValueError, match="1-d"):
        V.check_row_offsets("o", np.zeros((2, 2), int), 0, "T")


def test_scale_sinks_heads_out():
    assert V.check_scale(None, 16) == 0.25
    assert V.check_scale(2, 16) == 2.0
    with pytest.raises(ValueError, match="finite"):
        V.check_scale(np.inf, 4)
    with pytest.raises(TypeError, match="scale"):
        V.check_scale("1", 4)
    with pytest.raises(ValueError, match="past the float64 range"):
        V.check_scale(2**2000, 4)
    assert V.check_scale(1e300, 4, np.float64) == 1e300
    with pytest.raises(ValueError, match="overflows float32"):
        V.check_scale(-1e300, 4, np.float32)
    assert V.check_scale(np.array(0.5), 4) == 0.5  # a 0-d array
    with pytest.raises(TypeError, match="scale"):
        V.check_scale([0.5], 4)
    s = V.check_sink_weights(np.array([1.0, 2.0]), 2, np.float32)
    assert s.dtype == np.float32
    s = V.check_sink_weights([1.0, 2.5], 2, np.float64)  # a list of numbers, like offsets
    assert s.dtype == np.float64 and s.tolist() == [1.0, 2.5]
    with pytest.raises(ValueError, match=r"sink_weights must have shape \[3\]"):
        V.check_sink_weights(np.ones(2), 3, np.float32)
    with pytest.raises(TypeError, match="float64, float32, float16 or bfloat16"):
        V.check_sink_weights(np.ones(2, int), 2, np.float32)
    assert V.check_heads(8, 2) == 4
    with pytest.raises(ValueError, match="multiple"):
        V.check_heads(6, 4)
    out = np.empty((2, 3), np.float32)
    assert V.check_out(out, (2, 3), np.float32) is out
    with pytest.raises(ValueError, match=r"out must have shape \[3, 2\]"):
        V.check_out(out, (3, 2), np.float32)
    with pytest.raises(TypeError, match="dtype float64"):
        V.check_out(out, (2, 3), np.float64)
    with pytest.raises(ValueError, match="C-contiguous"):
        V.check_out(np.empty((3, 2), np.float32).T, (2, 3), np.float32)
    with pytest.raises(TypeError, match="must be an array"):
        V.check_array("q", [1, 2])
    with pytest.raises(ValueError, match="q must be 3-d or 4-d"):
        V.check_array("q", np.zeros(2), ndim=(3, 4))


class _ForeignTensor:
    """Looks like an array (shape, dtype) but is neither NumPy nor a CUDA device array."""

    shape = (2, 4, 8)
    dtype = "float32"


def test_foreign_array_types_are_named():
    k = np.zeros((2, 5, 2, 8), np.float32)
    for call in (lambda: numattn.decode_attention(_ForeignTensor(), k, k),
                 lambda: numattn.cross_attention(_ForeignTensor(), [0, 1, 2], 1, k[0], k[0],
                                                 [0, 2, 5])):
        with pytest.raises(TypeError, match="q must be a NumPy array or a CUDA device array"):
            call()
    q = np.zeros((2, 4, 8), np.float32)
    with pytest.raises(TypeError, match="sink_weights must be a NumPy array"):
        numattn.decode_attention(q, k, k, sink_weights=_ForeignTensor())



@pytest.mark.parametrize("kv", [5, None, {"blocks": 1}, [[1.0]]])
def test_k_and_v_of_the_same_non_array_kind_are_named(kv):
    """k and v of one kind (so the pair check passes) that is no array nor cache."""
    q = np.zeros((3, 4, 8), np.float32)
    offsets = np.array([0, 1, 3])
    calls = (lambda: numattn.decode_attention(q, kv, kv),
             lambda: numattn.flash_attention_kv_cache(q, kv, kv, None,
                                                      q_input_row_offsets=offsets),
             lambda: numattn.cross_attention(q, offsets, 2, kv, kv, offsets))
    for call in calls:
        with pytest.raises(TypeError, match="k must be an array"):
            call()

class _FakeDeviceArray:
    @property
    def __cuda_array_interface__(self):
        return {}


def test_device_resolution():
    host = np.zeros(2)
    assert resolve_device("auto", [host]) == "cpu"
    assert resolve_device("auto", [host, _FakeDeviceArray()]) == "cuda"
    assert resolve_device("cuda", [host]) == "cuda"
    assert is_device_array(_FakeDeviceArray()) and not is_device_array(host)
    with pytest.raises(TypeError, match="device='cpu'"):
        resolve_device("cpu", [_FakeDeviceArray()])
    with pytest.raises(ValueError, match="device must be"):
        resolve_device("gpu", [host])
    assert issubclass(CudaUnavailableError, RuntimeError)


class _DeviceRange:
    """Just enough of a CUDA device array for the overlap check (never dereferenced)."""

    def __init__(self, address, shape, strides=None, typestr="<f4"):
        self.__cuda_array_interface__ = {"data": (address, False), "shape": shape,
                                         "strides": strides, "typestr": typestr, "version": 3}
        self.shape = shape
        self.dtype = np.dtype(typestr)


def test_overlap_check_on_host_and_device_arrays():
    base = np.zeros((6, 8), np.float32)
    V.check_no_overlap(base[:3], {"x": base[3:], "none": None})  # adjacent rows
    V.check_no_overlap(None, {"x": base})
    for other in (base[2:4], base[::-1], base[:, ::-2], base.T):
        with pytest.raises(ValueError, match="out must not overlap x"):
            V.check_no_overlap(base[3:5], {"x": other})
    # device arrays: address ranges from the interface (C-contiguous when strides is None)
    out = _DeviceRange(1000, (2, 3))  # bytes 1000..1023
    V.check_no_overlap(out, {"x": _DeviceRange(1024, (4,)), "host": base})
    V.check_no_overlap(out, {"x": _DeviceRange(900, (25,))})  # ends at byte 1000
    V.check_no_overlap(out, {"x": _DeviceRange(1020, (0, 5))})  # empty
    for other in (_DeviceRange(1020, (4,)), _DeviceRange(900, (2, 26)),
                  _DeviceRange(1100, (3,), strides=(-40,)),  # bytes 1020..1103
                  _DeviceRange(992, (2,), typestr="<f8")):
        with pytest.raises(ValueError, match="out must not overlap x"):
            V.check_no_overlap(out, {"x": other})
