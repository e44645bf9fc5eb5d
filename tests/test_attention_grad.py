"""Gradients of IKBO attention (`ikbo::attention`, `ikbo::self_target_attention`) against fp64 autograd.

CPU:
- `torch.autograd.gradcheck` in fp64 through the public ops (torch path) on hypothesis-drawn problems (U = 1, B = 1,
  B = 0, users without candidates, unsorted mappings, kv_len 0 and L, strided and fused-QKV layouts), causal and
  not; U = 1, B = 1 outputs carry a grad_fn;
- the torch-path forward and backward functions under `ReplicationDetector` (a dispatch mode sees a custom op as
  one op, so the functions are run themselves): no user tensor at B rows;
- torch.compile(fullgraph=True) of small modules calling each op (aot_eager: the ops' fakes and autograd
  traced), forward and backward equal to eager; torch.export of the same modules.
Under TRITON_INTERPRET=1 (the `interpreted_*` tests, in a child process; every kernel access memchecked): the
Triton forward with its log-sum-exp and the backward kernels on small fp16 problems, every gradient written into
NaN-poisoned buffers, against fp64 autograd of a replicated reference (K/V indexed to B rows: only the reference
does that), at several tile shapes; and the public op's autograd on the Triton path.
GPU (skipped without CUDA): every gradient at the canonical size (U = 15 ragged, B = 1024, S = 64, L = 1024, H = 4,
d = 128), with and without kv_len, target and self + target, bf16, rel err ≤ 2e-2 against fp64, gradients
poisoned first; through the public ops' autograd too; bad index values raise at check_deferred() and in strict mode.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from interpreted import run_child_tests, run_interpreted
from test_attention import make_inputs, problems
from torch.utils._python_dispatch import TorchDispatchMode

from ikbo_backend.transform import ReplicationDetector
from kernels import attention, check_deferred, ikbo_attention, ikbo_self_target_attention, strict_checks
from kernels._interpreter import interpreting
from kernels.configs import TileConfig
from kernels.reference import rel_err

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1" and interpreting()
HAS_CUDA = torch.cuda.is_available() and not INTERPRETING
GRADCHECK = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
tiny_problems = problems(max_users=3, max_queries=2, max_len=4, max_heads=2, head_dims=(1, 2, 3))


# ---------------------------------------------------------------------------------------------
# The reference: K/V replicated to B rows, fp64, differentiable everywhere
# ---------------------------------------------------------------------------------------------


def _masked_attention(q, k, v, valid, scale):
    """softmax(scale·q·kᵀ over valid keys)·v; rows without a valid key give 0 (and gradient 0, no NaN)."""
    scores = (scale * q @ k.transpose(-1, -2)).masked_fill(~valid, float("-inf"))
    live = valid.any(dim=-1, keepdim=True)
    return (torch.softmax(torch.where(live, scores, 0.0), dim=-1) * live) @ v


def reference(q, k, v, cand_to_user, kv_len=None, scale=None, user_q=None, causal=True):
    """fp64 target attention over k[m], v[m] (the broadcast IKBO avoids), and with user_q the users' self-attention
    (rows ≥ kv_len zeros) → cand_out, or (user_out, cand_out)."""
    q, k, v = q.double(), k.double(), v.double()
    num_users, _, seq_len, head_dim = k.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    lengths = torch.full((num_users,), seq_len, device=k.device) if kv_len is None else kv_len.long()
    mapping = cand_to_user.long()
    keys = torch.arange(seq_len, device=k.device)
    cand_out = _masked_attention(q, k[mapping], v[mapping], (keys < lengths[mapping][:, None])[:, None, None], scale)
    if user_q is None:
        return cand_out
    rows = keys < lengths[:, None]  # [U, L]
    mask = (rows[:, :, None] & rows[:, None, :])[:, None]
    if causal:
        mask = mask & (keys[None, :] <= keys[:, None])
    return _masked_attention(user_q.double(), k, v, mask, scale), cand_out


@dataclass
class Want:
    """fp64 gradients and, per gradient, the norm of its rounding-error scale (`_term_magnitudes`)."""

    grads: list
    bounds: list

    def __getitem__(self, index):
        if isinstance(index, slice):
            return Want(self.grads[index], self.bounds[index])
        return self.grads[index]


def _term_magnitudes(q, k, v, valid, scale, d_out):
    """The rounding-error scales of dq, dk, dv for attention rows softmax(scale·q·kᵀ)·v with output gradient d_out, in
    units of the 16-bit unit roundoff: a kernel stores P and dS = P ⊙ (dP − Δ) in 16 bits before its products
    (independent per-term roundings: root-sum-squares over the summed index) and forms Δ = rowsum(dO ⊙ O) from the
    16-bit output (δΔ_i ≈ rss_c(dO_ic·O_ic), carried by P·k and Pᵀ·q). Where a gradient's terms cancel (a saturated
    softmax: P ≈ 1 and dP ≈ Δ, so dS ≈ 0) its own norm says nothing about the error; these scales do."""
    scores = (scale * q @ k.transpose(-1, -2)).masked_fill(~valid, float("-inf"))
    live = valid.any(dim=-1, keepdim=True)
    probs = torch.softmax(torch.where(live, scores, 0.0), dim=-1) * live
    out = probs @ v
    delta = (d_out * out).sum(-1, keepdim=True)
    d_scores = probs * (d_out @ v.transpose(-1, -2) - delta)
    delta_err = (d_out * out).square().sum(-1, keepdim=True).sqrt()
    rss = lambda a, b: (a.square() @ b.square()).sqrt()  # noqa: E731
    dq = scale * (rss(d_scores, k) + delta_err * (probs @ k).abs())
    dk = scale * (rss(d_scores.transpose(-1, -2), q) + rss(probs.transpose(-1, -2), delta_err * q))
    return dq, dk, rss(probs.transpose(-1, -2), d_out)


def _bounds(inputs, grads_out, cand_to_user, kv_len=None, scale=None, causal=True):
    """`_term_magnitudes` over the same replicated problem as `reference`, summed back to (q, k, v[, user_q])."""
    q, k, v = (t.detach().double() for t in inputs[:3])
    num_users, _, seq_len, head_dim = k.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    lengths = torch.full((num_users,), seq_len, device=k.device) if kv_len is None else kv_len.long()
    mapping, keys = cand_to_user.long(), torch.arange(seq_len, device=k.device)
    valid = (keys < lengths[mapping][:, None])[:, None, None]
    dq, dk_rows, dv_rows = _term_magnitudes(q, k[mapping], v[mapping], valid, scale, grads_out[0].double())
    dk = torch.zeros_like(k).index_add_(0, mapping, dk_rows)
    dv = torch.zeros_like(v).index_add_(0, mapping, dv_rows)
    if len(inputs) == 3:
        return [dq, dk, dv]
    rows = keys < lengths[:, None]
    mask = (rows[:, :, None] & rows[:, None, :])[:, None]
    if causal:
        mask = mask & (keys[None, :] <= keys[:, None])
    duq, dk_self, dv_self = _term_magnitudes(inputs[3].detach().double(), k, v, mask, scale, grads_out[1].double())
    return [dq, dk + dk_self, dv + dv_self, duq]


def reference_grads(inputs, grads_out, **kwargs):
    """fp64 gradients of `reference` for the given output gradients: inputs (q, k, v[, user_q]) → same order, with
    their error scales (`_bounds`)."""
    leaves = [t.detach().double().requires_grad_() for t in inputs]
    user_q = leaves[3] if len(leaves) == 4 else None
    outs = reference(*leaves[:3], user_q=user_q, **kwargs)
    outs = outs[::-1] if user_q is not None else (outs,)  # (cand_out, user_out)
    torch.autograd.backward(list(outs), [g.double() for g in grads_out])
    bounds = [float(torch.linalg.vector_norm(b)) for b in _bounds(inputs, grads_out, **kwargs)]
    return Want([t.grad for t in leaves], bounds)


# ---------------------------------------------------------------------------------------------
# CPU: gradcheck through the public ops (torch path)
# ---------------------------------------------------------------------------------------------


def _leaves(*tensors):
    return [t.detach().requires_grad_() for t in tensors]


@pytest.fixture
def one_thread():
    """Tiny problems, many calls: one intra-op thread (a busy machine's second thread makes each call far slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@GRADCHECK
@given(p=tiny_problems)
def test_target_attention_gradcheck(one_thread, p):
    q, k, v = _leaves(*make_inputs(p, torch.float64)[:3])
    _, _, _, _, cand_to_user, kv_len = make_inputs(p)

    def op(q, k, v):
        return ikbo_attention(q, k, v, cand_to_user, kv_len, scale=p["scale"], backend="torch")

    assert torch.autograd.gradcheck(op, (q, k, v))


@GRADCHECK
@given(p=tiny_problems, causal=st.booleans())
def test_self_target_attention_gradcheck(one_thread, p, causal):
    q, k, v, user_q = _leaves(*make_inputs(p, torch.float64)[:4])
    _, _, _, _, cand_to_user, kv_len = make_inputs(p)

    def op(user_q, q, k, v):
        return ikbo_self_target_attention(
            user_q, q, k, v, cand_to_user, kv_len, causal=causal, scale=p["scale"], backend="torch"
        )

    assert torch.autograd.gradcheck(op, (user_q, q, k, v))


def test_apart_in_training_rule(monkeypatch):
    """Self + target runs apart under autograd only on Hopper, Triton backend, 16-bit, d ∈ {64, 128}, S a multiple of
    64, no kv_len, and where user_q's rows cannot join the Gluon dK/dV walk (L not a multiple of 64, or user_q not
    contiguous); checked on CPU tensors with Hopper stood in."""
    user_q, k = (torch.randn(2, 1, 16, 128, dtype=torch.bfloat16) for _ in range(2))
    cand_q = torch.randn(3, 1, 64, 128, dtype=torch.bfloat16)
    assert not attention.apart_in_training(user_q, cand_q, k, None, "triton")  # not a Hopper GPU
    monkeypatch.setattr(attention._hopper, "is_hopper", lambda device: True)
    assert attention.apart_in_training(user_q, cand_q, k, None, "triton")
    assert not attention.apart_in_training(user_q, cand_q, k, torch.tensor([16, 3]), "triton")
    assert not attention.apart_in_training(user_q, cand_q, k, None, "torch")
    assert not attention.apart_in_training(user_q, cand_q[:, :, :8], k, None, "triton")
    assert not attention.apart_in_training(user_q.float(), cand_q.float(), k.float(), None, "triton")
    assert not attention.apart_in_training(user_q[..., :32], cand_q[..., :32], k[..., :32], None, "triton")
    user_q, k = (torch.randn(2, 1, 128, 128, dtype=torch.bfloat16) for _ in range(2))
    assert not attention.apart_in_training(user_q, cand_q, k, None, "triton")  # the Gluon walk takes its rows
    strided = torch.randn(2, 128, 1, 3 * 128, dtype=torch.bfloat16)[..., :128].transpose(1, 2)  # fused QKV layout
    assert attention.apart_in_training(strided, cand_q, k, None, "triton")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_self_target_apart_matches_fused(monkeypatch, causal):
    """The apart form (SDPA self-attention + ikbo_attention) gives the fused op's outputs and gradients (torch
    paths, fp64, fresh inputs, a user without candidates, an unsorted mapping)."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    user_q, k, v = (torch.randn(3, 2, 9, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    cand_q = torch.randn(5, 2, 4, 16, generator=gen, dtype=torch.float64)
    mapping = torch.tensor([2, 0, 2, 0, 2])
    grads_out = (torch.randn(user_q.shape, generator=gen, dtype=torch.float64),
                 torch.randn(cand_q.shape, generator=gen, dtype=torch.float64))  # fmt: skip
    results = []
    for apart in (False, True):
        monkeypatch.setattr(attention, "apart_in_training", lambda *args, apart=apart: apart)
        leaves = [t.clone().requires_grad_() for t in (user_q, cand_q, k, v)]
        outs = ikbo_self_target_attention(*leaves, mapping, causal=causal, scale=0.3)
        results.append((*outs, *torch.autograd.grad(outs, leaves, grads_out)))
    for fused, apart in zip(*results):
        assert rel_err(apart, fused) < 1e-10


def test_one_user_one_candidate_has_a_grad_fn():
    q = torch.randn(1, 2, 3, 4, requires_grad=True)
    k, v = (torch.randn(1, 2, 5, 4, requires_grad=True) for _ in range(2))
    out = ikbo_attention(q, k, v, torch.tensor([0]))
    assert out.grad_fn is not None
    out.sum().backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (q, k, v))


def test_no_candidates():
    """B = 0: target gradients are zeros; with self-attention, K/V gradients come from the users' rows alone."""
    q = torch.randn(0, 2, 3, 4, dtype=torch.float64, requires_grad=True)
    k, v, user_q = _leaves(*(torch.randn(2, 2, 5, 4, dtype=torch.float64) for _ in range(3)))
    mapping, kv_len = torch.zeros(0, dtype=torch.int64), torch.tensor([5, 2])
    ikbo_attention(q, k, v, mapping, kv_len).sum().backward()
    assert q.grad.shape == q.shape and k.grad.abs().sum() == 0 and v.grad.abs().sum() == 0
    k.grad = v.grad = None
    user_out, cand_out = ikbo_self_target_attention(user_q, q, k, v, mapping, kv_len)
    (user_out.sum() + cand_out.sum()).backward()
    want = reference_grads(
        (q, k, v, user_q), (torch.zeros_like(q), torch.ones_like(user_q)), cand_to_user=mapping, kv_len=kv_len
    )
    for got, ref in zip((k.grad, v.grad, user_q.grad), want.grads[1:]):
        assert rel_err(got, ref) <= 1e-10


@settings(max_examples=6, deadline=None)
@given(p=tiny_problems)
def test_double_backward_raises(p):
    """A second derivative (d/dk of ‖d out / d q‖², gradgradcheck) raises; the first derivative taken with
    create_graph=True is right. It used to come out as silent zeros in k, v."""
    q, k, v, user_q, mapping, kv_len = make_inputs(p, torch.float64)
    q, k, v, user_q = _leaves(q, k, v, user_q)
    out = ikbo_attention(q, k, v, mapping, kv_len, p["scale"])
    grad_out = torch.randn_like(out)
    (dq,) = torch.autograd.grad(out, q, grad_out, create_graph=True)
    want = reference_grads((q, k, v), (grad_out,), cand_to_user=mapping, kv_len=kv_len, scale=p["scale"])
    assert rel_err(dq.detach(), want[0]) <= 1e-10
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(dq.square().sum(), k)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.gradgradcheck(
            lambda user_q, q, k, v: ikbo_self_target_attention(user_q, q, k, v, mapping, kv_len), (user_q, q, k, v)
        )


def test_forward_mode_ad_raises():
    p = dict(num_users=2, mapping=(1, 0, 1), num_queries=2, seq_len=3, heads=1, head_dim=4, kv_len=None, scale=None,
             index_dtype=torch.int64, layout="bhsd", seed=3)  # fmt: skip
    q, k, v, user_q, mapping, _ = make_inputs(p, torch.float64)
    with pytest.raises(NotImplementedError, match="forward-mode AD"):
        torch.func.jvp(lambda q: ikbo_attention(q, k, v, mapping), (q,), (torch.randn_like(q),))
    with pytest.raises(NotImplementedError, match="forward-mode AD"):
        torch.func.jacfwd(lambda k: ikbo_self_target_attention(user_q, q, k, v, mapping)[0])(k)


@settings(max_examples=6, deadline=None)
@given(p=tiny_problems, causal=st.booleans())
def test_torch_func_grad_and_per_candidate_grads(p, causal):
    """torch.func.grad (the ops' torch.func twins: the custom op's autograd raises under torch.func) and vmap(grad)
    per candidate, against fp64 autograd of the replicated reference."""
    q, k, v, user_q, mapping, kv_len = make_inputs(p, torch.float64)
    grads_out = [torch.randn_like(q), torch.randn_like(user_q)]

    def loss(q, k, v, user_q):
        user_out, cand_out = ikbo_self_target_attention(user_q, q, k, v, mapping, kv_len, causal, p["scale"])
        return (cand_out * grads_out[0]).sum() + (user_out * grads_out[1]).sum()

    got = torch.func.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, user_q)
    want = reference_grads((q, k, v, user_q), grads_out, cand_to_user=mapping, kv_len=kv_len, scale=p["scale"],
                           causal=causal)  # fmt: skip
    for g, ref in zip(got, want.grads, strict=True):
        assert rel_err(g, ref) <= 1e-10

    if not p["mapping"]:
        return  # vmap over 0 candidates: torch's batching fallback of the backward op refuses size 0 (a clear error)

    def one(k, q_row, user, grad_row):  # one candidate's loss
        return (ikbo_attention(q_row[None], k, v, user[None], kv_len, p["scale"]) * grad_row[None]).sum()

    per_candidate = torch.func.vmap(torch.func.grad(one), in_dims=(None, 0, 0, 0))(k, q, mapping, grads_out[0])
    for b in range(len(p["mapping"])):
        ref = reference_grads((q[b : b + 1], k, v), (grads_out[0][b : b + 1],), cand_to_user=mapping[b : b + 1],
                              kv_len=kv_len, scale=p["scale"])  # fmt: skip
        assert rel_err(per_candidate[b], ref[1]) <= 1e-10


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_on_the_cpu(dtype):
    """Under torch.autocast the float inputs are cast as SDPA casts them (the torch path wrote 16-bit rows into an
    fp32 output and failed inside); gradients come back in fp32."""
    p = dict(num_users=3, mapping=(2, 0, 2, 1), num_queries=2, seq_len=7, heads=2, head_dim=8, kv_len=(7, 0, 4),
             scale=None, index_dtype=torch.int64, layout="bhsd", seed=4)  # fmt: skip
    q, k, v, user_q, mapping, kv_len = make_inputs(p, torch.float32)
    leaves = _leaves(q, k, v, user_q)
    with torch.autocast("cpu", dtype=dtype):
        cand_out = ikbo_attention(*leaves[:3], mapping, kv_len)
        user_out, cand_out_2 = ikbo_self_target_attention(leaves[3], *leaves[:3], mapping, kv_len)
    assert cand_out.dtype == user_out.dtype == cand_out_2.dtype == dtype
    ref_user, ref_cand = reference(q, k, v, mapping, kv_len, user_q=user_q)
    assert max(rel_err(cand_out, ref_cand), rel_err(cand_out_2, ref_cand), rel_err(user_out, ref_user)) <= 2e-2
    grads_out = [torch.randn_like(q), torch.randn_like(user_q)]
    torch.autograd.backward([cand_out_2.float(), user_out.float()], grads_out)
    want = reference_grads((q, k, v, user_q), grads_out, cand_to_user=mapping, kv_len=kv_len)
    for got, ref in zip(leaves, want.grads, strict=True):
        assert got.grad.dtype == torch.float32 and rel_err(got.grad, ref) <= 5e-2


