"""Reliability rows that need `make serve` itself (scripts/serve as a subprocess, over a
copy of the rankers' models): hardening (restricted APIs behind the admin header, no model control),
stub kill -9 under load (serve restarts tritonserver), a tritonserver killed by a signal (serve
starts it again), and SIGTERM under load (last: it stops the
server); then the same kill and SIGTERM rows with `serve --replicas 2` (a replica with a dead stub is
killed and replaced while the other serves: only requests in flight at the kill may fail).
Long forms: scripts/reliability.py harden|kill|shutdown [--replicas N].
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from ikbo_backend.paths import REPO_ROOT
from ikbo_backend.reliability import RANKERS
from ikbo_backend.reliability.hardening import hardening
from ikbo_backend.reliability.kill import attributed_failures, kill_stubs
from ikbo_backend.reliability.load import probe
from ikbo_backend.reliability.repositories import rankers_repository
from ikbo_backend.reliability.served import serving, wait_ready
from ikbo_backend.reliability.shutdown import graceful_shutdown

EXIT_TIMEOUT = 20
SERVE = [sys.executable, str(REPO_ROOT / "scripts" / "serve"), "--cpu"]
pytestmark = pytest.mark.timeout(600)


def shown(result: dict, served=None) -> str:
    """The whole result for a failed assertion (pytest shortens a dict's repr to 240 characters), and the end of
    serve's log when given."""
    return json.dumps(result, default=str) + (f"\nserve's log:\n{served.log_tail(60)}" if served else "")


@pytest.fixture(scope="module")
def served():
    with rankers_repository() as repo, serving(EXIT_TIMEOUT, repo) as running:
        yield running


def test_restricted_apis_need_the_admin_header(served):
    result = hardening(served)
    assert not result["failures"], result["failures"]


def test_stub_kill_under_load_recovers_within_30_s_without_shm_leaks(served):
    result = kill_stubs(served, kills=1, recover_timeout=30)
    assert result["kills"] == 1 and not result["failures"], shown(result)


def test_a_tritonserver_killed_by_a_signal_is_started_again(served):
    """A crash inside tritonserver's process (SIGSEGV: a model run in process by python_inprocess)
    takes the server down; serve starts it again and both rankers answer within 60 s."""
    wait_ready(served)
    [server] = served.triton_pids()
    os.kill(server, signal.SIGSEGV)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        pids = served.triton_pids()
        if pids and server not in pids and served.all_up() and all(probe(served.http_url, m) is None for m in RANKERS):
            break
        assert served.process.poll() is None, f"serve exited with {served.process.returncode}\n{served.log_tail()}"
        time.sleep(0.5)
    else:
        pytest.fail(f"not serving again 60 s after the crash\n{served.log_tail()}")
    assert "died of signal 11; restarting tritonserver" in served.log_tail(200)


def test_sigterm_under_load_finishes_in_flight_requests_and_exits_0(served):
    result = graceful_shutdown(served, EXIT_TIMEOUT)
    assert not result["failures"], shown(result)


def test_readiness_probes_treat_a_port_that_echoes_the_request_as_not_up():
    """What a TCP self-connect to a port nothing listens on yet returns (our own request line back):
    not ready, no exception (it once ended `serve --replicas 2` while a replica was starting)."""
    import socket
    import threading

    from ikbo_backend.tritonserver import is_ready, metrics_started

    listener = socket.create_server(("localhost", 0))
    port = listener.getsockname()[1]

    def echo():
        for _ in range(2):
            connection, _ = listener.accept()
            with connection:
                connection.sendall(connection.recv(65536))

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    assert not metrics_started(f"localhost:{port}")
    assert not is_ready(f"localhost:{port}")
    thread.join(5)
    listener.close()


def test_ports_picked_for_one_server_are_distinct_and_free():
    """serve's HTTP, gRPC and metrics ports, picked together: never one port twice (tritonserver then refuses to
    start: 'cannot listen to HTTP requests and GRPC requests at the same address and port')."""
    from ikbo_backend.reliability.served import free_port_block
    from ikbo_backend.tritonserver import free_ports, port_taken

    for _ in range(50):
        ports = free_ports(3)
        metrics = free_port_block(2, avoid=ports)
        picked = [*ports, metrics, metrics + 1]
        assert len(set(picked)) == 5, picked
        assert not any(port_taken(port) for port in picked), picked


def test_each_failed_request_belongs_to_one_kill():
    """A request sent after one kill that is still in flight at the next is that next kill's in-flight failure, not
    a failure of the first round's (a slow replacement on a loaded machine made one look like a request lost
    after its replica was gone)."""
    rng = np.random.default_rng()
    t0 = float(rng.uniform(0, 100))
    gap = float(rng.uniform(20, 90))  # kill 1 comes `gap` s after kill 0
    times = [(t0, t0 + 0.2), (t0 + gap, t0 + gap + 0.2)]
    spans = {
        "in flight at kill 0": (t0 - 1, t0 + 0.1),
        "sent while replica 0 was up": (t0 + 0.1, t0 + 0.15),
        "sent after replica 0 was gone": (t0 + gap / 2, t0 + gap / 2 + 1),
        "sent after kill 0, in flight at kill 1": (t0 + gap - 1, t0 + gap + 2),
        "sent after kill 1": (t0 + gap + 5, t0 + gap + 6),
    }
    failed = [(start, end, name) for name, (start, end) in spans.items()]
    rng.shuffle(failed)
    (next0, in0, sent0, window0), (next1, in1, sent1, window1) = attributed_failures(failed, times, t0 + gap + 60)

    def names(entries):
        return sorted(e[2] for e in entries)

    assert next0 == t0 + gap and next1 == t0 + gap + 60
    assert names(in0) == ["in flight at kill 0"]
    assert names(sent0) == ["sent after replica 0 was gone", "sent while replica 0 was up"]
    assert names(window0) == ["sent while replica 0 was up"]
    assert names(in1) == ["sent after kill 0, in flight at kill 1"]
    assert names(sent1) == ["sent after kill 1"] and window1 == []


@pytest.mark.parametrize("value", ["0", "-1"])
def test_serve_refuses_fewer_than_one_replica(value):
    run = subprocess.run([*SERVE, "--replicas", value], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--replicas: expected an integer >= 1" in run.stderr, run.stderr


def test_serve_refuses_replicas_with_a_tritonserver_without_reuse_port(tmp_path):
    fake = tmp_path / "bin" / "tritonserver"  # lists the options of an older server: no --reuse-*-port
    fake.parent.mkdir()
    fake.write_text(
        "#!/bin/sh\necho 'Usage: tritonserver [options]\n  --http-port <integer>\n  --grpc-port <integer>'\nexit 1\n"
    )
    fake.chmod(0o755)
    env = {**os.environ, "TRITONSERVER": str(fake)}
    run = subprocess.run([*SERVE, "--replicas", "2"], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 2 and "--reuse-http-port or --reuse-grpc-port" in run.stderr, run.stderr


@pytest.fixture(scope="module")
def served_replicas():
    with rankers_repository() as repo, serving(EXIT_TIMEOUT, repo, replicas=2) as running:
        yield running


def test_stub_kills_with_two_replicas_fail_only_in_flight_requests(served_replicas):
    result = kill_stubs(served_replicas, kills=2, recover_timeout=30)
    assert result["kills"] == 2 and not result["failures"], shown(result, served_replicas)
    assert result["failed_sent_after_down"] == 0 and result["continuity_probes_ok"] == 4, shown(result)
    assert result["down_s_max"] <= 2.0 and not result["shm_leaked"] and result["orphan_stubs"] == 0, shown(result)


def test_sigterm_stops_every_replica_gracefully(served_replicas):
    result = graceful_shutdown(served_replicas, EXIT_TIMEOUT)
    assert not result["failures"], shown(result)
