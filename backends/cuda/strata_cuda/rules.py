"""NVIDIA platform rules: pure functions of a profile (DeviceInfo, HostInfo), so they run without cupy or a GPU.

Every value here is a default of ours that settings and site plugins override; the why of each is in its comment and
in the `PlatformDefaults` it returns, so a plan can say where a number came from. The display reserve and the CPU
share rule hold for any discrete GPU on a PC, so strata_rocm.rules uses them from here.
"""

from __future__ import annotations

from strata_core.api.facts import GIB, DeviceInfo, HostInfo, PlatformDefaults

NAME = "cuda"

#: Cards with at least this much VRAM take the large chunk ceiling: their expert cache can lend a 32768-token chunk's
#: ring and buffers and still keep the decode floor.
LARGE_CARD_VRAM_BYTES = 16 * GIB
LARGE_CARD_CHUNK_CEILING_TOKENS = 32768
SMALL_CARD_CHUNK_CEILING_TOKENS = 8192

#: WDDM refuses every later allocation once a process has page-locked "too much" (seed #1756: the whole-arena
#: cudaHostRegister failed and the CPU share's cudaHostAlloc died). 8 GiB is the engine's figure from that seed; it now
#: applies to one GPU as well as several, since the seed's failure was on a single-GPU host.
WDDM_PIN_CAP_BYTES = 8 * GIB

#: A card that drives a display shares VRAM with the compositor (DWM, a desktop session), whose use moves with the
#: windows on screen; 700 MiB is the reserve the seed #2090 reporter ran with on such a card. A headless card keeps
#: only the driver's own slack. (Shared with the rocm backend.)
DISPLAY_VRAM_RESERVE_MIB = 700
HEADLESS_VRAM_RESERVE_MIB = 512

#: The CPU share's gain was measured on a Zen 4 host with AVX2 and FMA; on an AVX-only CPU (seed #1756's Xeon
#: E5-2670) the engine's own build calls the CPU path slow, so the share stays off by default there. (Shared with
#: the rocm backend: the rule is about the host CPU, not the GPU.)
CPU_SHARE_FLAGS = ("avx2", "fma")

#: The budget of the f16 scratch a prefill of Q4_K/Q5_K/Q6_K/MXFP4 experts dequantizes into before cuBLAS' GEMMs
#: (strata_core.planner.buffers.scratch_layout: two groups of at most 32 whole experts, or pieces of one expert where
#: one does not fit half of it); the planner's workspace line counts what the layout takes of it. 576 MiB holds two
#: groups of 32 Qwen3-30B-A3B experts: on the H200 32-expert groups ran the layer in 3.27 ms, 14-expert groups (256
#: MiB) in 3.80 ms and 8-expert groups in 9.43 ms (bench/results/q_h200/call2_quant_layer_h200.json; per-group
#: host work suspected, not profiled); Mixtral 8x7B takes 235 MB of it (one expert's gate|up).
DEQUANT_SCRATCH_BYTES = 576 * (1 << 20)


def chunk_ceiling_tokens(device: DeviceInfo) -> int:
    """The auto prompt chunk's ceiling: 32768 tokens on cards of 16 GiB or more, 8192 below."""
    if device.vram_total_bytes >= LARGE_CARD_VRAM_BYTES:
        return LARGE_CARD_CHUNK_CEILING_TOKENS
    return SMALL_CARD_CHUNK_CEILING_TOKENS


def pin_cap_bytes(device: DeviceInfo) -> int | None:
    """The page-locked cap: WDDM_PIN_CAP_BYTES under WDDM (Windows, WSL2), single GPU or several; None elsewhere."""
    return WDDM_PIN_CAP_BYTES if device.is_wddm else None


def vram_reserve_mib(device: DeviceInfo) -> int:
    """VRAM kept free: more on a card that drives a display (the compositor's share moves), less on a headless one."""
    return DISPLAY_VRAM_RESERVE_MIB if device.drives_display else HEADLESS_VRAM_RESERVE_MIB


def cpu_share_default(host: HostInfo) -> tuple[bool, str]:
    """(on, why) for the CPU share under 'auto': on only when the host CPU has AVX2 and FMA."""
    missing = [f for f in CPU_SHARE_FLAGS if not host.cpu.has(f)]
    if missing:
        return False, (f"off: the host CPU ({host.cpu.name}) lacks {', '.join(missing)}; the share's gain was "
                       f"measured on a Zen 4 CPU with AVX2 and FMA")
    return True, "on: the host CPU has AVX2 and FMA, like the Zen 4 CPU the share's gain was measured on"


def nvidia_defaults(device: DeviceInfo, host: HostInfo) -> PlatformDefaults:
    """The NVIDIA PlatformDefaults for one card on one host (pure: no cupy, no GPU)."""
    share_on, share_why = cpu_share_default(host)
    return PlatformDefaults(
        chunk_ceiling_tokens=chunk_ceiling_tokens(device),
        vram_reserve_mib=vram_reserve_mib(device),
        # the prompt path's lent experts live in VRAM only; nothing extra is held in host RAM
        host_borrow=False,
        pin_cap_bytes=pin_cap_bytes(device),
        cpu_share_default=share_on,
        cpu_share_reason=share_why,
        # NVIDIA drivers report free VRAM that can be allocated (no spill into host memory)
        free_vram_trust=1.0,
        dequant_scratch_bytes=DEQUANT_SCRATCH_BYTES,
        # CudaLayerOps.greedy_table page-locks the embedding in place for the device's greedy loop
        pins_embedding=True,
        source="cuda backend",
    )
