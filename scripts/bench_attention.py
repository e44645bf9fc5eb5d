#!/usr/bin/env python3
"""IKBO attention benchmark: providers side by side at the canonical shape, self + target, then the sweep.

    scripts/bench_attention.py [--sweep full|corners|none] [--no-flex] [--only PREFIX,...] [--smoke]

Canonical shape (CANONICAL), bf16, non-causal target attention: B=1024 candidates, S=64 query tokens each, U=15
users with ragged counts, L=1024, H=4, d=128. The baseline replicates K/V to B rows for SDPA; packed SDPA needs
equal counts (B' = U·round(B/U)); ours as dispatched is the Gluon kernel of kernels/attention_ws.py where
`prefer_ws`, else the Triton kernel. Self + target: causal self-attention of U×L and the target attention over the
same K/V, apart against fused. Sweep (SWEEP, or CORNERS): the baseline against ours. References: the baseline's
formulas in fp64. Kernels compile first in worker processes. Checking, timing, floor, tables
($OUT/attention_bench.md): ikbo_backend/perf/harness.py.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, replace
from functools import partial

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before kernels is imported: Triton builds the kernels at import

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ikbo_backend.perf.harness import Bench, Case, Provider, argument_parser, nan_like
from kernels import attention, attention_ws, ikbo_attention, ikbo_self_target_attention


@dataclass(frozen=True)
class Shape:
    num_users: int  # U
    num_candidates: int  # B
    num_queries: int  # S
    seq_len: int  # L
    heads: int  # H
    head_dim: int  # d

    def flops(self, target=True, causal_self=False) -> float:
        """4·B·H·S·L·d of the target attention + 4·U·H·L(L+1)/2·d of the causal self-attention (where asked)."""
        pairs = target * self.num_candidates * self.num_queries * self.seq_len  # query-key pairs per head
        pairs += causal_self * self.num_users * self.seq_len * (self.seq_len + 1) / 2
        return 4.0 * self.heads * self.head_dim * pairs

    def min_bytes(self, itemsize: int, with_self=False) -> float:
        """q and out once, K/V once per user (and user_q, user_out with self-attention)."""
        rows = 2 * self.num_candidates * self.num_queries + (4 if with_self else 2) * self.num_users * self.seq_len
        return float(itemsize * self.heads * self.head_dim * rows)


CANONICAL = Shape(15, 1024, 64, 1024, 4, 128)
SMOKE_CANONICAL = Shape(3, 10, 5, 40, 2, 16)
SWEEP_CANDIDATES = 1024
# (S, L, d, B/U) at B = SWEEP_CANDIDATES, H = 4; CORNERS: the sweep's extremes and its slowest points
SWEEP = [(s, n, d, r) for s in (1, 8, 64) for n in (256, 1024, 4096) for d in (64, 128) for r in (1, 16, 70, 256)]
CORNERS = [(1, 256, 64, 256), (8, 256, 64, 1), (8, 256, 64, 16), (64, 256, 64, 256), (1, 4096, 128, 1)]
CORNERS += [(64, 4096, 128, 70)]
SMOKE_SWEEP = [Shape(2, 8, 8, 20, 2, 32)]
CHECKED_HEAD = 256  # sweep: candidates checked against fp64
TOL = 1e-2
BASELINE, OURS, DISPATCHED = "baseline (index_select + SDPA)", "ours: public op", "ours: plan + kernel as dispatched"
APART = "apart: SDPA causal self + our target as dispatched"


def make_problem(shape: Shape, device, dtype, seed: int, counts=None, with_user_q=False) -> dict:
    """Fresh random q [B, H, S, d], k, v (and user_q) [U, H, L, d], never zeros, and a shuffled mapping with the
    given counts (default ragged: weights 1/(u+1)^0.7, every user at least one candidate when B ≥ U)."""
    if counts is None:
        weights = torch.tensor([1.0 / (u + 1) ** 0.7 for u in range(shape.num_users)])
        counts = torch.floor(weights / weights.sum() * shape.num_candidates).long()
        counts = counts.clamp(min=1) if shape.num_candidates >= shape.num_users else counts
        while counts.sum() > shape.num_candidates:
            counts[counts.argmax()] -= 1
        counts[0] += shape.num_candidates - counts.sum()
    cpu_gen, gen = torch.Generator().manual_seed(seed), torch.Generator(device=device).manual_seed(seed)
    mapping = torch.repeat_interleave(torch.arange(shape.num_users), counts)
    mapping = mapping[torch.randperm(mapping.shape[0], generator=cpu_gen)].to(device)
    user = (shape.num_users, shape.heads, shape.seq_len, shape.head_dim)
    sizes = dict(q=(mapping.shape[0], shape.heads, shape.num_queries, shape.head_dim), k=user, v=user)
    if with_user_q:
        sizes["user_q"] = user
    p = {name: torch.randn(*size, generator=gen, device=device, dtype=dtype) for name, size in sizes.items()}
    return dict(p, cand_to_user=mapping, counts=counts, scale=1 / math.sqrt(shape.head_dim))


def baseline(p: dict, head=None, dtype=None) -> torch.Tensor:
    """SDPA over K/V replicated to the (first `head`) candidates' rows, in `dtype` (the fp64 reference)."""
    rows, dtype = p["cand_to_user"][:head], dtype or p["q"].dtype
    k, v = (p[n].index_select(0, rows).to(dtype) for n in ("k", "v"))
    return F.scaled_dot_product_attention(p["q"][:head].to(dtype), k, v)


