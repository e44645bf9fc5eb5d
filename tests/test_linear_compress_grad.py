"""Gradients of IKBO linear compression: the custom op `ikbo::linear_compress` and its backward op against fp64.

- CPU: `torch.autograd.gradcheck` in fp64 through the public function (torch path) and through
  PackedLinearCompress (its Parameters swapped in by `torch.func.functional_call`), on hypothesis-drawn shapes
  (U = 1, B = 1, users without candidates, unsorted mappings, Ku = 0, bias or none) and named corners (B = 0,
  Kc = 0); `needs_input_grad` respected;
- the torch-path forward and backward functions under `ReplicationDetector` (a dispatch mode sees a custom op as
  one op, so the functions inside it run there): no user tensor at B rows;
- an optimizer step on PackedLinearCompress: its padded-weight cache follows the updated Parameters;
- torch.compile(fullgraph=True) (aot_eager: the backward graph too; and under no_grad) of a module calling
  `ikbo_linear_compress` and of one holding a PackedLinearCompress, against eager; torch.export of both; eager calls
  run the implementation without autograd, the op's eager twin with it, the op under a dispatch mode (inductor on
  the CPU also matches, in about a minute: not run here);
- the Triton backward kernels under TRITON_INTERPRET=1 (the `interpreted_*` tests, run by `test_triton_interpreted`
  in a child process, with the out-of-bounds memcheck of tests/interpreted.py) on small fp16 shapes against fp64
  autograd of a replicated reference, every gradient written into NaN-poisoned buffers, the user sums both in the
  dW_c pass and apart;
- the same kernels compiled for sm_90a on the CPU under a stand-in driver (the `standin_` test in a child process):
  no register spills, the weight-gradient GEMM with its TMA ring;
- on CUDA (skipped without): every gradient at real sizes in bf16 (rel err ≤ 2e-2 against the fp64 torch path,
  buffers poisoned first), both kernels of d_cand_emb and both forms of the user sums, the public op's autograd, the
  optimizer step, inductor, and a bad mapping raising at `check_deferred()` and in strict mode.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from interpreted import run_child_tests, run_interpreted

from ikbo_backend.transform import ReplicationDetector
from kernels import PackedLinearCompress, check_deferred, ikbo_linear_compress, strict_checks
from kernels import linear_compress as lce
from kernels.reference import rel_err

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
HAS_CUDA = torch.cuda.is_available()
FP16_TOL = 5e-3
BF16_TOL = 2e-2
GRAD_NAMES = ("user_emb", "cand_emb", "user_weight", "cand_weight", "bias")


@dataclass(frozen=True)
class Case:
    num_user_tokens: int  # Ku
    num_cand_tokens: int  # Kc
    dim: int  # D
    rows: int  # N
    num_users: int  # U
    mapping: tuple  # cand_to_user, length B
    with_bias: bool
    seed: int


def make_inputs(case: Case, dtype=torch.float64, device="cpu"):
    """user_emb [U, Ku, D], cand_emb [B, Kc, D], cand_to_user [B] int32, weight [N, Ku + Kc], bias [N] or None, and an
    upstream gradient dout [B, N, D]; fresh random values."""
    gen = torch.Generator().manual_seed(case.seed)
    ku, kc, d, n = case.num_user_tokens, case.num_cand_tokens, case.dim, case.rows
    tensors = [
        torch.randn(case.num_users, ku, d, generator=gen),
        torch.randn(len(case.mapping), kc, d, generator=gen),
        torch.randn(n, ku + kc, generator=gen) / max(1, ku + kc) ** 0.5,
        torch.randn(n, generator=gen),
        torch.randn(len(case.mapping), n, d, generator=gen),
    ]
    user_emb, cand_emb, weight, bias, grad_out = (t.to(device=device, dtype=dtype) for t in tensors)
    cand_to_user = torch.tensor(case.mapping, dtype=torch.int32, device=device)
    return user_emb, cand_emb, cand_to_user, weight, bias if case.with_bias else None, grad_out


def replicated(user_emb, cand_emb, cand_to_user, weight, bias):
    """The broadcasting formula, for reference only: user rows replicated to B rows, one GEMM."""
    tokens = torch.cat([user_emb[cand_to_user.long()], cand_emb], dim=1)  # [B, Ku + Kc, D]
    out = torch.matmul(weight, tokens)
    return out if bias is None else out + bias[:, None]


def reference_grads(case: Case, inputs):
    """fp64 autograd of `replicated`: (d_user_emb, d_cand_emb, d_user_weight, d_cand_weight, d_bias or None)."""
    user_emb, cand_emb, cand_to_user, weight, bias, grad_out = (
        None if t is None else t.detach().double().cpu() for t in inputs
    )
    leaves = [t.requires_grad_() for t in (user_emb, cand_emb, weight)] + (
        [bias.requires_grad_()] if bias is not None else []
    )
    out = replicated(user_emb, cand_emb, cand_to_user.cpu(), weight, bias)
    grads = torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
    d_user, d_cand, d_weight = (
        torch.zeros_like(t) if g is None else g for g, t in zip(grads[:3], leaves, strict=False)
    )
    ku = case.num_user_tokens
    return d_user, d_cand, d_weight[:, :ku], d_weight[:, ku:], grads[3] if bias is not None else None


@st.composite
def cases(draw, max_users=3, max_candidates=4, max_tokens=3, max_dim=3, max_rows=3):
    num_users = draw(st.integers(1, max_users))
    num_candidates = draw(st.integers(1, max_candidates))
    mapping = draw(st.lists(st.integers(0, num_users - 1), min_size=num_candidates, max_size=num_candidates))
    return Case(
        num_user_tokens=draw(st.integers(0, max_tokens)),
        num_cand_tokens=draw(st.integers(1, max_tokens)),
        dim=draw(st.integers(1, max_dim)),
        rows=draw(st.integers(1, max_rows)),
        num_users=num_users,
        mapping=tuple(mapping),
        with_bias=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


CORNERS = [
    Case(2, 3, 3, 2, 1, (0,), True, 1),  # U = 1, B = 1
    Case(2, 2, 2, 3, 4, (3, 3, 1), True, 2),  # users 0 and 2 without candidates, unsorted
    Case(0, 3, 2, 2, 2, (1, 0, 1), False, 3),  # Ku = 0, no bias
    Case(3, 0, 2, 2, 2, (1, 0), True, 4),  # Kc = 0
    Case(2, 2, 2, 2, 3, (), True, 5),  # B = 0
]


def _corner_id(case: Case) -> str:
    return f"U{case.num_users}-B{len(case.mapping)}-Ku{case.num_user_tokens}-Kc{case.num_cand_tokens}"


# ---------------------------------------------------------------- CPU: gradcheck (torch path)


def _gradcheck(case: Case) -> None:
    user_emb, cand_emb, cand_to_user, weight, bias, _ = make_inputs(case)
    leaves = [user_emb, cand_emb, weight] + ([bias] if bias is not None else [])
    for t in leaves:
        t.requires_grad_()

    def functional(user_emb, cand_emb, weight, bias=None):
        return ikbo_linear_compress(user_emb, cand_emb, cand_to_user, weight, bias)

    assert torch.autograd.gradcheck(functional, leaves), case
    packed = PackedLinearCompress.from_weight(weight, case.num_user_tokens, bias)
    ku = case.num_user_tokens

    def through_module(user_emb, cand_emb, weight, bias=None):
        params = {"user_weight": weight[:, :ku], "cand_weight": weight[:, ku:], "bias": bias}
        return torch.func.functional_call(packed, params, (user_emb, cand_emb, cand_to_user))

    assert torch.autograd.gradcheck(through_module, leaves), case


@pytest.mark.parametrize("case", CORNERS, ids=_corner_id)
def test_gradcheck_corners(case):
    _gradcheck(case)


@settings(max_examples=8, deadline=None)
@given(case=cases())
def test_gradcheck_drawn(case):
    _gradcheck(case)


@settings(max_examples=10, deadline=None)
@given(case=cases(max_users=5, max_candidates=7), bad=st.booleans())
def test_user_sums_by_selection_matrix(case, bad):
    """dY_u by the one-hot selection GEMM (the CUDA choice for few users) equals the fp64 sum over each user's
    candidates, users without candidates at zero; an out-of-range mapping value adds to no user."""
    *_, cand_to_user, _, _, grad_out = make_inputs(case, torch.float32)
    if bad:
        cand_to_user[0] = case.num_users  # reported by the op's deferred check; here: nothing out of bounds
    got = lce._user_gradients(grad_out, cand_to_user, case.num_users, method="selection")
    want = torch.zeros(case.num_users, *grad_out.shape[1:], dtype=torch.float64)
    scale = torch.zeros_like(want)  # Σ |g| per entry: fp32 rounding of a sum is bounded by it, not by |Σ g|
    for b, u in enumerate(cand_to_user.tolist()):
        if 0 <= u < case.num_users:
            want[u] += grad_out[b].double()
            scale[u] += grad_out[b].double().abs()
    # within fp32 rounding of each sum's terms (a cancelling sum has a tiny |Σ g|); users without candidates exactly 0
    assert ((got.double() - want).abs() <= 1e-6 * scale).all(), (got, want)
    with pytest.raises(ValueError, match="method"):
        lce._user_gradients(grad_out, cand_to_user, case.num_users, method="sorted")


def test_backward_computes_only_what_is_needed(monkeypatch):
    """needs_input_grad reaches the backward op: a frozen weight and a constant input get no gradient computed."""
    case = Case(3, 2, 4, 5, 2, (1, 0, 1), True, 7)
    user_emb, cand_emb, cand_to_user, weight, bias, grad_out = make_inputs(case)
    seen = []
    backward = lce._linear_compress_backward_torch

    def recording(*args):
        seen.append(tuple(args[-1]))
        return backward(*args)

    monkeypatch.setattr(lce, "_linear_compress_backward_torch", recording)
    cand_emb.requires_grad_()
    out = ikbo_linear_compress(user_emb, cand_emb, cand_to_user, weight, bias)
    (d_cand,) = torch.autograd.grad(out, cand_emb, grad_out)
    assert seen == [(False, True, False, False, False)]
    ref = reference_grads(case, (user_emb, cand_emb, cand_to_user, weight, bias, grad_out))
    assert rel_err(d_cand, ref[1]) <= 1e-12


def test_weight_grads_reach_weight_and_bias():
    """The functional op slices `weight` outside the op: its gradient is the two column blocks' gradients."""
    case = Case(3, 4, 5, 6, 3, (2, 0, 1, 0, 2), True, 8)
    user_emb, cand_emb, cand_to_user, weight, bias, grad_out = make_inputs(case)
    weight.requires_grad_()
    bias.requires_grad_()
    ikbo_linear_compress(user_emb, cand_emb, cand_to_user, weight, bias).backward(grad_out)
    _, _, d_user_weight, d_cand_weight, d_bias = reference_grads(
        case, (user_emb, cand_emb, cand_to_user, weight, bias, grad_out)
    )
    assert rel_err(weight.grad, torch.cat([d_user_weight, d_cand_weight], dim=1)) <= 1e-12
    assert rel_err(bias.grad, d_bias) <= 1e-12


