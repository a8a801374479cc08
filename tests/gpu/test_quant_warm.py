"""QuantMoE's warm prefill on a real GPU (issue 14 item 5): the device-table paths (scratch groups behind the Triton
launches, and the decode inside the GEMMs), the super-block dequantization kernel, the speculated
dequantization of the first cached experts before the routing is known, and the ways hit_groups groups the rest,
each against the float64 reference of the same bytes; a speculated slot an admission rewrites is not used from the
speculation. Skipped, saying "no CUDA device", where there is none. Run on the H200:
`python -m pytest -q tests/gpu/test_quant_warm.py`."""

from __future__ import annotations

import numpy as np
import pytest

from strata_core.models.gguf import q4_k_m_down_types, read_moe_tensors, write_moe_gguf
from strata_core.testing import reference64 as r64

pytestmark = [pytest.mark.gpu, pytest.mark.requires_cuda]

#: f16 weights, activations and intermediates (the fast path's bound, tests/gpu/test_quant_cuda.py's F16_BOUND)
F16_BOUND = 1e-3

#: QuantMoE attributes of each variant the bench times (bench/q2_diag_h200.py), the product's default ({}: the
#: host-synced path, quant_ffn.WARM_DEVICE off) first, then the device-table path (where Triton is there, its first
#: two groups dequantized before the routing: WARM_DEVICE_AHEAD) at each side-stream priority and without the groups
#: ahead; the rest are the host-synced path's variants, warm_device off whatever the default
_HOST = dict(warm_device=False)
CONFIGS = {
    "default": {},
    "device": dict(warm_device=True),
    "device-high-priority": dict(warm_device=True, dequant_priority="high"),
    "fused": dict(warm_device=True, warm_fused=True),
    "chunk-kernel-halves": dict(_HOST, dequant_kernel="chunk", warm_spec_halves=0, warm_rest_whole=False),
    "sb-kernel-whole": dict(_HOST, dequant_kernel="sb", warm_spec_halves=0),
    "sbt-kernel-whole": dict(_HOST, dequant_kernel="sbt", warm_spec_halves=0),
    "sbt-device": dict(warm_device=True, dequant_kernel="sbt"),
    "sbt-device-no-ahead": dict(warm_device=True, dequant_kernel="sbt", warm_device_ahead=False),
    "sb-no-spec-halves": dict(_HOST, dequant_kernel="sb", warm_spec_halves=0, warm_rest_whole=False),
    "spec1-halves": dict(_HOST, dequant_kernel="sb", warm_spec_halves=1, warm_rest_whole=False),
    "spec2-split-halves": dict(_HOST, dequant_kernel="sb", warm_spec_halves=2, warm_merge_spec=False,
                               warm_rest_whole=False),
    "spec2-merged-whole": dict(_HOST, dequant_kernel="sb", warm_spec_halves=2),
    "spec2-merged-whole-after-route": dict(_HOST, dequant_kernel="sb", warm_spec_halves=2, spec_after_route=True),
}


def _layer(tmp_path, experts: int, seed: int = 5, down: str | None = None):
    """A qwen3moe Q4_K_M-style layer of `experts` experts (hidden and ffn 256: whole super-blocks) on the device, with
    8 spare slots; (layer pool, device pool, host blob of the layer's experts). `down`: every layer's down type
    (default Q4_K_M's, which differ between layers)."""
    import cupy as cp
    path = write_moe_gguf(tmp_path / "q.gguf", seed=seed, arch="qwen3moe", layers=3, experts=experts,
                          gate_up="q4_k", down=down or q4_k_m_down_types(3))
    lp = read_moe_tensors(path).experts.for_layer(2)
    blob_h = lp.arrays["blob"]
    dev_blob = cp.full((blob_h.shape[0] + 8, blob_h.shape[1]), 255, cp.uint8)
    dev_blob[:blob_h.shape[0]] = cp.asarray(blob_h)
    return lp, lp.with_arrays({"blob": dev_blob}), blob_h[2 * experts:3 * experts]


