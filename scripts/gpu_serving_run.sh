#!/usr/bin/env bash
# One measured serving run on a GPU machine, in this order: in-process forward (bench_model), the
# served rankers' own call in process (serving_probe.py in-process: the reference for the server's
# compute time), tritonserver with --model-config-name=$CONFIG, first-request latency, perf_analyzer
# sweeps (IKBO, baseline, transformed; batch and online), the same offered load, per-model server
# times and compilation counters, a soak, GPU memory sampled throughout. Everything lands in
# $OUT/run.tgz plus $OUT/summary.md (the tables) and the two plots.
#
#   OUT=out/gpu scripts/gpu_serving_run.sh            # large profile, bf16, on the GPU
#
# Knobs (environment): GPU_TESTS (pytest arguments run first; "" skips), SKIP_BENCH, BENCH_MIXES,
# MAIN_MIXES / MAIN_RANKERS / MAIN_CONCURRENCY (the main gRPC sweep: 15:1024, both batch ensembles,
# 1 2 4 8), ONLINE_CONCURRENCY (online endpoints at 15:1024; "" skips), EQUAL_RATES / EQUAL_MODELS
# (offered requests/s and models of the same-load comparison, the first the reference; "" skips), EQUAL_WINDOW
# (its perf_analyzer window, ms, default 3000: perf_analyzer merges the 3 stable windows, ~900 requests at
# 100 req/s, so a p99 rests on the ~9 slowest; longer windows give it more), SKIP_EXTRA (no
# transformed, other-mix and HTTP sweeps), SKIP_IN_PROCESS, STEP_TIMEOUT (s per step), WINDOW
# (perf_analyzer ms), IN_PROCESS_MODELS, GAPS (ms of sleep between the in-process calls and before
# `serving_probe.py idle`'s fixed work), WAKE_AB (the in-process call
# and the same-load comparison again with idle CPUs kept awake: "qos", a PM QoS request holding CPU
# wake latency at 0 µs, as `scripts/serve --cpu-wake-latency-us 0` does; "spin", a SCHED_IDLE busy
# loop on every CPU, as `scripts/serve --busy-idle` does; "" skips),
# SOAK_SECONDS (a soak against this server at 70 % of its peak: RSS and GPU memory; "" skips),
# AB_TREE (a copy of another commit, e.g. `git archive <commit> | tar -x -C out/ab_tree`: ikbo_ranker's
# call in process from that tree and from this one, alternating twice, at $GAPS; "" skips).
#
# Machines without network (the lab's H200) and python3 without the package installed:
# scripts/triton_bundle_env.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu}; CONFIG=${CONFIG-large}; PROFILE=${PROFILE:-large}; DTYPE=${DTYPE:-bfloat16}
DEVICE=${DEVICE:-cuda}; WINDOW=${WINDOW:-2000}; STEP_TIMEOUT=${STEP_TIMEOUT:-300}
W=$(mktemp -d); mkdir -p "$OUT"; S="$OUT/summary.md"  # written as the run goes: a cut run keeps its tables
log() { echo "[$(date -u +%T)] $*" | tee -a "$W/steps.log" >&2; }

. scripts/triton_bundle_env.sh  # offline tritonserver + perf_analyzer where the machine has no network
{ echo "# GPU serving run $(date -u +%FT%TZ)"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  echo "CPUs $(nproc), cpuidle $(cat /sys/devices/system/cpu/cpuidle/current_driver 2>/dev/null || echo none)," \
    "haltpoll $(cat /sys/module/haltpoll/parameters/guest_halt_poll_ns 2>/dev/null || echo -) ns," \
    "/dev/cpu_dma_latency $( [ -w /dev/cpu_dma_latency ] && echo writable || echo absent)"; } >"$S" 2>/dev/null
WAKE_AB=${WAKE_AB-}
hold_wake_latency() {  # CPUs kept out of idle ($WAKE_AB) by background processes until `kill $WAKE`
  WAKE=""
  if [ "$WAKE_AB" = qos ]; then  # a PM QoS request (0 µs); acts through a cpuidle driver only
    timeout 3600 python3 -m ikbo_backend.perf.hold wake-latency 0 >>"$W/steps.log" 2>&1 &
    WAKE=$!
  elif [ "$WAKE_AB" = spin ]; then  # a busy loop per CPU at SCHED_IDLE (`scripts/serve --busy-idle`); they end with this process
    timeout 3600 python3 -m ikbo_backend.perf.hold busy-idle >>"$W/steps.log" 2>&1 &
    WAKE=$!
  fi
  [ -n "$WAKE" ] && sleep 1 && kill -0 $WAKE 2>/dev/null
}
case "$WAKE_AB" in
  qos) WAKE_LABEL="a PM QoS request holding CPU wake latency at 0 µs" ;;
  *) WAKE_LABEL="a SCHED_IDLE busy loop on every CPU" ;;
