"""What the 'gguf' (QuantMoE) path takes from the device outside the plan's lines, step by step, as the driver
reports it (cudaMemGetInfo's used bytes, after a synchronize, cupy's pool emptied).

`strata run --model Qwen3-30B-A3B@Q4_K_M` on an H100 (bench/results/s19_h100/call3_) measured its device peak
8,674,304 bytes over the plan in every cache setting, where F16 and Q8_0 runs measured the plan exactly. This
script builds the pieces the gguf path adds after a session's baseline, one at a time, on a bare process:
quant_fast.cu's and quant_decode.cu's modules, quant_mma.cu's module, then a QuantMoE for each of the two Q4_K_M
formats of the Qwen3-30B-A3B shape with its decode buffers and one warm-up of its GEMM classes. Each step's
figure is the driver's used bytes after it minus before it. Writes quant_device_bytes.json to --out.

    python3 bench/quant_device_bytes.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def used_bytes(cp) -> int:
    """The device's used bytes as the driver reports them, after the device is idle and cupy's pools are empty."""
    cp.cuda.Device().synchronize()
    cp.get_default_memory_pool().free_all_blocks()
    cp.get_default_pinned_memory_pool().free_all_blocks()
    free, total = cp.cuda.runtime.memGetInfo()
    return int(total) - int(free)


def main() -> int:
    """Measure each step's device bytes and write the JSON; 0 when every step ran."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    import cupy as cp

    from strata_core.api.kernels import ExpertFormat
    from strata_cuda import quant_ffn, quant_mma
    from strata_cuda.fast import warm_gemms

    cp.cuda.Device(0).use()
    cp.zeros(1)  # the context, before the baseline (a session has one before it plans)
    steps: list[dict] = []
    errors: list[str] = []
    keep: list = []  # what each step built, alive to the end (a freed module or buffer would not be counted)

    def step(name: str, fn) -> None:
        before = used_bytes(cp)
        try:
            keep.append(fn())
        except Exception as e:  # a step that cannot run here is said, the others still measured
            errors.append(f"{name}: {type(e).__name__}: {e}")
            return
        after = used_bytes(cp)
        steps.append({"step": name, "device_bytes": after - before})
        print(f"{name}: {after - before:,} bytes", flush=True)

    step("quant_fast.cu module", lambda: quant_ffn.fast_kernels(cp))
    step("quant_decode.cu module", lambda: quant_ffn.decode_kernels(cp))
    step("quant_mma.cu module (sm_90a)", lambda: quant_mma._load_module(cp, ()))
    for down in ("q4_k", "q6_k"):
        fmt = ExpertFormat("q4_k", down, 2048, 768)
        moe: list = []
        step(f"QuantMoE q4_k/{down}", lambda f=fmt: moe.append(quant_ffn.QuantMoE(128, 8, f)) or moe[0])
        if moe:
            step(f"QuantMoE q4_k/{down} decode_buffers", lambda m=moe[0]: m.decode_buffers())
            step(f"QuantMoE q4_k/{down} warm_gemms", lambda m=moe[0]: warm_gemms(m, 4096, "gguf"))
    total = sum(s["device_bytes"] for s in steps)
    name = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    res = {"schema": "strata.bench.quant_device_bytes/1", "device": name, "how": __doc__.split("\n\n")[0],
           "steps": steps, "total_device_bytes": total, "errors": errors}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "quant_device_bytes.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    print(f"total {total:,} bytes; errors: {errors}")
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
