"""What the model.py files of model_repository/ and the scripts share: paths, weights, declared shape
ranges, the served stages, and the request → response loop of the python backend.

Declared once:
- shape ranges: `model_repository/shape_ranges.json` ({"users": [lo, hi], "candidates": [lo, hi]},
  inclusive, and "typical": [[U, B], ...], the common request shapes, warmed up too). tritonserver
  ignores plain files at the repository root; the same numbers drive validation
  (`validate_request`), warm-up (`warmup_sizes`) and kernel precompilation (shape_spec.py).
- weights: the `weights` parameter of a model's config (relative paths from the repository root of
  this project), else `$IKBO_WEIGHTS`, else `<repo>/weights/ranker.safetensors`; a missing file is
  created with random weights (seed 0) of the config's `profile` parameter (ranker.PROFILES,
  default "demo"). The RankerConfig travels in the safetensors metadata; `check_model_config`
  refuses a config.pbtxt whose dims disagree with it.
- compute dtype: the interaction models' `compute_dtype` parameter ("float32" default, "bfloat16"
  in the large GPU configs: the Triton attention kernels take 16-bit inputs only).
- threads: an optional `torch_threads` parameter sets torch's intra-op threads per instance.

`triton_python_backend_utils` is imported only by the model.py files; they hand it to
`execute_requests`, so this module imports without a server.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.dlpack import from_dlpack, to_dlpack

from .cuda_graphs import GraphedInteraction, GraphedRanker
from .ranker import (
    COMPUTE_DTYPES,
    Features,
    FeatureStage,
    RankerConfig,
    build_ranker,
    load_weights,
    make_demo_weights,
    profile_config,
    save_weights,
)
from .requests import (
    INPUT_NAMES,
    InvalidRequest,
    ShapeRanges,
    check_request_shapes,
    check_request_values,
    input_widths,
    make_request,
    to_tensors,
    validate_request,
)
from .shape_spec import bucket_representatives

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL_REPOSITORY = REPO_ROOT / "model_repository"
SHAPE_RANGES_FILE = "shape_ranges.json"  # at the root of a model repository
DEFAULT_WEIGHTS = REPO_ROOT / "weights" / "ranker.safetensors"
FEATURE_NAMES = tuple(f.name for f in dataclasses.fields(Features))  # features stage → interaction stage


def weights_path(parameter: str | None = None) -> Path:
    """The weights file: config parameter, else $IKBO_WEIGHTS, else weights/ranker.safetensors."""
    chosen = parameter or os.environ.get("IKBO_WEIGHTS") or DEFAULT_WEIGHTS
    return (REPO_ROOT / chosen).resolve()  # absolute paths stay as they are


def ensure_weights(path=None, profile: str = "demo") -> Path:
    """Create random weights (seed 0) of the named profile at `path` if the file is missing. Atomic
    (temp file, then rename), so models loading in parallel never read half a file."""
    path = Path(path) if path is not None else weights_path()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        os.close(fd)
        try:
            cfg = profile_config(profile)
            save_weights(tmp, cfg, make_demo_weights(cfg, seed=0))
            os.replace(tmp, path)
        finally:
            Path(tmp).unlink(missing_ok=True)
    return path


def load_shape_ranges(model_repository=None) -> ShapeRanges:
    """The declared U and B ranges of a model repository (default: this project's)."""
    return ShapeRanges.from_json(Path(model_repository or MODEL_REPOSITORY) / SHAPE_RANGES_FILE)


def warmup_sizes(ranges: ShapeRanges) -> list[tuple[int, int]]:
    """(U, B) at both ends of the declared ranges, at their geometric middle, and the declared
    typical request shapes (so the common mix's cuBLAS choices and allocator blocks exist before
    the first request: on the H200 the first IKBO request took 3.5× the steady p50 without them)."""
    (u_lo, u_hi), (b_lo, b_hi) = ranges.users, ranges.candidates
    middle = (round((u_lo * u_hi) ** 0.5), round((b_lo * b_hi) ** 0.5))
    return list(dict.fromkeys([(u_lo, b_lo), middle, (u_hi, b_hi), *ranges.typical]))


# --- I/O of the served stages, as config.pbtxt must declare it (max_batch_size: 0, -1 = rows) ---


def request_dims(cfg: RankerConfig) -> dict[str, list[int]]:
    """The 7 raw inputs (ensembles and ranker_features)."""
    return {name: [-1] if width is None else [-1, width] for name, width in input_widths(cfg).items()}


def feature_dims(cfg: RankerConfig) -> dict[str, list[int]]:
    """Outputs of ranker_features = inputs of the interaction models."""
    return {
        "user_tokens": [-1, cfg.user_tokens, cfg.embedding_dim],
        "cand_tokens": [-1, cfg.cand_tokens, cfg.embedding_dim],
        "history_tokens": [-1, cfg.history_length, cfg.embedding_dim],
        "history_len": [-1],
        "cand_to_user": [-1],
    }


def score_dims(cfg: RankerConfig) -> dict[str, list[int]]:
    return {"scores": [-1, cfg.tasks]}


def check_model_config(model_config: dict, inputs: dict[str, list[int]], outputs: dict[str, list[int]]) -> None:
    """Raise ValueError if the model config (as JSON, the way the python backend passes it) does not
    declare exactly these input/output names and dims."""
    for kind, expected in (("input", inputs), ("output", outputs)):
        declared = {t["name"]: [int(d) for d in t["dims"]] for t in model_config.get(kind, [])}
        if declared != expected:
            raise ValueError(
                f"{model_config.get('name')}: config {kind}s {declared} do not match the weights' RankerConfig {expected}"
            )


TRITON_DTYPES = {
    "TYPE_FP32": torch.float32,
    "TYPE_BF16": torch.bfloat16,
    "TYPE_FP16": torch.float16,
    "TYPE_INT32": torch.int32,
    "TYPE_INT64": torch.int64,
}
FLOAT_FEATURES = ("user_tokens", "cand_tokens", "history_tokens")  # the float tensors between the stages


def feature_dtype(model_config: dict, kind: str) -> torch.dtype:
    """dtype of the float features a model config declares (kind "input" or "output"): float32 in the
    CPU and demo GPU configs; bfloat16 in the large ones, so that the 16-bit interaction's cast
    happens in the features stage and half the bytes cross between the ensemble steps."""
    declared = {t["name"]: t["data_type"] for t in model_config.get(kind, [])}
    kinds = {declared.get(name) for name in FLOAT_FEATURES}
    if len(kinds) != 1 or next(iter(kinds)) not in ("TYPE_FP32", "TYPE_BF16", "TYPE_FP16"):
        raise ValueError(
            f"{model_config.get('name')}: the {kind}s {list(FLOAT_FEATURES)} must share one float type, got {sorted(map(str, kinds))}"
        )
    return TRITON_DTYPES[kinds.pop()]


def set_torch_threads(value: str | None) -> None:
    """The `torch_threads` parameter of a model config: torch's intra-op threads in that model's
    process (unset: torch's default, one per core). Each python-backend instance is its own process,
    so on a small CPU several instances × all cores oversubscribe (docs/perf.md, CPU serving)."""
    if value is None or value == "":
        return
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"parameter torch_threads: expected a positive integer, got {value!r}")
    torch.set_num_threads(int(value))


