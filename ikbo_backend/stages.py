"""The served stages of the ranker: what one model instance runs, built from its config.

| stage            | models                                        | inputs → outputs          |
|------------------|-----------------------------------------------|---------------------------|
| FeatureModel     | ranker_features                               | raw request → features    |
| InteractionModel | ikbo / baseline / transformed_interaction     | features → scores         |
| RankerModel      | ikbo / baseline / transformed_ranker (GPU)    | raw request → scores      |
| OnlineModel      | ikbo / baseline_ranker_online                 | online requests → scores  |

Each is built from the python backend's initialize args (`from_triton_args`: config, weights, shape
ranges, device; model_config.py reads the config, paths.py finds the files), checks that the config
declares its I/O, and warms up at load: every declared range end and typical shape, one shape per
Triton shape bucket on a GPU, then the CUDA graphs if the config asks for them. python_model.py
serves them. torch tensors by name in and out; no server import here.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from .autotune import bucket_representatives
from .cuda_graphs import GraphedInteraction, GraphedRanker
from .model_config import (
    FEATURE_NAMES,
    check_model_config,
    feature_dims,
    feature_dtype,
    instance_device,
    model_parameters,
    online_dims,
    request_dims,
    score_dims,
    set_torch_threads,
    use_cuda_graphs,
)
from .online import ONLINE_INPUT_NAMES
from .paths import ensure_weights, load_shape_ranges, weights_path
from .ranker import Features, FeatureStage, RankerConfig, load_weights
from .requests import (
    INPUT_NAMES,
    InvalidRequest,
    ShapeRanges,
    check_request_shapes,
    check_request_values,
    validate_request,
)
from .synthetic import make_request, to_tensors
from .variants import COMPUTE_DTYPES, build_ranker


def warmup_sizes(ranges: ShapeRanges) -> list[tuple[int, int]]:
    """(U, B) at both ends of the declared ranges, at their geometric middle, and the declared
    typical request shapes (so the common mix's cuBLAS choices and allocator blocks exist before
    the first request, which would take several times the steady latency without them)."""
    (u_lo, u_hi), (b_lo, b_hi) = ranges.users, ranges.candidates
    middle = (round((u_lo * u_hi) ** 0.5), round((b_lo * b_hi) ** 0.5))
    return list(dict.fromkeys([(u_lo, b_lo), middle, (u_hi, b_hi), *ranges.typical]))


class ServedStage:
    """A stage of the ranker as one model instance serves it: `inputs` → `outputs`, torch tensors by
    name. Subclasses define `__call__`, `example` (a raw request → this stage's inputs, for warm-up)
    and `io_dims` (what config.pbtxt must declare for a RankerConfig)."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    shape_inputs: tuple[str, str]  # the inputs with one row per user and one per candidate: U and B
    config_parameters: tuple[str, ...] = ()  # config.pbtxt parameters passed to the constructor

    def __init__(self, cfg: RankerConfig, ranges: ShapeRanges, device):
        self.cfg, self.ranges, self.device = cfg, ranges, torch.device(device)

    @classmethod
    def from_triton_args(cls, args: dict):
        """Build from the python backend's initialize args (config and its parameters, weights,
        ranges of the served repository, instance device), check the config, warm up."""
        model_config = json.loads(args["model_config"])
        parameters = model_parameters(model_config)
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
        each op on this device (ikbo_backend/kernel_buckets.py; none on a CPU)."""
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


class FeatureModel(ServedStage):
    """ranker_features: validate the raw request, then lookups and projections at natural batch sizes."""

    inputs, outputs = INPUT_NAMES, FEATURE_NAMES
    shape_inputs = ("user_dense", "cand_dense")

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


def _as_feature(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() else t


class InteractionModel(ServedStage):
    """ikbo_interaction / baseline_interaction / transformed_interaction: features → scores [B, T]
    (config parameter `variant`)."""

    inputs, outputs = FEATURE_NAMES, ("scores",)
    shape_inputs = ("user_tokens", "cand_tokens")
    config_parameters = ("variant", "compute_dtype", "cuda_graphs")

    def __init__(
        self, cfg, weights, ranges, device="cpu", variant: str = "ikbo", compute_dtype: str = "float32", cuda_graphs: str = "no",
        feature_dtype: torch.dtype = torch.float32,
    ):  # fmt: skip
        super().__init__(cfg, ranges, device)
        self.variant = variant
        self.compute_dtype = COMPUTE_DTYPES.get(compute_dtype, compute_dtype)
        self.feature_dtype = feature_dtype  # of the float inputs
        graphed = use_cuda_graphs(cuda_graphs, self.device)
        self.features, self.interaction = build_ranker(
            variant, cfg, weights, self.device, dtype=compute_dtype, cuda_graphs=graphed
        )  # features: warm-up only
        if graphed:
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


class RankerModel(ServedStage):
    """ikbo_ranker / baseline_ranker / transformed_ranker as one python model (the large GPU configs;
    the CPU configs serve them as ensembles of ranker_features and an interaction model): check the
    raw request's shapes, run lookups and interaction in this process — replayed from one CUDA graph
    per shape bucket with `cuda_graphs`, which checks the values on the device (GraphedRanker), else
    eagerly after the host's value checks — and answer with the scores in host memory. No
    tensor crosses between python models, and the response holds no GPU tensor (in python backend
    2.51 each response with GPU outputs costs a second IPC round trip to the stub and a stream sync)."""

    inputs, outputs = INPUT_NAMES, ("scores",)
    shape_inputs = ("user_dense", "cand_dense")
    config_parameters = ("variant", "compute_dtype", "cuda_graphs")

    def __init__(
        self, cfg, weights, ranges, device="cpu", variant: str = "ikbo", compute_dtype: str = "float32", cuda_graphs: str = "no",
        batch_invariant: bool = False,
    ):  # fmt: skip
        super().__init__(cfg, ranges, device)
        self.variant = variant
        self.compute_dtype = COMPUTE_DTYPES.get(compute_dtype, compute_dtype)
        graphed = use_cuda_graphs(cuda_graphs, self.device)
        self.features, self.interaction = build_ranker(
            variant,
            cfg,
            weights,
            self.device,
            dtype=compute_dtype,
            batch_invariant=batch_invariant,
            cuda_graphs=graphed,
        )
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


class OnlineModel(RankerModel):
    """ikbo_ranker_online / baseline_ranker_online: the one-model ranker behind the online contract
    (online.py). Called on a batch in the batch contract (scores [B, T] in host memory; values
    checked, InvalidRequest for a bad one; shapes are the caller's); python_model.execute_online
    serves the online contract. A single python model per variant (not an ensemble): one batching
    point, no copy between steps.

    With the config parameter `batch_invariant: "yes"` (the CPU configs; default "no") the batch runs
    in the batch-invariant CPU mode (ikbo_backend/batch_invariant.py): every request's scores are
    bit-identical to its scores sent alone, whatever else shares its batch."""

    inputs = ONLINE_INPUT_NAMES
    config_parameters = RankerModel.config_parameters + ("batch_invariant",)

    def __init__(
        self, cfg, weights, ranges, device="cpu", variant: str = "ikbo", compute_dtype: str = "float32", cuda_graphs: str = "no",
        batch_invariant: str = "no",
    ):  # fmt: skip
        if batch_invariant not in ("yes", "no"):
            raise ValueError(f"parameter batch_invariant: expected 'yes' or 'no', got {batch_invariant!r}")
        super().__init__(
            cfg, weights, ranges, device, variant, compute_dtype, cuda_graphs, batch_invariant=batch_invariant == "yes"
        )

    @staticmethod
    def io_dims(cfg):
        return online_dims(cfg), score_dims(cfg)

    def __call__(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """scores [B, T] of a batch (the batch contract, `cand_to_user` included)."""
        return self.scores(batch)
