"""Capture: a torch.fx graph of a model that follows its Python control flow on the example.

torch.fx's symbolic tracing stops at the first `if` on a traced value, and standard modules branch
on their inputs everywhere (`BatchNorm1d._check_input_dim`, `nn.MultiheadAttention`'s fast-path and
mask checks, `nn.TransformerEncoderLayer`). Here every proxy carries its value on the example inputs
(`ShadowProxy.value`, computed as the graph is recorded), so a branch, a loop bound or a `len` is
decided by the example, as torch.dynamo does, and the decision is kept as a guard:

| what the branch reads | guard |
|---|---|
| dtypes, devices, ndims, flags of tensors | static: the transformed module checks its inputs' dtypes and ndims each call |
| a size that is not a row count (a history length, a feature width) | the inputs' non-row sizes must equal the example's, checked each call |
| a row count (U or B) or tensor values of the inputs | not followed: the module (or the model) is kept whole |

A call whose inputs differ from the example in a checked way runs the original model.

Modules (`call_module`):
- `nn.MultiheadAttention` and `nn.TransformerEncoder` are traced through their eval forms
  (`standard.py`): the same function written with linear / SDPA, which the pass can rewrite;
- RNNs (`nn.GRU`, `nn.LSTM`, `nn.RNN`) stay leaves: the pass knows they act row by row on the batch;
  so do `pack_padded_sequence` and `pad_packed_sequence` (their bodies branch on length values), one node each;
- a module without state that the forward makes and calls (`nn.Softmax(dim=-1)(x)`) is its forward's functions;
- any other module is traced into; where that fails (control flow on tensor values, an unsupported
  Python construct), its nodes are dropped and it becomes a leaf, kept whole (`Capture.opaque` says
  which and why). The pass runs such a leaf at U rows when it reads only user rows and does so
  row by row on the example.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
import sys
import threading
import traceback
import types
from collections.abc import MutableMapping, MutableSequence, MutableSet
from dataclasses import dataclass, field
from itertools import chain

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.fx._symbolic_trace import _maybe_revert_all_patches
from torch.fx.experimental.symbolic_shapes import uninteresting_files
from torch.fx.graph import _PyTreeCodeGen
from torch.fx.node import map_aggregate
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import standard
from .values import _name


def placeholder_value(examples: dict, target: str, args: tuple = ()):
    """The example's value of a placeholder: the argument of its name, or of the name fx gives the placeholder of a
    non-tensor argument (`name_<n>`), else its default (`args`); a `*args` / `**kwargs` placeholder (fx names it
    with its stars) is its tuple / dict."""
    target = target.lstrip("*")
    if target in examples:
        return examples[target]
    base = target.rsplit("_", 1)[0]
    if base in examples and target[len(base) + 1 :].isdigit():
        return examples[base]
    return args[0] if args else None


class CaptureError(Exception):
    """Control flow the capture does not follow (on tensor values or on a row count)."""


META_ATTRIBUTES = {
    "dtype", "device", "ndim", "is_cuda", "is_nested", "layout", "requires_grad", "is_sparse", "is_quantized",
    "is_meta", "is_mkldnn", "type", "is_leaf",
}  # fmt: skip
META_METHODS = {"dim", "ndimension", "is_floating_point", "is_complex", "get_device", "is_contiguous", "element_size"}
META_FUNCTIONS = {torch.is_floating_point, torch.is_complex}
# meta reads whose answer a call can change beyond what `Guarded` checks of every input (dtype, ndim, device type):
# a branch on one is recorded (`Capture.flags`) and guarded per call
FLAG_READS = {
    "is_contiguous", "requires_grad", "is_leaf", "get_device", "device", "layout", "is_nested", "is_sparse",
    "is_quantized", "is_mkldnn",
}  # fmt: skip
SIZE_METHODS = {"size"}
COUNT_METHODS = {"numel", "nelement"}  # products of every dim
PIECES = {"split", "chunk", "unbind", "tensor_split", "split_with_sizes"}  # ops returning a size-dependent count
DATA_SHAPED = {"masked_select", "nonzero", "argwhere", "unique", "unique_consecutive", "bincount", "nonzero_static"}
RNN_MODULES = (nn.RNNBase,)
DICT_VIEWS = (type({}.keys()), type({}.values()), type({}.items()))
OUT_OF_PLACE_OPERATORS = {
    operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
    operator.itruediv: operator.truediv, operator.ifloordiv: operator.floordiv, operator.imod: operator.mod,
    operator.ipow: operator.pow, operator.imatmul: operator.matmul, operator.iand: operator.and_,
    operator.ior: operator.or_, operator.ixor: operator.xor,
}  # fmt: skip
PACKING = {
    "pack_padded_sequence": nn.utils.rnn.pack_padded_sequence,
    "pad_packed_sequence": nn.utils.rnn.pad_packed_sequence,
}
_HERE = __file__.rsplit("/", 1)[0]


def user_frame() -> str:
    """file:line of the innermost frame outside torch and this package (the model's code), and of the
    innermost torch frame below it where that is where the branch is."""
    inner = ""
    for frame in reversed(traceback.extract_stack()):
        name = frame.filename
        if name.startswith(_HERE) and not name.rsplit("/", 1)[-1].startswith("zoo"):  # the pass, not a model
            continue
        if "/torch/" in name:
            if not inner and "/torch/fx/" not in name:
                inner = f" (in {name.split('/torch/')[-1]}:{frame.lineno})"
            continue
        return f"{name}:{frame.lineno}{inner}"
    return "?"


def node_source(node: fx.Node) -> str:
    """`module.path (file:line)` of a captured node: the innermost module and the model's source line."""
    stack = node.meta.get("nn_module_stack") or {}
    path = next(reversed(stack.values()))[0] if stack else ""
    where = ""
    trace = node.meta.get("stack_trace") or ""
    for line in reversed(trace.strip().splitlines()):
        line = line.strip()
        if line.startswith("File ") and "/torch/" not in line and not line.startswith(f'File "{_HERE}/capture.py'):
            parts = line.split('"')
            if len(parts) >= 3:
                where = f"{parts[1].rsplit('/', 1)[-1]}:{parts[2].split(',')[1].split()[-1]}"
            break
    if path and where:
        return f"{path} ({where})"
    return path or where


@dataclass
class Capture:
    """A captured model: the graph module, each node's example value, and what the capture decided."""

    module: fx.GraphModule
    fixed_sizes: bool = False  # a branch read a non-row size: checked on each call
    opaque: list = field(default_factory=list)  # (module path, type name, reason)
    guards: int = 0
    flags: frozenset = frozenset()  # FLAG_READS a branch followed (contiguity, requires_grad, device, ...)
    settings: dict = field(default_factory=dict)  # torch's global settings the model's code read: getter -> value
    jagged_read: frozenset = frozenset()  # the jagged inputs' counts (not rows) that a branch read


class ShadowProxy(fx.Proxy):
    """A proxy with the traced value's value on the example inputs."""

    def __init__(self, node, tracer=None):
        super().__init__(node, tracer)
        self.value = None

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return ShadowAttribute(self, name)

    def __len__(self):
        return self.tracer.concrete(self, len)

    def __index__(self):
        return self.tracer.concrete(self, operator.index)

    def __int__(self):
        return self.tracer.concrete(self, int)

    def __float__(self):
        return self.tracer.concrete(self, float)

    def __setitem__(self, key, value):
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        form = standard.FUNCTION_FORMS.get(func)
        if form is not None and (out := form(*args, **(kwargs or {}))) is not NotImplemented:
            return out
        return super().__torch_function__(func, types, args, kwargs)


def _in_place_operator(op):
    def method(self, other):
        if not isinstance(self.value, torch.Tensor):
            return NotImplemented  # an int or a tuple: Python rebinds the name to `x + y`
        return self.tracer.create_proxy("call_function", op, (self, other), {})

    return method


for _op in OUT_OF_PLACE_OPERATORS:  # `x += y` on a tensor changes x in place: other views of x see the change
    setattr(ShadowProxy, f"__{_op.__name__}__", _in_place_operator(_op))


class ShadowAttribute(fx.proxy.Attribute, ShadowProxy):
    """`proxy.attr`: its node is made only when used as a value (method calls need none)."""

    def __init__(self, root, attr):
        fx.proxy.Attribute.__init__(self, root, attr)

    @property
    def value(self):
        return getattr(self.root.value, self.attr)

    @value.setter
    def value(self, _):
        pass


def _ancestors(node):
    """`node` and every node it is computed from, each once (depth first)."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen or not isinstance(n, fx.Node):
            continue
        seen.add(n)
        yield n
        todo.extend(n.all_input_nodes)


def _value(x):
    return x.value if isinstance(x, ShadowProxy) else x


def _traced_sizes(kind, target, args) -> bool:
    """Whether an op is `x.view(sizes)` / `x.reshape(sizes)` / `torch.reshape(x, sizes)` with `sizes` one traced
    tuple (a torch.Size: `x.shape[:-1] + torch.Size([H, d])`, `x.shape`). Recorded with its sizes one by one, as
    `x.view(*sizes)` is, the rewrite reads each (the row count among them); the op is the same."""
    if len(args) != 2 or not isinstance(args[1], ShadowProxy) or not isinstance(args[1].value, tuple):
        return False
    return (
        kind == "call_method" and target in ("view", "reshape") or kind == "call_function" and target is torch.reshape
    )


class _Record:
    """A dataclass argument while the forward is traced: the graph takes its fields as a dict (`to_ikbo` converts
    the call's object), so `req.user` reads the entry `req["user"]`; a field holding no tensor (a setting) is the
    example's value, which `Guarded` checks at each call. Its class's methods and properties run on it as they are
    (`req.num_users()` reads its fields); `isinstance(req, cls)` holds. Anything else (`dataclasses.asdict(req)`,
    an attribute set on it) is not followed: the capture fails there."""

    def __init__(self, proxy, cls, fields: dict):
        object.__setattr__(self, "_proxy", proxy)
        object.__setattr__(self, "_cls", cls)
        object.__setattr__(self, "_fields", fields)

    @property
    def __class__(self):
        return object.__getattribute__(self, "_cls")

    def __getattr__(self, name):
        fields, cls = object.__getattribute__(self, "_fields"), object.__getattribute__(self, "_cls")
        if name in fields:
            value = fields[name]
            return object.__getattribute__(self, "_proxy")[name] if _traced(value) else value
        attribute = inspect.getattr_static(cls, name, None)
        if isinstance(attribute, property) and attribute.fget is not None:
            return attribute.fget(self)
        if isinstance(attribute, types.FunctionType):
            return types.MethodType(attribute, self)
        if attribute is not None:  # a class constant, a staticmethod or classmethod
            return getattr(cls, name)
        raise CaptureError(f"`{name}` of a {cls.__name__} argument is no field of the dataclass: not followed")

    def __setattr__(self, name, value):
        raise CaptureError(f"the forward sets `{name}` on its {self.__class__.__name__} argument: not followed")


class Tracer(fx.Tracer):
    """torch.fx tracing with example values (see the module doc)."""

    def __init__(self, examples: dict, rows: tuple):
        super().__init__(autowrap_functions=())
        self.examples, self.rows = examples, {r for r in rows if r is not None}
        self.record_stack_traces = True
        self.fixed_sizes = False
        self.jagged: dict = {}  # a jagged input's count (offsets' U + 1, values' N) → the arguments that carry it
        self.jagged_rows: set = set()  # those counts that are row counts (U + 1): a branch on one fails the capture
        self.jagged_read: set = set()  # the others (N) that a branch read: `Guarded` checks them
        self.guards = 0
        self.evaluating = 0  # > 0 while an op or a module kept whole runs eagerly on the example's values
        self.flags: set = set()
        self.opaque: list = []
        self.settings: dict = {}  # GLOBAL_SETTINGS the model's own code read, with the values it saw
        self.records: dict = {}  # argument name → dataclass: traced as a dict of its fields (`_Record`)

    # --- values --------------------------------------------------------------------------------

    def proxy(self, node):
        return ShadowProxy(node, self)

    def _proxy_placeholder(self, name, concrete_args, sig, fn_for_analysis):
        """A list, tuple or dict of settings (`weights=[0.3, 0.7]`, `dims=(1, 2)`) is one placeholder, and the forward
        reads the example's value: fx would make one placeholder per entry, each asserted in the graph. `Guarded`
        checks every entry on each call, as it checks other settings. A `*args` / `**kwargs` the example leaves empty
        is empty (`()`, `{}`), no placeholder: the graph takes the named arguments, and `Guarded` runs the original
        for a call that passes more."""
        if name.startswith("*") and not self.examples.get(name.lstrip("*")):
            return {} if name.startswith("**") else ()
        if name in self.records:  # a dataclass argument: a dict placeholder, its fields read as entries
            proxy = super()._proxy_placeholder(name, concrete_args, sig, fn_for_analysis)
            return _Record(proxy, self.records[name], self.examples[name])
        value = concrete_args.get(name) if concrete_args else None
        if not isinstance(value, (list, tuple, dict)):
            return super()._proxy_placeholder(name, concrete_args, sig, fn_for_analysis)
        default = sig.parameters[name].default
        self.create_proxy("placeholder", f"{name}_1", () if default is inspect.Parameter.empty else (default,), {})
        return value

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
        if _traced_sizes(kind, target, args):  # x.view(x.shape[:-1] + torch.Size([H, d])): its sizes one by one
            sizes = tuple(args[1][i] for i in range(len(args[1])))
            args = (args[0], sizes) if target is torch.reshape else (args[0], *sizes)
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        self.evaluating += 1
        try:
            with _maybe_revert_all_patches(), torch.no_grad():  # run eagerly, not traced
                value = self._evaluate(kind, target, args, kwargs)
        finally:
            self.evaluating -= 1
        if isinstance(proxy, ShadowProxy) and not isinstance(proxy, ShadowAttribute):
            proxy.value = value
        proxy.node.meta["example_value"] = value
        return proxy

    def _evaluate(self, kind, target, args, kwargs):
        if kind == "placeholder":
            return placeholder_value(self.examples, target, args)
        if kind == "get_attr":
            return self.fetch(target)
        if kind == "output":
            return None
        a, k = map_aggregate((args, kwargs), _value)
        if kind == "call_function":
            return target(*a, **k)
        if kind == "call_method":
            return getattr(a[0], target)(*a[1:], **k)
        tensors = [t for t in tree_flatten((a, k))[0] if isinstance(t, torch.Tensor) and not t.is_inference()]
        versions = [t._version for t in tensors]
        value = self.fetch(target)(*a, **k)
        if any(t._version != v for t, v in zip(tensors, versions)):
            # kept whole, it would run on the user rows themselves at U rows (the original changes a replica)
            raise CaptureError(f"module `{target}` (kept whole) changes its input in place")
        return value

    def fetch(self, target: str):
        value = self.root
        for part in target.split("."):
            value = getattr(value, part)
        return value

    # --- control flow --------------------------------------------------------------------------

    def to_bool(self, obj):
        return self.concrete(obj, bool)

    def iter(self, obj):
        value = getattr(obj, "value", None)
        if isinstance(value, (dict, *DICT_VIEWS)):
            return iter(self._dict_entries(obj.node, value))
        return iter([obj[i] for i in range(self.concrete(obj, len))])

    def _dict_entries(self, node, value) -> list:
        """A loop over a dict of tensors (`for k, v in d.items()`, `d.values()`, `d.keys()`, `d`): its keys are the
        example's (structure, not data: `Guarded` serves the original to inputs of another structure), its values
        the traced `d[k]`."""
        self.guards += 1
        if isinstance(value, dict):
            return list(value)
        whole = self.proxy(node.args[0])
        whole.value = node.args[0].meta["example_value"]
        keys = list(whole.value)
        if node.target == "keys":
            return keys
        if node.target == "values":
            return [whole[k] for k in keys]
        return [(k, whole[k]) for k in keys]

    def keys(self, obj):
        return self.concrete(obj, lambda v: list(v.keys()))

    def concrete(self, proxy, convert):
        """The example's answer for a branch / loop bound on `proxy`, kept as a guard."""
        whole_shape = self._shape_source(proxy.node)
        if convert is len and not isinstance(proxy.value, int) and (whole_shape is not None or self._sizes(proxy.node)):
            kind = "meta"  # len(x.shape), len(x.size()[:-1] + (H, d)): the number of dims
        elif convert is len and isinstance(proxy.value, (tuple, list)) and proxy.node.op != "placeholder":
            kind = self._pieces_depend_on(proxy.node)
        elif convert is len and isinstance(proxy.value, (tuple, list)):
            kind = "meta"  # an argument's tuple or list (`f(*user)`): its structure, which `Guarded` checks
        else:
            kind = self._depends_on(proxy.node)
        where = user_frame()
        if kind == "data":
            raise CaptureError(f"Python control flow on tensor values at {where}")
        if kind == "rows":
            raise CaptureError(f"Python control flow on the number of users or candidates at {where}")
        self.fixed_sizes |= kind == "size"
        if kind == "meta":
            self.flags |= self._flag_reads(proxy.node)
        self.guards += 1
        return convert(proxy.value)

    def _flag_reads(self, node) -> set:
        """The FLAG_READS among the meta reads `node` is computed from (`x.device.type` reads x.device too)."""
        names = {n.args[1] if n.op == "call_function" and n.target is getattr else _name(n.target)
                 for n in _ancestors(node) if self._is_meta(n)}  # fmt: skip
        return names & FLAG_READS

    def _depends_on(self, node) -> str:
        """'data', 'rows', 'size' or 'meta': what the value of `node` depends on among the inputs."""
        kinds, seen, todo = set(), set(), [node]
        while todo:
            n = todo.pop()
            if n in seen or not isinstance(n, fx.Node):
                continue
            seen.add(n)
            shape_source = self._shape_source(n)
            if shape_source is not None:
                source, sizes = shape_source
                if self._data_shaped(source):  # x[mask].shape[0], masked_select(...).numel(): counts of values
                    kinds.add("data")
                elif self._from_inputs(source):
                    kinds.add(self._size_kind(source, sizes))
                continue
            if self._is_meta(n):
                continue
            if n.op == "placeholder":
                kinds.add("data")
                continue
            todo.extend(n.all_input_nodes)
        for kind in ("data", "rows", "size"):
            if kind in kinds:
                return kind
        return "meta"

    def _size_kind(self, source, sizes) -> str:
        """'rows' where a size read from `source` is a row count: U or B, or a jagged input's count of rows (the
        offsets' U + 1) read from a tensor computed from that input; else 'size'. A jagged count that is no row count
        (the values' N) read so is recorded (`jagged_read`). Sizes are told by value: a jagged count read from a
        tensor computed from other inputs only is a size like any other."""
        kind = "rows" if any(s in self.rows for s in sizes) else "size"
        jagged = [s for s in sizes if s in self.jagged]
        if jagged:
            inputs = {n.target for n in _ancestors(source) if n.op == "placeholder"}
            for s in jagged:
                if inputs & self.jagged[s]:
                    if s in self.jagged_rows:
                        kind = "rows"
                    else:
                        self.jagged_read.add(s)
        return kind

    def _sizes(self, n) -> bool:
        """Whether `n` is a tuple of sizes built from shapes: x.shape / x.size(), slices of it, and concatenations
        with constant tuples (`x.size()[:-1] + (heads, head_dim)`, as Hugging Face's `transpose_for_scores`)."""
        if not isinstance(n, fx.Node):
            return isinstance(n, tuple) and all(isinstance(v, int) for v in n)
        if not isinstance(n.meta.get("example_value"), tuple):
            return False
        if self._shape_source(n) is not None:
            return True
        if n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[1], slice):
            return self._sizes(n.args[0])
        if n.op == "call_function" and n.target is operator.add:
            return all(self._sizes(a) for a in n.args)
        return False

    def _pieces_depend_on(self, node) -> str:
        """What the number of tensors an op returns depends on: for split / chunk / unbind / tensor_split, the
        size of the dim they cut (a row count, or another size; of a parameter or buffer, a constant of the model) and
        their other arguments; for `tolist`, the
        tensor's sizes (`for v in x.tolist()` unrolls over its rows); any other op returns
        a fixed structure (topk's values and indices, an RNN's output and state); a slice of pieces, theirs."""
        target = node.target
        name = target if isinstance(target, str) else getattr(target, "__name__", "")
        value = node.args[0].meta.get("example_value") if node.args and isinstance(node.args[0], fx.Node) else None
        if name == "tolist" and isinstance(value, torch.Tensor):  # nested lists, a level per dim: their lengths
            if self.rows.intersection(value.shape):
                return "rows"
            return "size" if self._from_inputs(node.args[0]) else "meta"
        if name not in PIECES or not node.args:
            sequences = [a for a in node.all_input_nodes if isinstance(a.meta.get("example_value"), (tuple, list))]
            if not sequences:
                return "meta"
            if target is operator.getitem and isinstance(node.args[0], fx.Node):
                return self._pieces_depend_on(node.args[0])
            return self._depends_on(node)
        source = node.args[0]
        value = getattr(source, "meta", {}).get("example_value") if isinstance(source, fx.Node) else None
        if not isinstance(value, torch.Tensor):
            return self._depends_on(node)
        position = 1 if name == "unbind" else 2
        dim = node.kwargs.get("dim", node.args[position] if len(node.args) > position else 0)
        if not isinstance(dim, int) or not value.dim():
            return self._depends_on(node)
        size = value.shape[dim]
        if not self._from_inputs(source):  # a parameter's or buffer's pieces (`self.w.unbind(0)`): fixed by the model
            kinds = {"meta"}
        else:
            kinds = {"rows" if dim % value.dim() == 0 else self._size_kind(source, (size,))}
        kinds |= {self._depends_on(a) for a in node.all_input_nodes if a is not source}
        for kind in ("data", "rows", "size"):
            if kind in kinds:
                return kind
        return "meta"

    def _shape_source(self, n):
        """(tensor node, sizes read) if `n` reads sizes of a tensor (x.shape, x.size(), x.shape[i]...)."""
        value = n.meta.get("example_value")
        if n.op == "call_function" and n.target is getattr and n.args[1] == "shape":
            return n.args[0], tuple(value) + self._folded_rows(n.args[0])
        if n.op == "call_method" and n.target in COUNT_METHODS and isinstance(n.args[0], fx.Node):
            inner = self._shape_source(n.args[0])  # x.shape.numel()
            if inner is not None:
                return inner
            shape = getattr(n.args[0].meta.get("example_value"), "shape", None)  # x.numel(): every dim
            return n.args[0], (*tuple(shape or ()), value) + self._folded_rows(n.args[0])
        if n.op == "call_method" and n.target in SIZE_METHODS:
            sizes = (value,) if isinstance(value, int) else tuple(value)
            return n.args[0], sizes + self._folded_rows(n.args[0])
        if n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], fx.Node):
            inner = self._shape_source(n.args[0])
            if inner is not None and isinstance(value, int):
                return inner[0], (value,) + self._folded_rows(inner[0])
        return None

    def _folded_rows(self, n) -> tuple:
        """The row count a view-like op folded into another dim of its result (`x.view(-1)`, `x.flatten()`,
        `x.reshape(-1, 4)` of x with rows on dim 0), so that a size read from it counts as reading the rows."""
        if not (isinstance(n, fx.Node) and n.op in ("call_method", "call_function") and n.args):
            return ()
        if _name(n.target) not in ("view", "reshape", "flatten", "ravel", "unflatten", "view_as", "reshape_as"):
            return ()
        source, result = n.args[0], n.meta.get("example_value")
        before = getattr(source.meta.get("example_value"), "shape", None) if isinstance(source, fx.Node) else None
        if not before or not isinstance(result, torch.Tensor) or before[0] not in self.rows:
            return ()
        return () if result.dim() and result.shape[0] == before[0] else (before[0],)

    def _is_meta(self, n) -> bool:
        if n.op == "call_function" and n.target is getattr and n.args[1] in META_ATTRIBUTES:
            return True
        if n.op == "call_method" and n.target in META_METHODS:
            return True
        return n.op == "call_function" and n.target in META_FUNCTIONS

    @staticmethod
    def _upstream(node, test) -> bool:
        """Whether `test` holds for `node` or any node it is computed from."""
        return any(map(test, _ancestors(node)))

    def _data_shaped(self, node) -> bool:
        """Whether a tensor's shape may depend on tensor values: it or a tensor it is computed from comes out of an
        op whose output size counts values (boolean indexing, masked_select, nonzero, unique, repeat_interleave by
        a tensor, ...)."""

        def counts_values(n) -> bool:
            name = _name(n.target) if n.op in ("call_function", "call_method") else ""
            if name in DATA_SHAPED:
                return True
            if name == "repeat_interleave":
                return any(
                    isinstance(a, fx.Node) and isinstance(a.meta.get("example_value"), torch.Tensor)
                    for a in n.args[1:2]
                )
            if name in ("getitem", "__getitem__") and len(n.args) == 2:
                index = n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)
                return any(getattr(i.meta.get("example_value"), "dtype", None) == torch.bool for i in index
                           if isinstance(i, fx.Node))  # fmt: skip
            return False

        return self._upstream(node, counts_values)

    def _from_inputs(self, node) -> bool:
        return self._upstream(node, lambda n: n.op == "placeholder")

    # --- modules -------------------------------------------------------------------------------

    def is_leaf_module(self, m, qualified_name) -> bool:
        return isinstance(m, RNN_MODULES)

    def call_module(self, m, forward, args, kwargs):
        if not self._installed(m) and next(chain(m.parameters(), m.buffers()), None) is None:
            # a module made in the forward without state (`nn.Softmax(dim=-1)(x)`, RecBole's `nn.ZeroPad2d(pad)(x)`):
            # its forward is the functions it calls, with the arguments the forward gave it
            return forward(*args, **kwargs)
        form = standard.MODULE_FORMS.get(type(m))
        if form is not None:
            return super().call_module(m, lambda *a, **k: form(m, *a, **k), args, kwargs)
        if self.is_leaf_module(m, ""):
            return super().call_module(m, forward, args, kwargs)
        last = next(iter(reversed(self.graph.nodes)))  # reversed() gives a view in some torch versions
        stack, guards, fixed, flags = dict(self.module_stack), self.guards, self.fixed_sizes, set(self.flags)
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception as e:  # any failure inside: keep the module whole
            for node in reversed(list(self.graph.nodes)):
                if node is last:
                    break
                self.graph.erase_node(node)
            self.module_stack.clear()
            self.module_stack.update(stack)
            self.guards, self.fixed_sizes, self.flags = guards, fixed, flags
            path = self.path_of_module(m)
            self.opaque.append((path, type(m).__name__, f"{type(e).__name__}: {e}".splitlines()[0][:200]))
            return self.create_proxy("call_module", path, args, kwargs)

    def _installed(self, m) -> bool:
        """Whether `m` is a submodule of the traced model (not one its forward made)."""
        try:
            self.path_of_module(m)
        except NameError:
            return False
        return True


