"""The NVIDIA probe: which CUDA devices there are, with their facts, and why not when there are none. Never raises.

Devices are enumerated through cupy's runtime (cudaGetDeviceCount and cudaGetDeviceProperties create no context,
and they honour the CUDA device order the process was given); the memory, display and driver-model facts come from
NVML (nvidia-ml-py), matched by PCI bus id, read before any CUDA context exists. Without NVML the probe falls back
to cudaMemGetInfo. Then the probe measures two facts of the driver with a context (`driver_memory_facts`, once per
process and device): its allocation granularity and the device bytes its page tables take per GiB of page-locked
host memory, which the plan makes lines of (strata_core.planner.driver_memory). They are kept in the user's cache
folder (DRIVER_FACTS_FILE), keyed by the card's bus id and name and the driver's version, so a later process (a
`strata backends`, a `strata plan`) reads them instead of making a context and page-locking 2 GiB again.

The helpers under "cupy probing" serve the rocm backend's probe too: cupy's runtime API is the same on its CUDA
and ROCm builds.
"""

from __future__ import annotations

import json
import os
import sys
import weakref
from pathlib import Path
from typing import Any, Callable

from strata_core.api import DeviceCaps, DeviceInfo, DeviceType, ProbeResult
from strata_core.api.facts import GIB

NAME = "cuda"


def install_line(extra: str, package_dir: Path) -> str:
    """How to install strata-core's `extra` from where the user stands: the checkout the package lives in, else PyPI.

    A source checkout is recognized by strata-core's own pyproject.toml two levels above the backend's package
    (backends/<name>/<package>); from inside that checkout the line says '.', from elsewhere the checkout's path.
    """
    root = package_dir.resolve().parents[2]
    try:
        is_checkout = 'name = "strata-core"' in (root / "pyproject.toml").read_text()
    except OSError:
        is_checkout = False
    if not is_checkout:
        return f"pip install 'strata-core[{extra}]'"
    try:
        here = Path.cwd().resolve() == root
    except OSError:  # the working directory was removed
        here = False
    return f"pip install -e '{'.' if here else root}[{extra}]'"


INSTALL_HINT = install_line("cuda", Path(__file__).parent)

#: A probe result's install line when the library is installed and the device is what is missing: none is shown.
NO_INSTALL_FIXES_IT = ""

#: A usable GPU outranks the cpu backend (10) and the sim backend (0); a larger card outranks a smaller one.
BASE_SCORE = 100

#: NVML's driver models (nvmlDriverModel_t) by value.
_NVML_DRIVER_MODELS = {0: "wddm", 1: "tcc", 2: "mcdm"}


def driver_model(os_name: str, wsl: bool) -> str:
    """The driver model of a GPU without a vendor query for it: WDDM on Windows, WSL2's paravirtualized WDDM, Linux."""
    if os_name == "windows":
        return "wddm"
    return "wsl2" if wsl else "linux"


def current_os() -> str:
    """This OS as DeviceInfo and HostInfo name it: 'windows', 'macos' or 'linux'."""
    return {"win32": "windows", "darwin": "macos"}.get(sys.platform, "linux")


def is_wsl() -> bool:
    """True under WSL2, whose GPU paravirtualization inherits WDDM's page-locked limits."""
    try:
        return "microsoft" in Path("/proc/version").read_text().lower()
    except OSError:
        return False


# --- cupy probing (shared with strata_rocm.probe) ---


def text(v: Any) -> str:
    """A runtime's answer as str (cupy gives names and bus ids as bytes)."""
    return v.decode(errors="replace") if isinstance(v, (bytes, bytearray)) else str(v)


def memory_info(runtime: Any, index: int) -> tuple[int, int]:
    """(free, total) VRAM bytes of device `index` through the runtime (memGetInfo needs the device current)."""
    prev = runtime.getDevice()
    runtime.setDevice(index)
    try:
        free, total = runtime.memGetInfo()
    finally:
        runtime.setDevice(prev)
    return int(free), int(total)