@pytest.mark.parametrize("config", list(CONFIGS))
def test_warm_prefill_variants_match_the_float64_reference(tmp_path, config):
    """Every variant, twice in a row (the second call's speculation waits for the first's GEMMs), 16 experts in
    scratch halves of 3 (spec covers 6, the rest in several groups), experts 1 and 7 left out by the routing (the
    speculated runs skip them)."""
    import cupy as cp
    from strata_cuda.quant_ffn import QuantMoE, scratch_bytes
    e_n, k, t = 16, 2, 400
    lp, pool, _ = _layer(tmp_path, e_n)
    h = lp.fmt.hidden
    rng = np.random.default_rng(7)
    x = rng.standard_normal((t, h)).astype(np.float32)
    logits = rng.standard_normal((t, e_n)).astype(np.float32)
    logits[:, [1, 7]] -= 40.0
    assert r64.topk_margin(logits, k) > 1e-5
    slot_of = 2 * e_n + np.arange(e_n)
    want = r64.moe_layer(x, logits, lp, slot_of, k)
    moe = QuantMoE(e_n, k, lp.fmt, group_experts=3, scratch_budget_bytes=scratch_bytes(h, lp.fmt.ffn, 3))
    for name, v in CONFIGS[config].items():
        if name == "dequant_priority":
            moe.set_dequant_priority(v)
        else:
            setattr(moe, name, v)
    xd, ld = cp.asarray(x), cp.asarray(logits)
    cp.cuda.Device().synchronize()
    errs = []
    for _ in range(2):
        out = cp.full((t, h), np.nan, cp.float32)  # poisoned: every row must be written
        cp.cuda.Device().synchronize()
        moe.prefill_layer(xd, ld, pool, slot_of, out=out)
        moe.compute_stream.synchronize()
        errs.append(r64.relative_error(cp.asnumpy(out), want))
    spec = moe.warm_spec_halves
    print(f"{config}: rel err {errs} (bound {F16_BOUND:g}); speculation {moe.spec_report}")
    assert max(errs) <= F16_BOUND, errs
    # the device configs take the device-table path wherever FastMoE has one (Triton there), the others never
    from strata_cuda.quant_ffn import WARM_DEVICE
    wants = moe.warm_device and moe.device_gemm is not None
    assert moe.warm_device == CONFIGS[config].get("warm_device", WARM_DEVICE)
    assert moe.stats.device_table == wants, config
    # halves of 3: 3 * halves experts speculated, of which experts 1 (and 7 past the halves) are left out
    assert moe.spec_report["speculated"] == 3 * spec
    assert moe.spec_report["used"] == {0: 0, 1: 2, 2: 5}[spec]


def test_warm_layers_queued_back_to_back_keep_their_own_scratch(tmp_path):
    """Five warm layers on the device-table path queued with no sync between them (each its own input and
    routing, two layers' experts in the pool): a layer's dequantization into a scratch half must wait for the
    GEMMs of the layer before that read the half, so each output is its own layer's float64 reference."""
    import cupy as cp
    from strata_cuda.quant_ffn import QuantMoE, scratch_bytes
    e_n, k, t = 16, 2, 300
    lp, pool, _ = _layer(tmp_path, e_n, down="q6_k")  # one format in every layer: layers 1 and 2 share the pool
    h = lp.fmt.hidden
    moe = QuantMoE(e_n, k, lp.fmt, group_experts=5, scratch_budget_bytes=scratch_bytes(h, lp.fmt.ffn, 5))
    moe.warm_device = True
    if moe.device_gemm is None:
        pytest.skip("no device-table path here (Triton or torch missing)")
    rng = np.random.default_rng(23)
    runs = []
    for i in range(5):
        x = rng.standard_normal((t, h)).astype(np.float32)
        logits = rng.standard_normal((t, e_n)).astype(np.float32)
        slot_of = (e_n if i % 2 else 2 * e_n) + np.arange(e_n)  # layers 1 and 2 of the file, in turn
        out = cp.full((t, h), np.nan, cp.float32)
        cp.cuda.Device().synchronize()  # the inputs (null stream) land before the layers queue
        runs.append((x, logits, slot_of, out))
    for x, logits, slot_of, out in runs:
        moe.prefill_layer(cp.asarray(x), cp.asarray(logits), pool, slot_of, out=out)
        assert moe.stats.device_table
    moe.compute_stream.synchronize()
    for i, (x, logits, slot_of, out) in enumerate(runs):
        err = r64.relative_error(cp.asnumpy(out), r64.moe_layer(x, logits, lp, slot_of, k))
        assert err <= F16_BOUND, (i, err)


