"""Configurations derived at serve time (ikbo_backend/instance_groups.py, `scripts/serve --gpus`,
`--backend python`): generated through protobuf, identical to configs/gpu.pbtxt except the GPU list of
the instance groups (and, over several GPUs or with --backend python, the python backend for
in-process models), ensembles left to config.pbtxt (checked on the real tritonserver), bad `--gpus`
refused with a message that names it.
Without a GPU, except the last test (two GPUs): an instance on GPU 1 keeps its weights and work there."""

import json
import shutil
import subprocess
import sys
import textwrap
import urllib.request

import pytest
import torch
from tritonclient.grpc import model_config_pb2

from ikbo_backend.instance_groups import (
    GENERATED_GLOBS,
    backend_config_name,
    config_name,
    on_backend,
    parse_gpus,
    serve_config_name,
    spread,
    write_gpu_configs,
)
from ikbo_backend.paths import MODEL_REPOSITORY, REPO_ROOT
from ikbo_backend.pbtxt import read_config
from ikbo_backend.tritonserver import running_tritonserver

KIND_GPU = model_config_pb2.ModelInstanceGroup.KIND_GPU
GPU_MODELS = sorted(p.parts[-3] for p in MODEL_REPOSITORY.glob("*/configs/gpu.pbtxt"))
ENSEMBLES = ("ikbo_ranker", "baseline_ranker", "transformed_ranker")


@pytest.fixture
def repository(tmp_path):
    """A copy of the model repository's configs (no code, no generated files)."""
    copy = tmp_path / "model_repository"
    shutil.copytree(MODEL_REPOSITORY, copy, ignore=shutil.ignore_patterns("1", *GENERATED_GLOBS, "__pycache__"))
    return copy


def without_placement(config):
    """The config without its instance groups and backend (spread over several GPUs, python_inprocess
    becomes python: one GIL per instance)."""
    config = type(config).FromString(config.SerializeToString())
    config.ClearField("instance_group")
    config.ClearField("backend")
    return config


def test_every_model_has_a_gpu_config_and_the_rankers_are_python_models_there():
    """The GPU configs serve each ranker as one python model (the CPU ones as ensembles), so its
    instances spread over the GPUs like every other model's."""
    assert {"ikbo_interaction", "ikbo_ranker_online", "ranker_features", *ENSEMBLES} <= set(GPU_MODELS)
    for model in ENSEMBLES:
        assert read_config(MODEL_REPOSITORY / model / "configs" / "gpu.pbtxt").backend == "python_inprocess", model
        assert read_config(MODEL_REPOSITORY / model / "config.pbtxt").platform == "ensemble", model


@pytest.mark.parametrize("gpus", [[0], [0, 1], [0, 1, 2, 3]], ids=lambda g: f"{len(g)}gpu")
def test_generated_configs_differ_from_gpu_pbtxt_only_in_the_gpu_list(repository, gpus):
    name = write_gpu_configs(gpus, model_repository=repository)
    assert name == config_name("gpu", gpus) == "gpu_gpus_" + "_".join(map(str, gpus))
    for model in GPU_MODELS:
        base = read_config(repository / model / "configs" / "gpu.pbtxt")
        generated = read_config(repository / model / "configs" / f"{name}.pbtxt")  # parses back as a ModelConfig
        assert [list(g.gpus) for g in generated.instance_group] == [gpus] * len(base.instance_group), model
        assert [(g.kind, g.count) for g in generated.instance_group] == [
            (KIND_GPU, g.count) for g in base.instance_group
        ]
        in_process = base.backend == "python_inprocess"
        assert generated.backend == ("python" if in_process and len(gpus) > 1 else base.backend), model
        assert without_placement(generated) == without_placement(base), model
        assert generated == spread(base, gpus)


def test_models_without_the_base_file_are_left_to_config_pbtxt(repository):
    """A model with no configs/gpu.pbtxt (here the rankers' GPU files removed: their ensembles) gets no
    generated file, and tritonserver falls back to its config.pbtxt."""
    for model in ENSEMBLES:
        (repository / model / "configs" / "gpu.pbtxt").unlink()
    before = {p: p.read_bytes() for model in ENSEMBLES for p in (repository / model).rglob("*.pbtxt")}
    name = write_gpu_configs([0, 1], model_repository=repository)
    assert not any((repository / model / "configs" / f"{name}.pbtxt").exists() for model in ENSEMBLES)
    assert {p: p.read_bytes() for model in ENSEMBLES for p in (repository / model).rglob("*.pbtxt")} == before


