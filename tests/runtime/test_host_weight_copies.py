"""The cpu kernels' f32 copies of read-only dense weights (routers, LM head) are a line of the host plan, and the
copies a run makes stay within it."""

from __future__ import annotations

import json

from strata_core.builtin import cpu
from strata_core.cli import main
from strata_core.models.synthetic import tiny_model_spec
from strata_core.planner import buffers
from strata_core.planner.invariants import InvariantBroken, check_host


def _run_capturing(capsys, monkeypatch, args: list[str]) -> tuple[dict, list, list]:
    """`strata run --backend cpu --json` with the plan it ran under and every HostKernels it made."""
    import strata_core.planner as planner
    plans, kernels = [], []
    real_plan, real_init = planner.plan_for_machine, cpu.HostKernels.__init__

    def plan_for_machine(*a, **k):
        plans.append(real_plan(*a, **k))
        return plans[-1]

    def init(self):
        real_init(self)
        kernels.append(self)

    monkeypatch.setattr(planner, "plan_for_machine", plan_for_machine)
    monkeypatch.setattr(cpu.HostKernels, "__init__", init)
    capsys.readouterr()
    assert main(["run", "--backend", "cpu", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out), plans, kernels


def test_the_copies_a_cpu_run_makes_are_the_host_plans_line(capsys, monkeypatch, clean_strata_env):
    out, plans, kernels = _run_capturing(capsys, monkeypatch, ["--prompt-tokens", "64", "--decode-tokens", "8"])
    (plan,), (k,) = plans, kernels
    copies = plan.host_memory.weight_copies_bytes
    # the tiny model's LM head is f16 (copied once, 1 MiB); its routers are f32 already (used as they are): the
    # line, which counts every router too (the spec does not say their dtype), holds what was copied
    assert k.f32_copy_bytes == tiny_model_spec().vocab * tiny_model_spec().hidden * 4
    assert 0 < k.f32_copy_bytes <= copies
    assert out["host_bytes_planned"] >= copies
    assert plan.to_json()["host_memory"]["weight_copies_bytes"] == copies


def test_the_line_is_each_router_and_the_head_in_f32_within_the_limit():
    spec = tiny_model_spec()
    on = cpu.CpuDevice(cpu.host_device_info(cpu.probe_host())).platform_defaults(cpu.probe_host())
    router = spec.experts_per_layer * spec.hidden * 4
    head = spec.vocab * spec.hidden * 4
    assert buffers.weight_copies_bytes(spec, on) == spec.moe_layers * router + head
    small = type(on)(kernel_f32_copy_limit_bytes=router)  # the head's copy is over this limit: not made, not counted
    assert head > router and buffers.weight_copies_bytes(spec, small) == spec.moe_layers * router
    assert buffers.weight_copies_bytes(spec, type(on)()) == 0  # a backend that keeps no copies


def test_check_host_counts_the_copies():
    from dataclasses import replace
    from strata_core.config.settings import settings_from_partial
    from strata_core.planner import plan_for_machine
    from strata_core.registry import load_plugins
    plugins = load_plugins()
    settings = settings_from_partial({"backend": {"name": "cpu"}})
    plan = plan_for_machine(plugins, plugins.resolve_target(settings), tiny_model_spec(), settings)
    h, p = plan.host_memory, plan.pinned
    assert h.weight_copies_bytes > 0
    need = max(h.resident_bytes, p.arena_bytes) + h.borrow_bytes + h.kv_pinned_bytes + h.headroom_bytes
    check_host(replace(plan, host_memory=replace(h, available_bytes=need + h.weight_copies_bytes)))
    try:
        check_host(replace(plan, host_memory=replace(h, available_bytes=need + h.weight_copies_bytes - 1)))
    except InvariantBroken as e:
        assert "kernel weight copies" in str(e)
    else:
        raise AssertionError("a host plan one byte short of its weight copies passed check_host")
