// The fast kernels of 'gguf' expert pools on CUDA (issue 14): quants.cuh's formats decoded 32 weights at a time.
//
// - strata_qf_dequant_f16: m experts' matrices (one of gate|up or down, slots from a table) to f16 rows in a
//   scratch the caller sizes for a bounded group of experts, so cuBLAS' tensor-core GEMMs (strata_cuda.fast) run on
//   them: the f16 value of every weight is the round-to-nearest-even f16 of quants.cuh's exact f32 weight.
// - strata_qf_gemv_gate_up / strata_qf_gemv_down: the grouped FFN for groups of a few rows (decode), straight from
//   the quant blocks: each warp reads a row's blocks once, decodes them in registers and dots them with the rows
//   of x (f32 accumulation of exact weights). Rows of a group are taken QF_R at a time.
// - strata_qf_decode_down: one token's down projection over all its K experts: out[h] (+)= sum_k w_k (act_k . Wd_h)
//   (the routing weights applied in k order, one write per h, no atomics), so a decode step is route + gate/up +
//   down, no host sync, capturable in a graph.
// A "chunk" is 32 consecutive weights of a row (H and F are multiples of 32): one block of q8_0/mxfp4, one
// sub-block of the K formats. CUDA only (warp shuffles); the portable tiled kernels are moe_quant.cu.

#define STRATA_QUANTS_NO_TEST_KERNEL
#include "quants.cuh"

#define QF_WARP 32
#define QF_THREADS 256
#define QF_WARPS (QF_THREADS / QF_WARP)
#define QF_R 4  // rows of a group one pass of the GEMV kernels takes

// f32 -> binary16 bits, round to nearest even (moe_quant.cu's qt_f2h; numpy's astype(float16) rounds the same way)
__device__ __forceinline__ unsigned int qf_f2h(float f) {
    const unsigned int x = __float_as_uint(f);
    const unsigned int sign = (x >> 16) & 0x8000u;
    const unsigned int ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u);
    if (ax >= 0x477ff000u) return sign | 0x7c00u;
    if (ax < 0x38800000u) return sign | (unsigned int)rintf(__uint_as_float(ax) * 16777216.0f);
    const unsigned int rounded = ax + 0x0fffu + ((ax >> 13) & 1u);
    return sign | ((rounded - 0x38000000u) >> 13);
}

// Two f32 -> one word of two binary16 (lo in the low half), round to nearest even: one cvt.rn.f16x2.f32 on the GPU;
// the host build (QF_HOST) uses qf_f2h, which rounds the same way.
__device__ __forceinline__ unsigned int qf_pack_h2(float lo, float hi) {
#if defined(QF_HOST)
    return qf_f2h(lo) | (qf_f2h(hi) << 16);
#else
    unsigned int r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#endif
}

// A small non-negative int as float, exactly (q < 2^23), by its bits: no int-to-float conversion, a quarter-rate
// instruction on the SMs.
__device__ __forceinline__ float qf_small(unsigned int q) {
    return __fsub_rn(__uint_as_float(0x4b000000u | q), 8388608.0f);
}

// 32 bytes at p as 8 little-endian words: two 16-byte loads where p is 16-aligned (q4_k/q5_k rows of aligned slots),
// else nine aligned 4-byte words funnel-shifted into place (a q6_k block is 210 bytes, so its fields are often
// unaligned; byte loads took 32 load instructions a field and most of the dequantization's time). The ninth word
// holds byte p+31, so no load leaves the words the 32 bytes touch.
#if defined(QF_HOST)
#define QF_LDG(p) (*(p))
#else
#define QF_LDG(p) __ldg(p)  // read-only path: the pointer came through an integer, so say it is global memory
#endif

__device__ __forceinline__ void qf_load32(const unsigned char* p, unsigned int w[8]) {
    const unsigned long long a = (unsigned long long)p;
    if ((a & 15ull) == 0ull) {
        const uint4 x = ((const uint4*)p)[0], y = ((const uint4*)p)[1];
        w[0] = x.x; w[1] = x.y; w[2] = x.z; w[3] = x.w; w[4] = y.x; w[5] = y.y; w[6] = y.z; w[7] = y.w;
        return;
    }
    const unsigned int* q = (const unsigned int*)(a & ~3ull);
    const unsigned int sh = 8u * (unsigned int)(a & 3ull);
    if (sh == 0u) {
#pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = QF_LDG(q + i);
        return;
    }
    unsigned int lo = QF_LDG(q);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const unsigned int hi = QF_LDG(q + i + 1);
        w[i] = (unsigned int)((((unsigned long long)hi << 32) | lo) >> sh);
        lo = hi;
    }
}

__device__ __forceinline__ unsigned int qf_byte(const unsigned int w[8], int l) {
    return (w[l >> 2] >> (8 * (l & 3))) & 0xffu;
}

