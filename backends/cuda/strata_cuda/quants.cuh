// Dequantization of ggml's GGUF weight formats in CUDA C: q8_0, q4_k, q5_k, q6_k, mxfp4 (and f32, f16, bf16).
// Meant to be included into a backend's kernels (NVRTC, or hiprtc for rocm); the numpy oracle, layouts described,
// is strata_core/reference/quants.py, and every function here returns the same float32 bits as its dequantize.
//
// - dq_<fmt>(row, i) returns weight i of a row that starts at `row` (blocks back to back, as in a GGUF tensor);
//   dq_weight(row, i, fmt) dispatches on ggml's type id (DQ_TYPE_*, quants.GGML_TYPES).
// - the rules of moe.cu hold here too: no headers (f16 is decoded in integer arithmetic, no __half), no warp
//   intrinsics; bytes are read one at a time, so no alignment is assumed (a q6_k block is 210 bytes).
// - every float operation is an __fmul_rn/__fsub_rn: with the default -fmad=true the compiler (ptxas included, for
//   PTX mul/sub without a rounding modifier) may fuse q4_k's (d*sc)*q - dmin*m into an fma, which rounds once where
//   numpy rounds twice; the _rn intrinsics become mul.rn/sub.rn, which are never contracted.
// - mxfp4 scales of e = 0 and 1 make float32 subnormals (2^-128, 2^-127); those weights are built from their bits,
//   so they stay exact under -ftz=true.
// - the test kernel strata_dequant_rows is left out when STRATA_QUANTS_NO_TEST_KERNEL is defined.

#ifndef STRATA_QUANTS_CUH
#define STRATA_QUANTS_CUH

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

// The little-endian binary16 at p as float (exact: every half is a float).
__device__ __forceinline__ float dq_half_at(const unsigned char* p) {
    const unsigned int h = (unsigned int)p[0] | ((unsigned int)p[1] << 8);
    const unsigned int sign = (h & 0x8000u) << 16;
    const unsigned int e = (h >> 10) & 0x1fu;
    const unsigned int m = h & 0x3ffu;
    if (e == 0u)  // zero or subnormal: m * 2^-24 is exact and a normal float
        return __uint_as_float(__float_as_uint(__fmul_rn((float)m, 5.9604644775390625e-8f)) | sign);
    if (e == 31u) return __uint_as_float(sign | 0x7f800000u | (m << 13));
    return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
}

__device__ __forceinline__ float dq_f32(const unsigned char* row, int i) {
    const unsigned char* p = row + (long long)i * 4;
    return __uint_as_float((unsigned int)p[0] | ((unsigned int)p[1] << 8) | ((unsigned int)p[2] << 16) |
                           ((unsigned int)p[3] << 24));
}

__device__ __forceinline__ float dq_f16(const unsigned char* row, int i) {
    return dq_half_at(row + (long long)i * 2);
}

__device__ __forceinline__ float dq_bf16(const unsigned char* row, int i) {
    const unsigned char* p = row + (long long)i * 2;
    return __uint_as_float(((unsigned int)p[0] << 16) | ((unsigned int)p[1] << 24));
}

// q8_0: f16 d, int8 qs[32].
__device__ __forceinline__ float dq_q8_0(const unsigned char* row, int i) {
    const unsigned char* b = row + (long long)(i / 32) * DQ_Q8_0_BYTES;
    return __fmul_rn((float)(signed char)b[2 + i % 32], dq_half_at(b));
}

// The 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes s of a q4_k/q5_k block.
__device__ __forceinline__ void dq_k_scale_min(const unsigned char* s, int j, unsigned int* sc, unsigned int* m) {
    if (j < 4) {
        *sc = s[j] & 63u;
        *m = s[j + 4] & 63u;
    } else {
        *sc = (s[j + 4] & 15u) | ((unsigned int)(s[j - 4] >> 6) << 4);
        *m = (unsigned int)(s[j + 4] >> 4) | ((unsigned int)(s[j] >> 6) << 4);
    }
}

// (d*sc)*q - dmin*m of q4_k/q5_k, rounded step by step as numpy does.
__device__ __forceinline__ float dq_k_affine(const unsigned char* b, int sub, unsigned int q) {
    unsigned int sc, m;
    dq_k_scale_min(b + 4, sub, &sc, &m);
    const float scale = __fmul_rn(dq_half_at(b), (float)sc);
    const float minv = __fmul_rn(dq_half_at(b + 2), (float)m);
    return __fsub_rn(__fmul_rn(scale, (float)q), minv);
}

// q4_k: f16 d, f16 dmin, scales[12], qs[128]; 32 bytes of qs per 64 weights, low nibbles first.
__device__ __forceinline__ float dq_q4_k(const unsigned char* row, int i) {
    const unsigned char* b = row + (long long)(i / DQ_QK_K) * DQ_Q4_K_BYTES;
    const int j = i % DQ_QK_K, sub = j / 32, l = j % 32;
    const unsigned int byte = b[16 + (sub / 2) * 32 + l];
    return dq_k_affine(b, sub, (sub & 1) ? (byte >> 4) : (byte & 15u));
}

