"""The fast MoE paths on a CUDA (or ROCm) device: strata_cuda/moe_fast.cu through cupy, GEMMs in cuBLAS.

`FastMoE` runs MoE layers on ExpertPool-layout device arrays, so the runtime's KernelSet and
executor can call it with the cache's own pool, slot maps and lent ring slots:
- `prefill_layer`: route on the device (top-k, then group positions and counts, both without atomics), one small
  host sync for the per-expert row counts, then the rows gathered into a compact f16 stack (each expert's rows
  contiguous, no padding to the largest group), the expert GEMMs as one pointer-array batched cuBLAS GEMM per
  size class and projection (f16 in, f32 accumulation; `gemm_mode` names the others), a group of more than
  `split_rows` rows run as pieces of that many (so a hot expert under skewed routing joins the common class),
  with a SwiGLU kernel between, and a deterministic per-token combine (k order). Missed experts stream from
  page-locked host memory through ring slots of the same pool on a copy stream, several experts per copy (large
  groups first, small ones last, so little compute is left once the last byte lands), while the compute stream
  runs the hits and every group whose copy has landed (events, no host waits). Q8_0 experts are copied as quants
  and scales (about half the bytes) and dequantized on the compute stream into f16 scratch.
- `decode_layer`: one token: two kernels (route + gate/up GEMV + SwiGLU, then the down GEMV over all top-k
  experts), routing and slot look-up on the device, no host sync, replayed as a CUDA graph per set of buffers.
  A missed expert is read by the kernels straight from page-locked, mapped host memory (no round trip, no copy).
  f16 and Q8_0 pools (Q8_0: the kernels read the int8 quants and f16 scales themselves, no f16 scratch).
- `decode_layer_misses`: the alternative for host memory the device cannot map: a one-block routing kernel,
  the ids to the host (one event sync), then the misses' gate/up and down matrices are copied into ring slots
  (two events) while the two kernels run the cached experts; the missed experts' rows are filled as soon as
  their gate/up matrices land, and their share of the down product is added once the rest has landed.
- `grouped_ffn`: the KernelSet's `moe_grouped_ffn` contract (rows already grouped by expert) on the same steps:
  pack into the compact stack by slot order, the same grouped GEMMs, unpack to f32.
Work buffers are grown once and addressed by pointer, and the small tables travel through page-locked staging,
so the host's share of a layer stays a few tens of microseconds.
cupy is imported inside the constructor: this module imports without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.resources import files
from typing import Any, Sequence

import numpy as np

from strata_core.reference.kernels import QK8_0, ExpertPool

from .grouping import gemm_pieces

SOURCE_NAME = "moe_fast.cu"
COMPILE_OPTIONS = ("-std=c++17",)
KERNEL_NAMES = ("strata_fast_route", "strata_fast_positions", "strata_fast_offsets", "strata_fast_gather",
                "strata_fast_swiglu", "strata_fast_combine", "strata_fast_dequant_q8_0", "strata_fast_decode_gate_up",
                "strata_fast_decode_down", "strata_fast_decode_norm_route", "strata_fast_decode_gate_up_q8",
                "strata_fast_decode_down_q8", "strata_fast_decode_norm_route2", "strata_fast_decode_down2",
                "strata_fast_gemv_f16w", "strata_fast_decode_gate_up3", "strata_fast_decode_down3_s1",
                "strata_fast_decode_down3_s2", "strata_fast_decode_down3_s4", "strata_fast_pull_words",
                "strata_fast_pull_u4", "strata_fast_decode_gate_up3_q8", "strata_fast_decode_down3_q8",
                "strata_fast_decode_gate_up4_q8", "strata_fast_decode_down4_q8")
#: The expert formats the fused decode kernels read, and the pool arrays whose host addresses a layer's missed
#: experts are read at (in the kernels' order).
DECODE_HOST_ARRAYS = {"f16": ("w_gate_up", "w_down"), "q8_0": ("gate_up_q", "gate_up_d", "down_q", "down_d")}
#: Threads per block of every kernel (STRATA_FAST_THREADS in the source).
THREADS = 256
#: Lanes of a warp on CUDA; the top-k keeps 8 logits per lane in registers, so E <= 8 * warp.
WARP_LANES = 32
WARPS = THREADS // WARP_LANES
TOPK_PER_LANE = 8
MAX_TOPK = 16
#: Most blocks of the grid-stride kernels: more only adds scheduling.
STRIDE_MAX_BLOCKS = 8192
#: FFN rows per warp of the decode gate/up kernel (STRATA_DEC_ROWS in the source).
DECODE_ROWS_PER_WARP = 2
#: The decode stack's kernels (FastMoE.decode_form): 1 the first forms of moe_fast.cu; 2 the second norm/router (router
#: rows loaded before the wait for x) and down (loads in batches of 8) kernels; 3, 4 and 5 the second norm/router
#: with the third gate/up (routing once a block by rank, one trip to memory a lane, routed slots published) and the
#: third down kernel, as DECODE_THIRD[form] sets them. f16 pools; Q8_0 layers take the first Q8_0 pair in forms 1
#: and 2 and the third-form Q8_0 pair in the rest (THIRD_FORM_DTYPES).
#: H200, 48-layer graph (bench/results/k1_h200/call2_decode_kernels_h200.json): 1.995 ms with 2, 2.226 ms with 1;
#: bench/results/d_h200/call1_decode_kernels_h200.json: form 2 1.987 ms, 3 1.790, 4 1.756, 5 1.794 plain, and
#: 1.986, 1.731, 1.671, 1.696 as programmatic launches; call2_decode_kernels_h200.json (programmatic): 4 1.662 ms,
#: 6 1.467 (gate/up 20.2 -> 16.9 us: 256 blocks in one wave, each routing once for 3 row pairs a warp), 7 1.706 and
#: 8 1.826 (the L2 hint of the down matrices slowed gate/up more than it sped down). 6 the fastest; end to end
#: (call2_strata_run_h200.json) the all-cached run decoded 504.5 tok/s with 4, 444.7 with form 2 plain in that call.
DECODE_FORM = 6
#: How the third-form Q8_0 decode pair is compiled and which it is (FastMoE.q8_decode): (quants widened by a byte
#: permute and an add, exact, instead of the int8 conversion; the fourth pair, strata_fast_decode_gate_up4_q8 and
#: down4_q8, whose lanes keep their activations in registers, instead of the third; blocks an SM the pairs are
#: compiled for). "cast" and "prmt" sum the same products in the same order (the same bits), and so do "cast_reg"
#: and "prmt_reg" (the fourth down kernel sums a row's slices in another order than the third).
Q8_DECODE_VARIANTS = {"cast": (0, 0, 2), "prmt": (1, 0, 2), "cast_reg": (0, 1, 2), "prmt_reg": (1, 1, 2)}
#: The variants whose sums are the cast's, bit for bit.
Q8_DECODE_CHUNK_ORDER = ("cast", "prmt")
#: H200, Qwen3-30B-A3B's 48-layer stack (bench/results/s13_h200/call3_decode_q8_kernels_h200.json): prmt_reg 1.091 ms,
#: cast_reg 1.239, prmt 1.404, cast 1.476; `strata run` Q8_0 half-cached decode 311.3 tok/s against prmt's 284.9
#: (call 3), 308.8 against 289.2 (call 4).
Q8_DECODE = "prmt_reg"
#: The fourth Q8_0 pair's limits (moe_fast.cu): gate/up keeps H / 16 <= 4 * 32 chunks of x a lane group, down keeps
#: K * F / 16 <= 4 slices * 3 * 32 (expert, chunk) pairs; past them a layer takes the third pair.
Q8_REG_MAX_X_CHUNKS = 4 * 32
Q8_REG_MAX_DOWN_PAIRS = 4 * 3 * 32
#: Rows a block of strata_fast_decode_down4_q8 computes (two row groups of STRATA_D4_ROWS).
Q8_REG_DOWN_ROWS = 2 * 4
#: Pool dtypes of the third forms: f16 (strata_fast_decode_gate_up3 and the DECODE_THIRD down kernel) and Q8_0
#: (the Q8_DECODE pair in every third form: the form's gate/up row pairs a warp, its own down kernel, no L2 hint). Before them a Q8_0 layer took the first Q8_0 kernels (routing in every
#: warp), 48.8 us a Qwen3-30B-A3B layer on the H200 against 36 in F16 (bench/results/strata_run_h200_q8_0.json).
THIRD_FORM_DTYPES = ("f16", "q8_0")
#: The third forms: (down kernel, its warps a hidden row, gate/up row pairs a warp, gate/up hints the routed down
#: matrices into L2 for the down kernel).
DECODE_THIRD = {3: ("strata_fast_decode_down3_s2", 2, 1, False), 4: ("strata_fast_decode_down3_s1", 1, 1, False),
                5: ("strata_fast_decode_down3_s4", 4, 1, False), 6: ("strata_fast_decode_down3_s1", 1, 3, False),
                7: ("strata_fast_decode_down3_s1", 1, 3, True), 8: ("strata_fast_decode_down3_s1", 1, 1, True)}
#: Decode kernels as programmatic dependent launches (pdl.py; FastMoE.decode_pdl) where the driver has them. On: with
#: the third forms the 48-layer graph takes 1.671 ms against 1.756 ms plain (form 4; d_h200/call1, same call; call2:
#: form 6 1.467 against 1.559; the LM head GEMV 137.5 against 140.4 us); the second forms gained nothing
#: (1.986 / 1.987 ms; k1_h200/call2: 2.024 / 1.995).
DECODE_PDL = True
#: Output rows per warp of the f16-weight GEMV (STRATA_GEMV_WROWS in the source).
GEMV_ROWS_PER_WARP = 2
#: A streamed copy group carries at least this many bytes (small experts go many to a group): each group costs the
#: host a few launches, so tiny experts in groups of 8 were bound by Python, not by the link.
COPY_GROUP_BYTES = 64 << 20
#: Size classes are spread over side streams only for calls of at least this many experts (a ring group's few
#: experts gain nothing from the fork and join).
SIDE_STREAM_MIN_PROBLEMS = 16
#: Captured decode graphs kept (one per set of buffers a caller uses; the executor uses a few).
MAX_DECODE_GRAPHS = 64
#: cuBLAS / CUDA enums (cublas_api.h, library_types.h): fixed by the ABI.
_CUBLAS_OP_N, _CUBLAS_OP_T = 0, 1
_CUDA_R_16F = 2
_CUBLAS_COMPUTE_32F = 68
_CUBLAS_GEMM_DEFAULT = -1
_CUBLAS_POINTER_MODE_HOST = 0
_MEMCPY_H2D = 1
#: Each expert's rows in the compact f16 stacks start at a multiple of this, so every group starts 16-byte aligned
#: whatever the widths and cuBLAS sees aligned matrices.
ROW_ALIGN = 8
#: How the expert GEMMs of a layer run (FastMoE.gemm_mode): "classes" is one pointer-array batched GEMM per size
#: class (each group rounded up to the next class, two an octave), the classes spread over
#: `gemm_streams` streams so small ones run beside large ones; "grouped-classes" the same classes in one
#: cublasGemmGroupedBatchedEx (CUDA >= 12.5); "grouped" one grouped call with each expert's exact rows; "loop" one
#: GEMM per expert. Measured on the H200 (bench/results/layer_h200.json): classes is the fastest, the default.
GEMM_MODES = ("classes", "grouped-classes", "grouped", "loop")
CLASS_MODES = ("classes", "grouped-classes")
#: In the class modes a group of more rows than this runs as pieces of this many rows (FastMoE.split_rows; 0: whole
#: groups; grouping.gemm_pieces). Each size class is one cuBLAS call of about 20 us of host time a projection
#: (H200, bench/results/k2_h200/call2_profile_layer.json), and the sweep's skewed routing made 18 classes of a
#: 4096-token chunk, the host issuing GEMMs slower than the device ran them; above 512 rows every group joins the 512-row
#: class (12 classes, 10% fewer padded rows), and the uniform chunk's groups (about 256 rows) stay whole. Pieces of
#: 128 rows lost on the device (more problems, each expert's weights read again per piece).
SPLIT_ROWS = 512
#: In the class modes no group is given fewer stack rows than this (a multiple of ROW_ALIGN; FastMoE.class_floor;
#: the stack's bound grows by (floor - ROW_ALIGN) rows an expert). A 64-row floor merges the skewed chunk's six
#: smallest classes (85 groups of 1 to 64 rows) into one; on the H200 it gained nothing: the skewed layer took 1.190 ms
#: with it, 1.483 with 32, 1.178 without (bench/results/lead_h200_s6/call2_layer_h200.json), so no floor.
CLASS_FLOOR_ROWS = ROW_ALIGN
#: A prefill layer whose every expert is cached (f16 pool) runs its expert GEMMs as triton_moe's two launches, which
#: read the routing counts on the device: no host sync, no size classes, no padding (FastMoE.device_gemm; needs
#: Triton and torch, else the cuBLAS modes run). Its counts reach on_counts later, through page-locked staging that
#: rotates over DEFERRED_COUNTS layers (flush_counts).
DEVICE_GEMM = True
#: Pool dtypes of that path: f16, and Q8_0 (the int8 quants and f16 scales read in the K loop, each weight rounded
#: once to f16 as strata_fast_dequant_q8_0 rounds it; the cuBLAS path dequantized slot runs into scratch group by
#: group, 11.8 ms a Qwen3-30B-A3B layer on the H200: bench/results/lead_h200_s8/call2_strata_run_h200_q8_0.json).
DEVICE_TABLE_DTYPES = ("f16", "q8_0")
#: Pool dtypes whose cached experts in a layer with misses run as one pair of those launches too, over the host's
#: stack layout (FastMoE._device_hits), not group by group through scratch and cuBLAS classes: Q8_0 (its class path
#: costs the host a dequantization and class calls per group of group_experts). f16 hits stay one batched cuBLAS
#: call per class (a streamed f16 layer is link-bound: 0.97x the floor, bench/results/strata_run_h200.json).
HITS_DEVICE_DTYPES = ("q8_0",)
DEFERRED_COUNTS = 4

#: Copy the first ring group of a streamed layer's uncached experts before the layer routes (prefetch_misses, which
#: the layer ops call at the layer's start): without it the link idles ~0.7 ms a layer between one layer's last
#: landing and the next layer's first copy, spent on the router, the counts' sync and the hits' set-up
#: (bench/results/k2_h200/call1_trace_run_half_skewed.json). A chunk of thousands of tokens routes to nearly every
#: uncached expert, so the first group's guess is nearly always right; a wrong guess costs one group's copy.
PREFETCH_MISSES = True

#: A streamed layer queues copy groups at most this many ahead of the last group whose compute it has issued (None:
#: every group whose ring slots are free, at once). Measured on the H200 (bench/results/lead_h200_s5/): no
#: difference beyond the runs' spread; the host never blocked in memcpyAsync (0.4-0.8 ms a layer inside it either
#: way). Kept at 2, which bounds what a stall behind the copy engine can wait for.
COPY_GROUPS_AHEAD: int | None = 2

#: Small host->device tables (GEMM pointers, slot maps) and the ring's device-to-device admissions go through a pull
#: kernel (strata_fast_pull_*) instead of cudaMemcpyAsync: a memcpy on the compute stream can wait in the copy
#: engine's queue behind the ring's host copies, and in most half-skewed layers the hits' GEMMs then ran after the
#: layer's last landing, ~1.4 ms a layer (bench/results/lead_h200_s5/link_trace_h200.json).
PULL_SMALL_COPIES = True


def kernel_source() -> str:
    """The text of strata_cuda/moe_fast.cu."""
    return files("strata_cuda").joinpath(SOURCE_NAME).read_text()


def compile_to_ptx(arch: str = "compute_90", options: tuple[str, ...] = COMPILE_OPTIONS) -> bytes:
    """Compile moe_fast.cu to PTX with NVRTC (no GPU needed); raises RuntimeError with NVRTC's log on failure."""
    from .kernels import nvrtc_compile
    return nvrtc_compile(kernel_source(), SOURCE_NAME, (f"-arch={arch}", *options))