// Weights 32c .. 32c+31 of a row of type fmt, the same f32 bits as quants.cuh's dq_weight of each.
__device__ __forceinline__ void qf_chunk(const unsigned char* row, int c, int fmt, float v[32]) {
    if (fmt == DQ_TYPE_Q4_K || fmt == DQ_TYPE_Q5_K) {
        const bool five = fmt == DQ_TYPE_Q5_K;
        const unsigned char* b = row + (long long)(c >> 3) * (five ? DQ_Q5_K_BYTES : DQ_Q4_K_BYTES);
        const int sub = c & 7;
        unsigned int sc, m;
        dq_k_scale_min(b + 4, sub, &sc, &m);
        const float scale = __fmul_rn(dq_half_at(b), (float)sc);
        const float minv = __fmul_rn(dq_half_at(b + 2), (float)m);
        unsigned int qs[8], qh[8];
        qf_load32(b + (five ? 48 : 16) + (sub >> 1) * 32, qs);
        if (five) qf_load32(b + 16, qh);
        const int shift = (sub & 1) * 4;
#pragma unroll
        for (int l = 0; l < 32; ++l) {
            unsigned int q = (qf_byte(qs, l) >> shift) & 15u;
            if (five) q |= ((qf_byte(qh, l) >> sub) & 1u) << 4;
            v[l] = __fsub_rn(__fmul_rn(scale, qf_small(q)), minv);
        }
        return;
    }
    if (fmt == DQ_TYPE_Q6_K) {
        const unsigned char* b = row + (long long)(c >> 3) * DQ_Q6_K_BYTES;
        const int j = c & 7, h = j >> 2, g = j & 3;
        unsigned int ql[8], qh[8];
        qf_load32(b + h * 64 + (g & 1) * 32, ql);
        qf_load32(b + 128 + h * 32, qh);
        const float d = dq_half_at(b + 208);
        const float s0 = __fmul_rn(d, (float)(signed char)b[192 + 2 * j]);
        const float s1 = __fmul_rn(d, (float)(signed char)b[192 + 2 * j + 1]);
        const int lshift = (g < 2) ? 0 : 4;
#pragma unroll
        for (int l = 0; l < 32; ++l) {
            const unsigned int low = (qf_byte(ql, l) >> lshift) & 15u;
            const unsigned int high = (qf_byte(qh, l) >> (2 * g)) & 3u;
            // (float)(q - 32), exact either way
            v[l] = __fmul_rn(l < 16 ? s0 : s1, __fsub_rn(qf_small(low | (high << 4)), 32.0f));
        }
        return;
    }
    if (fmt == DQ_TYPE_Q8_0) {
        const unsigned char* b = row + (long long)c * DQ_Q8_0_BYTES;
        const float d = dq_half_at(b);
#pragma unroll
        for (int l = 0; l < 32; ++l) v[l] = __fmul_rn((float)(signed char)b[2 + l], d);
        return;
    }
    // mxfp4 (its subnormal scales need quants.cuh's care), f32, f16, bf16: weight by weight, fully unrolled so that
    // v stays in registers (a runtime index would put it in local memory for every format)
    if (fmt == DQ_TYPE_MXFP4) {
#pragma unroll
        for (int l = 0; l < 32; ++l) v[l] = dq_mxfp4(row, 32 * c + l);
    } else if (fmt == DQ_TYPE_F16) {
#pragma unroll
        for (int l = 0; l < 32; ++l) v[l] = dq_f16(row, 32 * c + l);
    } else if (fmt == DQ_TYPE_BF16) {
#pragma unroll
        for (int l = 0; l < 32; ++l) v[l] = dq_bf16(row, 32 * c + l);
    } else if (fmt == DQ_TYPE_F32) {
#pragma unroll
        for (int l = 0; l < 32; ++l) v[l] = dq_f32(row, 32 * c + l);
    } else {
#pragma unroll
        for (int l = 0; l < 32; ++l) v[l] = __uint_as_float(0x7fc00000u);  // a type this file does not know
    }
}

__device__ __forceinline__ float qf_dot32(const float v[32], const float* x) {
    const float4* x4 = (const float4*)x;
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const float4 a = x4[i];
        s += v[4 * i] * a.x + v[4 * i + 1] * a.y + v[4 * i + 2] * a.z + v[4 * i + 3] * a.w;
    }
    return s;
}

