"""SimDeviceMemory and SimPinnedAllocator: capacities, accounting-only mode, the OS lock limit, the budget."""

from __future__ import annotations

import numpy as np
import pytest

from strata_core.api.backend import DeviceMemory, PinnedAllocator, PinnedBudget
from strata_core.builtin.sim import FaultPlan, PhantomArray, SimDeviceMemory, SimPinnedAllocator

MIB = 1 << 20


# -- device memory -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("accounting_only", [False, True])
def test_device_memory_satisfies_the_protocol(accounting_only):
    assert isinstance(SimDeviceMemory(MIB, accounting_only=accounting_only), DeviceMemory)


def test_alloc_counts_bytes_and_free_gives_them_back():
    mem = SimDeviceMemory(10 * MIB)
    a = mem.alloc((256, 1024), np.float32)  # 1 MiB
    assert isinstance(a, np.ndarray) and a.shape == (256, 1024) and a.dtype == np.float32
    assert mem.mem_info() == (9 * MIB, 10 * MIB)
    b = mem.alloc((MIB,), np.uint8)
    assert mem.mem_info() == (8 * MIB, 10 * MIB)
    mem.free(a)
    assert mem.mem_info() == (9 * MIB, 10 * MIB)
    mem.free(b)
    assert mem.mem_info() == (10 * MIB, 10 * MIB)
    assert mem.live_allocations == 0 and mem.peak_bytes == 2 * MIB


def test_alloc_beyond_capacity_returns_none_and_takes_nothing():
    mem = SimDeviceMemory(4 * MIB)
    a = mem.alloc((3 * MIB,), np.uint8)
    assert a is not None
    assert mem.alloc((MIB + 1,), np.uint8) is None
    assert mem.mem_info()[0] == MIB
    assert mem.alloc((MIB,), np.uint8) is not None  # exactly what is left fits
    assert mem.mem_info()[0] == 0
    assert mem.refusals == 1


def test_real_mode_arrays_start_poisoned_so_unwritten_reads_show():
    mem = SimDeviceMemory(MIB)
    assert np.isnan(mem.alloc((4, 4), np.float32)).all()
    assert (mem.alloc((8,), np.int32) == np.iinfo(np.int32).max).all()


def test_double_free_and_foreign_free_are_refused():
    mem = SimDeviceMemory(MIB)
    a = mem.alloc((16,), np.float32)
    mem.free(a)
    with pytest.raises(ValueError, match="freed twice"):
        mem.free(a)
    with pytest.raises(ValueError):
        mem.free(np.zeros(16, np.float32))
    assert mem.mem_info()[0] == MIB


def test_upload_download_round_trip_real_mode():
    mem = SimDeviceMemory(MIB)
    src = np.arange(12, dtype=np.float32).reshape(3, 4)
    dst = mem.alloc((3, 4), np.float32)
    mem.upload(dst, src, stream=mem.new_stream())
    back = mem.download(dst)
    assert np.array_equal(back, src) and back is not dst
    assert mem.bytes_uploaded == src.nbytes and mem.bytes_downloaded == src.nbytes
    dev = mem.to_device(src * 2)
    assert np.array_equal(mem.download(dev), src * 2)
    assert mem.mem_info()[0] == MIB - 2 * src.nbytes


def test_upload_of_the_wrong_size_is_refused():
    mem = SimDeviceMemory(MIB)
    dst = mem.alloc((4,), np.float32)
    with pytest.raises(ValueError):
        mem.upload(dst, np.zeros(5, np.float32))


def test_accounting_mode_hands_out_phantoms_and_counts_bytes():
    mem = SimDeviceMemory(64 * 1024 * MIB, accounting_only=True)  # far more than this machine has
    a = mem.alloc((32 * 1024, MIB), np.uint8)  # 32 GiB, no memory behind it
    assert isinstance(a, PhantomArray) and a.nbytes == 32 * 1024 * MIB and a.shape == (32 * 1024, MIB)
    assert mem.mem_info() == (32 * 1024 * MIB, 64 * 1024 * MIB)
    mem.upload(a, PhantomArray.of(a.shape, np.uint8))
    assert mem.bytes_uploaded == a.nbytes
    back = mem.download(a)
    assert isinstance(back, PhantomArray) and back.nbytes == a.nbytes
    assert mem.bytes_downloaded == a.nbytes
    dev = mem.to_device(np.ones((4, 4), np.float32))
    assert isinstance(dev, PhantomArray) and dev.nbytes == 64
    assert mem.alloc((33 * 1024, MIB), np.uint8) is None
    mem.free(a)
    mem.free(dev)
    assert mem.mem_info() == (64 * 1024 * MIB, 64 * 1024 * MIB)


def test_to_device_returns_none_when_it_does_not_fit():
    mem = SimDeviceMemory(16)
    assert mem.to_device(np.zeros(5, np.float32)) is None
    assert mem.mem_info()[0] == 16


def test_phantom_reshape_and_view_follow_numpy():
    p = PhantomArray.of((4, 6), np.float32)
    assert p.reshape(-1).shape == (24,) and p.reshape(2, -1).shape == (2, 12)
    assert p.reshape((3, 8)).shape == (3, 8)
    assert p.view(np.uint8).shape == (96,)
    assert np.zeros((4, 6), np.float32).reshape(2, -1).shape == p.reshape(2, -1).shape
    with pytest.raises(ValueError):
        p.reshape(5, -1)
    with pytest.raises(ValueError):
        p.reshape(-1, -1)


