"""Online endpoints (ikbo_backend/online.py, stages.OnlineModel, python_model.execute_online): one user
per request, coalesced by the runtime.

Without a server: the batch ↔ online conversions, the mapping built from request boundaries, the cut
at the declared ranges, and `execute_online` through the stand-in pb_utils of tests/stand_ins.py (a bad
request fails alone, the others are bit-identical to the same batch without it; with the
batch-invariant mode, every request of one batch bit-identical to itself sent alone, for
hypothesis-drawn batch compositions, and close to the fp64 reference).
With a real tritonserver (CPU configuration, or configs/gpu.pbtxt on a GPU machine): concurrent
requests over HTTP and gRPC are answered like the in-process model on each request alone (on a
CPU, with the configs' batch-invariant mode: bit-identical), the
backend really received several requests per execute, bad requests interleaved with good ones
fail alone, and perf_analyzer drives the endpoint with the sweep's online input. Inputs and weights
are fresh random each run: the seed is in every failure message.
"""

import math
import secrets
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from google.protobuf import json_format, text_format
from hypothesis import given, settings
from hypothesis import strategies as st
from stand_ins import FAKE_PB_UTILS, SMALL
from tritonclient.grpc import model_config_pb2
from tritonclient.utils import InferenceServerException

from ikbo_backend.client import client_module, infer_inputs
from ikbo_backend.model_config import online_dims, score_dims
from ikbo_backend.online import (
    ONLINE_INPUT_NAMES,
    coalesce,
    groups_within,
    merge_scores,
    split_by_user,
    unbatch,
)
from ikbo_backend.paths import MODEL_REPOSITORY
from ikbo_backend.python_model import execute_online
from ikbo_backend.ranker import RankerConfig, load_weights, make_demo_weights, save_weights
from ikbo_backend.requests import ShapeRanges
from ikbo_backend.stages import OnlineModel
from ikbo_backend.synthetic import make_online_batch, make_request, to_tensors
from ikbo_backend.tritonserver import has_gpu, running_tritonserver
from ikbo_backend.variants import build_ranker
from kernels.reference import rel_err

SEED = secrets.randbits(32)
CFG = RankerConfig()
VARIANTS = ("ikbo", "baseline")
CLIENT_ERROR = {"http": "400", "grpc": "StatusCode.INVALID_ARGUMENT"}
GPU = has_gpu()
DEVICE = "cuda" if GPU else "cpu"

pytestmark = pytest.mark.timeout(600)


def rng(*salt):
    return np.random.default_rng([SEED, *salt])


