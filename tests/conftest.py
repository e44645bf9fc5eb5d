"""Under TRITON_INTERPRET=1 (the interpreter children of the kernel tests), interpreted kernels run
with the out-of-bounds memcheck of tests/interpreted.py (and, through `import kernels`, its fix for
numpy >= 2.4)."""

import os

if os.environ.get("TRITON_INTERPRET") == "1":
    import kernels  # noqa: F401  (kernels/__init__.py fixes the interpreter for numpy >= 2.4)
    from interpreted import enable_memcheck

    enable_memcheck()
