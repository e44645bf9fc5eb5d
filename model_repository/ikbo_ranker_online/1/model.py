"""ikbo_ranker_online: one user per request, batched by Triton (stages.OnlineModel), with the IKBO metrics.
Role "online" of ikbo_backend.python_model; the variant comes from the config."""

import triton_python_backend_utils as pb_utils

from ikbo_backend.python_model import triton_python_model

TritonPythonModel = triton_python_model(pb_utils, "online")
