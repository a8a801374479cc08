#!/usr/bin/env bash
# The lead's third call of the 2026-12-01 late session: the GPU tests of the pull change (each file in its own
# process), then bench/link_trace_h200.py: copy rates, a small table's landing behind 600 MB of copies (memcpy vs
# pull), and the half-skewed run traced per variant (default: pull on, 2 groups ahead, hotter-only admissions;
# nopull; all groups at once; noguard). Carry .whl and strata_core.egg-info.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee "$OUT/lane.log") 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:$PWD/backends/cuda:$PWD/backends/rocm:$PWD/backends/sycl:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
rc=0; t0=$(date +%s)
for f in ${TESTS:-tests/gpu/test_pull.py tests/gpu/test_prefetch.py tests/gpu/test_layer_ops.py tests/gpu/test_decode_loop.py tests/gpu/test_fast_paths.py}; do
  echo "=== $f" >> "$OUT/gpu_tests.log"
  timeout -k 10 "${TEST_S:-120}" python3 -m pytest -p no:cacheprovider -q -rfE "$f" >> "$OUT/gpu_tests.log" 2>&1 || rc=1
  echo "$f: $(tail -1 "$OUT/gpu_tests.log")"
done
echo "tests took $(( $(date +%s) - t0 )) s"
timeout -k 10 "${TRACE_S:-300}" python3 bench/link_trace_h200.py --out "$OUT" --decode 128 --ahead "${AHEAD:-default,default:nopull,all,default:noguard}" 2>&1 | tail -8 || rc=1
echo "call took $(( $(date +%s) - t0 )) s"
exit $rc
