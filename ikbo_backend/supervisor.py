"""`scripts/serve`'s supervisor: one or several tritonservers in the foreground, restarted when a python
backend stub dies or the server crashes, stopped gracefully on a signal.

Dead stubs: python backend 2.51 never restarts a stub process that died (kill -9, OOM killer): every
later request to its model fails, and tritonserver cannot unload that model on shutdown. Every
POLL_S the supervisor looks for dead stubs (ikbo_backend.process_tree). With one tritonserver, when
a stub dies it stops the server (SIGTERM, SIGKILL after `restart_grace` s), unlinks the /dev/shm
segments it had mapped, and starts it again on the same ports (at most `max_restarts` times):
requests fail until it is ready again. A tritonserver that dies of a signal after it was ready (a
crash in a model run inside its process by the python_inprocess backend, the OOM killer) is started
again the same way; one that exits with a status ends serving (the others are stopped).

Replicas (docs/reliability.md): N tritonservers with the same arguments share the HTTP and gRPC ports
(--reuse-http-port, --reuse-grpc-port: the kernel spreads new connections over them); replica i
serves metrics on metrics_port + i, which also tells when it is ready (2.51 starts metrics last,
after all models loaded). Each has its own stubs and /dev/shm segments: N times the memory. When a
stub of one dies while another is ready, that replica's process group is SIGKILLed at once (its
in-flight requests fail), its segments unlinked and a replacement started while the others serve;
with none other ready it is stopped as with one.

SIGINT, SIGTERM or SIGHUP stop every server gracefully (in-flight requests get `exit_timeout` s); the
exit status is the first non-zero one of the servers that had been ready, else 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .paths import REPO_ROOT
from .process_tree import dead_stubs, shm_segments
from .tritonserver import (
    ADMIN_HEADER,
    REUSE_PORT_ARGS,
    find_tritonserver,
    hardening_args,
    is_ready,
    kill_group,
    metrics_started,
    missing_options,
    port_taken,
    stop,
    tritonserver_command,
)

POLL_S = 0.2  # how often every tritonserver is checked for dead stubs, exit and readiness
SEGMENTS_EVERY = 25  # polls between readings of the /dev/shm segments mapped (~5 ms a server on 2 cores)


class ServeError(RuntimeError):
    """Serving stopped (every server stopped first): the message says why."""


@dataclass
class Replica:
    """One supervised tritonserver: its command line, its readiness check, and what it had mapped."""

    label: str  # "tritonserver" (one) or "replica <i>"
    cmd: list[str]
    ready_url: str  # HTTP (one replica: /v2/health/ready) or its own metrics port (several)
    process: subprocess.Popen | None = None
    ready: bool = False
    deadline: float = 0.0  # monotonic time by which it must be ready
    segments: set[str] = field(default_factory=set)  # /dev/shm files it mapped


def check_replicas(replicas: int, http_port: int, grpc_port: int, metrics_port: int, extra_args=()) -> None:
    """ValueError naming --replicas when `replicas` servers cannot share these ports: fewer than one,
    a metrics port that is the HTTP or gRPC one, metrics turned off (their readiness), a tritonserver
    without reuse-port options, or a port in use (a server left there would take a share of the connections)."""
    if replicas < 1:
        raise ValueError(f"--replicas: expected an integer >= 1, got {replicas}")
    if replicas == 1:
        return
    metrics_ports = [metrics_port + i for i in range(replicas)]
    clash = {http_port, grpc_port} & set(metrics_ports)
    if clash:
        raise ValueError(f"--replicas {replicas}: metrics ports {metrics_ports} include HTTP/gRPC port {sorted(clash)}")
    if any(a.replace(" ", "=").lower() in ("--allow-metrics=false", "--allow-metrics=0") for a in extra_args):
        raise ValueError(
            f"--replicas {replicas}: each replica's readiness is its own metrics port; drop --allow-metrics=false"
        )
    binary, _, binary_env = find_tritonserver()
    missing = missing_options(binary, binary_env, [a.split("=")[0] for a in REUSE_PORT_ARGS])
    if missing:
        raise ValueError(
            f"--replicas {replicas}: {binary} has no {' or '.join(missing)} option (replicas share ports through it)"
        )
    taken = [port for port in (http_port, grpc_port, *metrics_ports) if port_taken(port)]
    if taken:
        raise ValueError(f"--replicas {replicas}: port(s) {taken} already in use")


def make_replicas(
    model_repository,
    http_port: int,
    grpc_port: int,
    metrics_port: int,
    replicas: int,
    config_name: str | None,
    admin_key: str,
    exit_timeout: int,
    extra_args=(),
) -> tuple[list[Replica], dict[str, str]]:
    """The hardened tritonservers to supervise (sharing HTTP and gRPC ports when several) and their environment."""
    servers = []
    for i in range(replicas):
        cmd, env = tritonserver_command(
            model_repository,
            http_port,
            grpc_port,
            metrics_port + i,
            config_name=config_name,
            extra_args=hardening_args(admin_key, exit_timeout)
            + (list(REUSE_PORT_ARGS) if replicas > 1 else [])
            + [a for a in extra_args if a != "--"],
        )
        if replicas == 1:
            servers.append(Replica("tritonserver", cmd, f"localhost:{http_port}"))
        else:
            servers.append(Replica(f"replica {i}", cmd, f"localhost:{metrics_port + i}"))
    return servers, env


def unlink_left(segments) -> None:
    """Remove the /dev/shm segments a stopped tritonserver left (it leaves them when killed)."""
    left = [Path(s) for s in segments if Path(s).exists()]
    for path in left:
        path.unlink(missing_ok=True)
    if left:
        print(f"serve: removed {len(left)} /dev/shm segment(s) left by tritonserver", flush=True)


def ready_banner(http_port: int, grpc_port: int, metrics_port: int, replicas: int) -> str:
    """What serve prints once every server is ready: the endpoints and how to send a request."""

    def shown(path: Path) -> str:
        return os.path.relpath(path) if path.is_relative_to(Path.cwd()) else str(path)

    python, client = shown(Path(sys.executable)), shown(REPO_ROOT / "scripts" / "client.py")
    http_url = f"localhost:{http_port}"
    metrics = ", ".join(f"localhost:{metrics_port + i}" for i in range(replicas))
    if replicas > 1:
        metrics += f" (replica 0 to {replicas - 1}; {replicas} tritonservers share HTTP and gRPC)"
    return (
        f"\ntritonserver is ready: HTTP {http_url}, gRPC localhost:{grpc_port}, metrics {metrics}\n"
        f"Send a request:\n"
        f"  {python} {client} --url {http_url} --protocol http\n"
        f"  {python} {client} --url localhost:{grpc_port} --protocol grpc --model baseline_ranker\n"
        f"Model-repository, shared-memory, logging and trace APIs need the header '{ADMIN_HEADER}: <admin key>'.\n"
    )


class Supervisor:
    """Runs `replicas` until a signal, a server's own exit, or a failure (module docstring)."""

    def __init__(
        self,
        replicas: list[Replica],
        env: dict[str, str],
        timeout: float,
        exit_timeout: int,
        max_restarts: int,
        restart_grace: float,
        on_ready=lambda: None,
    ):
        self.replicas, self.env = replicas, env
        self.timeout, self.exit_timeout = timeout, exit_timeout
        self.max_restarts, self.restart_grace = max_restarts, restart_grace
        self.on_ready = on_ready  # called once, when every server is first ready
        self.is_up = is_ready if len(replicas) == 1 else metrics_started
        self.stopping, self.announced, self.restarts = False, False, 0

    def run(self) -> int:
        """Supervise until stopped (from the main thread: it handles SIGINT, SIGTERM, SIGHUP); the exit
        status. ServeError when a server fails to become ready or restarts run out."""
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, self._on_signal)
        for r in self.replicas:
            self._start(r)
        polls = 0
        while not self.stopping:
            polls += 1
            for r in self.replicas:
                code = self._poll(r, polls)
                if code is not None:
                    return code
            if not self.announced and all(r.ready for r in self.replicas):
                self.on_ready()
                self.announced = True
            time.sleep(POLL_S)
        return self._finish()

    def _on_signal(self, *_):  # every stop signal means: stop gracefully
        self.stopping = True
        for r in self.replicas:
            if r.process is not None:
                r.process.send_signal(signal.SIGTERM)

    def _start(self, r: Replica) -> None:
        r.ready, r.segments, r.deadline = False, set(), time.monotonic() + self.timeout
        r.process = subprocess.Popen(r.cmd, env=self.env, start_new_session=True)  # signals reach it only through us
        if self.stopping:
            r.process.send_signal(signal.SIGTERM)

    def _poll(self, r: Replica, polls: int) -> int | None:
        """One look at `r`: restart it where needed; the exit status when serving must end."""
        code = r.process.poll()
        if code is not None and not self.stopping:  # exited by itself
            if not r.ready:
                self._finish(f"serve: {r.label} exited with {code} before ready")
            if code < 0 and self.restarts < self.max_restarts:  # killed by a signal: a crash in a model run in
                # its process (python_inprocess), the OOM killer: started again, as after a dead stub
                kill_group(r.process)  # its python backend stubs
                unlink_left(r.segments)
                self.restarts += 1
                print(
                    f"serve: {r.label} (pid {r.process.pid}) died of signal {-code}; restarting tritonserver",
                    flush=True,
                )
                self._start(r)
                return None
            print(f"serve: {r.label} exited with {code}", flush=True)  # exited with a status: serve ends
            return self._finish(code=code)
        if not r.ready:
            if self.is_up(r.ready_url):
                r.ready = True
                r.segments |= shm_segments(r.process.pid)
                if self.announced:
                    print(f"serve: {r.label} ready again (restart {self.restarts})", flush=True)
            elif time.monotonic() > r.deadline:
                self._finish(f"serve: {r.label} not ready after {self.timeout} s")
        if polls % SEGMENTS_EVERY == 0:
            r.segments |= shm_segments(r.process.pid)
        dead = dead_stubs(r.process.pid)
        if dead and not self.stopping:
            self._replace(r, dead)
        return None

    def _replace(self, r: Replica, dead: list[int]) -> None:
        """Stop `r`, whose stubs `dead` died, and start it again."""
        r.segments |= shm_segments(r.process.pid)  # the server maps every stub's region
        if self.restarts >= self.max_restarts:
            self._finish(f"serve: more than {self.max_restarts} restarts")
        others = [o for o in self.replicas if o is not r and o.ready and not dead_stubs(o.process.pid)]
        if others:  # they serve on: no grace for this one
            kill_group(r.process)
        else:
            stop(r.process, grace=self.restart_grace)
        self.restarts += 1
        then = "restarting tritonserver"
        if others:
            then = f"killed it, {len(others)} of {len(self.replicas)} replicas serving; starting a replacement"
        print(f"serve: python backend stub(s) {dead} of {r.label} (pid {r.process.pid}) died; {then}", flush=True)
        unlink_left(r.segments)
        self._start(r)

    def _finish(self, message: str | None = None, code: int = 0) -> int:
        """Stop every tritonserver gracefully and unlink what they left; then raise ServeError(`message`),
        or return `code` or else the first non-zero exit status of those that had been ready."""
        for r in self.replicas:
            if r.process.poll() is None:
                r.process.send_signal(signal.SIGTERM)
        codes = []
        for r in self.replicas:
            r.segments |= shm_segments(r.process.pid)
            try:
                r.process.wait(self.exit_timeout + 15)
            except subprocess.TimeoutExpired:
                stop(r.process, grace=0)
            if r.ready:  # one stopped while loading may exit non-zero
                codes.append(r.process.returncode)
            unlink_left(r.segments)
        if message:
            raise ServeError(message)
        return code or next((c for c in codes if c), 0)
