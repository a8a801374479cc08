#!/usr/bin/env bash
# Engineer D's second H200 call, on the tree with the third decode forms as the default (fast.DECODE_FORM 4,
# DECODE_PDL on): bench/decode_kernels_h200.py over forms 2, 4, 6, 7, 8; the GPU tests of the decode forms, the fast
# paths and the layer ops; bench/strata_run_h200.py --settings all --skip-peers (the defaults); then the same
# all-cached strata run with form 2 plain (the default before) and form 7 programmatic (form_run.py). $OUT: logs, JSONs.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:$PWD/backends/cuda:$PWD/backends/rocm:$PWD/backends/sycl:/tmp/site PYTHONUNBUFFERED=1
cat bench/results/d_h200/call2_tree.txt | tee "$OUT/call2_tests.log"
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee -a "$OUT/call2_tests.log"
timeout -k 5 45 python3 bench/decode_kernels_h200.py --out "$OUT" --forms 2,4,6,7,8 2>&1 | tee "$OUT/call2_bench.log"
timeout -k 5 100 python3 -m pytest -p no:cacheprovider -q -rfE -x tests/gpu/test_decode_forms.py \
  tests/gpu/test_fast_paths.py tests/gpu/test_layer_ops.py >> "$OUT/call2_tests.log" 2>&1
echo "pytest rc $?"
grep -E "passed|failed|Error|assert" "$OUT/call2_tests.log" | tail -12
timeout -k 5 60 python3 bench/strata_run_h200.py --settings all --skip-peers --out "$OUT" 2>&1 | tail -4
for fp in "2 0" "7 1"; do
  set -- $fp
  timeout -k 5 28 python3 bench/results/d_h200/form_run.py $1 $2 > "$OUT/call2_form$1_pdl$2_run.json" 2>> "$OUT/call2_form_runs.err"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('form', sys.argv[2], 'pdl', sys.argv[3], 'decode tok/s', d.get('decode_tokens_per_s'), 'prefill tok/s', d.get('prefill_tokens_per_s'))" "$OUT/call2_form$1_pdl$2_run.json" $1 $2 || tail -5 "$OUT/call2_form_runs.err"
done
