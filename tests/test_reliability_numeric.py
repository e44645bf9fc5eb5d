"""Numeric safety: IKBO and baseline scores are finite for valid requests within the
declared ranges, with extreme but valid values: dense features up to |x| = DENSE_ABS_MAX (and subnormals),
ids at both ends of their tables, history lengths 0 and L, users with no candidates, U and B at the
ends of shape_ranges.json. In process, the demo weights; hypothesis draws the requests.

Near the float32 maximum (|x| ≳ 1.6e38, mixed signs) the first projection overflows, so the contract
bounds dense magnitudes by DENSE_ABS_MAX and validation refuses larger ones.
"""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ikbo_backend.paths import load_shape_ranges
from ikbo_backend.ranker import RankerConfig, make_demo_weights
from ikbo_backend.requests import DENSE_ABS_MAX, InvalidRequest, validate_request
from ikbo_backend.synthetic import make_request, to_tensors
from ikbo_backend.variants import build_ranker

CFG = RankerConfig()
RANGES = load_shape_ranges()
MAGNITUDES = (0.0, 1e-45, 1e-38, 1.0, 1e3, 1e10, 1e20, DENSE_ABS_MAX)
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def rankers():
    weights = make_demo_weights(CFG, seed=0)
    return {variant: build_ranker(variant, CFG, weights) for variant in ("ikbo", "baseline")}


def extreme_request(num_users, num_candidates, seed, magnitude, id_end, history_end, one_user):
    rng = np.random.default_rng(seed)
    r = make_request(CFG, num_users, num_candidates, rng)
    for name in ("user_dense", "cand_dense"):
        signs = rng.choice(np.array([-1.0, 1.0], np.float32), size=r[name].shape)
        r[name] = (signs * np.float32(magnitude)).astype(np.float32)
    if id_end is not None:  # every id at the first or last row of its table
        for name, vocab in (
            ("user_sparse_ids", CFG.user_vocab_size),
            ("cand_sparse_ids", CFG.cand_vocab_size),
            ("user_history_ids", CFG.item_vocab_size),
        ):
            r[name][:] = 0 if id_end == "first" else vocab - 1
    if history_end is not None:
        r["user_history_len"][:] = 0 if history_end == "empty" else CFG.history_length
    if one_user:  # every candidate on user 0: the others have none
        r["cand_to_user"][:] = 0
    return r


def assert_finite(rankers, request):
    tensors = to_tensors(request)
    validate_request(CFG, RANGES, tensors)  # the request is valid
    for variant, (features, interaction) in rankers.items():
        with torch.inference_mode():
            scores = interaction(features(**tensors))
        assert scores.shape == (len(request["cand_dense"]), CFG.tasks)
        assert bool(torch.isfinite(scores).all()), f"{variant}: non-finite scores"


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_users=st.integers(RANGES.users[0], 64),
    num_candidates=st.integers(RANGES.candidates[0], 512),
    seed=st.integers(0, 2**32 - 1),
    magnitude=st.sampled_from(MAGNITUDES),
    id_end=st.sampled_from([None, "first", "last"]),
    history_end=st.sampled_from([None, "empty", "full"]),
    one_user=st.booleans(),
)
def test_scores_finite_for_extreme_valid_requests(
    rankers, num_users, num_candidates, seed, magnitude, id_end, history_end, one_user
):
    assert_finite(rankers, extreme_request(num_users, num_candidates, seed, magnitude, id_end, history_end, one_user))


@pytest.mark.parametrize(
    "num_users,num_candidates",
    [
        (RANGES.users[0], RANGES.candidates[0]),
        (RANGES.users[1], RANGES.candidates[1]),
        (RANGES.users[1], RANGES.users[1]),
    ],
)
def test_scores_finite_at_the_ends_of_the_declared_ranges(rankers, num_users, num_candidates):
    assert_finite(rankers, extreme_request(num_users, num_candidates, 0, DENSE_ABS_MAX, "last", "full", False))


@pytest.mark.parametrize("name", ["user_dense", "cand_dense"])
def test_dense_values_beyond_the_bound_are_refused(name):
    request = extreme_request(4, 32, int(np.random.default_rng().integers(1 << 30)), 1.0, None, None, False)
    request[name][1, 2] = np.float32(np.finfo(np.float32).max)
    with pytest.raises(InvalidRequest, match=f"input '{name}': magnitude .* at index \\[1, 2\\] is above"):
        validate_request(CFG, RANGES, to_tensors(request))
