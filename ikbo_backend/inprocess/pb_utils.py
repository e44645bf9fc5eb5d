"""`triton_python_backend_utils` for models run by the in-process backend: the part of the python
backend's API that this project's model.py files use, on Triton's C API (triton_c.py) instead of the
stub's IPC. The driver puts this module into sys.modules under that name before loading a model.py.

- `get_input_tensor_by_name(request, name)` → `Tensor` over Triton's input buffer (no copy; valid
  until the request is released, after `execute` returns), or None.
- `Tensor(name, array)`, `Tensor.from_dlpack(name, capsule)`, `.to_dlpack()`, `.as_numpy()`,
  `.shape()`, `.name()`; host tensors only (outputs are copied into Triton's host buffer).
- `InferenceResponse(output_tensors=…, error=…)`, `TritonError(message, code)`, `Logger`,
  `MetricFamily(name, description, kind).Metric(labels=…, buckets=…)` with increment/set/observe:
  in-process calls, not IPC round trips.
- beyond the python backend's API: `IN_SERVER_PROCESS`, `loads_in_progress()` (other models share
  this process) and `Tensor.as_torch()`."""

from __future__ import annotations

import ctypes
import functools
import json
import threading
from contextlib import contextmanager
from ctypes import byref, c_char_p, c_double, c_int, c_int32, c_int64, c_uint32, c_uint64, c_void_p

import numpy as np
import torch
from torch.utils.dlpack import from_dlpack, to_dlpack

from .. import libc
from . import triton_c as C
from .triton_c import api

# Models here run inside tritonserver: metric updates are thread-safe C calls, so
# ikbo_backend.metrics makes them on a worker thread, off the request path.
IN_SERVER_PROCESS = True
_loads_in_progress = 0  # model instances loading now (`load_in_progress`)


@contextmanager
def load_in_progress():
    """Around the load of a model instance (driver.initialize; loads are exclusive): counted by
    `loads_in_progress`."""
    global _loads_in_progress
    _loads_in_progress += 1
    try:
        yield
    finally:
        _loads_in_progress -= 1


def loads_in_progress() -> int:
    """Model instances loading in this process now. All models on this backend share the process: a
    Triton compilation made during a load belongs to the loading model, not to the request path of
    those already loaded (ikbo_backend.compile_counter). Not in the python backend's API, where each
    instance has a process of its own."""
    return _loads_in_progress


class TritonError:
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, message: str, code: int = INTERNAL):
        self._message, self._code = message, code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code


class Tensor:
    """A named host tensor (torch inside)."""

    def __init__(self, name: str, value):
        self._name = name
        self._tensor = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(value))

    @classmethod
    def from_dlpack(cls, name: str, capsule) -> Tensor:
        return cls(name, from_dlpack(capsule))

    def name(self) -> str:
        return self._name

    def shape(self) -> list[int]:
        return list(self._tensor.shape)

    def to_dlpack(self):
        return to_dlpack(self._tensor)

    def as_torch(self) -> torch.Tensor:
        """The torch tensor itself (this backend only; the python backend's tensors have to_dlpack)."""
        return self._tensor

    def as_numpy(self) -> np.ndarray:
        return self._tensor.numpy()


