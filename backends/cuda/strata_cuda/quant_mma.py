"""Tensor-core grouped GEMMs over a 'gguf' pool's own q4_k / q6_k rows (quant_mma.cu), for QuantMoE's warm layer.

The two launches of a layer (gate|up with the SwiGLU fused in, then down) read the device tables FastMoE's
device-table path builds (counts, row0, slots: int32 [E] each) and the pool's blob; every weight is decoded once per
block into a shared f16 tile between the MMAs of the step before (the file's header says how), so no f16 copy of any
expert is written and no host sync is needed. The weights are the oracle's float32 rounded once to f16, as the
scratch path's, so the two differ only in the order of the f32 sums. CUDA only: on the H200 (compute capability 9.0)
the kernels are built for sm_90a and run wgmma from the shared tiles, the decode of the next step issued while it
runs, in blocks of 128 input rows x 256 or 128 weight rows, or 256 x 128 (SHAPES); elsewhere (sm_80 and newer)
mma.sync from ldmatrix fragments, blocks of 128 x 256. cupy is imported by the constructor.
"""

from __future__ import annotations

import functools
import hashlib
import tempfile
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

import numpy as np

from .triton_moe import max_row_tiles

SOURCE_NAME = "quant_mma.cu"
#: ggml types the kernels decode (either matrix may be either).
TYPES = ("q4_k", "q6_k")
#: QM_BM, QM_BK, QM_THREADS of quant_mma.cu (BM: a block's input rows by default).
BM = 128
BK = 64
THREADS = 256
#: QM_XSTAGES: input tiles in flight (step k's is stage k % 4, so STEP_UNROLL must be a multiple of it).
XSTAGES = 4
#: (gate|up, down) weight rows a block decodes and multiplies (its BN) QuantMmaGEMM takes by default. A gate|up block
#: gives BN / 2 act columns (BN / 2 gate rows and the same up rows), a down block BN output columns.
DEFAULT_BLOCK_ROWS = (256, 256)
#: The (input rows, weight rows) a block can take: 128 x 256 (every arch), and on the sm_90a build 128 x 128 and
#: 256 x 128 (each weight decoded for twice the input rows: half the decode per MMA, one block an SM).
SHAPES = ((128, 256), (128, 128), (256, 128))
#: (gate|up, down) input rows QuantMmaGEMM takes by default.
DEFAULT_INPUT_ROWS = (BM, BM)
#: K steps per unrolled loop trip (a q6_k raw unit spans two steps, and the buffers alternate every trip of two).
STEP_UNROLL = 4

#: The architecture of the wgmma path (quant_mma.cu's QM_WGMMA: sm_90a's arch-specific instructions).
WGMMA_ARCH = "sm_90a"

_MODULE: dict[tuple[str, ...], Any] = {}


def kernel_source() -> str:
    """The text of strata_cuda/quant_mma.cu."""
    return files("strata_cuda").joinpath(SOURCE_NAME).read_text()


def smem_bytes(block_rows: int, input_rows: int = BM) -> int:
    """QM_SMEM(BN, MT): XSTAGES input stages of input_rows x BK f16, two decoded tiles of BN x BK f16, 1 KiB to align
    them."""
    return XSTAGES * int(input_rows) * BK * 2 + 2 * int(block_rows) * BK * 2 + 1024


def kernel_names(gate_up: str, down: str, block_rows: tuple[int, int] = DEFAULT_BLOCK_ROWS,
                 input_rows: tuple[int, int] = DEFAULT_INPUT_ROWS) -> tuple[str, str]:
    """The gate|up and down kernels for these types, block rows and input rows."""
    pre = [("strata_qm" if b == 256 else f"strata_qm{b}") + ("" if m == BM else f"_m{m}")
           for b, m in zip(block_rows, input_rows)]
    return f"{pre[0]}_gate_up_{gate_up}", f"{pre[1]}_down_{down}"


