"""The numpy oracle for ggml's GGUF weight formats of MoE models: block layouts, dequantize, quantize, matmul.

Layouts are ggml's (ggml-common.h), little-endian, one row of n weights = n / block_weights blocks back to back:
- q8_0  (32 w,  34 B): f16 d, int8 qs[32];                       w = d * q
- q4_k (256 w, 144 B): f16 d, f16 dmin, scales[12], qs[128];      w = d*sc[s] * q - dmin*m[s], q in 0..15
- q5_k (256 w, 176 B): f16 d, f16 dmin, scales[12], qh[32], qs[128]; as q4_k with a 5th bit, q in 0..31
- q6_k (256 w, 210 B): ql[128], qh[64], int8 scales[16], f16 d;   w = d*sc[s] * (q - 32), q in 0..63
- mxfp4 (32 w,  17 B): e8m0 e, qs[16] e2m1 nibbles;               w = e2m1[q] * 2^(e - 127)
q4_k/q5_k: 8 sub-blocks of 32, each with a 6-bit scale sc and a 6-bit min m packed into 12 bytes (sub-blocks 0-3
in the low 6 bits of bytes 0-3 and 4-7, sub-blocks 4-7 split over the nibbles of bytes 8-11 and the top 2 bits of
bytes 0-7). A 64-weight chunk c takes 32 bytes of qs: low nibbles are sub-block 2c, high nibbles sub-block 2c+1.
q6_k: two halves of 128; in half h weights 32g+l (g 0..3) take the low (g<2) or high (g>=2) nibble of
ql[64h + 32(g&1) + l] and bits 2g..2g+1 of qh[32h + l]; 16 sub-blocks of 16 weights each have an int8 scale.
mxfp4: weight j < 16 is the low nibble of qs[j], weight j >= 16 the high nibble of qs[j-16].

dequantize is bit-exact with gguf-py's gguf.quants.dequantize (the same float32 operations in the same order).
Only numpy and the standard library are imported.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["QuantFormat", "FORMATS", "GGML_TYPES", "QK_K", "get_format", "row_bytes", "dequantize", "quantize",
           "matmul_quant"]

#: Weights per super-block of the K formats.
QK_K = 256
_F32 = np.float32
_F16 = np.dtype("<f2")


@dataclass(frozen=True)
class QuantFormat:
    """A ggml weight format: `block_weights` weights stored in `block_bytes` bytes."""

    name: str
    block_weights: int
    block_bytes: int


FORMATS: dict[str, QuantFormat] = {f.name: f for f in (
    QuantFormat("f32", 1, 4),
    QuantFormat("f16", 1, 2),
    QuantFormat("bf16", 1, 2),
    QuantFormat("q8_0", 32, 34),
    QuantFormat("q4_k", QK_K, 144),
    QuantFormat("q5_k", QK_K, 176),
    QuantFormat("q6_k", QK_K, 210),
    QuantFormat("mxfp4", 32, 17),
)}

#: ggml's type ids (enum ggml_type, GGMLQuantizationType); the kernel sources take these as their `fmt` argument.
GGML_TYPES: dict[str, int] = {"f32": 0, "f16": 1, "q8_0": 8, "q4_k": 12, "q5_k": 13, "q6_k": 14, "bf16": 30,
                              "mxfp4": 39}

#: e2m1 values doubled (ggml's kvalues_mxfp4), so that the half-scale of e8m0 makes them exact.
_E2M1_X2 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8).astype(_F32)
#: Midpoints between the non-negative doubled e2m1 magnitudes, for nearest-value search.
_E2M1_MID = np.array([0.5, 1.5, 2.5, 3.5, 5.0, 7.0, 10.0], dtype=_F32)


def get_format(fmt: str | QuantFormat) -> QuantFormat:
    """The QuantFormat named `fmt` (any case) or `fmt` itself; ValueError for an unknown name."""
    if isinstance(fmt, QuantFormat):
        return fmt
    f = FORMATS.get(str(fmt).lower())
    if f is None:
        raise ValueError(f"unknown quant format {fmt!r} (known: {', '.join(FORMATS)})")
    return f


def row_bytes(fmt: str | QuantFormat, n_weights: int) -> int:
    """Bytes of one row of `n_weights` weights in `fmt`; ValueError when n is not a whole number of blocks."""
    f = get_format(fmt)
    n = int(n_weights)
    if n < 0 or n % f.block_weights:
        raise ValueError(f"{f.name}: {n} weights per row is not a multiple of its block size {f.block_weights}")
    return n // f.block_weights * f.block_bytes


# ------------------------------------------------------------------------------------------------- dequantize


def _f16_at(b: np.ndarray, off: int) -> np.ndarray:
    """The f16 at byte `off` of every block of b [B, block_bytes], as float32 [B]."""
    return np.ascontiguousarray(b[:, off:off + 2]).view(_F16)[:, 0].astype(_F32)


def _unpack_k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 packed bytes of q4_k/q5_k [B, 12] -> (scales, mins), each [B, 8] uint8 in 0..63."""
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo & 63, (hi & 15) | ((lo >> 6) << 4)], axis=1)
    mn = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return sc, mn


