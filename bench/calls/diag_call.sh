#!/usr/bin/env bash
# Engineer A's diagnostic device call: the edited paths' GPU tests, the in-process profile of `strata run` at
# Qwen3-30B-A3B F16 shape (bench/diag_run_h200.py, the request served twice), then bench/strata_run_h200.py on
# $SETTINGS ($PEERS=1: with the peers).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:$PWD/backends/cuda:$PWD/backends/rocm:$PWD/backends/sycl:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
timeout 90 python3 -m pytest -p no:cacheprovider -q -rfE tests/gpu/test_layer_ops.py tests/gpu/test_fast_paths.py 2>&1 | tail -15
timeout 120 python3 bench/diag_run_h200.py --out "$OUT" --decode 32 2>&1 | tee "$OUT/diag.log" | head -60
timeout 240 python3 bench/strata_run_h200.py --out "$OUT" --settings ${SETTINGS:-all,half_skewed,smallest} --decode 64 \
  $([[ "${PEERS:-0}" == 1 ]] || echo --skip-peers) 2>&1 | tail -30
