"""quant_mma.cu's tensor-core GEMMs over a 'gguf' pool's q4_k / q6_k rows on a real GPU, against float64 of the
same bytes: every pair of types, experts with 0, 1, a partial, a whole and several row tiles, stacks with gaps
between experts (rows outside the experts' must stay untouched), slots scattered over the blob, a launch over a
subset of the experts. Skipped, saying "no CUDA device", where there is none. Run on the H200:
`python -m pytest -q tests/gpu/test_quant_mma.py`."""

from __future__ import annotations

import numpy as np
import pytest

from strata_core.models.gguf import read_moe_tensors, write_moe_gguf
from strata_core.testing import reference64 as r64

pytestmark = [pytest.mark.gpu, pytest.mark.requires_cuda]

#: Per element, |gpu - float64| / (|float64| + 1% of the rows' rms): the outputs are f16 (half an ulp is 2^-11
#: relative) from f32 sums of f16 products; a wrong weight anywhere in a row moves its outputs far more.
ELEMENT_BOUND = 1e-3
#: Rows of each expert (0: an expert no block works for; 127/128/129: a 128-row tile's edges; 300: three such
#: tiles, or a 256-row tile and part of another; 200: a 256-row tile's last warpgroup sub-tile in part; 257: one row
#: past a 256-row tile).
COUNTS = (0, 1, 127, 128, 129, 300, 64, 65, 200, 257)
#: Rows left between one expert's rows and the next in the stacks.
GAP = 3
NAN16 = 0x7E00


def _pool(tmp_path, gate_up: str, down: str, e_n: int, h: int, f: int):
    """A 2-layer qwen3moe file of these types; (layer 1's pool, its experts' slots in a permuted device blob, the
    device pool)."""
    import cupy as cp
    path = write_moe_gguf(tmp_path / "m.gguf", seed=13, layers=2, experts=e_n, hidden=h, ffn=f, gate_up=gate_up,
                          down=down)
    lp = read_moe_tensors(path).experts.for_layer(1)
    blob_h = lp.arrays["blob"]
    perm = np.random.default_rng(5).permutation(blob_h.shape[0])
    slots = np.argsort(perm)[e_n + np.arange(e_n)].astype(np.int32)  # device slot of expert e
    return lp, slots, lp.with_arrays({"blob": cp.asarray(blob_h[perm])})


def _run(gemm, lp, pool, slots, xs_h: np.ndarray, row0: np.ndarray, rows: int, experts=None):
    import cupy as cp
    h, f = lp.fmt.hidden, lp.fmt.ffn
    xs = cp.asarray(xs_h)
    act = cp.full((rows, f), NAN16, cp.uint16).view(cp.float16)
    ys = cp.full((rows, h), NAN16, cp.uint16).view(cp.float16)
    counts_d, row0_d, slots_d = (cp.asarray(np.asarray(v, np.int32)) for v in (COUNTS, row0, slots))
    blob = pool.arrays["blob"]
    gemm.quant_layer(cp.cuda.get_current_stream().ptr, xs.data.ptr, act.data.ptr, ys.data.ptr, blob.data.ptr,
                     int(blob.shape[1]), counts_d.data.ptr, row0_d.data.ptr, slots_d.data.ptr, int(sum(COUNTS)),
                     experts)
    cp.cuda.Device().synchronize()
    return cp.asnumpy(act).astype(np.float64), cp.asnumpy(ys).astype(np.float64)


