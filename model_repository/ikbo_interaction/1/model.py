"""ikbo_interaction: features → scores (ikbo_backend.serving.InteractionModel, variant from config),
with the custom IKBO metrics (ikbo_backend.metrics) of each answered batch."""

import time

import triton_python_backend_utils as pb_utils

from ikbo_backend.compile_counter import CompileCounter
from ikbo_backend.metrics import RankerMetrics, replicated_row_bytes
from ikbo_backend.serving import InteractionModel, execute_requests


class TritonPythonModel:
    def initialize(self, args):
        compilations = CompileCounter.install()  # Triton compilations: warm-up, then requests (must stay 0)
        self.model = InteractionModel.from_triton_args(args)  # config, weights, device, warm-up
        compilations.phase = "request"
        self.metrics = RankerMetrics(
            pb_utils, args["model_name"], replicated_row_bytes(self.model.cfg), compilations, self.model.device
        )

    def execute(self, requests):
        start = time.perf_counter()
        responses = execute_requests(pb_utils, self.model, requests)
        self.metrics.record_responses(pb_utils, requests, responses)
        self.metrics.record_execute(time.perf_counter() - start)
        return responses

    def finalize(self):
        if self.metrics is not None:
            self.metrics.close()  # the queued metric updates, then its worker thread ends
