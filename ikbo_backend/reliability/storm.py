"""Malformed-request storms: every case sent over HTTP and gRPC (truncated binary payloads as raw
requests), each answer judged (a 400-class status, the message names the input and the problem), the
server ready and its valid answers bit-identical before and after."""

from __future__ import annotations

import http.client
import json
import time

import numpy as np

from ..client import client_module, infer_inputs
from ..synthetic import make_request
from . import CFG, CLIENT_ERRORS, PROTOCOLS, RANKERS
from .cases import Case, malformed_cases

NOT_FOUND = {
    "http": {"404", "400"},
    "grpc": {"StatusCode.NOT_FOUND", "StatusCode.INVALID_ARGUMENT", "StatusCode.UNAVAILABLE"},
}


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
