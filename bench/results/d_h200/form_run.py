"""One `strata run` of bench/strata_run_h200.py's all-cached setting (same model, prompt, decode tokens and cache
size, computed by that script's own functions) with fast.DECODE_FORM and fast.DECODE_PDL set to the arguments, so
decode forms compare end to end in one device call. Usage: form_run.py FORM PDL(0|1) > run.json
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path


def main() -> int:
    """Set the decode form and launch kind, then run the CLI in this process (its JSON goes to stdout)."""
    form, pdl = int(sys.argv[1]), sys.argv[2] == "1"
    g = runpy.run_path(str(Path(__file__).resolve().parents[2] / "strata_run_h200.py"), run_name="strata_run_bench")
    total = g["LAYERS"] * g["E"]
    loan = int(((g["plan_json"](total).get("prompt") or {}).get("max_loan_slots")) or 0)
    from strata_cuda import fast
    fast.DECODE_FORM, fast.DECODE_PDL = form, pdl
    from strata_core.cli import main as cli_main
    sys.argv = ["strata", "run", "--backend", "cuda", "--model", g["MODEL"], "--prompt-tokens", str(g["PROMPT"]),
                "--decode-tokens", str(g["DECODE"]), "--json", "--set", f"prefill.chunk={g['PROMPT']}",
                "--set", f"memory.expert_cache={total + loan}"]
    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
