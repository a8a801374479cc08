#!/usr/bin/env bash
# 2026-12-04 third session, H200 call 2: quant_mma.cu's kernels alone (call 1: the fused warm layer 2.16 ms, its GEMMs
# 1.97 ms of it, ~157 TFLOP/s): with and without the decode and the MMAs, against the f16 device GEMMs, and Nsight
# Compute on one gate|up and one down launch. Files: quant_mma_h200.json, mma_bench.log, ncu_mma.txt, gpu_tests.log.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
TEST_S=120 lane_gpu_tests 120 tests/gpu/test_quant_mma.py
timeout -k 10 150 python3 bench/quant_mma_h200.py --out "$OUT" --ablations > "$OUT/mma_bench.log" 2>&1 || rc=1
cut -c1-1500 "$OUT/mma_bench.log" | tail -30
echo "mma bench done at $(( $(date +%s) - t0 )) s"
timeout -k 10 200 ncu --clock-control none --kernel-name regex:strata_qm --launch-count 2 \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
  --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis python3 bench/quant_mma_h200.py --profile \
  > "$OUT/ncu_mma.txt" 2>&1 || rc=1
grep -E "strata_qm|Duration|Compute \(SM\) Throughput|Issue Slots Busy|Warp Cycles Per Issued|Stall|Registers|Achieved Occupancy|No Eligible|Memory Throughput|Executed Ipc A" "$OUT/ncu_mma.txt" | head -60
echo "ncu done at $(( $(date +%s) - t0 )) s"
exit $rc
