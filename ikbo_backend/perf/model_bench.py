"""In-process benchmark of the ranker (CPU or GPU): IKBO vs baseline, side by side in one run.

Providers: `baseline` (user tensors replicated to B rows; the reference of every ratio), `ikbo` and
optionally `transformed` (the baseline's code after the IKBO pass), built by `ranker.build_ranker`
from the weights the server loads. Stages: `feature` (lookups and dense projections, shared code),
`interaction` (where the variants differ, timed on precomputed features) and `whole`. Each mix uses a
pool of fixed, seeded requests from `make_request` (never zeros, ragged candidates per user); the timed
calls cycle through the pool, each provider running its stages as one block, the block order
alternating, so both see the same machine state. On a GPU every timed call ends with a device
synchronize (wall time of the request, launches included); `kernels` adds the sum of the kernel times
of one interaction call (torch.profiler): the gap between the two is host time.
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
import torch

from ..cuda_graphs import GraphedInteraction
from ..paths import REPO_ROOT, ensure_weights, load_shape_ranges, weights_path
from ..ranker import load_weights
from ..synthetic import make_request, to_tensors
from ..variants import build_ranker
from .inputs import mix_shape

PROVIDERS = ("baseline", "ikbo")  # baseline first: the reference of every ratio
AGREEMENT = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 2e-2}  # max |ikbo − baseline| / max |baseline|
STAGES = ("feature", "interaction", "whole")
DEFAULT_MIXES = ("u15_b1024", "u1_b1024", "u4_b256", "u64_b64", "u1_b64")


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


def served_models(profile: str, providers, device: torch.device, dtype, backend: str, cuda_graphs: bool = False):
    """(cfg, {provider: (features, interaction)}) from the weights the server loads for `profile`
    (created if missing); with `cuda_graphs`, each interaction replayed from CUDA graphs per shape
    bucket, as the served GPU configs run it."""
    path = weights_path() if profile == "demo" else REPO_ROOT / "weights" / f"ranker_{profile}.safetensors"
    cfg, weights = load_weights(ensure_weights(path, profile))
    names = list(PROVIDERS) + [p for p in providers if p not in PROVIDERS]
    models = {name: build_ranker(name, cfg, weights, device, backend=backend, dtype=dtype) for name in names}
    if cuda_graphs:
        ranges = load_shape_ranges()
        models = {
            name: (f, GraphedInteraction(i, ranges, device, replay_eagerly=device.type != "cuda"))
            for name, (f, i) in models.items()
        }
    return cfg, models


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
    features_of = [models["baseline"][0](**r) for r in requests]

    times = {key: [] for key in calls}
    with torch.inference_mode():
        for name, (_, interaction) in models.items():
            if isinstance(interaction, GraphedInteraction):  # capture this mix's bucket first
                interaction.capture(*interaction.bucket(num_users, num_candidates), vars(features_of[0]))
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
    """Markdown: one line per (mix, stage), baseline and IKBO side by side (and transformed when run)."""
    transformed = any(name == "transformed" for medians in results.values() for name, _ in medians)
    extra = " transformed ms | transformed / IKBO |" if transformed else ""
    lines = [
        "| mix (U:B) | stage | baseline ms | IKBO ms | baseline / IKBO | IKBO candidates/s | baseline candidates/s |"
        + extra,
        "|---|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if transformed else ""),
    ]
    for mix, medians in results.items():
        num_users, num_candidates = mix_shape(mix)
        for stage in STAGES + ("kernels",):
            if ("ikbo", stage) not in medians:
                continue
            base, ikbo = medians["baseline", stage], medians["ikbo", stage]
            label = "interaction kernels (sum)" if stage == "kernels" else stage
            line = (
                f"| {mix} ({num_users}:{num_candidates}) | {label} | {base:.3f} | {ikbo:.3f} | **{base / ikbo:.2f}×** "
                f"| {num_candidates / ikbo * 1e3:,.0f} | {num_candidates / base * 1e3:,.0f} |"
            )
            if transformed:
                moved = medians["transformed", stage]
                line += f" {moved:.3f} | {moved / ikbo:.2f}× |"
            lines.append(line)
    return "\n".join(lines) + f"\n\nMedian of {runs} calls per cell; ratio > 1 means IKBO is faster."