#: a kernel of one thread that spins for `cycles` SM clocks: holds a stream back while later work queues behind it
SPIN_SOURCE = r"""
extern "C" __global__ void strata_test_spin(long long cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
}
"""


def test_groups_ahead_wait_for_the_last_layers_readers_of_the_scratch(tmp_path):
    """The first groups a warm layer dequantizes before its routing (WARM_DEVICE_AHEAD) go into the scratch halves
    the layer before reads: with the compute stream held back by a spinning kernel while two layers of different
    experts queue, the second layer's groups ahead must still wait for the first layer's GEMMs (a side stream that
    did not wait would overwrite the halves during the spin, and the first layer would compute with the second's
    weights)."""
    import cupy as cp
    from strata_cuda.quant_ffn import QuantMoE, scratch_bytes
    e_n, k, t = 16, 2, 300
    lp, pool, _ = _layer(tmp_path, e_n, down="q6_k")
    h = lp.fmt.hidden
    moe = QuantMoE(e_n, k, lp.fmt, group_experts=4, scratch_budget_bytes=scratch_bytes(h, lp.fmt.ffn, 4))
    moe.warm_device, moe.warm_device_ahead = True, True
    if moe.device_gemm is None:
        pytest.skip("no device-table path here (Triton or torch missing)")
    rng = np.random.default_rng(29)
    runs = []
    for slot_of in (2 * e_n + np.arange(e_n), e_n + np.arange(e_n)):  # layers 2 and 1 of the file
        x = rng.standard_normal((t, h)).astype(np.float32)
        logits = rng.standard_normal((t, e_n)).astype(np.float32)
        runs.append((x, logits, slot_of, cp.asarray(x), cp.asarray(logits), cp.full((t, h), np.nan, cp.float32)))
    cp.cuda.Device().synchronize()
    spin = cp.RawKernel(SPIN_SOURCE, "strata_test_spin")
    spin((1,), (1,), (np.int64(50_000_000),), stream=moe.compute_stream)  # ~25 ms at the H200's clock
    for _, _, slot_of, xd, ld, out in runs:
        moe.prefill_layer(xd, ld, pool, slot_of, out=out)
        assert moe.stats.device_table
    moe.compute_stream.synchronize()
    for i, (x, logits, slot_of, _, _, out) in enumerate(runs):
        err = r64.relative_error(cp.asnumpy(out), r64.moe_layer(x, logits, lp, slot_of, k))
        assert err <= F16_BOUND, (i, err)


@pytest.mark.parametrize("gate_up,down", [("q4_k", "q6_k"), ("q4_k", "q4_k"), ("q5_k", "q5_k"), ("q8_0", "q6_k"),
                                          ("q6_k", "q8_0")])
