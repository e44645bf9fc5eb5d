"""Inference-time IKBO transformation: a standard ranking model in, the same function out, with user
tensors kept at U rows and joined to candidates through the mapping (docs/design/transform.md).

    module, report = to_ikbo(model, example_inputs)   # example_inputs: forward's positional args
    print(report)                                     # what was rewritten, what was left and why

The pass captures `model` on the example (capture.py: torch.fx with example values, following Python
control flow, standard modules in eval form), finds the replications of user tensors by what they
compute, and rebuilds the graph (rewrite.py): row-wise ops at U rows, joins where user rows meet
candidates (ops.py), replication only where nothing else exists (reported). The result is checked
against the model on the example and timed against it (cost.py); it is served only when it agrees and
is not slower.
"""

from __future__ import annotations

import ast
import collections
import collections.abc
import copy
import dataclasses
import enum
import inspect
import re
import textwrap
import types
import warnings
from collections import Counter
from itertools import chain
from operator import attrgetter, call, is_not, itemgetter, methodcaller

import torch
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_map

from . import cost, ops
from .capture import CAPTURE_LOCK, alias_root, capture, mutated_input, write_back_views
from .detect import ReplicationDetector, replications_in
from .rewrite import Rewriter
from .values import Report

MAPPING_ARGUMENT = "cand_to_user"

__all__ = ["MAPPING_ARGUMENT", "Guarded", "ReplicationDetector", "Report", "replications_in", "to_ikbo"]

RTOL = {torch.float16: 2e-2, torch.bfloat16: 2e-2}  # default 1e-3 (fp32: tf32 on CUDA, fp64)


def _float_dtypes(model: torch.nn.Module, example_inputs) -> set[torch.dtype]:
    """Floating dtypes of the example's tensors and of the model's parameters and buffers (a bf16 model
    fed integer ids computes in bf16), and the autocast dtype where the pass runs under `torch.autocast`."""
    tensors = [t for t in tree_flatten(example_inputs)[0] if isinstance(t, torch.Tensor)]
    tensors += [*model.parameters(), *model.buffers()]
    dtypes = {t.dtype for t in tensors if t.is_floating_point()}
    # a pass run under torch.autocast: the original computes its matmuls in the autocast dtype
    return dtypes | {
        torch.get_autocast_dtype(d) for d in {t.device.type for t in tensors} if torch.is_autocast_enabled(d)
    }


def to_ikbo(
    model: torch.nn.Module,
    example_inputs,
    mapping_name: str = MAPPING_ARGUMENT,
    rtol: float | None = None,
    measure: bool = True,
    cuda_graphs: bool = False,
    example_kwargs: dict | None = None,
):
    """(module, report): `model` rewritten so that user tensors stay at U rows, and what was done.

    `example_inputs`: forward's positional arguments for one request (tensors, or dicts / tuples of
    tensors, or dataclasses holding tensors; settings: numbers, flags, strings and lists / tuples / dicts of them), in
    eval mode (a forward that only hands them on to a submodule, `forward(self, *args, **kwargs)`: that submodule's);
    `example_kwargs`: its arguments by name (keyword-only ones: `forward(self, user, cand, *, cand_to_user)`). The
    mapping is the argument named `mapping_name` ([B] integer, candidate → user row), or the entry (field) with that
    key in a dict (dataclass) argument. Rows
    tell tensors apart: a tensor with B rows is per candidate, one with U rows (the most common other row count the
    mapping can index) per user, so pick U ≠ B and both unlike the model's other dims; with U == B the model comes back
    unchanged, with a warning.
    Values are not baked in: the module takes any U and B. Shapes the model branched on in Python
    (capture.py) are checked on each call; other inputs run the original model.

    Never wrong, never slower: a model that cannot be captured, whose rewrite fails or disagrees with it
    on the example (relative error above `rtol`: a wrong rewrite, not rounding; default 1e-3, 2e-2 where
    the inputs or the model's parameters are 16-bit, or the pass runs under a 16-bit `torch.autocast`: on CUDA the IKBO linear compression runs fp32 in
    tf32), or that runs slower than the original on the example (`measure`; cost.py; `cuda_graphs`: both
    timed as CUDA-graph replays, for a module served that way) comes back unchanged, with the reason in
    the report. The model is left as it was (buffers the pass's runs change are put back); a forward that keeps
    state (changes a buffer in place, assigns attributes from its inputs) comes back unchanged.
    """
    if isinstance(model, Guarded):
        return model, Report(left=["the whole model: already rewritten by to_ikbo (a Guarded module); served as it is"])
    buffers = [(b, b.clone()) for b in model.buffers()]  # the pass runs the model: what it changes is put back
    with CAPTURE_LOCK:  # fx patches nn.Module.__call__ process-wide while it traces: one pass at a time
        try:
            return _to_ikbo(model, example_inputs, example_kwargs, mapping_name, rtol, measure, cuda_graphs)
        finally:
            for buffer, saved in buffers:
                if not torch.equal(buffer, saved):
                    buffer.copy_(saved)


