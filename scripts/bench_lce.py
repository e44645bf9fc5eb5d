#!/usr/bin/env python3
"""IKBO linear compression benchmark: providers side by side at the canonical shape, then the B/U sweep.

    scripts/bench_lce.py [--no-sweep] [--candidates 64,1024,16384] [--ratios 1,4,16,70,256,1024] [--graph]
                         [--no-compile] [--no-ws] [--only PREFIX,...] [--smoke]

Canonical shape (CANONICAL), bf16: B=1024 candidates, U=15 users with ragged counts (unsorted mapping), Ku=1024,
Kc=500, D=256, N=512; FLOPs 2·N·D·(U·Ku + B·Kc), the IKBO work. Providers: S0 eager (the baseline: user_emb
replicated to B rows, concatenated along K, one batched matmul), torch.compile(S0), S1 eager (the op's torch path:
two GEMMs and the gathered add), torch.compile(S1), the Triton variants without the op's input checks
(kernels/linear_compress.py), warp_specialized (the Gluon kernel, kernels/linear_compress_ws.py; Hopper) and
the public op (input checks, the default variant). The reference is S0 in fp64.
Sweep: B in --candidates, B/U in --ratios (U = round(B / ratio), at least 1): S0 against fused, persistent, warp_specialized and the public
op, checked on the first CHECKED_HEAD candidates; --graph adds CUDA-graph replays up to B = 1024.
Checking, timing, floor, tables ($OUT/lce_bench.md): ikbo_backend/perf/harness.py.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace
from functools import partial

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before kernels is imported: Triton builds the kernels at import

import torch

from ikbo_backend.perf.harness import Bench, Case, Provider, argument_parser, nan_like
from kernels.linear_compress import VARIANTS, WS_VARIANT, PackedLinearCompress
from kernels.linear_compress_ws import ws_supported


@dataclass(frozen=True)
class Shape:
    num_users: int  # U
    num_candidates: int  # B
    ku: int  # user tokens
    kc: int  # candidate tokens
    dim: int  # D
    rows: int  # N

    def flops(self) -> float:
        return 2.0 * self.rows * self.dim * (self.num_users * self.ku + self.num_candidates * self.kc)

    def min_bytes(self, elem: int) -> float:
        """Each input read once, the output written once (the mapping in int32)."""
        users, cands = self.num_users * self.ku * self.dim, self.num_candidates * self.kc * self.dim
        weights, out = self.rows * (self.ku + self.kc + 1), self.num_candidates * self.rows * self.dim
        return float(elem * (users + cands + weights + out) + 4 * self.num_candidates)


CANONICAL = Shape(num_users=15, num_candidates=1024, ku=1024, kc=500, dim=256, rows=512)
SMOKE_CANONICAL = Shape(num_users=3, num_candidates=12, ku=20, kc=13, dim=32, rows=24)
SWEEP_CANDIDATES = (64, 1024, 16384)
SMOKE_SWEEP_CANDIDATES = (4, 16)
SWEEP_RATIOS = (1, 4, 16, 70, 256, 1024)
SWEEP_VARIANTS = ("fused", "persistent", WS_VARIANT)
CHECKED_HEAD = 256  # sweep: candidates checked against fp64 (S0 in fp64 at B = 16384 would take 51 GB)
GRAPH_MAX_CANDIDATES = 1024  # --graph: the host's launch time matters only for small problems
TOL = 1e-2
BASELINE = "S0 eager (baseline)"


def make_inputs(shape: Shape, device, dtype, seed: int):
    """Fresh random (user_emb [U, Ku, D], cand_emb [B, Kc, D], cand_to_user [B] int32 unsorted with unequal counts,
    weight [N, Ku + Kc], bias [N])."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*size):
        return torch.randn(*size, generator=gen, device=device, dtype=dtype)

    weights = torch.rand(shape.num_users, generator=gen, device=device) ** 2 + 0.05
    mapping = torch.multinomial(weights, shape.num_candidates, replacement=True, generator=gen).int()
    depth = shape.ku + shape.kc
    user_emb, cand_emb = randn(shape.num_users, shape.ku, shape.dim), randn(shape.num_candidates, shape.kc, shape.dim)
    return user_emb, cand_emb, mapping, randn(shape.rows, depth) / depth**0.5, randn(shape.rows)


