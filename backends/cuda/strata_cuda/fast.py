"""The fast MoE paths on a CUDA (or ROCm) device: strata_core/kernels/moe_fast.cu through cupy, GEMMs in cuBLAS.

`FastMoE` runs one MoE layer three ways, each on ExpertPool-layout device arrays, so the runtime's KernelSet and
executor can call it with the cache's own pool, slot maps and lent ring slots:
- `prefill_layer`: route on the device, one small host sync for the per-expert row counts, then the rows gathered
  into a padded [groups, Mpad, H] f16 stack, two strided batched GEMMs per run of consecutive slots (f16 in, f32
  accumulation) with a SwiGLU kernel between, and a deterministic per-token combine. Missed experts stream from
  page-locked host memory through ring slots of the same pool on a copy stream, several experts per copy (large
  groups first, small ones last, so little compute is left once the last byte lands), while the compute stream
  runs the hits and every group whose copy has landed (events, no host waits). Q8_0 experts are copied as quants
  and scales (about half the bytes) and dequantized on the compute stream into f16 scratch.
- `decode_layer`: one token, every routed expert cached: two kernels (route + gate/up GEMV + SwiGLU, then the
  down GEMV over all top-k experts), routing and slot look-up on the device, no host sync; `capture_decode`
  records the two launches as a CUDA graph.
- `decode_layer_misses`: one token with misses: the first kernel routes and runs the cached experts, the ids
  come to the host (one sync), the misses' gate/up then down matrices are copied into ring slots (two events),
  the device slot map is patched, the first kernel fills the missed experts' rows as soon as their gate/up
  matrices land and the down kernel runs when the rest has landed.
cupy is imported inside the constructor: this module imports without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.resources import files
from typing import Any, Sequence

import numpy as np

from strata_core.kernels.reference import QK8_0, ExpertPool

SOURCE_NAME = "moe_fast.cu"
COMPILE_OPTIONS = ("-std=c++17",)
KERNEL_NAMES = ("strata_fast_route_count", "strata_fast_gather", "strata_fast_swiglu", "strata_fast_combine",
                "strata_fast_dequant_q8_0", "strata_fast_decode_gate_up", "strata_fast_decode_down")
#: Threads per block of every kernel (STRATA_FAST_THREADS in the source).
THREADS = 256
#: Lanes of a warp on CUDA; the top-k keeps 8 logits per lane in registers, so E <= 8 * warp.
WARP_LANES = 32
TOPK_PER_LANE = 8
MAX_TOPK = 16
#: Most blocks of the grid-stride kernels: more only adds scheduling.
STRIDE_MAX_BLOCKS = 8192
#: FFN rows per warp of the decode gate/up kernel (STRATA_DEC_ROWS in the source).
DECODE_ROWS_PER_WARP = 2
#: cuBLAS / CUDA enums (cublas_api.h, library_types.h): fixed by the ABI.
_CUBLAS_OP_N, _CUBLAS_OP_T = 0, 1
_CUDA_R_16F = 2
_CUBLAS_COMPUTE_32F = 68
_CUBLAS_GEMM_DEFAULT = -1
_CUBLAS_POINTER_MODE_HOST = 0
_MEMCPY_H2D = 1
#: Rows of a padded group are rounded up to this, so every row of the f16 stacks starts 16-byte aligned whatever
#: the widths, and cuBLAS sees tidy leading dimensions.
ROW_ALIGN = 8


def kernel_source() -> str:
    """The text of strata_core/kernels/moe_fast.cu."""
    return files("strata_core.kernels").joinpath(SOURCE_NAME).read_text()


def compile_to_ptx(arch: str = "compute_90") -> bytes:
    """Compile moe_fast.cu to PTX with NVRTC (no GPU needed); raises RuntimeError with NVRTC's log on failure."""
    from cupy_backends.cuda.libs import nvrtc
    prog = nvrtc.createProgram(kernel_source(), SOURCE_NAME, (), ())
    try:
        try:
            nvrtc.compileProgram(prog, (f"-arch={arch}", *COMPILE_OPTIONS))
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"NVRTC failed on {SOURCE_NAME} ({e}):\n{nvrtc.getProgramLog(prog)}") from None
        return nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)


