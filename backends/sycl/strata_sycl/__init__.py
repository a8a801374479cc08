"""strata_sycl: the SYCL backend of Strata Core (Intel and other SYCL devices through dpctl).

Importing this package never imports dpctl: the vendor library is loaded lazily by `strata_sycl.runtime`, so the
backend lists itself as unavailable, with the reason and the install line, where the [sycl] extra is missing.
"""

INSTALL_HINT = "pip install 'strata-core[sycl]'"
