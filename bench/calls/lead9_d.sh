#!/usr/bin/env bash
# The 2026-12-02 (fourth) session's fourth H200 call, at the session's final code: quant_fast.cu is the source call 2
# timed (the trial forms of call 3 removed), 'sbt' QuantMoE's default dequantization, Q8_0 on the third decode forms.
# The tests/gpu files over those sources first, then quant_layer_h200.py (the default host-synced path and the
# device-table path, both with sbt, and the trial sbt_o8: that source held to 32 registers), then `strata run` at Qwen3-30B-A3B@Q8_0 with the peers.
# Files: gpu_tests.log, quant_layer_h200.json, strata_run_h200_q8_0.json, lane.log.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
TEST_S=110 lane_gpu_tests 110 tests/gpu/test_quant_warm.py tests/gpu/test_decode_forms.py tests/gpu/test_fast_paths.py \
  tests/gpu/test_quant_cuda.py tests/gpu/test_quant_decode.py
echo "tests done at $(( $(date +%s) - t0 )) s"
timeout -k 10 120 python3 bench/quant_layer_h200.py --out "$OUT" --reps 7 --variants auto:classes auto:classes:sbt_o8 auto:classes:device \
  2>&1 | grep -v "^tiled\|^KernelSet" | grep "HBM\|QuantMoE.*warm\|decode:" | cut -c1-330 || rc=1
echo "quant bench done at $(( $(date +%s) - t0 )) s"
timeout -k 10 180 python3 bench/strata_run_h200.py --out "$OUT" --model Qwen3-30B-A3B@Q8_0 --timeout 100 2>&1 \
  | cut -c1-260 | grep -v transformers | tail -5 || rc=1
echo "lane took $(( $(date +%s) - t0 )) s"
exit $rc
