"""Training throughput of the ranker: candidates trained per second, IKBO against baseline, side by side in one run.

A step is what `make train` runs (training.train_step): zero_grad, forward under autocast, the click loss,
backward and a fused AdamW step over every Parameter (the embedding tables included), on `requests_per_step`
requests of one U:B mix concatenated. Both variants start from the same weights (`make_demo_weights`) and cycle
through the same pool of batches (clicks.ClickData, labelled by its teacher, built on the device before
timing), so data generation is not timed. Before timing, the two variants' losses on the first batch must agree
(the same function), then each runs `warmup` steps. The timed steps run in blocks of `block` steps per
variant, the block order alternating, each block timed from a device synchronize to the next: candidates/s =
candidates per step × steps / seconds.

Memory (CUDA): the caching allocator's peak during a variant's blocks above what was allocated when its block
began (the step's activations, gradients and temporaries: "step peak"), and that plus the variant's own
Parameters and AdamW state ("total"). On the CPU no memory is reported.

`breakdown`: one step per variant under torch.profiler, its top ops by self device time (CPU time on the
CPU), to stderr: where the step's time goes.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass

import torch

from ..clicks import ClickData, Teacher
from ..ranker import RankerConfig, make_demo_weights
from ..training import RankerModule, click_loss, make_optimizer, train_step

PROVIDERS = ("baseline", "ikbo")  # baseline first: the reference of every ratio
AGREEMENT = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # |loss_ikbo − loss_baseline| / loss_baseline
SWEEP_RATIOS = (1, 16, 70, 256)  # B/U of the sweep at B = 1024 candidates per request


def parse_mix(text: str) -> tuple[int, int]:
    """A mix "U:B" → (U, B), 1 ≤ U ≤ B."""
    try:
        users, candidates = (int(part) for part in text.split(":"))
    except ValueError:
        raise ValueError(f"mix: expected U:B (e.g. 15:1024), got {text!r}") from None
    if not 1 <= users <= candidates:
        raise ValueError(f"mix {text!r}: expected 1 ≤ U ≤ B")
    return users, candidates


def sweep_mixes(candidates: int = 1024, ratios=SWEEP_RATIOS) -> list[str]:
    """U:B mixes at B/U ≈ each ratio (U = B / ratio, rounded)."""
    return [f"{max(1, round(candidates / ratio))}:{candidates}" for ratio in ratios]


@dataclass
class Measured:
    """One variant at one mix."""

    ms_per_step: float  # median over blocks
    candidates_per_s: float
    steps: int
    step_peak_mib: float = float("nan")
    total_mib: float = float("nan")
    loss: float = float("nan")  # on the first batch, from the initial weights


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _state_bytes(model: torch.nn.Module, optimizer) -> int:
    tensors = list(model.parameters()) + [
        t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)
    ]
    return sum(t.numel() * t.element_size() for t in tensors)


def bench_mix(
    cfg: RankerConfig,
    mix: str,
    requests_per_step: int,
    device: torch.device,
    dtype: torch.dtype,
    backend: str = "auto",
    steps: int = 20,
    warmup: int = 3,
    block: int = 5,
    pool: int = 4,
    seed: int = 0,
    breakdown: bool = False,
) -> dict[str, Measured]:
    """Both variants trained at one mix; see the module doc."""
    users, candidates = parse_mix(mix)
    data = ClickData(cfg, users, candidates, train_requests=pool * requests_per_step, heldout_requests=1, seed=seed)
    teacher = Teacher(data, seed + 1, device=device, backend=backend)
    batches = [data.batch(data.train_indices(i, requests_per_step), teacher, device) for i in range(pool)]
    del teacher
    initial = make_demo_weights(cfg, seed + 2)
    runs = {}
    for name in PROVIDERS:
        model = RankerModule(name, cfg, initial, device, backend)
        runs[name] = (model, make_optimizer(model, 1e-3, 0.01))
    losses = {}
    with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        for name, (model, _) in runs.items():
            losses[name] = float(click_loss(model(batches[0]), batches[0]["labels"]))
    error = abs(losses["ikbo"] - losses["baseline"]) / losses["baseline"]
    if not error <= AGREEMENT[dtype]:
        raise RuntimeError(f"{mix}: ikbo and baseline losses disagree ({losses}, relative {error:.2e})")

    for name, (model, optimizer) in runs.items():
        for i in range(warmup):
            train_step(model, optimizer, batches[i % pool], dtype)
    _sync(device)

    times = {name: [] for name in runs}
    peaks = {name: 0 for name in runs}
    done = {name: 0 for name in runs}
    blocks = max(1, -(-steps // block))
    for b in range(blocks):
        for name in PROVIDERS if b % 2 else reversed(PROVIDERS):
            model, optimizer = runs[name]
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                resting = torch.cuda.memory_allocated(device)
            _sync(device)
            start = time.perf_counter()
            for i in range(block):
                train_step(model, optimizer, batches[(done[name] + i) % pool], dtype)
            _sync(device)
            times[name].append((time.perf_counter() - start) / block)
            done[name] += block
            if device.type == "cuda":
                peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated(device) - resting)

    per_step = requests_per_step * candidates
    results = {}
    for name, (model, optimizer) in runs.items():
        ms = statistics.median(times[name]) * 1e3
        measured = Measured(ms, per_step / ms * 1e3, done[name], loss=losses[name])
        if device.type == "cuda":
            measured.step_peak_mib = peaks[name] / 2**20
            measured.total_mib = (peaks[name] + _state_bytes(model, optimizer)) / 2**20
        results[name] = measured
        if breakdown:
            step_profile(model, optimizer, batches[0], dtype, device, f"{mix} × {requests_per_step}, {name}")
    return results


def step_profile(model, optimizer, batch, dtype, device: torch.device, title: str, rows: int = 25) -> None:
    """Top ops of one training step by self device time (CPU time on the CPU), to stderr."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        train_step(model, optimizer, batch, dtype)
        _sync(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=rows)
    print(f"\n## one training step: {title}\n{table}", file=sys.stderr)


