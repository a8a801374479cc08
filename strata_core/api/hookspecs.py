"""The hook contract between the core and its plugins (pluggy project name "strata").

Every hook takes keyword arguments. A backend answers only for devices whose `device.backend` is its own name and
returns None otherwise, so several backends coexist in one plugin manager. `firstresult` hooks stop at the first
non-None answer: a site plugin that wants to override a backend marks its implementation `tryfirst=True`.
A plugin that implements a hook not named here is rejected at load time, with the plugin's name in the message.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("strata")
hookimpl = pluggy.HookimplMarker("strata")


@hookspec
def strata_backends():
    """Called once after loading: return a list of `Backend` objects this plugin provides (or None).

    The core collects the backends of every plugin, refuses one whose `api_version` has another major version than
    the core's, and probes the rest through `strata_probe`.
    """


@hookspec
def strata_configure(settings):
    """Called by `plugins.load_from_settings` after loading, before any probe: a plugin may read its own settings group.

    `settings` is the loaded `StrataSettings`. Returns nothing. A plugin keeps what it read until the next call;
    a bad value in its group raises BadInput (the command exits 2).
    """


@hookspec(firstresult=True)
def strata_probe(backend):
    """Called by `strata backends`, backend selection and `strata doctor`: return a `ProbeResult` for `backend`.

    Return None for a backend that is not yours. Never raise: an unavailable backend returns
    `ProbeResult.unavailable(reason)`. The core calls `backend.probe()` itself when no plugin answers, and lists
    a probe that raises anyway as unavailable with the error.
    """


@hookspec(firstresult=True)
def strata_host_info():
    """Called before planning on this machine: return a `HostInfo`, or None to let the core's psutil reading stand.

    A plugin may refine what the core cannot see (the page-locked limit of a driver, say).
    """


@hookspec(firstresult=True)
def strata_platform_defaults(device, host):
    """Called before planning: return the `PlatformDefaults` for `device` on `host`, or None if it is not yours.

    The core falls back to its own `PlatformDefaults()` when no plugin answers. Every value is a default: settings
    (and plans adjusted by site plugins) override it, and the plan records which source each value came from.
    """


@hookspec
def strata_adjust_plan(draft, device, host, settings):
    """Called on every draft plan, in plugin order, before the invariants are checked: may only tighten it.

    `draft` is a `PlanDraft` with `tighten(field, value, why)`: a lower chunk, fewer cache slots, a larger reserve,
    the CPU share off. Each call records a `Decision` with the plugin as its source. Returns nothing.
    A draft that was loosened is refused as a bug in the plugin.
    """


@hookspec(firstresult=True)
def strata_pinned_allocator(device, budget):
    """Called when the runtime starts on `device`: return a `PinnedAllocator` charging `budget` (a `PinnedBudget`).

    Return None if `device` is not yours. Allocation and registration must return None on lack of memory, never
    raise for it. With no answer the runtime uses pageable memory only and says so in one line.
    """


@hookspec(firstresult=True)
def strata_device_memory(device):
    """Called when the runtime starts on `device`: return its `DeviceMemory`, or None if it is not yours."""


@hookspec(firstresult=True)
def strata_kernels(device):
    """Called when the runtime starts on `device`: return its `KernelSet`, or None if it is not yours.

    Every kernel must match `strata_core.reference.kernels` within the conformance suite's bounds.
    """
