"""The cuda backend's grouped FFN over 'gguf' expert pools (strata_cuda/moe_quant.cu) on a real GPU, against the
float64 reference of the same bytes; and `strata run --backend cuda --check` on Q4_K_M-style files. Skipped, saying
"no CUDA device" and why, where there is none. Run on the H200: `python -m pytest -q tests/gpu/test_quant_cuda.py`.
"""

from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import pytest

from strata_core.models.gguf import q4_k_m_down_types, read_moe_tensors, write_moe_gguf
from strata_core.testing import reference64 as r64

from .test_fast_paths import pinned, workspace

pytestmark = [pytest.mark.gpu, pytest.mark.requires_cuda]

#: f32 accumulation of exactly dequantized weights (SIMT kernels); f16 inputs to tensor cores (the mma variant)
F32_BOUND = 1e-5
F16_BOUND = 1e-3
#: (write_moe_gguf arguments, MoE layer to take): every expert type, biases, rows of more than one tile
CASES = {
    "q4_k-q6_k": (dict(arch="qwen3moe", layers=3, gate_up="q4_k", down=q4_k_m_down_types(3)), 2),
    "q4_k-q4_k": (dict(arch="qwen3moe", layers=3, gate_up="q4_k", down=q4_k_m_down_types(3)), 0),
    "q5_k-q6_k": (dict(arch="llama", gate_up="q5_k", down="q6_k"), 1),
    "q6_k-q8_0": (dict(arch="olmoe", gate_up="q6_k", down="q8_0"), 0),
    "mxfp4-bias": (dict(arch="gpt-oss", gate_up="mxfp4", down="mxfp4"), 1),
}


#: the GEMV kernels (small groups, decode): exact weights, f32 sums; 2e-7 measured on the host build
#: (tests/quant/test_quant_cuda_host.py), the GPU's own summation order allowed for
GEMV_BOUND = 1e-5
#: fixture variant -> (QuantGroupedFFN arguments, the bound of the path the CASES groups (19..70 rows) take)
VARIANTS = {"tiled-simt": (dict(fast=False, mma=False), F32_BOUND), "tiled-mma": (dict(fast=False, mma=True), F16_BOUND),
            "fast": (dict(fast=True), F16_BOUND)}


@pytest.fixture(scope="module", params=list(VARIANTS))
def cuda_kernels(request):
    """The cuda KernelSet on device 0 with moe_quant.cu's tiled SIMT or tensor-core kernels, or the fast paths
    (quant_fast.cu's GEMV for small groups, f16 scratch + cuBLAS for large ones; cupy imported only here)."""
    import cupy
    from strata_cuda.kernels import CupyKernels
    from strata_cuda.quant_ffn import QuantGroupedFFN
    k = CupyKernels()
    kw, bound = VARIANTS[request.param]
    k._quant = QuantGroupedFFN(cupy, **kw)
    k.variant, k.bound = request.param, bound
    return k


@pytest.mark.parametrize("case", list(CASES))
def test_the_cuda_quant_grouped_ffn_matches_the_float64_reference(tmp_path, cuda_kernels, case):
    import cupy as cp
    kw, layer = CASES[case]
    path = write_moe_gguf(tmp_path / f"{case}.gguf", seed=7, **kw)
    host = read_moe_tensors(path).experts
    assert host.dtype == "gguf", case
    lp = host.for_layer(layer)
    dev = lp.with_arrays({"blob": cp.asarray(lp.arrays["blob"])})
    h = lp.fmt.hidden
    rng = np.random.default_rng(11)
    x = rng.standard_normal((150, h)).astype(np.float32)
    base = layer * 8
    # 70 rows (two row tiles), an empty group, 60, 19, and a slot outside the pool (its row is zero)
    offsets = np.array([0, 70, 70, 130, 149, 150], np.int32)
    slots = np.array([base + 5, base + 1, base + 7, base + 2, 10_000], np.int32)
    y = cp.asnumpy(cuda_kernels.moe_grouped_ffn(cp.asarray(x), offsets, slots, dev))
    want = r64.moe_grouped_ffn(x[:149], offsets[:5], slots[:4], lp)
    err = r64.relative_error(y[:149], want)
    print(f"{cuda_kernels.variant} {case}: rel err {err:.2e} (bound {cuda_kernels.bound:g})")
    assert err <= cuda_kernels.bound, (case, err)
    assert not y[149].any()
    if cuda_kernels.variant == "fast":
        # biased formats (gpt-oss) stay on the tiled kernels: the f16 path's SwiGLU adds no biases
        path = "tiled" if lp.fmt.bias else "dequant_gemm"
        assert cuda_kernels._quant.counts[path] >= 1, cuda_kernels._quant.counts


