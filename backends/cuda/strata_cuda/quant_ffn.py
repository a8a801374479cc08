"""The grouped FFN and MoE layers of 'gguf' expert pools on CUDA (and ROCm): the GGUF file's own rows, computed from.

- QuantGroupedFFN: the KernelSet's moe_grouped_ffn over a 'gguf' pool. Groups of at most GEMV_MAX_ROWS rows
  (decode) run quant_fast.cu's GEMV kernels (each warp reads an output's quant blocks once, decodes them in
  registers, f32 accumulation of the exact weights); larger groups run QuantMoE.grouped_ffn (bounded groups of
  experts dequantized to f16 scratch, then cuBLAS tensor-core GEMMs); formats with biases (gpt-oss) and shapes off
  that path run moe_quant.cu's portable tiled kernels (dequantize per tile into shared memory, f32 accumulation).
- QuantMoE: strata_cuda.fast.FastMoE (device routing, compact stacks, cuBLAS GEMMs, ring streaming of misses)
  over a 'gguf' pool, its f16 dequantization scratch bounded in bytes (scratch_layout: the plan's budget,
  PlatformDefaults.dequant_scratch_bytes, counted in the workspace line and lent as prefill buffer "scratch"):
  groups of whole experts dequantized on a side stream into the whole scratch (a cached layer's experts:
  WARM_REST_WHOLE, the fewest groups, since each costs the host ~0.5 ms and the H200 did not run a group's
  dequantization beside the other's GEMMs anyway) or into one of its two halves in turn (hit_groups; streamed ring
  groups: half 0 on the compute stream); where one expert's f16 does not fit a half (Mixtral 8x7B: 352 MB), pieces of it
  on the compute stream: gate/up by blocks of output columns, down by blocks of K accumulated with beta = 1.
  Streamed misses go through the ring in copy groups two at a time (RING_GROUPS_IN_FLIGHT; FastMoE keeps four),
  so a small ring still gives groups large enough that the link, not the host, sets the pace.
  Never an f16 copy of a whole layer. decode_layer / decode_stack: no host sync, captured as a CUDA graph; decode
  form 2 (quant_decode_form, the default where decode_kernels_take): quant_decode.cu's gate/up kernel (routing in
  every block, each lane's weight loads issued before any sum) and down kernel (a warp a hidden row), programmatic
  launches; form 1 (other formats, biases, unaligned q4_k/q5_k blobs): route, one GEMV kernel for gate/up of all K
  experts and one for down with the routing weights (QF_DW warps a row).
  With warm_device (WARM_DEVICE, off by default: not faster on the H200) a warm layer (every expert cached) takes
  FastMoE's device-table path instead (_device_experts): no host sync; groups of a scratch half dequantized on the
  side stream in expert order, each group's triton_moe launches on the compute stream behind its dequantization.
  strata_cuda.layer_ops takes QuantMoE (quant_moe_for) for prefill chunks of a 'gguf' model.
cupy is imported by the caller (or inside the constructors).
"""

from __future__ import annotations

from importlib.resources import files
from typing import Any

import numpy as np

from strata_core.api.kernels import ExpertFormat, ExpertPool
from strata_core.planner.buffers import SCRATCH_GROUP_EXPERTS, f16_expert_bytes, scratch_layout
from strata_core.reference.quants import GGML_TYPES

from .fast import (_CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT, _CUBLAS_OP_N, _CUBLAS_OP_T,
                   _CUBLAS_POINTER_MODE_HOST, _CUDA_R_16F, CLASS_MODES, COPY_GROUP_BYTES, THREADS, DecodeLayer,
                   FastMoE, _Grown, _launcher)
from .rules import DEQUANT_SCRATCH_BYTES

SOURCE_NAME = "moe_quant.cu"
KERNEL_NAMES = ("strata_quant_gate_up", "strata_quant_down")
#: The tensor-core variant (mma.sync, f16 inputs, f32 accumulation; CUDA only).
MMA_KERNEL_NAMES = ("strata_quant_gate_up_mma", "strata_quant_down_mma")
#: QT_M, QT_N, QT_THREADS and QM_THREADS of moe_quant.cu.
TILE_ROWS = 64
TILE_OUTPUTS = 64
THREADS = 256
MMA_THREADS = 128
#: Whether the cuda KernelSet takes the tensor-core variant. Off until tests/gpu/test_quant_cuda.py has passed
#: for it on a GPU (its fragment layout is checked here only by an emulation of the instruction on the host).
MMA_BY_DEFAULT = False
FAST_SOURCE_NAME = "quant_fast.cu"
#: (gate|up, down) format pairs with a strata_qf_dequant_sbt_<a>_<b> kernel (QF_SBT_KERNEL in quant_fast.cu)
SBT_PAIRS = (("q4_k", "q6_k"), ("q5_k", "q6_k"), ("q6_k", "q6_k"), ("q4_k", "q4_k"), ("q5_k", "q5_k"),
             ("q8_0", "q8_0"))
FAST_KERNEL_NAMES = ("strata_qf_dequant_f16", "strata_qf_dequant_f16_part", "strata_qf_dequant_sb",
                     *(f"strata_qf_dequant_sbt_{a}_{b}" for a, b in SBT_PAIRS),
                     "strata_qf_gemv_gate_up", "strata_qf_gemv_down", "strata_qf_decode_down",
                     "strata_qf_decode_down_wide")
