"""Shared pieces of the IKBO ops: input checks, backend choice, the TMA check and the user→candidate combine.

Every op takes user tensors at U rows, candidate tensors at B rows and `cand_to_user` [B] (int32 or
int64, values in [0, U)). Nothing here replicates a user tensor to B rows.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
import warnings

import torch
import triton
import triton.language as tl
from torch._C._functorch import TransformType
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
from torch.autograd import forward_ad
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ._interpreter import interpreting
from ._launch import CachedLaunch, launch

BACKENDS = ("auto", "torch", "triton")
INDEX_TYPES = (torch.int32, torch.int64)


def check_tensor(name: str, t, rank: int, dtypes=None) -> None:
    """Raise ValueError unless `t` is a tensor of the given rank (and one of `dtypes`)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"{name}: expected rank {rank}, got shape {list(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name}: expected dtype in ({names}), got {str(t.dtype).replace('torch.', '')}")


def check_same(name: str, actual, expected_name: str, expected) -> None:
    if actual != expected:
        raise ValueError(f"{name}: expected {expected_name} = {expected}, got {actual}")


def _within(values: torch.Tensor, low: int, high: int) -> bool:
    """low <= values <= high everywhere, with one reduction and one device sync. True without
    looking while a CUDA graph is being captured (no sync is allowed there): the values are then
    the caller's to check before each replay (ikbo_backend/cuda_graphs.py)."""
    if values.is_cuda and torch.cuda.is_current_stream_capturing():
        return True
    lowest, highest = torch.aminmax(values)
    return bool((lowest >= low) & (highest <= high))


def _check_index_shape(name: str, t, length: int, length_name: str, device: torch.device) -> None:
    """The checks of an index tensor that need no values (no device→host wait): rank 1, int32/int64, `length`
    entries, on `device`."""
    check_tensor(name, t, 1, INDEX_TYPES)
    check_same(name, t.shape[0], length_name, length)
    if t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")


def check_mapping_shape(cand_to_user, num_candidates: int, device: torch.device) -> None:
    """The checks of check_mapping that need no values: rank, dtype, length, device."""
    _check_index_shape("cand_to_user", cand_to_user, num_candidates, "B (rows of the candidate tensor)", device)


def check_kv_len_shape(kv_len, num_users: int, device: torch.device) -> None:
    """The checks of check_kv_len that need no values: rank, dtype, length, device."""
    _check_index_shape("kv_len", kv_len, num_users, "U (rows of k)", device)


def check_mapping(cand_to_user, num_candidates: int, num_users: int, device: torch.device) -> None:
    """cand_to_user: [B] int32/int64 with every value in [0, U), on the inputs' device."""
    check_mapping_shape(cand_to_user, num_candidates, device)
    if num_candidates and not _within(cand_to_user, 0, num_users - 1):
        bad = cand_to_user[(cand_to_user < 0) | (cand_to_user >= num_users)][0]
        raise ValueError(f"cand_to_user: value {int(bad)} is outside [0, U={num_users})")


class HostFlag:
    """A verdict that a kernel writes straight into pinned host memory (a word of `_HostFlagRing`): 0 until the
    kernel has run, then 1 + its value (0: the index values are in range, 1: one is not). No copy and no event
    are enqueued: pinned memory is mapped into the device's address space (unified addressing), so the kernel's
    store crosses the bus itself. `done()` reads the word; `values()` waits for the stream it was enqueued on
    where it has not arrived. Kernels launched before the verdict is read must read and write nothing out of
    bounds for bad values."""

    __slots__ = ("ring", "index", "device", "stream")

    def __init__(self, device: torch.device):
        self.device = device.index if device.index is not None else torch.cuda.current_device()
        self.ring = _HostFlagRing.of(self.device)
        self.index = self.ring.take()
        self.stream = torch._C._cuda_getCurrentRawStream(self.device)

    @property
    def slot(self) -> torch.Tensor:
        """The word the kernel writes: pass it as the kernel's host-flag pointer."""
        return self.ring.slot(self.index)

    @property
    def address(self) -> int:
        """The slot's address, which is also its device address (pinned memory under unified addressing)."""
        return self.ring.address + self.index * _HostFlagRing.STRIDE * 4

    def done(self) -> bool:
        return bool(self.ring.view[self.index * _HostFlagRing.STRIDE])

    def values(self) -> list:
        if not self.done():
            torch.cuda.ExternalStream(self.stream, device=self.device).synchronize()
        word = int(self.ring.view[self.index * _HostFlagRing.STRIDE])
        if word == 0:
            raise RuntimeError("an IKBO kernel that checks index values did not run (its host flag is unwritten)")
        return [word - 1]


