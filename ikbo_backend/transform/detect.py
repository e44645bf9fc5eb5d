"""A dispatch-mode check that a model never replicates user tensors to candidate rows."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class ReplicationDetector(TorchDispatchMode):
    """Records ops that turn a U-row float tensor into a B-row float tensor with no B-row float input.

    That is a user tensor replicated to candidate count; combining a B-row candidate tensor with
    U-row user rows (the IKBO join) has a B-row input and is not recorded. Pick U and B distinct from
    the model's other dims (and U > 1), so that row counts identify tensors.
    """

    def __init__(self, num_users, num_candidates):
        super().__init__()
        self.num_users, self.num_candidates = num_users, num_candidates
        self.replications = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [
            t
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor) and t.dim() and t.is_floating_point()
        ]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.dim() and t.is_floating_point()]
        rows_in = {t.shape[0] for t in inputs}
        if (
            self.num_users in rows_in
            and self.num_candidates not in rows_in
            and any(t.shape[0] == self.num_candidates for t in outputs)
        ):
            self.replications.append(str(func))
        return out