__device__ __forceinline__ float qf_warp_sum(float v) {
#if defined(QF_HOST)
    return qf_host_warp_sum(v);  // the host build's shim: one exchange of the 32 lanes instead of five
#else
#pragma unroll
    for (int m = QF_WARP / 2; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
    return v;
#endif
}

__device__ __forceinline__ float qf_silu(float v) { return v / (1.0f + expf(-v)); }

// Select word q (0..3) of four uint4 without a runtime index (one would put them in local memory).
__device__ __forceinline__ uint4 qf_pick(const uint4 p[4], unsigned int q) {
    return q == 0u ? p[0] : q == 1u ? p[1] : q == 2u ? p[2] : p[3];
}

// out[e] = f16 of rows r0 .. r0+rows-1, chunks c0 .. c0+ccols-1 of the matrix at mat_off bytes into slot slots[e]
// (rows of rb bytes), as [rows, 32 * ccols]; blockIdx.y is e, a lane per chunk, a warp per 32 consecutive chunks,
// grid-stride in 32-bit indices. Chunk i's 64 output bytes are at 64 i, so a warp's 32 chunks are 2 KB in a row:
// they go through shared memory (each lane's four 16-byte words written in a lane-rotated order, free of bank
// conflicts) and out as four stores of 512 consecutive bytes, not 32 lanes each writing 64 bytes apart.
// out is 16-byte aligned. blockDim.x is QF_THREADS.
__device__ __forceinline__ void qf_dequant_part(const unsigned char* __restrict__ blob, long long slot_bytes,
                                                const int* __restrict__ slots, long long mat_off, long long rb,
                                                int rows, int r0, int c0, int ccols, int fmt,
                                                unsigned short* __restrict__ out) {
    __shared__ uint4 s_out[QF_WARPS][4 * QF_WARP];
    const int e = blockIdx.y, per = rows * ccols;
    const int warp = threadIdx.x / QF_WARP, lane = threadIdx.x % QF_WARP;
    const unsigned char* mat = blob + (long long)slots[e] * slot_bytes + mat_off + (long long)r0 * rb;
    uint4* dst0 = (uint4*)(out + (long long)e * per * 32);
    for (int i0 = blockIdx.x * QF_THREADS + warp * QF_WARP; i0 < per; i0 += gridDim.x * QF_THREADS) {
        const int i = i0 + lane;
        if (i < per) {
            const int r = i / ccols, c = i - r * ccols;
            float v[32];
            qf_chunk(mat + (long long)r * rb, c0 + c, fmt, v);
            uint4 p[4];
#pragma unroll
            for (int q = 0; q < 4; ++q)
                p[q] = make_uint4(qf_pack_h2(v[8 * q], v[8 * q + 1]), qf_pack_h2(v[8 * q + 2], v[8 * q + 3]),
                                  qf_pack_h2(v[8 * q + 4], v[8 * q + 5]), qf_pack_h2(v[8 * q + 6], v[8 * q + 7]));
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const unsigned int w = (unsigned int)(q + (lane >> 1)) & 3u;
                s_out[warp][4 * lane + w] = qf_pick(p, w);
            }
        }
        __syncwarp();
        const int words = 4 * min(QF_WARP, per - i0);  // 16-byte words of the warp's chunks
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const int j = q * QF_WARP + lane;
            if (j < words) dst0[4 * (long long)i0 + j] = s_out[warp][j];
        }
        __syncwarp();
    }
}

// out[e] = f16 of the whole [rows, cols] matrix at mat_off bytes into slot slots[e]; cols a multiple of 32.
extern "C" __global__ void __launch_bounds__(QF_THREADS)
strata_qf_dequant_f16(const unsigned char* __restrict__ blob, long long slot_bytes, const int* __restrict__ slots,
                      int m, long long mat_off, long long rb, int rows, int cols, int fmt,
                      unsigned short* __restrict__ out) {
    qf_dequant_part(blob, slot_bytes, slots, mat_off, rb, rows, 0, 0, cols / 32, fmt, out);
}

// A piece of each matrix (QuantMoE's scratch when one expert's f16 does not fit it): rows r0.., chunks c0.. .
extern "C" __global__ void __launch_bounds__(QF_THREADS)
strata_qf_dequant_f16_part(const unsigned char* __restrict__ blob, long long slot_bytes,
                           const int* __restrict__ slots, int m, long long mat_off, long long rb, int rows, int r0,
                           int c0, int ccols, int fmt, unsigned short* __restrict__ out) {
    qf_dequant_part(blob, slot_bytes, slots, mat_off, rb, rows, r0, c0, ccols, fmt, out);
}

// ---- super-block dequantization (QuantMoE's prefill scratch; issue 14 item 5) --------------------------------
// A warp per 256 consecutive weights of a row (a q4_k/q5_k/q6_k super-block, eight q8_0 blocks), lane l its weights
// 8l .. 8l+7: each lane reads only the 8 or 16 bytes of quants its 8 weights need (the chunk kernel's lanes each
// read 32 bytes, twice what a q4_k sub-block uses) and stores one 16-byte word, so a warp writes 512 consecutive
// bytes straight from registers (no shared-memory staging). Two super-blocks a warp per pass, their loads issued
// before either is decoded, keep more bytes in flight. Both matrices of m experts in one launch.
// The f16 of every weight is the chunk kernel's (the same f32 steps, then round to nearest even).

// n bytes (n = 8 or 16) at p of any alignment as n/4 little-endian words: one vector load where p is n-aligned,
// else n/4 + 1 aligned words funnel-shifted into place (every word loaded holds a byte of [p, p + n)).
template <int N>
__device__ __forceinline__ void qf_loadw(const unsigned char* p, unsigned int w[N]) {
    const unsigned long long a = (unsigned long long)p;
    if (N == 4 && (a & 15ull) == 0ull) {
        const uint4 x = QF_LDG((const uint4*)p);
        w[0] = x.x; w[1] = x.y; w[2 % N] = x.z; w[3 % N] = x.w;
        return;
    }
    if (N == 2 && (a & 7ull) == 0ull) {
        const unsigned long long x = QF_LDG((const unsigned long long*)p);
        w[0] = (unsigned int)x; w[1 % N] = (unsigned int)(x >> 32);
        return;
    }
    const unsigned int* q = (const unsigned int*)(a & ~3ull);
    const unsigned int sh = 8u * (unsigned int)(a & 3ull);
    unsigned int lo = QF_LDG(q);
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const unsigned int hi = (sh == 0u && i == N - 1) ? 0u : QF_LDG(q + i + 1);
        w[i] = sh == 0u ? lo : (unsigned int)((((unsigned long long)hi << 32) | lo) >> sh);
        lo = hi;
    }
}

