#!/usr/bin/env python3
"""In-process benchmark of the ranker (CPU or GPU): IKBO vs baseline, side by side in one run.

Providers: `baseline` (user tensors replicated to B rows; marked as the baseline) and `ikbo` (and,
with --providers, `transformed`: the baseline's code after the IKBO pass), built by
`ikbo_backend.ranker.build_ranker` from the weights the server loads for --profile
(`serving.ensure_weights`: created if missing). On a GPU (--device cuda) every timed call ends with
a device synchronize (wall time of the request, launches included), and `--profile-kernels` adds
the sum of the kernel times of one call (torch.profiler): the gap between the two is host time,
the most CUDA graphs could remove. Stages: `feature` (lookups and dense
projections, shared code), `interaction` (where the variants differ) and `whole` (feature +
interaction). Each mix uses a pool of fixed, seeded requests from `make_request` (the tests'
generator: never zeros, ragged candidates per user); the timed calls cycle through the pool, each
provider running its stages as one block, the block order alternating, so both see the same machine
state. Reported: median ms per
request, ratio baseline/ikbo, candidates/s of the whole forward.

    python scripts/bench_model.py                              # default mixes
    python scripts/bench_model.py --mixes u15_b1024 --runs 200 --append docs/perf.md
    python scripts/bench_model.py --device cuda --profile large --dtype bfloat16 --profile-kernels
    python scripts/bench_model.py --device cuda --profile large --dtype bfloat16 --cuda-graphs

`--cuda-graphs` runs every provider's interaction as the served GPU configs do
(ikbo_backend/cuda_graphs.py): the request copied into its shape bucket's static inputs, one graph
replay, the scores copied out; each mix's bucket is captured before its timing.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ikbo_backend.cuda_graphs import GraphedInteraction
from ikbo_backend.perf.inputs import mix_shape
from ikbo_backend.ranker import COMPUTE_DTYPES, PROFILES, build_ranker, load_weights
from ikbo_backend.requests import make_request, to_tensors
from ikbo_backend.serving import REPO_ROOT, ensure_weights, load_shape_ranges, weights_path

PROVIDERS = ("baseline", "ikbo")  # baseline first: the reference of every ratio
AGREEMENT = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 2e-2}  # max |ikbo − baseline| / max |baseline|
STAGES = ("feature", "interaction", "whole")
DEFAULT_MIXES = ("u15_b1024", "u1_b1024", "u4_b256", "u64_b64", "u1_b64")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name() -> str:
    """The CPU model, and the GPU when torch sees one."""
    cpu = f"CPU {cpu_model()}"
    return f"GPU {torch.cuda.get_device_name(0)}, {cpu}" if torch.cuda.is_available() else cpu


def environment() -> str:
    return (
        f"{device_name()}, {os.cpu_count()} cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), Python {platform.python_version()}, "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}"
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_ms(fn, arg, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn(arg)
    _sync(device)
    return (time.perf_counter() - start) * 1e3


def kernel_ms(fn, arg, device: torch.device) -> float:
    """Sum of the device kernel times of one call (torch.profiler), in ms."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(arg)
        _sync(device)
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e3


