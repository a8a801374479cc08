// One token's MoE layer straight from GGUF K-quant / Q8_0 expert blocks (issue 14 item 5, decode): QuantMoE's
// decode_layer / decode_stack, a missed expert read from the page-locked store's mapped rows where the caller
// gives their base (else every routed expert must be cached). Two kernels a layer, as the f16 third forms of
// moe_fast.cu (FastMoE decode_form 6), whose ideas these port:
//
// - strata_qd_gate_up_<fmt>: routing once a block (every thread ranks the logits: no separate route kernel), then
//   a warp a (gate row, up row) pair at a time, each lane issuing all of its weight loads for the pair before any
//   sum (QD_ISSUE_FENCE keeps ptxas from interleaving them), act[k, f] = silu(x . Wg_f) * (x . Wu_f). Block (0,0)
//   publishes the K ids, softmax weights and routed slots for the down kernel.
// - strata_qd_down_<fmt>: a warp a hidden row h, its lanes over the (expert, unit) pairs of the K routed experts,
//   the loads of a trip issued before the act vector is staged and summed; out[h] (+)= sum_k w_k (act_k . Wd_k,h).
//
// The weights are decoded 32 at a time ("a unit": two runs of 16 weights, each with one scale, and for q4_k/q5_k
// one min): the scales once a run, the codes as bytes put into a float's mantissa (a byte permute, one exact
// subtraction), a float FMA with x a weight. sum_l (s q_l - m) x_l is computed as s (sum_l q_l x_l) - m (sum_l x_l),
// f32 throughout; the activation is never quantized. x (and act) sits in shared memory in unit order, each unit's
// eight 16-byte chunks XOR-swizzled by the unit's low bits, so the 8 lanes of a quarter-warp's 16-byte reads (8
// consecutive units) hit distinct banks.
// q4_k/q5_k read 16-byte words (the caller checks 16-byte alignment of the blob, slots, host rows and matrices;
// else it takes quant_fast.cu's kernels); q6_k (210-byte blocks) and q8_0 (34) read aligned 4-byte words
// funnel-shifted into place, never a word past the field's last byte. No biases (those formats take
// quant_fast.cu's kernels).
// Sizes: H <= QD_MAX_H, K * F <= QD_MAX_KF, K <= 16, E <= 256 (QuantMoE checks; else quant_fast.cu's kernels).

#define STRATA_QUANTS_NO_TEST_KERNEL
#include "quants.cuh"

#define QD_THREADS 256
#define QD_WARP 32
#define QD_WARPS (QD_THREADS / QD_WARP)
#define QD_MAXK 16
#define QD_MAX_H 4096
#define QD_MAX_KF 8192
#define QD_PAIRS 3  // gate/up row pairs a warp strides over (grid x = ceil(F / (QD_WARPS * QD_PAIRS)))
#define QD_GU_UNITS 2  // units of a lane a gate/up trip loads (H = 2048: the whole row, 64 units)
#define QD_DN_UNITS 3  // units of a lane a down trip loads (K = 8, F = 768: 192 units a row, two trips)

#if defined(QD_HOST)
#define QD_GRID_WAIT()
#define QD_LAUNCH_DEPENDENTS()
#define QD_ISSUE_FENCE()
#define QD_LDG(p) (*(p))
#elif defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
// programmatic dependent launch (pdl.py): inputs of the previous kernel are read only after the wait
#define QD_GRID_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#define QD_LAUNCH_DEPENDENTS() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
// between a trip's loads and its sums: an asm volatile instruction ptxas does not move loads across (moe_fast.cu's
// STRATA_ISSUE_FENCE; a no-op here: the kernels signal their dependents at their start already)
#define QD_ISSUE_FENCE() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
#define QD_LDG(p) __ldg(p)
#else
#define QD_GRID_WAIT()
#define QD_LAUNCH_DEPENDENTS()
#define QD_ISSUE_FENCE()
#define QD_LDG(p) __ldg(p)
#endif

