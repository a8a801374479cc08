"""quant_mma.cu's kernels run on the host: g++ builds the CUDA C source with QM_HOST (and, for the sm_90a paths,
QM_HOST_WGMMA) and a shim for its one-instruction helpers, so the kernels' logic (the expert of each row tile, the
input stages, the decode of q4_k and q6_k rows into the swizzled tiles, the wgmma descriptors and sub-tiles, the
mma.sync fragments, the epilogues) is checked against float64 without a GPU, at every block shape.

The shim: a block's 256 threads are fibers (host_build.FIBERS); ldmatrix, mma.sync and the warp shuffles exchange
through memory between warp barriers; cp.async copies and wgmmas run either at once or as late as the kernel's waits
allow (a missing wait or barrier, a tile written while a wgmma may still read it, shows in one of the two); a wgmma
is computed by each thread of the warpgroup
for its own accumulator fragment, reading A and B from shared memory through the descriptor as the PTX ISA lays
out a K-major tile with the 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r % 8), 8-row groups 1 KiB
apart), so a wrong descriptor, sub-tile offset or swizzle reads the wrong weights here as on the card. Every
shared-memory access is checked against the launch's dynamic shared bytes. What the shim cannot see: the async
proxy's fences, speed, register pressure: tests/gpu/test_quant_mma.py and the benches on the H200.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
from host_build import FIBERS, block_shim, build_host_library, pointer

from strata_core.models.gguf import read_moe_tensors, write_moe_gguf
from strata_core.testing import reference64 as r64

CUDA_DIR = Path(__file__).resolve().parents[2] / "backends" / "cuda" / "strata_cuda"
#: As tests/gpu/test_quant_mma.py: per element, |out - float64| / (|float64| + 1% of the rows' rms); the outputs are
#: f16 (half an ulp is 2^-11 relative) of f32 sums of f16 products.
ELEMENT_BOUND = 1e-3
#: Rows of each expert: none, one, a 128-row tile's edges, a 256-row tile's second sub-tile in part, past it.
COUNTS = (0, 1, 127, 129, 64, 200, 257)
GAP = 3
NAN16 = 0x7E00

SHIM = r"""
#define QM_HOST 1
""" + FIBERS + block_shim("qmh") + r"""
#include <cstdint>
typedef unsigned int u32;
struct uint2 { unsigned int x, y; };
static inline uint2 make_uint2(unsigned a, unsigned b) { return uint2{a, b}; }
#define __align__(n)
template <class T> static inline T __ldg(const T* p) { return *p; }
static inline u32 __byte_perm(u32 x, u32 y, u32 s) {
    const unsigned long long b = ((unsigned long long)y << 32) | x;
    u32 r = 0;
    for (int i = 0; i < 4; ++i) r |= (u32)((b >> (8 * ((s >> (4 * i)) & 7u))) & 255u) << (8 * i);
    return r;
}
static inline u32 __funnelshift_r(u32 lo, u32 hi, u32 sh) {
    return (u32)(((((unsigned long long)hi) << 32) | lo) >> (sh & 31u));
}
static inline float __fmaf_rn(float a, float b, float c) { return std::fmaf(a, b, c); }
static inline float __fdividef(float a, float b) { return a / b; }
#define __expf(x) std::exp((float)(x))  // (a macro: glibc declares an __expf of its own, not exported)
static inline int __ffs(u32 x) { return __builtin_ffs((int)x); }
static int qmh_ix[256];
template <class F> static inline int qmh_warp_xchg(int v, F src_lane) {
    const unsigned t = threadIdx.x, w0 = t & ~31u;
    qmh_ix[t] = v;
    qmh_warp_bar[t / 32]->arrive_and_wait();
    const int r = qmh_ix[w0 + src_lane(t & 31u)];
    qmh_warp_bar[t / 32]->arrive_and_wait();
    return r;
}
static inline int __shfl_sync(unsigned, int v, int src) {
    return qmh_warp_xchg(v, [&](unsigned) { return (unsigned)src; });
}
static inline int __shfl_sync(unsigned m, bool v, int src) { return __shfl_sync(m, (int)v, src); }
static inline int __shfl_up_sync(unsigned, int v, int d) {
    return qmh_warp_xchg(v, [&](unsigned l) { return l >= (unsigned)d ? l - (unsigned)d : l; });
}
static inline u32 __ballot_sync(unsigned, bool p) {
    u32 r = 0;
    for (unsigned l = 0; l < 32; ++l) r |= (u32)(qmh_warp_xchg((int)p, [&](unsigned) { return l; }) != 0) << l;
    return r;
}

