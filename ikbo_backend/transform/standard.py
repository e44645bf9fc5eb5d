"""Eval forms of standard modules: the same function as the module in eval mode, written with the
functional ops the pass rewrites (linear, scaled_dot_product_attention, masks as tensors).

`nn.MultiheadAttention` (and `F.multi_head_attention_forward` called directly in eval) becomes:
in-projections (one packed linear for self-attention), heads split with `unflatten`, the key padding
mask and the attention mask merged into one SDPA mask (boolean where both are boolean, additive
otherwise, as `F._canonical_mask` makes them), SDPA, out-projection; the averaged attention weights
are computed beside it only where the caller reads them. A query row with every key masked gives what the
module gives: NaN where it computes the weights (`need_weights`, the default) or takes torch's native fast path
(self-attention, batch-first, boolean masks, grad off or nothing requiring it: decided on each call,
`ops.fast_path_taken`), zeros (SDPA) otherwise. `nn.TransformerEncoderLayer` is traced through its own slow path,
its output rows NaN where its fast path would run and the query's keys are all masked (boolean, or −inf in a
float mask; the fast path also drops keys of other nonzero float values, which the slow path adds: not followed).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from . import ops


def _keep_or_bias(mask):
    """(boolean keep-mask or additive float mask) from a PyTorch mask (bool: True = masked out)."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return ~mask
    return mask


def _merge(a, b):
    if a is None:
        return b
    if b is None:
        return a
    if a.dtype == torch.bool and b.dtype == torch.bool:
        return a & b
    as_bias = [m if m.dtype != torch.bool else torch.zeros_like(m, dtype=torch.float).masked_fill(~m, -math.inf)
               for m in (a, b)]  # fmt: skip
    return as_bias[0] + as_bias[1]


def attention_forward(
    query, key, value, num_heads, in_proj_weight, in_proj_bias, bias_k, bias_v, add_zero_attn,
    out_proj_weight, out_proj_bias, key_padding_mask=None, need_weights=True, attn_mask=None,
    separate=None, average_attn_weights=True, batch_first=False, fast_path=None,
):  # fmt: skip
    """Eval-mode multi-head attention (`F.multi_head_attention_forward` without dropout); `fast_path`: the
    module's parameters where its native fast path may run (`_fast_path_static`)."""
    self_attention = query is key and key is value
    unbatched = query.dim() == 2
    if unbatched:  # [T, E]: one sequence
        query, key, value = (t.unsqueeze(0) for t in (query, key, value))
        key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
    elif not batch_first:
        query, key, value = (t.transpose(0, 1) for t in (query, key, value))
    # from here on batch-first: [N, T, E]
    embed = query.shape[-1]
    if separate is None:
        w_q, w_k, w_v = in_proj_weight.chunk(3)
    else:
        w_q, w_k, w_v = separate
    b_q, b_k, b_v = (None, None, None) if in_proj_bias is None else in_proj_bias.chunk(3)
    if separate is None and self_attention:
        q, k, v = F.linear(query, in_proj_weight, in_proj_bias).chunk(3, dim=-1)
    else:
        q, k, v = F.linear(query, w_q, b_q), F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)
    keep_keys = _keep_or_bias(key_padding_mask)
    if keep_keys is not None:
        keep_keys = keep_keys[:, None, None, :]  # [N, 1, 1, S]
    mask = _keep_or_bias(attn_mask)
    if mask is not None and mask.dim() == 3:  # [N·H, T, S]
        mask = mask.unflatten(0, (-1, num_heads))
    if bias_k is not None:
        k = torch.cat([k, bias_k.expand(k.shape[0], 1, embed)], dim=1)
        v = torch.cat([v, bias_v.expand(v.shape[0], 1, embed)], dim=1)
        mask = None if mask is None else F.pad(mask, (0, 1), value=True if mask.dtype == torch.bool else 0.0)
        keep_keys = None if keep_keys is None else F.pad(keep_keys, (0, 1), value=keep_keys.dtype == torch.bool)
    if add_zero_attn:
        k = torch.cat([k, torch.zeros_like(k[:, :1])], dim=1)
        v = torch.cat([v, torch.zeros_like(v[:, :1])], dim=1)
        mask = None if mask is None else F.pad(mask, (0, 1), value=True if mask.dtype == torch.bool else 0.0)
        keep_keys = None if keep_keys is None else F.pad(keep_keys, (0, 1), value=keep_keys.dtype == torch.bool)
    mask = _merge(mask, keep_keys)
    q, k, v = (t.unflatten(-1, (num_heads, -1)).transpose(1, 2) for t in (q, k, v))  # [N, H, T, d]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if (need_weights or fast_path is not None) and mask is not None:  # a row with every key masked gives NaN
        dead = ~mask.any(-1) if mask.dtype == torch.bool else mask.isneginf().all(-1)
        if not need_weights:  # only where the fast path runs
            dead = dead.logical_and(_fast_path(query, *fast_path))
        out = out.masked_fill(dead.unsqueeze(-1), math.nan)
    out = F.linear(out.transpose(1, 2).flatten(2), out_proj_weight, out_proj_bias)  # [N, T, E]
    weights = None
    if need_weights:
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        if mask is not None:
            scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask
        weights = torch.softmax(scores, dim=-1)
        if average_attn_weights:
            weights = weights.mean(dim=1)
        if unbatched:
            weights = weights.squeeze(0)
    if unbatched:
        return out.squeeze(0), weights
    return (out if batch_first else out.transpose(0, 1)), weights


