"""The forms a value of the traced graph takes while the pass rebuilds it, the report, and the op
tables (which ops act row by row on dim 0)."""

from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.node import map_aggregate

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
        """Whether it holds values (real or complex: a spectrum, `torch.fft.rfft`), not ids, counts or masks."""
        return self.dtype.is_floating_point or self.dtype.is_complex


@dataclass(eq=False)
class Mapping:
    """One candidate → user mapping; `node` (new graph) is an index tensor [B] into the user rows."""

    key: Any
    node: fx.Node
    name: str
    heads: tuple | None = None  # (h, order): a mapping of merged rows, derived from another (`Rewriter.merged_rep`)
    base: Mapping | None = None  # the mapping a merged one was derived from


@dataclass(eq=False)
class Plain:
    node: Any  # new-graph node (or a literal)
    meta: Any
    batched: bool = False  # has the B candidate rows as dim 0
    mapping: Mapping | None = None  # this value is the mapping (maybe converted)
    spread: Mapping | None = None  # the mapping broadcast along trailing dims: value[b, ...] = m[b]
    rows_of: Plain | None = None  # a tensor without candidate rows expanded to B equal rows: value[b] = rows_of
    pairs: bool = False  # rows are the B candidates' pairs flattened (B·L rows of a Folded value, or ops on them)
    # (h, order): candidate rows merged with a dim of h (heads), B·h rows: row b·h + j ("batch") or j·B + b ("head")
    merged: tuple | None = None
    row_index: bool = False  # arange(B): value[b] = b


@dataclass(eq=False)
class Rep:
    user: fx.Node  # [U, ...] (or a tuple of them)
    mapping: Mapping
    meta: Any  # of the replicated value (B rows)
    source: str
    materialized: fx.Node | None = None
    row_dim: int = 0  # the dim that holds the rows (1 for sequence-first tensors)


@dataclass(eq=False)
class Sum:
    """cand + Σ sign · user[mapping]: an add / sub join kept as its terms until something reads it
    whole (a linear reads the terms, so user terms stay at U rows through it)."""

    cand: Any  # new-graph node [B, ...] or None
    users: list  # (user node [U, ...], Mapping, sign)
    meta: Meta
    materialized: fx.Node | None = None
    owned: bool = False  # `cand` is read by this sum only (a join may add into it in place)


@dataclass(eq=False)
class Struct:
    """A tuple of forms (a module or op returning several values: RNN output and state, topk)."""

    items: tuple
    meta: Any


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


@dataclass(eq=False)
class Packed:
    """pack_padded_sequence of replicated rows kept virtual: `user` packs the U user rows (enforce_sorted off, lengths
    at least 1), so an RNN runs over it at U rows; at B rows it is that sequence's rows repacked (`ops.packed_rows`)."""

    user: fx.Node
    mapping: Mapping
    meta: Any
    source: str
    materialized: fx.Node | None = None


@dataclass(eq=False)
class Folded:
    """x.view(-1, *rest) of a value x [B, L, …, *rest] with user rows in it (a concat, a replica, a sum): the pair
    rows flattened before an MLP. Kept as `inner` (x unflattened) for the ops that act on trailing dims alone (a
    linear then still splits), flattened where anything else reads it."""

    inner: Any
    lead: int  # the leading dims of `inner` the view merged (≥ 2)
    meta: Meta  # of the flattened value
    view: tuple  # (op, target, args, kwargs) that flatten `inner` (args[0]), as the model wrote it
    flat: Any = None  # the form of that op's result, once something reads the value flattened


VALUES = (Plain, Rep, Concat, RepShape, Rows, Sum, Struct, Packed, Folded)
USER_FORMS = (Rep, Concat, RepShape, Rows, Sum, Packed, Folded)  # forms that stand for B rows built from user rows


def is_value(x):
    return isinstance(x, VALUES)


