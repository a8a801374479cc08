"""The SYCL KernelSet: strata_core's shared OpenCL C source (moe.cl) built and launched through dpctl.program.

Kernels run on the device's default in-order queue (the stream None of `SyclDeviceMemory`), so they are ordered
after uploads on that stream and before downloads from it. Numpy inputs are accepted and uploaded for the call;
outputs are device arrays (UsmArray), the caller's `out` where given. The kernel methods themselves are
strata_core's OpenClKernels; this module supplies dpctl's way to build, convert arguments (a USM pointer, already at
the view's offset, and offset 0 per array) and submit.
"""

from __future__ import annotations

import ctypes
from collections import deque
from typing import Any

from strata_core.kits.opencl.driver import OpenClKernels

from .memory import SyclDeviceMemory, UsmArray
from .runtime import Session


class SyclKernels(OpenClKernels):
    """KernelSet of one SYCL device; the contract is strata_core.reference.kernels."""

    name = "sycl-opencl-c"
    label = "sycl"
    memory_type = SyclDeviceMemory

    def __init__(self, session: Session, memory: SyclDeviceMemory | None = None):
        self._dpctl = session.dpctl
        # Arguments and temporaries of submitted work, kept referenced until their event completes (dpctl frees USM
        # on garbage collection, which would pull memory from under a running kernel).
        self._inflight: deque[tuple[Any, tuple]] = deque()
        super().__init__(session, memory)

    def _build(self, session: Session, source: str) -> Any:
        return self._dpctl.program.create_program_from_source(session.queue, source)

    def _get_kernel(self, name: str) -> Any:
        return self._program.get_sycl_kernel(name)

    def _retire(self) -> None:
        # One in-order queue completes its kernels in order: the finished ones are at the front.
        while self._inflight and self._inflight[0][0].execution_status.name == "complete":
            self._inflight.popleft()

    def _buffer_arg(self, a: UsmArray) -> Any:
        return a.mem

    def _i32_arg(self, v: Any) -> Any:
        # dpctl takes scalars as ctypes values: a numpy scalar is not a kernel argument it knows.
        return ctypes.c_int32(int(v))

    def _i64_arg(self, v: Any) -> Any:
        return ctypes.c_int64(int(v))

    def _f32_arg(self, v: Any) -> Any:
        return ctypes.c_float(float(v))

    def _local_arg(self, floats: int) -> Any:
        return self._dpctl.LocalAccessor("f4", (floats,))

    def _submit(self, name: str, global_size: tuple[int, ...], local_size: tuple[int, ...] | None,
                args: list[Any], keep: tuple) -> Any:
        # SYCL ranges list the slowest dimension first, the reverse of OpenCL's order.
        gs = list(reversed(global_size))
        ls = list(reversed(local_size)) if local_size is not None else None
        # submit_async, not submit: dpctl's submit waits for the kernel, which would serialize host and device.
        ev = self.session.queue.submit_async(self._kernel(name), args, gs, ls)
        self._retire()
        # Every USM argument stays referenced until the kernel is done: a caller may drop an intermediate array
        # right after passing it on, and dpctl frees USM at once on garbage collection.
        self._inflight.append((ev, (args, keep)))
        return ev