@pytest.mark.parametrize("case", list(CASES))
def test_the_gemv_path_of_small_groups_matches_the_float64_reference(tmp_path, case):
    """Groups of 1..6 rows (decode, short chunks) take quant_fast.cu's GEMV kernels: f32 sums of exact weights."""
    import cupy as cp
    from strata_cuda.kernels import CupyKernels
    from strata_cuda.quant_ffn import QuantGroupedFFN
    k = CupyKernels()
    k._quant = QuantGroupedFFN(cp)
    kw, layer = CASES[case]
    lp = read_moe_tensors(write_moe_gguf(tmp_path / f"{case}.gguf", seed=3, **kw)).experts.for_layer(layer)
    dev = lp.with_arrays({"blob": cp.asarray(lp.arrays["blob"])})
    rng = np.random.default_rng(12)
    x = rng.standard_normal((13, lp.fmt.hidden)).astype(np.float32)
    offsets = np.array([0, 1, 7, 7, 10, 12, 13], np.int32)
    b = layer * 8
    slots = np.array([b + 3, b + 6, b + 1, b + 0, b + 7, 10_000], np.int32)
    y = cp.asnumpy(k.moe_grouped_ffn(cp.asarray(x), offsets, slots, dev))
    want = r64.moe_grouped_ffn(x[:12], offsets[:6], slots[:5], lp)
    err = r64.relative_error(y[:12], want)
    print(f"gemv {case}: rel err {err:.2e} (bound {GEMV_BOUND:g})")
    assert k._quant.counts["gemv"] == 1, k._quant.counts
    assert err <= GEMV_BOUND, (case, err)
    assert not y[12].any()


