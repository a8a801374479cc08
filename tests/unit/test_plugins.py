"""Plugin manager: entry points, allow/block/autoload, api versions, broken plugins and backend resolution."""

from __future__ import annotations

from types import ModuleType, SimpleNamespace

import pytest

from strata_core import registry as plugins
from strata_core.api import API_VERSION
from strata_core.api.backend import Backend, ProbeResult
from strata_core.errors import BadInput, StrataError
from strata_core.api.facts import DeviceInfo, PlatformDefaults
from strata_core.api.hookspecs import hookimpl
from strata_core.registry import load_from_settings, load_plugins
from strata_core.config.settings import load_settings


def device(backend: str) -> DeviceInfo:
    """A small device of `backend`."""
    return DeviceInfo(backend=backend, name=f"{backend} card", vram_total_bytes=8 << 30, vram_free_bytes=7 << 30)


def backend(name: str, score: int = 5, available: bool = True, api_version: str = API_VERSION, probe=None,
            install_hint: str = "") -> Backend:
    """A Backend whose probe reports `score` (or `probe` itself)."""
    def default_probe():
        if not available:
            return ProbeResult.unavailable(f"{name}: no device here")
        return ProbeResult(available=True, reason="ok", devices=(device(name),), score=score)
    return Backend(name=name, vendor="acme", probe=probe or default_probe, api_version=api_version,
                   install_hint=install_hint)


def plugin(name: str, *backends_: Backend, **hooks) -> ModuleType:
    """A plugin module named `name` providing `backends_` and any other hook implementations given."""
    m = ModuleType(name)
    m.strata_backends = hookimpl(lambda: list(backends_))
    for hook, fn in hooks.items():
        setattr(m, hook, hookimpl(fn))
    return m


def names(host) -> set[str]:
    """Names of the backends that loaded."""
    return set(host.backends)


def broken(host, name: str):
    """The broken status listed for `name`."""
    found = [s for s in host.statuses() if s.name == name and s.reason]
    assert found, f"{name} is not listed"
    return found[0]


# ------------------------------------------------------------------ entry points, allow, block, autoload


def test_in_tree_backends_come_from_entry_points():
    host = load_plugins()
    listed = {s.name for s in host.statuses()}
    assert {"cpu", "sim", "cuda", "rocm", "sycl"} <= listed
    assert host.probe("cpu").available and host.probe("sim").available


def test_allow_list_loads_only_those():
    assert names(load_plugins(allow=["cpu"])) == {"cpu"}
    assert {s.name for s in load_plugins(allow=["cpu"]).statuses()} == {"cpu"}


def test_block_list_never_loads_those():
    host = load_plugins(block=["sim", "cuda"])
    listed = {s.name for s in host.statuses()}
    assert "sim" not in listed and "cuda" not in listed and "cpu" in listed


def test_autoload_off_loads_only_extra_objects():
    host = load_plugins(autoload=False, extra=[plugin("acme", backend("acme"))])
    assert names(host) == {"acme"}


def test_plugins_settings_group_drives_loading(tmp_path):
    s = load_settings(env={"STRATA_PLUGINS__ALLOW": "cpu,sim", "STRATA_PLUGINS__BLOCK": "sim"}, cwd=tmp_path).settings
    assert names(load_from_settings(s)) == {"cpu"}
    off = load_settings(env={"STRATA_PLUGINS__AUTOLOAD": "0"}, cwd=tmp_path).settings
    assert names(load_from_settings(off, extra=[plugin("acme", backend("acme"))])) == {"acme"}


class FakeEntryPoint:
    """An entry point whose load() is the given callable."""

    def __init__(self, name, load):
        self.name = name
        self.load = load


def fake_metadata(monkeypatch, by_group: dict):
    """Make plugins see only these entry points, per group."""
    monkeypatch.setattr(plugins, "md", SimpleNamespace(entry_points=lambda group: by_group.get(group, [])))


def test_plugin_raising_on_import_is_listed_unavailable(monkeypatch):
    def explode():
        raise ImportError("libfoo.so.3: cannot open shared object file")
    good = plugin("goodmod", backend("good"))
    fake_metadata(monkeypatch, {"strata.backends": [FakeEntryPoint("foo", explode), FakeEntryPoint("good", lambda: good)]})
    host = load_plugins()
    assert names(host) == {"good"}
    s = broken(host, "foo")
    assert not s.available and "failed to import" in s.reason and "libfoo.so.3" in s.reason
    assert host.selection() == ("good", "")


