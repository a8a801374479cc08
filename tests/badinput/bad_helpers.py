"""Helpers of the bad-input tests: the shared scenarios and `strata` in a fresh interpreter with a clean environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCENARIO_DIR = REPO / "tests" / "data" / "scenarios"
SCENARIO_FILES = sorted(SCENARIO_DIR.glob("*.json")) if SCENARIO_DIR.is_dir() else []


def strata_subprocess(argv: list[str], cwd: Path, env: dict[str, str] | None = None,
                      timeout_s: int = 120) -> subprocess.CompletedProcess:
    """`strata ARGV` in a fresh interpreter, cwd as its working directory, no STRATA_* variable but `env`'s."""
    full_env = {k: v for k, v in os.environ.items() if not k.upper().startswith("STRATA_")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "strata_core.cli", *argv], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout_s)
