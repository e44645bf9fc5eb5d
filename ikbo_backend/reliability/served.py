"""`scripts/serve` as a subprocess on free ports (one tritonserver or replicas), and what the rows read
of its processes: tritonserver children, replicas' metrics, orphaned stubs."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..paths import REPO_ROOT
from ..perf.prometheus import scrape
from ..tritonserver import (
    ADMIN_KEY_ENV,
    TritonServerError,
    free_port,
    free_ports,
    is_ready,
    metrics_started,
    port_taken,
)
from . import RANKERS
from .load import probe


@dataclass
class Served:
    """scripts/serve running in the background (CPU configuration) on free ports; with `replicas` > 1,
    that many tritonservers on the same HTTP and gRPC ports, replica i's metrics at metrics_urls[i]."""

    process: subprocess.Popen
    http_url: str
    grpc_url: str
    admin_key: str
    log_path: Path
    metrics_urls: tuple = ()
    replicas: int = 1

    def triton_pids(self) -> list[int]:
        """serve's tritonserver children (not a SCHED_IDLE busy loop), in start order."""
        try:
            children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text().split()
        except OSError:
            return []
        pids = []
        for child in children:
            try:
                if Path(f"/proc/{child}/comm").read_text().strip() == "tritonserver":
                    pids.append(int(child))
            except OSError:
                continue
        return pids

    def all_up(self) -> bool:
        """serve runs `replicas` tritonservers and each one's metrics port answers (it has started its
        endpoints, after loading every model)."""
        return len(self.triton_pids()) == self.replicas and all(metrics_started(url) for url in self.metrics_urls)

    def log_tail(self, lines=40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def wait_ready(served: Served, timeout: float = 180) -> float:
    """Seconds until every replica is up (Served.all_up), /v2/health/ready answers 200 and a valid
    request succeeds (TritonServerError after `timeout`)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if served.process.poll() is not None:
            raise TritonServerError(f"serve exited with {served.process.returncode}\n{served.log_tail()}")
        if served.all_up() and is_ready(served.http_url) and probe(served.http_url) is None:
            return time.monotonic() - start
        time.sleep(0.25)
    raise TritonServerError(f"serve not ready after {timeout} s\n{served.log_tail()}")


def free_port_block(count: int, avoid=()) -> int:
    """A port p with p .. p + count - 1 all free and none in `avoid` (serve --replicas puts replica i's metrics on
    p + i)."""
    for _ in range(100):
        first = free_port()
        block = range(first, first + count)
        if block[-1] < 65536 and not any(p in avoid or (p != first and port_taken(p)) for p in block):
            return first
    raise OSError(f"no {count} consecutive free ports found")


@contextlib.contextmanager
def serving(exit_timeout: int = 30, model_repository=None, env_extra=None, log_dir=None, replicas: int = 1):
    """scripts/serve --cpu on free ports with a known admin key (`--replicas` when > 1); stopped
    (SIGTERM, then kill) on exit."""
    http_port, grpc_port = free_ports(2)
    metrics_port = free_port_block(replicas, avoid=(http_port, grpc_port))
    admin_key = f"test-{os.getpid()}-{time.monotonic_ns()}"
    env = dict(os.environ, **{ADMIN_KEY_ENV: admin_key}, **(env_extra or {}))
    log_path = Path(tempfile.mkdtemp(prefix="serve-", dir=log_dir)) / "serve.log"
    argv = [sys.executable, str(REPO_ROOT / "scripts" / "serve"), "--cpu", f"--http-port={http_port}", f"--grpc-port={grpc_port}",
            f"--metrics-port={metrics_port}", f"--exit-timeout={exit_timeout}"]  # fmt: skip
    if replicas != 1:
        argv.append(f"--replicas={replicas}")
    if model_repository:
        argv.append(f"--model-repository={model_repository}")
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    metrics_urls = tuple(f"localhost:{metrics_port + i}" for i in range(replicas))
    served = Served(
        process, f"localhost:{http_port}", f"localhost:{grpc_port}", admin_key, log_path, metrics_urls, replicas
    )
    try:
        wait_ready(served)
        yield served
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(exit_timeout + 30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def _alive(pid: int) -> bool:
    """`pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def _metrics_url(pid: int) -> str | None:
    """localhost:<--metrics-port> of tritonserver `pid`, from its command line."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    port = next((a.split("=", 1)[1] for a in argv if a.startswith("--metrics-port=")), None)
    return f"localhost:{port}" if port else None


def replica_successes(metrics_url: str, models=RANKERS) -> int | None:
    """Requests to `models` one tritonserver answered successfully since it started
    (nv_inference_request_success on its own metrics port); None when it does not answer."""
    try:
        samples = scrape(metrics_url, timeout=5)
    except OSError:
        return None
    total = 0.0
    for (name, labels), value in samples.items():
        labels = dict(labels)
        if name == "nv_inference_request_success" and labels.keys() == {"model", "version"}:
            total += value if labels["model"] in models else 0.0
    return int(total)


def orphan_stubs(model_repository) -> list[int]:
    """Pids of python backend stubs serving `model_repository` whose tritonserver is gone (parent 1)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        comm, ppid = stat[stat.index("(") + 1 : stat.rindex(")")], int(stat[stat.rindex(")") + 2 :].split()[1])
        if (
            comm.startswith("triton_python_b")
            and ppid == 1
            and len(argv) > 1
            and argv[1].decode(errors="replace").startswith(str(model_repository))
        ):
            found.append(int(proc.name))
    return found
