#!/usr/bin/env python3
"""Send one random ranking request to a running tritonserver and print the scores.

.venv/bin/python scripts/client.py --url localhost:8000 --protocol http
.venv/bin/python scripts/client.py --url localhost:8001 --protocol grpc --model baseline_ranker --users 64 --candidates 64
.venv/bin/python scripts/client.py --url localhost:8000 --model ikbo_ranker_online   # U concurrent one-user requests
"""

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ikbo_backend.client import client_module, infer_scores
from ikbo_backend.online import merge_scores, split_by_user
from ikbo_backend.ranker import PROFILES
from ikbo_backend.synthetic import make_online_batch, make_request


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="localhost:8000", help="host:port (HTTP 8000, gRPC 8001 by default)")
    parser.add_argument("--protocol", choices=("http", "grpc"), default="http")
    parser.add_argument("--model", default="ikbo_ranker", help="ikbo_ranker, baseline_ranker, or an *_online model")
    parser.add_argument("--users", type=int, default=15, help="U")
    parser.add_argument("--candidates", type=int, default=1024, help="B")
    parser.add_argument("--seed", type=int, default=None, help="request seed (default: random)")
    parser.add_argument("--rows", type=int, default=5, help="score rows to print")
    parser.add_argument(
        "--profile",
        default="demo",
        choices=sorted(PROFILES),
        help="model dims the server was started with (large: --config large)",
    )
    args = parser.parse_args()

    module = client_module(args.protocol)
    online = args.model.endswith("_online")
    make = make_online_batch if online else make_request
    request = make(PROFILES[args.profile], args.users, args.candidates, np.random.default_rng(args.seed))
    client = (
        module.InferenceServerClient(args.url, concurrency=args.users)
        if online and args.protocol == "http"
        else module.InferenceServerClient(args.url)
    )
    try:
        start = time.perf_counter()
        if online:  # one request per user, sent together so the server's batcher can coalesce them
            with ThreadPoolExecutor(args.users) as pool:
                answers = list(pool.map(lambda r: infer_scores(client, module, args.model, r), split_by_user(request)))
            scores = merge_scores(request, answers)
        else:
            scores = infer_scores(client, module, args.model, request)
        elapsed_ms = (time.perf_counter() - start) * 1e3
    finally:
        client.close()
    print(
        f"{args.model} over {args.protocol} at {args.url}: U={args.users}, B={args.candidates} → scores {list(scores.shape)} in {elapsed_ms:.1f} ms"
    )
    np.set_printoptions(precision=4, suppress=True)
    for b in range(min(args.rows, len(scores))):
        print(f"  candidate {b} (user {request['cand_to_user'][b]}): {scores[b]}")


if __name__ == "__main__":
    main()
