STRATA_CONFORMANCE_BACKENDS = ["opencl"]
from strata_core.testing.conformance import *  # noqa: F401,F403 — the kit is the whole test suite
