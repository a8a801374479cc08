#!/usr/bin/env bash
# Sixth session (2026-12-06), call 1: s17_a.sh (written 2026-12-04, never run) without Nsight Compute, plus
# quant_mma.cu as of 623a019 and after: the tile's expert, its rows and each warpgroup's "active" flags broadcast from
# lane 0 (__shfl_sync), so ptxas no longer serializes the wgmmas (C7518: every build measured before had a wait after
# each wgmma, so the next step's decode never overlapped the tensor cores); decoded tiles stored by st.shared (they
# were generic ST.E); the SwiGLU's division __fdividef; each step's decode under its own wgmmas; the input
# chunks' addresses and the wgmma descriptors computed once, not per step; and blocks of 256 input rows x 128
# weight rows (sm_90a; each weight decoded for twice the rows).
# Order: the layer's GPU tests (test_quant_mma at every block shape), a planted fault in the 256-row path, the
# kernels alone (with the ablations), then the layer bench: the host-synced default and the fused path at five
# shape pairs, and Nsight Compute on the kernels alone. Files: gpu_tests.log, mma_bench.log, quant_mma_h200.json,
# quant_layer_h200.json, ncu_mma.txt, lane.log.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
TEST_S=150 lane_gpu_tests 150 tests/gpu/test_quant_mma.py tests/gpu/test_quant_warm.py tests/gpu/test_quant_cuda.py \
  tests/gpu/test_layer_ops.py tests/gpu/test_quant_decode.py
# planted faults: the second sub-tile read 64 rows on instead of 128 (the 256-row blocks' rows 128.. multiply the
# wrong inputs); the input chunks 16 rows apart in shared memory instead of 32 (every shape's input tile wrong)
lane_planted_faults backends/cuda/strata_cuda/quant_mma.cu tests/gpu/test_quant_mma.py \
  's/da + 2 \* kk + 1024 \* t, db/da + 2 * kk + 512 * t, db/' \
  's/qm_cp16(dst + i \* 32 \* 128,/qm_cp16(dst + i * 16 * 128,/'
echo "tests done at $(( $(date +%s) - t0 )) s"
timeout -k 10 180 python3 bench/quant_mma_h200.py --out "$OUT" --reps 10 --ablations > "$OUT/mma_bench.log" 2>&1 || rc=1
python3 - "$OUT/quant_mma_h200.json" <<'PY' || rc=1
import json, sys
d = json.load(open(sys.argv[1]))
for k, r in d["routing"].items():
    print(k, {n: round(v["median_ms"], 3) for n, v in r.items() if isinstance(v, dict) and "median_ms" in v})
    print(k, {n: v for n, v in r.items() if n.endswith("rel_diff_vs_f16")})
PY
echo "mma bench done at $(( $(date +%s) - t0 )) s"
timeout -k 10 300 python3 bench/quant_layer_h200.py --out "$OUT" --reps 5 \
  --variants auto:classes auto:classes:fused:b256x256 auto:classes:fused:b128x128 auto:classes:fused:b128x256 \
  auto:classes:fused:b128x128:m256x256 auto:classes:fused:b128x256:m256x128 \
  2>&1 | grep "QuantMoE\|f16 FastMoE\|Traceback\|Error" | grep -v "cold with" | cut -c1-160 | tail -24 || rc=1
echo "quant bench done at $(( $(date +%s) - t0 )) s"
exit $rc
