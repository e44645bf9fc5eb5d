"""The kernel benchmark scripts run end to end on the CPU (--smoke: TRITON_INTERPRET=1, tiny shapes, the
canonical tables and a sweep, every provider checked against fp64 before it is timed), through
scripts/bench_kernels.py. A check that the scripts work, not a measurement; the measured tables come from the GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("argv", "table", "row"),
    [
        (["lce", "--smoke", "--candidates", "4", "--ratios", "4"], "lce_bench.md", "| Triton fused "),
        (["lce", "--smoke", "--backward", "--candidates", "4", "--ratios", "4"], "lce_bench.md", "| ours: backward "),
        (["attention", "--smoke"], "attention_bench.md", "| ours: plan + kernel as dispatched"),
    ],
    ids=["lce", "lce-backward", "attention"],
)
def test_bench_smoke(argv, table, row, tmp_path):
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_kernels.py"), *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OUT": str(tmp_path)},
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    text = (tmp_path / table).read_text()
    assert "| provider |" in text and row in text, text[:2000]
    assert "| B | U | B/U |" in text or "| S | L | d | U |" in text, text[-2000:]  # the sweep's table