#: The third-form gate/up kernels compute a layer's uncached experts first (STRATA_MISSES_FIRST in moe_fast.cu):
#: their link-bound blocks start in the first wave, beside the cached experts' blocks, not after them.
DECODE_MISSES_FIRST = True


def module_options(decode_rows_per_warp: int = DECODE_ROWS_PER_WARP, q8_decode: str | None = None) -> tuple[str, ...]:
    """NVRTC options of moe_fast.cu for these compiled-in choices (DECODE_MISSES_FIRST and Q8_DECODE read now)."""
    prmt, _, min_blocks = Q8_DECODE_VARIANTS[q8_decode or Q8_DECODE]
    return COMPILE_OPTIONS + (f"-DSTRATA_DEC_ROWS={int(decode_rows_per_warp)}",
                              f"-DSTRATA_MISSES_FIRST={int(bool(DECODE_MISSES_FIRST))}",
                              f"-DSTRATA_Q8_PRMT={prmt}", f"-DSTRATA_Q8_MINB={min_blocks}")


def precompile(decode_rows_per_warp: int = DECODE_ROWS_PER_WARP) -> None:
    """Compile moe_fast.cu now (cupy keeps the module by source and options), so a FastMoE built later, inside a
    timed region, does not pay for NVRTC."""
    import cupy
    mod = cupy.RawModule(code=kernel_source(), options=module_options(decode_rows_per_warp))
    for n in KERNEL_NAMES:
        mod.get_function(n)


_SIDE_LANES: dict[int, list] = {}


def side_lanes(n: int) -> list:
    """n (stream, cuBLAS handle) pairs of the current device, made once per process: cublasCreate is slow the first
    times, and a FastMoE built inside a timed region should not pay for it."""
    import cupy
    from cupy_backends.cuda.libs import cublas
    dev = cupy.cuda.Device().id
    lanes = _SIDE_LANES.setdefault(dev, [])
    while len(lanes) < n:
        hnd = cublas.create()
        cublas.setPointerMode(hnd, _CUBLAS_POINTER_MODE_HOST)
        lanes.append((cupy.cuda.Stream(non_blocking=True), hnd))
    return lanes[:n]


def warm_up() -> None:
    """Compile the module, start cuBLAS and make the side lanes, then run one tiny prefill and decode layer, so the
    first real layer of a run pays for none of it (called when a cuda session's layer ops are made)."""
    import cupy
    precompile()
    side_lanes(3)
    e, k, h, f, t = 8, 2, 256, 256, 64
    moe = FastMoE(e, k, h, f)
    rng = np.random.default_rng(0)
    pool = ExpertPool("f16", {"w_gate_up": cupy.asarray(rng.standard_normal((1, 2 * f, h)).astype(np.float16)),
                              "w_down": cupy.asarray(rng.standard_normal((1, h, f)).astype(np.float16))})
    x = cupy.asarray(rng.standard_normal((t, h)).astype(np.float32))
    logits = cupy.asarray(rng.standard_normal((t, e)).astype(np.float32))
    moe.prefill_layer(x, logits, pool, np.zeros(e, dtype=np.int64))
    moe.decode_graphs = False
    moe.decode_layer(x[:1], logits[:1], pool, cupy.zeros(e, dtype=cupy.int32))
    cupy.cuda.Device().synchronize()


#: Batch counts the GEMM warm-up runs each size class at (cuBLAS picks kernels by batch count too).
WARM_BATCHES = (*range(1, 17), 24, 32, 48, 64, 96, 128, 192, 256, 384)


