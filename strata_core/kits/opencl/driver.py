"""The vendor-neutral half of the backends that run moe.cl: the Backend and its Device objects (API 2.0), the
KernelSet, device memory and pinned host memory expressed over a few primitives that each backend supplies (launch a
kernel, allocate, copy, record and wait).

The in-tree sycl backend (dpctl) and the opencl plugin (pyopencl) run the same OpenCL C source under the same
KernelSet contract (strata_core.reference.kernels), so everything but the vendor calls lives here once: the backend
object that wraps a probe's facts into devices and opens their sessions, host-side argument checks and uploads, the
`out=` buffers, the tiled/plain and reduction launch geometry, the array wrapper's views (`DeviceMemory.view`, so
the runtime carves every buffer from the plan's regions), the allocation count and ledger (`peak_bytes`: the
measured device peak), the pinned-memory budget accounting, the sessions' queue bookkeeping, where intel-opencl-rt
put its library, and device types and scores.

This module imports no vendor library and reads no environment: a backend subclasses these classes and passes in
its session (any object with `device`, `queue`, `lock` and `allocated_bytes`) and whatever paths it needs.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from strata_core.api import (Backend, DeviceInfo, DeviceSession, DeviceType, HostInfo, PinnedBudget, PinnedBuffer,
                             PlatformDefaults, ProbeResult, hookimpl)
from strata_core.errors import BadInput, StrataError
from strata_core.kits.opencl import kernel_source
from strata_core.reference.kernels import QK8_0, ExpertPool
from strata_core.reference.quants import GGML_TYPES as GGML_TYPE_IDS

__all__ = ["EXPERT_FORMATS", "INTEL_OCL_NAMES", "LINEAR_TILE", "DeviceArray", "EventSlot", "Local", "MoeClBackend",
           "MoeClDevice", "OpenClDeviceMemory", "OpenClKernels", "OpenClPinnedAllocator", "QueueSession",
           "QueueStream", "device_score", "device_type_of", "find_intel_opencl_runtime", "handle_alias", "round_up"]

I32_MAX = 2**31 - 1
#: Side of the square work-group of the tiled kernels (LINEAR_TILE and FFN_TILE in moe.cl).
LINEAR_TILE = 16
#: File names of Intel's OpenCL CPU runtime as the intel-opencl-rt package installs it.
INTEL_OCL_NAMES = ("libintelocl.so", "intelocl64.dll")
#: The moe.cl source every backend of this module builds.
SOURCE = "moe.cl"
#: Expert formats moe.cl's grouped FFN computes from their own bytes (OpenClKernels.moe_grouped_ffn; K and MXFP4
#: rows in 'gguf' pools, through quants.cl).
EXPERT_FORMATS = ("f16", "q8_0", "bf16", "q4_k", "q5_k", "q6_k", "mxfp4")
#: quants.cl (without its test kernel) goes before moe.cl in the one program a session builds.
PROGRAM_PRELUDE = "#define STRATA_QUANTS_NO_TEST_KERNEL\n"


def round_up(n: int, m: int) -> int:
    """n rounded up to a multiple of m."""
    return (n + m - 1) // m * m


def find_intel_opencl_runtime(prefix: str | Path) -> Path | None:
    """Intel's OpenCL CPU runtime library if the intel-opencl-rt package is installed (else under `prefix`), or None."""
    try:
        for f in md.files("intel-opencl-rt") or ():
            if f.name in INTEL_OCL_NAMES:
                p = Path(f.locate()).resolve()
                if p.is_file():
                    return p
    except md.PackageNotFoundError:
        pass
    # A conda-style install puts the library under the environment's prefix without pip's file list.
    for d in (Path(prefix) / "lib", Path(prefix) / "Library" / "bin"):
        for n in INTEL_OCL_NAMES:
            if (d / n).is_file():
                return d / n
    return None


def device_score(device: Any, discrete_gpu: int, integrated_gpu: int, accelerator: int, cpu_device: int) -> int:
    """Selection score of one DeviceInfo from a backend's four: discrete GPU, integrated GPU, accelerator, CPU device."""
    if device.arch == "gpu":
        # Unified memory is what tells an integrated GPU from a discrete card in DeviceInfo.
        return integrated_gpu if device.unified_memory else discrete_gpu
    if device.arch == "accelerator":
        return accelerator
    return cpu_device


def device_type_of(kind: str, unified_memory: bool) -> DeviceType:
    """The DeviceType of an OpenCL/SYCL device kind ('gpu', 'accelerator', 'cpu', other) and its memory model."""
    if kind == "gpu":
        return DeviceType.INTEGRATED_GPU if unified_memory else DeviceType.GPU
    if kind == "cpu":
        return DeviceType.CPU
    return DeviceType.ACCELERATOR


def _import(spec: str, package: str) -> Any:
    """The class named 'module:Class' relative to `package`, imported on first use (so a backend module imports
    without its vendor library)."""
    module, _, cls = spec.partition(":")
    return getattr(importlib.import_module(module, package), cls)


