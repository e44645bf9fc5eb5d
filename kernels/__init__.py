"""IKBO ops: user tensors at U rows, candidate tensors at B rows, joined only through `cand_to_user`."""

from ._common import add_user_rows, check_deferred, group_by_user, strict_checks
from .attention import ikbo_attention, ikbo_self_target_attention
from .linear_compress import PackedLinearCompress, ikbo_linear_compress

__all__ = [
    "PackedLinearCompress",
    "add_user_rows",
    "check_deferred",
    "group_by_user",
    "ikbo_attention",
    "ikbo_linear_compress",
    "ikbo_self_target_attention",
    "strict_checks",
]
