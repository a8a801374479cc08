"""The backend conformance suite: plain pytest tests of one backend, reached only through hooks.

Use it from a test module of your plugin:

    STRATA_CONFORMANCE_BACKENDS = ["mybackend"]   # optional; `pytest --strata-backend NAME|all` overrides it
    from strata_core.testing.conformance import *

Every test takes the `strata_backend` fixture (see `strata_core.testing.plugin`). The suite is vendor-neutral: it
moves data only with `DeviceMemory.to_device`/`upload`/`download` and calls kernels on the device arrays the
backend returns. Test names carry their suite: `test_hooks_*`, `test_alloc_*`, `test_memory_*`, `test_kernel_*`,
`test_run_*`. Inputs are fresh random data each run; a failure message carries the seed to replay it.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys

import numpy as np
import pytest

from strata_core.api import API_VERSION
from strata_core.api.backend import Backend, DeviceMemory, KernelSet, PinnedBudget, ProbeResult
from strata_core.api.facts import DeviceInfo, PlatformDefaults
from strata_core.reference import kernels as ref
from strata_core.reference.kernels import ExpertPool, relative_error

#: Bounds against the numpy reference: fp32 paths, and paths with fp16 weights or outputs.
FP32_REL_ERR = 1e-5
FP16_REL_ERR = 2e-3
#: A device allocation no device has room for (1 PiB).
ABSURD_DEVICE_BYTES = 1 << 50
#: Wall-clock limit of the `strata run --check` subprocess, seconds (a limit against hangs, not a timing).
RUN_CHECK_LIMIT_S = 600
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
    for impl in getattr(bt.plugins.hook, hook_name).get_hookimpls():
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


def _memory(bt) -> DeviceMemory:
    """The DeviceMemory the runtime would get for this backend's device."""
    mem = bt.plugins.hook.strata_device_memory(device=bt.device)
    assert mem is not None, f"no plugin answered strata_device_memory for a '{bt.name}' device"
    return mem


def _kernels(bt) -> KernelSet:
    """The KernelSet the runtime would get for this backend's device."""
    k = bt.plugins.hook.strata_kernels(device=bt.device)
    assert k is not None, f"no plugin answered strata_kernels for a '{bt.name}' device"
    return k


def _pinned(bt, budget: PinnedBudget):
    """The PinnedAllocator the runtime would get for this backend's device."""
    a = bt.plugins.hook.strata_pinned_allocator(device=bt.device, budget=budget)
    assert a is not None, f"no plugin answered strata_pinned_allocator for a '{bt.name}' device"
    return a


def _poison(mem: DeviceMemory, shape: tuple[int, ...], dtype) -> None:
    """Leave NaN (or -1) in freed device memory of an output's size, so a kernel that skips writes shows it."""
    fill = np.nan if np.issubdtype(np.dtype(dtype), np.floating) else -1
    arr = mem.to_device(np.full(shape, fill, dtype=dtype))
    mem.free(arr)


def _close(name: str, out: np.ndarray, want: np.ndarray, bound: float, seed: int) -> None:
    """Assert shape, dtype and relative error against the reference."""
    assert out.shape == want.shape, f"{name}: shape {out.shape}, the reference gives {want.shape} (seed {seed})"
    assert out.dtype == want.dtype, f"{name}: dtype {out.dtype}, the contract says {want.dtype} (seed {seed})"
    err = relative_error(out, want)
    assert err < bound, f"{name}: relative error {err:.3g} >= {bound:g} against the reference (seed {seed})"


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
    """Probing twice (the Backend's probe and the strata_probe hook) returns the same well-formed answer."""
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
            assert isinstance(d, DeviceInfo)
            assert d.backend == bt.name, f"device '{d.name}' says backend '{d.backend}'"
            assert 0 <= d.vram_free_bytes <= d.vram_total_bytes
        assert len({d.index for d in r.devices}) == len(r.devices), "device indices are unique"
    seen = {(r.available, tuple((d.backend, d.name, d.index, d.vram_total_bytes) for d in r.devices)) for r in answers}
    assert len(seen) == 1, f"repeated probes disagree: {seen}"


