"""model_repository/ without a server: the committed configs are those the role templates generate
(ikbo_backend/model_repository.py, scripts/make_model_repository.py), every config parses as a
ModelConfig, the ensembles expose the request contract of ikbo_backend/requests.py, and every dim
equals the RankerConfig defaults."""

import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from ikbo_backend.model_config import feature_dims, online_dims, request_dims, score_dims
from ikbo_backend.model_repository import config_files, stale_files
from ikbo_backend.paths import MODEL_REPOSITORY, REPO_ROOT, load_shape_ranges
from ikbo_backend.pbtxt import render
from ikbo_backend.perf.repository_copy import repository_copy
from ikbo_backend.ranker import PROFILES, RankerConfig
from ikbo_backend.requests import INPUT_DTYPES, INPUT_NAMES, ShapeRanges

CFG = RankerConfig()
ENSEMBLES = ("ikbo_ranker", "baseline_ranker", "transformed_ranker")
ONLINE = ("ikbo_ranker_online", "baseline_ranker_online")  # batched (max_batch_size > 0): tests/test_online.py
PYTHON_MODELS = {  # name → (input dims, output dims)
    "ranker_features": (request_dims(CFG), feature_dims(CFG)),
    "ikbo_interaction": (feature_dims(CFG), score_dims(CFG)),
    "baseline_interaction": (feature_dims(CFG), score_dims(CFG)),
    "transformed_interaction": (feature_dims(CFG), score_dims(CFG)),
}
TRITON_DTYPE = {"float32": "TYPE_FP32", "int64": "TYPE_INT64", "int32": "TYPE_INT32"}
CONFIG_FILES = sorted(MODEL_REPOSITORY.glob("*/config.pbtxt")) + sorted(MODEL_REPOSITORY.glob("*/configs/*.pbtxt"))


def parse(path: Path) -> model_config_pb2.ModelConfig:
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def config(model: str, name: str = "config") -> model_config_pb2.ModelConfig:
    return parse(MODEL_REPOSITORY / model / ("config.pbtxt" if name == "config" else f"configs/{name}.pbtxt"))


def io(tensors) -> dict[str, tuple[str, list[int]]]:
    return {t.name: (model_config_pb2.DataType.Name(t.data_type), list(t.dims)) for t in tensors}


