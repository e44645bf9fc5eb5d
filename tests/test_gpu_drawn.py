"""Drawn problems through the GPU kernels on a Hopper device, against fp64 (skipped without one).

The fixed GPU cases of test_linear_compress_ws.py, test_attention_ws.py and test_attention.py pin the
named corners. Here hypothesis draws everything else:
- the sizes, so the tile edges fall anywhere;
- ragged, unsorted mappings, with some users left without candidates, as int32 or int64;
- kv_len, with 0 and L among the values;
- the K/V layouts the served model passes: contiguous [U, H, L, d], [U, L, H, d] storage, and slices of one
  fused [U, L, 3·H·d] projection;
- S on both q paths of the Gluon attention kernel: rows by TMA when S % 64 == 0, gathered rows otherwise;
- the persistent grid: full, or a few programs, so that the ring, turn and item phases wrap many times.

Each problem runs through the kernel itself (outputs and Y_u NaN-poisoned first) and through the public op's
own dispatch, fresh random inputs (drawn on the GPU from a drawn seed). Examples per test: $IKBO_GPU_EXAMPLES
(default 20). docs/perf.md has the device run with many more.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels import attention
from kernels.attention_ws import DEFAULT_CONFIG, WSAttentionConfig, launch_ws, self_target_ws_ok, ws_supported
from kernels.linear_compress import PackedLinearCompress
from kernels.linear_compress_ws import lce_s6, s6_supported

HAS_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
EXAMPLES = int(os.environ.get("IKBO_GPU_EXAMPLES", "20"))
DRAWN = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), print_blob=True)
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
ATTENTION_TOLERANCE = 1e-2  # P is rounded to 16 bits before P·V, also in fp16
pytestmark = pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper GPU")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in fp64; a NaN (an unwritten poisoned output) never passes; 0 / 0 is 0."""
    diff = (out.double() - ref).norm().item()
    scale = ref.norm().item()
    return diff / scale if scale > 0 else diff


def ragged_mapping(draw, num_users: int, num_candidates: int, gen: torch.Generator) -> torch.Tensor:
    """Unsorted, unequal counts; the drawn number of users (the last ones) get no candidate."""
    empty = draw(st.integers(0, num_users - 1))
    weights = torch.rand(num_users - empty, generator=gen) ** 2 + 0.05
    users = torch.multinomial(weights, num_candidates, replacement=True, generator=gen)
    return users.to("cuda", draw(st.sampled_from([torch.int32, torch.int64])))


def cuda_generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


# ---------------------------------------------------------------------------------------------- LCE


@st.composite
def lce_problems(draw):
    """user_emb [U, Ku, D], cand_emb [B, Kc, D], mapping, weight [N, Ku + Kc], bias, in s6's domain
    (fp16/bf16, Kc ≥ 1, D · 2 bytes a multiple of 16), and the fp64 reference."""
    num_users = draw(st.integers(1, 40))
    num_candidates = draw(st.integers(1, 1100))
    num_user_tokens = draw(st.just(0) | st.integers(1, 300))
    num_cand_tokens = draw(st.integers(1, 600))
    dim = 8 * draw(st.integers(1, 40))
    rows = draw(st.integers(1, 520))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16]))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    cand_to_user = ragged_mapping(draw, num_users, num_candidates, gen)
    cuda_gen = cuda_generator(seed)
    user_emb = torch.randn(num_users, num_user_tokens, dim, device="cuda", generator=cuda_gen).to(dtype)
    cand_emb = torch.randn(num_candidates, num_cand_tokens, dim, device="cuda", generator=cuda_gen).to(dtype)
    weight = torch.randn(rows, num_user_tokens + num_cand_tokens, device="cuda", generator=cuda_gen)
    weight = (weight / (num_user_tokens + num_cand_tokens) ** 0.5).to(dtype)
    bias = torch.randn(rows, device="cuda", generator=cuda_gen).to(dtype) if draw(st.booleans()) else None
    # the reference replicates user rows, as the baseline does: test code only
    tokens = torch.cat([user_emb.double()[cand_to_user.long()], cand_emb.double()], dim=1)
    ref = torch.matmul(weight.double(), tokens) + (0 if bias is None else bias.double()[:, None])
    num_programs = draw(st.none() | st.integers(1, 7))
    return user_emb, cand_emb, cand_to_user, weight, bias, ref, num_programs


