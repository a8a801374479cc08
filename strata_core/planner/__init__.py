"""The memory planner: pure functions from facts + model + settings + platform defaults to a proven Plan."""

from __future__ import annotations

from typing import Any

from strata_core.api.target import Target
from strata_core.models.spec import ModelSpec
from strata_core.api.plan_draft import KNOBS, PlanDraft
from strata_core.planner.invariants import check_all
from strata_core.planner.plan import Decision, LoanRow, Plan
from strata_core.planner.steps import make_plan

__all__ = ["make_plan", "plan_for_machine", "Plan", "PlanDraft", "Decision", "LoanRow",
           "check_all", "KNOBS"]


def plan_for_machine(plugin_host: Any, target: Target, model: ModelSpec, settings: Any) -> Plan:
    """Plan for a resolved Target (its platform defaults) with every site plugin's `strata_adjust_plan`, in order."""
    device, host = target.device.info, target.host

    def adjust(draft: PlanDraft) -> None:
        if plugin_host is None:
            return
        hook = plugin_host.hook.strata_adjust_plan
        for impl in reversed(hook.get_hookimpls()):  # pluggy's call order: tryfirst first, then LIFO
            draft.source = plugin_host.pm.get_name(impl.plugin) or "plugin"
            given = dict(draft=draft, target=target)  # an implementation may take fewer arguments (pluggy's rule)
            impl.function(**{a: v for a, v in given.items() if a in impl.argnames})

    return make_plan(device, host, model, settings, target.defaults, adjust=adjust)
