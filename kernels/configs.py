"""Launch configurations of the Triton kernels, and the ones tuned per shape bucket.

`TileConfig`: the tile shape and launch options of one Triton kernel launch (LCE's GEMM kernels, the attention
kernel). `set_tuned_configs` / `tuned_config`: what the load-time tuner (ikbo_backend/autotune.py) chose per shape
bucket, looked up by the public ops on every call; where nothing is tuned they use their own heuristics.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

import torch


@dataclass(frozen=True)
class TileConfig:
    """An output tile of block_m × block_n and the launch options.

    LCE (`kernels/linear_compress.py`): block_m rows of N × block_n columns of D per output tile, block_k the K
    step. Attention (`kernels/attention.py`): block_m query rows × block_n keys per step (block_k unused: the K of
    both products is the head dim). maxnreg caps the registers per thread; warp_specialize turns on Triton's
    automatic warp specialization of the main loop; epilogue_split writes LCE's epilogue in two
    [block_m, block_n / 2] halves (half the shared memory).
    """

    block_m: int
    block_n: int
    block_k: int = 0
    _: KW_ONLY
    num_warps: int
    num_stages: int
    maxnreg: int | None = None
    warp_specialize: bool = False
    epilogue_split: bool = False


# (op, device, dtype, *dims) → lookup(U, B) → the op's tuned choice, or None for its heuristics
_TUNED: dict = {}
_VERSION = [0]  # changes with every change of _TUNED (the ops' replayed launches are keyed on it)


def tuned_version() -> int:
    """A number that changes whenever a tuned choice is set or removed."""
    return _VERSION[0]


def set_tuned_configs(op: str, device, dtype: torch.dtype, dims: tuple, lookup) -> None:
    """Have `op` ("lce" or "attention") on `device` (with its index, e.g. cuda:0) in `dtype` with model `dims` launch
    `lookup(U, B)`: lce dims (Ku, Kc, N, D) → (variant, TileConfig or None); attention dims (H, L, S, d,
    with self-attention) → TileConfig or `attention.WS_CHOICE`. Where it returns None the op's heuristics decide.
    `lookup=None` removes it."""
    key = (op, torch.device(device), dtype, *dims)
    _VERSION[0] += 1
    if lookup is None:
        _TUNED.pop(key, None)
    else:
        _TUNED[key] = lookup


def tuned_config(op: str, device: torch.device, dtype: torch.dtype, dims: tuple, num_users: int, num_candidates: int):
    """The tuned choice of `op` at (U, B) (see `set_tuned_configs`), or None."""
    if not _TUNED:
        return None
    lookup = _TUNED.get((op, device, dtype, *dims))
    return None if lookup is None else lookup(num_users, num_candidates)


def clear_tuned_configs() -> None:
    """Remove every tuned choice: the ops use their heuristics again."""
    _VERSION[0] += 1
    _TUNED.clear()
