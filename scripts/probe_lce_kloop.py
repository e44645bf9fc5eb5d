#!/usr/bin/env python3
"""Where s6's time goes (issue 3, docs/notes/lce.md): its K loop against the matmul ceiling, and fix variants side by side.

    scripts/probe_lce_kloop.py            # on a Hopper GPU: ceilings, variants, K scaling, long K; table last
    scripts/probe_lce_kloop.py --ncu      # one canonical s6 launch (default config), for `ncu -k regex:_lce_ws_kernel`
    scripts/probe_lce_kloop.py --warm N   # worker: compiles variant/shape job N on a tiny problem (disk cache)
    scripts/probe_lce_kloop.py --all      # the device call: the probe, then ncu on --ncu, then the GPU tests
                                          # of tests/test_linear_compress_ws.py with the winner as s6's default
    scripts/probe_lce_kloop.py --call     # a short device call (≤ CALL_BUDGET_S): CALL_ORDER without K scaling
                                          # or ncu, then the GPU tests (all with a winner as the default, else
                                          # those of the timed variant, CALL_TESTS)
    scripts/probe_lce_kloop.py --variants a,b --no-k-scaling   # the probe on those VARIANTS only

Canonical shape as scripts/bench_lce.py (B=1024, U=15 ragged, Ku=1024, Kc=500, D=256, N=512, bf16).
1. Ceilings measured in this run: bf16 matmul 8192³ (random), device copy (read + write).
2. Variants (WSConfig), each checked against fp64 on fresh random inputs with NaN-poisoned out and
   Y_u (bf16 rel err ≤ 1e-2), then timed on one shared input set: median device (busy) time from CUPTI
   with L2 flushed before each call (ikbo_backend/perf/device_time.py; do_bench would add the host's launch time), CUDA-graph
   replay median, the kernel alone (no Y_u, no bias) and the kernel with its fused epilogue (Y_u
   given). The default is timed first and again near the end (the spread of one config within the run,
   the run's noise); with --call the new variant (CALL_ORDER) too.
3. K scaling: the kernel alone at Kc = 500, 1024, 2048, 8192 (8 … 128 K steps of 64 per 128 × 256
   tile): time per tile = a + b · steps on the busiest SM gives the per-tile cost a and the per-step
   cost b, against the ceiling's time for one step; at Kc = 8192 also the whole op (checked on the
   first 64 candidates) and cuBLAS on the same candidate GEMM.
Every Gluon kernel is compiled first by parallel worker processes (--warm) into Triton's disk cache:
the K loop is unrolled, and one compile at Kc = 8192 takes ~45 s.
A watchdog ends the run (exit 3, table so far) if one step takes over STEP_LIMIT_S.
With $OUT set, writes probe_lce_kloop.{md,json} there and, for the tests, the winning config to
$OUT/s6_winner.txt (empty when no variant beats the default by more than the run's noise, eager and in
CUDA graphs: the larger of 1 % and the relative spread between the two timings of the default, or of
the variant where it was timed twice).
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import triton
from triton.testing import do_bench_cudagraph

from ikbo_backend.perf.device_time import device_ms
from kernels.linear_compress import PackedLinearCompress
from kernels.linear_compress_ws import WSConfig, _launch_ws, lce_s6, user_gemm, ws_config
from scripts.bench_lce import CANONICAL, make_problem, measure_ceilings, reference, rel_err

STEP_LIMIT_S = 90
WARM_LIMIT_S = 40  # --no-k-scaling: the warm workers' compiles and tiny runs (~10 s at Kc = 500)
# On the H200 (2026-11-29) the probe reached Kc = 8192 at 27 s, before its worker had compiled that
# kernel (44 s on one free core, longer beside 21 other compiles), compiled it a second time and
# ran past its 85 s stage limit; so the long-K step now waits for its workers, and --all gives the
# probe 110 s.
BF16_TOL = 1e-2
VARIANTS = {  # name → WSConfig (None: s6's default)
    "default": None,
    "free2": WSConfig(epi_free_at=2),  # the last tile's stores waited for at K step 2
    "st3": WSConfig(stages=3),
    "bd128": WSConfig(block_d=128, stages=0),  # 128 × 128 tiles, 6 stages
}
# --call: timed in this order (default and the variant twice: the run's noise)
CALL_ORDER = ("default", "free2", "default", "free2")
CALL_TESTS = "gpu and free-at-2"  # the GPU tests of the timed variant, run when no variant wins
CALL_BUDGET_S = 140  # the whole --call run: the probe (≤ 70 s), then the GPU tests with what is left (≤ 65 s)
K_SCALING = (500, 1024, 2048, 8192)
LONG_K = 8192
LONG_K_VARIANTS = ("default",)
DIM, ROWS = CANONICAL["dim"], CANONICAL["rows"]


def run_options(argv=None):
    """(variant names in timing order, whether to run the K scaling) from the command line."""
    argv = sys.argv if argv is None else argv
    if "--variants" in argv:
        order = argv[argv.index("--variants") + 1].split(",")
    else:
        order = list(VARIANTS) + ["default"]
    unknown = [name for name in order if name not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    return order, "--no-k-scaling" not in argv


def warm_jobs(argv=None):
    """(variant, Kc, with_user) for every kernel the run launches; the slowest (long K) first."""
    order, k_scaling = run_options(argv)
    jobs = [(name, LONG_K, user) for name in LONG_K_VARIANTS for user in (True, False)] if k_scaling else []
    jobs += [(name, 500, user) for name in dict.fromkeys(order) for user in (True, False)]
    if k_scaling:
        jobs += [("default", kc, False) for kc in K_SCALING if kc not in (500, LONG_K)]
    return jobs


def warm(index: int):
    """Compile one job's kernels by running it once on a tiny problem (B = 2) with the same specialization."""
    name, kc, with_user = warm_jobs()[index]
    num_candidates = 2
    p = make_problem(
        num_users=1,
        num_candidates=num_candidates,
        ku=CANONICAL["ku"] if with_user else 0,
        kc=kc,
        dim=DIM,
        rows=ROWS,
        seed=0,
    )
    packed = PackedLinearCompress.from_weight(p.weight, p.user_emb.shape[1], p.bias if with_user else None)
    out = torch.empty(num_candidates, ROWS, DIM, dtype=p.cand_emb.dtype, device="cuda")
    if with_user:
        lce_s6(packed, p.user_emb, p.cand_emb, p.cand_to_user, out=out, config=VARIANTS[name])
    else:
        _launch_ws(packed, p.cand_emb, out, None, p.cand_to_user, None, ws_config(DIM, 2, VARIANTS[name]))
    torch.cuda.synchronize()