// ---- routing: moe_fast.cu's block_rank_topk and gate_up3's softmax, copied (this module compiles alone) --------

__device__ __forceinline__ float qd_rank_key(float v) { return v != v ? -__int_as_float(0x7f800000) : v; }

// Top-k of E <= blockDim.x logits by rank: s_sel[r], s_lg[r] the id and (NaN-mapped) logit of rank r < K,
// descending, ties to the lower id (warp_topk's and the reference's stable argsort's order).
__device__ void qd_rank_topk(const float* __restrict__ logits, int E, int K, float* s_l, int* s_part, int* s_sel,
                             float* s_lg) {
    const int t = threadIdx.x;
    for (int i = t; i < E; i += blockDim.x) s_l[i] = qd_rank_key(logits[i]);
    __syncthreads();
    const int parts = blockDim.x / E;
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

// ---- loads -------------------------------------------------------------------------------------------------

// The 5 aligned words holding the 16 bytes at p (the fifth only where p is not 4-aligned: else the fourth again,
// so no word past p + 15 is read); qd_align16 shifts them into place.
__device__ __forceinline__ void qd_words16(const unsigned char* p, unsigned int w[5]) {
    const unsigned long long a = (unsigned long long)p;
    const unsigned int* q = (const unsigned int*)(a & ~3ull);
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = QD_LDG(q + i);
    w[4] = QD_LDG(q + ((a & 3ull) ? 4 : 3));
}

__device__ __forceinline__ unsigned int qd_shr(unsigned int lo, unsigned int hi, unsigned int sh) {
#if defined(QD_HOST)
    return (unsigned int)((((unsigned long long)hi << 32) | lo) >> sh);
#else
    return __funnelshift_r(lo, hi, sh);
#endif
}

__device__ __forceinline__ void qd_align16(const unsigned int w[5], unsigned int sh, unsigned int o[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) o[i] = qd_shr(w[i], w[i + 1], sh);
}

__device__ __forceinline__ uint4 qd_ld16(const unsigned char* p) {  // 16-aligned
#if defined(QD_HOST)
    const unsigned int* q = (const unsigned int*)p;
    return make_uint4(q[0], q[1], q[2], q[3]);
#else
    return __ldg((const uint4*)p);
#endif
}

// byte i of word w, as float 2^23 + byte (exact), minus 2^23 + off: the signed weight code, exact
__device__ __forceinline__ float qd_code(unsigned int w, int i, float base) {
#if defined(QD_HOST)
    const unsigned int b = (w >> (8 * i)) & 0xffu;
    return __fsub_rn(__uint_as_float(0x4b000000u | b), base);
#else
    return __fsub_rn(__uint_as_float(__byte_perm(w, 0x4b000000u, 0x7440u | (unsigned int)i)), base);
#endif
}

// binary16 bits as float, exact: the hardware conversion on the GPU (no branches for subnormals and inf/NaN)
__device__ __forceinline__ float qd_half(unsigned int bits) {
#if defined(QD_HOST)
    const unsigned char b[2] = {(unsigned char)(bits & 0xffu), (unsigned char)((bits >> 8) & 0xffu)};
    return dq_half_at(b);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)bits));
    return f;
#endif
}

// ---- a unit of each format: raw registers (loaded in one go), then decoded ---------------------------------
// Unit u of a row: weights at x positions p0(u) .. +15 (run 0) and p1(u) .. +15 (run 1).

struct QdUnitQ4 { uint4 hdr, qs; };
struct QdUnitQ5 { uint4 hdr, qh, qs; };
struct QdUnitQ6 { unsigned int ql[5], qh[5], sc[2], d[2]; unsigned int sh_l, sh_h, sh_s, sh_d; };
struct QdUnitQ8 { unsigned int w[10]; unsigned int sh; };

template <int FMT> struct QdFmt;