def _to_ikbo(model, example_inputs, example_kwargs, mapping_name, rtol, measure, cuda_graphs):
    # the caller's tensors stay as they are, whatever the model does
    example_inputs, example_kwargs = _copied((tuple(example_inputs), dict(example_kwargs or {})))
    training = [name or type(model).__name__ for name, m in model.named_modules() if m.training and _mode_matters(m)]
    if training:
        raise ValueError(f"model: expected eval mode (call model.eval()), got training mode in {training[:3]}")
    traced, path = _passed_through(model)  # a wrapper's `forward(*args, **kwargs)`: the module it hands them to
    signature = inspect.signature(traced.forward)
    examples = _bound(signature, example_inputs, example_kwargs)
    # a dataclass argument holding tensors: the graph takes its fields as a dict (`Guarded` converts at each call)
    records = {name: type(v) for name, v in examples.items() if _record(v)}
    examples = {name: _fields(v) if name in records else v for name, v in examples.items()}
    example_inputs = tuple(examples.values())  # the graph's inputs, in the order of forward's parameters
    calling = _Calling(signature, list(examples), {list(examples).index(n): c for n, c in records.items()})
    variadic = [p.name for p in signature.parameters.values() if p.kind == p.VAR_POSITIONAL]
    if variadic and not _names_mapping(examples, mapping_name):
        reason = (
            f"forward{signature} takes its arguments as *{variadic[0]}, and the pass could not follow them to a "
            f"module whose forward names {mapping_name!r}"
        )
        warnings.warn(f"to_ikbo: {reason}; the model is returned unchanged", stacklevel=2)
        return model, Report(left=[f"the whole model: {reason}; served unchanged"])
    mapping = _find_mapping(examples, mapping_name, signature)
    others = _unfollowed_settings(examples)  # before the rows: tensors inside such objects are not counted there
    if others:
        reason = f"non-tensor arguments of other types than numbers, flags, strings, enums and dtypes: {others[0]}"
        return model, Report(left=[f"the whole model: {reason}; served unchanged"])
    num_candidates = mapping.shape[0]
    num_users, jagged = _user_rows(examples, num_candidates, mapping)
    if num_users is None:
        reason = (
            f"every tensor of the example has B = {num_candidates} rows: if U = B = {num_candidates}, user and "
            "candidate tensors cannot be told apart by rows"
        )
        warnings.warn(f"to_ikbo: {reason}; the model is returned unchanged (pass an example with U ≠ B)", stacklevel=2)
        return model, Report(left=[f"the whole model: {reason}; served unchanged"])
    rows_note = f"rows: U = {num_users}, B = {num_candidates}"
    if jagged:
        rows_note += f" (U from the jagged offsets {', '.join(f'`{name}`' for name, _ in jagged)} [U + 1])"
        clash = sorted({int(o[-1]) for _, o in jagged} & {num_users, num_candidates})
        if clash:  # rows tell tensors apart: values [N, …] at N = U or B are taken for user or candidate rows
            role = "B" if clash[-1] == num_candidates else "U"
            rows_note += (
                f"; the jagged values have N = {role} = {clash[-1]} rows on the example, taken for {role} rows: calls "
                f"where N ≠ {role} run the original (pass an example where N differs from U and B)"
            )

    def unchanged_model(reason, kept=()):
        return model, Report(left=[f"the whole model: {reason}; served unchanged"], kept=list(kept), notes=[rows_note])

    hooked = _hooked(model)
    if hooked:
        return unchanged_model(
            f"forward hooks on {', '.join(hooked[:3])}: Python calls a rewritten graph would not make"
        )
    if rtol is None:
        rtol = max([RTOL.get(d, 1e-3) for d in _float_dtypes(model, example_inputs)], default=1e-3)
    # the jagged inputs' counts change with each request as U and B do: the capture takes a branch on the offsets' U + 1
    # read from a tensor computed from them for one on the rows, and `Guarded` leaves it free, and the values' count N
    # where no branch read it so
    offsets_rows = {len(o) for _, o in jagged} - {num_users, num_candidates}
    values_rows = {int(o[-1]) for _, o in jagged} - {num_users, num_candidates}
    carriers = {count: frozenset(name for name, v in examples.items() if count in _row_counts({name: v}, None))
                for count in offsets_rows | values_rows}  # fmt: skip
    try:
        captured = capture(traced, examples, (num_users, num_candidates), records, (carriers, offsets_rows))
    except Exception as e:
        return unchanged_model(f"the capture could not follow it ({type(e).__name__}: {e})")
    kept = [f"`{path}` ({kind}): {reason}" for path, kind, reason in captured.opaque]
    traced = captured.module  # in-place ops count for their effect, also where their result goes unused
    changed = sorted({root.target for n in traced.graph.nodes if (x := mutated_input(n, traced)) is not None
                      and (root := alias_root(x, traced)).op == "get_attr"})  # fmt: skip
    if changed:
        reason = (
            f"the forward changes `{'`, `'.join(changed[:3])}` in place: module state a rewritten graph would not keep"
        )
        return unchanged_model(reason, kept)
    write_back_views(traced)  # an in-place op through a view as an assignment into the viewed tensor
    traced.graph.eliminate_dead_code(is_impure_node=lambda n: n.is_impure() or mutated_input(n, traced) is not None)
    traced.recompile()
    rewriter = None
    try:
        rewriter = Rewriter(traced, examples, mapping_name, num_users, num_candidates)
        rewriter.value_checks = not cuda_graphs
        module, report = rewriter.run()
    except Exception as e:
        where = f" at {rewriter.where()}" if rewriter is not None and rewriter.node is not None else ""
        return unchanged_model(f"the rewrite failed{where} ({type(e).__name__}: {e})", kept)
    report.kept = kept
    if path:
        report.notes.append(f"the model's forward hands its arguments to `{path}`: captured there (paths from it)")
    report.notes.append(rows_note)
    unchanged = not report.rewritten  # nothing to gain: the model itself (no guards, no fixed branches)
    error = 0.0 if unchanged else _disagreement(calling(model), module, example_inputs)
    if not error <= rtol:
        return unchanged_model(f"the rewrite disagrees with it on the example (rel. error {error:.1e})", kept)
    seen, other_rows = [], None
    if not report.replications_left:
        jagged_counts = {len(o) for _, o in jagged} | {int(o[-1]) for _, o in jagged}  # segments and values: no users
        others = [r for r in _row_counts(examples, num_candidates) if r != num_users and r not in jagged_counts]
        checked = calling(model) if unchanged else module  # (the graph takes its inputs in order)
        try:
            seen = replications_in(checked, _copied(example_inputs), num_users, num_candidates, row_dims=(0, 1))
            for rows in others if not seen else []:  # tensors of another row count replicated: U was taken wrong
                seen = replications_in(checked, _copied(example_inputs), rows, num_candidates, row_dims=(0, 1))
                if seen:
                    other_rows = rows
                    break
        except Exception as e:  # a check of the report, not of the rewrite (already checked on the example)
            report.notes.append(f"the replication check of the rewrite could not run ({type(e).__name__}: {e})")
    if seen and other_rows is not None:
        report.left.append(
            f"tensors with {other_rows} rows replicated to B rows, seen on the example, while the pass took U = "
            f"{num_users} (the most common row count the mapping can index): pass an example where the user tensors "
            f"have the most common row count"
        )
    elif seen:
        report.left.append(
            f"user tensors replicated to B rows by spellings the pass does not recognise, seen on the example: "
            f"{', '.join(sorted(set(seen)))}"
        )
    if unchanged:
        if not report.left:
            report.left.append(
                f"the whole model: nothing to rewrite (no tensor with U = {num_users} rows is replicated to B rows on "
                "the example); served unchanged"
            )
        return model, report
    if "is_contiguous" in captured.flags and not all(
        t.is_contiguous() for t in tree_flatten(example_inputs)[0] if isinstance(t, torch.Tensor)
    ):
        reason = (
            "a branch reads the contiguity of tensors made from a non-contiguous example input: a call's strides could "
            "take the other branch"
        )
        return unchanged_model(reason, kept)
    module = Guarded(
        module,
        model,
        example_inputs,
        (num_users, num_candidates),
        captured.fixed_sizes,
        captured.flags,
        captured.settings,
        offsets_rows | (values_rows - captured.jagged_read),
        calling,
        mapping,
    )
    read = sorted(values_rows & captured.jagged_read)
    if read and captured.fixed_sizes:
        report.notes.append(
            f"a branch read a size equal to the jagged values' count N = {read[0]} on the example: calls where N differs "
            "run the original (pass an example where N differs from the model's other dims)"
        )
    if measure:
        timing = cost.compare(calling(model), calling(module), example_inputs, cuda_graphs=cuda_graphs)
        ratio = report.speedup = timing.speedup
        report.timing = f"at U:B = {num_users}:{num_candidates} {timing.describe()}"
        if cost.rewrite_slower(timing):
            report.left.insert(
                0, f"the whole model: the rewrite is slower on the example ({ratio:.2f}×); served unchanged"
            )
            return model, report
    return module, report


