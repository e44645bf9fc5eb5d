#!/usr/bin/env python3
"""IKBO linear compression benchmark (GPU): providers side by side at the canonical shape, and the B/U sweep.

    scripts/bench_lce.py [--no-sweep] [--ratios 1,16,70] [--candidates 64,1024] [--no-compile]
                         [--configs [s6]] [--no-s6] [--only S0,Triton s4,...] [--smoke]
    (or scripts/bench_kernels.py lce ...)

Canonical shape, bf16: B=1024 candidates, U=15 users with ragged counts, Ku=1024, Kc=500, D=256,
N=512. Providers: S0 eager (baseline: user_emb replicated to B rows, concatenated along K, one
matmul), torch.compile(S0), S1 eager (the op's torch path: two GEMMs + sparse gather-add),
torch.compile(S1) (two GEMMs + `cand_part + user_part[m]`, which inductor fuses into one indirect-
load kernel), the Triton variants s1…s4 and s6 (Gluon, warp-specialized persistent: TMA
producer warp + wgmma consumer warpgroups, `kernels/linear_compress_ws.py`; Hopper only). (s5, the
candidate GEMM with W_c resident in shared memory, was slower everywhere, and s7, s6 with two
pingpong consumer warpgroups, was no faster than s6; both were removed on 2026-11-29:
docs/notes/lce.md.) Metrics: median device ms of a call (the time the GPU is busy with the call's own
kernels and copies, read by CUPTI through torch.profiler, L2 flushed before each call:
ikbo_backend/perf/device_time.py); in the canonical table beside it the call's device span (its first start to its
last end, so with any wait for the host between its launches), the SM clock right after the calls, and the median of `triton.testing.do_bench`
("do_bench ms", CUDA events around the call, which also counts the host's launch time wherever that is
longer than the L2 flush), TFLOP/s of the IKBO work 2·N·D·(U·Ku + B·Kc), % of the floor, where
floor = max(FLOPs / bf16 matmul rate, minimum bytes / copy bandwidth), both ceilings measured in this
run. Every provider's output is checked against an fp64 reference first (Triton outputs poisoned
with NaN before the run). Prints a markdown table; with $OUT set, writes it to $OUT/lce_bench.md.
--smoke runs the same code on the CPU under TRITON_INTERPRET=1 with tiny shapes and wall-clock
timing: a check of this script, not a measurement.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton compiles anything

import torch
import triton
from triton.testing import do_bench_cudagraph

from ikbo_backend.perf.device_time import device_times, event_ms, host_us
from kernels.linear_compress import VARIANTS, PackedLinearCompress, TileConfig
from kernels.linear_compress_ws import WSConfig, _launch_ws, lce_s6, s6_supported, user_gemm, ws_config

CANONICAL = dict(num_users=15, num_candidates=1024, ku=1024, kc=500, dim=256, rows=512)
SWEEP_RATIOS = (1, 4, 16, 70, 256, 1024)
SWEEP_CANDIDATES = (64, 1024, 16384)
SMOKE_CANONICAL = dict(num_users=3, num_candidates=12, ku=20, kc=13, dim=32, rows=24)
SMOKE_SWEEP_CANDIDATES = (4, 16)
DEVICE = "cuda"  # "cpu" with --smoke
DTYPE = torch.bfloat16  # float32 with --smoke (Triton 3.6's interpreter gets bf16 dots wrong)
BF16_TOL = 1e-2
# Alternatives measured beside the defaults with --configs: (variant, config). Warp-specialized
# configs are left out: on the H200 (2026-11-29) the first one never finished (see docs/notes/lce.md).
EXTRA_CONFIGS = [
    ("s3", TileConfig(128, 256, 64, 8, 3, epilogue_split=True)),
    ("s3", TileConfig(128, 256, 64, 8, 4)),
    ("s3", TileConfig(128, 128, 64, 4, 4, epilogue_split=True)),
    ("s4", TileConfig(128, 256, 64, 8, 2, epilogue_split=True)),
    ("s4", TileConfig(128, 128, 64, 8, 4, epilogue_split=True)),
]
S6_EXTRA_CONFIGS = [  # with --configs, beside s6's default (128×256×64, 4 stages, stores waited at K step 1)
    WSConfig(epi_free_at=2),
    WSConfig(stages=3),
    WSConfig(block_d=128, stages=0),  # 128×128 tiles, 64 accumulator registers, 6 stages
]


@dataclass
class Problem:
    user_emb: torch.Tensor  # [U, Ku, D]
    cand_emb: torch.Tensor  # [B, Kc, D]
    cand_to_user: torch.Tensor  # [B] int32, unsorted, ragged counts
    weight: torch.Tensor  # [N, Ku + Kc]
    bias: torch.Tensor  # [N]

    @property
    def shape(self):
        num_users, ku, dim = self.user_emb.shape
        num_candidates, kc, _ = self.cand_emb.shape
        return num_users, num_candidates, ku, kc, dim, self.weight.shape[0]

    def flops(self) -> float:
        num_users, num_candidates, ku, kc, dim, rows = self.shape
        return 2.0 * rows * dim * (num_users * ku + num_candidates * kc)

    def min_bytes(self) -> float:
        """Each input read once, the output written once."""
        num_users, num_candidates, ku, kc, dim, rows = self.shape
        elem = self.user_emb.element_size()
        values = num_users * ku * dim + num_candidates * kc * dim + rows * (ku + kc + 1) + num_candidates * rows * dim
        return float(elem * values + self.cand_to_user.element_size() * num_candidates)


def make_problem(num_users, num_candidates, ku, kc, dim, rows, seed=0) -> Problem:
    """Fresh random inputs on the GPU; the mapping is unsorted with unequal counts per user."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    dtype = DTYPE
    weights = torch.rand(num_users, generator=gen, device=DEVICE) ** 2 + 0.05
    mapping = torch.multinomial(weights, num_candidates, replacement=True, generator=gen).int()
    return Problem(
        torch.randn(num_users, ku, dim, generator=gen, device=DEVICE, dtype=dtype),
        torch.randn(num_candidates, kc, dim, generator=gen, device=DEVICE, dtype=dtype),
        mapping,
        torch.randn(rows, ku + kc, generator=gen, device=DEVICE, dtype=dtype) / (ku + kc) ** 0.5,
        torch.randn(rows, generator=gen, device=DEVICE, dtype=dtype),
    )


