"""Load-time autotuning of the Triton kernels per shape bucket (ikbo_backend/kernel_buckets.py).

`bucket_representatives`, run by every served model at load (ikbo_backend/stages.py): on a GPU it first runs
`tune_buckets`, then returns the (U, B) to warm up at, so that the warm-up runs, and compiles, the kernels the
requests will launch. `tune_buckets`: per op and bucket, the candidate configurations are timed at the bucket's
largest (U, B) (its heaviest load; at the smallest one every candidate is launch-bound) with fresh random inputs,
each first checked against the fp64 torch path on poisoned outputs, and the fastest correct one (`fastest`) is
what the public ops launch for every (U, B) of the bucket (kernels.configs.set_tuned_configs; the kernels'
heuristics where nothing is tuned). Candidates: lce, the fused bucket fused's `tile_configs`, the persistent
bucket persistent's and fused's, plus warp_specialized (Gluon, one kernel for any U, B) on a Hopper GPU in 16-bit;
attention, `pick_config`'s and ATTENTION_CONFIGS with BLOCK_N | BLOCK_M, plus the Gluon kernel (`WS_CHOICE`) on
Hopper. A model that replays CUDA graphs (`cuda_graphs`) times them as graph replays, as it runs them (an eager
timing counts the host's launch time, which a replay does not pay), and without persistent (inside a capture it
runs as fused). Choices are cached on disk and Triton's binaries too (ikbo_backend/tuning_cache.py), so a restart
times and compiles nothing: it reads the choices and loads the chosen kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton

from kernels import attention as attention_op
from kernels import ikbo_linear_compress, ikbo_self_target_attention
from kernels import linear_compress as lce_op
from kernels.attention import pick_config
from kernels.configs import TileConfig, set_tuned_configs
from kernels.linear_compress import PackedLinearCompress, tile_configs
from kernels.reference import rel_err

from .kernel_buckets import KEYS, OPS, device_sms, kernel_buckets, op_dims
from .ranker import RankerConfig
from .requests import ShapeRanges
from .tuning_cache import TuningCache, cached_entries, entry_key, use_persistent_triton_cache

WARMUP_MS, REP_MS = 10, 40  # triton.testing.do_bench per candidate: ≥ 40 runs of a ≤ 1 ms kernel
ROUNDS = 2  # timings of each candidate (in alternating order); the best median counts
# Attention tiles besides pick_config's (docs/design/attention.md)
ATTENTION_CONFIGS = (
    TileConfig(128, 64, num_warps=8, num_stages=3),
    TileConfig(128, 32, num_warps=8, num_stages=4, maxnreg=128),
    TileConfig(64, 64, num_warps=4, num_stages=2),
    TileConfig(64, 32, num_warps=4, num_stages=3),
)
TOLERANCE = {torch.float32: 2e-3, torch.float16: 2e-2, torch.bfloat16: 2e-2}  # vs fp64; fp32 runs tf32 (≈ 3e-4)


# ----------------------------------------------------------------------------- timing and the choice


def median_ms(fn) -> float:
    """Median time of `fn` in ms (CUDA events, L2 flushed between runs): for a model that runs eagerly,
    where a call's host launch time counts whenever it exceeds the device time."""
    return triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")


def graph_median_ms(fn) -> float:
    """Median time of `fn` in ms as CUDA-graph replays: for a model that replays its kernels from CUDA
    graphs, where the host's launch time does not count (and `fn` runs as it does under capture)."""
    return triton.testing.do_bench_cudagraph(fn, rep=REP_MS, return_mode="median")


@dataclass(frozen=True)
class Candidate:
    """One configuration to try: `check()` launches it on poisoned outputs and says whether the
    result matches the reference; `run()` is the launch that gets timed; `choice` is what the cache
    stores (JSON) when it wins."""

    label: str
    choice: dict
    check: Callable[[], bool]
    run: Callable[[], object]


def fastest(candidates, timer=median_ms, rounds: int = ROUNDS) -> dict:
    """→ {"choice": the fastest correct candidate's choice or None, "ms": {label: ms, or why dropped}}.
    A candidate that raises when checked (Triton OutOfResources, a compilation error, anything) is
    dropped, with the exception's type as its entry in "ms".
    All are checked (and so compiled) first, then timed back to back, `rounds` times in alternating
    order, each keeping its best median: no compilation pause between timings (the clocks stay up),
    and no candidate always comes first."""
    ms, correct = {}, []
    for candidate in candidates:
        try:
            passed = candidate.check()
        except Exception as e:
            ms[candidate.label] = f"dropped: {type(e).__name__}"
            continue
        if passed:
            correct.append(candidate)
        else:
            ms[candidate.label] = "dropped: wrong result"
    for round_ in range(rounds):
        for candidate in correct if round_ % 2 == 0 else correct[::-1]:
            ms[candidate.label] = min(float(timer(candidate.run)), ms.get(candidate.label, math.inf))
    best = min(correct, key=lambda c: ms[c.label], default=None)
    return {"choice": None if best is None else best.choice, "ms": ms}


