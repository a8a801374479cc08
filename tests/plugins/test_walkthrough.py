"""docs/PLUGINS.md, followed as a new user would: write its files into an empty directory, install the package,
see it in `strata backends`, and pass the conformance kit with it.

The doc's install line is `pip install -e .` into the user's environment. Here the package is installed with
`pip install --no-deps --no-build-isolation --target DIR` and seen through PYTHONPATH, because the venv is shared by
every test run on this checkout: a backend that appeared in it for the length of this test would show up in theirs.
Removing DIR uninstalls it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "PLUGINS.md"
BACKEND = "mynumpy"
#: A fenced block that belongs to the example: ```LANG file=PATH
FILE_BLOCK = re.compile(r"^```(\w+) file=(\S+)\n(.*?)^```$", re.S | re.M)
SHELL_BLOCK = re.compile(r"^```sh\n(.*?)^```$", re.S | re.M)

_spec = importlib.util.spec_from_file_location("strata_ci_matrix", ROOT / ".ci" / "matrix.py")
matrix = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(matrix)


def doc_files(text: str) -> dict[str, str]:
    """path -> content of the example's files: every block naming the same file, appended in order."""
    files: dict[str, str] = {}
    for _lang, path, body in FILE_BLOCK.findall(text):
        files[path] = files.get(path, "") + body
    return files


def doc_commands(text: str) -> list[str]:
    """Every command line of the doc's shell blocks, in order."""
    return [line.strip() for block in SHELL_BLOCK.findall(text) for line in block.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """An empty directory with the doc's files written into it."""
    root = tmp_path_factory.mktemp("strata-mynumpy")
    for path, content in doc_files(DOC.read_text()).items():
        target = root / path
        assert root in target.resolve().parents, f"the doc writes outside the project: {path}"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content)
    return root


@pytest.fixture(scope="module")
def installed(project, tmp_path_factory) -> dict:
    """Install the project (pip --no-deps --no-build-isolation) into a private target; the environment that sees it."""
    site = tmp_path_factory.mktemp("site")
    p = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--target", str(site), str(project)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"pip install failed: {p.stderr[-3000:]}"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site)] + [x for x in [env.get("PYTHONPATH")] if x])
    yield env
    shutil.rmtree(site, ignore_errors=True)


def test_the_doc_is_a_complete_project():
    """The doc's blocks make the package, its entry point and a test module; its commands are the ones run here."""
    text = DOC.read_text()
    files = doc_files(text)
    assert {"pyproject.toml", "strata_mynumpy/__init__.py", "strata_mynumpy/backend.py",
            "tests/test_conformance.py"} <= set(files)
    assert f'{BACKEND} = "strata_mynumpy.backend"' in files["pyproject.toml"]
    for path, content in files.items():
        if path.endswith(".py"):
            compile(content, path, "exec")
    commands = doc_commands(text)
    for expected in ("pip install -e .", "strata backends", f"pytest --strata-backend {BACKEND} tests/",
                     f"strata run --backend {BACKEND} --check"):
        assert expected in commands, f"the doc no longer says `{expected}`"


def test_strata_backends_sees_the_new_backend(installed, project):
    """`strata backends --json` lists the backend as available, from its plugin, with a device."""
    p = subprocess.run([sys.executable, "-m", "strata_core.cli", "backends", "--json"], cwd=project, env=installed,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout)
    assert out["schema"] == "strata.backends/1"
    mine = [b for b in out["backends"] if b["name"] == BACKEND]
    assert len(mine) == 1, [b["name"] for b in out["backends"]]
    assert mine[0]["available"] is True, mine[0]["reason"]
    assert mine[0]["devices"] and mine[0]["devices"][0]["backend"] == BACKEND


def test_strata_plan_plans_for_the_new_backend(installed, project):
    """`strata plan --backend mynumpy --json` plans with the backend's platform defaults."""
    p = subprocess.run([sys.executable, "-m", "strata_core.cli", "plan", "--backend", BACKEND, "--json"],
                       cwd=project, env=installed, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout)
    assert out["schema"] == "strata.plan/1" and out["backend"] == BACKEND
    assert out["prompt"]["ceiling"] == 4096, "the doc's platform defaults set a 4096-token ceiling"


def test_the_new_backend_passes_the_conformance_kit(installed, project):
    """`pytest --strata-backend mynumpy tests/` in the new project passes every test of the kit."""
    xml = project / "junit.xml"
    p = subprocess.run([sys.executable, "-m", "pytest", "--strata-backend", BACKEND, "tests/", "-q",
                        "-p", "no:cacheprovider", f"--junitxml={xml}"],
                       cwd=project, env=installed, capture_output=True, text=True, timeout=1200)
    cases = matrix.parse_junit(xml) if xml.exists() else []
    failed = [f"{c['name']}: {c['message']}" for c in cases if c["outcome"] != "passed"]
    assert p.returncode == 0 and not failed, "\n".join(failed) or p.stdout[-3000:] + p.stderr[-2000:]
    suites = matrix.summarize(cases)
    assert set(suites) == set(matrix.SUITES), suites.keys()
    assert all(f"[{BACKEND}" in c["name"] for c in cases)
