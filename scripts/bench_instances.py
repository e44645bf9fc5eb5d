#!/usr/bin/env python3
"""Requests/s of N ranker instances in N threads of one process on one GPU, as python_inprocess runs
a model's instances: do they add up, or do they wait for each other's GIL?

Each thread owns a RankerModel (the served one-model ranker: CUDA graphs per shape bucket) on the
same GPU and calls it on a pool of seeded requests of one mix for --seconds per point. Replays go
through the CUDA runtime's calls (`--replay runtime`, what serves: one GIL release per request) or
torch's (`--replay torch`: `copy_`, `CUDAGraph.replay`, `Stream.synchronize`, each a release). Also
reported: voluntary context switches per request of the calling threads (/proc), the GIL's
hand-overs. docs/perf.md, 2026-12-01 11:05-11:37 UTC. `--device cpu` runs the same harness on the eager
CPU model (no graphs, so no replay path to compare: a check that the script works, in CI).

    .venv/bin/python scripts/bench_instances.py --profile large --threads 1 2 3 --replay runtime torch
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ikbo_backend import cuda_graphs
from ikbo_backend.ranker import PROFILES, load_weights
from ikbo_backend.requests import make_request
from ikbo_backend.serving import REPO_ROOT, RankerModel, ensure_weights, load_shape_ranges, weights_path

RUNTIME = cuda_graphs._cuda_runtime


def voluntary_switches() -> int:
    """This thread's voluntary context switches so far."""
    with open("/proc/thread-self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("voluntary_ctxt_switches"))


def point(models, pool, threads: int, seconds: float) -> tuple[float, float]:
    """(requests/s in all, voluntary context switches per request) of `threads` threads, one model each."""
    counts, switches = [0] * threads, [0] * threads
    ready = threading.Barrier(threads + 1)
    stop = [float("inf")]

    def work(k: int) -> None:
        if models[k].device.type == "cuda":
            torch.cuda.set_device(models[k].device)
        with torch.inference_mode():
            models[k](pool[k % len(pool)])  # this thread's first call outside the window
            ready.wait()
            start, n = voluntary_switches(), 0
            while time.perf_counter() < stop[0]:
                models[k](pool[(n + k) % len(pool)])
                n += 1
            counts[k], switches[k] = n, voluntary_switches() - start

    workers = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    ready.wait()  # every thread has made its first call
    begin = time.perf_counter()
    stop[0] = begin + seconds
    for w in workers:
        w.join()
    total = sum(counts)
    return total / (time.perf_counter() - begin), sum(switches) / max(total, 1)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="large", choices=sorted(PROFILES))
    parser.add_argument("--users", type=int, default=15)
    parser.add_argument("--candidates", type=int, default=1024)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--replay", nargs="+", choices=("runtime", "torch"), default=["runtime", "torch"])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", default="cuda:0")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("bench_instances.py: no CUDA GPU here (--device cpu checks the harness on the CPU model)")

    path = weights_path() if args.profile == "demo" else REPO_ROOT / "weights" / f"ranker_{args.profile}.safetensors"
    cfg, weights = load_weights(ensure_weights(path, args.profile))
    ranges = load_shape_ranges()
    models = []
    for _ in range(max(args.threads)):
        models.append(RankerModel(cfg, weights, ranges, args.device, compute_dtype="bfloat16", cuda_graphs="yes"))
        models[-1].warm_up()
    rng = np.random.default_rng(1)
    pool = [models[0].example(make_request(cfg, args.users, args.candidates, rng)) for _ in range(16)]
    with torch.inference_mode():  # both replay paths give the same scores
        for inputs in pool[:4]:
            cuda_graphs._cuda_runtime = lambda: None
            by_torch = models[0](inputs)["scores"]
            cuda_graphs._cuda_runtime = RUNTIME
            assert torch.equal(by_torch, models[0](inputs)["scores"])

    device = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "CPU (eager, no graphs)"
    print(
        f"{device}, torch {torch.__version__}, Python {sys.version.split()[0]}; profile {args.profile!r}, "
        f"bf16, {'CUDA graphs' if args.device.startswith('cuda') else 'eager'}, U={args.users} B={args.candidates} (make_request, seeded), {args.seconds:g} s per point\n"
    )
    print("| replay | threads | requests/s in all | × 1 thread | candidates/s | voluntary context switches / request |")
    print("|---|---:|---:|---:|---:|---:|")
    for round_ in range(1, args.rounds + 1):
        for replay in args.replay:
            cuda_graphs._cuda_runtime = RUNTIME if replay == "runtime" else (lambda: None)
            one = None
            for threads in args.threads:
                rate, switches = point(models, pool, threads, args.seconds)
                one = one or rate
                print(
                    f"| {replay} (round {round_}) | {threads} | {rate:,.0f} | {rate / one:.2f} | {rate * args.candidates:,.0f} | {switches:.1f} |",
                    flush=True,
                )
    cuda_graphs._cuda_runtime = RUNTIME


if __name__ == "__main__":
    main()
