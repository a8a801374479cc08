// Grouped expert GEMMs on tensor cores that read a 'gguf' pool's own q4_k / q6_k rows and decode them per tile
// (CUDA only: wgmma on sm_90a, mma.sync elsewhere, cp.async; sm_80 and newer). strata_cuda/quant_mma.py launches them.
//
// One launch is a layer's gate|up with the SwiGLU fused in (act = silu(x Wg^T) * (x Wu^T)), another its down
// projection (y = act Wd^T), for every routed expert at once. Tables as triton_moe's: expert e's rows are rows
// row0[e] .. row0[e] + counts[e] of the f16 input, its weights the pool slot slots[e] (slot s at blob + s *
// slot_bytes, the matrix's rows at mat_off, row_bytes each). A block finds its expert from the counts (blockIdx.y
// walks every expert's ceil(count / QM_BM) row tiles in expert order; a block past the last returns at once), so no
// launch needs the counts on the host.
//
// A block computes QM_BM (or 2 QM_BM) input rows x BN weight rows (gate|up: BN/2 gate rows and the same BN/2 up
// rows, BN/2 act columns; down: BN output columns) in K steps of 64 weights: the input tile comes by cp.async (four
// stages, two ahead: the stage of step k is k % 4, a constant of the unrolled loop); the 256 threads decode the next step's BN x 64 weights (a row by 256 / BN threads) from the quant bytes
// (read into registers a step or two ahead) into the other of two shared f16 tiles (128-byte rows, 16-byte chunks
// swizzled by the row) while the current step's MMAs run. On sm_90a each of two warpgroups runs wgmma m64nBNk16 from
// the shared tiles (asynchronous: the decode issues while the tensor cores work, which needs every value a wgmma's
// path depends on warp-uniform to the compiler: see qm_kernel); elsewhere (BN 256 only) eight
// warps (2 x 4, 64 x 64 each) run mma.sync m16n8k16 from ldmatrix fragments. BN 256: one block an SM (128 f32 sums
// a thread); BN 128 (sm_90a): two (64 sums a thread, half the shared memory), so one block's decode, barriers and
// start overlap the other's MMAs. Each weight is decoded once per block and never written to global memory.
//
// Decoded weights are the oracle's float32 (strata_core/reference/quants.py, quants.cuh) rounded once to f16: a
// quant q becomes the float 2^23 + q by its bits, fma(2^23 + q, scale, -2^23 * scale) is q * scale exactly, and the
// q4_k min (or q6_k's 32 * scale) is subtracted with one rounding, as numpy does.

// QM_BM input rows a block by default: 64 a warpgroup; MT = 2 (sm_90a, BN 128) takes 2 * QM_BM, 128 a warpgroup
#define QM_BM 128
#define QM_BK 64
#define QM_THREADS 256
#define QM_XSTAGES 4
#define QM_XTILE(MT) ((MT) * QM_BM * QM_BK * 2)
// tiles 1024-byte aligned (the 128-byte swizzle's period, which wgmma's descriptors assume): one KiB of slack
#define QM_SMEM(BN, MT) (QM_XSTAGES * QM_XTILE(MT) + 2 * (BN) * QM_BK * 2 + 1024)

// (QM_HOST, QM_HOST_WGMMA: tests/quant/test_quant_mma_host.py builds this file for the host, supplying the
// helpers of the device-only section below and the intrinsics; QM_HOST_WGMMA its sm_90a paths)
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || defined(QM_HOST_WGMMA)
#define QM_WGMMA 1
#else
#define QM_WGMMA 0
#endif

#define QM_Q4_K 12
#define QM_Q6_K 14

typedef unsigned int u32;

// ---- the device-only helpers: each one PTX instruction or a few (the host build supplies its own) ----
#if !defined(QM_HOST)
#define QM_DYNAMIC_SHARED(name) extern __shared__ __align__(128) char name[]

__device__ __forceinline__ u32 qm_smem(const void* p) {
    u32 r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}

__device__ __forceinline__ void qm_cp16(u32 dst, const void* src, u32 bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void qm_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

__device__ __forceinline__ void qm_wait1() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }

__device__ __forceinline__ void qm_ldm4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr)
                 : "memory");
}

__device__ __forceinline__ void qm_mma(float* c, const u32* a, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// D[64 x N] += A[64 x 16] B[16 x N]^T from two shared-memory descriptors (K-major, 128-byte swizzle).
__device__ __forceinline__ void qm_wgmma256(float* d, unsigned long long da, unsigned long long db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(da), "l"(db), "r"(1));
}

