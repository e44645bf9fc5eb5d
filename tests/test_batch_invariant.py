"""Batch-invariant CPU arithmetic (ikbo_backend/batch_invariant.py): each helper against an fp64
reference on regular, odd and empty shapes, and bit-identical results for a row (an element) whatever
surrounds it in the batch. Fresh random inputs each run; hypothesis draws shapes and offsets."""

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from ikbo_backend.batch_invariant import GRAIN, ROWS, rowwise_linear, vectorized_elementwise

# (K, N) of the demo model's linears: cand/user dense, history qkv, cand query, MLP layers (IKBO, baseline)
LINEAR_SHAPES = [(16, 64), (32, 128), (64, 192), (64, 64), (576, 256), (64, 256), (640, 256), (256, 128), (128, 3)]


def linear_weights(k, n):
    return torch.randn(n, k) * k**-0.5, torch.randn(n)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(0, 3 * ROWS + 5),
    shape=st.sampled_from(LINEAR_SHAPES),
    with_bias=st.booleans(),
    split=st.booleans(),
)
def test_rowwise_linear_matches_fp64(rows, shape, with_bias, split):
    weight, bias = linear_weights(*shape)
    bias = bias if with_bias else None
    x = torch.randn(rows, shape[0])
    x = x.view(rows // 2, 2, shape[0]) if split and rows % 2 == 0 else x  # leading dims [a, b, K] too
    got = rowwise_linear(x, weight, bias)
    want = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(total=st.integers(1, 4 * ROWS), data=st.data(), shape=st.sampled_from(LINEAR_SHAPES))
def test_a_rows_linear_does_not_depend_on_its_batch(total, data, shape):
    """Rows [start, start + n) of a batch bit-identical to the same rows computed alone."""
    start = data.draw(st.integers(0, total - 1), label="start")
    n = data.draw(st.integers(1, total - start), label="n")
    weight, bias = linear_weights(*shape)
    x = torch.randn(total, shape[0])
    assert torch.equal(
        rowwise_linear(x, weight, bias)[start : start + n], rowwise_linear(x[start : start + n], weight, bias)
    )


@settings(max_examples=30, deadline=None)
@given(
    numel=st.one_of(st.integers(0, 300), st.integers(GRAIN - 40, 3 * GRAIN)), scale=st.sampled_from([1.0, 8.0, 60.0])
)
def test_vectorized_sigmoid_matches_fp64(numel, scale):
    x = torch.randn(numel) * scale
    got = vectorized_elementwise(torch.sigmoid, x.view(-1, 1) if numel % 3 else x)
    assert got.dtype == torch.float32 and got.numel() == numel
    torch.testing.assert_close(got.reshape(-1).double(), torch.sigmoid(x.double()), rtol=1e-6, atol=1e-7)


@settings(max_examples=30, deadline=None)
@given(total=st.integers(1, 3 * GRAIN), data=st.data())
def test_an_elements_sigmoid_does_not_depend_on_its_offset(total, data):
    """Elements [start, start + n) bit-identical to the same elements computed alone: no scalar tail,
    no thread boundary reaches them differently."""
    start = data.draw(st.integers(0, total - 1), label="start")
    n = data.draw(st.integers(1, total - start), label="n")
    x = torch.randn(total) * 8
    assert torch.equal(
        vectorized_elementwise(torch.sigmoid, x)[start : start + n],
        vectorized_elementwise(torch.sigmoid, x[start : start + n]),
    )
