"""OpenCL memory: device arrays as cl.Buffer, streams as in-order queues, markers as events, mapped pinned buffers.

The bookkeeping (views, the allocation count, checks, the pinned budget) is strata-core's OpenCL kit
(strata_core.kits.opencl); this module supplies pyopencl's buffers, copies, markers and barriers.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from strata_core.api import PinnedBudget, PinnedBuffer
from strata_core.kits.opencl import (DeviceArray, EventSlot, OpenClDeviceMemory, OpenClPinnedAllocator,
                                               handle_alias)

from .runtime import Session


class ClArray(DeviceArray):
    """A device array: its shape, dtype, the cl.Buffer that holds it and the byte offset into that buffer.

    Indexing the first axis (`pool[slot]`, `x[a:b]`) gives a view into the same buffer, as the runtime does to
    upload one expert into its cache slot; a view's `owner` is the array it came from.
    """

    __slots__ = ("offset_bytes",)

    def __init__(self, shape: tuple[int, ...], dtype: Any, buf: Any, offset_bytes: int = 0,
                 owner: "ClArray | None" = None):
        super().__init__(shape, dtype, buf, owner=owner)
        self.offset_bytes = int(offset_bytes)

    buf = handle_alias("The cl.Buffer (None once freed).")

    def _view(self, shape: tuple[int, ...], offset_bytes: int, nbytes: int, dtype: np.dtype) -> "ClArray":
        return ClArray(shape, dtype, self.buf, self.offset_bytes + offset_bytes, owner=self)

    def element_offset(self) -> int:
        """This view's offset in its buffer in elements of its dtype (kernels take the buffer and this offset)."""
        if self.offset_bytes % self.dtype.itemsize:
            raise ValueError(f"a {self.dtype.name} view at byte {self.offset_bytes} of its buffer is not a kernel "
                             "argument (not a whole number of elements)")
        return self.offset_bytes // self.dtype.itemsize


class ClEvent(EventSlot):
    """An event slot: `record` fills it with a marker of a queue; None until then."""

    __slots__ = ()

    def _complete(self, event: Any) -> bool:
        return event.command_execution_status == 0  # CL_COMPLETE


def _is_mapped(a: np.ndarray, cl: Any) -> bool:
    """True when a numpy array views a mapped host-visible buffer (from ClPinnedAllocator): copies may be async."""
    base = a
    while isinstance(base, np.ndarray):
        base = base.base
    return isinstance(base, cl.MemoryMap)


class ClDeviceMemory(OpenClDeviceMemory):
    """DeviceMemory of one OpenCL device: buffers, in-order queues as streams, markers and barriers as events."""

    array_type = ClArray
    event_type = ClEvent

    def __init__(self, session: Session):
        super().__init__(session)
        self.cl = session.cl

    def _allocate(self, nbytes: int) -> Any:
        # The OpenCL runtime keeps a buffer alive until the commands using it are done, even once we drop it.
        try:
            return self.cl.Buffer(self.session.context, self.cl.mem_flags.READ_WRITE, nbytes)
        except (self.cl.Error, MemoryError):
            return None

    # free() only drops the reference, not clReleaseMemObject now: views of the array may still hold the buffer,
    # and OpenCL keeps a released buffer alive for commands already enqueued anyway (so no _before_free wait).

    def _copy_in(self, queue: Any, dst: ClArray, host: np.ndarray) -> None:
        # Only a mapped pinned buffer may be copied asynchronously: pageable memory could change before the copy ran.
        self.cl.enqueue_copy(queue, dst.buf, host, dst_offset=dst.offset_bytes,
                             is_blocking=not _is_mapped(host, self.cl))

    def _copy_out(self, queue: Any, out: np.ndarray, src: ClArray) -> None:
        self.cl.enqueue_copy(queue, out, src.buf, src_offset=src.offset_bytes, is_blocking=True)

    def _marker(self, queue: Any) -> Any:
        return self.cl.enqueue_marker(queue)

    def _barrier(self, queue: Any, event: Any) -> None:
        self.cl.enqueue_barrier(queue, wait_for=[event])

    def _reported_free(self) -> int | None:
        try:
            return int(self.session.device.global_free_memory_amd[0]) * 1024  # reported in KiB
        except Exception:  # the extension is AMD's; elsewhere the query fails and our own count stands
            return None


class ClPinnedAllocator(OpenClPinnedAllocator):
    """Pinned host memory as CL_MEM_ALLOC_HOST_PTR buffers kept mapped, charged to a PinnedBudget.

    Where the platform does not offer host-visible buffers every request returns None (and nothing is charged).
    OpenCL has no way to page-lock existing memory in place (CL_MEM_USE_HOST_PTR may copy), so a GPU registers
    nothing; a CPU device's memory is host memory, where registering is only the budget's accounting.
    """

    kind = "cl-host"

    def __init__(self, session: Session, budget: PinnedBudget):
        self.offered = session.offers_host_visible_memory()
        self.host_device = bool(int(session.device.type) & session.cl.device_type.CPU)
        super().__init__(session, budget, allocates=self.offered, registers=self.offered and self.host_device)

    def _allocate_pinned(self, nbytes: int) -> tuple[np.ndarray, Any]:
        cl = self.session.cl
        buf = cl.Buffer(self.session.context, cl.mem_flags.READ_WRITE | cl.mem_flags.ALLOC_HOST_PTR, nbytes)
        try:
            arr, _ = cl.enqueue_map_buffer(self.session.queue, buf, cl.map_flags.READ | cl.map_flags.WRITE, 0,
                                           (nbytes,), np.uint8, is_blocking=True)
        except Exception:
            buf.release()  # the buffer is ours until it is handed out; the caller gives the bytes back
            raise
        return arr, buf

    def _release_pinned(self, buf: PinnedBuffer) -> None:
        """Unmap and release the buffer."""
        buf.array.base.release(self.session.queue)
        self.session.queue.finish()
        buf.handle.release()