@pytest.mark.parametrize("scale", ["half", float("nan"), float("inf"), torch.ones(2)], ids=str)
def test_bad_scale_raises_value_error(scale):
    q, k = torch.randn(2, 1, 3, 4), torch.randn(2, 1, 5, 4)
    with pytest.raises(ValueError, match="scale"):
        ikbo_attention(q, k, k, torch.tensor([1, 0]), scale=scale)
    with pytest.raises(ValueError, match="scale"):
        ikbo_self_target_attention(k, q, k, k, torch.tensor([1, 0]), scale=scale)


def test_lse_only_where_autograd_needs_it():
    """The forward keeps its softmax statistics only when a backward can follow."""
    q, k, v = (torch.randn(3, 2, 4, 8, requires_grad=True) for _ in range(3))
    assert attention._keeps_lse(q, k, v) and attention._keeps_lse(q.detach(), k, v.detach())
    assert not attention._keeps_lse(q.detach(), k.detach(), v.detach())
    for context in (torch.inference_mode(), torch.no_grad()):
        with context:
            assert not attention._keeps_lse(q, k, v)


# ---------------------------------------------------------------------------------------------
# CPU: no backward builds a user tensor at B rows
# ---------------------------------------------------------------------------------------------


def test_torch_backward_never_replicates_user_tensors():
    """The torch-path forward and backward functions (U = 3, B = 7: row counts that no other dim has)."""
    num_users, num_candidates, heads, num_queries, seq_len, head_dim = 3, 7, 2, 5, 11, 4
    q, grad_out = (torch.randn(num_candidates, heads, num_queries, head_dim) for _ in range(2))
    user_q, k, v, grad_user_out = (torch.randn(num_users, heads, seq_len, head_dim) for _ in range(4))
    cand_to_user, kv_len = torch.tensor([2, 0, 2, 2, 1, 0, 2]), torch.tensor([11, 4, 0])
    with ReplicationDetector(num_users, num_candidates) as detector:
        attention._target_attention_torch(q, k, v, cand_to_user, kv_len, 0.5)
        attention._target_attention_torch_backward(grad_out, q, k, v, cand_to_user, kv_len, 0.5)
        attention._self_attention_torch(user_q, k, v, kv_len, True, 0.5)
        attention._self_attention_torch_backward(grad_user_out, user_q, k, v, kv_len, True, 0.5)
    assert detector.replications == []
    with ReplicationDetector(num_users, num_candidates) as detector:  # the detector does see a replication
        reference(q, k, v, cand_to_user, kv_len)
    assert detector.replications


