"""What backend.c calls, with the GIL held, from Triton's threads: `initialize` / `finalize` per model
instance and `execute` per batch of requests. A model instance is its model.py's TritonPythonModel,
built and called as the python backend would (same `args` keys, same `execute(requests)` contract),
but in tritonserver's process: inputs are read from Triton's buffers, outputs written into Triton's,
statistics reported per request as Triton's own backends (onnxruntime, TensorRT) do: compute input =
wrapping the requests, compute infer = the model's `execute`, compute output = writing the outputs
into Triton's response buffers. `execute` builds the responses and returns them to backend.c, which
reports the statistics, sends the responses and releases the requests after it released the GIL
(exec end): Triton's frontend serializes a response in the sending thread.

Loading is exclusive: an `initialize` (warm-up, CUDA graph capture in global capture mode, Triton
compilations) waits for running `execute` calls and holds new ones back (`_Exclusive`), as each
instance had its own process under the python backend. A model can tell that another one is loading
(`pb_utils.loads_in_progress`): its compilations then are not request-path compilations of the models
already loaded.
After each load the objects alive are frozen out of the garbage collector (`_freeze_long_lived`).

Each returns None, or for initialize/finalize an error message that Triton shows (the model then
fails to load). A model that raises answers every request of the call with an INTERNAL error naming
the model and the exception type; the traceback goes to the server log."""

from __future__ import annotations

import ctypes
import gc
import importlib.util
import json
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from ctypes import POINTER, byref, c_char_p, c_int, c_int32, c_uint64, c_void_p
from pathlib import Path

from . import pb_utils
from . import triton_c as C
from .triton_c import api

sys.modules.setdefault("triton_python_backend_utils", pb_utils)


class _Instance:
    def __init__(self, handle: int, model, args: dict[str, str]):
        self.handle, self.model, self.name = handle, model, args["model_name"]
        self.cuda_device = int(args["model_instance_device_id"]) if args["model_instance_kind"] == "GPU" else None


class _Exclusive:
    """Shared holds (execute) run together; an exclusive hold (initialize, finalize) runs alone, and a
    waiting exclusive hold keeps new shared ones out. A shared hold with no exclusive one around takes
    one lock and no wait (it opens every request: no generator, no notify)."""

    def __init__(self):
        self._condition = threading.Condition(threading.Lock())
        self._shared = 0
        self._exclusive = self._waiting = False
        self._shared_hold = _SharedHold(self)

    def shared(self) -> _SharedHold:
        return self._shared_hold

    def _enter_shared(self) -> None:
        with self._condition:
            if self._exclusive or self._waiting:
                self._condition.wait_for(lambda: not (self._exclusive or self._waiting))
            self._shared += 1

    def _exit_shared(self) -> None:
        with self._condition:
            self._shared -= 1
            if self._waiting and not self._shared:  # the last shared hold lets the waiting exclusive one in
                self._condition.notify_all()

    @contextmanager
    def exclusive(self):
        with self._condition:
            self._condition.wait_for(lambda: not self._waiting)
            self._waiting = True
            self._condition.wait_for(lambda: not (self._exclusive or self._shared))
            self._exclusive, self._waiting = True, False
        try:
            yield
        finally:
            with self._condition:
                self._exclusive = False
                self._condition.notify_all()


class _SharedHold:
    """`with _Exclusive.shared():` one reusable context manager per lock."""

    def __init__(self, lock: _Exclusive):
        self._lock = lock

    def __enter__(self) -> None:
        self._lock._enter_shared()

    def __exit__(self, *exc) -> None:
        self._lock._exit_shared()


_instances: dict[int, _Instance] = {}  # instance handle → its model
_loading = _Exclusive()
_thread = threading.local()  # .cuda_device: the device set in this (Triton instance) thread


class _Reply(ctypes.Structure):
    """backend.c's `ikbo_reply`: a request's built response (None: it could not be built), the error it
    carries (None: a success) and the success flag of its statistics."""

    _fields_ = [("response", c_void_p), ("error", c_void_p), ("success", c_int32), ("reserved", c_int32)]


class _Execution(ctypes.Structure):
    """backend.c's `ikbo_execution`, zeroed by it: what `execute` hands back."""

    _fields_ = [
        ("compute_start_ns", c_uint64),
        ("compute_end_ns", c_uint64),
        ("replies", POINTER(_Reply)),
        ("complete", c_int32),
        ("reserved", c_int32),
    ]


def set_native_reader(address: int) -> None:
    """backend.c, once at start: the address of its `ikbo_read_inputs` (for pb_utils._read_all_inputs)."""
    pb_utils.set_native_reader(address)