def test_hooks_platform_defaults_for_own_device(strata_backend):
    """strata_platform_defaults answers PlatformDefaults with sane values for the backend's own device."""
    bt = strata_backend
    pd = _call_own(bt, "strata_platform_defaults", device=bt.device, host=bt.host_info)
    assert isinstance(pd, PlatformDefaults), f"got {type(pd).__name__}"
    assert pd.chunk_grid_tokens > 0 and pd.chunk_ceiling_tokens >= pd.chunk_grid_tokens
    assert pd.chunk_ceiling_tokens % pd.chunk_grid_tokens == 0, "the ceiling lies on the chunk grid"
    assert 0 < pd.lend_fraction <= 1 and 0 < pd.free_vram_trust <= 1
    assert pd.min_keep_slots >= 0 and pd.vram_reserve_mib >= 0 and pd.pin_floor_bytes >= 0
    assert pd.pin_cap_bytes is None or pd.pin_cap_bytes >= 0, "a pin cap is bytes (0: nothing can be page-locked)"
    for chunk in (pd.chunk_grid_tokens, pd.chunk_ceiling_tokens):
        assert pd.ring_slots(chunk, 8 * MIB, 1.0) > 0, f"the ring policy gives no slot at chunk {chunk}"
    json.dumps(pd.to_json())


def test_hooks_answer_for_own_device(strata_backend):
    """strata_device_memory, strata_kernels and strata_pinned_allocator answer for the backend's own device."""
    bt = strata_backend
    mem = _call_own(bt, "strata_device_memory", device=bt.device)
    assert isinstance(mem, DeviceMemory), f"strata_device_memory gave {type(mem).__name__}"
    kernels = _call_own(bt, "strata_kernels", device=bt.device)
    assert isinstance(kernels, KernelSet), f"strata_kernels gave {type(kernels).__name__}"
    assert isinstance(kernels.name, str) and kernels.name
    alloc = _call_own(bt, "strata_pinned_allocator", device=bt.device, budget=PinnedBudget(MIB))
    assert alloc is not None, "strata_pinned_allocator gave None for the backend's own device"
    assert isinstance(alloc.kind, str) and alloc.kind
    for method in ("alloc", "register", "free"):
        assert callable(getattr(alloc, method, None)), f"the pinned allocator has no {method}()"


def test_hooks_ignore_a_device_of_another_backend(strata_backend):
    """Every device hook of the plugin answers None for a device (or backend) that is not its own."""
    bt = strata_backend
    foreign = Backend(name=FOREIGN_DEVICE.backend, vendor="nobody", probe=lambda: ProbeResult.unavailable("foreign"))
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


# ---- alloc: allocators fail softly ---------------------------------------------------------------------------------

def test_alloc_pinned_zero_budget_returns_none(strata_backend):
    """With a budget of 0 bytes, alloc and register return None (never raise) and charge nothing."""
    budget = PinnedBudget(0)
    a = _pinned(strata_backend, budget)
    host = np.zeros(MIB, dtype=np.uint8)
    for from_floor in (False, True):
        assert a.alloc(MIB, from_floor=from_floor) is None
        assert a.register(host, from_floor=from_floor) is None
    assert budget.used_bytes == 0


def test_alloc_pinned_budget_accounting(strata_backend):
    """Whatever an allocator hands out is charged to the budget, usable, and given back once on free."""
    budget = PinnedBudget(8 * MIB, floor_bytes=2 * MIB)
    a = _pinned(strata_backend, budget)
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


def test_alloc_pinned_refused_by_the_platform_returns_none(strata_backend):
    """A budget that allows 1 PiB of page-locked memory, which no host has: alloc returns None and charges nothing."""
    budget = PinnedBudget(2 * ABSURD_DEVICE_BYTES)
    a = _pinned(strata_backend, budget)
    assert a.alloc(ABSURD_DEVICE_BYTES) is None
    assert budget.used_bytes == 0, "a refused allocation kept its bytes in the budget"


