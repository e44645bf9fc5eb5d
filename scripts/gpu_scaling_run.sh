#!/usr/bin/env bash
# One run on a machine with 2+ GPUs: candidates/s of $MODELS in several serving layouts, side
# by side (same machine, same repository copy, same request mix). A layout is BACKEND:GPUS[:servers]:
#   configs:0        one tritonserver, instances on GPU 0, the backends the configs name (python_inprocess
#                    for the GPU rankers)
#   configs:0,1      one tritonserver, Triton instance groups over GPUs 0 and 1 (`scripts/serve --gpus 0,1`:
#                    configs/<config>_gpus_<ids>.pbtxt, the same count per GPU; there the in-process
#                    models take the python backend, ikbo_backend/instance_groups.py)
#   stub:0           the configs with `backend: "python"` everywhere (a python-backend stub per instance)
#   inprocess:0,1    as configs:0,1 but the in-process models stay in tritonserver's process over several GPUs
#                    (`scripts/serve --keep-in-process`)
#   configs:0,1:servers   one tritonserver per GPU (CUDA_VISIBLE_DEVICES), ports 8000+ and 9000+, each
#                    loaded with half the concurrency at the same time; candidates/s summed
#   configs:0:x2     a last field xN sets every KIND_GPU instance group of the copied $CONFIG configs to
#                    N instances (per GPU); e.g. "configs:0:x1 configs:0:x2" compares 1 and 2 on one GPU
# The repository copy holds only $MODELS (faster load). Per point: perf_analyzer (scripts/perf_sweep.py,
# gRPC, $MIX) inside scripts/gpu_throughput.py (candidates/s per GPU from the metrics port), and the
# server processes' CPU use (top, 3 s, with tritonserver's busiest threads) during the window.
#
#   OUT=out/scale scripts/gpu_scaling_run.sh      # → $OUT/summary.md, $OUT/run.tgz
#
# Knobs: LAYOUTS ("configs:0 configs:0,1 configs:0,1:servers"), CONFIG (large), PROFILE (large), MODELS (ikbo_ranker),
# MIX (u15_b1024), CONCURRENCY (total requests in flight, "4 8 16"), WINDOW (perf_analyzer ms).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/scale}; CONFIG=${CONFIG:-large}; PROFILE=${PROFILE:-large}; MODELS=${MODELS:-ikbo_ranker}
MIX=${MIX:-u15_b1024}; CONCURRENCY=${CONCURRENCY:-4 8 16}; WINDOW=${WINDOW:-2000}
LAYOUTS=${LAYOUTS:-configs:0 configs:0,1 configs:0,1:servers}
W=$(mktemp -d); mkdir -p "$OUT"; S="$OUT/summary.md"
log() { echo "[$(date -u +%T)] $*" | tee -a "$W/steps.log" >&2; }
. scripts/triton_bundle_env.sh
{ echo "# GPU scaling run $(date -u +%FT%TZ)"; nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; echo "CPUs $(nproc)"; } >"$S" 2>/dev/null
copy_repository() {  # $1: directory, $2: backend ("configs": as configured; "stub": python), $3: instances per GPU ("": as configured)
  local stub=(); [ "$2" = stub ] && stub=(--python-backend)
  python3 -m ikbo_backend.perf.repository_copy "$1" --models $MODELS "${stub[@]}" ${3:+--config "$CONFIG" --gpu-instances "$3"} >/dev/null
}
wait_ready() {  # $1: HTTP port, $2: server pid
  for _ in $(seq 400); do curl -sf "localhost:$1/v2/health/ready" >/dev/null && return 0; kill -0 "$2" 2>/dev/null || return 1; sleep 1; done
  return 1
}
cpu_sample() {  # $1: file; CPU % of the servers and stubs over 3 s (top), then tritonserver's busiest threads
  sleep $(( WINDOW / 1000 * 3 ))
  top -b -d 3 -n 2 -w 200 | awk '/^top -/{n++} n==2' | grep -E "tritonserver|triton_python" >"$1"
  for pid in $(pgrep -x tritonserver); do
    echo "threads of $pid:" >>"$1"; top -H -b -d 3 -n 2 -w 200 -p "$pid" | awk '/^top -/{n++} n==2' | sed -n '7,14p' >>"$1"
  done
}
sweep() {  # $1: tag, $2: HTTP port, $3: concurrency, $4: metrics port → $W/<tag>/sweep.csv
  timeout 200 python3 scripts/gpu_throughput.py --url "localhost:$4" --json "$W/$1.json" -- \
    python3 scripts/perf_sweep.py --url "localhost:$2" --grpc-url "localhost:$(( $2 + 1 ))" --profile "$PROFILE" --rankers $MODELS \
      --mixes "$MIX" --protocols grpc --concurrency "$3" --window-ms "$WINDOW" --out "$W/$1" >>"$W/$1.md" 2>>"$W/steps.log"
}
for layout in $LAYOUTS; do
  IFS=: read -r backend gpus rest <<<"$layout"; name=${layout//[:,]/_}; servers=; count=
  for field in ${rest//:/ }; do case $field in servers) servers=servers ;; x[0-9]*) count=${field#x} ;; esac; done
  copy_repository "$W/copy_$name" "$backend" "$count"
  repo="$W/copy_$name/model_repository"; start=$(date +%s); pids=()
  if [ "$servers" = servers ]; then
    i=0
    for gpu in ${gpus//,/ }; do
      port=$(( 8000 + 1000 * i ))
      CUDA_VISIBLE_DEVICES=$gpu python3 scripts/serve --config "$CONFIG" --model-repository "$repo" \
        --http-port $port --grpc-port $(( port + 1 )) --metrics-port $(( port + 2 )) >"$W/serve_${name}_$i.log" 2>&1 &
      pids+=($!); i=$(( i + 1 ))
    done
  else
    keep=(); [ "$backend" = inprocess ] && keep=(--keep-in-process)
    python3 scripts/serve --config "$CONFIG" --gpus "$gpus" "${keep[@]}" --model-repository "$repo" >"$W/serve_$name.log" 2>&1 &
    pids+=($!)
  fi
  log "layout $layout: ${#pids[@]} server(s)"
  ready=1; i=0
  for pid in "${pids[@]}"; do wait_ready $(( 8000 + 1000 * i )) "$pid" || ready=0; i=$(( i + 1 )); done
  if [ $ready = 0 ]; then log "$layout not ready: $(tail -3 "$W"/serve_${name}*.log)"; kill "${pids[@]}"; wait; continue; fi
  echo -e "\n## $layout (ready after $(( $(date +%s) - start )) s)\n" >>"$S"
  for c in $CONCURRENCY; do
    log "$layout concurrency $c"
    cpu_sample "$W/cpu_${name}_c$c.txt" & sampler=$!
    if [ ${#pids[@]} -gt 1 ]; then
      share=$(( c / ${#pids[@]} )); jobs=()
      for i in $(seq 0 $(( ${#pids[@]} - 1 ))); do
        port=$(( 8000 + 1000 * i )); sweep "${name}_c${c}_s$i" $port $share $(( port + 2 )) & jobs+=($!)
      done
      wait "${jobs[@]}"
    else
      sweep "${name}_c$c" 8000 "$c" 8002
    fi
    wait $sampler
    { cat "$W/${name}_c$c"*.md; echo -e "\nCPU (top, 3 s):\n\n\`\`\`"; cat "$W/cpu_${name}_c$c.txt"; echo "\`\`\`"; } >>"$S"
  done
  kill -TERM "${pids[@]}"; wait "${pids[@]}"
done
python3 -m ikbo_backend.perf.scaling_report "$W" "$LAYOUTS" $CONCURRENCY >>"$S"
tar czf "$OUT/run.tgz" -C "$W" --exclude='copy_*' . && log "wrote $OUT"
cat "$S"
