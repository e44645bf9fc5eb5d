"""Shape-range spec: the declared U and B ranges (model_repository/shape_ranges.json) and the fixed
L, S, N, D of the RankerConfig → per-op shape buckets, each a set of (U, B) that launches the same
compiled Triton kernels. Warming up at one representative (U, B) per bucket compiles every kernel a
request in the declared range can launch, so none compiles on the request path.

What makes Triton 3.6 compile again (triton/runtime/jit.py, triton/backends/compiler.py): another
constexpr (tile config, variant flags), another dtype, or another specialization of a plain
argument: integers are specialized on divisibility by 16 and on being 1 (a value of 1 becomes a
constexpr), pointers on 16-byte alignment. The kernels take every integer that a request's (U, B)
sets unspecialized (`do_not_specialize`: U, B, program and tile counts) and keep their scratch
buffers 16-byte aligned for any B (attention's plan buffer), so a request's (U, B) changes only:

- lce (kernels/linear_compress.py; Triton on CUDA for fp32/fp16/bf16): the variant
  `default_variant(U, B)`, s3 (`_lce_tile_kernel`, integers fixed by the model dims) or s4
  (`_lce_persistent_kernel`): key (variant,).
- attention (kernels/attention.py; Triton only for fp16/bf16 and d ∈ {16, 32, 64, 128}: an fp32
  model takes the torch path, one key "torch"): the tile config `pick_config(B·S/U + L)`: key (BLOCK_M,).
(A first version keyed U%16, B%16 and the program count, and missed the value-1 and alignment
specializations: the H200 online endpoint compiled 6 kernels on the request path, 2026-11-29.)
On a CPU both ops run torch: one bucket each, and the warm-up is the range's ends and middle
(`serving.warmup_sizes`). Tensor descriptors are specialized on their block shape only (constant
per config). `tests/test_shape_spec.py` checks the enumeration against every (U, B) of a range, and
on a GPU counts compilations during requests after the warm-up (it must be 0); `CompileCounter`
counts them in a served model's process (metric ikbo_triton_compilations_total{phase}).

Tuning (`tune_buckets`, run by `bucket_representatives` on a GPU, so at every model load before the
warm-up): per op and bucket, the candidate configurations are timed at the bucket's largest (U, B)
(its heaviest load; at the smallest one every candidate is launch-bound) with fresh random inputs,
each first checked against the fp64 torch path on poisoned outputs, and the fastest correct one is
what the public ops launch for every (U, B) of the bucket (`set_tuned_configs` of kernels/
linear_compress.py and kernels/attention.py; their heuristics where nothing is tuned). Candidates:
lce, the s3 bucket s3's `tile_configs`, the s4 bucket s4's and s3's, plus s6 (Gluon,
warp-specialized, one kernel for any U, B) on a Hopper GPU in 16-bit; attention, `pick_config`'s
and ATTENTION_CONFIGS with BLOCK_N | BLOCK_M, plus the Gluon kernel on Hopper. A model that replays
CUDA graphs (`cuda_graphs`) times them as graph replays, as it runs them (an eager timing counts the
host's launch time, which a replay does not pay), and without s4 (inside a capture it runs as s3).
Choices are cached on disk and Triton's binaries too (ikbo_backend/tuning.py), so a restart times
and compiles nothing: it reads the choices and loads the chosen kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from dataclasses import dataclass

import torch

from kernels import attention as attention_op
from kernels import ikbo_linear_compress, ikbo_self_target_attention
from kernels import linear_compress as lce_op
from kernels.attention import TRITON_HEAD_DIMS, pick_config
from kernels.attention import TRITON_TYPES as ATTENTION_TRITON_TYPES
from kernels.linear_compress import TRITON_TYPES as LCE_TRITON_TYPES
from kernels.linear_compress import PackedLinearCompress, default_variant, tile_configs
from kernels.reference import rel_err

from .ranker import RankerConfig
from .requests import ShapeRanges
from .tuning import (
    FORMAT,
    Candidate,
    TuningCache,
    cached_entries,
    device_description,
    fastest,
    graph_median_ms,
    median_ms,
    use_persistent_triton_cache,
)

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
    lies below): tests/test_shape_spec.py checks."""
    low, high = ranges.candidates
    counts = set(range(low, min(high, EXHAUSTIVE_CANDIDATES) + 1))
    for base in range(EXHAUSTIVE_CANDIDATES - EXHAUSTIVE_CANDIDATES % 16, high + 2, 16):
        counts.update(b for b in (base - 1, base, base + 1) if low <= b <= high)
    return sorted(counts)


