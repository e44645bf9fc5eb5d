#!/usr/bin/env python3
"""IKBO linear compression benchmark: providers side by side at the canonical shape, then the B/U sweep.

    scripts/bench_lce.py [--backward] [--no-sweep] [--candidates 64,1024,16384] [--ratios 1,4,16,70,256,1024]
                         [--graph] [--no-compile] [--no-ws] [--only PREFIX,...] [--smoke]

Canonical shape (CANONICAL), bf16: B=1024 candidates, U=15 users with ragged counts (unsorted mapping), Ku=1024,
Kc=500, D=256, N=512; FLOPs 2·N·D·(U·Ku + B·Kc), the IKBO work. Providers: S0 eager (the baseline: user_emb
replicated to B rows, concatenated along K, one batched matmul), torch.compile(S0), S1 eager (the op's torch path:
two GEMMs and the gathered add), torch.compile(S1), the Triton variants without the op's input checks
(kernels/linear_compress.py), warp_specialized (the Gluon kernel, kernels/linear_compress_ws.py; Hopper) and
the public op (input checks, the default variant). The reference is S0 in fp64.
Sweep: B in --candidates, B/U in --ratios (U = round(B / ratio), at least 1): S0 against fused, persistent,
warp_specialized and the public op, checked on the first CHECKED_HEAD candidates; --graph adds CUDA-graph replays
up to B = 1024.
--backward: forward + backward (dout given) instead, FLOPs 3 × the IKBO forward. Providers: S0 + autograd (the
baseline), S1 + autograd (decomposed torch: two GEMMs, a gather whose backward is an index_add), ours (a
PackedLinearCompress, gradients to the inputs and its Parameters); at the canonical shape also ours split into
forward, backward and the backward's kernels. Checked in fp64 (ikbo_backend/perf/lce_cases.py): out and d_cand_emb
on the first CHECKED_HEAD candidates, d_user_emb on as many users, the weight gradients projected on fixed random
vectors, d_bias whole. Sweep: B/U in 1,16,70,256 by default.
Checking, timing, floor, tables ($OUT/lce_bench.md): ikbo_backend/perf/harness.py.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from functools import partial

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before kernels is imported: Triton builds the kernels at import

import torch

from ikbo_backend.perf import lce_cases as cases
from ikbo_backend.perf.harness import Bench, Case, Provider, argument_parser, nan_like
from ikbo_backend.perf.lce_cases import CHECKED_HEAD, Shape, make_inputs, reference, s0_materialized, train_case
from kernels.linear_compress import VARIANTS, WS_VARIANT, PackedLinearCompress
from kernels.linear_compress_ws import ws_supported

SWEEP_CANDIDATES = (64, 1024, 16384)
SMOKE_SWEEP_CANDIDATES = (4, 16)
SWEEP_RATIOS = (1, 4, 16, 70, 256, 1024)
TRAIN_SWEEP_RATIOS = (1, 16, 70, 256)
SWEEP_VARIANTS = ("fused", "persistent", WS_VARIANT)
GRAPH_MAX_CANDIDATES = 1024  # --graph: the host's launch time matters only for small problems
TOL = 1e-2
TRAIN_TOL = 2e-2  # gradients in bf16: the baseline's own autograd lands near 1.2e-2
BASELINE = "S0 eager (baseline)"


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
        s0_compiled, s1_compiled = torch.compile(s0_materialized), torch.compile(cases.s1_gather)
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


def sweep_points(shape: Shape, candidate_counts, ratios, device, dtype, variants, graph: bool, train: bool):
    """(parameters, setup) per distinct (U, B); U = max(1, round(B / ratio)) repeats U = 1 past B: timed once."""
    points = {}
    for num_candidates in candidate_counts:
        for ratio in ratios:
            points.setdefault((max(1, round(num_candidates / ratio)), num_candidates), ratio)
    for (num_users, num_candidates), ratio in points.items():
        point = replace(shape, num_users=num_users, num_candidates=num_candidates)
        with_graph = graph and num_candidates <= GRAPH_MAX_CANDIDATES
        options = dict(variants=variants, canonical=False, with_compile=False, graph=with_graph)
        seed = num_candidates + ratio
        setup = partial(train_case, point, device, dtype, seed, CHECKED_HEAD, canonical=False) if train else None
        setup = setup or partial(case, point, device, dtype, seed, CHECKED_HEAD, **options)
        yield dict(B=num_candidates, U=num_users, **{"B/U": f"{num_candidates / num_users:.0f}"}), setup


def main(argv=None):
    parser = argument_parser(__doc__)
    parser.add_argument("--backward", action="store_true", help="forward + backward instead of the forward")
    parser.add_argument("--no-sweep", action="store_true", help="the canonical shape only")
    parser.add_argument("--candidates", default="", help="sweep: candidate counts B (default 64,1024,16384)")
    parser.add_argument(
        "--ratios", default="", help="sweep: B/U ratios (default 1,4,16,70,256,1024; --backward 1,16,70,256)"
    )
    parser.add_argument("--graph", action="store_true", help="sweep: also time CUDA-graph replays (B ≤ 1024)")
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile providers")
    parser.add_argument("--no-ws", action="store_true", help=f"leave out {WS_VARIANT} (Gluon, warp-specialized)")
    args = parser.parse_args(argv)
    bench = Bench("lce_bench", args.smoke, args.only)
    dtype = torch.float32 if args.smoke else torch.bfloat16  # Triton 3.6's interpreter gets bf16 dots wrong
    smoke_shape = cases.SMOKE_TRAIN if args.backward else cases.SMOKE_CANONICAL
    shape = smoke_shape if args.smoke else cases.CANONICAL
    variants = tuple(v for v in (*VARIANTS, WS_VARIANT) if not (args.no_ws and v == WS_VARIANT))
    with_compile = not (args.no_compile or args.smoke)
    options = dict(variants=variants, canonical=True, with_compile=with_compile, graph=True)
    tol = TRAIN_TOL if args.backward else TOL
    if args.backward:
        bench.table(train_case(shape, bench.device, dtype, 1, CHECKED_HEAD, canonical=True), tol)
    else:
        bench.table(case(shape, bench.device, dtype, 1, shape.num_candidates, **options), TOL)
    if not args.no_sweep:
        counts = SMOKE_SWEEP_CANDIDATES if args.smoke else SWEEP_CANDIDATES
        counts = tuple(int(b) for b in args.candidates.split(",")) if args.candidates else counts
        ratios = TRAIN_SWEEP_RATIOS if args.backward else SWEEP_RATIOS
        ratios = tuple(int(r) for r in args.ratios.split(",")) if args.ratios else ratios
        sweep_variants = tuple(v for v in SWEEP_VARIANTS if v in variants)
        points = sweep_points(shape, counts, ratios, bench.device, dtype, sweep_variants, args.graph, args.backward)
        names = [BASELINE, *(f"Triton {v}" for v in sweep_variants), "public op"]
        names = [cases.TRAIN_BASELINE, cases.DECOMPOSED, cases.OURS] if args.backward else names
        what = "forward + backward, " if args.backward else ""
        title = (
            f"Sweep, {what}Ku={shape.ku}, Kc={shape.kc}, D={shape.dim}, N={shape.rows}; first {CHECKED_HEAD} checked"
        )
        bench.sweep(title, points, names, tol)
    bench.finish()


if __name__ == "__main__":
    main(sys.argv[1:])