@dataclass(frozen=True)
class MoeClDevice:
    """One device of a moe.cl backend: its facts, its platform rules and `open(plan)`.

    `present` is False for a device described by a profile of another machine: it plans, it cannot open.
    """

    info: DeviceInfo
    backend: "MoeClBackend" = field(compare=False, repr=False)
    present: bool = True

    def platform_defaults(self, host: HostInfo) -> PlatformDefaults:
        """This device's platform rules on `host`, from its facts (and, for a live device, what it offers)."""
        return self.backend.defaults(self, host)

    def open(self, plan: Any) -> DeviceSession:
        """A session for a proven plan: device memory, pinned memory charging the plan's budget, moe.cl's kernels."""
        return self.backend.open(self, plan)


class MoeClBackend:
    """A backend of moe.cl (the sycl backend, the opencl plugin): its Backend, its devices and their sessions.

    A backend supplies its probe's facts (`probe`: a ProbeResult of DeviceInfo), its rules (`defaults(device,
    host)`), how a DeviceInfo finds its live session (`session_of`, raising with one line when it cannot), its
    device memory and kernel classes as 'module:Class' relative to `package`, and its pinned allocator
    (`pinned(session, budget)`, None when the device offers no page-locked memory).
    """

    def __init__(self, *, name: str, vendor: str, version: str, api_version: str, install_hint: str,
                 description: str, probe: Callable[[], ProbeResult],
                 defaults: Callable[[MoeClDevice, HostInfo], PlatformDefaults], session_of: Callable[[DeviceInfo], Any],
                 package: str, device_memory: str, kernels: str, pinned: Callable[[Any, PinnedBudget], Any]):
        self._probe_facts = probe
        self.defaults = defaults
        self.session_of = session_of
        self.package = package
        self.device_memory = device_memory
        self.kernels = kernels
        self.pinned = pinned
        self.backend = Backend(name=name, vendor=vendor, probe=self.probe, version=version, api_version=api_version,
                               install_hint=install_hint, description=description, describe=self.describe)

    def probe(self) -> ProbeResult:
        """The probe's facts with each DeviceInfo wrapped in a MoeClDevice. Never raises."""
        try:
            r = self._probe_facts()
            if not r.available:
                return r
            return ProbeResult(available=True, reason=r.reason, score=r.score, version=r.version,
                               devices=tuple(MoeClDevice(info, self) for info in r.devices))
        except Exception as e:  # the contract: a probe never raises
            return ProbeResult.unavailable(f"the {self.backend.name} probe failed: {type(e).__name__}: {e}")

    def describe(self, info: DeviceInfo) -> MoeClDevice:
        """A device of this backend known only from a profile's facts: it plans with the backend's rules."""
        return MoeClDevice(info, self, present=False)

    def open(self, device: MoeClDevice, plan: Any) -> DeviceSession:
        """The session of `device` for `plan`; device memory and kernels share the device's one vendor session."""
        info = device.info
        if not device.present:
            raise BadInput(f"{self.backend.name} device '{info.name}' (index {info.index}) comes from a profile: "
                           f"it can be planned for here, not opened")
        try:
            session = self.session_of(info)
        except StrataError:
            raise
        except Exception as e:  # a plugin's own error type (LookupError, ImportError ...): one line, not a traceback
            raise StrataError(f"{self.backend.name}: cannot open device '{info.name}' (index {info.index}): "
                              f"{e}") from None
        memory = _import(self.device_memory, self.package)(session)
        kernels = _import(self.kernels, self.package)(session, memory)
        budget = PinnedBudget(plan.pinned.limit_bytes, plan.pinned.floor_bytes)
        # the vendor session outlives this one (its program is built once per process): closing waits for its queues
        return DeviceSession(memory=memory, kernels=kernels, budget=budget, pinned=self.pinned(session, budget),
                             closers=[session.wait_all])

    @hookimpl
    def strata_backends(self) -> list[Backend]:
        """This one backend."""
        return [self.backend]


# ------------------------------------------------------------------------------------------------- runtime pieces


class QueueStream:
    """A stream of a backend: one in-order queue (an object, so a session can track its streams weakly)."""

    __slots__ = ("queue", "__weakref__")

    def __init__(self, queue: Any):
        self.queue = queue


@dataclass
class QueueSession:
    """One device's context, its default in-order queue, the queues made since, the built program, bytes allocated.

    Device memory, pinned memory and kernels of a device all come from its session, so their buffers are
    interchangeable. A subclass adds its vendor module and supplies `_new_queue` and `wait_queue`.
    """

    device: Any
    context: Any
    queue: Any
    allocated_bytes: int = 0
    streams: "weakref.WeakSet[QueueStream]" = field(default_factory=weakref.WeakSet)
    program: Any = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    #: The stream class `new_stream` wraps a queue in (a backend's subclass of QueueStream).
    stream_type = QueueStream

    def _new_queue(self) -> Any:
        raise NotImplementedError

    def wait_queue(self, queue: Any) -> None:
        """Block until one queue of this session is idle."""
        raise NotImplementedError

    def new_stream(self) -> QueueStream:
        """A stream: a new in-order queue on this session's context."""
        s = self.stream_type(self._new_queue())
        self.streams.add(s)
        return s

    def wait_all(self) -> None:
        """Block until every queue of the session is idle."""
        self.wait_queue(self.queue)
        for s in list(self.streams):
            self.wait_queue(s.queue)


