"""Readable fp64 references of the IKBO ops, one candidate at a time, on the CPU, and the relative error
that compares an op against them (tests, benchmarks, the tuner's candidate checks).

They index user tensors per candidate (the obvious way), which is exactly what the IKBO paths avoid.
"""

from __future__ import annotations

import math

import torch


def linear_compress_reference(user_emb, cand_emb, cand_to_user, weight, bias=None):
    """out[b] = weight @ cat(user_emb[m[b]], cand_emb[b]) (+ bias[:, None]), fp64 → [B, N, D]."""
    w = weight.double().cpu()
    rows = []
    for b, u in enumerate(cand_to_user.tolist()):
        tokens = torch.cat([user_emb[u].double().cpu(), cand_emb[b].double().cpu()], dim=0)  # [Ku+Kc, D]
        row = w @ tokens
        rows.append(row if bias is None else row + bias.double().cpu()[:, None])
    return torch.stack(rows) if rows else torch.zeros(0, weight.shape[0], user_emb.shape[2], dtype=torch.float64)


def _softmax_attend(q, k, v, valid):
    """q [S, d], k/v [L, d], valid [S, L] bool → [S, d]; rows with no valid key give zeros."""
    scores = (q @ k.T).masked_fill(~valid, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return weights @ v


def attention_reference(q, k, v, cand_to_user, kv_len=None, scale=None):
    """Target attention, fp64, one candidate and head at a time → [B, H, S, d]."""
    q, k, v = (t.double().cpu() for t in (q, k, v))
    seq_len, head_dim = k.shape[2], k.shape[3]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    lengths = [seq_len] * k.shape[0] if kv_len is None else kv_len.tolist()
    out = torch.zeros_like(q)
    for b, u in enumerate(cand_to_user.tolist()):
        valid = (torch.arange(seq_len) < lengths[u]).expand(q.shape[2], seq_len)
        for h in range(q.shape[1]):
            out[b, h] = _softmax_attend(q[b, h] * scale, k[u, h], v[u, h], valid)
    return out


def self_attention_reference(user_q, k, v, kv_len=None, causal=True, scale=None):
    """Self-attention of each user's sequence, fp64; query rows ≥ kv_len are zeros → [U, H, L, d]."""
    user_q, k, v = (t.double().cpu() for t in (user_q, k, v))
    seq_len, head_dim = k.shape[2], k.shape[3]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    lengths = [seq_len] * k.shape[0] if kv_len is None else kv_len.tolist()
    out = torch.zeros_like(user_q)
    for u, length in enumerate(lengths):
        keys = torch.arange(seq_len)
        valid = (keys < length).expand(seq_len, seq_len)
        if causal:
            valid = valid & (keys[None, :] <= keys[:, None])
        valid = valid & (keys < length)[:, None]
        for h in range(user_q.shape[1]):
            out[u, h] = _softmax_attend(user_q[u, h] * scale, k[u, h], v[u, h], valid)
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor, ord: float = 2) -> float:
    """‖out − ref‖ / ‖ref‖ in fp64 over all elements (`ord` 2: Frobenius; `math.inf`: the largest absolute
    error over the largest magnitude); NaN when out holds a NaN (so it never passes a ≤ check)."""
    ref = ref.detach().double()
    diff = out.detach().double().to(ref.device) - ref
    return float(torch.linalg.vector_norm(diff, ord) / torch.linalg.vector_norm(ref, ord).clamp_min(1e-300))
