"""PinnedPool: every page-locked byte of the runtime's own buffers goes through the PinnedBudget.

A buffer is sized once, to the largest size the run can need, before the first request: it never frees and
re-allocates mid-run (the churn the CPU-share seed describes). An allocation that fails returns None and the caller
falls back (a pageable copy, or its optimization off) after one line in the log.
"""

from __future__ import annotations

import numpy as np

from strata_core.api.backend import PinnedAllocator, PinnedBudget, PinnedBuffer
from strata_core.runtime.runlog import RunLog


class PinnedPool:
    """Named page-locked buffers, each grown once; `from_floor` pools draw on the budget's floor (CPU share, staging)."""

    def __init__(self, allocator: PinnedAllocator | None, budget: PinnedBudget, log: RunLog,
                 from_floor: bool = False, name: str = "pinned pool"):
        self.allocator = allocator
        self.budget = budget
        self.log = log
        self.from_floor = from_floor
        self.name = name
        self.buffers: dict[str, PinnedBuffer] = {}
        #: (buffer name, bytes) of every allocation made, in order: tests read it to prove grow-once.
        self.allocations: list[tuple[str, int]] = []
        self.frees = 0
        self.failures: dict[str, int] = {}
        self.last_failure = ""

    def reserve(self, key: str, nbytes: int, say: bool = True) -> PinnedBuffer | None:
        """The buffer `key` of at least nbytes: allocated on the first call, the same one after; None on failure.

        Asking for more than the first size is a sizing bug of the caller, not a reason to free and re-allocate:
        it returns None (the caller falls back) and says so once. With say=False the caller says it, in its own
        one line, and `last_failure` tells it why.
        """
        nbytes = int(nbytes)
        have = self.buffers.get(key)
        if have is not None:
            if have.nbytes >= nbytes:
                return have
            self.log.fallback(f"{self.name}: {key}",
                              f"{nbytes} bytes asked of a buffer sized once at {have.nbytes}; "
                              "not re-allocated mid-run, this use falls back", once=("pool-grow", self.name, key))
            return None
        if key in self.failures:
            return None
        buf = None
        if self.allocator is None:
            why = "the backend offers no page-locked memory"
        else:
            buf = self.allocator.alloc(nbytes, from_floor=self.from_floor)
            why = (f"{_mib(nbytes)} of page-locked memory could not be had "
                   f"({_mib(self.budget.left_bytes)} left of the budget"
                   + (", budget exhausted" if self.budget.exhausted else "") + ")")
        if buf is None:
            self.failures[key] = nbytes
            self.last_failure = why
            if say:
                self.log.fallback(f"{self.name}: {key}", why, once=("pool-fail", self.name, key))
            return None
        self.buffers[key] = buf
        self.allocations.append((key, nbytes))
        return buf

    def view(self, key: str, shape: tuple[int, ...], dtype) -> np.ndarray | None:
        """A typed view of the first bytes of buffer `key` (None when it was never had or is too small)."""
        buf = self.buffers.get(key)
        need = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if buf is None or buf.nbytes < need:
            return None
        if not hasattr(buf.array, "__getitem__"):
            return buf.array  # an accounting-only phantom: the bytes are counted, there is nothing to view
        return buf.array[:need].view(dtype).reshape(shape)

    @property
    def held_bytes(self) -> int:
        """Bytes this pool holds now."""
        return sum(b.nbytes for b in self.buffers.values())

    def close(self) -> None:
        """Release every buffer (end of the run)."""
        for buf in self.buffers.values():
            if self.allocator is not None:
                self.allocator.free(buf)
            self.frees += 1
        self.buffers.clear()


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"
