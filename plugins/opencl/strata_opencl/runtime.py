"""The pyopencl side of the plugin: the ICD loader's environment, lazy import, devices and per-device sessions.

A session is one OpenCL context on one device with its default in-order queue and the built program; device
memory, pinned buffers and kernels of a device all come from its session, so their buffers are interchangeable.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from strata_core.kits.opencl import QueueSession, QueueStream
from strata_core.kits.opencl import find_intel_opencl_runtime as _find_runtime

_lock = threading.Lock()
_sessions: dict[tuple[int, int], "Session"] = {}


def find_intel_opencl_runtime() -> Path | None:
    """The Intel OpenCL CPU runtime library installed by the intel-opencl-rt package, or None when it is absent."""
    # The search is strata_core's; this environment's prefix is where a conda-style install would have put it.
    return _find_runtime(sys.prefix)


#: Where the ICD loader looks for the system's OpenCL drivers (ocl-icd and the Khronos loader on Linux).
SYSTEM_VENDORS_DIR = Path("/etc/OpenCL/vendors")


def _prepare_runtime_env() -> None:
    """Point the OpenCL ICD loader at the runtime intel-opencl-rt installed, before pyopencl loads it.

    The one place this plugin touches the environment, and it only writes: a pip-installed runtime is not in the
    system's vendors directory, so without this the loader would not find it. OCL_ICD_VENDORS replaces that
    directory (pyopencl's bundled loader reads no OCL_ICD_FILENAMES), so it is set only where the system registers
    no driver of its own: a GPU's ICD is never hidden. A value the user set is left alone, and nothing happens when
    the package is not installed.
    """
    lib = find_intel_opencl_runtime()
    if lib is None:
        return
    try:
        system_icds = any(SYSTEM_VENDORS_DIR.glob("*.icd"))
    except OSError:
        system_icds = False
    if not system_icds:
        os.environ.setdefault("OCL_ICD_VENDORS", str(lib))


def load_pyopencl() -> ModuleType:
    """Import pyopencl after preparing the loader; ImportError when it is not installed."""
    _prepare_runtime_env()
    import pyopencl
    return pyopencl


_TYPE_RANK = {"gpu": 0, "accelerator": 1, "cpu": 2}


def device_kind(cl: ModuleType, dev: Any) -> str:
    """'gpu', 'accelerator', 'cpu' or 'other'."""
    t = int(dev.type)
    if t & cl.device_type.GPU:
        return "gpu"
    if t & cl.device_type.ACCELERATOR:
        return "accelerator"
    if t & cl.device_type.CPU:
        return "cpu"
    return "other"


def list_devices(cl: ModuleType) -> list[tuple[int, int, Any]]:
    """Every OpenCL device as (platform number, device number, device), GPUs first; [] when there is no platform."""
    out = []
    try:
        platforms = cl.get_platforms()
    except cl.Error:
        return []  # the ICD loader reports 'no platform' as an error
    for pi, p in enumerate(platforms):
        try:
            devs = p.get_devices()
        except cl.Error:
            continue  # a platform without devices of any type
        out.extend((pi, di, d) for di, d in enumerate(devs))
    return sorted(out, key=lambda e: (_TYPE_RANK.get(device_kind(cl, e[2]), 3), e[0], e[1]))


class ClStream(QueueStream):
    """A stream: one in-order command queue."""

    __slots__ = ()


@dataclass
class Session(QueueSession):
    """One device's context, default in-order queue, built program, the queues made since, and bytes allocated."""

    cl: ModuleType | None = None
    host_visible: bool | None = None

    stream_type = ClStream

    def _new_queue(self) -> Any:
        return self.cl.CommandQueue(self.context, self.device)

    def wait_queue(self, queue: Any) -> None:
        """Block until one command queue of this session is idle."""
        queue.finish()

    def offers_host_visible_memory(self) -> bool:
        """Whether CL_MEM_ALLOC_HOST_PTR buffers can be created and mapped here (checked once, on a small buffer)."""
        if self.host_visible is None:
            cl = self.cl
            try:
                buf = cl.Buffer(self.context, cl.mem_flags.READ_WRITE | cl.mem_flags.ALLOC_HOST_PTR, 4096)
                arr, _ = cl.enqueue_map_buffer(self.queue, buf, cl.map_flags.READ | cl.map_flags.WRITE, 0,
                                               (4096,), "uint8", is_blocking=True)
                arr[:] = 1
                arr.base.release(self.queue)
                buf.release()
                self.host_visible = True
            except Exception:  # any refusal means the platform does not offer it
                self.host_visible = False
        return self.host_visible


def session_for(platform_index: int, device_index: int) -> Session:
    """The session of a device (created once per process), by platform and device number."""
    key = (platform_index, device_index)
    with _lock:
        s = _sessions.get(key)
        if s is None:
            cl = load_pyopencl()
            dev = cl.get_platforms()[platform_index].get_devices()[device_index]
            ctx = cl.Context([dev])
            s = Session(cl=cl, device=dev, context=ctx, queue=cl.CommandQueue(ctx, dev))
            _sessions[key] = s
        return s
