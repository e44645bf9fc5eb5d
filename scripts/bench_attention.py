#!/usr/bin/env python3
"""IKBO attention benchmark (GPU): providers side by side at the canonical shape, self+target, sweep.

    scripts/bench_attention.py [--sweep full|corners|none] [--no-flex] [--tune] [--variants] [--smoke] [--host-cpu]   (or scripts/bench_kernels.py attention ...)
    scripts/bench_attention.py --ws      the Gluon FA3-style kernel (kernels/attention_ws.py) side by side
    scripts/bench_attention.py --ws-ab   its WS_AB variants against its default, in alternation, one process
    scripts/bench_attention.py --ws-sched   its item scheduling (atomic counter / static) with ragged kv_len (SCHED_GRID)
    ncu --profile-from-start off ... scripts/bench_attention.py --ws-profile   PROFILE_RUNS, once each, for Nsight Compute

Canonical shape, bf16, non-causal target attention: B=1024 candidates, S=64 query tokens each,
U=15 users with ragged counts, L=1024, H=4, d=128; FLOPs = 4·B·H·S·L·d. Providers:
  baseline          index_select K/V to B rows + SDPA (the replication is timed)
  sdpa_replicated   SDPA on K/V replicated beforehand (kernel only)
  packed_flash/…    SDPA on each user's candidates packed into one query sequence, [U, H, c·S, d];
                    needs equal counts, so it runs B' = U·round(B/U) candidates (its own FLOPs)
  flex              FlexAttention (torch.compile) over the flattened sorted queries and all users'
                    keys, block mask: query's user == key's user (ragged, no replication)
  ours              kernels.ikbo_attention on CUDA (Triton: plan + packed-tile kernel), per call
Self+target: causal self-attention of U×L plus the target attention; "apart" is the best self
kernel (SDPA flash is_causal, or ours alone) plus our target kernel; "fused" is one launch.
Sweep: S ∈ {1, 8, 64}, L ∈ {256, 1024, 4096}, d ∈ {64, 128}, B/U ∈ {1, 16, 70, 256} at B=1024
(U = B / ratio), baseline vs ours.
Metrics: median device ms of a call (the time the GPU is busy with the call's own kernels and copies,
read by CUPTI through torch.profiler, L2 flushed before each call: ikbo_backend/perf/device_time.py; the canonical
table also gives the call's device span, first start to last end, so with any wait for the host between
its launches, the SM clock right after the calls, and do_bench's median between CUDA events, which counts the host's launch time wherever it
outlasts the L2 flush), TFLOP/s, % of the floor max(FLOPs / matmul rate, bytes / copy bandwidth), both ceilings measured in this run.
--ws: the bf16 matmul ceiling, the baseline and the Triton kernel in this process, then each
WS_VARIANTS entry in its own child process (a timeout, so that a hang costs one variant): fp64
checks of NaN-poisoned outputs on WS_CHECKS (ragged counts, kv_len < L and 0, L not a multiple of
the tile, users without candidates, S > 64, d = 64, fp16), then plan + kernel and kernel alone at
WS_SHAPES; a table last, details in $OUT/attention_ws.json.
--ws-ab: the same fp64 checks for the WS_AB variants (parallel child processes), then one child times
them at AB_SHAPES in AB_ROUNDS alternating rounds (default, v1, v2, …, default, v1, …), kernel alone
(plan given) and plan + kernel; err vs fp64 at the canonical shape, vs the default elsewhere. Table
last, details in $OUT/attention_ws_ab.json.
Outputs are checked before timing: ours (poisoned with NaN) against fp64 at the canonical shape,
every provider and sweep point against each other. Prints markdown; with $OUT set, writes
$OUT/attention_bench.md. Kernels are compiled first in parallel worker processes (shared disk
cache) to spend less device time. --smoke runs the same code on the CPU under TRITON_INTERPRET=1
with tiny shapes: a check of this script, not a measurement.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton builds the kernels

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from ikbo_backend.perf.device_time import device_times, event_ms, host_us
from kernels import attention
from kernels.attention import TileConfig, ikbo_attention, ikbo_self_target_attention

SMOKE = "--smoke" in sys.argv
DEVICE = "cpu" if SMOKE or "--host-cpu" in sys.argv else "cuda"
DTYPE = torch.float16 if SMOKE else torch.bfloat16  # Triton 3.6's interpreter gets bf16 dots wrong
BF16_TOL = 1e-2


@dataclass(frozen=True)
class Shape:
    num_users: int  # U
    num_candidates: int  # B
    num_queries: int  # S
    seq_len: int  # L
    heads: int  # H
    head_dim: int  # d

    @property
    def target_flops(self):
        return 4 * self.num_candidates * self.heads * self.num_queries * self.seq_len * self.head_dim

    @property
    def self_flops(self):  # causal: L(L+1)/2 query-key pairs per user and head
        return 4 * self.num_users * self.heads * self.seq_len * (self.seq_len + 1) // 2 * self.head_dim

    def target_bytes(self, itemsize=2):  # q and out once, K/V once per user
        return (
            itemsize
            * self.heads
            * self.head_dim
            * (2 * self.num_candidates * self.num_queries + 2 * self.num_users * self.seq_len)
        )


CANONICAL = Shape(15, 1024, 64, 1024, 4, 128)
SMOKE_CANONICAL = Shape(3, 10, 5, 40, 2, 16)
SWEEP = [
    (s, length, d, ratio)
    for s in (1, 8, 64)
    for length in (256, 1024, 4096)
    for d in (64, 128)
    for ratio in (1, 16, 70, 256)
]
SWEEP_CANDIDATES = 1024
# Tiles of the Triton kernel timed side by side with --variants (canonical shape): each against the default, twice in
# alternation, kernel only and fused self+target. (The loop options lazy rescale, exp2 emulation and persistent
# programs were removed on 2026-12-01 after measuring no faster: docs/notes/attention.md.)
DEFAULT_TILE = TileConfig(128, 64, 8, 2, maxnreg=128)
VARIANTS = {
    "default 128×64 ≤128 regs": DEFAULT_TILE,
    "no reg cap": replace(DEFAULT_TILE, maxnreg=None),
    "3 stages": replace(DEFAULT_TILE, num_stages=3),
    "128×32, 2 stages": replace(DEFAULT_TILE, block_n=32),
    "128×32, 3 stages": replace(DEFAULT_TILE, block_n=32, num_stages=3),
    "128×128, no cap": replace(DEFAULT_TILE, block_n=128, maxnreg=None),
}
# Tile configurations timed beside the default with --tune (target attention, canonical shape).
TUNE_CONFIGS = [
    TileConfig(128, 64, 8, 3),
    TileConfig(128, 32, 8, 4, maxnreg=128),
    TileConfig(64, 64, 4, 2),
    TileConfig(64, 32, 4, 3),
]


def ragged_counts(num_users: int, num_candidates: int):
    """Zipf-like candidate counts (weights 1/(u+1)^0.7), every user at least one when B ≥ U."""
    weights = torch.tensor([1.0 / (u + 1) ** 0.7 for u in range(num_users)])
    counts = torch.floor(weights / weights.sum() * num_candidates).long()
    if num_candidates >= num_users:
        counts = counts.clamp(min=1)
    while counts.sum() > num_candidates:
        counts[counts.argmax()] -= 1
    counts[0] += num_candidates - counts.sum()
    return counts


def make_problem(shape: Shape, seed: int = 0, counts=None, with_user_q=False):
    """Fresh random bf16 q/k/v (user_q too if asked; never zeros), drawn on the device, and a
    shuffled mapping with the given (default: ragged) counts."""
    cpu_gen = torch.Generator().manual_seed(seed)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    counts = ragged_counts(shape.num_users, shape.num_candidates) if counts is None else counts
    mapping = torch.repeat_interleave(torch.arange(shape.num_users), counts)[
        torch.randperm(int(counts.sum()), generator=cpu_gen)
    ]

    def rand(*size):
        return torch.randn(*size, generator=gen, device=DEVICE, dtype=DTYPE)

    user_shape = (shape.num_users, shape.heads, shape.seq_len, shape.head_dim)
    return dict(
        q=rand(mapping.shape[0], shape.heads, shape.num_queries, shape.head_dim),
        k=rand(*user_shape),
        v=rand(*user_shape),
        user_q=rand(*user_shape) if with_user_q else None,
        cand_to_user=mapping.to(DEVICE),
        counts=counts,
    )


def label(config: TileConfig) -> str:
    regs = f" ≤{config.maxnreg} regs" if config.maxnreg else ""
    return f"{config.block_m}×{config.block_n}, {config.num_warps} warps, {config.num_stages} stages{regs}"


# ---------------------------------------------------------------------------------------------
# Providers
# ---------------------------------------------------------------------------------------------


def baseline(p):
    rows = p["cand_to_user"]
    return F.scaled_dot_product_attention(p["q"], p["k"].index_select(0, rows), p["v"].index_select(0, rows))


def ours(p, config=None):
    if config is None:
        return ikbo_attention(p["q"], p["k"], p["v"], p["cand_to_user"], backend="triton")
    return attention._launch(
        p["q"], p["k"], p["v"], p["cand_to_user"], None, 1 / math.sqrt(p["k"].shape[3]), config=config
    )[0]


def dispatched_kernels(p, plan=None):
    """Plan + target-attention kernel(s) of what the public op runs on these inputs, without its input
    checks: the Gluon kernel (kernels/attention_ws.py) where `prefer_ws`, else the Triton kernel.
    `plan` (from `dispatched_plan`) skips the plan launch."""
    from kernels import attention_ws

    scale = 1 / math.sqrt(p["k"].shape[3])
    if attention_ws.prefer_ws(p["q"], p["k"]):
        return attention_ws.launch_ws(p["q"], p["k"], p["v"], p["cand_to_user"], None, scale, plan=plan)[0]
    return attention._launch(p["q"], p["k"], p["v"], p["cand_to_user"], None, scale, plan=plan)[0]


def dispatched_plan(p, shape):
    from kernels import attention_ws

    block_m = (
        attention_ws.TILE_M
        if attention_ws.prefer_ws(p["q"], p["k"])
        else attention.pick_config(
            shape.num_candidates * shape.num_queries / shape.num_users, attention.interpreting()
        ).block_m
    )
    return attention.plan_tiles(p["cand_to_user"], shape.num_users, shape.num_queries, block_m)


def packed(p, backend):
    """p holds an equal-count problem; q_packed [U, H, c·S, d] built outside the timed region."""
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(p["q_packed"], p["k"], p["v"])


def make_flex(p, shape):
    """FlexAttention over flattened, user-sorted queries [1, H, B·S, d] and keys [1, H, U·L, d]."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    order = torch.argsort(p["cand_to_user"], stable=True)
    q_user = p["cand_to_user"][order].repeat_interleave(shape.num_queries).int()
    kv_user = torch.arange(shape.num_users, device=DEVICE).repeat_interleave(shape.seq_len).int()
    q_flat = p["q"][order].permute(1, 0, 2, 3).reshape(1, shape.heads, -1, shape.head_dim)
    k_flat, v_flat = (t.permute(1, 0, 2, 3).reshape(1, shape.heads, -1, shape.head_dim) for t in (p["k"], p["v"]))

    def same_user(b, h, q_idx, kv_idx):
        return q_user[q_idx] == kv_user[kv_idx]

    mask = create_block_mask(same_user, None, None, q_flat.shape[2], k_flat.shape[2], device=DEVICE)
    compiled = torch.compile(flex_attention)

    def run():
        return compiled(q_flat, k_flat, v_flat, block_mask=mask)

    def unflatten(out):  # back to [B, H, S, d] in candidate order, for the check
        res = torch.empty_like(p["q"])
        res[order] = out.reshape(shape.heads, -1, shape.num_queries, shape.head_dim).permute(1, 0, 2, 3)
        return res

    return run, unflatten


