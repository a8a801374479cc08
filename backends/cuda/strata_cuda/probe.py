"""The NVIDIA probe: which CUDA devices there are, with their facts, and why not when there are none. Never raises.

Devices are enumerated through cupy's runtime (cudaGetDeviceCount and cudaGetDeviceProperties create no context,
and they honour the CUDA device order the process was given); the memory, display and driver-model facts come from
NVML (nvidia-ml-py), matched by PCI bus id, so probing creates no CUDA context either. Without NVML the probe falls
back to cudaMemGetInfo, which does create one.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from strata_core.backend_api import ProbeResult
from strata_core.facts import GIB, DeviceInfo

NAME = "cuda"
INSTALL_HINT = "pip install 'strata-core[cuda]'"

#: A usable GPU outranks the cpu backend (10) and the sim backend (0); a larger card outranks a smaller one.
BASE_SCORE = 100

#: NVML's driver models (nvmlDriverModel_t) by value.
_NVML_DRIVER_MODELS = {0: "wddm", 1: "tcc", 2: "mcdm"}


def _os_name() -> str:
    return {"win32": "windows", "darwin": "macos"}.get(sys.platform, "linux")


def _is_wsl() -> bool:
    """True under WSL2, whose GPU paravirtualization inherits WDDM's page-locked limits."""
    try:
        return "microsoft" in Path("/proc/version").read_text().lower()
    except OSError:
        return False


def _text(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, (bytes, bytearray)) else str(v)


def _load_nvml() -> Any | None:
    """pynvml, initialized, or None when nvidia-ml-py is missing or NVML cannot start (facts then come from cupy)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:
        return None
    return pynvml


def _nvml_facts(nvml: Any, bus_id: str, os_name: str) -> dict:
    """What NVML says about the card at `bus_id` (each fact on its own: a card may not support one query)."""
    out: dict = {}
    try:
        h = nvml.nvmlDeviceGetHandleByPciBusId(bus_id)
    except Exception:
        return out
    try:
        mem = nvml.nvmlDeviceGetMemoryInfo(h)
        out["vram_total_bytes"], out["vram_free_bytes"] = int(mem.total), int(mem.free)
    except Exception:
        pass
    try:
        out["name"] = _text(nvml.nvmlDeviceGetName(h))
    except Exception:
        pass
    try:
        out["drives_display"] = bool(nvml.nvmlDeviceGetDisplayActive(h))
    except Exception:
        pass
    if os_name == "windows":
        try:
            current = nvml.nvmlDeviceGetDriverModel(h)[0]
            out["driver_model"] = _NVML_DRIVER_MODELS.get(int(current), "wddm")
        except Exception:
            pass
    return out


def device_info(index: int, runtime: Any, nvml: Any | None, os_name: str, wsl: bool) -> DeviceInfo:
    """DeviceInfo of CUDA device `index`: NVML's facts where it has them, cupy's runtime for the rest."""
    props = runtime.getDeviceProperties(index)
    arch = f"sm_{int(props['major'])}{int(props['minor'])}"
    facts: dict = {}
    if nvml is not None:
        try:
            facts = _nvml_facts(nvml, _text(runtime.deviceGetPCIBusId(index)), os_name)
        except Exception:
            facts = {}
    if "vram_free_bytes" not in facts:
        prev = runtime.getDevice()
        runtime.setDevice(index)
        try:
            free, total = runtime.memGetInfo()
        finally:
            runtime.setDevice(prev)
        facts["vram_free_bytes"], facts["vram_total_bytes"] = int(free), int(total)
    if "driver_model" not in facts:
        if os_name == "windows":
            facts["driver_model"] = "tcc" if int(props.get("tccDriver", 0)) else "wddm"
        else:
            facts["driver_model"] = "wsl2" if wsl else "linux"
    if "drives_display" not in facts:
        # the kernel watchdog is on exactly when the card runs a display
        facts["drives_display"] = bool(int(props.get("kernelExecTimeoutEnabled", 0)))
    return DeviceInfo(backend=NAME, vendor="nvidia", name=facts.get("name") or _text(props.get("name", "")),
                      arch=arch, vram_total_bytes=facts["vram_total_bytes"], vram_free_bytes=facts["vram_free_bytes"],
                      driver_model=facts["driver_model"], drives_display=facts["drives_display"], index=index)


def probe_with(runtime: Any, nvml: Any | None = None, os_name: str | None = None, wsl: bool | None = None,
               version: str = "") -> ProbeResult:
    """Probe through the given runtime (cupy's, or a fake in tests) and NVML module; never raises."""
    os_name = os_name or _os_name()
    wsl = _is_wsl() if wsl is None else wsl
    try:
        count = int(runtime.getDeviceCount())
    except Exception as e:
        return ProbeResult.unavailable(f"cupy is installed but no CUDA device: {e}", version=version)
    if count <= 0:
        return ProbeResult.unavailable("cupy is installed but no CUDA device: cudaGetDeviceCount found 0",
                                       version=version)
    try:
        devices = tuple(device_info(i, runtime, nvml, os_name, wsl) for i in range(count))
    except Exception as e:
        return ProbeResult.unavailable(f"CUDA devices found but not readable: {type(e).__name__}: {e}",
                                       version=version)
    score = BASE_SCORE + max(d.vram_total_bytes for d in devices) // GIB
    names = ", ".join(f"{d.name} ({d.arch}, {d.vram_total_bytes / GIB:.0f} GiB)" for d in devices)
    return ProbeResult(available=True, reason=f"{count} CUDA device(s): {names}", devices=devices,
                       score=int(score), version=version)


def probe() -> ProbeResult:
    """The cuda backend's probe: cupy (the CUDA build) must import and see a device. Never raises."""
    try:
        import cupy
        from cupy.cuda import runtime
    except Exception as e:
        return ProbeResult.unavailable(f"cupy is not installed ({type(e).__name__}: {e}); install: {INSTALL_HINT}")
    try:
        if runtime.is_hip:
            return ProbeResult.unavailable(f"the installed cupy {cupy.__version__} is the ROCm build; the cuda "
                                           f"backend needs the CUDA build: {INSTALL_HINT}")
        version = f"cupy {cupy.__version__}"
        nvml = _load_nvml()
        try:
            result = probe_with(runtime, nvml=nvml, version=version)
        finally:
            if nvml is not None:
                try:
                    nvml.nvmlShutdown()
                except Exception:
                    pass
        if result.available:
            try:
                rt = runtime.runtimeGetVersion()
                result = ProbeResult(available=True, reason=result.reason, devices=result.devices,
                                     score=result.score,
                                     version=f"{version}, CUDA runtime {rt // 1000}.{rt % 1000 // 10}")
            except Exception:
                pass
        return result
    except Exception as e:  # the contract: a probe never raises
        return ProbeResult.unavailable(f"the CUDA probe failed: {type(e).__name__}: {e}")