__device__ __forceinline__ void qm_wgmma128(float* d, unsigned long long da, unsigned long long db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(1));
}

__device__ __forceinline__ void qm_wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void qm_wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void qm_wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
// the generic proxy's shared-memory writes (cp.async, the decode's stores) made visible to wgmma's async proxy
__device__ __forceinline__ void qm_fence_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

__device__ __forceinline__ float qm_half(u32 bits) {
    float f;
    asm("{ .reg .b16 h; cvt.u16.u32 h, %1; cvt.f32.f16 %0, h; }" : "=f"(f) : "r"(bits));
    return f;
}

__device__ __forceinline__ u32 qm_pack(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ void qm_st_shared_v4(u32 addr, u32 a, u32 b, u32 c, u32 d) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}

__device__ __forceinline__ u32 qm_ld_shared_u32(u32 addr) {
    u32 v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
    return v;
}

// v held in its register across this point (the compiler may not move its uses over a wgmma fence or wait)
__device__ __forceinline__ void qm_keep(float& v) { asm volatile("" : "+f"(v)::"memory"); }
#endif  // !QM_HOST

template <int BN>
__device__ __forceinline__ void qm_wgmma(float* d, unsigned long long da, unsigned long long db) {
    if constexpr (BN == 256)
        qm_wgmma256(d, da, db);
    else
        qm_wgmma128(d, da, db);
}

