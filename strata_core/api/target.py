"""Target: the one resolution every command makes (settings -> registry -> backend, device, host, defaults)."""

from __future__ import annotations

from dataclasses import dataclass

from strata_core.api.backend import Backend, Device
from strata_core.api.facts import DeviceInfo, HostInfo, PlatformDefaults


@dataclass(frozen=True)
class Target:
    """The backend, the device, the host facts and that device's platform defaults on that host (versionadded 2.0).

    Made once per command by `strata_core.registry.PluginHost.resolve_target`; the planner plans for it,
    `strata_adjust_plan` receives it, and the engine opens `device`. `origin` says where the facts came from:
    'this machine', or the profile or scenario file they were read from.
    """

    backend: Backend
    device: Device
    host: HostInfo
    defaults: PlatformDefaults
    origin: str = "this machine"

    @property
    def info(self) -> DeviceInfo:
        """The device's facts."""
        return self.device.info
