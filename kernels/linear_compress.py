"""IKBO linear compression (LCE).

Math, per candidate b with user u = m[b]:
    out[b] = W @ cat(user_emb[u], cand_emb[b]) (+ bias[:, None])
           = W_u @ user_emb[u] + W_c @ cand_emb[b] (+ bias[:, None])          (Type I decomposition)
Shapes: user_emb [U, Ku, D], cand_emb [B, Kc, D], cand_to_user [B], W [N, Ku + Kc] (user columns
first), bias [N] → out [B, N, D].

The user GEMM runs at U rows and the candidate GEMM at B rows; the [U, N, D] user result joins the
candidate result through the mapping (see `_common.add_user_rows`), never replicated.
Source: "In-Kernel Broadcast Optimization" (Meta, 2025), linear compression embedding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._common import add_user_rows, check_mapping, check_same, check_tensor, resolve_backend

FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True)
class PackedLinearCompress:
    """Weights of one LCE layer, split into user and candidate columns once, at load time.

    user_weight [N, Ku], cand_weight [N, Kc], bias [N] or None.
    """

    user_weight: torch.Tensor
    cand_weight: torch.Tensor
    bias: torch.Tensor | None

    @classmethod
    def from_weight(cls, weight: torch.Tensor, num_user_tokens: int, bias: torch.Tensor | None = None):
        check_tensor("weight", weight, 2, FLOAT_TYPES)
        if not 0 <= num_user_tokens <= weight.shape[1]:
            raise ValueError(f"num_user_tokens: expected in [0, {weight.shape[1]}], got {num_user_tokens}")
        if bias is not None:
            check_tensor("bias", bias, 1, FLOAT_TYPES)
            check_same("bias", bias.shape[0], "N (rows of weight)", weight.shape[0])
        return cls(
            weight[:, :num_user_tokens].contiguous(),
            weight[:, num_user_tokens:].contiguous(),
            None if bias is None else bias.contiguous(),
        )

    def __call__(self, user_emb, cand_emb, cand_to_user, backend: str = "auto") -> torch.Tensor:
        check_tensor("user_emb", user_emb, 3, FLOAT_TYPES)
        check_tensor("cand_emb", cand_emb, 3, FLOAT_TYPES)
        num_users, num_user_tokens, dim = user_emb.shape
        num_candidates, num_cand_tokens, cand_dim = cand_emb.shape
        check_same("cand_emb", cand_dim, "D (last dim of user_emb)", dim)
        check_same("user_emb", num_user_tokens, "Ku (user columns of weight)", self.user_weight.shape[1])
        check_same("cand_emb", num_cand_tokens, "Kc (candidate columns of weight)", self.cand_weight.shape[1])
        for name, t in (("cand_emb", cand_emb), ("weight", self.user_weight), ("bias", self.bias)):
            if t is not None and (t.dtype != user_emb.dtype or t.device != user_emb.device):
                raise ValueError(f"{name}: expected {user_emb.dtype} on {user_emb.device} like user_emb, got {t.dtype} on {t.device}")
        check_mapping(cand_to_user, num_candidates, num_users, user_emb.device)
        resolve_backend(backend, user_emb.device, triton_available=False)
        return _linear_compress_torch(user_emb, cand_emb, cand_to_user, self.user_weight, self.cand_weight, self.bias)


def _linear_compress_torch(user_emb, cand_emb, cand_to_user, user_weight, cand_weight, bias):
    """Type I torch path: two GEMMs at natural batch sizes, combined through the mapping."""
    user_part = torch.matmul(user_weight, user_emb)  # [U, N, D]
    cand_part = torch.matmul(cand_weight, cand_emb)  # [B, N, D]
    if bias is not None:
        cand_part = cand_part + bias[:, None]
    return add_user_rows(cand_part, user_part, cand_to_user)


def ikbo_linear_compress(user_emb, cand_emb, cand_to_user, weight, bias=None, backend: str = "auto") -> torch.Tensor:
    """out[b] = weight @ cat(user_emb[m[b]], cand_emb[b]) (+ bias[:, None]) → [B, N, D].

    user_emb [U, Ku, D], cand_emb [B, Kc, D], cand_to_user [B] in [0, U), weight [N, Ku + Kc] (user
    columns first), bias [N] or None. Splits `weight` on every call; servers hold a
    `PackedLinearCompress` instead.
    """
    check_tensor("user_emb", user_emb, 3, FLOAT_TYPES)
    check_tensor("cand_emb", cand_emb, 3, FLOAT_TYPES)
    check_tensor("weight", weight, 2, FLOAT_TYPES)
    check_same("weight", weight.shape[1], "Ku + Kc (user + candidate tokens)", user_emb.shape[1] + cand_emb.shape[1])
    packed = PackedLinearCompress.from_weight(weight, user_emb.shape[1], bias)
    return packed(user_emb, cand_emb, cand_to_user, backend=backend)
