#!/usr/bin/env python3
"""Our IKBO forward ops against Meta's stock-Triton IKBO kernels (pytorch/FBGEMM, fbgemm_gpu/experimental/ikbo), side
by side in one run, every provider checked against fp64 first.

    scripts/bench_fbgemm.py [--fbgemm-ikbo DIR] [--ops lce attention] [--dtype fp16 bf16]
                            [--shapes canonical fbgemm] [--out DIR] [--only PREFIX,...] [--smoke]

DIR holds a copy of fbgemm_gpu/experimental/ikbo (ikbo/__init__.py, ikbo/ops/triton_ikbo_lce.py, triton_ikbo_fa.py,
torch_lce.py, tlx_ikbo_lce.py; a README.txt of `<commit>  <path>` lines is reported if present), imported by file
path, never part of this tree:
    git clone --depth 1 https://github.com/pytorch/FBGEMM /tmp/FBGEMM
    cp -r /tmp/FBGEMM/fbgemm_gpu/experimental/ikbo .cache/fbgemm_ikbo
Problems: LCE at our canonical shape (B=1024, U=15 ragged, shuffled mapping, Ku=1024, Kc=500, D=256, N=512; no bias:
theirs has none) and at ikbo_lce_bench.py's default (B=1024, 70 candidates a user sorted, Ku=1178, Kc=866, D=256,
N=433); target attention at our canonical shape (U=15 ragged, B=1024, S=64, L=1024, H=4, d=128, non-causal, full
lengths) and at ikbo_fa_bench.py's default (B=2048, 64 a user sorted, S=64, H=2, d=128) with L = 1024 and 4096.
Providers, layouts, fairness notes and autotuning: ikbo_backend/perf/fbgemm_compare.py. Checking, timing (CUPTI
device ms, do_bench), tables: ikbo_backend/perf/harness.py, written to --out (default $OUT) as
fbgemm_compare_<ops>_<dtypes>.md and .json.
--smoke: tiny shapes on the CPU under Triton's interpreter, fp16: a check of the script, not a measurement.
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before kernels is imported: Triton builds the kernels at import

import torch

from ikbo_backend.perf import fbgemm_compare
from ikbo_backend.perf.harness import argument_parser

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def main(argv=None):
    parser = argument_parser(__doc__)
    parser.add_argument("--fbgemm-ikbo", default=".cache/fbgemm_ikbo", help="copy of fbgemm_gpu/experimental/ikbo")
    parser.add_argument("--ops", nargs="+", choices=("lce", "attention"), default=["lce", "attention"])
    parser.add_argument(
        "--dtype", nargs="+", choices=tuple(DTYPES), help="default fp16 bf16 (--smoke: fp16; the interpreter's bf16 "
        "dots are wrong)"
    )  # fmt: skip
    parser.add_argument("--shapes", nargs="+", choices=("canonical", "fbgemm"), default=["canonical", "fbgemm"])
    parser.add_argument("--out", default="", help="directory for the tables (default $OUT; none: printed only)")
    args = parser.parse_args(argv)
    if args.out:
        os.environ["OUT"] = args.out
    dtypes = [DTYPES[name] for name in args.dtype or (["fp16"] if args.smoke else ["fp16", "bf16"])]
    fbgemm_compare.run(args.fbgemm_ikbo, args.ops, dtypes, args.shapes, args.smoke, args.only)


if __name__ == "__main__":
    main(sys.argv[1:])