def alone(one: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """An online request as a batch request of its own (U = 1, mapping all 0)."""
    single = {name: one[name] if name != "user_history_len" else one[name][:, 0] for name in ONLINE_INPUT_NAMES}
    single.update({name: single[name][0] for name in ("cand_dense", "cand_sparse_ids")})
    single["cand_to_user"] = np.zeros(len(single["cand_dense"]), dtype=np.int32)
    return single


def as_served(one: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """An online request as the python backend receives it (user_history_len reshaped to [1])."""
    return to_tensors({name: one[name].reshape(1) if name == "user_history_len" else one[name] for name in one})


# ------------------------------------------------------------------ without a server


def online_config(model, name="config"):
    path = MODEL_REPOSITORY / model / ("config.pbtxt" if name == "config" else f"configs/{name}.pbtxt")
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


@pytest.mark.parametrize("variant", VARIANTS)
def test_online_configs(variant):
    model = f"{variant}_ranker_online"
    cpu, gpu = online_config(model), online_config(model, "gpu")
    assert cpu.backend == "python" and cpu.max_batch_size > 0
    assert {t.name: list(t.dims) for t in cpu.input} == online_dims(CFG)
    assert {t.name: list(t.dims) for t in cpu.output} == score_dims(CFG)
    assert {t.name for t in cpu.input if t.allow_ragged_batch} == {"cand_dense", "cand_sparse_ids"}
    assert list(next(t for t in cpu.input if t.name == "user_history_len").reshape.shape) == []
    assert cpu.dynamic_batching.max_queue_delay_microseconds > 0
    assert not cpu.dynamic_batching.HasField(
        "default_queue_policy"
    )  # 2.51 stalls requests with one: docs/reliability.md
    assert cpu.parameters["variant"].string_value == variant
    assert cpu.parameters["batch_invariant"].string_value == "yes"  # CPU only: the GPU configs keep the default "no"
    assert "batch_invariant" not in gpu.parameters
    assert (
        gpu.backend == "python_inprocess" and "FORCE_CPU_ONLY_INPUT_TENSORS" not in gpu.parameters
    )  # host-memory inputs
    assert [g.kind for g in gpu.instance_group] == [model_config_pb2.ModelInstanceGroup.KIND_GPU]
    assert gpu.parameters["cuda_graphs"].string_value == "yes"
    for parsed in (cpu, gpu):
        parsed.ClearField("instance_group")
        parsed.ClearField("parameters")
        parsed.ClearField("model_warmup")  # GPU configs warm up through Triton (tests/test_model_repository.py)
        parsed.ClearField("backend")  # the GPU configs run model.py in tritonserver's process
    assert cpu == gpu


def test_split_by_user_round_trip():
    request = make_request(CFG, 5, 70, rng(1))
    online = split_by_user(request)
    assert len(online) == 5
    for user, one in enumerate(online):
        n = int((request["cand_to_user"] == user).sum())
        assert one["user_dense"].shape == (1, CFG.user_dense_features)
        assert one["user_history_len"].shape == (1, 1)
        assert one["cand_dense"].shape == (1, n, CFG.cand_dense_features)
        assert one["cand_sparse_ids"].shape == (1, n, CFG.cand_sparse_features)
    fake_scores = [
        np.arange(one["cand_dense"].shape[1], dtype=np.float32)[None, :, None] + 1000 * u
        for u, one in enumerate(online)
    ]
    merged = merge_scores(request, fake_scores)
    for user in range(5):
        np.testing.assert_array_equal(merged[request["cand_to_user"] == user, 0], fake_scores[user][0, :, 0])


def test_online_batches_give_every_user_a_candidate():
    for users, candidates in ((1, 1), (64, 64), (15, 1024)):
        online = split_by_user(make_online_batch(CFG, users, candidates, rng(9, users)))
        counts = [one["cand_dense"].shape[1] for one in online]
        assert len(counts) == users and min(counts) >= 1 and sum(counts) == candidates
    with pytest.raises(ValueError, match="num_users"):
        make_online_batch(CFG, 5, 4, rng(9))


def test_coalesce_builds_the_mapping_from_request_boundaries():
    request = make_request(CFG, 3, 8, rng(2))
    request["cand_to_user"] = np.array([0, 0, 0, 1, 2, 2, 2, 2], dtype=np.int32)
    batch = coalesce([unbatch(as_served(one)) for one in split_by_user(request)])
    assert batch["cand_to_user"].tolist() == request["cand_to_user"].tolist()
    for name, tensor in to_tensors(request).items():
        torch.testing.assert_close(batch[name], tensor, rtol=0, atol=0)


def test_groups_within_the_declared_ranges():
    assert groups_within([], 4, 10) == []
    assert groups_within([3, 3, 3], 4, 10) == [slice(0, 3)]
    assert groups_within([3, 3, 3, 3, 3], 2, 100) == [slice(0, 2), slice(2, 4), slice(4, 5)]
    assert groups_within([6, 5, 4, 1, 10], 8, 10) == [slice(0, 1), slice(1, 4), slice(4, 5)]


@pytest.fixture(scope="module")
def small_weights():
    return make_demo_weights(SMALL, seed=SEED % 1000)


class _Recorder:
    def __init__(self):
        self.batches = []

    def record(self, num_users, num_candidates):
        self.batches.append((num_users, num_candidates))


@pytest.mark.parametrize("variant", VARIANTS)
def test_bad_request_fails_alone_and_the_batch_is_unchanged(small_weights, variant):
    model = OnlineModel(SMALL, small_weights, ShapeRanges((1, 8), (1, 40)), variant=variant)
    request = make_online_batch(SMALL, 4, 30, rng(3))
    good = [as_served(one) for one in split_by_user(request)]
    bad_id = dict(good[1], cand_sparse_ids=good[1]["cand_sparse_ids"].clone().fill_(SMALL.cand_vocab_size))
    two_users = dict(good[2], user_dense=good[2]["user_dense"].repeat(2, 1))
    too_many = {k: v.repeat(1, 41, 1) if k.startswith("cand") else v for k, v in good[0].items()}  # n = 41 > 40
    recorder = _Recorder()
    mixed = execute_online(
        FAKE_PB_UTILS, model, [good[0], bad_id, good[1], two_users, good[2], too_many, good[3]], recorder
    )
    clean = execute_online(FAKE_PB_UTILS, model, good, None)

    for response, name in ((mixed[1], "cand_sparse_ids"), (mixed[3], "user_dense"), (mixed[5], "cand_dense")):
        assert response.error.code == "INVALID_ARG" and f"'{name}'" in response.error.message, response.error.message
    answered = [mixed[i] for i in (0, 2, 4, 6)]
    assert all(r.error is None for r in answered + clean)
    assert recorder.batches == [(4, 30)]
    features, interaction = build_ranker(variant, SMALL, small_weights)
    for user, (got, want) in enumerate(zip(answered, clean)):
        torch.testing.assert_close(got.outputs["scores"], want.outputs["scores"], rtol=0, atol=0)  # bit-identical
        solo = interaction(features(**to_tensors(alone(split_by_user(request)[user]))))
        assert got.outputs["scores"].shape == (1, solo.shape[0], SMALL.tasks)
        torch.testing.assert_close(got.outputs["scores"][0], solo, rtol=1e-5, atol=1e-7)


def test_values_are_checked_once_per_batch_and_request_by_request_only_after_a_bad_one(small_weights, monkeypatch):
    """All good: one value check per batch (the model's), none per request. One bad value: the batch's
    check fails, then every request is checked alone and the good ones are answered."""
    import ikbo_backend.python_model as python_model_module
    import ikbo_backend.stages as stages_module

    calls = []

    def counting(module):
        check = module.check_request_values

        def counted(cfg, inputs):
            calls.append((module.__name__, inputs["cand_dense"].shape[0]))
            return check(cfg, inputs)

        monkeypatch.setattr(module, "check_request_values", counted)

    counting(python_model_module)
    counting(stages_module)
    model = OnlineModel(SMALL, small_weights, ShapeRanges((1, 8), (1, 40)))
    good = [as_served(one) for one in split_by_user(make_online_batch(SMALL, 4, 30, rng(11)))]
    assert all(r.error is None for r in execute_online(FAKE_PB_UTILS, model, good))
    assert calls == [("ikbo_backend.stages", 30)]
    calls.clear()
    bad = dict(good[2], user_history_len=good[2]["user_history_len"].clone().fill_(SMALL.history_length + 1))
    responses = execute_online(FAKE_PB_UTILS, model, [good[0], good[1], bad, good[3]])
    assert [r.error is None for r in responses] == [True, True, False, True] and "'user_history_len'" in responses[
        2
    ].error.message
    assert [module for module, _ in calls] == ["ikbo_backend.stages"] + ["ikbo_backend.python_model"] * 4 + [
        "ikbo_backend.stages"
    ]


@pytest.fixture(scope="module")
def invariant_models():
    """(weights, variant → OnlineModel in the batch-invariant mode), demo dims, fresh weights."""
    weights = make_demo_weights(CFG, seed=SEED % 1000)
    ranges = ShapeRanges((1, 64), (1, 8192))
    return weights, {
        variant: OnlineModel(CFG, weights, ranges, variant=variant, batch_invariant="yes") for variant in VARIANTS
    }


def online_requests(counts: list[int], seed: int) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    """(batch request, its one-user online requests): user i has counts[i] candidates; fresh random inputs."""
    request = make_request(CFG, len(counts), sum(counts), np.random.default_rng(seed))
    request["cand_to_user"] = np.repeat(np.arange(len(counts)), counts).astype(np.int32)
    return request, split_by_user(request)


def fp64_scores(weights, request) -> np.ndarray:
    """The fp64 reference of tests/test_ranker.py: the baseline variant, float64 weights and inputs."""
    features, interaction = build_ranker("baseline", CFG, {k: v.double() for k, v in weights.items()})
    inputs = {k: v.double() if v.is_floating_point() else v for k, v in to_tensors(request).items()}
    with torch.inference_mode():
        return interaction(features(**inputs)).numpy()


def answers(model, online, recorder=None) -> list[torch.Tensor]:
    """scores [1, n, T] of each online request, all sent in one execute."""
    responses = execute_online(FAKE_PB_UTILS, model, [as_served(one) for one in online], recorder)
    assert all(r.error is None for r in responses), [r.error.message for r in responses if r.error]
    return [r.outputs["scores"] for r in responses]


@settings(max_examples=20, deadline=None)
@given(
    variant=st.sampled_from(VARIANTS),
    counts=st.lists(st.integers(1, 200), min_size=1, max_size=16),
    seed=st.integers(0, 2**32 - 1),
)
def test_batch_invariant_mode_answers_each_request_as_if_alone(invariant_models, variant, counts, seed):
    """Requests coalesced into ONE batch: each answer bit-identical (torch.equal) to the same request
    sent alone, and the scores within 1e-5 of the fp64 reference."""
    weights, models = invariant_models
    request, online = online_requests(counts, seed)
    recorder = _Recorder()
    batched = answers(models[variant], online, recorder)
    assert recorder.batches == [(len(counts), sum(counts))]  # one batch, not one execution per request
    for index, (one, got) in enumerate(zip(online, batched)):
        solo = answers(models[variant], [one])[0]
        difference = float((got - solo).abs().max())
        assert torch.equal(got, solo), (
            f"{variant}: request {index} of {counts}: max |batched - solo| {difference:.2e} (seed {seed})"
        )
    scores = merge_scores(request, [a.numpy() for a in batched])
    assert rel_err(torch.tensor(scores), torch.tensor(fp64_scores(weights, request)), ord=math.inf) <= 1e-5, (
        f"{variant} (seed {seed})"
    )


def test_without_the_mode_a_batch_changes_the_last_bits(invariant_models):
    """The check above has teeth: in the default mode, torch's CPU kernels give some requests of a
    batch other last bits than alone (docs/reliability.md, batch isolation)."""
    weights, _ = invariant_models
    model = OnlineModel(CFG, weights, ShapeRanges((1, 64), (1, 8192)), variant="ikbo")
    _, online = online_requests(rng(10).integers(1, 100, size=24).tolist(), SEED)
    differing = sum(not torch.equal(got, answers(model, [one])[0]) for one, got in zip(online, answers(model, online)))
    assert differing > 0, f"all 24 batched answers bit-identical to their solo answers without the mode (seed {SEED})"


def test_batch_invariant_parameter_is_checked(small_weights):
    with pytest.raises(ValueError, match="batch_invariant"):
        OnlineModel(SMALL, small_weights, ShapeRanges((1, 8), (1, 40)), batch_invariant="true")


def test_batches_are_cut_at_the_candidate_range(small_weights):
    model = OnlineModel(SMALL, small_weights, ShapeRanges((1, 3), (1, 40)))
    request = make_request(SMALL, 7, 100, rng(4))
    request["cand_to_user"] = rng(4).permutation(np.repeat(np.arange(7), [5, 30, 12, 20, 1, 15, 17])).astype(np.int32)
    online = split_by_user(request)
    recorder = _Recorder()
    responses = execute_online(FAKE_PB_UTILS, model, [as_served(one) for one in online], recorder)
    assert all(u <= 3 and b <= 40 for u, b in recorder.batches) and sum(u for u, _ in recorder.batches) == 7, (
        recorder.batches
    )
    features, interaction = build_ranker("ikbo", SMALL, small_weights)
    want = interaction(features(**to_tensors(request))).numpy()
    got = merge_scores(request, [r.outputs["scores"].numpy() for r in responses])
    assert rel_err(torch.tensor(got), torch.tensor(want), ord=math.inf) <= 1e-5


def test_an_internal_error_fails_its_batch_only_and_hides_details(small_weights, monkeypatch):
    """Two batches (cut at 2 users); the model raises on the second: INTERNAL naming the model and the
    exception type, not its text; the first batch is answered."""
    model = OnlineModel(SMALL, small_weights, ShapeRanges((1, 2), (1, 40)))
    model.name = "ikbo_ranker_online"
    online = [as_served(one) for one in split_by_user(make_online_batch(SMALL, 4, 20, rng(8)))]
    calls = []
    forward = OnlineModel.__call__

    def failing_second(self, batch):
        calls.append(len(batch["user_dense"]))
        if len(calls) == 2:
            raise RuntimeError("secret /dev/shm/key")
        return forward(self, batch)

    monkeypatch.setattr(OnlineModel, "__call__", failing_second)
    responses = execute_online(FAKE_PB_UTILS, model, online)
    assert calls == [2, 2]
    assert all(r.error is None for r in responses[:2])
    for r in responses[2:]:
        assert (
            r.error.code == "INTERNAL" and "RuntimeError" in r.error.message and "ikbo_ranker_online" in r.error.message
        )
        assert "secret" not in r.error.message


# ------------------------------------------------------------------ with a real tritonserver

ONLINE_MODELS = ("ikbo_ranker_online", "baseline_ranker_online")


@pytest.fixture(scope="module")
def weights_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("weights") / "ranker.safetensors"
    save_weights(path, CFG, make_demo_weights(CFG, seed=SEED))
    return path


QUEUE_DELAY_US = 100_000  # overrides the configs' max_queue_delay_microseconds: the batches do not depend on timing


# The GPU configs run model.py in tritonserver's process (python_inprocess); on the CPU both backends
# serve the CPU config, the second time with only `backend` changed.
BACKENDS = ("python_inprocess",) if GPU else ("python", "python_inprocess")


@pytest.fixture(scope="module", params=BACKENDS)
def server(weights_file, tmp_path_factory, request):
    """Started empty; the online models are loaded with their config (CPU or GPU) where only the queue
    delay (and on the CPU the backend) differs, as a deployment would set it (load request with a config)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("IKBO_WEIGHTS", str(weights_file))
        log_path = tmp_path_factory.mktemp("server") / "tritonserver.log"
        with running_tritonserver(log_path=log_path, extra_args=["--model-control-mode=explicit"]) as running:
            # a model load (warm-up included) takes 4-30 s here; one took 94 s on a loaded 2-core machine
            connection = client_module("http").InferenceServerClient(running.http_url, network_timeout=600.0)
            try:
                for model in ONLINE_MODELS:
                    config = online_config(model, "gpu" if GPU else "config")
                    config.dynamic_batching.max_queue_delay_microseconds = QUEUE_DELAY_US
                    config.backend = request.param
                    connection.load_model(model, config=json_format.MessageToJson(config))
                    assert (
                        connection.get_model_config(model)["dynamic_batching"]["max_queue_delay_microseconds"]
                        == QUEUE_DELAY_US
                    )
            finally:
                connection.close()
            yield running


@pytest.fixture(scope="module")
def reference(weights_file):
    """variant → (features, interaction) as the served config runs it (the CPU configs: batch-invariant)."""
    cfg, weights = load_weights(weights_file)
    return {variant: build_ranker(variant, cfg, weights, DEVICE, batch_invariant=not GPU) for variant in VARIANTS}


def solo_scores(reference, model, one) -> np.ndarray:
    features, interaction = reference[model.removesuffix("_ranker_online")]
    with torch.inference_mode():
        return interaction(features(**to_tensors(alone(one), DEVICE))).cpu().numpy()


def connect(server, protocol):
    module = client_module(protocol)
    return module, module.InferenceServerClient(server.http_url if protocol == "http" else server.grpc_url)


def send_concurrently(server, model, requests, protocol_of):
    """Each request from its own thread and client; → list of scores or InferenceServerException."""

    def send(index):
        module, connection = connect(server, protocol_of(index))
        try:
            result = connection.infer(
                model, infer_inputs(module, requests[index]), outputs=[module.InferRequestedOutput("scores")]
            )
            return result.as_numpy("scores")
        except InferenceServerException as e:
            return e
        finally:
            connection.close()

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(send, range(len(requests))))


def statistics(server, model):
    _, connection = connect(server, "http")
    try:
        stats = connection.get_inference_statistics(model)["model_stats"][0]
    finally:
        connection.close()
    return int(stats["inference_count"]), int(stats["execution_count"])


@pytest.mark.parametrize("model", ONLINE_MODELS)
def test_concurrent_requests_are_coalesced_and_answered_alone_correctly(server, reference, model):
    online = split_by_user(make_online_batch(CFG, 24, 24 * 68, rng(5, len(model))))
    before = statistics(server, model)
    answers = send_concurrently(server, model, online, lambda i: ("http", "grpc")[i % 2])
    deadline = time.monotonic() + 10  # the python backend reports a batch's statistics after sending its responses
    while (counts := statistics(server, model))[0] - before[0] < len(online) and time.monotonic() < deadline:
        time.sleep(0.05)
    inferences, executions = (a - b for a, b in zip(counts, before))
    for index, (one, scores) in enumerate(zip(online, answers)):
        assert not isinstance(scores, Exception), f"request {index}: {scores} (seed {SEED})"
        want = solo_scores(reference, model, one)
        assert scores.shape == (1, *want.shape), f"request {index}: {scores.shape} (seed {SEED})"
        err = rel_err(torch.tensor(scores[0]), torch.tensor(want), ord=math.inf)
        assert err <= 1e-5, f"{model} request {index}: rel err {err:.2e} (seed {SEED})"
        if not GPU:  # batch-invariant mode: bit-identical to the request scored alone
            assert np.array_equal(scores[0], want), f"{model} request {index}: rel err {err:.2e} (seed {SEED})"
    assert inferences == len(online)
    assert executions < inferences, f"{model}: {executions} executes for {inferences} requests: nothing was coalesced"


BAD_ONLINE = {  # kind → (input the message names, request → bad request)
    "NaN dense": ("cand_dense", lambda r: r | {"cand_dense": np.insert(r["cand_dense"][:, 1:], 0, np.nan, axis=1)}),
    "id outside table": ("cand_sparse_ids", lambda r: r | {"cand_sparse_ids": r["cand_sparse_ids"] + CFG.cand_vocab_size}),
    "history len > L": ("user_history_len", lambda r: r | {"user_history_len": np.full((1, 1), CFG.history_length + 1, np.int32)}),
    "two users": ("user_dense", lambda r: {k: np.concatenate([v, v]) for k, v in r.items()}),
    "no candidates": ("cand_dense", lambda r: r | {k: r[k][:, :0] for k in ("cand_dense", "cand_sparse_ids")}),
}  # fmt: skip


@pytest.mark.parametrize("protocol", ("http", "grpc"))
def test_bad_requests_interleaved_with_good_ones_fail_alone(server, reference, protocol):
    model = "ikbo_ranker_online"
    good = split_by_user(make_online_batch(CFG, 2 * len(BAD_ONLINE), 40 * len(BAD_ONLINE), rng(6, len(protocol))))
    requests, expected = [], []
    for index, one in enumerate(good):
        kind = list(BAD_ONLINE)[index // 2]
        requests.append(one if index % 2 == 0 else BAD_ONLINE[kind][1](one))
        expected.append(None if index % 2 == 0 else (kind, BAD_ONLINE[kind][0]))
    answers = send_concurrently(server, model, requests, lambda i: protocol)
    for index, (answer, want) in enumerate(zip(answers, expected)):
        if want is None:
            assert not isinstance(answer, Exception), f"good request {index} failed: {answer} (seed {SEED})"
            solo = solo_scores(reference, model, requests[index])
            err = rel_err(torch.tensor(answer[0]), torch.tensor(solo), ord=math.inf)
            assert err <= 1e-5, f"request {index}: rel err {err:.2e} (seed {SEED})"
            assert GPU or np.array_equal(answer[0], solo), f"request {index}: rel err {err:.2e} (seed {SEED})"
        else:
            kind, name = want
            assert isinstance(answer, InferenceServerException), f"{kind}: answered (seed {SEED})"
            assert str(answer.status()) == CLIENT_ERROR[protocol] and f"'{name}'" in answer.message(), (
                f"{kind}: {answer}"
            )


def test_client_cannot_send_the_mapping(server):
    module, connection = connect(server, "grpc")
    try:
        one = split_by_user(make_online_batch(CFG, 1, 5, rng(7)))[0]
        with pytest.raises(InferenceServerException, match="cand_to_user"):
            connection.infer(
                "ikbo_ranker_online", infer_inputs(module, one | {"cand_to_user": np.zeros((1, 5), np.int32)})
            )
    finally:
        connection.close()


@pytest.mark.timeout(180)
def test_perf_analyzer_drives_the_online_endpoint(server, tmp_path):
    """The sweep's online input (U one-user requests of ragged n) through perf_analyzer: no error, and
    the server coalesced its 15 requests in flight."""
    from ikbo_backend.perf.inputs import candidates_per_request, ensure_online_config
    from ikbo_backend.perf.perf_analyzer import Profile, run_perf_analyzer

    model = "ikbo_ranker_online"
    data = ensure_online_config("u15_b1024", tmp_path)
    assert candidates_per_request(data) == pytest.approx(1024 / 15)
    quick = Profile(("u15_b1024",), (1,), window_ms=1000, stability_pct=50, max_trials=4, request_count=60)
    before = statistics(server, model)
    row, _, status = run_perf_analyzer(
        model, server.grpc_url, "grpc", data, 15, quick, tmp_path / "run.csv", tmp_path / "run.log", 120
    )
    assert status == "ok" and float(row["Inferences/Second"]) > 0, (tmp_path / "run.log").read_text()[-3000:]
    inferences, executions = (a - b for a, b in zip(statistics(server, model), before))
    assert inferences >= 60 and executions < inferences, (inferences, executions)
