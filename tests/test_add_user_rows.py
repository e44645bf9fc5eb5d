"""`kernels.add_user_rows`, the Type I combine out[b] = cand[b] + user[m[b]]: forward and gradients against fp64
references, the CUDA gather-add kernel (interpreted on the CPU), no replication, input errors, compile."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from interpreted import run_interpreted

from ikbo_backend.transform.detect import ReplicationDetector
from kernels import _common, add_user_rows, check_deferred, strict_checks
from kernels.reference import rel_err

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def reference(cand, user, mapping):
    """fp64, one candidate at a time on the CPU."""
    rows = [cand[b].double().cpu() + user[u].double().cpu() for b, u in enumerate(mapping.tolist())]
    return torch.stack(rows) if rows else cand.double().cpu()


def problem(num_users, num_candidates, trailing, dtype=torch.float64, device="cpu", empty_user=False):
    mapping = torch.randint(0, num_users, (num_candidates,), device=device)
    if empty_user and num_users > 1:
        mapping = mapping.clamp(min=1)  # user 0 has no candidates
    cand = torch.randn(num_candidates, *trailing, dtype=dtype, device=device)
    user = torch.randn(num_users, *trailing, dtype=dtype, device=device)
    return cand, user, mapping.to(torch.int32)


shapes = st.tuples(
    st.integers(1, 5), st.integers(0, 9), st.lists(st.integers(1, 4), min_size=1, max_size=2), st.booleans()
)


@settings(max_examples=15, deadline=None)
@given(shapes)
def test_forward_and_gradients_against_fp64(shape):
    num_users, num_candidates, trailing, empty_user = shape
    cand, user, mapping = problem(num_users, num_candidates, trailing, empty_user=empty_user)
    out = add_user_rows(cand, user, mapping)
    assert out.shape == cand.shape
    if num_candidates:
        assert rel_err(out, reference(cand, user, mapping)) <= 1e-12
    cand.requires_grad_(True)
    user.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda c, u: add_user_rows(c, u, mapping), (cand, user))
    grad = torch.randn_like(cand)
    d_cand, d_user = torch.autograd.grad(add_user_rows(cand, user, mapping), (cand, user), grad)
    expected = torch.zeros_like(user)
    for b, u in enumerate(mapping.tolist()):
        expected[u] += grad[b]
    assert torch.equal(d_cand, grad) and rel_err(d_user, expected) <= 1e-12 or not num_candidates
    if num_candidates == 0:
        assert not d_user.any()


def test_eager_autograd_twin_twice_differentiable():
    """An eager call that autograd differentiates runs the op's eager twin; its backward is torch ops, so a
    second derivative exists (gradgradcheck in fp64), as through the op."""
    cand, user, mapping = problem(3, 7, [2, 3])
    cand.requires_grad_(True)
    user.requires_grad_(True)
    out = add_user_rows(cand, user, mapping)
    assert type(out.grad_fn).__name__ == "_AddUserRowsBackward"
    assert torch.autograd.gradgradcheck(lambda c, u: add_user_rows(c, u, mapping), (cand, user))


def test_op_registration():
    cand, user, mapping = problem(3, 11, [4])
    torch.library.opcheck(torch.ops.ikbo.add_user_rows.default, (cand.requires_grad_(), user, mapping))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_matches_fp64_on_the_cpu(dtype):
    cand, user, mapping = problem(4, 50, [3, 8], dtype)
    assert rel_err(add_user_rows(cand, user, mapping), reference(cand, user, mapping)) <= 5e-3


def test_no_replication_forward_or_backward():
    cand, user, mapping = problem(5, 37, [6])
    cand.requires_grad_(True)
    user.requires_grad_(True)
    with ReplicationDetector(5, 37) as detector:
        _common._add_user_rows_sparse(cand, user, mapping)  # the implementation, seen op by op
        out = add_user_rows(cand, user, mapping)
        out.backward(torch.randn_like(out))
    assert detector.replications == []


def test_bad_inputs_raise_value_errors():
    cand, user, mapping = problem(3, 6, [4])
    with pytest.raises(ValueError, match="cand_to_user: value 3 is outside"):
        add_user_rows(cand, user, torch.tensor([0, 1, 2, 3, 0, 0]))
    with pytest.raises(ValueError, match="cand_to_user"):
        add_user_rows(cand, user, mapping[:5])
    with pytest.raises(ValueError, match="user_part: trailing shape"):
        add_user_rows(cand, user[:, :3], mapping)
    with pytest.raises(ValueError, match="user_part: expected"):
        add_user_rows(cand, user.float(), mapping)
    with pytest.raises(ValueError, match="cand_part"):
        add_user_rows(mapping, user, mapping)


def test_compiles_without_graph_breaks():
    cand, user, mapping = problem(4, 21, [5])
    cand.requires_grad_(True)
    user.requires_grad_(True)

    def f(c, u, m):
        return (add_user_rows(c * 2, u.sin(), m) ** 2).sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    eager_grads = torch.autograd.grad(f(cand, user, mapping), (cand, user))
    compiled_grads = torch.autograd.grad(compiled(cand, user, mapping), (cand, user))
    for got, want in zip(compiled_grads, eager_grads):
        assert rel_err(got, want) <= 1e-12


@pytest.mark.skipif(not INTERPRETING, reason="runs in test_gather_add_kernel_interpreted's child process")
def test_interpreted_gather_add_kernel():
    for num_users, num_candidates, trailing in ((1, 1, [3]), (4, 19, [5, 7]), (3, 8, [64 * 70 + 1])):
        cand, user, mapping = problem(num_users, num_candidates, trailing, torch.float16)
        out = torch.full_like(cand, float("nan"))
        _common.add_user_rows_triton(cand, user, mapping, out=out)
        assert rel_err(out, reference(cand, user, mapping)) <= 1e-3


@pytest.mark.skipif(INTERPRETING, reason="already interpreting")
def test_gather_add_kernel_interpreted():
    run_interpreted(__file__)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_forward_and_gradients(dtype):
    cand, user, mapping = problem(15, 1024, [512], dtype, "cuda")
    cand.requires_grad_(True)
    user.requires_grad_(True)
    out = add_user_rows(cand, user, mapping)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    assert rel_err(out, reference(cand, user, mapping)) <= tol
    grad = torch.randn_like(out)
    d_cand, d_user = torch.autograd.grad(out, (cand, user), grad)
    expected = torch.zeros(15, 512, dtype=torch.float64).index_add_(0, mapping.long().cpu(), grad.double().cpu())
    assert rel_err(d_cand, grad) == 0 and rel_err(d_user, expected) <= tol


@cuda
def test_cuda_bad_mapping_raises_without_a_wait_and_in_strict_mode():
    cand, user, mapping = problem(3, 40, [16], torch.float32, "cuda")
    mapping[7] = 3
    add_user_rows(cand, user, mapping)  # returns: the value is checked when it reaches the host
    with pytest.raises(ValueError, match="cand_to_user: value 3 is outside"):
        check_deferred()
    with strict_checks(), pytest.raises(ValueError, match="cand_to_user: value 3 is outside"):
        add_user_rows(cand, user, mapping)
    good = mapping.clamp(max=2)
    assert rel_err(add_user_rows(cand, user, good), reference(cand, user, good)) <= 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_on_the_cpu_keeps_the_inputs_dtype(dtype):
    """Under torch.autocast the sparse product was cast to 16 bits, which MKL lacks (NotImplementedError inside)."""
    cand, user, mapping = problem(3, 7, [4, 5], dtype=torch.float32)
    with torch.autocast("cpu", dtype=dtype):
        out = add_user_rows(cand, user, mapping)
    assert out.dtype == torch.float32 and rel_err(out, reference(cand, user, mapping)) <= 1e-6


def test_torch_func_grad_and_jvp():
    """torch.func.grad runs (the custom op's autograd raises under torch.func); jvp raises (it passed zero tangents)."""
    cand, user, mapping = problem(3, 7, [4], empty_user=True)
    weights = torch.randn_like(cand)
    d_cand, d_user = torch.func.grad(lambda c, u: (add_user_rows(c, u, mapping) * weights).sum(), (0, 1))(cand, user)
    assert torch.equal(d_cand, weights)
    want = torch.zeros_like(user).index_add_(0, mapping, weights)  # the segment sum, as the reference
    assert rel_err(d_user, want) <= 1e-12
    with pytest.raises(NotImplementedError, match="forward-mode AD"):
        torch.func.jvp(lambda u: add_user_rows(cand, u, mapping), (user,), (torch.randn_like(user),))
