"""QuantMoE's choice of fused GEMMs on the host (no GPU): quant_mma's kernels where they take the format; where they
cannot be built (a shape this device's build lacks, a compile error) or lack the block shapes, none (the layer then
takes the scratch path), with the reason kept, instead of an exception on that optional path; Triton's fused
kernels only where asked for (fused_kernel "triton")."""

from __future__ import annotations

import pytest

from strata_core.api.kernels import ExpertFormat
from strata_cuda import quant_ffn, quant_mma, triton_moe


def _moe(block_rows=(256, 256), device_gemm=None, input_rows=(128, 128), kernel="mma"):
    moe = quant_ffn.QuantMoE.__new__(quant_ffn.QuantMoE)  # no device: only what _fused_gemm reads
    moe._fused, moe.fused_kernel, moe.fused_block_rows = {}, kernel, block_rows
    moe.fused_input_rows = input_rows
    moe.experts, moe.device_gemm, moe.fused_error = 128, device_gemm, None
    return moe


FMT = ExpertFormat(gate_up="q4_k", down="q6_k", hidden=2048, ffn=768)


def test_quant_mma_is_taken_where_it_builds(monkeypatch):
    built = []
    monkeypatch.setattr(quant_mma, "QuantMmaGEMM",
                        lambda *a, **k: built.append((k["block_rows"], k["input_rows"])) or "mma")
    moe = _moe((128, 256), input_rows=(256, 128))
    assert moe._fused_gemm(FMT) == "mma" and built == [((128, 256), (256, 128))] and moe.fused_error is None
    assert moe._fused_gemm(FMT) == "mma" and len(built) == 1  # built once


@pytest.mark.parametrize("error", [ValueError("quant_mma: blocks of 128 weight rows need the sm_90a build"),
                                   RuntimeError("NVRTC failed on quant_mma.cu")])
def test_a_build_that_fails_falls_back_and_keeps_the_reason(monkeypatch, error):
    def fail(*a, **k):
        raise error
    monkeypatch.setattr(quant_mma, "QuantMmaGEMM", fail)
    monkeypatch.setattr(triton_moe, "DeviceQuantGEMM", lambda *a: "triton")
    moe = _moe(device_gemm=object())
    assert moe._fused_gemm(FMT) is None  # not Triton's fused kernels (slower than the scratch path): none
    assert moe.fused_error.startswith(type(error).__name__) and str(error) in moe.fused_error


def test_block_shapes_quant_mma_lacks_fall_back_and_say_so(monkeypatch):
    monkeypatch.setattr(quant_mma, "QuantMmaGEMM", lambda *a, **k: "mma")
    monkeypatch.setattr(triton_moe, "DeviceQuantGEMM", lambda *a: "triton")
    moe = _moe((256, 256), device_gemm=object(), input_rows=(256, 256))  # 256 x 256: no such block
    assert moe._fused_gemm(FMT) is None
    assert "no blocks of (256, 256) input x (256, 256) weight rows" in moe.fused_error
    q5 = ExpertFormat(gate_up="q5_k", down="q6_k", hidden=2048, ffn=768)  # not quant_mma's: none, and no reason
    moe = _moe(device_gemm=object())
    assert moe._fused_gemm(q5) is None and moe.fused_error is None


def test_tritons_fused_kernels_only_where_asked_for(monkeypatch):
    monkeypatch.setattr(quant_mma, "QuantMmaGEMM", lambda *a, **k: "mma")
    monkeypatch.setattr(triton_moe, "DeviceQuantGEMM", lambda *a: "triton")
    q5 = ExpertFormat(gate_up="q5_k", down="q6_k", hidden=2048, ffn=768)
    assert _moe(device_gemm=object(), kernel="triton")._fused_gemm(q5) == "triton"
    assert _moe(device_gemm=object(), kernel="triton")._fused_gemm(FMT) == "triton"
    assert _moe(device_gemm=None, kernel="triton")._fused_gemm(q5) is None  # no Triton on this device
