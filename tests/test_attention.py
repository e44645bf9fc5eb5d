"""IKBO attention (target and self+target) against the fp64 references in kernels/reference.py.

Torch path: hypothesis-drawn U, B, S, L, H, d, kv_len (0 and L included) and mappings (unsorted,
users with no candidates, U = 1, B = 1, B = U, B = 0), causal and not, fp32 within 1e-5 relative
(rows whose reference is zero: absolute).
Triton path on CPU: the same draws on small shapes (tiles of 16, so several query tiles, key
blocks and partial blocks) under TRITON_INTERPRET=1, bf16 and fp16 within 1e-2, outputs poisoned
with NaN first. The interpreter must be on before Triton builds the kernels (at import), so
`test_triton_kernels_on_cpu` runs those tests in a child pytest with the variable set; this process
and the other test modules keep compiled kernels.
Triton path on CUDA (skipped without a GPU): real sizes, bf16 within 1e-2 of fp64.
Input checks: every bad argument raises ValueError naming it.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels import attention, check_deferred, ikbo_attention, ikbo_self_target_attention, strict_checks
from kernels._interpreter import interpreting
from kernels.configs import TileConfig
from kernels.reference import attention_reference, self_attention_reference

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and interpreting()
HAS_CUDA = torch.cuda.is_available()

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


# storage of q / k / v / user_q, all viewed as [N, H, S, d]: contiguous; [N, S, H, d] transposed;
# k/v/user_q as slices of one fused [U, L, 3·H·d] projection (the served model's layout)
LAYOUTS = ("bhsd", "bshd", "fused")


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
        layout=draw(st.sampled_from(LAYOUTS)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def make_inputs(p, dtype=torch.float32, device="cpu"):
    """Fresh random q/k/v/user_q (never zeros) on `device` in `dtype`, plus mapping and kv_len."""
    gen = torch.Generator().manual_seed(p["seed"])
    num_users, heads, seq_len, head_dim = p["num_users"], p["heads"], p["seq_len"], p["head_dim"]
    num_candidates = len(p["mapping"])

    def rand(rows, tokens):
        if p["layout"] == "bhsd":
            t = torch.randn(rows, heads, tokens, head_dim, generator=gen)
        else:
            t = torch.randn(rows, tokens, heads, head_dim, generator=gen).transpose(1, 2)
        return t.to(device=device, dtype=dtype)

    q = rand(num_candidates, p["num_queries"])  # [B, H, S, d]
    if p["layout"] == "fused":
        fused = torch.randn(num_users, seq_len, 3 * heads * head_dim, generator=gen).to(device=device, dtype=dtype)
        user_q, k, v = (t.unflatten(2, (heads, head_dim)).transpose(1, 2) for t in fused.chunk(3, dim=2))
    else:
        user_q, k, v = (rand(num_users, seq_len) for _ in range(3))  # [U, H, L, d]
    cand_to_user = torch.tensor(p["mapping"], dtype=p["index_dtype"], device=device)
    kv_len = None if p["kv_len"] is None else torch.tensor(p["kv_len"], dtype=p["index_dtype"], device=device)
    return q, k, v, user_q, cand_to_user, kv_len


def assert_rows_close(
    out: torch.Tensor, ref: torch.Tensor, rtol: float, atol: float = 1e-6, floor: float = 0.0
) -> None:
    """‖out − ref‖ ≤ rtol·max(‖ref‖, floor·√n) over the n elements of the rows whose reference is
    nonzero, and the rows whose reference is all zeros (no valid key, query row past kv_len) zeros
    within `atol`, element-wise. `floor` keeps a handful of cancelling elements (d = 1, say) from
    turning half-precision rounding into a large relative error. NaN/inf never pass (a poisoned,
    unwritten output fails here)."""
    assert out.shape == ref.shape, (out.shape, ref.shape)
    out, ref = out.double().cpu(), ref.double().cpu()
    assert torch.isfinite(out).all(), "non-finite output"
    zero_rows = (ref == 0).all(dim=-1)
    if zero_rows.any():
        worst = out[zero_rows].abs().max()
        assert worst <= atol, f"rows with an all-zero reference hold up to {worst:.3e} (> {atol})"
    ref_norm = max(ref[~zero_rows].norm(), floor * math.sqrt(ref[~zero_rows].numel()))
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
    user_out, cand_out = ikbo_self_target_attention(
        user_q, q, k, v, cand_to_user, kv_len, causal=causal, scale=p["scale"], backend="torch"
    )
    assert_rows_close(user_out, self_attention_reference(user_q, k, v, kv_len, causal, p["scale"]), rtol=1e-5)
    assert_rows_close(cand_out, attention_reference(q, k, v, cand_to_user, kv_len, p["scale"]), rtol=1e-5)


@settings(max_examples=15, deadline=None)
@given(p=problems(), dtype=st.sampled_from([torch.bfloat16, torch.float16]))
def test_half_precision_torch(p, dtype):
    q, k, v, user_q, cand_to_user, kv_len = make_inputs(p, dtype)
    user_out, cand_out = ikbo_self_target_attention(
        user_q, q, k, v, cand_to_user, kv_len, scale=p["scale"], backend="auto"
    )
    assert cand_out.dtype == dtype and user_out.dtype == dtype
    # CPU half SDPA rounds its intermediates to half: tiny cancelling outputs compare at 1e-1 scale
    assert_rows_close(
        cand_out, attention_reference(q, k, v, cand_to_user, kv_len, p["scale"]), rtol=2e-2, atol=1e-3, floor=0.1
    )
    assert_rows_close(
        user_out, self_attention_reference(user_q, k, v, kv_len, True, p["scale"]), rtol=2e-2, atol=1e-3, floor=0.1
    )


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
        ikbo_attention(
            args["q"], args["k"], args["v"], args["cand_to_user"], args["kv_len"], backend=args.get("backend", "auto")
        )


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
        ikbo_self_target_attention(
            args["user_q"], args["q"], args["k"], args["v"], args["cand_to_user"], args["kv_len"]
        )


@pytest.mark.skipif(INTERPRETED or HAS_CUDA, reason="the Triton path runs here")
def test_triton_backend_needs_cuda():
    args = _good()
    with pytest.raises(ValueError, match=r"^backend:"):
        ikbo_attention(args["q"], args["k"], args["v"], args["cand_to_user"], backend="triton")


# ---------------------------------------------------------------------------------------------
# Triton path on CPU: TRITON_INTERPRET=1, in a child process
# ---------------------------------------------------------------------------------------------

if INTERPRETED:
    # Triton 3.6's interpreter multiplies bf16 operands of tl.dot as their raw uint16 bits; widen
    # them to fp32 first (exact, as on the GPU's tensor cores, which accumulate in fp32).
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as _interp

    _dot = _interp.InterpreterBuilder.create_dot

    def _widen(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        return _interp.TensorHandle(
            _interp._convert_float(h.data, tl.bfloat16, tl.float32, None).view(np.float32), tl.float32
        )

    _interp.InterpreterBuilder.create_dot = lambda self, a, b, d, *rest: _dot(self, _widen(a), _widen(b), d, *rest)

interpreted = pytest.mark.skipif(not INTERPRETED, reason="run by test_triton_kernels_on_cpu under TRITON_INTERPRET=1")
HALF_TOL = 1e-2
INTERP_SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# tiles of 16 rows / keys: S up to 20 spans tiles, L up to 40 gives full, partial and masked blocks
small_problems = problems(max_users=4, max_queries=20, max_len=40, max_heads=2, head_dims=(16, 32))


def _poisoned(like):
    return torch.full(like.shape, float("nan"), dtype=like.dtype, device=like.device)


def _triton(q, k, v, cand_to_user, kv_len, scale, user_q=None, causal=True, config=None):
    """The Triton path with NaN-poisoned outputs: every element must be written. → (out, user_out)"""
    scale = 1.0 / math.sqrt(k.shape[3]) if scale is None else scale
    user_out = None if user_q is None else _poisoned(user_q)
    out, user_out, flag = attention._launch(
        q, k, v, cand_to_user, kv_len, scale, user_q, causal, config=config, out=_poisoned(q), user_out=user_out
    )
    assert flag.item() == 0
    return out, user_out


@interpreted
@INTERP_SETTINGS
@given(p=small_problems, dtype=st.sampled_from([torch.bfloat16, torch.float16]))
def test_interp_target_attention(p, dtype):
    q, k, v, _, cand_to_user, kv_len = make_inputs(p, dtype)
    out, _ = _triton(q, k, v, cand_to_user, kv_len, p["scale"])
    assert_rows_close(out, attention_reference(q, k, v, cand_to_user, kv_len, p["scale"]), rtol=HALF_TOL)


@interpreted
@INTERP_SETTINGS
@given(p=small_problems, dtype=st.sampled_from([torch.bfloat16, torch.float16]), causal=st.booleans())
def test_interp_self_target_attention(p, dtype, causal):
    q, k, v, user_q, cand_to_user, kv_len = make_inputs(p, dtype)
    cand_out, user_out = _triton(q, k, v, cand_to_user, kv_len, p["scale"], user_q, causal)
    assert_rows_close(user_out, self_attention_reference(user_q, k, v, kv_len, causal, p["scale"]), rtol=HALF_TOL)
    assert_rows_close(cand_out, attention_reference(q, k, v, cand_to_user, kv_len, p["scale"]), rtol=HALF_TOL)


def _poisoned_plan_buffers(monkeypatch):
    """plan_buffers as the kernels get them (uninitialized), filled with garbage here: every word the
    attention kernels read must come from the plan kernel."""
    real = attention.plan_buffers

    def poisoned(num_candidates, max_tiles, device, recording=None):
        parts = real(num_candidates, max_tiles, device, recording)
        parts[0].as_strided((parts[0].untyped_storage().nbytes() // 4,), (1,)).fill_(0x5A5A5A5A)
        return parts

    monkeypatch.setattr(attention, "plan_buffers", poisoned)


def _check_plan_slots(cand_to_user, num_users, num_queries, order, tiles, flag):
    """Every tile slot is an empty slot (user -1) or a tile of a user in [0, U) whose rows lie inside
    that user's candidates in `order`, and those `order` entries are candidates of that user; the
    two words after the flag (the Gluon kernel's counters) are zero."""
    num_candidates = cand_to_user.shape[0]
    assert flag.as_strided((3,), (1,))[1:].tolist() == [0, 0]
    counts = torch.bincount(cand_to_user[(cand_to_user >= 0) & (cand_to_user < num_users)], minlength=num_users)
    for user, first_slot, row0, row_end in tiles.tolist():
        assert -1 <= user < num_users
        if user < 0:
            continue
        assert row_end == counts[user] * num_queries and 0 <= row0 < row_end
        assert 0 <= first_slot and first_slot + counts[user] <= num_candidates
        for cand in order[first_slot : first_slot + counts[user]].tolist():
            assert 0 <= cand < num_candidates and cand_to_user[cand] == user


@interpreted
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(num_users=st.integers(1, 70), data=st.data(), num_queries=st.integers(1, 40), block_m=st.sampled_from([16, 64]))
def test_interp_plan(monkeypatch, num_users, data, num_queries, block_m):
    """`order` groups the candidates by user, stable; the tiles cover each user's count·S rows
    exactly once; the flag stays down for valid values and goes up for any value out of range (and the host's
    word, where given, reads 1 + the flag). The
    buffers start as garbage: the plan kernel writes every slot, also for a bad mapping."""
    _poisoned_plan_buffers(monkeypatch)
    mapping = data.draw(st.lists(st.integers(0, num_users - 1), min_size=0, max_size=150))
    cand_to_user = torch.tensor(mapping, dtype=torch.int64)
    seq_len = data.draw(st.integers(0, 9))
    kv_len = data.draw(st.none() | st.just(torch.randint(0, seq_len + 1, (num_users,))))
    host_flag = torch.zeros(1, dtype=torch.int32)  # stands in for a pinned host word (kernels._common.HostFlag)
    order, tiles, max_tiles, flag = attention.plan_tiles(
        cand_to_user, num_users, num_queries, block_m, kv_len, seq_len, host_flag=host_flag
    )
    assert flag.item() == 0 and host_flag.item() == 1 and tiles.shape == (max_tiles, 4)
    assert order.tolist() == torch.argsort(cand_to_user, stable=True).tolist()
    _check_plan_slots(cand_to_user, num_users, num_queries, order, tiles, flag)
    counts = torch.bincount(cand_to_user, minlength=num_users).tolist()
    starts = [sum(counts[:u]) for u in range(num_users)]
    covered = {u: [] for u in range(num_users)}
    for user, first_slot, row0, row_end in tiles.tolist():
        if user < 0:
            continue
        assert first_slot == starts[user] and row_end == counts[user] * num_queries and row0 % block_m == 0
        covered[user].append(row0)
    for user, rows in covered.items():
        assert sorted(rows) == list(range(0, counts[user] * num_queries, block_m))

    bad = data.draw(st.sampled_from(["mapping_low", "mapping_high", "kv_len_low", "kv_len_high"]))
    if bad.startswith("mapping") and mapping:
        for _ in range(data.draw(st.integers(1, 3))):
            cand_to_user[data.draw(st.integers(0, len(mapping) - 1))] = (
                -data.draw(st.integers(1, 5)) if bad.endswith("low") else num_users + data.draw(st.integers(0, 5))
            )
    else:
        kv_len = torch.randint(0, seq_len + 1, (num_users,))
        kv_len[data.draw(st.integers(0, num_users - 1))] = -1 if bad.endswith("low") else seq_len + 1
    order, tiles, _, flag = attention.plan_tiles(
        cand_to_user, num_users, num_queries, block_m, kv_len, seq_len, host_flag=host_flag
    )
    assert flag.item() == 1 and host_flag.item() == 2
    _check_plan_slots(cand_to_user, num_users, num_queries, order, tiles, flag)


@interpreted
def test_interp_public_ops_dispatch():
    """backend='triton' runs the kernels (here: the interpreter), 'auto' stays on torch on CPU."""
    args = {name: t.to(torch.float16) if t.is_floating_point() else t for name, t in _good().items()}
    args["q"], args["k"], args["v"], args["user_q"] = (
        torch.randn(*args[n].shape[:3], 16).half() for n in ("q", "k", "v", "user_q")
    )
    triton_out = ikbo_self_target_attention(
        args["user_q"], args["q"], args["k"], args["v"], args["cand_to_user"], args["kv_len"], backend="triton"
    )
    torch_out = ikbo_self_target_attention(
        args["user_q"], args["q"], args["k"], args["v"], args["cand_to_user"], args["kv_len"], backend="auto"
    )
    for got, want in zip(triton_out, torch_out):
        assert_rows_close(got, want.double(), rtol=HALF_TOL, atol=1e-3)
    with pytest.raises(ValueError, match=r"^k:"):
        ikbo_attention(args["q"].float(), args["k"].float(), args["v"].float(), args["cand_to_user"], backend="triton")
    for name, change in BAD_INPUTS:  # index checks: before the launch (shapes) or flagged by the plan (values)
        if name in ("cand_to_user", "kv_len"):
            bad = {**args, **change}
            with pytest.raises(ValueError, match=rf"^{name}:"):
                ikbo_self_target_attention(
                    bad["user_q"], bad["q"], bad["k"], bad["v"], bad["cand_to_user"], bad["kv_len"], backend="triton"
                )


INTERP_TESTS = [name for name in dir() if name.startswith("test_interp_")]


@pytest.mark.skipif(INTERPRETED, reason="this process runs the interpreter tests itself")
def test_triton_kernels_on_cpu():
    """Runs the test_interp_* tests above in a child pytest with TRITON_INTERPRET=1."""
    root = Path(__file__).resolve().parents[1]
    ids = [f"{Path(__file__).resolve()}::{name}" for name in INTERP_TESTS]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *ids],
        cwd=root, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0 and f"{len(ids)} passed" in proc.stdout, proc.stdout[-6000:] + proc.stderr[-3000:]


