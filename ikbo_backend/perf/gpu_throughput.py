"""Per-GPU and total candidates/s of a running tritonserver, from the increments of its Prometheus counters.

- IKBO models (`ikbo_interaction`, i.e. the batch ensemble `ikbo_ranker`, and `ikbo_ranker_online`):
  `ikbo_candidates_scored_total`, `ikbo_users_scored_total` and the batch count
  (`ikbo_candidates_per_user_count`) per model and instance device (label `device`: "cuda:0", …;
  ikbo_backend/metrics.py) → candidates/s per GPU, and their total;
- every model: Triton's `nv_inference_request_success`, `nv_inference_count` (inferences) and
  `nv_inference_exec_count` (executions) per model and `gpu_uuid` (the label Triton gives GPU
  instances, where the server has GPU metrics) → inferences/s per GPU.
Rates are increments / window seconds, the window including any ramp-up of the load. Counters that
went down (server restarted in the window) count from 0. The command line is scripts/gpu_throughput.py's.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass

from .prometheus import METRICS_SETTLE_S, Series, increments, scrape

CANDIDATES, USERS, BATCHES = "ikbo_candidates_scored_total", "ikbo_users_scored_total", "ikbo_candidates_per_user_count"
SUCCESS, INFERENCES, EXECUTIONS = "nv_inference_request_success", "nv_inference_count", "nv_inference_exec_count"


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
                f"| {r.model} | {r.device} | {r.candidates:,.0f} | {r.users:,.0f} | {r.batches:,.0f} "
                f"| {r.candidates_per_s:,.0f} |"
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
            candidates = counts[CANDIDATES]
            devices.append(
                DeviceRow(model, where or "-", candidates, counts[USERS], counts[BATCHES], candidates / seconds)
            )
        else:
            inferences = counts[INFERENCES]
            triton.append(
                TritonRow(model, where, counts[SUCCESS], inferences, counts[EXECUTIONS], inferences / seconds)
            )
    return Report(seconds, devices, triton)


def main(argv=None, description: str | None = None) -> int:
    """Measure around the command after `--` (else --duration seconds); returns the command's status."""
    argv = sys.argv[1:] if argv is None else argv
    command = argv[argv.index("--") + 1 :] if "--" in argv else []
    parser = argparse.ArgumentParser(description=description, usage="%(prog)s [options] [-- COMMAND ...]")
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
    result = report(before, scrape(args.url), seconds)
    print(f"\n### Per-GPU throughput (`scripts/gpu_throughput.py --url {args.url}`)\n\n{result.markdown()}\n")
    if args.json:
        with open(args.json, "w") as f:
            totals = {"per_device": result.per_device(), "total_candidates_per_s": result.total_candidates_per_s}
            json.dump(asdict(result) | totals, f, indent=1)
    return status
