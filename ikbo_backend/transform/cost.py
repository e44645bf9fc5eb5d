"""The cost model: the rewritten module is served only where it is not slower than the original.

Both run on the example, alternately, after a few calls each (the first calls at new shapes build
kernels), in inference mode (CUDA synchronized), for at least `MIN_ROUNDS` rounds, or `DECISIVE_ROUNDS`
when one is already more than `DECISIVE` times faster than the other (the served transformed model
decides at load, and a 6× rewrite needs no five rounds to show it); each keeps its fastest round (other
work on a shared machine only ever adds time). The rewrite counts as slower when its fastest round is
more than `TOLERANCE` above the original's: closer than that, the two cannot be told apart on a shared
machine.
"""

from __future__ import annotations

import time

import torch
from torch.utils._pytree import tree_flatten, tree_map

TOLERANCE = 0.03
WARMUP, MIN_ROUNDS, MAX_ROUNDS, BUDGET_S = 2, 5, 30, 1.0
DECISIVE, DECISIVE_ROUNDS = 2.0, 2


def _sync(inputs):
    if any(isinstance(t, torch.Tensor) and t.is_cuda for t in tree_flatten(inputs)[0]):
        torch.cuda.synchronize()


def graphed(fn, args):
    """fn(*args) replayed from a CUDA graph over static copies of args (captured after three calls on a side
    stream, as torch.cuda.graphs asks): a call without the host's launch work, as a graph-served model runs."""
    static = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, args)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(*static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*static)

    def replay():
        graph.replay()
        return out

    return replay


def compare(original, rewritten, inputs, cuda_graphs: bool = False) -> tuple[float, float]:
    """(original, rewritten) seconds a call on `inputs`: the fastest of alternating rounds. `cuda_graphs` (CUDA
    inputs): each replayed from a CUDA graph, for a module that will be served that way; where either cannot be
    captured, both run eagerly."""
    calls = [lambda f=f: f(*inputs) for f in (original, rewritten)]
    best = [float("inf"), float("inf")]
    with torch.inference_mode():
        for _ in range(WARMUP):  # first calls at new shapes build kernels (oneDNN primitives, Triton)
            for fn in calls:
                fn()
        _sync(inputs)
        if cuda_graphs and any(isinstance(t, torch.Tensor) and t.is_cuda for t in tree_flatten(inputs)[0]):
            try:
                calls = [graphed(f, inputs) for f in (original, rewritten)]
            except RuntimeError:  # an op that cannot be captured (a host sync): eager, as it will be served
                pass
        spent, rounds = 0.0, 0
        while rounds < MIN_ROUNDS or (spent < BUDGET_S and rounds < MAX_ROUNDS):
            if rounds >= DECISIVE_ROUNDS and max(best) > DECISIVE * min(best):
                break
            for i, fn in enumerate(calls):
                start = time.perf_counter()
                fn()
                _sync(inputs)
                elapsed = time.perf_counter() - start
                best[i] = min(best[i], elapsed)
                spent += elapsed
            rounds += 1
    return best[0], best[1]


def slower(original_s: float, rewritten_s: float) -> bool:
    return rewritten_s > original_s * (1 + TOLERANCE)
