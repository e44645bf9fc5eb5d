"""Under TRITON_INTERPRET=1 (the interpreter children of the kernel tests), interpreted kernels run
with the out-of-bounds memcheck of tests/interpreted.py."""

import gc
import os
import sys

import pytest

if os.environ.get("TRITON_INTERPRET") == "1":
    from interpreted import enable_memcheck

    enable_memcheck()


@pytest.fixture(autouse=True)
def _hand_back_cached_gpu_memory():
    """After each test that used CUDA, hand the blocks torch's caching allocator kept back to the GPU, so that
    parallel pytest workers (`pytest -n 12` over the kernel and model files) can share one GPU: without it, two
    workers can hold most of its memory and the others fail with out-of-memory."""
    yield
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture
def one_torch_thread():
    """Small tensors: one torch thread for the test (on a shared 2-core machine, intra-op threads wait for busy
    cores)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def replays(monkeypatch):
    """A list that gets one entry per replayed launch path (`kernels._launch.Replay` called) during the test."""
    from kernels import _launch

    calls = []
    real = _launch.Replay.__call__
    monkeypatch.setattr(_launch.Replay, "__call__", lambda *args: calls.append(1) or real(*args))
    return calls
