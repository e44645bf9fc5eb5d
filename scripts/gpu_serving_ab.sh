#!/usr/bin/env bash
# Several trees served one after the other in one device call, side by side (issue 5's A/B runs):
# scripts/gpu_serving_run.sh in each tree (a `git archive <commit> | tar -x -C out/<name>` export
# with `.triton_bundle` linked in and the commit in `.commit`), its summary and run.tgz under $OUT/<name>/, steps in $OUT/steps.txt.
#
#   scripts/gpu_serving_ab.sh out/new:240 out/old:150      # tree:seconds ...; the first runs first
#
# The knobs of gpu_serving_run.sh come from the environment; FIRST_ONLY names those that only the first
# tree gets (default: GPU_TESTS and the call in process), so the later trees time the server alone.
# Each tree builds its own python_inprocess shim (the backend directory is shared: its backend.c is
# touched first, which trees from before 2026-12-01 need; later ones rebuild on any other source or
# library) and no server outlives its tree's time: after each tree it kills every process
# whose command line holds "bin/tritonserver" (a calling shell whose own command line holds that text too).
set -uo pipefail
BASE=${OUT:?set OUT}; mkdir -p "$BASE"
FIRST=1
for spec in "$@"; do
  tree=${spec%%:*}; seconds=${spec##*:}; name=$(basename "$tree")
  touch "$tree/ikbo_backend/inprocess/backend.c"
  (
    cd "$tree" || exit 1
    [ $FIRST = 1 ] || export ${FIRST_ONLY:-GPU_TESTS= SKIP_IN_PROCESS=1}
    OUT=$BASE/$name timeout "$seconds" scripts/gpu_serving_run.sh >"$BASE/$name.log" 2>&1
    rc=$?; echo "$name ($(cat .commit 2>/dev/null || echo "no .commit")): exit $rc" >>"$BASE/$name.log"
  )
  rm -f "$BASE/$name"/*.png
  for _ in $(seq 30); do pgrep -f bin/tritonserver >/dev/null || break; sleep 1; done
  pkill -9 -f bin/tritonserver 2>/dev/null
  FIRST=0
done
cat "$BASE"/*.log >"$BASE/steps.txt" && rm -f "$BASE"/*.log
