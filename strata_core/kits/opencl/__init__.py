"""The shared OpenCL C kit: moe.cl, its program build and kernel cache, the Intel CPU runtime's discovery, and the
Backend/Device/session scaffolding of a moe.cl backend (`MoeClBackend`).

The sycl backend (dpctl) and the opencl plugin (pyopencl) build on it; neither vendor library is imported here.
A backend imports what it needs from this package: `from strata_core.kits.opencl import MoeClBackend, ...`.
"""

from importlib import resources


def kernel_source(name: str = "moe.cl") -> str:
    """The text of an OpenCL C source kept in this kit ('moe.cl')."""
    return resources.files(__package__).joinpath(name).read_text()


# After kernel_source: the driver reads it from this package.
from strata_core.kits.opencl.driver import *  # noqa: E402,F401,F403
from strata_core.kits.opencl.driver import __all__ as _driver_all  # noqa: E402

__all__ = ["kernel_source", *_driver_all]
