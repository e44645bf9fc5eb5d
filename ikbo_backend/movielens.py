"""MovieLens-100k as training data: requests of the contract (requests.py) built from real user histories, labels
from the ratings.

The files ship inside the PyPI wheel recbole==1.2.1 (MIT license): `recbole/dataset_example/ml-100k/ml-100k.inter`
(100,000 ratings 1–5 with timestamps), `.user` (943 users: age, gender, occupation, zip code) and `.item` (1,682
movies: release year, genres). They are read in place, located through the installed distribution's metadata:
recbole itself (and its dependency tree) is never imported, and `make setup` installs it with --no-deps.

Request i is drawn from `np.random.default_rng([seed, i])` out of one split's users: `users` users, `candidates`
candidates over them (ragged, `synthetic.ragged_counts`; `cand_to_user` shuffled). Each user's ratings are ordered
by (timestamp, item id) and cut at a drawn position p in [0, n):
- history: the items rated before p, the last L of them, oldest first (MovieLens item ids, 1..1682; 0 pads);
- candidates: the user's next ratings from p on (at most `positive_share` of the user's candidates, fewer where
  fewer ratings follow), then items the user never rated, drawn uniformly;
- labels [B, 3]: rated (a next rating against a drawn item), rating ≥ 4, rating = 5 (a drawn item: 0, 0, 0).

Features (every slot carries data, none is padding):
- user_sparse_ids: slot 0 the user id, then age bucket, gender, occupation and zip prefix (3 characters), then
  crosses of those four (pairs, triples, all four), cycled when the profile has more slots;
- cand_sparse_ids: slot 0 the item id, then release year, genre set and first genre, then their crosses, cycled;
  each slot's values are ranks of its distinct values, modulo the table size (no collision at ML-100k's sizes in
  the served profiles; history ids are item ids modulo the item table);
- user_dense: a fixed random projection of age, gender and the history before the cut (log rating count, mean
  rating, share ≥ 4, share = 5, the share of each genre); cand_dense: one of the genre flags, the scaled release
  year and an unknown-year flag. The projections (`PROJECTION_SEED`) fill any profile's widths and do not change
  with the split's seed.

The split is by user: a seeded permutation holds out `heldout_share` of the users, requests [0, train_requests)
draw training users and later indices held-out ones. A held-out user's ratings enter neither a gradient nor the
popularity counts, so the held-out AUC measures the model on users it never saw (from their features and
histories), not its memory of them. There is no teacher: the reference is item popularity, each task's score the
log count of training users' ratings of the candidate that meet the task's label (a baseline, not a ceiling; its
scores are not probabilities, so it has an AUC and no log-loss).
"""

from __future__ import annotations

import importlib.metadata
import itertools
import math
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import numpy as np
import torch

from .clicks import ClickData, check_sizes, concatenate
from .ranker import RankerConfig
from .synthetic import ragged_counts, to_tensors

PACKAGE, VERSION = "recbole", "1.2.1"
FILES = "recbole/dataset_example/ml-100k/ml-100k"  # + .inter, .user, .item
TASKS = ("rated", "rating ≥ 4", "rating = 5")
AGE_BOUNDS = (18, 25, 35, 45, 50, 56)  # the age groups of MovieLens-1M's user file
PROJECTION_SEED = 20_100  # the dense features' projections, the same for every split seed
SPLIT_KEY = 1 << 30  # default_rng([seed, SPLIT_KEY]) draws the user split; request indices stay below it


def data_files() -> tuple[Path, Path, Path]:
    """The paths of ml-100k.inter, .user and .item inside the installed recbole wheel (located, not imported)."""
    install = f"{sys.executable} -m pip install --no-deps {PACKAGE}=={VERSION} (or `make setup`)"
    try:
        distribution = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"MovieLens-100k ships in the PyPI wheel {PACKAGE}=={VERSION}, which is not installed: {install}"
        ) from None
    paths = tuple(Path(distribution.locate_file(f"{FILES}.{kind}")) for kind in ("inter", "user", "item"))
    missing = [str(path) for path in paths if not path.is_file()]
    if missing:
        raise FileNotFoundError(
            f"MovieLens-100k: {', '.join(missing)} not in {PACKAGE} {distribution.version}: {install}"
        )
    return paths


