"""The shared scenario files, found relative to the repository (../shared/scenarios beside the checkout)."""

from pathlib import Path

import pytest

SCENARIO_DIR = (Path(__file__).resolve().parents[2] / ".." / "shared" / "scenarios").resolve()
SCENARIO_FILES = sorted(SCENARIO_DIR.glob("*.json")) if SCENARIO_DIR.is_dir() else []


def pytest_collection_modifyitems(config, items):
    """Say why the replay tests are not run when the shared scenarios are not beside this checkout."""
    if SCENARIO_FILES:
        return
    skip = pytest.mark.skip(reason=f"no scenario files: {SCENARIO_DIR} is absent or empty")
    for item in items:
        if "scenarios" in str(item.fspath):
            item.add_marker(skip)