# ---------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------


def timed(fn, calls=50):
    """Median device ms of a call: the GPU's busy time for its own work (device_time.device_ms); wall clock under --smoke."""
    return device_times(fn, not SMOKE, calls)[0]


def ceilings():
    """(bf16 matmul FLOP/s, copy bytes/s) measured here: 8192³ random matmul, 4 GiB copy."""
    if SMOKE:
        return 1e12, 1e11
    a, b = (torch.randn(8192, 8192, device=DEVICE, dtype=DTYPE) for _ in range(2))
    flops = 2 * 8192**3 / (timed(lambda: a @ b) * 1e-3)
    src = torch.randn(2**29, device=DEVICE)  # 2 GiB fp32
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() * 4 / (timed(lambda: dst.copy_(src)) * 1e-3)
    del a, b, src, dst
    return flops, bandwidth


def graph_ms(fn):
    """Median ms of CUDA-graph replays of `fn` (device time, without the host's launch time); nan under --smoke."""
    if SMOKE:
        return float("nan")
    return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median")


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def fp64_target(p):
    return ikbo_attention(*(p[n].double() for n in ("q", "k", "v")), p["cand_to_user"], backend="torch")


def poisoned_ours(p, user_q=None):
    out = torch.full_like(p["q"], float("nan"))
    user_out = None if user_q is None else torch.full_like(user_q, float("nan"))
    return attention._launch(
        p["q"],
        p["k"],
        p["v"],
        p["cand_to_user"],
        None,
        1 / math.sqrt(p["k"].shape[3]),
        user_q,
        True,
        out=out,
        user_out=user_out,
    )


def _warm(job):
    """Worker: compile (into the shared disk cache) what `job` will launch."""
    kind, shape, config = job
    p = make_problem(shape, with_user_q=kind in ("fused", "self"))
    if kind == "flex":
        make_flex(p, shape)[0]()
    elif kind == "target":
        ours(p, config)
    elif kind == "fused" and config is not None:
        attention._launch(p["q"], p["k"], p["v"], p["cand_to_user"], None, 1.0, p["user_q"], config=config)
    elif kind == "fused":
        ikbo_self_target_attention(p["user_q"], p["q"], p["k"], p["v"], p["cand_to_user"], backend="triton")
    elif kind == "self":
        attention._launch(p["q"][:0], p["k"], p["v"], p["cand_to_user"][:0], None, 1.0, p["user_q"])
    torch.cuda.synchronize()
    return job


def warm_up(jobs, workers=12):
    start = time.perf_counter()
    ctx = torch.multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        list(pool.map(_warm, jobs))
    return time.perf_counter() - start


# ---------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------


@dataclass
class Row:
    """One provider of the canonical table: device busy ms, span ms and SM MHz (device_times), do_bench ms."""

    name: str
    ms: float
    flops: float
    check: str = ""
    note: str = ""
    span: float = float("nan")
    mhz: float = float("nan")
    events: float = float("nan")


