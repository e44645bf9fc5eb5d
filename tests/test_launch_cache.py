"""kernels._launch.CachedLaunch: a launch goes straight to the compiled kernel only under an argument key at least as
fine as Triton's specialization; anything else takes Triton's path. A stand-in kernel records which path each launch
took (the real launches run in every GPU test of the ops)."""

from __future__ import annotations

import pytest
import torch

from kernels import _launch


class Compiled:
    function, packed_metadata = "function", "metadata"

    def __init__(self, launches):
        self.launches = launches

    def run(self, *args):
        self.launches.append(("cached", args))


class StandInKernel:
    """A jit function's surface: fn (the Python function), and kernel[grid](*args, **kwargs) → the compiled kernel."""

    def __init__(self):
        self.launches, self.compiled = [], []

    @staticmethod
    def fn(x_ptr, n, scale, BLOCK, FLAG):
        """The kernel's signature."""

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.launches.append(("triton", grid, args, kwargs))
            self.compiled.append(Compiled(self.launches))
            return self.compiled[-1]

        return run


class StandInDriver:
    class active:
        get_current_device = staticmethod(lambda: 0)
        get_current_stream = staticmethod(lambda device: 77)


@pytest.fixture
def kernel(monkeypatch):
    monkeypatch.setattr(_launch, "interpreting", lambda: False)
    monkeypatch.setattr(_launch, "driver", StandInDriver())
    return StandInKernel()


def paths(kernel):
    return [launch[0] for launch in kernel.launches]


def test_a_repeated_key_launches_the_compiled_kernel_with_every_parameter_in_order(kernel):
    launch = _launch.CachedLaunch(kernel)
    x = torch.randn(64)
    launch[(3,)](x, 40, 0.5, BLOCK=16, FLAG=True, num_warps=4)
    launch[(5, 2)](x, 41 + 15, 0.25, BLOCK=16, FLAG=True, num_warps=4)  # 56: same class as 40 (not 1, not ×16)
    assert paths(kernel) == ["triton", "cached"]
    args = kernel.launches[1][1]
    assert args == (5, 2, 1, 77, "function", "metadata", None, None, None, x, 56, 0.25, 16, True)


@pytest.mark.parametrize(
    "change",
    [
        dict(n=1),  # Triton makes an int of 1 a constant
        dict(n=48),  # and specializes multiples of 16
        dict(n=2**31),  # and 64-bit ints
        dict(x=torch.randn(64, dtype=torch.float64)),  # dtype
        dict(x=torch.randn(65)[1:]),  # a pointer off 16-byte alignment
        dict(BLOCK=32),  # a constexpr
        dict(num_warps=8),  # an option
        dict(scale=None),
    ],
)
def test_whatever_triton_specializes_on_is_a_new_key(kernel, change):
    launch = _launch.CachedLaunch(kernel)
    first = dict(x=torch.randn(64), n=40, scale=0.5, BLOCK=16, num_warps=4)
    for arguments in (first, {**first, **change}):
        launch[(1,)](arguments["x"], arguments["n"], arguments["scale"], BLOCK=arguments["BLOCK"], FLAG=False,
                     num_warps=arguments["num_warps"])  # fmt: skip
    assert paths(kernel) == ["triton", "triton"]


def test_unnamed_arguments_and_missing_parameters_always_take_tritons_path(kernel):
    launch = _launch.CachedLaunch(kernel)
    for _ in range(2):
        launch[(1,)](torch.randn(4), 3, object(), BLOCK=16, FLAG=False)  # no key for an object
        launch[(1,)](torch.randn(4), 3, 0.5, BLOCK=16)  # FLAG left to its default: cannot be replayed
        launch[lambda meta: (1,)](torch.randn(4), 3, 0.5, BLOCK=16, FLAG=False)  # a grid function
    assert paths(kernel) == ["triton"] * 6


@pytest.mark.parametrize("why", ["interpreter", "launch hook"])
def test_under_the_interpreter_or_a_launch_hook_every_launch_takes_tritons_path(kernel, monkeypatch, why):
    if why == "interpreter":
        monkeypatch.setattr(_launch, "interpreting", lambda: True)
    else:
        monkeypatch.setattr(_launch.knobs.runtime.launch_enter_hook, "calls", [print])
    launch = _launch.CachedLaunch(kernel)
    for _ in range(3):
        launch[(1,)](torch.randn(4), 3, 0.5, BLOCK=16, FLAG=False)
    assert paths(kernel) == ["triton"] * 3


def test_the_key_table_stays_bounded(kernel, monkeypatch):
    monkeypatch.setattr(_launch.CachedLaunch, "MAX_KEYS", 4)
    launch = _launch.CachedLaunch(kernel)
    for block in range(10):
        launch[(1,)](torch.randn(4), 3, 0.5, BLOCK=block, FLAG=False)
    assert len(launch.compiled) <= 4
