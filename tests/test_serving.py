"""ikbo_backend.serving without a server: weights and ranges resolution, config checks, and the
python-backend request loop driven through a stand-in for triton_python_backend_utils."""

import multiprocessing
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils.dlpack import from_dlpack, to_dlpack

from ikbo_backend import serving
from ikbo_backend.ranker import RankerConfig, build_ranker, load_weights, make_demo_weights
from ikbo_backend.requests import ShapeRanges, make_request, to_tensors
from ikbo_backend.serving import (
    FEATURE_NAMES,
    FeatureModel,
    InteractionModel,
    check_model_config,
    ensure_weights,
    execute_requests,
    feature_dims,
    request_dims,
    score_dims,
    warmup_sizes,
    weights_path,
)

SMALL = RankerConfig(
    user_vocab_size=50, cand_vocab_size=60, item_vocab_size=70, history_length=8, embedding_dim=16, mlp_hidden=(32,)
)
RANGES = ShapeRanges(users=(1, 8), candidates=(1, 40))


def test_weights_path_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("IKBO_WEIGHTS", raising=False)
    assert weights_path() == serving.DEFAULT_WEIGHTS
    monkeypatch.setenv("IKBO_WEIGHTS", str(tmp_path / "env.safetensors"))
    assert weights_path() == tmp_path / "env.safetensors"
    assert weights_path("weights/other.safetensors") == serving.REPO_ROOT / "weights" / "other.safetensors"
    assert weights_path(str(tmp_path / "abs.safetensors")) == tmp_path / "abs.safetensors"


def _ensure(path):
    return str(ensure_weights(path))


def test_ensure_weights_creates_demo_weights_once_even_in_parallel(tmp_path):
    path = tmp_path / "sub" / "ranker.safetensors"
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        assert pool.map(_ensure, [path] * 3) == [str(path)] * 3
    cfg, weights = load_weights(path)
    assert cfg == RankerConfig()
    torch.testing.assert_close(weights["mlp.0.weight"], make_demo_weights(cfg, seed=0)["mlp.0.weight"])
    assert [p.name for p in path.parent.iterdir()] == ["ranker.safetensors"]  # no temp file left behind
    stamp = path.stat().st_mtime_ns
    ensure_weights(path)
    assert path.stat().st_mtime_ns == stamp


def test_warmup_sizes_cover_the_declared_range():
    assert warmup_sizes(ShapeRanges((1, 256), (1, 8192))) == [(1, 1), (16, 91), (256, 8192)]
    assert warmup_sizes(ShapeRanges((4, 4), (9, 9))) == [(4, 9)]
    assert warmup_sizes(ShapeRanges((1, 256), (1, 8192), ((15, 1024), (1, 1)))) == [
        (1, 1),
        (16, 91),
        (256, 8192),
        (15, 1024),
    ]
    with pytest.raises(ValueError, match="typical shape"):
        ShapeRanges((1, 8), (1, 40), ((9, 10),))


def _config(inputs, outputs):
    return {
        "name": "m",
        "input": [{"name": n, "dims": [str(d) for d in dims]} for n, dims in inputs.items()],
        "output": [{"name": n, "dims": [str(d) for d in dims]} for n, dims in outputs.items()],
    }


def test_check_model_config_refuses_dims_of_other_weights():
    cfg = RankerConfig()
    check_model_config(_config(request_dims(cfg), feature_dims(cfg)), request_dims(cfg), feature_dims(cfg))
    with pytest.raises(ValueError, match="do not match"):
        check_model_config(_config(request_dims(cfg), feature_dims(SMALL)), request_dims(cfg), feature_dims(cfg))
    with pytest.raises(ValueError, match="inputs"):
        check_model_config(_config(feature_dims(cfg), score_dims(cfg)), request_dims(cfg), score_dims(cfg))


class _Tensor:
    def __init__(self, name, tensor):
        self.name, self.tensor = name, tensor

    def to_dlpack(self):
        return to_dlpack(self.tensor)

    @classmethod
    def from_dlpack(cls, name, capsule):
        return cls(name, from_dlpack(capsule).clone())


class _Error:
    INVALID_ARG, INTERNAL = "INVALID_ARG", "INTERNAL"

    def __init__(self, message, code):
        self.message, self.code = message, code


FAKE_PB_UTILS = SimpleNamespace(
    Tensor=_Tensor,
    TritonError=_Error,
    InferenceResponse=lambda output_tensors=(), error=None: SimpleNamespace(
        outputs={t.name: t.tensor for t in output_tensors}, error=error
    ),
    get_input_tensor_by_name=lambda request, name: _Tensor(name, request[name]) if name in request else None,
    Logger=SimpleNamespace(log_error=lambda message: None),
)


@pytest.fixture(scope="module")
def small_weights():
    return make_demo_weights(SMALL, seed=1)


