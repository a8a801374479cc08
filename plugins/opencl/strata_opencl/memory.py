"""OpenCL memory: device arrays as cl.Buffer, streams as in-order queues, markers as events, mapped pinned buffers."""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from strata_core.backend_api import PinnedBudget, PinnedBuffer

from .runtime import Session


class ClArray:
    """A device array: its shape, dtype, the cl.Buffer that holds it and the byte offset into that buffer.

    Indexing the first axis (`pool[slot]`, `x[a:b]`) gives a view into the same buffer, as the runtime does to
    upload one expert into its cache slot; a view's `owner` is the array it came from.
    """

    __slots__ = ("shape", "dtype", "buf", "offset_bytes", "nbytes", "release", "owner", "__weakref__")

    def __init__(self, shape: tuple[int, ...], dtype: Any, buf: Any, offset_bytes: int = 0,
                 owner: "ClArray | None" = None):
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.buf = buf
        self.offset_bytes = int(offset_bytes)
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

    def __getitem__(self, key) -> "ClArray":
        """A view of one row (int) or a contiguous run of rows (slice with step 1) of the first axis."""
        if not self.shape:
            raise IndexError("a 0-d device array cannot be indexed")
        rows = self.shape[0]
        if isinstance(key, (int, np.integer)):
            i = int(key) + (rows if key < 0 else 0)
            if not 0 <= i < rows:
                raise IndexError(f"index {int(key)} out of range for {rows} rows")
            start, shape = i, self.shape[1:]
        elif isinstance(key, slice):
            start, stop, step = key.indices(rows)
            if step != 1:
                raise IndexError("device array views take contiguous rows only (step 1)")
            shape = (max(start, stop) - start,) + self.shape[1:]
        else:
            raise IndexError(f"device arrays index the first axis with an int or a slice, not {type(key).__name__}")
        row_bytes = int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize
        return ClArray(shape, self.dtype, self.buf, self.offset_bytes + start * row_bytes, owner=self)

    def kernel_arg(self) -> Any:
        """The buffer a kernel gets: the whole buffer, or a sub-buffer for a view (ValueError if misaligned)."""
        if self.offset_bytes == 0:
            return self.buf
        try:
            return self.buf.get_sub_region(self.offset_bytes, max(self.nbytes, 1))
        except Exception as e:
            raise ValueError(f"a view at byte {self.offset_bytes} cannot be a kernel argument on this device "
                             f"(sub-buffer refused: {e})") from None

    def __repr__(self) -> str:
        return f"ClArray(shape={self.shape}, dtype={self.dtype.name}{', view' if self.owner else ''})"


class ClEvent:
    """An event slot: `record` fills it with a marker of a queue; None until then."""

    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = None

    def query_done(self) -> bool:
        """True when the recorded work has completed (or nothing was recorded)."""
        if self.event is None:
            return True
        return self.event.command_execution_status == 0  # CL_COMPLETE


def _is_mapped(a: np.ndarray, cl: Any) -> bool:
    """True when a numpy array views a mapped host-visible buffer (from ClPinnedAllocator): copies may be async."""
    base = a
    while isinstance(base, np.ndarray):
        base = base.base
    return isinstance(base, cl.MemoryMap)


def _uncount(session: Session, nbytes: int) -> None:
    with session.lock:
        session.allocated_bytes -= nbytes


