"""The core's backend conformance kit on the cuda backend, reached only through the hooks.

Run it where a CUDA device is: `pytest tests/gpu/test_cuda_kernels_conformance.py --strata-backend cuda`. Without
`--strata-backend` the kit deselects these tests (naming cuda here would fail every machine without a GPU);
tests/gpu/test_cuda_kernels.py covers the same ground and skips with the probe's reason instead.
"""

from strata_core.testing.conformance import *  # noqa: F401,F403
