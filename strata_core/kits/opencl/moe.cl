/*
 * Strata Core's OpenCL C kernels: the one source the SYCL backend (through dpctl.program) and the OpenCL plugin
 * (through pyopencl) both build. The contract, shapes and dtypes included, is strata_core/kernels/reference.py.
 *
 * Conventions shared by every host that launches these kernels:
 * - dimension 0 of the global range walks the contiguous (last) axis of the output, dimension 1 the rows;
 *   global sizes may be rounded up, so every kernel guards its indices;
 * - sizes are passed as int, scalars as float; half data is read with vload_half and written with vstore_half_rte,
 *   so cl_khr_fp16 is not needed (the PoCL CPU device, for one, lacks it);
 * - Q8_0: blocks of QK8_0 int8 quants along the last axis with one half scale per block, value = q * d.
 * - every buffer argument comes as ARG(type, name): the buffer and the element offset of the array in it, so an
 *   array carved at any offset of a plan region is an argument as it is (OpenCL sub-buffers must start on
 *   CL_DEVICE_MEM_BASE_ADDR_ALIGN, carved views need not; a SYCL host passes USM pointers with offset 0);
 * - no kernel needs device memory beyond its arguments: the host gives every output (and the grouped FFN keeps
 *   its intermediate activations in local memory), so a runtime that carves its buffers from the plan's regions
 *   allocates nothing while it serves;
 * - GGUF experts ('gguf' pools: Q4_K, Q5_K, Q6_K, MXFP4, Q8_0, f16, bf16, f32 rows as the file stores them, one
 *   slot of slot_bytes bytes per expert, api.kernels.ExpertFormat): every weight is read through quants.cl's
 *   dq_weight, which the host puts before this file in the one program it builds (STRATA_QUANTS_NO_TEST_KERNEL).
 */

/* Contraction to fma would round the f32 kernels differently from the numpy oracle, which rounds every product
 * and every sum; the pragma asks for the same here (a compiler may still contract, within the tolerances). */
#pragma OPENCL FP_CONTRACT OFF

#define QK8_0 32
#define LINEAR_TILE 16

inline float silu_f32(const float v)
{
    return v / (1.0f + exp(-v));
}

/* A buffer argument: the buffer and the element offset of the array in it (see the conventions above). */
#define ARG(T, name) __global T* name##_base, const long name##_off
#define AT(name) (name##_base + name##_off)

/* ------------------------------------------------------------------------------------------------ fills */

__kernel void fill_i32(ARG(int, out), const int n, const int value)
{
    __global int* out = AT(out);
    const int i = get_global_id(0);
    if (i < n)
        out[i] = value;
}

/* ------------------------------------------------------------------------------------------------ routing */

/* One work-item per token. The j-th pick is the best logit strictly after the (j-1)-th in the order
 * (value descending, id ascending), so ties go to the lower id without any scratch memory. */
__kernel void route_topk(ARG(const float, logits), const int T, const int E, const int K, ARG(int, ids),
                         ARG(float, weights))
{
    const int t = get_global_id(0);
    if (t >= T)
        return;
    __global const float* row = AT(logits) + (size_t)t * E;
    __global int* out_ids = AT(ids) + (size_t)t * K;
    __global float* out_w = AT(weights) + (size_t)t * K;
    float prev_v = INFINITY;
    int prev_i = -1;
    for (int j = 0; j < K; ++j) {
        int best = -1;
        float best_v = -INFINITY;
        for (int e = 0; e < E; ++e) {
            const float v = row[e];
            const bool after = (v < prev_v) || (v == prev_v && e > prev_i);
            if (after && (best < 0 || v > best_v)) {
                best = e;
                best_v = v;
            }
        }
        out_ids[j] = best;
        out_w[j] = best_v;
        prev_v = best_v;
        prev_i = best;
    }
    const float top = out_w[0];
    float sum = 0.0f;
    for (int j = 0; j < K; ++j) {
        const float e = exp(out_w[j] - top);
        out_w[j] = e;
        sum += e;
    }
    for (int j = 0; j < K; ++j)
        out_w[j] = out_w[j] / sum;
}

