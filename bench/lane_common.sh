# Sourced by the H200 lane and call scripts (bench/lead_lane*.sh, bench/calls/lead5_*.sh): the start every call shares
# and the per-file GPU test loop. Not run on its own.

# The wheels the device lacks installed to /tmp/site, this checkout and its backends on PYTHONPATH, the card named.
lane_env() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || exit 1
  export PYTHONPATH=$PWD:$PWD/backends/cuda:$PWD/backends/rocm:$PWD/backends/sycl:/tmp/site PYTHONUNBUFFERED=1
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
}

# Output folder, everything printed teed into $OUT/lane.log, then lane_env; rc=0 and t0 set for the caller.
lane_start() {
  OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
  exec > >(tee "$OUT/lane.log") 2>&1
  lane_env
  rc=0; t0=$(date +%s)
}

# Each test file in its own pytest process (a sticky CUDA error in one cannot fail the files after it), its log
# appended to $OUT/gpu_tests.log as it ends, `timeout -k` so a process stuck in the driver is killed (a call that ran
# four files at once into a temporary folder copied only at the end brought nothing back). The conformance kit
# deselects itself unless told the backend. Default files: every tests/gpu file, test_fidelity.py first (it reads
# the driver's free memory). Sets rc=1 on any failure; per-file limit $TEST_S, else the first argument (seconds).
lane_gpu_tests() {
  local limit=$1; shift
  local files=("$@")
  if [[ ${#files[@]} -eq 0 ]]; then
    files=(tests/gpu/test_fidelity.py $(ls tests/gpu/test_*.py | grep -v test_fidelity.py))
  fi
  local f extra
  for f in "${files[@]}"; do
    echo "=== $f" >> "$OUT/gpu_tests.log"
    extra=""; case $f in *conformance*) extra="--strata-backend cuda";; esac
    timeout -k 10 "${TEST_S:-$limit}" python3 -m pytest -p no:cacheprovider -q -rfE "$f" $extra >> "$OUT/gpu_tests.log" 2>&1 || rc=1
    echo "$f: $(tail -1 "$OUT/gpu_tests.log")"
  done
}

# Planted faults: each sed expression applied in turn to SRC (restored after each), TEST run on it; a fault must
# make TEST fail (a failure, not an error, is a catch: the log's last line says which). Sets rc=1 when a fault did not
# apply or TEST passed with it. Usage: lane_planted_faults SRC TEST EXPR...
lane_planted_faults() {
  local src=$1 test=$2; shift 2
  local keep fault
  keep=$(mktemp)
  cp "$src" "$keep"
  for fault in "$@"; do
    sed -i "$fault" "$src"
    if cmp -s "$src" "$keep"; then echo "planted fault did not apply: $fault"; rc=1; fi
    echo "=== planted fault: $fault" >> "$OUT/gpu_tests.log"
    timeout -k 10 120 python3 -m pytest -p no:cacheprovider -q "$test" >> "$OUT/gpu_tests.log" 2>&1 \
      && { echo "planted fault NOT caught: $fault"; rc=1; } \
      || echo "planted fault: $(tail -1 "$OUT/gpu_tests.log") (a failure, not an error, is a catch)"
    cp "$keep" "$src"
  done
  rm -f "$keep"
}
