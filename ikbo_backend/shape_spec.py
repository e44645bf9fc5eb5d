"""Shape-range spec: the declared U and B ranges (model_repository/shape_ranges.json) and the fixed
L, S, N, D of the RankerConfig → per-op shape buckets, each a set of (U, B) that launches the same
compiled Triton kernels. Warming up at one representative (U, B) per bucket compiles every kernel a
request in the declared range can launch, so none compiles on the request path.

What makes Triton 3.6 compile again (triton/runtime/jit.py, triton/backends/compiler.py): another
constexpr (tile config, variant flags), another dtype, or another specialization of a plain
argument: integers are specialized on divisibility by 16 (and on i32 vs i64, not reachable here),
pointers on 16-byte alignment (every buffer here comes from the allocator). Per op, the key below
holds everything of that which a request's (U, B) can change:

- lce (kernels/linear_compress.py; Triton on CUDA for fp32/fp16/bf16): the variant
  `default_variant(U, B)`. s3 launches `_lce_tile_kernel` with integers fixed by the model dims
  (N, D, K, strides): one key. s4 launches `_lce_persistent_kernel` with num_users,
  num_candidates and num_programs = min(SMs, (U + B)·tiles per row): key (s4, U%16 = 0, B%16 = 0,
  programs%16 = 0).
- attention (kernels/attention.py; Triton only for fp16/bf16 and d ∈ {16, 32, 64, 128}: the
  served fp32 model takes the torch path, one key "torch"): the tile config `pick_config(B·S/U + L)`,
  then num_candidates, num_users and num_self_tiles = U·cdiv(L, BLOCK_M): key (BLOCK_M, U%16 = 0,
  B%16 = 0, self tiles%16 = 0).
On a CPU both ops run torch: one bucket each, and the warm-up is the range's ends and middle
(`serving.warmup_sizes`). Tensor descriptors are specialized on their block shape only (constant
per config). `tests/test_shape_spec.py` checks the enumeration against every (U, B) of a range, and
on a GPU counts compilations during requests after the warm-up (it must be 0); `CompileCounter`
counts them in a served model's process (metric ikbo_triton_compilations_total{phase}).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from kernels.attention import TRITON_HEAD_DIMS
from kernels.attention import TRITON_TYPES as ATTENTION_TRITON_TYPES
from kernels.attention import pick_config
from kernels.linear_compress import TRITON_TYPES as LCE_TRITON_TYPES
from kernels.linear_compress import default_variant, tile_configs

from .ranker import RankerConfig
from .requests import ShapeRanges

OPS = ("lce", "attention")
EXHAUSTIVE_CANDIDATES = 1024  # every B up to here; above, B ≡ -1, 0, 1 (mod 16) (see `candidate_counts`)


@functools.lru_cache(maxsize=None)
def _s4_tiles_per_row(cfg: RankerConfig, dtype: torch.dtype) -> int:
    tile = next(tile_configs("s4", dtype, cfg.embedding_dim))  # the first config (the one that launches on the H200)
    return triton.cdiv(cfg.compressed_tokens, tile.block_m) * triton.cdiv(cfg.embedding_dim, tile.block_d)


def lce_key(cfg: RankerConfig, num_users: int, num_candidates: int, dtype: torch.dtype, num_sms: int | None) -> tuple:
    """What a (U, B) changes in the LCE kernels' compilation key; num_sms None: not on a GPU."""
    if num_sms is None or dtype not in LCE_TRITON_TYPES:
        return ("torch",)
    variant = default_variant(num_users, num_candidates)
    if variant != "s4":
        return (variant,)
    programs = min(num_sms, (num_users * (cfg.user_tokens > 0) + num_candidates) * _s4_tiles_per_row(cfg, dtype))
    return ("s4", num_users % 16 == 0, num_candidates % 16 == 0, programs % 16 == 0)


def attention_key(cfg: RankerConfig, num_users: int, num_candidates: int, dtype: torch.dtype, num_sms: int | None) -> tuple:
    """What a (U, B) changes in the attention kernels' compilation key (self + target attention)."""
    if num_sms is None or dtype not in ATTENTION_TRITON_TYPES or cfg.head_dim not in TRITON_HEAD_DIMS:
        return ("torch",)
    tile = pick_config(num_candidates * cfg.query_tokens / num_users + cfg.history_length, interpret=False)
    self_tiles = num_users * triton.cdiv(cfg.history_length, tile.block_m)
    return (tile.block_m, num_users % 16 == 0, num_candidates % 16 == 0, self_tiles % 16 == 0)


