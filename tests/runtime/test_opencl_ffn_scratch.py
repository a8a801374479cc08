"""The opencl/sycl kit's two-pass grouped FFN (work-groups too small for the tiled kernel) keeps its [N, ffn]
intermediate in a buffer the layer ops carve from the plan's workspace: given its outputs and that scratch, the call
allocates no device memory (the kit's ledger peak stays put); the layer ops carve it after the FFN's output, and
the loan sizing's dry replay carves it too. The fake backend of tests/backends/test_opencl_driver.py runs it."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from strata_core.reference.kernels import ExpertPool
from strata_core.runtime.devmem import Arena
from strata_core.runtime.layer_ops import ComposedLayerOps

_spec = importlib.util.spec_from_file_location(
    "opencl_fakes", Path(__file__).resolve().parents[1] / "backends" / "test_opencl_driver.py")
fakes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fakes)

H, F, E = 32, 16, 4


def _kit(tiled: bool):
    k = fakes.FakeKernels(fakes._session(wg=256 if tiled else 64))
    m = k.memory
    pool = ExpertPool("f16", {"w_gate_up": m.to_device(np.ones((E, 2 * F, H), np.float16)),
                              "w_down": m.to_device(np.ones((E, H, F), np.float16))})
    return k, m, pool


def _ops(k, m) -> ComposedLayerOps:
    share = SimpleNamespace(armed_for=lambda tokens: False, rows_capacity=0)
    return ComposedLayerOps(dm=m, kernels=k, store=SimpleNamespace(row_bytes=E * 3 * H * F * 2), share=share,
                            hidden=H, expert_ffn=F, experts_per_layer=E, layers=1)


def test_the_two_pass_ffn_given_out_and_scratch_allocates_nothing_and_uses_the_scratch():
    k, m, pool = _kit(tiled=False)
    assert k.ffn_scratch_shape(5, F) == (5, F)
    region = m.alloc((8192,), np.uint8)
    x = m.view(region, 0, (5, H), np.float32)
    offs, slots = m.view(region, 1024, (3,), np.int32), m.view(region, 1280, (2,), np.int32)
    out, scratch = m.view(region, 1536, (5, H), np.float32), m.view(region, 2560, (5, F), np.float32)
    peak = m.peak_bytes()
    assert k.moe_grouped_ffn(x, offs, slots, pool, out=out, scratch=scratch) is out
    assert m.peak_bytes() == peak, "the two-pass FFN allocated its intermediate outside the given scratch"
    (up, _, _, up_args), (down, _, _, down_args) = k.launches[-2:]
    assert up == "ffn_gate_up_f16" and down == "ffn_down_f16"
    at = [("buf", (5, F)), ("offset", scratch.offset // 4)]
    assert up_args[-2:] == at and down_args[:2] == at, "both passes must use the scratch view"
    # without a scratch the intermediate is allocated, and the ledger's peak sees it (what the plan would miss)
    k.moe_grouped_ffn(x, offs, slots, pool, out=out)
    assert m.peak_bytes() == peak + 5 * F * 4
    with pytest.raises(ValueError):
        k.moe_grouped_ffn(x, offs, slots, pool, out=out, scratch=m.view(region, 2560, (4, F), np.float32))


@pytest.mark.parametrize("tiled", [True, False])
def test_layer_ops_carve_the_scratch_after_the_ffn_output_and_the_dry_replay_does_too(tiled):
    k, m, pool = _kit(tiled)
    ops = _ops(k, m)
    region = m.alloc((16384,), np.uint8)
    ws = Arena(m, [region])
    x = ws.carve((6, H), np.float32)
    offs, slots = ws.carve((3,), np.int32), ws.carve((2,), np.int32)
    used, peak = ws.used[0], m.peak_bytes()
    ops._ffn(SimpleNamespace(workspace=ws, pool=pool), x, offs, slots, 6)
    assert m.peak_bytes() == peak, "the layer ops' grouped FFN allocated device memory outside the workspace"
    carved = ws.used[0] - used
    out_bytes, scratch_bytes = 6 * H * 4, 0 if tiled else 6 * F * 4
    assert out_bytes + scratch_bytes <= carved < out_bytes + scratch_bytes + 2 * 256  # aligned carves
    steps = [s for s in ops.worst_carves(64, 0, 2) if isinstance(s, tuple)]
    n = next(shape[0] for shape, dt in steps if len(shape) == 2 and shape[1] == H and dt == np.float32
             and shape[0] != 64)  # the call's rows: its gather output
    assert (((n, F), np.float32) in steps) is (not tiled), steps


def _dense_ops(k, m, pool, kind: str):
    """DenseFfnLayerOps around a do-nothing inner op, with one dense block (before layer 0) or one shared expert."""
    from strata_core.models.weights import DenseFfn
    from strata_core.runtime.dense_ffn import DenseFfnLayerOps
    f = DenseFfn(kind=kind, layer=0, block=0, pool=pool)
    dense = {f"{f.key}.{n}": a for n, a in pool.arrays.items()}
    dense[f"{f.key}.norm"] = m.to_device(np.ones(H, np.float32))
    inner = SimpleNamespace(hidden=H, decode_step=lambda works: None, prefill_layer=lambda w: None,
                            worst_carves=lambda tokens, vocab, top_k=None: ["fix"])
    return DenseFfnLayerOps(inner, [f], dense, m, k, layers=1), f


@pytest.mark.parametrize("kind", ["dense", "shared"])
@pytest.mark.parametrize("tiled", [True, False])
def test_dense_ffn_blocks_carve_the_two_pass_scratch_from_the_workspace(tiled, kind):
    k, m, pool = _kit(tiled)
    one = ExpertPool("f16", {n: m.to_device(np.asarray(m.download(a))[:1]) for n, a in pool.arrays.items()})
    ops, f = _dense_ops(k, m, one, kind)
    region = m.alloc((16384,), np.uint8)
    ws = Arena(m, [region])
    T = 6
    x = ws.carve((T, H), np.float32)
    ws.fix()
    w = SimpleNamespace(workspace=ws, x=x, tokens=T, layer=0, phase="prefill",
                        norm_w=m.to_device(np.ones(H, np.float32)), extras={})
    peak = m.peak_bytes()
    ops.prefill_layer(w)
    assert m.peak_bytes() == peak, "a dense FFN block allocated device memory outside the workspace"
    ups = [a for name, _, _, a in k.launches if name == "ffn_gate_up_f16"]
    assert len(ups) == (0 if tiled else 1)
    if not tiled:
        assert ups[0][-2][1] == (T, F), "the two-pass FFN's intermediate must be the carved scratch"
    steps = [s for s in ops.worst_carves(T, 0, 2) if isinstance(s, tuple)]
    assert (((T, F), np.float32) in steps) is (not tiled), steps
    # the dry replay (loan sizing) reaches the scratch too: the residual, the norm's and the FFN's outputs, the
    # scratch where the kit needs one
    dry = Arena(None, sizes=[16384])
    assert dry.replay([((T, H), np.float32), "fix"] + ops.worst_carves(T, 0, 2)[1:])
    assert dry.high_water_bytes >= 3 * T * H * 4 + (0 if tiled else T * F * 4)