// shared memory: the dynamic tiles in one 1 KiB-aligned buffer; an address is the byte offset from its start
// (signed: the kernel's static __shared__ words live elsewhere in the library)
alignas(1024) static char qmh_shared[256 * 1024];
static long long qmh_dyn_bytes = 0;
static int qmh_oob = 0;
extern "C" int qmh_out_of_bounds() { return qmh_oob; }
#define QM_DYNAMIC_SHARED(name) char* name = qmh_shared
static inline u32 qm_smem(const void* p) { return (u32)(long long)((const char*)p - qmh_shared); }
static inline char* qmh_at(u32 a, long long n) {  // a dynamic tile's bytes a .. a + n, counted when out of bounds
    const long long o = (long long)(int)a;
    if (o < 0 || o + n > qmh_dyn_bytes) ++qmh_oob;
    return qmh_shared + o;
}
// The asynchronous copies and MMAs at either end of the time they may take (qmh_late, set per launch): 0 at once when
// issued; 1 as late as the kernel lets them: a cp.async group lands at the wait that lets it be pending no more, a
// wgmma reads its tiles at the wait of its group. A kernel that reads a stage before its wait, or writes a tile a
// wgmma still reads, or an input stage a copy may still land in, computes the wrong values in one of the two.
static int qmh_late = 0;
static int qmh_unwaited = 0;
extern "C" void qmh_set_late(int late) { qmh_late = late; }
extern "C" int qmh_unwaited_ops() { return qmh_unwaited; }
struct qmh_copy { u32 dst; const void* src; u32 bytes; };
static std::vector<qmh_copy> qmh_open[256];                // this thread's copies since its last commit
static std::vector<std::vector<qmh_copy>> qmh_groups[256];  // its committed groups not yet landed, oldest first
static inline void qmh_land(const qmh_copy& c) {
    char* d = qmh_at(c.dst, 16);
    std::memset(d, 0, 16);
    std::memcpy(d, c.src, c.bytes);
}
static inline void qm_cp16(u32 dst, const void* src, u32 bytes) {
    if (qmh_late) qmh_open[threadIdx.x].push_back(qmh_copy{dst, src, bytes});
    else qmh_land(qmh_copy{dst, src, bytes});
}
static inline void qm_commit() {
    qmh_groups[threadIdx.x].push_back(std::move(qmh_open[threadIdx.x]));
    qmh_open[threadIdx.x].clear();
}
static inline void qm_wait1() {  // cp.async.wait_group 1: every committed group but the newest has landed
    auto& g = qmh_groups[threadIdx.x];
    while (g.size() > 1) {
        for (const auto& c : g.front()) qmh_land(c);
        g.erase(g.begin());
    }
}
static inline void qm_fence_async() {}
static inline void qm_wg_fence() {}
static inline void qm_wg_commit() {}
struct qmh_mma { float* d; unsigned long long da, db; int n; };
static std::vector<qmh_mma> qmh_wg_pending[256];
static void qmh_wgmma_now(const qmh_mma& m);
static inline void qm_wg_wait0() {
    for (const auto& m : qmh_wg_pending[threadIdx.x]) qmh_wgmma_now(m);
    qmh_wg_pending[threadIdx.x].clear();
}
static inline void qm_keep(float&) {}
// each thread's queues empty at its start; at its end no wgmma may be left unwaited (its sums never read)
static inline void qmh_thread_start() {
    qmh_open[threadIdx.x].clear(); qmh_groups[threadIdx.x].clear(); qmh_wg_pending[threadIdx.x].clear();
}
static inline void qmh_thread_end() { if (!qmh_wg_pending[threadIdx.x].empty()) ++qmh_unwaited; }
static inline void qm_st_shared_v4(u32 a, u32 x, u32 y, u32 z, u32 w) {
    const u32 v[4] = {x, y, z, w};
    std::memcpy(qmh_at(a, 16), v, 16);
}
static inline u32 qm_ld_shared_u32(u32 a) {  // the kernel's static magic word
    u32 v;
    std::memcpy(&v, qmh_shared + (long long)(int)a, 4);
    return v;
}
static inline float qm_half(u32 bits) {
    const unsigned short b = (unsigned short)bits;
    _Float16 h;
    std::memcpy(&h, &b, 2);
    return (float)h;
}
static inline u32 qmh_f16_bits(float f) {
    const _Float16 h = (_Float16)f;  // round to nearest even, as cvt.rn
    unsigned short b;
    std::memcpy(&b, &h, 2);
    return b;
}
static inline u32 qm_pack(float lo, float hi) { return qmh_f16_bits(lo) | (qmh_f16_bits(hi) << 16); }
static inline float qmh_f16_at(const char* p) {
    unsigned short b;
    std::memcpy(&b, p, 2);
    return qm_half(b);
}