def test_committed_configs_are_the_generated_ones():
    tracked = subprocess.run(
        ["git", "ls-files", "model_repository/*.pbtxt"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert sorted(tracked) == sorted(f"model_repository/{f.path}" for f in config_files())
    assert stale_files() == [], "run scripts/make_model_repository.py"
    for generated in config_files():  # the text reads back as the message it was rendered from
        assert parse(MODEL_REPOSITORY / generated.path) == generated.config, generated.path


def test_make_model_repository_checks_and_rewrites(tmp_path):
    script = [sys.executable, str(REPO_ROOT / "scripts" / "make_model_repository.py")]
    with repository_copy(sorted(p.name for p in MODEL_REPOSITORY.iterdir() if p.is_dir())) as repo:
        edited = repo / "ikbo_interaction" / "configs" / "gpu.pbtxt"
        edited.write_text(edited.read_text().replace("count: 1", "count: 3"))
        check = subprocess.run([*script, "--check", "--model-repository", str(repo)], capture_output=True, text=True)
        assert check.returncode == 1 and str(edited) in check.stdout and check.stdout.count("\n") == 1, check.stdout
        write = subprocess.run([*script, "--model-repository", str(repo)], capture_output=True, text=True)
        assert write.returncode == 0 and f"wrote {edited}" in write.stdout, write.stdout + write.stderr
        assert (
            stale_files(repo) == [] and edited.read_text() == (MODEL_REPOSITORY / edited.relative_to(repo)).read_text()
        )


def test_render_reads_back_where_entries_do_not_fit_on_a_line():
    """pbtxt.render falls back to blocks for entries longer than a line, keeps comments above their field,
    and text_format reads the result back as the same message."""
    long = "x" * 150
    config = model_config_pb2.ModelConfig(name="m", backend="python", max_batch_size=0)
    config.input.add(name=long, data_type=model_config_pb2.TYPE_FP32, dims=[-1, 3])
    config.input.add(name="short", data_type=model_config_pb2.TYPE_INT32, dims=[-1])
    config.parameters["key"].string_value = long
    step = config.ensemble_scheduling.step.add(model_name="a", model_version=-1)
    step.input_map[long] = long
    warmup = config.model_warmup.add(name="w", batch_size=1, count=1)
    warmup.inputs[long].dims.extend([1, 3])
    text = render(config, "a header", {"parameters.key": "why this parameter", "input": "why these inputs"})
    assert text_format.Parse(text, model_config_pb2.ModelConfig()) == config
    lines = text.splitlines()
    assert lines[0] == "# a header" and lines[lines.index("# why these inputs") + 1] == "input ["
    assert lines[lines.index("# why this parameter") + 1] == "parameters {"  # too long for one line


def test_repository_holds_exactly_the_served_models():
    models = {p.name for p in MODEL_REPOSITORY.iterdir() if p.is_dir()}
    assert models == set(ENSEMBLES) | set(PYTHON_MODELS) | set(ONLINE)
    for model in models:
        versions = [p for p in (MODEL_REPOSITORY / model).iterdir() if p.is_dir() and p.name.isdigit()]
        assert [v.name for v in versions] == ["1"], model
        assert any(versions[0].iterdir()), f"{model}/1 is empty: git would drop it (track a placeholder)"


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: str(p.relative_to(MODEL_REPOSITORY)))
def test_config_parses(path):
    parsed = parse(path)
    assert parsed.name == path.relative_to(MODEL_REPOSITORY).parts[0]
    assert (parsed.max_batch_size > 0) == (parsed.name in ONLINE)


@pytest.mark.parametrize("model", ENSEMBLES)
def test_ensemble_io_is_the_request_contract(model):
    parsed = config(model)
    assert parsed.platform == "ensemble"
    expected = {
        name: (TRITON_DTYPE[str(INPUT_DTYPES[name]).removeprefix("torch.")], request_dims(CFG)[name])
        for name in INPUT_NAMES
    }
    assert io(parsed.input) == expected
    assert [t.name for t in parsed.input] == list(INPUT_NAMES)
    assert io(parsed.output) == {"scores": ("TYPE_FP32", [-1, CFG.tasks])}


@pytest.mark.parametrize("model", ENSEMBLES)
def test_ensemble_steps_connect(model):
    """Each step feeds a served model its exact inputs from tensors that exist by then."""
    parsed = config(model)
    available = {t.name for t in parsed.input}
    variant = model.removesuffix("_ranker")
    assert [s.model_name for s in parsed.ensemble_scheduling.step] == ["ranker_features", f"{variant}_interaction"]
    for step in parsed.ensemble_scheduling.step:
        composing = config(step.model_name)
        assert set(step.input_map) == {t.name for t in composing.input}, step.model_name
        assert set(step.input_map.values()) <= available, step.model_name
        assert set(step.output_map) <= {t.name for t in composing.output}, step.model_name
        available |= set(step.output_map.values())
    assert {t.name for t in parsed.output} <= available


@pytest.mark.parametrize("name", ["gpu", "large"])
@pytest.mark.parametrize("model", ENSEMBLES)
def test_gpu_rankers_are_one_python_model_with_the_ensemble_contract(model, name):
    """On the GPU a ranker is one python model (serving.RankerModel) run inside tritonserver's process
    (the python_inprocess backend: host-memory inputs): the ensemble's inputs and output, its variant,
    lookups + interaction replayed from CUDA graphs."""
    ensemble, parsed = config(model), config(model, name)
    assert parsed.backend == "python_inprocess" and not parsed.platform and parsed.max_batch_size == 0
    assert [t.name for t in parsed.input] == [t.name for t in ensemble.input]
    assert [t.data_type for t in list(parsed.input) + list(parsed.output)] == [
        t.data_type for t in list(ensemble.input) + list(ensemble.output)
    ]
    if name == "gpu":
        assert io(parsed.input) == io(ensemble.input) and io(parsed.output) == io(ensemble.output)
    assert [g.kind for g in parsed.instance_group] == [model_config_pb2.ModelInstanceGroup.KIND_GPU]
    parameters = {k: v.string_value for k, v in parsed.parameters.items()}
    assert (
        "FORCE_CPU_ONLY_INPUT_TENSORS" not in parameters and parameters["cuda_graphs"] == "yes"
    )  # a python backend option
    assert parameters["variant"] == model.removesuffix("_ranker")
    assert (MODEL_REPOSITORY / model / "1" / "model.py").is_file()


@pytest.mark.parametrize("model", sorted(PYTHON_MODELS))
def test_python_model_dims_match_ranker_config(model):
    inputs, outputs = PYTHON_MODELS[model]
    for name in ("config", "gpu"):
        parsed = config(model, name)
        assert parsed.backend == "python"
        assert {t.name: list(t.dims) for t in parsed.input} == inputs
        assert {t.name: list(t.dims) for t in parsed.output} == outputs


@pytest.mark.parametrize("model", sorted(PYTHON_MODELS))
def test_gpu_config_differs_only_in_placement(model):
    cpu, gpu = config(model), config(model, "gpu")
    assert [g.kind for g in cpu.instance_group] == [model_config_pb2.ModelInstanceGroup.KIND_CPU]
    assert [g.kind for g in gpu.instance_group] == [model_config_pb2.ModelInstanceGroup.KIND_GPU]
    # raw request inputs stay in host memory (validated there, no device syncs); features arrive on the GPU
    expected = "yes" if model == "ranker_features" else "no"
    for name in ("gpu", "large"):
        assert config(model, name).parameters["FORCE_CPU_ONLY_INPUT_TENSORS"].string_value == expected, name
    for field in ("instance_group", "parameters", "model_warmup"):  # warm-up through Triton: GPU configs
        cpu.ClearField(field)
        gpu.ClearField(field)
    assert cpu == gpu
    if model != "ranker_features":
        assert config(model).parameters["variant"].string_value == model.removesuffix("_interaction")


def test_stage_dtypes_chain():
    assert io(config("ranker_features").input) == io(config("ikbo_ranker").input)
    features = io(config("ranker_features").output)
    for model in ("ikbo_interaction", "baseline_interaction"):
        assert io(config(model).input) == features
        assert io(config(model).output) == io(config("ikbo_ranker").output)


def test_shape_ranges_file():
    ranges = load_shape_ranges()
    assert isinstance(ranges, ShapeRanges)
    for low, high in (ranges.users, ranges.candidates):
        assert isinstance(low, int) and isinstance(high, int) and 1 <= low <= high
    assert (15, 1024) in ranges.typical  # the canonical mix is warmed up at load


LARGE = PROFILES["large"]
LARGE_DIMS = {**request_dims(LARGE), **feature_dims(LARGE), **score_dims(LARGE)}
MODELS = sorted(ENSEMBLES + ONLINE + tuple(PYTHON_MODELS))


@pytest.mark.parametrize("model", MODELS)
def test_large_config_is_the_gpu_config_at_the_large_profile(model):
    """configs/large.pbtxt: the GPU config (config.pbtxt for ensembles) with the dims of
    PROFILES["large"], its weights file and profile, and bfloat16 compute in the interaction models."""
    large = config(model, "large")
    base = config(model, "config" if large.platform == "ensemble" else "gpu")
    expected = {**online_dims(LARGE), **score_dims(LARGE)} if large.max_batch_size > 0 else LARGE_DIMS
    assert {t.name: list(t.dims) for t in list(large.input) + list(large.output)} == {
        t.name: expected[t.name] for t in list(large.input) + list(large.output)
    }
    parameters = {k: v.string_value for k, v in large.parameters.items()}
    if large.platform != "ensemble":
        assert parameters.pop("profile") == "large"
        assert parameters.pop("weights") == "weights/ranker_large.safetensors"
        if model != "ranker_features":
            assert parameters.pop("compute_dtype") == "bfloat16"
    assert parameters == {k: v.string_value for k, v in base.parameters.items()}
    assert [g.kind for g in large.instance_group] == [g.kind for g in base.instance_group]  # counts may differ
    # the float features between ranker_features and the interactions are bfloat16 in the large
    # profile (its interactions compute in bfloat16), float32 in the GPU config
    between = (
        list(large.output)
        if model == "ranker_features"
        else list(large.input)
        if model.endswith("_interaction")
        else []
    )
    for t in between:
        if t.name in ("user_tokens", "cand_tokens", "history_tokens"):
            assert t.data_type == model_config_pb2.TYPE_BF16, t.name
            t.data_type = model_config_pb2.TYPE_FP32
    for c in (large, base):
        for t in list(c.input) + list(c.output):
            t.ClearField("dims")
        c.ClearField("parameters")
        c.ClearField("instance_group")
        c.ClearField("model_warmup")
    assert large == base


@pytest.mark.parametrize("model", sorted(PYTHON_MODELS))
@pytest.mark.parametrize("name", ["gpu", "large"])
def test_gpu_stage_models_are_lean_direct_endpoints(model, name):
    """On the GPU the rankers are one python model each and never call the ensembles' stage models:
    those load for direct calls only, one instance, eager, no warm-up (GPU memory stays with the rankers)."""
    parsed = config(model, name)
    assert [(g.kind, g.count) for g in parsed.instance_group] == [(model_config_pb2.ModelInstanceGroup.KIND_GPU, 1)]
    assert not parsed.model_warmup
    if model != "ranker_features":
        assert parsed.parameters["cuda_graphs"].string_value == "no"


@pytest.mark.parametrize("model", list(ONLINE) + list(ENSEMBLES))
@pytest.mark.parametrize("name", ["gpu", "large"])
def test_gpu_configs_warm_up_through_triton_at_the_typical_shape(model, name):
    """model_warmup: one request per instance at the first typical shape of shape_ranges.json (one
    user for the online endpoints), every input of the config with its dtype and a valid zero
    payload, dims matching the declared ones (-1: the rows)."""
    parsed = config(model, name)
    (warmup,) = parsed.model_warmup
    assert warmup.batch_size == 1 and warmup.count >= 1
    declared = {t.name: t for t in parsed.input}
    assert set(warmup.inputs) == set(declared)
    num_users, num_candidates = load_shape_ranges().typical[0]
    for input_name, data in warmup.inputs.items():
        assert data.zero_data and data.data_type == declared[input_name].data_type
        rows = (
            1
            if parsed.max_batch_size > 0
            else (num_users if input_name.startswith(("user", "history")) else num_candidates)
        )
        assert len(data.dims) == len(declared[input_name].dims)
        for got, want in zip(data.dims, declared[input_name].dims):
            assert got == want or (want == -1 and (parsed.max_batch_size > 0 or got == rows)), (
                input_name,
                list(data.dims),
            )
