#!/usr/bin/env python3
"""In-process benchmark of the ranker (CPU or GPU): IKBO vs baseline, side by side in one run.

Median ms per request of the feature stage, the interaction and the whole forward, ratio
baseline/ikbo, candidates/s (ikbo_backend.perf.model_bench), on the weights the server loads for
--profile (created if missing).

    python scripts/bench_model.py                              # default mixes
    python scripts/bench_model.py --mixes u15_b1024 --runs 200 --append out/bench_model.md
    python scripts/bench_model.py --device cuda --profile large --dtype bfloat16 --profile-kernels
    python scripts/bench_model.py --device cuda --profile large --dtype bfloat16 --cuda-graphs

`--cuda-graphs` runs every provider's interaction as the served GPU configs do
(ikbo_backend/cuda_graphs.py): the request copied into its shape bucket's static inputs, one graph
replay, the scores copied out; each mix's bucket is captured before its timing.
"""

import argparse
import sys
from pathlib import Path

import torch

from ikbo_backend.perf.inputs import mix_shape
from ikbo_backend.perf.machine import environment
from ikbo_backend.perf.model_bench import DEFAULT_MIXES, PROVIDERS, bench_mix, served_models, table
from ikbo_backend.ranker import PROFILES
from ikbo_backend.variants import COMPUTE_DTYPES


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mixes", nargs="+", default=list(DEFAULT_MIXES))
    parser.add_argument("--runs", type=int, default=100, help="timed calls per provider and stage")
    parser.add_argument("--pool", type=int, default=8, help="distinct fixed requests per mix")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--append", type=Path, default=None, help="append the section to this markdown file")
    parser.add_argument(
        "--profile", default="demo", choices=sorted(PROFILES), help="model dims (weights/ranker_<profile>.safetensors)"
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    parser.add_argument(
        "--dtype", default="float32", choices=sorted(COMPUTE_DTYPES), help="compute dtype of the interaction"
    )
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=list(PROVIDERS) + ["transformed"])
    parser.add_argument("--backend", default=None, help="kernel backend (default: torch on a CPU, auto on a GPU)")
    parser.add_argument(
        "--profile-kernels", action="store_true", help="also the kernel-time sum of one interaction call (GPU)"
    )
    parser.add_argument(
        "--cuda-graphs", action="store_true", help="interactions replayed from CUDA graphs per shape bucket, as served"
    )
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    for mix in args.mixes:
        mix_shape(mix)  # fail early on an unknown name
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), COMPUTE_DTYPES[args.dtype]
    backend = args.backend or ("torch" if device.type == "cpu" else "auto")
    cfg, models = served_models(args.profile, args.providers, device, dtype, backend, args.cuda_graphs)
    kernels = args.profile_kernels and device.type == "cuda"
    results = {}
    for mix in args.mixes:
        results[mix] = bench_mix(cfg, models, mix, args.runs, args.pool, args.warmup, args.seed, device, kernels)
        whole = {name: results[mix][name, "whole"] for name in PROVIDERS}
        print(f"{mix}: whole baseline {whole['baseline']:.2f} ms, ikbo {whole['ikbo']:.2f} ms", file=sys.stderr)

    graphs = " replayed from CUDA graphs" if args.cuda_graphs else ""
    section = (
        "### Model forward, in process (`scripts/bench_model.py`)\n\n"
        f"{environment()}. Served weights, D={cfg.embedding_dim} L={cfg.history_length} N={cfg.compressed_tokens} "
        f"S={cfg.query_tokens} H={cfg.heads} MLP {'-'.join(map(str, cfg.mlp_hidden))} T={cfg.tasks} "
        f"(profile {args.profile!r}), {args.dtype} interaction on {device}{graphs}, kernels backend {backend!r}, "
        f"`torch.inference_mode`, {args.pool} fixed seeded requests per mix from `make_request`.\n\n"
        f"{table(results, args.runs)}\n"
    )
    print(section)
    if args.append:
        with args.append.open("a") as f:
            f.write("\n" + section)


if __name__ == "__main__":
    main()
