"""ikbo_backend.perf.serving_ab (scripts/serving_ab.py): the repository copy per point, the summary's medians and ratios, and one real
A/B on the CPU (two names for this tree, a tritonserver start per point, perf_analyzer), where a point
that cannot be served gets its reason in its row and the exit status 1."""

import csv
import random
import statistics
from pathlib import Path

import pytest

from ikbo_backend.paths import REPO_ROOT
from ikbo_backend.pbtxt import read_config
from ikbo_backend.perf.serving_ab import Point, Result, copy_model, main, run_order, summary


def test_copy_sets_every_instance_group_and_links_the_tree(tmp_path):
    count = random.randint(2, 9)
    repository = copy_model(REPO_ROOT, "ikbo_ranker", "large", count, tmp_path)
    source = read_config(REPO_ROOT / "model_repository/ikbo_ranker/configs/large.pbtxt")
    copied = read_config(repository / "ikbo_ranker/configs/large.pbtxt")
    assert [g.count for g in copied.instance_group] == [count] * len(source.instance_group)
    source.ClearField("instance_group")
    copied.ClearField("instance_group")
    assert copied == source  # nothing else changed
    assert sorted(p.name for p in repository.iterdir()) == ["ikbo_ranker", "shape_ranges.json"]
    assert (tmp_path / "ikbo_backend").resolve() == REPO_ROOT / "ikbo_backend"
    assert not (tmp_path / "model_repository").is_symlink()


def test_an_ensemble_comes_with_its_steps_and_takes_one_instance_only(tmp_path):
    repository = copy_model(REPO_ROOT, "ikbo_ranker", None, 1, tmp_path / "one")
    steps = {
        s.model_name
        for s in read_config(REPO_ROOT / "model_repository/ikbo_ranker/config.pbtxt").ensemble_scheduling.step
    }
    assert steps and {p.name for p in repository.iterdir()} == {"ikbo_ranker", "shape_ranges.json"} | steps
    with pytest.raises(ValueError, match="no instance_group to set to 2"):
        copy_model(REPO_ROOT, "ikbo_ranker", None, 2, tmp_path / "two")


def test_points_parse_or_say_what_is_wrong():
    trees = {"old": Path("a"), "new": Path("b")}
    assert Point.parse("new:3:12", trees) == Point("new", 3, 12)
    for bad in ("other:1:1", "new:0:1", "new:1", "new:1:x"):
        with pytest.raises(ValueError, match="TREE:INSTANCES:CONCURRENCY"):
            Point.parse(bad, trees)


def test_rounds_alternate_the_order():
    a, b, c = Point("a", 1, 1), Point("b", 1, 1), Point("b", 2, 8)
    assert run_order([a, b, c], 1) == [a, b, c]
    assert run_order([a, b, c], 3) == [a, b, c, c, b, a, a, b, c]


def test_summary_medians_and_ratios():
    draws = {
        (tree, c): [random.uniform(1e5, 1e6) for _ in range(random.randint(1, 4))]
        for tree in ("old", "new")
        for c in (1, 8)
    }
    results = [Result(0, tree, 1, c, "ok", value, 1.0, 2.0) for (tree, c), values in draws.items() for value in values]
    random.shuffle(results)
    results.append(Result(0, "new", 1, 8, "server: not ready"))
    lines = summary(results, ["old", "new"]).splitlines()
    for c in (1, 8):
        old, new = statistics.median(draws[("old", c)]), statistics.median(draws[("new", c)])
        row = next(line for line in lines if line.startswith(f"| 1 | {c} | "))
        assert (
            row
            == f"| 1 | {c} | {old:,.0f} ({len(draws[('old', c)])}) | {new:,.0f} ({len(draws[('new', c)])}) | {new / old:.2f}× |"
        )
    assert "| new | 1 | 8 | server: not ready |" in "\n".join(lines)


@pytest.mark.timeout(400)
def test_a_real_ab_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "ab"
    status = main(
        [
            "--tree",
            f"a={REPO_ROOT}",
            "--tree",
            f"b={REPO_ROOT}",
            "--points",
            "a:1:1",
            "b:1:1",
            "b:2:1",
            "--window-ms",
            "1000",
            "--out",
            str(out),
        ]
    )
    rows = list(csv.DictReader(open(out / "points.csv")))
    assert status == 1  # the third point cannot be served: an ensemble has no instance groups
    assert [(r["tree"], r["status"]) for r in rows[:2]] == [("a", "ok"), ("b", "ok")]
    assert "no instance_group to set to 2" in rows[2]["status"]
    a, b = (float(r["candidates_per_s"]) for r in rows[:2])
    assert a > 0 and b > 0 and float(rows[0]["compute_infer_us"]) > 0
    assert f"| 1 | 1 | {a:,.0f} (1) | {b:,.0f} (1) | {b / a:.2f}× |" in (out / "summary.md").read_text()
    assert all(
        (out / f"{i}_{r['tree']}_n{r['instances']}_c1" / "server.log").exists() for i, r in enumerate(rows[:2], 1)
    )
