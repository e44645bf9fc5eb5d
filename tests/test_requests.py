"""The request contract: generated requests are valid, and every bad kind is refused by name."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ikbo_backend.ranker import RankerConfig
from ikbo_backend.requests import InvalidRequest, ShapeRanges, validate_request
from ikbo_backend.synthetic import make_request, to_tensors

CFG = RankerConfig()
RANGES = ShapeRanges(users=(1, 32), candidates=(1, 512))


def fresh(num_users=4, num_candidates=50):
    return to_tensors(make_request(CFG, num_users, num_candidates, np.random.default_rng()))


@settings(max_examples=30, deadline=None)
@given(num_users=st.integers(1, 32), num_candidates=st.integers(1, 512), seed=st.integers(0, 2**31))
def test_generated_requests_are_valid(num_users, num_candidates, seed):
    request = to_tensors(make_request(CFG, num_users, num_candidates, np.random.default_rng(seed)))
    validate_request(CFG, RANGES, request)
    assert request["cand_to_user"].shape == (num_candidates,)
    assert int(request["cand_to_user"].max()) < num_users


def _set(request, name, value):
    request[name] = value
    return request


def _poke(request, name, index, value):
    request[name] = request[name].clone()
    request[name][index] = value
    return request


BAD = {
    "wrong dtype": ("user_dense", lambda r: _set(r, "user_dense", r["user_dense"].double()), "dtype"),
    "wrong rank": ("cand_sparse_ids", lambda r: _set(r, "cand_sparse_ids", r["cand_sparse_ids"][:, :, None]), "rank"),
    "wrong width": ("cand_dense", lambda r: _set(r, "cand_dense", r["cand_dense"][:, :-1]), "columns"),
    "mapping length": ("cand_to_user", lambda r: _set(r, "cand_to_user", r["cand_to_user"][:-1]), "rows"),
    "history_len length": (
        "user_history_len",
        lambda r: _set(r, "user_history_len", r["user_history_len"][:-1]),
        "rows",
    ),
    "mapping too large": ("cand_to_user", lambda r: _poke(r, "cand_to_user", 3, 4), "outside"),
    "mapping negative": ("cand_to_user", lambda r: _poke(r, "cand_to_user", 0, -1), "outside"),
    "user id out of table": (
        "user_sparse_ids",
        lambda r: _poke(r, "user_sparse_ids", (1, 2), CFG.user_vocab_size),
        "table",
    ),
    "cand id negative": ("cand_sparse_ids", lambda r: _poke(r, "cand_sparse_ids", (5, 0), -3), "table"),
    "history id out of table": (
        "user_history_ids",
        lambda r: _poke(r, "user_history_ids", (0, 0), CFG.item_vocab_size),
        "table",
    ),
    "history too long": (
        "user_history_len",
        lambda r: _poke(r, "user_history_len", 1, CFG.history_length + 1),
        "outside",
    ),
    "history negative": ("user_history_len", lambda r: _poke(r, "user_history_len", 1, -1), "outside"),
    "NaN dense": ("user_dense", lambda r: _poke(r, "user_dense", (0, 1), float("nan")), "NaN"),
    "Inf dense": ("cand_dense", lambda r: _poke(r, "cand_dense", (7, 2), float("inf")), "Inf"),
    "missing input": ("cand_dense", lambda r: {k: v for k, v in r.items() if k != "cand_dense"}, "missing"),
    "unknown input": ("user_age", lambda r: _set(r, "user_age", torch.ones(4)), "unknown"),
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_bad_request_is_refused_by_name(kind):
    name, corrupt, problem = BAD[kind]
    with pytest.raises(InvalidRequest, match=problem) as caught:
        validate_request(CFG, RANGES, corrupt(fresh()))
    assert caught.value.input_name == name
    assert f"input '{name}'" in str(caught.value)


def test_zero_candidates_and_out_of_range_batches():
    with pytest.raises(InvalidRequest, match="B = 0"):
        validate_request(CFG, RANGES, fresh(3, 0))
    with pytest.raises(InvalidRequest, match="U = 33"):
        validate_request(CFG, RANGES, fresh(33, 40))
    with pytest.raises(InvalidRequest, match="B = 513"):
        validate_request(CFG, RANGES, fresh(2, 513))