class _HostFlagRing:
    """Per device, pinned int32 words that kernels write their index-value verdicts to, handed out in turn. A word
    is zeroed when it is handed out and read once (`HostFlag`); SIZE exceeds the deferred checks that can be
    pending (`_DeferredChecks.MAX_PENDING`), so a word comes round again only after its check ran. Words lie
    16 bytes apart: Triton specializes pointers on 16-byte alignment, and one alignment keeps one binary."""

    SIZE = 4096
    STRIDE = 4  # int32 words between flags (16 bytes)
    _rings: dict = {}
    _lock = threading.Lock()

    def __init__(self, device: int):
        with torch.cuda.device(device):
            self.words = torch.zeros(self.SIZE * self.STRIDE, dtype=torch.int32, device="cpu", pin_memory=True)
        self.view = self.words.numpy()  # host reads and writes without a torch call
        self.address = self.words.data_ptr()
        self.slots: list = [None] * self.SIZE  # each word's one-element view, made once
        self.next = 0

    def slot(self, index: int) -> torch.Tensor:
        view = self.slots[index]
        if view is None:
            at = index * self.STRIDE
            view = self.slots[index] = self.words[at : at + 1]
        return view

    @classmethod
    def of(cls, device: int) -> _HostFlagRing:
        """The ring of CUDA device number `device`."""
        ring = cls._rings.get(device)
        if ring is None:
            with cls._lock:
                ring = cls._rings.setdefault(device, cls(device))
        return ring

    def take(self) -> int:
        with self._lock:
            index, self.next = self.next, (self.next + 1) % self.SIZE
        self.view[index * self.STRIDE] = 0
        return index


class _DeferredChecks:
    """Index-value checks of eager CUDA calls, read when their values have reached the host instead of
    waiting for them: an op launches its kernels (which clamp or skip bad values), hands its `HostFlag` (or
    anything with `done()` and `values()`) and a `check(values)` that raises the ValueError naming the input to
    `defer`, and returns. Each later IKBO call first runs the checks whose values have arrived (`poll`);
    `check_deferred()` waits for all of them. In strict mode (`strict_checks()`, or IKBO_STRICT_CHECKS=1)
    `defer` waits and raises at once, as a synchronous check would."""

    MAX_PENDING = 1024  # beyond this, the oldest check waits (a caller that never synchronizes)

    def __init__(self):
        self.pending: list[tuple[HostFlag, object]] = []
        self.lock = threading.Lock()
        self.strict = os.environ.get("IKBO_STRICT_CHECKS") == "1"

    def defer(self, readback: HostFlag, check) -> None:
        if self.strict:
            check(readback.values())
            return
        with self.lock:
            self.pending.append((readback, check))
            overflow = self.pending.pop(0) if len(self.pending) > self.MAX_PENDING else None
        if overflow is not None:
            overflow[1](overflow[0].values())

    def run(self, wait: bool) -> None:
        """Run the checks whose values have arrived (all of them with `wait`), oldest first, until one raises; the
        ones after it stay pending for the next poll. Without `wait` it stops at the first readback still in
        flight: readbacks enqueued on one stream arrive in order, so a poll costs one query however far the host
        runs ahead of the device (a readback on another stream waits its turn)."""
        while True:
            with self.lock:
                if not self.pending or not (wait or self.pending[0][0].done()):
                    return
                readback, check = self.pending.pop(0)
            check(readback.values())


DEFERRED = _DeferredChecks()


def poll_deferred() -> None:
    """Raise the ValueError of an earlier call whose index values have reached the host and are bad (not while a
    CUDA graph is being captured: querying an event there would break the capture)."""
    if DEFERRED.pending and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        DEFERRED.run(wait=False)


