"""moe.cu's kernels run on the host: the CUDA C source is compiled by g++ with a small shim (threads for GPU threads,
a barrier for __syncthreads) and checked against the numpy reference, so its logic is tested on machines without a
GPU. The shim runs the kernels exactly as written; only the launch and the built-ins are emulated.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from strata_core.reference import kernels as ref
from strata_cuda.grouping import group_layouts
from strata_cuda.kernels import MAX_TOPK, NORM_THREADS, ROUTE_THREADS, kernel_source

SHIM = r"""
#include <atomic>
#include <barrier>
#include <cstring>
#include <functional>
#include <math.h>
#include <thread>
#include <vector>
struct strata_dim3 { unsigned int x = 0, y = 0, z = 0; };
static thread_local strata_dim3 threadIdx, blockIdx;
static strata_dim3 blockDim, gridDim;
static std::barrier<>* strata_bar = nullptr;
static inline void __syncthreads() { strata_bar->arrive_and_wait(); }
static inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
static inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
static inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
#define __device__
#define __global__
#define __shared__ static
static void strata_launch(unsigned grid, unsigned block, const std::function<void()>& body) {
    blockDim.x = block; gridDim.x = grid;
    for (unsigned b = 0; b < grid; ++b) {
        std::barrier<> bar(block);
        strata_bar = &bar;
        std::vector<std::thread> ts;
        for (unsigned t = 0; t < block; ++t) ts.emplace_back([&, t, b] { threadIdx.x = t; blockIdx.x = b; body(); });
        for (auto& th : ts) th.join();
    }
}
"""

# grid-stride kernels run with a grid and block that do not divide the work, so the striding itself is exercised
WRAPPERS = r"""
#define G 3
#define B 5
extern "C" {
void host_route_topk(const float* l, int T, int E, int k, int* ids, float* w) {
    strata_launch(T, STRATA_ROUTE_THREADS, [&] { strata_route_topk(l, T, E, k, ids, w); }); }
void host_gather(const float* x, const int* rows, long long N, int H, float* out) {
    strata_launch(G, B, [&] { strata_gather_f32(x, rows, N, H, out); }); }
void host_scatter_add(float* out, const int* order, const int* seg, const float* y, const float* s, long long T,
                      int H) {
    strata_launch(G, B, [&] { strata_scatter_add_f32(out, order, seg, y, s, T, H); }); }
void host_dequantize(const signed char* q, const unsigned short* d, long long n, unsigned short* out) {
    strata_launch(G, B, [&] { strata_dequantize_q8_0(q, d, n, out); }); }
void host_dequantize_slots(const signed char* q, const unsigned short* d, const int* slots, int n_slots,
                           long long per_slot, unsigned short* out) {
    strata_launch(G, B, [&] { strata_dequantize_q8_0_slots(q, d, slots, n_slots, per_slot, out); }); }
void host_rmsnorm(const float* x, const float* w, int T, int H, float eps, float* out) {
    strata_launch(T, STRATA_NORM_THREADS, [&] { strata_rmsnorm_f32(x, w, T, H, eps, out); }); }
void host_pack(const float* x, const int* src, long long P, int H, unsigned short* xp) {
    strata_launch(G, B, [&] { strata_pack_rows_f16(x, src, P, H, xp); }); }
void host_swiglu(const float* gu, long long rows, int F, unsigned short* h) {
    strata_launch(G, B, [&] { strata_swiglu_f16(gu, rows, F, h); }); }
void host_unpack(const float* yp, const int* dst, long long P, int H, float* y) {
    strata_launch(G, B, [&] { strata_unpack_rows_f32(yp, dst, P, H, y); }); }
void host_f2h(const float* in, long long n, unsigned short* out) { for (long long i = 0; i < n; ++i) out[i] = strata_f2h(in[i]); }
void host_h2f(const unsigned short* in, long long n, float* out) { for (long long i = 0; i < n; ++i) out[i] = strata_h2f(in[i]); }
}
"""


def _compile(tmp: Path, source: str, out: Path) -> subprocess.CompletedProcess:
    src = tmp / (out.stem + ".cpp")
    src.write_text(source)
    return subprocess.run(["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-w", str(src), "-o", str(out)],
                          capture_output=True, text=True)


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    """moe.cu built for the host; skipped only when no C++20 compiler is there (a build error of moe.cu fails)."""
    if shutil.which("g++") is None:
        pytest.skip("no g++ on this machine: the host build of moe.cu needs a C++20 compiler")
    tmp = tmp_path_factory.mktemp("moe_host")
    probe = _compile(tmp, SHIM + "\nextern \"C\" int ok() { return 1; }\n", tmp / "probe.so")
    if probe.returncode != 0:
        pytest.skip(f"g++ here lacks C++20 <barrier>/<atomic_ref>: {probe.stderr.strip()[:200]}")
    built = _compile(tmp, SHIM + kernel_source() + WRAPPERS, tmp / "moe_host.so")
    assert built.returncode == 0, f"moe.cu does not build on the host:\n{built.stderr}"
    return ctypes.CDLL(str(tmp / "moe_host.so"))


def _p(a: np.ndarray):
    assert a.flags.c_contiguous
    return a.ctypes.data_as(ctypes.c_void_p)


LL, I32, F32 = ctypes.c_longlong, ctypes.c_int, ctypes.c_float


def _poisoned(shape, dtype) -> np.ndarray:
    """An output filled with NaN (or -1 for ints), so a value the kernel did not write shows."""
    a = np.empty(shape, dtype=dtype)
    a.fill(np.nan if np.issubdtype(np.dtype(dtype), np.floating) else -1)
    return a


def test_the_source_fixes_the_block_sizes_the_backend_launches_with():
    src = kernel_source()
    assert f"#define STRATA_ROUTE_THREADS {ROUTE_THREADS}" in src
    assert f"#define STRATA_NORM_THREADS {NORM_THREADS}" in src
    assert f"#define STRATA_MAX_TOPK {MAX_TOPK}" in src


def test_half_to_float_is_exact_for_every_bit_pattern(lib):
    bits = np.arange(1 << 16, dtype=np.uint16)
    out = np.empty(bits.size, np.float32)
    lib.host_h2f(_p(bits), LL(bits.size), _p(out))
    want = bits.view(np.float16).astype(np.float32)
    finite = ~np.isnan(want)
    assert np.array_equal(out[finite].view(np.uint32), want[finite].view(np.uint32))
    assert np.all(np.isnan(out[~finite]))


def test_float_to_half_rounds_like_numpy(lib):
    rng = np.random.default_rng(7)
    raw = rng.integers(0, 1 << 32, size=400_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    halves = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    finite_halves = halves[np.isfinite(halves)]
    # the midpoints between neighbouring halves are the round-half-to-even cases
    mids = ((finite_halves[:-1].astype(np.float64) + finite_halves[1:]) / 2).astype(np.float32)
    edges = np.array([0.0, -0.0, 65504.0, 65519.996, 65520.0, -65520.0, 6.1035156e-05, 6.0975552e-05,
                      5.9604645e-08, 2.9802322e-08, 2.9802326e-08, 1e-9, np.inf, -np.inf], dtype=np.float32)
    x = np.ascontiguousarray(np.concatenate([raw, mids, edges, rng.standard_normal(10_000).astype(np.float32)]))
    out = np.empty(x.size, np.uint16)
    lib.host_f2h(_p(x), LL(x.size), _p(out))
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    nan = np.isnan(x)
    assert np.array_equal(out[~nan], want[~nan].view(np.uint16))
    assert np.all(np.isnan(out[nan].view(np.float16)))


@pytest.mark.parametrize("t,e,k", [(5, 128, 8), (3, 200, 10), (2, 16, 16), (1, 512, 1)])
def test_route_topk_matches_the_reference(lib, t, e, k):
    rng = np.random.default_rng(t * 1000 + e + k)
    logits = rng.standard_normal((t, e)).astype(np.float32)
    ids = _poisoned((t, k), np.int32)
    w = _poisoned((t, k), np.float32)
    lib.host_route_topk(_p(logits), I32(t), I32(e), I32(k), _p(ids), _p(w))
    rid, rw = ref.route_topk(logits, k)
    assert np.array_equal(ids, rid)
    assert ref.relative_error(w, rw) < 1e-6


def test_route_topk_breaks_ties_to_the_lower_id(lib):
    rng = np.random.default_rng(3)
    logits = rng.integers(-2, 3, size=(4, 64)).astype(np.float32)  # many equal logits
    ids = _poisoned((4, 12), np.int32)
    w = _poisoned((4, 12), np.float32)
    lib.host_route_topk(_p(logits), I32(4), I32(64), I32(12), _p(ids), _p(w))
    rid, rw = ref.route_topk(logits, 12)
    assert np.array_equal(ids, rid)
    assert ref.relative_error(w, rw) < 1e-6


def test_gather_and_scatter_add_match_the_reference(lib):
    rng = np.random.default_rng(11)
    x = rng.standard_normal((9, 33)).astype(np.float32)
    rows = rng.integers(0, 9, size=14).astype(np.int32)  # repeats on purpose
    out = _poisoned((14, 33), np.float32)
    lib.host_gather(_p(x), _p(rows), LL(14), I32(33), _p(out))
    assert np.array_equal(out, ref.gather(x, rows))
    y = rng.standard_normal((14, 33)).astype(np.float32)
    scale = rng.random(14).astype(np.float32)
    acc = rng.standard_normal((9, 33)).astype(np.float32)
    before = acc.copy()
    want = acc.copy()
    ref.scatter_add(want, rows, y, scale)
    # the order and segments kernels.py computes on the device: sorted by (row, position), one segment per row
    order = np.argsort(rows.astype(np.int64) * 14 + np.arange(14), kind="stable").astype(np.int32)
    seg = np.searchsorted(rows[order], np.arange(10)).astype(np.int32)
    lib.host_scatter_add(_p(acc), _p(order), _p(seg), _p(y), _p(scale), LL(9), I32(33))
    assert ref.relative_error(acc, want) < 1e-6
    # one owner per element, summing its row's rounded products in ascending position, then adding to out: exactly
    # these bits (a kernel that summed in another order, or fused the multiply-add, would differ in the last place)
    seq = before.copy()
    for t in range(9):
        js = np.flatnonzero(rows == t)
        if js.size:
            part = scale[js[0]] * y[js[0]]
            for j in js[1:]:
                part = part + scale[j] * y[j]
            seq[t] = seq[t] + part
    assert np.array_equal(acc.view(np.uint32), seq.view(np.uint32))


def test_dequantize_is_bit_exact(lib):
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((6, 96)) * np.logspace(-6, 3, 6)[:, None]).astype(np.float32)
    q, d = ref.quantize_q8_0(w)
    out = _poisoned(q.shape, np.float16)
    lib.host_dequantize(_p(q), _p(d), LL(q.size), _p(out))
    assert np.array_equal(out.view(np.uint16), ref.dequantize_q8_0(q, d).view(np.uint16))


def test_dequantize_slots_picks_the_slots_asked(lib):
    rng = np.random.default_rng(6)
    q, d = ref.quantize_q8_0(rng.standard_normal((5, 4, 64)).astype(np.float32))
    slots = np.array([3, 0, 3], dtype=np.int32)
    out = _poisoned((3, 4, 64), np.float16)
    lib.host_dequantize_slots(_p(q), _p(d), _p(slots), I32(3), LL(4 * 64), _p(out))
    assert np.array_equal(out.view(np.uint16), ref.dequantize_q8_0(q[slots], d[slots]).view(np.uint16))


@pytest.mark.parametrize("t,h", [(3, 64), (2, 1000), (1, 4096)])
def test_rmsnorm_matches_the_reference(lib, t, h):
    rng = np.random.default_rng(h)
    x = (rng.standard_normal((t, h)) * 3).astype(np.float32)
    w = rng.standard_normal(h).astype(np.float32)
    out = _poisoned((t, h), np.float32)
    lib.host_rmsnorm(_p(x), _p(w), I32(t), I32(h), F32(1e-6), _p(out))
    assert ref.relative_error(out, ref.rmsnorm(x, w)) < 1e-5


def _host_grouped_ffn(lib, x, offsets, slots, pool):
    """The backend's grouped-FFN pipeline with the host-built kernels and numpy for the f16-in, f32-out GEMMs."""
    n, h = x.shape
    y = np.zeros((n, h), np.float32)
    for lay in group_layouts(offsets, slots, n_rows=n, n_slots=pool.slots):
        b, per = lay.batches, lay.rows_per_batch
        if pool.dtype == "f16":
            w13, w2 = pool.arrays["w_gate_up"][lay.slots], pool.arrays["w_down"][lay.slots]
        else:
            a = pool.arrays
            w13 = _poisoned((b, *a["gate_up_q"].shape[1:]), np.float16)
            lib.host_dequantize_slots(_p(a["gate_up_q"]), _p(a["gate_up_d"]), _p(lay.slots), I32(b),
                                      LL(w13[0].size), _p(w13))
            w2 = _poisoned((b, *a["down_q"].shape[1:]), np.float16)
            lib.host_dequantize_slots(_p(a["down_q"]), _p(a["down_d"]), _p(lay.slots), I32(b),
                                      LL(w2[0].size), _p(w2))
        f = w2.shape[2]
        xp = _poisoned((b, per, h), np.float16)
        lib.host_pack(_p(x), _p(lay.row_of_padded), LL(b * per), I32(h), _p(xp))
        gu = np.ascontiguousarray(np.matmul(xp.astype(np.float32), w13.astype(np.float32).transpose(0, 2, 1)))
        hid = _poisoned((b, per, f), np.float16)
        lib.host_swiglu(_p(gu), LL(b * per), I32(f), _p(hid))
        yp = np.ascontiguousarray(np.matmul(hid.astype(np.float32), w2.astype(np.float32).transpose(0, 2, 1)))
        lib.host_unpack(_p(yp), _p(lay.row_of_padded), LL(b * per), I32(h), _p(y))
    return y


