"""Helpers of the bad-input tests: the project's scenarios, and `strata` in-process or in a fresh interpreter.

In-process (`strata_inprocess`) is the fast path most rows take: `strata_core.cli.main` with a clean environment
(no STRATA_* variable but the row's), an empty working directory and pytest's capture of stdout and stderr. A few
rows also run through a real interpreter (`strata_subprocess`), so the in-process path cannot hide what only a real
process shows (a flush at exit, a closed pipe).
"""

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


def strata_inprocess(argv: list[str], cwd: Path, env: dict[str, str], monkeypatch, capsys) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `strata ARGV` run by `cli.main` in this process, cwd and env as given."""
    from strata_core import cli
    for name in list(os.environ):
        if name.upper().startswith("STRATA_"):
            monkeypatch.delenv(name)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.chdir(cwd)
    capsys.readouterr()
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err
