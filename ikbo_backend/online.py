"""Online endpoints (`ikbo_ranker_online`, `baseline_ranker_online`): one request = one user and that
user's candidates; the runtime, never the client, builds `cand_to_user`.

Contract: the inputs of `ikbo_ranker` without `cand_to_user`, each with a leading request dimension
of 1 (`max_batch_size` > 0):

| input            | per request | config dims        |
|------------------|-------------|--------------------|
| user_dense       | [1, Fu]     | [Fu]               |
| user_sparse_ids  | [1, Su]     | [Su]               |
| user_history_ids | [1, L]      | [L]                |
| user_history_len | [1, 1]      | [1], reshape: []   |
| cand_dense       | [1, n, Fc]  | [-1, Fc], ragged   |
| cand_sparse_ids  | [1, n, Sc]  | [-1, Sc], ragged   |

Output `scores` [1, n, T]. n is free per request. `user_history_len` travels as [1, 1] (Triton
needs a dim after the request dimension) and reaches the model as [1] (reshape). Triton's dynamic batcher coalesces concurrent
requests (ragged batching on the NRO inputs: the python backend receives them as separate requests
in one `execute`); `execute_online` checks each one's shapes alone (at U = 1), concatenates them —
request i becomes user i, its candidates get `cand_to_user` = i — runs the feature stage and the
interaction in-process as one IKBO batch (serving.RankerModel: one CUDA graph per shape bucket on a
GPU, which checks the values on the device), and splits the scores back (host memory). A bad request
gets its own INVALID_ARG response and no answer it shares a batch with changes: a batch with a bad
value is run again without it. A single python model per variant (not an
ensemble): one batching point, no copy between steps.

With the config parameter `batch_invariant: "yes"` (the CPU configs; default "no") the batch runs
in the batch-invariant CPU mode (ikbo_backend/batch_invariant.py): every request's scores are
bit-identical to its scores sent alone, whatever else shares its batch.
"""

from __future__ import annotations

import numpy as np
import torch

from .ranker import RankerConfig
from .requests import (
    CAND_INPUTS,
    INPUT_NAMES,
    USER_INPUTS,
    InvalidRequest,
    check_request_shapes,
    check_request_values,
    input_widths,
    make_request,
)
from .serving import RankerModel, _to_torch, from_torch, score_dims

ONLINE_INPUT_NAMES = tuple(name for name in INPUT_NAMES if name != "cand_to_user")
ONLINE_CAND_INPUTS = tuple(name for name in CAND_INPUTS if name != "cand_to_user")  # NRO, ragged


def online_dims(cfg: RankerConfig) -> dict[str, list[int]]:
    """Input dims as config.pbtxt declares them (without the request dimension)."""
    widths = input_widths(cfg)
    dims = {name: [widths[name]] if widths[name] is not None else [1] for name in USER_INPUTS}
    dims.update({name: [-1, widths[name]] for name in ONLINE_CAND_INPUTS})
    return dims