// The binary16 bits h as float (quants.cuh's dq_half_at of the same two bytes).
__device__ __forceinline__ float qf_half(unsigned int h) {
    const unsigned int sign = (h & 0x8000u) << 16;
    const unsigned int e = (h >> 10) & 0x1fu;
    const unsigned int m = h & 0x3ffu;
    if (e == 0u) return __uint_as_float(__float_as_uint(__fmul_rn((float)m, 5.9604644775390625e-8f)) | sign);
    if (e == 31u) return __uint_as_float(sign | 0x7f800000u | (m << 13));
    return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
}

// Byte k (0..11) of three words, without a runtime index into an array (that would go to local memory).
__device__ __forceinline__ unsigned int qf_byte12(unsigned int a, unsigned int b, unsigned int c, unsigned int k) {
    const unsigned int w = k < 4u ? a : (k < 8u ? b : c);
    return (w >> (8u * (k & 3u))) & 0xffu;
}

// What a lane loads of one super-block: up to 4 + 2 + 2 words (a header, then two 8-byte runs of quants).
struct qf_sb_raw {
    unsigned int h[4], a[2], b[2];
};

// Bytes of the 256 weights' blocks; 0 where this kernel does not take the format.
__device__ __forceinline__ int qf_sb_bytes(int fmt) {
    return fmt == DQ_TYPE_Q4_K ? DQ_Q4_K_BYTES : fmt == DQ_TYPE_Q5_K ? DQ_Q5_K_BYTES
         : fmt == DQ_TYPE_Q6_K ? DQ_Q6_K_BYTES : fmt == DQ_TYPE_Q8_0 ? 8 * DQ_Q8_0_BYTES : 0;
}

__device__ __forceinline__ void qf_sb_load(const unsigned char* b, int fmt, int lane, qf_sb_raw* r) {
    const int j = lane >> 2, q4 = lane & 3;  // the lane's 32-weight sub-block and its quarter of it
    if (fmt == DQ_TYPE_Q4_K || fmt == DQ_TYPE_Q5_K) {
        qf_loadw<4>(b, r->h);  // d, dmin, scales[12]
        qf_loadw<2>(b + (fmt == DQ_TYPE_Q5_K ? 48 : 16) + 32 * (j >> 1) + 8 * q4, r->a);  // qs
        if (fmt == DQ_TYPE_Q5_K) qf_loadw<2>(b + 16 + 8 * q4, r->b);  // qh
    } else if (fmt == DQ_TYPE_Q6_K) {
        const int hh = j >> 2, g = j & 3;
        qf_loadw<2>(b + 64 * hh + 32 * (g & 1) + 8 * q4, r->a);  // ql
        qf_loadw<2>(b + 128 + 32 * hh + 8 * q4, r->b);  // qh
        // the scale of the lane's 8 weights, and d: two bytes each, read as such (210-byte blocks: any alignment)
        const unsigned char* s = b + 192 + 2 * j + (q4 >> 1);
        r->h[0] = QF_LDG(s);
        r->h[1] = (unsigned int)QF_LDG(b + 208) | ((unsigned int)QF_LDG(b + 209) << 8);
    } else {  // q8_0: the lane's block j of eight, its d and 8 quants
        const unsigned char* blk = b + DQ_Q8_0_BYTES * j;
        r->h[0] = (unsigned int)QF_LDG(blk) | ((unsigned int)QF_LDG(blk + 1) << 8);
        qf_loadw<2>(blk + 2 + 8 * q4, r->a);
    }
}

