// Strata Core's MoE kernels in CUDA C: one source for the cuda backend (NVRTC through cupy.RawModule) and the rocm
// backend (hiprtc through cupy's HIP build). The contract and layouts are those of strata_core/kernels/reference.py.
//
// Portability rules this file keeps, so that the same text builds on both:
// - no headers: half precision is carried as its 16 bits (unsigned short) and converted in software below, because
//   cuda_fp16.h and hip_fp16.h differ and hiprtc's built-in headers vary by ROCm release;
// - no warp intrinsics and no assumption on the warp size (32 on NVIDIA and RDNA, 64 on CDNA): reductions go
//   through shared memory with __syncthreads();
// - only device functions both compilers provide: expf, sqrtf, rintf, __float_as_uint, __uint_as_float, __fadd_rn,
//   __fmul_rn; no atomics (reductions are owned by one thread each, so results do not depend on scheduling).
// Element counts are long long so that tensors of more than 2^31 elements index correctly.

#define STRATA_ROUTE_THREADS 128
#define STRATA_MAX_TOPK 64
#define STRATA_NORM_THREADS 256
#define STRATA_NO_ID 0x7fffffff

// ---------------------------------------------------------------------------------------------------------------
// half <-> float, bit-exact with IEEE 754 binary16 and round-to-nearest-even (what numpy's astype(float16) does)
// ---------------------------------------------------------------------------------------------------------------

__device__ inline float strata_h2f(unsigned short h) {
    const unsigned int sign = ((unsigned int)h & 0x8000u) << 16;
    const unsigned int e = ((unsigned int)h >> 10) & 0x1fu;
    const unsigned int m = (unsigned int)h & 0x3ffu;
    if (e == 0u) {
        // zero or subnormal: m * 2^-24 is exact in float
        const float v = (float)m * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    if (e == 31u) return __uint_as_float(sign | 0x7f800000u | (m << 13));  // inf, nan (payload kept)
    return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
}

__device__ inline unsigned short strata_f2h(float f) {
    const unsigned int x = __float_as_uint(f);
    const unsigned int sign = (x >> 16) & 0x8000u;
    const unsigned int ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (unsigned short)(sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u));
    if (ax >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);  // >= 65520 rounds to infinity
    if (ax < 0x38800000u) {
        // below the smallest normal half (2^-14): the result is round(|f| * 2^24) units of 2^-24; the scaling is
        // exact and rintf rounds half to even, as IEEE asks (1024 units is the smallest normal, encoded alike)
        const float units = rintf(__uint_as_float(ax) * 16777216.0f);
        return (unsigned short)(sign | (unsigned int)units);
    }
    // normal: rebias the exponent and round the 13 dropped mantissa bits to nearest even; a carry into the
    // exponent is the correct rounding up to the next binade
    const unsigned int rounded = ax + 0x0fffu + ((ax >> 13) & 1u);
    return (unsigned short)(sign | ((rounded - 0x38000000u) >> 13));
}

// ---------------------------------------------------------------------------------------------------------------
// routing
// ---------------------------------------------------------------------------------------------------------------

// (v, i) ranks before (bv, bi): a higher logit first, ties to the lower expert id; STRATA_NO_ID ranks last.
__device__ inline bool strata_ranks_before(float v, int i, float bv, int bi) {
    if (i == STRATA_NO_ID) return false;
    if (bi == STRATA_NO_ID) return true;
    return v > bv || (v == bv && i < bi);
}

