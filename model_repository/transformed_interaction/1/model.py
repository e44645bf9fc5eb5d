"""transformed_interaction: features → scores with BaselineRanker's code after the IKBO transformation
(ikbo_backend.serving.InteractionModel, variant "transformed"); the pass's report goes to the log."""

import triton_python_backend_utils as pb_utils

from ikbo_backend.serving import InteractionModel, execute_requests


class TritonPythonModel:
    def initialize(self, args):
        self.model = InteractionModel.from_triton_args(args)  # config, weights, device, the pass, warm-up
        pb_utils.Logger.log_info(str(self.model.interaction.report))

    def execute(self, requests):
        return execute_requests(pb_utils, self.model, requests)
