"""`strata simulate --list-faults` lists every fault site the sim injects, each with an example that parses."""

from __future__ import annotations

import contextlib
import io
import json

from strata_core.cli import main
from strata_core.builtin.sim import FaultPlan, list_fault_sites


def _strata(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = main(list(argv))
    return rc, out.getvalue()


def test_list_faults_json_names_every_site_and_example():
    rc, out = _strata("simulate", "--list-faults", "--json")
    assert rc == 0
    listed = json.loads(out)["sites"]
    assert [(s["name"], s["example"]) for s in listed] == [(s.name, s.spec_example) for s in list_fault_sites()]
    FaultPlan.parse([s["example"] for s in listed])  # every example is a valid spec


def test_list_faults_text_has_one_line_a_site():
    rc, out = _strata("simulate", "--list-faults")
    assert rc == 0
    lines = out.strip().splitlines()
    assert len(lines) == len(list_fault_sites())
    for line, site in zip(lines, list_fault_sites()):
        assert line.startswith(site.spec_example)
