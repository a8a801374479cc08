"""Tensor-core grouped GEMMs over a 'gguf' pool's own q4_k / q6_k rows (quant_mma.cu), for QuantMoE's warm layer.

The two launches of a layer (gate|up with the SwiGLU fused in, then down) read the device tables FastMoE's
device-table path builds (counts, row0, slots: int32 [E] each) and the pool's blob; every weight is decoded once per
block into a shared f16 tile between the MMAs of the step before (the file's header says how), so no f16 copy of any
expert is written and no host sync is needed. The weights are the oracle's float32 rounded once to f16, as the
scratch path's, so the two differ only in the order of the f32 sums. CUDA only: on the H200 (compute capability 9.0)
the kernels are built for sm_90a and run wgmma from the shared tiles, the decode of the next step issued while it
runs; elsewhere (sm_80 and newer) mma.sync from ldmatrix fragments. cupy is imported by the constructor.
"""

from __future__ import annotations

from importlib.resources import files
from typing import Any

import numpy as np

SOURCE_NAME = "quant_mma.cu"
#: ggml types the kernels decode (either matrix may be either).
TYPES = ("q4_k", "q6_k")
#: QM_BM, QM_BK, QM_THREADS of quant_mma.cu; the weight rows of a block: 128 act columns of gate|up (the 128 gate
#: rows and the same 128 up rows), 256 output columns of down.
BM = 128
BK = 64
THREADS = 256
GATE_UP_COLUMNS = 128
DOWN_COLUMNS = 256
#: QM_SMEM: four input stages of BM x BK f16, three decoded tiles of 256 x BK f16, 1 KiB to align them.
SMEM_BYTES = 4 * BM * BK * 2 + 3 * 256 * BK * 2 + 1024
#: K steps per unrolled loop trip (a q6_k raw unit spans two steps, and the buffers alternate every trip of two).
STEP_UNROLL = 4

#: The architecture of the wgmma path (quant_mma.cu's QM_WGMMA: sm_90a's arch-specific instructions).
WGMMA_ARCH = "sm_90a"

_MODULE: dict[Any, Any] = {}


def kernel_source() -> str:
    """The text of strata_cuda/quant_mma.cu."""
    return files("strata_cuda").joinpath(SOURCE_NAME).read_text()


def kernel_names(gate_up: str, down: str) -> tuple[str, str]:
    """The gate|up and down kernels for these types."""
    return f"strata_qm_gate_up_{gate_up}", f"strata_qm_down_{down}"


def takes(gate_up: str, down: str, hidden: int, ffn: int, biased: bool = False) -> bool:
    """Whether the kernels run experts of these types and shape: no biases, whole K steps in trips of STEP_UNROLL,
    whole column tiles."""
    steps_ok = all(k % (BK * STEP_UNROLL) == 0 for k in (hidden, ffn))
    return (not biased and gate_up in TYPES and down in TYPES and steps_ok and ffn % GATE_UP_COLUMNS == 0
            and hidden % DOWN_COLUMNS == 0)


