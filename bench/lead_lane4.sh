#!/usr/bin/env bash
# The lead's final H200 call of the 2026-12-01 late session (lead_lane3.sh's steps plus the layer bench): every
# tests/gpu file in its own pytest process (the conformance kit with --strata-backend cuda), `strata run --backend
# cuda --check` twice on the tiny model (same outputs_sha256), bench/strata_run_h200.py with the three cache settings,
# the peers and --fidelity, bench/quant_layer_h200.py (auto:classes) and bench/layer_h200.py (classes:4, warm
# uniform/skewed, cold). Files in $OUT (8, the device tool's limit): gpu_tests.log, run_cuda_1.json, run_cuda_2.json,
# strata_run_h200.json, fidelity_h200.json, quant_layer_h200.json, layer_h200.json, lane.log (everything printed,
# the runs' stderr too). Carry .whl and strata_core.egg-info.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lane_common.sh"
lane_start
lane_gpu_tests 150
echo "tests/gpu took $(( $(date +%s) - t0 )) s"
for i in 1 2; do
  timeout -k 10 150 python3 -m strata_core.cli run --backend cuda --check --json > "$OUT/run_cuda_$i.json" || rc=1
done
python3 - "$OUT" <<'PY'
import json, sys
runs = [json.load(open(f"{sys.argv[1]}/run_cuda_{i}.json")) for i in (1, 2)]
for d in runs:
    print("strata run --backend cuda --check:", d.get("check"), "sha", (d.get("outputs_sha256") or "")[:16],
          "peak", d.get("device_bytes_peak_measured"), "planned", d.get("device_bytes_planned"))
print("same outputs_sha256 twice:", runs[0].get("outputs_sha256") == runs[1].get("outputs_sha256"))
PY
timeout -k 10 "${RUN_S:-300}" python3 bench/strata_run_h200.py --out "$OUT" --fidelity --timeout 80 2>&1 | tail -40 || rc=1
timeout -k 10 "${QUANT_S:-80}" python3 bench/quant_layer_h200.py --out "$OUT" --reps 5 --variants auto:classes 2>&1 | tail -15 || rc=1
timeout -k 10 "${LAYER_S:-90}" python3 bench/layer_h200.py --out "$OUT" --skip generation --variants classes:4 --reps 9 2>&1 | tail -12 || rc=1
echo "lane took $(( $(date +%s) - t0 )) s"
exit $rc
