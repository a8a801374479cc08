"""The pytest plugin of the conformance kit (entry point `pytest11: strata`): `--strata-backend` and its fixtures.

Tests that take the `strata_backend` fixture (the suite in `strata_core.testing.conformance`) are parametrized over
the backends selected by `--strata-backend NAME[,NAME...]|all`, or, without the option, by a module-level
`STRATA_CONFORMANCE_BACKENDS = [...]`. With neither they are deselected, so a plain `pytest` never runs them by
accident. Under `all` a backend that is unavailable here is skipped with its probe's reason; a backend named
explicitly (on the command line or in the module) that is unavailable fails, because someone asked for it.
`strata_session` opens the backend's first device for the test (`device.open(plan)`) and closes it after.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from typing import Any

from strata_core.api.backend import Backend, ProbeResult
from strata_core.api.facts import DeviceInfo, HostInfo
from strata_core.registry import PluginHost, load_plugins
from strata_core.testing.session import KitSession, info_of, open_kit_session

FIXTURE = "strata_backend"
MODULE_SELECTION = "STRATA_CONFORMANCE_BACKENDS"
_HOST_KEY = pytest.StashKey[PluginHost]()


@dataclass(frozen=True)
class BackendUnderTest:
    """What a conformance test gets: the backend, its probe, its first device (a Device object; `info` its facts),
    the host facts and the plugin host."""

    name: str
    backend: Backend
    probe: ProbeResult
    device: Any
    host_info: HostInfo
    plugins: PluginHost

    @property
    def info(self) -> DeviceInfo:
        """The device's facts."""
        return info_of(self.device)


@dataclass(frozen=True)
class _Selection:
    name: str
    explicit: bool


def pytest_addoption(parser):
    """Add `--strata-backend`."""
    group = parser.getgroup("strata", "Strata Core conformance kit")
    group.addoption("--strata-backend", action="store", default=None, metavar="NAME|all",
                    help="run the conformance suite against these backends (comma list, or 'all' for every "
                         "installed backend; unavailable ones are skipped under 'all', a failure when named)")


def pytest_configure(config):
    """Declare the marker the suite's tests carry."""
    config.addinivalue_line("markers", "strata_conformance: a test of the Strata backend conformance kit")


def plugin_host(config) -> PluginHost:
    """The plugin host of this pytest session, loaded once from the installed entry points."""
    if _HOST_KEY not in config.stash:
        config.stash[_HOST_KEY] = load_plugins()
    return config.stash[_HOST_KEY]


def _names(spec, config) -> list[_Selection]:
    """Expand a selection (a string with commas, or a list of names) into backend names."""
    items = [spec] if isinstance(spec, str) else list(spec)
    out: list[_Selection] = []
    for item in items:
        for name in str(item).split(","):
            name = name.strip()
            if not name:
                continue
            if name == "all":
                host = plugin_host(config)
                every = sorted(set(host.backends) | {b.name for b in host.broken})
                out.extend(_Selection(n, explicit=False) for n in every)
            else:
                out.append(_Selection(name, explicit=True))
    seen, unique = set(), []
    for s in out:
        if s.name not in seen:
            seen.add(s.name)
            unique.append(s)
    return unique


def pytest_generate_tests(metafunc):
    """Parametrize `strata_backend` over the selected backends; leave it unparametrized (deselected) when none are."""
    if FIXTURE not in metafunc.fixturenames:
        return
    spec = metafunc.config.getoption("strata_backend")
    if spec is None:
        spec = getattr(metafunc.module, MODULE_SELECTION, None)
    if spec is None:
        return
    selected = _names(spec, metafunc.config)
    if not selected:
        raise pytest.UsageError("--strata-backend: no backend named")
    metafunc.parametrize(FIXTURE, selected, indirect=True, ids=[s.name for s in selected])


def pytest_collection_modifyitems(config, items):
    """Deselect conformance tests that no backend selection parametrized."""
    keep, dropped = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        if FIXTURE in getattr(item, "fixturenames", ()) and (callspec is None or FIXTURE not in callspec.params):
            dropped.append(item)
        else:
            keep.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def resolve(config, selection: _Selection) -> BackendUnderTest:
    """The backend under test, or skip (unavailable under 'all') or fail (named but unavailable, or broken)."""
    host = plugin_host(config)
    name = selection.name
    broken = [b for b in host.broken if b.name == name]
    if name not in host.backends:
        if broken:
            pytest.fail(f"backend plugin '{name}' did not load: {broken[0].reason}", pytrace=False)
        known = ", ".join(sorted(host.backends)) or "none"
        pytest.fail(f"backend '{name}' is not installed (installed: {known})", pytrace=False)
    probe = host.probe(name)
    if not probe.available:
        hint = host.backends[name].install_hint
        reason = probe.reason or "no reason given"
        why = f"backend '{name}' is not available here: {reason}" + (
            f" (install: {hint})" if hint and hint not in reason else "")
        if selection.explicit:
            pytest.fail(why, pytrace=False)
        pytest.skip(why)
    if not probe.devices:
        pytest.fail(f"backend '{name}' says it is available but its probe lists no device", pytrace=False)
    if hasattr(host, "host_info"):
        host_info = host.host_info()
    else:
        host_info = host.hook.strata_host_info()
        if host_info is None:
            from strata_core.hostinfo import probe_host  # the core's own reading, as the planner falls back to
            host_info = probe_host()
    return BackendUnderTest(name=name, backend=host.backends[name], probe=probe, device=probe.devices[0],
                            host_info=host_info, plugins=host)


@pytest.fixture
def strata_backend(request) -> BackendUnderTest:
    """The backend under test (parametrized by `--strata-backend` or the module's STRATA_CONFORMANCE_BACKENDS)."""
    selection = getattr(request, "param", None)
    if not isinstance(selection, _Selection):
        pytest.fail("strata_backend is parametrized by --strata-backend or STRATA_CONFORMANCE_BACKENDS only",
                    pytrace=False)
    return resolve(request.config, selection)


@pytest.fixture
def strata_session(strata_backend) -> KitSession:
    """The backend's first device opened for the test (memory, kernels, layer ops, pinned), closed after it."""
    bt = strata_backend
    session = open_kit_session(bt.plugins, bt.backend, bt.device, bt.host_info)
    try:
        yield session
    finally:
        session.close()
