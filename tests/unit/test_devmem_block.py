"""PlanMemory.reserve: the start-up lines carved from one block (the driver then rounds one allocation)."""

from __future__ import annotations

import numpy as np
import pytest

from strata_core.builtin.cpu import HostMemory
from strata_core.runtime.devmem import ALIGN_BYTES, OutsidePlan, PlanMemory
from strata_core.planner import driver_memory


class CountingHost(HostMemory):
    """HostMemory that counts the allocations it makes."""

    def __init__(self):
        self.allocs: list[int] = []

    def alloc(self, shape, dtype):
        """A numpy array, counted."""
        a = super().alloc(shape, dtype)
        self.allocs.append(int(a.nbytes))
        return a


def test_start_up_arrays_are_aligned_views_of_the_one_block():
    inner = CountingHost()
    pm = PlanMemory(inner, strict=True)
    assert pm.reserve(1 << 20)
    pm.region("a")
    a = pm.alloc((3, 5), np.float32)
    b = pm.take("workspace", 1000)
    c = pm.to_device(np.arange(7, dtype=np.int64))
    assert inner.allocs == [1 << 20], "a start-up array was allocated outside the block"
    base = pm._block.ctypes.data
    for arr in (a, b, c):
        assert np.shares_memory(arr, pm._block)
        assert (arr.ctypes.data - base) % ALIGN_BYTES == 0
    assert np.array_equal(c, np.arange(7))
    assert pm.regions == {"a": 60, "workspace": 1000 + 56}  # the copy counts under the region named last
    assert pm.block_bytes == 1 << 20


def test_freed_top_arrays_give_their_bytes_back_and_overflow_falls_back_to_its_own_allocation():
    inner = CountingHost()
    pm = PlanMemory(inner, strict=True)
    assert pm.reserve(4096)
    x = pm.alloc((512,), np.uint8)
    y = pm.alloc((512,), np.uint8)
    pm.free(x)  # not at the top: the block's end stays after y
    assert pm._block_used == 1024
    pm.free(y)  # now both are free: the block is empty again
    assert pm._block_used == 0
    z = pm.alloc((4096,), np.uint8)
    assert np.shares_memory(z, pm._block) and inner.allocs == [4096]
    w = pm.alloc((16,), np.float32)  # no room left: its own allocation, still before the seal
    assert not np.shares_memory(w, pm._block) and inner.allocs == [4096, 64]
    pm.seal()
    with pytest.raises(OutsidePlan):
        pm.alloc((1,), np.uint8)
    pm.free(z)
    pm.free(w)
    assert pm._block is None, "the block outlived every array carved from it"


def test_no_second_block_and_none_after_the_seal():
    pm = PlanMemory(CountingHost(), strict=True)
    assert pm.reserve(1024) and not pm.reserve(1024)
    pm2 = PlanMemory(CountingHost(), strict=True)
    pm2.seal()
    assert not pm2.reserve(1024) and pm2.block_bytes == 0


def test_the_planners_alignment_is_the_carvers():
    assert driver_memory.ALIGN_BYTES == ALIGN_BYTES
