"""Hypothesis over the space between the population test's cards (issue 12.6): any card of 8-32 GiB on cuda, rocm
or sycl, any OS and driver model, 16-128 GB of RAM, any preset and quant, any reserve. Each plan holds every
invariant (re-derived by test_plan_properties) or refuses naming the resource and the shortfall; some replay."""

from __future__ import annotations

import re

from hypothesis import HealthCheck, given, settings as hyp_settings
from hypothesis import strategies as st
from test_plan_properties import _independent_checks

from strata_core.api.facts import GIB, MIB, DeviceInfo, HostInfo, Profile
from strata_core.commands.simulate import simulate
from strata_core.config import StrataSettings
from strata_core.errors import PlanRefused
from strata_core.models.presets import PRESET_QUANTS, PRESETS, model_from_name
from strata_core.planner import check_all, plan_for_machine
from strata_core.registry import load_plugins
from strata_core.scenario import Scenario

PLUGINS = load_plugins()  # one host for every example: loading entry points is the slow part


@st.composite
def machines(draw) -> Profile:
    """A consumer card and its host, between the population table's rows."""
    backend, arch = draw(st.sampled_from([("cuda", "sm_89"), ("cuda", "sm_86"), ("rocm", "gfx1100"),
                                          ("rocm", "gfx1201"), ("sycl", "dg2")]))
    total = draw(st.integers(8, 32)) * GIB
    free = total - draw(st.integers(200, 1500)) * MIB
    where = draw(st.sampled_from([("linux", "linux", "none"), ("windows", "wddm", "none"),
                                  ("linux", "wsl2", "wsl2"), ("linux", "linux", "docker-wsl2")]))
    ram = draw(st.integers(16, 128)) * 10 ** 9
    device = DeviceInfo(backend=backend, name=f"prop {backend} card", arch=arch, vram_total_bytes=total,
                        vram_free_bytes=free, driver_model=where[1], drives_display=draw(st.booleans()))
    host = HostInfo(os=where[0], ram_total_bytes=ram, ram_available_bytes=int(ram * draw(st.floats(0.5, 0.95))),
                    virtualization=where[2])
    return Profile(backend=backend, device=device, host=host)


@st.composite
def user_settings(draw) -> StrataSettings:
    """A reserve, a context length and sometimes resident experts, as people set them."""
    s = StrataSettings()
    s.memory.vram_reserve_mib = draw(st.one_of(st.none(), st.integers(0, 4096)))
    s.kv.max_context = draw(st.sampled_from([4096, 8192, 32768, 131072]))
    s.memory.resident_experts = draw(st.booleans())
    return s


MODELS = st.sampled_from([f"{p.name}@{q}" for p in PRESETS for q in PRESET_QUANTS])


def _plan(profile, model, s):
    target = PLUGINS.resolve_target(s, profile=profile)
    return plan_for_machine(PLUGINS, target, model_from_name(model), s)


@hyp_settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(profile=machines(), model=MODELS, s=user_settings())
def test_any_card_between_the_table_rows_plans_or_refuses_naming_the_resource(profile, model, s):
    try:
        plan = _plan(profile, model, s)
    except PlanRefused as e:
        assert re.match(r"(VRAM|host RAM|expert cache|page-locked memory): .*short by [\d,.]+ MiB", str(e)), str(e)
        return
    check_all(plan)
    _independent_checks(plan)


@hyp_settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(profile=machines(), model=st.sampled_from(["Qwen3-30B-A3B@Q4_K", "Mixtral-8x7B@Q4_K", "DeepSeek-V2-Lite@Q8_0",
                                                  "gpt-oss-120b@MXFP4", "Mixtral-8x7B@F16"]),
       s=user_settings(), prompt=st.integers(1, 40000))
def test_any_card_between_the_table_rows_replays_with_no_exit(profile, model, s, prompt):
    try:
        plan = _plan(profile, model, s)
    except PlanRefused:
        return
    requests = (min(prompt, plan.limits.max_context_tokens), min(plan.prompt.chunk or 1, plan.limits.max_context_tokens))
    r = simulate(Scenario(profile=profile, model=model_from_name(model), settings=s, requests=requests,
                          path="property"), s, PLUGINS, [], [], decode_tokens=1)
    assert r["engine_exits"] == 0, r["engine_exit_reasons"]
    assert r["completed"] == len(requests), [q["refused_reason"] for q in r["requests"]]
