#!/usr/bin/env bash
# 2026-12-04 second session, H200 call 7, the final tree: the device-table path the default for warm 'gguf' layers
# (quant_ffn.WARM_DEVICE, its first groups ahead of the routing: WARM_DEVICE_AHEAD). The GPU test files of the quant
# prefill, the layer ops, the device GEMMs and the kit; two planted faults in the groups-ahead code against
# test_quant_warm.py; then the Q4_K_M layer bench with the default and the host-synced path: the committed
# bench/results/quant_layer_h200.json. Files: gpu_tests.log, quant_layer_h200.json, lane.log.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
TEST_S=150 lane_gpu_tests 150 tests/gpu/test_quant_warm.py tests/gpu/test_quant_cuda.py tests/gpu/test_layer_ops.py \
  tests/gpu/test_device_gemm.py tests/gpu/test_fast_paths.py tests/gpu/test_quant_decode.py \
  tests/gpu/test_cuda_kernels_conformance.py
echo "tests done at $(( $(date +%s) - t0 )) s"
lane_planted_faults backends/cuda/strata_cuda/quant_ffn.py tests/gpu/test_quant_warm.py \
  's/w13, w2 = self._dequant(pool, table, e_hi - e_lo, half)/w13, w2 = self._dequant(pool, table, e_hi - e_lo, 1 - half)/' \
  '/def _dequant_ahead/,/got = \[\]/s/side.wait_event(fork)/pass/'
echo "faults done at $(( $(date +%s) - t0 )) s"
timeout -k 10 240 python3 bench/quant_layer_h200.py --out "$OUT" --variants auto:classes auto:classes:host \
  auto:classes:device:noahead 2>&1 | grep -v "^ " | cut -c1-300 | tail -14 || rc=1
echo "quant bench done at $(( $(date +%s) - t0 )) s"
exit $rc
