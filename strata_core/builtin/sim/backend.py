"""The 'sim' backend: a simulated device whose facts come from a profile, with capacities and page-locked limits.

Its arrays are numpy arrays (so a run on sim computes real numbers) while every byte is counted against the
simulated device's capacity; `strata simulate` drives it in accounting-only mode. Fault injection lives in
`strata_core.builtin.sim.faults`.

The backend reads its own settings group (`sim.profile`, `sim.inject`) through the `strata_configure` hook, which
`plugins.load_from_settings` calls before any probe; what it read stays until the next call (`configure`).
One `FaultPlan` is shared by the device memory and the pinned allocator handed out after a configure, so fault
counters (the Nth pinned allocation, the Nth device allocation) run over one session.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import Any

from strata_core import __version__
from strata_core.api import API_VERSION
from strata_core.api.backend import Backend, ProbeResult
from strata_core.api.facts import GIB, CpuInfo, DeviceInfo, HostInfo, PlatformDefaults, Profile, load_profile
from strata_core.api.hookspecs import hookimpl
from strata_core.reference.kernels import ReferenceKernels
from strata_core.builtin.sim.faults import FaultPlan
from strata_core.builtin.sim.memory import SimDeviceMemory, SimPinnedAllocator

NAME = "sim"

#: The device the sim backend reports when no profile is given: a 24 GiB card on a 64 GiB Linux host.
DEFAULT_PROFILE = Profile(
    backend=NAME,
    device=DeviceInfo(backend=NAME, vendor="sim", name="Simulated 24 GiB device", arch="sim",
                      vram_total_bytes=24 * GIB, vram_free_bytes=23 * GIB, driver_model="linux"),
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
    selected: bool = False  # backend.name == 'sim': the host facts of a profile then stand for this machine
    faults: FaultPlan = field(default_factory=FaultPlan)


_state_lock = threading.Lock()
_config = SimConfig()


def as_sim_profile(profile: Profile) -> Profile:
    """A profile's machine as the sim backend reports it: the same facts, the device's backend set to 'sim'."""
    return replace(profile, backend=NAME, device=replace(profile.device, backend=NAME))


def configure(settings: Any = None, accounting_only: bool = False, profile: Profile | None = None) -> SimConfig:
    """(Re)configure the sim backend from settings (sim.profile, sim.inject), resetting its fault counters.

    `profile` (already loaded) wins over `sim.profile`. Raises BadInput for an unreadable profile or a bad spec.
    """
    global _config
    sim = getattr(settings, "sim", None)
    path = getattr(sim, "profile", None)
    inject = tuple(getattr(sim, "inject", None) or ())
    faults = FaultPlan.parse(list(inject))
    if profile is None:
        profile = load_profile(path) if path else DEFAULT_PROFILE
    selected = getattr(getattr(settings, "backend", None), "name", "") == NAME
    cfg = SimConfig(profile=as_sim_profile(profile), profile_path=str(path) if path else None, inject=inject,
                    accounting_only=bool(accounting_only), selected=selected, faults=faults)
    with _state_lock:
        _config = cfg
    return cfg


def current_config() -> SimConfig:
    """The configuration the hooks use now."""
    with _state_lock:
        return _config


def probe() -> ProbeResult:
    """Always available, never chosen by 'auto' over a real device (score 0)."""
    cfg = current_config()
    why = f"simulated device (profile {cfg.profile_path})" if cfg.profile_path else "simulated device (profile-driven)"
    return ProbeResult(available=True, reason=why, devices=(cfg.profile.device,), score=0, version=__version__)


BACKEND = Backend(name=NAME, vendor="sim", probe=probe, version=__version__, api_version=API_VERSION,
                  description="a simulated device with capacities, pin limits and fault injection")


@hookimpl
def strata_backends():
    """The sim backend."""
    return [BACKEND]


@hookimpl
def strata_configure(settings):
    """Read the sim settings group: the simulated machine's profile and the faults to inject."""
    configure(settings)


@hookimpl
def strata_host_info():
    """The profile's host when the sim backend is selected with a profile (the machine being simulated), else None."""
    cfg = current_config()
    return cfg.profile.host if (cfg.selected and cfg.profile_path) else None


@hookimpl
def strata_platform_defaults(device, host):
    """Core defaults for a simulated device (scenarios plan with their own backend's rules)."""
    if device.backend != NAME:
        return None
    return PlatformDefaults(source="sim backend")


@hookimpl
def strata_device_memory(device):
    """A SimDeviceMemory whose capacity is the device's free VRAM, with the configured faults."""
    if device.backend != NAME:
        return None
    cfg = current_config()
    return SimDeviceMemory(device.vram_free_bytes, faults=cfg.faults, accounting_only=cfg.accounting_only)


@hookimpl
def strata_pinned_allocator(device, budget):
    """A SimPinnedAllocator limited by the simulated host's pinnable bytes, with the configured faults."""
    if device.backend != NAME:
        return None
    cfg = current_config()
    return SimPinnedAllocator(budget, cfg.profile.host.pinnable_bytes, faults=cfg.faults,
                              accounting_only=cfg.accounting_only)


@hookimpl
def strata_kernels(device):
    """The numpy reference kernels (the sim computes real numbers in real mode)."""
    return ReferenceKernels() if device.backend == NAME else None
