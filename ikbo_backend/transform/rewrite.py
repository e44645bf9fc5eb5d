"""The pass: rebuild a captured graph (capture.py) with user-side work at U rows.

Every value of the captured graph gets one of these forms while the new graph is built, in order:
    Plain   — computed as in the original (candidate rows B, user rows U, or no batch dim);
    Rep     — user[mapping] kept virtual: only `user` [U, ...] exists in the new graph;
    Concat  — cat(parts, dim) of Rep and candidate parts, kept as its parts;
    Sum     — cand + Σ ± user[mapping], an add / sub join kept as its terms;
    Struct  — a tuple of forms (an RNN's output and state);
    RepShape / Rows — x.shape / x.shape[0] of a Rep (B in the original, U in the user-row graph).
A Rep starts where a user tensor is replicated, recognised by what the op computes (x[m], x[m, :],
index_select(0, m), gather / take_along_dim with an index spread from m, embedding(m, x),
repeat_interleave(counts, 0), expand / repeat of one row, a one-hot selection matrix of m times x; x[:, m] and
index_select(1, m) of a sequence-first [L, U, ...] tensor give a Rep with its rows on dim 1), and flows through
ops that act row by row (they run at U rows). Where a Rep meets candidate rows the op becomes a join: the Type I
split of a linear (sibling linears merged, candidate parts in one GEMM), ikbo_linear_compress, ikbo_attention
(any per-user key mask), add_user_rows, or a tiled join (ops.rows_join / rows_matmul / rows_einsum).
Where no join exists the Rep is materialized right there (`ops.index_rows`) and the report says where
and why. Every node emitted is also run on the example (`values`), so checks look at values, not at
spellings.
"""

from __future__ import annotations

import itertools
import math
import operator
import string
from collections import Counter
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.fx.node import map_arg
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from . import ops
from .attention import AttentionRewrites, fuse_self_target_attention
from .capture import OUT_OF_PLACE_OPERATORS, alias_root, mutated_input, node_source, placeholder_value
from .values import (
    ADD_SUB,
    CONVERSIONS,
    DIM_OPS,
    ELEMENTWISE_FUNCTIONS,
    ELEMENTWISE_METHODS,
    FACTORIES,
    FFTS,
    LIKE_FACTORIES,
    MATMUL,
    NEW_FACTORIES,
    NORM_REDUCTIONS,
    REDUCTION_FUNCTIONS,
    REDUCTIONS,
    SDPA,
    SOFTMAX,
    USER_FORMS,
    Concat,
    Folded,
    Mapping,
    Meta,
    Packed,
    Plain,
    Rep,
    Report,
    RepShape,
    Rows,
    Struct,
    Sum,
    _arg,
    _name,
    _norm,
    _off_rows,
    _tensors,
    fft_dims,
    fmap,
    is_value,
    leaves,
    to_meta,
)  # fmt: skip

METADATA = {"shape", "dtype", "device", "ndim", "is_cuda", "layout"}
SIZE_OPS = {"view", "reshape", torch.reshape, "expand", "repeat"}  # their row size at U rows is U
EQUAL_ROWS = {"expand", "repeat", "broadcast_to", torch.broadcast_to}  # of a tensor without rows: equal rows
ADD_PRODUCTS = {torch.baddbmm: torch.bmm, "baddbmm": torch.bmm, torch.addmm: torch.matmul, "addmm": torch.matmul}
MATMULS = {torch.matmul, operator.matmul, torch.mm, "matmul", "mm"}
SPREADS = {"unsqueeze", "view", "reshape", "expand", "expand_as", "repeat", "broadcast_to", torch.unsqueeze,
           torch.reshape, torch.broadcast_to, operator.getitem}  # fmt: skip
KEEPS_DTYPE_IN_PLACE = {"eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not", "isnan",
                        "isinf", "isneginf", "isposinf", "isfinite"}  # fmt: skip
EQUAL_FACTORIES = {torch.zeros, torch.ones, torch.full}  # every row the same (not empty or random ones)
JOIN_OPS = {  # elementwise op → ops.rows_join name for (cand, user) and (user, cand) operand orders
    operator.mul: ("mul", "mul"), torch.mul: ("mul", "mul"), "mul": ("mul", "mul"),
    operator.truediv: ("div_cu", "div_uc"), torch.div: ("div_cu", "div_uc"), "div": ("div_cu", "div_uc"),
    torch.maximum: ("maximum", "maximum"), "maximum": ("maximum", "maximum"),
    torch.minimum: ("minimum", "minimum"), "minimum": ("minimum", "minimum"),
    operator.pow: ("pow_cu", "pow_uc"), torch.pow: ("pow_cu", "pow_uc"), "pow": ("pow_cu", "pow_uc"),
    **{k: (name, name) for name, keys in (("eq", (operator.eq, torch.eq, "eq")), ("ne", (operator.ne, torch.ne, "ne")))
       for k in keys},
    **{k: (f"{name}_cu", f"{name}_uc") for name, keys in (
        ("lt", (operator.lt, torch.lt, "lt")), ("le", (operator.le, torch.le, "le")),
        ("gt", (operator.gt, torch.gt, "gt")), ("ge", (operator.ge, torch.ge, "ge"))) for k in keys},
    **{k: (name, name) for name, keys in (
        ("and", (operator.and_, torch.bitwise_and, "__and__", "bitwise_and", torch.logical_and, "logical_and")),
        ("or", (operator.or_, torch.bitwise_or, "__or__", "bitwise_or", torch.logical_or, "logical_or")),
        ("xor", (operator.xor, torch.bitwise_xor, "__xor__", "bitwise_xor"))) for k in keys},
}  # fmt: skip
ANY_DTYPE_JOINS = {"eq", "ne", "lt", "le", "gt", "ge", "and", "or", "xor"}  # also for integer and boolean user rows
SEQUENCE_OPS = {
    torch.cat,
    torch.stack,
    torch.concat,
    torch.hstack,
    torch.vstack,
    torch.dstack,
}  # take a list of tensors
LOOKUP_MODULES = (nn.Embedding, nn.EmbeddingBag)
LOOKUP_FUNCTIONS = {F.embedding, F.embedding_bag, torch.embedding}
NORMS = {F.layer_norm, *([F.rms_norm] if hasattr(F, "rms_norm") else [])}
# reductions a replica's rows may go through (ops.reduce_rows): name → its kind; max / min of all elements only
ROW_REDUCTIONS = {
    **{k: k for k in ops.ROW_REDUCTIONS}, torch.sum: "sum", torch.nansum: "nansum", torch.mean: "mean",
    torch.nanmean: "nanmean", torch.amax: "amax", torch.amin: "amin", torch.logsumexp: "logsumexp",
    "max": "amax", torch.max: "amax", "min": "amin", torch.min: "amin",
}  # fmt: skip
VAR_STD = {"var": False, torch.var: False, "std": True, torch.std: True}  # → takes the square root
# reductions along a concat dim that combine exactly (max, min) or as logsumexp does (log(e^a + e^b)): each side
# reduced at its own rows, the sides combined per candidate → (reduce, combine within a side, rows_join name)
EXTREMES = {
    **dict.fromkeys(("amax", torch.amax), (torch.amax, torch.maximum, "maximum")),
    **dict.fromkeys(("amin", torch.amin), (torch.amin, torch.minimum, "minimum")),
    **dict.fromkeys(("logsumexp", torch.logsumexp), (torch.logsumexp, torch.logaddexp, "logaddexp")),
}
TRANSPOSES = {"transpose", torch.transpose, "swapaxes", torch.swapaxes, "swapdims"}
# functions that compute each sample of a batched input (dim 0) alone → the input's dims when batched
PER_SAMPLE = {
    F.conv1d: 3, F.conv2d: 4, F.conv3d: 5, F.conv_transpose1d: 3, F.conv_transpose2d: 4, F.max_pool1d: 3,
    F.max_pool2d: 4, F.max_pool3d: 5, F.avg_pool1d: 3, F.avg_pool2d: 4, F.avg_pool3d: 5, F.adaptive_avg_pool1d: 3,
    F.adaptive_avg_pool2d: 4, F.adaptive_max_pool1d: 3, F.adaptive_max_pool2d: 4, F.lp_pool1d: 3, F.lp_pool2d: 4,
    F.unfold: 4, F.fold: 3, F.max_pool1d_with_indices: 3, F.max_pool2d_with_indices: 4, F.max_pool3d_with_indices: 5,
    F.adaptive_max_pool1d_with_indices: 3, F.adaptive_max_pool2d_with_indices: 4,
}  # fmt: skip


