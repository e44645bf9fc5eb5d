"""Inference-time IKBO transformation: a standard ranking model in, the same function out, with user
tensors kept at U rows and joined to candidates through `cand_to_user` (docs/design/transform.md).

    module, report = to_ikbo(model, example_inputs)   # example_inputs: forward's positional args
    print(report)                                     # what was rewritten, what was left and why

The pass traces `model` with torch.fx (through every submodule), finds the replications of user
tensors (x[cand_to_user], index_select(0, cand_to_user), repeat_interleave(counts, dim=0), expand of
one user row) and rewrites the graph (rewrite.py): row-wise ops run at U rows, a concat of user and
candidate features before a linear becomes the Type I split or ikbo_linear_compress, attention over
replicated K/V becomes ikbo_attention, and other joins become add_user_rows or grouped ops (ops.py).
What cannot be rewritten is replicated where it is consumed, and the report says where and why.
"""

from __future__ import annotations

import inspect

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from .detect import ReplicationDetector
from .rewrite import Report, Rewriter

MAPPING_ARGUMENT = "cand_to_user"

__all__ = ["MAPPING_ARGUMENT", "ReplicationDetector", "Report", "to_ikbo", "trace"]


class _Tracer(fx.Tracer):
    """Traces into every submodule (nn.Linear → F.linear …), so the pass sees functional ops only."""

    def is_leaf_module(self, module, qualified_name) -> bool:
        return False


def trace(model: torch.nn.Module) -> fx.GraphModule:
    graph = _Tracer().trace(model)
    return fx.GraphModule(model, graph, class_name=type(model).__name__)


RTOL = {torch.float16: 2e-2, torch.bfloat16: 2e-2}  # default 1e-3 (fp32: tf32 on CUDA, fp64)


def to_ikbo(model: torch.nn.Module, example_inputs, mapping_name: str = MAPPING_ARGUMENT, rtol: float | None = None):
    """(rewritten module, report). `example_inputs`: forward's positional arguments for one request,
    with U ≠ B (row counts tell user tensors from candidate tensors); values are not baked in.

    Never wrong: a model that does not trace, or whose rewrite fails or disagrees with it on the
    example (relative error above `rtol`), comes back unchanged, with the reason in the report.
    `rtol` catches a wrong rewrite (errors of order 1), not rounding: on CUDA the IKBO linear
    compression runs fp32 in tf32 (relative error near 3e-4 on its own output). Default: 1e-3, or
    2e-2 when the example's floating inputs are 16-bit (bf16 rounding alone reaches ~1e-3).
    """
    example_inputs = tuple(example_inputs)
    if rtol is None:
        dtypes = {t.dtype for t in example_inputs if isinstance(t, torch.Tensor) and t.is_floating_point()}
        rtol = max([RTOL.get(d, 1e-3) for d in dtypes], default=1e-3)
    names = list(inspect.signature(model.forward).parameters)
    if mapping_name not in names:
        raise ValueError(f"model: forward has no argument named {mapping_name!r} (arguments: {names})")
    try:
        traced = trace(model)
    except Exception as e:
        return model, Report(
            left=[f"the whole model: torch.fx could not trace it ({type(e).__name__}: {e}); served unchanged"]
        )
    try:
        module, report = Rewriter(traced, example_inputs, mapping_name).run()
    except Exception as e:
        return model, Report(left=[f"the whole model: the rewrite failed ({type(e).__name__}: {e}); served unchanged"])
    error = _disagreement(model, module, example_inputs)
    if error > rtol:
        reason = f"the rewrite disagrees with it on the example (rel. error {error:.1e})"
        return model, Report(left=[f"the whole model: {reason}; served unchanged"])
    return module, report


def _disagreement(model, module, example_inputs) -> float:
    """Largest relative error of `module` against `model` over their tensor outputs."""
    with torch.no_grad():
        expected, actual = tree_flatten(model(*example_inputs))[0], tree_flatten(module(*example_inputs))[0]
    if len(expected) != len(actual):
        return float("inf")
    worst = 0.0
    for e, a in zip(expected, actual):
        if isinstance(e, torch.Tensor):
            if not isinstance(a, torch.Tensor) or a.shape != e.shape:
                return float("inf")
            e, a = e.double(), a.double()
            both_nan = torch.isnan(e) & torch.isnan(a)
            e, a = torch.where(both_nan, 0.0, e), torch.where(both_nan, 0.0, a)
            worst = max(worst, float((a - e).norm() / e.norm().clamp(min=1e-30)))
        elif e != a:
            return float("inf")
    return worst
