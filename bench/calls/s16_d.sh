#!/usr/bin/env bash
# 2026-12-04 third session, H200 call 4: the wgmma path with a step's wgmmas running on into the next (4 input stages, 3 weight tiles): its
# GPU tests, two planted faults, the kernels alone against the f16 device GEMMs, the fused warm path's tests, then the
# layer bench with the default and the fused path. Files: gpu_tests.log, quant_mma_h200.json, quant_layer_h200.json.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
TEST_S=200 lane_gpu_tests 200 tests/gpu/test_quant_mma.py
echo "mma tests done at $(( $(date +%s) - t0 )) s"
timeout -k 10 150 python3 bench/quant_mma_h200.py --out "$OUT" --ablations > "$OUT/mma_bench.log" 2>&1 || rc=1
cut -c1-1200 "$OUT/mma_bench.log" | tail -6
echo "mma bench done at $(( $(date +%s) - t0 )) s"
lane_planted_faults backends/cuda/strata_cuda/quant_mma.cu tests/gpu/test_quant_mma.py \
  's/w0 \& 0xf0f0f0f0u, s.s1/w0 \& 0x0f0f0f0fu, s.s1/' \
  's/const int si = 4 \* odd + 2 \* second + (kk >> 1);/const int si = 4 * odd + 2 * second;/'
echo "faults done at $(( $(date +%s) - t0 )) s"
python3 - <<'PY' >> "$OUT/gpu_tests.log" 2>&1
import strata_cuda.quant_ffn as q
print("FUSED_KERNEL", q.FUSED_KERNEL)
PY
TEST_S=200 timeout -k 10 200 python3 -m pytest -p no:cacheprovider -q -rfE tests/gpu/test_quant_warm.py -k "fused" >> "$OUT/gpu_tests.log" 2>&1 || rc=1
echo "warm fused tests: $(tail -1 "$OUT/gpu_tests.log") at $(( $(date +%s) - t0 )) s"
timeout -k 10 240 python3 bench/quant_layer_h200.py --out "$OUT" --reps 7 --variants auto:classes auto:classes:fused \
  2>&1 | grep "QuantMoE\|f16 FastMoE\|Traceback\|Error" | grep -v "cold with" | cut -c1-220 | tail -12 || rc=1
echo "quant bench done at $(( $(date +%s) - t0 )) s"
exit $rc