KEYS = {"lce": lce_key, "attention": attention_key}


@dataclass(frozen=True)
class ShapeBucket:
    """The (U, B) of the declared range that share one compilation key of one op."""

    op: str
    key: tuple
    representative: tuple[int, int]  # (U, B): the smallest B, then U, of the bucket
    shapes: int  # how many enumerated (U, B) fall in it


def candidate_counts(ranges: ShapeRanges) -> list[int]:
    """The B values enumerated: all up to EXHAUSTIVE_CANDIDATES, then those ≡ -1, 0, 1 (mod 16).
    Above that bound every rule of the keys changes only at multiples of 16 (32·U, 16-divisibility;
    the others — B ≤ 256, programs < SMs — lie below it): tests/test_shape_spec.py checks."""
    low, high = ranges.candidates
    counts = set(range(low, min(high, EXHAUSTIVE_CANDIDATES) + 1))
    for base in range(EXHAUSTIVE_CANDIDATES - EXHAUSTIVE_CANDIDATES % 16, high + 2, 16):
        counts.update(b for b in (base - 1, base, base + 1) if low <= b <= high)
    return sorted(counts)


@functools.lru_cache(maxsize=None)
def shape_buckets(
    cfg: RankerConfig, ranges: ShapeRanges, dtype: torch.dtype = torch.float32, num_sms: int | None = None
) -> dict[str, tuple[ShapeBucket, ...]]:
    """op → its buckets over the declared range, for a model in `dtype` on a GPU with `num_sms`
    SMs (None: a CPU, where every op is one torch bucket)."""
    counts = candidate_counts(ranges)
    if num_sms is None:  # every op runs torch: one bucket, nothing to enumerate
        everything = (ranges.users[1] - ranges.users[0] + 1) * len(counts)
        return {op: (ShapeBucket(op, ("torch",), (ranges.users[0], counts[0]), everything),) for op in OPS}
    found: dict[str, dict[tuple, list]] = {op: {} for op in OPS}
    for num_users in range(ranges.users[0], ranges.users[1] + 1):
        for num_candidates in counts:
            for op in OPS:
                key = KEYS[op](cfg, num_users, num_candidates, dtype, num_sms)
                entry = found[op].setdefault(key, [(num_candidates, num_users), 0])
                entry[0] = min(entry[0], (num_candidates, num_users))
                entry[1] += 1
    return {
        op: tuple(ShapeBucket(op, key, (rep[1], rep[0]), n) for key, (rep, n) in sorted(found[op].items(), key=lambda kv: kv[1][0]))
        for op in OPS
    }


def device_sms(device) -> int | None:
    """SM count of a CUDA device, None elsewhere."""
    device = torch.device(device)
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None


def bucket_representatives(cfg: RankerConfig, ranges: ShapeRanges, device, dtype: torch.dtype = torch.float32) -> list[tuple[int, int]]:
    """(U, B) to warm up at so that every bucket of every op has run once on `device`."""
    buckets = shape_buckets(cfg, ranges, dtype, device_sms(device))
    return list(dict.fromkeys(b.representative for op in OPS for b in buckets[op]))


class CompileCounter:
    """Triton kernel compilations in this process, by phase: "warmup" until `phase` is set to
    "request". Counted through triton.knobs.runtime.jit_post_compile_hook (called after every
    compilation, also when the binary comes from Triton's disk cache); a hook already set is kept."""

    def __init__(self):
        self.phase = "warmup"
        self.counts = {"warmup": 0, "request": 0}
        self.kernels: list[tuple[str, str]] = []  # (phase, kernel name)

    @classmethod
    def install(cls) -> "CompileCounter":
        from triton import knobs

        counter, previous = cls(), knobs.runtime.jit_post_compile_hook

        def hook(**kwargs):
            counter.counts[counter.phase] += 1
            counter.kernels.append((counter.phase, kwargs["fn"].name))
            return previous(**kwargs) if previous is not None else None

        knobs.runtime.jit_post_compile_hook = hook
        return counter
