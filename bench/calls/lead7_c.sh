#!/usr/bin/env bash
# The 2026-12-02 (second) session's third H200 call: warm 'gguf' layers on the device-table path
# (QuantMoE._device_experts: scratch halves dequantized on the side stream group by group, each group's triton_moe
# launches behind it). tests/gpu files that run QuantMoE and the device-table path, two planted faults in
# quant_ffn.py that test_quant_warm.py must catch (restored after), then quant_layer_h200.py (the device-table warm
# path against the host-synced one) and layer_h200.py (the f16 path after the kernel took an expert range).
# Files: gpu_tests.log, quant_layer_h200.json, layer_h200.json, lane.log.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
lane_gpu_tests 150 tests/gpu/test_device_gemm.py tests/gpu/test_quant_warm.py tests/gpu/test_quant_cuda.py \
  tests/gpu/test_fast_paths.py tests/gpu/test_layer_ops.py
lane_planted_faults backends/cuda/strata_cuda/quant_ffn.py tests/gpu/test_quant_warm.py \
  's/w13, w2 = self._dequant(pool, table + 4 \* e_lo, e_hi - e_lo, half)/w13, w2 = self._dequant(pool, table, e_hi - e_lo, half)/' \
  's/            self.device_gemm.layer(main.ptr, xs, act, ys, int(w13\[0\]), int(w2\[0\]), counts, row_of, None,/            self.device_gemm.layer(main.ptr, xs, act, ys, int(w13[0]), int(w13[0]), counts, row_of, None,/'
timeout -k 10 120 python3 bench/quant_layer_h200.py --out "$OUT" --reps 5 --variants auto:classes auto:classes:host 2>&1 | tail -16 || rc=1
timeout -k 10 90 python3 bench/layer_h200.py --out "$OUT" --skip generation --variants "classes:4:t,classes:4" --reps 9 2>&1 | tail -8 || rc=1
echo "lane took $(( $(date +%s) - t0 )) s"
exit $rc
