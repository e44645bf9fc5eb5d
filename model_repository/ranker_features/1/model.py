"""ranker_features: raw request → validated features (ikbo_backend.serving.FeatureModel)."""

import triton_python_backend_utils as pb_utils

from ikbo_backend.serving import FeatureModel, execute_requests


class TritonPythonModel:
    def initialize(self, args):
        self.model = FeatureModel.from_triton_args(args)  # config, weights, device, warm-up

    def execute(self, requests):
        return execute_requests(pb_utils, self.model, requests)
