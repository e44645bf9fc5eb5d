"""ikbo_ranker in the GPU configs (configs/gpu.pbtxt, configs/large.pbtxt): ONE python model, raw request →
scores (ikbo_backend.serving.RankerModel, variant from config). The CPU layout (config.pbtxt) is an
ensemble of ranker_features and ikbo_interaction and does not load this file."""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo root: the stub ignores PYTHONPATH

import triton_python_backend_utils as pb_utils  # noqa: E402

from ikbo_backend.metrics import RankerMetrics, replicated_row_bytes  # noqa: E402
from ikbo_backend.serving import RankerModel, execute_requests  # noqa: E402
from ikbo_backend.shape_spec import CompileCounter  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        compilations = CompileCounter.install()  # Triton compilations: warm-up, then requests (must stay 0)
        self.model = RankerModel.from_triton_args(args)  # config, weights, device, warm-up, graphs
        compilations.phase = "request"
        if self.model.variant == "transformed":
            pb_utils.Logger.log_info(str(self.model.interaction.report))
        ikbo = self.model.variant == "ikbo"
        row_bytes = replicated_row_bytes(self.model.cfg)
        self.metrics = RankerMetrics(pb_utils, args["model_name"], row_bytes, compilations, self.model.device) if ikbo else None

    def execute(self, requests):
        start = time.perf_counter()
        responses = execute_requests(pb_utils, self.model, requests)
        if self.metrics is not None:
            self.metrics.record_responses(pb_utils, requests, responses, users_input="user_dense", candidates_input="cand_dense")
            self.metrics.record_execute(time.perf_counter() - start)
        return responses