def probe_devices(runtime: Any, read: Callable[[int, int], DeviceInfo], *, label: str, no_device: str,
                  count_call: str, version: str = "") -> ProbeResult:
    """Count the runtime's devices and read each with `read(index, count)`; a reason instead of an exception.

    The devices of the result are DeviceInfo facts; the backend wraps them into its Device objects.
    """
    try:
        count = int(runtime.getDeviceCount())
    except Exception as e:
        return ProbeResult.unavailable(f"{no_device}: {e}", version=version, install_hint=NO_INSTALL_FIXES_IT)
    if count <= 0:
        return ProbeResult.unavailable(f"{no_device}: {count_call} found 0", version=version,
                                       install_hint=NO_INSTALL_FIXES_IT)
    try:
        devices = tuple(read(i, count) for i in range(count))
    except Exception as e:
        return ProbeResult.unavailable(f"{label} devices found but not readable: {type(e).__name__}: {e}",
                                       version=version, install_hint=NO_INSTALL_FIXES_IT)
    score = BASE_SCORE + max(d.vram_total_bytes for d in devices) // GIB
    names = ", ".join(f"{d.name} ({d.arch}, {d.vram_total_bytes / GIB:.0f} GiB)" for d in devices)
    return ProbeResult(available=True, reason=f"{count} {label} device(s): {names}", devices=devices,
                       score=int(score), version=version)


def peer_copies(runtime: Any, index: int, count: int) -> bool:
    """True when device `index` can copy directly to or from another device of the runtime (peer access)."""
    for j in range(count):
        if j == index:
            continue
        try:
            if int(runtime.deviceCanAccessPeer(index, j)):
                return True
        except Exception:  # a runtime (or a double) without the query: no peer copies are claimed
            return False
    return False


def probe_cupy(*, hip: bool, label: str, missing: Callable[[Exception], str], wrong_build: Callable[[str], str],
               run: Callable[[Any, str], ProbeResult]) -> ProbeResult:
    """Import cupy, check it is the wanted build (ROCm when `hip`) and probe through `run(runtime, cupy version)`.

    Importing cupy can fail in more ways than ImportError (cupy-rocm without ROCm's libraries raises OSError or
    RuntimeError from its extension modules): each is a reason, never a crash.
    """
    try:
        import cupy
        from cupy.cuda import runtime
    except Exception as e:
        return ProbeResult.unavailable(missing(e))
    try:
        if bool(runtime.is_hip) != hip:
            return ProbeResult.unavailable(wrong_build(cupy.__version__))
        return run(runtime, cupy.__version__)
    except Exception as e:  # the contract: a probe never raises
        return ProbeResult.unavailable(f"the {label} probe failed: {type(e).__name__}: {e}",
                                       install_hint=NO_INSTALL_FIXES_IT)


# --- the NVIDIA probe ---


def _load_nvml() -> Any | None:
    """pynvml, initialized, or None when nvidia-ml-py is missing or NVML cannot start (facts then come from cupy)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:
        return None
    return pynvml


def _nvml_facts(nvml: Any, bus_id: str, os_name: str) -> dict:
    """What NVML says about the card at `bus_id` (each fact on its own: a card may not support one query)."""
    out: dict = {}
    try:
        h = nvml.nvmlDeviceGetHandleByPciBusId(bus_id)
    except Exception:
        return out
    try:
        mem = nvml.nvmlDeviceGetMemoryInfo(h)
        out["vram_total_bytes"], out["vram_free_bytes"] = int(mem.total), int(mem.free)
    except Exception:
        pass
    try:
        out["name"] = text(nvml.nvmlDeviceGetName(h))
    except Exception:
        pass
    try:
        out["drives_display"] = bool(nvml.nvmlDeviceGetDisplayActive(h))
    except Exception:
        pass
    if os_name == "windows":
        try:
            current = nvml.nvmlDeviceGetDriverModel(h)[0]
            out["driver_model"] = _NVML_DRIVER_MODELS.get(int(current), "wddm")
        except Exception:
            pass
    return out


#: The probe's odd-sized allocation: the driver's delta above it, less one byte, is its allocation granularity.
GRANULARITY_PROBE_BYTES = (32 << 20) + 1
#: Page-locked GiB the probe takes one at a time: the largest device delta of one is the page tables' cost of a GiB.
PINNED_PROBE_GIB = 2
#: cudaHostAllocPortable: the pinned allocator's flag, so the probe maps memory as a run does.
_HOST_ALLOC_PORTABLE = 0x01

#: Measured facts by runtime (weakly: a test's double goes with its facts) and device index.
_DRIVER_FACTS: "weakref.WeakKeyDictionary[Any, dict[int, tuple[int, int]]]" = weakref.WeakKeyDictionary()


def _granularity(runtime: Any) -> int:
    """The driver's allocation granularity: an allocation of 32 MiB + 1 byte takes 32 MiB + one granule (the
    smaller of two tries, so a first allocation's own start-up cost does not count); 0 when the figure is not one."""
    deltas = []
    for _ in range(2):
        free0 = int(runtime.memGetInfo()[0])
        ptr = runtime.malloc(GRANULARITY_PROBE_BYTES)
        try:
            deltas.append(free0 - int(runtime.memGetInfo()[0]))
        finally:
            runtime.free(ptr)
    g = min(deltas) - (GRANULARITY_PROBE_BYTES - 1)
    return g if 0 < g <= GRANULARITY_PROBE_BYTES - 1 and g & (g - 1) == 0 else 0