@settings(max_examples=6, deadline=None)
@given(case=cases(max_users=4, max_candidates=5), packed=st.booleans())
def test_double_backward_raises(case, packed):
    """A gradient penalty (d/dW of ‖d out / d user_emb‖²) and gradgradcheck raise; the first derivative taken with
    create_graph=True is right. The eager twin's backward used to tie its gradients to the incoming gradient only, so
    the penalty's derivative in the weights came out as silent zeros."""
    user_emb, cand_emb, cand_to_user, weight, bias, grad_out = make_inputs(case)
    leaves = [t.requires_grad_() for t in (user_emb, cand_emb, weight)]
    module = PackedLinearCompress.from_weight(weight, case.num_user_tokens, bias) if packed else None

    def layer(user_emb, cand_emb, weight):
        if packed:
            return module(user_emb, cand_emb, cand_to_user)
        return ikbo_linear_compress(user_emb, cand_emb, cand_to_user, weight, bias)

    out = layer(*leaves)
    (d_cand,) = torch.autograd.grad(out, cand_emb, grad_out, create_graph=True)
    assert (
        rel_err(d_cand.detach(), reference_grads(case, (*leaves[:2], cand_to_user, weight, bias, grad_out))[1]) <= 1e-12
    )
    penalty_in = module.cand_weight if packed else weight
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(d_cand.square().sum(), penalty_in)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.gradgradcheck(layer, leaves)