// One block of STRATA_ROUTE_THREADS threads per token. Round j picks the best expert ranked after round j-1's pick,
// so the k picks come out in descending order with ties to the lower id, without any per-token scratch memory.
extern "C" __global__ void strata_route_topk(const float* __restrict__ logits, int T, int E, int k,
                                             int* __restrict__ ids, float* __restrict__ weights) {
    __shared__ float s_val[STRATA_ROUTE_THREADS];
    __shared__ int s_id[STRATA_ROUTE_THREADS];
    __shared__ float s_top[STRATA_MAX_TOPK];
    const int t = blockIdx.x;
    if (t >= T) return;  // uniform for the whole block
    const float* row = logits + (long long)t * E;
    const int tid = threadIdx.x;
    float prev_v = __uint_as_float(0x7f800000u);
    int prev_i = -1;
    for (int j = 0; j < k; ++j) {
        float best_v = -__uint_as_float(0x7f800000u);
        int best_i = STRATA_NO_ID;
        for (int e = tid; e < E; e += STRATA_ROUTE_THREADS) {
            const float v = row[e];
            const bool after_prev = (v < prev_v) || (v == prev_v && e > prev_i);
            if (after_prev && strata_ranks_before(v, e, best_v, best_i)) {
                best_v = v;
                best_i = e;
            }
        }
        s_val[tid] = best_v;
        s_id[tid] = best_i;
        __syncthreads();
        for (int s = STRATA_ROUTE_THREADS / 2; s > 0; s >>= 1) {
            if (tid < s && strata_ranks_before(s_val[tid + s], s_id[tid + s], s_val[tid], s_id[tid])) {
                s_val[tid] = s_val[tid + s];
                s_id[tid] = s_id[tid + s];
            }
            __syncthreads();
        }
        prev_v = s_val[0];
        prev_i = s_id[0];
        if (tid == 0) {
            ids[(long long)t * k + j] = prev_i;
            s_top[j] = prev_v;
        }
        __syncthreads();  // every thread has read round j's pick before round j+1 overwrites s_val
    }
    if (tid == 0) {
        const float top = s_top[0];
        float sum = 0.0f;
        for (int j = 0; j < k; ++j) {
            const float e = expf(s_top[j] - top);
            s_top[j] = e;
            sum += e;
        }
        for (int j = 0; j < k; ++j) weights[(long long)t * k + j] = s_top[j] / sum;
    }
}

// ---------------------------------------------------------------------------------------------------------------
// gather / scatter
// ---------------------------------------------------------------------------------------------------------------

// out[i, c] = x[rows[i], c]
extern "C" __global__ void strata_gather_f32(const float* __restrict__ x, const int* __restrict__ rows, long long N,
                                             int H, float* __restrict__ out) {
    const long long n = N * H;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / H;
        out[i] = x[(long long)rows[r] * H + (i - r * H)];
    }
}

// out[t, c] += scale[j] * y[j, c] for every j with rows[j] == t, in ascending j: each output element is owned by one
// thread, which sums its row's segment of `order` (the routed rows sorted by (row, j), seg[t]..seg[t+1]) in order
// and adds the sum to out. No atomics: the same inputs give the same bits on every run. Products are rounded before
// the sum (no fused multiply-add), so the bits are those of that order in plain f32 arithmetic on any device.
extern "C" __global__ void strata_scatter_add_f32(float* __restrict__ out, const int* __restrict__ order,
                                                  const int* __restrict__ seg, const float* __restrict__ y,
                                                  const float* __restrict__ scale, long long T, int H) {
    const long long n = T * H;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const long long t = i / H;
        const int j0 = seg[t], j1 = seg[t + 1];
        if (j0 == j1) continue;
        const long long c = i - t * H;
        float acc = __fmul_rn(scale[order[j0]], y[(long long)order[j0] * H + c]);
        for (int j = j0 + 1; j < j1; ++j) {
            const int r = order[j];
            acc = __fadd_rn(acc, __fmul_rn(scale[r], y[(long long)r * H + c]));
        }
        out[i] = __fadd_rn(out[i], acc);
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Q8_0
// ---------------------------------------------------------------------------------------------------------------

// out[i] = f16(q[i] * d[i / 32]) for a contiguous [.., C] tensor (C a multiple of 32)
extern "C" __global__ void strata_dequantize_q8_0(const signed char* __restrict__ qs,
                                                  const unsigned short* __restrict__ d, long long n,
                                                  unsigned short* __restrict__ out) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        out[i] = strata_f2h((float)qs[i] * strata_h2f(d[i >> 5]));
    }
}

