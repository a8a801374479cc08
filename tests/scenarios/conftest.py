"""The project's scenario files (tests/data/scenarios, copies of the seed scenarios), found relative to the tests."""

from pathlib import Path

import pytest

SCENARIO_DIR = Path(__file__).resolve().parents[1] / "data" / "scenarios"
SCENARIO_FILES = sorted(SCENARIO_DIR.glob("*.json")) if SCENARIO_DIR.is_dir() else []


def scenario_params(paths=None):
    """pytest params of scenario files, or one skipped param saying why there are none."""
    paths = SCENARIO_FILES if paths is None else paths
    if paths:
        return [pytest.param(p, id=p.stem) for p in paths]
    why = (f"no scenario files: {SCENARIO_DIR} is absent or empty" if not SCENARIO_FILES
           else "no scenario file of this kind in the shared scenarios")
    return [pytest.param(None, marks=pytest.mark.skip(reason=why), id="none")]
