"""kernels.request_checks against a numpy reference: the clamped values and the flag, on fresh
tensors with a few values drawn outside the range (or NaN, ±Inf, above the bound), through the torch
backend here, the Triton kernels under TRITON_INTERPRET=1 (a child process) and on CUDA."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from interpreted import run_interpreted

from kernels.request_checks import BLOCK, clamp_flagged_, flag_unbounded

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _indices(rng, shape, low, high, dtype, bad: int):
    """Values in [low, high] with `bad` of them outside (below low or above high, up to the dtype's limits)."""
    x = rng.integers(low, high + 1, size=shape).astype(dtype)
    flat, info = x.reshape(-1), np.iinfo(dtype)
    for i in rng.choice(flat.size, size=min(bad, flat.size), replace=False):
        flat[i] = rng.choice([low - 1, high + 1, info.min, info.max, high + int(rng.integers(1, 1000))])
    return x


def _check_clamp(backend: str, device: str, shape, dtype, high_on_device: bool, bad: int, seed: int):
    rng = np.random.default_rng(seed)
    low, high = 0, int(rng.integers(0, 5000))
    x = _indices(rng, shape, low, high, dtype, bad)
    flag = torch.zeros(1, device=device)
    t = torch.from_numpy(x.copy()).to(device)
    bound = torch.tensor(high, dtype=t.dtype, device=device) if high_on_device else high
    out = clamp_flagged_(t, low, bound, flag, backend=backend)
    assert out is t or out.data_ptr() == t.data_ptr()  # in place
    np.testing.assert_array_equal(t.cpu().numpy(), np.clip(x, low, high))
    assert float(flag) == float(((x < low) | (x > high)).any())


def _check_unbounded(backend: str, device: str, shape, dtype, bad: int, seed: int):
    rng = np.random.default_rng(seed)
    abs_max = 1e30 if dtype == torch.float32 else 6e4
    x = rng.standard_normal(shape).astype(np.float32)
    flat = x.reshape(-1)
    for i in rng.choice(flat.size, size=min(bad, flat.size), replace=False):
        flat[i] = rng.choice([np.nan, np.inf, -np.inf, -abs_max * 2, abs_max * 3])
    t = torch.from_numpy(x).to(dtype).to(device)
    flag = torch.zeros(1, device=device)
    flag_unbounded(t, abs_max, flag, backend=backend)
    values = t.float().cpu().numpy()
    assert float(flag) == float((~(np.abs(values) <= abs_max)).any())


shapes = st.one_of(st.tuples(st.integers(0, 3 * BLOCK)), st.tuples(st.integers(1, 40), st.integers(1, 70)))
DRAWN = dict(shape=shapes, bad=st.sampled_from([0, 0, 1, 3]), seed=st.integers(0, 2**32 - 1))


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from([np.int32, np.int64]), high_on_device=st.booleans(), **DRAWN)
def test_torch_clamp_flagged(dtype, high_on_device, shape, bad, seed):
    _check_clamp("torch", "cpu", shape, dtype, high_on_device, bad, seed)


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.bfloat16]), **DRAWN)
def test_torch_flag_unbounded(dtype, shape, bad, seed):
    _check_unbounded("torch", "cpu", shape, dtype, bad, seed)


def test_a_raised_flag_stays_raised_and_bad_arguments_are_refused():
    flag = torch.ones(1)
    clamp_flagged_(torch.arange(5, dtype=torch.int32), 0, 10, flag)
    flag_unbounded(torch.ones(4), 1e30, flag)
    assert float(flag) == 1.0
    with pytest.raises(ValueError, match=r"^x: expected dtype"):
        clamp_flagged_(torch.ones(3), 0, 1, flag)
    with pytest.raises(ValueError, match=r"^x: expected a contiguous"):
        clamp_flagged_(torch.zeros(4, 4, dtype=torch.int64).t(), 0, 1, flag)
    with pytest.raises(ValueError, match=r"^flag: expected float32 \[1\]"):
        flag_unbounded(torch.ones(3), 1.0, torch.zeros(2))
    with pytest.raises(ValueError, match=r"^high: expected an int or a 0-d tensor"):
        clamp_flagged_(torch.zeros(3, dtype=torch.int32), 0, torch.tensor([1, 2], dtype=torch.int32), flag)


@pytest.mark.skipif(INTERPRETING, reason="already interpreting: the interpreted tests run directly")
def test_triton_interpreted():
    """Run the `interpreted` tests below in a child process with TRITON_INTERPRET=1."""
    run_interpreted(__file__, timeout=300)


@pytest.mark.skipif(not INTERPRETING, reason="runs in test_triton_interpreted's child process")
@settings(max_examples=25, deadline=None)
@given(dtype=st.sampled_from([np.int32, np.int64]), high_on_device=st.booleans(), **DRAWN)
def test_interpreted_clamp_flagged(dtype, high_on_device, shape, bad, seed):
    _check_clamp("triton", "cpu", shape, dtype, high_on_device, bad, seed)


@pytest.mark.skipif(not INTERPRETING, reason="runs in test_triton_interpreted's child process")
@settings(max_examples=25, deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.bfloat16]), **DRAWN)
def test_interpreted_flag_unbounded(dtype, shape, bad, seed):
    _check_unbounded("triton", "cpu", shape, dtype, bad, seed)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("bad", [0, 1, 5])
def test_cuda_clamp_flagged(dtype, bad):
    for seed, shape in enumerate([(1,), (BLOCK + 1,), (1024, 24), (16, 512), (100_003,)]):
        _check_clamp(
            "auto", "cuda", shape, dtype, seed % 2 == 0, bad, seed + int(np.random.default_rng().integers(1 << 30))
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad", [0, 1, 5])
def test_cuda_flag_unbounded(dtype, bad):
    for seed, shape in enumerate([(1,), (BLOCK + 1,), (1024, 32), (100_003,)]):
        _check_unbounded("auto", "cuda", shape, dtype, bad, seed + int(np.random.default_rng().integers(1 << 30)))
