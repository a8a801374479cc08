/*
 * Dequantization of ggml's GGUF weight formats in OpenCL C 1.2: q8_0, q4_k, q5_k, q6_k, mxfp4 (and f32, f16, bf16).
 * Meant to be included into (or concatenated before) a backend's kernels; the numpy oracle, layouts described, is
 * strata_core/reference/quants.py, and every function here returns the same float32 bits as its dequantize.
 *
 * - dq_<fmt>(row, i) returns weight i of a row that starts at `row` (blocks back to back, as in a GGUF tensor);
 *   dq_weight(row, i, fmt) dispatches on ggml's type id (DQ_TYPE_*, quants.GGML_TYPES).
 * - bytes are read one at a time and f16 is decoded in integer arithmetic: no alignment is assumed (a q6_k block
 *   is 210 bytes) and neither cl_khr_fp16 nor vload_half is needed.
 * - q4_k and q5_k compute (d*sc)*q - dmin*m as two rounded products and a rounded difference; the FP_CONTRACT
 *   pragma in those functions keeps the compiler from fusing them into an fma, which would round differently.
 *   It is scoped to the function body, so it does not change the contraction state of the file including this one.
 * - mxfp4 scales of e = 0 and 1 make float32 subnormals (2^-128, 2^-127); those weights are built from their bits,
 *   so they stay exact on a device that flushes denormals.
 * - the test kernel dequant_rows is left out when STRATA_QUANTS_NO_TEST_KERNEL is defined.
 */

#ifndef STRATA_QUANTS_CL
#define STRATA_QUANTS_CL

#define DQ_TYPE_F32 0
#define DQ_TYPE_F16 1
#define DQ_TYPE_Q8_0 8
#define DQ_TYPE_Q4_K 12
#define DQ_TYPE_Q5_K 13
#define DQ_TYPE_Q6_K 14
#define DQ_TYPE_BF16 30
#define DQ_TYPE_MXFP4 39

#define DQ_QK_K 256
#define DQ_Q8_0_BYTES 34
#define DQ_Q4_K_BYTES 144
#define DQ_Q5_K_BYTES 176
#define DQ_Q6_K_BYTES 210
#define DQ_MXFP4_BYTES 17

/* The little-endian binary16 at p as float (exact: every half is a float). */
inline float dq_half_at(__global const uchar* p)
{
    const uint h = (uint)p[0] | ((uint)p[1] << 8);
    const uint sign = (h & 0x8000u) << 16;
    const uint e = (h >> 10) & 0x1fu;
    const uint m = h & 0x3ffu;
    if (e == 0u)  /* zero or subnormal: m * 2^-24 is exact and a normal float */
        return as_float(as_uint((float)m * 5.9604644775390625e-8f) | sign);
    if (e == 31u)
        return as_float(sign | 0x7f800000u | (m << 13));
    return as_float(sign | ((e + 112u) << 23) | (m << 13));
}

inline float dq_f32(__global const uchar* row, const int i)
{
    __global const uchar* p = row + (size_t)i * 4;
    return as_float((uint)p[0] | ((uint)p[1] << 8) | ((uint)p[2] << 16) | ((uint)p[3] << 24));
}

inline float dq_f16(__global const uchar* row, const int i)
{
    return dq_half_at(row + (size_t)i * 2);
}

inline float dq_bf16(__global const uchar* row, const int i)
{
    __global const uchar* p = row + (size_t)i * 2;
    return as_float(((uint)p[0] << 16) | ((uint)p[1] << 24));
}

/* q8_0: f16 d, int8 qs[32]. */
inline float dq_q8_0(__global const uchar* row, const int i)
{
    __global const uchar* b = row + (size_t)(i / 32) * DQ_Q8_0_BYTES;
    return (float)(char)b[2 + i % 32] * dq_half_at(b);
}

/* The 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes s of a q4_k/q5_k block. */
inline void dq_k_scale_min(__global const uchar* s, const int j, uint* sc, uint* m)
{
    if (j < 4) {
        *sc = s[j] & 63u;
        *m = s[j + 4] & 63u;
    } else {
        *sc = (s[j + 4] & 15u) | ((uint)(s[j - 4] >> 6) << 4);
        *m = (uint)(s[j + 4] >> 4) | ((uint)(s[j] >> 6) << 4);
    }
}

/* (d*sc)*q - dmin*m of q4_k/q5_k, rounded step by step as numpy does. */
inline float dq_k_affine(__global const uchar* b, const int sub, const uint q)
{
#pragma OPENCL FP_CONTRACT OFF
    uint sc, m;
    dq_k_scale_min(b + 4, sub, &sc, &m);
    const float scale = dq_half_at(b) * (float)sc;
    const float minv = dq_half_at(b + 2) * (float)m;
    return scale * (float)q - minv;
}