def _mode_matters(m: torch.nn.Module) -> bool:
    """Whether the module computes another function in training mode (dropout, batch statistics)."""
    nn = torch.nn
    if isinstance(m, nn.modules.batchnorm._BatchNorm):
        return True
    if isinstance(m, nn.modules.dropout._DropoutNd):
        return m.p > 0
    if isinstance(m, nn.MultiheadAttention):
        return m.dropout > 0
    if isinstance(m, nn.RNNBase):
        return m.dropout > 0
    return False


def _passed_through(model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """(module, its path): the module whose forward computes the model's — the model itself, or where its forward only
    hands its arguments on to a submodule, as wrappers do (`def forward(self, *args, **kwargs): return
    self.inner(*args, **kwargs)`, read from its source), that submodule (through wrappers of wrappers). Its parameters
    name the arguments; `Guarded` watches the wrapper (another `inner` assigned runs the original)."""
    module, path = model, []
    passing = ([inspect.Parameter.VAR_POSITIONAL], [inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD])
    while True:
        forward = type(module).forward
        parameters = inspect.signature(forward).parameters
        if [p.kind for p in list(parameters.values())[1:]] not in passing:
            break
        try:
            definition = ast.parse(textwrap.dedent(inspect.getsource(forward))).body[0]
        except (OSError, TypeError, SyntaxError):
            break
        body = definition.body[1:] if ast.get_docstring(definition) is not None else definition.body
        if definition.decorator_list or len(body) != 1:
            break
        first, *rest = parameters
        passed = re.escape(", ".join([f"*{rest[0]}", *(f"**{n}" for n in rest[1:])]))
        call = re.fullmatch(rf"return {first}\.(\w+)\({passed}\)", ast.unparse(body[0]))
        if call is None or module._modules.get(call[1]) is None:
            break
        module = module._modules[call[1]]
        path.append(call[1])
    return module, ".".join(path)


def _bound(signature, args: tuple, kwargs: dict) -> dict:
    """The example's arguments by name, in the order of forward's parameters: `args` and `kwargs` bound, with the
    defaults of parameters left out before a named one (a keyword argument after them), and of those after them up to
    the first keyword-only one or one whose default is not a setting (`return_aux=False`, `cfg=None`): traced with
    those values."""
    try:
        examples = dict(signature.bind(*args, **kwargs).arguments)
    except TypeError as e:
        required = [f"`{p.name}`" for p in signature.parameters.values()
                    if p.kind == p.KEYWORD_ONLY and p.default is p.empty and p.name not in kwargs]  # fmt: skip
        hint = f"; keyword-only {', '.join(required)}: pass it by name, in example_kwargs" if required else ""
        raise ValueError(f"example_inputs: do not match forward{signature} ({e}){hint}") from None
    parameters = list(signature.parameters.values())
    named = max((i for i, p in enumerate(parameters) if p.name in examples), default=-1)
    for parameter in parameters[:named]:
        if parameter.name in examples or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if not _is_setting(parameter.default):
            raise ValueError(
                f"example_kwargs: `{parameter.name}` is left out before `{parameters[named].name}`, and its default is "
                "not a setting the graph could be traced with: pass it too"
            )
        examples[parameter.name] = parameter.default
    for parameter in parameters[named + 1 :]:
        if parameter.kind != parameter.POSITIONAL_OR_KEYWORD or not _is_setting(parameter.default):
            break
        examples[parameter.name] = parameter.default
    return {p.name: examples[p.name] for p in parameters if p.name in examples}


def _record(value) -> bool:
    """A dataclass instance holding tensors (a request's features), whose fields the pass follows as a dict's."""
    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        return False
    return any(isinstance(t, torch.Tensor) for t in tree_flatten(list(_fields(value).values()))[0])


def _fields(record) -> dict:
    """A dataclass instance's fields by name (the objects themselves: no copies, as `dataclasses.asdict` makes)."""
    return {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}


class _Calling:
    """Calls of the model (or its `Guarded` module) on the graph's inputs: forward's parameters in order, the
    keyword-only ones passed by name and `*args` / `**kwargs` spread, dataclass arguments (dicts of their fields in
    the graph) made again as copies of the example's objects with those fields."""

    def __init__(self, signature, names: list, records: dict):
        self.kinds = [signature.parameters[n].kind for n in names]
        self.names, self.records = names, records

    def __call__(self, fn):
        if not self.records and all(k <= inspect.Parameter.POSITIONAL_OR_KEYWORD for k in self.kinds):
            return fn  # positional arguments, as the graph takes them

        def call(*inputs):
            args, kwargs = [], {}
            for i, (kind, name, value) in enumerate(zip(self.kinds, self.names, inputs)):
                if i in self.records and isinstance(value, dict):
                    value = self.record(i, value)
                if kind == inspect.Parameter.VAR_POSITIONAL:
                    args += value
                elif kind == inspect.Parameter.VAR_KEYWORD:
                    kwargs.update(value)
                elif kind == inspect.Parameter.KEYWORD_ONLY:
                    kwargs[name] = value
                else:
                    args.append(value)
            return fn(*args, **kwargs)

        return call

    def record(self, i, fields: dict):
        cls = self.records[i]
        record = cls.__new__(cls)
        for name, value in fields.items():  # (frozen dataclasses too)
            object.__setattr__(record, name, value)
        return record


def _names_mapping(examples, mapping_name) -> bool:
    """Whether the bound example arguments hold one named `mapping_name` (or a dict entry of that name)."""
    return mapping_name in examples or any(isinstance(v, dict) and mapping_name in v for v in examples.values())


def _find_mapping(examples, mapping_name, signature):
    if isinstance(examples.get(mapping_name), torch.Tensor):
        mapping = examples[mapping_name]
    else:
        found = [v[mapping_name] for v in examples.values() if isinstance(v, dict) and mapping_name in v]
        if not found:
            raise ValueError(
                f"model: forward{signature} has no argument (or dict entry) named {mapping_name!r}: pass the "
                "candidate → user mapping as an argument or a dict key of that name (mapping_name=...); "
                "a mapping inside a tuple cannot be named"
            )
        mapping = found[0]
    if not isinstance(mapping, torch.Tensor) or mapping.dim() != 1 or mapping.is_floating_point():
        raise ValueError(f"{mapping_name}: expected a 1-D integer tensor [B], got {mapping!r:.80}")
    return mapping


def _row_counts(examples, num_candidates) -> Counter:
    """How many of the example's tensors have each row count other than B."""
    return Counter(
        t.shape[0]
        for t in tree_flatten(list(examples.values()))[0]
        if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] != num_candidates
    )