# ---------------------------------------------------------------------------------------------
# Triton path on CUDA: real sizes
# ---------------------------------------------------------------------------------------------

cuda_only = pytest.mark.skipif(not HAS_CUDA or INTERPRETED, reason="needs a CUDA GPU")


REFERENCE_SCORE_BYTES = 1 << 30  # fp64 self-attention scores a reference chunk of users holds at most


def _fp64_on_device(q, k, v, cand_to_user, kv_len, user_q=None, causal=True):
    """fp64 reference at real sizes: the grouped torch path on upcast inputs (SDPA math in fp64); the self part a few
    users at a time, so that its [users, H, L, L] fp64 scores stay within REFERENCE_SCORE_BYTES (at U = 64,
    L = 4096 all of them would take 17 GB, and the GPU tests run twelve at once)."""
    up = [t.double() for t in (q, k, v)]
    cand_out = ikbo_attention(*up, cand_to_user, kv_len, backend="torch")
    if user_q is None:
        return cand_out, None
    num_users, heads, seq_len, head_dim = k.shape
    lengths = torch.full((num_users,), seq_len, device=k.device) if kv_len is None else kv_len.long()
    step = max(1, REFERENCE_SCORE_BYTES // (heads * seq_len * seq_len * 8))
    parts = [
        attention._self_attention_torch(
            user_q[u : u + step].double(), up[1][u : u + step], up[2][u : u + step], lengths[u : u + step], causal,
            1.0 / math.sqrt(head_dim),
        )
        for u in range(0, num_users, step)
    ]  # fmt: skip
    return cand_out, torch.cat(parts)


GPU_CASES = [
    # U, B, S, L, H, d, ragged kv_len, layout
    (15, 1024, 64, 1024, 4, 128, False, "bhsd"),
    (7, 300, 8, 1000, 2, 64, True, "bhsd"),
    (64, 64, 1, 4096, 2, 128, True, "fused"),
    (3, 700, 5, 333, 4, 64, True, "bshd"),
]


@cuda_only
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "U{}-B{}-S{}-L{}-H{}-d{}-{}-{}".format(*c))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_self_target_attention(case, dtype):
    num_users, num_candidates, num_queries, seq_len, heads, head_dim, ragged, layout = case
    gen = torch.Generator().manual_seed(num_users * 1000 + num_queries)
    mapping = torch.randint(0, num_users, (num_candidates,), generator=gen)
    lengths = [0, seq_len] + torch.randint(0, seq_len + 1, (num_users,), generator=gen).tolist()
    p = dict(num_users=num_users, mapping=mapping.tolist(), num_queries=num_queries, seq_len=seq_len, heads=heads,
             head_dim=head_dim, kv_len=lengths[:num_users] if ragged else None, scale=None, index_dtype=torch.int64,
             layout=layout, seed=int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))  # fmt: skip
    q, k, v, user_q, cand_to_user, kv_len = make_inputs(p, dtype, "cuda")
    cand_ref, user_ref = _fp64_on_device(q, k, v, cand_to_user, kv_len, user_q)
    cand_out, user_out = _triton(q, k, v, cand_to_user, kv_len, None, user_q)
    assert_rows_close(cand_out, cand_ref, rtol=HALF_TOL, atol=0.0)
    assert_rows_close(user_out, user_ref, rtol=HALF_TOL, atol=0.0)
    out = ikbo_attention(q, k, v, cand_to_user, kv_len)  # public op, "auto" → Triton on CUDA
    assert_rows_close(out, cand_ref, rtol=HALF_TOL, atol=0.0)
    sample = torch.randperm(num_candidates, generator=gen)[:8].to(q.device)  # the loop reference on a few
    sub_ref = attention_reference(q[sample], k, v, cand_to_user[sample], kv_len)
    assert_rows_close(out[sample], sub_ref, rtol=HALF_TOL, atol=0.0)


