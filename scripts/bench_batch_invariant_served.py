#!/usr/bin/env python3
"""The online endpoints' batch-invariant mode through a real tritonserver: shipped ("yes") vs "no".

Two temporary copies of the online endpoints (`reliability.repository_copy`, the model.py files
find the packages through symlinks); the "off" copy differs only in the line
`parameters { key: "batch_invariant" value: { string_value: "no" } }` of both config.pbtxt. The
configurations alternate (on, off, on, off, ...), one tritonserver per sweep, each checked over HTTP
to serve the intended parameter, then `scripts/perf_sweep.py --url ...` measures both endpoints
(gRPC, u15_b1024 by default, best of --repeats). Prints every command line, one row per endpoint,
configuration and concurrency (best over all rounds, with each round's figure and load average),
and the on/off ratio (of the best, and per round).

    .venv/bin/python scripts/bench_batch_invariant_served.py                      # 2 rounds, c = 1 2 4
    .venv/bin/python scripts/bench_batch_invariant_served.py --rounds 3 --concurrency 1 2
    .venv/bin/python scripts/bench_batch_invariant_served.py --rounds 3 --report-only          # table of the last run

Writes out/perf/batch_invariant_served/<on|off>.r<round>/ (perf_sweep's CSVs, runs, server log).
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import shlex
import subprocess
import sys
import urllib.request
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

from reliability import ONLINE_MODELS, repository_copy  # noqa: E402

from ikbo_backend.tritonserver import running_tritonserver  # noqa: E402

PARAMETER = re.compile(r'(parameters \{ key: "batch_invariant" value: \{ string_value: ")(yes|no)(" \} \})')


def set_mode(repo: Path, value: str) -> None:
    """Set batch_invariant to `value` in both online configs (exactly one such line each)."""
    for name in ONLINE_MODELS:
        config = repo / name / "config.pbtxt"
        text, n = PARAMETER.subn(lambda m: m.group(1) + value + m.group(3), config.read_text())
        if n != 1:
            raise ValueError(f"{config}: expected one batch_invariant parameter, found {n}")
        config.write_text(text)


def served_mode(http_url: str, model: str) -> str:
    with urllib.request.urlopen(f"http://{http_url}/v2/models/{model}/config", timeout=10) as response:
        return json.load(response)["parameters"]["batch_invariant"]["string_value"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="on/off pairs")
    parser.add_argument("--mix", default="u15_b1024")
    parser.add_argument("--concurrency", nargs="+", default=["1", "2", "4"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--window-ms", type=int, help="perf_sweep's --window-ms (default: its own)")
    parser.add_argument(
        "--report-only", action="store_true", help="no measurement: the table of the sweeps already in --out"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "perf" / "batch_invariant_served")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if not args.report_only:
        measure(args)
    report(args)


def measure(args) -> None:
    with ExitStack() as stack:
        repos = {}
        for mode, value in (("on", "yes"), ("off", "no")):
            repos[mode] = stack.enter_context(repository_copy(ONLINE_MODELS, f"bi-{mode}-"))
            set_mode(repos[mode], value)
        for rnd in range(args.rounds):
            for mode in ("on", "off"):
                out = args.out / f"{mode}.r{rnd}"
                out.mkdir(parents=True, exist_ok=True)
                with running_tritonserver(repos[mode], log_path=out / "tritonserver.log") as server:
                    modes = {m: served_mode(server.http_url, m) for m in ONLINE_MODELS}
                    if set(modes.values()) != {"yes" if mode == "on" else "no"}:
                        raise RuntimeError(f"{mode}: server reports {modes}")
                    cmd = [
                        sys.executable, str(ROOT / "scripts" / "perf_sweep.py"),
                        "--url", server.http_url, "--grpc-url", server.grpc_url,
                        "--rankers", *ONLINE_MODELS, "--mixes", args.mix, "--protocols", "grpc",
                        "--concurrency", *args.concurrency, "--repeats", str(args.repeats), "--aggregate", "best",
                        *(["--window-ms", str(args.window_ms)] if args.window_ms else []),
                        "--out", str(out),
                    ]  # fmt: skip
                    print(
                        f"# round {rnd}, batch_invariant {modes}, repository {repos[mode]}\n{shlex.join(cmd)}",
                        flush=True,
                    )
                    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
                    (out / "perf_sweep.out").write_text(proc.stdout + proc.stderr)
                    print(
                        proc.stdout.strip().splitlines()[2] if proc.stdout.strip() else "", flush=True
                    )  # environment line
                    if proc.returncode:
                        print(f"perf_sweep exit {proc.returncode}, see {out / 'perf_sweep.out'}", flush=True)


def report(args) -> None:
    rows = []  # (mode, round, ranker, concurrency, candidates/s, p50, p99, load1, mode column)
    for rnd in range(args.rounds):
        for mode in ("on", "off"):
            path = args.out / f"{mode}.r{rnd}" / "sweep.csv"
            for r in csv.DictReader(path.open()) if path.exists() else ():
                if r["status"] == "ok":
                    rows.append((mode, rnd, r["ranker"], int(r["concurrency"]), float(r["candidates_per_s"]),
                                 float(r["p50_ms"]), float(r["p99_ms"]), float(r["load1"]), r["mode"]))  # fmt: skip
    print("\nload1 per sweep: " + ", ".join(
        f"{mode}.r{rnd} {min(x[7] for x in rows if x[:2] == (mode, rnd)):.2f}–{max(x[7] for x in rows if x[:2] == (mode, rnd)):.2f}"
        for rnd in range(args.rounds) for mode in ("on", "off") if any(x[:2] == (mode, rnd) for x in rows)
    ))  # fmt: skip
    print(
        "\n| endpoint | concurrency | batch_invariant | candidates/s (best of all) | per round (best of repeats) "
        "| p50 / p99 ms (of the best) | on / off (best of all; per round, best of repeats) |"
    )
    print("|---|---:|---|---:|---|---:|---:|")
    for ranker in ONLINE_MODELS:
        for c in sorted({x[3] for x in rows}):
            best = {}
            for mode in ("on", "off"):
                mine = [x for x in rows if (x[0], x[2], x[3]) == (mode, ranker, c)]
                if not mine:
                    continue
                best[mode] = max(mine, key=lambda x: x[4])
                per_round = " / ".join(
                    f"{max(x[4] for x in mine if x[1] == rnd):,.0f}"
                    for rnd in range(args.rounds)
                    if any(x[1] == rnd for x in mine)
                )
                b = best[mode]
                ratio = ""
                if mode == "off" and "on" in best:
                    on = [x for x in rows if (x[0], x[2], x[3]) == ("on", ranker, c)]
                    pairs = [
                        max(x[4] for x in on if x[1] == rnd) / max(x[4] for x in mine if x[1] == rnd)
                        for rnd in range(args.rounds)
                        if any(x[1] == rnd for x in on) and any(x[1] == rnd for x in mine)
                    ]
                    ratio = (
                        f"**{best['on'][4] / best['off'][4]:.2f}×** (per round "
                        + " / ".join(f"{v:.2f}" for v in pairs)
                        + ")"
                    )
                dagger = "†" if "count" in b[8] else ""
                print(
                    f"| {ranker} | {c} | {'yes' if mode == 'on' else 'no'} | {b[4]:,.0f}{dagger} | {per_round} "
                    f"| {b[5]:.1f} / {b[6]:.1f} | {ratio} |"
                )


if __name__ == "__main__":
    main()
