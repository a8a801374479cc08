"""Issue 12 item 1 for 'gguf' experts on cuda: QuantMoE's f16 dequantization scratch is bounded in bytes, its size a
backend fact the planner counts in the workspace line (PlatformDefaults.dequant_scratch_bytes), and the carves of a
chunk's worst layer (scratch included) fit the plan's workspace and the loan's planned buffer slots. No GPU: the
carve arithmetic is the product's own (CudaLayerOps.worst_carves over FastMoE.prefill_buffer_bytes, replayed on a
dry Arena as the executor replays it); the kernels' part is tests/quant/test_quant_cuda_host.py (host build) and
tests/gpu/test_quant_cuda.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from strata_core.api.facts import GIB, MIB, DeviceInfo, HostInfo, Profile
from strata_core.config.settings import StrataSettings
from strata_core.models.resolve import model_from_name
from strata_core.planner import plan_for_machine
from strata_core.planner.buffers import dequant_scratch_bytes, f16_expert_bytes
from strata_core.registry import load_plugins
from strata_core.runtime.devmem import Arena

pytest.importorskip("cupy")  # strata_cuda.fast / layer_ops import without a GPU, but need cupy installed

from strata_cuda.backend import plan_pool_dtype  # noqa: E402
from strata_cuda.fast import CLASS_FLOOR_ROWS, FastMoE  # noqa: E402
from strata_cuda.layer_ops import CudaLayerOps  # noqa: E402
from strata_cuda.quant_ffn import SCRATCH_BUDGET_BYTES, scratch_layout  # noqa: E402
from strata_cuda.rules import DEQUANT_SCRATCH_BYTES  # noqa: E402

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
                           gemm_mode="classes", class_floor=CLASS_FLOOR_ROWS)
    fast.stack_rows_bound = lambda t: FastMoE.stack_rows_bound(fast, t)
    fast.prefill_buffer_bytes = lambda t, d, s=0: FastMoE.prefill_buffer_bytes(fast, t, d, s)
    return SimpleNamespace(_fast={shape: fast}, _plan_shape=shape, _plan_dtype=plan_pool_dtype(model),
                           _plan_slot_bytes=model.slot_bytes)


def _fits(plan, chunk: int, workspace_bytes: int, lent: bool = True) -> bool:
    """The executor's replay (Executor.buffer_slots_needed) of a chunk's carves on a dry arena of the workspace and
    the chunk's planned buffer slots as one run (lent=False: the workspace alone, a prompt shorter than
    stream_min_tokens): do they land?"""
    m = plan.model
    slots = plan.loan_model.loan(chunk).buffer_slots if lent else 0
    steps = [((chunk, m.hidden), np.float32)] + CudaLayerOps.worst_carves(_plan_ops(m), chunk, m.vocab, m.top_k)
    return Arena(None, sizes=[workspace_bytes, slots * m.slot_bytes]).replay(steps)


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
    for device, host, name in ((H200, HOST, "Qwen3-30B-A3B@Q4_K"), (RTX4060, HOST32, "Mixtral-8x7B@Q4_K"),
                               (H200, HOST, "Qwen3-30B-A3B@Q4_K_M"), (H200, HOST, "DeepSeek-V2-Lite@Q5_K_M")):
        plan = _plan(device, host, name)
        m = plan.model
        scratch = dequant_scratch_bytes(m, plan.defaults)
        layout = scratch_layout(m.hidden, m.expert_ffn, m.experts_per_layer, plan.defaults.dequant_scratch_bytes)
        assert 0 < scratch == layout.nbytes <= DEQUANT_SCRATCH_BYTES, (name, scratch, layout)
        assert plan.vram.workspace_bytes == plan.prompt.stream_min_tokens * m.prompt_bytes_per_token + scratch
    f16 = _plan(H200, HOST, "Qwen3-30B-A3B@F16")
    assert f16.vram.workspace_bytes == f16.prompt.stream_min_tokens * f16.model.prompt_bytes_per_token


@pytest.mark.parametrize("device,host,name", [(H200, HOST, "Qwen3-30B-A3B@Q4_K"),
                                              (RTX4060, HOST32, "Mixtral-8x7B@Q4_K"),
                                              (H200, HOST, "Qwen3-30B-A3B@Q4_K_M")])
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


def test_the_cuda_layer_ops_take_the_pool_the_model_loads_into():
    """A mix preset (Q4_K_M: generated as a 'gguf' pool) and a BF16 GGUF file (a 'gguf' pool of bf16 rows) warm and
    size 'gguf' layers, with the scratch planned; a BF16 preset (generated f16) an f16 one, without. On an H100
    (2026-12-06, bench/results/s19_h100/call2_) a Qwen3-30B-A3B@Q4_K_M run sized f16 layers: every layer's buffers came from outside the plan and
    the measured peak was 2.37 GB over it."""
    mix = model_from_name("Qwen3-30B-A3B@Q4_K_M")
    assert plan_pool_dtype(mix) == "gguf" and dequant_scratch_bytes(mix, _plan(H200, HOST, mix.name).defaults) > 0
    bf16 = model_from_name("Qwen3-30B-A3B@BF16")
    assert plan_pool_dtype(bf16) == "f16"
    defaults = _plan(H200, HOST, "Qwen3-30B-A3B@Q4_K").defaults
    assert dequant_scratch_bytes(bf16, defaults) == 0
    from dataclasses import replace
    bf16_file = replace(bf16, expert_pool="gguf", source="gguf:/models/x-bf16.gguf")
    assert plan_pool_dtype(bf16_file) == "gguf" and dequant_scratch_bytes(bf16_file, defaults) > 0
    assert plan_pool_dtype(replace(mix, quant="Q8_0", expert_pool="")) == "q8_0"