class Watchdog:
    """Ends the process (exit 3) after printing the table so far, if one step runs past the limit."""

    def __init__(self, report):
        self.report, self.deadline, self.label = report, None, ""
        threading.Thread(target=self._run, daemon=True).start()

    def step(self, label, limit=STEP_LIMIT_S):
        self.label, self.deadline = label, time.monotonic() + limit

    def _run(self):
        while True:
            time.sleep(1)
            if self.deadline is not None and time.monotonic() > self.deadline:
                print(f"WATCHDOG: '{self.label}' ran past its limit; ending the run", flush=True)
                self.report()
                os._exit(3)


def versions() -> str:
    try:
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
    except Exception as exc:
        driver = f"? ({type(exc).__name__})"
    return (
        f"device {torch.cuda.get_device_name()}, driver {driver}, torch {torch.__version__}, "
        f"triton {triton.__version__}, python {sys.version.split()[0]}, "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
    )


def med(fn, calls=100) -> float:
    return device_ms(fn, calls=calls).busy_ms


def graph_med(fn) -> float:
    return do_bench_cudagraph(fn, rep=100, return_mode="median")


def flops(num_users, num_candidates, ku, kc, dim, rows) -> float:
    return 2.0 * rows * dim * (num_users * ku + num_candidates * kc)


