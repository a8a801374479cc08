"""Measured backend speed: one decode layer of the tiny model timed on a backend's device, cached per machine.

`strata run` with `backend.name = auto` takes the highest probe score; where that backend computes on the host CPU
and other available backends do too, the registry asks this module which of them runs a decode layer fastest, since
a probe score cannot know it (on a CPU-only machine the SYCL and OpenCL runtimes scored above numpy and decoded 3-4x
slower). The layer is the composed decode path's kernel sequence for one token: rmsnorm, router linear, top-k, the
ids to the host and the groups back, gather, the grouped FFN over top_k cached experts, scatter_add, synchronise.
Its time per layer (the median of `TIMED_LAYERS` layers after `WARM_LAYERS`, timers around the calls, synchronised)
is kept in `calibration.json` under the user's cache folder (`strata_core.config.user_cache_dir`), keyed by backend,
its version, the device, the host CPU and the Strata version: it is measured once per machine, not per run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from strata_core import __version__

SCHEMA = "strata.calibration/1"
#: Bumped when the measured layer changes, so older figures are measured again.
CALIBRATION_VERSION = 1
WARM_LAYERS = 3
TIMED_LAYERS = 25
#: A backend slower than this per layer stops early (its figure is the median of what it ran).
MAX_TIMED_S = 0.5
CACHE_FILE = "calibration.json"
#: A measured 'auto' choice is reused without probing the other backends for this long (a runtime installed or a
#: driver fixed meanwhile is seen after it, or at once by `strata backends`, which always probes every backend).
SELECTION_TTL_S = 24 * 3600


def cache_path(folder: Path | None = None) -> Path:
    """The calibration file: `folder` / calibration.json, by default under the user's cache folder."""
    if folder is None:
        from strata_core.config import user_cache_dir
        folder = user_cache_dir()
    return Path(folder) / CACHE_FILE


def cache_key(backend: Any, probe: Any, device: Any, host: Any) -> str:
    """What a figure depends on: backend and version, device, host CPU, Strata and the calibration's version."""
    info = device.info
    cpu = getattr(getattr(host, "cpu", None), "name", "") or ""
    return "|".join([backend.name, str(getattr(probe, "version", "") or backend.version), info.name, str(info.index),
                     cpu, __version__, f"v{CALIBRATION_VERSION}"])


def load(path: Path) -> dict[str, dict]:
    """The cached entries (key -> figure); empty when the file is missing or unreadable."""
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(d, dict) or d.get("schema") != SCHEMA or not isinstance(d.get("entries"), dict):
        return {}
    return d["entries"]


def save(path: Path, entries: dict[str, dict]) -> str | None:
    """Write the entries; None, or why the file could not be written (the selection still stands)."""
    try:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        try:
            kept = json.loads(path.read_text()).get("selections") or {}
        except (OSError, ValueError, AttributeError):
            kept = {}
        tmp.write_text(json.dumps({"schema": SCHEMA, "entries": entries, "selections": kept}, indent=2,
                                  sort_keys=True) + "\n")
        tmp.replace(path)
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None


def selection_key(installed: list[str], device_index: int) -> str:
    """The key of a remembered 'auto' choice: the installed backends, the device index, host CPU, Strata."""
    from strata_core.hostinfo import probe_host
    cpu = getattr(getattr(probe_host(), "cpu", None), "name", "") or ""
    return "|".join([",".join(installed), str(int(device_index)), cpu, __version__, f"v{CALIBRATION_VERSION}"])


def load_selection(path: Path, key: str, now_s: float | None = None) -> dict | None:
    """The 'auto' choice remembered under this key, if younger than SELECTION_TTL_S; else None."""
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    got = (d.get("selections") or {}).get(key) if isinstance(d, dict) and d.get("schema") == SCHEMA else None
    now = time.time() if now_s is None else now_s
    if not isinstance(got, dict) or not (0 <= now - float(got.get("decided_at_s", -1e18)) < SELECTION_TTL_S):
        return None
    return got