// The lane's 8 weights as four f16x2 words, the same f32 steps as qf_chunk's.
__device__ __forceinline__ uint4 qf_sb_decode(const qf_sb_raw& r, int fmt, int lane) {
    const int j = lane >> 2;
    float v[8];
    if (fmt == DQ_TYPE_Q4_K || fmt == DQ_TYPE_Q5_K) {
        const unsigned int s0 = r.h[1], s1 = r.h[2], s2 = r.h[3], uj = (unsigned int)j;
        unsigned int sc, m;
        if (uj < 4u) {
            sc = qf_byte12(s0, s1, s2, uj) & 63u;
            m = qf_byte12(s0, s1, s2, uj + 4u) & 63u;
        } else {
            sc = (qf_byte12(s0, s1, s2, uj + 4u) & 15u) | ((qf_byte12(s0, s1, s2, uj - 4u) >> 6) << 4);
            m = (qf_byte12(s0, s1, s2, uj + 4u) >> 4) | ((qf_byte12(s0, s1, s2, uj) >> 6) << 4);
        }
        const float scale = __fmul_rn(qf_half(r.h[0] & 0xffffu), (float)sc);
        const float minv = __fmul_rn(qf_half(r.h[0] >> 16), (float)m);
        const unsigned int shift = (uj & 1u) * 4u;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            unsigned int q = (r.a[i >> 2] >> (8 * (i & 3) + shift)) & 15u;
            if (fmt == DQ_TYPE_Q5_K) q |= ((r.b[i >> 2] >> (8 * (i & 3) + j)) & 1u) << 4;
            v[i] = __fsub_rn(__fmul_rn(scale, qf_small(q)), minv);
        }
    } else if (fmt == DQ_TYPE_Q6_K) {
        const int g = j & 3;
        const float s = __fmul_rn(qf_half(r.h[1]), (float)(signed char)(unsigned char)r.h[0]);
        const unsigned int lshift = g < 2 ? 0u : 4u;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const unsigned int low = (r.a[i >> 2] >> (8 * (i & 3) + lshift)) & 15u;
            const unsigned int high = (r.b[i >> 2] >> (8 * (i & 3) + 2 * g)) & 3u;
            v[i] = __fmul_rn(s, __fsub_rn(qf_small(low | (high << 4)), 32.0f));
        }
    } else {
        const float d = qf_half(r.h[0]);
#pragma unroll
        for (int i = 0; i < 8; ++i)
            v[i] = __fmul_rn((float)(signed char)(unsigned char)((r.a[i >> 2] >> (8 * (i & 3))) & 0xffu), d);
    }
    return make_uint4(qf_pack_h2(v[0], v[1]), qf_pack_h2(v[2], v[3]), qf_pack_h2(v[4], v[5]),
                      qf_pack_h2(v[6], v[7]));
}

// out_a[e] = f16 of matrix a ([rows_a, cols_a] at off_a bytes into slot slots[e], rows of rb_a bytes), and the same
// of matrix b into out_b (rows_b 0: none); blockIdx.y is e (< m), a warp per row of either matrix (grid-stride over
// blockIdx.x), its super-blocks two at a time; cols multiples of 256, formats qf_sb_bytes takes (the caller checks:
// sb_takes in quant_ffn.py), out 16-byte aligned. No division anywhere: the first version's two 64-bit divisions
// per super-block made it issue-bound (1.02 ms for the Qwen3-30B-A3B layer against the chunk kernel's 0.65,
// bench/results/qw_h200/call1_qw_diag.json). blockDim.x is QF_THREADS.
extern "C" __global__ void __launch_bounds__(QF_THREADS)
strata_qf_dequant_sb(const unsigned char* __restrict__ blob, long long slot_bytes, const int* __restrict__ slots,
                     int m, long long off_a, long long rb_a, int rows_a, int cols_a, int fmt_a,
                     uint4* __restrict__ out_a, long long off_b, long long rb_b, int rows_b, int cols_b, int fmt_b,
                     uint4* __restrict__ out_b) {
    const int lane = threadIdx.x % QF_WARP, e = blockIdx.y;
    const unsigned char* slot = blob + (long long)slots[e] * slot_bytes;
    for (int r = blockIdx.x * QF_WARPS + threadIdx.x / QF_WARP; r < rows_a + rows_b; r += gridDim.x * QF_WARPS) {
        const bool b = r >= rows_a;
        const int rr = b ? r - rows_a : r, fmt = b ? fmt_b : fmt_a, spr = (b ? cols_b : cols_a) / 256;
        const int bsz = qf_sb_bytes(fmt);
        const unsigned char* src = slot + (b ? off_b + rr * rb_b : off_a + rr * rb_a);
        uint4* dst = (b ? out_b + ((long long)e * rows_b + rr) * (32 * spr)
                        : out_a + ((long long)e * rows_a + rr) * (32 * spr)) + lane;
        for (int k = 0; k < spr; k += 2) {
            // both super-blocks' loads first, then both decodes and stores
            qf_sb_raw r0, r1;
            const bool two = k + 1 < spr;
            qf_sb_load(src + k * bsz, fmt, lane, &r0);
            if (two) qf_sb_load(src + (k + 1) * bsz, fmt, lane, &r1);
            dst[32 * k] = qf_sb_decode(r0, fmt, lane);
            if (two) dst[32 * (k + 1)] = qf_sb_decode(r1, fmt, lane);
        }
    }
}