def reference(p: Problem, candidates=slice(None)) -> torch.Tensor:
    """fp64 on the GPU, the replicated formula (benchmark check only) → [B', N, D]."""
    tokens = torch.cat([p.user_emb.double()[p.cand_to_user[candidates].long()], p.cand_emb[candidates].double()], dim=1)
    return torch.matmul(p.weight.double(), tokens) + p.bias.double()[:, None]


def rel_err(out, ref) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


# ----------------------------------------------------------------------------- providers


def s0_materialized(user_emb, cand_emb, cand_to_user, weight, bias):
    """S0: user_emb replicated to B rows, concatenated along K, one batched matmul (bias fused)."""
    tokens = torch.cat([user_emb.index_select(0, cand_to_user), cand_emb], dim=1)  # [B, Ku + Kc, D]
    num_candidates, _, dim = tokens.shape
    return torch.baddbmm(
        bias[None, :, None].expand(num_candidates, -1, dim), weight.expand(num_candidates, -1, -1), tokens
    )


def s1_gather(user_emb, cand_emb, cand_to_user, user_weight, cand_weight, bias):
    """S1 for torch.compile: two GEMMs at natural batch sizes, then the gathered add of the [U, N, D] result."""
    user_part = torch.matmul(user_weight, user_emb)  # [U, N, D]
    cand_part = torch.matmul(cand_weight, cand_emb)  # [B, N, D]
    return cand_part + bias[:, None] + user_part[cand_to_user]


