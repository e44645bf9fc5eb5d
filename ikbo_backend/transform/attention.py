"""Attention rewrites: candidate queries over replicated K/V → ikbo_attention (SDPA with a key-length
mask, or matmul-softmax-matmul), and the causal self-attention of the same K/V fused in
(ikbo_self_target_attention)."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F

from . import ops
from .values import SDPA, Meta, Plain, Rep, Report, _arg


class AttentionRewrites:
    """Methods of `rewrite.Rewriter` that handle attention."""

    def attention(self, args, kwargs, meta, name):
        """SDPA of candidate queries over replicated K/V → ikbo_attention. A key-length prefix mask written
        as arange(L) < lengths[m] gives kv_len directly; any other mask that is one key mask per user
        (boolean, or additive 0 / −inf, broadcast over heads and queries: checked on the example) has
        each user's kept keys moved to the front at U rows (`ops.compact_keys`)."""
        q, k, v = args[:3]
        mask = _arg(args, kwargs, 3, "attn_mask")
        dropout, causal = _arg(args, kwargs, 4, "dropout_p", 0.0), _arg(args, kwargs, 5, "is_causal", False)
        scale = _arg(args, kwargs, 6, "scale")
        if not (
            isinstance(k, Rep) and isinstance(v, Rep) and k.mapping is v.mapping and isinstance(q, Plain) and q.batched
        ):
            return None
        if dropout or causal or k.row_dim or v.row_dim:
            return None
        ndim = q.meta.ndim
        if not (ndim == k.meta.ndim == v.meta.ndim and ndim in (3, 4)):
            return None
        seq_len = k.meta.shape[-2]
        k_user, v_user, q_node, kv_len, keep, fill = k.user, v.user, q.node, None, None, None
        if _arg(args, kwargs, 7, "enable_gqa", False) and ndim == 4:  # K/V heads shared by query heads: at U rows
            if q.meta.shape[-3] % k.meta.shape[-3] or k.meta.shape[-3] != v.meta.shape[-3]:
                return None
            k_user, v_user = (self.emit("call_function", ops.kv_heads_for, (t, q_node)) for t in (k_user, v_user))
        if ndim == 3:  # [B, S, d]: one head
            q_node, k_user, v_user = (self.emit("call_method", "unsqueeze", (t, 1)) for t in (q_node, k_user, v_user))
        how = ""
        if mask is not None:
            lengths = self.prefix_lengths(mask, seq_len, k.mapping) if ndim == 4 else None
            if lengths is not None:
                kv_len = self.emit("call_function", ops.kv_len_from, (lengths, seq_len))
                how = " (key-length mask)"
            else:
                found = self.key_mask(self.constant_key_mask(mask, k, seq_len, ndim), k.mapping, seq_len, ndim)
                if found is None:
                    return None
                keep, fill = found
                how = " (per-user key mask, kept keys moved first at U rows)"
        node = self.emit_attention(q_node, k_user, v_user, k.mapping, scale, ndim, kv_len, keep, fill)
        if node is None:
            return None
        self.report.rewritten.append(
            f"{name}: attention of candidate queries over replicated K/V → ikbo_attention{how}"
        )
        return Plain(node, meta, True)

    def emit_attention(self, q, k, v, mapping, scale, ndim, kv_len=None, keep=None, fill=None, dtype=torch.float32,
                       softmax=False):  # fmt: skip
        """ikbo_attention of the query node `q` over the user rows `k`, `v` (4-D; 3-D originals are squeezed back).
        With `keep` (a bool node: the keys each user keeps) those keys are moved first at U rows, and a user
        with none gets what the original gives it (`fill`, `all_masked`). The node, or None where `all_masked`
        declines."""
        all_values, all_keys = v, k
        if keep is not None:
            packed = self.emit("call_function", ops.compact_keys, (k, v, keep))
            k, v, kv_len = (self.emit("call_function", operator.getitem, (packed, i)) for i in range(3))
            fill = self.all_masked(fill, q, all_keys, kv_len, scale, dtype, softmax=softmax)
            if fill is False:
                return None
        node = self.emit("call_function", ops.attention, (q, k, v, mapping.node, kv_len, scale))
        if fill is not None:  # users whose keys are all masked: what the original's softmax gives there
            node = self.emit("call_function", ops.empty_users, (node, all_values, kv_len, mapping.node, fill))
        if ndim == 3:
            node = self.emit("call_method", "squeeze", (node, 1))
        return node

    def constant_key_mask(self, mask, k, seq_len, ndim):
        """A mask without rows, the same for every candidate (`attn_mask=self.valid_pos` of [L], [1, 1, 1, L]): the
        one key mask of every user, as a Rep of it expanded to the users of `k` (U rows); other masks as they are."""
        if not (isinstance(mask, Plain) and not self.batched(mask) and isinstance(mask.meta, Meta)):
            return mask
        shape = mask.meta.shape
        if not 1 <= len(shape) <= ndim or shape[-1] != seq_len or any(d != 1 for d in shape[:-1]):
            return mask
        if len(shape) == ndim and self.num_users == 1:  # its one row may be the example's one user's
            return mask
        users = self.emit(
            "call_function", operator.getitem, (self.emit("call_function", getattr, (k.user, "shape")), 0)
        )
        row = self.emit("call_method", "reshape", (mask.node, (1,) * (ndim - 1) + (-1,)))
        node = self.emit("call_method", "expand", (row, users, *[-1] * (ndim - 1)))
        meta = Meta((self.num_candidates, *[1] * (ndim - 2), seq_len), mask.meta.dtype)
        return Rep(node, k.mapping, meta, f"{self.where()} (a key mask without rows)")

    def key_mask(self, mask, mapping, seq_len, ndim):
        """([U, L] bool node of the keys each user keeps, fill) if `mask` is one key mask per user, else None. fill:
        None for a boolean mask, else the additive mask's value for a dropped key (−inf, or a finite value ≤
        ops.MASKS_OUT), which each call checks is the only one besides 0 (`ops.check_mask_values`: a bias of other
        values is not a mask). Under CUDA graphs (no value checks) boolean masks only."""
        if not (isinstance(mask, Rep) and mask.mapping is mapping and not mask.row_dim and isinstance(mask.meta, Meta)):
            return None
        shape = mask.meta.shape
        if len(shape) != ndim or seq_len is not None and shape[-1] != seq_len or any(d != 1 for d in shape[1:-1]):
            return None
        value, fill = self.values[mask.user], None
        if value.dtype != torch.bool:
            if not value.is_floating_point() or not self.value_checks:
                return None
            dropped = value[value != 0].unique()
            if dropped.numel() != 1 or not float(dropped) <= ops.MASKS_OUT:
                return None  # an additive bias, or a mask whose value the example does not show
            fill = float(dropped)
            self.emit("call_function", ops.check_mask_values, (mask.user, fill))
        return self.emit("call_function", ops.key_mask, (mask.user,)), fill

    def all_masked(self, fill, q_node, k_user, kv_len, scale, add_dtype, softmax):
        """What the original gives a user whose keys are all masked by `fill`: None (zeros: SDPA's, for a boolean or
        −inf mask), "nan" (a softmax over −inf), "mean" (a finite fill that rounds the scores away, checked on each
        call: `ops.check_rounds_away`); False where that cannot be checked (under CUDA graphs)."""
        if fill is None or fill == float("-inf"):
            return "nan" if softmax and fill is not None else None
        if not self.value_checks:
            return False
        if scale is None:
            scale = 1.0 / math.sqrt(self.values[q_node].shape[-1])
        self.emit("call_function", ops.check_rounds_away, (q_node, k_user, kv_len, scale, fill, add_dtype))
        return "mean"

    def attention_chain(self, scores):
        """A Chain if `scores` starts matmul(q, kᵀ) [· c | / c] [key mask] → softmax(-1) → matmul(·, v) with
        single-use intermediates, q candidate rows [B, (H,) S, d], kᵀ replicated; else None. The mask and v are
        read when the chain's last node comes (`fuse_attention_chain`)."""

        def matmul(n):  # bmm is matmul of 3-D operands (DeepCTR's and DSIN's target attention spell it so)
            return (
                n.op == "call_function"
                and n.target in (torch.matmul, operator.matmul, torch.bmm)
                or n.op == "call_method"
                and n.target in ("matmul", "bmm")
            )

        if not (matmul(scores) and len(scores.args) == 2 and len(scores.users) == 1):
            return None
        q, k_t = (self.env.get(a) for a in scores.args)
        if not (isinstance(q, Plain) and q.batched and isinstance(q.meta, Meta) and q.meta.ndim in (3, 4)):
            return None
        if not (isinstance(k_t, Rep) and k_t.meta.ndim == q.meta.ndim and not k_t.row_dim):
            return None
        source, scale, inner = scores, 1.0, [scores]
        scaled = next(iter(scores.users))
        by_constant = scaled.op == "call_function" and scaled.target in (operator.mul, operator.truediv)
        factor = scaled.args[1] if by_constant and len(scaled.args) == 2 and scaled.args[0] is scores else None
        scalar = isinstance(factor, fx.Node) and type(factor.meta.get("example_value")) in (int, float)
        if isinstance(factor, (int, float)) or scalar:  # a number, or one traced (math.sqrt(k.size(-1)))
            scale = (factor, scaled.target is operator.truediv)  # scores · factor, or scores / factor
            source = scaled
            inner.append(scaled)
        mask = None
        probs = next(iter(source.users)) if len(source.users) == 1 else None
        if len(source.users) == 2:  # scores.masked_fill_(mask, c); softmax(scores)
            first, second = sorted(source.users, key=self.order.get)
            if first.op == "call_method" and first.target == "masked_fill_" and not first.users:
                mask, probs = first, second
        elif probs is not None and probs.target not in SOFTMAXES:
            mask = probs
            probs = next(iter(mask.users)) if len(mask.users) == 1 else None
        masked_from = source
        if mask is not None:
            if _mask_operand(mask, source) is None:
                return None
            inner.append(mask)
            source = mask if probs is not None and probs.args and probs.args[0] is mask else source
        if probs is None or probs.target not in SOFTMAXES or not probs.args or probs.args[0] is not source:
            return None
        dim = _arg(probs.args, probs.kwargs, 1, "dim")
        if not (dim in (-1, q.meta.ndim - 1) and not probs.kwargs.get("dtype") and len(probs.users) == 1):
            return None
        weights, between = probs, []  # dropout in eval between the softmax and the matmul (Hugging Face's) is x
        while len(weights.users) == 1 and _eval_dropout(nxt := next(iter(weights.users)), weights):
            weights = nxt
            between.append(nxt)
        if len(weights.users) != 1:
            return None
        out = next(iter(weights.users))
        if not (matmul(out) and len(out.args) == 2 and out.args[0] is weights):
            return None
        return Chain(scores, q, k_t, scale, mask, masked_from, probs, out, [*inner, probs, *between])

    def fuse_attention_chain(self, chain) -> bool:
        """The chain as ikbo_attention (3-D inputs get a head dim), a key mask before the softmax as kv lengths
        with each user's kept keys moved first at U rows; False where V or the mask is not one the kernel takes."""
        q, k_t = chain.q, chain.k_t
        v = self.env.get(chain.out.args[1])
        if not (isinstance(v, Rep) and v.mapping is k_t.mapping and v.meta.ndim == q.meta.ndim and not v.row_dim):
            return False
        if isinstance(chain.scale, tuple) and isinstance(chain.scale[0], fx.Node):
            form = self.env.get(chain.scale[0])
            if not (isinstance(form, Plain) and type(form.meta) in (int, float) and not form.batched):
                return False
        masking = None
        if chain.mask is not None:
            masking = self._chain_mask(chain.mask, chain.masked_from, q, k_t.mapping)
            if masking is None:
                return False
        scale = chain.scale
        if isinstance(scale, tuple):
            factor, divides = scale
            if isinstance(factor, fx.Node):
                node = self.env[factor].node
                scale = self.emit("call_function", operator.truediv, (1.0, node)) if divides else node
            else:
                scale = 1.0 / factor if divides else factor
        k = self.emit("call_method", "transpose", (k_t.user, -2, -1))
        q_node, v_node, keep, fill = q.node, v.user, None, None
        if q.meta.ndim == 3:
            q_node, k, v_node = (self.emit("call_method", "unsqueeze", (t, 1)) for t in (q_node, k, v_node))
        how = ""
        if masking is not None:
            keep, fill = masking
            if q.meta.ndim == 3:
                keep = self.emit("call_method", "unsqueeze", (keep, 1))
            keep = self.emit("call_function", ops.key_mask, (keep,))
            how = " (per-user key mask, kept keys moved first at U rows)"
        node = self.emit_attention(
            q_node, k, v_node, k_t.mapping, scale, q.meta.ndim, None, keep, fill, q.meta.dtype, softmax=True
        )
        if node is None:
            return False
        for n in chain.inner:
            self.env[n] = None  # computed inside the fused op; nothing else reads it
            self.pending.discard(n)
        self.env[chain.out] = Plain(node, self.meta[chain.out], True)
        self.report.rewritten.append(
            f"{self.where()}: matmul-softmax-matmul of candidate queries over replicated K/V → ikbo_attention{how}"
        )
        return True

    def _chain_mask(self, node, source, q, mapping):
        """(keep node [U, 1, (1,) L] bool, fill) for a key mask of the scores before the softmax, one per user:
        `masked_fill(mask, c)` (in place or not; c = −inf or ≤ ops.MASKS_OUT) or `+ mask` (additive float, as SDPA's); None
        otherwise. fill: the value a dropped key's score gets (`all_masked` says what that gives a user with none)."""
        kind, operand, value = _mask_operand(node, source)
        mask = self.env.get(operand) if isinstance(operand, fx.Node) else None
        if not (isinstance(mask, Rep) and mask.mapping is mapping and not mask.row_dim and isinstance(mask.meta, Meta)):
            return None
        shape, keys = mask.meta.shape, self.meta[source].shape[-1]
        if len(shape) != q.meta.ndim or any(d != 1 for d in shape[1:-1]) or shape[-1] != keys:
            return None  # not one entry per key: a value per user broadcast over all keys is no key mask
        if kind == "add":
            if mask.meta.dtype == torch.bool:
                return None  # a boolean added to the scores adds 1 where it is True: a bias, not a mask
            return self.key_mask(mask, mapping, keys, q.meta.ndim)
        if mask.meta.dtype != torch.bool or not isinstance(value, (int, float)) or not value <= ops.MASKS_OUT:
            return None
        return self.emit("call_function", torch.logical_not, (mask.user,)), float(value)

    def prefix_lengths(self, mask, seq_len, mapping):
        """The user-row lengths node if `mask` is arange(L) < lengths[m][:, None] broadcast over
        heads and queries ([B, 1, 1, L]); else None."""
        if not isinstance(mask, Rep) or mask.mapping is not mapping or mask.meta.ndim != 4:
            return None
        if mask.meta.shape[1:3] != (1, 1) or mask.meta.shape[3] != seq_len:
            return None
        user = mask.user
        while (
            user.op == "call_function"
            and user.target is operator.getitem
            or (user.op == "call_method" and user.target == "unsqueeze")
        ):
            if user.target is operator.getitem:
                index = user.args[1] if isinstance(user.args[1], tuple) else (user.args[1],)
                if not all(i is None or i == slice(None) for i in index):
                    return None
            user = user.args[0]
        if user.op != "call_function" or user.target not in (operator.lt, operator.gt, torch.lt, torch.gt):
            return None
        a, b = user.args
        positions, column = (a, b) if user.target in (operator.lt, torch.lt) else (b, a)
        if not (
            isinstance(positions, fx.Node) and positions.op == "call_function" and positions.target is torch.arange
        ):
            return None
        bounds = [x for x in positions.args]
        if bounds not in ([seq_len], [0, seq_len]) or positions.kwargs.get("dtype") not in (None, torch.int64):
            return None
        if not isinstance(column, fx.Node):
            return None
        indexed = (
            column.op == "call_function" and column.target is operator.getitem and column.args[1] == (slice(None), None)
        )
        unsqueezed = column.op == "call_method" and column.target == "unsqueeze" and column.args[1] in (1, -1)
        if not (indexed or unsqueezed):
            return None
        return column.args[0]