// ---- super-block dequantization with the formats fixed at compile time (DEQUANT_KERNEL "sbt") ---------------
// strata_qf_dequant_sb's rows, loads, decode and stores, one row loop per matrix with its format a template
// argument, so every format test of qf_sb_load / qf_sb_decode folds away and the loop holds only its format's
// instructions; one entry point per (gate|up, down) format pair of the K-quant files (QF_SBT_PAIRS), the rest
// take strata_qf_dequant_sb.
template <int FMT>
__device__ __forceinline__ void qf_sbt_row(const unsigned char* src, uint4* dst, int spr, int lane) {
    constexpr int bsz = FMT == DQ_TYPE_Q4_K ? DQ_Q4_K_BYTES : FMT == DQ_TYPE_Q5_K ? DQ_Q5_K_BYTES
                      : FMT == DQ_TYPE_Q6_K ? DQ_Q6_K_BYTES : 8 * DQ_Q8_0_BYTES;
    for (int k = 0; k < spr; k += 2) {
        qf_sb_raw r0, r1;
        const bool two = k + 1 < spr;
        qf_sb_load(src + k * bsz, FMT, lane, &r0);
        if (two) qf_sb_load(src + (k + 1) * bsz, FMT, lane, &r1);
        dst[32 * k] = qf_sb_decode(r0, FMT, lane);
        if (two) dst[32 * (k + 1)] = qf_sb_decode(r1, FMT, lane);
    }
}

template <int FA, int FB>
__device__ __forceinline__ void qf_dequant_sbt(const unsigned char* __restrict__ blob, long long slot_bytes,
                                               const int* __restrict__ slots, long long off_a, long long rb_a,
                                               int rows_a, int cols_a, uint4* __restrict__ out_a, long long off_b,
                                               long long rb_b, int rows_b, int cols_b, uint4* __restrict__ out_b) {
    const int lane = threadIdx.x % QF_WARP, e = blockIdx.y;
    const unsigned char* slot = blob + (long long)slots[e] * slot_bytes;
    for (int r = blockIdx.x * QF_WARPS + threadIdx.x / QF_WARP; r < rows_a + rows_b; r += gridDim.x * QF_WARPS) {
        if (r < rows_a) {
            const int spr = cols_a / 256;
            qf_sbt_row<FA>(slot + off_a + r * rb_a, out_a + ((long long)e * rows_a + r) * (32 * spr) + lane, spr, lane);
        } else {
            const int rr = r - rows_a, spr = cols_b / 256;
            qf_sbt_row<FB>(slot + off_b + rr * rb_b, out_b + ((long long)e * rows_b + rr) * (32 * spr) + lane, spr,
                           lane);
        }
    }
}

// strata_qf_dequant_sbt_<a>_<b>: strata_qf_dequant_sb's arguments less the two formats.
#define QF_SBT_KERNEL(NAME, FA, FB)                                                                            \
    extern "C" __global__ void __launch_bounds__(QF_THREADS)                                                   \
    NAME(const unsigned char* __restrict__ blob, long long slot_bytes, const int* __restrict__ slots, int m,    \
         long long off_a, long long rb_a, int rows_a, int cols_a, uint4* __restrict__ out_a, long long off_b,   \
         long long rb_b, int rows_b, int cols_b, uint4* __restrict__ out_b) {                                 \
        qf_dequant_sbt<FA, FB>(blob, slot_bytes, slots, off_a, rb_a, rows_a, cols_a, out_a, off_b, rb_b, rows_b, \
                               cols_b, out_b);                                                                 \
    }
QF_SBT_KERNEL(strata_qf_dequant_sbt_q4_k_q6_k, DQ_TYPE_Q4_K, DQ_TYPE_Q6_K)
QF_SBT_KERNEL(strata_qf_dequant_sbt_q5_k_q6_k, DQ_TYPE_Q5_K, DQ_TYPE_Q6_K)
QF_SBT_KERNEL(strata_qf_dequant_sbt_q6_k_q6_k, DQ_TYPE_Q6_K, DQ_TYPE_Q6_K)
QF_SBT_KERNEL(strata_qf_dequant_sbt_q4_k_q4_k, DQ_TYPE_Q4_K, DQ_TYPE_Q4_K)
QF_SBT_KERNEL(strata_qf_dequant_sbt_q5_k_q5_k, DQ_TYPE_Q5_K, DQ_TYPE_Q5_K)
QF_SBT_KERNEL(strata_qf_dequant_sbt_q8_0_q8_0, DQ_TYPE_Q8_0, DQ_TYPE_Q8_0)

// The group of blockIdx.y: its rows [r0, r1) and slot. offsets null: group g is row g alone (decode: act row k);
// ids not null: the slot is slot_map[ids[g]], else slots[g].
__device__ __forceinline__ void qf_group(const int* offsets, const int* ids, const int* slots, int g, int* r0,
                                         int* r1, int* s) {
    if (offsets) {
        *r0 = offsets[g];
        *r1 = offsets[g + 1];
    } else {
        *r0 = g;
        *r1 = g + 1;
    }
    *s = ids ? slots[ids[g]] : slots[g];
}

