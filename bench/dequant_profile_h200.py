"""The dequantization kernels of QuantMoE's warm prefill (quant_ffn.DEQUANT_KERNELS), one launch each over a group of
32 Qwen3-30B-A3B Q4_K_M experts (gate/up Q4_K, down Q6_K), for Nsight Compute to read: run it under
`ncu --clock-control none -k regex:strata_qf_dequant ...` on the H200 (bench/calls/lead9_b.sh). Prints each kernel's
event time too (one launch after a warm-up; the timed figures are quant_layer_h200.py's)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_layer_h200 import E, RING, build  # noqa: E402


def main() -> int:
    """One launch of each dequantization kernel over 32 experts (after one warm-up launch each)."""
    import cupy as cp

    from strata_core.api.kernels import ExpertPool
    from strata_cuda.quant_ffn import DEQUANT_KERNELS, QuantMoE
    fmt, blob, _, _ = build(argparse.Namespace(templates=2))
    dev = cp.empty((E + RING, fmt.nbytes), cp.uint8)
    dev[:E].set(blob)
    pool = ExpertPool("gguf", {"blob": dev}, (fmt,))
    moe = QuantMoE(E, 8, fmt)
    with moe.compute_stream:
        tab = moe._upload_slots(np.arange(E, dtype=np.int32))
    m = min(32, moe.layout.group_experts)
    for kern in DEQUANT_KERNELS:
        moe.dequant_kernel = kern
        with moe.compute_stream:
            moe._dequant(pool, tab, m, 0)  # warm-up (compiles)
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record()
            moe._dequant(pool, tab, m, 0)
            b.record()
        b.synchronize()
        print(f"{kern}: {m} experts {cp.cuda.get_elapsed_time(a, b):.3f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
