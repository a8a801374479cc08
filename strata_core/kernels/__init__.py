"""Kernels: the numpy reference (the oracle every backend is checked against) and the shared device sources."""

from importlib import resources


def kernel_source(name: str) -> str:
    """The text of a shared kernel source kept in this package ('moe.cl' for OpenCL C, 'moe.cu' for CUDA C)."""
    return resources.files(__package__).joinpath(name).read_text()
