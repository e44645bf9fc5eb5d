"""The demo ranking model, in two variants that compute the same function from the same weights.

Per request: U users (request-only, "RO" features) and B candidates ("NRO" features), and
`cand_to_user` [B] in [0, U).

Feature stage (both variants, natural batch sizes):
    user_tokens    [U, Ku, D] = cat(user sparse embeddings [U, Su, D], user dense → Kdu tokens)
    cand_tokens    [B, Kc, D] = cat(cand sparse embeddings [B, Sc, D], cand dense → Kdc tokens)
    history_tokens [U, L, D]  = item embedding of user_history_ids + position embedding
Interaction stage:
    compressed [B, N, D]   = W_lce @ cat(user_tokens[u], cand_tokens[b]) + b_lce         (LCE)
    q, k, v    [U, H, L, d] = history_tokens @ W_qkv                                     (user side)
    cand_q     [B, H, S, d] = compressed[:, :S] @ W_cq                                   (S ≤ N)
    user_seq   [U, H, L, d] = causal self-attention of the history, keys < history_len
    cand_seq   [B, H, S, d] = target attention of cand_q over the user's k, v
    user_repr  [U, D]       = mean of user_seq over valid positions
    cand_repr  [B, N·D + D] = cat(compressed flattened, mean of cand_seq over S)
    scores     [B, T]       = sigmoid(MLP(cat(user_repr[u], cand_repr[b])))

`IkboRanker` does user-side work at U rows and joins through the mapping (IKBO ops, Type I split
of the first MLP layer); `BaselineRanker` replicates the user tensors to B rows first, the way
ranking models are usually served, then runs standard ops. Both, and the feature stage, take
`batch_invariant`: every linear in 64-row GEMM calls and the sigmoid without scalar tails, so a
candidate's scores are bit-identical in any batch (ikbo_backend/batch_invariant.py; CPU).
The served (feature stage, interaction) pairs, the transformed baseline among them, come from
`variants.build_ranker`.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from kernels import PackedLinearCompress, add_user_rows, ikbo_linear_compress, ikbo_self_target_attention

from .batch_invariant import rowwise_linear, vectorized_elementwise


@dataclass(frozen=True)
class RankerConfig:
    """Every dimension of the model. Defaults are the demo dims (README: "Demo model")."""

    user_dense_features: int = 32  # Fu
    user_sparse_features: int = 8  # Su
    user_vocab_size: int = 10_000  # rows per user sparse slot
    user_dense_tokens: int = 2  # Kdu: user dense features projected to this many tokens
    cand_dense_features: int = 16  # Fc
    cand_sparse_features: int = 6  # Sc
    cand_vocab_size: int = 20_000  # rows per candidate sparse slot
    cand_dense_tokens: int = 1  # Kdc
    item_vocab_size: int = 50_000  # history item ids
    history_length: int = 64  # L
    embedding_dim: int = 64  # D
    compressed_tokens: int = 8  # N
    query_tokens: int = 4  # S: candidate query tokens, taken from the first S compressed tokens
    heads: int = 2  # H; head_dim d = D / H
    mlp_hidden: tuple[int, ...] = field(default=(256, 128))
    tasks: int = 3  # T

    def __post_init__(self):
        if self.embedding_dim % self.heads:
            raise ValueError(f"embedding_dim {self.embedding_dim} is not divisible by heads {self.heads}")
        if not 1 <= self.query_tokens <= self.compressed_tokens:
            raise ValueError(f"query_tokens must lie in [1, compressed_tokens={self.compressed_tokens}]")
        object.__setattr__(self, "mlp_hidden", tuple(self.mlp_hidden))

    @property
    def user_tokens(self) -> int:  # Ku
        return self.user_sparse_features + self.user_dense_tokens

    @property
    def cand_tokens(self) -> int:  # Kc
        return self.cand_sparse_features + self.cand_dense_tokens

    @property
    def head_dim(self) -> int:  # d
        return self.embedding_dim // self.heads

    @property
    def mlp_input(self) -> int:  # user_repr + cand_repr
        return self.embedding_dim + self.compressed_tokens * self.embedding_dim + self.embedding_dim


# Named model sizes. "demo" (the defaults) is what the CPU configs and CI serve; "large" is the
# GPU-scale model of model_repository/*/configs/large.pbtxt: long user histories (L = 512, D = 256,
# d = 128) and many user tokens (Ku = 128 vs Kc = 32), where the replicated user work of the baseline
# dominates, as in production rankers.
PROFILES = {
    "demo": RankerConfig(),
    "large": RankerConfig(
        user_dense_features=64,
        user_sparse_features=32,
        user_vocab_size=5_000,
        user_dense_tokens=96,
        cand_dense_features=32,
        cand_sparse_features=24,
        cand_vocab_size=5_000,
        cand_dense_tokens=8,
        item_vocab_size=100_000,
        history_length=512,
        embedding_dim=256,
        compressed_tokens=32,
        query_tokens=8,
        heads=2,
        mlp_hidden=(1024, 256),
    ),
}


def profile_config(name: str) -> RankerConfig:
    """The RankerConfig of a named profile (PROFILES)."""
    if name not in PROFILES:
        raise ValueError(f"profile: expected one of {sorted(PROFILES)}, got {name!r}")
    return PROFILES[name]


def weight_shapes(cfg: RankerConfig) -> dict[str, tuple[int, ...]]:
    """Name → shape of every weight tensor."""
    dim = cfg.embedding_dim
    shapes = {
        "user_table": (cfg.user_sparse_features * cfg.user_vocab_size, dim),
        "cand_table": (cfg.cand_sparse_features * cfg.cand_vocab_size, dim),
        "item_table": (cfg.item_vocab_size, dim),
        "history_position": (cfg.history_length, dim),
        "user_dense.weight": (cfg.user_dense_tokens * dim, cfg.user_dense_features),
        "user_dense.bias": (cfg.user_dense_tokens * dim,),
        "cand_dense.weight": (cfg.cand_dense_tokens * dim, cfg.cand_dense_features),
        "cand_dense.bias": (cfg.cand_dense_tokens * dim,),
        "lce.weight": (cfg.compressed_tokens, cfg.user_tokens + cfg.cand_tokens),
        "lce.bias": (cfg.compressed_tokens,),
        "history_qkv.weight": (3 * dim, dim),
        "history_qkv.bias": (3 * dim,),
        "cand_query.weight": (dim, dim),
        "cand_query.bias": (dim,),
    }
    widths = (cfg.mlp_input, *cfg.mlp_hidden, cfg.tasks)
    for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:])):
        shapes[f"mlp.{i}.weight"] = (fan_out, fan_in)
        shapes[f"mlp.{i}.bias"] = (fan_out,)
    return shapes


def make_demo_weights(cfg: RankerConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights with the usual scales: tables ~N(0, 0.1), layers ~U(±1/√fan_in)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = weight_shapes(cfg)
    weights = {}
    for name, shape in shapes.items():
        if name.endswith((".weight", ".bias")):
            fan_in = shapes[name.rsplit(".", 1)[0] + ".weight"][1]
            weights[name] = (torch.rand(shape, generator=gen) * 2 - 1) * fan_in**-0.5
        else:  # embedding tables
            weights[name] = torch.randn(shape, generator=gen) * 0.1
    return weights


def save_weights(path, cfg: RankerConfig, weights: dict[str, torch.Tensor]) -> None:
    """One safetensors file that carries its RankerConfig in the metadata."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in weights.items()}, str(path), metadata={"ranker_config": json.dumps(asdict(cfg))}
    )


