"""The contract package itself: what it exports, and how each hook is documented."""

from __future__ import annotations

import inspect

import strata_core.api as api
from strata_core.api import hookspecs

HOOKS = {"strata_backends", "strata_settings_group", "strata_host_info", "strata_adjust_plan"}


def _specs() -> dict:
    return {n: f for n, f in vars(hookspecs).items()
            if callable(f) and getattr(f, "strata_spec", None) is not None}


def test_the_hooks_are_the_four_phases_and_nothing_else():
    assert set(_specs()) == HOOKS


def test_every_hook_says_what_none_means_and_when_it_was_added():
    for name, f in _specs().items():
        doc = inspect.getdoc(f) or ""
        assert "versionadded" in doc, f"{name}: no versionadded"
        assert "None" in doc, f"{name}: does not say what None means"
        assert inspect.signature(f).return_annotation is not inspect.Signature.empty, f"{name}: untyped return"


def test_host_info_is_firstresult_and_the_others_collect_every_answer():
    opts = {n: f.strata_spec for n, f in _specs().items()}
    assert opts["strata_host_info"]["firstresult"] is True
    assert not any(opts[n]["firstresult"] for n in HOOKS - {"strata_host_info"})


def test_adjust_plan_receives_the_draft_and_the_target_only():
    assert list(inspect.signature(hookspecs.strata_adjust_plan).parameters) == ["draft", "target"]


def test_everything_in_all_is_importable_from_the_package():
    assert api.API_VERSION == "2.0"
    missing = [n for n in api.__all__ if not hasattr(api, n)]
    assert not missing and len(set(api.__all__)) == len(api.__all__)
    for name in ("Backend", "Device", "DeviceSession", "FactsOnlyDevice", "ProbeResult", "SettingsGroup", "Target",
                 "PlanDraft", "PlatformDefaults", "DeviceInfo", "HostInfo", "KernelSet", "LayerOps", "hookimpl"):
        assert name in api.__all__, name
