"""What the serving tests share: small model dims and a stand-in for triton_python_backend_utils
(`FAKE_PB_UTILS`: requests are dicts of torch tensors, responses SimpleNamespaces with `outputs` and
`error`, metrics record their values), so that ikbo_backend's python-backend side runs without a server."""

import dataclasses
import threading
from types import SimpleNamespace

from torch.utils.dlpack import from_dlpack, to_dlpack

from ikbo_backend.ranker import RankerConfig
from ikbo_backend.requests import ShapeRanges

SMALL = RankerConfig(
    user_vocab_size=50, cand_vocab_size=60, item_vocab_size=70, history_length=8, embedding_dim=16, mlp_hidden=(32,)
)
RANGES = ShapeRanges(users=(1, 8), candidates=(1, 40))
# Small dims, none of them equal to the U and B the tests draw, so row counts identify tensors.
ODD_DIMS = RankerConfig(
    user_dense_features=6, user_sparse_features=3, user_vocab_size=50, user_dense_tokens=2,
    cand_dense_features=9, cand_sparse_features=4, cand_vocab_size=70, cand_dense_tokens=1,
    item_vocab_size=90, history_length=12, embedding_dim=16, compressed_tokens=6, query_tokens=3,
    heads=2, mlp_hidden=(24, 20), tasks=3,
)  # fmt: skip


def odd_dims(**changes) -> RankerConfig:
    """ODD_DIMS with some fields changed."""
    return dataclasses.replace(ODD_DIMS, **changes)


class _Tensor:
    def __init__(self, name, tensor):
        self.name, self.tensor = name, tensor

    def to_dlpack(self):
        return to_dlpack(self.tensor)

    @classmethod
    def from_dlpack(cls, name, capsule):
        return cls(name, from_dlpack(capsule).clone())

    def shape(self):
        return list(self.tensor.shape)


class _Error:
    INVALID_ARG, INTERNAL = "INVALID_ARG", "INTERNAL"

    def __init__(self, message, code):
        self.message, self.code = message, code


class Metric:
    def __init__(self, family, labels, buckets=None):
        self.family, self.labels, self.buckets, self.values, self.threads = family, labels, buckets, [], set()

    def increment(self, value):
        self.values.append(value)
        self.threads.add(threading.current_thread().name)

    def observe(self, value):
        self.values.append(value)
        self.threads.add(threading.current_thread().name)


class MetricFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

    def __init__(self, name, description, kind):
        self.name, self.kind = name, kind

    def Metric(self, labels, buckets=None):
        return Metric(self, labels, buckets)


def _response(output_tensors=(), error=None):
    return SimpleNamespace(
        outputs={t.name: t.tensor for t in output_tensors}, error=error, has_error=lambda: error is not None
    )


FAKE_PB_UTILS = SimpleNamespace(
    Tensor=_Tensor,
    TritonError=_Error,
    InferenceResponse=_response,
    get_input_tensor_by_name=lambda request, name: _Tensor(name, request[name]) if name in request else None,
    Logger=SimpleNamespace(log_error=lambda message: None, log_info=lambda message: None),
    MetricFamily=MetricFamily,
)