# ---------------------------------------------------------------------------------------------
# CPU: torch.compile and torch.export
# ---------------------------------------------------------------------------------------------


class Target(torch.nn.Module):
    def forward(self, q, k, v, cand_to_user, kv_len):
        return ikbo_attention(q * 2, k, v, cand_to_user, kv_len).relu()


class SelfTarget(torch.nn.Module):
    def forward(self, user_q, q, k, v, cand_to_user, kv_len):
        user_out, cand_out = ikbo_self_target_attention(user_q, q, k, v, cand_to_user, kv_len)
        return user_out.sum(dim=2), cand_out * 3


def _module_inputs(module):
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(6, 2, 3, 8, generator=gen)
    user_q, k, v = (torch.randn(4, 2, 5, 8, generator=gen) for _ in range(3))
    mapping, kv_len = torch.tensor([3, 0, 3, 1, 0, 3], dtype=torch.int32), torch.tensor([5, 0, 2, 4])
    if isinstance(module, Target):
        return (q, k, v, mapping, kv_len)
    return (user_q, q, k, v, mapping, kv_len)


def _outputs_and_grads(module, inputs):
    inputs = [t.clone().requires_grad_() if t.is_floating_point() else t for t in inputs]
    outs = module(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    return list(outs) + [t.grad for t in inputs if t.is_floating_point()]


@pytest.mark.parametrize("module", [Target(), SelfTarget()], ids=["target", "self_target"])
def test_compile_fullgraph_matches_eager(module):
    """Forward and backward; and under no_grad (eager calls then skip the dispatcher, compiled ones keep the op)."""
    inputs = _module_inputs(module)
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    for got, want in zip(_outputs_and_grads(compiled, inputs), _outputs_and_grads(module, inputs), strict=True):
        torch.testing.assert_close(got, want)
    with torch.no_grad():
        torch.testing.assert_close(compiled(*inputs), module(*inputs))


class _Watch(TorchDispatchMode):
    """A dispatch mode that only passes calls on: under it the public ops take their custom ops."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("module", [Target(), SelfTarget()], ids=["target", "self_target"])
def test_eager_twin_matches_the_op(module):
    """An eager call that autograd differentiates runs the op's eager twin (an autograd.Function around the same
    implementations, no dispatcher): its outputs and gradients equal the custom op's, taken under a dispatch mode."""
    inputs = _module_inputs(module)
    twin = _outputs_and_grads(module, inputs)
    with _Watch():
        through_op = _outputs_and_grads(module, inputs)
    for got, want in zip(twin, through_op, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    leaves = [t.clone().requires_grad_() if t.is_floating_point() else t for t in inputs]
    out = module(*leaves)
    names = {type(o.grad_fn.next_functions[0][0]).__name__ for o in (out if isinstance(out, tuple) else (out,))}
    assert names <= {"_AttentionBackward", "_SelfTargetAttentionBackward"}, names


@pytest.mark.parametrize("module", [Target(), SelfTarget()], ids=["target", "self_target"])
def test_export(module):
    inputs = _module_inputs(module)
    exported = torch.export.export(module, inputs)
    assert any("ikbo" in str(node.target) for node in exported.graph.nodes)
    for got, want in zip(exported.module()(*inputs), module(*inputs), strict=True):
        torch.testing.assert_close(got, want)


def test_backward_benchmark_smoke(tmp_path):
    """scripts/bench_attention.py --backward end to end on the CPU (--smoke: interpreted kernels, tiny shapes, every
    provider checked against fp64 before it is timed): a check that the script works, not a measurement."""
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run(
        [sys.executable, str(root / "scripts" / "bench_kernels.py"), "attention", "--smoke", "--backward"],
        cwd=root, capture_output=True, text=True, timeout=600, env={**os.environ, "OUT": str(tmp_path)},
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    text = (tmp_path / "attention_bench.md").read_text()
    for row in ("| ours: public op, autograd |", "| fused: ours, autograd |", "| B | U | ratio |"):
        assert row in text, text[-3000:]


# ---------------------------------------------------------------------------------------------
# The Triton backward under TRITON_INTERPRET=1 (child process)
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(INTERPRETING, reason="already interpreting: the interpreted tests run directly")
def test_triton_backward_interpreted():
    """Run the `interpreted_*` tests below in a child pytest with TRITON_INTERPRET=1."""
    run_interpreted(__file__)


interpreted = pytest.mark.skipif(not INTERPRETING, reason="runs in test_triton_backward_interpreted's child")
INTERP_SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# 16-row / 16- and 32-key tiles: S up to 20 spans tiles, L up to 40 gives full, partial and masked key blocks
small_problems = problems(max_users=4, max_queries=20, max_len=40, max_heads=2, head_dims=(16, 32))
# (dQ tiles, dK/dV tiles): BLOCK_M rows × BLOCK_N keys; dK/dV steps of more rows than keys and of fewer
BACKWARD_TILES = [
    None,
    (TileConfig(16, 32, num_warps=4, num_stages=1), TileConfig(32, 16, num_warps=4, num_stages=1)),
    (TileConfig(32, 16, num_warps=4, num_stages=1), TileConfig(16, 16, num_warps=4, num_stages=1)),
]
HALF_TOL = 2e-2


def _poisoned(t):
    return torch.full(t.shape, float("nan"), dtype=t.dtype, device=t.device)


def triton_grads(q, k, v, cand_to_user, kv_len, scale, grad_out, user_q=None, grad_user_out=None, causal=True,
                 config=None):  # fmt: skip
    """Forward (with the log-sum-exp) and backward through the host wrappers, every output and gradient written
    into NaN-poisoned buffers → (dq, dk, dv[, duq])."""
    scale = 1.0 / math.sqrt(k.shape[3]) if scale is None else scale
    lse = torch.full((attention.lse_size(q.shape, k.shape, user_q is not None),), float("nan"), device=q.device)
    user_out = None if user_q is None else _poisoned(user_q)
    out, user_out, flag = attention._launch(
        q, k, v, cand_to_user, kv_len, scale, user_q, causal, out=_poisoned(q), user_out=user_out, lse=lse
    )
    assert int(flag[0]) == 0
    assert not lse.isnan().any()
    grads = [_poisoned(t) for t in (q, k, v)] + [None if user_q is None else _poisoned(user_q)]
    dq, dk, dv, duq = attention._launch_backward(
        grad_out, q, k, v, out, lse, cand_to_user, kv_len, scale, user_q, grad_user_out, user_out, causal, grads,
        config,
    )  # fmt: skip
    return (dq, dk, dv) if user_q is None else (dq, dk, dv, duq)


ROUNDINGS = 4  # unit roundoffs of `_term_magnitudes` allowed where a gradient's terms cancel


def assert_grads_close(got, want: Want, tol):
    """Each gradient within `tol` of the fp64 one relative to its norm, or, where its terms cancel (a saturated
    softmax), within ROUNDINGS unit roundoffs of its terms' error scale (`_term_magnitudes`)."""
    for name, g, w, bound in zip(("dq", "dk", "dv", "duser_q"), got, want.grads, want.bounds):
        assert g.shape == w.shape, name
        assert not g.isnan().any(), f"{name}: unwritten (NaN) elements"
        if w.numel() == 0:
            continue
        diff = float(torch.linalg.vector_norm(g.double().cpu() - w.double().cpu()))
        norm = float(torch.linalg.vector_norm(w.double()))
        allowed = max(tol * norm, ROUNDINGS * torch.finfo(g.dtype).eps / 2 * bound)
        assert diff <= allowed, f"{name}: |error| {diff:.2e} > {allowed:.2e} (|ref| {norm:.2e}, terms {bound:.2e})"


@interpreted
@INTERP_SETTINGS
@given(p=small_problems, tiles=st.sampled_from(BACKWARD_TILES))
def test_interpreted_target_backward(p, tiles):
    q, k, v, _, cand_to_user, kv_len = make_inputs(p, torch.float16)
    grad_out = torch.randn(q.shape).half()
    got = triton_grads(q, k, v, cand_to_user, kv_len, p["scale"], grad_out, config=tiles)
    want = reference_grads((q, k, v), (grad_out,), cand_to_user=cand_to_user, kv_len=kv_len, scale=p["scale"])
    assert_grads_close(got, want, HALF_TOL)


@interpreted
@INTERP_SETTINGS
@given(p=small_problems, causal=st.booleans(), tiles=st.sampled_from(BACKWARD_TILES))
def test_interpreted_self_target_backward(p, causal, tiles):
    q, k, v, user_q, cand_to_user, kv_len = make_inputs(p, torch.float16)
    grad_out, grad_user_out = torch.randn(q.shape).half(), torch.randn(user_q.shape).half()
    got = triton_grads(q, k, v, cand_to_user, kv_len, p["scale"], grad_out, user_q, grad_user_out, causal, tiles)
    want = reference_grads(
        (q, k, v, user_q), (grad_out, grad_user_out), cand_to_user=cand_to_user, kv_len=kv_len, scale=p["scale"],
        causal=causal,
    )  # fmt: skip
    assert_grads_close(got, want, HALF_TOL)


@interpreted
@INTERP_SETTINGS
@given(
    p=small_problems, tokens=st.sampled_from([16, 32]), with_self=st.booleans(), rows_tma=st.booleans(),
    splits=st.sampled_from([1, 3]),
)  # fmt: skip
def test_interpreted_dkdv_walks(p, tokens, with_self, rows_tma, splits):
    """S a multiple of the dK/dV step's rows, q contiguous: the walk copies each step's candidate rows by TMA
    (`attention.DKDV_ROWS_TMA`; off: the gathered rows), each user's walk whole or split in parts whose dK and dV
    add up atomically (`attention.dkdv_splits`); all match fp64, with and without self rows."""
    p = {**p, "num_queries": tokens, "layout": "bhsd", "mapping": p["mapping"] or [0]}
    q, k, v, user_q, cand_to_user, kv_len = make_inputs(p, torch.float16)
    grad_out, grad_user_out = torch.randn(q.shape).half(), torch.randn(user_q.shape).half()
    step_rows = attention.pick_backward_configs(1, q.shape[3], interpret=True)[1].block_m
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention, "DKDV_ROWS_TMA", rows_tma)
        patch.setattr(attention, "dkdv_splits", lambda *args: splits)
        assert attention.rows_by_tma(q, q, step_rows)
        if with_self:
            got = triton_grads(q, k, v, cand_to_user, kv_len, p["scale"], grad_out, user_q, grad_user_out)
        else:
            got = triton_grads(q, k, v, cand_to_user, kv_len, p["scale"], grad_out)
    inputs, grads_out = ((q, k, v, user_q), (grad_out, grad_user_out)) if with_self else ((q, k, v), (grad_out,))
    want = reference_grads(inputs, grads_out, cand_to_user=cand_to_user, kv_len=kv_len, scale=p["scale"])
    assert_grads_close(got, want, HALF_TOL)


@interpreted
@pytest.mark.parametrize("ranked", [True, False], ids=["ranked", "grid_order"])
def test_interpreted_public_ops_autograd(monkeypatch, ranked):
    """The Triton path through the custom ops' autograd (backend='triton' on CPU tensors under the interpreter):
    users without candidates, kv_len 0, S larger than a tile; dK/dV programs in ranked order (U ≤ RANKED_USERS)
    and in grid order. The forward keeps its log-sum-exp only when asked to."""
    if not ranked:
        monkeypatch.setattr(attention, "RANKED_USERS", 1)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(5, 2, 18, 16, generator=gen).half().requires_grad_()
    k, v, user_q = (torch.randn(4, 2, 21, 16, generator=gen).half().requires_grad_() for _ in range(3))
    cand_to_user, kv_len = torch.tensor([2, 0, 2, 2, 0]), torch.tensor([21, 0, 9, 14])
    for keep in (False, True):
        lse = torch.ops.ikbo.attention(q, k, v, cand_to_user, kv_len, 0.25, "triton", keep)[1]
        assert lse.numel() == (attention.lse_size(q.shape, k.shape, False) if keep else 0)
    out = ikbo_attention(q, k, v, cand_to_user, kv_len, backend="triton")
    grad_out = torch.randn(out.shape, generator=gen).half()
    got = torch.autograd.grad(out, (q, k, v), grad_out)
    want = reference_grads((q, k, v), (grad_out,), cand_to_user=cand_to_user, kv_len=kv_len)
    assert_grads_close(got, want, HALF_TOL)
    out = torch.ops.ikbo.attention(q, k, v, cand_to_user, kv_len, 0.25, "triton", False)[0]  # no statistics kept
    assert_grads_close(torch.autograd.grad(out, (q, k, v), grad_out), want, HALF_TOL)
    user_out, cand_out = ikbo_self_target_attention(user_q, q, k, v, cand_to_user, kv_len, backend="triton")
    grads_out = (torch.randn(cand_out.shape, generator=gen).half(), torch.randn(user_out.shape, generator=gen).half())
    got = torch.autograd.grad((cand_out, user_out), (q, k, v, user_q), grads_out)
    want = reference_grads((q, k, v, user_q), grads_out, cand_to_user=cand_to_user, kv_len=kv_len)
    assert_grads_close(got, want, HALF_TOL)


@interpreted
def test_interpreted_no_candidates_with_self():
    """B = 0 with self-attention: the dK/dV programs walk the users' own rows only."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(0, 1, 4, 16).half()
    k, v, user_q, grad_user_out = (torch.randn(2, 1, 19, 16, generator=gen).half() for _ in range(4))
    kv_len = torch.tensor([19, 7])
    mapping = torch.zeros(0, dtype=torch.int64)
    got = triton_grads(q, k, v, mapping, kv_len, None, torch.zeros_like(q), user_q, grad_user_out)
    want = reference_grads((q, k, v, user_q), (torch.zeros_like(q), grad_user_out), cand_to_user=mapping, kv_len=kv_len)
    assert_grads_close(got[1:], want[1:], HALF_TOL)


@interpreted
def test_interpreted_bad_index_values_stay_in_bounds():
    """A backward can run before a deferred check reports a bad mapping or kv_len value: every access stays inside
    the tensors (the memcheck), and the candidates and users that are valid get their gradients."""
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(6, 1, 3, 16, generator=gen).half()
    k, v, user_q = (torch.randn(3, 1, 20, 16, generator=gen).half() for _ in range(3))
    grad_out, grad_user_out = torch.randn(q.shape, generator=gen).half(), torch.randn(k.shape, generator=gen).half()
    cand_to_user, kv_len = torch.tensor([1, -1, 1, 3, 0, 7]), torch.tensor([20, -3, 25])
    scale, lse = 0.25, torch.empty(attention.lse_size(q.shape, k.shape, True))
    out, user_out, flag = attention._launch(q, k, v, cand_to_user, kv_len, scale, user_q, lse=lse)
    assert int(flag[0]) == 1
    dq, dk, dv, duq = attention._launch_backward(
        grad_out, q, k, v, out, lse, cand_to_user, kv_len, scale, user_q, grad_user_out, user_out
    )
    valid = torch.tensor([0, 2, 4])  # candidates of users 0 and 1 (user 1: kv_len clamped to 0, user 2 to L)
    clamped = kv_len.clamp(0, 20)
    want = reference_grads(
        (q[valid], k, v, user_q), (grad_out[valid], grad_user_out), cand_to_user=cand_to_user[valid], kv_len=clamped
    )
    assert_grads_close((dq[valid], dk, dv, duq), want, HALF_TOL)


# ---------------------------------------------------------------------------------------------
# sm_90a compiles on the CPU (a stand-in driver, in a child process)
# ---------------------------------------------------------------------------------------------

STANDIN = os.environ.get("IKBO_STANDIN_DRIVER") == "1"


@given(programs=st.integers(1, 2000), rows_per_user=st.floats(0, 1e6), sms=st.sampled_from([16, 78, 132]))
def test_dkdv_splits_rule(programs, rows_per_user, sms):
    """A user's dK/dV walk is split only where the programs do not fill DKDV_WAVES per SM, into parts that each walk
    DKDV_MIN_STEPS steps or more on average, and no more parts than it takes to fill the GPU."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention._hopper, "device_info", lambda device: ((9, 0), sms))
        cfg = attention.pick_backward_configs(rows_per_user, 128, interpret=False)[1]
        parts = attention.dkdv_splits(programs, rows_per_user, cfg, torch.device("cuda"))
    wanted = attention.DKDV_WAVES * sms
    steps = rows_per_user / cfg.block_m
    assert parts >= 1
    if programs >= wanted:
        assert parts == 1
    if parts > 1:
        assert steps / parts >= attention.DKDV_MIN_STEPS
        assert (parts - 1) * programs < wanted
    else:
        assert programs >= wanted or steps < 2 * attention.DKDV_MIN_STEPS


@pytest.mark.skipif(torch.cuda.is_available() or INTERPRETING, reason="the GPU tests compile these kernels for real")
def test_backward_kernels_compile_for_sm90():
    """The forward with its log-sum-exp and both backward kernels through their host wrappers, compiled for an H200
    (sm_90a, the wheel's ptxas) under `kernels.devtools.install_standin_driver` (nothing runs)."""
    try:
        from kernels.devtools import compile_attention_ws

        compile_attention_ws(has_kv_len=False)
    except Exception as exc:
        pytest.skip(f"cannot compile for sm_90a here: {type(exc).__name__}: {str(exc)[:200]}")
    run_child_tests(__file__, "standin_", {"IKBO_STANDIN_DRIVER": "1"}, timeout=900)


@pytest.mark.skipif(not STANDIN, reason="runs in test_backward_kernels_compile_for_sm90's child process")
@pytest.mark.parametrize(
    "num_users, num_candidates, num_queries, seq_len, heads, head_dim, dtype, with_self, causal",
    [(15, 1024, 64, 1024, 4, 128, torch.bfloat16, False, True), (3, 40, 5, 333, 2, 64, torch.float16, True, True)],
    ids=["canonical", "self-odd-d64"],
)
def test_standin_backward_compiles(num_users, num_candidates, num_queries, seq_len, heads, head_dim, dtype,
                                   with_self, causal):  # fmt: skip
    """At the canonical shape neither the dQ kernel nor the dK/dV kernel (dK, dV [128, d] fp32 in registers across
    64-row steps copied by TMA) spills a register (kernels.attention.pick_backward_configs)."""
    from kernels.devtools import disassemble, install_standin_driver

    install_standin_driver()
    q = torch.zeros(num_candidates, heads, num_queries, head_dim, dtype=dtype)
    k, v, user_q = (torch.zeros(num_users, heads, seq_len, head_dim, dtype=dtype) for _ in range(3))
    cand_to_user = torch.zeros(num_candidates, dtype=torch.int32)
    kv_len = torch.zeros(num_users, dtype=torch.int32)
    user_q = user_q if with_self else None
    lse = torch.zeros(attention.lse_size(q.shape, k.shape, with_self))
    out, user_out, _ = attention._launch(q, k, v, cand_to_user, kv_len, 0.1, user_q, causal, lse=lse)
    out, user_out = torch.zeros_like(q), None if user_q is None else torch.zeros_like(user_q)
    attention._launch_backward(out, q, k, v, out, lse, cand_to_user, kv_len, 0.1, user_q, user_out, user_out, causal)
    if with_self:
        return
    for kernel in (attention._attention_bwd_dq_kernel, attention._attention_bwd_dkdv_kernel):
        for compiled in next(iter(kernel.device_caches.values()))[0].values():
            disassembled = disassemble(compiled)
            if disassembled is not None:
                sass, usage = disassembled
                assert int(re.search(r"STACK:(\d+)", usage).group(1)) == 0, usage
                assert "LDL" not in sass, usage


# ---------------------------------------------------------------------------------------------
# GPU: real sizes
# ---------------------------------------------------------------------------------------------

cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
GPU_TOL = 2e-2


CANONICAL = (15, 1024, 64, 1024, 4, 128)  # U, B, S, L, H, d
# other sizes: d = 64, L not a multiple of a key block, S not of a tile; more users than RANKED_USERS (grid order);
# few users with many candidates each (the dK/dV walks split, `attention.dkdv_splits`); the Gluon dK/dV kernel
# (S a multiple of 64) at d = 64 with L not a multiple of its 128-key blocks
OTHER_SIZES = [((7, 300, 8, 1000, 2, 64), torch.float16), ((3, 700, 5, 333, 4, 64), torch.bfloat16),
               ((70, 300, 3, 256, 2, 128), torch.bfloat16), ((1, 200, 64, 512, 2, 128), torch.bfloat16),
               ((5, 150, 128, 1000, 3, 64), torch.float16)]  # fmt: skip


def gpu_problem(ragged_kv_len: bool, with_self: bool, size=CANONICAL, dtype=torch.bfloat16, seed=0, device="cuda"):
    """Ragged counts (weights 1/(u+1)^0.7, shuffled), kv_len with L, 0 and 700 (clamped to L) among its values."""
    num_users, num_candidates, num_queries, seq_len, heads, head_dim = size
    gen = torch.Generator().manual_seed(seed)
    weights = torch.tensor([1.0 / (u + 1) ** 0.7 for u in range(num_users)])
    mapping = torch.multinomial(weights, num_candidates, replacement=True, generator=gen)
    lengths = torch.randint(0, seq_len + 1, (num_users,), generator=gen)
    lengths[:3] = torch.tensor([seq_len, 0, min(700, seq_len)])[:num_users]
    make = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)  # noqa: E731
    problem = dict(
        q=make(num_candidates, heads, num_queries, head_dim),
        k=make(num_users, heads, seq_len, head_dim),
        v=make(num_users, heads, seq_len, head_dim),
        cand_to_user=mapping.to(device, torch.int32),
        kv_len=lengths.to(device, torch.int32) if ragged_kv_len else None,
        grad_out=make(num_candidates, heads, num_queries, head_dim),
    )
    if with_self:
        problem.update(
            user_q=make(num_users, heads, seq_len, head_dim), grad_user_out=make(num_users, heads, seq_len, head_dim)
        )
    return problem


