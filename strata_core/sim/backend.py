"""The 'sim' backend: a simulated device whose facts come from a profile, with capacities and page-locked limits.

Its arrays are numpy arrays (so a run on sim computes real numbers) while every byte is counted against the
simulated device's capacity; `strata simulate` drives it in accounting-only mode. Fault injection lives in
`strata_core.sim.faults`.
"""

from __future__ import annotations

from .. import API_VERSION, __version__
from ..backend_api import Backend, ProbeResult
from ..facts import GIB, CpuInfo, DeviceInfo, HostInfo, PlatformDefaults, Profile
from ..hookspecs import hookimpl

NAME = "sim"

#: The device the sim backend reports when no profile is given: a 24 GiB card on a 64 GiB Linux host.
DEFAULT_PROFILE = Profile(
    backend=NAME,
    device=DeviceInfo(backend=NAME, vendor="sim", name="Simulated 24 GiB device", arch="sim",
                      vram_total_bytes=24 * GIB, vram_free_bytes=23 * GIB, driver_model="linux"),
    host=HostInfo(os="linux", ram_total_bytes=64 * GIB, ram_available_bytes=60 * GIB, pinnable_bytes=None,
                  cpu=CpuInfo(name="Simulated CPU", cores=8, flags=("avx", "avx2", "fma", "f16c"))),
)


def probe() -> ProbeResult:
    """Always available, never chosen by 'auto' over a real device (score 0)."""
    return ProbeResult(available=True, reason="simulated device (profile-driven)", devices=(DEFAULT_PROFILE.device,),
                       score=0, version=__version__)


BACKEND = Backend(name=NAME, vendor="sim", probe=probe, version=__version__, api_version=API_VERSION,
                  description="a simulated device with capacities, pin limits and fault injection")


@hookimpl
def strata_backends():
    """The sim backend."""
    return [BACKEND]


@hookimpl
def strata_platform_defaults(device, host):
    """Core defaults for a simulated device (scenarios plan with their own backend's rules)."""
    if device.backend != NAME:
        return None
    return PlatformDefaults(source="sim backend")
