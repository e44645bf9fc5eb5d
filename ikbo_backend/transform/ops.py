"""Runtime pieces the rewritten graphs call: joins of user rows (U) with candidate rows (B) through
the mapping `cand_to_user` [B], none of which copies a user tensor to B rows, plus the one explicit
replication (`index_rows`) that the pass emits where it has no join for a consumer (and reports).

`GroupedOp` is the general join: any elementwise op between candidate tensors and user tensors runs
once per user on that user's candidates, the user row broadcast (a stride-0 view, never copied),
the way the torch path of `kernels.ikbo_attention` groups candidates. `grouped_matmul` does the same
for batched matmuls, packing a user's candidates into one GEMM against the user's matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_map

from kernels import PackedLinearCompress, add_user_rows, group_by_user


def index_rows(user: torch.Tensor, cand_to_user: torch.Tensor) -> torch.Tensor:
    """user[cand_to_user]: the materialized replication [B, ...] (what the pass could not avoid)."""
    return user.index_select(0, cand_to_user)


def index_rows_tuple(users, cand_to_user):
    return tuple(index_rows(u, cand_to_user) for u in users)


def mapping_rows(cand_to_user: torch.Tensor) -> int:
    """B, the number of candidates."""
    return cand_to_user.shape[0]


def rep_shape(user_shape, cand_to_user: torch.Tensor) -> torch.Size:
    """Shape of user[cand_to_user] from the user tensor's shape."""
    return torch.Size((cand_to_user.shape[0], *user_shape[1:]))


def repeat_mapping(user: torch.Tensor, repeats) -> torch.Tensor:
    """The mapping of user.repeat_interleave(repeats, dim=0): row b comes from user row out[b]."""
    return torch.repeat_interleave(torch.arange(user.shape[0], device=user.device), repeats)


def expand_mapping(rows: int, user: torch.Tensor) -> torch.Tensor:
    """The mapping of user.expand(rows, ...) for a single user: all zeros."""
    return torch.zeros(rows, dtype=torch.int64, device=user.device)


def kv_len_from(lengths: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Key lengths of a prefix mask `arange(L) < lengths[:, None]`, as the IKBO attention takes them."""
    if lengths.is_floating_point():
        lengths = torch.ceil(lengths)  # j < 2.5 keeps keys 0, 1, 2
    return lengths.clamp(0, seq_len).long()


def add_user_rows_broadcast(cand, user, cand_to_user, cand_sign: float = 1.0, user_sign: float = 1.0) -> torch.Tensor:
    """cand_sign·cand[b] + user_sign·user[m[b]] with broadcasting over the trailing dims (`add_user_rows`)."""
    trailing = torch.broadcast_shapes(cand.shape[1:], user.shape[1:])
    dtype = torch.result_type(cand, user)
    cand = cand.to(dtype).expand(cand.shape[0], *trailing)
    user = user.to(dtype).expand(user.shape[0], *trailing)
    if cand_sign != 1.0:
        cand = -cand
    if user_sign != 1.0:
        user = -user
    return add_user_rows(cand, user, cand_to_user)


def _groups(cand_to_user: torch.Tensor, num_users: int):
    """(user, candidate rows) for every user with candidates."""
    order, counts, _ = group_by_user(cand_to_user, num_users)
    start = 0
    for user, count in enumerate(counts.tolist()):
        if count:
            yield user, order[start : start + count]
            start += count


def grouped_matmul(cand: torch.Tensor, user: torch.Tensor, cand_to_user: torch.Tensor, cand_left: bool) -> torch.Tensor:
    """matmul(cand[b], user[m[b]]) (cand_left) or matmul(user[m[b]], cand[b]) for every b.

    cand [B, *batch, M, K] and user [U, *batch, K, N] (or the transposes): per user, its candidates
    are packed into the M dimension of one GEMM against the user's matrix.
    """
    if not cand_left:  # (u @ c) = (cᵀ @ uᵀ)ᵀ
        return grouped_matmul(cand.transpose(-1, -2), user.transpose(-1, -2), cand_to_user, True).transpose(-1, -2)
    out_shape = (cand.shape[0], *cand.shape[1:-1], user.shape[-1])
    out = cand.new_empty(out_shape, dtype=torch.result_type(cand, user))
    for u, rows in _groups(cand_to_user, user.shape[0]):
        block = cand[rows].movedim(0, -3)  # [*batch, n, M, K]
        n, rows_m = block.shape[-3], block.shape[-2]
        packed = block.reshape(*block.shape[:-3], n * rows_m, block.shape[-1])  # [*batch, n·M, K]
        result = torch.matmul(packed, user[u])  # [*batch, n·M, N]
        out[rows] = result.reshape(*result.shape[:-2], n, rows_m, result.shape[-1]).movedim(-3, 0)
    return out


@dataclass(frozen=True)
class Slot:
    """A tensor argument of a `GroupedOp`: the `index`-th tensor passed to forward, in `role`."""

    role: str  # "cand" (B rows), "user" (U rows) or "plain" (no candidate rows)
    index: int


class GroupedOp(nn.Module):
    """An elementwise op over candidate tensors and user tensors, run per user.

    `args` / `kwargs` are the op's arguments with every tensor replaced by a `Slot`. Candidate
    tensors are sliced to the user's candidates, user tensors to the user's row [1, ...] (broadcast
    by the op, not copied).
    """

    def __init__(self, fn, args, kwargs, description: str):
        super().__init__()
        self.fn, self.args, self.kwargs, self.description = fn, args, kwargs, description

    def extra_repr(self) -> str:
        return self.description

    def _call(self, tensors, pick):
        fill = lambda x: pick(x.role, tensors[x.index]) if isinstance(x, Slot) else x  # noqa: E731
        is_slot = lambda x: isinstance(x, Slot)  # noqa: E731
        return self.fn(*tree_map(fill, self.args, is_leaf=is_slot), **tree_map(fill, self.kwargs, is_leaf=is_slot))

    def forward(self, cand_to_user, num_users: int, *tensors):
        if cand_to_user.shape[0] == 0 or num_users == 0:
            return self._call(tensors, lambda role, t: t[:0] if role == "user" else t)
        out = None
        for user, rows in _groups(cand_to_user, num_users):
            result = self._call(
                tensors, lambda role, t: t[rows] if role == "cand" else t[user : user + 1] if role == "user" else t
            )
            if out is None:
                out = torch.empty((cand_to_user.shape[0], *result.shape[1:]), dtype=result.dtype, device=result.device)
            out[rows] = result
        return out


class LinearCompress(nn.Module):
    """matmul(W, cat([user[m], cand], dim=1)) with W packed once: `kernels.PackedLinearCompress`."""

    def __init__(self, weight: torch.Tensor, num_user_tokens: int):
        super().__init__()
        self.packed = PackedLinearCompress.from_weight(weight, num_user_tokens)

    def forward(self, user, cand, cand_to_user):
        return self.packed(user, cand, cand_to_user)
