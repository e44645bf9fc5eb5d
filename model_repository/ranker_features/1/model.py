"""ranker_features: raw request → validated features (stages.FeatureModel).
Role "features" of ikbo_backend.python_model."""

import triton_python_backend_utils as pb_utils

from ikbo_backend.python_model import triton_python_model

TritonPythonModel = triton_python_model(pb_utils, "features")