esac
# the GPUs the run uses (nvidia-smi ignores CUDA_VISIBLE_DEVICES, so it is passed on; all GPUs when unset)
nvidia-smi ${CUDA_VISIBLE_DEVICES:+--id=$CUDA_VISIBLE_DEVICES} --query-gpu=timestamp,memory.used,utilization.gpu --format=csv -l 2 >"$W/gpu_memory.csv" 2>/dev/null &
SMI=$!

if [ -n "${GPU_TESTS-tests/test_cuda_graphs.py}" ]; then
  log "GPU tests: ${GPU_TESTS-tests/test_cuda_graphs.py}"
  { echo -e "\n### GPU tests\n"; echo '```'
    timeout "$STEP_TIMEOUT" python3 -m pytest -q -p no:cacheprovider ${GPU_TESTS-tests/test_cuda_graphs.py} 2>&1 | tail -15
    echo '```'; } >>"$S"
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  for graphs in "" --cuda-graphs; do  # eager, then replayed from CUDA graphs (as the GPU configs serve)
    log "bench_model (in process, CUDA) $graphs"
    timeout "$STEP_TIMEOUT" python3 scripts/bench_model.py --device "$DEVICE" --profile "$PROFILE" --dtype "$DTYPE" \
      --providers baseline ikbo transformed --mixes ${BENCH_MIXES:-u15_b1024 u1_b1024 u64_b64} --runs 30 --pool 4 \
      --profile-kernels $graphs >>"$S" 2>"$W/bench_model$graphs.err" || log "bench_model failed: $(tail -3 "$W/bench_model$graphs.err")"
  done
fi

if [ -z "${SKIP_IN_PROCESS:-}" ]; then
  in_process() {  # models...: each in its own process (its load's GPU memory alone)
    for model in "$@"; do
      timeout "$STEP_TIMEOUT" python3 scripts/serving_probe.py in-process --config "$CONFIG" --model "$model" --gap-ms ${GAPS:-0 3} 2>>"$W/in_process.err" \
        || log "in-process $model: exit $? $(tail -3 "$W/in_process.err")"
    done
    timeout 60 python3 scripts/serving_probe.py idle --gap-ms ${GAPS:-0 3} --profile "$PROFILE" 2>>"$W/in_process.err"
  }
  log "served rankers in process (configs/$CONFIG.pbtxt)"
  { echo -e "\n### The served rankers' own call in process, U = 15, B = 1024 (\`serving_probe.py in-process\`, then \`idle\`)\n"
    in_process ${IN_PROCESS_MODELS:-baseline_ranker ikbo_ranker}; } >>"$S"
  if [ -n "$WAKE_AB" ] && hold_wake_latency; then
    log "served ikbo_ranker in process, with $WAKE_LABEL"
    { echo -e "\nThe same with $WAKE_LABEL:\n"; in_process ikbo_ranker; } >>"$S"
    kill $WAKE
  fi
fi

if [ -n "${AB_TREE:-}" ]; then
  log "ikbo_ranker in process: $AB_TREE against this tree"
  echo -e "\n### ikbo_ranker's call in process: $AB_TREE ($(cat "$AB_TREE/.commit" 2>/dev/null)) against this tree, alternating\n" >>"$S"
  for round in 1 2; do
    for tree in "$AB_TREE" .; do
      echo -e "\n$tree, round $round:\n" >>"$S"
      (cd "$tree" && PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout "$STEP_TIMEOUT" python3 scripts/serving_probe.py in-process --config "$CONFIG" --model ikbo_ranker \
        --gap-ms ${GAPS:-0 3}) >>"$S" 2>>"$W/in_process.err" || log "in-process ($tree): exit $? $(tail -3 "$W/in_process.err")"
    done
  done
fi