__device__ __forceinline__ unsigned long long qm_desc(u32 addr) {  // K-major, 128-byte swizzle, 8-row groups 1 KiB apart
    return (unsigned long long)((addr & 0x3ffffu) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}


// silu(g) * u of two adjacent outputs, packed as f16.
// (__fdividef: IEEE division would put a subroutine call per output into the epilogue; its 2-ulp f32 error is far
// below the f16 rounding that follows)
__device__ __forceinline__ u32 qm_swiglu(const float* g, const float* u) {
    return qm_pack(__fdividef(g[0], 1.0f + __expf(-g[0])) * u[0], __fdividef(g[1], 1.0f + __expf(-g[1])) * u[1]);
}

// The exponent bytes of 2^23 (mg = QM_MAGIC; see QmBlock::step for why it is a register).
#define QM_MAGIC 0x4B000000u

// Byte b of w as the float 2^23 + byte.
__device__ __forceinline__ float qm_magic(u32 w, int b, u32 mg) {
    return __uint_as_float(__byte_perm(w, mg, 0x7650u | (u32)b));
}

// Four weights from the four bytes of u (each a quant value times 1 or 16): fma(2^23 + u, s, nb) - c, packed.
__device__ __forceinline__ uint2 qm_four(u32 u, float s, float nb, float c, u32 mg) {
    float w[4];
#pragma unroll
    for (int b = 0; b < 4; ++b) w[b] = __fsub_rn(__fmaf_rn(qm_magic(u, b, mg), s, nb), c);
    return make_uint2(qm_pack(w[0], w[1]), qm_pack(w[2], w[3]));
}

// st.shared, not a store through the generic pointer (which the compiler would issue as ST.E, address translation
// included: the tile pointers live in the block's struct and lose their address space)
__device__ __forceinline__ void qm_store(char* bt, int n, int chunk, uint2 a, uint2 b) {
    qm_st_shared_v4(qm_smem(bt) + n * 128 + ((chunk ^ (n & 7)) << 4), a.x, a.y, b.x, b.y);
}

// ---- q4_k: a step is a quarter g of a super-block: sub-blocks 2g (low nibbles of qs[32g..+32]) and 2g+1 (high). A
// thread of part p (of RT a row) decodes qs bytes 32g + 32p/RT .. +32/RT: CH = 4/RT chunks of 8 weights of each sub.
template <int RT>
struct QmRawQ4 {
    uint4 hdr, q[2 / RT];
};

template <int RT>
__device__ __forceinline__ void qm_load(QmRawQ4<RT>& r, const unsigned char* row, int step, int part) {
    const unsigned char* b = row + (long long)(step >> 2) * 144;
    const int g = step & 3;
    r.hdr = *(const uint4*)b;
#pragma unroll
    for (int i = 0; i < 2 / RT; ++i) r.q[i] = *(const uint4*)(b + 16 + 32 * g + (32 / RT) * part + 16 * i);
}

struct QmScaleQ4 {
    float s0, nb0, m0, s1, nb1, m1;
    u32 mg;  // QM_MAGIC
};

__device__ __forceinline__ u32 qm_byte(const uint4& h, int i) {  // byte i of the 12 scale bytes (h.y, h.z, h.w)
    const u32 w = i < 4 ? h.y : (i < 8 ? h.z : h.w);
    return (w >> (8 * (i & 3))) & 255u;
}

__device__ __forceinline__ void qm_scale_min(const uint4& h, int j, u32& sc, u32& m) {
    if (j < 4) {
        sc = qm_byte(h, j) & 63u;
        m = qm_byte(h, j + 4) & 63u;
    } else {
        sc = (qm_byte(h, j + 4) & 15u) | ((qm_byte(h, j - 4) >> 6) << 4);
        m = (qm_byte(h, j + 4) >> 4) | ((qm_byte(h, j) >> 6) << 4);
    }
}

template <int RT>
__device__ __forceinline__ QmScaleQ4 qm_scales(const QmRawQ4<RT>& r, int step) {
    const int g = step & 3;
    const float d = qm_half(r.hdr.x & 0xffffu), dmin = qm_half(r.hdr.x >> 16);
    u32 sc0, m0, sc1, m1;
    qm_scale_min(r.hdr, 2 * g, sc0, m0);
    qm_scale_min(r.hdr, 2 * g + 1, sc1, m1);
    QmScaleQ4 s;
    s.s0 = __fmul_rn(d, (float)sc0);
    s.m0 = __fmul_rn(dmin, (float)m0);
    s.nb0 = __fmul_rn(s.s0, -8388608.0f);
    s.s1 = __fmul_rn(__fmul_rn(d, (float)sc1), 0.0625f);  // the high nibbles are read as 16 * q
    s.m1 = __fmul_rn(dmin, (float)m1);
    s.nb1 = __fmul_rn(s.s1, -8388608.0f);
    s.mg = QM_MAGIC;
    return s;
}

// Chunk c of the part's (weights 8c.. of its span of sub 2g, and of sub 2g+1) into row n of the f16 tile.
template <int RT>
__device__ __forceinline__ void qm_decode(const QmRawQ4<RT>& r, const QmScaleQ4& s, int c, int, int part, char* bt,
                                          int n) {
    const uint4& q = r.q[c >> 1];
    const u32 w0 = (c & 1) ? q.z : q.x, w1 = (c & 1) ? q.w : q.y;
    const int chunk = (4 / RT) * part + c;
    qm_store(bt, n, chunk, qm_four(w0 & 0x0f0f0f0fu, s.s0, s.nb0, s.m0, s.mg),
             qm_four(w1 & 0x0f0f0f0fu, s.s0, s.nb0, s.m0, s.mg));
    qm_store(bt, n, 4 + chunk, qm_four(w0 & 0xf0f0f0f0u, s.s1, s.nb1, s.m1, s.mg),
             qm_four(w1 & 0xf0f0f0f0u, s.s1, s.nb1, s.m1, s.mg));
}

// ---- q6_k: a step is a quarter q of a 210-byte super-block (half h = q / 2, odd = q % 2): weights
// 128h + 64odd + l (l < 32) from nibble `odd` of ql[64h + l] and bits 4odd.. of qh[32h + l], weights
// 128h + 64odd + 32 + l from ql[64h + 32 + l] and bits 4odd + 2.. of qh[32h + l]. A thread of part p decodes
// l = 32p/RT .. +32/RT. Rows are 2-byte aligned, so the words are read aligned and funnel-shifted at decode. Both
// quarters of a half read the same bytes.
template <int RT>
struct QmRawQ6 {
    static constexpr int W = 32 / RT / 4 + 1;  // words of a region of 32/RT bytes, one more for the shift
    u32 la[W], lb[W], qh[W], sc[3], sh;
    unsigned short d;
};

template <int RT>
__device__ __forceinline__ void qm_load(QmRawQ6<RT>& r, const unsigned char* row, int step, int part) {
    constexpr int W = QmRawQ6<RT>::W;
    const unsigned long long p = (unsigned long long)(row + (long long)(step >> 2) * 210);
    const int h = (step >> 1) & 1, l0 = (32 / RT) * part;
    r.sh = (u32)(p & 3u) * 8u;
    const u32* la = (const u32*)((p + 64 * h + l0) & ~3ull);
    const u32* lb = (const u32*)((p + 64 * h + 32 + l0) & ~3ull);
    const u32* qh = (const u32*)((p + 128 + 32 * h + l0) & ~3ull);
    const u32* sc = (const u32*)((p + 192 + 8 * h) & ~3ull);
    // __ldg: the pointers come from integers (aligned down), so a plain load would be a generic one (LD.E), not a
    // global read-only one (LDG.E.CONSTANT)
#pragma unroll
    for (int i = 0; i < W; ++i) {
        r.la[i] = __ldg(la + i);
        r.lb[i] = __ldg(lb + i);
        r.qh[i] = __ldg(qh + i);
    }
    r.sc[0] = __ldg(sc);
    r.sc[1] = __ldg(sc + 1);
    r.sc[2] = r.sh ? __ldg(sc + 2) : 0u;  // only a shifted row needs it (an aligned one would read past the block)
    r.d = __ldg((const unsigned short*)(p + 208));
}

struct QmScaleQ6 {
    float d;
    u32 mg;  // QM_MAGIC
};

template <int RT>
__device__ __forceinline__ QmScaleQ6 qm_scales(const QmRawQ6<RT>& r, int) {
    QmScaleQ6 s;
    s.d = qm_half(r.d);
    s.mg = QM_MAGIC;
    return s;
}

__device__ __forceinline__ u32 qm_word(const u32* w, int i, u32 sh) { return __funnelshift_r(w[i], w[i + 1], sh); }

template <int RT>
__device__ __forceinline__ void qm_decode_q6_part(const QmRawQ6<RT>& r, float d, u32 mg, int c, int odd, int part,
                                                  int second, char* bt, int n) {
    const u32 sh = r.sh, nsh = 4u * (u32)odd, hsh = 4u * (u32)odd + 2u * (u32)second;
    const u32 s_lo = qm_word(r.sc, 0, sh), s_hi = qm_word(r.sc, 1, sh);
    const int l = (32 / RT) * part + 8 * c;          // the chunk's first l
    const int si = 4 * odd + 2 * second + (l >> 4);  // scale index within the half's eight
    const u32 sb = ((si < 4 ? s_lo : s_hi) >> (8 * (si & 3))) & 255u;
    const float s = __fmul_rn(d, (float)(int)(signed char)sb);
    const float nb = __fmul_rn(s, -8388608.0f), cc = __fmul_rn(s, 32.0f);
    const u32* ql = second ? r.lb : r.la;
    uint2 out[2];
#pragma unroll
    for (int t = 0; t < 2; ++t) {
        const u32 lw = qm_word(ql, 2 * c + t, sh), hw = qm_word(r.qh, 2 * c + t, sh);
        const u32 u = ((lw >> nsh) & 0x0f0f0f0fu) | (((hw >> hsh) & 0x03030303u) << 4);
        out[t] = qm_four(u, s, nb, cc, mg);
    }
    qm_store(bt, n, (second ? 4 : 0) + (l >> 3), out[0], out[1]);
}

template <int RT>
__device__ __forceinline__ void qm_decode(const QmRawQ6<RT>& r, const QmScaleQ6& s, int c, int odd, int part,
                                          char* bt, int n) {
    qm_decode_q6_part(r, s.d, s.mg, c, odd, part, 0, bt, n);
    qm_decode_q6_part(r, s.d, s.mg, c, odd, part, 1, bt, n);
}

template <int FMT, int RT>
struct QmFmt;
template <int RT>
struct QmFmt<QM_Q4_K, RT> {
    typedef QmRawQ4<RT> Raw;
    typedef QmScaleQ4 Scale;
    static constexpr int UNIT_SHIFT = 0;  // a raw unit per step
};
template <int RT>
struct QmFmt<QM_Q6_K, RT> {
    typedef QmRawQ6<RT> Raw;
    typedef QmScaleQ6 Scale;
    static constexpr int UNIT_SHIFT = 1;  // a raw unit per two steps (a half super-block)
};

template <int FMT, bool SWIGLU, int BN, int MT>
struct QmBlock {
    static constexpr int RT = 256 / BN;  // threads a weight row
    static constexpr int CH = 4 / RT;    // chunk pairs a thread decodes a step
    static constexpr int BTILE = BN * QM_BK * 2;
    static constexpr int BM = MT * QM_BM;  // input rows: row group g (64 rows) is warpgroup g % 2's sub-tile g / 2
    static constexpr int XTILE = QM_XTILE(MT);
#if !QM_WGMMA
    static_assert(MT == 1, "the mma.sync path takes 128 input rows a block");
#endif
    typedef typename QmFmt<FMT, RT>::Raw Raw;
    typedef typename QmFmt<FMT, RT>::Scale Scale;

    char* xs;  // QM_XSTAGES input tiles
    char* bs;  // two f16 weight tiles
    const unsigned short* a;
    const unsigned char* wrow;  // this thread's weight row
    long long arow0;            // first input row of the tile
    // this thread's input chunks (rows xr0 + 32 i, its 16 bytes ch = tid % 8 of each; the row's swizzle is i's too):
    // the first's source, the stride between them, the first's shared address in stage 0
    const unsigned short* xsrc;
    long long xstride;
    u32 xdst;
    int xr0;
    u32 magic_at;  // shared address of a word holding QM_MAGIC
    int rows, K, S, tid, lane, wm, wn, n, part;
    bool active[MT];  // whether this warp's (warpgroup's) 64 rows of sub-tile t hold any routed row
#if QM_WGMMA
    // sub-tile t's n8 tile j: acc[t * BN / 2 + 4j ..] (rows l/4 and l/4 + 8 of the warp's 16, columns 8j + 2(l%4), +1)
    float acc[MT * BN / 2];
#else
    float acc[4][8][4];
#endif
    Raw raw[2];

    // (the addresses once, not per step: they were most of a step's instructions besides the decode)
    __device__ __forceinline__ void init_x() {
        const int ch = tid & 7;
        xr0 = tid >> 3;
        xstride = 32ll * K;
        xsrc = a + (arow0 + xr0) * K + ch * 8;
        xdst = qm_smem(xs) + xr0 * 128 + ((ch ^ (xr0 & 7)) << 4);
    }

    __device__ __forceinline__ void load_x(int step) {
        if (step >= S) return;
        const u32 dst = xdst + (step & (QM_XSTAGES - 1)) * XTILE;
        const unsigned short* dead = a + arow0 * K;  // a row past the routed ones reads nothing (zero-filled)
#pragma unroll
        for (int i = 0; i < 4 * MT; ++i) {
            const bool live = xr0 + 32 * i < rows;
            qm_cp16(dst + i * 32 * 128, live ? xsrc + i * xstride + step * QM_BK : dead, live ? 16u : 0u);
        }
    }

    __device__ __forceinline__ void decode_chunk(const Raw& r, const Scale& s, int c, int odd, char* bt) const {
        qm_decode(r, s, c, odd, part, bt, n);
    }

#if QM_WGMMA
    __device__ __forceinline__ void fence_acc() {
#pragma unroll
        for (int i = 0; i < MT * BN / 2; ++i) qm_keep(acc[i]);
    }

    // This warpgroup's wgmmas of a step (four k16 sub-steps 32 bytes apart in the swizzled rows, each for every
    // sub-tile with routed rows: a later sub-tile's rows only where the first's are all routed), committed.
    __device__ __forceinline__ void wg_issue(const char* xt, const char* bt) {
#ifdef QM_SKIP_MMA
        return;
#endif
        if (!active[0]) return;
        // a descriptor's address field is the byte address / 16 (no carry out of it below 256 KiB), so an offset
        // within the tile is added to the descriptor: the sub-step's 32 bytes (2), a sub-tile's 128 rows (1024)
        const unsigned long long da = qm_desc(qm_smem(xt) + 64 * wm * 128), db = qm_desc(qm_smem(bt));
        fence_acc();
        qm_wg_fence();
        if (MT == 1 || !active[MT - 1])  // (each sequence straight-line: a branch between wgmmas serializes them)
            wg_sub_tiles<1>(da, db);
        else
            wg_sub_tiles<MT>(da, db);
        qm_wg_commit();
    }

    template <int T>
    __device__ __forceinline__ void wg_sub_tiles(unsigned long long da, unsigned long long db) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
            for (int t = 0; t < T; ++t) qm_wgmma<BN>(acc + t * BN / 2, da + 2 * kk + 1024 * t, db + 2 * kk);
    }

    __device__ __forceinline__ void wg_wait() {
#ifdef QM_SKIP_MMA
        return;
#endif
        if (!active[0]) return;
        qm_wg_wait0();
        fence_acc();
    }
#else
    __device__ __forceinline__ int pair_row(int p) const {
        return SWIGLU ? (p >> 1) * 128 + 32 * wn + 16 * (p & 1) : 64 * wn + 16 * p;
    }

    // The MMAs of sub-step kk of the tile in xs stage xt and weight tile bt (BN 256).
    __device__ __forceinline__ void mma_sub(const char* xt, const char* bt, int kk) {
#ifdef QM_SKIP_MMA  // bench/quant_mma_h200.py's ablation: the loads and the decode alone
        return;
#endif
        if (!active[0]) return;
        u32 af[4][4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int r = 64 * wm + 16 * i + (lane & 15), ch = 2 * kk + (lane >> 4);
            qm_ldm4(qm_smem(xt + r * 128 + ((ch ^ (r & 7)) << 4)), af[i][0], af[i][1], af[i][2], af[i][3]);
        }
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            const int nn = pair_row(p) + (lane & 7) + ((lane >> 4) << 3), ch = 2 * kk + ((lane >> 3) & 1);
            u32 b0, b1, b2, b3;
            qm_ldm4(qm_smem(bt + nn * 128 + ((ch ^ (nn & 7)) << 4)), b0, b1, b2, b3);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                qm_mma(acc[i][2 * p], af[i], b0, b1);
                qm_mma(acc[i][2 * p + 1], af[i], b2, b3);
            }
        }
    }
