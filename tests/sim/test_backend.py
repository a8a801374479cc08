"""The sim backend's Device: its settings group (sim.profile, sim.inject) reaches the sessions it opens."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from strata_core.errors import BadInput
from strata_core.reference.kernels import ReferenceKernels
from strata_core.registry import load_from_settings, load_plugins
from strata_core.config.settings import StrataSettings
from strata_core.builtin.sim import PhantomArray, SimDeviceMemory, SimPinnedAllocator
from strata_core.builtin.sim import backend as sim_backend
from strata_core.builtin.sim.settings import SimSettings

SCENARIOS = Path(__file__).resolve().parents[1] / "data" / "scenarios"
SEED_3090 = SCENARIOS / "seed1756-rtx3090-windows-pinned.json"


@pytest.fixture(autouse=True)
def _reset_sim():
    """Each test starts from, and leaves, the sim's default configuration."""
    sim_backend.configure(None)
    yield
    sim_backend.configure(None)


def _settings(**sim) -> StrataSettings:
    from strata_core.config import schema_with_groups
    s = schema_with_groups({"sim": SimSettings})()  # the core schema with the sim backend's own group
    for k, v in sim.items():
        setattr(s.sim, k, v)
    return s


def _sim_device(host):
    return host.probe("sim").devices[0]


def _plan(limit_bytes: int = 1 << 20, floor_bytes: int = 0):
    """The part of a plan a session reads: its page-locked budget."""
    return SimpleNamespace(pinned=SimpleNamespace(limit_bytes=limit_bytes, floor_bytes=floor_bytes))


def test_the_sim_device_opens_a_session_of_sim_memory_pinned_and_reference_kernels():
    dev = _sim_device(load_plugins(autoload=False, extra=[sim_backend]))
    assert dev.info.backend == "sim" and dev.info.device_type.value == "simulated"
    session = dev.open(_plan(limit_bytes=3 << 20, floor_bytes=1 << 20))
    assert isinstance(session.memory, SimDeviceMemory) and isinstance(session.pinned, SimPinnedAllocator)
    assert isinstance(session.kernels, ReferenceKernels) and session.layer_ops is None
    assert (session.budget.limit_bytes, session.budget.floor_bytes) == (3 << 20, 1 << 20)
    assert session.pinned.budget is session.budget
    assert dev.platform_defaults(None).source == "sim backend"


def test_device_capacity_is_the_devices_free_vram():
    dev = _sim_device(load_plugins(autoload=False, extra=[sim_backend]))
    mem = dev.open(_plan()).memory
    assert mem.mem_info() == (dev.info.vram_free_bytes, dev.info.vram_free_bytes)


def test_the_sim_settings_group_is_declared_by_the_backend():
    host = load_plugins(autoload=False)
    (group,) = host.settings_groups()
    assert group.name == "sim" and group.model is SimSettings and group.apply is sim_backend.configure
    host.apply_settings(SimpleNamespace(sim={"inject": ["pinned-alloc:every"]}))
    assert sim_backend.current_config().inject == ("pinned-alloc:every",)
    with pytest.raises(BadInput, match="^sim.inject"):
        host.apply_settings(SimpleNamespace(sim={"inject": "pinned-alloc:every", "profile": None, "x": 1}))


def test_injected_faults_from_settings_reach_the_session_and_share_one_record():
    host = load_from_settings(_settings(inject=["pinned-alloc:nth=1", "device-alloc:above=8"]))
    session = _sim_device(host).open(_plan())
    mem, pa = session.memory, session.pinned
    assert pa.alloc(64) is None and pa.alloc(64) is not None
    assert mem.alloc((3,), np.float32) is None and mem.alloc((2,), np.float32) is not None
    assert [f["site"] for f in mem.faults_injected()] == ["pinned-alloc", "device-alloc"]


def test_reloading_settings_resets_the_fault_counters():
    s = _settings(inject=["pinned-alloc:nth=1"])
    for _ in range(2):
        host = load_from_settings(s)
        pa = _sim_device(host).open(_plan()).pinned
        assert pa.alloc(64) is None


def test_a_bad_spec_in_settings_is_bad_input_at_load():
    with pytest.raises(BadInput, match="fault spec 'pinned-alloc:nth=0'"):
        load_from_settings(_settings(inject=["pinned-alloc:nth=0"]))


def test_a_scenario_profile_gives_the_sim_its_facts_and_reproduces_the_seeds_failed_registration():
    scenario = json.loads(SEED_3090.read_text())
    s = _settings(profile=str(SEED_3090))
    s.backend.name = "sim"
    host = load_from_settings(s)
    dev = _sim_device(host)
    assert dev.info.backend == "sim" and dev.info.name == scenario["profile"]["device"]["name"]
    assert dev.info.vram_free_bytes == scenario["profile"]["device"]["vram_free_bytes"]
    assert dev.info.driver_model == "wddm"
    h = host.resolve_target(s).host  # the simulated machine's host, not this one
    assert h.pinnable_bytes == scenario["profile"]["host"]["pinnable_bytes"] and h.os == "windows"
    # the arena does not lock whole: the budget is marked exhausted, as in the seed's startup log
    sim_backend.configure(s, accounting_only=True)
    session = dev.open(_plan(limit_bytes=scenario["model"]["arena_bytes"] + (1 << 30)))
    assert session.memory.accounting_only  # accounting mode now: phantoms only
    assert session.pinned.register(PhantomArray.of((scenario["model"]["arena_bytes"],), np.uint8)) is None
    assert session.budget.exhausted and session.budget.used_bytes == 0


def test_host_facts_are_this_machines_without_a_profile_or_when_sim_is_not_selected():
    from strata_core.hostinfo import probe_host
    s = _settings()
    s.backend.name = "sim"
    assert _sim_device(load_from_settings(s)).simulated_host is None
    assert load_from_settings(s).resolve_target(s).host.ram_total_bytes == probe_host().ram_total_bytes
    auto = _settings(profile=str(SEED_3090))  # backend.name stays 'auto': the target is not sim
    t = load_from_settings(auto).resolve_target(auto)
    assert t.backend.name != "sim" and t.host.os != "windows"


def test_an_unreadable_profile_is_bad_input(tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text("{not json")
    with pytest.raises(BadInput, match="not valid JSON"):
        load_from_settings(_settings(profile=str(bad)))
    with pytest.raises(BadInput, match="cannot read"):
        load_from_settings(_settings(profile=str(tmp_path / "missing.json")))