/* ------------------------------------------------------------------------------------------------ gather */

/* Row gather by element size (4 bytes: f32/i32, 2 bytes: f16), so one kernel serves every dtype of that size.
 * A row index outside [0, T) yields zeros rather than a read out of bounds. */
#define DEFINE_GATHER(NAME, ETYPE)                                                                                 \
    __kernel void NAME(ARG(const ETYPE, x), ARG(const int, rows), const int N, const int H, const int T,          \
                       ARG(ETYPE, out))                                                                            \
    {                                                                                                              \
        const int h = get_global_id(0), i = get_global_id(1);                                                      \
        if (h >= H || i >= N)                                                                                      \
            return;                                                                                                \
        const int r = AT(rows)[i];                                                                                 \
        AT(out)[(size_t)i * H + h] = (r >= 0 && r < T) ? AT(x)[(size_t)r * H + h] : (ETYPE)0;                      \
    }

DEFINE_GATHER(gather_b4, uint)
DEFINE_GATHER(gather_b2, ushort)

/* ------------------------------------------------------------------------------------------------ scatter_add */

/* scatter_add is deterministic without scratch memory: float atomics would add a token's contributions in whatever
 * order the work-items ran, so the same inputs could give different bits. Work-item (h, b) walks every i in
 * ascending order and adds the rows r with r % B == b: out[r,h] += scale[i] * y[i,h], each row's terms in
 * ascending i, as the reference does. B (the host picks it, <= T) spreads the rows over more work-items; indices
 * outside [0, T) are skipped. */
__kernel void scatter_add_cols(ARG(float, out), const int T, const int H, ARG(const int, rows), const int N,
                               ARG(const float, y), ARG(const float, scale), const int B)
{
    const int h = get_global_id(0), b = get_global_id(1);
    if (h >= H || b >= B)
        return;
    __global float* o = AT(out);
    __global const int* rw = AT(rows);
    __global const float* yv = AT(y);
    __global const float* sc = AT(scale);
    for (int i = 0; i < N; ++i) {
        const int r = rw[i];
        if (r < 0 || r >= T || r % B != b)
            continue;
        const float p = yv[(size_t)i * H + h] * sc[i];
        o[(size_t)r * H + h] = o[(size_t)r * H + h] + p;
    }
}

/* ------------------------------------------------------------------------------------------------ Q8_0 */

/* qs [R*C] int8, d [R*C/QK8_0] half -> out [R*C] half, rounded to nearest even like numpy's astype(float16). */
__kernel void dequantize_q8_0(ARG(const char, qs), ARG(const half, d), const int total, ARG(half, out))
{
    const int i = get_global_id(0);
    if (i >= total)
        return;
    const float v = (float)AT(qs)[i] * vload_half(i / QK8_0, AT(d));
    vstore_half_rte(v, i, AT(out));
}

/* ------------------------------------------------------------------------------------------------ grouped MoE FFN */

/* The group of row n: the last g with offsets[g] <= n, if n < offsets[g + 1]; -1 for a row in no group
 * (its output is zero, as in the reference). Offsets are non-decreasing, so empty groups are skipped. */
inline int group_of_row(__global const int* offsets, const int G, const int n)
{
    int lo = 0, hi = G - 1, g = -1;
    while (lo <= hi) {
        const int mid = (lo + hi) / 2;
        if (offsets[mid] <= n) {
            g = mid;
            lo = mid + 1;
        } else {
            hi = mid - 1;
        }
    }
    if (g < 0 || n >= offsets[g + 1])
        return -1;
    return g;
}

/* The expert slot row n runs, or -1 for a row in no group or a slot outside [0, S) (its output is zero). */
inline int slot_of_row(__global const int* offsets, __global const int* slots, const int G, const int S, const int n)
{
    const int g = group_of_row(offsets, G, n);
    if (g < 0)
        return -1;
    const int s = slots[g];
    return (s >= 0 && s < S) ? s : -1;
}