#: QF_THREADS, QF_WARPS of quant_fast.cu (a warp per output row)
FAST_THREADS = 256
FAST_WARPS = 8
#: QF_DROWS of quant_fast.cu: outputs h a block of strata_qf_decode_down_wide computes (QF_DW = 4 warps each)
DECODE_DOWN_ROWS = 2
#: Groups of at most this many rows take the GEMV kernels (they decode the weights once per 4 rows).
GEMV_MAX_ROWS = 8
#: Most experts dequantized to f16 per group of QuantMoE's prefill (two such groups of scratch in flight); the
#: scratch budget may allow fewer (strata_core.planner.buffers.scratch_layout, the planner's arithmetic too).
GROUP_EXPERTS = SCRATCH_GROUP_EXPERTS
#: QuantMoE's scratch budget: the cuda PlatformDefaults' figure (the planner's line is its layout's bytes).
SCRATCH_BUDGET_BYTES = DEQUANT_SCRATCH_BYTES
#: Types quant_fast.cu decodes (quants.cuh's).
FAST_TYPES = frozenset(GGML_TYPES)
#: Copy groups of a streamed layer in flight on QuantMoE's ring (FastMoE.miss_groups keeps 4). A copy group costs the
#: host about the same whatever its size (the slot table, two dequantization launches, the GEMM calls of its size
#: classes), and a Q4_K_M expert is only 3 MB: a 32-slot ring in four groups of 8 gave groups of 0.44 ms of link, and
#: the host, not the link, set the pace (bench/results/q2_h200/). Two groups of 16 keep the link busy as long as a
#: group computes in less time than the next one copies (a 16-expert group: ~0.2 ms of device work, 0.9 ms of link).
RING_GROUPS_IN_FLIGHT = 2
#: The last copy groups' sizes (FastMoE's 4, 2, 2), so the compute left after the last byte lands is small.
RING_TAIL = (4, 2, 2)
#: Whole experts' dequantization kernel: "chunk" (strata_qf_dequant_f16, a lane per 32 weights, a launch per matrix)
#: or "sb" (strata_qf_dequant_sb: a warp per row, 256 weights a pass, both matrices of a group in one launch, where
#: sb_takes the format). For the Qwen3-30B-A3B Q4_K_M layer on the H200 the chunk kernel took 0.654 ms (2.45 TB/s)
#: and the sb kernel 0.737 (a warm layer 1.669 against 1.774 ms: bench/results/qw_h200/call2_qw_diag.json), but in
#: the product's bench "chunk" streamed a cold layer at 1.270x the link floor (bench/results/lead_h200_s5b/) where
#: "sb" gave 1.056x and 1.065x (qw_h200/call2_quant_layer_h200.json, lead_h200_s5c/sb_quant_layer_h200.json), so
#: "sb" was the default. "sbt" is the sb kernel with the format pair fixed at compile time (strata_qf_dequant_sbt_*,
#: SBT_PAIRS; other pairs take "sb"): 0.578 ms against sb's 0.719 and chunk's 0.639 for that layer, the warm layer
#: 1.499 ms (1.60x f16) against 1.658, cold 1.074x the floor against 1.091 (bench/results/lead_h200_s9/
#: call2_quant_layer_h200.json; Nsight Compute, call2_ncu_dequant.txt: 48 registers against 64, 54% occupancy, the
#: warps stalled on their loads 46% of the time), so it is the default.
#: Tried 2026-12-04 and removed: "sbp", sbt's decode with each tile's quant bytes (8 gate|up or 16 down rows)
#: copied into shared memory by cp.async, the next tile's copies in flight while this one decodes, bit for bit sbt's
#: f16 on the H200: 0.585-0.628 ms against sbt's 0.576-0.620 for the layer (s15_h200/call2_-call6_, kernel
#: strata_qf_dequant_sbp_* of commit d73d7e9), so the reads' latency is not what holds sbt at ~2.7 TB/s.
DEQUANT_KERNEL = "sbt"
#: Whole experts' dequantization kernels. Tried and removed: the sb kernel with each warp's row segment (up to 8
#: super-blocks) staged in shared memory by 16-byte loads first, bit for bit the same f16 but no faster, 0.743 ms
#: against sb's 0.719 (lead_h200_s9/call1_, kernel strata_qf_dequant_st of commit 0fb6be0). Three
#: trial forms of "sbt" for the Q4_K_M pair (a pass of 4 super-blocks; at least 8 blocks an SM; both at 6) and a
#: rewrite of its pass of 2 as a loop over an array ran in call 3 on a slower host (f16 warm 1.235 ms against
#: 0.935): the rewrite took 0.770 ms (sb 0.772 there), the pass of 4 0.834, 8 blocks 0.712, both 0.736
#: (lead_h200_s9/call3_quant_layer_h200.json); none is kept, and "sbt" is the source call 2 timed. That source's
#: Q4_K_M kernel held to 32 registers (8 blocks an SM) took 0.590 ms against its 0.582 in call 4 (call4_), not kept.
DEQUANT_KERNELS = ("chunk", "sb", "sbt")
#: Formats strata_qf_dequant_sb decodes (256-weight super-blocks, or eight q8_0 blocks).
SB_TYPES = frozenset({"q4_k", "q5_k", "q6_k", "q8_0"})
#: Most blocks of a strata_qf_dequant_sb launch per expert (a warp per row, grid-stride beyond).
SB_MAX_BLOCKS = 4096
#: Scratch halves a prefill fills with its first cached experts (in expert order) before the routing is known:
#: the device is nearly idle while the host waits for the routing counts and plans the stacks (~0.37 ms of a
#: 4096-token layer on the H200), and a chunk of thousands of rows routes to nearly every expert, so the first
#: groups' dequantization is rarely wasted; an expert the routing leaves out only costs its share of that work
#: (QuantMoE.prefill_layer, hit_groups). 0: none, the default: on the H200 the speculation's blocks delayed the
#: routing kernels queued beside them (routed at 0.37 ms instead of 0.10) and the layer lost 0.08-0.3 ms
#: (bench/results/qw_h200/call1_qw_diag.json: cur 2.31 ms, qw_route 2.10, qw_sb_whole 2.01).
WARM_SPEC_HALVES = 0
#: Speculate only for chunks of at least this many routed rows per expert (smaller ones leave many experts out).
SPEC_MIN_ROWS_PER_EXPERT = 4
#: The speculated halves' experts run as one group (one cuBLAS call per size class for both): the warm layer is
#: host-bound, ~0.05 ms of cuBLAS host time per call.
WARM_MERGE_SPEC = True
#: The cached experts after the speculated ones run in groups of the whole scratch (both halves, after the GEMMs
#: that read them) rather than half by half (False: halves in turn, each dequantized beside the other's GEMMs). The
#: GEMMs and the dequantization did not overlap on the H200 (a 32-expert group took their sum, ~0.4 ms) while each
#: group cost the host ~0.5 ms (cuBLAS calls per size class): two groups of 64 took 1.11 ms of host against 1.85 for
#: four of 32 (bench/results/qw_h200/call1_qw_diag.json, qw_sb_whole and qw_sb).
WARM_REST_WHOLE = True
#: A warm layer (every expert cached, a chunk of at least SPEC_MIN_ROWS_PER_EXPERT rows an expert) of a 'gguf' pool
#: on FastMoE's device-table path: no host sync; the cached experts dequantized group by group (expert order, the
#: scratch halves in turn) on the side stream, each group's two Triton launches (triton_moe, its experts' rows only)
#: on the compute stream as soon as its f16 has landed (QuantMoE._device_experts), the first two groups queued before
#: the routing (WARM_DEVICE_AHEAD). False: the host-synced path above (counts, hit_groups, cuBLAS classes), the
#: default: on the H200 the two measured the same for the Qwen3-30B-A3B Q4_K_M warm layer, 8 layers back to back
#: 1.523 ms a layer on this path against 1.498 and 1.515 host-synced timed before and after it, one call at a time
#: 1.586 against 1.574 and 1.602 (bench/results/s15_h200/call8_quant_layer_h200.json; call7_: 1.523 / 1.518 and
#: 1.619 / 1.604). A group's dequantization runs beside the GEMMs before it only by taking SMs from them (each group
#: takes the sum of the two): neither a 192-register cap on the GEMMs (room for a dequantization block beside each
#: program), the side stream at the greatest priority, nor the dequantization given the GEMMs' shared-memory
#: carveout changed that (calls 3-5). Issue 14's warm target needs the dequantization inside the GEMM's K loop.
WARM_DEVICE = False
#: With warm_device: the warm layer's GEMMs read the pool's own blocks and decode them inside the K loop
#: (triton_moe.DeviceQuantGEMM, q4_k/q5_k/q6_k/q8_0 rows; the CPU tests hold its decode, triton_moe.step_weights,
#: against the oracle bit for bit): no scratch, no dequantization pass. Off: on the H200 it matched the scratch
#: path bit for bit but the Qwen3-30B-A3B Q4_K_M warm layer took 2.78-3.25x the f16 warm time at BM 128 and 64
#: (bench/results/lead_h200_s8/call1_quant_layer_h200.json) and 2.37x at its best BM 256 tile (call2_), against
#: 1.58-1.71x host-synced: each program decodes its tile's blocks again per row tile, and the decode (byte loads,
#: the scales' six-bit unpacking) runs in the warps that issue the MMAs, so nothing hides it. With quant_mma.cu's
#: kernels (FUSED_KERNEL "mma") the fused warm layer took 1.72-1.81 ms against 1.53-1.56 host-synced, one call at a
#: time (bench/results/s16_h200/call3_, call4_quant_layer_h200.json): the kernels alone 1.33-1.38 ms against the f16
#: device GEMMs' 0.67-0.70 (call3_, call4_quant_mma_h200.json). Their ablations: without the decode 0.42 + 0.34 ms
#: (gate|up + down, the wgmma skeleton at ~480 TFLOP/s), the decode alone 0.47-0.53 + 0.42, so the decode, which
#: barely overlaps the MMAs, sets the pace. Blocks of 128 weight rows (two an SM, sm_90a) took gate|up to 0.696 ms
#: (0.848 at 256) but down to 0.653 (0.627 at 256; its q6_k decode spills at 128 registers), and the fused layer at
#: 128 x 128 1.693 ms a layer back to back against 1.493 host-synced (s16_h200/call7_). Still off. Those builds had
#: every wgmma serialized by ptxas (C7518: a wait after each), which is why the decode never overlapped; fixed since
#: (quant_mma.cu's qm_kernel). Measured since on an H100 (bench/results/s19_h100/call1_quant_layer_h200.json, one
#: call): at 128 x 128 weight rows with 256-row input blocks the fused layer took 1.516 ms (1.55x f16), 1.448 back
#: to back (1.524x), against 1.674 / 1.635 (1.71x / 1.72x) host-synced: faster, still over issue 14's 1.5x. Still
#: off until every GPU test runs at those defaults in one call (bench/calls/s17_b.sh, with the shapes below).
WARM_FUSED = False
#: The fused GEMMs of warm_fused: "mma", quant_mma.cu's tensor-core kernels (q4_k and q6_k rows: each weight decoded
#: once per block into a shared f16 tile between the MMAs of the step before), or "triton" (triton_moe.DeviceQuantGEMM,
#: above). Where the chosen kernels do not take the format (or cannot be built) the layer has no fused GEMMs and
#: takes the scratch path: Triton's fused kernels measured slower than it, so "mma" does not fall back to them.
FUSED_KERNEL = "mma"
#: quant_mma's (gate|up, down) weight rows a block: 256 (a block an SM; every arch has it). The fastest pair measured
#: (above, H100) is 128 x 128 with FUSED_INPUT_ROWS (256, 256); test_quant_mma runs every shape, the layer's tests
#: not yet at that pair as the default.
FUSED_BLOCK_ROWS = (256, 256)
#: quant_mma's (gate|up, down) input rows a block (quant_mma.SHAPES: 256 with 128 weight rows, sm_90a only).
FUSED_INPUT_ROWS = (128, 128)
#: With warm_device: the experts the scratch holds first (both halves' groups, expert order) are dequantized on the side
#: stream as soon as the layer starts, beside its routing and gather (which leave most SMs idle), not after them; a
#: warm layer on this path dequantizes every cached expert, routed to or not, so nothing is speculated.
#: Measured: 1.558 ms against 1.621 without (s15_h200/call2_), 1.542 against 1.549 a layer back to back (call6_).
WARM_DEVICE_AHEAD = True
#: The side stream's priority: "high" (the device's greatest: the dequantization takes SMs as the GEMMs free them) or
#: "default"; "high" gained nothing measurable (1.852 against 1.823 ms, call4_), so "default".
DEQUANT_PRIORITY = "default"
#: One token's layer from the quant blocks (quant_decode.cu, issue 14 item 5): routing fused into gate/up, each lane
#: issuing a trip's loads before any sum, x staged in shared memory in unit order; its kernels by the format of the
#: matrix each reads (no biases; other formats and biased ones take quant_fast.cu's route + GEMV + wide down).
DECODE_SOURCE_NAME = "quant_decode.cu"
DECODE_TYPES = ("q4_k", "q5_k", "q6_k", "q8_0")
DECODE_KERNEL_NAMES = tuple(f"strata_qd_{k}_{t}" for t in DECODE_TYPES for k in ("gate_up", "down"))
#: QD_PAIRS, QD_MAX_H, QD_MAX_KF, QD_MAXK of quant_decode.cu
DECODE_PAIRS = 3
DECODE_MAX_H = 4096
DECODE_MAX_KF = 8192
DECODE_MAX_K = 16
#: QuantMoE.decode_form: 2 quant_decode.cu's two kernels where decode_kernels_take (else 1), 1 quant_fast.cu's route,
#: GEMV and wide down kernels (the form before; bench/quant_layer_h200.py times both)
QUANT_DECODE_FORM = 2


