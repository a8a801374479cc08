"""Generated models in the K-quant and MXFP4 bytes of real files: a preset at Q4_K, Q4_K_M, Q5_K, Q5_K_M, Q6_K or
MXFP4 is generated as a 'gguf' pool of its own types (a _M mix's down type per layer as llama.cpp picks it), planned
at those bytes, and runs with --check. Backend used: the sim backend (numpy) for the engine run.
"""

from __future__ import annotations

import numpy as np
import pytest

from strata_core.models.presets import model_from_name
from strata_core.models.synthetic import (SKEW_UNIT, generate_weights, generated_expert_formats, model_spec,
                                          popular_half_shares)
from strata_core.reference import quants
from strata_core.reference.kernels import expert_matrices, gguf_expert_parts

L, E, K, H, F = 8, 16, 2, 256, 512


def _weights(quant: str, skew: float = 0.0, layers: int = L, experts: int = E):
    formats, notes = generated_expert_formats(quant, layers, H, F)
    spec = model_spec(f"gen-{quant}", layers, experts, K, H, F, 256, dtype="gguf", formats=formats, quant=quant,
                      source="test")
    return spec, generate_weights(spec, 0, dtype="gguf", popularity_skew=skew, formats=formats), notes


def test_a_q4_k_m_mix_gives_down_q6_k_in_the_layers_llama_cpp_gives_more_bits():
    formats, notes = generated_expert_formats("Q4_K_M", 48, 2048, 768)
    # llama.cpp's use_more_bits for 48 layers: the first and last six, and every third of the rest from layer 8
    more = set(range(6)) | set(range(8, 42, 3)) | set(range(42, 48))
    assert [f.down for f in formats] == ["q6_k" if i in more else "q4_k" for i in range(48)]
    assert {f.gate_up for f in formats} == {"q4_k"} and notes == []
    # the plan of `strata plan --model Qwen3-30B-A3B@Q4_K_M` (the preset's byte math) holds the largest layer
    assert model_from_name("Qwen3-30B-A3B@Q4_K_M").slot_bytes == max(f.nbytes for f in formats) == 3059712


def test_rows_that_are_not_whole_blocks_fall_back_to_a_computed_type_and_say_so():
    formats, notes = generated_expert_formats("Q4_K_M", 26, 2048, 1408)  # DeepSeek-V2-Lite's 1408-wide down rows
    assert {(f.gate_up, f.down) for f in formats} == {("q4_k", "q8_0")}
    assert any("Q5_0, which the kernels do not compute" in n for n in notes), notes
    assert generated_expert_formats("IQ2_XS", 4, 2048, 768) == ((), [])


@pytest.mark.parametrize("quant", ["Q4_K", "Q4_K_M", "Q5_K", "Q5_K_M", "Q6_K", "MXFP4"])
def test_generated_experts_are_their_types_bytes_with_the_generators_law(quant):
    spec, w, _ = _weights(quant)
    pool = w.experts
    assert pool.dtype == "gguf" and len(pool.formats) == L
    assert pool.arrays["blob"].shape == (L * E, spec.slot_bytes) == (L * E, max(f.nbytes for f in pool.formats))
    for layer in (0, L - 1):
        lp = pool.for_layer(layer)
        gu, dn = expert_matrices(lp, layer * E + 3)
        # N(0, 1/fan_in) weights, as the f16 and Q8_0 generators draw them (quantization noise on top)
        assert abs(gu.std() * np.sqrt(H) - 1) < 0.03 and abs(dn.std() * np.sqrt(F) - 1) < 0.03, quant
        other, _ = expert_matrices(lp, layer * E + 4)
        assert not np.array_equal(gu, other), "experts are windows at their own offsets"


def test_the_skew_carrier_is_written_in_the_quantized_rows_and_the_skew_holds_at_depth():
    spec, w, _ = _weights("Q4_K_M", skew=1.0, layers=8, experts=32)
    lp = w.experts.for_layer(5)
    gu_raw, dn_raw, _, _ = gguf_expert_parts(w.experts.arrays["blob"][5 * 32 + 7], lp.fmt)
    assert np.array_equal(gu_raw[F + SKEW_UNIT], gu_raw[SKEW_UNIT]), "the carrier unit's up row is its gate row"
    carrier = quants.dequantize(lp.fmt.down, dn_raw[H - 1:H], F)[0]
    assert carrier[SKEW_UNIT] > 0 and not np.delete(carrier, SKEW_UNIT).any()
    shares = popular_half_shares(w, np.random.default_rng(1).integers(0, 256, 128))
    assert min(shares) > 0.9, [round(s, 3) for s in shares]


def test_a_generated_q4_k_m_model_runs_with_check_on_the_sim_backend():
    from strata_core.api.backend import PinnedBudget
    from strata_core.builtin.sim import SimPinnedAllocator
    from strata_core.builtin.sim.memory import SimDeviceMemory
    from strata_core.reference.kernels import ReferenceKernels
    from strata_core.runtime.check import ReferenceCheck
    from strata_core.runtime.engine import Engine
    from strata_core.runtime.runlog import RunLog
    from tests.runtime.plans import sim_plan
    spec, w, _ = _weights("Q4_K_M", layers=4, experts=16)
    _, plan = sim_plan(spec, {"memory": {"expert_cache": 2 * 16}})  # half the experts: misses stream
    budget = PinnedBudget(plan.pinned.limit_bytes, plan.pinned.floor_bytes)
    check = ReferenceCheck(w)
    eng = Engine(plan, dm=SimDeviceMemory(plan.device.vram_free_bytes), allocator=SimPinnedAllocator(budget, None),
                 kernels=ReferenceKernels(), budget=budget, weights=w, log=RunLog(), observer=check,
                 strict_memory=True)
    assert eng.pool_bytes == plan.vram.expert_cache_bytes == 32 * spec.slot_bytes
    prompt = np.random.default_rng(2).integers(0, w.vocab, 200)
    res = eng.serve(prompt, decode_tokens=3)
    check.check_tokens(int(prompt[-1]), res.tokens)
    eng.close()
    assert check.report.passed, check.report.failures
    assert check.report.layers_checked == 4 * (1 + 3)
    assert eng.executor.stats.bytes_streamed > 0 and eng.executor.stats.bytes_streamed % spec.slot_bytes == 0


def test_strata_run_generates_a_k_quant_preset_in_its_own_bytes_and_says_what_it_does_not_compute(monkeypatch,
                                                                                                   capsys):
    from strata_core.commands import run as run_cmd
    from strata_core.config import LoadedSettings, settings_from_partial
    monkeypatch.setattr(run_cmd, "GENERATE_RAM_FRACTION", 1e9)  # plan the presets here; nothing is generated
    loaded = LoadedSettings(settings_from_partial({}), {})
    spec, _, _ = run_cmd.resolve_run_model("Qwen3-30B-A3B@Q4_K_M", loaded, 0)
    assert spec.quant == "Q4_K_M" and spec.slot_bytes == model_from_name("Qwen3-30B-A3B@Q4_K_M").slot_bytes
    spec, _, _ = run_cmd.resolve_run_model("Qwen3-30B-A3B@Q2_K", loaded, 0)
    assert spec.quant == "Q8_0"
    assert "generated experts: Q8_0 (Q2_K is not computed" in capsys.readouterr().err
