"""baseline_interaction: features → scores (ikbo_backend.serving.InteractionModel, variant from config)."""

import triton_python_backend_utils as pb_utils

from ikbo_backend.serving import InteractionModel, execute_requests


class TritonPythonModel:
    def initialize(self, args):
        self.model = InteractionModel.from_triton_args(args)  # config, weights, device, warm-up

    def execute(self, requests):
        return execute_requests(pb_utils, self.model, requests)
