"""baseline_interaction: features → scores (ikbo_backend.serving.InteractionModel, variant from config)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo root: the stub ignores PYTHONPATH

import triton_python_backend_utils as pb_utils  # noqa: E402

from ikbo_backend.serving import InteractionModel, execute_requests  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        self.model = InteractionModel.from_triton_args(args)  # config, weights, device, warm-up

    def execute(self, requests):
        return execute_requests(pb_utils, self.model, requests)
