"""strata_core.reference.quants against gguf-py: layouts, bit-exact dequantize, quantizer quality, the tiled matmul."""

from __future__ import annotations

import ast
import inspect
import sys
import time

import numpy as np
import pytest

from strata_core.reference import quants as Q

gguf_quants = pytest.importorskip("gguf.quants")
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402

QUANTIZED = ("q8_0", "q4_k", "q5_k", "q6_k", "mxfp4")
ALL = tuple(Q.FORMATS)
#: Byte offsets of the f16 fields of each block: random bytes there are made finite, the rest stays random.
F16_FIELDS = {"q8_0": (0,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "mxfp4": ()}
#: Relative RMS error bounds of quantize -> dequantize on gaussian weights. Measured over 6 seeds of 64x1024
#: (sigma 1 and 0.02): q8_0 0.00533-0.00539, q4_k 0.0725-0.0735, q5_k 0.0362-0.0366, q6_k 0.0176-0.0178,
#: mxfp4 0.1136-0.1156, f16 0.00021, bf16 0.00167; each bound is about 1.1x the worst of those.
RMS_BOUND = {"q8_0": 0.0060, "q4_k": 0.080, "q5_k": 0.040, "q6_k": 0.020, "mxfp4": 0.125, "f16": 0.00025,
             "bf16": 0.0019, "f32": 0.0}


def _gguf_type(fmt: str) -> GGMLQuantizationType:
    return GGMLQuantizationType[fmt.upper()]


def _gguf_dequantize(fmt: str, raw: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # mxfp4's e = 255 is infinite in gguf as well
        return gguf_quants.dequantize(raw, _gguf_type(fmt))


def _assert_bits_equal(a: np.ndarray, b: np.ndarray) -> None:
    # bitwise, so that -0.0 against 0.0 and NaN payloads count too
    assert a.dtype == np.float32 and b.dtype == np.float32
    assert a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


def random_rows(rng: np.random.Generator, fmt: str, lead: tuple[int, ...], n: int) -> np.ndarray:
    """Random bytes [*lead, row_bytes] of `fmt` whose f16 scales are finite (any value, subnormals included)."""
    f = Q.FORMATS[fmt]
    raw = rng.integers(0, 256, (*lead, Q.row_bytes(fmt, n)), dtype=np.uint8)
    blocks = raw.reshape(-1, f.block_bytes)
    for off in F16_FIELDS.get(fmt, ()):
        h = np.ascontiguousarray(blocks[:, off:off + 2]).view("<u2")
        h = np.where((h & 0x7C00) == 0x7C00, h ^ 0x4000, h).astype("<u2")   # exponent 31 -> 15
        blocks[:, off:off + 2] = h.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(raw.shape)


def gaussian(rng: np.random.Generator, shape: tuple[int, ...], sigma: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * sigma).astype(np.float32)


def _rel_rms(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(np.mean((a.astype(np.float64) - b) ** 2) / np.mean(b.astype(np.float64) ** 2)))


# --------------------------------------------------------------------------------------------------- layouts


@pytest.mark.parametrize("fmt", ALL)
def test_block_sizes_and_type_ids_are_ggmls(fmt):
    f = Q.FORMATS[fmt]
    assert f.name == fmt
    assert (f.block_weights, f.block_bytes) == GGML_QUANT_SIZES[_gguf_type(fmt)]
    assert Q.GGML_TYPES[fmt] == int(_gguf_type(fmt))
    assert Q.row_bytes(fmt, 6 * f.block_weights) == 6 * f.block_bytes
    assert Q.row_bytes(fmt.upper(), 0) == 0
    assert Q.get_format(f) is f


def test_quant_format_is_frozen():
    with pytest.raises(AttributeError):
        Q.FORMATS["q4_k"].block_bytes = 1


# ---------------------------------------------------------------------------------------- dequantize vs gguf

SHAPES = [((1,), 1), ((3,), 2), ((2, 3), 4), ((4, 1, 2), 1), ((), 3)]


@pytest.mark.parametrize("fmt", ALL)
@pytest.mark.parametrize("lead,blocks", SHAPES)
def test_dequantize_of_random_bytes_is_bit_exact_with_gguf(fmt, lead, blocks):
    rng = np.random.default_rng([Q.GGML_TYPES[fmt], blocks, len(lead)])
    n = blocks * Q.FORMATS[fmt].block_weights
    raw = random_rows(rng, fmt, lead, n)
    mine = Q.dequantize(fmt, raw, n)
    assert mine.shape == (*lead, n)
    _assert_bits_equal(mine, _gguf_dequantize(fmt, raw))


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_random_bytes_hit_every_code(fmt):
    # the exactness test above is only as strong as its inputs: make sure they cover every quant value
    rng = np.random.default_rng(7)
    n = 8 * Q.FORMATS[fmt].block_weights
    y = Q.dequantize(fmt, random_rows(rng, fmt, (64,), n), n)
    assert np.isfinite(y).mean() > 0.9 and len(np.unique(y)) > 1000


@pytest.mark.parametrize("fmt", ALL)
def test_dequantize_of_quantized_weights_is_bit_exact_with_gguf(fmt):
    rng = np.random.default_rng(Q.GGML_TYPES[fmt])
    n = 2 * max(Q.FORMATS[fmt].block_weights, 256)
    w = gaussian(rng, (2, 3, n), 0.05)
    w[0, 0] = -np.abs(w[0, 0])          # a row without a positive weight (the min of the K formats)
    w[0, 1] = 0                         # an all-zero row
    w[1, 2, :n // 2] *= 1e3             # one block far larger than its neighbour
    raw = Q.quantize(fmt, w)
    assert raw.dtype == np.uint8 and raw.shape == (2, 3, Q.row_bytes(fmt, n))
    mine = Q.dequantize(fmt, raw, n)
    _assert_bits_equal(mine, _gguf_dequantize(fmt, raw))
    assert np.all(mine[0, 1] == 0)


def test_dequantize_accepts_a_non_contiguous_view():
    rng = np.random.default_rng(3)
    raw = random_rows(rng, "q4_k", (6,), 512)
    view = raw[::2]
    _assert_bits_equal(Q.dequantize("q4_k", view, 512), _gguf_dequantize("q4_k", np.ascontiguousarray(view)))


# ---------------------------------------------------------------------------------------------- quantizers


@pytest.mark.parametrize("fmt", ALL)
@pytest.mark.parametrize("sigma", [1.0, 0.02])
def test_round_trip_error_is_bounded(fmt, sigma):
    rng = np.random.default_rng([Q.GGML_TYPES[fmt], int(sigma * 100)])
    w = gaussian(rng, (64, 1024), sigma)
    err = _rel_rms(Q.dequantize(fmt, Q.quantize(fmt, w), 1024), w)
    assert err <= RMS_BOUND[fmt], f"{fmt}: relative RMS error {err:.5f} > {RMS_BOUND[fmt]}"


@pytest.mark.parametrize("fmt", ["q8_0", "mxfp4", "bf16", "f16"])
def test_quantizers_gguf_has_give_its_bytes(fmt):
    # gguf quantizes these like ggml's reference; the K formats it only reads
    rng = np.random.default_rng(11)
    w = gaussian(rng, (16, 512))
    w[3, 64:96] = 0
    np.testing.assert_array_equal(Q.quantize(fmt, w), gguf_quants.quantize(w, _gguf_type(fmt)).view(np.uint8)
                                  .reshape(16, -1))


@pytest.mark.parametrize("fmt", ["q4_k", "q5_k", "q6_k"])
def test_k_quantizers_beat_their_simplest_form(fmt, monkeypatch):
    # the grid search must pay for itself against one grid over [min, max] (a regression guard on the search)
    rng = np.random.default_rng(5)
    w = gaussian(rng, (32, 1024))
    err = _rel_rms(Q.dequantize(fmt, Q.quantize(fmt, w), 1024), w)
    if fmt == "q6_k":
        fit = Q._fit_symmetric
        monkeypatch.setattr(Q, "_fit_symmetric", lambda x, deltas: fit(x, (0.0,)))
    else:
        fit = Q._fit_scale_min
        monkeypatch.setattr(Q, "_fit_scale_min", lambda x, nmax, deltas: fit(x, nmax, (0.0,)))
    assert err < _rel_rms(Q.dequantize(fmt, Q.quantize(fmt, w), 1024), w)


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_quantize_of_a_2048x768_matrix_is_fast(fmt):
    w = gaussian(np.random.default_rng(0), (2048, 768), 0.02)
    best = min(_timed(lambda: Q.quantize(fmt, w)) for _ in range(2))
    # measured 0.03-0.21 s on a shared 2-core machine; a per-block Python loop takes minutes
    assert best < 1.0, f"{fmt}: {best:.2f} s"


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def test_quantize_keeps_large_scales_finite():
    w = np.full((1, 256), 3e9, dtype=np.float32)
    for fmt in ("q4_k", "q5_k", "q6_k", "q8_0"):
        assert np.all(np.isfinite(Q.dequantize(fmt, Q.quantize(fmt, w), 256))), fmt


# --------------------------------------------------------------------------------------------------- matmul


@pytest.mark.parametrize("fmt", ALL)
@pytest.mark.parametrize("tile_rows", [1, 7, 64, 1000])
def test_matmul_quant_is_x_times_the_dequantized_transpose(fmt, tile_rows):
    rng = np.random.default_rng([Q.GGML_TYPES[fmt], tile_rows])
    n, o = 512, 130
    raw = Q.quantize(fmt, gaussian(rng, (o, n), 0.05))
    x = gaussian(rng, (5, n))
    got = Q.matmul_quant(x, raw, fmt, n, tile_rows=tile_rows)
    want = x @ Q.dequantize(fmt, raw, n).T
    assert got.dtype == np.float32 and got.shape == (5, o)
    assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want)


def test_matmul_quant_with_no_tokens_or_no_rows():
    raw = Q.quantize("q8_0", np.ones((3, 64), np.float32))
    assert Q.matmul_quant(np.zeros((0, 64), np.float32), raw, "q8_0", 64).shape == (0, 3)
    assert Q.matmul_quant(np.ones((2, 64), np.float32), raw[:0], "q8_0", 64).shape == (2, 0)


# ---------------------------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_a_row_that_is_not_whole_blocks_is_refused_naming_the_format_and_block(fmt):
    bw = Q.FORMATS[fmt].block_weights
    n = bw + bw // 2
    pattern = rf"^{fmt}: {n} weights per row is not a multiple of its block size {bw}$"
    with pytest.raises(ValueError, match=pattern):
        Q.row_bytes(fmt, n)
    with pytest.raises(ValueError, match=pattern):
        Q.quantize(fmt, np.zeros((2, n), np.float32))
    with pytest.raises(ValueError, match=pattern):
        Q.dequantize(fmt, np.zeros((2, 100), np.uint8), n)
    with pytest.raises(ValueError, match=pattern):
        Q.matmul_quant(np.zeros((1, n), np.float32), np.zeros((2, 100), np.uint8), fmt, n)


def test_raw_bytes_of_the_wrong_size_or_dtype_are_refused():
    n = 256
    with pytest.raises(ValueError, match=r"^q6_k: raw must be uint8 \[\.\.\., 210\]"):
        Q.dequantize("q6_k", np.zeros((2, 209), np.uint8), n)
    with pytest.raises(ValueError, match=r"^q6_k: raw must be uint8"):
        Q.dequantize("q6_k", np.zeros((2, 210), np.int8), n)
    with pytest.raises(ValueError, match=r"^q4_k: x must be \[T, 256\]"):
        Q.matmul_quant(np.zeros((1, 255), np.float32), np.zeros((1, 144), np.uint8), "q4_k", n)
    with pytest.raises(ValueError, match=r"^q4_k: raw must be \[O, 144\]"):
        Q.matmul_quant(np.zeros((1, 256), np.float32), np.zeros((1, 143), np.uint8), "q4_k", n)


def test_unknown_formats_and_non_finite_weights_are_refused():
    with pytest.raises(ValueError, match=r"unknown quant format 'q4_0'"):
        Q.row_bytes("q4_0", 32)
    w = np.zeros((1, 256), np.float32)
    w[0, 3] = np.nan
    with pytest.raises(ValueError, match=r"^q4_k: weights must be finite"):
        Q.quantize("q4_k", w)


def test_the_module_imports_only_numpy_and_the_standard_library():
    tree = ast.parse(inspect.getsource(Q))
    roots = {a.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    roots |= {node.module.split(".")[0] for node in ast.walk(tree)
              if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
    assert roots - {"numpy"} <= set(sys.stdlib_module_names) | {"__future__"}
