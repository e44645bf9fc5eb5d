"""Inference-time IKBO transformation: a standard ranking model in, the same function out, with user
tensors kept at U rows and joined to candidates through `cand_to_user` (issue 7, docs/transform.md).

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

import torch
import torch.fx as fx

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


def to_ikbo(model: torch.nn.Module, example_inputs, mapping_name: str = MAPPING_ARGUMENT) -> tuple[fx.GraphModule, Report]:
    """(rewritten module, report). `example_inputs`: forward's positional arguments for one request,
    with U ≠ B (row counts tell user tensors from candidate tensors); values are not baked in."""
    traced = trace(model)
    return Rewriter(traced, tuple(example_inputs), mapping_name).run()