// ldmatrix .x4: lanes 8i..8i+7 give the row addresses of matrix i; lane l gets row l / 4, words l % 4 of each
static u32 qmh_rows[256];
static inline void qm_ldm4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    const unsigned t = threadIdx.x, w0 = t & ~31u, l = t & 31u;
    qmh_rows[t] = addr;
    qmh_warp_bar[t / 32]->arrive_and_wait();
    u32 r[4];
    for (int i = 0; i < 4; ++i) std::memcpy(&r[i], qmh_at(qmh_rows[w0 + 8 * i + l / 4] + 4 * (l % 4), 4), 4);
    qmh_warp_bar[t / 32]->arrive_and_wait();
    r0 = r[0]; r1 = r[1]; r2 = r[2]; r3 = r[3];
}

// mma.sync m16n8k16 over the warp's fragments as the PTX ISA lays them out (g = lane / 4, t = lane % 4):
// a0 (g, 2t..), a1 (g + 8, 2t..), a2 (g, 2t + 8..), a3 (g + 8, 2t + 8..); b0 (k 2t.., n g), b1 (k 2t + 8.., n g);
// c0, c1 (g, 2t, 2t + 1), c2, c3 (g + 8, ..)
static u32 qmh_fa[256][4], qmh_fb[256][2];
static inline void qm_mma(float* c, const u32* a, u32 b0, u32 b1) {
    const unsigned tid = threadIdx.x, lane = tid & 31u, w0 = tid - lane;
    for (int i = 0; i < 4; ++i) qmh_fa[tid][i] = a[i];
    qmh_fb[tid][0] = b0;
    qmh_fb[tid][1] = b1;
    qmh_warp_bar[tid / 32]->arrive_and_wait();
    float A[16][16], B[16][8];
    for (unsigned l = 0; l < 32; ++l) {
        const unsigned g = l / 4, t = l % 4;
        for (unsigned j = 0; j < 2; ++j) {
            A[g][2 * t + j] = qm_half(qmh_fa[w0 + l][0] >> (16 * j));
            A[g + 8][2 * t + j] = qm_half(qmh_fa[w0 + l][1] >> (16 * j));
            A[g][2 * t + 8 + j] = qm_half(qmh_fa[w0 + l][2] >> (16 * j));
            A[g + 8][2 * t + 8 + j] = qm_half(qmh_fa[w0 + l][3] >> (16 * j));
            B[2 * t + j][g] = qm_half(qmh_fb[w0 + l][0] >> (16 * j));
            B[2 * t + 8 + j][g] = qm_half(qmh_fb[w0 + l][1] >> (16 * j));
        }
    }
    qmh_warp_bar[tid / 32]->arrive_and_wait();
    const unsigned g = lane / 4, t = lane % 4;
    for (int i = 0; i < 4; ++i) {
        float s = 0.0f;
        for (int k = 0; k < 16; ++k) s += A[g + (i >= 2 ? 8 : 0)][k] * B[k][2 * t + (i & 1)];
        c[i] += s;
    }
}