/* Rows before offsets[0] or from offsets[G] on are in no group: their output is zero (one work-item per row). */
__kernel void ffn_zero_ungrouped(ARG(const int, offsets), const int G, const int N, const int H, ARG(float, y))
{
    const int n = get_global_id(0);
    __global const int* offsets = AT(offsets);
    if (n >= N || (n >= offsets[0] && n < offsets[G]))
        return;
    __global float* yr = AT(y) + (size_t)n * H;
    for (int h = 0; h < H; ++h)
        yr[h] = 0.0f;
}

/* The plain grouped FFN, for devices whose work-groups are smaller than FFN_TILE x FFN_TILE: two passes through an
 * intermediate act [N,F] the host allocates (the tiled kernel below needs none).
 * Phase 1, f16 weights: act[n,f] = silu(x[n] . Wg[f]) * (x[n] . Wu[f]) with Wg = rows 0..F-1 and Wu = rows F..2F-1
 * of w_gate_up[slot]. */
__kernel void ffn_gate_up_f16(ARG(const float, x), ARG(const int, offsets), ARG(const int, slots),
                              const int G, const int S, const int N, const int H, const int F,
                              ARG(const half, w_gate_up), ARG(float, act))
{
    const int f = get_global_id(0), n = get_global_id(1);
    if (f >= F || n >= N)
        return;
    const int sl = slot_of_row(AT(offsets), AT(slots), G, S, n);
    if (sl < 0) {
        AT(act)[(size_t)n * F + f] = 0.0f;
        return;
    }
    const size_t s = (size_t)sl;
    __global const half* wg = AT(w_gate_up) + (s * 2 * F + f) * (size_t)H;
    __global const half* wu = AT(w_gate_up) + (s * 2 * F + F + f) * (size_t)H;
    __global const float* xr = AT(x) + (size_t)n * H;
    float a = 0.0f, b = 0.0f;
    for (int h = 0; h < H; ++h) {
        const float xv = xr[h];
        a += xv * vload_half(h, wg);
        b += xv * vload_half(h, wu);
    }
    AT(act)[(size_t)n * F + f] = silu_f32(a) * b;
}

/* Phase 2, f16 weights: y[n,h] = act[n] . Wd[h] with Wd = w_down[slot] [H, F]. */
__kernel void ffn_down_f16(ARG(const float, act), ARG(const int, offsets), ARG(const int, slots),
                           const int G, const int S, const int N, const int H, const int F,
                           ARG(const half, w_down), ARG(float, y))
{
    const int h = get_global_id(0), n = get_global_id(1);
    if (h >= H || n >= N)
        return;
    __global float* y = AT(y);
    const int sl = slot_of_row(AT(offsets), AT(slots), G, S, n);
    if (sl < 0) {
        y[(size_t)n * H + h] = 0.0f;
        return;
    }
    const size_t s = (size_t)sl;
    __global const half* wd = AT(w_down) + (s * H + h) * (size_t)F;
    __global const float* ar = AT(act) + (size_t)n * F;
    float acc = 0.0f;
    for (int f = 0; f < F; ++f)
        acc += ar[f] * vload_half(f, wd);
    y[(size_t)n * H + h] = acc;
}

/* A Q8_0 row times an f32 vector: each block's integer-weighted sum is scaled once by its half scale (as ggml does);
 * the oracle rounds every q*d to half first, a difference far inside the f16 tolerance. */
inline float dot_q8_0(__global const char* q, __global const half* d, __global const float* v, const int len)
{
    float acc = 0.0f;
    for (int b = 0; b < len / QK8_0; ++b) {
        float part = 0.0f;
        for (int j = 0; j < QK8_0; ++j)
            part += (float)q[b * QK8_0 + j] * v[b * QK8_0 + j];
        acc += part * vload_half(b, d);
    }
    return acc;
}

