"""A served model's config.pbtxt as the stages read it (as JSON, the way the python backend passes it).

- I/O: the names and dims each stage must declare for a RankerConfig (max_batch_size: 0, -1 = rows;
  the online models batch, so their dims leave out the request dimension). `check_model_config`
  refuses a config whose dims disagree with the weights' RankerConfig.
- float features: their dtype between ranker_features and the interaction models (`feature_dtype`).
- parameters: `weights`, `profile` (paths.py), `variant`, `compute_dtype` ("float32" default,
  "bfloat16" in the large GPU configs: the Triton attention kernels take 16-bit inputs only),
  `cuda_graphs`, `batch_invariant` (stages.py), and `torch_threads`, torch's intra-op threads per
  instance (`set_torch_threads`).
"""

from __future__ import annotations

import dataclasses

import torch

from .online import ONLINE_CAND_INPUTS
from .ranker import Features, RankerConfig
from .requests import USER_INPUTS, input_widths

FEATURE_NAMES = tuple(f.name for f in dataclasses.fields(Features))  # features stage → interaction stage
FLOAT_FEATURES = ("user_tokens", "cand_tokens", "history_tokens")  # the float tensors between the stages
TRITON_DTYPES = {
    "TYPE_FP32": torch.float32,
    "TYPE_BF16": torch.bfloat16,
    "TYPE_FP16": torch.float16,
    "TYPE_INT32": torch.int32,
    "TYPE_INT64": torch.int64,
}


def request_dims(cfg: RankerConfig) -> dict[str, list[int]]:
    """The 7 raw inputs (ensembles, ranker_features and the one-model rankers)."""
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


def online_dims(cfg: RankerConfig) -> dict[str, list[int]]:
    """Inputs of the online models (the online contract, online.py), without the request dimension."""
    widths = input_widths(cfg)
    dims = {name: [widths[name]] if widths[name] is not None else [1] for name in USER_INPUTS}
    dims.update({name: [-1, widths[name]] for name in ONLINE_CAND_INPUTS})
    return dims


def check_model_config(model_config: dict, inputs: dict[str, list[int]], outputs: dict[str, list[int]]) -> None:
    """Raise ValueError if the model config does not declare exactly these input/output names and dims."""
    for kind, expected in (("input", inputs), ("output", outputs)):
        declared = {t["name"]: [int(d) for d in t["dims"]] for t in model_config.get(kind, [])}
        if declared != expected:
            raise ValueError(
                f"{model_config.get('name')}: config {kind}s {declared} do not match the weights' RankerConfig {expected}"
            )


def model_parameters(model_config: dict) -> dict[str, str]:
    """The config's `parameters`, name → string value."""
    return {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}


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
    """The `torch_threads` parameter: torch's intra-op threads in that model's process (unset: torch's
    default, one per core). Each python-backend instance is its own process, so on a small CPU several
    instances × all cores oversubscribe."""
    if value is None or value == "":
        return
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"parameter torch_threads: expected a positive integer, got {value!r}")
    torch.set_num_threads(int(value))


def use_cuda_graphs(value: str | None, device: torch.device) -> bool:
    """The `cuda_graphs` parameter ("yes" / "no", default "no"): replay the stage from CUDA graphs per
    shape bucket (ikbo_backend/cuda_graphs.py). Only on a GPU; ignored on a CPU."""
    if value not in (None, "", "yes", "no"):
        raise ValueError(f"parameter cuda_graphs: expected 'yes' or 'no', got {value!r}")
    return value == "yes" and device.type == "cuda"


def instance_device(kind: str, device_id) -> torch.device:
    """torch device of a model instance (args["model_instance_kind"], args["model_instance_device_id"])."""
    return torch.device(f"cuda:{int(device_id)}") if kind == "GPU" else torch.device("cpu")
