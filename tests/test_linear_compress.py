"""IKBO linear compression against the fp64 reference (`kernels.reference.linear_compress_reference`).

Every case draws fresh random inputs (never zeros) and a random mapping: U = 1, B = 1, B = U, users
with no candidates, unsorted mappings, odd Ku / Kc / D, Ku = 0 or Kc = 0, bias or none, int32 and
int64 mappings. Error tests check that the ValueError names the bad argument.

Three layers:
- the torch path, on the CPU;
- the Triton kernels of every variant (`VARIANTS`) under TRITON_INTERPRET=1, on small shapes. The
  interpreter must be switched on before Triton compiles anything, so `test_triton_interpreted`
  runs this file's `interpreted` tests in a child pytest process with the variable set; this
  process (and any other test module in it) keeps compiled Triton. Run with TRITON_INTERPRET=1 in
  the environment, the `interpreted` tests run directly. fp32 and fp16 only: Triton 3.6's
  interpreter gets `tl.dot` on bfloat16 wrong (relative error ~1e9 on a bare 16×16 dot), bf16 is
  covered on the GPU;
- the same kernels on CUDA at real sizes, bf16, outputs poisoned with NaN first (skipped without CUDA).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from interpreted import run_interpreted

from kernels import PackedLinearCompress, check_deferred, ikbo_linear_compress, strict_checks
from kernels.configs import TileConfig
from kernels.linear_compress import VARIANTS
from kernels.reference import linear_compress_reference, rel_err

FP32_TOL = 1e-5
FP16_TOL = 2e-3
BF16_TOL = 1e-2
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
HAS_CUDA = torch.cuda.is_available()


@dataclass(frozen=True)
class Case:
    """One drawn problem: sizes, mapping and a seed for the random tensors."""

    num_user_tokens: int  # Ku
    num_cand_tokens: int  # Kc
    dim: int  # D
    out_rows: int  # N
    num_users: int  # U
    mapping: tuple  # cand_to_user, length B
    with_bias: bool
    index_dtype: torch.dtype
    seed: int


def make_inputs(case: Case, dtype=torch.float32, device="cpu"):
    """Fresh random tensors for `case`: user_emb, cand_emb, cand_to_user, weight, bias."""
    gen = torch.Generator().manual_seed(case.seed)
    ku, kc, d, n = case.num_user_tokens, case.num_cand_tokens, case.dim, case.out_rows
    user_emb = torch.randn(case.num_users, ku, d, generator=gen)  # [U, Ku, D]
    cand_emb = torch.randn(len(case.mapping), kc, d, generator=gen)  # [B, Kc, D]
    weight = torch.randn(n, ku + kc, generator=gen) / max(1, ku + kc) ** 0.5  # [N, Ku + Kc]
    bias = torch.randn(n, generator=gen) if case.with_bias else None  # [N]
    cand_to_user = torch.tensor(case.mapping, dtype=case.index_dtype)  # [B]
    tensors = [t.to(device=device, dtype=dtype) for t in (user_emb, cand_emb, weight)]
    bias = None if bias is None else bias.to(device=device, dtype=dtype)
    return tensors[0], tensors[1], cand_to_user.to(device), tensors[2], bias


@st.composite
def cases(draw, max_users=6, max_candidates=12, max_tokens=9, max_dim=9, max_rows=9):
    num_users = draw(st.integers(1, max_users))
    num_candidates = draw(st.integers(0, max_candidates))
    mapping = draw(st.lists(st.integers(0, num_users - 1), min_size=num_candidates, max_size=num_candidates))
    return Case(
        num_user_tokens=draw(st.integers(0, max_tokens)),
        num_cand_tokens=draw(st.integers(0, max_tokens)),
        dim=draw(st.integers(1, max_dim)),
        out_rows=draw(st.integers(1, max_rows)),
        num_users=num_users,
        mapping=tuple(mapping),
        with_bias=draw(st.booleans()),
        index_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


# Named corner cases, run on every invocation besides the drawn ones.
CORNERS = [
    Case(3, 5, 7, 4, 1, (0,), True, torch.int64, 1),  # U = 1, B = 1
    Case(4, 3, 5, 6, 1, (0, 0, 0, 0, 0), False, torch.int32, 2),  # U = 1, many candidates
    Case(5, 2, 3, 5, 4, (3, 1, 0, 2), True, torch.int32, 3),  # B = U, unsorted
    Case(2, 3, 4, 3, 6, (5, 5, 1), True, torch.int64, 4),  # users 0, 2, 3, 4 have no candidates
    Case(0, 5, 3, 4, 3, (2, 0, 1, 0), True, torch.int64, 5),  # Ku = 0
    Case(5, 0, 3, 4, 3, (1, 2, 2), False, torch.int32, 6),  # Kc = 0
    Case(0, 0, 3, 4, 2, (1, 0), True, torch.int64, 7),  # Ku = Kc = 0: bias only
    Case(3, 3, 4, 5, 2, (), True, torch.int64, 8),  # B = 0
]


def _check_torch_path(case: Case) -> None:
    user_emb, cand_emb, cand_to_user, weight, bias = make_inputs(case)
    ref = linear_compress_reference(user_emb, cand_emb, cand_to_user, weight, bias)
    out = ikbo_linear_compress(user_emb, cand_emb, cand_to_user, weight, bias, backend="torch")
    assert out.shape == (len(case.mapping), case.out_rows, case.dim)
    assert out.dtype == torch.float32
    assert rel_err(out, ref) <= FP32_TOL, case

    packed = PackedLinearCompress.from_weight(weight, case.num_user_tokens, bias)
    out_packed = packed(user_emb, cand_emb, cand_to_user, backend="auto")  # CPU tensors → torch path
    assert rel_err(out_packed, ref) <= FP32_TOL, case


@pytest.mark.parametrize(
    "case", CORNERS, ids=lambda c: f"U{c.num_users}-B{len(c.mapping)}-Ku{c.num_user_tokens}-Kc{c.num_cand_tokens}"
)
def test_torch_path_corners(case):
    _check_torch_path(case)


@settings(max_examples=200, deadline=None)
@given(case=cases())
def test_torch_path_drawn(case):
    _check_torch_path(case)


@settings(max_examples=25, deadline=None)
@given(case=cases(max_users=4, max_candidates=40, max_tokens=70, max_dim=40, max_rows=40))
def test_torch_path_drawn_larger(case):
    _check_torch_path(case)


# ---------------------------------------------------------------- input checks (ValueError names the argument)


def _valid(seed=0):
    return make_inputs(Case(3, 4, 5, 6, 3, (2, 0, 1, 0), True, torch.int64, seed))


def _call(user_emb, cand_emb, cand_to_user, weight, bias):
    return ikbo_linear_compress(user_emb, cand_emb, cand_to_user, weight, bias, backend="torch")


def _replace(position, value):
    args = list(_valid())
    args[position] = value
    return args


USER, CAND, MAP, WEIGHT, BIAS = range(5)
BAD_INPUTS = {
    "user_emb rank": (lambda: _replace(USER, torch.randn(3, 3 * 5)), "user_emb"),
    "cand_emb rank": (lambda: _replace(CAND, torch.randn(4, 4, 5, 1)), "cand_emb"),
    "weight rank": (lambda: _replace(WEIGHT, torch.randn(6, 7, 1)), "weight"),
    "bias rank": (lambda: _replace(BIAS, torch.randn(6, 1)), "bias"),
    "mapping rank": (lambda: _replace(MAP, torch.tensor([[2, 0, 1, 0]])), "cand_to_user"),
    "user_emb dtype": (lambda: _replace(USER, torch.randint(-3, 3, (3, 3, 5))), "user_emb"),
    "cand_emb dtype": (lambda: _replace(CAND, torch.randn(4, 4, 5, dtype=torch.float64)), "cand_emb"),
    "weight dtype": (lambda: _replace(WEIGHT, torch.randn(6, 7, dtype=torch.float16)), "weight"),
    "bias dtype": (lambda: _replace(BIAS, torch.randn(6, dtype=torch.float64)), "bias"),
    "mapping dtype": (lambda: _replace(MAP, torch.tensor([2.0, 0.0, 1.0, 0.0])), "cand_to_user"),
    "mapping int16": (lambda: _replace(MAP, torch.tensor([2, 0, 1, 0], dtype=torch.int16)), "cand_to_user"),
    "mapping out of range": (lambda: _replace(MAP, torch.tensor([2, 0, 3, 0])), "cand_to_user"),
    "mapping negative": (lambda: _replace(MAP, torch.tensor([2, -1, 1, 0])), "cand_to_user"),
    "mapping too short": (lambda: _replace(MAP, torch.tensor([2, 0, 1])), "cand_to_user"),
    "mapping too long": (lambda: _replace(MAP, torch.tensor([2, 0, 1, 0, 1])), "cand_to_user"),
    "D mismatch": (lambda: _replace(CAND, torch.randn(4, 4, 6)), "cand_emb"),
    "weight columns": (lambda: _replace(WEIGHT, torch.randn(6, 8)), "weight"),
    "bias length": (lambda: _replace(BIAS, torch.randn(5)), "bias"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_names_argument(name):
    build, argument = BAD_INPUTS[name]
    with pytest.raises(ValueError, match=rf"^{argument}:"):
        _call(*build())


def test_bad_backend_and_packed_shapes():
    user_emb, cand_emb, cand_to_user, weight, bias = _valid()
    with pytest.raises(ValueError, match=r"^backend:"):
        ikbo_linear_compress(user_emb, cand_emb, cand_to_user, weight, bias, backend="cuda")
    packed = PackedLinearCompress.from_weight(weight, 3, bias)
    with pytest.raises(ValueError, match=r"^user_emb:"):  # Ku of the inputs differs from the packed weight's
        packed(torch.randn(3, 2, 5), torch.randn(4, 5, 5), cand_to_user)
    with pytest.raises(ValueError, match=r"^num_user_tokens:"):
        PackedLinearCompress.from_weight(weight, 8, bias)


def test_triton_path_rejects_what_it_cannot_run():
    user_emb, cand_emb, cand_to_user, weight, bias = _valid()
    with pytest.raises(ValueError, match=r"^variant:"):
        ikbo_linear_compress(user_emb, cand_emb, cand_to_user, weight, bias, variant="s9")
    for old in ("s1", "s2", "s3", "s4", "s6"):  # the old names: refused, naming the valid ones
        with pytest.raises(ValueError, match=r"^variant: expected one of \('decomposed', 'aligned', 'fused'"):
            ikbo_linear_compress(user_emb, cand_emb, cand_to_user, weight, bias, variant=old)
    packed = PackedLinearCompress.from_weight(weight, 3, bias)
    with pytest.raises(ValueError, match=r"^variant:"):  # also by the Triton path's own entry
        packed._triton(user_emb, cand_emb, cand_to_user, "s3")
    with pytest.raises(ValueError, match=r"^config: block_k"):
        packed._triton(user_emb, cand_emb, cand_to_user, "fused", config=TileConfig(16, 16, num_warps=4, num_stages=1))
    if not INTERPRETING:
        with pytest.raises(ValueError, match=r"^user_emb:.*CUDA"):
            ikbo_linear_compress(user_emb, cand_emb, cand_to_user, weight, bias, backend="triton")
    with pytest.raises(ValueError, match=r"^user_emb:.*float32/float16/bfloat16"):
        args = [t.double() if t.is_floating_point() else t for t in (user_emb, cand_emb, cand_to_user, weight, bias)]
        ikbo_linear_compress(*args, backend="triton")


# ---------------------------------------------------------------- Triton kernels under the interpreter


@pytest.mark.skipif(INTERPRETING, reason="already interpreting: the interpreted tests run directly")
def test_triton_interpreted():
    """Run the `interpreted` tests below in a child process with TRITON_INTERPRET=1 (one worker: the drawn test is
    most of the time, and slower beside another worker)."""
    run_interpreted(__file__, workers=1)


INTERPRETED_CONFIGS = [None, TileConfig(16, 32, 16, num_warps=4, num_stages=1, epilogue_split=True)]


def _check_triton(case: Case, variant: str, dtype: torch.dtype, tol: float, config=None) -> None:
    user_emb, cand_emb, cand_to_user, weight, bias = make_inputs(case, dtype)
    ref = linear_compress_reference(user_emb, cand_emb, cand_to_user, weight, bias)
    packed = PackedLinearCompress.from_weight(weight, case.num_user_tokens, bias)
    shape = (len(case.mapping), case.out_rows, case.dim)
    out = torch.full(shape, float("nan"), dtype=dtype)  # poisoned: every element must be written
    user_part = torch.full((case.num_users, case.out_rows, case.dim), float("nan"), dtype=dtype)
    if case.num_user_tokens == 0:
        user_part = user_part[:0]
    packed._triton(user_emb, cand_emb, cand_to_user, variant, config=config, out=out, user_part=user_part)
    assert bool(torch.isfinite(out).all()), (case, variant)
    assert rel_err(out, ref) <= tol, (case, variant, rel_err(out, ref))
    public = packed(user_emb, cand_emb, cand_to_user, backend="triton", variant=variant)
    assert rel_err(public, ref) <= tol, (case, variant)


# Shapes that span several 16 × 16 tiles in N and D, and both tensor-descriptor (D·4 bytes a multiple of
# 16) and pointer (odd D) activation loads.
INTERPRETED_CORNERS = [
    Case(20, 13, 24, 20, 3, (2, 0, 1, 0, 2, 2, 1), True, torch.int32, 11),
    Case(9, 17, 40, 33, 1, (0, 0, 0), False, torch.int64, 12),  # U = 1
    Case(5, 6, 7, 5, 4, (3, 1, 0, 2), True, torch.int64, 13),  # B = U, odd D: pointer loads
    Case(17, 3, 16, 18, 6, (5, 5, 1), True, torch.int32, 14),  # users without candidates
    Case(0, 11, 12, 9, 3, (2, 0, 1), True, torch.int64, 15),  # Ku = 0
    Case(13, 0, 20, 9, 3, (1, 2, 2, 0), True, torch.int32, 16),  # Kc = 0
    Case(0, 0, 8, 4, 2, (1, 0), True, torch.int64, 17),  # bias only
]


@pytest.mark.skipif(not INTERPRETING, reason="runs in test_triton_interpreted's child process")
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "case",
    INTERPRETED_CORNERS,
    ids=lambda c: f"U{c.num_users}-B{len(c.mapping)}-Ku{c.num_user_tokens}-Kc{c.num_cand_tokens}-D{c.dim}",
)
@pytest.mark.parametrize("config", INTERPRETED_CONFIGS, ids=["default", "split"])
def test_interpreted_corners(case, variant, config):
    _check_triton(case, variant, torch.float32, FP32_TOL, config)


@pytest.mark.skipif(not INTERPRETING, reason="runs in test_triton_interpreted's child process")
@settings(max_examples=60, deadline=None)
@given(
    case=cases(max_users=5, max_candidates=10, max_tokens=40, max_dim=40, max_rows=40),
    variant=st.sampled_from(VARIANTS),
    config=st.sampled_from(INTERPRETED_CONFIGS),
)
def test_interpreted_drawn(case, variant, config):
    _check_triton(case, variant, torch.float32, FP32_TOL, config)


@pytest.mark.skipif(not INTERPRETING, reason="runs in test_triton_interpreted's child process")
@settings(max_examples=12, deadline=None)
@given(
    case=cases(max_users=4, max_candidates=8, max_tokens=24, max_dim=24, max_rows=24), variant=st.sampled_from(VARIANTS)
)
def test_interpreted_drawn_fp16(case, variant):
    _check_triton(case, variant, torch.float16, FP16_TOL)


@pytest.mark.skipif(not INTERPRETING, reason="runs in test_triton_interpreted's child process")
@pytest.mark.parametrize("variant", VARIANTS)
def test_interpreted_bad_mapping_reads_in_bounds(variant):
    """On CUDA the op launches its kernels before it knows the mapping's range (it raises after), so
    the kernels clamp a bad m[b] to [0, U): rows with m = -3 or U + 4 get user 0's or user U-1's part."""
    case = Case(9, 7, 24, 20, 3, (2, -3, 1, 7, 0), True, torch.int64, 21)
    user_emb, cand_emb, cand_to_user, weight, bias = make_inputs(case, torch.float32)
    ref = linear_compress_reference(user_emb, cand_emb, cand_to_user.clamp(0, case.num_users - 1), weight, bias)
    packed = PackedLinearCompress.from_weight(weight, case.num_user_tokens, bias)
    out = torch.full((len(case.mapping), case.out_rows, case.dim), float("nan"))
    packed._triton(user_emb, cand_emb, cand_to_user, variant, out=out)
    assert rel_err(out, ref) <= FP32_TOL, (variant, rel_err(out, ref))
    with pytest.raises(ValueError, match=r"^cand_to_user: value -3 is outside \[0, U=3\)"):
        packed(user_emb, cand_emb, cand_to_user, backend="triton", variant=variant)


# ---------------------------------------------------------------- Triton kernels on CUDA, real sizes


def _ragged_mapping(num_users: int, num_candidates: int, gen: torch.Generator) -> tuple:
    """Unsorted mapping with unequal counts per user (some users may get none)."""
    weights = torch.rand(num_users, generator=gen) ** 2 + 0.05
    users = torch.multinomial(weights, num_candidates, replacement=True, generator=gen)
    return tuple(users.tolist())


GPU_SHAPES = [
    # (U, B, Ku, Kc, D, N, bias)
    (15, 1024, 1024, 500, 256, 512, True),  # canonical
    (1, 300, 64, 499, 200, 384, False),  # U = 1, odd Kc, D not a multiple of the tile
    (257, 257, 40, 33, 100, 130, True),  # B = U, D·2 bytes not 16-aligned: pointer loads
    (64, 40, 96, 0, 64, 256, True),  # Kc = 0, users without candidates
    (8, 500, 0, 72, 128, 96, True),  # Ku = 0
]


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "U{}-B{}-Ku{}-Kc{}-D{}-N{}".format(*s[:6]))
def test_gpu_bf16_real_sizes(shape, variant):
    num_users, num_candidates, ku, kc, dim, rows, with_bias = shape
    gen = torch.Generator().manual_seed(hash(shape) % 2**31)
    case = Case(
        ku,
        kc,
        dim,
        rows,
        num_users,
        _ragged_mapping(num_users, num_candidates, gen),
        with_bias,
        torch.int32,
        int(torch.randint(0, 2**31 - 1, (1,), generator=gen)),
    )
    user_emb, cand_emb, cand_to_user, weight, bias = make_inputs(case, torch.bfloat16, "cuda")
    tokens = torch.cat([user_emb.double()[cand_to_user.long()], cand_emb.double()], dim=1)  # test reference only
    ref = torch.matmul(weight.double(), tokens) + (0 if bias is None else bias.double()[:, None])
    packed = PackedLinearCompress.from_weight(weight, ku, bias)
    for _ in range(2):  # twice: persistent's flags must work across calls
        out = torch.full((num_candidates, rows, dim), float("nan"), dtype=torch.bfloat16, device="cuda")
        user_part = torch.full((num_users if ku else 0, rows, dim), float("nan"), dtype=torch.bfloat16, device="cuda")
        packed._triton(user_emb, cand_emb, cand_to_user, variant, out=out, user_part=user_part)
        torch.cuda.synchronize()
        assert bool(torch.isfinite(out).all()), variant
        err = rel_err(out, ref)
        assert err <= BF16_TOL, (variant, err)


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_offsets_past_int32():
    """B·N·D > 2³¹: the last candidates' rows must land where they belong (int64 offsets)."""
    num_users, num_candidates, ku, kc, dim, rows = 4, 17000, 16, 16, 256, 512
    gen = torch.Generator().manual_seed(7)
    case = Case(ku, kc, dim, rows, num_users, _ragged_mapping(num_users, num_candidates, gen), True, torch.int64, 8)
    user_emb, cand_emb, cand_to_user, weight, bias = make_inputs(case, torch.bfloat16, "cuda")
    assert num_candidates * rows * dim > 2**31
    packed = PackedLinearCompress.from_weight(weight, ku, bias)
    tail = slice(num_candidates - 300, num_candidates)
    ref = linear_compress_reference(user_emb, cand_emb[tail], cand_to_user[tail], weight, bias)
    for variant in VARIANTS:
        out = packed(user_emb, cand_emb, cand_to_user, backend="triton", variant=variant)
        torch.cuda.synchronize()
        assert rel_err(out[tail], ref) <= BF16_TOL, variant
        del out


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("variant", VARIANTS + ("warp_specialized",))
@pytest.mark.parametrize("bad", [15, -1, 2**40], ids=["U", "negative", "huge"])
def test_gpu_bad_mapping_raises_after_launch(variant, bad):
    """The Triton path launches first and checks the mapping's range after: a bad value still gives the
    ValueError that names it (no fault, no hang: persistent waits on no missing flag), at check_deferred() or at
    once in strict mode, and the next good call on the same module is right."""
    num_users, num_candidates, ku, kc, dim, rows = 15, 300, 64, 72, 128, 256
    gen = torch.Generator().manual_seed(abs(bad) % 1000 + len(variant))
    case = Case(ku, kc, dim, rows, num_users, _ragged_mapping(num_users, num_candidates, gen), True, torch.int64, 31)
    user_emb, cand_emb, cand_to_user, weight, bias = make_inputs(case, torch.bfloat16, "cuda")
    packed = PackedLinearCompress.from_weight(weight, ku, bias)
    wrong = cand_to_user.clone()
    wrong[137] = bad
    check_deferred()  # nothing pending from earlier calls
    packed(user_emb, cand_emb, wrong, backend="triton", variant=variant)  # returns before the range is known
    with pytest.raises(ValueError, match=rf"^cand_to_user: value {bad} is outside \[0, U=15\)"):
        check_deferred()
    with strict_checks(), pytest.raises(ValueError, match=rf"^cand_to_user: value {bad} is outside \[0, U=15\)"):
        packed(user_emb, cand_emb, wrong, backend="triton", variant=variant)
    out = packed(user_emb, cand_emb, cand_to_user, backend="triton", variant=variant)
    ref = linear_compress_reference(user_emb, cand_emb, cand_to_user, weight, bias)
    assert rel_err(out, ref) <= BF16_TOL, (variant, rel_err(out, ref))


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_replayed_calls(replays):
    """A PackedLinearCompress call whose signature was seen before replays that call's steps with its own tensors
    (kernels._launch): fresh inputs each round against fp64, the module's weights changed in place between rounds,
    then a bad mapping value in a replayed call raises at check_deferred() and the next call is right."""
    num_users, num_candidates, ku, kc, dim, rows = 15, 1024, 64, 96, 128, 256
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    weight = torch.randn(rows, ku + kc, generator=gen).cuda() / (ku + kc) ** 0.5
    bias = torch.randn(rows, generator=gen).cuda()
    packed = PackedLinearCompress.from_weight(weight.bfloat16(), ku, bias.bfloat16())
    for round in range(4):
        mapping = _ragged_mapping(num_users, num_candidates, gen)
        case = Case(ku, kc, dim, rows, num_users, mapping, True, torch.int64, int(torch.randint(0, 2**31, (1,), generator=gen)))  # fmt: skip
        user_emb, cand_emb, cand_to_user, _, _ = make_inputs(case, torch.bfloat16, "cuda")
        out = packed(user_emb, cand_emb, cand_to_user)
        full = torch.cat([packed.user_weight, packed.cand_weight], dim=1)
        ref = linear_compress_reference(user_emb, cand_emb, cand_to_user, full, packed.bias)
        assert rel_err(out, ref) <= BF16_TOL, (round, rel_err(out, ref))
        with torch.no_grad():  # an optimizer step's in-place update
            packed.cand_weight.mul_(-1.5)
    if torch.cuda.get_device_capability()[0] == 9:  # the warp-specialized path is the one recorded
        assert len(replays) >= 2
    wrong = cand_to_user.clone()
    wrong[num_candidates // 3] = num_users
    packed(user_emb, cand_emb, wrong)
    with pytest.raises(ValueError, match=r"^cand_to_user: value 15 is outside"):
        check_deferred()
    out = packed(user_emb, cand_emb, cand_to_user)
    full = torch.cat([packed.user_weight, packed.cand_weight], dim=1)
    assert rel_err(out, linear_compress_reference(user_emb, cand_emb, cand_to_user, full, packed.bias)) <= BF16_TOL


def test_first_fitting_config_is_kept_and_the_last_error_raised(monkeypatch):
    """`_launch_first_fitting` reads configs lazily, launches the first that fits, remembers it under its key (the
    next call tries nothing else), and raises the last OutOfResources where none fits."""
    from triton.runtime.errors import OutOfResources

    from kernels import linear_compress as lce

    monkeypatch.setattr(lce, "_CONFIG_CHOICE", {})
    tried = []

    def launch(cfg):
        tried.append(cfg)
        if cfg > 2:
            raise OutOfResources(cfg, 2, "shared memory")

    def configs():
        yield from (4, 3, 2, 1)

    lce._launch_first_fitting("key", configs(), launch)
    assert tried == [4, 3, 2]
    lce._launch_first_fitting("key", configs(), launch)
    assert tried == [4, 3, 2, 2]
    with pytest.raises(OutOfResources, match="3"):
        lce._launch_first_fitting(None, iter((5, 3)), launch)
