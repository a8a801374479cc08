"""The sim device's memory and page-locked allocator: every byte counted against simulated capacities.

Real mode hands out numpy arrays, so a run on sim computes the same numbers as the cpu backend. Accounting-only
mode hands out `PhantomArray`s (a shape, a dtype, a byte count, no memory behind them) so `strata simulate` can
replay a 24 GiB card's plan on a laptop. Faults (`strata_core.builtin.sim.faults`) refuse allocations where a real
platform would.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from strata_core.api.backend import PinnedBudget, PinnedBuffer
from strata_core.phantom import PhantomArray
from strata_core.builtin.sim.faults import FaultPlan

#: Simulated host<->device copy bandwidth (a PCIe 4.0 x16 link's order of magnitude), bytes per second.
SIM_COPY_BYTES_PER_S = 25_000_000_000


def _size_of(shape: Any) -> int:
    if np.isscalar(shape):
        return int(shape)
    return int(np.prod([int(n) for n in shape], dtype=np.int64))


def _poisoned(shape: Any, dtype: Any) -> np.ndarray:
    """A fresh array full of values no correct computation reads before writing (NaN, or the dtype's maximum)."""
    dt = np.dtype(dtype)
    if dt.kind in "fc":
        return np.full(shape, np.nan, dtype=dt)
    if dt.kind in "iu":
        return np.full(shape, np.iinfo(dt).max, dtype=dt)
    return np.zeros(shape, dtype=dt)


@dataclass(frozen=True)
class SimStream:
    """A nominal stream: sim work is synchronous, the id only tells streams apart in traces."""

    id: int


@dataclass(frozen=True)
class SimEvent:
    """A nominal event."""

    id: int


class SimDeviceMemory:
    """DeviceMemory of a simulated device of `capacity_bytes` (the free VRAM it reports at start).

    alloc returns None when an allocation would exceed the capacity or a fault refuses it; it never raises for
    lack of memory. A free of an array this device did not hand out (or handed out and got back already) raises
    ValueError: on a real device that is a double free, a bug worth stopping at.
    """

    def __init__(self, capacity_bytes: int, faults: FaultPlan | None = None, accounting_only: bool = False):
        if int(capacity_bytes) < 0:
            raise ValueError(f"capacity_bytes must not be negative, got {capacity_bytes}")
        self.capacity_bytes = int(capacity_bytes)
        self.initial_capacity_bytes = self.capacity_bytes
        self.faults = faults if faults is not None else FaultPlan()
        self.accounting_only = bool(accounting_only)
        self.used_bytes = 0
        self.peak_bytes = 0
        self.allocations = 0
        self.refusals = 0
        self.bytes_uploaded = 0
        self.bytes_downloaded = 0
        self.copy_seconds = 0.0
        self._live: dict[int, tuple[Any, int]] = {}
        self._next_id = 0
        self._lock = threading.Lock()

    # -- memory ----------------------------------------------------------------------------------------------------

    def alloc(self, shape, dtype):
        """A device array (numpy, or a PhantomArray in accounting mode), or None when it does not fit."""
        dt = np.dtype(dtype)
        nbytes = _size_of(shape) * dt.itemsize
        if nbytes < 0:
            raise ValueError(f"negative size for shape {shape}")
        refused, drop = self.faults.on_device_alloc(nbytes)
        with self._lock:
            if drop:
                self.capacity_bytes = max(0, self.capacity_bytes - drop)
            if refused or self.used_bytes + nbytes > self.capacity_bytes:
                self.refusals += 1
                return None
            try:
                arr = PhantomArray.of(shape, dt) if self.accounting_only else _poisoned(shape, dt)
            except MemoryError:  # the host backing real mode ran out: the device says no, as a real one would
                self.refusals += 1
                return None
            self.used_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.used_bytes)
            self.allocations += 1
            self._live[id(arr)] = (arr, nbytes)
            return arr

    def free(self, arr):
        """Give an array's bytes back to the device."""
        with self._lock:
            entry = self._live.pop(id(arr), None)
            if entry is None or entry[0] is not arr:
                raise ValueError("sim device: free of an array this device did not allocate, or freed twice")
            self.used_bytes -= entry[1]

    def mem_info(self):
        """(free_bytes, total_bytes) now: the capacity less what is allocated, and the capacity."""
        with self._lock:
            return max(0, self.capacity_bytes - self.used_bytes), self.capacity_bytes

    def drop_capacity(self, nbytes: int) -> None:
        """Lower the capacity now, as another process taking VRAM would (what the vram-drop fault does)."""
        with self._lock:
            self.capacity_bytes = max(0, self.capacity_bytes - int(nbytes))

    @property
    def live_allocations(self) -> int:
        """Arrays handed out and not yet freed."""
        return len(self._live)

    # -- copies ----------------------------------------------------------------------------------------------------

    def _account_copy(self, nbytes: int) -> float:
        factor = self.faults.copy_factor(nbytes)
        seconds = nbytes / SIM_COPY_BYTES_PER_S * factor
        with self._lock:
            self.copy_seconds += seconds
        return seconds

    def upload(self, dst, src, stream=None):
        """Copy host -> device (real mode) or count the bytes (accounting mode); sizes must match."""
        src_size = int(getattr(src, "size", np.asarray(src).size))
        if src_size != int(dst.size):
            raise ValueError(f"upload of {src_size} elements into a device array of {dst.size}")
        nbytes = int(dst.nbytes)
        if not self.accounting_only:
            np.copyto(dst, np.asarray(src).reshape(dst.shape), casting="same_kind")
        with self._lock:
            self.bytes_uploaded += nbytes
        self._account_copy(nbytes)

    def download(self, src, stream=None):
        """Copy device -> host: a numpy copy (real mode) or a phantom of the same shape (accounting mode)."""
        nbytes = int(src.nbytes)
        out = PhantomArray.of(src.shape, src.dtype) if self.accounting_only else np.array(src, copy=True)
        with self._lock:
            self.bytes_downloaded += nbytes
        self._account_copy(nbytes)
        return out

    def to_device(self, src):
        """Allocate and fill a device array from host data, or None when it does not fit."""
        dst = self.alloc(src.shape, src.dtype)
        if dst is None:
            return None
        self.upload(dst, src)
        return dst

    # -- streams and events (nominal: sim work is synchronous) -----------------------------------------------------

    def _new_id(self) -> int:
        with self._lock:
            self._next_id += 1
            return self._next_id

    def new_stream(self):
        """A nominal stream."""
        return SimStream(self._new_id())

    def new_event(self):
        """A nominal event."""
        return SimEvent(self._new_id())

    def record(self, event, stream):
        """Nothing to record: sim work is synchronous."""

    def wait(self, stream, event):
        """Nothing to wait for: sim work is synchronous."""

    def synchronize(self, stream=None):
        """Nothing to wait for: sim work is synchronous."""

    def counters(self) -> dict:
        """The device's byte counters, for reports and leak checks."""
        with self._lock:
            return {"capacity_bytes": self.capacity_bytes, "used_bytes": self.used_bytes,
                    "peak_bytes": self.peak_bytes, "live_allocations": len(self._live),
                    "allocations": self.allocations, "refusals": self.refusals,
                    "bytes_uploaded": self.bytes_uploaded, "bytes_downloaded": self.bytes_downloaded,
                    "copy_seconds": self.copy_seconds}

    def faults_injected(self) -> list[dict]:
        """Faults that fired on this device (shared with its pinned allocator)."""
        return self.faults.faults_injected()