def s0_materialized(user_emb, cand_emb, cand_to_user, weight, bias):
    """S0: user_emb replicated to B rows, concatenated along K, one batched matmul with the bias fused."""
    tokens = torch.cat([user_emb.index_select(0, cand_to_user), cand_emb], dim=1)  # [B, Ku + Kc, D]
    num_candidates, _, dim = tokens.shape
    bias = bias[None, :, None].expand(num_candidates, -1, dim)
    return torch.baddbmm(bias, weight.expand(num_candidates, -1, -1), tokens)


def s1_gather(user_emb, cand_emb, cand_to_user, user_weight, cand_weight, bias):
    """S1 for torch.compile: two GEMMs at natural batch sizes, then the gathered add of the [U, N, D] result."""
    user_part = torch.matmul(user_weight, user_emb)  # [U, N, D]
    cand_part = torch.matmul(cand_weight, cand_emb)  # [B, N, D]
    return cand_part + bias[:, None] + user_part[cand_to_user]


def reference(inputs, head: int) -> torch.Tensor:
    """S0 in fp64 over the first `head` candidates → [head, N, D]."""
    user_emb, cand_emb, cand_to_user, weight, bias = inputs
    users = user_emb.index_select(0, cand_to_user[:head]).double()  # one row a candidate: the replicated formula
    mapping = torch.arange(users.shape[0], device=users.device)
    return s0_materialized(users, cand_emb[:head].double(), mapping, weight.double(), bias.double())


def triton_provider(packed: PackedLinearCompress, args, variant: str, graph: bool) -> Provider:
    """The Triton path at `variant`, without the public op's input checks; checked on NaN-poisoned outputs."""
    user_emb, cand_emb, _ = args
    out_shape = (cand_emb.shape[0], packed.cand_weight.shape[0], user_emb.shape[2])  # [B, N, D]
    user_shape = (user_emb.shape[0] if user_emb.shape[1] else 0, *out_shape[1:])  # Y_u [U, N, D]

    def run(out=None, user_part=None):
        return packed._triton(*args, variant, out=out, user_part=user_part)

    return Provider(
        run,
        check=lambda: run(nan_like(cand_emb, out_shape), nan_like(cand_emb, user_shape)),
        graph=graph and variant != "persistent",  # inside a CUDA-graph capture persistent takes fused
        host=True,
        note="Gluon, warp-specialized" if variant == WS_VARIANT else "",
    )


def providers(inputs, shape: Shape, variants, canonical: bool, with_compile: bool, graph: bool) -> dict[str, Provider]:
    """S0, the Triton variants and the public op; with `canonical` also S1 eager and (`with_compile`) torch.compile."""
    user_emb, cand_emb, cand_to_user, weight, bias = inputs
    args = (user_emb, cand_emb, cand_to_user)
    packed = PackedLinearCompress.from_weight(weight, shape.ku, bias)
    table = {BASELINE: Provider(lambda: s0_materialized(*inputs), graph=graph, note="user_emb replicated to B rows")}
    with_compile = canonical and with_compile
    if with_compile:
        s0_compiled, s1_compiled = torch.compile(s0_materialized), torch.compile(s1_gather)
        table["torch.compile(S0)"] = Provider(lambda: s0_compiled(*inputs), optional=True)
    if canonical:
        table["S1 eager (torch path)"] = Provider(lambda: packed(*args, backend="torch"))
    if with_compile:
        weights = (packed.user_weight, packed.cand_weight, bias)
        table["torch.compile(S1)"] = Provider(lambda: s1_compiled(*args, *weights), optional=True)
    for variant in variants:
        if variant != WS_VARIANT or ws_supported(user_emb, cand_emb):
            table[f"Triton {variant}"] = triton_provider(packed, args, variant, graph)
    table["public op"] = Provider(lambda: packed(*args), host=True, note="input checks, untuned default variant")
    return table