// q5_k: f16 d, f16 dmin, scales[12], qh[32], qs[128]; bit `sub` of qh[l] is the 5th bit.
__device__ __forceinline__ float dq_q5_k(const unsigned char* row, int i) {
    const unsigned char* b = row + (long long)(i / DQ_QK_K) * DQ_Q5_K_BYTES;
    const int j = i % DQ_QK_K, sub = j / 32, l = j % 32;
    const unsigned int byte = b[48 + (sub / 2) * 32 + l];
    const unsigned int low = (sub & 1) ? (byte >> 4) : (byte & 15u);
    const unsigned int high = ((unsigned int)b[16 + l] >> sub) & 1u;
    return dq_k_affine(b, sub, low | (high << 4));
}

// q6_k: ql[128], qh[64], int8 scales[16], f16 d; see the oracle's header for the bit positions.
__device__ __forceinline__ float dq_q6_k(const unsigned char* row, int i) {
    const unsigned char* b = row + (long long)(i / DQ_QK_K) * DQ_Q6_K_BYTES;
    const int j = i % DQ_QK_K, h = j / 128, g = (j % 128) / 32, l = j % 32;
    const unsigned int lb = b[h * 64 + (g & 1) * 32 + l];
    const unsigned int low = (g < 2) ? (lb & 15u) : (lb >> 4);
    const unsigned int high = ((unsigned int)b[128 + h * 32 + l] >> (2 * g)) & 3u;
    const int q = (int)(low | (high << 4)) - 32;
    const float scale = __fmul_rn(dq_half_at(b + 208), (float)(signed char)b[192 + j / 16]);
    return __fmul_rn(scale, (float)q);
}

// mxfp4: e8m0 e, qs[16]; weight j < 16 is the low nibble of qs[j], j >= 16 the high nibble of qs[j - 16].
__device__ __forceinline__ float dq_mxfp4(const unsigned char* row, int i) {
    const unsigned char* b = row + (long long)(i / 32) * DQ_MXFP4_BYTES;
    const int j = i % 32;
    const unsigned int nib = (j < 16) ? (b[1 + j] & 15u) : (b[1 + j - 16] >> 4);
    // e2m1 doubled, so that the half scale below keeps it whole: 0 1 2 3 4 6 8 12
    const unsigned int em = nib & 7u, ex = em >> 1, mant = em & 1u;
    const int mag = (int)(ex == 0u ? mant : (2u + mant) << (ex - 1u));
    const int v = (nib & 8u) ? -mag : mag;  // an int, so that code 8 is +0 like ggml's table
    const unsigned int e = b[0];
    if (e >= 2u)  // the scale 2^(e - 128) and the product are normal floats (or the product overflows)
        return __fmul_rn((float)v, __uint_as_float((e - 1u) << 23));
    // Below, the value |v| * 2^(e - 128) is at most 12 * 2^-127: often subnormal, which -ftz=true (and the scale
    // itself is one) would turn into 0. k counts it in units of 2^-149, the bit value of a float below 2^-125;
    // each halving past that moves one binade up.
    unsigned int k = (unsigned int)mag << (21u + e), binades = 0u;
    while (k >= 0x1000000u) {
        k >>= 1;
        ++binades;
    }
    return __uint_as_float((k + (binades << 23)) | ((v < 0) ? 0x80000000u : 0u));
}

// Weight i of a row of ggml type `fmt` (DQ_TYPE_*); NaN for a type this file does not know.
__device__ __forceinline__ float dq_weight(const unsigned char* row, int i, int fmt) {
    switch (fmt) {
    case DQ_TYPE_F32: return dq_f32(row, i);
    case DQ_TYPE_F16: return dq_f16(row, i);
    case DQ_TYPE_BF16: return dq_bf16(row, i);
    case DQ_TYPE_Q8_0: return dq_q8_0(row, i);
    case DQ_TYPE_Q4_K: return dq_q4_k(row, i);
    case DQ_TYPE_Q5_K: return dq_q5_k(row, i);
    case DQ_TYPE_Q6_K: return dq_q6_k(row, i);
    case DQ_TYPE_MXFP4: return dq_mxfp4(row, i);
    default: return __uint_as_float(0x7fc00000u);
    }
}

#ifndef STRATA_QUANTS_NO_TEST_KERNEL
// dst[r, i] = weight i of row r for `rows` rows of n weights, grid-stride over all rows * n weights.
extern "C" __global__ void strata_dequant_rows(const unsigned char* src, float* dst, int n, int row_bytes, int fmt,
                                               int rows) {
    const long long total = (long long)rows * n;
    for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < total;
         k += (long long)gridDim.x * blockDim.x) {
        const long long r = k / n;
        dst[k] = dq_weight(src + r * row_bytes, (int)(k - r * n), fmt);
    }
}
#endif

#endif  // STRATA_QUANTS_CUH
