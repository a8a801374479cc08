"""The 'opencl' backend (entry point strata.backends: opencl; API 2.0): any OpenCL device, through pyopencl.

Platform rules of this plugin (each a default; settings and site plugins override):
- chunk ceiling 4096 tokens: OpenCL drivers differ widely, and the smaller chunk keeps the prompt path's loan small;
- no page-locked memory unless the platform offers host-visible memory (CL_MEM_ALLOC_HOST_PTR buffers that map):
  then pinned buffers are such mapped buffers; otherwise the pinned allocator returns None for every request and
  the plan gets no page-locked floor. For a device of this machine the offer is tested; for a profile of another
  machine only a unified-memory device is assumed to offer it;
- no page-locked cap of its own: under WDDM the planner's platform cap applies (about half of RAM), never more.
Caps: copies from mapped host-visible buffers are non-blocking on their own in-order queue, which overlaps the
kernels on a GPU (on a CPU device both are host threads: no overlap is claimed); no graph capture, no peer copies,
no fused layer ops; kernels never read host memory in place (every input is a device buffer).
Written as a third party would: only strata-core's contract (`strata_core.api`), its OpenCL kit
(`strata_core.kits.opencl`) and pyopencl. Imports without pyopencl.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from strata_core.api import DeviceCaps, DeviceInfo, HostInfo, PinnedBudget, PlatformDefaults, ProbeResult
from strata_core.kits.opencl import EXPERT_FORMATS, MoeClBackend, MoeClDevice, device_score, device_type_of

from . import INSTALL_HINT, __version__

NAME = "opencl"

#: The strata contract this plugin was written against: a core of another major version refuses it, as it should.
API_VERSION = "2.0"

#: What to install where no OpenCL platform is found: Intel's CPU runtime (the plugin finds it without any variable).
CPU_RUNTIME_HINT = "pip install 'strata-opencl[cpu]'"

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


def device_info(cl: Any, dev: Any, index: int, host_visible: bool = False) -> DeviceInfo:
    """The DeviceInfo of one pyopencl device; `host_visible`: the platform offers mapped host-visible buffers."""
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
    unified = unified or kind == "cpu"
    return DeviceInfo(backend=NAME, name=str(dev.name).strip(), vram_total_bytes=total, vram_free_bytes=free,
                      vendor=_vendor(str(dev.vendor)), arch=kind, driver_model=driver, index=index,
                      unified_memory=unified, device_type=device_type_of(kind, unified),
                      caps=DeviceCaps(async_copies=host_visible and kind != "cpu", expert_formats=EXPERT_FORMATS))


def _offers_host_visible(cl: Any, platform_index: int, device_index: int) -> bool:
    """Whether this live device offers mapped host-visible buffers (tested once per process, on its session)."""
    from .runtime import session_for
    try:
        return session_for(platform_index, device_index).offers_host_visible_memory()
    except Exception:  # a device that cannot even make a context offers nothing
        return False


def probe() -> ProbeResult:
    """The OpenCL platforms and devices pyopencl sees, GPUs first. Never raises."""
    try:
        from .runtime import list_devices, load_pyopencl
        cl = load_pyopencl()
    except ImportError as e:  # the one outcome the install line fixes
        return ProbeResult.unavailable(f"pyopencl is not installed ({e})")
    except Exception as e:  # a broken installation must read as 'unavailable'
        return ProbeResult.unavailable(f"pyopencl failed to load: {type(e).__name__}: {e}")
    version = f"pyopencl {getattr(cl, 'VERSION_TEXT', '?')}"
    try:
        devs = list_devices(cl)
        if not devs:
            return ProbeResult.unavailable("no OpenCL platform or device found (install a driver's ICD, or Intel's "
                                           "CPU runtime)", version=version, install_hint=CPU_RUNTIME_HINT)
        infos = tuple(device_info(cl, d, i, _offers_host_visible(cl, p, n)) for i, (p, n, d) in enumerate(devs))
        platforms = sorted({str(cl.get_platforms()[p].name).strip() for p, _, _ in devs})
    except Exception as e:
        return ProbeResult.unavailable(f"OpenCL device query failed: {type(e).__name__}: {e}", version=version,
                                       install_hint="")
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
    """The pyopencl session of the live device a DeviceInfo names (created once per process)."""
    from .runtime import session_for
    return session_for(*_locate(device))


def offers_host_visible_memory(device: MoeClDevice) -> bool:
    """Whether the platform offers mapped host-visible buffers (tested live; on a profile: unified memory only)."""
    if not device.present:
        return device.info.unified_memory
    try:
        return _session(device.info).offers_host_visible_memory()
    except Exception:  # no pyopencl, or the device went away: decide from the facts
        return device.info.unified_memory


def platform_defaults(device: DeviceInfo, host: HostInfo, host_visible: bool) -> PlatformDefaults:
    """The OpenCL platform rules (module docstring) given whether host-visible memory is offered."""
    on_cpu = device.arch == "cpu" or device.driver_model == "host"
    # without host-visible memory nothing can be page-locked: a zero cap and floor only ever lower the platform's
    pin = {} if host_visible else {"pin_cap_bytes": 0, "pin_floor_bytes": 0}
    return PlatformDefaults(
        chunk_ceiling_tokens=CHUNK_CEILING_TOKENS,
        cpu_share_default=not on_cpu,
        cpu_share_reason="the OpenCL device is the CPU" if on_cpu else "the platform default",
        source="opencl plugin" + ("" if host_visible else " (no host-visible memory: nothing page-locked)"),
        **pin,
    )


def _pinned(session: Any, budget: PinnedBudget):
    """Mapped CL_MEM_ALLOC_HOST_PTR buffers charged to `budget`; None where the platform offers none."""
    if not session.offers_host_visible_memory():
        return None
    from .memory import ClPinnedAllocator
    return ClPinnedAllocator(session, budget)


#: The opencl backend: its devices, their cl.Buffer device arrays and in-order queues, and moe.cl through pyopencl.
PLUGIN = MoeClBackend(
    name=NAME, vendor="opencl", version=__version__, api_version=API_VERSION, install_hint=INSTALL_HINT,
    description="any OpenCL device through pyopencl (third-party plugin)", probe=probe,
    defaults=lambda device, host: platform_defaults(device.info, host, offers_host_visible_memory(device)),
    session_of=_session, package=__package__, device_memory=".memory:ClDeviceMemory", kernels=".kernels:ClKernels",
    pinned=_pinned)
BACKEND = PLUGIN.backend

# The entry point names this module, so the hookimpl is its attribute (pluggy reads bound methods' markers).
strata_backends = PLUGIN.strata_backends
