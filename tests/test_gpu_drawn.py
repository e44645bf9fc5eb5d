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
(default 20).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels import attention, linear_compress_ws
from kernels.attention_ws import DEFAULT_CONFIG, WSAttentionConfig, launch_ws, self_target_ws_ok, ws_supported
from kernels.linear_compress import PackedLinearCompress
from kernels.reference import rel_err

HAS_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
EXAMPLES = int(os.environ.get("IKBO_GPU_EXAMPLES", "20"))
DRAWN = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), print_blob=True)
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
ATTENTION_TOLERANCE = 1e-2  # P is rounded to 16 bits before P·V, also in fp16
pytestmark = pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper GPU")


def ragged_mapping(
    num_users: int, num_candidates: int, empty_users: int, index_dtype, gen, device="cuda"
) -> torch.Tensor:
    """Unsorted, unequal counts; the last `empty_users` users get no candidate."""
    weights = torch.rand(num_users - empty_users, generator=gen) ** 2 + 0.05
    users = torch.multinomial(weights, num_candidates, replacement=True, generator=gen)
    return users.to(device, index_dtype)


def filler(device, seed: int, dtype, random: bool):
    """make(*shape, scale=1) → a [shape] tensor of `dtype` on `device`: standard normal draws from `seed` (on the
    device), or uninitialized when not `random`."""
    gen = torch.Generator(device=device).manual_seed(seed) if random else None

    def make(*shape, scale=1.0):
        if not random:
            return torch.empty(shape, dtype=dtype, device=device)
        return (torch.randn(shape, device=device, generator=gen) * scale).to(dtype)

    return make


def drawn_inputs(spec, device, random: bool):
    """(CPU generator from spec.seed, spec's ragged mapping on `device`, spec's `filler`)."""
    gen = torch.Generator().manual_seed(spec.seed)
    cand_to_user = ragged_mapping(
        spec.num_users, spec.num_candidates, spec.empty_users, INDEX_DTYPES[spec.index_dtype], gen, device
    )
    return gen, cand_to_user, filler(device, spec.seed, DTYPES[spec.dtype], random)


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
INDEX_DTYPES = {"int32": torch.int32, "int64": torch.int64}


# ---------------------------------------------------------------------------------------------- LCE


@dataclass(frozen=True)
class LCESpec:
    """A drawn LCE problem (fp16/bf16; `lce_specs` keeps it in the warp-specialized kernel's domain, Kc ≥ 1 and
    D · 2 bytes a multiple of 16, unless asked for any shape); its tensors come from `seed` (printed as is when a
    test fails)."""

    num_users: int
    num_candidates: int
    num_user_tokens: int  # Ku (0: no user part)
    num_cand_tokens: int  # Kc
    dim: int  # D
    rows: int  # N
    with_bias: bool
    dtype: str
    index_dtype: str
    empty_users: int  # the last users, without candidates
    num_programs: int | None  # the warp-specialized kernel's persistent grid (None: one program per SM)
    seed: int

    def tensors(self, device="cuda", random=True):
        """user_emb [U, Ku, D], cand_emb [B, Kc, D], cand_to_user [B], weight [N, Ku + Kc], bias [N] or None; random=False:
        uninitialized (tests/test_gpu_compile.py only compiles)."""
        _, cand_to_user, make = drawn_inputs(self, device, random)
        ku, kc = self.num_user_tokens, self.num_cand_tokens
        user_emb, cand_emb = make(self.num_users, ku, self.dim), make(self.num_candidates, kc, self.dim)
        weight = make(self.rows, ku + kc, scale=max(1, ku + kc) ** -0.5)
        bias = make(self.rows) if self.with_bias else None
        return user_emb, cand_emb, cand_to_user, weight, bias


def lce_reference(user_emb, cand_emb, cand_to_user, weight, bias):
    """out [B, N, D] in fp64; it replicates user rows, as the baseline does (test code only)."""
    tokens = torch.cat([user_emb.double()[cand_to_user.long()], cand_emb.double()], dim=1)
    return torch.matmul(weight.double(), tokens) + (0 if bias is None else bias.double()[:, None])


