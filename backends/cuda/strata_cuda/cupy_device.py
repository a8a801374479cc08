"""Page-locked host memory and device memory through cupy, for both of cupy's builds (CUDA and ROCm/HIP).

cupy exposes the same runtime API on both builds (cudaHostAlloc is hipHostMalloc underneath, and so on), so the
rocm backend uses these classes too, under its own `kind`. cupy is imported inside the functions: this module
imports without it.
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import Any

import numpy as np

from strata_core.api.backend import PinnedBudget, PinnedBuffer

#: cudaErrorMemoryAllocation and hipErrorOutOfMemory share the value 2: the one status that means "no memory".
OUT_OF_MEMORY_STATUS = 2
#: cudaHostAllocPortable / cudaHostRegisterPortable (same value on HIP): usable from every device's context.
_PORTABLE = 0x01


def _cupy_runtime() -> Any:
    from cupy.cuda import runtime
    return runtime


def is_out_of_memory(exc: BaseException) -> bool:
    """True when a runtime error (cupy's CUDARuntimeError or a test double) says the memory ran out."""
    return getattr(exc, "status", None) == OUT_OF_MEMORY_STATUS


def host_view(ptr: int, nbytes: int) -> np.ndarray:
    """A uint8 numpy array over `nbytes` of host memory at `ptr` (no copy; the caller keeps the memory alive)."""
    if nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))


class CupyPinnedAllocator:
    """Page-locked host memory through cudaHostAlloc / cudaHostRegister (or HIP's), every byte through the budget.

    Lack of memory returns None, never raises. A refused registration marks the budget exhausted: it is the
    strongest evidence that the platform has no more page-locked memory to give (seed #1756), so optional users
    (the CPU share) stand down instead of dying on their own allocation later. `runtime` is cupy's runtime module
    unless a test injects a double with the same four functions.
    """

    def __init__(self, budget: PinnedBudget, kind: str = "cuda-host", runtime: Any = None):
        self.budget = budget
        self.kind = kind
        self._runtime = runtime
        #: The last runtime error this allocator turned into None, for the one line the caller logs.
        self.last_error = ""

    @property
    def runtime(self) -> Any:
        """The runtime in use (cupy's, imported on first use, unless one was injected)."""
        if self._runtime is None:
            self._runtime = _cupy_runtime()
        return self._runtime

    def alloc(self, nbytes: int, from_floor: bool = False) -> PinnedBuffer | None:
        """Allocate nbytes page-locked (cudaHostAlloc, portable) through the budget, or None."""
        nbytes = int(nbytes)
        if not self.budget.take(nbytes, from_floor=from_floor):
            self.last_error = f"the pinned budget has {self.budget.left_bytes} bytes left, {nbytes} asked"
            return None
        if nbytes == 0:
            return PinnedBuffer(array=host_view(0, 0), nbytes=0, kind="alloc", handle=None, from_floor=from_floor)
        try:
            ptr = int(self.runtime.hostAlloc(nbytes, _PORTABLE))
        except Exception as e:
            self.budget.give(nbytes)
            self.last_error = f"cudaHostAlloc of {nbytes} bytes failed: {e}"
            return None
        return PinnedBuffer(array=host_view(ptr, nbytes), nbytes=nbytes, kind="alloc", handle=ptr,
                            from_floor=from_floor)

    def register(self, array: np.ndarray, from_floor: bool = False) -> PinnedBuffer | None:
        """Page-lock a C-contiguous numpy array in place (cudaHostRegister) through the budget, or None.

        A registration refused for lack of memory marks the budget exhausted and returns None.
        """
        if not isinstance(array, np.ndarray) or not array.flags.c_contiguous:
            raise ValueError("register needs a C-contiguous numpy array")
        nbytes = int(array.nbytes)
        if not self.budget.take(nbytes, from_floor=from_floor):
            self.last_error = f"the pinned budget has {self.budget.left_bytes} bytes left, {nbytes} asked"
            return None
        flat = array.reshape(-1).view(np.uint8)
        if nbytes == 0:
            return PinnedBuffer(array=flat, nbytes=0, kind="register", handle=None, from_floor=from_floor)
        ptr = int(array.ctypes.data)
        try:
            self.runtime.hostRegister(ptr, nbytes, _PORTABLE)
        except Exception as e:
            self.budget.give(nbytes)
            self.last_error = f"cudaHostRegister of {nbytes} bytes failed: {e}"
            if is_out_of_memory(e):
                self.budget.mark_exhausted(f"page-locking {nbytes} bytes in place was refused for lack of memory "
                                           f"({e}); no more page-locked memory is to be had")
            return None
        # the handle keeps the registered array alive until it is unregistered
        return PinnedBuffer(array=flat, nbytes=nbytes, kind="register", handle=(ptr, array), from_floor=from_floor)

    def free(self, buf: PinnedBuffer) -> None:
        """Release a buffer (cudaFreeHost or cudaHostUnregister) and give its bytes back (idempotent)."""
        if buf.freed:
            return
        try:
            if buf.handle is not None:
                if buf.kind == "alloc":
                    self.runtime.freeHost(buf.handle)
                else:
                    self.runtime.hostUnregister(buf.handle[0])
        except Exception as e:
            self.last_error = f"releasing {buf.nbytes} page-locked bytes failed: {e}"
        finally:
            buf.freed = True
            self.budget.give(buf.nbytes)
            # an allocated buffer's view would point at freed memory; a registered one stays ordinary memory
            if buf.kind == "alloc":
                buf.array = host_view(0, 0)
            buf.handle = None