// q4_k: 144-byte blocks of 8 sub-blocks; unit u = block u/8, sub-block pair p = (u/2)%4, half hh = u%2 of its
// 32 qs bytes: low nibbles are sub-block 2p, high nibbles 2p+1.
template <> struct QdFmt<DQ_TYPE_Q4_K> {
    typedef QdUnitQ4 Unit;
    static const bool MIN = true;
    static __device__ __forceinline__ int p0(int u) { return 256 * (u >> 3) + 64 * ((u >> 1) & 3) + 16 * (u & 1); }
    static __device__ __forceinline__ int p1(int u) { return p0(u) + 32; }
    static __device__ __forceinline__ void load(const unsigned char* row, int u, Unit& r) {
        const unsigned char* b = row + (long long)(u >> 3) * DQ_Q4_K_BYTES;
        r.hdr = qd_ld16(b);
        r.qs = qd_ld16(b + 16 + 32 * ((u >> 1) & 3) + 16 * (u & 1));
    }
    // codes c0/c1 (4 words of byte codes each), scales s, mins m, the code offset
    static __device__ __forceinline__ void decode(const Unit& r, int u, unsigned int c0[4], unsigned int c1[4],
                                                  float s[2], float m[2]) {
        const unsigned int q[4] = {r.qs.x, r.qs.y, r.qs.z, r.qs.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            c0[i] = q[i] & 0x0f0f0f0fu;
            c1[i] = (q[i] >> 4) & 0x0f0f0f0fu;
        }
        scales(r.hdr, 2 * ((u >> 1) & 3), s, m);
    }
    // the 6-bit scale and min of sub-blocks j, j + 1 (j even) from the 12 scale bytes (quants.cuh's
    // dq_k_scale_min on words: a runtime byte index into an array would put it in local memory)
    static __device__ __forceinline__ void scales(const uint4& h, int j, float s[2], float m[2]) {
        const float d = qd_half(h.x & 0xffffu), dmin = qd_half(h.x >> 16);
#pragma unroll
        for (int t = 0; t < 2; ++t) {
            const int jj = (j + t) & 3;
            const unsigned int b1 = (h.y >> (8 * jj)) & 0xffu, b2 = (h.z >> (8 * jj)) & 0xffu,
                               b3 = (h.w >> (8 * jj)) & 0xffu;
            const unsigned int sc = j < 4 ? (b1 & 63u) : ((b3 & 15u) | ((b1 >> 6) << 4));
            const unsigned int mn = j < 4 ? (b2 & 63u) : ((b3 >> 4) | ((b2 >> 6) << 4));
            s[t] = __fmul_rn(d, (float)sc);
            m[t] = __fmul_rn(dmin, (float)mn);
        }
    }
    static __device__ __forceinline__ float base() { return 8388608.0f; }
};

// q5_k: 176-byte blocks: d, dmin, scales[12], qh[32] (bit j of qh[l]: the fifth bit of sub-block j), qs[128].
template <> struct QdFmt<DQ_TYPE_Q5_K> {
    typedef QdUnitQ5 Unit;
    static const bool MIN = true;
    static __device__ __forceinline__ int p0(int u) { return QdFmt<DQ_TYPE_Q4_K>::p0(u); }
    static __device__ __forceinline__ int p1(int u) { return p0(u) + 32; }
    static __device__ __forceinline__ void load(const unsigned char* row, int u, Unit& r) {
        const unsigned char* b = row + (long long)(u >> 3) * DQ_Q5_K_BYTES;
        r.hdr = qd_ld16(b);
        r.qh = qd_ld16(b + 16 + 16 * (u & 1));
        r.qs = qd_ld16(b + 48 + 32 * ((u >> 1) & 3) + 16 * (u & 1));
    }
    static __device__ __forceinline__ void decode(const Unit& r, int u, unsigned int c0[4], unsigned int c1[4],
                                                  float s[2], float m[2]) {
        const unsigned int q[4] = {r.qs.x, r.qs.y, r.qs.z, r.qs.w}, hb[4] = {r.qh.x, r.qh.y, r.qh.z, r.qh.w};
        const int j = 2 * ((u >> 1) & 3);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            c0[i] = (q[i] & 0x0f0f0f0fu) | (((hb[i] >> j) & 0x01010101u) << 4);
            c1[i] = ((q[i] >> 4) & 0x0f0f0f0fu) | (((hb[i] >> (j + 1)) & 0x01010101u) << 4);
        }
        QdFmt<DQ_TYPE_Q4_K>::scales(r.hdr, j, s, m);
    }
    static __device__ __forceinline__ float base() { return 8388608.0f; }
};

// q6_k: 210-byte blocks: ql[128], qh[64], int8 scales[16], f16 d. Unit u = block u/8, half h = (u/4)%2, odd
// od = (u/2)%2, l-half hh = u%2: groups g = od (low nibbles) and od + 2 (high nibbles) of ql[64h + 32od + 16hh ..],
// their 2 high bits from qh[32h + 16hh ..] at bits 2g; scale of a run: scales[8h + 2g + hh].
template <> struct QdFmt<DQ_TYPE_Q6_K> {
    typedef QdUnitQ6 Unit;
    static const bool MIN = false;
    static __device__ __forceinline__ int p0(int u) {
        return 256 * (u >> 3) + 128 * ((u >> 2) & 1) + 32 * ((u >> 1) & 1) + 16 * (u & 1);
    }
    static __device__ __forceinline__ int p1(int u) { return p0(u) + 64; }
    static __device__ __forceinline__ void load(const unsigned char* row, int u, Unit& r) {
        const unsigned char* b = row + (long long)(u >> 3) * DQ_Q6_K_BYTES;
        const int h = (u >> 2) & 1, od = (u >> 1) & 1, hh = u & 1;
        const unsigned char* pl = b + 64 * h + 32 * od + 16 * hh;
        const unsigned char* ph = b + 128 + 32 * h + 16 * hh;
        const unsigned char* ps = b + 192 + 8 * h + 2 * od + hh;  // and ps + 4
        const unsigned char* pd = b + 208;
        qd_words16(pl, r.ql);
        qd_words16(ph, r.qh);
        const unsigned long long as = (unsigned long long)ps, ad = (unsigned long long)pd;
        const unsigned int* qs = (const unsigned int*)(as & ~3ull);
        r.sc[0] = QD_LDG(qs);
        r.sc[1] = QD_LDG(qs + 1);
        const unsigned int* qd = (const unsigned int*)(ad & ~3ull);
        r.d[0] = QD_LDG(qd);
        r.d[1] = QD_LDG(qd + ((ad & 3ull) == 3ull ? 1 : 0));  // d's second byte, never past the block
        r.sh_l = 8u * (unsigned int)((unsigned long long)pl & 3ull);
        r.sh_h = 8u * (unsigned int)((unsigned long long)ph & 3ull);
        r.sh_s = 8u * (unsigned int)(as & 3ull);
        r.sh_d = 8u * (unsigned int)(ad & 3ull);
    }
    static __device__ __forceinline__ void decode(const Unit& r, int u, unsigned int c0[4], unsigned int c1[4],
                                                  float s[2], float m[2]) {
        unsigned int ql[4], qh[4];
        qd_align16(r.ql, r.sh_l, ql);
        qd_align16(r.qh, r.sh_h, qh);
        const int g0 = (u >> 1) & 1;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            c0[i] = (ql[i] & 0x0f0f0f0fu) | (((qh[i] >> (2 * g0)) & 0x03030303u) << 4);
            c1[i] = ((ql[i] >> 4) & 0x0f0f0f0fu) | (((qh[i] >> (2 * g0 + 4)) & 0x03030303u) << 4);
        }
        const float d = qd_half(qd_shr(r.d[0], r.d[1], r.sh_d) & 0xffffu);
        s[0] = __fmul_rn(d, (float)(signed char)((r.sc[0] >> r.sh_s) & 0xffu));
        s[1] = __fmul_rn(d, (float)(signed char)((r.sc[1] >> r.sh_s) & 0xffu));
        m[0] = m[1] = 0.0f;
    }
    static __device__ __forceinline__ float base() { return 8388608.0f + 32.0f; }
};

