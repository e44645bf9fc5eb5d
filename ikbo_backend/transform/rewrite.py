"""The pass: trace a model with torch.fx, propagate where each value lives, rebuild the graph with
user-side work at U rows.

Every value of the traced graph gets one of these forms while the new graph is built, in order:
    Plain   — computed as in the original (candidate rows B, user rows U, or no batch dim);
    Rep     — user[mapping] kept virtual: only `user` [U, ...] exists in the new graph;
    Concat  — cat(parts, dim) of Rep and candidate parts, kept as its parts;
    RepShape / Rows — x.shape / x.shape[0] of a Rep (B in the original, U in the user-row graph).
A Rep is created at each replication site (x[m], x.index_select(0, m), x.repeat_interleave(r, 0),
x.expand(B, ...) of one row) and flows through ops that act row by row (they run on `user` at U
rows). Where a Rep meets candidate rows, the op becomes a join (add_user_rows, the Type I split of a
linear, ikbo_linear_compress, ikbo_attention, a grouped op); where no join exists, the Rep is
materialized right there (`ops.index_rows`) and the report says where and why.
"""

from __future__ import annotations

import operator
from collections import Counter
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten, tree_map

from . import ops
from .attention import AttentionRewrites, fuse_self_target_attention
from .values import (
    ADD_SUB,
    CONVERSIONS,
    ELEMENTWISE_FUNCTIONS,
    ELEMENTWISE_METHODS,
    MATMUL,
    REDUCTIONS,
    SDPA,
    SOFTMAX,
    Concat,
    Mapping,
    Meta,
    Plain,
    Rep,
    Report,
    RepShape,
    Rows,
    _arg,
    _name,
    _norm,
    _off_rows,
    _tensors,
    is_value,
    to_meta,
)  # fmt: skip

# ----------------------------------------------------------------------------- the pass