def check(name, seed, kc=None, candidates=slice(None)) -> float:
    """rel err of one variant against fp64 on fresh inputs, out and Y_u poisoned with NaN."""
    shape = dict(CANONICAL, kc=kc or CANONICAL["kc"])
    p = make_problem(**shape, seed=seed)
    packed = PackedLinearCompress.from_weight(p.weight, shape["ku"], p.bias)
    out = torch.full((shape["num_candidates"], ROWS, DIM), float("nan"), dtype=p.cand_emb.dtype, device="cuda")
    user_part = torch.full((shape["num_users"], ROWS, DIM), float("nan"), dtype=p.cand_emb.dtype, device="cuda")
    lce_s6(packed, p.user_emb, p.cand_emb, p.cand_to_user, out=out, user_part=user_part, config=VARIANTS[name])
    torch.cuda.synchronize()
    if not bool(torch.isfinite(out).all()):
        return float("nan")
    return rel_err(out[candidates], reference(p, candidates))


def option_args(argv=None) -> list[str]:
    """The run options of this command line, for the warm workers (they must list the same jobs)."""
    argv = sys.argv if argv is None else argv
    args = ["--variants", argv[argv.index("--variants") + 1]] if "--variants" in argv else []
    return args + (["--no-k-scaling"] if "--no-k-scaling" in argv else [])


def main():
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    t_start = time.monotonic()
    order, k_scaling = run_options()
    workers = [
        subprocess.Popen([sys.executable, __file__, "--warm", str(i), *option_args()]) for i in range(len(warm_jobs()))
    ]
    header = versions()
    rows, notes, raw = [], [], {"header": header}

    def table():
        lines = [
            header,
            *notes,
            "",
            "| variant | ms | CUDA-graph ms | TFLOP/s | % of ceiling | rel err | kernel alone ms | kernel + fused epilogue ms |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        lines += [
            f"| {r['name']} | {r['ms']:.4f} | {r['graph_ms']:.4f} | {r['tflops']:.0f} | {r['pct']:.0f}% | "
            f"{r['err']:.1e} | {r['alone_ms']:.4f} | {r['fused_ms']:.4f} |"
            for r in rows
        ]
        lines += raw.get("k_lines", [])
        return "\n".join(lines)

    def save():  # after every measurement: a run cut by its time limit keeps what it measured
        if out_dir:
            (out_dir / "probe_lce_kloop.md").write_text(table() + "\n")
            (out_dir / "probe_lce_kloop.json").write_text(json.dumps(dict(raw, rows=rows), indent=1, default=str))

    def report():
        save()
        print("\n" + table(), flush=True)

    dog = Watchdog(report)
    dog.step("ceilings")
    flop_rate, copy_rate = measure_ceilings()
    raw.update(flop_rate=flop_rate, copy_rate=copy_rate)
    notes.append(f"ceilings: bf16 matmul 8192³ {flop_rate / 1e12:.0f} TFLOP/s, copy {copy_rate / 1e12:.2f} TB/s")
    print(notes[-1], flush=True)

    p = make_problem(**CANONICAL, seed=1)  # the timing inputs, shared by every variant
    packed = PackedLinearCompress.from_weight(p.weight, CANONICAL["ku"], p.bias)
    work = flops(*p.shape)
    num_users, num_candidates = CANONICAL["num_users"], CANONICAL["num_candidates"]
    y_u = torch.empty(num_users, ROWS, DIM, dtype=p.cand_emb.dtype, device="cuda")
    user_gemm(packed, p.user_emb, y_u)
    out = torch.empty(num_candidates, ROWS, DIM, dtype=p.cand_emb.dtype, device="cuda")
    args = (p.user_emb, p.cand_emb, p.cand_to_user)
    failed = set()
    if not k_scaling:  # nothing compiles beside the timings (the long-K compile is not in this run)
        dog.step("warm workers' compiles")
        failed = wait_warm(workers, time.monotonic() + WARM_LIMIT_S)
        notes.append(
            f"warm compiles done at {time.monotonic() - t_start:.0f} s"
            + (f"; not timed (warm run failed or hung): {sorted(failed)}" if failed else "")
        )
        print(notes[-1], flush=True)
    for n, name in enumerate(order):
        if name in failed:
            continue
        dog.step(f"variant {name}")
        cfg = ws_config(DIM, 2, VARIANTS[name])
        label = name if name not in order[:n] else f"{name} (again)"
        try:
            err = check(name, seed=100 + n)
            full = lambda: lce_s6(packed, *args, out=out, config=VARIANTS[name])  # noqa: E731
            ms = med(full)
            graph = graph_med(lambda: lce_s6(packed, *args, config=VARIANTS[name]))
            alone = med(lambda: _launch_ws(packed, p.cand_emb, out, None, p.cand_to_user, None, cfg))
            fused = med(lambda: _launch_ws(packed, p.cand_emb, out, y_u, p.cand_to_user, packed.bias, cfg))
        except Exception as exc:
            print(f"{name}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        rows.append(
            dict(
                name=label,
                variant=name,
                config=asdict(cfg),
                ms=ms,
                graph_ms=graph,
                tflops=work / ms / 1e9,
                pct=100 * work / flop_rate / (ms * 1e-3),
                err=err,
                alone_ms=alone,
                fused_ms=fused,
            )
        )
        print(rows[-1], f"t={time.monotonic() - t_start:.0f}s", flush=True)
        save()
    del p, packed, y_u, out
    torch.cuda.empty_cache()
    if k_scaling:
        k_scaling_probe(dog, raw, workers, flop_rate, num_candidates, t_start, save)
    dog.step("report")
    raw["winner"] = winner = pick_winner(rows, notes)
    if out_dir:
        (out_dir / "s6_winner.txt").write_text(winner)
    for w in workers:  # compiles that the run did not need are not waited for
        try:
            w.wait(timeout=1)
        except subprocess.TimeoutExpired:
            w.kill()
    raw["warm_exit_codes"] = [w.returncode for w in workers]
    notes.append(f"warm workers' exit codes: {raw['warm_exit_codes']}; run {time.monotonic() - t_start:.0f} s")
    report()


