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

/* ------------------------------------------------------------------------------------------------ fills */

__kernel void fill_i32(__global int* out, const int n, const int value)
{
    const int i = get_global_id(0);
    if (i < n)
        out[i] = value;
}

/* ------------------------------------------------------------------------------------------------ routing */

/* One work-item per token. The j-th pick is the best logit strictly after the (j-1)-th in the order
 * (value descending, id ascending), so ties go to the lower id without any scratch memory. */
__kernel void route_topk(__global const float* logits, const int T, const int E, const int K,
                         __global int* ids, __global float* weights)
{
    const int t = get_global_id(0);
    if (t >= T)
        return;
    __global const float* row = logits + (size_t)t * E;
    __global int* out_ids = ids + (size_t)t * K;
    __global float* out_w = weights + (size_t)t * K;
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
__kernel void gather_b4(__global const uint* x, __global const int* rows, const int N, const int H, const int T,
                        __global uint* out)
{
    const int h = get_global_id(0), i = get_global_id(1);
    if (h >= H || i >= N)
        return;
    const int r = rows[i];
    out[(size_t)i * H + h] = (r >= 0 && r < T) ? x[(size_t)r * H + h] : 0u;
}

__kernel void gather_b2(__global const ushort* x, __global const int* rows, const int N, const int H, const int T,
                        __global ushort* out)
{
    const int h = get_global_id(0), i = get_global_id(1);
    if (h >= H || i >= N)
        return;
    const int r = rows[i];
    out[(size_t)i * H + h] = (r >= 0 && r < T) ? x[(size_t)r * H + h] : (ushort)0;
}

/* ------------------------------------------------------------------------------------------------ scatter_add */

/* scatter_add is deterministic: float atomics would add a token's contributions in whatever order the work-items
 * ran, so the same inputs could give different bits. Instead the host runs five passes:
 *   fill_i32(counts, 0), fill_i32(cursor, 0)
 *   scatter_count   counts[t] = how many i have rows[i] == t                 (integer atomics: exact)
 *   scatter_scan    starts[t] = exclusive prefix sum of counts, starts[T] = total
 *   scatter_fill    idx[starts[t] ...] = the i of token t, in arbitrary order
 *   scatter_sort    sort each token's i ascending (lists are short: a token appears once per routed expert)
 *   scatter_apply   out[t,h] += scale[i] * y[i,h] over the token's i in ascending order: a fixed order, so the
 *                   same inputs always give the same bits. */

__kernel void scatter_count(__global const int* rows, const int N, const int T, __global int* counts)
{
    const int i = get_global_id(0);
    if (i >= N)
        return;
    const int r = rows[i];
    if (r >= 0 && r < T)
        atomic_inc(&counts[r]);
}

/* A single work-item: T is a prompt chunk at most, and this pass is negligible beside the others. */
__kernel void scatter_scan(__global const int* counts, const int T, __global int* starts)
{
    if (get_global_id(0) != 0)
        return;
    int acc = 0;
    for (int t = 0; t < T; ++t) {
        starts[t] = acc;
        acc += counts[t];
    }
    starts[T] = acc;
}

__kernel void scatter_fill(__global const int* rows, const int N, const int T, __global const int* starts,
                           __global int* cursor, __global int* idx)
{
    const int i = get_global_id(0);
    if (i >= N)
        return;
    const int r = rows[i];
    if (r >= 0 && r < T)
        idx[starts[r] + atomic_inc(&cursor[r])] = i;
}

__kernel void scatter_sort(__global const int* starts, const int T, __global int* idx)
{
    const int t = get_global_id(0);
    if (t >= T)
        return;
    const int lo = starts[t], hi = starts[t + 1];
    for (int a = lo + 1; a < hi; ++a) {
        const int v = idx[a];
        int b = a - 1;
        while (b >= lo && idx[b] > v) {
            idx[b + 1] = idx[b];
            --b;
        }
        idx[b + 1] = v;
    }
}

__kernel void scatter_apply(__global float* out, const int T, const int H, __global const int* starts,
                            __global const int* idx, __global const float* y, __global const float* scale)
{
    const int h = get_global_id(0), t = get_global_id(1);
    if (h >= H || t >= T)
        return;
    float acc = out[(size_t)t * H + h];
    for (int j = starts[t]; j < starts[t + 1]; ++j) {
        const int i = idx[j];
        const float p = y[(size_t)i * H + h] * scale[i];
        acc = acc + p;
    }
    out[(size_t)t * H + h] = acc;
}

/* ------------------------------------------------------------------------------------------------ Q8_0 */

/* qs [R*C] int8, d [R*C/QK8_0] half -> out [R*C] half, rounded to nearest even like numpy's astype(float16). */
__kernel void dequantize_q8_0(__global const char* qs, __global const half* d, const int total, __global half* out)
{
    const int i = get_global_id(0);
    if (i >= total)
        return;
    const float v = (float)qs[i] * vload_half(i / QK8_0, d);
    vstore_half_rte(v, i, out);
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

/* Phase 1, f16 weights: act[n,f] = silu(x[n] . Wg[f]) * (x[n] . Wu[f]) with Wg = rows 0..F-1 and Wu = rows F..2F-1
 * of w_gate_up[slot]. */
__kernel void ffn_gate_up_f16(__global const float* x, __global const int* offsets, __global const int* slots,
                              const int G, const int S, const int N, const int H, const int F,
                              __global const half* w_gate_up, __global float* act)
{
    const int f = get_global_id(0), n = get_global_id(1);
    if (f >= F || n >= N)
        return;
    const int sl = slot_of_row(offsets, slots, G, S, n);
    if (sl < 0) {
        act[(size_t)n * F + f] = 0.0f;
        return;
    }
    const size_t s = (size_t)sl;
    __global const half* wg = w_gate_up + (s * 2 * F + f) * (size_t)H;
    __global const half* wu = w_gate_up + (s * 2 * F + F + f) * (size_t)H;
    __global const float* xr = x + (size_t)n * H;
    float a = 0.0f, b = 0.0f;
    for (int h = 0; h < H; ++h) {
        const float xv = xr[h];
        a += xv * vload_half(h, wg);
        b += xv * vload_half(h, wu);
    }
    act[(size_t)n * F + f] = silu_f32(a) * b;
}

/* Phase 2, f16 weights: y[n,h] = act[n] . Wd[h] with Wd = w_down[slot] [H, F]. */
__kernel void ffn_down_f16(__global const float* act, __global const int* offsets, __global const int* slots,
                           const int G, const int S, const int N, const int H, const int F,
                           __global const half* w_down, __global float* y)
{
    const int h = get_global_id(0), n = get_global_id(1);
    if (h >= H || n >= N)
        return;
    const int sl = slot_of_row(offsets, slots, G, S, n);
    if (sl < 0) {
        y[(size_t)n * H + h] = 0.0f;
        return;
    }
    const size_t s = (size_t)sl;
    __global const half* wd = w_down + (s * H + h) * (size_t)F;
    __global const float* ar = act + (size_t)n * F;
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

__kernel void ffn_gate_up_q8_0(__global const float* x, __global const int* offsets, __global const int* slots,
                               const int G, const int S, const int N, const int H, const int F,
                               __global const char* gate_up_q, __global const half* gate_up_d, __global float* act)
{
    const int f = get_global_id(0), n = get_global_id(1);
    if (f >= F || n >= N)
        return;
    const int sl = slot_of_row(offsets, slots, G, S, n);
    if (sl < 0) {
        act[(size_t)n * F + f] = 0.0f;
        return;
    }
    const size_t s = (size_t)sl;
    const size_t row_g = s * 2 * F + f, row_u = s * 2 * F + F + f;
    __global const float* xr = x + (size_t)n * H;
    const float a = dot_q8_0(gate_up_q + row_g * H, gate_up_d + row_g * (H / QK8_0), xr, H);
    const float b = dot_q8_0(gate_up_q + row_u * H, gate_up_d + row_u * (H / QK8_0), xr, H);
    act[(size_t)n * F + f] = silu_f32(a) * b;
}

__kernel void ffn_down_q8_0(__global const float* act, __global const int* offsets, __global const int* slots,
                            const int G, const int S, const int N, const int H, const int F,
                            __global const char* down_q, __global const half* down_d, __global float* y)
{
    const int h = get_global_id(0), n = get_global_id(1);
    if (h >= H || n >= N)
        return;
    const int sl = slot_of_row(offsets, slots, G, S, n);
    if (sl < 0) {
        y[(size_t)n * H + h] = 0.0f;
        return;
    }
    const size_t row = (size_t)sl * H + h;
    y[(size_t)n * H + h] = dot_q8_0(down_q + row * F, down_d + row * (F / QK8_0), act + (size_t)n * F, F);
}

/* ------------------------------------------------------------------------------------------------ rmsnorm */

/* One work-group per row; the local size is a power of two (the host picks it) for the tree reduction. */
#define DEFINE_RMSNORM(NAME, WTYPE, LOADW)                                                                          \
    __kernel void NAME(__global const float* x, __global const WTYPE* w, const int T, const int H, const float eps, \
                       __global float* out, __local float* scratch)                                                \
    {                                                                                                               \
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
    void NAME(__global const float* x, __global const WTYPE* w, const int T, const int H, const int O,            \
              __global float* out)                                                                                  \
    {                                                                                                               \
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
    __kernel void NAME(__global const float* x, __global const WTYPE* w, const int T, const int H, const int O,    \
                       __global float* out)                                                                         \
    {                                                                                                               \
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

/* The grouped FFN tiled like `linear`: a FFN_TILE x FFN_TILE work-group computes FFN_TILE outputs of FFN_TILE rows
 * through local memory when all its rows lie in one group (so they share one expert's weights: the usual case in a
 * prompt chunk, where a group holds many tokens). A tile that straddles groups, or whose rows are in no group, runs
 * the per-item loop of the plain kernels. The test is the same for every work-item of a group, so the barriers of
 * the tiled branch are reached by all of them or by none. */
#define FFN_TILE 16

/* A weight element (row, col) of a [rows, C] matrix: half weights, or Q8_0 quants times their block's scale. */
#define W_F16(row, col, C) vload_half((size_t)(row) * (C) + (col), w)
#define W_Q8_0(row, col, C) \
    ((float)wq[(size_t)(row) * (C) + (col)] * vload_half((size_t)(row) * ((C) / QK8_0) + (col) / QK8_0, wd))

/* The slot shared by every row of the tile starting at n0, or -1 when the tile straddles groups (or has none). */
inline int tile_slot(__global const int* offsets, __global const int* slots, const int G, const int S, const int N,
                     const int n0)
{
    const int g_first = group_of_row(offsets, G, n0);
    const int g_last = group_of_row(offsets, G, min(n0 + FFN_TILE, N) - 1);
    if (g_first < 0 || g_first != g_last)
        return -1;
    const int s = slots[g_first];
    return (s >= 0 && s < S) ? s : -1;
}

#define DEFINE_FFN_GATE_UP_TILED(NAME, WLOAD, ...)                                                                   \
    __kernel __attribute__((reqd_work_group_size(FFN_TILE, FFN_TILE, 1)))                                           \
    void NAME(__global const float* x, __global const int* offsets, __global const int* slots,                      \
              const int G, const int S, const int N, const int H, const int F, __VA_ARGS__, __global float* act)    \
    {                                                                                                               \
        __local float xs[FFN_TILE][FFN_TILE + 1];                                                                   \
        __local float gs[FFN_TILE][FFN_TILE + 1];                                                                   \
        __local float us[FFN_TILE][FFN_TILE + 1];                                                                   \
        const int lo = get_local_id(0), lt = get_local_id(1);                                                       \
        const int f0 = get_group_id(0) * FFN_TILE, n0 = get_group_id(1) * FFN_TILE;                                 \
        const int f = f0 + lo, n = n0 + lt;                                                                         \
        if (n0 >= N)                                                                                                \
            return;                                                                                                 \
        const int st = tile_slot(offsets, slots, G, S, N, n0);                                                      \
        if (st >= 0) {                                                                                              \
            const size_t gate_row = (size_t)st * 2 * F + f0 + lt, up_row = gate_row + F;                            \
            const bool row_ok = f0 + lt < F;                                                                        \
            float a = 0.0f, b = 0.0f;                                                                               \
            for (int h0 = 0; h0 < H; h0 += FFN_TILE) {                                                              \
                const int h = h0 + lo;                                                                              \
                xs[lt][lo] = (n < N && h < H) ? x[(size_t)n * H + h] : 0.0f;                                        \
                gs[lt][lo] = (row_ok && h < H) ? WLOAD(gate_row, h, H) : 0.0f;                                      \
                us[lt][lo] = (row_ok && h < H) ? WLOAD(up_row, h, H) : 0.0f;                                        \
                barrier(CLK_LOCAL_MEM_FENCE);                                                                       \
                for (int k = 0; k < FFN_TILE; ++k) {                                                                \
                    a += xs[lt][k] * gs[lo][k];                                                                     \
                    b += xs[lt][k] * us[lo][k];                                                                     \
                }                                                                                                   \
                barrier(CLK_LOCAL_MEM_FENCE);                                                                       \
            }                                                                                                       \
            if (f < F && n < N)                                                                                     \
                act[(size_t)n * F + f] = silu_f32(a) * b;                                                           \
            return;                                                                                                 \
        }                                                                                                           \
        if (f >= F || n >= N)                                                                                       \
            return;                                                                                                 \
        const int sl = slot_of_row(offsets, slots, G, S, n);                                                        \
        if (sl < 0) {                                                                                               \
            act[(size_t)n * F + f] = 0.0f;                                                                          \
            return;                                                                                                 \
        }                                                                                                           \
        const size_t gate_row = (size_t)sl * 2 * F + f, up_row = gate_row + F;                                      \
        __global const float* xr = x + (size_t)n * H;                                                               \
        float a = 0.0f, b = 0.0f;                                                                                   \
        for (int h = 0; h < H; ++h) {                                                                               \
            a += xr[h] * WLOAD(gate_row, h, H);                                                                     \
            b += xr[h] * WLOAD(up_row, h, H);                                                                       \
        }                                                                                                           \
        act[(size_t)n * F + f] = silu_f32(a) * b;                                                                   \
    }

#define DEFINE_FFN_DOWN_TILED(NAME, WLOAD, ...)                                                                      \
    __kernel __attribute__((reqd_work_group_size(FFN_TILE, FFN_TILE, 1)))                                           \
    void NAME(__global const float* act, __global const int* offsets, __global const int* slots,                    \
              const int G, const int S, const int N, const int H, const int F, __VA_ARGS__, __global float* y)      \
    {                                                                                                               \
        __local float as[FFN_TILE][FFN_TILE + 1];                                                                   \
        __local float ws[FFN_TILE][FFN_TILE + 1];                                                                   \
        const int lo = get_local_id(0), lt = get_local_id(1);                                                       \
        const int h0 = get_group_id(0) * FFN_TILE, n0 = get_group_id(1) * FFN_TILE;                                 \
        const int h = h0 + lo, n = n0 + lt;                                                                         \
        if (n0 >= N)                                                                                                \
            return;                                                                                                 \
        const int st = tile_slot(offsets, slots, G, S, N, n0);                                                      \
        if (st >= 0) {                                                                                              \
            const size_t down_row = (size_t)st * H + h0 + lt;                                                       \
            const bool row_ok = h0 + lt < H;                                                                        \
            float acc = 0.0f;                                                                                       \
            for (int c0 = 0; c0 < F; c0 += FFN_TILE) {                                                              \
                const int c = c0 + lo;                                                                              \
                as[lt][lo] = (n < N && c < F) ? act[(size_t)n * F + c] : 0.0f;                                      \
                ws[lt][lo] = (row_ok && c < F) ? WLOAD(down_row, c, F) : 0.0f;                                      \
                barrier(CLK_LOCAL_MEM_FENCE);                                                                       \
                for (int k = 0; k < FFN_TILE; ++k)                                                                  \
                    acc += as[lt][k] * ws[lo][k];                                                                   \
                barrier(CLK_LOCAL_MEM_FENCE);                                                                       \
            }                                                                                                       \
            if (h < H && n < N)                                                                                     \
                y[(size_t)n * H + h] = acc;                                                                         \
            return;                                                                                                 \
        }                                                                                                           \
        if (h >= H || n >= N)                                                                                       \
            return;                                                                                                 \
        const int sl = slot_of_row(offsets, slots, G, S, n);                                                        \
        if (sl < 0) {                                                                                               \
            y[(size_t)n * H + h] = 0.0f;                                                                            \
            return;                                                                                                 \
        }                                                                                                           \
        const size_t down_row = (size_t)sl * H + h;                                                                 \
        __global const float* ar = act + (size_t)n * F;                                                             \
        float acc = 0.0f;                                                                                           \
        for (int c = 0; c < F; ++c)                                                                                 \
            acc += ar[c] * WLOAD(down_row, c, F);                                                                   \
        y[(size_t)n * H + h] = acc;                                                                                 \
    }

/* The weight parameters come last (variadic) because the Q8_0 kernels take two: quants and scales. */
DEFINE_FFN_GATE_UP_TILED(ffn_gate_up_f16_tiled, W_F16, __global const half* w)
DEFINE_FFN_DOWN_TILED(ffn_down_f16_tiled, W_F16, __global const half* w)
DEFINE_FFN_GATE_UP_TILED(ffn_gate_up_q8_0_tiled, W_Q8_0, __global const char* wq, __global const half* wd)
DEFINE_FFN_DOWN_TILED(ffn_down_q8_0_tiled, W_Q8_0, __global const char* wq, __global const half* wd)

/* GGUF experts ('gguf' pools): a slot holds its expert's rows as the file stores them; weight k of a row of rb bytes
 * and ggml type fmt is dq_weight(row, k, fmt) (quants.cl). The host lists one tile per FFN_TILE rows of each group
 * (tile_group, tile_row0), so every work-group's rows share one slot: each step dequantizes one FFN_TILE x FFN_TILE
 * tile of weights into local memory (never a whole expert) and every row of the tile uses it. The f32 biases
 * (gate [F], up [F], down [H]) start bias_off bytes into the slot; bias_off < 0: none. Rows of no group are the
 * host's to zero. */
#define GGUF_ARGS __global const uchar* w, const int slot_bytes, const int w_off, const int rb, const int fmt, \
                  const int bias_off
#define GGUF_BIAS(slot, i) dq_f32(w + (size_t)(slot) * (size_t)slot_bytes + bias_off, (i))

__kernel __attribute__((reqd_work_group_size(FFN_TILE, FFN_TILE, 1)))
void ffn_gate_up_gguf(__global const float* x, __global const int* offsets, __global const int* slots,
                      __global const int* tile_group, __global const int* tile_row0, const int S, const int H,
                      const int F, GGUF_ARGS, __global float* act)
{
    __local float xs[FFN_TILE][FFN_TILE + 1];
    __local float gs[FFN_TILE][FFN_TILE + 1];
    __local float us[FFN_TILE][FFN_TILE + 1];
    const int lo = get_local_id(0), lt = get_local_id(1), t = get_group_id(1);
    const int g = tile_group[t], n0 = tile_row0[t], n1 = min(offsets[g + 1], n0 + FFN_TILE), st = slots[g];
    const int f0 = get_group_id(0) * FFN_TILE, f = f0 + lo, n = n0 + lt;
    if (st < 0 || st >= S) {  /* the same for the whole work-group: no barrier is skipped by some items only */
        if (f < F && n < n1)
            act[(size_t)n * F + f] = 0.0f;
        return;
    }
    __global const uchar* ws = w + (size_t)st * (size_t)slot_bytes + w_off;
    const bool row_ok = f0 + lt < F;
    __global const uchar* gate = ws + (size_t)(f0 + lt) * rb;
    __global const uchar* up = ws + (size_t)(F + f0 + lt) * rb;
    float a = 0.0f, b = 0.0f;
    for (int h0 = 0; h0 < H; h0 += FFN_TILE) {
        const int h = h0 + lo;
        xs[lt][lo] = (n < n1 && h < H) ? x[(size_t)n * H + h] : 0.0f;
        gs[lt][lo] = (row_ok && h < H) ? dq_weight(gate, h, fmt) : 0.0f;
        us[lt][lo] = (row_ok && h < H) ? dq_weight(up, h, fmt) : 0.0f;
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int k = 0; k < FFN_TILE; ++k) {
            a += xs[lt][k] * gs[lo][k];
            b += xs[lt][k] * us[lo][k];
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (f < F && n < n1) {
        if (bias_off >= 0) {
            a += GGUF_BIAS(st, f);
            b += GGUF_BIAS(st, F + f);
        }
        act[(size_t)n * F + f] = silu_f32(a) * b;
    }
}

__kernel __attribute__((reqd_work_group_size(FFN_TILE, FFN_TILE, 1)))
void ffn_down_gguf(__global const float* act, __global const int* offsets, __global const int* slots,
                   __global const int* tile_group, __global const int* tile_row0, const int S, const int H,
                   const int F, GGUF_ARGS, __global float* y)
{
    __local float as[FFN_TILE][FFN_TILE + 1];
    __local float wts[FFN_TILE][FFN_TILE + 1];
    const int lo = get_local_id(0), lt = get_local_id(1), t = get_group_id(1);
    const int g = tile_group[t], n0 = tile_row0[t], n1 = min(offsets[g + 1], n0 + FFN_TILE), st = slots[g];
    const int h0 = get_group_id(0) * FFN_TILE, h = h0 + lo, n = n0 + lt;
    if (st < 0 || st >= S) {
        if (h < H && n < n1)
            y[(size_t)n * H + h] = 0.0f;
        return;
    }
    __global const uchar* down = w + (size_t)st * (size_t)slot_bytes + w_off + (size_t)(h0 + lt) * rb;
    const bool row_ok = h0 + lt < H;
    float acc = 0.0f;
    for (int c0 = 0; c0 < F; c0 += FFN_TILE) {
        const int c = c0 + lo;
        as[lt][lo] = (n < n1 && c < F) ? act[(size_t)n * F + c] : 0.0f;
        wts[lt][lo] = (row_ok && c < F) ? dq_weight(down, c, fmt) : 0.0f;
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int k = 0; k < FFN_TILE; ++k)
            acc += as[lt][k] * wts[lo][k];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (h < H && n < n1)
        y[(size_t)n * H + h] = (bias_off >= 0) ? acc + GGUF_BIAS(st, 2 * F + h) : acc;
}