def source_dir() -> str:
    """The package directory: moe_quant.cu includes quants.cuh from it (-I)."""
    return str(files("strata_cuda"))


def compile_options() -> tuple[str, ...]:
    """NVRTC / hiprtc options of moe_quant.cu."""
    return ("-std=c++17", f"-I{source_dir()}")


def kernel_source() -> str:
    """The text of strata_cuda/moe_quant.cu."""
    return files("strata_cuda").joinpath(SOURCE_NAME).read_text()


def fast_kernel_source() -> str:
    """The text of strata_cuda/quant_fast.cu."""
    return files("strata_cuda").joinpath(FAST_SOURCE_NAME).read_text()


def compile_to_ptx(arch: str = "compute_90", name: str = SOURCE_NAME) -> bytes:
    """moe_quant.cu (or quant_fast.cu) compiled to PTX with NVRTC (no GPU needed); RuntimeError with NVRTC's log."""
    from .kernels import nvrtc_compile
    return nvrtc_compile(files("strata_cuda").joinpath(name).read_text(), name, (f"-arch={arch}", *compile_options()))


def tile_list(offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(group, first row) of every TILE_ROWS-row tile of the non-empty groups (int32 each)."""
    offsets = np.asarray(offsets, dtype=np.int64)
    groups, rows = [], []
    for g in range(len(offsets) - 1):
        lo, hi = int(offsets[g]), int(offsets[g + 1])
        starts = np.arange(lo, hi, TILE_ROWS)
        groups.append(np.full(len(starts), g))
        rows.append(starts)
    if not groups:
        return np.zeros(0, np.int32), np.zeros(0, np.int32)
    return np.concatenate(groups).astype(np.int32), np.concatenate(rows).astype(np.int32)


def scratch_bytes(hidden: int, ffn: int, group_experts: int = GROUP_EXPERTS) -> int:
    """Device bytes of two scratch buffers of group_experts whole experts' f16 gate|up and down matrices."""
    return 2 * int(group_experts) * f16_expert_bytes(hidden, ffn)


def ring_group_sizes(n: int, ring_slots: int, want: int, in_flight: int = RING_GROUPS_IN_FLIGHT,
                     tail: tuple[int, ...] = RING_TAIL) -> list[int]:
    """Sizes of the copy groups that stream n missed experts through a ring of ring_slots: at most `want` each and
    in_flight groups on the ring, the head split evenly, then `tail` (each size at most the groups') when n is at
    least two groups."""
    big = max(1, min(int(want), int(ring_slots) // max(1, int(in_flight))))
    end = [s for s in tail if s <= big] if n >= 2 * big else []
    head = n - sum(end)
    groups = -(-head // big) if head > 0 else 0
    return [head // groups + (1 if i < head % groups else 0) for i in range(groups)] + end


def sb_takes(fmt: ExpertFormat) -> bool:
    """Whether strata_qf_dequant_sb dequantizes both matrices of this format (rows of whole 256-weight blocks)."""
    return fmt.gate_up in SB_TYPES and fmt.down in SB_TYPES and fmt.hidden % 256 == 0 and fmt.ffn % 256 == 0


def hit_groups(block_slots: Any, step: int, spec: tuple = (), merge_spec: bool = WARM_MERGE_SPEC,
               rest_whole: bool = WARM_REST_WHOLE, first: int | None = None) -> list[tuple[int, int, tuple, bool]]:
    """QuantMoE._run_blocks' groups over blocks of these slots, in block order: (first block, experts, scratch halves
    it uses, whether its f16 is speculated). spec holds each half's speculated slots (the first cached experts in
    expert order, so the blocks in a half are a run: blocks come in expert order too); the run of blocks in half 0,
    then the run in half 1, use them (one group with merge_spec), the rest are dequantized: groups of both halves
    (2 * step experts) with rest_whole, else of one half (the one used least recently; a first group of `first`
    where nothing was speculated)."""
    slots = np.asarray(block_slots).reshape(-1)
    n, step = int(slots.size), int(step)
    out: list[tuple[int, int, tuple, bool]] = []
    i = 0
    for half, part in enumerate(tuple(spec)[:2]):
        inside = np.isin(slots[i:], np.asarray(part))
        k = int(inside.size if inside.all() else np.argmin(inside))
        if k:
            out.append((i, k, (half,), True))
            i += k
    if merge_spec and len(out) == 2:
        out = [(out[0][0], out[0][1] + out[1][1], (0, 1), True)]
    last = [-1, -1]  # the group that last used each half
    for g, grp in enumerate(out):
        for half in grp[2]:
            last[half] = g
    while i < n:
        if rest_whole:
            m, halves = min(2 * step, n - i), (0, 1)
        else:
            lead = step if out or first is None else max(1, min(int(first), step))
            m, halves = min(lead, n - i), (0 if last[0] <= last[1] else 1,)
        for half in halves:
            last[half] = len(out)
        out.append((i, m, halves, False))
        i += m
    return out


def fast_path_takes(fmt: ExpertFormat) -> bool:
    """Whether QuantMoE (f16 scratch + cuBLAS) runs this format: no biases (its SwiGLU kernel adds none), rows of
    whole 32-weight chunks."""
    return (not fmt.bias and fmt.hidden % 32 == 0 and fmt.ffn % 32 == 0 and fmt.gate_up in FAST_TYPES
            and fmt.down in FAST_TYPES)


def gemv_takes(fmt: ExpertFormat) -> bool:
    """Whether quant_fast.cu's GEMV kernels run this format (biases included)."""
    return fmt.hidden % 32 == 0 and fmt.ffn % 32 == 0 and fmt.gate_up in FAST_TYPES and fmt.down in FAST_TYPES


def decode_kernels_take(fmt: ExpertFormat, experts: int, top_k: int, blob_ptr: int, slot_bytes: int) -> bool:
    """Whether quant_decode.cu's kernels run a decode step of this format over a blob at blob_ptr with slots of
    slot_bytes: its types, no biases, its shared-memory bounds, and the 16-byte alignment q4_k/q5_k's loads take."""
    if fmt.bias or fmt.gate_up not in DECODE_TYPES or fmt.down not in DECODE_TYPES:
        return False
    if not (0 < fmt.hidden <= DECODE_MAX_H and 0 < top_k <= DECODE_MAX_K and top_k * fmt.ffn <= DECODE_MAX_KF
            and experts <= THREADS and fmt.hidden % 32 == 0 and fmt.ffn % 32 == 0):
        return False
    wide = {"q4_k", "q5_k"}
    offsets = ([0] if fmt.gate_up in wide else []) + ([fmt.down_offset] if fmt.down in wide else [])
    return all((int(blob_ptr) + int(o)) % 16 == 0 for o in offsets) and (not offsets or int(slot_bytes) % 16 == 0)


def decode_kernel_source() -> str:
    """The text of strata_cuda/quant_decode.cu."""
    return files("strata_cuda").joinpath(DECODE_SOURCE_NAME).read_text()


#: source file name -> its kernels by name, compiled once per process (_compiled)
_COMPILED: dict[str, dict[str, Any]] = {}


def _compiled(cupy: Any, source_name: str, text: Any, names: tuple[str, ...]) -> dict[str, Any]:
    """The kernels `names` of the source `text()` (named `source_name`) on the current device, compiled once."""
    got = _COMPILED.get(source_name)
    if got is None:
        mod = cupy.RawModule(code=text(), options=compile_options())
        got = _COMPILED[source_name] = {n: mod.get_function(n) for n in names}
    return got


def decode_kernels(cupy: Any) -> dict[str, Any]:
    """quant_decode.cu's kernels on the current device, compiled once per process."""
    return _compiled(cupy, DECODE_SOURCE_NAME, decode_kernel_source, DECODE_KERNEL_NAMES)


class QuantGroupedFFN:
    """moe_grouped_ffn over a 'gguf' pool on the current cupy device (see the module docstring)."""

    def __init__(self, cupy: Any, mma: bool | None = None, fast: bool = True, pinned: Any = None):
        self._cp = cupy
        #: the session's page-locked allocator: the QuantMoE it builds takes its staging from it (None: cupy's own)
        self._pinned = pinned
        #: tensor cores (mma.sync, f16 inputs) or the f32 SIMT kernels, for the tiled path
        self.mma = MMA_BY_DEFAULT if mma is None else bool(mma)
        #: the GEMV kernels for small groups and QuantMoE for large ones (False: the tiled kernels for everything;
        #: always on ROCm, where quant_fast.cu's warp shuffles and f16 conversion do not build)
        self.fast = bool(fast) and not _is_hip(cupy)
        self._module = cupy.RawModule(code=kernel_source(), options=compile_options())
        # compile now, so a broken toolchain fails at start-up and not in the middle of a request
        names = MMA_KERNEL_NAMES if self.mma else KERNEL_NAMES
        self._gate_up, self._down = (self._module.get_function(n) for n in names)
        self._threads = MMA_THREADS if self.mma else THREADS
        self._fk = fast_kernels(cupy) if self.fast else None
        self._moe: dict[tuple, QuantMoE] = {}
        #: which path each call took (tests and benches read it)
        self.counts = {"gemv": 0, "dequant_gemm": 0, "tiled": 0}

    def __call__(self, x: Any, offsets: Any, slots: Any, pool: ExpertPool) -> Any:
        """x [N,H] f32 (cupy); rows offsets[g]:offsets[g+1] run the expert in slot slots[g] -> y [N,H] f32."""
        cp = self._cp
        fmt = pool.fmt
        x = cp.ascontiguousarray(cp.asarray(x, dtype=cp.float32))
        n, h = (int(s) for s in x.shape)
        blob = pool.arrays["blob"]
        s_slots, slot_b = (int(s) for s in blob.shape)
        if h != fmt.hidden or fmt.nbytes > slot_b:
            raise ValueError(f"moe_grouped_ffn: x has hidden {h}, the experts {fmt.hidden} in {fmt.nbytes}-byte "
                             f"slots of {slot_b}")
        off_h = _host(offsets).astype(np.int32)
        slots_h = _host(slots).astype(np.int32)
        f = fmt.ffn
        counts = np.diff(off_h)
        if len(counts) == 0 or int(counts.max(initial=0)) <= 0:
            return cp.zeros((n, h), dtype=cp.float32)
        if self.fast and int(counts.max()) <= GEMV_MAX_ROWS and gemv_takes(fmt):
            self.counts["gemv"] += 1
            return self._gemv(x, off_h, slots_h, pool)
        if self.fast and fast_path_takes(fmt) and s_slots <= (1 << 31) - 1:
            key = (h, f)
            if key not in self._moe:
                self._moe[key] = QuantMoE(256, 1, fmt, pinned=self._pinned)
            self.counts["dequant_gemm"] += 1
            moe = self._moe[key]
            moe.compute_stream = cp.cuda.get_current_stream()
            # a slot outside the pool: computed with slot 0, then its rows zeroed (the reference's zero rows)
            bad = (slots_h < 0) | (slots_h >= s_slots)
            y = moe.grouped_ffn(x, off_h, np.where(bad, 0, slots_h), pool)
            for g in np.flatnonzero(bad & (counts > 0)):
                y[int(off_h[g]):int(off_h[g + 1])] = 0
            return y
        self.counts["tiled"] += 1
        groups, rows0 = tile_list(off_h)
        y = cp.zeros((n, h), dtype=cp.float32)  # rows in no group stay zero, as in the reference
        if len(groups) == 0:
            return y
        off_d, slots_d = cp.asarray(off_h), cp.asarray(slots_h)
        grp_d, row_d = cp.asarray(groups), cp.asarray(rows0)
        act = cp.empty((n, f), dtype=cp.float32)
        bias_off = np.int64(fmt.bias_offset if fmt.bias else -1)
        t = len(groups)
        self._gate_up(
            ((f + TILE_OUTPUTS - 1) // TILE_OUTPUTS, t), (self._threads,),
            (x, off_d, slots_d, grp_d, row_d, np.int32(s_slots), np.int32(h), np.int32(f), blob, np.int64(slot_b),
             np.int64(fmt.gate_up_row_bytes), np.int32(GGML_TYPES[fmt.gate_up]), bias_off, act))
        self._down(
            ((h + TILE_OUTPUTS - 1) // TILE_OUTPUTS, t), (self._threads,),
            (act, off_d, slots_d, grp_d, row_d, np.int32(s_slots), np.int32(h), np.int32(f), blob, np.int64(slot_b),
             np.int64(fmt.down_offset), np.int64(fmt.down_row_bytes), np.int32(GGML_TYPES[fmt.down]), bias_off, y))
        return y

    def _gemv(self, x: Any, off_h: np.ndarray, slots_h: np.ndarray, pool: ExpertPool) -> Any:
        """The GEMV kernels over every group (a few rows each): act [N,F], then y [N,H]."""
        cp = self._cp
        fmt = pool.fmt
        n, h, f = int(x.shape[0]), fmt.hidden, fmt.ffn
        blob = pool.arrays["blob"]
        s_slots, slot_b = (int(s) for s in blob.shape)
        # every row of a group is written; only rows outside the groups need zeros (the reference's)
        lo, hi = int(off_h[0]), int(off_h[-1])
        y = cp.empty((n, h), dtype=cp.float32)
        if lo > 0 or hi < n:
            y[:lo] = 0
            y[hi:] = 0
        act = cp.empty((n, f), dtype=cp.float32)
        tab = cp.asarray(np.concatenate([off_h, slots_h]).astype(np.int32))  # one small upload
        g = len(slots_h)
        off_d, slots_d = tab[:g + 1], tab[g + 1:]
        bias_off = np.int64(fmt.bias_offset if fmt.bias else -1)
        self._fk["strata_qf_gemv_gate_up"](
            ((f + FAST_WARPS - 1) // FAST_WARPS, g), (FAST_THREADS,),
            (x, np.int64(h), off_d, np.uint64(0), slots_d, np.int32(s_slots), np.int32(h), np.int32(f), blob,
             np.int64(slot_b), np.int64(fmt.gate_up_row_bytes), np.int32(GGML_TYPES[fmt.gate_up]), bias_off,
             np.int32(0), act))
        self._fk["strata_qf_gemv_down"](
            ((h + FAST_WARPS - 1) // FAST_WARPS, g), (FAST_THREADS,),
            (act, off_d, slots_d, np.int32(s_slots), np.int32(h), np.int32(f), blob, np.int64(slot_b),
             np.int64(fmt.down_offset), np.int64(fmt.down_row_bytes), np.int32(GGML_TYPES[fmt.down]), bias_off, y))
        return y


def fast_kernels(cupy: Any) -> dict[str, Any]:
    """quant_fast.cu's kernels on the current device, compiled once per process."""
    return _compiled(cupy, FAST_SOURCE_NAME, fast_kernel_source, FAST_KERNEL_NAMES)


class QuantDecodeLayer(DecodeLayer):
    """A DecodeLayer whose pool is 'gguf' (its key names the blob, not f16 arrays)."""

    def key(self) -> tuple:
        """The buffers a captured graph of this layer reads and writes."""
        return (self.norm_w.data.ptr, self.router_w.data.ptr, self.pool.arrays["blob"].data.ptr,
                self.slot_map.data.ptr, self.ids.data.ptr, self.w.data.ptr, self.host)


class QuantMoE(FastMoE):
    """FastMoE over 'gguf' pools of one ExpertFormat (see the module docstring); f16 and Q8_0 pools still work."""

    def __init__(self, experts: int, top_k: int, fmt: ExpertFormat, group_experts: int = GROUP_EXPERTS,
                 scratch_budget_bytes: int = SCRATCH_BUDGET_BYTES, **kw: Any):
        super().__init__(experts, top_k, fmt.hidden, fmt.ffn, group_experts=group_experts, **kw)
        import cupy
        if not gemv_takes(fmt):
            raise ValueError(f"QuantMoE: {fmt.label} at hidden {fmt.hidden}, ffn {fmt.ffn} is not on the fast path")
        self.fmt = fmt
        self._qk = fast_kernels(cupy)
        # the side stream the dequantization of the next group runs on, dequant_stream (DEQUANT_PRIORITY)
        self.set_dequant_priority(DEQUANT_PRIORITY)
        #: how the prefill uses its scratch (groups of whole experts, or pieces of one)
        self.layout = scratch_layout(fmt.hidden, fmt.ffn, experts, scratch_budget_bytes, group_experts)
        self._ready: tuple | None = None
        self._beta = (np.zeros(1, np.float32), np.ones(1, np.float32))  # host scalars cuBLAS reads at enqueue
        #: decode's down projection with QF_DW warps a row (False: one warp a row, the first kernel)
        self.decode_down_wide = True
        #: decode's kernels over 'gguf' pools (QUANT_DECODE_FORM); set before the first decode (graphs are kept)
        self.quant_decode_form = QUANT_DECODE_FORM
        self._qd: dict[str, Any] | None = None
        #: streamed copy groups in flight on the ring, and the last groups' sizes (RING_GROUPS_IN_FLIGHT, RING_TAIL)
        self.ring_groups_in_flight = RING_GROUPS_IN_FLIGHT
        self.ring_tail = RING_TAIL
        #: experts of a warm prefill's first dequantized group (None: a whole scratch half's). A first group of a
        #: quarter hid the first dequantization behind GEMMs sooner, but each group costs the host ~0.6 ms and the
        #: warm layer is host-bound: 4 groups of 32 took 2.13 ms against 3.13 ms for 8 + 32 + 32 + 32 + 24 (H200,
        #: bench/results/q2_h200/call1_q2_diag.json)
        self.first_group_experts: int | None = None
        #: whole experts' dequantization kernel (DEQUANT_KERNEL), scratch halves speculated before the routing
        #: (WARM_SPEC_HALVES; launched after the routing kernels with spec_after_route), and how hit_groups groups
        #: the rest (WARM_MERGE_SPEC, WARM_REST_WHOLE)
        self.dequant_kernel = DEQUANT_KERNEL
        self.warm_spec_halves = WARM_SPEC_HALVES
        self.spec_after_route = False
        self.warm_merge_spec = WARM_MERGE_SPEC
        self.warm_rest_whole = WARM_REST_WHOLE
        #: warm 'gguf' layers on the device-table path (WARM_DEVICE; where FastMoE has one), and there with the
        #: decode inside the GEMMs (WARM_FUSED)
        self.warm_device = WARM_DEVICE
        self.warm_fused = WARM_FUSED
        #: which fused GEMMs (FUSED_KERNEL): "mma" (quant_mma.cu) or "triton"; none where they do not take the format
        self.fused_kernel = FUSED_KERNEL
        #: quant_mma's (gate|up, down) block rows and input rows (quant_mma.SHAPES; all but 256 x 128 on sm_90a only)
        self.fused_block_rows = FUSED_BLOCK_ROWS
        self.fused_input_rows = FUSED_INPUT_ROWS
        #: why quant_mma's kernels were not taken where they were not (the layer then takes the scratch path)
        self.fused_error: str | None = None
        self.warm_device_ahead = WARM_DEVICE_AHEAD
        self._ahead: tuple | None = None
        self._fused: dict = {}
        #: the last prefill's speculation: experts dequantized ahead, and blocks that used them (tests, benches)
        self.spec_report = {"speculated": 0, "used": 0}
        self._spec: dict | None = None
        self._spec_launch: Any = None
        # page-locked staging of the slot tables the dequantization reads, used from a cursor that restarts once
        # its last upload has run (as FastMoE's pointer staging)
        n = 64 * max(experts, 64)
        self._slot_mem = self._page_locked(4 * n)
        self._slot_stage = np.frombuffer(self._slot_mem, dtype=np.int32, count=n)
        self._slot_dev = cupy.cuda.alloc(4 * n)
        self._slot_cursor = 0
        self._slot_done = cupy.cuda.Event(disable_timing=True)

    def set_dequant_priority(self, priority: str) -> None:
        """A new side stream of this priority ("high": the device's greatest; "default"); call between layers."""
        cp = self._cp
        if priority not in ("high", "default"):
            raise ValueError(f"QuantMoE: a dequantization priority is 'high' or 'default', not {priority!r}")
        self.dequant_priority = priority
        if priority == "high":
            # CUDA clamps a priority past its range to the range's end: this is the device's greatest (cupy does
            # not bind cudaDeviceGetStreamPriorityRange)
            self.dequant_stream = cp.cuda.Stream(non_blocking=True, priority=-1000)
        else:
            self.dequant_stream = cp.cuda.Stream(non_blocking=True)

    def miss_groups(self, n: int, ring_slots: int, slot_bytes: int = 0) -> list[int]:
        """Copy groups of n streamed experts (ring_group_sizes): FastMoE's sizes (group_experts, or COPY_GROUP_BYTES
        a group) with ring_groups_in_flight groups on the ring; _group computes a group larger than a scratch half
        in halves' worth."""
        want = max(self.group_experts, COPY_GROUP_BYTES // slot_bytes if slot_bytes > 0 else 0)
        return ring_group_sizes(n, ring_slots, want, self.ring_groups_in_flight, self.ring_tail)

    def scratch_bytes(self) -> int:
        """The dequantization scratch a prefill layer takes (both halves, or the one buffer of pieces)."""
        return self.layout.nbytes

    def prefill_buffer_bytes(self, tokens: int, pool_dtype: str, slot_bytes: int = 0) -> dict[str, int]:
        """FastMoE's prefill buffers; a 'gguf' pool's "scratch" is the layout's (at most the plan's budget)."""
        out = super().prefill_buffer_bytes(tokens, pool_dtype, slot_bytes)
        if pool_dtype == "gguf":  # first, as FastMoE orders it: the carves take the workspace line in this order
            out = {"scratch": self.layout.nbytes, **{n: b for n, b in out.items() if n != "scratch"}}
        return out

    def _scratch_base(self) -> int:
        """The scratch's address: a buffer the plan lent (use_buffers) or one of this object's own."""
        return self._ws.setdefault("scratch", _Grown(self._cp)).ptr(self.layout.nbytes)

    def _upload_slots(self, slots: np.ndarray) -> int:
        """An int32 slot table on the device (async on the current stream); its address."""
        n = int(slots.size)
        if n > self._slot_stage.size:
            raise ValueError(f"QuantMoE: {n} slots exceed the staging of {self._slot_stage.size}")
        if self._slot_cursor + n > self._slot_stage.size:
            self._slot_done.synchronize()
            self._slot_cursor = 0
        c = self._slot_cursor
        self._slot_stage[c:c + n] = slots
        dst = int(self._slot_dev.ptr) + 4 * c
        st = self._cp.cuda.get_current_stream()
        self._rt.memcpyAsync(dst, self._slot_stage.ctypes.data + 4 * c, 4 * n, 1, st.ptr)
        self._slot_done.record(st)
        self._slot_cursor = c + n
        return dst

    def _dequant(self, pool: ExpertPool, table: int, m: int, buf: int,
                 whole: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Dequantize the m experts of the device slot table into scratch half `buf` (with `whole`: the whole scratch,
        up to twice a half's experts) on the current stream; the device pointers of each one's f16 gate|up [2F,H] and
        down [H,F] matrices."""
        fmt = pool.fmt  # a shared QuantMoE (QuantGroupedFFN's) sees every format of its shape
        h, f = self.hidden, self.ffn
        n13, n2 = 2 * f * h, h * f
        most = self.layout.group_experts * (2 if whole else 1)
        if not 0 < m <= most:
            raise ValueError(f"QuantMoE: {m} experts do not fit a scratch {'' if whole else 'half '}of {most}")
        base = self._scratch_base() + (0 if whole else buf * (self.layout.nbytes // 2))
        s13, s2 = base, base + 2 * m * n13
        blob = pool.arrays["blob"]
        slot_b = int(blob.shape[1])
        mats = ((0, fmt.gate_up_row_bytes, 2 * f, h, fmt.gate_up, s13),
                (fmt.down_offset, fmt.down_row_bytes, h, f, fmt.down, s2))
        pair = (fmt.gate_up, fmt.down)
        kern = self.dequant_kernel
        if kern == "sbt" and sb_takes(fmt) and pair in SBT_PAIRS:
            (oa, ra, rows_a, cols_a, _, da), (ob, rb_, rows_b, cols_b, _, db) = mats
            self._qk[f"strata_qf_dequant_{kern}_{fmt.gate_up}_{fmt.down}"](
                (max(1, min(SB_MAX_BLOCKS, -(-(rows_a + rows_b) // (2 * FAST_WARPS)))), m), (FAST_THREADS,),
                (blob, np.int64(slot_b), np.uint64(table), np.int32(m), np.int64(oa), np.int64(ra), np.int32(rows_a),
                 np.int32(cols_a), np.uint64(da), np.int64(ob), np.int64(rb_), np.int32(rows_b), np.int32(cols_b),
                 np.uint64(db)))
        elif kern in ("sb", "sbt") and sb_takes(fmt):
            (oa, ra, rows_a, cols_a, ta, da), (ob, rb_, rows_b, cols_b, tb, db) = mats
            # a warp per row, two rows a warp: blockIdx.y is the expert
            self._qk["strata_qf_dequant_sb"](
                (max(1, min(SB_MAX_BLOCKS, -(-(rows_a + rows_b) // (2 * FAST_WARPS)))), m), (FAST_THREADS,),
                (blob, np.int64(slot_b), np.uint64(table), np.int32(m), np.int64(oa), np.int64(ra), np.int32(rows_a),
                 np.int32(cols_a), np.int32(GGML_TYPES[ta]), np.uint64(da), np.int64(ob), np.int64(rb_),
                 np.int32(rows_b), np.int32(cols_b), np.int32(GGML_TYPES[tb]), np.uint64(db)))
        else:
            for off, rb, rows, cols, typ, dst in mats:
                chunks = rows * (cols // 32)  # of one expert: blockIdx.y is the expert
                self._qk["strata_qf_dequant_f16"](
                    (max(1, min(4096, -(-chunks // FAST_THREADS))), m), (FAST_THREADS,),
                    (blob, np.int64(slot_b), np.uint64(table), np.int32(m), np.int64(off), np.int64(rb),
                     np.int32(rows), np.int32(cols), np.int32(GGML_TYPES[typ]), np.uint64(dst)))
        idx = np.arange(m, dtype=np.int64)
        return s13 + idx * (2 * n13), s2 + idx * (2 * n2)

    def _weights_f16(self, pool: ExpertPool, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if pool.dtype != "gguf":
            return super()._weights_f16(pool, slots)
        if self._ready is not None:  # dequantized ahead on the side stream by _run_blocks
            return self._ready
        # a ring group of _stream_misses: on this stream, after the GEMMs that read the scratch before and after a
        # speculated dequantization no group waited for
        self._spec_wait(self._cp.cuda.get_current_stream(), (0, 1))
        return self._dequant(pool, self._upload_slots(np.asarray(slots, dtype=np.int32)), len(slots), 0)

    def _group(self, pool: ExpertPool, slots: np.ndarray, blk0: int, lay: Any, bufs: tuple) -> None:
        g = self.layout.group_experts
        if pool.dtype == "gguf" and self._ready is None and g == 0:
            table = self._upload_slots(np.asarray(slots, dtype=np.int32))
            for i in range(len(slots)):
                self._pieces(pool, table + 4 * i, blk0 + i, lay, bufs)
            return
        if pool.dtype == "gguf" and self._ready is None and len(slots) > g:
            for sub in range(0, len(slots), g):  # a half of the scratch holds g experts
                super()._group(pool, slots[sub:sub + g], blk0 + sub, lay, bufs)
            return
        super()._group(pool, slots, blk0, lay, bufs)

    def _gemm(self, m: int, n: int, k: int, a: int, lda: int, b: int, ldb: int, c: int, ldc: int,
              accumulate: bool) -> None:
        """One GEMM of FastMoE._gemm_tn's layout (row-major C_rows (+)= B_rows @ A_rows^T) on the current stream."""
        cb = self._cublas
        cb.setStream(self._handle, self._cp.cuda.get_current_stream().ptr)
        cb.setPointerMode(self._handle, _CUBLAS_POINTER_MODE_HOST)
        cb.gemmStridedBatchedEx(self._handle, _CUBLAS_OP_T, _CUBLAS_OP_N, m, n, k, self._beta[1].ctypes.data,
                                a, _CUDA_R_16F, lda, 0, b, _CUDA_R_16F, ldb, 0,
                                self._beta[int(bool(accumulate))].ctypes.data, c, _CUDA_R_16F, ldc, 0, 1,
                                _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT)

    def _dequant_part(self, pool: ExpertPool, table: int, off: int, rb: int, rows: int, r0: int, c0: int,
                      ccols: int, typ: str, dst: int) -> None:
        """Rows r0.. and 32-weight chunks c0.. of one matrix of the expert at the slot table into dst (f16)."""
        blob = pool.arrays["blob"]
        self._qk["strata_qf_dequant_f16_part"](
            (max(1, min(4096, -(-rows * ccols // FAST_THREADS))), 1), (FAST_THREADS,),
            (blob, np.int64(blob.shape[1]), np.uint64(table), np.int32(1), np.int64(off), np.int64(rb),
             np.int32(rows), np.int32(r0), np.int32(c0), np.int32(ccols), np.int32(GGML_TYPES[typ]), np.uint64(dst)))

    def _pieces(self, pool: ExpertPool, table: int, blk: int, lay: Any, bufs: tuple) -> None:
        """One expert too big for a scratch half, on the current stream in pieces of the scratch: gate/up by blocks
        of output rows (gate's and up's), SwiGLU, then down by blocks of K, each added to the last (beta = 1)."""
        fmt, h, f = pool.fmt, self.hidden, self.ffn
        xs, gu, act, ys = bufs
        row0 = int(lay.row0[blk])
        n = int(lay.cap[blk] if self.gemm_mode in CLASS_MODES else lay.count[blk])
        if n <= 0:
            return
        base = self._scratch_base()
        fb, kb = self.layout.gate_up_rows, self.layout.down_cols
        for f0 in range(0, f, fb):
            r = min(fb, f - f0)
            for half, first in ((0, f0), (1, f + f0)):  # gate rows f0.., then up rows F + f0..
                dst = base + half * 2 * r * h
                self._dequant_part(pool, table, 0, fmt.gate_up_row_bytes, r, first, 0, h // 32, fmt.gate_up, dst)
                self._gemm(r, n, h, dst, h, xs + 2 * row0 * h, h, gu + 2 * (row0 * 2 * f + first), 2 * f, False)
        self._k["strata_fast_swiglu"]((self._stride_blocks(n * (f // 8)),), (THREADS,),
                                      (np.uint64(gu), np.int64(row0), np.int64(n), np.int32(f), np.uint64(act)))
        for k0 in range(0, f, kb):
            c = min(kb, f - k0)
            self._dequant_part(pool, table, fmt.down_offset, fmt.down_row_bytes, h, 0, k0 // 32, c // 32, fmt.down,
                               base)
            self._gemm(h, n, c, base, c, act + 2 * (row0 * f + k0), f, ys + 2 * row0 * h, h, k0 > 0)

    def _run_blocks(self, pool: ExpertPool, block_slots: np.ndarray, blk0: int, lay: Any, bufs: tuple) -> None:
        if pool.dtype != "gguf":
            return super()._run_blocks(pool, block_slots, blk0, lay, bufs)
        cp = self._cp
        n, step = len(block_slots), self.layout.group_experts
        main, side = cp.cuda.get_current_stream(), self.dequant_stream
        table = self._upload_slots(np.asarray(block_slots, dtype=np.int32))
        if step == 0:  # pieces of one expert at a time, on this stream
            for i in range(n):
                self._pieces(pool, table + 4 * i, blk0 + i, lay, bufs)
            return
        fork = cp.cuda.Event(disable_timing=True)
        fork.record(main)
        side.wait_event(fork)  # the table has landed and earlier readers of the scratch are done
        spec = self._spec
        groups = hit_groups(block_slots, step, spec["slots"] if spec else (), self.warm_merge_spec,
                            self.warm_rest_whole, self.first_group_experts)
        last: list = [None, None]  # the event after the GEMMs that last read each half
        # each group dequantized on the side stream (the next one while this one's GEMMs run, where it has a half
        # of its own) or speculated before the routing (_speculate), then its GEMMs on this stream
        try:
            for sub, m, halves, ahead in groups:
                if ahead:
                    self._spec_wait(main, halves)
                    ptrs = self._spec_ptrs(block_slots[sub:sub + m])
                    self.spec_report["used"] += m
                else:
                    for half in halves:
                        if last[half] is not None:
                            side.wait_event(last[half])
                    with side:
                        ptrs = self._dequant(pool, table + 4 * sub, m, halves[0], whole=len(halves) == 2)
                    ready = cp.cuda.Event(disable_timing=True)
                    ready.record(side)
                    main.wait_event(ready)
                self._ready = ptrs
                FastMoE._group(self, pool, block_slots[sub:sub + m], blk0 + sub, lay, bufs)
                ev = cp.cuda.Event(disable_timing=True)
                ev.record(main)
                for half in halves:
                    last[half] = ev
                self._mark(f"hit_group_{sub}_{m}{'_spec' if ahead else ''}")
        finally:
            self._ready = None

    # -- warm layers on the device-table path (WARM_DEVICE) ------------------------------------------------------

    def _device_takes(self, pool: ExpertPool, tokens: int) -> bool:
        """FastMoE's f16 pools, and 'gguf' pools on the fast path with a scratch of whole experts, for chunks long
        enough to route to nearly every expert (every cached one is dequantized, routed to or not)."""
        if pool.dtype != "gguf":
            return super()._device_takes(pool, tokens)
        if not self.warm_device:
            return False
        if self.warm_fused and self._fused_gemm(pool.fmt) is not None:
            return True  # nothing is decoded for an expert the routing leaves out: any chunk
        return bool(self.layout.group_experts > 0 and fast_path_takes(pool.fmt)
                    and tokens * self.top_k >= SPEC_MIN_ROWS_PER_EXPERT * self.experts)

    def _fused_gemm(self, fmt: ExpertFormat) -> Any:
        """The GEMMs that decode this format's blocks in their K loop (built once): quant_mma.QuantMmaGEMM where
        fused_kernel is "mma" and it takes the format and builds (else None, the reason in fused_error),
        triton_moe.DeviceQuantGEMM where fused_kernel is "triton" and Triton runs it (else None)."""
        from . import quant_mma, triton_moe
        key = (fmt.gate_up, fmt.down, fmt.bias, self.fused_kernel, self.fused_block_rows, self.fused_input_rows)
        if key not in self._fused:
            args = (fmt.hidden, fmt.ffn, self.experts, fmt.gate_up, fmt.down, fmt.gate_up_row_bytes,
                    fmt.down_row_bytes, fmt.down_offset)
            got = None
            kinds = (fmt.gate_up, fmt.down, fmt.hidden, fmt.ffn, fmt.bias)
            if self.fused_kernel == "mma" and quant_mma.takes(*kinds, self.fused_block_rows, self.fused_input_rows):
                try:  # an optional path: a shape this device's build lacks, or a compile error, falls back
                    got = quant_mma.QuantMmaGEMM(*args, block_rows=self.fused_block_rows,
                                                 input_rows=self.fused_input_rows)
                except (ValueError, RuntimeError) as e:
                    self.fused_error = f"{type(e).__name__}: {e}"
            elif self.fused_kernel == "mma" and quant_mma.takes(*kinds):
                # the format is quant_mma's but not these block shapes: say so rather than fall back in silence
                self.fused_error = (f"quant_mma: no blocks of {self.fused_input_rows} input x {self.fused_block_rows} "
                                    f"weight rows for hidden {fmt.hidden}, ffn {fmt.ffn} (shapes "
                                    f"{quant_mma.SHAPES})")
            elif self.fused_kernel == "triton" and self.device_gemm is not None and triton_moe.quant_takes(*kinds):
                got = triton_moe.DeviceQuantGEMM(*args)
            self._fused[key] = got
        return self._fused[key]

    def _prefill_device(self, x: Any, logits: Any, pool: ExpertPool, slot_of: np.ndarray, out: Any,
                        accumulate: bool, on_counts: Any) -> Any:
        """FastMoE._prefill_device; over a 'gguf' pool with warm_device_ahead the first two groups' dequantization is
        queued on the side stream before the routing (_dequant_ahead)."""
        fused = pool.dtype == "gguf" and self.warm_fused and self._fused_gemm(pool.fmt) is not None
        if pool.dtype == "gguf" and self.warm_device_ahead and not fused and self.layout.group_experts > 0:
            self._ahead = self._dequant_ahead(pool, slot_of)
        try:
            return super()._prefill_device(x, logits, pool, slot_of, out, accumulate, on_counts)
        finally:
            self._ahead = None

    def _dequant_ahead(self, pool: ExpertPool, slot_of: np.ndarray) -> tuple[int, list]:
        """Groups 0 and 1 of _device_experts (expert order, a scratch half each) dequantized on the side stream after
        the compute stream's work so far (the last layer's readers of the scratch): (the slot table, uploaded on
        the side stream for every expert, and [(w13, w2, ready event)] of those groups)."""
        cp, side, step = self._cp, self.dequant_stream, self.layout.group_experts
        fork = cp.cuda.Event(disable_timing=True)
        fork.record(cp.cuda.get_current_stream())
        side.wait_event(fork)
        with side:
            table = self._upload_slots(np.asarray(slot_of, dtype=np.int32))
            got = [self._dequant_group(pool, table, e_lo, half)
                   for half, e_lo in enumerate(range(0, min(self.experts, 2 * step), step))]
        self._mark("ahead_queued")
        return table, got

    def _dequant_group(self, pool: ExpertPool, table: int, e_lo: int, half: int) -> tuple:
        """The group of _device_experts from expert e_lo dequantized into scratch half `half` on the current (side)
        stream: (w13, w2, the event after it)."""
        m = min(self.experts, e_lo + self.layout.group_experts) - e_lo
        w13, w2 = self._dequant(pool, table + 4 * e_lo, m, half)
        ready = self._cp.cuda.Event(disable_timing=True)
        ready.record(self._cp.cuda.get_current_stream())
        return w13, w2, ready

    def _device_experts(self, pool: ExpertPool, slot_of: np.ndarray, xs: int, act: int, ys: int, counts: int,
                        row_of: int, slot_d: int, routed_rows: int) -> None:
        """Every cached expert in groups of a scratch half (expert order): group g dequantized on the side stream
        into half g % 2 once the GEMMs that read that half before are done, then its Triton launches on this
        stream; the next group's dequantization is queued before this one's GEMMs run (groups 0 and 1: before the
        routing, where _prefill_device queued them)."""
        if pool.dtype != "gguf":
            return super()._device_experts(pool, slot_of, xs, act, ys, counts, row_of, slot_d, routed_rows)
        cp = self._cp
        fused = self._fused_gemm(pool.fmt) if self.warm_fused else None
        if fused is not None:  # the blocks decoded inside the GEMMs' K loop, straight from the pool's slots
            blob = pool.arrays["blob"]
            fused.quant_layer(cp.cuda.get_current_stream().ptr, xs, act, ys, int(blob.data.ptr), int(blob.shape[1]),
                              counts, row_of, slot_d, routed_rows)
            return
        main, side = cp.cuda.get_current_stream(), self.dequant_stream
        step = self.layout.group_experts
        # the slot table: uploaded with the groups ahead (on the side stream, before them), else here
        table, ahead = self._ahead or (self._upload_slots(np.asarray(slot_of, dtype=np.int32)), [])
        fork = cp.cuda.Event(disable_timing=True)
        fork.record(main)  # the table, and the last layer's readers of the scratch
        side.wait_event(fork)
        read: list = [None, None]  # the event after the GEMMs that last read each half
        for g, e_lo in enumerate(range(0, self.experts, step)):
            e_hi, half = min(self.experts, e_lo + step), g % 2
            if g < len(ahead):
                w13, w2, ready = ahead[g]
            else:
                if read[half] is not None:
                    side.wait_event(read[half])
                with side:
                    w13, w2, ready = self._dequant_group(pool, table, e_lo, half)
            main.wait_event(ready)
            self.device_gemm.layer(main.ptr, xs, act, ys, int(w13[0]), int(w2[0]), counts, row_of, None,
                                   routed_rows, (e_lo, e_hi))
            read[half] = cp.cuda.Event(disable_timing=True)
            read[half].record(main)
            self._mark(f"device_group_{e_lo}_{e_hi}")

    # -- the speculated dequantization of a prefill's first cached experts (WARM_SPEC_HALVES) -----------------

    def prefill_layer(self, x: Any, logits: Any, pool: ExpertPool, slot_of_expert: np.ndarray,
                      host_pool: ExpertPool | None = None, ring: Any = None, out: Any = None,
                      accumulate: bool = False, on_counts: Any = None) -> Any:
        """FastMoE.prefill_layer; over a 'gguf' pool the first cached experts (expert order) are dequantized into the
        scratch halves on the side stream before the routing is known (_speculate), and the groups that route to
        them use that f16 (hit_groups); a slot on_counts gives another expert is not used from it."""
        slot_of = np.asarray(slot_of_expert, dtype=np.int64)
        self.spec_report = {"speculated": 0, "used": 0}
        if pool.dtype != "gguf" or not self._speculate(pool, slot_of, int(x.shape[0])):
            return super().prefill_layer(x, logits, pool, slot_of, host_pool, ring, out, accumulate, on_counts)
        given = on_counts

        def on_counts_checked(counts: np.ndarray) -> np.ndarray:
            new = np.asarray(given(counts), dtype=np.int64)
            self._spec_forget(slot_of, new)
            return new
        try:
            return super().prefill_layer(x, logits, pool, slot_of, host_pool, ring, out, accumulate,
                                         on_counts_checked if given is not None else None)
        finally:
            self._spec_launch = None
            # whatever no group waited for is waited for here: later users of the scratch on the compute stream
            # (the next layer's speculation forks from it) come after it
            self._spec_wait(self.compute_stream, (0, 1))
            self._spec = None

    def _speculate(self, pool: ExpertPool, slot_of: np.ndarray, tokens: int) -> bool:
        """Queue the dequantization of the first cached experts (expert order; a scratch half each step of them) on
        the side stream after the compute stream's work so far, now or (spec_after_route) once the routing kernels
        are queued; False where nothing is speculated (no halves, pieces, a short chunk, nothing cached)."""
        step, halves = self.layout.group_experts, min(2, int(self.warm_spec_halves))
        if halves <= 0 or step <= 0 or tokens * self.top_k < SPEC_MIN_ROWS_PER_EXPERT * self.experts:
            return False
        cached = slot_of[slot_of >= 0]
        parts = [p for p in (cached[i * step:(i + 1) * step] for i in range(halves)) if p.size]
        if not parts:
            return False
        cp, side = self._cp, self.dequant_stream
        fork = cp.cuda.Event(disable_timing=True)
        fork.record(self.compute_stream)  # earlier readers of the scratch (the last layer's GEMMs) first

        def launch() -> None:
            side.wait_event(fork)
            ptrs, ready = [], []
            with side:
                for half, part in enumerate(parts):
                    ptrs.append(self._dequant(pool, self._upload_slots(part.astype(np.int32)), int(part.size), half))
                    ev = cp.cuda.Event(disable_timing=True)
                    ev.record(side)
                    ready.append(ev)
                self._mark("spec_dequantized", side)
            pos = {int(sl): (half, i) for half, part in enumerate(parts) for i, sl in enumerate(part.tolist())}
            self._spec = {"slots": [p.copy() for p in parts], "ptrs": ptrs, "ready": ready,
                          "waited": [False] * len(parts), "pos": pos}
            self.spec_report["speculated"] = int(sum(p.size for p in parts))

        if self.spec_after_route:
            self._spec_launch = launch
        else:
            launch()
        return True

    def _launch_route(self, logits: Any, t: int) -> tuple[int, int, int, int, int]:
        out = super()._launch_route(logits, t)
        launch, self._spec_launch = self._spec_launch, None
        if launch is not None:  # spec_after_route: the routing kernels are queued ahead of the speculation
            launch()
        return out

    def _spec_forget(self, old: np.ndarray, new: np.ndarray) -> None:
        """on_counts gave experts other slots (admissions): a slot whose expert changed is not used from the
        speculation (its bytes may have been read before, or while, the admission's copy wrote them)."""
        spec = self._spec
        if spec is None:
            return
        moved = old != new
        bad = set(new[moved & (new >= 0)].tolist()) | set(old[moved & (old >= 0)].tolist())
        if not bad:
            return
        spec["slots"] = [np.asarray([s for s in part.tolist() if s not in bad], dtype=np.int64)
                         for part in spec["slots"]]
        for sl in bad:
            spec["pos"].pop(int(sl), None)

    def _spec_wait(self, stream: Any, halves: tuple) -> None:
        """`stream` waits for the speculated dequantization of these halves (once each)."""
        spec = self._spec
        if spec is None:
            return
        for half in halves:
            if half < len(spec["ready"]) and not spec["waited"][half]:
                stream.wait_event(spec["ready"][half])
                spec["waited"][half] = True

    def _spec_ptrs(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The speculated f16 matrices' device pointers of these slots (each in the speculation's map)."""
        spec = self._spec
        at = [spec["pos"][int(sl)] for sl in np.asarray(slots).tolist()]
        p13 = np.array([int(spec["ptrs"][half][0][i]) for half, i in at], dtype=np.int64)
        p2 = np.array([int(spec["ptrs"][half][1][i]) for half, i in at], dtype=np.int64)
        return p13, p2

    # -- decode: route, gate/up GEMV of all K experts, down GEMV with the routing weights ----------------------

    def _check_decode_pool(self, pool: ExpertPool) -> None:
        if pool.dtype != "gguf":
            super()._check_decode_pool(pool)

    def decode_buffers(self) -> dict[str, Any]:
        """FastMoE's decode buffers; quant_decode.cu's kernels are compiled here, before any capture."""
        b = super().decode_buffers()
        if self._qd is None and self.quant_decode_form == 2:
            self._qd = decode_kernels(self._cp)
        return b

    def _decode_two(self, pool: ExpertPool, x: Any = None) -> bool:
        """Whether this decode launch takes quant_decode.cu's kernels (quant_decode_form 2 and decode_kernels_take;
        x, where given, 16-byte aligned for the staging's float4 reads)."""
        blob = pool.arrays["blob"]
        return (self.quant_decode_form == 2 and (x is None or int(x.data.ptr) % 16 == 0)
                and decode_kernels_take(pool.fmt, self.experts, self.top_k, int(blob.data.ptr), int(blob.shape[1])))

    def reads_host_misses(self, pool: ExpertPool, host_ptr: int, host_bytes: int) -> bool:
        """Whether a decode step over this 'gguf' pool can read its missed experts from mapped host rows at
        host_ptr, host_bytes apart (quant_decode.cu's kernels, with the 16-byte alignment their wide loads take)."""
        if pool.dtype != "gguf" or not self._decode_two(pool):
            return False
        return decode_kernels_take(pool.fmt, self.experts, self.top_k, int(host_ptr), int(host_bytes))

    def _qd_launch(self, name: str, grid: tuple, args: tuple) -> None:
        """A quant_decode.cu kernel on the current stream: a programmatic dependent launch when decode_pdl is on."""
        if self._qd is None:
            self._qd = decode_kernels(self._cp)
        kern = self._qd[name]
        if self.decode_pdl:
            if self._pdl is None:
                self._pdl = _launcher(self._cp)
            if self._pdl.available():
                self._pdl.launch(kern, grid, (FAST_THREADS,), args, self._cp.cuda.get_current_stream().ptr)
                return
        kern(grid, (FAST_THREADS,), args)

    def _gate_up(self, x: Any, logits: Any, pool: ExpertPool, slot_map: Any, refill_from: Any, skip_missing: int,
                 host_w13: int = 0, ids_out: Any = None, w_out: Any = None, **third: Any) -> None:
        # third: FastMoE's third-form arguments (land), which 'gguf' pools never take; host_w13: (mapped host
        # address of the layer's expert 0, row bytes) where misses are read from host memory (reads_host_misses)
        if pool.dtype != "gguf":
            return super()._gate_up(x, logits, pool, slot_map, refill_from, skip_missing, host_w13, ids_out, w_out,
                                    **third)
        if refill_from is not None or skip_missing:
            raise NotImplementedError("QuantMoE decode: misses are read from mapped host rows or not at all")
        b = self.decode_buffers()
        ids, w = (b["ids"], b["w"]) if ids_out is None else (ids_out, w_out)
        fmt, blob = pool.fmt, pool.arrays["blob"]
        h, f = self.hidden, self.ffn
        host, host_bytes = host_w13 if host_w13 else (0, 0)
        if self._decode_two(pool, x):
            # routing in every block, the routed slots published in b["slots"] for _down (read in stream order)
            rows = FAST_WARPS * DECODE_PAIRS
            self._qd_launch(f"strata_qd_gate_up_{fmt.gate_up}", ((f + rows - 1) // rows, self.top_k),
                            (x, logits, np.int32(self.experts), np.int32(self.top_k), slot_map,
                             np.int32(blob.shape[0]), np.int32(h), np.int32(f), blob, np.int64(blob.shape[1]),
                             np.int64(fmt.gate_up_row_bytes), np.uint64(host), np.int64(host_bytes), b["act"], ids,
                             w, b["slots"]))
            return
        if host:
            raise NotImplementedError("QuantMoE decode: quant_fast.cu's kernels read cached experts only")
        self._k["strata_fast_route"]((1,), (256,), (logits, np.int32(1), np.int32(self.experts),
                                                   np.int32(self.top_k), ids, w))
        self._qk["strata_qf_gemv_gate_up"](
            ((f + FAST_WARPS - 1) // FAST_WARPS, self.top_k), (FAST_THREADS,),
            (x, np.int64(0), np.uint64(0), ids, slot_map, np.int32(blob.shape[0]), np.int32(h), np.int32(f), blob,
             np.int64(blob.shape[1]), np.int64(fmt.gate_up_row_bytes), np.int32(GGML_TYPES[fmt.gate_up]),
             np.int64(fmt.bias_offset if fmt.bias else -1), np.int32(1), b["act"]))

    def _down(self, pool: ExpertPool, slot_map: Any, only_missing_in: Any, skip_missing: int, out: Any,
              host_w2: int = 0, accumulate: int = 0, ids: Any = None, w: Any = None, **third: Any) -> None:
        if pool.dtype != "gguf":
            return super()._down(pool, slot_map, only_missing_in, skip_missing, out, host_w2, accumulate, ids, w,
                                 **third)
        if only_missing_in is not None or skip_missing:
            raise NotImplementedError("QuantMoE decode: misses are read from mapped host rows or not at all")
        b = self.decode_buffers()
        ids, w = (b["ids"], b["w"]) if ids is None else (ids, w)
        fmt, blob = pool.fmt, pool.arrays["blob"]
        h, f = self.hidden, self.ffn
        host, host_bytes = host_w2 if host_w2 else (0, 0)
        if self._decode_two(pool):
            self._qd_launch(f"strata_qd_down_{fmt.down}", ((h + FAST_WARPS - 1) // FAST_WARPS,),
                            (b["act"], w, b["slots"], np.int32(blob.shape[0]), np.int32(self.top_k), np.int32(h),
                             np.int32(f), blob, np.int64(blob.shape[1]), np.int64(fmt.down_offset),
                             np.int64(fmt.down_row_bytes), np.uint64(host), np.int64(host_bytes),
                             np.int32(accumulate), out))
            return
        if host:
            raise NotImplementedError("QuantMoE decode: quant_fast.cu's kernels read cached experts only")
        name, rows = (("strata_qf_decode_down_wide", DECODE_DOWN_ROWS) if self.decode_down_wide
                      else ("strata_qf_decode_down", FAST_WARPS))
        self._qk[name](
            ((h + rows - 1) // rows,), (FAST_THREADS,),
            (b["act"], ids, w, slot_map, np.int32(blob.shape[0]), np.int32(self.top_k), np.int32(h), np.int32(f),
             blob, np.int64(blob.shape[1]), np.int64(fmt.down_offset), np.int64(fmt.down_row_bytes),
             np.int32(GGML_TYPES[fmt.down]), np.int64(fmt.bias_offset if fmt.bias else -1), np.int32(accumulate),
             out))

    def decode_layer(self, x: Any, logits: Any, pool: ExpertPool, slot_map: Any, out: Any = None,
                     host_pool: ExpertPool | None = None, land: Any = None) -> Any:
        """One token (FastMoE.decode_layer) over a 'gguf' pool: route, gate/up and down GEMVs, replayed as a graph
        per set of buffers; every routed expert must be cached (slot_map [E] int32 on the device)."""
        if pool.dtype != "gguf":
            return super().decode_layer(x, logits, pool, slot_map, out, host_pool, land)
        if host_pool is not None or land is not None:
            raise NotImplementedError("QuantMoE decode: misses are not read from host memory (nor landed)")
        b = self.decode_buffers()  # allocated before any capture: no allocation may happen inside one
        out = b["out"] if out is None else out

        def body() -> None:
            self._gate_up(x, logits, pool, slot_map, None, 0)
            self._down(pool, slot_map, None, 0, out)

        if not self.decode_graphs:
            with self.compute_stream:
                body()
            return out
        key = ("gguf", self.quant_decode_form, x.data.ptr, logits.data.ptr, slot_map.data.ptr,
               pool.arrays["blob"].data.ptr, out.data.ptr)
        graph = self._graphs.get(key)
        if graph is None:
            self._graphs[key] = graph = self._capture(body)
        graph.launch(self.compute_stream)
        return out


def quant_moe_for(cache: dict, work: Any, pinned: Any = None) -> QuantMoE | None:
    """The QuantMoE of a LayerWork over a 'gguf' pool (built once into `cache`, its staging from `pinned`, the
    session's page-locked allocator), or None where it does not apply (several formats in the pool, biases, shapes
    off the fast path): then the composed path runs the layer."""
    pool = work.pool
    if pool is None or pool.dtype != "gguf" or work.router_w is None or "blob" not in pool.arrays:
        return None
    import cupy
    if _is_hip(cupy):
        return None
    try:
        fmt = pool.fmt
    except ValueError:
        return None
    e, k = int(work.router_w.shape[0]), int(work.top_k)
    if not fast_path_takes(fmt) or e > 256 or not 0 < k <= min(16, e):
        return None
    key = ("gguf", e, k, fmt)
    if key not in cache:
        cache[key] = QuantMoE(e, k, fmt, pinned=pinned)
    return cache[key]


def _is_hip(cupy: Any) -> bool:
    """Whether cupy is its ROCm build (quant_fast.cu is CUDA C only)."""
    return bool(getattr(cupy.cuda.runtime, "is_hip", False))


def _host(a: Any) -> np.ndarray:
    """A small index array on the host (cupy arrays are copied down; numpy and lists pass through)."""
    get = getattr(a, "get", None)
    return np.asarray(get() if callable(get) else a)
