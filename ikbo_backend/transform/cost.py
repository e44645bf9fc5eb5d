"""The cost model: the rewritten module is served only where it is not slower than the original.

Both run on the example, alternately, after a few calls each (the first calls at new shapes build
kernels), in inference mode (CUDA synchronized), for at least `MIN_ROUNDS` rounds and then while the rounds
fit in `BUDGET_S` (at most `MAX_ROUNDS`). Where the rounds are expensive (`BUDGET_S` spent) and one side is more
than `DECISIVE` times faster than the other in every round so far, `DECISIVE_ROUNDS` rounds decide (the served
transformed model decides at load, and a 6× rewrite of a model that takes a second needs no five rounds to show
it); on cheap calls two rounds never decide: a burst of other work on a shared machine can slow both of one side's
first rounds twice over. Two statistics come out: each side's fastest round (other work only ever adds time) and
the median over rounds of the original's time over the rewrite's in that round (the typical call: a rewrite
fast on a few calls only, an allocator's lucky reuse, does not count as faster). The rewrite counts as slower
where either says it is more than `TOLERANCE` slower: closer than that, the two cannot be told apart on a shared
machine.
"""

from __future__ import annotations

import statistics
import time
from typing import NamedTuple

import torch
from torch.utils._pytree import tree_flatten, tree_map

TOLERANCE = 0.03
WARMUP, MIN_ROUNDS, MAX_ROUNDS, BUDGET_S = 2, 5, 30, 1.0
DECISIVE, DECISIVE_ROUNDS = 2.0, 2


class Timing(NamedTuple):
    """What `compare` measured: each side's fastest round, the median of the rounds' paired ratios, the rounds."""

    original_s: float
    rewritten_s: float
    paired: float  # median over rounds of original / rewritten
    rounds: int

    @property
    def speedup(self) -> float:
        """original / rewrite by the less favourable of the two statistics."""
        return min(self.original_s / self.rewritten_s, self.paired)

    def describe(self) -> str:
        return (
            f"the original takes {self.original_s * 1e3:.3g} ms, the rewrite {self.rewritten_s * 1e3:.3g} ms "
            f"({self.original_s / self.rewritten_s:.2f}×; fastest of {self.rounds} alternating rounds each, the "
            f"median of the rounds' ratios {self.paired:.2f}×)"
        )


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


def _decisive(times) -> bool:
    """Whether one side was more than `DECISIVE` times faster than the other in every round so far."""
    ratios = [a / b for a, b in zip(*times)]
    return all(r > DECISIVE for r in ratios) or all(r * DECISIVE < 1 for r in ratios)


def compare(original, rewritten, inputs, cuda_graphs: bool = False) -> Timing:
    """Alternating timed rounds of `original` and `rewritten` on `inputs` (`Timing`). `cuda_graphs` (CUDA inputs):
    each replayed from a CUDA graph, for a module that will be served that way; where either cannot be captured,
    both run eagerly."""
    calls = [lambda f=f: f(*inputs) for f in (original, rewritten)]
    times = ([], [])
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
            if rounds >= DECISIVE_ROUNDS and spent >= BUDGET_S and _decisive(times):
                break
            for i, fn in enumerate(calls):
                start = time.perf_counter()
                fn()
                _sync(inputs)
                elapsed = time.perf_counter() - start
                times[i].append(elapsed)
                spent += elapsed
            rounds += 1
    paired = statistics.median(a / b for a, b in zip(*times))
    return Timing(min(times[0]), min(times[1]), paired, rounds)


def slower(original_s: float, rewritten_s: float) -> bool:
    return rewritten_s > original_s * (1 + TOLERANCE)


def rewrite_slower(timing: Timing) -> bool:
    """Whether the rewrite counts as slower: by its fastest round or by the median of the paired rounds."""
    return slower(1.0, 1.0 / timing.speedup)