GLOBAL_SETTINGS = (
    torch.is_grad_enabled, torch.is_inference_mode_enabled, torch.get_default_dtype,
    torch.are_deterministic_algorithms_enabled, torch.is_deterministic_algorithms_warn_only_enabled,
    torch.get_num_threads,
)  # fmt: skip  # process-wide settings a forward may branch on (`if torch.is_grad_enabled():`), read at each call


def _model_frame(frame) -> bool:
    """Whether `frame` runs the model's code: not torch's (whose own reads of these settings the eval forms model)
    and not the pass's."""
    name = frame.f_code.co_filename
    if name.startswith(_HERE) and not name.rsplit("/", 1)[-1].startswith("zoo"):
        return False
    return "/torch/" not in name


FACTORIES = ("zeros", "ones", "empty", "full", "rand", "randn", "randint", "eye")
DTYPE_INFO = ("finfo", "iinfo")  # of a traced tensor's dtype: the example's (Hugging Face's `finfo(dtype).min` masks)
SIZED_METHODS = ("expand", "repeat", "view", "reshape", "broadcast_to", "tile", "new_zeros", "new_ones", "new_empty",
                 "new_full")  # fmt: skip  # sizes as ints: a traced size on a constant tensor is recorded too


@contextlib.contextmanager
def _traced_factories(tracer, model: nn.Module):
    """torch.zeros(n, d) and the like with a traced size become graph nodes (torch's argument parser
    rejects a proxy inside a size list before __torch_function__ is consulted); so do the sequence packing
    functions, reached through `nn.utils.rnn` or imported by name into the module of a forward the model runs
    (fx's own autowrap would mark their nodes for codegen with a dotted name its next trace cannot find); `len`
    of a traced tensor in those modules is its traced size(0); `@torch.jit.script` functions they name run as the
    Python they were scripted from; the transformer layers' `F._none_or_dtype` takes a traced mask."""

    def wrap(original):
        def factory(*args, **kwargs):
            if any(isinstance(a, fx.Proxy) for a in tree_flatten((args, kwargs))[0]):
                return tracer.create_proxy("call_function", original, args, kwargs)
            return original(*args, **kwargs)

        return factory

    def traced_len(obj):  # len(x) of a traced tensor is x.size(0), like x.shape[0] (e.g. `B = len(cand_to_user)`)
        if isinstance(obj, ShadowProxy) and isinstance(obj.value, torch.Tensor) and obj.value.dim() > 0:
            return obj.size(0)
        return len(obj)

    def wrap_setting(getter):
        def setting():  # a setting the model's code reads is kept, as Guarded checks it at each call
            value = getter()
            if _model_frame(sys._getframe(1)):
                tracer.settings[getter] = value
            return value

        return setting

    def traced_info(original):  # torch.finfo(x.dtype): the example's dtype (dtypes are checked at each call)
        def info(*args, **kwargs):
            args, kwargs = map_aggregate((args, kwargs), lambda a: a.value if isinstance(a, ShadowProxy) else a)
            return original(*args, **kwargs)

        return info

    none_or_dtype = getattr(F, "_none_or_dtype", None)

    def traced_none_or_dtype(mask):  # the transformer layers' mask check: a traced mask has its example's dtype
        if isinstance(mask, ShadowProxy) and isinstance(mask.value, torch.Tensor):
            return mask.value.dtype
        return none_or_dtype(mask)

    def wrap_method(name, original):
        def method(self, *args, **kwargs):
            if any(isinstance(a, fx.Proxy) for a in tree_flatten((args, kwargs))[0]):
                return tracer.create_proxy("call_method", name, (self, *args), kwargs)
            return original(self, *args, **kwargs)

        return method

    autocast = torch.amp.autocast_mode.autocast
    enter_autocast = autocast.__enter__

    def traced_autocast(self):  # the graph would not keep the region: the module entering it is kept whole
        if not tracer.evaluating:
            raise CaptureError(
                f"the forward enters torch.autocast at {user_frame()}, a region the graph would not keep"
            )
        return enter_autocast(self)

    originals = {name: getattr(torch, name) for name in FACTORIES}
    info_types = {name: getattr(torch, name) for name in DTYPE_INFO}
    methods = {name: (getattr(torch.Tensor, name), name in vars(torch.Tensor)) for name in SIZED_METHODS}
    scopes = {id(g): g for m in model.modules() if (g := getattr(type(m).forward, "__globals__", None)) is not None}
    lens = [g for g in scopes.values() if "len" not in g]  # the forwards' modules: their `len` is the builtin
    scopes[id(vars(nn.utils.rnn))] = vars(nn.utils.rnn)
    packing = {id(fn) for fn in PACKING.values()}
    imported = [(g, key, value) for g in scopes.values() for key, value in list(g.items()) if id(value) in packing]
    settings = {id(fn) for fn in GLOBAL_SETTINGS}  # `from torch import is_grad_enabled` too
    read = [(g, key, value) for g in scopes.values() for key, value in list(g.items()) if id(value) in settings]
    read += [(vars(torch), fn.__name__, fn) for fn in GLOBAL_SETTINGS]
    scripted = _scripted_functions(scopes.values())
    try:
        autocast.__enter__ = traced_autocast
        for scope, key, fn in read:
            scope[key] = wrap_setting(fn)
        for name, fn in originals.items():
            setattr(torch, name, wrap(fn))
        for name, (fn, _) in methods.items():  # a buffer or constant of the model expanded by a traced size
            setattr(torch.Tensor, name, wrap_method(name, fn))
        for scope, key, fn in imported:
            scope[key] = wrap(fn)
        for scope, key, fn in scripted:
            scope[key] = fn._torchdynamo_inline
        for scope in lens:
            scope["len"] = traced_len
        if none_or_dtype is not None:
            F._none_or_dtype = traced_none_or_dtype
        for name in DTYPE_INFO:
            setattr(torch, name, traced_info(info_types[name]))
        yield
    finally:
        autocast.__enter__ = enter_autocast
        for scope, key, fn in read:
            scope[key] = fn
        for name, fn in originals.items():
            setattr(torch, name, fn)
        for name, (fn, own) in methods.items():
            if own:
                setattr(torch.Tensor, name, fn)
            else:
                delattr(torch.Tensor, name)  # inherited from torch._C.TensorBase
        for scope, key, fn in imported + scripted:
            scope[key] = fn
        for scope in lens:
            scope.pop("len", None)
        if none_or_dtype is not None:
            F._none_or_dtype = none_or_dtype
        for name in DTYPE_INFO:
            setattr(torch, name, info_types[name])


