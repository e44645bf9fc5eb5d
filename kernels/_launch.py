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
from typing import NamedTuple

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


# ---------------------------------------------------------------------------------------------
# Prepared launches: a call signature's launches replayed with only the device addresses new
# ---------------------------------------------------------------------------------------------
#
# An op whose inputs have the shapes, strides, dtypes and alignments of an earlier call takes the same decisions and
# launches the same compiled kernels with the same integer arguments; only the device addresses of its tensors (and
# the TMA descriptors over them) change. A `Recording` passed down an op's launch path names the call's tensors
# ("q", "out", "plan", ...); each launch site builds its arguments through a binder, `NOW` (the tensors and
# descriptors themselves, launched now) and then the recording (a `Slot`, `Desc` or `Diff` where a value depends on
# an address), which keeps a `PreparedLaunch`. Replaying a recording costs the allocations, one descriptor encode per
# TMA argument and the C launcher alone (integer addresses: no data_ptr() call and no pointer query per tensor).


class NotPreparable(Exception):
    """A launch path step that a recording cannot replay (a copy made for this call, a launch hook, a kernel whose
    launcher is not the known one): the op keeps its ordinary path for that signature."""


class Slot(NamedTuple):
    """A device address given per call: the address of the call's tensor `name` plus `offset` bytes."""

    name: str
    offset: int


class Diff(NamedTuple):
    """An integer given per call: (address of `name` − address of `base`) // `elem`."""

    name: str
    base: str
    elem: int


class Desc(NamedTuple):
    """A TMA descriptor given per call over the call's tensor `name` (+ `offset` bytes), with this shape and these
    strides (elements); its block, swizzle and dtype are the compiled kernel's."""

    name: str
    offset: int
    shape: tuple
    strides: tuple


class _Now:
    """The binder of a launch now: tensors and descriptors as they are."""

    @staticmethod
    def ptr(t):
        return t

    @staticmethod
    def desc(make, t, shape, strides, *rest):
        return make(t, list(shape), list(strides), *rest)

    @staticmethod
    def diff(t, base, elem):
        return (t.data_ptr() - base.data_ptr()) // elem


NOW = _Now()


class Recording:
    """The launches of one call, kept for the calls with its signature (module comment above). `tensors`: name →
    the call's tensor whose address a launch argument may take; a launch path adds the ones it allocates (`name`)."""

    def __init__(self, **tensors):
        self.tensors: dict = {}
        self.same: list = []  # (name, earlier name) of one tensor passed twice: a replay needs that again
        for name, t in tensors.items():
            earlier = None if t is None else next((o for o, u in self.tensors.items() if _same_view(u, t)), None)
            if earlier is not None:
                self.same.append((name, earlier))
            elif t is not None:
                self.tensors[name] = t
        self.fresh: dict = {}  # name → (shape, dtype) of the tensors the launch path allocated
        self.steps: list = []  # PreparedLaunch / PreparedCall, in order
        storages = [t.untyped_storage().data_ptr() for t in self.tensors.values()]
        # two names over one storage (q, k and v inside one fused tensor) would make an address ambiguous
        self.failed = len(set(storages)) < len(storages)

    def name(self, name: str, t: torch.Tensor) -> None:
        """`t` (contiguous, allocated by the launch path for this call) is the call's tensor `name`."""
        if not t.is_contiguous() or t.storage_offset():
            raise ValueError(f"Recording.name: {name} must be a whole contiguous allocation")
        self.tensors[name] = t
        self.fresh[name] = (tuple(t.shape), t.dtype)

    def _find(self, t) -> Slot:
        address, storage = t.data_ptr(), t.untyped_storage().data_ptr()
        for name, candidate in self.tensors.items():
            if candidate.untyped_storage().data_ptr() == storage:
                return Slot(name, address - candidate.data_ptr())
        raise NotPreparable("a launch argument is not one of the call's named tensors")

    def ptr(self, t):
        return self._find(t) if isinstance(t, torch.Tensor) else t

    def desc(self, make, t, shape, strides, *rest):
        name, offset = self._find(t)
        return Desc(name, offset, tuple(shape), tuple(strides))

    def diff(self, t, base, elem):
        return Diff(self._find(t).name, self._find(base).name, elem) if t is not base else 0

    def launch(self, launch: CachedLaunch, grid, build, **kwargs):
        """Launch `launch[grid](*build(NOW), **kwargs)` now and keep it for replay, `build(self)` giving the replay's
        arguments (raises NotPreparable after the launch where it cannot be kept)."""
        args = build(NOW)
        compiled = launch[grid](*args, **kwargs)
        rest = launch.names[len(args) :]
        try:
            if compiled is None or not all(name in kwargs for name in rest):
                raise NotPreparable("the launch took Triton's own path (interpreter or launch hook)")
            self.steps.append(PreparedLaunch(compiled, grid, (*build(self), *(kwargs[n] for n in rest))))
        except NotPreparable:
            self.failed = True
        return compiled

    def call(self, fn, *args, **kwargs):
        """`fn(*args, **kwargs)` now (a torch op between the launches, say), kept for replay with the call's tensors
        in place of these, which must be named ones themselves."""
        result = fn(*args, **kwargs)
        by_id = {id(t): name for name, t in self.tensors.items()}

        def name_of(value):
            if not isinstance(value, torch.Tensor):
                return value
            if id(value) not in by_id:
                raise NotPreparable("a torch call's tensor is not one of the call's named tensors")
            return Named(by_id[id(value)])

        try:
            self.steps.append(PreparedCall(fn, [name_of(a) for a in args], {k: name_of(a) for k, a in kwargs.items()}))
        except NotPreparable:
            self.failed = True
        return result

    def replay(self) -> Replay | None:
        """What a later call with this call's signature runs, or None where this path cannot be replayed."""
        return None if self.failed or not self.steps else Replay(self.steps, self.fresh, self.same)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b are one tensor, or views of the same elements alike (a Parameter and its detach())."""
    return a is b or (
        a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.stride() == b.stride() and a.shape == b.shape
    )


class Named(NamedTuple):
    """The call's tensor `name`, in a recorded torch call."""

    name: str