def triton_provider(packed, args, variant, config=None):
    """Calls the Triton path; tests pass NaN-poisoned `out` / `user_part` buffers."""
    if variant == "s6":
        return lambda out=None, user_part=None: lce_s6(packed, *args, out=out, user_part=user_part, config=config)
    return lambda out=None, user_part=None: packed._triton(*args, variant, config=config, out=out, user_part=user_part)


WITH_S6 = True  # --no-s6 leaves s6 out
ONLY: tuple[str, ...] = ()  # --only: canonical providers whose names start with one of these


def has_s6(p: Problem) -> bool:
    return WITH_S6 and DEVICE == "cuda" and s6_supported(p.user_emb, p.cand_emb)


def providers(p: Problem, packed: PackedLinearCompress, with_compile: bool, with_configs: str | None):
    """name → (callable returning the output, callable writing into a poisoned output or None)."""
    args = (p.user_emb, p.cand_emb, p.cand_to_user)
    table = {"S0 eager (baseline)": lambda: s0_materialized(*args, p.weight, p.bias)}
    if with_compile:
        s0_compiled = torch.compile(s0_materialized)
        s1_compiled = torch.compile(s1_gather)
        table["torch.compile(S0)"] = lambda: s0_compiled(*args, p.weight, p.bias)
    table["S1 eager (torch path)"] = lambda: packed(*args, backend="torch")
    if with_compile:
        table["torch.compile(S1)"] = lambda: s1_compiled(*args, packed.user_weight, packed.cand_weight, p.bias)
    for variant in VARIANTS:
        table[f"Triton {variant}"] = triton_provider(packed, args, variant)
    if has_s6(p):
        table["Triton s6 (Gluon, warp-specialized)"] = triton_provider(packed, args, "s6")
    table["public op (input checks, untuned default variant)"] = lambda: packed(*args)
    if with_configs == "all":
        for variant, cfg in EXTRA_CONFIGS:
            name = f"Triton {variant} {cfg.block_m}x{cfg.block_d}x{cfg.block_k} w{cfg.num_warps} st{cfg.num_stages}"
            table[name + (" ws" if cfg.warp_specialize else "")] = triton_provider(packed, args, variant, cfg)
    if with_configs in ("all", "s6") and has_s6(p):
        for cfg in S6_EXTRA_CONFIGS:
            cfg = ws_config(p.shape[4], p.cand_emb.element_size(), cfg)
            name = f"Triton s6 {cfg.block_m}x{cfg.block_d}x{cfg.block_k} st{cfg.stages} free@{cfg.epi_free_at}"
            table[name] = triton_provider(packed, args, "s6", cfg)
    if ONLY:
        table = {name: fn for name, fn in table.items() if name.startswith(ONLY)}
    return table


def calibration(p: Problem, packed: PackedLinearCompress, flop_rate, log):
    """The candidate GEMM alone (B·N·D·Kc of the work) through cuBLAS, s2's Triton kernel and the s6
    Gluon kernel (no Y_u, no bias); s6's user GEMM alone (U·N·D·Ku); s6's kernel with its fused
    epilogue (Y_u computed beforehand)."""
    num_users, num_candidates, ku, kc, dim, rows = p.shape
    flops = 2.0 * num_candidates * rows * dim * kc
    out = torch.empty(num_candidates, rows, dim, dtype=p.user_emb.dtype, device=DEVICE)
    cfg = next(iter(packed_configs("s2", p)))
    entries = {
        "cuBLAS: W_c @ cand_emb (torch.matmul)": (lambda: torch.matmul(packed.cand_weight, p.cand_emb), flops),
        "Triton s2 kernel: W_c @ cand_emb": (
            lambda: packed._launch_tile(packed.cand_weight_padded, p.cand_emb, out, None, False, True, cfg),
            flops,
        ),
    }
    if has_s6(p):
        user_part = torch.empty(num_users, rows, dim, dtype=out.dtype, device=DEVICE)
        entries["s6's user GEMM alone: W_u @ user_emb (cuBLAS batched)"] = (
            lambda: user_gemm(packed, p.user_emb, user_part),
            2.0 * num_users * rows * dim * ku,
        )
        s6_cfg = ws_config(dim, p.cand_emb.element_size())
        entries["Gluon s6 kernel: W_c @ cand_emb (warp-specialized, no Y_u, no bias)"] = (
            lambda: _launch_ws(packed, p.cand_emb, out, None, p.cand_to_user, None, s6_cfg),
            flops,
        )
        if ku:
            user_part6 = torch.empty(num_users, rows, dim, dtype=out.dtype, device=DEVICE)
            user_gemm(packed, p.user_emb, user_part6)
            entries["Gluon s6 kernel with the fused epilogue (+ Y_u[m[b]] + bias; Y_u given)"] = (
                lambda: _launch_ws(packed, p.cand_emb, out, user_part6, p.cand_to_user, packed.bias, s6_cfg),
                flops,
            )
    lines = ["| GEMM alone | ms | TFLOP/s | % of bf16 matmul rate |", "| --- | ---: | ---: | ---: |"]
    for name, (fn, flops) in entries.items():
        ms = time_ms(fn)
        rate = flops / (ms * 1e-3)
        lines.append(f"| {name} | {ms:.4f} | {rate / 1e12:.0f} | {100 * rate / flop_rate:.0f}% |")
        log(lines[-1])
    return lines