def _scripted_functions(scopes) -> list:
    """(globals, name, function) of each `@torch.jit.script` function named in `scopes` and in the Python functions
    they were scripted from (helpers of helpers): TorchScript's argument parser rejects a proxy, so the trace calls
    the Python function instead (`_torchdynamo_inline`, which torch.jit.script keeps for torch.dynamo), which
    computes the same ops."""
    found, seen, todo = [], set(), list(scopes)
    while todo:
        scope = todo.pop()
        if id(scope) in seen:
            continue
        seen.add(id(scope))
        for key, value in list(scope.items()):
            inline = getattr(value, "_torchdynamo_inline", None)
            if isinstance(value, torch.jit.ScriptFunction) and inline is not None:
                found.append((scope, key, value))
                todo.append(inline.__globals__)
    return found


def capture(
    model: nn.Module, examples: dict, rows: tuple, records: dict | None = None, jagged: tuple = ({}, ())
) -> Capture:
    """Trace `model` on `examples` (forward's arguments by name; `records`: those that are dataclasses in the call,
    by name → class, given here as dicts of their fields; `jagged`: the jagged inputs' counts → the arguments holding
    them, and which of those counts are row counts); raises where the model's own forward cannot be followed (the
    message names the source line)."""
    uninteresting_files()  # its lazy imports must not happen inside the trace (fx patches Module.__call__)
    tracer = Tracer(examples, rows)
    tracer.records = dict(records or {})
    tracer.jagged, tracer.jagged_rows = dict(jagged[0]), set(jagged[1])
    concrete = {k: v for k, v in examples.items() if not _traced(v)}
    # a forward may assign attributes (RecBole's Dice: `self.alpha = self.alpha.to(x.device)`) or fill containers:
    # the trace would leave proxies there; the model is kept as it was
    saved = [(m, _state(m)) for m in model.modules()]
    buffers = {name: b.clone() for name, b in model.named_buffers()}  # a buffer changed in place runs untraced
    with CAPTURE_LOCK:  # the patched torch functions are process-wide: one capture at a time
        try:
            # traced with grad on: a `torch.no_grad()` the forward enters itself is then seen (standard.CALLER_GRAD)
            standard.CALLER_GRAD.append(True)
            try:
                with _traced_factories(tracer, model), torch.enable_grad():
                    graph = tracer.trace(model, concrete_args=concrete or None)
                _unflatten_output(graph)
                _required_placeholders(graph)
            finally:
                standard.CALLER_GRAD.pop()
            names = [name for name, _ in model.named_modules()]
            stateful = [f"`{name + '.' if name else ''}{key}`" for (m, state), name in zip(saved, names)
                        for key in _written(tracer, m, state)]  # fmt: skip
            stateful += [f"`{name}`" for name, b in model.named_buffers() if name in buffers
                         and not torch.equal(b, buffers[name])]  # fmt: skip
            if stateful:
                raise CaptureError(
                    f"the forward keeps state in {', '.join(stateful[:3])} (changes it on each call): a rewritten "
                    "graph would not"
                )
            for m, state in saved:  # the graph reads attributes by get_attr: their values before the trace
                _restore(m, state, drop_new=False)
            module = fx.GraphModule(_root_for(model, graph), graph, class_name=type(model).__name__)
            module.training = model.training
        finally:  # the model as it was; attributes the trace added (fx's `_tensor_constant*`) now live in `module`
            for m, state in saved:
                _restore(m, state, drop_new=True)
            for name, b in model.named_buffers():
                if name in buffers and not torch.equal(b, buffers[name]):
                    b.copy_(buffers[name])
    return Capture(
        module,
        tracer.fixed_sizes,
        tracer.opaque,
        tracer.guards,
        frozenset(tracer.flags),
        tracer.settings,
        frozenset(tracer.jagged_read),
    )