@cuda_only
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "U{}-B{}-S{}-L{}-H{}-d{}-{}-{}".format(*c))
def test_cuda_replayed_calls(case, replays):
    """A call whose signature was seen before replays that call's launches with its own addresses (kernels._launch):
    three rounds of fresh inputs (new allocations) through both ops, each against fp64; then a bad mapping value in
    a replayed call raises at check_deferred() and the next call is right."""
    num_users, num_candidates, num_queries, seq_len, heads, head_dim, ragged, layout = case
    attention._REPLAYS.clear()
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))

    def inputs():
        mapping = torch.randint(0, num_users, (num_candidates,), generator=gen)
        lengths = torch.randint(0, seq_len + 1, (num_users,), generator=gen).tolist()
        p = dict(num_users=num_users, mapping=mapping.tolist(), num_queries=num_queries, seq_len=seq_len,
                 heads=heads, head_dim=head_dim, kv_len=lengths if ragged else None, scale=None,
                 index_dtype=torch.int64, layout=layout, seed=int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))  # fmt: skip
        return make_inputs(p, torch.bfloat16, "cuda")

    for _ in range(3):
        q, k, v, user_q, cand_to_user, kv_len = inputs()
        cand_ref, user_ref = _fp64_on_device(q, k, v, cand_to_user, kv_len, user_q)
        assert_rows_close(ikbo_attention(q, k, v, cand_to_user, kv_len), cand_ref, rtol=HALF_TOL, atol=0.0)
        user_out, cand_out = ikbo_self_target_attention(user_q, q, k, v, cand_to_user, kv_len)
        assert_rows_close(cand_out, cand_ref, rtol=HALF_TOL, atol=0.0)
        assert_rows_close(user_out, user_ref, rtol=HALF_TOL, atol=0.0)
    if layout == "bhsd":  # separate q, k, v (the fused layout shares one storage: never recorded)
        assert len(replays) >= 2
    bad = cand_to_user.clone()
    bad[num_candidates // 2] = num_users
    ikbo_attention(q, k, v, bad, kv_len)
    with pytest.raises(ValueError, match=r"^cand_to_user"):
        check_deferred()
    q, k, v, user_q, cand_to_user, kv_len = inputs()
    cand_ref, _ = _fp64_on_device(q, k, v, cand_to_user, kv_len)
    assert_rows_close(ikbo_attention(q, k, v, cand_to_user, kv_len), cand_ref, rtol=HALF_TOL, atol=0.0)


# the canonical shape's tiles (128 × 64, 8 warps, ≤ 128 registers) with the register cap off and with 32-key blocks,
# self + target
GPU_OPTIONS = [
    dict(maxnreg=None),
    dict(block_n=32),
]


@cuda_only
@pytest.mark.parametrize("options", GPU_OPTIONS, ids=str)
@pytest.mark.parametrize("case", GPU_CASES[0:3:2], ids=lambda c: "U{}-B{}-S{}-L{}-H{}-d{}-{}-{}".format(*c))
def test_cuda_tile_options(case, options):
    num_users, num_candidates, num_queries, seq_len, heads, head_dim, ragged, layout = case
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    mapping = torch.randint(0, num_users, (num_candidates,), generator=gen)
    lengths = torch.randint(0, seq_len + 1, (num_users,), generator=gen).tolist()
    p = dict(num_users=num_users, mapping=mapping.tolist(), num_queries=num_queries, seq_len=seq_len, heads=heads,
             head_dim=head_dim, kv_len=lengths if ragged else None, scale=None, index_dtype=torch.int32,
             layout=layout, seed=int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))  # fmt: skip
    q, k, v, user_q, cand_to_user, kv_len = make_inputs(p, torch.bfloat16, "cuda")
    cand_ref, user_ref = _fp64_on_device(q, k, v, cand_to_user, kv_len, user_q)
    config = TileConfig(**{**vars(attention.pick_config(1e9, False)), **options})
    cand_out, user_out = _triton(q, k, v, cand_to_user, kv_len, None, user_q, config=config)
    assert_rows_close(cand_out, cand_ref, rtol=HALF_TOL, atol=0.0)
    assert_rows_close(user_out, user_ref, rtol=HALF_TOL, atol=0.0)


