"""QuantMoE's decode over 'gguf' pools on a real GPU (quant_decode.cu, decode form 2: routing fused into gate/up, the
quant blocks decoded against x staged in shared memory; form 1: quant_fast.cu's route + GEMV + wide down), against
the float64 reference of the same bytes: the Qwen3-30B-A3B layer shape in Q4_K/Q6_K, every type the kernels take,
a blob off a 16-byte boundary (q6_k/q8_0 keep form 2, q4_k falls back to form 1), poisoned outputs written again
by the graph's replay, NaN for an unresolved routed miss. Run on the H200: `python -m pytest -q
tests/gpu/test_quant_decode.py`; the host build of the kernels is tests/quant/test_quant_decode_host.py."""

from __future__ import annotations

import numpy as np
import pytest

from strata_core.models.gguf import read_moe_tensors, write_moe_gguf
from strata_core.testing import reference64 as r64

pytestmark = [pytest.mark.gpu, pytest.mark.requires_cuda]

#: exact weights, f32 sums (test_quant_cuda's GEMV_BOUND)
BOUND = 1e-5
#: write_moe_gguf arguments and the layer: gate/up and down in every type quant_decode.cu takes
CASES = {
    "q4_k-q6_k": (dict(arch="qwen3moe", layers=3, gate_up="q4_k", down=["q4_k", "q4_k", "q6_k"]), 2),
    "q4_k-q4_k": (dict(arch="qwen3moe", layers=3, gate_up="q4_k", down=["q4_k", "q4_k", "q6_k"]), 0),
    "q5_k-q6_k": (dict(arch="llama", gate_up="q5_k", down="q6_k"), 1),
    "q6_k-q8_0": (dict(arch="olmoe", gate_up="q6_k", down="q8_0"), 0),
    "q8_0-q5_k": (dict(arch="qwen3moe", gate_up="q8_0", down="q5_k", hidden=512), 1),
}


def _reference(x, logits, pool, slot_map, k):
    ids, w = r64.route_topk(logits, k)
    ys = r64.moe_grouped_ffn(np.repeat(x, k, 0), np.arange(k + 1), slot_map[ids[0]], pool)
    return (w[0][:, None] * ys).sum(0)[None]


def _decode(moe, x, logits, pool, smap):
    """decode_layer twice (capture, then a replay onto a poisoned output): both outputs, host arrays."""
    import cupy as cp
    out = moe.decode_layer(x, logits, pool, smap)
    moe.compute_stream.synchronize()
    first = cp.asnumpy(out)
    out.fill(np.nan)
    cp.cuda.Device().synchronize()
    moe.decode_layer(x, logits, pool, smap)
    moe.compute_stream.synchronize()
    return first, cp.asnumpy(out)


@pytest.mark.parametrize("form", [2, 1])
@pytest.mark.parametrize("pad", [0, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_quant_decode_layer_matches_the_float64_reference(tmp_path, case, pad, form):
    import cupy as cp
    from strata_cuda.quant_ffn import QuantMoE
    kw, layer = CASES[case]
    host = read_moe_tensors(write_moe_gguf(tmp_path / "q.gguf", seed=11, **kw)).experts
    pool_h = host.for_layer(layer)
    blob_h = np.ascontiguousarray(pool_h.arrays["blob"])
    raw = cp.zeros(blob_h.nbytes + 256, cp.uint8)
    dev = raw[pad:pad + blob_h.nbytes].reshape(blob_h.shape)
    dev.set(blob_h)
    pool = pool_h.with_arrays({"blob": dev})
    e_n, k = 8, 3
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, pool.fmt.hidden)).astype(np.float32)
    logits = rng.standard_normal((1, e_n)).astype(np.float32)
    slot_map = (layer * e_n + np.arange(e_n, dtype=np.int32))[::-1].copy()
    moe = QuantMoE(e_n, k, pool.fmt)
    moe.quant_decode_form = form
    xd, ld, smap = cp.asarray(x), cp.asarray(logits), cp.asarray(slot_map)
    cp.cuda.Device().synchronize()
    two = moe._decode_two(pool, xd)
    wide = {pool.fmt.gate_up, pool.fmt.down} & {"q4_k", "q5_k"}
    assert two == (form == 2 and not (pad and wide)), (case, pad, form)
    a, b = _decode(moe, xd, ld, pool, smap)
    err = r64.relative_error(a, _reference(x, logits, pool_h, slot_map, k))
    print(f"{case} pad {pad} form {form} (quant_decode.cu: {two}): rel err {err:.2e} (bound {BOUND:g})")
    assert err <= BOUND and np.array_equal(a, b), err
    if two:
        ids = r64.route_topk(logits, k)[0][0]
        assert np.array_equal(moe.decode_buffers()["ids"].get(), ids)
        assert np.array_equal(moe.decode_buffers()["slots"].get(), slot_map[ids])