def case(shape: Shape, device, dtype, seed: int, head: int, **options) -> Case:
    inputs = make_inputs(shape, device, dtype, seed)
    table, elem = providers(inputs, shape, **options), inputs[0].element_size()
    title = f"Linear compression, {shape} (ragged, unsorted mapping), {str(dtype).removeprefix('torch.')}"
    return Case(table, reference(inputs, head), shape.flops(), shape.min_bytes(elem), BASELINE, title)


def sweep_points(shape: Shape, candidate_counts, ratios, device, dtype, variants, graph: bool):
    """(parameters, setup) per distinct (U, B); U = max(1, round(B / ratio)) repeats U = 1 past B: timed once."""
    points = {}
    for num_candidates in candidate_counts:
        for ratio in ratios:
            points.setdefault((max(1, round(num_candidates / ratio)), num_candidates), ratio)
    for (num_users, num_candidates), ratio in points.items():
        point = replace(shape, num_users=num_users, num_candidates=num_candidates)
        with_graph = graph and num_candidates <= GRAPH_MAX_CANDIDATES
        options = dict(variants=variants, canonical=False, with_compile=False, graph=with_graph)
        setup = partial(case, point, device, dtype, num_candidates + ratio, CHECKED_HEAD, **options)
        yield dict(B=num_candidates, U=num_users, **{"B/U": f"{num_candidates / num_users:.0f}"}), setup


def main(argv=None):
    parser = argument_parser(__doc__)
    parser.add_argument("--no-sweep", action="store_true", help="the canonical shape only")
    parser.add_argument("--candidates", default="", help="sweep: candidate counts B (default 64,1024,16384)")
    parser.add_argument("--ratios", default=",".join(map(str, SWEEP_RATIOS)), help="sweep: B/U ratios")
    parser.add_argument("--graph", action="store_true", help="sweep: also time CUDA-graph replays (B ≤ 1024)")
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile providers")
    parser.add_argument("--no-ws", action="store_true", help=f"leave out {WS_VARIANT} (Gluon, warp-specialized)")
    args = parser.parse_args(argv)
    bench = Bench("lce_bench", args.smoke, args.only)
    dtype = torch.float32 if args.smoke else torch.bfloat16  # Triton 3.6's interpreter gets bf16 dots wrong
    shape = SMOKE_CANONICAL if args.smoke else CANONICAL
    variants = tuple(v for v in (*VARIANTS, WS_VARIANT) if not (args.no_ws and v == WS_VARIANT))
    with_compile = not (args.no_compile or args.smoke)
    options = dict(variants=variants, canonical=True, with_compile=with_compile, graph=True)
    bench.table(case(shape, bench.device, dtype, 1, shape.num_candidates, **options), TOL)
    if not args.no_sweep:
        counts = SMOKE_SWEEP_CANDIDATES if args.smoke else SWEEP_CANDIDATES
        counts = tuple(int(b) for b in args.candidates.split(",")) if args.candidates else counts
        ratios = tuple(int(r) for r in args.ratios.split(","))
        sweep_variants = tuple(v for v in SWEEP_VARIANTS if v in variants)
        points = sweep_points(shape, counts, ratios, bench.device, dtype, sweep_variants, args.graph)
        names = [BASELINE, *(f"Triton {v}" for v in sweep_variants), "public op"]
        title = f"Sweep (Ku={shape.ku}, Kc={shape.kc}, D={shape.dim}, N={shape.rows}; first {CHECKED_HEAD} checked)"
        bench.sweep(title, points, names, TOL)
    bench.finish()


if __name__ == "__main__":
    main(sys.argv[1:])
