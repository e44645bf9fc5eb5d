"""IKBO ops: user tensors at U rows, candidate tensors at B rows, joined only through `cand_to_user`."""

import os

from ._common import add_user_rows, fix_interpreter_scalar_index, group_by_user
from .attention import ikbo_attention, ikbo_self_target_attention
from .linear_compress import PackedLinearCompress, ikbo_linear_compress

if os.environ.get("TRITON_INTERPRET") == "1":  # the kernels run on CPU tensors (tests, --smoke benchmarks)
    fix_interpreter_scalar_index()

__all__ = [
    "PackedLinearCompress",
    "add_user_rows",
    "group_by_user",
    "ikbo_attention",
    "ikbo_linear_compress",
    "ikbo_self_target_attention",
]
