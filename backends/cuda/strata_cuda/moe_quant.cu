// The grouped SwiGLU FFN over 'gguf' expert pools (strata_core.api.kernels.ExpertFormat): every expert slot holds its
// GGUF rows as the file stores them (Q4_K, Q5_K, Q6_K, MXFP4, Q8_0, f16, bf16, f32), and the weights are dequantized
// by quants.cuh's dq_weight one tile at a time into shared memory, inside the GEMM: never an f16 copy of an expert.
//
// Two tiled GEMMs per call, each over a host-built tile list (one entry per QT_M rows of one group, so a block's rows
// share one expert slot):
//   strata_quant_gate_up: act[r, f] = silu(x[r] . gate_f + bg[f]) * (x[r] . up_f + bu[f])     (act [N, F] f32)
//   strata_quant_down:    y[r, h]   = act[r] . down_h + bd[h]                                  (y [N, H] f32)
// A block computes QT_M rows x QT_N outputs with QT_THREADS threads (each QT_R x QT_R outputs in registers); per
// QT_K-wide step it stages the activations and the dequantized weights in shared memory; f32 accumulation.
// Biases (gpt-oss) are f32 at bias_off bytes into the slot: gate [F], up [F], down [H]; bias_off < 0: none.
//
// Portability as moe.cu: no warp intrinsics, no atomics, no headers beyond quants.cuh (found with -I on the
// package directory), so hiprtc can build the same text.

#define STRATA_QUANTS_NO_TEST_KERNEL
#include "quants.cuh"

#define QT_M 64
#define QT_N 64
#define QT_K 32
#define QT_R 4
#define QT_THREADS 256

__device__ __forceinline__ float qt_silu(float v) { return v / (1.0f + expf(-v)); }

// Rows [r0, r1) of one group, all of whose weights sit at `w` (a slot's matrix: rows of `rb` bytes).
// NW = 2: outputs o take rows o (gate) and `second + o` (up) of the matrix; NW = 1: row o only.
template <int NW>
__device__ __forceinline__ void qt_tile(const float* a, int lda, int r0, int r1, int K, const unsigned char* w,
                                        long long rb, int fmt, int o0, int O, int second,
                                        float acc[NW][QT_R][QT_R]) {
    __shared__ float as[QT_K][QT_M + 1];
    __shared__ float ws[NW][QT_K][QT_N + 1];
    const int tid = threadIdx.x, tx = tid % (QT_N / QT_R), ty = tid / (QT_N / QT_R);
    for (int v = 0; v < NW; ++v)
        for (int i = 0; i < QT_R; ++i)
            for (int j = 0; j < QT_R; ++j) acc[v][i][j] = 0.0f;
    for (int k0 = 0; k0 < K; k0 += QT_K) {
        for (int e = tid; e < QT_M * QT_K; e += QT_THREADS) {
            const int m = e / QT_K, k = e % QT_K, r = r0 + m;
            as[k][m] = (r < r1 && k0 + k < K) ? a[(long long)r * lda + k0 + k] : 0.0f;
        }
        for (int e = tid; e < QT_N * QT_K; e += QT_THREADS) {
            // consecutive threads read consecutive weights of one row: its bytes are read together
            const int n = e / QT_K, k = e % QT_K, o = o0 + n;
            const bool ok = o < O && k0 + k < K;
            for (int v = 0; v < NW; ++v)
                ws[v][k][n] = ok ? dq_weight(w + (long long)(o + v * second) * rb, k0 + k, fmt) : 0.0f;
        }
        __syncthreads();
        for (int k = 0; k < QT_K; ++k) {
            float av[QT_R];
            for (int i = 0; i < QT_R; ++i) av[i] = as[k][ty + i * (QT_M / QT_R)];
            for (int v = 0; v < NW; ++v)
                for (int j = 0; j < QT_R; ++j) {
                    const float wv = ws[v][k][tx + j * (QT_N / QT_R)];
                    for (int i = 0; i < QT_R; ++i) acc[v][i][j] += av[i] * wv;
                }
        }
        __syncthreads();
    }
}

