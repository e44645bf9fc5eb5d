"""Helpers shared by the model.py files of model_repository/ and the scripts: paths, weights, ranges."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL_REPOSITORY = REPO_ROOT / "model_repository"