__kernel void ffn_gate_up_q8_0(ARG(const float, x), ARG(const int, offsets), ARG(const int, slots),
                               const int G, const int S, const int N, const int H, const int F,
                               ARG(const char, gate_up_q), ARG(const half, gate_up_d), ARG(float, act))
{
    const int f = get_global_id(0), n = get_global_id(1);
    if (f >= F || n >= N)
        return;
    const int sl = slot_of_row(AT(offsets), AT(slots), G, S, n);
    if (sl < 0) {
        AT(act)[(size_t)n * F + f] = 0.0f;
        return;
    }
    const size_t s = (size_t)sl;
    const size_t row_g = s * 2 * F + f, row_u = s * 2 * F + F + f;
    __global const float* xr = AT(x) + (size_t)n * H;
    const float a = dot_q8_0(AT(gate_up_q) + row_g * H, AT(gate_up_d) + row_g * (H / QK8_0), xr, H);
    const float b = dot_q8_0(AT(gate_up_q) + row_u * H, AT(gate_up_d) + row_u * (H / QK8_0), xr, H);
    AT(act)[(size_t)n * F + f] = silu_f32(a) * b;
}

__kernel void ffn_down_q8_0(ARG(const float, act), ARG(const int, offsets), ARG(const int, slots),
                            const int G, const int S, const int N, const int H, const int F,
                            ARG(const char, down_q), ARG(const half, down_d), ARG(float, y))
{
    const int h = get_global_id(0), n = get_global_id(1);
    if (h >= H || n >= N)
        return;
    __global float* y = AT(y);
    const int sl = slot_of_row(AT(offsets), AT(slots), G, S, n);
    if (sl < 0) {
        y[(size_t)n * H + h] = 0.0f;
        return;
    }
    const size_t row = (size_t)sl * H + h;
    y[(size_t)n * H + h] = dot_q8_0(AT(down_q) + row * F, AT(down_d) + row * (F / QK8_0), AT(act) + (size_t)n * F, F);
}

/* ------------------------------------------------------------------------------------------------ rmsnorm */

/* One work-group per row; the local size is a power of two (the host picks it) for the tree reduction. */
#define DEFINE_RMSNORM(NAME, WTYPE, LOADW)                                                                          \
    __kernel void NAME(ARG(const float, x), ARG(const WTYPE, w), const int T, const int H, const float eps,     \
                       ARG(float, out), __local float* scratch)                                                    \
    {                                                                                                               \
        __global const float* x = AT(x);                                                                            \
        __global const WTYPE* w = AT(w);                                                                            \
        __global float* out = AT(out);                                                                              \
        const int t = get_group_id(0), l = get_local_id(0), L = get_local_size(0);                                  \
        if (t >= T)                                                                                                 \
            return;                                                                                                 \
        __global const float* xr = x + (size_t)t * H;                                                               \
        float ss = 0.0f;                                                                                            \
        for (int h = l; h < H; h += L)                                                                              \
            ss += xr[h] * xr[h];                                                                                    \
        scratch[l] = ss;                                                                                            \
        barrier(CLK_LOCAL_MEM_FENCE);                                                                               \
        for (int stride = L / 2; stride > 0; stride /= 2) {                                                         \
            if (l < stride)                                                                                         \
                scratch[l] += scratch[l + stride];                                                                  \
            barrier(CLK_LOCAL_MEM_FENCE);                                                                           \
        }                                                                                                           \
        const float r = 1.0f / sqrt(scratch[0] / (float)H + eps);                                                   \
        for (int h = l; h < H; h += L)                                                                              \
            out[(size_t)t * H + h] = (xr[h] * r) * LOADW(w, h);                                                     \
    }

#define LOAD_F32(p, i) ((p)[i])
#define LOAD_F16(p, i) vload_half((i), (p))

DEFINE_RMSNORM(rmsnorm_w_f32, float, LOAD_F32)
DEFINE_RMSNORM(rmsnorm_w_f16, half, LOAD_F16)

/* ------------------------------------------------------------------------------------------------ linear */

/* out [T,O] = x [T,H] . w [O,H]^T, tiled LINEAR_TILE x LINEAR_TILE through local memory: each work-group loads
 * one tile of x rows and one tile of w rows per step (both contiguous along H), so every global element is read
 * once per tile instead of once per output. The +1 column keeps the transposed read off one local bank. */
