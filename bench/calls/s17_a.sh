#!/usr/bin/env bash
# 2026-12-04 fourth session, H200 call 1: quant_mma.cu with the expert, its rows and each warpgroup's "active" flag
# broadcast from lane 0 (__shfl_sync), so ptxas no longer serializes the wgmmas (C7518: before, a wait followed each
# wgmma and the decode of the next step could not overlap the tensor cores); the decoded tiles stored by st.shared
# (they were generic ST.E), the SwiGLU's division __fdividef (no subroutine call per output), each step's decode
# after its wgmmas are issued. The layer's GPU tests first, then the
# kernels alone (with the ablations), then the layer bench: the fused path at three block-width pairs and the
# host-synced default. Files: gpu_tests.log, mma_bench.log, quant_mma_h200.json, quant_layer_h200.json, lane.log.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
TEST_S=150 lane_gpu_tests 150 tests/gpu/test_quant_mma.py tests/gpu/test_quant_warm.py tests/gpu/test_quant_cuda.py \
  tests/gpu/test_layer_ops.py
echo "tests done at $(( $(date +%s) - t0 )) s"
timeout -k 10 150 python3 bench/quant_mma_h200.py --out "$OUT" --reps 10 --ablations > "$OUT/mma_bench.log" 2>&1 || rc=1
python3 - "$OUT/quant_mma_h200.json" <<'PY' || rc=1
import json, sys
d = json.load(open(sys.argv[1]))
for k, r in d["routing"].items():
    print(k, {n: round(v["median_ms"], 3) for n, v in r.items() if isinstance(v, dict) and "median_ms" in v})
PY
echo "mma bench done at $(( $(date +%s) - t0 )) s"
timeout -k 10 240 python3 bench/quant_layer_h200.py --out "$OUT" --reps 5 \
  --variants auto:classes auto:classes:fused:b256x256 auto:classes:fused:b128x128 auto:classes:fused:b128x256 \
  2>&1 | grep "QuantMoE\|f16 FastMoE\|Traceback\|Error" | grep -v "cold with" | cut -c1-160 | tail -20 || rc=1
echo "quant bench done at $(( $(date +%s) - t0 )) s"
exit $rc
