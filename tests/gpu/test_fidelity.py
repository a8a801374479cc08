"""Plan fidelity on a CUDA device: `strata run --backend cuda --json` on the tiny model at the plan's largest chunk
measures its device peak from the driver (memGetInfo less cupy's unused pool, from a baseline at start) and that
peak lies in [0.98 x planned, planned]; the plan's driver lines come from this device's probe. Each run is its own
process, so its baseline starts from a fresh context. Skipped with "no CUDA device" where there is none.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .test_fast_paths import _cuda_device_count

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_cuda_device_count() == 0, reason="no CUDA device")]


def _run(*args: str) -> dict:
    p = subprocess.run([sys.executable, "-m", "strata_core.cli", "run", "--backend", "cuda", "--json", *args],
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout)


@pytest.mark.parametrize("chunk", [4096, 16384])
def test_the_tiny_models_measured_peak_is_within_its_plan(chunk):
    r = _run("--prompt-tokens", str(chunk), "--decode-tokens", "4", "--set", f"prefill.chunk={chunk}")
    v = r["plan"]["vram"]
    planned, measured = r["device_bytes_planned"], r["device_bytes_peak_measured"]
    assert "mem_info" in r["device_bytes_peak_source"]
    capped = r["plan"]["device"]["driver_model"] in ("wddm", "wsl2")  # the probe page-locks nothing there
    assert v["alloc_rounding_bytes"] > 0 and (v["pinned_map_bytes"] > 0 or capped), "the probe measured no facts"
    lines = (v["dense_bytes"] + v["kv_bytes"] + v["workspace_bytes"] + v["expert_cache_bytes"]
             + v["owned_prompt_bytes"] + v["alloc_rounding_bytes"] + v["pinned_map_bytes"])
    assert planned == lines
    assert not [f for f in r["fallbacks"] if "device memory" in str(f)], r["fallbacks"]
    assert 0.98 * planned <= measured <= planned, (measured, planned, v)


def test_the_probe_measures_the_drivers_granularity_and_page_tables():
    from strata_cuda import backend
    (d, *_) = backend.BACKEND.probe().devices
    g, t = d.info.alloc_granularity_bytes, d.info.pinned_map_bytes_per_gib
    assert g > 0 and g & (g - 1) == 0, g
    assert 0 < t <= 16 << 20 or d.info.driver_model in ("wddm", "wsl2"), t