def is_page_locked(arr: np.ndarray) -> bool:
    """True when the host array's memory is page-locked (allocated or registered with the runtime)."""
    rt = _cupy_runtime()
    if arr.nbytes == 0:
        return False
    try:
        attrs = rt.pointerGetAttributes(int(arr.ctypes.data))
    except Exception:
        # HIP answers an error for pageable memory where CUDA answers "unregistered"
        return False
    return int(getattr(attrs, "type", 0)) == int(rt.cudaMemoryTypeHost)


class CupyDeviceMemory:
    """Device arrays (cupy ndarrays), copies, streams and events of one device.

    `stream=None` means cupy's current stream everywhere, so the kernels (which run on the current stream) and the
    copies order the same way unless the caller hands out streams and events.
    """

    #: f16 uploads into f32 arrays of at least this many elements are widened on the device (below it the host's
    #: conversion costs less than the launches)
    WIDEN_MIN_ELEMENTS = 1 << 16

    def __init__(self, device_index: int = 0):
        import cupy
        self._cp = cupy
        self._rt = cupy.cuda.runtime
        self._device = cupy.cuda.Device(device_index)
        self._device.use()
        self._widen = None
        try:
            from .kernels import COMPILE_OPTIONS, kernel_source
            self._widen = cupy.RawModule(code=kernel_source(), options=COMPILE_OPTIONS).get_function(
                "strata_widen_f16_f32")
        except Exception:  # no compiler: f16 uploads into f32 arrays convert on the host, as before
            self._widen = None

    def _upload_widened(self, dst: Any, src: np.ndarray, stream: Any) -> None:
        """An f16 host array into an f32 device array: its bytes into dst's first half, then widened in place."""
        n = int(src.size)
        ptr = self._stream_ptr(stream)
        self._rt.memcpyAsync(int(dst.data.ptr), int(src.ctypes.data), 2 * n, self._rt.memcpyHostToDevice, ptr)
        hi = n
        with stream if stream is not None else contextlib.nullcontext():
            while hi > 0:
                lo = (hi + 1) // 2 if hi > 1 else 0  # [lo, hi) with hi <= 2 lo: see strata_widen_f16_f32
                blocks = max(1, min(4096, (hi - lo + 255) // 256))
                self._widen((blocks,), (256,), (dst, np.int64(lo), np.int64(hi)))
                hi = lo

    def _stream_ptr(self, stream: Any) -> int:
        return int((stream if stream is not None else self._cp.cuda.get_current_stream()).ptr)

    def alloc(self, shape: tuple[int, ...], dtype: Any) -> Any | None:
        """A cupy array, or None when the device has no room (cupy's pool already retried after freeing its cache)."""
        try:
            return self._cp.empty(shape, dtype=dtype)
        except self._cp.cuda.memory.OutOfMemoryError:
            return None

    def free(self, arr: Any) -> None:
        """Nothing to release by hand: cupy returns the memory to its pool on the last reference (see mem_info)."""

    def upload(self, dst: Any, src: np.ndarray, stream: Any = None) -> None:
        """Copy host -> device on `stream` (cudaMemcpyAsync).

        Asynchronous when `src` is page-locked: the caller keeps it unchanged until the stream passes this copy.
        Pageable (or converted) sources are staged by the runtime before this returns, so they are safe to reuse.
        """
        src = np.asarray(src)
        if src.size != dst.size:
            raise ValueError(f"upload: {src.size} elements into a device array of {dst.size}")
        if not dst.flags.c_contiguous:
            raise ValueError("upload: the device array must be C-contiguous")
        if (src.dtype == np.float16 and dst.dtype == np.float32 and self._widen is not None
                and src.size >= self.WIDEN_MIN_ELEMENTS):
            self._upload_widened(dst, np.ascontiguousarray(src), stream)
            return
        if src.dtype != dst.dtype:
            src = src.astype(dst.dtype, casting="same_kind")
        src = np.ascontiguousarray(src)
        if src.nbytes:
            self._rt.memcpyAsync(int(dst.data.ptr), int(src.ctypes.data), int(src.nbytes),
                                 self._rt.memcpyHostToDevice, self._stream_ptr(stream))

    def download(self, src: Any, stream: Any = None) -> np.ndarray:
        """Copy device -> host on `stream` and wait for it; returns a new numpy array."""
        src = self._cp.ascontiguousarray(src)
        out = np.empty(src.shape, dtype=src.dtype)
        if out.nbytes:
            ptr = self._stream_ptr(stream)
            self._rt.memcpyAsync(int(out.ctypes.data), int(src.data.ptr), int(out.nbytes),
                                 self._rt.memcpyDeviceToHost, ptr)
            self._rt.streamSynchronize(ptr)
        return out

    def to_device(self, src: np.ndarray) -> Any | None:
        """A new device array holding `src`, copied synchronously; None when the device has no room."""
        src = np.asarray(src)
        arr = self.alloc(src.shape, src.dtype)
        if arr is None:
            return None
        self.upload(arr, src)
        self._rt.streamSynchronize(self._stream_ptr(None))
        return arr

    def new_stream(self) -> Any:
        """A non-blocking stream (no implicit ordering with the legacy default stream)."""
        return self._cp.cuda.Stream(non_blocking=True)

    def new_event(self) -> Any:
        """An event without timing (cheaper to record and wait on)."""
        return self._cp.cuda.Event(disable_timing=True)

    def record(self, event: Any, stream: Any) -> None:
        """Record `event` on `stream` (None: the current stream)."""
        event.record(stream if stream is not None else self._cp.cuda.get_current_stream())

    def wait(self, stream: Any, event: Any) -> None:
        """Make `stream` (None: the current stream) wait for `event`."""
        (stream if stream is not None else self._cp.cuda.get_current_stream()).wait_event(event)

    def synchronize(self, stream: Any = None) -> None:
        """Block until `stream` is idle, or the whole device when stream is None."""
        if stream is None:
            self._device.synchronize()
        else:
            stream.synchronize()

    def release_cached(self) -> None:
        """Wait for the device, then hand cupy's cached unused blocks back to the driver (a session's closer)."""
        self._device.synchronize()
        self._cp.get_default_memory_pool().free_all_blocks()
        self._cp.get_default_pinned_memory_pool().free_all_blocks()

    def mem_info(self) -> tuple[int, int]:
        """(free_bytes, total_bytes): the driver's free memory plus what cupy's pool holds unused (ours to reuse)."""
        free, total = self._rt.memGetInfo()
        return int(free) + int(self._cp.get_default_memory_pool().free_bytes()), int(total)
