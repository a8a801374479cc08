#!/usr/bin/env bash
# Engineer D's first H200 call (decode kernel forms): tests/gpu/test_decode_forms.py, then bench/decode_kernels_h200.py
# over forms 1-5 (each plain and programmatic), in one call. Logs and the JSON land in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:$PWD/backends/cuda:$PWD/backends/rocm:$PWD/backends/sycl:/tmp/site PYTHONUNBUFFERED=1
cat bench/results/d_h200/call1_tree.txt > "$OUT/call1_tests.log"
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee -a "$OUT/call1_tests.log"
timeout -k 5 "${TEST_S:-85}" python3 -m pytest -p no:cacheprovider -q -rfE -x tests/gpu/test_decode_forms.py \
  >> "$OUT/call1_tests.log" 2>&1
echo "pytest rc $?"
grep -E "passed|failed|Error|assert" "$OUT/call1_tests.log" | tail -12
timeout -k 5 "${BENCH_S:-95}" python3 bench/decode_kernels_h200.py --out "$OUT" 2>&1 | tee "$OUT/call1_bench.log"