def multihead_attention(
    module: nn.MultiheadAttention, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
    average_attn_weights=True, is_causal=False,
):  # fmt: skip
    """`nn.MultiheadAttention.forward` in eval mode (`is_causal` is a hint about `attn_mask`, which is used)."""
    if module.training and module.dropout > 0:
        raise ValueError("nn.MultiheadAttention in training mode (dropout): put the model in eval mode")
    separate = None
    if not module._qkv_same_embed_dim:
        separate = (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight)
    fast_path = None
    if _fast_path_static(module, query, key_padding_mask, attn_mask) and _same(query, key) and _same(key, value):
        fast_path = (module.in_proj_weight, module.in_proj_bias, module.out_proj.weight, module.out_proj.bias)
    return attention_forward(
        query, key, value, module.num_heads, module.in_proj_weight, module.in_proj_bias, module.bias_k,
        module.bias_v, module.add_zero_attn, module.out_proj.weight, module.out_proj.bias, key_padding_mask,
        need_weights, attn_mask, separate, average_attn_weights, module.batch_first, fast_path,
    )  # fmt: skip


def _fast_path_static(attention: nn.MultiheadAttention, x, *masks) -> bool:
    """The conditions of torch's native attention fast path that do not change between calls (eval, batched
    input, batch-first, packed projections with biases, an even number of heads, no bias_k / zero attention; for
    `nn.MultiheadAttention` boolean masks, given as `masks`); grad mode and autocast are read on each call
    (`ops.fast_path_taken`)."""
    return (
        not attention.training
        and x.dim() == 3
        and attention.batch_first
        and attention.in_proj_weight is not None
        and attention.in_proj_bias is not None
        and x.dtype == attention.in_proj_weight.dtype == attention.in_proj_bias.dtype
        and attention.num_heads % 2 == 0
        and attention.bias_k is None
        and attention.bias_v is None
        and not attention.add_zero_attn
        and attention._qkv_same_embed_dim
        and all(m is None or m.dtype == torch.bool for m in masks)
    )


def _traced_call(fn, like, *args, **kwargs):
    """fn(*args) as one node of the graph that `like` (a proxy) is traced into, else called at once."""
    tracer = getattr(like, "tracer", None)
    return fn(*args, **kwargs) if tracer is None else tracer.create_proxy("call_function", fn, args, kwargs)


CALLER_GRAD: list = []  # the grad mode the capture was started in (capture.py): a forward that changes it is seen


def _fast_path(like, *tensors):
    """ops.fast_path_taken(like, *tensors) as a node; the grad mode fixed where the forward set its own."""
    grad = torch.is_grad_enabled()
    inner = CALLER_GRAD and CALLER_GRAD[-1] != grad
    return _traced_call(ops.fast_path_taken, like, like, *tensors, **({"grad": grad} if inner else {}))


def _same(a, b) -> bool:
    """a is b, also for proxies whose example values are one tensor (a dropout in eval, `.float()` of a float)."""
    return a is b or getattr(a, "value", a) is getattr(b, "value", b)


def transformer_encoder_layer(module: nn.TransformerEncoderLayer, src, src_mask=None, src_key_padding_mask=None,
                              is_causal=False):  # fmt: skip
    """`nn.TransformerEncoderLayer.forward` traced through its slow path, with the rows its native fast path gives
    NaN (a query whose keys are all masked) made NaN where that path would run at the call."""
    out = type(module).forward(module, src, src_mask, src_key_padding_mask, is_causal)
    attention = module.self_attn
    fast = (
        _fast_path_static(attention, src)
        and module.activation_relu_or_gelu
        and module.norm1.eps == module.norm2.eps
        and (src_mask is not None or src_key_padding_mask is not None)
    )
    if not fast:
        return out
    kept = lambda m: ~m if m.dtype == torch.bool else ~m.isneginf()  # noqa: E731  (float: the −inf entries)
    keep = None if src_mask is None else kept(src_mask)  # [T, S]
    if src_key_padding_mask is not None:
        keys = kept(src_key_padding_mask)[:, None, :]  # [N, 1, S]
        keep = keys if keep is None else keep & keys
    dead = ~keep.any(-1)  # [T] or [N, T]
    params = [attention.in_proj_weight, attention.in_proj_bias, attention.out_proj.weight, attention.out_proj.bias]
    params += [p for m in (module.norm1, module.norm2, module.linear1, module.linear2) for p in (m.weight, m.bias)]
    dead = dead.logical_and(_fast_path(src, *params))
    return out.masked_fill(dead.unsqueeze(-1), math.nan)


