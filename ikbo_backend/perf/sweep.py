"""The perf_analyzer sweep of the rankers through a real tritonserver: rankers × mixes × concurrency × protocol.

Starts a tritonserver on free ports (`ikbo_backend.tritonserver.running_tritonserver`) unless `--url`
points at one already running, then runs perf_analyzer once per (mix, protocol, concurrency, ranker),
the rankers back to back, their order alternating between repeats, with `--input-data
perf_configs/<mix>.json` (written first when missing) and `-f <run>.csv`. Candidates/s = infer/s × B.

Online endpoints (`ikbo_ranker_online`, `baseline_ranker_online`: one user per request, coalesced by the
server): a mix is sent as U one-user requests of B/U candidates on average (`perf_configs/<mix>.online.json`),
and concurrency level c keeps c·U requests in flight (`in_flight`), the offered load of c batch requests.
Candidates/s = infer/s × candidates per request of the file.

Writes into --out: sweep.csv, throughput.png, latency.png, runs/<run>.csv|.log; prints a markdown table.
The command line is scripts/perf_sweep.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import urllib.request
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

from ..ranker import PROFILES
from .inputs import DEFAULT_DIR as CONFIG_DIR
from .inputs import MIXES, candidates_per_request, ensure_config, ensure_online_config, mix_shape
from .machine import device_name, package_version, today
from .perf_analyzer import Profile, Result, perf_analyzer_command, run_perf_analyzer, to_result
from .sweep_report import (
    ONLINE_RANKERS,
    PROTOCOLS,
    RANKERS,
    TRANSFORMED,
    markdown_table,
    plot,
    transformed_table,
    write_csv,
)

ROOT = Path(__file__).resolve().parents[2]
SHORT = Profile(("u15_b1024", "u1_b64", "u64_b64"), (1, 2), window_ms=1500, stability_pct=20, max_trials=5)
FULL = Profile(tuple(MIXES), (1, 2, 4, 8, 16), window_ms=5000, stability_pct=10, max_trials=10)


def aggregate(results: list[Result], how: str = "median") -> list[Result]:
    """One Result per (ranker, mix, protocol, concurrency) over its good repeats.

    "median": the median of each metric; "best": the repeat with the highest throughput, whole (on a
    shared machine, other work only ever slows a run down, like `timeit`'s minimum).
    """
    groups: dict[tuple, list[Result]] = {}
    for r in results:
        groups.setdefault((r.ranker, r.mix, r.protocol, r.concurrency), []).append(r)
    out = []
    for runs in groups.values():
        good = [r for r in runs if r.status == "ok"]
        if not good:
            out.append(runs[-1])
        elif how == "best":
            out.append(replace(max(good, key=lambda r: r.candidates_per_s), repeat=len(good)))
        else:
            merged = replace(good[0], repeat=len(good), mode="/".join(sorted({r.mode for r in good})))
            for name in ("infer_per_s", "candidates_per_s", "p50_ms", "p90_ms", "p99_ms", "load1"):
                setattr(merged, name, statistics.median(getattr(r, name) for r in good))
            out.append(merged)
    return out


def server_version(http_url: str) -> str:
    try:
        with urllib.request.urlopen(f"http://{http_url}/v2", timeout=5) as response:
            return json.load(response).get("version", "?")
    except OSError:
        return "?"


def _host_port(url: str) -> str:
    return url.split("://", 1)[-1].rstrip("/")


def environment(version: str, profile: Profile, repeats: int, how: str) -> str:
    return (
        f"{device_name()}, {os.cpu_count()} cores; tritonserver {version}; perf_analyzer "
        f"{perf_analyzer_command()[0][0]} (tritonclient {package_version('tritonclient')} installed); "
        f"{profile.window_ms} ms windows, stability {profile.stability_pct} %, {how} of {repeats} "
        f"measurement(s) per cell; {today()}"
    )


class _Progress(list):
    """tqdm's few calls used here, on stderr (a bare GPU machine's Python has no tqdm)."""

    def __init__(self, items, **_):
        super().__init__(items)

    def set_postfix_str(self, text):
        print(f"[{len(self)} runs] {text}", file=sys.stderr, flush=True)

    write = staticmethod(lambda text: print(text, file=sys.stderr))


def _measure(plan, results, inputs, online_inputs, per_request, profile, runs_dir, http_url, grpc_url, tqdm) -> None:
    """Run perf_analyzer once per planned point, appending to `results` as each run ends."""
    for mix, protocol, concurrency, repeat, ranker in (bar := tqdm(plan, desc="perf_analyzer", unit="run")):
        online = ranker in ONLINE_RANKERS
        in_flight = concurrency * mix_shape(mix)[0] if online else concurrency
        bar.set_postfix_str(
            f"{ranker} {mix} {protocol} c={concurrency}" + (f" ({in_flight} in flight)" if online else "")
        )
        name = f"{ranker}.{mix}.{protocol}.c{concurrency}.r{repeat}"
        row, mode, status = run_perf_analyzer(
            ranker,
            grpc_url if protocol == "grpc" else http_url,
            protocol,
            online_inputs[mix] if online else inputs[mix],
            in_flight,
            profile,
            runs_dir / f"{name}.csv",
            runs_dir / f"{name}.log",
        )
        per = per_request[mix] if online else None
        results.append(to_result(ranker, mix, protocol, concurrency, repeat, row, mode, status, per))
        results[-1].load1, results[-1].in_flight = os.getloadavg()[0], in_flight
        if status != "ok":
            tqdm.write(f"{name}: {status}, see {runs_dir / name}.log")


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def parse_args(argv=None, description: str | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help=f"long sweep: {FULL}")
    parser.add_argument("--mixes", nargs="+", choices=list(MIXES), help="override the profile's mixes")
    parser.add_argument("--concurrency", nargs="+", type=int, help="override the profile's concurrency levels")
    parser.add_argument("--window-ms", type=int, help="override the profile's measurement window")
    parser.add_argument("--repeats", type=int, default=1, help="measure every point this many times")
    parser.add_argument("--aggregate", choices=("median", "best"), default="median", help="how repeats are combined")
    rankers = list(RANKERS + ONLINE_RANKERS)
    parser.add_argument("--rankers", nargs="+", default=rankers, choices=rankers + [TRANSFORMED])
    parser.add_argument(
        "--profile", default="demo", choices=sorted(PROFILES), help="model dims of the served config (ranker.PROFILES)"
    )
    parser.add_argument("--protocols", nargs="+", default=list(PROTOCOLS), choices=list(PROTOCOLS))
    parser.add_argument("--url", help="HOST:PORT of a running server's HTTP endpoint (no server is started)")
    parser.add_argument("--grpc-url", help="HOST:PORT of its gRPC endpoint (default: the HTTP port + 1)")
    parser.add_argument("--model-repository", type=Path, help="for the started server (default: the project's)")
    parser.add_argument("--config-name", help="for the started server: --model-config-name (e.g. a GPU config)")
    parser.add_argument(
        "--configs",
        type=Path,
        help="directory of the --input-data files (default perf_configs/, perf_configs/<profile>/)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "perf")
    return parser.parse_args(argv)


def main(argv=None, description: str | None = None) -> None:
    """The sweep of `argv` (scripts/perf_sweep.py's flags); exit status 1 when a run failed or it was cut."""
    args = parse_args(argv, description)
    base = FULL if args.full else SHORT
    profile = replace(
        base,
        mixes=tuple(args.mixes or base.mixes),
        concurrency=tuple(args.concurrency or base.concurrency),
        window_ms=args.window_ms or base.window_ms,
    )
    runs_dir = args.out / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    cfg = PROFILES[args.profile]
    configs = args.configs or (CONFIG_DIR if args.profile == "demo" else CONFIG_DIR / args.profile)
    inputs = {mix: ensure_config(mix, configs, cfg) for mix in profile.mixes}
    online_inputs = {mix: ensure_online_config(mix, configs, cfg) for mix in profile.mixes}
    per_request = {mix: candidates_per_request(path) for mix, path in online_inputs.items()}
    perf_analyzer_command()  # fail before starting a server
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = _Progress

    if args.url:
        server = nullcontext(None)
    else:
        from ..tritonserver import running_tritonserver

        server = running_tritonserver(
            model_repository=args.model_repository, config_name=args.config_name, log_path=args.out / "tritonserver.log"
        )
    plan = [
        (mix, protocol, concurrency, repeat, ranker)
        for mix in profile.mixes
        for protocol in args.protocols
        for concurrency in profile.concurrency
        for repeat in range(args.repeats)
        for ranker in (args.rankers if repeat % 2 == 0 else args.rankers[::-1])
    ]
    results, interrupted = [], False
    signal.signal(signal.SIGTERM, _interrupt)
    with server as started:
        http_url = _host_port(started.http_url if started else args.url)
        if started:
            grpc_url = _host_port(started.grpc_url)
        elif args.grpc_url:
            grpc_url = _host_port(args.grpc_url)
        else:
            host, port = http_url.rsplit(":", 1)
            grpc_url = f"{host}:{int(port) + 1}"
        version = server_version(http_url)
        try:
            _measure(plan, results, inputs, online_inputs, per_request, profile, runs_dir, http_url, grpc_url, tqdm)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM (e.g. `timeout`): report the runs done so far
            tqdm.write(f"interrupted after {len(results)} of {len(plan)} runs: reporting those")
            interrupted = True

    summary = aggregate(results, args.aggregate)
    write_csv(results, args.out / "sweep.csv")
    if args.repeats > 1:
        write_csv(summary, args.out / f"sweep_{args.aggregate}.csv")
    plots = plot(summary, args.out)
    print(
        f"\n### Server throughput (`scripts/perf_sweep.py`)\n\n"
        f"{environment(version, profile, args.repeats, args.aggregate)}; model profile {args.profile!r}.\n\n"
        f"{markdown_table(summary)}\n"
    )
    if any(r.ranker == TRANSFORMED for r in summary):
        print(f"{transformed_table(summary)}\n")
    print(f"wrote {args.out / 'sweep.csv'}" + "".join(f", {p}" for p in plots))
    if interrupted or any(r.status != "ok" for r in results):
        sys.exit(1)
