"""Kernel launches with programmatic dependent launch (PDL, sm_90 and later) through the driver's cuLaunchKernelEx.

A kernel launched this way may start while the kernel before it in the stream drains: its blocks become resident and
run up to `griddepcontrol.wait` (STRATA_GRID_WAIT in moe_fast.cu), which returns once the previous kernel's writes
are visible. The decode stack is 3 kernels a layer; launched plainly each boundary idles the chip while the last
blocks finish and the next grid ramps up. Captured into a CUDA graph the launches keep their programmatic edges.

cupy launches through cuLaunchKernel, which takes no launch attributes, so this module calls the driver through
ctypes with the CUfunction cupy compiled (`RawKernel.kernel.ptr`). `Launcher.available()` is False where the driver lacks the
entry point; callers then launch plainly (the kernels' wait is a no-op without the attribute).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

#: CUlaunchAttributeID of cuda.h: CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _Attr(ctypes.Structure):
    # CUlaunchAttribute: the id, padding to 8 bytes, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("value", ctypes.c_int * 16)]


class _Config(ctypes.Structure):
    # CUlaunchConfig
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attr)),
                ("n_attrs", ctypes.c_uint)]


def _c_value(v: Any) -> Any:
    """A kernel argument as the ctypes value whose address cuLaunchKernelEx reads."""
    if isinstance(v, np.generic):
        kinds = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.uint32): ctypes.c_uint32,
                 np.dtype(np.int64): ctypes.c_int64, np.dtype(np.uint64): ctypes.c_uint64,
                 np.dtype(np.float32): ctypes.c_float}
        t = kinds.get(v.dtype)
        if t is None:
            raise TypeError(f"pdl launch: no kernel argument type for {v.dtype}")
        return t(v.item())
    data = getattr(v, "data", None)
    if data is not None and hasattr(data, "ptr"):  # a cupy array: its device address
        return ctypes.c_uint64(int(data.ptr))
    raise TypeError(f"pdl launch: pass numpy scalars or cupy arrays, not {type(v).__name__}")


class Launcher:
    """Launches cupy-compiled kernels with the programmatic-serialization attribute set."""

    def __init__(self, enabled: bool = True) -> None:
        self._fn = None
        if not enabled:  # a device without programmatic launches (before sm_90)
            return
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            fn = lib.cuLaunchKernelEx
        except (OSError, AttributeError):  # no driver library, or one older than CUDA 12
            return
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self._fn = fn
        self._attr = _Attr()
        self._attr.id = _ATTR_PROGRAMMATIC_STREAM_SERIALIZATION
        self._attr.value[0] = 1

    def available(self) -> bool:
        """Does the driver have cuLaunchKernelEx?"""
        return self._fn is not None

    def launch(self, kernel: Any, grid: tuple, block: tuple, args: tuple, stream_ptr: int) -> None:
        """kernel(grid, block, args) on the stream, as a programmatic dependent launch; raises on a driver error."""
        g = tuple(grid) + (1,) * (3 - len(grid))
        b = tuple(block) + (1,) * (3 - len(block))
        cfg = _Config(g[0], g[1], g[2], b[0], b[1], b[2], 0, ctypes.c_void_p(int(stream_ptr) or None),
                      ctypes.pointer(self._attr), 1)
        values = [_c_value(a) for a in args]
        params = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
        # cupy's RawModule hands out RawKernels, whose compiled Function (with the CUfunction) is .kernel
        fn = getattr(kernel, "kernel", kernel)
        rc = self._fn(ctypes.byref(cfg), ctypes.c_void_p(int(fn.ptr)), params, None)
        if rc != 0:
            raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {rc}")