def test_site_plugin_from_the_plugins_group_is_loaded(monkeypatch):
    seen = []
    site = plugin("site", strata_platform_defaults=lambda device, host: seen.append(device.name) or
                  PlatformDefaults(chunk_ceiling_tokens=1024, source="site"))
    fake_metadata(monkeypatch, {"strata.backends": [FakeEntryPoint("good", lambda: plugin("goodmod", backend("good")))],
                                "strata.plugins": [FakeEntryPoint("site", lambda: site)]})
    host = load_plugins()
    _, dev, _, defaults = host.device_and_defaults()
    assert defaults.chunk_ceiling_tokens == 1024 and seen == [dev.name]


# ------------------------------------------------------------------ api version, bad hooks


def test_api_major_mismatch_is_refused_naming_versions():
    host = load_plugins(autoload=False, extra=[plugin("future", backend("future", api_version="3.0")),
                                               plugin("now", backend("now", api_version="2.7"))])
    assert names(host) == {"now"}
    s = broken(host, "future")
    assert "3.0" in s.reason and API_VERSION in s.reason and "future" in s.reason
    assert s.api_version == "3.0"


def test_unknown_hook_implementation_is_rejected_with_plugin_name():
    bad = plugin("typo_plugin", backend("typo"), strata_probes=lambda backend: None)
    host = load_plugins(autoload=False, extra=[bad, plugin("fine", backend("fine"))])
    assert names(host) == {"fine"}
    s = broken(host, "typo_plugin")
    assert "typo_plugin" in s.reason and "strata_probes" in s.reason


def test_hook_with_wrong_arguments_is_rejected():
    bad = plugin("argmix", backend("argmix"), strata_probe=lambda backnd: None)
    host = load_plugins(autoload=False, extra=[bad])
    assert names(host) == set()
    assert "argmix" in broken(host, "argmix").reason


def test_strata_backends_raising_is_listed():
    m = ModuleType("crashy")
    m.strata_backends = hookimpl(lambda: 1 / 0)
    host = load_plugins(autoload=False, extra=[m, plugin("fine", backend("fine"))])
    assert names(host) == {"fine"}
    assert "ZeroDivisionError" in broken(host, "crashy").reason


def test_returning_something_not_a_backend_is_listed():
    m = ModuleType("odd")
    m.strata_backends = hookimpl(lambda: ["cuda"])
    host = load_plugins(autoload=False, extra=[m])
    assert "not a Backend" in broken(host, "odd").reason


def test_duplicate_backend_name_keeps_the_first_and_says_so():
    host = load_plugins(autoload=False, extra=[plugin("first", backend("twin", score=1)),
                                               plugin("second", backend("twin", score=9))])
    assert host.backend_plugin["twin"] == "first"
    assert any("'twin' is provided twice" in n and "second" in n for n in host.notices)


# ------------------------------------------------------------------ probes


def test_probe_raising_is_unavailable_with_the_error():
    def probe():
        raise RuntimeError("driver too old")
    host = load_plugins(autoload=False, extra=[plugin("flaky", backend("flaky", probe=probe)),
                                               plugin("fine", backend("fine"))])
    st = {s.name: s for s in host.statuses()}
    assert not st["flaky"].available and "RuntimeError: driver too old" in st["flaky"].reason
    assert st["fine"].available


def test_probe_hook_raising_in_its_own_plugin_is_unavailable():
    b = backend("hooked")
    def probe_hook(backend):
        if backend.name == "hooked":
            raise OSError("nvml missing")
        return None
    host = load_plugins(autoload=False, extra=[plugin("hooked", b, strata_probe=probe_hook)])
    r = host.probe("hooked")
    assert not r.available and "nvml missing" in r.reason


def test_foreign_probe_hook_raising_does_not_make_another_backend_unavailable():
    def meddling_probe(backend):
        raise ValueError("not mine, but I raise anyway")
    host = load_plugins(autoload=False, extra=[plugin("fine", backend("fine")),
                                               plugin("meddler", strata_probe=meddling_probe)])
    assert host.probe("fine").available
    assert any("meddler" in n and "fine" in n for n in host.notices)


def test_probe_returning_a_wrong_type_is_unavailable():
    host = load_plugins(autoload=False, extra=[plugin("weird", backend("weird", probe=lambda: {"ok": True}))])
    r = host.probe("weird")
    assert not r.available and "not a ProbeResult" in r.reason


def test_probe_hook_overrides_the_backend_probe():
    override = ProbeResult(available=True, reason="site says so", devices=(device("x"),), score=99)
    host = load_plugins(autoload=False, extra=[
        plugin("x", backend("x", available=False)),
        plugin("site", strata_probe=lambda backend: override if backend.name == "x" else None)])
    assert host.probe("x") == override


