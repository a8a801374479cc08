"""'auto' among backends that compute on the host CPU: the measured-fastest wins, the figure is cached per machine,
a named backend is never measured, a GPU's probe score still stands above host backends."""

from __future__ import annotations

import json
from types import ModuleType

import pytest

from strata_core import calibration
from strata_core.api import API_VERSION
from strata_core.api.backend import Backend, FactsOnlyDevice, ProbeResult
from strata_core.api.facts import DeviceInfo, DeviceType, PlatformDefaults
from strata_core.api.hookspecs import hookimpl
from strata_core.config import load_settings
from strata_core.registry import load_plugins


def _device(name: str, kind: DeviceType) -> FactsOnlyDevice:
    info = DeviceInfo(backend=name, name=f"{name} device", vram_total_bytes=8 << 30, vram_free_bytes=7 << 30,
                      device_type=kind)
    return FactsOnlyDevice(info, defaults=PlatformDefaults())


def _backend(name: str, score: int, kind: DeviceType = DeviceType.CPU) -> Backend:
    r = ProbeResult(available=True, reason="ok", devices=(_device(name, kind),), score=score, version="1.0")
    return Backend(name=name, vendor="acme", probe=lambda: r, api_version=API_VERSION)


def _host(tmp_path, figures: dict[str, float], calls: list, *backends: Backend):
    """A plugin host with these backends (beside the built-in cpu and sim) whose measurement returns `figures`."""
    m = ModuleType("acme")
    m.strata_backends = hookimpl(lambda: list(backends))
    host = load_plugins(autoload=False, extra=[m])
    host.calibration_path = tmp_path / "calibration.json"

    def measure(plugins, backend, device, host_info):
        calls.append(backend.name)
        if figures[backend.name] is None:
            raise RuntimeError("no kernels here")
        return {"us_per_layer": figures[backend.name], "layers": 25}

    host.measure = measure
    return host


def test_auto_picks_the_measured_fastest_host_backend_over_a_higher_score(tmp_path):
    calls: list = []
    host = _host(tmp_path, {"fast": 100.0, "slow": 900.0, "cpu": 400.0}, calls,
                 _backend("fast", 5), _backend("slow", 30))
    assert host.resolve()[0].name == "fast"
    assert sorted(calls) == ["cpu", "fast", "slow"]
    sel = host.auto_selection
    assert sel["selected"] == "fast" and sel["highest_score"] == "slow" and sel["by"] == "measured"
    assert "100 us" in sel["why"] and "slow 900 us" in sel["why"]


def test_the_figures_are_cached_and_reused_by_the_next_run(tmp_path):
    calls: list = []
    _host(tmp_path, {"fast": 100.0, "slow": 900.0, "cpu": 400.0}, calls,
          _backend("fast", 5), _backend("slow", 30)).resolve()
    saved = json.loads((tmp_path / "calibration.json").read_text())
    assert saved["schema"] == calibration.SCHEMA and len(saved["entries"]) == 3
    again: list = []
    # a second process: the cache answers, nothing is measured, even where a new measurement would say otherwise
    host = _host(tmp_path, {"fast": 9000.0, "slow": 1.0, "cpu": 1.0}, again, _backend("fast", 5), _backend("slow", 30))
    host.fresh_selection = True  # every backend probed (not the remembered choice): the figures come from the cache
    assert host.resolve()[0].name == "fast" and again == []
    assert all(f["cached"] for f in host.auto_selection["figures"].values())


def test_a_new_backend_version_is_measured_again(tmp_path):
    calls: list = []
    _host(tmp_path, {"fast": 100.0, "slow": 900.0, "cpu": 400.0}, calls, _backend("fast", 5),
          _backend("slow", 30)).resolve()
    newer = _backend("slow", 30)
    r = newer.probe()
    newer = Backend(name="slow", vendor="acme", api_version=API_VERSION,
                    probe=lambda: ProbeResult(available=True, reason="ok", devices=r.devices, score=30, version="2.0"))
    again: list = []
    host = _host(tmp_path, {"fast": 100.0, "slow": 50.0, "cpu": 400.0}, again, _backend("fast", 5), newer)
    host.fresh_selection = True
    assert host.resolve()[0].name == "slow" and again == ["slow"]


def test_a_named_backend_is_used_and_nothing_is_measured(tmp_path):
    calls: list = []
    host = _host(tmp_path, {"fast": 100.0, "slow": 900.0, "cpu": 400.0}, calls,
                 _backend("fast", 5), _backend("slow", 30))
    assert host.resolve("slow")[0].name == "slow"
    settings = load_settings(env={"STRATA_BACKEND__NAME": "slow"}).settings
    assert host.resolve_target(settings).backend.name == "slow"
    assert calls == [] and host.auto_selection is None
    assert not (tmp_path / "calibration.json").exists()


