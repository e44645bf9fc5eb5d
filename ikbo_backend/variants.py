"""The served variants of the ranker, built from one set of weights: "ikbo" (ranker.IkboRanker),
"baseline" (ranker.BaselineRanker) and "transformed" (the baseline after the IKBO transformation,
transformed.py), each in a compute dtype (`COMPUTE_DTYPES`)."""

from __future__ import annotations

import torch

from .ranker import INTERACTION_WEIGHTS, BaselineRanker, Features, FeatureStage, IkboRanker, RankerConfig
from .transformed import TransformedInteraction

COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CastInteraction:
    """An interaction run in a 16-bit compute dtype: float features cast on the way in, scores
    returned as float32 (the served contract). Weights are cast once, by `build_ranker`."""

    def __init__(self, interaction, dtype: torch.dtype):
        self.interaction, self.dtype = interaction, dtype

    def __getattr__(self, name):  # the wrapped interaction's attributes (e.g. the transform report)
        if name == "interaction":
            raise AttributeError(name)
        return getattr(self.interaction, name)

    def __call__(self, f: Features) -> torch.Tensor:
        cast = {k: v.to(self.dtype) if v.is_floating_point() else v for k, v in vars(f).items()}
        return self.interaction(Features(**cast)).float()


def build_ranker(
    variant: str,
    cfg: RankerConfig,
    weights,
    device="cpu",
    backend: str = "auto",
    dtype=None,
    batch_invariant: bool = False,
    cuda_graphs: bool = False,
):
    """(FeatureStage, interaction) for variant "ikbo", "baseline" or "transformed" (BaselineRanker
    after the IKBO transformation, ikbo_backend.transform). With `dtype` (a torch dtype or a
    COMPUTE_DTYPES name) the interaction's weights are cast to it once and a 16-bit interaction
    returns float32 scores; None keeps the weights' dtype (tests pass float64 weights).
    `batch_invariant` (ikbo and baseline, torch ops): each candidate's scores are bit-identical in
    any batch (ikbo_backend/batch_invariant.py). `cuda_graphs`: the interaction will be replayed from CUDA graphs, so
    the transformation's cost model times both sides as graph replays."""
    if dtype is not None:
        dtype = COMPUTE_DTYPES[dtype] if isinstance(dtype, str) and dtype in COMPUTE_DTYPES else dtype
        if dtype not in COMPUTE_DTYPES.values():
            raise ValueError(f"compute dtype: expected one of {sorted(COMPUTE_DTYPES)}, got {dtype!r}")
    if batch_invariant and variant == "transformed":
        raise ValueError("batch_invariant: supported for variants 'ikbo' and 'baseline', got 'transformed'")
    if batch_invariant and torch.device(device).type != "cpu":
        raise ValueError(f"batch_invariant: a CPU mode (torch's CPU kernels), got device {device}")
    cast = {
        k: v.to(dtype) if dtype is not None and k.startswith(INTERACTION_WEIGHTS) else v for k, v in weights.items()
    }
    if variant == "ikbo":
        interaction = IkboRanker(cfg, cast, device, backend, batch_invariant)
    elif variant == "baseline":
        interaction = BaselineRanker(cfg, cast, device, batch_invariant)
    elif variant == "transformed":
        interaction = TransformedInteraction(
            cfg, cast, device, dtype or next(v.dtype for v in cast.values() if v.is_floating_point()), cuda_graphs
        )
    else:
        raise ValueError(f"variant: expected 'ikbo', 'baseline' or 'transformed', got {variant!r}")
    if dtype in (torch.float16, torch.bfloat16):
        interaction = CastInteraction(interaction, dtype)
    return FeatureStage(cfg, weights, device, batch_invariant), interaction
