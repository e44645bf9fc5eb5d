"""MovieLens-100k as training data (ikbo_backend/movielens.py), read from the recbole wheel's files.

- Requests obey the served contract (`validate_request` with the served shape ranges) in every profile and in odd
  dims, at their natural sizes (U user rows, B candidate rows), with no constant dense column.
- The data set is fixed by its seed; held-out users never appear in a training request, nor in the popularity
  counts.
- Labels and histories agree with the raw file, parsed here on its own: a candidate's labels are (rated,
  rating ≥ 4, rating = 5) of its user's rating, or zeros for an unrated item; a history followed by its user's
  rated candidates is a run of that user's ratings in (timestamp, item) order.
- A short CPU training run learns (held-out AUC well above 0.5); a missing recbole is a clear error; recbole is
  never imported.

The data seed is fresh random each run: it is in the failure messages.
"""

import csv
import importlib.metadata
import math
import secrets
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from stand_ins import ODD_DIMS, odd_dims

from ikbo_backend import movielens
from ikbo_backend.movielens import MovieLensData, data_files
from ikbo_backend.paths import load_shape_ranges
from ikbo_backend.ranker import load_weights, profile_config
from ikbo_backend.requests import validate_request
from ikbo_backend.synthetic import to_tensors
from ikbo_backend.training import TrainConfig, Trainer, train

SEED = secrets.randbits(30)
DEMO = profile_config("demo")
TRAIN_REQUESTS = 500


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tab_rows(kind):
    """The rows of ml-100k.<kind> as dicts by header name (type suffixes dropped), parsed with csv."""
    path = dict(zip(("inter", "user", "item"), data_files()))[kind]
    with open(path, newline="", encoding="utf-8") as file:
        rows = list(csv.reader(file, delimiter="\t", quoting=csv.QUOTE_NONE))
    names = [name.split(":")[0] for name in rows[0]]
    return [dict(zip(names, row)) for row in rows[1:] if row]


@pytest.fixture(scope="module")
def raw():
    """ratings: (user, item) → (rating, timestamp); sequences: user → items in (timestamp, item) order; the sorted
    user and item ids."""
    ratings = {
        (int(r["user_id"]), int(r["item_id"])): (float(r["rating"]), int(float(r["timestamp"])))
        for r in tab_rows("inter")
    }
    rated = {}
    for (user, item), (_, timestamp) in ratings.items():
        rated.setdefault(user, []).append((timestamp, item))
    return SimpleNamespace(
        ratings=ratings,
        sequences={user: [item for _, item in sorted(pairs)] for user, pairs in rated.items()},
        users=np.array(sorted(int(r["user_id"]) for r in tab_rows("user"))),
        items=np.array(sorted(int(r["item_id"]) for r in tab_rows("item"))),
    )


def demo_data(cfg=DEMO, **changes):
    settings = dict(users=15, candidates=400, train_requests=TRAIN_REQUESTS, heldout_requests=20, seed=SEED)
    return MovieLensData(cfg, **{**settings, **changes})


def decoded(request, raw):
    """The MovieLens user ids [U] and item ids [B] of a demo-profile request: slot 0 of each holds the rank of the
    id among the file's ids (the tables are larger than the id counts, so no modulo)."""
    return raw.users[request["user_sparse_ids"][:, 0]], raw.items[request["cand_sparse_ids"][:, 0]]


@pytest.mark.parametrize("cfg", [DEMO, profile_config("large"), ODD_DIMS], ids=["demo", "large", "odd"])
def test_requests_obey_the_served_contract(cfg):
    ranges = load_shape_ranges()
    data = MovieLensData(cfg, users=15, candidates=1024, train_requests=TRAIN_REQUESTS, heldout_requests=4, seed=SEED)
    requests = [data.request(i) for i in [0, 1, 2, *data.heldout_indices()]]
    for request in requests:
        validate_request(cfg, ranges, to_tensors(request))
        assert len(request["user_dense"]) == 15 and len(request["cand_dense"]) == 1024  # natural sizes
        assert request["user_history_len"].max() > 0
    counts = np.bincount(requests[0]["cand_to_user"], minlength=15)
    assert counts.min() < counts.max(), f"ragged candidates (seed {SEED})"
    for name in ("user_dense", "cand_dense"):
        columns = np.concatenate([r[name] for r in requests])
        assert (columns.std(axis=0) > 0).all(), f"{name}: a constant column (seed {SEED})"
    for name in ("user_sparse_ids", "cand_sparse_ids"):
        columns = np.concatenate([r[name] for r in requests])
        assert all(len(np.unique(c)) > 1 for c in columns.T), f"{name}: a constant slot (seed {SEED})"
    batch = data.batch([0, 1])
    validate_request(cfg, ranges, {name: batch[name] for name in requests[0]})
    assert batch["labels"].shape == batch["popularity_logits"].shape == (2048, 3)


def test_fixed_by_the_seed():
    first, again, other = demo_data(), demo_data(), demo_data(seed=SEED + 1)
    for index in (3, TRAIN_REQUESTS + 2):
        a, b = first.example(index), again.example(index)
        assert all(np.array_equal(a[0][k], b[0][k]) for k in a[0]) and np.array_equal(a[1], b[1])
        assert np.array_equal(a[2], b[2])
    assert not np.array_equal(first.request(3)["cand_sparse_ids"], first.request(4)["cand_sparse_ids"])
    assert not np.array_equal(first.request(3)["user_sparse_ids"], other.request(3)["user_sparse_ids"])
    assert not np.array_equal(first.heldout_user_ids(), other.heldout_user_ids())
    assert first.heldout_indices() == list(range(TRAIN_REQUESTS, TRAIN_REQUESTS + 20))