def check_cuda_gradients(p, with_self):
    """The kernels through the host wrappers (gradients poisoned), then the public op's autograd (as dispatched:
    on Hopper at the canonical shape its forward is the Gluon kernel, which writes the log-sum-exp)."""
    inputs = (p["q"], p["k"], p["v"]) + ((p["user_q"],) if with_self else ())
    grads_out = (p["grad_out"],) + ((p["grad_user_out"],) if with_self else ())
    want = reference_grads(inputs, grads_out, cand_to_user=p["cand_to_user"], kv_len=p["kv_len"])
    got = triton_grads(
        p["q"], p["k"], p["v"], p["cand_to_user"], p["kv_len"], None, p["grad_out"], p.get("user_q"),
        p.get("grad_user_out"),
    )  # fmt: skip
    assert_grads_close(got, want, GPU_TOL)
    leaves = [t.clone().requires_grad_() for t in inputs]
    if with_self:
        user_out, cand_out = ikbo_self_target_attention(leaves[3], *leaves[:3], p["cand_to_user"], p["kv_len"])
        got = torch.autograd.grad((cand_out, user_out), leaves, grads_out)
    else:
        out = ikbo_attention(*leaves, p["cand_to_user"], p["kv_len"])
        got = torch.autograd.grad(out, leaves, grads_out)
    assert_grads_close(got, want, GPU_TOL)


