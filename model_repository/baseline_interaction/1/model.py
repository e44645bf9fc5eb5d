"""baseline_interaction: features → scores (stages.InteractionModel).
Role "interaction" of ikbo_backend.python_model; the variant comes from the config."""

import triton_python_backend_utils as pb_utils

from ikbo_backend.python_model import triton_python_model

TritonPythonModel = triton_python_model(pb_utils, "interaction")