def route(*tensors) -> str:
    """How an IKBO call runs: "op", through its custom op, where something traces or intercepts it (torch.compile,
    torch.export, a dispatch mode, a torch.func vmap, a tensor subclass); "func", through the op's torch.func twin
    (`functorch_function`), under a torch.func transform that differentiates (grad, vjp, jacrev: the custom op's own
    autograd cannot run there); "autograd", through the op's eager twin (`eager_function`), where autograd
    differentiates it (grad mode and a plain input that requires grad); "direct", the op's implementation, otherwise.
    The four compute the same: the dispatcher's Python path costs about a kernel launch's host time a call, and a
    custom op's autograd wrapper several (about 0.3 ms a forward and backward on a CPU core). Forward-mode AD
    (torch.func.jvp, jacfwd, torch.autograd.forward_ad) raises: the kernels have no tangent rule, and the custom op
    would pass zero tangents on without a word."""
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return "op"
    if torch._C._functorch.peek_interpreter_stack() is not None:
        kinds = {interpreter.key() for interpreter in retrieve_all_functorch_interpreters()}
        if TransformType.Jvp in kinds:
            raise NotImplementedError(FORWARD_AD_MESSAGE)
        return "func" if TransformType.Grad in kinds else "op"
    if forward_ad._current_level >= 0 and any(
        t is not None and forward_ad.unpack_dual(t).tangent is not None for t in tensors
    ):
        raise NotImplementedError(FORWARD_AD_MESSAGE)
    grad = torch.is_grad_enabled()
    differentiated = False
    for t in tensors:
        if t is None:
            continue
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            return "op"
        differentiated = differentiated or (grad and t.requires_grad)
    return "autograd" if differentiated else "direct"


FORWARD_AD_MESSAGE = (
    "IKBO ops do not support forward-mode AD (torch.func.jvp, jacfwd, hessian, torch.autograd.forward_ad): their "
    "kernels have no tangent rule. Use reverse mode (backward(), torch.autograd.grad, torch.func.grad / vjp / jacrev)."
)


def through_dispatcher(*tensors) -> bool:
    """Whether a call must go through a custom op or autograd (`route` is not "direct")."""
    return route(*tensors) != "direct"


def eager_function(name: str, forward, setup_context, backward, once: bool = True):
    """The eager twin of a custom op with registered autograd: an autograd.Function whose forward is the op's
    implementation `forward(*inputs)`, with the op's `setup_context(ctx, inputs, output)` and `backward(ctx,
    *grads)`. The graph it builds is the op's (same saved tensors, same gradients); ctx.eager is set so that the
    backward can run its op's implementation directly (`backward_call`). `once`: the backward runs kernels that
    autograd cannot see through (as the ops' backward ops, which have no autograd), so a second derivative
    raises (`_first_derivative_only`) instead of coming out wrong. The context is set up inside forward: a Function
    with a separate setup_context binds its arguments through inspect.signature on every call (longer than the op's
    launches)."""

    def run(ctx, *inputs):
        output = forward(*inputs)
        setup_context(ctx, inputs, output)
        ctx.eager = True
        return output

    namespace = {
        "forward": staticmethod(run),
        "backward": staticmethod(_first_derivative_only(name, backward) if once else backward),
    }
    return type(name, (torch.autograd.Function,), namespace)


def functorch_function(name: str, forward, setup_context, backward, once: bool = True):
    """The torch.func twin of a custom op with registered autograd (`route` "func": under torch.func.grad, vjp,
    jacrev, also inside vmap): an autograd.Function with a separate setup_context, as torch.func requires (the
    custom op's autograd raises there). Its backward runs the op's backward implementation (`backward_call`; the
    backward op under a vmap, whose batching fallback loops); under vmap the forward runs once per batch entry, as
    the custom ops' batching fallback does."""

    def setup(ctx, inputs, output):
        setup_context(ctx, inputs, output)
        ctx.eager = True

    def vmap(info, in_dims, *inputs):
        def entry(index):
            if info.batch_size == 0:  # an entry of zeros gives the outputs' shapes (an index value 0 is in range)
                return [t if dim is None else t.new_zeros(t.shape[:dim] + t.shape[dim + 1 :]) for t, dim in pairs]
            return [t if dim is None else t.select(dim, index) for t, dim in pairs]

        pairs = list(zip(inputs, in_dims, strict=True))
        results = [cls.apply(*entry(index)) for index in range(max(info.batch_size, 1))]
        single = not isinstance(results[0], tuple)
        parts = [torch.stack(part)[: info.batch_size] for part in zip(*((r,) if single else r for r in results))]
        return (parts[0], 0) if single else (tuple(parts), (0,) * len(parts))

    namespace = {
        "forward": staticmethod(forward),
        "setup_context": staticmethod(setup),
        "backward": staticmethod(_first_derivative_only(name, backward) if once else backward),
        "vmap": staticmethod(vmap),
    }
    cls = type(name, (torch.autograd.Function,), namespace)
    return cls