@pytest.mark.parametrize("t", [5, 300])
def test_the_fused_decode_inside_the_gemms_matches_the_reference(tmp_path, gate_up, down, t):
    """QuantMoE.warm_fused: the warm layer's GEMMs decode the pool's own blocks in their K loop (no scratch):
    quant_mma's kernels for the q4_k/q6_k pairs (fused_kernel "mma"), triton_moe's for the rest ("triton"), for each
    type the decode knows, a chunk of 5 tokens (most experts left out) and one of 300, experts in scattered slots;
    twice, the same bits. Q8_0 in mixed slots: a file all in Q8_0 loads as the native 'q8_0' pool (FastMoE's
    kernels), not a 'gguf' blob."""
    import cupy as cp
    from strata_cuda.quant_ffn import QuantMoE
    e_n, k = 16, 2
    path = write_moe_gguf(tmp_path / "f.gguf", seed=11, arch="qwen3moe", layers=3, experts=e_n, gate_up=gate_up,
                          down=down)
    lp = read_moe_tensors(path).experts.for_layer(2)
    blob_h = lp.arrays["blob"]
    perm = np.random.default_rng(3).permutation(blob_h.shape[0])
    dev = cp.asarray(blob_h[perm])  # every row moved: slot s holds the file's row perm[s]
    pool = lp.with_arrays({"blob": dev})
    slot_of = np.argsort(perm)[2 * e_n + np.arange(e_n)]
    h = lp.fmt.hidden
    rng = np.random.default_rng(29)
    x = rng.standard_normal((t, h)).astype(np.float32)
    logits = rng.standard_normal((t, e_n)).astype(np.float32)
    moe = QuantMoE(e_n, k, lp.fmt)
    moe.warm_device = moe.warm_fused = True
    moe.fused_kernel = "mma" if {gate_up, down} <= {"q4_k", "q6_k"} else "triton"
    assert moe._fused_gemm(lp.fmt) is not None or moe.device_gemm is None
    if moe.device_gemm is None:
        pytest.skip("no device-table path here (Triton or torch missing)")
    want = r64.moe_layer(x, logits, lp, 2 * e_n + np.arange(e_n), k)
    outs = []
    for _ in range(2):
        out = cp.full((t, h), np.nan, cp.float32)
        cp.cuda.Device().synchronize()
        moe.prefill_layer(cp.asarray(x), cp.asarray(logits), pool, slot_of, out=out)
        moe.compute_stream.synchronize()
        assert moe.stats.device_table
        outs.append(cp.asnumpy(out))
    err = r64.relative_error(outs[0], want)
    assert err <= F16_BOUND, (gate_up, down, t, err)
    assert np.array_equal(outs[0], outs[1])


def test_a_speculated_slot_an_admission_rewrites_is_not_used_from_the_speculation(tmp_path):
    """Experts 0..5 cached in slots 0..5 (the speculation takes all six: halves of 4 and 2), experts 4 and 5 left
    out by the routing, experts 6 and 7 missed and admitted by on_counts into slots 4 and 5 (copied on the compute
    stream, as the layer ops admit): the admitted experts' blocks fall in the speculated run of half 1 and must be
    dequantized from their new bytes, not taken from the speculation of the evicted ones."""
    import cupy as cp
    from strata_cuda.quant_ffn import QuantMoE, scratch_bytes
    e_n, k, t = 8, 2, 300
    lp, pool, layer_blob = _layer(tmp_path, e_n, seed=9)
    h = lp.fmt.hidden
    dev = cp.full((8, layer_blob.shape[1]), 255, cp.uint8)
    dev[:6] = cp.asarray(layer_blob[:6])
    pool = pool.with_arrays({"blob": dev})
    src = cp.asarray(layer_blob)
    rng = np.random.default_rng(17)
    x = rng.standard_normal((t, h)).astype(np.float32)
    logits = rng.standard_normal((t, e_n)).astype(np.float32)
    logits[:, [4, 5]] -= 40.0
    assert r64.topk_margin(logits, k) > 1e-5
    slot_of = np.array([0, 1, 2, 3, 4, 5, -1, -1])
    final = np.array([0, 1, 2, 3, -1, -1, 4, 5])
    want = r64.moe_layer(x, logits, lp, 2 * e_n + np.arange(e_n), k)
    moe = QuantMoE(e_n, k, lp.fmt, group_experts=4, scratch_budget_bytes=scratch_bytes(h, lp.fmt.ffn, 4))
    moe.warm_spec_halves, moe.warm_merge_spec, moe.warm_rest_whole, moe.dequant_kernel = 2, False, False, "sb"

    def admit(counts):
        assert counts[4] == 0 and counts[5] == 0 and counts[6] > 0 and counts[7] > 0
        dev[4:6] = src[6:8]  # on the current (compute) stream, before the layer's GEMMs
        return final

    xd, ld = cp.asarray(x), cp.asarray(logits)
    cp.cuda.Device().synchronize()
    out = moe.prefill_layer(xd, ld, pool, slot_of, on_counts=admit)
    moe.compute_stream.synchronize()
    err = r64.relative_error(cp.asnumpy(out), want)
    print(f"admission over speculated slots: rel err {err:.2e}; speculation {moe.spec_report}")
    assert moe.spec_report["speculated"] == 6 and moe.spec_report["used"] == 4
    assert err <= F16_BOUND, err