def canonical_section(shape, peak, bandwidth, with_flex, tune):
    lines = []
    p = make_problem(shape, seed=1)
    floor_ms = max(shape.target_flops / peak, shape.target_bytes() / bandwidth) * 1e3
    ref = fp64_target(p)
    err_ours = rel_err(poisoned_ours(p)[0], ref)
    assert err_ours <= BF16_TOL, f"ours: relative error {err_ours:.2e} vs fp64"
    base_out = baseline(p)
    rows: list[Row] = []

    def add(name, fn, flops, out=None, note=""):
        check = "" if out is None else f"{rel_err(out, ref):.1e}"
        ms, span, mhz = device_times(fn, not SMOKE)
        rows.append(Row(name, ms, flops, check, note, span, mhz, event_ms(fn, not SMOKE)))

    add("baseline (index_select + SDPA)", lambda: baseline(p), shape.target_flops, base_out, "replication timed")
    k_rep, v_rep = (p[n].index_select(0, p["cand_to_user"]) for n in ("k", "v"))
    add(
        "sdpa_replicated (kernel only)",
        lambda: F.scaled_dot_product_attention(p["q"], k_rep, v_rep),
        shape.target_flops,
    )
    del k_rep, v_rep
    if not SMOKE:
        per_user = round(shape.num_candidates / shape.num_users)
        eq = make_problem(
            replace(shape, num_candidates=per_user * shape.num_users),
            seed=2,
            counts=torch.full((shape.num_users,), per_user),
        )
        order = torch.argsort(eq["cand_to_user"], stable=True)
        eq["q_packed"] = (
            eq["q"][order]
            .view(shape.num_users, per_user, shape.heads, shape.num_queries, shape.head_dim)
            .transpose(1, 2)
            .reshape(shape.num_users, shape.heads, per_user * shape.num_queries, shape.head_dim)
        )
        eq_flops = replace(shape, num_candidates=per_user * shape.num_users).target_flops
        for name, backend in (
            ("packed_flash", SDPBackend.FLASH_ATTENTION),
            ("packed_cudnn", SDPBackend.CUDNN_ATTENTION),
        ):
            try:
                packed(eq, backend)
                add(
                    f"{name} (equal counts {per_user}/user)",
                    lambda b=backend: packed(eq, b),
                    eq_flops,
                    note=f"B'={per_user * shape.num_users}",
                )
            except RuntimeError as exc:  # backend not available for this shape/device
                rows.append(Row(name, float("nan"), eq_flops, note=f"unavailable: {str(exc)[:60]}"))
        del eq
    if with_flex:
        try:
            run, unflatten = make_flex(p, shape)
            add("flex (block mask, ragged)", run, shape.target_flops, unflatten(run()))
        except Exception as exc:
            rows.append(
                Row("flex", float("nan"), shape.target_flops, note=f"failed: {type(exc).__name__}: {str(exc)[:60]}")
            )
    config = attention.pick_config(shape.num_candidates * shape.num_queries / shape.num_users, attention.interpreting())
    from kernels import attention_ws

    runs = (
        "the Gluon kernel (attention_ws)"
        if attention_ws.prefer_ws(p["q"], p["k"])
        else "the Triton kernel, " + label(config)
    )
    add(
        "**ours** (ikbo_attention, backend triton)",
        lambda: ours(p),
        shape.target_flops,
        ours(p),
        "public op, one device sync (input checks); runs " + runs,
    )
    plan = attention.plan_tiles(p["cand_to_user"], shape.num_users, shape.num_queries, config.block_m)
    scale = 1 / math.sqrt(shape.head_dim)
    ws_plan = dispatched_plan(p, shape)
    add(
        "ours: plan + kernel as dispatched (no input checks)",
        lambda: dispatched_kernels(p),
        shape.target_flops,
        dispatched_kernels(p),
        "the Gluon kernel where prefer_ws, else the Triton kernel",
    )
    add("ours: kernel as dispatched, plan given", lambda: dispatched_kernels(p, ws_plan), shape.target_flops)
    # config given: the Triton kernel itself (without one, _launch takes the Gluon kernel where prefer_ws)
    add(
        "ours: plan + Triton kernel (no input checks)",
        lambda: attention._launch(p["q"], p["k"], p["v"], p["cand_to_user"], None, scale, config=config),
        shape.target_flops,
    )
    add(
        "ours: Triton kernel only (plan given)",
        lambda: attention._launch(p["q"], p["k"], p["v"], p["cand_to_user"], None, scale, plan=plan),
        shape.target_flops,
    )
    add(
        "ours: plan kernel only",
        lambda: attention.plan_tiles(p["cand_to_user"], shape.num_users, shape.num_queries, config.block_m),
        shape.target_flops,
        note="FLOPs of the op",
    )
    if not SMOKE:  # device time without the host's launches: both captured once, replayed
        base_graph, ours_graph = graph_ms(lambda: baseline(p)), graph_ms(lambda: ours(p))
        rows.append(Row("baseline as a CUDA-graph replay", base_graph, shape.target_flops))
        rows.append(
            Row(
                "ours: public op as a CUDA-graph replay (as served)",
                ours_graph,
                shape.target_flops,
                note=f"{base_graph / ours_graph:.2f}× the baseline's replay",
            )
        )
    if tune:
        for config in TUNE_CONFIGS:
            add(f"ours {label(config)}", lambda c=config: ours(p, c), shape.target_flops, ours(p, config))

    base_ms, base_events = rows[0].ms, rows[0].events
    lines.append(f"Target attention, {shape}, counts {p['counts'].tolist()}, bf16, non-causal")
    lines.append(
        f"floor {floor_ms:.3f} ms (FLOPs / {peak / 1e12:.0f} TFLOP/s; bytes / {bandwidth / 1e12:.2f} TB/s); ours rel err vs fp64 {err_ours:.1e} (poisoned output)\n"
    )
    lines.append(
        "ms: the GPU's busy time for a call's work (CUPTI); span: its first start to last end (with waits for the host between "
        "its launches); SM MHz: the SM clock right after each call (median); do_bench: CUDA events around the call (+ host launch time where it outlasts the L2 flush)\n"
    )
    lines.append(
        "| provider | ms | TFLOP/s | × baseline | % of floor | err vs fp64 | span ms | SM MHz | do_bench ms | × baseline, do_bench | note |"
    )
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        lines.append(
            f"| {r.name} | {r.ms:.4f} | {r.flops / r.ms / 1e9:.0f} | {base_ms / r.ms:.2f} | {100 * floor_ms / r.ms * r.flops / shape.target_flops:.0f} | "
            f"{r.check} | {r.span:.4f} | {r.mhz:.0f} | {r.events:.4f} | {base_events / r.events:.2f} | {r.note} |"
        )
    return lines