class InferenceRequest:
    """One TRITONBACKEND_Request of an `execute` call."""

    def __init__(self, handle: int):
        self.handle = handle
        self.inputs: dict[str, Tensor | None] | None = (
            None  # all read at the first access (the metrics read some again)
        )

    def parameters(self) -> str:
        """The request's parameters as a JSON object string (the python backend's form)."""
        count, parameters = c_uint32(), {}
        api.TRITONBACKEND_RequestParameterCount(self.handle, byref(count))
        for index in range(count.value):
            key, kind, value = c_char_p(), c_int(), c_void_p()
            api.TRITONBACKEND_RequestParameter(self.handle, index, byref(key), byref(kind), byref(value))
            if kind.value == C.PARAMETER_STRING:
                parameters[key.value.decode()] = ctypes.cast(value, c_char_p).value.decode()
            elif kind.value == C.PARAMETER_INT:
                parameters[key.value.decode()] = ctypes.cast(value, ctypes.POINTER(c_int64)).contents.value
            elif kind.value == C.PARAMETER_BOOL:
                parameters[key.value.decode()] = ctypes.cast(value, ctypes.POINTER(ctypes.c_bool)).contents.value
            elif kind.value == C.PARAMETER_DOUBLE:
                parameters[key.value.decode()] = ctypes.cast(value, ctypes.POINTER(c_double)).contents.value
        return json.dumps(parameters)


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    """The request's input `name` as a host tensor over Triton's buffer (a copy only when Triton holds
    it in several buffers), or None if the request has no such input. Raises ValueError for an
    input in GPU memory (CUDA shared memory from the client) or of a type not served here.
    The first call of a request reads all its inputs at once (`_read_all_inputs`)."""
    if request.inputs is None:
        request.inputs = _read_all_inputs(request)
    if name not in request.inputs:
        request.inputs[name] = _read_input(request, name)
    return request.inputs[name]


class _NativeInput(ctypes.Structure):
    """backend.c's `ikbo_input`."""

    _fields_ = [
        ("name", c_char_p), ("data", c_void_p), ("byte_size", c_uint64), ("shape", c_int64 * 8),
        ("datatype", c_int32), ("dims", c_uint32), ("status", c_int32), ("reserved", c_int32),
    ]  # fmt: skip


_NATIVE_SLOTS = 16
_native_read_inputs = None  # backend.c's ikbo_read_inputs(request, slots, capacity) → input count, or -1


def set_native_reader(address: int) -> None:
    """Bind backend.c's `ikbo_read_inputs` (PYFUNCTYPE: it keeps the GIL, a short call)."""
    global _native_read_inputs
    _native_read_inputs = ctypes.PYFUNCTYPE(c_int64, c_void_p, ctypes.POINTER(_NativeInput), c_uint32)(address)


class _OutParameters(threading.local):
    """The C API's out-parameters of `_read_input` and the slots of `_read_all_inputs`, allocated once
    per thread."""

    def __init__(self):
        self.input, self.pointer = c_void_p(), c_void_p()
        self.datatype, self.memory = c_int(), c_int()
        self.shape, self.dims = ctypes.POINTER(c_int64)(), c_uint32()
        self.byte_size, self.buffers, self.size, self.memory_id = c_uint64(), c_uint32(), c_uint64(), c_int64()
        self.refs = {name: byref(getattr(self, name)) for name in vars(self).copy()}
        self.slots = (_NativeInput * _NATIVE_SLOTS)()


_out = _OutParameters()
# numpy dtype of the same width per served torch dtype (numpy has no bfloat16: its bits as uint16)
_NUMPY_VIEWS = {
    dtype: torch.empty(0, dtype=dtype).view(torch.uint16 if dtype == torch.bfloat16 else dtype).numpy().dtype
    for dtype in C.DTYPES.values()
}


def _raw_bytes(address: int | None, size: int) -> np.ndarray:
    """`size` bytes of host memory at `address` as a uint8 array, no copy (numpy's wrapping of a raw
    buffer is the cheapest: torch.frombuffer costs tens of µs more per request)."""
    return (
        np.frombuffer((ctypes.c_char * size).from_address(address), dtype=np.uint8) if size else np.empty(0, np.uint8)
    )


def _host_tensor(name: str, data: np.ndarray, dtype: torch.dtype, shape) -> Tensor:
    """The uint8 bytes `data` viewed as a `dtype` tensor of `shape` (bfloat16 through its uint16 bits).
    Only bfloat16 takes a torch `view`: like every torch op it releases the GIL, and a release hands
    it to another instance's thread (cuda_graphs._CudaRuntime says what that costs)."""
    tensor = torch.from_numpy(data.view(_NUMPY_VIEWS[dtype]).reshape(shape))
    return Tensor(name, tensor.view(dtype) if dtype == torch.bfloat16 else tensor)


