"""AMD platform rules: pure functions of a profile (DeviceInfo, HostInfo), so they run without cupy-rocm or a GPU.

The gfx12 rules answer seed #2090's second report: on gfx12 the prompt path also holds its lent experts in host
RAM (as the resident mode does), so a larger chunk is a larger host borrow. The rule only supplies the 16384 ceiling,
`host_borrow` and the headroom; the planner steps the chunk down (16384 -> 8192 -> ...) while resident experts +
host borrow + headroom do not fit the available RAM.
"""

from __future__ import annotations

from strata_core.api.facts import GIB, DeviceInfo, HostInfo, PlatformDefaults
# the display reserve and the CPU share rule are the same on any discrete GPU; they are written once, in strata_cuda
from strata_cuda.rules import (CPU_SHARE_FLAGS, DISPLAY_VRAM_RESERVE_MIB, HEADLESS_VRAM_RESERVE_MIB,
                               cpu_share_default, vram_reserve_mib)

__all__ = ["CPU_SHARE_FLAGS", "DISPLAY_VRAM_RESERVE_MIB", "GFX12_CHUNK_CEILING_TOKENS", "HEADLESS_VRAM_RESERVE_MIB",
           "NAME", "OTHER_CHUNK_CEILING_TOKENS", "RESIDENT_HEADROOM_BYTES", "amd_defaults", "cpu_share_default",
           "is_gfx12", "vram_reserve_mib"]

NAME = "rocm"

#: gfx12 (RDNA 4) reads prompts faster at 16384-token chunks on PCs with RAM to spare (the engine's default there).
GFX12_CHUNK_CEILING_TOKENS = 16384
#: Other AMD archs keep the chunk the engine used before the gfx12 change.
OTHER_CHUNK_CEILING_TOKENS = 8192
#: Host RAM kept free beside resident experts and the host borrow, so the OS does not swap. Seed #2090's R9700 host
#: thrashed with 3.4 GiB left available (chunk 16384) and ran stable with about 6.4 GiB left (chunk 8192, 3 GiB less
#: borrow); 4 GiB lies between the failing and the working figure, so the planner steps that host down to 8192.
RESIDENT_HEADROOM_BYTES = 4 * GIB


def is_gfx12(device: DeviceInfo) -> bool:
    """True for gfx12 archs (gfx1200, gfx1201, ...)."""
    return device.arch.lower().startswith("gfx12")


def amd_defaults(device: DeviceInfo, host: HostInfo) -> PlatformDefaults:
    """The AMD PlatformDefaults for one card on one host (pure: no cupy-rocm, no GPU)."""
    gfx12 = is_gfx12(device)
    share_on, share_why = cpu_share_default(host)
    return PlatformDefaults(
        chunk_ceiling_tokens=GFX12_CHUNK_CEILING_TOKENS if gfx12 else OTHER_CHUNK_CEILING_TOKENS,
        vram_reserve_mib=vram_reserve_mib(device),
        host_borrow=gfx12,
        resident_headroom_bytes=RESIDENT_HEADROOM_BYTES,
        cpu_share_default=share_on,
        cpu_share_reason=share_why,
        free_vram_trust=1.0,
        source="rocm backend (gfx12 rules)" if gfx12 else "rocm backend",
    )
