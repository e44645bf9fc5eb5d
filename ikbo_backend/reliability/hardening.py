"""Restricted APIs behind the admin header; inference needs none; no model control."""

from __future__ import annotations

from ..client import client_module
from ..tritonserver import ADMIN_HEADER, GRPC_ADMIN_HEADER
from . import PROTOCOLS
from .served import Served


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
