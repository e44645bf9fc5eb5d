#!/usr/bin/env python3
"""perf_analyzer sweep of both rankers through a real tritonserver: rankers × mixes × concurrency × protocol.

Starts a tritonserver on free ports (`ikbo_backend.tritonserver.running_tritonserver`) unless `--url`
points at one already running, then runs perf_analyzer once per (mix, protocol, concurrency, ranker),
the two rankers back to back, with `--input-data perf_configs/<mix>.json` (written first when missing,
see scripts/make_perf_configs.py) and `-f <run>.csv`. Candidates/s = infer/s × B of the mix.

Online endpoints (`ikbo_ranker_online`, `baseline_ranker_online`: one user per request, coalesced by
the server): a mix is sent as U one-user requests of B/U candidates on average
(`perf_configs/<mix>.online.json`), and concurrency level c keeps c·U requests in flight (`in_flight`),
the offered load of c batch requests. Candidates/s = infer/s × candidates per request of the file.

Writes into --out (default out/perf/): sweep.csv, throughput.png (candidates/s vs concurrency),
latency.png (p50/p99 latency vs candidates/s), runs/<run>.csv|.log; prints a markdown table.

    python scripts/perf_sweep.py                        # short CPU sweep (a few minutes)
    python scripts/perf_sweep.py --full                 # every mix, concurrency 1..16, longer windows
    python scripts/perf_sweep.py --url localhost:8000 --grpc-url localhost:8001
    PERF_ANALYZER=/tmp/tb/bin/perf_analyzer python scripts/perf_sweep.py --config-name gpu --full

perf_analyzer: $PERF_ANALYZER, else the one next to this Python (tritonclient[all]), else PATH.
The pip-installed one links libcudart.so.12: its directory from nvidia-cuda-runtime-cu12 is put on
LD_LIBRARY_PATH when that package is installed.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import urllib.request
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

from ikbo_backend.perf.inputs import DEFAULT_DIR as CONFIG_DIR  # noqa: E402
from ikbo_backend.perf.inputs import MIXES, candidates_per_request, ensure_config, ensure_online_config, mix_shape  # noqa: E402
from ikbo_backend.ranker import PROFILES  # noqa: E402

RANKERS = ("baseline_ranker", "ikbo_ranker")  # baseline first: the reference of every ratio
ONLINE_RANKERS = ("baseline_ranker_online", "ikbo_ranker_online")  # one user per request
TRANSFORMED = "transformed_ranker"  # the baseline's code after the IKBO pass: compared with ikbo_ranker
PAIRS = {"batch": RANKERS, "online": ONLINE_RANKERS}
PROTOCOLS = ("http", "grpc")


@dataclass(frozen=True)
class Profile:
    """How much to measure: which mixes and concurrency levels, and perf_analyzer's windows.

    request_count 0: stabilise over time windows (perf_analyzer's default method); N > 0: one
    measurement of exactly N requests, no stability criterion (what a run falls back to when the
    windows do not stabilise, e.g. on a shared machine).
    """

    mixes: tuple[str, ...]
    concurrency: tuple[int, ...]
    window_ms: int
    stability_pct: int
    max_trials: int
    request_count: int = 0


SHORT = Profile(("u15_b1024", "u1_b64", "u64_b64"), (1, 2), window_ms=1500, stability_pct=20, max_trials=5)
FULL = Profile(tuple(MIXES), (1, 2, 4, 8, 16), window_ms=5000, stability_pct=10, max_trials=10)


@dataclass
class Result:
    ranker: str
    mix: str
    users: int
    candidates: int
    protocol: str
    concurrency: int
    repeat: int = 0
    infer_per_s: float = float("nan")
    candidates_per_s: float = float("nan")
    p50_ms: float = float("nan")
    p90_ms: float = float("nan")
    p99_ms: float = float("nan")
    mode: str = ""  # "windows" (stable time windows) | "count N" (N requests, no stability criterion)
    status: str = "ok"  # ok | error: <first error line>
    load1: float = float("nan")  # 1-minute load average when the run ended (other work on the machine)
    in_flight: int = 0  # perf_analyzer's concurrency: = concurrency (batch), concurrency × U (online)


# ---------------------------------------------------------------------------------------------
# perf_analyzer
# ---------------------------------------------------------------------------------------------


def perf_analyzer_command() -> tuple[list[str], dict[str, str]]:
    """(argv prefix, environment) for perf_analyzer; see the module docstring for the search order."""
    binary = os.environ.get("PERF_ANALYZER")
    if not binary:
        beside = Path(sys.executable).parent / "perf_analyzer"
        binary = str(beside) if beside.exists() else shutil.which("perf_analyzer")
    if not binary:
        raise FileNotFoundError("perf_analyzer not found: set $PERF_ANALYZER or pip install tritonclient[all]")
    env = dict(os.environ)
    spec = importlib.util.find_spec("nvidia.cuda_runtime") if importlib.util.find_spec("nvidia") else None
    if spec and spec.submodule_search_locations:
        lib = Path(list(spec.submodule_search_locations)[0]) / "lib"
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(lib), env.get("LD_LIBRARY_PATH")) if p)
    return [binary], env


def run_perf_analyzer(
    model: str,
    url: str,
    protocol: str,
    input_data: Path,
    concurrency: int,
    profile: Profile,
    csv_path: Path,
    log_path: Path,
    timeout_s: float | None = None,
    request_rate: float | None = None,
) -> tuple[dict[str, str] | None, str, str]:
    """One perf_analyzer measurement at one concurrency, or at a fixed offered load of
    `request_rate` requests/s (`--request-rate-range`; `concurrency` then only sizes the fallback).
    Returns (its CSV row or None, mode, status).

    mode: "windows" or "count N" (see Profile); status: "ok" or "error: <first error line>".
    perf_analyzer writes no CSV when its windows do not stabilise (exit code 2); the run is then
    repeated once as a fixed count of requests: 3 windows' worth at the rate its windows saw.
    """
    prefix, env = perf_analyzer_command()
    if profile.request_count:
        mode = f"count {profile.request_count}"
        how = ["--request-count", str(profile.request_count)]
        limit = timeout_s or 60 + 30 * profile.window_ms / 1e3
    else:
        mode = "windows"
        how = [
            "--measurement-mode", "time_windows",
            "--measurement-interval", str(profile.window_ms),
            "--stability-percentage", str(profile.stability_pct),
            "--max-trials", str(profile.max_trials),
        ]  # fmt: skip
        limit = timeout_s or 30 + 2 * profile.max_trials * profile.window_ms / 1e3
    argv = prefix + [
        "-m", model,
        "-u", url,
        "-i", protocol,
        "--input-data", str(input_data),
        *(["--request-rate-range", f"{request_rate:g}:{request_rate:g}"] if request_rate else ["--concurrency-range", f"{concurrency}:{concurrency}"]),
        *how,
        "-f", str(csv_path),
        "-v",
    ]  # fmt: skip
    csv_path.unlink(missing_ok=True)
    output = ""
    for attempt in range(
        2
    ):  # a perf_analyzer that stalls (seen in request-rate count mode on a loaded 2-core machine, with the server idle) is run once more
        try:
            proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=limit)
            output, returncode = output + proc.stdout + proc.stderr, proc.returncode
            break
        except subprocess.TimeoutExpired as exc:
            output += "".join(
                x.decode(errors="replace") if isinstance(x, bytes) else x for x in (exc.stdout or "", exc.stderr or "")
            )
            output, returncode = f"{output}\ntimed out after {limit:.0f} s (attempt {attempt + 1} of 2)\n", -1
    with log_path.open("a" if profile.request_count else "w") as log:
        log.write(" ".join(argv) + "\n\n" + output + "\n")

    rows = []
    if csv_path.exists():
        column = "Request Rate" if request_rate else "Concurrency"
        rows = [
            r for r in csv.DictReader(csv_path.open()) if (r.get(column) or "").strip().replace(".", "", 1).isdigit()
        ]
    if returncode == 0 and rows:
        return rows[-1], mode, "ok"
    rates = [float(m) for m in re.findall(r"Pass \[\d+\] throughput: ([0-9.]+) infer/sec", output)]
    if "failed to obtain stable measurement" in output.lower() and not profile.request_count and rates:
        count = max(5 * concurrency, round(statistics.median(rates) * 3 * profile.window_ms / 1e3))
        fallback = replace(profile, request_count=count)
        return run_perf_analyzer(
            model, url, protocol, input_data, concurrency, fallback, csv_path, log_path, timeout_s, request_rate
        )
    problem = next((line.strip() for line in output.splitlines() if "error" in line.lower()), None)
    return None, mode, f"error: {problem or f'exit code {returncode}, see {log_path}'}"


def to_result(
    ranker, mix, protocol, concurrency, repeat, row, mode, status, per_request: float | None = None
) -> Result:
    """`per_request`: candidates per request (online endpoints), default B of the mix."""
    users, candidates = mix_shape(mix)
    result = Result(ranker, mix, users, candidates, protocol, concurrency, repeat, mode=mode, status=status)
    if row is not None:
        result.infer_per_s = float(row["Inferences/Second"])
        result.candidates_per_s = result.infer_per_s * (per_request or candidates)
        for pct in (50, 90, 99):
            setattr(result, f"p{pct}_ms", float(row[f"p{pct} latency"]) / 1e3)  # perf_analyzer writes µs
    return result


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


# ---------------------------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------------------------


def write_csv(results: list[Result], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[fl.name for fl in fields(Result)])
        writer.writeheader()
        writer.writerows(asdict(r) for r in results)


def markdown_table(results: list[Result]) -> str:
    """One line per (mix, protocol, concurrency, endpoint batch | online): the two rankers side by side."""
    by_key = {(r.mix, r.protocol, r.concurrency, r.ranker): r for r in results}
    lines = [
        "| mix (U:B) | protocol | concurrency | endpoint | baseline candidates/s | IKBO candidates/s | IKBO / baseline "
        "| baseline p50 / p99 ms | IKBO p50 / p99 ms |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    points = [
        (mix, protocol, concurrency, endpoint)
        for mix, protocol, concurrency in dict.fromkeys((r.mix, r.protocol, r.concurrency) for r in results)
        for endpoint, pair in PAIRS.items()
        if any((mix, protocol, concurrency, name) in by_key for name in pair)
    ]
    for mix, protocol, concurrency, endpoint in points:
        base, ikbo = (by_key.get((mix, protocol, concurrency, name)) for name in PAIRS[endpoint])

        def rate(r):
            if r is None or r.status != "ok":
                return r.status.split(":")[0] if r else "–"
            return f"{r.candidates_per_s:,.0f}" + ("†" if "count" in r.mode else "")

        def lat(r):
            return f"{r.p50_ms:.1f} / {r.p99_ms:.1f}" if r and r.status == "ok" else "–"

        ratio = "–"
        if base and ikbo and base.candidates_per_s > 0 and ikbo.candidates_per_s > 0:
            ratio = f"**{ikbo.candidates_per_s / base.candidates_per_s:.2f}×**"
        users, candidates = mix_shape(mix)
        lines.append(
            f"| {mix} ({users}:{candidates}) | {protocol} | {concurrency} | {endpoint} | {rate(base)} | {rate(ikbo)} | {ratio} "
            f"| {lat(base)} | {lat(ikbo)} |"
        )
    note = (
        "\n\n† at least one measurement fell back to a fixed request count: perf_analyzer's time "
        "windows did not stabilise (shared or noisy machine)."
    )
    return "\n".join(lines) + (note if any("count" in r.mode for r in results if r.status == "ok") else "")


def transformed_table(results: list[Result]) -> str:
    """transformed_ranker (the baseline's code after the IKBO pass) next to the hand-written ikbo_ranker."""
    by_key = {(r.mix, r.protocol, r.concurrency, r.ranker): r for r in results if r.status == "ok"}
    lines = [
        "| mix (U:B) | protocol | concurrency | IKBO candidates/s | transformed candidates/s | transformed / IKBO "
        "| IKBO p50 / p99 ms | transformed p50 / p99 ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for mix, protocol, concurrency in dict.fromkeys((r.mix, r.protocol, r.concurrency) for r in results):
        ikbo, moved = (
            by_key.get((mix, protocol, concurrency, "ikbo_ranker")),
            by_key.get((mix, protocol, concurrency, TRANSFORMED)),
        )
        if ikbo and moved:
            lines.append(
                f"| {mix} | {protocol} | {concurrency} | {ikbo.candidates_per_s:,.0f} | {moved.candidates_per_s:,.0f} "
                f"| **{moved.candidates_per_s / ikbo.candidates_per_s:.2f}×** | {ikbo.p50_ms:.1f} / {ikbo.p99_ms:.1f} "
                f"| {moved.p50_ms:.1f} / {moved.p99_ms:.1f} |"
            )
    return "\n".join(lines)


def plot(results: list[Result], out_dir: Path) -> list[Path]:
    """throughput.png and latency.png, one panel per mix (none when matplotlib is not installed)."""
    try:
        import matplotlib
    except ImportError:  # e.g. a bare GPU machine's Python: the CSV and the table still come out
        print("matplotlib not installed: no plots", file=sys.stderr)
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    good = [r for r in results if r.status == "ok"]
    mixes = list(dict.fromkeys(r.mix for r in good))
    if not mixes:
        return []
    styles = {"baseline_ranker": "tab:gray", "ikbo_ranker": "tab:green"}
    styles.update({"baseline_ranker_online": "tab:brown", "ikbo_ranker_online": "tab:blue", TRANSFORMED: "tab:olive"})
    paths = []
    for name, ylabel in (("throughput", "candidates/s"), ("latency", "latency (ms)")):
        fig, axes = plt.subplots(1, len(mixes), figsize=(5 * len(mixes), 4), squeeze=False)
        for ax, mix in zip(axes[0], mixes):
            for ranker in RANKERS + ONLINE_RANKERS + (TRANSFORMED,):
                for protocol, marker in zip(PROTOCOLS, ("o", "s")):
                    rs = sorted(
                        (r for r in good if (r.mix, r.ranker, r.protocol) == (mix, ranker, protocol)),
                        key=lambda r: r.concurrency,
                    )
                    if not rs:
                        continue
                    label = f"{ranker.replace('_ranker', '')} {protocol}"
                    color = styles[ranker]
                    if name == "throughput":
                        ax.plot(
                            [r.concurrency for r in rs],
                            [r.candidates_per_s for r in rs],
                            marker=marker,
                            color=color,
                            label=label,
                        )
                        ax.set_xlabel("concurrency")
                        ax.set_xscale("log", base=2)
                        ax.set_xticks([r.concurrency for r in rs], [str(r.concurrency) for r in rs])
                    else:
                        x = [r.candidates_per_s for r in rs]
                        ax.plot(x, [r.p50_ms for r in rs], marker=marker, color=color, label=f"{label} p50")
                        ax.plot(
                            x,
                            [r.p99_ms for r in rs],
                            marker=marker,
                            color=color,
                            linestyle="--",
                            alpha=0.6,
                            label=f"{label} p99",
                        )
                        ax.set_xlabel("candidates/s")
            ax.set_ylim(bottom=0)  # after every line: an earlier set_ylim would freeze the top at the first line's
            users, candidates = mix_shape(mix)
            ax.set_title(f"{mix} (U={users}, B={candidates})")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle("IKBO vs baseline ranker through tritonserver (perf_analyzer)")
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def server_version(http_url: str) -> str:
    try:
        with urllib.request.urlopen(f"http://{http_url}/v2", timeout=5) as response:
            return json.load(response).get("version", "?")
    except OSError:
        return "?"


def _host_port(url: str) -> str:
    return url.split("://", 1)[-1].rstrip("/")


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


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
        results.append(
            to_result(
                ranker, mix, protocol, concurrency, repeat, row, mode, status, per_request[mix] if online else None
            )
        )
        results[-1].load1, results[-1].in_flight = os.getloadavg()[0], in_flight
        if status != "ok":
            tqdm.write(f"{name}: {status}, see {runs_dir / name}.log")


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--full", action="store_true", help=f"long sweep: {FULL}")
    parser.add_argument("--mixes", nargs="+", choices=list(MIXES), help="override the profile's mixes")
    parser.add_argument("--concurrency", nargs="+", type=int, help="override the profile's concurrency levels")
    parser.add_argument("--window-ms", type=int, help="override the profile's measurement window")
    parser.add_argument("--repeats", type=int, default=1, help="measure every point this many times")
    parser.add_argument("--aggregate", choices=("median", "best"), default="median", help="how repeats are combined")
    parser.add_argument(
        "--rankers",
        nargs="+",
        default=list(RANKERS + ONLINE_RANKERS),
        choices=list(RANKERS + ONLINE_RANKERS) + [TRANSFORMED],
    )
    parser.add_argument(
        "--profile",
        default="demo",
        choices=sorted(PROFILES),
        help="model dims of the served config (ikbo_backend.ranker.PROFILES)",
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


def environment(version: str, profile: Profile, repeats: int, how: str) -> str:
    from bench_model import device_name

    return (
        f"{device_name()}, {os.cpu_count()} cores; tritonserver {version}; perf_analyzer "
        f"{perf_analyzer_command()[0][0]} (tritonclient {_version('tritonclient')} installed); "
        f"{profile.window_ms} ms windows, stability {profile.stability_pct} %, {how} of {repeats} "
        f"measurement(s) per cell; {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}"
    )


def main(argv=None) -> None:
    args = parse_args(argv)
    base = FULL if args.full else SHORT
    profile = replace(
        base, mixes=tuple(args.mixes or base.mixes), concurrency=tuple(args.concurrency or base.concurrency)
    )
    profile = replace(profile, window_ms=args.window_ms or base.window_ms)
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
    except ImportError:  # progress on stderr without tqdm (a bare GPU machine's Python)

        class tqdm(list):
            def __init__(self, items, **_):
                super().__init__(items)

            def set_postfix_str(self, text):
                print(f"[{len(self)} runs] {text}", file=sys.stderr, flush=True)

            write = staticmethod(lambda text: print(text, file=sys.stderr))

    if args.url:
        server = nullcontext(None)
    else:
        from ikbo_backend.tritonserver import running_tritonserver

        server = running_tritonserver(
            model_repository=args.model_repository, config_name=args.config_name, log_path=args.out / "tritonserver.log"
        )
    # the rankers back to back at every point, their order alternating between repeats
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
        f"\n### Server throughput (`scripts/perf_sweep.py`)\n\n{environment(version, profile, args.repeats, args.aggregate)}; model profile {args.profile!r}.\n\n{markdown_table(summary)}\n"
    )
    if any(r.ranker == TRANSFORMED for r in summary):
        print(f"{transformed_table(summary)}\n")
    print(f"wrote {args.out / 'sweep.csv'}" + "".join(f", {p}" for p in plots))
    if interrupted or any(r.status != "ok" for r in results):
        sys.exit(1)


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "?"


if __name__ == "__main__":
    main()
