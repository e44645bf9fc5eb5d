"""What a running tritonserver says about its models: Triton's statistics API and our /metrics counters.

Triton's statistics (/v2/models/stats, cumulative since start) give the time per executed request of
queue, compute input, compute infer and compute output per model; `ikbo_execute_seconds_total` the wall
time inside `execute` (compute infer minus it is the python backend's IPC); and
`ikbo_triton_compilations_total` the Triton compilations by phase ("request" must stay 0).
"""

from __future__ import annotations

import json
import urllib.request

from .prometheus import scrape, sum_by

STAGES = ("queue", "compute_input", "compute_infer", "compute_output")


def _statistics(http_url: str) -> list[dict]:
    with urllib.request.urlopen(f"http://{http_url}/v2/models/stats", timeout=10) as response:
        return json.load(response).get("model_stats", [])


def model_stats(http_url: str) -> list[dict]:
    """Per model and version: executed requests and mean ms per request of each server stage."""
    rows = []
    for entry in _statistics(http_url):
        inference = entry["inference_stats"]
        count = int(inference["success"]["count"])
        if not count:
            continue
        row = {"model": entry["name"], "requests": count, "executions": int(entry.get("execution_count", 0))}
        for stage in STAGES:
            row[f"{stage}_ms"] = int(inference[stage]["ns"]) / count / 1e6
        rows.append(row)
    return rows


def execute_seconds(metrics_url: str) -> dict[str, float]:
    """ikbo_execute_seconds_total by model (summed over devices): wall time inside execute."""
    return {
        model: value for (model,), value in sum_by(scrape(metrics_url), "ikbo_execute_seconds_total", "model").items()
    }


def compilations(metrics_url: str) -> dict[str, float]:
    """ikbo_triton_compilations_total by "model:phase" (summed over devices)."""
    counts = sum_by(scrape(metrics_url), "ikbo_triton_compilations_total", "model", "phase")
    return {f"{model}:{phase}": value for (model, phase), value in counts.items()}


def server_snapshot(http_url: str, metrics_url: str) -> dict[str, dict]:
    """Cumulative Triton statistics (ns, counts) and ikbo_execute_seconds_total per model."""
    document = _statistics(http_url)
    inside = execute_seconds(metrics_url)
    snapshot = {}
    for entry in document:
        inference = entry["inference_stats"]
        snapshot[entry["name"]] = {
            "requests": int(inference["success"]["count"]), "executions": int(entry.get("execution_count", 0)),
            **{stage: int(inference[stage]["ns"]) for stage in STAGES}, "execute_s": inside.get(entry["name"]),
        }  # fmt: skip
    return snapshot


def server_times(before: dict, after: dict, model: str) -> dict:
    """Mean ms per request of each server stage of `model` between two snapshots, and the mean wall
    ms inside execute per execution; compute = compute input + infer + output."""
    a, b = after.get(model), before.get(model, {})
    requests = a["requests"] - b.get("requests", 0) if a else 0
    if not requests:
        return {}
    times = {f"{stage}_ms": (a[stage] - b.get(stage, 0)) / requests / 1e6 for stage in STAGES}
    times["compute_ms"] = times["compute_input_ms"] + times["compute_infer_ms"] + times["compute_output_ms"]
    executions = a["executions"] - b.get("executions", 0)
    exported = a["execute_s"] is not None and executions  # ikbo_execute_seconds_total: python models of this repo
    times["execute_ms"] = (
        (a["execute_s"] - (b.get("execute_s") or 0.0)) * 1e3 / executions if exported else float("nan")
    )
    return times


def stats_table(http_url: str, metrics_url: str) -> str:
    """Markdown: each model's server times since start, then the compilation counters."""
    inside = execute_seconds(metrics_url)
    lines = [
        "| model | requests | executions | queue ms | compute input ms | compute infer ms | compute output ms "
        "| inside execute ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in model_stats(http_url):
        executions = r["executions"]
        execute = f"{inside[r['model']] * 1e3 / executions:.3f}" if r["model"] in inside and executions else "–"
        lines.append(
            f"| {r['model']} | {r['requests']} | {executions} | {r['queue_ms']:.3f} | {r['compute_input_ms']:.3f} "
            f"| {r['compute_infer_ms']:.3f} | {r['compute_output_ms']:.3f} | {execute} |"
        )
    lines.append(
        "\n(compute times: mean per request; inside execute: mean per execution, from ikbo_execute_seconds_total)"
    )
    counts = compilations(metrics_url)
    listed = ", ".join(f"{k} = {v:g}" for k, v in sorted(counts.items())) or "none exported"
    return "\n".join(lines) + f"\n\nikbo_triton_compilations_total: {listed}"
