"""The IKBO interaction under torch.compile(fullgraph=True) and torch.export: the ops are custom ops with fakes
and autograd, so the whole ranker compiles without a graph break, exports with dynamic U and B, and matches eager
forward and backward."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from stand_ins import ODD_DIMS

from ikbo_backend.ranker import Features, FeatureStage, IkboRanker, make_demo_weights
from ikbo_backend.synthetic import make_request, to_tensors
from kernels.reference import rel_err

CFG = ODD_DIMS
WEIGHTS = make_demo_weights(CFG, seed=int(np.random.default_rng().integers(1 << 30)))
FEATURES = FeatureStage(CFG, WEIGHTS)


class Interaction(torch.nn.Module):
    """IkboRanker over the feature stage's five tensors (what torch.export takes)."""

    def __init__(self, ranker: IkboRanker):
        super().__init__()
        self.ranker = ranker

    def forward(self, user_tokens, cand_tokens, history_tokens, history_len, cand_to_user):
        return self.ranker(Features(user_tokens, cand_tokens, history_tokens, history_len, cand_to_user))


def features(num_users, num_candidates, empty_user=False, device="cpu", dtype=torch.float32):
    request = make_request(CFG, num_users, num_candidates, np.random.default_rng())
    if empty_user and num_users > 1:
        request["cand_to_user"] = np.maximum(request["cand_to_user"], 1)  # user 0 has no candidates
    f = FEATURES(**to_tensors(request))
    floats = [
        t.detach().to(device, dtype).requires_grad_(True) for t in (f.user_tokens, f.cand_tokens, f.history_tokens)
    ]
    return (*floats, f.history_len.to(device), f.cand_to_user.to(device))


def forward_backward(fn, inputs, grad_out=None):
    scores = fn(*inputs)
    grad_out = torch.randn_like(scores) if grad_out is None else grad_out
    grads = torch.autograd.grad(scores, inputs[:3], grad_out)
    return scores, grads, grad_out


@pytest.mark.parametrize("shape", [(3, 20, False), (1, 1, False), (4, 9, True)])
def test_ranker_compiles_whole_and_matches_eager(shape):
    model = Interaction(IkboRanker(CFG, WEIGHTS, backend="torch"))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    inputs = features(*shape)
    want, want_grads, grad_out = forward_backward(model, inputs)
    got, got_grads, _ = forward_backward(compiled, inputs, grad_out)
    assert rel_err(got, want) <= 1e-6
    for g, w in zip(got_grads, want_grads):
        assert rel_err(g, w) <= 1e-5


def test_ranker_exports_with_dynamic_users_and_candidates():
    model = Interaction(IkboRanker(CFG, WEIGHTS, backend="torch"))
    users, cands = torch.export.Dim("U", min=1, max=4096), torch.export.Dim("B", min=1, max=1 << 20)
    example = [t.detach() for t in features(3, 20)]
    exported = torch.export.export(
        model, tuple(example), dynamic_shapes=({0: users}, {0: cands}, {0: users}, {0: users}, {0: cands})
    )
    ops = {str(node.target) for node in exported.graph.nodes if node.op == "call_function"}
    assert {"ikbo.linear_compress.default", "ikbo.self_target_attention.default", "ikbo.add_user_rows.default"} <= ops
    for shape in ((5, 37), (1, 1), (2, 64)):
        inputs = [t.detach() for t in features(*shape)]
        assert rel_err(exported.module()(*inputs), model(*inputs)) <= 1e-6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_ranker_compiles_with_inductor_on_cuda():
    model = Interaction(IkboRanker(CFG, {k: v.cuda() for k, v in WEIGHTS.items()}, device="cuda"))
    compiled = torch.compile(model, fullgraph=True)
    for shape in ((15, 1024, False), (4, 64, True)):
        inputs = features(*shape, device="cuda")
        want, want_grads, grad_out = forward_backward(model, inputs)
        got, got_grads, _ = forward_backward(compiled, inputs, grad_out)
        assert rel_err(got, want) <= 1e-3
        for g, w in zip(got_grads, want_grads):
            assert rel_err(g, w) <= 1e-2