def host_profile(fn, arg, device: torch.device, title: str, rows: int = 30) -> None:
    """Where the host time of one call goes (torch.profiler, CPU and CUDA), to stderr."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn(arg)
        _sync(device)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    print(f"\n## host profile: {title}\n{table}", file=sys.stderr)


def bench_mix(
    cfg,
    models,
    mix: str,
    runs: int,
    pool: int,
    warmup: int,
    seed: int,
    device=torch.device("cpu"),
    kernels: bool = False,
) -> dict:
    """Median ms per (provider, stage) over `runs` calls, cycling through `pool` fixed requests;
    with `kernels`, also (provider, "kernels"): the kernel-time sum of one interaction call."""
    num_users, num_candidates = mix_shape(mix)
    rng = np.random.default_rng([seed, num_users, num_candidates])
    requests = [to_tensors(make_request(cfg, num_users, num_candidates, rng), device) for _ in range(pool)]

    calls = {}
    for name, (features, interaction) in models.items():
        calls[name, "feature"] = lambda r, f=features: f(**r)
        calls[name, "interaction"] = lambda feats, i=interaction: i(feats)
        calls[name, "whole"] = lambda r, f=features, i=interaction: i(f(**r))
    # the interaction stage is timed on precomputed features (the feature stage is shared code)
    features_of = [models["baseline"][0](**r) for r in requests]

    times = {key: [] for key in calls}
    with torch.inference_mode():
        for name, (_, interaction) in models.items():
            if isinstance(interaction, GraphedInteraction):  # capture this mix's bucket first
                interaction.capture(*interaction.bucket(num_users, num_candidates), features_of[0])
        scores = {name: models[name][1](features_of[0]) for name in models}
        tolerance = AGREEMENT[getattr(models["ikbo"][1], "dtype", torch.float32)]
        for name in models:
            error = float((scores[name] - scores["baseline"]).abs().max() / scores["baseline"].abs().max())
            if not error <= tolerance:
                raise RuntimeError(
                    f"{mix}: {name} and baseline disagree (max relative error {error:.2e} > {tolerance})"
                )
        for step in range(warmup + runs):
            k = step % pool
            # each provider runs its stages as a block; the block order alternates, so every provider
            # follows itself half the time and the other half the time (symmetric cache/allocator state)
            for name in models if step % 2 else reversed(models):
                for stage in STAGES:
                    elapsed = _time_ms(
                        calls[name, stage], features_of[k] if stage == "interaction" else requests[k], device
                    )
                    if step >= warmup:
                        times[name, stage].append(elapsed)
        medians = {key: statistics.median(values) for key, values in times.items()}
        if kernels:
            for name in models:
                medians[name, "kernels"] = statistics.median(
                    kernel_ms(calls[name, "interaction"], features_of[k], device) for k in range(pool)
                )
            host_profile(calls["ikbo", "interaction"], features_of[0], device, f"{mix} ikbo interaction")
    return medians


def table(results: dict, runs: int) -> str:
    transformed = any(name == "transformed" for medians in results.values() for name, _ in medians)
    extra = " transformed ms | transformed / IKBO |" if transformed else ""
    lines = [
        f"| mix (U:B) | stage | baseline ms | IKBO ms | baseline / IKBO | IKBO candidates/s | baseline candidates/s |{extra}",
        "|---|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if transformed else ""),
    ]
    for mix, medians in results.items():
        num_users, num_candidates = mix_shape(mix)
        for stage in STAGES + ("kernels",):
            if ("ikbo", stage) not in medians:
                continue
            base, ikbo = medians["baseline", stage], medians["ikbo", stage]
            rate = lambda ms: f"{num_candidates / ms * 1e3:,.0f}"  # noqa: E731
            label = "interaction kernels (sum)" if stage == "kernels" else stage
            line = f"| {mix} ({num_users}:{num_candidates}) | {label} | {base:.3f} | {ikbo:.3f} | **{base / ikbo:.2f}×** | {rate(ikbo)} | {rate(base)} |"
            if transformed:
                moved = medians["transformed", stage]
                line += f" {moved:.3f} | {moved / ikbo:.2f}× |"
            lines.append(line)
    return "\n".join(lines) + f"\n\nMedian of {runs} calls per cell; ratio > 1 means IKBO is faster."


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mixes", nargs="+", default=list(DEFAULT_MIXES))
    parser.add_argument("--runs", type=int, default=100, help="timed calls per provider and stage")
    parser.add_argument("--pool", type=int, default=8, help="distinct fixed requests per mix")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--append", type=Path, default=None, help="append the section to this markdown file")
    parser.add_argument(
        "--profile",
        default="demo",
        choices=sorted(PROFILES),
        help="model dims (weights/ranker_<profile>.safetensors unless demo)",
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
    args = parser.parse_args(argv)
    for mix in args.mixes:
        mix_shape(mix)  # fail early on an unknown name
    if args.threads:
        torch.set_num_threads(args.threads)

    device, dtype = torch.device(args.device), COMPUTE_DTYPES[args.dtype]
    backend = args.backend or ("torch" if device.type == "cpu" else "auto")
    path = weights_path() if args.profile == "demo" else REPO_ROOT / "weights" / f"ranker_{args.profile}.safetensors"
    cfg, weights = load_weights(ensure_weights(path, args.profile))  # the weights the server loads (created if missing)
    providers = ["baseline", "ikbo"] + [p for p in args.providers if p not in PROVIDERS]
    models = {name: build_ranker(name, cfg, weights, device, backend=backend, dtype=dtype) for name in providers}
    if args.cuda_graphs:
        ranges = load_shape_ranges()
        models = {
            name: (f, GraphedInteraction(i, ranges, device, replay_eagerly=device.type != "cuda"))
            for name, (f, i) in models.items()
        }
    results = {}
    for mix in args.mixes:
        results[mix] = bench_mix(
            cfg,
            models,
            mix,
            args.runs,
            args.pool,
            args.warmup,
            args.seed,
            device,
            args.profile_kernels and device.type == "cuda",
        )
        print(
            f"{mix}: whole baseline {results[mix]['baseline', 'whole']:.2f} ms, ikbo {results[mix]['ikbo', 'whole']:.2f} ms",
            file=sys.stderr,
        )

    section = (
        "### Model forward, in process (`scripts/bench_model.py`)\n\n"
        f"{environment()}. Served weights, D={cfg.embedding_dim} L={cfg.history_length} N={cfg.compressed_tokens} "
        f"S={cfg.query_tokens} H={cfg.heads} MLP {'-'.join(map(str, cfg.mlp_hidden))} T={cfg.tasks} (profile {args.profile!r}), "
        f"{args.dtype} interaction on {device}{' replayed from CUDA graphs' if args.cuda_graphs else ''}, kernels backend {backend!r}, "
        f"`torch.inference_mode`, {args.pool} fixed seeded requests per mix from `make_request`.\n\n"
        f"{table(results, args.runs)}\n"
    )
    print(section)
    if args.append:
        with args.append.open("a") as f:
            f.write("\n" + section)


if __name__ == "__main__":
    main()