SOFTMAXES = (F.softmax, torch.softmax, "softmax")


def _eval_dropout(node, x):
    """Whether node is F.dropout(x, p, training=False) (an nn.Dropout in eval, as traced): x itself."""
    if not (node.op == "call_function" and node.target is F.dropout and node.args and node.args[0] is x):
        return False
    training = node.args[2] if len(node.args) > 2 else node.kwargs.get("training", True)
    inplace = node.args[3] if len(node.args) > 3 else node.kwargs.get("inplace", False)
    return training is False and inplace is False


@dataclass
class Chain:
    """matmul(q, kᵀ) [· scale] [key mask] → softmax → matmul(·, v), found at its first node."""

    scores: fx.Node
    q: Plain
    k_t: Rep
    scale: float
    mask: fx.Node | None  # masked_fill(_) or + of the scores
    masked_from: fx.Node  # the scores the mask applies to (scaled or not)
    probs: fx.Node
    out: fx.Node
    inner: list  # scores … probs


def _mask_operand(node, source):
    """("fill", mask node, value) for masked_fill(_)(source, mask, value), ("add", mask node, None) for source + mask
    or mask + source; None for anything else."""
    first = node.args[0] if node.args else None
    if first is not source and node.target not in (operator.add, torch.add):
        return None
    if (
        node.op == "call_method"
        and node.target in ("masked_fill", "masked_fill_")
        or (node.op == "call_function" and node.target is torch.masked_fill)
    ):
        if len(node.args) != 3 or node.kwargs:
            return None
        return "fill", node.args[1], node.args[2]
    if node.op == "call_function" and node.target in (operator.add, torch.add) and len(node.args) == 2:
        if node.kwargs:
            return None
        a, b = node.args
        if source not in (a, b) or a is b:
            return None
        return "add", b if a is source else a, None
    return None


