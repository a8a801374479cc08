"""The shared OpenCL C kit: moe.cl, its program build and kernel cache, and the Intel CPU runtime's discovery.

The sycl backend (dpctl) and the opencl plugin (pyopencl) build on it; neither vendor library is imported here.
"""

from importlib import resources


def kernel_source(name: str = "moe.cl") -> str:
    """The text of an OpenCL C source kept in this kit ('moe.cl')."""
    return resources.files(__package__).joinpath(name).read_text()