def wait_warm(workers, deadline: float) -> set[str]:
    """Wait for the warm workers until deadline, end those still running (a kernel that hangs, e.g. on a
    barrier, hangs its tiny warm run too); the names of the variants whose warm run did not exit 0."""
    failed = set()
    for w, (name, _, _) in zip(workers, warm_jobs()):
        try:
            w.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.kill()
            w.wait()
        if w.returncode != 0:
            failed.add(name)
    return failed


def pick_winner(rows, notes) -> str:
    """The fastest correct variant that beats s6's default by more than the run's noise, eager and in
    CUDA graphs (each name's best timing against the default's best); its WSConfig fields that differ
    from WSConfig() as "name=value,…", or "" where none does. Noise: the larger of 1 % and the relative
    spread between two timings of one name (the default's, and the variant's where it ran twice)."""

    def best(name, key):
        return min(r[key] for r in rows if r["variant"] == name)

    def spread(name, key):
        values = [r[key] for r in rows if r["variant"] == name]
        return (max(values) - min(values)) / min(values) if len(values) > 1 else 0.0

    if not any(r["variant"] == "default" for r in rows):
        return ""
    good = []
    for name in dict.fromkeys(r["variant"] for r in rows if r["variant"] != "default"):
        if not all(r["err"] <= BF16_TOL for r in rows if r["variant"] == name):  # NaN fails too
            continue
        noise = {key: max(0.01, spread("default", key), spread(name, key)) for key in ("ms", "graph_ms")}
        gains = {key: 1 - best(name, key) / best("default", key) for key in ("ms", "graph_ms")}
        notes.append(
            f"{name}: eager {100 * gains['ms']:+.1f} % (noise {100 * noise['ms']:.1f} %), "
            f"graph {100 * gains['graph_ms']:+.1f} % (noise {100 * noise['graph_ms']:.1f} %) against the default"
        )
        if all(gains[key] > noise[key] for key in gains):
            good.append(name)
    if not good:
        notes.append("winner: none (s6's default stays)")
        return ""
    name = min(good, key=lambda n: best(n, "ms"))
    cfg = next(r["config"] for r in rows if r["variant"] == name)
    fields = {k: v for k, v in cfg.items() if v != getattr(WSConfig(), k) and k != "block_d"}
    winner = ",".join(f"{k}={v}" for k, v in fields.items())
    notes.append(f"winner: {name} ({winner})")
    return winner


