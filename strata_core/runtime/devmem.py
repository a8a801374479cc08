"""Device memory from the plan only: the regions the runtime takes at start, and the arenas buffers are carved from.

At start the engine takes one region per plan line (the expert cache pool, the dense weights, the workspace, owned
prompt buffers, KV when the plan has it) through `PlanMemory`, then seals it. Where the plan has the driver's
rounding line (a backend that measured its allocation granularity), those regions are carved from one block taken
first (`reserve`): the driver then rounds one allocation, which that line plans, instead of every array. While serving, every buffer is a view
carved from an `Arena` over those regions (the workspace region, a loan's buffer slots of the cache pool): an
allocation after the seal is outside the plan. In strict mode (tests) it raises `OutsidePlan`; in a run it is
refused (None, as a device with no room would answer) and reported once as a fallback.

The measured peak comes from the backend itself where it keeps one (`peak_bytes`: the sim's ledger, a pool's
high-water), else from the driver's free-memory figure sampled around the run (`mem_info`), else (host memory, the
cpu backend) from the high-water of the regions the runtime allocated through it.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from strata_core.errors import StrataError

#: Carved views start on this byte boundary (OpenCL sub-buffers want the device's base alignment; 256 covers it).
ALIGN_BYTES = 256


class OutsidePlan(StrataError):
    """An allocation after start-up: outside every region of the plan (a bug; raised in strict mode)."""


class DeviceFull(StrataError):
    """The device refused an allocation the request cannot run without."""


def _align(n: int) -> int:
    return -(-int(n) // ALIGN_BYTES) * ALIGN_BYTES


def nbytes_of(shape: tuple[int, ...], dtype: Any) -> int:
    """Bytes of an array of this shape and dtype."""
    n = np.dtype(dtype).itemsize
    for d in shape:
        n *= int(d)
    return n


def byte_view(dm: Any, arr: Any) -> Any | None:
    """A flat uint8 view of a contiguous device array (the backend's `as_bytes`, else numpy-style), or None."""
    f = getattr(dm, "as_bytes", None)
    if f is not None:
        return f(arr)
    try:
        v = arr.reshape(-1).view(np.uint8)
        return v if int(v.nbytes) == int(arr.nbytes) else None
    except (AttributeError, TypeError, ValueError, NotImplementedError):
        return None


def typed_view(dm: Any, base: Any, offset_bytes: int, shape: tuple[int, ...], dtype: Any, view: Any = False) -> Any:
    """A [shape] dtype view of bytes [offset, offset + size) of a flat uint8 device array.

    `view`: the backend's DeviceMemory.view (None: it has none), when the caller looked it up already.
    """
    f = getattr(dm, "view", None) if view is False else view
    if f is not None:
        return f(base, offset_bytes, shape, dtype)
    n = nbytes_of(shape, dtype)
    return base[offset_bytes:offset_bytes + n].view(dtype).reshape(shape)


class Arena:
    """A Workspace over extents of plan memory (flat uint8 device views): first-fit bump carving, marks, reset.

    `sizes` alone (no device views) makes a dry arena that only computes where carves would land (loan sizing).
    """

    def __init__(self, dm: Any, extents: list[Any] | None = None, sizes: list[int] | None = None):
        self.dm = dm
        self.extents = list(extents or [])
        self.sizes = [int(e.nbytes) for e in self.extents] if sizes is None else [int(s) for s in sizes]
        self.used = [0] * len(self.sizes)
        self._base: tuple[int, ...] = tuple(self.used)
        self.high_water_bytes = 0
        self._view = getattr(dm, "view", None) if dm is not None else None

    @property
    def capacity_bytes(self) -> int:
        """Bytes of all extents."""
        return sum(self.sizes)

    def _place(self, n: int) -> tuple[int, int] | None:
        for i, size in enumerate(self.sizes):
            off = _align(self.used[i])
            if off + n <= size:
                return i, off
        return None

    def fits(self, n: int) -> bool:
        """Would a carve of n bytes land now?"""
        return self._place(int(n)) is not None

    def carve(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """A device view of this shape from the first extent with room; DeviceFull when none has."""
        n = nbytes_of(shape, dtype)
        at = self._place(n)
        if at is None:
            raise DeviceFull(f"the plan's buffers have no room for {n} bytes ({shape} {np.dtype(dtype).name}; "
                             f"{self.capacity_bytes - sum(self.used)} of {self.capacity_bytes} bytes left, fragmented)")
        i, off = at
        self.used[i] = off + n
        if not self.extents:
            self.high_water_bytes = max(self.high_water_bytes, sum(self.used))
            return None
        return typed_view(self.dm, self.extents[i], off, shape, dtype, self._view)

    def mark(self) -> tuple[int, ...]:
        """Where every extent stands now (release to it later)."""
        return tuple(self.used)

    def release(self, mark: tuple[int, ...]) -> None:
        """Release everything carved since `mark`."""
        self.used = list(mark)

    def fix(self) -> None:
        """Make the present carves permanent for this arena's life: `reset` releases only what comes after."""
        self._base = self.mark()

    def reset(self) -> None:
        """Release every view carved since `fix` (between layers)."""
        self.used = list(self._base)

    def replay(self, steps: list) -> bool:
        """Replay a layer's carve steps ((shape, dtype) or "fix" / "mark" / "release" / "reset", as LayerOps'
        worst_carves lists them) on this arena: whether every carve lands (False at the first that does not)."""
        mark = self.mark()
        try:
            for step in steps:
                if step == "fix":
                    self.fix()
                elif step == "mark":
                    mark = self.mark()
                elif step == "release":
                    self.release(mark)
                elif step == "reset":
                    self.reset()
                else:
                    self.carve(*step)
        except DeviceFull:
            return False
        return True


class HeapArena:
    """The Arena of a backend that cannot view its arrays: every carve is an allocation, freed on release/reset.

    Its buffers are outside the plan's regions; the runtime says so once, as a fallback, when it has to use one.
    """

    def __init__(self, dm: Any):
        self.dm = dm
        self._live: list = []
        self._base = 0
        self.high_water_bytes = 0
        self._bytes = 0

    def carve(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """A fresh device array; DeviceFull when the device refuses it."""
        a = self.dm.alloc(tuple(int(s) for s in shape), dtype)
        if a is None:
            raise DeviceFull(f"the device refused {nbytes_of(shape, dtype)} bytes of buffers")
        self._live.append(a)
        self._bytes += int(a.nbytes)
        self.high_water_bytes = max(self.high_water_bytes, self._bytes)
        return a

    def mark(self) -> int:
        """How many buffers are live now."""
        return len(self._live)

    def release(self, mark: int) -> None:
        """Free the buffers carved since `mark`."""
        while len(self._live) > mark:
            a = self._live.pop()
            self._bytes -= int(a.nbytes)
            self.dm.free(a)

    def fix(self) -> None:
        """Keep the present buffers for the arena's life."""
        self._base = len(self._live)

    def reset(self) -> None:
        """Free every buffer carved since `fix`."""
        self.release(self._base)

    def close(self) -> None:
        """Free everything, the fixed buffers too."""
        self.release(0)


def can_view(dm: Any, region: Any) -> bool:
    """Can typed views be carved from this flat region on this backend?"""
    try:
        v = typed_view(dm, region, 0, (1,), np.float32)
        return v is not None and int(v.nbytes) == 4
    except Exception:  # a backend whose arrays have no dtype views (no DeviceMemory.view)
        return False


class PlanMemory:
    """Forwards to a backend's DeviceMemory; takes the plan's regions at start and refuses allocations after `seal`.

    `strict` (tests): an allocation after the seal raises OutsidePlan. Otherwise it is refused (None) and
    `on_outside(what, why)` is told once per kind of buffer, so the run reports it as a fallback.
    """

    def __init__(self, inner: Any, strict: bool = False, on_outside: Callable[[str, str], None] | None = None):
        self.inner = inner
        self.strict = bool(strict)
        self.on_outside = on_outside
        self.sealed = False
        self.live_bytes = 0
        self.peak_bytes = 0
        self.regions: dict[str, int] = {}
        self.refused: dict[str, int] = {}
        self._sizes: dict[int, int] = {}
        self._region = "unnamed"
        self._used0 = self._device_used()
        self._sampled_peak = 0
        self._samples = True  # until the seal decides whether the backend's own figure makes sampling moot
        self._block: Any = None
        self._block_used = 0
        self._carves: list[list] = []  # [end offset, freed] of each array carved from the block, in order
        self._carved: dict[int, int] = {}  # id(array) -> its index in _carves
        # the calls of every layer go straight to the backend (no __getattr__ on the hot path)
        for name in ("upload", "download", "new_stream", "new_event", "record", "wait", "synchronize"):
            f = getattr(inner, name, None)
            if f is not None:
                setattr(self, name, f)

    # --- regions -------------------------------------------------------------------------------------------

    def region(self, name: str) -> "PlanMemory":
        """Count the allocations that follow under the plan line `name` (until the next call)."""
        self._region = name
        self.regions.setdefault(name, 0)
        return self

    def take(self, name: str, nbytes: int) -> Any | None:
        """One flat uint8 region of nbytes for the plan line `name` (None when the device refuses it)."""
        self.region(name)
        return self.alloc((max(1, int(nbytes)),), np.uint8) if nbytes > 0 else None

    def reserve(self, nbytes: int) -> bool:
        """Take one device block of nbytes for the start-up lines: until the seal, alloc and to_device carve their
        arrays from it. False (each array its own allocation, as before) when the device refuses it."""
        if self.sealed or self._block is not None or int(nbytes) <= 0:
            return False
        block = self.inner.alloc((int(nbytes),), np.uint8)
        if block is None:
            return False
        self._block, self._block_used = block, 0
        return True

    @property
    def block_bytes(self) -> int:
        """Bytes of the start-up block (0: none was taken)."""
        return 0 if self._block is None else int(self._block.nbytes)

    def _carve(self, shape: tuple[int, ...], dtype: Any) -> Any | None:
        """An array carved from the start-up block, or None when there is none or it has no room left."""
        if self._block is None:
            return None
        n = nbytes_of(shape, dtype)
        off = _align(self._block_used)
        if off + n > int(self._block.nbytes):
            return None
        arr = typed_view(self.inner, self._block, off, shape, dtype)
        self._block_used = off + n
        self._carved[id(arr)] = len(self._carves)
        self._carves.append([off + n, False])
        return arr

    def _uncarve(self, arr: Any) -> None:
        """Give a carved array's bytes back: the block's end moves back over the freed arrays at its top."""
        i = self._carved.pop(id(arr), None)
        if i is None:
            return
        self._carves[i][1] = True
        while self._carves and self._carves[-1][1]:
            self._carves.pop()
        self._block_used = self._carves[-1][0] if self._carves else 0
        if not self._carves and self.sealed:
            self._block = None  # every array is freed after start-up: the block goes back with them

    def seal(self) -> None:
        """Start-up is over: from now on every buffer is carved from a region."""
        self.sealed = True
        self.sample()
        self._samples = self._measure_kind() == "sampled"

    def allow_outside(self, why: str) -> None:
        """Let allocations after the seal through (a backend that cannot carve views), said once as a fallback."""
        self.sealed = False
        self.region("outside_plan_total")  # every per-use allocation from here on, summed (not a live figure)
        # the regions taken at the seal were given back: the peak is what is held from here on
        self._sampled_peak = 0
        self.sample()
        if self.on_outside is not None:
            self.on_outside("device memory (regions)", why)

    def _outside(self, nbytes: int, what: str) -> None:
        why = f"{nbytes} bytes for {what} asked after start-up, outside the plan's regions"
        if self.strict:
            raise OutsidePlan(why)
        first = what not in self.refused
        self.refused[what] = self.refused.get(what, 0) + 1
        if first and self.on_outside is not None:
            self.on_outside(f"device memory ({what})", f"{why}: refused")

    def _count(self, arr: Any) -> Any:
        if arr is not None:
            n = int(arr.nbytes)
            self._sizes[id(arr)] = n
            self.live_bytes += n
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            self.regions[self._region] = self.regions.get(self._region, 0) + n
        return arr

    # --- DeviceMemory --------------------------------------------------------------------------------------

    def alloc(self, shape, dtype):
        """A device array through the backend (start-up only), counted under the current region."""
        if self.sealed:
            self._outside(nbytes_of(tuple(np.atleast_1d(shape)), dtype), "an array")
            return None
        carved = self._carve(tuple(int(d) for d in np.atleast_1d(shape)), dtype)
        return self._count(carved if carved is not None else self.inner.alloc(shape, dtype))

    def to_device(self, src):
        """Allocate and fill through the backend (start-up only), counted under the current region."""
        if self.sealed:
            self._outside(int(src.nbytes), "a host array's copy")
            return None
        src = np.asarray(src)
        carved = self._carve(tuple(src.shape), src.dtype)
        if carved is None:
            return self._count(self.inner.to_device(src))
        self.inner.upload(carved, src)
        self.inner.synchronize()
        return self._count(carved)

    def free(self, arr):
        """Release an array this wrapper handed out."""
        n = self._sizes.pop(id(arr), None)
        if n is not None:
            self.live_bytes -= n
            if id(arr) in self._carved:
                self._uncarve(arr)
            else:
                self.inner.free(arr)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    # --- measurement ---------------------------------------------------------------------------------------

    def _device_used(self) -> int | None:
        try:
            free, total = self.inner.mem_info()
            return int(total) - int(free)
        except Exception:  # a backend without mem_info: no driver figure
            return None

    def sample(self) -> None:
        """Read the driver's used-memory figure now (between chunks and steps) and keep its high-water."""
        if not self._samples:
            return
        used = self._device_used()
        if used is not None and self._used0 is not None:
            self._sampled_peak = max(self._sampled_peak, used - self._used0)

    def _measure_kind(self) -> str:
        f = getattr(self.inner, "peak_bytes", None)
        if callable(f):
            return "method"
        if isinstance(f, (int, np.integer)):
            return "ledger"
        if not hasattr(self, "_host"):
            self._host = _host_arrays(self.inner)
        return "host" if self._host else "sampled"

    def peak_measured(self) -> tuple[int, str]:
        """(peak device bytes, where the figure comes from), from the backend itself where it can say."""
        kind = self._measure_kind()
        if kind == "method":
            return int(self.inner.peak_bytes()), "the backend's own peak_bytes()"
        if kind == "ledger":
            return int(self.inner.peak_bytes), "the backend's ledger (peak_bytes)"
        if kind == "host":
            return self.peak_bytes, "host memory: high-water of the numpy arrays allocated through DeviceMemory"
        self.sample()
        return self._sampled_peak, "the driver's used memory (mem_info), sampled between chunks and steps"


def _host_arrays(inner: Any) -> bool:
    """Does this DeviceMemory hand out numpy arrays (the cpu backend: device memory is host RAM)?"""
    try:
        a = inner.alloc((1,), np.uint8)
    except Exception:
        return False
    ok = isinstance(a, np.ndarray)
    if a is not None:
        inner.free(a)
    return ok


#: The name the runtime used before regions (kept for imports).
CountingMemory = PlanMemory
