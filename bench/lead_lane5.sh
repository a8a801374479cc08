#!/usr/bin/env bash
# The lead's H200 lane of the 2026-12-02 session: lead_lane4.sh's steps (every tests/gpu file in its own pytest
# process, `strata run --backend cuda --check` twice, bench/strata_run_h200.py --fidelity, quant_layer_h200.py
# auto:classes, layer_h200.py $LAYER_VARIANTS, default classes:4), then bench/link_trace_h200.py's half-skewed run
# in a process per $AHEAD variant, default: the default, :ring0 (copy groups placed from ring slot 0 every layer, as
# before) and :hostembed (the prompt's rows gathered on the host, as before). Files in $OUT (8, the device tool's
# limit): gpu_tests.log, run_cuda.json (both --check runs), strata_run_h200.json, fidelity_h200.json,
# quant_layer_h200.json, layer_h200.json, link_trace_h200.json, lane.log (everything printed). Carry .whl and
# strata_core.egg-info.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lane_common.sh"
lane_start
lane_gpu_tests 150
echo "tests/gpu took $(( $(date +%s) - t0 )) s"
runs=/tmp/runs; mkdir -p $runs
for i in 1 2; do
  timeout -k 10 150 python3 -m strata_core.cli run --backend cuda --check --json > "$runs/run_cuda_$i.json" || rc=1
done
python3 - "$runs" "$OUT" <<'PY'
import json, sys
runs = [json.load(open(f"{sys.argv[1]}/run_cuda_{i}.json")) for i in (1, 2)]
for d in runs:
    print("strata run --backend cuda --check:", d.get("check"), "sha", (d.get("outputs_sha256") or "")[:16],
          "peak", d.get("device_bytes_peak_measured"), "planned", d.get("device_bytes_planned"))
print("same outputs_sha256 twice:", runs[0].get("outputs_sha256") == runs[1].get("outputs_sha256"))
json.dump({"runs": runs}, open(f"{sys.argv[2]}/run_cuda.json", "w"), indent=1)
PY
timeout -k 10 "${RUN_S:-300}" python3 bench/strata_run_h200.py --out "$OUT" --fidelity --timeout 80 2>&1 | tail -40 || rc=1
timeout -k 10 "${QUANT_S:-80}" python3 bench/quant_layer_h200.py --out "$OUT" --reps 5 --variants auto:classes 2>&1 | tail -15 || rc=1
timeout -k 10 "${LAYER_S:-90}" python3 bench/layer_h200.py --out "$OUT" --skip generation --variants "${LAYER_VARIANTS:-classes:4}" --reps 9 2>&1 | tail -12 || rc=1
timeout -k 10 "${TRACE_S:-120}" python3 bench/link_trace_h200.py --out "$OUT" --decode 32 --ahead "${AHEAD:-default,default:ring0,default:hostembed}" 2>&1 | tail -10 || rc=1
echo "lane took $(( $(date +%s) - t0 )) s"
exit $rc
