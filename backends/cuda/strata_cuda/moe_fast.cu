// Strata Core's fast MoE paths in CUDA C (backends/cuda/strata_cuda/fast.py drives them; GEMMs go to cuBLAS).
// Layouts are those of strata_core/kernels/reference.py: w_gate_up [S,2F,H] f16, w_down [S,H,F] f16, Q8_0 blocks
// of 32 with int8 quants and f16 scales; activations f32 in and out.
//
// One source for NVRTC (cupy's CUDA build) and hiprtc (cupy's ROCm build):
// - no headers: halves travel as their 16 bits; on CUDA the conversions are the hardware's cvt instructions (one
//   instruction instead of a software routine, which matters in the bandwidth-bound decode loops), on HIP clang's
//   _Float16 does the same job;
// - warp shuffles differ in name and the wavefront is 64 lanes on CDNA: STRATA_WARP and STRATA_SHFL_XOR hide both.
// Kernels that need 16-byte loads require H and F to be multiples of 8 (fast.py checks before launching).

#if defined(__HIPCC__) || defined(__HIP_PLATFORM_AMD__) || defined(__HIP__)
#define STRATA_HIP 1
#ifdef __AMDGCN_WAVEFRONT_SIZE
#define STRATA_WARP __AMDGCN_WAVEFRONT_SIZE
#else
#define STRATA_WARP 64
#endif
#define STRATA_SHFL_XOR(v, m) __shfl_xor((v), (m))
#define STRATA_SHFL_UP(v, d) __shfl_up((v), (d))
#else
#define STRATA_WARP 32
#define STRATA_SHFL_XOR(v, m) __shfl_xor_sync(0xffffffffu, (v), (m))
#define STRATA_SHFL_UP(v, d) __shfl_up_sync(0xffffffffu, (v), (d))
#endif

// Programmatic dependent launch (sm_90): a decode kernel launched with the attribute may start while the kernel
// before it drains; it reads only constant weights before STRATA_GRID_WAIT, which returns once the previous
// kernel's writes are visible (at once when launched without the attribute, and a no-op elsewhere).
#if !defined(STRATA_HIP) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
#define STRATA_GRID_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#define STRATA_GRID_LAUNCH_DEPENDENTS() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
#else
#define STRATA_GRID_WAIT()
#define STRATA_GRID_LAUNCH_DEPENDENTS()
#endif
// Between a kernel's load phase and its sums: ptxas otherwise interleaves a lane's loads with the sums of the first
// ones (seen in the SASS of the third forms: 4 of 16 loads issued before the first conversion), so a warp makes
// several trips to memory. An asm volatile instruction is not moved across, and this one changes nothing: the
// kernels signal their dependents at their start already (a no-op without a programmatic launch, and on sm < 90).
#if !defined(STRATA_HIP) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
#define STRATA_ISSUE_FENCE() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
#else
#define STRATA_ISSUE_FENCE()
#endif
// A hint that a 128-byte line will be read soon by a later kernel: fetched into L2 with the last eviction priority
// (sm_80+; nothing elsewhere). Only a hint: the reader loads it as usual.
#if !defined(STRATA_HIP) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 800)
#define STRATA_PREFETCH_L2(p) asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(p))
#else
#define STRATA_PREFETCH_L2(p)
#endif


#define STRATA_FAST_THREADS 256
#define STRATA_FAST_WARPS (STRATA_FAST_THREADS / STRATA_WARP)
// top-k keeps every lane's logits in registers: E <= STRATA_TOPK_PER_LANE * STRATA_WARP (256 on CUDA)
#define STRATA_TOPK_PER_LANE 8
#define STRATA_FAST_MAXK 16

__device__ __forceinline__ float fh2f(unsigned short h) {
#ifdef STRATA_HIP
    _Float16 v;
    __builtin_memcpy(&v, &h, 2);
    return (float)v;
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#endif
}

__device__ __forceinline__ unsigned short ff2h(float f) {
#ifdef STRATA_HIP
    _Float16 v = (_Float16)f;
    unsigned short h;
    __builtin_memcpy(&h, &v, 2);
    return h;
#else
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#endif
}

__device__ __forceinline__ unsigned int pack2(float a, float b) {
    return (unsigned int)ff2h(a) | ((unsigned int)ff2h(b) << 16);
}

__device__ __forceinline__ float lo_h(unsigned int v) { return fh2f((unsigned short)(v & 0xffffu)); }
__device__ __forceinline__ float hi_h(unsigned int v) { return fh2f((unsigned short)(v >> 16)); }

// dot of 8 halves (one 16-byte load) with 8 floats
__device__ __forceinline__ float dot8(uint4 w, const float* x) {
    return lo_h(w.x) * x[0] + hi_h(w.x) * x[1] + lo_h(w.y) * x[2] + hi_h(w.y) * x[3] +
           lo_h(w.z) * x[4] + hi_h(w.z) * x[5] + lo_h(w.w) * x[6] + hi_h(w.w) * x[7];
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int m = STRATA_WARP / 2; m > 0; m >>= 1) v += STRATA_SHFL_XOR(v, m);
    return v;
}

__device__ __forceinline__ float silu(float g) { return g / (1.0f + expf(-g)); }

// One warp picks the top k of E logits (descending, ties to the lower id, as the reference's stable argsort does)
// and the softmax over them. Results land in ids/w, shared memory the caller passes (w holds the raw logits until
// the softmax at the end, so no per-rank register array is needed). The caller syncs the warp before reading.
__device__ void warp_topk(const float* __restrict__ logits, int E, int K, int lane, int* ids, float* w) {
    float v[STRATA_TOPK_PER_LANE];
#pragma unroll
    for (int j = 0; j < STRATA_TOPK_PER_LANE; ++j) {
        const int idx = j * STRATA_WARP + lane;
        v[j] = idx < E ? logits[idx] : 0.0f;
        // a NaN logit ranks as -inf: every comparison below stays ordered, so the K ids are always valid experts
        // (a NaN compares false both ways, and K NaN rounds left no lane a candidate: an id past E)
        if (v[j] != v[j]) v[j] = -__int_as_float(0x7f800000);
    }
    unsigned int taken = 0u;
    float top0 = 0.0f;
    for (int r = 0; r < K; ++r) {
        float best = 0.0f;
        int bid = 0x7fffffff;
#pragma unroll
        for (int j = 0; j < STRATA_TOPK_PER_LANE; ++j) {
            const int idx = j * STRATA_WARP + lane;
            if (idx < E && !((taken >> j) & 1u)) {
                if (bid == 0x7fffffff || v[j] > best || (v[j] == best && idx < bid)) { best = v[j]; bid = idx; }
            }
        }
        for (int m = STRATA_WARP / 2; m > 0; m >>= 1) {
            const float ob = STRATA_SHFL_XOR(best, m);
            const int oi = STRATA_SHFL_XOR(bid, m);
            if (oi != 0x7fffffff && (bid == 0x7fffffff || ob > best || (ob == best && oi < bid))) { best = ob; bid = oi; }
        }
        if (bid % STRATA_WARP == lane) taken |= 1u << (bid / STRATA_WARP);
        if (r == 0) top0 = best;
        if (lane == 0) { ids[r] = bid; w[r] = best; }
    }
    if (lane == 0) {
        float s = 0.0f;
        for (int r = 0; r < K; ++r) s += expf(w[r] - top0);
        for (int r = 0; r < K; ++r) w[r] = expf(w[r] - top0) / s;
    }
}

__device__ __forceinline__ void warp_sync_lanes() {
#ifdef STRATA_HIP
    __builtin_amdgcn_wave_barrier();
#else
    __syncwarp();
#endif
}

// Prefill routing: one warp per token; writes ids/weights [T,K]. Positions within each expert's group come from
// strata_fast_positions (no atomics, so the layout is the same on every run).
extern "C" __global__ void strata_fast_route(const float* __restrict__ logits, int T, int E, int K,
                                             int* __restrict__ ids, float* __restrict__ wts) {
    __shared__ int s_ids[STRATA_FAST_WARPS][STRATA_FAST_MAXK];
    __shared__ float s_w[STRATA_FAST_WARPS][STRATA_FAST_MAXK];
    const int warp = threadIdx.x / STRATA_WARP, lane = threadIdx.x % STRATA_WARP;
    const int t = blockIdx.x * STRATA_FAST_WARPS + warp;
    if (t >= T) return;  // whole warps leave together; no block barrier follows
    warp_topk(logits + (long long)t * E, E, K, lane, s_ids[warp], s_w[warp]);
    warp_sync_lanes();
    if (lane < K) {
        ids[(long long)t * K + lane] = s_ids[warp][lane];
        wts[(long long)t * K + lane] = s_w[warp][lane];
    }
}

// Group positions: one block per expert e scans the N = T*K routed ids in (t,k) order, in tiles of 4 ids a thread;
// pos[i] is the number of earlier i' with ids[i'] == e, counts[e] their total. A warp scan (shuffles) and the warps'
// totals in shared memory give each thread its start. Deterministic (no atomics); every counts[e] is written.
extern "C" __global__ void strata_fast_positions(const int* __restrict__ ids, int N, int* __restrict__ pos,
                                                 int* __restrict__ counts) {
    __shared__ int s_warp[STRATA_FAST_WARPS];
    const int e = blockIdx.x, tid = threadIdx.x;
    const int lane = tid % STRATA_WARP, warp = tid / STRATA_WARP;
    int base = 0;
    for (int t0 = 0; t0 < N; t0 += 4 * STRATA_FAST_THREADS) {
        const int i0 = t0 + 4 * tid;
        int f[4], c = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            f[j] = (i0 + j < N) && ids[i0 + j] == e;
            c += f[j];
        }
        int v = c;  // inclusive scan over the warp's lanes
        for (int d = 1; d < STRATA_WARP; d <<= 1) {
            const int u = STRATA_SHFL_UP(v, d);
            if (lane >= d) v += u;
        }
        if (lane == STRATA_WARP - 1) s_warp[warp] = v;
        __syncthreads();
        int before = 0, total = 0;
        for (int w = 0; w < STRATA_FAST_WARPS; ++w) {
            const int sw = s_warp[w];
            before += w < warp ? sw : 0;
            total += sw;
        }
        int p = base + before + v - c;
#pragma unroll
        for (int j = 0; j < 4; ++j)
            if (f[j]) pos[i0 + j] = p++;
        base += total;
        __syncthreads();  // s_warp is written again by the next tile
    }
    if (tid == 0) counts[e] = base;
}

// Rows of a group in the compact stack: its count rounded up to 8 (classes 0), or in size-class mode to its class
// (8, 16, then 2^k and 1.5 * 2^k) and at least `classes` rows (the class floor, >= 8); fast.py's class_rows computes
// the same.
__device__ __forceinline__ int stack_cap(int c, int classes) {
    if (c <= 0) return 0;
    if (!classes) return (c + 7) / 8 * 8;
    int p = 1;
    while (p < c) p <<= 1;  // the power of two at or above c
    const int mid = 3 * p / 4;
    const int r = (mid >= c && mid % 8 == 0) ? mid : p;
    const int floor_rows = classes < 8 ? 8 : classes;
    return r < floor_rows ? floor_rows : r;
}

