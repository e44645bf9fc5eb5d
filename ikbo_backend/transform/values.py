"""The forms a value of the traced graph takes while the pass rebuilds it, the report, and the op
tables (which ops act row by row on dim 0)."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten

# ----------------------------------------------------------------------------- values


@dataclass(frozen=True)
class Meta:
    """Shape and dtype of a tensor in the example run."""

    shape: tuple
    dtype: torch.dtype

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def is_float(self):
        return self.dtype.is_floating_point


@dataclass(eq=False)
class Mapping:
    """One candidate → user mapping; `node` (new graph) is an index tensor [B] into the user rows."""

    key: Any
    node: fx.Node
    name: str


@dataclass(eq=False)
class Plain:
    node: Any  # new-graph node (or a literal)
    meta: Any
    batched: bool = False  # has the B candidate rows as dim 0
    mapping: Mapping | None = None  # this value is the mapping (maybe converted)


@dataclass(eq=False)
class Rep:
    user: fx.Node  # [U, ...] (or a tuple of them)
    mapping: Mapping
    meta: Any  # of the replicated value (B rows)
    source: str
    materialized: fx.Node | None = None


@dataclass(eq=False)
class Concat:
    parts: list
    dim: int  # non-negative
    meta: Meta
    materialized: fx.Node | None = None


@dataclass(eq=False)
class RepShape:
    user_shape: fx.Node
    mapping: Mapping
    meta: Any


@dataclass(eq=False)
class Rows:
    user_rows: fx.Node
    mapping: Mapping
    meta: int


VALUES = (Plain, Rep, Concat, RepShape, Rows)


def is_value(x):
    return isinstance(x, VALUES)


def to_meta(x):
    if isinstance(x, torch.Tensor):
        return Meta(tuple(x.shape), x.dtype)
    if isinstance(x, torch.Size):
        return tuple(x)
    if isinstance(x, (tuple, list)):
        return type(x)(to_meta(v) for v in x)
    return x


# ----------------------------------------------------------------------------- report


@dataclass
class Report:
    """What the pass rewrote and what it left, for a person."""

    rewritten: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def replications_left(self) -> int:
        return len(self.left)

    def __str__(self):
        lines = ["IKBO transformation report", f"rewritten ({len(self.rewritten)}):"]
        lines += [f"  - {r}" for r in self.rewritten] or ["  (nothing)"]
        lines += [f"left ({len(self.left)}):"]
        lines += [f"  - {r}" for r in self.left] or ["  (nothing: no user tensor is replicated to B rows)"]
        if self.notes:
            lines += ["notes:"] + [f"  - {n}" for n in self.notes]
        return "\n".join(lines)


# ----------------------------------------------------------------------------- op tables

ELEMENTWISE_FUNCTIONS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod, operator.pow,
    operator.neg, operator.invert, operator.and_, operator.or_, operator.xor,
    operator.lt, operator.le, operator.gt, operator.ge, operator.eq, operator.ne, operator.abs,
    torch.add, torch.sub, torch.mul, torch.div, torch.where, torch.maximum, torch.minimum, torch.pow, torch.exp,
    torch.log, torch.sqrt, torch.rsqrt, torch.tanh, torch.sigmoid, torch.relu, torch.abs, torch.clamp, torch.neg,
    torch.logical_and, torch.logical_or, torch.logical_not, torch.masked_fill, torch.square, torch.reciprocal,
    F.relu, F.gelu, F.silu, F.dropout, F.tanh, F.sigmoid, F.leaky_relu, F.elu, F.softplus, F.hardtanh, F.mish,
}  # fmt: skip
ELEMENTWISE_METHODS = {
    "add", "sub", "mul", "div", "masked_fill", "clamp", "clamp_min", "clamp_max", "relu", "sigmoid", "tanh", "exp",
    "log", "sqrt", "rsqrt", "pow", "abs", "neg", "float", "double", "half", "bfloat16", "long", "int", "bool", "to",
    "type_as", "contiguous", "clone", "detach", "sign", "where", "logical_not", "square", "reciprocal", "type",
    "__and__", "__or__", "__invert__", "eq", "ne", "lt", "le", "gt", "ge",
}  # fmt: skip
ADD_SUB = {operator.add: 1.0, torch.add: 1.0, "add": 1.0, operator.sub: -1.0, torch.sub: -1.0, "sub": -1.0}
REDUCTIONS = {"sum", "mean", "amax", "amin", "prod", "logsumexp", "all", "any", "count_nonzero"}  # dim = 2nd argument
SOFTMAX = {F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, "softmax", "log_softmax"}
MATMUL = {torch.matmul, torch.bmm, operator.matmul, "matmul", "bmm", "__matmul__"}
CONVERSIONS = {"long", "int", "to", "type", "contiguous", "clone", "detach"}  # keep a mapping a mapping
SDPA = F.scaled_dot_product_attention


def _name(target) -> str:
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def _norm(dim, ndim):
    """A dim index made non-negative; None for anything but a plain int (then no rule applies)."""
    if not isinstance(dim, int) or isinstance(dim, bool):
        return None
    return dim + ndim if dim < 0 else dim


def _off_rows(dim, ndim) -> bool:
    """`dim` is a known int dim other than dim 0 (the row dim)."""
    return _norm(dim, ndim) not in (None, 0)


def _arg(args, kwargs, pos, name, default=None):
    if name in kwargs:
        return kwargs[name]
    return args[pos] if len(args) > pos else default


def _tensors(tree):
    return [v for v in tree_flatten(tree)[0] if is_value(v) and isinstance(v.meta, Meta)]