def test_forward_mode_ad_raises():
    """torch.func.jvp passed zero tangents through the custom op silently: forward-mode AD raises instead."""
    case = Case(2, 3, 4, 3, 3, (2, 0, 2, 1), True, 11)
    user_emb, cand_emb, cand_to_user, weight, bias, _ = make_inputs(case)
    with pytest.raises(NotImplementedError, match="forward-mode AD"):
        torch.func.jvp(lambda w: ikbo_linear_compress(user_emb, cand_emb, cand_to_user, w, bias), (weight,), (weight,))
    with torch.autograd.forward_ad.dual_level(), pytest.raises(NotImplementedError, match="forward-mode AD"):
        dual = torch.autograd.forward_ad.make_dual(user_emb, torch.randn_like(user_emb))
        ikbo_linear_compress(dual, cand_emb, cand_to_user, weight, bias)


@settings(max_examples=6, deadline=None)
@given(case=cases(max_users=4, max_candidates=5))
def test_torch_func_grad_and_per_candidate_grads(case):
    """torch.func.grad in every float input (the custom op's autograd raises under torch.func: the op's torch.func
    twin runs), and vmap(grad) per candidate, against fp64 autograd of the replicated formula."""
    user_emb, cand_emb, cand_to_user, weight, bias, grad_out = make_inputs(case)
    bias = torch.randn(case.rows, dtype=torch.float64) if bias is None else bias

    def loss(user_emb, cand_emb, weight, bias):
        return (ikbo_linear_compress(user_emb, cand_emb, cand_to_user, weight, bias) * grad_out).sum()

    got = torch.func.grad(loss, argnums=(0, 1, 2, 3))(user_emb, cand_emb, weight, bias)
    ref = reference_grads(case, (user_emb, cand_emb, cand_to_user, weight, bias, grad_out))
    for g, want in zip(got, (ref[0], ref[1], torch.cat(ref[2:4], dim=1), ref[4]), strict=True):
        assert rel_err(g, want) <= 1e-12

    def one(weight, cand_row, user, grad_row):  # one candidate's loss
        out = ikbo_linear_compress(user_emb, cand_row[None], user[None], weight, bias)
        return (out * grad_row[None]).sum()

    per_candidate = torch.func.vmap(torch.func.grad(one), in_dims=(None, 0, 0, 0))(
        weight, cand_emb, cand_to_user, grad_out
    )
    for b, user in enumerate(case.mapping):
        tokens = torch.cat([user_emb[user], cand_emb[b]])  # [Ku + Kc, D]: one candidate, for the reference only
        assert rel_err(per_candidate[b], grad_out[b] @ tokens.T) <= 1e-12


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("packed", [False, True], ids=["functional", "packed"])
def test_autocast_on_the_cpu(dtype, packed):
    """Under torch.autocast the float inputs are cast as matmul casts them (the op ran its two GEMMs in different
    dtypes and failed inside, or the MKL sparse product lacked 16 bits); gradients come back in fp32."""
    case = Case(3, 4, 6, 5, 3, (2, 0, 2, 1, 0), True, 12)
    user_emb, cand_emb, cand_to_user, weight, bias, grad_out = make_inputs(case, dtype=torch.float32)
    leaves = [t.requires_grad_() for t in (user_emb, cand_emb, weight, bias)]
    module = PackedLinearCompress.from_weight(weight, case.num_user_tokens, bias) if packed else None
    with torch.autocast("cpu", dtype=dtype):
        if packed:
            out = module(user_emb, cand_emb, cand_to_user)
        else:
            out = ikbo_linear_compress(user_emb, cand_emb, cand_to_user, weight, bias)
    assert out.dtype == dtype
    out.float().backward(grad_out)
    ref_out = replicated(
        *(t.detach().double() for t in leaves[:2]), cand_to_user, *(t.detach().double() for t in leaves[2:])
    )
    assert rel_err(out, ref_out) <= 2e-2
    ref = reference_grads(case, (*leaves[:2], cand_to_user, weight, bias, grad_out))
    got = [user_emb.grad, cand_emb.grad, weight.grad, bias.grad]
    if packed:
        got[2:] = torch.cat([module.user_weight.grad, module.cand_weight.grad], 1), module.bias.grad
    for g, want in zip(got, (ref[0], ref[1], torch.cat(ref[2:4], dim=1), ref[4]), strict=True):
        assert g.dtype == torch.float32 and rel_err(g, want) <= 3e-2


