"""quant_fast.cu's super-block dequantization (strata_qf_dequant_sb: a warp per 256 weights, both matrices of a group
of experts in one launch; QuantMoE's warm prefill, issue 14 item 5) and its fixed-format forms
(strata_qf_dequant_sbt_<a>_<b>) built for the host by g++ (the fiber shim of test_quant_cuda_host.py) and checked bit
for bit against numpy's float16 of the oracle's weights."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import numpy as np
import pytest
from host_build import build_host_library, pointer
from test_quant_cuda_host import FAST_SHIM

from strata_core.reference import quants
from strata_core.reference.quants import GGML_TYPES

CUDA_DIR = Path(__file__).resolve().parents[2] / "backends" / "cuda" / "strata_cuda"

SB_WRAPPERS = r"""
extern "C" {
void host_dequant_sb(unsigned gx, const unsigned char* blob, long long sb, const int* slots, int m, long long off_a,
                     long long rb_a, int rows_a, int cols_a, int fmt_a, void* out_a, long long off_b, long long rb_b,
                     int rows_b, int cols_b, int fmt_b, void* out_b) {
    qf_launch(gx, m, [&] { strata_qf_dequant_sb(blob, sb, slots, m, off_a, rb_a, rows_a, cols_a, fmt_a,
                                                (uint4*)out_a, off_b, rb_b, rows_b, cols_b, fmt_b, (uint4*)out_b); });
}
}
"""


#: quant_ffn.SBT_PAIRS (read from the source's entry points, so the test needs no cupy)
SBT_PAIRS = sorted(set(re.findall(r"QF_SBT_KERNEL\(strata_qf_dequant_sbt_(q\d_[k0])_(q\d_[k0]),",
                                  (CUDA_DIR / "quant_fast.cu").read_text())))

SBT_WRAPPERS = "".join(f"""
extern "C" void host_dequant_{v}_{a}_{b}(unsigned gx, const unsigned char* blob, long long sb, const int* slots, int m,
        long long off_a, long long rb_a, int rows_a, int cols_a, void* out_a, long long off_b, long long rb_b,
        int rows_b, int cols_b, void* out_b) {{
    qf_launch(gx, m, [&] {{ strata_qf_dequant_{v}_{a}_{b}(blob, sb, slots, m, off_a, rb_a, rows_a, cols_a, (uint4*)out_a,
                                                   off_b, rb_b, rows_b, cols_b, (uint4*)out_b); }});
}}
""" for v, a, b in [("sbt", a, b) for a, b in SBT_PAIRS])


@pytest.fixture(scope="module")
def sb_lib(tmp_path_factory):
    """quant_fast.cu built for the host with the super-block kernels' wrappers."""
    text = FAST_SHIM + (CUDA_DIR / "quant_fast.cu").read_text() + SB_WRAPPERS + SBT_WRAPPERS
    return build_host_library(tmp_path_factory, "quant_fast_sb_host", text, CUDA_DIR,
                              includes=[CUDA_DIR / "quants.cuh"])


def _matrix(rng, fmt: str, m: int, rows: int, cols: int) -> np.ndarray:
    """m quantized [rows, cols] matrices of fmt, some weights tiny (f16 subnormals and zeros)."""
    w = rng.standard_normal((m, rows, cols)).astype(np.float32) * np.float32(0.05)
    w[1 % m, 1, :40] *= np.float32(1e-6)
    return quants.quantize(fmt, w)


@pytest.mark.parametrize("gx", [1, 3], ids=["one_block", "three_blocks"])
@pytest.mark.parametrize("pad", [0, 2, 3], ids=["aligned", "pad2", "pad3"])
@pytest.mark.parametrize("fmt_a,fmt_b", [("q4_k", "q6_k"), ("q5_k", "q8_0"), ("q6_k", "q4_k"), ("q8_0", "q5_k")])
def test_super_block_dequantization_is_the_f16_of_the_oracle_bit_for_bit(sb_lib, fmt_a, fmt_b, pad, gx):
    """Both matrices of every slot of an out-of-order table, in one launch, equal numpy's float16 of
    quants.dequantize bit for bit: 16-aligned slots and slots 2 and 3 bytes off (the funnel-shifted loads), one block
    (each warp takes many rows) and three (grid-stride past the last row); rows of 9 and 1 super-blocks (a pass's
    second super-block past the row's end)."""
    rng = np.random.default_rng(11)
    m, rows_a, cols_a, rows_b, cols_b = 3, 5, 9 * 256, 7, 256
    qa, qb = _matrix(rng, fmt_a, m, rows_a, cols_a), _matrix(rng, fmt_b, m, rows_b, cols_b)
    rb_a, rb_b = qa.shape[-1], qb.shape[-1]
    off_a, off_b = pad, pad + rows_a * rb_a + 5  # down's rows start at an odd offset after gate|up's
    sb = off_b + rows_b * rb_b + 9
    blob = np.zeros(pad + m * sb + 64, np.uint8)[pad:][:m * sb].reshape(m, sb)
    blob[:, off_a:off_a + rows_a * rb_a] = qa.reshape(m, -1)
    blob[:, off_b:off_b + rows_b * rb_b] = qb.reshape(m, -1)
    slots = np.array([2, 0, 1], np.int32)
    out_a = np.full((m, rows_a, cols_a), 0x7e00, np.uint16)  # poisoned: every element must be written
    out_b = np.full((m, rows_b, cols_b), 0x7e00, np.uint16)
    ll, i32 = ctypes.c_longlong, ctypes.c_int
    sb_lib.host_dequant_sb(
        ctypes.c_uint(gx), pointer(blob), ll(sb), pointer(slots), i32(m), ll(off_a), ll(rb_a), i32(rows_a), i32(cols_a),
        i32(GGML_TYPES[fmt_a]), pointer(out_a), ll(off_b), ll(rb_b), i32(rows_b), i32(cols_b), i32(GGML_TYPES[fmt_b]),
        pointer(out_b))
    for fmt, q, out, cols in ((fmt_a, qa, out_a, cols_a), (fmt_b, qb, out_b, cols_b)):
        want = quants.dequantize(fmt, q[slots], cols).astype(np.float16).view(np.uint16)
        mism = int(np.count_nonzero(out != want))
        assert mism == 0, f"{fmt}: {mism} of {out.size} f16 weights differ"