def _graph_module_names() -> frozenset:
    """Attribute names a GraphModule sets or defines beyond nn.Module's (`graph`, `meta`, `code`, `shape_env`, …)."""
    empty = fx.GraphModule(nn.Module(), fx.Graph())
    ours = set(dir(fx.GraphModule)) | set(vars(empty))
    return frozenset(ours - set(dir(nn.Module)) - set(vars(nn.Module())))


GRAPH_MODULE_NAMES = _graph_module_names()


def _root_for(model: nn.Module, graph: fx.Graph):
    """The root a GraphModule copies the graph's submodules and attributes from: the model, or where one's top-level
    name is one a GraphModule uses itself (a meta-learner `self.meta`, a GNN's `self.graph`: copied there, then
    overwritten, or refused by nn.Module), a dict of every target with those renamed in the graph."""
    targets = {n.target for n in graph.nodes if n.op in ("call_module", "get_attr")}
    clash = {t.split(".")[0] for t in targets} & GRAPH_MODULE_NAMES
    if not clash:
        return model
    taken = {t.split(".")[0] for t in targets} | set(dir(model))
    renamed = {}
    for name in sorted(clash):
        new = f"{name}_"
        while new in taken or new in GRAPH_MODULE_NAMES:
            new += "_"
        taken.add(new)
        renamed[name] = new
    root = {}
    for node in graph.nodes:
        if node.op in ("call_module", "get_attr"):
            head, _, rest = node.target.partition(".")
            obj = model.get_submodule(node.target) if node.op == "call_module" else _attr_at(model, node.target)
            if head in renamed:
                node.target = renamed[head] + ("." + rest if rest else "")
            root[node.target] = obj
    return root


