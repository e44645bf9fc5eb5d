"""The served stages without a server: weights and ranges resolution, config checks, and the
python-backend request loop and model classes driven through a stand-in for triton_python_backend_utils."""

import json
import multiprocessing
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from stand_ins import FAKE_PB_UTILS, RANGES, SMALL

from ikbo_backend import model_config, paths
from ikbo_backend.model_config import (
    FEATURE_NAMES,
    check_model_config,
    feature_dims,
    request_dims,
    score_dims,
    set_torch_threads,
)
from ikbo_backend.paths import ensure_weights, weights_path
from ikbo_backend.python_model import execute_requests, triton_python_model
from ikbo_backend.ranker import Features, RankerConfig, load_weights, make_demo_weights, save_weights
from ikbo_backend.requests import ShapeRanges
from ikbo_backend.stages import FeatureModel, InteractionModel, warmup_sizes
from ikbo_backend.synthetic import make_request, to_tensors
from ikbo_backend.variants import build_ranker
from kernels.reference import rel_err


def test_weights_path_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("IKBO_WEIGHTS", raising=False)
    assert weights_path() == paths.DEFAULT_WEIGHTS
    monkeypatch.setenv("IKBO_WEIGHTS", str(tmp_path / "env.safetensors"))
    assert weights_path() == tmp_path / "env.safetensors"
    assert weights_path("weights/other.safetensors") == paths.REPO_ROOT / "weights" / "other.safetensors"
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
        assert model_config.feature_dtype(config, "output") == expected
    mixed = _io_config({"user_tokens": "TYPE_BF16", "cand_tokens": "TYPE_FP32", "history_tokens": "TYPE_BF16"}, "input")
    with pytest.raises(ValueError, match="must share one float type"):
        model_config.feature_dtype(mixed, "input")
    with pytest.raises(ValueError, match="must share one float type"):
        model_config.feature_dtype(_io_config(dict.fromkeys(floats, "TYPE_INT32"), "input"), "input")


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
    expected = exact(Features(**f64))
    assert rel_err(scores, expected) <= 2e-2
    assert interaction.example(make_request(cfg, 2, 5, rng))["cand_tokens"].dtype == torch.bfloat16


def _triton_args(tmp_path, name: str, inputs: dict, outputs: dict, parameters: dict) -> dict:
    """The python backend's initialize args of model `name` in a repository of its own (ranges RANGES)."""
    repository = tmp_path / "repository"
    (repository / name).mkdir(parents=True, exist_ok=True)
    (repository / paths.SHAPE_RANGES_FILE).write_text(
        json.dumps({"users": list(RANGES.users), "candidates": list(RANGES.candidates)})
    )
    types = dict.fromkeys(("history_len", "cand_to_user"), "TYPE_INT32")
    config = {
        "name": name,
        "input": [{"name": n, "data_type": types.get(n, "TYPE_FP32"), "dims": d} for n, d in inputs.items()],
        "output": [{"name": n, "data_type": "TYPE_FP32", "dims": d} for n, d in outputs.items()],
        "parameters": {k: {"string_value": v} for k, v in parameters.items()},
    }
    return {
        "model_config": json.dumps(config),
        "model_repository": str(repository / name),
        "model_instance_kind": "CPU",
        "model_instance_device_id": "0",
        "model_name": name,
    }


@pytest.mark.parametrize("variant", ["ikbo", "baseline", "transformed"])
def test_the_python_model_of_a_role_serves_its_stage(tmp_path, monkeypatch, small_weights, variant):
    """triton_python_model(pb_utils, "interaction"): the stage built from the config, one response per
    request; the ikbo variant records each answered batch (U, B) and the execute's wall time, the
    transformed one logs the pass's report, the baseline neither."""
    from triton import knobs

    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)  # the counter's hook goes at the end
    weights = tmp_path / "small.safetensors"
    save_weights(weights, SMALL, small_weights)
    logged = []
    pb_utils = SimpleNamespace(**(vars(FAKE_PB_UTILS) | {"Logger": SimpleNamespace(log_info=logged.append)}))
    name = f"{variant}_interaction"
    served = triton_python_model(pb_utils, "interaction")()
    served.initialize(
        _triton_args(
            tmp_path, name, feature_dims(SMALL), score_dims(SMALL), {"variant": variant, "weights": str(weights)}
        )
    )
    features = FeatureModel(SMALL, small_weights, RANGES)(
        to_tensors(make_request(SMALL, 3, 20, np.random.default_rng()))
    )
    bad = dict(features, cand_to_user=features["cand_to_user"][:-1])
    responses = served.execute([features, bad])
    served.finalize()

    assert served.model.name == name and served.model.variant == variant
    assert responses[0].error is None and responses[1].error.code == "INVALID_ARG"
    torch.testing.assert_close(responses[0].outputs["scores"], served.model(features)["scores"], rtol=0, atol=0)
    assert (served.metrics is not None) == (variant == "ikbo")
    if variant == "ikbo":
        assert served.metrics.candidates.values == [20.0] and served.metrics.users.values == [3.0]
        assert len(served.metrics.execute_seconds.values) == 1
    assert logged == ([str(served.model.interaction.report)] if variant == "transformed" else [])


def test_the_python_model_roles():
    with pytest.raises(ValueError, match="role"):
        triton_python_model(FAKE_PB_UTILS, "ensemble")
    for role in ("features", "interaction", "ranker", "online"):
        assert callable(triton_python_model(FAKE_PB_UTILS, role)().initialize)