// Stack offsets on the device, so the gather need not wait for the host: one block of STRATA_FAST_THREADS >= E
// threads; the cached experts' groups first, then the missed ones, each in expert-id order.
extern "C" __global__ void strata_fast_offsets(const int* __restrict__ counts, const int* __restrict__ slot_of, int E,
                                               int classes, int* __restrict__ row_of_expert) {
    __shared__ int s_hit[STRATA_FAST_THREADS];
    __shared__ int s_miss[STRATA_FAST_THREADS];
    const int e = threadIdx.x;
    const int c = e < E ? counts[e] : 0;
    const int cap = stack_cap(c, classes);
    const bool hit = c > 0 && slot_of[e] >= 0;
    s_hit[e] = hit ? cap : 0;
    s_miss[e] = hit ? 0 : cap;
    __syncthreads();
    for (int off = 1; off < STRATA_FAST_THREADS; off <<= 1) {
        const int h = e >= off ? s_hit[e - off] : 0, m = e >= off ? s_miss[e - off] : 0;
        __syncthreads();
        s_hit[e] += h;
        s_miss[e] += m;
        __syncthreads();
    }
    if (e < E) {
        const int hits_total = s_hit[STRATA_FAST_THREADS - 1];
        row_of_expert[e] = hit ? s_hit[e] - cap : (c > 0 ? hits_total + s_miss[e] - cap : 0);
    }
}

// Gather: token t's row, converted to f16 once, goes to row row_of_expert[e] + pos of the compact stack X for each of
// its K routed experts (each expert's rows contiguous, no padding to a common height); rowidx records where. One
// block per token; each thread moves 8 floats as one 16-byte store per destination.
extern "C" __global__ void strata_fast_gather(const float* __restrict__ x, const int* __restrict__ ids,
                                              const int* __restrict__ pos, const int* __restrict__ row_of_expert,
                                              int T, int K, int H, unsigned short* __restrict__ X,
                                              int* __restrict__ rowidx) {
    __shared__ long long s_dst[STRATA_FAST_MAXK];
    const int t = blockIdx.x;
    if (t >= T) return;  // the whole block leaves: no barrier is skipped by part of it
    if (threadIdx.x < K) {
        const long long r = (long long)t * K + threadIdx.x;
        const long long d = (long long)row_of_expert[ids[r]] + pos[r];
        s_dst[threadIdx.x] = d;
        rowidx[r] = (int)d;
    }
    __syncthreads();
    const float4* src = (const float4*)(x + (long long)t * H);
    for (int c = threadIdx.x; c < H / 8; c += blockDim.x) {
        const float4 a = src[2 * c], b = src[2 * c + 1];
        const uint4 v = make_uint4(pack2(a.x, a.y), pack2(a.z, a.w), pack2(b.x, b.y), pack2(b.z, b.w));
        for (int k = 0; k < K; ++k) ((uint4*)(X + s_dst[k] * H))[c] = v;
    }
}

// SwiGLU over rows row0..row0+rows-1 of the stack: GU [rows, 2F] (gate | up) -> A [rows, F]. Rows of a group's
// alignment tail hold no routed row; their outputs are never read.
extern "C" __global__ void strata_fast_swiglu(const unsigned short* __restrict__ GU, long long row0, long long rows,
                                              int F, unsigned short* __restrict__ A) {
    const int per_row = F / 8;
    const long long n = rows * per_row;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long row = row0 + i / per_row;
        const int c = (int)(i % per_row);
        const uint4 g = ((const uint4*)(GU + row * 2 * F))[c];
        const uint4 u = ((const uint4*)(GU + row * 2 * F + F))[c];
        uint4 o;
        o.x = pack2(silu(lo_h(g.x)) * lo_h(u.x), silu(hi_h(g.x)) * hi_h(u.x));
        o.y = pack2(silu(lo_h(g.y)) * lo_h(u.y), silu(hi_h(g.y)) * hi_h(u.y));
        o.z = pack2(silu(lo_h(g.z)) * lo_h(u.z), silu(hi_h(g.z)) * hi_h(u.z));
        o.w = pack2(silu(lo_h(g.w)) * lo_h(u.w), silu(hi_h(g.w)) * hi_h(u.w));
        ((uint4*)(A + row * F))[c] = o;
    }
}

// Copies n 32-bit words (n16 16-byte units in the _u4 form) with the SMs. src is device memory or page-locked host
// memory mapped for the device: the prefill's small tables and the ring's device-to-device admissions then need no
// copy engine, whose queue the ring's host copies hold (a memcpy on the compute stream waited there for the whole
// layer's copies in most half-skewed layers: bench/results/lead_h200_s5/).
extern "C" __global__ void strata_fast_pull_words(const unsigned int* __restrict__ src, unsigned int* __restrict__ dst,
                                                  long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        dst[i] = src[i];
}

extern "C" __global__ void strata_fast_pull_u4(const uint4* __restrict__ src, uint4* __restrict__ dst, long long n16) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += (long long)gridDim.x * blockDim.x)
        dst[i] = src[i];
}

// Combine: out[t] = sum_k w[t,k] * Y[rowidx[t,k]] in k order (deterministic, no atomics), f32 out; with accumulate
// the sum is added to out (the residual update x += moe(x)).
extern "C" __global__ void strata_fast_combine(const unsigned short* __restrict__ Y, const int* __restrict__ rowidx,
                                               const float* __restrict__ wts, int T, int K, int H,
                                               float* __restrict__ out, int accumulate) {
    const int t = blockIdx.x;
    if (t >= T) return;
    for (int c = threadIdx.x; c < H / 8; c += blockDim.x) {
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (int k = 0; k < K; ++k) {
            const float s = wts[(long long)t * K + k];
            const uint4 v = ((const uint4*)(Y + (long long)rowidx[(long long)t * K + k] * H))[c];
            acc[0] += s * lo_h(v.x); acc[1] += s * hi_h(v.x); acc[2] += s * lo_h(v.y); acc[3] += s * hi_h(v.y);
            acc[4] += s * lo_h(v.z); acc[5] += s * hi_h(v.z); acc[6] += s * lo_h(v.w); acc[7] += s * hi_h(v.w);
        }
        float4* o = (float4*)(out + (long long)t * H + 8 * c);
        if (accumulate) {
            const float4 a = o[0], b = o[1];
            acc[0] = a.x + acc[0]; acc[1] = a.y + acc[1]; acc[2] = a.z + acc[2]; acc[3] = a.w + acc[3];
            acc[4] = b.x + acc[4]; acc[5] = b.y + acc[5]; acc[6] = b.z + acc[6]; acc[7] = b.w + acc[7];
        }
        o[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
        o[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
    }
}

// Q8_0 -> f16: n elements (a multiple of 32); each thread turns 16 quants (one 16-byte load) into 16 halves.
extern "C" __global__ void strata_fast_dequant_q8_0(const signed char* __restrict__ q, const unsigned short* __restrict__ d,
                                                    long long n, unsigned short* __restrict__ out) {
    const long long n16 = n / 16;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += (long long)gridDim.x * blockDim.x) {
        const float s = fh2f(d[i / 2]);
        const int4 v = ((const int4*)q)[i];
        const int w[4] = {v.x, v.y, v.z, v.w};
        unsigned int o[8];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float b0 = (float)(signed char)(w[j] & 0xff), b1 = (float)(signed char)((w[j] >> 8) & 0xff);
            const float b2 = (float)(signed char)((w[j] >> 16) & 0xff), b3 = (float)(signed char)((w[j] >> 24) & 0xff);
            o[2 * j] = pack2(b0 * s, b1 * s);
            o[2 * j + 1] = pack2(b2 * s, b3 * s);
        }
        uint4* dst = (uint4*)(out + 16 * i);
        dst[0] = make_uint4(o[0], o[1], o[2], o[3]);
        dst[1] = make_uint4(o[4], o[5], o[6], o[7]);
    }
}

// Decode, step 1 of 2: route (every warp repeats the top-k of the one token: 128 logits cost less than a launch
// and a block barrier), then each warp computes STRATA_DEC_ROWS FFN rows i of expert k:
// act[k,i] = silu(x . Wg[i]) * (x . Wu[i]), weights read from the cache slot slot_map[id].
// Grid (ceil(F / (warps * STRATA_DEC_ROWS)), K). Block (0,0) publishes ids and weights for step 2.
// A missed expert (slot < 0) is read straight from page-locked host memory when host_w13 is not null (the SMs'
// own loads over the link: no host round trip, so a decode with misses stays one pair of launches and can be a
// graph); otherwise skip_missing leaves its rows alone (a later launch fills them), or else it writes NaN so a
// check catches an unresolved miss. refill_from (may be null): only the k whose slot in that map is < 0 run.
#ifndef STRATA_DEC_ROWS
#define STRATA_DEC_ROWS 2  // FFN rows per warp (fast.py passes its own choice with -D)
#endif
extern "C" __global__ void __launch_bounds__(STRATA_FAST_THREADS)
strata_fast_decode_gate_up(const float* __restrict__ x, const float* __restrict__ logits, int E, int K,
                           const int* __restrict__ slot_map, const int* __restrict__ refill_from, int skip_missing,
                           const unsigned short* __restrict__ w13, const unsigned short* __restrict__ host_w13,
                           long long slot_stride, int H, int F, float* __restrict__ act, int* __restrict__ ids_out,
                           float* __restrict__ w_out) {
    __shared__ int s_ids[STRATA_FAST_WARPS][STRATA_FAST_MAXK];
    __shared__ float s_w[STRATA_FAST_WARPS][STRATA_FAST_MAXK];
    const int warp = threadIdx.x / STRATA_WARP, lane = threadIdx.x % STRATA_WARP;
    const int k = blockIdx.y;
    const int row0 = (blockIdx.x * STRATA_FAST_WARPS + warp) * STRATA_DEC_ROWS;
    STRATA_GRID_LAUNCH_DEPENDENTS();
    STRATA_GRID_WAIT();  // logits and x are the previous kernel's
    if (row0 >= F) return;  // whole warps; no block barrier in this kernel
    warp_topk(logits, E, K, lane, s_ids[warp], s_w[warp]);
    warp_sync_lanes();
    if (blockIdx.x == 0 && k == 0 && warp == 0 && lane < K) {
        ids_out[lane] = s_ids[0][lane];
        w_out[lane] = s_w[0][lane];
    }
    const int e = s_ids[warp][k];
    if (refill_from != 0 && refill_from[e] >= 0) return;
    const long long slot = slot_map[e];
    const unsigned short* base;
    if (slot >= 0) {
        base = w13 + slot * slot_stride;
    } else if (host_w13 != 0) {
        base = host_w13 + (long long)e * slot_stride;
    } else {
        if (!skip_missing && lane < STRATA_DEC_ROWS && row0 + lane < F)
            act[(long long)k * F + row0 + lane] = __int_as_float(0x7fc00000);
        return;
    }
    const float4* x4 = (const float4*)x;
    float acc[2 * STRATA_DEC_ROWS];
#pragma unroll
    for (int r = 0; r < 2 * STRATA_DEC_ROWS; ++r) acc[r] = 0.f;
#pragma unroll 2
    for (int c = lane; c < H / 8; c += STRATA_WARP) {
        uint4 wv[2 * STRATA_DEC_ROWS];
#pragma unroll
        for (int r = 0; r < STRATA_DEC_ROWS; ++r) {
            const int row = min(row0 + r, F - 1);
            wv[2 * r] = ((const uint4*)(base + (long long)row * H))[c];
            wv[2 * r + 1] = ((const uint4*)(base + (long long)(F + row) * H))[c];
        }
        const float4 xa = x4[2 * c], xb = x4[2 * c + 1];
        const float xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
        for (int r = 0; r < 2 * STRATA_DEC_ROWS; ++r) acc[r] += dot8(wv[r], xv);
    }
#pragma unroll
    for (int r = 0; r < 2 * STRATA_DEC_ROWS; ++r) acc[r] = warp_sum(acc[r]);
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < STRATA_DEC_ROWS; ++r)
            if (row0 + r < F) act[(long long)k * F + row0 + r] = silu(acc[2 * r]) * acc[2 * r + 1];
    }
}