// wgmma m64nNk16 f32 += f16 x f16, A and B K-major in shared memory by descriptor (start address / 16 in bits
// 0..13, leading offset 1 in 16..29, stride offset / 16 in 32..45, 128-byte swizzle: mode 1 in bits 62..63). Element
// (row, k) of a tile: linear byte start + (row / 8) * stride + (row % 8) * 128 + 2k, its 16-byte chunk XORed with
// bits 7..9 of that address. Thread t of the warpgroup holds D[16 (t / 32) + (t % 32) / 4 + 8h][8j + 2 (t % 4) + e]
// in d[4j + 2h + e].
static int qmh_bad_desc = 0;
extern "C" int qmh_bad_descriptors() { return qmh_bad_desc; }
static inline float qmh_operand(unsigned long long desc, int row, int k) {
    if (((desc >> 16) & 0x3fffull) != 1 || (desc >> 62) != 1 || ((desc >> 49) & 7ull) != 0) ++qmh_bad_desc;
    const u32 start = (u32)(desc & 0x3fffull) << 4, stride = (u32)((desc >> 32) & 0x3fffull) << 4;
    const u32 lin = start + (u32)(row / 8) * stride + (u32)(row % 8) * 128u + 2u * (u32)k;
    return qmh_f16_at(qmh_at(lin ^ (((lin >> 7) & 7u) << 4), 2));
}
template <int N>
static inline void qmh_wgmma(float* d, unsigned long long da, unsigned long long db) {
    const unsigned t = threadIdx.x & 127u, w = t / 32, l = t & 31u;
    for (int j = 0; j < N / 8; ++j)
        for (int h = 0; h < 2; ++h)
            for (int e = 0; e < 2; ++e) {
                const int row = 16 * w + l / 4 + 8 * h, col = 8 * j + 2 * (l % 4) + e;
                float s = 0.0f;
                for (int k = 0; k < 16; ++k) s += qmh_operand(da, row, k) * qmh_operand(db, col, k);
                d[4 * j + 2 * h + e] += s;
            }
}
static void qmh_wgmma_now(const qmh_mma& m) {
    if (m.n == 256) qmh_wgmma<256>(m.d, m.da, m.db);
    else qmh_wgmma<128>(m.d, m.da, m.db);
}
static inline void qmh_wgmma_issue(float* d, unsigned long long da, unsigned long long db, int n) {
    const qmh_mma m{d, da, db, n};
    if (qmh_late) qmh_wg_pending[threadIdx.x].push_back(m);
    else qmh_wgmma_now(m);
}
static inline void qm_wgmma256(float* d, unsigned long long da, unsigned long long db) {
    qmh_wgmma_issue(d, da, db, 256);
}
static inline void qm_wgmma128(float* d, unsigned long long da, unsigned long long db) {
    qmh_wgmma_issue(d, da, db, 128);
}
"""

ARGS = ("const unsigned short* a, const unsigned char* blob, unsigned short* c, const int* counts, const int* row0, "
        "const int* slots, int N, int K, long long slot_bytes, long long mat_off, long long row_bytes, int e_lo, "
        "int e_hi")
CALL = "a, blob, c, counts, row0, slots, N, K, slot_bytes, mat_off, row_bytes, e_lo, e_hi"
#: The kernels each build defines: sm_80 (mma.sync) the 128 x 256 blocks only; sm_90a (wgmma) every shape.
KERNELS = {False: [f"strata_qm_{w}_{t}" for w in ("gate_up", "down") for t in ("q4_k", "q6_k")],
           True: [f"strata_qm{p}_{w}_{t}" for p in ("", "128", "128_m256") for w in ("gate_up", "down")
                  for t in ("q4_k", "q6_k")]}


def _wrappers(wgmma: bool) -> str:
    """extern "C" host_<kernel>(gx, gy, smem, args): the kernel launched over a gx x gy grid of 256-thread blocks."""
    return "extern \"C\" {\n" + "".join(
        f"void host_{k}(unsigned gx, unsigned gy, long long smem, {ARGS}) {{ qmh_dyn_bytes = smem; "
        f"qmh_launch(gx, gy, [&] {{ qmh_thread_start(); {k}({CALL}); qmh_thread_end(); }}); }}\n"
        for k in KERNELS[wgmma]) + "}\n"


@pytest.fixture(scope="module", params=[True, False], ids=["sm90a-wgmma", "sm80-mma-sync"])
def build(request, tmp_path_factory):
    """(quant_mma.cu built for the host, whether it is the wgmma build)."""
    wgmma = request.param
    text = ("#define QM_HOST_WGMMA 1\n" if wgmma else "") + SHIM + (CUDA_DIR / "quant_mma.cu").read_text() + \
        _wrappers(wgmma)
    return build_host_library(tmp_path_factory, "quant_mma_host" + ("_wgmma" if wgmma else ""), text, CUDA_DIR), wgmma


def _pool(tmp_path, gate_up: str, down: str, e_n: int, h: int, f: int):
    """Layer 1 of a 2-layer qwen3moe file of these types, its blob's slots permuted: (pool, blob, slot of each
    expert)."""
    path = write_moe_gguf(tmp_path / "m.gguf", seed=13, layers=2, experts=e_n, hidden=h, ffn=f, gate_up=gate_up,
                          down=down)
    lp = read_moe_tensors(path).experts.for_layer(1)
    blob = lp.arrays["blob"]
    perm = np.random.default_rng(5).permutation(blob.shape[0])
    return lp, np.ascontiguousarray(blob[perm]), np.argsort(perm)[e_n + np.arange(e_n)].astype(np.int32)


def _run(lib, lp, blob, slots, xs: np.ndarray, row0: np.ndarray, rows: int, block_rows, input_rows, experts=None,
         late: bool = False):
    """Both launches as QuantMmaGEMM makes them (quant_mma.launches), through the host build, the asynchronous
    copies and MMAs at once or `late`: (act, ys) float64."""
    from strata_cuda.quant_mma import launches
    fmt = lp.fmt
    e_lo, e_hi = experts or (0, len(COUNTS))
    gu, dn = launches(fmt.hidden, fmt.ffn, (fmt.gate_up, fmt.down), (fmt.gate_up_row_bytes, fmt.down_row_bytes),
                      fmt.down_offset, block_rows, input_rows)
    act = np.full((rows, fmt.ffn), NAN16, np.uint16)
    ys = np.full((rows, fmt.hidden), NAN16, np.uint16)
    tables = [np.ascontiguousarray(v, dtype=np.int32) for v in (COUNTS, row0, slots)]
    lib.qmh_set_late(ctypes.c_int(int(late)))
    for ln, a, c in ((gu, xs.view(np.uint16), act), (dn, act, ys)):
        gx, gy = ln.grid(int(sum(COUNTS)), e_hi - e_lo)
        getattr(lib, f"host_{ln.kernel}")(
            ctypes.c_uint(gx), ctypes.c_uint(gy), ctypes.c_longlong(ln.smem_bytes), pointer(a), pointer(blob),
            pointer(c), *(pointer(t) for t in tables), ctypes.c_int(ln.n), ctypes.c_int(ln.k),
            ctypes.c_longlong(blob.shape[1]), ctypes.c_longlong(ln.mat_off), ctypes.c_longlong(ln.row_bytes),
            ctypes.c_int(e_lo), ctypes.c_int(e_hi))
    assert lib.qmh_out_of_bounds() == 0, "a shared-memory access fell outside the launch's dynamic shared bytes"
    assert lib.qmh_bad_descriptors() == 0, "a wgmma descriptor is not K-major with the 128-byte swizzle"
    assert lib.qmh_unwaited_ops() == 0, "a thread ended with a wgmma it never waited for"
    return act.view(np.float16).astype(np.float64), ys.view(np.float16).astype(np.float64)


def _shapes(wgmma: bool):
    """(block rows, input rows) of (gate|up, down): 256 x 128 on both builds; 128-row weight blocks for 128 and 256
    input rows, and a pair of different shapes, on the wgmma build."""
    base = [((256, 256), (128, 128))]
    return base + [((128, 128), (128, 128)), ((128, 128), (256, 256)), ((128, 256), (256, 128))] if wgmma else base


#: (gate|up type, down type, late, hidden, ffn): each type's K loop over two trips of STEP_UNROLL steps (K 512) in
#: one of its launches, the four input stages reused; the copies and MMAs at once and late.
CASES = {"q4_k-q6_k-at-once": ("q4_k", "q6_k", False, 512, 256), "q4_k-q6_k-late": ("q4_k", "q6_k", True, 256, 512),
         "q6_k-q4_k-late": ("q6_k", "q4_k", True, 512, 256)}


@pytest.mark.parametrize("case", list(CASES))
def test_both_launches_match_float64_of_the_same_bytes_at_every_shape(tmp_path, build, case):
    """gate|up with the SwiGLU against float64 of x and the f16 weights; down against float64 of the build's own act;
    rows in the gaps between experts untouched; the copies and MMAs at once or as late as the kernel allows."""
    lib, wgmma = build
    gate_up, down, late, h, f = CASES[case]
    e_n = len(COUNTS)
    lp, blob, slots = _pool(tmp_path, gate_up, down, e_n, h, f)
    row0 = np.concatenate([[0], np.cumsum(np.asarray(COUNTS) + GAP)[:-1]]).astype(np.int32)
    rows = int(row0[-1] + COUNTS[-1] + GAP)
    xs = np.random.default_rng(2).standard_normal((rows, h)).astype(np.float16)
    weights = [r64.f16_expert_matrices(lp, lp.arrays["blob"].shape[0] // 2 + e) for e in range(e_n)]
    for block_rows, input_rows in _shapes(wgmma):
        act, ys = _run(lib, lp, blob, slots, xs, row0, rows, block_rows, input_rows, late=late)
        live = np.zeros(rows, bool)
        for e, (r, n) in enumerate(zip(row0, COUNTS)):
            live[r:r + n] = True
            w13, w2 = weights[e]
            x = xs[r:r + n].astype(np.float64)
            g, u = x @ w13[:f].T, x @ w13[f:].T
            worst_act = r64.worst_element_error(act[r:r + n], g / (1.0 + np.exp(-g)) * u)
            assert worst_act <= ELEMENT_BOUND, ("act", block_rows, input_rows, e, worst_act)
            worst_y = r64.worst_element_error(ys[r:r + n], act[r:r + n] @ w2.T)
            assert worst_y <= ELEMENT_BOUND, ("y", block_rows, input_rows, e, worst_y)
        assert np.isnan(act[~live]).all() and np.isnan(ys[~live]).all(), ("a row outside the experts'", block_rows)


def test_a_launch_over_a_subset_of_the_experts_writes_only_their_rows(tmp_path, build):
    """experts=(2, 6): those experts' rows as in the whole launch, every other row untouched (each shape)."""
    lib, wgmma = build
    e_n, h, f = len(COUNTS), 256, 256
    lp, blob, slots = _pool(tmp_path, "q4_k", "q6_k", e_n, h, f)
    row0 = np.concatenate([[0], np.cumsum(COUNTS)[:-1]]).astype(np.int32)
    rows = int(sum(COUNTS))
    xs = np.random.default_rng(4).standard_normal((rows, h)).astype(np.float16)
    inside = np.zeros(rows, bool)
    inside[row0[2]:row0[6]] = True
    for block_rows, input_rows in _shapes(wgmma)[-1:]:
        act_all, ys_all = _run(lib, lp, blob, slots, xs, row0, rows, block_rows, input_rows)
        act, ys = _run(lib, lp, blob, slots, xs, row0, rows, block_rows, input_rows, (2, 6))
        assert np.array_equal(act[inside], act_all[inside]) and np.array_equal(ys[inside], ys_all[inside])
        assert np.isnan(act[~inside]).all() and np.isnan(ys[~inside]).all()
