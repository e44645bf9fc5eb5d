#!/usr/bin/env python3
"""Training throughput, IKBO against baseline side by side in one run: candidates trained per second and (CUDA)
peak memory per step, at one or more U:B mixes (ikbo_backend.perf.train_bench).

Default mixes: 15:1024 and the sweep B/U ∈ {1, 16, 70, 256} at B = 1024 (1024:1024, 64:1024, 15:1024, 4:1024).

    python scripts/bench_train.py                                   # CPU, demo profile, fp32
    python scripts/bench_train.py --device cuda --profile large     # bf16 autocast, 8 requests per step
    python scripts/bench_train.py --device cuda --profile large --mixes 15:1024 --breakdown

With --out DIR: DIR/bench_train_<profile>_<device>.md (the environment line and the table) and .json.
"""

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import torch

from ikbo_backend.paths import REPO_ROOT
from ikbo_backend.perf.machine import environment, package_version
from ikbo_backend.perf.train_bench import bench_mix, parse_mix, sweep_mixes, table
from ikbo_backend.ranker import PROFILES
from ikbo_backend.training import DTYPES


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--profile", default="demo", choices=sorted(PROFILES), help="model dims")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="autocast (default: bf16 on cuda)")
    parser.add_argument("--mixes", nargs="+", default=None, help="U:B per request (default: the sweep)")
    parser.add_argument(
        "--requests-per-step", type=int, default=None, help="requests concatenated per step (default: 8 cuda, 2 cpu)"
    )
    parser.add_argument("--steps", type=int, default=None, help="timed steps per variant (default: 40 cuda, 10 cpu)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first")
    parser.add_argument("--block", type=int, default=5, help="steps per timed block")
    parser.add_argument("--pool", type=int, default=4, help="distinct batches cycled through")
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--breakdown", action="store_true", help="top ops of one step per variant, to stderr")
    parser.add_argument("--out", type=Path, default=None, help="write the table (.md) and results (.json) here")
    args = parser.parse_args(argv)
    try:
        args.device = torch.device(args.device)
        for mix in args.mixes or []:
            parse_mix(mix)
    except (RuntimeError, ValueError) as error:
        parser.error(str(error))
    if args.device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch sees no CUDA device")
    on_gpu = args.device.type == "cuda"
    args.dtype = DTYPES[args.dtype or ("bfloat16" if on_gpu else "float32")]
    if args.requests_per_step is None:
        args.requests_per_step = 8 if on_gpu else 2
    if args.steps is None:
        args.steps = 40 if on_gpu else 10
    for name in ("requests_per_step", "steps", "warmup", "block", "pool"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            parser.error(f"--{name.replace('_', '-')}: expected a positive integer, got {getattr(args, name)}")
    return args


def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True)
        return out.stdout.strip() or "?"
    except OSError:
        return "?"


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    mixes = args.mixes or list(dict.fromkeys(["15:1024", *sweep_mixes()]))
    cfg, on_gpu = PROFILES[args.profile], args.device.type == "cuda"
    header = (
        f"# Training throughput: {args.profile} profile, {str(args.dtype).replace('torch.', '')}, "
        f"{args.requests_per_step} requests per step\n\n{environment()}, triton {package_version('triton')}, "
        f"commit {commit()}\n\n`python3 scripts/bench_train.py {' '.join(sys.argv[1:])}`\n"
    )
    print(header, flush=True)
    results = {}
    for mix in mixes:
        results[mix] = bench_mix(
            cfg, mix, args.requests_per_step, args.device, args.dtype, args.backend,
            args.steps, args.warmup, args.block, args.pool, breakdown=args.breakdown,
        )  # fmt: skip
        ikbo, base = results[mix]["ikbo"], results[mix]["baseline"]
        print(f"{mix}: IKBO {ikbo.ms_per_step:.2f} ms/step, baseline {base.ms_per_step:.2f} ms/step", flush=True)
        if on_gpu:
            torch.cuda.empty_cache()
    report = header + "\n" + table(results, args.requests_per_step, on_gpu) + "\n"
    print("\n" + report)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = args.out / f"bench_train_{args.profile}_{args.device.type}"
        stem.with_suffix(".md").write_text(report)
        raw = {mix: {name: dataclasses.asdict(m) for name, m in r.items()} for mix, r in results.items()}
        stem.with_suffix(".json").write_text(json.dumps(raw, indent=1))


if __name__ == "__main__":
    main()
