"""Find and run a real tritonserver over this project's model repository.

`find_tritonserver` picks, in order: `$TRITONSERVER`, `tritonserver` on PATH (NGC container
`nvcr.io/nvidia/tritonserver`, backends in /opt/tritonserver/backends), or the server bundled in
the nvidia-pytriton wheel (its python backend stub for this Python is copied into backends/python/,
its shared libraries come from site-packages/nvidia_pytriton.libs). See ../shared/ENVIRONMENT.md.

`tritonserver_command` is the command line that serves a model repository (`hardening_args` adds
what `make serve` restricts); `running_tritonserver` starts it on free ports, waits for
/v2/health/ready, and stops it on exit. Supervising servers (`scripts/serve`): ikbo_backend.supervisor;
their process trees: ikbo_backend.process_tree.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .paths import MODEL_REPOSITORY

NGC_BACKEND_DIR = Path("/opt/tritonserver/backends")


class TritonServerError(RuntimeError):
    """The server could not be found, died, or never became ready (message ends with the log tail)."""


def _python_env() -> dict[str, str]:
    """Environment in which the python backend stub runs this Python's packages.

    The stub embeds an *isolated* interpreter (PYTHONPATH is ignored) that finds its prefix through
    `python3` on PATH: the running interpreter's bin/ goes first, so a venv's pyvenv.cfg and
    site-packages are used, and its libpython first on LD_LIBRARY_PATH, so the stub's libpython
    matches that stdlib. The project is installed (editable) in that site-packages, so model.py files
    import `kernels` and `ikbo_backend` by name; PYTHONPATH carries site-packages too, for
    non-isolated stubs and child processes.
    """
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join(filter(None, [str(Path(sys.executable).parent), env.get("PATH")]))
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            filter(None, [sysconfig.get_config_var("LIBDIR"), env.get("LD_LIBRARY_PATH")])
        )
    paths = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(filter(None, paths)))
    return env


def _prepare_pytriton_layout(binary: Path, env: dict[str, str]) -> Path:
    """For a server laid out like the nvidia-pytriton wheel (<site>/pytriton/tritonserver/bin/tritonserver):
    put the stub for this Python into backends/python/ and the wheel's libraries on LD_LIBRARY_PATH."""
    server_dir = binary.parent.parent  # .../pytriton/tritonserver
    backend_dir = server_dir / "backends"
    libs = server_dir.parent.parent / "nvidia_pytriton.libs"
    if libs.is_dir():
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(libs), env.get("LD_LIBRARY_PATH")]))
    stub = backend_dir / "python" / "triton_python_backend_stub"
    if not stub.exists():
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        source = server_dir / "python_backend_stubs" / version / "triton_python_backend_stub"
        if not source.exists():
            raise TritonServerError(f"no python backend stub for Python {version} at {source}")
        tmp = stub.with_name(f".{stub.name}.{os.getpid()}")
        shutil.copy2(source, tmp)
        os.replace(tmp, stub)  # atomic: parallel starts never see half a stub
    return backend_dir


def find_tritonserver() -> tuple[Path, Path, dict[str, str]]:
    """(binary, backend directory, environment) of the tritonserver to run."""
    env = _python_env()
    if os.environ.get("TRITONSERVER"):
        binary = Path(os.environ["TRITONSERVER"]).resolve()
        if not binary.is_file():
            raise TritonServerError(f"$TRITONSERVER={os.environ['TRITONSERVER']} is not a file")
    elif shutil.which("tritonserver"):
        binary = Path(shutil.which("tritonserver")).resolve()
    else:
        try:
            import pytriton
        except ImportError as e:
            raise TritonServerError(
                "no $TRITONSERVER, no tritonserver on PATH and nvidia-pytriton is not installed"
            ) from e
        binary = Path(pytriton.__file__).parent / "tritonserver" / "bin" / "tritonserver"
    if (binary.parent.parent / "python_backend_stubs").is_dir():
        backend_dir = _prepare_pytriton_layout(binary, env)
    else:
        backend_dir = binary.parent.parent / "backends"
        backend_dir = backend_dir if backend_dir.is_dir() else NGC_BACKEND_DIR
    _install_inprocess_backend(backend_dir)
    return binary, backend_dir, env


def _install_inprocess_backend(backend_dir: Path) -> None:
    """Build the python_inprocess backend (ikbo_backend/inprocess) into `backend_dir` if it is not
    there yet. If that fails, say why: the models whose config names that backend will not load
    (Triton: "unable to find backend library"), the others are unaffected."""
    from .inprocess import build

    try:
        build(backend_dir)
    except (OSError, RuntimeError) as e:
        print(f"ikbo_backend: the python_inprocess backend is not available: {e}", file=sys.stderr, flush=True)


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports nothing listens on right now (the OS picks them). Each socket stays bound until
    all are picked: a port picked and released at once can be handed out again by the next pick."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(count)]
        for s in sockets:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in sockets]


