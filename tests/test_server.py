"""End to end against a real tritonserver on free ports, over HTTP and gRPC: the CPU configuration,
or configs/gpu.pbtxt where the machine has a GPU (the in-process reference then runs there too); the
GPU configs' one-model rankers placed on the CPU, served by `scripts/serve` on either backend.

Both rankers answer random requests at several U:B mixes like the in-process model built from the
same weights file; every bad-input kind comes back as HTTP 400 / gRPC INVALID_ARGUMENT
naming the input, and the server keeps answering good requests correctly. Inputs (and weights) are
fresh random each run: the seed is in every failure message.
"""

import contextlib
import math
import secrets
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from tritonclient.grpc import model_config_pb2
from tritonclient.utils import InferenceServerException

from ikbo_backend.client import client_module, infer_inputs, infer_scores
from ikbo_backend.instance_groups import BACKENDS
from ikbo_backend.paths import REPO_ROOT, load_shape_ranges
from ikbo_backend.pbtxt import read_config, render
from ikbo_backend.perf.repository_copy import repository_copy
from ikbo_backend.ranker import RankerConfig, load_weights, make_demo_weights, save_weights
from ikbo_backend.synthetic import make_request, to_tensors
from ikbo_backend.tritonserver import RunningServer, free_ports, has_gpu, running_tritonserver, stop, wait_until_ready
from ikbo_backend.variants import build_ranker
from kernels.reference import rel_err

SEED = secrets.randbits(32)
CFG = RankerConfig()
RANGES = load_shape_ranges()
RANKERS = ("ikbo_ranker", "baseline_ranker")
PROTOCOLS = ("http", "grpc")
CLIENT_ERROR = {"http": "400", "grpc": "StatusCode.INVALID_ARGUMENT"}
MIXES = [(1, 64), (15, 1024), (64, 64), (1, 1)]
GPU = has_gpu()
DEVICE = "cuda" if GPU else "cpu"
# IKBO vs baseline: the same function, but on CUDA the IKBO linear compression runs in tf32
# (kernels/linear_compress.py): the two differ by up to ~2e-5 on a GPU. Each ranker vs its own
# in-process model stays at 1e-5 everywhere.
VARIANT_RTOL = 2e-4 if GPU else 1e-5

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def weights_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("weights") / "ranker.safetensors"
    save_weights(path, CFG, make_demo_weights(CFG, seed=SEED))
    return path


