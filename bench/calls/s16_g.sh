#!/usr/bin/env bash
# 2026-12-04 third session, H200 call 7: quant_mma.cu generic in the block's weight rows, blocks of 128 (two an SM,
# sm_90a) beside 256 (call 3's kernels: three input stages, two decoded tiles, each step's wgmmas waited for). Ordered
# by what matters if the device time runs out: quant_mma's GPU tests (both widths), the kernels alone (both widths),
# then the layer bench: the fused path with blocks of 128, and the default (little device time left). Files: gpu_tests.log,
# mma_bench.log, quant_mma_h200.json, quant_layer_h200.json, lane.log.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
TEST_S=120 lane_gpu_tests 120 tests/gpu/test_quant_mma.py
timeout -k 10 120 python3 bench/quant_mma_h200.py --out "$OUT" --reps 10 --ablations > "$OUT/mma_bench.log" 2>&1 || rc=1
python3 - "$OUT/quant_mma_h200.json" <<'PY' || rc=1
import json, sys
d = json.load(open(sys.argv[1]))
for k, r in d["routing"].items():
    print(k, {n: round(v["median_ms"], 3) for n, v in r.items() if isinstance(v, dict) and "median_ms" in v})
PY
echo "mma bench done at $(( $(date +%s) - t0 )) s"
timeout -k 10 200 python3 bench/quant_layer_h200.py --out "$OUT" --reps 5 \
  --variants auto:classes:fused:b128x128 auto:classes \
  2>&1 | grep "QuantMoE\|f16 FastMoE\|Traceback\|Error" | grep -v "cold with" | cut -c1-160 | tail -14 || rc=1
echo "quant bench done at $(( $(date +%s) - t0 )) s"
exit $rc