@pytest.mark.parametrize("group_experts,pieces", [(1, False), (3, False), (3, True)])
def test_quant_moe_layer_warm_cold_and_decode_match_the_float64_reference(tmp_path, group_experts, pieces):
    """QuantMoE (the layer path of a 'gguf' model): a warm prefill chunk (every expert cached, groups of
    group_experts dequantized to f16 scratch on the side stream, two buffers in turn; with `pieces`, a scratch
    budget smaller than one expert: gate/up in 32-row blocks, down in 64-column K blocks added with beta = 1), a
    cold one (every expert streamed from page-locked host memory through 8 ring slots) and a decode step replayed
    as a graph; the scratch is the plan's lent buffer, never grown."""
    import cupy as cp
    from strata_core.api.kernels import ExpertPool
    from strata_cuda.quant_ffn import QuantMoE, scratch_layout
    path = write_moe_gguf(tmp_path / "q.gguf", seed=5, arch="qwen3moe", layers=3, gate_up="q4_k",
                          down=q4_k_m_down_types(3))
    layer, e_n, k = 2, 8, 2
    lp = read_moe_tensors(path).experts.for_layer(layer)
    blob_h = lp.arrays["blob"]
    ring0, ring_n = blob_h.shape[0], 8
    dev_blob = cp.full((ring0 + ring_n, blob_h.shape[1]), 255, cp.uint8)
    dev_blob[:ring0] = cp.asarray(blob_h)
    pool = lp.with_arrays({"blob": dev_blob})
    host_blob = pinned(cp, (e_n, blob_h.shape[1]), np.uint8)
    host_blob[:] = blob_h[layer * e_n:(layer + 1) * e_n]
    host_pool = ExpertPool("gguf", {"blob": host_blob})
    rng = np.random.default_rng(21)
    h = lp.fmt.hidden
    x = rng.standard_normal((300, h)).astype(np.float32)
    logits = rng.standard_normal((300, e_n)).astype(np.float32)
    assert r64.topk_margin(logits, k) > 1e-5
    slot_of = layer * e_n + np.arange(e_n)
    want = r64.moe_layer(x, logits, lp, slot_of, k)
    budget = 2 * h * 64 if pieces else 1 << 30
    lay = scratch_layout(h, lp.fmt.ffn, e_n, budget, group_experts)
    assert (lay.group_experts == 0 and lay.gate_up_rows < lp.fmt.ffn and lay.down_cols < lp.fmt.ffn) if pieces \
        else lay.group_experts == group_experts
    moe = QuantMoE(e_n, k, lp.fmt, group_experts=group_experts, scratch_budget_bytes=budget)
    # every prefill buffer lent, as layer_ops carves them from the plan's arena: a buffer grown past it raises
    need = moe.prefill_buffer_bytes(300, "gguf")
    assert need["scratch"] == lay.nbytes <= budget
    lent_mem = {n: cp.cuda.alloc(max(b, 16)) for n, b in need.items()}
    moe.use_buffers({n: (int(m.ptr), need[n]) for n, m in lent_mem.items()})
    xd, ld = cp.asarray(x), cp.asarray(logits)
    cp.cuda.Device().synchronize()  # the inputs land before QuantMoE's non-blocking streams read them
    # QuantMoE runs on its own non-blocking stream: synchronize it before reading an output on the null stream
    warm = moe.prefill_layer(xd, ld, pool, slot_of)
    moe.compute_stream.synchronize()
    err_w = r64.relative_error(cp.asnumpy(warm), want)
    cold = moe.prefill_layer(xd, ld, pool, np.full(e_n, -1), host_pool, (ring0, ring_n))
    moe.compute_stream.synchronize()
    err_c = r64.relative_error(cp.asnumpy(cold), want)
    assert moe.stats.misses == e_n and moe.stats.bytes_streamed == e_n * blob_h.shape[1]
    smap = cp.asarray(slot_of.astype(np.int32))
    cp.cuda.Device().synchronize()
    out = moe.decode_layer(xd[:1], ld[:1], pool, smap)
    moe.compute_stream.synchronize()
    dec = cp.asnumpy(out)
    out.fill(np.nan)
    cp.cuda.Device().synchronize()
    moe.decode_layer(xd[:1], ld[:1], pool, smap)  # the graph's replay writes the poisoned output again
    moe.compute_stream.synchronize()
    dec2 = cp.asnumpy(out)
    err_d = r64.relative_error(dec, want[:1])
    print(f"QuantMoE group_experts={group_experts} pieces={pieces}: warm {err_w:.2e}, cold {err_c:.2e} "
          f"(bound {F16_BOUND:g}); "
          f"decode {err_d:.2e} (bound {GEMV_BOUND:g})")
    assert err_w <= F16_BOUND and err_c <= F16_BOUND, (err_w, err_c)
    assert err_d <= GEMV_BOUND and np.array_equal(dec, dec2), err_d


