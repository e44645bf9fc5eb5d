"""The interpreter memcheck (tests/interpreted.py) catches an out-of-bounds access and lets masked
and in-bounds ones through."""

import os
import subprocess
import sys
from pathlib import Path

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


@pytest.mark.skipif(INTERPRETING, reason="starts its own processes")
@pytest.mark.parametrize("interpret", ["1", "0"])
def test_the_interpreter_fix_comes_with_import_under_the_interpreter_only(interpret):
    """Without the interpreter `import kernels` patches nothing. Under TRITON_INTERPRET=1 (the --smoke benchmarks, the
    interpreted tests) the fix of triton 3.6's interpreter for numpy >= 2.4 is in place from the import, before any
    kernel runs, whichever host path launches first, and not from this suite's conftest."""
    backend = "triton" if interpret == "1" else "auto"
    code = (
        "import torch, kernels, triton.runtime.interpreter as i\n"
        "print(getattr(i, '_ikbo_index_fix', False))\n"
        "user, cand, mapping = torch.randn(2, 3, 8), torch.randn(5, 2, 8), torch.tensor([0, 1, 1, 0, 1])\n"
        f"kernels.ikbo_linear_compress(user, cand, mapping, torch.randn(6, 5), backend={backend!r})\n"
        "print(getattr(i, '_ikbo_index_fix', False))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "TRITON_INTERPRET": interpret},
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [str(interpret == "1")] * 2
