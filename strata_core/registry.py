"""The registry: built-in backends by import, third-party plugins by entry point, and the one Target resolution.

Loading: the built-in `cpu` and `sim` backends are registered by import and always present; `plugins.autoload`,
`plugins.allow` and `plugins.block` concern third-party entry points only (`strata.backends`, `strata.plugins`).
A plugin that fails to import, implements a hook that does not exist, or provides a Backend of another API major
version is listed as refused, in one line; it never breaks a command.

Resolution (`PluginHost.resolve_target`): settings (or a profile's facts) -> a Backend -> one of its Device objects
-> the host facts -> that device's platform defaults on that host: a `Target`, which every command plans for.
'auto' takes the highest probe score, except where that backend computes on the host CPU and others do too: then the
one that ran a decode layer fastest (`strata_core.calibration`, measured once per machine and cached); the choice
is remembered for a day, so later runs probe only the backend chosen.
"""

from __future__ import annotations

import importlib.metadata as md
from dataclasses import dataclass, field
from typing import Any, Iterable

import pluggy
from pydantic import BaseModel, ValidationError

from strata_core.api import API_VERSION
from strata_core.api import hookspecs
from strata_core.api.backend import Backend, Device, FactsOnlyDevice, ProbeResult
from strata_core.api.facts import VENDOR_OF_BACKEND, DeviceInfo, DeviceType, HostInfo, PlatformDefaults, Profile
from strata_core.api.settings import SettingsGroup
from strata_core.api.target import Target
from strata_core.builtin import cpu as _cpu
from strata_core.builtin.sim import backend as _sim
from strata_core.errors import BadInput, StrataError
from strata_core.hostinfo import probe_host

ENTRY_POINT_GROUPS = ("strata.backends", "strata.plugins")

#: The backends of the core itself, registered by import under these names whatever the plugin settings say.
BUILTIN_PLUGINS = (("cpu", _cpu), ("sim", _sim))

#: Hooks of API 1.x that API 2.0 removed; a plugin implementing one is refused at load (its device questions now go
#: to the Device object: `platform_defaults(host)`, `open(plan)`; its settings to `strata_settings_group`).
REMOVED_HOOKS = ("strata_probe", "strata_platform_defaults", "strata_pinned_allocator", "strata_device_memory",
                 "strata_kernels", "strata_configure")

#: Where the defaults of a device come from when no backend gives them.
CORE_DEFAULTS_SOURCE = "core (no backend answered)"


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
    devices: tuple = ()  # Device objects
    plugin: str = ""

    def to_json(self) -> dict:
        """One entry of `strata.backends/1`."""
        return {"name": self.name, "vendor": self.vendor, "version": self.version, "api_version": self.api_version,
                "available": self.available, "reason": self.reason, "install_hint": self.install_hint,
                "score": self.score, "devices": [d.info.to_json() for d in self.devices], "plugin": self.plugin}