def multi_head_attention_forward(
    query, key, value, embed_dim_to_check, num_heads, in_proj_weight, in_proj_bias, bias_k, bias_v, add_zero_attn,
    dropout_p, out_proj_weight, out_proj_bias, training=True, key_padding_mask=None, need_weights=True,
    attn_mask=None, use_separate_proj_weight=False, q_proj_weight=None, k_proj_weight=None, v_proj_weight=None,
    static_k=None, static_v=None, average_attn_weights=True, is_causal=False,
):  # fmt: skip
    """`F.multi_head_attention_forward` called directly, in eval (no dropout, no static K/V)."""
    if (training and dropout_p > 0) or static_k is not None or static_v is not None:
        raise ValueError("F.multi_head_attention_forward with dropout or static K/V has no eval form")
    separate = (q_proj_weight, k_proj_weight, v_proj_weight) if use_separate_proj_weight else None
    return attention_forward(
        query, key, value, num_heads, in_proj_weight, in_proj_bias, bias_k, bias_v, add_zero_attn,
        out_proj_weight, out_proj_bias, key_padding_mask, need_weights, attn_mask, separate, average_attn_weights,
    )  # fmt: skip


def cosine_similarity(x1, x2, dim=1, eps=1e-8):
    """`F.cosine_similarity` as ATen computes it (each side divided by its norm clamped to eps, then a product
    summed): the norms of a replicated side run at its U rows and the product is a join."""
    norms = (torch.linalg.vector_norm(x, dim=dim, keepdim=True).clamp_min(eps) for x in (x1, x2))
    return ((x1 / next(norms)) * (x2 / next(norms))).sum(dim)


def pairwise_distance(x1, x2, p=2.0, eps=1e-6, keepdim=False):
    """`F.pairwise_distance` as ATen computes it: the p-norm of `x1 - x2 + eps` over the last dim."""
    return torch.linalg.vector_norm(x1 - x2 + eps, p, dim=-1, keepdim=keepdim)


def bilinear(input1, input2, weight, bias=None):
    """`F.bilinear` / `nn.Bilinear` (y_o = x1ᵀ·W_o·x2 + b_o) as ATen computes it: x1 contracted with W first (one GEMM
    by the weight laid out [in1, out · in2]), then a batched product with x2, so a replicated x1 runs at its U rows
    and the product with candidate x2 is a batched-matmul join (FiBiNET's bilinear field pairs, a user × candidate
    bilinear score); x2 replicated joins at the second product."""
    out_features, in1, in2 = weight.shape
    t = torch.matmul(input1, weight.transpose(0, 1).reshape(in1, out_features * in2))
    y = torch.matmul(t.unflatten(-1, (out_features, in2)), input2.unsqueeze(-1)).squeeze(-1)
    return y if bias is None else y + bias


CDIST_MM_ROWS = 25  # torch.cdist's default mode uses the matrix-product form past this many rows on either side


def cdist(x1, x2, p=2.0, compute_mode="use_mm_for_euclid_dist_if_necessary"):
    """Batched `torch.cdist` ([..., P, M] × [..., R, M] → [..., P, R]) in the form ATen takes for these sizes: for
    p = 2 past 25 rows (or compute_mode="use_mm_for_euclid_dist") ‖x1‖² − 2·x1·x2ᵀ + ‖x2‖², clamped at 0, square
    root (a batched-matmul join and row norms); else, where one side has one row, the norm of the differences.
    Other calls (2-D inputs, whose rows are the batch; P, R > 1 below the threshold, whose differences would be
    [..., P, R, M]) run as written (`NotImplemented`)."""
    if x1.dim() < 3 or x2.dim() < 3:
        return NotImplemented
    rows = max(x1.shape[-2], x2.shape[-2])
    mm = compute_mode == "use_mm_for_euclid_dist" or (
        compute_mode == "use_mm_for_euclid_dist_if_necessary" and rows > CDIST_MM_ROWS
    )
    if p == 2 and mm:
        n1, n2 = (x.pow(2).sum(-1, keepdim=True) for x in (x1, x2))
        return (n1 - 2 * torch.matmul(x1, x2.transpose(-1, -2)) + n2.transpose(-1, -2)).clamp_min(0).sqrt()
    if x1.shape[-2] != 1 and x2.shape[-2] != 1:
        return NotImplemented
    diff = (x1.unsqueeze(-2) - x2.unsqueeze(-3)).abs()
    if p == 0:
        return (diff != 0).to(x1.dtype).sum(-1)
    if p == math.inf:
        return diff.amax(-1)
    if p == 1:
        return diff.sum(-1)
    if p == 2:
        return diff.pow(2).sum(-1).sqrt()
    return diff.pow(p).sum(-1).pow(1 / p)


MODULE_FORMS = {nn.MultiheadAttention: multihead_attention, nn.TransformerEncoderLayer: transformer_encoder_layer}
FUNCTION_FORMS = {
    F.multi_head_attention_forward: multi_head_attention_forward,
    torch.cosine_similarity: cosine_similarity,  # F.cosine_similarity is the same function
    torch.pairwise_distance: pairwise_distance,
    torch.cdist: cdist,
    torch.bilinear: bilinear,  # F.bilinear is the same function
}