def _model_args(instance: int) -> dict[str, str]:
    """The python backend's initialize args of a model instance (all strings)."""
    model, name, instance_name, kind, device = c_void_p(), c_char_p(), c_char_p(), c_int(), c_int32()
    api.TRITONBACKEND_ModelInstanceModel(instance, byref(model))
    api.TRITONBACKEND_ModelName(model, byref(name))
    api.TRITONBACKEND_ModelInstanceName(instance, byref(instance_name))
    api.TRITONBACKEND_ModelInstanceKind(instance, byref(kind))
    api.TRITONBACKEND_ModelInstanceDeviceId(instance, byref(device))
    version, artifact, location = c_uint64(), c_int(), c_char_p()
    api.TRITONBACKEND_ModelVersion(model, byref(version))
    api.TRITONBACKEND_ModelRepository(model, byref(artifact), byref(location))
    message, base, size = c_void_p(), c_void_p(), c_uint64()
    api.TRITONBACKEND_ModelConfig(model, 1, byref(message))
    try:
        api.TRITONSERVER_MessageSerializeToJson(message, byref(base), byref(size))
        config = ctypes.string_at(base, size.value).decode()
    finally:
        api.TRITONSERVER_MessageDelete(message)
    return {
        "model_config": config,
        "model_instance_kind": C.INSTANCE_KINDS[kind.value],
        "model_instance_name": instance_name.value.decode(),
        "model_instance_device_id": str(device.value),
        "model_repository": location.value.decode(),
        "model_version": str(version.value),
        "model_name": name.value.decode(),
    }


def initialize(instance: int) -> str | None:
    with _loading.exclusive(), pb_utils.load_in_progress():
        return _initialize(instance)


def _initialize(instance: int) -> str | None:
    try:
        args = _model_args(instance)
        filename = json.loads(args["model_config"]).get("default_model_filename") or "model.py"
        path = Path(args["model_repository"]) / args["model_version"] / filename
        spec = importlib.util.spec_from_file_location(
            f"_inprocess_{args['model_name']}_{args['model_version']}_{instance:x}", path
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        model = module.TritonPythonModel()
        if hasattr(model, "initialize"):
            model.initialize(args)
        _instances[instance] = _Instance(instance, model, args)
        _freeze_long_lived()
        return None
    except Exception:
        return f"python_inprocess: initialize failed:\n{traceback.format_exc()}"


def _freeze_long_lived() -> None:
    """Move every object alive now (the loaded models: modules, weights, graphs) out of the cyclic
    garbage collector's generations (gc.freeze), so that its full collections scan only what requests
    leave behind. All models share this interpreter: with the loaded rankers frozen, a full collection
    scans a few objects instead of hundreds of thousands."""
    gc.collect()
    gc.freeze()


def finalize(instance: int) -> str | None:
    with _loading.exclusive():
        served = _instances.pop(instance, None)
        try:
            if hasattr(served, "model") and hasattr(served.model, "finalize"):
                served.model.finalize()
            del served
            gc.unfreeze()  # the unloaded model's cycles become collectable again
            _freeze_long_lived()
        except Exception:
            return f"python_inprocess: finalize failed:\n{traceback.format_exc()}"
    return None


def execute(instance: int, requests_address: int, count: int, execution_address: int) -> None:
    """Run the model on the `count` requests at `requests_address` and put a reply per request into the
    `_Execution` at `execution_address`; backend.c sends them and releases the requests."""
    with _loading.shared():
        _execute(_instances[instance], requests_address, count, _Execution.from_address(execution_address))


def _execute(served: _Instance, requests_address: int, count: int, execution: _Execution) -> None:
    if served.cuda_device is not None and getattr(_thread, "cuda_device", None) != served.cuda_device:
        import torch

        torch.cuda.set_device(served.cuda_device)  # per thread: Triton calls execute from its own threads
        _thread.cuda_device = served.cuda_device
    requests = [pb_utils.InferenceRequest(handle) for handle in (c_void_p * count).from_address(requests_address)]
    execution.compute_start_ns = time.monotonic_ns()
    try:
        responses = served.model.execute(requests)
        if len(responses) != count:
            raise RuntimeError(f"execute returned {len(responses)} responses for {count} requests")
    except Exception as e:
        pb_utils.Logger.log_error(f"{served.name}: {traceback.format_exc()}")
        message = f"model '{served.name}': internal error ({type(e).__name__}); details are in the server log"
        responses = [
            pb_utils.InferenceResponse(error=pb_utils.TritonError(message, pb_utils.TritonError.INTERNAL))
        ] * count
    execution.compute_end_ns = time.monotonic_ns()
    for index, (request, response) in enumerate(zip(requests, responses)):
        built, reply = _build(served, request, response), execution.replies[index]
        if built is not None:
            reply.response, reply.error = built[0].value, built[1]
        reply.success = built is not None and not built[1] and not response.has_error()
    execution.complete = 1


def _build(served: _Instance, request, response):
    """`pb_utils.build_response`, or None (logged) if Triton refused to create the response."""
    try:
        return pb_utils.build_response(request, response)
    except Exception:
        pb_utils.Logger.log_error(f"{served.name}: creating a response failed: {traceback.format_exc()}")
        return None
