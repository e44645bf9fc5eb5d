"""baseline_ranker: raw request → scores in one model (stages.RankerModel).
GPU configs only: the CPU config.pbtxt is an ensemble of ranker_features and an interaction model.
Role "ranker" of ikbo_backend.python_model; the variant comes from the config."""

import triton_python_backend_utils as pb_utils

from ikbo_backend.python_model import triton_python_model

TritonPythonModel = triton_python_model(pb_utils, "ranker")
