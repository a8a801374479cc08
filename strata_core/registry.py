"""The plugin manager: entry points, allow and block lists, api versions, probing and backend resolution."""

from __future__ import annotations

import importlib.metadata as md
from dataclasses import dataclass, field
from typing import Any, Iterable

import pluggy

from strata_core.api import API_VERSION
from strata_core.api import hookspecs
from strata_core.api.backend import Backend, ProbeResult
from strata_core.errors import BadInput, StrataError
from strata_core.api.facts import VENDOR_OF_BACKEND, PlatformDefaults
from strata_core.hostinfo import probe_host

ENTRY_POINT_GROUPS = ("strata.backends", "strata.plugins")


@dataclass(frozen=True)
class BackendStatus:
    """A discovered backend and what its probe said (or why it was never probed)."""

    name: str
    vendor: str
    version: str
    api_version: str
    available: bool
    reason: str
    install_hint: str
    score: int
    devices: tuple = ()
    plugin: str = ""

    def to_json(self) -> dict:
        """One entry of `strata.backends/1`."""
        return {"name": self.name, "vendor": self.vendor, "version": self.version, "api_version": self.api_version,
                "available": self.available, "reason": self.reason, "install_hint": self.install_hint,
                "score": self.score, "devices": [d.to_json() for d in self.devices], "plugin": self.plugin}


@dataclass
class PluginHost:
    """The loaded plugins and their backends. Build one with `load_plugins`."""

    pm: pluggy.PluginManager
    backends: dict[str, Backend] = field(default_factory=dict)
    backend_plugin: dict[str, str] = field(default_factory=dict)
    broken: list[BackendStatus] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)
    _probes: dict[str, ProbeResult] = field(default_factory=dict)

    @property
    def hook(self):
        """The pluggy hook relay."""
        return self.pm.hook

    def probe(self, name: str) -> ProbeResult:
        """Probe one backend once (cached); a probe that raises becomes 'unavailable' with the error and the plugin."""
        if name not in self._probes:
            self._probes[name] = self._probe_uncached(self.backends[name])
        return self._probes[name]

    def _probe_uncached(self, b: Backend) -> ProbeResult:
        owner = self.backend_plugin.get(b.name, "?")
        r = None
        # Each strata_probe implementation is called on its own so that one plugin raising for a backend it does
        # not own cannot make that backend unavailable; call order is pluggy's (reverse registration, tryfirst first).
        for impl in reversed(self.pm.hook.strata_probe.get_hookimpls()):
            pname = self.pm.get_name(impl.plugin) or "?"
            try:
                r = impl.function(backend=b)
            except Exception as e:  # a plugin's probe must never break a command
                if pname == owner:
                    return ProbeResult.unavailable(f"probe raised {type(e).__name__}: {e}")
                self.notices.append(f"plugin '{pname}' raised in strata_probe for '{b.name}': "
                                    f"{type(e).__name__}: {e}; ignored")
                r = None
                continue
            if r is not None:
                break
        if r is None:
            try:
                r = b.probe()
            except Exception as e:
                return ProbeResult.unavailable(f"probe raised {type(e).__name__}: {e}")
        if not isinstance(r, ProbeResult):
            return ProbeResult.unavailable(f"probe returned {type(r).__name__}, not a ProbeResult")
        return r

    def statuses(self) -> list[BackendStatus]:
        """Every discovered backend with its probe result, and the plugins that could not load, sorted by name."""
        out = []
        for name, b in self.backends.items():
            r = self.probe(name)
            out.append(BackendStatus(name=name, vendor=b.vendor, version=r.version or b.version,
                                     api_version=b.api_version, available=r.available, reason=r.reason,
                                     install_hint=b.install_hint if not r.available else "",
                                     score=r.score if r.available else 0, devices=tuple(r.devices),
                                     plugin=self.backend_plugin.get(name, "")))
        return sorted(out + list(self.broken), key=lambda s: s.name)

    def resolve(self, requested: str = "auto") -> tuple[Backend, ProbeResult]:
        """The backend to use: an explicit name (must be available) or, for 'auto', the highest probe score.

        A tie at the top is an error asking the user to choose: selection never guesses.
        """
        if requested and requested != "auto":
            if requested not in self.backends:
                why = next((s.reason for s in self.broken if s.name == requested), "")
                if why:
                    raise BadInput(f"backend.name: backend '{requested}' is not available: {why}")
                known = ", ".join(sorted(self.backends)) or "none"
                raise BadInput(f"backend.name: unknown backend '{requested}' (installed: {known})")
            r = self.probe(requested)
            if not r.available:
                hint = self.backends[requested].install_hint
                raise BadInput(f"backend.name: backend '{requested}' is not available: {r.reason}"
                               + (f" (install: {hint})" if hint else ""))
            return self.backends[requested], r
        ranked = sorted(((self.probe(n).score, n) for n in self.backends if self.probe(n).available), reverse=True)
        if not ranked:
            raise StrataError("no backend is available; run `strata backends` to see why")
        top = [n for s, n in ranked if s == ranked[0][0]]
        if len(top) > 1:
            raise BadInput(f"backend.name: backends {', '.join(sorted(top))} tie at score {ranked[0][0]}; "
                           f"choose one with --backend NAME or STRATA_BACKEND__NAME")
        return self.backends[top[0]], self.probe(top[0])

    def selection(self, requested: str = "auto") -> tuple[str | None, str]:
        """(backend name, '') that `resolve` picks, or (None, why not): never raises."""
        try:
            return self.resolve(requested)[0].name, ""
        except StrataError as e:
            return None, str(e)

    def device_and_defaults(self, requested: str = "auto", device_index: int = 0):
        """(backend, device, host, PlatformDefaults) of the resolved backend; raises like `resolve`."""
        b, r = self.resolve(requested)
        if not r.devices:
            raise StrataError(f"backend '{b.name}' reports no device")
        matching = [d for d in r.devices if d.index == device_index]
        if not matching and device_index >= len(r.devices):
            raise BadInput(f"backend.device: backend '{b.name}' has {len(r.devices)} device(s); "
                           f"allowed: 0..{len(r.devices) - 1}")
        device = matching[0] if matching else r.devices[device_index]
        try:
            host = self.pm.hook.strata_host_info() or probe_host()
            defaults = self.pm.hook.strata_platform_defaults(device=device, host=host) or PlatformDefaults()
        except Exception as e:  # a plugin's bug, reported in one line rather than a traceback
            raise StrataError(f"a plugin failed while reading the platform of '{b.name}': {type(e).__name__}: {e}") \
                from None
        return b, device, host, defaults