// Decode, step 2 of 2: one warp per hidden row h: out[h] = sum_k w_k * (Wd[slot_k, h] . act[k]), all K experts in
// one pass (no atomics, one write). act is read through the cache (the block's warps share it), so the weight loads
// start at once. Grid ceil(H / warps). Missed experts as in step 1 (host_w2 null: skip_missing leaves them out,
// else NaN). only_missing_in (may be null): only the k whose slot in that map is < 0 are summed and out[h] is
// added to (the second launch of a decode whose misses were copied to the device).
extern "C" __global__ void __launch_bounds__(STRATA_FAST_THREADS)
strata_fast_decode_down(const float* __restrict__ act, const int* __restrict__ ids, const float* __restrict__ wts,
                        const int* __restrict__ slot_map, const int* __restrict__ only_missing_in, int skip_missing,
                        const unsigned short* __restrict__ w2, const unsigned short* __restrict__ host_w2,
                        long long slot_stride, int H, int F, int K, float* __restrict__ out, int accumulate) {
    __shared__ const unsigned short* s_base[STRATA_FAST_WARPS][STRATA_FAST_MAXK];
    __shared__ float s_w[STRATA_FAST_WARPS][STRATA_FAST_MAXK];
    __shared__ int s_nan[STRATA_FAST_WARPS];
    const int warp = threadIdx.x / STRATA_WARP, lane = threadIdx.x % STRATA_WARP;
    const int h = blockIdx.x * STRATA_FAST_WARPS + warp;
    STRATA_GRID_LAUNCH_DEPENDENTS();
    STRATA_GRID_WAIT();  // act, ids and weights are the previous kernel's
    if (h >= H) return;  // whole warps; no block barrier in this kernel
    // the K look-ups are independent: one per lane, not a chain of dependent loads per expert; an expert this
    // launch leaves out gets weight 0 and reads slot 0's row (harmless)
    if (lane == 0) s_nan[warp] = 0;
    warp_sync_lanes();
    if (lane < K) {
        const int e = ids[lane];
        const long long slot = slot_map[e];
        float w = wts[lane];
        const unsigned short* base = w2;
        const bool take = only_missing_in ? only_missing_in[e] < 0 : true;
        if (!take) {
            w = 0.f;
        } else if (slot >= 0) {
            base = w2 + slot * slot_stride;
        } else if (host_w2 != 0) {
            base = host_w2 + (long long)e * slot_stride;
        } else if (skip_missing) {
            w = 0.f;
        } else {
            s_nan[warp] = 1;
        }
        s_base[warp][lane] = base;
        s_w[warp][lane] = w;
    }
    warp_sync_lanes();
    if (s_nan[warp]) {
        if (lane == 0) out[h] = __int_as_float(0x7fc00000);
        return;
    }
    const int per_row = F / 8;
    float acc = 0.f;
    // one flat loop over (expert, 16-byte chunk), unrolled, so loads of several experts are in flight at once
#pragma unroll 4
    for (int i = lane; i < K * per_row; i += STRATA_WARP) {
        const int k = i / per_row, c = i - k * per_row;
        const uint4 v = ((const uint4*)(s_base[warp][k] + (long long)h * F))[c];
        const float4* a4 = (const float4*)(act + (long long)k * F);
        const float4 xa = a4[2 * c], xb = a4[2 * c + 1];
        const float xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
        acc += s_w[warp][k] * dot8(v, xv);
    }
    acc = warp_sum(acc);
    if (lane == 0) out[h] = (only_missing_in || accumulate) ? out[h] + acc : acc;
}

// Decode, step 0 of 3 (the layer op's graph): rmsnorm and router of the one token. Every block reduces x's sum of
// squares itself (H values: cheaper than another launch), block 0 writes xn = x / rms(x) * w for step 1, and each
// warp computes one expert's logit xn . router[e]. Grid ceil(E / warps).
extern "C" __global__ void __launch_bounds__(STRATA_FAST_THREADS)
strata_fast_decode_norm_route(const float* __restrict__ x, const float* __restrict__ norm_w,
                              const float* __restrict__ router, int E, int H, float eps, float* __restrict__ xn,
                              float* __restrict__ logits) {
    __shared__ float s_part[STRATA_FAST_WARPS];
    const int warp = threadIdx.x / STRATA_WARP, lane = threadIdx.x % STRATA_WARP;
    STRATA_GRID_LAUNCH_DEPENDENTS();
    STRATA_GRID_WAIT();
    float ss = 0.f;
    for (int i = threadIdx.x; i < H; i += STRATA_FAST_THREADS) ss += x[i] * x[i];
    ss = warp_sum(ss);
    if (lane == 0) s_part[warp] = ss;
    __syncthreads();
    float tot = 0.f;
    for (int w = 0; w < STRATA_FAST_WARPS; ++w) tot += s_part[w];
    const float inv = 1.0f / sqrtf(tot / (float)H + eps);
    if (blockIdx.x == 0)
        for (int i = threadIdx.x; i < H; i += STRATA_FAST_THREADS) xn[i] = x[i] * inv * norm_w[i];
    const int e = blockIdx.x * STRATA_FAST_WARPS + warp;
    if (e >= E) return;
    const float* r = router + (long long)e * H;
    float acc = 0.f;
    for (int i = lane; i < H; i += STRATA_WARP) acc += (x[i] * inv * norm_w[i]) * r[i];
    acc = warp_sum(acc);
    if (lane == 0) logits[e] = acc;
}