// act[r, f] = silu(x_r . Wg_f + bg_f) * (x_r . Wu_f + bu_f) for rows r of group blockIdx.y; a warp per f.
// x row r is x + r * ldx (ldx 0: one x for every group, decode). A slot outside [0, n_slots): zero rows, or NaN
// with nan_missing (decode, so an unresolved miss fails a check).
extern "C" __global__ void __launch_bounds__(QF_THREADS)
strata_qf_gemv_gate_up(const float* __restrict__ x, long long ldx, const int* __restrict__ offsets,
                       const int* __restrict__ ids, const int* __restrict__ slots, int n_slots, int H, int F,
                       const unsigned char* __restrict__ blob, long long slot_bytes, long long rb, int fmt,
                       long long bias_off, int nan_missing, float* __restrict__ act) {
    const int warp = threadIdx.x / QF_WARP, lane = threadIdx.x % QF_WARP;
    const int f = blockIdx.x * QF_WARPS + warp;
    if (f >= F) return;  // whole warps; no block barrier here
    int r0, r1, s;
    qf_group(offsets, ids, slots, blockIdx.y, &r0, &r1, &s);
    if (s < 0 || s >= n_slots) {
        if (lane == 0)
            for (int r = r0; r < r1; ++r) act[(long long)r * F + f] = nan_missing ? __int_as_float(0x7fc00000) : 0.0f;
        return;
    }
    const unsigned char* w = blob + (long long)s * slot_bytes;
    const unsigned char* wg = w + (long long)f * rb;
    const unsigned char* wu = w + (long long)(F + f) * rb;
    const int chunks = H / 32;
    float bg = 0.0f, bu = 0.0f;
    if (bias_off >= 0) {
        bg = dq_f32(w + bias_off, f);
        bu = dq_f32(w + bias_off, F + f);
    }
    for (int rb0 = r0; rb0 < r1; rb0 += QF_R) {
        float ag[QF_R], au[QF_R];
#pragma unroll
        for (int i = 0; i < QF_R; ++i) ag[i] = au[i] = 0.0f;
        for (int c = lane; c < chunks; c += QF_WARP) {
            float v[32];
            qf_chunk(wg, c, fmt, v);
#pragma unroll
            for (int i = 0; i < QF_R; ++i)
                if (rb0 + i < r1) ag[i] += qf_dot32(v, x + (long long)(rb0 + i) * ldx + 32 * c);
            qf_chunk(wu, c, fmt, v);
#pragma unroll
            for (int i = 0; i < QF_R; ++i)
                if (rb0 + i < r1) au[i] += qf_dot32(v, x + (long long)(rb0 + i) * ldx + 32 * c);
        }
#pragma unroll
        for (int i = 0; i < QF_R; ++i) {
            const float a = qf_warp_sum(ag[i]) + bg, b = qf_warp_sum(au[i]) + bu;
            if (lane == 0 && rb0 + i < r1) act[(long long)(rb0 + i) * F + f] = qf_silu(a) * b;
        }
    }
}

// y[r, h] = act_r . Wd_h + bd_h for rows r of group blockIdx.y; a warp per h. A slot outside the pool: zero rows.
extern "C" __global__ void __launch_bounds__(QF_THREADS)
strata_qf_gemv_down(const float* __restrict__ act, const int* __restrict__ offsets, const int* __restrict__ slots,
                    int n_slots, int H, int F, const unsigned char* __restrict__ blob, long long slot_bytes,
                    long long down_off, long long rb, int fmt, long long bias_off, float* __restrict__ y) {
    const int warp = threadIdx.x / QF_WARP, lane = threadIdx.x % QF_WARP;
    const int h = blockIdx.x * QF_WARPS + warp;
    if (h >= H) return;
    int r0, r1, s;
    qf_group(offsets, 0, slots, blockIdx.y, &r0, &r1, &s);
    if (s < 0 || s >= n_slots) {
        if (lane == 0)
            for (int r = r0; r < r1; ++r) y[(long long)r * H + h] = 0.0f;
        return;
    }
    const unsigned char* w = blob + (long long)s * slot_bytes;
    const unsigned char* wd = w + down_off + (long long)h * rb;
    const float bd = bias_off >= 0 ? dq_f32(w + bias_off, 2 * F + h) : 0.0f;
    const int chunks = F / 32;
    for (int rb0 = r0; rb0 < r1; rb0 += QF_R) {
        float acc[QF_R];
#pragma unroll
        for (int i = 0; i < QF_R; ++i) acc[i] = 0.0f;
        for (int c = lane; c < chunks; c += QF_WARP) {
            float v[32];
            qf_chunk(wd, c, fmt, v);
#pragma unroll
            for (int i = 0; i < QF_R; ++i)
                if (rb0 + i < r1) acc[i] += qf_dot32(v, act + (long long)(rb0 + i) * F + 32 * c);
        }
#pragma unroll
        for (int i = 0; i < QF_R; ++i) {
            const float a = qf_warp_sum(acc[i]);
            if (lane == 0 && rb0 + i < r1) y[(long long)(rb0 + i) * H + h] = a + bd;
        }
    }
}