def test_a_gpu_above_the_host_backends_keeps_its_score_rank_unmeasured(tmp_path):
    calls: list = []
    host = _host(tmp_path, {"fast": 100.0, "cpu": 400.0}, calls, _backend("fast", 5),
                 _backend("gpu", 50, DeviceType.GPU))
    assert host.resolve()[0].name == "gpu" and calls == []


def test_a_backend_that_cannot_run_the_layer_is_not_picked(tmp_path):
    calls: list = []
    host = _host(tmp_path, {"fast": None, "slow": 900.0, "cpu": 400.0}, calls,
                 _backend("fast", 5), _backend("slow", 30))
    assert host.resolve()[0].name == "cpu"
    assert "RuntimeError: no kernels here" in host.auto_selection["figures"]["fast"]["error"]


def test_the_real_calibration_times_the_cpu_backends_decode_layer():
    host = load_plugins(autoload=False)
    b, r = host.backends["cpu"], host.probe("cpu")
    got = calibration.measure_layer_us(host, b, r.devices[0], host.host_info())
    assert got["layers"] >= 3 and 0 < got["us_per_layer"] < 1e6
    assert got["timed_s"] < 1.0  # the timed layers themselves: well under a second


@pytest.mark.parametrize("env,want", [({"XDG_CACHE_HOME": "/x/cache"}, "/x/cache/strata"),
                                      ({"HOME": "/home/u"}, "/home/u/.cache/strata")])
def test_the_cache_folder_comes_from_the_config_package(env, want):
    from strata_core.config import user_cache_dir
    assert str(user_cache_dir(env)) == want


def _probe_counting(name: str, score: int, probes: list, available: bool = True) -> Backend:
    r = ProbeResult(available=True, reason="ok", devices=(_device(name, DeviceType.CPU),), score=score, version="1.0")

    def probe():
        probes.append(name)
        return r if available else ProbeResult.unavailable("gone")
    return Backend(name=name, vendor="acme", probe=probe, api_version=API_VERSION, version="1.0")


def test_the_next_run_probes_only_the_remembered_choice(tmp_path):
    probes: list = []
    _host(tmp_path, {"fast": 100.0, "slow": 900.0, "cpu": 400.0}, [], _probe_counting("fast", 5, probes),
          _probe_counting("slow", 30, probes)).resolve()
    assert sorted(probes) == ["fast", "slow"]
    probes.clear()
    host = _host(tmp_path, {"fast": 100.0, "slow": 900.0, "cpu": 400.0}, [], _probe_counting("fast", 5, probes),
                 _probe_counting("slow", 30, probes))
    assert host.resolve()[0].name == "fast" and probes == ["fast"]  # slow's runtime is not started
    assert host.auto_selection["remembered"] and "remembered" in host.auto_selection["why"]
    probes.clear()
    host.fresh_selection = True  # strata backends: every backend probed again
    host._probes.clear()
    assert host.resolve()[0].name == "fast" and sorted(probes) == ["fast", "slow"]


def test_a_remembered_choice_is_dropped_when_it_is_gone_stale_or_the_installation_changed(tmp_path, monkeypatch):
    probes: list = []
    _host(tmp_path, {"fast": 100.0, "slow": 900.0, "cpu": 400.0}, [], _probe_counting("fast", 5, probes),
          _probe_counting("slow", 30, probes)).resolve()
    # the chosen backend no longer probes available: a full resolution
    host = _host(tmp_path, {"fast": 100.0, "slow": 900.0, "cpu": 400.0}, [],
                 _probe_counting("fast", 5, probes, available=False), _probe_counting("slow", 30, probes))
    assert host.resolve()[0].name == "cpu"
    # another backend installed: the key differs, every backend is probed
    probes.clear()
    host = _host(tmp_path, {"fast": 100.0, "slow": 900.0, "cpu": 400.0, "new": 950.0}, [],
                 _probe_counting("fast", 5, probes), _probe_counting("slow", 30, probes),
                 _probe_counting("new", 1, probes))
    assert host.resolve()[0].name == "fast" and sorted(probes) == ["fast", "new", "slow"]
    # older than a day: probed again
    probes.clear()
    real_time = calibration.time.time
    monkeypatch.setattr(calibration.time, "time", lambda: real_time() + calibration.SELECTION_TTL_S + 1)
    host = _host(tmp_path, {"fast": 100.0, "slow": 900.0, "cpu": 400.0, "new": 950.0}, [],
                 _probe_counting("fast", 5, probes), _probe_counting("slow", 30, probes),
                 _probe_counting("new", 1, probes))
    assert host.resolve()[0].name == "fast" and sorted(probes) == ["fast", "new", "slow"]
