"""Registers, spills, shared memory and wgmma count of triton_moe's launches for sm_90, per tile config, with no GPU:
Triton compiles each specialization as a launch would (pointers 16-byte aligned) and the ptxas it carries reports
the registers and spills. A config that spills may pay for it on the H200; this ranks candidates before device
time is spent on them, no more: it is not the device's own compile (the driver, Triton's autotuned layout choices at
a real launch), and the f16 default, which reads as spilling here, ran fastest of those timed there. Writes
triton_compile_report.json in --out.

    python bench/triton_compile_report.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends" / "cuda"))

#: (BM, BN, BK, warps, stages) of the f16 launches (BK is the quant launches' QUANT_BK there)
F16_CONFIGS = [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 64, 64, 8, 4), (128, 64, 64, 4, 3),
               (64, 128, 64, 4, 3), (128, 256, 64, 8, 3)]
Q_CONFIGS = [(128, 64, 8, 2), (128, 32, 8, 2), (64, 64, 4, 2), (64, 128, 8, 2), (128, 128, 8, 2), (128, 64, 8, 3)]


def compile_one(fn, sig: dict, consts: dict, opts: dict) -> dict:
    """One specialization: its shared bytes, wgmma count and ptxas's registers and spills."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from strata_cuda import triton_moe as tm
    attrs = tm.LAUNCH_ATTRS
    t0 = time.perf_counter()
    c = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32), options=opts)
    ptx = c.asm["ptx"]
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        Path(d, "k.ptx").write_text(ptx)
        r = subprocess.run([ptxas, "-arch=sm_90a", "-v", f"{d}/k.ptx", "-o", f"{d}/k.cubin"], capture_output=True,
                           text=True)
    info = r.stderr
    regs = re.search(r"Used (\d+) registers", info)
    spill = re.search(r"(\d+) bytes spill stores", info)
    return {"shared_bytes": int(c.metadata.shared), "wgmma": ptx.count("wgmma.mma_async"),
            "registers": int(regs.group(1)) if regs else None,
            "spill_store_bytes": int(spill.group(1)) if spill else None,
            "compile_s": round(time.perf_counter() - t0, 2)}


def main() -> int:
    """Compile every config; write the report."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    import triton
    from strata_cuda import triton_moe as tm
    tm._kernels()
    k, kq = tm._STATE["k"], tm._STATE["kq"]
    res: dict = {"schema": "strata.bench.triton_compile/1", "triton": triton.__version__, "target": "cuda sm_90",
                 "f16": {}, "quant": {}}
    for bm, bn, bk, w, st in F16_CONFIGS:
        for sw in (True, False):
            name = f"{'gate_up' if sw else 'down'} {bm}x{bn}x{bk} w{w} s{st}"
            consts = {"EP": 128, "SWIGLU": sw, "SLOTS": True, "Q8": False, "BM": bm, "BN": bn, "BK": bk}
            res["f16"][name] = compile_one(k, tm.F16_SIGNATURE, consts, {"num_warps": w, "num_stages": st})
            print(name, res["f16"][name], flush=True)
    for typ in ("q4_k", "q6_k"):
        for bm, bn, w, st in Q_CONFIGS:
            for sw in (True, False):
                name = f"{typ} {'gate_up' if sw else 'down'} {bm}x{bn} w{w} s{st}"
                consts = {"EP": 128, "SWIGLU": sw, "FMT": tm._QUANT_TYPE_IDS[typ], "BB": tm.QUANT_BLOCK_BYTES[typ],
                          "Q0": tm._QS_OFFSET[typ], "BM": bm, "BN": bn, "BK": tm.QUANT_BK}
                res["quant"][name] = compile_one(kq, tm.QUANT_SIGNATURE, consts, {"num_warps": w, "num_stages": st,
                                                                     "enable_fp_fusion": False})
                print(name, res["quant"][name], flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "triton_compile_report.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
