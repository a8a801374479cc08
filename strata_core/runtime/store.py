"""The expert store: every expert's weights in host memory, page-locked where the plan allows it, pageable otherwise.

Pinning follows the plan: first the whole arena is registered in place through the PinnedAllocator; when that
fails (the budget or the platform says no) the pinned budget is marked exhausted, which every optional page-locked
user reads later, and the store pins what the plan's arena allows in slices, the rest staying pageable. One line
says what happened. In accounting-only mode (`strata simulate`) the store holds phantoms: shapes and bytes only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from strata_core.api.backend import PinnedAllocator, PinnedBudget, PinnedBuffer
from strata_core.reference.kernels import ExpertPool
from strata_core.phantom import PhantomArray
from strata_core.planner.pin_caps import REGISTRATION_SLICE_BYTES
from strata_core.runtime.runlog import RunLog

GIB = 1 << 30

#: The arena is pinned in at most this many slices when it cannot be registered whole (the seed's engine: 40).
MAX_SLICES = 40


def phantom_pool(dtype: str, rows: int, hidden: int, ffn: int) -> ExpertPool:
    """A host ExpertPool of phantoms, for accounting-only runs of models too large to hold."""
    specs = ExpertPool.array_specs(dtype, rows, hidden, ffn)
    return ExpertPool(dtype, {k: PhantomArray.of(shape, dt) for k, (shape, dt) in specs.items()})


def phantom_pool_of_bytes(rows: int, slot_bytes: int) -> ExpertPool:
    """A one-array phantom pool of rows x slot_bytes: scenarios give bytes, not shapes, for their quants."""
    return ExpertPool("raw", {"blob": PhantomArray.of((rows, slot_bytes), np.uint8)})


class ExpertStore:
    """Host experts (layers x experts rows of one ExpertPool) and which rows are page-locked."""

    def __init__(self, pool: ExpertPool, layers: int, experts_per_layer: int):
        self.pool = pool
        self.layers = int(layers)
        self.experts_per_layer = int(experts_per_layer)
        self.rows = self.layers * self.experts_per_layer
        self.pinned_rows = np.zeros(self.rows, dtype=bool)
        self.buffers: list[PinnedBuffer] = []
        self.allocator: PinnedAllocator | None = None
        self.whole = False
        #: One registration call of 512 GiB or more fails: the plan's slice size (planner.pin_caps).
        self.max_call_bytes = REGISTRATION_SLICE_BYTES
        self._row_bytes_pool: ExpertPool | None = None
        self._row_bytes = 0

    @property
    def nbytes(self) -> int:
        """Bytes of every expert."""
        return sum(int(a.nbytes) for a in self.pool.arrays.values())

    @property
    def row_bytes(self) -> int:
        """Bytes of one expert (one row of every array)."""
        # asked once per streamed expert (~10^6 times a replay): computed once per pool object, not per call
        if self._row_bytes_pool is not self.pool:
            self._row_bytes_pool, self._row_bytes = self.pool, self.nbytes // self.rows
        return self._row_bytes

    @property
    def pinned_bytes(self) -> int:
        """Bytes page-locked now."""
        return int(self.pinned_rows.sum()) * self.row_bytes

    @property
    def pinned_fraction(self) -> float:
        """Share of the experts that is page-locked."""
        return float(self.pinned_rows.mean()) if self.rows else 1.0

    def expert(self, row: int) -> dict[str, Any]:
        """name -> host view of one expert's arrays."""
        return {k: a[row] for k, a in self.pool.arrays.items()}

    def _register_rows(self, r0: int, r1: int) -> list[PinnedBuffer] | None:
        """Register rows r0:r1 of every array, in calls below the per-call limit; all or nothing."""
        got = []
        step = max(1, self.max_call_bytes // max(1, self.row_bytes))
        for a in self.pool.arrays.values():
            for c0 in range(r0, r1, step):
                buf = self.allocator.register(a[c0:min(r1, c0 + step)])
                if buf is None:
                    for b in got:
                        self.allocator.free(b)
                    return None
                got.append(buf)
        return got

    def pin(self, allocator: PinnedAllocator | None, budget: PinnedBudget, arena_limit_bytes: int,
            log: RunLog, max_call_bytes: int = REGISTRATION_SLICE_BYTES) -> None:
        """Page-lock the store as the plan allows: whole, else in slices up to arena_limit_bytes, else pageable."""
        self.allocator = allocator
        self.max_call_bytes = int(max_call_bytes)
        total = self.nbytes
        if allocator is None:
            log.fallback("expert arena", "the backend offers no page-locked memory: experts are copied from "
                         "pageable memory")
            return
        got = self._register_rows(0, self.rows) if arena_limit_bytes >= total else None
        if got is not None:
            self.buffers += got
            self.pinned_rows[:] = True
            self.whole = True
            log.say(f"expert arena: {_gib(total)} page-locked whole")
            return
        why = (budget.exhausted_reason if budget.exhausted else
               f"the plan's arena allows {_gib(arena_limit_bytes)}" if arena_limit_bytes < total else
               f"the page-locked allocator refused it, {_gib(budget.left_bytes)} of the budget left")
        # A failed whole-arena registration is the strongest evidence the pinned budget is gone: say so to every
        # later optional user of page-locked memory (seed #1756).
        if not budget.exhausted:
            budget.mark_exhausted(f"the whole-arena registration of {_gib(total)} failed ({why})")
        slice_rows = max(1, -(-self.rows // MAX_SLICES))
        limit_rows = min(self.rows, arena_limit_bytes // max(1, self.row_bytes))
        slices, r0 = 0, 0
        while r0 < limit_rows:
            r1 = min(limit_rows, r0 + slice_rows)
            got = self._register_rows(r0, r1)
            if got is None:
                break
            self.buffers += got
            self.pinned_rows[r0:r1] = True
            slices += 1
            r0 = r1
        log.fallback("expert arena", f"registering the whole arena ({_gib(total)}) FAILED ({why}); {slices} slices "
                     f"pinned ({_gib(self.pinned_bytes)}), the rest copied from pageable memory; the pinned budget "
                     f"is exhausted, so optional page-locked users keep to the floor")

    def close(self) -> None:
        """Unlock everything pinned."""
        if self.allocator is not None:
            for b in self.buffers:
                self.allocator.free(b)
        self.buffers.clear()
        self.pinned_rows[:] = False


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB"