class SimPinnedAllocator:
    """Page-locked host memory of a simulated host: every byte through `budget`, and an OS lock limit.

    `pinnable_bytes` is what the OS would lock in all (None: no limit). A registration the budget allows but the
    OS refuses marks the budget exhausted, as a failed whole-arena `cudaHostRegister` does on WDDM; a plain
    allocation the OS refuses just returns None. Nothing here raises for lack of memory.
    """

    kind = "sim-host"

    def __init__(self, budget: PinnedBudget, pinnable_bytes: int | None, faults: FaultPlan | None = None,
                 accounting_only: bool = False):
        self.budget = budget
        self.pinnable_bytes = None if pinnable_bytes is None else int(pinnable_bytes)
        self.faults = faults if faults is not None else FaultPlan()
        self.accounting_only = bool(accounting_only)
        self.locked_bytes = 0
        self.peak_locked_bytes = 0
        self.failures = 0
        self._lock = threading.Lock()

    def _os_take(self, nbytes: int) -> bool:
        with self._lock:
            if self.pinnable_bytes is not None and self.locked_bytes + nbytes > self.pinnable_bytes:
                return False
            self.locked_bytes += nbytes
            self.peak_locked_bytes = max(self.peak_locked_bytes, self.locked_bytes)
            return True

    def _fail(self, nbytes: int, budget_taken: bool) -> None:
        if budget_taken:
            self.budget.give(nbytes)
        with self._lock:
            self.failures += 1

    @property
    def os_left_bytes(self) -> int | None:
        """Bytes the OS would still lock (None: no limit)."""
        with self._lock:
            return None if self.pinnable_bytes is None else self.pinnable_bytes - self.locked_bytes

    def alloc(self, nbytes, from_floor=False):
        """nbytes of page-locked memory through the budget, or None (budget, OS limit or an injected fault)."""
        nbytes = int(nbytes)
        if nbytes < 0:
            return None
        refused = self.faults.on_pinned_alloc(nbytes)
        if not self.budget.take(nbytes, from_floor=from_floor):
            self._fail(nbytes, budget_taken=False)
            return None
        if refused or not self._os_take(nbytes):
            self._fail(nbytes, budget_taken=True)
            return None
        try:
            arr = PhantomArray.of((nbytes,), np.uint8) if self.accounting_only else np.empty(nbytes, dtype=np.uint8)
        except MemoryError:
            self._os_give(nbytes)
            self._fail(nbytes, budget_taken=True)
            return None
        return PinnedBuffer(array=arr, nbytes=nbytes, kind="alloc", from_floor=from_floor)

    def register(self, array, from_floor=False):
        """Page-lock existing memory in place through the budget, or None; an OS refusal marks the budget exhausted."""
        nbytes = int(array.nbytes)
        refused = self.faults.on_register(nbytes)
        if not self.budget.take(nbytes, from_floor=from_floor):
            self._fail(nbytes, budget_taken=False)
            return None
        if refused or not self._os_take(nbytes):
            left = self.os_left_bytes
            self._fail(nbytes, budget_taken=True)
            why = "an injected fault" if refused else f"{left} bytes left to lock"
            self.budget.mark_exhausted(f"registering {nbytes} bytes in place FAILED (out of memory; {why})")
            return None
        view = array.reshape(-1).view(np.uint8)
        return PinnedBuffer(array=view, nbytes=nbytes, kind="register", from_floor=from_floor)

    def _os_give(self, nbytes: int) -> None:
        with self._lock:
            self.locked_bytes -= nbytes
            assert self.locked_bytes >= 0, "sim host unlocked more than it locked"

    def free(self, buf):
        """Unlock a buffer and give its bytes back to the budget (idempotent)."""
        with self._lock:
            if buf.freed:
                return
            buf.freed = True
        self._os_give(buf.nbytes)
        self.budget.give(buf.nbytes)

    def faults_injected(self) -> list[dict]:
        """Faults that fired (shared with the sim device's memory when they share a plan)."""
        return self.faults.faults_injected()
