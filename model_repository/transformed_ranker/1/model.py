"""transformed_ranker in the GPU configs (configs/gpu.pbtxt, configs/large.pbtxt): ONE python model, raw request →
scores (ikbo_backend.serving.ranker_python_model). The CPU layout (config.pbtxt) is an ensemble of
ranker_features and transformed_interaction and does not load this file."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo root: the stub ignores PYTHONPATH

import triton_python_backend_utils as pb_utils  # noqa: E402

from ikbo_backend.serving import ranker_python_model  # noqa: E402

TritonPythonModel = ranker_python_model(pb_utils)