def _major(version: str) -> str:
    return str(version).split(".", 1)[0]


def _name_of(plugin: Any, fallback: str) -> str:
    return getattr(plugin, "__name__", None) or fallback


def new_plugin_manager() -> pluggy.PluginManager:
    """A plugin manager that knows the strata hook contract."""
    pm = pluggy.PluginManager("strata")
    pm.add_hookspecs(hookspecs)
    return pm


def load_plugins(allow: Iterable[str] = (), block: Iterable[str] = (), autoload: bool = True,
                 extra: Iterable[Any] = ()) -> PluginHost:
    """Load plugins from the entry-point groups (when autoload) and `extra` objects, then collect their backends.

    `allow`, when not empty, names the only entry points loaded; `block` names entry points never loaded. A plugin
    that fails to import, or implements a hook that does not exist, is listed as broken with the error; it never
    breaks a command.
    """
    allow, block = set(allow), set(block)
    pm = new_plugin_manager()
    host = PluginHost(pm=pm)
    candidates: list[tuple[str, str, Any]] = []  # (name, group, loader)
    if autoload:
        for group in ENTRY_POINT_GROUPS:
            for ep in md.entry_points(group=group):
                if ep.name in block or (allow and ep.name not in allow):
                    continue
                candidates.append((ep.name, group, ep.load))
    for obj in extra:
        candidates.append((_name_of(obj, repr(obj)), "extra", lambda obj=obj: obj))
    for name, group, loader in candidates:
        if pm.has_plugin(name):
            continue
        try:
            plugin = loader()
        except Exception as e:
            host.broken.append(_broken(name, f"plugin failed to import: {type(e).__name__}: {e}"))
            continue
        try:
            pm.register(plugin, name=name)
            pm.check_pending()
        except pluggy.PluginValidationError as e:
            _unregister(pm, name)
            host.broken.append(_broken(name, f"plugin '{name}' rejected: {e}"))
            continue
        except Exception as e:
            _unregister(pm, name)
            host.broken.append(_broken(name, f"plugin '{name}' rejected: {type(e).__name__}: {e}"))
            continue
    for impl in pm.hook.strata_backends.get_hookimpls():
        pname = pm.get_name(impl.plugin) or "?"
        try:
            provided = impl.function() or []
            provided = [provided] if isinstance(provided, Backend) else list(provided)
        except Exception as e:
            host.broken.append(_broken(pname, f"strata_backends raised {type(e).__name__}: {e}"))
            continue
        for b in provided:
            if not isinstance(b, Backend):
                host.broken.append(_broken(pname, f"plugin '{pname}' returned {type(b).__name__}, not a Backend"))
            elif _major(b.api_version) != _major(API_VERSION):
                host.broken.append(_broken(b.name, f"backend '{b.name}' (plugin '{pname}') speaks api "
                                                   f"{b.api_version}; this core speaks {API_VERSION}", vendor=b.vendor,
                                           api_version=b.api_version))
            elif b.name in host.backends:
                host.notices.append(f"backend '{b.name}' is provided twice; plugin '{pname}' ignored")
            else:
                host.backends[b.name] = b
                host.backend_plugin[b.name] = pname
    return host


def _unregister(pm: pluggy.PluginManager, name: str) -> None:
    plugin = pm.get_plugin(name)
    if plugin is not None:
        pm.unregister(plugin)


def _broken(name: str, reason: str, vendor: str = "", api_version: str = "?") -> BackendStatus:
    return BackendStatus(name=name, vendor=vendor or VENDOR_OF_BACKEND.get(name, "?"), version="", api_version=api_version, available=False,
                         reason=reason, install_hint="", score=0, plugin=name)


def load_from_settings(settings: Any, extra: Iterable[Any] = ()) -> PluginHost:
    """Load plugins as the `plugins` settings group says (allow, block, autoload), then let them read their settings."""
    p = settings.plugins
    host = load_plugins(allow=p.allow, block=p.block, autoload=p.autoload, extra=extra)
    # Before any probe, so probes see each plugin's settings. Each implementation runs on its own: a bad value is the
    # user's (BadInput, exit 2), any other error is the plugin's and must not break the command.
    for impl in reversed(host.pm.hook.strata_configure.get_hookimpls()):
        try:
            impl.function(settings=settings)
        except BadInput:
            raise
        except Exception as e:
            host.notices.append(f"plugin '{host.pm.get_name(impl.plugin)}' raised in strata_configure: "
                                f"{type(e).__name__}: {e}; its settings were not applied")
    return host