def free_port() -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    return free_ports(1)[0]


def visible_gpu_count() -> int:
    """CUDA devices this process (and a tritonserver started from it) sees: torch's count where torch
    has CUDA, else the GPUs `nvidia-smi -L` lists, capped by CUDA_VISIBLE_DEVICES when that is set."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
    except ImportError:
        pass
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    count = sum(line.startswith("GPU ") for line in listing.stdout.splitlines()) if listing.returncode == 0 else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return count if visible is None else min(count, len([d for d in visible.split(",") if d.strip()]))


def has_gpu() -> bool:
    """True when this process sees a GPU (`visible_gpu_count`)."""
    return visible_gpu_count() > 0


def tritonserver_command(
    model_repository=None,
    http_port: int = 8000,
    grpc_port: int = 8001,
    metrics_port: int = 8002,
    config_name: str | None = None,
    extra_args=(),
) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) that serve `model_repository` (default: this project's) on these ports;
    `config_name` loads <model>/configs/<config_name>.pbtxt where a model has one (e.g. "gpu").

    Auto-complete is off: every config is complete (generated, ikbo_backend.model_repository), and with it on the
    python backend starts and stops one extra stub per model only to ask model.py for a config (one more
    `import torch` each), whose exit leaves a zombie stub for a moment that looks like a dead one."""
    binary, backend_dir, env = find_tritonserver()
    cmd = [
        str(binary),
        f"--model-repository={Path(model_repository or MODEL_REPOSITORY).resolve()}",
        f"--backend-directory={backend_dir}",
        "--disable-auto-complete-config",
        f"--http-port={http_port}",
        f"--grpc-port={grpc_port}",
        f"--metrics-port={metrics_port}",
    ]
    if config_name:
        cmd.append(f"--model-config-name={config_name}")
    if config_name and config_name != "config":  # the GPU configurations
        cmd += cuda_pool_args()
    return cmd + list(extra_args), env


CUDA_POOL_ENV = "IKBO_CUDA_POOL_MB"
DEFAULT_CUDA_POOL_MB = 4096


def cuda_pool_args() -> list[str]:
    """--cuda-memory-pool-byte-size per visible GPU ($IKBO_CUDA_POOL_MB, default 4096 MiB).

    Tensors between ensemble steps on the GPU live in this pool. Triton's default (64 MiB) holds one
    large-profile request (~43 MB of features at 15:1024): with two in flight it falls back to pinned
    host memory, and python backend 2.51 then fails to load that input ("failed to load GPU buffers:
    failed to copy data: invalid argument") and runs execute on garbage.
    """
    megabytes = int(os.environ.get(CUDA_POOL_ENV, DEFAULT_CUDA_POOL_MB))
    return [f"--cuda-memory-pool-byte-size={gpu}:{megabytes << 20}" for gpu in range(visible_gpu_count())]


# --- hardening (`make serve`) ---

# APIs that change or reveal the server's state, behind a header: the model repository (load/unload),
# shared-memory registration (the python backend's regions; CVE-2025-23319/23320/23334), logging and
# trace settings. HTTP takes --http-restricted-api; 2.51's gRPC flag is --grpc-restricted-protocol.
RESTRICTED_APIS = ("model-repository", "shared-memory", "logging", "trace")
ADMIN_HEADER = "ikbo-admin-key"  # lower case: gRPC metadata keys are
GRPC_ADMIN_HEADER = f"triton-grpc-protocol-{ADMIN_HEADER}"  # the metadata key gRPC clients send
ADMIN_KEY_ENV = "IKBO_ADMIN_KEY"


def hardening_args(admin_key: str, exit_timeout: int = 30) -> list[str]:
    """tritonserver flags: no model control (the repository is loaded once, at start), restricted APIs
    only with the header `ikbo-admin-key: <admin_key>`, at most `exit_timeout` s for in-flight
    requests on shutdown."""
    if not admin_key or any(c in admin_key for c in ",:= \t\n"):
        raise ValueError(f"admin_key: expected a non-empty string without ',:=' or spaces, got {admin_key!r}")
    restricted = f"{','.join(RESTRICTED_APIS)}:{ADMIN_HEADER}={admin_key}"
    return [
        "--model-control-mode=none",
        f"--http-restricted-api={restricted}",
        f"--grpc-restricted-protocol={restricted}",
        f"--exit-timeout-secs={exit_timeout}",
    ]


# Not up yet. HTTPException too: a port in the ephemeral range that nothing listens on yet can be
# reached by a TCP self-connect (source port = destination port), which reads back our own request
# line ("BadStatusLine: GET /metrics HTTP/1.1"), which `serve --replicas 2` meets while a replica starts.
NOT_UP = (urllib.error.URLError, OSError, http.client.HTTPException)


def is_ready(http_url: str) -> bool:
    """GET /v2/health/ready answers 200."""
    try:
        with urllib.request.urlopen(f"http://{http_url}/v2/health/ready", timeout=2) as r:
            return r.status == 200
    except NOT_UP:
        return False


def metrics_started(metrics_url: str) -> bool:
    """GET /metrics answers 200. Tritonserver 2.51 starts its metrics service last, after the gRPC and
    HTTP endpoints, which it starts once every model has loaded: the readiness of one server among
    several that share their HTTP and gRPC ports (reuse-port), where /v2/health/ready may reach any."""
    try:
        with urllib.request.urlopen(f"http://{metrics_url}/metrics", timeout=2) as r:
            return r.status == 200
    except NOT_UP:
        return False


def wait_until_ready(process: subprocess.Popen, http_url: str, timeout: float, log_tail=lambda: "") -> None:
    """Poll readiness; TritonServerError if the process exits first or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while not is_ready(http_url):
        if process.poll() is not None:
            raise TritonServerError(f"tritonserver exited with {process.returncode} before ready\n{log_tail()}")
        if time.monotonic() > deadline:
            raise TritonServerError(f"tritonserver not ready after {timeout} s\n{log_tail()}")
        time.sleep(0.25)


@dataclass
class RunningServer:
    http_url: str  # "localhost:PORT", as tritonclient.http takes it
    grpc_url: str
    metrics_url: str
    process: subprocess.Popen
    log_path: Path

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            text = "(no log)"
        return f"log {self.log_path}:\n{text}"


def stop(process: subprocess.Popen, grace: float = 45.0) -> None:
    """SIGTERM, then kill after `grace` s (tritonserver itself waits up to 30 s for open connections).
    For a server started with start_new_session, SIGKILL then goes to its whole process group: the
    python backend stubs of a killed tritonserver live on otherwise (orphans of ~400 MB each)."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace)
            return
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    with contextlib.suppress(OSError):  # no such group (not a session leader, or nothing left)
        os.killpg(process.pid, signal.SIGKILL)


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL to the process group of `process` (started with start_new_session: tritonserver and its
    python backend stubs) at once, then reap it. Its in-flight requests fail."""
    with contextlib.suppress(OSError):  # nothing left
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


# Several tritonservers on the same HTTP and gRPC ports (`scripts/serve --replicas N`): each binds
# them with SO_REUSEPORT and the kernel spreads new connections over the live ones. There is no such
# option for the metrics port: each needs its own.
REUSE_PORT_ARGS = ("--reuse-http-port=true", "--reuse-grpc-port=true")


def missing_options(binary, env: dict[str, str], options) -> list[str]:
    """Those of `options` (e.g. "--reuse-http-port") that `binary --help` does not list."""
    try:
        listing = subprocess.run([str(binary), "--help"], env=env, capture_output=True, text=True, timeout=60)
        text = listing.stdout + listing.stderr
    except (OSError, subprocess.TimeoutExpired) as e:
        text = str(e)
    return [option for option in options if not re.search(rf"{re.escape(option)}(?![\w-])", text)]


def port_taken(port: int) -> bool:
    """Something listens on TCP `port` (any address): binding it, as tritonserver does, fails."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # connections in TIME_WAIT do not count
        try:
            s.bind(("", port))
        except OSError:
            return True
    return False


@contextlib.contextmanager
def running_tritonserver(
    model_repository=None,
    http_port: int | None = None,
    grpc_port: int | None = None,
    metrics_port: int | None = None,
    config_name: str | None = None,
    extra_args=(),
    log_path=None,
    timeout: float = 180,
):
    """Start tritonserver (free ports where None), wait until ready, yield a RunningServer; on exit
    SIGTERM, then kill. Raises TritonServerError with the log tail if the server exits before it is
    ready, is not ready within `timeout` seconds, or died while the block ran. Close clients before
    the block ends: open HTTP connections hold a stopping server up to 30 s.
    """
    requested = (http_port, grpc_port, metrics_port)
    fresh = iter(port for port in free_ports(2 * len(requested)) if port not in requested)
    ports = [next(fresh) if port is None else port for port in requested]
    cmd, env = tritonserver_command(model_repository, *ports, config_name=config_name, extra_args=extra_args)
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix="tritonserver-", suffix=".log")
        os.close(fd)
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = RunningServer(*(f"localhost:{port}" for port in ports), process, log_path)
    try:
        wait_until_ready(process, server.http_url, timeout, server.log_tail)
        yield server
    except BaseException:
        stop(process)
        raise
    died = process.poll()
    stop(process)
    if died is not None:
        raise TritonServerError(f"tritonserver died with {died} while in use\n{server.log_tail()}")
