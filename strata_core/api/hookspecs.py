"""The hook contract between the core and its plugins (pluggy project name "strata"), grouped by phase.

Hooks are for discovery and cross-cutting concerns only. Everything about one device is asked of the `Device`
object a backend's probe returns (`info`, `platform_defaults(host)`, `open(plan)`), never broadcast to every plugin.
Every hook takes keyword arguments. `firstresult` hooks stop at the first non-None answer: a site plugin that wants
to override another marks its implementation `tryfirst=True`. A plugin implementing a hook not named here is
refused at load time in one line naming the plugin and the hook; so is one implementing a hook API 2.0 removed
(`strata_probe`, `strata_platform_defaults`, `strata_pinned_allocator`, `strata_device_memory`, `strata_kernels`,
`strata_configure`: an API 1.x plugin).

Phases, in the order a command meets them:
1. discovery: `strata_backends`
2. settings: `strata_settings_group`
3. host facts: `strata_host_info`
4. planning: `strata_adjust_plan`
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:  # annotations only: the contract's own types
    from strata_core.api.backend import Backend
    from strata_core.api.facts import HostInfo
    from strata_core.api.plan_draft import PlanDraft
    from strata_core.api.settings import SettingsGroup
    from strata_core.api.target import Target

hookspec = pluggy.HookspecMarker("strata")
hookimpl = pluggy.HookimplMarker("strata")


# --- 1. discovery --------------------------------------------------------------------------------------------------

@hookspec
def strata_backends() -> "list[Backend] | None":
    """Called once after loading: the `Backend` objects this plugin provides.

    None (or an empty list) means the plugin provides no backend (a site-policy plugin, say). The core refuses a
    Backend whose `api_version` is missing or of another major version than the core's (one line naming both), and
    probes the rest through `Backend.probe()`, which must never raise.

    versionadded 1.0; versionchanged 2.0: the Backend's probe returns Device objects.
    """


# --- 2. settings ---------------------------------------------------------------------------------------------------

@hookspec
def strata_settings_group() -> "SettingsGroup | None":
    """Called once after loading: this plugin's own settings group (a name and a pydantic model), or None.

    None means the plugin has no settings. The group is read from every settings source under its name
    (`[name]` in TOML, `STRATA_NAME__KEY`, `--set name.key=VALUE`); its `apply` receives the validated values
    before any probe. A name that another group already has is refused with a notice.

    versionadded 2.0 (replaces `strata_configure`).
    """


# --- 3. host facts -------------------------------------------------------------------------------------------------

@hookspec(firstresult=True)
def strata_host_info() -> "HostInfo | None":
    """Called when a Target is resolved for this machine: a `HostInfo`, or None to let the core's reading stand.

    None means the plugin has nothing to add; the first non-None answer wins. A plugin may refine what the core
    cannot see (the page-locked limit of a driver, say). Not called for a profile or scenario: its host is given.

    versionadded 1.0
    """


# --- 4. planning ---------------------------------------------------------------------------------------------------

@hookspec
def strata_adjust_plan(draft: "PlanDraft", target: "Target") -> None:
    """Called on every draft plan, in plugin order, before the invariants are checked: may only tighten it.

    `draft` is a `PlanDraft` with `tighten(knob, value, why)`: a lower chunk, fewer cache slots, a larger reserve,
    the CPU share off. Each call records a `Decision` with the plugin as its source. `target` is what is planned
    for (backend, device, host, defaults). Returns None (the return value is ignored). A draft that was loosened is
    refused as a bug in the plugin.

    versionadded 1.0; versionchanged 2.0: receives the Target instead of (device, host, settings).
    """

