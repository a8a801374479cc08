"""The 'sycl' backend (entry point strata.backends: sycl; API 2.0): Intel and other SYCL devices through dpctl.

Platform rules of this backend (each a default of ours; settings and site plugins override):
- chunk ceiling 8192 tokens;
- free VRAM is trusted to 90 %: Intel's drivers let allocations spill into host memory, so the reported free figure
  is not a hard wall, and a plan that fills it to the byte would page;
- pinned host memory is SYCL USM host memory (page-locked by the runtime), where the device offers it; dpctl cannot
  lock existing memory in place, so registration is refused on a GPU (on a CPU device it is budget accounting only);
- a CPU device (the Intel OpenCL CPU runtime) is the host itself: the CPU share is off by default;
- no page-locked cap of its own: under WDDM the planner's platform cap applies (about half of RAM), never more.
Caps: copies from USM host memory run asynchronously on their own in-order queue, and on a GPU that overlaps the
kernels (on a CPU device both are host threads: no overlap is claimed); no graph capture, no peer copies, no fused
layer ops; kernels never read host memory in place (every input is a USM device array), so host-mapped is off.
Only OpenCL-backend SYCL devices with USM device memory are used, because the kernels are OpenCL C
(strata_core/kits/opencl/moe.cl) built through dpctl.program; PoCL's platform is kept out (it can abort SYCL).
This module imports without dpctl; the probe then says why the backend is unavailable.
"""

from __future__ import annotations

import sys
from typing import Any

from strata_core import __version__
from strata_core.api import (API_VERSION, DeviceCaps, DeviceInfo, HostInfo, PinnedBudget, PlatformDefaults,
                             ProbeResult)
from strata_core.errors import StrataError
from strata_core.hostinfo import probe_host
from strata_core.kits.opencl import EXPERT_FORMATS, MoeClBackend, device_score, device_type_of

from . import INSTALL_HINT

NAME = "sycl"

#: Largest prompt chunk the auto choice may take on a SYCL device, in tokens.
CHUNK_CEILING_TOKENS = 8192
#: Fraction of the reported free VRAM a plan may use (drivers that spill into host memory over-report it).
FREE_VRAM_TRUST = 0.9

#: Selection scores: above the cpu backend's 10 for the same host, below any real GPU.
SCORE_DISCRETE_GPU = 120
SCORE_INTEGRATED_GPU = 100
SCORE_ACCELERATOR = 50
SCORE_CPU_DEVICE = 20

#: Intel GPU names that are discrete cards (dpctl 0.22 does not expose host_unified_memory, so the name decides).
_DISCRETE_MARKERS = ("arc", "data center", "max", "flex", "battlemage", "alchemist")


def score_for(device: DeviceInfo) -> int:
    """Selection score of one device: discrete GPU > integrated GPU > accelerator > CPU device (> the cpu backend)."""
    return device_score(device, SCORE_DISCRETE_GPU, SCORE_INTEGRATED_GPU, SCORE_ACCELERATOR, SCORE_CPU_DEVICE)


def _vendor(vendor_string: str) -> str:
    v = vendor_string.lower()
    if "intel" in v:
        return "intel"
    return v.split()[0] if v.split() else "unknown"


def device_info(dev: Any, index: int) -> DeviceInfo:
    """The DeviceInfo of one dpctl device; a CPU device's free memory is the host's available RAM."""
    kind = dev.device_type.name
    total = int(dev.global_mem_size)
    if kind == "cpu":
        free, unified, driver = min(total, probe_host().ram_available_bytes), True, "host"
    else:
        name = dev.name.lower()
        unified = kind == "gpu" and not any(m in name for m in _DISCRETE_MARKERS)
        free, driver = total, ("wddm" if sys.platform == "win32" else "linux")
    usm_host = bool(dev.has_aspect_usm_host_allocations)
    return DeviceInfo(backend=NAME, name=str(dev.name), vram_total_bytes=total, vram_free_bytes=free,
                      vendor=_vendor(str(dev.vendor)), arch=kind, driver_model=driver, index=index,
                      unified_memory=unified, device_type=device_type_of(kind, unified),
                      caps=DeviceCaps(async_copies=usm_host and kind != "cpu", expert_formats=EXPERT_FORMATS))


