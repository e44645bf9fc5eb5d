"""transformed_interaction: features → scores with BaselineRanker's code after the IKBO transformation
(ikbo_backend.serving.InteractionModel, variant "transformed"); the pass's report goes to the log."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo root: the stub ignores PYTHONPATH

import triton_python_backend_utils as pb_utils  # noqa: E402

from ikbo_backend.serving import InteractionModel, execute_requests  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        self.model = InteractionModel.from_triton_args(args)  # config, weights, device, the pass, warm-up
        pb_utils.Logger.log_info(str(self.model.interaction.report))

    def execute(self, requests):
        return execute_requests(pb_utils, self.model, requests)