// One token's down projection over its K routed experts: out[h] = (accumulate ? out[h] : 0) +
// sum_k w_k (act_k . Wd[slot_map[ids[k]]]_h + bd_h); a warp per h, the (expert, chunk) pairs dealt over its lanes so
// loads of several experts are in flight at once. A routed expert outside the pool makes out[h] NaN.
extern "C" __global__ void __launch_bounds__(QF_THREADS)
strata_qf_decode_down(const float* __restrict__ act, const int* __restrict__ ids, const float* __restrict__ wts,
                      const int* __restrict__ slot_map, int n_slots, int K, int H, int F,
                      const unsigned char* __restrict__ blob, long long slot_bytes, long long down_off, long long rb,
                      int fmt, long long bias_off, int accumulate, float* __restrict__ out) {
    __shared__ long long s_slot[QF_WARPS][16];
    __shared__ float s_w[QF_WARPS][16];
    const int warp = threadIdx.x / QF_WARP, lane = threadIdx.x % QF_WARP;
    const int h = blockIdx.x * QF_WARPS + warp;
    if (h >= H) return;
    if (lane < K) {
        s_slot[warp][lane] = slot_map[ids[lane]];
        s_w[warp][lane] = wts[lane];
    }
    __syncwarp();
    bool bad = false;
    for (int k = 0; k < K; ++k) bad |= s_slot[warp][k] < 0 || s_slot[warp][k] >= n_slots;
    if (bad) {
        if (lane == 0) out[h] = __int_as_float(0x7fc00000);
        return;
    }
    const int chunks = F / 32;
    float acc = 0.0f;
    for (int i = lane; i < K * chunks; i += QF_WARP) {
        const int k = i / chunks, c = i - k * chunks;
        const unsigned char* wd = blob + s_slot[warp][k] * slot_bytes + down_off + (long long)h * rb;
        float v[32];
        qf_chunk(wd, c, fmt, v);
        acc += s_w[warp][k] * qf_dot32(v, act + (long long)k * F + 32 * c);
    }
    acc = qf_warp_sum(acc);
    if (lane == 0) {
        float b = 0.0f;
        if (bias_off >= 0)
            for (int k = 0; k < K; ++k) b += s_w[warp][k] * dq_f32(blob + s_slot[warp][k] * slot_bytes + bias_off, 2 * F + h);
        out[h] = (accumulate ? out[h] : 0.0f) + acc + b;
    }
}

// A host build whose shim has no block barrier (QF_HOST without QF_HOST_SYNCTHREADS: the warp kernels' tests) leaves
// out the one kernel below that needs __syncthreads.
#if !defined(QF_HOST) || defined(QF_HOST_SYNCTHREADS)
#define QF_DW 4                    // warps of strata_qf_decode_down_wide that share one output h
#define QF_DROWS (QF_WARPS / QF_DW)  // outputs h a block of it computes

// strata_qf_decode_down with QF_DW warps per output h: the K * F/32 (expert, chunk) pairs of a row dealt over
// QF_DW * 32 lanes, so four times the loads are in flight and each lane decodes a quarter of the chunks (the
// one-warp kernel left most of the H200's warp slots empty at H = 2048); the warps' partial sums are added in
// warp order through shared memory. Same arguments; grid ceil(H / QF_DROWS) blocks of QF_THREADS.
extern "C" __global__ void __launch_bounds__(QF_THREADS)
strata_qf_decode_down_wide(const float* __restrict__ act, const int* __restrict__ ids, const float* __restrict__ wts,
                           const int* __restrict__ slot_map, int n_slots, int K, int H, int F,
                           const unsigned char* __restrict__ blob, long long slot_bytes, long long down_off,
                           long long rb, int fmt, long long bias_off, int accumulate, float* __restrict__ out) {
    __shared__ long long s_slot[16];
    __shared__ float s_w[16];
    __shared__ float s_part[QF_WARPS];
    const int warp = threadIdx.x / QF_WARP, lane = threadIdx.x % QF_WARP;
    const int hr = warp / QF_DW, part = warp % QF_DW;
    const int h = blockIdx.x * QF_DROWS + hr;
    if (threadIdx.x < K) {
        s_slot[threadIdx.x] = slot_map[ids[threadIdx.x]];
        s_w[threadIdx.x] = wts[threadIdx.x];
    }
    __syncthreads();
    bool bad = false;
    for (int k = 0; k < K; ++k) bad |= s_slot[k] < 0 || s_slot[k] >= n_slots;
    const int chunks = F / 32;
    float acc = 0.0f;
    if (h < H && !bad) {
        for (int i = part * QF_WARP + lane; i < K * chunks; i += QF_DW * QF_WARP) {
            const int k = i / chunks, c = i - k * chunks;
            const unsigned char* wd = blob + s_slot[k] * slot_bytes + down_off + (long long)h * rb;
            float v[32];
            qf_chunk(wd, c, fmt, v);
            acc += s_w[k] * qf_dot32(v, act + (long long)k * F + 32 * c);
        }
    }
    acc = qf_warp_sum(acc);
    if (lane == 0) s_part[warp] = acc;
    __syncthreads();
    if (part == 0 && lane == 0 && h < H) {
        if (bad) {
            out[h] = __int_as_float(0x7fc00000);
            return;
        }
        float sum = 0.0f;
        for (int p = 0; p < QF_DW; ++p) sum += s_part[hr * QF_DW + p];
        float b = 0.0f;
        if (bias_off >= 0)
            for (int k = 0; k < K; ++k) b += s_w[k] * dq_f32(blob + s_slot[k] * slot_bytes + bias_off, 2 * F + h);
        out[h] = (accumulate ? out[h] : 0.0f) + sum + b;
    }
}
#endif
