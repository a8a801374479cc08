"""moe_quant.cu's kernels run on the host: g++ builds the CUDA C source (quants.cuh included) with a small shim
(a fiber for each GPU thread, a barrier for __syncthreads, one block at a time: host_build.FIBERS), and its grouped
FFN over 'gguf' pools is checked against the float64 reference, so the kernel's logic is tested without a GPU. The GPU run is
tests/gpu/test_quant_cuda.py; NVRTC's build of the same text is checked here too where cupy is installed."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
from host_build import FIBERS, block_shim, build_host_library, nvrtc_or_skip, pointer

from strata_core.models.gguf import read_moe_tensors
from strata_core.reference.quants import GGML_TYPES
from strata_core.testing import reference64 as r64

CUDA_DIR = Path(__file__).resolve().parents[2] / "backends" / "cuda" / "strata_cuda"
F32_BOUND = 1e-5

SHIM = FIBERS + r"""
#include <algorithm>
#include <cmath>
#include <cstring>
using std::min;
struct qt_dim3 { unsigned int x = 0, y = 0, z = 0; };
static qt_dim3 threadIdx, blockIdx;
static qh_barrier* qt_bar = nullptr;
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
static void qt_set_thread(unsigned t) { threadIdx.x = t; }
static void qt_launch(unsigned gx, unsigned gy, unsigned block, const std::function<void()>& body) {
    for (unsigned by = 0; by < gy; ++by)
        for (unsigned bx = 0; bx < gx; ++bx) {
            qh_barrier bar(block);
            qt_bar = &bar;
            blockIdx.x = bx;
            blockIdx.y = by;
            qh_run_block(block, body, qt_set_thread);
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


def _host_library(tmp_path_factory, cu_name: str, shim: str, wrappers: str) -> ctypes.CDLL:
    """backends/cuda/strata_cuda/<cu_name> between its shim and wrappers, built by g++ for the host once per session
    (skipped only without a C++20 g++; a build error of the source fails)."""
    text = shim + (CUDA_DIR / cu_name).read_text() + wrappers
    return build_host_library(tmp_path_factory, Path(cu_name).stem + "_host", text, CUDA_DIR,
                              includes=[CUDA_DIR / "quants.cuh"])


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    """moe_quant.cu built for the host."""
    return _host_library(tmp_path_factory, "moe_quant.cu", SHIM, WRAPPERS)


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
    gate_up(ctypes.c_uint(-(-f // TILE_OUTPUTS)), ctypes.c_uint(len(tg)), pointer(x), pointer(off), pointer(sl), pointer(tg),
                     pointer(tr), i32(blob.shape[0]), i32(h), i32(f), pointer(blob), ll(blob.shape[1]),
                     ll(fmt.gate_up_row_bytes), i32(GGML_TYPES[fmt.gate_up]), bias, pointer(act))
    down(ctypes.c_uint(-(-h // TILE_OUTPUTS)), ctypes.c_uint(len(tg)), pointer(act), pointer(off), pointer(sl), pointer(tg),
                  pointer(tr), i32(blob.shape[0]), i32(h), i32(f), pointer(blob), ll(blob.shape[1]), ll(fmt.down_offset),
                  ll(fmt.down_row_bytes), i32(GGML_TYPES[fmt.down]), bias, pointer(y))
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
    nvrtc_or_skip()
    import re

    from strata_cuda.quant_ffn import KERNEL_NAMES, MMA_KERNEL_NAMES, compile_to_ptx
    ptx = compile_to_ptx("compute_90").decode()
    assert sorted(re.findall(r"\.entry\s+(\w+)", ptx)) == sorted(KERNEL_NAMES + MMA_KERNEL_NAMES)
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx


# --------------------------------------------------------------------------------------------------------------
# quant_fast.cu (the dequantize-to-f16 kernel of QuantMoE's prefill and the GEMV kernels of small groups and decode)
# on the host: a fiber per GPU thread, one block at a time, warp shuffles exchanged through memory between two
# barriers of the warp's 32 threads.
# --------------------------------------------------------------------------------------------------------------

#: exact weights, f32 sums of 256 products per output: measured 1.5e-7 .. 2.1e-7 here; 1e-6 leaves room for the
#: GPU's other summation order (warp tree, fused multiply-adds) and nothing for a wrong weight
GEMV_BOUND = 1e-6

FAST_SHIM = FIBERS + "#define QF_HOST 1\n#define QF_HOST_SYNCTHREADS 1\n" + block_shim("qf")

FAST_WRAPPERS = r"""
extern "C" {
void host_dequant_f16(unsigned gx, const unsigned char* blob, long long sb, const int* slots, int m, long long off,
                      long long rb, int rows, int cols, int fmt, unsigned short* out) {
    qf_launch(gx, m, [&] { strata_qf_dequant_f16(blob, sb, slots, m, off, rb, rows, cols, fmt, out); });
}
void host_gemv_gate_up(unsigned gx, unsigned gy, const float* x, long long ldx, const int* off, const int* ids,
                       const int* slots, int S, int H, int F, const unsigned char* blob, long long sb, long long rb,
                       int fmt, long long bias, int nan_missing, float* act) {
    qf_launch(gx, gy, [&] { strata_qf_gemv_gate_up(x, ldx, off, ids, slots, S, H, F, blob, sb, rb, fmt, bias,
                                                   nan_missing, act); });
}
void host_gemv_down(unsigned gx, unsigned gy, const float* act, const int* off, const int* slots, int S, int H,
                    int F, const unsigned char* blob, long long sb, long long doff, long long rb, int fmt,
                    long long bias, float* y) {
    qf_launch(gx, gy, [&] { strata_qf_gemv_down(act, off, slots, S, H, F, blob, sb, doff, rb, fmt, bias, y); });
}
void host_decode_down(unsigned gx, const float* act, const int* ids, const float* w, const int* slot_map, int S,
                      int K, int H, int F, const unsigned char* blob, long long sb, long long doff, long long rb,
                      int fmt, long long bias, int acc, float* out) {
    qf_launch(gx, 1, [&] { strata_qf_decode_down(act, ids, w, slot_map, S, K, H, F, blob, sb, doff, rb, fmt, bias,
                                                 acc, out); });
}
void host_dequant_part(unsigned gx, const unsigned char* blob, long long sb, const int* slots, int m, long long off,
                       long long rb, int rows, int r0, int c0, int ccols, int fmt, unsigned short* out) {
    qf_launch(gx, m, [&] { strata_qf_dequant_f16_part(blob, sb, slots, m, off, rb, rows, r0, c0, ccols, fmt, out); });
}
void host_decode_down_wide(unsigned gx, const float* act, const int* ids, const float* w, const int* slot_map, int S,
                           int K, int H, int F, const unsigned char* blob, long long sb, long long doff, long long rb,
                           int fmt, long long bias, int acc, float* out) {
    qf_launch(gx, 1, [&] { strata_qf_decode_down_wide(act, ids, w, slot_map, S, K, H, F, blob, sb, doff, rb, fmt,
                                                      bias, acc, out); });
}
}
"""


@pytest.fixture(scope="module")
def fast_lib(tmp_path_factory):
    """quant_fast.cu built for the host."""
    return _host_library(tmp_path_factory, "quant_fast.cu", FAST_SHIM, FAST_WRAPPERS)


@pytest.mark.parametrize("pad", [0, 3], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("fmt", ["q4_k", "q5_k", "q6_k", "q8_0", "mxfp4", "f16", "bf16", "f32"])
def test_quant_fast_dequant_f16_is_the_f16_of_the_oracle_bit_for_bit(fast_lib, fmt, pad):
    """strata_qf_dequant_f16's output is numpy's float16 of quants.dequantize, bit for bit, for every slot of a
    table (out of order), 16-aligned slots and slots 3 bytes off (the byte-load path of the 32-byte loads)."""
    from strata_core.reference import quants
    rng = np.random.default_rng(5)
    rows, cols, m = 6, 512, 3
    w = rng.standard_normal((m, rows, cols)).astype(np.float32) * np.float32(0.05)
    w[1, 2, :40] *= np.float32(1e-6)  # tiny weights: f16 subnormals and zeros
    raw = quants.quantize(fmt, w)  # [m, rows, rb]
    rb = raw.shape[-1]
    sb = rows * rb + pad + 13  # the matrix starts pad bytes into each slot
    blob = np.zeros(pad + m * sb + 64, np.uint8)[pad:]  # a base pad bytes off a 16-byte boundary
    blob = blob[:m * sb].reshape(m, sb)
    blob[:, pad:pad + rows * rb] = raw.reshape(m, -1)
    slots = np.array([2, 0, 1], np.int32)
    out = np.full((m, rows, cols), 0x7e00, np.uint16)  # poisoned: every element must be written
    ll, i32 = ctypes.c_longlong, ctypes.c_int
    fast_lib.host_dequant_f16(ctypes.c_uint(2), pointer(blob), ll(sb), pointer(slots), i32(m), ll(pad), ll(rb), i32(rows),
                              i32(cols), i32(GGML_TYPES[fmt]), pointer(out))
    want = quants.dequantize(fmt, raw[slots], cols).astype(np.float16).view(np.uint16)
    mism = int(np.count_nonzero(out != want))
    assert mism == 0, f"{fmt}: {mism} of {out.size} f16 weights differ"


def host_gemv_grouped_ffn(lib, x, offsets, slots, pool) -> np.ndarray:
    """moe_grouped_ffn over a 'gguf' pool through the host build of the GEMV kernels, launched as
    strata_cuda.quant_ffn.QuantGroupedFFN._gemv launches them."""
    from strata_cuda.quant_ffn import FAST_WARPS
    fmt = pool.fmt
    blob = np.ascontiguousarray(pool.arrays["blob"])
    n, h = x.shape
    f = fmt.ffn
    off = np.ascontiguousarray(offsets, dtype=np.int32)
    sl = np.ascontiguousarray(slots, dtype=np.int32)
    act = np.full((n, f), np.nan, np.float32)
    y = np.full((n, h), np.nan, np.float32)
    bias = ctypes.c_longlong(fmt.bias_offset if fmt.bias else -1)
    ll, i32, u = ctypes.c_longlong, ctypes.c_int, ctypes.c_uint
    g = len(sl)
    lib.host_gemv_gate_up(u(-(-f // FAST_WARPS)), u(g), pointer(x), ll(h), pointer(off), None, pointer(sl), i32(blob.shape[0]),
                          i32(h), i32(f), pointer(blob), ll(blob.shape[1]), ll(fmt.gate_up_row_bytes),
                          i32(GGML_TYPES[fmt.gate_up]), bias, i32(0), pointer(act))
    lib.host_gemv_down(u(-(-h // FAST_WARPS)), u(g), pointer(act), pointer(off), pointer(sl), i32(blob.shape[0]), i32(h), i32(f),
                       pointer(blob), ll(blob.shape[1]), ll(fmt.down_offset), ll(fmt.down_row_bytes),
                       i32(GGML_TYPES[fmt.down]), bias, pointer(y))
    return y


@pytest.mark.parametrize("arch,layer", [("qwen3moe", 2), ("llama", 1), ("olmoe", 0), ("gpt-oss", 1)])
def test_quant_fast_gemv_on_the_host_matches_the_float64_reference(fast_lib, gguf_files, arch, layer):
    """The GEMV kernels (groups of 1..6 rows, two passes of QF_R = 4 in one, an out-of-pool slot) against float64:
    exact weights, f32 sums (GEMV_BOUND)."""
    pool = read_moe_tensors(gguf_files[arch]).experts.for_layer(layer)
    rng = np.random.default_rng(8)
    x = rng.standard_normal((13, 256)).astype(np.float32)
    offsets = np.array([0, 1, 7, 7, 10, 12, 13])  # 1 row, 6 rows, none, 3, 2, then the out-of-pool slot
    b = layer * 8
    slots = np.array([b + 3, b + 6, b + 1, b + 0, b + 7, 10_000])
    y = host_gemv_grouped_ffn(fast_lib, x, offsets, slots, pool)
    want = r64.moe_grouped_ffn(x[:12], offsets[:6], slots[:5], pool)
    err = r64.relative_error(y[:12], want)
    print(f"{arch} layer {layer}: GEMV rel err {err:.2e} (bound {GEMV_BOUND:g})")
    assert err <= GEMV_BOUND, err
    assert not y[12].any()


def test_quant_fast_decode_kernels_on_the_host_match_the_float64_reference(fast_lib, gguf_files):
    """The decode pair (gate/up of all K experts through ids and the slot map, one x; down with the routing
    weights summed in k order, added to out) against float64; a routed expert outside the pool gives NaN."""
    from strata_cuda.quant_ffn import FAST_WARPS
    pool = read_moe_tensors(gguf_files["gpt-oss"]).experts.for_layer(1)  # biases: both bias paths run
    fmt = pool.fmt
    blob = np.ascontiguousarray(pool.arrays["blob"])
    h, f, k = fmt.hidden, fmt.ffn, 3
    rng = np.random.default_rng(9)
    x = rng.standard_normal((1, h)).astype(np.float32)
    slot_map = np.array([8 + e for e in range(8)], np.int32)[::-1].copy()  # expert e in slot 15 - e
    ids = np.array([5, 0, 6], np.int32)
    wts = np.array([0.5, 0.3, 0.2], np.float32)
    act = np.full((k, f), np.nan, np.float32)
    out = rng.standard_normal((1, h)).astype(np.float32)
    out0 = out.copy()
    ll, i32, u = ctypes.c_longlong, ctypes.c_int, ctypes.c_uint
    bias = ll(fmt.bias_offset)

    def run(smap):
        fast_lib.host_gemv_gate_up(u(-(-f // FAST_WARPS)), u(k), pointer(x), ll(0), None, pointer(ids), pointer(smap),
                                   i32(blob.shape[0]), i32(h), i32(f), pointer(blob), ll(blob.shape[1]),
                                   ll(fmt.gate_up_row_bytes), i32(GGML_TYPES[fmt.gate_up]), bias, i32(1), pointer(act))
        fast_lib.host_decode_down(u(-(-h // FAST_WARPS)), pointer(act), pointer(ids), pointer(wts), pointer(smap), i32(blob.shape[0]),
                                  i32(k), i32(h), i32(f), pointer(blob), ll(blob.shape[1]), ll(fmt.down_offset),
                                  ll(fmt.down_row_bytes), i32(GGML_TYPES[fmt.down]), bias, i32(1), pointer(out))

    run(slot_map)
    ys = r64.moe_grouped_ffn(np.repeat(x, k, 0), np.arange(k + 1), slot_map[ids], pool)
    want = out0.astype(np.float64) + (wts.astype(np.float64)[:, None] * ys).sum(0)
    err = r64.relative_error(out - out0, want - out0)
    print(f"decode pair rel err {err:.2e} (bound {GEMV_BOUND:g})")
    assert err <= GEMV_BOUND, err
    bad = slot_map.copy()
    bad[6] = 10_000
    run(bad)
    assert np.isnan(out).all()


def test_quant_fast_cu_compiles_with_nvrtc():
    nvrtc_or_skip()
    import re

    from strata_cuda.quant_ffn import FAST_KERNEL_NAMES, FAST_SOURCE_NAME, compile_to_ptx
    ptx = compile_to_ptx("compute_90", FAST_SOURCE_NAME).decode()
    assert sorted(re.findall(r"\.entry\s+(\w+)", ptx)) == sorted(FAST_KERNEL_NAMES)
    assert "shfl.sync.bfly" in ptx


@pytest.mark.parametrize("pad", [0, 3, 2], ids=["aligned", "odd", "even"])
@pytest.mark.parametrize("fmt", ["q4_k", "q6_k", "q5_k", "mxfp4"])
def test_the_piece_dequantization_is_the_f16_of_the_oracle_bit_for_bit(fast_lib, fmt, pad):
    """strata_qf_dequant_f16_part's rows r0.. and chunks c0.. (a gate/up piece's rows, a down piece's K block) are
    numpy's float16 of quants.dequantize of the same weights, bit for bit, with slots 0, 2 and 3 bytes off a
    16-byte boundary (the funnel-shifted 4-byte loads of qf_load32 at both odd and even offsets)."""
    from strata_core.reference import quants
    rng = np.random.default_rng(11)
    rows, cols, m = 7, 768, 2
    w = rng.standard_normal((m, rows, cols)).astype(np.float32) * np.float32(0.05)
    raw = quants.quantize(fmt, w)
    rb = raw.shape[-1]
    sb = rows * rb + pad + 10
    blob = np.zeros(pad + m * sb + 64, np.uint8)[pad:][:m * sb].reshape(m, sb)
    blob[:, pad:pad + rows * rb] = raw.reshape(m, -1)
    slots = np.array([1, 0], np.int32)
    full = quants.dequantize(fmt, raw[slots], cols).astype(np.float16).view(np.uint16)
    r0, nrows, c0, ccols = 2, 4, 9, 11  # chunks 9..19: across a 256-weight super-block boundary
    out = np.full((m, nrows, 32 * ccols), 0x7e00, np.uint16)
    ll, i32 = ctypes.c_longlong, ctypes.c_int
    fast_lib.host_dequant_part(ctypes.c_uint(1), pointer(blob), ll(sb), pointer(slots), i32(m), ll(pad), ll(rb), i32(nrows),
                          i32(r0), i32(c0), i32(ccols), i32(GGML_TYPES[fmt]), pointer(out))
    want = full[:, r0:r0 + nrows, 32 * c0:32 * (c0 + ccols)]
    mism = int(np.count_nonzero(out != want))
    assert mism == 0, f"{fmt}: {mism} of {out.size} f16 weights differ"


def test_the_wide_decode_down_kernel_matches_the_float64_reference(fast_lib, tmp_path):
    """strata_qf_decode_down_wide (QF_DW warps a row) over K routed experts of a Q4_K_M file: out += sum_k w_k
    (act_k . Wd_k), f32 sums of exact weights within 1e-6 of float64; an expert outside the pool gives NaN."""
    from strata_core.models.gguf import q4_k_m_down_types, read_moe_tensors, write_moe_gguf
    from strata_cuda.quant_ffn import DECODE_DOWN_ROWS
    path = write_moe_gguf(tmp_path / "q.gguf", seed=3, arch="qwen3moe", layers=3, gate_up="q4_k",
                          down=q4_k_m_down_types(3))
    pool = read_moe_tensors(path).experts.for_layer(2)
    fmt = pool.fmt
    assert fmt.down == "q6_k"
    blob = np.ascontiguousarray(pool.arrays["blob"])
    h, f, k = fmt.hidden, fmt.ffn, 3
    rng = np.random.default_rng(4)
    act = rng.standard_normal((k, f)).astype(np.float32)
    slot_map = (16 + np.arange(8, dtype=np.int32))[::-1].copy()
    ids = np.array([6, 1, 3], np.int32)
    wts = np.array([0.5, 0.3, 0.2], np.float32)
    out0 = rng.standard_normal((1, h)).astype(np.float32)
    out = out0.copy()
    ll, i32, u = ctypes.c_longlong, ctypes.c_int, ctypes.c_uint

    def run(smap):
        fast_lib.host_decode_down_wide(u(-(-h // DECODE_DOWN_ROWS)), pointer(act), pointer(ids), pointer(wts), pointer(smap),
                                  i32(blob.shape[0]), i32(k), i32(h), i32(f), pointer(blob), ll(blob.shape[1]),
                                  ll(fmt.down_offset), ll(fmt.down_row_bytes), i32(GGML_TYPES[fmt.down]), ll(-1),
                                  i32(1), pointer(out))

    run(slot_map)
    from strata_core.reference import quants
    want = out0.astype(np.float64)
    for j in range(k):
        row = blob[slot_map[ids[j]], fmt.down_offset:fmt.down_offset + h * fmt.down_row_bytes]
        wd = quants.dequantize("q6_k", row.reshape(h, fmt.down_row_bytes), f).astype(np.float64)
        want = want + float(wts[j]) * (wd @ act[j].astype(np.float64))
    err = float(np.linalg.norm(out - want) / np.linalg.norm(want - out0))
    assert err <= 1e-6, err
    bad = slot_map.copy()
    bad[3] = 10_000
    run(bad)
    assert np.isnan(out).all()