// q8_0: 34-byte blocks (f16 d, int8 qs[32]); unit u = block u. Codes are qs ^ 0x80 (offset 128).
template <> struct QdFmt<DQ_TYPE_Q8_0> {
    typedef QdUnitQ8 Unit;
    static const bool MIN = false;
    static __device__ __forceinline__ int p0(int u) { return 32 * u; }
    static __device__ __forceinline__ int p1(int u) { return 32 * u + 16; }
    static __device__ __forceinline__ void load(const unsigned char* row, int u, Unit& r) {
        const unsigned long long a = (unsigned long long)(row + (long long)u * DQ_Q8_0_BYTES);
        const unsigned int* q = (const unsigned int*)(a & ~3ull);
        const int last = (int)(((a & 3ull) + 33ull) >> 2);  // the word of the block's last byte (8 or 9)
#pragma unroll
        for (int i = 0; i < 10; ++i) r.w[i] = QD_LDG(q + min(i, last));
        r.sh = (unsigned int)(a & 3ull);
    }
    static __device__ __forceinline__ void decode(const Unit& r, int u, unsigned int c0[4], unsigned int c1[4],
                                                  float s[2], float m[2]) {
        // byte k of the block is byte (sh + k) % 4 of word (sh + k) / 4; qs[l] is byte 2 + l
        const unsigned int o = r.sh + 2u, ws = o >> 2, sh = 8u * (o & 3u);
        unsigned int v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            // ws is 0 or 1: pick without a runtime index (one would put r.w in local memory)
            const unsigned int lo = ws ? r.w[i + 1] : r.w[i], hi = ws ? r.w[i + 2] : r.w[i + 1];
            v[i] = qd_shr(lo, hi, sh) ^ 0x80808080u;
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            c0[i] = v[i];
            c1[i] = v[i + 4];
        }
        const float d = qd_half(qd_shr(r.w[0], r.w[1], 8u * r.sh) & 0xffffu);
        s[0] = s[1] = d;
        m[0] = m[1] = 0.0f;
    }
    static __device__ __forceinline__ float base() { return 8388608.0f + 128.0f; }
};

// ---- the staged vector: unit order, chunks swizzled ---------------------------------------------------------

// Units n0 .. n0+nu-1 of the vector v (nu units of a row of one expert, flat index fu0 + u in the stage) into
// xs; with MIN, the run sums into xsum. Each thread a unit.
template <int FMT>
__device__ __forceinline__ void qd_stage(const float* __restrict__ v, int nu, int fu0, float4* xs, float2* xsum,
                                         int t, int nt) {
    typedef QdFmt<FMT> Fm;
    for (int u = t; u < nu; u += nt) {
        const int fu = fu0 + u;
        const float4* a = (const float4*)(v + Fm::p0(u));
        const float4* b = (const float4*)(v + Fm::p1(u));
        float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const float4 xa = a[c], xb = b[c];
            xs[8 * fu + (c ^ (fu & 7))] = xa;
            xs[8 * fu + ((c + 4) ^ (fu & 7))] = xb;
            s0 += (xa.x + xa.y) + (xa.z + xa.w);
            s1 += (xb.x + xb.y) + (xb.z + xb.w);
        }
        if (Fm::MIN) xsum[fu] = make_float2(s0, s1);
    }
}

