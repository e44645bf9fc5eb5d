"""Under TRITON_INTERPRET=1 (the interpreter children of the kernel tests), interpreted kernels run
with the out-of-bounds memcheck of tests/interpreted.py (and, through `import kernels`, its fix for
numpy >= 2.4)."""

import gc
import os
import sys

import pytest

if os.environ.get("TRITON_INTERPRET") == "1":
    from interpreted import enable_memcheck

    import kernels  # noqa: F401  (kernels/__init__.py fixes the interpreter for numpy >= 2.4)

    enable_memcheck()


@pytest.fixture(autouse=True)
def _hand_back_cached_gpu_memory():
    """After each test that used CUDA, hand the blocks torch's caching allocator kept back to the GPU, so that
    parallel pytest workers can share one GPU. On an H200 (2026-12-01, `pytest -n 12` over the kernel and model
    files) two workers held 48.9 and 47.6 GiB and 15 tests of the others failed with out-of-memory; with this
    fixture the same files passed (446 passed)."""
    yield
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()
