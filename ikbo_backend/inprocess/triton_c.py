"""Triton's C API (tritonserver.h, tritonbackend.h of server 2.51), called through ctypes from inside
tritonserver's process: the symbols are those of its libtritonserver.so, global in the process.

Only what the in-process backend uses is declared. Every function returning a TRITONSERVER_Error*
is wrapped so that a non-null error raises `TritonCError` with Triton's message (and is deleted).
Enum values are the headers' (declaration order, from 0)."""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_char_p, c_double, c_int, c_int32, c_int64, c_uint32, c_uint64, c_void_p

import torch

# TRITONSERVER_Error_Code
(
    ERROR_UNKNOWN,
    ERROR_INTERNAL,
    ERROR_NOT_FOUND,
    ERROR_INVALID_ARG,
    ERROR_UNAVAILABLE,
    ERROR_UNSUPPORTED,
    ERROR_ALREADY_EXISTS,
    ERROR_CANCELLED,
) = range(8)
# TRITONSERVER_MemoryType
MEMORY_CPU, MEMORY_CPU_PINNED, MEMORY_GPU = range(3)
# TRITONSERVER_InstanceGroupKind
INSTANCE_KINDS = ("AUTO", "CPU", "GPU", "MODEL")
# TRITONSERVER_LogLevel
LOG_INFO, LOG_WARN, LOG_ERROR, LOG_VERBOSE = range(4)
# TRITONSERVER_ParameterType
PARAMETER_STRING, PARAMETER_INT, PARAMETER_BOOL, PARAMETER_DOUBLE, PARAMETER_BYTES = range(5)
# TRITONSERVER_MetricKind
METRIC_COUNTER, METRIC_GAUGE, METRIC_HISTOGRAM = range(3)
# TRITONSERVER_DataType → torch dtype (BYTES and the unsigned types beyond uint8 are not served here)
DTYPES = {
    1: torch.bool,
    2: torch.uint8,
    6: torch.int8,
    7: torch.int16,
    8: torch.int32,
    9: torch.int64,
    10: torch.float16,
    11: torch.float32,
    12: torch.float64,
    14: torch.bfloat16,
}
TRITON_DTYPES = {dtype: code for code, dtype in DTYPES.items()}


class TritonCError(RuntimeError):
    """A TRITONSERVER_Error returned by the C API."""