@cuda_only
@pytest.mark.parametrize("strict", [False, True], ids=["deferred", "strict"])
@pytest.mark.parametrize(
    "name, change", [(n, c) for n, c in BAD_INPUTS if n in ("cand_to_user", "kv_len")], ids=lambda x: str(x)[:40]
)
def test_cuda_bad_index_values_raise(name, change, strict):
    """On CUDA the op does not wait for the device: a bad shape or dtype raises at the call, a bad value (the
    plan's flag, written to pinned host memory by the plan kernel) the ValueError naming the argument at check_deferred(),
    or at the call in strict mode; the next valid call is unaffected."""
    args = {n: t.cuda() if isinstance(t, torch.Tensor) else t for n, t in {**_good(), **change}.items()}
    args["q"], args["k"], args["v"] = (
        torch.randn(*args[n].shape[:3], 64, device="cuda", dtype=torch.bfloat16) for n in ("q", "k", "v")
    )
    call = partial(ikbo_attention, args["q"], args["k"], args["v"], args["cand_to_user"], args["kv_len"])
    shape_ok = args["cand_to_user"].shape == (4,) and not args["cand_to_user"].is_floating_point()
    shape_ok = shape_ok and args["kv_len"].shape == (3,) and not args["kv_len"].is_floating_point()
    with strict_checks(strict):
        if strict or not shape_ok:
            with pytest.raises(ValueError, match=rf"^{name}:"):
                call()
        else:
            call()  # returns without waiting for the device
            with pytest.raises(ValueError, match=rf"^{name}:"):
                check_deferred()
    good = {n: t.cuda() for n, t in _good().items()}
    out = ikbo_attention(args["q"], args["k"], args["v"], good["cand_to_user"], good["kv_len"])
    assert_rows_close(
        out,
        _fp64_on_device(args["q"], args["k"], args["v"], good["cand_to_user"], good["kv_len"])[0],
        rtol=HALF_TOL,
        atol=0.0,
    )


