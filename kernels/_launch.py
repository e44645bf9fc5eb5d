"""Launching a hot kernel with less host time: `CachedLaunch(kernel)[grid](*args, **kwargs)` launches as
`kernel[grid](*args, **kwargs)` does, and after the first call with a given argument key goes straight to the
compiled kernel.

A Triton launch binds its arguments to the signature, specializes each (a C call per argument), builds a cache key
string and looks the compiled kernel up; for the IKBO kernels' 15–50 arguments that is about half of a launch's host
time, which an eager call pays for every launch. Here the lookup is keyed on what Triton specializes on, computed
in one pass (`_arg_key`): each tensor's dtype and 16-byte alignment, each int's value class (1, a multiple of 16,
32 or 64 bit), each descriptor's type, dtype, block shape, layout and padding, the rest by type and value. The key is
at least as fine as Triton's, so a hit can only find the kernel Triton would have picked; a miss (or an argument of
another kind) takes Triton's own path, whose compiled kernel is then kept under the key. Under the interpreter, and
while a launch hook is installed (profilers such as proton), every call takes Triton's path; otherwise the launch
passes no hooks (Triton's empty hook chains would be called for nothing).
"""

from __future__ import annotations

import inspect
import os

import torch
from triton import knobs
from triton.runtime import driver

from ._interpreter import interpreting

_INT32 = (-(2**31), 2**31)
ENABLED = os.environ.get("IKBO_LAUNCH_CACHE", "1") != "0"  # IKBO_LAUNCH_CACHE=0: every launch takes Triton's path


def _hooked() -> bool:
    """Whether a launch hook is installed (Triton keeps them in chains that are empty by default)."""
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(hook is not None and getattr(hook, "calls", True) for hook in hooks)


def _arg_key(arg):
    """What Triton's specialization of one argument depends on (a superset of it), or raise TypeError."""
    kind = type(arg)
    if kind is torch.Tensor or isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if kind is int:
        return arg == 1, arg % 16 == 0, _INT32[0] <= arg < _INT32[1]
    if kind is float:
        return kind  # fp32 whatever its value
    if kind is bool or arg is None:
        return kind, arg
    base = getattr(arg, "base", None)
    if isinstance(base, torch.Tensor) and hasattr(arg, "block_shape"):  # a host tensor descriptor (Triton or Gluon)
        layout = getattr(arg, "layout", None)
        return kind, base.dtype, tuple(arg.block_shape), layout, getattr(arg, "padding", None)
    raise TypeError(f"no launch key for an argument of type {kind.__name__}")


class CachedLaunch:
    """`CachedLaunch(kernel)[grid](*args, **kwargs)`: `kernel[grid](*args, **kwargs)` with the compiled kernel kept
    per argument key (module doc). Positional arguments come first, keyword arguments name the remaining
    parameters (constexprs) and the launch options (num_warps, num_stages, maxnreg, ...)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.names = list(inspect.signature(kernel.fn).parameters)  # a jit or interpreted function's own
        self.compiled: dict = {}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    MAX_KEYS = 512  # beyond this many argument keys the oldest half is dropped (a bound, not a working set)

    def launch(self, grid, args: tuple, kwargs: dict):
        if not ENABLED or interpreting() or _hooked() or callable(grid):
            return self.kernel[grid](*args, **kwargs)
        device = driver.active.get_current_device()  # as Triton's launch asks (a test's stand-in driver too)
        try:
            key = (device, tuple(map(_arg_key, args)), tuple(kwargs.items()))
            entry = self.compiled.get(key)
        except TypeError:  # an argument this key cannot name, or an unhashable keyword value
            return self.kernel[grid](*args, **kwargs)
        if entry is None:
            compiled = self.kernel[grid](*args, **kwargs)
            rest = self.names[len(args) :]
            if compiled is not None and all(name in kwargs for name in rest):  # every parameter given: replayable
                if len(self.compiled) >= self.MAX_KEYS:
                    for old in list(self.compiled)[: self.MAX_KEYS // 2]:
                        del self.compiled[old]
                self.compiled[key] = (compiled, rest)
            return compiled
        compiled, rest = entry
        grid_x, grid_y, grid_z = (*grid, 1, 1)[:3]
        stream = driver.active.get_current_stream(device)
        compiled.run(
            grid_x, grid_y, grid_z, stream, compiled.function, compiled.packed_metadata, None, None, None,
            *args, *(kwargs[name] for name in rest),
        )  # fmt: skip
        return compiled