@DRAWN
@given(problem=lce_problems())
def test_drawn_lce_s6_and_public_op(problem):
    """s6 (its two launches, out and Y_u NaN-poisoned; the full grid or a few programs) and the public op's
    own variant choice (s6 or s3/s4 by shape), both against fp64."""
    user_emb, cand_emb, cand_to_user, weight, bias, ref, num_programs = problem
    tol = TOLERANCE[cand_emb.dtype]
    assert s6_supported(user_emb, cand_emb)
    packed = PackedLinearCompress.from_weight(weight, user_emb.shape[1], bias)
    out = torch.full(ref.shape, float("nan"), dtype=cand_emb.dtype, device="cuda")
    user_part = torch.full((user_emb.shape[0], *ref.shape[1:]), float("nan"), dtype=cand_emb.dtype, device="cuda")
    if num_programs is None:
        lce_s6(packed, user_emb, cand_emb, cand_to_user, out=out, user_part=user_part if user_emb.shape[1] else None)
    else:
        from kernels.linear_compress_ws import _launch_ws, run_fused, ws_config

        cfg = ws_config(user_emb.shape[2], cand_emb.element_size())
        launch = lambda *args: _launch_ws(*args, num_programs=num_programs)  # noqa: E731
        run_fused(packed, user_emb, cand_emb, cand_to_user, out, user_part if user_emb.shape[1] else None, cfg, launch)
    torch.cuda.synchronize()
    assert rel_err(out, ref) <= tol, ("s6", num_programs, rel_err(out, ref))
    public = packed(user_emb, cand_emb, cand_to_user)
    assert rel_err(public, ref) <= tol, ("public op", rel_err(public, ref))


# ---------------------------------------------------------------------------------------- attention


def kv_tensors(draw, num_users, heads, seq_len, head_dim, dtype, gen):
    """(user_q, k, v) [U, H, L, d] in a drawn layout: contiguous, [U, L, H, d] storage, or slices of one fused
    [U, L, 3·H·d] projection (q | k | v), as the served model passes them."""
    layout = draw(st.sampled_from(["contiguous", "ULHd", "fused"]))
    if layout == "fused":
        qkv = torch.randn(num_users, seq_len, 3 * heads * head_dim, device="cuda", generator=gen).to(dtype)
        parts = qkv.split(heads * head_dim, dim=2)
        return tuple(p.unflatten(2, (heads, head_dim)).transpose(1, 2) for p in parts)
    if layout == "ULHd":
        return tuple(torch.randn(num_users, seq_len, heads, head_dim, device="cuda", generator=gen).to(dtype).transpose(1, 2)
                     for _ in range(3))  # fmt: skip
    return tuple(torch.randn(num_users, heads, seq_len, head_dim, device="cuda", generator=gen).to(dtype) for _ in range(3))