@cuda_only
@pytest.mark.parametrize("with_self", [False, True], ids=["target", "self_target"])
@pytest.mark.parametrize("ragged", [False, True], ids=["full", "kv_len"])
def test_cuda_gradients_at_the_canonical_size(ragged, with_self):
    check_cuda_gradients(gpu_problem(ragged, with_self), with_self)


@cuda_only
@pytest.mark.parametrize("with_self", [False, True], ids=["target", "self_target"])
@pytest.mark.parametrize("size, dtype", OTHER_SIZES, ids=lambda x: str(x))
def test_cuda_gradients_at_other_sizes(size, dtype, with_self):
    check_cuda_gradients(gpu_problem(True, with_self, size, dtype, seed=1), with_self)


@cuda_only
@pytest.mark.parametrize("with_self", [False, True], ids=["target", "self_target"])
def test_cuda_replayed_training_forwards(replays, with_self):
    """A forward that autograd records keeps its log-sum-exp for the backward; a later call of the same signature
    replays its launches (kernels._launch) with a fresh lse: three rounds of fresh inputs, every gradient of each
    against fp64, and the second and third forwards replayed."""
    attention._REPLAYS.clear()
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    for round_ in range(3):
        p = gpu_problem(True, with_self, (7, 300, 64, 512, 2, 128), seed=seed + round_)
        inputs = (p["q"], p["k"], p["v"]) + ((p["user_q"],) if with_self else ())
        grads_out = (p["grad_out"],) + ((p["grad_user_out"],) if with_self else ())
        want = reference_grads(inputs, grads_out, cand_to_user=p["cand_to_user"], kv_len=p["kv_len"])
        leaves = [t.clone().requires_grad_() for t in inputs]
        if with_self:
            user_out, cand_out = ikbo_self_target_attention(leaves[3], *leaves[:3], p["cand_to_user"], p["kv_len"])
            got = torch.autograd.grad((cand_out, user_out), leaves, grads_out)
        else:
            got = torch.autograd.grad(ikbo_attention(*leaves, p["cand_to_user"], p["kv_len"]), leaves, grads_out)
        assert_grads_close(got, want, GPU_TOL)
    assert len(replays) >= 2


