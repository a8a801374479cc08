"""The dpctl side of the SYCL backend: the vendor runtime's environment, lazy import, devices and per-device sessions.

A session is one SYCL context on one device with its default in-order queue; device memory, pinned host memory and
kernels of a device all come from its session, so a USM pointer made by one is valid in the others.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from strata_core.kits.opencl.driver import QueueSession, QueueStream
from strata_core.kits.opencl.driver import find_intel_opencl_runtime as _find_runtime

_lock = threading.Lock()
_sessions: dict[str, "Session"] = {}


def find_intel_opencl_runtime() -> Path | None:
    """The Intel OpenCL CPU runtime library installed by the intel-opencl-rt package, or None when it is absent."""
    # The search is strata_core's; this environment's prefix is where a conda-style install would have put it.
    return _find_runtime(sys.prefix)


def _prepare_runtime_env() -> None:
    """Point the OpenCL ICD loader at the runtime the [sycl] extra installed, before dpctl loads it.

    This is the one place the backend touches the environment, and it only writes: a user who installs the extra
    sets nothing by hand, so the loader must learn where intel-opencl-rt put its library. OCL_ICD_FILENAMES (and not
    the vendors directory) is used because it makes the loader see that runtime alone: an ICD such as PoCL, if the
    system registers one, aborts SYCL's OpenCL adapter. A value the user did set is left as it is.
    """
    lib = find_intel_opencl_runtime()
    if lib is not None:
        os.environ.setdefault("OCL_ICD_FILENAMES", str(lib))


def load_dpctl() -> ModuleType:
    """Import dpctl (and its memory and program modules) after preparing the runtime; ImportError when absent."""
    _prepare_runtime_env()
    import dpctl
    import dpctl.memory  # noqa: F401  (submodules used through the package)
    import dpctl.program  # noqa: F401
    return dpctl


#: OpenCL platforms kept out of SYCL: PoCL's CPU runtime has been seen to abort SYCL's OpenCL adapter (the whole
#: process, beyond any try/except), so its devices are never opened through dpctl; the opencl plugin serves them.
EXCLUDED_PLATFORMS = ("portable computing language",)


def excluded(dev: Any) -> bool:
    """True for a device of a platform in EXCLUDED_PLATFORMS."""
    try:
        name = str(dev.sycl_platform.name).lower()
    except Exception:  # a platform that cannot even name itself is not one to open
        return True
    return any(p in name for p in EXCLUDED_PLATFORMS)


def usable_devices(dpctl: ModuleType) -> list[Any]:
    """The SYCL devices our kernels can run on (OpenCL backend, USM device memory, PoCL excepted), GPUs first."""
    devs = [d for d in dpctl.get_devices()
            if d.backend.name == "opencl" and not excluded(d) and d.has_aspect_usm_device_allocations]
    rank = {"gpu": 0, "accelerator": 1, "cpu": 2}
    return sorted(devs, key=lambda d: (rank.get(d.device_type.name, 3), d.filter_string))


def all_device_names(dpctl: ModuleType) -> list[str]:
    """Every SYCL device as 'backend:type name', for the reason when none is usable."""
    return [f"{d.backend.name}:{d.device_type.name} {d.name}" for d in dpctl.get_devices()]


class SyclStream(QueueStream):
    """A stream of the runtime: one in-order SYCL queue (held by a Python object so the session can track it weakly)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"SyclStream({self.queue.sycl_device.name})"


@dataclass
class Session(QueueSession):
    """One device's SYCL context, its default in-order queue, the queues made since, and the bytes allocated."""

    dpctl: ModuleType | None = None

    stream_type = SyclStream

    def _new_queue(self) -> Any:
        return self.dpctl.SyclQueue(self.context, self.device, property="in_order")

    def wait_queue(self, queue: Any) -> None:
        """Block until one SYCL queue of this session is idle."""
        queue.wait()


def session_for(filter_string: str) -> Session:
    """The session of a device (created once per process), by its SYCL filter string."""
    with _lock:
        s = _sessions.get(filter_string)
        if s is None:
            dpctl = load_dpctl()
            dev = dpctl.SyclDevice(filter_string)
            ctx = dpctl.SyclContext(dev)
            q = dpctl.SyclQueue(ctx, dev, property="in_order")
            s = Session(dpctl=dpctl, device=dev, context=ctx, queue=q)
            _sessions[filter_string] = s
        return s