def _read_all_inputs(request: InferenceRequest) -> dict[str, Tensor]:
    """{name: Tensor} of every input of the request that sits in one host buffer, through one C call
    (backend.c); an input it leaves out is read by `_read_input`, which copies it or names the problem."""
    if _native_read_inputs is None:
        return {}
    slots = _out.slots
    count = _native_read_inputs(request.handle, slots, _NATIVE_SLOTS)
    inputs = {}
    for index in range(min(count, _NATIVE_SLOTS)):
        slot = slots[index]
        dtype = C.DTYPES.get(slot.datatype)
        if slot.status == 0 and dtype is not None:
            name = slot.name.decode()
            inputs[name] = _host_tensor(name, _raw_bytes(slot.data, slot.byte_size), dtype, slot.shape[: slot.dims])
    return inputs


@functools.cache
def _input_api():
    """The per-input C calls as bare functions (errors checked inline), bound at the first request."""
    return tuple(
        api.raw(name)
        for name in ("TRITONBACKEND_RequestInput", "TRITONBACKEND_InputProperties", "TRITONBACKEND_InputBuffer")
    )


def _read_input(request: InferenceRequest, name: str) -> Tensor | None:
    """One input the per-call way (three C calls): None if the request has none; several buffers are
    copied into one."""
    out, ref = _out, _out.refs
    request_input, input_properties, input_buffer = _input_api()
    error = request_input(request.handle, name.encode(), ref["input"])
    if error:  # no such input
        api.TRITONSERVER_ErrorDelete(error)
        return None
    api.check(
        input_properties(out.input, None, ref["datatype"], ref["shape"], ref["dims"], ref["byte_size"], ref["buffers"])
    )
    dtype = C.DTYPES.get(out.datatype.value)
    if dtype is None:
        raise ValueError(f"input {name}: data type {out.datatype.value} is not served by this backend")
    parts = []
    for index in range(out.buffers.value):
        out.memory.value = C.MEMORY_CPU
        api.check(input_buffer(out.input, index, ref["pointer"], ref["size"], ref["memory"], ref["memory_id"]))
        if out.memory.value == C.MEMORY_GPU:
            raise ValueError(f"input {name}: arrived in GPU memory; this backend takes inputs in host memory")
        if out.size.value:
            parts.append((out.pointer.value, out.size.value))
    if len(parts) > 1:  # several buffers: one copy
        data = np.concatenate([_raw_bytes(*part) for part in parts])
    else:
        data = _raw_bytes(*parts[0]) if parts else _raw_bytes(None, 0)
    return _host_tensor(name, data, dtype, out.shape[: out.dims.value])


class InferenceResponse:
    def __init__(self, output_tensors=None, error: TritonError | None = None):
        self._outputs, self._error = list(output_tensors or []), error

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error


def build_response(request: InferenceRequest, response: InferenceResponse) -> tuple[c_void_p, int | None]:
    """Triton's response for `request`: its outputs copied into Triton's host buffers, or its error.
    → (response handle, TRITONSERVER_Error or None); backend.c sends it (driver.py)."""
    handle = c_void_p()
    api.TRITONBACKEND_ResponseNew(byref(handle), request.handle)
    error = None
    try:
        if response.has_error():
            error = api.TRITONSERVER_ErrorNew(response.error().code(), response.error().message().encode())
        for tensor in response.output_tensors():
            _write_output(handle, tensor)
    except Exception as e:
        error = api.TRITONSERVER_ErrorNew(C.ERROR_INTERNAL, f"output {getattr(tensor, '_name', '?')}: {e}".encode())
    return handle, error