class ClDeviceMemory:
    """DeviceMemory of one OpenCL device: buffers, in-order queues as streams, markers and barriers as events."""

    def __init__(self, session: Session):
        self.session = session
        self.cl = session.cl

    def _queue(self, stream: Any) -> Any:
        return self.session.queue if stream is None else stream.queue

    def alloc(self, shape, dtype):
        """A ClArray, or None when the device has no room (never raises for lack of memory)."""
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        dev = self.session.device
        # OpenCL allocates buffers lazily (at first use), so the device's limits are checked here, up front.
        if nbytes > dev.max_mem_alloc_size or self.session.allocated_bytes + nbytes > dev.global_mem_size:
            return None
        try:
            buf = self.cl.Buffer(self.session.context, self.cl.mem_flags.READ_WRITE, max(nbytes, 1))
        except (self.cl.Error, MemoryError):
            return None
        with self.session.lock:
            self.session.allocated_bytes += nbytes
        arr = ClArray(shape, dtype, buf)
        # Arrays dropped without free() (kernel temporaries, outputs a caller let go) still leave the count; the
        # OpenCL runtime itself keeps a released buffer alive until the commands using it are done.
        arr.release = weakref.finalize(arr, _uncount, self.session, nbytes)
        return arr

    def free(self, arr):
        """Release a device array (idempotent; a view frees nothing)."""
        if arr.buf is None or arr.owner is not None:
            return
        # Dropping the reference, not clReleaseMemObject now: views of this array may still hold the buffer, and
        # OpenCL keeps a released buffer alive for commands already enqueued anyway.
        arr.buf = None
        if arr.release is not None:
            arr.release()

    def upload(self, dst, src, stream=None):
        """Copy host -> device; asynchronous on `stream` when `src` is a mapped pinned buffer, else complete on return."""
        host = np.asarray(src)
        if host.size != dst.size:
            raise ValueError(f"upload: {host.size} elements into a device array of {dst.size}")
        if host.dtype != dst.dtype or not host.flags.c_contiguous:
            host = np.ascontiguousarray(host, dtype=dst.dtype)
        if dst.nbytes == 0:
            return
        self.cl.enqueue_copy(self._queue(stream), dst.buf, host, dst_offset=dst.offset_bytes,
                             is_blocking=not _is_mapped(host, self.cl))

    def download(self, src, stream=None):
        """Copy device -> host after the stream's earlier work, and return the host array."""
        out = np.empty(src.shape, dtype=src.dtype)
        if src.nbytes:
            self.cl.enqueue_copy(self._queue(stream), out, src.buf, src_offset=src.offset_bytes, is_blocking=True)
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
        return ClEvent()

    def record(self, event, stream):
        """Record on `stream`: the event completes when the stream's work enqueued so far has."""
        event.event = self.cl.enqueue_marker(self._queue(stream))

    def wait(self, stream, event):
        """Make `stream`'s later work wait for `event` (a no-op for an unrecorded event)."""
        if event.event is not None:
            self.cl.enqueue_barrier(self._queue(stream), wait_for=[event.event])

    def synchronize(self, stream=None):
        """Block until `stream` is idle, or every queue of the device when None."""
        if stream is None:
            self.session.finish_all()
        else:
            stream.queue.finish()

    def mem_info(self):
        """(free_bytes, total_bytes): AMD's free-memory query where offered, else the total less what we allocated."""
        dev = self.session.device
        total = int(dev.global_mem_size)
        free = total - self.session.allocated_bytes
        try:
            free = min(free, int(dev.global_free_memory_amd[0]) * 1024)  # reported in KiB
        except Exception:  # the extension is AMD's; elsewhere the query fails and our own count stands
            pass
        return max(0, free), total


class ClPinnedAllocator:
    """Pinned host memory as CL_MEM_ALLOC_HOST_PTR buffers kept mapped, charged to a PinnedBudget.

    Where the platform does not offer host-visible buffers every request returns None (and nothing is charged).
    """

    kind = "cl-host"

    def __init__(self, session: Session, budget: PinnedBudget):
        self.session = session
        self.budget = budget
        self.offered = session.offers_host_visible_memory()
        self.host_device = bool(int(session.device.type) & session.cl.device_type.CPU)

    def alloc(self, nbytes, from_floor=False):
        """A mapped host-visible buffer of nbytes through the budget, or None."""
        nbytes = int(nbytes)
        if not self.offered or nbytes <= 0 or not self.budget.take(nbytes, from_floor=from_floor):
            return None
        cl = self.session.cl
        buf = None
        try:
            buf = cl.Buffer(self.session.context, cl.mem_flags.READ_WRITE | cl.mem_flags.ALLOC_HOST_PTR, nbytes)
            arr, _ = cl.enqueue_map_buffer(self.session.queue, buf, cl.map_flags.READ | cl.map_flags.WRITE, 0,
                                           (nbytes,), np.uint8, is_blocking=True)
        except Exception:  # an allocator must not raise: any runtime refusal is 'no memory'
            if buf is not None:
                buf.release()
            self.budget.give(nbytes)
            return None
        return PinnedBuffer(array=arr, nbytes=nbytes, kind="alloc", handle=buf, from_floor=from_floor)

    def register(self, array, from_floor=False):
        """Existing memory in place through the budget on a CPU device; None on any other device.

        OpenCL has no way to page-lock existing memory in place (CL_MEM_USE_HOST_PTR may copy), so a GPU gets None.
        A CPU device's memory is host memory: registering there is only the budget's accounting.
        """
        if not (self.offered and self.host_device):
            return None
        a = np.asarray(array)
        if not a.flags.c_contiguous or a.nbytes == 0:
            return None
        nbytes = int(a.nbytes)
        if not self.budget.take(nbytes, from_floor=from_floor):
            return None
        return PinnedBuffer(array=a.reshape(-1).view(np.uint8), nbytes=nbytes, kind="register", from_floor=from_floor)

    def free(self, buf):
        """Unmap and release the buffer and give its bytes back (idempotent)."""
        if buf.freed:
            return
        buf.freed = True
        if buf.kind == "register":
            self.budget.give(buf.nbytes)
            return
        try:
            buf.array.base.release(self.session.queue)
            self.session.queue.finish()
            buf.handle.release()
        finally:
            buf.handle = None
            self.budget.give(buf.nbytes)