// sum over a unit of (s_r * sum(q x) - m_r * sum(x)), the x chunks from the stage at flat unit fu
template <int FMT>
__device__ __forceinline__ float qd_unit_dot(const unsigned int c0[4], const unsigned int c1[4], const float s[2],
                                             const float m[2], const float4* xs, const float2* xsum, int fu) {
    typedef QdFmt<FMT> Fm;
    const float base = Fm::base();
    float a0 = 0.0f, a1 = 0.0f;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        const float4 xa = xs[8 * fu + (c ^ (fu & 7))];
        const float4 xb = xs[8 * fu + ((c + 4) ^ (fu & 7))];
        a0 = fmaf(qd_code(c0[c], 0, base), xa.x, a0);
        a0 = fmaf(qd_code(c0[c], 1, base), xa.y, a0);
        a0 = fmaf(qd_code(c0[c], 2, base), xa.z, a0);
        a0 = fmaf(qd_code(c0[c], 3, base), xa.w, a0);
        a1 = fmaf(qd_code(c1[c], 0, base), xb.x, a1);
        a1 = fmaf(qd_code(c1[c], 1, base), xb.y, a1);
        a1 = fmaf(qd_code(c1[c], 2, base), xb.z, a1);
        a1 = fmaf(qd_code(c1[c], 3, base), xb.w, a1);
    }
    float r = s[0] * a0 + s[1] * a1;
    if (Fm::MIN) {
        const float2 xm = xsum[fu];
        r -= m[0] * xm.x + m[1] * xm.y;
    }
    return r;
}