class Rewriter(AttentionRewrites):
    def __init__(self, traced: fx.GraphModule, example_inputs, mapping_name: str):
        self.traced, self.mapping_name = traced, mapping_name
        self.graph = fx.Graph()
        self.report = Report()
        self.env: dict[fx.Node, Any] = {}
        self.mappings: dict[Any, Mapping] = {}
        self.counter = 0
        self.sunk: Counter = Counter()  # op name → how many ran at U rows instead of B
        self.fused: dict[fx.Node, Any] = {}  # original nodes already computed by a fused op
        self.meta = self._run_example(example_inputs)
        placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
        names = [n.target for n in placeholders]
        if mapping_name not in names:
            raise ValueError(f"model: forward has no argument named {mapping_name!r} (arguments: {names})")
        self.num_candidates = self.meta[placeholders[names.index(mapping_name)]].shape[0]

    def _run_example(self, example_inputs):
        meta = {}

        class Recorder(fx.Interpreter):
            def run_node(self, n):
                out = super().run_node(n)
                meta[n] = to_meta(out)
                return out

        with torch.no_grad():
            Recorder(self.traced).run(*example_inputs)
        return meta

    # --- emitting ------------------------------------------------------------------------------

    def emit(self, op, target, args=(), kwargs=None):
        return self.graph.create_node(op, target, tuple(args), dict(kwargs or {}))

    def attach(self, prefix, value) -> str:
        """Store a constant or module on the rewritten module; returns its attribute name."""
        self.counter += 1
        name = f"_ikbo_{prefix}_{self.counter}"
        setattr(self.traced, name, value)
        return name

    def fetch(self, target: str):
        """The tensor behind a get_attr target ("top.0.weight")."""
        value = self.traced
        for part in target.split("."):
            value = getattr(value, part)
        return value

    def user_side(self, x):
        """A value's form in the user-row graph (Rep → U rows)."""
        if isinstance(x, Rep):
            return x.user
        if isinstance(x, Rows):
            return x.user_rows
        if isinstance(x, RepShape):
            return x.user_shape
        if isinstance(x, Plain):
            return x.node
        if isinstance(x, Concat):
            raise AssertionError("a Concat has no user-row form")
        return x

    def materialize(self, x, consumer: str, why: str):
        """A value's form at B rows; replicates a Rep (and reports it)."""
        if isinstance(x, Plain):
            return x.node
        if isinstance(x, Rows):
            return self.emit("call_function", ops.mapping_rows, (x.mapping.node,))
        if isinstance(x, RepShape):
            return self.emit("call_function", ops.rep_shape, (x.user_shape, x.mapping.node))
        if isinstance(x, Concat):
            if x.materialized is None:
                parts = [self.materialize(p, consumer, why) for p in x.parts]
                x.materialized = self.emit("call_function", torch.cat, (parts,), {"dim": x.dim})
            return x.materialized
        if isinstance(x, Rep):
            if x.materialized is None:
                fn = ops.index_rows_tuple if isinstance(x.meta, tuple) else ops.index_rows
                x.materialized = self.emit("call_function", fn, (x.user, x.mapping.node))
                small = isinstance(x.meta, Meta) and not x.meta.is_float
                entry = f"{x.source} replicated to B rows at `{consumer}`: {why}"
                if small:
                    self.report.notes.append(
                        f"{entry} (non-float, {x.meta.dtype}: index/mask data, not counted as a replication)"
                    )
                else:
                    self.report.left.append(entry)
            return x.materialized
        return x

    def plain(self, op, target, args, kwargs, meta, name, why):
        """Emit the op as in the original, materializing what it reads."""
        flat = tree_flatten((args, kwargs))[0]
        batched = any(
            isinstance(v, (Rep, Concat, Rows, RepShape)) or (isinstance(v, Plain) and (v.batched or v.mapping))
            for v in flat
        )
        m = lambda v: self.materialize(v, name, why) if is_value(v) else v  # noqa: E731
        node = self.emit(op, target, tree_map(m, args, is_leaf=is_value), tree_map(m, kwargs, is_leaf=is_value))
        rows_b = isinstance(meta, Meta) and meta.ndim > 0 and meta.shape[0] == self.num_candidates
        count_b = type(meta) is int and meta == self.num_candidates  # e.g. cand.shape[0]
        return Plain(node, meta, batched=batched and (rows_b or count_b or isinstance(meta, tuple)))

    # --- main loop -----------------------------------------------------------------------------

    def run(self) -> tuple[fx.GraphModule, Report]:
        for node in self.traced.graph.nodes:
            meta = self.meta.get(node)
            if node.op == "placeholder":
                new = self.graph.placeholder(node.target)
                if node.target == self.mapping_name:
                    mapping = Mapping(("input",), new, node.target)
                    self.env[node] = Plain(new, meta, batched=True, mapping=mapping)
                else:
                    rows_b = isinstance(meta, Meta) and meta.ndim > 0 and meta.shape[0] == self.num_candidates
                    self.env[node] = Plain(new, meta, batched=rows_b)
            elif node.op == "get_attr":
                self.env[node] = Plain(self.emit("get_attr", node.target), meta)
            elif node.op == "output":
                returned = lambda v: self.materialize(v, "output", "the model returns it") if is_value(v) else v  # noqa: E731
                out = tree_map(returned, self._lookup(node.args[0]), is_leaf=is_value)
                self.graph.output(out)
            elif node in self.fused:
                self.env[node] = self.fused.pop(node)
            elif (chain := self.attention_chain(node)) is not None:
                self.env[node] = self.fuse_attention_chain(node, *chain)
            else:
                args, kwargs = self._lookup(node.args), self._lookup(node.kwargs)
                self.env[node] = self.apply(node.op, node.target, args, kwargs, meta, node.name)
        if self.sunk:
            ops_run = ", ".join(f"{op}×{n}" if n > 1 else op for op, n in self.sunk.most_common())
            self.report.rewritten.append(
                f"{sum(self.sunk.values())} row-wise ops run at U rows instead of B rows: {ops_run}"
            )
        fuse_self_target_attention(self.graph, self.report)
        module = fx.GraphModule(self.traced, self.graph, class_name="IkboRewritten")
        module.graph.eliminate_dead_code()
        module.graph.lint()
        module.recompile()
        return module, self.report

    def _lookup(self, tree):
        return tree_map(lambda a: self.env[a] if isinstance(a, fx.Node) else a, tree)

    # --- dispatch ------------------------------------------------------------------------------

    def apply(self, op, target, args, kwargs, meta, name):
        values = [v for v in tree_flatten((args, kwargs))[0] if is_value(v)]
        key = target
        if op in ("call_function", "call_method"):
            for handler in (self.replication_site, self.mapping_conversion):
                out = handler(key, args, kwargs, meta, name)
                if out is not None:
                    return out
        if not any(isinstance(v, (Rep, Concat, Rows, RepShape)) for v in values):
            return self.plain(op, target, args, kwargs, meta, name, "")
        if op not in ("call_function", "call_method"):
            return self.plain(op, target, args, kwargs, meta, name, f"{op} is not traced into")
        for handler in (self.shape_access, self.concat_ops, self.rowwise, self.joins):
            out = handler(op, key, args, kwargs, meta, name)
            if out is not None:
                return out
        return self.plain(op, target, args, kwargs, meta, name, self.why_not(key, args, kwargs, meta))

    # --- replication sites ---------------------------------------------------------------------

    def _mapping_of(self, v):
        return v.mapping if isinstance(v, Plain) else None

    def _user_tensor(self, v):
        return (
            isinstance(v, Plain)
            and not v.batched
            and v.mapping is None
            and isinstance(v.meta, Meta)
            and v.meta.ndim > 0
        )

    def replication_site(self, key, args, kwargs, meta, name):
        if key is operator.getitem and len(args) == 2:
            src, index = args
            if self._user_tensor(src) and self._mapping_of(index):
                return self.new_rep(src, self._mapping_of(index), meta, name, "x[cand_to_user]")
        if key in (torch.index_select, "index_select"):
            src, dim, index = args[0], _arg(args, kwargs, 1, "dim"), _arg(args, kwargs, 2, "index")
            if (
                self._user_tensor(src)
                and dim in (0, -src.meta.ndim if isinstance(src.meta, Meta) else 0)
                and self._mapping_of(index)
            ):
                return self.new_rep(src, self._mapping_of(index), meta, name, "index_select(0, cand_to_user)")
        if key in (torch.repeat_interleave, "repeat_interleave") and len(args) >= 2:
            src, repeats, dim = args[0], args[1], _arg(args, kwargs, 2, "dim")
            if self._user_tensor(src) and dim == 0 and not (isinstance(repeats, Plain) and repeats.batched):
                mkey = ("repeat_interleave", id(repeats) if is_value(repeats) else repeats)
                if mkey not in self.mappings:
                    node = self.emit(
                        "call_function", ops.repeat_mapping, (src.node, repeats.node if is_value(repeats) else repeats)
                    )
                    self.mappings[mkey] = Mapping(mkey, node, f"repeat_interleave at {name}")
                return self.new_rep(src, self.mappings[mkey], meta, name, "repeat_interleave(counts, dim=0)")
        if key == "expand" and self._user_tensor(args[0]) and args[0].meta.shape[0] == 1:
            sizes = list(args[1]) if len(args) == 2 and isinstance(args[1], (tuple, list)) else list(args[1:])
            if sizes and isinstance(meta, Meta) and meta.shape[0] == self.num_candidates and self.num_candidates != 1:
                rows = sizes[0]
                rows_b = self.materialize(rows, name, "") if is_value(rows) else rows
                mkey = ("expand", id(rows) if is_value(rows) else rows)
                if mkey not in self.mappings:
                    node = self.emit("call_function", ops.expand_mapping, (rows_b, args[0].node))
                    self.mappings[mkey] = Mapping(mkey, node, f"expand at {name}")
                user = self.emit("call_method", "expand", (args[0].node, 1, *[self.user_side(s) for s in sizes[1:]]))
                rep = Rep(user, self.mappings[mkey], meta, f"{name} (expand of one user row)")
                self.report.rewritten.append(f"`{name}`: expand of a single user row to B rows kept virtual")
                return rep
        return None

    def new_rep(self, src, mapping, meta, name, how):
        self.report.rewritten.append(f"`{name}`: replication {how} kept virtual (user rows stay at U)")
        return Rep(src.node, mapping, meta, f"`{name}`")

    def mapping_conversion(self, key, args, kwargs, meta, name):
        if key in CONVERSIONS and args and self._mapping_of(args[0]):
            node = self.emit(
                "call_method", key, tree_map(lambda v: v.node if is_value(v) else v, args, is_leaf=is_value), kwargs
            )
            return Plain(node, meta, batched=True, mapping=args[0].mapping)
        return None

    # --- shapes of Reps ------------------------------------------------------------------------

    def shape_access(self, op, key, args, kwargs, meta, name):
        x = args[0] if args else None
        if key is getattr and isinstance(x, Rep):
            if args[1] == "shape":
                return RepShape(self.emit("call_function", getattr, (x.user, "shape")), x.mapping, meta)
            if args[1] in ("dtype", "device", "ndim", "is_cuda", "layout"):
                return Plain(self.emit("call_function", getattr, (x.user, args[1])), meta)
        if key is operator.getitem and isinstance(x, RepShape) and isinstance(args[1], int):
            node = self.emit("call_function", operator.getitem, (x.user_shape, args[1]))
            return Rows(node, x.mapping, meta) if _norm(args[1], len(x.meta)) == 0 else Plain(node, meta)
        if key == "size" and isinstance(x, Rep):
            dim = _arg(args, kwargs, 1, "dim")
            if dim is None:
                return RepShape(self.emit("call_method", "size", (x.user,)), x.mapping, meta)
            node = self.emit("call_method", "size", (x.user, dim))
            if _norm(dim, x.meta.ndim) is None:
                return None
            return Rows(node, x.mapping, meta) if _norm(dim, x.meta.ndim) == 0 else Plain(node, meta)
        if key == "dim" and isinstance(x, Rep):
            return Plain(x.meta.ndim, meta)
        return None

    # --- row-wise ops: run at U rows -----------------------------------------------------------

    def rowwise_ok(self, key, args, kwargs, meta):
        """Does the op act on dim 0 row by row (for the batched arguments)? None if unknown."""
        if not isinstance(meta, (Meta, tuple)):
            return False
        tensors = _tensors((args, kwargs))
        x = args[0] if args else None
        if key is operator.getitem and isinstance(x, Rep) and isinstance(x.meta, tuple):
            return isinstance(args[1], int)
        if key in (torch.cat, torch.stack):
            parts, dim = args[0], _arg(args, kwargs, 1, "dim", 0)
            ndim = parts[0].meta.ndim + (key is torch.stack) if parts and is_value(parts[0]) else 0
            return (
                all(isinstance(p, Rep) for p in parts)
                and len({p.mapping.key for p in parts}) == 1
                and _off_rows(dim, ndim)
            )
        xnd = x.meta.ndim if is_value(x) and isinstance(x.meta, Meta) else None
        if key in ELEMENTWISE_FUNCTIONS or key in ELEMENTWISE_METHODS:
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
        if xnd is None or not self.batched(x) or xnd == 0:
            return False
        others_plain = all(not self.batched(t) for t in tensors if t is not x)
        if key in SOFTMAX:
            return others_plain and _off_rows(_arg(args, kwargs, 1, "dim"), xnd)
        if key in REDUCTIONS or key in (torch.sum, torch.mean, torch.amax, torch.amin, torch.logsumexp):
            dim = _arg(args, kwargs, 1, "dim")
            dims = dim if isinstance(dim, (tuple, list)) else [dim]
            return dim is not None and all(_off_rows(d, xnd) for d in dims)
        if key in ("cumsum", "cumprod", torch.cumsum, F.normalize):
            dim = _arg(args, kwargs, 1, "dim", 1 if key is F.normalize else None)
            return _off_rows(dim, xnd)
        if key in ("flatten", torch.flatten):
            return _off_rows(_arg(args, kwargs, 1, "start_dim", 0), xnd)
        if key in ("unsqueeze", torch.unsqueeze):
            return _off_rows(_arg(args, kwargs, 1, "dim"), xnd + 1)
        if key in ("squeeze", torch.squeeze):
            dim = _arg(args, kwargs, 1, "dim")
            return _off_rows(dim, xnd)
        if key in ("transpose", torch.transpose, "swapaxes"):
            return _off_rows(_arg(args, kwargs, 1, "dim0"), xnd) and _off_rows(_arg(args, kwargs, 2, "dim1"), xnd)
        if key in ("permute", torch.permute):
            dims = list(args[1]) if len(args) == 2 and isinstance(args[1], (tuple, list)) else list(args[1:])
            return bool(dims) and _norm(dims[0], xnd) == 0 and all(_norm(d, xnd) is not None for d in dims)
        if key in ("chunk", torch.chunk, "split", torch.split, "unbind", torch.unbind):
            dim = _arg(args, kwargs, 1 if key in ("unbind", torch.unbind) else 2, "dim", 0)
            return _off_rows(dim, xnd)
        if key in ("view", "reshape", torch.reshape):
            sizes = list(args[1]) if len(args) == 2 and isinstance(args[1], (tuple, list)) else list(args[1:])
            if not sizes or not isinstance(meta, Meta) or meta.shape[0] != x.meta.shape[0]:
                return False
            if any(isinstance(s, Rows) for s in sizes[1:]) or any(
                isinstance(s, Plain) and s.batched for s in sizes[1:]
            ):
                return False
            return self.is_count(sizes[0])
        if key == "expand":
            sizes = list(args[1]) if len(args) == 2 and isinstance(args[1], (tuple, list)) else list(args[1:])
            return bool(sizes) and self.is_count(sizes[0]) and not any(isinstance(s, Rows) for s in sizes[1:])
        if key is operator.getitem:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(is_value(i) for i in index) or not index:
                return False
            first = index[0]
            return isinstance(first, slice) and first == slice(None)
        if key in (F.linear,):
            return others_plain and xnd >= 2
        if key in (F.layer_norm, getattr(F, "rms_norm", None)):
            return others_plain and len(_arg(args, kwargs, 1, "normalized_shape")) < xnd
        if key is F.embedding:
            return not self.batched(_arg(args, kwargs, 1, "weight"))
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

    def is_count(self, size):
        """A view size that is the row count B (or -1 there)."""
        return (
            isinstance(size, Rows)
            or size == -1
            or (isinstance(size, Plain) and size.batched and type(size.meta) is int)
        )

    def batched(self, v):
        return isinstance(v, (Rep, Concat)) or (isinstance(v, Plain) and (v.batched or v.mapping is not None))

    def rowwise(self, op, key, args, kwargs, meta, name):
        if key is torch.cat or key is torch.stack:
            if not all(isinstance(p, Rep) for p in args[0]):
                return None
        reps = [v for v in tree_flatten((args, kwargs))[0] if isinstance(v, (Rep, Rows, RepShape))]
        flat = tree_flatten((args, kwargs))[0]
        batched_plain = [
            v for v in flat if isinstance(v, (Plain, Concat)) and self.batched(v) and isinstance(v.meta, Meta)
        ]
        if batched_plain or len({r.mapping.key for r in reps}) != 1:
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
        node = self.emit(op, key, tree_map(u, args, is_leaf=is_value), tree_map(u, kwargs, is_leaf=is_value))
        rep = reps[0]
        source = next((r.source for r in reps if isinstance(r, Rep)), "")
        if key is SDPA:
            self.report.rewritten.append(
                f"`{name}`: attention with replicated q, k, v runs at U rows (self-attention per user)"
            )
        elif isinstance(meta, Meta) and meta.ndim:
            self.sunk[_name(key)] += 1
        return Rep(node, rep.mapping, meta, source)

    # --- concat of user and candidate parts ----------------------------------------------------

    def concat_ops(self, op, key, args, kwargs, meta, name):
        if key is torch.cat:
            parts, dim = list(args[0]), _norm(_arg(args, kwargs, 1, "dim", 0), meta.ndim)
            if dim is None:
                return None
            flat = []
            for p in parts:
                flat += p.parts if isinstance(p, Concat) and p.dim == dim else [p]
            if (
                dim == 0
                or not any(isinstance(p, Rep) for p in flat)
                or not all(self.batched(p) and isinstance(p.meta, Meta) for p in flat)
            ):
                return None
            if all(isinstance(p, Rep) for p in flat) and len({p.mapping.key for p in flat}) == 1:
                return None  # row-wise
            return Concat(flat, dim, meta)
        concat = [v for v in tree_flatten((args, kwargs))[0] if isinstance(v, Concat)]
        if not concat:
            return None
        c = concat[0]
        if key is F.linear and args[0] is c and c.dim == c.meta.ndim - 1:
            weight, bias = _arg(args, kwargs, 1, "weight"), _arg(args, kwargs, 2, "bias")
            if not self.batched(weight) and not (bias is not None and self.batched(bias)):
                return self.split_linear(c, weight, bias, meta, name, weight_cols=True)
        if key in MATMUL and len(args) == 2:
            a, b = args
            if a is c and c.dim == c.meta.ndim - 1 and not self.batched(b) and b.meta.ndim == 2:
                return self.split_linear(c, b, None, meta, name, weight_cols=False)
            if b is c and c.meta.ndim == 3 and c.dim == 1 and not self.batched(a) and a.meta.ndim == 2:
                return self.split_compress(a, c, meta, name)
        if (key in ELEMENTWISE_FUNCTIONS or key in ELEMENTWISE_METHODS) and self.rowwise_ok(key, args, kwargs, meta):
            return self.split_elementwise(op, key, args, kwargs, c, meta, name)
        return None

    def _slice(self, v, dim_from_end, start, stop, name):
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
        if isinstance(v, Concat):
            offset = 0
            for p in v.parts:
                size = p.meta.shape[v.dim]
                if (offset, offset + size) == (start, stop) and v.dim == dim:
                    return p
                offset += size
            whole = self.materialize(v, "slice", "split of a concat")
            return Plain(self.emit("call_function", operator.getitem, (whole, index)), meta, True)
        return Plain(self.emit("call_function", operator.getitem, (v.node, index)), meta, v.batched)

    def split_elementwise(self, op, key, args, kwargs, c, meta, name):
        """An elementwise op over a concat: apply it to each part (the other operands sliced alike)."""
        dim_from_end = c.meta.ndim - c.dim
        parts, offset = [], 0
        for p in c.parts:
            size = p.meta.shape[c.dim]
            s = lambda v, a=offset, b=offset + size: self._slice(v, dim_from_end, a, b, name) if is_value(v) else v  # noqa: E731
            shape = list(meta.shape)
            shape[c.dim] = size
            pargs, pkwargs = tree_map(s, args, is_leaf=is_value), tree_map(s, kwargs, is_leaf=is_value)
            parts.append(
                self.apply(op, key, pargs, pkwargs, Meta(tuple(shape), meta.dtype), f"{name}[part {len(parts)}]")
            )
            offset += size
        self.report.rewritten.append(f"`{name}`: {_name(key)} over a user+candidate concat applied per part")
        if not any(isinstance(p, (Rep, Concat)) for p in parts):
            return Plain(self.emit("call_function", torch.cat, ([p.node for p in parts],), {"dim": c.dim}), meta, True)
        if all(isinstance(p, Rep) for p in parts) and len({p.mapping.key for p in parts}) == 1:
            node = self.emit("call_function", torch.cat, ([p.user for p in parts],), {"dim": c.dim})
            return Rep(node, parts[0].mapping, meta, parts[0].source)
        return Concat(parts, c.dim, meta)

    def _weight_slice(self, weight, start, stop, cols: bool):
        """weight[:, start:stop] (cols) or weight[start:stop]; constants sliced once, here."""
        index = (slice(None), slice(start, stop)) if cols else (slice(start, stop),)
        if isinstance(weight, Plain) and weight.node.op == "get_attr":
            tensor = self.fetch(weight.node.target)[index].contiguous()
            return self.emit("get_attr", self.attach("weight", tensor))
        return self.emit("call_function", operator.getitem, (weight.node, index))

    def _join(self, cand_sum, user_terms, meta):
        """cand_sum [B, ...] (or None) + Σ user_terms[mapping][m] through add_user_rows."""
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
            cand_sum = self.emit("call_function", ops.add_user_rows_broadcast, (cand_sum, total, mapping.node))
        return Plain(cand_sum, meta, True)

    def split_linear(self, c, weight, bias, meta, name, weight_cols: bool):
        """linear(cat(parts, -1), W, b) = Σ linear(part_i, W_i) + b; user parts at U rows (Type I)."""
        cand_sum, user_terms, offset = None, {}, 0
        for p in c.parts:
            size = p.meta.shape[c.dim]
            w = self._weight_slice(weight, offset, offset + size, cols=weight_cols)
            offset += size
            if isinstance(p, Rep):
                term = self.emit("call_function", F.linear if weight_cols else torch.matmul, (p.user, w))
                user_terms.setdefault(p.mapping, []).append(term)
            else:
                cand = self.materialize(p, name, "part of a concat")
                term = self.emit("call_function", F.linear if weight_cols else torch.matmul, (cand, w))
                cand_sum = term if cand_sum is None else self.emit("call_function", operator.add, (cand_sum, term))
        if bias is not None:
            b = bias.node if is_value(bias) else bias
            cand_sum = self.emit("call_function", operator.add, (cand_sum, b)) if cand_sum is not None else None
            if cand_sum is None:
                first = next(iter(user_terms.values()))
                first[0] = self.emit("call_function", operator.add, (first[0], b))
        self.report.rewritten.append(
            f"`{name}`: linear over cat(user, candidate) split (Type I): user columns at U rows, "
            "candidate columns at B rows, joined by add_user_rows"
        )
        return self._join(cand_sum, user_terms, meta)

    def split_compress(self, weight, c, meta, name):
        """matmul(W, cat(parts, dim=1)) over tokens: ikbo_linear_compress for [user, candidate]."""
        kinds = [isinstance(p, Rep) for p in c.parts]
        if kinds == [True, False] and isinstance(weight, Plain) and weight.node.op == "get_attr":
            user, cand = c.parts
            module = ops.LinearCompress(self.fetch(weight.node.target), user.meta.shape[1])
            node = self.emit(
                "call_module",
                self.attach("lce", module),
                (user.user, self.materialize(cand, name, ""), user.mapping.node),
            )
            self.report.rewritten.append(
                f"`{name}`: matmul(W, cat(user tokens, candidate tokens)) → ikbo_linear_compress (weights packed once)"
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
                term = self.emit("call_function", torch.matmul, (w, self.materialize(p, name, "")))
                cand_sum = term if cand_sum is None else self.emit("call_function", operator.add, (cand_sum, term))
        self.report.rewritten.append(
            f"`{name}`: matmul(W, cat over tokens) split (Type I): user tokens at U rows, joined by add_user_rows"
        )
        return self._join(cand_sum, user_terms, meta)

    # --- joins of user rows with candidate rows ------------------------------------------------

    def joins(self, op, key, args, kwargs, meta, name):
        flat = [v for v in tree_flatten((args, kwargs))[0] if is_value(v)]
        if any(isinstance(v, Concat) for v in flat):
            return None
        reps = [v for v in flat if isinstance(v, Rep)]
        # non-float user data (lengths, masks) is cheap to replicate: do it, then look again
        if any(isinstance(r.meta, Meta) and not r.meta.is_float for r in reps) and key is not SDPA:
            why = f"{_name(key)} combines it with candidate rows"

            def small(v):
                return (
                    Plain(self.materialize(v, name, why), v.meta, True)
                    if isinstance(v, Rep) and not v.meta.is_float
                    else v
                )

            args, kwargs = tree_map(small, args, is_leaf=is_value), tree_map(small, kwargs, is_leaf=is_value)
            return self.apply(op, key, args, kwargs, meta, name)
        if len({r.mapping.key for r in reps}) != 1 or any(isinstance(v, (Rows, RepShape)) for v in flat):
            return None
        mapping = reps[0].mapping
        if key is SDPA:
            return self.attention(args, kwargs, meta, name)
        if not self.rowwise_ok(key, args, kwargs, meta):
            return None
        if key in ADD_SUB and len(args) == 2 and not kwargs and all(is_value(a) and self.batched(a) for a in args):
            a, b = args
            sign = ADD_SUB[key]
            if isinstance(a, Rep):
                node = self.emit(
                    "call_function", ops.add_user_rows_broadcast, (b.node, a.user, mapping.node), {"cand_sign": sign}
                )
            else:
                node = self.emit(
                    "call_function", ops.add_user_rows_broadcast, (a.node, b.user, mapping.node), {"user_sign": sign}
                )
            self.report.rewritten.append(
                f"`{name}`: {_name(key)} of candidate rows and replicated user rows → add_user_rows"
            )
            return Plain(node, meta, True)
        if key in MATMUL and len(args) == 2 and all(self.batched(a) for a in args):
            a, b = args
            if a.meta.ndim == b.meta.ndim >= 3:
                cand_left = isinstance(b, Rep)
                cand, user = (a, b) if cand_left else (b, a)
                node = self.emit("call_function", ops.grouped_matmul, (cand.node, user.user, mapping.node, cand_left))
                self.report.rewritten.append(
                    f"`{name}`: batched matmul of candidate rows with replicated user rows → grouped per user "
                    "(user matrix read once per user)"
                )
                return Plain(node, meta, True)
            return None
        if key in ELEMENTWISE_FUNCTIONS or key in ELEMENTWISE_METHODS:
            return self.grouped(op, key, args, kwargs, mapping, reps, meta, name)
        return None

    def grouped(self, op, key, args, kwargs, mapping, reps, meta, name):
        tensors = []

        def slot(v):
            if not is_value(v):
                return v
            if isinstance(v, Rep):
                role, node = "user", v.user
            elif self.batched(v):
                role, node = "cand", v.node
            else:
                role, node = "plain", v.node
            tensors.append(node)
            return ops.Slot(role, len(tensors) - 1)

        sargs, skwargs = tree_map(slot, args, is_leaf=is_value), tree_map(slot, kwargs, is_leaf=is_value)
        if op == "call_method":
            fn = getattr(torch.Tensor, key)
        else:
            fn = key
        module = ops.GroupedOp(fn, sargs, skwargs, f"{_name(key)} at {name}")
        num_users = self.emit(
            "call_function", operator.getitem, (self.emit("call_function", getattr, (reps[0].user, "shape")), 0)
        )
        node = self.emit("call_module", self.attach("grouped", module), (mapping.node, num_users, *tensors))
        self.report.rewritten.append(
            f"`{name}`: {_name(key)} of candidate rows with replicated user rows → grouped per user (user row broadcast, not copied)"
        )
        return Plain(node, meta, True)

    # --- why an op was left --------------------------------------------------------------------

    def why_not(self, key, args, kwargs, meta):
        flat = [v for v in tree_flatten((args, kwargs))[0] if is_value(v)]
        reps = [v for v in flat if isinstance(v, Rep)]
        if len({r.mapping.key for r in reps}) > 1:
            return "it combines user rows replicated through different mappings"
        if any(isinstance(v, Concat) for v in flat):
            return f"{_name(key)} over a concat of user and candidate parts has no per-part form"
        if key is SDPA:
            return "attention whose mask is not a key-length prefix mask, or with dropout / is_causal / candidate K/V"
        if self.batched(args[0] if args else None) and not self.rowwise_ok(key, args, kwargs, meta):
            return f"{_name(key)} is not known to act row by row on dim 0 (e.g. it reduces or reorders candidates)"
        return f"no IKBO join for {_name(key)}"
