"""The backend conformance suite: plain pytest tests of one backend, reached only through its Device objects.

Use it from a test module of your plugin:

    STRATA_CONFORMANCE_BACKENDS = ["mybackend"]   # optional; `pytest --strata-backend NAME|all` overrides it
    from strata_core.testing.conformance import *

Every test takes the `strata_backend` fixture (see `strata_core.testing.plugin`); tests that drive the device take
`strata_session`, the session `Backend.probe().devices[0].open(plan)` returns for a plan of the built-in tiny
model. The suite is vendor-neutral: it moves data only with `DeviceMemory.to_device`/`upload`/`download` and calls
kernels on the device arrays the backend returns. Test names carry their suite: `test_hooks_*`, `test_alloc_*`,
`test_memory_*`, `test_kernel_*`, `test_run_*`. Inputs are fresh random data each run; a failure message carries
the seed to replay it.

Expected values are computed in float64 (`strata_core.testing.reference64`), never with the numpy oracle under
test, and each kernel is held to the bound of the precision path it declares (`strata_core.testing.tolerance`:
f32 accumulation 1e-5 relative, f16 intermediates or outputs 1e-3; quantized weights against their exact
dequantization). The mutation self-test (tests/kit/test_mutations.py) keeps every kernel check able to fail.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys

import numpy as np
import pytest

from strata_core.api import API_VERSION
from strata_core.api.backend import Backend, DeviceMemory, PinnedBudget, ProbeResult
from strata_core.api.facts import DeviceInfo, PlatformDefaults
from strata_core.api.kernels import KernelSet, LayerOps
from strata_core.reference.kernels import ReferenceKernels
from strata_core.testing.checks import CHECKS, protocol_kernels
from strata_core.testing.session import declared_hooks, info_of, is_device_object, platform_defaults
from strata_core.testing.tolerance import BOUNDS, bound_of, precision_of

#: The junit property a kernel test records: "1" when the kernels under test are the numpy reference itself.
REFERENCE_PROPERTY = "strata_reference"
#: A device allocation no device has room for (1 PiB).
ABSURD_DEVICE_BYTES = 1 << 50
#: Wall-clock limit of the `strata run --check` subprocess, seconds (a limit against hangs, not a timing).
RUN_CHECK_LIMIT_S = 600
#: The reproducibility runs' prompt and decode lengths (small: two runs per lane).
REPRO_PROMPT_TOKENS, REPRO_DECODE_TOKENS = 300, 8
MIB = 1 << 20

#: A device that belongs to no backend: every backend must answer None for it.
FOREIGN_DEVICE = DeviceInfo(backend="strata-conformance-foreign", vendor="nobody", name="a device of another backend",
                            vram_total_bytes=8 << 30, vram_free_bytes=8 << 30)


def _rng() -> tuple[np.random.Generator, int]:
    """A fresh generator and its seed (printed on failure so a run can be replayed)."""
    seed = secrets.randbits(32)
    return np.random.default_rng(seed), seed


def _own_impl(bt, hook_name: str):
    """The implementation of `hook_name` in the plugin that provides this backend, or None if it has none."""
    plugin = bt.plugins.pm.get_plugin(bt.plugins.backend_plugin[bt.name])
    hook = getattr(bt.plugins.hook, hook_name, None)
    for impl in (hook.get_hookimpls() if hook is not None else []):
        if impl.plugin is plugin:
            return impl
    return None


def _call_own(bt, hook_name: str, **kwargs):
    """Call this backend's plugin's own implementation of a hook (not the first answer of any plugin)."""
    impl = _own_impl(bt, hook_name)
    if impl is None:
        pytest.fail(f"plugin '{bt.plugins.backend_plugin[bt.name]}' of backend '{bt.name}' does not implement "
                    f"{hook_name}", pytrace=False)
    return impl.function(**{a: kwargs[a] for a in impl.argnames})


# ---- hooks: the answers are well formed ----------------------------------------------------------------------------

def test_hooks_backend_is_well_formed(strata_backend):
    """The Backend object: its name, a vendor, an api version of the core's major, and provided exactly once."""
    b = strata_backend.backend
    assert isinstance(b, Backend)
    assert b.name == strata_backend.name
    assert isinstance(b.vendor, str) and b.vendor, "a backend names its vendor"
    assert str(b.api_version).split(".")[0] == API_VERSION.split(".")[0]
    provided = _call_own(strata_backend, "strata_backends") or []
    assert [x.name for x in provided].count(b.name) == 1, "strata_backends lists the backend exactly once"


