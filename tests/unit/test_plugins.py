"""Plugin manager: entry points, allow/block/autoload, api versions, broken plugins and backend resolution."""

from __future__ import annotations

from types import ModuleType, SimpleNamespace

import pytest

from strata_core import registry as plugins
from strata_core.api import API_VERSION
from strata_core.api.backend import Backend, FactsOnlyDevice, ProbeResult
from strata_core.errors import BadInput, StrataError
from strata_core.api.facts import DeviceInfo, PlatformDefaults
from strata_core.api.hookspecs import hookimpl
from strata_core.registry import load_from_settings, load_plugins
from strata_core.config.settings import load_settings


def device(backend: str, index: int = 0, defaults: PlatformDefaults | None = None) -> FactsOnlyDevice:
    """A small device of `backend` (a Device object that plans; these tests never open one)."""
    info = DeviceInfo(backend=backend, name=f"{backend} card {index}", vram_total_bytes=8 << 30,
                      vram_free_bytes=7 << 30, index=index)
    return FactsOnlyDevice(info, defaults=defaults or PlatformDefaults())


def backend(name: str, score: int = 50, available: bool = True, api_version: str = API_VERSION, probe=None,
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


def test_in_tree_backends_come_from_entry_points_and_builtins_by_import():
    host = load_plugins()
    listed = {s.name for s in host.statuses()}
    assert {"cpu", "sim", "cuda", "rocm", "sycl"} <= listed
    assert host.probe("cpu").available and host.probe("sim").available
    assert host.backend_plugin["cpu"] == "cpu" and host.backend_plugin["sim"] == "sim"


def test_builtins_are_not_entry_points():
    import tomllib
    from pathlib import Path
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    eps = project["entry-points"]["strata.backends"]
    assert eps and not {"cpu", "sim"} & set(eps) and not any(v.startswith("strata_core") for v in eps.values())


def test_allow_list_concerns_entry_points_only():
    assert names(load_plugins(allow=["cuda"])) == {"cpu", "sim", "cuda"}
    assert {s.name for s in load_plugins(allow=["nothing"]).statuses()} == {"cpu", "sim"}


def test_block_list_never_loads_those_but_keeps_the_builtins():
    host = load_plugins(block=["sim", "cpu", "cuda"])
    listed = {s.name for s in host.statuses()}
    assert "cuda" not in listed and {"cpu", "sim"} <= listed


def test_autoload_off_keeps_cpu_and_sim_and_loads_extra_objects():
    host = load_plugins(autoload=False, extra=[plugin("acme", backend("acme"))])
    assert names(host) == {"cpu", "sim", "acme"}


def test_autoload_off_resolves_to_cpu(tmp_path):
    off = load_settings(env={"STRATA_PLUGINS__AUTOLOAD": "0"}, cwd=tmp_path).settings
    target = load_from_settings(off).resolve_target(off)
    assert target.backend.name == "cpu" and target.device.info.backend == "cpu"


def test_a_builtin_module_given_again_as_extra_is_loaded_once():
    from strata_core.builtin.sim import backend as sim_backend
    host = load_plugins(autoload=False, extra=[sim_backend])
    assert names(host) == {"cpu", "sim"} and not host.broken


def test_plugins_settings_group_drives_loading(tmp_path):
    s = load_settings(env={"STRATA_PLUGINS__ALLOW": "cuda,sycl", "STRATA_PLUGINS__BLOCK": "sycl"},
                      cwd=tmp_path).settings
    assert names(load_from_settings(s)) == {"cpu", "sim", "cuda"}
    off = load_settings(env={"STRATA_PLUGINS__AUTOLOAD": "0"}, cwd=tmp_path).settings
    assert names(load_from_settings(off, extra=[plugin("acme", backend("acme"))])) == {"cpu", "sim", "acme"}


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
    assert names(host) == {"cpu", "sim", "good"}
    s = broken(host, "foo")
    assert not s.available and "failed to import" in s.reason and "libfoo.so.3" in s.reason
    assert host.selection() == ("good", "")


def test_site_plugin_from_the_plugins_group_is_loaded(monkeypatch):
    seen = []
    site = plugin("site", strata_adjust_plan=lambda draft, target: seen.append(target.backend.name))
    fake_metadata(monkeypatch, {"strata.backends": [FakeEntryPoint("good", lambda: plugin("goodmod", backend("good")))],
                                "strata.plugins": [FakeEntryPoint("site", lambda: site)]})
    host = load_plugins()
    assert host.pm.has_plugin("site") and not host.broken
    assert [i.plugin for i in host.hook.strata_adjust_plan.get_hookimpls()] == [site]


# ------------------------------------------------------------------ api version, bad hooks


def test_api_major_mismatch_is_refused_naming_versions():
    host = load_plugins(autoload=False, extra=[plugin("future", backend("future", api_version="3.0")),
                                               plugin("old", backend("old", api_version="1.0")),
                                               plugin("now", backend("now", api_version="2.7"))])
    assert names(host) == {"cpu", "sim", "now"}
    for name, spoken in (("future", "3.0"), ("old", "1.0")):
        s = broken(host, name)
        assert f"speaks api {spoken}; this core speaks {API_VERSION}" in s.reason and name in s.reason
        assert "\n" not in s.reason and s.api_version == spoken


def test_a_backend_declaring_no_api_version_is_refused():
    host = load_plugins(autoload=False, extra=[plugin("vague", backend("vague", api_version=""))])
    s = broken(host, "vague")
    assert "vague" not in names(host)
    assert s.reason == f"backend 'vague' (plugin 'vague') declares no api_version; this core speaks {API_VERSION}"


def test_unknown_hook_implementation_is_rejected_with_plugin_name():
    bad = plugin("typo_plugin", backend("typo"), strata_probes=lambda backend: None)
    host = load_plugins(autoload=False, extra=[bad, plugin("fine", backend("fine"))])
    assert names(host) == {"cpu", "sim", "fine"}
    s = broken(host, "typo_plugin")
    assert "typo_plugin" in s.reason and "strata_probes" in s.reason


def test_hook_with_wrong_arguments_is_rejected():
    bad = plugin("argmix", backend("argmix"), strata_adjust_plan=lambda draft, targett: None)
    host = load_plugins(autoload=False, extra=[bad])
    assert names(host) == {"cpu", "sim"}
    assert "argmix" in broken(host, "argmix").reason


def test_strata_backends_raising_is_listed():
    m = ModuleType("crashy")
    m.strata_backends = hookimpl(lambda: 1 / 0)
    host = load_plugins(autoload=False, extra=[m, plugin("fine", backend("fine"))])
    assert names(host) == {"cpu", "sim", "fine"}
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


def test_probe_returning_a_wrong_type_is_unavailable():
    host = load_plugins(autoload=False, extra=[plugin("weird", backend("weird", probe=lambda: {"ok": True}))])
    r = host.probe("weird")
    assert not r.available and "not a ProbeResult" in r.reason


def test_probe_listing_something_not_a_device_is_unavailable():
    odd = ProbeResult(available=True, devices=("card0",), score=1)
    r = load_plugins(autoload=False, extra=[plugin("odd", backend("odd", probe=lambda: odd))]).probe("odd")
    assert not r.available and "str among its devices, not a Device" in r.reason


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
    host = load_plugins(autoload=False, extra=[plugin("a", backend("a", score=3), backend("b", score=17)),
                                               plugin("c", backend("c", score=50, available=False))])
    assert host.resolve()[0].name == "b"


def test_auto_tie_is_an_error_asking_to_choose():
    host = load_plugins(autoload=False, extra=[plugin("a", backend("a", score=17), backend("b", score=17),
                                                      backend("c", score=1))])
    with pytest.raises(BadInput) as e:
        host.resolve("auto")
    msg = str(e.value)
    assert "a, b" in msg and "tie" in msg and "--backend" in msg
    assert host.selection() == (None, msg)
    with pytest.raises(BadInput, match="tie"):
        host.resolve_target(load_settings(env={}).settings)


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
    with pytest.raises(BadInput, match=r"unknown backend 'zzz' \(installed: a, cpu, sim\)"):
        host.resolve("zzz")


def test_nothing_available_is_an_engine_failure():
    host = load_plugins(autoload=False, extra=[plugin("a", backend("a", available=False))])
    host._probes.update({n: ProbeResult.unavailable("hidden for this test") for n in ("cpu", "sim")})
    with pytest.raises(StrataError) as e:
        host.resolve()
    assert e.value.exit_code == 1 and "strata backends" in str(e.value)


# ------------------------------------------------------------------ Target resolution


def settings_for(name: str = "auto", index: int = 0, tmp_path=None):
    """Settings naming backend `name` and device `index` (flags, no environment)."""
    return load_settings(flags={"backend.name": name, "backend.device": index}, env={}, cwd=tmp_path).settings


def two_device_backend(name: str = "a") -> Backend:
    """A backend with devices 0 and 1."""
    return backend(name, probe=lambda: ProbeResult(available=True, devices=(device(name, 0), device(name, 1)),
                                                   score=5))


def test_target_is_backend_device_host_and_that_devices_defaults(tmp_path):
    mine = PlatformDefaults(chunk_ceiling_tokens=1024, source="a backend")
    b = backend("a", probe=lambda: ProbeResult(available=True, devices=(device("a", defaults=mine),), score=5))
    t = load_plugins(autoload=False, extra=[plugin("a", b)]).resolve_target(settings_for("a", tmp_path=tmp_path))
    assert t.backend is b and t.device.info.name == "a card 0" and t.defaults is mine
    assert t.host.ram_total_bytes > 0 and t.origin == "this machine"


def test_device_index_picks_that_device(tmp_path):
    host = load_plugins(autoload=False, extra=[plugin("a", two_device_backend())])
    assert host.resolve_target(settings_for("a", 1, tmp_path)).device.info.index == 1


@pytest.mark.parametrize("index", [2, 7])
def test_device_index_out_of_range_is_refused_with_the_range_never_clamped(index, tmp_path):
    host = load_plugins(autoload=False, extra=[plugin("a", two_device_backend())])
    with pytest.raises(BadInput) as e:
        host.resolve_target(settings_for("a", index, tmp_path))
    assert str(e.value) == f"backend.device: backend 'a' has 2 device(s), no device {index}; allowed: 0..1"


def test_unknown_and_unavailable_backends_are_refused_by_resolve_target(tmp_path):
    host = load_plugins(autoload=False, extra=[plugin("g", backend("gpu", available=False))])
    with pytest.raises(BadInput, match="unknown backend 'zzz'"):
        host.resolve_target(settings_for("zzz", tmp_path=tmp_path))
    with pytest.raises(BadInput, match="'gpu' is not available: gpu: no device here"):
        host.resolve_target(settings_for("gpu", tmp_path=tmp_path))


def test_a_backend_with_no_device_is_an_engine_failure(tmp_path):
    empty = backend("empty", probe=lambda: ProbeResult(available=True, devices=(), score=5))
    host = load_plugins(autoload=False, extra=[plugin("empty", empty)])
    with pytest.raises(StrataError, match="reports no device") as e:
        host.resolve_target(settings_for("empty", tmp_path=tmp_path))
    assert not isinstance(e.value, BadInput)


def test_platform_defaults_raising_is_one_line_naming_the_backend(tmp_path):
    class Grumpy(FactsOnlyDevice):
        def platform_defaults(self, host):
            raise KeyError("arch")
    b = backend("g", probe=lambda: ProbeResult(available=True, devices=(Grumpy(device("g").info),), score=5))
    with pytest.raises(StrataError) as e:
        load_plugins(autoload=False, extra=[plugin("g", b)]).resolve_target(settings_for("g", tmp_path=tmp_path))
    assert "backend 'g' failed while reading the platform of 'g card 0': KeyError" in str(e.value)


def test_host_info_hook_refines_this_machine_only(tmp_path):
    from strata_core.api.facts import HostInfo, Profile
    mine = HostInfo(os="linux", ram_total_bytes=1 << 40, ram_available_bytes=1 << 39)
    host = load_plugins(autoload=False, extra=[plugin("h", strata_host_info=lambda: mine)])
    assert host.resolve_target(settings_for("cpu", tmp_path=tmp_path)).host is mine
    given = HostInfo(os="windows", ram_total_bytes=1 << 34, ram_available_bytes=1 << 33)
    t = host.resolve_target(settings_for(tmp_path=tmp_path), profile=Profile("zzz", device("zzz").info, given))
    assert t.host is given


def test_host_override_wins(tmp_path):
    from strata_core.api.facts import HostInfo
    given = HostInfo(os="linux", ram_total_bytes=1 << 34, ram_available_bytes=1 << 33)
    assert load_plugins(autoload=False).resolve_target(settings_for("cpu", tmp_path=tmp_path),
                                                       host_override=given).host is given


def test_a_profile_of_an_unknown_backend_plans_with_facts_only_and_core_defaults(tmp_path):
    from strata_core.api.facts import HostInfo, Profile
    from strata_core.registry import CORE_DEFAULTS_SOURCE
    info = device("npu").info
    h = HostInfo(os="linux", ram_total_bytes=1 << 34, ram_available_bytes=1 << 33)
    t = load_plugins(autoload=False).resolve_target(settings_for(tmp_path=tmp_path), profile=Profile("npu", info, h))
    assert isinstance(t.device, FactsOnlyDevice) and t.device.info == info and t.backend.name == "npu"
    assert t.defaults == PlatformDefaults(source=CORE_DEFAULTS_SOURCE)
    with pytest.raises(BadInput, match="described by a profile, not present here"):
        t.device.open(None)


def test_a_profile_of_an_installed_backend_is_described_by_it(tmp_path):
    from strata_core.api.facts import HostInfo, Profile
    seen = []
    mine = PlatformDefaults(chunk_ceiling_tokens=2048, source="d backend")
    b = Backend(name="d", vendor="acme", probe=lambda: ProbeResult.unavailable("not here"), api_version=API_VERSION,
                describe=lambda info: seen.append(info) or FactsOnlyDevice(info, defaults=mine))
    h = HostInfo(os="linux", ram_total_bytes=1 << 34, ram_available_bytes=1 << 33)
    t = load_plugins(autoload=False, extra=[plugin("d", b)]).resolve_target(
        settings_for(tmp_path=tmp_path), profile=Profile("d", device("d").info, h))
    assert seen == [device("d").info] and t.defaults is mine and t.backend is b


def test_sim_with_a_profile_plans_for_the_simulated_host(tmp_path):
    import json
    from strata_core.builtin.sim import backend as sim_backend
    prof = {"schema": "strata.profile/1", "backend": "cuda",
            "device": {"name": "card", "vram_total_bytes": 8 << 30, "vram_free_bytes": 7 << 30},
            "host": {"os": "windows", "ram_total_bytes": 32 << 30, "ram_available_bytes": 20 << 30}}
    (tmp_path / "p.json").write_text(json.dumps(prof))
    s = load_settings(flags={"backend.name": "sim", "sim.profile": str(tmp_path / "p.json")}, env={},
                      cwd=tmp_path).settings
    try:
        t = load_from_settings(s).resolve_target(s)
        assert t.backend.name == "sim" and t.host.os == "windows" and t.device.info.vram_free_bytes == 7 << 30
        auto = load_settings(flags={"sim.profile": str(tmp_path / "p.json")}, env={}, cwd=tmp_path).settings
        assert load_from_settings(auto).resolve_target(auto).host.os != "windows"  # cpu here: this machine's host
    finally:
        sim_backend.configure(None)


# ------------------------------------------------------------------ settings groups


def group_plugin(name: str, group_name: str, apply=None, model=None):
    """A plugin declaring a settings group `group_name` with one field, `level` (int, default 1)."""
    from pydantic import BaseModel

    class Levels(BaseModel):
        level: int = 1
    g = plugins.SettingsGroup(name=group_name, model=model or Levels, apply=apply)
    return plugin(name, strata_settings_group=lambda: g)


def test_settings_groups_list_the_plugins_groups_with_sim_built_in():
    host = load_plugins(autoload=False, extra=[group_plugin("acme", "acme")])
    assert [g.name for g in host.settings_groups()] == ["acme", "sim"]
    assert host.group_plugin["acme"] == "acme"


def test_apply_settings_validates_each_groups_values_and_calls_apply():
    seen = []
    host = load_plugins(autoload=False, extra=[group_plugin("acme", "acme", apply=seen.append)])
    host.apply_settings(SimpleNamespace(acme={"level": 3}, sim=None))
    host.apply_settings(SimpleNamespace())
    assert [v.level for v in seen] == [3, 1]
    with pytest.raises(BadInput, match=r"^acme.level: "):
        host.apply_settings(SimpleNamespace(acme={"level": "high"}))


def test_apply_bad_input_is_the_users_other_errors_are_notices():
    def strict(values):
        raise BadInput("acme.level: 3 is not allowed")
    with pytest.raises(BadInput, match="acme.level"):
        load_plugins(autoload=False, extra=[group_plugin("acme", "acme", apply=strict)]).apply_settings(None)
    host = load_plugins(autoload=False, extra=[group_plugin("sloppy", "sloppy", apply=lambda v: 1 / 0)])
    host.apply_settings(None)
    assert any("sloppy" in n and "ZeroDivisionError" in n for n in host.notices)


def test_duplicate_or_malformed_settings_groups_are_left_out_with_a_notice():
    host = load_plugins(autoload=False, extra=[group_plugin("again", "sim"),
                                               plugin("odd", strata_settings_group=lambda: {"name": "odd"})])
    assert [g.name for g in host.settings_groups()] == ["sim"] and host.group_plugin["sim"] == "sim"
    assert any("'sim' is declared twice" in n and "again" in n for n in host.notices)
    assert any("odd" in n and "not a SettingsGroup" in n for n in host.notices)


def test_load_from_settings_applies_the_sim_group_before_probes(tmp_path):
    from strata_core.builtin.sim import backend as sim_backend
    s = load_settings(flags={"sim.inject": ["pinned-alloc:every"]}, env={}, cwd=tmp_path).settings
    try:
        load_from_settings(s)
        assert sim_backend.current_config().inject == ("pinned-alloc:every",)
    finally:
        sim_backend.configure(None)


def test_a_bad_sim_profile_is_bad_input(tmp_path):
    s = load_settings(flags={"sim.profile": str(tmp_path / "missing.json")}, env={}, cwd=tmp_path).settings
    with pytest.raises(BadInput, match="missing.json"):
        load_from_settings(s)