def _offsets(examples, num_candidates, least) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of the jagged offsets among the example's tensors: 1-D integer tensors [U + 1] that start at 0,
    never decrease and end at the row count of another tensor (the values [N, …] they cut into one segment per user),
    with U ≠ B rows the mapping can index (U ≥ `least`), and U + 1 ≠ B."""
    named = [(name + keystr(path), t) for name, value in examples.items()
             for path, t in tree_flatten_with_path(value)[0] if isinstance(t, torch.Tensor)]  # fmt: skip
    found = []
    for name, t in named:
        if t.dim() != 1 or t.is_floating_point() or t.is_complex() or t.dtype is torch.bool or len(t) < 2:
            continue
        users = len(t) - 1  # (the mapping and other tensors at B rows are per candidate)
        if num_candidates in (users, len(t)) or users < least or int(t[0]) != 0 or bool((t[1:] < t[:-1]).any()):
            continue
        end = int(t[-1])
        if end == 0 or any(v is not t and v.dim() and v.shape[0] == end for _, v in named):
            found.append((name, t))
    return found


def _user_rows(examples, num_candidates, mapping) -> tuple[int | None, list]:
    """(U, the jagged offsets that gave it): U the most common row count of the example's tensors other than B that
    the mapping can index (> its largest value), the smallest on a tie; None if none. Jagged inputs count for the
    users they describe: offsets [U + 1] (`_offsets`) for U, and the values [N, …] they cut (N = offsets[-1]) for
    none, so a user history that arrives as values and offsets alone, no tensor at U rows, still gives U."""
    least = int(mapping.max()) + 1 if mapping.numel() else 0
    offsets = _offsets(examples, num_candidates, least)
    counts = _row_counts(examples, num_candidates)
    for _, o in offsets:
        counts[len(o)] -= 1
        counts[len(o) - 1] += 1
    ends = {int(o[-1]) for _, o in offsets} - {len(o) - 1 for _, o in offsets}
    for t in tree_flatten(list(examples.values()))[0]:  # the values the offsets cut: a count of history, not users
        if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] in ends and t.shape[0] != num_candidates:
            if not any(t is o for _, o in offsets):
                counts[t.shape[0]] -= 1
    rows = {r: n for r, n in counts.items() if r >= least and n > 0}
    if not rows:
        return None, []
    users = max(rows, key=lambda r: (rows[r], -r))
    return users, [(name, o) for name, o in offsets if len(o) == users + 1]


def _copied(tree):
    """The tensors of `tree` copied (each side of a comparison gets its own: a model that changes its inputs in place
    must not hand its changes to the other)."""
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, tree)


def _disagreement(model, module, example_inputs) -> float:
    """Largest relative error of `module` against `model` over their tensor outputs, each run on its own copy of the
    example."""
    with torch.no_grad():
        expected = tree_flatten(model(*_copied(example_inputs)))[0]
        actual = tree_flatten(module(*_copied(example_inputs)))[0]
    if len(expected) != len(actual):
        return float("inf")
    worst = 0.0
    for e, a in zip(expected, actual):
        if isinstance(e, torch.Tensor):
            if not isinstance(a, torch.Tensor) or a.shape != e.shape:
                return float("inf")
            e, a = e.double(), a.double()
            both_nan = torch.isnan(e) & torch.isnan(a)
            if bool((torch.isnan(e) ^ torch.isnan(a)).any()):
                return float("inf")
            e, a = torch.where(both_nan, 0.0, e), torch.where(both_nan, 0.0, a)
            worst = max(worst, float((a - e).norm() / e.norm().clamp(min=1e-30)))
        elif e != a:
            return float("inf")
    return worst


SETTINGS = (type(None), bool, int, float, complex, str, enum.Enum, torch.dtype, torch.device)


def _is_setting(value) -> bool:
    """A value of `SETTINGS`, or a list, tuple or dict of them (nested too: `weights=[0.3, 0.7]`, `dims=((1,), 2)`),
    which the graph is traced with and each call checks entry by entry (`Guarded`)."""
    if isinstance(value, dict):
        return all(map(_is_setting, value.values()))
    if isinstance(value, (list, tuple)):
        return all(map(_is_setting, value))
    return isinstance(value, SETTINGS)


def _same_setting(a, b) -> bool:
    """A non-tensor argument equal to the example's, of its type (1 is not 1.0 or True, -0.0 is not 0.0; NaN is
    NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (float, complex)):
        return repr(a) == repr(b)
    return a == b


