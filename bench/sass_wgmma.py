"""quant_mma.cu's sm_90a build as SASS, per kernel: its HGMMAs, its waits on them (WARPGROUP.DEPBAR), how many
instructions stand between a step's last HGMMA and the wait (the work that overlaps the tensor cores), and its
generic loads and stores. Needs NVRTC
(cupy) and the `nvdisasm` of a CUDA toolkit (or of the `nvidia-cuda-nvdisasm` wheel) and `ptxas` on PATH or given;
no GPU. Also prints ptxas's notes about wgmma (C7517/C7518) from NVRTC's log.

    python bench/sass_wgmma.py [--source FILE.cu] [--nvdisasm PATH] [--ptxas PATH] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends" / "cuda"))


def kernels_of(sass: str) -> dict[str, list[str]]:
    """Each kernel's instruction lines, by name, from nvdisasm's text."""
    parts = re.split(r"\n\s*\.text\.(\w+):", sass)
    return {parts[i]: [ln for ln in parts[i + 1].split("\n") if re.search(r"/\*[0-9a-f]{4,}\*/", ln)]
            for i in range(1, len(parts), 2)}


def overlap(lines: list[str]) -> dict:
    """HGMMA and wait counts, and the instructions between each run of HGMMAs and the wait after it."""
    gaps, last = [], None
    for j, ln in enumerate(lines):
        if "HGMMA" in ln:
            last = j
        elif "WARPGROUP.DEPBAR" in ln and last is not None:
            gaps.append(j - last - 1)
            last = None
    ops = [re.sub(r"^\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?", "", ln).split(" ", 1)[0] for ln in lines]
    return {"hgmma": sum("HGMMA" in ln for ln in lines), "waits": sum("WARPGROUP.DEPBAR" in ln for ln in lines),
            "instructions_before_each_wait": gaps,
            # generic loads / stores (a pointer whose address space the compiler lost), and the global ones
            "generic_ld_st": sum(o.startswith(("LD.", "ST.")) for o in ops),
            "global_loads": sum(o.startswith("LDG.") for o in ops), "instructions": len(lines)}


def main() -> None:
    """Build, disassemble, report."""
    from strata_cuda import quant_mma
    from strata_cuda.kernels import nvrtc_compile
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", help="a .cu to build instead of strata_cuda/quant_mma.cu")
    ap.add_argument("--nvdisasm", default="nvdisasm")
    ap.add_argument("--ptxas", default="ptxas")
    ap.add_argument("--out")
    args = ap.parse_args()
    text = Path(args.source).read_text() if args.source else quant_mma.kernel_source()
    log: list[str] = []
    opts = (f"-arch={quant_mma.WGMMA_ARCH}", "-std=c++17")
    nvrtc_compile(text, quant_mma.SOURCE_NAME, (*opts, "--ptxas-options=-v"), cubin=True, log=log)
    ptx = nvrtc_compile(text, quant_mma.SOURCE_NAME, opts).decode()
    notes = sorted({ln.split(" : ", 1)[-1] for ln in "".join(log).splitlines() if "(C751" in ln})
    with tempfile.TemporaryDirectory() as d:
        # NVRTC's cubin is disassembled through the toolkit's ptxas when the two disagree on the ELF version; the
        # PTX's .version is lowered to what that ptxas reads (the instructions are the same)
        ver = subprocess.run([args.ptxas, "--version"], capture_output=True, text=True).stdout
        m = re.search(r"release (\d+)\.(\d+)", ver)
        if m:
            ptx = re.sub(r"^\.version \S+", f".version {int(m.group(1)) - 4}.{m.group(2)}", ptx, count=1, flags=re.M)
        (Path(d) / "q.ptx").write_text(ptx)
        subprocess.run([args.ptxas, f"-arch={quant_mma.WGMMA_ARCH}", "-o", f"{d}/q.cubin", f"{d}/q.ptx"], check=True,
                       capture_output=True)
        sass = subprocess.run([args.nvdisasm, "-c", f"{d}/q.cubin"], check=True, capture_output=True,
                              text=True).stdout
    res = {"source": args.source or "strata_cuda/quant_mma.cu", "ptxas": ver.strip().splitlines()[-1] if ver else None,
           "notes": notes,
           "kernels": {k: overlap(v) for k, v in sorted(kernels_of(sass).items())}}
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
