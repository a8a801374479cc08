"""FastMoE's and QuantMoE's page-locked staging (pointer tables, small tables, counts back, the dequantization's slot
tables) comes from the session's pinned allocator, so the plan's pinned budget (its runtime floor) counts it; the
CUDA session's layer ops hand that allocator to every FastMoE / QuantMoE they build. On the CPU (no GPU here): the
staging helper on a stand-in object, and the sources' every page-locked allocation and construction site."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from strata_core.api.backend import PinnedBudget
from strata_core.builtin.cpu import HostPinnedAllocator

fast = pytest.importorskip("strata_cuda.fast")
CUDA_DIR = Path(fast.__file__).resolve().parent


def _stand_in(pinned):
    """The attributes FastMoE.__init__ sets before its staging, and a cupy whose own page-locked memory is counted."""
    raw = []
    cp = SimpleNamespace(cuda=SimpleNamespace(alloc_pinned_memory=lambda n: raw.append(n) or bytearray(n)))
    return SimpleNamespace(_pinned=pinned, _pinned_bufs=[], staging_outside_plan_bytes=0, _cp=cp), raw


def test_staging_comes_from_the_sessions_pinned_floor():
    budget = PinnedBudget(1 << 20, floor_bytes=1 << 16)
    moe, raw = _stand_in(HostPinnedAllocator(budget))
    mem = fast.FastMoE._page_locked(moe, 4096)
    stage = np.frombuffer(mem, dtype=np.int32, count=1024)  # how FastMoE reads it
    assert stage.size == 1024 and not raw
    assert budget.used_bytes == 4096 and budget.peak_bytes == 4096
    assert moe.staging_outside_plan_bytes == 0 and len(moe._pinned_bufs) == 1


def test_staging_without_an_allocator_or_past_the_floor_is_counted_outside_the_plan():
    moe, raw = _stand_in(None)
    fast.FastMoE._page_locked(moe, 512)
    assert raw == [512] and moe.staging_outside_plan_bytes == 512
    budget = PinnedBudget(1024, floor_bytes=256)
    moe, raw = _stand_in(HostPinnedAllocator(budget))
    fast.FastMoE._page_locked(moe, 2048)  # more than the budget holds: refused, then cupy's own, counted
    assert raw == [2048] and moe.staging_outside_plan_bytes == 2048 and budget.used_bytes == 0


def _calls(path: Path, name: str) -> list[tuple[ast.Call, str]]:
    """Every call of `name` (a bare name or an attribute) in a file, with the function it sits in."""
    tree = ast.parse(path.read_text())
    out = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for n in ast.walk(fn):
                if isinstance(n, ast.Call):
                    f = n.func
                    called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                    if called == name:
                        out.append((n, fn.name))
    return out


def test_every_page_locked_allocation_of_the_fast_paths_goes_through_the_staging_helper():
    for file in ("fast.py", "quant_ffn.py"):
        raw = [where for _, where in _calls(CUDA_DIR / file, "alloc_pinned_memory")]
        assert all(where == "_page_locked" for where in raw), (file, raw)
    helper = [where for _, where in _calls(CUDA_DIR / "fast.py", "_page_locked")]
    quant = [where for _, where in _calls(CUDA_DIR / "quant_ffn.py", "_page_locked")]
    # the pointer staging, the small tables, the counts back, the device-table path's rotating staging
    assert helper.count("__init__") == 4 and quant.count("__init__") == 1, (helper, quant)


def test_the_cuda_layer_ops_hand_their_pinned_allocator_to_every_fast_path_they_build():
    # every FastMoE the layer ops build, and the QuantMoE quant_moe_for builds for them
    built = _calls(CUDA_DIR / "layer_ops.py", "FastMoE") + [
        (c, where) for c, where in _calls(CUDA_DIR / "quant_ffn.py", "QuantMoE") if where == "quant_moe_for"]
    assert len(built) >= 3, [where for _, where in built]
    for call, where in built:
        assert any(k.arg == "pinned" for k in call.keywords), f"{where} builds a fast path without pinned="
    handed = _calls(CUDA_DIR / "layer_ops.py", "quant_moe_for")
    assert handed and all(len(c.args) == 3 for c, _ in handed), "quant_moe_for without the session's allocator"


def test_the_kernel_sets_grouped_ffn_fast_paths_stage_through_the_sessions_allocator_too():
    # the KernelSet's moe_grouped_ffn (the composed layer ops' path) builds a FastMoE and, for gguf pools, a QuantMoE
    built = _calls(CUDA_DIR / "kernels.py", "FastMoE") + _calls(CUDA_DIR / "quant_ffn.py", "QuantMoE") + \
        _calls(CUDA_DIR / "kernels.py", "QuantGroupedFFN")
    assert len(built) >= 4, [where for _, where in built]
    for call, where in built:
        assert any(k.arg == "pinned" for k in call.keywords), f"{where} builds a fast path without pinned="
    backend = (CUDA_DIR / "backend.py").read_text()
    assert "kernels.pinned = session.pinned" in backend, "the session's kernels are not handed its allocator"