def packed_configs(variant, p: Problem):
    from kernels.linear_compress import tile_configs

    return tile_configs(variant, p.user_emb.dtype, p.shape[4])


def check(name, fn, p: Problem, ref: torch.Tensor, candidates=slice(None)) -> float:
    """Relative error of `fn` against `ref`; Triton providers write into NaN-poisoned buffers."""
    num_users, num_candidates, ku, kc, dim, rows = p.shape
    if name.startswith("Triton"):
        out = torch.full((num_candidates, rows, dim), float("nan"), dtype=p.user_emb.dtype, device=DEVICE)
        user_part = torch.full((num_users if ku else 0, rows, dim), float("nan"), dtype=p.user_emb.dtype, device=DEVICE)
        fn(out, user_part)
    else:
        out = fn()
    _sync()
    out = out[candidates]
    if not bool(torch.isfinite(out).all()):
        return float("nan")
    return rel_err(out, ref)


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def time_ms(fn) -> float:
    """Median device ms of a call: the GPU's busy time for its own work (device_time.device_ms); wall clock
    (median of 3 runs) under --smoke."""
    return device_times(fn, DEVICE == "cuda")[0]


# ----------------------------------------------------------------------------- ceilings


def measure_ceilings():
    """(bf16 matmul FLOP/s on random 8192³, device copy bytes/s counting read + write)."""
    size, numel = (8192, 2**30) if DEVICE == "cuda" else (256, 2**20)
    a = torch.randn(size, size, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=DEVICE, dtype=torch.bfloat16)
    matmul_ms = time_ms(lambda: a @ b)
    del a, b
    src = torch.randn(numel, device=DEVICE, dtype=torch.bfloat16)  # 2 GiB on the GPU
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src))
    copy_bytes = 2 * src.numel() * src.element_size()
    del src, dst
    return 2 * size**3 / (matmul_ms * 1e-3), copy_bytes / (copy_ms * 1e-3)


def floor_ms(p: Problem, flop_rate, copy_rate) -> float:
    return max(p.flops() / flop_rate, p.min_bytes() / copy_rate) * 1e3


# ----------------------------------------------------------------------------- runs


GRAPH_PROVIDERS = ("Triton s3", "Triton s6")  # graph-safe (s4 takes s3 inside a capture)