def _shapes() -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(block rows, input rows) of (gate|up, down) to test: 256 x 128 everywhere; on compute capability 9.0 (the
    sm_90a build) also blocks of 128 weight rows for 128 and for 256 input rows, and a pair of different shapes."""
    try:
        import cupy as cp
        hopper = cp.cuda.Device().compute_capability == "90"
    except Exception:  # no device: the tests skip anyway
        hopper = False
    base = [((256, 256), (128, 128))]
    return base + [((128, 128), (128, 128)), ((128, 128), (256, 256)), ((128, 256), (256, 128))] if hopper else base


@pytest.mark.parametrize("shape", _shapes())
@pytest.mark.parametrize("gate_up,down", [("q4_k", "q6_k"), ("q6_k", "q4_k"), ("q4_k", "q4_k"), ("q6_k", "q6_k")])
def test_both_launches_match_float64_of_the_same_bytes(tmp_path, gate_up, down, shape):
    """gate|up with the SwiGLU against float64 of x and the f16 weights; down against float64 of the kernel's own act
    (so each launch is held alone); rows in the gaps and past the last expert untouched; twice, the same bits."""
    from strata_cuda.quant_mma import QuantMmaGEMM
    e_n, h, f = len(COUNTS), 512, 256
    lp, slots, pool = _pool(tmp_path, gate_up, down, e_n, h, f)
    fmt = lp.fmt
    gemm = QuantMmaGEMM(h, f, e_n, gate_up, down, fmt.gate_up_row_bytes, fmt.down_row_bytes, fmt.down_offset,
                        block_rows=shape[0], input_rows=shape[1])
    row0 = np.concatenate([[0], np.cumsum(np.asarray(COUNTS) + GAP)[:-1]]).astype(np.int32)
    rows = int(row0[-1] + COUNTS[-1] + GAP)
    xs_h = np.random.default_rng(2).standard_normal((rows, h)).astype(np.float16)
    act, ys = _run(gemm, lp, pool, slots, xs_h, row0, rows)
    live = np.zeros(rows, bool)
    for e, (r, n) in enumerate(zip(row0, COUNTS)):
        live[r:r + n] = True
        w13, w2 = r64.f16_expert_matrices(lp, lp.arrays["blob"].shape[0] // 2 + e)  # layer 1: slots E..2E-1
        x = xs_h[r:r + n].astype(np.float64)
        g, u = x @ w13[:f].T, x @ w13[f:].T
        want_act = g / (1.0 + np.exp(-g)) * u
        worst_act = r64.worst_element_error(act[r:r + n], want_act)
        assert worst_act <= ELEMENT_BOUND, ("act", e, worst_act)
        want_y = act[r:r + n] @ w2.T
        worst_y = r64.worst_element_error(ys[r:r + n], want_y)
        assert worst_y <= ELEMENT_BOUND, ("y", e, worst_y)
    assert np.isnan(act[~live]).all() and np.isnan(ys[~live]).all(), "a row outside the experts' was written"
    act2, ys2 = _run(gemm, lp, pool, slots, xs_h, row0, rows)
    assert np.array_equal(act, act2, equal_nan=True) and np.array_equal(ys, ys2, equal_nan=True)


@pytest.mark.parametrize("shape", _shapes())
def test_a_launch_over_a_subset_of_the_experts_writes_only_their_rows(tmp_path, shape):
    """experts=(2, 6): experts 2..5's rows computed (as in the whole launch), every other row untouched."""
    from strata_cuda.quant_mma import QuantMmaGEMM
    e_n, h, f = len(COUNTS), 256, 512
    lp, slots, pool = _pool(tmp_path, "q4_k", "q6_k", e_n, h, f)
    fmt = lp.fmt
    gemm = QuantMmaGEMM(h, f, e_n, "q4_k", "q6_k", fmt.gate_up_row_bytes, fmt.down_row_bytes, fmt.down_offset,
                        block_rows=shape[0], input_rows=shape[1])
    row0 = np.concatenate([[0], np.cumsum(COUNTS)[:-1]]).astype(np.int32)
    rows = int(sum(COUNTS))
    xs_h = np.random.default_rng(4).standard_normal((rows, h)).astype(np.float16)
    act_all, ys_all = _run(gemm, lp, pool, slots, xs_h, row0, rows)
    act, ys = _run(gemm, lp, pool, slots, xs_h, row0, rows, (2, 6))
    inside = np.zeros(rows, bool)
    inside[row0[2]:row0[6]] = True
    assert np.array_equal(act[inside], act_all[inside]) and np.array_equal(ys[inside], ys_all[inside])
    assert np.isnan(act[~inside]).all() and np.isnan(ys[~inside]).all()
