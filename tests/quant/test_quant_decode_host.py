"""quant_decode.cu (QuantMoE's decode kernels over 'gguf' pools: routing fused into gate/up, the quant blocks
decoded a 32-weight unit at a time against x staged in shared memory) built by g++ for the host, a fiber a GPU
thread (host_build.FIBERS), and checked against the float64 reference: every format the kernels take (q4_k, q5_k,
q6_k, q8_0 in either matrix), blobs off a 4-byte boundary for the word-loaded formats, the routing's ids and
weights, NaN for a routed expert outside the pool. The GPU run is tests/gpu/test_quant_decode.py."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import numpy as np
import pytest
from host_build import FIBERS, block_shim, build_host_library, nvrtc_or_skip, pointer

from strata_core.models.gguf import read_moe_tensors, write_moe_gguf
from strata_core.testing import reference64 as r64

CUDA_DIR = Path(__file__).resolve().parents[2] / "backends" / "cuda" / "strata_cuda"
#: exact weights, f32 sums (s * sum(q x) - m * sum(x) a run); the old GEMV kernels' host bound
BOUND = 1e-6

SHIM = FIBERS + "#define QD_HOST 1\n" + block_shim("qd")

WRAPPERS = "extern \"C\" {\n" + "".join(rf"""
void host_gate_up_{t}(unsigned gx, unsigned gy, const float* x, const float* logits, int E, int K,
                      const int* slot_map, int S, int H, int F, const unsigned char* blob, long long sb, long long rb,
                      const unsigned char* host, long long hb, float* act, int* ids, float* w, int* slots) {{
    qd_launch(gx, gy, [&] {{ strata_qd_gate_up_{t}(x, logits, E, K, slot_map, S, H, F, blob, sb, rb, host, hb, act,
                                                   ids, w, slots); }});
}}
void host_down_{t}(unsigned gx, const float* act, const float* w, const int* slots, int S, int K, int H, int F,
                   const unsigned char* blob, long long sb, long long doff, long long rb, const unsigned char* host,
                   long long hb, int acc, float* out) {{
    qd_launch(gx, 1, [&] {{ strata_qd_down_{t}(act, w, slots, S, K, H, F, blob, sb, doff, rb, host, hb, acc,
                                               out); }});
}}
""" for t in ("q4_k", "q5_k", "q6_k", "q8_0")) + "}\n"


@pytest.fixture(scope="module")
def qd_lib(tmp_path_factory):
    """quant_decode.cu built for the host."""
    text = SHIM + (CUDA_DIR / "quant_decode.cu").read_text() + WRAPPERS
    return build_host_library(tmp_path_factory, "quant_decode_host", text, CUDA_DIR,
                              includes=[CUDA_DIR / "quants.cuh"])


def host_decode(lib, x, logits, pool, slot_map, k, out0, pad: int = 0, host=None):
    """One decode step through the host build, launched as QuantMoE launches it (decode_form 2): gate/up (routing
    in every block), then down added to out0; the blob `pad` bytes off a 16-byte boundary; `host` the [E, row
    bytes] rows a miss (slot -1) is read from, else none. (out, ids, w, slots)."""
    from strata_cuda.quant_ffn import DECODE_PAIRS, FAST_WARPS
    fmt = pool.fmt
    src = np.ascontiguousarray(pool.arrays["blob"])
    buf = np.zeros(src.nbytes + 64, np.uint8)
    off = (-buf.ctypes.data) % 16 + pad
    blob = buf[off:off + src.nbytes].reshape(src.shape)
    blob[:] = src
    e, h, f = logits.shape[1], fmt.hidden, fmt.ffn
    act = np.full((k, f), np.nan, np.float32)
    ids, w, slots = np.full(k, -7, np.int32), np.full(k, np.nan, np.float32), np.full(k, -7, np.int32)
    out = out0.copy()
    ll, i32, u = ctypes.c_longlong, ctypes.c_int, ctypes.c_uint
    rows = FAST_WARPS * DECODE_PAIRS
    hp, hb = (pointer(host), ll(host.strides[0])) if host is not None else (ctypes.c_void_p(0), ll(0))
    getattr(lib, f"host_gate_up_{fmt.gate_up}")(
        u(-(-f // rows)), u(k), pointer(x), pointer(logits), i32(e), i32(k), pointer(slot_map), i32(blob.shape[0]), i32(h), i32(f),
        pointer(blob), ll(blob.shape[1]), ll(fmt.gate_up_row_bytes), hp, hb, pointer(act), pointer(ids), pointer(w),
        pointer(slots))
    getattr(lib, f"host_down_{fmt.down}")(
        u(-(-h // FAST_WARPS)), pointer(act), pointer(w), pointer(slots), i32(blob.shape[0]), i32(k), i32(h), i32(f), pointer(blob),
        ll(blob.shape[1]), ll(fmt.down_offset), ll(fmt.down_row_bytes), hp, hb, i32(1), pointer(out))
    return out, ids, w, slots


#: (write_moe_gguf arguments, layer): gate/up and down in every type the kernels take
CASES = {
    "q4_k-q6_k": (dict(arch="qwen3moe", layers=3, gate_up="q4_k", down=["q4_k", "q4_k", "q6_k"]), 2),
    "q4_k-q4_k": (dict(arch="qwen3moe", layers=3, gate_up="q4_k", down=["q4_k", "q4_k", "q6_k"]), 0),
    "q5_k-q6_k": (dict(arch="llama", gate_up="q5_k", down="q6_k"), 1),
    "q6_k-q8_0": (dict(arch="olmoe", gate_up="q6_k", down="q8_0"), 0),
    "q8_0-q5_k": (dict(arch="qwen3moe", gate_up="q8_0", down="q5_k", hidden=512), 1),
    "q8_0-q6_k": (dict(arch="qwen3moe", gate_up="q8_0", down="q6_k"), 0),
}
#: q6_k and q8_0 read 4-byte words at any offset: those cases also run on blobs 2 and 3 bytes off a boundary
RUNS = [(c, 0) for c in CASES] + [(c, p) for c in ("q6_k-q8_0", "q8_0-q6_k") for p in (2, 3)]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("qd_gguf")
    return {c: write_moe_gguf(d / f"{c}.gguf", seed=i + 3, **kw) for i, (c, (kw, _)) in enumerate(CASES.items())}


@pytest.mark.parametrize("case,pad", RUNS)
def test_quant_decode_kernels_on_the_host_match_the_float64_reference(qd_lib, files, case, pad):
    """out0 + sum_k w_k expert(slot_map[id_k])(x) of the reference's routing, within BOUND of float64; the ids,
    weights and routed slots the gate/up kernel publishes are the reference's."""
    from strata_cuda.quant_ffn import decode_kernels_take
    kw, layer = CASES[case]
    pool = read_moe_tensors(files[case]).experts.for_layer(layer)
    fmt = pool.fmt
    e_n, k = 8, 3
    assert decode_kernels_take(fmt, e_n, k, 4096 + pad, pool.arrays["blob"].shape[1])
    rng = np.random.default_rng(17)
    x = rng.standard_normal((1, fmt.hidden)).astype(np.float32)
    logits = rng.standard_normal((1, e_n)).astype(np.float32)
    n_slots = pool.arrays["blob"].shape[0]
    slot_map = (layer * e_n + np.arange(e_n, dtype=np.int32))[::-1].copy()  # expert e in slot base + 7 - e
    out0 = rng.standard_normal((1, fmt.hidden)).astype(np.float32)
    out, ids, w, slots = host_decode(qd_lib, x, logits, pool, slot_map, k, out0, pad)
    want_ids, want_w = r64.route_topk(logits, k)
    assert np.array_equal(ids, want_ids[0]) and np.array_equal(slots, slot_map[want_ids[0]])
    assert np.allclose(w, want_w[0], rtol=1e-6, atol=0)
    ys = r64.moe_grouped_ffn(np.repeat(x, k, 0), np.arange(k + 1), slot_map[ids], pool)
    want = out0.astype(np.float64) + (want_w[0][:, None] * ys).sum(0)
    err = r64.relative_error(out - out0, want - out0)
    print(f"{case} pad {pad}: rel err {err:.2e} (bound {BOUND:g}); slots {n_slots}")
    assert err <= BOUND, err


