"""Compiling the Gluon kernels for sm_90a on a machine without a GPU (kernels.devtools), for the tests."""

import pytest


def compiled_or_skip(compile_fn, **kwargs):
    """compile_fn(**kwargs) (a CompiledKernel), or skip the test where this Triton build cannot compile for sm_90a
    (no CUDA backend or ptxas)."""
    try:
        return compile_fn(**kwargs)
    except Exception as exc:
        pytest.skip(f"cannot compile Gluon for sm_90a here: {type(exc).__name__}: {str(exc)[:200]}")