def dispatched(p: dict, out=None, plan=None) -> torch.Tensor:
    """Plan + target-attention kernel as the public op dispatches them, without its input checks; with `plan` (for
    the dispatched kernel's block rows) the kernel alone."""
    args = (p["q"], p["k"], p["v"], p["cand_to_user"], None, p["scale"])
    if plan is not None and attention_ws.prefer_ws(p["q"], p["k"]):
        return attention_ws.launch_ws(*args, out=out, plan=plan)[0]
    return attention._launch(*args, out=out, plan=plan)[0]


def triton_config(p: dict) -> attention.TileConfig:
    """The Triton kernel's tiles for the target attention of `p` (by query rows per user)."""
    return attention.pick_config(p["q"].shape[0] * p["q"].shape[2] / p["k"].shape[0], attention.interpreting())


def core_providers(p: dict) -> dict[str, Provider]:
    """The sweep's providers: the baseline, the public op, plan + kernel as dispatched."""
    q, k, v, m = p["q"], p["k"], p["v"], p["cand_to_user"]
    note = "input checks, one device sync; as served in CUDA graphs"
    return {
        BASELINE: Provider(lambda: baseline(p), graph=True, host=True, note="replication timed"),
        OURS: Provider(lambda: ikbo_attention(q, k, v, m, backend="triton"), graph=True, host=True, note=note),
        DISPATCHED: Provider(lambda: dispatched(p), lambda: dispatched(p, nan_like(q)), host=True),
    }


def packed_providers(shape: Shape, device, dtype) -> dict[str, Provider]:
    """SDPA over each user's candidates packed into one query sequence [U, H, c·S, d]: equal counts, own problem."""
    per_user = round(shape.num_candidates / shape.num_users)
    eq_shape = replace(shape, num_candidates=per_user * shape.num_users)
    eq = make_problem(eq_shape, device, dtype, 2, counts=torch.full((shape.num_users,), per_user))
    order = torch.argsort(eq["cand_to_user"], stable=True)
    packed_q = eq["q"][order].unflatten(0, (shape.num_users, per_user)).transpose(1, 2).flatten(2, 3)

    def run(backend):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(packed_q, eq["k"], eq["v"])

    def unpacked(fn):  # [U, H, c·S, d] → [B', H, S, d] in candidate order
        res = torch.empty_like(eq["q"])
        res[order] = fn().unflatten(2, (per_user, shape.num_queries)).transpose(1, 2).flatten(0, 1)
        return res

    ref = baseline(eq, dtype=torch.float64)
    backends = dict(flash=SDPBackend.FLASH_ATTENTION, cuDNN=SDPBackend.CUDNN_ATTENTION)
    fns = {f"packed SDPA, {name} ({per_user}/user)": partial(run, backend) for name, backend in backends.items()}
    return {name: Provider(fn, partial(unpacked, fn), ref, eq_shape.flops(), optional=True) for name, fn in fns.items()}


