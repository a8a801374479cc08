#!/usr/bin/env bash
# The lead's last call of the 2026-12-01 late session: tests/gpu/test_decode_loop.py and test_embed_rows.py after the
# prefill-only embed_rows fix, then bench/quant_variants_h200.py (quant_layer_h200 default / sb / nopull, one process
# each). Files: gpu_tests.log, lane.log, <variant>/quant_layer_h200.json. Carry .whl and strata_core.egg-info.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee "$OUT/lane.log") 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:$PWD/backends/cuda:$PWD/backends/rocm:$PWD/backends/sycl:/tmp/site PYTHONUNBUFFERED=1
rc=0; t0=$(date +%s)
for f in tests/gpu/test_decode_loop.py tests/gpu/test_embed_rows.py; do
  echo "=== $f" >> "$OUT/gpu_tests.log"
  timeout -k 5 60 python3 -m pytest -p no:cacheprovider -q -rfE "$f" >> "$OUT/gpu_tests.log" 2>&1 || rc=1
  echo "$f: $(tail -1 "$OUT/gpu_tests.log")"
done
timeout -k 5 "${QV_S:-120}" python3 bench/quant_variants_h200.py --out "$OUT" --variants default,sb,nopull 2>&1 || rc=1
echo "call took $(( $(date +%s) - t0 )) s"
exit $rc
