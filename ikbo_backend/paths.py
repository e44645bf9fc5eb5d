"""Where the served files are: the model repository, its declared shape ranges, the weights.

- shape ranges: `model_repository/shape_ranges.json` ({"users": [lo, hi], "candidates": [lo, hi]},
  inclusive, and "typical": [[U, B], ...], the common request shapes, warmed up too). tritonserver
  ignores plain files at the repository root; the same numbers drive validation
  (`requests.validate_request`), warm-up (`stages.warmup_sizes`) and kernel precompilation
  (kernel_buckets.py, autotune.py).
- weights: the `weights` parameter of a model's config (relative paths from the root of this
  project), else `$IKBO_WEIGHTS`, else `<repo>/weights/ranker.safetensors`; a missing file is created
  with random weights (seed 0) of the config's `profile` parameter (ranker.PROFILES, default "demo").
  The RankerConfig travels in the safetensors metadata.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .ranker import make_demo_weights, profile_config, save_weights
from .requests import ShapeRanges

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL_REPOSITORY = REPO_ROOT / "model_repository"
SHAPE_RANGES_FILE = "shape_ranges.json"  # at the root of a model repository
DEFAULT_WEIGHTS = REPO_ROOT / "weights" / "ranker.safetensors"


def weights_path(parameter: str | None = None) -> Path:
    """The weights file: config parameter, else $IKBO_WEIGHTS, else weights/ranker.safetensors."""
    chosen = parameter or os.environ.get("IKBO_WEIGHTS") or DEFAULT_WEIGHTS
    return (REPO_ROOT / chosen).resolve()  # absolute paths stay as they are


def profile_weights_path(profile: str = "demo") -> Path:
    """The weights file the model repository's configs of `profile` load: `weights_path()` for "demo"
    (config.pbtxt, configs/gpu.pbtxt name none), weights/ranker_<profile>.safetensors otherwise (their
    `weights` parameter)."""
    return weights_path() if profile == "demo" else REPO_ROOT / "weights" / f"ranker_{profile}.safetensors"


def ensure_weights(path=None, profile: str = "demo") -> Path:
    """Create random weights (seed 0) of the named profile at `path` if the file is missing. Atomic
    (temp file, then rename), so models loading in parallel never read half a file."""
    path = Path(path) if path is not None else weights_path()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        os.close(fd)
        try:
            cfg = profile_config(profile)
            save_weights(tmp, cfg, make_demo_weights(cfg, seed=0))
            os.replace(tmp, path)
        finally:
            Path(tmp).unlink(missing_ok=True)
    return path


def load_shape_ranges(model_repository=None) -> ShapeRanges:
    """The declared U and B ranges of a model repository (default: this project's)."""
    return ShapeRanges.from_json(Path(model_repository or MODEL_REPOSITORY) / SHAPE_RANGES_FILE)