/* q4_k: f16 d, f16 dmin, scales[12], qs[128]; 32 bytes of qs per 64 weights, low nibbles first. */
inline float dq_q4_k(__global const uchar* row, const int i)
{
    __global const uchar* b = row + (size_t)(i / DQ_QK_K) * DQ_Q4_K_BYTES;
    const int j = i % DQ_QK_K, sub = j / 32, l = j % 32;
    const uint byte = b[16 + (sub / 2) * 32 + l];
    return dq_k_affine(b, sub, (sub & 1) ? (byte >> 4) : (byte & 15u));
}

/* q5_k: f16 d, f16 dmin, scales[12], qh[32], qs[128]; bit `sub` of qh[l] is the 5th bit. */
inline float dq_q5_k(__global const uchar* row, const int i)
{
    __global const uchar* b = row + (size_t)(i / DQ_QK_K) * DQ_Q5_K_BYTES;
    const int j = i % DQ_QK_K, sub = j / 32, l = j % 32;
    const uint byte = b[48 + (sub / 2) * 32 + l];
    const uint low = (sub & 1) ? (byte >> 4) : (byte & 15u);
    const uint high = ((uint)b[16 + l] >> sub) & 1u;
    return dq_k_affine(b, sub, low | (high << 4));
}

/* q6_k: ql[128], qh[64], int8 scales[16], f16 d; see the oracle's header for the bit positions. */
inline float dq_q6_k(__global const uchar* row, const int i)
{
    __global const uchar* b = row + (size_t)(i / DQ_QK_K) * DQ_Q6_K_BYTES;
    const int j = i % DQ_QK_K, h = j / 128, g = (j % 128) / 32, l = j % 32;
    const uint lb = b[h * 64 + (g & 1) * 32 + l];
    const uint low = (g < 2) ? (lb & 15u) : (lb >> 4);
    const uint high = ((uint)b[128 + h * 32 + l] >> (2 * g)) & 3u;
    const int q = (int)(low | (high << 4)) - 32;
    const float scale = dq_half_at(b + 208) * (float)(char)b[192 + j / 16];
    return scale * (float)q;
}

/* mxfp4: e8m0 e, qs[16]; weight j < 16 is the low nibble of qs[j], j >= 16 the high nibble of qs[j - 16]. */
inline float dq_mxfp4(__global const uchar* row, const int i)
{
    __global const uchar* b = row + (size_t)(i / 32) * DQ_MXFP4_BYTES;
    const int j = i % 32;
    const uint nib = (j < 16) ? (b[1 + j] & 15u) : (b[1 + j - 16] >> 4);
    /* e2m1 doubled, so that the half scale below keeps it whole: 0 1 2 3 4 6 8 12 */
    const uint em = nib & 7u, ex = em >> 1, mant = em & 1u;
    const int mag = (int)(ex == 0u ? mant : (2u + mant) << (ex - 1u));
    const int v = (nib & 8u) ? -mag : mag;  /* an int, so that code 8 is +0 like ggml's table */
    const uint e = b[0];
    if (e >= 2u)  /* the scale 2^(e - 128) and the product are normal floats (or the product overflows) */
        return (float)v * as_float((e - 1u) << 23);
    /* Below, the value |v| * 2^(e - 128) is at most 12 * 2^-127: often subnormal, which a device that flushes
     * denormals (and the scale itself is one) would turn into 0. k counts it in units of 2^-149, the bit value of
     * a float below 2^-125; each halving past that moves one binade up. */
    uint k = (uint)mag << (21u + e), binades = 0u;
    while (k >= 0x1000000u) {
        k >>= 1;
        ++binades;
    }
    return as_float((k + (binades << 23)) | ((v < 0) ? 0x80000000u : 0u));
}

/* Weight i of a row of ggml type `fmt` (DQ_TYPE_*); NaN for a type this file does not know. */
inline float dq_weight(__global const uchar* row, const int i, const int fmt)
{
    switch (fmt) {
    case DQ_TYPE_F32: return dq_f32(row, i);
    case DQ_TYPE_F16: return dq_f16(row, i);
    case DQ_TYPE_BF16: return dq_bf16(row, i);
    case DQ_TYPE_Q8_0: return dq_q8_0(row, i);
    case DQ_TYPE_Q4_K: return dq_q4_k(row, i);
    case DQ_TYPE_Q5_K: return dq_q5_k(row, i);
    case DQ_TYPE_Q6_K: return dq_q6_k(row, i);
    case DQ_TYPE_MXFP4: return dq_mxfp4(row, i);
    default: return NAN;
    }
}

#ifndef STRATA_QUANTS_NO_TEST_KERNEL
/* dst[r, i] = weight i of row r: dimension 0 walks the weights (rounded-up sizes are guarded), dimension 1 the
 * rows (exactly as many as there are). */
__kernel void dequant_rows(__global const uchar* src, __global float* dst, const int n, const int row_bytes,
                           const int fmt)
{
    const int i = get_global_id(0);
    const size_t r = get_global_id(1);
    if (i >= n)
        return;
    dst[r * (size_t)n + i] = dq_weight(src + r * (size_t)row_bytes, i, fmt);
}
#endif

#endif /* STRATA_QUANTS_CL */
