"""The KernelSet of the cuda and rocm backends: strata_cuda/moe.cu through cupy.RawModule, GEMMs in the BLAS.

Device arrays are cupy arrays; an ExpertPool's arrays are cupy arrays. Kernels run on cupy's current stream.
moe_grouped_ffn is gather-pad-batched-GEMM: the active groups' expert weights are copied (f16) or dequantized
(Q8_0) into a contiguous f16 scratch, the rows are packed into a [groups, largest group, H] f16 stack per bucket of
similar-sized groups (grouping.py), and two strided batched GEMMs (f16 inputs, f32 accumulation and output) run the
experts. Each step is its own method so a
faster path (a grouped GEMM without padding, a fused decode kernel) can replace one step at a time.
cupy is imported inside the constructor: this module imports without it.
"""

from __future__ import annotations

from importlib.resources import files
from typing import Any

import numpy as np

from strata_core.reference.kernels import QK8_0, ExpertPool

from .grouping import GroupLayout, group_layouts

SOURCE_NAME = "moe.cu"
#: NVRTC and hiprtc options; no defines: the source is portable as it stands (see its header).
COMPILE_OPTIONS = ("-std=c++17",)
KERNEL_NAMES = ("strata_route_topk", "strata_gather_f32", "strata_scatter_add_f32", "strata_dequantize_q8_0",
                "strata_dequantize_q8_0_slots", "strata_rmsnorm_f32", "strata_pack_rows_f16", "strata_swiglu_f16",
                "strata_unpack_rows_f32", "strata_gemv_f16w_f32", "strata_widen_f16_f32")
#: Block sizes fixed by the source (STRATA_ROUTE_THREADS, STRATA_NORM_THREADS, STRATA_MAX_TOPK).
ROUTE_THREADS = 128
NORM_THREADS = 256
MAX_TOPK = 64
#: Threads per block and the most blocks of the grid-stride kernels (more blocks than this only add scheduling).
STRIDE_THREADS = 256
STRIDE_MAX_BLOCKS = 65535
#: Output rows per block of the f16-weight GEMV (STRATA_GEMV_ROWS in the source), and the most rows of x it takes:
#: above that the weights are read too many times and the BLAS (on an f32 copy of them) is faster.
GEMV_ROWS = 8
GEMV_THREADS = 256
GEMV_MAX_T = 8


