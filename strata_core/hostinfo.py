"""The core's own reading of the host (psutil and /proc/cpuinfo): what `strata_host_info` falls back to."""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import psutil

from strata_core.api.facts import CpuInfo, HostInfo

_FLAGS_OF_INTEREST = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "amx_tile", "neon", "sve")


def _cpu_flags() -> tuple[str, ...]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            have = set(line.split(":", 1)[1].split())
            return tuple(f for f in _FLAGS_OF_INTEREST if f in have)
    return ()


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def virtualization(proc_version: Path = Path("/proc/version"), dockerenv: Path = Path("/.dockerenv")) -> str:
    """'docker-wsl2', 'wsl2' or 'none', from the kernel's version string and Docker's marker file (facts, not settings)."""
    try:
        wsl = "microsoft" in proc_version.read_text().lower()
    except OSError:
        wsl = False
    if not wsl:
        return "none"
    return "docker-wsl2" if dockerenv.exists() else "wsl2"


def probe_host() -> HostInfo:
    """HostInfo of this machine. The page-locked limit is unknown to the core (None); a backend may refine it."""
    vm = psutil.virtual_memory()
    os_name = {"win32": "windows", "darwin": "macos"}.get(sys.platform, "linux")
    return HostInfo(os=os_name, ram_total_bytes=int(vm.total), ram_available_bytes=int(vm.available),
                    pinnable_bytes=None,
                    cpu=CpuInfo(name=_cpu_name(), cores=psutil.cpu_count(logical=False) or 1, flags=_cpu_flags()),
                    virtualization=virtualization() if os_name == "linux" else "none")