def test_hooks_probe_never_raises_and_is_stable(strata_backend):
    """Probing twice (the Backend's probe, and the strata_probe hook where it still exists) gives the same answer."""
    bt = strata_backend
    answers = [bt.backend.probe(), bt.backend.probe()]
    if _own_impl(bt, "strata_probe") is not None:
        answers += [r for r in (_call_own(bt, "strata_probe", backend=bt.backend) for _ in range(2)) if r is not None]
    for r in answers:
        assert isinstance(r, ProbeResult), f"probe returned {type(r).__name__}"
        assert r.available, f"probe changed its mind: {r.reason}"
        assert isinstance(r.score, int)
        assert r.devices, "an available backend lists at least one device"
        for d in r.devices:
            info = info_of(d)
            assert isinstance(info, DeviceInfo), f"a device entry's facts are a {type(info).__name__}"
            assert info.backend == bt.name, f"device '{info.name}' says backend '{info.backend}'"
            assert 0 <= info.vram_free_bytes <= info.vram_total_bytes
        assert len({info_of(d).index for d in r.devices}) == len(r.devices), "device indices are unique"
    seen = {(r.available, tuple((info_of(d).backend, info_of(d).name, info_of(d).index, info_of(d).vram_total_bytes)
                                for d in r.devices)) for r in answers}
    assert len(seen) == 1, f"repeated probes disagree: {seen}"


def test_hooks_platform_defaults_for_own_device(strata_backend):
    """The device's platform defaults (Device.platform_defaults, or the 1.x hook) are PlatformDefaults with sane values."""
    bt = strata_backend
    pd = platform_defaults(bt.plugins, bt.device, bt.host_info)
    assert isinstance(pd, PlatformDefaults), f"got {type(pd).__name__}"
    assert pd.chunk_grid_tokens > 0 and pd.chunk_ceiling_tokens >= pd.chunk_grid_tokens
    assert pd.chunk_ceiling_tokens % pd.chunk_grid_tokens == 0, "the ceiling lies on the chunk grid"
    assert 0 < pd.lend_fraction <= 1 and 0 < pd.free_vram_trust <= 1
    assert pd.min_keep_slots >= 0 and pd.vram_reserve_mib >= 0 and pd.pin_floor_bytes >= 0
    assert pd.pin_cap_bytes is None or pd.pin_cap_bytes >= 0, "a pin cap is bytes (0: nothing can be page-locked)"
    for chunk in (pd.chunk_grid_tokens, pd.chunk_ceiling_tokens):
        assert pd.ring_slots(chunk, 8 * MIB, 1.0) > 0, f"the ring policy gives no slot at chunk {chunk}"
    json.dumps(pd.to_json())


def test_hooks_answer_for_own_device(strata_backend, strata_session):
    """The device opens: DeviceMemory, a named KernelSet with a valid precision declaration, a pinned allocator."""
    s = strata_session
    assert isinstance(s.memory, DeviceMemory), f"the session's memory is a {type(s.memory).__name__}"
    assert isinstance(s.kernels, KernelSet), f"the session's kernels are a {type(s.kernels).__name__}"
    assert isinstance(s.kernels.name, str) and s.kernels.name
    for name in protocol_kernels():
        assert precision_of(s.kernels, name) in BOUNDS
    if s.layer_ops is not None:
        assert isinstance(s.layer_ops, LayerOps), f"the session's layer ops are a {type(s.layer_ops).__name__}"
    alloc, budget = s.pinned(MIB, 0)
    assert alloc is not None, "the device offers no pinned allocator"
    assert isinstance(alloc.kind, str) and alloc.kind
    for method in ("alloc", "register", "free"):
        assert callable(getattr(alloc, method, None)), f"the pinned allocator has no {method}()"


def test_hooks_ignore_a_device_of_another_backend(strata_backend):
    """Every per-device hook the plugin still implements answers None for a device (or backend) not its own."""
    bt = strata_backend
    foreign = Backend(name=FOREIGN_DEVICE.backend, vendor="nobody", api_version=API_VERSION,
                      probe=lambda: ProbeResult.unavailable("foreign"))
    calls = {
        "strata_platform_defaults": dict(device=FOREIGN_DEVICE, host=bt.host_info),
        "strata_device_memory": dict(device=FOREIGN_DEVICE),
        "strata_kernels": dict(device=FOREIGN_DEVICE),
        "strata_pinned_allocator": dict(device=FOREIGN_DEVICE, budget=PinnedBudget(MIB)),
        "strata_probe": dict(backend=foreign),
    }
    answers = {h: _call_own(bt, h, **kw) for h, kw in calls.items() if _own_impl(bt, h) is not None}
    answered = {h: type(r).__name__ for h, r in answers.items() if r is not None}
    assert not answered, f"answered for a device of another backend: {answered}"
    if is_device_object(bt.device) and not declared_hooks(bt.plugins):
        assert not answers, "API 2.0 broadcasts no per-device question"


