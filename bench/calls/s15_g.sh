#!/usr/bin/env bash
# 2026-12-04 second session, H200 call 8: call 7's planted faults in the groups-ahead code were not caught (both are
# races the tiny test layers never lose); test_quant_warm.py now holds the compute stream back with a spinning kernel
# while two layers queue. The file, the fork fault against it, and the layer bench once more with the host-synced path
# timed first and last (call 6 timed it first: 1.923 ms a layer back to back; call 7 second: 1.518). Files:
# gpu_tests.log, quant_layer_h200.json, lane.log.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
TEST_S=150 lane_gpu_tests 150 tests/gpu/test_quant_warm.py
lane_planted_faults backends/cuda/strata_cuda/quant_ffn.py tests/gpu/test_quant_warm.py \
  '/def _dequant_ahead/,/got = \[\]/s/side.wait_event(fork)/pass/'
echo "faults done at $(( $(date +%s) - t0 )) s"
timeout -k 10 240 python3 bench/quant_layer_h200.py --out "$OUT" --variants auto:classes:host auto:classes \
  auto:classes:host:hostagain 2>&1 | grep "QuantMoE\|f16 FastMoE" | grep -v "cold with" | cut -c1-200 | tail -14 || rc=1
echo "quant bench done at $(( $(date +%s) - t0 )) s"
exit $rc
