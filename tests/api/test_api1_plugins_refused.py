"""A plugin or backend written against API 1.x is refused at load, in one line naming it and why."""

from __future__ import annotations

from types import ModuleType

import pytest

from strata_core.api import API_VERSION, Backend, FactsOnlyDevice, ProbeResult, hookimpl
from strata_core.api.facts import DeviceInfo
from strata_core.registry import REMOVED_HOOKS, load_plugins

INFO = DeviceInfo(backend="old", name="old card", vram_total_bytes=8 << 30, vram_free_bytes=7 << 30)


def _backend(api_version: str = API_VERSION, devices=(FactsOnlyDevice(INFO),)) -> Backend:
    return Backend(name="old", vendor="acme", api_version=api_version,
                   probe=lambda: ProbeResult(available=True, devices=tuple(devices), score=50))


def _plugin(name: str, backend: Backend | None = None, **hooks) -> ModuleType:
    m = ModuleType(name)
    m.strata_backends = hookimpl(lambda: [backend] if backend else [])
    for hook, fn in hooks.items():
        setattr(m, hook, hookimpl(fn))
    return m


def _one_line(host, name: str) -> str:
    (s,) = [s for s in host.statuses() if s.name == name]
    assert not s.available and "\n" not in s.reason
    return s.reason


def test_the_removed_hooks_are_the_broadcast_device_hooks_and_configure():
    assert set(REMOVED_HOOKS) == {"strata_probe", "strata_platform_defaults", "strata_pinned_allocator",
                                  "strata_device_memory", "strata_kernels", "strata_configure"}


@pytest.mark.parametrize("hook, fn", [
    ("strata_kernels", lambda device: None),
    ("strata_probe", lambda backend: None),
    ("strata_platform_defaults", lambda device, host: None),
    ("strata_pinned_allocator", lambda device, budget: None),
    ("strata_device_memory", lambda device: None),
    ("strata_configure", lambda settings: None),
])
def test_a_plugin_implementing_a_removed_hook_is_refused_naming_plugin_and_hook(hook, fn):
    host = load_plugins(autoload=False, extra=[_plugin("legacy", _backend(), **{hook: fn}), _plugin("fine")])
    assert "old" not in host.backends and host.pm.has_plugin("fine") and not host.pm.has_plugin("legacy")
    assert _one_line(host, "legacy") == (f"plugin 'legacy' implements {hook}, removed in API 2.0 "
                                         f"(an API 1.x plugin); refused")


def test_every_removed_hook_is_named_at_once():
    host = load_plugins(autoload=False, extra=[_plugin("legacy", strata_kernels=lambda device: None,
                                                       strata_device_memory=lambda device: None)])
    assert "implements strata_device_memory, strata_kernels, removed" in _one_line(host, "legacy")


@pytest.mark.parametrize("version, said", [("1.0", "speaks api 1.0"), ("1.9.3", "speaks api 1.9.3"),
                                           ("", "declares no api_version"), (None, "declares no api_version")])
def test_a_backend_of_api_1x_or_of_no_version_is_refused_naming_both_versions(version, said):
    host = load_plugins(autoload=False, extra=[_plugin("legacy", _backend(api_version=version))])
    assert "old" not in host.backends
    assert _one_line(host, "old") == f"backend 'old' (plugin 'legacy') {said}; this core speaks {API_VERSION}"


def test_a_probe_listing_bare_device_facts_is_an_api_1x_backend():
    host = load_plugins(autoload=False, extra=[_plugin("legacy", _backend(devices=(INFO,)))])
    r = host.probe("old")
    assert not r.available and r.reason == "probe lists DeviceInfo facts, not Device objects (an API 1.x backend)"


def test_the_in_tree_backends_all_load_on_api_2():
    host = load_plugins()
    assert not [s.reason for s in host.broken], "an in-tree plugin was refused"
    for name in ("cpu", "sim", "cuda", "rocm", "sycl"):
        assert name in host.backends and host.backends[name].api_version == API_VERSION
        assert "API 1.x" not in host.probe(name).reason
