#!/usr/bin/env python3
"""In-process CPU cost of the online endpoints' batch-invariant mode, side by side in one run.

Providers per variant (ikbo, baseline): `default` (torch's kernels as they come; marked as the
baseline) and `invariant` (`batch_invariant`: fixed-size GEMM row chunks, sigmoid in the vectorized
body only; ikbo_backend/batch_invariant.py). Each (U, B) shape is the batch the online backend runs
for U coalesced one-user requests of B/U candidates on average (`make_online_batch` →
`split_by_user` → `coalesce`: the mapping from request boundaries). Timed: `OnlineModel.__call__`
(feature stage + interaction) under `torch.inference_mode`, the providers alternating call by call
over a pool of fixed seeded batches. Reported: median ms per batch and the ratio invariant/default.

    python scripts/bench_batch_invariant.py                     # 15×1020 (68 candidates a user), 64×4096
    python scripts/bench_batch_invariant.py --shapes 1x68 --runs 200
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_model import environment

from ikbo_backend.online import OnlineModel, coalesce, make_online_batch, split_by_user, unbatch
from ikbo_backend.ranker import load_weights
from ikbo_backend.requests import to_tensors
from ikbo_backend.serving import ensure_weights, load_shape_ranges, weights_path

VARIANTS = ("ikbo", "baseline")
PROVIDERS = ("default", "invariant")  # default first: the reference of the ratio
MODE = {"default": "no", "invariant": "yes"}  # provider → the online models' batch_invariant parameter


def online_batch(cfg, num_users: int, num_candidates: int, rng) -> dict[str, torch.Tensor]:
    """The batch `execute_online` builds from U concurrent one-user requests."""
    online = split_by_user(make_online_batch(cfg, num_users, num_candidates, rng))
    served = [to_tensors({k: v.reshape(1) if k == "user_history_len" else v for k, v in one.items()}) for one in online]
    return coalesce([unbatch(one) for one in served])


def shape(text: str) -> tuple[int, int]:
    users, candidates = (int(x) for x in text.lower().split("x"))
    return users, candidates


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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shapes", nargs="+", type=shape, default=[(15, 1020), (64, 4096)], help="UxB: users (= requests) x candidates"
    )
    parser.add_argument("--runs", type=int, default=50, help="timed calls per provider and shape")
    parser.add_argument("--pool", type=int, default=4, help="distinct fixed batches per shape")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    cfg, weights = load_weights(ensure_weights(weights_path()))  # the weights the server loads
    ranges = load_shape_ranges()
    lines = ["| variant | U:B | default ms | invariant ms | invariant / default |", "|---|---|---:|---:|---:|"]
    for num_users, num_candidates in args.shapes:
        rng = np.random.default_rng([args.seed, num_users, num_candidates])
        batches = [online_batch(cfg, num_users, num_candidates, rng) for _ in range(args.pool)]
        for variant in VARIANTS:
            models = {
                name: OnlineModel(cfg, weights, ranges, variant=variant, batch_invariant=MODE[name])
                for name in PROVIDERS
            }
            medians = bench(models, batches, args.runs, args.warmup)
            default, invariant = medians["default"], medians["invariant"]
            row = f"| {variant} | {num_users}:{num_candidates} | {default:.2f} | {invariant:.2f} | **{invariant / default:.2f}×** |"
            lines.append(row)
            print(row, file=sys.stderr, flush=True)
    print(f"{environment()}; median of {args.runs} calls per cell, providers alternating.\n\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