#define DEFINE_LINEAR(NAME, WTYPE, LOADW)                                                                           \
    __kernel __attribute__((reqd_work_group_size(LINEAR_TILE, LINEAR_TILE, 1)))                                     \
    void NAME(ARG(const float, x), ARG(const WTYPE, w), const int T, const int H, const int O, ARG(float, out))  \
    {                                                                                                               \
        __global const float* x = AT(x);                                                                            \
        __global const WTYPE* w = AT(w);                                                                            \
        __global float* out = AT(out);                                                                              \
        __local float xs[LINEAR_TILE][LINEAR_TILE + 1];                                                             \
        __local float ws[LINEAR_TILE][LINEAR_TILE + 1];                                                             \
        const int lo = get_local_id(0), lt = get_local_id(1);                                                       \
        const int o0 = get_group_id(0) * LINEAR_TILE, t0 = get_group_id(1) * LINEAR_TILE;                           \
        const int o = o0 + lo, t = t0 + lt;                                                                         \
        float acc = 0.0f;                                                                                           \
        for (int h0 = 0; h0 < H; h0 += LINEAR_TILE) {                                                               \
            const int h = h0 + lo;                                                                                  \
            xs[lt][lo] = (t < T && h < H) ? x[(size_t)t * H + h] : 0.0f;                                            \
            ws[lt][lo] = (o0 + lt < O && h < H) ? LOADW(w, (size_t)(o0 + lt) * H + h) : 0.0f;                      \
            barrier(CLK_LOCAL_MEM_FENCE);                                                                           \
            for (int k = 0; k < LINEAR_TILE; ++k)                                                                   \
                acc += xs[lt][k] * ws[lo][k];                                                                       \
            barrier(CLK_LOCAL_MEM_FENCE);                                                                           \
        }                                                                                                           \
        if (o < O && t < T)                                                                                         \
            out[(size_t)t * O + o] = acc;                                                                           \
    }

DEFINE_LINEAR(linear_w_f32, float, LOAD_F32)
DEFINE_LINEAR(linear_w_f16, half, LOAD_F16)

/* The same product without local memory, one output per work-item, for devices whose work-groups are smaller
 * than LINEAR_TILE x LINEAR_TILE. */
#define DEFINE_LINEAR_PLAIN(NAME, WTYPE, LOADW)                                                                     \
    __kernel void NAME(ARG(const float, x), ARG(const WTYPE, w), const int T, const int H, const int O,         \
                       ARG(float, out))                                                                            \
    {                                                                                                               \
        __global const float* x = AT(x);                                                                            \
        __global const WTYPE* w = AT(w);                                                                            \
        __global float* out = AT(out);                                                                              \
        const int o = get_global_id(0), t = get_global_id(1);                                                       \
        if (o >= O || t >= T)                                                                                       \
            return;                                                                                                 \
        float acc = 0.0f;                                                                                           \
        for (int h = 0; h < H; ++h)                                                                                 \
            acc += x[(size_t)t * H + h] * LOADW(w, (size_t)o * H + h);                                              \
        out[(size_t)t * O + o] = acc;                                                                               \
    }

DEFINE_LINEAR_PLAIN(linear_plain_w_f32, float, LOAD_F32)
DEFINE_LINEAR_PLAIN(linear_plain_w_f16, half, LOAD_F16)

/* ------------------------------------------------------------------------------------------------ tiled grouped FFN */

/* The grouped FFN in one pass, SwiGLU intermediates in local memory (no act buffer in device memory). Work-group t
 * takes the t-th tile of FFN_TILE rows of one group, counting each group's tiles in group order (ffn_tile_of), so
 * every row of a tile runs the same expert slot and each FFN_TILE x FFN_TILE weight tile loaded (dequantized for
 * Q8_0 and GGUF) serves all of them. For each chunk of FFN_TILE intermediates f0..f0+15 it computes
 * act = silu(x . Wg) * (x . Wu) through local memory, then adds act . Wd^T to its rows of y, chunk after chunk:
 * every output sums its terms in ascending f, as the two-pass kernels do (the same bits); the last chunk stores the
 * result (plus the down bias, for GGUF experts that have one). The host launches
 * ceil(N / FFN_TILE) + G work-groups (an upper bound on the tiles); the rest return at once. Rows of a slot outside
 * [0, S) are zero; rows in no group are zeroed by ffn_zero_ungrouped. */
#define FFN_TILE 16

