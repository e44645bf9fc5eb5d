"""Under TRITON_INTERPRET=1 (the interpreter children of the kernel tests), interpreted kernels run
with the out-of-bounds memcheck of tests/interpreted.py, and with its fix for numpy ≥ 2.4."""

import os

if os.environ.get("TRITON_INTERPRET") == "1":
    from interpreted import enable_memcheck, index_scalars_explicitly

    enable_memcheck()
    index_scalars_explicitly()
