"""IKBO attention (target and self+target) against the fp64 references in kernels/reference.py.

Torch path: hypothesis-drawn U, B, S, L, H, d, kv_len (0 and L included) and mappings (unsorted,
users with no candidates, U = 1, B = 1, B = U, B = 0), causal and not, fp32 within 1e-5 relative (rows whose reference is zero: absolute).
Input checks: every bad argument raises ValueError naming it.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels import ikbo_attention, ikbo_self_target_attention
from kernels.reference import attention_reference, self_attention_reference

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------------
# Problems: one generator for every test
# ---------------------------------------------------------------------------------------------


@st.composite
def mappings(draw, num_users: int):
    """cand_to_user as a list: random (unsorted, gaps), a permutation (B = U), one candidate, or
    candidates of every other user only (users with none), or none at all (B = 0)."""
    kind = draw(st.sampled_from(["random", "permutation", "single", "every_other", "empty"]))
    if kind == "random":
        return draw(st.lists(st.integers(0, num_users - 1), min_size=1, max_size=2 * num_users + 3))
    if kind == "permutation":
        return draw(st.permutations(list(range(num_users))))
    if kind == "single":
        return [draw(st.integers(0, num_users - 1))]
    if kind == "every_other":
        users = list(range(0, num_users, 2))
        return draw(st.lists(st.sampled_from(users), min_size=1, max_size=2 * num_users + 3))
    return []


@st.composite
def problems(draw, max_users=5, max_queries=5, max_len=9, max_heads=3, head_dims=(1, 2, 3, 4, 8, 16)):
    """Shape, mapping, kv_len, scale, layout and a seed for fresh random inputs."""
    num_users = draw(st.integers(1, max_users))
    seq_len = draw(st.integers(1, max_len))
    lengths = draw(
        st.none()
        | st.lists(st.sampled_from([0, seq_len]) | st.integers(0, seq_len), min_size=num_users, max_size=num_users)
    )
    return dict(
        num_users=num_users,
        mapping=draw(mappings(num_users)),
        num_queries=draw(st.integers(1, max_queries)),
        seq_len=seq_len,
        heads=draw(st.integers(1, max_heads)),
        head_dim=draw(st.sampled_from(head_dims)),
        kv_len=lengths,
        scale=draw(st.none() | st.floats(0.05, 2.0)),
        index_dtype=draw(st.sampled_from([torch.int64, torch.int32])),
        bshd=draw(st.booleans()),  # k/v (and q) as [N, S, H, d] storage viewed as [N, H, S, d]
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def make_inputs(p, dtype=torch.float32, device="cpu"):
    """Fresh random q/k/v/user_q (never zeros) on `device` in `dtype`, plus mapping and kv_len."""
    gen = torch.Generator().manual_seed(p["seed"])
    num_users, heads, seq_len, head_dim = p["num_users"], p["heads"], p["seq_len"], p["head_dim"]
    num_candidates = len(p["mapping"])

    def rand(rows, tokens):
        if p["bshd"]:
            t = torch.randn(rows, tokens, heads, head_dim, generator=gen).transpose(1, 2)
        else:
            t = torch.randn(rows, heads, tokens, head_dim, generator=gen)
        return t.to(device=device, dtype=dtype)

    q = rand(num_candidates, p["num_queries"])  # [B, H, S, d]
    k = rand(num_users, seq_len)  # [U, H, L, d]
    v = rand(num_users, seq_len)  # [U, H, L, d]
    user_q = rand(num_users, seq_len)  # [U, H, L, d]
    cand_to_user = torch.tensor(p["mapping"], dtype=p["index_dtype"], device=device)
    kv_len = None if p["kv_len"] is None else torch.tensor(p["kv_len"], dtype=p["index_dtype"], device=device)
    return q, k, v, user_q, cand_to_user, kv_len


def assert_rows_close(out: torch.Tensor, ref: torch.Tensor, rtol: float, atol: float = 1e-6) -> None:
    """‖out − ref‖ ≤ rtol·‖ref‖ over the rows whose reference is nonzero, and the rows whose
    reference is all zeros (no valid key, query row past kv_len) zeros within `atol`, element-wise.
    NaN/inf never pass (a poisoned, unwritten output fails here)."""
    assert out.shape == ref.shape, (out.shape, ref.shape)
    out = out.double().cpu()
    assert torch.isfinite(out).all(), "non-finite output"
    zero_rows = (ref == 0).all(dim=-1)
    if zero_rows.any():
        worst = out[zero_rows].abs().max()
        assert worst <= atol, f"rows with an all-zero reference hold up to {worst:.3e} (> {atol})"
    ref_norm = ref[~zero_rows].norm()
    if ref_norm > 0:
        rel = (out[~zero_rows] - ref[~zero_rows]).norm() / ref_norm
        assert rel <= rtol, f"relative error {rel:.3e} > {rtol}"


# ---------------------------------------------------------------------------------------------
# Torch path vs fp64 reference
# ---------------------------------------------------------------------------------------------


@SETTINGS
@given(p=problems())
def test_target_attention_torch(p):
    q, k, v, _, cand_to_user, kv_len = make_inputs(p)
    out = ikbo_attention(q, k, v, cand_to_user, kv_len, scale=p["scale"], backend="torch")
    assert out.dtype == q.dtype
    assert_rows_close(out, attention_reference(q, k, v, cand_to_user, kv_len, p["scale"]), rtol=1e-5)


@SETTINGS
@given(p=problems(), causal=st.booleans())
def test_self_target_attention_torch(p, causal):
    q, k, v, user_q, cand_to_user, kv_len = make_inputs(p)
    user_out, cand_out = ikbo_self_target_attention(user_q, q, k, v, cand_to_user, kv_len, causal=causal, scale=p["scale"], backend="torch")
    assert_rows_close(user_out, self_attention_reference(user_q, k, v, kv_len, causal, p["scale"]), rtol=1e-5)
    assert_rows_close(cand_out, attention_reference(q, k, v, cand_to_user, kv_len, p["scale"]), rtol=1e-5)


@settings(max_examples=15, deadline=None)
@given(p=problems(), dtype=st.sampled_from([torch.bfloat16, torch.float16]))
def test_half_precision_torch(p, dtype):
    q, k, v, user_q, cand_to_user, kv_len = make_inputs(p, dtype)
    user_out, cand_out = ikbo_self_target_attention(user_q, q, k, v, cand_to_user, kv_len, scale=p["scale"], backend="auto")
    assert cand_out.dtype == dtype and user_out.dtype == dtype
    assert_rows_close(cand_out, attention_reference(q, k, v, cand_to_user, kv_len, p["scale"]), rtol=2e-2, atol=1e-3)
    assert_rows_close(user_out, self_attention_reference(user_q, k, v, kv_len, True, p["scale"]), rtol=2e-2, atol=1e-3)


def test_no_users_no_candidates():
    k, v, user_q = (torch.randn(0, 2, 3, 4) for _ in range(3))
    q = torch.randn(0, 2, 5, 4)
    user_out, cand_out = ikbo_self_target_attention(user_q, q, k, v, torch.zeros(0, dtype=torch.int64))
    assert user_out.shape == (0, 2, 3, 4) and cand_out.shape == (0, 2, 5, 4)


# ---------------------------------------------------------------------------------------------
# Input checks: ValueError naming the argument
# ---------------------------------------------------------------------------------------------


def _good():
    """U=3, B=4, H=2, S=5, L=6, d=8 with a valid mapping and kv_len."""
    return dict(
        user_q=torch.randn(3, 2, 6, 8),
        q=torch.randn(4, 2, 5, 8),
        k=torch.randn(3, 2, 6, 8),
        v=torch.randn(3, 2, 6, 8),
        cand_to_user=torch.tensor([2, 0, 2, 1]),
        kv_len=torch.tensor([6, 0, 3]),
    )


BAD_INPUTS = [
    # (argument named in the error, change to the good inputs)
    ("q", dict(q=torch.randn(4, 5, 8))),  # rank 3
    ("q", dict(q=torch.randint(0, 3, (4, 2, 5, 8)))),  # integer dtype
    ("q", dict(q=torch.randn(4, 3, 5, 8))),  # H mismatch
    ("q", dict(q=torch.randn(4, 2, 5, 16))),  # d mismatch
    ("q", dict(q=torch.randn(4, 2, 5, 8, dtype=torch.float64))),  # dtype unlike k
    ("k", dict(k=torch.randn(3, 2, 6))),  # rank 3
    ("k", dict(k=torch.randn(3, 2, 6, 8).to(torch.int32))),
    ("v", dict(v=torch.randn(3, 2, 7, 8))),  # shape unlike k
    ("v", dict(v=torch.randn(3, 2, 6, 8, dtype=torch.float16))),  # dtype unlike k
    ("cand_to_user", dict(cand_to_user=torch.tensor([2, 0, 3, 1]))),  # value U out of range
    ("cand_to_user", dict(cand_to_user=torch.tensor([2, -1, 0, 1]))),  # negative
    ("cand_to_user", dict(cand_to_user=torch.tensor([2, 0, 1]))),  # length ≠ B
    ("cand_to_user", dict(cand_to_user=torch.tensor([2.0, 0.0, 1.0, 1.0]))),  # float
    ("cand_to_user", dict(cand_to_user=torch.tensor([[2, 0, 1, 1]]))),  # rank 2
    ("kv_len", dict(kv_len=torch.tensor([7, 0, 3]))),  # > L
    ("kv_len", dict(kv_len=torch.tensor([6, -1, 3]))),  # < 0
    ("kv_len", dict(kv_len=torch.tensor([6, 0]))),  # length ≠ U
    ("kv_len", dict(kv_len=torch.tensor([6.0, 0.0, 3.0]))),  # float
    ("backend", dict(backend="cuda")),
]


@pytest.mark.parametrize("name, change", BAD_INPUTS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_INPUTS)])
def test_target_attention_rejects(name, change):
    args = {**_good(), **change}
    with pytest.raises(ValueError, match=rf"^{name}:"):
        ikbo_attention(args["q"], args["k"], args["v"], args["cand_to_user"], args["kv_len"], backend=args.get("backend", "auto"))


SELF_BAD_INPUTS = [
    ("user_q", dict(user_q=torch.randn(3, 2, 6))),  # rank 3
    ("user_q", dict(user_q=torch.randn(3, 2, 5, 8))),  # rows ≠ L
    ("user_q", dict(user_q=torch.randn(2, 2, 6, 8))),  # users ≠ U
    ("user_q", dict(user_q=torch.randn(3, 1, 6, 8))),  # H mismatch
    ("user_q", dict(user_q=torch.randn(3, 2, 6, 4))),  # d mismatch
    ("user_q", dict(user_q=torch.randn(3, 2, 6, 8, dtype=torch.bfloat16))),  # dtype unlike k
    ("cand_q", dict(q=torch.randn(4, 2, 5, 4))),  # d mismatch
    ("cand_q", dict(q=torch.randn(4, 1, 5, 8))),  # H mismatch
    ("cand_to_user", dict(cand_to_user=torch.tensor([2, 0, 3, 1]))),
    ("kv_len", dict(kv_len=torch.tensor([7, 0, 3]))),
    ("v", dict(v=torch.randn(3, 2, 6, 4))),
]


@pytest.mark.parametrize("name, change", SELF_BAD_INPUTS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(SELF_BAD_INPUTS)])
def test_self_target_attention_rejects(name, change):
    args = {**_good(), **change}
    with pytest.raises(ValueError, match=rf"^{name}:"):
        ikbo_self_target_attention(args["user_q"], args["q"], args["k"], args["v"], args["cand_to_user"], args["kv_len"])
