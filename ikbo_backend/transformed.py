"""The baseline ranker's interaction after the IKBO transformation (ikbo_backend.transform): the
"transformed" variant of `variants.build_ranker`.

`BaselineInteraction` only gives `ranker.BaselineRanker` the forward signature the pass traces (the
Features fields as arguments); the model code itself is not touched.
"""

from __future__ import annotations

from dataclasses import astuple, fields

import torch
from torch import nn

from .ranker import BaselineRanker, Features, RankerConfig
from .transform import to_ikbo


class BaselineInteraction(nn.Module):
    """BaselineRanker as an nn.Module whose forward takes the Features fields."""

    def __init__(self, baseline: BaselineRanker):
        super().__init__()
        self.baseline = baseline

    def forward(self, user_tokens, cand_tokens, history_tokens, history_len, cand_to_user):
        return self.baseline(Features(user_tokens, cand_tokens, history_tokens, history_len, cand_to_user))


def example_features(cfg: RankerConfig, device="cpu", seed: int = 0, dtype=torch.float32) -> Features:
    """Random features of a typical request, U ≈ 15 users and B ≈ 1024 candidates (the pass's cost model
    times the rewrite at the example's U:B), both unlike every model dim (row counts tell them apart)."""
    dims = {
        v
        for f in fields(cfg)
        for v in (getattr(cfg, f.name) if isinstance(getattr(cfg, f.name), tuple) else (getattr(cfg, f.name),))
    }
    dims |= {cfg.user_tokens, cfg.cand_tokens, cfg.head_dim, cfg.mlp_input, 1}
    num_users = next(n for n in range(15, 1000) if n not in dims)
    num_candidates = next(n for n in range(1024, 10_000) if n not in dims and n != num_users)
    gen = torch.Generator().manual_seed(seed)
    dim = cfg.embedding_dim
    return Features(
        torch.randn(num_users, cfg.user_tokens, dim, generator=gen).to(device, dtype),
        torch.randn(num_candidates, cfg.cand_tokens, dim, generator=gen).to(device, dtype),
        torch.randn(num_users, cfg.history_length, dim, generator=gen).to(device, dtype),
        torch.randint(0, cfg.history_length + 1, (num_users,), generator=gen, dtype=torch.int32).to(device),
        torch.randint(0, num_users, (num_candidates,), generator=gen, dtype=torch.int32).to(device),
    )


class TransformedInteraction:
    """Features → scores with the rewritten BaselineRanker graph; `report` says what the pass did."""

    def __init__(self, cfg: RankerConfig, weights, device="cpu", dtype=torch.float32, cuda_graphs: bool = False):
        baseline = BaselineInteraction(BaselineRanker(cfg, weights, device))
        example = astuple(example_features(cfg, device, dtype=dtype))
        self.module, self.report = to_ikbo(baseline, example, cuda_graphs=cuda_graphs)  # timed as it will be served

    def __call__(self, f: Features) -> torch.Tensor:
        return self.module(f.user_tokens, f.cand_tokens, f.history_tokens, f.history_len, f.cand_to_user)