/* Tile t of the groups' rows: its group and first row (false when t is past the last tile). The same for every
 * work-item of a work-group, so no barrier is skipped by some items only. */
inline bool ffn_tile_of(__global const int* offsets, const int G, const int t, int* g, int* n0)
{
    int seen = 0;
    for (int q = 0; q < G; ++q) {
        const int c = offsets[q + 1] - offsets[q];
        const int k = c > 0 ? (c + FFN_TILE - 1) / FFN_TILE : 0;
        if (t < seen + k) {
            *g = q;
            *n0 = offsets[q] + (t - seen) * FFN_TILE;
            return true;
        }
        seen += k;
    }
    return false;
}

/* Weight (r, k) of an expert's gate/up matrix [2F, H] (GU) and of its down matrix [H, F] (DN), slot st. */
#define GU_F16(st, r, k) vload_half(((size_t)(st) * 2 * F + (r)) * (size_t)H + (k), wgu)
#define DN_F16(st, r, k) vload_half(((size_t)(st) * H + (r)) * (size_t)F + (k), wdn)
#define W_Q8_0(q, d, row, col, C) \
    ((float)(q)[(size_t)(row) * (C) + (col)] * vload_half((size_t)(row) * ((C) / QK8_0) + (col) / QK8_0, (d)))
#define GU_Q8_0(st, r, k) W_Q8_0(gq, gd, (size_t)(st) * 2 * F + (r), (k), H)
#define DN_Q8_0(st, r, k) W_Q8_0(dq, dd, (size_t)(st) * H + (r), (k), F)
/* GGUF experts ('gguf' pools): a slot of slot_bytes holds its expert's rows as the file stores them (gate/up rows of
 * gu_rb bytes at byte 0, down rows of dn_rb bytes at dn_off); weight k of a row of ggml type fmt is
 * dq_weight(row, k, fmt) (quants.cl). The f32 biases (gate [F], up [F], down [H]) start bias_off bytes into the
 * slot; bias_off < 0: none. */
#define GU_GGUF(st, r, k) dq_weight(wb + (size_t)(st) * (size_t)slot_bytes + (size_t)(r) * gu_rb, (k), gu_fmt)
#define DN_GGUF(st, r, k) \
    dq_weight(wb + (size_t)(st) * (size_t)slot_bytes + dn_off + (size_t)(r) * dn_rb, (k), dn_fmt)
#define GGUF_BIAS(st, i) dq_f32(wb + (size_t)(st) * (size_t)slot_bytes + bias_off, (i))
#define NO_BIAS(st, i) 0.0f
#define HAS_BIAS_NONE 0
#define HAS_BIAS_GGUF (bias_off >= 0)