def test_the_decode_kernels_take_only_what_they_can_read():
    """decode_kernels_take: q4_k/q5_k matrices only 16-byte aligned (blob and slots), no biases, no other types,
    the shared-memory bounds (H, K * F, K) and E within a block's threads."""
    from strata_core.api.kernels import ExpertFormat
    from strata_cuda.quant_ffn import decode_kernels_take
    q = ExpertFormat("q4_k", "q6_k", 2048, 768)
    assert decode_kernels_take(q, 128, 8, 1 << 20, q.nbytes)
    assert not decode_kernels_take(q, 128, 8, (1 << 20) + 2, q.nbytes)
    assert not decode_kernels_take(q, 128, 8, 1 << 20, q.nbytes + 2)
    assert decode_kernels_take(ExpertFormat("q6_k", "q8_0", 2048, 768), 128, 8, (1 << 20) + 3, 7)
    assert not decode_kernels_take(ExpertFormat("mxfp4", "mxfp4", 2048, 768), 128, 8, 1 << 20, 1 << 20)
    assert not decode_kernels_take(ExpertFormat("q4_k", "q6_k", 8192, 768), 128, 8, 1 << 20, q.nbytes)
    assert not decode_kernels_take(q, 128, 16, 1 << 20, q.nbytes)  # K * F = 12288 > 8192
    assert not decode_kernels_take(q, 512, 8, 1 << 20, q.nbytes)