def _same_key(a, b) -> bool:
    """A dict key equal to the example's, of its type, tuples entry by entry: pytree's structure compares keys by
    `==`, where {1: w} equals {True: w} and {0.0: w} {-0.0: w}, but a forward that reads the keys tells them apart."""
    if type(a) is tuple and type(b) is tuple:
        return len(a) == len(b) and all(map(_same_key, a, b))
    return _same_setting(a, b)


def _dict_keys(value) -> list:
    """The keys of the dicts in a structure of arguments, in pytree's order of flattening (nested too)."""
    if isinstance(value, dict):
        return [*value, *chain.from_iterable(map(_dict_keys, value.values()))]
    if isinstance(value, (list, tuple)):
        return list(chain.from_iterable(map(_dict_keys, value)))
    return []


def _unfollowed_settings(examples: dict) -> list[str]:
    """The non-tensor arguments the graph cannot be traced with (other than `SETTINGS`, which are checked per call)."""
    leaves = {name: tree_flatten(value)[0] for name, value in examples.items()}
    return [f"`{name}` ({type(v).__name__})" for name, vs in leaves.items() for v in vs
            if not isinstance(v, (torch.Tensor, *SETTINGS))]  # fmt: skip


def _hooked(model: torch.nn.Module) -> list[str]:
    """The modules with forward (pre-)hooks, and "every module" where global ones are registered."""
    hooked = [f"`{name}`" if name else "the model" for name, m in model.named_modules()
              if m._forward_hooks or m._forward_pre_hooks]  # fmt: skip
    if torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks:
        hooked.append("every module (global hooks)")
    return hooked


