"""A dispatch-mode check that a model never replicates user tensors to candidate rows."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class ReplicationDetector(TorchDispatchMode):
    """Records ops that turn a U-row float tensor into a B-row float tensor with no B-row float input (complex
    tensors count as float: a spectrum of user rows replicated is a replication).

    That is a user tensor replicated to candidate count; combining a B-row candidate tensor with
    U-row user rows (the IKBO join) has a B-row input and is not recorded. Pick U and B distinct from
    the model's other dims (and U > 1), so that row counts identify tensors. `floats_only=False` also
    records integer and boolean tensors (user ids replicated before their embedding lookups).
    """

    def __init__(self, num_users, num_candidates, floats_only: bool = True, row_dims=(0,)):
        super().__init__()
        self.num_users, self.num_candidates = num_users, num_candidates
        self.floats_only = floats_only
        self.row_dims = row_dims  # (0, 1) also finds sequence-first replications ([L, U, E] → [L, B, E])
        self.replications = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))

        def dense(t):  # nested tensors have no sizes to compare
            return isinstance(t, torch.Tensor) and not t.is_nested and t.dim()

        inputs = [t for t in tree_flatten((args, kwargs))[0] if dense(t)]
        outputs = [t for t in tree_flatten(out)[0] if dense(t) and (_values(t) or not self.floats_only)]
        for d in self.row_dims:
            user_rows = any(
                t.dim() > d and t.shape[d] == self.num_users and (_values(t) or not self.floats_only) for t in inputs
            )
            # integer inputs with B rows are indices (cand_to_user and what is built from it), not candidate data
            cand_rows = any(
                t.dim() > e and t.shape[e] == self.num_candidates and _values(t) for t in inputs for e in self.row_dims
            )
            if user_rows and not cand_rows and any(t.dim() > d and t.shape[d] == self.num_candidates for t in outputs):
                self.replications.append(str(func))
                break
        return out


def _values(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def replications_in(
    fn, args, num_users: int, num_candidates: int, floats_only: bool = True, row_dims=(0,)
) -> list[str]:
    """The ops of `fn(*args)` (under inference mode) that replicate a user tensor to candidate rows (on dim 0, or
    on each of `row_dims`)."""
    with torch.inference_mode(), ReplicationDetector(num_users, num_candidates, floats_only, row_dims) as detector:
        fn(*args)
    return detector.replications