log "tritonserver --model-config-name=$CONFIG"
python3 -m ikbo_backend.perf.hold server "$W" --config "$CONFIG" >>"$W/steps.log" 2>&1 &  # the server stops with this holder
HOLDER=$!
for _ in $(seq 500); do [ -f "$W/server.env" ] && break; kill -0 $HOLDER 2>/dev/null || break; sleep 1; done
if [ -f "$W/server.env" ]; then
  . "$W/server.env"  # HTTP, GRPC, METRICS, SERVER_PID, READY_S
  echo -e "\nserver ready after $READY_S s (model load and warm-up included)\n" >>"$S"
  log "first requests"
  timeout 120 python3 scripts/serving_probe.py first --url "$GRPC" --profile "$PROFILE" \
    --model ikbo_ranker baseline_ranker transformed_ranker >>"$S" 2>>"$W/steps.log"
  sweep() {  # name, perf_sweep arguments...
    local name=$1; shift
    log "perf_sweep $name"
    timeout "$STEP_TIMEOUT" python3 scripts/perf_sweep.py --url "$HTTP" --grpc-url "$GRPC" --profile "$PROFILE" \
      --window-ms "$WINDOW" --out "$W/$name" "$@" >>"$S" 2>>"$W/$name.err" || log "perf_sweep $name: exit $?"
  }
  sweep main --mixes ${MAIN_MIXES:-u15_b1024} --protocols grpc --concurrency ${MAIN_CONCURRENCY:-1 2 4 8} --rankers ${MAIN_RANKERS:-baseline_ranker ikbo_ranker}
  equal_load() {  # name
    timeout "$STEP_TIMEOUT" python3 scripts/serving_probe.py equal-load --url "$GRPC" --http-url "$HTTP" --metrics-url "$METRICS" --profile "$PROFILE" \
      --rates ${EQUAL_RATES-50 100} --models ${EQUAL_MODELS:-baseline_ranker ikbo_ranker} --window-ms "${EQUAL_WINDOW:-3000}" --out "$W/$1" >>"$S" 2>>"$W/steps.log" || log "equal-load: exit $?"
  }
  if [ -n "${EQUAL_RATES-50 100}" ]; then
    log "equal offered load: ${EQUAL_RATES-50 100} req/s"
    echo -e "\n### Same offered load, U = 15, B = 1024, gRPC (\`serving_probe.py equal-load\`)\n" >>"$S"
    equal_load equal_load
    if [ -n "$WAKE_AB" ] && hold_wake_latency; then
      log "equal offered load, with $WAKE_LABEL"
      echo -e "\nThe same with $WAKE_LABEL:\n" >>"$S"
      equal_load equal_load_wake0
      kill $WAKE
    fi
  fi
  [ -n "${ONLINE_CONCURRENCY-1 4 8}" ] && sweep online --mixes u15_b1024 --protocols grpc --concurrency ${ONLINE_CONCURRENCY-1 4 8} --rankers baseline_ranker_online ikbo_ranker_online
  [ -z "${SKIP_EXTRA:-}" ] && sweep transformed --mixes u15_b1024 --protocols grpc --concurrency 4 --rankers ikbo_ranker transformed_ranker
  [ -z "${SKIP_EXTRA:-}" ] && sweep mixes --mixes u1_b1024 u64_b64 --protocols grpc --concurrency 1 4 --rankers baseline_ranker ikbo_ranker
  [ -z "${SKIP_EXTRA:-}" ] && sweep http --mixes u15_b1024 --protocols http --concurrency 1 4 --rankers baseline_ranker ikbo_ranker
  echo -e "\n### Server-side times per model (Triton statistics, whole run)\n" >>"$S"
  python3 scripts/serving_probe.py stats --url "$HTTP" --metrics-url "$METRICS" >>"$S" 2>>"$W/steps.log"
  if [ -n "${SOAK_SECONDS-120}" ]; then
    log "soak ${SOAK_SECONDS-120} s"
    echo -e "\n### Soak at 70 % of the measured peak, ikbo_ranker, HTTP (\`reliability.py soak --attach\`)\n" >>"$S"
    timeout "$STEP_TIMEOUT" python3 scripts/reliability.py soak --attach "$HTTP" --server-pid "$SERVER_PID" --profile "$PROFILE" \
      --seconds "${SOAK_SECONDS-120}" --out "$W/soak.json" >>"$S" 2>>"$W/steps.log" || log "soak: exit $?"
  fi
else
  log "server never became ready"; tail -40 "$W/tritonserver.log" >>"$S"
fi
kill $HOLDER $SMI 2>/dev/null; wait $HOLDER 2>/dev/null; pkill -f tritonserver 2>/dev/null  # the holder stops its server
python3 -m ikbo_backend.perf.gpu_memory "$W/gpu_memory.csv" >>"$S" 2>/dev/null
for p in throughput latency; do [ -f "$W/main/$p.png" ] && cp "$W/main/$p.png" "$OUT/$p.png"; done
tar czf "$OUT/run.tgz" -C "$W" . && log "wrote $OUT"
cat "$S"