class Guarded(torch.nn.Module):
    """The rewritten graph (`rewritten`, a torch.fx.GraphModule) for inputs shaped like the example's:
    the same structure (containers, dict keys), dtypes and ndims, one row count among the inputs that had U rows and
    one among those that had B, neither of them 0, and, where the capture followed a branch on them, the same non-row
    sizes, and a mapping without negative entries; the original model for other inputs (`fallbacks` counts them), also
    where a concat the rewrite keeps as
    its parts meets other widths than the example's (`ops.WidthsChanged`, raised before any output is made), and once
    the model has changed since the pass (the graph holds what it was): a forward hook registered, a parameter or
    buffer changed in place (`load_state_dict`, an optimizer step) or rebound, a submodule replaced, an attribute
    rebound, a module put in training mode, parametrized or given another forward — with a warning the first time
    (run `to_ikbo` again). Writes through `.data` or a tensor's storage move no version counter: not seen.
    Where the capture followed a branch on a tensor's flags (`capture.FLAG_READS`), each call also has them as the
    example had: the same contiguity of every input and, for the row counts, 1 where the example's was 1 and more
    where it was more (a view's contiguity depends on them only there); requires_grad / is_leaf: the inputs' flags as
    the example's, and grad mode off (the capture computes its values without grad); the device: the same device.
    With grad on and a parameter of the model or an input requiring grad the original runs too: the tiled joins have
    no autograd, and the gradients are then the original's."""

    def __init__(
        self,
        rewritten,
        original,
        example_inputs,
        rows,
        fixed_sizes: bool,
        flags=frozenset(),
        settings=None,
        free=(),
        calling=None,
        mapping=None,
    ):
        super().__init__()
        self.free = frozenset(free)  # row counts of jagged inputs (offsets [U + 1], values [N, …]): dim 0 not checked
        self.rewritten, self.original = rewritten, original
        self.settings = list((settings or {}).items())  # torch's global settings the forward read: as on the example
        self.fixed_sizes, self.fallbacks = fixed_sizes, 0
        self.flags, self.rows = flags, rows
        leaves, self.structure = tree_flatten(example_inputs)  # dict keys included: the graph reads entries by key
        # the mapping's place among the inputs: a call whose mapping counts rows from the end (negative entries, as
        # indexing reads them) runs the original (the joins take rows 0 … U − 1)
        self.mapping_leaf = next((i for i, t in enumerate(leaves) if t is mapping and mapping is not None), None)
        self.keys = _dict_keys(example_inputs)  # and their types (the structure compares them by ==: 1 == True)
        self.expected = [self._key(t, rows) for t in leaves]
        # which inputs had U rows and which B: at each call the tensors of a role share their row count (a [15, d]
        # lookup table passed with 15 users in the example would otherwise be taken for user rows at every U)
        self.roles = [rows.index(t.shape[0]) if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] in rows
                      else None for t in leaves]  # fmt: skip
        self._watch(original)
        self.warned = False
        self.signature = inspect.signature(_passed_through(original)[0].forward)
        if calling is None:  # the graph's inputs, in order: forward's first parameters
            calling = _Calling(self.signature, list(self.signature.parameters)[: len(example_inputs)], {})
        self.names, self.records = calling.names, calling.records  # records: position → dataclass
        # a call of the first names by position and the keyword-only ones by name, in order: the graph's inputs as
        # they are (else bound to forward's parameters)
        positional = [k <= inspect.Parameter.POSITIONAL_OR_KEYWORD for k in calling.kinds]
        self.positional = positional.index(False) if False in positional else len(positional)
        rest = calling.kinds[self.positional :]
        keyword_only = all(k == inspect.Parameter.KEYWORD_ONLY for k in rest)
        self.keywords = tuple(self.names[self.positional :]) if keyword_only else (None,)
        self.keyword_set = frozenset(self.keywords)

    _WATCH = ("watched", "weights", "own", "classes", "reads", "attributes", "deep", "state")

    def _watch(self, original):
        """Take the model as it is now as the one the graph was made from (`_changed` compares with it)."""
        self.watched = list(original.modules())  # (a plain list: not registered as submodules again)
        self.weights = list(original.parameters())
        self.warned_grad = False
        self.own = [m for m in self.watched if not type(m).__module__.startswith("torch.")]  # the model's own classes
        self.classes = [c for m in self.own for c in type(m).__mro__ if not _library(c)]
        self.reads = _names_read(self.classes, self.own)
        # each module's own attributes (`self.scale`, `self._eps`, `negative_slope`): read by a C-level getter a module
        self.attributes = [_getter("training", *(k for k in vars(m) if k not in _MODULE_INTERNALS))
                           for m in self.watched]  # fmt: skip
        # the values read that hold others (a dict of settings, a config object): their contents are read too, the
        # rest compared as objects (one rebound to a container is another object)
        self.deep = [i for i, v in enumerate(self._top()) if _kind_of(v) is not _leaf]
        self.state = self._state()

    def __deepcopy__(self, memo):
        """A copy of the graph and the model together (their shared weights stay shared), watching its own model;
        what it watches names globals and Python modules (`os.environ`), which are not copied but read again from the
        copy. One whose model had changed since the pass runs the original for good."""
        changed = self._changed()
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        vars(copied).update(copy.deepcopy({k: v for k, v in vars(self).items() if k not in self._WATCH}, memo))
        copied._watch(copied.original)
        if changed:
            copied.state = None
        return copied

    def __getstate__(self):
        """What pickling (`torch.save`) keeps: the graph, the model and the checks; not what the watch reads (globals
        and Python modules: `__setstate__` reads them again from the loaded model). One whose model had changed since
        the pass runs the original for good once loaded."""
        state = {k: v for k, v in vars(self).items() if k not in self._WATCH}
        state["_changed_at_save"] = self._changed()
        # a GraphModule pickles as its code, which its loading traces again (the IKBO ops cannot be): its graph and
        # what the graph reads instead, made a GraphModule again at load
        modules = dict(state["_modules"])
        modules["rewritten"] = _GraphState(modules["rewritten"])
        state["_modules"] = modules
        return state

    def __setstate__(self, state):
        changed = state.pop("_changed_at_save")
        state["_modules"] = {k: v.module() if isinstance(v, _GraphState) else v for k, v in state["_modules"].items()}
        super().__setstate__(state)  # (nn.Module's: the hook registries a module pickled by an older torch lacks)
        self._watch(self.original)
        if changed:
            self.state = None

    def _key(self, t, rows):
        if not isinstance(t, torch.Tensor):  # a number, flag, string, enum or dtype the graph was traced with
            return ("value", t)
        rows_free = t.dim() and (t.shape[0] in rows or t.shape[0] in self.free)
        sizes = tuple(t.shape[1:]) if self.fixed_sizes and rows_free else None
        if self.fixed_sizes and t.dim() and not rows_free:
            sizes = tuple(t.shape)
        return t.dtype, t.dim(), t.device.type, sizes, (t.layout, t.is_nested), self._flags(t)

    def _flags(self, t) -> tuple:
        """What a call's tensor must share with the example's where a branch read its flags (`self.flags`)."""
        flags = self.flags
        if not flags:
            return ()
        grad = bool(flags & {"requires_grad", "is_leaf"})
        return (
            t.is_contiguous() if "is_contiguous" in flags else None,
            (t.requires_grad, t.is_leaf) if grad else None,
            t.device if flags & {"device", "get_device"} else None,
        )

    def _state(self) -> tuple:
        """What the graph was made from: each module's class and its forward, its attributes (mode, settings the
        forward reads: `self.scale`, `self._eps`, an own `forward`, a torch module's `negative_slope`), the attributes
        of its own classes (`SCALE = 2.0`), the globals and closure cells its own code and the helpers it calls name
        (`SCALE`, `os.environ`), with what lists, dicts, sets and plain objects (a config dataclass) among all those
        hold, its submodules, parameters and buffers (the objects, and the tensors' version counters, which in-place
        changes advance). Read at each call."""
        watched = self.watched
        values = dict.values  # (the registries are dicts: a C call, where methodcaller("values") costs 3×)
        tensors = list(chain.from_iterable(map(values, map(attrgetter("_parameters"), watched))))
        tensors += chain.from_iterable(map(values, map(attrgetter("_buffers"), watched)))
        read = self._top()
        deep = [read[i] for i in self.deep] if len(read) > 1 else []
        kinds = list(map(type, watched))
        return (
            kinds + [k.forward for k in kinds] + list(map(len, map(vars, watched))),
            _contents(deep, read, depth=3),
            tensors,
            [t._version if t is not None else None for t in tensors],
        )

    def _top(self) -> list:
        """The objects `_state` compares by identity: every module's attributes and submodules (a submodule
        replaced), the attributes of the model's own classes, the globals, cells and module attributes its code
        names ([None] where an attribute was deleted)."""
        watched = self.watched
        values = methodcaller("values")
        try:
            read = list(chain.from_iterable(map(call, self.attributes, map(vars, watched))))
        except KeyError:  # an attribute deleted
            return [None]
        read += chain.from_iterable(map(dict.values, map(attrgetter("_modules"), watched)))
        read += chain.from_iterable(map(values, map(vars, self.classes)))
        read += map(_read, *zip(*self.reads)) if self.reads else ()
        return read

    def _changed(self) -> bool:
        """Whether the model has changed since the pass (`_state`), or a forward hook has been registered on it."""
        if torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks:
            return True
        if self.state is None:  # a copy of one whose model had changed
            return True
        watched = self.watched
        if any(map(attrgetter("_forward_hooks"), watched)) or any(map(attrgetter("_forward_pre_hooks"), watched)):
            return True
        now = self._state()
        return (
            now[0] != self.state[0]
            or now[3] != self.state[3]
            or any(len(a) != len(b) or any(map(is_not, a, b)) for a, b in zip(now[2:3], self.state[2:3]))
            or len(now[1]) != len(self.state[1])
            or any(map(is_not, now[1], self.state[1]))
            and not all(map(_same_object, now[1], self.state[1]))
        )

    @property
    def code(self) -> str:
        return self.rewritten.code

    def matches(self, args) -> bool:
        leaves, structure = tree_flatten(args)
        if structure != self.structure or not all(map(_same_key, _dict_keys(args), self.keys)):
            return False
        counts = ({}, {})
        for t, role in zip(leaves, self.roles):
            if role is not None and isinstance(t, torch.Tensor) and t.dim():
                counts[role][t.shape[0]] = True
        if any(len(c) > 1 or 0 in c for c in counts):  # no candidates (or no users): the original, as cheap
            return False
        at = getattr(self, "mapping_leaf", None)
        mapping = leaves[at] if at is not None else None
        # read on the CPU only: on a GPU that is a device sync per call (and none may run under CUDA graphs)
        if isinstance(mapping, torch.Tensor) and mapping.device.type == "cpu" and mapping.numel() and mapping.min() < 0:
            return False
        if torch.is_grad_enabled() and (
            any(t.requires_grad for t in leaves if isinstance(t, torch.Tensor)) or any(self._requires_grad())
        ):
            self._warn_grad()
            return False
        flags = self.flags
        if flags:
            if "is_contiguous" in flags and any((n > 1) != (r > 1) for c, r in zip(counts, self.rows) for n in c):
                return False
            if flags & {"requires_grad", "is_leaf"} and torch.is_grad_enabled():  # the capture's values: without grad
                return False
        for t, want in zip(leaves, self.expected):
            if want is None:
                continue
            if want[0] == "value":
                if not _same_setting(t, want[1]):
                    return False
                continue
            if not isinstance(t, torch.Tensor) or (t.dtype, t.dim(), t.device.type) != want[:3]:
                return False
            sizes = want[3]
            if sizes is not None and tuple(t.shape[len(t.shape) - len(sizes) :]) != sizes:
                return False
            if (t.layout, t.is_nested) != want[4] or (flags and self._flags(t) != want[5]):
                return False
        return True

    def _warn_grad(self):
        if not self.warned_grad:
            self.warned_grad = True
            warnings.warn(
                "to_ikbo: called with grad enabled and a parameter or input requiring grad: the original runs (the "
                "rewrite has no autograd); call it under torch.inference_mode() or torch.no_grad() for the rewrite",
                stacklevel=4,
            )

    def _requires_grad(self):
        return map(attrgetter("requires_grad"), self.weights)

    def _inputs(self, args, kwargs):
        """The graph's inputs for a call: its arguments by name or by their defaults, in the order of forward's
        parameters, dataclass arguments of the example's classes as dicts of their fields; None where the call passes
        anything else (more `*args` / `**kwargs`, a parameter the graph does not take away from its default)."""
        if len(args) == self.positional and (kwargs.keys() == self.keyword_set if kwargs else not self.keywords):
            inputs = (*args, *map(kwargs.__getitem__, self.keywords)) if kwargs else args
        else:
            try:
                bound = self.signature.bind(*args, **kwargs)
                bound.apply_defaults()
            except TypeError:
                return None
            parameters = self.signature.parameters
            others = {k: v for k, v in bound.arguments.items() if k not in self.names}
            at_default = all(
                v is parameters[k].default or parameters[k].kind in (inspect.Parameter.VAR_POSITIONAL,
                inspect.Parameter.VAR_KEYWORD) and not v for k, v in others.items()
            )  # fmt: skip
            if not at_default or not all(n in bound.arguments for n in self.names):
                return None
            inputs = tuple(bound.arguments[n] for n in self.names)
        if self.records:
            inputs = tuple(_fields(v) if type(v) is self.records.get(i) else v for i, v in enumerate(inputs))
        return inputs

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled() and any(self._requires_grad()):  # the original, as `matches` would say: no watch
            self._warn_grad()
            self.fallbacks += 1
            return self.original(*args, **kwargs)
        inputs = self._inputs(args, kwargs)
        changed = self._changed()
        if changed and not self.warned:
            self.warned = True
            warnings.warn(
                "to_ikbo: the model changed after the pass (weights, mode, hooks, modules or state its forward read): the original "
                "runs; "
                "call to_ikbo again to serve a rewrite of the model as it is now",
                stacklevel=2,
            )
        settings = all(getter() == value for getter, value in self.settings)
        if inputs is not None and not changed and settings and self.matches(inputs):
            try:
                return self.rewritten(*inputs)
            except ops.WidthsChanged:
                pass
        self.fallbacks += 1
        return self.original(*args, **kwargs)