def test_cuda_layer_ops_run_a_gguf_prefill_on_the_quant_moe_path(tmp_path):
    """CudaLayerOps (what `strata run --backend cuda` calls) takes QuantMoE for a 'gguf' layer: a prefill chunk with
    half the experts cached and the rest streamed through lent ring slots, on the runtime's cache, store and source."""
    import cupy as cp

    from strata_core.api.kernels import LayerWork
    from strata_core.runtime.cache import ExpertCache
    from strata_core.runtime.layer_ops import StoreSource, new_counters
    from strata_core.runtime.store import ExpertStore
    from strata_cuda.cupy_device import CupyDeviceMemory
    from strata_cuda.kernels import CupyKernels
    from strata_cuda.layer_ops import CudaLayerOps
    from strata_cuda.quant_ffn import QuantMoE
    path = write_moe_gguf(tmp_path / "q.gguf", seed=6, arch="qwen3moe", layers=3, gate_up="q4_k",
                          down=q4_k_m_down_types(3))
    host_file = read_moe_tensors(path).experts
    layers, e_n, k = 3, 8, 2
    blob_h = host_file.arrays["blob"]
    blob_p = pinned(cp, blob_h.shape, np.uint8)
    blob_p[:] = blob_h
    host = host_file.with_arrays({"blob": blob_p})
    n_slots = layers * e_n // 2 + 8
    cache = ExpertCache(n_slots, layers, e_n)
    dev = host.with_arrays({"blob": cp.full((n_slots, blob_h.shape[1]), 255, cp.uint8)})
    rng = np.random.default_rng(31)
    placed = rng.permutation(layers * e_n)[: layers * e_n // 2]
    got = cache.place(placed)
    dev.arrays["blob"][cp.asarray(got)] = cp.asarray(blob_p[placed[: got.size]])
    store = ExpertStore(host, layers, e_n)
    store.pinned_rows[:] = True
    dm = CupyDeviceMemory(0)
    stats = new_counters()
    source = StoreSource(dm, dev, store, None, stats, False)
    op = CudaLayerOps(dm, CupyKernels(0))
    h = host.formats[0].hidden
    ring = cache.lend(4)
    assert ring is not None
    ws = workspace(cp)
    x0 = rng.standard_normal((200, h)).astype(np.float32)
    x = cp.asarray(x0)
    checked = 0
    for layer in range(layers):
        norm = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
        router = (rng.standard_normal((e_n, h)) / np.sqrt(h)).astype(np.float32)
        cp.cuda.Device().synchronize()
        x_in = x.get()
        w = LayerWork(phase="prefill", layer=layer, tokens=200, x=x, norm_w=cp.asarray(norm),
                      router_w=cp.asarray(router), top_k=k, pool=dev.for_layer(layer), slots=cache, source=source,
                      workspace=ws, ring=np.asarray(ring), copy_stream=cp.cuda.Stream(non_blocking=True),
                      stats=stats)
        op.prefill_layer(w)
        cp.cuda.Device().synchronize()
        xn = r64.rmsnorm(x_in, norm)
        logits = r64.linear(xn, router).astype(np.float32)
        if r64.topk_margin(logits, k) < 1e-3:  # a near-tie: the device's f32 router may pick the other expert
            continue
        want = r64.moe_layer(np.asarray(xn, np.float32), logits, host.for_layer(layer),
                                layer * e_n + np.arange(e_n), k)
        err = r64.relative_error(x.get() - x_in, want)
        print(f"layer ops gguf layer {layer}: rel err {err:.2e} (bound {F16_BOUND:g})")
        assert err <= F16_BOUND, (layer, err)
        checked += 1
    assert checked >= 1
    assert op.counts["prefill_fused"] == layers and op.counts["prefill_composed"] == 0, op.counts
    assert any(isinstance(v, QuantMoE) for v in op._fast.values())
    assert stats["experts_streamed"] > 0


@pytest.mark.parametrize("cached", ["all", "half"])
def test_cuda_layer_ops_decode_a_gguf_model_as_graph_replays_per_format(tmp_path, cached):
    """CudaLayerOps.decode_step over a 'gguf' model whose layers differ in format (Q4_K_M: down Q4_K, Q4_K, Q6_K):
    one QuantMoE graph replay per run of layers of one format, the residual after all layers against the float64
    reference; no composed step. "half": half the experts cached, the store page-locked, so routed misses are read
    from its mapped rows inside the replay (before 2026-12-06 such a step ran composed: 24 tok/s for
    Qwen3-30B-A3B@Q4_K_M half cached on the H100)."""
    import cupy as cp

    from strata_core.api.kernels import LayerWork
    from strata_core.runtime.cache import ExpertCache
    from strata_core.runtime.layer_ops import StoreSource, new_counters
    from strata_core.runtime.store import ExpertStore
    from strata_cuda.cupy_device import CupyDeviceMemory
    from strata_cuda.kernels import CupyKernels
    from strata_cuda.layer_ops import CudaLayerOps
    from strata_cuda.quant_ffn import QuantMoE
    path = write_moe_gguf(tmp_path / "q.gguf", seed=7, arch="qwen3moe", layers=3, gate_up="q4_k",
                          down=q4_k_m_down_types(3))
    host_file = read_moe_tensors(path).experts
    layers, e_n, k = 3, 8, 2
    blob_h = host_file.arrays["blob"]
    blob_p = pinned(cp, blob_h.shape, np.uint8)
    blob_p[:] = blob_h
    host = host_file.with_arrays({"blob": blob_p})
    rng = np.random.default_rng(41)
    placed = np.arange(layers * e_n) if cached == "all" else np.sort(rng.permutation(layers * e_n)[: layers * e_n // 2])
    cache = ExpertCache(placed.size, layers, e_n)
    dev = host.with_arrays({"blob": cp.full((placed.size, blob_h.shape[1]), 255, cp.uint8)})
    got = cache.place(placed)
    assert got.size == placed.size
    dev.arrays["blob"][cp.asarray(got)] = cp.asarray(blob_p[placed])
    cp.cuda.Device().synchronize()
    store = ExpertStore(host, layers, e_n)
    store.pinned_rows[:] = True  # cudaHostAlloc memory: page-locked and mapped
    dm = CupyDeviceMemory(0)
    stats = new_counters()
    source = StoreSource(dm, dev, store, None, stats, False)
    op = CudaLayerOps(dm, CupyKernels(0))
    h = host.formats[0].hidden
    norms = [(1 + 0.1 * rng.standard_normal(h)).astype(np.float32) for _ in range(layers)]
    routers = [(rng.standard_normal((e_n, h)) / np.sqrt(h)).astype(np.float32) for _ in range(layers)]
    norms_d, routers_d = [cp.asarray(v) for v in norms], [cp.asarray(v) for v in routers]
    ws = workspace(cp)
    for _ in range(50):  # a token without near-ties in any layer (and with a routed miss, half cached)
        x0 = rng.standard_normal((1, h)).astype(np.float32)
        want, ok, missed = x0.astype(np.float64), True, 0
        for layer in range(layers):
            xn = np.asarray(r64.rmsnorm(want.astype(np.float32), norms[layer]), np.float32)
            logits = r64.linear(xn, routers[layer]).astype(np.float32)
            ok = ok and r64.topk_margin(logits, k) > 1e-2
            missed += int(np.isin(layer * e_n + r64.route_topk(logits, k)[0][0], placed, invert=True).sum())
            want = want + r64.moe_layer(xn, logits, host.for_layer(layer), layer * e_n + np.arange(e_n), k)
        if ok and (cached == "all" or missed):
            break
    assert ok and (cached == "all" or missed), "no token without near-ties (and with a miss) in 50 draws"
    x = cp.empty((1, h), cp.float32)
    for step in range(2):
        x.set(x0)
        cp.cuda.Device().synchronize()
        works = [LayerWork(phase="decode", layer=i, tokens=1, x=x, norm_w=norms_d[i], router_w=routers_d[i], top_k=k,
                           pool=dev.for_layer(i), slots=cache, source=source, workspace=ws,
                           ring=np.zeros(0, np.int32), copy_stream=cp.cuda.Stream(non_blocking=True), stats=stats)
                 for i in range(layers)]
        op.decode_step(works)
        cp.cuda.Device().synchronize()
        err = r64.relative_error(x.get() - x0, want - x0)
        print(f"layer ops gguf decode ({cached} cached, {missed} routed misses) step {step}: rel err {err:.2e} "
              f"(bound {F16_BOUND:g})")
        assert err <= F16_BOUND, (step, err)
    assert op.counts["decode_graph_steps"] == 2 and op.counts["decode_composed_steps"] == 0, op.counts
    moes = [v for v in op._fast.values() if isinstance(v, QuantMoE)]
    assert len(moes) == 2, "Q4_K_M's two down formats: two QuantMoE objects"
    assert all(len(m._graphs) == 1 for m in moes), "one graph per run of layers, replayed"


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss", "deepseek2"])
def test_strata_run_on_cuda_checks_a_quantized_file(tmp_path, arch):
    from strata_core.cli import main
    kw = dict(gate_up="mxfp4", down="mxfp4") if arch == "gpt-oss" else dict(layers=3, down=q4_k_m_down_types(3))
    path = write_moe_gguf(tmp_path / f"{arch}.gguf", arch=arch, **kw)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["run", "--model", str(path), "--backend", "cuda", "--check", "--prompt-tokens", "300",
                   "--decode-tokens", "4", "--set", "memory.expert_cache=6", "--json"])
    assert rc == 0, err.getvalue()[-3000:]
    r = json.loads(out.getvalue())
    assert r["check"] == "passed" and r["bytes_streamed"] > 0
    assert r["cache_pool_bytes"] == 6 * r["plan"]["expert_cache"]["slot_bytes"]


@pytest.mark.parametrize("fmt", ["q4_k", "q5_k", "q6_k", "q8_0", "mxfp4", "f16", "bf16", "f32"])
def test_the_gpu_dequant_to_f16_is_numpys_f16_of_the_oracle_bit_for_bit(fmt):
    """strata_qf_dequant_f16 on the GPU (the hardware's cvt.rn.f16x2.f32, not the host build's integer rounding)
    gives numpy's float16 of quants.dequantize for every weight, slots taken out of order from a table."""
    import cupy as cp
    from strata_core.reference import quants
    from strata_cuda.quant_ffn import FAST_THREADS, fast_kernels
    from strata_core.reference.quants import GGML_TYPES
    rng = np.random.default_rng(13)
    m, rows, cols = 3, 64, 512
    w = rng.standard_normal((m, rows, cols)).astype(np.float32) * np.float32(0.05)
    w[1, 2, :40] *= np.float32(1e-6)  # f16 subnormals and zeros
    raw = quants.quantize(fmt, w)
    rb = raw.shape[-1]
    blob = cp.asarray(raw.reshape(m, -1))
    slots = cp.asarray(np.array([2, 0, 1], np.int32))
    out = cp.full((m, rows, cols), 0x7e00, cp.uint16)  # poisoned
    fast_kernels(cp)["strata_qf_dequant_f16"](
        (4, m), (FAST_THREADS,), (blob, np.int64(rows * rb), slots, np.int32(m), np.int64(0), np.int64(rb),
                                  np.int32(rows), np.int32(cols), np.int32(GGML_TYPES[fmt]), out))
    want = quants.dequantize(fmt, raw[[2, 0, 1]], cols).astype(np.float16).view(np.uint16)
    got = cp.asnumpy(out)
    assert int(np.count_nonzero(got != want)) == 0, fmt


@pytest.mark.parametrize("broken", ["shape", "build"])
def test_strata_run_on_cuda_reports_a_fused_gemm_that_stood_down_and_still_checks(tmp_path, monkeypatch, broken):
    """With the fused warm GEMMs on (quant_ffn.WARM_DEVICE and WARM_FUSED; the plan caches every expert of this
    file) and quant_mma unable to run them (block shapes it lacks, or a build that raises), `strata run` takes the
    f16 scratch path, passes --check and lists the reason once among its fallbacks: said, never fatal."""
    from strata_core.cli import main
    from strata_cuda import quant_ffn, quant_mma
    monkeypatch.setattr(quant_ffn, "WARM_DEVICE", True)  # the warm layers (every expert cached, as here) ask
    monkeypatch.setattr(quant_ffn, "WARM_FUSED", True)   # for the fused GEMMs
    monkeypatch.setattr(quant_ffn, "FUSED_KERNEL", "mma")
    if broken == "shape":
        monkeypatch.setattr(quant_ffn, "FUSED_BLOCK_ROWS", (64, 64))
    else:
        def planted(*a, **k):
            raise RuntimeError("planted build failure")
        monkeypatch.setattr(quant_mma, "QuantMmaGEMM", planted)
    path = write_moe_gguf(tmp_path / "q4_k_m.gguf", arch="qwen3moe", layers=3, down=q4_k_m_down_types(3))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["run", "--model", str(path), "--backend", "cuda", "--check", "--prompt-tokens", "300",
                   "--decode-tokens", "4", "--json"])
    assert rc == 0, err.getvalue()[-3000:]
    r = json.loads(out.getvalue())
    assert r["check"] == "passed"
    said = [f for f in r["fallbacks"] if f["what"] == "fused quant GEMM"]
    want = "no blocks of (128, 128) input x (64, 64) weight rows" if broken == "shape" else "planted build failure"
    assert len(said) == 1 and want in said[0]["why"], r["fallbacks"]
