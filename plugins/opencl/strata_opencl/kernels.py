"""The OpenCL KernelSet: strata_core's shared OpenCL C source (moe.cl) built and launched through pyopencl.

Kernels run on the device's default in-order queue (the stream None of `ClDeviceMemory`), so they are ordered
after uploads on that queue and before downloads from it. Numpy inputs are accepted and uploaded for the call;
outputs are device arrays (ClArray), the caller's `out` where given. The kernel methods themselves are strata_core's
OpenClKernels (part of strata-core's public API); this module supplies pyopencl's way to build, convert arguments
(a buffer and an element offset per array) and enqueue.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from strata_core.kits.opencl import OpenClKernels

from .memory import ClArray, ClDeviceMemory
from .runtime import Session


class ClKernels(OpenClKernels):
    """KernelSet of one OpenCL device; the contract is strata_core.reference.kernels."""

    name = "opencl-c"
    label = "opencl"
    memory_type = ClDeviceMemory

    @property
    def cl(self) -> Any:
        """The pyopencl module of this device's session."""
        return self.session.cl

    def _build(self, session: Session, source: str) -> Any:
        with warnings.catch_warnings():
            # Build logs full of vectorizer remarks are not warnings a user can act on.
            warnings.simplefilter("ignore", self.cl.CompilerWarning)
            return self.cl.Program(session.context, source).build()

    def _get_kernel(self, name: str) -> Any:
        return self.cl.Kernel(self._program, name)

    def _buffer_arg(self, a: ClArray) -> Any:
        # the whole buffer and the view's offset as an argument: no sub-buffer, so a view at any offset (a buffer
        # carved from a plan region) is an argument without CL_DEVICE_MEM_BASE_ADDR_ALIGN or a copy
        return a.buf

    def _offset_arg(self, a: ClArray) -> Any:
        return np.int64(a.element_offset())

    def _local_arg(self, floats: int) -> Any:
        return self.cl.LocalMemory(4 * floats)

    def _submit(self, name: str, global_size: tuple[int, ...], local_size: tuple[int, ...] | None,
                args: list[Any], keep: tuple) -> Any:
        # `keep` is unused: OpenCL holds enqueued buffers itself until the commands using them are done.
        k = self._kernel(name)
        k.set_args(*args)
        return self.cl.enqueue_nd_range_kernel(self.session.queue, k, global_size, local_size)
