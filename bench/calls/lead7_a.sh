#!/usr/bin/env bash
# The 2026-12-02 (second) session's first H200 call: the device-table path (strata_cuda.triton_moe) checked, then
# timed. Imports, tests/gpu/test_device_gemm.py and test_fast_paths.py, two planted faults in triton_moe.py that
# test_device_gemm.py must catch (restored after), then layer_h200.py over the device-table tile configs against the
# cuBLAS classes. Files: gpu_tests.log, layer_h200.json, lane.log.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lane_common.sh"
lane_start
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)
from strata_cuda import triton_moe; print('triton_moe.available', triton_moe.available())"
lane_gpu_tests 150 tests/gpu/test_device_gemm.py tests/gpu/test_fast_paths.py
lane_planted_faults backends/cuda/strata_cuda/triton_moe.py tests/gpu/test_device_gemm.py \
  's/acc = acc \/ (1.0 + tl.exp(-acc)) \* acc_u/acc = acc \/ (1.0 + tl.exp(-acc))/' \
  's/first = tl.sum(tl.where(offs < e, tiles, 0), axis=0)/first = tl.sum(tl.where(offs <= e, tiles, 0), axis=0)/'
timeout -k 10 "${LAYER_S:-150}" python3 bench/layer_h200.py --out "$OUT" --skip generation --reps 9 \
  --variants "classes:4:t,classes:4,classes:4:t64x64x64x4x4+64x128x64x4x4,classes:4:t128x64x64x8x3+128x128x64x8x3,classes:4:t128x128x64x8x3+128x256x64x8x3,classes:4:t:" 2>&1 | tail -14 || rc=1
echo "lane took $(( $(date +%s) - t0 )) s"
exit $rc
