"""The backend conformance matrix: run the kit once per backend lane and print backend x suite.

    .venv/bin/python .ci/matrix.py [--lanes cpu,sim,...] [--json-out PATH] [--json]

A backend whose distribution is in this repository (plugins/opencl) but not in the venv is installed into a private
directory for its lane. A lane whose backend is not installed or not available on this machine is `skipped` with
the probe's reason; a lane whose plugin does not load, or whose suite has a failure or an error, is `failed`.
A lane whose kernels are the numpy reference itself (cpu, sim) is `reference`, and so is its kernel suite: those
kernels are checked against float64 there, but they are what every other lane is compared with, not a backend
that passed (the kit's kernel tests record the junit property `strata_reference`).
Exit 0 when no lane failed, 1 when one did, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = "strata.matrix/1"
DEFAULT_LANES = ("cpu", "sim", "sycl", "opencl", "cuda", "rocm")
SUITE_MODULE = "tests/plugins/test_conformance_all.py"
#: The suites of the kit, by test-name prefix (see strata_core.testing.conformance).
SUITES = ("hooks", "alloc", "memory", "kernel", "run")
#: The junit property a kit kernel test records: "1" when the kernels under test are the numpy reference.
REFERENCE_PROPERTY = "strata_reference"
#: Wall-clock limit of one lane's pytest run, seconds (against hangs).
LANE_LIMIT_S = 1800


#: Backends whose distribution lives in this repository but outside strata-core: when the venv does not have it,
#: the lane installs it into a private directory for its own run (never into the shared venv).
LOCAL_DISTRIBUTIONS = {"opencl": "plugins/opencl"}

#: Run in a subprocess (the lane's environment): print what the plugin host says of one backend, as JSON.
PROBE_SCRIPT = """
import json, sys
from strata_core.registry import load_plugins
name = sys.argv[1]
host = load_plugins()
out = {"installed": name in host.backends, "broken": [b.reason for b in host.broken if b.name == name]}
if out["installed"]:
    r = host.probe(name)
    out.update(available=r.available, reason=r.reason, install_hint=host.backends[name].install_hint)
print(json.dumps(out))
"""


def lane_env(site: Path | None) -> dict:
    """The environment of a lane's subprocesses: this one, with a private install directory first on the path."""
    env = dict(os.environ)
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(site)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def probe_lane(name: str, env: dict) -> dict:
    """What the plugin host in the lane's environment says of the backend (installed, broken, available, reason)."""
    p = subprocess.run([sys.executable, "-c", PROBE_SCRIPT, name], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    if p.returncode != 0:
        tail = " | ".join(p.stderr.strip().splitlines()[-2:])
        return {"installed": False, "broken": [f"probing crashed: {tail}"]}
    return json.loads(p.stdout)


def lane_state(info: dict) -> tuple[str, str]:
    """('run', '') when the backend is available, else ('skipped' or 'failed', why)."""
    if not info["installed"]:
        if info["broken"]:
            return "failed", f"plugin did not load: {info['broken'][0]}"
        return "skipped", "not installed (no plugin provides this backend here)"
    if not info["available"]:
        hint, reason = info.get("install_hint"), info.get("reason") or "not available"
        return "skipped", reason + (f" (install: {hint})" if hint and hint not in reason else "")
    return "run", ""


def install_local(name: str, tmp: Path) -> tuple[Path | None, str]:
    """Install the repository's own distribution of a backend into tmp/site: (site, '') or (None, pip's error)."""
    src = ROOT / LOCAL_DISTRIBUTIONS[name]
    copy = tmp / "src"
    shutil.copytree(src, copy, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    site = tmp / "site"
    p = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--target", str(site), str(copy)], capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        return None, " | ".join(p.stderr.strip().splitlines()[-3:])
    return site, ""


def suite_of(test_name: str) -> str:
    """The suite a conformance test belongs to, from its name."""
    bare = test_name.split("[", 1)[0]
    for s in SUITES:
        if bare.startswith(f"test_{s}_"):
            return s
    return "other"


def parse_junit(path: Path) -> list[dict]:
    """[{name, suite, outcome: passed|failed|skipped, message, reference}] from a pytest junit XML file."""
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name", "?")
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                message = (el.get("message") or el.text or "").strip().splitlines()[0][:300] if (
                    el.get("message") or el.text) else tag
                break
        out.append({"name": name, "suite": suite_of(name), "outcome": outcome, "message": message,
                    "reference": props.get(REFERENCE_PROPERTY) == "1"})
    return out


def summarize(cases: list[dict]) -> dict[str, dict]:
    """Per suite: status (failed, reference, passed or skipped), counts, failing test names and skip reasons."""
    suites: dict[str, dict] = {}
    for c in cases:
        s = suites.setdefault(c["suite"], {"passed": 0, "failed": 0, "skipped": 0, "failures": [], "skip_reasons": []})
        s[c["outcome"]] += 1
        if c["outcome"] == "failed":
            s["failures"].append(f"{c['name']}: {c['message']}")
        elif c["outcome"] == "skipped" and c["message"] not in s["skip_reasons"]:
            s["skip_reasons"].append(c["message"])
    for name, s in suites.items():
        ran = [c for c in cases if c["suite"] == name and c["outcome"] == "passed"]
        is_reference = bool(ran) and all(c.get("reference") for c in ran)
        s["status"] = ("failed" if s["failed"] else "reference" if is_reference else "passed" if s["passed"]
                       else "skipped")
    return suites


def run_lane(name: str, module: str) -> dict:
    """Run the conformance suite for one backend in a subprocess and return the lane's record."""
    lane = {"backend": name, "status": "", "reason": "", "installed_from": "", "returncode": None, "suites": {}}
    with tempfile.TemporaryDirectory(prefix="strata-matrix-") as tmp:
        env = lane_env(None)
        info = probe_lane(name, env)
        if not info["installed"] and not info["broken"] and name in LOCAL_DISTRIBUTIONS:
            site, err = install_local(name, Path(tmp))
            if site is None:
                lane.update(status="failed", reason=f"{LOCAL_DISTRIBUTIONS[name]} did not install: {err}")
                return lane
            env = lane_env(site)
            info = probe_lane(name, env)
            lane["installed_from"] = LOCAL_DISTRIBUTIONS[name]
        state, why = lane_state(info)
        if state != "run":
            lane.update(status=state, reason=why)
            return lane
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "--strata-backend", name, "-q", "-p", "no:cacheprovider",
               f"--junitxml={xml}", module]
        try:
            p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=LANE_LIMIT_S)
        except subprocess.TimeoutExpired:
            lane.update(status="failed", reason=f"the suite did not finish within {LANE_LIMIT_S} s")
            return lane
        lane["returncode"] = p.returncode
        if not xml.exists():
            tail = (p.stdout + p.stderr).strip().splitlines()[-3:]
            lane.update(status="failed", reason=f"pytest exited {p.returncode} without a report: {' | '.join(tail)}")
            return lane
        cases = parse_junit(xml)
    lane["suites"] = summarize(cases)
    if not cases:
        lane.update(status="failed", reason="no conformance test ran")
    elif any(s["status"] == "failed" for s in lane["suites"].values()) or p.returncode != 0:
        lane["status"] = "failed"
        failures = [f for s in lane["suites"].values() for f in s["failures"]]
        more = f"; and {len(failures) - 3} more" if len(failures) > 3 else ""
        lane["reason"] = "; ".join(failures[:3]) + more if failures else f"pytest exited {p.returncode}"
    elif any(s["status"] == "reference" for s in lane["suites"].values()):
        lane.update(status="reference", reason="its kernels are the numpy reference the other lanes are compared "
                                               "with; checked here against float64")
    else:
        lane["status"] = "passed"
    return lane