def _dq_f32(b: np.ndarray) -> np.ndarray:
    return b.view("<f4").astype(_F32)


def _dq_f16(b: np.ndarray) -> np.ndarray:
    return b.view(_F16).astype(_F32)


def _dq_bf16(b: np.ndarray) -> np.ndarray:
    return (b.view("<u2").astype(np.uint32) << np.uint32(16)).view(_F32)


def _dq_q8_0(b: np.ndarray) -> np.ndarray:
    d = _f16_at(b, 0)
    return b[:, 2:].view(np.int8).astype(_F32) * d[:, None]


def _k_affine(b: np.ndarray, q: np.ndarray) -> np.ndarray:
    """(d*sc) * q - dmin*m of q4_k/q5_k for the quants q [B, 8, 32] (as float32), in gguf's operation order."""
    sc, mn = _unpack_k_scales(b[:, 4:16])
    scale = _f16_at(b, 0)[:, None] * sc.astype(_F32)
    minv = _f16_at(b, 2)[:, None] * mn.astype(_F32)
    return (scale[:, :, None] * q.astype(_F32) - minv[:, :, None]).reshape(len(b), QK_K)


def _nibbles_k(qs: np.ndarray) -> np.ndarray:
    """qs [B, 128] of q4_k/q5_k -> the low 4 bits of every weight [B, 8, 32] (low nibbles first per 32 bytes)."""
    qs = qs.reshape(len(qs), 4, 1, 32)
    return np.concatenate([qs & 15, qs >> 4], axis=2).reshape(len(qs), 8, 32)


def _dq_q4_k(b: np.ndarray) -> np.ndarray:
    return _k_affine(b, _nibbles_k(b[:, 16:144]))


_BIT_OF_SUB = np.arange(8, dtype=np.uint8)[None, :, None]


def _dq_q5_k(b: np.ndarray) -> np.ndarray:
    high = (b[:, None, 16:48] >> _BIT_OF_SUB) & 1
    return _k_affine(b, _nibbles_k(b[:, 48:176]) | (high << 4))


_Q6_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]


def _dq_q6_k(b: np.ndarray) -> np.ndarray:
    n = len(b)
    ql = b[:, 0:128].reshape(n, 2, 2, 32)           # [half, which 32 bytes, l]
    low = np.stack([ql & 15, ql >> 4], axis=2).reshape(n, 2, 4, 32)   # group g = 2*nibble + which
    high = (b[:, None, 128:192].reshape(n, 2, 1, 32) >> _Q6_SHIFTS) & 3
    q = (low | (high << 4)).view(np.int8) - np.int8(32)
    scale = _f16_at(b, 208)[:, None] * b[:, 192:208].view(np.int8).astype(_F32)
    return (scale[:, :, None] * q.reshape(n, 16, 16).astype(_F32)).reshape(n, QK_K)


def _e8m0_half(e: np.ndarray) -> np.ndarray:
    """ggml's e8m0 -> float32 at half scale, 2^(e-128); e 0 and 1 give the subnormals 2^-128 and 2^-127."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(_F32)


def _dq_mxfp4(b: np.ndarray) -> np.ndarray:
    qs = b[:, 1:17]
    nib = np.concatenate([qs & 15, qs >> 4], axis=1)
    # e = 255 with |q| >= 4 is infinite in ggml too: that is the format's value, not a fault to warn about
    with np.errstate(over="ignore"):
        return _E2M1_X2[nib] * _e8m0_half(b[:, 0])[:, None]


_DEQUANT = {"f32": _dq_f32, "f16": _dq_f16, "bf16": _dq_bf16, "q8_0": _dq_q8_0, "q4_k": _dq_q4_k,
            "q5_k": _dq_q5_k, "q6_k": _dq_q6_k, "mxfp4": _dq_mxfp4}


def dequantize(fmt: str | QuantFormat, raw: np.ndarray, n_weights_per_row: int) -> np.ndarray:
    """uint8 rows [..., row_bytes] of `fmt` -> float32 weights [..., n], bit-exact with gguf-py's dequantize."""
    f = get_format(fmt)
    rb = row_bytes(f, n_weights_per_row)
    raw = np.asarray(raw)
    if raw.dtype != np.uint8 or raw.ndim < 1 or raw.shape[-1] != rb:
        raise ValueError(f"{f.name}: raw must be uint8 [..., {rb}] for {n_weights_per_row} weights per row, "
                         f"got {raw.dtype} {raw.shape}")
    blocks = np.ascontiguousarray(raw).reshape(-1, f.block_bytes)
    return _DEQUANT[f.name](blocks).reshape(*raw.shape[:-1], int(n_weights_per_row))


