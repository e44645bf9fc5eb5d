"""ikbo_ranker_online / baseline_ranker_online: one user per request, coalesced by the dynamic batcher
into one batch per execute (ikbo_backend.online; variant from config). IKBO: custom metrics."""

import triton_python_backend_utils as pb_utils

from ikbo_backend.compile_counter import CompileCounter
from ikbo_backend.metrics import RankerMetrics, replicated_row_bytes
from ikbo_backend.online import OnlineModel, execute_online


class TritonPythonModel:
    def initialize(self, args):
        compilations = CompileCounter.install()  # Triton compilations: warm-up, then requests (must stay 0)
        self.model = OnlineModel.from_triton_args(args)  # config, weights, device, warm-up
        compilations.phase = "request"
        ikbo = self.model.variant == "ikbo"
        row_bytes = replicated_row_bytes(self.model.cfg)
        self.metrics = (
            RankerMetrics(pb_utils, args["model_name"], row_bytes, compilations, self.model.device) if ikbo else None
        )

    def execute(self, requests):
        return execute_online(pb_utils, self.model, requests, self.metrics)

    def finalize(self):
        if self.metrics is not None:
            self.metrics.close()  # the queued metric updates, then its worker thread ends
