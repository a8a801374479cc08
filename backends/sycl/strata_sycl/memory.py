"""SYCL memory: device arrays in USM device memory, streams as in-order queues, and pinned host memory as USM host."""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from strata_core.backend_api import PinnedBudget, PinnedBuffer

from .runtime import Session


class UsmArray:
    """A device array: its shape, dtype and the USM device allocation (dpctl MemoryUSMDevice) that holds it.

    Indexing the first axis (`pool[slot]`, `x[a:b]`) gives a view into the same allocation, as the runtime does to
    upload one expert into its cache slot; a view's `owner` is the array it came from and keeps it alive.
    """

    __slots__ = ("shape", "dtype", "mem", "nbytes", "release", "owner", "__weakref__")

    def __init__(self, shape: tuple[int, ...], dtype: Any, mem: Any, owner: "UsmArray | None" = None):
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.mem = mem
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

    def __getitem__(self, key) -> "UsmArray":
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
        nbytes = (stop - start) * row_bytes
        mem = _usm_view(self.mem, start * row_bytes, nbytes) if nbytes else None
        return UsmArray(shape, self.dtype, mem, owner=self)

    def __repr__(self) -> str:
        return f"UsmArray(shape={self.shape}, dtype={self.dtype.name}{', view' if self.owner else ''})"


class _UsmRange:
    """An object exposing a byte range of a USM allocation through __sycl_usm_array_interface__ (for a view)."""

    def __init__(self, mem: Any, offset_bytes: int, nbytes: int):
        self.mem = mem  # keeps the allocation alive as long as the view
        ptr = mem.__sycl_usm_array_interface__["data"][0] + offset_bytes
        self.__sycl_usm_array_interface__ = {"data": (ptr, False), "shape": (nbytes,), "strides": None,
                                             "typestr": "|u1", "version": 1, "syclobj": mem.sycl_queue}


def _usm_view(mem: Any, offset_bytes: int, nbytes: int) -> Any:
    """A dpctl memory object for bytes [offset, offset + nbytes) of `mem`, sharing its allocation."""
    return type(mem)(_UsmRange(mem, offset_bytes, nbytes))


class SyclEvent:
    """An event slot: `record` fills it with the barrier event of a queue; None until then."""

    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = None

    def query_done(self) -> bool:
        """True when the recorded work has completed (or nothing was recorded)."""
        if self.event is None:
            return True
        return self.event.execution_status.name == "complete"


def _is_usm_host(a: np.ndarray) -> bool:
    """True when a numpy array views USM host memory (a buffer from UsmPinnedAllocator): copies may then be async."""
    base = a
    while base is not None:
        if type(base).__name__ == "MemoryUSMHost":
            return True
        base = getattr(base, "base", None) if not isinstance(base, memoryview) else base.obj
    return False


def _uncount(session: Session, nbytes: int) -> None:
    with session.lock:
        session.allocated_bytes -= nbytes


