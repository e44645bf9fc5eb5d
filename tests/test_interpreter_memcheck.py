"""The interpreter memcheck (tests/interpreted.py) catches an out-of-bounds access and lets masked
and in-bounds ones through."""

import os

import pytest
import torch
import triton
import triton.language as tl
from interpreted import run_interpreted

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, SHIFT: tl.constexpr, MASKED: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n if MASKED else offs < BLOCK
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs + SHIFT, mask=mask), mask=mask)


@pytest.mark.skipif(INTERPRETING, reason="already interpreting: the interpreted tests run directly")
def test_memcheck_interpreted():
    run_interpreted(__file__, timeout=120)


@pytest.mark.skipif(not INTERPRETING, reason="runs in the child with TRITON_INTERPRET=1")
def test_interpreted_memcheck_flags_out_of_bounds():
    n = int(torch.randint(5, 15, ()))
    src, dst = torch.randn(n), torch.full((16,), float("nan"))
    _copy_kernel[(1,)](src, dst, n, SHIFT=0, MASKED=True, BLOCK=16)  # masked: fine
    assert torch.equal(dst[:n], src)
    with pytest.raises(Exception, match="memcheck: .*load addresses outside"):
        _copy_kernel[(1,)](src, dst, n, SHIFT=0, MASKED=False, BLOCK=16)  # reads src[n:16]
    with pytest.raises(Exception, match="memcheck"):
        _copy_kernel[(1,)](src, dst, n, SHIFT=-1, MASKED=True, BLOCK=16)  # reads src[-1]