def self_target_section(shape, peak):
    lines = []
    p = make_problem(shape, seed=3, with_user_q=True)
    cand_out, user_out, _ = poisoned_ours(p, p["user_q"])
    fp64 = ikbo_self_target_attention(
        *(p[n].double() for n in ("user_q", "q", "k", "v")), p["cand_to_user"], backend="torch"
    )
    err = max(rel_err(user_out, fp64[0]), rel_err(cand_out, fp64[1]))
    assert err <= BF16_TOL, f"fused: relative error {err:.2e} vs fp64"
    scale = 1 / math.sqrt(shape.head_dim)

    def self_sdpa():
        return F.scaled_dot_product_attention(p["user_q"], p["k"], p["v"], is_causal=True)

    def self_ours():
        return attention._launch(p["q"][:0], p["k"], p["v"], p["cand_to_user"][:0], None, scale, p["user_q"])[1]

    def target_ours():
        return attention._launch(p["q"], p["k"], p["v"], p["cand_to_user"], None, scale)[0]

    def fused_ours():
        return attention._launch(p["q"], p["k"], p["v"], p["cand_to_user"], None, scale, p["user_q"])

    triton_config = attention.pick_config(
        shape.num_candidates * shape.num_queries / shape.num_users + shape.seq_len, attention.interpreting()
    )
    target_config = attention.pick_config(
        shape.num_candidates * shape.num_queries / shape.num_users, attention.interpreting()
    )

    def target_triton():  # config given: the Triton kernel itself (without one, _launch may take the Gluon kernel)
        return attention._launch(p["q"], p["k"], p["v"], p["cand_to_user"], None, scale, config=target_config)[0]

    def fused_triton():  # the Triton kernel's fused grid, which the op ran before the Gluon kernel took self tiles
        return attention._launch(
            p["q"], p["k"], p["v"], p["cand_to_user"], None, scale, p["user_q"], config=triton_config
        )

    rows = [
        ("self: SDPA is_causal (flash)", timed(self_sdpa), shape.self_flops),
        ("self: ours alone", timed(self_ours), shape.self_flops),
        ("target: ours, Triton kernel (plan + kernel)", timed(target_triton), shape.target_flops),
        ("target: ours as dispatched (plan + kernel)", timed(lambda: dispatched_kernels(p)), shape.target_flops),
    ]
    apart = min(rows[0][1], rows[1][1]) + min(rows[2][1], rows[3][1])
    fused = timed(fused_ours)
    total = shape.self_flops + shape.target_flops
    public = timed(
        lambda: ikbo_self_target_attention(p["user_q"], p["q"], p["k"], p["v"], p["cand_to_user"], backend="triton")
    )
    rows += [
        ("apart (best self + target)", apart, total),
        ("**fused** (plan + one launch, as dispatched)", fused, total),
        ("fused, public op (one device sync)", public, total),
        ("fused, Triton kernel (plan + one launch)", timed(fused_triton), total),
    ]
    graph_ratio = ""
    if not SMOKE:  # device time without the host's launches (which bound the eager rows on a slow host)
        rows += [
            (
                "apart as one CUDA-graph replay (SDPA self + target as dispatched)",
                graph_ms(lambda: (self_sdpa(), dispatched_kernels(p))),
                total,
            ),
            ("**fused** as a CUDA-graph replay (as dispatched)", graph_ms(fused_ours), total),
            ("fused, Triton kernel, as a CUDA-graph replay", graph_ms(fused_triton), total),
        ]
        graph_ratio = f"; in CUDA-graph replays {rows[-2][1] / rows[-3][1]:.3f}"
    host = {
        "baseline": host_us(lambda: baseline(p), not SMOKE),
        "ours public op (ends with the flag sync)": host_us(lambda: ours(p), not SMOKE),
        "ours plan + kernel launches": host_us(target_ours, not SMOKE),
        "plan launch alone": host_us(
            lambda: attention.plan_tiles(p["cand_to_user"], shape.num_users, shape.num_queries, 128), not SMOKE
        ),
        "self-only launches": host_us(self_ours, not SMOKE),
    }
    lines.append("\nHost time per call (µs, CPU side, 50 calls): " + ", ".join(f"{k} {v:.0f}" for k, v in host.items()))
    lines.append(
        f"\nSelf (causal, U×L) + target attention, {shape}; fused rel err vs fp64 {err:.1e}; fused / apart = {fused / apart:.3f}{graph_ratio}\n"
    )
    lines.append("| part | ms | TFLOP/s |")
    lines.append("|---|---:|---:|")
    lines += [f"| {name} | {ms:.3f} | {flops / ms / 1e9:.0f} |" for name, ms, flops in rows]
    return lines


def variants_section(shape, peak):
    """Each of VARIANTS at the canonical shape: target kernel only (plan given) in two alternating
    rounds, fused self+target (plan + one launch), registers / spills of the compiled kernel, and
    rel err vs fp64 of poisoned outputs (target and fused)."""
    p = make_problem(shape, seed=5, with_user_q=True)
    scale = 1 / math.sqrt(shape.head_dim)
    ref = fp64_target(p)
    fused_ref = ikbo_self_target_attention(
        *(p[n].double() for n in ("user_q", "q", "k", "v")), p["cand_to_user"], backend="torch"
    )
    rows, runs = {}, {}
    for name, config in VARIANTS.items():
        if SMOKE:  # the same options on tiles the interpreter runs in seconds
            config = replace(config, block_m=16, block_n=16, num_warps=4, num_stages=1)
        plan = attention.plan_tiles(p["cand_to_user"], shape.num_users, shape.num_queries, config.block_m)
        out, user_out = torch.full_like(p["q"], float("nan")), torch.full_like(p["user_q"], float("nan"))
        cache = {} if SMOKE else attention._attention_kernel.device_caches[torch.cuda.current_device()][0]
        known = set(cache)
        attention._launch(p["q"], p["k"], p["v"], p["cand_to_user"], None, scale, config=config, out=out, plan=plan)
        compiled = [cache[key] for key in cache if key not in known]  # this variant's target kernel
        regs = f"{compiled[0].n_regs}/{compiled[0].n_spills}" if compiled else ""
        err = rel_err(out, ref)
        out.fill_(float("nan"))
        attention._launch(
            p["q"],
            p["k"],
            p["v"],
            p["cand_to_user"],
            None,
            scale,
            p["user_q"],
            config=config,
            out=out,
            user_out=user_out,
        )
        fused_err = max(rel_err(out, fused_ref[1]), rel_err(user_out, fused_ref[0]))
        rows[name] = [err, fused_err, regs]
        runs[name] = (
            lambda c=config, pl=plan: attention._launch(
                p["q"], p["k"], p["v"], p["cand_to_user"], None, scale, config=c, plan=pl
            ),
            lambda c=config: attention._launch(
                p["q"], p["k"], p["v"], p["cand_to_user"], None, scale, p["user_q"], config=c
            ),
        )
    times = {name: [] for name in VARIANTS}
    for _ in range(2):  # alternating rounds: the spread between them is the noise
        for name, (target, _) in runs.items():
            times[name].append(timed(target))
    fused = {name: timed(run) for name, (_, run) in runs.items()}
    base = min(times[next(iter(VARIANTS))])
    lines = [
        f"\nTiles of the Triton kernel, {shape}, bf16; target kernel with the plan given (two alternating rounds), fused = plan + one launch of self (causal) + target\n"
    ]
    lines.append(
        "| variant | target ms (round 1 / 2) | TFLOP/s | vs default | fused ms | fused TFLOP/s | regs/spill B | err target | err fused |"
    )
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in VARIANTS:
        best = min(times[name])
        err, fused_err, regs = rows[name]
        lines.append(
            f"| {name} | {times[name][0]:.3f} / {times[name][1]:.3f} | {shape.target_flops / best / 1e9:.0f} | {base / best:.3f} | "
            f"{fused[name]:.3f} | {(shape.target_flops + shape.self_flops) / fused[name] / 1e9:.0f} | {regs} | {err:.1e} | {fused_err:.1e} |"
        )
    return lines


def host_profile(shape, calls=300):
    """cProfile of the public op's host side (per call, top functions by own time)."""
    import cProfile
    import io
    import pstats

    p = make_problem(shape, seed=6)
    ours(p)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        ours(p)
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    return text.getvalue()


def host_cpu(calls=3000):
    """Host µs per call on a machine without a GPU, interpreter off: Triton's real JIT dispatch
    (binder, specialization, cache lookup; kernels compiled for sm_90 here) under a stand-in driver
    whose launcher does nothing, on CPU tensors. Leaves out the C launcher (TMA descriptor encoding,
    cuLaunchKernelEx), CUDA allocations and the flag wait, which only a GPU run measures."""
    from kernels._common import install_standin_driver

    install_standin_driver()
    uninitialized = attention.plan_buffers

    def plan_buffers(num_candidates, max_tiles, device):  # the flag as a plan kernel that found nothing wrong leaves it
        flag, order, tiles = uninitialized(num_candidates, max_tiles, device)
        return flag.zero_(), order, tiles

    attention.plan_buffers = plan_buffers
    attention._choose_backend = lambda backend, k: "triton"  # CPU tensors stand in for CUDA ones
    lines = [
        "| shape | plan_tiles | _launch, plan given | _launch | public op (flag read on the CPU) |",
        "|---|---:|---:|---:|---:|",
    ]
    for shape in (Shape(15, 64, 1, 256, 4, 64), CANONICAL):
        p = {n: t.cpu() if isinstance(t, torch.Tensor) else t for n, t in make_problem(shape, seed=7).items()}
        config = attention.pick_config(shape.num_candidates * shape.num_queries / shape.num_users, False)
        plan = attention.plan_tiles(p["cand_to_user"], shape.num_users, shape.num_queries, config.block_m)
        args = (p["q"], p["k"], p["v"], p["cand_to_user"], None, 1 / math.sqrt(shape.head_dim))
        fns = [lambda: attention.plan_tiles(p["cand_to_user"], shape.num_users, shape.num_queries, config.block_m),
               lambda: attention._launch(*args, plan=plan), lambda: attention._launch(*args),
               lambda: ikbo_attention(p["q"], p["k"], p["v"], p["cand_to_user"])]  # fmt: skip
        row = []
        for fn in fns:
            fn()  # compiles
            best = math.inf
            for _ in range(3):
                start = time.perf_counter()
                for _ in range(calls):
                    fn()
                best = min(best, (time.perf_counter() - start) / calls * 1e6)
            row.append(f"{best:.1f}")
        lines.append(
            f"| U={shape.num_users} B={shape.num_candidates} S={shape.num_queries} L={shape.seq_len} d={shape.head_dim} | "
            + " | ".join(row)
            + " |"
        )
    return lines


