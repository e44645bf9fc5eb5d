"""The ranking request contract: inputs, declared shape ranges, validation (random requests: synthetic.py).

One request holds U users and B candidates:

| input              | side    | dtype | shape   | meaning                                   |
|--------------------|---------|-------|---------|-------------------------------------------|
| user_dense         | RO      | FP32  | [U, Fu] | user dense features, finite, |x| ≤ 1e30   |
| user_sparse_ids    | RO      | INT64 | [U, Su] | one id per user sparse slot, [0, Vu)      |
| user_history_ids   | RO      | INT64 | [U, L]  | item ids of the history, [0, Vi)          |
| user_history_len   | RO      | INT32 | [U]     | valid history positions, [0, L]           |
| cand_dense         | NRO     | FP32  | [B, Fc] | candidate dense features, finite, ≤ 1e30  |
| cand_sparse_ids    | NRO     | INT64 | [B, Sc] | one id per candidate sparse slot, [0, Vc) |
| cand_to_user       | mapping | INT32 | [B]     | the user of each candidate, [0, U)        |

Output `scores` FP32 [B, T]. IDs outside a table are rejected (no hashing); NaN/Inf dense values
are rejected, and so are dense magnitudes above DENSE_ABS_MAX (near the float32 maximum the
first projection overflows). History positions ≥ user_history_len are ignored but must hold valid ids (pad with 0).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kernels.request_checks import clamp_flagged_, flag_unbounded

from .ranker import RankerConfig

USER_INPUTS = ("user_dense", "user_sparse_ids", "user_history_ids", "user_history_len")
CAND_INPUTS = ("cand_dense", "cand_sparse_ids", "cand_to_user")
INPUT_NAMES = USER_INPUTS + CAND_INPUTS
DENSE_ABS_MAX = 1e30  # |dense feature| bound: scores stay finite up to here (tests/test_reliability_numeric.py)
INPUT_DTYPES = {
    "user_dense": torch.float32,
    "user_sparse_ids": torch.int64,
    "user_history_ids": torch.int64,
    "user_history_len": torch.int32,
    "cand_dense": torch.float32,
    "cand_sparse_ids": torch.int64,
    "cand_to_user": torch.int32,
}


def input_widths(cfg: RankerConfig) -> dict[str, int | None]:
    """Second dimension of each input (None for [rows] vectors)."""
    return {
        "user_dense": cfg.user_dense_features,
        "user_sparse_ids": cfg.user_sparse_features,
        "user_history_ids": cfg.history_length,
        "user_history_len": None,
        "cand_dense": cfg.cand_dense_features,
        "cand_sparse_ids": cfg.cand_sparse_features,
        "cand_to_user": None,
    }


@dataclass(frozen=True)
class ShapeRanges:
    """Declared batch ranges, inclusive. One source for validation, warm-up and precompilation:
    the served numbers live in `model_repository/shape_ranges.json` (`paths.load_shape_ranges`)."""

    users: tuple[int, int]
    candidates: tuple[int, int]
    typical: tuple[tuple[int, int], ...] = ()  # (U, B) of the common requests: warmed up at load too

    def __post_init__(self):
        object.__setattr__(self, "typical", tuple(tuple(int(n) for n in shape) for shape in self.typical))
        for num_users, num_candidates in self.typical:
            if not (
                self.users[0] <= num_users <= self.users[1]
                and self.candidates[0] <= num_candidates <= self.candidates[1]
            ):
                raise ValueError(
                    f"typical shape {(num_users, num_candidates)} lies outside users {self.users}, candidates {self.candidates}"
                )

    @classmethod
    def from_json(cls, path) -> ShapeRanges:
        spec = json.loads(Path(path).read_text())
        return cls(tuple(spec["users"]), tuple(spec["candidates"]), tuple(map(tuple, spec.get("typical", ()))))


class InvalidRequest(ValueError):
    """A client error; the message starts with the input it is about."""

    def __init__(self, name: str, problem: str):
        super().__init__(f"input '{name}': {problem}")
        self.input_name = name


def _host_array(t: torch.Tensor) -> np.ndarray:
    """A view (host tensors) or copy of `t` as a numpy array: one numpy reduction over a request's
    few hundred KB costs microseconds, a torch CPU op tens of them."""
    return t.numpy() if t.device.type == "cpu" else t.cpu().numpy()


def _check_range(name, values, low, high, what):
    """values must lie in [low, high); report the first offender."""
    if values.numel() == 0:
        return
    array = _host_array(values)
    if low <= array.min() and array.max() < high:
        return
    bad = (values < low) | (values >= high)
    index = tuple(int(i) for i in bad.nonzero()[0])
    raise InvalidRequest(name, f"value {int(values[index])} at index {list(index)} is outside {what}")


def validate_request(cfg: RankerConfig, ranges: ShapeRanges, inputs: dict[str, torch.Tensor]) -> None:
    """Raise InvalidRequest naming the input and the problem; return None for a valid request."""
    check_request_shapes(cfg, ranges, inputs)
    check_request_values(cfg, inputs)


def check_request_shapes(cfg: RankerConfig, ranges: ShapeRanges, inputs: dict[str, torch.Tensor]) -> None:
    """The metadata half of `validate_request`: names, dtypes, ranks, widths, row counts, and U and B
    inside the served ranges. Reads no values."""
    for name in INPUT_NAMES:
        if name not in inputs:
            raise InvalidRequest(name, "missing")
    for name in inputs:
        if name not in INPUT_DTYPES:
            raise InvalidRequest(name, f"unknown input; expected {', '.join(INPUT_NAMES)}")
    widths = input_widths(cfg)
    for name in INPUT_NAMES:
        t, width = inputs[name], widths[name]
        if t.dtype != INPUT_DTYPES[name]:
            raise InvalidRequest(name, f"expected dtype {INPUT_DTYPES[name]}, got {t.dtype}".replace("torch.", ""))
        rank = 1 if width is None else 2
        if t.dim() != rank:
            raise InvalidRequest(name, f"expected rank {rank}, got shape {list(t.shape)}")
        if width is not None and t.shape[1] != width:
            raise InvalidRequest(name, f"expected {width} columns, got shape {list(t.shape)}")

    num_users, num_candidates = inputs["user_dense"].shape[0], inputs["cand_dense"].shape[0]
    for name in USER_INPUTS[1:]:
        if inputs[name].shape[0] != num_users:
            raise InvalidRequest(name, f"has {inputs[name].shape[0]} rows but user_dense has U={num_users}")
    for name in CAND_INPUTS[1:]:
        if inputs[name].shape[0] != num_candidates:
            raise InvalidRequest(name, f"has {inputs[name].shape[0]} rows but cand_dense has B={num_candidates}")
    if num_candidates == 0:
        raise InvalidRequest("cand_dense", "B = 0: a request needs at least one candidate")
    low, high = ranges.users
    if not low <= num_users <= high:
        raise InvalidRequest("user_dense", f"U = {num_users} is outside the served range [{low}, {high}]")
    low, high = ranges.candidates
    if not low <= num_candidates <= high:
        raise InvalidRequest("cand_dense", f"B = {num_candidates} is outside the served range [{low}, {high}]")


def index_bounds(cfg: RankerConfig, last_user) -> dict[str, tuple[int, object]]:
    """Inclusive [low, high] of each index input; `last_user` = U - 1, an int or a 0-d tensor."""
    return {
        "cand_to_user": (0, last_user),
        "user_history_len": (0, cfg.history_length),
        "user_sparse_ids": (0, cfg.user_vocab_size - 1),
        "cand_sparse_ids": (0, cfg.cand_vocab_size - 1),
        "user_history_ids": (0, cfg.item_vocab_size - 1),
    }


def check_request_values(cfg: RankerConfig, inputs: dict[str, torch.Tensor]) -> None:
    """The value half of `validate_request` (shapes already checked): dense values finite and at most
    DENSE_ABS_MAX in magnitude, every index inside its table, the mapping and the lengths in range.
    Numpy reductions first; torch ops only to name the first offender."""
    for name in ("user_dense", "cand_dense"):
        array = _host_array(inputs[name])
        low, high = array.min(), array.max()  # NaN propagates into both
        if np.isfinite(low) and np.isfinite(high) and max(-low, high) <= DENSE_ABS_MAX:
            continue
        finite = torch.isfinite(inputs[name])
        if not bool(finite.all()):
            index = [int(i) for i in (~finite).nonzero()[0]]
            raise InvalidRequest(name, f"NaN or Inf at index {index}")
        too_large = inputs[name].abs() > DENSE_ABS_MAX
        if bool(too_large.any()):
            index = [int(i) for i in too_large.nonzero()[0]]
            raise InvalidRequest(
                name, f"magnitude {float(inputs[name][tuple(index)]):.3g} at index {index} is above {DENSE_ABS_MAX:g}"
            )
    num_users = inputs["user_dense"].shape[0]
    tables = {
        "cand_to_user": f"[0, U={num_users})",
        "user_history_len": f"[0, L={cfg.history_length}]",
        "user_sparse_ids": f"the table [0, {cfg.user_vocab_size})",
        "cand_sparse_ids": f"the table [0, {cfg.cand_vocab_size})",
        "user_history_ids": f"the table [0, {cfg.item_vocab_size})",
    }
    for name, (low, high) in index_bounds(cfg, num_users - 1).items():
        _check_range(name, inputs[name], low, high + 1, tables[name])


def check_values_on_device(
    cfg: RankerConfig, inputs: dict[str, torch.Tensor], last_user: torch.Tensor, flag: torch.Tensor
) -> None:
    """The device twin of `check_request_values`, with no host sync (a CUDA graph holds it): every
    index input clamped into its range in place (a bad index never reaches a gather), and flag[0]
    set to 1 if any value check fails (kernels.request_checks). `last_user`: U - 1 as a 0-d int32
    tensor on the inputs' device; flag: float32 [1], zeroed by the caller. A flagged request's
    scores are discarded and `check_request_values` names the offender on the host."""
    for name in ("user_dense", "cand_dense"):
        flag_unbounded(inputs[name], DENSE_ABS_MAX, flag)
    for name, (low, high) in index_bounds(cfg, last_user).items():
        clamp_flagged_(inputs[name], low, high, flag)