def takes(gate_up: str, down: str, hidden: int, ffn: int, biased: bool = False,
          block_rows: tuple[int, int] = DEFAULT_BLOCK_ROWS,
          input_rows: tuple[int, int] = DEFAULT_INPUT_ROWS) -> bool:
    """Whether the kernels run experts of these types and shape: no biases, whole K steps in trips of STEP_UNROLL,
    block shapes of SHAPES, whole column tiles."""
    steps_ok = all(k % (BK * STEP_UNROLL) == 0 for k in (hidden, ffn))
    gu, dn = block_rows
    return (not biased and gate_up in TYPES and down in TYPES and steps_ok
            and all(s in SHAPES for s in zip(input_rows, block_rows)) and ffn % (gu // 2) == 0 and hidden % dn == 0)


def compile_cubin(arch: str = WGMMA_ARCH, options: tuple[str, ...] = (), log: list[str] | None = None) -> bytes:
    """quant_mma.cu compiled by NVRTC to a cubin for `arch` (no GPU needed; its log appended to `log` if given);
    RuntimeError with NVRTC's log."""
    from .kernels import nvrtc_compile
    return nvrtc_compile(kernel_source(), SOURCE_NAME, (f"-arch={arch}", "-std=c++17", *options), cubin=True,
                         log=log)


@functools.lru_cache(maxsize=None)
def _cubin_dir() -> Path:
    """The process's folder for the sm_90a cubins (cupy's RawModule loads a cubin from a file)."""
    return Path(tempfile.mkdtemp(prefix="strata_quant_mma_"))


@dataclass(frozen=True)
class Launch:
    """One kernel of a layer: its name, column tiles, input rows a block, dynamic shared bytes and the shape
    arguments it takes."""

    kernel: str
    col_tiles: int
    input_rows: int
    smem_bytes: int
    n: int                 # output columns (gate|up: ffn act columns; down: hidden)
    k: int                 # the K of the GEMM (gate|up: hidden; down: ffn)
    mat_off: int           # byte offset of the matrix's rows in a slot
    row_bytes: int

    def grid(self, routed_rows: int, experts: int) -> tuple[int, int]:
        """(column tiles, row tiles: the most any routing of routed_rows rows over `experts` experts can need)."""
        return self.col_tiles, max_row_tiles(routed_rows, experts, self.input_rows)


def launches(hidden: int, ffn: int, types: tuple[str, str], row_bytes: tuple[int, int], down_offset: int,
             block_rows: tuple[int, int], input_rows: tuple[int, int]) -> tuple[Launch, Launch]:
    """The (gate|up, down) kernels of a layer of this shape and types (no device needed)."""
    gu_name, dn_name = kernel_names(*types, block_rows, input_rows)
    return (Launch(gu_name, ffn // (block_rows[0] // 2), input_rows[0], smem_bytes(block_rows[0], input_rows[0]),
                   ffn, hidden, 0, int(row_bytes[0])),
            Launch(dn_name, hidden // block_rows[1], input_rows[1], smem_bytes(block_rows[1], input_rows[1]),
                   hidden, ffn, int(down_offset), int(row_bytes[1])))


def _load_module(cp: Any, options: tuple[str, ...]) -> Any:
    """The kernels for the current device: on compute capability 9.0 a cubin for sm_90a (the wgmma path; cupy's own
    compile targets sm_90, without it), loaded from a file in a temporary folder; elsewhere cupy's RawModule."""
    if cp.cuda.Device().compute_capability == "90":
        cubin = compile_cubin(WGMMA_ARCH, options)
        path = _cubin_dir() / f"{hashlib.sha1(cubin).hexdigest()}.cubin"
        path.write_bytes(cubin)
        return cp.RawModule(path=str(path))
    return cp.RawModule(code=kernel_source(), options=("-std=c++17", *options))


class QuantMmaGEMM:
    """The two launches for one layer shape and pair of types; quant_layer has triton_moe.DeviceQuantGEMM's
    signature, so QuantMoE takes either."""

    def __init__(self, hidden: int, ffn: int, experts: int, gate_up: str, down: str, gate_up_row_bytes: int,
                 down_row_bytes: int, down_offset: int, options: tuple[str, ...] = (),
                 block_rows: tuple[int, int] = DEFAULT_BLOCK_ROWS,
                 input_rows: tuple[int, int] = DEFAULT_INPUT_ROWS):
        import cupy as cp
        #: (gate|up, down) weight rows of a block (SHAPES; 128 needs the sm_90a build)
        self.block_rows = tuple(int(b) for b in block_rows)
        #: (gate|up, down) input rows of a block (SHAPES: 256 with 128 weight rows, the sm_90a build only)
        self.input_rows = tuple(int(m) for m in input_rows)
        if not takes(gate_up, down, hidden, ffn, block_rows=self.block_rows, input_rows=self.input_rows):
            raise ValueError(f"quant_mma: no launches for {gate_up}/{down} at hidden {hidden}, ffn {ffn}, block rows "
                             f"{self.block_rows}, input rows {self.input_rows}")
        cc = cp.cuda.Device().compute_capability
        if any(s != SHAPES[0] for s in zip(self.input_rows, self.block_rows)) and cc != "90":
            raise ValueError(f"quant_mma: blocks other than {SHAPES[0][0]} x {SHAPES[0][1]} need the sm_90a build, "
                             f"not compute capability {cc}")
        self._cp = cp
        self.hidden, self.ffn, self.experts = int(hidden), int(ffn), int(experts)
        self.types = (gate_up, down)
        self._rows = (int(gate_up_row_bytes), int(down_row_bytes))
        self._down_offset = int(down_offset)
        q4_rows = [r for r, t in zip(self._rows, self.types) if t == "q4_k"]
        if any(v % 16 for v in (self._down_offset, *q4_rows)):  # the q4_k rows are read 16 bytes at a time
            raise ValueError("quant_mma: the down offset and q4_k rows must be 16-byte multiples")
        # options: extra NVRTC options (bench/quant_mma_h200.py's ablations, -DQM_SKIP_MMA / -DQM_SKIP_DECODE)
        mod = _MODULE.get(options)
        if mod is None:
            mod = _MODULE[options] = _load_module(cp, options)
        #: the (gate|up, down) launches' kernel names, tiles and arguments, and their functions
        self._launches = launches(self.hidden, self.ffn, self.types, self._rows, self._down_offset, self.block_rows,
                                  self.input_rows)
        self._gate_up, self._down = (mod.get_function(ln.kernel) for ln in self._launches)
        for fn, ln in zip((self._gate_up, self._down), self._launches):
            fn.max_dynamic_shared_size_bytes = ln.smem_bytes
        self._streams: dict[int, Any] = {}

    def _stream(self, ptr: int) -> Any:
        s = self._streams.get(ptr)
        if s is None:
            cp = self._cp
            s = self._streams[ptr] = cp.cuda.Stream.null if ptr == 0 else cp.cuda.ExternalStream(ptr)
        return s

    def gate_up(self, stream_ptr: int, xs: int, act: int, blob: int, slot_bytes: int, tables: tuple[int, int, int],
                routed_rows: int, experts: tuple[int, int] | None = None) -> None:
        """Queue gate|up with SwiGLU, xs [rows, H] f16 -> act [rows, F], for experts e_lo <= e < e_hi; tables: the
        device addresses of counts, row0 and slots."""
        self._launch(self._gate_up, 0, stream_ptr, xs, act, blob, slot_bytes, tables, routed_rows, experts)

    def down(self, stream_ptr: int, act: int, ys: int, blob: int, slot_bytes: int, tables: tuple[int, int, int],
             routed_rows: int, experts: tuple[int, int] | None = None) -> None:
        """Queue down, act [rows, F] f16 -> ys [rows, H], as gate_up."""
        self._launch(self._down, 1, stream_ptr, act, ys, blob, slot_bytes, tables, routed_rows, experts)

    def _launch(self, kernel: Any, which: int, stream_ptr: int, a: int, c: int, blob: int, slot_bytes: int,
                tables: tuple, routed_rows: int, experts: tuple[int, int] | None) -> None:
        e_lo, e_hi = experts or (0, self.experts)
        if any(int(v) % 16 for v in (a, c, blob, slot_bytes)):
            raise ValueError("quant_mma: stacks, blob and slot bytes must be 16-byte aligned")
        ln = self._launches[which]
        u64, i32, i64 = np.uint64, np.int32, np.int64
        with self._stream(int(stream_ptr)):
            kernel(ln.grid(routed_rows, e_hi - e_lo), (THREADS,),
                   (u64(a), u64(blob), u64(c), *(u64(t) for t in tables), i32(ln.n), i32(ln.k), i64(slot_bytes),
                    i64(ln.mat_off), i64(ln.row_bytes), i32(e_lo), i32(e_hi)), shared_mem=ln.smem_bytes)

    def quant_layer(self, stream_ptr: int, xs: int, act: int, ys: int, blob: int, slot_bytes: int, counts: int,
                    row0: int, slots: int, routed_rows: int, experts: tuple[int, int] | None = None) -> None:
        """Queue gate|up with SwiGLU (xs [rows, H] f16 -> act [rows, F]) and down (act -> ys [rows, H]) for the
        experts e_lo <= e < e_hi (default: all) on the stream at stream_ptr; slot s of the pool at blob + s *
        slot_bytes (gate|up rows first, down rows at the down offset). ValueError where the addresses are not 16-byte
        aligned (the q4_k rows are read 16 bytes at a time)."""
        tables = (counts, row0, slots)
        self.gate_up(stream_ptr, xs, act, blob, slot_bytes, tables, routed_rows, experts)
        self.down(stream_ptr, act, ys, blob, slot_bytes, tables, routed_rows, experts)