def test_a_partly_cached_streamed_layer_with_speculation_matches_the_reference(tmp_path):
    """Half the experts cached (speculated), half streamed through a 4-slot ring (their dequantization on the
    compute stream in half 0, after the speculation of it): the output is the float64 reference's."""
    import cupy as cp
    from strata_core.api.kernels import ExpertPool
    from strata_cuda.quant_ffn import QuantMoE, scratch_bytes
    e_n, k, t = 8, 2, 300
    lp, pool, layer_blob = _layer(tmp_path, e_n, seed=4)
    h = lp.fmt.hidden
    mem = cp.cuda.alloc_pinned_memory(layer_blob.nbytes)
    host_blob = np.frombuffer(mem, np.uint8, layer_blob.size).reshape(layer_blob.shape)
    host_blob[:] = layer_blob
    host_pool = ExpertPool("gguf", {"blob": host_blob})
    rng = np.random.default_rng(29)  # seed 23 drew a near-tie (7.5e-6) on the H200 call 1
    x = rng.standard_normal((t, h)).astype(np.float32)
    logits = rng.standard_normal((t, e_n)).astype(np.float32)
    assert r64.topk_margin(logits, k) > 1e-5
    slot_of = np.where(np.arange(e_n) % 2 == 0, 2 * e_n + np.arange(e_n), -1)
    want = r64.moe_layer(x, logits, lp, 2 * e_n + np.arange(e_n), k)
    moe = QuantMoE(e_n, k, lp.fmt, group_experts=2, scratch_budget_bytes=scratch_bytes(h, lp.fmt.ffn, 2))
    moe.warm_spec_halves = 2
    ring0 = int(pool.arrays["blob"].shape[0]) - 8
    xd, ld = cp.asarray(x), cp.asarray(logits)
    cp.cuda.Device().synchronize()
    out = moe.prefill_layer(xd, ld, pool, slot_of, host_pool, (ring0, 4))
    moe.compute_stream.synchronize()
    err = r64.relative_error(cp.asnumpy(out), want)
    print(f"partly cached, streamed: rel err {err:.2e}; speculation {moe.spec_report}; misses {moe.stats.misses}")
    assert moe.stats.misses == 4 and moe.spec_report["speculated"] == 4
    assert err <= F16_BOUND, err


