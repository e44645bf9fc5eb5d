"""The cost model: the rewritten module is served only where it is not slower than the original.

Both run on the example, alternately, after a few calls each (the first calls at new shapes build
kernels), in inference mode (CUDA synchronized). The speed ratio is the median of the rounds' paired
ratios: a burst of other work on the machine slows one round of both. The rewrite counts as slower when
the ratio is below 1 / (1 + `TOLERANCE`): closer than that, the two cannot be told apart on a shared
machine.
"""

from __future__ import annotations

import time

import torch
from torch.utils._pytree import tree_flatten

TOLERANCE = 0.03
WARMUP, MIN_ROUNDS, MAX_ROUNDS, BUDGET_S = 3, 5, 20, 0.5


def _sync(inputs):
    if any(isinstance(t, torch.Tensor) and t.is_cuda for t in tree_flatten(inputs)[0]):
        torch.cuda.synchronize()


def compare(original, rewritten, inputs) -> tuple[float, float]:
    """(original, rewritten) seconds a call on `inputs`, from alternating rounds: the original's fastest
    round, and that divided by the median of the rounds' paired ratios (robust to bursts of other work)."""
    times = [], []
    with torch.inference_mode():
        for _ in range(WARMUP):  # first calls at new shapes build kernels (oneDNN primitives, Triton)
            for fn in (original, rewritten):
                fn(*inputs)
        _sync(inputs)
        spent, rounds = 0.0, 0
        while rounds < MIN_ROUNDS or (spent < BUDGET_S and rounds < MAX_ROUNDS):
            for i, fn in enumerate((original, rewritten)):
                start = time.perf_counter()
                fn(*inputs)
                _sync(inputs)
                elapsed = time.perf_counter() - start
                times[i].append(elapsed)
                spent += elapsed
            rounds += 1
    ratios = sorted(a / b for a, b in zip(*times))
    ratio = ratios[len(ratios) // 2]
    return min(times[0]), min(times[0]) / ratio


def slower(original_s: float, rewritten_s: float) -> bool:
    return rewritten_s > original_s * (1 + TOLERANCE)