def test_a_base_whose_ensembles_have_configs_copies_them_unchanged(repository):
    """E.g. a profile with other dims ("large"): its ensembles must not fall back to config.pbtxt."""
    for model in ("ikbo_ranker", "ikbo_interaction"):
        source = repository / model / ("config.pbtxt" if model == "ikbo_ranker" else "configs/gpu.pbtxt")
        (repository / model / "configs").mkdir(exist_ok=True)
        shutil.copy(source, repository / model / "configs" / "alt.pbtxt")
    name = write_gpu_configs([0, 1], "alt", repository)
    ensemble = repository / "ikbo_ranker" / "configs"
    assert read_config(ensemble / f"{name}.pbtxt") == read_config(ensemble / "alt.pbtxt")
    assert [
        list(g.gpus) for g in read_config(repository / "ikbo_interaction" / "configs" / f"{name}.pbtxt").instance_group
    ] == [[0, 1]]


def test_regenerated_from_whatever_gpu_pbtxt_holds(repository):
    path = repository / "ikbo_interaction" / "configs" / "gpu.pbtxt"
    name = write_gpu_configs([0, 1], model_repository=repository)
    config = read_config(path)
    config.parameters["compute_dtype"].string_value = "bfloat16"
    config.instance_group[0].count = 2
    path.write_text(str(config))
    write_gpu_configs([0, 1], model_repository=repository)
    generated = read_config(path.with_name(f"{name}.pbtxt"))
    assert generated.parameters["compute_dtype"].string_value == "bfloat16"
    assert [(g.count, list(g.gpus)) for g in generated.instance_group] == [(2, [0, 1])]


def test_other_instance_groups_are_kept():
    config = model_config_pb2.ModelConfig(name="m")
    config.instance_group.add(kind=model_config_pb2.ModelInstanceGroup.KIND_CPU, count=1)
    config.instance_group.add(kind=KIND_GPU, count=2, gpus=[3])
    cpu_kind = config.instance_group[0].kind
    assert [(g.kind, list(g.gpus)) for g in spread(config, [0, 1]).instance_group] == [
        (cpu_kind, []),
        (KIND_GPU, [0, 1]),
    ]
    assert list(config.instance_group[1].gpus) == [3]  # a copy: the input is unchanged
    with pytest.raises(ValueError, match="gpus"):
        spread(config, [])


@pytest.mark.parametrize(
    "gpus, backend",
    [([0], "python_inprocess"), ([1], "python_inprocess"), ([0, 1], "python"), ([0, 1, 2, 3], "python")],
)
def test_in_process_models_get_a_process_per_instance_over_several_gpus(gpus, backend):
    """python_inprocess runs every instance under tritonserver's one GIL: over several GPUs the spread
    config takes the python backend (a stub process per instance). Other backends, and in-process
    models without a GPU group, stay as they are."""
    config = model_config_pb2.ModelConfig(name="m", backend="python_inprocess")
    config.instance_group.add(kind=KIND_GPU, count=1)
    assert spread(config, gpus).backend == backend
    assert config.backend == "python_inprocess"  # a copy
    on_cpu = model_config_pb2.ModelConfig(name="m", backend="python_inprocess")
    on_cpu.instance_group.add(kind=model_config_pb2.ModelInstanceGroup.KIND_CPU, count=1)
    assert spread(on_cpu, gpus).backend == "python_inprocess"
    other = model_config_pb2.ModelConfig(name="m", backend="python")
    other.instance_group.add(kind=KIND_GPU, count=1)
    assert spread(other, gpus).backend == "python"
    assert spread(config, gpus, keep_in_process=True).backend == "python_inprocess"  # scripts/serve --keep-in-process


def test_serve_config_name_from_the_gpus_present(repository):
    assert serve_config_name(None, 1, model_repository=repository) == "gpu"  # one GPU: the plain gpu.pbtxt
    assert serve_config_name([0], 1, model_repository=repository) == "gpu"
    assert serve_config_name(None, 0, model_repository=repository) == "gpu"  # --gpu forced without a GPU: as before
    assert not [p for glob in GENERATED_GLOBS for p in repository.glob(f"*/configs/{glob}")]
    assert serve_config_name(None, 2, model_repository=repository) == "gpu_gpus_0_1"
    assert serve_config_name([0], 2, model_repository=repository) == "gpu_gpus_0"  # gpu.pbtxt would use both
    assert serve_config_name([3, 1], 4, model_repository=repository) == "gpu_gpus_3_1"
    with pytest.raises(ValueError, match="no model .* configs/nothing.pbtxt"):
        write_gpu_configs([0, 1], "nothing", repository)