// The same for G expert slots picked by `slots`: out[g, :] = dequantized slot slots[g], each slot per_slot values
extern "C" __global__ void strata_dequantize_q8_0_slots(const signed char* __restrict__ qs,
                                                        const unsigned short* __restrict__ d,
                                                        const int* __restrict__ slots, int G, long long per_slot,
                                                        unsigned short* __restrict__ out) {
    const long long n = (long long)G * per_slot;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const long long g = i / per_slot;
        const long long src = (long long)slots[g] * per_slot + (i - g * per_slot);
        out[i] = strata_f2h((float)qs[src] * strata_h2f(d[src >> 5]));
    }
}

// ---------------------------------------------------------------------------------------------------------------
// norms
// ---------------------------------------------------------------------------------------------------------------

// One block of STRATA_NORM_THREADS threads per row: out = x / sqrt(mean(x^2) + eps) * w
extern "C" __global__ void strata_rmsnorm_f32(const float* __restrict__ x, const float* __restrict__ w, int T, int H,
                                              float eps, float* __restrict__ out) {
    __shared__ float s_sum[STRATA_NORM_THREADS];
    const int t = blockIdx.x;
    if (t >= T) return;  // uniform for the whole block
    const float* row = x + (long long)t * H;
    float acc = 0.0f;
    for (int c = threadIdx.x; c < H; c += STRATA_NORM_THREADS) acc += row[c] * row[c];
    s_sum[threadIdx.x] = acc;
    __syncthreads();
    for (int s = STRATA_NORM_THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) s_sum[threadIdx.x] += s_sum[threadIdx.x + s];
        __syncthreads();
    }
    const float r = 1.0f / sqrtf(s_sum[0] / (float)H + eps);
    float* dst = out + (long long)t * H;
    for (int c = threadIdx.x; c < H; c += STRATA_NORM_THREADS) dst[c] = row[c] * r * w[c];
}

// ---------------------------------------------------------------------------------------------------------------
// grouped expert FFN helpers (the GEMMs themselves run in the BLAS library)
// ---------------------------------------------------------------------------------------------------------------

// Padded activations for the batched GEMM: xp[p, :] = f16(x[src_rows[p], :]), or zeros where src_rows[p] < 0
extern "C" __global__ void strata_pack_rows_f16(const float* __restrict__ x, const int* __restrict__ src_rows,
                                                long long P, int H, unsigned short* __restrict__ xp) {
    const long long n = P * H;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const long long p = i / H;
        const int src = src_rows[p];
        xp[i] = src < 0 ? (unsigned short)0 : strata_f2h(x[(long long)src * H + (i - p * H)]);
    }
}

// SwiGLU on gate/up rows [rows, 2F] (gate first): h[r, c] = f16(silu(g) * u)
extern "C" __global__ void strata_swiglu_f16(const float* __restrict__ gu, long long rows, int F,
                                             unsigned short* __restrict__ h) {
    const long long n = rows * F;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / F;
        const long long c = i - r * F;
        const float g = gu[r * 2 * F + c];
        const float u = gu[r * 2 * F + F + c];
        h[i] = strata_f2h(g / (1.0f + expf(-g)) * u);
    }
}

// Back from the padded layout: y[dst_rows[p], :] = yp[p, :] where dst_rows[p] >= 0
extern "C" __global__ void strata_unpack_rows_f32(const float* __restrict__ yp, const int* __restrict__ dst_rows,
                                                  long long P, int H, float* __restrict__ y) {
    const long long n = P * H;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const long long p = i / H;
        const int dst = dst_rows[p];
        if (dst >= 0) y[(long long)dst * H + (i - p * H)] = yp[i];
    }
}

// ---------------------------------------------------------------------------------------------------------------
// linear with f16 weights and few rows (the LM head of one token): out[t, o] = x[t, :] . w[o, :], f32 sums
// ---------------------------------------------------------------------------------------------------------------

#define STRATA_GEMV_THREADS 256
#define STRATA_GEMV_ROWS 8

