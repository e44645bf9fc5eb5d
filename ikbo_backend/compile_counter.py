"""Counts the Triton kernel compilations of this process, by phase (warm-up, then requests)."""

from __future__ import annotations

import logging
from collections.abc import Callable


class CompileCounter:
    """Triton kernel compilations in this process, by phase: "warmup" until `phase` is set to
    "request". Counted through triton.knobs.runtime.jit_post_compile_hook (called after every
    compilation, also when the binary comes from Triton's disk cache); a hook already set is kept.
    Where several models share a process (the python_inprocess backend) their loads are exclusive and
    `loads_in_progress` (the backend's `pb_utils.loads_in_progress`) counts them: a compilation during
    one belongs to the loading model, not to the request path of those already loaded."""

    def __init__(self, loads_in_progress: Callable[[], int] | None = None):
        self.phase = "warmup"
        self.counts = {"warmup": 0, "request": 0}
        self.kernels: list[tuple[str, str]] = []  # (phase, kernel name)
        self.loads_in_progress = loads_in_progress

    @classmethod
    def install(cls, loads_in_progress: Callable[[], int] | None = None) -> CompileCounter:
        """A counter hooked into Triton. `loads_in_progress`: how many other models are loading in
        this process now (None: one model per process)."""
        from triton import knobs

        counter, previous = cls(loads_in_progress), knobs.runtime.jit_post_compile_hook

        def hook(**kwargs):
            if counter.phase == "request" and counter.loads_in_progress is not None and counter.loads_in_progress():
                return previous(**kwargs) if previous is not None else None
            counter.counts[counter.phase] += 1
            counter.kernels.append((counter.phase, kwargs["fn"].name))
            if counter.phase == "request":  # a bucket the warm-up missed: say which kernel and specialization
                logging.getLogger("ikbo").warning(
                    "Triton compilation on the request path: %s %s", kwargs["fn"].name, kwargs.get("repr", "")
                )
            return previous(**kwargs) if previous is not None else None

        knobs.runtime.jit_post_compile_hook = hook
        return counter