@functools.cache
def shape_buckets(
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


def bucket_representatives(
    cfg: RankerConfig, ranges: ShapeRanges, device, dtype: torch.dtype = torch.float32, graphs: bool = False
) -> list[tuple[int, int]]:
    """(U, B) to warm up at so that every bucket of every op has run once on `device`. On a GPU,
    first `tune_buckets` (read from the disk cache after the first load; `graphs`: the model replays
    CUDA graphs), so that the warm-up runs, and compiles, the kernels the requests will launch."""
    if torch.device(device).type == "cuda":
        tune_buckets(cfg, ranges, device, dtype, graphs=graphs)
    buckets = shape_buckets(cfg, ranges, dtype, device_sms(device))
    return list(dict.fromkeys(b.representative for op in OPS for b in buckets[op]))


# ----------------------------------------------------------------------------- tuning per bucket

# Attention tiles besides pick_config's: the TUNE_CONFIGS of scripts/bench_attention.py (docs/notes/attention.md).
ATTENTION_CONFIGS = (
    attention_op.TileConfig(128, 64, 8, 3),
    attention_op.TileConfig(128, 32, 8, 4, maxnreg=128),
    attention_op.TileConfig(64, 64, 4, 2),
    attention_op.TileConfig(64, 32, 4, 3),
)
TOLERANCE = {torch.float32: 2e-3, torch.float16: 2e-2, torch.bfloat16: 2e-2}  # vs fp64; fp32 runs tf32 (≈ 3e-4)


@dataclass(frozen=True)
class Tuned:
    """The configuration chosen for one bucket of one op."""

    choice: object  # lce: (variant, linear_compress.TileConfig); attention: attention.TileConfig; None: heuristics
    shape: tuple[int, int]  # (U, B) it was timed at
    ms: dict  # candidate label → best median ms of its timing rounds, or why it was dropped


def _lce_label(variant, tile) -> str:
    if tile is None:  # s6: its WSConfig default (kernels/linear_compress_ws.py)
        return f"{variant} warp-specialized (Gluon)"
    split = " split" if tile.epilogue_split else ""
    return f"{variant} {tile.block_m}x{tile.block_d}x{tile.block_k} w{tile.num_warps} s{tile.num_stages}{split}"


def _attention_label(tile) -> str:
    if tile == attention_op.WS_CHOICE:
        return "warp-specialized (Gluon)"
    regs = f" r{tile.maxnreg}" if tile.maxnreg else ""
    return f"{tile.block_m}x{tile.block_n} w{tile.num_warps} s{tile.num_stages}{regs}"


def lce_candidates(
    cfg: RankerConfig, key: tuple, dtype: torch.dtype, hopper: bool = False, graphs: bool = False
) -> list[tuple[str, object]]:
    """(variant, tile) to try for the LCE bucket `key`: the s3 bucket s3's configs; the s4 bucket s4's
    and s3's (either compiles one kernel per config for any U, B), s3's only for a model that replays
    CUDA graphs (`graphs`: inside a capture s4 runs as s3); on a Hopper GPU in 16-bit also s6 (tile
    None: its own config; one kernel for any U, B; graph-safe)."""
    variants = ("s4", "s3") if key[0] == "s4" else (key[0],)
    if graphs:
        variants = tuple(v for v in variants if v != "s4")
    candidates = [
        (variant, tile)
        for variant in variants
        for tile in dict.fromkeys(tile_configs(variant, dtype, cfg.embedding_dim))
    ]
    if hopper and dtype in (torch.float16, torch.bfloat16):
        candidates.append((lce_op.WS_VARIANT, None))
    return candidates


def _is_hopper(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def attention_candidates(cfg: RankerConfig, key: tuple, dtype: torch.dtype | None = None, hopper: bool = False) -> list:
    """Tiles to try for an attention bucket: `pick_config`'s and ATTENTION_CONFIGS with BLOCK_N |
    BLOCK_M (causal self tiles need it); on a Hopper GPU in 16 bit with d ∈ {64, 128} also the Gluon
    warp-specialized kernel (`attention_op.WS_CHOICE`: self and target tiles in one launch; one kernel
    for any U, B; graph-safe)."""
    tiles = [pick_config(rows, interpret=False) for rows in (64, 65)] + list(ATTENTION_CONFIGS)
    tiles = [t for t in dict.fromkeys(tiles) if t.block_m % t.block_n == 0]
    if hopper and dtype in (torch.float16, torch.bfloat16) and cfg.head_dim in (64, 128):
        tiles.append(attention_op.WS_CHOICE)
    return tiles


def _tune_lce(cfg: RankerConfig, key: tuple, shape, dtype, device, timer, graphs: bool) -> dict:
    num_users, num_candidates = shape
    ku, kc, n, d = cfg.user_tokens, cfg.cand_tokens, cfg.compressed_tokens, cfg.embedding_dim
    user_emb = torch.randn(num_users, ku, d, dtype=dtype, device=device)  # [U, Ku, D]
    cand_emb = torch.randn(num_candidates, kc, d, dtype=dtype, device=device)  # [B, Kc, D]
    cand_to_user = torch.randint(0, num_users, (num_candidates,), dtype=torch.int32, device=device)  # as served
    weight = torch.randn(n, ku + kc, dtype=dtype, device=device) / math.sqrt(ku + kc)  # [N, Ku + Kc]
    bias = torch.randn(n, dtype=dtype, device=device)
    ref = ikbo_linear_compress(
        user_emb.double(), cand_emb.double(), cand_to_user, weight.double(), bias.double(), backend="torch"
    )
    packed = PackedLinearCompress.from_weight(weight, ku, bias)
    out = torch.empty(num_candidates, n, d, dtype=dtype, device=device)  # [B, N, D]
    user_part = torch.empty(num_users, n, d, dtype=dtype, device=device)  # Y_u [U, N, D]: no allocation per timed call

    def candidate(variant, tile):
        def run():
            return packed._triton(user_emb, cand_emb, cand_to_user, variant, config=tile, out=out, user_part=user_part)

        def check():
            out.fill_(float("nan"))
            return rel_err(run(), ref) <= TOLERANCE[dtype]

        choice = {"variant": variant, "tile": None if tile is None else dataclasses.asdict(tile)}
        return Candidate(_lce_label(variant, tile), choice, check, run)

    hopper = _is_hopper(torch.device(device))
    return fastest([candidate(v, t) for v, t in lce_candidates(cfg, key, dtype, hopper, graphs)], timer)


def _tune_attention(cfg: RankerConfig, key: tuple, shape, dtype, device, timer, graphs: bool) -> dict:
    """(`graphs` leaves the candidates as they are: every attention candidate runs as itself in a capture.)"""
    num_users, num_candidates = shape
    heads, seq_len, queries, head_dim = cfg.heads, cfg.history_length, cfg.query_tokens, cfg.head_dim
    user_q, k, v = (
        torch.randn(num_users, heads, seq_len, head_dim, dtype=dtype, device=device) for _ in range(3)
    )  # [U, H, L, d]
    cand_q = torch.randn(num_candidates, heads, queries, head_dim, dtype=dtype, device=device)  # [B, H, S, d]
    cand_to_user = torch.randint(0, num_users, (num_candidates,), dtype=torch.int32, device=device)
    kv_len = torch.randint(0, seq_len + 1, (num_users,), dtype=torch.int32, device=device)
    kv_len[0] = seq_len  # one full history
    ref_user, ref_cand = ikbo_self_target_attention(
        user_q.double(), cand_q.double(), k.double(), v.double(), cand_to_user, kv_len, backend="torch"
    )
    out, user_out = torch.empty_like(cand_q), torch.empty_like(user_q)

    def candidate(tile):
        def run():
            return attention_op._launch(
                cand_q,
                k,
                v,
                cand_to_user,
                kv_len,
                1 / math.sqrt(head_dim),
                user_q,
                True,
                config=tile,
                out=out,
                user_out=user_out,
            )

        def check():
            out.fill_(float("nan"))
            user_out.fill_(float("nan"))
            cand_got, user_got, _ = run()
            return max(rel_err(cand_got, ref_cand), rel_err(user_got, ref_user)) <= TOLERANCE[dtype]

        choice = (
            {"tile": None, "kernel": tile} if tile == attention_op.WS_CHOICE else {"tile": dataclasses.asdict(tile)}
        )
        return Candidate(_attention_label(tile), choice, check, run)

    return fastest(
        [candidate(t) for t in attention_candidates(cfg, key, dtype, _is_hopper(torch.device(device)))], timer
    )


TUNERS = {"lce": _tune_lce, "attention": _tune_attention}


def _dims(cfg: RankerConfig, op: str) -> tuple[int, int, int, int]:
    """The model dims an op's kernels see: lce (Ku, Kc, N, D), attention (H, L, S, d)."""
    if op == "lce":
        return cfg.user_tokens, cfg.cand_tokens, cfg.compressed_tokens, cfg.embedding_dim
    return cfg.heads, cfg.history_length, cfg.query_tokens, cfg.head_dim


def _decode(op: str, choice):
    """A cache entry's choice → what `set_tuned_configs` takes; None for none (or an unreadable one)."""
    if choice is None:
        return None
    try:
        if op == "lce":
            tile = choice["tile"]
            return choice["variant"], None if tile is None else lce_op.TileConfig(**tile)
        if choice.get("kernel") == attention_op.WS_CHOICE:
            return attention_op.WS_CHOICE
        return attention_op.TileConfig(**choice["tile"])
    except (KeyError, TypeError) as e:
        warnings.warn(f"tuned {op} config {choice} unreadable ({e!r}); the kernel's heuristics are used", stacklevel=2)
        return None


def tune_buckets(
    cfg: RankerConfig,
    ranges: ShapeRanges,
    device,
    dtype: torch.dtype = torch.float32,
    *,
    num_sms: int | None = None,
    cache: TuningCache | None = None,
    timer=None,
    graphs: bool = False,
) -> dict[str, dict[tuple, Tuned]]:
    """Tune every Triton bucket of every op on `device` (see the module docstring) and make the
    public ops use the choices: op → {bucket key: Tuned}. Choices come from `cache` (default:
    .cache/ikbo-tuning/tuned_configs.json) where it holds them, else `timer(fn)` → ms times the
    candidates and the cache keeps the result. `graphs`: the model replays CUDA graphs, so the
    candidates are timed as graph replays (default timer `graph_median_ms`, else `median_ms`) and
    those that do not run as themselves inside a capture (s4) are left out; the cache keys the two
    apart. `num_sms` overrides the device's SM count (the interpreter tests). Nothing to do on a CPU
    (every op runs torch there): {}."""
    timer = timer or (graph_median_ms if graphs else median_ms)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    num_sms = device_sms(device) if num_sms is None else num_sms
    if num_sms is None:
        return {}
    use_persistent_triton_cache()  # before this process's first compilation (below, or the warm-up)
    cache = TuningCache() if cache is None else cache
    buckets = shape_buckets(cfg, ranges, dtype, num_sms)
    where, jobs = {}, {}
    for op in OPS:
        for bucket in buckets[op]:
            if bucket.key == ("torch",):
                continue
            dims = ",".join(map(str, _dims(cfg, op)))
            mode = "graphs" if graphs else "eager"
            key = f"v{FORMAT}|{device_description(device)}|{op}|{str(dtype).removeprefix('torch.')}|{dims}|{bucket.key}|{mode}"
            where[key] = (op, bucket)
            jobs[key] = functools.partial(_job, op, cfg, bucket, dtype, device, timer, graphs)
    tables: dict[str, dict[tuple, Tuned]] = {op: {} for op in OPS}
    for key, entry in cached_entries(cache, jobs).items():
        op, bucket = where[key]
        tables[op][bucket.key] = Tuned(_decode(op, entry["choice"]), tuple(entry["shape"]), entry["ms"])
    for op, table in tables.items():
        if table:
            _register(op, cfg, dtype, device, num_sms, {key: tuned.choice for key, tuned in table.items()})
    return tables


def _job(op, cfg, bucket, dtype, device, timer, graphs) -> dict:
    """A cache entry: the timed candidates at the bucket's largest (U, B)."""
    return {"shape": list(bucket.largest), **TUNERS[op](cfg, bucket.key, bucket.largest, dtype, device, timer, graphs)}


def _register(op: str, cfg: RankerConfig, dtype, device, num_sms: int, choices: dict) -> None:
    """Have the public op launch choices[its bucket key at (U, B)] (the kernel's heuristics where absent)."""
    key_of = KEYS[op]

    def lookup(num_users, num_candidates):
        return choices.get(key_of(cfg, num_users, num_candidates, dtype, num_sms))

    setter = lce_op.set_tuned_configs if op == "lce" else attention_op.set_tuned_configs
    setter(device, dtype, _dims(cfg, op), lookup)
