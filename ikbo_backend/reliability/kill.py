"""kill -9 of python backend stubs under load: what failed, how fast service came back, what was left."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np

from ..paths import MODEL_REPOSITORY
from ..process_tree import shm_segments, stub_states
from . import RANKERS, SERVED_STAGES
from .load import Load, http_resends, probe
from .served import Served, _alive, _metrics_url, orphan_stubs, replica_successes, wait_ready

CLEAR_ERRORS = (
    "not healthy",
    "Connection",
    "connect",
    "Stub",
    "unavailable",
    "refused",
    "reset",
    "closed",
    "Broken pipe",
)


def attributed_failures(failed, times, t_end: float) -> list[tuple[float, list, list, list]]:
    """Per kill (t_kill, t_down) of `times`: the next kill's time (or `t_end`); the failed requests (start, end,
    error) in flight at the kill; those sent between it and the next kill and not in flight at that one (those are
    the next kill's: a slow replacement leaves requests sent after one kill running into the next); and of those
    the ones sent while its tritonserver was still up (start ≤ t_down)."""
    bounds = [t for t, _ in times[1:]] + [t_end]
    rounds = []
    for i, ((t_kill, t_down), t_next) in enumerate(zip(times, bounds)):
        in_flight = [e for e in failed if e[0] < t_kill <= e[1]]
        last = i == len(times) - 1
        sent = [e for e in failed if t_kill <= e[0] < t_next and (last or e[1] < t_next)]
        rounds.append((t_next, in_flight, sent, [e for e in sent if e[0] <= t_down]))
    return rounds


def kill_stubs(
    served: Served, kills: int, recover_timeout: float = 30, settle: float = 2.0, down_bound: float = 2.0
) -> dict:
    """kill -9 a python backend stub `kills` times under load (2 clients on ikbo_ranker, one on
    baseline_ranker; with several replicas each request on a new connection, so that every replica
    gets some). Per kill: requests in flight at it; requests the HTTP client resent after a server
    closed their connection unanswered (`http_resends`); failed requests, split into those in flight at
    the kill, those sent after it while its tritonserver was still up (until serve stopped it, "down_s"
    after the kill; with replicas serve SIGKILLs it within its 0.2 s poll: these reached the dying
    replica), and those sent after that (one tritonserver: during its restart; replicas: must be 0).
    Recovery: seconds until a request sent after the server went down succeeds for both rankers (within
    `recover_timeout`); with replicas also a continuity probe (one request per ranker on a new
    connection, sent as soon as the dying replica is gone, must succeed) and the seconds until serve
    runs every replica again ("replaced_s"). /dev/shm: segments of every killed tritonserver must be
    gone; no stub left without its server."""
    rng = np.random.default_rng(0)
    several = served.replicas > 1
    rounds, failures, seen_segments, times = [], [], set(), []
    shm_before = {p.name for p in Path("/dev/shm").iterdir()}
    ikbo = Load(served.http_url, threads=2, sizes=((15, 256), (32, 1024)), new_connection=several)
    baseline = Load(served.http_url, model="baseline_ranker", threads=1, sizes=((8, 128),), new_connection=several)
    with http_resends() as resends, ikbo, baseline:
        loads = (ikbo, baseline)
        for k in range(kills):
            wait_ready(served)
            time.sleep(settle)
            servers = served.triton_pids()
            stubs = {
                stub: (name, server)
                for server in servers
                for stub, (name, state) in stub_states(server).items()
                if state not in "ZX" and name.startswith(SERVED_STAGES)
            }
            if not stubs:
                failures.append(f"kill {k}: no live stub of {SERVED_STAGES} under tritonservers {servers}")
                break
            for server in servers:
                seen_segments |= shm_segments(server)
            victim = sorted(stubs)[int(rng.integers(len(stubs)))]
            name, server = stubs[victim]
            metrics_url = _metrics_url(server)
            answered = replica_successes(metrics_url) if several and metrics_url else None
            t_kill = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            t_down = None
            while time.monotonic() - t_kill < recover_timeout + 60:  # serve stops (replicas: SIGKILLs) its tritonserver
                if not _alive(server):
                    t_down = time.monotonic()
                    break
                time.sleep(0.01)
            continuity = {model: probe(served.http_url, model) for model in RANKERS} if several and t_down else {}
            probed = time.monotonic() - t_kill
            after = t_down if t_down is not None else t_kill
            recovered = replaced = None
            while (
                time.monotonic() - t_kill < recover_timeout + 60
            ):  # clients succeed again; serve runs every replica again
                if recovered is None and all(any(e[0] >= after and e[2] is None for e in load.log) for load in loads):
                    recovered = (
                        max(min(e[1] for e in load.log if e[0] >= after and e[2] is None) for load in loads) - t_kill
                    )
                if replaced is None and server not in served.triton_pids() and served.all_up():
                    replaced = time.monotonic() - t_kill
                if recovered is not None and replaced is not None:
                    break
                time.sleep(0.1)
            times.append((t_kill, after))
            rounds.append({
                "stub": name,
                "replica": served.metrics_urls.index(metrics_url) if metrics_url in served.metrics_urls else None,
                "replica_answered_before": answered,
                "down_s": None if t_down is None else round(t_down - t_kill, 3),
                "recovery_s": None if recovered is None else round(recovered, 2),
                "replaced_s": None if replaced is None else round(replaced, 1),
                **({"continuity_probe": {m: e or "ok" for m, e in continuity.items()}, "probe_s": round(probed, 2)} if several else {}),
            })  # fmt: skip
            if t_down is None:
                failures.append(f"kill {k} ({name}): its tritonserver {server} still up after {recover_timeout + 60} s")
            elif several and t_down - t_kill > down_bound:
                failures.append(
                    f"kill {k} ({name}): its replica went down {t_down - t_kill:.2f} s after the kill (bound {down_bound} s)"
                )
            if recovered is None or recovered > recover_timeout:
                failures.append(f"kill {k} ({name}): service not back within {recover_timeout} s")
            if replaced is None:
                failures.append(f"kill {k} ({name}): serve did not run {served.replicas} ready tritonserver(s) again")
            bad_probes = {m: e for m, e in continuity.items() if e}
            if bad_probes:
                failures.append(
                    f"kill {k} ({name}): a request sent right after the replica went down failed: {bad_probes}"
                )
        wait_ready(served)
        t_end = time.monotonic()
    # Every failed request belongs to one kill (attributed_failures).
    log = [e for load in loads for e in load.log if e[2]]
    entries = [e for load in loads for e in load.log]
    attributed = attributed_failures(log, times, t_end)
    for round_, (t_kill, t_down), (t_next, in_flight, sent, window) in zip(rounds, times, attributed):
        round_.update({
            "in_flight": sum(e[0] < t_kill <= e[1] for e in entries),
            "resent_by_client": sum(t_kill <= t < t_next for t in resends),
            "failed_in_flight": len(in_flight),
            "failed_sent_before_down": len(window),
            "failed_sent_after_down": len(sent) - len(window),
            "errors": sorted({e[2].split(" (")[0][:160] for e in in_flight + sent})[:4],
        })  # fmt: skip
        unclear = [e[2] for e in in_flight + sent if not any(w in e[2] for w in CLEAR_ERRORS)]
        if unclear:
            failures.append(f"kill at {t_kill:.1f}: unclear errors {unclear[:3]}")
        if several and len(sent) > len(window):
            late = [(round(e[0] - t_kill, 2), round(e[1] - t_kill, 2)) for e in sent if e[0] > t_down]
            failures.append(
                f"{round_['stub']}: {len(late)} request(s) sent after its replica went down failed: {round_['errors']}; "
                f"(sent, failed) s after the kill: {late[:6]}, replica down at {round_['down_s']} s, replaced at {round_['replaced_s']} s"
            )
    before_first = [e for e in log if times and e[1] < times[0][0]]
    if before_first:
        failures.append(
            f"{len(before_first)} request(s) failed before the first kill: {[e[2][:160] for e in before_first[:3]]}"
        )
    repo = next(
        (a.split("=", 1)[1] for a in served.process.args if str(a).startswith("--model-repository=")),
        str(MODEL_REPOSITORY),
    )
    orphans = orphan_stubs(repo)
    if orphans:
        failures.append(f"python backend stubs left without their tritonserver: {orphans}")
    current = set().union(*(shm_segments(pid) for pid in served.triton_pids()))
    leaked = sorted(s for s in seen_segments - current if Path(s).exists())
    new_files = {p.name for p in Path("/dev/shm").iterdir()} - shm_before
    if leaked:
        failures.append(f"/dev/shm segments of replaced servers left: {leaked}")
    recoveries = [r["recovery_s"] for r in rounds if r["recovery_s"] is not None]
    replacements = [r["replaced_s"] for r in rounds if r["replaced_s"] is not None]
    downs = [r["down_s"] for r in rounds if r["down_s"] is not None]
    return {
        "replicas": served.replicas,
        "kills": len(rounds),
        "rounds": rounds,
        "recovery_s_max": max((r["recovery_s"] or float("inf")) for r in rounds) if rounds else None,
        "recovery_s_mean": round(float(np.mean(recoveries)), 2) if recoveries else None,
        "replaced_s_min_max": [min(replacements), max(replacements)] if replacements else None,
        "down_s_max": max(downs) if downs else None,
        "in_flight": sum(r["in_flight"] for r in rounds),
        "resent_by_client": sum(r["resent_by_client"] for r in rounds),
        "failed_in_flight": sum(r["failed_in_flight"] for r in rounds),
        "failed_sent_before_down": sum(r["failed_sent_before_down"] for r in rounds),
        "failed_sent_after_down": sum(r["failed_sent_after_down"] for r in rounds),
        "failed_after_kill": sum(r["failed_sent_before_down"] + r["failed_sent_after_down"] for r in rounds),
        "continuity_probes_ok": sum(v == "ok" for r in rounds for v in r.get("continuity_probe", {}).values())
        if several
        else None,
        "requests": len(ikbo.log) + len(baseline.log),
        "shm_segments_server_now": len(current),
        "shm_segments_seen": len(seen_segments),
        "shm_leaked": leaked,
        "orphan_stubs": len(orphans),
        "shm_new_files_total": len(new_files),
        "failures": failures,
    }