def test_streams_and_events_are_distinct_and_nominal():
    mem = SimDeviceMemory(MIB)
    s1, s2, e = mem.new_stream(), mem.new_stream(), mem.new_event()
    assert s1 != s2
    mem.record(e, s1)
    mem.wait(s2, e)
    mem.synchronize(s1)
    mem.synchronize()


def test_drop_capacity_lowers_free_memory_but_never_below_zero():
    mem = SimDeviceMemory(10 * MIB)
    a = mem.alloc((4 * MIB,), np.uint8)
    mem.drop_capacity(3 * MIB)
    assert mem.mem_info() == (3 * MIB, 7 * MIB)
    mem.drop_capacity(100 * MIB)
    assert mem.mem_info() == (0, 0)
    mem.free(a)
    assert mem.used_bytes == 0


# -- pinned allocator ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("accounting_only", [False, True])
def test_pinned_allocator_satisfies_the_protocol(accounting_only):
    assert isinstance(SimPinnedAllocator(PinnedBudget(MIB), None, accounting_only=accounting_only), PinnedAllocator)


def test_pinned_alloc_goes_through_the_budget_and_free_is_idempotent():
    budget = PinnedBudget(limit_bytes=4 * MIB, floor_bytes=MIB)
    pa = SimPinnedAllocator(budget, pinnable_bytes=None)
    buf = pa.alloc(3 * MIB)
    assert buf is not None and buf.nbytes == 3 * MIB and buf.array.nbytes == 3 * MIB
    assert budget.used_bytes == 3 * MIB
    assert pa.alloc(1) is None  # the arena side may not eat into the floor
    floor = pa.alloc(MIB, from_floor=True)
    assert floor is not None and budget.used_bytes == 4 * MIB
    pa.free(buf)
    pa.free(buf)
    assert budget.used_bytes == MIB and pa.locked_bytes == MIB
    pa.free(floor)
    assert budget.used_bytes == 0 and pa.locked_bytes == 0
    assert not budget.exhausted


def test_pinned_alloc_beyond_what_the_os_locks_returns_none_and_gives_the_budget_back():
    budget = PinnedBudget(limit_bytes=100 * MIB)
    pa = SimPinnedAllocator(budget, pinnable_bytes=10 * MIB)
    a = pa.alloc(8 * MIB)
    assert a is not None
    assert pa.alloc(3 * MIB) is None
    assert budget.used_bytes == 8 * MIB and pa.locked_bytes == 8 * MIB
    assert not budget.exhausted  # a plain allocation failing is not evidence the whole budget is gone
    assert pa.alloc(2 * MIB) is not None


def test_register_of_more_than_the_os_locks_marks_the_budget_exhausted():
    """The seed: cudaHostRegister of the whole arena FAILED (out of memory) on a 64 GB WDDM host."""
    arena_bytes, pinnable_bytes = 35456548864, 32427003084  # the 3090 scenario's arena and pinnable limit
    budget = PinnedBudget(limit_bytes=40 * 1024 * MIB, floor_bytes=512 * MIB)
    pa = SimPinnedAllocator(budget, pinnable_bytes=pinnable_bytes, accounting_only=True)
    arena = PhantomArray.of((arena_bytes,), np.uint8)
    assert pa.register(arena) is None
    assert budget.exhausted and "FAILED (out of memory" in budget.exhausted_reason
    assert budget.used_bytes == 0 and pa.locked_bytes == 0
    # slices of the arena still lock, as the seed's sliced fallback did
    half = pa.register(PhantomArray.of((arena_bytes // 2,), np.uint8))
    assert half is not None and half.kind == "register" and budget.used_bytes == arena_bytes // 2


def test_register_refused_by_the_budget_does_not_mark_exhausted():
    budget = PinnedBudget(limit_bytes=MIB)
    pa = SimPinnedAllocator(budget, pinnable_bytes=None)
    assert pa.register(np.zeros(2 * MIB, np.uint8)) is None
    assert not budget.exhausted and budget.used_bytes == 0


def test_register_real_mode_views_the_same_memory():
    budget = PinnedBudget(limit_bytes=MIB)
    pa = SimPinnedAllocator(budget, pinnable_bytes=None)
    host = np.zeros((4, 4), np.float32)
    buf = pa.register(host)
    assert buf is not None and buf.nbytes == host.nbytes
    buf.array[:4] = 0xFF
    assert host.reshape(-1).view(np.uint8)[0] == 0xFF  # locked in place, not copied
    pa.free(buf)
    assert budget.used_bytes == 0


def test_negative_pinned_alloc_returns_none():
    pa = SimPinnedAllocator(PinnedBudget(MIB), None)
    assert pa.alloc(-1) is None


def test_pinned_accounting_mode_returns_phantoms():
    budget = PinnedBudget(limit_bytes=64 * 1024 * MIB)
    pa = SimPinnedAllocator(budget, pinnable_bytes=None, accounting_only=True)
    buf = pa.alloc(48 * 1024 * MIB)
    assert buf is not None and isinstance(buf.array, PhantomArray) and buf.array.nbytes == 48 * 1024 * MIB


def test_device_and_pinned_share_one_fault_plan_sequence():
    faults = FaultPlan.parse(["pinned-alloc:nth=2"])
    mem = SimDeviceMemory(MIB, faults=faults)
    pa = SimPinnedAllocator(PinnedBudget(MIB), None, faults=faults)
    mem.alloc((4,), np.float32)
    assert pa.alloc(16) is not None
    assert pa.alloc(16) is None
    assert [f["op"] for f in mem.faults_injected()] == [3]
    assert mem.faults_injected() == pa.faults_injected()
