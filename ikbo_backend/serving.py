"""Old import path of names that now live in paths.py, model_config.py, stages.py and python_model.py,
kept only for importers outside the backend's files (scripts, tritonserver.py, instance_groups.py,
other tests). Delete this module once their imports name the new homes."""

from .model_config import feature_dims, request_dims, score_dims  # noqa: F401
from .paths import MODEL_REPOSITORY, REPO_ROOT, ensure_weights, load_shape_ranges, weights_path  # noqa: F401
from .python_model import TEST_FAULT_PARAMETER, TEST_FAULTS_ENV  # noqa: F401
from .stages import FeatureModel, InteractionModel, RankerModel, warmup_sizes  # noqa: F401
