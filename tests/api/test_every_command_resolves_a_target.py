"""One resolution: every command that plans, runs or reports a selection goes through `PluginHost.resolve_target`."""

from __future__ import annotations

from pathlib import Path

import pytest

from strata_core import cli
from strata_core.registry import PluginHost

SCENARIO = Path(__file__).resolve().parents[1] / "data" / "scenarios" / "seed2090-rtx4070ti-reserve700.json"

COMMANDS = {
    "run": ["run", "--backend", "cpu", "--prompt-tokens", "64", "--decode-tokens", "1", "--json"],
    "plan": ["plan", "--json"],
    "plan --scenario": ["plan", "--scenario", str(SCENARIO), "--json"],
    "simulate": ["simulate", "--scenario", str(SCENARIO), "--json"],
    "bench": ["bench", "--backend", "sim", "--tokens", "32", "--experts", "8", "--hidden", "64", "--ffn", "64",
              "--repeat", "1", "--json"],
    "doctor": ["doctor", "--json"],
    "backends": ["backends", "--json"],
    "config show": ["config", "show", "--json"],
}


@pytest.fixture
def resolutions(monkeypatch):
    """Every call of PluginHost.resolve_target, as (backend name asked, profile backend or None, result backend)."""
    calls = []
    real = PluginHost.resolve_target

    def spy(self, settings, host_override=None, profile=None, origin=None):
        t = real(self, settings, host_override=host_override, profile=profile, origin=origin)
        calls.append((getattr(getattr(settings, "backend", None), "name", None),
                      profile.backend if profile else None, t.backend.name))
        return t
    monkeypatch.setattr(PluginHost, "resolve_target", spy)
    return calls


@pytest.mark.parametrize("name", list(COMMANDS))
def test_the_command_resolves_its_target_once_through_the_registry(name, resolutions, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert cli.main(COMMANDS[name]) == 0, capsys.readouterr().err
    assert len(resolutions) == 1, resolutions
    if "scenario" in " ".join(COMMANDS[name]):
        assert resolutions[0][1] == "cuda" and resolutions[0][2] == "cuda"  # the scenario's own backend's rules
    elif name in ("run", "bench"):
        assert resolutions[0][2] == COMMANDS[name][2]


def test_a_bad_device_index_is_refused_by_every_command_that_resolves(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    for argv in (["run", "--prompt-tokens", "64"], ["plan"], ["bench", "--repeat", "1"]):
        assert cli.main(argv + ["--backend", "cpu", "--set", "backend.device=5"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == ["strata: error: backend.device: backend 'cpu' has 1 device(s), no device 5; allowed: 0..0"], err


def test_run_with_autoload_off_runs_on_the_builtin_cpu(capsys, monkeypatch, tmp_path):
    import json
    monkeypatch.chdir(tmp_path)
    argv = ["run", "--set", "plugins.autoload=false", "--prompt-tokens", "64", "--decode-tokens", "1", "--json"]
    assert cli.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["backend"] == "cpu" and report["device"]["device_type"] == "cpu" and report["tokens"]
