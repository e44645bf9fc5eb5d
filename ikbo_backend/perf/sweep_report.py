"""A sweep's results as CSV, markdown tables (the rankers side by side) and plots (candidates/s, latency)."""

from __future__ import annotations

import csv
import sys
from dataclasses import asdict, fields
from pathlib import Path

from .inputs import mix_shape
from .perf_analyzer import Result

RANKERS = ("baseline_ranker", "ikbo_ranker")  # baseline first: the reference of every ratio
ONLINE_RANKERS = ("baseline_ranker_online", "ikbo_ranker_online")  # one user per request
TRANSFORMED = "transformed_ranker"  # the baseline's code after the IKBO pass: compared with ikbo_ranker
PAIRS = {"batch": RANKERS, "online": ONLINE_RANKERS}
PROTOCOLS = ("http", "grpc")
COLORS = {
    "baseline_ranker": "tab:gray",
    "ikbo_ranker": "tab:green",
    "baseline_ranker_online": "tab:brown",
    "ikbo_ranker_online": "tab:blue",
    TRANSFORMED: "tab:olive",
}


def write_csv(results: list[Result], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[fl.name for fl in fields(Result)])
        writer.writeheader()
        writer.writerows(asdict(r) for r in results)


def _rate(r: Result | None) -> str:
    if r is None or r.status != "ok":
        return r.status.split(":")[0] if r else "–"
    return f"{r.candidates_per_s:,.0f}" + ("†" if "count" in r.mode else "")


def _latency(r: Result | None) -> str:
    return f"{r.p50_ms:.1f} / {r.p99_ms:.1f}" if r and r.status == "ok" else "–"


def markdown_table(results: list[Result]) -> str:
    """One line per (mix, protocol, concurrency, endpoint batch | online): the two rankers side by side."""
    by_key = {(r.mix, r.protocol, r.concurrency, r.ranker): r for r in results}
    lines = [
        "| mix (U:B) | protocol | concurrency | endpoint | baseline candidates/s | IKBO candidates/s | IKBO / baseline "
        "| baseline p50 / p99 ms | IKBO p50 / p99 ms |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    points = [
        (mix, protocol, concurrency, endpoint)
        for mix, protocol, concurrency in dict.fromkeys((r.mix, r.protocol, r.concurrency) for r in results)
        for endpoint, pair in PAIRS.items()
        if any((mix, protocol, concurrency, name) in by_key for name in pair)
    ]
    for mix, protocol, concurrency, endpoint in points:
        base, ikbo = (by_key.get((mix, protocol, concurrency, name)) for name in PAIRS[endpoint])
        ratio = "–"
        if base and ikbo and base.candidates_per_s > 0 and ikbo.candidates_per_s > 0:
            ratio = f"**{ikbo.candidates_per_s / base.candidates_per_s:.2f}×**"
        users, candidates = mix_shape(mix)
        lines.append(
            f"| {mix} ({users}:{candidates}) | {protocol} | {concurrency} | {endpoint} | {_rate(base)} | {_rate(ikbo)} "
            f"| {ratio} | {_latency(base)} | {_latency(ikbo)} |"
        )
    note = (
        "\n\n† at least one measurement fell back to a fixed request count: perf_analyzer's time "
        "windows did not stabilise (shared or noisy machine)."
    )
    return "\n".join(lines) + (note if any("count" in r.mode for r in results if r.status == "ok") else "")


def transformed_table(results: list[Result]) -> str:
    """transformed_ranker (the baseline's code after the IKBO pass) next to the hand-written ikbo_ranker."""
    by_key = {(r.mix, r.protocol, r.concurrency, r.ranker): r for r in results if r.status == "ok"}
    lines = [
        "| mix (U:B) | protocol | concurrency | IKBO candidates/s | transformed candidates/s | transformed / IKBO "
        "| IKBO p50 / p99 ms | transformed p50 / p99 ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for mix, protocol, concurrency in dict.fromkeys((r.mix, r.protocol, r.concurrency) for r in results):
        ikbo = by_key.get((mix, protocol, concurrency, "ikbo_ranker"))
        moved = by_key.get((mix, protocol, concurrency, TRANSFORMED))
        if ikbo and moved:
            lines.append(
                f"| {mix} | {protocol} | {concurrency} | {ikbo.candidates_per_s:,.0f} | {moved.candidates_per_s:,.0f} "
                f"| **{moved.candidates_per_s / ikbo.candidates_per_s:.2f}×** | {_latency(ikbo)} | {_latency(moved)} |"
            )
    return "\n".join(lines)


def _draw(ax, name: str, rs: list[Result], label: str, marker: str, color: str) -> None:
    """One ranker and protocol on one panel: candidates/s over concurrency, or p50 and p99 over candidates/s."""
    if name == "throughput":
        levels = [r.concurrency for r in rs]
        ax.plot(levels, [r.candidates_per_s for r in rs], marker=marker, color=color, label=label)
        ax.set_xlabel("concurrency")
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        return
    x = [r.candidates_per_s for r in rs]
    ax.plot(x, [r.p50_ms for r in rs], marker=marker, color=color, label=f"{label} p50")
    ax.plot(x, [r.p99_ms for r in rs], marker=marker, color=color, linestyle="--", alpha=0.6, label=f"{label} p99")
    ax.set_xlabel("candidates/s")


def plot(results: list[Result], out_dir: Path) -> list[Path]:
    """throughput.png and latency.png, one panel per mix (none when matplotlib is not installed)."""
    try:
        import matplotlib
    except ImportError:  # e.g. a bare GPU machine's Python: the CSV and the table still come out
        print("matplotlib not installed: no plots", file=sys.stderr)
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    good = [r for r in results if r.status == "ok"]
    mixes = list(dict.fromkeys(r.mix for r in good))
    if not mixes:
        return []
    paths = []
    for name, ylabel in (("throughput", "candidates/s"), ("latency", "latency (ms)")):
        fig, axes = plt.subplots(1, len(mixes), figsize=(5 * len(mixes), 4), squeeze=False)
        for ax, mix in zip(axes[0], mixes):
            for ranker in RANKERS + ONLINE_RANKERS + (TRANSFORMED,):
                for protocol, marker in zip(PROTOCOLS, ("o", "s")):
                    rs = sorted(
                        (r for r in good if (r.mix, r.ranker, r.protocol) == (mix, ranker, protocol)),
                        key=lambda r: r.concurrency,
                    )
                    if rs:
                        label = f"{ranker.replace('_ranker', '')} {protocol}"
                        _draw(ax, name, rs, label, marker, COLORS[ranker])
            ax.set_ylim(bottom=0)  # after every line: an earlier set_ylim would freeze the top at the first line's
            users, candidates = mix_shape(mix)
            ax.set_title(f"{mix} (U={users}, B={candidates})")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle("IKBO vs baseline ranker through tritonserver (perf_analyzer)")
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths
