"""The python backend's side of the served stages: the `TritonPythonModel` of every model.py.

Each model.py is three lines: it imports `triton_python_backend_utils` (only model.py files do, so
this package imports without a server) and hands it to `triton_python_model` with its role:

| role          | stage (stages.py) | execute            | models                                     |
|---------------|-------------------|--------------------|--------------------------------------------|
| "features"    | FeatureModel      | `execute_requests` | ranker_features                            |
| "interaction" | InteractionModel  | `execute_requests` | ikbo / baseline / transformed_interaction  |
| "ranker"      | RankerModel       | `execute_requests` | ikbo / baseline / transformed_ranker (GPU) |
| "online"      | OnlineModel       | `execute_online`   | ikbo / baseline_ranker_online              |

The variant comes from the config (`variant`). For the ikbo variant the custom metrics
(ikbo_backend.metrics) of each answered batch, wall time inside `execute` included; for the
transformed variant the rewrite pass's report in the server log. The same model.py runs under
Triton's python backend and under python_inprocess (whose pb_utils hands out torch tensors).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from torch.utils.dlpack import from_dlpack, to_dlpack

from .compile_counter import CompileCounter
from .metrics import RankerMetrics, replicated_row_bytes
from .online import ONLINE_INPUT_NAMES, coalesce, groups_within, unbatch
from .requests import InvalidRequest, check_request_shapes, check_request_values
from .stages import FeatureModel, InteractionModel, OnlineModel, RankerModel, ServedStage

# Test-only fault injection: with IKBO_TEST_FAULTS=1 in the server's environment (never in `make serve`),
# a request parameter ikbo_test_fault="raise" makes execute raise an exception whose text holds internal
# details (this process's command line: model.py path, shared-memory key), as a real bug's might.
TEST_FAULTS_ENV = "IKBO_TEST_FAULTS"
TEST_FAULT_PARAMETER = "ikbo_test_fault"
_TEST_FAULTS = os.environ.get(TEST_FAULTS_ENV) == "1"  # read once: the server's environment is fixed at its start


def _to_torch(name: str, tensor) -> torch.Tensor:
    """A pb_utils.Tensor (CPU or GPU) as a torch tensor, without a copy: the python_inprocess backend's
    tensors are torch tensors already (`as_torch`), the python backend's go through DLPack. Not
    as_numpy(): python backend 2.51's stub builds wrong arrays under numpy 2 (every row = row 0)."""
    if tensor is None:
        raise InvalidRequest(name, "missing")
    return tensor.as_torch() if hasattr(tensor, "as_torch") else from_dlpack(tensor.to_dlpack())


def from_torch(pb_utils, name: str, tensor: torch.Tensor):
    """A torch tensor as a pb_utils.Tensor, without a copy: the python_inprocess backend's Tensor holds
    it as it is, the python backend's takes it through DLPack."""
    if hasattr(pb_utils.Tensor, "as_torch"):
        return pb_utils.Tensor(name, tensor)
    return pb_utils.Tensor.from_dlpack(name, to_dlpack(tensor.contiguous()))


def _injected_fault(request) -> None:
    if not _TEST_FAULTS:
        return
    if json.loads(request.parameters() or "{}").get(TEST_FAULT_PARAMETER) == "raise":
        cmdline = Path("/proc/self/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        raise RuntimeError(f"injected test fault in {cmdline}")


def _invalid(pb_utils, error: ValueError):
    """The INVALID_ARG response of a client error (HTTP 400, gRPC INVALID_ARGUMENT)."""
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(error), pb_utils.TritonError.INVALID_ARG))


def _internal(pb_utils, model, error: Exception):
    """The INTERNAL response (HTTP 500) of any other exception: it names the model and the exception
    type only; its text, which may hold paths or shared-memory keys, goes to the server log."""
    name = getattr(model, "name", type(model).__name__)
    pb_utils.Logger.log_error(f"{name}: {type(error).__name__}: {error}")
    message = f"model '{name}': internal error ({type(error).__name__}); details are in the server log"
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, pb_utils.TritonError.INTERNAL))


def execute_requests(pb_utils, model: ServedStage, requests) -> list:
    """The python backend's execute: one response per request. A ValueError (InvalidRequest included)
    becomes an INVALID_ARG error response for that request alone, any other exception an INTERNAL
    one. The other requests of the call are unaffected."""
    responses = []
    for request in requests:
        try:
            _injected_fault(request)
            inputs = {name: _to_torch(name, pb_utils.get_input_tensor_by_name(request, name)) for name in model.inputs}
            with torch.inference_mode():
                outputs = model(inputs)
            tensors = [from_torch(pb_utils, name, t) for name, t in outputs.items()]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        except ValueError as e:
            responses.append(_invalid(pb_utils, e))
        except Exception as e:
            responses.append(_internal(pb_utils, model, e))
    return responses


def execute_online(pb_utils, model: OnlineModel, requests, metrics=None) -> list:
    """The python backend's execute for the online endpoints (online.py): one response per request,
    in order. Each request's shapes are checked alone (at U = 1); the rest run as one IKBO batch per
    `groups_within` chunk, whose values the model checks (on the GPU inside its graph, else on the
    host, once per batch), and the scores are split back (host memory). If a batch holds a bad value,
    every request's values are checked alone on the host, the bad ones get INVALID_ARG and the valid
    ones run again, grouped as if the bad ones had never come: no answer or metric of the first pass
    is kept. Any other error fails its chunk with INTERNAL. `metrics.record(U, B)` per answered batch."""
    responses: list = [None] * len(requests)
    shaped: list[tuple[int, dict[str, torch.Tensor]]] = []
    for index, request in enumerate(requests):
        try:
            raw = {
                name: _to_torch(name, pb_utils.get_input_tensor_by_name(request, name)) for name in ONLINE_INPUT_NAMES
            }
            single = unbatch(raw)
            check_request_shapes(model.cfg, model.ranges, single)  # InvalidRequest names the input
            shaped.append((index, single))
        except ValueError as e:
            responses[index] = _invalid(pb_utils, e)
    try:
        answered, batches = _run_batches(pb_utils, model, shaped)
    except InvalidRequest:  # a bad value somewhere: find it request by request
        valid = []
        for index, single in shaped:
            try:
                check_request_values(model.cfg, single)
                valid.append((index, single))
            except ValueError as e:
                responses[index] = _invalid(pb_utils, e)
        answered, batches = _run_batches(pb_utils, model, valid)
    for index, response in answered:
        responses[index] = response
    if metrics is not None:
        for num_users, num_candidates in batches:
            metrics.record(num_users, num_candidates)
    return responses


def _run_batches(pb_utils, model: OnlineModel, members: list[tuple[int, dict[str, torch.Tensor]]]):
    """([(request index, response)], [(U, B) of each answered batch]) of requests at U = 1, run as
    `groups_within` batches. InvalidRequest (a value check of a batch failed) propagates; any other
    error answers its chunk with INTERNAL."""
    counts = [single["cand_dense"].shape[0] for _, single in members]
    answered, batches = [], []
    for group in groups_within(counts, model.ranges.users[1], model.ranges.candidates[1]):
        chunk = members[group]
        try:
            with torch.inference_mode():
                scores = model(coalesce([single for _, single in chunk]))  # [B, T]
            for (index, _), part in zip(chunk, torch.split(scores, counts[group])):
                tensor = from_torch(pb_utils, "scores", part[None])  # [1, n, T]
                answered.append((index, pb_utils.InferenceResponse(output_tensors=[tensor])))
            batches.append((len(chunk), sum(counts[group])))
        except InvalidRequest:
            raise
        except Exception as e:
            failed = _internal(pb_utils, model, e)  # details only in the server log
            answered += [(index, failed) for index, _ in chunk]
    return answered, batches


ROLES = {"features": FeatureModel, "interaction": InteractionModel, "ranker": RankerModel, "online": OnlineModel}


def triton_python_model(pb_utils, role: str) -> type:
    """The `TritonPythonModel` class of a model.py: the stage of `role` (ROLES) built from the config
    at initialize, served by `execute_online` (role "online") or `execute_requests`, with the ikbo
    variant's metrics and the transformed variant's report (module doc)."""
    if role not in ROLES:
        raise ValueError(f"role: expected one of {sorted(ROLES)}, got {role!r}")
    stage = ROLES[role]

    class TritonPythonModel:
        def initialize(self, args):
            # Triton compilations: warm-up, then requests (must stay 0)
            compilations = CompileCounter.install(getattr(pb_utils, "loads_in_progress", None))
            self.model = stage.from_triton_args(args)  # config, weights, device, warm-up, graphs
            compilations.phase = "request"
            variant = getattr(self.model, "variant", None)
            if variant == "transformed":
                pb_utils.Logger.log_info(str(self.model.interaction.report))
            self.metrics = None
            if variant == "ikbo":
                row_bytes = replicated_row_bytes(self.model.cfg)
                self.metrics = RankerMetrics(pb_utils, args["model_name"], row_bytes, compilations, self.model.device)

        def execute(self, requests):
            start = time.perf_counter()
            if role == "online":
                responses = execute_online(pb_utils, self.model, requests, self.metrics)
            else:
                responses = execute_requests(pb_utils, self.model, requests)
                if self.metrics is not None:
                    self.metrics.record_responses(pb_utils, requests, responses, *self.model.shape_inputs)
            if self.metrics is not None:
                self.metrics.record_execute(time.perf_counter() - start)
            return responses

        def finalize(self):
            if self.metrics is not None:
                self.metrics.close()  # the queued metric updates, then its worker thread ends

    return TritonPythonModel