@pytest.mark.parametrize(
    "text, available, message",
    [
        ("", None, "expected comma-separated GPU ids"),
        ("a", None, "expected comma-separated GPU ids"),
        ("0,,1", None, "expected comma-separated GPU ids"),
        ("-1", None, "expected comma-separated GPU ids"),
        ("0,0", None, "GPU ids must be distinct"),
        ("0,2", 2, r"GPU 2 not present \(this machine sees GPUs 0, 1\)"),
        ("0", 0, r"GPU 0 not present \(this machine sees no GPU\)"),
    ],
)
def test_bad_gpus_value_is_a_clear_error(text, available, message):
    with pytest.raises(ValueError, match=f"^--gpus: {message}"):
        parse_gpus(text, available)


def test_good_gpus_values():
    assert parse_gpus("0") == [0] and parse_gpus(" 1, 0 ", 2) == [1, 0] and parse_gpus("7") == [7]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--gpus", "0,x"], "--gpus: expected"),
        (["--gpus", "0,0"], "distinct"),
        (["--gpus", "0", "--cpu"], "not allowed with"),
    ],
)
def test_serve_refuses_a_bad_gpus_flag_before_starting(flags, message):
    run = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "serve"), *flags], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 2 and message in run.stderr, run.stderr


def test_python_backend_configs_differ_from_gpu_pbtxt_only_in_the_backend(repository):
    """`scripts/serve --backend python`: configs/gpu_python.pbtxt, the python_inprocess models on the python
    backend, every other model and field unchanged; over several GPUs spread from there."""
    assert serve_config_name(None, 1, model_repository=repository, backend="python") == "gpu_python"
    assert (
        backend_config_name("large", "python") == "large_python"
        and backend_config_name("gpu", "python_inprocess") == "gpu"
    )
    for model in GPU_MODELS:
        base = read_config(repository / model / "configs" / "gpu.pbtxt")
        generated = read_config(repository / model / "configs" / "gpu_python.pbtxt")
        assert generated.backend == "python", model
        assert without_placement(generated) == without_placement(base), model
        assert generated.instance_group == base.instance_group and generated == on_backend(base, "python"), model
    name = serve_config_name([0, 1], 2, model_repository=repository, keep_in_process=True, backend="python")
    assert name == "gpu_python_gpus_0_1"
    spread_file = read_config(repository / "ikbo_ranker" / "configs" / f"{name}.pbtxt")
    assert spread_file.backend == "python" and [list(g.gpus) for g in spread_file.instance_group] == [[0, 1]]
    with pytest.raises(ValueError, match="^--backend: expected one of python_inprocess, python"):
        serve_config_name(None, 1, model_repository=repository, backend="onnx")