def test_one_bad_request_does_not_fail_the_others(small_weights):
    model = FeatureModel(SMALL, small_weights, RANGES)
    rng = np.random.default_rng()
    good = to_tensors(make_request(SMALL, 3, 20, rng))
    bad = to_tensors(make_request(SMALL, 2, 10, rng))
    bad["cand_to_user"][4] = 7
    missing = {k: v for k, v in good.items() if k != "cand_dense"}
    responses = execute_requests(FAKE_PB_UTILS, model, [bad, good, missing])

    assert responses[0].error.code == "INVALID_ARG" and "'cand_to_user'" in responses[0].error.message
    assert responses[2].error.code == "INVALID_ARG" and "'cand_dense'" in responses[2].error.message
    assert responses[1].error is None and set(responses[1].outputs) == set(FEATURE_NAMES)
    features = build_ranker("ikbo", SMALL, small_weights)[0](**good)
    for name in FEATURE_NAMES:
        torch.testing.assert_close(responses[1].outputs[name], getattr(features, name), rtol=0, atol=0)


@pytest.mark.parametrize("variant", ["ikbo", "baseline"])
def test_interaction_model_scores_and_checks_its_joins(small_weights, variant):
    model = InteractionModel(SMALL, small_weights, RANGES, variant=variant)
    model.warm_up()
    features_stage, interaction = build_ranker(variant, SMALL, small_weights)
    features = features_stage(**to_tensors(make_request(SMALL, 4, 30, np.random.default_rng())))
    good = {name: getattr(features, name) for name in FEATURE_NAMES}
    bad_len = dict(good, history_len=good["history_len"].clone().fill_(SMALL.history_length + 1))
    bad_rows = dict(good, cand_to_user=good["cand_to_user"][:-1])
    responses = execute_requests(FAKE_PB_UTILS, model, [good, bad_len, bad_rows])

    torch.testing.assert_close(responses[0].outputs["scores"], interaction(features), rtol=0, atol=0)
    assert responses[1].error.code == "INVALID_ARG" and "'history_len'" in responses[1].error.message
    assert responses[2].error.code == "INVALID_ARG" and "'cand_to_user'" in responses[2].error.message


def test_torch_threads_parameter():
    from ikbo_backend.serving import set_torch_threads

    before = torch.get_num_threads()
    try:
        set_torch_threads(None)
        set_torch_threads("")
        assert torch.get_num_threads() == before
        set_torch_threads("1")
        assert torch.get_num_threads() == 1
        for bad in ("0", "-2", "two", "1.5"):
            with pytest.raises(ValueError, match="torch_threads"):
                set_torch_threads(bad)
    finally:
        torch.set_num_threads(before)


def _io_config(kind_dtypes: dict[str, str], kind: str) -> dict:
    return {
        "name": "m",
        kind: [{"name": name, "data_type": dtype, "dims": [-1]} for name, dtype in kind_dtypes.items()],
    }


def test_feature_dtype_comes_from_the_config():
    floats = ("user_tokens", "cand_tokens", "history_tokens")
    for declared, expected in (
        ("TYPE_FP32", torch.float32),
        ("TYPE_BF16", torch.bfloat16),
        ("TYPE_FP16", torch.float16),
    ):
        config = _io_config(
            {**dict.fromkeys(floats, declared), "history_len": "TYPE_INT32", "cand_to_user": "TYPE_INT32"}, "output"
        )
        assert serving.feature_dtype(config, "output") == expected
    mixed = _io_config({"user_tokens": "TYPE_BF16", "cand_tokens": "TYPE_FP32", "history_tokens": "TYPE_BF16"}, "input")
    with pytest.raises(ValueError, match="must share one float type"):
        serving.feature_dtype(mixed, "input")
    with pytest.raises(ValueError, match="must share one float type"):
        serving.feature_dtype(_io_config(dict.fromkeys(floats, "TYPE_INT32"), "input"), "input")


def test_bfloat16_features_between_the_stages(small_weights):
    """ranker_features declaring TYPE_BF16 outputs casts its float features (ints unchanged); an
    interaction declaring TYPE_BF16 inputs (bf16 compute) scores them like the float32 stage chain
    (the same cast happens one stage earlier), within bf16 rounding of the fp64 scores."""
    cfg, weights = SMALL, small_weights
    rng = np.random.default_rng()
    request = to_tensors(make_request(cfg, 3, 29, rng))
    features = FeatureModel(cfg, weights, RANGES, feature_dtype=torch.bfloat16)(request)
    assert {k: v.dtype for k, v in features.items()} == {
        "user_tokens": torch.bfloat16, "cand_tokens": torch.bfloat16, "history_tokens": torch.bfloat16,
        "history_len": torch.int32, "cand_to_user": torch.int32,
    }  # fmt: skip
    reference = FeatureModel(cfg, weights, RANGES)(request)
    for name in ("user_tokens", "cand_tokens", "history_tokens"):
        assert torch.equal(features[name], reference[name].to(torch.bfloat16))
    interaction = InteractionModel(cfg, weights, RANGES, compute_dtype="bfloat16", feature_dtype=torch.bfloat16)
    scores = interaction(features)["scores"]
    assert scores.dtype == torch.float32
    torch.testing.assert_close(
        scores, InteractionModel(cfg, weights, RANGES, compute_dtype="bfloat16")(reference)["scores"], rtol=0, atol=0
    )
    exact = build_ranker("ikbo", cfg, {k: v.double() for k, v in weights.items()})[1]
    f64 = {k: v.double() if v.is_floating_point() else v for k, v in reference.items()}
    from ikbo_backend.ranker import Features

    expected = exact(Features(**f64))
    assert float((scores.double() - expected).norm() / expected.norm()) <= 2e-2
    assert interaction.example(make_request(cfg, 2, 5, rng))["cand_tokens"].dtype == torch.bfloat16
