"""The kernel benchmark scripts run end to end on the CPU (--smoke: TRITON_INTERPRET=1, tiny shapes,
every provider checked against fp64 before it is timed). A check that the scripts work, not a
measurement; the measured tables come from the GPU (docs/perf.md)."""

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
        (["lce", "--smoke", "--no-sweep"], "lce_bench.md", "| Triton s3 "),
        (["attention", "--smoke", "--sweep", "none"], "attention_bench.md", "| ours: plan + kernel as dispatched"),
    ],
    ids=["lce", "attention"],
)
def test_bench_smoke(argv, table, row, tmp_path):
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_kernels.py"), *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OUT": str(tmp_path)},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    text = (tmp_path / table).read_text()
    assert "| provider |" in text and row in text, text[:2000]
