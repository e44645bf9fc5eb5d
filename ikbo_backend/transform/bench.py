"""Side-by-side timing of the zoo's models (zoo.py) and what `to_ikbo` serves for them, on one request
shape and one set of the zoo's sizes (`zoo.DIMS`: "small", or "large", near production for the
attention-bearing models): `scripts/bench_transform.py` prints the table of docs/results.md (Transformation).

Each model runs the pass as a server would (its cost model on, the example at the benchmark's U:B),
then the original and the served module run alternately, `rounds` times after a warm-up; the speed
ratio is the median of the rounds' paired ratios (a burst of other work slows one round of both). On
CUDA each call can be replayed from a CUDA graph (`graphs`: static inputs captured once), as the served
rankers are.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_map

from kernels.reference import rel_err

from . import cost, to_ikbo, zoo


@dataclass
class Row:
    model: str
    served: str  # "fully" / "partly" (some user tensors still replicated) / "kept" (the original)
    left: int  # user tensors still replicated to B rows in the rewrite
    original_ms: float
    served_ms: float
    speedup: float  # original / served, median of paired rounds
    rewrite_speedup: float | None  # the pass's own measurement of the rewrite at load
    rel_err: float  # served against the original on a fresh request


def _cast(args, device, dtype):
    def one(t):
        if not isinstance(t, torch.Tensor):
            return t
        t = t.to(device)
        return t.to(dtype) if t.is_floating_point() else t

    return tree_map(one, args)


def paired(fns, rounds: int, sync) -> tuple[list[float], float]:
    """(fastest seconds of each fn, median over rounds of fns[0]'s time / fns[1]'s)."""
    times = [[] for _ in fns]
    for _ in range(3):
        for fn in fns:
            fn()
    sync()
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            sync()
            times[i].append(time.perf_counter() - start)
    ratios = sorted(a / b for a, b in zip(times[0], times[1]))
    return [min(t) for t in times], ratios[len(ratios) // 2]


def run(
    names, num_users=15, num_candidates=1024, device="cpu", dtype=torch.float32, rounds=20, graphs=False, seed=0,
    dims="small",
):  # fmt: skip
    """One Row per zoo model `names` at U:B = num_users:num_candidates and sizes `zoo.DIMS[dims]`."""
    if dims not in zoo.DIMS:
        raise ValueError(f"dims must be one of {list(zoo.DIMS)}, got {dims!r}")
    sizes, rows = zoo.DIMS[dims], []
    cuda = torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for name in names:
        try:
            rows.append(
                _one(name, num_users, num_candidates, device, dtype, rounds, graphs and cuda, seed, sync, sizes)
            )
        except Exception as e:  # one model's failure is a row of the table, not the end of the run
            rows.append(Row(name, f"error: {type(e).__name__}: {str(e).splitlines()[0][:120]}", 0, 0, 0, 0, None, 0))
    return rows


def _one(name, num_users, num_candidates, device, dtype, rounds, graphs, seed, sync, dims) -> Row:
    gen = torch.Generator().manual_seed(seed)
    model = zoo.build(name, seed=seed, dims=dims).to(device, dtype)
    example = _cast(zoo.inputs(model, num_users, num_candidates, gen), device, dtype)
    module, report = to_ikbo(model, example, cuda_graphs=graphs)
    served = "kept" if module is model else "fully" if report.replications_left == 0 else "partly"
    left = 0 if module is model else report.replications_left
    args = _cast(zoo.inputs(model, num_users, num_candidates, gen), device, dtype)
    with torch.inference_mode():
        err = rel_err(module(*args), model(*args))
        calls = [lambda f=f: f(*args) for f in (model, module)]
        if graphs:
            calls = [cost.graphed(f, args) for f in (model, module)]
        (orig_s, _), ratio = paired(calls, rounds, sync)
    return Row(name, served, left, orig_s * 1e3, orig_s / ratio * 1e3, ratio, report.speedup, err)


def table(rows) -> str:
    lines = [
        "| model | served | user tensors left at B rows | original ms | served ms | speedup | rewrite at load | rel. error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        at_load = f"{r.rewrite_speedup:.2f}×" if r.rewrite_speedup is not None else "—"
        lines.append(
            f"| {r.model} | {r.served} | {r.left} | {r.original_ms:.3g} | {r.served_ms:.3g} | {r.speedup:.2f}× "
            f"| {at_load} | {r.rel_err:.1e} |"
        )
    return "\n".join(lines)