def _attr_at(model: nn.Module, target: str):
    obj = model
    for atom in target.split("."):
        obj = getattr(obj, atom)
    return obj


def _required_placeholders(graph: fx.Graph) -> None:
    """Placeholders before one without a default lose theirs (a keyword-only parameter with a default before one
    without, `forward(self, x, *, scale=1.0, cand_to_user)`, would make the graph's positional `forward` invalid
    Python): the graph's caller passes every argument up to the last it takes (`Guarded`)."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    required = [i for i, n in enumerate(placeholders) if not n.args]
    for n in placeholders[: required[-1] if required else 0]:
        n.args = ()


def _unflatten_output(graph: fx.Graph) -> None:
    """Where a list, tuple or dict of settings was an argument, fx's graph takes its arguments and returns its outputs
    flattened (`_PyTreeCodeGen`); the placeholders are one per argument all the same (`Tracer._proxy_placeholder`):
    the output is given its structure back and the graph the plain calling convention."""
    codegen = graph._codegen
    if isinstance(codegen, _PyTreeCodeGen):
        output = next(n for n in reversed(graph.nodes) if n.op == "output")
        output.args = (tree_unflatten(list(output.args[0]), codegen.pytree_info.out_spec),)
        graph.set_codegen(fx.graph.CodeGen())


CAPTURE_LOCK = threading.RLock()
REGISTRIES = ("_parameters", "_buffers", "_modules")


def _state(module: nn.Module) -> dict:
    """A module's attributes: each value, with the contents of a list / dict / set / deque (and of its registries)
    and a copy of a tensor attribute that is no parameter or buffer."""
    state = {}
    for key, value in vars(module).items():
        contents = None
        if isinstance(value, (MutableSequence, MutableMapping, MutableSet)):
            contents = dict(value) if isinstance(value, MutableMapping) else list(value)
        elif isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
            contents = value.detach().clone()
        state[key] = (value, contents)
    return state


def _written(tracer, module: nn.Module, state: dict) -> list:
    """Attributes the forward changed as state: rebound to a value computed from the inputs' data or sizes, or to
    another Python value (`self.prev = out.mean()`, `self.count += 1`), containers it filled or emptied
    (`self.seen.append(x.size(0))`, a memo), tensor attributes it changed in place. A value of constants and of the
    inputs' dtypes and devices (RecBole's `self.alpha = self.alpha.to(x.device)`) is not state."""
    written = []
    for key, value in vars(module).items():
        if key.startswith("_tensor_constant"):
            continue
        if key in REGISTRIES:  # a parameter, buffer or submodule registered (or removed) in the forward
            if value.keys() != state[key][1].keys():
                written.append(key.strip("_"))
            continue
        if key not in state:
            written.append(key)
            continue
        old, contents = state[key]
        if value is not old:
            if isinstance(value, fx.Proxy):
                changed = tracer._depends_on(value.node) != "meta"
            else:
                changed = not (type(value) is type(old) and not isinstance(value, torch.Tensor) and value == old)
        elif isinstance(contents, torch.Tensor):
            changed = not torch.equal(value, contents)
        elif isinstance(contents, dict):
            changed = value.keys() != contents.keys() or any(value[k] is not contents[k] for k in contents)
        elif contents is not None:
            now = list(value)
            changed = len(now) != len(contents) or any(a is not b for a, b in zip(now, contents))
        else:
            changed = False
        if changed:
            written.append(key)
    return written


def _restore(module: nn.Module, state: dict, drop_new: bool) -> None:
    attributes = vars(module)
    for key in [k for k in attributes if k not in state] if drop_new else []:
        del attributes[key]
    for key, (value, contents) in state.items():
        attributes[key] = value
        if isinstance(contents, torch.Tensor):
            if not torch.equal(value, contents):
                with torch.no_grad():
                    value.copy_(contents)
        elif isinstance(contents, dict):
            value.clear()
            value.update(contents)
        elif contents is not None:
            value.clear()
            (value.update if isinstance(value, MutableSet) else value.extend)(contents)


IN_PLACE_OPERATORS = {operator.setitem, *OUT_OF_PLACE_OPERATORS}


def mutated_input(node: fx.Node, root: nn.Module) -> fx.Node | None:
    """The node whose tensor `node` changes in place, or None: `x.mul_(…)` and every method ending in `_`,
    `F.relu_(x)` and every function ending in `_`, `F.relu(x, inplace=True)`, a module with `inplace=True`
    (nn.ReLU(inplace=True)), `x[i] = v`, `operator.iadd`, the `out=` of any op. Such a node counts for its effect
    even where its result goes unused (`h.masked_fill_(pad, 0)`): later readers of x see the result."""
    if isinstance(node.kwargs.get("out"), fx.Node):  # torch.tanh(x, out=y) writes y
        return node.kwargs["out"]
    first = node.args[0] if node.args else None
    if not isinstance(first, fx.Node):
        return None
    if node.op == "call_method":
        name = node.target
    elif node.op == "call_function":
        if node.target in IN_PLACE_OPERATORS or node.kwargs.get("inplace") is True:
            return first
        if getattr(node.target, "__module__", None) in ("_operator", "operator"):
            return None  # operator.and_ is `&`, not in place
        name = getattr(node.target, "__name__", "")
    elif node.op == "call_module":
        return first if getattr(root.get_submodule(node.target), "inplace", False) is True else None
    else:
        return None
    return first if name.endswith("_") and not name.endswith("__") else None


# ops whose result may share its first argument's storage: views, and conversions that return their input as is
# (`to`, `float`, `contiguous` of a tensor that is already so; dropout in eval)
VIEW_METHODS = {
    "view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "transpose", "permute", "t", "narrow",
    "select", "squeeze", "unsqueeze", "expand", "expand_as", "split", "chunk", "unbind", "tensor_split",
    "split_with_sizes", "diagonal", "unfold", "as_strided", "detach", "contiguous", "movedim", "moveaxis",
    "swapaxes", "swapdims", "view_as_real", "view_as_complex", "to", "type", "type_as", "float", "double", "half",
    "bfloat16", "long", "int", "bool", "cpu", "cuda", "ravel", "positive", "conj", "resolve_conj", "resolve_neg",
    "adjoint", "hsplit", "vsplit", "dsplit", "align_as", "sum_to_size",
}  # fmt: skip
VIEW_FUNCTIONS = {
    torch.reshape, torch.flatten, torch.unflatten, torch.transpose, torch.permute, torch.t, torch.narrow,
    torch.select, torch.squeeze, torch.unsqueeze, torch.split, torch.chunk, torch.unbind, torch.tensor_split,
    torch.diagonal, torch.as_strided, torch.detach, torch.movedim, torch.moveaxis, torch.swapaxes, torch.swapdims,
    torch.real, torch.imag, torch.view_as_real, torch.view_as_complex, torch.broadcast_to, F.dropout, F.dropout1d,
    F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout, torch.ravel, torch.atleast_1d,
    torch.atleast_2d, torch.atleast_3d, torch.hsplit, torch.vsplit, torch.dsplit, torch.broadcast_tensors,
    torch.positive, torch.conj, torch.resolve_conj, torch.resolve_neg, torch.adjoint,
}  # fmt: skip
VIEW_ATTRIBUTES = {"T", "mT", "H", "mH", "real", "imag", "data"}
RESHAPING_IN_PLACE = {"squeeze_", "unsqueeze_", "t_", "transpose_", "swapdims_", "swapaxes_", "resize_", "resize_as_",
                      "as_strided_", "set_", "detach_", "requires_grad_"}  # fmt: skip


def basic_index(index) -> bool:
    """`x[index]` is a view of x: ints, slices, None, Ellipsis (and 0-dim integer tensors), no tensor index."""

    def basic(entry):
        if isinstance(entry, fx.Node):
            value = entry.meta.get("example_value")
            if isinstance(value, torch.Tensor):
                return value.dim() == 0 and not value.is_floating_point() and value.dtype != torch.bool
            return isinstance(value, int)
        if isinstance(entry, slice):
            return all(e is None or basic(e) for e in (entry.start, entry.stop, entry.step))
        return entry is None or entry is Ellipsis or isinstance(entry, int)

    return all(basic(e) for e in (index if isinstance(index, tuple) else (index,)))


def aliased_input(node: fx.Node, root: nn.Module) -> fx.Node | None:
    """The node whose storage `node`'s value may share, or None: the input of a view (VIEW_METHODS,
    VIEW_FUNCTIONS, `x.T`, `x[basic index]`, a piece of split / chunk / unbind: an item of their tuple), of an
    in-place op (`mutated_input`: `x.clamp_()` returns x), and of any op whose value shares an input's storage on
    the example (`_sharing_input`: what the names miss)."""
    mutated = mutated_input(node, root)
    if mutated is not None:
        return mutated
    first = node.args[0] if node.args else None
    if not isinstance(first, fx.Node) or node.op not in ("call_method", "call_function"):
        return _sharing_input(node)
    if node.op == "call_method" and node.target in VIEW_METHODS:
        return first
    if node.op != "call_function":
        return _sharing_input(node)
    if node.target in VIEW_FUNCTIONS or node.target is getattr and node.args[1] in VIEW_ATTRIBUTES:
        return first
    if node.target is operator.getitem:
        container = isinstance(first.meta.get("example_value"), (tuple, list))
        return first if container or basic_index(node.args[1]) else None
    return _sharing_input(node)


def _storages(value) -> set:
    """The storages (data pointers) of the tensors in a value; empty tensors own none."""
    leaves = tree_flatten(value)[0] if isinstance(value, (tuple, list, dict)) else [value]
    return {
        t.untyped_storage().data_ptr()
        for t in leaves
        if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.untyped_storage().nbytes()
    }


def _sharing_input(node: fx.Node) -> fx.Node | None:
    """The input whose storage `node`'s value shares on the example, whatever the op is called (torch.hsplit,
    ravel, atleast_2d, broadcast_tensors, positive, conj, nn.Identity, …), or None."""
    mine = _storages(node.meta.get("example_value"))
    if not mine:
        return None
    return next((a for a in node.all_input_nodes if _storages(a.meta.get("example_value")) & mine), None)


def alias_root(node: fx.Node, root: nn.Module) -> fx.Node:
    """The node that owns the storage `node`'s value may share (`aliased_input` followed back)."""
    while (up := aliased_input(node, root)) is not None:
        node = up
    return node