def probe() -> ProbeResult:
    """What dpctl sees: OpenCL-backend SYCL devices, GPUs first. Never raises."""
    try:
        from .runtime import all_device_names, find_intel_opencl_runtime, load_dpctl, usable_devices
        dpctl = load_dpctl()
    except ImportError as e:  # the one outcome the install line fixes
        return ProbeResult.unavailable(f"dpctl is not installed ({e})")
    except Exception as e:  # a broken runtime must read as 'unavailable', never break a command
        return ProbeResult.unavailable(f"dpctl failed to load: {type(e).__name__}: {e}")
    version = f"dpctl {getattr(dpctl, '__version__', '?')}"
    try:
        devs = usable_devices(dpctl)
        if not devs:
            seen = all_device_names(dpctl)
            why = ("no SYCL device found" if not seen else
                   "no OpenCL-backend SYCL device with USM device memory (the kernels are OpenCL C); found: "
                   + ", ".join(seen))
            # the [sycl] extra brings Intel's OpenCL CPU runtime: its line helps only where that runtime is missing
            runtime_here = find_intel_opencl_runtime() is not None
            return ProbeResult.unavailable(why + ("" if runtime_here else "; the Intel OpenCL CPU runtime comes with "
                                                  "the [sycl] extra (intel-opencl-rt)"),
                                           version=version, install_hint="" if runtime_here else None)
        infos = tuple(device_info(d, i) for i, d in enumerate(devs))
    except Exception as e:
        return ProbeResult.unavailable(f"SYCL device query failed: {type(e).__name__}: {e}", version=version,
                                       install_hint="")
    usm_host = {i: bool(d.has_aspect_usm_host_allocations) for i, d in enumerate(devs)}
    described = ", ".join(f"{d.arch} {d.name}" + ("" if usm_host[d.index] else " (no USM host memory: nothing pinned)")
                          for d in infos)
    # the DeviceInfo facts; BACKEND.probe wraps each into the device object the core drives
    return ProbeResult(available=True, reason=f"{len(infos)} SYCL device(s) via OpenCL: {described}",
                       devices=infos, score=max(score_for(d) for d in infos), version=version)


def platform_defaults(device: DeviceInfo, host: HostInfo) -> PlatformDefaults:
    """The SYCL platform rules (module docstring) for one device, from its facts alone (no hardware needed)."""
    on_cpu = device.arch == "cpu" or device.driver_model == "host"
    return PlatformDefaults(
        chunk_ceiling_tokens=CHUNK_CEILING_TOKENS,
        free_vram_trust=FREE_VRAM_TRUST,
        # no cap of the backend's own: the planner's platform cap (WDDM, WSL2) applies, and this may only lower it
        pin_cap_bytes=None,
        cpu_share_default=not on_cpu,
        cpu_share_reason="the SYCL device is the CPU" if on_cpu else "the platform default",
        source="sycl backend",
    )


def _session(device: DeviceInfo):
    """The dpctl session of the live device a DeviceInfo names (by index, checked by name)."""
    try:
        from .runtime import load_dpctl, session_for, usable_devices
        devs = usable_devices(load_dpctl())
    except ImportError as e:
        raise StrataError(f"sycl backend is not available: dpctl is not installed ({e}); "
                          f"install: {INSTALL_HINT}") from None
    if 0 <= device.index < len(devs) and devs[device.index].name == device.name:
        return session_for(devs[device.index].filter_string)
    for d in devs:
        if d.name == device.name:
            return session_for(d.filter_string)
    raise StrataError(f"sycl: device {device.name!r} (index {device.index}) is not present on this machine")


def _pinned(session: Any, budget: PinnedBudget):
    """USM host memory charged to `budget`; None where the device offers no USM host allocations."""
    if not bool(session.device.has_aspect_usm_host_allocations):
        return None
    from .memory import UsmPinnedAllocator
    return UsmPinnedAllocator(session, budget)


#: The sycl backend: its devices, their USM device memory and in-order queues, and moe.cl through dpctl.program.
PLUGIN = MoeClBackend(
    name=NAME, vendor="intel", version=__version__, api_version=API_VERSION, install_hint=INSTALL_HINT,
    description="SYCL devices through dpctl (USM memory, OpenCL C kernels)", probe=probe,
    defaults=lambda device, host: platform_defaults(device.info, host), session_of=_session, package=__package__,
    device_memory=".memory:SyclDeviceMemory", kernels=".kernels:SyclKernels", pinned=_pinned)
BACKEND = PLUGIN.backend

# The entry point names this module, so the hookimpl is its attribute (pluggy reads bound methods' markers).
strata_backends = PLUGIN.strata_backends
