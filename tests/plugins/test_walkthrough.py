"""docs/PLUGINS.md (API 2.0), followed as a new user would: write its files into an empty directory, install the
package, see it in `strata backends`, plan for it (its own settings group included), and pass the conformance kit.

The doc's first steps make a venv and install strata-core from the checkout (`pip install -e <checkout>`) and
pytest: the venv these tests run in is exactly that (checked below), so they are not repeated. The doc's
`pip install -e .` of the new package is done with `pip install --no-deps --no-build-isolation --target DIR` and
seen through PYTHONPATH, because the venv is shared by every test run on this checkout: a backend that appeared in
it for the length of this test would show up in theirs. Removing DIR uninstalls it.
"""

from __future__ import annotations

import importlib.metadata as md
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


def _install(project: Path, site: Path) -> dict:
    """pip-install `project` into `site` (no deps, no build isolation); the environment that sees it."""
    p = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--target", str(site), str(project)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"pip install failed: {p.stderr[-3000:]}"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site)] + [x for x in [env.get("PYTHONPATH")] if x])
    return env


@pytest.fixture(scope="module")
def installed(project, tmp_path_factory) -> dict:
    """Install the project into a private target; the environment that sees it."""
    site = tmp_path_factory.mktemp("site")
    yield _install(project, site)
    shutil.rmtree(site, ignore_errors=True)


def _strata(env: dict, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "strata_core.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


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
    for expected in ("mkdir strata-mynumpy && cd strata-mynumpy", "pip install pytest", "pip install -e .",
                     "strata backends", f"strata plan --backend {BACKEND}",
                     f"strata plan --backend {BACKEND} --set {BACKEND}.chunk_ceiling_tokens=2048",
                     f"pytest --strata-backend {BACKEND} tests/", f"strata run --backend {BACKEND} --check"):
        assert expected in commands, f"the doc no longer says `{expected}`"
    from_checkout = [c for c in commands if c.startswith("pip install -e ") and c != "pip install -e ."]
    assert len(from_checkout) == 1, "the doc installs strata-core from its checkout once"


def test_the_environment_is_the_one_the_doc_makes():
    """strata-core installed editable from this checkout (`pip install -e <checkout>`), with pytest beside it."""
    # pip's record of the install (a checkout's own strata_core.egg-info, seen from its root, has none)
    urls = [json.loads(d.read_text("direct_url.json")) for d in md.distributions(name="strata-core")
            if d.read_text("direct_url.json")]
    assert len(urls) == 1, urls
    (url,) = urls
    assert url.get("dir_info", {}).get("editable") is True, url
    assert Path(url["url"].removeprefix("file://")).resolve() == ROOT
    assert md.version("pytest")


def test_the_example_speaks_api_2_0_only():
    """The example's module implements no API 1.x hook and imports the contract from strata_core.api."""
    code = doc_files(DOC.read_text())["strata_mynumpy/backend.py"]
    hooks = set(re.findall(r"^def (strata_\w+)\(", code, re.M))
    assert hooks == {"strata_backends", "strata_settings_group"}, hooks
    assert 'API_VERSION = "2.0"' in code
    assert "device.backend" not in code, "API 2.0: a device is never asked whose it is"


def test_strata_backends_sees_the_new_backend(installed, project):
    """`strata backends --json` lists the backend as available, from its plugin, with a device and its caps."""
    p = _strata(installed, project, "backends", "--json")
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout)
    assert out["schema"] == "strata.backends/1"
    mine = [b for b in out["backends"] if b["name"] == BACKEND]
    assert len(mine) == 1, [b["name"] for b in out["backends"]]
    assert mine[0]["available"] is True, mine[0]["reason"]
    assert mine[0]["api_version"] == "2.0"
    (device,) = mine[0]["devices"]
    assert device["backend"] == BACKEND and device["device_type"] == "cpu"
    assert device["caps"]["async_copies"] is False
    assert device["caps"]["expert_formats"] == ["f16", "q8_0", "bf16", "q4_k", "q5_k", "q6_k", "mxfp4"]


def test_strata_plan_plans_for_the_new_backend(installed, project):
    """`strata plan --backend mynumpy --json` plans with the backend's platform defaults."""
    p = _strata(installed, project, "plan", "--backend", BACKEND, "--json")
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout)
    assert out["schema"] == "strata.plan/1" and out["backend"] == BACKEND
    assert out["prompt"]["ceiling"] == 4096, "the doc's platform defaults set a 4096-token ceiling"


def test_the_plugins_settings_group_reaches_its_platform_defaults(installed, project):
    """`--set mynumpy.chunk_ceiling_tokens=2048` lowers the ceiling; a value the group's model refuses exits 2."""
    p = _strata(installed, project, "plan", "--backend", BACKEND, "--set", f"{BACKEND}.chunk_ceiling_tokens=2048",
                "--json")
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout)["prompt"]["ceiling"] == 2048
    bad = _strata(installed, project, "plan", "--backend", BACKEND, "--set", f"{BACKEND}.chunk_ceiling_tokens=100")
    assert bad.returncode == 2, bad.stderr[-2000:]
    assert len(bad.stderr.strip().splitlines()) == 1 and f"{BACKEND}.chunk_ceiling_tokens" in bad.stderr


def test_the_example_written_against_api_1_is_refused_in_one_line(project, tmp_path):
    """The same package declaring api_version 1.0 is listed as refused, the line naming both versions."""
    old = tmp_path / "old"
    shutil.copytree(project, old, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "junit.xml"))
    code = old / "strata_mynumpy" / "backend.py"
    code.write_text(code.read_text().replace('API_VERSION = "2.0"', 'API_VERSION = "1.0"'))
    env = _install(old, tmp_path / "site")
    p = _strata(env, old, "backends", "--json")
    assert p.returncode == 0, p.stderr[-2000:]
    (mine,) = [b for b in json.loads(p.stdout)["backends"] if b["name"] == BACKEND]
    assert mine["available"] is False and "1.0" in mine["reason"] and "2.0" in mine["reason"], mine["reason"]
    assert "\n" not in mine["reason"]


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