@dataclass
class PluginHost:
    """The loaded plugins, their backends and settings groups. Build one with `load_plugins` or `load_from_settings`."""

    pm: pluggy.PluginManager
    backends: dict[str, Backend] = field(default_factory=dict)
    backend_plugin: dict[str, str] = field(default_factory=dict)
    broken: list[BackendStatus] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)
    groups: dict[str, SettingsGroup] = field(default_factory=dict)
    group_plugin: dict[str, str] = field(default_factory=dict)
    _probes: dict[str, ProbeResult] = field(default_factory=dict)
    #: 'auto' among host-CPU backends: (plugins, backend, device, host) -> {"us_per_layer": ...}; None: the real
    #: calibration. The cache file (None: calibration.json in the user's cache folder).
    measure: Any = None
    calibration_path: Any = None
    #: How the last 'auto' resolution among host-CPU backends chose (None: by probe score alone).
    auto_selection: dict | None = None
    #: True: 'auto' probes every backend, never the remembered choice (`strata backends`).
    fresh_selection: bool = False

    @property
    def hook(self):
        """The pluggy hook relay."""
        return self.pm.hook

    # --- probing -------------------------------------------------------------------------------------------------

    def probe(self, name: str) -> ProbeResult:
        """Probe one backend once (cached); a probe that raises becomes 'unavailable' with the error."""
        if name not in self._probes:
            self._probes[name] = self._probe_uncached(self.backends[name])
        return self._probes[name]

    def _probe_uncached(self, b: Backend) -> ProbeResult:
        try:
            r = b.probe()
        except Exception as e:
            return ProbeResult.unavailable(f"probe raised {type(e).__name__}: {e}")
        if not isinstance(r, ProbeResult):
            return ProbeResult.unavailable(f"probe returned {type(r).__name__}, not a ProbeResult")
        for d in r.devices:
            if isinstance(d, DeviceInfo):
                return ProbeResult.unavailable("probe lists DeviceInfo facts, not Device objects (an API 1.x "
                                               "backend)", version=r.version)
            if not isinstance(d, Device):
                return ProbeResult.unavailable(f"probe returned a {type(d).__name__} among its devices, not a Device "
                                               f"(info, platform_defaults, open)", version=r.version)
        return r

    def statuses(self) -> list[BackendStatus]:
        """Every discovered backend with its probe result, and the plugins that could not load, sorted by name."""
        out = []
        for name, b in self.backends.items():
            r = self.probe(name)
            out.append(BackendStatus(name=name, vendor=b.vendor, version=r.version or b.version,
                                     api_version=b.api_version, available=r.available, reason=r.reason,
                                     install_hint=r.hint_for(b),
                                     score=r.score if r.available else 0, devices=tuple(r.devices),
                                     plugin=self.backend_plugin.get(name, "")))
        return sorted(out + list(self.broken), key=lambda s: s.name)

    # --- resolution ----------------------------------------------------------------------------------------------

    def resolve(self, requested: str = "auto", device_index: int = 0) -> tuple[Backend, ProbeResult]:
        """The backend to use: an explicit name (must be available) or, for 'auto', the highest probe score.

        Where the highest-scored backend computes on the host CPU and other available backends do too, 'auto' takes
        the one of them that runs a decode layer fastest, measured once per machine (`strata_core.calibration`);
        `auto_selection` says what was measured and why the winner won. A tie at the top that no measurement
        settles is an error asking the user to choose: selection never guesses.
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
                hint = r.hint_for(self.backends[requested])
                raise BadInput(f"backend.name: backend '{requested}' is not available: {r.reason}"
                               + (f" (install: {hint})" if hint else ""))
            return self.backends[requested], r
        cached = None if self.fresh_selection else self._cached_selection(device_index)
        if cached is not None:
            return self.backends[cached], self.probe(cached)
        ranked = sorted(((self.probe(n).score, n) for n in self.backends if self.probe(n).available), reverse=True)
        if not ranked:
            raise StrataError("no backend is available; run `strata backends` to see why")
        top = [n for s, n in ranked if s == ranked[0][0]]
        on_host = [n for _, n in ranked if self._computes_on_host(n, device_index)]
        if len(on_host) > 1 and all(n in on_host for n in top):
            best = self._fastest_on_host(on_host, ranked[0][1] if len(top) == 1 else None, device_index)
            if best is not None:
                return self.backends[best], self.probe(best)
        if len(top) > 1:
            raise BadInput(f"backend.name: backends {', '.join(sorted(top))} tie at score {ranked[0][0]}; "
                           f"choose one with --backend NAME or STRATA_BACKEND__NAME")
        return self.backends[top[0]], self.probe(top[0])

    def _computes_on_host(self, name: str, device_index: int = 0) -> bool:
        """Does this available backend's device (the one `backend.device` picks) compute on the host CPU?"""
        r = self.probe(name)
        if not r.devices:
            return False
        d = r.devices[min(int(device_index), len(r.devices) - 1)]
        return getattr(d.info, "device_type", None) == DeviceType.CPU and callable(getattr(d, "open", None))

    def _fastest_on_host(self, names: list[str], by_score: str | None, device_index: int = 0) -> str | None:
        """The measured-fastest of these host-CPU backends (figures from the cache, else measured and cached);
        None when none could be measured. Records `auto_selection`."""
        from strata_core import calibration
        path = self.calibration_path or calibration.cache_path()
        entries = calibration.load(path)
        host = self.host_info()
        figures: dict[str, dict] = {}
        wrote = False
        for n in names:
            b, r = self.backends[n], self.probe(n)
            d = r.devices[min(int(device_index), len(r.devices) - 1)]
            key = calibration.cache_key(b, r, d, host)
            got = entries.get(key)
            cached = got is not None
            if got is None:
                measure = self.measure or calibration.measure_layer_us
                try:
                    got = dict(measure(self, b, d, host))
                except Exception as e:  # a backend that cannot run the tiny layer is not picked by speed
                    got = {"us_per_layer": None, "error": f"{type(e).__name__}: {e}"}
                entries[key] = got
                wrote = True
            figures[n] = {**got, "cached": cached, "score": r.score}
        save_error = calibration.save(path, entries) if wrote else None
        timed = [(f["us_per_layer"], n) for n, f in figures.items() if f.get("us_per_layer") is not None]
        if not timed:
            return None
        us, best = min(timed)
        others = ", ".join(f"{n} {f['us_per_layer']:.0f} us" if f.get("us_per_layer") is not None
                           else f"{n} not measured ({f.get('error')})" for n, f in figures.items() if n != best)
        why = (f"{best} ran the tiny model's decode layer in {us:.0f} us, the fastest of the backends on the host "
               f"CPU ({others})" + (f"; the highest probe score was {by_score}'s" if by_score not in (None, best)
                                    else ""))
        self.auto_selection = {"by": "measured", "selected": best, "highest_score": by_score, "why": why,
                               "figures": figures, "cache": str(path), "cache_error": save_error}
        self.auto_selection["cache_error"] = calibration.save_selection(path, self._installed_key(device_index),
                                                                        self.auto_selection) or save_error
        return best

    def _installed_key(self, device_index: int) -> str:
        """What a remembered 'auto' choice depends on without probing: the installed backends and their versions,
        the plugins that did not load, the device index, the host CPU and Strata's version."""
        from strata_core import calibration
        names = [f"{n}={b.version}" for n, b in sorted(self.backends.items())] + [f"!{b.name}" for b in self.broken]
        return calibration.selection_key(names, device_index)

    def _cached_selection(self, device_index: int) -> str | None:
        """The measured 'auto' choice remembered for this installation (younger than calibration.SELECTION_TTL_S),
        when its backend still probes available: the other backends are not probed (their runtimes not started)."""
        from strata_core import calibration
        path = self.calibration_path or calibration.cache_path()
        got = calibration.load_selection(path, self._installed_key(device_index))
        if got is None or got.get("selected") not in self.backends or not self.probe(got["selected"]).available:
            return None
        self.auto_selection = {**got, "remembered": True,
                               "why": f"{got['why']} (measured {got.get('decided_at', '?')}, remembered; "
                                      f"`strata backends` probes every backend again)"}
        return got["selected"]

    def selection(self, requested: str = "auto") -> tuple[str | None, str]:
        """(backend name, '') that `resolve` picks, or (None, why not): never raises."""
        try:
            return self.resolve(requested)[0].name, ""
        except StrataError as e:
            return None, str(e)

    def resolve_target(self, settings: Any, host_override: HostInfo | None = None, profile: Profile | None = None,
                       origin: str | None = None) -> Target:
        """The one resolution of a command: backend, device, host facts and platform defaults.

        Without `profile`: the backend `backend.name` names (or the best for 'auto'), its device `backend.device`
        (refused, never clamped, with the allowed range), this machine's host facts (`strata_host_info`, else the
        core's reading; a simulated machine's own when its device carries them). With `profile`: its facts, the
        device described by the profile's backend (`Backend.describe`), or a `FactsOnlyDevice` for a backend not
        installed here. `host_override` replaces the host facts either way.
        """
        if profile is not None:
            backend = self.backends.get(profile.backend) or _absent_backend(profile.backend)
            device = self.describe(profile.device)
            host = host_override or profile.host
            origin = origin or f"a {profile.backend} profile"
        else:
            index = int(getattr(settings.backend, "device", 0) or 0)
            backend, r = self.resolve(getattr(settings.backend, "name", "auto") or "auto", index)
            device = _pick_device(backend, r, index)
            host = host_override or getattr(device, "simulated_host", None) or self.host_info()
            origin = origin or "this machine"
        return Target(backend=backend, device=device, host=host, defaults=self._defaults(backend, device, host),
                      origin=origin)

    def target_for(self, info: DeviceInfo, host: HostInfo, origin: str | None = None) -> Target:
        """The Target of given facts (a device of `info.backend` on `host`): `resolve_target` with them as a profile."""
        return self.resolve_target(None, profile=Profile(backend=info.backend, device=info, host=host), origin=origin)

    def describe(self, info: DeviceInfo) -> Device:
        """A Device for facts from a profile or scenario: its backend's `describe`, else a FactsOnlyDevice."""
        b = self.backends.get(info.backend)
        if b is not None and b.describe is not None:
            try:
                d = b.describe(info)
            except StrataError:
                raise
            except Exception as e:  # a plugin's bug, in one line
                raise StrataError(f"backend '{b.name}' failed to describe device '{info.name}': "
                                  f"{type(e).__name__}: {e}") from None
            if not isinstance(d, Device):
                raise StrataError(f"backend '{b.name}' described device '{info.name}' as a {type(d).__name__}, "
                                  f"not a Device")
            return d
        return FactsOnlyDevice(info, defaults=PlatformDefaults(source=CORE_DEFAULTS_SOURCE))

    def host_info(self) -> HostInfo:
        """This machine's host facts: the first plugin's `strata_host_info` answer, else the core's reading."""
        try:
            h = self.pm.hook.strata_host_info()
        except Exception as e:  # a plugin refining host facts must not break a command
            self.notices.append(f"strata_host_info raised {type(e).__name__}: {e}; using the core's reading")
            h = None
        return h if isinstance(h, HostInfo) else probe_host()

    def _defaults(self, backend: Backend, device: Device, host: HostInfo) -> PlatformDefaults:
        try:
            d = device.platform_defaults(host)
        except StrataError:
            raise
        except Exception as e:  # a plugin's bug, reported in one line rather than a traceback
            raise StrataError(f"backend '{backend.name}' failed while reading the platform of "
                              f"'{device.info.name}': {type(e).__name__}: {e}") from None
        if d is None:
            return PlatformDefaults(source=CORE_DEFAULTS_SOURCE)
        if not isinstance(d, PlatformDefaults):
            raise StrataError(f"backend '{backend.name}' gave a {type(d).__name__} as the platform defaults of "
                              f"'{device.info.name}', not PlatformDefaults")
        return d

    # --- settings groups -----------------------------------------------------------------------------------------

    def settings_groups(self) -> list[SettingsGroup]:
        """The plugins' own settings groups (the built-in sim's included), sorted by name."""
        return [self.groups[n] for n in sorted(self.groups)]

    def apply_settings(self, settings: Any) -> None:
        """Give each settings group its validated values: a BadInput there is the user's, other errors a notice."""
        for group in self.settings_groups():
            values = group_values(settings, group)
            if group.apply is None:
                continue
            try:
                group.apply(values)
            except BadInput:
                raise
            except Exception as e:
                self.notices.append(f"plugin '{self.group_plugin.get(group.name, '?')}' raised applying settings "
                                    f"group '{group.name}': {type(e).__name__}: {e}; its settings were not applied")