// blockIdx.x: a QT_N-wide slice of the F outputs; blockIdx.y: a tile of the list (group tile_group[t], rows
// tile_row0[t] up to QT_M more within the group).
extern "C" __global__ void strata_quant_gate_up(const float* x, const int* offsets, const int* slots,
                                                const int* tile_group, const int* tile_row0, int n_slots, int H,
                                                int F, const unsigned char* blob, long long slot_bytes, long long rb,
                                                int fmt, long long bias_off, float* act) {
    const int t = blockIdx.y, g = tile_group[t], r0 = tile_row0[t];
    const int r1 = min(offsets[g + 1], r0 + QT_M), f0 = blockIdx.x * QT_N, s = slots[g];
    const int tid = threadIdx.x, tx = tid % (QT_N / QT_R), ty = tid / (QT_N / QT_R);
    if (s < 0 || s >= n_slots) {  // a slot outside the pool: its rows' outputs are zero, as in the reference
        for (int i = 0; i < QT_R; ++i)
            for (int j = 0; j < QT_R; ++j) {
                const int r = r0 + ty + i * (QT_M / QT_R), f = f0 + tx + j * (QT_N / QT_R);
                if (r < r1 && f < F) act[(long long)r * F + f] = 0.0f;
            }
        return;
    }
    const unsigned char* w = blob + (long long)s * slot_bytes;
    float acc[2][QT_R][QT_R];
    qt_tile<2>(x, H, r0, r1, H, w, rb, fmt, f0, F, F, acc);
    for (int i = 0; i < QT_R; ++i)
        for (int j = 0; j < QT_R; ++j) {
            const int r = r0 + ty + i * (QT_M / QT_R), f = f0 + tx + j * (QT_N / QT_R);
            if (r >= r1 || f >= F) continue;
            float a = acc[0][i][j], b = acc[1][i][j];
            if (bias_off >= 0) {
                a += dq_f32(w + bias_off, f);
                b += dq_f32(w + bias_off, F + f);
            }
            act[(long long)r * F + f] = qt_silu(a) * b;
        }
}

extern "C" __global__ void strata_quant_down(const float* act, const int* offsets, const int* slots,
                                             const int* tile_group, const int* tile_row0, int n_slots, int H, int F,
                                             const unsigned char* blob, long long slot_bytes, long long down_off,
                                             long long rb, int fmt, long long bias_off, float* y) {
    const int t = blockIdx.y, g = tile_group[t], r0 = tile_row0[t];
    const int r1 = min(offsets[g + 1], r0 + QT_M), h0 = blockIdx.x * QT_N, s = slots[g];
    const int tid = threadIdx.x, tx = tid % (QT_N / QT_R), ty = tid / (QT_N / QT_R);
    if (s < 0 || s >= n_slots) {
        for (int i = 0; i < QT_R; ++i)
            for (int j = 0; j < QT_R; ++j) {
                const int r = r0 + ty + i * (QT_M / QT_R), h = h0 + tx + j * (QT_N / QT_R);
                if (r < r1 && h < H) y[(long long)r * H + h] = 0.0f;
            }
        return;
    }
    const unsigned char* w = blob + (long long)s * slot_bytes;
    float acc[1][QT_R][QT_R];
    qt_tile<1>(act, F, r0, r1, F, w + down_off, rb, fmt, h0, H, 0, acc);
    for (int i = 0; i < QT_R; ++i)
        for (int j = 0; j < QT_R; ++j) {
            const int r = r0 + ty + i * (QT_M / QT_R), h = h0 + tx + j * (QT_N / QT_R);
            if (r >= r1 || h >= H) continue;
            const float v = acc[0][i][j];
            y[(long long)r * H + h] = bias_off >= 0 ? v + dq_f32(w + bias_off, 2 * F + h) : v;
        }
}

