"""Grouped expert GEMMs in Triton that read their problem table on the device: FastMoE's gemm_mode "device".

One launch computes every routed expert's gate|up with the SwiGLU fused in (act = silu(x Wg^T) * (x Wu^T), f32 sums,
one f16 rounding), one more its down projection. Each program finds its expert from the routing counts themselves:
expert e owns ceil(count_e / BM) row tiles, the programs of a launch walk those tiles in expert order (a prefix sum
over the E counts in every program), and a program past the last tile returns at once. So neither launch needs the
counts on the host, no expert is padded to a size class, and a layer whose every expert is cached runs with no host
sync at all (fast.FastMoE._prefill_device).

Stacks and weights are FastMoE's: expert e's rows are rows row0[e] .. row0[e] + count[e] of the f16 stacks (the
device's strata_fast_offsets), its weights the f16 pool slot slot[e] (w_gate_up [2F,H], gate rows first; w_down
[H,F]). Triton compiles for the GPU it runs on (wgmma on Hopper). It needs torch too: Triton launches on torch's
current stream, which `launch` points at the caller's stream. Both are optional; `available()` says whether they
import, and FastMoE keeps its cuBLAS modes where they do not.

`expert_of_tile` is the programs' expert look-up in numpy and `tile_table` the tiles it must give (tests check one
against the other on the CPU, and the kernels against a float64 reference on the GPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

#: Row tile, column tile and K step of each launch, its warps and pipeline stages; the gate|up launch's column
#: tile is BN columns of gate and the same BN of up (two accumulators). bench/layer_h200.py times others (its
#: variant token t<BMxBNxBKxWARPSxSTAGES>+<down's>). On the H200 (Qwen3-30B-A3B layer, 4096 tokens) 128/128/64/8/3
#: with down 128/256/64/8/3 ran the warm layer in 0.927 ms uniform and 0.975 skewed, against 0.985 and 1.250 for the
#: cuBLAS classes; 4 stages 0.920 / 0.969, BK 32 1.017 / 1.065, BM 64 1.216 / 1.228 (bench/results/lead_h200_s7/
#: call2_layer_h200.json; call 1 there, on a slower host, ranked them alike).
DEFAULT_CONFIG = (128, 128, 64, 8, 3)
DOWN_CONFIG = (128, 256, 64, 8, 3)


@dataclass(frozen=True)
class TileConfig:
    """One launch's tiling: rows BM, columns BN, K step BK, warps, software-pipeline stages."""

    bm: int
    bn: int
    bk: int
    warps: int
    stages: int

    @classmethod
    def parse(cls, text: str | tuple | None, default: tuple) -> "TileConfig":
        """From "BM:BN:BK:warps:stages" (or a tuple; None: the default)."""
        if text is None:
            return cls(*default)
        if isinstance(text, TileConfig):
            return text
        vals = tuple(int(v) for v in (text.split(":") if isinstance(text, str) else text))
        if len(vals) != 5 or min(vals) <= 0:
            raise ValueError(f"a Triton tile config is BM:BN:BK:warps:stages, not {text!r}")
        return cls(*vals)


def fitted(hidden: int, ffn: int) -> tuple[TileConfig, TileConfig] | None:
    """The default configs with column tiles and K steps halved until they divide the shape (at least 16), or
    None where even 16 does not (hidden and ffn not multiples of 16)."""
    def fit(cfg: TileConfig, n: int, k: int) -> TileConfig | None:
        bn, bk = cfg.bn, cfg.bk
        while bn > 16 and n % bn:
            bn //= 2
        while bk > 16 and k % bk:
            bk //= 2
        return TileConfig(cfg.bm, bn, bk, cfg.warps, cfg.stages) if n % bn == 0 and k % bk == 0 else None
    gu = fit(TileConfig(*DEFAULT_CONFIG), ffn, hidden)
    dn = fit(TileConfig(*DOWN_CONFIG), hidden, ffn)
    return (gu, dn) if gu is not None and dn is not None else None


