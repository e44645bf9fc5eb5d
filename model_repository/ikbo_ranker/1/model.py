"""ikbo_ranker in the GPU configs (configs/gpu.pbtxt, configs/large.pbtxt): ONE python model, raw request →
scores (ikbo_backend.serving.ranker_python_model). The CPU layout (config.pbtxt) is an ensemble of
ranker_features and ikbo_interaction and does not load this file."""

import triton_python_backend_utils as pb_utils

from ikbo_backend.serving import ranker_python_model

TritonPythonModel = ranker_python_model(pb_utils)