@pytest.fixture(scope="module")
def server(weights_file, tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("IKBO_WEIGHTS", str(weights_file))  # read by every model at load
        log_path = tmp_path_factory.mktemp("server") / "tritonserver.log"
        with running_tritonserver(config_name="gpu" if GPU else None, log_path=log_path) as running:
            yield running


@pytest.fixture(scope="module")
def reference(weights_file):
    """variant → in-process (features, interaction) from the server's weights file."""
    cfg, weights = load_weights(weights_file)
    return {variant: build_ranker(variant, cfg, weights, DEVICE) for variant in ("ikbo", "baseline")}


@pytest.fixture(scope="module", params=PROTOCOLS)
def client(request, server):
    """(protocol, module, client); closed at the end, so the server stops without waiting."""
    module = client_module(request.param)
    connection = module.InferenceServerClient(server.http_url if request.param == "http" else server.grpc_url)
    yield request.param, module, connection
    connection.close()


def expected_scores(reference, model, request) -> np.ndarray:
    features, interaction = reference[model.removesuffix("_ranker")]
    with torch.inference_mode():
        return interaction(features(**to_tensors(request, DEVICE))).cpu().numpy()


def scores_err(got: np.ndarray, want: np.ndarray) -> float:
    """The largest score error over the largest score."""
    return rel_err(torch.tensor(got), torch.tensor(want), ord=math.inf)


def assert_answers(client, reference, model, request):
    _, module, connection = client
    scores = infer_scores(connection, module, model, request)
    want = expected_scores(reference, model, request)
    assert scores.shape == want.shape == (len(request["cand_dense"]), CFG.tasks)
    assert scores_err(scores, want) <= 1e-5, f"{model}: rel err {scores_err(scores, want):.2e} (seed {SEED})"
    return scores


def request_at(num_users, num_candidates, salt=0):
    return make_request(CFG, num_users, num_candidates, np.random.default_rng([SEED, num_users, num_candidates, salt]))


@pytest.mark.parametrize("mix", MIXES, ids=lambda m: f"U{m[0]}_B{m[1]}")
def test_rankers_agree_with_in_process_model(client, reference, mix):
    request = request_at(*mix)
    ikbo = assert_answers(client, reference, "ikbo_ranker", request)
    baseline = assert_answers(client, reference, "baseline_ranker", request)
    assert scores_err(ikbo, baseline) <= VARIANT_RTOL, (
        f"ikbo vs baseline: rel err {scores_err(ikbo, baseline):.2e} (seed {SEED})"
    )


def test_user_without_candidates(client, reference):
    request = request_at(3, 40)
    request["cand_to_user"] = np.where(request["cand_to_user"] == 1, 2, request["cand_to_user"]).astype(np.int32)
    request["cand_to_user"][0] = 0  # users 0 and 2 have candidates, user 1 none
    for model in RANKERS:
        assert_answers(client, reference, model, request)


def _with(name, value):
    def corrupt(r):
        r[name] = value(r) if callable(value) else value
        return r

    return corrupt


def _poke(name, index, value):
    def corrupt(r):
        r[name] = r[name].copy()
        r[name][index] = value
        return r

    return corrupt


def _rows(names, rows):
    def corrupt(r):
        return {k: v[:rows] if k in names else v for k, v in r.items()}

    return corrupt


USER_NAMES = ("user_dense", "user_sparse_ids", "user_history_ids", "user_history_len")
CAND_NAMES = ("cand_dense", "cand_sparse_ids", "cand_to_user")
# kind → (input the message must name, request → bad request); the base request has U=4, B=32
BAD = {
    "wrong dtype": ("user_dense", _with("user_dense", lambda r: r["user_dense"].astype(np.float64))),
    "wrong dtype mapping": ("cand_to_user", _with("cand_to_user", lambda r: r["cand_to_user"].astype(np.int64))),
    "wrong rank": ("cand_sparse_ids", _with("cand_sparse_ids", lambda r: r["cand_sparse_ids"][:, :, None])),
    "wrong rank mapping": ("cand_to_user", _with("cand_to_user", lambda r: r["cand_to_user"][:, None])),
    "wrong width": ("cand_dense", _with("cand_dense", lambda r: r["cand_dense"][:, :-1])),
    "mapping length != B": ("cand_to_user", _with("cand_to_user", lambda r: r["cand_to_user"][:-1])),
    "history_len length != U": ("user_history_len", _with("user_history_len", lambda r: r["user_history_len"][:-1])),
    "mapping >= U": ("cand_to_user", _poke("cand_to_user", 5, 4)),
    "mapping negative": ("cand_to_user", _poke("cand_to_user", 0, -1)),
    "user id outside table": ("user_sparse_ids", _poke("user_sparse_ids", (1, 2), CFG.user_vocab_size)),
    "cand id negative": ("cand_sparse_ids", _poke("cand_sparse_ids", (7, 0), -3)),
    "history id outside table": ("user_history_ids", _poke("user_history_ids", (0, 0), CFG.item_vocab_size)),
    "history len > L": ("user_history_len", _poke("user_history_len", 1, CFG.history_length + 1)),
    "history len negative": ("user_history_len", _poke("user_history_len", 2, -1)),
    "NaN dense": ("user_dense", _poke("user_dense", (0, 1), np.nan)),
    "Inf dense": ("cand_dense", _poke("cand_dense", (9, 2), np.inf)),
    "-Inf dense": ("user_dense", _poke("user_dense", (3, 0), -np.inf)),
    "B = 0": ("cand_dense", _rows(CAND_NAMES, 0)),
    "U = 0": ("user_dense", _rows(USER_NAMES, 0)),
    "U above range": ("user_dense", lambda r: request_at(RANGES.users[1] + 1, 300)),
    "B above range": ("cand_dense", lambda r: request_at(2, RANGES.candidates[1] + 1)),
}


def error_of(client, model, request) -> InferenceServerException:
    _, module, connection = client
    with pytest.raises(InferenceServerException) as caught:
        connection.infer(model, infer_inputs(module, request))
    return caught.value


@pytest.mark.parametrize("model", RANKERS)
@pytest.mark.parametrize("kind", list(BAD))
def test_bad_input_is_a_client_error_naming_the_input(client, reference, model, kind):
    protocol, _, connection = client
    name, corrupt = BAD[kind]
    error = error_of(client, model, corrupt(request_at(4, 32)))
    assert str(error.status()) == CLIENT_ERROR[protocol], f"{kind}: {error}"
    assert f"'{name}'" in error.message(), f"{kind}: message does not name {name!r}: {error}"
    assert connection.is_server_ready()
    assert_answers(client, reference, model, request_at(4, 32, salt=1))


def test_bad_mapping_sent_straight_to_an_interaction_model(client, reference):
    """The interaction stage checks its joins too: a bad index never reaches a gather."""
    protocol, module, connection = client
    features, _ = reference["ikbo"]
    with torch.inference_mode():
        f = features(**to_tensors(request_at(4, 32), DEVICE))
    inputs = {
        name: getattr(f, name).cpu().numpy()
        for name in ("user_tokens", "cand_tokens", "history_tokens", "history_len", "cand_to_user")
    }
    inputs["cand_to_user"][3] = 4
    for model in ("ikbo_interaction", "baseline_interaction"):
        error = error_of(client, model, inputs)
        assert str(error.status()) == CLIENT_ERROR[protocol] and "'cand_to_user'" in error.message(), str(error)


def test_server_and_models_ready(client):
    _, _, connection = client
    assert connection.is_server_ready()
    for model in ("ranker_features", "ikbo_interaction", "baseline_interaction", *RANKERS):
        assert connection.is_model_ready(model), model


def test_serving_probe_reads_latency_statistics_and_compilations(server):
    """serving_probe.py's first and stats against the running server: first vs steady latency, per-model
    statistics that grew by the requests it sent, and the request-path compilation counters."""
    from ikbo_backend.perf.latency import first_request
    from ikbo_backend.perf.server_stats import compilations, model_stats

    before = {r["model"]: r["requests"] for r in model_stats(server.http_url)}
    result = first_request(server.grpc_url, "ikbo_ranker", "demo", 3, 40, repeats=3, seed=None)
    assert result["first_ms"] > 0 and result["p50_ms"] > 0 and result["ratio"] == result["first_ms"] / result["p50_ms"]
    models = (
        ("ikbo_ranker",) if GPU else ("ikbo_ranker", "ranker_features", "ikbo_interaction")
    )  # GPU: one python model
    for _ in range(50):  # Triton updates its statistics just after the response goes out
        after = {r["model"]: r for r in model_stats(server.http_url)}
        if all(after[m]["requests"] >= before.get(m, 0) + 4 for m in models):
            break
        time.sleep(0.1)
    for model in models:
        assert after[model]["requests"] >= before.get(model, 0) + 4, model
        assert after[model]["compute_infer_ms"] > 0
    counts = compilations(server.metrics_url)
    assert counts.get("ikbo_ranker:request" if GPU else "ikbo_interaction:request") == 0, counts


def test_bfloat16_features_cross_the_ensemble(tmp_path, monkeypatch):
    """The large GPU configs pass the float features between ranker_features and the interactions as
    TYPE_BF16 (DLPack through python backend 2.51). The same on a CPU copy of the ikbo_ranker chain:
    scores equal the in-process bf16 chain's and stay within bf16 rounding of fp64."""
    from ikbo_backend.model_config import FLOAT_FEATURES
    from ikbo_backend.ranker import Features
    from ikbo_backend.stages import FeatureModel, InteractionModel

    weights_path = tmp_path / "ranker.safetensors"
    weights = make_demo_weights(CFG, seed=SEED)
    save_weights(weights_path, CFG, weights)
    with repository_copy(["ranker_features", "ikbo_interaction", "ikbo_ranker"], "bf16-features-") as repo:
        for name, kind in (("ranker_features", "output"), ("ikbo_interaction", "input")):
            path = repo / name / "config.pbtxt"
            config = read_config(path)
            for tensor in getattr(config, kind):
                if tensor.name in FLOAT_FEATURES:
                    tensor.data_type = model_config_pb2.TYPE_BF16
            if name == "ikbo_interaction":
                config.parameters["compute_dtype"].string_value = "bfloat16"
            path.write_text(render(config))
        rng = np.random.default_rng(SEED)
        features = FeatureModel(CFG, weights, RANGES, feature_dtype=torch.bfloat16)
        interaction = InteractionModel(CFG, weights, RANGES, compute_dtype="bfloat16", feature_dtype=torch.bfloat16)
        exact = build_ranker("ikbo", CFG, {k: v.double() for k, v in weights.items()})[1]
        monkeypatch.setenv("IKBO_WEIGHTS", str(weights_path))  # read by every model at load
        with running_tritonserver(model_repository=repo, log_path=tmp_path / "tritonserver.log") as server:
            for num_users, num_candidates in ((4, 50), (1, 7)):
                request = make_request(CFG, num_users, num_candidates, rng)
                module = client_module("grpc")
                client = module.InferenceServerClient(server.grpc_url)
                got = infer_scores(client, module, "ikbo_ranker", request)
                client.close()
                with torch.inference_mode():
                    chain = interaction(features(to_tensors(request)))["scores"].numpy()
                    f32 = FeatureModel(CFG, weights, RANGES)(to_tensors(request))
                    expected = exact(
                        Features(**{k: v.double() if v.is_floating_point() else v for k, v in f32.items()})
                    ).numpy()
                np.testing.assert_allclose(got, chain, rtol=1e-5, atol=1e-6, err_msg=f"seed {SEED}")
                assert np.linalg.norm(got - expected) / np.linalg.norm(expected) <= 2e-2, f"seed {SEED}"


@contextlib.contextmanager
def served(repository, log_path, *flags, timeout: float = 300):
    """`scripts/serve` over `repository` on free ports, until ready; stopped (SIGTERM, then kill) on exit."""
    ports = free_ports(3)
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "serve"), f"--model-repository={repository}"]
    cmd += [f"--{name}-port={port}" for name, port in zip(("http", "grpc", "metrics"), ports)] + list(flags)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = RunningServer(*(f"localhost:{port}" for port in ports), process, log_path)
    try:
        wait_until_ready(process, server.http_url, timeout, server.log_tail)
        yield server
    finally:
        stop(process)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_model_rankers_of_the_gpu_configs(tmp_path, monkeypatch, backend):
    """configs/gpu.pbtxt of ikbo_ranker and baseline_ranker (one python model: serving.RankerModel),
    placed on the CPU and served by `scripts/serve --gpu --backend <backend>` (python_inprocess: in
    tritonserver's process; python: Triton's python backend, configs/gpu_python.pbtxt): answers equal
    the in-process model's over HTTP and gRPC, a bad request is a 400 naming its input and the next one
    is answered, and the IKBO metrics count its batches."""
    import json
    import re
    import urllib.request

    weights_path = tmp_path / "ranker.safetensors"
    save_weights(weights_path, CFG, make_demo_weights(CFG, seed=SEED))
    cfg, weights = load_weights(weights_path)
    reference = {variant: build_ranker(variant, cfg, weights) for variant in ("ikbo", "baseline")}
    with repository_copy(RANKERS, "one-model-") as repo:
        for name in RANKERS:
            path = repo / name / "configs" / "gpu.pbtxt"
            config = read_config(path)
            for group in config.instance_group:
                group.kind = group.KIND_CPU
            config.ClearField("model_warmup")  # CPU: no warm-up needed
            path.write_text(render(config))
        monkeypatch.setenv("IKBO_WEIGHTS", str(weights_path))  # read by every model at load
        with served(repo, tmp_path / "serve.log", "--gpu", f"--backend={backend}") as server:
            for model in RANKERS:
                url = f"http://{server.http_url}/v2/models/{model}/config"
                assert json.load(urllib.request.urlopen(url, timeout=10))["backend"] == backend, model
            for protocol in PROTOCOLS:
                module = client_module(protocol)
                connection = module.InferenceServerClient(server.http_url if protocol == "http" else server.grpc_url)
                client = (protocol, module, connection)
                for model in RANKERS:
                    for mix in ((3, 40), (1, 1)):
                        request = make_request(CFG, *mix, np.random.default_rng([SEED, *mix]))
                        features, interaction = reference[model.removesuffix("_ranker")]
                        got = infer_scores(connection, module, model, request)
                        with torch.inference_mode():
                            want = interaction(features(**to_tensors(request))).numpy()
                        assert scores_err(got, want) <= 1e-5, (
                            f"{model} {mix}: rel err {scores_err(got, want):.2e} (seed {SEED})"
                        )
                    bad = request_at(4, 32)
                    bad["cand_to_user"][5] = 4  # users 0..3
                    error = error_of(client, model, bad)
                    assert str(error.status()) == CLIENT_ERROR[protocol] and "'cand_to_user'" in error.message(), str(
                        error
                    )
                    infer_scores(connection, module, model, request_at(4, 32))
                connection.close()
            deadline = time.monotonic() + 5  # in process the metrics are updated by a worker, right after the responses
            while True:
                metrics = urllib.request.urlopen(f"http://{server.metrics_url}/metrics", timeout=10).read().decode()
                scored = re.search(r'ikbo_candidates_scored_total\{[^}]*model="ikbo_ranker"[^}]*\} (\S+)', metrics)
                if (scored and float(scored.group(1)) == 2 * (40 + 1 + 32)) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert scored and float(scored.group(1)) == 2 * (40 + 1 + 32), metrics[:2000]


