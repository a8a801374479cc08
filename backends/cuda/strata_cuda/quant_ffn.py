"""The grouped FFN of 'gguf' expert pools on CUDA (and ROCm): strata_cuda/moe_quant.cu through cupy.RawModule.

The slots hold the GGUF file's own rows (strata_core.api.kernels.ExpertFormat); moe_quant.cu's two tiled GEMMs
dequantize a tile of weights at a time into shared memory (quants.cuh) and accumulate in f32. The host builds the
tile list (one entry per 64 rows of one group) from the group offsets, a small copy. cupy is imported by the caller.
"""

from __future__ import annotations

from importlib.resources import files
from typing import Any

import numpy as np

from strata_core.api.kernels import ExpertPool
from strata_core.reference.quants import GGML_TYPES

SOURCE_NAME = "moe_quant.cu"
KERNEL_NAMES = ("strata_quant_gate_up", "strata_quant_down")
#: The tensor-core variant (mma.sync, f16 inputs, f32 accumulation; CUDA only).
MMA_KERNEL_NAMES = ("strata_quant_gate_up_mma", "strata_quant_down_mma")
#: QT_M, QT_N, QT_THREADS and QM_THREADS of moe_quant.cu.
TILE_ROWS = 64
TILE_OUTPUTS = 64
THREADS = 256
MMA_THREADS = 128
#: Whether the cuda KernelSet takes the tensor-core variant. Off until tests/gpu/test_quant_cuda.py has passed
#: for it on a GPU (its fragment layout is checked here only by an emulation of the instruction on the host).
MMA_BY_DEFAULT = False


def source_dir() -> str:
    """The package directory: moe_quant.cu includes quants.cuh from it (-I)."""
    return str(files("strata_cuda"))


def compile_options() -> tuple[str, ...]:
    """NVRTC / hiprtc options of moe_quant.cu."""
    return ("-std=c++17", f"-I{source_dir()}")


def kernel_source() -> str:
    """The text of strata_cuda/moe_quant.cu."""
    return files("strata_cuda").joinpath(SOURCE_NAME).read_text()


def compile_to_ptx(arch: str = "compute_90") -> bytes:
    """moe_quant.cu compiled to PTX with NVRTC (no GPU needed); RuntimeError with NVRTC's log on failure."""
    from cupy_backends.cuda.libs import nvrtc
    prog = nvrtc.createProgram(kernel_source(), SOURCE_NAME, (), ())
    try:
        try:
            nvrtc.compileProgram(prog, (f"-arch={arch}", *compile_options()))
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"NVRTC failed on {SOURCE_NAME} ({e}):\n{nvrtc.getProgramLog(prog)}") from None
        return nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)


def tile_list(offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(group, first row) of every TILE_ROWS-row tile of the non-empty groups (int32 each)."""
    offsets = np.asarray(offsets, dtype=np.int64)
    groups, rows = [], []
    for g in range(len(offsets) - 1):
        lo, hi = int(offsets[g]), int(offsets[g + 1])
        starts = np.arange(lo, hi, TILE_ROWS)
        groups.append(np.full(len(starts), g))
        rows.append(starts)
    if not groups:
        return np.zeros(0, np.int32), np.zeros(0, np.int32)
    return np.concatenate(groups).astype(np.int32), np.concatenate(rows).astype(np.int32)


class QuantGroupedFFN:
    """moe_grouped_ffn over a 'gguf' pool on the current cupy device (see the module docstring)."""

    def __init__(self, cupy: Any, mma: bool | None = None):
        self._cp = cupy
        #: tensor cores (mma.sync, f16 inputs) or the f32 SIMT kernels
        self.mma = MMA_BY_DEFAULT if mma is None else bool(mma)
        self._module = cupy.RawModule(code=kernel_source(), options=compile_options())
        # compile now, so a broken toolchain fails at start-up and not in the middle of a request
        names = MMA_KERNEL_NAMES if self.mma else KERNEL_NAMES
        self._gate_up, self._down = (self._module.get_function(n) for n in names)
        self._threads = MMA_THREADS if self.mma else THREADS

    def __call__(self, x: Any, offsets: Any, slots: Any, pool: ExpertPool) -> Any:
        """x [N,H] f32 (cupy); rows offsets[g]:offsets[g+1] run the expert in slot slots[g] -> y [N,H] f32."""
        cp = self._cp
        fmt = pool.fmt
        x = cp.ascontiguousarray(cp.asarray(x, dtype=cp.float32))
        n, h = (int(s) for s in x.shape)
        blob = pool.arrays["blob"]
        s_slots, slot_b = (int(s) for s in blob.shape)
        if h != fmt.hidden or fmt.nbytes > slot_b:
            raise ValueError(f"moe_grouped_ffn: x has hidden {h}, the experts {fmt.hidden} in {fmt.nbytes}-byte "
                             f"slots of {slot_b}")
        off_h = _host(offsets).astype(np.int32)
        groups, rows0 = tile_list(off_h)
        f = fmt.ffn
        y = cp.zeros((n, h), dtype=cp.float32)  # rows in no group stay zero, as in the reference
        if len(groups) == 0:
            return y
        off_d, slots_d = cp.asarray(off_h), cp.asarray(_host(slots).astype(np.int32))
        grp_d, row_d = cp.asarray(groups), cp.asarray(rows0)
        act = cp.empty((n, f), dtype=cp.float32)
        bias_off = np.int64(fmt.bias_offset if fmt.bias else -1)
        t = len(groups)
        self._gate_up(
            ((f + TILE_OUTPUTS - 1) // TILE_OUTPUTS, t), (self._threads,),
            (x, off_d, slots_d, grp_d, row_d, np.int32(s_slots), np.int32(h), np.int32(f), blob, np.int64(slot_b),
             np.int64(fmt.gate_up_row_bytes), np.int32(GGML_TYPES[fmt.gate_up]), bias_off, act))
        self._down(
            ((h + TILE_OUTPUTS - 1) // TILE_OUTPUTS, t), (self._threads,),
            (act, off_d, slots_d, grp_d, row_d, np.int32(s_slots), np.int32(h), np.int32(f), blob, np.int64(slot_b),
             np.int64(fmt.down_offset), np.int64(fmt.down_row_bytes), np.int32(GGML_TYPES[fmt.down]), bias_off, y))
        return y


def _host(a: Any) -> np.ndarray:
    """A small index array on the host (cupy arrays are copied down; numpy and lists pass through)."""
    get = getattr(a, "get", None)
    return np.asarray(get() if callable(get) else a)