def to_meta(x):
    if isinstance(x, torch.Tensor):
        return Meta(tuple(x.shape), x.dtype)
    if isinstance(x, torch.Size):
        return tuple(x)
    if isinstance(x, (tuple, list)):
        return tuple(to_meta(v) for v in x)
    if isinstance(x, dict):
        return {k: to_meta(v) for k, v in x.items()}
    return x


# ----------------------------------------------------------------------------- report


def _items(entries) -> list[str]:
    """Report lines, an entry that recurs (a loop the capture unrolled) once with its count."""
    counts = Counter(entries)
    return [f"  - {e}" + (f" (×{counts[e]})" if counts[e] > 1 else "") for e in counts]


@dataclass
class Report:
    """What the pass rewrote and what it left, for a person. Entries name the module path and the
    model's source line (`module.path (file:line)`).

    `left`: each user tensor still replicated to B rows, where and why (the model as a whole when it
    is served unchanged); `kept`: modules kept whole; `timing`: the cost model's measurement."""

    rewritten: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    timing: str = ""
    speedup: float | None = None  # original / rewritten on the example: the less favourable of cost.Timing's two

    @property
    def replications_left(self) -> int:
        return len(self.left)

    def __str__(self):
        lines = ["IKBO transformation report", f"rewritten ({len(self.rewritten)}):"]
        lines += _items(self.rewritten) or ["  (nothing)"]
        lines += [f"left ({len(self.left)}):"]
        lines += _items(self.left) or ["  (nothing: no user tensor is replicated to B rows)"]
        if self.kept:
            lines += ["modules kept whole:"] + _items(self.kept)
        if self.notes:
            lines += ["notes:"] + _items(self.notes)
        if self.timing:
            lines += [f"cost: {self.timing}"]
        return "\n".join(lines)


# ----------------------------------------------------------------------------- op tables

ELEMENTWISE_FUNCTIONS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod, operator.pow,
    operator.neg, operator.invert, operator.and_, operator.or_, operator.xor,
    operator.lt, operator.le, operator.gt, operator.ge, operator.eq, operator.ne, operator.abs,
    torch.add, torch.sub, torch.mul, torch.div, torch.where, torch.maximum, torch.minimum, torch.pow, torch.exp,
    torch.log, torch.sqrt, torch.rsqrt, torch.tanh, torch.sigmoid, torch.relu, torch.abs, torch.clamp, torch.neg,
    torch.logical_and, torch.logical_or, torch.logical_not, torch.masked_fill, torch.square, torch.reciprocal,
    torch.nan_to_num, torch.erf, torch.floor, torch.ceil, torch.round, torch.remainder, torch.fmod, torch.sign,
    torch.log1p, torch.expm1, torch.sin, torch.cos, torch.atan2, torch.eq, torch.ne, torch.lt, torch.le, torch.gt,
    torch.ge, torch.bitwise_and, torch.bitwise_or, torch.bitwise_not, torch.clamp_min, torch.clamp_max,
    torch.isnan, torch.isinf, torch.isneginf, torch.isposinf, torch.isfinite,
    F.relu, F.gelu, F.silu, F.dropout, F.tanh, F.sigmoid, F.leaky_relu, F.elu, F.softplus, F.hardtanh, F.mish,
    F.selu, F.celu, F.hardswish, F.hardsigmoid, F.logsigmoid, F.relu6, F.softsign, F.tanhshrink,
}  # fmt: skip
ELEMENTWISE_METHODS = {
    "add", "sub", "mul", "div", "masked_fill", "clamp", "clamp_min", "clamp_max", "relu", "sigmoid", "tanh", "exp",
    "log", "sqrt", "rsqrt", "pow", "abs", "neg", "float", "double", "half", "bfloat16", "long", "int", "bool", "to",
    "type_as", "contiguous", "clone", "detach", "cpu", "cuda", "sign", "where", "logical_not", "square", "reciprocal", "type",
    "__and__", "__or__", "__invert__", "eq", "ne", "lt", "le", "gt", "ge", "maximum", "minimum", "nan_to_num",
    "floor", "ceil", "round", "remainder", "fmod", "log1p", "expm1", "logical_and", "logical_or", "sin", "cos",
    "isnan", "isinf", "isneginf", "isposinf", "isfinite",
    "add_", "sub_", "mul_", "div_", "masked_fill_", "clamp_", "relu_", "sigmoid_", "tanh_", "exp_", "fill_", "zero_",
    "neg_", "abs_", "pow_", "sqrt_", "nan_to_num_", "__rsub__", "__radd__", "__rmul__", "__rtruediv__",
}  # fmt: skip
ADD_SUB = {operator.add: 1.0, torch.add: 1.0, "add": 1.0, operator.sub: -1.0, torch.sub: -1.0, "sub": -1.0}
REDUCTIONS = {"sum", "mean", "amax", "amin", "prod", "logsumexp", "all", "any", "count_nonzero", "std", "var", "norm",
              "nansum", "nanmean"}  # fmt: skip