def instance_device(kind: str, device_id) -> torch.device:
    """torch device of a model instance (args["model_instance_kind"], args["model_instance_device_id"])."""
    return torch.device(f"cuda:{int(device_id)}") if kind == "GPU" else torch.device("cpu")


class _ServedStage:
    """A stage of the ranker as one model instance serves it: `inputs` → `outputs`, torch tensors by
    name. Subclasses define `__call__`, `example` (a raw request → this stage's inputs, for warm-up)
    and `io_dims` (what config.pbtxt must declare for a RankerConfig)."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    config_parameters: tuple[str, ...] = ()  # config.pbtxt parameters passed to the constructor

    def __init__(self, cfg: RankerConfig, ranges: ShapeRanges, device):
        self.cfg, self.ranges, self.device = cfg, ranges, torch.device(device)

    @classmethod
    def from_triton_args(cls, args: dict):
        """Build from the python backend's initialize args (config and its parameters, weights,
        ranges of the served repository, instance device), check the config, warm up."""
        model_config = json.loads(args["model_config"])
        parameters = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
        cfg, weights = load_weights(
            ensure_weights(weights_path(parameters.get("weights")), parameters.get("profile", "demo"))
        )
        check_model_config(model_config, *cls.io_dims(cfg))
        ranges = load_shape_ranges(Path(args["model_repository"]).parent)
        set_torch_threads(parameters.get("torch_threads"))
        device = instance_device(args["model_instance_kind"], args["model_instance_device_id"])
        if device.type == "cuda":
            torch.cuda.set_device(device)  # Triton launches on the current device: make it this instance's GPU
        options = {k: parameters[k] for k in cls.config_parameters if k in parameters} | cls.options_from_config(
            model_config
        )
        model = cls(cfg, weights, ranges, device, **options)
        model.name = args["model_name"]  # for error messages
        model.warm_up()
        return model

    @staticmethod
    def options_from_config(model_config: dict) -> dict:
        """Constructor arguments read from the config's I/O declarations (none by default)."""
        return {}

    def warmup_shapes(self) -> list[tuple[int, int]]:
        """(U, B): the declared range's ends and middle, then one shape per Triton shape bucket of
        each op on this device (ikbo_backend/shape_spec.py; none on a CPU)."""
        dtype = getattr(self, "compute_dtype", torch.float32)
        buckets = bucket_representatives(self.cfg, self.ranges, self.device, dtype, graphs=self.replays_graphs())
        return list(dict.fromkeys(warmup_sizes(self.ranges) + buckets))

    def replays_graphs(self) -> bool:
        """Whether the stage's kernels run from CUDA graphs (the tuner then times them as replays)."""
        return False

    @torch.inference_mode()
    def warm_up(self, seed: int = 0) -> None:
        """Run requests at `warmup_shapes`: no Triton compilation is left for the request path. Then,
        if the stage replays from CUDA graphs, capture one per shape bucket (`capture_graphs`)."""
        rng = np.random.default_rng(seed)
        for num_users, num_candidates in self.warmup_shapes():
            self(self.example(make_request(self.cfg, num_users, num_candidates, rng)))
        self.capture_graphs(rng)

    def graph_example(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """A valid raw request at the first typical shape: the example of a graph capture."""
        shape = self.ranges.typical[0] if self.ranges.typical else (self.ranges.users[0], self.ranges.candidates[0])
        return make_request(self.cfg, *shape, rng)

    def capture_graphs(self, rng: np.random.Generator) -> None:
        """Capture this stage's CUDA graphs (example: `graph_example`); none by default."""


class FeatureModel(_ServedStage):
    """ranker_features: validate the raw request, then lookups and projections at natural batch sizes."""

    inputs, outputs = INPUT_NAMES, FEATURE_NAMES

    def __init__(self, cfg, weights, ranges, device="cpu", feature_dtype: torch.dtype = torch.float32):
        super().__init__(cfg, ranges, device)
        self.stage = FeatureStage(cfg, weights, self.device)
        self.feature_dtype = feature_dtype  # of the float outputs

    @staticmethod
    def io_dims(cfg):
        return request_dims(cfg), feature_dims(cfg)

    @staticmethod
    def options_from_config(model_config: dict) -> dict:
        return {"feature_dtype": feature_dtype(model_config, "output")}

    def example(self, request):
        return to_tensors(request)

    def warmup_shapes(self) -> list[tuple[int, int]]:
        """The range's ends and middle: this stage launches no Triton kernel (no buckets to tune)."""
        return warmup_sizes(self.ranges)

    def __call__(self, inputs):
        validate_request(self.cfg, self.ranges, inputs)  # InvalidRequest names the input
        features = self.stage(**{name: t.to(self.device) for name, t in inputs.items()})
        return {name: _as_feature(getattr(features, name), self.feature_dtype) for name in FEATURE_NAMES}


def use_cuda_graphs(value: str | None, device: torch.device) -> bool:
    """The `cuda_graphs` parameter ("yes" / "no", default "no"): replay the interaction from CUDA
    graphs per shape bucket (ikbo_backend/cuda_graphs.py). Only on a GPU; ignored on a CPU."""
    if value not in (None, "", "yes", "no"):
        raise ValueError(f"parameter cuda_graphs: expected 'yes' or 'no', got {value!r}")
    return value == "yes" and device.type == "cuda"


def _as_feature(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() else t


class InteractionModel(_ServedStage):
    """ikbo_interaction / baseline_interaction: features → scores [B, T] (config parameter `variant`)."""

    inputs, outputs = FEATURE_NAMES, ("scores",)
    config_parameters = ("variant", "compute_dtype", "cuda_graphs")

    def __init__(
        self, cfg, weights, ranges, device="cpu", variant: str = "ikbo", compute_dtype: str = "float32", cuda_graphs: str = "no",
        feature_dtype: torch.dtype = torch.float32,
    ):  # fmt: skip
        super().__init__(cfg, ranges, device)
        self.compute_dtype = COMPUTE_DTYPES.get(compute_dtype, compute_dtype)
        self.feature_dtype = feature_dtype  # of the float inputs
        self.features, self.interaction = build_ranker(
            variant, cfg, weights, self.device, dtype=compute_dtype
        )  # features: warm-up only
        if use_cuda_graphs(cuda_graphs, self.device):
            self.interaction = GraphedInteraction(self.interaction, ranges, self.device)

    @staticmethod
    def io_dims(cfg):
        return feature_dims(cfg), score_dims(cfg)

    @staticmethod
    def options_from_config(model_config: dict) -> dict:
        return {"feature_dtype": feature_dtype(model_config, "input")}

    def example(self, request):
        features = self.features(**to_tensors(request, self.device))
        return {name: _as_feature(getattr(features, name), self.feature_dtype) for name in FEATURE_NAMES}

    def replays_graphs(self) -> bool:
        return isinstance(self.interaction, GraphedInteraction)

    def capture_graphs(self, rng):
        if isinstance(self.interaction, GraphedInteraction):  # static inputs in the dtype the stage receives
            features = self.features(**to_tensors(self.graph_example(rng), self.device))
            self.interaction.capture_all(
                Features(**{k: _as_feature(v, self.feature_dtype) for k, v in vars(features).items()})
            )

    def _check(self, inputs):
        """The joins must be in range: a bad index must not reach a (device-side) gather. One device
        sync for both index tensors; the slow path names the one out of range."""
        num_users, num_candidates = inputs["user_tokens"].shape[0], inputs["cand_tokens"].shape[0]
        for name, rows in (("history_tokens", num_users), ("history_len", num_users), ("cand_to_user", num_candidates)):
            if inputs[name].shape[0] != rows:
                raise InvalidRequest(name, f"has {inputs[name].shape[0]} rows, expected {rows}")
        limits = (("cand_to_user", num_users), ("history_len", self.cfg.history_length + 1))
        for name, _ in limits:
            if inputs[name].dtype != torch.int32:
                raise InvalidRequest(name, f"expected dtype int32, got {inputs[name].dtype}".replace("torch.", ""))
        outside = [((inputs[name] < 0) | (inputs[name] >= high)).any() for name, high in limits]
        if bool(torch.stack(outside).any()):
            for (name, high), bad in zip(limits, outside):
                if bool(bad):
                    raise InvalidRequest(name, f"values outside [0, {high})")

    def __call__(self, inputs):
        self._check(inputs)
        features = Features(**{name: inputs[name].to(self.device) for name in FEATURE_NAMES})
        return {"scores": self.interaction(features)}


class RankerModel(_ServedStage):
    """ikbo_ranker / baseline_ranker / transformed_ranker as one python model (the large GPU configs;
    the CPU configs serve them as ensembles of ranker_features and an interaction model): check the
    raw request's shapes, run lookups and interaction in this process — replayed from one CUDA graph
    per shape bucket with `cuda_graphs`, which checks the values on the device (GraphedRanker), else
    eagerly after the host's value checks — and answer with the scores in host memory. No
    tensor crosses between python models, and the response holds no GPU tensor (in python backend
    2.51 each response with GPU outputs costs a second IPC round trip to the stub and a stream sync)."""

    inputs, outputs = INPUT_NAMES, ("scores",)
    config_parameters = ("variant", "compute_dtype", "cuda_graphs")

    def __init__(
        self, cfg, weights, ranges, device="cpu", variant: str = "ikbo", compute_dtype: str = "float32", cuda_graphs: str = "no",
        batch_invariant: bool = False,
    ):  # fmt: skip
        super().__init__(cfg, ranges, device)
        self.variant = variant
        self.compute_dtype = COMPUTE_DTYPES.get(compute_dtype, compute_dtype)
        self.features, self.interaction = build_ranker(
            variant, cfg, weights, self.device, dtype=compute_dtype, batch_invariant=batch_invariant
        )
        graphed = use_cuda_graphs(cuda_graphs, self.device)
        self.graphed = GraphedRanker(self.features, self.interaction, cfg, ranges, self.device) if graphed else None

    @staticmethod
    def io_dims(cfg):
        return request_dims(cfg), score_dims(cfg)

    def example(self, request):
        return to_tensors(request)  # host memory, as served

    def scores(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """scores [B, T] in host memory of a batch in the batch contract (7 inputs, shapes checked;
        values checked here: on the device by the graphs, else on the host)."""
        if self.graphed is not None:
            return self.graphed(batch)  # InvalidRequest for a bad value
        check_request_values(self.cfg, batch)
        return self.interaction(self.features(**{name: t.to(self.device) for name, t in batch.items()})).cpu()

    def replays_graphs(self) -> bool:
        return self.graphed is not None

    def capture_graphs(self, rng):
        if self.graphed is not None:
            self.graphed.capture_all(to_tensors(self.graph_example(rng)))

    def __call__(self, inputs):
        check_request_shapes(self.cfg, self.ranges, inputs)  # InvalidRequest names the input
        return {"scores": self.scores(inputs)}


def ranker_python_model(pb_utils):
    """The python backend's `TritonPythonModel` class of the one-model rankers (their model.py files
    are this and the sys.path line): `RankerModel` from the config; for the ikbo variant the custom
    metrics (ikbo_backend.metrics) of each answered request, wall time inside execute included; for
    the transformed variant the rewrite pass's report in the server log."""
    from .compile_counter import CompileCounter
    from .metrics import RankerMetrics, replicated_row_bytes

    class TritonPythonModel:
        def initialize(self, args):
            compilations = CompileCounter.install()  # Triton compilations: warm-up, then requests (must stay 0)
            self.model = RankerModel.from_triton_args(args)  # config, weights, device, warm-up, graphs
            compilations.phase = "request"
            if self.model.variant == "transformed":
                pb_utils.Logger.log_info(str(self.model.interaction.report))
            self.metrics = None
            if self.model.variant == "ikbo":
                row_bytes = replicated_row_bytes(self.model.cfg)
                self.metrics = RankerMetrics(pb_utils, args["model_name"], row_bytes, compilations, self.model.device)

        def execute(self, requests):
            start = time.perf_counter()
            responses = execute_requests(pb_utils, self.model, requests)
            if self.metrics is not None:
                self.metrics.record_responses(
                    pb_utils, requests, responses, users_input="user_dense", candidates_input="cand_dense"
                )
                self.metrics.record_execute(time.perf_counter() - start)
            return responses

        def finalize(self):
            if self.metrics is not None:
                self.metrics.close()  # the queued metric updates, then its worker thread ends

    return TritonPythonModel


def _to_torch(name: str, tensor) -> torch.Tensor:
    """A pb_utils.Tensor (CPU or GPU) as a torch tensor, without a copy: the python_inprocess backend's
    tensors are torch tensors already (`as_torch`), the python backend's go through DLPack. Not
    as_numpy(): python backend 2.51's stub builds wrong arrays under numpy 2 (every row = row 0, seen
    on the H200)."""
    if tensor is None:
        raise InvalidRequest(name, "missing")
    return tensor.as_torch() if hasattr(tensor, "as_torch") else from_dlpack(tensor.to_dlpack())


def from_torch(pb_utils, name: str, tensor: torch.Tensor):
    """A torch tensor as a pb_utils.Tensor, without a copy: the python_inprocess backend's Tensor holds
    it as it is, the python backend's takes it through DLPack."""
    if hasattr(pb_utils.Tensor, "as_torch"):
        return pb_utils.Tensor(name, tensor)
    return pb_utils.Tensor.from_dlpack(name, to_dlpack(tensor.contiguous()))


# Test-only fault injection: with IKBO_TEST_FAULTS=1 in the server's environment (never in `make serve`),
# a request parameter ikbo_test_fault="raise" makes execute raise an exception whose text holds internal
# details (this process's command line: model.py path, shared-memory key), as a real bug's might.
TEST_FAULTS_ENV = "IKBO_TEST_FAULTS"
TEST_FAULT_PARAMETER = "ikbo_test_fault"
_TEST_FAULTS = os.environ.get(TEST_FAULTS_ENV) == "1"  # read once: the server's environment is fixed at its start


def _injected_fault(request) -> None:
    if not _TEST_FAULTS:
        return
    if json.loads(request.parameters() or "{}").get(TEST_FAULT_PARAMETER) == "raise":
        cmdline = Path("/proc/self/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        raise RuntimeError(f"injected test fault in {cmdline}")


def execute_requests(pb_utils, model: _ServedStage, requests) -> list:
    """The python backend's execute: one response per request. A ValueError (InvalidRequest included)
    becomes an INVALID_ARG error response for that request alone (HTTP 400, gRPC INVALID_ARGUMENT);
    any other exception an INTERNAL one (HTTP 500) that names the model and the exception type only:
    its text, which may hold paths or shared-memory keys, goes to the server log. The other requests
    of the call are unaffected."""
    responses = []
    for request in requests:
        try:
            _injected_fault(request)
            inputs = {name: _to_torch(name, pb_utils.get_input_tensor_by_name(request, name)) for name in model.inputs}
            with torch.inference_mode():
                outputs = model(inputs)
            tensors = [from_torch(pb_utils, name, t) for name, t in outputs.items()]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        except ValueError as e:
            responses.append(
                pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG))
            )
        except Exception as e:
            name = getattr(model, "name", type(model).__name__)
            pb_utils.Logger.log_error(f"{name}: {type(e).__name__}: {e}")
            message = f"model '{name}': internal error ({type(e).__name__}); details are in the server log"
            responses.append(
                pb_utils.InferenceResponse(error=pb_utils.TritonError(message, pb_utils.TritonError.INTERNAL))
            )
    return responses
