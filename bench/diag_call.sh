#!/usr/bin/env bash
# Engineer A's diagnostic device call: the edited kernels' tests, the in-process profile of `strata run` at
# Qwen3-30B-A3B F16 shape (bench/diag_run_h200.py), then bench/strata_run_h200.py on two settings with the peers.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:$PWD/backends/cuda:$PWD/backends/rocm:$PWD/backends/sycl:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
free -g | head -2
timeout 60 python3 -m pytest -p no:cacheprovider -q -x tests/gpu/test_cuda_kernels.py -k "linear or rmsnorm or layer_ops or graph" tests/gpu/test_layer_ops.py 2>&1 | tail -15
timeout 150 python3 bench/diag_run_h200.py --out "$OUT" --decode 32 2>&1 | tee "$OUT/diag.log" | head -120
timeout 170 python3 bench/strata_run_h200.py --out "$OUT" --settings ${SETTINGS:-all} --decode 64 2>&1 | tail -40