def group_values(settings: Any, group: SettingsGroup) -> BaseModel:
    """A settings group's values, validated by its model: `settings.<name>` (a model or a dict), else the defaults."""
    raw = getattr(settings, group.name, None) if settings is not None else None
    if raw is None:
        raw = (getattr(settings, "plugin_settings", None) or {}).get(group.name) if settings is not None else None
    if isinstance(raw, group.model):
        return raw
    if isinstance(raw, BaseModel):
        raw = raw.model_dump()
    try:
        return group.model.model_validate(raw or {})
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join([group.name, *(str(p) for p in err.get("loc", ()))])
        raise BadInput(f"{key}: {err.get('msg', 'invalid value')}") from None


def _pick_device(backend: Backend, r: ProbeResult, index: int) -> Device:
    """The device of `index`: the one reporting that index, else the index-th; never clamped."""
    if not r.devices:
        raise StrataError(f"backend '{backend.name}' reports no device")
    for d in r.devices:
        if d.info.index == index:
            return d
    if 0 <= index < len(r.devices):
        return r.devices[index]
    raise BadInput(f"backend.device: backend '{backend.name}' has {len(r.devices)} device(s), no device {index}; "
                   f"allowed: 0..{len(r.devices) - 1}")


def _absent_backend(name: str) -> Backend:
    """A stand-in Backend for facts of a backend not installed here (plans with the core's defaults)."""
    return Backend(name=name, vendor=VENDOR_OF_BACKEND.get(name, name), api_version=API_VERSION,
                   probe=lambda: ProbeResult.unavailable(f"backend '{name}' is not installed here"),
                   description="not installed: facts from a profile")


