"""A cuda device opens a DeviceSession for a plan: cupy memory, the plan's pinned budget, moe.cu's kernels, closers.

Needs a CUDA device (the GPU lane); skipped with the probe's reason elsewhere.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from strata_core.api import Device, DeviceMemory, DeviceSession, KernelSet, LayerOps, PinnedAllocator
from strata_cuda import backend as cuda_backend

PROBE = cuda_backend.BACKEND.probe()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not PROBE.available, reason=PROBE.reason)]

MIB = 1 << 20


def plan(limit_bytes: int = 64 * MIB, floor_bytes: int = 8 * MIB):
    """The part of a plan a session reads: its page-locked limit and floor."""
    return SimpleNamespace(pinned=SimpleNamespace(limit_bytes=limit_bytes, floor_bytes=floor_bytes))


def test_the_probe_gives_devices_that_open_a_session_charging_the_plans_budget():
    d = PROBE.devices[0]
    assert isinstance(d, Device) and d.info.caps.async_copies and d.info.caps.graph_capture
    s = d.open(plan())
    try:
        assert isinstance(s, DeviceSession)
        assert isinstance(s.memory, DeviceMemory) and isinstance(s.kernels, KernelSet)
        assert isinstance(s.pinned, PinnedAllocator) and s.pinned.kind == "cuda-host"
        assert (s.budget.limit_bytes, s.budget.floor_bytes) == (64 * MIB, 8 * MIB)
        # the fused CUDA layer ops, advertised in the caps
        assert isinstance(s.layer_ops, LayerOps) and d.info.caps.fused_layer_ops
        assert s.kernels.name == "cuda-moe.cu"
        buf = s.pinned.alloc(4 * MIB)
        assert buf is not None and s.budget.used_bytes == 4 * MIB
        # the arena may not eat into the floor: 64 - 8 - 4 MiB are left to it
        assert s.pinned.alloc(57 * MIB) is None
        s.pinned.free(buf)
        x = np.arange(12, dtype=np.float32).reshape(3, 4)
        y = s.memory.download(s.kernels.gather(s.memory.to_device(x), s.memory.to_device(np.array([2, 0], np.int32))))
        np.testing.assert_array_equal(y, x[[2, 0]])
    finally:
        s.close()
    assert s.closers == []


def test_a_described_device_of_this_machine_still_refuses_to_open():
    d = cuda_backend.BACKEND.describe(PROBE.devices[0].info)
    from strata_core.errors import BadInput
    with pytest.raises(BadInput):
        d.open(plan())