#endif

    // Step k + D's index for the loads and the decode: super-block (k + D) / 4 (the last one past the end: what
    // it decodes there is never multiplied), quarter (KP + D) % 4 known at compile time, so the scales' six-bit
    // fields and the q6_k halves are picked by constant shifts, not by branches on a runtime quarter.
    template <int KP, int D>
    __device__ __forceinline__ int step_at(int k) const {
        return 4 * min((k >> 2) + ((KP + D) >> 2), (S >> 2) - 1) + ((KP + D) & 3);
    }

    // Step k (KP = k % 4): the MMAs over stage k, and the decode of step k + 1 into the other weight tile.
    template <int KP>
    __device__ __forceinline__ void step(int k) {
        constexpr int US = QmFmt<FMT, RT>::UNIT_SHIFT;
        qm_wait1();
#if QM_WGMMA
        qm_fence_async();
#endif
        __syncthreads();
        load_x(k + 2);
        qm_commit();
        const char* xt = xs + KP * XTILE;  // k % QM_XSTAGES
        const char* bt = bs + (KP & 1) * BTILE;
#ifndef QM_SKIP_DECODE  // the ablation of the MMAs and the input tiles alone (the weight tiles left as they are)
        // the raw unit of step k + 2 (q4_k) or of steps k + 2, k + 3 (q6_k, at even k) into the free buffer
        if (US == 0 || (KP & 1) == 0) {
            constexpr int buf = ((KP + 2) >> US) & 1;
            qm_load(raw[buf], wrow, step_at<KP, 2>(k), part);
        }
        constexpr int dbuf = ((KP + 1) >> US) & 1;  // the raw unit of step k + 1
        const int dstep = step_at<KP, 1>(k);
        char* bn = bs + ((KP + 1) & 1) * BTILE;
#if QM_WGMMA
        wg_issue(xt, bt);
        Scale s = qm_scales(raw[dbuf], dstep);
        // the 2^23 bytes read from shared memory after this step's barrier, not an immediate: every decode
        // instruction then depends on a load ptxas keeps below the barrier, so it cannot move a step's decode into
        // the step before (it did, once the quarter was a constant: all of a step's work in one step, none in the
        // next, so half the steps' MMAs ran with nothing beside them)
        s.mg = qm_ld_shared_u32(magic_at);
#pragma unroll
        for (int c = 0; c < CH; ++c) decode_chunk(raw[dbuf], s, c, dstep & 1, bn);
        wg_wait();
#else
        const Scale s = qm_scales(raw[dbuf], dstep);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            mma_sub(xt, bt, kk);
            decode_chunk(raw[dbuf], s, kk, dstep & 1, bn);
        }
