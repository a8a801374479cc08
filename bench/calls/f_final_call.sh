#!/usr/bin/env bash
# Engineer F's last H200 call (issue 12.2, plan fidelity): tests/gpu (all of it, tests/gpu/test_fidelity.py among
# them), then the fidelity runs of bench/strata_run_h200.py (tiny at chunks 4096 and 16384, Qwen3-30B-A3B@Q8_0 at
# 4096 and 16384; no cache settings, no peers), and, only where a run leaves [0.98, 1] x planned, the diagnostic
# (bench/fidelity_diag_h200.py) of the tiny and Q8_0 4096 runs. Files in $OUT: gpu_tests.log, fidelity_h200.json,
# strata_run_h200.json, lane.log (and fidelity_diag.json). Carry .whl and strata_core.egg-info.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee "$OUT/lane.log") 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:$PWD/backends/cuda:$PWD/backends/rocm:$PWD/backends/sycl:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
rc=0
timeout "${TEST_S:-200}" python3 -m pytest -p no:cacheprovider -q -rfE tests/gpu > "$OUT/gpu_tests.log" 2>&1 || rc=1
grep -E "passed|failed|FAILED|ERROR" "$OUT/gpu_tests.log" | tail -20
timeout "${FID_S:-150}" python3 bench/strata_run_h200.py --out "$OUT" --fidelity --settings "" --skip-peers \
  --timeout 70 2>&1 | tail -8 || rc=1
python3 - "$OUT/fidelity_h200.json" <<'PY' || { rc=1; timeout 80 python3 bench/fidelity_diag_h200.py --out "$OUT" --configs tiny_4096,q8_4096 --timeout 35 2>&1 | tail -30; }
import json, sys
rows = json.load(open(sys.argv[1]))["runs"]
bad = [r for r in rows if not (r.get("peak_over_planned") and 0.98 <= r["peak_over_planned"] <= 1.0)]
for r in rows:
    print(r["model"], r["chunk"], r.get("device_bytes_planned"), r.get("device_bytes_peak_measured"), r.get("peak_over_planned"))
sys.exit(1 if bad else 0)
PY
exit $rc