def _rows(path: Path) -> list[list[str]]:
    """The tab-separated fields of each line of a file, its header left out."""
    lines = path.read_text(encoding="utf-8").splitlines()[1:]
    return [line.split("\t") for line in lines if line]


@lru_cache(maxsize=2)
def read_movielens(inter: Path, user: Path, item: Path) -> SimpleNamespace:
    """The three files as arrays: ratings (user, item, rating, timestamp), users and items sorted by id."""
    ratings = np.array([[int(float(field)) for field in row[:4]] for row in _rows(inter)], dtype=np.int64)
    users = sorted(_rows(user), key=lambda row: int(row[0]))
    items = sorted(_rows(item), key=lambda row: int(row[0]))
    return SimpleNamespace(
        rating_user=ratings[:, 0],
        rating_item=ratings[:, 1],
        rating=ratings[:, 2],
        timestamp=ratings[:, 3],
        user_id=np.array([int(row[0]) for row in users]),
        age=np.array([int(row[1]) for row in users]),
        gender=np.array([row[2] for row in users]),
        occupation=np.array([row[3] for row in users]),
        zip_prefix=np.array([row[4][:3] for row in users]),
        item_id=np.array([int(row[0]) for row in items]),
        year=np.array([row[2] for row in items]),  # "unkonwn" for one movie
        genres=[row[3].split() for row in items],
    )


def rating_labels(ratings: np.ndarray) -> np.ndarray:
    """[n, 3] labels of ratings [n] (`TASKS`): rated, rating ≥ 4, rating = 5."""
    return np.stack([np.ones_like(ratings), ratings >= 4, ratings == 5], axis=1).astype(np.float32)


def codes(values) -> np.ndarray:
    """Each value's rank among the distinct values."""
    return np.unique(values, return_inverse=True)[1].ravel()


def slot_ids(columns: list[np.ndarray], slots: int, vocab_size: int) -> np.ndarray:
    """[rows, slots] ids in [0, vocab_size) of integer feature columns [rows]: slot k < len(columns) holds column k,
    further slots the crosses of columns[1:] (pairs, triples, ...), cycled when they run out; a slot's ids are the
    ranks of its distinct values (of a cross: of value tuples), modulo vocab_size."""
    groups = [(k,) for k in range(len(columns))]
    groups += [
        group for size in range(2, len(columns)) for group in itertools.combinations(range(1, len(columns)), size)
    ]
    ids = [
        np.unique(np.stack([columns[k] for k in groups[slot % len(groups)]], axis=1), axis=0, return_inverse=True)[1]
        for slot in range(slots)
    ]
    return (np.stack([i.ravel() for i in ids], axis=1) % vocab_size).astype(np.int64)


def projection(rows: int, cols: int, key: int) -> np.ndarray:
    """A fixed [rows, cols] Gaussian projection scaled by 1/√rows (`PROJECTION_SEED`, `key`)."""
    return np.random.default_rng([PROJECTION_SEED, key]).standard_normal((rows, cols)) / math.sqrt(rows)