class EventSlot:
    """An event slot: `record` fills it with a marker of a queue; None until then. Subclasses say when one is done."""

    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = None

    def query_done(self) -> bool:
        """True when the recorded work has completed (or nothing was recorded)."""
        if self.event is None:
            return True
        return self._complete(self.event)

    def _complete(self, event: Any) -> bool:
        raise NotImplementedError


# ------------------------------------------------------------------------------------------------- device arrays


class DeviceArray:
    """A device array: shape, dtype and the vendor allocation (`handle`) that holds it; subclasses make views.

    Indexing the first axis (`pool[slot]`, `x[a:b]`) gives a view into the same allocation, as the runtime does to
    upload one expert into its cache slot; a view's `owner` is the array it came from.
    """

    __slots__ = ("shape", "dtype", "handle", "nbytes", "release", "owner", "__weakref__")

    def __init__(self, shape: tuple[int, ...], dtype: Any, handle: Any, owner: "DeviceArray | None" = None):
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.handle = handle
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self.release = None  # a weakref.finalize giving the bytes back to the session's count, set by alloc
        self.owner = owner

    @property
    def size(self) -> int:
        """Number of elements."""
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self.shape)

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 0

    def __getitem__(self, key) -> "DeviceArray":
        """A view of one row (int) or a contiguous run of rows (slice with step 1) of the first axis."""
        if not self.shape:
            raise IndexError("a 0-d device array cannot be indexed")
        rows = self.shape[0]
        if isinstance(key, (int, np.integer)):
            i = int(key) + (rows if key < 0 else 0)
            if not 0 <= i < rows:
                raise IndexError(f"index {int(key)} out of range for {rows} rows")
            start, stop, shape = i, i + 1, self.shape[1:]
        elif isinstance(key, slice):
            start, stop, step = key.indices(rows)
            if step != 1:
                raise IndexError("device array views take contiguous rows only (step 1)")
            stop = max(start, stop)
            shape = (stop - start,) + self.shape[1:]
        else:
            raise IndexError(f"device arrays index the first axis with an int or a slice, not {type(key).__name__}")
        row_bytes = int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize
        return self._view(shape, start * row_bytes, (stop - start) * row_bytes, self.dtype)

    def _view(self, shape: tuple[int, ...], offset_bytes: int, nbytes: int, dtype: np.dtype) -> "DeviceArray":
        """An array of `shape` and `dtype` over bytes [offset, offset + nbytes) of this one (a subclass's)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={self.shape}, dtype={self.dtype.name}{', view' if self.owner else ''})"


def handle_alias(doc: str) -> property:
    """A property naming a DeviceArray's `handle` after the vendor's object (UsmArray.mem, ClArray.buf)."""
    return property(lambda a: a.handle, lambda a, v: setattr(a, "handle", v), doc=doc)


def _uncount(session: Any, ledger: "AllocationLedger", nbytes: int) -> None:
    with session.lock:
        session.allocated_bytes -= nbytes
        ledger.live_bytes -= nbytes


class AllocationLedger:
    """Bytes of the device allocations (USM / cl buffers) one DeviceMemory made: live now, and their high-water."""

    __slots__ = ("live_bytes", "peak_bytes")

    def __init__(self) -> None:
        self.live_bytes = 0
        self.peak_bytes = 0


# ------------------------------------------------------------------------------------------------- device memory


class OpenClDeviceMemory:
    """DeviceMemory of one device over a backend's primitives: allocation count, checks and copies in one place.

    Subclasses name their `array_type` and `event_type`, supply `_allocate`, `_copy_in`, `_copy_out`, `_marker` and
    `_barrier`, and may refine `_before_free` and `_reported_free`; waiting is the session's (QueueSession).
    """

    #: The DeviceArray subclass that wraps this backend's allocations, and the EventSlot subclass of its events.
    array_type: type = DeviceArray
    event_type: type = EventSlot

    def __init__(self, session: Any):
        self.session = session
        #: Every vendor allocation this memory made (kernel temporaries included): the measured device peak.
        self.ledger = AllocationLedger()

    def _queue(self, stream: Any) -> Any:
        return self.session.queue if stream is None else stream.queue

    # -- primitives
    def _allocate(self, nbytes: int) -> Any:
        raise NotImplementedError

    def _copy_in(self, queue: Any, dst: DeviceArray, host: np.ndarray) -> None:
        raise NotImplementedError

    def _copy_out(self, queue: Any, out: np.ndarray, src: DeviceArray) -> None:
        raise NotImplementedError

    def _marker(self, queue: Any) -> Any:
        raise NotImplementedError

    def _barrier(self, queue: Any, event: Any) -> None:
        raise NotImplementedError

    def _before_free(self) -> None:
        """Hook run before an owning array's allocation is dropped (nothing by default)."""

    def _reported_free(self) -> int | None:
        """The device's own free-memory figure where the platform reports one (None by default)."""
        return None

    # -- the DeviceMemory contract
    def alloc(self, shape, dtype):
        """A device array, or None when the device has no room (never raises for lack of memory)."""
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        dev = self.session.device
        # Both runtimes back allocations lazily (a CPU device at first touch, OpenCL at first use), so an
        # over-large request would only fail later; the device's own limits are checked up front instead.
        if nbytes > dev.max_mem_alloc_size or self.session.allocated_bytes + nbytes > dev.global_mem_size:
            return None
        handle = self._allocate(max(nbytes, 1))
        if handle is None:
            return None
        led = self.ledger
        with self.session.lock:
            self.session.allocated_bytes += nbytes
            led.live_bytes += nbytes
            if led.live_bytes > led.peak_bytes:
                led.peak_bytes = led.live_bytes
        arr = self.array_type(shape, dtype, handle)
        # Arrays dropped without free() (kernel temporaries, outputs a caller let go) still leave the count.
        arr.release = weakref.finalize(arr, _uncount, self.session, led, nbytes)
        return arr

    def view(self, base, offset_bytes, shape, dtype):
        """A [shape] dtype array over bytes [offset_bytes, offset_bytes + size) of the contiguous array `base`."""
        shape = tuple(int(s) for s in shape)
        dtype = np.dtype(dtype)
        offset_bytes = int(offset_bytes)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if base.handle is None and base.nbytes:
            raise ValueError("view of a freed device array")
        if offset_bytes < 0 or offset_bytes + nbytes > base.nbytes:
            raise ValueError(f"view of bytes [{offset_bytes}, {offset_bytes + nbytes}) of a {base.nbytes}-byte array")
        if offset_bytes % dtype.itemsize:
            raise ValueError(f"a {dtype.name} view at byte {offset_bytes}: not a multiple of {dtype.itemsize}")
        return base._view(shape, offset_bytes, nbytes, dtype)

    def as_bytes(self, arr):
        """A flat uint8 view of a contiguous device array (the runtime lends cache slots as byte extents)."""
        return self.view(arr, 0, (arr.nbytes,), np.uint8)

    def peak_bytes(self) -> int:
        """High-water of the device bytes this memory allocated from the runtime (USM / cl buffers, any use)."""
        return self.ledger.peak_bytes

    def free(self, arr):
        """Release a device array (idempotent; a view frees nothing)."""
        if arr.handle is None or arr.owner is not None:
            return
        self._before_free()
        arr.handle = None
        if arr.release is not None:
            arr.release()

    def upload(self, dst, src, stream=None):
        """Copy host -> device; asynchronous on `stream` when `src` is pinned host memory, else complete on return."""
        host = np.asarray(src)
        if host.size != dst.size:
            raise ValueError(f"upload: {host.size} elements into a device array of {dst.size}")
        if host.dtype != dst.dtype or not host.flags.c_contiguous:
            host = np.ascontiguousarray(host, dtype=dst.dtype)
        if dst.nbytes == 0:
            return
        self._copy_in(self._queue(stream), dst, host)

    def download(self, src, stream=None):
        """Copy device -> host after the stream's earlier work, and return the host array."""
        out = np.empty(src.shape, dtype=src.dtype)
        if src.nbytes:
            self._copy_out(self._queue(stream), out, src)
        return out

    def to_device(self, src):
        """Allocate and fill a device array from host data (synchronous); None when the device has no room."""
        host = np.ascontiguousarray(src)
        arr = self.alloc(host.shape, host.dtype)
        if arr is not None:
            self.upload(arr, host)
        return arr

    def new_stream(self):
        """A new in-order queue on the device's context."""
        return self.session.new_stream()

    def new_event(self):
        """A new, unrecorded event."""
        return self.event_type()

    def record(self, event, stream):
        """Record on `stream`: the event completes when the stream's work submitted so far has."""
        event.event = self._marker(self._queue(stream))

    def wait(self, stream, event):
        """Make `stream`'s later work wait for `event` (a no-op for an unrecorded event)."""
        if event.event is not None:
            self._barrier(self._queue(stream), event.event)

    def synchronize(self, stream=None):
        """Block until `stream` is idle, or every queue of the device when None."""
        if stream is None:
            self.session.wait_all()
        else:
            self.session.wait_queue(stream.queue)

    def mem_info(self):
        """(free_bytes, total_bytes): the platform's free figure where reported, else the total less our allocations."""
        total = int(self.session.device.global_mem_size)
        free = total - self.session.allocated_bytes
        reported = self._reported_free()
        if reported is not None:
            free = min(free, reported)
        return max(0, free), total


# ------------------------------------------------------------------------------------------------- pinned memory


class OpenClPinnedAllocator:
    """Pinned host memory charged to a PinnedBudget; subclasses supply `_allocate_pinned` and `_release_pinned`.

    `allocates` says whether the platform can allocate pinned memory at all, `registers` whether existing memory may
    be registered (only on a CPU device, where the device's memory is host memory: registering is the budget's
    accounting alone, as the cpu backend does).
    """

    kind = "pinned"

    def __init__(self, session: Any, budget: PinnedBudget, allocates: bool, registers: bool):
        self.session = session
        self.budget = budget
        self.allocates = allocates
        self.registers = registers

    def _allocate_pinned(self, nbytes: int) -> tuple[np.ndarray, Any]:
        raise NotImplementedError

    def _release_pinned(self, buf: PinnedBuffer) -> None:
        """Give an allocated buffer back to the runtime (nothing by default: dropping the handle frees it)."""

    def alloc(self, nbytes, from_floor=False):
        """Pinned host memory of nbytes through the budget, or None (unsupported, budget or runtime says no)."""
        nbytes = int(nbytes)
        if not self.allocates or nbytes <= 0 or not self.budget.take(nbytes, from_floor=from_floor):
            return None
        try:
            array, handle = self._allocate_pinned(nbytes)
        except Exception:  # an allocator must not raise: any runtime refusal is 'no memory'
            self.budget.give(nbytes)
            return None
        return PinnedBuffer(array=array, nbytes=nbytes, kind="alloc", handle=handle, from_floor=from_floor)

    def register(self, array, from_floor=False):
        """Existing memory in place through the budget on a CPU device; None on any other device."""
        if not self.registers:
            return None
        a = np.asarray(array)
        if not a.flags.c_contiguous or a.nbytes == 0:
            return None
        nbytes = int(a.nbytes)
        if not self.budget.take(nbytes, from_floor=from_floor):
            return None
        return PinnedBuffer(array=a.reshape(-1).view(np.uint8), nbytes=nbytes, kind="register", from_floor=from_floor)

    def free(self, buf):
        """Release the pinned memory (or end a registration) and give its bytes back (idempotent)."""
        if buf.freed:
            return
        buf.freed = True
        try:
            if buf.kind != "register":
                self._release_pinned(buf)
        finally:
            buf.handle = None
            self.budget.give(buf.nbytes)