// ---------------------------------------------------------------------------------------------------------------
// Tensor-core variant (CUDA only, sm_80 and later): the same tiles, but the staged activations and dequantized
// weights are rounded to f16 in shared memory and multiplied by mma.sync m16n8k16 (f16 inputs, f32 accumulation),
// the f16 precision path. 128 threads: four warps, each a 32 x 32 corner of the 64 x 64 block tile. A host build
// (tests/quant/test_quant_cuda_host.py) defines QT_HOST_MMA and supplies qt_mma_host, an emulation of the
// instruction over the warp's fragments as the PTX ISA lays them out.
// ---------------------------------------------------------------------------------------------------------------
#if !defined(__HIPCC_RTC__) && !defined(__HIP_PLATFORM_AMD__)

#define QM_THREADS 128
#define QM_KP (QT_K + 8)  // the k stride of the shared f16 tiles: conflict-free fragment reads

// f32 -> binary16 bits, round to nearest even (as moe.cu's strata_f2h)
__device__ __forceinline__ unsigned short qt_f2h(float f) {
    const unsigned int x = __float_as_uint(f);
    const unsigned int sign = (x >> 16) & 0x8000u;
    const unsigned int ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (unsigned short)(sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u));
    if (ax >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);
    if (ax < 0x38800000u) return (unsigned short)(sign | (unsigned int)rintf(__uint_as_float(ax) * 16777216.0f));
    const unsigned int rounded = ax + 0x0fffu + ((ax >> 13) & 1u);
    return (unsigned short)(sign | ((rounded - 0x38000000u) >> 13));
}

