"""The site-policy plugin (plugins/site-policy): it tightens plans, names itself in their decisions, and every
invariant still holds; installed as a distribution, `strata plan` picks it up through its entry point."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from strata_core.api.facts import GIB, MIB, CpuInfo, DeviceInfo, HostInfo
from strata_core.api import Target, hookimpl
from strata_core.models.spec import ModelSpec
from strata_core.planner import check_all, plan_for_machine
from strata_core.registry import load_plugins
from strata_core.config.settings import settings_from_partial
from strata_core.builtin.sim import backend as sim_backend

ROOT = Path(__file__).resolve().parents[2]
DIST = ROOT / "plugins" / "site-policy"
# The plugin module loaded from its file, so the shared venv and sys.path stay untouched.
_spec = importlib.util.spec_from_file_location("strata_site_policy_plugin", DIST / "strata_site_policy" / "plugin.py")
site_policy = sys.modules.setdefault(_spec.name, importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(site_policy)

DEVICE = DeviceInfo(backend="sim", vendor="sim", name="24 GiB test card", vram_total_bytes=24 * GIB,
                    vram_free_bytes=23 * GIB)
HOST = HostInfo(os="linux", ram_total_bytes=64 * GIB, ram_available_bytes=60 * GIB,
                cpu=CpuInfo(name="test cpu", cores=8))
#: A model whose prompt buffers are small, so the unadjusted auto chunk reaches the platform's 8192 ceiling.
MODEL = ModelSpec(name="policy-test", moe_layers=24, experts_per_layer=64, top_k=4, hidden=2048,
                  slot_bytes=8 * MIB, largest_blob_bytes=9 * MIB, prompt_bytes_per_token=16 * 1024)


def _plan(extra_plugins=(), settings=None):
    """Plan MODEL on DEVICE with the sim backend plus `extra_plugins`; return (plan, plugin host)."""
    host = load_plugins(autoload=False, extra=[sim_backend, *extra_plugins])
    assert not host.broken, host.broken
    return plan_for_machine(host, host.target_for(DEVICE, HOST), MODEL, settings or settings_from_partial({})), host


def _plugin_decisions(plan, name):
    return {d.what: d for d in plan.decisions if d.source == f"plugin:{name}"}


def test_policy_tightens_the_plan_and_names_itself():
    """Without the policy the chunk is 8192 and the reserve 700 MiB; with it 4096 and 1024 MiB, said by the plugin."""
    base, _ = _plan()
    assert base.prompt.chunk > site_policy.POLICY.chunk_cap_tokens
    assert base.vram.reserve_bytes < site_policy.POLICY.min_vram_reserve_bytes
    plan, host = _plan([site_policy])
    name = host.pm.get_name(site_policy)
    assert plan.prompt.chunk <= site_policy.POLICY.chunk_cap_tokens
    assert plan.vram.reserve_bytes == site_policy.POLICY.min_vram_reserve_bytes
    mine = _plugin_decisions(plan, name)
    assert mine["prompt.chunk_cap_tokens"].value == 4096
    assert mine["vram.reserve_bytes"].value == 1024 * MIB
    check_all(plan)
    out = plan.to_json()
    assert {"what": "vram.reserve_bytes", "source": f"plugin:{name}"}.items() <= next(
        d for d in out["decisions"] if d["what"] == "vram.reserve_bytes" and d["source"].startswith("plugin:")).items()
    assert max(r["chunk"] for r in out["prompt"]["loans"]) <= 4096


def test_policy_leaves_a_tighter_plan_alone():
    """Settings already tighter than the policy (chunk auto:2048, reserve 2048 MiB) are kept; no decision of its own."""
    settings = settings_from_partial({"prefill": {"chunk": "auto:2048"}, "memory": {"vram_reserve_mib": 2048}})
    plan, host = _plan([site_policy], settings)
    assert plan.prompt.chunk <= 2048
    assert plan.vram.reserve_bytes == 2048 * MIB
    assert _plugin_decisions(plan, host.pm.get_name(site_policy)) == {}
    check_all(plan)


class StricterSite:
    """A second site plugin without tryfirst: it runs after the policy and tightens the chunk further."""

    seen: list = []
    targets: list = []

    @hookimpl
    def strata_adjust_plan(self, draft, target):
        """Record the cap it finds and what is planned for, then cap at 2048."""
        self.seen.append(draft.get("prompt.chunk_cap_tokens"))
        self.targets.append(target)
        draft.tighten("prompt.chunk_cap_tokens", 2048, "stricter site")


def test_policy_runs_first_and_others_can_tighten_further():
    """tryfirst: a plugin loaded after it still sees the policy's cap already applied, and may go lower."""
    other = StricterSite()
    other.seen, other.targets = [], []
    plan, host = _plan([site_policy, other])  # registered last, `other` would run first without tryfirst
    assert other.seen == [4096]
    (target,) = other.targets
    assert isinstance(target, Target) and target.host == HOST
    assert (target.device.info.name, target.device.info.vram_free_bytes) == (DEVICE.name, DEVICE.vram_free_bytes)
    assert plan.prompt.chunk <= 2048
    order = [d.source for d in plan.decisions if d.what == "prompt.chunk_cap_tokens"]
    assert order == [f"plugin:{host.pm.get_name(site_policy)}", f"plugin:{host.pm.get_name(other)}"]
    check_all(plan)


def test_the_policy_speaks_api_2_0s_hook():
    """strata_adjust_plan(draft, target): the API 2.0 signature, nothing of 1.x's (device, host, settings)."""
    _, host = _plan([site_policy])
    (impl,) = [i for i in host.hook.strata_adjust_plan.get_hookimpls() if i.plugin is site_policy]
    assert impl.argnames == ("draft", "target") and impl.tryfirst


def test_policy_values_are_frozen():
    """The policy cannot be changed at run time by another plugin."""
    with pytest.raises(AttributeError):
        site_policy.POLICY.chunk_cap_tokens = 1 << 20


def test_installed_distribution_is_picked_up_by_strata_plan(tmp_path):
    """pip-installed (into a private target, not the shared venv), `strata plan --json` shows its decisions."""
    src = tmp_path / "src"
    shutil.copytree(DIST, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    site = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--target", str(site), str(src)], capture_output=True, text=True, timeout=600)
    assert pip.returncode == 0, pip.stderr[-2000:]
    scenario = tmp_path / "scenario.json"
    scenario.write_text(json.dumps({
        "schema": "strata.scenario/1",
        "profile": {"backend": "sim", "device": DEVICE.to_json(), "host": HOST.to_json()},
        "model": MODEL.to_json(), "settings": {}, "requests": [1000], "expect": {}}))
    env = dict(os.environ, PYTHONPATH=str(site))
    p = subprocess.run([sys.executable, "-m", "strata_core.cli", "plan", "--scenario", str(scenario), "--json"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout)
    assert out["schema"] == "strata.plan/1"
    mine = {d["what"]: d["value"] for d in out["decisions"] if d["source"] == "plugin:site-policy"}
    assert mine == {"prompt.chunk_cap_tokens": 4096, "vram.reserve_bytes": 1024 * MIB}
    assert out["prompt"]["chunk"] <= 4096 and out["vram"]["reserve_bytes"] == 1024 * MIB