#endif
#else
#if QM_WGMMA
        wg_issue(xt, bt);
        wg_wait();
#else
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) mma_sub(xt, bt, kk);
#endif
#endif
    }

    __device__ __forceinline__ void run() {
        init_x();
        load_x(0);
        qm_commit();
        load_x(1);
        qm_commit();
        qm_load(raw[0], wrow, 0, part);
        if (QmFmt<FMT, RT>::UNIT_SHIFT == 0) qm_load(raw[1], wrow, min(1, S - 1), part);
#if QM_WGMMA
#pragma unroll
        for (int i = 0; i < MT * BN / 2; ++i) acc[i] = 0.0f;
#else
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.0f;
#endif
        {
            const Scale s = qm_scales(raw[0], 0);
#pragma unroll
            for (int c = 0; c < CH; ++c) decode_chunk(raw[0], s, c, 0, bs);
        }
        for (int k = 0; k < S; k += 4) {
            step<0>(k);
            step<1>(k + 1);
            step<2>(k + 2);
            step<3>(k + 3);
        }
    }
};

// The expert of row tile blockIdx.y (BM rows a tile) and its first row (e = -1 past the last tile), by warp 0.
template <int BM>
__device__ __forceinline__ void qm_expert_of_tile(const int* counts, int e_lo, int e_hi, int* s_e, int* s_rin) {
    if (threadIdx.x >= 32) return;
    const int lane = threadIdx.x, tile = blockIdx.y;
    int base = 0, found = -1, rin = 0;
    for (int e0 = e_lo; e0 < e_hi; e0 += 32) {
        const int e = e0 + lane;
        const int t = e < e_hi ? (counts[e] + BM - 1) / BM : 0;
        int s = t;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(0xffffffffu, s, o);
            if (lane >= o) s += v;
        }
        const int total = __shfl_sync(0xffffffffu, s, 31);
        if (tile < base + total) {
            const int L = __ffs(__ballot_sync(0xffffffffu, tile < base + s)) - 1;
            const int excl = __shfl_sync(0xffffffffu, s - t, L);
            found = e0 + L;
            rin = (tile - base - excl) * BM;
            break;
        }
        base += total;
    }
    if (lane == 0) {
        *s_e = found;
        *s_rin = rin;
    }
}