def slot_runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """Split a list of slots (in the order given) into runs of consecutive slots: (first index, first slot, length)."""
    runs: list[tuple[int, int, int]] = []
    for i, s in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == s:
            a, b, n = runs[-1]
            runs[-1] = (a, b, n + 1)
        else:
            runs.append((i, int(s), 1))
    return runs


@dataclass
class LayerStats:
    """What the last layer did: experts used, hits, misses, bytes streamed, padded rows per group."""

    experts_used: int = 0
    hits: int = 0
    misses: int = 0
    bytes_streamed: int = 0
    mpad_rows: int = 0
    routed_rows_hit: int = 0
    routed_rows: int = 0


class FastMoE:
    """Fast MoE layer paths for one shape (E experts, top-k, hidden H, FFN F) on the current cupy device."""

    def __init__(self, experts: int, top_k: int, hidden: int, ffn: int, group_experts: int = 8,
                 hit_batch_experts: int = 0):
        import cupy
        from cupy.cuda import runtime
        from cupy_backends.cuda.libs import cublas
        self._cp = cupy
        self._rt = runtime
        self._cublas = cublas
        if hidden % 8 or ffn % 8 or hidden % QK8_0 or ffn % QK8_0:
            raise ValueError(f"FastMoE needs hidden and ffn to be multiples of {QK8_0} (got {hidden}, {ffn})")
        if experts > TOPK_PER_LANE * WARP_LANES or not 0 < top_k <= min(MAX_TOPK, experts):
            raise ValueError(f"FastMoE routes at most {TOPK_PER_LANE * WARP_LANES} experts and top-k <= {MAX_TOPK}")
        self.experts, self.top_k, self.hidden, self.ffn = experts, top_k, hidden, ffn
        #: most experts per streamed copy group (the ring must hold 4 groups for it; smaller rings take smaller)
        self.group_experts = int(group_experts)
        #: most cached experts per batched GEMM (0: a whole run of consecutive slots in one GEMM)
        self.hit_batch_experts = int(hit_batch_experts)
        #: when a list, prefill_layer appends (name, stream, event) at its stages; trace_report() reads them
        self.trace: list | None = None
        self._module = cupy.RawModule(code=kernel_source(), options=COMPILE_OPTIONS)
        self._k = {n: self._module.get_function(n) for n in KERNEL_NAMES}
        self.compute_stream = cupy.cuda.Stream(non_blocking=True)
        self.copy_stream = cupy.cuda.Stream(non_blocking=True)
        self._handle = cupy.cuda.device.get_cublas_handle()
        # alpha/beta live on the host for the whole life of the object: cuBLAS reads them at enqueue time
        self._one = np.ones(1, dtype=np.float32)
        self._zero = np.zeros(1, dtype=np.float32)
        # page-locked staging for the tiny host->device tables (block map, slot map), so their copies are async
        self._stage = cupy.cuda.alloc_pinned_memory(4 * 4 * max(experts, 64))
        self._stage_np = np.frombuffer(self._stage, dtype=np.int32, count=4 * max(experts, 64))
        self._ids_host_mem = cupy.cuda.alloc_pinned_memory(4 * MAX_TOPK)
        self._ids_host = np.frombuffer(self._ids_host_mem, dtype=np.int32, count=MAX_TOPK)
        self.stats = LayerStats()

    # -- small helpers -----------------------------------------------------------------------------------------

    def _gemm_tn(self, m: int, n: int, k: int, a: int, lda: int, sa: int, b: int, ldb: int, sb: int,
                 c: int, ldc: int, sc: int, batch: int) -> None:
        """Column-major C[m,n] = A^T B per batch item (row-major: C_rows = B_rows @ A_rows^T), f16 in/out, f32 sum."""
        if n <= 0 or batch <= 0:
            return
        cb = self._cublas
        cb.setStream(self._handle, self._cp.cuda.get_current_stream().ptr)
        cb.setPointerMode(self._handle, _CUBLAS_POINTER_MODE_HOST)
        cb.gemmStridedBatchedEx(self._handle, _CUBLAS_OP_T, _CUBLAS_OP_N, m, n, k,
                                self._one.ctypes.data, a, _CUDA_R_16F, lda, sa,
                                b, _CUDA_R_16F, ldb, sb,
                                self._zero.ctypes.data, c, _CUDA_R_16F, ldc, sc,
                                batch, _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT)

    def _stride_blocks(self, n: int) -> int:
        return max(1, min(STRIDE_MAX_BLOCKS, (n + THREADS - 1) // THREADS))

    def _mark(self, name: str, stream: Any = None) -> None:
        if self.trace is not None:
            stream = stream or self._cp.cuda.get_current_stream()
            ev = self._cp.cuda.Event()
            ev.record(stream)
            self.trace.append((name, ev))

    def trace_report(self) -> list[tuple[str, float]]:
        """(stage, ms since the first mark) for every mark of the traced calls (synchronizes the device)."""
        if not self.trace:
            return []
        self.trace[-1][1].synchronize()
        self._cp.cuda.Device().synchronize()
        t0 = self.trace[0][1]
        return [(n, self._cp.cuda.get_elapsed_time(t0, ev)) for n, ev in self.trace]

    def kernel_report(self) -> dict[str, dict[str, int]]:
        """Registers, local (spilled) bytes and static shared bytes of every kernel, as the driver loaded them."""
        return {n: {"regs": int(k.num_regs), "local_bytes": int(k.local_size_bytes),
                    "shared_bytes": int(k.shared_size_bytes)} for n, k in self._k.items()}

    def _upload_i32(self, dst: Any, values: np.ndarray, offset: int = 0) -> None:
        """Copy a small int32 table to the device through page-locked staging, async on the current stream."""
        n = int(values.size)
        self._stage_np[offset:offset + n] = values
        self._rt.memcpyAsync(dst.data.ptr, self._stage_np.ctypes.data + 4 * offset, 4 * n, _MEMCPY_H2D,
                             self._cp.cuda.get_current_stream().ptr)

    # -- routing -----------------------------------------------------------------------------------------------

    def route(self, logits: Any) -> tuple[Any, Any, Any, Any]:
        """[T,E] f32 logits -> (ids [T,K] int32, weights [T,K] f32, pos [T,K] int32, counts [E] int32) on device."""
        cp = self._cp
        t = int(logits.shape[0])
        ids = cp.empty((t, self.top_k), dtype=cp.int32)
        wts = cp.empty((t, self.top_k), dtype=cp.float32)
        pos = cp.empty((t, self.top_k), dtype=cp.int32)
        counts = cp.zeros(self.experts, dtype=cp.int32)
        warps = THREADS // WARP_LANES
        self._k["strata_fast_route_count"](((t + warps - 1) // warps,), (THREADS,),
                                           (logits, np.int32(t), np.int32(self.experts), np.int32(self.top_k),
                                            ids, wts, pos, counts))
        return ids, wts, pos, counts

    # -- prefill -----------------------------------------------------------------------------------------------

    def prefill_layer(self, x: Any, logits: Any, pool: ExpertPool, slot_of_expert: np.ndarray,
                      host_pool: ExpertPool | None = None, ring: tuple[int, int] | None = None,
                      out: Any = None) -> Any:
        """One MoE layer over a chunk: x [T,H] f32, logits [T,E] f32 -> y [T,H] f32 (see the module docstring).

        slot_of_expert [E] (host int32): the pool slot holding each expert, -1 when missed. Missed experts are
        copied from host_pool (page-locked arrays, indexed by expert id) into the ring, pool slots
        ring[0]..ring[0]+ring[1]-1, whose earlier contents are no longer needed. Runs on `compute_stream`;
        `out` (a [T,H] f32 device array) is written in place when given.
        """
        cp = self._cp
        st = self.compute_stream
        with st:
            return self._prefill(cp, x, logits, pool, np.asarray(slot_of_expert, dtype=np.int64), host_pool, ring,
                                out)

    def warm_prefill_layer(self, x: Any, logits: Any, pool: ExpertPool, slot_of_expert: np.ndarray) -> Any:
        """prefill_layer with every routed expert cached (raises if one is not)."""
        return self.prefill_layer(x, logits, pool, slot_of_expert)

    def cold_prefill_layer(self, x: Any, logits: Any, pool: ExpertPool, host_pool: ExpertPool,
                           ring: tuple[int, int]) -> Any:
        """prefill_layer with every expert missed and streamed through the ring."""
        return self.prefill_layer(x, logits, pool, np.full(self.experts, -1, dtype=np.int64), host_pool, ring)

    def _prefill(self, cp: Any, x: Any, logits: Any, pool: ExpertPool, slot_of: np.ndarray,
                 host_pool: ExpertPool | None, ring: tuple[int, int] | None, out: Any) -> Any:
        t, h = int(x.shape[0]), self.hidden
        f, kk, e_n = self.ffn, self.top_k, self.experts
        self._mark("start")
        ids, wts, pos, counts = self.route(logits)
        # the one host sync of a prefill layer: row counts decide the padded height and which experts to fetch
        counts_h = counts.get()
        used = counts_h > 0
        hits = np.nonzero(used & (slot_of >= 0))[0]
        hits = hits[np.argsort(slot_of[hits], kind="stable")]
        misses = np.nonzero(used & (slot_of < 0))[0]
        if misses.size and (host_pool is None or ring is None):
            raise ValueError(f"prefill_layer: {misses.size} experts are not cached and no host pool/ring was given")
        order = np.concatenate([hits, misses])
        g_n = int(order.size)
        count_of_block = counts_h[order].astype(np.int32)
        mpad = int(-(-int(counts_h.max()) // ROW_ALIGN) * ROW_ALIGN) if g_n else ROW_ALIGN
        self.stats = LayerStats(experts_used=g_n, hits=int(hits.size), misses=int(misses.size), mpad_rows=mpad,
                                routed_rows=t * kk, routed_rows_hit=int(counts_h[hits].sum()))
        if out is None:
            out = cp.empty((t, h), dtype=cp.float32)
        if g_n == 0:
            out.fill(0)
            return out
        table = np.zeros(2 * e_n, dtype=np.int32)
        table[order] = np.arange(g_n, dtype=np.int32)
        table[e_n:e_n + g_n] = count_of_block
        maps = cp.empty(2 * e_n, dtype=cp.int32)
        self._upload_i32(maps, table)
        block_of_d, count_of_block_d = maps[:e_n], maps[e_n:]
        xs = cp.empty((g_n, mpad, h), dtype=cp.float16)
        rowidx = cp.empty((t, kk), dtype=cp.int32)
        self._mark("planned")
        # ring copies may begin once the compute stream is past every earlier reader of the ring (previous layers)
        start = cp.cuda.Event(disable_timing=True)
        start.record()
        self._k["strata_fast_gather"]((t * kk,), (THREADS,),
                                      (x, ids, pos, block_of_d, np.int32(t), np.int32(kk), np.int32(h),
                                       np.int32(mpad), xs, rowidx))
        gu = cp.empty((g_n, mpad, 2 * f), dtype=cp.float16)
        act = cp.empty((g_n, mpad, f), dtype=cp.float16)
        ys = cp.empty((g_n, mpad, h), dtype=cp.float16)
        bufs = (xs, gu, act, ys, count_of_block_d)

        def run_hits() -> None:
            if hits.size:
                self._run_hits(cp, pool, slot_of, hits, count_of_block, mpad, bufs)

        if misses.size:
            # the first copy is queued before the hits' GEMMs, so the link starts now
            self._stream_misses(cp, [int(e) for e in misses], pool, host_pool, ring, int(hits.size),
                                count_of_block, mpad, bufs, start, run_hits)
        else:
            run_hits()
        self._k["strata_fast_combine"]((t,), (THREADS,), (ys, rowidx, wts, np.int32(t), np.int32(kk), np.int32(h), out))
        self._mark("end")
        return out

    def _run_hits(self, cp: Any, pool: ExpertPool, slot_of: np.ndarray, hits: np.ndarray,
                  count_of_block: np.ndarray, mpad: int, bufs: tuple) -> None:
        """The cached experts: one GEMM pair per run of consecutive slots (Q8_0: dequantized a group at a time)."""
        if pool.dtype == "q8_0":
            step = self.group_experts
        else:
            step = self.hit_batch_experts or len(hits)
        for first, slot0, n in slot_runs(slot_of[hits].tolist()):
            for sub in range(0, n, max(1, step)):
                m = min(n - sub, max(1, step))
                rows = int(count_of_block[first + sub:first + sub + m].max())
                self._group(cp, pool, slot0 + sub, first + sub, m, rows, mpad, *bufs)
        self._mark("hits_done")

    def _weights_f16(self, cp: Any, pool: ExpertPool, slot0: int, m: int) -> tuple[int, int]:
        """Device pointers of m consecutive slots' f16 weights (Q8_0: dequantized into scratch on this stream)."""
        h, f = self.hidden, self.ffn
        if pool.dtype == "f16":
            return (pool.arrays["w_gate_up"][slot0].data.ptr, pool.arrays["w_down"][slot0].data.ptr)
        scratch = self._scratch(cp, m)
        a = pool.arrays
        n13, n2 = m * 2 * f * h, m * h * f
        self._k["strata_fast_dequant_q8_0"]((self._stride_blocks(n13 // 16),), (THREADS,),
                                            (a["gate_up_q"][slot0], a["gate_up_d"][slot0], np.int64(n13), scratch[0]))
        self._k["strata_fast_dequant_q8_0"]((self._stride_blocks(n2 // 16),), (THREADS,),
                                            (a["down_q"][slot0], a["down_d"][slot0], np.int64(n2), scratch[1]))
        return scratch[0].data.ptr, scratch[1].data.ptr

    def _scratch(self, cp: Any, m: int) -> tuple[Any, Any]:
        have = getattr(self, "_scr", None)
        if have is None or have[0].shape[0] < m:
            self._scr = (cp.empty((max(m, self.group_experts), 2 * self.ffn, self.hidden), dtype=cp.float16),
                         cp.empty((max(m, self.group_experts), self.hidden, self.ffn), dtype=cp.float16))
        return self._scr

    def _group(self, cp: Any, pool: ExpertPool, slot0: int, blk0: int, m: int, rows: int, mpad: int,
               xs: Any, gu: Any, act: Any, ys: Any, count_of_block_d: Any) -> None:
        """Run m experts in consecutive slots slot0.. over stack blocks blk0.. (rows: their largest group)."""
        h, f = self.hidden, self.ffn
        w13, w2 = self._weights_f16(cp, pool, slot0, m)
        self._gemm_tn(2 * f, rows, h, w13, h, 2 * f * h, xs[blk0].data.ptr, h, mpad * h,
                      gu[blk0].data.ptr, 2 * f, mpad * 2 * f, m)
        n = m * mpad * (f // 8)
        self._k["strata_fast_swiglu"]((self._stride_blocks(n),), (THREADS,),
                                      (gu, count_of_block_d, np.int32(blk0), np.int32(m), np.int32(mpad),
                                       np.int32(f), act))
        self._gemm_tn(h, rows, f, w2, f, h * f, act[blk0].data.ptr, f, mpad * f,
                      ys[blk0].data.ptr, h, mpad * h, m)

    def _copy_experts(self, pool: ExpertPool, host_pool: ExpertPool, experts: list[int], slot0: int,
                      names: Sequence[str] | None = None) -> int:
        """Enqueue host->device copies of `experts` into slots slot0.. on the copy stream (arrays `names`, default
        all); consecutive expert ids go as one copy per array. Returns the bytes enqueued."""
        total = 0
        stream = self.copy_stream.ptr
        for first, e0, n in slot_runs(experts):
            for name in names or pool.arrays:
                dev, src = pool.arrays[name], host_pool.arrays[name]
                per = int(src[0].nbytes)
                self._rt.memcpyAsync(dev[slot0 + first].data.ptr, src.ctypes.data + e0 * per, n * per, _MEMCPY_H2D,
                                     stream)
                total += n * per
        return total

    def miss_groups(self, n: int, ring_slots: int) -> list[int]:
        """Sizes of the copy groups that stream n missed experts: as large as the ring allows (4 groups in flight)
        for most, then 4, 2, 2 at the end, so the compute left after the last byte lands is small."""
        big = max(1, min(self.group_experts, ring_slots // 4))
        tail = [s for s in (4, 2, 2) if s <= big] if n >= 2 * big else []
        head = n - sum(tail)
        groups = -(-head // big) if head > 0 else 0
        sizes = [head // groups + (1 if i < head % groups else 0) for i in range(groups)] if groups else []
        return sizes + tail

    def _stream_misses(self, cp: Any, misses: list[int], pool: ExpertPool, host_pool: ExpertPool,
                       ring: tuple[int, int], blk_base: int, count_of_block: np.ndarray, mpad: int,
                       bufs: tuple, start: Any, run_hits: Any) -> None:
        ring0, ring_n = int(ring[0]), int(ring[1])
        sizes = self.miss_groups(len(misses), ring_n)
        if max(sizes) > ring_n:
            raise ValueError(f"prefill_layer: a ring of {ring_n} slots cannot hold a copy group of {max(sizes)}")
        cs, st = self.copy_stream, self.compute_stream
        # ring slots may still be read by earlier work on the compute stream (the previous layer): start after it
        cs.wait_event(start)
        last_user: list[Any] = [None] * ring_n  # per ring slot: the event of the last group computed in it
        cursor, j, streamed = 0, 0, 0
        for g, size in enumerate(sizes):
            if cursor + size > ring_n:
                cursor = 0
            waits = {id(ev): ev for ev in last_user[cursor:cursor + size] if ev is not None}
            for ev in waits.values():
                cs.wait_event(ev)  # the groups that last used these slots have finished computing
            streamed += self._copy_experts(pool, host_pool, misses[j:j + size], ring0 + cursor)
            landed = cp.cuda.Event(disable_timing=True)
            landed.record(cs)
            self._mark(f"copied_{g}", cs)
            if g == 0:
                run_hits()  # the hits compute while the first copies fly
            st.wait_event(landed)
            blk0 = blk_base + j
            rows = int(count_of_block[blk0:blk0 + size].max())
            self._group(cp, pool, ring0 + cursor, blk0, size, rows, mpad, *bufs)
            done = cp.cuda.Event(disable_timing=True)
            done.record(st)
            self._mark(f"computed_{g}")
            for i in range(cursor, cursor + size):
                last_user[i] = done
            cursor += size
            j += size
        self.stats.bytes_streamed = streamed

    # -- decode ------------------------------------------------------------------------------------------------

    def decode_buffers(self) -> dict[str, Any]:
        """Device buffers one decode step writes (act, ids, weights, out, patched slot map); reused, so a captured
        graph can replay them."""
        cp = self._cp
        buf = getattr(self, "_dec", None)
        if buf is None:
            buf = {"act": cp.empty((self.top_k, self.ffn), dtype=cp.float32),
                   "ids": cp.empty(self.top_k, dtype=cp.int32),
                   "w": cp.empty(self.top_k, dtype=cp.float32),
                   "out": cp.empty((1, self.hidden), dtype=cp.float32),
                   "map": cp.empty(self.experts, dtype=cp.int32),
                   "ev_gate_up": cp.cuda.Event(disable_timing=True),
                   "ev_down": cp.cuda.Event(disable_timing=True)}
            self._dec = buf
        return buf

    def _gate_up(self, x: Any, logits: Any, pool: ExpertPool, slot_map: Any, refill_from: Any, skip_missing: int) -> None:
        b = self.decode_buffers()
        h, f, kk = self.hidden, self.ffn, self.top_k
        rows_per_block = (THREADS // WARP_LANES) * DECODE_ROWS_PER_WARP
        self._k["strata_fast_decode_gate_up"](((f + rows_per_block - 1) // rows_per_block, kk), (THREADS,),
                                              (x, logits, np.int32(self.experts), np.int32(kk), slot_map,
                                               refill_from if refill_from is not None else np.uint64(0),
                                               np.int32(skip_missing), pool.arrays["w_gate_up"],
                                               np.int64(2 * f * h), np.int32(h), np.int32(f), b["act"], b["ids"],
                                               b["w"]))

    def _down(self, pool: ExpertPool, slot_map: Any, out: Any) -> None:
        b = self.decode_buffers()
        h, f, kk = self.hidden, self.ffn, self.top_k
        warps = THREADS // WARP_LANES
        self._k["strata_fast_decode_down"](((h + warps - 1) // warps,), (THREADS,),
                                           (b["act"], b["ids"], b["w"], slot_map, pool.arrays["w_down"],
                                            np.int64(h * f), np.int32(h), np.int32(f), np.int32(kk), out))

    def _check_decode_pool(self, pool: ExpertPool) -> None:
        if pool.dtype != "f16":
            raise NotImplementedError("decode_layer: the fused decode kernels read f16 pools only (Q8_0: not yet)")

    def decode_layer(self, x: Any, logits: Any, pool: ExpertPool, slot_map: Any, out: Any = None) -> Any:
        """One token, every routed expert cached: x [1,H] f32, logits [1,E] f32, slot_map [E] int32 (device)
        -> y [1,H] f32. No host sync; runs on `compute_stream`."""
        self._check_decode_pool(pool)
        out = self.decode_buffers()["out"] if out is None else out
        with self.compute_stream:
            self._gate_up(x, logits, pool, slot_map, None, 0)
            self._down(pool, slot_map, out)
        return out

    def capture_decode(self, x: Any, logits: Any, pool: ExpertPool, slot_map: Any) -> Any:
        """A CUDA graph of decode_layer on these very buffers (launch(stream) replays it; output in decode_buffers)."""
        self._check_decode_pool(pool)
        out = self.decode_buffers()["out"]
        s = self._cp.cuda.Stream(non_blocking=True)
        with s:
            s.begin_capture()
            self._gate_up(x, logits, pool, slot_map, None, 0)
            self._down(pool, slot_map, out)
            graph = s.end_capture()
        self._graph_stream = s
        return graph

    def decode_layer_misses(self, x: Any, logits: Any, pool: ExpertPool, slot_of_expert: np.ndarray,
                            slot_map: Any, host_pool: ExpertPool, ring: tuple[int, int], out: Any = None) -> Any:
        """One token with possible misses (see the module docstring). slot_of_expert is the host copy of slot_map;
        both are left as they were (the ring is scratch, not cache). Runs on `compute_stream`."""
        self._check_decode_pool(pool)
        b = self.decode_buffers()
        st = self.compute_stream
        with st:
            if out is None:
                out = self._cp.empty((1, self.hidden), dtype=self._cp.float32)
            self._gate_up(x, logits, pool, slot_map, None, 1)
            self._rt.memcpyAsync(self._ids_host.ctypes.data, b["ids"].data.ptr, 4 * self.top_k, 2, st.ptr)
            st.synchronize()  # also: nothing earlier on this stream still reads the ring
            routed = self._ids_host[:self.top_k]
            missing = np.asarray(slot_of_expert)[routed] < 0
            misses = sorted(int(e) for e in routed[missing])
            self.stats = LayerStats(experts_used=self.top_k, hits=self.top_k - len(misses), misses=len(misses),
                                    routed_rows=self.top_k, routed_rows_hit=self.top_k - len(misses))
            if not misses:
                self._down(pool, slot_map, out)
                return out
            if len(misses) > int(ring[1]):
                raise ValueError(f"decode_layer_misses: {len(misses)} misses and a ring of {ring[1]} slots")
            names = list(pool.arrays)
            gate_names = [n for n in names if n.startswith("w_gate_up") or n.startswith("gate_up")]
            down_names = [n for n in names if n not in gate_names]
            streamed = self._copy_experts(pool, host_pool, misses, int(ring[0]), gate_names)
            b["ev_gate_up"].record(self.copy_stream)
            streamed += self._copy_experts(pool, host_pool, misses, int(ring[0]), down_names)
            b["ev_down"].record(self.copy_stream)
            self.stats.bytes_streamed = streamed
            patched = np.asarray(slot_of_expert, dtype=np.int32).copy()
            patched[misses] = int(ring[0]) + np.arange(len(misses), dtype=np.int32)
            self._upload_i32(b["map"], patched, offset=2 * self.experts)
            st.wait_event(b["ev_gate_up"])
            self._gate_up(x, logits, pool, b["map"], slot_map, 0)
            st.wait_event(b["ev_down"])
            self._down(pool, b["map"], out)
        return out
