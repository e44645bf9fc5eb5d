"""In-process CPU cost of the online endpoints' batch-invariant mode: `OnlineModel.__call__` with
torch's kernels as they come (`default`, the reference) and with `batch_invariant` (`invariant`:
fixed-size GEMM row chunks; ikbo_backend/batch_invariant.py), alternating call by call.

Each (U, B) shape is the batch the online backend runs for U coalesced one-user requests of B/U
candidates on average (`make_online_batch` → `split_by_user` → `coalesce`).
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from ..online import coalesce, split_by_user, unbatch
from ..paths import ensure_weights, load_shape_ranges, weights_path
from ..ranker import load_weights
from ..stages import OnlineModel
from ..synthetic import make_online_batch, to_tensors

VARIANTS = ("ikbo", "baseline")
PROVIDERS = ("default", "invariant")  # default first: the reference of the ratio
MODE = {"default": "no", "invariant": "yes"}  # provider → the online models' batch_invariant parameter


def online_batch(cfg, num_users: int, num_candidates: int, rng) -> dict[str, torch.Tensor]:
    """The batch `execute_online` builds from U concurrent one-user requests."""
    online = split_by_user(make_online_batch(cfg, num_users, num_candidates, rng))
    served = [to_tensors({k: v.reshape(1) if k == "user_history_len" else v for k, v in one.items()}) for one in online]
    return coalesce([unbatch(one) for one in served])


def bench(models: dict, batches: list, runs: int, warmup: int) -> dict[str, float]:
    """Median ms per provider; the providers alternate call by call over the batch pool."""
    times = {name: [] for name in models}
    with torch.inference_mode():
        for step in range(warmup + runs):
            for name in models if step % 2 else reversed(models):
                start = time.perf_counter()
                models[name](batches[step % len(batches)])
                if step >= warmup:
                    times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def rows(shapes, runs: int, pool: int, warmup: int, seed: int):
    """Yields one markdown row per (shape, variant): default and invariant ms and their ratio."""
    cfg, weights = load_weights(ensure_weights(weights_path()))  # the weights the server loads
    ranges = load_shape_ranges()
    for num_users, num_candidates in shapes:
        rng = np.random.default_rng([seed, num_users, num_candidates])
        batches = [online_batch(cfg, num_users, num_candidates, rng) for _ in range(pool)]
        for variant in VARIANTS:
            models = {
                name: OnlineModel(cfg, weights, ranges, variant=variant, batch_invariant=MODE[name])
                for name in PROVIDERS
            }
            medians = bench(models, batches, runs, warmup)
            default, invariant = medians["default"], medians["invariant"]
            yield (
                f"| {variant} | {num_users}:{num_candidates} | {default:.2f} | {invariant:.2f} "
                f"| **{invariant / default:.2f}×** |"
            )
