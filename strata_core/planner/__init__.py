"""The memory planner: pure functions from facts + model + settings + platform defaults to a proven Plan."""

from __future__ import annotations

from typing import Any

from strata_core.api.facts import DeviceInfo, HostInfo, PlatformDefaults
from strata_core.models.spec import ModelSpec
from strata_core.api.plan_draft import KNOBS, PlanDraft
from strata_core.planner.invariants import check_all
from strata_core.planner.plan import Decision, LoanRow, Plan
from strata_core.planner.steps import make_plan

__all__ = ["make_plan", "plan_for_machine", "platform_defaults_for", "Plan", "PlanDraft", "Decision", "LoanRow",
           "check_all", "KNOBS"]


def platform_defaults_for(plugin_host: Any, device: DeviceInfo, host: HostInfo) -> PlatformDefaults:
    """The backend's PlatformDefaults for this device through the hook, or the core's own when none answers."""
    d = plugin_host.hook.strata_platform_defaults(device=device, host=host) if plugin_host is not None else None
    return d if isinstance(d, PlatformDefaults) else PlatformDefaults(source="core (no backend answered)")


def plan_for_machine(plugin_host: Any, device: DeviceInfo, host: HostInfo, model: ModelSpec, settings: Any) -> Plan:
    """Plan with the backend's platform defaults and every site plugin's `strata_adjust_plan`, in plugin order."""
    defaults = platform_defaults_for(plugin_host, device, host)

    def adjust(draft: PlanDraft) -> None:
        if plugin_host is None:
            return
        hook = plugin_host.hook.strata_adjust_plan
        for impl in reversed(hook.get_hookimpls()):  # pluggy's call order: tryfirst first, then LIFO
            draft.source = plugin_host.pm.get_name(impl.plugin) or "plugin"
            impl.function(**{a: v for a, v in dict(draft=draft, device=device, host=host, settings=settings).items()
                             if a in impl.argnames})

    return make_plan(device, host, model, settings, defaults, adjust=adjust)
