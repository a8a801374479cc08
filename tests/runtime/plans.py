"""Helpers of the runtime tests: plans of real scenarios and of small generated models on the sim backend."""

from __future__ import annotations

from pathlib import Path

import pytest

from strata_core.planner import plan_for_machine
from strata_core.registry import load_plugins
from strata_core.scenario import load_scenario
from strata_core.config.settings import settings_from_partial

SCENARIO_DIR = Path(__file__).resolve().parents[1] / "data" / "scenarios"


def scenario_plan(name: str):
    """(scenario, plan) of a shared scenario, planned with its profile's backend rules; skips when it is absent."""
    path = SCENARIO_DIR / name
    if not path.is_file():
        pytest.skip(f"shared scenario {path} is absent")
    sc = load_scenario(path)
    plugins = load_plugins()
    return sc, plan_for_machine(plugins, plugins.resolve_target(sc.settings, profile=sc.profile), sc.model, sc.settings)


def sim_plan(spec, settings: dict):
    """A plan for `spec` on the sim backend's default device (a 24 GiB card), with these partial settings."""
    plugins = load_plugins()
    target = plugins.resolve_target(settings_from_partial({"backend": {"name": "sim"}}))
    return plugins, plan_for_machine(plugins, target, spec, settings_from_partial(settings))
