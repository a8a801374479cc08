"""The 'rocm' backend plugin: AMD GPUs through cupy's ROCm build. Imports without cupy-rocm; says why not instead.

cupy offers the same runtime API on its CUDA and ROCm builds, so the hookimpls, the memory classes and the KernelSet
are the ones in strata_cuda (moe.cu is hipified and compiled by hiprtc through cupy.RawModule; the GEMMs run in
hipBLAS; strata_cuda.fast's grouped FFN stays off, it is CUDA only). Nothing here sets environment variables: cupy's
ROCm build needs none from us.
"""

from __future__ import annotations

from strata_cuda.backend import CupyBackendPlugin

from .probe import INSTALL_HINT, NAME, probe
from .rules import amd_defaults

PINNED_KIND = "hip-host"

PLUGIN = CupyBackendPlugin(name=NAME, vendor="amd", probe=probe, install_hint=INSTALL_HINT,
                           description="AMD GPUs through cupy's ROCm build; gfx12 rules", defaults=amd_defaults,
                           pinned_kind=PINNED_KIND, kernel_name="rocm-moe.cu")
BACKEND = PLUGIN.backend

# The entry point names this module, so the hookimpls are its attributes (pluggy reads bound methods' markers).
strata_backends = PLUGIN.strata_backends
strata_platform_defaults = PLUGIN.strata_platform_defaults
strata_pinned_allocator = PLUGIN.strata_pinned_allocator
strata_device_memory = PLUGIN.strata_device_memory
strata_kernels = PLUGIN.strata_kernels