#: Greedy decode on the device (strata_core.runtime.executor's pipelined loop through CudaLayerOps): the token as the
#: argmax of the LM head's f32 logits, and the next step's residual as its embedding row, so a step is queued before
#: the host has read the token. Kept to moe.cu's portability rules (no headers, no warp intrinsics, reductions through
#: shared memory); one block per launch.
GREEDY_SOURCE = r"""
#define STRATA_GREEDY_THREADS 256
#define STRATA_NO_ID 0x7fffffff

// np.argmax's order: a NaN beats every number (the first NaN wins), else the larger value, ties to the lower index
__device__ inline bool strata_greedy_better(float a, int ia, float b, int ib) {
    if (ia == STRATA_NO_ID) return false;
    if (ib == STRATA_NO_ID) return true;
    const bool na = a != a, nb = b != b;
    if (na || nb) return na && nb ? ia < ib : na;
    if (a != b) return a > b;
    return ia < ib;
}

// the block's best (value, index) of what each thread holds, into (sv[0], si[0]); blockDim.x a power of two
__device__ inline void strata_greedy_block_best(float* sv, int* si, float best, int bi) {
    sv[threadIdx.x] = best;
    si[threadIdx.x] = bi;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s && strata_greedy_better(sv[threadIdx.x + s], si[threadIdx.x + s], sv[threadIdx.x],
                                                    si[threadIdx.x])) {
            sv[threadIdx.x] = sv[threadIdx.x + s];
            si[threadIdx.x] = si[threadIdx.x + s];
        }
        __syncthreads();
    }
}

// pass 1 of np.argmax over v[0..n): block b takes the b-th of gridDim.x contiguous ranges, its best into
// (part_v[b], part_i[b]) (index STRATA_NO_ID for an empty range)
extern "C" __global__ void strata_argmax_part_f32(const float* v, int n, float* part_v, int* part_i) {
    __shared__ float sv[STRATA_GREEDY_THREADS];
    __shared__ int si[STRATA_GREEDY_THREADS];
    const int per = (n + gridDim.x - 1) / gridDim.x;
    const int lo = blockIdx.x * per;
    const int hi = lo + per < n ? lo + per : n;
    float best = 0.0f;
    int bi = STRATA_NO_ID;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const float x = v[i];
        if (strata_greedy_better(x, i, best, bi)) { best = x; bi = i; }
    }
    strata_greedy_block_best(sv, si, best, bi);
    if (threadIdx.x == 0) {
        part_v[blockIdx.x] = sv[0];
        part_i[blockIdx.x] = si[0];
    }
}

// pass 2: out[0] = the best of the parts (one block); 0 when every part was empty (n == 0)
extern "C" __global__ void strata_argmax_final_f32(const float* part_v, const int* part_i, int parts, int* out) {
    __shared__ float sv[STRATA_GREEDY_THREADS];
    __shared__ int si[STRATA_GREEDY_THREADS];
    float best = 0.0f;
    int bi = STRATA_NO_ID;
    for (int p = threadIdx.x; p < parts; p += blockDim.x) {
        if (strata_greedy_better(part_v[p], part_i[p], best, bi)) { best = part_v[p]; bi = part_i[p]; }
    }
    strata_greedy_block_best(sv, si, best, bi);
    if (threadIdx.x == 0) out[0] = si[0] == STRATA_NO_ID ? 0 : si[0];
}

// out[r, 0..h) = the f16 row tok[r] of table [V, h] widened to f32 (bit-exact, as moe.cu's strata_h2f), r =
// blockIdx.y (one row: the greedy step's; a chunk's rows: the prefill's embedding); the table may be device memory or
// page-locked host memory mapped at its host address
extern "C" __global__ void strata_embed_row_f16(const unsigned short* table, const int* tok, int h, float* out) {
    const unsigned short* row = table + (long long)tok[blockIdx.y] * h;
    out += (long long)blockIdx.y * h;
    for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < h; j += gridDim.x * blockDim.x) {
        const unsigned int x = row[j];
        const unsigned int sign = (x & 0x8000u) << 16, e = (x >> 10) & 0x1fu, m = x & 0x3ffu;
        float f;
        if (e == 0u) {
            f = (float)m * 5.9604644775390625e-8f;
            f = sign ? -f : f;
        } else if (e == 31u) {
            f = __uint_as_float(sign | 0x7f800000u | (m << 13));
        } else {
            f = __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
        }
        out[j] = f;
    }
}
"""
GREEDY_KERNEL_NAMES = ("strata_argmax_part_f32", "strata_argmax_final_f32", "strata_embed_row_f16")
#: Threads of every greedy kernel's blocks (STRATA_GREEDY_THREADS in GREEDY_SOURCE), and the argmax's first-pass
#: blocks (contiguous ranges of the vocabulary: 151936 logits are 1187 a block, under 5 loads a thread).
GREEDY_THREADS = 256
ARGMAX_PARTS = 128
EMBED_THREADS = 256
#: Rows of one embedding launch (CUDA's grid limit in y)
EMBED_GRID_Y = 65535


