#!/usr/bin/env python3
"""SM clock, power and throttle reasons of the GPU under each kernel's sustained load (docs/perf.md, 2026-11-30 13:32).

    scripts/probe_clocks.py        # on a CUDA GPU; writes $OUT/clock_probe.md (default /tmp/clock_out)

Phases, each ~3 s of back-to-back launches (no L2 flush, no gaps: a server's steady state, unlike
`do_bench`) while `nvidia-smi -lms 50` samples in a side process: idle; cuBLAS bf16 8192³ (the matmul
ceiling's GEMM); the LCE op through s6 at its canonical shape; s6's kernel alone; the attention op's
kernels (plan given) at its canonical shape; cuBLAS again. Per phase: ms a launch (CUDA events), TFLOP/s,
and the median (min–max) of the SM clock, memory clock, power and temperature after the first fifth of
the samples, with the throttle-reason bitmasks seen (0x4: software power cap)."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))  # bench_lce, bench_attention

import torch  # noqa: E402

OUT = Path(os.environ.get("OUT", "/tmp/clock_out"))
FIELDS = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active"
PHASE_S = 3.0
SMI = Path("/tmp/smi_logs")


def smi_fields():
    for fields in (FIELDS, FIELDS.replace("clocks_event_reasons", "clocks_throttle_reasons")):
        r = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"], capture_output=True, text=True
        )
        if r.returncode == 0:
            return fields
    return "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu"


def run_phase(name, fn, fields, flops=None):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    SMI.mkdir(exist_ok=True)
    log = SMI / ("".join(c if c.isalnum() else "_" for c in name) + ".csv")
    with open(log, "w") as sink:
        smi = subprocess.Popen(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-lms", "50"],
            stdout=sink,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(0.3)
        start = time.perf_counter()
        n = 0
        ev0 = torch.cuda.Event(enable_timing=True)
        ev1 = torch.cuda.Event(enable_timing=True)
        ev0.record()
        while time.perf_counter() - start < PHASE_S:
            for _ in range(20):
                fn()
            n += 20
            torch.cuda.synchronize()
        ev1.record()
        torch.cuda.synchronize()
        smi.terminate()
        smi.wait()
    ms = ev0.elapsed_time(ev1) / n
    rows = [line.split(", ") for line in log.read_text().splitlines() if line.strip()]
    rows = rows[len(rows) // 5 :]  # drop the ramp
    sm, mem, power, temp = (_median_range(_column(rows, i)) for i in (1, 2, 3, 4))
    reasons = " ".join(sorted({r[5] for r in rows if len(r) > 5}))
    rate = f"{flops / ms / 1e9:.0f}" if flops else ""
    return f"| {name} | {ms:.4f} | {rate} | {sm} | {mem} | {power} | {temp} | {reasons} | {len(rows)} |"


def _column(rows, i):
    """Field i of every sample that has it as a number."""
    values = []
    for row in rows:
        try:
            values.append(float(row[i]))
        except (ValueError, IndexError):
            pass
    return values


def _median_range(values):
    return f"{statistics.median(values):.0f} ({min(values):.0f}–{max(values):.0f})" if values else "n/a"


def _gemm_phase(name, fields):
    """cuBLAS bf16 8192³ on random operands: the GEMM the benchmarks' matmul ceiling uses."""
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    c = torch.empty_like(a)
    return run_phase(name, lambda: torch.matmul(a, b, out=c), fields, 2 * 8192**3)


def main():
    from bench_lce import CANONICAL, make_problem

    from kernels.linear_compress import PackedLinearCompress
    from kernels.linear_compress_ws import _launch_ws, lce_s6, ws_config

    OUT.mkdir(parents=True, exist_ok=True)
    fields = smi_fields()
    info = subprocess.run(
        [
            "nvidia-smi",
            "--query-gpu=name,driver_version,power.limit,power.default_limit,clocks.max.sm,"
            "clocks.applications.graphics,temperature.gpu",
            "--format=csv",
        ],
        capture_output=True,
        text=True,
    ).stdout
    lines = [
        f"# Clock / power probe, {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}",
        "",
        "```",
        info.strip(),
        "```",
        "",
        f"torch {torch.__version__}, nvidia-smi fields: {fields}",
        "",
        "| phase | ms / launch | TFLOP/s | SM MHz median (min–max) | mem MHz | power W | temp C | throttle reasons (hex) | samples |",
        "|---|---:|---:|---|---|---|---|---|---:|",
    ]
    lines.append(run_phase("idle (sleep)", lambda: time.sleep(0.01), fields))
    lines.append(_gemm_phase("cuBLAS bf16 8192^3", fields))
    p = make_problem(**CANONICAL, seed=7)
    packed = PackedLinearCompress.from_weight(p.weight, CANONICAL["ku"], p.bias)
    num_users, num_candidates, ku, kc, dim, rows = p.shape
    lce_flops = 2 * rows * dim * (num_users * ku + num_candidates * kc)
    out = torch.empty(num_candidates, rows, dim, device="cuda", dtype=p.cand_emb.dtype)
    lines.append(
        run_phase(
            "LCE s6 op (canonical)",
            lambda: lce_s6(packed, p.user_emb, p.cand_emb, p.cand_to_user, out=out),
            fields,
            lce_flops,
        )
    )
    cfg = ws_config(dim, p.cand_emb.element_size())
    lines.append(
        run_phase(
            "LCE s6 kernel alone",
            lambda: _launch_ws(packed, p.cand_emb, out, None, p.cand_to_user, None, cfg),
            fields,
            2 * rows * dim * num_candidates * kc,
        )
    )
    del p, packed, out
    from bench_attention import CANONICAL as ACANON
    from bench_attention import dispatched_kernels, dispatched_plan
    from bench_attention import make_problem as amake

    ap = amake(ACANON, seed=3)
    plan = dispatched_plan(ap, ACANON)
    lines.append(
        run_phase(
            "attention kernels as dispatched (plan given)",
            lambda: dispatched_kernels(ap, plan),
            fields,
            ACANON.target_flops,
        )
    )
    lines.append(_gemm_phase("cuBLAS bf16 8192^3 (again)", fields))
    lines += [
        "",
        "Throttle reason bits (nvidia-smi): 0x1 GPU idle, 0x4 SW power cap, 0x8 HW slowdown, 0x20 SW thermal, "
        "0x40 HW thermal, 0x80 HW power brake; 0x0 none.",
    ]
    (OUT / "clock_probe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