class PreparedCall:
    """A recorded torch call: `fn` with the call's tensors in place of the `Named` arguments."""

    def __init__(self, fn, args: list, kwargs: dict):
        self.fn, self.args, self.kwargs = fn, args, kwargs

    def __call__(self, stream: int, addresses: dict, tensors: dict) -> None:
        pick = lambda a: tensors[a.name] if type(a) is Named else a  # noqa: E731
        self.fn(*map(pick, self.args), **{k: pick(a) for k, a in self.kwargs.items()})


class Replay:
    """A recorded launch path run on a later call: the path's own allocations made again, then each step with this
    call's tensors and addresses."""

    def __init__(self, steps: list, fresh: dict, same: list):
        self.steps, self.fresh, self.same = steps, fresh, same
        self.with_tensors = any(isinstance(step, PreparedCall) for step in steps)

    def __call__(self, stream: int, device, inputs: dict) -> dict | None:
        """Run on `inputs` (name → tensor, or an int address) → the fresh tensors by name; None (nothing run) where
        a tensor the recorded call passed under two names is not one tensor here."""
        if self.same and any(inputs[name].data_ptr() != inputs[earlier].data_ptr() for name, earlier in self.same):
            return None  # (shapes, strides and dtypes are the signature's)
        made = {name: torch.empty(shape, dtype=dtype, device=device) for name, (shape, dtype) in self.fresh.items()}
        addresses = {name: t.data_ptr() for name, t in made.items()}
        for name, t in inputs.items():
            if t is not None:
                addresses[name] = t if type(t) is int else t.data_ptr()
        tensors = {**inputs, **made} if self.with_tensors else None
        for step in self.steps:
            step(stream, addresses, tensors)
        return made


