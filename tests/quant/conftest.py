"""Real Q4_K_M-style GGUF files of every architecture the reader knows, written once per test session."""

from __future__ import annotations

import pytest

from strata_core.models.gguf import q4_k_m_down_types, write_moe_gguf

#: arch -> write_moe_gguf arguments: the expert types of the files people run (Q4_K_M with llama.cpp's per-layer
#: Q6_K/Q4_K down rows, Q5_K_M, Q6_K, MXFP4), each architecture's extras included (shared experts, dense blocks,
#: biases). hidden and ffn 256: one K super-block a row, small enough for seconds per run on two cores.
FILES = {
    "qwen3moe": dict(layers=3, gate_up="q4_k", down=q4_k_m_down_types(3)),
    "qwen2moe": dict(layers=2, gate_up="q4_k", down="q6_k"),
    "llama": dict(layers=2, gate_up="q5_k", down="q6_k"),
    "deepseek2": dict(layers=2, gate_up="q4_k", down="q6_k"),
    "gpt-oss": dict(layers=2, gate_up="mxfp4", down="mxfp4", embed_type="q8_0", head_type="q8_0"),
    "olmoe": dict(layers=2, gate_up="q6_k", down="q6_k", embed_type="q6_k"),
}


@pytest.fixture(scope="session")
def gguf_files(tmp_path_factory) -> dict:
    """arch -> path of its test file (8 experts, top 2, hidden 256, expert FFN 256, vocab 64)."""
    d = tmp_path_factory.mktemp("quant_gguf")
    return {arch: write_moe_gguf(d / f"{arch}.gguf", arch=arch, seed=i, **kw)
            for i, (arch, kw) in enumerate(FILES.items())}
