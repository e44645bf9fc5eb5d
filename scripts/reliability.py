#!/usr/bin/env python3
"""Reliability and security suite against a real tritonserver (issue 6): malformed-request storms,
a test-only fault inside execute, stub kill -9 under load, graceful shutdown, a broken model, soak.
Modelled on Triton's qa/L0_input_validation, L0_backend_python (lifecycle, restart), L0_memory_growth.
The short forms run in `make test` (tests/test_reliability*.py, which import this module); the long
forms here, one subcommand a row, each printing a JSON line of figures:

    .venv/bin/python scripts/reliability.py storm --requests 1000     # per protocol, both rankers
    .venv/bin/python scripts/reliability.py fault
    .venv/bin/python scripts/reliability.py kill --kills 20
    .venv/bin/python scripts/reliability.py kill --kills 20 --replicas 2   # serve --replicas 2
    .venv/bin/python scripts/reliability.py shutdown
    .venv/bin/python scripts/reliability.py broken
    .venv/bin/python scripts/reliability.py soak --seconds 600
    .venv/bin/python scripts/reliability.py soak --attach localhost:8000 --server-pid PID --profile large
    .venv/bin/python scripts/reliability.py all --out out/reliability.json

Servers run on free ports of 127.0.0.1; every loop is bounded by a count or a deadline.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "scripts"))

from ikbo_backend.client import client_module, infer_inputs  # noqa: E402
from ikbo_backend.ranker import PROFILES, RankerConfig  # noqa: E402
from ikbo_backend.requests import CAND_INPUTS, INPUT_DTYPES, INPUT_NAMES, USER_INPUTS, make_request  # noqa: E402
from ikbo_backend.serving import MODEL_REPOSITORY, TEST_FAULT_PARAMETER, TEST_FAULTS_ENV, load_shape_ranges  # noqa: E402
from ikbo_backend.tritonserver import (  # noqa: E402
    ADMIN_HEADER,
    ADMIN_KEY_ENV,
    GRPC_ADMIN_HEADER,
    TritonServerError,
    free_port,
    is_ready,
    metrics_started,
    port_taken,
    running_tritonserver,
    shm_segments,
    stub_states,
    tree_rss_bytes,
)

CFG = RankerConfig()
RANGES = load_shape_ranges()
RANKERS = ("ikbo_ranker", "baseline_ranker")
PROTOCOLS = ("http", "grpc")
SERVED_STAGES = ("ranker_features", "ikbo_interaction", "baseline_interaction")  # the stubs behind RANKERS
CLIENT_ERRORS = {"http": {"400"}, "grpc": {"StatusCode.INVALID_ARGUMENT"}}
NOT_FOUND = {
    "http": {"404", "400"},
    "grpc": {"StatusCode.NOT_FOUND", "StatusCode.INVALID_ARGUMENT", "StatusCode.UNAVAILABLE"},
}
TORCH_TO_NP = {"float32": np.float32, "float64": np.float64, "int32": np.int32, "int64": np.int64}
NP_DTYPES = {name: TORCH_TO_NP[str(dtype).removeprefix("torch.")] for name, dtype in INPUT_DTYPES.items()}
# What a leak in an error message looks like: a file path, a python-backend shared-memory key.
LEAK_MARKERS = ("/", ".py", "triton_python_backend_shm", "shm_region")


# --- malformed requests (hypothesis) ---


@dataclass
class Case:
    """One malformed request: what to send and what the answer must say."""

    kind: str
    model: str
    request: dict  # name → array (what the client sends)
    name: str  # the input (or model) the message must name
    problem: tuple[str, ...]  # the message holds one of these (lower case)
    truncate: int = 0  # > 0: raw request whose binary header claims this many bytes more than sent


KINDS = (
    "dtype", "rank", "width", "user rows != U", "cand rows != B", "mapping >= U", "mapping negative",
    "B = 0", "U above range", "B above range", "id outside table", "NaN/Inf", "history_len outside [0, L]",
    "missing input", "unknown input", "truncated binary payload", "unknown model",
)  # fmt: skip


def _case_strategy(kind: str):
    from hypothesis import strategies as st

    @st.composite
    def cases(draw):
        model = draw(st.sampled_from(RANKERS))
        num_users, num_candidates = draw(st.integers(1, 8)), draw(st.integers(1, 48))
        seed = draw(st.integers(0, 2**32 - 1))
        rng = np.random.default_rng(seed)
        if kind == "U above range":
            num_users = RANGES.users[1] + draw(st.integers(1, 4))
        if kind == "B above range":
            num_candidates = RANGES.candidates[1] + draw(st.integers(1, 4))
        if kind in ("mapping >= U", "user rows != U"):
            num_users = max(num_users, 2)
        r = make_request(CFG, num_users, num_candidates, rng)
        pick = lambda names: draw(st.sampled_from(names))  # noqa: E731
        if kind == "dtype":
            name = pick(INPUT_NAMES)
            wrong = draw(
                st.sampled_from(
                    [d for d in (np.float32, np.float64, np.int32, np.int64, np.float16) if d != NP_DTYPES[name]]
                )
            )
            r[name] = r[name].astype(wrong)
            return Case(kind, model, r, name, ("data-type", "datatype", "dtype"))
        if kind == "rank":
            name = pick(INPUT_NAMES)
            r[name] = (
                r[name][..., None]
                if draw(st.booleans())
                else (r[name].reshape(-1) if r[name].ndim == 2 else r[name][None])
            )
            return Case(kind, model, r, name, ("shape", "rank"))
        if kind == "width":
            name = pick([n for n in INPUT_NAMES if r[n].ndim == 2])
            extra = draw(st.sampled_from([-1, 1, 3]))
            r[name] = r[name][:, :-1] if extra < 0 else np.concatenate([r[name]] + [r[name][:, :1]] * extra, axis=1)
            return Case(kind, model, r, name, ("shape", "columns"))
        if kind == "user rows != U":
            name = pick(USER_INPUTS[1:])
            r[name] = r[name][:-1] if draw(st.booleans()) else np.concatenate([r[name], r[name][:1]])
            return Case(kind, model, r, name, ("rows",))
        if kind == "cand rows != B":
            name = pick(CAND_INPUTS[1:])
            r[name] = r[name][:-1] if draw(st.booleans()) else np.concatenate([r[name], r[name][:1]])
            return Case(kind, model, r, name, ("rows",))
        if kind in ("mapping >= U", "mapping negative"):
            i = draw(st.integers(0, num_candidates - 1))
            r["cand_to_user"][i] = (
                num_users + draw(st.integers(0, 1000)) if kind == "mapping >= U" else -draw(st.integers(1, 2**31 - 1))
            )
            return Case(kind, model, r, "cand_to_user", ("outside",))
        if kind == "B = 0":
            r.update({n: r[n][:0] for n in CAND_INPUTS})
            return Case(kind, model, r, "cand_dense", ("b = 0",))
        if kind == "U above range":
            return Case(kind, model, r, "user_dense", ("outside the served range",))
        if kind == "B above range":
            return Case(kind, model, r, "cand_dense", ("outside the served range",))
        if kind == "id outside table":
            name, vocab = draw(
                st.sampled_from(
                    [
                        ("user_sparse_ids", CFG.user_vocab_size),
                        ("cand_sparse_ids", CFG.cand_vocab_size),
                        ("user_history_ids", CFG.item_vocab_size),
                    ]
                )
            )
            index = tuple(draw(st.integers(0, s - 1)) for s in r[name].shape)
            r[name][index] = draw(st.one_of(st.integers(vocab, 2**62), st.integers(-(2**62), -1)))
            return Case(kind, model, r, name, ("outside the table",))
        if kind == "NaN/Inf":
            name = pick(("user_dense", "cand_dense"))
            index = tuple(draw(st.integers(0, s - 1)) for s in r[name].shape)
            r[name][index] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
            return Case(kind, model, r, name, ("nan or inf",))
        if kind == "history_len outside [0, L]":
            i = draw(st.integers(0, num_users - 1))
            r["user_history_len"][i] = draw(
                st.one_of(st.integers(CFG.history_length + 1, 2**31 - 1), st.integers(-(2**31), -1))
            )
            return Case(kind, model, r, "user_history_len", ("outside",))
        if kind == "missing input":
            name = pick(INPUT_NAMES)
            del r[name]
            return Case(kind, model, r, name, ("missing",))
        if kind == "unknown input":
            name = draw(st.sampled_from(["user_densse", "scores", "candidates", "cand_to_users"]))
            r[name] = np.zeros((num_candidates,), np.int32)
            return Case(kind, model, r, name, ("unexpected", "expected 7 inputs"))
        if kind == "truncated binary payload":  # the body ends early: the last input (in a drawn order) is short
            order = draw(st.permutations(INPUT_NAMES))
            r, name = {n: r[n] for n in order}, order[-1]
            return Case(
                kind,
                model,
                r,
                name,
                ("size", "byte", "unexpected", "expected"),
                truncate=draw(st.integers(1, r[name].nbytes)),
            )
        name = draw(st.sampled_from(["ikbo_rankr", "ranker", "ikbo_ranker_v2", "IKBO_RANKER"]))
        return Case(kind, name, r, name, ("unknown model", "not found"))

    return cases()


def malformed_cases(count: int, seed: int) -> list[Case]:
    """`count` malformed requests drawn by hypothesis (reproducible from `seed`), every kind."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed

    drawn: list[Case] = []
    for i, kind in enumerate(KINDS):  # every kind, count/len(KINDS) examples each

        @hypothesis_seed(seed + i)
        @settings(
            max_examples=-(-count // len(KINDS)),
            database=None,
            deadline=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(_case_strategy(kind))
        def collect(case):
            drawn.append(case)

        collect()
    return drawn


def _raw_http_truncated(url: str, case: Case) -> tuple[str, str]:
    """POST the request in Triton's binary form; `case.name`'s binary_data_size claims
    `case.truncate` bytes more than the body holds. (status, message)."""
    inputs, blobs = [], []
    for name, array in case.request.items():
        data = np.ascontiguousarray(array).tobytes()
        from tritonclient.utils import np_to_triton_dtype

        inputs.append(
            {
                "name": name,
                "shape": list(array.shape),
                "datatype": np_to_triton_dtype(array.dtype),
                "parameters": {"binary_data_size": len(data)},
            }
        )
        blobs.append(data[: len(data) - case.truncate] if name == case.name else data)
    header = json.dumps(
        {"inputs": inputs, "outputs": [{"name": "scores", "parameters": {"binary_data": True}}]}
    ).encode()
    body = header + b"".join(blobs)
    host, port = url.split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        connection.request(
            "POST",
            f"/v2/models/{case.model}/infer",
            body,
            {"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"},
        )
        response = connection.getresponse()
        text = response.read().decode(errors="replace")
    finally:
        connection.close()
    try:
        text = json.loads(text).get("error", text)
    except ValueError:
        pass
    return str(response.status), text


def _raw_grpc_truncated(url: str, case: Case) -> tuple[str, str]:
    """ModelInfer with raw_input_contents of `case.name` short by `case.truncate` bytes."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc
    from tritonclient.utils import np_to_triton_dtype

    request = service_pb2.ModelInferRequest(model_name=case.model)
    for name, array in case.request.items():
        tensor = request.inputs.add()
        tensor.name, tensor.datatype = name, np_to_triton_dtype(array.dtype)
        tensor.shape.extend(array.shape)
        data = np.ascontiguousarray(array).tobytes()
        request.raw_input_contents.append(data[: len(data) - case.truncate] if name == case.name else data)
    with grpc.insecure_channel(url) as channel:
        try:
            service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=60)
        except grpc.RpcError as e:
            return str(e.code()), e.details()
    return "OK", ""


def send_case(connection, module, protocol: str, url: str, case: Case) -> tuple[str, str]:
    """(status, message) of the server's answer to a malformed request ("OK", "" if it was accepted)."""
    from tritonclient.utils import InferenceServerException

    if case.truncate:
        return (_raw_http_truncated if protocol == "http" else _raw_grpc_truncated)(url, case)
    try:
        connection.infer(case.model, infer_inputs(module, case.request))
    except InferenceServerException as e:
        return str(e.status()), e.message() or str(e)
    return "OK", ""


def judge(protocol: str, case: Case, status: str, message: str) -> str | None:
    """None when the answer is right: a 400-class status (404 for an unknown model), the message names
    the input (or model) and the problem; else what is wrong."""
    allowed = NOT_FOUND[protocol] if case.kind == "unknown model" else CLIENT_ERRORS[protocol]
    low = message.lower()
    if status not in allowed:
        return f"status {status}, expected one of {sorted(allowed)}: {message[:300]}"
    if f"'{case.name}'" not in message and f'"{case.name}"' not in message:
        return f"message does not name '{case.name}': {message[:300]}"
    if not any(word in low for word in case.problem):
        return f"message does not say the problem ({' / '.join(case.problem)}): {message[:300]}"
    return None


def reference_scores(connection, module, seed: int) -> dict[str, bytes]:
    """Raw bytes of both rankers' scores for one fixed valid request (compare before/after a storm)."""
    from tritonclient.utils import InferenceServerException  # noqa: F401

    request = make_request(CFG, 5, 96, np.random.default_rng(seed))
    out = {}
    for model in RANKERS:
        result = connection.infer(model, infer_inputs(module, request), outputs=[module.InferRequestedOutput("scores")])
        out[model] = result.as_numpy("scores").tobytes()
    return out


def storm(server, count: int, seed: int, protocols=PROTOCOLS) -> dict:
    """`count` hypothesis-drawn malformed requests per protocol; readiness and bit-identical valid
    answers before/after. Figures and failures in a dict (`failures` empty = pass)."""
    cases = malformed_cases(count, seed)
    result = {
        "requests_per_protocol": len(cases),
        "kinds": sorted({c.kind for c in cases}),
        "failures": [],
        "per_kind": {},
    }
    start = time.perf_counter()
    for protocol in protocols:
        module = client_module(protocol)
        url = server.http_url if protocol == "http" else server.grpc_url
        connection = module.InferenceServerClient(url)
        try:
            before = reference_scores(connection, module, seed)
            for case in cases:
                status, message = send_case(connection, module, protocol, url, case)
                problem = judge(protocol, case, status, message)
                counts = result["per_kind"].setdefault(case.kind, {"sent": 0, "right": 0})
                counts["sent"] += 1
                counts["right"] += problem is None
                if problem:
                    result["failures"].append(f"{protocol} {case.kind} ({case.model}): {problem}")
            if not connection.is_server_ready():
                result["failures"].append(f"{protocol}: server not ready after the storm")
            after = reference_scores(connection, module, seed)
            result[f"{protocol}_bit_identical_after"] = before == after
            if before != after:
                result["failures"].append(f"{protocol}: valid answers after the storm differ from before")
        finally:
            connection.close()
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


# --- fault inside execute ---


def fault(server) -> dict:
    """The test-only fault through both protocols and both rankers: 500 / INTERNAL naming the model,
    nothing internal in the message, the next request fine."""
    from tritonclient.utils import InferenceServerException

    request = make_request(CFG, 3, 40, np.random.default_rng(0))
    failures, messages = [], []
    for protocol in PROTOCOLS:
        module = client_module(protocol)
        connection = module.InferenceServerClient(server.http_url if protocol == "http" else server.grpc_url)
        try:
            for model in (*RANKERS, "ranker_features"):
                try:
                    connection.infer(model, infer_inputs(module, request), parameters={TEST_FAULT_PARAMETER: "raise"})
                    failures.append(f"{protocol} {model}: the fault was not raised (is {TEST_FAULTS_ENV}=1 set?)")
                    continue
                except InferenceServerException as e:
                    status, message = str(e.status()), e.message() or ""
                messages.append(message)
                if status not in ("500", "StatusCode.INTERNAL"):
                    failures.append(f"{protocol} {model}: status {status}: {message}")
                if "'ranker_features'" not in message:
                    failures.append(f"{protocol} {model}: message does not name the failing model: {message}")
                if any(marker in message for marker in LEAK_MARKERS):
                    failures.append(f"{protocol} {model}: message leaks internals: {message}")
                connection.infer(model, infer_inputs(module, request))  # raises if not fine
        finally:
            connection.close()
    return {"faults": len(messages), "example": messages[0] if messages else None, "failures": failures}


# --- load ---


@dataclass
class Load:
    """Threads sending valid requests to `model` over HTTP until stopped: closed loop, or paced to
    `rate` requests/s in total. `log` holds (start, end, error or None) per request, monotonic time.
    `new_connection`: each request on a connection of its own (the kernel spreads connections, not
    requests, over tritonservers sharing a port; a keep-alive client stays on one of them)."""

    url: str
    model: str = "ikbo_ranker"
    threads: int = 2
    sizes: tuple = ((4, 64), (15, 256), (32, 1024))
    rate: float | None = None
    max_seconds: float = 3600
    cfg: RankerConfig = CFG  # the served model's dims (PROFILES["large"] for the large GPU configs)
    new_connection: bool = False
    log: list = field(default_factory=list)

    def __post_init__(self):
        self.requests = [make_request(self.cfg, u, b, np.random.default_rng([u, b])) for u, b in self.sizes]
        self.stop_event = threading.Event()
        self.workers = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(self.threads)]

    def _run(self, index: int):
        import tritonclient.http as module
        from tritonclient.utils import InferenceServerException

        connection = module.InferenceServerClient(self.url, connection_timeout=120, network_timeout=120)
        deadline = time.monotonic() + self.max_seconds
        next_at = time.monotonic() + (index / self.rate if self.rate else 0)
        n = index
        try:
            while not self.stop_event.is_set() and time.monotonic() < deadline:
                if self.rate:
                    delay = next_at - time.monotonic()
                    if delay > 0 and self.stop_event.wait(delay):
                        break
                    next_at = max(next_at + self.threads / self.rate, time.monotonic() - 1.0)
                request = self.requests[n % len(self.requests)]
                n += 1
                start, broken = time.monotonic(), False
                try:
                    result = connection.infer(
                        self.model, infer_inputs(module, request), outputs=[module.InferRequestedOutput("scores")]
                    )
                    scores = result.as_numpy("scores")
                    error = (
                        None
                        if scores.shape == (len(request["cand_dense"]), self.cfg.tasks) and np.isfinite(scores).all()
                        else "bad scores"
                    )
                except InferenceServerException as e:
                    error = f"{e.status()}: {e.message()}"
                except Exception as e:
                    error, broken = f"{type(e).__name__}: {e}", True
                self.log.append((start, time.monotonic(), error))
                if broken or self.new_connection:
                    connection.close()
                    if broken and self.stop_event.wait(0.2):
                        break
                    connection = module.InferenceServerClient(self.url, connection_timeout=120, network_timeout=120)
        finally:
            connection.close()

    def __enter__(self):
        for worker in self.workers:
            worker.start()
        return self

    def stop(self):
        self.stop_event.set()
        for worker in self.workers:
            worker.join(timeout=180)

    def __exit__(self, *exc):
        self.stop()

    def errors(self, since=float("-inf")):
        return [entry for entry in self.log if entry[2] and entry[0] >= since]


def measure_peak(url: str, seconds: float = 10, threads: int = 4, cfg: RankerConfig = CFG) -> float:
    """Requests/s of a closed loop with `threads` clients (the 'measured peak')."""
    with Load(url, threads=threads, max_seconds=seconds + 5, cfg=cfg) as load:
        time.sleep(2)  # ramp up
        start, first = time.monotonic(), len(load.log)
        time.sleep(seconds)
        done = len(load.log) - first
        elapsed = time.monotonic() - start
    return done / elapsed


def gpu_memory_used_mib() -> int | None:
    """Device memory in use on the GPUs of CUDA_VISIBLE_DEVICES (all when unset), summed, from
    nvidia-smi (this process opens no CUDA context); None without nvidia-smi or a GPU."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    argv = [
        "nvidia-smi",
        "--query-gpu=memory.used",
        "--format=csv,noheader,nounits",
        *([f"--id={visible}"] if visible else []),
    ]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    values = [int(v) for v in out.split() if v.strip().isdigit()]
    return sum(values) if values else None


def soak(server, seconds: float, fraction: float = 0.7, peak_seconds: float = 10, cfg: RankerConfig = CFG) -> dict:
    """Load at `fraction` of the measured peak for `seconds`; server RSS (tritonserver + stubs) and,
    where there is a GPU, its memory in use sampled each second; growth = max in the second half -
    value at mid-run (RSS: < 100 MB; GPU memory: flat, ≤ 64 MiB)."""
    peak = measure_peak(server.http_url, peak_seconds, cfg=cfg)
    rate = fraction * peak
    samples = []
    with Load(server.http_url, threads=4, rate=rate, max_seconds=seconds + 30, cfg=cfg) as load:
        start = time.monotonic()
        while time.monotonic() - start < seconds:
            samples.append((time.monotonic() - start, tree_rss_bytes(server.process.pid), gpu_memory_used_mib()))
            time.sleep(1.0)
    second_half = [s for s in samples if s[0] >= seconds / 2]
    mid = second_half[0][1]
    growth = max(s[1] for s in second_half) - mid
    gpu = {}
    if all(s[2] is not None for s in samples):
        gpu_growth = max(s[2] for s in second_half) - second_half[0][2]
        gpu = {
            "gpu_mib_start": samples[0][2],
            "gpu_mib_mid": second_half[0][2],
            "gpu_mib_end": samples[-1][2],
            "gpu_growth_from_mid_mib": gpu_growth,
        }
    errors = load.errors()
    return {
        "seconds": seconds,
        "peak_rps": round(peak, 1),
        "target_rps": round(rate, 1),
        "achieved_rps": round(len(load.log) / seconds, 1),
        "requests": len(load.log),
        "errors": len(errors),
        "error_examples": sorted({e[2][:200] for e in errors})[:5],
        "rss_start_mb": round(samples[0][1] / 2**20, 1),
        "rss_mid_mb": round(mid / 2**20, 1),
        "rss_end_mb": round(samples[-1][1] / 2**20, 1),
        "rss_growth_from_mid_mb": round(growth / 2**20, 1),
        **gpu,
        "failures": ([f"{len(errors)} unexpected errors"] if errors else [])
        + ([f"RSS grew {growth / 2**20:.0f} MB from mid-run"] if growth >= 100 * 2**20 else [])
        + (
            [f"GPU memory grew {gpu['gpu_growth_from_mid_mib']} MiB from mid-run"]
            if gpu and gpu["gpu_growth_from_mid_mib"] > 64
            else []
        ),
    }


# --- `make serve` as a subprocess: hardening, kill -9, shutdown ---


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


def probe(url: str, model: str = "ikbo_ranker", timeout: float = 60) -> str | None:
    """One small valid request on a connection of its own: None when it succeeds, else the error."""
    import tritonclient.http as module
    from tritonclient.utils import InferenceServerException

    request = make_request(CFG, 2, 16, np.random.default_rng(0))
    connection = module.InferenceServerClient(url, connection_timeout=timeout, network_timeout=timeout)
    try:
        connection.infer(model, infer_inputs(module, request))
        return None
    except InferenceServerException as e:
        return f"{e.status()}: {e.message()}"
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        connection.close()


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


def free_port_block(count: int) -> int:
    """A port p with p .. p + count - 1 all free (serve --replicas puts replica i's metrics on p + i)."""
    for _ in range(100):
        first = free_port()
        if first + count <= 65536 and not any(port_taken(first + i) for i in range(1, count)):
            return first
    raise OSError(f"no {count} consecutive free ports found")


@contextlib.contextmanager
def serving(exit_timeout: int = 30, model_repository=None, env_extra=None, log_dir=None, replicas: int = 1):
    """scripts/serve --cpu on free ports with a known admin key (`--replicas` when > 1); stopped
    (SIGTERM, then kill) on exit."""
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port_block(replicas)
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


def restricted_calls(protocol: str, url: str, headers: dict | None) -> dict[str, str]:
    """Call each restricted API once; name → "ok" or the error message."""
    from tritonclient.utils import InferenceServerException

    module = client_module(protocol)
    connection = module.InferenceServerClient(url)
    calls = {
        "model-repository index": lambda: connection.get_model_repository_index(headers=headers),
        "model-repository load": lambda: connection.load_model("ikbo_ranker", headers=headers),
        "shared-memory status": lambda: connection.get_system_shared_memory_status(headers=headers),
        "shared-memory register": lambda: connection.register_system_shared_memory(
            "probe", "/triton_python_backend_shm_region_probe", 64, headers=headers
        ),
        "logging": lambda: connection.get_log_settings(headers=headers),
        "trace": lambda: connection.get_trace_settings(headers=headers),
    }
    answers = {}
    try:
        for name, call in calls.items():
            try:
                call()
                answers[name] = "ok"
            except InferenceServerException as e:
                answers[name] = e.message() or str(e)
    finally:
        connection.close()
    return answers


def hardening(served: Served) -> dict:
    """Restricted APIs refused without the header, accepted with it (model control and registering a
    region that does not exist still fail, for their own reasons); inference needs no header."""
    failures, seen = [], {}
    for protocol in PROTOCOLS:
        url = served.http_url if protocol == "http" else served.grpc_url
        without = restricted_calls(protocol, url, None)
        with_key = restricted_calls(
            protocol, url, {ADMIN_HEADER if protocol == "http" else GRPC_ADMIN_HEADER: served.admin_key}
        )
        seen[protocol] = {"without_header": without, "with_header": with_key}
        for name, answer in without.items():
            if "restricted" not in answer.lower() or ADMIN_HEADER not in answer:
                failures.append(f"{protocol} {name} without the header: {answer}")
        for name, answer in with_key.items():
            if "restricted" in answer.lower():
                failures.append(f"{protocol} {name} with the header still refused: {answer}")
        if with_key["model-repository load"] == "ok":
            failures.append(f"{protocol}: model load accepted (expected refused under --model-control-mode=none)")
        for name in ("model-repository index", "shared-memory status", "logging", "trace"):
            if with_key[name] != "ok":
                failures.append(f"{protocol} {name} with the header: {with_key[name]}")
    return {"answers": seen, "failures": failures}


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
        with urllib.request.urlopen(f"http://{metrics_url}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    pattern = re.compile(r'^nv_inference_request_success\{model="([^"]+)",version="[^"]*"\} (\S+)$', re.M)
    return int(sum(float(value) for model, value in pattern.findall(text) if model in models))


@contextlib.contextmanager
def http_resends():
    """Yields a list that collects the monotonic times at which the HTTP client library resent a
    request because the server closed the connection without answering: geventhttpclient (under
    tritonclient.http) sends it again on a new connection, for any method, up to pool size + 1 times,
    and the caller sees only the second answer. A request in flight on a tritonserver that dies is
    resent so (with replicas the new connection reaches another one)."""
    import geventhttpclient.client as client

    times, original = [], client.HTTPSocketPoolResponse

    def counted(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        except client.HTTPConnectionClosed:
            times.append(time.monotonic())
            raise

    client.HTTPSocketPoolResponse = counted
    try:
        yield times
    finally:
        client.HTTPSocketPoolResponse = original


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
    # Every failed request belongs to one kill: in flight at it, or sent between it and the next one.
    log = [e for load in loads for e in load.log if e[2]]
    bounds = [t for t, _ in times[1:]] + [t_end]
    for round_, (t_kill, t_down), t_next in zip(rounds, times, bounds):
        in_flight = [e for e in log if e[0] < t_kill <= e[1]]
        sent = [e for e in log if t_kill <= e[0] < t_next]
        window = [e for e in sent if e[0] <= t_down]
        round_.update({
            "in_flight": sum(e[0] < t_kill <= e[1] for load in loads for e in load.log),
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


def graceful_shutdown(served: Served, exit_timeout: int) -> dict:
    """SIGTERM to serve under load (2 clients, large requests): requests in flight at the signal must
    succeed within the exit timeout, serve must exit 0, and tritonserver's /dev/shm segments be gone."""
    with Load(served.http_url, threads=2, sizes=((64, 2048), (32, 1024))) as load:
        time.sleep(3)
        # closed loop: both clients have a request in flight nearly always
        segments = set().union(*(shm_segments(pid) for pid in served.triton_pids()))  # of every replica
        t_signal = time.monotonic()
        served.process.send_signal(signal.SIGTERM)
        load.stop_event.set()  # no new requests; the ones in flight finish
        load.stop()
    try:
        code = served.process.wait(exit_timeout + 30)
    except subprocess.TimeoutExpired:
        code = None
    t_exit = time.monotonic()
    in_flight = [e for e in load.log if e[0] < t_signal < e[1]]
    failed = [e for e in in_flight if e[2]]
    left = sorted(s for s in segments if Path(s).exists())
    failures = []
    if not in_flight:
        failures.append("no request was in flight at SIGTERM")
    if failed:
        failures.append(f"in-flight requests failed: {[e[2][:200] for e in failed]}")
    if any(e[1] - t_signal > exit_timeout for e in in_flight):
        failures.append("an in-flight request finished after the exit timeout")
    if code != 0:
        failures.append(f"serve exit code {code}")
    if left:
        failures.append(f"/dev/shm segments left: {left}")
    return {
        "in_flight_at_sigterm": len(in_flight),
        "in_flight_failed": len(failed),
        "last_in_flight_done_s": round(max((e[1] - t_signal for e in in_flight), default=0), 2),
        "exit_s": round(t_exit - t_signal, 1),
        "exit_code": code,
        "shm_segments_before": len(segments),
        "shm_segments_left": len(left),
        "failures": failures,
    }


# --- online (dynamically batched) endpoints: batch isolation, queue full ---

ONLINE_MODELS = ("ikbo_ranker_online", "baseline_ranker_online")


def _bad_online(kind: str, one: dict) -> tuple[str, dict]:
    """(input the message must name, a bad version of the online request `one`)."""
    if kind == "NaN dense":
        return "cand_dense", one | {
            "cand_dense": np.where(
                np.arange(one["cand_dense"].shape[1])[None, :, None] == 0, np.nan, one["cand_dense"]
            ).astype(np.float32)
        }
    if kind == "id outside table":
        return "cand_sparse_ids", one | {"cand_sparse_ids": one["cand_sparse_ids"] + CFG.cand_vocab_size}
    if kind == "history_len > L":
        return "user_history_len", one | {"user_history_len": np.full((1, 1), CFG.history_length + 1, np.int32)}
    if kind == "two users":
        return "user_dense", {k: np.concatenate([v, v]) for k, v in one.items()}
    if kind == "no candidates":
        return "cand_dense", one | {k: one[k][:, :0] for k in ("cand_dense", "cand_sparse_ids")}
    raise ValueError(f"kind: unknown {kind!r}")


BAD_ONLINE_KINDS = ("NaN dense", "id outside table", "history_len > L", "two users", "no candidates")


def _send_all(url_of, model, requests, protocol_of, workers=16):
    """Send concurrently (a client per thread); → list of (scores bytes | None, status, message, seconds)."""
    from concurrent.futures import ThreadPoolExecutor

    from tritonclient.utils import InferenceServerException

    local, opened = threading.local(), []

    def send(index):
        protocol = protocol_of(index)
        module = client_module(protocol)
        clients = local.__dict__.setdefault("clients", {})
        if protocol not in clients:
            clients[protocol] = module.InferenceServerClient(
                url_of(protocol), **({"network_timeout": 120} if protocol == "http" else {})
            )
            opened.append(clients[protocol])
        start = time.monotonic()
        try:
            result = clients[protocol].infer(
                model, infer_inputs(module, requests[index]), outputs=[module.InferRequestedOutput("scores")]
            )
            return result.as_numpy("scores").tobytes(), "OK", "", time.monotonic() - start
        except InferenceServerException as e:
            return None, str(e.status()), e.message() or str(e), time.monotonic() - start

    try:
        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(send, range(len(requests))))
    finally:
        for client in opened:
            client.close()


def _statistics(server, model) -> tuple[int, int]:
    import tritonclient.http as module

    connection = module.InferenceServerClient(server.http_url)
    try:
        stats = connection.get_inference_statistics(model)["model_stats"][0]
    finally:
        connection.close()
    return int(stats["inference_count"]), int(stats["execution_count"])


def _batch_invariant(server, model) -> bool:
    """Whether the served config of `model` sets the batch-invariant mode (parameter batch_invariant)."""
    import tritonclient.http as module

    connection = module.InferenceServerClient(server.http_url)
    try:
        parameters = connection.get_model_config(model).get("parameters", {})
    finally:
        connection.close()
    return parameters.get("batch_invariant", {}).get("string_value") == "yes"


def batch_isolation(server, rounds: int, seed: int, users: int = 24) -> dict:
    """Good and bad one-user requests interleaved and sent concurrently (HTTP and gRPC alternating) to
    both online endpoints, `rounds` times in shuffled orders. Criterion for a good answer: bit-identical
    to the same request's answer sent alone where the served config has `batch_invariant: "yes"`,
    else rel err <= 1e-5 to it (a batch runs the matmuls at another M, which changes the last bits);
    the count of bit-identical answers and the max rel err are reported either way. Every bad request:
    a 400 naming its input."""
    from ikbo_backend.online import make_online_batch, split_by_user

    rng = np.random.default_rng(seed)
    url_of = lambda protocol: server.http_url if protocol == "http" else server.grpc_url  # noqa: E731
    failures, sent, per_model = [], 0, {}
    for model in ONLINE_MODELS:
        invariant = _batch_invariant(server, model)
        good = split_by_user(make_online_batch(CFG, users, users * 40, rng))
        solo = [_send_all(url_of, model, [one], lambda i: "http", workers=1)[0][0] for one in good]
        bad = [(kind, *_bad_online(kind, good[i % len(good)])) for i, kind in enumerate(BAD_ONLINE_KINDS * 2)]
        before = _statistics(server, model)
        goods, identical, max_rel = 0, 0, 0.0
        for r in range(rounds):
            items = [("good", i, one) for i, one in enumerate(good)] + [
                ("bad", kind, (name, one)) for kind, name, one in bad
            ]
            order = rng.permutation(len(items))
            items = [items[i] for i in order]
            answers = _send_all(
                url_of, model, [it[2] if it[0] == "good" else it[2][1] for it in items], lambda i: PROTOCOLS[i % 2]
            )
            for (what, key, payload), (scores, status, message, _), index in zip(items, answers, range(len(items))):
                sent += 1
                protocol = PROTOCOLS[index % 2]
                if what == "good":
                    goods += 1
                    if scores is None:
                        failures.append(f"{model} round {r}: good request {key} failed: {status} {message[:160]}")
                        continue
                    identical += scores == solo[key]
                    got, want = np.frombuffer(scores, np.float32), np.frombuffer(solo[key], np.float32)
                    rel = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-12))
                    max_rel = max(max_rel, rel)
                    if invariant and scores != solo[key]:
                        failures.append(
                            f"{model} round {r}: good request {key} not bit-identical to its solo answer (rel err {rel:.2e})"
                        )
                    elif rel > 1e-5:
                        failures.append(f"{model} round {r}: good request {key}: rel err {rel:.2e} to its solo answer")
                if what == "bad" and (status not in CLIENT_ERRORS[protocol] or f"'{payload[0]}'" not in message):
                    failures.append(f"{model} round {r}: bad '{key}' answered {status}: {message[:200]}")
        inferences, executions = (a - b for a, b in zip(_statistics(server, model), before))
        per_model[model] = {
            "batch_invariant": invariant,
            "requests": inferences,
            "executions": executions,
            "good": goods,
            "bit_identical_to_solo": int(identical),
            "max_rel_err_to_solo": float(f"{max_rel:.2e}"),
        }
        if executions >= inferences:
            failures.append(f"{model}: {executions} executions for {inferences} requests: nothing was batched")
    return {
        "requests": sent,
        "good": sum(m["good"] for m in per_model.values()),
        "bit_identical_to_solo": sum(m["bit_identical_to_solo"] for m in per_model.values()),
        "max_rel_err_to_solo": max(m["max_rel_err_to_solo"] for m in per_model.values()),
        "per_model": per_model,
        "failures": failures,
    }


def queue_full(server, bursts: int, burst: int = 48, candidates: int = 512, p99_bound_s: float = 30.0) -> dict:
    """`bursts` bursts of `burst` simultaneous one-user requests (`candidates` each) to
    ikbo_ranker_online over HTTP: the overflow is answered 503 "Exceeds maximum queue size", the
    others succeed; p99 latency of the accepted ones stays below `p99_bound_s`."""
    from ikbo_backend.online import make_online_batch, split_by_user

    model, rng = "ikbo_ranker_online", np.random.default_rng(0)
    requests = split_by_user(make_online_batch(CFG, burst, burst * candidates, rng))
    url_of = lambda protocol: server.http_url  # noqa: E731
    answers = []
    for _ in range(bursts):
        answers += _send_all(url_of, model, requests, lambda i: "http", workers=burst)
    accepted = [a for a in answers if a[1] == "OK"]
    rejected = [a for a in answers if a[1] != "OK"]
    wrong = [a for a in rejected if a[1] != "503" or "Exceeds maximum queue size" not in a[2]]
    p99 = float(np.percentile([a[3] for a in accepted], 99)) if accepted else None
    failures = []
    if not rejected:
        failures.append("no request was rejected: the queue never overflowed")
    if wrong:
        failures.append(
            f"{len(wrong)} rejections not 503 'Exceeds maximum queue size', e.g. {[(a[1], a[2][:150]) for a in wrong[:3]]}"
        )
    if p99 is None or p99 > p99_bound_s:
        failures.append(f"p99 of accepted requests {p99} s")
    return {
        "requests": len(answers),
        "accepted": len(accepted),
        "rejected_503": len(rejected) - len(wrong),
        "accepted_p50_s": round(float(np.percentile([a[3] for a in accepted], 50)), 2) if accepted else None,
        "accepted_p99_s": None if p99 is None else round(p99, 2),
        "failures": failures,
    }


@contextlib.contextmanager
def repository_copy(models, prefix: str):
    """A temporary model repository holding a copy of `models` (and shape_ranges.json); the model.py
    files find the packages through symlinks next to it."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        root = Path(tmp)
        for package in ("ikbo_backend", "kernels"):
            if (REPO_ROOT / package).is_dir():
                (root / package).symlink_to(REPO_ROOT / package)
        repo = root / "model_repository"
        repo.mkdir()
        shutil.copy2(MODEL_REPOSITORY / "shape_ranges.json", repo)
        for name in models:
            shutil.copytree(MODEL_REPOSITORY / name, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
        yield repo


@contextlib.contextmanager
def online_repository(max_queue_size: int | None = None):
    """A copy of the online endpoints; with `max_queue_size`, a REJECT queue policy of that size is
    added to their dynamic batcher (the shipped configs have none: docs/reliability.md)."""
    with repository_copy(ONLINE_MODELS, "online-repo-") as repo:
        for name in ONLINE_MODELS if max_queue_size is not None else ():
            config = repo / name / "config.pbtxt"
            policy = f"  default_queue_policy {{ max_queue_size: {max_queue_size} timeout_action: REJECT }}\n"
            text, n = re.subn(r"dynamic_batching \{\n", lambda m: m.group(0) + policy, config.read_text())
            if n != 1:
                raise ValueError(f"{config}: expected one dynamic_batching block, found {n}")
            config.write_text(text)
        yield repo


# --- a broken model ---


@contextlib.contextmanager
def rankers_repository(broken_model: str | None = None):
    """A copy of the models behind both rankers (no other model of model_repository/); with
    `broken_model`, that model's config declares a dim the weights do not have."""
    with repository_copy((*SERVED_STAGES, *RANKERS), "rankers-repo-") as repo:
        if broken_model:
            config = repo / broken_model / "config.pbtxt"
            text = config.read_text()
            config.write_text(text.replace("dims: [ -1, 7, 64 ]", "dims: [ -1, 7, 63 ]", 1))
        yield repo


def broken(model: str = "ikbo_interaction") -> dict:
    """Start on a repository with one broken model: the server must refuse (exit before ready, or never
    ready) with a message naming the model."""
    start = time.monotonic()
    with rankers_repository(broken_model=model) as repo:
        try:
            with running_tritonserver(repo, timeout=120) as server:
                ready = is_ready(server.http_url)
                return {
                    "refused": False,
                    "ready": ready,
                    "failures": [f"server became ready={ready} with broken {model}"],
                }
        except TritonServerError as e:
            message = str(e)
    lines = [
        line for line in message.splitlines() if model in line and ("fail" in line.lower() or "error" in line.lower())
    ]
    failures = [] if lines else [f"no log line names {model}: {message[-1500:]}"]
    return {
        "refused": True,
        "seconds": round(time.monotonic() - start, 1),
        "message": lines[0][:300] if lines else None,
        "failures": failures,
    }


# --- command line ---


@contextlib.contextmanager
def fault_server(model_repository):
    """tritonserver over `model_repository` with the test-only fault enabled."""
    os.environ[TEST_FAULTS_ENV] = "1"
    try:
        with running_tritonserver(model_repository) as server:
            yield server
    finally:
        os.environ.pop(TEST_FAULTS_ENV, None)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "row", choices=("storm", "fault", "kill", "shutdown", "broken", "soak", "harden", "online", "all")
    )
    parser.add_argument("--rounds", type=int, default=20, help="online: interleaved rounds per endpoint")
    parser.add_argument("--bursts", type=int, default=10, help="online: queue-full bursts")
    parser.add_argument("--queue-size", type=int, default=8, help="online: max_queue_size of the copy")
    parser.add_argument("--requests", type=int, default=1000, help="storm: malformed requests per protocol")
    parser.add_argument("--seed", type=int, default=None, help="storm: hypothesis seed (default: random)")
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--replicas", type=int, default=1, help="harden, kill, shutdown: scripts/serve --replicas N")
    parser.add_argument("--seconds", type=float, default=600, help="soak duration")
    parser.add_argument("--fraction", type=float, default=0.7, help="soak load as a fraction of the measured peak")
    parser.add_argument(
        "--attach", metavar="HTTP_URL", help="soak: a server already running (its rankers), e.g. the GPU run's"
    )
    parser.add_argument("--server-pid", type=int, help="with --attach: tritonserver's pid (RSS of it and its stubs)")
    parser.add_argument(
        "--profile", default="demo", choices=sorted(PROFILES), help="with --attach: the served model's dims"
    )
    parser.add_argument("--exit-timeout", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None, help="append the JSON results here")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    rows = (
        ("storm", "fault", "harden", "kill", "shutdown", "broken", "soak", "online")
        if args.row == "all"
        else (args.row,)
    )
    results = {}
    if args.attach:
        if rows != ("soak",) or args.server_pid is None:
            parser.error("--attach runs the soak row only, and needs --server-pid")
        server = SimpleNamespace(http_url=args.attach, process=SimpleNamespace(pid=args.server_pid))
        results["soak"] = dict(
            soak(server, args.seconds, args.fraction, cfg=PROFILES[args.profile]), profile=args.profile
        )
        print(json.dumps({"soak": results["soak"]}), flush=True)
        rows = ()
    if {"storm", "fault", "soak"} & set(rows):
        with rankers_repository() as repo, fault_server(repo) as server:
            if "storm" in rows:
                results["storm"] = dict(storm(server, args.requests, seed), seed=seed)
                print(json.dumps({"storm": results["storm"]}), flush=True)
            if "fault" in rows:
                results["fault"] = fault(server)
                print(json.dumps({"fault": results["fault"]}), flush=True)
            if "soak" in rows:
                results["soak"] = soak(server, args.seconds, args.fraction)
                print(json.dumps({"soak": results["soak"]}), flush=True)
    if {"harden", "kill", "shutdown"} & set(rows):
        with rankers_repository() as repo, serving(args.exit_timeout, repo, replicas=args.replicas) as served:
            if "harden" in rows:
                results["harden"] = hardening(served)
                print(json.dumps({"harden": results["harden"]}), flush=True)
            if "kill" in rows:
                results["kill"] = kill_stubs(served, args.kills)
                print(json.dumps({"kill": results["kill"]}), flush=True)
            if "shutdown" in rows:
                results["shutdown"] = graceful_shutdown(served, args.exit_timeout)
                print(json.dumps({"shutdown": results["shutdown"]}), flush=True)
    if "online" in rows:
        with online_repository() as repo, running_tritonserver(repo) as server:
            results["online_isolation"] = dict(batch_isolation(server, args.rounds, seed), seed=seed)
            print(json.dumps({"online_isolation": results["online_isolation"]}), flush=True)
        with online_repository(args.queue_size) as repo, running_tritonserver(repo) as server:
            results["online_queue_full"] = dict(queue_full(server, args.bursts), max_queue_size=args.queue_size)
            print(json.dumps({"online_queue_full": results["online_queue_full"]}), flush=True)
    if "broken" in rows:
        results["broken"] = broken()
        print(json.dumps({"broken": results["broken"]}), flush=True)
    results["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(results) + "\n")
    failed = {row: r["failures"] for row, r in results.items() if isinstance(r, dict) and r.get("failures")}
    for row, problems in failed.items():
        print(f"FAIL {row}: {len(problems)} problem(s), e.g. {problems[:3]}", file=sys.stderr)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