// Decode, step 0, second form: 4 experts a block of 128 threads (E / 4 blocks spread the 1 MB f32 router over more
// SMs), each lane's router row chunks loaded (16-byte loads, all in flight) before the wait for x, so under a
// programmatic launch the router is read while the previous layer's down kernel drains.
#define STRATA_NR_THREADS 128
#define STRATA_NR_WARPS (STRATA_NR_THREADS / STRATA_WARP)
#define STRATA_NR_PREFETCH 16
extern "C" __global__ void __launch_bounds__(STRATA_NR_THREADS)
strata_fast_decode_norm_route2(const float* __restrict__ x, const float* __restrict__ norm_w,
                               const float* __restrict__ router, int E, int H, float eps, float* __restrict__ xn,
                               float* __restrict__ logits) {
    __shared__ float s_part[STRATA_NR_WARPS];
    const int warp = threadIdx.x / STRATA_WARP, lane = threadIdx.x % STRATA_WARP;
    const int e = blockIdx.x * STRATA_NR_WARPS + warp;
    const int h4 = H / 4;
    const float4* r4 = (const float4*)(router + (long long)(e < E ? e : E - 1) * H);
    float4 rv[STRATA_NR_PREFETCH];
#pragma unroll
    for (int j = 0; j < STRATA_NR_PREFETCH; ++j) {
        const int c = lane + j * STRATA_WARP;
        rv[j] = c < h4 ? r4[c] : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    STRATA_GRID_LAUNCH_DEPENDENTS();
    STRATA_GRID_WAIT();  // x is the previous kernel's
    const float4* x4 = (const float4*)x;
    const float4* n4 = (const float4*)norm_w;
    float ss = 0.f;
    for (int c = threadIdx.x; c < h4; c += STRATA_NR_THREADS) {
        const float4 v = x4[c];
        ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
    ss = warp_sum(ss);
    if (lane == 0) s_part[warp] = ss;
    __syncthreads();
    float tot = 0.f;
    for (int w = 0; w < STRATA_NR_WARPS; ++w) tot += s_part[w];
    const float inv = 1.0f / sqrtf(tot / (float)H + eps);
    if (blockIdx.x == 0) {
        for (int c = threadIdx.x; c < h4; c += STRATA_NR_THREADS) {
            const float4 v = x4[c], n = n4[c];
            ((float4*)xn)[c] = make_float4(v.x * inv * n.x, v.y * inv * n.y, v.z * inv * n.z, v.w * inv * n.w);
        }
    }
    if (e >= E) return;
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < STRATA_NR_PREFETCH; ++j) {
        const int c = lane + j * STRATA_WARP;
        if (c < h4) {
            const float4 v = x4[c], n = n4[c], r = rv[j];
            acc += (v.x * inv * n.x) * r.x + (v.y * inv * n.y) * r.y + (v.z * inv * n.z) * r.z + (v.w * inv * n.w) * r.w;
        }
    }
    for (int c = lane + STRATA_NR_PREFETCH * STRATA_WARP; c < h4; c += STRATA_WARP) {
        const float4 v = x4[c], n = n4[c], r = r4[c];
        acc += (v.x * inv * n.x) * r.x + (v.y * inv * n.y) * r.y + (v.z * inv * n.z) * r.z + (v.w * inv * n.w) * r.w;
    }
    acc = warp_sum(acc);
    if (lane == 0) logits[e] = acc;
}

// Decode, step 2, second form: as strata_fast_decode_down (hits and mapped misses only), each lane's weight loads
// issued in batches of STRATA_DOWN_BATCH 16-byte loads before any of them is used, so a warp keeps that many in
// flight; the sum runs in the same order as the first form (the same bits).
#define STRATA_DOWN_BATCH 8
extern "C" __global__ void __launch_bounds__(STRATA_FAST_THREADS)
strata_fast_decode_down2(const float* __restrict__ act, const int* __restrict__ ids, const float* __restrict__ wts,
                         const int* __restrict__ slot_map, const unsigned short* __restrict__ w2,
                         const unsigned short* __restrict__ host_w2, long long slot_stride, int H, int F, int K,
                         float* __restrict__ out, int accumulate) {
    __shared__ const unsigned short* s_base[STRATA_FAST_WARPS][STRATA_FAST_MAXK];
    __shared__ float s_w[STRATA_FAST_WARPS][STRATA_FAST_MAXK];
    __shared__ int s_nan[STRATA_FAST_WARPS];
    const int warp = threadIdx.x / STRATA_WARP, lane = threadIdx.x % STRATA_WARP;
    const int h = blockIdx.x * STRATA_FAST_WARPS + warp;
    STRATA_GRID_LAUNCH_DEPENDENTS();
    STRATA_GRID_WAIT();  // act, ids and weights are the previous kernel's
    if (h >= H) return;  // whole warps; no block barrier in this kernel
    if (lane == 0) s_nan[warp] = 0;
    warp_sync_lanes();
    if (lane < K) {
        const int e = ids[lane];
        const long long slot = slot_map[e];
        const unsigned short* base = w2;
        if (slot >= 0) {
            base = w2 + slot * slot_stride;
        } else if (host_w2 != 0) {
            base = host_w2 + (long long)e * slot_stride;
        } else {
            s_nan[warp] = 1;
        }
        s_base[warp][lane] = base;
        s_w[warp][lane] = wts[lane];
    }
    warp_sync_lanes();
    if (s_nan[warp]) {
        if (lane == 0) out[h] = __int_as_float(0x7fc00000);
        return;
    }
    const int per_row = F / 8, n = K * per_row;
    float acc = 0.f;
    for (int i0 = lane; i0 < n; i0 += STRATA_DOWN_BATCH * STRATA_WARP) {
        uint4 v[STRATA_DOWN_BATCH];
#pragma unroll
        for (int j = 0; j < STRATA_DOWN_BATCH; ++j) {
            const int i = i0 + j * STRATA_WARP;
            if (i < n) {
                const int k = i / per_row, c = i - k * per_row;
                v[j] = ((const uint4*)(s_base[warp][k] + (long long)h * F))[c];
            }
        }
#pragma unroll
        for (int j = 0; j < STRATA_DOWN_BATCH; ++j) {
            const int i = i0 + j * STRATA_WARP;
            if (i < n) {
                const int k = i / per_row, c = i - k * per_row;
                const float4* a4 = (const float4*)(act + (long long)k * F);
                const float4 xa = a4[2 * c], xb = a4[2 * c + 1];
                const float xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
                acc += s_w[warp][k] * dot8(v[j], xv);
            }
        }
    }
    acc = warp_sum(acc);
    if (lane == 0) out[h] = accumulate ? out[h] + acc : acc;
}

// Decode, third forms (FastMoE.decode_form 3-5). Measured on the H200, the first and second forms read well under
// the HBM rate (gate/up 2.4 TB/s, down 1.6) because each warp's time went to latency, not bytes: every gate/up
// warp ran its own K rounds of shuffles for the top-k before its first load, then the slot look-up chained behind
// it; the down warps chained ids -> slot map -> weights and made three trips to memory for their 24 loads. Here
// the routing is done once a block by all its threads (each expert's rank counted against every logit: short
// independent compares instead of K dependent shuffle rounds), block (0,0) publishes the K routed slots so the down
// kernel reads ids, weights and slots side by side, and every lane issues all of its weight loads before summing
// any (as the LM-head GEMV does), one trip to memory a warp.

// A NaN logit ranks as -inf (warp_topk's rule: the K ids are always experts).
__device__ __forceinline__ float rank_key(float v) { return v != v ? -__int_as_float(0x7f800000) : v; }

// Top-k of E <= blockDim.x logits by rank, every thread of the block taking part; on return s_sel[r] and s_lg[r]
// hold the id and (NaN-mapped) logit of rank r < K for every thread: descending, ties to the lower id, the order
// of warp_topk and of the reference's stable argsort. s_l and s_part hold blockDim.x values each.
__device__ void block_rank_topk(const float* __restrict__ logits, int E, int K, float* s_l, int* s_part, int* s_sel,
                                float* s_lg) {
    const int t = threadIdx.x;
    for (int i = t; i < E; i += blockDim.x) s_l[i] = rank_key(logits[i]);
    __syncthreads();
    const int parts = blockDim.x / E;  // each expert's compares split over this many threads
    const int e = t % E, p = t / E;
    const int span = (E + parts - 1) / parts;
    if (p < parts) {
        const float le = s_l[e];
        const int j1 = min(E, (p + 1) * span);
        int rank = 0;
        for (int j = p * span; j < j1; ++j) {
            const float lj = s_l[j];
            rank += (lj > le) | ((lj == le) & (j < e));
        }
        s_part[t] = rank;
    }
    __syncthreads();
    if (t < E) {
        int r = 0;
        for (int q = 0; q < parts; ++q) r += s_part[q * E + t];
        if (r < K) {
            s_sel[r] = t;
            s_lg[r] = s_l[t];
        }
    }
    __syncthreads();
}

// Block (0,0)'s threads r < K write the routed ids, softmax weights (warp_topk's arithmetic, the same bits) and
// slots (s_slot[r] = slot_map[id]) of block_rank_topk's result for step 2.
__device__ __forceinline__ void publish_route(const int* s_sel, const float* s_lg, int K, const int* s_slot,
                                              int* __restrict__ ids_out, float* __restrict__ w_out,
                                              int* __restrict__ slots_out) {
    if (threadIdx.x >= K) return;
    const int r = threadIdx.x;
    const float top0 = s_lg[0];
    float s = 0.0f;
    for (int q = 0; q < K; ++q) s += expf(s_lg[q] - top0);
    ids_out[r] = s_sel[r];
    w_out[r] = expf(s_lg[r] - top0) / s;
    slots_out[r] = s_slot[r];
}

// Which of the K routed experts a third-form gate/up block computes. With STRATA_MISSES_FIRST (the default) the
// grid's expert index blockIdx.y walks the uncached ranks before the cached ones (each in rank order): a block
// is dispatched in index order, so a missed expert's link-bound blocks start in the first wave and the cached
// experts' blocks fill the SMs beside them, instead of the miss starting after every hit ahead of it in rank.
// The block still writes act at its expert's rank, so results are the same bits in either order.
#ifndef STRATA_MISSES_FIRST
#define STRATA_MISSES_FIRST 1
#endif
struct RoutedBlock {
    int rank;        // the expert's rank in the top k (act's row)
    int e;           // its id
    long long slot;  // its cache slot, -1 if not cached
    long long land;  // for a miss: the slot its bytes are written into as they are read (land[e]), else -1
};

// The opening of a third-form gate/up block: wait for logits and x (the previous kernel's), rank the top k once a
// block, block (0,0) publishes ids, weights and slots for step 2, and this block's expert is chosen (above). `land`
// (may be null) is the layer's landing table [E]: a missed expert e with land[e] >= 0 is admitted in passing, its
// bytes written into slot land[e] as the kernels read them from host memory (the host reserved that slot and reads
// none of it until the step is counted), so an admission costs the link nothing beyond the miss itself.
// The pools stay `const __restrict__` in the kernels (their hits take the read-only load path) and a landing is
// written through const_cast: the reserved slot is one no map of the step names, so no load of the kernel reads it.
__device__ RoutedBlock route_block(const float* __restrict__ logits, int E, int K, const int* __restrict__ slot_map,
                                   const int* __restrict__ land, int* __restrict__ ids_out, float* __restrict__ w_out,
                                   int* __restrict__ slots_out) {
    __shared__ float s_l[STRATA_FAST_THREADS];
    __shared__ int s_part[STRATA_FAST_THREADS];
    __shared__ int s_sel[STRATA_FAST_MAXK];
    __shared__ float s_lg[STRATA_FAST_MAXK];
    __shared__ int s_slot[STRATA_FAST_MAXK];
    __shared__ int s_rank;
    STRATA_GRID_LAUNCH_DEPENDENTS();
    STRATA_GRID_WAIT();
    block_rank_topk(logits, E, K, s_l, s_part, s_sel, s_lg);
    if (threadIdx.x < K) s_slot[threadIdx.x] = slot_map[s_sel[threadIdx.x]];
    __syncthreads();
    if (blockIdx.x == 0 && blockIdx.y == 0) publish_route(s_sel, s_lg, K, s_slot, ids_out, w_out, slots_out);
    if (threadIdx.x == 0) {
        int rank = blockIdx.y;
#if STRATA_MISSES_FIRST
        int n = 0;
        for (int pass = 0; pass < 2; ++pass)  // pass 0 the misses, pass 1 the hits
            for (int r = 0; r < K; ++r)
                if ((s_slot[r] >= 0) == (pass == 1) && n++ == (int)blockIdx.y) rank = r;
#endif
        s_rank = rank;
    }
    __syncthreads();
    RoutedBlock b;
    b.rank = s_rank;
    b.e = s_sel[b.rank];
    b.slot = s_slot[b.rank];
    b.land = (b.slot < 0 && land != 0) ? (long long)land[b.e] : -1;
    return b;
}

// Step 1, third form: act[k,i] = silu(x . Wg[i]) * (x . Wu[i]), one warp a row pair (gate row i and up row i of
// expert k) at a time, each lane loading STRATA_GU3_GROUP 16-byte chunks of both rows before any sum (16 loads in
// flight a lane; H = 2048 is one group). Sums in the LM-head GEMV's tree shape. Grid (gx, K): the warps stride over
// the F row pairs (gx = ceil(F / warps) gives one pair a warp; fewer blocks route fewer times and fit in one wave).
// Block (0,0) writes ids, softmax weights (warp_topk's arithmetic, the same bits) and the routed slots slot_map[id]
// for step 2. With w2_prefetch (may be null), the blocks of expert k hint its cached down matrix (w2_stride halves
// at slot * w2_stride) into L2, split between them, so step 2 reads it from L2 while this kernel reads HBM.
// Misses as strata_fast_decode_gate_up without refill_from / skip_missing (host_w13 or NaN).
#define STRATA_GU3_GROUP 8
extern "C" __global__ void __launch_bounds__(STRATA_FAST_THREADS, 2)
strata_fast_decode_gate_up3(const float* __restrict__ x, const float* __restrict__ logits, int E, int K,
                            const int* __restrict__ slot_map, const unsigned short* __restrict__ w13,
                            const unsigned short* __restrict__ host_w13, long long slot_stride, int H, int F,
                            float* __restrict__ act, int* __restrict__ ids_out, float* __restrict__ w_out,
                            int* __restrict__ slots_out, const unsigned short* __restrict__ w2_prefetch,
                            long long w2_stride, const int* __restrict__ land) {
    const int warp = threadIdx.x / STRATA_WARP, lane = threadIdx.x % STRATA_WARP;
    const RoutedBlock rb = route_block(logits, E, K, slot_map, land, ids_out, w_out, slots_out);
    const int k = rb.rank, e = rb.e;
    const long long slot = rb.slot;
    if (w2_prefetch != 0 && slot >= 0) {
        const char* p = (const char*)(w2_prefetch + slot * w2_stride);
        const long long bytes = 2 * w2_stride;
        const long long per_block = (bytes + 128LL * gridDim.x - 1) / (128LL * gridDim.x) * 128;
        const long long b1 = min(bytes, (blockIdx.x + 1) * per_block);
        for (long long o = blockIdx.x * per_block + 128LL * threadIdx.x; o < b1; o += 128LL * blockDim.x)
            STRATA_PREFETCH_L2(p + o);
    }
    const unsigned short* base = w13;
    const bool unread = slot < 0 && host_w13 == 0;
    uint4* landing = 0;  // the reserved slot this miss is written into as it is read (block-uniform)
    if (slot >= 0) {
        base = w13 + slot * slot_stride;
    } else if (host_w13 != 0) {
        base = host_w13 + (long long)e * slot_stride;
        if (rb.land >= 0) landing = (uint4*)(const_cast<unsigned short*>(w13) + rb.land * slot_stride);
    }
    const float4* x4 = (const float4*)x;
    const int h8 = H / 8;
    for (int row = blockIdx.x * STRATA_FAST_WARPS + warp; row < F; row += gridDim.x * STRATA_FAST_WARPS) {
        if (unread) {
            if (lane == 0) act[(long long)k * F + row] = __int_as_float(0x7fc00000);
            continue;
        }
        const uint4* g = (const uint4*)(base + (long long)row * H);
        const uint4* u = (const uint4*)(base + (long long)(F + row) * H);
        float ag = 0.f, au = 0.f;
        // chunks past H re-read the last one (clamped, not predicated) and count zero: a loop body without branches,
        // so the compiler issues all of a group's loads before the first sum (a load under a branch stays behind it)
        for (int c0 = 0; c0 < h8; c0 += STRATA_GU3_GROUP * STRATA_WARP) {
            uint4 vg[STRATA_GU3_GROUP], vu[STRATA_GU3_GROUP];
#pragma unroll
            for (int j = 0; j < STRATA_GU3_GROUP; ++j) {
                const int c = min(c0 + j * STRATA_WARP + lane, h8 - 1);
                vg[j] = g[c];
                vu[j] = u[c];
            }
            STRATA_ISSUE_FENCE();
            if (landing != 0) {  // after the fence: a store waits for its load, which must not hold back the others
#pragma unroll
                for (int j = 0; j < STRATA_GU3_GROUP; ++j) {
                    const int cj = c0 + j * STRATA_WARP + lane;
                    if (cj < h8) {
                        landing[(long long)row * h8 + cj] = vg[j];
                        landing[(long long)(F + row) * h8 + cj] = vu[j];
                    }
                }
            }
            float dg[STRATA_GU3_GROUP], du[STRATA_GU3_GROUP];
#pragma unroll
            for (int j = 0; j < STRATA_GU3_GROUP; ++j) {
                const int cj = c0 + j * STRATA_WARP + lane, c = min(cj, h8 - 1);
                const float4 xa = x4[2 * c], xb = x4[2 * c + 1];
                const float xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
                const float a = dot8(vg[j], xv), b = dot8(vu[j], xv);
                dg[j] = cj < h8 ? a : 0.f;
                du[j] = cj < h8 ? b : 0.f;
            }
            ag += ((dg[0] + dg[1]) + (dg[2] + dg[3])) + ((dg[4] + dg[5]) + (dg[6] + dg[7]));
            au += ((du[0] + du[1]) + (du[2] + du[3])) + ((du[4] + du[5]) + (du[6] + du[7]));
        }
        ag = warp_sum(ag);
        au = warp_sum(au);
        if (lane == 0) act[(long long)k * F + row] = silu(ag) * au;
    }
}

// Step 2, third forms: out[h] (+)= sum_k w_k * (Wd[slot_k, h] . act[k]) with SPLIT warps a hidden row, each taking
// ceil(K / SPLIT) experts, their partial sums added in warp order through shared memory (one writer a row, no
// atomics). A lane takes the warp's (expert, 16-byte chunk) pairs 32 apart and issues BATCH loads before summing
// (at K = 8, F = 768: SPLIT 2 and BATCH 12, or SPLIT 4 and BATCH 6, is every load of the lane at once; SPLIT 1 and
// BATCH 12 two trips). ids, weights and slots are step 1's (slot < 0: host_w2, or NaN without it).
// Grid ceil(H / (warps / SPLIT)).
template <int SPLIT, int BATCH>
__device__ __forceinline__ void decode_down3(const float* __restrict__ act, const int* __restrict__ ids,
                                             const float* __restrict__ wts, const int* __restrict__ slots,
                                             const unsigned short* __restrict__ w2,
                                             const unsigned short* __restrict__ host_w2, long long slot_stride, int H,
                                             int F, int K, float* __restrict__ out, int accumulate,
                                             const int* __restrict__ land) {
    constexpr int RPB = STRATA_FAST_WARPS / SPLIT;  // hidden rows a block
    __shared__ const unsigned short* s_base[STRATA_FAST_MAXK];
    __shared__ uint4* s_land[STRATA_FAST_MAXK];  // a missed expert's reserved slot (route_block), else null
    __shared__ float s_w[STRATA_FAST_MAXK];
    __shared__ float s_part[STRATA_FAST_WARPS];
    __shared__ int s_nan;
    const int warp = threadIdx.x / STRATA_WARP, lane = threadIdx.x % STRATA_WARP;
    STRATA_GRID_LAUNCH_DEPENDENTS();
    STRATA_GRID_WAIT();  // act, ids, weights and slots are the previous kernel's
    if (threadIdx.x == 0) s_nan = 0;
    __syncthreads();
    if (threadIdx.x < K) {
        const int q = threadIdx.x;
        const long long slot = slots[q];
        const unsigned short* base = w2;
        uint4* dst = 0;
        if (slot >= 0) {
            base = w2 + slot * slot_stride;
        } else if (host_w2 != 0) {
            base = host_w2 + (long long)ids[q] * slot_stride;
            const long long ls = land != 0 ? (long long)land[ids[q]] : -1;
            if (ls >= 0) dst = (uint4*)(const_cast<unsigned short*>(w2) + ls * slot_stride);
        } else {
            s_nan = 1;
        }
        s_base[q] = base;
        s_land[q] = dst;
        s_w[q] = wts[q];
    }
    __syncthreads();
    const int r = warp % RPB, part = warp / RPB;
    const int h = blockIdx.x * RPB + r;
    const int kpw = (K + SPLIT - 1) / SPLIT, k0 = part * kpw, k1 = min(K, k0 + kpw);
    const int per_row = F / 8;
    float acc = 0.f;
    if (h < H && k0 < k1 && !s_nan) {  // uniform over the warp
        // the warp's (expert, chunk) pairs flat, 32 apart a lane; pairs past the end re-read the last one and
        // count zero (selects, not branches: a load under a branch is not issued before the sums of the others)
        const int n = (k1 - k0) * per_row;
        for (int i0 = 0; i0 < n; i0 += BATCH * STRATA_WARP) {  // the same trips for every lane
            uint4 v[BATCH];
            int off[BATCH];
            float wq[BATCH];
#pragma unroll
            for (int j = 0; j < BATCH; ++j) {
                const int i = min(i0 + j * STRATA_WARP + lane, n - 1);
                const int q = k0 + i / per_row, c = i % per_row;
                v[j] = ((const uint4*)(s_base[q] + (long long)h * F))[c];
                off[j] = q * F + 8 * c;
                wq[j] = s_w[q];
            }
            STRATA_ISSUE_FENCE();
#pragma unroll
            for (int j = 0; j < BATCH; ++j) {
                const int i = i0 + j * STRATA_WARP + lane;
                if (i < n) {
                    const int q = k0 + i / per_row, c = i % per_row;
                    uint4* dst = s_land[q];
                    if (dst != 0) dst[(long long)h * per_row + c] = v[j];
                }
            }
#pragma unroll
            for (int j = 0; j < BATCH; ++j) {
                const float4* a4 = (const float4*)(act + off[j]);
                const float4 xa = a4[0], xb = a4[1];
                const float xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
                const float d = wq[j] * dot8(v[j], xv);
                acc += i0 + j * STRATA_WARP + lane < n ? d : 0.f;
            }
        }
        acc = warp_sum(acc);
    }
    if (lane == 0) s_part[warp] = acc;
    __syncthreads();
    if (part == 0 && lane == 0 && h < H) {
        float sum = s_part[r];
#pragma unroll
        for (int q = 1; q < SPLIT; ++q) sum += s_part[q * RPB + r];
        out[h] = s_nan ? __int_as_float(0x7fc00000) : (accumulate ? out[h] + sum : sum);
    }
}

#define STRATA_DOWN3_KERNEL(NAME, SPLIT, BATCH, MIN_BLOCKS)                                                       \
    extern "C" __global__ void __launch_bounds__(STRATA_FAST_THREADS, MIN_BLOCKS)                                 \
    NAME(const float* __restrict__ act, const int* __restrict__ ids, const float* __restrict__ wts,               \
         const int* __restrict__ slots, const unsigned short* __restrict__ w2,                                    \
         const unsigned short* __restrict__ host_w2, long long slot_stride, int H, int F, int K,                  \
         float* __restrict__ out, int accumulate, const int* __restrict__ land) {                                  \
        decode_down3<SPLIT, BATCH>(act, ids, wts, slots, w2, host_w2, slot_stride, H, F, K, out, accumulate, land); \
    }
STRATA_DOWN3_KERNEL(strata_fast_decode_down3_s1, 1, 12, 2)
STRATA_DOWN3_KERNEL(strata_fast_decode_down3_s2, 2, 12, 2)
STRATA_DOWN3_KERNEL(strata_fast_decode_down3_s4, 4, 6, 3)

// The LM head of a few tokens: out[t, o] = x[t] . w[o] for f16 weights w [O, H], f32 sums; grid (ceil(O / rows a
// block), T). Each warp takes STRATA_GEMV_WROWS rows; a lane loads 8 chunks of 8 halves (16 bytes each) of every
// one of its rows before summing any, so a warp has 8 x STRATA_GEMV_WROWS loads in flight, and the first group of
// loads is issued before the wait for x (weights are constant: under a programmatic launch they stream in while the
// final norm runs). The sums keep the pairwise shape of a tree: a chunk's 8 products in order, the lane's 8 chunk
// sums pairwise, then the warp's lanes by butterfly (8 levels over 256 chunks at H = 2048), so the rounding error
// stays that of a tree reduction. Hardware half conversion (fh2f). H % 8 == 0.
#define STRATA_GEMV_WROWS 2
#define STRATA_GEMV_GROUP 8
extern "C" __global__ void __launch_bounds__(STRATA_FAST_THREADS)
strata_fast_gemv_f16w(const float* __restrict__ x, const unsigned short* __restrict__ w, int O, int H,
                      float* __restrict__ out) {
    const int warp = threadIdx.x / STRATA_WARP, lane = threadIdx.x % STRATA_WARP;
    const int t = blockIdx.y;
    const int o0 = (blockIdx.x * STRATA_FAST_WARPS + warp) * STRATA_GEMV_WROWS;
    const int h8 = H / 8;
    const float4* x4 = (const float4*)(x + (long long)t * H);
    const uint4* rows[STRATA_GEMV_WROWS];
#pragma unroll
    for (int r = 0; r < STRATA_GEMV_WROWS; ++r) {
        const int o = o0 + r < O ? o0 + r : O - 1;  // rows past O repeat the last one, never written
        rows[r] = (const uint4*)(w + (long long)o * H);
    }
    float acc[STRATA_GEMV_WROWS];
#pragma unroll
    for (int r = 0; r < STRATA_GEMV_WROWS; ++r) acc[r] = 0.f;
    bool waited = false;
    for (int c0 = 0; c0 < h8; c0 += STRATA_GEMV_GROUP * STRATA_WARP) {
        uint4 v[STRATA_GEMV_WROWS][STRATA_GEMV_GROUP];
#pragma unroll
        for (int j = 0; j < STRATA_GEMV_GROUP; ++j) {
            const int c = c0 + j * STRATA_WARP + lane;
#pragma unroll
            for (int r = 0; r < STRATA_GEMV_WROWS; ++r)
                v[r][j] = c < h8 ? rows[r][c] : make_uint4(0u, 0u, 0u, 0u);
        }
        if (!waited) {
            STRATA_GRID_LAUNCH_DEPENDENTS();
            STRATA_GRID_WAIT();  // x is the previous kernel's
            waited = true;
        }
        float d[STRATA_GEMV_WROWS][STRATA_GEMV_GROUP];
#pragma unroll
        for (int j = 0; j < STRATA_GEMV_GROUP; ++j) {
            const int c = c0 + j * STRATA_WARP + lane;
            float4 xa = make_float4(0.f, 0.f, 0.f, 0.f), xb = xa;
            if (c < h8) { xa = x4[2 * c]; xb = x4[2 * c + 1]; }
            const float xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
            for (int r = 0; r < STRATA_GEMV_WROWS; ++r) d[r][j] = dot8(v[r][j], xv);
        }
#pragma unroll
        for (int r = 0; r < STRATA_GEMV_WROWS; ++r)
            acc[r] += ((d[r][0] + d[r][1]) + (d[r][2] + d[r][3])) + ((d[r][4] + d[r][5]) + (d[r][6] + d[r][7]));
    }
#pragma unroll
    for (int r = 0; r < STRATA_GEMV_WROWS; ++r) acc[r] = warp_sum(acc[r]);
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < STRATA_GEMV_WROWS; ++r)
            if (o0 + r < O) out[(long long)t * O + o0 + r] = acc[r];
    }
}