# ---------------------------------------------------------------- no user tensor at B rows


def test_torch_path_never_replicates_user_rows():
    """U = 5, B = 11 and every other dim distinct from both: a float tensor of B rows made only from U-row inputs
    would be a replicated user tensor."""
    case = Case(3, 4, 6, 7, 5, (4, 0, 0, 2, 4, 4, 1, 0, 2, 2, 4), True, 9)
    user_emb, cand_emb, cand_to_user, weight, bias, grad_out = make_inputs(case)
    user_weight, cand_weight = weight[:, :3], weight[:, 3:]
    detector = ReplicationDetector(case.num_users, len(case.mapping))
    with detector:
        lce._linear_compress_torch(user_emb, cand_emb, cand_to_user, user_weight, cand_weight, bias)
        grads = lce._linear_compress_backward_torch(
            grad_out, user_emb, cand_emb, cand_to_user, user_weight, cand_weight, (True,) * 5
        )
    assert detector.replications == []
    ref = reference_grads(case, (user_emb, cand_emb, cand_to_user, weight, bias, grad_out))
    for name, got, want in zip(GRAD_NAMES, grads, ref, strict=True):
        assert rel_err(got, want) <= 1e-12, name


# ---------------------------------------------------------------- training: the padded cache follows the weights


def _optimizer_step_changes_result(device, dtype, backend, tol) -> None:
    case = Case(20, 13, 16, 24, 3, (2, 0, 1, 0, 2, 2, 1), True, 10)
    user_emb, cand_emb, cand_to_user, weight, bias, grad_out = make_inputs(case, dtype, device)
    packed = PackedLinearCompress.from_weight(
        torch.nn.Parameter(weight), case.num_user_tokens, torch.nn.Parameter(bias)
    )
    assert [name for name, _ in packed.named_parameters()] == ["user_weight", "cand_weight", "bias"]
    before = packed.cand_weight_padded.clone()
    optimizer = torch.optim.SGD(packed.parameters(), lr=0.5)
    packed(user_emb, cand_emb, cand_to_user, backend=backend).backward(grad_out)
    optimizer.step()
    after = packed(user_emb, cand_emb, cand_to_user, backend=backend)
    updated = torch.cat([packed.user_weight, packed.cand_weight], dim=1).detach()
    want = replicated(
        user_emb.double().cpu(),
        cand_emb.double().cpu(),
        cand_to_user.cpu(),
        updated.double().cpu(),
        packed.bias.detach().double().cpu(),
    )
    assert rel_err(after.detach(), want) <= tol
    assert rel_err(packed.cand_weight_padded[:, : case.num_cand_tokens], packed.cand_weight.detach()) == 0
    assert not torch.equal(before, packed.cand_weight_padded)


def test_optimizer_step_refreshes_padded_weights():
    _optimizer_step_changes_result("cpu", torch.float64, "auto", 1e-12)


def test_from_weight_copies_and_inherits_requires_grad():
    weight = torch.randn(4, 5)
    frozen = PackedLinearCompress.from_weight(weight, 2)
    assert not frozen.user_weight.requires_grad and frozen.bias is None
    trained = PackedLinearCompress.from_weight(torch.nn.Parameter(weight), 2, torch.nn.Parameter(torch.zeros(4)))
    assert trained.user_weight.requires_grad and trained.bias.requires_grad
    trained.user_weight.data.zero_()
    assert weight.abs().sum() > 0  # a copy: the source is untouched


# ---------------------------------------------------------------- torch.compile and torch.export


class Functional(torch.nn.Module):
    def __init__(self, weight, bias):
        super().__init__()
        self.weight, self.bias = torch.nn.Parameter(weight), torch.nn.Parameter(bias)

    def forward(self, user_emb, cand_emb, cand_to_user):
        return torch.tanh(ikbo_linear_compress(user_emb, cand_emb, cand_to_user, self.weight, self.bias))


class Holder(torch.nn.Module):
    def __init__(self, weight, bias, num_user_tokens):
        super().__init__()
        self.lce = PackedLinearCompress.from_weight(
            torch.nn.Parameter(weight), num_user_tokens, torch.nn.Parameter(bias)
        )

    def forward(self, user_emb, cand_emb, cand_to_user):
        return torch.tanh(self.lce(user_emb, cand_emb, cand_to_user))


