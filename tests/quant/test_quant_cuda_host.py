"""moe_quant.cu's kernels run on the host: g++ builds the CUDA C source (quants.cuh included) with a small shim
(a thread for each GPU thread, a barrier for __syncthreads, one block at a time), and its grouped FFN over 'gguf'
pools is checked against the float64 reference, so the kernel's logic is tested without a GPU. The GPU run is
tests/gpu/test_quant_cuda.py; NVRTC's build of the same text is checked here too where cupy is installed."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from strata_core.models.gguf import read_moe_tensors
from strata_core.reference.quants import GGML_TYPES
from strata_core.testing import reference64 as r64

CUDA_DIR = Path(__file__).resolve().parents[2] / "backends" / "cuda" / "strata_cuda"
F32_BOUND = 1e-5

SHIM = r"""
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>
using std::min;
struct qt_dim3 { unsigned int x = 0, y = 0, z = 0; };
static thread_local qt_dim3 threadIdx, blockIdx;
static std::barrier<>* qt_bar = nullptr;
static inline void __syncthreads() { qt_bar->arrive_and_wait(); }
static inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
static inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
static inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
#define __device__
#define __global__
#define __forceinline__ inline
#define __shared__ static
// mma.sync m16n8k16 (f16 x f16 + f32) emulated over the warp's fragments, laid out as the PTX ISA gives them:
// a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..); b0 (k 2t..2t+1, n g), b1 (k 2t+8.., n g);
// c0/c1 (g, 2t / 2t+1), c2/c3 (g+8, 2t / 2t+1); g = lane / 4, t = lane % 4; the lower half of a pair is first.
#define QT_HOST_MMA 1
static unsigned int qt_frag_a[1024][4], qt_frag_b[1024][2];
static float qt_h2f(unsigned int h) {
    const unsigned int sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    unsigned int bits;
    if (e == 0u) { float v = (float)m * 5.9604644775390625e-8f; return sign ? -v : v; }
    bits = e == 31u ? (sign | 0x7f800000u | (m << 13)) : (sign | ((e + 112u) << 23) | (m << 13));
    float f; std::memcpy(&f, &bits, 4); return f;
}
static void __syncthreads();
static void qt_mma_host(float c[4], const unsigned int a[4], const unsigned int b[2]);
static void qt_launch(unsigned gx, unsigned gy, unsigned block, const std::function<void()>& body) {
    for (unsigned by = 0; by < gy; ++by)
        for (unsigned bx = 0; bx < gx; ++bx) {
            std::barrier<> bar(block);
            qt_bar = &bar;
            std::vector<std::thread> ts;
            for (unsigned t = 0; t < block; ++t)
                ts.emplace_back([&, t] { threadIdx.x = t; blockIdx.x = bx; blockIdx.y = by; body(); });
            for (auto& th : ts) th.join();
        }
}
"""

WRAPPERS = r"""
static void qt_mma_host(float c[4], const unsigned int a[4], const unsigned int b[2]) {
    const unsigned int tid = threadIdx.x, lane = tid % 32, w0 = tid - lane;
    for (int i = 0; i < 4; ++i) qt_frag_a[tid][i] = a[i];
    for (int i = 0; i < 2; ++i) qt_frag_b[tid][i] = b[i];
    __syncthreads();
    float A[16][16], B[16][8];
    for (unsigned int l = 0; l < 32; ++l) {
        const unsigned int g = l / 4, t = l % 4, *fa = qt_frag_a[w0 + l], *fb = qt_frag_b[w0 + l];
        for (unsigned int j = 0; j < 2; ++j) {
            A[g][2 * t + j] = qt_h2f((fa[0] >> (16 * j)) & 0xffffu);
            A[g + 8][2 * t + j] = qt_h2f((fa[1] >> (16 * j)) & 0xffffu);
            A[g][2 * t + 8 + j] = qt_h2f((fa[2] >> (16 * j)) & 0xffffu);
            A[g + 8][2 * t + 8 + j] = qt_h2f((fa[3] >> (16 * j)) & 0xffffu);
            B[2 * t + j][g] = qt_h2f((fb[0] >> (16 * j)) & 0xffffu);
            B[2 * t + 8 + j][g] = qt_h2f((fb[1] >> (16 * j)) & 0xffffu);
        }
    }
    const unsigned int g = lane / 4, t = lane % 4;
    for (int i = 0; i < 4; ++i) {
        const unsigned int row = g + (i >= 2 ? 8 : 0), col = 2 * t + (i & 1);
        float s = 0.0f;
        for (int k = 0; k < 16; ++k) s += A[row][k] * B[k][col];
        c[i] += s;
    }
    __syncthreads();
}
extern "C" {
void host_gate_up_mma(unsigned gx, unsigned gy, const float* x, const int* off, const int* slots, const int* tg,
                      const int* tr, int S, int H, int F, const unsigned char* blob, long long sb, long long rb,
                      int fmt, long long bias, float* act) {
    qt_launch(gx, gy, 128, [&] { strata_quant_gate_up_mma(x, off, slots, tg, tr, S, H, F, blob, sb, rb, fmt, bias,
                                                          act); });
}
void host_down_mma(unsigned gx, unsigned gy, const float* act, const int* off, const int* slots, const int* tg,
                   const int* tr, int S, int H, int F, const unsigned char* blob, long long sb, long long doff,
                   long long rb, int fmt, long long bias, float* y) {
    qt_launch(gx, gy, 128, [&] { strata_quant_down_mma(act, off, slots, tg, tr, S, H, F, blob, sb, doff, rb, fmt,
                                                       bias, y); });
}
void host_gate_up(unsigned gx, unsigned gy, const float* x, const int* off, const int* slots, const int* tg,
                  const int* tr, int S, int H, int F, const unsigned char* blob, long long sb, long long rb, int fmt,
                  long long bias, float* act) {
    qt_launch(gx, gy, 256, [&] { strata_quant_gate_up(x, off, slots, tg, tr, S, H, F, blob, sb, rb, fmt, bias, act); });
}
void host_down(unsigned gx, unsigned gy, const float* act, const int* off, const int* slots, const int* tg,
               const int* tr, int S, int H, int F, const unsigned char* blob, long long sb, long long doff,
               long long rb, int fmt, long long bias, float* y) {
    qt_launch(gx, gy, 256, [&] { strata_quant_down(act, off, slots, tg, tr, S, H, F, blob, sb, doff, rb, fmt, bias, y); });
}
}
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    """moe_quant.cu built for the host (skipped only without a C++20 g++; a build error of the source fails)."""
    if shutil.which("g++") is None:
        pytest.skip("no g++ on this machine: the host build of moe_quant.cu needs a C++20 compiler")
    tmp = tmp_path_factory.mktemp("moe_quant_host")
    src = tmp / "moe_quant_host.cpp"
    src.write_text(SHIM + (CUDA_DIR / "moe_quant.cu").read_text() + WRAPPERS)
    done = subprocess.run(["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-w", f"-I{CUDA_DIR}",
                           str(src), "-o", str(tmp / "q.so")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return ctypes.CDLL(str(tmp / "q.so"))


def _p(a: np.ndarray):
    return a.ctypes.data_as(ctypes.c_void_p)


def host_grouped_ffn(lib, x, offsets, slots, pool, mma: bool = False) -> np.ndarray:
    """moe_grouped_ffn over a 'gguf' pool through the host build, launched as strata_cuda.quant_ffn launches it."""
    from strata_cuda.quant_ffn import TILE_OUTPUTS, tile_list
    fmt = pool.fmt
    blob = np.ascontiguousarray(pool.arrays["blob"])
    n, h = x.shape
    f = fmt.ffn
    off = np.ascontiguousarray(offsets, dtype=np.int32)
    sl = np.ascontiguousarray(slots, dtype=np.int32)
    tg, tr = tile_list(off)
    act = np.full((n, f), np.nan, np.float32)
    y = np.zeros((n, h), np.float32)
    bias = ctypes.c_longlong(fmt.bias_offset if fmt.bias else -1)
    ll, i32 = ctypes.c_longlong, ctypes.c_int
    gate_up, down = (lib.host_gate_up_mma, lib.host_down_mma) if mma else (lib.host_gate_up, lib.host_down)
    gate_up(ctypes.c_uint(-(-f // TILE_OUTPUTS)), ctypes.c_uint(len(tg)), _p(x), _p(off), _p(sl), _p(tg),
                     _p(tr), i32(blob.shape[0]), i32(h), i32(f), _p(blob), ll(blob.shape[1]),
                     ll(fmt.gate_up_row_bytes), i32(GGML_TYPES[fmt.gate_up]), bias, _p(act))
    down(ctypes.c_uint(-(-h // TILE_OUTPUTS)), ctypes.c_uint(len(tg)), _p(act), _p(off), _p(sl), _p(tg),
                  _p(tr), i32(blob.shape[0]), i32(h), i32(f), _p(blob), ll(blob.shape[1]), ll(fmt.down_offset),
                  ll(fmt.down_row_bytes), i32(GGML_TYPES[fmt.down]), bias, _p(y))
    return y


#: the tensor-core variant rounds activations and weights to f16: the f16 path's bound
F16_BOUND = 1e-3


@pytest.mark.parametrize("mma", [False, True], ids=["simt", "mma"])
@pytest.mark.parametrize("arch,layer", [("qwen3moe", 2), ("gpt-oss", 1)])
def test_moe_quant_cu_on_the_host_matches_the_float64_reference(lib, gguf_files, arch, layer, mma):
    pool = read_moe_tensors(gguf_files[arch]).experts.for_layer(layer)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((90, 256)).astype(np.float32)
    # a group of 70 rows (two row tiles), an empty group, one of 19, and a slot outside the pool (zero rows)
    offsets = np.array([0, 70, 70, 89, 90])
    slots = np.array([layer * 8 + 5, layer * 8 + 1, layer * 8 + 7, 10_000])
    y = host_grouped_ffn(lib, x, offsets, slots, pool, mma)
    want = r64.moe_grouped_ffn(x[:89], offsets[:4], slots[:3], pool)
    err = r64.relative_error(y[:89], want)
    assert err <= (F16_BOUND if mma else F32_BOUND), err
    if mma:  # f16 inputs: not the f32 kernel's result, so the emulated instruction did run on rounded data
        assert err > 1e-6
    assert not y[89].any()


def test_moe_quant_cu_compiles_with_nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc
        nvrtc.getVersion()
    except Exception as e:  # cupy or NVRTC not installed here
        pytest.skip(f"NVRTC is not available here ({type(e).__name__}: {e})")
    import re

    from strata_cuda.quant_ffn import KERNEL_NAMES, MMA_KERNEL_NAMES, compile_to_ptx
    ptx = compile_to_ptx("compute_90").decode()
    assert sorted(re.findall(r"\.entry\s+(\w+)", ptx)) == sorted(KERNEL_NAMES + MMA_KERNEL_NAMES)
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx
