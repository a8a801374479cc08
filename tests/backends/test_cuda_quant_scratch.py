"""Issue 12 item 1 for 'gguf' experts on cuda: QuantMoE's f16 dequantization scratch is bounded in bytes, its size a
backend fact the planner counts in the workspace line (PlatformDefaults.dequant_scratch_bytes), and the carves of a
chunk's worst layer (scratch included) fit the plan's workspace and the loan's planned buffer slots. No GPU: the
carve arithmetic is the product's own (CudaLayerOps.worst_carves over FastMoE.prefill_buffer_bytes, replayed on a
dry Arena as the executor replays it); the kernels' part is the host build below and tests/gpu/test_quant_cuda.py.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from strata_core.api.facts import GIB, MIB, DeviceInfo, HostInfo, Profile
from strata_core.config.settings import StrataSettings
from strata_core.models.resolve import model_from_name
from strata_core.planner import plan_for_machine
from strata_core.planner.buffers import dequant_scratch_bytes, f16_expert_bytes
from strata_core.reference.quants import GGML_TYPES
from strata_core.registry import load_plugins
from strata_core.runtime.devmem import Arena, DeviceFull

pytest.importorskip("cupy")  # strata_cuda.fast / layer_ops import without a GPU, but need cupy installed

from strata_cuda.fast import FastMoE  # noqa: E402
from strata_cuda.layer_ops import CudaLayerOps  # noqa: E402
from strata_cuda.quant_ffn import SCRATCH_BUDGET_BYTES, scratch_layout  # noqa: E402
from strata_cuda.rules import DEQUANT_SCRATCH_BYTES  # noqa: E402

CUDA_DIR = Path(__file__).resolve().parents[2] / "backends" / "cuda" / "strata_cuda"
H200 = DeviceInfo(backend="cuda", name="NVIDIA H200", vram_total_bytes=141 * GIB, vram_free_bytes=139 * GIB,
                  drives_display=False)
RTX4060 = DeviceInfo(backend="cuda", name="RTX 4060 8 GB", vram_total_bytes=8 * GIB, vram_free_bytes=7800 * MIB)
HOST = HostInfo(os="linux", ram_total_bytes=256 * GIB, ram_available_bytes=240 * GIB)
HOST32 = HostInfo(os="linux", ram_total_bytes=32 * GIB, ram_available_bytes=28 * GIB)


def _plan(device, host, name):
    plugins = load_plugins()
    settings = StrataSettings()
    target = plugins.resolve_target(settings, profile=Profile(backend="cuda", device=device, host=host))
    return plan_for_machine(plugins, target, model_from_name(name), settings)


def _plan_ops(model):
    """A CudaLayerOps as cuda_layer_ops builds it for the plan's model (no cupy call: only what worst_carves reads)."""
    shape = (model.experts_per_layer, model.top_k, model.hidden, model.expert_ffn)
    fast = SimpleNamespace(experts=shape[0], top_k=shape[1], hidden=shape[2], ffn=shape[3], group_experts=8,
                           gemm_mode="classes")
    fast.stack_rows_bound = lambda t: FastMoE.stack_rows_bound(fast, t)
    fast.prefill_buffer_bytes = lambda t, d, s=0: FastMoE.prefill_buffer_bytes(fast, t, d, s)
    return SimpleNamespace(_fast={shape: fast}, _plan_shape=shape, _plan_dtype="gguf",
                           _plan_slot_bytes=model.slot_bytes)


def _fits(plan, chunk: int, workspace_bytes: int, lent: bool = True) -> bool:
    """The executor's replay (Executor.buffer_slots_needed) of a chunk's carves on a dry arena of the workspace and
    the chunk's planned buffer slots as one run (lent=False: the workspace alone, a prompt shorter than
    stream_min_tokens): do they land?"""
    m = plan.model
    slots = plan.loan_model.loan(chunk).buffer_slots if lent else 0
    steps = [((chunk, m.hidden), np.float32)] + CudaLayerOps.worst_carves(_plan_ops(m), chunk, m.vocab, m.top_k)
    arena = Arena(None, sizes=[workspace_bytes, slots * m.slot_bytes])
    try:
        for step in steps:
            if step == "fix":
                arena.fix()
            elif step == "reset":
                arena.reset()
            else:
                arena.carve(*step)
    except DeviceFull:
        return False
    return True


def test_the_scratch_layout_is_bounded_in_bytes_whole_experts_or_pieces():
    qwen = scratch_layout(2048, 768, 128, 256 * MIB)
    assert qwen.group_experts == 256 * MIB // 2 // f16_expert_bytes(2048, 768) == 14
    assert qwen.nbytes == 2 * 14 * f16_expert_bytes(2048, 768) <= 256 * MIB
    # Mixtral 8x7B: one expert is 352 MB in f16; its gate|up (235 MB) and then its down (117 MB) in one buffer
    mix = scratch_layout(4096, 14336, 8, 256 * MIB)
    assert f16_expert_bytes(4096, 14336) > 256 * MIB // 2 and mix.group_experts == 0
    assert (mix.gate_up_rows, mix.down_cols) == (14336, 14336) and mix.nbytes <= 256 * MIB
    small = scratch_layout(4096, 14336, 8, 64 * MIB)  # pieces: 4096 gate rows + 4096 up rows, K blocks of 8192
    assert (small.gate_up_rows, small.down_cols) == (4096, 8192) and small.nbytes == 64 * MIB
    assert scratch_layout(2048, 768, 4, 256 * MIB).group_experts == 4  # never more than the layer has
    with pytest.raises(ValueError, match="cannot hold a piece"):
        scratch_layout(4096, 14336, 8, 256 << 10)  # 16 rows of gate and up: less than a 32-row piece


def test_the_planner_counts_the_cuda_scratch_in_the_workspace_line():
    assert SCRATCH_BUDGET_BYTES == DEQUANT_SCRATCH_BYTES  # QuantMoE's own budget is the plan's
    for device, host, name in ((H200, HOST, "Qwen3-30B-A3B@Q4_K"), (RTX4060, HOST32, "Mixtral-8x7B@Q4_K")):
        plan = _plan(device, host, name)
        m = plan.model
        scratch = dequant_scratch_bytes(m, plan.defaults)
        layout = scratch_layout(m.hidden, m.expert_ffn, m.experts_per_layer, plan.defaults.dequant_scratch_bytes)
        assert scratch == layout.nbytes <= DEQUANT_SCRATCH_BYTES, (name, scratch, layout)
        assert plan.vram.workspace_bytes == plan.prompt.stream_min_tokens * m.prompt_bytes_per_token + scratch
    f16 = _plan(H200, HOST, "Qwen3-30B-A3B@F16")
    assert f16.vram.workspace_bytes == f16.prompt.stream_min_tokens * f16.model.prompt_bytes_per_token


@pytest.mark.parametrize("device,host,name", [(H200, HOST, "Qwen3-30B-A3B@Q4_K"),
                                              (RTX4060, HOST32, "Mixtral-8x7B@Q4_K")])
def test_the_worst_layer_carves_with_its_scratch_fit_the_planned_workspace_and_loan(device, host, name):
    """Every planned chunk's carves, the dequantization scratch among them (worst_carves), land in the plan's
    workspace and that chunk's planned buffer slots, and a prompt just shorter than stream_min_tokens in the
    workspace alone; on a workspace without the scratch line some do not."""
    plan = _plan(device, host, name)
    chunks = [r.chunk for r in plan.prompt.loans]
    assert not plan.prompt.owned_buffers and plan.prompt.chunk in chunks
    m = plan.model
    scratch = ((scratch_layout(m.hidden, m.expert_ffn, m.experts_per_layer, SCRATCH_BUDGET_BYTES).nbytes,), np.uint8)
    assert scratch in CudaLayerOps.worst_carves(_plan_ops(m), chunks[0], m.vocab), "the scratch is no carve"
    owned = plan.prompt.stream_min_tokens - 1
    assert all(_fits(plan, c, plan.vram.workspace_bytes) for c in chunks)
    assert _fits(plan, owned, plan.vram.workspace_bytes, lent=False)
    short = plan.vram.workspace_bytes - dequant_scratch_bytes(plan.model, plan.defaults)
    assert not (all(_fits(plan, c, short) for c in chunks) and _fits(plan, owned, short, lent=False))


# --------------------------------------------------------------------------------------------------------------
# quant_fast.cu's kernels of this change on the host (g++, a thread per GPU thread, one block at a time, block and
# warp barriers): the piece dequantization bit for bit against the oracle's f16, and the wide decode down kernel
# against float64.
# --------------------------------------------------------------------------------------------------------------

SHIM = r"""
#define QF_HOST 1
#define QF_HOST_SYNCTHREADS 1
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>
using std::min;
struct qt_dim3 { unsigned int x = 1, y = 1, z = 1; };
struct uint4 { unsigned int x, y, z, w; };
struct float4 { float x, y, z, w; };
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }
static thread_local qt_dim3 threadIdx, blockIdx;
static qt_dim3 blockDim, gridDim;
static std::barrier<>* qf_warp_bar[8];
static std::barrier<>* qf_block_bar;
static float qf_xchg[256];
static inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
static inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
static inline void __syncwarp() { qf_warp_bar[threadIdx.x / 32]->arrive_and_wait(); }
static inline void __syncthreads() { qf_block_bar->arrive_and_wait(); }
static inline float __shfl_xor_sync(unsigned, float v, int m) {
    const unsigned t = threadIdx.x;
    qf_xchg[t] = v;
    qf_warp_bar[t / 32]->arrive_and_wait();
    const float r = qf_xchg[(t & ~31u) | ((t & 31u) ^ (unsigned)m)];
    qf_warp_bar[t / 32]->arrive_and_wait();
    return r;
}
static inline float qf_host_warp_sum(float v) {
    const unsigned t = threadIdx.x, w0 = t & ~31u;
    qf_xchg[t] = v;
    qf_warp_bar[t / 32]->arrive_and_wait();
    float s = 0.0f;
    for (unsigned l = 0; l < 32; ++l) s += qf_xchg[w0 + l];
    qf_warp_bar[t / 32]->arrive_and_wait();
    return s;
}
#define __device__
#define __global__
#define __forceinline__ inline
#define __shared__ static
#define __restrict__
#define __launch_bounds__(n)
static void qf_launch(unsigned gx, unsigned gy, const std::function<void()>& body) {
    blockDim.x = 256; gridDim.x = gx; gridDim.y = gy;
    for (unsigned by = 0; by < gy; ++by)
        for (unsigned bx = 0; bx < gx; ++bx) {
            for (int w = 0; w < 8; ++w) qf_warp_bar[w] = new std::barrier<>(32);
            qf_block_bar = new std::barrier<>(256);
            std::vector<std::thread> ts;
            for (unsigned t = 0; t < 256; ++t)
                ts.emplace_back([&, t] { threadIdx.x = t; blockIdx.x = bx; blockIdx.y = by; body(); });
            for (auto& th : ts) th.join();
            for (int w = 0; w < 8; ++w) delete qf_warp_bar[w];
            delete qf_block_bar;
        }
}
"""

WRAPPERS = r"""
extern "C" {
void host_dequant_part(unsigned gx, const unsigned char* blob, long long sb, const int* slots, int m, long long off,
                       long long rb, int rows, int r0, int c0, int ccols, int fmt, unsigned short* out) {
    qf_launch(gx, m, [&] { strata_qf_dequant_f16_part(blob, sb, slots, m, off, rb, rows, r0, c0, ccols, fmt, out); });
}
void host_decode_down_wide(unsigned gx, const float* act, const int* ids, const float* w, const int* slot_map, int S,
                           int K, int H, int F, const unsigned char* blob, long long sb, long long doff, long long rb,
                           int fmt, long long bias, int acc, float* out) {
    qf_launch(gx, 1, [&] { strata_qf_decode_down_wide(act, ids, w, slot_map, S, K, H, F, blob, sb, doff, rb, fmt,
                                                      bias, acc, out); });
}
}
"""


def _p(a):
    return ctypes.c_void_p(a.ctypes.data)


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    """quant_fast.cu built for the host with a block barrier (skipped only without a C++20 g++)."""
    if shutil.which("g++") is None:
        pytest.skip("no g++ on this machine: the host build of quant_fast.cu needs a C++20 compiler")
    tmp = tmp_path_factory.mktemp("qf_scratch")
    src = tmp / "qf.cpp"
    src.write_text(SHIM + (CUDA_DIR / "quant_fast.cu").read_text() + WRAPPERS)
    done = subprocess.run(["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-w", f"-I{CUDA_DIR}",
                           str(src), "-o", str(tmp / "qf.so")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return ctypes.CDLL(str(tmp / "qf.so"))


@pytest.mark.parametrize("pad", [0, 3, 2], ids=["aligned", "odd", "even"])
@pytest.mark.parametrize("fmt", ["q4_k", "q6_k", "q5_k", "mxfp4"])
def test_the_piece_dequantization_is_the_f16_of_the_oracle_bit_for_bit(lib, fmt, pad):
    """strata_qf_dequant_f16_part's rows r0.. and chunks c0.. (a gate/up piece's rows, a down piece's K block) are
    numpy's float16 of quants.dequantize of the same weights, bit for bit, with slots 0, 2 and 3 bytes off a
    16-byte boundary (the funnel-shifted 4-byte loads of qf_load32 at both odd and even offsets)."""
    from strata_core.reference import quants
    rng = np.random.default_rng(11)
    rows, cols, m = 7, 768, 2
    w = rng.standard_normal((m, rows, cols)).astype(np.float32) * np.float32(0.05)
    raw = quants.quantize(fmt, w)
    rb = raw.shape[-1]
    sb = rows * rb + pad + 10
    blob = np.zeros(pad + m * sb + 64, np.uint8)[pad:][:m * sb].reshape(m, sb)
    blob[:, pad:pad + rows * rb] = raw.reshape(m, -1)
    slots = np.array([1, 0], np.int32)
    full = quants.dequantize(fmt, raw[slots], cols).astype(np.float16).view(np.uint16)
    r0, nrows, c0, ccols = 2, 4, 9, 11  # chunks 9..19: across a 256-weight super-block boundary
    out = np.full((m, nrows, 32 * ccols), 0x7e00, np.uint16)
    ll, i32 = ctypes.c_longlong, ctypes.c_int
    lib.host_dequant_part(ctypes.c_uint(1), _p(blob), ll(sb), _p(slots), i32(m), ll(pad), ll(rb), i32(nrows),
                          i32(r0), i32(c0), i32(ccols), i32(GGML_TYPES[fmt]), _p(out))
    want = full[:, r0:r0 + nrows, 32 * c0:32 * (c0 + ccols)]
    mism = int(np.count_nonzero(out != want))
    assert mism == 0, f"{fmt}: {mism} of {out.size} f16 weights differ"


def test_the_wide_decode_down_kernel_matches_the_float64_reference(lib, tmp_path):
    """strata_qf_decode_down_wide (QF_DW warps a row) over K routed experts of a Q4_K_M file: out += sum_k w_k
    (act_k . Wd_k), f32 sums of exact weights within 1e-6 of float64; an expert outside the pool gives NaN."""
    from strata_core.models.gguf import q4_k_m_down_types, read_moe_tensors, write_moe_gguf
    from strata_cuda.quant_ffn import DECODE_DOWN_ROWS
    path = write_moe_gguf(tmp_path / "q.gguf", seed=3, arch="qwen3moe", layers=3, gate_up="q4_k",
                          down=q4_k_m_down_types(3))
    pool = read_moe_tensors(path).experts.for_layer(2)
    fmt = pool.fmt
    assert fmt.down == "q6_k"
    blob = np.ascontiguousarray(pool.arrays["blob"])
    h, f, k = fmt.hidden, fmt.ffn, 3
    rng = np.random.default_rng(4)
    act = rng.standard_normal((k, f)).astype(np.float32)
    slot_map = (16 + np.arange(8, dtype=np.int32))[::-1].copy()
    ids = np.array([6, 1, 3], np.int32)
    wts = np.array([0.5, 0.3, 0.2], np.float32)
    out0 = rng.standard_normal((1, h)).astype(np.float32)
    out = out0.copy()
    ll, i32, u = ctypes.c_longlong, ctypes.c_int, ctypes.c_uint

    def run(smap):
        lib.host_decode_down_wide(u(-(-h // DECODE_DOWN_ROWS)), _p(act), _p(ids), _p(wts), _p(smap),
                                  i32(blob.shape[0]), i32(k), i32(h), i32(f), _p(blob), ll(blob.shape[1]),
                                  ll(fmt.down_offset), ll(fmt.down_row_bytes), i32(GGML_TYPES[fmt.down]), ll(-1),
                                  i32(1), _p(out))

    run(slot_map)
    from strata_core.reference import quants
    want = out0.astype(np.float64)
    for j in range(k):
        row = blob[slot_map[ids[j]], fmt.down_offset:fmt.down_offset + h * fmt.down_row_bytes]
        wd = quants.dequantize("q6_k", row.reshape(h, fmt.down_row_bytes), f).astype(np.float64)
        want = want + float(wts[j]) * (wd @ act[j].astype(np.float64))
    err = float(np.linalg.norm(out - want) / np.linalg.norm(want - out0))
    assert err <= 1e-6, err
    bad = slot_map.copy()
    bad[3] = 10_000
    run(bad)
    assert np.isnan(out).all()
