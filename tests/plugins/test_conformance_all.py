"""The conformance suite for the backends named on the command line (`pytest --strata-backend NAME|all`).

Without `--strata-backend` these tests are deselected, so a plain `pytest tests/` does not run them; `.ci/matrix.py`
runs this module once per backend lane.
"""

from strata_core.testing.conformance import *  # noqa: F401,F403
