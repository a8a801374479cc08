"""What a backend hands the core: the Backend itself, its probe result, and the three objects the runtime drives.

Three different things with small interfaces (after ggml-backend's reg / device / buffer-type split):
- `Backend`: what is installed (name, vendor, api version, how to install it, a probe that never raises);
- `DeviceInfo` (facts.py): one device the probe found;
- `PinnedAllocator` / `DeviceMemory`: what memory kinds that device offers; `KernelSet`: what it computes.
Device arrays are the backend's own objects (numpy arrays for cpu and sim, cupy arrays, USM buffers); the core
never looks inside them, it only passes them between `DeviceMemory` and `KernelSet`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

import numpy as np

from strata_core.api import API_VERSION
from strata_core.api.facts import DeviceInfo


@dataclass(frozen=True)
class ProbeResult:
    """What a probe found: available or not, why not, the devices, a selection score (higher wins)."""

    available: bool
    reason: str = ""
    devices: tuple[DeviceInfo, ...] = ()
    score: int = 0
    version: str = ""

    @classmethod
    def unavailable(cls, reason: str, version: str = "") -> "ProbeResult":
        """A probe result for a backend that cannot run here, with the reason."""
        return cls(available=False, reason=reason, devices=(), score=0, version=version)


@dataclass(frozen=True)
class Backend:
    """A backend as a plugin provides it. `probe` must never raise; the core guards it anyway."""

    name: str
    vendor: str
    probe: Callable[[], ProbeResult]
    version: str = ""
    api_version: str = API_VERSION
    install_hint: str = ""
    description: str = ""


class PinnedBudget:
    """Every page-locked byte goes through one budget: `take` before locking, `give` after unlocking.

    `exhausted` is set when the platform refused a lock the budget allowed (a failed whole-arena registration),
    the strongest evidence that no more page-locked memory is to be had; later optional users read it and stand down.
    """

    def __init__(self, limit_bytes: int, floor_bytes: int = 0):
        self.limit_bytes = int(limit_bytes)
        self.floor_bytes = int(floor_bytes)
        self.used_bytes = 0
        self.peak_bytes = 0
        self.exhausted = False
        self.exhausted_reason = ""
        self._lock = threading.Lock()

    def take(self, nbytes: int, from_floor: bool = False) -> bool:
        """Reserve nbytes; the arena (from_floor=False) may not eat into the floor. False when it does not fit."""
        nbytes = int(nbytes)
        with self._lock:
            cap = self.limit_bytes if from_floor else self.limit_bytes - self.floor_bytes
            if nbytes < 0 or self.used_bytes + nbytes > cap:
                return False
            self.used_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.used_bytes)
            return True

    def give(self, nbytes: int) -> None:
        """Return nbytes taken earlier."""
        with self._lock:
            self.used_bytes -= int(nbytes)
            assert self.used_bytes >= 0, "pinned budget returned more than it lent"

    def mark_exhausted(self, why: str) -> None:
        """Record that the platform refused page-locked memory the budget allowed."""
        self.exhausted = True
        self.exhausted_reason = why

    @property
    def left_bytes(self) -> int:
        """Bytes still available, floor included."""
        return self.limit_bytes - self.used_bytes


@dataclass
class PinnedBuffer:
    """Page-locked host memory: a uint8 numpy view of `nbytes`, how it was obtained, and the handle to release it."""

    array: np.ndarray
    nbytes: int
    kind: str  # "alloc" (allocated page-locked) or "register" (existing memory locked in place)
    handle: Any = None
    from_floor: bool = False
    freed: bool = field(default=False)


@runtime_checkable
class PinnedAllocator(Protocol):
    """Page-locked host memory for one device. Lack of memory returns None; it never raises for it."""

    kind: str  # "cuda-host", "hip-host", "usm-host", "cl-host", "numpy" ...

    def alloc(self, nbytes: int, from_floor: bool = False) -> PinnedBuffer | None:
        """Allocate nbytes of page-locked memory through the budget, or None."""

    def register(self, array: np.ndarray, from_floor: bool = False) -> PinnedBuffer | None:
        """Page-lock existing host memory in place through the budget, or None."""

    def free(self, buf: PinnedBuffer) -> None:
        """Release a buffer and give its bytes back to the budget (idempotent)."""


@runtime_checkable
class DeviceMemory(Protocol):
    """Device memory, copy streams and events of one device."""

    def alloc(self, shape: tuple[int, ...], dtype: Any) -> Any | None:
        """A device array, or None when the device has no room (never raises for lack of memory)."""

    def free(self, arr: Any) -> None:
        """Release a device array."""

    def upload(self, dst: Any, src: np.ndarray, stream: Any = None) -> None:
        """Copy host -> device; asynchronous on `stream` when `src` is page-locked."""

    def download(self, src: Any, stream: Any = None) -> np.ndarray:
        """Copy device -> host and return the host array (synchronous with respect to the caller)."""

    def to_device(self, src: np.ndarray) -> Any:
        """Allocate and fill a device array from host data (synchronous)."""

    def new_stream(self) -> Any:
        """A new stream (a queue of copies and kernels)."""

    def new_event(self) -> Any:
        """A new event."""

    def record(self, event: Any, stream: Any) -> None:
        """Record `event` on `stream`."""

    def wait(self, stream: Any, event: Any) -> None:
        """Make `stream` wait until `event` has completed."""

    def synchronize(self, stream: Any = None) -> None:
        """Block the host until `stream` (or the whole device) is idle."""

    def mem_info(self) -> tuple[int, int]:
        """(free_bytes, total_bytes) of the device now."""