def test_alloc_absurd_device_alloc_returns_none(strata_backend):
    """A 1 PiB device allocation returns None, without an exception."""
    mem = _memory(strata_backend)
    assert mem.alloc((ABSURD_DEVICE_BYTES,), np.uint8) is None
    assert mem.alloc((ABSURD_DEVICE_BYTES // 4,), np.float32) is None


# ---- memory: data survives the trip ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float16", "int32", "int8"])
def test_memory_round_trip(strata_backend, dtype):
    """to_device then download, and alloc, upload, download, give back the same random data."""
    rng, seed = _rng()
    mem = _memory(strata_backend)
    x = (rng.standard_normal((37, 53)) * 50).astype(dtype)
    back = mem.download(mem.to_device(x))
    assert back.shape == x.shape and back.dtype == x.dtype and np.array_equal(back, x), f"seed {seed}"
    dst = mem.alloc(x.shape, x.dtype)
    assert dst is not None, "a small device allocation failed"
    y = (rng.standard_normal(x.shape) * 50).astype(dtype)
    mem.upload(dst, y)
    assert np.array_equal(mem.download(dst), y), f"upload then download (seed {seed})"
    mem.free(dst)


def test_memory_streams_and_events(strata_backend):
    """An upload on a stream, an event recorded after it and waited on by another stream, then synchronize."""
    rng, seed = _rng()
    mem = _memory(strata_backend)
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


def test_memory_info(strata_backend):
    """mem_info gives (free, total) bytes as ints with 0 <= free <= total."""
    free_bytes, total_bytes = _memory(strata_backend).mem_info()
    assert int(free_bytes) == free_bytes and int(total_bytes) == total_bytes
    assert 0 <= free_bytes <= total_bytes and total_bytes > 0


# ---- kernels: match the reference ------------------------------------------------------------------------------------

def test_kernel_route_topk(strata_backend):
    """Top-k ids equal the reference's; the softmax weights match within the fp32 bound."""
    rng, seed = _rng()
    mem, k = _memory(strata_backend), _kernels(strata_backend)
    logits = rng.standard_normal((37, 16)).astype(np.float32)
    want_ids, want_w = ref.route_topk(logits, 4)
    _poison(mem, want_ids.shape, np.int32)
    _poison(mem, want_w.shape, np.float32)
    ids, w = k.route_topk(mem.to_device(logits), 4)
    ids, w = mem.download(ids), mem.download(w)
    assert ids.shape == want_ids.shape and ids.dtype == np.int32, f"ids {ids.shape} {ids.dtype}"
    assert np.array_equal(ids, want_ids), f"top-k ids differ from the reference (seed {seed})"
    _close("route_topk weights", w, want_w, FP32_REL_ERR, seed)


def test_kernel_gather(strata_backend):
    """gather picks exactly the reference's rows, repeats included."""
    rng, seed = _rng()
    mem, k = _memory(strata_backend), _kernels(strata_backend)
    x = rng.standard_normal((37, 64)).astype(np.float32)
    rows = rng.integers(0, 37, size=50).astype(np.int32)
    want = ref.gather(x, rows)
    _poison(mem, want.shape, np.float32)
    out = mem.download(k.gather(mem.to_device(x), mem.to_device(rows)))
    assert out.shape == want.shape and out.dtype == want.dtype and np.array_equal(out, want), f"seed {seed}"


def test_kernel_scatter_add(strata_backend):
    """scatter_add adds (never overwrites) into a non-zero output, duplicate rows included."""
    rng, seed = _rng()
    mem, k = _memory(strata_backend), _kernels(strata_backend)
    want = rng.standard_normal((37, 64)).astype(np.float32)
    rows = np.concatenate([rng.integers(0, 37, size=40), [5, 5, 5]]).astype(np.int32)
    y = rng.standard_normal((rows.size, 64)).astype(np.float32)
    scale = rng.random(rows.size).astype(np.float32)
    out = mem.to_device(want)
    k.scatter_add(out, mem.to_device(rows), mem.to_device(y), mem.to_device(scale))
    ref.scatter_add(want, rows, y, scale)
    _close("scatter_add", mem.download(out), want, FP32_REL_ERR, seed)


def test_kernel_rmsnorm(strata_backend):
    """rmsnorm matches the reference within the fp32 bound."""
    rng, seed = _rng()
    mem, k = _memory(strata_backend), _kernels(strata_backend)
    x = (rng.standard_normal((37, 128)) * 3).astype(np.float32)
    w = rng.standard_normal(128).astype(np.float32)
    want = ref.rmsnorm(x, w, 1e-6)
    _poison(mem, want.shape, np.float32)
    _close("rmsnorm", mem.download(k.rmsnorm(mem.to_device(x), mem.to_device(w), 1e-6)), want, FP32_REL_ERR, seed)


@pytest.mark.parametrize("wdtype,bound", [("float32", FP32_REL_ERR), ("float16", FP16_REL_ERR)], ids=["f32", "f16"])
def test_kernel_linear(strata_backend, wdtype, bound):
    """linear with f32 and f16 weights matches the reference."""
    rng, seed = _rng()
    mem, k = _memory(strata_backend), _kernels(strata_backend)
    x = rng.standard_normal((37, 128)).astype(np.float32)
    w = (rng.standard_normal((96, 128)) * 0.1).astype(wdtype)
    want = ref.linear(x, w)
    _poison(mem, want.shape, np.float32)
    _close(f"linear ({wdtype} weights)", mem.download(k.linear(mem.to_device(x), mem.to_device(w))), want, bound, seed)


def test_kernel_dequantize_q8_0(strata_backend):
    """Q8_0 blocks dequantize to the reference's f16 values."""
    rng, seed = _rng()
    mem, k = _memory(strata_backend), _kernels(strata_backend)
    qs, d = ref.quantize_q8_0(rng.standard_normal((48, 256)).astype(np.float32))
    want = ref.dequantize_q8_0(qs, d)
    _poison(mem, want.shape, np.float16)
    out = mem.download(k.dequantize_q8_0(mem.to_device(qs), mem.to_device(d)))
    _close("dequantize_q8_0", out, want, FP16_REL_ERR, seed)


def _expert_pool(rng, dtype: str, slots: int, hidden: int, ffn: int) -> ExpertPool:
    """A host ExpertPool of random SwiGLU experts in `dtype`."""
    gate_up = (rng.standard_normal((slots, 2 * ffn, hidden)) / np.sqrt(hidden)).astype(np.float32)
    down = (rng.standard_normal((slots, hidden, ffn)) / np.sqrt(ffn)).astype(np.float32)
    if dtype == "f16":
        return ExpertPool("f16", {"w_gate_up": gate_up.astype(np.float16), "w_down": down.astype(np.float16)})
    guq, gud = ref.quantize_q8_0(gate_up)
    dq, dd = ref.quantize_q8_0(down)
    return ExpertPool("q8_0", {"gate_up_q": guq, "gate_up_d": gud, "down_q": dq, "down_d": dd})


@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
def test_kernel_moe_grouped_ffn(strata_backend, dtype):
    """SwiGLU experts over token groups (an empty group, a slot used twice) match the reference."""
    rng, seed = _rng()
    mem, k = _memory(strata_backend), _kernels(strata_backend)
    hidden, ffn, slots = 128, 96, 5
    host_pool = _expert_pool(rng, dtype, slots, hidden, ffn)
    sizes = np.array([7, 0, 12, 1, 9, 4])
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    group_slots = np.array([3, 1, 0, 4, 3, 2], dtype=np.int32)
    x = rng.standard_normal((int(offsets[-1]), hidden)).astype(np.float32)
    want = ref.moe_grouped_ffn(x, offsets, group_slots, host_pool)
    dev_pool = ExpertPool(dtype, {n: mem.to_device(a) for n, a in host_pool.arrays.items()})
    _poison(mem, want.shape, np.float32)
    out = k.moe_grouped_ffn(mem.to_device(x), mem.to_device(offsets), mem.to_device(group_slots), dev_pool)
    _close(f"moe_grouped_ffn ({dtype})", mem.download(out), want, FP16_REL_ERR, seed)


# ---- run: the whole engine on the backend ----------------------------------------------------------------------------

def test_run_check_tiny_model(strata_backend):
    """`strata run --backend NAME --check --json` plans, runs the tiny model and passes its check."""
    name = strata_backend.name
    cmd = [sys.executable, "-m", "strata_core.cli", "run", "--backend", name, "--check", "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_CHECK_LIMIT_S)
    assert p.returncode == 0, f"{' '.join(cmd[2:])} exited {p.returncode}: {p.stderr.strip()[-2000:]}"
    try:
        out = json.loads(p.stdout)
    except json.JSONDecodeError as e:
        pytest.fail(f"--json printed something that is not one JSON object ({e}): {p.stdout[:500]!r}", pytrace=False)
    assert out.get("schema") == "strata.run/1", f"schema {out.get('schema')!r}"
    assert out.get("backend") == name
    assert out.get("check") == "passed", f"check {out.get('check')!r}"


__all__ = [n for n in list(globals()) if n.startswith("test_")]