@st.composite
def attention_problems(draw):
    """q [B, H, S, d], user_q / k / v [U, H, L, d], mapping, kv_len (None or ragged, 0 and L among the
    values), in the Gluon kernel's domain (fp16/bf16, d ∈ {64, 128}); B · S ≤ 40,000 query rows."""
    num_users = draw(st.integers(1, 24))
    num_queries = draw(st.sampled_from([1, 8, 64, 128, 192]) | st.integers(1, 200))
    num_candidates = draw(st.integers(1, max(1, min(900, 40_000 // num_queries))))
    seq_len = draw(st.integers(1, 1100))
    heads = draw(st.integers(1, 4))
    head_dim = draw(st.sampled_from([64, 128]))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16]))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    cand_to_user = ragged_mapping(draw, num_users, num_candidates, gen)
    kv_len = None
    if draw(st.booleans()):
        kv_len = torch.randint(0, seq_len + 1, (num_users,), generator=gen)
        kv_len[torch.randint(0, num_users, (2,), generator=gen)] = torch.tensor([0, seq_len])
        kv_len = kv_len.to("cuda", draw(st.sampled_from([torch.int32, torch.int64])))
    cuda_gen = cuda_generator(seed)
    user_q, k, v = kv_tensors(draw, num_users, heads, seq_len, head_dim, dtype, cuda_gen)
    q = torch.randn(num_candidates, heads, num_queries, head_dim, device="cuda", generator=cuda_gen).to(dtype)
    config = draw(st.sampled_from([DEFAULT_CONFIG, WSAttentionConfig(dynamic=True), WSAttentionConfig(dynamic=False)]))
    num_programs = draw(st.none() | st.integers(1, 5))
    return q, user_q, k, v, cand_to_user, kv_len, config, num_programs


def _fp64(*tensors):
    return [t.double() for t in tensors]


@DRAWN
@given(problem=attention_problems())
def test_drawn_target_attention(problem):
    """launch_ws (out NaN-poisoned; drawn item order and grid) and ikbo_attention's own dispatch (the Gluon
    kernel at its preferred shapes, else the Triton kernel), both against fp64."""
    q, _, k, v, cand_to_user, kv_len, config, num_programs = problem
    assert ws_supported(q, k)
    ref = attention.ikbo_attention(*_fp64(q, k, v), cand_to_user, kv_len, backend="torch")
    out = torch.full_like(q, float("nan"))
    launch_ws(q, k, v, cand_to_user, kv_len, 1 / math.sqrt(q.shape[3]), config, out=out, num_programs=num_programs)
    torch.cuda.synchronize()
    assert rel_err(out, ref) <= ATTENTION_TOLERANCE, ("launch_ws", rel_err(out, ref))
    public = attention.ikbo_attention(q, k, v, cand_to_user, kv_len)
    assert rel_err(public, ref) <= ATTENTION_TOLERANCE, ("public op", rel_err(public, ref))


@DRAWN
@given(problem=attention_problems(), causal=st.booleans())
def test_drawn_self_target_attention(problem, causal):
    """Self tiles (causal or not) and target tiles in one launch_ws (both outputs NaN-poisoned), and
    ikbo_self_target_attention's own dispatch, against fp64."""
    q, user_q, k, v, cand_to_user, kv_len, config, num_programs = problem
    ref_user, ref_cand = attention.ikbo_self_target_attention(*_fp64(user_q, q, k, v), cand_to_user, kv_len, causal=causal,
                                                              backend="torch")  # fmt: skip
    out, user_out = torch.full_like(q, float("nan")), torch.full(user_q.shape, float("nan"), dtype=q.dtype, device="cuda")
    assert self_target_ws_ok(q, out, user_q, user_out)
    launch_ws(q, k, v, cand_to_user, kv_len, 1 / math.sqrt(q.shape[3]), config, out=out, num_programs=num_programs,
              user_q=user_q, user_out=user_out, causal=causal)  # fmt: skip
    torch.cuda.synchronize()
    assert rel_err(user_out, ref_user) <= ATTENTION_TOLERANCE, ("launch_ws user", rel_err(user_out, ref_user))
    assert rel_err(out, ref_cand) <= ATTENTION_TOLERANCE, ("launch_ws candidates", rel_err(out, ref_cand))
    user_public, cand_public = attention.ikbo_self_target_attention(user_q, q, k, v, cand_to_user, kv_len, causal=causal)
    assert rel_err(user_public, ref_user) <= ATTENTION_TOLERANCE, ("public op user", rel_err(user_public, ref_user))
    assert rel_err(cand_public, ref_cand) <= ATTENTION_TOLERANCE, ("public op candidates", rel_err(cand_public, ref_cand))
