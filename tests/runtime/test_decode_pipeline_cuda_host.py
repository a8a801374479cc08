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
    o = doubles.make_op(monkeypatch)
    o.waits = []
    sys.modules["cupy"].cuda.get_current_stream().wait_event = lambda e: o.waits.append(e)
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


# --- GREEDY_SOURCE built for the host (the shim of tests/backends/test_cuda_source_host.py: threads for GPU threads)

_HOST_WRAPPERS = r"""
extern "C" {
void host_argmax(const float* v, int n, int grid, int block, float* part_v, int* part_i, int* out) {
    strata_launch(grid, block, [&] { strata_argmax_part_f32(v, n, part_v, part_i); });
    strata_launch(1, block, [&] { strata_argmax_final_f32(part_v, part_i, grid, out); }); }
void host_embed(const unsigned short* table, const int* tok, int h, int grid, int block, float* out) {
    strata_launch(grid, block, [&] { strata_embed_row_f16(table, tok, h, out); }); }
}
"""


@pytest.fixture(scope="module")
def greedy_host(tmp_path_factory):
    """GREEDY_SOURCE compiled by g++ with the host shim (skipped only without a C++20 compiler)."""
    import ctypes
    import shutil
    from strata_cuda.kernels import GREEDY_SOURCE
    if shutil.which("g++") is None:
        pytest.skip("no g++ on this machine: the host build of the greedy kernels needs a C++20 compiler")
    spec = importlib.util.spec_from_file_location(
        "cuda_source_host_shim", Path(__file__).resolve().parents[1] / "backends" / "test_cuda_source_host.py")
    shim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shim)
    tmp = tmp_path_factory.mktemp("greedy_host")
    built = shim._compile(tmp, shim.SHIM + GREEDY_SOURCE + _HOST_WRAPPERS, tmp / "greedy_host.so")
    if built.returncode != 0 and "barrier" in built.stderr:
        pytest.skip(f"g++ here lacks C++20 <barrier>: {built.stderr.strip()[:200]}")
    assert built.returncode == 0, f"GREEDY_SOURCE does not build on the host:\n{built.stderr}"
    return ctypes.CDLL(str(tmp / "greedy_host.so"))


def _host_argmax(lib, v: np.ndarray, grid: int, block: int) -> int:
    import ctypes
    v = np.ascontiguousarray(v, dtype=np.float32)
    part_v, part_i, out = np.full(grid, np.nan, np.float32), np.full(grid, -1, np.int32), np.full(1, -5, np.int32)
    p = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    lib.host_argmax(p(v), ctypes.c_int(v.size), ctypes.c_int(grid), ctypes.c_int(block), p(part_v), p(part_i), p(out))
    return int(out[0])


def _argmax_cases() -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    cases = [rng.standard_normal(n).astype(np.float32) for n in (1, 2, 6, 7, 50, 333)]
    tie = rng.standard_normal(333).astype(np.float32)
    tie[[4, 100, 332]] = 9.0
    nan = rng.standard_normal(333).astype(np.float32)
    nan[[200, 30]] = np.nan
    late = np.full(333, -1e30, np.float32)
    late[-1] = 2.0
    signed = np.zeros(100, np.float32)
    signed[:7] = -0.0
    return cases + [tie, nan, late, signed, np.full(40, -np.inf, np.float32), np.full(64, 1.5, np.float32)]


@pytest.mark.parametrize("grid,block", [(7, 16), (3, 4), (1, 8), (64, 2)])
def test_the_greedy_argmax_kernels_are_np_argmax_on_the_host(greedy_host, grid, block):
    for v in _argmax_cases():
        assert _host_argmax(greedy_host, v, grid, block) == int(np.argmax(v)), (v.size, grid, block)


def test_the_greedy_argmax_at_its_launch_shape_over_a_real_vocabulary(greedy_host):
    from strata_cuda.kernels import ARGMAX_PARTS, GREEDY_THREADS
    v = np.random.default_rng(6).standard_normal(151936).astype(np.float32)
    v[[151935, 77777]] = np.float32(7.5)
    assert _host_argmax(greedy_host, v, ARGMAX_PARTS, GREEDY_THREADS) == 77777


def test_the_embedding_row_kernel_widens_every_half_bit_for_bit(greedy_host):
    import ctypes
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    table = np.stack([halves, halves[::-1]]).view(np.float16)  # [2, 65536]: every bit pattern
    p = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    for token in (0, 1):
        tok = np.array([token], np.int32)
        out = np.full(table.shape[1], np.nan, np.float32)
        greedy_host.host_embed(p(table), p(tok), ctypes.c_int(table.shape[1]), ctypes.c_int(3), ctypes.c_int(5), p(out))
        want = table[token].astype(np.float32)
        same = out.view(np.uint32) == want.view(np.uint32)
        nan = np.isnan(want) & np.isnan(out)  # numpy may quiet a signalling NaN; any NaN stays a NaN
        assert np.all(same | nan), np.flatnonzero(~(same | nan))[:5]
