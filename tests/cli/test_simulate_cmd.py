"""`strata simulate`: every seed scenario (the project's copies in tests/data/scenarios) replays through the runtime
on the sim backend (accounting only) with no engine exit and every request completed; the seeds' lines are said
once; injected faults become fallbacks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from strata_core.cli import main

SCENARIO_DIR = Path(__file__).resolve().parents[1] / "data" / "scenarios"
SCENARIOS = sorted(SCENARIO_DIR.glob("*.json")) if SCENARIO_DIR.is_dir() else []


def _scenario(name: str) -> Path:
    p = SCENARIO_DIR / name
    assert p.is_file(), f"the project's copy {p} is missing"  # tests/data ships with the tests: never a skip
    return p


#: Replays already run in this module, by argv: the same replay is deterministic (seeded), so the tests that only
#: read a plain replay of one scenario share one run instead of repeating it (each takes seconds).
_REPLAYS: dict[tuple[str, ...], tuple[int, str]] = {}


def _simulate(capsys, *argv) -> tuple[int, dict]:
    key = tuple(argv)
    if key not in _REPLAYS:
        capsys.readouterr()
        rc = main(["simulate", *argv, "--json"])
        _REPLAYS[key] = (rc, capsys.readouterr().out)
    rc, out = _REPLAYS[key]
    return rc, json.loads(out)  # a fresh object per test, so no test sees another's edits


def test_the_scenario_copies_are_there():
    assert len(SCENARIOS) >= 5, f"tests/data/scenarios lost its seed scenarios: {SCENARIOS}"


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_every_scenario_replays_with_no_engine_exit_and_every_request_completed(clean_strata_env, capsys, path):
    rc, r = _simulate(capsys, "--scenario", str(path))
    assert rc == 0 and r["schema"] == "strata.simulation/1"
    assert r["engine_exits"] == 0, r["engine_exit_reasons"]
    n = len(json.loads(path.read_text())["requests"])
    assert len(r["requests"]) == n and r["completed"] == n and r["refused"] == 0
    for q in r["requests"]:
        assert set(q) >= {"prompt_tokens", "chunk", "loan_slots", "halvings", "completed", "refused_reason",
                          "fallbacks"}
    assert r["device"]["live_allocations"] == 0, "the replay freed what it allocated"


def test_seed_2090_the_larger_loan_is_lent_and_said_once(clean_strata_env, capsys):
    rc, r = _simulate(capsys, "--scenario", str(_scenario("seed2090-rtx4070ti-reserve700.json")))
    assert rc == 0
    auto = next(x["loan_slots"] for x in r["plan"]["prompt"]["loans"] if x["chunk"] == r["plan"]["prompt"]["chunk"])
    larger = [q for q in r["requests"] if q["larger_than_auto"]]
    assert larger and all(q["completed"] and q["loan_slots"] > auto for q in larger)
    lines = [ln for ln in r["log"] if "is larger than the auto chunk's" in ln]
    assert len(lines) == 1 and "lent from further down the cache" in lines[0]


def test_seed_1756_the_arena_fails_whole_and_exhausted_is_carried_to_the_share(clean_strata_env, capsys):
    rc, r = _simulate(capsys, "--scenario", str(_scenario("seed1756-rtx3090-windows-pinned.json")))
    assert rc == 0 and r["completed"] == len(r["requests"])
    assert r["pinned"]["budget_exhausted"] and not r["pinned"]["arena_whole"]
    assert any("registering the whole arena" in f["why"] for f in r["fallbacks"])
    share = r["cpu_share"]
    # off, or its buffer taken from the kept floor: one line says which
    assert (not share["enabled"]) or share["buffer_bytes"] <= r["plan"]["pinned"]["floor_bytes"]
    lines = [ln for ln in r["log"] if ln.startswith("CPU share")]
    assert len(lines) == 1 and ("exhausted" in lines[0] or "floor" in lines[0])
    assert r["pinned"]["budget_peak_bytes"] <= r["plan"]["pinned"]["limit_bytes"]


def test_an_injected_pinned_failure_turns_the_share_off_with_one_line_and_requests_complete(clean_strata_env, capsys):
    rc, r = _simulate(capsys, "--scenario", str(_scenario("seed2090-rtx4070ti-reserve700.json")),
                      "--inject", "pinned-alloc:every")
    assert r["plan"]["cpu_share"]["enabled"], "the scenario's plan arms the share"
    assert rc == 0 and r["engine_exits"] == 0 and r["completed"] == len(r["requests"])
    assert not r["cpu_share"]["enabled"] and r["faults_injected"]
    assert len([f for f in r["fallbacks"] if f["what"].startswith("CPU share")]) == 1


def test_the_share_arms_on_a_small_tail_chunk_without_the_fault(clean_strata_env, capsys):
    rc, r = _simulate(capsys, "--scenario", str(_scenario("seed2090-rtx4070ti-reserve700.json")))
    assert r["cpu_share"]["enabled"] and r["cpu_share"]["experts"] > 0
    assert r["cpu_share"]["allocations"] == [["cpu-share activations", r["cpu_share"]["buffer_bytes"]]], \
        "one buffer, sized once"


def test_random_requests_and_over_long_prompts_never_exit_the_engine(clean_strata_env, capsys):
    rc, r = _simulate(capsys, "--scenario", str(_scenario("seed2090-rtx4070ti-reserve1000.json")),
                      "--requests", "12", "--seed", "5", "--set", "kv.max_context=3500")
    assert rc == 0 and r["engine_exits"] == 0 and len(r["requests"]) == 16
    refused = [q for q in r["requests"] if q["refused_reason"]]
    assert refused and all("kv.max_context" in q["refused_reason"] for q in refused)
    assert all(q["completed"] for q in r["requests"] if not q["refused_reason"])
    assert r["refused"] == len(refused) and r["completed"] == 16 - len(refused)


def test_device_faults_at_start_are_reported_not_raised(clean_strata_env, capsys):
    rc, r = _simulate(capsys, "--scenario", str(_scenario("seed2090-rtx4070ti-reserve700.json")),
                      "--inject", "vram-drop:bytes=2GiB,at=1")
    # the cache pool shrinks with a fallback line (free VRAM changed since planning); the loans that no longer
    # fit halve their chunks; every request still completes
    assert r["engine_exits"] == 0 and r["completed"] == len(r["requests"])
    assert any(f["what"] == "expert cache" for f in r["fallbacks"])
    assert r["cache"]["slots"] < r["plan"]["expert_cache"]["slots"] and r["halvings"] > 0


def test_bad_input_exits_2_with_one_line(clean_strata_env, capsys):
    """In-process (tests/badinput drives the same through a fresh interpreter too)."""
    for args in (["--scenario", "missing.json"],
                 ["--scenario", str(_scenario("seed2090-rtx4070ti-reserve700.json")), "--inject", "no-such-site"]):
        capsys.readouterr()
        rc = main(["simulate", *args])
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err


def test_the_table_output(clean_strata_env, capsys):
    rc = main(["simulate", "--scenario", str(_scenario("seed2090-rtx4070ti-reserve1000.json"))])
    out = capsys.readouterr().out
    assert rc == 0 and "engine exits: 0" in out and "loan slots" in out


def test_seed_1756_with_the_share_on_it_takes_its_buffer_from_the_kept_floor(clean_strata_env, capsys):
    rc, r = _simulate(capsys, "--scenario", str(_scenario("seed1756-rtx3090-windows-pinned.json")),
                      "--set", "prefill.cpu_share=on")
    assert rc == 0 and r["engine_exits"] == 0 and r["completed"] == len(r["requests"])
    assert r["pinned"]["budget_exhausted"] and r["plan"]["cpu_share"]["enabled"]
    share = r["cpu_share"]
    assert share["enabled"] and share["experts"] > 0, "the 900- and 300-token prompts arm the share"
    assert share["allocations"] == [["cpu-share activations", share["buffer_bytes"]]]
    assert share["buffer_bytes"] <= r["plan"]["pinned"]["floor_bytes"]
    lines = [ln for ln in r["log"] if ln.startswith("CPU share")]
    assert len(lines) == 1 and "kept floor" in lines[0] and "exhausted" in lines[0]