# ----------------------------------------------------------------------------- candidates per op and bucket


@dataclass(frozen=True)
class Tuned:
    """The configuration chosen for one bucket of one op."""

    choice: object  # lce: (variant, TileConfig or None); attention: TileConfig or WS_CHOICE; None: heuristics
    shape: tuple[int, int]  # (U, B) it was timed at
    ms: dict  # candidate label → best median ms of its timing rounds, or why it was dropped


def _lce_label(variant, tile) -> str:
    if tile is None:  # warp_specialized: its WSConfig default (kernels/linear_compress_ws.py)
        return f"{variant} (Gluon)"
    split = " split" if tile.epilogue_split else ""
    return f"{variant} {tile.block_m}x{tile.block_n}x{tile.block_k} w{tile.num_warps} s{tile.num_stages}{split}"


def _attention_label(tile) -> str:
    if tile == attention_op.WS_CHOICE:
        return f"{attention_op.WS_CHOICE} (Gluon)"
    regs = f" r{tile.maxnreg}" if tile.maxnreg else ""
    return f"{tile.block_m}x{tile.block_n} w{tile.num_warps} s{tile.num_stages}{regs}"


def lce_candidates(
    cfg: RankerConfig, key: tuple, dtype: torch.dtype, hopper: bool = False, graphs: bool = False
) -> list[tuple[str, object]]:
    """(variant, tile) to try for the LCE bucket `key`: the fused bucket fused's configs; the persistent bucket
    persistent's and fused's (either compiles one kernel per config for any U, B), fused's only for a model that
    replays CUDA graphs (`graphs`: inside a capture persistent runs as fused); on a Hopper GPU in 16-bit also
    warp_specialized (tile None: its own config; one kernel for any U, B; graph-safe)."""
    variants = ("persistent", "fused") if key[0] == "persistent" else (key[0],)
    if graphs:
        variants = tuple(v for v in variants if v != "persistent")
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


def _decode(op: str, choice):
    """A cache entry's choice → what `set_tuned_configs` takes; None for none (or an unreadable one)."""
    if choice is None:
        return None
    try:
        if op == "lce":
            tile = choice["tile"]
            return choice["variant"], None if tile is None else TileConfig(**tile)
        if choice.get("kernel") == attention_op.WS_CHOICE:
            return attention_op.WS_CHOICE
        return TileConfig(**choice["tile"])
    except (KeyError, TypeError) as e:
        warnings.warn(f"tuned {op} config {choice} unreadable ({e!r}); the kernel's heuristics are used", stacklevel=2)
        return None


# ----------------------------------------------------------------------------- tuning every bucket


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
    those that do not run as themselves inside a capture (persistent) are left out; the cache keys the two
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
    buckets = kernel_buckets(cfg, ranges, dtype, num_sms)
    where, jobs = {}, {}
    for op in OPS:
        for bucket in buckets[op]:
            if bucket.key == ("torch",):
                continue
            dims = ",".join(map(str, op_dims(cfg, op)))
            mode = "graphs" if graphs else "eager"
            key = entry_key(device, op, str(dtype).removeprefix("torch."), dims, bucket.key, mode)
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

    set_tuned_configs(op, device, dtype, op_dims(cfg, op), lookup)


def bucket_representatives(
    cfg: RankerConfig, ranges: ShapeRanges, device, dtype: torch.dtype = torch.float32, graphs: bool = False
) -> list[tuple[int, int]]:
    """(U, B) to warm up at so that every bucket of every op has run once on `device`. On a GPU,
    first `tune_buckets` (read from the disk cache after the first load; `graphs`: the model replays
    CUDA graphs), so that the warm-up runs, and compiles, the kernels the requests will launch."""
    if torch.device(device).type == "cuda":
        tune_buckets(cfg, ranges, device, dtype, graphs=graphs)
    buckets = kernel_buckets(cfg, ranges, dtype, device_sms(device))
    return list(dict.fromkeys(b.representative for op in OPS for b in buckets[op]))
