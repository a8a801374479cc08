"""The 'opencl' backend (entry point strata.backends: opencl): any OpenCL device, through pyopencl.

Platform rules of this plugin (each a default; settings and site plugins override):
- chunk ceiling 4096 tokens: OpenCL drivers differ widely, and the smaller chunk keeps the prompt path's loan small;
- no page-locked memory unless the platform offers host-visible memory (CL_MEM_ALLOC_HOST_PTR buffers that map):
  then pinned buffers are such mapped buffers; otherwise the pinned allocator returns None for every request and
  the plan gets no page-locked floor. For a device of this machine the offer is tested; for a profile of another
  machine only a unified-memory device is assumed to offer it.
Written as a third party would: only strata-core's public API and pyopencl. Imports without pyopencl.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from strata_core.api.backend import Backend, ProbeResult
from strata_core.api.facts import DeviceInfo, HostInfo, PlatformDefaults
from strata_core.api.hookspecs import hookimpl
from strata_core.kits.opencl.driver import backend_hooks, device_score

from . import INSTALL_HINT, __version__

NAME = "opencl"

#: The strata hook API this plugin was written against: a core of another major version refuses it, as it should.
API_VERSION = "1.0"

#: Largest prompt chunk the auto choice may take on an OpenCL device, in tokens.
CHUNK_CEILING_TOKENS = 4096

#: Selection scores: below the sycl backend on the same device (20 for a CPU device, 100+ for a GPU), above cpu's 10.
SCORE_DISCRETE_GPU = 90
SCORE_INTEGRATED_GPU = 80
SCORE_ACCELERATOR = 40
SCORE_CPU_DEVICE = 15


def score_for(device: DeviceInfo) -> int:
    """Selection score of one device: discrete GPU > integrated GPU > accelerator > CPU device."""
    return device_score(device, SCORE_DISCRETE_GPU, SCORE_INTEGRATED_GPU, SCORE_ACCELERATOR, SCORE_CPU_DEVICE)


def _vendor(vendor_string: str) -> str:
    v = vendor_string.lower()
    for key, name in (("nvidia", "nvidia"), ("advanced micro", "amd"), ("amd", "amd"), ("intel", "intel"),
                      ("apple", "apple"), ("arm", "arm"), ("qualcomm", "qualcomm")):
        if key in v:
            return name
    return v.split()[0] if v.split() else "unknown"


def _host_free_bytes() -> int | None:
    """Free physical memory of this host, where the OS tells it through sysconf (Linux), else None."""
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return None


def device_info(cl: Any, dev: Any, index: int) -> DeviceInfo:
    """The DeviceInfo of one pyopencl device."""
    from .runtime import device_kind
    kind = device_kind(cl, dev)
    total = int(dev.global_mem_size)
    free = total
    if kind == "cpu":
        host_free = _host_free_bytes()
        free = min(total, host_free) if host_free else total
        driver = "host"
    else:
        driver = "wddm" if sys.platform == "win32" else "linux"
        try:
            free = min(total, int(dev.global_free_memory_amd[0]) * 1024)  # AMD reports KiB
        except Exception:  # an AMD extension; other platforms do not report free memory
            pass
    try:
        unified = bool(dev.host_unified_memory)
    except Exception:  # deprecated in OpenCL 2.0+, absent on some platforms
        unified = kind == "cpu"
    return DeviceInfo(backend=NAME, name=str(dev.name).strip(), vram_total_bytes=total, vram_free_bytes=free,
                      vendor=_vendor(str(dev.vendor)), arch=kind, driver_model=driver, index=index,
                      unified_memory=unified or kind == "cpu")


def probe() -> ProbeResult:
    """The OpenCL platforms and devices pyopencl sees, GPUs first. Never raises."""
    try:
        from .runtime import list_devices, load_pyopencl
        cl = load_pyopencl()
    except ImportError as e:
        return ProbeResult.unavailable(f"pyopencl is not installed ({e})")
    except Exception as e:  # a broken installation must read as 'unavailable'
        return ProbeResult.unavailable(f"pyopencl failed to load: {type(e).__name__}: {e}")
    version = f"pyopencl {getattr(cl, 'VERSION_TEXT', '?')}"
    try:
        devs = list_devices(cl)
        if not devs:
            return ProbeResult.unavailable("no OpenCL platform or device found (install a driver's ICD, or "
                                           "'pip install strata-opencl[cpu]' for Intel's CPU runtime)",
                                           version=version)
        infos = tuple(device_info(cl, d, i) for i, (_, _, d) in enumerate(devs))
        platforms = sorted({str(cl.get_platforms()[p].name).strip() for p, _, _ in devs})
    except Exception as e:
        return ProbeResult.unavailable(f"OpenCL device query failed: {type(e).__name__}: {e}", version=version)
    described = ", ".join(f"{d.arch} {d.name}" for d in infos)
    return ProbeResult(available=True, reason=f"{len(infos)} OpenCL device(s) on {', '.join(platforms)}: {described}",
                       devices=infos, score=max(score_for(d) for d in infos), version=version)


def _locate(device: DeviceInfo) -> tuple[int, int]:
    """(platform number, device number) of the live device a DeviceInfo names; LookupError when absent here."""
    from .runtime import list_devices, load_pyopencl
    try:
        devs = list_devices(load_pyopencl())
    except ImportError as e:
        raise LookupError(f"opencl backend is not available: pyopencl is not installed ({e}); "
                          f"install: {INSTALL_HINT}") from None
    if 0 <= device.index < len(devs) and str(devs[device.index][2].name).strip() == device.name:
        return devs[device.index][0], devs[device.index][1]
    for p, d, dev in devs:
        if str(dev.name).strip() == device.name:
            return p, d
    raise LookupError(f"opencl: device {device.name!r} (index {device.index}) is not present on this machine")


def _session(device: DeviceInfo):
    from .runtime import session_for
    return session_for(*_locate(device))


def offers_host_visible_memory(device: DeviceInfo) -> bool:
    """Whether the platform offers mapped host-visible buffers (tested live; on a profile: unified memory only)."""
    try:
        return _session(device).offers_host_visible_memory()
    except Exception:  # not on this machine (a profile), or no pyopencl: decide from the facts
        return device.unified_memory


def platform_defaults(device: DeviceInfo, host: HostInfo, host_visible: bool) -> PlatformDefaults:
    """The OpenCL platform rules (module docstring) given whether host-visible memory is offered."""
    on_cpu = device.arch == "cpu" or device.driver_model == "host"
    pin = {} if host_visible else {"pin_cap_bytes": 0, "pin_floor_bytes": 0}
    return PlatformDefaults(
        chunk_ceiling_tokens=CHUNK_CEILING_TOKENS,
        cpu_share_default=not on_cpu,
        cpu_share_reason="the OpenCL device is the CPU" if on_cpu else "the platform default",
        source="opencl plugin" + ("" if host_visible else " (no host-visible memory: nothing page-locked)"),
        **pin,
    )


class NoPinnedMemory:
    """The allocator of a platform without host-visible memory: every request gets None, nothing is charged."""

    kind = "none"

    def alloc(self, nbytes, from_floor=False):
        """None: nothing can be page-locked here."""
        return None

    def register(self, array, from_floor=False):
        """None: nothing can be page-locked here."""
        return None

    def free(self, buf):
        """Nothing was allocated."""


BACKEND = Backend(name=NAME, vendor="opencl", probe=probe, version=__version__, api_version=API_VERSION,
                  install_hint=INSTALL_HINT, description="any OpenCL device through pyopencl (third-party plugin)")


@hookimpl
def strata_probe(backend):
    """The OpenCL probe for this plugin's backend; None for any other."""
    return probe() if backend.name == NAME else None


@hookimpl
def strata_platform_defaults(device, host):
    """OpenCL platform defaults for an opencl device."""
    if device.backend != NAME:
        return None
    return platform_defaults(device, host, offers_host_visible_memory(device))


@hookimpl
def strata_pinned_allocator(device, budget):
    """Mapped CL_MEM_ALLOC_HOST_PTR buffers charged to `budget`, or an allocator that always says no."""
    if device.backend != NAME:
        return None
    try:
        session = _session(device)
        if not session.offers_host_visible_memory():
            return NoPinnedMemory()
        from .memory import ClPinnedAllocator
        return ClPinnedAllocator(session, budget)
    except Exception:  # a pinned allocator is optional: without a usable device, nothing is page-locked
        return NoPinnedMemory()


#: The opencl backend, its cl.Buffer device arrays and in-order queues, and moe.cl through pyopencl.
strata_backends, strata_device_memory, strata_kernels = backend_hooks(
    BACKEND, _session, __package__, device_memory=".memory:ClDeviceMemory", kernels=".kernels:ClKernels")
