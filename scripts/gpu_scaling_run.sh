#!/usr/bin/env bash
# Issue 8, one run on a machine with 2+ GPUs: candidates/s of $MODELS on one GPU, then on two, side by
# side (same machine, same repository copy, same request mix), through Triton instance groups
# (`scripts/serve --gpus 0` then `--gpus 0,1`: configs/<config>_gpus_<ids>.pbtxt, the same count per
# GPU). The repository copy holds only $MODELS (faster load; the other models do not change the
# measured one). Per point: perf_analyzer (scripts/perf_sweep.py, gRPC, $MIX) inside
# scripts/gpu_throughput.py (candidates/s per GPU from the metrics port).
#
#   OUT=out/scale scripts/gpu_scaling_run.sh      # → $OUT/summary.md, $OUT/run.tgz
#
# Knobs: CONFIG (large), PROFILE (large), MODELS (ikbo_ranker), MIX (u15_b1024), CONCURRENCY per GPU
# count ("4 8 16"), WINDOW (perf_analyzer ms).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/scale}; CONFIG=${CONFIG:-large}; PROFILE=${PROFILE:-large}; MODELS=${MODELS:-ikbo_ranker}
MIX=${MIX:-u15_b1024}; CONCURRENCY=${CONCURRENCY:-4 8 16}; WINDOW=${WINDOW:-2000}
W=$(mktemp -d); mkdir -p "$OUT"; S="$OUT/summary.md"
log() { echo "[$(date -u +%T)] $*" | tee -a "$W/steps.log" >&2; }
. scripts/triton_bundle_env.sh
{ echo "# GPU scaling run $(date -u +%FT%TZ)"; nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } >"$S" 2>/dev/null
python3 - "$W/copy" $MODELS <<'PY'
import shutil, sys
from pathlib import Path
sys.path.insert(0, ".")
from ikbo_backend.serving import MODEL_REPOSITORY, REPO_ROOT
root = Path(sys.argv[1]); repo = root / "model_repository"; repo.mkdir(parents=True)
for package in ("ikbo_backend", "kernels"):  # model.py finds the packages next to the repository
    (root / package).symlink_to(REPO_ROOT / package)
shutil.copy2(MODEL_REPOSITORY / "shape_ranges.json", repo)
for name in sys.argv[2:]:
    shutil.copytree(MODEL_REPOSITORY / name, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
PY
for gpus in 0 0,1; do
  log "serve --config $CONFIG --gpus $gpus"
  start=$(date +%s)
  python3 scripts/serve --config "$CONFIG" --gpus "$gpus" --model-repository "$W/copy/model_repository" >"$W/serve_$gpus.log" 2>&1 &
  SERVE=$!
  for _ in $(seq 400); do curl -sf localhost:8000/v2/health/ready >/dev/null && break; kill -0 $SERVE 2>/dev/null || break; sleep 1; done
  if ! curl -sf localhost:8000/v2/health/ready >/dev/null; then log "not ready: $(tail -5 "$W/serve_$gpus.log")"; kill $SERVE; wait $SERVE; continue; fi
  echo -e "\n## GPUs $gpus (ready after $(( $(date +%s) - start )) s)\n" >>"$S"
  for c in $CONCURRENCY; do
    log "gpus $gpus concurrency $c"
    timeout 200 python3 scripts/gpu_throughput.py --url localhost:8002 --json "$W/gpus_${gpus}_c$c.json" -- \
      python3 scripts/perf_sweep.py --url localhost:8000 --grpc-url localhost:8001 --profile "$PROFILE" --rankers $MODELS \
        --mixes "$MIX" --protocols grpc --concurrency "$c" --window-ms "$WINDOW" --out "$W/gpus_${gpus}_c$c" >>"$S" 2>>"$W/steps.log"
  done
  kill -TERM $SERVE; wait $SERVE
done
python3 - "$W" $CONCURRENCY >>"$S" <<'PY'
import csv, sys
from pathlib import Path
work, levels = Path(sys.argv[1]), sys.argv[2:]
def row(gpus, c):
    path = work / f"gpus_{gpus}_c{c}" / "sweep.csv"
    return next(csv.DictReader(path.open()), None) if path.exists() else None
print("\n## One GPU vs two (perf_analyzer, client side)\n")
print("| concurrency per GPU count | 1 GPU candidates/s | 2 GPUs candidates/s | 2 / 1 | 1 GPU p50 / p99 ms | 2 GPUs p50 / p99 ms |\n|---:|---:|---:|---:|---:|---:|")
for c in levels:
    one, two = row("0", c), row("0,1", c)
    if one and two:
        a, b = float(one["candidates_per_s"]), float(two["candidates_per_s"])
        print(f"| {c} | {a:,.0f} | {b:,.0f} | **{b / a:.2f}×** | {float(one['p50_ms']):.1f} / {float(one['p99_ms']):.1f} | {float(two['p50_ms']):.1f} / {float(two['p99_ms']):.1f} |")
PY
tar czf "$OUT/run.tgz" -C "$W" --exclude=copy . && log "wrote $OUT"
cat "$S"
