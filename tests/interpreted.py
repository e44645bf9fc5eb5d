"""Triton-interpreter helpers for the tests.

`run_interpreted(test_file)`: run that file's `interpreted_*` tests in a child pytest with
TRITON_INTERPRET=1 (the variable must be set before Triton compiles anything, so those tests cannot
run in the parent process); `run_child_tests` is the same for any keyword and environment.

`enable_memcheck()` (tests/conftest.py calls it whenever TRITON_INTERPRET=1): every unmasked address
an interpreted kernel loads or stores must lie inside the storage of one of the kernel's tensor
arguments, else the launch fails naming the kernel source lines. On the CPU an out-of-bounds access
reads neighbouring heap memory (a wrong value or, rarely, a segfault); on a GPU it is garbage or an
illegal-address error that kills the CUDA context. Patches triton 3.6's interpreter internals.

numpy ≥ 2.4 needs a fix of triton 3.6's interpreter: the kernels apply it at their first interpreted launch
(`kernels._interpreter.interpreting`).
"""

import importlib.util
import os
import subprocess
import sys
import traceback
from pathlib import Path

import numpy as np


def run_interpreted(test_file: str, timeout: float = 600, workers: int | None = None) -> None:
    run_child_tests(test_file, "interpreted_", {"TRITON_INTERPRET": "1"}, timeout, workers)


# the parent waits idle: the child's tests over both cores (pytest-xdist, where installed)
CHILD_WORKERS = min(2, os.cpu_count() or 1) if importlib.util.find_spec("xdist") else 1


def run_child_tests(test_file: str, keyword: str, env: dict, timeout: float = 600, workers: int | None = None) -> None:
    """Run `test_file`'s tests matching `keyword` in a child pytest with `env` added; all must pass, none skip.
    `workers` xdist processes (default CHILD_WORKERS; 1 where one long test is most of the child's time)."""
    env = dict(os.environ, **env)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test_file, "-k", keyword]
    workers = CHILD_WORKERS if workers is None else workers
    if workers > 1:  # one intra-op thread each: two workers of two OpenMP threads spin against each other
        cmd += ["-n", str(workers)]
        env.setdefault("OMP_NUM_THREADS", "1")
    done = subprocess.run(
        cmd, env=env, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1], done.stdout[-2000:]


_RANGES: list[tuple[int, int]] = []  # [start, end) byte ranges of the running kernel's tensor arguments


def _record(arg) -> None:
    if isinstance(arg, (tuple, list)):
        for item in arg:
            _record(item)
    elif hasattr(arg, "block_shape") and hasattr(arg, "base"):  # a TensorDescriptor
        _record(arg.base)
    elif hasattr(arg, "untyped_storage"):
        storage = arg.untyped_storage()
        _RANGES.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))


def _check(ptrs, mask, itemsize: int, what: str) -> None:
    addresses = np.asarray(ptrs)[np.asarray(mask, dtype=bool)].astype(np.uint64)
    inside = np.zeros(addresses.shape, dtype=bool)
    for start, end in _RANGES:
        inside |= (addresses >= start) & (addresses + itemsize <= end)
    if not inside.all():
        where = [
            f"{Path(f.filename).name}:{f.lineno} {f.line}"
            for f in traceback.extract_stack()
            if "/kernels/" in f.filename or "/tests/" in f.filename
        ]
        raise AssertionError(
            f"memcheck: {int((~inside).sum())} of {addresses.size} {what} addresses outside every tensor argument at {where}"
        )


def enable_memcheck() -> None:
    import triton.runtime.interpreter as interpreter

    if getattr(interpreter, "_ikbo_memcheck", False):
        return
    init_args, native = interpreter.GridExecutor._init_args_hst, interpreter._interpreter

    def init_args_checked(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        _RANGES.clear()
        _record(list(args_hst) + list(kwargs_hst.values()))
        return args_hst, kwargs_hst

    class Checked:
        def __getattr__(self, name):
            return getattr(native, name)

        @staticmethod
        def load(ptrs, mask, other, dtype):
            _check(ptrs, mask, np.dtype(dtype).itemsize, "load")
            return native.load(ptrs, mask, other, dtype)

        @staticmethod
        def store(ptrs, value, mask):
            _check(ptrs, mask, value.dtype.itemsize, "store")
            return native.store(ptrs, value, mask)

    interpreter.GridExecutor._init_args_hst = init_args_checked
    interpreter._interpreter = Checked()
    interpreter._ikbo_memcheck = True
