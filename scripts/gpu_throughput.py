#!/usr/bin/env python3
"""Per-GPU and total candidates/s of a running tritonserver, from its Prometheus metrics (issue 8).

Reads /metrics before and after a measurement window and reports the counter increments:
- IKBO models (`ikbo_interaction`, i.e. the batch ensemble `ikbo_ranker`, and `ikbo_ranker_online`):
  `ikbo_candidates_scored_total`, `ikbo_users_scored_total` and the batch count
  (`ikbo_candidates_per_user_count`) per model and instance device (label `device`: "cuda:0", …;
  ikbo_backend/metrics.py) → candidates/s per GPU, and their total;
- every model: Triton's `nv_inference_request_success`, `nv_inference_count` (inferences) and
  `nv_inference_exec_count` (executions) per model and `gpu_uuid` (the label Triton gives GPU
  instances, where the server has GPU metrics) → inferences/s per GPU.
Rates are increments / window seconds, the window including any ramp-up of the load. Counters that
went down (server restarted in the window) count from 0.

The window is a command run after `--` (e.g. a perf_sweep point against the same server), else
--duration seconds of whatever load is running:

    python scripts/gpu_throughput.py --url localhost:8002 -- \\
        python scripts/perf_sweep.py --url localhost:8000 --rankers ikbo_ranker --mixes <mix> --concurrency 8 --protocols grpc
    python scripts/gpu_throughput.py --url localhost:8002 --duration 60 --json out/gpu_throughput.json

Prints markdown tables (for docs/perf.md); exits with the command's status.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from dataclasses import asdict, dataclass

Series = tuple[str, frozenset]  # (metric name, frozenset of (label, value))

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\d+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

CANDIDATES, USERS, BATCHES = "ikbo_candidates_scored_total", "ikbo_users_scored_total", "ikbo_candidates_per_user_count"
SUCCESS, INFERENCES, EXECUTIONS = "nv_inference_request_success", "nv_inference_count", "nv_inference_exec_count"


def parse_prometheus(text: str) -> dict[Series, float]:
    """Prometheus text exposition → {(name, labels): value}; comments and blank lines skipped."""
    samples = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            raise ValueError(f"not a Prometheus sample line: {line!r}")
        name, labels, value = match.groups()
        samples[(name, frozenset(_LABEL.findall(labels or "")))] = float(value)
    return samples


METRICS_SETTLE_S = 0.1  # in process, metric updates reach /metrics within 50 ms (ikbo_backend.metrics.PUSH_PERIOD_S)


def scrape(url: str) -> dict[Series, float]:
    """The samples of http://<url>/metrics (url: HOST:PORT of the metrics endpoint)."""
    with urllib.request.urlopen(f"http://{url}/metrics", timeout=10) as response:
        return parse_prometheus(response.read().decode())


def increments(before: dict[Series, float], after: dict[Series, float]) -> dict[Series, float]:
    """after − before per series (a series new in `after`, or one that went down, counts from 0)."""
    return {
        key: value - before.get(key, 0.0) if value >= before.get(key, 0.0) else value for key, value in after.items()
    }


@dataclass
class DeviceRow:
    """IKBO candidates scored by one model's instance(s) on one device during the window."""

    model: str
    device: str
    candidates: float
    users: float
    batches: float
    candidates_per_s: float


@dataclass
class TritonRow:
    """Triton's per-model, per-GPU counts during the window (gpu_uuid "" where Triton gives none)."""

    model: str
    gpu_uuid: str
    successes: float
    inferences: float
    executions: float
    inferences_per_s: float