def test_serving_probe_in_process_builds_the_served_model_from_its_config():
    """serving_probe.py in-process: the GPU config's ranker (a python model) built as the python backend
    builds it (here on the CPU), timed on fresh requests, with and without gaps; an ensemble is refused."""
    from ikbo_backend.perf.in_process import in_process

    for gap_ms in (0.0, 1.0):
        r = in_process("ikbo_ranker", "gpu", 3, 40, repeats=3, seed=None, gap_ms=gap_ms)
        assert r["model"] == "ikbo_ranker" and r["repeats"] == 3 and 0 < r["p50_ms"] and 0 < r["mean_ms"]
    with pytest.raises(SystemExit, match="not a python model"):
        in_process("ikbo_ranker", "config", 3, 40, repeats=1, seed=None)


def test_serving_probe_idle_times_fixed_work_after_each_gap():
    """serving_probe.py idle: host work (request validation) timed after each gap; device work only
    where there is CUDA (NaN here without it)."""
    from ikbo_backend.perf.in_process import idle_cost

    rows = idle_cost([0.0, 2.0], repeats=3, profile="demo", seed=None)
    assert [r["gap_ms"] for r in rows] == [0.0, 2.0]
    assert all(0 < r["host_ms"] < 1e3 for r in rows)
    assert all((r["device_ms"] > 0) if torch.cuda.is_available() else r["device_ms"] != r["device_ms"] for r in rows)