class GreedyKernels:
    """GREEDY_SOURCE compiled once (at construction), launched on cupy's current stream with raw addresses; the
    argmax's per-block partial results live in two small device arrays made here."""

    def __init__(self) -> None:
        import cupy
        self._cp = cupy
        module = cupy.RawModule(code=GREEDY_SOURCE, options=COMPILE_OPTIONS)
        self._k = {n: module.get_function(n) for n in GREEDY_KERNEL_NAMES}
        self._part_v = cupy.empty(ARGMAX_PARTS, dtype=cupy.float32)
        self._part_i = cupy.empty(ARGMAX_PARTS, dtype=cupy.int32)

    def argmax(self, logits_ptr: int, n: int, out_ptr: int) -> None:
        """int32 at out_ptr = np.argmax of the n f32 values at logits_ptr (device addresses), in two launches."""
        self._k["strata_argmax_part_f32"]((ARGMAX_PARTS,), (GREEDY_THREADS,),
                                          (np.uint64(logits_ptr), np.int32(n), self._part_v, self._part_i))
        self._k["strata_argmax_final_f32"]((1,), (GREEDY_THREADS,),
                                           (self._part_v, self._part_i, np.int32(ARGMAX_PARTS), np.uint64(out_ptr)))

    def embed_rows(self, table_ptr: int, tok_ptr: int, rows: int, hidden: int, out_ptr: int) -> None:
        """rows x hidden f32 at out_ptr = the f16 rows (rows int32 at tok_ptr) of the [V, hidden] table at table_ptr."""
        blocks = max(1, min(64, (int(hidden) + EMBED_THREADS - 1) // EMBED_THREADS))
        for r0 in range(0, int(rows), EMBED_GRID_Y):
            n = min(EMBED_GRID_Y, int(rows) - r0)
            self._k["strata_embed_row_f16"]((blocks, n), (EMBED_THREADS,),
                                            (np.uint64(table_ptr), np.uint64(tok_ptr + 4 * r0), np.int32(hidden),
                                             np.uint64(out_ptr + 4 * r0 * int(hidden))))

    def embed_row(self, table_ptr: int, tok_ptr: int, hidden: int, out_ptr: int) -> None:
        """hidden f32 at out_ptr = f16 row (int32 at tok_ptr) of the [V, hidden] table at table_ptr."""
        blocks = max(1, min(64, (int(hidden) + EMBED_THREADS - 1) // EMBED_THREADS))
        self._k["strata_embed_row_f16"]((blocks,), (EMBED_THREADS,),
                                        (np.uint64(table_ptr), np.uint64(tok_ptr), np.int32(hidden),
                                         np.uint64(out_ptr)))


def kernel_source() -> str:
    """The text of strata_cuda/moe.cu."""
    return files("strata_cuda").joinpath(SOURCE_NAME).read_text()


def nvrtc_compile(text: str, name: str, options: tuple[str, ...], cubin: bool = False,
                  log: list[str] | None = None) -> bytes:
    """CUDA C `text` (called `name` in messages) compiled by NVRTC with `options` (the -arch one included) to PTX, or
    to a cubin; no GPU needed; NVRTC's log (ptxas's notes included) appended to `log` if given. RuntimeError with
    that log on failure."""
    from cupy_backends.cuda.libs import nvrtc
    prog = nvrtc.createProgram(text, name, (), ())
    try:
        try:
            nvrtc.compileProgram(prog, tuple(options))
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"NVRTC failed on {name} ({e}):\n{nvrtc.getProgramLog(prog)}") from None
        if log is not None:
            log.append(str(nvrtc.getProgramLog(prog)).replace("\x00", ""))
        return nvrtc.getCUBIN(prog) if cubin else nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)


def compile_to_ptx(arch: str = "compute_90", options: tuple[str, ...] = COMPILE_OPTIONS,
                   defines: tuple[str, ...] = (), source: str | None = None) -> bytes:
    """Compile moe.cu (or `source`) to PTX with NVRTC (no GPU needed); raises RuntimeError with NVRTC's log."""
    return nvrtc_compile(kernel_source() if source is None else source, SOURCE_NAME,
                         (f"-arch={arch}", *options, *(f"-D{d}" for d in defines)))


class CupyKernels:
    """KernelSet on a CUDA or ROCm device through cupy (see the module docstring for the grouped FFN's structure)."""

    #: the grouped FFN packs rows and intermediates as f16 (f32 accumulation); every other kernel is f32
    precision = {"moe_grouped_ffn": "f16"}

    def __init__(self, device_index: int = 0, name: str = "cupy-moe.cu", fast_grouped_ffn: bool = False):
        import cupy
        from cupy.cuda import runtime
        self._cp = cupy
        self._rt = runtime
        self.name = name
        #: route moe_grouped_ffn through strata_cuda.fast (cuBLAS strided-batched GEMMs over slot runs, CUDA only)
        self.fast_grouped_ffn = fast_grouped_ffn
        self._fast: dict[tuple[int, int], Any] = {}
        #: the session's page-locked allocator (backend.open sets it): the grouped FFN's fast paths take their staging
        #: from it, so the plan's pinned budget counts it
        self.pinned: Any = None
        cupy.cuda.Device(device_index).use()
        self._module = cupy.RawModule(code=kernel_source(), options=COMPILE_OPTIONS)
        # compile now, so a broken toolchain fails at start-up and not in the middle of a request
        self._k = {n: self._module.get_function(n) for n in KERNEL_NAMES}

    # -- launch helpers ---------------------------------------------------------------------------------------

    def _stride_launch(self, name: str, n_items: int, args: tuple) -> None:
        if n_items <= 0:
            return
        blocks = min(STRIDE_MAX_BLOCKS, (n_items + STRIDE_THREADS - 1) // STRIDE_THREADS)
        self._k[name]((blocks,), (STRIDE_THREADS,), args)

    def _as(self, a: Any, dtype: Any) -> Any:
        """A C-contiguous cupy array of `dtype` (no copy when `a` already is one; host arrays are uploaded)."""
        return self._cp.ascontiguousarray(self._cp.asarray(a, dtype=dtype))

    def _f32(self, a: Any) -> Any:
        return self._as(a, self._cp.float32)

    def _i32(self, a: Any) -> Any:
        return self._as(a, self._cp.int32)

    # -- the KernelSet ----------------------------------------------------------------------------------------

    def route_topk(self, logits: Any, k: int) -> tuple[Any, Any]:
        """[T,E] f32 router logits -> (ids [T,k] int32 by descending logit, ties to the lower id; weights [T,k] f32)."""
        logits = self._f32(logits)
        t, e = logits.shape
        if not 0 < k <= min(e, MAX_TOPK):
            raise ValueError(f"route_topk: k={k} must lie in [1, min(E={e}, {MAX_TOPK})]")
        ids = self._cp.empty((t, k), dtype=self._cp.int32)
        weights = self._cp.empty((t, k), dtype=self._cp.float32)
        if t:
            self._k["strata_route_topk"]((t,), (ROUTE_THREADS,),
                                         (logits, np.int32(t), np.int32(e), np.int32(k), ids, weights))
        return ids, weights

    def gather(self, x: Any, rows: Any) -> Any:
        """x [T,H], rows [N] int32 -> x[rows] [N,H] (f32 through the kernel, other dtypes through cupy.take)."""
        rows = self._i32(rows).reshape(-1)
        if x.dtype != self._cp.float32:
            return self._cp.take(self._cp.asarray(x), rows, axis=0)
        x = self._as(x, self._cp.float32)
        h = int(x.shape[1])
        out = self._cp.empty((rows.shape[0], h), dtype=self._cp.float32)
        self._stride_launch("strata_gather_f32", rows.shape[0] * h,
                            (x, rows, np.int64(rows.shape[0]), np.int32(h), out))
        return out

    def scatter_add(self, out: Any, rows: Any, y: Any, scale: Any) -> None:
        """out[rows[i]] += scale[i] * y[i] in place (out [T,H] f32 and C-contiguous; rows may repeat), deterministic."""
        if out.dtype != self._cp.float32 or not out.flags.c_contiguous:
            raise ValueError("scatter_add: out must be a C-contiguous float32 array")
        rows = self._i32(rows).reshape(-1)
        y = self._f32(y)
        scale = self._f32(scale).reshape(-1)
        n, h = int(rows.shape[0]), int(out.shape[1])
        if y.shape != (n, h) or scale.shape[0] != n:
            raise ValueError(f"scatter_add: y {y.shape} and scale {scale.shape} must match {n} rows of {h}")
        if n == 0:
            return
        cp = self._cp
        t = int(out.shape[0])
        # sort by (row, position): the keys are unique, so every sort gives this one permutation, and each output
        # row's contributions are then summed by one thread in ascending position (no atomics, same bits each run)
        order = cp.argsort(rows.astype(cp.int64) * n + cp.arange(n, dtype=cp.int64)).astype(cp.int32)
        seg = cp.searchsorted(rows[order], cp.arange(t + 1, dtype=cp.int32)).astype(cp.int32)
        self._stride_launch("strata_scatter_add_f32", t * h, (out, order, seg, y, scale, np.int64(t), np.int32(h)))

    def dequantize_q8_0(self, qs: Any, d: Any) -> Any:
        """Q8_0 blocks (qs [.., C] int8, d [.., C/32] f16) -> [.., C] f16, bit-exact with the reference."""
        qs = self._as(qs, self._cp.int8)
        d = self._as(d, self._cp.float16)
        if qs.shape[-1] % QK8_0 or d.size * QK8_0 != qs.size:
            raise ValueError(f"dequantize_q8_0: qs {qs.shape} and d {d.shape} are not Q8_0 blocks of {QK8_0}")
        out = self._cp.empty(qs.shape, dtype=self._cp.float16)
        self._stride_launch("strata_dequantize_q8_0", int(qs.size), (qs, d, np.int64(qs.size), out))
        return out

    def _out(self, out: Any, shape: tuple[int, ...]) -> Any:
        """The caller's output buffer (a C-contiguous f32 device array of this shape), or a new one."""
        if out is None:
            return self._cp.empty(shape, dtype=self._cp.float32)
        if tuple(out.shape) != tuple(shape) or out.dtype != self._cp.float32 or not out.flags.c_contiguous:
            raise ValueError(f"out must be a C-contiguous float32 array of shape {shape} (got {out.shape} "
                             f"{out.dtype})")
        return out

    def rmsnorm(self, x: Any, w: Any, eps: float = 1e-6, out: Any = None) -> Any:
        """[T,H] f32, w [H] -> x / rms(x) * w, f32 (into `out` when given)."""
        x = self._f32(x)
        w = self._f32(w).reshape(-1)
        t, h = x.shape
        out = self._out(out, (t, h))
        if t:
            self._k["strata_rmsnorm_f32"]((t,), (NORM_THREADS,),
                                          (x, w, np.int32(t), np.int32(h), np.float32(eps), out))
        return out

    def linear(self, x: Any, w: Any, out: Any = None) -> Any:
        """x [T,H] f32, w [O,H] f16 or f32 -> x w^T [T,O] f32 (into `out` when given); cuBLAS / hipBLAS in f32, and
        a few rows of x against f16 weights through strata_gemv_f16w_f32, which reads the f16 bytes once instead of
        widening them into an f32 copy."""
        cp = self._cp
        x = self._f32(x)
        t, o = int(x.shape[0]), int(w.shape[0])
        out = self._out(out, (t, o))
        if (getattr(w, "dtype", None) == cp.float16 and isinstance(w, cp.ndarray) and w.flags.c_contiguous
                and x.ndim == 2 and 0 < t <= GEMV_MAX_T and x.shape[1] % 8 == 0 and w.shape[1] == x.shape[1]
                and w.data.ptr % 16 == 0 and x.data.ptr % 16 == 0):
            if o:
                self._k["strata_gemv_f16w_f32"]((-(-o // GEMV_ROWS), t), (GEMV_THREADS,),
                                                (x, w, np.int32(o), np.int32(int(x.shape[1])), out))
            return out
        return cp.matmul(x, cp.asarray(w, dtype=cp.float32).T, out=out)

    def moe_grouped_ffn(self, x: Any, offsets: Any, slots: Any, weights: ExpertPool) -> Any:
        """SwiGLU experts over token groups: rows offsets[g]:offsets[g+1] of x [N,H] f32 run slot slots[g] -> [N,H] f32.

        offsets and slots may be numpy or cupy arrays; the group sizes are read on the host (a small copy).
        """
        if weights.dtype == "gguf":  # GGUF rows, dequantized per tile inside moe_quant.cu's GEMMs (issue 14)
            if getattr(self, "_quant", None) is None:
                from .quant_ffn import QuantGroupedFFN
                self._quant = QuantGroupedFFN(self._cp, pinned=self.pinned)
            return self._quant(x, offsets, slots, weights)
        fast = self._fast_path(weights)
        if fast is not None:
            return fast.grouped_ffn(x, offsets, slots, weights)
        x = self._f32(x)
        n, h = x.shape
        y = self._cp.zeros((n, h), dtype=self._cp.float32)
        for layout in group_layouts(_host(offsets), _host(slots), n_rows=n, n_slots=weights.slots):
            self._run_layout(x, layout, weights, y)
        return y

    def _fast_path(self, pool: ExpertPool) -> Any:
        """The FastMoE for this pool's shape, or None where it does not apply (ROCm, shapes off its 32-grid)."""
        if not self.fast_grouped_ffn:
            return None
        a = pool.arrays["w_down" if pool.dtype == "f16" else "down_q"]
        h, f = int(a.shape[1]), int(a.shape[2])
        if h % QK8_0 or f % QK8_0:
            return None
        if (h, f) not in self._fast:
            from .fast import FastMoE
            self._fast[(h, f)] = FastMoE(experts=8, top_k=1, hidden=h, ffn=f, pinned=self.pinned)
        return self._fast[(h, f)]

    # -- grouped FFN steps ------------------------------------------------------------------------------------

    def _run_layout(self, x: Any, layout: GroupLayout, pool: ExpertPool, y: Any) -> None:
        """Run one bucket of groups: pack rows, gate/up GEMM, SwiGLU, down GEMM, unpack into y."""
        cp = self._cp
        h = int(x.shape[1])
        w13, w2 = self._expert_weights_f16(pool, cp.asarray(layout.slots))
        b, per, f = layout.batches, layout.rows_per_batch, int(w2.shape[2])
        row_map = cp.asarray(layout.row_of_padded)
        xp = cp.empty((b, per, h), dtype=cp.float16)
        self._stride_launch("strata_pack_rows_f16", b * per * h, (x, row_map, np.int64(b * per), np.int32(h), xp))
        gu = cp.empty((b, per, 2 * f), dtype=cp.float32)
        self._batched_gemm_f16_f32(w13, xp, gu)
        hidden = cp.empty((b, per, f), dtype=cp.float16)
        self._stride_launch("strata_swiglu_f16", b * per * f, (gu, np.int64(b * per), np.int32(f), hidden))
        yp = cp.empty((b, per, h), dtype=cp.float32)
        self._batched_gemm_f16_f32(w2, hidden, yp)
        self._stride_launch("strata_unpack_rows_f32", b * per * h, (yp, row_map, np.int64(b * per), np.int32(h), y))

    def _expert_weights_f16(self, pool: ExpertPool, slots: Any) -> tuple[Any, Any]:
        """(w_gate_up [B,2F,H], w_down [B,H,F]) f16 and contiguous for the B slots picked."""
        a = pool.arrays
        if pool.dtype == "f16":
            return (self._cp.take(a["w_gate_up"], slots, axis=0), self._cp.take(a["w_down"], slots, axis=0))
        if pool.dtype == "q8_0":
            return (self._dequantize_slots(a["gate_up_q"], a["gate_up_d"], slots),
                    self._dequantize_slots(a["down_q"], a["down_d"], slots))
        raise ValueError(f"moe_grouped_ffn: unknown expert dtype {pool.dtype!r}")

    def _dequantize_slots(self, qs: Any, d: Any, slots: Any) -> Any:
        qs = self._as(qs, self._cp.int8)
        d = self._as(d, self._cp.float16)
        per_slot = int(np.prod(qs.shape[1:]))
        out = self._cp.empty((int(slots.shape[0]), *qs.shape[1:]), dtype=self._cp.float16)
        self._stride_launch("strata_dequantize_q8_0_slots", int(out.size),
                            (qs, d, slots, np.int32(slots.shape[0]), np.int64(per_slot), out))
        return out

    def _batched_gemm_f16_f32(self, a: Any, b: Any, c: Any) -> None:
        """c[g] = b[g] @ a[g]^T for every g: a [G,N,K] f16, b [G,M,K] f16, c [G,M,N] f32 (f32 accumulation)."""
        from cupy.cuda import cublas, device
        g, n, k = (int(s) for s in a.shape)
        m = int(b.shape[1])
        one = np.ones(1, dtype=np.float32)
        zero = np.zeros(1, dtype=np.float32)
        # row-major c[M,N] = b a^T is column-major c^T[N,M] = op(a^T stored) * b^T stored: A transposed, B not
        cublas.gemmStridedBatchedEx(
            device.get_cublas_handle(), cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, n, m, k,
            one.ctypes.data, a.data.ptr, self._rt.CUDA_R_16F, k, n * k,
            b.data.ptr, self._rt.CUDA_R_16F, k, m * k,
            zero.ctypes.data, c.data.ptr, self._rt.CUDA_R_32F, n, m * n,
            g, cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)


def _host(a: Any) -> np.ndarray:
    """A small index array on the host (cupy arrays are copied down; numpy and lists pass through)."""
    get = getattr(a, "get", None)
    return np.asarray(get() if callable(get) else a)