template <int FMT, bool SWIGLU, int BN, int MT>
__device__ __forceinline__ void qm_kernel(const unsigned short* __restrict__ a, const unsigned char* __restrict__ blob,
                                          unsigned short* __restrict__ c, const int* __restrict__ counts,
                                          const int* __restrict__ row0, const int* __restrict__ slots, int N, int K,
                                          long long slot_bytes, long long mat_off, long long row_bytes, int e_lo,
                                          int e_hi) {
    QM_DYNAMIC_SHARED(qm_shared);
    __shared__ int s_e, s_rin;
    __shared__ u32 s_magic;
    typedef QmBlock<FMT, SWIGLU, BN, MT> B;
    qm_expert_of_tile<B::BM>(counts, e_lo, e_hi, &s_e, &s_rin);
    if (threadIdx.x == 0) s_magic = QM_MAGIC;
    __syncthreads();
    // broadcast from lane 0: values the compiler sees as warp-uniform, so the wgmma paths below are not divergent
    // (ptxas would otherwise serialize every wgmma, C7518, and the decode would not overlap the tensor cores)
    const int e = __shfl_sync(0xffffffffu, s_e, 0);
    if (e < 0) return;
    B blk;
    char* base = (char*)(((unsigned long long)qm_shared + 1023ull) & ~1023ull);
    blk.xs = base;
    blk.bs = base + QM_XSTAGES * B::XTILE;
    blk.a = a;
    blk.magic_at = qm_smem(&s_magic);
    blk.tid = threadIdx.x;
    blk.lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
#if QM_WGMMA
    blk.wm = warp >> 2;  // the warpgroup: rows 64 wm .. (of each 128 of the tile)
    blk.wn = warp & 3;   // the warp in it: rows 16 wn .. of those
#else
    blk.wm = warp & 1;
    blk.wn = warp >> 1;
#endif
    const int count = __shfl_sync(0xffffffffu, counts[e], 0);
    blk.rows = min(B::BM, count - __shfl_sync(0xffffffffu, s_rin, 0));
    blk.arow0 = (long long)row0[e] + s_rin;
    blk.K = K;
    blk.S = K / QM_BK;
#pragma unroll
    for (int t = 0; t < MT; ++t) blk.active[t] = __shfl_sync(0xffffffffu, 64 * (2 * t + blk.wm) < blk.rows, 0);
    // this thread's weight row of the tile (and its part of it): gate|up rows n0.. then the same up rows (F + n0..);
    // down rows n0..
    // (two threads a row: a warp's first 16 lanes take part 0 of its 16 rows, the rest part 1, so each quarter-warp
    // phase of a 16-byte tile store covers eight rows' same chunk, eight distinct banks after the swizzle; lanes
    // 2r, 2r + 1 on one row made every such store a 2-way conflict)
    blk.n = B::RT == 1 ? threadIdx.x : (threadIdx.x >> 5) * 16 + (threadIdx.x & 15);
    blk.part = B::RT == 1 ? 0 : (threadIdx.x >> 4) & 1;
    const int n = blk.n, half = BN / 2;
    const long long wr = SWIGLU ? (n < half ? (long long)blockIdx.x * half + n : (long long)N + blockIdx.x * half + n - half)
                                : (long long)blockIdx.x * BN + n;
    blk.wrow = blob + (long long)slots[e] * slot_bytes + mat_off + wr * row_bytes;
    blk.run();
    if (!blk.active[0]) return;
    const int lane = blk.lane;
#if QM_WGMMA
#pragma unroll
    for (int t = 0; t < MT; ++t) {
        const float* acc = blk.acc + t * BN / 2;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int r = 64 * (2 * t + blk.wm) + 16 * blk.wn + (lane >> 2) + 8 * hh;
            if (r >= blk.rows) continue;
            unsigned short* out = c + (blk.arow0 + r) * N;
            if (SWIGLU) {
#pragma unroll
                for (int j = 0; j < BN / 16; ++j) {
                    const float* g = acc + 4 * j + 2 * hh;
                    *(u32*)(out + blockIdx.x * half + 8 * j + 2 * (lane & 3)) = qm_swiglu(g, g + BN / 4);
                }
            } else {
#pragma unroll
                for (int j = 0; j < BN / 8; ++j)
                    *(u32*)(out + blockIdx.x * BN + 8 * j + 2 * (lane & 3)) =
                        qm_pack(acc[4 * j + 2 * hh], acc[4 * j + 2 * hh + 1]);
            }
        }
    }