def _pool(rng, dtype, slots, h, f):
    w13 = (rng.standard_normal((slots, 2 * f, h)) / np.sqrt(h)).astype(np.float32)
    w2 = (rng.standard_normal((slots, h, f)) / np.sqrt(f)).astype(np.float32)
    if dtype == "f16":
        return ref.ExpertPool("f16", {"w_gate_up": w13.astype(np.float16), "w_down": w2.astype(np.float16)})
    gq, gd = ref.quantize_q8_0(w13)
    dq, dd = ref.quantize_q8_0(w2)
    return ref.ExpertPool("q8_0", {"gate_up_q": gq, "gate_up_d": gd, "down_q": dq, "down_d": dd})


@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
def test_grouped_ffn_pipeline_stays_within_the_fp16_bound(lib, dtype):
    rng = np.random.default_rng(42)
    h, f, n_slots = 64, 32, 6
    pool = _pool(rng, dtype, n_slots, h, f)
    # skewed groups (one large, several small, one empty) so padding, bucketing and the -1 rows all occur
    counts = np.array([1, 9, 0, 2, 3, 1])
    offsets = np.concatenate(([0], np.cumsum(counts)))
    slots = np.array([4, 0, 5, 2, 4, 1])
    x = rng.standard_normal((int(offsets[-1]) + 2, h)).astype(np.float32)  # 2 rows belong to no group
    got = _host_grouped_ffn(lib, x, offsets, slots, pool)
    want = ref.moe_grouped_ffn(x, offsets, slots, pool)
    assert np.all(got[-2:] == 0)
    assert ref.relative_error(got, want) < 2e-3