def write_back_views(module: fx.GraphModule) -> None:
    """An in-place op through a view `x = r[index]` (basic index) of a tensor r that is no view itself, as in
    `u[:, :3].clamp_(-3, 3)` or `u[i][j] = v`, becomes a write into r: `t = x.clamp(-3, 3)` (where the op has no
    out-of-place form, a clone of x changed in place), `r[index] = t`, and every later reader of x or of the op's
    result reads `r[index]` again. The rewrite handles an assignment into r for every form of r (into a replicated
    tensor at U rows); through the view it would change x alone, not r."""
    graph = module.graph
    for node in list(graph.nodes):
        view = mutated_input(node, module)
        if view is None or view.op != "call_function" or view.target is not operator.getitem:
            continue
        base, index = view.args
        if not isinstance(base, fx.Node) or not isinstance(base.meta.get("example_value"), torch.Tensor):
            continue
        if not basic_index(index) or aliased_input(base, module) is not None or node.target in RESHAPING_IN_PLACE:
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        later = [u for u in view.users if order[u] > order[node]]
        with graph.inserting_before(node):
            name, kwargs = node.target, {k: v for k, v in node.kwargs.items() if k != "inplace"}
            if node.op == "call_method" and hasattr(torch.Tensor, name[:-1]):
                value = graph.call_method(name[:-1], node.args, kwargs)
            elif node.op == "call_function" and (name in OUT_OF_PLACE_OPERATORS or node.kwargs.get("inplace")):
                value = graph.call_function(OUT_OF_PLACE_OPERATORS.get(name, name), node.args, kwargs)
            else:
                value = graph.call_method("clone", (view,))
                graph.node_copy(node, lambda a: value if a is view else a)
            write = graph.call_function(operator.setitem, (base, index, value))
            fresh = graph.call_function(operator.getitem, (base, index))
        for new in (value, write, fresh, *value.users):
            new.meta.update({k: node.meta[k] for k in ("stack_trace", "nn_module_stack") if k in node.meta})
        write.meta["in_place"] = _name(node.target)
        fresh.meta["example_value"] = view.meta.get("example_value")
        for user in later:
            user.replace_input_with(view, fresh)
        node.replace_all_uses_with(fresh)
        graph.erase_node(node)
    module.recompile()


def _traced(value) -> bool:
    """Inputs that become placeholders: tensors and containers of tensors."""
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_traced(v) for v in value.values())
    if isinstance(value, (tuple, list)):
        return any(_traced(v) for v in value)
    return False