class _AtenOps(TorchDispatchMode):
    """Records the ATen ops a call runs (below autograd and composite decompositions)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _aten_ops(fn, args, kwargs) -> tuple[list, Any]:
    """(the ATen ops fn(*args, **kwargs) runs, its value), on copies of the tensors (an in-place op changes none)."""
    args, kwargs = tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, (args, kwargs))
    with torch.no_grad(), torch.random.fork_rng(devices=[]), _AtenOps() as recorder:
        out = fn(*args, **kwargs)
    return recorder.ops, out


def _scalar(value) -> bool:
    """A number, or a 0-dim tensor without candidate rows."""
    return isinstance(value, (bool, int, float)) or (
        isinstance(value, Plain) and not value.batched and isinstance(value.meta, Meta) and not value.meta.ndim
    )


def _bitwise_agrees(key, a, b) -> bool:
    """Whether the bitwise join computes `key`: logical_and / logical_or only of two booleans."""
    logical = key in (torch.logical_and, "logical_and", torch.logical_or, "logical_or")
    return not logical or a.meta.dtype == b.meta.dtype == torch.bool


def _row_tolerance(want: torch.Tensor) -> dict:
    """allclose tolerances for a module's output run at U rows and gathered, against its output at B rows: the
    same rows in another batch size round alike in fp32; a 16-bit GEMM may block them differently."""
    if want.is_floating_point() and want.element_size() == 2:
        return dict(rtol=2e-2, atol=2e-2 * float(want.abs().max()) if want.numel() else 0.0)
    return dict(rtol=1e-4, atol=1e-6)


def _explicit_einsum(args):
    """einsum's (equation, *operands) with its operands given one by one and an ellipsis spelled as letters of its
    own (`"...ld,...d->...l"` of [B, L, D] and [B, D] is `"ald,ad->al"`), so that the rules reading an equation's
    letters (joins, the row index) apply: each operand's ellipsis covers the dims its letters leave, aligned from
    the right as einsum broadcasts them; an output without `->` is the ellipsis, then the letters used once, sorted.
    The operands' ndims are fixed by the graph (each call checks its inputs'). As given where it cannot tell."""
    equation, operands = args[0].replace(" ", ""), list(args[1:])
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    if "..." not in equation:
        return (equation, *operands)
    lhs, arrow, rhs = equation.partition("->")
    terms = lhs.split(",")
    ndims = [getattr(getattr(v, "meta", None), "ndim", None) for v in operands]
    if len(terms) != len(operands) or None in ndims or any(t.count("...") > 1 for t in terms):
        return args
    spans = [n - (len(t) - 3) if "..." in t else 0 for t, n in zip(terms, ndims)]
    free = [ch for ch in string.ascii_letters if ch not in equation]
    width = max(spans)
    if min(spans) < 0 or width > len(free):
        return args
    fill = free[:width]
    terms = [t.replace("...", "".join(fill[width - k :])) for t, k in zip(terms, spans)]
    if arrow:
        out = rhs.replace("...", "".join(fill))
    else:
        letters = [ch for ch in lhs if ch.isalpha()]
        out = "".join(fill) + "".join(sorted(ch for ch in set(letters) if letters.count(ch) == 1))
    return (",".join(terms) + "->" + out, *operands)


def _norm_dims(args, kwargs) -> int:
    """The number of dims a layer / group / RMS norm normalizes over; a shape read from a tensor (x.shape) may count
    its rows: taken as every dim (sizes read one by one that are no row count, `[x.shape[-1]]`, count as one each)."""
    shape = _arg(args, kwargs, 1, "normalized_shape")
    if isinstance(shape, int):
        return 1
    if is_value(shape) and isinstance(shape.meta, tuple):  # x.shape[-1:] read in the forward: its length is fixed
        return len(shape.meta)
    return len(shape) if isinstance(shape, (tuple, list)) and all(map(_plain_size, shape)) else 1 << 30


def _plain_size(s) -> bool:
    """A number, or a size read from a tensor that is no row count."""
    return not is_value(s) or (
        type(s) is Plain and type(s.meta) is int and not s.batched and s.mapping is None and s.merged is None
    )


def _sizes(args):
    """The size arguments of view / reshape / expand / repeat / a factory, as a list."""
    return list(args[1]) if len(args) == 2 and isinstance(args[1], (tuple, list)) else list(args[1:])


class Rewriter(AttentionRewrites):
    def __init__(self, traced: fx.GraphModule, examples: dict, mapping_name: str, num_users: int, num_candidates):
        self.traced, self.mapping_name = traced, mapping_name
        self.num_users, self.num_candidates = num_users, num_candidates
        self.graph = fx.Graph()
        self.report = Report()
        self.env: dict[fx.Node, Any] = {}
        self.values: dict[fx.Node, Any] = {}  # new-graph node → its value on the example
        self.mappings: dict[Any, Mapping] = {}
        self.input_mappings: dict[fx.Node, Mapping] = {}  # the mapping input's node → its Mapping
        self.counter = 0
        self.sunk: Counter = Counter()  # op name → how many ran at U rows instead of B
        self.fused: dict[fx.Node, Any] = {}  # original nodes already computed by a fused op
        self.examples = examples
        self.original = self._run_example()
        self.meta = {n: to_meta(v) for n, v in self.original.items()}
        self.node: fx.Node | None = None  # the original node being rebuilt
        self.order = {n: i for i, n in enumerate(traced.graph.nodes)}
        self.roots = {n: alias_root(n, traced) for n in traced.graph.nodes}  # the node owning each value's storage
        self.aliases: dict[fx.Node, list] = {}  # root → the nodes whose values may share its storage
        for n, root in self.roots.items():
            self.aliases.setdefault(root, []).append(n)
        self.converted = False  # the node being rebuilt was in place and is emitted out of place
        self.folding = True  # flattened pair rows become Folded (off while a Folded's own view op runs)
        self.value_checks = True  # checks that read tensor values (a device sync); off for modules CUDA graphs replay
        self.chains: dict = {}  # last node of a matmul-softmax-matmul chain → the chain (attention.Chain)
        self.pending: set = set()  # the chains' inner nodes, rebuilt with their last node
        self.meanings: dict[fx.Node, tuple] = {}  # node → (its ATen ops on the example, its value)

    def _run_example(self):
        """Each captured node's value on the example (tensors copied: later in-place ops do not change them)."""
        values = {}
        examples = self.examples

        class Recorder(fx.Interpreter):
            def placeholder(self, target, args, kwargs):
                return placeholder_value(examples, target, args)

            def run_node(self, n):
                out = super().run_node(n)
                copy = lambda v: v.clone() if isinstance(v, torch.Tensor) else v  # noqa: E731
                if type(out).__module__ == "torch.return_types":  # (values, indices) and the like: keep their names
                    values[n] = type(out)([copy(v) for v in out])
                else:
                    values[n] = tree_map(copy, out)
                return out

        with torch.no_grad():
            Recorder(self.traced).run(*[None] * sum(n.op == "placeholder" for n in self.traced.graph.nodes))
        return values

    # --- emitting ------------------------------------------------------------------------------

    def emit(self, op, target, args=(), kwargs=None):
        node = self.graph.create_node(op, target, tuple(args), dict(kwargs or {}))
        self.values[node] = self._evaluate(node)
        return node

    def _evaluate(self, node):
        if node.op == "get_attr":
            return self.fetch(node.target)
        args, kwargs = map_arg((node.args, node.kwargs), lambda n: self.values[n])
        with torch.no_grad():
            if node.op == "call_function":
                return node.target(*args, **kwargs)
            if node.op == "call_method":
                return getattr(args[0], node.target)(*args[1:], **kwargs)
            return self.fetch(node.target)(*args, **kwargs)

    def attach(self, prefix, value) -> str:
        """Store a constant or module on the rewritten module; returns its attribute name. A tensor is stored
        detached: made from parameters (a weight's split or merge), it would otherwise hold their autograd graph,
        which `copy.deepcopy` of the module refuses (gradients come from the original: `Guarded`)."""
        if isinstance(value, torch.Tensor):
            value = value.detach()
        self.counter += 1
        name = f"_ikbo_{prefix}_{self.counter}"
        setattr(self.traced, name, value)
        return name

    def fetch(self, target: str):
        """The tensor or module behind a get_attr / call_module target ("top.0.weight")."""
        value = self.traced
        for part in target.split("."):
            value = getattr(value, part)
        return value

    def where(self) -> str:
        """The original node being rebuilt, as `module.path (file:line)` (its name where nothing is known)."""
        if self.node is None:
            return "?"
        return f"`{node_source(self.node) or self.node.name}`"

    def user_side(self, x):
        """A value's form in the user-row graph (Rep → U rows)."""
        if isinstance(x, Rep):
            return x.user
        if isinstance(x, Rows):
            return x.user_rows
        if isinstance(x, RepShape):
            return x.user_shape
        if isinstance(x, Packed):
            return x.user
        if isinstance(x, Plain):
            return x.node
        raise AssertionError(f"{type(x).__name__} has no user-row form")

    def materialize(self, x, consumer: str, why: str):
        """A value's form at B rows; replicates a Rep (and reports it)."""
        if isinstance(x, Plain):
            return x.node
        if isinstance(x, Rows):
            return self.emit("call_function", ops.mapping_rows, (x.mapping.node,))
        if isinstance(x, RepShape):
            return self.emit("call_function", ops.rep_shape, (x.user_shape, x.mapping.node))
        if isinstance(x, Struct):
            return tuple(self.materialize(v, consumer, why) if is_value(v) else v for v in x.items)
        if isinstance(x, Sum):
            if x.materialized is None:
                x.materialized = self.join_sum(x)
            return x.materialized
        if isinstance(x, Concat):
            if x.materialized is None:
                parts = [self.materialize(p, consumer, why) for p in x.parts]
                x.materialized = self.emit("call_function", torch.cat, (parts,), {"dim": x.dim})
            return x.materialized
        if isinstance(x, Folded):
            return self.materialize(self.flat_form(x), consumer, why)
        if isinstance(x, Packed):
            if x.materialized is None:
                x.materialized = self.emit("call_function", ops.packed_rows, (x.user, x.mapping.node))
                self.report.left.append(f"{x.source} packed sequence replicated to B rows at {consumer}: {why}")
            return x.materialized
        if isinstance(x, Rep):
            if x.materialized is None:
                fn = ops.index_rows_tuple if isinstance(x.meta, tuple) else ops.index_rows
                args = (x.user, x.mapping.node) + ((x.row_dim,) if x.row_dim else ())
                x.materialized = self.emit("call_function", fn, args)
                entry = f"{x.source} replicated to B rows at {consumer}: {why}"
                if isinstance(x.meta, Meta) and not x.meta.is_float and self._feeds_lookup(self.node):
                    self.report.left.append(
                        f"{entry} (ids, {x.meta.dtype}: the lookups they feed, and what follows, run at B rows)"
                    )
                elif isinstance(x.meta, Meta) and not x.meta.is_float:
                    self.report.notes.append(
                        f"{entry} (non-float, {x.meta.dtype}: index/mask data, not counted as a replication)"
                    )
                else:
                    self.report.left.append(entry)
            return x.materialized
        return x

    def _feeds_lookup(self, node) -> bool:
        """Whether integer user data materialized at `node` (of the captured graph) reaches an embedding lookup
        through integer ops of one tensor (reshapes, slices, casts): the user rows it looks up are then computed at
        B rows. An op that mixes in another tensor (a crossed id `u * V + c`) makes per-candidate data: not counted."""
        todo, seen = [node] if node is not None else [], set()
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            if n.op == "call_module" and isinstance(self.traced.get_submodule(n.target), LOOKUP_MODULES):
                return True
            if n.op == "call_function" and n.target in LOOKUP_FUNCTIONS:
                return True
            value = n.meta.get("example_value")
            tensors = [a for a in n.all_input_nodes if isinstance(a.meta.get("example_value"), torch.Tensor)]
            if len(tensors) == 1 and isinstance(value, torch.Tensor) and not value.is_floating_point():
                todo.extend(n.users)
        return False

    def plain(self, op, target, args, kwargs, meta, why):
        """Emit the op as in the original, materializing what it reads."""
        flat = leaves((args, kwargs))
        batched = any(
            isinstance(v, USER_FORMS)
            or isinstance(v, Plain)
            and (
                v.batched
                or v.mapping
                or v.pairs
                or v.merged
                or isinstance(v.meta, Meta)
                and self.num_candidates in v.meta.shape
            )
            for v in flat
        )  # candidate rows in, at dim 0 or elsewhere (a sequence-first tensor)
        pair_rows = {v.meta.shape[0] for v in flat if isinstance(v, Plain) and v.pairs and v.meta.ndim}
        where = self.where()
        m = lambda v: self.materialize(v, where, why) if is_value(v) else v  # noqa: E731
        node = self.emit(op, target, fmap(args, m), fmap(kwargs, m))
        rows_b = isinstance(meta, Meta) and meta.ndim > 0 and meta.shape[0] == self.num_candidates
        count_b = type(meta) is int and meta == self.num_candidates  # e.g. cand.shape[0]
        out = Plain(node, meta, batched=batched and (rows_b or count_b or isinstance(meta, tuple)))
        out.pairs = not out.batched and isinstance(meta, Meta) and meta.ndim > 0 and meta.shape[0] in pair_rows
        if not out.batched and isinstance(meta, Meta) and meta.ndim > 0:
            out.merged = self.merged_tag(op, target, args, kwargs, meta)
        src = args[0] if args else None
        if target in EQUAL_ROWS and out.batched and isinstance(src, Plain) and not src.batched and src.mapping is None:
            if isinstance(src.meta, Meta) and (src.meta.ndim < meta.ndim or src.meta.shape[0] == 1):
                out.rows_of = src  # arange(L).expand(B, L): every candidate row the same
        if out.batched and isinstance(meta, Meta) and op == "call_function" and target in EQUAL_FACTORIES:
            out.rows_of = self._one_row_factory(target, args, kwargs)  # zeros(B, L) with B = cand.shape[0]
        return out

    def _one_row_factory(self, target, args, kwargs):
        """torch.zeros / ones / full of sizes (B, *rest) with B a candidate row count and constant rest: the same
        factory of one row, or None."""
        sized = bool(args) and isinstance(args[0], (tuple, list))
        sizes, rest = (list(args[0]), args[1:]) if sized else (list(args), ())
        if target is torch.full and not sized:
            return None
        first = sizes[0] if sizes else None
        if not (isinstance(first, Plain) and first.batched and type(first.meta) is int):
            return None
        if any(is_value(v) and not (isinstance(v, Plain) and not v.batched) for v in leaves((sizes[1:], rest, kwargs))):
            return None
        unwrap = lambda v: v.node if isinstance(v, Plain) else v  # noqa: E731
        node = self.emit(
            "call_function", target, ((1, *fmap(sizes[1:], unwrap)), *fmap(rest, unwrap)), fmap(kwargs, unwrap)
        )
        return Plain(node, to_meta(self.values[node]))

    @staticmethod
    def _one_row_rep(v) -> bool:
        """A Rep of one row expanded to every candidate (`one_row`: a model's constant token `sink.expand(B, 1, d)`)."""
        return (
            isinstance(v, Rep) and not v.row_dim and isinstance(v.mapping.key, tuple) and v.mapping.key[0] == "expand"
        )

    def constant_rows_beside(self, args, kwargs):
        """Operands expanded to B equal rows (rows_of, or a Rep of one row through its own expand mapping) beside Reps
        of one mapping: Reps of their source expanded to U rows (any mapping selects the same row), so a row-wise op
        (a cat of a constant token and a history along the sequence) runs at U rows."""
        flat = leaves((args, kwargs))
        reps = [v for v in flat if isinstance(v, Rep) and not v.row_dim and not self._one_row_rep(v)]
        consts = [v for v in flat if isinstance(v, Plain) and v.rows_of is not None]
        consts += [v for v in flat if self._one_row_rep(v) and isinstance(v.meta, Meta)]
        if not reps or not consts or len({r.mapping.key for r in reps}) != 1:
            return args, kwargs
        rows = self.emit(
            "call_function", operator.getitem, (self.emit("call_function", getattr, (reps[0].user, "shape")), 0)
        )
        swapped = {}
        for v in consts:
            if isinstance(v, Rep):  # its user tensor is the one row: [1, ...]
                node = self.emit("call_method", "expand", (v.user, rows, *[-1] * (v.meta.ndim - 1)))
            else:
                node = self.emit("call_method", "expand", (v.rows_of.node, rows, *v.meta.shape[1:]))
            swapped[id(v)] = Rep(node, reps[0].mapping, v.meta, f"{self.where()} (a constant row)")
        swap = lambda v: swapped.get(id(v), v)  # noqa: E731
        return fmap(args, swap), fmap(kwargs, swap)

    # --- main loop -----------------------------------------------------------------------------

    def run(self) -> tuple[fx.GraphModule, Report]:
        for node in self.traced.graph.nodes:
            self.node = node
            meta = self.meta.get(node)
            if node.op == "placeholder":
                new = self.graph.create_node("placeholder", node.target, node.args)
                self.values[new] = placeholder_value(self.examples, node.target, node.args)
                if node.target == self.mapping_name:
                    self.env[node] = Plain(new, meta, batched=True, mapping=self._input_mapping(new))
                else:
                    self.env[node] = Plain(new, meta, batched=self._rows_b(meta))
            elif node.op == "get_attr":
                self.env[node] = Plain(self.emit("get_attr", node.target), meta)
            elif node.op == "output":
                returned = lambda v: self.materialize(v, "the output", "the model returns it") if is_value(v) else v  # noqa: E731
                self.graph.output(fmap(self._lookup(node.args[0]), returned))
            elif node in self.fused:
                self.env[node] = self.fused.pop(node)
            elif node in self.pending:  # inside an attention chain: rebuilt with its last node
                continue
            elif node in self.chains:
                chain = self.chains.pop(node)
                if not self.fuse_attention_chain(chain):  # as written, node by node
                    for n in sorted(chain.inner, key=self.order.get):
                        self.pending.discard(n)
                        self.node = n
                        self.rebuild(n)
                    self.node = node
                    self.rebuild(node)
            elif (chain := self.attention_chain(node)) is not None:
                self.chains[chain.out] = chain  # fused when its last matmul comes: masks and V are known then
                self.pending.update(chain.inner[1:])
                self.env[node] = None
            else:
                self.rebuild(node)
        self.node = None
        if self.sunk:
            ops_run = ", ".join(f"{op}×{n}" if n > 1 else op for op, n in self.sunk.most_common())
            self.report.rewritten.append(
                f"{sum(self.sunk.values())} row-wise ops run at U rows instead of B rows: {ops_run}"
            )
        fuse_self_target_attention(self.graph, self.report)
        for node in self.graph.nodes:  # `Guarded` passes the arguments by position: parameters get the nodes' names,
            if node.op == "placeholder":  # which fx keeps apart from what the code reads (`torch`, `getattr`)
                node.target = node.name
        module = fx.GraphModule(self.traced, self.graph, class_name="IkboRewritten")
        module.graph.eliminate_dead_code()
        module.graph.lint()
        module.recompile()
        return module, self.report

    def rebuild(self, node):
        """node's form in the new graph, through the rules (in-place ops as above)."""
        meta = self.meta.get(node)
        mutated = mutated_input(node, self.traced)
        args, kwargs = self._lookup(node.args), self._lookup(node.kwargs)
        copied, into = False, mutated is not None and node.kwargs.get("out") is mutated
        if into:  # torch.tanh(x, out=y): run out of place, later readers of y get the result
            kwargs = {k: v for k, v in kwargs.items() if k != "out"}
        elif mutated is not None and self.out_of_place(node.op, node.target, args, kwargs) is None:
            copied = self.private_copy(node, mutated)  # run in place: on a copy where x's nodes are shared
            args, kwargs = self._lookup(node.args), self._lookup(node.kwargs)
        self.converted = into
        out = self.apply(node.op, self.canonical(node), args, kwargs, meta)
        self.converted |= into
        self.env[node] = out
        if mutated is not None:
            self.check_aliases(node, mutated, copied or self.converted)
            self.env[mutated] = out  # later readers of the mutated tensor see the result

    def _lookup(self, tree):
        return fmap(tree, lambda a: self.env[a] if isinstance(a, fx.Node) else a)

    def _meaning(self, node) -> tuple[list, Any]:
        """(the ATen ops the original node runs on the example, its value); ([], None) where it cannot be rerun."""
        if node not in self.meanings:
            self.meanings[node] = [], None
            if node.op in ("call_function", "call_method") and mutated_input(node, self.traced) is None:
                args, kwargs = map_arg((node.args, node.kwargs), lambda n: self.original[n])
                fn = node.target if node.op == "call_function" else getattr(type(args[0]), node.target, None)
                if isinstance(args[0] if args else None, torch.Tensor) or node.op == "call_function":
                    try:
                        self.meanings[node] = _aten_ops(fn, args, kwargs)
                    except Exception:  # a call that does not rerun has no meaning to read
                        pass
        return self.meanings[node]

    def pointwise(self, key) -> bool:
        """Whether the op being rebuilt (`key` its target) is elementwise by what it runs: every ATen op it dispatched
        on the example is tagged pointwise and none draws random numbers (`torch.clip`, `torch.special.expit`,
        `torch.lerp`, `x.xlogy(y)`)."""
        node = self.node
        if node is None or node.target is not key:
            return False
        aten, _ = self._meaning(node)
        return bool(aten) and all(
            torch.Tag.pointwise in f.tags and torch.Tag.nondeterministic_seeded not in f.tags for f in aten
        )

    def canonical(self, node):
        """The torch function or method that an alias dispatches to, where the node is a spelling of a known
        elementwise op (`torch.multiply` → `torch.mul`, `torch.subtract` → `torch.sub`, `torch.true_divide` →
        `torch.div`, `torch.greater` → `torch.gt`): the node runs exactly one ATen op, the function of that name
        is a known elementwise op, and it gives the node's value on the example with the same arguments; else the
        node's own target."""
        known = lambda t: t in ELEMENTWISE_FUNCTIONS or t in ELEMENTWISE_METHODS or t in JOIN_OPS  # noqa: E731
        if node.op not in ("call_function", "call_method") or known(node.target):
            return node.target
        aten, value = self._meaning(node)
        if len(aten) != 1 or not isinstance(value, torch.Tensor):
            return node.target
        name = aten[0].overloadpacket.__name__
        target = getattr(torch, name, None) if node.op == "call_function" else name
        if target is None or not known(target):
            return node.target
        args, kwargs = map_arg((node.args, node.kwargs), lambda n: self.original[n])
        fn = target if node.op == "call_function" else getattr(type(args[0]), target, None)
        try:
            _, same = _aten_ops(fn, args, kwargs)
        except Exception:  # other arguments than the alias's: not the same op
            return node.target
        agree = isinstance(same, torch.Tensor) and same.dtype == value.dtype and same.shape == value.shape
        return target if agree and torch.equal(same, value) else node.target

    # --- in-place ops --------------------------------------------------------------------------

    def out_of_place(self, op, target, args, kwargs):
        """The op an in-place op with user-side operands runs as, or None: `x.mul_(y)` as `x.mul(y)`, `x += y` as
        `x + y` (later readers of x get its result: `mutated_input`)."""
        if not any(isinstance(v, (*USER_FORMS, Struct)) for v in leaves((args, kwargs))):
            return None
        if op == "call_method" and target.endswith("_") and target[:-1] in ELEMENTWISE_METHODS:
            # x.gt_(y) keeps x's dtype where x.gt(y) is boolean: those run in place, on a copy
            return None if target[:-1] in KEEPS_DTYPE_IN_PLACE else target[:-1]
        return OUT_OF_PLACE_OPERATORS.get(target) if op == "call_function" else None

    def private_copy(self, node, x) -> bool:
        """Before the in-place op `node` on x: where x's nodes may be read by other values of the new graph, x's
        form over copies of them (a Rep's U-row `user` is its source's node, other Reps and joins read it later; a
        user-row Plain may be a Rep's source; a candidate-row Plain that a Sum or Concat read keeps its node as a
        term), so the op changes x alone, as in the original where x[m] is a copy. True if it copied."""
        form = self.env[x]
        user_side = isinstance(form, (Rep, Concat, Folded)) or isinstance(form, Plain) and not form.batched
        held = any(
            isinstance(self.env.get(reader), (Rep, Sum, Concat, Packed, Struct))
            for alias in self.aliases[self.roots[x]]
            for reader in alias.users
            if self.order[reader] < self.order[node]
        )
        if not (user_side or held):
            return False
        copy = self._copied(form)
        self.env[x] = copy
        return copy is not form

    def _copied(self, form):
        clone = lambda n: self.emit("call_method", "clone", (n,))  # noqa: E731
        if isinstance(form, Plain) and isinstance(form.meta, Meta) and isinstance(form.node, fx.Node):
            return Plain(clone(form.node), form.meta, form.batched, form.mapping, form.spread)
        if isinstance(form, Rep) and isinstance(form.meta, Meta):
            return Rep(clone(form.user), form.mapping, form.meta, form.source, row_dim=form.row_dim)
        if isinstance(form, Concat):
            return Concat([self._copied(p) for p in form.parts], form.dim, form.meta)
        if isinstance(form, Folded):  # changed in place: flattened, on a copy
            node = self.materialize(form, self.where(), "an in-place op changes the flattened rows")
            return Plain(clone(node), form.meta, pairs=True)
        return form

    def check_aliases(self, node, x, detached: bool):
        """After the in-place op `node` on x: other views of x's storage read again afterwards see the change in
        the original; in the new graph they do only where the op ran in place on x's own node and they are views of
        it there too (candidate rows emitted as written). Otherwise (x or an alias is a user-side form, or the op
        ran on a copy or out of place: `detached`) the rewrite would give them the old values: it raises, and the
        pass returns the model."""
        later = lambda a: any(self.order[u] > self.order[node] for u in a.users)  # noqa: E731
        stale = [a for a in self.aliases[self.roots[x]] if a is not x and self.order[a] < self.order[node] and later(a)]
        user_side = lambda v: isinstance(v, USER_FORMS) or isinstance(v, Plain) and not v.batched  # noqa: E731
        if stale and (detached or any(user_side(self.env[a]) for a in (x, *stale))):
            op = node.meta.get("in_place", _name(node.target))
            aliases = ", ".join(sorted({node_source(a) or a.name for a in stale}))
            raise ValueError(
                f"in-place {op} through an alias of a user tensor: another view of its storage ({aliases}) is read "
                "afterwards and would not see the change (user rows are kept apart from their per-candidate copies)"
            )

    def _input_mapping(self, node, name=None):
        mapping = Mapping(("input",) if name is None else ("input", name), node, name or self.mapping_name)
        self.input_mappings[node] = mapping
        return mapping

    def _rows_b(self, meta):
        return isinstance(meta, Meta) and meta.ndim > 0 and meta.shape[0] == self.num_candidates

    # --- dispatch ------------------------------------------------------------------------------

    def apply(self, op, target, args, kwargs, meta):
        # a sum already joined (maybe into its candidate term, in place) is read as its result from then on
        done = lambda v: Plain(v.materialized, v.meta, True) if isinstance(v, Sum) and v.materialized is not None else v  # noqa: E731
        args, kwargs = fmap(args, done), fmap(kwargs, done)
        if any(isinstance(v, Folded) for v in leaves((args, kwargs))):
            if (out_of_place := self.out_of_place(op, target, args, kwargs)) is not None:
                target, self.converted = out_of_place, True  # before the value is flattened: then it is no user form
            out = self.through_fold(op, target, args, kwargs, meta)
            if out is not None:
                return out
            flat = lambda v: self.flat_form(v) if isinstance(v, Folded) else v  # noqa: E731
            args, kwargs = fmap(args, flat), fmap(kwargs, flat)
        elif (folded := self.fold(target, args, kwargs, meta)) is not None:
            return folded
        if target is torch.einsum and args and isinstance(args[0], str):
            args = _explicit_einsum(args)
        if target is operator.setitem:
            return self.setitem(*args)
        if target is ops.fast_path_taken:  # reads grad flags only: any form of the input will do
            form = lambda v: v.user if isinstance(v, Rep) else v.node if isinstance(v, Plain) else None  # noqa: E731
            node = self.emit(op, target, tuple(form(v) if is_value(v) else v for v in args), kwargs)
            return Plain(node, meta)
        if target in SEQUENCE_OPS and args and isinstance(args[0], Struct):  # torch.stack(torch.split(x, ...))
            args = (list(args[0].items), *args[1:])
        if (
            target == "expand_as"
            and len(args) == 2
            and isinstance(args[1], Rep)
            and args[1].row_dim == 0
            and isinstance(args[1].meta, Meta)
        ):
            shape = RepShape(
                self.emit("call_function", getattr, (args[1].user, "shape")), args[1].mapping, args[1].meta.shape
            )
            return self.apply("call_method", "expand", (args[0], shape), {}, meta)  # only the shape of a Rep is read
        if (
            target in ("view_as", "reshape_as")
            and len(args) == 2
            and not kwargs
            and isinstance(args[1], Concat)
            and isinstance(args[0], Plain)
            and isinstance(meta, Meta)
        ):  # x.view_as(y) of a concat y reads y's shape only (HiFormer's `composite(x).view_as(q)`): at B rows
            shape = self.shape_access("call_function", getattr, (args[1], "shape"), {}, tuple(meta.shape))
            return self.apply("call_method", target[: -len("_as")], (args[0], shape), {}, meta)
        if target is torch.tensordot and self._tensordot_is_matmul(args, kwargs):
            op, target, args, kwargs = "call_function", torch.matmul, args[:2], {}
        if (
            target in (torch.mm, "mm")
            and len(args) == 2
            and not kwargs
            and any(isinstance(v, USER_FORMS) for v in args)
        ):
            op, target = "call_function", torch.matmul  # mm is matmul of two 2-D operands (HSTU's `mm(x, uvqk)`)
        if target in ADD_PRODUCTS and len(args) == 3 and set(kwargs) <= {"beta", "alpha"}:
            if any(isinstance(v, USER_FORMS) for v in leaves(args)):
                return self.add_product(target, args, kwargs, meta)
        flat = leaves((args, kwargs))
        if op in ("call_function", "call_method"):
            for handler in (self.replication_site, self.mapping_conversion, self.containers, self.packing):
                out = handler(target, args, kwargs, meta)
                if out is not None:
                    return out
        if op == "call_function" and target is torch.arange and self._arange_rows(args, kwargs, meta):
            out = self.plain(op, target, args, kwargs, meta, "")
            out.row_index = out.batched
            return out
        user = [v for v in flat if isinstance(v, USER_FORMS) or isinstance(v, Struct)]
        if not user:
            return self.plain(op, target, args, kwargs, meta, "")
        if (out_of_place := self.out_of_place(op, target, args, kwargs)) is not None:
            target, self.converted = out_of_place, True
        if (split := self.split_merged(target, args, kwargs, meta)) is not None:
            return split
        if not self.merged_rows_agree(flat):
            return self.plain(op, target, args, kwargs, meta, "it mixes rows merged with heads with other rows")
        if op == "call_module":
            out = self.modules(target, args, kwargs, meta)
            return out if out is not None else self.plain(op, target, args, kwargs, meta, self.why_module(target))
        if op != "call_function" and op != "call_method":
            return self.plain(op, target, args, kwargs, meta, f"{op} is not traced into")
        handlers = (self.readout, self.merged_rep, self.constant_rows, self.shape_access, self.moved_rows, self.concat_ops, self.rows_reduction,
                    self.sums, self.rowwise, self.sequence_first_elementwise, self.sequence_first_rowwise)  # fmt: skip
        for handler in (*handlers, self.joins):
            out = handler(op, target, args, kwargs, meta)
            if out is not None:
                return out
        return self.plain(op, target, args, kwargs, meta, self.why_not(target, args, kwargs, meta))

    # --- pair rows flattened: x.view(-1, d) of [B, L, d] ----------------------------------------------------------

    FOLDS = {"view", "reshape", torch.reshape, "flatten", torch.flatten}

    def fold(self, key, args, kwargs, meta):
        """x.view(-1, *rest) / reshape / flatten(0, k) of a concat, replica or sum x [B, L, …, *rest] merging its
        leading dims: a Folded, so that the ops reading it can still act on x's parts (`through_fold`)."""
        x = args[0] if args else None
        if not self.folding or key not in self.FOLDS or not isinstance(x, (Rep, Concat, Sum)):
            return None
        if not isinstance(meta, Meta) or not isinstance(x.meta, Meta):
            return None
        if isinstance(x, Rep) and (x.row_dim or not isinstance(x.meta, Meta)):
            return None
        shape = x.meta.shape
        lead = len(shape) - meta.ndim + 1
        if lead < 2 or shape[0] != self.num_candidates or meta.shape[1:] != shape[lead:] or meta.shape[0] == shape[0]:
            return None  # not a merge of rows, or one that keeps them (x.view(B, -1) of [B, 1, d]): the rules below
        if key in ("flatten", torch.flatten):
            start, end = _arg(args, kwargs, 1, "start_dim", 0), _arg(args, kwargs, 2, "end_dim", -1)
            if (
                set(kwargs) - {"start_dim", "end_dim"}
                or _norm(start, len(shape)) != 0
                or _norm(end, len(shape)) != lead - 1
            ):
                return None
        else:
            sizes = _sizes(args)
            if kwargs or len(sizes) != meta.ndim or (isinstance(sizes[0], int) and sizes[0] != -1):
                return None  # a row count written as a number holds for the example only
            if not all(type(s) is int or isinstance(s, Plain) and not self.batched(s) for s in sizes):
                return None
            if isinstance(x, Sum) and not (x.cand is not None and self.values[x.cand].shape == shape):
                return None  # its shape would need it joined
            # a merge of the first `lead` dims on the example; each call checks it is one there too (sizes traced
            # from other dims, or a dim that equals another on the example only): else the original model runs
            shape_node = self.emit("call_function", getattr, (x.cand, "shape")) if isinstance(x, Sum) else None
            shape_node = shape_node or self._shape_node(x)
            unwrap = lambda v: v.node if is_value(v) else v  # noqa: E731
            self.emit("call_function", ops.check_fold, (shape_node, lead, [unwrap(v) for v in sizes]))
        return Folded(x, lead, meta, ("call_method" if isinstance(key, str) else "call_function", key, args, kwargs))

    def flat_form(self, v):
        """The form of a Folded value read flattened: its view op run as the model wrote it, through the rules
        (once; rows of B candidates' pairs are marked `pairs`)."""
        if v.flat is None:
            op, key, args, kwargs = v.view
            self.folding = False
            try:
                v.flat = self.apply(op, key, args, kwargs, v.meta)
            finally:
                self.folding = True
            if isinstance(v.flat, Plain) and not v.flat.batched:
                v.flat.pairs = True
        return v.flat

    def through_fold(self, op, key, args, kwargs, meta):
        """An op reading Folded values that acts on trailing dims alone (a linear or matmul by a weight, an
        elementwise op with operands broadcast over the trailing dims, a concat along them): run on the unflattened
        values (a linear over a concat splits), flattened after it. None: the Folded values are flattened."""
        folds = [v for v in leaves((args, kwargs)) if isinstance(v, Folded)]
        first = folds[0]
        lead_shape = first.inner.meta.shape[: first.lead]
        if not isinstance(meta, Meta) or meta.ndim == 0:
            return None
        if any(f.lead != first.lead or f.inner.meta.shape[: f.lead] != lead_shape for f in folds):
            return None
        if op == "call_method" and isinstance(key, str) and key.endswith("_"):
            return None  # in place: the flattened view's storage is read as written
        nd = meta.ndim

        def trailing(v):  # broadcast over the trailing dims only
            if not is_value(v):
                return True
            if not isinstance(v, Plain) or self.batched(v) or v.pairs or not isinstance(v.meta, Meta):
                return False
            return v.meta.ndim < nd or v.meta.ndim == nd and v.meta.shape[0] == 1

        x = args[0] if args else None
        if key in ("view", "reshape", torch.reshape) and x is first and len(folds) == 1 and not kwargs:
            return self.apply(op, key, (first.inner, *args[1:]), {}, meta)  # same row-major order: x's view
        if key is F.linear or key in MATMUL:
            weights = [w for w in (*args[1:], *kwargs.values()) if is_value(w)]
            constant = lambda w: isinstance(w, Plain) and not (self.batched(w) or w.pairs)  # noqa: E731
            if not (x in folds and len(folds) == 1 and all(constant(w) for w in weights)):
                return None
            if key in MATMUL and not (len(args) == 2 and args[1].meta.ndim in (1, 2)):
                return None
        elif key is torch.cat:
            dim = _norm(_arg(args, kwargs, 1, "dim", 0), nd)
            if dim in (None, 0) or not all(isinstance(p, Folded) for p in args[0]):
                return None
            args, kwargs = (args[0], dim + first.lead - 1), {}
        elif key in ELEMENTWISE_FUNCTIONS or key in ELEMENTWISE_METHODS:
            same_rank = lambda v: isinstance(v, Folded) and v.meta.ndim == nd  # noqa: E731
            if not all(same_rank(v) or trailing(v) for v in leaves((args, kwargs))):
                return None
        else:
            return None
        if meta.shape[0] != first.meta.shape[0]:
            return None
        unfold = lambda v: v.inner if isinstance(v, Folded) else v  # noqa: E731
        inner_meta = Meta((*lead_shape, *meta.shape[1:]), meta.dtype)
        fused = set(self.fused)
        out = self.apply(op, key, fmap(args, unfold), fmap(kwargs, unfold), inner_meta)
        for n in set(self.fused) - fused:  # linears over the same flattened concat, merged into this one
            self.fused[n] = self._folded_result(self.fused[n], first.lead, self.meta[n])
        return self._folded_result(out, first.lead, meta)

    def _folded_result(self, out, lead, meta):
        if isinstance(out, Plain):
            return Plain(self.emit("call_method", "flatten", (out.node, 0, lead - 1)), meta, pairs=True)
        return Folded(out, lead, meta, ("call_method", "flatten", (out, 0, lead - 1), {}))

    def add_product(self, target, args, kwargs, meta):
        """baddbmm / addmm(base, a, b, beta=, alpha=) as beta · base + alpha · (a @ b), each op through the rules (the
        product may be a join, the add a Sum)."""
        base, left, right = args[:3]
        beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
        product = self.apply("call_function", ADD_PRODUCTS[target], (left, right), {}, meta)
        if alpha != 1:
            product = self.apply("call_function", operator.mul, (product, alpha), {}, meta)
        if beta == 0:  # base ignored, as baddbmm does (NaN in it does not propagate)
            return product
        if beta != 1:
            base = self.apply("call_function", operator.mul, (base, beta), {}, getattr(base, "meta", meta))
        return self.apply("call_function", operator.add, (base, product), {}, meta)

    def _tensordot_is_matmul(self, args, kwargs) -> bool:
        """tensordot(x, W, dims=([-1], [0])) (or dims=1) with a 2-D W: x @ W, as DeepCTR-Torch's layers write it."""
        if len(args) < 2 or not all(is_value(a) and isinstance(a.meta, Meta) for a in args[:2]):
            return False
        x, w = args[:2]
        dims = _arg(args, kwargs, 2, "dims", 2)
        if w.meta.ndim != 2 or x.meta.ndim < 1 or self.batched(w) or set(kwargs) - {"dims", "out"} or kwargs.get("out"):
            return False
        if dims == 1:
            return True
        if not (isinstance(dims, (tuple, list)) and len(dims) == 2):
            return False
        left, right = (list(d) if isinstance(d, (tuple, list)) else [d] for d in dims)
        return [_norm(d, x.meta.ndim) for d in left] == [x.meta.ndim - 1] and [_norm(d, 2) for d in right] == [0]

    def setitem(self, x, index, value):
        """x[index] = value: the form of x afterwards (row-wise on a Rep's user rows where it can be)."""
        unwrap = lambda v: v.node if isinstance(v, Plain) else v  # noqa: E731
        entries = index if isinstance(index, tuple) else (index,)
        row_wise = entries and entries[0] == slice(None) and not any(is_value(i) and self.batched(i) for i in entries)
        # a value without candidate rows, or replicated like x (then read at its user rows)
        same_rows = isinstance(x, Rep) and isinstance(value, Rep) and value.mapping.key == x.mapping.key
        at_user_rows = not (is_value(value) and self.batched(value)) or same_rows and not value.row_dim
        if isinstance(x, Rep) and not x.row_dim and row_wise and at_user_rows:  # x.user: a copy (`private_copy`)
            user_value = self.user_side(value) if is_value(value) else value
            self.emit("call_function", operator.setitem, (x.user, fmap(index, unwrap), user_value))
            return Rep(x.user, x.mapping, x.meta, x.source)
        node = self.materialize(x, self.where(), "it is assigned into") if is_value(x) else x
        where = self.where()
        value = self.materialize(value, where, "it is assigned into candidate rows") if is_value(value) else value
        self.emit(
            "call_function",
            operator.setitem,
            (node, fmap(index, lambda v: self.materialize(v, where, "") if is_value(v) else v), value),
        )
        return Plain(node, x.meta, self.batched(x))

    # --- replication sites ---------------------------------------------------------------------

    def _mapping_of(self, v):
        return v.mapping if isinstance(v, Plain) else None

    @staticmethod
    def _own_tensor(v, min_dims: int) -> bool:
        """A plain tensor of at least `min_dims` dims, neither derived from candidates nor the mapping."""
        return (
            isinstance(v, Plain)
            and not v.batched
            and v.mapping is None
            and v.spread is None
            and isinstance(v.meta, Meta)
            and v.meta.ndim >= min_dims
        )

    def _user_tensor(self, v):
        """A tensor with one row per user (dim 0 = U), not derived from candidates."""
        return self._own_tensor(v, 1) and (v.meta.shape[0] == self.num_users or v.meta.shape[0] == 1)

    def _sequence_first_user_tensor(self, v, meta):
        """A tensor with one row per user on dim 1 ([L, U, ...], as sequence-first RNNs and attention read it), not
        derived from candidates, whose replication `meta` has the B candidate rows on dim 1."""
        return (
            self._own_tensor(v, 2)
            and v.meta.shape[1] == self.num_users
            and isinstance(meta, Meta)
            and meta.ndim == v.meta.ndim
            and meta.shape[1] == self.num_candidates
        )

    def _indexed_dim(self, index, ndim):
        """(dim, mapping) where `x[index]` indexes one dim by the mapping and takes every other dim whole (x[m],
        x[m, :], x[m, ...], x[:, m], x[:, m, :], x[..., m, :]); (None, None) for any other index."""
        entries = index if isinstance(index, tuple) else (index,)
        at = [i for i, e in enumerate(entries) if self._mapping_of(e)]
        if len(at) != 1 or sum(e is Ellipsis for e in entries) > 1:
            return None, None
        k = at[0]
        if any(not (e is Ellipsis or e == slice(None)) for i, e in enumerate(entries) if i != k):
            return None, None
        dim = ndim - (len(entries) - k) if any(e is Ellipsis for e in entries[:k]) else k
        return dim, self._mapping_of(entries[k])

    def replication_site(self, key, args, kwargs, meta):
        src = args[0] if args else None
        if key is operator.getitem and len(args) == 2 and isinstance(src, Plain) and isinstance(src.meta, Meta):
            dim, mapping = self._indexed_dim(args[1], src.meta.ndim)
            if dim == 0 and self._user_tensor(src):
                return self.new_rep(src, mapping, meta, "x[cand_to_user]")
            if dim == 1 and self._sequence_first_user_tensor(src, meta):
                return self.new_rep(src, mapping, meta, "x[:, cand_to_user] (sequence-first)", row_dim=1)
        if key in (torch.index_select, "index_select") and isinstance(src, Plain) and isinstance(src.meta, Meta):
            dim, index = _norm(_arg(args, kwargs, 1, "dim"), src.meta.ndim), _arg(args, kwargs, 2, "index")
            if dim == 0 and self._user_tensor(src) and self._mapping_of(index):
                return self.new_rep(src, self._mapping_of(index), meta, "index_select(0, cand_to_user)")
            if dim == 1 and self._sequence_first_user_tensor(src, meta) and self._mapping_of(index):
                how = "index_select(1, cand_to_user) (sequence-first)"
                return self.new_rep(src, self._mapping_of(index), meta, how, row_dim=1)
        if key in (torch.gather, "gather", torch.take_along_dim, "take_along_dim") and self._user_tensor(src):
            along = key in (torch.take_along_dim, "take_along_dim")
            dim = _arg(args, kwargs, 2 if along else 1, "dim")
            index = _arg(args, kwargs, 1 if along else 2, "indices" if along else "index")
            if _norm(dim, src.meta.ndim) == 0 and isinstance(index, Plain) and index.spread is not None:
                trailing = index.meta.shape[1:]
                if along:  # take_along_dim broadcasts the index's size-1 dims
                    trailing = tuple(b if a == 1 else a for a, b in zip(trailing, src.meta.shape[1:]))
                if len(trailing) == src.meta.ndim - 1 and all(a <= b for a, b in zip(trailing, src.meta.shape[1:])):
                    user = src.node
                    if trailing != src.meta.shape[1:]:
                        user = self.emit(
                            "call_function", operator.getitem, (user, (slice(None), *map(slice, trailing)))
                        )
                    return self.new_rep(
                        Plain(user, meta), index.spread, meta, f"{_name(key)} with an index spread from cand_to_user"
                    )
        if key is F.embedding and self._mapping_of(src) and _arg(args, kwargs, 3, "max_norm") is None:
            weight = _arg(args, kwargs, 1, "weight")  # (max_norm renormalizes the rows it reads, in place)
            if self._user_tensor(weight) and weight.meta.shape[0] == self.num_users:
                return self.new_rep(weight, self._mapping_of(src), meta, "embedding(cand_to_user, user rows)")
        if key in (torch.repeat_interleave, "repeat_interleave") and len(args) >= 2 and self._user_tensor(src):
            repeats, dim = args[1], _arg(args, kwargs, 2, "dim")
            if dim == 0 and not (isinstance(repeats, Plain) and repeats.batched):
                mkey = ("repeat_interleave", id(repeats) if is_value(repeats) else repeats)
                if mkey not in self.mappings:
                    node = self.emit(
                        "call_function", ops.repeat_mapping, (src.node, repeats.node if is_value(repeats) else repeats)
                    )
                    self.mappings[mkey] = Mapping(mkey, node, f"repeat_interleave at {self.where()}")
                return self.new_rep(src, self.mappings[mkey], meta, "repeat_interleave(counts, dim=0)")
        one_row = key in ("expand", "repeat", "expand_as") and self._user_tensor(src) and src.meta.shape[0] == 1
        if one_row and not any(isinstance(a, RepShape) for a in args[1:]):
            return self.one_row(key, args, meta)
        if key in MATMULS and len(args) == 2 and self._user_tensor(args[1]) and args[1].meta.ndim == 2:
            mapping = self._selection_of(src)
            if mapping is not None and args[1].meta.shape[0] == self.num_users:
                return self.new_rep(args[1], mapping, meta, "one-hot selection matrix of cand_to_user @ x")
        if key is torch.einsum and len(args) == 3 and isinstance(args[0], str):
            return self._einsum_selection(args[0], args[1:], meta)
        return None

    def _einsum_selection(self, equation: str, operands, meta):
        """einsum("bu,ud->bd", S, x) (either order, "bu,u...->b...", any letters) with S [B, U] the one-hot selection
        matrix of the mapping and x a user tensor [U, ...]: x replicated."""
        inputs, _, out = equation.replace(" ", "").partition("->")
        terms = inputs.split(",")
        if not out or len(terms) != 2:
            return None
        for sel, x, (ts, tx) in ((operands[0], operands[1], terms), (operands[1], operands[0], terms[::-1])):
            letters = ts + tx.replace("...", "")
            if (
                len(ts) != 2
                or not tx.startswith(ts[1])
                or out != ts[0] + tx[1:]
                or len(set(letters)) != len(letters) - 1
            ):
                continue
            if self._user_tensor(x) and x.meta.shape[0] == self.num_users and (mapping := self._selection_of(sel)):
                return self.new_rep(x, mapping, meta, "einsum of the one-hot selection matrix of cand_to_user and x")
        return None

    def _selection_of(self, v):
        """The input mapping m whose one-hot selection matrix v [B, U] is (F.one_hot(m, U), eye(U)[m], m[:, None] ==
        arange(U), in any dtype): v computed from m and constants alone (no other input's values), and on the
        example 1 at (b, m[b]) and 0 elsewhere."""
        if not (isinstance(v, Plain) and v.batched and isinstance(v.meta, Meta) and v.meta.ndim == 2):
            return None
        if v.meta.shape != (self.num_candidates, self.num_users) or not isinstance(v.node, fx.Node):
            return None
        value = self.values.get(v.node)
        if not isinstance(value, torch.Tensor):
            return None
        seen, stack, found = set(), [v.node], set()
        while stack:  # v's inputs: the mapping and constants only (sizes of other inputs aside)
            node = stack.pop()
            if node in self.input_mappings:
                found.add(node)
                continue
            if node.op == "placeholder":
                return None  # other data (a per-candidate mask would scale the selection on other inputs)
            if node.target is getattr and node.args[1] in METADATA or node.target in ("size", "dim"):
                continue  # x.shape, x.dtype, x.device: metadata
            parents = node.all_input_nodes
            if node.op == "call_method" and node.target in ("to", "type_as") and isinstance(node.args[0], fx.Node):
                parents = [node.args[0]]  # `.to(x)`, `.type_as(x)`: x's dtype and device only
            for parent in parents:
                if parent not in seen:
                    seen.add(parent)
                    stack.append(parent)
        if len(found) != 1:
            return None
        (node,) = found
        m = self.values[node].long()
        expected = F.one_hot(m.clamp(0, self.num_users - 1), self.num_users).to(value.dtype)
        ok = bool(((m >= 0) & (m < self.num_users)).all()) and torch.equal(value, expected)
        return self.input_mappings[node] if ok else None

    def one_row(self, key, args, meta):
        """x.expand(B, ...) / x.repeat(B, ...) / x.expand_as(cand) of one user row: every candidate gets it."""
        if not (isinstance(meta, Meta) and meta.shape[0] == self.num_candidates and self.num_candidates != 1):
            return None
        src = args[0]
        if not (isinstance(src, Plain) and isinstance(src.meta, Meta) and src.meta.ndim and src.meta.shape[0] == 1):
            return None

        def one_row_each_call():  # one row on the example; each call checks (a user tensor when U = 1 is not)
            shape = self.emit("call_function", getattr, (src.node, "shape"))
            self.emit("call_function", ops.check_widths, ([shape], 0, [1]))

        if key == "expand_as":
            rows, rest = args[1], [-1] * (src.meta.ndim - 1)
            if not (isinstance(rows, Plain) and rows.batched and rows.meta.ndim == src.meta.ndim):
                return None
            rows_b = self.emit(
                "call_function", operator.getitem, (self.emit("call_function", getattr, (rows.node, "shape")), 0)
            )
            rest = list(meta.shape[1:])
        else:
            sizes = _sizes(args)
            if key == "repeat" and (len(sizes) != src.meta.ndim or any(s != 1 for s in sizes[1:])):
                return None
            if len(sizes) == 1 and isinstance(sizes[0], Plain) and isinstance(sizes[0].meta, tuple):  # expand(x.size())
                shape = self.materialize(sizes[0], self.where(), "")
                sizes = [self.emit("call_function", operator.getitem, (shape, i)) for i in range(len(meta.shape))]
                sizes = [Plain(n, meta.shape[i], batched=i == 0) for i, n in enumerate(sizes)]
            rows, rest = sizes[0], sizes[1:]
            if isinstance(rows, Rows):  # the row count of a Rep: a constant row of that mapping
                one_row_each_call()
                sizes = [self.user_side(s) if is_value(s) else s for s in rest]
                user = self.emit("call_method", key, (src.node, rows.user_rows, *sizes))
                return Rep(user, rows.mapping, meta, f"{self.where()} (one row for every user)")
            rows_b = self.materialize(rows, self.where(), "") if is_value(rows) else rows
        one_row_each_call()
        mkey = ("expand", id(rows) if is_value(rows) else rows)
        if mkey not in self.mappings:
            node = self.emit("call_function", ops.expand_mapping, (rows_b, src.node))
            self.mappings[mkey] = Mapping(mkey, node, f"expand at {self.where()}")
        if key == "repeat":  # repeat(B, 1, …): the row itself
            user = src.node
        else:
            user = self.emit(
                "call_method", "expand", (src.node, 1, *[self.user_side(s) if is_value(s) else s for s in rest])
            )
        self.report.rewritten.append(f"{self.where()}: {key} of a single user row to B rows kept virtual")
        return Rep(user, self.mappings[mkey], meta, f"{self.where()} ({key} of one user row)")

    def new_rep(self, src, mapping, meta, how, row_dim=0):
        self.report.rewritten.append(f"{self.where()}: replication {how} kept virtual (user rows stay at U)")
        return Rep(src.node, mapping, meta, self.where(), row_dim=row_dim)

    @staticmethod
    def _keeps_rows(index, ndim: int) -> bool:
        """Whether `x[index]` of an `ndim`-dim x takes every row of dim 0 in order, whatever the row count: no tensor
        in the index, and dim 0 under an Ellipsis or a whole slice (`:`, `0::1`)."""
        entries = index if isinstance(index, tuple) else (index,)
        if any(isinstance(v, torch.Tensor) or is_value(v) and isinstance(v.meta, Meta) for v in leaves(entries)):
            return False
        taking = [e for e in entries if e is not None and e is not Ellipsis]  # entries that index a dim
        for i, e in enumerate(entries):
            if e is Ellipsis:
                after = sum(1 for f in entries[i + 1 :] if f is not None and f is not Ellipsis)
                if after < ndim:
                    return True  # the Ellipsis covers dim 0
            elif e is not None:
                return isinstance(e, slice) and e.start in (None, 0) and e.stop is None and e.step in (None, 1)
        return not taking

    def mapping_conversion(self, key, args, kwargs, meta):
        """Conversions of the mapping stay the mapping; view-like ops that spread it along new trailing
        dims (m[:, None].expand(-1, d)) give an index whose every row b holds m[b] (checked on the example)."""
        src = args[0] if args else None
        if not (isinstance(src, Plain) and (src.mapping or src.spread)):
            return None
        unwrap = lambda v: v.node if is_value(v) else v  # noqa: E731
        if any(isinstance(v, USER_FORMS) for v in leaves((args[1:], kwargs))):
            return None
        # m[idx] with a tensor idx, or m[:k], selects or reorders the mapping's rows: where it equals m on the example
        # (an example already sorted by the order idx computes, or with B = k) that is a coincidence of values
        if key is operator.getitem and not self._keeps_rows(args[1], src.meta.ndim):
            return None
        if src.mapping and key in CONVERSIONS:
            node = self.emit("call_method", key, fmap(args, unwrap), fmap(kwargs, unwrap))
            return Plain(node, meta, batched=True, mapping=src.mapping)
        if key in SPREADS or key in CONVERSIONS:
            op = "call_method" if isinstance(key, str) else "call_function"
            node = self.emit(op, key, fmap(args, unwrap), fmap(kwargs, unwrap))
            value, mapping = self.values[node], src.mapping or src.spread
            m = self.values[mapping.node]
            if isinstance(value, torch.Tensor) and not value.is_floating_point() and value.dim() >= 1:
                if value.shape[0] == m.shape[0] and value.dim() >= 1:
                    spread = bool((value == m.view(-1, *[1] * (value.dim() - 1))).all())
                    if value.dim() == 1 and spread:
                        return Plain(node, meta, batched=True, mapping=mapping)
                    return Plain(node, meta, batched=True, spread=mapping if spread else None)
            return Plain(node, meta, batched=self._rows_b(meta))
        return None

    def packing(self, key, args, kwargs, meta):
        """pack_padded_sequence of replicated rows and their replicated lengths packs the user rows (an RNN then runs
        over them at U rows); pad_packed_sequence of such a pack with a fixed total_length pads at U rows (without
        one, the padded length is the longest of the candidates' users, so the pack is repacked at B rows)."""
        if key is nn.utils.rnn.pack_padded_sequence:
            x, lengths = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "lengths")
            batch_first = _arg(args, kwargs, 2, "batch_first", False)
            ok = isinstance(x, Rep) and isinstance(lengths, Rep) and lengths.mapping.key == x.mapping.key
            if not (ok and x.row_dim == (0 if batch_first else 1) and lengths.row_dim == 0):
                return None
            node = self.emit("call_function", ops.pack_user_rows, (x.user, lengths.user, batch_first))
            self.report.rewritten.append(f"{self.where()}: pack_padded_sequence of replicated rows packed at U rows")
            return Packed(node, x.mapping, meta, self.where())
        if key is nn.utils.rnn.pad_packed_sequence and isinstance(args[0] if args else None, Packed):
            packed, total = args[0], _arg(args, kwargs, 3, "total_length")
            batch_first = _arg(args, kwargs, 1, "batch_first", False)
            if total is None or (is_value(total) and not isinstance(total, Plain)):
                return None
            options = {
                "batch_first": batch_first,
                "padding_value": _arg(args, kwargs, 2, "padding_value", 0.0),
                "total_length": total.node if is_value(total) else total,
            }
            node = self.emit("call_function", nn.utils.rnn.pad_packed_sequence, (packed.user,), options)
            padded, lengths = (self.emit("call_function", operator.getitem, (node, i)) for i in (0, 1))
            return Struct(
                (
                    Rep(padded, packed.mapping, meta[0], packed.source, row_dim=0 if batch_first else 1),
                    Rep(lengths, packed.mapping, meta[1], packed.source),
                ),
                meta,
            )
        return None

    def containers(self, key, args, kwargs, meta):
        """x[k] of a tuple / dict input or of a Struct, and a named field of a Struct (`x.median(1).values`)."""
        if key is getattr and len(args) == 2 and isinstance(args[0], Struct) and isinstance(args[1], str):
            produced = self.original.get(self.node.args[0]) if self.node.args else None
            field = getattr(produced, args[1], None)
            at = [i for i, v in enumerate(produced) if v is field] if isinstance(produced, tuple) else []
            return args[0].items[at[0]] if len(at) == 1 else None
        if key is not operator.getitem or len(args) != 2:
            return None
        src, index = args
        if isinstance(src, Struct) and isinstance(index, int):
            return src.items[index]
        if isinstance(src, Struct) and isinstance(index, slice) and isinstance(meta, tuple):
            return Struct(src.items[index], meta)
        if (
            isinstance(src, Plain)
            and src.node.op == "placeholder"
            and isinstance(src.meta, (dict, tuple))
            and isinstance(index, (str, int))
        ):
            node = self.emit("call_function", operator.getitem, (src.node, index))
            if index == self.mapping_name and src.node.op == "placeholder":
                return Plain(node, meta, batched=True, mapping=self._input_mapping(node, index))
            return Plain(node, meta, batched=self._rows_b(meta))
        return None

    # --- shapes of Reps and constant rows ------------------------------------------------------

    def shape_access(self, op, key, args, kwargs, meta):
        x = args[0] if args else None
        if isinstance(x, Concat) and (key is getattr and args[1] == "shape" or key == "size" and len(args) == 1):
            # at B rows: its [0] is a candidate count (`B, F, d = x.shape`)
            shapes = [self._shape_node(p) for p in x.parts]
            return Plain(self.emit("call_function", ops.cat_shape, (shapes, x.dim)), meta, batched=True)
        if isinstance(x, Concat) and key == "size" and len(args) == 2 and isinstance(args[1], int):
            dim = _norm(args[1], x.meta.ndim)  # x.size(d): a part's, or the parts' sum along the concat dim
            if dim is not None and dim != x.dim:
                return self.apply("call_method", "size", (x.parts[0], dim), {}, meta)
            if dim is not None:
                total = None
                for part in x.parts:
                    size = self.apply("call_method", "size", (part, dim), {}, part.meta.shape[dim])
                    total = size if total is None else self.apply("call_function", operator.add, (total, size), {}, 0)
                return Plain(total.node, meta)
        if isinstance(x, Concat) and (key is getattr and args[1] in ("dtype", "device", "ndim")):
            return Plain(self.emit("call_function", getattr, (self._shape_source(x.parts[0]), args[1])), meta)
        if not isinstance(x, Rep) or isinstance(x.meta, tuple):
            return None
        rows_at = x.row_dim
        if key is getattr:
            if args[1] == "shape":
                return RepShape(self.emit("call_function", getattr, (x.user, "shape")), x.mapping, meta)
            if args[1] in ("dtype", "device", "ndim", "is_cuda", "layout"):
                return Plain(self.emit("call_function", getattr, (x.user, args[1])), meta)
        if key == "size":
            dim = _arg(args, kwargs, 1, "dim")
            if dim is None:
                return RepShape(self.emit("call_method", "size", (x.user,)), x.mapping, meta)
            if _norm(dim, x.meta.ndim) is None:
                return None
            node = self.emit("call_method", "size", (x.user, dim))
            return Rows(node, x.mapping, meta) if _norm(dim, x.meta.ndim) == rows_at else Plain(node, meta)
        if key in ("dim", "ndimension"):
            return Plain(x.meta.ndim, meta)
        return None

    def check_widths(self, parts, dim):
        """ops.check_widths on the parts' shapes along `dim` (Reps: their U-row tensors; joins and nested concats are
        not read for it, nothing is materialized)."""
        shapes, widths = [], []
        for p in parts:
            node = p.user if isinstance(p, Rep) else p.node if isinstance(p, Plain) else None
            if isinstance(node, fx.Node) and isinstance(p.meta, Meta):
                shapes.append(self.emit("call_function", getattr, (node, "shape")))
                widths.append(p.meta.shape[dim])
        if shapes:
            self.emit("call_function", ops.check_widths, (shapes, dim, widths))

    def _check_ones(self, c, dims):
        """Each call checks that the concat's `dims`, of size 1 on the example, are 1 (else the original runs): a
        flatten over them keeps each part one range only then."""
        if dims:
            shape = self._shape_node(c)
            for dim in dims:
                self.emit("call_function", ops.check_widths, ([shape], dim, [1]))

    def _shape_source(self, form):
        return form.user if isinstance(form, Rep) else self.materialize(form, self.where(), "")

    def _shape_node(self, form):
        """The B-row shape of a form, without materializing a user tensor."""
        if isinstance(form, Rep):
            return self.emit(
                "call_function",
                ops.rep_shape,
                (self.emit("call_function", getattr, (form.user, "shape")), form.mapping.node),
            )
        if isinstance(form, Concat):
            return self.emit("call_function", ops.cat_shape, ([self._shape_node(p) for p in form.parts], form.dim))
        return self.emit("call_function", getattr, (self.materialize(form, self.where(), ""), "shape"))

    def constant_rows(self, op, key, args, kwargs, meta):
        """torch.zeros(B_of_a_Rep, d), x.new_zeros(B_of_a_Rep, d) and the like: equal on every row, so made at U rows;
        x.shape[i] of a RepShape."""
        if key is operator.getitem and isinstance(args[0], RepShape) and isinstance(args[1], int):
            x = args[0]
            node = self.emit("call_function", operator.getitem, (x.user_shape, args[1]))
            return Rows(node, x.mapping, meta) if _norm(args[1], len(x.meta)) == 0 else Plain(node, meta)
        if key in FACTORIES:
            sizes = list(args[0]) if args and isinstance(args[0], (tuple, list)) else list(args)
            rest_args = args[1:] if args and isinstance(args[0], (tuple, list)) else ()
            if key is torch.full and not rest_args:
                sizes, rest_args = (list(args[0]), args[1:]) if isinstance(args[0], (tuple, list)) else (sizes, ())
            if sizes and isinstance(sizes[0], Rows) and not any(isinstance(s, USER_FORMS) for s in sizes[1:]):
                size = (sizes[0].user_rows, *[self.user_side(s) if is_value(s) else s for s in sizes[1:]])
                unwrap = lambda v: v.node if isinstance(v, Plain) else v  # noqa: E731
                node = self.emit(
                    "call_function",
                    key,
                    (size, *fmap(rest_args, unwrap)),
                    fmap(kwargs, unwrap),
                )
                return Rep(node, sizes[0].mapping, meta, f"{self.where()} (a constant row)")
        if key in NEW_FACTORIES and args and isinstance(args[0], (Rep, Plain)):
            rest = list(args[1:])
            sizes = list(rest[0]) if rest and isinstance(rest[0], (tuple, list)) else rest
            extra = rest[1:] if rest and isinstance(rest[0], (tuple, list)) else []  # new_full's fill value
            if sizes and isinstance(sizes[0], Rows) and not any(isinstance(s, USER_FORMS) for s in sizes[1:]):
                size = (sizes[0].user_rows, *[self.user_side(s) if is_value(s) else s for s in sizes[1:]])
                unwrap = lambda v: v.node if isinstance(v, Plain) else v  # noqa: E731
                # x only gives dtype and device: its user-row form (or x itself) serves as well
                node = self.emit(
                    "call_method", key, (self.user_side(args[0]), size, *fmap(extra, unwrap)), fmap(kwargs, unwrap)
                )
                return Rep(node, sizes[0].mapping, meta, f"{self.where()} (a constant row)")
            first = sizes[0] if sizes else None
            if (
                key != "new_empty"
                and isinstance(args[0], Rep)
                and isinstance(first, Plain)
                and first.batched
                and type(first.meta) is int
                and isinstance(meta, Meta)
                and not any(
                    is_value(v) and not (isinstance(v, Plain) and not v.batched)
                    for v in leaves((sizes[1:], extra, kwargs))
                )
            ):  # keep.new_ones(B, 1) with B a candidate count: equal rows, the Rep giving dtype and device only
                unwrap = lambda v: v.node if isinstance(v, Plain) else v  # noqa: E731
                user, rest_sizes = args[0].user, fmap(sizes[1:], unwrap)
                like = {a: self.emit("call_function", getattr, (user, a)) for a in ("dtype", "device")}
                factory = {"new_zeros": torch.zeros, "new_ones": torch.ones, "new_full": torch.full}[key]
                node = self.emit(  # made at B rows from nothing but the replica's dtype and device
                    "call_function", factory, ((first.node, *rest_sizes), *fmap(extra, unwrap)),
                    {**like, **fmap(kwargs, unwrap)},
                )  # fmt: skip
                row = self.emit(
                    "call_method", key, (user, (1, *rest_sizes), *fmap(extra, unwrap)), fmap(kwargs, unwrap)
                )
                out = Plain(node, meta, batched=True)
                out.rows_of = Plain(row, to_meta(self.values[row]))
                return out
        if key in ("expand", "repeat") and isinstance(args[0], Plain) and not args[0].batched:
            sizes = _sizes(args)
            src = args[0]
            if key == "expand" and len(sizes) == 1 and isinstance(sizes[0], RepShape) and isinstance(src.meta, Meta):
                if isinstance(meta, Meta) and (
                    src.meta.ndim < meta.ndim or src.meta.shape[0] == 1
                ):  # x.expand(u[m].shape)
                    node = self.emit("call_method", "expand", (src.node, sizes[0].user_shape))
                    return Rep(node, sizes[0].mapping, meta, f"{self.where()} (a constant row)")
            if sizes and isinstance(sizes[0], Rows) and isinstance(src.meta, Meta):
                new_dim = len(sizes) > src.meta.ndim or (src.meta.ndim and src.meta.shape[0] == 1)
                if key == "repeat" and len(sizes) == src.meta.ndim and src.meta.shape[0] != 1:
                    new_dim = False
                if new_dim and not any(isinstance(s, USER_FORMS) for s in sizes[1:]):
                    node = self.emit(
                        "call_method",
                        key,
                        (src.node, sizes[0].user_rows, *[self.user_side(s) if is_value(s) else s for s in sizes[1:]]),
                    )
                    return Rep(node, sizes[0].mapping, meta, f"{self.where()} (a constant row)")
        return None

    def _arange_rows(self, args, kwargs, meta):
        """torch.arange(B) of a candidate row count (x.size(0) of a replica, cand.shape[0]) in an integer dtype."""
        return (
            len(args) == 1
            and self.is_count(args[0])
            and not isinstance(args[0], int)
            and set(kwargs) <= {"device", "dtype"}
            and isinstance(meta, Meta)
            and meta.dtype in (torch.int64, torch.int32)
        )

    def readout(self, op, key, args, kwargs, meta):
        """x[arange(B), j] of a replica x [B, L, ...] (a sequence encoder's output read at each candidate's last
        position, `out[arange(B), lengths[m] - 1]`): with j a replica through the same mapping, x's user rows read at
        j's user rows (`ops.readout_rows`, a replica); with j per candidate ([B] integers), x's user rows read at
        (m, j) (a gather of B rows). Trailing full slices read the rest."""
        if key is not operator.getitem or len(args) != 2 or kwargs or not isinstance(args[1], tuple):
            return None
        x, index = args
        if not (isinstance(x, Rep) and x.row_dim in (0, 1) and isinstance(x.meta, Meta) and x.mapping.heads is None):
            return None
        r = x.row_dim  # sequence-first x [L, B, ...]: x[j, arange(B)], read as x.transpose(0, 1)[arange(B), j]
        if len(index) < 2 or not (isinstance(index[r], Plain) and index[r].row_index):
            return None
        if x.meta.ndim < 2 or any(i != slice(None) for i in index[2:]) or len(index) > x.meta.ndim:
            return None
        j = index[1 - r]
        user = self.emit("call_method", "transpose", (x.user, 0, 1)) if r else x.user
        if not is_value(j) or not isinstance(j.meta, Meta) or j.meta.ndim != 1:
            return None
        if j.meta.dtype not in (torch.int64, torch.int32):
            return None
        if isinstance(j, Rep) and j.row_dim == 0 and j.mapping.key == x.mapping.key and j.mapping.heads is None:
            node = self.emit("call_function", ops.readout_rows, (user, j.user, x.mapping.node))
            self.sunk["readout"] += 1
            return Rep(node, x.mapping, meta, x.source)
        if isinstance(j, Plain) and j.batched and j.mapping is None and j.merged is None and not j.pairs:
            node = self.emit("call_function", ops.readout_at, (user, x.mapping.node, j.node))
            self.report.rewritten.append(
                f"{self.where()}: x[arange(B), j] of a replica read from its user rows at (m, j)"
            )
            return Plain(node, meta, True)
        return None

    # --- ops that move the row dim (sequence-first tensors) ------------------------------------

    def moved_rows(self, op, key, args, kwargs, meta):
        x = args[0] if args else None
        if not isinstance(x, Rep) or not isinstance(x.meta, Meta):
            return None
        if any(isinstance(v, USER_FORMS) or (isinstance(v, Plain) and v.batched) for v in leaves((args[1:], kwargs))):
            return None
        r, nd = x.row_dim, x.meta.ndim
        new = None
        if key in TRANSPOSES:
            d0, d1 = _norm(_arg(args, kwargs, 1, "dim0"), nd), _norm(_arg(args, kwargs, 2, "dim1"), nd)
            if d0 is None or d1 is None:
                return None
            new = d1 if r == d0 else d0 if r == d1 else r
        elif key in ("permute", torch.permute):
            dims = [_norm(d, nd) for d in _sizes(args)]
            if None in dims:
                return None
            new = dims.index(r)
        elif key in ("movedim", torch.movedim, "moveaxis"):
            src, dst = _arg(args, kwargs, 1, "source"), _arg(args, kwargs, 2, "destination")
            if not (isinstance(src, int) and isinstance(dst, int)):
                return None
            order = [d for d in range(nd) if d != _norm(src, nd)]
            order.insert(_norm(dst, nd), _norm(src, nd))
            new = order.index(r)
        elif key in ("unsqueeze", torch.unsqueeze):
            d = _norm(_arg(args, kwargs, 1, "dim"), nd + 1)
            if d is None:
                return None
            new = r + (d <= r)
        elif key in ("squeeze", torch.squeeze) and r != 0:
            d = _norm(_arg(args, kwargs, 1, "dim"), nd)
            if d is None or d == r:
                return None
            new = r - (d < r)
        elif key is operator.getitem and r != 0:
            new = self._row_after_index(args[1], r, nd)
        elif key is getattr and len(args) == 2 and args[1] in ("T", "mT") and nd >= 2:  # dims reversed / last 2 swapped
            new = nd - 1 - r if args[1] == "T" else {nd - 1: nd - 2, nd - 2: nd - 1}.get(r, r)
        elif r != 0 and key in ("contiguous", "clone", "float", "to", "detach", "double", "half", "bfloat16"):
            new = r
        if new is None or (r == 0 and new == 0):
            return None
        u = lambda v: self.user_side(v) if is_value(v) else v  # noqa: E731
        node = self.emit(op, key, fmap(args, u), fmap(kwargs, u))
        return Rep(node, x.mapping, meta, x.source, row_dim=new)

    def sequence_first_elementwise(self, op, key, args, kwargs, meta):
        """An elementwise op of replicas with their rows on dim r ≥ 1 (sequence-first [L, B, …]) and other operands:
        every tensor operand is aligned to the output's dims (leading dims of size 1, as broadcasting does) and its
        dim r moved to the front, the op runs through the rules (row-wise at U rows, or a join with candidate rows),
        and its result's dim 0 is moved back to r. Moving one dim of every operand commutes with an elementwise op."""
        if not (key in ELEMENTWISE_FUNCTIONS or key in ELEMENTWISE_METHODS) or not isinstance(meta, Meta):
            return None
        if _tensors(kwargs) or (isinstance(key, str) and key.endswith("_")):  # in place: the operand's own layout
            return None
        flat = [v for v in leaves(args) if is_value(v)]
        reps = [v for v in flat if isinstance(v, Rep)]
        if not reps or any(not isinstance(v, (Rep, Plain)) or not isinstance(v.meta, Meta) for v in flat):
            return None
        r, nd = reps[0].row_dim, meta.ndim
        if r == 0 or any(v.row_dim != r for v in reps) or len({v.mapping.key for v in reps}) != 1 or r >= nd:
            return None
        if any(v.meta.ndim > nd for v in flat) or any(isinstance(a, (list, tuple)) for a in args):
            return None

        def front(v):  # v aligned to nd dims, its dim r first
            if not is_value(v):
                return v
            for _ in range(nd - v.meta.ndim):
                shape = (1, *v.meta.shape)
                v = self.apply("call_method", "unsqueeze", (v, 0), {}, Meta(shape, v.meta.dtype))
            shape = v.meta.shape
            moved = Meta((shape[r], *shape[:r], *shape[r + 1 :]), v.meta.dtype)
            return self.apply("call_method", "movedim", (v, r, 0), {}, moved)

        moved = [front(a) for a in args]
        if any(isinstance(v, Rep) and v.row_dim for v in moved):
            return None
        shape = meta.shape
        inner = Meta((shape[r], *shape[:r], *shape[r + 1 :]), meta.dtype)
        out = self.apply(op, key, tuple(moved), kwargs, inner)
        if isinstance(out, Sum):  # an add / sub join: joined here (its terms are read moved back, not by a linear)
            out = Plain(self.materialize(out, self.where(), ""), inner, True)
        if not isinstance(out, (Rep, Plain)):
            return None
        return self.apply("call_method", "movedim", (out, 0, r), {}, meta)

    SCANS = {"cumsum", "cumprod", torch.cumsum, torch.cumprod}

    def sequence_first_rowwise(self, op, key, args, kwargs, meta):
        """An op of one replica x with its rows on dim r ≥ 1 (sequence-first [L, B, …], an RNN's [layers, B, d] state)
        and no other candidate operand, that acts on each position of dim r apart: a linear or a layer / RMS norm over
        trailing dims after r, a softmax or a scan along another dim, a reduction over dims without r. It commutes with
        picking rows on dim r, so it runs on x's user rows; the result holds its rows on r, less the reduced dims before
        it (r = 0 then: an ordinary replica)."""
        x = args[0] if args else None
        if not isinstance(x, Rep) or not x.row_dim or not isinstance(x.meta, Meta) or not isinstance(meta, Meta):
            return None
        if any(v is not x and self.batched(v) or isinstance(v, USER_FORMS) for v in leaves((args[1:], kwargs))):
            return None
        if any(v is x for v in leaves((args[1:], kwargs))):
            return None
        r, nd = x.row_dim, x.meta.ndim
        new = None
        if key is F.linear:
            new = r if r < nd - 1 else None
        elif key in (F.layer_norm, getattr(F, "rms_norm", None)):
            new = r if r < nd - _norm_dims(args, kwargs) else None
        elif key in SOFTMAX or key in self.SCANS:
            d = _norm(_arg(args, kwargs, 1, "dim"), nd)
            new = r if d is not None and d != r else None
        elif key in REDUCTIONS or key in REDUCTION_FUNCTIONS:
            spread = key in ("std", "var", torch.std, torch.var)  # (x, dim, unbiased / correction, keepdim)
            at = 2 if key in NORM_REDUCTIONS else 1
            dim, keepdim = _arg(args, kwargs, at, "dim"), _arg(args, kwargs, at + 1, "keepdim", False)
            if spread:
                keepdim = kwargs.get("keepdim", False)
            dims = [_norm(d, nd) for d in (dim if isinstance(dim, (tuple, list)) else [dim])]
            if dim is None or None in dims or r in dims or not isinstance(keepdim, bool):
                return None
            if len(args) > (at + 1 if spread else at + 2) or set(kwargs) - {"dim", "keepdim", "p", "ord", "correction"}:
                return None
            new = r if keepdim else r - sum(d < r for d in set(dims))
        if new is None or new >= meta.ndim or meta.shape[new] != x.meta.shape[r]:
            return None
        u = lambda v: self.user_side(v) if is_value(v) else v  # noqa: E731
        node = self.emit(op, key, fmap(args, u), fmap(kwargs, u))
        self.sunk[_name(key)] += 1
        return Rep(node, x.mapping, meta, x.source, row_dim=new)

    def _row_after_index(self, index, r, nd):
        index = index if isinstance(index, tuple) else (index,)
        p = q = 0
        for i in index:
            if i is None:
                q += 1
            elif isinstance(i, int) and not isinstance(i, bool):
                if p == r:
                    return None
                p += 1
            elif isinstance(i, slice):
                if p == r:
                    return q if i == slice(None) else None
                p, q = p + 1, q + 1
            else:
                return None
        return q + (r - p) if r >= p else None

    # --- modules -------------------------------------------------------------------------------

    def modules(self, target, args, kwargs, meta):
        module = self.fetch(target)
        if isinstance(module, nn.RNNBase):
            return self.rnn(module, target, args, kwargs, meta)
        return self.opaque(module, target, args, kwargs, meta)

    def rnn(self, module, target, args, kwargs, meta):
        """An RNN over replicated sequences runs at U rows: it acts row by row on the batch dim."""
        x = args[0]
        state = args[1] if len(args) > 1 else kwargs.get("hx")
        rows = 0 if module.batch_first else 1
        if not (isinstance(x, Packed) or isinstance(x, Rep) and x.row_dim == rows) or kwargs.keys() - {"hx"}:
            return None
        states = () if state is None else (state.items if isinstance(state, Struct) else (state,))
        if not all(isinstance(s, Rep) and s.row_dim == 1 and s.mapping is x.mapping for s in states):
            return None
        user_state = None if state is None else (tuple(s.user for s in states) if len(states) > 1 else states[0].user)
        node = self.emit("call_module", target, (x.user,) if state is None else (x.user, user_state))
        output = self.emit("call_function", operator.getitem, (node, 0))
        if isinstance(x, Packed):  # a packed output, the rows of the packed input
            out = Packed(output, x.mapping, meta[0], x.source)
        else:
            out = Rep(output, x.mapping, meta[0], x.source, row_dim=rows)
        hidden = self.emit("call_function", operator.getitem, (node, 1))
        if isinstance(module, nn.LSTM):
            h, c = (self.emit("call_function", operator.getitem, (hidden, i)) for i in (0, 1))
            final = Struct(
                (
                    Rep(h, x.mapping, meta[1][0], x.source, row_dim=1),
                    Rep(c, x.mapping, meta[1][1], x.source, row_dim=1),
                ),
                meta[1],
            )
        else:
            final = Rep(hidden, x.mapping, meta[1], x.source, row_dim=1)
        self.sunk[type(module).__name__] += 1
        return Struct((out, final), meta)

    def opaque(self, module, target, args, kwargs, meta):
        """A module kept whole that reads only user rows runs at U rows where it acts row by row on the
        example: module(user)[m] equals module(user[m]); the rows of users without candidates are replaced by rows of
        users with some (`ops.present_rows`), so a branch on its rows' values sees the original's rows."""
        flat = [v for v in leaves((args, kwargs)) if is_value(v)]
        reps = [v for v in flat if isinstance(v, Rep)]
        if not reps or any(self.batched(v) and not isinstance(v, Rep) for v in flat):
            return None
        if len({r.mapping.key for r in reps}) != 1 or any(r.row_dim for r in reps):
            return None
        mapping = reps[0].mapping
        present = {}  # each Rep's user rows as the original's replica holds them (`ops.present_rows`)

        def u(v):
            if isinstance(v, Rep):
                if id(v) not in present:
                    present[id(v)] = self.emit("call_function", ops.present_rows, (v.user, mapping.node))
                return present[id(v)]
            return self.user_side(v) if is_value(v) else v

        node = self.emit("call_module", target, fmap(args, u), fmap(kwargs, u))
        m = self.values[mapping.node].long()
        got, want = tree_flatten(self.values[node])[0], tree_flatten(self.original[self.node])[0]
        ok = len(got) == len(want) and all(isinstance(w, torch.Tensor) for w in want)  # a size beside: maybe U
        for g, w in zip(got, want):
            if isinstance(w, torch.Tensor):
                ok = ok and isinstance(g, torch.Tensor) and g.dim() > 0 and g.shape[0] == self.num_users
                ok = (
                    ok
                    and w.shape[0] == self.num_candidates
                    and torch.allclose(g.index_select(0, m), w, **_row_tolerance(w))
                )
        if not (ok and self._row_wise_on_probes(module, args, kwargs, m)):
            self.graph.erase_node(node)
            return None
        self.report.rewritten.append(
            f"{self.where()}: module {type(module).__name__} kept whole, runs at U rows (row by row on the example)"
        )
        if isinstance(meta, Meta):
            return Rep(node, mapping, meta, reps[0].source)
        if isinstance(meta, tuple):
            items = tuple(
                Rep(self.emit("call_function", operator.getitem, (node, i)), mapping, mi, reps[0].source)
                for i, mi in enumerate(meta)
            )
            return Struct(items, meta)
        return None

    def _row_wise_on_probes(self, module, args, kwargs, m) -> bool:
        """module(x)[m] equals module(x[m]) also where the user rows' float values are scaled by 1e-3 and 1e3 and
        replaced by fresh normal values (a module that branches on its values, `if x.abs().max() > 10: x = x /
        x.norm()`, may act row by row on the example alone), for one candidate and eight times the example's (at least
        4,096: a branch on its batch size, `if x.shape[0] > 64`), with one user holding most candidates (a branch on
        the mean of its rows) and with the users in reverse order (a branch on its first or last row); an error counts
        as not row-wise. Probes sample: a branch none of them crosses is missed."""
        gen = torch.Generator().manual_seed(0)
        values = (
            lambda t: t,
            lambda t: t * 1e-3,
            lambda t: t * 1e3,
            lambda t: torch.randn(t.shape, generator=gen).to(t),
        )
        # and at other candidate counts (one; eight times the example's, at least 4,096): a branch on its row count
        probes = [(v, m) for v in values[1:]] + [(values[0], m[:1]), (values[0], m.repeat(max(8, -(-4096 // len(m)))))]
        # and with one user holding most candidates, its values of one sign and the others' of the other: a branch
        # on a mean or sum of its rows weighs them by their counts, which the U rows do not hold
        skewed = torch.cat([m.new_zeros(4 * len(m)), torch.arange(self.num_users).to(m)])

        def apart(t, sign):
            out = torch.randn(t.shape, generator=gen).to(t).abs() + 1
            out[1:] *= -1
            return out * sign

        probes += [(lambda t, sign=sign: apart(t, sign), skewed) for sign in (1, -1)]
        # and with the users in reverse order (user 0's row first at U rows, last at B rows): a branch on the first or
        # last row reads another user's row at U rows
        flipped = torch.arange(self.num_users - 1, -1, -1).to(m)
        probes += [(lambda t, sign=sign: apart(t, sign), flipped) for sign in (1, -1)]
        for probe, m in probes:
            probed = {}  # each Rep's probe values, the same at U and at B rows

            def value(v, rows, probe=probe, probed=probed):
                if isinstance(v, Rep):
                    if id(v) not in probed:
                        t = self.values[v.user]
                        probed[id(v)] = probe(t) if t.is_floating_point() else t
                    # at U rows as the call runs it: the rows of users without candidates replaced
                    return probed[id(v)].index_select(0, m) if rows else ops.present_rows(probed[id(v)], m)
                return self.values[v.node] if isinstance(v, Plain) and isinstance(v.node, fx.Node) else v

            try:
                with torch.inference_mode():
                    at_u = module(*fmap(args, lambda v: value(v, False)), **fmap(kwargs, lambda v: value(v, False)))
                    at_b = module(*fmap(args, lambda v: value(v, True)), **fmap(kwargs, lambda v: value(v, True)))
            except Exception:
                return False
            for g, w in zip(tree_flatten(at_u)[0], tree_flatten(at_b)[0]):
                if isinstance(w, torch.Tensor) and not (
                    isinstance(g, torch.Tensor)
                    and torch.allclose(g.index_select(0, m), w, equal_nan=True, **_row_tolerance(w))
                ):
                    return False
        return True

    def why_module(self, target):
        return f"module `{target}` reads candidate rows, or does not act row by row on the example"

    # --- sums (add / sub joins kept as terms) --------------------------------------------------

    def sums(self, op, key, args, kwargs, meta):
        flat = leaves((args, kwargs))
        sums = [v for v in flat if isinstance(v, Sum)]
        if not sums:
            return None
        s = sums[0]
        if key is F.linear and args[0] is s and not any(self.batched(v) for v in flat if v is not s):
            weight, bias = _arg(args, kwargs, 1, "weight"), _arg(args, kwargs, 2, "bias")
            return self._sum_map(
                s,
                meta,
                lambda x, with_bias: (
                    F.linear,
                    (x, weight.node, bias.node if with_bias and bias is not None else None),
                ),
            )
        if key in MATMUL and len(args) == 2 and args[0] is s and not self.batched(args[1]) and args[1].meta.ndim == 2:
            return self._sum_map(s, meta, lambda x, with_bias: (torch.matmul, (x, args[1].node)))
        if key in ADD_SUB and len(args) == 2 and not kwargs and all(self.batched(a) for a in args if is_value(a)):
            return self.add_terms(args[0], args[1], ADD_SUB[key], meta)
        if key in (operator.neg, torch.neg, "neg") and len(args) == 1:
            return Sum(self._neg(s.cand), [(u, m, -sign) for u, m, sign in s.users], meta, owned=s.cand is not None)
        # anything else reads the sum whole
        where = self.where()
        whole = lambda v: Plain(self.materialize(v, where, ""), v.meta, True) if isinstance(v, Sum) else v  # noqa: E731
        return self.apply(op, key, fmap(args, whole), fmap(kwargs, whole), meta)

    def _cat_columns(self, nodes):
        """The one node, or several joined along the last dim (the columns a split GEMM reads together)."""
        return nodes[0] if len(nodes) == 1 else self.emit("call_function", torch.cat, (nodes,), {"dim": -1})

    def _neg(self, node):
        return None if node is None else self.emit("call_function", operator.neg, (node,))

    def _sum_map(self, s, meta, fn):
        """A linear map applied to every term of a Sum (the bias once, on the candidate term)."""
        target, cand_args = fn(s.cand, True)
        cand = self.linear_cand(target, cand_args) if s.cand is not None else None
        users = []
        for u, m, sign in s.users:
            t, a = fn(u, cand is None and not users)
            users.append((self.emit("call_function", t, a), m, sign))
        self.sunk[_name(target)] += len(users)
        return Sum(cand, users, meta, owned=cand is not None)

    def linear_cand(self, target, args):
        """target(x, W, ...) on candidate rows; a candidate tensor expanded along a middle dim (a target
        item broadcast over the history) is multiplied before it is expanded."""
        x = args[0]
        if x.op == "call_method" and x.target == "expand" and target in (F.linear, torch.matmul):
            source = self.values[x.args[0]]
            shape = self.values[x].shape
            if source.dim() == len(shape) and source.shape[-1] == shape[-1] and source.shape[0] == shape[0]:
                small = self.emit("call_function", target, (x.args[0], *args[1:]))
                sizes = (
                    list(x.args[1]) if len(x.args) == 2 and isinstance(x.args[1], (tuple, list)) else list(x.args[1:])
                )
                if len(sizes) == 1 and isinstance(sizes[0], fx.Node):  # a shape computed at run time (a Rep's)
                    head = self.emit("call_function", operator.getitem, (sizes[0], slice(None, -1)))
                    return self.emit(
                        "call_method", "expand", (small, self.emit("call_function", operator.add, (head, (-1,))))
                    )
                return self.emit("call_method", "expand", (small, *sizes[:-1], -1))
        return self.emit("call_function", target, args)

    def add_terms(self, a, b, sign, meta):
        """a ± b where either is a Sum, a Rep or candidate rows."""

        def terms(v, s):
            if isinstance(v, Sum):
                if s > 0:
                    v.owned = False  # its candidate term is now shared
                cand = v.cand if s > 0 else self._neg(v.cand)
                return cand, [(u, m, sign_ * s) for u, m, sign_ in v.users]
            if isinstance(v, Rep):
                return None, [(v.user, v.mapping, s)]
            node = self.materialize(v, self.where(), "")
            return (node if s > 0 else self._neg(node)), []

        ca, ua = terms(a, 1.0)
        cb, ub = terms(b, sign)
        fresh = ca is not None and cb is not None
        cand = ca if cb is None else cb if ca is None else self.emit("call_function", operator.add, (ca, cb))
        if any(
            isinstance(u[0], tuple)
            or (isinstance(self.values[u[0]], torch.Tensor) and not self.values[u[0]].is_floating_point())
            for u in ua + ub
        ):
            return None
        return Sum(cand, ua + ub, meta, owned=fresh)

    def join_sum(self, s: Sum):
        """cand + Σ ± user[m] through add_user_rows (user terms of one mapping added at U rows first)."""
        groups: dict = {}
        for u, m, sign in s.users:
            groups.setdefault(m, []).append(u if sign > 0 else self._neg(u))
        self.report.rewritten.append(f"{self.where()}: candidate rows + user rows → add_user_rows")
        return self._join(s.cand, groups, s.meta, owned=s.owned).node

    # --- row-wise ops: run at U rows -----------------------------------------------------------

    def rowwise_ok(self, key, args, kwargs, meta):
        """Does the op act on dim 0 row by row (for the batched arguments)?"""
        if not isinstance(meta, (Meta, tuple)):
            return False
        tensors = _tensors((args, kwargs))
        x = args[0] if args else None
        if key is operator.getitem and isinstance(x, Rep) and isinstance(x.meta, tuple):
            return isinstance(args[1], int)
        if key in (operator.getitem, "__getitem__") and len(args) == 2 and isinstance(args[1], Rep) and not kwargs:
            ids = args[1]  # table[ids]: a lookup, row by row over the ids' rows
            return (
                isinstance(x, Plain)
                and not self.batched(x)
                and not ids.row_dim
                and isinstance(ids.meta, Meta)
                and not ids.meta.is_float
                and ids.meta.dtype != torch.bool
            )
        if key in (torch.cat, torch.stack):
            parts, dim = args[0], _arg(args, kwargs, 1, "dim", 0)
            ndim = parts[0].meta.ndim + (key is torch.stack) if parts and is_value(parts[0]) else 0
            return (
                all(isinstance(p, Rep) for p in parts)
                and len({p.mapping.key for p in parts}) == 1
                and _off_rows(dim, ndim)
            )
        xnd = x.meta.ndim if is_value(x) and isinstance(x.meta, Meta) else None
        if key in (torch.searchsorted, "searchsorted"):  # a constant sorted sequence, batched values
            values = _arg(args, kwargs, 1, "input")
            return (
                is_value(x) and not self.batched(x) and x.meta.ndim == 1 and is_value(values) and self.batched(values)
            )
        if key in ELEMENTWISE_FUNCTIONS or key in ELEMENTWISE_METHODS or key in LIKE_FACTORIES or self.pointwise(key):
            if not isinstance(meta, Meta) or meta.ndim == 0:
                return False
            if key in (F.dropout,) and _arg(args, kwargs, 2, "training", True):
                return False
            for t in tensors:
                if self.batched(t):
                    if t.meta.ndim != meta.ndim:
                        return False
                elif not (t.meta.ndim < meta.ndim or t.meta.shape[0] == 1):
                    return False
            return True
        if key in MATMUL and len(args) == 2 and is_value(args[1]) and self.batched(args[1]) and not self.batched(x):
            return is_value(x) and x.meta.ndim <= 2 and args[1].meta.ndim >= 3
        if key is torch.einsum:
            return self._einsum_rowwise(args)
        if xnd is None or not self.batched(x) or xnd == 0:
            return False
        others_plain = all(not self.batched(t) for t in tensors if t is not x)
        if key in SOFTMAX:
            return others_plain and _off_rows(_arg(args, kwargs, 1, "dim"), xnd)
        if key in REDUCTIONS or key in REDUCTION_FUNCTIONS or key in ("max", "min", torch.max, torch.min):
            dim = _arg(args, kwargs, 2 if key in NORM_REDUCTIONS else 1, "dim")
            dims = dim if isinstance(dim, (tuple, list)) else [dim]
            return dim is not None and all(_off_rows(d, xnd) for d in dims)
        if key in self.SCANS or key in (F.normalize, F.glu, "flip", torch.flip, "roll", torch.roll):
            dim = _arg(args, kwargs, 1, "dim", {F.normalize: 1, F.glu: -1}.get(key))
            if key in ("roll", torch.roll):
                dim = _arg(args, kwargs, 2, "dims")
            dims = dim if isinstance(dim, (tuple, list)) else [dim]
            return all(_off_rows(d, xnd) for d in dims)
        if key in FFTS:  # a transform along dims other than the rows: row by row
            dims = fft_dims(key, args, kwargs, xnd)
            return others_plain and dims is not None and 0 not in dims
        if _name(key) in DIM_OPS:
            at, default = DIM_OPS[_name(key)]
            dim = kwargs.get("dim", default) if at is None else _arg(args, kwargs, at, "dim", default)
            return others_plain and dim is not None and _off_rows(dim, xnd)
        if key in ("renorm", torch.renorm):  # each slice along `dim` renormalized: along the rows, one row each
            return others_plain and _norm(_arg(args, kwargs, 2, "dim"), xnd) == 0
        if key in ("index_fill", torch.index_fill):
            return others_plain and _off_rows(_arg(args, kwargs, 1, "dim"), xnd)
        if key in (torch.bucketize, "bucketize"):  # constant boundaries
            return others_plain
        if key is F.interpolate:
            return others_plain and xnd >= 3
        if key in PER_SAMPLE:
            return others_plain and xnd == PER_SAMPLE[key]
        if key in ("topk", torch.topk, "sort", torch.sort, "argsort", torch.argsort):
            default = -1
            dim = _arg(args, kwargs, 2 if key in ("topk", torch.topk) else 1, "dim", default)
            return others_plain and _off_rows(dim, xnd)
        if key in ("gather", torch.gather, "take_along_dim", torch.take_along_dim):
            along = key in ("take_along_dim", torch.take_along_dim)
            dim = _arg(args, kwargs, 2 if along else 1, "dim")
            return _off_rows(dim, xnd) and all(isinstance(t, Rep) or not self.batched(t) for t in tensors)
        if key in ("flatten", torch.flatten):
            return _off_rows(_arg(args, kwargs, 1, "start_dim", 0), xnd)
        if key in ("unflatten", torch.unflatten):
            return _off_rows(_arg(args, kwargs, 1, "dim"), xnd)
        if key in ("unsqueeze", torch.unsqueeze):
            return _off_rows(_arg(args, kwargs, 1, "dim"), xnd + 1)
        if key in ("squeeze", torch.squeeze):
            dim = _arg(args, kwargs, 1, "dim")
            return all(_off_rows(d, xnd) for d in (dim if isinstance(dim, (tuple, list)) else [dim]))
        if key in TRANSPOSES:
            return _off_rows(_arg(args, kwargs, 1, "dim0"), xnd) and _off_rows(_arg(args, kwargs, 2, "dim1"), xnd)
        if key in ("permute", torch.permute):
            dims = _sizes(args)
            return bool(dims) and _norm(dims[0], xnd) == 0 and all(_norm(d, xnd) is not None for d in dims)
        if key in ("chunk", torch.chunk, "split", torch.split, "unbind", torch.unbind, "tensor_split"):
            dim = _arg(args, kwargs, 1 if key in ("unbind", torch.unbind) else 2, "dim", 0)
            return _off_rows(dim, xnd)
        if key in ("tril", "triu", torch.tril, torch.triu):
            return xnd >= 3
        if key is F.pad:
            return others_plain and len(_arg(args, kwargs, 1, "pad")) // 2 < xnd
        if key in ("view", "reshape", torch.reshape):
            sizes = _sizes(args)
            if not sizes or not isinstance(meta, Meta) or meta.shape[0] != x.meta.shape[0]:
                return False
            if any(isinstance(s, Rows) for s in sizes[1:]) or any(
                isinstance(s, Plain) and s.batched for s in sizes[1:]
            ):
                return False
            return self.is_count(sizes[0])
        if key == "expand":
            sizes = _sizes(args)
            if len(sizes) == 1 and isinstance(sizes[0], RepShape):  # x.expand_as(u[m]): the U-row shape of u
                return isinstance(x, Rep) and x.row_dim == 0 and len(sizes[0].meta) >= xnd
            return bool(sizes) and self.is_count(sizes[0]) and not any(isinstance(s, Rows) for s in sizes[1:])
        if key == "repeat":
            sizes = _sizes(args)
            return len(sizes) == xnd and sizes[0] == 1
        if key is operator.getitem:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(is_value(i) for i in index) or not index:
                return False
            if index[0] is Ellipsis:  # x[..., i]: dims from the end, dim 0 kept
                return index.count(Ellipsis) == 1 and sum(i is not None for i in index[1:]) < xnd
            return isinstance(index[0], slice) and index[0] == slice(None)
        if key is F.linear:
            return others_plain and xnd >= 2
        if key in (F.layer_norm, getattr(F, "rms_norm", None), F.group_norm):
            return others_plain and _norm_dims(args, kwargs) < xnd
        if key is F.batch_norm:
            return others_plain and not _arg(args, kwargs, 5, "training", False) and xnd >= 2
        if key is F.prelu:
            return others_plain
        # max_norm renormalizes, in place, the table rows the ids read: at U rows also those of users without
        # candidates, which the original leaves as they are
        if key is F.embedding:
            return not self.batched(_arg(args, kwargs, 1, "weight")) and _arg(args, kwargs, 3, "max_norm") is None
        if key is F.embedding_bag:  # per_sample_weights, if any, replicated with the ids
            weights = _arg(args, kwargs, 8, "per_sample_weights")
            others = [t for t in tensors if t is not x and t is not weights]
            return (
                xnd == 2 and _arg(args, kwargs, 2, "offsets") is None and _arg(args, kwargs, 3, "max_norm") is None
                and not any(self.batched(t) for t in others)
                and (weights is None or isinstance(weights, Rep) or not self.batched(weights))
            )  # fmt: skip
        if key in MATMUL:
            a, b = args[0], args[1]
            if self.batched(a) and self.batched(b):
                return a.meta.ndim == b.meta.ndim >= 3
            if self.batched(a):
                return a.meta.ndim >= 2 and b.meta.ndim <= 2
            return False
        if key is SDPA:
            q, k, v = args[:3]
            mask = _arg(args, kwargs, 3, "attn_mask")
            return all(self.batched(t) and t.meta.ndim == 4 for t in (q, k, v)) and (
                mask is None
                or (self.batched(mask) and mask.meta.ndim == 4)
                or (not self.batched(mask) and mask.meta.ndim < 4)
            )
        return False

    def _einsum_rowwise(self, args):
        """einsum whose batched operands and output all start with the same (row) index, which no
        unbatched operand uses."""
        equation, operands = args[0], args[1:]
        if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
            operands = tuple(operands[0])
        if not isinstance(equation, str) or "..." in equation or "->" not in equation:
            return False
        inputs, output = equation.replace(" ", "").split("->")
        inputs = inputs.split(",")
        if len(inputs) != len(operands) or not output:
            return False
        row = output[0]
        for spec, v in zip(inputs, operands):
            if self.batched(v) != (spec[:1] == row) or (not self.batched(v) and row in spec):
                return False
        return True

    def is_count(self, size):
        """A view size that is the row count B (or -1 there)."""
        return (
            isinstance(size, Rows)
            or size == -1
            or (isinstance(size, Plain) and size.batched and type(size.meta) is int)
        )

    def batched(self, v):
        return isinstance(v, (Rep, Concat, Sum)) or (
            isinstance(v, Plain) and (v.batched or v.mapping is not None or v.merged is not None)
        )

    def rowwise(self, op, key, args, kwargs, meta):
        args, kwargs = self.constant_rows_beside(args, kwargs)
        if key is torch.cat or key is torch.stack:
            if not all(isinstance(p, Rep) for p in args[0]):
                return None
        if key not in SIZE_OPS:  # a row count used as a number (x * x.shape[0], a fill value) is B, as in the original
            as_value = lambda v: (  # noqa: E731
                Plain(self.materialize(v, self.where(), "a row count used as a value"), v.meta)
                if isinstance(v, (Rows, RepShape)) else v
            )  # fmt: skip
            args, kwargs = fmap(args, as_value), fmap(kwargs, as_value)
        flat = leaves((args, kwargs))
        reps = [v for v in flat if isinstance(v, (Rep, Rows, RepShape))]
        batched_plain = [
            v
            for v in flat
            if isinstance(v, (Plain, Concat, Sum, Struct)) and self.batched(v) and isinstance(v.meta, Meta)
        ]
        if (
            batched_plain
            or len({r.mapping.key for r in reps}) != 1
            or any(isinstance(r, Rep) and r.row_dim for r in reps)
        ):
            return None
        if not self.rowwise_ok(key, args, kwargs, meta):
            return None
        if key in ("view", "reshape", torch.reshape, "expand") and isinstance(
            args[1] if len(args) == 2 else None, (tuple, list)
        ):
            args = (args[0], *args[1])
        if key in ("view", "reshape", torch.reshape, "expand") and isinstance(
            args[1], Plain
        ):  # B from a candidate tensor
            rows = self.emit(
                "call_function", operator.getitem, (self.emit("call_function", getattr, (args[0].user, "shape")), 0)
            )
            args = (args[0], rows, *args[2:])
        u = lambda v: self.user_side(v) if is_value(v) else v  # noqa: E731
        inferred = key in ("view", "reshape", torch.reshape) and len(args) > 1 and args[1] == -1
        if key is torch.reshape:  # the function takes its sizes as one tuple
            args = (args[0], tuple(args[1:]))
        node = self.emit(op, key, fmap(args, u), fmap(kwargs, u))
        if inferred:
            shapes = [self.emit("call_function", getattr, (n, "shape")) for n in (node, u(args[0]))]
            self.emit("call_function", ops.check_same_rows, tuple(shapes))
        rep = next(r for r in reps if isinstance(r, (Rep, Rows, RepShape)))
        source = next((r.source for r in reps if isinstance(r, Rep)), "")
        if key is SDPA:
            self.report.rewritten.append(
                f"{self.where()}: attention with replicated q, k, v runs at U rows (self-attention per user)"
            )
        elif isinstance(meta, Meta) and meta.ndim or isinstance(meta, tuple):
            self.sunk[_name(key)] += 1
        if (
            isinstance(meta, tuple)
            and key not in (torch.cat, torch.stack)
            and not isinstance(self.values[node], torch.Tensor)
        ):
            items = tuple(
                Rep(self.emit("call_function", operator.getitem, (node, i)), rep.mapping, mi, source)
                for i, mi in enumerate(meta)
            )
            return Struct(items, meta)
        return Rep(node, rep.mapping, meta, source)

    # --- rows merged with heads: [B, h, …] as [B·h, …] (attention heads moved into the row dim) ------------------

    MERGES = {"view", "reshape", torch.reshape, "flatten", torch.flatten}

    @staticmethod
    def _row_reduction_dims(key, args, kwargs, nd):
        """(dims, keepdim) of a reduction in ROW_REDUCTIONS when dim 0 is among its dims (none given, `()` or
        `None`: every dim); None otherwise or where it takes other arguments (a dtype)."""
        if key in ("max", "min", torch.max, torch.min):
            return (tuple(range(nd)), False) if len(args) == 1 and not kwargs else None
        if set(kwargs) - {"dim", "keepdim"} or len(args) > 3:
            return None
        dim, keepdim = _arg(args, kwargs, 1, "dim"), _arg(args, kwargs, 2, "keepdim", False)
        if dim is None or dim == () or dim == []:
            if ROW_REDUCTIONS[key] == "logsumexp":
                return None
            dims = list(range(nd))
        else:
            dims = [_norm(d, nd) for d in (dim if isinstance(dim, (tuple, list)) else [dim])]
        if None in dims or 0 not in dims or not isinstance(keepdim, bool):
            return None
        return tuple(sorted(set(dims))), keepdim

    def rows_reduction(self, op, key, args, kwargs, meta):
        """A reduction over the rows of a replica (`u[m].sum(0)`, `.mean(0)`, `.amax(0)`, `.sum()`, ...): computed from
        the user rows weighted by their candidate counts (`ops.reduce_rows`), the replica never made."""
        if key not in ROW_REDUCTIONS or not args or not isinstance(meta, Meta):
            return None
        x = args[0]
        if not (isinstance(x, Rep) and not x.row_dim and isinstance(x.meta, Meta) and x.meta.ndim):
            return None
        if any(is_value(v) for v in leaves((args[1:], kwargs))):
            return None
        parsed = self._row_reduction_dims(key, args, kwargs, x.meta.ndim)
        if parsed is None:
            return None
        dims, keepdim = parsed
        kind = ROW_REDUCTIONS[key]
        node = self.emit("call_function", ops.reduce_rows, (kind, x.user, x.mapping.node, dims, keepdim))
        if to_meta(self.values[node]) != meta:
            return None  # another dtype than the original's (a mean of integers raises there)
        self.report.rewritten.append(
            f"{self.where()}: {_name(key)} over the rows of {x.source} → reduce_rows (each user row weighted by its "
            "candidate count, at U rows)"
        )
        return Plain(node, meta)

    def candidate_rows(self, node, meta, mapping):
        """The form of a join's result: candidate rows, or candidate rows merged with heads as the mapping's."""
        if mapping.heads is None:
            return Plain(node, meta, True)
        return Plain(node, meta, merged=mapping.heads)

    def merged_rows_agree(self, flat) -> bool:
        """Where rows merged with heads (a Rep of a merged mapping, candidate rows tagged `merged`) are read, every
        operand with rows has those same rows (one (h, order)), so a join pairs each row with its own user row.
        Else (rows of candidates, another order, a concat or sum) the op runs as written."""
        kinds, rows = set(), set()
        for v in flat:
            if isinstance(v, (Rep, Rows, RepShape, Packed)):
                kinds.add(v.mapping.heads)
                if v.mapping.heads is not None and isinstance(v, Rep) and isinstance(v.meta, Meta) and v.meta.ndim:
                    rows.add(v.meta.shape[0])
            elif isinstance(v, Plain) and v.merged is not None:
                kinds.add(v.merged)
            elif isinstance(v, Plain) and (v.batched or v.mapping is not None or v.spread is not None):
                kinds.add(None)
            elif isinstance(v, (Concat, Sum, Folded, Struct)):
                kinds.add(("other",))
        if all(k is None or k == ("other",) for k in kinds):
            return True
        unknown = any(  # tensors at the merged row count that are no candidate rows the pass knows the order of
            isinstance(v, Plain)
            and v.merged is None
            and isinstance(v.meta, Meta)
            and v.meta.ndim
            and v.meta.shape[0] in rows
            for v in flat
        )
        return len(kinds) == 1 and not unknown

    def _merged_mapping(self, base, heads, order, heads_node, users_node):
        """The mapping of user rows merged with a dim of `heads` (batch-major: row u·h + j; head-major: j·U + u), from
        `base`; `heads_node` the heads at each call (a traced size or the number)."""
        key = ("merged", base.key, order, heads)
        if key not in self.mappings:
            num_users = None
            if order == "head":
                shape = self.emit("call_function", getattr, (users_node, "shape"))
                num_users = self.emit("call_function", operator.getitem, (shape, 0))
            node = self.emit("call_function", ops.merged_mapping, (base.node, heads_node, num_users))
            name = f"{base.name} merged with {heads} heads ({order}-major)"
            self.mappings[key] = Mapping(key, node, name, heads=(heads, order), base=base)
        return self.mappings[key]

    def _merge_of(self, key, args, kwargs, meta):
        """(h, order, how) where the op merges the rows of args[0] (B rows) with h heads: a view / reshape /
        flatten of [B, h, …] as [B·h, …] ("batch"), repeat_interleave(h, 0) ("batch"), repeat(h, 1, …) ("head"),
        cat of n equal tensors along dim 0 ("head"); how: "view" (sizes checked at each call), or the op."""
        if not isinstance(meta, Meta) or not meta.ndim:
            return None
        if key in (torch.cat, torch.concat) and args:
            seq = args[0]  # a list of tensors, or one value of several (the pieces of a split, as written)
            if isinstance(seq, Plain) and isinstance(seq.meta, tuple):
                metas = list(seq.meta)
            elif isinstance(seq, (list, tuple)) and all(is_value(p) for p in seq):
                metas = [p.meta for p in seq]
            else:
                return None
            dim = _norm(_arg(args, kwargs, 1, "dim", 0), meta.ndim)
            if dim != 0 or len(metas) < 2 or set(kwargs) - {"dim"}:
                return None
            if (
                not all(isinstance(m, Meta) and m == metas[0] for m in metas)
                or meta.shape[0] != len(metas) * metas[0].shape[0]
            ):
                return None
            return len(metas), "head", "cat"
        x = args[0] if args else None
        if not (is_value(x) and isinstance(x.meta, Meta) and x.meta.ndim >= 2):
            return None
        shape = x.meta.shape
        if key in self.MERGES:
            if shape[1] < 2 or meta.shape[0] != shape[0] * shape[1] or meta.shape[1:] != shape[2:]:
                return None
            if key in ("flatten", torch.flatten):
                start, end = _arg(args, kwargs, 1, "start_dim", 0), _arg(args, kwargs, 2, "end_dim", -1)
                if set(kwargs) - {"start_dim", "end_dim"} or _norm(start, x.meta.ndim) != 0:
                    return None
                return (shape[1], "batch", "flatten") if _norm(end, x.meta.ndim) == 1 else None
            sizes = _sizes(args)
            if kwargs or len(sizes) != meta.ndim or (isinstance(sizes[0], int) and sizes[0] != -1):
                return None  # a row count written as a number holds for the example only
            if not all(type(s) is int or isinstance(s, Plain) and not self.batched(s) for s in sizes):
                return None
            return shape[1], "batch", "view"
        if key in ("repeat_interleave", torch.repeat_interleave):
            repeats, dim = _arg(args, kwargs, 1, "repeats"), _arg(args, kwargs, 2, "dim")
            if type(repeats) is int and repeats > 1 and _norm(dim, x.meta.ndim) == 0 and set(kwargs) <= {"dim"}:
                return repeats, "batch", "repeat_interleave"
        if key == "repeat":
            sizes = _sizes(args)
            if len(sizes) == x.meta.ndim and type(sizes[0]) is int and sizes[0] > 1 and all(s == 1 for s in sizes[1:]):
                return sizes[0], "head", "repeat"
        return None

    def _check_merge(self, x, key, args):
        """Each call: the view merges x's first two dims, as on the example."""
        unwrap = lambda v: v.node if is_value(v) else v  # noqa: E731
        shape = self._shape_node(x) if isinstance(x, Rep) else self.emit("call_function", getattr, (x.node, "shape"))
        self.emit("call_function", ops.check_fold, (shape, 2, [unwrap(v) for v in _sizes(args)]))

    def merged_tag(self, op, key, args, kwargs, meta):
        """(h, order) of a candidate-row result whose rows are candidates' rows merged with h heads, or None: a
        merge of candidate rows (`_merge_of`), or an op row by row over operands all merged alike."""
        flat = [v for v in leaves((args, kwargs)) if is_value(v)]
        if any(isinstance(v, USER_FORMS) for v in flat) or op not in ("call_function", "call_method"):
            return None
        candidates = lambda v: isinstance(v, Plain) and v.batched and v.mapping is None and v.merged is None  # noqa: E731
        merge = self._merge_of(key, args, kwargs, meta)
        x = args[0] if args else None
        if merge is not None:
            parts = list(x) if merge[2] == "cat" and isinstance(x, (list, tuple)) else [x]
            if not all(candidates(p) for p in parts):
                return None
            if merge[2] == "view":
                self._check_merge(x, key, args)
            return merge[:2]
        tags = {v.merged for v in flat if isinstance(v, Plain) and v.merged is not None}
        tagged = [v for v in flat if isinstance(v, Plain) and v.merged is not None]
        if len(tags) != 1 or any(self.batched(v) and v.merged is None for v in flat):
            return None
        if meta.shape[0] != tagged[0].meta.shape[0] or not self.rowwise_ok(key, args, kwargs, meta):
            return None
        return tags.pop()

    def merged_rep(self, op, key, args, kwargs, meta):
        """A merge of replicated rows with h heads (`_merge_of`): a Rep of the user rows merged alike ([U·h, …]),
        through the mapping `_merged_mapping` derives, so what reads it runs at U·h rows and its products with
        candidate rows merged alike are joins."""
        merge = self._merge_of(key, args, kwargs, meta)
        if merge is None:
            return None
        heads, order, how = merge
        x = args[0]
        if how == "cat" and not isinstance(x, (list, tuple)):
            return None
        parts = list(x) if how == "cat" else [x]
        rep = lambda p: (  # noqa: E731
            isinstance(p, Rep) and not p.row_dim and isinstance(p.meta, Meta) and p.mapping.heads is None
        )
        if not all(rep(p) for p in parts) or len({p.mapping.key for p in parts}) != 1:
            return None
        first = parts[0]
        heads_node = heads
        if how == "cat":
            user = self.emit("call_function", torch.cat, ([p.user for p in parts],), {"dim": 0})
        elif how == "repeat_interleave":
            user = self.emit("call_method", "repeat_interleave", (first.user, heads), {"dim": 0})
        elif how == "repeat":
            user = self.emit("call_method", "repeat", (first.user, *_sizes(args)))
        else:
            if how == "view":
                self._check_merge(first, key, args)
            heads_node = self.emit(
                "call_function", operator.getitem, (self.emit("call_function", getattr, (first.user, "shape")), 1)
            )
            user = self.emit("call_method", "flatten", (first.user, 0, 1))
        mapping = self._merged_mapping(first.mapping, heads, order, heads_node, first.user)
        self.report.rewritten.append(
            f"{self.where()}: {_name(key)} merging replicated rows with {heads} heads ({order}-major) kept at U·h rows"
        )
        return Rep(user, mapping, meta, first.source)

    SPLITS = {"view", "reshape", torch.reshape, "unflatten", torch.unflatten}

    def split_merged(self, key, args, kwargs, meta):
        """The merge undone: a view / reshape / unflatten(0, …) of replicated rows merged batch-major with h (a
        history's positions flattened, `x.reshape(-1, D)` of x = hist[m] [B, L, D]) as [B, …] (`.view(B, L, D)`,
        `.view(-1, L, D)`, `.reshape(x.shape)`, `.unflatten(0, (-1, L))`, `.view(B, L, H, d)`, `.view(B, -1)`): each
        candidate's h rows are its user's, so the result is the Rep of the user rows viewed alike ([U, …]) through the
        mapping the merge was derived from. Each call checks the view groups the rows by B (`ops.split_merged`);
        else the original runs."""
        if key not in self.SPLITS or not args:
            return None
        x = args[0]
        if not (isinstance(x, Rep) and not x.row_dim and isinstance(x.meta, Meta) and x.meta.ndim >= 1):
            return None
        mapping = x.mapping
        if mapping.heads is None or mapping.heads[1] != "batch" or mapping.base is None:
            return None
        heads, base = mapping.heads[0], mapping.base
        if not (isinstance(meta, Meta) and meta.ndim >= 2 and meta.shape[0] == self.num_candidates):
            return None
        if math.prod(meta.shape[1:]) != heads * math.prod(x.meta.shape[1:]):
            return None
        rest = key in ("unflatten", torch.unflatten)  # unflatten(0, sizes) keeps the other dims
        if rest:
            dim, sizes = _arg(args, kwargs, 1, "dim"), _arg(args, kwargs, 2, "sizes")
            if set(kwargs) - {"dim", "sizes"} or _norm(dim, x.meta.ndim) != 0 or not isinstance(sizes, (tuple, list)):
                return None
            sizes = list(sizes)
        elif kwargs:
            return None
        else:
            sizes = _sizes(args)
        if len(sizes) == 1 and isinstance(sizes[0], RepShape):  # x.reshape(r.shape) of r = hist[m]: [B, L, …]
            if sizes[0].mapping is not base or rest:
                return None
            sizes = sizes[0].user_shape  # its row count U is taken for B at each call
        else:
            for i, s in enumerate(sizes):
                if isinstance(s, Rows) and i == 0 and s.mapping is base:
                    sizes[i] = None  # B at each call
                elif is_value(s) and not (isinstance(s, Plain) and not self.batched(s) and s.merged is None):
                    return None
                elif is_value(s):
                    sizes[i] = s.node
            if len(sizes) + (x.meta.ndim - 1 if rest else 0) != meta.ndim:
                return None
        user_shape = self.emit("call_function", getattr, (x.user, "shape"))
        user_sizes = self.emit("call_function", ops.split_merged, (user_shape, mapping.node, base.node, sizes, rest))
        target = "reshape" if key in (torch.reshape, "reshape") else "view"
        user = self.emit("call_method", target, (x.user, user_sizes))
        self.report.rewritten.append(
            f"{self.where()}: {_name(key)} of replicated rows merged with {heads} positions back to B rows "
            f"{list(meta.shape)} kept virtual (user rows stay at U)"
        )
        return Rep(user, base, meta, x.source)

    # --- concat of user and candidate parts ----------------------------------------------------

    def concat_ops(self, op, key, args, kwargs, meta):
        if key is torch.einsum and len(args) >= 3 and any(isinstance(v, Concat) for v in args[1:]):
            return self.einsum_concat(args[0], list(args[1:]), meta)
        if key is torch.stack and isinstance(meta, Meta):  # stack along dim d ≠ 0: cat of the parts unsqueezed at d
            dim = _norm(_arg(args, kwargs, 1, "dim", 0), meta.ndim)
            parts = list(args[0])
            if not dim or not any(isinstance(p, (Rep, Sum, Concat)) for p in parts):
                return None
            if all(isinstance(p, Rep) for p in parts) and len({p.mapping.key for p in parts}) == 1:
                return None  # row-wise
            if not all(self.batched(p) and isinstance(p.meta, Meta) for p in parts):
                return None
            unsqueezed = []
            for p in parts:
                shape = (*p.meta.shape[:dim], 1, *p.meta.shape[dim:])
                unsqueezed.append(self.apply("call_method", "unsqueeze", (p, dim), {}, Meta(shape, p.meta.dtype)))
            return self.concat_ops("call_function", torch.cat, (unsqueezed, dim), {}, meta)
        if key is torch.cat:
            parts, dim = list(args[0]), _norm(_arg(args, kwargs, 1, "dim", 0), meta.ndim)
            if dim is None:
                return None
            if dim:  # constant rows beside user rows of one mapping: user rows too (a token prepended to a history)
                parts = list(self.constant_rows_beside((parts,), {})[0][0])
            across = [p for p in parts if isinstance(p, Concat) and p.dim != dim]
            if dim and across and all(self.batched(p) and isinstance(p.meta, Meta) for p in parts):
                # cat along another dim of concats (of one dim): piece by piece between every part boundary
                # (lookups of cat(user ids, candidate ids) in two tables, then cat of the embeddings)
                if len({p.dim for p in across}) == 1 and all(p.meta.ndim == meta.ndim for p in parts):
                    return self.split_elementwise("call_function", torch.cat, (parts, dim), {}, across[0], meta)
                return None
            flat = []
            for p in parts:
                flat += p.parts if isinstance(p, Concat) and p.dim == dim else [p]
            if (
                dim == 0
                or not any(isinstance(p, (Rep, Sum)) for p in flat)
                or not all(self.batched(p) and isinstance(p.meta, Meta) for p in flat)
                or any(isinstance(p, Rep) and p.row_dim for p in flat)
            ):
                return None
            if all(isinstance(p, Rep) for p in flat) and len({p.mapping.key for p in flat}) == 1:
                return None  # row-wise
            merged = []  # neighbouring user parts of one mapping: one tensor at U rows
            for p in flat:
                last = merged[-1] if merged else None
                if isinstance(p, Rep) and isinstance(last, Rep) and last.mapping is p.mapping:
                    size = last.meta.shape[dim] + p.meta.shape[dim]
                    shape = (*p.meta.shape[:dim], size, *p.meta.shape[dim + 1 :])
                    node = self.emit("call_function", torch.cat, ([last.user, p.user],), {"dim": dim})
                    merged[-1] = Rep(node, p.mapping, Meta(shape, p.meta.dtype), last.source)
                else:
                    merged.append(p)
            if len(merged) > 1:  # kept as its parts, split at the example's widths: each call checks them
                self.check_widths(merged, dim)
            return Concat(merged, dim, meta) if len(merged) > 1 else merged[0]
        concat = [v for v in leaves((args, kwargs)) if isinstance(v, Concat)]
        if not concat:
            return None
        c = concat[0]
        last = c.dim == c.meta.ndim - 1
        if key is F.linear and args[0] is c:
            weight, bias = _arg(args, kwargs, 1, "weight"), _arg(args, kwargs, 2, "bias")
            if self.batched(weight) or (bias is not None and self.batched(bias)):
                return None
            if last:
                return self.split_linear(c, weight, bias, meta, weight_cols=True)
            return self.per_part(op, key, args, kwargs, c, meta, c.dim)
        if key in MATMUL and len(args) == 2:
            a, b = args
            if a is c and last and not self.batched(b) and b.meta.ndim == 2:
                return self.split_linear(c, b, None, meta, weight_cols=False)
            if a is c and not last and not self.batched(b) and b.meta.ndim <= 2:
                return self.per_part(op, key, args, kwargs, c, meta, c.dim)  # x @ W leaves the concat dim alone
            if b is c and c.meta.ndim == 3 and c.dim == 1 and not self.batched(a) and a.meta.ndim == 2:
                return self.split_compress(a, c, meta)
            blocks = self.block_matmul(a, b, meta)
            if blocks is not None:
                return blocks
        if key is F.batch_norm and args[0] is c and not _arg(args, kwargs, 5, "training", False):
            if not any(self.batched(v) for v in leaves((args[1:], kwargs))):
                return self.batch_norm_concat(op, key, args, kwargs, c, meta)
        if (key in ELEMENTWISE_FUNCTIONS or key in ELEMENTWISE_METHODS) and self.rowwise_ok(key, args, kwargs, meta):
            return self.split_elementwise(op, key, args, kwargs, c, meta)
        x = args[0] if args else None
        if key in ("view", "reshape", torch.reshape) and x is c and not kwargs and isinstance(meta, Meta):
            return self.reshape_concat(c, _sizes(args), meta)  # the row count may come from a candidate tensor
        if not c.meta.is_float and self._lookup_of_concat(key, args, kwargs, c):
            return self.per_part(op, key, args, kwargs, c, meta, c.dim)  # table[cat(ids)] = cat(table[ids])
        shape = _arg(args, kwargs, 1, "normalized_shape") if key in NORMS else None  # x.shape[-1:]: no rows in it
        if x is not c or any(self.batched(v) and v is not shape for v in leaves((args[1:], kwargs))):
            return None
        nd = c.meta.ndim
        if key in LIKE_FACTORIES:  # ones_like(cat(u[m], c)): constant rows of each part's shape
            return self.per_part(op, key, args, kwargs, c, meta, c.dim)
        if isinstance(meta, tuple) and (dim := self._tuple_op_dim(key, args, kwargs, nd)) not in (None, 0, c.dim):
            return self.struct_per_part(op, key, args, kwargs, c, meta, dim)  # x.max(dim=-1) of fields: per part
        if (
            key in ("max", "min", torch.max, torch.min)
            and isinstance(meta, tuple)
            and self._tuple_op_dim(key, args, kwargs, nd) == c.dim
            and self._values_only()
        ):  # x.max(dim=concat).values, its indices never read: amax along the concat dim
            amax = torch.amax if key in ("max", torch.max) else torch.amin
            values = self.concat_statistic(amax, args, kwargs, c, [c.dim], meta[0])
            return None if values is None else Struct((values, values), meta)  # the second is never read
        if key in REDUCTIONS or key in REDUCTION_FUNCTIONS:
            at = 2 if key in NORM_REDUCTIONS else 1
            dim, keepdim = _arg(args, kwargs, at, "dim"), _arg(args, kwargs, at + 1, "keepdim", False)
            dims = [_norm(d, nd) for d in (dim if isinstance(dim, (tuple, list)) else [dim])]
            if key in ROW_REDUCTIONS and (rows := self._row_reduction_dims(key, args, kwargs, nd)) is not None:
                if c.dim in rows[0]:
                    return None
                shift = 0 if rows[1] else sum(d < c.dim for d in rows[0])
                return self.rows_of_parts(
                    op, key, args, kwargs, c, meta, rows, c.dim - shift
                )  # over the rows: per part
            if None in dims or 0 in dims:
                return None
            if c.dim in dims and key in ("sum", torch.sum, "mean", torch.mean) and not set(kwargs) - {"dim", "keepdim"}:
                return self.reduce_concat(key, dims, keepdim, c, meta)
            if c.dim not in dims:
                shift = 0 if keepdim else sum(d < c.dim for d in dims)
                return self.per_part(op, key, args, kwargs, c, meta, c.dim - shift)
            return self.concat_statistic(key, args, kwargs, c, dims, meta)
        if key is F.normalize and not set(kwargs) - {"p", "dim", "eps", "out"} and kwargs.get("out") is None:
            dim = _norm(_arg(args, kwargs, 2, "dim", 1), nd)
            if dim == c.dim:
                return self.normalize_rows(args, kwargs, c, meta)
            if dim not in (None, 0):
                return self.per_part(op, key, args, kwargs, c, meta, c.dim)
        if key in SOFTMAX and _norm(_arg(args, kwargs, 1, "dim"), nd) not in (None, 0, c.dim):
            return self.per_part(op, key, args, kwargs, c, meta, c.dim)
        if key in FFTS and not {0, c.dim} & set(fft_dims(key, args, kwargs, nd) or [0]):
            return self.per_part(op, key, args, kwargs, c, meta, c.dim)  # HFM's rfft of each field
        if key in NORMS and _norm_dims(args, kwargs) == 1 and last:
            out = self.normalized_linears(key, args, kwargs, c, meta)
            if out is not None:
                return out
        if key in NORMS and c.dim >= nd - _norm_dims(args, kwargs) > 0:
            return self.normalize_concat(key, args, kwargs, c, meta)
        if key in (F.layer_norm, getattr(F, "rms_norm", None)) and nd - _norm_dims(args, kwargs) > c.dim:
            return self.per_part(op, key, args, kwargs, c, meta, c.dim)
        if key in ("flatten", torch.flatten):
            start, end = (
                _norm(_arg(args, kwargs, 1, "start_dim", 0), nd),
                _norm(_arg(args, kwargs, 2, "end_dim", -1), nd),
            )
            if start and end is not None and start <= c.dim <= end and all(s == 1 for s in c.meta.shape[start : c.dim]):
                # the concat dim is the outermost of the flattened dims of size > 1: each part stays one range
                self._check_ones(c, range(start, c.dim))
                return self.per_part(op, key, args, kwargs, c, meta, start)
            if start is not None and end is not None and (end < c.dim or start > c.dim) and start > 0:
                return self.per_part(op, key, args, kwargs, c, meta, c.dim - (end - start if end < c.dim else 0))
            return None
        if key in ("unsqueeze", torch.unsqueeze):
            d = _norm(_arg(args, kwargs, 1, "dim"), nd + 1)
            if d not in (None, 0):
                return self.per_part(op, key, args, kwargs, c, meta, c.dim + (d <= c.dim))
        if key in ("squeeze", torch.squeeze) and _arg(args, kwargs, 1, "dim") is not None:
            dim = _arg(args, kwargs, 1, "dim")  # explicit dims only: squeeze() would drop the rows where B = 1
            dims = [_norm(d, nd) for d in (dim if isinstance(dim, (tuple, list)) else [dim])]
            if None not in dims and 0 not in dims and c.dim not in dims:
                self._check_ones(c, [d for d in dims if c.meta.shape[d] == 1])  # squeeze(d) of a d ≠ 1 keeps it
                return self.per_part(
                    op, key, args, kwargs, c, meta, c.dim - sum(d < c.dim and c.meta.shape[d] == 1 for d in dims)
                )
        if key in ("unflatten", torch.unflatten):
            d = _norm(_arg(args, kwargs, 1, "dim"), nd)
            if d not in (None, 0, c.dim):
                sizes = _arg(args, kwargs, 2, "sizes")
                return self.per_part(op, key, args, kwargs, c, meta, c.dim + (len(sizes) - 1 if d < c.dim else 0))
        if key in TRANSPOSES:
            d0, d1 = _norm(_arg(args, kwargs, 1, "dim0"), nd), _norm(_arg(args, kwargs, 2, "dim1"), nd)
            if d0 and d1:
                return self.per_part(
                    op, key, args, kwargs, c, meta, d1 if c.dim == d0 else d0 if c.dim == d1 else c.dim
                )
        if key in ("permute", torch.permute) and args[0] is c:
            order = [_norm(d, nd) for d in _sizes(args)]
            if len(order) == nd and order[0] == 0 and sorted(order) == list(range(nd)):  # rows stay first
                return self.per_part(op, key, args, kwargs, c, meta, order.index(c.dim))
        if key is operator.getitem:
            new_dim = self._new_dims_only(args[1], c)
            if new_dim is not None:  # x[:, :, None]: unsqueezes, per part
                return self.per_part(op, key, args, kwargs, c, meta, new_dim)
            return self.index_concat(c, args[1], meta) or self.gather_concat(c, args[1], meta)
        if (
            key in ("unbind", torch.unbind)
            and isinstance(meta, tuple)
            and _norm(_arg(args, kwargs, 1, "dim", 0), nd) == c.dim
        ):
            return self.pieces_of_concat(c, [(i, None) for i in range(c.meta.shape[c.dim])], meta)
        if key in ("chunk", torch.chunk, "split", torch.split) and isinstance(meta, tuple):
            dim = _norm(_arg(args, kwargs, 2, "dim", 0), nd)
            if dim == c.dim:
                bounds = itertools.accumulate((m.shape[dim] for m in meta), initial=0)
                starts = list(bounds)
                return self.pieces_of_concat(c, list(zip(starts[:-1], starts[1:])), meta)
            if dim in (None, 0):
                return None
            pieces = [self.apply(op, key, (p, *args[1:]), kwargs, tuple(meta)) for p in c.parts]
            return self._struct_of_pieces(pieces, meta, lambda parts, mi: Concat(parts, c.dim, mi))
        return None

    def _struct_of_pieces(self, pieces, meta, join):
        """The results of an op returning several values, applied to each part of a concat: result i joins the
        parts' i-th results (`join(parts, meta_i)`); None where a part's op did not give several values."""
        if not all(isinstance(pc, Struct) or isinstance(pc, Plain) and isinstance(pc.meta, tuple) for pc in pieces):
            return None
        items = []
        for i, mi in enumerate(meta):
            parts = [
                pc.items[i]
                if isinstance(pc, Struct)
                else self.apply("call_function", operator.getitem, (pc, i), {}, mi)
                for pc in pieces
            ]
            for part in parts:
                part.meta = self.meta_of(part, mi.dtype)
            items.append(join(parts, mi))
        return Struct(tuple(items), meta)

    def _values_only(self) -> bool:
        """Every reader of the node reads its first result (`.values`, `[0]`), none its indices."""
        readers = list(self.node.users)
        return bool(readers) and all(
            n.op == "call_function"
            and len(n.args) == 2
            and (n.target is operator.getitem and n.args[1] == 0 or n.target is getattr and n.args[1] == "values")
            for n in readers
        )

    @staticmethod
    def _tuple_op_dim(key, args, kwargs, nd):
        """The one dim (non-negative) along which an op returning several values works: `max` / `min` with a dim,
        the DIM_OPS (median, mode, kthvalue, cummax, ...), topk / sort; None for any other op or dim."""
        if key in ("max", "min", torch.max, torch.min):
            dim = _arg(args, kwargs, 1, "dim")
        elif _name(key) in DIM_OPS:
            at, default = DIM_OPS[_name(key)]
            dim = kwargs.get("dim", default) if at is None else _arg(args, kwargs, at, "dim", default)
        elif key in ("topk", torch.topk, "sort", torch.sort):
            dim = _arg(args, kwargs, 2 if key in ("topk", torch.topk) else 1, "dim", -1)
        else:
            return None
        return _norm(dim, nd) if isinstance(dim, int) and not isinstance(dim, bool) else None

    def struct_per_part(self, op, key, args, kwargs, c, meta, dim):
        """An op returning several values (values and indices) along a dim that is neither the rows nor the concat
        dim, applied to each part: each of its results a concat of the parts' (along the concat dim, one less where
        the op removed `dim` before it)."""
        pieces = []
        for p in c.parts:
            swap = lambda v, p=p: p if v is c else v  # noqa: E731
            pieces.append(self.apply(op, key, fmap(args, swap), fmap(kwargs, swap), tuple(meta)))
        # along the concat dim, one less where the op removed `dim` before it
        joined = lambda parts, mi: self._joined(parts, c.dim - (dim < c.dim and mi.ndim < c.meta.ndim), mi)  # noqa: E731
        return self._struct_of_pieces(pieces, meta, joined)

    def _lookup_of_concat(self, key, args, kwargs, c) -> bool:
        """A lookup in a constant table whose index is the concat of user and candidate ids: `table[ids]`,
        `F.embedding(ids, table)` (without max_norm, which renormalizes the table as it reads)."""
        if key in (operator.getitem, "__getitem__") and len(args) == 2 and args[1] is c and not kwargs:
            return isinstance(args[0], Plain) and not self.batched(args[0])
        if key in (F.embedding, torch.embedding) and args and args[0] is c:
            table = _arg(args, kwargs, 1, "weight")
            return (
                isinstance(table, Plain)
                and not self.batched(table)
                and _arg(args, kwargs, 3, "max_norm") is None
                and not any(self.batched(v) for v in leaves((args[2:], kwargs)))
            )
        return False

    def _constant_linear(self, n, source) -> bool:
        """n is F.linear(source, W, b) with W (and b) constants of the model."""
        if not (n.op == "call_function" and n.target is F.linear and n.args and n.args[0] is source):
            return False
        if set(n.kwargs) - {"weight", "bias"}:
            return False
        w, b = _arg(n.args, n.kwargs, 1, "weight"), _arg(n.args, n.kwargs, 2, "bias")
        return (
            isinstance(w, fx.Node)
            and w.op == "get_attr"
            and (b is None or isinstance(b, fx.Node) and b.op == "get_attr")
        )

    def normalized_linears(self, key, args, kwargs, c, meta):
        """Linears reading layer_norm / rms_norm over the last dim of cat(user[m], cand), split like Type I.

        W·LN(x) + b = r ⊙ (A_u[m] + A_c + δ·k) + h for LN(x) = (x − μ)·r·γ + β, with the user columns centred on
        their own mean and multiplied at U rows (A_u = (u − μ_u)·(W_u γ_u)ᵀ), the candidate columns at B rows
        (A_c), the row statistics joined per candidate by Chan's update (δ = μ_c − μ_u[m], M2 = M2_u[m] + M2_c +
        δ²·n_u·n_c/n, r = 1/√(M2/n + ε)), k = (n_u/n)·W_c γ_c − (n_c/n)·W_u γ_u and h = W β + b constants. RMSNorm:
        W·(x·r·γ) + b = r ⊙ (A_u[m] + A_c) + b with r from the joined sums of squares. Centring each side first
        keeps the rounding that of the original. Only where every reader of the normalization is such a linear
        (else None: it runs at B rows)."""
        node = self.node
        rms = key is not F.layer_norm
        readers = list(node.users)
        if not readers or not all(self._constant_linear(n, node) and n not in self.fused for n in readers):
            return None
        reps = [p for p in c.parts if isinstance(p, Rep)]
        if not reps or len({p.mapping.key for p in reps}) != 1 or len(reps) == len(c.parts):
            return None
        gamma = _arg(args, kwargs, 2, "weight")
        beta = None if rms else _arg(args, kwargs, 3, "bias")
        eps = _arg(args, kwargs, 3 if rms else 4, "eps", None if rms else 1e-5)
        if any(v is not None and not (isinstance(v, Plain) and v.node.op == "get_attr") for v in (gamma, beta)):
            return None
        if eps is None:
            eps = torch.finfo(c.meta.dtype).eps
        if not isinstance(eps, (int, float)):
            return None
        mapping, where = reps[0].mapping, self.where()
        user_cols, cand_cols, user_x, cand_x, offset = [], [], [], [], 0
        for p in c.parts:
            size = p.meta.shape[c.dim]
            if isinstance(p, Rep):
                user_cols += range(offset, offset + size)
                user_x.append(p.user)
            else:
                cand_cols += range(offset, offset + size)
                cand_x.append(self.materialize(p, where, "part of a normalized concat"))
            offset += size
        n_u, n_c, n = len(user_cols), len(cand_cols), offset
        g = torch.ones(n, dtype=c.meta.dtype) if gamma is None else self.fetch(gamma.node.target).detach()

        def side(x):  # (centred or raw columns, mean, M2 or sum of squares) of one side, at its own rows
            x = self._cat_columns(x)
            mean = None
            if not rms:
                mean = self.emit("call_method", "mean", (x, -1), {"keepdim": True})
                x = self.emit("call_function", operator.sub, (x, mean))
            square = self.emit("call_function", operator.mul, (x, x))
            return x, mean, self.emit("call_method", "sum", (square, -1), {"keepdim": True})

        (xu, mean_u, m2_u), (xc, mean_c, m2_c) = side(user_x), side(cand_x)
        join = lambda name, cand, user: self.emit("call_function", ops.rows_join, (name, cand, user, mapping.node))  # noqa: E731
        m2 = join("add", m2_c, m2_u)
        if not rms:
            delta = join("sub_cu", mean_c, mean_u)
            spread = self.emit("call_function", operator.mul, (delta, delta))
            m2 = self.emit("call_function", torch.add, (m2, spread), {"alpha": n_u * n_c / n})
        variance = self.emit("call_function", operator.truediv, (m2, n))
        r = self.emit("call_function", torch.rsqrt, (self.emit("call_function", operator.add, (variance, eps)),))
        for reader in readers:
            w = self.fetch(_arg(reader.args, reader.kwargs, 1, "weight").target).detach()
            b = _arg(reader.args, reader.kwargs, 2, "bias")
            scaled = w * g
            w_u, w_c = scaled[:, user_cols].contiguous(), scaled[:, cand_cols].contiguous()
            h = torch.zeros(w.shape[0], dtype=torch.float64)
            if beta is not None:
                h += w.double() @ self.fetch(beta.node.target).detach().double()
            if b is not None:
                h += self.fetch(b.target).detach().double()
            const = lambda t, prefix: self.emit("get_attr", self.attach(prefix, t.to(w.dtype)))  # noqa: E731
            a_u = self.emit("call_function", F.linear, (xu, const(w_u, "weight")))
            y = self.emit("call_function", ops.linear_rows, (xc, const(w_c, "weight"), a_u, mapping.node))
            if not rms:
                k = (n_u / n) * w_c.double().sum(1) - (n_c / n) * w_u.double().sum(1)
                y = self.emit("call_function", torch.addcmul, (y, delta, const(k, "bias")))
            y = self.emit("call_function", torch.addcmul, (const(h, "bias"), y, r))
            self.fused[reader] = Plain(y, self.meta[reader], True)
        self.report.rewritten.append(
            f"{where}: {_name(key)} over cat(user, candidate) and the {len(readers)} linear(s) reading it split: user "
            "columns normalized and multiplied at U rows, row statistics joined per candidate (linear_rows)"
        )
        return Plain(None, meta, True)  # read only by the linears above, which are computed here

    def rows_of_parts(self, op, key, args, kwargs, c, meta, reduced, new_dim):
        """A reduction over the rows (not the concat dim) of a concat (`reduced`: its dims and keepdim): each part
        reduced (a replica's through `reduce_rows`), the results concatenated; no candidate rows remain."""
        parts = []
        dims, keepdim = reduced
        for p in c.parts:
            swap = lambda v, p=p: p if v is c else v  # noqa: E731
            shape = [1 if d in dims else s for d, s in enumerate(p.meta.shape) if keepdim or d not in dims]
            part = self.apply(op, key, fmap(args, swap), fmap(kwargs, swap), Meta(tuple(shape), meta.dtype))
            if not isinstance(part, Plain) or part.batched:
                return None
            parts.append(part.node)
        return Plain(self.emit("call_function", torch.cat, (parts,), {"dim": new_dim}), meta)

    def _concat_sides(self, c, dims):
        """(mapping, accumulation dtype, (user nodes [U, …], their element count over dims), (candidate nodes
        [B, …], count)) of a float concat whose parts are replicas of one mapping and candidate rows, in the dtype
        its statistics accumulate in (fp32 for 16-bit floats, as torch's reductions); None for any other concat."""
        reps = [p for p in c.parts if isinstance(p, Rep)]
        if not c.meta.dtype.is_floating_point or not reps or len(reps) == len(c.parts):
            return None
        if len({p.mapping.key for p in reps}) != 1 or any(p.row_dim or not isinstance(p.meta, Meta) for p in reps):
            return None
        if not all(isinstance(p, (Rep, Plain, Sum)) and isinstance(p.meta, Meta) for p in c.parts):
            return None
        acc = torch.float32 if c.meta.dtype.itemsize < 4 else c.meta.dtype
        where = self.where()
        user, cand, n_u, n_c = [], [], 0, 0
        for p in c.parts:
            count = math.prod(p.meta.shape[d] for d in dims)
            if isinstance(p, Rep):
                node, n_u = p.user, n_u + count
                user.append(node)
            else:
                node, n_c = self.materialize(p, where, "part of a concat's statistics"), n_c + count
                cand.append(node)
            if self.values[node].dtype != acc:
                (user if isinstance(p, Rep) else cand)[-1] = self.emit("call_method", "to", (node, acc))
        return reps[0].mapping, acc, (user, n_u), (cand, n_c)

    def _side_reduce(self, nodes, dims, fn=None, reduce=torch.sum, combine=operator.add):
        """reduce(fn(x), dims, keepdim) of each node, combined (the parts of one side of a concat)."""
        total = None
        for x in nodes:
            part = self.emit("call_function", reduce, (x if fn is None else fn(x), dims), {"keepdim": True})
            total = part if total is None else self.emit("call_function", combine, (total, part))
        return total

    def concat_moments(self, c, dims, centred=True):
        """(acc dtype, element count n, Σx [B, …], M2 = Σ(x − μ)² or Σx² [B, …]) over `dims` (kept, size 1) of each
        row of cat(user[m], cand): each side's sum and centred sum of squares at its own rows (the user side at U
        rows), joined per candidate as scalars of its row (`rows_join`) by Chan's update, M2 = M2_u[m] + M2_c +
        δ²·n_u·n_c/n with δ = μ_c − μ_u[m] (the rounding of a two-pass variance); not centred: Σx² of both sides
        added."""
        sides = self._concat_sides(c, dims)
        if sides is None:
            return None
        mapping, acc, (user, n_u), (cand, n_c) = sides
        n, dims = n_u + n_c, tuple(dims)
        join = lambda name, cand, user: self.emit("call_function", ops.rows_join, (name, cand, user, mapping.node))  # noqa: E731
        sums = [self._side_reduce(side, dims) for side in (user, cand)]
        total = join("add", sums[1], sums[0])
        if not centred:
            square = lambda x: self.emit("call_function", operator.mul, (x, x))  # noqa: E731
            m2_u, m2_c = (self._side_reduce(side, dims, square) for side in (user, cand))
            return acc, n, total, join("add", m2_c, m2_u)
        means = [self.emit("call_function", operator.truediv, (s, k)) for s, k in zip(sums, (n_u, n_c))]

        def centred_square(mean):
            def fn(x):
                d = self.emit("call_function", operator.sub, (x, mean))
                return self.emit("call_function", operator.mul, (d, d))

            return fn

        m2_u, m2_c = (self._side_reduce(side, dims, centred_square(mean)) for side, mean in zip((user, cand), means))
        delta = join("sub_cu", means[1], means[0])
        m2 = join("add", m2_c, m2_u)
        spread = self.emit("call_function", operator.mul, (delta, delta))
        return acc, n, total, self.emit("call_function", torch.add, (m2, spread), {"alpha": n_u * n_c / n})

    def concat_norm(self, c, dims, p):
        """(acc dtype, ‖row‖_p [B, …] kept dims) over `dims` of each row of cat(user[m], cand), from the parts' sums
        of |x|^p (max / min of |x| for p = ±inf) at their own rows, joined per candidate; None for other p."""
        if p in (None, "fro"):
            p = 2
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (p > 0 or p == -math.inf):
            return None
        sides = self._concat_sides(c, dims)
        if sides is None:
            return None
        mapping, acc, (user, _), (cand, _) = sides
        dims = tuple(dims)
        absolute = lambda x: self.emit("call_function", torch.abs, (x,))  # noqa: E731
        if math.isinf(p):
            reduce, combine, name = (
                (torch.amax, torch.maximum, "maximum") if p > 0 else (torch.amin, torch.minimum, "minimum")
            )
            u, k = (self._side_reduce(side, dims, absolute, reduce, combine) for side in (user, cand))
            return acc, self.emit("call_function", ops.rows_join, (name, k, u, mapping.node))
        if p == 2:
            power = lambda x: self.emit("call_function", operator.mul, (x, x))  # noqa: E731
        elif p == 1:
            power = absolute
        else:
            power = lambda x: self.emit("call_function", torch.pow, (absolute(x), p))  # noqa: E731
        u, k = (self._side_reduce(side, dims, power) for side in (user, cand))
        total = self.emit("call_function", ops.rows_join, ("add", k, u, mapping.node))
        if p == 1:
            return acc, total
        if p == 2:
            return acc, self.emit("call_function", torch.sqrt, (total,))
        return acc, self.emit("call_function", torch.pow, (total, 1.0 / p))

    def _statistic_out(self, node, dims, keepdim, meta, what, how="sums"):
        """A statistic over a concat's rows (kept dims, accumulation dtype) as the op returns it."""
        if not keepdim:
            node = self.emit("call_function", torch.squeeze, (node, tuple(dims)))
        if self.values[node].dtype != meta.dtype:
            node = self.emit("call_method", "to", (node, meta.dtype))
        if to_meta(self.values[node]) != meta:
            return None
        self.report.rewritten.append(
            f"{self.where()}: {what} over cat(user, candidate): the parts' {how} at their own rows (the user side at U "
            "rows), joined per candidate as scalars of its row (rows_join)"
        )
        return Plain(node, meta, True)

    def concat_statistic(self, key, args, kwargs, c, dims, meta):
        """var / std / a vector norm over dims that include the concat dim (not the rows)."""
        kwargs = {k: v for k, v in kwargs.items() if not (k in ("out", "dtype") and v is None)}  # torch.norm's
        if key in VAR_STD:
            if set(kwargs) - {"dim", "unbiased", "correction", "keepdim"} or len(args) > 4:
                return None
            unbiased, keepdim = _arg(args, kwargs, 2, "unbiased", True), _arg(args, kwargs, 3, "keepdim", False)
            correction = kwargs.get("correction")
            correction = (1 if unbiased else 0) if correction is None else correction
            if not isinstance(correction, (int, float)) or not isinstance(keepdim, bool):
                return None
            moments = self.concat_moments(c, dims)
            if moments is None:
                return None
            _, n, _, m2 = moments
            out = self.emit("call_function", operator.truediv, (m2, max(n - correction, 0)))
            if VAR_STD[key]:
                out = self.emit("call_function", torch.sqrt, (out,))
            return self._statistic_out(out, dims, keepdim, meta, _name(key))
        if key in EXTREMES:
            if set(kwargs) - {"dim", "keepdim"} or len(args) > 3:
                return None
            keepdim = _arg(args, kwargs, 2, "keepdim", False)
            sides = self._concat_sides(c, dims) if isinstance(keepdim, bool) else None
            if sides is None:
                return None
            mapping, _, (user, _), (cand, _) = sides
            reduce, combine, join = EXTREMES[key]
            u, k = (self._side_reduce(side, tuple(dims), None, reduce, combine) for side in (user, cand))
            out = self.emit("call_function", ops.rows_join, (join, k, u, mapping.node))
            how = {"maximum": "maxima", "minimum": "minima"}.get(join, "logsumexps")
            return self._statistic_out(out, dims, keepdim, meta, _name(key), how)
        if key in NORM_REDUCTIONS:
            if set(kwargs) - {"p", "ord", "dim", "keepdim"} or len(args) > 4:
                return None
            default = {torch.linalg.vector_norm: 2, torch.linalg.norm: None}.get(key, "fro")
            p = _arg(args, kwargs, 1, "ord" if key in (torch.linalg.vector_norm, torch.linalg.norm) else "p", default)
            if key is torch.linalg.norm and len(dims) == 2 and p not in (None, "fro"):
                return None  # a matrix norm
            keepdim = _arg(args, kwargs, 3, "keepdim", False)
            norm = self.concat_norm(c, dims, p) if isinstance(keepdim, bool) else None
            return None if norm is None else self._statistic_out(norm[1], dims, keepdim, meta, _name(key))
        return None

    def normalize_rows(self, args, kwargs, c, meta):
        """F.normalize along the concat dim: x / max(‖x‖_p, eps) with the row norms joined per candidate
        (`concat_norm`), the division per part (a join for the user parts)."""
        p, eps = _arg(args, kwargs, 1, "p", 2.0), _arg(args, kwargs, 3, "eps", 1e-12)
        if not isinstance(eps, (int, float)):
            return None
        norm = self.concat_norm(c, [c.dim], p)
        if norm is None:
            return None
        node = self.emit("call_method", "to", (norm[1], c.meta.dtype))  # the original's norm is in its dtype
        node = self.emit("call_method", "clamp_min", (node, eps))
        denom = Plain(node, to_meta(self.values[node]), True)
        self.report.rewritten.append(
            f"{self.where()}: normalize over cat(user, candidate): row norms from the parts' sums at their own rows, "
            "joined per candidate (rows_join); the user columns divided by a join"
        )
        return self.apply("call_function", operator.truediv, (c, denom), {}, meta)

    def normalize_concat(self, key, args, kwargs, c, meta):
        """layer_norm / rms_norm over dims that include the concat dim, read by anything (not only linears): the row
        statistics joined per candidate (`concat_moments`), then (x − μ)·r·γ + β (x·r·γ) per part: the user
        columns by joins of the U-row tensor with the candidates' statistics."""
        rms = key is not F.layer_norm
        nd = c.meta.ndim
        dims = list(range(nd - _norm_dims(args, kwargs), nd))
        if set(kwargs) - {"normalized_shape", "weight", "bias", "eps"}:
            return None
        gamma = _arg(args, kwargs, 2, "weight")
        beta = None if rms else _arg(args, kwargs, 3, "bias")
        eps = _arg(args, kwargs, 3 if rms else 4, "eps", None if rms else 1e-5)
        if eps is None:
            eps = torch.finfo(c.meta.dtype).eps
        if not isinstance(eps, (int, float)) or any(v is not None and self.batched(v) for v in (gamma, beta)):
            return None
        moments = self.concat_moments(c, dims, centred=not rms)
        if moments is None:
            return None
        acc, n, total, m2 = moments
        stat = lambda node: Plain(node, to_meta(self.values[node]), True)  # noqa: E731
        work = Meta(meta.shape, acc)
        variance = self.emit("call_function", operator.truediv, (m2, n))
        r = self.emit("call_function", torch.rsqrt, (self.emit("call_function", operator.add, (variance, eps)),))
        y = c
        if not rms:
            mean = self.emit("call_function", operator.truediv, (total, n))
            y = self.apply("call_function", operator.sub, (y, stat(mean)), {}, work)
        y = self.apply("call_function", operator.mul, (y, stat(r)), {}, work)
        if isinstance(y, Plain) and isinstance(gamma, Plain) and isinstance(beta, Plain):  # one pass: y·γ + β
            y = Plain(self.emit("call_function", torch.addcmul, (beta.node, y.node, gamma.node)), work, True)
            gamma = beta = None
        if gamma is not None:
            y = self.apply("call_function", operator.mul, (y, gamma), {}, work)
        if beta is not None:
            y = self.apply("call_function", operator.add, (y, beta), {}, work)
        if acc != meta.dtype:
            y = self.apply("call_method", "to", (y, meta.dtype), {}, meta)
        self.report.rewritten.append(
            f"{self.where()}: {_name(key)} over cat(user, candidate): row statistics from the parts' sums at their own "
            "rows, joined per candidate (rows_join); the user columns normalized by joins"
        )
        return y

    def block_matmul(self, a, b, meta):
        """matmul(a, b) of batched [B, ..., M, K] @ [B, ..., K, N] where a is a concat along M or b along N (the
        pairwise dot products of user and candidate vectors, DLRM's interaction): one matmul per block, user × user
        at U rows, user × candidate by rows_matmul, the blocks kept as a concat along M of concats along N."""
        if not (is_value(a) and is_value(b) and self.batched(a) and self.batched(b)):
            return None
        if not (isinstance(a.meta, Meta) and isinstance(b.meta, Meta) and a.meta.ndim == b.meta.ndim >= 3):
            return None
        nd = a.meta.ndim
        if isinstance(a, Concat) and a.dim == nd - 1 or isinstance(b, Concat) and b.dim == nd - 2:
            return self.contract_concat(a, b, meta)
        rows = a.parts if isinstance(a, Concat) and a.dim == nd - 2 else None if isinstance(a, Concat) else [a]
        cols = b.parts if isinstance(b, Concat) and b.dim == nd - 1 else None if isinstance(b, Concat) else [b]
        if rows is None or cols is None or len(rows) == len(cols) == 1:
            return None
        if any(isinstance(p, (Concat, Struct)) or isinstance(p, Rep) and p.row_dim for p in rows + cols):
            return None
        lead = meta.shape[:-2]
        row_forms = []
        for pa in rows:
            blocks = []
            for pb in cols:
                block_meta = Meta((*lead, pa.meta.shape[-2], pb.meta.shape[-1]), meta.dtype)
                blocks.append(self.apply("call_function", torch.matmul, (pa, pb), {}, block_meta))
            row_meta = Meta((*lead, pa.meta.shape[-2], meta.shape[-1]), meta.dtype)
            row_forms.append(Concat(blocks, nd - 1, row_meta) if len(blocks) > 1 else blocks[0])
        self.report.rewritten.append(
            f"{self.where()}: matmul over a concat of user and candidate vectors split into blocks: user × user at U "
            "rows, user × candidate joined by rows_matmul"
        )
        # blocks kept apart (not joined) until read: a selection of some (DLRM's triangle) leaves the others unused
        return Concat(row_forms, nd - 2, meta) if len(row_forms) > 1 else row_forms[0]

    def contract_concat(self, a, b, meta):
        """matmul(a, b) contracting over a concat (attention weights over user and candidate values): Σ over the
        parts' ranges of a[..., range] @ b[..., range, :], user × user at U rows, the terms kept as a Sum."""
        nd = a.meta.ndim
        bounds = {0, a.meta.shape[-1]}
        for v, dim in ((a, nd - 1), (b, nd - 2)):
            if isinstance(v, Concat):
                if v.dim != dim:
                    return None
                bounds |= set(itertools.accumulate(p.meta.shape[dim] for p in v.parts))
        bounds = sorted(bounds)
        total = None
        for start, stop in zip(bounds[:-1], bounds[1:]):
            left, right = self._range(a, nd - 1, start, stop), self._range(b, nd - 2, start, stop)
            if left is None or right is None:
                return None
            term = self.apply("call_function", torch.matmul, (left, right), {}, meta)
            joined = None if total is None else self.add_terms(total, term, 1.0, meta)
            if total is not None and joined is None:
                return None
            total = term if total is None else joined
        self.report.rewritten.append(
            f"{self.where()}: matmul contracting over a concat of user and candidate parts split into a sum of "
            "block products (user × user at U rows)"
        )
        return total

    def einsum_concat(self, equation, operands, meta):
        """einsum over a concat (not along its rows): along a kept index, one einsum a part (a concat of the results);
        along a contracted index, Σ over the parts' ranges of the einsum of every operand's range (user × user terms
        at U rows, kept as a Sum): Wukong / DHEN's `einsum("bnd,nr->bdr", cat(user_fields, cand_fields), W)`."""
        if not isinstance(equation, str) or "." in equation or "->" not in equation or not isinstance(meta, Meta):
            return None
        inputs, out = equation.replace(" ", "").split("->")
        terms = inputs.split(",")
        if len(terms) != len(operands) or not all(is_value(v) and isinstance(v.meta, Meta) for v in operands):
            return None
        if any(len(t) != v.meta.ndim for t, v in zip(terms, operands)):
            return None
        c = next(v for v in operands if isinstance(v, Concat))
        letter = terms[operands.index(c)][c.dim]
        if letter == out[:1]:
            return None  # the rows' index
        if any(isinstance(v, Concat) and t[v.dim] != letter for t, v in zip(terms, operands)):
            return self.einsum_blocks(equation, terms, out, operands, letter, meta)
        bounds = {0, c.meta.shape[c.dim]}
        for t, v in zip(terms, operands):
            if isinstance(v, Concat):
                bounds |= set(itertools.accumulate(p.meta.shape[v.dim] for p in v.parts))
        bounds, pieces = sorted(bounds), []
        for start, stop in zip(bounds[:-1], bounds[1:]):
            ranged = [self._slice(v, v.meta.ndim - t.index(letter), start, stop) if letter in t else v
                      for t, v in zip(terms, operands)]  # fmt: skip
            if any(isinstance(v, Concat) and v.dim == t.index(letter) for t, v in zip(terms, ranged)):
                return None  # a range that covers more than one part
            shape = list(meta.shape)
            if letter in out:
                shape[out.index(letter)] = stop - start
            pieces.append(
                self.apply("call_function", torch.einsum, (equation, *ranged), {}, Meta(tuple(shape), meta.dtype))
            )
        if letter in out:
            how = "one einsum a part, the results kept as a concat"
            result = Concat(pieces, out.index(letter), meta)
        else:
            how = "a sum of the parts' einsums (user × user at U rows)"
            result = pieces[0]
            for piece in pieces[1:]:
                result = self.add_terms(result, piece, 1.0, meta)
                if result is None:
                    return None
        self.report.rewritten.append(f"{self.where()}: einsum over a concat of user and candidate parts: {how}")
        return result

    def einsum_blocks(self, equation, terms, out, operands, letter, meta):
        """einsum over concats along different indices, `letter` (one of them) kept in the output (FwFM's field
        pairs `einsum("bfd,bgd->bfg", x, x)`): one einsum per range of `letter`'s parts, each over the other
        operands as they are (so the next concat index splits it again: user × user blocks at U rows, user ×
        candidate blocks joined), the results kept as a concat along `letter`'s output dim, as DLRM's bmm(T, Tᵀ)
        blocks are. A concat index that is contracted, or an operand holding `letter` as a concat along another
        index, has no such form; nor does a result that a view regroups across the blocks' dims (xDeepFM's CIN
        reshapes [B, h, m, d] to [B, h·m, d], interleaving user × user and user × candidate blocks in every row:
        the blocks would be gathered back together at B rows, more work than the einsum as written)."""
        if letter not in out:
            return None
        kept = 1 + max(
            out.index(t[v.dim]) for t, v in zip(terms, operands) if isinstance(v, Concat) and t[v.dim] in out
        )
        node = self.node
        views = ("view", "reshape", "flatten", "view_as", "reshape_as")
        for reader in node.users if node is not None else ():
            shape = getattr(self.meta.get(reader), "shape", None)
            if _name(reader.target) in views and (shape is None or shape[:kept] != meta.shape[:kept]):
                return None
        bounds = {0}
        for t, v in zip(terms, operands):
            if letter in t:
                dim = t.index(letter)
                bounds.add(v.meta.shape[dim])
                if isinstance(v, Concat) and v.dim == dim:
                    bounds |= set(itertools.accumulate(p.meta.shape[dim] for p in v.parts))
        if len(bounds) > 2 + sum(len(v.parts) - 1 for v in operands if isinstance(v, Concat)):
            return None  # operands of other sizes along `letter` (a broadcast)
        bounds, pieces = sorted(bounds), []
        for start, stop in zip(bounds[:-1], bounds[1:]):
            ranged = [self._range(v, t.index(letter), start, stop) if letter in t else v
                      for t, v in zip(terms, operands)]  # fmt: skip
            if any(v is None for v in ranged):
                return None
            shape = list(meta.shape)
            shape[out.index(letter)] = stop - start
            pieces.append(
                self.apply("call_function", torch.einsum, (equation, *ranged), {}, Meta(tuple(shape), meta.dtype))
            )
        self.report.rewritten.append(
            f"{self.where()}: einsum over concats of user and candidate parts split into blocks along {letter!r}"
        )
        return Concat(pieces, out.index(letter), meta)

    def _range(self, v, dim, start, stop):
        """v[..., start:stop, ...] along `dim`: a part (or a slice of one) of a concat along it, else a slice."""
        if isinstance(v, Concat) and v.dim == dim:
            index = (*(slice(None),) * dim, slice(start, stop))
            shape = (*v.meta.shape[:dim], stop - start, *v.meta.shape[dim + 1 :])
            return self.index_concat(v, index, Meta(shape, v.meta.dtype))
        if isinstance(v, Concat):
            return None
        return self._slice(v, v.meta.ndim - dim, start, stop)

    def _constant(self, form):
        """The value of a form computed from constants only (no input): an index the model keeps as a buffer or
        builds from Python numbers; else None."""
        if not (isinstance(form, Plain) and isinstance(form.node, fx.Node)):
            return None
        seen, todo = set(), [form.node]
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            if n.op == "placeholder":
                return None
            todo.extend(n.all_input_nodes)
        return self.values[form.node]

    def _size_read(self, n) -> bool:
        """n reads one size of a tensor's shape that is not its rows (`x.shape[1]`, `x.size(-1)`) and whose value on
        the example is no row count (not U or B)."""
        if n.op == "call_function" and n.target is operator.getitem and len(n.args) == 2:
            shape, dim = self.values.get(n.args[0]), n.args[1]
            if not isinstance(shape, torch.Size):
                return False
        elif n.op == "call_method" and n.target == "size" and len(n.args) == 2 and not n.kwargs:
            shape, dim = getattr(self.values.get(n.args[0]), "shape", None), n.args[1]
        else:
            return False
        if type(dim) is not int or shape is None or _norm(dim, len(shape)) in (None, 0):
            return False
        return shape[dim] not in (self.num_users, self.num_candidates)

    def _constant_of_sizes(self, form):
        """The value of a form computed from constants and from sizes of other dims than the rows (`triu_indices(n,
        n, 1)` with n = x.shape[1], a number of fields): the graph checks at each call that those sizes are the
        example's (`ops.check_sizes`, shapes only; else the original runs); None for a form read from any input's
        values or rows."""
        if not (isinstance(form, Plain) and isinstance(form.node, fx.Node)):
            return None
        reads, seen, todo = [], set(), [form.node]
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            if self._size_read(n):
                reads.append(n)
                continue
            if n.op == "call_function" and n.target is getattr and n.args[1] in ("dtype", "device", "ndim"):
                continue  # `device=x.device`: checked on each call (`Guarded`)
            if n.op == "placeholder":
                return None
            todo.extend(n.all_input_nodes)
        if reads:
            self.emit("call_function", ops.check_sizes, (tuple(reads), [int(self.values[n]) for n in reads]))
        return self.values[form.node]

    def gather_concat(self, c, index, meta):
        """x[:, I, J, ...] of a (nested) concat with constant index tensors (DLRM's upper triangle of the
        interactions): each run of selected entries read from the part that holds it (a user part at U rows), the
        runs kept as a concat along the selected dim."""
        index = index if isinstance(index, tuple) else (index,)
        if len(index) < 2 or index[0] != slice(None):
            return None
        consts = [self._constant(i) for i in index[1:]]
        if any(t is None for t in consts):  # an index built from sizes of the fields (`triu_indices(n, n, 1)`)
            consts = [self._constant_of_sizes(i) for i in index[1:]]
        if not consts or any(
            not isinstance(t, torch.Tensor) or t.dim() != 1 or t.is_floating_point() or t.dtype == torch.bool
            for t in consts
        ):
            return None
        count, k = consts[0].shape[0], len(consts)
        if any(t.shape[0] != count for t in consts) or count == 0 or not isinstance(meta, Meta):
            return None
        coords = torch.stack([t.long() % c.meta.shape[d + 1] for d, t in enumerate(consts)], dim=1).tolist()

        def locate(form, at):
            while isinstance(form, Concat) and 1 <= form.dim <= k:
                d, offset = form.dim - 1, 0
                for part in form.parts:
                    size = part.meta.shape[form.dim]
                    if at[d] < offset + size:
                        form, at = part, [*at[:d], at[d] - offset, *at[d + 1 :]]
                        break
                    offset += size
            return (None, at) if isinstance(form, (Concat, Struct)) else (form, at)

        runs = []  # [leaf form, local coordinates]
        for at in coords:
            leaf, local = locate(c, at)
            if leaf is None:
                return None
            if runs and runs[-1][0] is leaf:
                runs[-1][1].append(local)
            else:
                runs.append([leaf, [local]])
        where = self.where()
        parts = []
        for leaf, local in runs:
            picks = torch.tensor(local, dtype=torch.int64).t()
            picked = (slice(None), *[self.emit("get_attr", self.attach("index", p.contiguous())) for p in picks])
            shape = Meta((self.num_candidates, len(local), *meta.shape[2:]), meta.dtype)
            if isinstance(leaf, Rep):
                node = self.emit("call_function", operator.getitem, (leaf.user, picked))
                parts.append(Rep(node, leaf.mapping, shape, leaf.source))
            else:
                node = self.emit("call_function", operator.getitem, (self.materialize(leaf, where, ""), picked))
                parts.append(Plain(node, shape, True))
        merged = []  # neighbouring candidate runs in one tensor, neighbouring user runs of a mapping in one
        for part in parts:
            if (
                merged
                and type(merged[-1][0]) is type(part)
                and (isinstance(part, Plain) or part.mapping is merged[-1][0].mapping)
            ):
                merged[-1].append(part)
            else:
                merged.append([part])
        pieces = []
        for group in merged:
            size = sum(p.meta.shape[1] for p in group)
            pieces.append(self._joined(group, 1, Meta((self.num_candidates, size, *meta.shape[2:]), meta.dtype)))
        if not any(isinstance(p, Rep) for p in pieces):
            return None  # nothing stays at U rows: as the original
        self.report.rewritten.append(
            f"{where}: constant-index selection from a concat of user and candidate blocks: user entries at U rows"
        )
        return self._joined(pieces, 1, meta)

    def reshape_concat(self, c, sizes, meta):
        """view / reshape of a concat that keeps each part one range of one dim, per part: the dims after the
        concat dim regrouped (heads split off the last dim), or the concat dim, when last, split into (-1, *rest)
        (DLRM's cat(features, 1).view(B, -1, d)). The sizes after the concat dim are the model's own arguments
        (ints or traced sizes), not the example's."""
        before, after = c.meta.shape, meta.shape
        d = c.dim
        merged = len(before) - len(after)
        if merged > 0 and len(sizes) == len(after) and sizes[0] != -1 and self.is_count(sizes[0]):
            for start in range(1, d + 1):  # x.view(x.size(0), -1): dims [start, start + merged] into one
                end = start + merged
                if (
                    end >= d
                    and sizes[start] == -1
                    and all(type(size) is int for size in sizes[start + 1 :])
                    and before[:start] == after[:start]
                    and before[end + 1 :] == after[start + 1 :]
                    and all(size == 1 for size in before[start:d])
                ):
                    self._check_ones(c, range(start, d))
                    return self.per_part("call_method", "flatten", (c, start, end), {}, c, meta, start)
        if len(sizes) != len(after) or before[:d] != after[:d]:
            return None
        rest = list(sizes[d + 1 :])
        if any(is_value(s) and not (isinstance(s, Plain) and not self.batched(s)) for s in rest):
            return None
        if after[d] == before[d] and len(after) > d + 1:  # the trailing dims regrouped
            steps = ([("flatten", d + 1)] if len(before) > d + 2 else []) + [("unflatten", d + 1)]
            if len(before) == d + 1:
                steps = [("unsqueeze", d + 1), ("unflatten", d + 1)]
        elif len(before) == d + 1 and len(after) > d + 1 and -1 not in rest:  # the concat dim split
            width = math.prod(after[d + 1 :])
            if any(p.meta.shape[d] % width for p in c.parts):
                return None
            steps, rest = [("unflatten", d)], [-1, *rest]
        else:
            return None
        parts = []
        for p in c.parts:
            form = p
            for step, dim in steps:
                shape = list(self.meta_of(form, meta.dtype).shape if form is not p else p.meta.shape)
                if step == "flatten":
                    args, shape = (form, dim), [*shape[:dim], math.prod(shape[dim:])]
                elif step == "unsqueeze":
                    args, shape = (form, dim), [*shape, 1]
                else:
                    widths = list(after[dim:]) if dim > d else [p.meta.shape[d] // width, *after[d + 1 :]]
                    args, shape = (form, dim, rest), [*shape[:dim], *widths]
                form = self.apply("call_method", step, args, {}, Meta(tuple(shape), meta.dtype))
            form.meta = self.meta_of(form, meta.dtype)
            parts.append(form)
        return self._joined(parts, d, meta)

    def pieces_of_concat(self, c, ranges, meta):
        """split / chunk (ranges (start, stop)) or unbind (ranges (i, None)) of a concat along its concat dim: a
        Struct of each piece's form, where every piece falls inside one part; None where one spans two."""
        lead = (slice(None),) * c.dim
        items = []
        for (start, stop), mi in zip(ranges, meta):
            index = (*lead, start if stop is None else slice(start, stop))
            piece = self.index_concat(c, index, mi)
            if piece is None:
                return None
            items.append(piece)
        return Struct(tuple(items), meta)

    def per_part(self, op, key, args, kwargs, c, meta, new_dim):
        """An op that leaves the concat dim alone, applied to each part (the concat kept along `new_dim`)."""
        parts = []
        for p in c.parts:
            swap = lambda v, p=p: p if v is c else v  # noqa: E731
            pargs, pkwargs = fmap(args, swap), fmap(kwargs, swap)
            part = self.apply(op, key, pargs, pkwargs, meta)
            part.meta = self.meta_of(part, meta.dtype)
            parts.append(part)
        return self._joined(parts, new_dim, meta)

    def batch_norm_concat(self, op, key, args, kwargs, c, meta):
        """batch_norm in eval (a per-channel affine map) over a concat: each part on its own, with its channels'
        statistics and weights where the channels (dim 1) are the concat dim."""
        if c.dim != 1:
            return self.per_part(op, key, args, kwargs, c, meta, c.dim)
        names = ("running_mean", "running_var", "weight", "bias")
        parts, start = [], 0
        for p in c.parts:
            stop = start + p.meta.shape[1]
            channels = lambda v: self._slice(v, 1, start, stop) if is_value(v) else v  # noqa: E731
            pargs = (p, *map(channels, args[1:5]), *args[5:])
            pkwargs = {k: channels(v) if k in names else v for k, v in kwargs.items()}
            part = self.apply(op, key, pargs, pkwargs, meta)
            part.meta = self.meta_of(part, meta.dtype)
            parts.append(part)
            start = stop
        return self._joined(parts, 1, meta)

    def _joined(self, parts, dim, meta):
        """cat(parts, dim) of forms: one part as itself, candidate parts (or user parts of one mapping) as one
        tensor, a mix as a Concat."""
        if len(parts) == 1:
            return parts[0]
        if all(isinstance(p, Plain) for p in parts):
            return Plain(self.emit("call_function", torch.cat, ([p.node for p in parts],), {"dim": dim}), meta, True)
        if all(isinstance(p, Rep) and not p.row_dim for p in parts) and len({p.mapping.key for p in parts}) == 1:
            node = self.emit("call_function", torch.cat, ([p.user for p in parts],), {"dim": dim})
            return Rep(node, parts[0].mapping, meta, parts[0].source)
        self.check_widths(parts, dim)  # kept as parts split at the example's widths: each call checks them
        return Concat(parts, dim, meta)

    def meta_of(self, form, dtype):
        """A form's shape at B rows, from its value on the example."""
        if isinstance(form, Rep):
            value = self.values[form.user]
            return Meta((self.num_candidates, *value.shape[1:]), value.dtype)
        if isinstance(form, Plain):
            return to_meta(self.values[form.node])
        return form.meta

    def reduce_concat(self, key, dims, keepdim, c, meta):
        """sum / mean over dims that include the concat dim: the parts' sums, joined (add_user_rows where user rows
        meet candidates)."""
        total = None
        for p in c.parts:
            pargs = (p, dims[0] if len(dims) == 1 else tuple(dims), keepdim)
            part = self.apply("call_method", "sum", pargs, {}, meta)
            total = (
                part
                if total is None
                else self.add_terms(total, part, 1.0, meta)
                or Plain(
                    self.emit(
                        "call_function",
                        operator.add,
                        (self.materialize(total, self.where(), ""), self.materialize(part, self.where(), "")),
                    ),
                    meta,
                    True,
                )
            )
        if key in ("mean", torch.mean):
            count = math.prod(c.meta.shape[d] for d in dims)
            total = self.apply("call_function", operator.truediv, (total, count), {}, meta)
        return total

    def _new_dims_only(self, index, c):
        """Where c's concat dim goes under a basic index that keeps the rows and the concat dim whole — full slices
        there; None, at most one Ellipsis, and ints or slices on the other dims (`x[..., 0]`, `x[:, :, 1:]`) — else
        None."""
        index = index if isinstance(index, tuple) else (index,)
        basic = lambda i: i is None or i is Ellipsis or isinstance(i, slice) or type(i) is int  # noqa: E731
        if not all(map(basic, index)) or index.count(Ellipsis) > 1:
            return None
        if any(isinstance(i, slice) and not all(type(v) is int or v is None for v in (i.start, i.stop, i.step))
               for i in index):  # fmt: skip
            return None  # bounds read from tensors
        consumed = sum(i is not None and i is not Ellipsis for i in index)
        if consumed > c.meta.ndim:
            return None
        expanded = []
        for i in index:
            expanded += [slice(None)] * (c.meta.ndim - consumed) if i is Ellipsis else [i]
        expanded += [slice(None)] * (c.meta.ndim - sum(i is not None for i in expanded))
        if expanded[0] != slice(None):
            return None  # the rows would move off dim 0, or be cut
        seen, out = 0, 0  # input dims consumed, output dims made
        for i in expanded:
            if i is not None and seen == c.dim:
                return out if i == slice(None) else None
            seen += i is not None
            out += type(i) is not int
        return None

    def index_concat(self, c, index, meta):
        """x[:, a:b] (or x[..., i]) that falls inside one part of a concat; x[:, [i, j, …]] with a list of ints along
        the concat dim (PNN's field pairs `x[:, row]`) as a concat of the runs each part gives."""
        index = index if isinstance(index, tuple) else (index,)
        if any(is_value(i) or i is Ellipsis or i is None for i in index) or len(index) <= c.dim:
            return None
        if not all(i == slice(None) for i in index[: c.dim]):
            return None
        sel, offset = index[c.dim], 0
        rest = index[c.dim + 1 :]  # x[:, sel, :] (FiGNN's `x[:, src_nodes, :]`) is x[:, sel]
        if isinstance(sel, list) and sel and all(type(i) is int for i in sel) and all(i == slice(None) for i in rest):
            return self.pick_from_concat(c, sel, meta, rest)
        for p in c.parts:
            size = p.meta.shape[c.dim]
            lo, hi = offset, offset + size
            offset = hi
            if isinstance(sel, int) and lo <= sel % c.meta.shape[c.dim] < hi:
                inner = (*index[: c.dim], sel % c.meta.shape[c.dim] - lo, *index[c.dim + 1 :])
                return self.apply("call_function", operator.getitem, (p, inner), {}, meta)
            if isinstance(sel, slice) and sel.step in (None, 1):
                start, stop, _ = sel.indices(c.meta.shape[c.dim])
                if lo <= start and stop <= hi:
                    inner = (*index[: c.dim], slice(start - lo, stop - lo), *index[c.dim + 1 :])
                    return self.apply("call_function", operator.getitem, (p, inner), {}, meta)
        return None

    def pick_from_concat(self, c, sel, meta, rest=()):
        """x[:, sel] along the concat dim, sel a list of ints (`rest`: full slices after it): each run of entries
        from one part is that part's slice (or its own list), the runs a concat in sel's order."""
        size, starts = c.meta.shape[c.dim], []
        for p in c.parts:
            starts.append((starts[-1] + c.parts[len(starts) - 1].meta.shape[c.dim]) if starts else 0)
        if not all(-size <= i < size for i in sel):
            return None
        located = []  # (part, index in the part) of each entry
        for i in sel:
            i %= size
            k = max(j for j, start in enumerate(starts) if start <= i)
            located.append((k, i - starts[k]))
        pieces, lead = [], (slice(None),) * c.dim
        for k, run in itertools.groupby(located, key=lambda e: e[0]):
            local = [i for _, i in run]
            consecutive = local == list(range(local[0], local[0] + len(local)))
            inner = slice(local[0], local[0] + len(local)) if consecutive else local
            shape = list(meta.shape)
            shape[c.dim] = len(local)
            piece_meta = Meta(tuple(shape), meta.dtype)
            piece = (c.parts[k], (*lead, inner, *rest))
            pieces.append(self.apply("call_function", operator.getitem, piece, {}, piece_meta))
        return pieces[0] if len(pieces) == 1 else Concat(pieces, c.dim, meta)

    def _slice(self, v, dim_from_end, start, stop):
        """v[..., start:stop, ...] along the dim `dim_from_end` from the end (v's form kept)."""
        if not is_value(v) or not isinstance(v.meta, Meta):
            return v
        dim = v.meta.ndim - dim_from_end
        if dim < 0 or v.meta.shape[dim] == 1:
            return v  # broadcast along that dim
        index = (slice(None),) * dim + (slice(start, stop),)
        shape = list(v.meta.shape)
        shape[dim] = stop - start
        meta = Meta(tuple(shape), v.meta.dtype)
        if isinstance(v, Rep):
            return Rep(self.emit("call_function", operator.getitem, (v.user, index)), v.mapping, meta, v.source)
        if isinstance(v, Concat) and v.dim == dim:  # the parts the range covers, each sliced: the form kept
            pieces, offset = [], 0
            for p in v.parts:
                size = p.meta.shape[v.dim]
                lo, hi = max(start, offset), min(stop, offset + size)
                if lo < hi:
                    pieces.append(
                        p
                        if (lo, hi) == (offset, offset + size)
                        else self._slice(p, dim_from_end, lo - offset, hi - offset)
                    )
                offset += size
            return pieces[0] if len(pieces) == 1 else Concat(pieces, dim, meta)
        whole = self.materialize(v, self.where(), "split of a concat")
        return Plain(self.emit("call_function", operator.getitem, (whole, index)), meta, self.batched(v))

    def split_elementwise(self, op, key, args, kwargs, c, meta):
        """An elementwise op over a concat: apply it to each piece between the part boundaries of every operand that
        is a concat along the same dim (AFM's pairwise products of user and candidate fields: user × user pieces at
        U rows, user × candidate pieces joined), the other operands sliced alike."""
        dim_from_end = c.meta.ndim - c.dim
        bounds = set()
        for v in leaves((args, kwargs)):
            if isinstance(v, Concat) and v.meta.ndim - v.dim == dim_from_end:
                bounds.update(itertools.accumulate((p.meta.shape[v.dim] for p in v.parts), initial=0))
        bounds = sorted(bounds)
        parts = []
        for start, stop in zip(bounds[:-1], bounds[1:]):
            s = lambda v, a=start, b=stop: self._slice(v, dim_from_end, a, b) if is_value(v) else v  # noqa: E731
            shape = list(meta.shape)
            shape[c.dim] = stop - start
            pargs, pkwargs = fmap(args, s), fmap(kwargs, s)
            parts.append(self.apply(op, key, pargs, pkwargs, Meta(tuple(shape), meta.dtype)))
        return self._joined(parts, c.dim, meta)

    def _weight_slice(self, weight, start, stop, cols: bool):
        """weight[:, start:stop] (cols) or weight[start:stop]; constants sliced once, here."""
        index = (slice(None), slice(start, stop)) if cols else (slice(start, stop),)
        if isinstance(weight, Plain) and weight.node.op == "get_attr":
            tensor = self.fetch(weight.node.target)[index].contiguous()
            return self.emit("get_attr", self.attach("weight", tensor))
        return self.emit("call_function", operator.getitem, (weight.node, index))

    def _join(self, cand_sum, user_terms, meta, owned=False):
        """cand_sum [B, ...] (or None) + Σ user_terms[mapping][m] through add_user_rows (into cand_sum in
        place where it is `owned`: a fresh tensor nothing else reads)."""
        for mapping, terms in user_terms.items():
            total = terms[0]
            for t in terms[1:]:
                total = self.emit("call_function", operator.add, (total, t))
            if cand_sum is None:
                shape = self.emit(
                    "call_function",
                    ops.rep_shape,
                    (self.emit("call_function", getattr, (total, "shape")), mapping.node),
                )
                device = self.emit("call_function", getattr, (total, "device"))
                cand_sum = self.emit("call_function", torch.zeros, (shape,), {"dtype": meta.dtype, "device": device})
            fresh = (
                owned
                and cand_sum.op == "call_function"
                and cand_sum.target in (F.linear, torch.matmul, operator.add)
                and not cand_sum.users
            )
            owned = True  # the join's own output from here on
            same = (
                fresh
                and self.values[cand_sum].shape[1:] == self.values[total].shape[1:]
                and self.values[cand_sum].dtype == self.values[total].dtype
            )
            join = ops.add_rows_ if same else ops.add_user_rows_broadcast
            cand_sum = self.emit("call_function", join, (cand_sum, total, mapping.node))
        return Plain(cand_sum, meta, True)

    def _siblings(self, weight_cols):
        """Other linears over the same concat with constant weights: merged into this one."""
        node = self.node
        if node.target is not F.linear or not weight_cols:
            return [node]
        source = node.args[0]

        def constant(n):
            w, b = _arg(n.args, n.kwargs, 1, "weight"), _arg(n.args, n.kwargs, 2, "bias")
            return (
                isinstance(w, fx.Node)
                and w.op == "get_attr"
                and (b is None or isinstance(b, fx.Node) and b.op == "get_attr")
            )

        if not constant(node):
            return [node]
        changed = [  # in-place ops on the source's storage: a linear after one reads other values
            self.order[n] for n in self.traced.graph.nodes
            if (x := mutated_input(n, self.traced)) is not None and self.roots[x] is self.roots[source]
        ]  # fmt: skip
        return [node] + [
            n
            for n in source.users
            if n is not node
            and n.target is F.linear
            and n.args[0] is source
            and constant(n)
            and n not in self.fused
            and n.op == "call_function"
            and not any(
                min(self.order[node], self.order[n]) < k < max(self.order[node], self.order[n]) for k in changed
            )
        ]

    def split_linear(self, c, weight, bias, meta, weight_cols: bool):
        """linear(cat(parts, -1), W, b) = Σ linear(part_i, W_i) + b (Type I): the user parts of a mapping in
        one GEMM at U rows, the candidate parts in one GEMM at B rows, joined by add_user_rows; linears
        reading the same concat (experts, gates, towers) merged into one."""
        siblings = self._siblings(weight_cols)
        if len(siblings) > 1:
            tensors = [self.fetch(_arg(n.args, n.kwargs, 1, "weight").target) for n in siblings]
            biases = [_arg(n.args, n.kwargs, 2, "bias") for n in siblings]
            merged_w = torch.cat(tensors, dim=0)
            merged_b = None
            if any(b is not None for b in biases):
                merged_b = torch.cat(
                    [
                        self.fetch(b.target) if b is not None else t.new_zeros(t.shape[0])
                        for b, t in zip(biases, tensors)
                    ]
                )
            weight = Plain(
                self.emit("get_attr", self.attach("weight", merged_w)), Meta(tuple(merged_w.shape), merged_w.dtype)
            )
            bias = (
                None
                if merged_b is None
                else Plain(
                    self.emit("get_attr", self.attach("bias", merged_b)), Meta(tuple(merged_b.shape), merged_b.dtype)
                )
            )
            meta = Meta((*meta.shape[:-1], merged_w.shape[0]), meta.dtype)
        cand_parts, user_parts, offset = [], {}, 0
        for p in c.parts:
            size = p.meta.shape[c.dim]
            cols = (offset, offset + size)
            offset += size
            if isinstance(p, Rep):
                user_parts.setdefault(p.mapping, []).append((p.user, cols, 1.0))
            elif (
                isinstance(p, Sum)
                and p.materialized is None
                and (p.cand is None or p.cand.op == "call_method" and p.cand.target == "expand")
            ):
                # candidate term broadcast (or none): its GEMM is small, the user terms' run at U rows
                if p.cand is not None:
                    cand_parts.append((p.cand, cols))
                for u, m, sign in p.users:
                    user_parts.setdefault(m, []).append((u, cols, sign))
            else:
                cand_parts.append((self.materialize(p, self.where(), "part of a concat"), cols))
        fn = F.linear if weight_cols else torch.matmul
        fused = self._fused_linear(cand_parts, user_parts, weight, bias, meta, weight_cols)
        if fused is not None:
            out = fused
        else:
            out = self._split_terms(cand_parts, user_parts, weight, bias, meta, weight_cols, fn)
        merged = f" ({len(siblings)} linears over it merged)" if len(siblings) > 1 else ""
        self.report.rewritten.append(
            f"{self.where()}: linear over cat(user, candidate) split (Type I){merged}: user columns at U rows, "
            "candidate columns in one GEMM at B rows, joined "
            + ("in the GEMM's output (linear_rows)" if fused is not None else "by add_user_rows")
        )
        if len(siblings) == 1:
            return out
        whole = Plain(self.materialize(out, self.where(), ""), meta, True)
        start = 0
        results = []
        for n in siblings:
            width = self.meta[n].shape[-1]
            node = self.emit("call_function", operator.getitem, (whole.node, (Ellipsis, slice(start, start + width))))
            node = self.emit("call_method", "contiguous", (node,))  # column blocks: strided ops are slow
            results.append(Plain(node, self.meta[n], True))
            start += width
        for n, r in zip(siblings[1:], results[1:]):
            self.fused[n] = r
        return results[0]

    def _fused_linear(self, cand_parts, user_parts, weight, bias, meta, weight_cols):
        """ops.linear_rows for one mapping's user parts and a candidate GEMM: the user rows read into the
        GEMM's output (broadcast candidate parts, a target item over its history, multiplied before)."""
        if not weight_cols or len(user_parts) != 1 or not cand_parts:
            return None
        expanded = [cp for cp in cand_parts if cp[0].op == "call_method" and cp[0].target == "expand"]
        main = [cp for cp in cand_parts if cp not in expanded]
        if not main:
            return None
        ((mapping, items),) = user_parts.items()
        user = None
        for sign in (1.0, -1.0):
            chosen = [it for it in items if it[2] == sign]
            if not chosen:
                continue
            x = self._cat_columns([it[0] for it in chosen])
            term = self.emit(
                "call_function", F.linear, (x, self._weight_columns(weight, [it[1] for it in chosen], True))
            )
            term = term if sign > 0 else self._neg(term)
            user = term if user is None else self.emit("call_function", operator.add, (user, term))
        if bias is not None:
            user = self.emit("call_function", operator.add, (user, bias.node if is_value(bias) else bias))
        if self.values[user].dim() != self.values[main[0][0]].dim():
            return None
        extras = []
        for cp in expanded:
            extras.append(self.linear_cand(F.linear, (cp[0], self._weight_columns(weight, [cp[1]], True))))
        x = self._cat_columns([cp[0] for cp in main])
        w = self._weight_columns(weight, [cp[1] for cp in main], True)
        return Plain(self.emit("call_function", ops.linear_rows, (x, w, user, mapping.node, extras)), meta, True)

    def _split_terms(self, cand_parts, user_parts, weight, bias, meta, weight_cols, fn):
        """The split as a Sum: candidate GEMMs (broadcast parts on their own) and user GEMMs per mapping."""
        cand_sum = None
        expanded = [x for x, _ in cand_parts if x.op == "call_method" and x.target == "expand"]
        groups = [[cp] for cp in cand_parts if cp[0] in expanded] + (
            [[cp for cp in cand_parts if cp[0] not in expanded]] if len(cand_parts) > len(expanded) else []
        )
        b = None if bias is None else (bias.node if is_value(bias) else bias)
        for group in groups:
            x = self._cat_columns([g[0] for g in group])
            w = self._weight_columns(weight, [g[1] for g in group], weight_cols)
            with_bias = cand_sum is None and b is not None and weight_cols and group is groups[-1]
            term = self.linear_cand(fn, (x, w, b) if with_bias else (x, w))
            if with_bias:
                b = None  # added
            cand_sum = term if cand_sum is None else self.emit("call_function", operator.add, (cand_sum, term))
        user_terms = {}
        for mapping, items in user_parts.items():
            terms = []
            for sign in (1.0, -1.0):
                chosen = [it for it in items if it[2] == sign]
                if not chosen:
                    continue
                x = self._cat_columns([it[0] for it in chosen])
                term = self.emit(
                    "call_function", fn, (x, self._weight_columns(weight, [it[1] for it in chosen], weight_cols))
                )
                terms.append(term if sign > 0 else self._neg(term))
            user_terms[mapping] = terms
        if b is not None:
            if cand_sum is not None:
                cand_sum = self.emit("call_function", operator.add, (cand_sum, b))
            else:
                first = next(iter(user_terms.values()))
                first[0] = self.emit("call_function", operator.add, (first[0], b))
        users = [(t, m, 1.0) for m, terms in user_terms.items() for t in terms]
        return Sum(cand_sum, users, meta, owned=cand_sum is not None)

    def _weight_columns(self, weight, ranges, cols: bool):
        """The weight's columns (rows for a matmul weight) of the given ranges, as one tensor (constants once)."""
        if len(ranges) == 1:
            return self._weight_slice(weight, *ranges[0], cols=cols)
        if isinstance(weight, Plain) and weight.node.op == "get_attr":
            w = self.fetch(weight.node.target)
            pieces = [w[:, a:b] if cols else w[a:b] for a, b in ranges]
            return self.emit("get_attr", self.attach("weight", torch.cat(pieces, dim=1 if cols else 0).contiguous()))
        pieces = [self._weight_slice(weight, a, b, cols) for a, b in ranges]
        return self.emit("call_function", torch.cat, (pieces,), {"dim": 1 if cols else 0})

    def split_compress(self, weight, c, meta):
        """matmul(W, cat(parts, dim=1)) over tokens: ikbo_linear_compress for [user, candidate]."""
        kinds = [isinstance(p, Rep) for p in c.parts]
        if kinds == [True, False] and isinstance(weight, Plain) and weight.node.op == "get_attr":
            user, cand = c.parts
            module = ops.LinearCompress(self.fetch(weight.node.target), user.meta.shape[1])
            node = self.emit(
                "call_module",
                self.attach("lce", module),
                (user.user, self.materialize(cand, self.where(), ""), user.mapping.node),
            )
            self.report.rewritten.append(
                f"{self.where()}: matmul(W, cat(user tokens, candidate tokens)) → ikbo_linear_compress (weights packed once)"
            )
            return Plain(node, meta, True)
        cand_sum, user_terms, offset = None, {}, 0
        for p in c.parts:
            size = p.meta.shape[1]
            w = self._weight_slice(weight, offset, offset + size, cols=True)
            offset += size
            if isinstance(p, Rep):
                user_terms.setdefault(p.mapping, []).append(self.emit("call_function", torch.matmul, (w, p.user)))
            else:
                term = self.emit("call_function", torch.matmul, (w, self.materialize(p, self.where(), "")))
                cand_sum = term if cand_sum is None else self.emit("call_function", operator.add, (cand_sum, term))
        self.report.rewritten.append(
            f"{self.where()}: matmul(W, cat over tokens) split (Type I): user tokens at U rows, joined by add_user_rows"
        )
        return self._join(cand_sum, user_terms, meta)

    # --- joins of user rows with candidate rows ------------------------------------------------

    def joins(self, op, key, args, kwargs, meta):
        flat = [v for v in leaves((args, kwargs)) if is_value(v)]
        if any(isinstance(v, (Concat, Struct)) for v in flat):
            return None
        reps = [v for v in flat if isinstance(v, Rep)]
        # non-float user data (lengths, masks) is cheap to replicate: do it, then look again (a comparison or bitwise
        # op with candidate rows is a join: hash bits, ids)
        compared = key in JOIN_OPS and JOIN_OPS[key][0].split("_")[0] in ANY_DTYPE_JOINS and len(args) == 2
        compared = compared and not kwargs and len(reps) == 1 and reps[0] in args and isinstance(meta, Meta)
        other = next((a for a in args if a is not reps[0]), None) if compared else None
        compared = compared and isinstance(other, Plain) and other.batched and self.rowwise_ok(key, args, kwargs, meta)
        compared = compared and _bitwise_agrees(key, reps[0], other)
        if any(isinstance(r.meta, Meta) and not r.meta.is_float for r in reps) and key is not SDPA and not compared:
            why = f"{_name(key)} combines it with candidate rows"
            where = self.where()

            def small(v):
                return (
                    self.candidate_rows(self.materialize(v, where, why), v.meta, v.mapping)
                    if isinstance(v, Rep) and not v.meta.is_float
                    else v
                )

            args, kwargs = fmap(args, small), fmap(kwargs, small)
            return self.apply(op, key, args, kwargs, meta)
        if not reps or len({r.mapping.key for r in reps}) != 1 or any(isinstance(v, (Rows, RepShape)) for v in flat):
            return None
        if any(r.row_dim for r in reps):
            return None
        constant = [r for r in reps if self._equal_rows(r)]
        if (
            len(reps) > 1
            and constant
            and len(constant) < len(reps)
            and any(self.batched(v) for v in flat if v not in reps)
        ):
            # zeros_like(u[m]) beside u[m] and candidate rows (`where(hit, ts[m], full_like(ts[m], -1))`): every row
            # of it is the same, so its first row broadcast to the candidates' rows (no copy) is its B-row form
            rows = next(v for v in flat if v not in reps and self.batched(v) and isinstance(v.meta, Meta))
            count = self.emit("call_method", "size", (rows.node, 0))
            broadcast = {}
            for r in constant:
                first = self.emit("call_function", operator.getitem, (r.user, slice(0, 1)))
                node = self.emit("call_method", "expand", (first, count, *[-1] * (r.meta.ndim - 1)))
                broadcast[r] = Plain(node, r.meta, True)
            swap = lambda v: broadcast.get(v, v) if isinstance(v, Rep) else v  # noqa: E731
            return self.apply(op, key, fmap(args, swap), fmap(kwargs, swap), meta)
        mapping = reps[0].mapping
        if mapping.heads is not None and (key is SDPA or key in ADD_SUB):
            return None  # attention kernels and sums take rows of candidates, not of their heads
        if key is SDPA:
            return self.attention(args, kwargs, meta, self.where())
        if key in ADD_SUB and len(args) == 2 and not kwargs and all(is_value(a) and self.batched(a) for a in args):
            return self.add_terms(args[0], args[1], ADD_SUB[key], meta)
        cands = [v for v in flat if self.batched(v) and not isinstance(v, Rep)]
        if len(reps) != 1 or len(cands) < 1 or not isinstance(meta, Meta):
            return None
        rep = reps[0]
        if key in MATMUL and len(args) == 2 and all(self.batched(a) for a in args):
            a, b = args
            if a.meta.ndim == b.meta.ndim >= 3:
                cand_left = b is rep
                cand = a if cand_left else b
                node = self.emit("call_function", ops.rows_matmul, (cand.node, rep.user, mapping.node, cand_left))
                self.report.rewritten.append(
                    f"{self.where()}: batched matmul of candidate rows with replicated user rows → rows_matmul (user rows read per tile)"
                )
                return self.candidate_rows(node, meta, mapping)
            return None
        if key in (torch.gather, "gather", torch.take_along_dim, "take_along_dim") and args[0] is rep:
            along = key in (torch.take_along_dim, "take_along_dim")
            dim = _norm(_arg(args, kwargs, 2 if along else 1, "dim"), rep.meta.ndim)
            index = _arg(args, kwargs, 1 if along else 2, "indices" if along else "index")
            if dim == 1 and isinstance(index, Plain) and index.batched and index.meta.ndim == rep.meta.ndim:
                node = self.emit("call_function", ops.select_user_rows, (rep.user, mapping.node, index.node, along))
                self.report.rewritten.append(
                    f"{self.where()}: {_name(key)} of each candidate's own rows of a user tensor → select_user_rows "
                    "(read from the U-row tensor; a per-candidate selection, not a replication)"
                )
                return self.candidate_rows(node, meta, mapping)
        if key is torch.einsum and len(args) == 3 and len(cands) == 1 and self._einsum_rowwise(args):
            equation, first, second = args
            cand_first = first is cands[0]
            cand = first if cand_first else second
            node = self.emit(
                "call_function", ops.rows_einsum, (equation, cand.node, rep.user, mapping.node, cand_first)
            )
            self.report.rewritten.append(
                f"{self.where()}: einsum of candidate rows with replicated user rows → rows_einsum (user rows read per tile)"
            )
            return self.candidate_rows(node, meta, mapping)
        if not self.rowwise_ok(key, args, kwargs, meta):
            return None
        joined = self._join_op(key, args, kwargs, rep, cands, meta)
        if joined is None:
            return None
        name, cand, cond = joined
        if not rep.meta.is_float and name.split("_")[0] not in ANY_DTYPE_JOINS:
            return None
        if not _bitwise_agrees(key, rep, cand):
            return None
        node = self.emit(
            "call_function",
            ops.rows_join,
            (name, cand.node, rep.user, mapping.node, None if cond is None else cond.node),
        )
        self.report.rewritten.append(
            f"{self.where()}: {_name(key)} of candidate rows with replicated user rows → rows_join (user rows read per tile)"
        )
        return self.candidate_rows(node, meta, mapping)

    def _equal_rows(self, rep) -> bool:
        """Every row of the Rep's user tensor is the same: a zeros / ones / full factory (`*_like`, `new_*`)."""
        node = rep.user
        return isinstance(node, fx.Node) and (
            node.op == "call_function" and node.target in (*EQUAL_FACTORIES, torch.zeros_like, torch.ones_like, torch.full_like)
            or node.op == "call_method" and node.target in ("new_zeros", "new_ones", "new_full")
        )  # fmt: skip

    def _join_op(self, key, args, kwargs, rep, cands, meta):
        """(rows_join op name, candidate operand, condition) for an elementwise op of one user and one
        candidate operand; None where the op has no join."""
        if kwargs:
            return None
        if key in JOIN_OPS and len(args) == 2 and len(cands) == 1:
            a, b = args
            if a is rep and b is cands[0]:
                return JOIN_OPS[key][1], b, None
            if b is rep and a is cands[0]:
                return JOIN_OPS[key][0], a, None
        if key in (torch.where, "where") and len(args) == 3:
            cond, a, b = args
            if isinstance(cond, Plain) and cond.batched and cond.meta.dtype == torch.bool:
                if a is rep and isinstance(b, Plain) and b.batched:
                    return "where_uc", b, cond
                if b is rep and isinstance(a, Plain) and a.batched:
                    return "where_cu", a, cond
                # where(cand_mask, user[m], v) with v a number: the result in the user rows' dtype (a float v beside
                # integer rows would promote them)
                if isinstance(meta, Meta) and meta.dtype == rep.meta.dtype:
                    if a is rep and _scalar(b):
                        return "where_uc", self._fill_rows(rep, b, cond), cond
                    if b is rep and _scalar(a):
                        return "where_cu", self._fill_rows(rep, a, cond), cond
        if key in (torch.masked_fill, "masked_fill") and len(args) == 3 and args[0] is rep:
            cond, value = args[1:]  # user[m].masked_fill(cand_mask, v) is where(cand_mask, v, user[m])
            if isinstance(cond, Plain) and cond.batched and cond.meta.dtype == torch.bool and _scalar(value):
                return "where_cu", self._fill_rows(rep, value, cond), cond
        return None

    def _fill_rows(self, rep, value, cond) -> Plain:
        """B rows of the number `value` (or 0-dim tensor) in the user rows' dtype, as masked_fill casts it, without a
        copy (stride 0): the constant side of a where joined with user rows."""
        if isinstance(value, Plain):
            fill = self.emit("call_method", "to", (value.node, rep.user))
        else:
            fill = self.emit("call_method", "new_full", (rep.user, (), value))
        ones = [1] * (rep.meta.ndim - 1)
        fill = self.emit("call_method", "expand", (fill, self.emit("call_method", "size", (cond.node, 0)), *ones))
        return Plain(fill, Meta((cond.meta.shape[0], *ones), rep.meta.dtype), True)

    # --- why an op was left --------------------------------------------------------------------

    def why_not(self, key, args, kwargs, meta):
        flat = [v for v in leaves((args, kwargs)) if is_value(v)]
        reps = [v for v in flat if isinstance(v, Rep)]
        if len({r.mapping.key for r in reps}) > 1:
            return "it combines user rows replicated through different mappings"
        if any(isinstance(v, Concat) for v in flat):
            if key is SDPA:
                return "attention over a concat of user and candidate tokens (the user tokens' outputs depend on the candidate)"
            if key in SOFTMAX:
                return (
                    "softmax over user and candidate entries together (attention across user and candidate tokens: "
                    "every output depends on the candidate)"
                )
            if (
                key in SEQUENCE_OPS
                and _norm(_arg(args, kwargs, 1, "dim", 0), meta.ndim if isinstance(meta, Meta) else 0) == 0
            ):
                return f"{_name(key)} along dim 0 of a concat of user and candidate parts (the rows move off dim 0)"
            return f"{_name(key)} over a concat of user and candidate parts has no per-part form"
        if key is SDPA:
            return "attention whose mask is not a per-user key mask, or with dropout / is_causal / candidate K/V"
        if any(isinstance(r, Rep) and r.row_dim for r in reps):
            return f"{_name(key)} of a sequence-first (rows on dim 1) user tensor"
        if self.batched(args[0] if args else None) and not self.rowwise_ok(key, args, kwargs, meta):
            return f"{_name(key)} is not known to act row by row on dim 0 (e.g. it reduces or reorders candidates)"
        return f"no IKBO join for {_name(key)}"
