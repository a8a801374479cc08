"""strata_sycl: the SYCL backend of Strata Core (Intel and other SYCL devices through dpctl).

Importing this package never imports dpctl: the vendor library is loaded lazily by `strata_sycl.runtime`, so the
backend lists itself as unavailable, with the reason and the install line, where the [sycl] extra is missing.
"""

from pathlib import Path as _Path

# the in-tree backends ship in strata-core's one distribution: their install line is written once, in strata_cuda
from strata_cuda.probe import install_line as _install_line

INSTALL_HINT = _install_line("sycl", _Path(__file__).parent)
