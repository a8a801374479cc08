"""The sim backend's hooks: settings (sim.profile, sim.inject) reach the device memory and the pinned allocator."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from strata_core.api.backend import PinnedBudget
from strata_core.errors import BadInput
from strata_core.reference.kernels import ReferenceKernels
from strata_core.registry import load_from_settings, load_plugins
from strata_core.config.settings import StrataSettings
from strata_core.builtin.sim import PhantomArray, SimDeviceMemory, SimPinnedAllocator
from strata_core.builtin.sim import backend as sim_backend

SCENARIOS = Path(__file__).resolve().parents[2].parent / "shared" / "scenarios"
SEED_3090 = SCENARIOS / "seed1756-rtx3090-windows-pinned.json"


@pytest.fixture(autouse=True)
def _reset_sim():
    """Each test starts from, and leaves, the sim's default configuration."""
    sim_backend.configure(None)
    yield
    sim_backend.configure(None)


def _settings(**sim) -> StrataSettings:
    s = StrataSettings()
    for k, v in sim.items():
        setattr(s.sim, k, v)
    return s


def _sim_device(host):
    return host.probe("sim").devices[0]


def test_hooks_answer_for_sim_devices_only():
    host = load_plugins(autoload=False, extra=[sim_backend])
    dev = _sim_device(host)
    assert dev.backend == "sim"
    assert isinstance(host.hook.strata_device_memory(device=dev), SimDeviceMemory)
    assert isinstance(host.hook.strata_pinned_allocator(device=dev, budget=PinnedBudget(1)), SimPinnedAllocator)
    assert isinstance(host.hook.strata_kernels(device=dev), ReferenceKernels)
    other = type(dev)(backend="cuda", name="x", vram_total_bytes=1, vram_free_bytes=1)
    assert host.hook.strata_device_memory(device=other) is None
    assert host.hook.strata_pinned_allocator(device=other, budget=PinnedBudget(1)) is None
    assert host.hook.strata_kernels(device=other) is None


def test_device_capacity_is_the_devices_free_vram():
    host = load_plugins(autoload=False, extra=[sim_backend])
    dev = _sim_device(host)
    mem = host.hook.strata_device_memory(device=dev)
    assert mem.mem_info() == (dev.vram_free_bytes, dev.vram_free_bytes)


def test_injected_faults_from_settings_reach_the_hooks_and_share_one_record():
    host = load_from_settings(_settings(inject=["pinned-alloc:nth=1", "device-alloc:above=8"]))
    dev = _sim_device(host)
    mem = host.hook.strata_device_memory(device=dev)
    pa = host.hook.strata_pinned_allocator(device=dev, budget=PinnedBudget(1 << 20))
    assert pa.alloc(64) is None and pa.alloc(64) is not None
    assert mem.alloc((3,), np.float32) is None and mem.alloc((2,), np.float32) is not None
    assert [f["site"] for f in mem.faults_injected()] == ["pinned-alloc", "device-alloc"]


def test_reloading_settings_resets_the_fault_counters():
    s = _settings(inject=["pinned-alloc:nth=1"])
    for _ in range(2):
        host = load_from_settings(s)
        pa = host.hook.strata_pinned_allocator(device=_sim_device(host), budget=PinnedBudget(1 << 20))
        assert pa.alloc(64) is None


def test_a_bad_spec_in_settings_is_bad_input_at_load():
    with pytest.raises(BadInput, match="fault spec 'pinned-alloc:nth=0'"):
        load_from_settings(_settings(inject=["pinned-alloc:nth=0"]))


@pytest.mark.skipif(not SEED_3090.is_file(), reason=f"shared scenarios not present at {SCENARIOS}")
def test_a_scenario_profile_gives_the_sim_its_facts_and_reproduces_the_seeds_failed_registration():
    scenario = json.loads(SEED_3090.read_text())
    s = _settings(profile=str(SEED_3090))
    s.backend.name = "sim"
    host = load_from_settings(s)
    dev = _sim_device(host)
    assert dev.backend == "sim" and dev.name == scenario["profile"]["device"]["name"]
    assert dev.vram_free_bytes == scenario["profile"]["device"]["vram_free_bytes"]
    assert dev.driver_model == "wddm"
    h = host.hook.strata_host_info()
    assert h.pinnable_bytes == scenario["profile"]["host"]["pinnable_bytes"] and h.os == "windows"
    # the arena does not lock whole: the budget is marked exhausted, as in the seed's startup log
    sim_backend.configure(s, accounting_only=True)
    budget = PinnedBudget(limit_bytes=scenario["model"]["arena_bytes"] + (1 << 30))
    pa = host.hook.strata_pinned_allocator(device=dev, budget=budget)
    arena = host.hook.strata_device_memory(device=dev)  # accounting mode now: phantoms only
    assert arena.accounting_only
    assert pa.register(PhantomArray.of((scenario["model"]["arena_bytes"],), np.uint8)) is None
    assert budget.exhausted and budget.used_bytes == 0


def test_host_info_is_left_to_the_core_without_a_profile_or_when_sim_is_not_selected():
    load_from_settings(_settings())
    assert sim_backend.strata_host_info() is None
    if SEED_3090.is_file():
        sim_backend.configure(_settings(profile=str(SEED_3090)))  # backend.name stays 'auto'
        assert sim_backend.strata_host_info() is None


def test_an_unreadable_profile_is_bad_input(tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text("{not json")
    with pytest.raises(BadInput, match="not valid JSON"):
        load_from_settings(_settings(profile=str(bad)))
    with pytest.raises(BadInput, match="cannot read"):
        load_from_settings(_settings(profile=str(tmp_path / "missing.json")))