@dataclass(frozen=True)
class MovieLensData:
    """Requests of `users` users and `candidates` candidates from MovieLens-100k; see the module doc. The same
    interface as `clicks.ClickData` (request, batch, train_indices, heldout_indices), without a teacher."""

    cfg: RankerConfig
    users: int = 15  # U per request
    candidates: int = 1024  # B per request
    train_requests: int = 1 << 16
    heldout_requests: int = 32
    seed: int = 0
    heldout_share: float = 0.2  # of the users
    positive_share: float = 0.5  # at most this share of a user's candidates are next ratings

    reference: ClassVar[str] = "popularity"  # batches carry "popularity_logits"

    def __post_init__(self):
        if self.cfg.tasks != len(TASKS):
            raise ValueError(f"cfg.tasks: MovieLens labels {len(TASKS)} tasks {TASKS}, got {self.cfg.tasks}")
        check_sizes(self, SPLIT_KEY)
        if not 0 < self.heldout_share < 1:
            raise ValueError(f"heldout_share: expected in (0, 1), got {self.heldout_share}")
        if not 0 < self.positive_share <= 1:
            raise ValueError(f"positive_share: expected in (0, 1], got {self.positive_share}")
        raw, cfg = read_movielens(*data_files()), self.cfg
        num_users, num_items = len(raw.user_id), len(raw.item_id)
        heldout = round(self.heldout_share * num_users)
        if not self.users <= min(heldout, num_users - heldout):
            raise ValueError(
                f"users: expected ≤ {min(heldout, num_users - heldout)} (the users of a split), got {self.users}"
            )
        split = np.random.default_rng([self.seed, SPLIT_KEY]).permutation(num_users)  # held out: split[:heldout]
        user = np.searchsorted(raw.user_id, raw.rating_user)  # rows of the ratings' users and items
        item = np.searchsorted(raw.item_id, raw.rating_item)
        order = np.lexsort((item, raw.timestamp, user))  # by user, then time, then item
        rated = np.zeros((num_users, num_items), dtype=bool)
        rated[user, item] = True
        by_training_user = ~np.isin(user, split[:heldout])[:, None] & (rating_labels(raw.rating) > 0)  # [ratings, 3]
        popularity = [np.bincount(item[by_training_user[:, t]], minlength=num_items) for t in range(len(TASKS))]
        genre_names = sorted({name for names in raw.genres for name in names})
        genres = np.array([[name in names for name in genre_names] for names in raw.genres], dtype=np.float64)
        year = np.array([int(y) if y.isdigit() else 0 for y in raw.year])  # 0: unknown
        item_raw = np.concatenate([genres, np.where(year > 0, (year - 1990) / 10, 0)[:, None], (year == 0)[:, None]], 1)
        user_columns = [
            raw.user_id,
            np.digitize(raw.age, AGE_BOUNDS),
            codes(raw.gender),
            codes(raw.occupation),
            codes(raw.zip_prefix),
        ]
        item_columns = [
            raw.item_id,
            codes(raw.year),
            codes([" ".join(names) for names in raw.genres]),
            codes([names[0] for names in raw.genres]),
        ]
        tables = SimpleNamespace(
            user_id=raw.user_id,
            item_id=raw.item_id,
            age=raw.age,
            male=raw.gender == "M",
            genres=genres,
            train_users=np.sort(split[heldout:]),
            heldout_users=np.sort(split[:heldout]),
            start=np.searchsorted(user[order], np.arange(num_users)),  # a user's ratings, in time order
            count=np.bincount(user, minlength=num_users),
            rated_item=item[order],
            rated_value=raw.rating[order],
            rated=rated,  # [users, items]
            popularity=np.log1p(np.stack(popularity, axis=1)).astype(np.float32),  # [items, 3]
            user_slots=slot_ids(user_columns, cfg.user_sparse_features, cfg.user_vocab_size),
            item_slots=slot_ids(item_columns, cfg.cand_sparse_features, cfg.cand_vocab_size),
            item_dense=(item_raw @ projection(item_raw.shape[1], cfg.cand_dense_features, 1)).astype(np.float32),
        )
        object.__setattr__(self, "_tables", tables)
        tables.user_projection = projection(len(self.user_features(0, 0)), cfg.user_dense_features, 0)

    def heldout_user_ids(self) -> np.ndarray:
        """The MovieLens user ids of the held-out split, sorted."""
        return self._tables.user_id[self._tables.heldout_users]

    def user_features(self, user: int, cut: int) -> np.ndarray:
        """The raw dense features of user row `user` whose history ends before rating `cut` (time order)."""
        t = self._tables
        before = slice(t.start[user], t.start[user] + cut)
        ratings, genres = t.rated_value[before], t.genres[t.rated_item[before]]
        stats = [ratings.mean() - 3, (ratings >= 4).mean(), (ratings == 5).mean()] if cut else [0.0, 0.0, 0.0]
        profile = genres.mean(axis=0) if cut else np.zeros(genres.shape[1])
        static = [(t.age[user] - 33) / 12, 1.0 if t.male[user] else -1.0, math.log1p(cut) / 5]
        return np.concatenate([static, stats, profile])

    def example(self, index: int) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
        """Request `index` (training users below train_requests, held-out ones from there on), its labels [B, 3]
        float32 and the candidates' MovieLens item ids [B]."""
        if index < 0:
            raise ValueError(f"index: expected ≥ 0, got {index}")
        cfg, t, draw = self.cfg, self._tables, np.random.default_rng([self.seed, index])
        length = cfg.history_length
        users = draw.choice(
            t.train_users if index < self.train_requests else t.heldout_users, self.users, replace=False
        )
        counts = ragged_counts(self.users, self.candidates, draw)
        history = np.zeros((self.users, length), dtype=np.int64)
        history_len = np.zeros(self.users, dtype=np.int32)
        user_raw = np.empty((self.users, t.user_projection.shape[0]))
        items, labels = [], []
        for row, (user, count) in enumerate(zip(users, counts)):
            start, cut = t.start[user], int(draw.integers(0, t.count[user]))
            history_len[row] = min(cut, length)
            seen = t.rated_item[start + cut - history_len[row] : start + cut]
            history[row, : history_len[row]] = t.item_id[seen] % cfg.item_vocab_size
            user_raw[row] = self.user_features(user, cut)
            positives = min(t.count[user] - cut, math.ceil(count * self.positive_share))
            following = slice(start + cut, start + cut + positives)
            unrated = np.flatnonzero(~t.rated[user])
            drawn = draw.choice(unrated, count - positives, replace=count - positives > len(unrated))
            items += [t.rated_item[following], drawn]
            labels += [rating_labels(t.rated_value[following]), np.zeros((len(drawn), len(TASKS)), dtype=np.float32)]
        order = draw.permutation(self.candidates)
        items = np.concatenate(items)[order]
        request = {
            "user_dense": (user_raw @ t.user_projection).astype(np.float32),
            "user_sparse_ids": t.user_slots[users],
            "user_history_ids": history,
            "user_history_len": history_len,
            "cand_dense": t.item_dense[items],
            "cand_sparse_ids": t.item_slots[items],
            "cand_to_user": np.repeat(np.arange(self.users), counts)[order].astype(np.int32),
        }
        return request, np.concatenate(labels)[order], t.item_id[items]

    def request(self, index: int) -> dict[str, np.ndarray]:
        return self.example(index)[0]

    train_indices = ClickData.train_indices  # the same splits of request indices
    heldout_indices = ClickData.heldout_indices

    def batch(self, indices, teacher=None, device="cpu") -> dict[str, torch.Tensor]:
        """Requests `indices` as one request (users and mappings offset) on `device`, with "labels" [B, 3] float32
        and the popularity baseline's "popularity_logits" [B, 3]. `teacher`: None (the labels are the ratings)."""
        if teacher is not None:
            raise ValueError("teacher: MovieLens labels come from the ratings; expected None")
        examples = [self.example(i) for i in indices]
        tensors = to_tensors(concatenate([request for request, _, _ in examples]), device)
        tensors["labels"] = torch.from_numpy(np.concatenate([labels for _, labels, _ in examples])).to(device)
        rows = np.searchsorted(self._tables.item_id, np.concatenate([items for _, _, items in examples]))
        tensors["popularity_logits"] = torch.from_numpy(self._tables.popularity[rows]).to(device)
        return tensors