class SyclDeviceMemory:
    """DeviceMemory of one SYCL device: USM device allocations, in-order queues as streams, barrier events."""

    def __init__(self, session: Session):
        self.session = session
        self._dm = session.dpctl.memory

    def _queue(self, stream: Any) -> Any:
        return self.session.queue if stream is None else stream.queue

    def alloc(self, shape, dtype):
        """A UsmArray, or None when the device has no room (never raises for lack of memory)."""
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        dev = self.session.device
        # A CPU device's allocations are lazily backed by host pages, so an over-large request would only fail
        # later, at first touch; the device's own limits are checked up front instead.
        if nbytes > dev.max_mem_alloc_size or self.session.allocated_bytes + nbytes > dev.global_mem_size:
            return None
        try:
            mem = self._dm.MemoryUSMDevice(max(nbytes, 1), queue=self.session.queue)
        except (self._dm.USMAllocationError, MemoryError):
            return None
        with self.session.lock:
            self.session.allocated_bytes += nbytes
        arr = UsmArray(shape, dtype, mem)
        # Arrays dropped without free() (kernel temporaries, outputs a caller let go) still leave the count.
        arr.release = weakref.finalize(arr, _uncount, self.session, nbytes)
        return arr

    def free(self, arr):
        """Release a device array once every queue of the device is done with it (idempotent; a view frees nothing)."""
        if arr.mem is None or arr.owner is not None:
            return
        self.session.wait_all()
        arr.mem = None
        if arr.release is not None:
            arr.release()

    def upload(self, dst, src, stream=None):
        """Copy host -> device; asynchronous on `stream` when `src` is USM host memory, else complete on return."""
        host = np.asarray(src)
        if host.size != dst.size:
            raise ValueError(f"upload: {host.size} elements into a device array of {dst.size}")
        if host.dtype != dst.dtype or not host.flags.c_contiguous:
            host = np.ascontiguousarray(host, dtype=dst.dtype)
        if dst.nbytes == 0:
            return
        q = self._queue(stream)
        if _is_usm_host(host):
            q.memcpy_async(dst.mem, host, dst.nbytes)
        else:
            q.memcpy(dst.mem, host, dst.nbytes)

    def download(self, src, stream=None):
        """Copy device -> host after the stream's earlier work, and return the host array."""
        out = np.empty(src.shape, dtype=src.dtype)
        if src.nbytes:
            self._queue(stream).memcpy(out, src.mem, src.nbytes)
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
        return SyclEvent()

    def record(self, event, stream):
        """Record on `stream`: the event completes when the stream's work submitted so far has."""
        event.event = self._queue(stream).submit_barrier()

    def wait(self, stream, event):
        """Make `stream`'s later work wait for `event` (a no-op for an unrecorded event)."""
        if event.event is not None:
            self._queue(stream).submit_barrier([event.event])

    def synchronize(self, stream=None):
        """Block until `stream` is idle, or every queue of the device when None."""
        if stream is None:
            self.session.wait_all()
        else:
            stream.queue.wait()

    def mem_info(self):
        """(free_bytes, total_bytes): the device's total less what this process allocated (dpctl reports no free)."""
        total = int(self.session.device.global_mem_size)
        return max(0, total - self.session.allocated_bytes), total


class UsmPinnedAllocator:
    """Pinned host memory as SYCL USM host allocations (page-locked by the runtime), charged to a PinnedBudget."""

    kind = "usm-host"

    def __init__(self, session: Session, budget: PinnedBudget):
        self.session = session
        self.budget = budget
        self.host_device = session.device.device_type.name == "cpu"
        self.usm_host = bool(session.device.has_aspect_usm_host_allocations)

    def alloc(self, nbytes, from_floor=False):
        """USM host memory of nbytes through the budget, or None (no USM host support, budget or runtime says no)."""
        nbytes = int(nbytes)
        if not self.usm_host or nbytes <= 0 or not self.budget.take(nbytes, from_floor=from_floor):
            return None
        try:
            mem = self.session.dpctl.memory.MemoryUSMHost(nbytes, queue=self.session.queue)
            view = np.frombuffer(mem, dtype=np.uint8)
        except Exception:  # an allocator must not raise: any runtime refusal is 'no memory'
            self.budget.give(nbytes)
            return None
        return PinnedBuffer(array=view, nbytes=nbytes, kind="alloc", handle=mem, from_floor=from_floor)

    def register(self, array, from_floor=False):
        """Existing memory in place through the budget on a CPU device; None on any other device.

        dpctl cannot page-lock memory in place, so a GPU gets None (callers copy from pageable memory). A CPU
        device's memory is host memory: there is no copy engine for page-locking to speed up, so registering is
        only the budget's accounting, as the cpu backend does.
        """
        if not self.host_device:
            return None
        a = np.asarray(array)
        if not a.flags.c_contiguous or a.nbytes == 0:
            return None
        nbytes = int(a.nbytes)
        if not self.budget.take(nbytes, from_floor=from_floor):
            return None
        return PinnedBuffer(array=a.reshape(-1).view(np.uint8), nbytes=nbytes, kind="register", from_floor=from_floor)

    def free(self, buf):
        """Release the USM host memory (or end a registration) and give its bytes back (idempotent)."""
        if buf.freed:
            return
        buf.freed = True
        buf.handle = None
        self.budget.give(buf.nbytes)