__device__ __forceinline__ float qd_warp_sum(float v) {
#if defined(QD_HOST)
    return qd_host_warp_sum(v);
#else
#pragma unroll
    for (int m = QD_WARP / 2; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
    return v;
#endif
}

// ---- gate/up ------------------------------------------------------------------------------------------------

// act[k, f] = silu(x . Wg_f) * (x . Wu_f) for the expert of rank k = blockIdx.y (routed from logits here), a warp
// a row pair f, the warps striding over F; H / 32 units a row, a lane taking units lane, lane + 32, ... in trips
// of QD_GU_UNITS (units past the row re-read the last one and count zero: the same loads in every lane, no
// branch between them). Block (0,0) writes ids, w (softmax over the K logits) and slots (slot_map[id]). A miss
// (slot -1) with a `host` base is read from mapped host memory, expert e at host + e * host_bytes (the layer's
// rows of the page-locked store: a miss costs the link its bytes, not a step on the composed path), and published
// as slot -2 - e for the down kernel. A routed slot outside [0, n_slots) otherwise: that expert's act is NaN.
template <int FMT>
__device__ __forceinline__ void qd_gate_up(const float* __restrict__ x, const float* __restrict__ logits, int E,
                                           int K, const int* __restrict__ slot_map, int n_slots, int H, int F,
                                           const unsigned char* __restrict__ blob, long long slot_bytes,
                                           long long rb, const unsigned char* __restrict__ host, long long host_bytes,
                                           float* __restrict__ act, int* __restrict__ ids_out,
                                           float* __restrict__ w_out, int* __restrict__ slots_out) {
    typedef QdFmt<FMT> Fm;
    __shared__ float s_l[QD_THREADS];
    __shared__ int s_part[QD_THREADS];
    __shared__ int s_sel[QD_MAXK];
    __shared__ float s_lg[QD_MAXK];
    __shared__ float4 s_x[QD_MAX_H / 4];
    __shared__ float2 s_xsum[QD_MAX_H / 32];
    const int warp = threadIdx.x / QD_WARP, lane = threadIdx.x % QD_WARP;
    const int k = blockIdx.y, nu = H / 32;
    QD_LAUNCH_DEPENDENTS();
    QD_GRID_WAIT();  // x and logits are the previous kernel's
    qd_stage<FMT>(x, nu, 0, s_x, s_xsum, threadIdx.x, QD_THREADS);
    qd_rank_topk(logits, E, K, s_l, s_part, s_sel, s_lg);  // its barriers also publish the stage
    const int e = s_sel[k];
    const long long slot = slot_map[e];
    if (blockIdx.x == 0 && k == 0 && threadIdx.x < K) {
        const int r = threadIdx.x;
        const float top0 = s_lg[0];
        float s = 0.0f;
        for (int q = 0; q < K; ++q) s += expf(s_lg[q] - top0);
        ids_out[r] = s_sel[r];
        w_out[r] = expf(s_lg[r] - top0) / s;
        const int sr = slot_map[s_sel[r]];
        slots_out[r] = sr < 0 && host != nullptr ? -2 - s_sel[r] : sr;
    }
    const bool from_host = slot < 0 && host != nullptr;
    const bool bad = !from_host && (slot < 0 || slot >= n_slots);
    const unsigned char* w = from_host ? host + (long long)e * host_bytes : blob + (bad ? 0 : slot) * slot_bytes;
    for (int f = blockIdx.x * QD_WARPS + warp; f < F; f += gridDim.x * QD_WARPS) {
        if (bad) {
            if (lane == 0) act[(long long)k * F + f] = __int_as_float(0x7fc00000);
            continue;
        }
        const unsigned char* wg = w + (long long)f * rb;
        const unsigned char* wu = w + (long long)(F + f) * rb;
        float ag = 0.0f, au = 0.0f;
        for (int u0 = 0; u0 < nu; u0 += QD_GU_UNITS * QD_WARP) {
            typename Fm::Unit rg[QD_GU_UNITS], ru[QD_GU_UNITS];
#pragma unroll
            for (int j = 0; j < QD_GU_UNITS; ++j) {
                const int u = min(u0 + j * QD_WARP + lane, nu - 1);
                Fm::load(wg, u, rg[j]);
                Fm::load(wu, u, ru[j]);
            }
            QD_ISSUE_FENCE();
#pragma unroll
            for (int j = 0; j < QD_GU_UNITS; ++j) {
                const int uj = u0 + j * QD_WARP + lane, u = min(uj, nu - 1);
                unsigned int c0[4], c1[4];
                float s[2], m[2];
                Fm::decode(rg[j], u, c0, c1, s, m);
                const float dg = qd_unit_dot<FMT>(c0, c1, s, m, s_x, s_xsum, u);
                Fm::decode(ru[j], u, c0, c1, s, m);
                const float du = qd_unit_dot<FMT>(c0, c1, s, m, s_x, s_xsum, u);
                ag += uj < nu ? dg : 0.0f;
                au += uj < nu ? du : 0.0f;
            }
        }
        ag = qd_warp_sum(ag);
        au = qd_warp_sum(au);
        if (lane == 0) act[(long long)k * F + f] = (ag / (1.0f + expf(-ag))) * au;
    }
}

// ---- down ---------------------------------------------------------------------------------------------------

// out[h] = (accumulate ? out[h] : 0) + sum_k w_k (act_k . Wd[slot_k]_h), a warp a hidden row h (grid
// ceil(H / QD_WARPS)); the K * F / 32 (expert, unit) pairs flat over the lanes, QD_DN_UNITS a trip. ids, w and
// slots are the gate/up kernel's (slot -2 - e: expert e read at host + e * host_bytes). A routed slot outside the
// pool otherwise: out[h] NaN.
template <int FMT>
__device__ __forceinline__ void qd_down(const float* __restrict__ act, const float* __restrict__ wts,
                                        const int* __restrict__ slots, int n_slots, int K, int H, int F,
                                        const unsigned char* __restrict__ blob, long long slot_bytes,
                                        long long down_off, long long rb, const unsigned char* __restrict__ host,
                                        long long host_bytes, int accumulate, float* __restrict__ out) {
    typedef QdFmt<FMT> Fm;
    __shared__ const unsigned char* s_base[QD_MAXK];
    __shared__ float s_w[QD_MAXK];
    __shared__ int s_bad;
    __shared__ float4 s_x[QD_MAX_KF / 4];
    __shared__ float2 s_xsum[QD_MAX_KF / 32];
    const int warp = threadIdx.x / QD_WARP, lane = threadIdx.x % QD_WARP;
    const int h = blockIdx.x * QD_WARPS + warp, nu = F / 32, n = K * nu;
    QD_LAUNCH_DEPENDENTS();
    QD_GRID_WAIT();  // act, w and slots are the previous kernel's
    if (threadIdx.x == 0) s_bad = 0;
    __syncthreads();
    if (threadIdx.x < K) {
        const long long slot = slots[threadIdx.x];
        const bool from_host = slot <= -2 && host != nullptr;
        const bool bad = !from_host && (slot < 0 || slot >= n_slots);
        if (bad) s_bad = 1;
        s_base[threadIdx.x] = (from_host ? host + (-2 - slot) * host_bytes : blob + (bad ? 0 : slot) * slot_bytes)
                              + down_off;
        s_w[threadIdx.x] = wts[threadIdx.x];
    }
    __syncthreads();
    const int hr = min(h, H - 1);  // rows past H compute row H - 1 and write nothing (the block's barriers)
    float acc = 0.0f;
    for (int i0 = 0; i0 < n; i0 += QD_DN_UNITS * QD_WARP) {
        typename Fm::Unit r[QD_DN_UNITS];
#pragma unroll
        for (int j = 0; j < QD_DN_UNITS; ++j) {
            const int i = min(i0 + j * QD_WARP + lane, n - 1);
            const int q = i / nu, u = i - q * nu;
            Fm::load(s_base[q] + (long long)hr * rb, u, r[j]);
        }
        QD_ISSUE_FENCE();
        if (i0 == 0) {  // stage act while the first trip's loads are in flight
            for (int q = 0; q < K; ++q) qd_stage<FMT>(act + (long long)q * F, nu, q * nu, s_x, s_xsum, threadIdx.x,
                                                      QD_THREADS);
            __syncthreads();
        }
#pragma unroll
        for (int j = 0; j < QD_DN_UNITS; ++j) {
            const int ij = i0 + j * QD_WARP + lane, i = min(ij, n - 1);
            const int q = i / nu, u = i - q * nu;
            unsigned int c0[4], c1[4];
            float s[2], m[2];
            Fm::decode(r[j], u, c0, c1, s, m);
            const float d = s_w[q] * qd_unit_dot<FMT>(c0, c1, s, m, s_x, s_xsum, i);
            acc += ij < n ? d : 0.0f;
        }
    }
    acc = qd_warp_sum(acc);
    if (lane == 0 && h < H)
        out[h] = s_bad ? __int_as_float(0x7fc00000) : (accumulate ? out[h] + acc : acc);
}

#define QD_KERNELS(SUFFIX, FMT)                                                                                    \
    extern "C" __global__ void __launch_bounds__(QD_THREADS, 2)                                                    \
    strata_qd_gate_up_##SUFFIX(const float* __restrict__ x, const float* __restrict__ logits, int E, int K,        \
                               const int* __restrict__ slot_map, int n_slots, int H, int F,                        \
                               const unsigned char* __restrict__ blob, long long slot_bytes, long long rb,         \
                               const unsigned char* __restrict__ host, long long host_bytes,                       \
                               float* __restrict__ act, int* __restrict__ ids_out, float* __restrict__ w_out,      \
                               int* __restrict__ slots_out) {                                                      \
        qd_gate_up<FMT>(x, logits, E, K, slot_map, n_slots, H, F, blob, slot_bytes, rb, host, host_bytes, act,     \
                        ids_out, w_out, slots_out);                                                                \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(QD_THREADS, 2)                                                    \
    strata_qd_down_##SUFFIX(const float* __restrict__ act, const float* __restrict__ wts,                          \
                            const int* __restrict__ slots, int n_slots, int K, int H, int F,                       \
                            const unsigned char* __restrict__ blob, long long slot_bytes, long long down_off,      \
                            long long rb, const unsigned char* __restrict__ host, long long host_bytes,            \
                            int accumulate, float* __restrict__ out) {                                             \
        qd_down<FMT>(act, wts, slots, n_slots, K, H, F, blob, slot_bytes, down_off, rb, host, host_bytes,          \
                     accumulate, out);                                                                             \
    }

QD_KERNELS(q4_k, DQ_TYPE_Q4_K)
QD_KERNELS(q5_k, DQ_TYPE_Q5_K)
QD_KERNELS(q6_k, DQ_TYPE_Q6_K)
QD_KERNELS(q8_0, DQ_TYPE_Q8_0)
