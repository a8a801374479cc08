"""The 'rocm' backend plugin (API 2.0): AMD GPUs through cupy's ROCm build. Imports without cupy-rocm; says why not.

cupy offers the same runtime API on its CUDA and ROCm builds, so the backend, its devices, the memory classes and the
KernelSet are strata_cuda's `CupyBackendPlugin` under this backend's name, rules and caps (moe.cu is hipified and
compiled by hiprtc through cupy.RawModule; the GEMMs run in hipBLAS; strata_cuda.fast's grouped FFN stays off, it is
CUDA only). Nothing here sets environment variables: cupy's ROCm build needs none from us.
"""

from __future__ import annotations

from strata_core.api import DeviceCaps
from strata_cuda.backend import CUPY_EXPERT_FORMATS, CupyBackendPlugin

from .probe import INSTALL_HINT, NAME, probe
from .rules import amd_defaults

PINNED_KIND = "hip-host"

#: What the ROCm session offers: copies on their own streams overlap kernels (the SDMA engines); the expert formats
#: of strata_cuda's sources (hipified). Graph capture is off: cupy's stream capture is not exercised on HIP by this backend (no test of it runs
#: on a ROCm card), so the runtime must not rely on it. Host-mapped memory is off for the same reason as on CUDA
#: (the allocator asks for portable, not mapped, memory); there are no fused layer ops.
ROCM_CAPS = DeviceCaps(async_copies=True, host_mapped_memory=False, graph_capture=False, peer_copies=False,
                       fused_layer_ops=False, expert_formats=CUPY_EXPERT_FORMATS)

PLUGIN = CupyBackendPlugin(name=NAME, vendor="amd", probe=probe, install_hint=INSTALL_HINT,
                           description="AMD GPUs through cupy's ROCm build; gfx12 rules", defaults=amd_defaults,
                           pinned_kind=PINNED_KIND, kernel_name="rocm-moe.cu", caps=ROCM_CAPS)
BACKEND = PLUGIN.backend

# The entry point names this module, so the hookimpl is its attribute (pluggy reads bound methods' markers).
strata_backends = PLUGIN.strata_backends
