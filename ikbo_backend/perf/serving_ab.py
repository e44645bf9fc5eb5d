"""Serving A/B of several trees, point by point: one tritonserver start per point, the trees alternated in
the order given, so that every ratio compares runs of one machine start.

A point is TREE:INSTANCES:CONCURRENCY. For each point the model's directory (with the steps of an
ensemble, and shape_ranges.json) is copied from that tree's model_repository, every instance_group count
of the served config set to INSTANCES, and served by the tree's own `scripts/serve` on free ports: the
tree's own code, its python_inprocess library rebuilt from its backend.c (touched first, for builds that
look at the file's mtime only). Then this tree's `scripts/perf_sweep.py` measures one cell: the model,
one mix, one protocol, concurrency C. The copy's root links every other top-level entry of the tree
(ikbo_backend, kernels, weights, ...), for trees whose model.py files import the packages from there.
The command line is scripts/serving_ab.py's.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..paths import REPO_ROOT
from ..tritonserver import TritonServerError, free_ports, stop, wait_until_ready
from .perf_analyzer import server_side_us
from .repository_copy import copy_models, served_config, set_instances


@dataclass(frozen=True)
class Point:
    tree: str
    instances: int
    concurrency: int

    @classmethod
    def parse(cls, text: str, trees: dict[str, Path]) -> Point:
        parts = text.split(":")
        if len(parts) != 3 or parts[0] not in trees or not all(p.isdigit() and int(p) > 0 for p in parts[1:]):
            raise ValueError(
                f"point {text!r}: expected TREE:INSTANCES:CONCURRENCY with TREE one of {sorted(trees)} "
                "and positive counts"
            )
        return cls(parts[0], int(parts[1]), int(parts[2]))


@dataclass
class Result:
    index: int
    tree: str
    instances: int
    concurrency: int
    status: str  # "ok", else what failed
    candidates_per_s: float = float("nan")
    p50_ms: float = float("nan")
    p99_ms: float = float("nan")
    ready_s: float = float("nan")
    queue_us: float = float("nan")
    compute_input_us: float = float("nan")
    compute_infer_us: float = float("nan")
    compute_output_us: float = float("nan")


def copy_model(tree: Path, model: str, config: str | None, instances: int, root: Path) -> Path:
    """`root`/model_repository with `model` of `tree` (and, for an ensemble, its step models) whose served
    config has `instances` per instance group; `root` links every other top-level entry of `tree`."""
    repository = root / "model_repository"
    copy_models(tree / "model_repository", [model], repository, follow_steps=True, config=config)
    set_instances(served_config(repository / model, config), instances)
    for entry in tree.resolve().iterdir():
        if entry.name != "model_repository" and not (root / entry.name).exists():
            (root / entry.name).symlink_to(entry)
    return repository


def _sweep_argv(args, point: Point, http: int, grpc: int, out: Path) -> list[str]:
    return [
        sys.executable, str(REPO_ROOT / "scripts" / "perf_sweep.py"),
        "--url", f"localhost:{http}", "--grpc-url", f"localhost:{grpc}", "--profile", args.profile,
        "--rankers", args.model, "--mixes", args.mix, "--protocols", args.protocol,
        "--concurrency", str(point.concurrency), "--window-ms", str(args.window_ms), "--out", str(out),
    ]  # fmt: skip


def run_point(index: int, point: Point, tree: Path, args, out: Path) -> Result:
    result = Result(index, point.tree, point.instances, point.concurrency, "ok")
    work = out / f"{index}_{point.tree}_n{point.instances}_c{point.concurrency}"
    work.mkdir(parents=True)
    try:
        repository = copy_model(tree, args.model, args.config, point.instances, work / "copy")
    except (OSError, ValueError) as e:
        result.status = f"copy failed: {e}"
        return result
    backend_source = tree / "ikbo_backend" / "inprocess" / "backend.c"
    if backend_source.exists():
        backend_source.touch()
    http, grpc, metrics = free_ports(3)
    command = [sys.executable, "scripts/serve", "--model-repository", str(repository)]
    command += ["--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)]
    command += [] if args.config is None else ["--config", args.config]
    log_path = work / "server.log"
    with open(log_path, "wb") as log:
        server = subprocess.Popen(command, cwd=tree, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        start = time.monotonic()
        wait_until_ready(
            server, f"localhost:{http}", args.ready_timeout, lambda: log_path.read_text(errors="replace")[-3000:]
        )
        result.ready_s = time.monotonic() - start
        with open(work / "sweep.txt", "wb") as sweep_log:
            subprocess.run(
                _sweep_argv(args, point, http, grpc, work / "sweep"),
                stdout=sweep_log, stderr=subprocess.STDOUT, timeout=args.point_timeout, check=False,
            )  # fmt: skip
        sweep_csv = work / "sweep" / "sweep.csv"
        rows = list(csv.DictReader(open(sweep_csv))) if sweep_csv.exists() else []
        if not rows or rows[0]["status"] != "ok":
            result.status = f"perf_analyzer: {rows[0]['status'] if rows else 'no result'} (see {work / 'sweep.txt'})"
            return result
        result.candidates_per_s, result.p50_ms, result.p99_ms = (
            float(rows[0][k]) for k in ("candidates_per_s", "p50_ms", "p99_ms")
        )
        for run_log in (work / "sweep" / "runs").glob("*.log"):
            for name, value in server_side_us(run_log.read_text(errors="replace")).items():
                setattr(result, name, value)
    except TritonServerError as e:
        result.status = f"server: {str(e).splitlines()[0]} (see {log_path})"
    except subprocess.TimeoutExpired:
        result.status = f"perf_sweep over {args.point_timeout} s"
    finally:
        stop(server)
    return result


def run_order(points: list[Point], rounds: int) -> list[Point]:
    """The points `rounds` times, every second round reversed: A B, B A, A B, ..."""
    return [point for r in range(rounds) for point in (points if r % 2 == 0 else points[::-1])]


def summary(results: list[Result], tree_names: list[str]) -> str:
    """Markdown: a row per point as run; then per instances and concurrency each tree's median
    candidates/s and its ratio to the first tree."""
    lines = [
        "| # | tree | instances | c | candidates/s | p50 / p99 ms | server: queue / compute input / infer / output µs "
        "| ready s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if r.status != "ok":
            lines.append(f"| {r.index} | {r.tree} | {r.instances} | {r.concurrency} | {r.status} | | | |")
            continue
        server = " / ".join(
            f"{v:.0f}" for v in (r.queue_us, r.compute_input_us, r.compute_infer_us, r.compute_output_us)
        )
        lines.append(
            f"| {r.index} | {r.tree} | {r.instances} | {r.concurrency} | {r.candidates_per_s:,.0f} "
            f"| {r.p50_ms:.1f} / {r.p99_ms:.1f} | {server} | {r.ready_s:.0f} |"
        )
    reference = tree_names[0]
    medians_header = " | ".join(f"{t}: median candidates/s (runs)" for t in tree_names)
    ratios_header = " | ".join(f"{t} / {reference}" for t in tree_names[1:])
    lines += ["", f"| instances | c | {medians_header} | {ratios_header} |"]
    lines.append("|---:|---:|" + "---:|" * (2 * len(tree_names) - 1))
    for instances, concurrency in sorted({(r.instances, r.concurrency) for r in results}):
        medians = {}
        for tree in tree_names:
            values = [
                r.candidates_per_s
                for r in results
                if (r.tree, r.instances, r.concurrency) == (tree, instances, concurrency) and r.status == "ok"
            ]
            medians[tree] = (statistics.median(values), len(values)) if values else None
        cells = [f"{m[0]:,.0f} ({m[1]})" if m else "–" for m in medians.values()]
        ratios = [
            f"{medians[t][0] / medians[reference][0]:.2f}×" if medians[t] and medians[reference] else "–"
            for t in tree_names[1:]
        ]
        lines.append(f"| {instances} | {concurrency} | {' | '.join(cells)} | {' | '.join(ratios)} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None, description: str | None = None) -> argparse.Namespace:
    from ..ranker import PROFILES

    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--tree", action="append", required=True, metavar="NAME=PATH",
        help="a tree to serve from (repeat; the first is the reference)",
    )  # fmt: skip
    parser.add_argument("--points", nargs="+", required=True, metavar="TREE:INSTANCES:C", help="in the order run")
    parser.add_argument(
        "--rounds", type=int, default=1, help="run the points this many times, every second round reversed"
    )
    parser.add_argument("--model", default="ikbo_ranker")
    parser.add_argument("--config", help="served config: configs/<name>.pbtxt (default: config.pbtxt, the CPU one)")
    parser.add_argument(
        "--profile",
        help="model dims of the config, for the request files (default: --config if it names a profile, else demo)",
    )
    parser.add_argument("--mix", default="u15_b1024")
    parser.add_argument("--protocol", default="grpc", choices=("grpc", "http"))
    parser.add_argument("--window-ms", type=int, default=3000)
    parser.add_argument("--ready-timeout", type=float, default=400, help="seconds a server gets to be ready")
    parser.add_argument("--point-timeout", type=float, default=300, help="seconds a point's perf_sweep gets")
    parser.add_argument("--budget-s", type=float, help="start no point after this many seconds")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "out" / "serving_ab")
    args = parser.parse_args(argv)
    args.profile = args.profile or (args.config if args.config in PROFILES else "demo")
    trees = {}
    for spec in args.tree:
        name, _, path = spec.partition("=")
        if not name or not path or not (Path(path) / "scripts" / "serve").exists():
            parser.error(f"--tree {spec!r}: expected NAME=PATH of a tree with scripts/serve")
        trees[name] = Path(path).resolve()
    args.trees = trees
    try:
        args.points = [Point.parse(p, trees) for p in args.points]
    except ValueError as e:
        parser.error(str(e))
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: expected at least 1")
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"--out {args.out}: not empty")
    return args


def main(argv=None, description: str | None = None) -> int:
    """Run the A/B of `argv` (scripts/serving_ab.py's flags); 0 when every point ran, else 1."""
    args = parse_args(argv, description)
    args.out.mkdir(parents=True, exist_ok=True)
    started, results, skipped = time.monotonic(), [], []
    for index, point in enumerate(run_order(args.points, args.rounds), 1):
        if args.budget_s is not None and time.monotonic() - started > args.budget_s:
            skipped.append(f"{point.tree}:{point.instances}:{point.concurrency}")
            continue
        result = run_point(index, point, args.trees[point.tree], args, args.out)
        results.append(result)
        print(
            f"[{time.strftime('%H:%M:%S', time.gmtime())}] {result.tree} n{result.instances} c{result.concurrency}: "
            f"{result.status}, {result.candidates_per_s:,.0f} candidates/s",
            flush=True,
        )
    with open(args.out / "points.csv", "w", newline="") as f:
        if results:
            writer = csv.DictWriter(f, fieldnames=list(asdict(results[0])))
            writer.writeheader()
            writer.writerows(asdict(r) for r in results)
    header = (
        f"# Serving A/B, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {args.model}, "
        f"config {args.config or 'config.pbtxt'}, mix {args.mix}, {args.protocol}, {args.window_ms} ms windows\n\n"
    )
    header += "".join(f"- {n}: {p}\n" for n, p in args.trees.items())
    text = header + "\n" + summary(results, list(args.trees))
    text += f"\nSkipped (budget): {' '.join(skipped)}\n" if skipped else ""
    (args.out / "summary.md").write_text(text)
    print(text)
    return 0 if results and all(r.status == "ok" for r in results) else 1