// Q8_0 decode: the two steps above over Q8_0 pools (int8 quants [rows, cols] and one f16 scale per 32 of a row),
// each lane reading 16 quants (one 16-byte load) and their scale, so the link and HBM carry 1.06 bytes a weight and
// no f16 copy exists. x . (q * d) is summed in f32 from the exact quants. A missed expert (slot < 0) is read from
// page-locked host memory when its host bases are not null, else its outputs are NaN (a check catches it).
#ifndef STRATA_Q8_PRMT
#define STRATA_Q8_PRMT 1  // fast.py passes FastMoE.q8_decode's choice with -D
#endif
#if STRATA_Q8_PRMT && !defined(STRATA_HIP)
// A quant biased to unsigned (xor 0x80) and put under the exponent of 2^23 by one byte permute is the float 2^23 + u;
// minus 2^23 + 128 it is the quant exactly, so the products and sums are those of the cast below, bit for bit. A
// byte permute and an add run on pipes of 64 and 128 lanes a clock an SM; the int8 conversion runs at 16, a quarter
// of the quants HBM delivers at full rate.
__device__ __forceinline__ float q8_at(unsigned u, unsigned sel) {
    return __uint_as_float(__byte_perm(u, 0x4B000000u, sel)) - 8388736.0f;
}
__device__ __forceinline__ float q8_dot4(int w, float4 x) {
    const unsigned u = (unsigned)w ^ 0x80808080u;
    return q8_at(u, 0x7540) * x.x + q8_at(u, 0x7541) * x.y + q8_at(u, 0x7542) * x.z + q8_at(u, 0x7543) * x.w;
}
#else
__device__ __forceinline__ float q8_dot4(int w, float4 x) {
    return (float)(signed char)(w & 0xff) * x.x + (float)(signed char)((w >> 8) & 0xff) * x.y +
           (float)(signed char)((w >> 16) & 0xff) * x.z + (float)(signed char)((w >> 24) & 0xff) * x.w;
}
#endif