def max_row_tiles(routed_rows: int, experts: int) -> int:
    """Most BM-row tiles any routing of routed_rows rows over `experts` experts can need."""
    return -(-int(routed_rows) // BM) + int(experts)


def row_tiles(counts: np.ndarray) -> int:
    """The row tiles these counts give (the blocks of a launch that do work, per column tile)."""
    return int(sum(-(-int(c) // BM) for c in np.asarray(counts).reshape(-1)))


def compile_cubin(arch: str = WGMMA_ARCH, options: tuple[str, ...] = ()) -> bytes:
    """quant_mma.cu compiled by NVRTC to a cubin for `arch` (no GPU needed); RuntimeError with NVRTC's log."""
    from cupy_backends.cuda.libs import nvrtc
    prog = nvrtc.createProgram(kernel_source(), SOURCE_NAME, (), ())
    try:
        try:
            nvrtc.compileProgram(prog, (f"-arch={arch}", "-std=c++17", *options))
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"NVRTC failed on {SOURCE_NAME} ({e}):\n{nvrtc.getProgramLog(prog)}") from None
        return nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)


def _load_module(cp: Any, options: tuple[str, ...]) -> Any:
    """The kernels for the current device: on compute capability 9.0 a cubin for sm_90a (the wgmma path; cupy's own
    compile targets sm_90, without it), loaded from a file in a temporary folder; elsewhere cupy's RawModule."""
    if cp.cuda.Device().compute_capability == "90":
        import hashlib
        import tempfile
        from pathlib import Path
        cubin = compile_cubin(WGMMA_ARCH, options)
        folder = _MODULE.setdefault("dir", Path(tempfile.mkdtemp(prefix="strata_quant_mma_")))
        path = folder / f"{hashlib.sha1(cubin).hexdigest()}.cubin"
        path.write_bytes(cubin)
        return cp.RawModule(path=str(path))
    return cp.RawModule(code=kernel_source(), options=("-std=c++17", *options))


class QuantMmaGEMM:
    """The two launches for one layer shape and pair of types; quant_layer has triton_moe.DeviceQuantGEMM's
    signature, so QuantMoE takes either."""

    def __init__(self, hidden: int, ffn: int, experts: int, gate_up: str, down: str, gate_up_row_bytes: int,
                 down_row_bytes: int, down_offset: int, options: tuple[str, ...] = ()):
        import cupy as cp
        if not takes(gate_up, down, hidden, ffn):
            raise ValueError(f"quant_mma: no launches for {gate_up}/{down} at hidden {hidden}, ffn {ffn}")
        self._cp = cp
        self.hidden, self.ffn, self.experts = int(hidden), int(ffn), int(experts)
        self.types = (gate_up, down)
        self._rows = (int(gate_up_row_bytes), int(down_row_bytes))
        self._down_offset = int(down_offset)
        # options: extra NVRTC options (bench/quant_mma_h200.py's ablations, -DQM_SKIP_MMA / -DQM_SKIP_DECODE)
        mod = _MODULE.get(options)
        if mod is None:
            mod = _MODULE[options] = _load_module(cp, options)
        self._gate_up, self._down = (mod.get_function(n) for n in kernel_names(gate_up, down))
        for k in (self._gate_up, self._down):
            k.max_dynamic_shared_size_bytes = SMEM_BYTES
        self._streams: dict[int, Any] = {}

    def _stream(self, ptr: int) -> Any:
        s = self._streams.get(ptr)
        if s is None:
            cp = self._cp
            s = self._streams[ptr] = cp.cuda.Stream.null if ptr == 0 else cp.cuda.ExternalStream(ptr)
        return s

    def _check(self, *addresses: int) -> None:
        q4_rows = [r for r, t in zip(self._rows, self.types) if t == "q4_k"]
        if any(int(v) % 16 for v in (*addresses, self._down_offset, *q4_rows)):
            raise ValueError("quant_mma: stacks, blob, slot bytes and offsets must be 16-byte aligned")

    def gate_up(self, stream_ptr: int, xs: int, act: int, blob: int, slot_bytes: int, tables: tuple[int, int, int],
                routed_rows: int, experts: tuple[int, int] | None = None) -> None:
        """Queue gate|up with SwiGLU, xs [rows, H] f16 -> act [rows, F], for experts e_lo <= e < e_hi; tables: the
        device addresses of counts, row0 and slots."""
        self._launch(self._gate_up, self.ffn // GATE_UP_COLUMNS, stream_ptr, xs, act, blob, slot_bytes, tables,
                     self.ffn, self.hidden, 0, self._rows[0], routed_rows, experts)

    def down(self, stream_ptr: int, act: int, ys: int, blob: int, slot_bytes: int, tables: tuple[int, int, int],
             routed_rows: int, experts: tuple[int, int] | None = None) -> None:
        """Queue down, act [rows, F] f16 -> ys [rows, H], as gate_up."""
        self._launch(self._down, self.hidden // DOWN_COLUMNS, stream_ptr, act, ys, blob, slot_bytes, tables,
                     self.hidden, self.ffn, self._down_offset, self._rows[1], routed_rows, experts)

    def _launch(self, kernel: Any, col_tiles: int, stream_ptr: int, a: int, c: int, blob: int, slot_bytes: int,
                tables: tuple, n: int, k: int, mat_off: int, row_bytes: int, routed_rows: int,
                experts: tuple[int, int] | None) -> None:
        e_lo, e_hi = experts or (0, self.experts)
        self._check(a, c, blob, slot_bytes)
        u64, i32, i64 = np.uint64, np.int32, np.int64
        with self._stream(int(stream_ptr)):
            kernel((col_tiles, max_row_tiles(routed_rows, e_hi - e_lo)), (THREADS,),
                   (u64(a), u64(blob), u64(c), *(u64(t) for t in tables), i32(n), i32(k), i64(slot_bytes),
                    i64(mat_off), i64(row_bytes), i32(e_lo), i32(e_hi)), shared_mem=SMEM_BYTES)

    def quant_layer(self, stream_ptr: int, xs: int, act: int, ys: int, blob: int, slot_bytes: int, counts: int,
                    row0: int, slots: int, routed_rows: int, experts: tuple[int, int] | None = None) -> None:
        """Queue gate|up with SwiGLU (xs [rows, H] f16 -> act [rows, F]) and down (act -> ys [rows, H]) for the
        experts e_lo <= e < e_hi (default: all) on the stream at stream_ptr; slot s of the pool at blob + s *
        slot_bytes (gate|up rows first, down rows at the down offset). ValueError where the addresses are not 16-byte
        aligned (the q4_k rows are read 16 bytes at a time)."""
        tables = (counts, row0, slots)
        self.gate_up(stream_ptr, xs, act, blob, slot_bytes, tables, routed_rows, experts)
        self.down(stream_ptr, act, ys, blob, slot_bytes, tables, routed_rows, experts)
