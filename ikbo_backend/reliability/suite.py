"""The reliability rows run together, each on the server it needs, each printing a JSON line of figures
as it ends (scripts/reliability.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from ..ranker import PROFILES
from ..tritonserver import running_tritonserver
from .broken import broken
from .fault import fault, fault_server
from .hardening import hardening
from .kill import kill_stubs
from .online import batch_isolation, queue_full
from .repositories import online_repository, rankers_repository
from .served import serving
from .shutdown import graceful_shutdown
from .soak import soak
from .storm import storm

ROWS = ("storm", "fault", "harden", "kill", "shutdown", "broken", "soak", "online")


def _report(results: dict, name: str, result: dict) -> None:
    results[name] = result
    print(json.dumps({name: result}), flush=True)


def attached_soak(http_url: str, server_pid: int, seconds: float, fraction: float, profile: str) -> dict:
    """The soak row against a server already running (its rankers, `profile`'s dims)."""
    server = SimpleNamespace(http_url=http_url, process=SimpleNamespace(pid=server_pid))
    results = {}
    _report(results, "soak", dict(soak(server, seconds, fraction, cfg=PROFILES[profile]), profile=profile))
    return results


def run(
    rows,
    seed: int,
    requests: int = 1000,
    kills: int = 20,
    replicas: int = 1,
    seconds: float = 600,
    fraction: float = 0.7,
    exit_timeout: int = 30,
    rounds: int = 20,
    bursts: int = 10,
    queue_size: int = 8,
) -> dict:
    """{row: figures} of `rows` (names of ROWS); each row's figures hold its `failures` (empty: passed)."""
    rows, results = set(rows), {}
    if {"storm", "fault", "soak"} & rows:
        with rankers_repository() as repo, fault_server(repo) as server:
            if "storm" in rows:
                _report(results, "storm", dict(storm(server, requests, seed), seed=seed))
            if "fault" in rows:
                _report(results, "fault", fault(server))
            if "soak" in rows:
                _report(results, "soak", soak(server, seconds, fraction))
    if {"harden", "kill", "shutdown"} & rows:
        with rankers_repository() as repo, serving(exit_timeout, repo, replicas=replicas) as served:
            if "harden" in rows:
                _report(results, "harden", hardening(served))
            if "kill" in rows:
                _report(results, "kill", kill_stubs(served, kills))
            if "shutdown" in rows:
                _report(results, "shutdown", graceful_shutdown(served, exit_timeout))
    if "online" in rows:
        with online_repository() as repo, running_tritonserver(repo) as server:
            _report(results, "online_isolation", dict(batch_isolation(server, rounds, seed), seed=seed))
        with online_repository(queue_size) as repo, running_tritonserver(repo) as server:
            _report(results, "online_queue_full", dict(queue_full(server, bursts), max_queue_size=queue_size))
    if "broken" in rows:
        _report(results, "broken", broken())
    return results
