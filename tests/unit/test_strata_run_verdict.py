"""bench/strata_run_h200.py's verdict: the file's own figures give its targets and whether each run kept its plan."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _verdict():
    """The bench module's verdict function (bench/ is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("strata_run_h200", ROOT / "bench" / "strata_run_h200.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.verdict


def test_a_run_whose_measured_peak_is_over_its_plan_is_flagged():
    res = {"prompt_tokens": 4096, "peers": {}, "runs": {
        "all": {"device_bytes_peak_measured": 1001, "device_bytes_planned": 1000},
        "smallest": {"device_bytes_peak_measured": 1000, "device_bytes_planned": 1000},
        "half_skewed": {"device_bytes_planned": 1000}}}
    out = _verdict()(res)
    assert out["plan_obeyed"] == {"all": False, "smallest": True}


def test_the_committed_file_recomputes_to_its_own_figures():
    path = ROOT / "bench" / "results" / "strata_run_h200.json"
    committed = json.loads(path.read_text())
    again = _verdict()(json.loads(path.read_text()))
    for key in ("targets", "ours_over_peer", "plan_obeyed"):
        assert again[key] == committed[key], key


def test_the_host_calibration_times_real_work():
    """The calibration's two medians are measured (positive times) and its shape is what the JSON records."""
    spec = importlib.util.spec_from_file_location("strata_run_h200", ROOT / "bench" / "strata_run_h200.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    got = mod.host_calibration(reps=3)
    assert got["python_dict_loop_200k_ms"] > 0 and got["numpy_expert_table_ops_us"] > 0, got
    assert got["reps"] == 3