@cuda_only
def test_cuda_graph_capture():
    """The public op under CUDA graph capture (no flag wait there): capture once, then replay on new
    values copied into the captured inputs (mapping and kv_len too); each replay matches fp64."""
    num_users, num_candidates, num_queries, seq_len, heads, head_dim = 5, 300, 8, 200, 2, 64
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))

    def fresh():
        p = dict(num_users=num_users, mapping=torch.randint(0, num_users, (num_candidates,), generator=gen).tolist(),
                 num_queries=num_queries, seq_len=seq_len, heads=heads, head_dim=head_dim,
                 kv_len=torch.randint(0, seq_len + 1, (num_users,), generator=gen).tolist(), scale=None,
                 index_dtype=torch.int64, layout="bhsd", seed=int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))  # fmt: skip
        return make_inputs(p, torch.bfloat16, "cuda")

    static = fresh()
    q, k, v, user_q, cand_to_user, kv_len = static
    ikbo_self_target_attention(user_q, q, k, v, cand_to_user, kv_len)  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        user_out, cand_out = ikbo_self_target_attention(user_q, q, k, v, cand_to_user, kv_len)
        target_out = ikbo_attention(q, k, v, cand_to_user, kv_len)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        new = fresh()
        for dst, src in zip(static, new):
            dst.copy_(src)
        for out in (user_out, cand_out, target_out):
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        cand_ref, user_ref = _fp64_on_device(q, k, v, cand_to_user, kv_len, user_q)
        assert_rows_close(cand_out, cand_ref, rtol=HALF_TOL, atol=0.0)
        assert_rows_close(target_out, cand_ref, rtol=HALF_TOL, atol=0.0)
        assert_rows_close(user_out, user_ref, rtol=HALF_TOL, atol=0.0)