class _GraphState:
    """A torch.fx.GraphModule to pickle: its graph, and a plain module holding its submodules, parameters, buffers
    and the other attributes its graph reads (`module()` makes the GraphModule again)."""

    def __init__(self, gm):
        self.graph, self.name = torch.fx.Graph(), type(gm).__name__  # a copy: the graph points to its GraphModule
        self.graph.output(self.graph.graph_copy(gm.graph, {}))
        self.graph._codegen = copy.deepcopy(gm.graph._codegen)  # the inputs' and outputs' pytree structure
        root = torch.nn.Module()
        for key in ("_modules", "_parameters", "_buffers"):
            vars(root)[key] = dict(vars(gm)[key])
        for node in gm.graph.nodes:
            head = node.target.split(".")[0] if node.op == "get_attr" else None
            if head and not hasattr(root, head):
                object.__setattr__(root, head, getattr(gm, head))
        self.root = root

    def module(self):
        return torch.fx.GraphModule(self.root, self.graph, self.name)


_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))  # registries, hooks and mode: read apart (`Guarded._state`)
_MISSING = object()
_CONTAINERS = (list, tuple, set, frozenset, collections.deque, collections.abc.Mapping)
_OPAQUE = (torch.Tensor, torch.nn.Module, type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)
_MAX_CONTENTS = 4096  # entries read per call at most: a larger table is watched as an object