def render(lanes: list[dict]) -> str:
    """The matrix as text: one row per backend, one column per suite, then the reasons."""
    cols = [s for s in SUITES] + sorted({k for l in lanes for k in l["suites"]} - set(SUITES))
    width = max(8, *(len(l["backend"]) for l in lanes))
    lines = ["backend".ljust(width) + "  " + "  ".join(c.ljust(14) for c in cols) + "  lane"]
    for l in lanes:
        cells = []
        for c in cols:
            s = l["suites"].get(c)
            if s is None:
                cells.append((l["status"] if l["status"] not in ("passed", "reference") else "-").ljust(14))
            else:
                n = s["passed"] + s["failed"] + s["skipped"]
                cells.append(f"{s['status']} {s['passed']}/{n}".ljust(14))
        lines.append(l["backend"].ljust(width) + "  " + "  ".join(cells) + "  " + l["status"])
    notes = [f"  {l['backend']}: {l['status']} ({l['reason']})" for l in lanes if l["reason"]]
    notes += [f"  {l['backend']}: installed from {l['installed_from']} for this run" for l in lanes
              if l["installed_from"]]
    skips = [f"  {l['backend']}/{k}: skipped ({r})" for l in lanes for k, s in l["suites"].items()
             for r in s["skip_reasons"]]
    return "\n".join(lines + ([""] + notes if notes else []) + skips)


def main(argv: list[str] | None = None) -> int:
    """Run every lane, print the matrix, write the JSON if asked; 1 if any lane failed."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lanes", default=",".join(DEFAULT_LANES), help="comma list of backends (default: %(default)s)")
    ap.add_argument("--module", default=SUITE_MODULE, help="test module that imports the kit (default: %(default)s)")
    ap.add_argument("--json-out", default=None, metavar="PATH", help=f"also write the matrix ({SCHEMA}) here")
    ap.add_argument("--json", action="store_true", help=f"print the matrix as one {SCHEMA} object instead of text")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    names = [n.strip() for n in args.lanes.split(",") if n.strip()]
    if not names:
        print("matrix: error: --lanes names no backend", file=sys.stderr)
        return 2
    if not (ROOT / args.module).exists() and not Path(args.module).exists():
        print(f"matrix: error: --module {args.module}: no such file", file=sys.stderr)
        return 2
    # Lanes are independent subprocesses (own temp dir, own install): run one per core, reported in --lanes order.
    with ThreadPoolExecutor(max_workers=max(1, min(len(names), os.cpu_count() or 1))) as pool:
        lanes = list(pool.map(lambda n: run_lane(n, args.module), names))
    ok = not any(l["status"] == "failed" for l in lanes)
    doc = {"schema": SCHEMA, "ok": ok, "module": args.module, "lanes": lanes}
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc, indent=2) if args.json else render(lanes))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
