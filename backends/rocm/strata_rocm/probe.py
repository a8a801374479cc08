"""The AMD probe: which ROCm devices cupy's HIP build sees, with their gfx arch, and why not when none. Never raises.

The cupy probing itself (counting, reading, scoring, the build check) is strata_cuda.probe's: cupy's runtime API is
the same on its CUDA and ROCm builds. Importing strata_cuda.probe imports no cupy.
"""

from __future__ import annotations

from typing import Any

from pathlib import Path
from typing import Any

from strata_core.api import DeviceCaps, DeviceInfo, ProbeResult
from strata_cuda.probe import (BASE_SCORE, current_os, device_type, driver_model, install_line, is_wsl, memory_info,
                               peer_copies, probe_cupy, probe_devices, text)

__all__ = ["BASE_SCORE", "INSTALL_HINT", "NAME", "device_info", "gfx_arch", "probe", "probe_with"]

NAME = "rocm"
INSTALL_HINT = install_line("rocm", Path(__file__).parent)


def gfx_arch(gcn_arch_name: Any) -> str:
    """'gfx1201:sramecc-:xnack-' -> 'gfx1201' (the feature flags after the colon are not the arch)."""
    return text(gcn_arch_name).split(":", 1)[0].strip()


def device_info(index: int, runtime: Any, count: int = 1, os_name: str = "linux", wsl: bool = False) -> DeviceInfo:
    """DeviceInfo of HIP device `index` (of `count`) through cupy's runtime."""
    props = runtime.getDeviceProperties(index)
    free, total = memory_info(runtime, index)
    return DeviceInfo(backend=NAME, vendor="amd", name=text(props.get("name", "")),
                      arch=gfx_arch(props.get("gcnArchName", "")), vram_total_bytes=total,
                      vram_free_bytes=free, driver_model=driver_model(os_name, wsl),
                      # the kernel watchdog is on exactly when the card runs a display
                      drives_display=bool(int(props.get("kernelExecTimeoutEnabled", 0))), index=index,
                      unified_memory=bool(int(props.get("integrated", 0))), device_type=device_type(props),
                      caps=DeviceCaps(peer_copies=peer_copies(runtime, index, count)))


def probe_with(runtime: Any, version: str = "", os_name: str | None = None, wsl: bool | None = None) -> ProbeResult:
    """Probe through the given HIP runtime (cupy's, or a fake in tests); never raises."""
    os_name = os_name or current_os()
    wsl = is_wsl() if wsl is None else wsl
    return probe_devices(runtime, lambda i, n: device_info(i, runtime, n, os_name, wsl), label="ROCm",
                         no_device="cupy-rocm is installed but no ROCm device", count_call="hipGetDeviceCount",
                         version=version)


def probe() -> ProbeResult:
    """The rocm probe's facts: cupy's ROCm build must import and see a device; DeviceInfo per card. Never raises.

    cupy-rocm without ROCm's libraries fails inside its import (not always with ImportError): that is the reason.
    """
    return probe_cupy(
        hip=True, label="ROCm", run=lambda runtime, v: probe_with(runtime, version=f"cupy {v} (ROCm)"),
        missing=lambda e: f"cupy-rocm is not installed or does not load ({type(e).__name__}: {e})",
        wrong_build=lambda v: f"cupy-rocm is not installed: the cupy here ({v}) is the CUDA build")