#define DEFINE_FFN_TILED(NAME, WEIGHTS, GU, DN, HAS_BIAS, BIAS, ...)                                                 \
    __kernel __attribute__((reqd_work_group_size(FFN_TILE, FFN_TILE, 1)))                                           \
    void NAME(ARG(const float, x), ARG(const int, offsets), ARG(const int, slots), const int G, const int S,        \
              const int N, const int H, const int F, __VA_ARGS__, ARG(float, y))                                    \
    {                                                                                                               \
        __local float xs[FFN_TILE][FFN_TILE + 1];                                                                   \
        __local float gs[FFN_TILE][FFN_TILE + 1];                                                                   \
        __local float us[FFN_TILE][FFN_TILE + 1];                                                                   \
        __local float as[FFN_TILE][FFN_TILE + 1];                                                                   \
        __local float ds[FFN_TILE][FFN_TILE + 1];                                                                   \
        __global const float* x = AT(x);                                                                            \
        __global const int* offsets = AT(offsets);                                                                  \
        __global float* y = AT(y);                                                                                  \
        __global float* part = y; /* the partial sums of the chunks before the last, in place of the result */     \
        WEIGHTS                                                                                                     \
        const int lo = get_local_id(0), lt = get_local_id(1);                                                       \
        int g, n0;                                                                                                  \
        if (!ffn_tile_of(offsets, G, get_group_id(1), &g, &n0))                                                     \
            return;                                                                                                 \
        const int n1 = min(min(offsets[g + 1], n0 + FFN_TILE), N), n = n0 + lt, st = AT(slots)[g];                  \
        const bool row_in = n < n1;                                                                                 \
        if (st < 0 || st >= S) {                                                                                    \
            for (int h = lo; row_in && h < H; h += FFN_TILE)                                                        \
                y[(size_t)n * H + h] = 0.0f;                                                                        \
            return;                                                                                                 \
        }                                                                                                           \
        for (int f0 = 0; f0 < F; f0 += FFN_TILE) {                                                                  \
            const int fr = f0 + lt, f = f0 + lo;                                                                    \
            float a = 0.0f, b = 0.0f;                                                                               \
            for (int h0 = 0; h0 < H; h0 += FFN_TILE) {                                                              \
                const int h = h0 + lo;                                                                              \
                xs[lt][lo] = (row_in && h < H) ? x[(size_t)n * H + h] : 0.0f;                                       \
                gs[lt][lo] = (fr < F && h < H) ? GU(st, fr, h) : 0.0f;                                              \
                us[lt][lo] = (fr < F && h < H) ? GU(st, F + fr, h) : 0.0f;                                          \
                barrier(CLK_LOCAL_MEM_FENCE);                                                                       \
                for (int k = 0; k < FFN_TILE; ++k) {                                                                \
                    a += xs[lt][k] * gs[lo][k];                                                                     \
                    b += xs[lt][k] * us[lo][k];                                                                     \
                }                                                                                                   \
                barrier(CLK_LOCAL_MEM_FENCE);                                                                       \
            }                                                                                                       \
            if (HAS_BIAS && f < F) {                                                                                \
                a += BIAS(st, f);                                                                                   \
                b += BIAS(st, F + f);                                                                               \
            }                                                                                                       \
            as[lt][lo] = f < F ? silu_f32(a) * b : 0.0f;                                                            \
            for (int h0 = 0; h0 < H; h0 += FFN_TILE) {                                                              \
                const int hr = h0 + lt, h = h0 + lo;                                                                \
                ds[lt][lo] = (hr < H && f < F) ? DN(st, hr, f) : 0.0f;                                              \
                barrier(CLK_LOCAL_MEM_FENCE);                                                                       \
                if (row_in && h < H) {                                                                              \
                    float acc = f0 == 0 ? 0.0f : part[(size_t)n * H + h];                                           \
                    for (int k = 0; k < FFN_TILE; ++k)                                                              \
                        acc += as[lt][k] * ds[lo][k];                                                               \
                    if (f0 + FFN_TILE < F)                                                                          \
                        part[(size_t)n * H + h] = acc;                                                              \
                    else                                                                                            \
                        y[(size_t)n * H + h] = HAS_BIAS ? acc + BIAS(st, 2 * F + h) : acc;                          \
                }                                                                                                   \
                barrier(CLK_LOCAL_MEM_FENCE);                                                                       \
            }                                                                                                       \
        }                                                                                                           \
    }

DEFINE_FFN_TILED(ffn_f16_tiled,
                 __global const half* wgu = AT(wgu); __global const half* wdn = AT(wdn);,
                 GU_F16, DN_F16, HAS_BIAS_NONE, NO_BIAS, ARG(const half, wgu), ARG(const half, wdn))
DEFINE_FFN_TILED(ffn_q8_0_tiled,
                 __global const char* gq = AT(gq); __global const half* gd = AT(gd);
                 __global const char* dq = AT(dq); __global const half* dd = AT(dd);,
                 GU_Q8_0, DN_Q8_0, HAS_BIAS_NONE, NO_BIAS, ARG(const char, gq), ARG(const half, gd),
                 ARG(const char, dq), ARG(const half, dd))
DEFINE_FFN_TILED(ffn_gguf_tiled, __global const uchar* wb = AT(wb);,
                 GU_GGUF, DN_GGUF, HAS_BIAS_GGUF, GGUF_BIAS, ARG(const uchar, wb), const int slot_bytes,
                 const int gu_rb, const int gu_fmt, const long dn_off, const int dn_rb, const int dn_fmt,
                 const int bias_off)
