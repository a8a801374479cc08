"""The cupy pinned allocator's budget logic, with a runtime double injected (no GPU needed).

The double hands out real host memory (so the buffers' numpy views are real) and refuses with the status cupy's
CUDARuntimeError carries for cudaErrorMemoryAllocation when told to.
"""

from __future__ import annotations

import numpy as np
import pytest

from strata_core.api.backend import PinnedAllocator, PinnedBudget
from strata_cuda.cupy_device import OUT_OF_MEMORY_STATUS, CupyPinnedAllocator, is_out_of_memory


class RuntimeRefusal(Exception):
    """Like cupy's CUDARuntimeError: the status is an attribute."""

    def __init__(self, status: int, text: str):
        super().__init__(text)
        self.status = status


class FakeRuntime:
    """hostAlloc / freeHost / hostRegister / hostUnregister over numpy memory, with scripted refusals."""

    def __init__(self, alloc_limit_bytes: int = 1 << 40, register_limit_bytes: int = 1 << 40,
                 register_status: int = OUT_OF_MEMORY_STATUS):
        self.alloc_limit_bytes = alloc_limit_bytes
        self.register_limit_bytes = register_limit_bytes
        self.register_status = register_status
        self.allocated: dict[int, np.ndarray] = {}
        self.registered: dict[int, int] = {}
        self.calls: list[str] = []

    def hostAlloc(self, nbytes, flags):
        self.calls.append("hostAlloc")
        if nbytes > self.alloc_limit_bytes:
            raise RuntimeRefusal(OUT_OF_MEMORY_STATUS, "cudaErrorMemoryAllocation: out of memory")
        mem = np.zeros(nbytes, dtype=np.uint8)
        self.allocated[mem.ctypes.data] = mem
        return mem.ctypes.data

    def freeHost(self, ptr):
        self.calls.append("freeHost")
        del self.allocated[ptr]

    def hostRegister(self, ptr, nbytes, flags):
        self.calls.append("hostRegister")
        if nbytes > self.register_limit_bytes:
            raise RuntimeRefusal(self.register_status, "cudaHostRegister refused")
        self.registered[ptr] = nbytes

    def hostUnregister(self, ptr):
        self.calls.append("hostUnregister")
        del self.registered[ptr]


def make(limit=1 << 20, floor=1 << 16, **rt):
    """A budget, a runtime double and the allocator charging the one through the other."""
    budget = PinnedBudget(limit_bytes=limit, floor_bytes=floor)
    runtime = FakeRuntime(**rt)
    return budget, runtime, CupyPinnedAllocator(budget, kind="cuda-host", runtime=runtime)


def test_it_is_a_pinned_allocator():
    _, _, alloc = make()
    assert isinstance(alloc, PinnedAllocator)
    assert alloc.kind == "cuda-host"


def test_alloc_takes_from_the_budget_and_free_gives_back_once():
    budget, rt, alloc = make()
    buf = alloc.alloc(4096)
    assert buf is not None and buf.kind == "alloc" and buf.nbytes == 4096
    assert budget.used_bytes == 4096 and len(rt.allocated) == 1
    buf.array[:] = 7  # the view is the runtime's memory
    assert int(next(iter(rt.allocated.values())).sum()) == 7 * 4096
    alloc.free(buf)
    alloc.free(buf)
    assert budget.used_bytes == 0 and rt.calls.count("freeHost") == 1 and not rt.allocated
    assert buf.array.size == 0  # no view onto freed memory is left behind


def test_alloc_over_the_budget_returns_none_without_asking_the_runtime():
    budget, rt, alloc = make(limit=10_000, floor=1_000)
    assert alloc.alloc(9_500) is None  # the arena may not eat the floor
    assert rt.calls == [] and budget.used_bytes == 0
    assert alloc.alloc(9_500, from_floor=True) is not None


def test_alloc_refused_by_the_runtime_returns_none_and_gives_the_bytes_back():
    budget, rt, alloc = make(alloc_limit_bytes=1000)
    assert alloc.alloc(5000) is None
    assert budget.used_bytes == 0
    assert "5000" in alloc.last_error
    assert budget.exhausted is False  # only a refused registration is that strong a signal


def test_register_locks_in_place_and_unregisters_on_free():
    budget, rt, alloc = make()
    arena = np.arange(1000, dtype=np.float32)
    buf = alloc.register(arena)
    assert buf is not None and buf.kind == "register" and buf.nbytes == 4000
    assert rt.registered == {arena.ctypes.data: 4000} and budget.used_bytes == 4000
    buf.array.view(np.float32)[0] = -1.0  # the view is the arena itself
    assert arena[0] == -1.0
    alloc.free(buf)
    assert not rt.registered and budget.used_bytes == 0
    assert arena[1] == 1.0  # registered memory stays the caller's ordinary memory


def test_a_failed_whole_arena_registration_marks_the_budget_exhausted():
    # seed #1756: cudaHostRegister of the whole arena FAILED (out of memory)
    budget, rt, alloc = make(limit=1 << 30, floor=1 << 20, register_limit_bytes=1 << 16)
    arena = np.zeros(1 << 20, dtype=np.uint8)
    assert alloc.register(arena) is None
    assert budget.exhausted is True
    assert str(1 << 20) in budget.exhausted_reason
    assert budget.used_bytes == 0


def test_a_registration_refused_for_another_reason_does_not_exhaust_the_budget():
    budget, rt, alloc = make(register_limit_bytes=0, register_status=1)  # cudaErrorInvalidValue
    assert alloc.register(np.zeros(64, dtype=np.uint8)) is None
    assert budget.exhausted is False and budget.used_bytes == 0
    assert "refused" in alloc.last_error


def test_register_over_the_budget_returns_none_without_asking_the_runtime():
    budget, rt, alloc = make(limit=1000, floor=100)
    assert alloc.register(np.zeros(950, dtype=np.uint8)) is None
    assert rt.calls == [] and budget.exhausted is False


def test_register_needs_contiguous_memory():
    _, _, alloc = make()
    with pytest.raises(ValueError):
        alloc.register(np.zeros((8, 8), dtype=np.float32)[:, ::2])


def test_zero_bytes_asks_nothing_of_the_runtime():
    budget, rt, alloc = make()
    buf = alloc.alloc(0)
    assert buf is not None and buf.array.size == 0
    alloc.free(buf)
    assert rt.calls == [] and budget.used_bytes == 0


def test_out_of_memory_is_recognized_by_status():
    assert is_out_of_memory(RuntimeRefusal(OUT_OF_MEMORY_STATUS, "x"))
    assert not is_out_of_memory(RuntimeRefusal(1, "x"))
    assert not is_out_of_memory(ValueError("no status"))