REDUCTION_FUNCTIONS = {torch.sum, torch.mean, torch.amax, torch.amin, torch.logsumexp, torch.prod, torch.std, torch.var,
                       torch.nansum, torch.nanmean,
                       torch.norm, torch.linalg.vector_norm, torch.linalg.norm}  # fmt: skip
# reductions and scans along one dim with two results or no reduction of every dim by default: row by row where the
# dim is not the rows' (name → the dim's argument position, its default)
DIM_OPS = {"median": (1, None), "nanmedian": (1, None), "mode": (1, -1), "kthvalue": (2, -1), "var_mean": (1, None),
           "std_mean": (1, None), "aminmax": (None, None), "cummax": (1, None), "cummin": (1, None),
           "logcumsumexp": (1, None), "nancumsum": (1, None)}  # fmt: skip
FFT = torch.fft
FFTS = {f: (-1,) for f in (FFT.fft, FFT.ifft, FFT.rfft, FFT.irfft, FFT.hfft, FFT.ihfft)}  # (input, n, dim, norm)
FFTS |= {f: (-2, -1) for f in (FFT.fft2, FFT.ifft2, FFT.rfft2, FFT.irfft2, FFT.hfft2, FFT.ihfft2)}  # (input, s, dim,
FFTS |= {f: None for f in (FFT.fftn, FFT.ifftn, FFT.rfftn, FFT.irfftn, FFT.hfftn, FFT.ihfftn)}  # norm); None: all
NORM_REDUCTIONS = {"norm", torch.norm, torch.linalg.vector_norm, torch.linalg.norm}  # (x, p / ord, dim, keepdim)
FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full}
LIKE_FACTORIES = {torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like}
NEW_FACTORIES = {"new_zeros", "new_ones", "new_empty", "new_full"}  # x.new_zeros(size): x gives dtype, device
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


def fft_dims(key, args, kwargs, ndim) -> list | None:
    """The dims a `torch.fft` transform of an ndim-dim input acts on (non-negative; None where one is not a plain
    int): its `dim`, else its default — the last, the last two, or for the n-dim ones the last len(s), all without s."""
    dim = _arg(args, kwargs, 2, "dim")
    if dim is None:
        dim = FFTS[key]
    if dim is None:
        s = _arg(args, kwargs, 1, "s")
        dim = range(ndim) if s is None else range(ndim - len(s), ndim)
    dims = [_norm(d, ndim) for d in (dim if isinstance(dim, (tuple, list, range)) else [dim])]
    return None if None in dims else dims


def fmap(tree, fn):
    """fn applied to every leaf of nested tuples, lists, dicts and slices (forms are leaves)."""
    return map_aggregate(tree, fn)


def leaves(tree) -> list:
    """The leaves of nested tuples, lists, dicts and slices."""
    out = []
    map_aggregate(tree, lambda v: out.append(v))
    return out


def _tensors(tree):
    return [v for v in leaves(tree) if is_value(v) and isinstance(v.meta, Meta)]