def warm_gemms(moe: "FastMoE", tokens: int, pool_dtype: str = "f16") -> int:
    """Run each expert GEMM size class a `tokens`-token chunk can meet, both projections, at a few batch counts, on
    moe's own lanes: cuBLAS loads a kernel the first time it picks it (about a millisecond each), and a first request
    met new class sizes layer after layer. Scratch buffers only (the device-table launches of `pool_dtype`'s
    weights too); returns the GEMM calls made."""
    import cupy
    if moe.gemm_mode == "loop":
        return 0
    h, f = moe.hidden, moe.ffn
    routed = max(1, tokens) * moe.top_k
    split = moe.split_rows if moe.gemm_mode in CLASS_MODES and moe.split_rows > 0 else 0
    # with split groups no problem is larger than split_rows' class, and that class meets more problems a call
    top = min(max(1, tokens), split) if split else max(1, tokens)
    sizes = np.unique(class_rows(np.arange(1, top + 1), moe.class_floor)) if moe.gemm_mode in CLASS_MODES else \
        np.unique(np.minimum(tokens, 1 << np.arange(int(np.log2(max(1, tokens))) + 2)))
    most = moe.experts + (routed // split if split else 0)
    batches = sorted({b for b in (*WARM_BATCHES, most // 2, most) if b > 0})
    n_max = int(sizes.max())
    w = cupy.empty(2 * (2 * f * h + h * f) // 2, dtype=cupy.float16)
    a = cupy.empty(n_max * (h + 2 * f), dtype=cupy.float16)
    w13, w2 = int(w.data.ptr), int(w.data.ptr) + 2 * (2 * f * h)
    xs, gu = int(a.data.ptr), int(a.data.ptr) + 2 * n_max * h
    calls = 0
    # on the caller's current stream (a run's layers use the session's, the null stream) and, through one call of
    # mixed sizes, on the side lanes too: cuBLAS takes a workspace per stream it first runs on, which a run would
    # otherwise allocate inside its first layer, outside the plan's regions
    st = cupy.cuda.get_current_stream()

    if moe.device_gemm is not None:
        # Triton compiles and loads both launches here (their specialization is the shape's, not the counts'):
        # with every count 0 each program returns at once
        tables = cupy.zeros(3 * moe.experts, dtype=cupy.int32)
        p = int(tables.data.ptr)
        from .quant_ffn import WARM_DEVICE
        # pool slots (f16 pools); a dequantized group's order only where QuantMoE's warm layers take the path
        orders = (p + 8 * moe.experts, None) if WARM_DEVICE else (p + 8 * moe.experts,)
        for slots in orders:
            moe.device_gemm.layer(st.ptr, xs, gu, xs, w13, w2, p, p + 4 * moe.experts, slots, routed)
        if pool_dtype == "q8_0":  # the Q8_0 specialization (the scratch stands in for quants and scales)
            moe.device_gemm.layer(st.ptr, xs, gu, xs, w13, w2, p, p + 4 * moe.experts, p + 8 * moe.experts, routed,
                                  scales=(w13, w2))
            calls += 2
        st.synchronize()
        calls += 2 * len(orders)

    def run(ns: np.ndarray) -> None:
        one = np.zeros(ns.size, dtype=np.int64)
        # every problem of the batch reads and writes the same scratch: the values are never used
        moe._gemm_problems(2 * f, h, h, h, 2 * f, one + w13, one + xs, one + gu, ns)
        moe._gemm_problems(h, f, f, f, h, one + w2, one + gu, one + xs, ns)
        moe._ptr_done.synchronize()
        moe._ptr_cursor = 0

    for n in sizes.tolist():
        for b in batches:
            if b > most or b * n > 2 * routed:
                continue
            run(np.full(b, n, dtype=np.int64))
            calls += 2
    mixed = np.resize(sizes[:4], max(SIDE_STREAM_MIN_PROBLEMS, 4 * len(moe._side) + 4))
    if sizes.size > 1 and mixed.size <= moe.experts:
        run(mixed.astype(np.int64))
        calls += 2
    st.synchronize()
    for side, _ in moe._side:
        side.synchronize()
    del w, a
    return calls


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


def _ring_key(ring: np.ndarray) -> bytes:
    return np.asarray(ring, dtype=np.int64).tobytes()


def ring_placement(sizes: Sequence[int], ring_slots: int,
                   start: int = 0) -> tuple[list[np.ndarray], list[list[int]], int]:
    """Where a streamed layer's copy groups sit on a ring of ring_slots slots, as a circular buffer from position
    `start` on (a group may wrap past the last slot): (each group's positions in the ring, the earlier groups of this
    layer whose slots each reuses, the position after the last group). A layer starts where the previous one through
    the ring ended, so its first group (the prefetch, queued behind that layer's copies) takes the slots that layer's
    earliest groups read, not its last ones: from slot 0 every layer, the next layer's prefetch waited for the previous
    layer's tail groups and the admissions after them (6.2 ms of link idle before prefetches a half-skewed prefill,
    0.3 ms this way, groups then kept contiguous: bench/results/lead_h200_s6/call2_link_trace_h200.json). Wrapping
    inside a group keeps every slot in use: skipping the ring's tail to keep groups contiguous left one group fewer
    in flight whenever a layer started mid-ring (the Q4_K_M cold layer 1.31x its link floor in
    call2_quant_layer_h200.json, 1.08x in call3_ with the wrap)."""
    n = int(ring_slots)
    positions: list[np.ndarray] = []
    deps: list[list[int]] = []
    last_user = np.full(max(n, 0), -1, dtype=np.int64)
    cursor = int(start) if 0 <= int(start) < n else 0
    for g, size in enumerate(int(k) for k in sizes):
        if size > n:
            raise ValueError(f"ring_placement: a group of {size} on a ring of {n} slots")
        pos = (cursor + np.arange(size, dtype=np.int64)) % n
        positions.append(pos)
        users = last_user[pos]
        deps.append(sorted(set(users[users >= 0].tolist())))
        last_user[pos] = g
        cursor = (cursor + size) % n
    return positions, deps, cursor


def class_rows(counts: np.ndarray, floor: int = ROW_ALIGN) -> np.ndarray:
    """Each count rounded up to its size class, two an octave: 8, 16, then 2^k and 1.5 * 2^k, so a class holds at
    most 1.5x its rows above 16 (moe_fast.cu's stack_cap), and at least `floor` rows. Four an octave (at most 1.25x)
    measured slower under skewed routing on the H200 (1.55 against 1.15 ms a layer): more classes, smaller batches,
    more launches."""
    c = np.maximum(np.asarray(counts, dtype=np.int64), 1)
    p = np.left_shift(1, np.ceil(np.log2(c)).astype(np.int64))  # the power of two at or above c
    mid = (3 * p) // 4  # 1.5 * 2^(k-1), between p/2 and p
    out = np.where((mid >= c) & (mid % ROW_ALIGN == 0), mid, p)
    return np.maximum(out, max(ROW_ALIGN, int(floor)))


@dataclass
class StackLayout:
    """Where each group's rows sit in the compact f16 stacks: block b holds count[b] rows from row row0[b], with room
    for cap[b] (its count rounded up to ROW_ALIGN, or to its size class in "classes" mode)."""

    count: np.ndarray
    cap: np.ndarray
    row0: np.ndarray

    @classmethod
    def of(cls, count_of_block: np.ndarray, mode: str, floor: int = ROW_ALIGN) -> "StackLayout":
        """The layout of these groups (in block order) for a gemm mode (class modes: classes of at least floor rows)."""
        count = np.asarray(count_of_block, dtype=np.int64)
        cap = class_rows(count, floor) if mode in CLASS_MODES else -(-count // ROW_ALIGN) * ROW_ALIGN
        row0 = np.concatenate([[0], np.cumsum(cap)[:-1]]).astype(np.int64) if count.size else count
        return cls(count=count, cap=cap, row0=row0)

    @property
    def rows(self) -> int:
        """Rows of the whole stack."""
        return int(self.cap.sum())


def _find_cublas() -> Any:
    """The libcublas cupy has loaded (its handle works with it), through ctypes; None where there is none."""
    import ctypes
    path = None
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                name = line.rsplit(None, 1)[-1] if "/" in line else ""
                if "/libcublas.so" in name:
                    path = name
                    break
    except OSError:
        pass
    for cand in ([path] if path else []) + ["libcublas.so.13", "libcublas.so.12", "libcublas.so"]:
        try:
            return ctypes.CDLL(cand)
        except OSError:
            continue
    return None


class _BlasExtra:
    """The cuBLAS GEMMs cupy does not bind: grouped (cublasGemmGroupedBatchedEx) and pointer-array batched."""

    def __init__(self):
        import ctypes as C
        lib = _find_cublas()
        vp, i = C.c_void_p, C.c_int
        self.grouped = getattr(lib, "cublasGemmGroupedBatchedEx", None) if lib is not None else None
        if self.grouped is not None:
            self.grouped.restype = i
            self.grouped.argtypes = [vp, vp, vp, vp, vp, vp, vp, vp, i, vp, vp, i, vp, vp, vp, i, vp, i, vp, i]
        self.batched = getattr(lib, "cublasGemmBatchedEx", None) if lib is not None else None
        if self.batched is not None:
            self.batched.restype = i
            self.batched.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, vp, i, i, vp, vp, i, i, i, i, i]


@dataclass
class DecodeLayer:
    """One layer of a decode stack: its norm and router weights (device f32), its pool and device slot map [E]
    int32 (-1: read from `host`, the mapped host addresses of its pool's arrays in DECODE_HOST_ARRAYS order: f16
    gate|up and down, or Q8_0 gate|up quants, scales, down quants, scales), and where its routed ids and weights
    [K] land (kept for the hit counts)."""

    norm_w: Any
    router_w: Any
    pool: ExpertPool
    slot_map: Any
    ids: Any
    w: Any
    host: tuple[int, ...] | None = None
    eps: float = 1e-6
    #: the landing table [E] int32 on the device (a miss e with land[e] >= 0 is written into slot land[e] as the
    #: third-form kernels read it), or None
    land: Any = None

    def key(self) -> tuple:
        """The buffers a captured graph of this layer reads and writes (every array of its pool, any format)."""
        a = self.pool.arrays
        return (self.norm_w.data.ptr, self.router_w.data.ptr, *(a[n].data.ptr for n in sorted(a)),
                self.slot_map.data.ptr, self.ids.data.ptr, self.w.data.ptr, self.host,
                None if self.land is None else self.land.data.ptr)


@dataclass
class LayerStats:
    """What the last layer did: experts used, hits, misses, bytes streamed, rows of the compact stack."""

    experts_used: int = 0
    hits: int = 0
    misses: int = 0
    bytes_streamed: int = 0
    stack_rows: int = 0
    routed_rows_hit: int = 0
    routed_rows: int = 0
    copy_groups: int = 0
    #: expert GEMM problems of each projection (more than experts_used where hot experts ran as pieces)
    gemm_problems: int = 0
    #: ring slot -> the missed expert it holds after the layer (streamed layers only)
    ring_held: dict | None = None
    #: the layer's prefetched first group (prefetch_misses): "used", "spent" (the routing missed other experts
    #: first; its bytes moved all the same and are in bytes_streamed) or "" (none)
    prefetch: str = ""
    #: the layer ran on the device-table path (triton_moe): no host sync, so the counts behind experts_used,
    #: hits and stack_rows were not on the host (they reach on_counts later)
    device_table: bool = False
    #: the layer streamed misses and its cached experts ran as one pair of device-table launches (_device_hits)
    device_hits: bool = False


class _Grown:
    """A device buffer that only grows (so pointers into it stay valid within a call and no call frees mid-run)."""

    def __init__(self, cp: Any):
        self._cp = cp
        self.mem = None
        self.nbytes = 0

    def ptr(self, nbytes: int) -> int:
        """The buffer's address, grown first to at least nbytes."""
        if nbytes > self.nbytes:
            self.mem = self._cp.cuda.alloc(nbytes)
            self.nbytes = nbytes
        return int(self.mem.ptr)


class _Given:
    """A buffer the caller lent (a view of the plan's memory): its address, refusing a request larger than it."""

    def __init__(self, ptr: int, nbytes: int):
        self.mem = ptr
        self.nbytes = int(nbytes)

    def ptr(self, nbytes: int) -> int:
        """The lent buffer's address (ValueError when nbytes exceeds it)."""
        if nbytes > self.nbytes:
            raise ValueError(f"FastMoE: a lent buffer of {self.nbytes} bytes cannot hold {nbytes}")
        return int(self.mem)


#: The prefill work buffers, by name (FastMoE.prefill_buffer_bytes gives their sizes).
PREFILL_BUFFERS = ("route", "maps", "xs", "gu", "act", "ys", "scratch")


_LAUNCHERS: dict[int, Any] = {}


def _launcher(cupy: Any) -> Any:
    """The programmatic-launch Launcher of the current device, made once per device (enabled from sm_90 on)."""
    from .pdl import Launcher
    dev = cupy.cuda.Device()
    got = _LAUNCHERS.get(dev.id)
    if got is None:
        got = _LAUNCHERS[dev.id] = Launcher(enabled=int(dev.compute_capability) >= 90)
    return got


def _split_host(dtype: str, host: tuple[int, ...] | None) -> tuple[Any, Any]:
    """A layer's mapped host addresses as the gate/up and down kernels take them: f16 one address each, Q8_0 a
    (quants, scales) pair each, 'gguf' (blob row 0, row bytes) each; 0 where the layer reads nothing from host
    memory."""
    if not host:
        return 0, 0
    if dtype == "gguf":  # one blob a row: (its address, the store's row bytes) for both kernels
        return host, host
    return (host[0], host[1]) if dtype != "q8_0" else ((host[0], host[1]), (host[2], host[3]))


class FastMoE:
    """Fast MoE layer paths for one shape (E experts, top-k, hidden H, FFN F) on the current cupy device."""

    def __init__(self, experts: int, top_k: int, hidden: int, ffn: int, group_experts: int = 8,
                 hit_batch_experts: int = 0, decode_rows_per_warp: int = DECODE_ROWS_PER_WARP,
                 gemm_mode: str | None = None, gemm_streams: int = 4, pinned: Any = None,
                 q8_decode: str | None = None):
        import cupy
        from cupy.cuda import runtime
        from cupy_backends.cuda.libs import cublas
        self._cp = cupy
        #: the session's page-locked allocator (the plan's pinned budget): the staging below comes from its runtime
        #: floor; None (or a refusal): cupy's own page-locked memory, counted in staging_outside_plan_bytes
        self._pinned = pinned
        self._pinned_bufs: list = []
        self.staging_outside_plan_bytes = 0
        self._rt = runtime
        self._cublas = cublas
        if hidden % 8 or ffn % 8 or hidden % QK8_0 or ffn % QK8_0:
            raise ValueError(f"FastMoE needs hidden and ffn to be multiples of {QK8_0} (got {hidden}, {ffn})")
        if experts > TOPK_PER_LANE * WARP_LANES or not 0 < top_k <= min(MAX_TOPK, experts):
            raise ValueError(f"FastMoE routes at most {TOPK_PER_LANE * WARP_LANES} experts and top-k <= {MAX_TOPK}")
        self.experts, self.top_k, self.hidden, self.ffn = experts, top_k, hidden, ffn
        #: most experts per streamed copy group (the ring must hold 4 groups for it; smaller rings take smaller)
        self.group_experts = int(group_experts)
        #: most cached experts per grouped GEMM call (0: every hit of the layer in one call)
        self.hit_batch_experts = int(hit_batch_experts)
        #: when a list, prefill_layer appends (name, event) at its stages; trace_report() reads them
        self.trace: list | None = None
        #: FFN rows each warp of the decode gate/up kernel computes (compiled in)
        self.decode_rows_per_warp = int(decode_rows_per_warp)
        #: how the third-form Q8_0 decode pair is compiled (Q8_DECODE_VARIANTS; compiled in)
        self.q8_decode = q8_decode or Q8_DECODE
        if self.q8_decode not in Q8_DECODE_VARIANTS:
            raise ValueError(f"FastMoE: q8_decode {self.q8_decode!r} is not one of {sorted(Q8_DECODE_VARIANTS)}")
        self._module = cupy.RawModule(code=kernel_source(),
                                      options=module_options(self.decode_rows_per_warp, self.q8_decode))
        self._k = {n: self._module.get_function(n) for n in KERNEL_NAMES}
        #: decode kernels launched as programmatic dependent launches (pdl.py) where the driver allows
        self.decode_pdl = DECODE_PDL
        #: the decode stack's kernels: 1 the first forms, 2 the second, DECODE_THIRD's the third (DECODE_FORM)
        self.decode_form = DECODE_FORM
        # made here, outside any capture (the device query and the driver library load are not stream work)
        self._pdl = _launcher(cupy)
        self.compute_stream = cupy.cuda.Stream(non_blocking=True)
        self.copy_stream = cupy.cuda.Stream(non_blocking=True)
        self._handle = cupy.cuda.device.get_cublas_handle()
        self._blas = _BlasExtra()
        #: the expert GEMMs' mode (GEMM_MODES): grouped where this cuBLAS has it, else classes, else loop
        self.gemm_mode = gemm_mode or ("classes" if self._blas.batched else "loop")
        needs = {"classes": self._blas.batched, "grouped-classes": self._blas.grouped, "grouped": self._blas.grouped,
                 "loop": True}
        if not needs.get(self.gemm_mode):
            raise ValueError(f"FastMoE: gemm_mode {self.gemm_mode!r} is not available here")
        #: class modes: groups above this many rows run as pieces of it (SPLIT_ROWS; 0: whole groups)
        self.split_rows = SPLIT_ROWS
        #: the fewest stack rows a group gets in the class modes (CLASS_FLOOR_ROWS); the stack's bound grows with it
        self.class_floor = CLASS_FLOOR_ROWS
        # side streams for the size classes, each with its own cuBLAS handle (a handle's workspace is not shared
        # between streams that run at once)
        self._side = side_lanes(max(0, int(gemm_streams) - 1)) if self.gemm_mode == "classes" else []
        # page-locked staging of the GEMMs' device pointer arrays, used from a cursor that restarts once the last
        # upload from it has run (an event), so the host never overwrites a table a queued copy still reads
        # (room for a layer's two projections with hot experts split into pieces, so the cursor need not restart)
        n_ptr = 64 * max(experts, 64)
        self._ptr_mem = self._page_locked(8 * n_ptr)
        self._ptr_stage = np.frombuffer(self._ptr_mem, dtype=np.int64, count=n_ptr)
        self._ptr_dev = cupy.cuda.alloc(8 * n_ptr)
        self._ptr_cursor = 0
        self._ptr_done = cupy.cuda.Event(disable_timing=True)
        # alpha/beta live on the host for the whole life of the object: cuBLAS reads them at enqueue time
        self._one = np.ones(1, dtype=np.float32)
        self._zero = np.zeros(1, dtype=np.float32)
        # page-locked staging: small tables to the device (block map, slot map) and counts/ids back, all async
        n_stage = 4 * max(experts, 64)
        self._stage_mem = self._page_locked(4 * n_stage)
        self._stage = np.frombuffer(self._stage_mem, dtype=np.int32, count=n_stage)
        self._back_mem = self._page_locked(4 * max(experts, MAX_TOPK))
        self._back = np.frombuffer(self._back_mem, dtype=np.int32, count=max(experts, MAX_TOPK))
        # the device-table path's rotating staging: slot maps up and counts back, DEFERRED_COUNTS layers of each,
        # an entry reused once the event after its last copy has passed
        n_rot = 2 * DEFERRED_COUNTS * experts
        self._rot_mem = self._page_locked(4 * n_rot)
        self._rot = np.frombuffer(self._rot_mem, dtype=np.int32, count=n_rot).reshape(2 * DEFERRED_COUNTS, experts)
        self._rot_done: list = [None] * DEFERRED_COUNTS
        self._rot_next = 0
        #: (event, entry, on_counts) of device-table layers whose counts on_counts has not seen yet, oldest first
        self._pending_counts: list = []
        #: triton_moe.DeviceGroupedGEMM for cached f16 layers (DEVICE_GEMM; None: the cuBLAS modes only)
        self.device_gemm = self._device_gemm() if DEVICE_GEMM else None
        self._synced = cupy.cuda.Event(disable_timing=True)
        self._ws = {n: _Grown(cupy) for n in ("route", "xs", "gu", "act", "ys")}
        #: decode_layer replays a captured graph per set of buffers (False: two plain launches per call)
        self.decode_graphs = True
        self._graphs: dict[tuple, Any] = {}
        self._capture_stream = cupy.cuda.Stream(non_blocking=True)
        self.stats = LayerStats()
        #: prefill_layer's ring streaming takes a group prefetch_misses queued (PREFETCH_MISSES)
        self.prefetch_misses_on = PREFETCH_MISSES
        self.copy_groups_ahead = COPY_GROUPS_AHEAD
        self.pull_small_copies = PULL_SMALL_COPIES
        self._mapped: dict[int, int] = {}
        self._prefetched: tuple | None = None
        # ring slot -> the event after its last reader (the group that computed from it, or the layer ops' copy from
        # it into the cache, ring_read): what a prefetch into that slot must wait for
        self._ring_done: dict[int, Any] = {}
        # (the ring's slots as bytes, the slot after its last layer's last group): ring_placement's start
        self._ring_cursor: tuple[bytes, int] | None = None

    # -- small helpers -----------------------------------------------------------------------------------------

    def _device_gemm(self, gate_up: Any = None, down: Any = None) -> Any:
        """triton_moe's launches for this shape, or None where Triton is missing or the shape does not tile."""
        from . import triton_moe
        if not triton_moe.available():
            return None
        if gate_up is None and down is None:
            got = triton_moe.fitted(self.hidden, self.ffn)  # the defaults, narrowed to tile a small shape
            if got is None:
                return None
            cfg_gu, cfg_dn = got
        else:
            cfg_gu = triton_moe.TileConfig.parse(gate_up, triton_moe.DEFAULT_CONFIG)
            cfg_dn = triton_moe.TileConfig.parse(down, triton_moe.DOWN_CONFIG)
        if not triton_moe.DeviceGroupedGEMM.takes(self.hidden, self.ffn, cfg_gu, cfg_dn):
            return None
        return triton_moe.DeviceGroupedGEMM(self.hidden, self.ffn, self.experts, cfg_gu, cfg_dn)

    def set_device_gemm(self, spec: str | None) -> None:
        """Turn the device-table path off ("off") or on with tile configs "BM:BN:BK:warps:stages[/BM:BN:BK:w:s]"
        (gate|up, then down; "" or None: the defaults)."""
        if spec == "off":
            self.device_gemm = None
            return
        parts = (spec or "").split("/") if spec else []
        self.device_gemm = self._device_gemm(parts[0] if parts else None, parts[1] if len(parts) > 1 else None)

    def flush_counts(self, wait: bool = True) -> int:
        """Hand the device-table layers' counts to their on_counts, oldest first: all of them (waiting for their
        copies), or with wait=False those already landed; how many are still pending."""
        while self._pending_counts and (wait or self._pending_counts[0][0].done):
            self._flush_one()
        return len(self._pending_counts)

    def _rot_entry(self) -> int:
        """The next rotating staging entry, once its last copies have passed (its pending counts handed on first)."""
        i = self._rot_next
        self._rot_next = (i + 1) % DEFERRED_COUNTS
        while any(p[1] == i for p in self._pending_counts):
            self._flush_one()
        if self._rot_done[i] is not None:
            self._rot_done[i].synchronize()
        return i

    def _flush_one(self) -> None:
        """Hand the oldest pending layer's counts to its on_counts (waiting for their copy)."""
        ev, entry, cb = self._pending_counts.pop(0)
        ev.synchronize()
        cb(self._rot[DEFERRED_COUNTS + entry].astype(np.int64))

    def _page_locked(self, nbytes: int) -> Any:
        """nbytes of page-locked host staging (a buffer np.frombuffer reads): from the session's pinned allocator's
        runtime floor, so the plan's pinned budget counts it; else cupy's own, outside the plan (counted here)."""
        buf = self._pinned.alloc(int(nbytes), from_floor=True) if self._pinned is not None else None
        if buf is not None:
            self._pinned_bufs.append(buf)
            return buf.array
        self.staging_outside_plan_bytes += int(nbytes)
        return self._cp.cuda.alloc_pinned_memory(int(nbytes))

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

    def device_view(self, host_ptr: int) -> int:
        """The address kernels read page-locked host memory at (cached per address; 0: not mapped for the device)."""
        got = self._mapped.get(int(host_ptr))
        if got is None:
            got = self._mapped[int(host_ptr)] = int(self.host_mapping_report([int(host_ptr)])[0]["device_ptr"])
        return got

    def pull(self, dst: int, src: int, nbytes: int, stream: Any = None, host_base: int | None = None) -> bool:
        """Copy nbytes (a multiple of 4) from src to dst with the pull kernels on `stream` (default: the current
        one). src is device memory, or with host_base the address of page-locked host memory inside the buffer
        starting at host_base. False, with nothing queued, when that buffer is not mapped for the device or the size
        is not whole words (the caller copies with memcpy then)."""
        if nbytes <= 0:
            return True
        if nbytes % 4:
            return False
        if host_base is not None:
            view = self.device_view(host_base)
            if not view:
                return False
            src = view + (int(src) - int(host_base))
        st = stream or self._cp.cuda.get_current_stream()
        wide = nbytes % 16 == 0 and src % 16 == 0 and dst % 16 == 0
        n = nbytes // 16 if wide else nbytes // 4
        self._k["strata_fast_pull_u4" if wide else "strata_fast_pull_words"](
            (max(1, min(4096, -(-n // THREADS))),), (THREADS,), (np.uint64(src), np.uint64(dst), np.int64(n)),
            stream=st)
        return True

    def _h2d_small(self, dst: int, base: int, offset: int, nbytes: int, stream: Any) -> None:
        """A small table at `offset` bytes into the page-locked staging at `base` to the device, on `stream`:
        pulled by a kernel (PULL_SMALL_COPIES) where the staging is mapped, else cudaMemcpyAsync."""
        if not (self.pull_small_copies and self.pull(dst, base + offset, nbytes, stream, host_base=base)):
            self._rt.memcpyAsync(dst, base + offset, nbytes, _MEMCPY_H2D, stream.ptr)

    def _upload_ptrs(self, values: np.ndarray) -> int:
        """Copy an int64 table (device pointers) to the device through the pointer staging; its device address."""
        n = int(values.size)
        if self._ptr_cursor + n > self._ptr_stage.size:
            self._ptr_done.synchronize()  # every earlier table has been copied: start the staging over
            self._ptr_cursor = 0
        if n > self._ptr_stage.size:
            raise ValueError(f"FastMoE: {n} GEMM pointers exceed the staging of {self._ptr_stage.size}")
        c = self._ptr_cursor
        self._ptr_stage[c:c + n] = values
        dst = int(self._ptr_dev.ptr) + 8 * c
        st = self._cp.cuda.get_current_stream()
        self._h2d_small(dst, int(self._ptr_stage.ctypes.data), 8 * c, 8 * n, st)
        self._ptr_done.record(st)
        self._ptr_cursor = c + n
        return dst

    def _gemm_problems(self, m: int, k: int, lda: int, ldb: int, ldc: int, a_ptrs: np.ndarray, b_ptrs: np.ndarray,
                       c_ptrs: np.ndarray, ns: np.ndarray) -> None:
        """C_j[m,n_j] = A_j^T B_j (column-major; row-major C_rows = B_rows @ A_rows^T) for every problem j, f16 in and
        out, f32 sums, on the current stream, in this object's gemm_mode (one call, one call per size, or a loop)."""
        ns = np.asarray(ns, dtype=np.int64)
        live = np.nonzero(ns > 0)[0]
        if live.size == 0:
            return
        cb = self._cublas
        cb.setStream(self._handle, self._cp.cuda.get_current_stream().ptr)
        cb.setPointerMode(self._handle, _CUBLAS_POINTER_MODE_HOST)
        if self.gemm_mode == "loop":
            for j in live:
                self._gemm_tn(m, int(ns[j]), k, int(a_ptrs[j]), lda, 0, int(b_ptrs[j]), ldb, 0, int(c_ptrs[j]), ldc,
                              0, 1)
            return
        order = live[np.argsort(ns[live], kind="stable")]
        sizes, first, per = np.unique(ns[order], return_index=True, return_counts=True)
        n_p = int(order.size)
        a_d = self._upload_ptrs(np.concatenate([np.asarray(a_ptrs, dtype=np.int64)[order],
                                                np.asarray(b_ptrs, dtype=np.int64)[order],
                                                np.asarray(c_ptrs, dtype=np.int64)[order]]))
        b_d, c_d = a_d + 8 * n_p, a_d + 16 * n_p
        if self.gemm_mode == "classes":
            main = self._cp.cuda.get_current_stream()
            lanes = [(main, self._handle)]
            if self._side and sizes.size > 1 and live.size >= SIDE_STREAM_MIN_PROBLEMS:
                # the fork and join events are made once: a wait takes the event's last record at enqueue time
                fork = self._fork_join()[0]
                fork.record(main)
                for side, _ in self._side:
                    side.wait_event(fork)
                lanes += self._side
            # largest classes first, dealt round the lanes, so each lane gets a share of the heavy work; alpha and
            # beta by address read once (numpy's .ctypes builds an object per access, twice a call)
            one, zero, batched = self._one.ctypes.data, self._zero.ctypes.data, self._blas.batched
            for j, c in enumerate(np.argsort(-sizes, kind="stable").tolist()):
                stream, hnd = lanes[j % len(lanes)]
                cb.setStream(hnd, stream.ptr)
                n, f0, cnt = int(sizes[c]), int(first[c]), int(per[c])
                st = batched(hnd, _CUBLAS_OP_T, _CUBLAS_OP_N, m, n, k, one, a_d + 8 * f0, _CUDA_R_16F, lda,
                             b_d + 8 * f0, _CUDA_R_16F, ldb, zero, c_d + 8 * f0, _CUDA_R_16F, ldc, cnt,
                             _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT)
                if st:
                    raise RuntimeError(f"cublasGemmBatchedEx failed with status {st}")
            for (side, _), join in zip(lanes[1:], self._fork_join()[1:]):
                join.record(side)
                main.wait_event(join)
            return
        g = int(sizes.size)
        # host arrays cuBLAS reads during the call; kept on self so nothing is collected before it returns
        self._gg = {"ta": np.full(g, _CUBLAS_OP_T, np.int32), "tb": np.full(g, _CUBLAS_OP_N, np.int32),
                    "m": np.full(g, m, np.int32), "n": sizes.astype(np.int32), "k": np.full(g, k, np.int32),
                    "lda": np.full(g, lda, np.int32), "ldb": np.full(g, ldb, np.int32),
                    "ldc": np.full(g, ldc, np.int32), "alpha": np.ones(g, np.float32),
                    "beta": np.zeros(g, np.float32), "size": per.astype(np.int32)}
        a = {kk: v.ctypes.data for kk, v in self._gg.items()}
        st = self._blas.grouped(self._handle, a["ta"], a["tb"], a["m"], a["n"], a["k"], a["alpha"], a_d,
                                _CUDA_R_16F, a["lda"], b_d, _CUDA_R_16F, a["ldb"], a["beta"], c_d, _CUDA_R_16F,
                                a["ldc"], g, a["size"], _CUBLAS_COMPUTE_32F)
        if st:
            raise RuntimeError(f"cublasGemmGroupedBatchedEx failed with status {st}")

    def _class_floor(self) -> int:
        """moe_fast.cu's stack_cap mode: 0 rounds groups to ROW_ALIGN, else the class floor in rows."""
        return max(ROW_ALIGN, int(self.class_floor)) if self.gemm_mode in CLASS_MODES else 0

    def _fork_join(self) -> list:
        """The fork event and one join event per side lane, made on first use."""
        ev = self.__dict__.get("_fj")
        if ev is None:
            ev = self._fj = [self._cp.cuda.Event(disable_timing=True) for _ in range(1 + len(self._side))]
        return ev

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
        self._cp.cuda.Device().synchronize()
        t0 = self.trace[0][1]
        return [(n, self._cp.cuda.get_elapsed_time(t0, ev)) for n, ev in self.trace]

    def kernel_report(self) -> dict[str, dict[str, int]]:
        """Registers, local (spilled) bytes and static shared bytes of every kernel, as the driver loaded them."""
        return {n: {"regs": int(k.num_regs), "local_bytes": int(k.local_size_bytes),
                    "shared_bytes": int(k.shared_size_bytes)} for n, k in self._k.items()}

    def _upload_i32(self, dst_ptr: int, values: np.ndarray, offset: int = 0) -> None:
        """Copy a small int32 table to the device through page-locked staging, async on the current stream. The
        caller has synchronized since the last use of this staging range (every path here syncs once per call)."""
        n = int(values.size)
        self._stage[offset:offset + n] = values
        self._h2d_small(dst_ptr, int(self._stage.ctypes.data), 4 * offset, 4 * n, self._cp.cuda.get_current_stream())

    def _download_i32(self, src_ptr: int, n: int) -> np.ndarray:
        """Copy n int32 from the device into page-locked memory and wait for just that copy (not later work)."""
        st = self._cp.cuda.get_current_stream()
        self._rt.memcpyAsync(self._back.ctypes.data, src_ptr, 4 * n, 2, st.ptr)
        self._synced.record(st)
        self._synced.synchronize()
        return self._back[:n]

    # -- routing -----------------------------------------------------------------------------------------------

    def _route_ptrs(self, t: int) -> tuple[int, int, int, int, int]:
        """(ids, weights, pos, rowidx, counts) pointers of a t-token routing workspace."""
        tk = t * self.top_k
        base = self._ws["route"].ptr(4 * (4 * tk + self.experts))
        return base, base + 4 * tk, base + 8 * tk, base + 12 * tk, base + 16 * tk

    def _launch_route(self, logits: Any, t: int) -> tuple[int, int, int, int, int]:
        ids, wts, pos, rowidx, counts = self._route_ptrs(t)
        warps = THREADS // WARP_LANES
        self._k["strata_fast_route"](((t + warps - 1) // warps,), (THREADS,),
                                     (logits, np.int32(t), np.int32(self.experts), np.int32(self.top_k),
                                      np.uint64(ids), np.uint64(wts)))
        self._k["strata_fast_positions"]((self.experts,), (THREADS,),
                                         (np.uint64(ids), np.int32(t * self.top_k), np.uint64(pos), np.uint64(counts)))
        return ids, wts, pos, rowidx, counts

    def route(self, logits: Any) -> tuple[Any, Any, Any, Any]:
        """[T,E] f32 logits -> (ids [T,K] int32, weights [T,K] f32, pos [T,K] int32, counts [E] int32), as new
        device arrays (copies of the workspace), on the current stream."""
        cp = self._cp
        t = int(logits.shape[0])
        ids, wts, pos, _, counts = self._launch_route(logits, t)
        out = []
        for ptr, shape, dt in ((ids, (t, self.top_k), cp.int32), (wts, (t, self.top_k), cp.float32),
                               (pos, (t, self.top_k), cp.int32), (counts, (self.experts,), cp.int32)):
            a = cp.empty(shape, dtype=dt)
            self._rt.memcpyAsync(a.data.ptr, ptr, a.nbytes, 3, cp.cuda.get_current_stream().ptr)
            out.append(a)
        return tuple(out)

    # -- prefill -----------------------------------------------------------------------------------------------

    def prefill_layer(self, x: Any, logits: Any, pool: ExpertPool, slot_of_expert: np.ndarray,
                      host_pool: ExpertPool | None = None, ring: Any = None, out: Any = None,
                      accumulate: bool = False, on_counts: Any = None) -> Any:
        """One MoE layer over a chunk: x [T,H] f32, logits [T,E] f32 -> y [T,H] f32 (see the module docstring).

        slot_of_expert [E] (host int32): the pool slot holding each expert, -1 when missed. Missed experts are
        copied from host_pool (page-locked arrays, indexed by expert id) into the ring, pool slots whose earlier
        contents are no longer needed: (first, count) for a run, or an array of slots. Runs on `compute_stream`;
        `out` (a [T,H] f32 device array) is written in place when given, or added to with `accumulate`.
        on_counts(counts [E] host int64), when given, is called once the counts are known and returns the slot map
        to run with: either every miss given a slot (admitted; its copy already ordered before this stream's next
        work) or none (they stream through the ring).
        """
        if ring is not None and not isinstance(ring, np.ndarray):
            ring = np.arange(int(ring[0]), int(ring[0]) + int(ring[1]), dtype=np.int64)
        with self.compute_stream:
            return self._prefill(x, logits, pool, np.asarray(slot_of_expert, dtype=np.int64), host_pool, ring, out,
                                 accumulate, on_counts)

    def warm_prefill_layer(self, x: Any, logits: Any, pool: ExpertPool, slot_of_expert: np.ndarray) -> Any:
        """prefill_layer with every routed expert cached (raises if one is not)."""
        return self.prefill_layer(x, logits, pool, slot_of_expert)

    def cold_prefill_layer(self, x: Any, logits: Any, pool: ExpertPool, host_pool: ExpertPool,
                           ring: tuple[int, int]) -> Any:
        """prefill_layer with every expert missed and streamed through the ring."""
        return self.prefill_layer(x, logits, pool, np.full(self.experts, -1, dtype=np.int64), host_pool, ring)

    def stack_rows_bound(self, tokens: int) -> int:
        """The most rows the compact stack of a `tokens`-token chunk can take in this gemm mode (any routing)."""
        routed = tokens * self.top_k
        if self.gemm_mode in CLASS_MODES:
            # a class holds at most 1.5x its rows plus ROW_ALIGN, or the floor (class_rows)
            return (3 * routed) // 2 + (ROW_ALIGN + max(ROW_ALIGN, self.class_floor)) * self.experts
        return routed + ROW_ALIGN * self.experts

    def prefill_buffer_bytes(self, tokens: int, pool_dtype: str, slot_bytes: int = 0) -> dict[str, int]:
        """Bytes of each prefill work buffer (PREFILL_BUFFERS) a `tokens`-token chunk can need, any routing: what a
        caller lends with use_buffers so the layer allocates nothing. Q8_0 pools add the dequantization scratch of
        the largest group (hit batches of group_experts; streamed groups as miss_groups sizes them)."""
        h, f, k, e = self.hidden, self.ffn, self.top_k, self.experts
        rows = self.stack_rows_bound(tokens)
        out = {"route": 4 * (4 * tokens * k + e), "maps": 16 * e, "xs": 2 * rows * h, "gu": 2 * rows * 2 * f,
               "act": 2 * rows * f, "ys": 2 * rows * h, "scratch": 0}
        if pool_dtype == "q8_0":
            m = max(self.group_experts, COPY_GROUP_BYTES // slot_bytes if slot_bytes > 0 else 0, 1)
            out["scratch"] = 2 * min(m, e) * (3 * h * f)
        elif pool_dtype == "gguf":  # quant_ffn.QuantMoE's f16 dequantization scratch, bounded by the plan's budget
            from .quant_ffn import SCRATCH_BUDGET_BYTES, scratch_layout
            # carved first: the workspace line holds it beside a short chunk's buffers
            out = {"scratch": scratch_layout(h, f, e, SCRATCH_BUDGET_BYTES).nbytes,
                   **{n: b for n, b in out.items() if n != "scratch"}}
        return out

    def use_buffers(self, buffers: dict[str, tuple[int, int]] | None) -> None:
        """Run prefill layers in the caller's buffers ({name: (address, bytes)} for PREFILL_BUFFERS), or, with None,
        in buffers of its own again (grown on demand from cupy's pool)."""
        if buffers is None:
            self._ws = self.__dict__.get("_own_ws") or self._ws
            return
        self.__dict__.setdefault("_own_ws", self._ws)
        self._ws = {n: _Given(p, b) for n, (p, b) in buffers.items()}

    def _stack_bufs(self, ws: dict, rows: int) -> tuple[int, int, int, int]:
        """(xs, gu, act, ys) f16 stacks of `rows` rows: inputs [rows,H], gate|up [rows,2F], SwiGLU [rows,F], out [rows,H]."""
        h, f = self.hidden, self.ffn
        return (ws["xs"].ptr(2 * rows * h), ws["gu"].ptr(2 * rows * 2 * f), ws["act"].ptr(2 * rows * f),
                ws["ys"].ptr(2 * rows * h))

    def _prefill(self, x: Any, logits: Any, pool: ExpertPool, slot_of: np.ndarray, host_pool: ExpertPool | None,
                 ring: np.ndarray | None, out: Any, accumulate: bool = False, on_counts: Any = None) -> Any:
        self.flush_counts(wait=False)
        if self.device_gemm is not None and slot_of.size and bool((slot_of >= 0).all()) and \
                self._device_takes(pool, int(x.shape[0])):
            return self._prefill_device(x, logits, pool, slot_of, out, accumulate, on_counts)
        cp = self._cp
        t, h = int(x.shape[0]), self.hidden
        kk, e_n = self.top_k, self.experts
        st = self._cp.cuda.get_current_stream()
        self._mark("start")
        maps = self._ws.setdefault("maps", _Grown(cp)).ptr(16 * e_n)
        slot_d, row_of_d = maps, maps + 4 * e_n
        self._upload_i32(slot_d, np.where(slot_of >= 0, 1, -1).astype(np.int32))
        ids, wts, pos, rowidx, counts = self._launch_route(logits, t)
        self._k["strata_fast_offsets"]((1,), (THREADS,), (np.uint64(counts), np.uint64(slot_d), np.int32(e_n),
                                                          np.int32(self._class_floor()),
                                                          np.uint64(row_of_d)))
        self._mark("routed")
        # the one host sync of a prefill layer: row counts decide the GEMM sizes and which experts to fetch; the
        # gather (its offsets computed on the device, as the host computes them below) runs while the host waits
        self._rt.memcpyAsync(self._back.ctypes.data, counts, 4 * e_n, 2, st.ptr)
        self._synced.record(st)
        # ring copies may begin once the compute stream is past every earlier reader of the ring (previous layers)
        start = cp.cuda.Event(disable_timing=True)
        start.record()
        # the input stack is sized for the most rows any routing can need, so the gather need not wait for the counts
        xs = self._ws["xs"].ptr(2 * self.stack_rows_bound(t) * h)
        self._k["strata_fast_gather"]((t,), (THREADS,),
                                      (x, np.uint64(ids), np.uint64(pos), np.uint64(row_of_d), np.int32(t),
                                       np.int32(kk), np.int32(h), np.uint64(xs), np.uint64(rowidx)))
        self._synced.synchronize()
        counts_h = self._back[:e_n].astype(np.int64)
        # every pointer table uploaded before this point has been copied (it preceded the counts on this stream)
        self._ptr_cursor = 0
        used = counts_h > 0
        hits = np.nonzero(used & (slot_of >= 0))[0]
        misses = np.nonzero(used & (slot_of < 0))[0]
        if on_counts is not None:
            new = np.asarray(on_counts(counts_h), dtype=np.int64)
            placed = new[misses] >= 0
            if placed.any() and not placed.all():
                raise ValueError("prefill_layer: on_counts must give every miss a slot or none")
            slot_of = new
            if placed.any():
                # every miss admitted: all blocks run as hits, in the device's order (hits, then the former misses)
                hits, misses = np.concatenate([hits, misses]), misses[:0]
        spent = self._take_prefetch() if not misses.size else None  # nothing streams: a prefetch was spent
        if misses.size and (host_pool is None or ring is None or ring.size == 0):
            raise ValueError(f"prefill_layer: {misses.size} experts are not cached and no host pool/ring was given")
        order = np.concatenate([hits, misses])
        g_n = int(order.size)
        lay = StackLayout.of(counts_h[order], self.gemm_mode, self.class_floor)
        self.stats = LayerStats(experts_used=g_n, hits=int(hits.size), misses=int(misses.size), stack_rows=lay.rows,
                                routed_rows=t * kk, routed_rows_hit=int(counts_h[hits].sum()))
        if spent is not None:
            self.stats.prefetch, self.stats.bytes_streamed = "spent", int(spent[4])
            st.wait_event(spent[3])  # later writers of those slots (the cache's admissions) come after this stream
        if out is None:
            out = cp.empty((t, h), dtype=cp.float32)
        if g_n == 0:
            if not accumulate:
                out.fill(0)
            return out
        bufs = self._stack_bufs(self._ws, lay.rows)
        assert bufs[0] == xs, "the input stack grew after the gather"
        self._mark("planned")

        def run_hits() -> None:
            if not hits.size:
                return
            if self.device_gemm is not None and pool.dtype in HITS_DEVICE_DTYPES:
                self._device_hits(pool, slot_of, hits, counts_h, maps, bufs)
            else:
                self._run_blocks(pool, slot_of[hits], 0, lay, bufs)
            self._mark("hits_done")

        if misses.size:
            # the first copies are queued before the hits' GEMMs, so the link starts at once
            self._stream_misses(misses.tolist(), pool, host_pool, ring, int(hits.size), lay, bufs, start, run_hits)
        else:
            run_hits()
        self._k["strata_fast_combine"]((t,), (THREADS,), (np.uint64(bufs[3]), np.uint64(rowidx), np.uint64(wts),
                                                          np.int32(t), np.int32(kk), np.int32(h), out,
                                                          np.int32(bool(accumulate))))
        self._mark("end")
        return out

    def _prefill_device(self, x: Any, logits: Any, pool: ExpertPool, slot_of: np.ndarray, out: Any,
                        accumulate: bool, on_counts: Any) -> Any:
        """_prefill for a layer whose every expert is cached: route, offsets and gather as there, then triton_moe's
        two launches read the counts, offsets and slots on the device; no host sync. The counts go back to
        page-locked staging, and on_counts (its answer unused: with nothing missed there is nothing to admit) sees
        them at a later flush_counts."""
        cp = self._cp
        t, h, f = int(x.shape[0]), self.hidden, self.ffn
        kk, e_n = self.top_k, self.experts
        st = cp.cuda.get_current_stream()
        self._mark("start")
        maps = self._ws.setdefault("maps", _Grown(cp)).ptr(16 * e_n)
        slot_d, row_of_d = maps, maps + 4 * e_n
        i = self._rot_entry()
        self._rot[i] = slot_of.astype(np.int32)
        self._h2d_small(slot_d, int(self._rot.ctypes.data), 4 * i * e_n, 4 * e_n, st)
        ids, wts, pos, rowidx, counts = self._launch_route(logits, t)
        self._k["strata_fast_offsets"]((1,), (THREADS,), (np.uint64(counts), np.uint64(slot_d), np.int32(e_n),
                                                          np.int32(0), np.uint64(row_of_d)))
        self._mark("routed")
        self._rt.memcpyAsync(int(self._rot[DEFERRED_COUNTS + i].ctypes.data), counts, 4 * e_n, 2, st.ptr)
        landed = cp.cuda.Event(disable_timing=True)
        landed.record(st)
        self._rot_done[i] = landed
        if on_counts is not None:
            self._pending_counts.append((landed, i, on_counts))
        self.stats = LayerStats(routed_rows=t * kk, routed_rows_hit=t * kk, device_table=True)
        spent = self._take_prefetch()
        if spent is not None:
            self.stats.prefetch, self.stats.bytes_streamed = "spent", int(spent[4])
            st.wait_event(spent[3])
        rows = self.stack_rows_bound(t)
        xs, act, ys = (self._ws[n].ptr(2 * rows * w) for n, w in (("xs", h), ("act", f), ("ys", h)))
        self._k["strata_fast_gather"]((t,), (THREADS,),
                                      (x, np.uint64(ids), np.uint64(pos), np.uint64(row_of_d), np.int32(t),
                                       np.int32(kk), np.int32(h), np.uint64(xs), np.uint64(rowidx)))
        self._mark("planned")
        self._device_experts(pool, slot_of, xs, act, ys, counts, row_of_d, slot_d, t * kk)
        self._mark("hits_done")
        if out is None:
            out = cp.empty((t, h), dtype=cp.float32)
        self._k["strata_fast_combine"]((t,), (THREADS,), (np.uint64(ys), np.uint64(rowidx), np.uint64(wts),
                                                          np.int32(t), np.int32(kk), np.int32(h), out,
                                                          np.int32(bool(accumulate))))
        self._mark("end")
        return out

    def _device_hits(self, pool: ExpertPool, slot_of: np.ndarray, hits: np.ndarray, counts_h: np.ndarray, maps: int,
                     bufs: tuple) -> None:
        """A streamed layer's cached experts in one pair of device-table launches (HITS_DEVICE_DTYPES): their
        counts (every other expert 0) and slots uploaded beside the layer's row offsets (maps: slots, rows, these),
        each expert's rows where the stack layout put them, written to act and ys as the class path writes them."""
        e_n = self.experts
        cnt = np.zeros(e_n, dtype=np.int32)
        cnt[hits] = counts_h[hits]
        slots = np.where(cnt > 0, slot_of, 0).astype(np.int32)
        hit_counts, hit_slots = maps + 8 * e_n, maps + 12 * e_n
        # staging entries E.. and 3E..: the first E carried this layer's slot signs and 2E.. is decode's
        # (_decode_layer_misses), whose host writes could overtake these copies; the counts sync came after every
        # earlier layer's copies from here
        self._upload_i32(hit_counts, cnt, e_n)
        self._upload_i32(hit_slots, slots, 3 * e_n)
        xs, _, act, ys = bufs
        self._device_experts(pool, slot_of, xs, act, ys, hit_counts, maps + 4 * e_n, hit_slots, int(cnt.sum()))
        self.stats.device_hits = True

    def _device_takes(self, pool: ExpertPool, tokens: int) -> bool:
        """Whether a layer of this pool, every expert cached, runs on the device-table path (f16 and Q8_0 pools
        here: Q8_0 quants decoded in the K loop)."""
        return pool.dtype in DEVICE_TABLE_DTYPES

    def _device_experts(self, pool: ExpertPool, slot_of: np.ndarray, xs: int, act: int, ys: int, counts: int,
                        row_of: int, slot_d: int, routed_rows: int) -> None:
        """The device-table path's expert GEMMs on the current stream: xs -> act -> ys for every expert."""
        a = pool.arrays
        q8 = pool.dtype == "q8_0"
        w13, w2 = (a["gate_up_q"], a["down_q"]) if q8 else (a["w_gate_up"], a["w_down"])
        scales = (int(a["gate_up_d"].data.ptr), int(a["down_d"].data.ptr)) if q8 else None
        self.device_gemm.layer(self._cp.cuda.get_current_stream().ptr, xs, act, ys, int(w13.data.ptr),
                               int(w2.data.ptr), counts, row_of, slot_d, routed_rows, scales=scales)

    def grouped_ffn(self, x: Any, offsets: Any, slots: Any, pool: ExpertPool) -> Any:
        """The KernelSet's moe_grouped_ffn on this path: rows offsets[g]:offsets[g+1] of x [N,H] f32 run slot
        slots[g] -> y [N,H] f32 (rows outside every group are 0), on the caller's current stream."""
        cp = self._cp
        off = np.asarray(offsets.get() if hasattr(offsets, "get") else offsets, dtype=np.int64).reshape(-1)
        sl = np.asarray(slots.get() if hasattr(slots, "get") else slots, dtype=np.int64).reshape(-1)
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        n, h = int(x.shape[0]), self.hidden
        y = cp.zeros((n, h), dtype=cp.float32)
        counts = np.diff(off)
        live = np.nonzero(counts > 0)[0]
        if n == 0 or live.size == 0:
            return y
        # blocks of the stack in slot order (Q8_0 pools dequantize runs of consecutive slots at once)
        order = live[np.argsort(sl[live], kind="stable")]
        lay = StackLayout.of(counts[order], self.gemm_mode, self.class_floor)
        row_of_group = np.zeros(sl.size, dtype=np.int32)
        row_of_group[order] = lay.row0
        r0, r1 = int(off[0]), int(off[-1])  # offsets ascend: the groups cover rows r0..r1-1 exactly
        gid = np.repeat(np.arange(sl.size, dtype=np.int32), counts.clip(min=0))
        pos = (np.arange(r0, r1, dtype=np.int64) - off[gid]).astype(np.int32)
        tab_d, gid_d, pos_d = cp.asarray(row_of_group), cp.asarray(gid), cp.asarray(pos)
        ws = self.__dict__.setdefault("_ws_grouped", {k: _Grown(cp) for k in ("xs", "gu", "act", "ys", "rowidx")})
        bufs = self._stack_bufs(ws, lay.rows)
        rowidx = ws["rowidx"].ptr(4 * (r1 - r0))
        rows = r1 - r0
        # pack: the gather kernel with one 'route' per row (K = 1): row r goes to row_of[group] + pos
        self._k["strata_fast_gather"]((rows,), (THREADS,),
                                      (np.uint64(x.data.ptr + 4 * r0 * h), gid_d, pos_d, tab_d, np.int32(rows),
                                       np.int32(1), np.int32(h), np.uint64(bufs[0]), np.uint64(rowidx)))
        self._run_blocks(pool, sl[order], 0, lay, bufs)
        # unpack: the combine kernel with K = 1 and weight 1 turns each row's f16 result back into f32
        ones = cp.ones(rows, dtype=cp.float32)
        self._k["strata_fast_combine"]((rows,), (THREADS,),
                                       (np.uint64(bufs[3]), np.uint64(rowidx), ones, np.int32(rows), np.int32(1),
                                        np.int32(h), np.uint64(y.data.ptr + 4 * r0 * h), np.int32(0)))
        return y

    def _run_blocks(self, pool: ExpertPool, block_slots: np.ndarray, blk0: int, lay: StackLayout,
                    bufs: tuple) -> None:
        """Blocks blk0.. run slots block_slots[i]: f16 pools in calls of hit_batch_experts (0: all in one); Q8_0
        pools group_experts at a time, dequantized into scratch first."""
        n = len(block_slots)
        step = self.group_experts if pool.dtype == "q8_0" else (self.hit_batch_experts or n)
        step = max(1, step)
        for sub in range(0, n, step):
            m = min(n - sub, step)
            self._group(pool, np.asarray(block_slots[sub:sub + m], dtype=np.int64), blk0 + sub, lay, bufs)

    def _weights_f16(self, pool: ExpertPool, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Device pointers of each slot's f16 gate|up and down matrices (Q8_0: dequantized into scratch on this
        stream, one pair of launches per run of consecutive slots)."""
        h, f = self.hidden, self.ffn
        a = pool.arrays
        n13, n2 = 2 * f * h, h * f
        if pool.dtype == "f16":
            return (a["w_gate_up"].data.ptr + slots * (2 * n13), a["w_down"].data.ptr + slots * (2 * n2))
        m = len(slots)
        scratch = self._ws.setdefault("scratch", _Grown(self._cp)).ptr(2 * m * (n13 + n2))
        s13, s2 = scratch, scratch + 2 * m * n13
        for first, slot0, run in slot_runs(slots.tolist()):
            for q, d, per, dst in ((a["gate_up_q"], a["gate_up_d"], n13, s13), (a["down_q"], a["down_d"], n2, s2)):
                n = run * per
                self._k["strata_fast_dequant_q8_0"]((self._stride_blocks(n // 16),), (THREADS,),
                                                    (np.uint64(q.data.ptr + slot0 * per),
                                                     np.uint64(d.data.ptr + slot0 * (per // QK8_0) * 2),
                                                     np.int64(n), np.uint64(dst + 2 * first * per)))
        idx = np.arange(m, dtype=np.int64)
        return s13 + idx * (2 * n13), s2 + idx * (2 * n2)

    def _group(self, pool: ExpertPool, slots: np.ndarray, blk0: int, lay: StackLayout, bufs: tuple) -> None:
        """Run the experts in `slots` over stack blocks blk0..blk0+len(slots)-1: gate|up GEMMs, SwiGLU, down GEMMs."""
        h, f = self.hidden, self.ffn
        xs, gu, act, ys = bufs
        m = len(slots)
        w13, w2 = self._weights_f16(pool, slots)
        row0 = lay.row0[blk0:blk0 + m]
        if self.gemm_mode in CLASS_MODES:
            # hot experts run as pieces of split_rows rows beside the others (grouping.gemm_pieces)
            blk, off, ns = gemm_pieces(lay.count[blk0:blk0 + m], lay.cap[blk0:blk0 + m], self.split_rows,
                                       lambda c: class_rows(c, self.class_floor))
            w13, w2, prow = w13[blk], w2[blk], row0[blk] + off
        else:
            ns, prow = lay.count[blk0:blk0 + m], row0
        self.stats.gemm_problems += int(np.count_nonzero(ns))
        self._gemm_problems(2 * f, h, h, h, 2 * f, w13, xs + 2 * prow * h, gu + 2 * prow * 2 * f, ns)
        r_first = int(row0[0])
        r_n = int(row0[-1] + lay.cap[blk0 + m - 1]) - r_first
        self._k["strata_fast_swiglu"]((self._stride_blocks(r_n * (f // 8)),), (THREADS,),
                                      (np.uint64(gu), np.int64(r_first), np.int64(r_n), np.int32(f), np.uint64(act)))
        self._gemm_problems(h, f, f, f, h, w2, act + 2 * prow * f, ys + 2 * prow * h, ns)

    def _copy_experts(self, pool: ExpertPool, host_pool: ExpertPool, experts: list[int], slots: Sequence[int],
                      names: Sequence[str] | None = None) -> int:
        """Enqueue host->device copies of `experts` into `slots` on the copy stream (arrays `names`, default all);
        runs of consecutive expert ids landing in consecutive slots go as one copy per array. Returns the bytes."""
        total = 0
        stream = self.copy_stream.ptr
        runs: list[tuple[int, int, int]] = []  # (expert, slot, count)
        for e, sl in zip(experts, slots):
            e, sl = int(e), int(sl)
            if runs and runs[-1][0] + runs[-1][2] == e and runs[-1][1] + runs[-1][2] == sl:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((e, sl, 1))
        for e0, s0, n in runs:
            for name in names or pool.arrays:
                dev, src = pool.arrays[name], host_pool.arrays[name]
                per = int(src.strides[0])
                self._rt.memcpyAsync(dev.data.ptr + s0 * int(dev.strides[0]), src.ctypes.data + e0 * per,
                                     n * per, _MEMCPY_H2D, stream)
                total += n * per
        return total

    def miss_groups(self, n: int, ring_slots: int, slot_bytes: int = 0) -> list[int]:
        """Sizes of the copy groups that stream n missed experts: group_experts each, or more for small experts
        (at least COPY_GROUP_BYTES a group, so the host's launches per group stay few against the bytes), as the
        ring allows (4 groups in flight), then 4, 2, 2 at the end, so the compute left after the last byte lands
        is small."""
        want = max(self.group_experts, COPY_GROUP_BYTES // slot_bytes if slot_bytes > 0 else 0)
        big = max(1, min(want, ring_slots // 4))
        tail = [s for s in (4, 2, 2) if s <= big] if n >= 2 * big else []
        head = n - sum(tail)
        groups = -(-head // big) if head > 0 else 0
        sizes = [head // groups + (1 if i < head % groups else 0) for i in range(groups)] if groups else []
        return sizes + tail

    @staticmethod
    def _host_key(host_pool: ExpertPool) -> tuple:
        """The host arrays' addresses: which layer's host experts a prefetch copied from."""
        return tuple(int(a.ctypes.data) for a in host_pool.arrays.values())

    def _take_prefetch(self) -> tuple | None:
        """The prefetch queued for this layer (experts, ring slots, host key, landed event, bytes), now taken."""
        pre, self._prefetched = self._prefetched, None
        return pre

    def prefetch_misses(self, pool: ExpertPool, host_pool: ExpertPool, uncached: np.ndarray, ring: Any,
                        after_previous_layer: bool) -> int:
        """Before a streamed layer routes, queue the copy of the first ring group of its `uncached` experts (ascending
        ids) from host_pool into the ring slots that group takes; prefill_layer's streaming uses the copy when the
        routing misses exactly those experts first, and otherwise spends it (a wrong guess costs one group's copy).
        The copy waits for the last readers of those slots: with `after_previous_layer` (the caller's last prefill
        on this FastMoE was the layer before, in the same chunk and ring), their last readers (the groups that read
        them, or ring_read's copies); else all work queued so far on compute_stream. Returns the bytes queued (0:
        none)."""
        self._prefetched = None
        if not self.prefetch_misses_on or ring is None or host_pool is None:
            return 0
        if not isinstance(ring, np.ndarray):
            ring = np.arange(int(ring[0]), int(ring[0]) + int(ring[1]), dtype=np.int64)
        uncached = np.asarray(uncached, dtype=np.int64)
        if uncached.size == 0 or ring.size == 0:
            return 0
        slot_bytes = sum(int(a.strides[0]) for a in host_pool.arrays.values())
        size = self.miss_groups(int(uncached.size), int(ring.size), slot_bytes)[0]
        if size > ring.size:
            return 0
        cp, cs = self._cp, self.copy_stream
        slots = ring[ring_placement([size], int(ring.size), self._ring_start(ring))[0][0]]
        known = [self._ring_done.get(int(r)) for r in slots]
        if after_previous_layer and all(e is not None for e in known):
            for e in {id(e): e for e in known}.values():
                cs.wait_event(e)
        else:
            now = cp.cuda.Event(disable_timing=True)
            now.record(self.compute_stream)
            cs.wait_event(now)
        self._mark("prefetch_begin", cs)
        moved = self._copy_experts(pool, host_pool, uncached[:size].tolist(), slots)
        landed = cp.cuda.Event(disable_timing=True)
        landed.record(cs)
        self._mark("prefetched", cs)
        self._prefetched = (tuple(int(e) for e in uncached[:size]), tuple(int(r) for r in slots),
                            self._host_key(host_pool), landed, moved)
        return moved

    def settle_prefetch(self) -> None:
        """Wait for a prefetch no layer took (a layer that failed before streaming) and drop it."""
        pre = self._take_prefetch()
        if pre is not None:
            pre[3].synchronize()

    def ring_read(self, slots: Sequence[int]) -> None:
        """The caller has queued reads of these ring slots on compute_stream after the layer (a copy from the ring
        into the cache): a prefetch into them waits for those reads."""
        ev = self._cp.cuda.Event(disable_timing=True)
        ev.record(self.compute_stream)
        for r in slots:  # recorded after the layer's groups on the same stream: the slot's last reader now
            self._ring_done[int(r)] = ev

    def _ring_start(self, ring: np.ndarray) -> int:
        """The ring slot the next layer through this ring places its first group at: where the last one ended."""
        got = self._ring_cursor
        return got[1] if got is not None and got[0] == _ring_key(ring) else 0

    def _stream_misses(self, misses: list[int], pool: ExpertPool, host_pool: ExpertPool, ring: np.ndarray,
                       blk_base: int, lay: StackLayout, bufs: tuple, start: Any,
                       run_hits: Any) -> None:
        cp = self._cp
        ring_n = int(ring.size)
        slot_bytes = sum(int(a.strides[0]) for a in host_pool.arrays.values())
        sizes = self.miss_groups(len(misses), ring_n, slot_bytes)
        if max(sizes) > ring_n:
            raise ValueError(f"prefill_layer: a ring of {ring_n} slots cannot hold a copy group of {max(sizes)}")
        # place the groups on the ring from where the last layer through it ended and find, for each, the groups of
        # this layer that last used its slots: its copy must wait until they have computed (earlier layers' readers
        # are behind `start`)
        place, deps, end = ring_placement(sizes, ring_n, self._ring_start(ring))
        self._ring_cursor = (_ring_key(ring), end)
        group_slots = [ring[p] for p in place]
        first_of = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
        cs, st = self.copy_stream, self.compute_stream
        pre = self._take_prefetch()
        if pre is not None:
            self.stats.prefetch = "spent"
        landed = [cp.cuda.Event(disable_timing=True) for _ in sizes]
        done = [cp.cuda.Event(disable_timing=True) for _ in sizes]
        streamed = pre[4] if pre is not None else 0  # a spent prefetch moved its bytes over the link all the same
        next_copy = 0
        first_slots = tuple(int(r) for r in group_slots[0])
        if (pre is not None and pre[0] == tuple(misses[:sizes[0]]) and pre[1] == first_slots
                and pre[2] == self._host_key(host_pool)):
            landed[0], next_copy = pre[3], 1  # the first group is in flight already, into the slots it would take
            self.stats.prefetch = "used"
        cs.wait_event(start)  # ring slots may still be read by earlier work on the compute stream
        self._mark("copy_start", cs)

        def queue_copies(computed: int) -> int:
            # queue every copy whose ring slots are free once the groups enqueued so far have computed: the copy
            # stream then holds several groups ahead, so a slow host moment does not leave the link idle
            nonlocal next_copy
            moved = 0
            ahead = self.copy_groups_ahead
            while (next_copy < len(sizes) and all(d < computed for d in deps[next_copy])
                   and (ahead is None or next_copy <= computed + ahead)):
                g = next_copy
                for d in deps[g]:
                    cs.wait_event(done[d])
                self._mark(f"copy_begin_{g}", cs)  # fires when the link may start this group: idle before it
                a = first_of[g]
                moved += self._copy_experts(pool, host_pool, misses[a:a + sizes[g]],
                                            group_slots[g])
                landed[g].record(cs)
                self._mark(f"copied_{g}", cs)
                next_copy += 1
            return moved

        streamed += queue_copies(0)
        run_hits()  # the hits compute while the first copies fly
        for g, size in enumerate(sizes):
            st.wait_event(landed[g])
            blk0 = blk_base + int(first_of[g])
            self._group(pool, group_slots[g], blk0, lay, bufs)
            done[g].record(st)
            self._mark(f"computed_{g}")
            streamed += queue_copies(g + 1)
        self.stats.bytes_streamed = streamed
        self.stats.copy_groups = len(sizes)
        # in group order, so a slot's entries are its last group's: that group is its last reader, and the expert it
        # holds once the layer has computed (a caller may copy hot ones into the cache from here, device to device,
        # instead of over the link again)
        held = {}
        for g, slots in enumerate(group_slots):
            for i, r in enumerate(slots.tolist()):
                self._ring_done[r] = done[g]
                held[r] = int(misses[first_of[g] + i])
        self.stats.ring_held = held

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
                   "pos": cp.empty(self.top_k, dtype=cp.int32),
                   "counts": cp.zeros(self.experts, dtype=cp.int32),
                   "xn": cp.empty((1, self.hidden), dtype=cp.float32),
                   "logits": cp.empty((1, self.experts), dtype=cp.float32),
                   "slots": cp.empty(self.top_k, dtype=cp.int32),
                   "ev_gate_up": cp.cuda.Event(disable_timing=True),
                   "ev_down": cp.cuda.Event(disable_timing=True)}
            self._dec = buf
        return buf

    def host_device_ptrs(self, host_pool: ExpertPool | None) -> tuple[int, ...] | None:
        """Device-side addresses of a page-locked f16 or Q8_0 host pool's arrays (DECODE_HOST_ARRAYS order; the
        same as the host's under unified addressing), or None when the memory is not mapped for the device (then
        misses go through copies)."""
        if host_pool is None or host_pool.dtype not in DECODE_HOST_ARRAYS:
            return None
        key = tuple(host_pool.arrays[n].ctypes.data for n in DECODE_HOST_ARRAYS[host_pool.dtype])
        cache = self.__dict__.setdefault("_host_ptrs", {})
        if key not in cache:
            report = self.host_mapping_report(key)
            cache[key] = tuple(r["device_ptr"] for r in report) if all(r["device_ptr"] for r in report) else None
        return cache[key]

    def host_mapping_report(self, host_ptrs: Sequence[int]) -> list[dict]:
        """For each host address: what the driver says of it (memory type, its device-side address) and the
        address the kernels may use (0: none, the memory is pageable or unknown to the driver)."""
        try:
            # cudaDevAttrCanUseHostPointerForRegisteredMem (91): registered memory is reachable at its host address
            same_address = bool(self._rt.deviceGetAttribute(91, self._cp.cuda.Device().id))
        except Exception:  # an old runtime without the attribute: rely on devicePointer alone
            same_address = False
        out = []
        for p in host_ptrs:
            row = {"host_ptr": int(p), "type": None, "device_pointer": 0, "same_address_ok": same_address,
                   "device_ptr": 0, "error": ""}
            try:
                attrs = self._rt.pointerGetAttributes(int(p))
                row["type"], row["device_pointer"] = int(attrs.type), int(attrs.devicePointer)
                # cudaMemoryTypeHost (1): page-locked and known to the driver
                if row["type"] == 1:
                    row["device_ptr"] = row["device_pointer"] or (int(p) if same_address else 0)
            except Exception as e:  # pageable or foreign memory: the caller copies the misses instead
                row["error"] = f"{type(e).__name__}: {e}"
            out.append(row)
        return out

    def _gate_up(self, x: Any, logits: Any, pool: ExpertPool, slot_map: Any, refill_from: Any, skip_missing: int,
                 host_w13: int = 0, ids_out: Any = None, w_out: Any = None, slots_out: Any = None,
                 land: Any = None) -> None:
        b = dict(self.decode_buffers())
        land_arg = land if land is not None else np.uint64(0)
        if ids_out is not None:
            b["ids"], b["w"] = ids_out, w_out
        h, f, kk = self.hidden, self.ffn, self.top_k
        if self._third_form(pool, refill_from, skip_missing) and pool.dtype == "q8_0":
            pairs = DECODE_THIRD[self.decode_form][2]
            rows = WARPS * pairs
            hq, hd = host_w13 if host_w13 else (0, 0)
            a = pool.arrays
            fourth = Q8_DECODE_VARIANTS[self.q8_decode][1] and h // 16 <= Q8_REG_MAX_X_CHUNKS
            self._dlaunch("strata_fast_decode_gate_up4_q8" if fourth else "strata_fast_decode_gate_up3_q8",
                          ((f + rows - 1) // rows, kk), (THREADS,),
                          (x, logits, np.int32(self.experts), np.int32(kk), slot_map, a["gate_up_q"], a["gate_up_d"],
                           np.uint64(hq), np.uint64(hd), np.int32(h), np.int32(f), b["act"], b["ids"], b["w"],
                           b["slots"] if slots_out is None else slots_out, land_arg))
            return
        if self._third_form(pool, refill_from, skip_missing):
            _, _, pairs, prefetch = DECODE_THIRD[self.decode_form]
            rows = WARPS * pairs
            self._dlaunch("strata_fast_decode_gate_up3", ((f + rows - 1) // rows, kk), (THREADS,),
                          (x, logits, np.int32(self.experts), np.int32(kk), slot_map, pool.arrays["w_gate_up"],
                           np.uint64(host_w13), np.int64(2 * f * h), np.int32(h), np.int32(f), b["act"], b["ids"],
                           b["w"], b["slots"] if slots_out is None else slots_out,
                           pool.arrays["w_down"] if prefetch else np.uint64(0), np.int64(h * f), land_arg))
            return
        rows_per_block = (THREADS // WARP_LANES) * self.decode_rows_per_warp
        if pool.dtype == "q8_0":
            if refill_from is not None or skip_missing:
                raise NotImplementedError("Q8_0 decode: misses are read from mapped host memory, not copied")
            hq, hd = host_w13 if host_w13 else (0, 0)
            a = pool.arrays
            self._dlaunch(
                "strata_fast_decode_gate_up_q8", ((f + rows_per_block - 1) // rows_per_block, kk), (THREADS,),
                (x, logits, np.int32(self.experts), np.int32(kk), slot_map, a["gate_up_q"], a["gate_up_d"],
                 np.uint64(hq), np.uint64(hd), np.int32(h), np.int32(f), b["act"], b["ids"], b["w"]))
            return
        self._dlaunch("strata_fast_decode_gate_up", ((f + rows_per_block - 1) // rows_per_block, kk), (THREADS,),
                                              (x, logits, np.int32(self.experts), np.int32(kk), slot_map,
                                               refill_from if refill_from is not None else np.uint64(0),
                                               np.int32(skip_missing), pool.arrays["w_gate_up"], np.uint64(host_w13),
                                               np.int64(2 * f * h), np.int32(h), np.int32(f), b["act"], b["ids"],
                                               b["w"]))

    def _down(self, pool: ExpertPool, slot_map: Any, only_missing_in: Any, skip_missing: int, out: Any,
              host_w2: int = 0, accumulate: int = 0, ids: Any = None, w: Any = None, slots: Any = None,
              land: Any = None) -> None:
        b = dict(self.decode_buffers())
        land_arg = land if land is not None else np.uint64(0)
        if ids is not None:
            b["ids"], b["w"] = ids, w
        h, f, kk = self.hidden, self.ffn, self.top_k
        warps = THREADS // WARP_LANES
        if self._third_form(pool, only_missing_in, skip_missing) and pool.dtype == "q8_0":
            hq, hd = host_w2 if host_w2 else (0, 0)
            a = pool.arrays
            if Q8_DECODE_VARIANTS[self.q8_decode][1] and kk * f // 16 <= Q8_REG_MAX_DOWN_PAIRS:
                name, rows = "strata_fast_decode_down4_q8", Q8_REG_DOWN_ROWS
            else:
                name, rows = "strata_fast_decode_down3_q8", WARPS
            self._dlaunch(name, ((h + rows - 1) // rows,), (THREADS,),
                          (b["act"], b["ids"], b["w"], b["slots"] if slots is None else slots, a["down_q"], a["down_d"],
                           np.uint64(hq), np.uint64(hd), np.int32(h), np.int32(f), np.int32(kk), out,
                           np.int32(accumulate), land_arg))
            return
        if self._third_form(pool, only_missing_in, skip_missing):
            # reads the routed slots the third gate/up kernel published (not slot_map: no look-up chained on ids)
            name, split, _, _ = DECODE_THIRD[self.decode_form]
            rows = WARPS // split
            self._dlaunch(name, ((h + rows - 1) // rows,), (THREADS,),
                          (b["act"], b["ids"], b["w"], b["slots"] if slots is None else slots, pool.arrays["w_down"],
                           np.uint64(host_w2), np.int64(h * f), np.int32(h), np.int32(f), np.int32(kk), out,
                           np.int32(accumulate), land_arg))
            return
        if pool.dtype == "q8_0":
            if only_missing_in is not None or skip_missing:
                raise NotImplementedError("Q8_0 decode: misses are read from mapped host memory, not copied")
            hq, hd = host_w2 if host_w2 else (0, 0)
            a = pool.arrays
            self._dlaunch(
                "strata_fast_decode_down_q8", ((h + warps - 1) // warps,), (THREADS,),
                (b["act"], b["ids"], b["w"], slot_map, a["down_q"], a["down_d"], np.uint64(hq), np.uint64(hd),
                 np.int32(h), np.int32(f), np.int32(kk), out, np.int32(accumulate)))
            return
        if self.decode_form == 2 and only_missing_in is None and not skip_missing:
            self._dlaunch("strata_fast_decode_down2", ((h + warps - 1) // warps,), (THREADS,),
                          (b["act"], b["ids"], b["w"], slot_map, pool.arrays["w_down"], np.uint64(host_w2),
                           np.int64(h * f), np.int32(h), np.int32(f), np.int32(kk), out, np.int32(accumulate)))
            return
        self._dlaunch("strata_fast_decode_down", ((h + warps - 1) // warps,), (THREADS,),
                                           (b["act"], b["ids"], b["w"], slot_map,
                                            only_missing_in if only_missing_in is not None else np.uint64(0),
                                            np.int32(skip_missing), pool.arrays["w_down"], np.uint64(host_w2),
                                            np.int64(h * f), np.int32(h), np.int32(f), np.int32(kk), out,
                                            np.int32(accumulate)))

    def decode_stack(self, x: Any, layers: Sequence["DecodeLayer"], graph: bool = True, key: tuple | None = None) -> None:
        """One token through every layer, in place on the residual x [1,H] f32: per layer rmsnorm + router,
        gate/up + SwiGLU, then down added to x; no host sync. With `graph` the whole stack is captured once per set
        of buffers and replayed (one launch per step); missed experts (slot -1) are read from each layer's mapped
        host memory. Runs on `compute_stream`. `key` (the caller's cached ("stack", x, layer keys...)) saves
        rebuilding it every step."""
        self.decode_buffers()
        if not graph:
            for lay in layers:
                self._check_decode_pool(lay.pool)
            with self.compute_stream:
                self._decode_stack_body(x, layers)
            return
        key = key or ("stack", x.data.ptr) + tuple(lay.key() for lay in layers)
        g = self._graphs.get(key)
        if g is None:
            for lay in layers:
                self._check_decode_pool(lay.pool)
            if len(self._graphs) >= MAX_DECODE_GRAPHS:
                self._graphs.clear()
            g = self._capture(lambda: self._decode_stack_body(x, layers))
            self._graphs[key] = g
        g.launch(self.compute_stream)

    def lands_misses(self, pool: ExpertPool) -> bool:
        """Whether decode over this pool takes the third-form kernels, which write a miss with a landing slot
        (DecodeLayer.land) into that slot as they read it."""
        return self._third_form(pool, None, 0)

    def _third_form(self, pool: ExpertPool, partial_map: Any, skip_missing: int) -> bool:
        """Whether a decode launch takes the third-form kernels: decode_form in DECODE_THIRD, an f16 or Q8_0 pool
        (THIRD_FORM_DTYPES), at most a block's threads of experts (block_rank_topk ranks one logit a thread), and
        neither of the first form's partial launches (decode_layer_misses' refill / skip: not in the third forms)."""
        return (self.decode_form in DECODE_THIRD and pool.dtype in THIRD_FORM_DTYPES and self.experts <= THREADS
                and partial_map is None and not skip_missing)

    def _decode_stack_body(self, x: Any, layers: Sequence["DecodeLayer"]) -> None:
        b = self.decode_buffers()  # allocated before any capture: no allocation may happen inside one
        xn, logits = b["xn"], b["logits"]
        warps = THREADS // WARP_LANES
        for lay in layers:
            if self.decode_form >= 2:
                self._dlaunch("strata_fast_decode_norm_route2", ((self.experts + 3) // 4,), (128,),
                              (x, lay.norm_w, lay.router_w, np.int32(self.experts), np.int32(self.hidden),
                               np.float32(lay.eps), xn, logits))
            else:
                self._dlaunch("strata_fast_decode_norm_route", ((self.experts + warps - 1) // warps,), (THREADS,),
                                                     (x, lay.norm_w, lay.router_w, np.int32(self.experts),
                                                      np.int32(self.hidden), np.float32(lay.eps), xn, logits))
            h13, h2 = _split_host(lay.pool.dtype, lay.host)
            self._gate_up(xn, logits, lay.pool, lay.slot_map, None, 0, h13, ids_out=lay.ids, w_out=lay.w,
                          land=lay.land)
            self._down(lay.pool, lay.slot_map, None, 0, x, h2, accumulate=1, ids=lay.ids, w=lay.w, land=lay.land)

    def gemv_f16w(self, x: Any, w: Any, out: Any) -> Any:
        """out [T,O] f32 = x [T,H] f32 . w [O,H] f16 ^T (the LM head of a decode token) on the current stream, through
        strata_fast_gemv_f16w (a programmatic launch when decode_pdl is on: its first weight loads overlap the
        kernel before it)."""
        t, h = int(x.shape[0]), int(x.shape[1])
        o = int(w.shape[0])
        rows = (THREADS // WARP_LANES) * GEMV_ROWS_PER_WARP
        self._dlaunch("strata_fast_gemv_f16w", ((o + rows - 1) // rows, t), (THREADS,),
                      (x, w, np.int32(o), np.int32(h), out))
        return out

    def _dlaunch(self, name: str, grid: tuple, block: tuple, args: tuple) -> None:
        """A decode kernel on the current stream: a programmatic dependent launch when decode_pdl is on."""
        if self.decode_pdl:
            if self._pdl is None:  # made at construction; here only for objects built around __init__
                self._pdl = _launcher(self._cp)
            if self._pdl.available():
                self._pdl.launch(self._k[name], grid, block, args, self._cp.cuda.get_current_stream().ptr)
                return
        self._k[name](grid, block, args)

    def _check_decode_pool(self, pool: ExpertPool) -> None:
        if pool.dtype not in DECODE_HOST_ARRAYS:
            raise NotImplementedError(f"decode_layer: the fused decode kernels read f16 and Q8_0 pools, not "
                                      f"{pool.dtype}")

    def _decode_pair(self, x: Any, logits: Any, pool: ExpertPool, slot_map: Any, out: Any,
                     host: tuple[int, ...] | None, land: Any = None) -> None:
        h13, h2 = _split_host(pool.dtype, host)
        self._gate_up(x, logits, pool, slot_map, None, 0, h13, land=land)
        self._down(pool, slot_map, None, 0, out, h2, land=land)

    def decode_layer(self, x: Any, logits: Any, pool: ExpertPool, slot_map: Any, out: Any = None,
                     host_pool: ExpertPool | None = None, land: Any = None) -> Any:
        """One token: x [1,H] f32, logits [1,E] f32, slot_map [E] int32 (device, -1 = not cached) -> y [1,H] f32.

        Routing and slot look-up on the device, no host sync; runs on `compute_stream`. Missed experts are read
        from host_pool (page-locked, mapped) by the kernels themselves; without one every routed expert must be
        cached. With `decode_graphs` on (the default) the two launches are captured once per set of buffers and
        replayed after, since a step's launches cost more host time than the device takes for them. |x| must
        stay in the f16 range. `land` [E] int32 (device, may be None): in the third forms a miss e with
        land[e] >= 0 is also written into pool slot land[e] as it is read (an admission that costs no link bytes).
        """
        self._check_decode_pool(pool)
        out = self.decode_buffers()["out"] if out is None else out
        host = self.host_device_ptrs(host_pool)
        if host_pool is not None and host is None:
            raise ValueError("decode_layer: host_pool is not mapped for the device; use decode_layer_misses")
        if not self.decode_graphs:
            with self.compute_stream:
                self._decode_pair(x, logits, pool, slot_map, out, host, land)
            return out
        key = (x.data.ptr, logits.data.ptr, slot_map.data.ptr, *(pool.arrays[n].data.ptr for n in sorted(pool.arrays)),
               out.data.ptr, host, None if land is None else land.data.ptr)
        graph = self._graphs.get(key)
        if graph is None:
            if len(self._graphs) >= MAX_DECODE_GRAPHS:
                self._graphs.clear()
            graph = self._capture(lambda: self._decode_pair(x, logits, pool, slot_map, out, host, land))
            self._graphs[key] = graph
        graph.launch(self.compute_stream)
        return out

    def _capture(self, body: Any) -> Any:
        s = self._capture_stream
        with s:
            s.begin_capture()
            try:
                body()
            except BaseException:
                # end the capture before the error leaves: a stream left capturing fails every later call on it
                # (cudaErrorStreamCaptureUnsupported), hiding the first error
                try:
                    s.end_capture()
                except Exception:  # an invalidated capture: the first error is the one to report
                    pass
                raise
            return s.end_capture()

    def capture_decode(self, x: Any, logits: Any, pool: ExpertPool, slot_map: Any,
                       host_pool: ExpertPool | None = None) -> Any:
        """A CUDA graph of one decode step on these very buffers (launch(stream) replays it; output in
        decode_buffers()["out"])."""
        self._check_decode_pool(pool)
        out = self.decode_buffers()["out"]
        host = self.host_device_ptrs(host_pool)
        return self._capture(lambda: self._decode_pair(x, logits, pool, slot_map, out, host))

    def decode_layer_misses(self, x: Any, logits: Any, pool: ExpertPool, slot_of_expert: np.ndarray,
                            slot_map: Any, host_pool: ExpertPool, ring: tuple[int, int], out: Any = None) -> Any:
        """One token with possible misses, through copies (see the module docstring): for host memory the device
        cannot map. slot_of_expert is the host copy of slot_map; both are left as they were (the ring is scratch,
        not cache). Runs on `compute_stream`. f16 pools only."""
        if pool.dtype != "f16":
            raise NotImplementedError("decode_layer_misses: f16 pools only (Q8_0 reads misses from mapped memory)")
        # plain launches here: the kernels wait on copy events between them, and a programmatic launch's relaxed
        # ordering is meant for kernel-after-kernel only
        pdl, self.decode_pdl = self.decode_pdl, False
        try:
            return self._decode_layer_misses(x, logits, pool, slot_of_expert, slot_map, host_pool, ring, out)
        finally:
            self.decode_pdl = pdl

    def _decode_layer_misses(self, x: Any, logits: Any, pool: ExpertPool, slot_of_expert: np.ndarray,
                             slot_map: Any, host_pool: ExpertPool, ring: tuple[int, int], out: Any) -> Any:
        b = self.decode_buffers()
        st = self.compute_stream
        kk = self.top_k
        with st:
            if out is None:
                out = self._cp.empty((1, self.hidden), dtype=self._cp.float32)
            # route with one block and bring the ids back; only that copy is waited for
            self._k["strata_fast_route"]((1,), (THREADS,), (logits, np.int32(1), np.int32(self.experts),
                                                            np.int32(kk), b["ids"], b["w"]))
            self._rt.memcpyAsync(self._back.ctypes.data, b["ids"].data.ptr, 4 * kk, 2, st.ptr)
            self._synced.record(st)
            self._synced.synchronize()
            routed = self._back[:kk]
            slot_h = np.asarray(slot_of_expert)
            missing = slot_h[routed] < 0
            n_miss = int(np.count_nonzero(missing))
            self.stats = LayerStats(experts_used=kk, hits=kk - n_miss, misses=n_miss, routed_rows=kk,
                                    routed_rows_hit=kk - n_miss)
            if not n_miss:
                self._gate_up(x, logits, pool, slot_map, None, 0)
                self._down(pool, slot_map, None, 0, out)
                return out
            misses = sorted(set(routed[missing].tolist()))
            n_miss = len(misses)
            if n_miss > int(ring[1]):
                raise ValueError(f"decode_layer_misses: {n_miss} misses and a ring of {ring[1]} slots")
            # the copies go first, gate/up matrices before down ones; the ring's earlier readers ran before the
            # sync point on this stream, so the copy stream may start at once
            cs = self.copy_stream
            cs.wait_event(self._synced)
            ring0 = int(ring[0])
            streamed = 0
            for names, ev in ((("w_gate_up",), b["ev_gate_up"]), (("w_down",), b["ev_down"])):
                for name in names:
                    dev, src = pool.arrays[name], host_pool.arrays[name]
                    per_d, per_h = int(dev.strides[0]), int(src.strides[0])
                    d0, h0 = dev.data.ptr + ring0 * per_d, src.ctypes.data
                    for i, e in enumerate(misses):
                        self._rt.memcpyAsync(d0 + i * per_d, h0 + e * per_h, per_h, _MEMCPY_H2D, cs.ptr)
                        streamed += per_h
                ev.record(cs)
            self.stats.bytes_streamed = streamed
            # the cached experts compute while the copies fly
            self._gate_up(x, logits, pool, slot_map, None, 1)
            self._down(pool, slot_map, None, 1, out)
            patched = slot_h.astype(np.int32)
            patched[misses] = ring0 + np.arange(n_miss, dtype=np.int32)
            self._upload_i32(b["map"].data.ptr, patched, offset=2 * self.experts)
            st.wait_event(b["ev_gate_up"])
            self._gate_up(x, logits, pool, b["map"], slot_map, 0)
            st.wait_event(b["ev_down"])
            self._down(pool, b["map"], slot_map, 0, out)
        return out
