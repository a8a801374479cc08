"""bench/quant_layer_h200.py once per variant, each in its own process, into --out/<variant>/ (the device tool
brings files back two folders down): `default`; `nopull` (fast.PULL_SMALL_COPIES off: small tables through
cudaMemcpyAsync, as before 2003cd5); `sb` (quant_ffn.DEQUANT_KERNEL = "sb", the default before a15a956)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

PATCH = {"default": "", "nopull": "import strata_cuda.fast as f; f.PULL_SMALL_COPIES = False",
         "sb": "import strata_cuda.quant_ffn as q; q.DEQUANT_KERNEL = 'sb'"}


def main() -> int:
    """Each variant's quant_layer_h200.json under --out/<variant>."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=".")
    ap.add_argument("--variants", default="default,nopull,sb")
    ap.add_argument("--timeout", type=int, default=70)
    args = ap.parse_args()
    bench = Path(__file__).resolve().parent / "quant_layer_h200.py"
    rc = 0
    for v in args.variants.split(","):
        out = Path(args.out) / v
        out.mkdir(parents=True, exist_ok=True)
        patch = f"{PATCH[v]}; " if PATCH[v] else ""
        code = (f"import sys, runpy; {patch}sys.argv = [{str(bench)!r}, '--out', {str(out)!r}, '--reps', '5', "
                f"'--variants', 'auto:classes']; runpy.run_path({str(bench)!r}, run_name='__main__')")
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=args.timeout)
        print(f"== {v} rc {p.returncode}")
        print("\n".join(p.stdout.splitlines()[-6:]))
        rc |= p.returncode not in (0, 1)  # 1: a target missed, still a measurement
    return rc


if __name__ == "__main__":
    sys.exit(main())
