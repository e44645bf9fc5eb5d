"""IKBO linear compression against the fp64 reference (`kernels.reference.linear_compress_reference`).

Every case draws fresh random inputs (never zeros) and a random mapping: U = 1, B = 1, B = U, users
with no candidates, unsorted mappings, odd Ku / Kc / D, Ku = 0 or Kc = 0, bias or none, int32 and
int64 mappings. Error tests check that the ValueError names the bad argument.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kernels import PackedLinearCompress, ikbo_linear_compress
from kernels.reference import linear_compress_reference

FP32_TOL = 1e-5


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


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in fp64 (0 when both are empty or both all-zero); NaN never passes."""
    diff = (out.double().cpu() - ref).norm().item()
    scale = ref.norm().item()
    return diff / scale if scale > 0 else diff


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


@pytest.mark.parametrize("case", CORNERS, ids=lambda c: f"U{c.num_users}-B{len(c.mapping)}-Ku{c.num_user_tokens}-Kc{c.num_cand_tokens}")
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