@pytest.mark.parametrize("kernel", ["sb", "sbt"])
@pytest.mark.parametrize("fmt", ["q4_k", "q5_k", "q6_k", "q8_0"])
def test_the_gpu_super_block_dequant_is_numpys_f16_of_the_oracle_bit_for_bit(fmt, kernel):
    """strata_qf_dequant_sb and its fixed-format form (sbt) on the GPU (the hardware's cvt.rn.f16x2.f32):
    both matrices of 3 slots out of order, the second one 2 bytes off a 16-byte boundary in each slot, rows of 9
    super-blocks, equal numpy's float16 of quants.dequantize."""
    import cupy as cp
    from strata_core.reference import quants
    from strata_core.reference.quants import GGML_TYPES
    from strata_cuda.quant_ffn import FAST_THREADS, fast_kernels
    rng = np.random.default_rng(13)
    m, rows, cols = 3, 64, 9 * 256
    w = rng.standard_normal((2, m, rows, cols)).astype(np.float32) * np.float32(0.05)
    w[0, 1, 2, :40] *= np.float32(1e-6)  # f16 subnormals and zeros
    raw = quants.quantize(fmt, w)  # [2, m, rows, rb]
    rb = raw.shape[-1]
    off_b = rows * rb + 2
    sb = off_b + rows * rb + 14
    blob_h = np.zeros((m, sb), np.uint8)
    blob_h[:, :rows * rb] = raw[0].reshape(m, -1)
    blob_h[:, off_b:off_b + rows * rb] = raw[1].reshape(m, -1)
    blob = cp.asarray(blob_h)
    slots = cp.asarray(np.array([2, 0, 1], np.int32))
    out = cp.full((2, m, rows, cols), 0x7e00, cp.uint16)  # poisoned
    typ = np.int32(GGML_TYPES[fmt])
    if kernel == "sbt":  # the formats are the kernel's (strata_qf_dequant_sbt_<a>_<b>)
        fast_kernels(cp)[f"strata_qf_dequant_sbt_{fmt}_{fmt}"](
            (5, m), (FAST_THREADS,), (blob, np.int64(sb), slots, np.int32(m), np.int64(0), np.int64(rb),
                                    np.int32(rows), np.int32(cols), out[0], np.int64(off_b), np.int64(rb),
                                    np.int32(rows), np.int32(cols), out[1]))
    else:
        fast_kernels(cp)[f"strata_qf_dequant_{kernel}"](
            (5, m), (FAST_THREADS,), (blob, np.int64(sb), slots, np.int32(m), np.int64(0), np.int64(rb),
                                    np.int32(rows), np.int32(cols), typ, out[0], np.int64(off_b), np.int64(rb),
                                    np.int32(rows), np.int32(cols), typ, out[1]))
    got = cp.asnumpy(out)
    for i in range(2):
        want = quants.dequantize(fmt, raw[i][[2, 0, 1]], cols).astype(np.float16).view(np.uint16)
        assert int(np.count_nonzero(got[i] != want)) == 0, (fmt, i)


def test_the_gpu_q4_k_m_dequant_is_numpys_f16_of_the_oracle_bit_for_bit():
    """The Q4_K_M pair's fixed-format kernel (strata_qf_dequant_sbt_q4_k_q6_k) on the GPU: gate|up Q4_K rows of 9
    super-blocks and down Q6_K rows of 3 (210-byte blocks: unaligned rows) of 3 slots out of order equal numpy's
    float16 of quants.dequantize."""
    import cupy as cp
    from strata_core.reference import quants
    from strata_cuda.quant_ffn import FAST_THREADS, fast_kernels
    kernel = "sbt"
    rng = np.random.default_rng(17)
    m, rows_a, cols_a, rows_b, cols_b = 3, 40, 9 * 256, 72, 3 * 256
    qa = quants.quantize("q4_k", rng.standard_normal((m, rows_a, cols_a)).astype(np.float32) * np.float32(0.05))
    qb = quants.quantize("q6_k", rng.standard_normal((m, rows_b, cols_b)).astype(np.float32) * np.float32(0.05))
    rb_a, rb_b = qa.shape[-1], qb.shape[-1]
    off_b = rows_a * rb_a + 6
    sb = off_b + rows_b * rb_b + 10
    blob_h = np.zeros((m, sb), np.uint8)
    blob_h[:, :rows_a * rb_a] = qa.reshape(m, -1)
    blob_h[:, off_b:off_b + rows_b * rb_b] = qb.reshape(m, -1)
    order = np.array([2, 0, 1], np.int32)
    out_a = cp.full((m, rows_a, cols_a), 0x7e00, cp.uint16)
    out_b = cp.full((m, rows_b, cols_b), 0x7e00, cp.uint16)
    fast_kernels(cp)[f"strata_qf_dequant_{kernel}_q4_k_q6_k"](
        (4, m), (FAST_THREADS,), (cp.asarray(blob_h), np.int64(sb), cp.asarray(order), np.int32(m), np.int64(0),
                                np.int64(rb_a), np.int32(rows_a), np.int32(cols_a), out_a, np.int64(off_b),
                                np.int64(rb_b), np.int32(rows_b), np.int32(cols_b), out_b))
    for fmt, q, out, cols in (("q4_k", qa, out_a, cols_a), ("q6_k", qb, out_b, cols_b)):
        want = quants.dequantize(fmt, q[order], cols).astype(np.float16).view(np.uint16)
        assert int(np.count_nonzero(cp.asnumpy(out) != want)) == 0, (kernel, fmt)
