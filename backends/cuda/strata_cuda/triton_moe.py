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
    def grouped_tn(a, w, c, counts, row0, slots, N, K, w_slot, e_lo, e_hi, EP: tl.constexpr,
                   SWIGLU: tl.constexpr, SLOTS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr):
        """c[rows of e, :N] = a[rows of e] @ w[slot e]^T for experts e_lo <= e < e_hi (SWIGLU: silu(a Wg^T) *
        (a Wu^T), up rows N.. of w); slot e is slots[e] (SLOTS), else e - e_lo (a dequantized group's order)."""
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
        w_p = w + slot * w_slot + cols[None, :].to(tl.int64) * K + ks[:, None]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if SWIGLU:
            u_p = w_p + N.to(tl.int64) * K
            acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for _ in range(0, K, BK):
            x = tl.load(a_p, mask=live[:, None], other=0.0)
            acc = tl.dot(x, tl.load(w_p), acc)
            if SWIGLU:
                acc_u = tl.dot(x, tl.load(u_p), acc_u)
                u_p += BK
            a_p += BK
            w_p += BK
        if SWIGLU:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_u
        tl.store(c + grow[:, None] * N + cols[None, :], acc.to(tl.float16), mask=live[:, None])

    _STATE["k"] = grouped_tn
    return grouped_tn


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
        self._f16, self._i32 = torch.float16, torch.int32

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
                swiglu: bool, routed_rows: int, experts: tuple[int, int]) -> None:
        counts, row0, slots = tables
        e_lo, e_hi = experts
        grid = (max_row_tiles(routed_rows, e_hi - e_lo, cfg.bm) * (n // cfg.bn),)
        self._kernel[grid](_Ptr(a, self._f16), _Ptr(w, self._f16), _Ptr(c, self._f16), _Ptr(counts, self._i32),
                           _Ptr(row0, self._i32), _Ptr(slots or counts, self._i32), n, k, w_slot, e_lo, e_hi,
                           EP=self._ep, SWIGLU=swiglu, SLOTS=slots is not None, BM=cfg.bm, BN=cfg.bn,
                           BK=cfg.bk, num_warps=cfg.warps, num_stages=cfg.stages)

    def layer(self, stream_ptr: int, xs: int, act: int, ys: int, w_gate_up: int, w_down: int, counts: int,
              row0: int, slots: int | None, routed_rows: int, experts: tuple[int, int] | None = None) -> None:
        """Queue gate|up with SwiGLU (xs -> act) and down (act -> ys) for the experts e_lo <= e < e_hi (default:
        all) on the stream at stream_ptr.

        counts, row0 and slots are int32 [E] device tables; w_gate_up / w_down the base addresses of [slots,2F,H]
        and [slots,H,F] f16 weights; slots None: expert e's weights are number e - e_lo there."""
        h, f = self.hidden, self.ffn
        tables = (counts, row0, slots)
        ex = experts or (0, self.experts)
        with self._torch.cuda.stream(self._stream(int(stream_ptr))):
            self._launch(self.gate_up, xs, w_gate_up, act, tables, f, h, 2 * f * h, True, routed_rows, ex)
            self._launch(self.down, act, w_down, ys, tables, h, f, h * f, False, routed_rows, ex)