# --------------------------------------------------------------------------------------------------- quantize


def _round_half_away(v: np.ndarray) -> np.ndarray:
    """roundf: halves away from zero (ggml's q8_0 reference), exact for every float32."""
    a = np.abs(v)
    f = np.floor(a)
    # a - f is exact, so this never rounds 0.49999997 up the way floor(a + 0.5) would
    return np.copysign(f + (a - f >= 0.5), v)


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    """float [B] -> the little-endian bytes of its f16 [B, 2], clipped to f16's finite range."""
    return np.clip(v, -65504.0, 65504.0).astype(_F16).view(np.uint8).reshape(-1, 2)


def _as_f16(v: np.ndarray) -> np.ndarray:
    return np.clip(v, -65504.0, 65504.0).astype(_F16).astype(_F32)


def _q_f32(x: np.ndarray) -> np.ndarray:
    return x.astype("<f4").view(np.uint8).reshape(len(x), 4)


def _q_f16(x: np.ndarray) -> np.ndarray:
    return x.astype(_F16).view(np.uint8).reshape(len(x), 2)


def _q_bf16(x: np.ndarray) -> np.ndarray:
    u = x.view(np.uint32).astype(np.uint64)
    rne = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    # a NaN stays a NaN (quieted) instead of rounding into infinity
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    h = np.where(nan, (u >> 16) | 0x40, rne).astype("<u2")
    return h.view(np.uint8).reshape(len(x), 2)


def _q_q8_0(x: np.ndarray) -> np.ndarray:
    # ggml's quantize_row_q8_0_ref: the quants use the f32 scale, the block stores its f16
    d = np.abs(x).max(axis=1) / _F32(127)
    inv = np.divide(_F32(1), d, out=np.zeros_like(d), where=d > 0)
    q = _round_half_away(x * inv[:, None]).astype(np.int8)
    return np.concatenate([_f16_bytes(d), q.view(np.uint8)], axis=1)


def _q_mxfp4(x: np.ndarray) -> np.ndarray:
    amax = np.abs(x).max(axis=1)
    # ggml: e = floor(log2(amax)) - 2 + 127; frexp gives floor(log2) exactly where a float32 log2 can round up
    _, ex = np.frexp(amax)
    e = np.where(amax > 0, np.clip(ex.astype(np.int32) + 124, 0, 255), 0).astype(np.uint8)
    t = np.abs(x) / _e8m0_half(e)[:, None]          # exact: the scale is a power of two
    mag = np.searchsorted(_E2M1_MID, t, side="left").astype(np.uint8)   # ties go to the smaller magnitude
    nib = mag | np.where((x < 0) & (mag > 0), np.uint8(8), np.uint8(0))
    return np.concatenate([e[:, None], nib[:, :16] | (nib[:, 16:] << 4)], axis=1)


