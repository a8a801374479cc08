"""What a backend hands the core (API 2.0): the Backend, its probe result, its Device objects and their sessions.

After ggml-backend's reg / device / buffer split:
- `Backend`: what is installed (name, vendor, the api version it was written against, how to install it, a probe
  that never raises). Discovery is the only thing the core asks a Backend.
- `Device`: one device the probe found. Everything about that device is asked of the object itself: its facts
  (`info`), its platform rules (`platform_defaults(host)`) and `open(plan)`, which returns the `DeviceSession` the
  runtime drives. No per-device question is broadcast to every plugin.
- `DeviceSession`: device memory, the pinned allocator (charging the plan's budget), streams and events, the
  primitive kernels and the layer ops.
Device arrays are the backend's own objects (numpy arrays for cpu and sim, cupy arrays, USM buffers); the core
never looks inside them, it only passes them between `DeviceMemory` and the kernels.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

import numpy as np

from strata_core.api.facts import DeviceInfo, HostInfo, PlatformDefaults

if TYPE_CHECKING:  # the contract names these types; it imports nothing of the runtime or the planner
    from strata_core.api.kernels import KernelSet, LayerOps


@runtime_checkable
class Device(Protocol):
    """One device of a backend (versionadded 2.0).

    A device that stands for a whole simulated machine (the built-in sim with a profile) may also carry
    `simulated_host: HostInfo | None`; the registry's Target then plans with that host instead of this one.
    """

    #: The device's facts: what the planner reads.
    info: DeviceInfo

    def platform_defaults(self, host: HostInfo) -> PlatformDefaults:
        """This device's platform rules on `host` (chunk ceiling, reserves, pin caps, ...); never raises."""

    def open(self, plan: Any) -> "DeviceSession":
        """Start a session on this device for a proven plan: memory, pinned allocator, streams, kernels."""


@dataclass
class DeviceSession:
    """What the runtime drives on one device for one plan (versionadded 2.0).

    `pinned` is None when the device offers no page-locked memory (every copy is then pageable, said in one line).
    `layer_ops` is None when the backend relies on the core's composition of its primitive kernels.
    """

    memory: "DeviceMemory"
    kernels: "KernelSet"
    budget: "PinnedBudget"
    pinned: "PinnedAllocator | None" = None
    layer_ops: "LayerOps | None" = None
    closers: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        """Release what the backend holds for this session (idempotent)."""
        while self.closers:
            self.closers.pop()()


@dataclass(frozen=True)
class FactsOnlyDevice:
    """A device known only by its facts (a profile or a scenario from another machine): it plans, it cannot open."""

    info: DeviceInfo
    defaults: PlatformDefaults = field(default_factory=PlatformDefaults)

    def platform_defaults(self, host: HostInfo) -> PlatformDefaults:
        """The defaults this device was described with."""
        return self.defaults

    def open(self, plan: Any) -> "DeviceSession":
        """A device of another machine cannot be opened here."""
        from strata_core.errors import BadInput
        raise BadInput(f"device '{self.info.name}' ({self.info.backend}) is described by a profile, not present here")


@dataclass(frozen=True)
class ProbeResult:
    """What a probe found: available or not, why not, the Device objects, a selection score (higher wins)."""

    available: bool
    reason: str = ""
    devices: tuple[Device, ...] = ()
    score: int = 0
    version: str = ""
    #: The install line that fixes this outcome: None means the Backend's `install_hint`; "" means no install does
    #: (the library is there, the device is not), so none is shown (versionadded 2.0).
    install_hint: str | None = None

    @classmethod
    def unavailable(cls, reason: str, version: str = "", install_hint: str | None = None) -> "ProbeResult":
        """A probe result for a backend that cannot run here, with the reason (and the install line that fixes it)."""
        return cls(available=False, reason=reason, devices=(), score=0, version=version, install_hint=install_hint)

    def hint_for(self, backend: "Backend") -> str:
        """The install line to show beside this result: none when available, else this result's or the backend's."""
        if self.available:
            return ""
        return backend.install_hint if self.install_hint is None else self.install_hint


@dataclass(frozen=True)
class Backend:
    """A backend as a plugin provides it. `probe` must never raise; the core guards it anyway.

    `api_version` is required (versionchanged 2.0: it had a default, so a plugin that left it out always passed).
    `describe(info)` turns facts from a profile or scenario of this backend into a Device that can plan (its
    `open` may refuse); None means the core plans such facts with its own PlatformDefaults.
    """

    name: str
    vendor: str
    probe: Callable[[], ProbeResult]
    api_version: str
    version: str = ""
    install_hint: str = ""
    description: str = ""
    describe: Callable[[DeviceInfo], Device] | None = None


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

    @classmethod
    def for_plan(cls, plan: Any) -> "PinnedBudget":
        """The budget a session charges for a proven plan: its page-locked limit and the floor kept for the runtime."""
        return cls(plan.pinned.limit_bytes, plan.pinned.floor_bytes)

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
    """Device memory, copy streams and events of one device (and, optionally, `view`: see DeviceMemoryViews)."""

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


@runtime_checkable
class DeviceMemoryViews(Protocol):
    """What a DeviceMemory may add (versionadded 2.0, optional): typed views, so every buffer is carved from a region.

    The runtime looks for `view` on the DeviceMemory (a backend without it still works: its buffers are then
    allocated per use, outside the plan's regions, and the run reports that as a fallback).
    """

    def view(self, base: Any, offset_bytes: int, shape: tuple[int, ...], dtype: Any) -> Any:
        """A [shape] dtype array over bytes [offset_bytes, offset_bytes + size) of the contiguous device array base."""