# ----------------------------------------------------------------------------- self + target fusion

KEYS_INDEX = (slice(None), None, None, slice(None))  # [U, L] → [U, 1, 1, L]: a mask over keys
ROWS_INDEX = (slice(None), None, slice(None), None)  # [U, L] → [U, 1, L, 1]: a mask over query rows


def _match_prefix(node, seq_len):
    """(lengths, index) if node = (arange(L) < lengths[:, None])[index]; else None."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem):
        return None
    less, index = node.args
    if not (isinstance(less, fx.Node) and less.op == "call_function" and less.target in (operator.lt, torch.lt)):
        return None
    positions, column = less.args
    if not (
        isinstance(positions, fx.Node)
        and positions.target is torch.arange
        and list(positions.args) in ([seq_len], [0, seq_len])
    ):
        return None
    if not (
        isinstance(column, fx.Node) and column.target is operator.getitem and column.args[1] == (slice(None), None)
    ):
        return None
    return column.args[0], index


def _is_causal_mask(node, seq_len):
    """ones(L, L, dtype=bool).tril()"""
    if not (
        isinstance(node, fx.Node)
        and node.op == "call_method"
        and node.target == "tril"
        and len(node.args) == 1
        and not node.kwargs
    ):
        return False
    ones = node.args[0]
    if not (isinstance(ones, fx.Node) and ones.target is torch.ones):
        return False
    return list(ones.args) == [seq_len, seq_len] and ones.kwargs.get("dtype") is torch.bool


def _self_attention_form(sdpa, lengths, seq_len, scale):
    """causal flag if `sdpa` is self-attention over keys < lengths (causal or not) whose every reader
    zeroes the query rows ≥ lengths (then the fused op's zero rows change nothing); else None."""
    args, kwargs = sdpa.args, sdpa.kwargs
    if len(args) > 4 or set(kwargs) - {"attn_mask", "scale"} or kwargs.get("scale") != scale:
        return None
    mask = _arg(args, kwargs, 3, "attn_mask")
    causal = False
    if isinstance(mask, fx.Node) and mask.target is operator.and_:
        first, second = mask.args
        if _is_causal_mask(second, seq_len):
            mask, causal = first, True
        elif _is_causal_mask(first, seq_len):
            mask, causal = second, True
    if _match_prefix(mask, seq_len) != (lengths, KEYS_INDEX):
        return None
    for reader in sdpa.users:
        if not (
            reader.op == "call_method"
            and reader.target == "masked_fill"
            and reader.args[0] is sdpa
            and reader.args[2] in (0, 0.0)
        ):
            return None
        inverted = reader.args[1]
        if not (isinstance(inverted, fx.Node) and inverted.target is operator.invert):
            return None
        if _match_prefix(inverted.args[0], seq_len) != (lengths, ROWS_INDEX):
            return None
    return causal


def _downstream(node):
    seen, todo = set(), [node]
    while todo:
        for user in todo.pop().users:
            if user not in seen:
                seen.add(user)
                todo.append(user)
    return seen


def fuse_self_target_attention(graph: fx.Graph, report: Report) -> None:
    """SDPA self-attention at U rows + ikbo_attention over the same K/V → one
    ikbo_self_target_attention (K/V read once for both, as IkboRanker does)."""
    for target in [n for n in graph.nodes if n.op == "call_function" and n.target is ops.attention]:
        cand_q, k, v, mapping, kv_len, scale = target.args
        if not (isinstance(kv_len, fx.Node) and kv_len.target is ops.kv_len_from):
            continue
        lengths, seq_len = kv_len.args
        for sdpa in [
            u for u in k.users if u.op == "call_function" and u.target is SDPA and u.args[1] is k and u.args[2] is v
        ]:
            causal = _self_attention_form(sdpa, lengths, seq_len, scale)
            after = _downstream(sdpa)
            if causal is None or target in after:
                continue
            with graph.inserting_before(target):
                fused = graph.call_function(
                    ops.self_target_attention,
                    (sdpa.args[0], cand_q, k, v, mapping, kv_len),
                    {"causal": causal, "scale": scale},
                )
                user_out = graph.call_function(operator.getitem, (fused, 0))
                cand_out = graph.call_function(operator.getitem, (fused, 1))
            target.replace_all_uses_with(cand_out)
            sdpa.replace_all_uses_with(user_out)
            before = []
            for node in graph.nodes:
                if node is fused:
                    break
                if node in after:
                    before.append(node)
            anchor = cand_out
            for node in before:  # readers of the self-attention placed before the fused op move after it
                anchor.append(node)
                anchor = node
            graph.erase_node(target)
            graph.erase_node(sdpa)
            report.rewritten.append(
                f"self-attention at U rows and ikbo_attention over the same K/V → one ikbo_self_target_attention (causal={causal})"
            )
            break
