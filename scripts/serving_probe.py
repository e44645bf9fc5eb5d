#!/usr/bin/env python3
"""Probe a running tritonserver of this repository: first-request latency, per-model server times,
Triton compilations on the request path; and the served model's own call in process.

    python scripts/serving_probe.py first --url localhost:8001 --model ikbo_ranker [--profile large]
    python scripts/serving_probe.py stats --url localhost:8000 [--metrics-url localhost:8002]
    python scripts/serving_probe.py equal-load --url localhost:8001 --rates 50 100 [--profile large]
    python scripts/serving_probe.py in-process --config large --model ikbo_ranker baseline_ranker
    python scripts/serving_probe.py idle --gap-ms 0 3 10

`first`: one request (U, B of --users/--candidates, gRPC) timed alone right after readiness, then
--repeats more: the first latency, the steady p50 and their ratio (ikbo_backend.perf.latency).
`stats`: Triton's statistics per model, the wall time inside `execute` and the
`ikbo_triton_compilations_total` counters (ikbo_backend.perf.server_stats).
`equal-load`: p50 / p99 of the rankers at the same offered load (perf_analyzer `--request-rate-range`,
gRPC), rankers back to back per rate, with --http-url also each model's server times per step.
`in-process`: the python model built from `configs/<config>.pbtxt` as the python backend builds it,
then --repeats calls on fresh requests: p50 and mean wall ms (ikbo_backend.perf.in_process).
`idle`: fixed host and device work timed right after idle gaps.
"""

import argparse
from pathlib import Path

from ikbo_backend.perf.in_process import idle_cost, in_process
from ikbo_backend.perf.latency import equal_load, equal_load_table, first_request
from ikbo_backend.perf.server_stats import stats_table
from ikbo_backend.ranker import PROFILES


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    first = sub.add_parser("first", help="first-request latency vs steady p50 (gRPC)")
    first.add_argument("--url", required=True, help="gRPC host:port")
    first.add_argument("--model", nargs="+", default=["ikbo_ranker"])
    first.add_argument("--profile", default="demo", choices=sorted(PROFILES))
    first.add_argument("--users", type=int, default=15)
    first.add_argument("--candidates", type=int, default=1024)
    first.add_argument("--repeats", type=int, default=20)
    first.add_argument("--seed", type=int, default=None)
    stats = sub.add_parser("stats", help="per-model server times and compilation counters")
    stats.add_argument("--url", required=True, help="HTTP host:port")
    stats.add_argument("--metrics-url", help="metrics host:port (default: the HTTP port + 2)")
    load = sub.add_parser("equal-load", help="p50/p99 of the rankers at the same offered load (gRPC)")
    load.add_argument("--url", required=True, help="gRPC host:port")
    load.add_argument("--profile", default="demo", choices=sorted(PROFILES))
    load.add_argument("--mix", default="u15_b1024")
    load.add_argument("--rates", nargs="+", type=float, required=True, help="offered requests/s")
    load.add_argument(
        "--models",
        nargs="+",
        default=["baseline_ranker", "ikbo_ranker"],
        help="the first is the reference of the ratio",
    )
    load.add_argument("--window-ms", type=int, default=3000)
    load.add_argument("--http-url", help="HTTP host:port: also the server's compute time per model and step")
    load.add_argument("--metrics-url", help="metrics host:port (default: the HTTP port + 2)")
    load.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "out" / "equal_load")
    local = sub.add_parser("in-process", help="wall ms of the served python model's own call, no server")
    local.add_argument("--config", default="large", help="configs/<name>.pbtxt ('config': config.pbtxt)")
    local.add_argument("--model", nargs="+", default=["baseline_ranker", "ikbo_ranker"])
    local.add_argument("--users", type=int, default=15)
    local.add_argument("--candidates", type=int, default=1024)
    local.add_argument("--repeats", type=int, default=200)
    local.add_argument("--seed", type=int, default=None)
    local.add_argument("--gap-ms", type=float, nargs="+", default=[0.0], help="sleep between calls (one row per value)")
    idle = sub.add_parser("idle", help="fixed host and device work after idle gaps")
    idle.add_argument("--gap-ms", type=float, nargs="+", default=[0.0, 1.0, 3.0, 10.0, 20.0])
    idle.add_argument("--profile", default="large", choices=sorted(PROFILES))
    idle.add_argument("--repeats", type=int, default=50)
    idle.add_argument("--seed", type=int, default=None)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.command == "idle":
        print("| gap ms | host: validate 15:1024, ms | device: 16 bf16 2048³ matmuls, ms |\n|---:|---:|---:|")
        for r in idle_cost(args.gap_ms, args.repeats, args.profile, args.seed):
            print(f"| {r['gap_ms']:g} | {r['host_ms']:.3f} | {r['device_ms']:.3f} |", flush=True)
    elif args.command == "in-process":
        print(
            f"| model (configs/{args.config}.pbtxt, in process) | U | B | gap ms | p50 ms | mean ms "
            "| load + warm-up s | GPU MiB reserved by the load |\n|---|---:|---:|---:|---:|---:|---:|---:|"
        )
        for model in args.model:
            for gap in args.gap_ms:
                r = in_process(model, args.config, args.users, args.candidates, args.repeats, args.seed, gap)
                print(
                    f"| {model} | {args.users} | {args.candidates} | {gap:g} | {r['p50_ms']:.3f} | {r['mean_ms']:.3f} "
                    f"| {r['load_s']:.1f} | {r['load_mib']:,.0f} |",
                    flush=True,
                )
    elif args.command == "equal-load":
        rows = equal_load(
            args.url, args.profile, args.mix, args.rates, args.models, args.window_ms, args.out,
            args.http_url, args.metrics_url,
        )  # fmt: skip
        print(equal_load_table(rows, reference=args.models[0]))
    elif args.command == "first":
        print("| model | first request ms | steady p50 ms | first / p50 |\n|---|---:|---:|---:|")
        for model in args.model:
            r = first_request(args.url, model, args.profile, args.users, args.candidates, args.repeats, args.seed)
            print(f"| {model} | {r['first_ms']:.1f} | {r['p50_ms']:.1f} | {r['ratio']:.2f} |", flush=True)
    else:
        host, port = args.url.rsplit(":", 1)
        print(stats_table(args.url, args.metrics_url or f"{host}:{int(port) + 2}"))


if __name__ == "__main__":
    main()