def test_make_model_repository_writes_the_serve_time_configs(repository):
    """scripts/make_model_repository.py --gpus / --backend: the configs scripts/serve would derive, and their name."""
    script = REPO_ROOT / "scripts" / "make_model_repository.py"
    flags = ["--gpus", "0,1", "--no-check", "--backend", "python", "--model-repository", str(repository)]
    run = subprocess.run([sys.executable, str(script), *flags], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.split() == ["gpu_python_gpus_0_1"], run.stdout + run.stderr
    for model in GPU_MODELS:
        base = read_config(repository / model / "configs" / "gpu.pbtxt")
        generated = read_config(repository / model / "configs" / "gpu_python_gpus_0_1.pbtxt")
        assert generated == spread(on_backend(base, "python"), [0, 1]), model


def test_generated_files_are_ignored_by_git():
    names = [config_name("gpu", [0, 1]), backend_config_name("gpu", "python"), backend_config_name("large", "python")]
    paths = [f"model_repository/{model}/configs/{name}.pbtxt" for name in names for model in GPU_MODELS]
    run = subprocess.run(["git", "check-ignore", *paths], cwd=REPO_ROOT, capture_output=True, text=True)
    assert run.stdout.split() == paths
    tracked = "model_repository/ikbo_interaction/configs/gpu.pbtxt"
    assert subprocess.run(["git", "check-ignore", "-q", tracked], cwd=REPO_ROOT).returncode == 1


@pytest.mark.timeout(300)
def test_tritonserver_takes_configs_name_where_present_else_config_pbtxt(tmp_path):
    """What serving gpu_gpus_<ids> relies on for the ensembles, on this Triton (2.51): with
    --model-config-name=<name>, configs/<name>.pbtxt where a model has one, config.pbtxt where not.
    CPU placements (count 2) stand in for the GPU lists, so it runs anywhere."""
    repository = tmp_path / "model_repository"
    repository.mkdir()
    shutil.copy(MODEL_REPOSITORY / "shape_ranges.json", repository)
    for model in ("ranker_features", "ikbo_interaction", "ikbo_ranker"):
        (repository / model).mkdir()
        shutil.copy(MODEL_REPOSITORY / model / "config.pbtxt", repository / model)
        (repository / model / "1").symlink_to(MODEL_REPOSITORY / model / "1")  # model.py finds the repo root through it
        if model != "ikbo_ranker":
            config = read_config(MODEL_REPOSITORY / model / "config.pbtxt")
            config.instance_group[0].count = 2
            (repository / model / "configs").mkdir()
            (repository / model / "configs" / "check.pbtxt").write_text(str(config))
    load = ["--model-control-mode=explicit", "--load-model=ikbo_ranker"]
    with running_tritonserver(
        repository, config_name="check", extra_args=load, log_path=tmp_path / "tritonserver.log"
    ) as server:
        configs = {
            model: json.load(urllib.request.urlopen(f"http://{server.http_url}/v2/models/{model}/config", timeout=10))
            for model in ("ranker_features", "ikbo_interaction", "ikbo_ranker")
        }
    assert [g["count"] for g in configs["ranker_features"]["instance_group"]] == [2]
    assert [g["count"] for g in configs["ikbo_interaction"]["instance_group"]] == [2]
    assert (
        configs["ikbo_ranker"]["platform"] == "ensemble"
        and len(configs["ikbo_ranker"]["ensemble_scheduling"]["step"]) == 2
    )


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_an_instance_on_gpu_1_keeps_its_weights_and_work_there(tmp_path):
    """What the python backend does for an instance of gpu_gpus_0_1 on GPU 1 (model_instance_device_id
    "1"; the stub's current CUDA device is 0): weights, outputs and Triton launches on cuda:1
    (Triton launches on torch's current device, triton/runtime/jit.py), scores as on cuda:0.
    A fresh process: a kernel launched on the wrong device may leave the CUDA context unusable."""
    code = textwrap.dedent(
        """
        import json
        import numpy as np, torch
        from google.protobuf import json_format
        from ikbo_backend.instance_groups import read_config, spread
        from ikbo_backend.paths import MODEL_REPOSITORY
        from ikbo_backend.stages import InteractionModel
        from ikbo_backend.synthetic import make_request

        config = spread(read_config(MODEL_REPOSITORY / "ikbo_interaction/configs/gpu.pbtxt"), [0, 1])
        def instance(device_id):
            args = {"model_config": json.dumps(json_format.MessageToDict(config, preserving_proto_field_name=True)),
                    "model_repository": str(MODEL_REPOSITORY / "ikbo_interaction"), "model_name": "ikbo_interaction",
                    "model_instance_kind": "GPU", "model_instance_device_id": str(device_id)}
            return InteractionModel.from_triton_args(args)
        first = instance(0)  # one instance per stub process: each in turn here
        request = make_request(first.cfg, 15, 1024, np.random.default_rng(0))
        with torch.inference_mode():
            on_0 = first(first.example(request))["scores"].cpu()
        second = instance(1)
        assert torch.cuda.current_device() == 1, "the instance did not make its GPU current"
        weights = [*second.interaction.w.values(), second.interaction.lce.cand_weight, second.interaction.lce.user_weight]
        assert {w.device for w in weights} == {torch.device("cuda:1")}
        with torch.inference_mode():
            on_1 = second(second.example(request))["scores"]
        torch.cuda.synchronize(1)
        assert on_1.device == torch.device("cuda:1"), on_1.device
        torch.testing.assert_close(on_1.cpu(), on_0, rtol=1e-4, atol=1e-5)
        """
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