def _modules(case: Case, dtype=torch.float64, device="cpu"):
    user_emb, cand_emb, cand_to_user, weight, bias, grad_out = make_inputs(case, dtype, device)
    return (
        [Functional(weight.clone(), bias.clone()), Holder(weight.clone(), bias.clone(), case.num_user_tokens)],
        (user_emb, cand_emb, cand_to_user),
        grad_out,
    )


def _forward_backward(module, inputs, grad_out):
    user_emb, cand_emb = (t.detach().clone().requires_grad_() for t in inputs[:2])
    module.zero_grad()
    out = module(user_emb, cand_emb, inputs[2])
    out.backward(grad_out)
    return [out.detach(), user_emb.grad, cand_emb.grad] + [p.grad.clone() for p in module.parameters()]


COMPILE_CASE = Case(4, 5, 6, 7, 3, (2, 0, 1, 0, 2), True, 11)


@pytest.mark.parametrize("which", [0, 1], ids=["functional", "packed"])
def test_compile_fullgraph_matches_eager(which):
    torch._dynamo.reset()
    modules, inputs, grad_out = _modules(COMPILE_CASE)
    module = modules[which]
    eager = _forward_backward(module, inputs, grad_out)
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)  # fullgraph: a graph break raises
    got = _forward_backward(compiled, inputs, grad_out)
    for want, have in zip(eager, got, strict=True):
        assert rel_err(have, want) <= 1e-12