@cuda_only
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "not_causal"])
@pytest.mark.parametrize("size", [(6, 500, 64, 704, 2, 128), (4, 90, 64, 320, 3, 64)], ids=str)
def test_cuda_self_rows_in_the_gluon_walk(size, causal):
    """Self + target where the Gluon dK/dV walk takes the user's own rows too (L a multiple of 64, not of its
    128-key blocks; kv_len with 0, L and values inside the diagonal block): every gradient, causal or not."""
    p = gpu_problem(True, True, size, seed=2)
    p["kv_len"][3:] = torch.tensor([65, 130, 1][: size[0] - 3], device="cuda")
    inputs = (p["q"], p["k"], p["v"], p["user_q"])
    grads_out = (p["grad_out"], p["grad_user_out"])
    want = reference_grads(inputs, grads_out, cand_to_user=p["cand_to_user"], kv_len=p["kv_len"], causal=causal)
    got = triton_grads(p["q"], p["k"], p["v"], p["cand_to_user"], p["kv_len"], None, p["grad_out"], p["user_q"],
                       p["grad_user_out"], causal)  # fmt: skip
    assert_grads_close(got, want, GPU_TOL)


@cuda_only
@pytest.mark.parametrize("with_self", [False, True], ids=["target", "self_target"])
def test_cuda_gluon_lse_matches_triton(with_self):
    """Where the Gluon kernel runs (Hopper), the log-sum-exp it writes equals the Triton kernel's, self rows too."""
    from kernels.attention_ws import launch_ws, ws_supported

    p = gpu_problem(True, with_self)
    q, k, v, m, kv_len, user_q = p["q"], p["k"], p["v"], p["cand_to_user"], p["kv_len"], p.get("user_q")
    if not ws_supported(q, k):
        pytest.skip("the Gluon kernel needs Hopper")
    size = attention.lse_size(q.shape, k.shape, with_self)
    lse_ws, lse_triton = (torch.full((size,), float("nan"), device="cuda") for _ in range(2))
    user_out = None if user_q is None else torch.empty_like(user_q)
    launch_ws(q, k, v, m, kv_len, 0.1, out=torch.empty_like(q), user_q=user_q, user_out=user_out, lse=lse_ws)
    config = attention.pick_config(1e9, False)
    attention._launch(q, k, v, m, kv_len, 0.1, user_q, config=config, lse=lse_triton)
    finite = lse_triton.isfinite()
    assert torch.equal(finite, lse_ws.isfinite()) and not lse_ws.isnan().any()
    torch.testing.assert_close(lse_ws[finite], lse_triton[finite], rtol=1e-5, atol=1e-3)


@cuda_only
@pytest.mark.parametrize("strict", [False, True], ids=["deferred", "strict"])
def test_cuda_bad_values_raise_without_a_wait(strict):
    p = gpu_problem(True, True)
    bad_mapping = p["cand_to_user"].clone()
    bad_mapping[5] = 15
    bad_kv_len = p["kv_len"].clone()
    bad_kv_len[2] = 1025
    for name, mapping, kv_len in (
        ("cand_to_user", bad_mapping, p["kv_len"]),
        ("kv_len", p["cand_to_user"], bad_kv_len),
    ):
        with strict_checks(strict):
            if strict:
                with pytest.raises(ValueError, match=rf"^{name}:"):
                    ikbo_self_target_attention(p["user_q"], p["q"], p["k"], p["v"], mapping, kv_len)
            else:
                ikbo_self_target_attention(p["user_q"], p["q"], p["k"], p["v"], mapping, kv_len)
                with pytest.raises(ValueError, match=rf"^{name}:"):
                    check_deferred()