def _write_output(response, tensor: Tensor) -> None:
    value = tensor._tensor
    if value.device.type != "cpu" or not value.is_contiguous():
        value = value.detach().contiguous().cpu()
    shape = (c_int64 * value.dim())(*value.shape)
    output, pointer, memory, memory_id = c_void_p(), c_void_p(), c_int(C.MEMORY_CPU), c_int64(0)
    api.TRITONBACKEND_ResponseOutput(
        response, byref(output), tensor.name().encode(), C.TRITON_DTYPES[value.dtype], shape, value.dim()
    )
    size = value.numel() * value.element_size()
    api.TRITONBACKEND_OutputBuffer(output, byref(pointer), size, byref(memory), byref(memory_id))
    if memory.value == C.MEMORY_GPU:
        raise RuntimeError("Triton gave a GPU output buffer; this backend writes host memory")
    if size:
        libc.memmove(pointer.value, value.data_ptr(), size)  # the GIL kept


class Logger:
    @staticmethod
    def log(message: str, level: int = C.LOG_INFO) -> None:
        api.TRITONSERVER_LogMessage(level, b"model.py", 0, str(message).encode(errors="replace"))

    @staticmethod
    def log_info(message: str) -> None:
        Logger.log(message, C.LOG_INFO)

    @staticmethod
    def log_warn(message: str) -> None:
        Logger.log(message, C.LOG_WARN)

    @staticmethod
    def log_error(message: str) -> None:
        Logger.log(message, C.LOG_ERROR)

    @staticmethod
    def log_verbose(message: str) -> None:
        Logger.log(message, C.LOG_VERBOSE)


class MetricFamily:
    COUNTER, GAUGE, HISTOGRAM = C.METRIC_COUNTER, C.METRIC_GAUGE, C.METRIC_HISTOGRAM

    def __init__(self, name: str, description: str, kind: int):
        self.kind, self.handle = kind, c_void_p()
        api.TRITONSERVER_MetricFamilyNew(byref(self.handle), kind, name.encode(), description.encode())

    def Metric(self, labels: dict[str, str] | None = None, buckets: list[float] | None = None) -> Metric:
        return Metric(self, labels or {}, buckets)

    def __del__(self):
        if self.handle:
            api.TRITONSERVER_MetricFamilyDelete(self.handle)


class Metric:
    def __init__(self, family: MetricFamily, labels: dict[str, str], buckets: list[float] | None):
        self.family, self.handle = family, c_void_p()  # the family must outlive its metrics
        parameters = [
            api.TRITONSERVER_ParameterNew(k.encode(), C.PARAMETER_STRING, c_char_p(str(v).encode()))
            for k, v in labels.items()
        ]
        arguments = c_void_p()
        try:
            if family.kind == MetricFamily.HISTOGRAM:
                if not buckets:
                    raise ValueError("a histogram metric needs buckets")
                api.TRITONSERVER_MetricArgsNew(byref(arguments))
                api.TRITONSERVER_MetricArgsSetHistogram(arguments, (c_double * len(buckets))(*buckets), len(buckets))
            label_array = (c_void_p * max(len(parameters), 1))(*parameters)
            api.TRITONSERVER_MetricNewWithArgs(
                byref(self.handle), family.handle, label_array, len(parameters), arguments
            )
        finally:
            for parameter in parameters:
                api.TRITONSERVER_ParameterDelete(parameter)
            if arguments:
                api.TRITONSERVER_MetricArgsDelete(arguments)

    def increment(self, value: float) -> None:
        api.TRITONSERVER_MetricIncrement(self.handle, float(value))

    def set(self, value: float) -> None:
        api.TRITONSERVER_MetricSet(self.handle, float(value))

    def observe(self, value: float) -> None:
        api.TRITONSERVER_MetricObserve(self.handle, float(value))

    def __del__(self):
        if self.handle:
            api.TRITONSERVER_MetricDelete(self.handle)
