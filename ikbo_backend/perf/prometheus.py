"""tritonserver's Prometheus metrics endpoint: scrape it, parse the text exposition, take increments."""

from __future__ import annotations

import re
import urllib.request

Series = tuple[str, frozenset]  # (metric name, frozenset of (label, value))

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\d+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

# Metric updates made in process reach /metrics within 2 push periods (ikbo_backend.metrics.PUSH_PERIOD_S).
METRICS_SETTLE_S = 0.1


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


def scrape(url: str, timeout: float = 10) -> dict[Series, float]:
    """The samples of http://<url>/metrics (url: HOST:PORT of the metrics endpoint)."""
    with urllib.request.urlopen(f"http://{url}/metrics", timeout=timeout) as response:
        return parse_prometheus(response.read().decode())


def increments(before: dict[Series, float], after: dict[Series, float]) -> dict[Series, float]:
    """after − before per series (a series new in `after`, or one that went down, counts from 0)."""
    return {
        key: value - before.get(key, 0.0) if value >= before.get(key, 0.0) else value for key, value in after.items()
    }


def sum_by(samples: dict[Series, float], name: str, *labels: str) -> dict[tuple[str, ...], float]:
    """The samples of metric `name` summed over every label but `labels` (a missing label reads "?")."""
    found: dict[tuple[str, ...], float] = {}
    for (metric, pairs), value in samples.items():
        if metric == name:
            key = tuple(dict(pairs).get(label, "?") for label in labels)
            found[key] = found.get(key, 0.0) + value
    return found
