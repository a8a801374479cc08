"""The 'cuda' backend plugin (API 2.0): NVIDIA GPUs through cupy. Imports without cupy; says why it is unavailable.

`CupyBackendPlugin` is the backend of any GPU that runs on cupy: the rocm backend instantiates it with its own name,
rules, probe, caps and kernel options, since cupy offers the same runtime API on its CUDA and ROCm builds.
The only hook is discovery (`strata_backends`); everything about one device is asked of its `CupyDevice`:
its facts (`info`), its platform rules (`platform_defaults(host)`) and `open(plan)`, the session the runtime drives.
Nothing here sets environment variables: cupy and the CUDA runtime need none from us.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from strata_core import __version__
from strata_core.api import (API_VERSION, Backend, DeviceCaps, DeviceInfo, DeviceSession, HostInfo, PinnedBudget,
                             PlatformDefaults, ProbeResult, hookimpl)
from strata_core.errors import BadInput, StrataError
from strata_core.planner.buffers import uses_dequant_scratch

from .cupy_device import CupyDeviceMemory, CupyPinnedAllocator
from .kernels import CupyKernels
from .probe import INSTALL_HINT, NAME, NO_INSTALL_FIXES_IT, probe
from .rules import nvidia_defaults

PINNED_KIND = "cuda-host"

#: Expert formats moe.cu and moe_quant.cu compute from their own bytes: f16 and Q8_0 pools, and 'gguf' pools of
#: these GGUF row formats (strata_cuda.quant_ffn; the same sources serve ROCm through hiprtc).
CUPY_EXPERT_FORMATS = ("f16", "q8_0", "bf16", "q4_k", "q5_k", "q6_k", "mxfp4")

#: What the CUDA session offers: copies on their own non-blocking streams overlap kernels (the copy engines); cupy
#: captures and replays CUDA graphs; the kernels compute the CUPY_EXPERT_FORMATS from their own bytes. Host-mapped
#: memory is off because the pinned allocator asks for portable, not mapped, memory (cudaHostAllocMapped is never
#: requested). `fused_layer_ops` is set by the plugin from whether it has layer ops of its own (`layer_ops`).
CUDA_CAPS = DeviceCaps(async_copies=True, host_mapped_memory=False, graph_capture=True, peer_copies=False,
                       fused_layer_ops=False, expert_formats=CUPY_EXPERT_FORMATS)


@dataclass(frozen=True)
class CupyDevice:
    """One GPU of a cupy backend: its facts, its platform rules and `open(plan)`.

    `present` is False for a device described by a profile of another machine: it plans, it cannot open.
    """

    info: DeviceInfo
    plugin: "CupyBackendPlugin"
    present: bool = True

    def platform_defaults(self, host: HostInfo) -> PlatformDefaults:
        """This card's platform rules on `host` (pure: from the facts alone, no cupy needed)."""
        return self.plugin.defaults(self.info, host)

    def open(self, plan: Any) -> DeviceSession:
        """A session on this card for a proven plan: cupy memory and streams, the pinned allocator, the kernels."""
        return self.plugin.open(self, plan)


