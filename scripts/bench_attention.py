#!/usr/bin/env python3
"""IKBO attention benchmark: providers side by side at the canonical shape, self + target, then the sweep.

    scripts/bench_attention.py [--backward] [--sweep full|corners|none] [--no-flex] [--only PREFIX,...] [--smoke]

Canonical shape (CANONICAL), bf16, non-causal target attention: B=1024 candidates, S=64 query tokens each, U=15
users with ragged counts, L=1024, H=4, d=128. The baseline replicates K/V to B rows for SDPA; packed SDPA needs
equal counts (B' = U·round(B/U)); ours as dispatched is the Gluon kernel of kernels/attention_ws.py where
`prefer_ws`, else the Triton kernel. Self + target: causal self-attention of U×L and the target attention over the
same K/V, apart against fused. Sweep (SWEEP, or CORNERS): the baseline against ours.
--backward: forward + backward (dO given; backward FLOPs 2.5 × the forward's) instead: the baseline with autograd,
packed SDPA (flash, cuDNN), ours through the public op's autograd and through its kernels, ours in parts (the
forward keeping its log-sum-exp, the backward on a kept graph, other backward tiles); self + target fused against
apart (SDPA causal self + our target), forward + backward and the backward alone; the sweep B ∈ {64, 1024, 16384} ×
B/U ∈ {1, 16, 70, 256} at S=64, L=512, H=4, d=128 (--sweep none leaves it out).
Problems, references (the baseline's formulas in fp64) and providers: ikbo_backend/perf/attention_cases.py. Kernels
compile first in worker processes. Checking, timing, floor, tables ($OUT/attention_bench.md): ikbo_backend/perf/harness.py.
"""

from __future__ import annotations

import os
import sys
from functools import partial

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before kernels is imported: Triton builds the kernels at import

import torch

from ikbo_backend.perf import attention_cases as cases
from ikbo_backend.perf.harness import Bench, argument_parser


def forward_tables(bench: Bench, args, dtype) -> None:
    shape, device = cases.SMOKE_CANONICAL if args.smoke else cases.CANONICAL, bench.device
    with_flex = not (args.no_flex or args.smoke)  # torch.compile on the CPU: minutes
    points = {"full": cases.SWEEP, "corners": cases.CORNERS, "none": []}[args.sweep]
    shapes = [cases.Shape(cases.SWEEP_CANDIDATES // r, cases.SWEEP_CANDIDATES, s, n, 4, d) for s, n, d, r in points]
    shapes = cases.SMOKE_SWEEP if args.smoke and shapes else shapes
    setups = [partial(cases.sweep_case, s, device, dtype) for s in shapes]
    bench.precompile([partial(cases.canonical_cases, shape, device, dtype, with_flex), *setups])
    for case in cases.canonical_cases(shape, device, dtype, with_flex):
        bench.table(case, cases.TOL)
    case = None  # its tensors go before the sweep's
    if setups:
        params = [dict(S=s.num_queries, L=s.seq_len, d=s.head_dim, U=s.num_users) for s in shapes]
        title = f"Sweep (non-causal target, B={shapes[0].num_candidates}, ragged counts; first {cases.CHECKED_HEAD} checked)"
        bench.sweep(title, zip(params, setups), [cases.BASELINE, cases.OURS, cases.DISPATCHED], cases.TOL)


def backward_tables(bench: Bench, args, dtype) -> None:
    shape, device = cases.SMOKE_TRAIN if args.smoke else cases.CANONICAL, bench.device
    shapes = cases.train_sweep_shapes(args.smoke) if args.sweep != "none" else []
    setups = [partial(cases.train_sweep_case, s, device, dtype) for s in shapes]
    # the points up to B = 1024 compile every kernel variant the sweep runs (the larger ones would share the GPU's
    # memory between the workers)
    small = [setup for s, setup in zip(shapes, setups) if s.num_candidates <= 1024]
    bench.precompile([partial(cases.train_cases, shape, device, dtype), *small])
    for case in cases.train_cases(shape, device, dtype):
        bench.table(case, cases.TRAIN_TOL)
    case = None  # its tensors go before the sweep's
    if setups:
        params = [dict(B=s.num_candidates, U=s.num_users, ratio=s.num_candidates // s.num_users) for s in shapes]
        title = (
            f"Sweep, forward + backward (non-causal target, S={shapes[0].num_queries}, L={shapes[0].seq_len}, "
            f"ragged counts; the first users' ≤ {cases.CHECKED_HEAD} candidates checked)"
        )
        names = [cases.TRAIN_BASELINE, cases.TRAIN_OURS, cases.TRAIN_KERNELS]
        bench.sweep(title, zip(params, setups), names, cases.TRAIN_TOL)


def main(argv=None):
    parser = argument_parser(__doc__)
    parser.add_argument("--backward", action="store_true", help="forward + backward instead of the forward")
    parser.add_argument("--sweep", choices=("full", "corners", "none"), default="full")
    parser.add_argument("--no-flex", action="store_true", help="leave out FlexAttention")
    args = parser.parse_args(argv)
    bench = Bench("attention_bench", args.smoke, args.only)
    dtype = torch.float16 if args.smoke else torch.bfloat16  # Triton 3.6's interpreter gets bf16 dots wrong
    (backward_tables if args.backward else forward_tables)(bench, args, dtype)
    bench.finish()


if __name__ == "__main__":
    main(sys.argv[1:])
