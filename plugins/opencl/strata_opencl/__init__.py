"""strata_opencl: an OpenCL backend plugin for Strata Core, through pyopencl.

Importing this package never imports pyopencl; the backend reports itself unavailable, with the reason and the
install line, where pyopencl or an OpenCL platform is missing.
"""

__version__ = "0.1.0"

INSTALL_HINT = "pip install strata-opencl"