__device__ __forceinline__ float q8_dot16(int4 v, const float4* x4) {
    return q8_dot4(v.x, x4[0]) + q8_dot4(v.y, x4[1]) + q8_dot4(v.z, x4[2]) + q8_dot4(v.w, x4[3]);
}

// Step 1 (Q8_0): route as strata_fast_decode_gate_up, then act[k,i] = silu(x . Wg[i]) * (x . Wu[i]).
// Grid (ceil(F / (warps * STRATA_DEC_ROWS)), K).
extern "C" __global__ void __launch_bounds__(STRATA_FAST_THREADS)
strata_fast_decode_gate_up_q8(const float* __restrict__ x, const float* __restrict__ logits, int E, int K,
                              const int* __restrict__ slot_map, const signed char* __restrict__ q13,
                              const unsigned short* __restrict__ d13, const signed char* __restrict__ host_q13,
                              const unsigned short* __restrict__ host_d13, int H, int F, float* __restrict__ act,
                              int* __restrict__ ids_out, float* __restrict__ w_out) {
    __shared__ int s_ids[STRATA_FAST_WARPS][STRATA_FAST_MAXK];
    __shared__ float s_w[STRATA_FAST_WARPS][STRATA_FAST_MAXK];
    const int warp = threadIdx.x / STRATA_WARP, lane = threadIdx.x % STRATA_WARP;
    const int k = blockIdx.y;
    const int row0 = (blockIdx.x * STRATA_FAST_WARPS + warp) * STRATA_DEC_ROWS;
    STRATA_GRID_LAUNCH_DEPENDENTS();
    STRATA_GRID_WAIT();  // logits and x are the previous kernel's
    if (row0 >= F) return;  // whole warps; no block barrier in this kernel
    warp_topk(logits, E, K, lane, s_ids[warp], s_w[warp]);
    warp_sync_lanes();
    if (blockIdx.x == 0 && k == 0 && warp == 0 && lane < K) {
        ids_out[lane] = s_ids[0][lane];
        w_out[lane] = s_w[0][lane];
    }
    const int e = s_ids[warp][k];
    const long long slot = slot_map[e];
    const long long nq = 2LL * F * H, nd = nq / 32;  // one expert's quants and scales
    const signed char* qb;
    const unsigned short* db;
    if (slot >= 0) {
        qb = q13 + slot * nq;
        db = d13 + slot * nd;
    } else if (host_q13 != 0) {
        qb = host_q13 + (long long)e * nq;
        db = host_d13 + (long long)e * nd;
    } else {
        if (lane < STRATA_DEC_ROWS && row0 + lane < F)
            act[(long long)k * F + row0 + lane] = __int_as_float(0x7fc00000);
        return;
    }
    const float4* x4 = (const float4*)x;
    float acc[2 * STRATA_DEC_ROWS];
#pragma unroll
    for (int r = 0; r < 2 * STRATA_DEC_ROWS; ++r) acc[r] = 0.f;
    const int nd_row = H / 32;
#pragma unroll 2
    for (int c = lane; c < H / 16; c += STRATA_WARP) {
        int4 qv[2 * STRATA_DEC_ROWS];
        float sv[2 * STRATA_DEC_ROWS];
#pragma unroll
        for (int r = 0; r < STRATA_DEC_ROWS; ++r) {
            const long long row = min(row0 + r, F - 1), row_u = F + row;
            qv[2 * r] = ((const int4*)(qb + row * H))[c];
            qv[2 * r + 1] = ((const int4*)(qb + row_u * H))[c];
            sv[2 * r] = fh2f(db[row * nd_row + c / 2]);
            sv[2 * r + 1] = fh2f(db[row_u * nd_row + c / 2]);
        }
        const float4 xv[4] = {x4[4 * c], x4[4 * c + 1], x4[4 * c + 2], x4[4 * c + 3]};
#pragma unroll
        for (int r = 0; r < 2 * STRATA_DEC_ROWS; ++r) acc[r] += sv[r] * q8_dot16(qv[r], xv);
    }
#pragma unroll
    for (int r = 0; r < 2 * STRATA_DEC_ROWS; ++r) acc[r] = warp_sum(acc[r]);
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < STRATA_DEC_ROWS; ++r)
            if (row0 + r < F) act[(long long)k * F + row0 + r] = silu(acc[2 * r]) * acc[2 * r + 1];
    }
}

// Step 2 (Q8_0): one warp per hidden row h: out[h] (+)= sum_k w_k * (Wd[slot_k, h] . act[k]). Grid ceil(H / warps).
extern "C" __global__ void __launch_bounds__(STRATA_FAST_THREADS)
strata_fast_decode_down_q8(const float* __restrict__ act, const int* __restrict__ ids, const float* __restrict__ wts,
                           const int* __restrict__ slot_map, const signed char* __restrict__ q2,
                           const unsigned short* __restrict__ d2, const signed char* __restrict__ host_q2,
                           const unsigned short* __restrict__ host_d2, int H, int F, int K, float* __restrict__ out,
                           int accumulate) {
    __shared__ const signed char* s_q[STRATA_FAST_WARPS][STRATA_FAST_MAXK];
    __shared__ const unsigned short* s_d[STRATA_FAST_WARPS][STRATA_FAST_MAXK];
    __shared__ float s_w[STRATA_FAST_WARPS][STRATA_FAST_MAXK];
    __shared__ int s_nan[STRATA_FAST_WARPS];
    const int warp = threadIdx.x / STRATA_WARP, lane = threadIdx.x % STRATA_WARP;
    const int h = blockIdx.x * STRATA_FAST_WARPS + warp;
    STRATA_GRID_LAUNCH_DEPENDENTS();
    STRATA_GRID_WAIT();
    if (h >= H) return;  // whole warps; no block barrier in this kernel
    if (lane == 0) s_nan[warp] = 0;
    warp_sync_lanes();
    const long long nq = (long long)H * F, nd = nq / 32;
    if (lane < K) {
        const int e = ids[lane];
        const long long slot = slot_map[e];
        const signed char* qb = q2;
        const unsigned short* db = d2;
        if (slot >= 0) {
            qb = q2 + slot * nq;
            db = d2 + slot * nd;
        } else if (host_q2 != 0) {
            qb = host_q2 + (long long)e * nq;
            db = host_d2 + (long long)e * nd;
        } else {
            s_nan[warp] = 1;
        }
        s_q[warp][lane] = qb;
        s_d[warp][lane] = db;
        s_w[warp][lane] = wts[lane];
    }
    warp_sync_lanes();
    if (s_nan[warp]) {
        if (lane == 0) out[h] = __int_as_float(0x7fc00000);
        return;
    }
    const int per_row = F / 16, nd_row = F / 32;
    float acc = 0.f;
#pragma unroll 4
    for (int i = lane; i < K * per_row; i += STRATA_WARP) {
        const int k = i / per_row, c = i - k * per_row;
        const int4 v = ((const int4*)(s_q[warp][k] + (long long)h * F))[c];
        const float s = fh2f(s_d[warp][k][(long long)h * nd_row + c / 2]);
        const float4* a4 = (const float4*)(act + (long long)k * F) + 4 * c;
        acc += s_w[warp][k] * s * q8_dot16(v, a4);
    }
    acc = warp_sum(acc);
    if (lane == 0) out[h] = accumulate ? out[h] + acc : acc;
}

// Decode, third forms over Q8_0 pools (FastMoE.decode_form 3-8, q8_0): the f16 third forms' structure (routing
// once a block by rank, block (0,0) publishing ids, weights and routed slots, every lane issuing a trip's loads
// before any sum) with the Q8_0 steps' loads and sums: 16 quants (one 16-byte load) and their f16 scale a chunk,
// x . (q * d) summed in f32 from the exact quants. The first Q8_0 kernels above route in every warp (K rounds of
// shuffles before the first load) and issue a row's loads a few at a time.