def max_row_tiles(routed_rows: int, experts: int, bm: int) -> int:
    """Most row tiles any routing of routed_rows rows over `experts` experts can need (sum of ceil(count/bm))."""
    return -(-int(routed_rows) // bm) + int(experts)


def tile_table(counts: np.ndarray, bm: int) -> tuple[np.ndarray, np.ndarray]:
    """For each row tile of a launch, in program order: (its expert, its first row within that expert)."""
    counts = np.asarray(counts, dtype=np.int64)
    tiles = -(-counts // bm)
    expert = np.repeat(np.arange(counts.size), tiles)
    start = np.concatenate([np.arange(t) * bm for t in tiles]) if tiles.sum() else np.zeros(0, np.int64)
    return expert.astype(np.int64), start.astype(np.int64)


def expert_of_tile(counts: np.ndarray, bm: int, tile: int, experts: tuple[int, int] | None = None
                   ) -> tuple[int, int, int]:
    """The kernels' look-up in numpy: (expert, first row within it, total tiles) of row tile `tile` over the
    experts e_lo <= e < e_hi (default all; the others count as 0 rows); past the last tile the program returns."""
    counts = np.asarray(counts, dtype=np.int64)
    if experts is not None:
        idx = np.arange(counts.size)
        counts = np.where((idx >= experts[0]) & (idx < experts[1]), counts, 0)
    tiles = -(-counts // bm)
    cum = np.cumsum(tiles)
    e = int(np.count_nonzero(cum <= tile))
    return e, (int(tile) - int(tiles[:e].sum())) * bm, int(tiles.sum())


#: K step of the quant kernels: half a 256-weight super-block (q4_k, q5_k, q6_k) or four q8_0 blocks.
QUANT_BK = 128
#: ggml types the quant kernels decode inside their K loop, with their block bytes (a row is blocks back to back).
QUANT_BLOCK_BYTES = {"q4_k": 144, "q5_k": 176, "q6_k": 210, "q8_0": 34}


def _f16_of(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The little-endian binary16 of two byte arrays as float32 (exact)."""
    return (lo.astype(np.uint16) | (hi.astype(np.uint16) << 8)).view(np.float16).astype(np.float32)


def step_weights(fmt: str, rows: np.ndarray, step: int) -> np.ndarray:
    """Weights QUANT_BK*step .. +QUANT_BK of each row of `rows` [BN, row bytes] (uint8) as float32 [BN, QUANT_BK]:
    the quant kernels' decode, op for op (the same shapes, joins and permutes, the same float32 steps), so that a
    test can hold it against quants.dequantize on the CPU."""
    if fmt not in QUANT_BLOCK_BYTES:
        raise ValueError(f"triton_moe: no K-loop decode of {fmt!r} (it has {sorted(QUANT_BLOCK_BYTES)})")
    rows = np.asarray(rows, dtype=np.uint8)
    bn = rows.shape[0]
    f32 = np.float32
    if fmt == "q8_0":
        blk = rows[:, 34 * 4 * step + np.arange(4)[:, None] * 34 + np.arange(34)[None, :]]  # [BN, 4, 34]
        d = _f16_of(blk[:, :, 0], blk[:, :, 1])
        q = blk[:, :, 2:].view(np.int8).astype(f32)
        return (q * d[:, :, None]).reshape(bn, QUANT_BK)
    bb = QUANT_BLOCK_BYTES[fmt]
    b = rows[:, (step // 2) * bb + np.arange(bb)]  # the super-block, [BN, bb]
    h = step % 2  # which half of it
    if fmt in ("q4_k", "q5_k"):
        d, dmin = _f16_of(b[:, 0], b[:, 1]), _f16_of(b[:, 2], b[:, 3])
        sa, sb, sc_ = (b[:, 4 + 4 * i:8 + 4 * i].astype(np.uint32) for i in range(3))
        if h == 0:
            sc, mn = sa & 63, sb & 63
        else:
            sc, mn = (sc_ & 15) | ((sa >> 6) << 4), (sc_ >> 4) | ((sb >> 6) << 4)
        q0 = 16 if fmt == "q4_k" else 48
        qs = b[:, q0 + 64 * h + np.arange(2)[:, None] * 32 + np.arange(32)[None, :]]  # [BN, 2, 32]
        q = np.stack([qs & 15, qs >> 4], axis=-1).transpose(0, 1, 3, 2).reshape(bn, 4, 32)  # join, permute
        if fmt == "q5_k":
            qh = b[:, 16 + np.arange(32)][:, None, :]  # [BN, 1, 32]
            q = q | (((qh >> (4 * h + np.arange(4, dtype=np.uint8))[None, :, None]) & 1) << 4)
        scale = d[:, None] * sc.astype(f32)
        minv = dmin[:, None] * mn.astype(f32)
        return (scale[:, :, None] * q.astype(f32) - minv[:, :, None]).reshape(bn, QUANT_BK)
    # q6_k
    ql = b[:, 64 * h + np.arange(2)[:, None] * 32 + np.arange(32)[None, :]]  # [BN, 2 (which), 32]
    low = np.stack([ql & 15, ql >> 4], axis=-1).transpose(0, 3, 1, 2).reshape(bn, 4, 32)  # g = 2 nib + which
    qh = b[:, 128 + 32 * h + np.arange(32)][:, None, :]
    high = (qh >> (2 * np.arange(4, dtype=np.uint8))[None, :, None]) & 3
    q = (low | (high << 4)).astype(np.int32) - 32
    sc = b[:, 192 + 8 * h + np.arange(8)].view(np.int8).astype(f32)  # [BN, 8]: weights 16 each
    scale = _f16_of(b[:, 208], b[:, 209])[:, None] * sc
    return (scale.reshape(bn, 4, 2, 1) * q.reshape(bn, 4, 2, 16).astype(f32)).reshape(bn, QUANT_BK)


#: The kernels' argument types as triton.compile takes them (what a launch specializes to): offline compiles, the
#: compile test and bench/triton_compile_report.py, use these.
F16_SIGNATURE = {"a": "*fp16", "w": "*fp16", "c": "*fp16", "counts": "*i32", "row0": "*i32", "slots": "*i32",
                 "N": "i32", "K": "i32", "w_slot": "i32", "e_lo": "i32", "e_hi": "i32", "ws": "*fp16",
                 "EP": "constexpr", "SWIGLU": "constexpr", "SLOTS": "constexpr", "Q8": "constexpr", "BM": "constexpr",
                 "BN": "constexpr", "BK": "constexpr"}
#: F16_SIGNATURE with Q8_0 quants for w (Q8 set)
Q8_SIGNATURE = {**F16_SIGNATURE, "w": "*i8"}
QUANT_SIGNATURE = {"a": "*fp16", "blob": "*u8", "c": "*fp16", "counts": "*i32", "row0": "*i32", "slots": "*i32",
                   "N": "i32", "K": "i32", "slot_bytes": "i64", "mat_off": "i64", "row_bytes": "i64",
                   "e_lo": "i32", "e_hi": "i32", "EP": "constexpr", "SWIGLU": "constexpr", "FMT": "constexpr",
                   "BB": "constexpr", "Q0": "constexpr", "BM": "constexpr", "BN": "constexpr", "BK": "constexpr"}
#: A launch's specialization of the first eight arguments: the six pointers 16-byte aligned, N and K multiples of 16.
LAUNCH_ATTRS = {(i,): [["tt.divisibility", 16]] for i in range(8)}

_STATE: dict[str, Any] = {}


def available() -> bool:
    """Whether Triton and torch (with CUDA) import here; cached."""
    if "ok" not in _STATE:
        try:
            import torch
            import triton  # noqa: F401
            _STATE["ok"] = bool(torch.cuda.is_available())
        except Exception:  # no Triton, no torch, or a torch without CUDA: the cuBLAS modes stay
            _STATE["ok"] = False
    return _STATE["ok"]


def _kernels() -> Any:
    """The jitted kernels (defined on first use, so importing this module needs no Triton)."""
    if "k" in _STATE:
        return _STATE["k"]
    import triton
    import triton.language as tl

    @triton.jit
    def _expert_of_tile(counts, e_lo, e_hi, EP: tl.constexpr, BM: tl.constexpr, tile):
        offs = tl.arange(0, EP)
        cnt = tl.load(counts + offs, mask=(offs >= e_lo) & (offs < e_hi), other=0)
        tiles = (cnt + BM - 1) // BM
        cum = tl.cumsum(tiles, axis=0)
        e = tl.sum((cum <= tile).to(tl.int32), axis=0)
        first = tl.sum(tl.where(offs < e, tiles, 0), axis=0)
        total = tl.sum(tiles, axis=0)
        return e, (tile - first) * BM, total

    @triton.jit
    def _q8_tile(w_p, s_p, BN: tl.constexpr, BK: tl.constexpr):
        """The f16 weights of a [BN, BK] tile of Q8_0 quants at w_p with their scales [BN, BK // 32] at s_p."""
        q = tl.reshape(tl.load(w_p).to(tl.float32), (BN, BK // 32, 32))
        d = tl.load(s_p).to(tl.float32)
        return tl.reshape(q * d[:, :, None], (BN, BK)).to(tl.float16)

    @triton.jit
    def _w_tile(w_p, s_p, Q8: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """grouped_tn's [BK, BN] f16 weight tile of one K step: loaded, or decoded from Q8_0 quants (Q8)."""
        if Q8:
            t = tl.trans(_q8_tile(w_p, s_p, BN, BK))
        else:
            t = tl.load(w_p)
        return t

    @triton.jit
    def grouped_tn(a, w, c, counts, row0, slots, N, K, w_slot, e_lo, e_hi, ws, EP: tl.constexpr,
                   SWIGLU: tl.constexpr, SLOTS: tl.constexpr, Q8: tl.constexpr, BM: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr):
        """c[rows of e, :N] = a[rows of e] @ w[slot e]^T for experts e_lo <= e < e_hi (SWIGLU: silu(a Wg^T) *
        (a Wu^T), up rows N.. of w); slot e is slots[e] (SLOTS), else e - e_lo (a dequantized group's order).
        Q8: w holds Q8_0 quants (int8, w_slot a slot) and ws their f16 scales (one per 32 along K), each weight
        q * d in float32 (exact: 8 by 11 significant bits) rounded once to f16, as the dequantization kernel does."""
        pid = tl.program_id(0)
        nt = N // BN
        tile, pn = pid // nt, pid % nt
        e, r_in, total = _expert_of_tile(counts, e_lo, e_hi, EP, BM, tile)
        if tile >= total:
            return
        count = tl.load(counts + e)
        base = tl.load(row0 + e).to(tl.int64)
        if SLOTS:
            slot = tl.load(slots + e).to(tl.int64)
        else:
            slot = (e - e_lo).to(tl.int64)
        rows = r_in + tl.arange(0, BM)
        live = rows < count
        grow = base + rows.to(tl.int64)
        cols = pn * BN + tl.arange(0, BN)
        ks = tl.arange(0, BK)
        a_p = a + grow[:, None] * K + ks[None, :]
        if Q8:  # rows of the [BN, BK] tile contiguous along K (16-byte loads), the scales [BN, BK // 32]
            w_p = w + slot * w_slot + cols[:, None].to(tl.int64) * K + ks[None, :]
            s_p = ws + slot * (w_slot // 32) + cols[:, None].to(tl.int64) * (K // 32) + tl.arange(0, BK // 32)[None, :]
        else:  # no scale read (s_p unused)
            w_p = w + slot * w_slot + cols[None, :].to(tl.int64) * K + ks[:, None]
            s_p = ws
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if SWIGLU:
            u_p = w_p + N.to(tl.int64) * K
            su_p = s_p + N.to(tl.int64) * (K // 32)
            acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for _ in range(0, K, BK):
            x = tl.load(a_p, mask=live[:, None], other=0.0)
            acc = tl.dot(x, _w_tile(w_p, s_p, Q8, BN, BK), acc)
            s_p += BK // 32
            if SWIGLU:
                acc_u = tl.dot(x, _w_tile(u_p, su_p, Q8, BN, BK), acc_u)
                su_p += BK // 32
                u_p += BK
            a_p += BK
            w_p += BK
        if SWIGLU:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_u
        tl.store(c + grow[:, None] * N + cols[None, :], acc.to(tl.float16), mask=live[:, None])

    @triton.jit
    def _f16_at(p):
        """The little-endian binary16 at byte pointers p, as float32."""
        lo = tl.load(p).to(tl.uint16)
        hi = tl.load(p + 1).to(tl.uint16)
        return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _step_weights(row, step, FMT: tl.constexpr, BB: tl.constexpr, Q0: tl.constexpr, BN: tl.constexpr):
        """step_weights on the device: weights 128*step.. of the rows starting at byte pointers row [BN]."""
        if FMT == 8:  # q8_0: four blocks of 32
            blk = row[:, None] + 136 * step + tl.arange(0, 4)[None, :] * 34  # [BN, 4]
            d = _f16_at(blk)
            q = tl.load(blk[:, :, None] + 2 + tl.arange(0, 32)[None, None, :]).to(tl.int8, bitcast=True)
            w = q.to(tl.float32) * d[:, :, None]
        elif FMT == 14:  # q6_k: half `step % 2` of a 210-byte super-block
            h = step % 2
            b = row + (step // 2) * BB
            ql = tl.load(b[:, None, None] + 64 * h + tl.arange(0, 2)[None, :, None] * 32
                         + tl.arange(0, 32)[None, None, :])  # [BN, 2 (which), 32]
            low = tl.reshape(tl.permute(tl.join(ql & 15, ql >> 4), (0, 3, 1, 2)), (BN, 4, 32))
            qh = tl.load(b[:, None, None] + 128 + 32 * h + tl.arange(0, 32)[None, None, :])  # [BN, 1, 32]
            high = (qh.to(tl.int32) >> (2 * tl.arange(0, 4))[None, :, None]) & 3
            q = (low.to(tl.int32) | (high << 4)) - 32
            sc = tl.load(b[:, None] + 192 + 8 * h + tl.arange(0, 8)[None, :]).to(tl.int8, bitcast=True)
            scale = _f16_at(b + 208)[:, None] * sc.to(tl.float32)  # [BN, 8]: 16 weights each
            w = tl.reshape(scale, (BN, 4, 2, 1)) * tl.reshape(q.to(tl.float32), (BN, 4, 2, 16))
        else:  # q4_k (12), q5_k (13): half `step % 2` of a super-block, subs 4h .. 4h+3
            h = step % 2
            b = row + (step // 2) * BB
            d = _f16_at(b)[:, None]
            dmin = _f16_at(b + 2)[:, None]
            j4 = tl.arange(0, 4)[None, :]
            sa = tl.load(b[:, None] + 4 + j4).to(tl.uint32)
            sb = tl.load(b[:, None] + 8 + j4).to(tl.uint32)
            sc_ = tl.load(b[:, None] + 12 + j4).to(tl.uint32)
            sc = tl.where(h == 0, sa & 63, (sc_ & 15) | ((sa >> 6) << 4))
            mn = tl.where(h == 0, sb & 63, (sc_ >> 4) | ((sb >> 6) << 4))
            qs = tl.load(b[:, None, None] + Q0 + 64 * h + tl.arange(0, 2)[None, :, None] * 32
                         + tl.arange(0, 32)[None, None, :])  # [BN, 2, 32]
            q = tl.reshape(tl.permute(tl.join(qs & 15, qs >> 4), (0, 1, 3, 2)), (BN, 4, 32)).to(tl.int32)
            if FMT == 13:
                qh = tl.load(b[:, None, None] + 16 + tl.arange(0, 32)[None, None, :]).to(tl.int32)
                q = q | (((qh >> (4 * h + tl.arange(0, 4))[None, :, None]) & 1) << 4)
            scale = d * sc.to(tl.float32)
            minv = dmin * mn.to(tl.float32)
            w = scale[:, :, None] * q.to(tl.float32) - minv[:, :, None]
        return tl.reshape(w, (BN, 128))

    @triton.jit
    def grouped_tn_quant(a, blob, c, counts, row0, slots, N, K, slot_bytes, mat_off, row_bytes, e_lo, e_hi,
                         EP: tl.constexpr, SWIGLU: tl.constexpr, FMT: tl.constexpr, BB: tl.constexpr,
                         Q0: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """grouped_tn with the weights read from the 'gguf' pool's own blocks (a slot of slot_bytes at blob, the
        matrix's rows at mat_off, row_bytes each) and decoded step by step inside the K loop (_step_weights)."""
        pid = tl.program_id(0)
        nt = N // BN
        tile, pn = pid // nt, pid % nt
        e, r_in, total = _expert_of_tile(counts, e_lo, e_hi, EP, BM, tile)
        if tile >= total:
            return
        count = tl.load(counts + e)
        base = tl.load(row0 + e).to(tl.int64)
        slot = tl.load(slots + e).to(tl.int64)
        rows = r_in + tl.arange(0, BM)
        live = rows < count
        grow = base + rows.to(tl.int64)
        cols = pn * BN + tl.arange(0, BN)
        wrow = blob + slot * slot_bytes + mat_off + cols.to(tl.int64) * row_bytes
        a_p = a + grow[:, None] * K + tl.arange(0, BK)[None, :]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if SWIGLU:
            urow = wrow + N.to(tl.int64) * row_bytes
            acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for step in range(0, K // BK):
            x = tl.load(a_p, mask=live[:, None], other=0.0)
            wg = _step_weights(wrow, step, FMT, BB, Q0, BN).to(tl.float16)
            acc = tl.dot(x, tl.trans(wg), acc)
            if SWIGLU:
                wu = _step_weights(urow, step, FMT, BB, Q0, BN).to(tl.float16)
                acc_u = tl.dot(x, tl.trans(wu), acc_u)
            a_p += BK
        if SWIGLU:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_u
        tl.store(c + grow[:, None] * N + cols[None, :], acc.to(tl.float16), mask=live[:, None])

    _STATE["k"] = grouped_tn
    _STATE["kq"] = grouped_tn_quant
    return grouped_tn


#: The quant launches' tiles (gate|up with SwiGLU, down): BM, BN, warps, stages; the K step is QUANT_BK. Chosen from
#: compiling for sm_90 here (bench/results/triton_compile_report.json): down at 128 columns spilled 44 bytes in
#: q4_k, at 64 none. On the H200 (QuantMoE.warm_fused, off) 256x64 was the fastest timed, 2.37x the f16 warm layer
#: against 2.92x for these (bench/results/lead_h200_s8/call1_ and call2_quant_layer_h200.json).
QUANT_GATE_UP_CONFIG = (128, 64, 8, 2)
QUANT_DOWN_CONFIG = (128, 64, 8, 2)
#: ggml type ids of the K-loop decode (quants.GGML_TYPES), and where a q4_k / q5_k block's low-nibble quants start.
_QUANT_TYPE_IDS = {"q8_0": 8, "q4_k": 12, "q5_k": 13, "q6_k": 14}
_QS_OFFSET = {"q4_k": 16, "q5_k": 48, "q6_k": 0, "q8_0": 0}


def quant_takes(gate_up: str, down: str, hidden: int, ffn: int, biased: bool = False) -> bool:
    """Whether the fused quant launches run experts of these types and shape (no biases; K steps and column
    tiles whole)."""
    gbn, dbn = QUANT_GATE_UP_CONFIG[1], QUANT_DOWN_CONFIG[1]
    return (not biased and gate_up in QUANT_BLOCK_BYTES and down in QUANT_BLOCK_BYTES
            and hidden % QUANT_BK == 0 and ffn % QUANT_BK == 0 and ffn % gbn == 0 and hidden % dbn == 0)


class _Ptr:
    """A device address as Triton takes a tensor argument (data_ptr and a dtype)."""

    __slots__ = ("ptr", "dtype")

    def __init__(self, ptr: int, dtype: Any):
        self.ptr, self.dtype = int(ptr), dtype

    def data_ptr(self) -> int:
        """The address."""
        return self.ptr


class DeviceGroupedGEMM:
    """FastMoE's two Triton launches for a layer shape (hidden H, ffn F, E experts)."""

    def __init__(self, hidden: int, ffn: int, experts: int, gate_up: str | tuple | None = None,
                 down: str | tuple | None = None):
        import torch
        self._torch = torch
        self.hidden, self.ffn, self.experts = int(hidden), int(ffn), int(experts)
        self.gate_up = TileConfig.parse(gate_up, DEFAULT_CONFIG)
        self.down = TileConfig.parse(down, DOWN_CONFIG)
        self._ep = 1 << max(0, (self.experts - 1).bit_length())
        self._streams: dict[int, Any] = {}
        self._kernel = _kernels()
        self._f16, self._i32, self._i8 = torch.float16, torch.int32, torch.int8

    @staticmethod
    def takes(hidden: int, ffn: int, gate_up: TileConfig | None = None, down: TileConfig | None = None) -> bool:
        """Whether the shapes tile evenly (every K step and column tile whole)."""
        gu = gate_up or TileConfig(*DEFAULT_CONFIG)
        dn = down or TileConfig(*DOWN_CONFIG)
        return hidden % gu.bk == 0 and ffn % gu.bn == 0 and ffn % dn.bk == 0 and hidden % dn.bn == 0

    def _stream(self, ptr: int) -> Any:
        s = self._streams.get(ptr)
        if s is None:
            cuda = self._torch.cuda
            s = self._streams[ptr] = cuda.default_stream() if ptr == 0 else cuda.ExternalStream(ptr)
        return s

    def _launch(self, cfg: TileConfig, a: int, w: int, c: int, tables: tuple, n: int, k: int, w_slot: int,
                swiglu: bool, routed_rows: int, experts: tuple[int, int], scales: int | None = None) -> None:
        counts, row0, slots = tables
        e_lo, e_hi = experts
        grid = (max_row_tiles(routed_rows, e_hi - e_lo, cfg.bm) * (n // cfg.bn),)
        q8 = scales is not None
        self._kernel[grid](_Ptr(a, self._f16), _Ptr(w, self._i8 if q8 else self._f16), _Ptr(c, self._f16),
                           _Ptr(counts, self._i32), _Ptr(row0, self._i32), _Ptr(slots or counts, self._i32), n, k,
                           w_slot, e_lo, e_hi, _Ptr(scales if q8 else w, self._f16), EP=self._ep, SWIGLU=swiglu,
                           SLOTS=slots is not None, Q8=q8, BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, num_warps=cfg.warps,
                           num_stages=cfg.stages, enable_fp_fusion=True)

    def layer(self, stream_ptr: int, xs: int, act: int, ys: int, w_gate_up: int, w_down: int, counts: int,
              row0: int, slots: int | None, routed_rows: int, experts: tuple[int, int] | None = None,
              scales: tuple[int, int] | None = None) -> None:
        """Queue gate|up with SwiGLU (xs -> act) and down (act -> ys) for the experts e_lo <= e < e_hi (default:
        all) on the stream at stream_ptr.

        counts, row0 and slots are int32 [E] device tables; w_gate_up / w_down the base addresses of [slots,2F,H]
        and [slots,H,F] f16 weights; slots None: expert e's weights are number e - e_lo there. scales (gate|up's,
        down's): the weights are a 'q8_0' pool's int8 quants and these its f16 scales ([slots,2F,H/32],
        [slots,H,F/32]), decoded in the K loop."""
        h, f = self.hidden, self.ffn
        tables = (counts, row0, slots)
        ex = experts or (0, self.experts)
        s13, s2 = scales or (None, None)
        with self._torch.cuda.stream(self._stream(int(stream_ptr))):
            self._launch(self.gate_up, xs, w_gate_up, act, tables, f, h, 2 * f * h, True, routed_rows, ex, s13)
            self._launch(self.down, act, w_down, ys, tables, h, f, h * f, False, routed_rows, ex, s2)


class DeviceQuantGEMM(DeviceGroupedGEMM):
    """DeviceGroupedGEMM's two launches over a 'gguf' pool's own blocks (q4_k, q5_k, q6_k, q8_0 rows), decoded
    inside the K loop: no f16 copy of any expert. Exact as the scratch path: each weight is quants.dequantize's
    float32 (no fused multiply-add: enable_fp_fusion off) rounded once to f16."""

    def __init__(self, hidden: int, ffn: int, experts: int, gate_up: str, down: str, gate_up_row_bytes: int,
                 down_row_bytes: int, down_offset: int):
        super().__init__(hidden, ffn, experts)
        if not quant_takes(gate_up, down, hidden, ffn):
            raise ValueError(f"triton_moe: no fused launches for {gate_up}/{down} at hidden {hidden}, ffn {ffn}")
        self.types = (gate_up, down)
        self._rows = (int(gate_up_row_bytes), int(down_row_bytes))
        self._down_offset = int(down_offset)
        self._kq = _STATE["kq"]
        self._u8 = self._torch.uint8
        #: the two launches' (BM, BN, warps, stages); the K step is QUANT_BK
        self.gate_up_q, self.down_q = QUANT_GATE_UP_CONFIG, QUANT_DOWN_CONFIG

    def set_configs(self, spec: str) -> None:
        """Tiles from "BMxBNxWARPSxSTAGES+BMxBNxWARPSxSTAGES" (gate|up, then down); ValueError where they do not
        tile this shape."""
        parts = [tuple(int(v) for v in p.split("x")) for p in spec.split("+")]
        if len(parts) != 2 or any(len(p) != 4 or min(p) <= 0 for p in parts):
            raise ValueError(f"triton_moe: quant tiles are BMxBNxWARPSxSTAGES+BMxBNxWARPSxSTAGES, not {spec!r}")
        if self.ffn % parts[0][1] or self.hidden % parts[1][1]:
            raise ValueError(f"triton_moe: column tiles {parts[0][1]}, {parts[1][1]} do not tile {self.ffn}, "
                             f"{self.hidden}")
        self.gate_up_q, self.down_q = parts

    def _launch_q(self, cfg: tuple, a: int, blob: int, c: int, tables: tuple, n: int, k: int, slot_bytes: int,
                  mat_off: int, row_bytes: int, typ: str, swiglu: bool, routed_rows: int,
                  experts: tuple[int, int]) -> None:
        bm, bn, warps, stages = cfg
        counts, row0, slots = (_Ptr(p, self._i32) for p in tables)
        e_lo, e_hi = experts
        grid = (max_row_tiles(routed_rows, e_hi - e_lo, bm) * (n // bn),)
        self._kq[grid](_Ptr(a, self._f16), _Ptr(blob, self._u8), _Ptr(c, self._f16), counts, row0, slots, n, k,
                       slot_bytes, mat_off, row_bytes, e_lo, e_hi, EP=self._ep, SWIGLU=swiglu,
                       FMT=_QUANT_TYPE_IDS[typ], BB=QUANT_BLOCK_BYTES[typ], Q0=_QS_OFFSET[typ], BM=bm, BN=bn,
                       BK=QUANT_BK, num_warps=warps, num_stages=stages, enable_fp_fusion=False)

    def quant_layer(self, stream_ptr: int, xs: int, act: int, ys: int, blob: int, slot_bytes: int, counts: int,
                    row0: int, slots: int, routed_rows: int, experts: tuple[int, int] | None = None) -> None:
        """layer() over the pool's blob (slot s at blob + s * slot_bytes): gate|up rows from the slot's start, down
        rows from its down offset."""
        h, f = self.hidden, self.ffn
        tables = (counts, row0, slots)
        ex = experts or (0, self.experts)
        with self._torch.cuda.stream(self._stream(int(stream_ptr))):
            self._launch_q(self.gate_up_q, xs, blob, act, tables, f, h, slot_bytes, 0, self._rows[0],
                           self.types[0], True, routed_rows, ex)
            self._launch_q(self.down_q, act, blob, ys, tables, h, f, slot_bytes, self._down_offset,
                           self._rows[1], self.types[1], False, routed_rows, ex)
