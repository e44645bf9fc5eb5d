"""Requests to a running tritonserver through tritonclient (HTTP or gRPC): inputs from numpy arrays, scores back."""

from __future__ import annotations

import numpy as np


def client_module(protocol: str):
    """tritonclient.http or tritonclient.grpc."""
    if protocol == "http":
        import tritonclient.http as module
    elif protocol == "grpc":
        import tritonclient.grpc as module
    else:
        raise ValueError(f"protocol: expected 'http' or 'grpc', got {protocol!r}")
    return module


def infer_inputs(module, request: dict[str, np.ndarray]) -> list:
    """InferInputs of a request, each with the Triton datatype of its numpy dtype."""
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, array in request.items():
        tensor = module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(np.ascontiguousarray(array))
        inputs.append(tensor)
    return inputs


def infer_scores(client, module, model: str, request: dict[str, np.ndarray]) -> np.ndarray:
    """scores [B, T] of `model` for a request; raises tritonclient's InferenceServerException."""
    result = client.infer(model, infer_inputs(module, request), outputs=[module.InferRequestedOutput("scores")])
    return result.as_numpy("scores")
