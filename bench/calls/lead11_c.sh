#!/usr/bin/env bash
# The 2026-12-03 second session's third H200 call, at the final code (the decode code of call 2, whose benchmark is
# the committed strata_run_h200*.json): every tests/gpu file in its own process, then `strata run --backend cuda
# --check` twice on the tiny model (the same outputs_sha256), through cuda_lane.sh with its tests, layer bench and
# strata_run_h200.py off. Files: gpu_tests.log, run_cuda_1.json, run_cuda_2.json, runs.err, lane.log.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
TEST_S=110 lane_gpu_tests 110
echo "tests/gpu took $(( $(date +%s) - t0 )) s"
SKIP_TESTS=1 SKIP_LAYER=1 SKIP_RUN=1 bash bench/cuda_lane.sh || rc=1
echo "lane took $(( $(date +%s) - t0 )) s"
exit $rc
