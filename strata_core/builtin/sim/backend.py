"""The 'sim' backend: a simulated device whose facts come from a profile, with capacities and page-locked limits.

Its arrays are numpy arrays (so a run on sim computes real numbers) while every byte is counted against the
simulated device's capacity; `strata simulate` drives it in accounting-only mode. Fault injection lives in
`strata_core.builtin.sim.faults`.

The backend declares its own settings group (`[sim]`: `sim.profile`, `sim.inject`, the model in
`strata_core.builtin.sim.settings`) through `strata_settings_group`; the registry applies it (`configure`) after
loading, before any probe, and what it read stays until the next apply. One `FaultPlan` is shared by the device
memory and the pinned allocator of every session opened after a configure, so fault counters (the Nth pinned
allocation, the Nth device allocation) run over one session.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import Any

from strata_core import __version__
from strata_core.api import API_VERSION, EXPERT_FORMATS
from strata_core.api.backend import Backend, DeviceSession, PinnedBudget, ProbeResult
from strata_core.api.facts import (
    GIB, CpuInfo, DeviceCaps, DeviceInfo, DeviceType, HostInfo, PlatformDefaults, Profile, load_profile,
)
from strata_core.api.hookspecs import hookimpl
from strata_core.api.settings import SettingsGroup
from strata_core.builtin.sim.faults import FaultPlan
from strata_core.builtin.sim.memory import SimDeviceMemory, SimPinnedAllocator
from strata_core.builtin.sim.settings import SimSettings
from strata_core.reference.kernels import ReferenceKernels

NAME = "sim"

#: The device the sim backend reports when no profile is given: a 24 GiB card on a 64 GiB Linux host.
DEFAULT_PROFILE = Profile(
    backend=NAME,
    device=DeviceInfo(backend=NAME, vendor="sim", name="Simulated 24 GiB device", arch="sim",
                      vram_total_bytes=24 * GIB, vram_free_bytes=23 * GIB, driver_model="linux",
                      device_type=DeviceType.SIMULATED, caps=DeviceCaps(expert_formats=EXPERT_FORMATS)),
    host=HostInfo(os="linux", ram_total_bytes=64 * GIB, ram_available_bytes=60 * GIB, pinnable_bytes=None,
                  cpu=CpuInfo(name="Simulated CPU", cores=8, flags=("avx", "avx2", "fma", "f16c"))),
)


@dataclass
class SimConfig:
    """What the sim backend was configured with: the machine it simulates, its faults and its mode."""

    profile: Profile = DEFAULT_PROFILE
    profile_path: str | None = None
    inject: tuple[str, ...] = ()
    accounting_only: bool = False
    faults: FaultPlan = field(default_factory=FaultPlan)


_state_lock = threading.Lock()
_config = SimConfig()


def as_sim_profile(profile: Profile) -> Profile:
    """A profile's machine as the sim backend reports it: the same facts, the device's backend set to 'sim' and its
    expert formats the ones its numpy kernels compute (all of the contract's)."""
    caps = replace(profile.device.caps, expert_formats=EXPERT_FORMATS)
    return replace(profile, backend=NAME, device=replace(profile.device, backend=NAME,
                                                         device_type=DeviceType.SIMULATED, caps=caps))


def _group_values(settings: Any) -> SimSettings:
    """The sim group's values from the whole settings object, the group itself, or None (the defaults)."""
    if settings is None:
        return SimSettings()
    if isinstance(settings, SimSettings):
        return settings
    group = getattr(settings, "sim", settings)
    return SimSettings(profile=getattr(group, "profile", None), inject=list(getattr(group, "inject", None) or ()))


def configure(settings: Any = None, accounting_only: bool = False, profile: Profile | None = None) -> SimConfig:
    """(Re)configure the sim backend from its group's values (sim.profile, sim.inject), resetting its fault counters.

    `settings` is the sim group (`SimSettings`), the whole settings object, or None for the defaults. `profile`
    (already loaded) wins over `sim.profile`. Raises BadInput for an unreadable profile or a bad fault spec.
    """
    global _config
    values = _group_values(settings)
    inject = tuple(values.inject)
    faults = FaultPlan.parse(list(inject))
    path = values.profile
    if profile is None:
        profile = load_profile(path) if path else DEFAULT_PROFILE
    cfg = SimConfig(profile=as_sim_profile(profile), profile_path=str(path) if path else None, inject=inject,
                    accounting_only=bool(accounting_only), faults=faults)
    with _state_lock:
        _config = cfg
    return cfg


def current_config() -> SimConfig:
    """The configuration sessions are opened with now."""
    with _state_lock:
        return _config


@dataclass(frozen=True)
class SimDevice:
    """A simulated device: its facts, and (when a profile names the machine) the simulated host's facts.

    `simulated_host` is set when `sim.profile` gave the machine: a Target on this device then plans with that
    host rather than the one it runs on. Sessions count every byte against the device's free VRAM and the
    simulated host's page-locked limit, with the faults configured when the session opens.
    """

    info: DeviceInfo
    simulated_host: HostInfo | None = None

    def platform_defaults(self, host: HostInfo) -> PlatformDefaults:
        """Core defaults for a simulated device (scenarios plan with their own backend's rules)."""
        return PlatformDefaults(source="sim backend")

    def open(self, plan: Any) -> DeviceSession:
        """A session of SimDeviceMemory and SimPinnedAllocator sized from the facts, with the configured faults."""
        cfg = current_config()
        budget = PinnedBudget.for_plan(plan)
        memory = SimDeviceMemory(self.info.vram_free_bytes, faults=cfg.faults, accounting_only=cfg.accounting_only)
        pinned = SimPinnedAllocator(budget, cfg.profile.host.pinnable_bytes, faults=cfg.faults,
                                    accounting_only=cfg.accounting_only)
        return DeviceSession(memory=memory, kernels=ReferenceKernels(), budget=budget, pinned=pinned)


def probe() -> ProbeResult:
    """Always available, never chosen by 'auto' over a real device (score 0)."""
    cfg = current_config()
    why = f"simulated device (profile {cfg.profile_path})" if cfg.profile_path else "simulated device (profile-driven)"
    device = SimDevice(cfg.profile.device, simulated_host=cfg.profile.host if cfg.profile_path else None)
    return ProbeResult(available=True, reason=why, devices=(device,), score=0, version=__version__)


def describe(info: DeviceInfo) -> SimDevice:
    """A simulated device with a profile's facts."""
    return SimDevice(replace(info, backend=NAME, device_type=DeviceType.SIMULATED))


BACKEND = Backend(name=NAME, vendor="sim", probe=probe, version=__version__, api_version=API_VERSION,
                  description="a simulated device with capacities, pin limits and fault injection", describe=describe)

#: The sim backend's settings group; applying it reconfigures the backend (fault counters start again).
SETTINGS_GROUP = SettingsGroup(name=NAME, model=SimSettings, apply=configure)


@hookimpl
def strata_backends():
    """The sim backend."""
    return [BACKEND]


@hookimpl
def strata_settings_group():
    """The `[sim]` group: the simulated machine's profile and the faults to inject."""
    return SETTINGS_GROUP