def flex_provider(p: dict, shape: Shape) -> Provider:
    """FlexAttention over the flattened user-sorted queries [1, H, B·S, d] and all users' keys [1, H, U·L, d]."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    order = torch.argsort(p["cand_to_user"], stable=True)
    q_user = p["cand_to_user"][order].repeat_interleave(shape.num_queries).int()
    kv_user = torch.arange(shape.num_users, device=q_user.device).repeat_interleave(shape.seq_len).int()
    q, k, v = (t.transpose(0, 1).flatten(1, 2)[None] for t in (p["q"][order], p["k"], p["v"]))
    mask = create_block_mask(lambda b, h, i, j: q_user[i] == kv_user[j], None, None, q.shape[2], k.shape[2], q.device)
    run = partial(torch.compile(flex_attention), q, k, v, block_mask=mask)

    def unflattened():  # [1, H, B·S, d] → [B, H, S, d] in candidate order
        res = torch.empty_like(p["q"])
        res[order] = run()[0].unflatten(1, (-1, shape.num_queries)).transpose(0, 1)
        return res

    return Provider(run, unflattened, optional=True, note="block mask, ragged")


def canonical_cases(shape: Shape, device, dtype, with_flex: bool) -> list[Case]:
    """Target attention, then self + target, on one problem."""
    p = make_problem(shape, device, dtype, 1, with_user_q=True)
    q, k, v, m, user_q, scale = p["q"], p["k"], p["v"], p["cand_to_user"], p["user_q"], p["scale"]
    user_ref = F.scaled_dot_product_attention(*(t.double() for t in (user_q, k, v)), is_causal=True)
    cand_ref, itemsize = baseline(p, dtype=torch.float64), q.element_size()
    k_rep, v_rep = k.index_select(0, m), v.index_select(0, m)
    block_m = attention_ws.TILE_M if attention_ws.prefer_ws(q, k) else triton_config(p).block_m  # as dispatched
    plan = attention.plan_tiles(m, shape.num_users, shape.num_queries, block_m)
    triton = partial(attention._launch, q, k, v, m, None, scale, config=triton_config(p))  # a config: never Gluon
    target = {
        **core_providers(p),
        "SDPA on K/V replicated beforehand": Provider(lambda: F.scaled_dot_product_attention(q, k_rep, v_rep)),
        **packed_providers(shape, device, dtype),
        **({"FlexAttention": flex_provider(p, shape)} if with_flex else {}),
        "ours: kernel as dispatched, plan given": Provider(
            partial(dispatched, p, plan=plan), lambda: dispatched(p, nan_like(q), plan)
        ),
        "ours: plan + Triton kernel": Provider(lambda: triton()[0], lambda: triton(out=nan_like(q))[0]),
    }
    fused = partial(attention._launch, q, k, v, m, None, scale, user_q)
    self_sdpa = partial(F.scaled_dot_product_attention, user_q, k, v, is_causal=True)

    def poisoned(launch):  # (user_out, out) of a fused launch into NaN-filled buffers
        out, user_out, _ = launch(out=nan_like(q), user_out=nan_like(user_q))
        return user_out, out

    both = {
        "self: SDPA is_causal": Provider(self_sdpa, ref=user_ref, flops=shape.flops(False, True)),
        DISPATCHED: Provider(lambda: dispatched(p), lambda: dispatched(p, nan_like(q)), cand_ref, shape.flops()),
        APART: Provider(
            lambda: (self_sdpa(), dispatched(p)), lambda: (self_sdpa(), dispatched(p, nan_like(q))), graph=True
        ),
        "fused: plan + one launch, as dispatched": Provider(fused, lambda: poisoned(fused), graph=True),
        "fused: public op": Provider(
            partial(ikbo_self_target_attention, user_q, q, k, v, m, backend="triton"), host=True
        ),
    }
    runs = "the Gluon kernel" if attention_ws.prefer_ws(q, k) else "the Triton kernel"
    title = f"Target attention, {shape}, counts {p['counts'].tolist()}, non-causal; as dispatched: {runs}"
    self_title = f"Self (causal, U×L) + target attention, {shape}; × baseline: apart / fused"
    return [
        Case(target, cand_ref, shape.flops(), shape.min_bytes(itemsize), BASELINE, title),
        Case(both, (user_ref, cand_ref), shape.flops(True, True), shape.min_bytes(itemsize, True), APART, self_title),
    ]


def sweep_case(shape: Shape, device, dtype) -> Case:
    p = make_problem(shape, device, dtype, 4)
    ref = baseline(p, CHECKED_HEAD, torch.float64)
    return Case(core_providers(p), ref, shape.flops(), shape.min_bytes(p["q"].element_size()))


def main(argv=None):
    parser = argument_parser(__doc__)
    parser.add_argument("--sweep", choices=("full", "corners", "none"), default="full")
    parser.add_argument("--no-flex", action="store_true", help="leave out FlexAttention")
    args = parser.parse_args(argv)
    bench = Bench("attention_bench", args.smoke, args.only)
    dtype = torch.float16 if args.smoke else torch.bfloat16  # Triton 3.6's interpreter gets bf16 dots wrong
    shape, device = SMOKE_CANONICAL if args.smoke else CANONICAL, bench.device
    with_flex = not (args.no_flex or args.smoke)  # torch.compile on the CPU: minutes
    points = {"full": SWEEP, "corners": CORNERS, "none": []}[args.sweep]
    shapes = [Shape(SWEEP_CANDIDATES // ratio, SWEEP_CANDIDATES, s, length, 4, d) for s, length, d, ratio in points]
    shapes = SMOKE_SWEEP if args.smoke and shapes else shapes
    setups = [partial(sweep_case, s, device, dtype) for s in shapes]
    bench.precompile([partial(canonical_cases, shape, device, dtype, with_flex), *setups])
    for case in canonical_cases(shape, device, dtype, with_flex):
        bench.table(case, TOL)
    case = None  # its tensors go before the sweep's
    if setups:
        params = [dict(S=s.num_queries, L=s.seq_len, d=s.head_dim, U=s.num_users) for s in shapes]
        title = f"Sweep (non-causal target, B={shapes[0].num_candidates}, ragged counts; first {CHECKED_HEAD} checked)"
        bench.sweep(title, zip(params, setups), [BASELINE, OURS, DISPATCHED], TOL)
    bench.finish()


if __name__ == "__main__":
    main(sys.argv[1:])