def _major(version: Any) -> str:
    return str(version).split(".", 1)[0]


def _name_of(plugin: Any, fallback: str) -> str:
    return getattr(plugin, "__name__", None) or fallback


def new_plugin_manager() -> pluggy.PluginManager:
    """A plugin manager that knows the strata hook contract."""
    pm = pluggy.PluginManager("strata")
    pm.add_hookspecs(hookspecs)
    return pm


def _removed_hooks_of(pm: pluggy.PluginManager, plugin: Any) -> list[str]:
    """The API 1.x hooks a plugin implements (marked as hook implementations), in name order."""
    # older pluggy reads the attribute without a default: ask only for names the plugin has
    return sorted(h for h in REMOVED_HOOKS
                  if hasattr(plugin, h) and pm.parse_hookimpl_opts(plugin, h) is not None)


def load_plugins(allow: Iterable[str] = (), block: Iterable[str] = (), autoload: bool = True,
                 extra: Iterable[Any] = ()) -> PluginHost:
    """The built-in backends, then the entry points (when autoload, filtered by allow/block), then `extra` objects.

    `allow`, when not empty, names the only entry points loaded; `block` names entry points never loaded. Neither
    touches the built-in cpu and sim backends.
    """
    allow, block = set(allow), set(block)
    pm = new_plugin_manager()
    host = PluginHost(pm=pm)
    candidates: list[tuple[str, Any]] = [(name, (lambda m=module: m)) for name, module in BUILTIN_PLUGINS]
    if autoload:
        for group in ENTRY_POINT_GROUPS:
            for ep in md.entry_points(group=group):
                if ep.name in block or (allow and ep.name not in allow):
                    continue
                candidates.append((ep.name, ep.load))
    for obj in extra:
        candidates.append((_name_of(obj, repr(obj)), lambda obj=obj: obj))
    for name, loader in candidates:
        if pm.has_plugin(name):
            continue
        try:
            plugin = loader()
        except Exception as e:
            host.broken.append(_broken(name, f"plugin failed to import: {type(e).__name__}: {e}"))
            continue
        if pm.is_registered(plugin):
            continue
        removed = _removed_hooks_of(pm, plugin)
        if removed:
            host.broken.append(_broken(name, f"plugin '{name}' implements {', '.join(removed)}, removed in API 2.0 "
                                             f"(an API 1.x plugin); refused"))
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
    _collect_backends(host)
    _collect_settings_groups(host)
    return host


