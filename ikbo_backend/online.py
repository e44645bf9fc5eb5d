"""The online contract (`ikbo_ranker_online`, `baseline_ranker_online`): one request = one user and
that user's candidates; the runtime, never the client, builds `cand_to_user`.

The inputs of `ikbo_ranker` without `cand_to_user`, each with a leading request dimension of 1
(`max_batch_size` > 0):

| input            | per request | config dims        |
|------------------|-------------|--------------------|
| user_dense       | [1, Fu]     | [Fu]               |
| user_sparse_ids  | [1, Su]     | [Su]               |
| user_history_ids | [1, L]      | [L]                |
| user_history_len | [1, 1]      | [1], reshape: []   |
| cand_dense       | [1, n, Fc]  | [-1, Fc], ragged   |
| cand_sparse_ids  | [1, n, Sc]  | [-1, Sc], ragged   |

Output `scores` [1, n, T]. n is free per request. `user_history_len` travels as [1, 1] (Triton
needs a dim after the request dimension) and reaches the model as [1] (reshape). Triton's dynamic
batcher coalesces concurrent requests (ragged batching on the NRO inputs: the python backend receives
them as separate requests in one `execute`). Each one becomes the batch contract at U = 1 (`unbatch`);
`coalesce` concatenates them into one IKBO batch — request i becomes user i, its candidates get
`cand_to_user` = i — cut to the declared ranges (`groups_within`). Clients go the other way:
`split_by_user` of a batch request, `merge_scores` of the answers. The served model is
stages.OnlineModel, its execute python_model.execute_online.
"""

from __future__ import annotations

import numpy as np
import torch

from .requests import CAND_INPUTS, INPUT_NAMES, USER_INPUTS, InvalidRequest

ONLINE_INPUT_NAMES = tuple(name for name in INPUT_NAMES if name != "cand_to_user")
ONLINE_CAND_INPUTS = tuple(name for name in CAND_INPUTS if name != "cand_to_user")  # NRO, ragged


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
