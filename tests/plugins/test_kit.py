"""Self-tests of the conformance kit and the matrix: selection, skip-vs-fail, and that a bad backend is caught.

Each test runs pytest (or .ci/matrix.py) in a subprocess against two test backends installed only for that
subprocess (a dist-info on PYTHONPATH in a temporary directory, so the shared venv never sees them):
- 'offline': installed but unavailable;
- 'bad': available, with known defects (a scatter_add that overwrites, top-k in the wrong order, allocators that
  raise instead of returning None);
- 'copy': available, the numpy reference's kernels under another class (passes, and is not the reference lane).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("strata_ci_matrix", ROOT / ".ci" / "matrix.py")
matrix = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(matrix)

TEST_BACKENDS = '''
"""Backends for the kit's self-tests: 'offline' (unavailable), 'bad' (available, with known defects) and 'copy'
(the numpy reference's kernels under another class: a backend that passes, not the reference)."""
from dataclasses import dataclass
import numpy as np
from strata_core.api import API_VERSION
from strata_core.api.backend import Backend, DeviceSession, PinnedBudget, ProbeResult
from strata_core.builtin.cpu import HostMemory, HostPinnedAllocator
from strata_core.api.facts import DeviceInfo, PlatformDefaults
from strata_core.api.hookspecs import hookimpl
from strata_core.reference.kernels import ReferenceKernels


class BadKernels(ReferenceKernels):
    name = "bad"

    def scatter_add(self, out, rows, y, scale):
        out[rows] = y * scale[:, None]

    def route_topk(self, logits, k):
        ids, w = super().route_topk(logits, k)
        return ids[:, ::-1].copy(), w[:, ::-1].copy()


class CopyKernels(ReferenceKernels):
    name = "copy"


class RaisingPinned(HostPinnedAllocator):
    def alloc(self, nbytes, from_floor=False):
        buf = super().alloc(nbytes, from_floor)
        if buf is None:
            raise MemoryError("no page-locked memory left")
        return buf


class RaisingMemory(HostMemory):
    def alloc(self, shape, dtype):
        return np.empty(shape, dtype=dtype)


@dataclass(frozen=True)
class TestDevice:
    info: DeviceInfo
    defective: bool

    def platform_defaults(self, host):
        return PlatformDefaults(source=self.info.backend)

    def open(self, plan):
        budget = PinnedBudget(plan.pinned.limit_bytes, plan.pinned.floor_bytes)
        if self.defective:
            return DeviceSession(memory=RaisingMemory(), kernels=BadKernels(), budget=budget,
                                 pinned=RaisingPinned(budget))
        return DeviceSession(memory=HostMemory(), kernels=CopyKernels(), budget=budget,
                             pinned=HostPinnedAllocator(budget))


def _device(name, defective):
    info = DeviceInfo(backend=name, name=f"{name} device", vram_total_bytes=1 << 30, vram_free_bytes=1 << 30)
    return TestDevice(info, defective)


OFFLINE = Backend(name="offline", vendor="test", api_version=API_VERSION,
                  probe=lambda: ProbeResult.unavailable("no offline device in this test"))
BAD = Backend(name="bad", vendor="test", api_version=API_VERSION,
              probe=lambda: ProbeResult(available=True, devices=(_device("bad", True),)))
COPY = Backend(name="copy", vendor="test", api_version=API_VERSION,
               probe=lambda: ProbeResult(available=True, devices=(_device("copy", False),)))


@hookimpl
def strata_backends():
    return [OFFLINE, BAD, COPY]
'''

#: The kit's tests the 'bad' backend must fail, and only these.
BAD_FAILS = {
    "test_alloc_pinned_zero_budget_returns_none[bad]",
    "test_alloc_pinned_budget_accounting[bad]",
    "test_alloc_pinned_refused_by_the_platform_returns_none[bad]",
    "test_alloc_absurd_device_alloc_returns_none[bad]",
    "test_kernel_scatter_add[bad]",
    "test_kernel_route_topk[bad]",
}

#: A module that imports the kit without the run suite (which needs `strata run`, tested by the matrix's own lanes).
KIT_MODULE = """
{header}
from strata_core.testing.conformance import *  # noqa: F401,F403

del test_run_check_tiny_model, test_run_outputs_are_reproducible  # noqa: F821


def test_ordinary():
    assert sum([1, 2]) == 3
"""


@pytest.fixture
def site(tmp_path) -> dict:
    """Install the test backends for subprocesses only; return the environment that sees them."""
    lib = tmp_path / "site"
    dist = lib / "strata_kit_testbackends-0.0.dist-info"
    dist.mkdir(parents=True)
    (lib / "strata_kit_testbackends.py").write_text(TEST_BACKENDS)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: strata-kit-testbackends\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text("[strata.backends]\nkit-test = strata_kit_testbackends\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(lib)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def _module(tmp_path: Path, header: str = "") -> Path:
    """Write a test module that imports the kit (with an optional module-level header)."""
    p = tmp_path / "suite" / "test_suite.py"
    p.parent.mkdir(exist_ok=True)
    p.write_text(KIT_MODULE.format(header=header))
    return p


def _pytest(env: dict, module: Path, *args: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Run pytest on `module` in a subprocess; return the process and its test cases from the junit report."""
    xml = module.parent / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *args, str(module)]
    p = subprocess.run(cmd, cwd=module.parent, env=env, capture_output=True, text=True, timeout=600)
    return p, (matrix.parse_junit(xml) if xml.exists() else [])


def _outcomes(cases: list[dict]) -> dict[str, str]:
    return {c["name"]: c["outcome"] for c in cases}


def test_without_a_selection_the_suite_is_deselected(site, tmp_path):
    """No --strata-backend and no STRATA_CONFORMANCE_BACKENDS: only the module's own test runs."""
    p, cases = _pytest(site, _module(tmp_path))
    assert p.returncode == 0, p.stdout + p.stderr
    assert _outcomes(cases) == {"test_ordinary": "passed"}
    assert "deselected" in p.stdout


def test_module_selection_runs_every_suite_on_cpu(site, tmp_path):
    """STRATA_CONFORMANCE_BACKENDS = ['cpu'] runs the hooks, alloc, memory and kernel suites; cpu passes them, its
    kernel suite marked as the reference (its kernels are the numpy reference)."""
    p, cases = _pytest(site, _module(tmp_path, 'STRATA_CONFORMANCE_BACKENDS = ["cpu"]'))
    assert p.returncode == 0, p.stdout[-3000:]
    suites = matrix.summarize([c for c in cases if c["name"] != "test_ordinary"])
    assert set(suites) == {"hooks", "alloc", "memory", "kernel"}
    assert all(s["failed"] == 0 and s["passed"] > 0 for s in suites.values()), suites
    assert all(s["skipped"] == 0 for n, s in suites.items() if n != "kernel"), suites
    # the only skips: grouped-FFN formats the cpu device does not advertise in its caps
    assert all("does not advertise expert format" in r for r in suites["kernel"]["skip_reasons"]), suites
    assert {n: s["status"] for n, s in suites.items()} == {"hooks": "passed", "alloc": "passed", "memory": "passed",
                                                           "kernel": "reference"}
    assert all(c["name"].endswith("]") and "[cpu" in c["name"] for c in cases if c["name"] != "test_ordinary")


def test_the_option_overrides_the_module_selection(site, tmp_path):
    """--strata-backend cpu wins over a module that names 'offline'."""
    p, cases = _pytest(site, _module(tmp_path, 'STRATA_CONFORMANCE_BACKENDS = ["offline"]'), "--strata-backend", "cpu")
    assert p.returncode == 0, p.stdout[-3000:]
    assert not any("offline" in c["name"] for c in cases)


def test_all_skips_an_unavailable_backend_with_its_reason(site, tmp_path):
    """Under 'all' the unavailable backend's tests are skipped, each with the probe's reason."""
    p, cases = _pytest(site, _module(tmp_path), "--strata-backend", "all", "-k", "offline")
    offline = [c for c in cases if "[offline" in c["name"]]
    assert offline, p.stdout[-3000:]
    assert all(c["outcome"] == "skipped" and "no offline device in this test" in c["message"] for c in offline)
    assert p.returncode == 0


def test_a_named_unavailable_backend_fails(site, tmp_path):
    """Naming an unavailable backend is a failure, with the probe's reason."""
    p, cases = _pytest(site, _module(tmp_path), "--strata-backend", "offline")
    suite = [c for c in cases if c["name"] != "test_ordinary"]
    assert p.returncode == 1 and suite
    assert all(c["outcome"] == "failed" and "no offline device in this test" in c["message"] for c in suite)


def test_a_named_backend_that_is_not_installed_fails(site, tmp_path):
    """Naming a backend nobody provides is a failure that lists what is installed."""
    p, cases = _pytest(site, _module(tmp_path), "--strata-backend", "nosuch")
    suite = [c for c in cases if c["name"] != "test_ordinary"]
    assert p.returncode == 1 and suite
    assert all(c["outcome"] == "failed" and "'nosuch' is not installed" in c["message"] for c in suite)


def test_the_kit_catches_each_defect_of_a_bad_backend(site, tmp_path):
    """The 'bad' backend fails exactly the tests of its defects and passes the rest."""
    p, cases = _pytest(site, _module(tmp_path), "--strata-backend", "bad")
    got = _outcomes(cases)
    failed = {n for n, o in got.items() if o == "failed"}
    assert failed == BAD_FAILS, f"unexpected: {failed ^ BAD_FAILS}"
    skipped = {c["name"] for c in cases if c["outcome"] == "skipped"}
    assert all("does not advertise expert format" in c["message"] for c in cases if c["outcome"] == "skipped")
    assert {n for n, o in got.items() if o == "passed"} == set(got) - BAD_FAILS - skipped
    assert len(got) > len(BAD_FAILS) + 10
    assert p.returncode == 1


def test_the_matrix_reports_each_lane(site, tmp_path):
    """The matrix: cpu the reference, 'copy' passed, 'offline' skipped with its reason, 'bad' failed, 'nosuch'
    skipped as not installed."""
    module = _module(tmp_path)
    out = tmp_path / "matrix.json"
    cmd = [sys.executable, str(ROOT / ".ci" / "matrix.py"), "--lanes", "cpu,copy,offline,bad,nosuch",
           "--module", str(module), "--json-out", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, env=site, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 1, p.stdout + p.stderr
    doc = json.loads(out.read_text())
    assert doc["schema"] == "strata.matrix/1" and doc["ok"] is False
    lanes = {l["backend"]: l for l in doc["lanes"]}
    assert lanes["cpu"]["status"] == "reference", lanes["cpu"]["reason"]
    assert set(lanes["cpu"]["suites"]) >= {"hooks", "alloc", "memory", "kernel"}
    assert lanes["cpu"]["suites"]["kernel"]["status"] == "reference"
    assert lanes["cpu"]["suites"]["hooks"]["status"] == "passed"
    assert lanes["copy"]["status"] == "passed" and lanes["copy"]["suites"]["kernel"]["status"] == "passed"
    assert lanes["offline"]["status"] == "skipped" and "no offline device in this test" in lanes["offline"]["reason"]
    assert lanes["bad"]["status"] == "failed" and lanes["bad"]["suites"]["kernel"]["failed"] == 2
    assert lanes["nosuch"]["status"] == "skipped" and "not installed" in lanes["nosuch"]["reason"]
    rows = {line.split()[0]: line.split()[-1] for line in p.stdout.splitlines()[1:6]}
    assert rows == {"cpu": "reference", "copy": "passed", "offline": "skipped", "bad": "failed", "nosuch": "skipped"}


def test_the_matrix_refuses_bad_arguments():
    """A module that does not exist is bad input: exit 2."""
    p = subprocess.run([sys.executable, str(ROOT / ".ci" / "matrix.py"), "--module", "no/such/module.py"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "no such file" in p.stderr


def test_suite_of_names_the_suite_from_the_test_name():
    """Test names map to their suite; unknown prefixes to 'other'."""
    assert matrix.suite_of("test_kernel_linear[cpu-f16]") == "kernel"
    assert matrix.suite_of("test_alloc_pinned_zero_budget_returns_none[x]") == "alloc"
    assert matrix.suite_of("test_ordinary") == "other"



def test_the_matrix_prints_one_json_object(site):
    """--json prints one strata.matrix/1 object; a lane that is only skipped is not a failure (exit 0)."""
    p = subprocess.run([sys.executable, str(ROOT / ".ci" / "matrix.py"), "--lanes", "offline", "--json"],
                       cwd=ROOT, env=site, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["schema"] == "strata.matrix/1" and doc["ok"] is True
    assert [(l["backend"], l["status"]) for l in doc["lanes"]] == [("offline", "skipped")]