// 16-byte loads without vector headers: alignas makes both compilers emit one 128-bit load per struct.
struct alignas(16) strata_u4 { unsigned int x, y, z, w; };
struct alignas(16) strata_f4 { float x, y, z, w; };

__device__ inline float strata_dot_h2(unsigned int p, float a, float b) {
    return strata_h2f((unsigned short)(p & 0xffffu)) * a + strata_h2f((unsigned short)(p >> 16)) * b;
}

// Grid (ceil(O / STRATA_GEMV_ROWS), T); STRATA_GEMV_THREADS threads split H in chunks of 8 (H % 8 == 0, rows
// 16-byte aligned: one 128-bit load per row and chunk) and each keeps STRATA_GEMV_ROWS partial sums, reduced
// through shared memory. The f16 weights are read once per row of x straight from their bytes, never widened into
// an f32 copy of the matrix (which cost 3x the bytes).
extern "C" __global__ void strata_gemv_f16w_f32(const float* __restrict__ x, const unsigned short* __restrict__ w,
                                                int O, int H, float* __restrict__ out) {
    __shared__ float s_acc[STRATA_GEMV_ROWS][STRATA_GEMV_THREADS];
    const int t = blockIdx.y;
    const int o0 = blockIdx.x * STRATA_GEMV_ROWS;
    const strata_f4* x4 = (const strata_f4*)(x + (long long)t * H);
    const strata_u4* w8 = (const strata_u4*)w;
    const int h8 = H / 8;
    float acc[STRATA_GEMV_ROWS];
#pragma unroll
    for (int r = 0; r < STRATA_GEMV_ROWS; ++r) acc[r] = 0.0f;
    for (int c = threadIdx.x; c < h8; c += STRATA_GEMV_THREADS) {
        const strata_f4 xa = x4[2 * c], xb = x4[2 * c + 1];
#pragma unroll
        for (int r = 0; r < STRATA_GEMV_ROWS; ++r) {
            const int o = o0 + r < O ? o0 + r : O - 1;  // rows past O repeat the last one, never written
            const strata_u4 p = w8[(long long)o * h8 + c];
            acc[r] += strata_dot_h2(p.x, xa.x, xa.y) + strata_dot_h2(p.y, xa.z, xa.w) + strata_dot_h2(p.z, xb.x, xb.y) +
                      strata_dot_h2(p.w, xb.z, xb.w);
        }
    }
#pragma unroll
    for (int r = 0; r < STRATA_GEMV_ROWS; ++r) s_acc[r][threadIdx.x] = acc[r];
    __syncthreads();
    for (int s = STRATA_GEMV_THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
#pragma unroll
            for (int r = 0; r < STRATA_GEMV_ROWS; ++r) s_acc[r][threadIdx.x] += s_acc[r][threadIdx.x + s];
        }
        __syncthreads();
    }
    if (threadIdx.x < STRATA_GEMV_ROWS && o0 + (int)threadIdx.x < O)
        out[(long long)t * O + o0 + threadIdx.x] = s_acc[threadIdx.x][0];
}

// ---------------------------------------------------------------------------------------------------------------
// widening an upload in place: f16 values copied into the first half of an f32 buffer become f32
// ---------------------------------------------------------------------------------------------------------------

// f[i] = float(h[i]) for i in [lo, hi), where h aliases the first bytes of f. With hi <= 2 * lo (or hi - lo == 1) no
// write of this launch touches a half this launch reads (f[i] covers halves 2i and 2i + 1 >= hi), and halves below
// lo are not written; the caller launches [n/2, n), [n/4, n/2), ... in stream order, so every half is read before
// it is overwritten.
extern "C" __global__ void strata_widen_f16_f32(float* f, long long lo, long long hi) {
    const unsigned short* h = (const unsigned short*)f;
    for (long long i = lo + blockIdx.x * (long long)blockDim.x + threadIdx.x; i < hi;
         i += (long long)gridDim.x * blockDim.x) {
        const float v = strata_h2f(h[i]);
        f[i] = v;
    }
}
