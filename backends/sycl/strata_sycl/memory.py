"""SYCL memory: device arrays in USM device memory, streams as in-order queues, and pinned host memory as USM host.

The bookkeeping (views, the allocation count, checks, the pinned budget) is strata_core's opencl_driver; this module
supplies dpctl's allocations, copies and barrier events.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from strata_core.api.backend import PinnedBudget
from strata_core.kits.opencl.driver import (DeviceArray, EventSlot, OpenClDeviceMemory, OpenClPinnedAllocator,
                                               handle_alias)

from .runtime import Session


class UsmArray(DeviceArray):
    """A device array: its shape, dtype and the USM device allocation (dpctl MemoryUSMDevice) that holds it.

    Indexing the first axis (`pool[slot]`, `x[a:b]`) gives a view into the same allocation, as the runtime does to
    upload one expert into its cache slot; a view's `owner` is the array it came from and keeps it alive.
    """

    __slots__ = ()

    mem = handle_alias("The dpctl memory object (None once freed).")

    def _view(self, shape: tuple[int, ...], offset_bytes: int, nbytes: int, dtype: np.dtype) -> "UsmArray":
        # USM sub-allocation by offset: a dpctl memory object at the same allocation's pointer plus offset_bytes
        mem = _usm_view(self.mem, offset_bytes, nbytes) if nbytes else None
        return UsmArray(shape, dtype, mem, owner=self)


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


class SyclEvent(EventSlot):
    """An event slot: `record` fills it with the barrier event of a queue; None until then."""

    __slots__ = ()

    def _complete(self, event: Any) -> bool:
        return event.execution_status.name == "complete"


def _is_usm_host(a: np.ndarray) -> bool:
    """True when a numpy array views USM host memory (a buffer from UsmPinnedAllocator): copies may then be async."""
    base = a
    while base is not None:
        if type(base).__name__ == "MemoryUSMHost":
            return True
        base = getattr(base, "base", None) if not isinstance(base, memoryview) else base.obj
    return False


class SyclDeviceMemory(OpenClDeviceMemory):
    """DeviceMemory of one SYCL device: USM device allocations, in-order queues as streams, barrier events."""

    array_type = UsmArray
    event_type = SyclEvent

    def __init__(self, session: Session):
        super().__init__(session)
        self._dm = session.dpctl.memory

    def _allocate(self, nbytes: int) -> Any:
        try:
            return self._dm.MemoryUSMDevice(nbytes, queue=self.session.queue)
        except (self._dm.USMAllocationError, MemoryError):
            return None

    def _before_free(self) -> None:
        # dpctl frees USM at once when the last reference goes, so queued work that uses it must finish first.
        self.session.wait_all()

    def _copy_in(self, queue: Any, dst: UsmArray, host: np.ndarray) -> None:
        # Only USM host memory may be copied asynchronously: pageable memory could change before the copy ran.
        if _is_usm_host(host):
            queue.memcpy_async(dst.mem, host, dst.nbytes)
        else:
            queue.memcpy(dst.mem, host, dst.nbytes)

    def _copy_out(self, queue: Any, out: np.ndarray, src: UsmArray) -> None:
        queue.memcpy(out, src.mem, src.nbytes)

    def _marker(self, queue: Any) -> Any:
        return queue.submit_barrier()

    def _barrier(self, queue: Any, event: Any) -> None:
        queue.submit_barrier([event])


class UsmPinnedAllocator(OpenClPinnedAllocator):
    """Pinned host memory as SYCL USM host allocations (page-locked by the runtime), charged to a PinnedBudget.

    dpctl cannot page-lock memory in place, so registering is refused on a GPU (callers copy from pageable memory).
    A CPU device's memory is host memory: there is no copy engine for page-locking to speed up, so registering is
    only the budget's accounting there, as the cpu backend does.
    """

    kind = "usm-host"

    def __init__(self, session: Session, budget: PinnedBudget):
        self.host_device = session.device.device_type.name == "cpu"
        self.usm_host = bool(session.device.has_aspect_usm_host_allocations)
        super().__init__(session, budget, allocates=self.usm_host, registers=self.host_device)

    def _allocate_pinned(self, nbytes: int) -> tuple[np.ndarray, Any]:
        mem = self.session.dpctl.memory.MemoryUSMHost(nbytes, queue=self.session.queue)
        return np.frombuffer(mem, dtype=np.uint8), mem
