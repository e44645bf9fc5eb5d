"""IKBO attention: candidate queries attend to their user's sequence, K/V never replicated.

Target attention, per candidate b with user u = m[b]:
    out[b] = softmax(scale · q[b] · k[u]ᵀ, keys j < kv_len[u]) · v[u]
q [B, H, S, d] candidate query tokens, k/v [U, H, L, d] user sequences, kv_len [U] valid lengths
(None = L), scale default 1/√d → out [B, H, S, d]. A user with kv_len 0 gives zeros.

Self + target attention shares k/v: each user's sequence attends to itself (causal by default,
keys < kv_len, query rows ≥ kv_len are zeros) and the candidates attend as above.

The torch path groups candidates by user once per batch and runs one attention per user whose
query block holds all S tokens of all that user's candidates, so each user's K/V is read once.
Source: "In-Kernel Broadcast Optimization" (Meta, 2025), target attention.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._common import check_kv_len, check_mapping, check_same, check_tensor, group_by_user, resolve_backend

FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _check_kv(k, v):
    check_tensor("k", k, 4, FLOAT_TYPES)
    check_tensor("v", v, 4, FLOAT_TYPES)
    check_same("v", list(v.shape), "k's shape [U, H, L, d]", list(k.shape))
    if v.dtype != k.dtype or v.device != k.device:
        raise ValueError(f"v: expected {k.dtype} on {k.device} like k, got {v.dtype} on {v.device}")


def _check_queries(name, q, k, expected_rows_name=None, expected_rows=None):
    check_tensor(name, q, 4, FLOAT_TYPES)
    check_same(name, q.shape[1], "H (dim 1 of k)", k.shape[1])
    check_same(name, q.shape[3], "d (dim 3 of k)", k.shape[3])
    if expected_rows is not None:
        check_same(name, q.shape[2], expected_rows_name, expected_rows)
    if q.dtype != k.dtype or q.device != k.device:
        raise ValueError(f"{name}: expected {k.dtype} on {k.device} like k, got {q.dtype} on {q.device}")


def _key_mask(kv_len, seq_len):
    """[U, 1, 1, L] bool: key j of user u is valid when j < kv_len[u]."""
    return (torch.arange(seq_len, device=kv_len.device) < kv_len[:, None])[:, None, None, :]


def _target_attention_torch(q, k, v, cand_to_user, kv_len, scale):
    num_candidates, heads, num_queries, head_dim = q.shape
    num_users, _, seq_len, _ = k.shape
    out = torch.zeros_like(q)
    if num_candidates == 0:
        return out
    order, counts, _ = group_by_user(cand_to_user, num_users)
    key_mask = _key_mask(kv_len, seq_len)
    start = 0
    for user, count in enumerate(counts.tolist()):
        if count == 0:
            continue
        rows = order[start : start + count]
        start += count
        if int(kv_len[user]) == 0:
            continue
        # all S query tokens of all this user's candidates in one query block: [1, H, count·S, d]
        block = q[rows].permute(1, 0, 2, 3).reshape(1, heads, count * num_queries, head_dim)
        attended = F.scaled_dot_product_attention(block, k[user : user + 1], v[user : user + 1], attn_mask=key_mask[user : user + 1], scale=scale)
        out[rows] = attended.reshape(heads, count, num_queries, head_dim).permute(1, 0, 2, 3)
    return out


def _self_attention_torch(user_q, k, v, kv_len, causal, scale):
    seq_len = k.shape[2]
    mask = _key_mask(kv_len, seq_len)
    if causal:
        mask = mask & torch.ones(seq_len, seq_len, dtype=torch.bool, device=k.device).tril()
    out = F.scaled_dot_product_attention(user_q, k, v, attn_mask=mask, scale=scale)
    valid_rows = torch.arange(seq_len, device=k.device) < kv_len[:, None]  # [U, L]
    return out.masked_fill(~valid_rows[:, None, :, None], 0.0)


def ikbo_attention(q, k, v, cand_to_user, kv_len=None, scale=None, backend: str = "auto") -> torch.Tensor:
    """Target attention of candidate queries over their user's K/V → [B, H, S, d] (see module doc)."""
    _check_kv(k, v)
    _check_queries("q", q, k)
    check_mapping(cand_to_user, q.shape[0], k.shape[0], k.device)
    kv_len = check_kv_len(kv_len, k.shape[0], k.shape[2], k.device)
    resolve_backend(backend, k.device, triton_available=False)
    scale = 1.0 / math.sqrt(k.shape[3]) if scale is None else float(scale)
    return _target_attention_torch(q, k, v, cand_to_user, kv_len, scale)


def ikbo_self_target_attention(user_q, cand_q, k, v, cand_to_user, kv_len=None, causal=True, scale=None, backend: str = "auto"):
    """(user_out [U, H, L, d], cand_out [B, H, S, d]): self-attention of each user's sequence and
    target attention of its candidates, both over the same k/v [U, H, L, d] (see module doc)."""
    _check_kv(k, v)
    _check_queries("user_q", user_q, k, "L (dim 2 of k)", k.shape[2])
    check_same("user_q", user_q.shape[0], "U (rows of k)", k.shape[0])
    _check_queries("cand_q", cand_q, k)
    check_mapping(cand_to_user, cand_q.shape[0], k.shape[0], k.device)
    kv_len = check_kv_len(kv_len, k.shape[0], k.shape[2], k.device)
    resolve_backend(backend, k.device, triton_available=False)
    scale = 1.0 / math.sqrt(k.shape[3]) if scale is None else float(scale)
    user_out = _self_attention_torch(user_q, k, v, kv_len, causal, scale)
    cand_out = _target_attention_torch(cand_q, k, v, cand_to_user, kv_len, scale)
    return user_out, cand_out