@st.composite
def lce_specs(draw, any_shape: bool = False):
    """In the warp-specialized kernel's domain; with `any_shape`, also D not a multiple of 8 and Kc = 0 (fused and
    persistent only: pointer loads)."""
    num_users = draw(st.integers(1, 40))
    return LCESpec(
        num_users=num_users,
        num_candidates=draw(st.integers(1, 1100)),
        num_user_tokens=draw(st.just(0) | st.integers(1, 300)),
        num_cand_tokens=draw(st.integers(0 if any_shape else 1, 600)),
        dim=draw(st.integers(1, 320)) if any_shape else 8 * draw(st.integers(1, 40)),
        rows=draw(st.integers(1, 520)),
        with_bias=draw(st.booleans()),
        dtype=draw(st.sampled_from(sorted(DTYPES))),
        index_dtype=draw(st.sampled_from(sorted(INDEX_DTYPES))),
        empty_users=draw(st.integers(0, num_users - 1)),
        num_programs=draw(st.none() | st.integers(1, 7)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@DRAWN
@given(spec=lce_specs())
def test_drawn_lce_warp_specialized_and_public_op(spec):
    """The warp-specialized variant (its two launches, out and Y_u NaN-poisoned; the full grid or a few programs)
    and the public op's own variant choice (warp_specialized, fused or persistent by shape), both against fp64."""
    user_emb, cand_emb, cand_to_user, weight, bias = spec.tensors()
    ref = lce_reference(user_emb, cand_emb, cand_to_user, weight, bias)
    tol = TOLERANCE[cand_emb.dtype]
    assert linear_compress_ws.ws_supported(user_emb, cand_emb)
    packed = PackedLinearCompress.from_weight(weight, spec.num_user_tokens, bias)
    out = torch.full(ref.shape, float("nan"), dtype=cand_emb.dtype, device="cuda")
    user_part = None
    if spec.num_user_tokens:
        user_part = torch.full((spec.num_users, *ref.shape[1:]), float("nan"), dtype=cand_emb.dtype, device="cuda")
    linear_compress_ws.launch_ws(
        packed, user_emb, cand_emb, cand_to_user, out, user_part, num_programs=spec.num_programs
    )
    torch.cuda.synchronize()
    assert rel_err(out, ref) <= tol, ("warp_specialized", rel_err(out, ref))
    public = packed(user_emb, cand_emb, cand_to_user)
    assert rel_err(public, ref) <= tol, ("public op", rel_err(public, ref))


# ---------------------------------------------------------------------------------------- attention

CONFIGS = {
    "default": DEFAULT_CONFIG,
    "dynamic": WSAttentionConfig(dynamic=True),
    "static": WSAttentionConfig(dynamic=False),
}


@dataclass(frozen=True)
class AttentionSpec:
    """A drawn attention problem in the Gluon kernel's domain (fp16/bf16, d ∈ {64, 128}); its tensors come
    from `seed`. `layout` of user_q / k / v: contiguous [U, H, L, d], "ULHd" storage, or slices of one
    "fused" [U, L, 3·H·d] projection (q | k | v), as the served model passes them."""

    num_users: int
    num_candidates: int
    num_queries: int  # S
    seq_len: int  # L
    heads: int
    head_dim: int
    kv_len: str | None  # None, or the index dtype of a ragged kv_len with 0 and L among its values
    layout: str
    dtype: str
    index_dtype: str
    empty_users: int
    config: str  # of CONFIGS
    num_programs: int | None
    seed: int

    def tensors(self, device="cuda", random=True):
        """q [B, H, S, d], user_q / k / v [U, H, L, d], cand_to_user [B], kv_len [U] or None; random=False:
        uninitialized (tests/test_gpu_compile.py only compiles)."""
        gen, cand_to_user, make = drawn_inputs(self, device, random)
        kv_len = None
        if self.kv_len is not None:
            kv_len = torch.randint(0, self.seq_len + 1, (self.num_users,), generator=gen)
            kv_len[torch.randint(0, self.num_users, (2,), generator=gen)] = torch.tensor([0, self.seq_len])
            kv_len = kv_len.to(device, INDEX_DTYPES[self.kv_len])
        users, heads, seq_len, head_dim = self.num_users, self.heads, self.seq_len, self.head_dim
        if self.layout == "fused":
            qkv = make(users, seq_len, 3 * heads * head_dim)
            user_q, k, v = (
                p.unflatten(2, (heads, head_dim)).transpose(1, 2) for p in qkv.split(heads * head_dim, dim=2)
            )
        elif self.layout == "ULHd":
            user_q, k, v = (make(users, seq_len, heads, head_dim).transpose(1, 2) for _ in range(3))
        else:
            user_q, k, v = (make(users, heads, seq_len, head_dim) for _ in range(3))
        q = make(self.num_candidates, heads, self.num_queries, head_dim)
        return q, user_q, k, v, cand_to_user, kv_len


@st.composite
def attention_specs(draw, any_head_dim: bool = False):
    """B · S ≤ 40,000 query rows; S both on the TMA-row path (multiples of 64) and off it. d ∈ {64, 128} (the Gluon
    kernel's); with `any_head_dim` every d of the Triton kernel, {16, 32, 64, 128}."""
    num_users = draw(st.integers(1, 24))
    num_queries = draw(st.sampled_from([1, 8, 64, 128, 192]) | st.integers(1, 200))
    return AttentionSpec(
        num_users=num_users,
        num_candidates=draw(st.integers(1, max(1, min(900, 40_000 // num_queries)))),
        num_queries=num_queries,
        seq_len=draw(st.integers(1, 1100)),
        heads=draw(st.integers(1, 4)),
        head_dim=draw(st.sampled_from([16, 32, 64, 128] if any_head_dim else [64, 128])),
        kv_len=draw(st.none() | st.sampled_from(sorted(INDEX_DTYPES))),
        layout=draw(st.sampled_from(["contiguous", "ULHd", "fused"])),
        dtype=draw(st.sampled_from(sorted(DTYPES))),
        index_dtype=draw(st.sampled_from(sorted(INDEX_DTYPES))),
        empty_users=draw(st.integers(0, num_users - 1)),
        config=draw(st.sampled_from(sorted(CONFIGS))),
        num_programs=draw(st.none() | st.integers(1, 5)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _fp64(*tensors):
    return [t.double() for t in tensors]


@DRAWN
@given(spec=attention_specs())
def test_drawn_target_attention(spec):
    """launch_ws (out NaN-poisoned; drawn item order and grid) and ikbo_attention's own dispatch (the Gluon
    kernel at its preferred shapes, else the Triton kernel), both against fp64."""
    q, _, k, v, cand_to_user, kv_len = spec.tensors()
    assert ws_supported(q, k)
    ref = attention.ikbo_attention(*_fp64(q, k, v), cand_to_user, kv_len, backend="torch")
    out = torch.full_like(q, float("nan"))
    launch_ws(q, k, v, cand_to_user, kv_len, 1 / math.sqrt(spec.head_dim), CONFIGS[spec.config], out=out,
              num_programs=spec.num_programs)  # fmt: skip
    torch.cuda.synchronize()
    assert rel_err(out, ref) <= ATTENTION_TOLERANCE, ("launch_ws", rel_err(out, ref))
    public = attention.ikbo_attention(q, k, v, cand_to_user, kv_len)
    assert rel_err(public, ref) <= ATTENTION_TOLERANCE, ("public op", rel_err(public, ref))


@DRAWN
@given(spec=attention_specs(), causal=st.booleans())
def test_drawn_self_target_attention(spec, causal):
    """Self tiles (causal or not) and target tiles in one launch_ws (both outputs NaN-poisoned), and
    ikbo_self_target_attention's own dispatch, against fp64."""
    q, user_q, k, v, cand_to_user, kv_len = spec.tensors()
    ref_user, ref_cand = attention.ikbo_self_target_attention(*_fp64(user_q, q, k, v), cand_to_user, kv_len, causal=causal,
                                                              backend="torch")  # fmt: skip
    out, user_out = (
        torch.full_like(q, float("nan")),
        torch.full(user_q.shape, float("nan"), dtype=q.dtype, device="cuda"),
    )
    assert self_target_ws_ok(q, out, user_q, user_out)
    launch_ws(q, k, v, cand_to_user, kv_len, 1 / math.sqrt(spec.head_dim), CONFIGS[spec.config], out=out,
              num_programs=spec.num_programs, user_q=user_q, user_out=user_out, causal=causal)  # fmt: skip
    torch.cuda.synchronize()
    assert rel_err(user_out, ref_user) <= ATTENTION_TOLERANCE, ("launch_ws user", rel_err(user_out, ref_user))
    assert rel_err(out, ref_cand) <= ATTENTION_TOLERANCE, ("launch_ws candidates", rel_err(out, ref_cand))
    user_public, cand_public = attention.ikbo_self_target_attention(
        user_q, q, k, v, cand_to_user, kv_len, causal=causal
    )
    assert rel_err(user_public, ref_user) <= ATTENTION_TOLERANCE, ("public op user", rel_err(user_public, ref_user))
    assert rel_err(cand_public, ref_cand) <= ATTENTION_TOLERANCE, (
        "public op candidates",
        rel_err(cand_public, ref_cand),
    )
