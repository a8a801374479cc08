"""The AMD probe: which ROCm devices cupy's HIP build sees, with their gfx arch, and why not when none. Never raises."""

from __future__ import annotations

from typing import Any

from strata_core.backend_api import ProbeResult
from strata_core.facts import GIB, DeviceInfo

NAME = "rocm"
INSTALL_HINT = "pip install 'strata-core[rocm]'"

#: A usable GPU outranks the cpu backend (10) and the sim backend (0); a larger card outranks a smaller one.
BASE_SCORE = 100


def _text(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, (bytes, bytearray)) else str(v)


def gfx_arch(gcn_arch_name: Any) -> str:
    """'gfx1201:sramecc-:xnack-' -> 'gfx1201' (the feature flags after the colon are not the arch)."""
    return _text(gcn_arch_name).split(":", 1)[0].strip()


def device_info(index: int, runtime: Any) -> DeviceInfo:
    """DeviceInfo of HIP device `index` through cupy's runtime (hipMemGetInfo needs the device current)."""
    props = runtime.getDeviceProperties(index)
    prev = runtime.getDevice()
    runtime.setDevice(index)
    try:
        free, total = runtime.memGetInfo()
    finally:
        runtime.setDevice(prev)
    return DeviceInfo(backend=NAME, vendor="amd", name=_text(props.get("name", "")),
                      arch=gfx_arch(props.get("gcnArchName", "")), vram_total_bytes=int(total),
                      vram_free_bytes=int(free), driver_model="linux",
                      # the kernel watchdog is on exactly when the card runs a display
                      drives_display=bool(int(props.get("kernelExecTimeoutEnabled", 0))), index=index)


def probe_with(runtime: Any, version: str = "") -> ProbeResult:
    """Probe through the given HIP runtime (cupy's, or a fake in tests); never raises."""
    try:
        count = int(runtime.getDeviceCount())
    except Exception as e:
        return ProbeResult.unavailable(f"cupy-rocm is installed but no ROCm device: {e}", version=version)
    if count <= 0:
        return ProbeResult.unavailable("cupy-rocm is installed but no ROCm device: hipGetDeviceCount found 0",
                                       version=version)
    try:
        devices = tuple(device_info(i, runtime) for i in range(count))
    except Exception as e:
        return ProbeResult.unavailable(f"ROCm devices found but not readable: {type(e).__name__}: {e}",
                                       version=version)
    score = BASE_SCORE + max(d.vram_total_bytes for d in devices) // GIB
    names = ", ".join(f"{d.name} ({d.arch}, {d.vram_total_bytes / GIB:.0f} GiB)" for d in devices)
    return ProbeResult(available=True, reason=f"{count} ROCm device(s): {names}", devices=devices,
                       score=int(score), version=version)


def probe() -> ProbeResult:
    """The rocm backend's probe: cupy's ROCm build must import and see a device. Never raises."""
    try:
        import cupy
        from cupy.cuda import runtime
    except Exception as e:
        return ProbeResult.unavailable(f"cupy-rocm is not installed or does not load ({type(e).__name__}: {e}); "
                                       f"install: {INSTALL_HINT}")
    try:
        if not runtime.is_hip:
            return ProbeResult.unavailable(f"cupy-rocm is not installed: the cupy here ({cupy.__version__}) is the "
                                           f"CUDA build; install: {INSTALL_HINT}")
        return probe_with(runtime, version=f"cupy {cupy.__version__} (ROCm)")
    except Exception as e:  # the contract: a probe never raises
        return ProbeResult.unavailable(f"the ROCm probe failed: {type(e).__name__}: {e}")
