"""PinnedPool: never above the budget, each buffer grown once (no free-then-reallocate), failure -> None, said once."""

from __future__ import annotations

from strata_core.api.backend import PinnedBudget
from strata_core.runtime.pinned import PinnedPool
from strata_core.runtime.runlog import RunLog
from strata_core.builtin.sim import FaultPlan, SimPinnedAllocator

MIB = 1 << 20


class RecordingAllocator:
    """Wraps a real allocator and records every alloc and free, to prove there is no churn."""

    kind = "recording"

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[tuple[str, int]] = []

    def alloc(self, nbytes, from_floor=False):
        self.calls.append(("alloc", nbytes))
        return self.inner.alloc(nbytes, from_floor=from_floor)

    def register(self, array, from_floor=False):
        return self.inner.register(array, from_floor=from_floor)

    def free(self, buf):
        self.calls.append(("free", buf.nbytes))
        self.inner.free(buf)


def _pool(limit=64 * MIB, floor=16 * MIB, faults=(), from_floor=True):
    budget = PinnedBudget(limit, floor)
    alloc = RecordingAllocator(SimPinnedAllocator(budget, None, faults=FaultPlan.parse(list(faults))))
    log = RunLog()
    return PinnedPool(alloc, budget, log, from_floor=from_floor, name="test pool"), budget, alloc, log


def test_a_buffer_grows_once_and_is_never_freed_and_reallocated_mid_run():
    pool, budget, alloc, log = _pool()
    a = pool.reserve("x", 8 * MIB)
    assert a is not None and budget.used_bytes == 8 * MIB
    assert pool.reserve("x", 4 * MIB) is a, "a smaller ask reuses the buffer sized once"
    assert pool.reserve("x", 12 * MIB) is None, "a larger ask falls back instead of re-allocating"
    assert pool.reserve("x", 12 * MIB) is None
    assert alloc.calls == [("alloc", 8 * MIB)], "no free-then-reallocate"
    assert pool.allocations == [("x", 8 * MIB)] and pool.frees == 0
    assert len(log.fallbacks) == 1 and "sized once" in log.fallbacks[0].why
    assert pool.reserve("x", 8 * MIB) is a, "the buffer is still there for sizes it holds"


def test_never_above_the_budget():
    pool, budget, alloc, log = _pool(limit=32 * MIB, floor=8 * MIB, from_floor=False)
    assert pool.reserve("a", 20 * MIB) is not None
    assert pool.reserve("b", 8 * MIB) is None, "the arena side may not eat into the floor"
    assert budget.used_bytes == 20 * MIB <= budget.limit_bytes - budget.floor_bytes
    floor_pool = PinnedPool(alloc, budget, log, from_floor=True, name="floor")
    assert floor_pool.reserve("c", 12 * MIB) is not None
    assert floor_pool.reserve("d", 1 * MIB) is None
    assert budget.peak_bytes <= budget.limit_bytes


def test_allocation_failure_returns_none_and_is_logged_once():
    pool, budget, alloc, log = _pool(faults=["pinned-alloc:every"])
    for _ in range(3):
        assert pool.reserve("share", 1 * MIB) is None
    assert budget.used_bytes == 0
    assert len(log.fallbacks) == 1 and log.fallbacks[0].what == "test pool: share"
    assert len(log.lines) == 1
    assert alloc.calls == [("alloc", 1 * MIB)], "a failed buffer is not asked for again"


def test_a_failure_the_caller_reports_itself_is_not_logged_twice():
    pool, _, _, log = _pool(faults=["pinned-alloc:every"])
    assert pool.reserve("share", 1 * MIB, say=False) is None
    assert log.lines == [] and "could not be had" in pool.last_failure


def test_close_gives_every_byte_back():
    pool, budget, alloc, _ = _pool()
    pool.reserve("a", 2 * MIB)
    pool.reserve("b", 3 * MIB)
    pool.close()
    assert budget.used_bytes == 0 and pool.frees == 2