#else
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int r = 64 * blk.wm + 16 * i + (lane >> 2) + 8 * hh;
            if (r >= blk.rows) continue;
            unsigned short* out = c + (blk.arow0 + r) * N;
            if (SWIGLU) {
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int col = blockIdx.x * 128 + 32 * blk.wn + 8 * j + 2 * (lane & 3);
                    *(u32*)(out + col) = qm_swiglu(&blk.acc[i][j][2 * hh], &blk.acc[i][j + 4][2 * hh]);
                }
            } else {
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const int col = blockIdx.x * 256 + 64 * blk.wn + 8 * j + 2 * (lane & 3);
                    *(u32*)(out + col) = qm_pack(blk.acc[i][j][2 * hh], blk.acc[i][j][2 * hh + 1]);
                }
            }
        }
    }
#endif
}

#define QM_ENTRY(NAME, FMT, SWIGLU, BN, MT, MINB)                                                                    \
    extern "C" __global__ void __launch_bounds__(QM_THREADS, MINB)                                                  \
        NAME(const unsigned short* a, const unsigned char* blob, unsigned short* c, const int* counts,              \
             const int* row0, const int* slots, int N, int K, long long slot_bytes, long long mat_off,              \
             long long row_bytes, int e_lo, int e_hi) {                                                             \
        qm_kernel<FMT, SWIGLU, BN, MT>(a, blob, c, counts, row0, slots, N, K, slot_bytes, mat_off, row_bytes, e_lo,\
                                       e_hi);                                                                       \
    }