def test_a_routed_expert_outside_the_pool_makes_the_output_nan(qd_lib, files):
    """A routed slot outside [0, n_slots) (decode needs every routed expert cached): every output NaN, not a read
    of another slot's bytes; the experts not routed may be missing."""
    pool = read_moe_tensors(files["q4_k-q6_k"]).experts.for_layer(2)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, pool.fmt.hidden)).astype(np.float32)
    logits = rng.standard_normal((1, 8)).astype(np.float32)
    ids = r64.route_topk(logits, 2)[0][0]
    slot_map = 16 + np.arange(8, dtype=np.int32)
    cold = np.setdiff1d(np.arange(8), ids)
    slot_map[cold] = -1
    out0 = np.zeros((1, pool.fmt.hidden), np.float32)
    out, _, _, _ = host_decode(qd_lib, x, logits, pool, slot_map, 2, out0)
    assert np.isfinite(out).all()
    slot_map[ids[1]] = 10_000
    out, _, _, _ = host_decode(qd_lib, x, logits, pool, slot_map, 2, out0)
    assert np.isnan(out).all()


@pytest.mark.parametrize("case", ["q4_k-q6_k", "q8_0-q5_k"])
def test_a_miss_is_read_from_the_host_rows_and_published_for_the_down_kernel(qd_lib, files, case):
    """With a host base, a routed expert whose slot is -1 is read from the host rows (expert e at host + e * row
    bytes, a stride unlike the pool's slots), its slot published as -2 - e, and the output is the reference's
    over those rows: the decode step of a partly cached layer (CudaLayerOps._hosts gives the store's mapped rows)."""
    kw, layer = CASES[case]
    pool = read_moe_tensors(files[case]).experts.for_layer(layer)
    fmt, e_n, k = pool.fmt, 8, 4
    blob = pool.arrays["blob"]
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, fmt.hidden)).astype(np.float32)
    logits = rng.standard_normal((1, e_n)).astype(np.float32)
    want_ids, want_w = r64.route_topk(logits, k)
    ids0 = want_ids[0]
    # the layer's rows in expert order, 48 bytes more a row than a slot (16-byte aligned, as the wide loads need)
    rows = np.zeros((e_n, blob.shape[1] + 48), np.uint8)
    base = layer * e_n
    rows[:, :blob.shape[1]] = blob[base:base + e_n]
    slot_map = base + np.arange(e_n, dtype=np.int32)
    slot_map[ids0[1::2]] = -1  # every other routed expert missed
    blob_junk = blob.copy()
    blob_junk[base + ids0[1::2]] = 0x55  # a read of a missed expert's stale slot would show
    junk_pool = pool.with_arrays({"blob": blob_junk})
    out0 = rng.standard_normal((1, fmt.hidden)).astype(np.float32)
    out, ids, w, slots = host_decode(qd_lib, x, logits, junk_pool, slot_map, k, out0, host=rows)
    assert np.array_equal(ids, ids0)
    assert np.array_equal(slots, np.where(slot_map[ids0] < 0, -2 - ids0, slot_map[ids0]))
    ys = r64.moe_grouped_ffn(np.repeat(x, k, 0), np.arange(k + 1), base + ids0, pool)
    want = out0.astype(np.float64) + (want_w[0][:, None] * ys).sum(0)
    err = r64.relative_error(out - out0, want - out0)
    print(f"{case}: misses {ids0[1::2].tolist()} from the host rows, rel err {err:.2e}")
    assert err <= BOUND, err
    # without the host base the same misses are NaN, as before
    out, _, _, slots = host_decode(qd_lib, x, logits, junk_pool, slot_map, k, out0)
    assert np.isnan(out).all() and np.array_equal(slots, slot_map[ids0])


def test_quant_decode_cu_compiles_with_nvrtc_and_keeps_its_loads_ahead_of_the_sums():
    """NVRTC builds every kernel QuantMoE names; in each gate/up and down kernel every weight load (32-bit or
    16-byte integer loads through the read-only path) sits between the kernel's first launch_dependents and the
    trip's issue fence (the last one), so none is left among the sums; no local memory."""
    nvrtc_or_skip()
    from strata_cuda.quant_ffn import DECODE_KERNEL_NAMES, DECODE_SOURCE_NAME, compile_to_ptx
    ptx = compile_to_ptx("compute_90", DECODE_SOURCE_NAME).decode()
    assert sorted(re.findall(r"\.entry\s+(\w+)", ptx)) == sorted(DECODE_KERNEL_NAMES)
    for body in re.split(r"\.entry\s+", ptx)[1:]:
        name = body.split("(", 1)[0]
        fences = [m.start() for m in re.finditer(r"griddepcontrol\.launch_dependents", body)]
        loads = [m.start() for m in re.finditer(r"ld\.global\.nc(\.v4)?\.u32", body)]
        assert len(fences) == 2 and loads, name
        assert all(fences[0] < a < fences[1] for a in loads), name
        assert "ld.local" not in body and "st.local" not in body, name