def _fit_scale_min(x: np.ndarray, nmax: int, deltas: tuple[float, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Per sub-block x [S, m]: (scale >= 0, min >= 0) with x ~ scale*L - min, L in 0..nmax.

    ggml's make_qkx2_quants, with fewer candidate grids: each candidate rounds x on a grid of nmax+delta steps over
    [min(x, 0), max(x)] and refits scale and min by weighted least squares (weights rms(x) + |x|, as ggml's
    reference), keeping the candidate of least weighted error.
    """
    # fit on x / max|x| so that the weighted sums stay in float32's range whatever the weights' magnitude
    unit = np.abs(x).max(axis=1)
    unit = np.where(unit > 0, unit, 1)
    x = x / unit[:, None]
    w = np.sqrt(np.mean(x * x, axis=1, keepdims=True)) + np.abs(x)
    lo = np.minimum(x.min(axis=1), 0)
    span = x.max(axis=1) - lo
    ok = span > 0
    span_safe = np.where(ok, span, 1)
    sw, swx = w.sum(axis=1), (w * x).sum(axis=1)
    best_scale, best_min = span / nmax, lo
    best_err = np.full(len(x), np.inf, dtype=_F32)
    for delta in deltas:
        inv = (nmax + delta) / span_safe
        L = np.clip(np.rint(inv[:, None] * (x - lo[:, None])), 0, nmax)
        wL = w * L
        sl, sl2, sxl = wL.sum(axis=1), (wL * L).sum(axis=1), (wL * x).sum(axis=1)
        det = sw * sl2 - sl * sl
        good = ok & (det > 0)
        det = np.where(good, det, 1)
        scale = (sw * sxl - swx * sl) / det
        mn = (sl2 * swx - sl * sxl) / det
        # the min is only ever subtracted: a positive offset refits as a pure scale
        pos = mn > 0
        scale = np.where(pos, sxl / np.where(sl2 > 0, sl2, 1), scale)
        mn = np.where(pos, 0, mn)
        err = (w * (scale[:, None] * L + mn[:, None] - x) ** 2).sum(axis=1)
        take = good & (err < best_err)
        best_err = np.where(take, err, best_err)
        best_scale = np.where(take, scale, best_scale)
        best_min = np.where(take, mn, best_min)
    return np.maximum(best_scale, 0) * unit, np.maximum(-best_min, 0) * unit


def _k_block_params(x: np.ndarray, nmax: int) -> tuple[np.ndarray, ...]:
    """q4_k/q5_k blocks x [B, 8, 32] -> (d bytes, dmin bytes, packed scales [B,12], quants [B,8,32] in 0..nmax)."""
    nb = len(x)
    scale, mn = _fit_scale_min(x.reshape(nb * 8, 32), nmax, (-0.5, 0.0, 0.5, 1.0))
    scale, mn = scale.reshape(nb, 8), mn.reshape(nb, 8)
    d, dmin = _as_f16(scale.max(axis=1) / 63), _as_f16(mn.max(axis=1) / 63)
    # sub-block scales are rounded against the stored f16 super-scales, not the unrounded ones
    ls = np.clip(np.rint(np.divide(scale, d[:, None], out=np.zeros_like(scale), where=d[:, None] > 0)), 0, 63)
    lm = np.clip(np.rint(np.divide(mn, dmin[:, None], out=np.zeros_like(mn), where=dmin[:, None] > 0)), 0, 63)
    ls, lm = ls.astype(np.uint8), lm.astype(np.uint8)
    step = d[:, None] * ls.astype(_F32)
    off = dmin[:, None] * lm.astype(_F32)
    num = x + off[:, :, None]
    q = np.divide(num, step[:, :, None], out=np.zeros_like(num), where=step[:, :, None] > 0)
    q = np.clip(np.rint(q), 0, nmax).astype(np.uint8)
    packed = np.concatenate([ls[:, :4] | ((ls[:, 4:] >> 4) << 6), lm[:, :4] | ((lm[:, 4:] >> 4) << 6),
                             (ls[:, 4:] & 15) | ((lm[:, 4:] & 15) << 4)], axis=1)
    return _f16_bytes(d), _f16_bytes(dmin), packed, q


def _pack_nibbles_k(q: np.ndarray) -> np.ndarray:
    """Low 4 bits of q [B, 8, 32] -> qs [B, 128] (sub-block 2c low nibbles, 2c+1 high nibbles)."""
    q = q & 15
    return (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(len(q), 128)


def _q_q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, q = _k_block_params(x.reshape(-1, 8, 32), 15)
    return np.concatenate([d, dmin, sc, _pack_nibbles_k(q)], axis=1)


def _q_q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, q = _k_block_params(x.reshape(-1, 8, 32), 31)
    qh = np.bitwise_or.reduce((q >> 4) << _BIT_OF_SUB, axis=1)
    return np.concatenate([d, dmin, sc, qh, _pack_nibbles_k(q)], axis=1)


def _fit_symmetric(x: np.ndarray, deltas: tuple[float, ...]) -> np.ndarray:
    """Per sub-block x [S, m]: the scale s (any sign) with x ~ s*L, L in -32..31.

    ggml's make_qx_quants (rmse_type 1): the value of largest magnitude maps to -(32 + delta) for a few deltas,
    each grid is refit by least squares weighted by x^2, and the best fit wins. The sign of s is chosen so that the
    largest magnitude takes the extra negative level.
    """
    vmax = np.take_along_axis(x, np.abs(x).argmax(axis=1)[:, None], axis=1)[:, 0]
    ok = vmax != 0
    # fit on x / |vmax| so that the x^2-weighted sums stay in float32's range whatever the weights' magnitude
    unit = np.where(ok, np.abs(vmax), 1)
    x, vmax = x / unit[:, None], vmax / unit
    vmax_safe = np.where(ok, vmax, 1)
    w = x * x
    best_score = np.full(len(x), -np.inf, dtype=_F32)
    best_scale = np.zeros(len(x), dtype=_F32)
    for delta in deltas:
        inv = -(32 + delta) / vmax_safe
        L = np.clip(np.rint(inv[:, None] * x), -32, 31)
        wL = w * L
        sxl, sl2 = (wL * x).sum(axis=1), (wL * L).sum(axis=1)
        sl2_safe = np.where(sl2 > 0, sl2, 1)
        # the weighted error at the least-squares scale falls as sxl^2 / sl2 rises
        score = np.where(sl2 > 0, sxl * sxl / sl2_safe, -np.inf)
        take = ok & (score > best_score)
        best_score = np.where(take, score, best_score)
        best_scale = np.where(take, sxl / sl2_safe, best_scale)
    return best_scale * unit


def _q_q6_k(x: np.ndarray) -> np.ndarray:
    nb = len(x)
    xs = x.reshape(nb, 16, 16)
    scale = _fit_symmetric(xs.reshape(nb * 16, 16), (-1.0, -0.5, 0.0, 0.5, 1.0)).reshape(nb, 16)
    smax = np.take_along_axis(scale, np.abs(scale).argmax(axis=1)[:, None], axis=1)[:, 0]
    # the largest sub-block scale maps to -128, the int8 level without a positive twin (ggml's choice)
    d = _as_f16(-smax / 128)
    sc = np.clip(np.rint(np.divide(scale, d[:, None], out=np.zeros_like(scale), where=d[:, None] != 0)), -128, 127)
    step = (d[:, None] * sc.astype(_F32))[:, :, None]
    q = np.divide(xs, step, out=np.zeros_like(xs), where=step != 0)
    q = (np.clip(np.rint(q), -32, 31) + 32).astype(np.uint8).reshape(nb, 2, 4, 32)
    low, high = q & 15, q >> 4
    ql = np.stack([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    return np.concatenate([ql.reshape(nb, 128), qh.reshape(nb, 64), sc.astype(np.int8).view(np.uint8),
                           _f16_bytes(d)], axis=1)


_QUANT = {"f32": _q_f32, "f16": _q_f16, "bf16": _q_bf16, "q8_0": _q_q8_0, "q4_k": _q_q4_k, "q5_k": _q_q5_k,
          "q6_k": _q_q6_k, "mxfp4": _q_mxfp4}


def quantize(fmt: str | QuantFormat, w: np.ndarray) -> np.ndarray:
    """float weights [..., n] -> uint8 rows [..., row_bytes] of `fmt` (ggml-style reference quantizers)."""
    f = get_format(fmt)
    w = np.asarray(w, dtype=_F32)
    if w.ndim < 1:
        raise ValueError(f"{f.name}: weights must have at least one axis, got a scalar")
    n = int(w.shape[-1])
    rb = row_bytes(f, n)
    if f.block_weights > 1 and not np.all(np.isfinite(w)):
        raise ValueError(f"{f.name}: weights must be finite to quantize")
    blocks = np.ascontiguousarray(w).reshape(-1, f.block_weights)
    return _QUANT[f.name](blocks).reshape(*w.shape[:-1], rb)


# ----------------------------------------------------------------------------------------------------- matmul


def matmul_quant(x: np.ndarray, raw: np.ndarray, fmt: str | QuantFormat, n: int, tile_rows: int = 64) -> np.ndarray:
    """x [T, n] f32 @ dequantize(raw [O, row_bytes]).T -> [T, O] f32, dequantizing `tile_rows` rows at a time."""
    f = get_format(fmt)
    rb = row_bytes(f, n)
    x = np.asarray(x, dtype=_F32)
    raw = np.asarray(raw)
    if x.ndim != 2 or x.shape[1] != n:
        raise ValueError(f"{f.name}: x must be [T, {n}], got {x.shape}")
    if raw.ndim != 2 or raw.shape[1] != rb:
        raise ValueError(f"{f.name}: raw must be [O, {rb}] for {n} weights per row, got {raw.shape}")
    if tile_rows < 1:
        raise ValueError(f"{f.name}: tile_rows must be at least 1, got {tile_rows}")
    out = np.empty((x.shape[0], raw.shape[0]), dtype=_F32)
    for o in range(0, raw.shape[0], tile_rows):
        out[:, o:o + tile_rows] = x @ dequantize(f, raw[o:o + tile_rows], n).T
    return out