def save_selection(path: Path, key: str, selection: dict) -> str | None:
    """Remember an 'auto' choice (with the figures it was made from) under this key; None, or why not."""
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        d = {}
    if not isinstance(d, dict) or d.get("schema") != SCHEMA:
        d = {"schema": SCHEMA, "entries": {}}
    d.setdefault("selections", {})[key] = {**selection, "decided_at_s": time.time(),
                                           "decided_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(path).with_suffix(".tmp")
        tmp.write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")
        tmp.replace(path)
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None


def _tiny_plan(plugins: Any, backend: Any, device: Any, host: Any) -> Any:
    """A plan of the built-in tiny model on this device (core defaults), to open a session with."""
    from strata_core.api.target import Target
    from strata_core.config import settings_from_partial
    from strata_core.models.synthetic import tiny_cache_slots, tiny_model_spec
    from strata_core.planner import plan_for_machine
    spec = tiny_model_spec()
    settings = settings_from_partial({"backend": {"name": backend.name, "device": device.info.index},
                                      "memory": {"expert_cache": tiny_cache_slots(spec)}}, where="the calibration")
    target = Target(backend=backend, device=device, host=host, defaults=device.platform_defaults(host),
                    origin="the calibration")
    return plan_for_machine(plugins, target, spec, settings)


def measure_layer_us(plugins: Any, backend: Any, device: Any, host: Any) -> dict:
    """Open the device for the tiny model and time its decode layer: {"us_per_layer", "layers", "timed_s", ...}."""
    from strata_core.models.synthetic import TINY_EXPERTS, TINY_FFN, TINY_HIDDEN, TINY_TOP_K
    from strata_core.reference.kernels import ExpertPool
    H, F, E, K = TINY_HIDDEN, TINY_FFN, TINY_EXPERTS, TINY_TOP_K
    t_open = time.perf_counter()
    session = device.open(_tiny_plan(plugins, backend, device, host))
    try:
        m, kernels = session.memory, session.kernels
        k = _OutCalls(kernels)
        open_s = time.perf_counter() - t_open
        rng = np.random.default_rng(0)
        arrays = {}
        for name, (shape, dtype) in ExpertPool.array_specs("f16", K, H, F).items():
            a = m.alloc(shape, dtype)
            m.upload(a, (rng.standard_normal(shape) * 0.05).astype(dtype))
            arrays[name] = a
        pool = ExpertPool(dtype="f16", arrays=arrays)
        x = m.to_device(rng.standard_normal((1, H)).astype(np.float32))
        norm_w = m.to_device(np.ones(H, np.float32))
        router = m.to_device((rng.standard_normal((E, H)) * 0.1).astype(np.float32))
        xn, lg = m.alloc((1, H), np.float32), m.alloc((1, E), np.float32)
        ids, wts = m.alloc((1, K), np.int32), m.alloc((1, K), np.float32)
        xg, y = m.alloc((K, H), np.float32), m.alloc((K, H), np.float32)
        ints, scales = m.alloc((3 * K + 1,), np.int32), m.alloc((K,), np.float32)
        rows_d, offs_d, slots_d = ints[:K], ints[K:2 * K + 1], ints[2 * K + 1:]
        host_ints = np.zeros(3 * K + 1, np.int32)
        times: list[float] = []
        t_all = time.perf_counter()
        for i in range(WARM_LAYERS + TIMED_LAYERS):
            t0 = time.perf_counter()
            k.rmsnorm(x, norm_w, out=xn)
            k.linear(xn, router, out=lg)
            k.route_topk(lg, K, out=(ids, wts))
            e = np.asarray(m.download(ids)).reshape(-1)
            w = np.asarray(m.download(wts), dtype=np.float32).reshape(-1)
            order = np.argsort(e, kind="stable")
            host_ints[K:2 * K + 1] = np.arange(K + 1)
            host_ints[2 * K + 1:] = np.arange(K)  # every expert a hit, in slots 0..K-1
            m.upload(ints, host_ints)
            m.upload(scales, w[order])
            k.gather(xn, rows_d, out=xg)
            k.moe_grouped_ffn(xg, offs_d, slots_d, pool, out=y)
            k.scatter_add(x, rows_d, y, scales)
            m.synchronize()
            if i >= WARM_LAYERS:
                times.append(time.perf_counter() - t0)
                if time.perf_counter() - t_all > MAX_TIMED_S and len(times) >= 3:
                    break
        return {"us_per_layer": float(np.median(times)) * 1e6, "layers": len(times),
                "timed_s": float(sum(times)), "open_s": open_s,
                "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    finally:
        session.close()


class _OutCalls:
    """A KernelSet whose calls pass `out` only to the kernels that take it (a backend written before 2.0)."""

    def __init__(self, kernels: Any):
        import inspect
        self.k = kernels
        self.takes = {}
        for name in ("rmsnorm", "linear", "route_topk", "gather", "moe_grouped_ffn"):
            try:
                self.takes[name] = "out" in inspect.signature(getattr(kernels, name)).parameters
            except (TypeError, ValueError):
                self.takes[name] = False

    def __getattr__(self, name: str) -> Any:
        """The kernel, dropping `out` where it allocates its own result."""
        f = getattr(self.__dict__["k"], name)
        if self.__dict__["takes"].get(name, True):
            return f
        return lambda *a, out=None, **kw: f(*a, **kw)