// Step 1: act[k,i] = silu(x . Wg[i]) * (x . Wu[i]), one warp a row pair at a time, each lane loading
// STRATA_GU3Q_GROUP chunks of both rows (and their scales) before any sum (H = 2048: one group). Grid (gx, K) as
// strata_fast_decode_gate_up3; misses from host_q13 / host_d13 (mapped), or NaN without them.
#define STRATA_GU3Q_GROUP 4
#ifndef STRATA_Q8_MINB
#define STRATA_Q8_MINB 2  // blocks an SM the third-form Q8_0 pair is compiled for (FastMoE.q8_decode)
#endif
extern "C" __global__ void __launch_bounds__(STRATA_FAST_THREADS, STRATA_Q8_MINB)
strata_fast_decode_gate_up3_q8(const float* __restrict__ x, const float* __restrict__ logits, int E, int K,
                               const int* __restrict__ slot_map, const signed char* __restrict__ q13,
                               const unsigned short* __restrict__ d13, const signed char* __restrict__ host_q13,
                               const unsigned short* __restrict__ host_d13, int H, int F, float* __restrict__ act,
                               int* __restrict__ ids_out, float* __restrict__ w_out, int* __restrict__ slots_out,
                               const int* __restrict__ land) {
    const int warp = threadIdx.x / STRATA_WARP, lane = threadIdx.x % STRATA_WARP;
    const RoutedBlock rb = route_block(logits, E, K, slot_map, land, ids_out, w_out, slots_out);
    const int k = rb.rank, e = rb.e;
    const long long slot = rb.slot;
    const long long nq = 2LL * F * H, nd = nq / 32;  // one expert's quants and scales
    const signed char* qb = q13;
    const unsigned short* db = d13;
    const bool unread = slot < 0 && host_q13 == 0;
    int4* land_q = 0;  // the reserved slot this miss is written into as it is read (block-uniform)
    unsigned short* land_d = 0;
    if (slot >= 0) {
        qb = q13 + slot * nq;
        db = d13 + slot * nd;
    } else if (host_q13 != 0) {
        qb = host_q13 + (long long)e * nq;
        db = host_d13 + (long long)e * nd;
        if (rb.land >= 0) {
            land_q = (int4*)(const_cast<signed char*>(q13) + rb.land * nq);
            land_d = const_cast<unsigned short*>(d13) + rb.land * nd;
        }
    }
    const float4* x4 = (const float4*)x;
    const int h16 = H / 16, nd_row = H / 32;
    for (int row = blockIdx.x * STRATA_FAST_WARPS + warp; row < F; row += gridDim.x * STRATA_FAST_WARPS) {
        if (unread) {
            if (lane == 0) act[(long long)k * F + row] = __int_as_float(0x7fc00000);
            continue;
        }
        const int4* g = (const int4*)(qb + (long long)row * H);
        const int4* u = (const int4*)(qb + (long long)(F + row) * H);
        const unsigned short* dg_row = db + (long long)row * nd_row;
        const unsigned short* du_row = db + (long long)(F + row) * nd_row;
        float ag = 0.f, au = 0.f;
        // chunks past H re-read the last one and count zero (selects, not branches, as strata_fast_decode_gate_up3)
        for (int c0 = 0; c0 < h16; c0 += STRATA_GU3Q_GROUP * STRATA_WARP) {
            int4 vg[STRATA_GU3Q_GROUP], vu[STRATA_GU3Q_GROUP];
            unsigned short sg[STRATA_GU3Q_GROUP], su[STRATA_GU3Q_GROUP];
#pragma unroll
            for (int j = 0; j < STRATA_GU3Q_GROUP; ++j) {
                const int c = min(c0 + j * STRATA_WARP + lane, h16 - 1);
                vg[j] = g[c];
                vu[j] = u[c];
                sg[j] = dg_row[c / 2];
                su[j] = du_row[c / 2];
            }
            STRATA_ISSUE_FENCE();
            if (land_q != 0) {  // after the fence: a store waits for its load, which must not hold back the others
#pragma unroll
                for (int j = 0; j < STRATA_GU3Q_GROUP; ++j) {
                    const int cj = c0 + j * STRATA_WARP + lane;
                    if (cj < h16) {
                        land_q[(long long)row * h16 + cj] = vg[j];
                        land_q[(long long)(F + row) * h16 + cj] = vu[j];
                        if ((cj & 1) == 0) {  // two chunks share a scale: the even one writes it
                            land_d[(long long)row * nd_row + cj / 2] = sg[j];
                            land_d[(long long)(F + row) * nd_row + cj / 2] = su[j];
                        }
                    }
                }
            }
#pragma unroll
            for (int j = 0; j < STRATA_GU3Q_GROUP; ++j) {
                const int cj = c0 + j * STRATA_WARP + lane, c = min(cj, h16 - 1);
                const float a = fh2f(sg[j]) * q8_dot16(vg[j], x4 + 4 * c);
                const float b = fh2f(su[j]) * q8_dot16(vu[j], x4 + 4 * c);
                ag += cj < h16 ? a : 0.f;
                au += cj < h16 ? b : 0.f;
            }
        }
        ag = warp_sum(ag);
        au = warp_sum(au);
        if (lane == 0) act[(long long)k * F + row] = silu(ag) * au;
    }
}

// Step 2: out[h] (+)= sum_k w_k * (Wd[slot_k, h] . act[k]), one warp a hidden row, a lane taking the row's
// (expert, 16-quant chunk) pairs 32 apart and issuing STRATA_D3Q_BATCH loads (and scales) before summing (K = 8,
// F = 768: 384 pairs, one trip). ids, weights and slots are step 1's (slot < 0: host_q2 / host_d2, or NaN).
// Grid ceil(H / warps).
#define STRATA_D3Q_BATCH 12
extern "C" __global__ void __launch_bounds__(STRATA_FAST_THREADS, STRATA_Q8_MINB)
strata_fast_decode_down3_q8(const float* __restrict__ act, const int* __restrict__ ids, const float* __restrict__ wts,
                            const int* __restrict__ slots, const signed char* __restrict__ q2,
                            const unsigned short* __restrict__ d2, const signed char* __restrict__ host_q2,
                            const unsigned short* __restrict__ host_d2, int H, int F, int K, float* __restrict__ out,
                            int accumulate, const int* __restrict__ land) {
    __shared__ const signed char* s_q[STRATA_FAST_MAXK];
    __shared__ const unsigned short* s_d[STRATA_FAST_MAXK];
    __shared__ long long s_land[STRATA_FAST_MAXK];  // a missed expert's reserved slot (route_block), else -1
    __shared__ float s_w[STRATA_FAST_MAXK];
    __shared__ int s_nan;
    const int warp = threadIdx.x / STRATA_WARP, lane = threadIdx.x % STRATA_WARP;
    STRATA_GRID_LAUNCH_DEPENDENTS();
    STRATA_GRID_WAIT();  // act, ids, weights and slots are the previous kernel's
    if (threadIdx.x == 0) s_nan = 0;
    __syncthreads();
    const long long nq = (long long)H * F, nd = nq / 32;
    if (threadIdx.x < K) {
        const int q = threadIdx.x;
        const long long slot = slots[q];
        const signed char* qb = q2;
        const unsigned short* db = d2;
        long long ls = -1;
        if (slot >= 0) {
            qb = q2 + slot * nq;
            db = d2 + slot * nd;
        } else if (host_q2 != 0) {
            qb = host_q2 + (long long)ids[q] * nq;
            db = host_d2 + (long long)ids[q] * nd;
            ls = land != 0 ? (long long)land[ids[q]] : -1;
        } else {
            s_nan = 1;
        }
        s_q[q] = qb;
        s_d[q] = db;
        s_land[q] = ls;
        s_w[q] = wts[q];
    }
    __syncthreads();
    const int h = blockIdx.x * STRATA_FAST_WARPS + warp;
    if (h >= H) return;  // whole warps; no block barrier after this
    if (s_nan) {
        if (lane == 0) out[h] = __int_as_float(0x7fc00000);
        return;
    }
    const int per_row = F / 16, nd_row = F / 32, n = K * per_row;
    float acc = 0.f;
    for (int i0 = 0; i0 < n; i0 += STRATA_D3Q_BATCH * STRATA_WARP) {  // the same trips for every lane
        int4 v[STRATA_D3Q_BATCH];
        unsigned short sd[STRATA_D3Q_BATCH];
        int off[STRATA_D3Q_BATCH];
        float wq[STRATA_D3Q_BATCH];
#pragma unroll
        for (int j = 0; j < STRATA_D3Q_BATCH; ++j) {
            const int i = min(i0 + j * STRATA_WARP + lane, n - 1);
            const int q = i / per_row, c = i - q * per_row;
            v[j] = ((const int4*)(s_q[q] + (long long)h * F))[c];
            sd[j] = s_d[q][(long long)h * nd_row + c / 2];
            off[j] = q * F + 16 * c;
            wq[j] = s_w[q];
        }
        STRATA_ISSUE_FENCE();
#pragma unroll
        for (int j = 0; j < STRATA_D3Q_BATCH; ++j) {
            const int i = i0 + j * STRATA_WARP + lane;
            if (i < n) {
                const int q = i / per_row, c = i - q * per_row;
                const long long ls = s_land[q];
                if (ls >= 0) {
                    ((int4*)(const_cast<signed char*>(q2) + ls * nq + (long long)h * F))[c] = v[j];
                    if ((c & 1) == 0) const_cast<unsigned short*>(d2)[ls * nd + (long long)h * nd_row + c / 2] = sd[j];
                }
            }
        }
#pragma unroll
        for (int j = 0; j < STRATA_D3Q_BATCH; ++j) {
            const float d = wq[j] * fh2f(sd[j]) * q8_dot16(v[j], (const float4*)(act + off[j]));
            acc += i0 + j * STRATA_WARP + lane < n ? d : 0.f;
        }
    }
    acc = warp_sum(acc);
    if (lane == 0) out[h] = accumulate ? out[h] + acc : acc;
}

// Decode, fourth Q8_0 pair (FastMoE.q8_decode "...reg"): the third pair's loads with the activations held in
// registers. Nsight Compute on the third pair (bench/results/s13_h200/call2_ncu_prmt.csv): 25% occupancy (128
// registers), DRAM 36% (gate/up) and 20% (down) busy, L1 60% busy with hits: each 16 quants (16 bytes) came with 64
// bytes of f32 activations read again from L1 for every row. Here a lane reads its activations once and keeps them.

