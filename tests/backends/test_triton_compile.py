"""triton_moe's kernels compile for the H200 (sm_90) with no GPU here: Triton's front end, its lowering and the
ptxas it carries, for every specialization the product launches (f16 gate|up and down, with pool slots or a group's
order; the fused quant launches for each type the K-loop decode knows). Each must lower its dots to Hopper's
wgmma (the tensor cores the layer's speed needs). Skipped, saying so, where Triton does not import (the cuda
extra installs it)."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton", reason="no Triton (pip install -e '.[cuda]')")

from strata_cuda import triton_moe as tm  # noqa: E402

_F16_SIG, _Q_SIG, _ALIGNED = tm.F16_SIGNATURE, tm.QUANT_SIGNATURE, tm.LAUNCH_ATTRS


def _ptx(fn, sig: dict, consts: dict, opts: dict) -> str:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    try:
        c = triton.compile(ASTSource(fn, sig, consts, _ALIGNED), target=GPUTarget("cuda", 90, 32), options=opts)
    except RuntimeError as e:
        if "ptxas" in str(e) and "not found" in str(e):
            pytest.skip(f"Triton here has no ptxas: {e}")
        raise
    return c.asm["ptx"]


@pytest.fixture(scope="module")
def kernels():
    tm._kernels()
    return tm._STATE["k"], tm._STATE["kq"]


@pytest.mark.parametrize("swiglu", [True, False], ids=["gate_up", "down"])
@pytest.mark.parametrize("slots,q8", [(True, False), (False, False), (True, True)],
                         ids=["pool_slots", "group_order", "q8_0_pool_slots"])
def test_the_f16_launches_compile_to_wgmma(kernels, swiglu, slots, q8):
    cfg = tm.TileConfig(*(tm.DEFAULT_CONFIG if swiglu else tm.DOWN_CONFIG))
    ptx = _ptx(kernels[0], tm.Q8_SIGNATURE if q8 else _F16_SIG,
               {"EP": 128, "SWIGLU": swiglu, "SLOTS": slots, "Q8": q8, "BM": cfg.bm, "BN": cfg.bn, "BK": cfg.bk},
               {"num_warps": cfg.warps, "num_stages": cfg.stages, "enable_fp_fusion": True})
    assert "wgmma.mma_async" in ptx
    # Q8_0: the int8 quants become floats in the K loop; the f16 launch converts no integer weight
    assert ("cvt.rn.f32.s16" in ptx or "cvt.rn.f32.s8" in ptx) == q8


@pytest.mark.parametrize("typ", sorted(tm.QUANT_BLOCK_BYTES))
@pytest.mark.parametrize("swiglu", [True, False], ids=["gate_up", "down"])
def test_the_fused_quant_launches_compile_to_wgmma_without_fma(kernels, typ, swiglu):
    bm, bn, warps, stages = tm.QUANT_GATE_UP_CONFIG if swiglu else tm.QUANT_DOWN_CONFIG
    consts = {"EP": 128, "SWIGLU": swiglu, "FMT": tm._QUANT_TYPE_IDS[typ], "BB": tm.QUANT_BLOCK_BYTES[typ],
              "Q0": tm._QS_OFFSET[typ], "BM": bm, "BN": bn, "BK": tm.QUANT_BK}
    ptx = _ptx(kernels[1], _Q_SIG, consts, {"num_warps": warps, "num_stages": stages, "enable_fp_fusion": False})
    assert "wgmma.mma_async" in ptx
    # the decode's multiply and subtract stay two roundings, as numpy's (an fma would round once)
    if typ in ("q4_k", "q5_k"):
        assert "fma.rn.f32" not in ptx
