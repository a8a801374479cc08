#!/usr/bin/env bash
# The 2026-12-02 (fourth) session's second H200 call: (0) tests; (1) Nsight Compute over the three dequantization kernels of
# QuantMoE's warm prefill (bench/dequant_profile_h200.py: why the sb kernel runs at 2.2 TB/s where a memset of the
# same f16 bytes runs at 4.1); (2) an A/B of decode admission in the half-skewed `strata run` (default 64 MiB a step,
# 16 MiB, none), Q8_0 and F16: the admission copies share the link with the decode's mapped reads; (3) the tests/gpu
# files call 1 did not run that read the changed sources, and test_quant_warm.py again (the fixed-format
# dequantization kernels, sbt), first; then quant_layer_h200.py: sb, sbt and chunk. Files: gpu_tests.log,
# ncu_dequant.txt, quant_layer_h200.json, ab_q8/strata_run_h200_q8_0.json, ab_f16/strata_run_h200.json, lane.log.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
TEST_S=100 lane_gpu_tests 100 tests/gpu/test_quant_warm.py tests/gpu/test_quant_decode.py tests/gpu/test_quant_cuda.py \
  tests/gpu/test_layer_ops.py tests/gpu/test_device_gemm.py tests/gpu/test_prefetch.py
echo "tests done at $(( $(date +%s) - t0 )) s"
timeout -k 10 150 ncu --clock-control none --kernel-name regex:strata_qf_dequant --launch-count 10 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  --section MemoryWorkloadAnalysis python3 bench/dequant_profile_h200.py > "$OUT/ncu_dequant.txt" 2>&1 || rc=1
grep -E "^  strata_qf|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Compute \(SM\)|^[a-z]+: " \
  "$OUT/ncu_dequant.txt" | head -60
echo "ncu done at $(( $(date +%s) - t0 )) s"
timeout -k 10 130 python3 bench/quant_layer_h200.py --out "$OUT" --reps 5 --variants auto:classes auto:classes:sbt \
  auto:classes:chunk 2>&1 | grep -v "^tiled\|^KernelSet" | grep "HBM\|QuantMoE.*warm" | cut -c1-330 || rc=1
for m in Q8_0:ab_q8 F16:ab_f16; do
  timeout -k 10 150 python3 bench/strata_run_h200.py --out "$OUT/${m#*:}" --model "Qwen3-30B-A3B@${m%%:*}" \
    --settings half_skewed,half_skewed_admit0,half_skewed_admit16 --skip-peers --timeout 100 2>&1 \
    | cut -c1-260 | grep "^half" || rc=1
done
echo "A/B done at $(( $(date +%s) - t0 )) s"
echo "lane took $(( $(date +%s) - t0 )) s"
exit $rc
