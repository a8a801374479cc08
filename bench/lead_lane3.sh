#!/usr/bin/env bash
# The lead's final H200 call of the 2026-12-01 evening session: every tests/gpu file in its own pytest process (a sticky
# CUDA error in one file cannot fail the files after it; test_fidelity.py first, as it reads the driver's free memory), `strata run --backend cuda --check` twice on the tiny model (same
# outputs_sha256), bench/strata_run_h200.py with the three cache settings, the peers and --fidelity, then
# bench/quant_layer_h200.py. Files in $OUT: gpu_tests.log, run_cuda_1.json, run_cuda_2.json, runs.err,
# strata_run_h200.json, fidelity_h200.json, quant_layer_h200.json, lane.log. Carry .whl and strata_core.egg-info.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lane_common.sh"
lane_start
lane_gpu_tests 150  # every tests/gpu file, each in its own process (bench/lane_common.sh)
echo "tests/gpu took $(( $(date +%s) - t0 )) s"
# --check twice (same outputs_sha256) and strata_run_h200.py --fidelity: cuda_lane.sh's steps, its tests and layer bench off
SKIP_TESTS=1 SKIP_LAYER=1 RUN_S="${RUN_S:-260}" RUN_ARGS="--fidelity --timeout 80" bash bench/cuda_lane.sh || rc=1
# REPEAT_ALL=1: the all-cached setting once more (a one-chunk prefill figure varies between runs); its summary line
# goes to lane.log only (the device tool brings back 8 files, all taken)
if [[ "${REPEAT_ALL:-0}" == 1 ]]; then
  timeout -k 10 90 python3 bench/strata_run_h200.py --settings all --skip-peers --out /tmp/repeat_all 2>&1 | tail -3 || rc=1
fi
timeout -k 10 "${QUANT_S:-80}" python3 bench/quant_layer_h200.py --out "$OUT" --reps 5 --variants auto:classes 2>&1 | tail -15 || rc=1
echo "lane took $(( $(date +%s) - t0 )) s"
exit $rc
