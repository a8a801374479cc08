"""The 'cuda' backend plugin: NVIDIA GPUs through cupy. Imports without cupy; says why it is unavailable instead.

`CupyBackendPlugin` holds the hookimpls of any backend that runs on cupy: the rocm backend instantiates it with its
own name, rules, probe and kernel options, since cupy offers the same runtime API on its CUDA and ROCm builds.
Nothing here sets environment variables: cupy and the CUDA runtime need none from us.
"""

from __future__ import annotations

from typing import Callable

from strata_core import __version__
from strata_core.api import API_VERSION
from strata_core.api.backend import Backend, ProbeResult
from strata_core.api.facts import DeviceInfo, HostInfo, PlatformDefaults
from strata_core.api.hookspecs import hookimpl

from .cupy_device import CupyDeviceMemory, CupyPinnedAllocator
from .kernels import CupyKernels
from .probe import INSTALL_HINT, NAME, probe
from .rules import nvidia_defaults

PINNED_KIND = "cuda-host"


class CupyBackendPlugin:
    """The hookimpls of one cupy-based backend; each answers only for devices of that backend's name."""

    def __init__(self, *, name: str, vendor: str, probe: Callable[[], ProbeResult], install_hint: str,
                 description: str, defaults: Callable[[DeviceInfo, HostInfo], PlatformDefaults], pinned_kind: str,
                 kernel_name: str, fast_grouped_ffn: bool = False):
        self.backend = Backend(name=name, vendor=vendor, probe=probe, version=__version__, api_version=API_VERSION,
                               install_hint=install_hint, description=description)
        self.defaults = defaults
        self.pinned_kind = pinned_kind
        self.kernel_name = kernel_name
        self.fast_grouped_ffn = fast_grouped_ffn

    def _mine(self, device) -> bool:
        return device.backend == self.backend.name

    @hookimpl
    def strata_backends(self):
        """This backend."""
        return [self.backend]

    @hookimpl
    def strata_platform_defaults(self, device, host):
        """The backend's platform rules for its own device; None for any other."""
        return self.defaults(device, host) if self._mine(device) else None

    @hookimpl
    def strata_pinned_allocator(self, device, budget):
        """Page-locked host buffers (cudaHostAlloc / hipHostMalloc through cupy) through the budget."""
        return CupyPinnedAllocator(budget, kind=self.pinned_kind) if self._mine(device) else None

    @hookimpl
    def strata_device_memory(self, device):
        """cupy arrays, streams and events on the backend's device."""
        return CupyDeviceMemory(device.index) if self._mine(device) else None

    @hookimpl
    def strata_kernels(self, device):
        """moe.cu through NVRTC (or hiprtc) plus cuBLAS (or hipBLAS), on the backend's device."""
        if not self._mine(device):
            return None
        return CupyKernels(device.index, name=self.kernel_name, fast_grouped_ffn=self.fast_grouped_ffn)


PLUGIN = CupyBackendPlugin(name=NAME, vendor="nvidia", probe=probe, install_hint=INSTALL_HINT,
                           description="NVIDIA GPUs through cupy (CUDA) and nvidia-ml-py", defaults=nvidia_defaults,
                           pinned_kind=PINNED_KIND, kernel_name="cuda-moe.cu", fast_grouped_ffn=True)
BACKEND = PLUGIN.backend

# The entry point names this module, so the hookimpls are its attributes (pluggy reads bound methods' markers).
strata_backends = PLUGIN.strata_backends
strata_platform_defaults = PLUGIN.strata_platform_defaults
strata_pinned_allocator = PLUGIN.strata_pinned_allocator
strata_device_memory = PLUGIN.strata_device_memory
strata_kernels = PLUGIN.strata_kernels
