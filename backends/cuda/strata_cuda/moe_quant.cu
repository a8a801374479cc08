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