@dataclass
class Report:
    seconds: float
    devices: list[DeviceRow]
    triton: list[TritonRow]

    def per_device(self) -> dict[str, float]:
        """device → candidates/s over all IKBO models."""
        totals = defaultdict(float)
        for row in self.devices:
            totals[row.device] += row.candidates_per_s
        return dict(sorted(totals.items()))

    @property
    def total_candidates_per_s(self) -> float:
        return sum(row.candidates_per_s for row in self.devices)

    def markdown(self) -> str:
        total = self.total_candidates_per_s
        lines = [f"Window: {self.seconds:.1f} s.", ""]
        lines += ["| model | device | candidates | users | batches | candidates/s |", "|---|---|---:|---:|---:|---:|"]
        for r in self.devices:
            lines.append(
                f"| {r.model} | {r.device} | {r.candidates:,.0f} | {r.users:,.0f} | {r.batches:,.0f} | {r.candidates_per_s:,.0f} |"
            )
        lines += ["", "| device | candidates/s | share |", "|---|---:|---:|"]
        for device, rate in self.per_device().items():
            lines.append(f"| {device} | {rate:,.0f} | {rate / total:.0%} |" if total else f"| {device} | 0 | – |")
        lines += [f"| **total** | **{total:,.0f}** | |", ""]
        lines += [
            "| model | gpu_uuid | successes | inferences | executions | inferences/s |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for r in self.triton:
            lines.append(
                f"| {r.model} | {r.gpu_uuid or '–'} | {r.successes:,.0f} | {r.inferences:,.0f} | {r.executions:,.0f} "
                f"| {r.inferences_per_s:,.1f} |"
            )
        return "\n".join(lines)


def report(before: dict[Series, float], after: dict[Series, float], seconds: float) -> Report:
    """Per-(model, device) IKBO rows and per-(model, gpu_uuid) Triton rows of the window; rows with
    nothing counted are left out."""
    if not 0 < seconds < math.inf:
        raise ValueError(f"seconds: expected a positive window, got {seconds}")
    by = defaultdict(lambda: defaultdict(float))
    for (name, labels), value in increments(before, after).items():
        labels = dict(labels)
        if name in (CANDIDATES, USERS, BATCHES):
            by[("ikbo", labels.get("model", ""), labels.get("device", ""))][name] += value
        elif name in (SUCCESS, INFERENCES, EXECUTIONS):
            by[("triton", labels.get("model", ""), labels.get("gpu_uuid", ""))][name] += value
    devices, triton = [], []
    for (kind, model, where), counts in sorted(by.items()):
        if not any(counts.values()):
            continue
        if kind == "ikbo":
            devices.append(
                DeviceRow(
                    model,
                    where or "-",
                    counts[CANDIDATES],
                    counts[USERS],
                    counts[BATCHES],
                    counts[CANDIDATES] / seconds,
                )
            )
        else:
            triton.append(
                TritonRow(
                    model, where, counts[SUCCESS], counts[INFERENCES], counts[EXECUTIONS], counts[INFERENCES] / seconds
                )
            )
    return Report(seconds, devices, triton)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[argv.index("--") + 1 :] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], usage="%(prog)s [options] [-- COMMAND ...]")
    parser.add_argument(
        "--url", default="localhost:8002", help="HOST:PORT of the server's metrics endpoint (default localhost:8002)"
    )
    parser.add_argument("--duration", type=float, default=30, help="window in seconds when no command is given")
    parser.add_argument("--json", help="also write the report as JSON to this file")
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    before, start = scrape(args.url), time.monotonic()
    status = subprocess.call(command) if command else (time.sleep(args.duration) or 0)
    seconds = time.monotonic() - start
    time.sleep(METRICS_SETTLE_S)
    after = scrape(args.url)
    result = report(before, after, seconds)
    print(f"\n### Per-GPU throughput (`scripts/gpu_throughput.py --url {args.url}`)\n\n{result.markdown()}\n")
    if args.json:
        with open(args.json, "w") as f:
            totals = {"per_device": result.per_device(), "total_candidates_per_s": result.total_candidates_per_s}
            json.dump(asdict(result) | totals, f, indent=1)
    return status


if __name__ == "__main__":
    sys.exit(main())
