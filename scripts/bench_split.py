#!/usr/bin/env python3
"""What splitting one ranking request across R replicas costs (docs/scale-out.md), in process.

One request of U users and B candidates (ikbo_backend.requests.make_request) is scored by the IKBO
ranker (features + interaction) whole, and split into R parts the way a load balancer could:
- by candidate: R equal slices of the candidate list; every part carries the users its candidates
  belong to, so a user's RO work (history self-attention, user tokens, MLP user part) is redone
  in every part that holds one of its candidates;
- by user: R groups of users, each with all of its candidates (user affinity); no RO row twice.
Reports the user rows computed, B/U of each part, and the summed time of the parts (the fleet's
compute for that request; best of --rounds interleaved rounds, the machine may be shared).

    python scripts/bench_split.py                       # CPU, 15:1024, R = 2 and 4
    python scripts/bench_split.py --device cuda --replicas 2 4 8
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ikbo_backend.ranker import RankerConfig, build_ranker, make_demo_weights
from ikbo_backend.requests import make_request, to_tensors


def take(request: dict[str, np.ndarray], candidates: np.ndarray, users: np.ndarray) -> dict[str, np.ndarray]:
    """The sub-request of these candidates and users (every candidate's user among `users`)."""
    position = np.full(len(request["user_dense"]), -1)
    position[users] = np.arange(len(users))
    part = {name: array[users] for name, array in request.items() if name.startswith("user_")}
    part.update(cand_dense=request["cand_dense"][candidates], cand_sparse_ids=request["cand_sparse_ids"][candidates])
    part["cand_to_user"] = position[request["cand_to_user"][candidates]].astype(np.int32)
    return part


def split_by_candidate(request, replicas: int) -> list[dict[str, np.ndarray]]:
    chunks = np.array_split(np.arange(len(request["cand_to_user"])), replicas)
    return [take(request, chunk, np.unique(request["cand_to_user"][chunk])) for chunk in chunks]


def split_by_user(request, replicas: int) -> list[dict[str, np.ndarray]]:
    groups = np.array_split(np.arange(len(request["user_dense"])), replicas)
    return [take(request, np.flatnonzero(np.isin(request["cand_to_user"], group)), group) for group in groups]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--users", type=int, default=15)
    parser.add_argument("--candidates", type=int, default=1024)
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=60)
    args = parser.parse_args()
    cfg, device = RankerConfig(), torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    features, interaction = build_ranker("ikbo", cfg, make_demo_weights(cfg), device)
    request = make_request(cfg, args.users, args.candidates, np.random.default_rng(0))
    cases = {"whole": [request]}
    for r in args.replicas:
        cases[f"R={r} by candidate"] = split_by_candidate(request, r)
        cases[f"R={r} by user"] = split_by_user(request, r)
    inputs = {name: [to_tensors(part, device) for part in parts] for name, parts in cases.items()}

    @torch.inference_mode()
    def run(parts) -> float:
        start = time.perf_counter()
        for part in parts:
            interaction(features(**part))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    best = {name: min(run(parts) for _ in range(2)) for name, parts in inputs.items()}  # warm-up
    for _ in range(args.rounds):
        for name, parts in inputs.items():
            best[name] = min(best[name], run(parts))
    where = f"{device} (torch {torch.__version__}, {torch.get_num_threads()} threads)"
    print(f"{args.users}:{args.candidates} on {where}, best of {args.rounds} rounds\n")
    print("| split | user rows | B/U per part | summed ms | vs whole |\n|---|---:|---|---:|---:|")
    for name, parts in cases.items():
        rows = sum(len(p["user_dense"]) for p in parts)
        ratios = ", ".join(f"{len(p['cand_to_user']) / max(len(p['user_dense']), 1):.1f}" for p in parts)
        print(f"| {name} | {rows} | {ratios} | {best[name] * 1e3:.2f} | {best[name] / best['whole']:.2f}× |")


if __name__ == "__main__":
    main()
