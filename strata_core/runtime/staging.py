"""Copy staging: page-locked slots that pageable experts pass through, so their copies to the device can run async.

Experts the arena could not pin are copied from pageable memory, which a copy engine cannot read on its own: the
backend stages them synchronously. With a staging buffer from the pinned floor (after the CPU share has taken its
part), the host copies the expert into a page-locked slot and the device copy runs on the copy stream while the
device computes. The buffer is sized once, for the widest half-ring the plan's loans need; when it cannot be had,
one line says so and misses are copied from pageable memory, as before.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from strata_core.runtime.pinned import PinnedPool
from strata_core.runtime.runlog import RunLog
from strata_core.runtime.store import ExpertStore

BUFFER = "copy staging"


class CopyStaging:
    """A ring of page-locked expert slots; the host reuses a slot only after the copy stream has drained."""

    def __init__(self, store: ExpertStore, pool: PinnedPool, log: RunLog, slots: int):
        self.store = store
        self.pool = pool
        self.log = log
        self.slots = 0
        self._next = 0
        self._layout: list[tuple[str, int, tuple[int, ...], np.dtype]] = []
        if slots <= 0 or store.pinned_fraction >= 1.0:
            return  # nothing pageable to stage, or no ring
        if pool.reserve(BUFFER, slots * store.row_bytes, say=False) is None:
            log.fallback("copy staging", f"{slots} page-locked staging slots ({slots * store.row_bytes / (1 << 20):.1f}"
                         f" MiB) could not be had ({pool.last_failure}); misses are copied from pageable memory")
            return
        self.slots = int(slots)
        offset = 0
        for name, arr in store.pool.arrays.items():
            shape, dtype = tuple(arr.shape[1:]), np.dtype(arr.dtype)
            self._layout.append((name, offset, shape, dtype))
            offset += int(np.prod(shape, dtype=np.int64)) * dtype.itemsize

    @property
    def enabled(self) -> bool:
        """True when pageable experts go through page-locked staging."""
        return self.slots > 0

    def stage(self, row: int, drain: Any) -> dict[str, Any] | None:
        """The expert of `row` copied into the next staging slot (name -> page-locked view); None when not staged.

        `drain()` blocks until the copy stream is idle; it is called when the ring of staging slots wraps, so a slot
        is never overwritten under a copy still reading it.
        """
        if not self.enabled or self.store.pinned_rows[row]:
            return None
        buf = self.pool.buffers[BUFFER].array
        if not hasattr(buf, "__getitem__"):
            return None  # accounting-only phantom: nothing to copy
        if self._next == self.slots:
            drain()
            self._next = 0
        base = self._next * self.store.row_bytes
        self._next += 1
        out = {}
        src = self.store.expert(row)
        for name, offset, shape, dtype in self._layout:
            n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            view = buf[base + offset: base + offset + n].view(dtype).reshape(shape)
            np.copyto(view, src[name])
            out[name] = view
        return out
