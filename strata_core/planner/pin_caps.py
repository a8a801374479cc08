"""Page-locked memory caps as platform facts, the same on every backend (issue 12.4).

Public measurements: Windows' WDDM lets about half of system RAM be page-locked (single and several GPUs alike; the
pages count against the card's shared-memory budget); WSL2's cumulative limit is about 0.75-1 GiB (the low end is
used); Docker on WSL2 about 500 MB; and one registration call of 512 GiB or more fails, so the arena is registered in
slices below that. A backend's own defaults may only lower the cap.
"""

from __future__ import annotations

from dataclasses import dataclass

from strata_core.api.facts import GIB, DeviceInfo, HostInfo

#: WSL2's cumulative page-locked limit (measured 0.75-1 GiB; the low end).
WSL2_PIN_CAP_BYTES = 3 * GIB // 4
#: Docker Desktop on WSL2 (measured about 500 MB).
DOCKER_WSL2_PIN_CAP_BYTES = 500 * 1000 * 1000
#: WDDM page-locks at most about this fraction of system RAM.
WDDM_PIN_FRACTION = 0.5
#: One registration call of this many bytes or more fails.
REGISTRATION_LIMIT_BYTES = 512 * GIB
#: The arena registers in slices of at most this many bytes (below the per-call limit, with room to spare).
REGISTRATION_SLICE_BYTES = 256 * GIB


@dataclass(frozen=True)
class PinCap:
    """The platform's page-locked cap in bytes (None: no cap known) and the fact it comes from."""

    cap_bytes: int | None
    why: str


def platform_pin_cap(device: DeviceInfo, host: HostInfo) -> PinCap:
    """The page-locked cap the driver model and the host's virtualization impose, whatever the backend."""
    virt = getattr(host, "virtualization", "none")
    if virt == "docker-wsl2":
        return PinCap(DOCKER_WSL2_PIN_CAP_BYTES, "Docker on WSL2 page-locks about 500 MB in all")
    if virt == "wsl2" or device.driver_model == "wsl2":
        return PinCap(WSL2_PIN_CAP_BYTES, "WSL2's cumulative page-locked limit is about 0.75-1 GiB")
    if device.driver_model == "wddm":
        return PinCap(int(host.ram_total_bytes * WDDM_PIN_FRACTION),
                      "WDDM page-locks about half of system RAM (one GPU or several), counted against the card")
    return PinCap(None, "no page-locked cap on this driver model")


def registration_slices(nbytes: int, slice_bytes: int = REGISTRATION_SLICE_BYTES) -> list[int]:
    """Sizes of the registration calls that page-lock `nbytes`: each below the per-call limit."""
    out, left = [], int(nbytes)
    while left > 0:
        out.append(min(left, slice_bytes))
        left -= out[-1]
    return out
