"""Helpers of the reliability and bad-input tests: the scenario files, and `strata` run in-process or in a subprocess."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCENARIO_DIR = REPO / "tests" / "data" / "scenarios"
SCENARIO_FILES = sorted(SCENARIO_DIR.glob("*.json")) if SCENARIO_DIR.is_dir() else []
NO_SCENARIOS = f"no scenario files: {SCENARIO_DIR} is absent or empty"


def scenario_params():
    """One pytest param per scenario file, or one skipped param that says why there are none."""
    if not SCENARIO_FILES:
        return [pytest.param(None, marks=pytest.mark.skip(reason=NO_SCENARIOS), id="no-scenarios")]
    return [pytest.param(p, id=p.stem) for p in SCENARIO_FILES]


def strata_inprocess(argv: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `strata ARGV` run in this process."""
    from strata_core.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def simulate_json(scenario: Path, *extra: str) -> tuple[int, dict]:
    """`strata simulate --scenario FILE --json EXTRA...` in-process: (exit code, the strata.simulation/1 object)."""
    rc, out, err = strata_inprocess(["simulate", "--scenario", str(scenario), "--json", *extra])
    assert rc in (0, 1), f"simulate exited {rc}: {err.strip()}"
    return rc, json.loads(out)


def clean_env() -> dict[str, str]:
    """The environment without any STRATA_* variable, for subprocesses."""
    return {k: v for k, v in os.environ.items() if not k.upper().startswith("STRATA_")}


def strata_subprocess(argv: list[str], cwd: Path, env: dict[str, str] | None = None,
                      timeout_s: int = 120) -> subprocess.CompletedProcess:
    """`strata ARGV` in a fresh interpreter with cwd as its working directory."""
    full_env = clean_env()
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "strata_core.cli", *argv], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout_s)