// Step 1: strata_fast_decode_gate_up3_q8 with the lane's x chunks (c = lane + 32 j, j < STRATA_GU3Q_GROUP) loaded
// once into registers for all of the warp's row pairs: the same products summed in the same order (its bits).
// Needs H <= 16 * STRATA_GU3Q_GROUP * warp (fast.py falls back to the third pair).
extern "C" __global__ void __launch_bounds__(STRATA_FAST_THREADS, STRATA_Q8_MINB)
strata_fast_decode_gate_up4_q8(const float* __restrict__ x, const float* __restrict__ logits, int E, int K,
                               const int* __restrict__ slot_map, const signed char* __restrict__ q13,
                               const unsigned short* __restrict__ d13, const signed char* __restrict__ host_q13,
                               const unsigned short* __restrict__ host_d13, int H, int F, float* __restrict__ act,
                               int* __restrict__ ids_out, float* __restrict__ w_out, int* __restrict__ slots_out,
                               const int* __restrict__ land) {
    const int warp = threadIdx.x / STRATA_WARP, lane = threadIdx.x % STRATA_WARP;
    const RoutedBlock rb = route_block(logits, E, K, slot_map, land, ids_out, w_out, slots_out);
    const int k = rb.rank, e = rb.e;
    const long long slot = rb.slot;
    const long long nq = 2LL * F * H, nd = nq / 32;
    const signed char* qb = q13;
    const unsigned short* db = d13;
    const bool unread = slot < 0 && host_q13 == 0;
    int4* land_q = 0;
    unsigned short* land_d = 0;
    if (slot >= 0) {
        qb = q13 + slot * nq;
        db = d13 + slot * nd;
    } else if (host_q13 != 0) {
        qb = host_q13 + (long long)e * nq;
        db = host_d13 + (long long)e * nd;
        if (rb.land >= 0) {
            land_q = (int4*)(const_cast<signed char*>(q13) + rb.land * nq);
            land_d = const_cast<unsigned short*>(d13) + rb.land * nd;
        }
    }
    const int h16 = H / 16, nd_row = H / 32;
    float4 xv[STRATA_GU3Q_GROUP][4];
#pragma unroll
    for (int j = 0; j < STRATA_GU3Q_GROUP; ++j) {
        const float4* x4 = (const float4*)x + 4 * min(j * STRATA_WARP + lane, h16 - 1);
        xv[j][0] = x4[0];
        xv[j][1] = x4[1];
        xv[j][2] = x4[2];
        xv[j][3] = x4[3];
    }
    for (int row = blockIdx.x * STRATA_FAST_WARPS + warp; row < F; row += gridDim.x * STRATA_FAST_WARPS) {
        if (unread) {
            if (lane == 0) act[(long long)k * F + row] = __int_as_float(0x7fc00000);
            continue;
        }
        const int4* g = (const int4*)(qb + (long long)row * H);
        const int4* u = (const int4*)(qb + (long long)(F + row) * H);
        const unsigned short* dg_row = db + (long long)row * nd_row;
        const unsigned short* du_row = db + (long long)(F + row) * nd_row;
        int4 vg[STRATA_GU3Q_GROUP], vu[STRATA_GU3Q_GROUP];
        unsigned short sg[STRATA_GU3Q_GROUP], su[STRATA_GU3Q_GROUP];
#pragma unroll
        for (int j = 0; j < STRATA_GU3Q_GROUP; ++j) {
            const int c = min(j * STRATA_WARP + lane, h16 - 1);
            vg[j] = g[c];
            vu[j] = u[c];
            sg[j] = dg_row[c / 2];
            su[j] = du_row[c / 2];
        }
        STRATA_ISSUE_FENCE();
        if (land_q != 0) {
#pragma unroll
            for (int j = 0; j < STRATA_GU3Q_GROUP; ++j) {
                const int cj = j * STRATA_WARP + lane;
                if (cj < h16) {
                    land_q[(long long)row * h16 + cj] = vg[j];
                    land_q[(long long)(F + row) * h16 + cj] = vu[j];
                    if ((cj & 1) == 0) {
                        land_d[(long long)row * nd_row + cj / 2] = sg[j];
                        land_d[(long long)(F + row) * nd_row + cj / 2] = su[j];
                    }
                }
            }
        }
        float ag = 0.f, au = 0.f;
#pragma unroll
        for (int j = 0; j < STRATA_GU3Q_GROUP; ++j) {
            const int cj = j * STRATA_WARP + lane;
            const float a = fh2f(sg[j]) * q8_dot16(vg[j], xv[j]);
            const float b = fh2f(su[j]) * q8_dot16(vu[j], xv[j]);
            ag += cj < h16 ? a : 0.f;
            au += cj < h16 ? b : 0.f;
        }
        ag = warp_sum(ag);
        au = warp_sum(au);
        if (lane == 0) act[(long long)k * F + row] = silu(ag) * au;
    }
}

// Step 2: out[h] (+)= sum_k w_k * (Wd[slot_k, h] . act[k]) with the (expert, 16-quant chunk) pairs of a row split
// over STRATA_D4_SLICES warps, STRATA_D4_J pairs a lane (i = 32 J slice + 32 j + lane), whose act chunks the lane
// loads once and keeps for the STRATA_D4_ROWS rows its warp computes (STRATA_D4_TRIP rows' loads a trip); the
// slices' sums of a row are added in slice order through shared memory. Block: 8 warps, two row groups of 4 slices;
// grid ceil(H / (2 * STRATA_D4_ROWS)). Needs K * F / 16 <= 32 * STRATA_D4_SLICES * STRATA_D4_J (fast.py falls back to
// the third pair). Sums in another order than the third pair's.
#define STRATA_D4_SLICES 4
#define STRATA_D4_J 3
#define STRATA_D4_ROWS 4
#define STRATA_D4_TRIP 2
#define STRATA_D4_GROUPS (STRATA_FAST_WARPS / STRATA_D4_SLICES)
extern "C" __global__ void __launch_bounds__(STRATA_FAST_THREADS, STRATA_Q8_MINB)
strata_fast_decode_down4_q8(const float* __restrict__ act, const int* __restrict__ ids, const float* __restrict__ wts,
                            const int* __restrict__ slots, const signed char* __restrict__ q2,
                            const unsigned short* __restrict__ d2, const signed char* __restrict__ host_q2,
                            const unsigned short* __restrict__ host_d2, int H, int F, int K, float* __restrict__ out,
                            int accumulate, const int* __restrict__ land) {
    __shared__ const signed char* s_q[STRATA_FAST_MAXK];
    __shared__ const unsigned short* s_d[STRATA_FAST_MAXK];
    __shared__ long long s_land[STRATA_FAST_MAXK];
    __shared__ float s_w[STRATA_FAST_MAXK];
    __shared__ float s_part[STRATA_FAST_WARPS][STRATA_D4_ROWS];
    __shared__ int s_nan;
    const int warp = threadIdx.x / STRATA_WARP, lane = threadIdx.x % STRATA_WARP;
    STRATA_GRID_LAUNCH_DEPENDENTS();
    STRATA_GRID_WAIT();
    if (threadIdx.x == 0) s_nan = 0;
    __syncthreads();
    const long long nq = (long long)H * F, nd = nq / 32;
    if (threadIdx.x < K) {
        const int q = threadIdx.x;
        const long long slot = slots[q];
        const signed char* qb = q2;
        const unsigned short* db = d2;
        long long ls = -1;
        if (slot >= 0) {
            qb = q2 + slot * nq;
            db = d2 + slot * nd;
        } else if (host_q2 != 0) {
            qb = host_q2 + (long long)ids[q] * nq;
            db = host_d2 + (long long)ids[q] * nd;
            ls = land != 0 ? (long long)land[ids[q]] : -1;
        } else {
            s_nan = 1;
        }
        s_q[q] = qb;
        s_d[q] = db;
        s_land[q] = ls;
        s_w[q] = wts[q];
    }
    __syncthreads();
    const int slice = warp % STRATA_D4_SLICES, group = warp / STRATA_D4_SLICES;
    const int h0 = (blockIdx.x * STRATA_D4_GROUPS + group) * STRATA_D4_ROWS;
    if (s_nan) {  // block-uniform
        if (slice == 0 && lane < STRATA_D4_ROWS && h0 + lane < H) out[h0 + lane] = __int_as_float(0x7fc00000);
        return;
    }
    const int per_row = F / 16, nd_row = F / 32, n = K * per_row;
    float4 av[STRATA_D4_J][4];
    const int4* pq[STRATA_D4_J];
    const unsigned short* pd[STRATA_D4_J];
    float wq[STRATA_D4_J];
    int qj[STRATA_D4_J], cj[STRATA_D4_J];
#pragma unroll
    for (int j = 0; j < STRATA_D4_J; ++j) {
        const int i = (slice * STRATA_D4_J + j) * STRATA_WARP + lane, ic = min(i, n - 1);
        const int q = ic / per_row, c = ic - q * per_row;
        const float4* a4 = (const float4*)(act + (long long)q * F) + 4 * c;
        av[j][0] = a4[0];
        av[j][1] = a4[1];
        av[j][2] = a4[2];
        av[j][3] = a4[3];
        pq[j] = (const int4*)s_q[q] + c;
        pd[j] = s_d[q] + c / 2;
        wq[j] = i < n ? s_w[q] : 0.f;
        qj[j] = i < n ? q : -1;
        cj[j] = c;
    }
#pragma unroll
    for (int r0 = 0; r0 < STRATA_D4_ROWS; r0 += STRATA_D4_TRIP) {
        int4 v[STRATA_D4_TRIP][STRATA_D4_J];
        unsigned short sd[STRATA_D4_TRIP][STRATA_D4_J];
#pragma unroll
        for (int t = 0; t < STRATA_D4_TRIP; ++t) {
            const long long h = min(h0 + r0 + t, H - 1);
#pragma unroll
            for (int j = 0; j < STRATA_D4_J; ++j) {
                v[t][j] = pq[j][h * (F / 16)];
                sd[t][j] = pd[j][h * nd_row];
            }
        }
        STRATA_ISSUE_FENCE();
#pragma unroll
        for (int t = 0; t < STRATA_D4_TRIP; ++t) {
            const int h = h0 + r0 + t;
#pragma unroll
            for (int j = 0; j < STRATA_D4_J; ++j) {
                const long long ls = qj[j] >= 0 ? s_land[qj[j]] : -1;
                if (ls >= 0 && h < H) {
                    ((int4*)(const_cast<signed char*>(q2) + ls * nq + (long long)h * F))[cj[j]] = v[t][j];
                    if ((cj[j] & 1) == 0) const_cast<unsigned short*>(d2)[ls * nd + (long long)h * nd_row + cj[j] / 2] = sd[t][j];
                }
            }
            float acc = 0.f;
#pragma unroll
            for (int j = 0; j < STRATA_D4_J; ++j) {
                const float d = wq[j] * fh2f(sd[t][j]) * q8_dot16(v[t][j], av[j]);
                acc += qj[j] >= 0 ? d : 0.f;
            }
            acc = warp_sum(acc);
            if (lane == 0) s_part[warp][r0 + t] = acc;
        }
    }
    __syncthreads();
    if (threadIdx.x < STRATA_D4_GROUPS * STRATA_D4_ROWS) {
        const int g = threadIdx.x / STRATA_D4_ROWS, r = threadIdx.x % STRATA_D4_ROWS, h = (blockIdx.x * STRATA_D4_GROUPS + g) * STRATA_D4_ROWS + r;
        if (h < H) {
            float sum = 0.f;
#pragma unroll
            for (int s = 0; s < STRATA_D4_SLICES; ++s) sum += s_part[g * STRATA_D4_SLICES + s][r];
            out[h] = accumulate ? out[h] + sum : sum;
        }
    }
}