def k_scaling_probe(dog, raw, workers, flop_rate, num_candidates, t_start, save):
    """K scaling, the kernel alone (no Y_u, no bias), default config, Kc = K_SCALING; fit a + b · steps."""
    # K scaling: the kernel alone (no Y_u, no bias) at 8 … 128 K steps per tile; the busiest SM runs
    # ceil(4096 / 132) = 32 tiles of 128 × 256.
    tiles_busiest = triton.cdiv(
        num_candidates * (ROWS // 128) * (DIM // 256), torch.cuda.get_device_properties(0).multi_processor_count
    )
    k_rows = []
    for kc in K_SCALING:
        dog.step(f"K scaling Kc={kc}", limit=120 if kc == LONG_K else STEP_LIMIT_S)
        if kc == LONG_K:  # wait for the workers' compiles (jobs 0, 1): a second compile here doubles the time
            for w in workers[: 2 * len(LONG_K_VARIANTS)]:
                w.wait()
        q = make_problem(**dict(CANONICAL, kc=kc), seed=kc)
        qp = PackedLinearCompress.from_weight(q.weight, CANONICAL["ku"], q.bias)
        qo = torch.empty(num_candidates, ROWS, DIM, dtype=q.cand_emb.dtype, device="cuda")
        cfg = ws_config(DIM, 2)
        steps = triton.cdiv(kc, cfg.block_k)
        cand_flops = 2.0 * ROWS * DIM * kc * num_candidates
        alone = med(lambda: _launch_ws(qp, q.cand_emb, qo, None, q.cand_to_user, None, cfg), calls=50)
        row = dict(
            kc=kc,
            steps=steps,
            alone_ms=alone,
            alone_tflops=cand_flops / alone / 1e9,
            us_per_tile=alone * 1e3 / tiles_busiest,
        )
        if kc == LONG_K:
            cublas = med(lambda: torch.matmul(qp.cand_weight, q.cand_emb), calls=50)
            row.update(cublas_ms=cublas, cublas_tflops=cand_flops / cublas / 1e9)
            for name in LONG_K_VARIANTS:
                full_ms = med(
                    lambda: lce_s6(qp, q.user_emb, q.cand_emb, q.cand_to_user, out=qo, config=VARIANTS[name]), calls=50
                )
                row[f"{name}_full_ms"] = full_ms
                row[f"{name}_full_tflops"] = flops(*q.shape) / full_ms / 1e9
            del q, qp, qo
            torch.cuda.empty_cache()
            row["err_first64"] = check("default", seed=7, kc=LONG_K, candidates=slice(0, 64))
        k_rows.append(row)
        raw["k_scaling"] = k_rows
        print(row, f"t={time.monotonic() - t_start:.0f}s", flush=True)
        save()
    raw["k_scaling"] = k_rows
    step_ceiling_us = (
        2.0 * 128 * 256 * 64 / (flop_rate / torch.cuda.get_device_properties(0).multi_processor_count) * 1e6
    )
    xs = [r["steps"] for r in k_rows]
    ys = [r["us_per_tile"] for r in k_rows]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    intercept = mean_y - slope * mean_x
    raw.update(step_ceiling_us=step_ceiling_us, per_step_us=slope, per_tile_us=intercept)
    k_lines = [
        "",
        f"K scaling, kernel alone (no Y_u, no bias), default config; {tiles_busiest} tiles of 128 × 256 on the busiest SM; "
        f"one 64-deep step at the ceiling = {step_ceiling_us:.3f} µs per SM",
        "| Kc | K steps | ms | TFLOP/s | % of ceiling | µs per tile |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    k_lines += [
        f"| {r['kc']} | {r['steps']} | {r['alone_ms']:.4f} | {r['alone_tflops']:.0f} | "
        f"{100 * r['alone_tflops'] * 1e12 / flop_rate:.0f}% | {r['us_per_tile']:.2f} |"
        for r in k_rows
    ]
    k_lines.append(
        f"fit: µs per tile = {intercept:.2f} + {slope:.3f} · steps (per step {100 * step_ceiling_us / slope:.0f}% of the ceiling's rate)"
    )
    long_row = k_rows[-1]
    if "cublas_ms" in long_row:
        k_lines.append(
            f"Kc = {LONG_K}: cuBLAS W_c @ cand_emb {long_row['cublas_ms']:.4f} ms ({long_row['cublas_tflops']:.0f} TFLOP/s); "
            + ", ".join(
                f"{n} whole op {long_row[f'{n}_full_ms']:.4f} ms ({long_row[f'{n}_full_tflops']:.0f} TFLOP/s)"
                for n in LONG_K_VARIANTS
            )
            + f"; rel err (first 64 candidates) {long_row['err_first64']:.1e}"
        )
    raw["k_lines"] = k_lines
    save()


def ncu_target():
    """Three canonical s6 launches (default config) on fresh inputs; profile the third."""
    p = make_problem(**CANONICAL, seed=5)
    packed = PackedLinearCompress.from_weight(p.weight, CANONICAL["ku"], p.bias)
    for _ in range(3):
        lce_s6(packed, p.user_emb, p.cand_emb, p.cand_to_user)
    torch.cuda.synchronize()


NCU_SECTIONS = (
    "SpeedOfLight",
    "ComputeWorkloadAnalysis",
    "MemoryWorkloadAnalysis",
    "MemoryWorkloadAnalysis_Tables",
    "WarpStateStats",
    "SchedulerStats",
    "SourceCounters",
)
ALL_BUDGET_S = 190  # the whole --all run; each stage gets what is left, up to its own limit


def _stages(budget_s: float):
    """(out_dir, log, stage): stage(label, cmd, limit, env=None, stdout=None) runs one subprocess with
    the smaller of its limit and what is left of budget_s, and logs its exit code and time."""
    out_dir = Path(os.environ.get("OUT") or "/tmp/probe_lce_out")
    out_dir.mkdir(parents=True, exist_ok=True)
    os.environ["OUT"] = str(out_dir)
    start = time.monotonic()
    log = []

    def stage(label, cmd, limit, env=None, stdout=None):
        left = budget_s - (time.monotonic() - start)
        timeout = min(limit, left - 5)
        if timeout < 10:
            log.append(f"{label}: skipped ({left:.0f} s left)")
            return None
        t = time.monotonic()
        try:
            done = subprocess.run(
                cmd, env=env, timeout=timeout, stdout=stdout, stderr=subprocess.STDOUT if stdout else None
            )
            rc = done.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        log.append(f"{label}: rc {rc}, {time.monotonic() - t:.0f} s (limit {timeout:.0f} s)")
        print(log[-1], flush=True)
        return rc

    return out_dir, log, stage


def _pytest_args(selection: str) -> list[str]:
    import importlib.util

    # one worker per CPU core (16 on the H200 machine): the tests' time is mostly Gluon/Triton compiles
    xdist = ["-n", str(min(16, os.cpu_count() or 8))] if importlib.util.find_spec("xdist") else []
    return [sys.executable, "-m", "pytest", "-q", *xdist, "-k", selection, "tests/test_linear_compress_ws.py"]


def _summary(out_dir, log):
    tail = (
        (out_dir / "pytest_gpu.txt").read_text().strip().splitlines()[-3:]
        if (out_dir / "pytest_gpu.txt").exists()
        else []
    )
    table = (
        (out_dir / "probe_lce_kloop.md").read_text()
        if (out_dir / "probe_lce_kloop.md").exists()
        else "(no probe table)"
    )
    print("\n" + "\n".join(log + tail) + "\n\n" + table, flush=True)


def run_call():
    """A short device call (CALL_BUDGET_S): the probe on CALL_ORDER without K scaling (≤ 70 s), then the
    GPU tests of tests/test_linear_compress_ws.py with what is left: all of them with the winner as s6's
    default (LCE_S6_DEFAULT), else CALL_TESTS."""
    out_dir, log, stage = _stages(CALL_BUDGET_S)
    stage("probe", [sys.executable, __file__, "--variants", ",".join(CALL_ORDER), "--no-k-scaling"], 70)
    winner_file = out_dir / "s6_winner.txt"
    winner = winner_file.read_text().strip() if winner_file.exists() else ""
    env = dict(os.environ, LCE_S6_DEFAULT=winner)
    selection = "gpu" if winner else CALL_TESTS
    with open(out_dir / "pytest_gpu.txt", "w") as f:
        stage(f"GPU tests -k '{selection}' (LCE_S6_DEFAULT='{winner}')", _pytest_args(selection), 65, env=env, stdout=f)
    _summary(out_dir, log)


def run_all():
    """One device call: probe (≤ 110 s), ncu on one canonical launch (≤ 45 s), GPU tests (what is left, ≤ 70 s)."""
    import shutil

    out_dir, log, stage = _stages(ALL_BUDGET_S)
    stage("probe", [sys.executable, __file__], 110)
    ncu = shutil.which("ncu") or next(iter(sorted(Path("/opt/nvidia").glob("nsight-compute/*/ncu"))), None)
    if ncu:
        rep = out_dir / "s6_canonical"
        sections = [arg for name in NCU_SECTIONS for arg in ("--section", name)]
        with open(out_dir / "ncu_log.txt", "w") as f:
            rc = stage(
                "ncu",
                [
                    str(ncu),
                    "--clock-control",
                    "none",
                    "-k",
                    "regex:_lce_ws_kernel",
                    "-s",
                    "2",
                    "-c",
                    "1",
                    *sections,
                    "-f",
                    "-o",
                    str(rep),
                    sys.executable,
                    __file__,
                    "--ncu",
                ],
                45,
                stdout=f,
            )
        if rc == 0:
            for page, suffix in (("details", "txt"), ("raw", "csv"), ("source", "csv")):
                extra = ["--csv"] if suffix == "csv" else []
                extra += ["--print-source", "sass"] if page == "source" else []
                with open(out_dir / f"ncu_{page}.{suffix}", "w") as f:
                    stage(
                        f"ncu --page {page}", [str(ncu), "-i", f"{rep}.ncu-rep", "--page", page, *extra], 20, stdout=f
                    )
    else:
        log.append("ncu: not found")
    winner_file = out_dir / "s6_winner.txt"
    winner = winner_file.read_text().strip() if winner_file.exists() else ""
    env = dict(os.environ, LCE_S6_DEFAULT=winner)
    with open(out_dir / "pytest_gpu.txt", "w") as f:
        stage(f"GPU tests (LCE_S6_DEFAULT='{winner}')", _pytest_args("gpu"), 70, env=env, stdout=f)
    _summary(out_dir, log)


if __name__ == "__main__":
    if "--all" in sys.argv:
        run_all()
    elif "--call" in sys.argv:
        run_call()
    elif "--warm" in sys.argv:
        warm(int(sys.argv[sys.argv.index("--warm") + 1]))
    elif "--ncu" in sys.argv:
        ncu_target()
    else:
        main()