def test_one_matrix_leaves_the_other_output_alone(sb_lib):
    """rows_b 0: only matrix a is written (the pieces path and single-matrix callers)."""
    rng = np.random.default_rng(3)
    m, rows, cols = 2, 3, 256
    q = _matrix(rng, "q4_k", m, rows, cols)
    rb = q.shape[-1]
    blob = np.ascontiguousarray(q.reshape(m, -1))
    slots = np.array([1, 0], np.int32)
    out = np.full((m, rows, cols), 0x7e00, np.uint16)
    other = np.full(64, 0x1234, np.uint16)
    ll, i32 = ctypes.c_longlong, ctypes.c_int
    sb_lib.host_dequant_sb(ctypes.c_uint(2), pointer(blob), ll(blob.shape[1]), pointer(slots), i32(m), ll(0), ll(rb), i32(rows),
                           i32(cols), i32(GGML_TYPES["q4_k"]), pointer(out), ll(0), ll(0), i32(0), i32(256),
                           i32(GGML_TYPES["q6_k"]), pointer(other))
    assert np.array_equal(out, quants.dequantize("q4_k", q[slots], cols).astype(np.float16).view(np.uint16))
    assert np.all(other == 0x1234)


def test_the_format_pairs_are_quant_ffns():
    """The entry points the source compiles are the pairs quant_ffn dispatches to (a pair named in one and not the
    other would fall back, or fail to launch)."""
    from strata_cuda.quant_ffn import SBT_PAIRS as FFN_PAIRS
    assert SBT_PAIRS == sorted(FFN_PAIRS) and len(SBT_PAIRS) == 6


@pytest.mark.parametrize("pad", [0, 3], ids=["aligned", "pad3"])
@pytest.mark.parametrize("kernel,fmt_a,fmt_b", [("sbt", a, b) for a, b in SBT_PAIRS])
def test_the_fixed_format_kernels_are_the_f16_of_the_oracle_bit_for_bit(sb_lib, kernel, fmt_a, fmt_b, pad):
    """strata_qf_dequant_sbt_<a>_<b> (the formats template arguments) equal numpy's float16 of quants.dequantize bit
    for bit: both matrices of an out-of-order table, rows of 9 and 1 super-blocks (a last pass of one), slots off a
    16-byte boundary."""
    rng = np.random.default_rng(5)
    m, rows_a, cols_a, rows_b, cols_b = 3, 6, 9 * 256, 5, 256
    qa, qb = _matrix(rng, fmt_a, m, rows_a, cols_a), _matrix(rng, fmt_b, m, rows_b, cols_b)
    rb_a, rb_b = qa.shape[-1], qb.shape[-1]
    off_a, off_b = pad, pad + rows_a * rb_a + 7
    sb = off_b + rows_b * rb_b + 3
    blob = np.zeros(pad + m * sb + 64, np.uint8)[pad:][:m * sb].reshape(m, sb)
    blob[:, off_a:off_a + rows_a * rb_a] = qa.reshape(m, -1)
    blob[:, off_b:off_b + rows_b * rb_b] = qb.reshape(m, -1)
    slots = np.array([1, 2, 0], np.int32)
    out_a = np.full((m, rows_a, cols_a), 0x7e00, np.uint16)
    out_b = np.full((m, rows_b, cols_b), 0x7e00, np.uint16)
    ll, i32 = ctypes.c_longlong, ctypes.c_int
    getattr(sb_lib, f"host_dequant_{kernel}_{fmt_a}_{fmt_b}")(
        ctypes.c_uint(2), pointer(blob), ll(sb), pointer(slots), i32(m), ll(off_a), ll(rb_a), i32(rows_a), i32(cols_a),
        pointer(out_a), ll(off_b), ll(rb_b), i32(rows_b), i32(cols_b), pointer(out_b))
    for fmt, q, out, cols in ((fmt_a, qa, out_a, cols_a), (fmt_b, qb, out_b, cols_b)):
        want = quants.dequantize(fmt, q[slots], cols).astype(np.float16).view(np.uint16)
        assert int(np.count_nonzero(out != want)) == 0, fmt