class PreparedLaunch:
    """One compiled kernel launched through its C launcher with recorded arguments, `Slot`, `Diff` and `Desc`
    entries filled from the call's addresses."""

    def __init__(self, compiled, grid, args: tuple):
        launcher = compiled.run
        raw = launcher.launch
        if getattr(raw, "__name__", "") == "inner":  # Triton's wrapper expanding host tensor descriptors
            cells = dict(zip(raw.__code__.co_freevars, (c.cell_contents for c in raw.__closure__ or ())))
            raw = cells.get("launcher")
        if raw is None or launcher.global_scratch_size or launcher.profile_scratch_size:
            raise NotPreparable("a launcher that needs scratch memory or is not the known one")
        metas = list(getattr(compiled.metadata, "tensordesc_meta", None) or [])
        template, self.fills, self.descs = [], [], []  # descs: the distinct (Desc, its TMA encoding's arguments)
        for arg in args:
            if isinstance(arg, Desc):
                meta = metas.pop(0) if metas else None
                if meta is None or meta.get("fp4_padded"):
                    raise NotPreparable("a host descriptor without the kernel's TMA metadata")
                encoding = (
                    meta["swizzle"], meta["elem_size"], _TMA_DTYPES[meta["elem_type"]], meta["block_size"],
                    list(arg.shape), list(arg.strides),
                )  # fmt: skip
                if (arg, encoding) not in self.descs:
                    self.descs.append((arg, encoding))
                self.fills.append((len(template), self.descs.index((arg, encoding)), True))
                template += [None, *arg.shape, *arg.strides]
            else:
                if isinstance(arg, (Slot, Diff)):
                    self.fills.append((len(template), arg, False))
                template.append(arg)
        self.template = template
        self.raw, self.function, self.metadata = raw, compiled.function, compiled.packed_metadata
        self.grid = (*grid, 1, 1)[:3]
        self.flags = (launcher.launch_cooperative_grid, launcher.launch_pdl)

    def __call__(self, stream: int, addresses: dict, tensors=None) -> None:
        args = self.template.copy()
        maps = [_encode(addresses[desc.name] + desc.offset, *encoding) for desc, encoding in self.descs]
        for at, arg, is_desc in self.fills:
            if is_desc:
                args[at] = maps[arg]
            elif type(arg) is Slot:
                args[at] = addresses[arg.name] + arg.offset
            else:
                args[at] = (addresses[arg.name] - addresses[arg.base]) // arg.elem
        self.raw(*self.grid, stream, self.function, *self.flags, None, None, self.metadata, None, None, None, *args)


def _tma_dtypes() -> dict:
    """Triton's device → host TMA dtype numbering (backends/nvidia/driver.py); identity where it is not there."""
    try:
        from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST
    except ImportError:  # a Triton build without the NVIDIA backend: nothing is replayed there
        return {i: i for i in range(16)}
    return TMA_DTYPE_DEVICE_TO_HOST


_TMA_DTYPES = _tma_dtypes()


def _encode(address: int, swizzle, elem_size, dtype, block, shape, strides):
    """The CUtensorMap Triton's launcher builds for a host descriptor (backends/nvidia/driver.py, make_tensordesc_arg;
    zero padding)."""
    return driver.active.utils.fill_tma_descriptor(address, swizzle, elem_size, dtype, block, shape, strides, 0)


def launch(cached: CachedLaunch, grid, build, recording: Recording | None = None, **kwargs):
    """`cached[grid](*build(NOW), **kwargs)`, kept in `recording` when one is given."""
    if recording is None:
        return cached[grid](*build(NOW), **kwargs)
    return recording.launch(cached, grid, build, **kwargs)


def named(recording: Recording | None, name: str, t: torch.Tensor) -> torch.Tensor:
    """t, named in `recording` when one is given (`Recording.name`)."""
    if recording is not None:
        recording.name(name, t)
    return t


def call(recording: Recording | None, fn, *args, **kwargs):
    """`fn(*args, **kwargs)` (a torch step between launches), kept in `recording` when one is given
    (`Recording.call`)."""
    return fn(*args, **kwargs) if recording is None else recording.call(fn, *args, **kwargs)


def fail(recording: Recording | None) -> None:
    """The launch path took a step that a replay would not repeat (a fill, a copy): nothing is kept."""
    if recording is not None:
        recording.failed = True


MAX_REPLAYS = 256  # signatures an op keeps replays for; beyond, the oldest half is dropped


def remember(table: dict, key, replay: Replay) -> None:
    """table[key] = replay, the table kept within MAX_REPLAYS entries."""
    if len(table) >= MAX_REPLAYS:
        for old in list(table)[: MAX_REPLAYS // 2]:
            del table[old]
    table[key] = replay


REPLAY = [True]  # REPLAY[0] = False: ops take their ordinary launch path every call (host-time comparisons)


def replayable() -> bool:
    """Whether launches may be prepared and replayed now (not under the interpreter, no launch hook, cache on)."""
    return ENABLED and REPLAY[0] and not interpreting() and not _hooked()