def load_weights(path) -> tuple[RankerConfig, dict[str, torch.Tensor]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        cfg = RankerConfig(**json.loads(f.metadata()["ranker_config"]))
    weights = load_file(str(path))
    expected = weight_shapes(cfg)
    for name, shape in expected.items():
        if name not in weights or tuple(weights[name].shape) != shape:
            got = tuple(weights[name].shape) if name in weights else "missing"
            raise ValueError(f"{path}: weight {name!r} expected shape {shape}, got {got}")
    return cfg, weights


INTERACTION_WEIGHTS = ("lce", "history_qkv", "cand_query", "mlp")  # name prefixes; the rest is the feature stage's


@dataclass
class Features:
    """Output of the feature stage, at natural batch sizes."""

    user_tokens: torch.Tensor  # [U, Ku, D]
    cand_tokens: torch.Tensor  # [B, Kc, D]
    history_tokens: torch.Tensor  # [U, L, D]
    history_len: torch.Tensor  # [U] int32
    cand_to_user: torch.Tensor  # [B] int32


class FeatureStage:
    """Embedding lookups and dense projections; users at U rows, candidates at B rows. With
    `batch_invariant`, the projections run in fixed-size row chunks (ikbo_backend/batch_invariant.py)."""

    def __init__(
        self, cfg: RankerConfig, weights: dict[str, torch.Tensor], device="cpu", batch_invariant: bool = False
    ):
        self.cfg = cfg
        self.linear = rowwise_linear if batch_invariant else F.linear
        self.w = {k: v.to(device) for k, v in weights.items() if not k.startswith(INTERACTION_WEIGHTS)}
        self.user_slot_offset = torch.arange(cfg.user_sparse_features, device=device) * cfg.user_vocab_size
        self.cand_slot_offset = torch.arange(cfg.cand_sparse_features, device=device) * cfg.cand_vocab_size

    def __call__(
        self, user_dense, user_sparse_ids, user_history_ids, user_history_len, cand_dense, cand_sparse_ids, cand_to_user
    ) -> Features:
        cfg, w = self.cfg, self.w
        dim = cfg.embedding_dim
        user_sparse = F.embedding(user_sparse_ids + self.user_slot_offset, w["user_table"])  # [U, Su, D]
        user_dense_tok = self.linear(user_dense, w["user_dense.weight"], w["user_dense.bias"]).view(
            -1, cfg.user_dense_tokens, dim
        )
        cand_sparse = F.embedding(cand_sparse_ids + self.cand_slot_offset, w["cand_table"])  # [B, Sc, D]
        cand_dense_tok = self.linear(cand_dense, w["cand_dense.weight"], w["cand_dense.bias"]).view(
            -1, cfg.cand_dense_tokens, dim
        )
        history = F.embedding(user_history_ids, w["item_table"]) + w["history_position"]  # [U, L, D]
        return Features(
            torch.cat([user_sparse, user_dense_tok], dim=1),
            torch.cat([cand_sparse, cand_dense_tok], dim=1),
            history,
            user_history_len.to(torch.int32),
            cand_to_user.to(torch.int32),
        )


class _Interaction:
    """Weights shared by both interaction variants, moved to the device once. With `batch_invariant`,
    every row-wise linear runs in fixed-size row chunks and the final sigmoid in the vectorized body
    only, so a candidate's scores do not depend on the rest of its batch (ikbo_backend/batch_invariant.py)."""

    def __init__(
        self, cfg: RankerConfig, weights: dict[str, torch.Tensor], device="cpu", batch_invariant: bool = False
    ):
        self.cfg = cfg
        self.linear = rowwise_linear if batch_invariant else F.linear
        self.sigmoid = functools.partial(vectorized_elementwise, torch.sigmoid) if batch_invariant else torch.sigmoid
        self.w = {k: v.to(device) for k, v in weights.items() if k.startswith(INTERACTION_WEIGHTS)}
        self.num_mlp_layers = len(cfg.mlp_hidden) + 1

    def _heads(self, x, rows):
        """[rows, T, D] → [rows, H, T, d]."""
        return x.view(rows, x.shape[1], self.cfg.heads, self.cfg.head_dim).transpose(1, 2)

    def _history_qkv(self, history_tokens):
        rows = history_tokens.shape[0]
        q, k, v = self.linear(history_tokens, self.w["history_qkv.weight"], self.w["history_qkv.bias"]).chunk(3, dim=-1)
        return self._heads(q, rows), self._heads(k, rows), self._heads(v, rows)

    def _cand_queries(self, compressed):
        q = self.linear(compressed[:, : self.cfg.query_tokens], self.w["cand_query.weight"], self.w["cand_query.bias"])
        return self._heads(q, compressed.shape[0])

    def _sequence_summary(self, seq_out, lengths):
        """Mean over valid positions of [rows, H, L, d] → [rows, D] (zeros for length 0)."""
        merged = seq_out.transpose(1, 2).flatten(2)  # [rows, L, D]
        return merged.sum(dim=1) / lengths.clamp(min=1).to(merged.dtype)[:, None]

    def _cand_repr(self, compressed, cand_seq):
        return torch.cat([compressed.flatten(1), cand_seq.mean(dim=2).flatten(1)], dim=1)  # [B, N·D + D]

    def _mlp_tail(self, hidden):
        """The MLP after its first layer → logits [B, T]."""
        for i in range(1, self.num_mlp_layers):
            hidden = self.linear(F.relu(hidden), self.w[f"mlp.{i}.weight"], self.w[f"mlp.{i}.bias"])
        return hidden

    def __call__(self, f: Features) -> torch.Tensor:
        """scores [B, T] = sigmoid(logits)."""
        return self.sigmoid(self.logits(f))


class IkboRanker(_Interaction):
    """Interaction stage with IKBO ops: user-side work at U rows, joined only through the mapping.

    Trains when its weights are Parameters that require grad (ikbo_backend/training.py): the LCE then
    trains its own Parameters (`self.lce`, packed from lce.weight and lce.bias), the first MLP layer's
    two column blocks are views of mlp.0.weight taken at every call, and under autocast the IKBO ops run
    in the autocast dtype, as the baseline's matmuls and attention do (`_op`)."""

    def __init__(self, cfg, weights, device="cpu", backend: str = "auto", batch_invariant: bool = False):
        super().__init__(cfg, weights, device, batch_invariant)
        self.backend = backend
        self.lce = PackedLinearCompress.from_weight(self.w["lce.weight"], cfg.user_tokens, self.w["lce.bias"])
        first = self.w["mlp.0.weight"]
        if not first.requires_grad:  # inference: contiguous copies, taken once
            self.mlp0_user = first[:, : cfg.embedding_dim].contiguous()  # [h1, D]
            self.mlp0_cand = first[:, cfg.embedding_dim :].contiguous()  # [h1, N·D + D]

    def _first_layer(self) -> tuple[torch.Tensor, torch.Tensor]:
        """mlp.0.weight's user columns [h1, D] and candidate columns [h1, N·D + D]."""
        first = self.w["mlp.0.weight"]
        if first.requires_grad:  # training: views, so the optimizer's updates and the gradients pass through
            return first[:, : self.cfg.embedding_dim], first[:, self.cfg.embedding_dim :]
        return self.mlp0_user, self.mlp0_cand

    def _op(self, op, *args, **kwargs):
        """An IKBO op; under autocast as `torch.library.register_autocast` runs an op: floating inputs cast to the
        autocast dtype, the op run with autocast off (autocast casts no custom op's inputs, and must not recast
        the torch ops inside one)."""
        device_type = args[0].device.type
        if not torch.is_autocast_enabled(device_type):
            return op(*args, **kwargs)
        dtype = torch.get_autocast_dtype(device_type)
        cast = [a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
        with torch.autocast(device_type, enabled=False):
            return op(*cast, **kwargs)

    def _compress(self, f: Features) -> torch.Tensor:
        """LCE → [B, N, D]; under autocast in its dtype, from the Parameters cast at the call (as autocast
        casts a linear's weight)."""
        lce = self.lce
        if not torch.is_autocast_enabled(f.user_tokens.device.type):
            return lce(f.user_tokens, f.cand_tokens, f.cand_to_user, backend=self.backend)
        weight = torch.cat([lce.user_weight, lce.cand_weight], dim=1)
        args = (f.user_tokens, f.cand_tokens, f.cand_to_user, weight, lce.bias)
        return self._op(ikbo_linear_compress, *args, backend=self.backend)

    def logits(self, f: Features) -> torch.Tensor:
        """[B, T], before the sigmoid."""
        compressed = self._compress(f)  # [B, N, D]
        user_q, k, v = self._history_qkv(f.history_tokens)  # [U, H, L, d]
        cand_q = self._cand_queries(compressed)  # [B, H, S, d]
        user_seq, cand_seq = self._op(
            ikbo_self_target_attention,
            user_q,
            cand_q,
            k,
            v,
            f.cand_to_user,
            f.history_len,
            causal=True,
            backend=self.backend,
        )
        user_repr = self._sequence_summary(user_seq, f.history_len)  # [U, D]
        mlp0_user, mlp0_cand = self._first_layer()
        cand_hidden = self.linear(self._cand_repr(compressed, cand_seq), mlp0_cand, self.w["mlp.0.bias"])  # [B, h1]
        user_hidden = self.linear(user_repr, mlp0_user)  # [U, h1]
        hidden = self._op(add_user_rows, cand_hidden, user_hidden, f.cand_to_user)  # Type I
        return self._mlp_tail(hidden)


class BaselineRanker(_Interaction):
    """Interaction stage as usually served: user tensors replicated to B rows, then standard ops."""

    def logits(self, f: Features) -> torch.Tensor:
        """[B, T], before the sigmoid."""
        cfg = self.cfg
        rows = f.cand_to_user.long()
        user_tokens = f.user_tokens.index_select(0, rows)  # [B, Ku, D]  materialized broadcast
        history = f.history_tokens.index_select(0, rows)  # [B, L, D]    materialized broadcast
        history_len = f.history_len.index_select(0, rows).long()  # [B]
        seq_len = cfg.history_length

        tokens = torch.cat([user_tokens, f.cand_tokens], dim=1)  # [B, Ku + Kc, D]
        compressed = torch.matmul(self.w["lce.weight"], tokens) + self.w["lce.bias"][:, None]  # [B, N, D]

        user_q, k, v = self._history_qkv(history)  # [B, H, L, d]
        positions = torch.arange(seq_len, device=rows.device)
        key_valid = (positions < history_len[:, None])[:, None, None, :]  # [B, 1, 1, L]
        causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=rows.device).tril()
        user_seq = F.scaled_dot_product_attention(user_q, k, v, attn_mask=key_valid & causal)
        user_seq = user_seq.masked_fill(~(positions < history_len[:, None])[:, None, :, None], 0.0)
        cand_seq = F.scaled_dot_product_attention(self._cand_queries(compressed), k, v, attn_mask=key_valid)
        cand_seq = cand_seq.masked_fill((history_len == 0)[:, None, None, None], 0.0)

        user_repr = self._sequence_summary(user_seq, history_len)  # [B, D]
        hidden = self.linear(
            torch.cat([user_repr, self._cand_repr(compressed, cand_seq)], dim=1),
            self.w["mlp.0.weight"],
            self.w["mlp.0.bias"],
        )
        return self._mlp_tail(hidden)