# ------------------------------------------------------------------------------------------------- kernels


class Local:
    """A __local float[floats] kernel argument."""

    __slots__ = ("floats",)

    def __init__(self, floats: int):
        self.floats = int(floats)


class OpenClKernels:
    """KernelSet over moe.cl; the contract is strata_core.reference.kernels.

    A subclass supplies `_build` (the program from the source, once per session), `_get_kernel` (one kernel of it),
    `_submit` (run kernel NAME with converted arguments over a global/local size, in OpenCL order), the argument
    conversions `_buffer_arg`, `_i32_arg`, `_i64_arg`, `_f32_arg`, `_local_arg`, and may refine `_offset_arg` (a
    device array's element offset in the buffer `_buffer_arg` gives) and `_device_input` (a device array as a kernel
    can take it). `memory_type` makes the device memory when none is given (and names the array type); `label` prefixes errors.
    """

    name = "opencl-c"
    label = "opencl"
    memory_type: type = OpenClDeviceMemory

    @property
    def array_type(self) -> type:
        """The device array class of this backend: the one its memory makes (numpy inputs are anything else)."""
        return self.memory_type.array_type

    def __init__(self, session: QueueSession, memory: OpenClDeviceMemory | None = None):
        self.session = session
        self.memory = memory or self.memory_type(session)
        self._kernels: dict[str, Any] = {}
        # One program per session: every KernelSet of a device shares it, and building moe.cl takes seconds.
        with session.lock:
            if session.program is None:
                session.program = self._build(session, PROGRAM_PRELUDE + kernel_source("quants.cl") + "\n"
                                              + kernel_source(SOURCE))
        self._program = session.program
        wg = int(session.device.max_work_group_size)
        self._reduce_local = 1 << min(6, wg.bit_length() - 1)  # a power of two <= 64 for the tree reductions
        # The tiled kernels (linear, grouped FFN) need LINEAR_TILE^2 work-items in one group; smaller devices get
        # the plain ones.
        self._tiled = wg >= LINEAR_TILE * LINEAR_TILE

    def _kernel(self, name: str) -> Any:
        k = self._kernels.get(name)
        if k is None:
            k = self._kernels[name] = self._get_kernel(name)
        return k

    # --------------------------------------------------------------------------------------------- primitives

    def _build(self, session: QueueSession, source: str) -> Any:
        raise NotImplementedError

    def _get_kernel(self, name: str) -> Any:
        raise NotImplementedError

    def _submit(self, name: str, global_size: tuple[int, ...], local_size: tuple[int, ...] | None,
                args: list[Any], keep: tuple) -> Any:
        raise NotImplementedError

    def _buffer_arg(self, a: DeviceArray) -> Any:
        raise NotImplementedError

    def _i32_arg(self, v: np.int32) -> Any:
        return v

    def _i64_arg(self, v: np.int64) -> Any:
        return v

    def _f32_arg(self, v: np.float32) -> Any:
        return v

    def _local_arg(self, floats: int) -> Any:
        raise NotImplementedError

    def _offset_arg(self, a: DeviceArray) -> Any:
        """The element offset of `a` in the buffer `_buffer_arg` passes (0: the buffer argument is the view itself)."""
        return self._i64_arg(np.int64(0))

    def _device_input(self, a: DeviceArray) -> tuple[DeviceArray, tuple]:
        """A device array as a kernel can take it, and what to keep alive (the array itself by default)."""
        return a, ()

    # --------------------------------------------------------------------------------------------- launching

    def _launch(self, name: str, global_size: tuple[int, ...], local_size: tuple[int, ...] | None,
                args: list[Any], keep: tuple = ()) -> Any:
        """Submit kernel `name` (sizes in OpenCL order, dimension 0 first); `keep` stays alive as the backend needs.

        A device array is two kernel arguments, its buffer and its element offset in it (moe.cl's ARG).
        """
        conv = []
        for a in args:
            if isinstance(a, self.array_type):
                conv.append(self._buffer_arg(a))
                conv.append(self._offset_arg(a))
            elif isinstance(a, np.int32):
                conv.append(self._i32_arg(a))
            elif isinstance(a, np.int64):
                conv.append(self._i64_arg(a))
            elif isinstance(a, np.float32):
                conv.append(self._f32_arg(a))
            elif isinstance(a, Local):
                conv.append(self._local_arg(a.floats))
            else:
                raise TypeError(f"kernel argument of type {type(a).__name__}")
        return self._submit(name, global_size, local_size, conv, keep)

    def _input(self, a: Any, dtype: Any, what: str) -> tuple[DeviceArray, tuple]:
        """A device array of `dtype` for an argument (numpy data is uploaded); the second item is what to keep alive."""
        dtype = np.dtype(dtype)
        if isinstance(a, self.array_type):
            if a.dtype != dtype:
                raise TypeError(f"{what}: expected a {dtype.name} device array, got {a.dtype.name}")
            return self._device_input(a)
        host = np.ascontiguousarray(np.asarray(a), dtype=dtype)
        dev = self.memory.to_device(host)
        if dev is None:
            raise MemoryError(f"{self.label}: no room on the device for {what} ({host.nbytes} bytes)")
        return dev, (dev,)

    def _empty(self, shape: tuple[int, ...], dtype: Any) -> DeviceArray:
        arr = self.memory.alloc(shape, dtype)
        if arr is None:
            raise MemoryError(f"{self.label}: no room for an output of shape {shape} ({np.dtype(dtype).name})")
        return arr

    def _result(self, out: Any, shape: tuple[int, ...], dtype: Any, what: str) -> DeviceArray:
        """The output buffer a kernel writes: the caller's `out` (checked: a device array of this shape and dtype),
        else a new allocation."""
        if out is None:
            return self._empty(shape, dtype)
        dtype = np.dtype(dtype)
        if not isinstance(out, self.array_type):
            raise TypeError(f"{what}: out must be a device array of this backend, got {type(out).__name__}")
        if out.shape != tuple(int(s) for s in shape) or out.dtype != dtype:
            raise ValueError(f"{what}: out is {out.shape} {out.dtype.name}, the result {tuple(shape)} {dtype.name}")
        return out

    def _dtype_of(self, a: Any) -> np.dtype:
        return a.dtype if isinstance(a, self.array_type) else np.asarray(a).dtype

    @staticmethod
    def _check_sizes(*sizes: int) -> None:
        for s in sizes:
            if s > I32_MAX:
                raise ValueError(f"size {s} exceeds the kernels' 32-bit indexing")

    # --------------------------------------------------------------------------------------------- kernels
    # `out` (API 2.0): the result is written there and returned; a call given its outputs allocates no device
    # memory (the tiled grouped FFN keeps its intermediates in local memory, scatter_add needs no scratch).

    def route_topk(self, logits, k, out=None):
        """[T,E] f32 router logits -> (ids [T,k] int32, weights [T,k] f32, softmax over the top k)."""
        lg, keep = self._input(logits, np.float32, "route_topk logits")
        t_rows, e_cols = lg.shape
        k = int(k)
        if not 1 <= k <= e_cols:
            raise ValueError(f"route_topk: k={k} must be in 1..{e_cols}")
        ids_out, w_out = out if out is not None else (None, None)
        ids = self._result(ids_out, (t_rows, k), np.int32, "route_topk ids")
        w = self._result(w_out, (t_rows, k), np.float32, "route_topk weights")
        if t_rows:
            self._launch("route_topk", (t_rows,), None,
                         [lg, np.int32(t_rows), np.int32(e_cols), np.int32(k), ids, w], keep)
        return ids, w

    def gather(self, x, rows, out=None):
        """x [T,H], rows [N] int32 -> x[rows] [N,H] (any 2- or 4-byte dtype)."""
        dt = self._dtype_of(x)
        if dt.itemsize not in (2, 4):
            raise TypeError(f"gather: {dt.name} rows are not supported (2- or 4-byte elements)")
        xd, k1 = self._input(x, dt, "gather x")
        rd, k2 = self._input(rows, np.int32, "gather rows")
        t_rows, h = xd.shape
        n = rd.size
        res = self._result(out, (n, h), dt, "gather")
        if n and h:
            self._launch(f"gather_b{dt.itemsize}", (h, n), None,
                         [xd, rd, np.int32(n), np.int32(h), np.int32(t_rows), res], k1 + k2)
        return res

    #: Work-items scatter_add aims for: its columns times the residue classes of rows each one walks.
    SCATTER_ITEMS = 16384

    def scatter_add(self, out, rows, y, scale):
        """out[rows[i]] += scale[i] * y[i] for i < N, in place, adding each row's terms in ascending i (deterministic)."""
        host_out = None
        if not isinstance(out, self.array_type):
            host_out = out
            out, _ = self._input(out, np.float32, "scatter_add out")
        elif out.dtype != np.float32:
            raise TypeError(f"scatter_add: out must be float32, got {out.dtype.name}")
        rd, k1 = self._input(rows, np.int32, "scatter_add rows")
        yd, k2 = self._input(y, np.float32, "scatter_add y")
        sd, k3 = self._input(scale, np.float32, "scatter_add scale")
        t_rows, h = out.shape
        n = rd.size
        self._check_sizes(out.size, yd.size)
        if n and h and t_rows:
            b = max(1, min(t_rows, -(-self.SCATTER_ITEMS // h)))
            self._launch("scatter_add_cols", (h, b), None,
                         [out, np.int32(t_rows), np.int32(h), rd, np.int32(n), yd, sd, np.int32(b)],
                         k1 + k2 + k3 + (out,))
        if host_out is not None:
            np.copyto(host_out, self.memory.download(out).reshape(np.shape(host_out)), casting="same_kind")

    def ffn_scratch_shape(self, rows: int, ffn: int) -> tuple[int, int] | None:
        """The f32 [rows, ffn] intermediate moe_grouped_ffn keeps between its two passes on a device whose
        work-groups are too small for the tiled kernel (the caller carves it and passes it as `scratch`); None
        when the tiled kernel keeps it in local memory."""
        return None if self._tiled else (int(rows), int(ffn))

    def moe_grouped_ffn(self, x, offsets, slots, weights: ExpertPool, out=None, scratch=None):
        """SwiGLU experts over token groups: rows offsets[g]:offsets[g+1] of x run expert slot slots[g] -> [N,H] f32.

        `scratch`: a device f32 array of `ffn_scratch_shape(N, ffn)` for the two-pass path's intermediate (from the
        caller's plan); without it that path allocates the intermediate (the ledger's peak counts it)."""
        xd, k1 = self._input(x, np.float32, "moe_grouped_ffn x")
        od, k2 = self._input(offsets, np.int32, "moe_grouped_ffn offsets")
        sd, k3 = self._input(slots, np.int32, "moe_grouped_ffn slots")
        n, h = xd.shape
        g = sd.size
        if od.size != g + 1:
            raise ValueError(f"moe_grouped_ffn: {od.size} offsets for {g} groups (need groups + 1)")
        a = weights.arrays
        if weights.dtype == "gguf":
            fmt = weights.fmt
            if not self._tiled:
                raise ValueError(f"{self.label}: GGUF expert pools need work-groups of {LINEAR_TILE * LINEAR_TILE} "
                                 "work-items; this device's are smaller")
            blob, kw = self._input(a["blob"], np.uint8, "gguf expert blob")
            s_slots, slot_b = blob.shape
            if fmt.hidden != h or fmt.nbytes > slot_b:
                raise ValueError(f"moe_grouped_ffn: x has hidden {h}, the experts {fmt.hidden} in {fmt.nbytes}-byte "
                                 f"slots of {slot_b}")
            f, hw, two_f = fmt.ffn, h, 2 * fmt.ffn
            w_args = [blob, np.int32(slot_b), np.int32(fmt.gate_up_row_bytes), np.int32(GGML_TYPE_IDS[fmt.gate_up]),
                      np.int64(fmt.down_offset), np.int32(fmt.down_row_bytes), np.int32(GGML_TYPE_IDS[fmt.down]),
                      np.int32(fmt.bias_offset if fmt.bias else -1)]
            suffix = "gguf"
            weight_elems = s_slots * slot_b
        elif weights.dtype == "f16":
            w13, kw1 = self._input(a["w_gate_up"], np.float16, "w_gate_up")
            w2, kw2 = self._input(a["w_down"], np.float16, "w_down")
            up_args, down_args = [w13], [w2]
            s_slots, two_f, hw = w13.shape
            kw = kw1 + kw2
            suffix = "f16"
            weight_elems = s_slots * two_f * hw
        elif weights.dtype == "q8_0":
            gq, ka = self._input(a["gate_up_q"], np.int8, "gate_up_q")
            gd, kb = self._input(a["gate_up_d"], np.float16, "gate_up_d")
            dq, kc = self._input(a["down_q"], np.int8, "down_q")
            dd, kd = self._input(a["down_d"], np.float16, "down_d")
            up_args, down_args = [gq, gd], [dq, dd]
            s_slots, two_f, hw = gq.shape
            kw = ka + kb + kc + kd
            suffix = "q8_0"
            weight_elems = s_slots * two_f * hw
            if h % QK8_0 or (two_f // 2) % QK8_0:
                raise ValueError(f"moe_grouped_ffn: Q8_0 needs hidden and ffn multiples of {QK8_0}")
        else:
            raise ValueError(f"moe_grouped_ffn: unknown expert dtype {weights.dtype!r}")
        if hw != h:
            raise ValueError(f"moe_grouped_ffn: x has hidden {h}, the experts {hw}")
        f = two_f // 2
        y = self._result(out, (n, h), np.float32, "moe_grouped_ffn")
        if n == 0 or h == 0:
            return y
        self._check_sizes(n * f, n * h, weight_elems)
        keep = k1 + k2 + k3 + kw
        sizes = [np.int32(g), np.int32(s_slots), np.int32(n), np.int32(h), np.int32(f)]
        if f == 0 or g == 0:
            # no intermediates (or no group): every output is zero; f32 0 is int 0
            self._launch("fill_i32", (n * h,), None, [y, np.int32(n * h), np.int32(0)], keep)
            return y
        # rows before the first group or after the last: zero, as in the reference
        self._launch("ffn_zero_ungrouped", (n,), None, [od, np.int32(g), np.int32(n), np.int32(h), y])
        if self._tiled:
            if suffix != "gguf":
                w_args = up_args + down_args
            t = LINEAR_TILE
            tiles = -(-n // t) + g  # at least the tiles of every group (each group's last may be partial)
            self._launch(f"ffn_{suffix}_tiled", (t, tiles * t), (t, t), [xd, od, sd, *sizes, *w_args, y], keep)
            return y
        act = (self._result(scratch, (n, f), np.float32, "moe_grouped_ffn scratch") if scratch is not None
               else self._empty((n, f), np.float32))
        self._launch(f"ffn_gate_up_{suffix}", (f, n), None, [xd, od, sd, *sizes, *up_args, act])
        self._launch(f"ffn_down_{suffix}", (h, n), None, [act, od, sd, *sizes, *down_args, y], keep + (act,))
        return y

    def dequantize_q8_0(self, qs, d, out=None):
        """Q8_0 blocks (qs [..,C] int8, d [..,C/32] f16) -> [..,C] f16."""
        qd, k1 = self._input(qs, np.int8, "dequantize qs")
        dd, k2 = self._input(d, np.float16, "dequantize d")
        if qd.shape[-1] % QK8_0 or dd.size * QK8_0 != qd.size:
            raise ValueError(f"dequantize_q8_0: {qd.shape} quants do not match {dd.shape} scales")
        total = qd.size
        self._check_sizes(total)
        res = self._result(out, qd.shape, np.float16, "dequantize_q8_0")
        if total:
            self._launch("dequantize_q8_0", (total,), None, [qd, dd, np.int32(total), res], k1 + k2)
        return res

    def rmsnorm(self, x, w, eps=1e-6, out=None):
        """[T,H] f32, w [H] f32 or f16 -> x / rms(x) * w, f32."""
        xd, k1 = self._input(x, np.float32, "rmsnorm x")
        wdt = self._dtype_of(w)
        wdt = np.dtype(np.float16) if wdt == np.float16 else np.dtype(np.float32)
        wd, k2 = self._input(w, wdt, "rmsnorm w")
        t_rows, h = xd.shape
        if wd.size != h:
            raise ValueError(f"rmsnorm: weight of {wd.size} for hidden {h}")
        res = self._result(out, (t_rows, h), np.float32, "rmsnorm")
        if t_rows and h:
            loc = self._reduce_local
            name = "rmsnorm_w_f16" if wdt == np.float16 else "rmsnorm_w_f32"
            self._launch(name, (t_rows * loc,), (loc,),
                         [xd, wd, np.int32(t_rows), np.int32(h), np.float32(eps), res, Local(loc)], k1 + k2)
        return res

    def linear(self, x, w, out=None):
        """x [T,H] f32, w [O,H] f16 or f32 -> x w^T [T,O] f32."""
        xd, k1 = self._input(x, np.float32, "linear x")
        wdt = self._dtype_of(w)
        wdt = np.dtype(np.float16) if wdt == np.float16 else np.dtype(np.float32)
        wd, k2 = self._input(w, wdt, "linear w")
        t_rows, h = xd.shape
        o, hw = wd.shape
        if hw != h:
            raise ValueError(f"linear: x has {h} columns, w has {hw}")
        self._check_sizes(t_rows * h, o * h, t_rows * o)
        res = self._result(out, (t_rows, o), np.float32, "linear")
        if t_rows and o:
            suffix = "w_f16" if wdt == np.float16 else "w_f32"
            args = [xd, wd, np.int32(t_rows), np.int32(h), np.int32(o), res]
            if self._tiled:
                gs = (round_up(o, LINEAR_TILE), round_up(t_rows, LINEAR_TILE))
                self._launch(f"linear_{suffix}", gs, (LINEAR_TILE, LINEAR_TILE), args, k1 + k2)
            else:
                self._launch(f"linear_plain_{suffix}", (o, t_rows), None, args, k1 + k2)
        return res