// 128 input rows x 256 weight rows a block (one block an SM); on sm_90a also 128 x 128 (two blocks an SM) and
// 256 x 128 (one block an SM, each weight decoded for twice the rows: half the decode per MMA)
QM_ENTRY(strata_qm_gate_up_q4_k, QM_Q4_K, true, 256, 1, 1)
QM_ENTRY(strata_qm_gate_up_q6_k, QM_Q6_K, true, 256, 1, 1)
QM_ENTRY(strata_qm_down_q4_k, QM_Q4_K, false, 256, 1, 1)
QM_ENTRY(strata_qm_down_q6_k, QM_Q6_K, false, 256, 1, 1)
#if QM_WGMMA
QM_ENTRY(strata_qm128_gate_up_q4_k, QM_Q4_K, true, 128, 1, 2)
QM_ENTRY(strata_qm128_gate_up_q6_k, QM_Q6_K, true, 128, 1, 2)
QM_ENTRY(strata_qm128_down_q4_k, QM_Q4_K, false, 128, 1, 2)
QM_ENTRY(strata_qm128_down_q6_k, QM_Q6_K, false, 128, 1, 2)
QM_ENTRY(strata_qm128_m256_gate_up_q4_k, QM_Q4_K, true, 128, 2, 1)
QM_ENTRY(strata_qm128_m256_gate_up_q6_k, QM_Q6_K, true, 128, 2, 1)
QM_ENTRY(strata_qm128_m256_down_q4_k, QM_Q4_K, false, 128, 2, 1)
QM_ENTRY(strata_qm128_m256_down_q6_k, QM_Q6_K, false, 128, 2, 1)
#endif
