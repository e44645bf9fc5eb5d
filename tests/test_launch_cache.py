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


# ---------------------------------------------------------------------------------------------- recorded launches


class Launcher:
    """A compiled kernel's launcher surface: the C launcher (`launch`, here recording its arguments) and options."""

    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid = launch_pdl = False

    def __init__(self, calls):
        self.launch = lambda *args: calls.append(args)


class RawCompiled(Compiled):
    class metadata:
        tensordesc_meta = [{"swizzle": 3, "elem_size": 4, "elem_type": 7, "block_size": [8, 4], "fp4_padded": False}]

    def __init__(self, launches, raw_calls):
        super().__init__(launches)
        self.run = Launcher(raw_calls)


class DescKernel(StandInKernel):
    """A kernel taking (x_ptr, out_ptr, x_desc, offset, n, BLOCK)."""

    def __init__(self):
        super().__init__()
        self.raw_calls = []

    @staticmethod
    def fn(x_ptr, out_ptr, x_desc, offset, n, BLOCK):
        """The kernel's signature."""

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.launches.append(("triton", grid, args, kwargs))
            return RawCompiled(self.launches, self.raw_calls)

        return run


class HostDesc:
    def __init__(self, base, shape, strides, block):
        self.base, self.shape, self.strides, self.block_shape = base, shape, strides, block


def _record(launch, recording, x, out, user):
    def build(bind):
        desc = bind.desc(HostDesc, x, [x.shape[0], 4], [4, 1], [8, 4])
        return (bind.ptr(x[2:]), bind.ptr(out), desc, bind.diff(user, x, 4), x.shape[0])

    return _launch.launch(launch, (3,), build, recording, BLOCK=16)


def test_a_recorded_launch_replays_with_the_new_calls_addresses(monkeypatch):
    monkeypatch.setattr(_launch, "interpreting", lambda: False)
    monkeypatch.setattr(_launch, "driver", StandInDriver())
    monkeypatch.setattr(_launch, "_encode", lambda address, *encoding: ("map", address, *encoding[-2:]))
    kernel = DescKernel()
    x, user = torch.randn(64), torch.randn(40)
    recording = _launch.Recording(x=x, user=user)
    out = torch.empty(16)
    recording.name("out", out)
    _record(_launch.CachedLaunch(kernel), recording, x, out, user)
    assert not recording.failed and recording.fresh == {"out": ((16,), torch.float32)}
    (prepared,) = recording.steps
    new = {"x": 1 << 20, "user": (1 << 20) + 4 * 1000, "out": 1 << 30}  # other addresses, another offset of user
    prepared(55, new)
    (call,) = kernel.raw_calls
    assert call[:13] == (3, 1, 1, 55, "function", False, False, None, None, "metadata", None, None, None)
    x_map = ("map", new["x"], [64, 4], [4, 1])
    assert call[13:] == (new["x"] + 8, new["out"], x_map, 64, 4, 4, 1, 1000, 64, 16)


def test_a_launch_path_that_a_replay_cannot_repeat_keeps_nothing(monkeypatch):
    monkeypatch.setattr(_launch, "interpreting", lambda: False)
    monkeypatch.setattr(_launch, "driver", StandInDriver())
    kernel = DescKernel()
    x, user = torch.randn(64), torch.randn(40)
    unnamed = _launch.Recording(x=x, user=user)  # out not named: a copy made for this call, say
    _record(_launch.CachedLaunch(kernel), unnamed, x, torch.empty(16), user)
    assert unnamed.failed and unnamed.replay() is None
    aliased = _launch.Recording(x=x, user=x[8:48])  # two names over one storage
    assert aliased.failed
    filled = _launch.Recording(x=x, user=user)
    _launch.fail(filled)
    assert filled.failed
    assert len(kernel.launches) == 1  # the launch itself ran


def test_a_recorded_torch_call_replays_on_the_new_calls_tensors():
    a, b = torch.randn(3, 4), torch.randn(4, 2)
    recording = _launch.Recording(a=a, b=b)
    out = torch.empty(3, 2)
    recording.name("out", out)
    recording.call(torch.matmul, a, b, out=out)
    torch.testing.assert_close(out, a.double().matmul(b.double()).float())
    replay = recording.replay()
    a2, b2 = torch.randn(3, 4), torch.randn(4, 2)
    made = replay(0, "cpu", {"a": a2, "b": b2})
    torch.testing.assert_close(made["out"], a2.double().matmul(b2.double()).float())
    unnamed = _launch.Recording(a=a)
    unnamed.call(torch.matmul, a, b)  # b is not one of the call's named tensors
    assert unnamed.replay() is None
    twice = _launch.Recording(a=a, b=a)  # one tensor under two names: replayed only where it is one tensor again
    twice.name("out", torch.empty(3, 3))
    twice.call(torch.matmul, a, a.t(), out=twice.tensors["out"])
    assert twice.replay() is None  # a.t() is a view, not a named tensor
    twice = _launch.Recording(a=a, b=a)
    twice.name("out", torch.empty(3, 4))
    twice.call(torch.add, a, a, out=twice.tensors["out"])
    replay = twice.replay()
    assert replay(0, "cpu", {"a": a2, "b": torch.randn(3, 4)}) is None
    torch.testing.assert_close(replay(0, "cpu", {"a": a2, "b": a2})["out"], a2 + a2)