def test_heldout_users_are_never_trained_on(raw):
    data = demo_data()
    heldout = set(data.heldout_user_ids().tolist())
    assert len(heldout) == round(0.2 * len(raw.users))
    trained = {u for i in range(200) for u in decoded(data.request(i), raw)[0]}
    tested = {u for i in data.heldout_indices() for u in decoded(data.request(i), raw)[0]}
    assert not trained & heldout and tested <= heldout, f"seed {SEED}"
    assert len(trained) > 0.9 * (len(raw.users) - len(heldout))  # 200 × 15 draws cover the training users
    # popularity: log(1 + count of the training users' ratings of the item that meet each task's label)
    batch = data.batch(data.heldout_indices()[:2])
    request = {name: batch[name].numpy() for name in ("user_sparse_ids", "cand_sparse_ids")}
    _, candidates = decoded(request, raw)
    counts = {}
    for (user, item), (rating, _) in raw.ratings.items():
        if user not in heldout:
            counts[item] = counts.get(item, np.zeros(3)) + [1, rating >= 4, rating == 5]
    want = np.log1p(np.stack([counts.get(int(item), np.zeros(3)) for item in candidates]))
    assert np.allclose(batch["popularity_logits"].numpy(), want, rtol=1e-6)


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_labels_and_histories_follow_the_ratings(raw, split):
    data = demo_data()
    indices = range(6) if split == "train" else data.heldout_indices()[:6]
    length, positive = DEMO.history_length, 0
    for index in indices:
        request, labels, items = data.example(index)
        users, candidates = decoded(request, raw)
        assert np.array_equal(candidates, items)
        for row, (user, item) in enumerate(zip(users[request["cand_to_user"]], candidates)):
            rating = raw.ratings.get((int(user), int(item)))
            want = [0, 0, 0] if rating is None else [1, rating[0] >= 4, rating[0] == 5]
            assert labels[row].tolist() == want, f"request {index}, candidate {row} (seed {SEED})"
        positive += int(labels[:, 0].sum())
        for row, user in enumerate(users):
            sequence = raw.sequences[int(user)]
            count = int(request["user_history_len"][row])
            history = request["user_history_ids"][row, :count].tolist()
            assert (request["user_history_ids"][row, count:] == 0).all()
            mine = request["cand_to_user"] == row
            following = sorted(sequence.index(int(i)) for i in candidates[mine & (labels[:, 0] == 1)])
            assert len(following) <= math.ceil(mine.sum() * data.positive_share)
            starts = [s for s in range(len(sequence) - count + 1) if sequence[s : s + count] == history]
            if count < length:
                starts = [0] if starts[:1] == [0] else []  # a short history is the user's first ratings
            assert any(following == list(range(s + count, s + count + len(following))) for s in starts), (
                f"request {index}, user {user}: history and next ratings are no run of the ratings (seed {SEED})"
            )
    assert positive > 0


def test_short_training_run_learns(tmp_path):
    """A few dozen CPU steps on MovieLens: held-out AUC (users never trained on) well above 0.5; the weights file
    has the served profile's dims; the reference is popularity, without a log-loss."""
    config = TrainConfig(
        source="movielens", steps=60, requests_per_step=2, users=15, candidates=512, eval_every=30,
        heldout_requests=8, seed=SEED, device="cpu", backend="torch", weights=str(tmp_path / "ranker.safetensors"),
        out=str(tmp_path / "run"), progress=False,
    )  # fmt: skip
    summary = train(config)
    evals = summary["history"]["eval"]
    # seen over 5 seeds: 0.69-0.75 after 60 steps, from 0.48-0.51
    assert summary["final"]["auc"] > max(0.62, evals[0]["auc"] + 0.1), f"{evals} (seed {SEED})"
    assert summary["final"]["logloss"] < evals[0]["logloss"]
    reference = summary["reference"]
    assert reference["name"] == "popularity" and "logloss" not in reference and reference["auc"] > 0.6
    assert summary["config"]["source"] == "movielens"
    cfg, _ = load_weights(tmp_path / "ranker.safetensors")
    assert cfg == DEMO
    assert Trainer(config).teacher is None
    assert (tmp_path / "run" / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "recbole" not in sys.modules  # the wheel's files are read, the package never imported


def test_missing_recbole_is_a_clear_error(monkeypatch, tmp_path):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(movielens.importlib.metadata, "distribution", not_installed)
    with pytest.raises(FileNotFoundError, match=r"recbole==1\.2\.1.*pip install --no-deps recbole==1\.2\.1"):
        demo_data()
    config = TrainConfig(source="movielens", device="cpu", out=str(tmp_path / "run"), progress=False)
    with pytest.raises(FileNotFoundError, match="recbole"):
        Trainer(config)

    class Elsewhere:  # installed, without the data files
        version = "0.0"

        @staticmethod
        def locate_file(path):
            return tmp_path / path

    monkeypatch.setattr(movielens.importlib.metadata, "distribution", lambda name: Elsewhere)
    with pytest.raises(FileNotFoundError, match="ml-100k.inter.*not in recbole 0.0"):
        demo_data()


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"users": 400}, "users"),
        ({"users": 20, "candidates": 10}, "users"),
        ({"heldout_share": 1.0}, "heldout_share"),
        ({"positive_share": 0.0}, "positive_share"),
        ({"train_requests": 0}, "train_requests"),
        ({"cfg": odd_dims(tasks=2)}, "tasks"),
    ],
)
def test_bad_settings_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        demo_data(**changes)