def _pinned_map_per_gib(runtime: Any) -> int:
    """Device bytes the driver takes for one GiB of page-locked host memory: the largest memGetInfo delta of
    PINNED_PROBE_GIB page-locked GiB taken one after another (the first may fit page tables the context has)."""
    deltas, ptrs = [], []
    try:
        for _ in range(PINNED_PROBE_GIB):
            free0 = int(runtime.memGetInfo()[0])
            ptrs.append(runtime.hostAlloc(GIB, _HOST_ALLOC_PORTABLE))
            deltas.append(free0 - int(runtime.memGetInfo()[0]))
    finally:
        for p in ptrs:
            runtime.freeHost(p)
    most = max(0, max(deltas))
    return most if most <= GIB // 64 else 0  # more than 16 MiB a GiB is another process's allocation, not tables


#: The file, in the user's cache folder, that keeps the driver facts across processes (`_probe_cuda` names it).
DRIVER_FACTS_FILE = "cuda_driver_facts.json"


def _facts_key(runtime: Any, index: int, page_lock: bool) -> str | None:
    """What the driver facts of a card depend on: its PCI bus id and name, the driver's version, page locking; None
    when the runtime cannot say (the facts are then measured, not kept)."""
    try:
        bus = text(runtime.deviceGetPCIBusId(index))
        name = text(runtime.getDeviceProperties(index).get("name", ""))
        driver = int(runtime.driverGetVersion())
    except Exception:
        return None
    return f"{bus}|{name}|driver {driver}|page_lock {int(bool(page_lock))}"


def _kept_facts(path: Path) -> dict:
    """The kept driver facts ({key: [granularity, tables per GiB]}); empty when the file is missing or unreadable."""
    try:
        got = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return got if isinstance(got, dict) else {}


def _keep_facts(path: Path, key: str, facts: tuple[int, int]) -> None:
    """Add one card's facts to the file (written whole, then renamed: a reader never sees half a file); a folder that
    cannot be written keeps nothing."""
    kept = _kept_facts(path)
    kept[key] = [int(facts[0]), int(facts[1])]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(kept, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass


def driver_memory_facts(runtime: Any, index: int, page_lock: bool = True, kept: Path | None = None) -> tuple[int, int]:
    """(allocation granularity, device bytes per page-locked GiB) of device `index`, measured once per process
    through the runtime (it makes the device's context); 0 for a fact the runtime cannot give (a test double, no
    host memory to page-lock) and for the page tables without `page_lock` (WDDM and WSL2, whose page-locked memory
    is capped near the probe's 2 GiB: the probe does not spend it). With `kept` (a JSON file), facts measured for
    this card and driver before are read from it, so a later process makes no context and page-locks nothing."""
    if not all(hasattr(runtime, f) for f in ("malloc", "free", "hostAlloc", "freeHost")):
        return 0, 0  # a runtime that only enumerates (a test double): nothing to measure with, no context made
    try:
        known = _DRIVER_FACTS.setdefault(runtime, {})
    except TypeError:  # not weakly referable: measured every time
        known = {}
    key = _facts_key(runtime, index, page_lock) if kept is not None else None
    if int(index) not in known and key is not None:
        got = _kept_facts(kept).get(key)
        if isinstance(got, list) and len(got) == 2 and all(isinstance(v, int) and v >= 0 for v in got):
            known[int(index)] = (got[0], got[1])
    if int(index) not in known:
        granularity = pinned_map = 0
        try:
            prev = runtime.getDevice()
            runtime.setDevice(index)
            try:
                try:
                    granularity = _granularity(runtime)
                except Exception:  # unmeasured: the plan has no rounding line
                    granularity = 0
                try:
                    pinned_map = _pinned_map_per_gib(runtime) if page_lock else 0
                except Exception:  # unmeasured: the plan has no page-table line
                    pinned_map = 0
            finally:
                runtime.setDevice(prev)
        except Exception:  # no device to make current: nothing measured
            granularity = pinned_map = 0
        known[int(index)] = (granularity, pinned_map)
        if key is not None and granularity > 0 and (pinned_map > 0 or not page_lock):
            _keep_facts(kept, key, known[int(index)])  # only complete measurements: a failed one is tried again
    return known[int(index)]


def device_info(index: int, runtime: Any, nvml: Any | None, os_name: str, wsl: bool, count: int = 1,
                kept: Path | None = None) -> DeviceInfo:
    """DeviceInfo of CUDA device `index` (of `count`): NVML's facts where it has them, cupy's runtime for the rest
    (the driver facts read from the `kept` file where it has them)."""
    props = runtime.getDeviceProperties(index)
    arch = f"sm_{int(props['major'])}{int(props['minor'])}"
    facts: dict = {}
    if nvml is not None:
        try:
            facts = _nvml_facts(nvml, text(runtime.deviceGetPCIBusId(index)), os_name)
        except Exception:
            facts = {}
    if "vram_free_bytes" not in facts:
        facts["vram_free_bytes"], facts["vram_total_bytes"] = memory_info(runtime, index)
    if "driver_model" not in facts:
        if os_name == "windows":
            facts["driver_model"] = "tcc" if int(props.get("tccDriver", 0)) else "wddm"
        else:
            facts["driver_model"] = driver_model(os_name, wsl)
    if "drives_display" not in facts:
        # the kernel watchdog is on exactly when the card runs a display
        facts["drives_display"] = bool(int(props.get("kernelExecTimeoutEnabled", 0)))
    granularity, pinned_map = driver_memory_facts(runtime, index,
                                                  page_lock=facts["driver_model"] not in ("wddm", "wsl2"), kept=kept)
    return DeviceInfo(backend=NAME, vendor="nvidia", name=facts.get("name") or text(props.get("name", "")),
                      arch=arch, vram_total_bytes=facts["vram_total_bytes"], vram_free_bytes=facts["vram_free_bytes"],
                      driver_model=facts["driver_model"], drives_display=facts["drives_display"], index=index,
                      unified_memory=bool(int(props.get("integrated", 0))), device_type=device_type(props),
                      caps=DeviceCaps(peer_copies=peer_copies(runtime, index, count)),
                      alloc_granularity_bytes=granularity, pinned_map_bytes_per_gib=pinned_map)


def device_type(props: dict) -> DeviceType:
    """An integrated GPU (Jetson, a GPU sharing host RAM) or a discrete one, from the runtime's properties."""
    return DeviceType.INTEGRATED_GPU if int(props.get("integrated", 0)) else DeviceType.GPU


def probe_with(runtime: Any, nvml: Any | None = None, os_name: str | None = None, wsl: bool | None = None,
               version: str = "", kept: Path | None = None) -> ProbeResult:
    """Probe through the given runtime (cupy's, or a fake in tests) and NVML module (`kept`: the driver facts'
    file, see driver_memory_facts); never raises."""
    os_name = os_name or current_os()
    wsl = is_wsl() if wsl is None else wsl
    return probe_devices(runtime, lambda i, n: device_info(i, runtime, nvml, os_name, wsl, n, kept=kept), label="CUDA",
                         no_device="cupy is installed but no CUDA device", count_call="cudaGetDeviceCount",
                         version=version)


def _probe_cuda(runtime: Any, cupy_version: str) -> ProbeResult:
    """probe_with cupy's CUDA runtime and NVML (shut down after), with the runtime's version when there is a device."""
    version = f"cupy {cupy_version}"
    nvml = _load_nvml()
    try:
        from strata_core.config import user_cache_dir
        result = probe_with(runtime, nvml=nvml, version=version, kept=user_cache_dir() / DRIVER_FACTS_FILE)
    finally:
        if nvml is not None:
            try:
                nvml.nvmlShutdown()
            except Exception:
                pass
    if result.available:
        try:
            rt = runtime.runtimeGetVersion()
            result = ProbeResult(available=True, reason=result.reason, devices=result.devices, score=result.score,
                                 version=f"{version}, CUDA runtime {rt // 1000}.{rt % 1000 // 10}")
        except Exception:
            pass
    return result


def probe() -> ProbeResult:
    """The cuda probe's facts: cupy (the CUDA build) must import and see a device; DeviceInfo per card. Never raises.

    `strata_cuda.backend.BACKEND.probe` wraps each DeviceInfo into the device object the core drives.
    """
    return probe_cupy(
        hip=False, label="CUDA", run=_probe_cuda,
        missing=lambda e: f"cupy is not installed ({type(e).__name__}: {e})",
        wrong_build=lambda v: f"the installed cupy {v} is the ROCm build; the cuda backend needs the CUDA build")