class _SecondDerivative(torch.autograd.Function):
    """Passes first-order gradients on and raises when they are differentiated (the ops' backward has no formula)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(name, count, *tensors):
        return tuple(t.detach() for t in tensors[:count])

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.name = inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            f"{ctx.name}: double backward (differentiating a gradient of an IKBO op: create_graph=True, "
            "torch.autograd.gradgradcheck, a gradient penalty, a Hessian) is not supported: the backward runs kernels "
            "without a derivative formula of their own"
        )


def _first_derivative_only(name: str, backward):
    """`backward` run without recording, its gradients tied (under create_graph=True) to every input they depend on
    through a node that raises when differentiated: torch's once_differentiable ties them only to the incoming
    gradients, so a second derivative in the saved inputs (a gradient penalty: grad of a loss in the weights of
    ‖d out / d x‖²) came out as silent zeros."""

    def wrapped(ctx, *grads):
        with torch.no_grad():
            results = backward(ctx, *grads)
        if not torch.is_grad_enabled():
            return results
        sources = [t for t in (*grads, *ctx.saved_tensors) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not sources:
            return results
        results = tuple(results) if isinstance(results, tuple) else (results,)
        present = [i for i, t in enumerate(results) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        tied = _SecondDerivative.apply(name, len(present), *(results[i] for i in present), *sources)
        results = list(results)
        for i, t in zip(present, tied, strict=True):
            results[i] = t
        return tuple(results)

    return wrapped


def backward_call(ctx, op, impl, *tensors):
    """The backward op to call from a registered backward: its implementation `impl` under an eager or torch.func
    twin on plain tensors (`route`), else the custom op `op` (whose trace or interception the caller is in; inside a
    torch.func vmap its batching fallback hands the implementation one batch entry at a time)."""
    if not getattr(ctx, "eager", False) or _vmapped():
        return op
    return impl if route(*tensors) != "op" else op


def _vmapped() -> bool:
    """Whether a torch.func vmap is active (its batched tensors cannot run the implementations' host code)."""
    return torch._C._functorch.peek_interpreter_stack() is not None and any(
        interpreter.key() == TransformType.Vmap for interpreter in retrieve_all_functorch_interpreters()
    )


def autocast_inputs(device: torch.device, *tensors):
    """The float inputs as torch.autocast would hand them to matmul: in the autocast dtype where autocast is on for
    their device (float64 and None unchanged), else as they are. The public entries cast before their checks, so an op
    inside an autocast region runs in one dtype and returns it (autograd casts the gradients back)."""
    if device.type not in ("cpu", "cuda") or not torch.is_autocast_enabled(device.type):
        return tensors
    dtype = torch.get_autocast_dtype(device.type)
    return tuple(
        t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64 else t
        for t in tensors
    )


def check_deferred() -> None:
    """Wait for the index values of every earlier eager call and raise the ValueError of a bad one."""
    DEFERRED.run(wait=True)


@contextlib.contextmanager
def strict_checks(enabled: bool = True):
    """Within: each eager CUDA call waits for its index values and raises at once on a bad one."""
    previous, DEFERRED.strict = DEFERRED.strict, enabled
    try:
        yield
    finally:
        DEFERRED.strict = previous


def check_kv_len(kv_len, num_users: int, max_len: int, device: torch.device):
    """kv_len: [U] int32/int64 in [0, L], or None for L everywhere. Returns an int64 tensor."""
    if kv_len is None:
        return torch.full((num_users,), max_len, dtype=torch.int64, device=device)
    check_kv_len_shape(kv_len, num_users, device)
    if num_users and not _within(kv_len, 0, max_len):
        raise ValueError(f"kv_len: values must lie in [0, L={max_len}], got [{int(kv_len.min())}, {int(kv_len.max())}]")
    return kv_len.long()


def resolve_backend(backend: str, device: torch.device, triton_available: bool) -> str:
    """ "auto" → Triton on CUDA tensors when the op has a Triton path, else torch."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available else "torch"
    if backend == "triton" and not triton_available:
        raise NotImplementedError("backend='triton': this op has no Triton path yet; use 'torch' or 'auto'")
    return backend


def tma_ok(t: torch.Tensor) -> bool:
    """Whether a tensor descriptor can address `t`: non-empty, unit last stride, 16-byte aligned base and strides."""
    elem = t.element_size()
    return (
        t.numel() > 0
        and t.stride(-1) == 1
        and t.data_ptr() % 16 == 0
        and all(s * elem % 16 == 0 for s in t.stride()[:-1])
    )


@functools.cache
def _quiet_sparse_csr_notice() -> None:
    """Sparse CSR is stable enough for the one product used here: silence its "beta" notice (once, at first use)."""
    warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")


def selection_matrix(cand_to_user: torch.Tensor, num_users: int, dtype: torch.dtype) -> torch.Tensor:
    """The mapping as a sparse [B, U] CSR matrix P with P[b, m[b]] = 1 (one nonzero per row)."""
    _quiet_sparse_csr_notice()
    num_candidates = cand_to_user.shape[0]
    device = cand_to_user.device
    return torch.sparse_csr_tensor(
        torch.arange(num_candidates + 1, device=device, dtype=torch.int64),
        cand_to_user.long(),
        torch.ones(num_candidates, device=device, dtype=dtype),
        size=(num_candidates, num_users),
        check_invariants=False,
    )


def check_mapping_values(cand_to_user: torch.Tensor, num_users: int, recording=None) -> None:
    """The value check of `check_mapping` without a host wait on CUDA: on the CPU (and inside a CUDA-graph
    capture, where the caller checks) as `check_mapping`; on CUDA one program compares the mapping with [0, U)
    behind the caller's kernels and writes its verdict to pinned host memory (`HostFlag`), checked when it has
    arrived (`DEFERRED`; at once in strict mode). The kernels that run before the check must clamp or skip
    out-of-range values. With `recording` (kernels._launch) the check's launch is kept for replay, its host word named
    "host_flag"."""
    num_candidates = cand_to_user.shape[0]
    if not cand_to_user.is_cuda:
        check_mapping(cand_to_user, num_candidates, num_users, cand_to_user.device)
        return
    if num_candidates == 0 or torch.cuda.is_current_stream_capturing():
        return
    if num_users == 0:
        raise ValueError(f"cand_to_user: {num_candidates} candidates but no users (U = 0)")
    flag = HostFlag(cand_to_user.device)
    if recording is not None:
        recording.tensors["host_flag"] = flag.slot
    index_check(cand_to_user, num_users - 1, flag.slot, recording)
    DEFERRED.defer(flag, functools.partial(raise_bad_mapping, cand_to_user, num_users))


def raise_bad_mapping(cand_to_user: torch.Tensor, num_users: int, verdict: list, kv_len=None, seq_len=0) -> None:
    """The ValueError of a deferred check whose device verdict (`HostFlag` values) says a value was out of range:
    the bad value read again from the tensors (the host waits here, on the error path only)."""
    if not verdict[0]:
        return
    check_mapping(cand_to_user, cand_to_user.shape[0], num_users, cand_to_user.device)
    if kv_len is not None:
        check_kv_len(kv_len, num_users, seq_len, kv_len.device)
    names = "cand_to_user" if kv_len is None else "cand_to_user or kv_len"
    raise ValueError(f"{names}: a value was out of range when the op ran (the tensor has changed since)")


@triton.jit(do_not_specialize=["n", "high"])  # one binary for every batch size (no n == 1 or n % 16 variants)
def _index_check_kernel(values_ptr, n, stride, high, flag_ptr, BLOCK: tl.constexpr):
    """flag [1] int32 = 1 + (any of values[:n] (elements `stride` apart) outside [0, high]), n ≥ 1: one program,
    BLOCK values a step. 0 is left for "not written yet" (`HostFlag`)."""
    offsets = tl.arange(0, BLOCK)
    bad = tl.full([BLOCK], 0, tl.int32)
    for start in tl.range(0, n, BLOCK):
        mask = start + offsets < n
        value = tl.load(values_ptr + (start + offsets).to(tl.int64) * stride, mask=mask, other=0).to(tl.int64)
        bad = tl.maximum(bad, (mask & ((value < 0) | (value > high))).to(tl.int32))
    tl.store(flag_ptr, 1 + tl.max(bad, 0))


_index_check_launch = CachedLaunch(_index_check_kernel)


def index_check(values: torch.Tensor, high: int, flag: torch.Tensor, recording=None) -> None:
    """flag[0] = 1 + (any value of a non-empty 1-D int32/int64 tensor outside [0, high]), in one launch; `flag` a
    pinned host word (`HostFlag.slot`) or a device tensor. One program walks the values (about a microsecond per
    4,096 on the H200), far below the kernels a batch that size feeds."""
    block = 256 if interpreting() else 4096

    def build(bind):
        return bind.ptr(values), values.shape[0], values.stride(0), high, bind.ptr(flag)

    launch(_index_check_launch, (1,), build, recording, BLOCK=block, num_warps=8)


@triton.jit
def _add_user_rows_kernel(out_ptr, cand_ptr, user_ptr, m_ptr, row_len, num_users, BLOCK: tl.constexpr):
    """out[b, i] = cand[b, i] + user[m[b], i] in fp32, one row chunk per program; m[b] clamped to [0, U)."""
    b = tl.program_id(0).to(tl.int64)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < row_len
    user = tl.minimum(tl.maximum(tl.load(m_ptr + b).to(tl.int64), 0), num_users - 1)
    cand = tl.load(cand_ptr + b * row_len + offsets, mask=mask).to(tl.float32)
    value = cand + tl.load(user_ptr + user * row_len + offsets, mask=mask).to(tl.float32)
    tl.store(out_ptr + b * row_len + offsets, value.to(out_ptr.dtype.element_ty), mask=mask)


_add_user_rows_launch = CachedLaunch(_add_user_rows_kernel)


def _add_user_rows_sparse(cand_part: torch.Tensor, user_part: torch.Tensor, cand_to_user: torch.Tensor) -> torch.Tensor:
    """The CPU combine: one sparse-dense addmm through the selection matrix (batch invariant: each output row
    is its candidate row plus one user row)."""
    # 16-bit inputs are added in float32: the MKL sparse kernels have no bfloat16, and fp32 costs one
    # cast of [B, ...] against no loss of precision
    compute = torch.float32 if cand_part.dtype in (torch.float16, torch.bfloat16) else cand_part.dtype
    select = selection_matrix(cand_to_user, user_part.shape[0], compute)
    cand_rows = cand_part.reshape(cand_part.shape[0], -1).to(compute)
    # in the inputs' dtype under torch.autocast too: it would cast the fp32 operands to 16 bits, which MKL lacks
    with torch.autocast("cpu", enabled=False):
        out = torch.sparse.addmm(cand_rows, select, user_part.reshape(user_part.shape[0], -1).to(compute))
    return out.to(cand_part.dtype).reshape(cand_part.shape)


@torch.library.custom_op("ikbo::add_user_rows", mutates_args=())
def _add_user_rows_op(cand_part: torch.Tensor, user_part: torch.Tensor, cand_to_user: torch.Tensor) -> torch.Tensor:
    return _add_user_rows(cand_part, user_part, cand_to_user)


def _add_user_rows(cand_part: torch.Tensor, user_part: torch.Tensor, cand_to_user: torch.Tensor) -> torch.Tensor:
    """The op's implementation for checked inputs: the sparse addmm on the CPU, the gather-add kernel on CUDA."""
    poll_deferred()
    if cand_part.shape[0] == 0:
        return cand_part.clone()
    check_mapping_values(cand_to_user, user_part.shape[0])
    if not cand_part.is_cuda:
        return _add_user_rows_sparse(cand_part, user_part, cand_to_user)
    return add_user_rows_triton(cand_part, user_part, cand_to_user)


def add_user_rows_triton(cand_part, user_part, cand_to_user, out=None) -> torch.Tensor:
    """The CUDA combine (also under TRITON_INTERPRET=1): one gather-add launch. `out` may be given (tests
    poison it)."""
    cand, user = cand_part.contiguous(), user_part.contiguous()
    out = torch.empty_like(cand) if out is None else out
    row_len = cand[0].numel() if cand.shape[0] else 0
    if row_len and user.shape[0]:
        block = min(4096, triton.next_power_of_2(row_len))
        grid = (cand.shape[0], triton.cdiv(row_len, block))
        _add_user_rows_launch[grid](out, cand, user, cand_to_user, row_len, user.shape[0], BLOCK=block)
    return out


@_add_user_rows_op.register_fake
def _(cand_part, user_part, cand_to_user):
    return torch.empty_like(cand_part, memory_format=torch.contiguous_format)


def _add_user_rows_setup(ctx, inputs, output):
    _, user_part, cand_to_user = inputs
    ctx.save_for_backward(cand_to_user)
    ctx.user_shape, ctx.user_dtype = user_part.shape, user_part.dtype


def _add_user_rows_backward(ctx, grad):
    """d_cand = g; d_user[u] = Σ_{b: m[b] = u} g[b], a segment sum in fp32 (never g's user rows at B rows)."""
    (cand_to_user,) = ctx.saved_tensors
    d_user = None
    if ctx.needs_input_grad[1]:
        compute = torch.float32 if grad.dtype in (torch.float16, torch.bfloat16) else grad.dtype
        rows = grad.reshape(grad.shape[0], math.prod(ctx.user_shape[1:])).to(compute)
        sums = rows.new_zeros(ctx.user_shape[0], rows.shape[1])
        index = cand_to_user.long().clamp(0, max(ctx.user_shape[0] - 1, 0))
        d_user = sums.index_add_(0, index, rows).to(ctx.user_dtype).reshape(ctx.user_shape)
    return grad if ctx.needs_input_grad[0] else None, d_user, None


_add_user_rows_op.register_autograd(_add_user_rows_backward, setup_context=_add_user_rows_setup)
_AddUserRows = eager_function("_AddUserRows", _add_user_rows, _add_user_rows_setup, _add_user_rows_backward, once=False)
_AddUserRowsFunc = functorch_function(
    "_AddUserRowsFunc", _add_user_rows, _add_user_rows_setup, _add_user_rows_backward, once=False
)


def add_user_rows(cand_part: torch.Tensor, user_part: torch.Tensor, cand_to_user: torch.Tensor) -> torch.Tensor:
    """out[b] = cand_part[b] + user_part[m[b]]  — the Type I combine, a custom op with autograd.

    cand_part: [B, ...], user_part: [U, ...] (same trailing shape, same floating dtype), cand_to_user [B]
    in [0, U) → [B, ...]. The user rows are never copied to B rows: on the CPU they are read through the
    sparse selection matrix (one addmm), on CUDA by a gather-add kernel; the backward sums g over each
    user's candidates (d_user) and passes g to cand_part. Mapping values are checked on the CPU at once,
    on CUDA without a host wait (`check_deferred`, `strict_checks`).
    """
    for name, t in (("cand_part", cand_part), ("user_part", user_part)):
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            raise ValueError(f"{name}: expected a torch.Tensor with a leading row dimension, got {t!r:.60}")
        if not t.is_floating_point():
            raise ValueError(f"{name}: expected a floating dtype, got {str(t.dtype).replace('torch.', '')}")
    if user_part.shape[1:] != cand_part.shape[1:]:
        raise ValueError(
            f"user_part: trailing shape {list(user_part.shape[1:])} != cand_part's {list(cand_part.shape[1:])}"
        )
    if user_part.dtype != cand_part.dtype or user_part.device != cand_part.device:
        raise ValueError(
            f"user_part: expected {cand_part.dtype} on {cand_part.device} like cand_part, "
            f"got {user_part.dtype} on {user_part.device}"
        )
    check_mapping_shape(cand_to_user, cand_part.shape[0], cand_part.device)
    way = route(cand_part, user_part, cand_to_user)
    if way == "direct":
        return _add_user_rows(cand_part, user_part, cand_to_user)
    if way == "autograd":
        return _AddUserRows.apply(cand_part, user_part, cand_to_user)
    if way == "func":
        return _AddUserRowsFunc.apply(cand_part, user_part, cand_to_user)
    return torch.ops.ikbo.add_user_rows.default(cand_part, user_part, cand_to_user)


def group_by_user(cand_to_user: torch.Tensor, num_users: int):
    """Segment candidates by user once per batch.

    Returns (order, counts, slot): `order` [B] sorts candidates by user (stable), `counts` [U] is the
    number of candidates per user, and `slot` [B] is each sorted candidate's position inside its user.
    """
    mapping = cand_to_user.long()
    order = torch.argsort(mapping, stable=True)
    counts = torch.bincount(mapping, minlength=num_users)
    starts = torch.cumsum(counts, 0) - counts
    sorted_users = mapping[order]
    slot = torch.arange(mapping.shape[0], device=mapping.device) - starts[sorted_users]
    return order, counts, slot