// c += A (16x16, row-major fragments a) x B (16x8, column-major fragments b)
__device__ __forceinline__ void qt_mma(float c[4], const unsigned int a[4], const unsigned int b[2]) {
#if defined(QT_HOST_MMA)
    qt_mma_host(c, a, b);
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// acc[v][mt][nt][i]: matrix v, the warp's m16 tile mt and n8 tile nt; element i at row g (+8 for i >= 2) and
// column 2t + (i & 1) of that tile, g = lane / 4, t = lane % 4.
template <int NW>
__device__ __forceinline__ void qt_tile_mma(const float* a, int lda, int r0, int r1, int K, const unsigned char* w,
                                            long long rb, int fmt, int o0, int O, int second,
                                            float acc[NW][2][4][4]) {
    __shared__ unsigned short as[QT_M][QM_KP];
    __shared__ unsigned short ws[NW][QT_N][QM_KP];
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int g = lane / 4, t = lane % 4, wm = (warp % 2) * 32, wn = (warp / 2) * 32;
    for (int v = 0; v < NW; ++v)
        for (int mt = 0; mt < 2; ++mt)
            for (int nt = 0; nt < 4; ++nt)
                for (int i = 0; i < 4; ++i) acc[v][mt][nt][i] = 0.0f;
    for (int k0 = 0; k0 < K; k0 += QT_K) {
        for (int e = tid; e < QT_M * QT_K; e += QM_THREADS) {
            const int m = e / QT_K, k = e % QT_K, r = r0 + m;
            as[m][k] = qt_f2h((r < r1 && k0 + k < K) ? a[(long long)r * lda + k0 + k] : 0.0f);
        }
        for (int e = tid; e < QT_N * QT_K; e += QM_THREADS) {
            const int n = e / QT_K, k = e % QT_K, o = o0 + n;
            const bool ok = o < O && k0 + k < K;
            for (int v = 0; v < NW; ++v)
                ws[v][n][k] = qt_f2h(ok ? dq_weight(w + (long long)(o + v * second) * rb, k0 + k, fmt) : 0.0f);
        }
        __syncthreads();
        for (int kk = 0; kk < QT_K; kk += 16) {
            unsigned int fa[2][4];
            for (int mt = 0; mt < 2; ++mt) {
                const int row = wm + mt * 16 + g;
                fa[mt][0] = *(const unsigned int*)&as[row][kk + 2 * t];
                fa[mt][1] = *(const unsigned int*)&as[row + 8][kk + 2 * t];
                fa[mt][2] = *(const unsigned int*)&as[row][kk + 2 * t + 8];
                fa[mt][3] = *(const unsigned int*)&as[row + 8][kk + 2 * t + 8];
            }
            for (int v = 0; v < NW; ++v)
                for (int nt = 0; nt < 4; ++nt) {
                    const int col = wn + nt * 8 + g;
                    const unsigned int fb[2] = {*(const unsigned int*)&ws[v][col][kk + 2 * t],
                                                *(const unsigned int*)&ws[v][col][kk + 2 * t + 8]};
                    for (int mt = 0; mt < 2; ++mt) qt_mma(acc[v][mt][nt], fa[mt], fb);
                }
        }
        __syncthreads();
    }
}

extern "C" __global__ void strata_quant_gate_up_mma(const float* x, const int* offsets, const int* slots,
                                                    const int* tile_group, const int* tile_row0, int n_slots, int H,
                                                    int F, const unsigned char* blob, long long slot_bytes,
                                                    long long rb, int fmt, long long bias_off, float* act) {
    const int tb = blockIdx.y, grp = tile_group[tb], r0 = tile_row0[tb];
    const int r1 = min(offsets[grp + 1], r0 + QT_M), f0 = blockIdx.x * QT_N, s = slots[grp];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, t = lane % 4, wm = (warp % 2) * 32, wn = (warp / 2) * 32;
    const bool valid = s >= 0 && s < n_slots;  // the same for the whole block
    const unsigned char* w = blob + (long long)(valid ? s : 0) * slot_bytes;
    float acc[2][2][4][4];
    if (valid) qt_tile_mma<2>(x, H, r0, r1, H, w, rb, fmt, f0, F, F, acc);
    for (int mt = 0; mt < 2; ++mt)
        for (int nt = 0; nt < 4; ++nt)
            for (int i = 0; i < 4; ++i) {
                const int r = r0 + wm + mt * 16 + g + (i >= 2 ? 8 : 0), f = f0 + wn + nt * 8 + 2 * t + (i & 1);
                if (r >= r1 || f >= F) continue;
                if (!valid) {
                    act[(long long)r * F + f] = 0.0f;
                    continue;
                }
                float av = acc[0][mt][nt][i], bv = acc[1][mt][nt][i];
                if (bias_off >= 0) {
                    av += dq_f32(w + bias_off, f);
                    bv += dq_f32(w + bias_off, F + f);
                }
                act[(long long)r * F + f] = qt_silu(av) * bv;
            }
}

extern "C" __global__ void strata_quant_down_mma(const float* act, const int* offsets, const int* slots,
                                                 const int* tile_group, const int* tile_row0, int n_slots, int H,
                                                 int F, const unsigned char* blob, long long slot_bytes,
                                                 long long down_off, long long rb, int fmt, long long bias_off,
                                                 float* y) {
    const int tb = blockIdx.y, grp = tile_group[tb], r0 = tile_row0[tb];
    const int r1 = min(offsets[grp + 1], r0 + QT_M), h0 = blockIdx.x * QT_N, s = slots[grp];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, t = lane % 4, wm = (warp % 2) * 32, wn = (warp / 2) * 32;
    const bool valid = s >= 0 && s < n_slots;
    const unsigned char* w = blob + (long long)(valid ? s : 0) * slot_bytes;
    float acc[1][2][4][4];
    if (valid) qt_tile_mma<1>(act, F, r0, r1, F, w + down_off, rb, fmt, h0, H, 0, acc);
    for (int mt = 0; mt < 2; ++mt)
        for (int nt = 0; nt < 4; ++nt)
            for (int i = 0; i < 4; ++i) {
                const int r = r0 + wm + mt * 16 + g + (i >= 2 ? 8 : 0), h = h0 + wn + nt * 8 + 2 * t + (i & 1);
                if (r >= r1 || h >= H) continue;
                if (!valid) {
                    y[(long long)r * H + h] = 0.0f;
                    continue;
                }
                const float v = acc[0][mt][nt][i];
                y[(long long)r * H + h] = bias_off >= 0 ? v + dq_f32(w + bias_off, 2 * F + h) : v;
            }
}

#endif