def test_probe_runs_once_per_host():
    calls = []
    def probe():
        calls.append(1)
        return ProbeResult(available=True, devices=(device("once"),), score=1)
    host = load_plugins(autoload=False, extra=[plugin("once", backend("once", probe=probe))])
    host.statuses()
    host.resolve()
    host.probe("once")
    assert len(calls) == 1


# ------------------------------------------------------------------ resolution


def test_auto_picks_the_highest_score():
    host = load_plugins(autoload=False, extra=[plugin("a", backend("a", score=3), backend("b", score=7)),
                                               plugin("c", backend("c", score=50, available=False))])
    assert host.resolve()[0].name == "b"


def test_auto_tie_is_an_error_asking_to_choose():
    host = load_plugins(autoload=False, extra=[plugin("a", backend("a", score=7), backend("b", score=7),
                                                      backend("c", score=1))])
    with pytest.raises(BadInput) as e:
        host.resolve("auto")
    msg = str(e.value)
    assert "a, b" in msg and "tie" in msg and "--backend" in msg
    assert host.selection() == (None, msg)


def test_named_backend_is_used_even_with_a_lower_score():
    host = load_plugins(autoload=False, extra=[plugin("a", backend("a", score=1), backend("b", score=7))])
    assert host.resolve("a")[0].name == "a"


def test_named_unavailable_backend_is_an_error_with_the_probe_reason():
    host = load_plugins(autoload=False, extra=[plugin("g", backend("gpu", available=False,
                                                                    install_hint="pip install 'strata-core[gpu]'"))])
    with pytest.raises(BadInput) as e:
        host.resolve("gpu")
    assert "gpu: no device here" in str(e.value) and "pip install 'strata-core[gpu]'" in str(e.value)


def test_named_broken_backend_reports_why():
    host = load_plugins(autoload=False, extra=[])
    host.broken.append(plugins._broken("cuda", "plugin failed to import: no module named cupy"))
    with pytest.raises(BadInput, match="'cuda' is not available: plugin failed to import: no module named cupy"):
        host.resolve("cuda")


def test_unknown_backend_name_lists_the_installed_ones():
    host = load_plugins(autoload=False, extra=[plugin("a", backend("a"))])
    with pytest.raises(BadInput, match=r"unknown backend 'zzz' \(installed: a\)"):
        host.resolve("zzz")


def test_nothing_available_is_an_engine_failure():
    host = load_plugins(autoload=False, extra=[plugin("a", backend("a", available=False))])
    with pytest.raises(StrataError) as e:
        host.resolve()
    assert e.value.exit_code == 1 and "strata backends" in str(e.value)


def test_device_index_out_of_range_is_bad_input():
    host = load_plugins(autoload=False, extra=[plugin("a", backend("a"))])
    with pytest.raises(BadInput, match="backend.device"):
        host.device_and_defaults("a", 3)


def test_platform_defaults_fall_back_to_the_core():
    host = load_plugins(autoload=False, extra=[plugin("a", backend("a"))])
    b, dev, _, defaults = host.device_and_defaults("a")
    assert b.name == "a" and dev.backend == "a" and defaults == PlatformDefaults()


# ------------------------------------------------------------------ strata_configure


def test_configure_hook_sees_the_settings_before_probes(tmp_path):
    seen = []
    b = backend("conf", probe=lambda: ProbeResult(available=bool(seen), reason=f"seen {seen}",
                                                  devices=(device("conf"),) if seen else (), score=1))
    s = load_settings(env={"STRATA_TRACE": "1"}, cwd=tmp_path).settings
    host = load_from_settings(s, extra=[plugin("conf", b, strata_configure=lambda settings: seen.append(settings.trace))])
    assert host.probe("conf").available and seen == [True]


def test_configure_hook_bad_input_propagates_other_errors_become_notices(tmp_path):
    s = load_settings(env={}, cwd=tmp_path).settings
    def strict(settings):
        raise BadInput("sim.profile: 'x' from flag is not allowed")
    with pytest.raises(BadInput, match="sim.profile"):
        load_from_settings(s, extra=[plugin("strict", strata_configure=strict)])
    host = load_from_settings(s, extra=[plugin("sloppy", backend("sloppy"), strata_configure=lambda settings: 1 / 0),
                                        plugin("fine", backend("fine"))])
    assert host.probe("fine").available
    assert any("sloppy" in n and "ZeroDivisionError" in n for n in host.notices)