def canonical(shape, flop_rate, copy_rate, with_compile, with_configs, log):
    p = make_problem(**shape, seed=1)
    packed = PackedLinearCompress.from_weight(p.weight, shape["ku"], p.bias)
    ref = reference(p)
    floor = floor_ms(p, flop_rate, copy_rate)
    rows = []
    baseline_ms = baseline_events = None
    for name, fn in providers(p, packed, with_compile, with_configs).items():
        try:
            err = check(name, fn, p, ref)
            (ms, span, mhz), events = device_times(fn, DEVICE == "cuda"), event_ms(fn, DEVICE == "cuda")
            host = host_us(fn) if name.startswith("Triton") and DEVICE == "cuda" else float("nan")
            graph = graph_ms(fn) if name.startswith(GRAPH_PROVIDERS) and DEVICE == "cuda" else float("nan")
        except Exception as exc:  # one provider's failure must not end the run
            log(f"  {name}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
            continue
        baseline_ms = baseline_ms or ms
        baseline_events = baseline_events or events
        rows.append(
            dict(
                name=name,
                ms=ms,
                tflops=p.flops() / (ms * 1e-3) / 1e12,
                pct_floor=100 * floor / ms,
                speedup=baseline_ms / ms,
                rel_err=err,
                span_ms=span,
                sm_mhz=mhz,
                do_bench_ms=events,
                speedup_do_bench=baseline_events / events,
                host_us=host,
                graph_ms=graph,
            )
        )
        log(
            f"  {name}: {ms:.4f} ms, span {span:.4f} ms, do_bench {events:.4f} ms, rel err {err:.2e}, host {host:.0f} us/call, graph {graph:.4f} ms"
        )
    lines = (
        calibration(p, packed, flop_rate, log)
        + [""]
        + [
            "| provider | device ms | TFLOP/s | % of floor | × S0 eager | rel err (fp64) | device span ms | SM MHz | do_bench ms "
            "| × S0, do_bench | host µs/call | CUDA-graph ms |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
    )
    lines += [
        "| {name} | {ms:.4f} | {tflops:.0f} | {pct_floor:.0f}% | {speedup:.2f} | {rel_err:.1e} | {span_ms:.4f} | {sm_mhz:.0f} | "
        "{do_bench_ms:.4f} | {speedup_do_bench:.2f} | {host_us:.0f} | {graph_ms:.4f} |".format(**row)
        for row in rows
    ]
    return lines, rows, floor, p


def graph_ms(fn) -> float:
    """Median of CUDA-graph replays: device time without the host's launch overhead."""
    return do_bench_cudagraph(fn, rep=50, return_mode="median")


def sweep(base_shape, candidate_counts, flop_rate, copy_rate, log, with_graph=False, ratios=SWEEP_RATIOS):
    graph_head = " S0 graph ms | s3 graph ms | s6 graph ms |" if with_graph else ""
    lines = [
        "| B | U | B/U | S0 eager ms | Triton s3 ms | Triton s4 ms | Gluon s6 ms | best Triton × S0 | floor ms "
        "| best % of floor | rel err s3 / s4 / s6 | public op ms (default variant) | best Triton × S0, do_bench |"
        + graph_head,
        "|" + " ---: |" * 10 + " --- | ---: | ---: |" + " ---: |" * 3 * with_graph,
    ]
    raw = []
    shape = dict(base_shape)
    points = {}  # (U, B) → B/U; U = max(1, round(B / ratio)) repeats U = 1 past B: measured once
    for num_candidates in candidate_counts:
        for ratio in ratios:
            points.setdefault((max(1, round(num_candidates / ratio)), num_candidates), ratio)
    for (num_users, num_candidates), ratio in points.items():
        shape.update(num_users=num_users, num_candidates=num_candidates)
        p = make_problem(**shape, seed=num_candidates + ratio)
        packed = PackedLinearCompress.from_weight(p.weight, shape["ku"], p.bias)
        head = slice(0, min(num_candidates, 256))
        ref = reference(p, head)
        args = (p.user_emb, p.cand_emb, p.cand_to_user)
        times, events, errs = {}, {}, {}
        for name, fn in [
            ("S0", lambda: s0_materialized(*args, p.weight, p.bias)),
            ("s3", lambda out=None, up=None: packed._triton(*args, "s3", out=out, user_part=up)),
            ("s4", lambda out=None, up=None: packed._triton(*args, "s4", out=out, user_part=up)),
            ("s6", lambda out=None, up=None: lce_s6(packed, *args, out=out, user_part=up)),
            ("op", lambda: packed(*args)),
        ]:
            if name == "s6" and not has_s6(p):
                times[name] = events[name] = float("nan")
                continue
            try:
                if name in ("s3", "s4", "s6"):
                    errs[name] = check("Triton " + name, fn, p, ref, head)
                elif name == "op":
                    errs[name] = check(name, fn, p, ref, head)
                times[name], events[name] = time_ms(fn), event_ms(fn, DEVICE == "cuda")
            except Exception as exc:
                log(f"  sweep B={num_candidates} U={num_users} {name}: FAILED {type(exc).__name__}: {str(exc)[:200]}")
                times[name] = events[name] = float("nan")
        graph = " | | |" if with_graph else ""
        if (
            with_graph and num_candidates <= 1024
        ):  # host overhead matters only for small problems  # s4 is not captured: inside a graph the op takes s3 (see PackedLinearCompress._triton)
            s0_fn = lambda: s0_materialized(*args, p.weight, p.bias)  # noqa: E731
            s3_fn = lambda: packed._triton(*args, "s3")  # noqa: E731
            s6_graph = graph_ms(lambda: lce_s6(packed, *args)) if has_s6(p) else float("nan")
            graph = f" {graph_ms(s0_fn):.4f} | {graph_ms(s3_fn):.4f} | {s6_graph:.4f} |"
        best = min(t for t in (times["s3"], times["s4"], times["s6"]) if t == t)
        best_events = min(t for t in (events["s3"], events["s4"], events["s6"]) if t == t)
        floor = floor_ms(p, flop_rate, copy_rate)
        raw.append(
            dict(
                B=num_candidates,
                U=num_users,
                ratio=ratio,
                floor_ms=floor,
                **{k + "_ms": v for k, v in times.items()},
                **{k + "_do_bench_ms": v for k, v in events.items()},
                **{"err_" + k: v for k, v in errs.items()},
            )
        )
        lines.append(
            f"| {num_candidates} | {num_users} | {num_candidates / num_users:.0f} | {times['S0']:.4f} | "
            f"{times['s3']:.4f} | {times['s4']:.4f} | {times['s6']:.4f} | {times['S0'] / best:.2f} | "
            f"{floor:.4f} | {100 * floor / best:.0f}% | "
            + " / ".join(f"{errs.get(k, float('nan')):.1e}" for k in ("s3", "s4", "s6"))
            + f" | {times['op']:.4f}"
            + (" (rel err {:.1e})".format(errs["op"]) if errs.get("op", 0) > 1e-2 else "")
            + f" | {events['S0'] / best_events:.2f} |"
            + graph
        )
        log(lines[-1])
        del p, packed, ref
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return lines, raw


def ws_probe():
    """s3 with `tl.range(..., warp_specialize=True)` (Triton 3.6's Hopper autoWS) at the canonical shape, once."""
    p = make_problem(**CANONICAL, seed=3)
    packed = PackedLinearCompress.from_weight(p.weight, CANONICAL["ku"], p.bias)
    ref = reference(p)
    for cfg in (
        TileConfig(128, 256, 64, 4, 3, warp_specialize=True),
        TileConfig(128, 128, 64, 4, 3, warp_specialize=True),
    ):
        print(f"ws probe {cfg}: launching", flush=True)
        fn = triton_provider(packed, (p.user_emb, p.cand_emb, p.cand_to_user), "s3", cfg)
        err = check("Triton s3 ws", fn, p, ref)
        print(f"ws probe: rel err {err:.2e}, {time_ms(fn):.4f} ms (device)", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-sweep", action="store_true", help="canonical shape only")
    parser.add_argument("--no-s6", action="store_true", help="leave out s6 (Gluon, warp-specialized)")
    parser.add_argument(
        "--only", default="", help="canonical: only providers whose names start with one of these (comma-separated)"
    )
    parser.add_argument(
        "--candidates", default="", help="sweep: candidate counts B (comma-separated; default 64,1024,16384)"
    )
    parser.add_argument(
        "--ratios", default=",".join(map(str, SWEEP_RATIOS)), help="sweep: B/U ratios (comma-separated)"
    )
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile providers")
    parser.add_argument(
        "--configs",
        nargs="?",
        const="all",
        choices=("all", "s6"),
        help="also time alternative tile configs of s3 / s4 / s6 (all) or of s6 only",
    )
    parser.add_argument("--graph", action="store_true", help="sweep: also time S0, s3 and s6 as CUDA-graph replays")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes on the CPU under the interpreter (checks the script)"
    )
    parser.add_argument(
        "--ws-probe", action="store_true", help="only run s3 with Hopper warp specialization once (wrap in `timeout`)"
    )
    args = parser.parse_args(argv)
    if os.environ.get("OUT"):  # the tables land there: make it rather than lose a finished run
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
    if args.ws_probe:
        return ws_probe()
    global DEVICE, DTYPE, WITH_S6, ONLY
    WITH_S6 = not args.no_s6
    ONLY = tuple(name for name in args.only.split(",") if name)
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("bench_lce --smoke: set TRITON_INTERPRET=1 before Triton is imported (run this file directly)")
        DEVICE, DTYPE, shape, candidate_counts = "cpu", torch.float32, SMOKE_CANONICAL, SMOKE_SWEEP_CANDIDATES
        args.no_compile, args.configs, args.graph = True, None, False
    elif not torch.cuda.is_available():
        sys.exit("bench_lce: needs a CUDA device")
    else:
        shape, candidate_counts = CANONICAL, SWEEP_CANDIDATES
    if args.candidates:
        candidate_counts = tuple(int(b) for b in args.candidates.split(","))

    def log(msg):
        print(msg, flush=True)

    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (smoke run, interpreter: not a measurement)"
    header = (
        f"device: {device}, torch {torch.__version__}, triton {triton.__version__}, "
        f"date {datetime.date.today().isoformat()}"
    )
    log(header)
    flop_rate, copy_rate = measure_ceilings()
    ceilings = f"ceilings (this run): bf16 matmul 8192³ {flop_rate / 1e12:.0f} TFLOP/s, device copy {copy_rate / 1e12:.2f} TB/s (read + write)"
    log(ceilings)
    lines, rows, floor, p = canonical(shape, flop_rate, copy_rate, not args.no_compile, args.configs, log)
    shape_line = "canonical: B={num_candidates}, U={num_users} (ragged, unsorted), Ku={ku}, Kc={kc}, D={dim}, N={rows}, {dtype}".format(
        **shape, dtype=str(DTYPE).replace("torch.", "")
    )
    floor_line = (
        f"floor {floor:.4f} ms = max(FLOPs {p.flops() / 1e9:.1f} G / rate = {p.flops() / flop_rate * 1e3:.4f} ms, "
        f"min bytes {p.min_bytes() / 1e6:.0f} MB / copy bw = {p.min_bytes() / copy_rate * 1e3:.4f} ms)"
    )
    report = [header, "", ceilings, "", shape_line, "", floor_line, "", *lines]
    del p
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    raw = {"canonical": rows, "floor_ms": floor, "flop_rate": flop_rate, "copy_rate": copy_rate}
    if not args.no_sweep:
        ratios = tuple(int(r) for r in args.ratios.split(","))
        sweep_lines, raw["sweep"] = sweep(shape, candidate_counts, flop_rate, copy_rate, log, args.graph, ratios)
        report += [
            "",
            "sweep (Ku={ku}, Kc={kc}, D={dim}, N={rows}; U = round(B / ratio), at least 1):".format(**shape),
            "",
            *sweep_lines,
        ]
    text = "\n".join(report)
    print("\n" + text, flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "lce_bench.md").write_text(text + "\n")
        Path(os.environ["OUT"], "lce_bench.json").write_text(json.dumps(raw, indent=1, default=str))
    return text


if __name__ == "__main__":
    main(sys.argv[1:])