@pytest.mark.parametrize("which", [0, 1], ids=["functional", "packed"])
def test_compile_fullgraph_without_grad(which):
    """Under no_grad an eager call skips the dispatcher; a compiled one still sees the op (no graph break)."""
    torch._dynamo.reset()
    modules, inputs, _ = _modules(COMPILE_CASE)
    compiled = torch.compile(modules[which], backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        assert rel_err(compiled(*inputs), modules[which](*inputs)) <= 1e-12


def test_eager_calls_take_the_op_only_where_traced_or_intercepted(monkeypatch):
    """The op runs through the dispatcher where a dispatch mode watches (or torch.compile, torch.export trace it);
    where autograd differentiates an eager call, through the op's eager twin (the same graph without the
    dispatcher's Python path); else its implementation runs directly (host time)."""
    calls = []
    monkeypatch.setattr(lce, "_linear_compress_op", lambda *args: calls.append("op") or lce._linear_compress(*args))
    twin = lce._LinearCompress.apply
    monkeypatch.setattr(lce._LinearCompress, "apply", lambda *args: calls.append("twin") or twin(*args))
    case = COMPILE_CASE
    user_emb, cand_emb, cand_to_user, weight, bias, _ = make_inputs(case)
    packed = PackedLinearCompress.from_weight(weight, case.num_user_tokens, bias)
    for call in (
        lambda: ikbo_linear_compress(user_emb, cand_emb, cand_to_user, weight, bias),
        lambda: packed(user_emb, cand_emb, cand_to_user),
    ):
        calls.clear()
        call()
        assert calls == []  # nothing requires grad
        with ReplicationDetector(case.num_users, len(case.mapping)):
            call()
        assert calls == ["op"]
        user_emb.requires_grad_()
        out = call()
        assert calls == ["op", "twin"]
        (d_user,) = torch.autograd.grad(out, user_emb, torch.ones_like(out))
        user_emb.requires_grad_(False)
        with torch.no_grad():
            call()
        assert calls == ["op", "twin"]
        w_u = weight[:, : case.num_user_tokens].double()
        counts = torch.bincount(cand_to_user.long(), minlength=case.num_users).double()
        expected = counts[:, None, None] * w_u.sum(0)[None, :, None].expand(-1, -1, user_emb.shape[2])
        assert rel_err(d_user, expected) <= 1e-12


@pytest.mark.parametrize("which", [0, 1], ids=["functional", "packed"])
def test_export(which):
    modules, inputs, _ = _modules(COMPILE_CASE)
    exported = torch.export.export(modules[which], inputs)
    assert "ikbo.linear_compress" in str(exported.graph)
    assert rel_err(exported.module()(*inputs), modules[which](*inputs)) <= 1e-12


# ---------------------------------------------------------------- Triton backward kernels under the interpreter


@pytest.mark.skipif(INTERPRETING, reason="already interpreting: the interpreted tests run directly")
def test_triton_interpreted():
    """Run the `interpreted` tests below in a child process with TRITON_INTERPRET=1."""
    run_interpreted(__file__)


def _poisoned(shape, dtype, device="cpu"):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _check_backward_kernels(
    case, dtype, tol, device="cpu", splits=None, cand_gemm=None, reference=None, fuse_sums=True
) -> None:
    """Every gradient of `_linear_compress_backward_triton`, written into NaN-poisoned buffers, against `reference`
    (default: fp64 autograd of the replicated formula)."""
    inputs = make_inputs(case, dtype, device)
    user_emb, cand_emb, cand_to_user, weight, bias, grad_out = inputs
    ku = case.num_user_tokens
    want = reference(inputs) if reference is not None else reference_grads(case, inputs)
    shapes = (user_emb.shape, cand_emb.shape, (case.rows, ku), (case.rows, case.num_cand_tokens), (case.rows,))
    grads = [_poisoned(shape, dtype, device) for shape in shapes]
    user_sums = _poisoned((case.num_users, case.rows, case.dim), dtype, device)
    needs = (True, True, True, True, bias is not None)
    weights = (weight[:, :ku], weight[:, ku:])
    got = lce._linear_compress_backward_triton(
        grad_out, user_emb, cand_emb, cand_to_user, *weights, needs, grads, user_sums, splits, cand_gemm, fuse_sums
    )
    for name, have, expected, need in zip(GRAD_NAMES, got, want, needs, strict=True):
        if not need:
            assert have is None, name
            continue
        assert bool(torch.isfinite(have).all()), (case, name)
        err = rel_err(have, expected) if expected.numel() else 0.0
        assert err <= tol, (case, name, err)


# Several 16 × 16 tiles in N, Ku, Kc and D; tensor-descriptor (D·2 bytes a multiple of 16) and pointer (odd D) loads.
INTERPRETED_CORNERS = [
    Case(20, 13, 24, 20, 3, (2, 0, 1, 0, 2, 2, 1), True, 21),
    Case(9, 17, 40, 33, 1, (0, 0, 0), False, 22),  # U = 1
    Case(5, 6, 7, 5, 4, (3, 1, 0, 2), True, 23),  # B = U, odd D: pointer loads
    Case(17, 3, 16, 18, 6, (5, 5, 1), True, 24),  # users without candidates
    Case(0, 11, 16, 9, 3, (2, 0, 1), True, 25),  # Ku = 0
    Case(13, 0, 16, 9, 3, (1, 2, 2, 0), True, 26),  # Kc = 0
    Case(4, 5, 8, 6, 2, (1,), True, 27),  # B = 1
    Case(4, 5, 8, 6, 2, (), True, 28),  # B = 0
]


@pytest.mark.skipif(not INTERPRETING, reason="runs in test_triton_interpreted's child process")
@pytest.mark.parametrize("case", INTERPRETED_CORNERS, ids=_corner_id)
@pytest.mark.parametrize(
    ("splits", "fuse_sums"), [(None, True), (3, True), (2, False)], ids=["one-split", "three-splits", "apart"]
)
def test_interpreted_backward_corners(case, splits, fuse_sums):
    """fuse_sums: the user sums from the dW_c pass (users crossing splits, users without candidates) or apart."""
    _check_backward_kernels(case, torch.float16, FP16_TOL, splits=splits, fuse_sums=fuse_sums)


@pytest.mark.skipif(not INTERPRETING, reason="runs in test_triton_interpreted's child process")
@settings(max_examples=6, deadline=None)
@given(
    case=cases(max_users=4, max_candidates=7, max_tokens=24, max_dim=24, max_rows=24),
    splits=st.sampled_from([None, 2, 3]),
    fuse_sums=st.booleans(),
)
def test_interpreted_backward_drawn(case, splits, fuse_sums):
    _check_backward_kernels(case, torch.float16, FP16_TOL, splits=splits, fuse_sums=fuse_sums)


@pytest.mark.skipif(not INTERPRETING, reason="runs in test_triton_interpreted's child process")
@pytest.mark.parametrize("fuse_sums", [True, False], ids=["fused", "apart"])
def test_interpreted_bad_mapping_stays_in_bounds(fuse_sums):
    """The backward's kernels clamp a bad m[b] as the forward does: rows with m = -3 or U + 4 count for user 0 or
    U - 1, and nothing is read or written out of bounds (the memcheck)."""
    case = Case(9, 7, 16, 20, 3, (2, -3, 1, 7, 0), True, 29)

    def clamped(inputs):
        user_emb, cand_emb, cand_to_user, weight, bias, grad_out = inputs
        return reference_grads(case, (user_emb, cand_emb, cand_to_user.clamp(0, 2), weight, bias, grad_out))

    _check_backward_kernels(case, torch.float16, FP16_TOL, splits=2, reference=clamped, fuse_sums=fuse_sums)


@pytest.mark.skipif(not INTERPRETING, reason="runs in test_triton_interpreted's child process")
@pytest.mark.parametrize("variant", ["fused", "persistent"])
def test_interpreted_autograd_through_the_op(variant):
    """The public op's autograd on the Triton path: forward by `variant` (every variant's forward is tested in
    tests/test_linear_compress.py; the backward does not depend on it), backward by the Triton kernels."""
    case = INTERPRETED_CORNERS[0]
    user_emb, cand_emb, cand_to_user, weight, bias, grad_out = make_inputs(case, torch.float16)
    leaves = [t.requires_grad_() for t in (user_emb, cand_emb, weight, bias)]
    out = ikbo_linear_compress(user_emb, cand_emb, cand_to_user, weight, bias, backend="triton", variant=variant)
    out.backward(grad_out)
    want = reference_grads(case, (user_emb, cand_emb, cand_to_user, weight, bias, grad_out))
    got = [
        user_emb.grad,
        cand_emb.grad,
        weight.grad[:, : case.num_user_tokens],
        weight.grad[:, case.num_user_tokens :],
        bias.grad,
    ]
    for name, have, expected in zip(GRAD_NAMES, got, want, strict=True):
        assert rel_err(have, expected) <= FP16_TOL, (variant, name)
    assert all(t.grad is not None for t in leaves)


@pytest.mark.skipif(not INTERPRETING, reason="runs in test_triton_interpreted's child process")
def test_interpreted_optimizer_step():
    _optimizer_step_changes_result("cpu", torch.float16, "triton", FP16_TOL)


# ---------------------------------------------------------------- compiled for Hopper on the CPU


STANDIN = os.environ.get("IKBO_STANDIN_DRIVER") == "1"


@pytest.mark.skipif(HAS_CUDA or STANDIN or INTERPRETING, reason="the GPU tests compile these kernels for real")
def test_backward_compiles_for_hopper_on_cpu():
    """Run the `standin_` test below in a child process under the stand-in driver (tests/test_gpu_compile.py)."""
    try:
        from kernels.devtools import compile_linear_compress_ws

        compile_linear_compress_ws(num_candidates=2, rows=16, dim=16, num_cand_tokens=16)
    except Exception as exc:
        pytest.skip(f"cannot compile for sm_90a here: {type(exc).__name__}: {str(exc)[:200]}")
    run_child_tests(__file__, "standin_", {"IKBO_STANDIN_DRIVER": "1"}, timeout=1500)


@pytest.mark.skipif(not STANDIN, reason="runs in test_backward_compiles_for_hopper_on_cpu's child process")
def test_standin_backward_kernels_compile_without_spills():
    """The backward's Triton kernels at the canonical N, Kc, D (bf16, both forms of dY_u) and the warp-specialized
    kernel as d_cand_emb's GEMM, compiled for sm_90a as an H200 would (nothing runs): each compiles, the weight-gradient
    GEMM keeps its TMA loads in a multi-stage ring, and no kernel spills registers."""
    from kernels.devtools import compile_linear_compress_ws, disassemble, install_standin_driver

    install_standin_driver()
    num_users, num_candidates, ku, kc, dim, rows = 3, 64, 1024, 500, 256, 512
    mapping = tuple(b * 7 % num_users for b in range(num_candidates))
    inputs = make_inputs(Case(ku, kc, dim, rows, num_users, mapping, True, 31), torch.bfloat16)
    user_emb, cand_emb, cand_to_user, weight, _, grad_out = inputs
    for fuse_sums in (True, False):
        weights = (weight[:, :ku], weight[:, ku:])
        needs = (True,) * 5
        lce._linear_compress_backward_triton(
            grad_out, user_emb, cand_emb, cand_to_user, *weights, needs, splits=16, fuse_sums=fuse_sums
        )
    kernels = [lce._lce_weight_grad_kernel, lce._lce_tile_kernel, lce._user_grad_sum_kernel, lce._user_offsets_kernel]
    kernels += [lce._user_sum_fixup_kernel, lce._split_sum_kernel]
    compiled = [(k.fn.__name__, c) for k in kernels for cache in k.device_caches.values() for c in cache[0].values()]
    ws_cand = compile_linear_compress_ws(rows=kc, num_cand_tokens=rows, has_user=False, has_bias=False)
    assert len(compiled) >= 7
    for name, kernel in [*compiled, ("_lce_ws_kernel (d_cand_emb)", ws_cand)]:
        listing = disassemble(kernel)
        if listing is None:
            pytest.skip("no cuobjdump")
        sass, _ = listing
        assert "STL" not in sass, f"{name} spills registers"
        if name == "_lce_weight_grad_kernel":
            assert kernel.metadata.shared >= 3 * 32 * 1024, f"{name}: {kernel.metadata.shared} bytes: no TMA ring"


# ---------------------------------------------------------------- CUDA, real sizes


GPU_SHAPES = [
    # (U, B, Ku, Kc, D, N, bias)
    (15, 1024, 1024, 500, 256, 512, True),  # canonical
    (1, 300, 64, 499, 200, 384, False),  # U = 1, odd Kc, D not a multiple of the tile
    (257, 257, 40, 33, 100, 130, True),  # B = U, D·2 bytes not 16-aligned: pointer loads
    (64, 40, 96, 0, 64, 256, True),  # Kc = 0, users without candidates
    (8, 500, 0, 72, 128, 96, True),  # Ku = 0
]


def _gpu_case(shape) -> Case:
    num_users, num_candidates, ku, kc, dim, rows, with_bias = shape
    gen = torch.Generator().manual_seed(hash(shape) % 2**31)
    weights = torch.rand(num_users, generator=gen) ** 2 + 0.05  # ragged counts, unsorted, some users without any
    mapping = torch.multinomial(weights, num_candidates, replacement=True, generator=gen)
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    return Case(ku, kc, dim, rows, num_users, tuple(mapping.tolist()), with_bias, seed)


def _fp64_torch_grads(case: Case):
    """The fp64 torch-path backward on the GPU (gradchecked on the CPU above): no replicated [B, Ku + Kc, D] tensor."""

    def reference(inputs):
        user_emb, cand_emb, cand_to_user, weight, bias, grad_out = (
            None if t is None else t.double() if t.is_floating_point() else t for t in inputs
        )
        ku = case.num_user_tokens
        needs = (True, True, True, True, bias is not None)
        return lce._linear_compress_backward_torch(
            grad_out, user_emb, cand_emb, cand_to_user, weight[:, :ku], weight[:, ku:], needs
        )

    return reference


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize(("cand_gemm", "fuse_sums"), [("ws", True), ("tile", False)], ids=["ws-fused", "tile-apart"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "U{}-B{}-Ku{}-Kc{}-D{}-N{}".format(*s[:6]))
def test_gpu_bf16_gradients_real_sizes(shape, cand_gemm, fuse_sums):
    case = _gpu_case(shape)
    from kernels.linear_compress_ws import ws_supported

    probe = torch.empty(1, max(case.rows, 1), case.dim, dtype=torch.bfloat16, device="cuda")
    if cand_gemm == "ws" and not ws_supported(probe, probe):
        pytest.skip("the warp-specialized kernel does not run here (not Hopper, or rows TMA cannot address)")
    for _ in range(2):  # twice: nothing carried over between calls
        reference = _fp64_torch_grads(case)
        _check_backward_kernels(
            case, torch.bfloat16, BF16_TOL, "cuda", cand_gemm=cand_gemm, reference=reference, fuse_sums=fuse_sums
        )
        torch.cuda.synchronize()


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_autograd_through_the_op():
    case = _gpu_case(GPU_SHAPES[0])
    user_emb, cand_emb, cand_to_user, weight, bias, grad_out = make_inputs(case, torch.bfloat16, "cuda")
    for t in (user_emb, cand_emb, weight, bias):
        t.requires_grad_()
    ikbo_linear_compress(user_emb, cand_emb, cand_to_user, weight, bias).backward(grad_out)
    want = _fp64_torch_grads(case)(
        (user_emb.detach(), cand_emb.detach(), cand_to_user, weight.detach(), bias.detach(), grad_out)
    )
    ku = case.num_user_tokens
    got = [user_emb.grad, cand_emb.grad, weight.grad[:, :ku], weight.grad[:, ku:], bias.grad]
    for name, have, expected in zip(GRAD_NAMES, got, want, strict=True):
        assert rel_err(have, expected) <= BF16_TOL, name


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("shape", [GPU_SHAPES[0], (7, 300, 64, 96, 128, 256, False)], ids=["canonical", "small"])
def test_gpu_replayed_backward(replays, shape):
    """A backward whose signature was seen before replays that call's steps with its own tensors (kernels._launch):
    three training steps of fresh inputs and weights through a PackedLinearCompress, every gradient against fp64
    each time, the later forwards and backwards replayed."""
    lce._BACKWARD_REPLAYS.clear()
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    for round_ in range(3):
        case = dataclasses.replace(_gpu_case(shape), seed=seed + round_)
        user_emb, cand_emb, cand_to_user, weight, bias, grad_out = make_inputs(case, torch.bfloat16, "cuda")
        bias = None if bias is None else bias.clone().requires_grad_()
        packed = PackedLinearCompress.from_weight(weight.clone().requires_grad_(), case.num_user_tokens, bias)
        leaves = [user_emb.requires_grad_(), cand_emb.requires_grad_()]
        packed(user_emb, cand_emb, cand_to_user).backward(grad_out)
        bias_value = None if bias is None else bias.detach()
        want = _fp64_torch_grads(case)(
            (user_emb.detach(), cand_emb.detach(), cand_to_user, weight, bias_value, grad_out)
        )
        got = [leaves[0].grad, leaves[1].grad, packed.user_weight.grad, packed.cand_weight.grad]
        got.append(None if bias is None else packed.bias.grad)
        for name, have, expected in zip(GRAD_NAMES, got, want, strict=True):
            assert (have is None) == (expected is None), name
            if have is not None:
                assert rel_err(have, expected) <= BF16_TOL, (round_, name, rel_err(have, expected))
    from kernels.linear_compress_ws import ws_supported

    if ws_supported(grad_out, grad_out):
        assert len(replays) >= 2 * 2  # the forward's and the backward's, rounds two and three


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_optimizer_step():
    _optimizer_step_changes_result("cuda", torch.bfloat16, "auto", BF16_TOL)


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("variant", [*lce.VARIANTS, lce.WS_VARIANT])
def test_gpu_bad_mapping_raises_deferred_and_strict(variant):
    """An eager CUDA call returns before its mapping's range is known; the ValueError that names the bad value comes
    at check_deferred() (or the next IKBO call that finds it arrived), and at once in strict mode."""
    case = _gpu_case((15, 300, 64, 72, 128, 256, True))
    user_emb, cand_emb, cand_to_user, weight, bias, _ = make_inputs(case, torch.bfloat16, "cuda")
    wrong = cand_to_user.clone()
    wrong[137] = 15
    check_deferred()  # nothing left from earlier tests
    ikbo_linear_compress(user_emb, cand_emb, wrong, weight, bias, backend="triton", variant=variant)
    with pytest.raises(ValueError, match=r"^cand_to_user: value 15 is outside \[0, U=15\)"):
        check_deferred()
    with strict_checks(), pytest.raises(ValueError, match=r"^cand_to_user: value 15 is outside \[0, U=15\)"):
        ikbo_linear_compress(user_emb, cand_emb, wrong, weight, bias, backend="triton", variant=variant)


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("which", [0, 1], ids=["functional", "packed"])
def test_gpu_compile_inductor_matches_eager(which):
    torch._dynamo.reset()
    case = _gpu_case((15, 300, 64, 72, 128, 256, True))
    modules, inputs, grad_out = _modules(case, torch.bfloat16, "cuda")
    module = modules[which]
    eager = _forward_backward(module, inputs, grad_out)
    got = _forward_backward(torch.compile(module, fullgraph=True), inputs, grad_out)
    for want, have in zip(eager, got, strict=True):
        assert rel_err(have, want) <= BF16_TOL