def _library(obj) -> bool:
    """Whether a class or function comes from torch, the standard library's builtins or this pass (not the model's)."""
    module = getattr(obj, "__module__", None) or ""
    if module.startswith(__name__):  # the pass, not its zoo of models
        return not module.rsplit(".", 1)[-1].startswith("zoo")
    return module.split(".")[0] in ("torch", "builtins", "typing", "abc")


def _getter(*keys):
    """itemgetter(*keys), giving a tuple for one key too."""
    return itemgetter(*keys) if len(keys) > 1 else lambda d: (d[keys[0]],)


def _kind_of(value):
    """How to list what `value` holds (`_kind`, kept per class)."""
    kind = _KINDS.get(type(value))
    if kind is None:
        kind = _KINDS[type(value)] = _kind(type(value))
    return kind


def _contents(values: list, out: list, depth: int = 3) -> list:
    """`out` with what the lists, tuples, dicts, sets and plain objects (dataclasses, namespaces: anything with a
    `__dict__` that is no tensor, module, class or function) among `values` hold, nested `depth` deep: a forward that
    reads `self.cfg["scale"]` or `self.cfg.gate` reads them too."""
    if depth and len(out) < _MAX_CONTENTS:
        for value in values:
            kind = _kind_of(value)
            if kind is not _leaf:
                inner = kind(value)
                out += inner
                _contents(inner, out, depth - 1)
    return out


def _leaf(value):
    return ()


def _kind(cls):
    """How to list what a value of this class holds (`_contents`): nothing for scalars, strings, tensors, modules,
    classes and functions."""
    if issubclass(cls, (str, bytes, int, float, complex, *_OPAQUE)):
        return _leaf
    if issubclass(cls, collections.abc.Mapping):
        return lambda v: list(chain.from_iterable(v.items()))
    if issubclass(cls, (set, frozenset)):
        return lambda v: sorted(v, key=id)
    if issubclass(cls, _CONTAINERS):
        return list
    if hasattr(cls, "__dict__") and "__dict__" in dir(cls) and not _library(cls):
        return lambda v: list(chain.from_iterable(vars(v).items())) if hasattr(v, "__dict__") else []
    return _leaf


_KINDS: dict = {}


def _read(namespace, name):
    """A global (`namespace` a dict), a closure cell's contents or a module's attribute; `_MISSING` where unset."""
    if type(namespace) is dict:
        return namespace.get(name, _MISSING)
    try:
        return getattr(namespace, name)
    except (AttributeError, ValueError):  # an empty cell
        return _MISSING


def _same_object(a, b) -> bool:
    """The same object, or an equal string (`os.environ` makes its strings at each read)."""
    return a is b or type(a) is type(b) and isinstance(a, (str, bytes)) and a == b


def _names_read(classes, modules) -> list:
    """(namespace, name) of each global, closure cell and attribute of a Python module (`os.environ`) that the
    functions of the model's own classes and of its modules' attributes (`self.spell = lambda ...`) name, and the
    functions they reach that way (helpers of the model's code, not torch's), which `Guarded` reads at each call: a
    forward reading `SCALE` was traced with its value."""
    functions = [f for c in classes for f in vars(c).values()]
    functions += [f for m in modules for f in vars(m).values() if isinstance(f, types.FunctionType)]
    reads, seen, todo = [], set(), []
    for f in functions:
        f = getattr(f, "__func__", f)  # staticmethod, classmethod
        todo += [g for g in (f, getattr(f, "fget", None)) if isinstance(g, types.FunctionType)]
    while todo:
        f = todo.pop()
        if id(f) in seen or _library(f):
            continue
        seen.add(id(f))
        namespace, names = f.__globals__, set()
        codes = [f.__code__]
        while codes:
            code = codes.pop()
            names.update(code.co_names)
            codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
        cells = [(c, "cell_contents") for c in f.__closure__ or ()]
        found = [(namespace, n) for n in sorted(names) if n in namespace] + cells
        for where, name in found:
            value = _read(where, name)
            if isinstance(value, types.ModuleType):  # `os.environ`, `config.SCALE`: data attributes it names
                found += [(value, n) for n in sorted(names) if n in vars(value) and not callable(vars(value)[n])
                          and not isinstance(vars(value)[n], types.ModuleType)]  # fmt: skip
            elif isinstance(value, types.FunctionType):
                todo.append(value)
            reads.append((where, name))
    return reads