def split_by_user(request: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """A batch request (U users, `cand_to_user`) → U online requests, candidates in their batch order.
    What a client of the online endpoint sends; `merge_scores` puts the answers back in batch order."""
    mapping = request["cand_to_user"]
    online = []
    for user in range(len(request["user_dense"])):
        rows = np.flatnonzero(mapping == user)
        one = {name: request[name][user : user + 1] for name in USER_INPUTS}
        one["user_history_len"] = one["user_history_len"][:, None]  # [1, 1]
        one.update({name: request[name][rows][None] for name in ONLINE_CAND_INPUTS})
        online.append(one)
    return online


def make_online_batch(
    cfg: RankerConfig, num_users: int, num_candidates: int, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """A random batch request (`make_request`) in which every user has at least one candidate (B ≥ U),
    so that `split_by_user` of it gives U valid online requests of B/U candidates on average."""
    if not 1 <= num_users <= num_candidates:
        raise ValueError(f"num_users: expected in [1, B={num_candidates}], got {num_users}")
    request = make_request(cfg, num_users, num_candidates, rng)
    counts = 1 + rng.multinomial(num_candidates - num_users, np.full(num_users, 1 / num_users))
    request["cand_to_user"] = rng.permutation(np.repeat(np.arange(num_users), counts)).astype(np.int32)
    return request


def merge_scores(request: dict[str, np.ndarray], scores: list[np.ndarray]) -> np.ndarray:
    """Per-user answers [1, n_u, T] of `split_by_user(request)` → scores [B, T] in batch order."""
    merged = np.empty((len(request["cand_to_user"]), scores[0].shape[-1]), dtype=scores[0].dtype)
    for user, answer in enumerate(scores):
        merged[request["cand_to_user"] == user] = answer[0]
    return merged


def unbatch(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One online request → the batch contract at U = 1 (user rows as sent, candidates without the
    request dimension, `cand_to_user` all 0). InvalidRequest if a tensor does not hold one request."""
    single = {}
    for name in ONLINE_INPUT_NAMES:
        t = inputs[name]
        if t.dim() == 0 or t.shape[0] != 1:
            raise InvalidRequest(
                name, f"expected one user per request (leading dimension 1), got shape {list(t.shape)}"
            )
        single[name] = t if name in USER_INPUTS else t[0]
    single["cand_to_user"] = torch.zeros(
        single["cand_dense"].shape[0], dtype=torch.int32, device=single["cand_dense"].device
    )
    return single


def coalesce(singles: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Requests at U = 1 → one batch: request i is user i; `cand_to_user` from the request boundaries."""
    batch = {name: torch.cat([s[name] for s in singles]) for name in ONLINE_INPUT_NAMES}
    counts = torch.tensor([s["cand_dense"].shape[0] for s in singles])
    users = torch.arange(len(singles), dtype=torch.int32)
    batch["cand_to_user"] = torch.repeat_interleave(users, counts).to(batch["cand_dense"].device)
    return batch


def groups_within(counts: list[int], max_users: int, max_candidates: int) -> list[slice]:
    """Consecutive requests cut into batches of at most `max_users` users and `max_candidates`
    candidates (the declared shape ranges: the kernels are warmed up for those shapes only)."""
    groups, start, total = [], 0, 0
    for i, count in enumerate(counts):
        if i > start and (i - start >= max_users or total + count > max_candidates):
            groups.append(slice(start, i))
            start, total = i, 0
        total += count
    if counts:
        groups.append(slice(start, len(counts)))
    return groups


class OnlineModel(RankerModel):
    """ikbo_ranker_online / baseline_ranker_online: the one-model ranker (serving.RankerModel) behind
    the online contract. Called on a batch in the batch contract (scores [B, T] in host memory; values
    checked, InvalidRequest for a bad one; shapes are the caller's); `execute_online` serves the
    online contract. `batch_invariant` "yes": the batch-invariant CPU mode (module doc)."""

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

    def example(self, request):
        return {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in request.items()}

    def __call__(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """scores [B, T] of a batch (the batch contract, `cand_to_user` included)."""
        return self.scores(batch)


def execute_online(pb_utils, model: OnlineModel, requests, metrics=None) -> list:
    """The python backend's execute for the online endpoints: one response per request, in order.
    Each request's shapes are checked alone; the rest run as one IKBO batch per `groups_within`
    chunk, whose values the model checks (on the GPU inside its graph, else on the host, once per
    batch). If a batch holds a bad value, every request's values are checked alone on the host, the
    bad ones get INVALID_ARG and the valid ones run again, grouped as if the bad ones had never come:
    no answer or metric of the first pass is kept. Any other error fails its chunk with INTERNAL,
    naming only the model and the exception type (the text goes to the server log).
    `metrics.record(U, B)` per answered batch."""

    def error(message, code):
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))

    responses: list = [None] * len(requests)
    shaped: list[tuple[int, dict[str, torch.Tensor]]] = []
    for index, request in enumerate(requests):
        try:
            raw = {
                name: _to_torch(name, pb_utils.get_input_tensor_by_name(request, name)) for name in ONLINE_INPUT_NAMES
            }
            single = unbatch(raw)
            check_request_shapes(model.cfg, model.ranges, single)  # InvalidRequest names the input
            shaped.append((index, single))
        except ValueError as e:
            responses[index] = error(str(e), pb_utils.TritonError.INVALID_ARG)
    try:
        answered, batches = _run_batches(pb_utils, model, shaped)
    except InvalidRequest:  # a bad value somewhere: find it request by request
        valid = []
        for index, single in shaped:
            try:
                check_request_values(model.cfg, single)
                valid.append((index, single))
            except ValueError as e:
                responses[index] = error(str(e), pb_utils.TritonError.INVALID_ARG)
        answered, batches = _run_batches(pb_utils, model, valid)
    for index, response in answered:
        responses[index] = response
    if metrics is not None:
        for num_users, num_candidates in batches:
            metrics.record(num_users, num_candidates)
    return responses


def _run_batches(pb_utils, model: OnlineModel, members: list[tuple[int, dict[str, torch.Tensor]]]):
    """([(request index, response)], [(U, B) of each answered batch]) of requests at U = 1, run as
    `groups_within` batches. InvalidRequest (a value check of a batch failed) propagates; any other
    error answers its chunk with INTERNAL."""
    counts = [single["cand_dense"].shape[0] for _, single in members]
    answered, batches = [], []
    for group in groups_within(counts, model.ranges.users[1], model.ranges.candidates[1]):
        chunk = members[group]
        try:
            with torch.inference_mode():
                scores = model(coalesce([single for _, single in chunk]))  # [B, T]
            for (index, _), part in zip(chunk, torch.split(scores, counts[group])):
                tensor = from_torch(pb_utils, "scores", part[None])  # [1, n, T]
                answered.append((index, pb_utils.InferenceResponse(output_tensors=[tensor])))
            batches.append((len(chunk), sum(counts[group])))
        except InvalidRequest:
            raise
        except Exception as e:
            name = getattr(model, "name", type(model).__name__)
            pb_utils.Logger.log_error(f"{name}: {type(e).__name__}: {e}")  # details only in the server log
            message = f"model '{name}': internal error ({type(e).__name__}); details are in the server log"
            answered += [
                (index, pb_utils.InferenceResponse(error=pb_utils.TritonError(message, pb_utils.TritonError.INTERNAL)))
                for index, _ in chunk
            ]
    return answered, batches