# ---- alloc: allocators fail softly ---------------------------------------------------------------------------------

def test_alloc_pinned_zero_budget_returns_none(strata_session):
    """With a budget of 0 bytes, alloc and register return None (never raise) and charge nothing."""
    a, budget = strata_session.pinned(0, 0)
    host = np.zeros(MIB, dtype=np.uint8)
    for from_floor in (False, True):
        assert a.alloc(MIB, from_floor=from_floor) is None
        assert a.register(host, from_floor=from_floor) is None
    assert budget.used_bytes == 0


def test_alloc_pinned_budget_accounting(strata_session):
    """Whatever an allocator hands out is charged to the budget, usable, and given back once on free."""
    a, budget = strata_session.pinned(8 * MIB, 2 * MIB)
    assert a.alloc(7 * MIB) is None, "the arena may not eat into the floor"
    assert budget.used_bytes == 0
    buf = a.alloc(MIB)
    if buf is None:
        assert budget.used_bytes == 0, "a refused allocation charged the budget"
    else:
        assert budget.used_bytes == MIB and buf.nbytes == MIB
        view = np.asarray(buf.array).reshape(-1).view(np.uint8)
        assert view.nbytes >= MIB
        view[:MIB] = np.arange(MIB, dtype=np.uint64).astype(np.uint8)
        assert np.array_equal(view[:MIB], np.arange(MIB, dtype=np.uint64).astype(np.uint8))
        a.free(buf)
        a.free(buf)
        assert budget.used_bytes == 0, "free gives the bytes back exactly once"
    host = np.arange(MIB // 4, dtype=np.float32)
    reg = a.register(host, from_floor=True)
    if reg is None:
        assert budget.used_bytes == 0
    else:
        assert budget.used_bytes == host.nbytes
        a.free(reg)
        assert budget.used_bytes == 0
    assert np.array_equal(host, np.arange(MIB // 4, dtype=np.float32)), "registering changed the data"


def test_alloc_pinned_refused_by_the_platform_returns_none(strata_session):
    """A budget that allows 1 PiB of page-locked memory, which no host has: alloc returns None and charges nothing."""
    a, budget = strata_session.pinned(2 * ABSURD_DEVICE_BYTES, 0)
    assert a.alloc(ABSURD_DEVICE_BYTES) is None
    assert budget.used_bytes == 0, "a refused allocation kept its bytes in the budget"


def test_alloc_absurd_device_alloc_returns_none(strata_session):
    """A 1 PiB device allocation returns None, without an exception."""
    mem = strata_session.memory
    assert mem.alloc((ABSURD_DEVICE_BYTES,), np.uint8) is None
    assert mem.alloc((ABSURD_DEVICE_BYTES // 4,), np.float32) is None


# ---- memory: data survives the trip ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float16", "int32", "int8"])
def test_memory_round_trip(strata_session, dtype):
    """to_device then download, and alloc, upload, download, give back the same random data."""
    rng, seed = _rng()
    mem = strata_session.memory
    x = (rng.standard_normal((37, 53)) * 50).astype(dtype)
    back = mem.download(mem.to_device(x))
    assert back.shape == x.shape and back.dtype == x.dtype and np.array_equal(back, x), f"seed {seed}"
    dst = mem.alloc(x.shape, x.dtype)
    assert dst is not None, "a small device allocation failed"
    y = (rng.standard_normal(x.shape) * 50).astype(dtype)
    mem.upload(dst, y)
    assert np.array_equal(mem.download(dst), y), f"upload then download (seed {seed})"
    mem.free(dst)


def test_memory_streams_and_events(strata_session):
    """An upload on a stream, an event recorded after it and waited on by another stream, then synchronize."""
    rng, seed = _rng()
    mem = strata_session.memory
    x = rng.standard_normal((64, 32)).astype(np.float32)
    dst = mem.alloc(x.shape, x.dtype)
    assert dst is not None
    copy, compute = mem.new_stream(), mem.new_stream()
    done = mem.new_event()
    mem.upload(dst, x, stream=copy)
    mem.record(done, copy)
    mem.wait(compute, done)
    mem.synchronize(compute)
    mem.synchronize()
    assert np.array_equal(mem.download(dst, stream=compute), x), f"seed {seed}"
    mem.free(dst)


def test_memory_info(strata_session):
    """mem_info gives (free, total) bytes as ints with 0 <= free <= total."""
    free_bytes, total_bytes = strata_session.memory.mem_info()
    assert int(free_bytes) == free_bytes and int(total_bytes) == total_bytes
    assert 0 <= free_bytes <= total_bytes and total_bytes > 0


# ---- kernels: match the float64 reference at the bound of their precision path -------------------------------------

def is_reference(kernels) -> bool:
    """True when the kernels under test are the numpy reference itself (sim), or say they give its bits (the cpu
    backend's HostKernels): their lane is the reference."""
    return type(kernels) is ReferenceKernels or getattr(type(kernels), "same_bits_as_reference", False) is True


def _kernel_test(kernel: str):
    """The test of one kernel of the protocol: its checks in strata_core.testing.checks, one per variant.

    Each records the junit property `strata_reference` ("1" when the kernels are the numpy reference, which the
    matrix then shows as the reference rather than as passed) and `strata_precision` (the path it was held to).
    """
    checks = {c.variant: c for c in CHECKS.get(kernel, [])}

    def run(strata_backend, strata_session, request, variant: str) -> None:
        # junit properties without the record_property fixture, which warns under the default xunit2 family
        request.node.user_properties.append((REFERENCE_PROPERTY, "1" if is_reference(strata_session.kernels) else "0"))
        request.node.user_properties.append(("strata_precision", precision_of(strata_session.kernels, kernel)))
        if variant not in checks:
            pytest.fail(f"the kit has no check of kernel {kernel!r} (strata_core.testing.checks.CHECKS)",
                        pytrace=False)
        advertised = set(strata_backend.info.caps.expert_formats)
        missing = sorted(set(checks[variant].formats) - advertised)
        if missing:
            pytest.skip(f"the device does not advertise expert format {', '.join(missing)} "
                        f"(DeviceCaps.expert_formats: {', '.join(sorted(advertised))}); the runtime never runs it")
        rng, seed = _rng()
        checks[variant].run(strata_session.memory, strata_session.kernels, rng, seed)

    if set(checks) in ({""}, set()):
        def test(strata_backend, strata_session, request):
            run(strata_backend, strata_session, request, "")
    else:
        @pytest.mark.parametrize("variant", list(checks))
        def test(strata_backend, strata_session, request, variant):
            run(strata_backend, strata_session, request, variant)
    test.__name__ = f"test_kernel_{kernel}"
    test.__doc__ = f"{kernel} matches the float64 reference within the bound of its declared precision path."
    return test


for _kernel in protocol_kernels():
    globals()[f"test_kernel_{_kernel}"] = _kernel_test(_kernel)
del _kernel


# ---- run: the whole engine on the backend ----------------------------------------------------------------------------

def _strata_run(name: str, *extra: str) -> dict:
    """`strata run --backend NAME --check --json [extra]` in a subprocess: its strata.run/1 object (exit 0 asserted)."""
    cmd = [sys.executable, "-m", "strata_core.cli", "run", "--backend", name, "--check", "--json", *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_CHECK_LIMIT_S)
    assert p.returncode == 0, f"{' '.join(cmd[2:])} exited {p.returncode}: {p.stderr.strip()[-2000:]}"
    try:
        out = json.loads(p.stdout)
    except json.JSONDecodeError as e:
        pytest.fail(f"--json printed something that is not one JSON object ({e}): {p.stdout[:500]!r}", pytrace=False)
    assert out.get("schema") == "strata.run/1", f"schema {out.get('schema')!r}"
    assert out.get("backend") == name
    return out


def test_run_check_tiny_model(strata_backend):
    """`strata run --backend NAME --check --json` plans, runs the tiny model and passes its check at the bound of
    the backend's precision path, which it reports."""
    out = _strata_run(strata_backend.name)
    assert out.get("check") == "passed", f"check {out.get('check')!r}: {(out.get('check_report') or {}).get('failures')}"
    rep = out["check_report"]
    assert rep["precision"] in BOUNDS and rep["tolerance"] == bound_of(rep["precision"]), rep
    assert rep["worst_rel_err"] <= rep["tolerance"]


def test_run_outputs_are_reproducible(strata_backend):
    """Two runs with the same inputs give the same outputs_sha256 (every layer output and token, bit for bit)."""
    extra = ("--prompt-tokens", str(REPRO_PROMPT_TOKENS), "--decode-tokens", str(REPRO_DECODE_TOKENS))
    first, second = (_strata_run(strata_backend.name, *extra) for _ in range(2))
    for out in (first, second):
        assert isinstance(out.get("outputs_sha256"), str) and len(out["outputs_sha256"]) == 64, out.get("outputs_sha256")
    assert first["outputs_sha256"] == second["outputs_sha256"], (
        f"the same inputs gave other bits: {first['outputs_sha256'][:16]} vs {second['outputs_sha256'][:16]}")


__all__ = [n for n in list(globals()) if n.startswith("test_")]
