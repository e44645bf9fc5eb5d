#!/usr/bin/env bash
# The whole test suite on a GPU machine, in two parts that each fit a 10-minute call:
#
#   scripts/gpu_tests.sh kernels   # kernel, model, tuning and transform files: pytest -n 10 (one GPU shared)
#   scripts/gpu_tests.sh serving   # the files that start tritonservers: 3 at a time, 2 torch threads a process
#
# The serving files time recoveries and readiness. On the H200's 16 host cores, 8 files at once with a torch
# thread per core in every stub stretched model loads to 30–140 s, past those limits; `make test` runs them
# one at a time on 2 cores. Tests marked `timing` (decisions by measured time) run after the others, alone.
# PYTEST_ARGS adds arguments (e.g. -k); results: $OUT/<part>.log and .xml (then <part>-timing.*).
# The MovieLens tests read the recbole wheel's files: put recbole-1.2.1-py3-none-any.whl in .triton_bundle/whl.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/triton_bundle_env.sh  # offline tritonserver + perf_analyzer where the machine has no network
OUT=${OUT:-out/gpu_tests}; mkdir -p "$OUT"
SERVING=(idle_cpus inprocess_backend instance_groups kernel_buckets metrics model_repository online perf_analyzer
  reliability reliability_online reliability_serve server serving serving_ab training transform)
part=${1:?"usage: scripts/gpu_tests.sh kernels|serving"}
files=()
for f in tests/test_*.py; do
  name=${f#tests/test_}; name=${name%.py}
  if [[ " ${SERVING[*]} " == *" $name "* ]]; then [ "$part" = serving ] && files+=("$f"); else [ "$part" = kernels ] && files+=("$f"); fi
done
[ ${#files[@]} -gt 0 ] || { echo "gpu_tests.sh: unknown part '$part' (kernels or serving)" >&2; exit 2; }
if [ "$part" = serving ]; then export OMP_NUM_THREADS=2; workers=3; else workers=10; fi
run() {  # name, pytest arguments...
  local name=$1; shift
  PYTHONUNBUFFERED=1 python3 -m pytest -v -p no:cacheprovider -rfE --durations=15 --junitxml="$OUT/$name.xml" \
    ${PYTEST_ARGS:-} "$@" "${files[@]}" >"$OUT/$name.log" 2>&1
  local status=$?
  grep -E "^(FAILED|ERROR) " "$OUT/$name.log"; tail -1 "$OUT/$name.log"
  return $status
}
run "$part" -n "$workers" -m "not timing"; status=$?
run "$part-timing" -m timing; timing=$?
[ $timing -eq 5 ] && timing=0  # no timing tests in this part
exit $(( status || timing ))
