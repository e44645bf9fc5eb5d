"""ikbo_backend.cuda_graphs: shape buckets, and that padding a request to its bucket leaves its scores
unchanged. On a CPU the padded call runs without a graph (`replay_eagerly`), on CUDA from real graphs."""

import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from stand_ins import RANGES, SMALL

from ikbo_backend import cuda_graphs
from ikbo_backend.cuda_graphs import GraphedInteraction, GraphedRanker, graph_buckets
from ikbo_backend.model_config import use_cuda_graphs
from ikbo_backend.ranker import Features, make_demo_weights, profile_config
from ikbo_backend.requests import (
    INPUT_NAMES,
    InvalidRequest,
    ShapeRanges,
    check_request_values,
    check_values_on_device,
    index_bounds,
)
from ikbo_backend.stages import InteractionModel, RankerModel
from ikbo_backend.synthetic import make_request, to_tensors
from ikbo_backend.variants import build_ranker


@given(users_hi=st.integers(1, 300), cands_hi=st.integers(1, 9000), data=st.data())
@settings(max_examples=50, deadline=None)
def test_every_shape_in_range_has_a_bucket_with_bounded_padding(users_hi, cands_hi, data):
    ranges = ShapeRanges(users=(1, users_hi), candidates=(1, cands_hi))
    user_sizes, cand_sizes = graph_buckets(ranges)
    assert user_sizes[-1] == users_hi and cand_sizes[-1] == cands_hi
    graphed = GraphedInteraction(None, ranges, "cpu", replay_eagerly=True)
    num_users, num_candidates = data.draw(st.integers(1, users_hi)), data.draw(st.integers(1, cands_hi))
    users, cands = graphed.bucket(num_users, num_candidates)
    assert num_users <= users < 2 * num_users and users in user_sizes
    assert num_candidates <= cands <= max(2, -(-3 * num_candidates // 2)) and cands in cand_sizes
    assert graphed.bucket(users_hi + 1, 1) is None and graphed.bucket(1, cands_hi + 1) is None


def _features(cfg, num_users, num_candidates, rng, features):
    """A fresh random request's features, floats in fp64 (the interaction's weights are fp64)."""
    f = features(**to_tensors(make_request(cfg, num_users, num_candidates, rng)))
    return Features(**{k: v.double() if v.is_floating_point() else v for k, v in vars(f).items()})


def _fp64_ranker(variant, seed):
    """(feature stage with fp32 weights, interaction with fp64 weights)."""
    weights = make_demo_weights(SMALL, seed=seed)
    features, _ = build_ranker(variant, SMALL, weights)
    return features, build_ranker(variant, SMALL, {k: v.double() for k, v in weights.items()})[1]


@pytest.mark.parametrize("variant", ["ikbo", "baseline"])
def test_padded_replay_gives_the_request_rows(variant):
    """fp64 weights: a request's scores from its padded bucket equal the unpadded call's, also after
    a larger request left other values in the padding rows."""
    rng = np.random.default_rng()
    features, interaction = _fp64_ranker(variant, int(rng.integers(1 << 30)))
    graphed = GraphedInteraction(interaction, RANGES, "cpu", replay_eagerly=True)
    graphed.capture_all(_features(SMALL, 3, 17, rng, features))
    assert len(graphed.graphs) == len(graphed.user_sizes) * len(graphed.cand_sizes)
    shapes = [(8, 40), (1, 1), (5, 3), (3, 25), (8, 7), (2, 40)]  # U > B too (users without candidates)
    for num_users, num_candidates in shapes:
        f = _features(SMALL, num_users, num_candidates, rng, features)
        expected = interaction(f)
        got = graphed(f)
        assert got.shape == (num_candidates, SMALL.tasks)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    assert graphed.replays == len(shapes) and graphed.eager_calls == 0


def test_shapes_outside_every_bucket_run_eagerly():
    rng = np.random.default_rng()
    features, interaction = _fp64_ranker("ikbo", 0)
    graphed = GraphedInteraction(interaction, RANGES, "cpu", replay_eagerly=True)
    graphed.capture_all(_features(SMALL, 2, 5, rng, features))
    f = _features(SMALL, 9, 50, rng, features)  # above the declared maxima
    torch.testing.assert_close(graphed(f), interaction(f), rtol=0, atol=0)
    assert graphed.eager_calls == 1 and graphed.replays == 0


@pytest.mark.parametrize("variant", ["ikbo", "baseline"])
def test_padded_replay_of_the_whole_ranker_gives_the_request_rows(variant):
    """GraphedRanker (lookups + interaction from the raw request, packed into one buffer per bucket
    layout): a request's scores from its padded bucket equal the unpadded call's (fp32: a matmul at
    another row count may change the last bits), also after a larger request of another layout."""
    rng = np.random.default_rng()
    features, interaction = build_ranker(variant, SMALL, make_demo_weights(SMALL, seed=int(rng.integers(1 << 30))))
    graphed = GraphedRanker(features, interaction, SMALL, RANGES, "cpu", replay_eagerly=True)
    graphed.capture_all(to_tensors(make_request(SMALL, 3, 17, rng)))
    assert len(graphed.graphs) == len(graphed.user_sizes) * len(graphed.cand_sizes)
    shapes = [(8, 40), (1, 1), (5, 3), (3, 25), (8, 7), (2, 40)]  # U > B too (users without candidates)
    for num_users, num_candidates in shapes:
        request = to_tensors(make_request(SMALL, num_users, num_candidates, rng))
        expected = interaction(features(**request))
        got = graphed(request)
        assert got.shape == (num_candidates, SMALL.tasks)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        views = graphed._views(*graphed.bucket(num_users, num_candidates))
        assert int(views["last_user"]) == num_users - 1
        for name, t in request.items():  # the request's rows, then zeros; views at 256-byte offsets
            assert torch.equal(views[name][: t.shape[0]], t) and not views[name][t.shape[0] :].any()
            assert (views[name].data_ptr() - graphed.static.data_ptr()) % GraphedRanker.ALIGN == 0
    assert graphed.replays == len(shapes) and graphed.eager_calls == 0


def test_rows_are_packed_only_where_they_fit_the_staging():
    """cuda_graphs._copy_rows (libc memmove, no bounds of its own): rows of another dtype, width or
    more rows than the staging view are refused; a strided source is packed like a contiguous one,
    and the rows past it are zeroed."""
    rng = np.random.default_rng()
    host = rng.integers(1, 100, size=(6, 3)).astype(np.int64)  # stale rows of an earlier request
    rows = torch.from_numpy(rng.integers(-50, 50, size=(3, 6)).astype(np.int64)).t()[:4]  # [4, 3], strided
    cuda_graphs._copy_rows(host, rows)
    assert np.array_equal(host[:4], rows.numpy()) and not host[4:].any()
    for bad in (rows.float(), torch.zeros(7, 3, dtype=torch.int64), torch.zeros(2, 4, dtype=torch.int64)):
        with pytest.raises(RuntimeError, match="do not fit the staging"):
            cuda_graphs._copy_rows(host, bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error path needs a machine without a CUDA driver")
def test_cuda_runtime_binds_only_a_loaded_runtime_and_names_the_failing_call():
    """cuda_graphs._CudaRuntime opens the runtime by soname without loading it (the one torch's CUDA
    code already loaded), and a failing call raises with the call's name and CUDA's message. Here: the
    pip runtime (requirements.txt, for perf_analyzer), loaded by path, on a machine without a driver."""
    import ctypes
    from pathlib import Path

    cuda_runtime = pytest.importorskip("nvidia.cuda_runtime")
    soname = "libcudart.so.12"
    path = Path(cuda_runtime.__path__[0]) / "lib" / soname
    if not any(soname in line for line in open("/proc/self/maps")):
        with pytest.raises(OSError):
            cuda_graphs._CudaRuntime(soname)
    ctypes.CDLL(str(path))
    runtime = cuda_graphs._CudaRuntime(soname)
    with pytest.raises(RuntimeError, match=r"cudaMemcpyAsync \(request in\): CUDA error \d+ \(.+\)"):
        runtime.replay(0, 0, (0, 0, 0), (0, 0, 0))
    if not torch.version.cuda:
        assert cuda_graphs._cuda_runtime() is None  # a CPU build of torch: replays keep torch's calls


def _bad_value(cfg, request, name, kind, rng):
    """Put one bad value of `kind` at a random position of input `name` (a host numpy request)."""
    array = request[name]
    index = tuple(int(rng.integers(n)) for n in array.shape)
    num_users = request["user_dense"].shape[0]
    high = {"cand_to_user": num_users, "user_history_len": cfg.history_length + 1, "user_sparse_ids": cfg.user_vocab_size,
            "cand_sparse_ids": cfg.cand_vocab_size, "user_history_ids": cfg.item_vocab_size}  # fmt: skip
    if name in high:
        array[index] = {"low": -1, "high": high[name], "huge": np.iinfo(array.dtype).max}[kind]
    else:
        array[index] = {"low": np.nan, "high": np.inf, "huge": -3e30}[kind]
    return index


@given(name=st.sampled_from(INPUT_NAMES), kind=st.sampled_from(["low", "high", "huge"]), data=st.data())
@settings(max_examples=40, deadline=None)
def test_device_value_checks_flag_exactly_what_the_host_checks_refuse(name, kind, data):
    """check_values_on_device (the graph's checks; here their torch reference on the CPU) against
    check_request_values (the host's), on fresh requests with one bad value of each kind in each
    input, and on valid ones: the flag is raised iff the host refuses, and every clamped index lies
    in its table."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    num_users, num_candidates = data.draw(st.integers(1, 8)), data.draw(st.integers(1, 40))
    request = make_request(SMALL, num_users, num_candidates, rng)
    bad = data.draw(st.booleans())
    if bad:
        _bad_value(SMALL, request, name, kind, rng)
    inputs = to_tensors(request)
    clamped, flag = {name: t.clone() for name, t in inputs.items()}, torch.zeros(1)
    check_values_on_device(SMALL, clamped, torch.tensor(num_users - 1, dtype=torch.int32), flag)
    try:
        check_request_values(SMALL, inputs)
        refused = False
    except InvalidRequest as e:
        refused = True
        assert e.input_name == name
    assert bool(flag) == refused == bad
    for index_name, (low, high) in index_bounds(SMALL, num_users - 1).items():
        assert int(clamped[index_name].min()) >= low and int(clamped[index_name].max()) <= high


@pytest.mark.parametrize("name", INPUT_NAMES)
def test_whole_ranker_graph_refuses_a_bad_value_then_answers_the_next_request(name):
    """A request with a bad value in `name` gets InvalidRequest naming it (from the host check after
    the graph's flag), the bad value is never gathered, and the next valid request of the same bucket
    gets its correct scores."""
    rng = np.random.default_rng()
    features, interaction = build_ranker("ikbo", SMALL, make_demo_weights(SMALL, seed=int(rng.integers(1 << 30))))
    graphed = GraphedRanker(features, interaction, SMALL, RANGES, "cpu", replay_eagerly=True)
    graphed.capture_all(to_tensors(make_request(SMALL, 3, 17, rng)))
    request = make_request(SMALL, 5, 30, rng)
    _bad_value(SMALL, request, name, str(rng.choice(["low", "high", "huge"])), rng)
    with pytest.raises(InvalidRequest, match=f"input '{name}'"):
        graphed(to_tensors(request))
    good = to_tensors(make_request(SMALL, 5, 30, rng))
    torch.testing.assert_close(graphed(good), interaction(features(**good)), rtol=1e-5, atol=1e-6)
    assert graphed.replays == 2


def test_one_model_ranker_validates_and_answers_in_host_memory():
    """RankerModel (the large GPU configs' rankers) on a CPU: the scores of the ensemble's two stages,
    and a bad request refused naming its input."""
    rng = np.random.default_rng()
    weights = make_demo_weights(SMALL, seed=int(rng.integers(1 << 30)))
    model = RankerModel(SMALL, weights, RANGES, "cpu", variant="ikbo")
    request = to_tensors(make_request(SMALL, 4, 30, rng))
    features, interaction = build_ranker("ikbo", SMALL, weights)
    scores = model(request)["scores"]
    assert scores.device.type == "cpu"
    torch.testing.assert_close(scores, interaction(features(**request)), rtol=1e-5, atol=1e-6)
    request["cand_to_user"][0] = 4  # only users 0..3 exist
    with pytest.raises(ValueError, match="cand_to_user"):
        model(request)


def test_cuda_graphs_parameter():
    assert use_cuda_graphs("yes", torch.device("cuda:0")) and not use_cuda_graphs("no", torch.device("cuda:0"))
    assert not use_cuda_graphs(None, torch.device("cuda:0")) and not use_cuda_graphs("yes", torch.device("cpu"))
    with pytest.raises(ValueError, match="cuda_graphs: expected 'yes' or 'no', got 'true'"):
        use_cuda_graphs("true", torch.device("cpu"))
    model = InteractionModel(SMALL, make_demo_weights(SMALL), RANGES, "cpu", cuda_graphs="yes")
    assert not isinstance(model.interaction, GraphedInteraction)  # a CPU model ignores it


def _fp64_scores(cfg, weights):
    """request → float32 scores of the CPU model: fp32 feature stage, fp64 interaction (the IKBO
    interaction: the same function as the baseline's, cheaper)."""
    features, _ = build_ranker("ikbo", cfg, weights)
    interaction64 = build_ranker("ikbo", cfg, {k: v.double() for k, v in weights.items()})[1]

    def scores(request):
        f = features(**to_tensors(request))
        return interaction64(
            Features(**{k: v.double() if v.is_floating_point() else v for k, v in vars(f).items()})
        ).float()

    return scores


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", ["ikbo", "baseline"])
def test_graph_replays_match_eager_calls_on_cuda(variant):
    """Large profile, bf16 interaction, the served model's stage: replayed scores against the eager
    call's and against the fp64 CPU model, for fresh requests of several buckets."""
    cfg, rng = profile_config("large"), np.random.default_rng()
    weights = make_demo_weights(cfg, seed=int(rng.integers(1 << 30)))
    ranges = ShapeRanges(users=(1, 16), candidates=(1, 1024))
    model = InteractionModel(cfg, weights, ranges, "cuda", variant=variant, compute_dtype="bfloat16", cuda_graphs="yes")
    model.warm_up()
    assert isinstance(model.interaction, GraphedInteraction) and all(
        g is not None for g, _ in model.interaction.graphs.values()
    )
    reference_of = _fp64_scores(cfg, weights)
    replays, eager_calls = model.interaction.replays, model.interaction.eager_calls  # the warm-up ran eagerly
    for num_users, num_candidates in [(15, 1024), (1, 1000), (16, 64), (3, 37), (16, 5)]:
        request = make_request(cfg, num_users, num_candidates, rng)
        inputs = model.example(request)
        with torch.inference_mode():
            replayed = model(inputs)["scores"]
            eager = model.interaction.interaction(Features(**inputs))
            reference = reference_of(request)
        assert torch.isfinite(replayed).all()
        torch.testing.assert_close(replayed.cpu(), eager.cpu(), rtol=0, atol=1e-2)
        error = float((replayed.cpu() - reference).norm() / reference.norm())
        assert error <= 2e-2, f"{(num_users, num_candidates)}: rel err {error:.2e} vs fp64"
    assert (model.interaction.replays - replays, model.interaction.eager_calls - eager_calls) == (5, 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", ["ikbo", "baseline"])
def test_whole_ranker_graph_replays_match_eager_calls_on_cuda(variant):
    """Large profile, bf16 interaction, the one-model ranker of the large GPU configs: scores (host
    memory) replayed from lookups + interaction graphs against the eager call's and the fp64 CPU model."""
    cfg, rng = profile_config("large"), np.random.default_rng()
    weights = make_demo_weights(cfg, seed=int(rng.integers(1 << 30)))
    ranges = ShapeRanges(users=(1, 16), candidates=(1, 1024))
    model = RankerModel(cfg, weights, ranges, "cuda", variant=variant, compute_dtype="bfloat16", cuda_graphs="yes")
    model.warm_up()
    assert isinstance(model.graphed, GraphedRanker) and all(g is not None for g, _ in model.graphed.graphs.values())
    reference_of = _fp64_scores(cfg, weights)
    replays, eager_calls = model.graphed.replays, model.graphed.eager_calls
    for num_users, num_candidates in [(15, 1024), (1, 1000), (16, 64), (3, 37), (16, 5)]:
        request = make_request(cfg, num_users, num_candidates, rng)
        inputs = model.example(request)
        with torch.inference_mode():
            replayed = model(inputs)["scores"]
            eager = model.interaction(model.features(**{k: v.cuda() for k, v in inputs.items()})).cpu()
            reference = reference_of(request)
        assert replayed.device.type == "cpu" and torch.isfinite(replayed).all()
        torch.testing.assert_close(replayed, eager, rtol=0, atol=1e-2)
        error = float((replayed - reference).norm() / reference.norm())
        assert error <= 2e-2, f"{(num_users, num_candidates)}: rel err {error:.2e} vs fp64"
    assert (model.graphed.replays - replays, model.graphed.eager_calls - eager_calls) == (5, 0)
    assert cuda_graphs._cuda_runtime() is not None  # the replays went through the CUDA runtime's calls, not torch's
    for name in INPUT_NAMES:  # the graph's own value checks: refused by name, nothing gathered out of range
        request = make_request(cfg, 15, 1024, rng)
        _bad_value(cfg, request, name, str(rng.choice(["low", "high", "huge"])), rng)
        with pytest.raises(InvalidRequest, match=f"input '{name}'"):
            model(model.example(request))
    request = make_request(cfg, 15, 1024, rng)  # the device still answers
    error = float(
        (model(model.example(request))["scores"] - reference_of(request)).norm() / reference_of(request).norm()
    )
    assert error <= 2e-2, f"after the refusals: rel err {error:.2e} vs fp64"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_instances_replaying_from_threads_at_once_answer_their_own_requests():
    """Three rankers on one GPU called from three threads at once (as python_inprocess instances are):
    each replays on its own stream and staging, and every answer is its own request's (fp64 CPU
    model, and the same scores as a lone call)."""
    cfg, rng = profile_config("large"), np.random.default_rng()
    weights = make_demo_weights(cfg, seed=int(rng.integers(1 << 30)))
    ranges = ShapeRanges(users=(1, 16), candidates=(1, 1024))
    models = [RankerModel(cfg, weights, ranges, "cuda", compute_dtype="bfloat16", cuda_graphs="yes") for _ in range(3)]
    for model in models:
        model.warm_up()
    requests = [make_request(cfg, int(rng.integers(1, 17)), int(rng.integers(1, 1025)), rng) for _ in range(12)]
    alone = [models[0](models[0].example(r))["scores"] for r in requests]
    answers, errors = {}, []

    def serve(k):
        try:
            torch.cuda.set_device(0)
            for i in range(k, len(requests) * 4, len(models)):
                answers.setdefault(i % len(requests), []).append(
                    models[k](models[k].example(requests[i % len(requests)]))["scores"]
                )
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=serve, args=(k,)) for k in range(len(models))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    reference_of = _fp64_scores(cfg, weights)
    for i, request in enumerate(requests):
        reference = reference_of(request)
        for scores in answers[i]:
            torch.testing.assert_close(scores, alone[i], rtol=0, atol=1e-2)
            assert float((scores - reference).norm() / reference.norm()) <= 2e-2
