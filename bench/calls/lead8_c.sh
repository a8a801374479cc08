#!/usr/bin/env bash
# The 2026-12-02 (third) session's third H200 call: Q8_0 pools on the device-table path (triton_moe.grouped_tn with
# Q8: the int8 quants and f16 scales decoded in the K loop; call 2 measured the cuBLAS path's Q8_0 layer at 11.8 ms).
# tests/gpu files of FastMoE and the layer ops, two planted faults in the Q8 decode that test_device_gemm.py must
# catch (restored after), then `strata run` at Qwen3-30B-A3B@Q8_0 and at F16 (the f16 launches' kernel was edited:
# the canonical file again), each with the peers, and layer_h200.py's default. Files: gpu_tests.log,
# strata_run_h200_q8_0.json, strata_run_h200.json, layer_h200.json, lane.log.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
lane_gpu_tests 150 tests/gpu/test_device_gemm.py tests/gpu/test_fast_paths.py tests/gpu/test_layer_ops.py
lane_planted_faults backends/cuda/strata_cuda/triton_moe.py tests/gpu/test_device_gemm.py \
  's/return tl.reshape(q \* d\[:, :, None\], (BN, BK))/return tl.reshape(q * d[:, :1, None], (BN, BK))/' \
  's/(K \/\/ 32) + tl.arange(0, BK \/\/ 32)/(K \/\/ 16) + tl.arange(0, BK \/\/ 32)/'
timeout -k 10 240 python3 bench/strata_run_h200.py --out "$OUT" --model Qwen3-30B-A3B@Q8_0 --timeout 100 2>&1 \
  | cut -c1-300 | grep -v transformers | tail -5 || rc=1
timeout -k 10 240 python3 bench/strata_run_h200.py --out "$OUT" --timeout 100 2>&1 \
  | cut -c1-300 | grep -v transformers | tail -5 || rc=1
timeout -k 10 90 python3 bench/layer_h200.py --out "$OUT" --skip generation --variants "classes:4:t,classes:4" --reps 9 \
  2>&1 | tail -6 || rc=1
echo "lane took $(( $(date +%s) - t0 )) s"
exit $rc
