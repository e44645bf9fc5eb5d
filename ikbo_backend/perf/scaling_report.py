"""The serving layouts of scripts/gpu_scaling_run.sh side by side, from its work directory: candidates/s
(summed over the servers of a layout), the ratio to the first layout, p50 / p99, and the CPU use of
tritonserver and the python-backend stubs (top).

    python -m ikbo_backend.perf.scaling_report WORK "LAYOUT ..." CONCURRENCY ...
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path


def _name(layout: str) -> str:
    return layout.replace(":", "_").replace(",", "_")


def point_rows(work: Path, layout: str, concurrency: str) -> list[dict]:
    """perf_sweep's rows of one point: one per server (a servers layout has one per GPU, each at its share
    of the load); [] when any is missing."""
    name = _name(layout)
    paths = sorted(work.glob(f"{name}_c{concurrency}_s*/sweep.csv")) or [work / f"{name}_c{concurrency}" / "sweep.csv"]
    found = [next(csv.DictReader(p.open()), None) for p in paths if p.exists()]
    return [r for r in found if r] if len(found) == len(paths) else []


def cpu_use(work: Path, layout: str, concurrency: str) -> str:
    """CPU % (top) of the tritonserver processes and of the python-backend stubs, summed per kind."""
    path = work / f"cpu_{_name(layout)}_c{concurrency}.txt"
    if not path.exists():
        return "–"
    use = {"tritonserver": 0.0, "triton_python": 0.0}
    for line in path.read_text().split("threads of")[0].splitlines():
        fields = line.split()
        for kind in use:
            if len(fields) > 9 and fields[-1].startswith(kind):
                use[kind] += float(fields[8])
    return f"{use['tritonserver']:.0f} / {use['triton_python']:.0f}"


def table(work: Path, layouts: list[str], levels: list[str]) -> str:
    lines = [
        "## Layouts side by side (perf_analyzer, client side; concurrency = requests in flight in all)",
        "",
        "| layout | concurrency | candidates/s | vs the first layout | p50 / p99 ms | CPU %: tritonserver / stubs (top) |",
        "|---|---:|---:|---:|---:|---|",
    ]
    first = {}
    for layout in layouts:
        for c in levels:
            found = point_rows(work, layout, c)
            if not found:
                lines.append(f"| {layout} | {c} | not run | | | |")
                continue
            total = sum(float(r["candidates_per_s"]) for r in found)
            first.setdefault(c, total)
            p50, p99 = (max(float(r[key]) for r in found) for key in ("p50_ms", "p99_ms"))
            lines.append(
                f"| {layout} | {c} | {total:,.0f} | **{total / first[c]:.2f}×** | {p50:.1f} / {p99:.1f} "
                f"| {cpu_use(work, layout, c)} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    print("\n" + table(Path(sys.argv[1]), sys.argv[2].split(), sys.argv[3:]))
