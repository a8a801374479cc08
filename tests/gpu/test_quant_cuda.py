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


@pytest.fixture(scope="module", params=[False, True], ids=["simt", "mma"])
def cuda_kernels(request):
    """The cuda KernelSet on device 0 with moe_quant.cu's SIMT or tensor-core kernels (cupy imported only here)."""
    import cupy
    from strata_cuda.kernels import CupyKernels
    from strata_cuda.quant_ffn import QuantGroupedFFN
    k = CupyKernels()
    k._quant = QuantGroupedFFN(cupy, mma=request.param)
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
    assert r64.relative_error(y[:149], want) <= (F16_BOUND if cuda_kernels._quant.mma else F32_BOUND), case
    assert not y[149].any()


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