_ERROR_API = (
    "TRITONSERVER_ErrorNew",
    "TRITONSERVER_ErrorDelete",
    "TRITONSERVER_ErrorMessage",
    "TRITONSERVER_ParameterNew",
    "TRITONSERVER_ParameterDelete",
)
_SIGNATURES = {  # name: argument types (all return TRITONSERVER_Error* but the _ERROR_API ones)
    "TRITONSERVER_ErrorNew": (c_int, c_char_p),
    "TRITONSERVER_ErrorDelete": (c_void_p,),
    "TRITONSERVER_ErrorMessage": (c_void_p,),
    "TRITONSERVER_MessageSerializeToJson": (c_void_p, POINTER(c_void_p), POINTER(c_uint64)),
    "TRITONSERVER_MessageDelete": (c_void_p,),
    "TRITONSERVER_LogMessage": (c_int, c_char_p, c_int, c_char_p),
    "TRITONSERVER_ParameterNew": (c_char_p, c_int, c_void_p),
    "TRITONSERVER_ParameterDelete": (c_void_p,),
    "TRITONSERVER_MetricFamilyNew": (POINTER(c_void_p), c_int, c_char_p, c_char_p),
    "TRITONSERVER_MetricFamilyDelete": (c_void_p,),
    "TRITONSERVER_MetricArgsNew": (POINTER(c_void_p),),
    "TRITONSERVER_MetricArgsSetHistogram": (c_void_p, POINTER(c_double), c_uint64),
    "TRITONSERVER_MetricArgsDelete": (c_void_p,),
    "TRITONSERVER_MetricNewWithArgs": (POINTER(c_void_p), c_void_p, POINTER(c_void_p), c_uint64, c_void_p),
    "TRITONSERVER_MetricDelete": (c_void_p,),
    "TRITONSERVER_MetricIncrement": (c_void_p, c_double),
    "TRITONSERVER_MetricSet": (c_void_p, c_double),
    "TRITONSERVER_MetricObserve": (c_void_p, c_double),
    "TRITONBACKEND_ModelInstanceModel": (c_void_p, POINTER(c_void_p)),
    "TRITONBACKEND_ModelInstanceName": (c_void_p, POINTER(c_char_p)),
    "TRITONBACKEND_ModelInstanceKind": (c_void_p, POINTER(c_int)),
    "TRITONBACKEND_ModelInstanceDeviceId": (c_void_p, POINTER(c_int32)),
    "TRITONBACKEND_ModelName": (c_void_p, POINTER(c_char_p)),
    "TRITONBACKEND_ModelVersion": (c_void_p, POINTER(c_uint64)),
    "TRITONBACKEND_ModelRepository": (c_void_p, POINTER(c_int), POINTER(c_char_p)),
    "TRITONBACKEND_ModelConfig": (c_void_p, c_uint32, POINTER(c_void_p)),
    "TRITONBACKEND_RequestInput": (c_void_p, c_char_p, POINTER(c_void_p)),
    "TRITONBACKEND_RequestParameterCount": (c_void_p, POINTER(c_uint32)),
    "TRITONBACKEND_RequestParameter": (c_void_p, c_uint32, POINTER(c_char_p), POINTER(c_int), POINTER(c_void_p)),
    "TRITONBACKEND_InputProperties": (
        c_void_p,
        POINTER(c_char_p),
        POINTER(c_int),
        POINTER(POINTER(c_int64)),
        POINTER(c_uint32),
        POINTER(c_uint64),
        POINTER(c_uint32),
    ),
    "TRITONBACKEND_InputBuffer": (
        c_void_p,
        c_uint32,
        POINTER(c_void_p),
        POINTER(c_uint64),
        POINTER(c_int),
        POINTER(c_int64),
    ),
    "TRITONBACKEND_ResponseNew": (POINTER(c_void_p), c_void_p),
    "TRITONBACKEND_ResponseOutput": (c_void_p, POINTER(c_void_p), c_char_p, c_int, POINTER(c_int64), c_uint32),
    "TRITONBACKEND_OutputBuffer": (c_void_p, POINTER(c_void_p), c_uint64, POINTER(c_int), POINTER(c_int64)),
}


class _CApi:
    """The functions above, bound on first use (so this module imports outside tritonserver too).
    Bound as PyDLL functions: each call keeps the GIL (they are short, non-blocking accessors), so
    a call neither pays for a GIL release and re-acquisition nor hands the GIL to another instance's
    thread in the middle of a request."""

    def raw(self, name: str):
        """The bare ctypes function: it returns the TRITONSERVER_Error* (an int, or None), for hot
        paths that pass it to `check` themselves (one Python frame less per call)."""
        function = getattr(ctypes.PyDLL(None), name)
        function.argtypes = _SIGNATURES[name]
        function.restype = {"TRITONSERVER_ErrorMessage": c_char_p, "TRITONSERVER_ErrorDelete": None}.get(name, c_void_p)
        return function

    def check(self, error) -> None:
        """Raise TritonCError with the message of a non-null TRITONSERVER_Error* (and delete it)."""
        if error:
            message = self.TRITONSERVER_ErrorMessage(error).decode(errors="replace")
            self.TRITONSERVER_ErrorDelete(error)
            raise TritonCError(message)

    def __getattr__(self, name: str):
        function = self.raw(name)
        if name in _ERROR_API:
            bound = function
        else:

            def bound(*args, _function=function):
                self.check(_function(*args))

        setattr(self, name, bound)
        return bound


api = _CApi()
