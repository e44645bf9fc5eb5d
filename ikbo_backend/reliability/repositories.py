"""The model-repository copies the rows serve: the rankers' models (one of them broken, on request) and
the online endpoints (with a REJECT queue policy, on request)."""

from __future__ import annotations

import contextlib
import re

from ..perf.repository_copy import repository_copy
from . import RANKERS, SERVED_STAGES
from .online import ONLINE_MODELS


@contextlib.contextmanager
def online_repository(max_queue_size: int | None = None):
    """A copy of the online endpoints; with `max_queue_size`, a REJECT queue policy of that size is
    added to their dynamic batcher (the shipped configs have none: docs/reliability.md)."""
    with repository_copy(ONLINE_MODELS, "online-repo-") as repo:
        for name in ONLINE_MODELS if max_queue_size is not None else ():
            config = repo / name / "config.pbtxt"
            policy = f"  default_queue_policy {{ max_queue_size: {max_queue_size} timeout_action: REJECT }}\n"
            text, n = re.subn(r"dynamic_batching \{\n", lambda m: m.group(0) + policy, config.read_text())
            if n != 1:
                raise ValueError(f"{config}: expected one dynamic_batching block, found {n}")
            config.write_text(text)
        yield repo


@contextlib.contextmanager
def rankers_repository(broken_model: str | None = None):
    """A copy of the models behind both rankers (no other model of model_repository/); with
    `broken_model`, that model's config declares a dim the weights do not have."""
    with repository_copy((*SERVED_STAGES, *RANKERS), "rankers-repo-") as repo:
        if broken_model:
            config = repo / broken_model / "config.pbtxt"
            text = config.read_text()
            config.write_text(text.replace("dims: [ -1, 7, 64 ]", "dims: [ -1, 7, 63 ]", 1))
        yield repo
