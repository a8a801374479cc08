"""CudaLayerOps' deferred decode steps on the host (the executor's pipelined greedy loop): two steps in flight land
their routed ids in different page-locked buffers, decode_done(keep=1) counts only the older one (its cache tick
first, as the step loop ticks before it counts), a deferred step's replay waits for the previous step's ids copy,
and a third launch counts the oldest first. cupy and FastMoE are the doubles of tests/backends/
test_cuda_layer_ops_host.py (numpy device arrays, memmove copies, a "graph" that writes known ids); the real calls
run in tests/gpu/test_decode_loop.py.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from strata_core.runtime.cache import ExpertCache

_spec = importlib.util.spec_from_file_location(
    "cuda_layer_ops_host_doubles", Path(__file__).resolve().parents[1] / "backends" / "test_cuda_layer_ops_host.py")
doubles = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(doubles)
L, E, K, H = doubles.L, doubles.E, doubles.K, doubles.H


@pytest.fixture
def op(monkeypatch):
    """The doubles' CudaLayerOps, its streams recording what they wait for."""
    import sys
    from types import SimpleNamespace
    import ctypes
    cp = doubles.fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cp.cuda)
    cp.cuda.runtime = SimpleNamespace(memcpyDeviceToHost=2,
                                      memcpyAsync=lambda dst, src, n, kind, stream: ctypes.memmove(dst, src, n))
    from strata_cuda import fast, layer_ops
    monkeypatch.setattr(fast, "warm_up", lambda: None)
    o = layer_ops.CudaLayerOps(memory=None, kernels=None)
    o._test_fast = doubles.FakeFast()
    monkeypatch.setattr(layer_ops.CudaLayerOps, "_fast_for", lambda self, w: self._test_fast)
    o.waits = []
    cp.cuda.get_current_stream().wait_event = lambda e: o.waits.append(e)
    return o


def _ids(step: int) -> np.ndarray:
    """The ids the doubles' graph writes at `step`."""
    return np.stack([(i + step + np.arange(K)) % E for i in range(L)])


def _cache() -> ExpertCache:
    cache = ExpertCache(L * E, L, E)
    cache.place(np.arange(L * E))  # every expert cached: no host reads, no admissions
    return cache


def _counted(steps: list[int]) -> ExpertCache:
    """The cache after the step loop's tick-then-count of these steps' ids."""
    c = _cache()
    for s in steps:
        c.tick()
        ids = _ids(s)
        rows = (ids + np.arange(L)[:, None] * E).ravel()
        cnt = np.bincount(rows, minlength=L * E)
        used = np.flatnonzero(cnt)
        c.lookup(0, used, cnt[used])
    return c


def test_two_deferred_steps_in_flight_are_counted_oldest_first_from_their_own_buffers(op):
    cache = _cache()
    works = doubles.step_works(cache, doubles.Dev(np.zeros((1, H), np.float32)))
    fast = op._test_fast
    fast.step = 0
    op.decode_launch(works, defer=True)
    assert op.waits == [], "nothing in flight before the first step"
    fast.step = 1
    op.decode_launch(works, defer=True)
    assert len(op._launched) == 2 and cache.lookups == 0, "a deferred launch counts nothing"
    assert len(op.waits) == 1 and op.waits[0] is op._launched[0][2], "the replay waits for the older ids copy"
    op.decode_done(keep=1)
    want = _counted([0])
    assert len(op._launched) == 1 and cache.lookups == want.lookups
    assert np.array_equal(cache.freq, want.freq), "step 0's ids, after its tick"
    fast.step = 2
    op.decode_launch(works, defer=True)
    op.decode_done(keep=1)
    op.decode_done()
    want = _counted([0, 1, 2])
    assert cache.lookups == want.lookups and np.array_equal(cache.freq, want.freq)
    assert not op._launched


def test_a_third_launch_counts_the_oldest_first(op):
    cache = _cache()
    works = doubles.step_works(cache, doubles.Dev(np.zeros((1, H), np.float32)))
    for s in range(3):
        op._test_fast.step = s
        op.decode_launch(works, defer=True)
    assert len(op._launched) == 2
    assert np.array_equal(cache.freq, _counted([0]).freq)
    op.decode_done()
    assert np.array_equal(cache.freq, _counted([0, 1, 2]).freq)


def test_after_a_deferred_step_the_step_loop_ticks_and_counts_as_before(op):
    cache = _cache()
    works = doubles.step_works(cache, doubles.Dev(np.zeros((1, H), np.float32)))
    op._test_fast.step = 0
    op.decode_launch(works, defer=True)
    op.decode_done()
    op._test_fast.step = 1
    cache.tick()  # the step loop's own tick, then a step that owes none
    op.decode_step(works)
    want = _counted([0, 1])
    assert not op._launched and cache.lookups == want.lookups and np.array_equal(cache.freq, want.freq)


@pytest.mark.parametrize("arch", ["compute_75", "compute_90"])
def test_the_greedy_kernels_compile_with_nvrtc_and_keep_moe_cus_portability_rules(arch):
    import re
    try:
        from cupy_backends.cuda.libs import nvrtc
        nvrtc.getVersion()
    except Exception as e:  # cupy or the NVRTC library is not installed here
        pytest.skip(f"NVRTC is not available here ({type(e).__name__}: {e}); it comes with 'strata-core[cuda]'")
    from strata_cuda.kernels import GREEDY_KERNEL_NAMES, GREEDY_SOURCE, compile_to_ptx
    ptx = compile_to_ptx(arch=arch, source=GREEDY_SOURCE)
    assert set(re.findall(rb"\.entry\s+(\w+)", ptx)) == {n.encode() for n in GREEDY_KERNEL_NAMES}
    code = "\n".join(line.split("//", 1)[0] for line in GREEDY_SOURCE.splitlines())
    for banned in ("#include", "__shfl", "__ballot", "warpSize", "__half", "atomic"):
        assert banned not in code, banned
