#!/usr/bin/env bash
# Engineer E's H200 call (issue 13 items 1 and 4: the pipelined greedy decode), run from the repository root:
# the GPU tests of the decode loop and the layer ops, `strata run --backend cuda` on the tiny model with --check
# (the step loop) and without (the pipeline: the same tokens?), then bench/strata_run_h200.py --settings all
# --skip-peers (Qwen3-30B-A3B@F16, every expert cached). Each log lands in $OUT as its step ends. tree.txt (the
# commit and `git status --short` of the tree sent) is written here before the call: the device copy has no .git.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
cp bench/results/e_h200/tree.txt "$OUT/tree.txt" 2>/dev/null
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:$PWD/backends/cuda:$PWD/backends/rocm:$PWD/backends/sycl:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
rc=0
for f in test_decode_loop:70 test_layer_ops:40; do  # one file at a time, each result line written as it ends
  timeout -k 5 "${f#*:}" python3 -m pytest -p no:cacheprovider -v -rfE --durations=5 "tests/gpu/${f%:*}.py" \
    >> "$OUT/gpu_tests.log" 2>&1 || rc=1
  echo "${f%:*} done at ${SECONDS}s" | tee -a "$OUT/gpu_tests.log"
done
grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/gpu_tests.log" | cut -c1-160 | tail -24
for mode in check plain; do
  flag=$([[ $mode == check ]] && echo --check)
  timeout -k 5 30 python3 -m strata_core.cli run --backend cuda $flag --json > "$OUT/run_tiny_$mode.json" \
    2>> "$OUT/runs.err" || rc=1
done
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
r = {}
for m in ("check", "plain"):
    try:
        r[m] = json.load(open(f"{out}/run_tiny_{m}.json"))
    except Exception as e:
        print(m, "no JSON", e)
for m, d in r.items():
    print(f"tiny {m}: check {d.get('check')} sha {(d.get('outputs_sha256') or '')[:16]} decode tok/s "
          f"{round(d.get('decode_tokens_per_s') or 0, 1)} tokens[:6] {d.get('tokens', [])[:6]}")
if len(r) == 2:
    print("same tokens, --check (step loop) and plain (pipeline):", r["check"]["tokens"] == r["plain"]["tokens"])
PY
echo "runs done at ${SECONDS}s"
timeout -k 5 "${RUN_S:-60}" python3 bench/strata_run_h200.py --out "$OUT" --settings all --skip-peers \
  > "$OUT/strata_run.log" 2>&1 || rc=1
grep -E "^all|exit|Error" "$OUT/strata_run.log" | cut -c1-600
echo "bench done at ${SECONDS}s"
exit $rc
