#!/usr/bin/env python3
"""The zoo of standard ranking models against what `to_ikbo` serves for them, side by side in one run.

Per model: served fully / partly / kept (the original: the rewrite was not faster), the user tensors
still replicated, ms a call of the original and of the served module (fastest round), their speed
ratio (median of paired rounds), the pass's own measurement at load, and the relative error on a fresh
request (ikbo_backend.transform.bench).

    python scripts/bench_transform.py --threads 1                       # CPU, 15:1024, fp32, small dims
    python scripts/bench_transform.py --device cuda --dtype bfloat16 --cuda-graphs
    python scripts/bench_transform.py --models din dien bst target_mha sim hstu --dims large --device cuda \
        --dtype bfloat16 --cuda-graphs                                  # production-like sizes (zoo.DIMS)
"""

import argparse

import torch

from ikbo_backend.perf.machine import environment
from ikbo_backend.transform import bench, zoo


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(zoo.MODELS), choices=list(zoo.MODELS))
    parser.add_argument("--users", type=int, default=15)
    parser.add_argument("--candidates", type=int, default=1024)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--rounds", type=int, default=20, help="timed calls of each, alternating")
    parser.add_argument("--cuda-graphs", action="store_true", help="replay each call from a CUDA graph")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dims", default="small", choices=list(zoo.DIMS), help="the zoo's sizes (zoo.DIMS)")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = bench.run(
        args.models, args.users, args.candidates, args.device, getattr(torch, args.dtype), args.rounds,
        args.cuda_graphs, args.seed, args.dims,
    )  # fmt: skip
    graphs = ", CUDA graphs" if args.cuda_graphs and args.device.startswith("cuda") else ""
    d = zoo.DIMS[args.dims]
    print(
        f"U:B = {args.users}:{args.candidates}, {args.dtype}, threads {torch.get_num_threads()}{graphs}; "
        f"dims {args.dims} (emb {d.emb}, heads {d.heads}, history {d.history}, long history {d.long_history}, "
        f"top-k {d.topk}, hidden {d.hidden}, item vocab {d.item_vocab}); {environment()}"
    )
    print(bench.table(rows))


if __name__ == "__main__":
    main()