def _qwen3_pool(cp, templates: int, experts: int):
    """A Qwen3-30B-A3B layer (hidden 2048, expert FFN 768) of `experts` slots in Q4_K gate/up and Q6_K down, slot e
    holding template e % templates (distinct quantized experts; quantizing 128 in numpy would take minutes)."""
    from strata_core.api.kernels import ExpertFormat, ExpertPool
    from strata_core.reference import quants
    h, f = 2048, 768
    fmt = ExpertFormat("q4_k", "q6_k", h, f)
    rng = np.random.default_rng(3)
    rows = []
    for _ in range(templates):
        gu = quants.quantize("q4_k", rng.standard_normal((2 * f, h), dtype=np.float32) / np.sqrt(h))
        dn = quants.quantize("q6_k", rng.standard_normal((h, f), dtype=np.float32) / np.sqrt(f))
        rows.append(np.concatenate([gu.reshape(-1), dn.reshape(-1)]))
    blob = np.stack([rows[e % templates] for e in range(experts)])
    return fmt, ExpertPool("gguf", {"blob": blob}, (fmt,))


def test_the_qwen3_layer_decodes_through_quant_decode_within_the_bound_and_nan_for_a_miss():
    """128 experts, top 8, hidden 2048, FFN 768 (the bench's layer): decode form 2 is QuantMoE's default there and
    matches float64 within BOUND, for two tokens (two graphs); a routed slot the map leaves at -1 gives NaN."""
    import cupy as cp
    from strata_cuda.quant_ffn import QuantMoE
    fmt, pool_h = _qwen3_pool(cp, 3, 128)
    dev = cp.asarray(pool_h.arrays["blob"])
    pool = pool_h.with_arrays({"blob": dev})
    rng = np.random.default_rng(8)
    perm = rng.permutation(128).astype(np.int32)
    moe = QuantMoE(128, 8, fmt)
    assert moe.quant_decode_form == 2
    smap = cp.asarray(perm)
    for t in range(2):
        x = rng.standard_normal((1, 2048)).astype(np.float32)
        logits = rng.standard_normal((1, 128)).astype(np.float32)
        xd, ld = cp.asarray(x), cp.asarray(logits)
        cp.cuda.Device().synchronize()
        assert moe._decode_two(pool, xd)
        a, b = _decode(moe, xd, ld, pool, smap)
        err = r64.relative_error(a, _reference(x, logits, pool_h, perm, 8))
        print(f"qwen3 layer token {t}: rel err {err:.2e} (bound {BOUND:g})")
        assert err <= BOUND and np.array_equal(a, b), err
    ids = r64.route_topk(logits, 8)[0][0]
    miss = perm.copy()
    miss[ids[5]] = -1
    smap2 = cp.asarray(miss)
    cp.cuda.Device().synchronize()
    out = moe.decode_layer(xd, ld, pool, smap2)
    moe.compute_stream.synchronize()
    assert np.isnan(cp.asnumpy(out)).all()
