#!/usr/bin/env bash
# The 2026-12-02 (third) session's second H200 call: the fused-decode test with Q8_0 in mixed slots (a file all in
# Q8_0 loads as the native q8_0 pool, so call 1's q8_0/q8_0 case had no blob), the fused quant launches at BM 256
# (each weight decoded about once per expert instead of ~2.5 times at BM 128: call 1's best was 2.78x f16), and
# `strata run` at Qwen3-30B-A3B@Q8_0, the three settings and the peers (strata_run_h200_q8_0.json: the link floors
# and the half-skewed decode's link bounds of the run's own expert bytes). Files: gpu_tests.log,
# quant_layer_h200.json, strata_run_h200_q8_0.json, lane.log.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
lane_gpu_tests 150 tests/gpu/test_quant_warm.py
timeout -k 10 150 python3 bench/quant_layer_h200.py --out "$OUT" --reps 5 --variants auto:classes \
  auto:classes:fused:q256x32x8x2+256x32x8x2 auto:classes:fused:q256x64x8x2+256x64x8x2 \
  auto:classes:fused:q256x16x8x2+256x32x8x2 2>&1 | grep -v "^tiled\|^KernelSet" | grep "QuantMoE\|warm_prefill" || rc=1
timeout -k 10 300 python3 bench/strata_run_h200.py --out "$OUT" --model Qwen3-30B-A3B@Q8_0 --timeout 100 2>&1 \
  | cut -c1-400 | tail -12 || rc=1
echo "lane took $(( $(date +%s) - t0 )) s"
exit $rc