def table(results: dict[str, dict[str, Measured]], requests_per_step: int, on_gpu: bool) -> str:
    """Markdown: one line per mix, baseline and IKBO side by side."""
    memory = (
        " baseline step peak MiB | IKBO step peak MiB | IKBO / baseline memory | baseline total MiB | IKBO total MiB |"
    )
    lines = [
        "| mix (U:B) × requests | B/U | baseline ms/step | IKBO ms/step | baseline cand/s | IKBO cand/s "
        "| IKBO / baseline cand/s |" + (memory if on_gpu else ""),
        "|---|---:|---:|---:|---:|---:|---:|" + ("---:|---:|---:|---:|---:|" if on_gpu else ""),
    ]
    for mix, measured in results.items():
        users, candidates = parse_mix(mix)
        base, ikbo = measured["baseline"], measured["ikbo"]
        line = (
            f"| {mix} × {requests_per_step} | {candidates / users:.0f} | {base.ms_per_step:.2f} | "
            f"{ikbo.ms_per_step:.2f} | {base.candidates_per_s:,.0f} | {ikbo.candidates_per_s:,.0f} | "
            f"**{ikbo.candidates_per_s / base.candidates_per_s:.2f}×** |"
        )
        if on_gpu:
            line += (
                f" {base.step_peak_mib:,.0f} | {ikbo.step_peak_mib:,.0f} | {ikbo.step_peak_mib / base.step_peak_mib:.2f} "
                f"| {base.total_mib:,.0f} | {ikbo.total_mib:,.0f} |"
            )
        lines.append(line)
    steps = next(iter(results.values()))["ikbo"].steps if results else 0
    note = (
        f"\n\nA step: forward (autocast), loss, backward, AdamW over every Parameter; {steps} timed steps per variant "
        "and mix, median ms over blocks; ratio > 1 means IKBO trains more candidates per second."
    )
    if on_gpu:
        note += " Step peak: allocator peak above the memory allocated before the step (activations, gradients)."
    return "\n".join(lines) + note
