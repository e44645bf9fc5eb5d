"""Kernel shape buckets: the declared U and B ranges (model_repository/shape_ranges.json) and the fixed
L, S, N, D of the RankerConfig → per op, the sets of (U, B) that launch the same compiled Triton kernels.
Warming up at one representative (U, B) per bucket compiles every kernel a request in the declared range
can launch, so none compiles on the request path. (Not cuda_graphs' buckets, which group the shapes one
captured graph serves.)

What makes Triton 3.6 compile again (triton/runtime/jit.py, triton/backends/compiler.py): another
constexpr (tile config, variant flags), another dtype, or another specialization of a plain
argument: integers are specialized on divisibility by 16 and on being 1 (a value of 1 becomes a
constexpr), pointers on 16-byte alignment. The kernels take every integer that a request's (U, B)
sets unspecialized (`do_not_specialize`: U, B, program and tile counts) and keep their scratch
buffers 16-byte aligned for any B (attention's plan buffer), so a request's (U, B) changes only:

- lce (kernels/linear_compress.py; Triton on CUDA for fp32/fp16/bf16): the variant
  `default_variant(U, B)`, fused (`_lce_tile_kernel`, integers fixed by the model dims) or persistent
  (`_lce_persistent_kernel`): key (variant,).
- attention (kernels/attention.py; Triton only for fp16/bf16 and d ∈ {16, 32, 64, 128}: an fp32
  model takes the torch path, one key "torch"): the tile config `pick_config(B·S/U + L)`: key (BLOCK_M,).
On a CPU both ops run torch: one bucket each, and the warm-up is the range's ends and middle
(`serving.warmup_sizes`). Tensor descriptors are specialized on their block shape only (constant
per config). tests/test_kernel_buckets.py checks the enumeration against every (U, B) of a range, and
on a GPU counts compilations during requests after the warm-up (it must be 0); `CompileCounter`
(ikbo_backend/compile_counter.py) counts them in a served model's process.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kernels.attention import TRITON_HEAD_DIMS, pick_config
from kernels.attention import TRITON_TYPES as ATTENTION_TRITON_TYPES
from kernels.linear_compress import TRITON_TYPES as LCE_TRITON_TYPES
from kernels.linear_compress import default_variant

from .ranker import RankerConfig
from .requests import ShapeRanges

OPS = ("lce", "attention")
EXHAUSTIVE_CANDIDATES = 1024  # every B up to here; above, B ≡ -1, 0, 1 (mod 16) (see `candidate_counts`)


def lce_key(cfg: RankerConfig, num_users: int, num_candidates: int, dtype: torch.dtype, num_sms: int | None) -> tuple:
    """What a (U, B) changes in the LCE kernels' compilation key; num_sms None: not on a GPU."""
    if num_sms is None or dtype not in LCE_TRITON_TYPES:
        return ("torch",)
    return (default_variant(num_users, num_candidates),)


def attention_key(
    cfg: RankerConfig, num_users: int, num_candidates: int, dtype: torch.dtype, num_sms: int | None
) -> tuple:
    """What a (U, B) changes in the attention kernels' compilation key (self + target attention)."""
    if num_sms is None or dtype not in ATTENTION_TRITON_TYPES or cfg.head_dim not in TRITON_HEAD_DIMS:
        return ("torch",)
    return (pick_config(num_candidates * cfg.query_tokens / num_users + cfg.history_length, interpret=False).block_m,)


KEYS = {"lce": lce_key, "attention": attention_key}


def op_dims(cfg: RankerConfig, op: str) -> tuple:
    """The model dims an op's kernels see, as its tuned configs are keyed (kernels.configs.set_tuned_configs):
    lce (Ku, Kc, N, D); attention (H, L, S, d, True: with self-attention, as the model runs it)."""
    if op == "lce":
        return cfg.user_tokens, cfg.cand_tokens, cfg.compressed_tokens, cfg.embedding_dim
    return cfg.heads, cfg.history_length, cfg.query_tokens, cfg.head_dim, True


@dataclass(frozen=True)
class ShapeBucket:
    """The (U, B) of the declared range that share one compilation key of one op."""

    op: str
    key: tuple
    representative: tuple[int, int]  # (U, B): the smallest B, then U, of the bucket
    shapes: int  # how many enumerated (U, B) fall in it
    largest: tuple[int, int]  # (U, B): the largest B, then U (where configurations are timed)


def candidate_counts(ranges: ShapeRanges) -> list[int]:
    """The B values enumerated: all up to EXHAUSTIVE_CANDIDATES, then those ≡ -1, 0, 1 (mod 16).
    Above that bound the keys change at default_variant's B ≥ 32·U (a multiple of 16) and at
    pick_config's thresholds on B·S/U, whose tile bands are far wider than 16 candidates (B ≤ 256
    lies below): tests/test_kernel_buckets.py checks."""
    low, high = ranges.candidates
    counts = set(range(low, min(high, EXHAUSTIVE_CANDIDATES) + 1))
    for base in range(EXHAUSTIVE_CANDIDATES - EXHAUSTIVE_CANDIDATES % 16, high + 2, 16):
        counts.update(b for b in (base - 1, base, base + 1) if low <= b <= high)
    return sorted(counts)


@functools.cache
def kernel_buckets(
    cfg: RankerConfig, ranges: ShapeRanges, dtype: torch.dtype = torch.float32, num_sms: int | None = None
) -> dict[str, tuple[ShapeBucket, ...]]:
    """op → its buckets over the declared range, for a model in `dtype` on a GPU with `num_sms`
    SMs (None: a CPU, where every op is one torch bucket)."""
    counts = candidate_counts(ranges)
    if num_sms is None:  # every op runs torch: one bucket, nothing to enumerate
        everything = (ranges.users[1] - ranges.users[0] + 1) * len(counts)
        ends = (ranges.users[0], counts[0]), (ranges.users[1], counts[-1])
        return {op: (ShapeBucket(op, ("torch",), ends[0], everything, ends[1]),) for op in OPS}
    found: dict[str, dict[tuple, list]] = {op: {} for op in OPS}
    for num_users in range(ranges.users[0], ranges.users[1] + 1):
        for num_candidates in counts:
            for op in OPS:
                key = KEYS[op](cfg, num_users, num_candidates, dtype, num_sms)
                entry = found[op].setdefault(key, [(num_candidates, num_users), 0, (num_candidates, num_users)])
                entry[0] = min(entry[0], (num_candidates, num_users))
                entry[1] += 1
                entry[2] = max(entry[2], (num_candidates, num_users))
    return {
        op: tuple(
            ShapeBucket(op, key, rep[::-1], n, top[::-1])
            for key, (rep, n, top) in sorted(found[op].items(), key=lambda kv: kv[1][0])
        )
        for op in OPS
    }


def device_sms(device) -> int | None:
    """SM count of a CUDA device, None elsewhere."""
    device = torch.device(device)
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None
