"""perf_analyzer, one measurement at a time: find it, run it at one concurrency or offered load, read its CSV.

perf_analyzer: $PERF_ANALYZER, else the one next to this Python (tritonclient[all]), else PATH. The
pip-installed one links libcudart.so.12: its directory from nvidia-cuda-runtime-cu12 is put on
LD_LIBRARY_PATH when that package is installed.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import re
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from .inputs import mix_shape

SERVER_STAGES = ("queue", "compute input", "compute infer", "compute output")  # perf_analyzer's server-side µs


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
    A perf_analyzer that outlives its time limit is killed and run once more.
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
    load = (
        ["--request-rate-range", f"{request_rate:g}:{request_rate:g}"]
        if request_rate
        else ["--concurrency-range", f"{concurrency}:{concurrency}"]
    )
    argv = prefix + [
        "-m", model, "-u", url, "-i", protocol, "--input-data", str(input_data), *load, *how, "-f", str(csv_path), "-v",
    ]  # fmt: skip
    csv_path.unlink(missing_ok=True)
    output = ""
    for attempt in range(2):
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


def server_side_us(log: str) -> dict[str, float]:
    """perf_analyzer's server-side averages per request from its log (the 'Server:' block of -v), µs."""
    found = {}
    for name in SERVER_STAGES:
        match = re.search(rf"{name} (\d+) usec", log)
        if match:
            found[name.replace(" ", "_") + "_us"] = float(match.group(1))
    return found