class CupyBackendPlugin:
    """One cupy-based backend: the Backend it registers, how it wraps its probe's facts into devices, its sessions."""

    def __init__(self, *, name: str, vendor: str, probe: Callable[[], ProbeResult], install_hint: str,
                 description: str, defaults: Callable[[DeviceInfo, HostInfo], PlatformDefaults], pinned_kind: str,
                 kernel_name: str, caps: DeviceCaps, fast_grouped_ffn: bool = False,
                 layer_ops: Callable[[DeviceSession], Any] | None = None):
        self._probe = probe
        self.defaults = defaults
        self.pinned_kind = pinned_kind
        self.kernel_name = kernel_name
        #: the backend's own layer ops for a session (cuda's fused paths), or None: the core composes the kernels'
        self.layer_ops = layer_ops
        self.caps = replace(caps, fused_layer_ops=layer_ops is not None)
        self.fast_grouped_ffn = fast_grouped_ffn
        self.backend = Backend(name=name, vendor=vendor, probe=self.probe, version=__version__,
                               api_version=API_VERSION, install_hint=install_hint, description=description,
                               describe=self.describe)

    def _device_info(self, info: DeviceInfo) -> DeviceInfo:
        """The probe's facts with this backend's caps (an integrated GPU keeps the type the probe gave it)."""
        return replace(info, caps=replace(self.caps, peer_copies=info.caps.peer_copies))

    def probe(self) -> ProbeResult:
        """The probe's result with each device's facts wrapped in a CupyDevice. Never raises."""
        try:
            r = self._probe()
            if not r.available:
                return r
            return replace(r, devices=tuple(CupyDevice(self._device_info(i), self) for i in r.devices))
        except Exception as e:  # the contract: a probe never raises
            return ProbeResult.unavailable(f"the {self.backend.name} probe failed: {type(e).__name__}: {e}",
                                           install_hint=NO_INSTALL_FIXES_IT)

    def describe(self, info: DeviceInfo) -> CupyDevice:
        """A device of this backend known only from a profile's facts: it plans with the backend's rules."""
        return CupyDevice(info, self, present=False)

    def _layer_ops(self, session: DeviceSession, plan: Any = None) -> Any:
        """The session's own layer ops (the backend's `layer_ops` factory, told the plan it serves); None: the core
        composes the kernels'."""
        return None if self.layer_ops is None else self.layer_ops(session, plan)

    def open(self, device: CupyDevice, plan: Any) -> DeviceSession:
        """Device memory, page-locked memory charging the plan's pinned budget, and moe.cu's KernelSet on `device`."""
        info = device.info
        if not device.present:
            raise BadInput(f"{self.backend.name} device '{info.name}' (index {info.index}) comes from a profile: "
                           f"it can be planned for here, not opened")
        try:
            memory = CupyDeviceMemory(info.index)
            kernels = CupyKernels(info.index, name=self.kernel_name, fast_grouped_ffn=self.fast_grouped_ffn)
        except ImportError as e:
            raise StrataError(f"{self.backend.name}: cupy does not import ({e}); "
                              f"install: {self.backend.install_hint}") from None
        budget = PinnedBudget(plan.pinned.limit_bytes, plan.pinned.floor_bytes)
        session = DeviceSession(memory=memory, kernels=kernels, budget=budget,
                                pinned=CupyPinnedAllocator(budget, kind=self.pinned_kind),
                                closers=[memory.release_cached])
        kernels.pinned = session.pinned  # the grouped FFN's fast paths stage through the plan's pinned budget
        session.layer_ops = self._layer_ops(session, plan)
        return session

    @hookimpl
    def strata_backends(self) -> list[Backend]:
        """This backend."""
        return [self.backend]


def cuda_layer_ops(session: DeviceSession, plan: Any = None) -> Any:
    """The fused CUDA layer ops (strata_cuda.layer_ops) over a session's memory and kernels, warmed up at the plan's
    model shape and largest chunk (so the first request pays no cuBLAS kernel loads)."""
    from .layer_ops import CudaLayerOps  # imported when a session opens, so this module imports without cupy
    shape, tokens = plan_shape(plan)
    model = getattr(plan, "model", None)
    layers = int(getattr(model, "moe_layers", 0) or 0)
    return CudaLayerOps(session.memory, session.kernels, shape=shape, max_tokens=tokens, layers=layers,
                        pool_dtype=plan_pool_dtype(model), slot_bytes=int(getattr(model, "slot_bytes", 0) or 0),
                        pinned=getattr(session, "pinned", None))


def plan_pool_dtype(model: Any) -> str:
    """The expert pool's dtype ('f16', 'q8_0' or 'gguf') the plan's model loads into: the one it names, else what
    its quant implies (a mix such as Q4_K_M is 'gguf': its presets once warmed and sized an f16 layer instead)."""
    pool = str(getattr(model, "expert_pool", "") or "")
    if pool:
        return pool
    quant = str(getattr(model, "quant", "")).upper()
    return "q8_0" if quant == "Q8_0" else "gguf" if uses_dequant_scratch(model) else "f16"


def plan_shape(plan: Any) -> tuple[tuple[int, int, int, int] | None, int]:
    """((experts, top_k, hidden, ffn) of the plan's model, its largest prompt chunk), or (None, 0) when unknown."""
    model = getattr(plan, "model", None)
    try:
        shape = (int(model.experts_per_layer), int(model.top_k), int(model.hidden), int(model.expert_ffn))
    except (AttributeError, TypeError, ValueError):
        return None, 0
    prompt = getattr(plan, "prompt", None)
    chunks = [int(getattr(prompt, "chunk", 0) or 0)] + [int(r.chunk) for r in (getattr(prompt, "loans", None) or ())]
    return (shape if all(shape) else None), max(chunks)


PLUGIN = CupyBackendPlugin(name=NAME, vendor="nvidia", probe=probe, install_hint=INSTALL_HINT,
                           description="NVIDIA GPUs through cupy (CUDA) and nvidia-ml-py", defaults=nvidia_defaults,
                           pinned_kind=PINNED_KIND, kernel_name="cuda-moe.cu", caps=CUDA_CAPS, fast_grouped_ffn=True,
                           layer_ops=cuda_layer_ops)
BACKEND = PLUGIN.backend

# The entry point names this module, so the hookimpl is its attribute (pluggy reads bound methods' markers).
strata_backends = PLUGIN.strata_backends
