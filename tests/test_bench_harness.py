"""ikbo_backend/perf/harness.py on the CPU: a provider that leaves a NaN-poisoned element unwritten or computes the
wrong values fails its fp64 check and is not timed, an optional provider that raises is a note, the tables are
written to $OUT, and a run with a failed provider exits with status 1."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ikbo_backend.perf.harness import Bench, Case, Provider, max_rel_err, nan_like


def _case(x: torch.Tensor) -> Case:
    ref = (2 * x).double()

    def into(out):  # writes all but the last row: a poisoned buffer shows it
        out[:-1] = 2 * x[:-1]
        return out

    def unavailable():
        raise RuntimeError("no such backend here")

    providers = {
        "baseline": Provider(lambda: 2 * x),
        "right": Provider(lambda: x + x, host=True, graph=True),
        "unwritten row": Provider(lambda: into(torch.empty_like(x)), lambda: into(nan_like(x))),
        "wrong": Provider(lambda: 3 * x),
        "optional": Provider(unavailable, optional=True),
    }
    return Case(providers, ref, flops=2.0 * x.numel(), min_bytes=8.0 * x.numel(), baseline="baseline", title="t")


def test_checks_time_and_report(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # what --smoke asks for
    monkeypatch.setenv("OUT", str(tmp_path))
    bench = Bench("harness_check", smoke=True)
    x = torch.randn(6, 5, dtype=torch.float32)
    results = bench.table(_case(x), tol=1e-6)
    assert results["right"].err <= 1e-6 and results["right"].ms > 0
    assert math.isnan(results["right"].graph_ms) and math.isnan(results["right"].host_us)  # GPU-only timings
    for name in ("unwritten row", "wrong"):
        assert results[name].failed and math.isnan(results[name].ms)  # not timed
    assert math.isnan(results["unwritten row"].err)
    assert results["optional"].note.startswith("unavailable: RuntimeError") and not results["optional"].failed
    points = [(dict(n=n), lambda n=n: _case(torch.randn(n, 3))) for n in (2, 4)]
    bench.sweep("s", points, ["baseline", "right", "absent"], tol=1e-6)
    with pytest.raises(SystemExit, match="6 provider"):  # "unwritten row" and "wrong" of the table and each point
        bench.finish()
    text = (tmp_path / "harness_check.md").read_text()
    assert "| provider |" in text and "| right |" in text and "FAILED" in text
    assert "| n | baseline ms | right ms | × baseline, right |" in text and "absent" not in text
    raw = json.loads((tmp_path / "harness_check.json").read_text())
    assert [len(t.get("results", t.get("points"))) for t in raw] == [5, 2]


def test_rel_err_of_tuples_and_heads():
    ref = torch.randn(4, 3, dtype=torch.float64)
    out = torch.cat([ref, torch.randn(2, 3, dtype=torch.float64)]).float()  # the reference covers the head
    assert max_rel_err(out, ref) < 1e-6
    assert max_rel_err((out, 2 * out), (ref, ref)) == pytest.approx(1.0, rel=1e-6)
    assert math.isnan(max_rel_err((out, nan_like(out)), (ref, ref)))
