"""The test-only fault inside execute: a 500 / INTERNAL naming the model, nothing internal in the message."""

from __future__ import annotations

import contextlib
import os

import numpy as np

from ..client import client_module, infer_inputs
from ..python_model import TEST_FAULT_PARAMETER, TEST_FAULTS_ENV
from ..synthetic import make_request
from ..tritonserver import running_tritonserver
from . import CFG, PROTOCOLS, RANKERS

# What a leak in an error message looks like: a file path, a python-backend shared-memory key.
LEAK_MARKERS = ("/", ".py", "triton_python_backend_shm", "shm_region")


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


@contextlib.contextmanager
def fault_server(model_repository):
    """tritonserver over `model_repository` with the test-only fault enabled."""
    os.environ[TEST_FAULTS_ENV] = "1"
    try:
        with running_tritonserver(model_repository) as server:
            yield server
    finally:
        os.environ.pop(TEST_FAULTS_ENV, None)
