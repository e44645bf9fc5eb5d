"""Model level: the IKBO and baseline rankers compute the same function, and IKBO never replicates."""

import functools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from stand_ins import ODD_DIMS

from ikbo_backend import transformed
from ikbo_backend.ranker import (
    RankerConfig,
    load_weights,
    make_demo_weights,
    profile_config,
    save_weights,
    weight_shapes,
)
from ikbo_backend.synthetic import make_request, to_tensors
from ikbo_backend.transform import replications_in
from ikbo_backend.variants import build_ranker
from kernels.reference import rel_err

CFG = ODD_DIMS  # no dim equal to the U and B drawn below, so row counts identify tensors
WEIGHTS = make_demo_weights(CFG, seed=int(np.random.default_rng().integers(1 << 30)))


def score(variant, request, weights=WEIGHTS, dtype=torch.float32):
    weights = {k: v.to(dtype) for k, v in weights.items()}
    features, interaction = build_ranker(variant, CFG, weights, backend="torch")
    inputs = to_tensors(request)
    for name in ("user_dense", "cand_dense"):
        inputs[name] = inputs[name].to(dtype)
    with torch.inference_mode():
        return interaction(features(**inputs))


@settings(max_examples=25, deadline=None)
@given(num_users=st.integers(1, 7), num_candidates=st.integers(1, 40), seed=st.integers(0, 2**31))
def test_ikbo_and_baseline_agree_with_fp64(num_users, num_candidates, seed):
    request = make_request(CFG, num_users, num_candidates, np.random.default_rng(seed))
    reference = score("baseline", request, dtype=torch.float64)
    ikbo, baseline = score("ikbo", request), score("baseline", request)
    assert ikbo.shape == (num_candidates, CFG.tasks)
    assert torch.isfinite(ikbo).all()
    assert rel_err(ikbo, reference) <= 1e-5
    assert rel_err(baseline, reference) <= 1e-5
    assert rel_err(ikbo, baseline) <= 1e-5


def test_users_without_candidates_or_history():
    rng = np.random.default_rng()
    request = make_request(CFG, 4, 30, rng)
    request["cand_to_user"] = rng.choice([0, 2], size=30).astype(np.int32)  # users 1 and 3: no candidates
    request["user_history_len"][2] = 0  # user 2: empty history
    assert rel_err(score("ikbo", request), score("baseline", request, dtype=torch.float64)) <= 1e-5


def test_mapping_matters():
    """Scores depend on which user a candidate belongs to (guards against a mapping that is ignored)."""
    rng = np.random.default_rng()
    request = make_request(CFG, 3, 20, rng)
    moved = dict(request, cand_to_user=(request["cand_to_user"] + 1) % 3)
    assert rel_err(score("ikbo", moved), score("ikbo", request)) > 1e-4
    assert rel_err(score("ikbo", moved), score("baseline", moved, dtype=torch.float64)) <= 1e-5


def run_detected(variant, batch_invariant=False):
    num_users, num_candidates = 5, 37  # neither a multiple of the batch-invariant mode's 64-row chunks
    request = make_request(CFG, num_users, num_candidates, np.random.default_rng())
    features, interaction = build_ranker(variant, CFG, WEIGHTS, backend="torch", batch_invariant=batch_invariant)
    return replications_in(lambda: interaction(features(**to_tensors(request))), (), num_users, num_candidates)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_ikbo_never_replicates_user_tensors(batch_invariant):
    assert run_detected("ikbo", batch_invariant) == []


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_detector_catches_the_baseline(batch_invariant):
    assert any("index_select" in op for op in run_detected("baseline", batch_invariant))


def test_weights_roundtrip_carries_config(tmp_path):
    path = tmp_path / "ranker.safetensors"
    save_weights(path, CFG, WEIGHTS)
    cfg, weights = load_weights(path)
    assert cfg == CFG
    assert all(torch.equal(weights[k], WEIGHTS[k]) for k in WEIGHTS)


def test_weights_with_wrong_shape_are_refused(tmp_path):
    path = tmp_path / "ranker.safetensors"
    broken = dict(WEIGHTS, **{"lce.weight": torch.randn(CFG.compressed_tokens, 3)})
    save_weights(path, CFG, broken)
    with pytest.raises(ValueError, match="lce.weight"):
        load_weights(path)


def test_config_rejects_inconsistent_dims():
    with pytest.raises(ValueError, match="heads"):
        RankerConfig(embedding_dim=30, heads=4)
    with pytest.raises(ValueError, match="query_tokens"):
        RankerConfig(compressed_tokens=4, query_tokens=5)


@pytest.mark.parametrize("variant", ["ikbo", "baseline", "transformed"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16bit_compute_matches_fp64(variant, dtype, monkeypatch):
    """The served GPU configs compute the interaction in bfloat16: float32 scores out, close to fp64. The pass's cost
    decision is off here (it times the CPU, which parallel workers load): this is about its 16-bit tolerance."""
    monkeypatch.setattr(transformed, "to_ikbo", functools.partial(transformed.to_ikbo, measure=False))
    rng = np.random.default_rng()
    request = make_request(CFG, int(rng.integers(1, 6)), int(rng.integers(8, 40)), rng)
    reference = score("baseline", request, dtype=torch.float64)
    features, interaction = build_ranker(variant, CFG, WEIGHTS, backend="torch", dtype=dtype)
    with torch.inference_mode():
        scores = interaction(features(**to_tensors(request)))
    assert scores.dtype == torch.float32 and torch.isfinite(scores).all()
    assert 0 < rel_err(scores, reference) <= 2e-2  # 16-bit rounding shows (> 0), within bf16's precision
    if variant == "transformed":  # the pass's own check must accept 16-bit rounding, not serve the baseline
        assert interaction.report.rewritten and not interaction.report.left


def test_compute_dtype_and_profile_errors():
    with pytest.raises(ValueError, match="compute dtype"):
        build_ranker("ikbo", CFG, WEIGHTS, dtype="int8")
    with pytest.raises(ValueError, match="batch_invariant"):
        build_ranker("transformed", CFG, WEIGHTS, batch_invariant=True)
    with pytest.raises(ValueError, match="batch_invariant"):
        build_ranker("ikbo", CFG, WEIGHTS, device="meta", batch_invariant=True)
    with pytest.raises(ValueError, match="profile"):
        profile_config("huge")


def test_large_profile_is_the_gpu_scale_model():
    large = profile_config("large")
    assert large != profile_config("demo") == RankerConfig()
    assert large.head_dim in (64, 128)  # the Triton attention kernels' head dims
    assert large.user_tokens > large.cand_tokens and large.history_length >= 512
    assert weight_shapes(large)["mlp.0.weight"] == (large.mlp_hidden[0], large.mlp_input)