def _collect_backends(host: PluginHost) -> None:
    pm = host.pm
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
            elif not b.api_version or _major(b.api_version) != _major(API_VERSION):
                spoken = f"speaks api {b.api_version}" if b.api_version else "declares no api_version"
                host.broken.append(_broken(b.name, f"backend '{b.name}' (plugin '{pname}') {spoken}; this core "
                                                   f"speaks {API_VERSION}", vendor=b.vendor,
                                           api_version=str(b.api_version or "none")))
            elif b.name in host.backends:
                host.notices.append(f"backend '{b.name}' is provided twice; plugin '{pname}' ignored")
            else:
                host.backends[b.name] = b
                host.backend_plugin[b.name] = pname


def _collect_settings_groups(host: PluginHost) -> None:
    pm = host.pm
    for impl in pm.hook.strata_settings_group.get_hookimpls():  # registration order: the built-ins first
        pname = pm.get_name(impl.plugin) or "?"
        try:
            g = impl.function()
        except Exception as e:
            host.notices.append(f"plugin '{pname}' raised in strata_settings_group: {type(e).__name__}: {e}; "
                                f"its settings group is left out")
            continue
        if g is None:
            continue
        if not (isinstance(g, SettingsGroup) and isinstance(g.model, type) and issubclass(g.model, BaseModel)):
            host.notices.append(f"plugin '{pname}' returned {type(g).__name__} from strata_settings_group, not a "
                                f"SettingsGroup with a pydantic model; left out")
        elif g.name in host.groups:
            host.notices.append(f"settings group '{g.name}' is declared twice; plugin '{pname}' ignored")
        else:
            host.groups[g.name] = g
            host.group_plugin[g.name] = pname


def _unregister(pm: pluggy.PluginManager, name: str) -> None:
    plugin = pm.get_plugin(name)
    if plugin is not None:
        pm.unregister(plugin)


def _broken(name: str, reason: str, vendor: str = "", api_version: str = "?") -> BackendStatus:
    return BackendStatus(name=name, vendor=vendor or VENDOR_OF_BACKEND.get(name, "?"), version="",
                         api_version=api_version, available=False, reason=reason, install_hint="", score=0,
                         plugin=name)


def load_from_settings(settings: Any, extra: Iterable[Any] = ()) -> PluginHost:
    """Load plugins as the `plugins` settings group says (allow, block, autoload), then apply their settings groups."""
    p = settings.plugins
    host = load_plugins(allow=p.allow, block=p.block, autoload=p.autoload, extra=extra)
    # Before any probe, so probes see each plugin's settings (the sim device is the profile it was given).
    host.apply_settings(settings)
    return host


def resolve_target(settings: Any, host_override: HostInfo | None = None, profile: Profile | None = None,
                   plugins: PluginHost | None = None) -> Target:
    """`PluginHost.resolve_target` on `plugins`, or on the plugins these settings load."""
    return (plugins or load_from_settings(settings)).resolve_target(settings, host_override=host_override,
                                                                    profile=profile)