# the sweep's extremes and its slowest points (2026-11-29 run), for a short run (--sweep corners)
CORNERS = [
    (1, 256, 64, 256),
    (8, 256, 64, 1),
    (8, 256, 64, 16),
    (64, 256, 64, 256),
    (1, 4096, 128, 1),
    (64, 4096, 128, 70),
]


def sweep_shapes(points):
    if SMOKE:
        return [
            Shape(max(1, 8 // ratio), 8, s, length, 2, d) for s, length, d, ratio in [(1, 40, 16, 1), (8, 20, 32, 4)]
        ]
    return [Shape(SWEEP_CANDIDATES // ratio, SWEEP_CANDIDATES, s, length, 4, d) for s, length, d, ratio in points]


def sweep_section(points):
    lines = ["\nSweep (bf16, non-causal target, H=4, B=1024, ragged counts): baseline vs ours, as the public op"]
    lines.append("(input checks: one device sync after its launches) and as plan + the kernel it")
    lines.append(
        "dispatches to; ms columns: device time of a call (the GPU's busy time, CUPTI); graph columns: both as CUDA-graph replays (back to back,"
    )
    lines.append(
        "the op captured as served, without its wait); last speedup: plan + kernel by do_bench (host launch time included)\n"
    )
    lines.append(
        "| S | L | d | B/U | U | baseline ms | ours op ms | ours kernels ms | speedup op | speedup kernels | kernels TFLOP/s "
        "| baseline graph ms | ours graph ms | speedup graph | err vs baseline | speedup kernels, do_bench |"
    )
    lines.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    slowest_op = slowest_kernels = slowest_graph = slowest_events = math.inf
    for shape in sweep_shapes(points):
        p = make_problem(shape, seed=4)
        scale = 1 / math.sqrt(shape.head_dim)

        def kernels():
            return dispatched_kernels(p)

        base_out, our_out = baseline(p), ours(p)
        err = max(rel_err(our_out, base_out), rel_err(kernels(), base_out))
        base_ms, op_ms, kernels_ms = timed(lambda: baseline(p), 30), timed(lambda: ours(p), 30), timed(kernels, 30)
        base_graph, op_graph = graph_ms(lambda: baseline(p)), graph_ms(lambda: ours(p))
        events_speedup = event_ms(lambda: baseline(p), not SMOKE) / event_ms(kernels, not SMOKE)
        slowest_events = min(slowest_events, events_speedup)
        slowest_op, slowest_kernels = min(slowest_op, base_ms / op_ms), min(slowest_kernels, base_ms / kernels_ms)
        slowest_graph = min(slowest_graph, base_graph / op_graph) if not SMOKE else slowest_graph
        ratio = shape.num_candidates // shape.num_users
        lines.append(
            f"| {shape.num_queries} | {shape.seq_len} | {shape.head_dim} | {ratio} | {shape.num_users} | {base_ms:.3f} | {op_ms:.3f} | "
            f"{kernels_ms:.3f} | {base_ms / op_ms:.2f} | {base_ms / kernels_ms:.2f} | {shape.target_flops / kernels_ms / 1e9:.0f} | "
            f"{base_graph:.3f} | {op_graph:.3f} | {base_graph / op_graph:.2f} | {err:.1e} | {events_speedup:.2f} |"
        )
        del p, base_out, our_out
    lines.append(
        f"\nsmallest speedup over the baseline in the sweep: public op {slowest_op:.2f}×, kernels {slowest_kernels:.2f}×, "
        f"CUDA graphs {slowest_graph:.2f}×, kernels by do_bench {slowest_events:.2f}×"
    )
    return lines


# ---------------------------------------------------------------------------------------------
# --ws: the Gluon kernel of kernels/attention_ws.py against the Triton kernel
# ---------------------------------------------------------------------------------------------

WS_VARIANTS = {  # name → WSAttentionConfig keyword arguments
    "ws default (128 keys; static items here, no kv_len)": {},
    "ws 128, items from the atomic counter": dict(dynamic=True),
}
WS_AB = list(WS_VARIANTS)  # --ws-ab: the first is the reference
AB_ROUNDS = int(os.environ.get("AB_ROUNDS", 3))  # alternations of every variant per shape
# (U, B, S, L, H, d, kv_len: None | "ragged", users without candidates, dtype)
WS_CHECKS = [
    (15, 1024, 64, 1024, 4, 128, None, 0, torch.bfloat16),  # canonical
    (15, 1024, 64, 1000, 4, 128, "ragged", 0, torch.bfloat16),  # kv_len < L, 0, < one block; L not a tile multiple
    (7, 300, 8, 777, 2, 128, "ragged", 2, torch.float16),  # S = 8 (16 candidates per warpgroup), empty users
    (5, 37, 100, 300, 3, 64, None, 1, torch.bfloat16),  # S > 64: warpgroups split candidates; d = 64
    (1, 3, 1, 129, 1, 128, "ragged", 0, torch.bfloat16),  # tiny: 1 tile, mostly empty slots
    (40, 64, 64, 256, 2, 64, "ragged", 20, torch.float16),  # many users, half without candidates
]
WS_SHAPES = [  # timed, bf16, no kv_len
    CANONICAL,
    Shape(4, 1024, 64, 4096, 4, 128),  # long histories, B/U = 256
    Shape(15, 1024, 8, 1024, 4, 128),  # short candidate sequences
    Shape(15, 1024, 64, 1024, 4, 64),  # d = 64
    Shape(64, 1024, 64, 512, 2, 128),  # B/U = 16, L = 512
]
PROFILE_RUNS = [(CANONICAL, WS_AB[0]), (Shape(4, 1024, 64, 4096, 4, 128), WS_AB[0])]
AB_SHAPES = [
    CANONICAL,
    Shape(4, 1024, 64, 4096, 4, 128),
    Shape(15, 1024, 64, 1024, 4, 64),
    Shape(64, 1024, 64, 512, 2, 128),
]


def _ws_problem(check, seed):
    num_users, num_candidates, num_queries, seq_len, heads, head_dim, kv_mode, empty, dtype = check
    gen = torch.Generator().manual_seed(seed)
    mapping = torch.randint(0, num_users - empty, (num_candidates,), generator=gen)
    kv_len = None
    if kv_mode == "ragged":
        kv_len = torch.randint(0, seq_len + 1, (num_users,), generator=gen)
        kv_len[0] = 0
        if num_users > 2:
            kv_len[1], kv_len[2] = 5, seq_len
        kv_len = kv_len.to(DEVICE)

    def rand(*size):
        return torch.randn(*size, generator=gen).to(DEVICE, dtype)

    q = rand(num_candidates, heads, num_queries, head_dim)
    k, v = rand(num_users, heads, seq_len, head_dim), rand(num_users, heads, seq_len, head_dim)
    return q, k, v, mapping.to(DEVICE), kv_len


def ws_child(name, phase):
    """Child process: check ("check") or time ("time") one WS_VARIANTS entry; one JSON line per
    result on stdout."""
    import json

    from kernels import attention_ws

    cfg = attention_ws.WSAttentionConfig(**WS_VARIANTS[name])
    for i, check in enumerate(WS_CHECKS if phase == "check" else []):
        q, k, v, mapping, kv_len = _ws_problem(check, seed=100 + i)
        ref = ikbo_attention(q.double(), k.double(), v.double(), mapping, kv_len, backend="torch")
        out = torch.full_like(q, float("nan"))
        attention_ws.launch_ws(q, k, v, mapping, kv_len, 1 / math.sqrt(q.shape[3]), cfg, out=out)
        torch.cuda.synchronize()
        print(json.dumps(dict(kind="check", variant=name, check=i, err=rel_err(out, ref))), flush=True)
    for shape in WS_SHAPES if phase == "time" else []:
        p = make_problem(shape, seed=7)
        scale = 1 / math.sqrt(shape.head_dim)
        ref = fp64_target(p)
        out = torch.full_like(p["q"], float("nan"))
        attention_ws.launch_ws(p["q"], p["k"], p["v"], p["cand_to_user"], None, scale, cfg, out=out)
        err = rel_err(out, ref)
        plan = attention.plan_tiles(p["cand_to_user"], shape.num_users, shape.num_queries, attention_ws.TILE_M)
        times = []
        for _ in range(2):
            times.append(
                timed(
                    lambda: attention_ws.launch_ws(
                        p["q"], p["k"], p["v"], p["cand_to_user"], None, scale, cfg, out=out, plan=plan
                    )
                )
            )
        full = timed(
            lambda: attention_ws.launch_ws(p["q"], p["k"], p["v"], p["cand_to_user"], None, scale, cfg, out=out)
        )
        print(
            json.dumps(
                dict(
                    kind="time",
                    variant=name,
                    shape=list(shape.__dict__.values()),
                    kernel_ms=times,
                    plan_kernel_ms=full,
                    err=err,
                )
            ),
            flush=True,
        )
        del p, out, ref


def ws_ab_child(names):
    """Child process (--ws-ab): time the WS_AB variants `names` in alternation at AB_SHAPES; one JSON
    line per shape and one per (shape, round, variant)."""
    import json

    from kernels import attention_ws

    cfgs = {name: attention_ws.WSAttentionConfig(**WS_VARIANTS[name]) for name in names}
    for shape in AB_SHAPES:
        p = make_problem(shape, seed=7)
        scale = 1 / math.sqrt(shape.head_dim)
        ref = fp64_target(p) if shape == CANONICAL else None
        outs, errs = {}, {}
        for name, cfg in cfgs.items():  # poisoned outputs, checked (and compiled) before any timing
            outs[name] = torch.full_like(p["q"], float("nan"))
            attention_ws.launch_ws(p["q"], p["k"], p["v"], p["cand_to_user"], None, scale, cfg, out=outs[name])
        for name in cfgs:
            errs[name] = rel_err(outs[name], ref if ref is not None else outs[names[0]])
        print(
            json.dumps(
                dict(
                    kind="ab_check",
                    shape=list(shape.__dict__.values()),
                    vs="fp64" if ref is not None else names[0],
                    err=errs,
                )
            ),
            flush=True,
        )
        del ref
        plan = attention.plan_tiles(p["cand_to_user"], shape.num_users, shape.num_queries, attention_ws.TILE_M)
        out = outs[names[0]]
        for r in range(AB_ROUNDS):
            for name, cfg in cfgs.items():
                kernel = timed(
                    lambda: attention_ws.launch_ws(
                        p["q"], p["k"], p["v"], p["cand_to_user"], None, scale, cfg, out=out, plan=plan
                    )
                )
                full = timed(
                    lambda: attention_ws.launch_ws(p["q"], p["k"], p["v"], p["cand_to_user"], None, scale, cfg, out=out)
                )
                print(
                    json.dumps(
                        dict(
                            kind="ab_time",
                            shape=list(shape.__dict__.values()),
                            round=r,
                            variant=name,
                            kernel_ms=kernel,
                            plan_kernel_ms=full,
                        )
                    ),
                    flush=True,
                )
        del p, outs, out


def _ws_checks(names, timeout_s: float) -> dict[str, tuple[str, str, str]]:
    """Run `--ws-child NAME --ws-phase check` for every name at once (checks and compilations in
    parallel); {name: (stdout, stderr, "exit N" | "timeout T s")}, all within timeout_s together."""
    import subprocess

    start = time.perf_counter()
    procs = {
        name: subprocess.Popen(
            [sys.executable, __file__, "--ws-child", name, "--ws-phase", "check"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in names
    }
    done = {}
    for name, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=max(1.0, timeout_s - (time.perf_counter() - start)))
            done[name] = (stdout, stderr, f"exit {proc.returncode}")
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            done[name] = (stdout, stderr, f"timeout {timeout_s} s")
    return done


def _ws_header(title: str, ceilings_line: str) -> list[str]:
    """The first lines of a --ws / --ws-ab table: title and time, device and versions, the ceilings."""
    props = torch.cuda.get_device_properties(0)
    return [
        f"# {title}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"device {props.name} ({props.multi_processor_count} SMs), driver {_driver_version()}, "
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}",
        f"{ceilings_line}\n",
    ]


def ws_ab_section(check_timeout_s=100, time_timeout_s=150):
    """The --ws-ab run (see module doc); returns the table lines."""
    import json
    import subprocess

    peak, _ = ceilings()
    lines = _ws_header(
        "Gluon FA3-style kernel: WS_AB variants against the default",
        f"bf16 matmul measured here: {peak / 1e12:.0f} TFLOP/s",
    )
    results, log = [], []
    start = time.perf_counter()
    passed = []
    for name, (stdout, stderr, status) in _ws_checks(WS_AB, check_timeout_s).items():
        log.append(f"== {name} (check): {status}\n{stdout}\n{stderr[-3000:]}")
        checks = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        results += checks
        errs = [c["err"] for c in checks]
        ok = status == "exit 0" and len(errs) == len(WS_CHECKS) and all(e <= BF16_TOL for e in errs)
        lines.append(
            f"- checks {name}: {status}; rel err vs fp64 {', '.join(f'{e:.1e}' for e in errs)}{'' if ok else '; FAILED'}"
        )
        if ok:
            passed.append(name)
    lines.append(f"(checks: {time.perf_counter() - start:.0f} s)\n")
    if passed and passed[0] == WS_AB[0]:
        start = time.perf_counter()
        try:
            proc = subprocess.run(
                [sys.executable, __file__, "--ws-child", "|".join(passed), "--ws-phase", "ab"],
                capture_output=True,
                text=True,
                timeout=time_timeout_s,
            )
            stdout, status = proc.stdout, f"exit {proc.returncode}: {proc.stderr[-2000:]}"
        except subprocess.TimeoutExpired as exc:
            stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            status = f"timeout {time_timeout_s} s"
        log.append(f"== timing: {status}\n{stdout}")
        results += [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        lines.append(
            f"timing child: {status.splitlines()[0] if status else ''} ({time.perf_counter() - start:.0f} s)\n"
        )
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "attention_ws_ab.json").write_text(
            json.dumps(dict(peak=peak, results=results), indent=1)
        )
        Path(os.environ["OUT"], "attention_ws_ab_log.txt").write_text("\n".join(log))
    return lines + ws_ab_table(results)


def ws_ab_table(results):
    """The --ws-ab table from the timing child's JSON lines."""
    lines = [
        "| shape (U, B, S, L, H, d) | variant | round | kernel ms | plan + kernel ms | TFLOP/s (plan + kernel) | err |"
    ]
    lines.append("|---|---|---:|---:|---:|---:|---:|")
    for shape in AB_SHAPES:
        key = list(shape.__dict__.values())
        check = next((r for r in results if r["kind"] == "ab_check" and r["shape"] == key), {"err": {}, "vs": ""})
        for r in results:
            if r["kind"] == "ab_time" and r["shape"] == key:
                err = check["err"].get(r["variant"], float("nan"))
                lines.append(
                    f"| {tuple(key)} | {r['variant']} | {r['round'] + 1} | {r['kernel_ms']:.4f} | {r['plan_kernel_ms']:.4f} | "
                    f"{shape.target_flops / r['plan_kernel_ms'] / 1e9:.0f} | {err:.1e} vs {check['vs'][:10]} |"
                )
    return lines


def ws_profile():
    """--ws-profile: each PROFILE_RUNS kernel compiled and run once, then once more (plan given) between
    cudaProfilerStart/Stop, so that `ncu --profile-from-start off` sees only those launches."""
    from kernels import attention_ws

    runs = []
    for shape, name in PROFILE_RUNS:
        p = make_problem(shape, seed=7)
        plan = attention.plan_tiles(p["cand_to_user"], shape.num_users, shape.num_queries, attention_ws.TILE_M)
        cfg = attention_ws.WSAttentionConfig(**WS_VARIANTS[name])
        args = (p["q"], p["k"], p["v"], p["cand_to_user"], None, 1 / math.sqrt(shape.head_dim), cfg)
        attention_ws.launch_ws(*args, plan=plan)
        runs.append((args, plan))
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for args, plan in runs:
        attention_ws.launch_ws(*args, plan=plan)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("profiled (in order):", [f"{name} at {shape}" for shape, name in PROFILE_RUNS], flush=True)


SCHED_GRID = [
    (op, length, d, ratio)
    for op in ("target", "self+target")
    for length in (512, 1024)
    for d in (64, 128)
    for ratio in (16, 70)
]  # --ws-sched: S = 64, H = 4, B = 1024, ragged kv_len


def ws_sched_section():
    """--ws-sched: the Gluon kernel's items from the atomic counter (dynamic) against the static order and the
    Triton kernel (pick_config), with ragged kv_len, target and causal self + target, as CUDA-graph replays of
    plan + kernel; the dynamic outputs checked against fp64 first. Returns the table lines."""
    from kernels import attention_ws

    configs = {
        "dynamic": attention_ws.WSAttentionConfig(dynamic=True),
        "static": attention_ws.WSAttentionConfig(dynamic=False),
    }
    lines = _ws_header(
        "Gluon kernel: items from the atomic counter vs the static order vs the Triton kernel, ragged kv_len", ""
    )
    lines += [
        "| op | L | d | B/U | dynamic ms | static ms | Triton ms | Triton / dynamic | Triton / static | rel err (dynamic) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for op, length, head_dim, ratio in SCHED_GRID:
        shape = Shape(round(SWEEP_CANDIDATES / ratio), SWEEP_CANDIDATES, 64, length, 4, head_dim)
        p = make_problem(shape, seed=length + head_dim + ratio, with_user_q=op != "target")
        kv_len = torch.randint(0, length + 1, (shape.num_users,), device=DEVICE, dtype=torch.int32)
        args = (p["q"], p["k"], p["v"], p["cand_to_user"], kv_len, 1 / math.sqrt(head_dim))
        out = torch.full_like(p["q"], float("nan"))
        user_out = None if p["user_q"] is None else torch.full_like(p["user_q"], float("nan"))
        extra = {} if user_out is None else dict(user_q=p["user_q"], user_out=user_out)
        tile = attention.pick_config(
            shape.num_candidates * 64 / shape.num_users + (length if user_out is not None else 0), False
        )
        runs = {
            name: (lambda cfg=cfg: attention_ws.launch_ws(*args, cfg, out=out, **extra))
            for name, cfg in configs.items()
        }
        runs["Triton"] = lambda: attention._launch(*args, p["user_q"], True, config=tile, out=out, user_out=user_out)
        runs["dynamic"]()
        if user_out is None:
            err = f"{rel_err(out, ikbo_attention(*(t.double() for t in args[:3]), p['cand_to_user'], kv_len, backend='torch')):.1e}"
        else:
            ref_user, ref_cand = ikbo_self_target_attention(
                p["user_q"].double(), *(t.double() for t in args[:3]), p["cand_to_user"], kv_len, backend="torch"
            )
            err = f"user {rel_err(user_out, ref_user):.1e}, cand {rel_err(out, ref_cand):.1e}"
            del ref_user, ref_cand
        ms = {name: graph_ms(fn) for name, fn in runs.items()}
        lines.append(
            f"| {op} | {length} | {head_dim} | {ratio} | {ms['dynamic']:.4f} | {ms['static']:.4f} | {ms['Triton']:.4f} | "
            f"{ms['Triton'] / ms['dynamic']:.2f} | {ms['Triton'] / ms['static']:.2f} | {err} |"
        )
        print(lines[-1], flush=True)
        del p, out, user_out
        torch.cuda.empty_cache()
    return lines


def _driver_version() -> str:
    import subprocess

    try:
        return (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            )
            .stdout.strip()
            .splitlines()[0]
        )
    except (OSError, IndexError, subprocess.SubprocessError):
        return "?"


def ws_section(check_timeout_s=110, time_timeout_s=60):
    """The --ws run (see module doc); returns the table lines."""
    import json
    import subprocess

    peak, bandwidth = ceilings()
    lines = _ws_header(
        "Gluon FA3-style kernel vs the Triton kernel",
        f"ceilings measured here: bf16 matmul {peak / 1e12:.0f} TFLOP/s, copy {bandwidth / 1e12:.2f} TB/s",
    )
    results = {"peak": peak, "bandwidth": bandwidth, "triton": {}, "ws": []}
    for shape in WS_SHAPES:  # the Triton kernel (default config) and, at the canonical shape, the baseline
        p = make_problem(shape, seed=7)
        scale = 1 / math.sqrt(shape.head_dim)
        ref = fp64_target(p)
        config = attention.pick_config(shape.num_candidates * shape.num_queries / shape.num_users, False)
        out = torch.full_like(p["q"], float("nan"))  # the Triton kernel: a config given, so no dispatch to ws
        attention._launch(p["q"], p["k"], p["v"], p["cand_to_user"], None, scale, config=config, out=out)
        err = rel_err(out, ref)
        plan = attention.plan_tiles(p["cand_to_user"], shape.num_users, shape.num_queries, config.block_m)
        kernel = [
            timed(
                lambda: attention._launch(
                    p["q"], p["k"], p["v"], p["cand_to_user"], None, scale, config=config, plan=plan
                )
            )
            for _ in range(2)
        ]
        full = timed(lambda: attention._launch(p["q"], p["k"], p["v"], p["cand_to_user"], None, scale, config=config))
        base = timed(lambda: baseline(p)) if shape == CANONICAL else float("nan")
        # the public op as served: input checks, plan + (dispatched) kernel, the flag readback
        public = timed(lambda: ikbo_attention(p["q"], p["k"], p["v"], p["cand_to_user"], backend="triton"))
        public_err = rel_err(ikbo_attention(p["q"], p["k"], p["v"], p["cand_to_user"], backend="triton"), ref)
        results["triton"][str(shape)] = dict(
            kernel_ms=kernel, plan_kernel_ms=full, err=err, baseline_ms=base, public_ms=public, public_err=public_err
        )
        del p, out, ref
    torch.cuda.empty_cache()
    log = []

    def collect(name, phase, stdout, stderr, status, seconds):
        log.append(f"== {name} ({phase}): {status}\n{stdout}\n{stderr[-3000:]}")
        for line in stdout.splitlines():
            if line.startswith("{"):
                results["ws"].append(json.loads(line))
        results["ws"].append(dict(kind="status", variant=name, phase=phase, status=status, seconds=seconds))

    # checks (and the compilations) of all variants at once, then the timings one at a time
    start = time.perf_counter()
    for name, (stdout, stderr, status) in _ws_checks(WS_VARIANTS, check_timeout_s).items():
        collect(name, "check", stdout, stderr, status, time.perf_counter() - start)
    for name in WS_VARIANTS:
        if any(r["kind"] == "status" and r["variant"] == name and r["status"] != "exit 0" for r in results["ws"]):
            continue  # a variant that failed or hung in its checks is not timed
        start = time.perf_counter()
        try:
            proc = subprocess.run(
                [sys.executable, __file__, "--ws-child", name, "--ws-phase", "time"],
                capture_output=True,
                text=True,
                timeout=time_timeout_s,
            )
            collect(name, "time", proc.stdout, proc.stderr, f"exit {proc.returncode}", time.perf_counter() - start)
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            collect(name, "time", out, "", f"timeout {time_timeout_s} s", time.perf_counter() - start)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "attention_ws.json").write_text(json.dumps(results, indent=1))
        Path(os.environ["OUT"], "attention_ws_log.txt").write_text("\n".join(log))
    return lines + ws_table(results)


def ws_table(results):
    """The --ws table from its results (see ws_section)."""
    peak = results["peak"]
    lines = [
        "| shape (U, B, S, L, H, d) | provider | kernel ms (round 1 / 2) | plan + kernel ms | TFLOP/s (plan + kernel) | % of matmul | err vs fp64 |"
    ]
    lines.append("|---|---|---:|---:|---:|---:|---:|")
    for shape in WS_SHAPES:
        key = tuple(shape.__dict__.values())
        flops = shape.target_flops
        tri = results["triton"][str(shape)]
        rows = [("Triton kernel (default)", tri)]
        rows += [(r["variant"], r) for r in results["ws"] if r["kind"] == "time" and tuple(r["shape"]) == key]
        if shape == CANONICAL:
            lines.append(
                f"| {key} | baseline (index_select + SDPA) | | {tri['baseline_ms']:.3f} | {flops / tri['baseline_ms'] / 1e9:.0f} | "
                f"{100 * flops / tri['baseline_ms'] / 1e-3 / peak:.0f} | |"
            )
        if "public_ms" in tri:
            lines.append(
                f"| {key} | public op ikbo_attention (dispatch, checks, readback) | | {tri['public_ms']:.3f} | "
                f"{flops / tri['public_ms'] / 1e9:.0f} | {100 * flops / tri['public_ms'] / 1e-3 / peak:.0f} | {tri['public_err']:.1e} |"
            )
        for name, r in rows:
            ms = r["plan_kernel_ms"]
            lines.append(
                f"| {key} | {name} | {r['kernel_ms'][0]:.3f} / {r['kernel_ms'][1]:.3f} | {ms:.3f} | {flops / ms / 1e9:.0f} | "
                f"{100 * flops / (ms * 1e-3) / peak:.0f} | {r['err']:.1e} |"
            )
    lines.append("\nChecks (rel err vs fp64, NaN-poisoned outputs; WS_CHECKS order) and status per variant:")
    for name in WS_VARIANTS:
        errs = [f"{r['err']:.1e}" for r in results["ws"] if r["kind"] == "check" and r["variant"] == name]
        status = "; ".join(
            f"{r['phase']} {r['status']} ({r['seconds']:.0f} s)"
            for r in results["ws"]
            if r["kind"] == "status" and r["variant"] == name
        )
        bad = sum(
            1 for r in results["ws"] if r["kind"] == "check" and r["variant"] == name and not r["err"] <= BF16_TOL
        )
        lines.append(f"- {name}: {status}; checks {', '.join(errs) or 'none'}{f'; {bad} FAILED' if bad else ''}")
    return lines


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", choices=("full", "corners", "none"), default="full")
    parser.add_argument("--no-flex", action="store_true")
    parser.add_argument("--tune", action="store_true", help="also time the TUNE_CONFIGS at the canonical shape")
    parser.add_argument(
        "--variants", action="store_true", help="time the Triton kernel's tiles of VARIANTS side by side"
    )
    parser.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny shapes")
    parser.add_argument(
        "--host-cpu", action="store_true", help="host µs per call without a GPU (stand-in driver), then exit"
    )
    parser.add_argument(
        "--ws", action="store_true", help="the Gluon kernel's variants against the Triton kernel, then exit"
    )
    parser.add_argument(
        "--ws-ab", action="store_true", help="the Gluon kernel's WS_AB variants in alternation, then exit"
    )
    parser.add_argument("--ws-profile", action="store_true", help="PROFILE_RUNS once each for ncu, then exit")
    parser.add_argument(
        "--ws-sched", action="store_true", help="the Gluon kernel's item scheduling with ragged kv_len, then exit"
    )
    parser.add_argument("--ws-child", help=argparse.SUPPRESS)
    parser.add_argument("--ws-phase", choices=("check", "time", "ab"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if os.environ.get("OUT"):  # the tables land there: make it rather than lose a finished run
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
    if args.ws_child and args.ws_phase == "ab":
        ws_ab_child(args.ws_child.split("|"))
        return
    if args.ws_child:
        ws_child(args.ws_child, args.ws_phase)
        return
    if args.ws:
        print("\n".join(ws_section()), flush=True)
        return
    if args.ws_ab:
        print("\n".join(ws_ab_section()), flush=True)
        return
    if args.ws_profile:
        ws_profile()
        return
    if args.ws_sched:
        print("\n".join(ws_sched_section()), flush=True)
        return
    if args.host_cpu:
        print("\n".join(host_cpu()))
        return
    canonical = SMOKE_CANONICAL if SMOKE else CANONICAL
    points = {"full": SWEEP, "corners": CORNERS, "none": []}[args.sweep]
    header = [f"# IKBO attention benchmark, {datetime.date.today()}"]
    if not SMOKE:
        props = torch.cuda.get_device_properties(0)
        header.append(
            f"device {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, triton {triton.__version__}"
        )
        jobs = [("target", canonical, None), ("fused", canonical, None), ("self", canonical, None)]
        jobs += [("target", canonical, c) for c in TUNE_CONFIGS] if args.tune else []
        jobs += (
            [(kind, canonical, c) for c in VARIANTS.values() for kind in ("target", "fused")] if args.variants else []
        )
        jobs += [("flex", canonical, None)] if not args.no_flex else []
        jobs += [("target", s, None) for s in sweep_shapes(points)]
        header.append(f"compiled {len(jobs)} kernel variants in worker processes: {warm_up(jobs):.0f} s")
    peak, bandwidth = ceilings()
    header.append(f"ceilings measured here: bf16 matmul {peak / 1e12:.0f} TFLOP/s, copy {bandwidth / 1e12:.2f} TB/s\n")
    print("\n".join(header), flush=True)
    lines = header + canonical_section(canonical, peak, bandwidth, not (args.no_flex or SMOKE), args.tune)
    print("\n".join(lines[len(header) :]), flush=True)
    more = self_target_section(canonical, peak)
    print("\n".join(more), flush=True)
    lines += more
    if args.variants:
        more = variants_section(canonical, peak)
        print("\n".join(more), flush=True)
        lines += more
    if os.environ.get("OUT") and not SMOKE:
        Path(os.environ["OUT"], "attention_host_profile.txt").write_text(host_profile(canonical))
    if points:
        more = sweep_section(points)
        print("\n".join(more), flush=True)
        lines += more
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "attention_bench.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
