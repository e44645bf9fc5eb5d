"""scripts/bench_fbgemm.py runs end to end on the CPU (--smoke: TRITON_INTERPRET=1, tiny shapes, FBGEMM's Triton IKBO
kernels beside ours, every provider checked against fp64 before it is timed), where a copy of FBGEMM's
fbgemm_gpu/experimental/ikbo is at .cache/fbgemm_ikbo (git-ignored, not part of this tree: see
ikbo_backend/perf/fbgemm_compare.py). A check that the script works, not a measurement."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FBGEMM_IKBO = ROOT / ".cache" / "fbgemm_ikbo"


@pytest.mark.skipif(
    not (FBGEMM_IKBO / "ikbo" / "ops" / "triton_ikbo_fa.py").is_file(),
    reason=f"no copy of FBGEMM's fbgemm_gpu/experimental/ikbo at {FBGEMM_IKBO} (git-ignored, never in this tree; "
    "ikbo_backend/perf/fbgemm_compare.py says what it holds)",
)
def test_bench_fbgemm_smoke(tmp_path):
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_fbgemm.py"), "--smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ),
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    text = (tmp_path / "fbgemm_compare_lce_attention_float16.md").read_text()
    assert "FBGEMM: pytorch/FBGEMM fbgemm_gpu/experimental/ikbo" in text, text[:2000]
    for row in (
        "| FBGEMM Triton |",
        "| FBGEMM Triton + K padding |",
        "| FBGEMM Triton + sort |",
        "| ours: public op |",
    ):
        assert row in text, row
    assert text.count("× baseline: over FBGEMM Triton") == 4, text[-3000:]  # LCE and attention, two shapes each
    assert "| lce | canonical | float16 |" in text and "| attention | FBGEMM default | float16 |" in text, text[-2000:]
    assert (tmp_path / "fbgemm_compare_lce_attention_float16.json").is_file()
