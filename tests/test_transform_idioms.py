"""The IKBO transformation on the spellings independent models use: replication by what it computes,
key masks in every common form, Python control flow (guards), modules the capture cannot see into,
RNNs, standard transformer layers, dict / tuple inputs, U == B, the cost model's decision, and the
eval form of nn.MultiheadAttention against the module. Every rewrite is checked on fresh inputs at other
U, B (unsorted mappings) against the original model.
"""

import collections
import contextlib
import copy
import dataclasses
import enum
import inspect
import itertools
import math
import operator
import os
import pickle
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.utils._pytree import tree_flatten

from ikbo_backend.transform import Guarded, cost, ops, replications_in, to_ikbo
from ikbo_backend.transform.standard import multihead_attention
from kernels.reference import rel_err

D, L, H, FU, FC = 16, 12, 2, 6, 9
EXAMPLE, SIZES = (5, 37), [(3, 41), (7, 53)]
WITHOUT_CANDIDATES = [*SIZES, (20, 8)]  # most users without candidates
RTOL = 1e-5


def request(num_users, num_candidates, gen, sorted_mapping=False):
    mapping = torch.randint(0, num_users, (num_candidates,), generator=gen)
    if sorted_mapping:
        mapping = mapping.sort().values
    ids = torch.randint(1, 50, (num_users, L), generator=gen)
    ids[torch.rand(num_users, L, generator=gen) < 0.3] = 0  # padding anywhere: not a prefix
    ids[:, 0] = 1
    return dict(
        user=torch.randn(num_users, FU, generator=gen),
        history=torch.randn(num_users, L, D, generator=gen),
        lengths=torch.randint(1, L + 1, (num_users,), generator=gen),
        ids=ids,
        cand=torch.randn(num_candidates, FC, generator=gen),
        cand_to_user=mapping,
    )


def args_for(model, inputs):
    names = model.forward.__code__.co_varnames[1 : model.forward.__code__.co_argcount]
    return tuple(inputs[n] for n in names)


def check(model, make=request, expect_left=0, must=(), sizes=SIZES, row_dims=(0,), example=None):
    """Transform on the example (made by `example`, default `make`), then compare with the original on fresh requests
    at `sizes` (U:B); where nothing is left, the rewrite must not replicate on `row_dims` (checked where U, B and 1
    differ: rows tell tensors apart); returns the report."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = model.eval()
    module, report = to_ikbo(model, args_for(model, (example or make)(*EXAMPLE, gen)), measure=False)
    assert module is not model, str(report)
    assert report.replications_left == expect_left, str(report)
    for word in must:
        assert word in str(report), f"{word!r} not in\n{report}"
    for num_users, num_candidates in sizes:
        args = args_for(model, make(num_users, num_candidates, gen))
        with torch.inference_mode():
            assert rel_err(module(*args), model(*args)) <= RTOL, str(report)
        if expect_left == 0 and 1 < num_candidates != num_users:
            assert replications_in(module, args, num_users, num_candidates, row_dims=row_dims) == [], str(report)
    return report


class Replicated(nn.Module):
    """An MLP over cat(user features replicated by `spell`, candidate features)."""

    SPELLINGS = {
        "index": lambda x, m: x[m],
        "index_rows": lambda x, m: x[m, :],
        "index_ellipsis": lambda x, m: x[m, ...],
        "index_select": lambda x, m: torch.index_select(x, 0, m),
        "gather": lambda x, m: torch.gather(x, 0, m.long().unsqueeze(1).expand(-1, x.shape[1])),
        "gather_view": lambda x, m: x.gather(0, m.view(-1, 1).repeat(1, x.size(1))),
        "take_along_dim": lambda x, m: torch.take_along_dim(x, m.view(-1, 1), dim=0),
        "embedding": lambda x, m: F.embedding(m, x),
        "one_hot_matmul": lambda x, m: F.one_hot(m, x.shape[0]).to(x.dtype) @ x,
        "compare_matmul": lambda x, m: torch.mm((m[:, None] == torch.arange(x.shape[0])).float(), x),
        "eye_rows_matmul": lambda x, m: torch.matmul(torch.eye(x.shape[0])[m], x),
        "one_hot_einsum": lambda x, m: torch.einsum("bu,uf->bf", F.one_hot(m, x.shape[0]).float(), x),
        "one_hot_einsum_swapped": lambda x, m: torch.einsum("u...,bu->b...", x, F.one_hot(m, x.shape[0]).to(x.dtype)),
    }

    def __init__(self, spell):
        super().__init__()
        self.spell = self.SPELLINGS[spell]
        self.net = nn.Sequential(nn.Linear(FU + FC, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, user, cand, cand_to_user):
        return self.net(torch.cat([self.spell(user, cand_to_user), cand], dim=1))


@pytest.mark.parametrize("spell", list(Replicated.SPELLINGS))
def test_replication_spellings(spell):
    check(Replicated(spell), must=("kept virtual", "linear_rows"))


def test_soft_selection_is_not_a_replication():
    """A [B, U] matrix computed from the mapping that is not one-hot (label smoothing) mixes users: it is not taken
    for a replication, and the model's outputs stay the same."""
    model = Replicated("one_hot_matmul").eval()
    model.spell = lambda x, m: (0.9 * F.one_hot(m, x.shape[0]) + 0.1 / x.shape[0]) @ x
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    module, report = to_ikbo(model, args_for(model, request(*EXAMPLE, gen)), measure=False)
    assert "selection" not in str(report), str(report)
    args = args_for(model, request(7, 53, gen))
    with torch.inference_mode():
        assert rel_err(module(*args), model(*args)) <= RTOL, str(report)


class MaskedSelection(nn.Module):
    """A one-hot selection matrix scaled by a per-candidate validity mask (all ones on the example): not a
    replication, since other inputs' values enter it."""

    def forward(self, user, cand, valid, cand_to_user):
        selection = F.one_hot(cand_to_user, user.shape[0]).float() * valid[:, None]
        return torch.cat([selection @ user, cand], 1)


def test_selection_scaled_by_other_inputs_is_not_a_replication():
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    inputs = lambda u, b, valid: (*args_for(Replicated("index"), request(u, b, gen)), valid)  # noqa: E731
    model = MaskedSelection().eval()
    user, cand, mapping, _ = inputs(*EXAMPLE, None)
    module, report = to_ikbo(model, (user, cand, torch.ones(EXAMPLE[1]), mapping), measure=False)
    for num_users, num_candidates in SIZES:
        user, cand, mapping, _ = inputs(num_users, num_candidates, None)
        valid = (torch.rand(num_candidates, generator=gen) > 0.3).float()
        with torch.inference_mode():
            assert rel_err(module(user, cand, valid, mapping), model(user, cand, valid, mapping)) <= RTOL, str(report)


class RowCounts(nn.Module):
    """Row counts used as numbers and in branches: `x.shape[0]` of a replica as a fill value (B in the original),
    a branch on `cand.numel()` or on the size of a flattened replica (both count candidates)."""

    def __init__(self, use):
        super().__init__()
        self.use = use

    def forward(self, user, cand, cand_to_user):
        x = user[cand_to_user]
        if self.use == "fill":
            return torch.cat([x * torch.full_like(x[:, :1], x.shape[0]).clamp(max=EXAMPLE[0] - 1), cand], 1)
        count = cand.numel() // FC if self.use == "numel" else x.reshape(-1).shape[0] // FU
        return torch.cat([x * 2, cand], 1) if count >= EXAMPLE[1] else torch.cat([x, cand], 1)


@pytest.mark.parametrize("use", ["fill", "numel", "flattened_size"])
def test_row_counts_as_values_and_in_branches(use):
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = RowCounts(use).eval()
    module, report = to_ikbo(model, args_for(model, request(*EXAMPLE, gen)), measure=False)
    for num_users, num_candidates in [(3, 41), (4, 2), (1, 1)]:
        args = args_for(model, request(num_users, num_candidates, gen))
        with torch.inference_mode():
            assert rel_err(module(*args), model(*args)) <= RTOL, str(report)


def test_keyword_arguments():
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = Replicated("index").eval()
    module, _ = to_ikbo(model, args_for(model, request(*EXAMPLE, gen)), measure=False)
    user, cand, mapping = args_for(model, request(7, 53, gen))
    with torch.inference_mode():
        want = model(user, cand, mapping)
        assert rel_err(module(user=user, cand=cand, cand_to_user=mapping), want) <= RTOL
        assert rel_err(module(user, cand_to_user=mapping, cand=cand), want) <= RTOL
    assert module.fallbacks == 0


class Written(nn.Module):
    """Ops that write their inputs: `out=` on a user input, a lookup that renormalizes the rows it reads
    (`F.embedding(m, user, max_norm=1)`), `user.add_(1)` (the caller's example must stay as it was)."""

    def __init__(self, how):
        super().__init__()
        self.how, self.out = how, nn.Linear(FU + FC, 1)

    def forward(self, user, cand, cand_to_user):
        if self.how == "out":
            torch.tanh(user, out=user)
            torch.add(cand, 1.0, out=cand)
            replica = user[cand_to_user]
        elif self.how == "max_norm":
            replica = F.embedding(cand_to_user, user, max_norm=1.0)
        else:
            replica = user.add_(1)[cand_to_user]
        return self.out(torch.cat([replica, cand], 1))


@pytest.mark.parametrize("how", ["out", "max_norm", "add_"])
def test_ops_that_write_their_inputs(how):
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = Written(how).eval()
    example = args_for(model, request(*EXAMPLE, gen))
    before = [t.clone() for t in example]
    module, report = to_ikbo(model, example, measure=False)
    assert all(torch.equal(a, b) for a, b in zip(example, before)), "to_ikbo changed the caller's example"
    for num_users, num_candidates in SIZES:
        args = args_for(model, request(num_users, num_candidates, gen))
        with torch.inference_mode():
            want = model(*[t.clone() for t in args])
            assert rel_err(module(*[t.clone() for t in args]), want) <= RTOL, str(report)


class LookupTable(nn.Module):
    """A [U_example, d] argument that is not per user (a lookup table with as many rows as the example's users)."""

    def __init__(self):
        super().__init__()
        self.out = nn.Linear(FU + FC, 1)

    def forward(self, user, table, cand, cand_to_user):
        return self.out(torch.cat([user[cand_to_user] * table[cand_to_user], cand], 1))


def test_argument_with_as_many_rows_as_users_is_checked_per_call():
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    table = torch.randn(EXAMPLE[0], FU, generator=gen)
    model = LookupTable().eval()
    inputs = lambda u, b: (lambda r: (r["user"], table, r["cand"], r["cand_to_user"]))(request(u, b, gen))  # noqa: E731
    module, report = to_ikbo(model, inputs(*EXAMPLE), measure=False)
    for num_users, num_candidates in [(3, 41), (4, 9), (1, 1)]:  # the table's rows cover these users
        args = inputs(num_users, num_candidates)
        with torch.inference_mode():
            assert rel_err(module(*args), model(*args)) <= RTOL, str(report)


def test_other_feature_widths_run_the_original():
    """The concat's user / candidate split is the example's: a call whose widths differ (same total) runs the
    original."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = Replicated("index").eval()
    module, _ = to_ikbo(model, args_for(model, request(*EXAMPLE, gen)), measure=False)
    user, cand, mapping = args_for(model, request(7, 53, gen))
    moved = torch.cat([user, cand[:7]], 1)[:, : FU - 2], torch.cat([user[:1].expand(53, -1)[:, :2], cand], 1)
    with torch.inference_mode():
        assert rel_err(module(*moved, mapping), model(*moved, mapping)) <= RTOL
    assert module.fallbacks == 1


class JaggedHistory(nn.Module):
    """A jagged history (values [N], offsets [U + 1]) pooled by an EmbeddingBag, beside user features [U, FU]: one
    tensor of each row count, so U is the one the mapping can index, the smallest of the tie."""

    def __init__(self):
        super().__init__()
        self.bag, self.user = nn.EmbeddingBag(50, D, mode="mean"), nn.Linear(FU, D)
        self.out = nn.Linear(2 * D + FC, 1)

    def forward(self, values, offsets, user, cand, cand_to_user):
        pooled = self.bag(values, offsets[:-1])
        return self.out(torch.cat([pooled[cand_to_user], self.user(user)[cand_to_user], cand], 1))


def test_user_rows_beside_jagged_inputs():
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))

    def inputs(num_users, num_candidates):
        r = request(num_users, num_candidates, gen)
        lengths = torch.randint(1, 6, (num_users,), generator=gen)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        values = torch.randint(0, 50, (int(offsets[-1]),), generator=gen)
        return values, offsets, r["user"], r["cand"], r["cand_to_user"]

    model = JaggedHistory().eval()
    module, report = to_ikbo(model, inputs(*EXAMPLE), measure=False)
    assert "kept virtual" in str(report) and report.replications_left == 0, str(report)
    for num_users, num_candidates in SIZES:
        args = inputs(num_users, num_candidates)
        with torch.inference_mode():
            assert rel_err(module(*args), model(*args)) <= RTOL, str(report)
        assert replications_in(module, args, num_users, num_candidates) == [], str(report)


class AddProducts(nn.Module):
    """baddbmm / addmm over replicated user rows: scores = bias + q · kᵀ (baddbmm, a scaled additive key mask as
    the bias, as some attention code writes it) and a user projection by addmm."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(FC, D)
        self.proj = nn.Parameter(torch.randn(FU, D) / FU**0.5)
        self.bias = nn.Parameter(torch.randn(D))
        self.out = nn.Linear(2 * D + FC, 1)

    def forward(self, user, history, lengths, cand, cand_to_user):
        keys = history[cand_to_user]
        mask = torch.arange(history.shape[1])[None, :] < lengths[cand_to_user][:, None]
        bias = torch.zeros(mask.shape).masked_fill(~mask, float("-inf")).unsqueeze(1)
        q = self.q(cand).unsqueeze(1)
        scores = torch.baddbmm(bias, q, keys.transpose(1, 2), beta=1.0, alpha=D**-0.5)
        pooled = torch.bmm(torch.softmax(scores, -1), keys).squeeze(1)
        projected = torch.addmm(self.bias, user[cand_to_user], self.proj, alpha=0.5)
        return self.out(torch.cat([pooled, projected, cand], dim=1))


def test_baddbmm_and_addmm_decomposed():
    check(AddProducts(), must=("rows_matmul",))


class Routed(nn.Module):
    """MIND-style interests by dynamic routing over the replicated history, whose routing logits start from a
    constant repeated to the history's row count (`B0.unsqueeze(0).repeat(h.size(0), 1, 1)`), then label-aware
    attention with the candidate: the routing runs at U rows."""

    def __init__(self, interests=3):
        super().__init__()
        self.bilinear = nn.Parameter(torch.randn(D, D) / D**0.5)
        self.start = nn.Parameter(torch.randn(interests, L) * 0.1)
        self.q = nn.Linear(FC, D)

    def forward(self, history, lengths, cand, cand_to_user):
        h = history[cand_to_user] @ self.bilinear  # [B, L, D]
        valid = (torch.arange(L)[None, :] < lengths[cand_to_user][:, None]).float()
        logits = self.start.unsqueeze(0).repeat(h.size(0), 1, 1)  # [B, K, L]
        for _ in range(2):
            weights = torch.softmax(logits.masked_fill(valid[:, None, :] == 0, -1e9), dim=1) * valid[:, None, :]
            caps = torch.bmm(weights, h)
            caps = caps * torch.rsqrt((caps * caps).sum(-1, keepdim=True) + 1.0)
            logits = logits + torch.bmm(caps, h.transpose(1, 2))
        att = torch.softmax(torch.bmm(caps, self.q(cand).unsqueeze(-1)).squeeze(-1), -1)
        return (att.unsqueeze(-1) * caps).sum(1)


def test_constant_repeated_to_a_replicated_row_count():
    check(Routed(), must=("rows_matmul",))


class PairProducts(nn.Module):
    """AFM-style attention over pairwise products of field embeddings (user fields replicated, then candidate
    fields): pairs from `itertools.combinations` over `torch.split` pieces, gathered by two `torch.cat`s whose user /
    candidate boundaries differ, multiplied, scored by an MLP, softmax over the pairs."""

    def __init__(self):
        super().__init__()
        self.att = nn.Sequential(nn.Linear(D, 8), nn.ReLU(), nn.Linear(8, 1, bias=False))
        self.user_fields, self.cand_fields = nn.Linear(FU, 4 * D), nn.Linear(FC, 2 * D)  # 6 fields: not U or B

    def forward(self, user, cand, cand_to_user):
        users = self.user_fields(user).view(-1, 4, D)[cand_to_user]
        fields = torch.cat([users, self.cand_fields(cand).view(-1, 2, D)], dim=1)
        left, right = zip(*itertools.combinations(torch.split(fields, 1, dim=1), 2))
        products = torch.cat(left, dim=1) * torch.cat(right, dim=1)  # [B, 15, D]
        weights = torch.softmax(self.att(products), dim=1)
        return (weights * products).sum(1)


def test_products_of_concats_with_other_boundaries_run_per_piece():
    """The products split at the boundaries of both concats: user × user pairs at U rows, user × candidate pairs
    joined; only the pair scores (one value a pair) meet candidates in the softmax, reported as such."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = PairProducts().eval()
    module, report = to_ikbo(model, args_for(model, request(*EXAMPLE, gen)), measure=False)
    text = str(report)
    assert "rows_join" in text and "row-wise ops run at U rows" in text, text
    assert report.left and all("softmax over user and candidate entries" in e for e in report.left), text
    for num_users, num_candidates in SIZES:
        args = args_for(model, request(num_users, num_candidates, gen))
        with torch.inference_mode():
            assert rel_err(module(*args), model(*args)) <= RTOL, text


class InPlace(nn.Module):
    """In-place ops as public code writes them: a padding mask applied with an unassigned masked_fill_ (no padding
    id in the example, so the example cannot tell it is there), a user gate multiplied into candidate rows with
    mul_, `+=`, and nn.ReLU(inplace=True) on a value that is read again afterwards."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, D)
        self.gate = nn.Linear(FU, FC)
        self.act = nn.ReLU(inplace=True)
        self.net = nn.Linear(D + 2 * FC, 1)

    def forward(self, ids, user, cand, cand_to_user):
        h = self.emb(ids)  # [U, L, D]; id 0 is padding
        h.masked_fill_((ids == 0).unsqueeze(-1), 0.0)
        x = cand.clone()
        x.mul_(torch.sigmoid(self.gate(user))[cand_to_user] * 2)
        x += 1.0
        y = self.act(x - 1.5)  # x - 1.5 is changed in place
        return self.net(torch.cat([h[cand_to_user].sum(1), x, y], dim=1))


def request_without_padding(num_users, num_candidates, gen):
    inputs = request(num_users, num_candidates, gen)
    inputs["ids"] = inputs["ids"].clamp(min=1)
    return inputs


def test_in_place_ops_keep_their_effect():
    """An in-place op counts for its effect even where its result is unused: the example (no padding) cannot tell
    the padding mask is there, and the rewrite still applies it on requests with padding."""
    model = InPlace().eval()
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    module, report = to_ikbo(model, args_for(model, request_without_padding(*EXAMPLE, gen)), measure=False)
    assert module is not model and report.replications_left == 0, str(report)
    for num_users, num_candidates in SIZES:
        args = args_for(model, request(num_users, num_candidates, gen))  # with padding
        assert (args[0] == 0).any()
        with torch.inference_mode():
            assert rel_err(module(*args), model(*args)) <= RTOL, str(report)
        assert replications_in(module, args, num_users, num_candidates) == [], str(report)


def request_to_change(num_users, num_candidates, gen, triggered=True):
    """Requests for models that change a tensor in place where its values call for it: `triggered`, large features
    (past a clip) and cold-start users (length 0), the last user without candidates; else none of these (the
    example: the change is not there to see)."""
    inputs = request(num_users, num_candidates, gen)
    inputs["user"] *= 3.0 if triggered else 0.05
    inputs["cand"] *= 3.0 if triggered else 0.05
    if triggered:
        inputs["lengths"][::2] = 0
        inputs["cand_to_user"] %= max(num_users - 1, 1)
    return inputs


def example_to_change(num_users, num_candidates, gen):
    return request_to_change(num_users, num_candidates, gen, triggered=False)


class ChangedAfterReplication(nn.Module):
    """A user tensor changed in place after its replication `u[m]` (a copy taken before the change) and read again
    afterwards: a clip, cold-start users' rows zeroed (the assignment from an outside tester's reproducer) or their
    infinities replaced."""

    CHANGES = {
        "clamp_": lambda u, n: u.clamp_(-1.0, 1.0),
        "masked_fill_": lambda u, n: u.masked_fill_((n == 0).unsqueeze(-1), 0.0),
        "nan_to_num_": lambda u, n: u.nan_to_num_(posinf=5.0, neginf=-5.0),
        "setitem": lambda u, n: operator.setitem(u, n == 0, 0.0),
    }

    def __init__(self, change):
        super().__init__()
        self.change = self.CHANGES[change]
        self.out, self.user_out = nn.Linear(FU + FC, 1), nn.Linear(FU, 1)

    def forward(self, user, lengths, cand, cand_to_user):
        u = 2.0 * user / lengths.unsqueeze(-1)  # [U, FU]; ±inf for cold-start users
        u_b = u[cand_to_user]
        self.change(u, lengths)
        scores = self.out(torch.cat([u_b.clamp(-10.0, 10.0), cand], dim=-1))
        return scores + self.user_out(u)[cand_to_user]


@pytest.mark.parametrize("change", list(ChangedAfterReplication.CHANGES))
def test_in_place_change_of_a_replicated_source(change):
    """The replica keeps the values from before the change; the source is changed on a copy at U rows."""
    check(ChangedAfterReplication(change), make=request_to_change, example=example_to_change, must=("kept virtual",))


class ChangedAfterAJoin(nn.Module):
    """Candidate rows clipped in place after a join kept as its terms read them: `x + u[m]` (a Sum) or
    `cat([u[m], x])` (a Concat) holds the values from before the clip."""

    def __init__(self, join):
        super().__init__()
        self.join = join
        self.out, self.cand_out = nn.Linear(2 * FU if join == "cat" else FU, 1), nn.Linear(FU, 1)

    def forward(self, user, cand, cand_to_user):
        x = 2.0 * cand[:, :FU]
        u_b = user[cand_to_user]
        joined = x + u_b if self.join == "add" else torch.cat([u_b, x], dim=-1)
        x.clamp_(-1.0, 1.0)
        return self.out(joined) + self.cand_out(x)


@pytest.mark.parametrize("join", ["add", "cat"])
def test_in_place_change_of_candidate_rows_a_join_holds(join):
    """The change runs on a copy of the candidate rows; the join reads the rows from before."""
    check(ChangedAfterAJoin(join), make=request_to_change, example=example_to_change)


class ChangedThroughAView(nn.Module):
    """An in-place op on a view of a replica, `u[:, :3].clamp_(...)` (din_bmm's clip of heavy-tailed features, from
    an outside tester's reproducer), or cold-start users' features zeroed through `u[:, 0]` or `v *= ...`: the
    replica sees the change."""

    CHANGES = {
        "clamp_": lambda u, n: u[:, :3].clamp_(-1.0, 1.0),
        "masked_fill_": lambda u, n: u[:, 0].masked_fill_(n == 0, 0.0),
        "imul": lambda u, n: operator.imul(u[:, 1:4], (n > 0).unsqueeze(-1)),  # v = u[:, 1:4]; v *= ...
    }

    def __init__(self, change):
        super().__init__()
        self.change = self.CHANGES[change]
        self.out = nn.Linear(FU + FC, 1)

    def forward(self, user, lengths, cand, cand_to_user):
        u = user[cand_to_user]
        self.change(u, lengths[cand_to_user])
        return self.out(torch.cat([u, cand], dim=-1))


@pytest.mark.parametrize("change", list(ChangedThroughAView.CHANGES))
def test_in_place_change_through_a_view_of_a_replica(change):
    """Written back into the replica: `t = u[:, :3].clamp(...)`, `u[:, :3] = t` at U rows."""
    check(ChangedThroughAView(change), make=request_to_change, example=example_to_change, must=("linear_rows",))


class AssignedIntoAReplica(nn.Module):
    """`u_b[:, 0] = 0` into the replica, then the source read again: the source keeps its first column."""

    def __init__(self):
        super().__init__()
        self.proj, self.out = nn.Linear(FU, FU), nn.Linear(FU, 1)

    def forward(self, user, cand, cand_to_user):
        u = self.proj(user)
        u_b = u[cand_to_user]
        u_b[:, 0] = 0.0
        return self.out(u_b * cand[:, :FU]) + self.out(u)[cand_to_user]


def test_assignment_into_a_replica_leaves_its_source():
    check(AssignedIntoAReplica(), must=("rows_join",))


class ChangedThroughOtherViews(nn.Module):
    """A clip through a view that is not an index (`u.t()`, `u.view(...)`): the replica sees the change."""

    VIEWS = {
        "t": lambda u: u.t(),
        "view": lambda u: u.view(-1, 2, FU // 2),
        "view_index": lambda u: u.view(-1, 2, FU // 2)[:, 0],
    }

    def __init__(self, view):
        super().__init__()
        self.view = self.VIEWS[view]
        self.out = nn.Linear(FU + FC, 1)

    def forward(self, user, cand, cand_to_user):
        u = user[cand_to_user]
        self.view(u).clamp_(-1.0, 1.0)
        return self.out(torch.cat([u, cand], dim=-1))


@pytest.mark.parametrize("view", list(ChangedThroughOtherViews.VIEWS))
def test_in_place_change_through_other_views_is_exact_or_refused(view):
    """Either exact, or the model comes back unchanged with the reason in the report."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = ChangedThroughOtherViews(view).eval()
    module, report = to_ikbo(model, args_for(model, example_to_change(*EXAMPLE, gen)), measure=False)
    if module is model:
        assert "in-place clamp_ through an alias of a user tensor" in str(report), str(report)
    for num_users, num_candidates in SIZES:
        args = args_for(model, request_to_change(num_users, num_candidates, gen))
        with torch.inference_mode():
            assert rel_err(module(*args), model(*args)) <= RTOL, str(report)


class TopKSelection(nn.Module):
    """Each candidate's top items of its user's history by score, taken with take_along_dim and an index that
    broadcasts over the embedding dim (ETA / SIM style)."""

    def __init__(self):
        super().__init__()
        self.query = nn.Linear(FC, D)
        self.net = nn.Linear(D + FC, 1)

    def forward(self, history, cand, cand_to_user):
        keys = history[cand_to_user]  # [B, L, D]
        top = (keys @ self.query(cand).unsqueeze(-1)).squeeze(-1).topk(4, dim=1).indices  # [B, 4]
        chosen = torch.take_along_dim(keys, top.unsqueeze(-1), dim=1)  # [B, 4, D]
        return self.net(torch.cat([chosen.mean(1), cand], dim=1))


def test_take_along_dim_with_a_broadcast_index():
    check(TopKSelection(), must=("select_user_rows",))


class ReorderedMapping(nn.Module):
    """Candidates taken in the order of a pre-score or grouped by user (`cand_to_user[order]`), or capped at the
    example's count (`cand_to_user[:37]`): each is another index than the mapping at other requests."""

    def __init__(self, rows):
        super().__init__()
        self.rows = rows
        self.net = nn.Linear(FU + FC, 1)

    def forward(self, user, cand, cand_to_user):
        if self.rows == "capped":
            rows = slice(None, EXAMPLE[1])
        else:
            rows = torch.argsort(cand[:, 0] if self.rows == "prescore" else cand_to_user, stable=True)
        return self.net(torch.cat([user[cand_to_user[rows]], cand[rows]], dim=1))


@pytest.mark.parametrize("rows", ["prescore", "by_user", "capped"])
def test_mapping_indexed_by_an_order_or_a_cap_is_not_the_mapping(rows):
    # on an example already in that order, or with as many candidates as the cap, it equals the mapping
    def in_order(num_users, num_candidates, gen):
        inputs = request(num_users, num_candidates, gen, sorted_mapping=rows == "by_user")
        inputs["cand"][:, 0] = inputs["cand"][:, 0].sort().values
        return inputs

    gen = torch.Generator().manual_seed(0)
    model = ReorderedMapping(rows).eval()
    module, report = to_ikbo(model, args_for(model, in_order(*EXAMPLE, gen)), measure=False)
    for num_users, num_candidates in SIZES:
        args = args_for(model, request(num_users, num_candidates, gen))
        with torch.inference_mode():
            assert rel_err(module(*args), model(*args)) <= RTOL, str(report)


class Similarity(nn.Module):
    """A two-tower / retrieval-style head: similarities and distances between a candidate vector and replicated
    user vectors or history rows (`F.cosine_similarity`, its module, `F.pairwise_distance`, `torch.cdist` in its
    matrix-product and difference forms, norms of a join)."""

    SPELLINGS = {
        "cosine": lambda s, u, h, c, m: F.cosine_similarity(u[m], c, dim=-1)[:, None],
        "cosine_module": lambda s, u, h, c, m: s.cosine(c, u[m])[:, None],
        "cosine_history_max": lambda s, u, h, c, m: F.cosine_similarity(h[m], c[:, None], dim=-1).amax(
            -1, keepdim=True
        ),
        "pairwise_distance": lambda s, u, h, c, m: F.pairwise_distance(c, u[m], p=1.0, keepdim=True),
        "cdist_matrix_product": lambda s, u, h, c, m: torch.cdist(c[:, None], h[m]).squeeze(1).amin(-1, keepdim=True),
        "cdist_one_row": lambda s, u, h, c, m: torch.cdist(h[m][:, :7], c[:, None], p=3).squeeze(-1),
        "norm_of_difference": lambda s, u, h, c, m: torch.norm(c - u[m], 2, -1, True),
        "vector_norm": lambda s, u, h, c, m: torch.linalg.vector_norm(c * u[m], dim=1, keepdim=True),
    }

    def __init__(self, spell):
        super().__init__()
        self.spell = self.SPELLINGS[spell]
        self.user, self.cand, self.history = nn.Linear(FU, D), nn.Linear(FC, D), nn.Linear(D, D)
        self.cosine = nn.CosineSimilarity()
        self.out = nn.Linear(FC + 1 if spell != "cdist_one_row" else FC + 7, 1)

    def forward(self, user, history, cand, cand_to_user):
        sim = self.spell(self, self.user(user), self.history(history), self.cand(cand), cand_to_user)
        return self.out(torch.cat([sim, cand], dim=1))


@pytest.mark.parametrize("spell", list(Similarity.SPELLINGS))
def test_similarities_and_distances_join_user_rows(spell):
    check(Similarity(spell))


class ShapedLike(nn.Module):
    """Shapes taken from a replicated tensor (`expand_as(u[m])`, `expand(u[m].shape)`) and a squeeze of one dim over
    a concat of user and candidate parts."""

    SPELLINGS = {
        "candidate_expand_as": lambda s, u, c, m: torch.cat([u[m], c.expand_as(u[m])], -1),
        "candidate_expand_to_shape": lambda s, u, c, m: torch.cat([u[m], c.expand(u[m].shape)], -1),
        "parameter_expand_as": lambda s, u, c, m: torch.cat([u[m], s.bias[None].expand_as(u[m]) * c], -1),
        "squeeze_over_concat": lambda s, u, c, m: torch.cat([u[m][:, None], c[:, None]], -1).squeeze(1),
        "squeeze_dims_over_concat": lambda s, u, c, m: torch.cat([u[m][:, None], c[:, None]], -1).squeeze((1,)),
        "new_dims_over_concat": lambda s, u, c, m: torch.cat([u[m], c], -1)[:, None, ..., None].flatten(1),
    }

    def __init__(self, spell):
        super().__init__()
        self.spell = self.SPELLINGS[spell]
        self.user, self.cand = nn.Linear(FU, D), nn.Linear(FC, D)
        self.bias = nn.Parameter(torch.randn(D))
        self.out = nn.Sequential(nn.Linear(2 * D, D), nn.ReLU(), nn.Linear(D, 1))

    def forward(self, user, cand, cand_to_user):
        return self.out(self.spell(self, self.user(user), self.cand(cand), cand_to_user))


@pytest.mark.parametrize("spell", list(ShapedLike.SPELLINGS))
def test_shapes_of_replicas_and_squeezed_concats(spell):
    check(ShapedLike(spell))


class SizesOfAConcat(nn.Module):
    """Sizes read from a concat of user and candidate tokens (`seq.size(1)`, `seq.size(-1)`) and the candidate count
    as `len(cand_to_user)`: sizes, not replications."""

    def __init__(self):
        super().__init__()
        self.history, self.cand = nn.Linear(D, D), nn.Linear(FC, D)

    def forward(self, history, cand, cand_to_user):
        seq = torch.cat([self.history(history)[cand_to_user], self.cand(cand)[:, None]], 1)
        tokens, width, num_candidates = seq.size(1), seq.size(-1), len(cand_to_user)
        return seq.sum(1) / tokens + torch.ones(num_candidates, width) * tokens


def test_sizes_of_a_concat_and_len_of_the_mapping():
    check(SizesOfAConcat())


class FieldEinsums(nn.Module):
    """Einsums over a feature matrix of user and candidate fields (Wukong / DHEN style): a projection contracting
    the field index, then one keeping it."""

    def __init__(self):
        super().__init__()
        self.user, self.cand = nn.Linear(FU, 3 * D), nn.Linear(FC, 2 * D)
        self.fields = nn.Parameter(torch.randn(5, 4) / 5**0.5)
        self.width = nn.Parameter(torch.randn(D, 8) / D**0.5)
        self.out = nn.Linear(4 * 8 + 5 * 8, 1)

    def forward(self, user, cand, cand_to_user):
        x = torch.cat([self.user(user)[cand_to_user].unflatten(1, (3, D)), self.cand(cand).unflatten(1, (2, D))], 1)
        mixed = torch.einsum("bnd,nr->brd", x, self.fields)  # contracts the field index
        widened = torch.einsum("bnd,de->bne", x, self.width)  # keeps it
        return self.out(torch.cat([torch.einsum("brd,de->bre", mixed, self.width).flatten(1), widened.flatten(1)], 1))


def test_einsums_over_user_and_candidate_fields():
    check(FieldEinsums(), must=("einsum over a concat",))


class EllipsisEinsums(nn.Module):
    """Target attention and a dot product written with einsum's ellipsis (`"...ld,...d->...l"`, an implicit output,
    operands as a list): the same joins as the equations spelled with letters."""

    SPELLINGS = {
        "scores": lambda h, q: torch.einsum("...ld,...d->...l", h, q),
        "list": lambda h, q: torch.einsum("...ld,...d->...l", [h, q]),
        "middle": lambda h, q: torch.einsum("b...d,bd->b...", h, q),
        "implicit": lambda h, q: torch.einsum("...d,...ld", q, h),  # output: the ellipsis, then l
    }

    def __init__(self, spell):
        super().__init__()
        self.scores = self.SPELLINGS[spell]
        self.query, self.user = nn.Linear(FC, D), nn.Linear(FU, D)
        self.out = nn.Linear(2 * D, 1)

    def forward(self, user, history, cand, cand_to_user):
        h, q = history[cand_to_user], self.query(cand)
        weights = torch.softmax(self.scores(h, q), -1)
        pooled = torch.einsum("...l,...ld->...d", weights, h)
        return self.out(torch.cat([pooled, torch.einsum("...d,...d->...", self.user(user)[cand_to_user], q)[:, None]
                                   * q], -1))  # fmt: skip


@pytest.mark.parametrize("spell", list(EllipsisEinsums.SPELLINGS))
def test_einsums_with_an_ellipsis_join_like_their_lettered_forms(spell):
    check(EllipsisEinsums(spell), sizes=WITHOUT_CANDIDATES, must=("rows_einsum",))


class TriangleOfFields(nn.Module):
    """PNN's inner products / DLRM's interaction over user and candidate fields whose number is read from the
    features (`triu_indices(x.shape[1], x.shape[1], 1)`, `tril_indices`): the index is a constant of those sizes."""

    def __init__(self, spell):
        super().__init__()
        self.spell = spell
        self.out = nn.Linear(1, 1)

    def forward(self, user, cand, cand_to_user):
        x = torch.cat([user[cand_to_user].view(len(cand_to_user), -1, 2), cand[:, :8].view(-1, 4, 2)], 1)  # 3 + 4
        inner = torch.bmm(x, x.transpose(1, 2))
        n = x.shape[1]
        if self.spell == "triu":
            i, j = torch.triu_indices(n, n, 1)
        else:
            i, j = torch.tril_indices(x.size(1), x.size(1), offset=-1, device=x.device)
        return self.out(inner[:, i, j].sum(-1, keepdim=True)) * inner[:, i, j]


@pytest.mark.parametrize("spell", ["triu", "tril"])
def test_triangle_index_built_from_the_number_of_fields(spell):
    model = TriangleOfFields(spell).eval()
    check(model, sizes=WITHOUT_CANDIDATES, must=("rows_matmul",))
    gen = torch.Generator().manual_seed(4)
    module, _ = to_ikbo(model, args_for(model, request(*EXAMPLE, gen)), measure=False)
    args = args_for(model, request(4, 30, gen))
    wider = (torch.randn(4, 8, generator=gen), *args[1:])  # four user fields, not three: another triangle
    with torch.inference_mode():
        assert rel_err(module(*wider), model(*wider)) <= RTOL


class BilinearPairs(nn.Module):
    """`nn.Bilinear` between user and candidate vectors (either side first) and between two user fields (FiBiNET's
    bilinear interaction; a user × candidate bilinear score), `F.bilinear` without a bias."""

    def __init__(self):
        super().__init__()
        self.user_first, self.cand_first = nn.Bilinear(FU, FC, 4), nn.Bilinear(FC, FU, 3, bias=False)
        self.fields = nn.Parameter(torch.randn(2, 3, 3) / 3)
        self.out = nn.Linear(4 + 3 + 2, 1)

    def forward(self, user, cand, cand_to_user):
        u = user[cand_to_user]
        pair = F.bilinear(u[:, :3], u[:, 3:], self.fields)  # user × user: at U rows
        return self.out(torch.cat([self.user_first(u, cand), self.cand_first(cand, u), pair], -1))


def test_bilinear_of_user_and_candidate_rows_joins():
    check(BilinearPairs(), sizes=WITHOUT_CANDIDATES, must=("rows_matmul",))


class NormedFields(nn.Module):
    """BatchNorm (eval, trained statistics) over a stack of user and candidate fields: channels on the fields (the
    concat dim) or on the embedding; then a weighted bag of history ids with per-position weights."""

    def __init__(self, channels):
        super().__init__()
        self.channels = channels
        self.user, self.cand = nn.Linear(FU, D), nn.Linear(FC, D)
        self.norm = nn.BatchNorm1d(2 if channels == "fields" else D)
        self.norm.running_mean.normal_(), self.norm.running_var.uniform_(0.5, 2), self.norm.weight.data.normal_()
        self.bag = nn.EmbeddingBag(50, D, mode="sum")
        self.position = nn.Parameter(torch.rand(L))
        self.out = nn.Linear(3 * D, 1)

    def forward(self, user, ids, cand, cand_to_user):
        fields = torch.stack([self.user(user)[cand_to_user], self.cand(cand)], 1)  # [B, 2, D]
        normed = self.norm(fields) if self.channels == "fields" else self.norm(fields.transpose(1, 2)).transpose(1, 2)
        bag = self.bag(ids[cand_to_user], per_sample_weights=self.position.expand(len(cand_to_user), L))
        return self.out(torch.cat([normed.flatten(1), bag], 1))


@pytest.mark.parametrize("channels", ["fields", "embedding"])
def test_batch_norm_over_fields_and_weighted_bags(channels):
    check(NormedFields(channels))


class RowNorm(nn.Module):
    """A norm over the rows (dim 0) of a replicated tensor, its dim given after p: not row-wise, kept exact."""

    def forward(self, user, cand, cand_to_user):
        return cand * user[cand_to_user].norm(2, 0).sum() + torch.linalg.vector_norm(user[cand_to_user], 2, 0).sum()


def test_norm_over_rows_is_not_row_wise():
    check(RowNorm(), expect_left=2)


class ConcatStatistics(nn.Module):
    """A per-row statistic or normalization over cat(user[m], cand) along the features (a field matrix for the
    two-dim forms), read by something other than a linear: the rows' sums and sums of squares join per candidate."""

    FORMS = {
        "var": lambda x: x.var(-1, keepdim=True),
        "var_biased": lambda x: torch.var(x, dim=-1, unbiased=False)[:, None],
        "var_correction": lambda x: x.var(dim=1, correction=0.5, keepdim=True),
        "std": lambda x: x.std(-1)[:, None],
        "std_positional": lambda x: torch.std(x, 1, False, True),
        "mean": lambda x: x.mean(-1, keepdim=True),
        "normalize": lambda x: F.normalize(x, dim=-1),
        "normalize_p1": lambda x: F.normalize(x, p=1, dim=1),
        "norm": lambda x: x.norm(dim=-1, keepdim=True),
        "norm_p3": lambda x: torch.norm(x, p=3, dim=-1, keepdim=True),
        "norm_inf": lambda x: torch.linalg.vector_norm(x, float("inf"), dim=-1)[:, None],
        "layer_norm": lambda x: torch.relu(F.layer_norm(x, x.shape[-1:])),
        "rms_norm": lambda x: torch.tanh(F.rms_norm(x, (FU + FC,))),
        "fields_var": lambda x: x.var((1, 2))[:, None],
        "fields_std_one_field_dim": lambda x: x.std(1),  # over the fields only
        "fields_layer_norm": lambda x: F.layer_norm(x, (5, 3)).flatten(1),
        "amax": lambda x: x.amax(-1, keepdim=True),
        "amin": lambda x: torch.amin(x, dim=1)[:, None],
        "logsumexp": lambda x: torch.logsumexp(x, -1, keepdim=True),
        "max_values": lambda x: x.max(dim=-1).values[:, None],  # its indices never read
        "min_values": lambda x: torch.min(x, 1, True)[0],
        "fields_amax": lambda x: x.amax((1, 2))[:, None],
        "fields_logsumexp": lambda x: x.logsumexp(1),  # over the fields only
    }

    def __init__(self, form):
        super().__init__()
        self.form, self.stat = form, self.FORMS.get(form)
        self.norm = nn.LayerNorm(FU + FC)
        nn.init.normal_(self.norm.weight), nn.init.normal_(self.norm.bias)

    def forward(self, user, cand, cand_to_user):
        if self.form.startswith("fields"):  # [B, 5, 3]: two user fields and three candidate fields
            x = torch.cat([user[cand_to_user].view(-1, 2, 3), cand.view(-1, 3, 3)], 1)
        else:
            x = torch.cat([cand[:, :4], user[cand_to_user], cand[:, 4:]], -1)  # user columns in the middle
        if self.form == "layer_norm_module":
            return x + torch.relu(self.norm(x))  # a residual: not a linear
        return self.stat(x) * cand[:, :1]


def request_with_nan(num_users, num_candidates, gen):
    """A request whose last user holds a NaN (a user without candidates, or one with them: the outputs NaN there)."""
    inputs = request(num_users, num_candidates, gen)
    inputs["user"][-1, 2] = float("nan")
    return inputs


@pytest.mark.parametrize("form", [*ConcatStatistics.FORMS, "layer_norm_module"])
def test_statistics_over_a_user_and_candidate_concat(form):
    model = ConcatStatistics(form).eval()
    check(model, sizes=WITHOUT_CANDIDATES, must=("joined per candidate",) if form != "mean" else ())
    gen = torch.Generator().manual_seed(1)
    module, _ = to_ikbo(model, args_for(model, request(*EXAMPLE, gen)), measure=False)
    for num_users, num_candidates in [(4, 30), (30, 4)]:
        args = args_for(model, request_with_nan(num_users, num_candidates, gen))
        with torch.inference_mode():
            want, got = model(*args), module(*args)
        assert torch.equal(want.isnan(), got.isnan())
        keep = ~want.isnan()
        assert rel_err(got[keep], want[keep]) <= RTOL
    with torch.inference_mode():  # B = 0
        args = args_for(model, request(3, 0, gen))
        assert module(*args).shape == model(*args).shape


class FieldReductions(nn.Module):
    """Reductions of a field concat [B, fields, d] along the embedding dim, neither the rows nor the concat dim, that
    return values and indices (FiBiNET's SENET squeeze by `max(dim=-1)`, top-k / sort / median per field), and
    `*_like` factories of a concat (EulerNet's `atan2(x, ones_like(x))`): per part, the user fields at U rows."""

    FORMS = {
        "max": lambda x: x.max(dim=-1).values + x.max(-1)[1].float(),
        "min_keepdim": lambda x: torch.min(x, 2, True).values.squeeze(-1),
        "topk": lambda x: x.topk(2, dim=-1).values.sum(-1) + x.topk(2, dim=-1).indices.sum(-1),
        "sort": lambda x: x.sort(-1, descending=True)[0][..., 0],
        "median": lambda x: x.median(-1).values,
        "cummax": lambda x: x.cummax(2).values.sum(-1),
        "ones_like": lambda x: torch.atan2(x, torch.ones_like(x)).sum(-1),
        "full_like": lambda x: torch.maximum(x, torch.full_like(x, 0.5)).sum(-1),
    }

    def __init__(self, form):
        super().__init__()
        self.reduce = self.FORMS[form]
        self.out = nn.Linear(5, 1)

    def forward(self, user, cand, cand_to_user):
        x = torch.cat([user[cand_to_user].view(-1, 2, 3), cand.view(-1, 3, 3)], 1)  # [B, 5, 3]
        z = self.reduce(x)  # [B, 5]
        return self.out(torch.sigmoid(z)) * x.flatten(1)


@pytest.mark.parametrize("form", list(FieldReductions.FORMS))
def test_reductions_along_a_field_concat_run_per_part(form):
    check(FieldReductions(form), sizes=WITHOUT_CANDIDATES)


class RowReductions(nn.Module):
    """A reduction over the candidate rows of a replica (a request-level pooling of the users' features, weighted by
    how many candidates each has), also of a user + candidate concat, beside the candidates."""

    FORMS = {
        "sum": lambda x: x.sum(0),
        "sum_keepdim": lambda x: torch.sum(x, dim=0, keepdim=True),
        "sum_all": lambda x: x.sum().expand(FU),
        "mean": lambda x: x.mean(0),
        "mean_dims": lambda x: x.view(-1, 2, 3).mean((0, 2)).repeat(3),
        "nansum": lambda x: x.nansum(0),
        "amax": lambda x: x.amax(0),
        "amin": lambda x: torch.amin(x, 0),
        "max_all": lambda x: x.max().expand(FU),
        "logsumexp": lambda x: torch.logsumexp(x, 0),
        "concat_sum": "cat",
    }

    def __init__(self, form):
        super().__init__()
        self.form, self.reduce = form, self.FORMS[form]
        self.out = nn.Linear(FU + FC, 1)

    def forward(self, user, cand, cand_to_user):
        replica = user[cand_to_user]
        if self.form == "concat_sum":
            pooled = torch.cat([replica, cand], 1).sum(0)  # [FU + FC]
            return self.out(cand.repeat(1, 2)[:, : FU + FC] * pooled)
        pooled = self.reduce(replica)  # [FU] (or [1, FU])
        return self.out(torch.cat([replica * pooled, cand], 1))


@pytest.mark.parametrize("form", list(RowReductions.FORMS))
def test_reductions_over_the_rows_of_a_replica(form):
    model = RowReductions(form).eval()
    check(model, sizes=WITHOUT_CANDIDATES, must=("reduce_rows",))
    gen = torch.Generator().manual_seed(2)
    module, _ = to_ikbo(model, args_for(model, request(*EXAMPLE, gen)), measure=False)
    for num_users, num_candidates in [(4, 30), (30, 4)]:  # a NaN in the last user: read only where it has candidates
        args = args_for(model, request_with_nan(num_users, num_candidates, gen))
        present = bool((args[-1] == num_users - 1).any())
        with torch.inference_mode():
            want, got = model(*args), module(*args)
        assert torch.equal(want.isnan(), got.isnan()) and (present or not want.isnan().any())
        keep = ~want.isnan()
        assert rel_err(got[keep], want[keep]) <= RTOL


class ConvolvedHistory(nn.Module):
    """Caser style: horizontal and vertical convolutions over the user's history as an image, max-pooled."""

    def __init__(self):
        super().__init__()
        self.horizontal = nn.Conv2d(1, 4, (3, D))
        self.vertical = nn.Conv2d(1, 2, (L, 1))
        self.net = nn.Linear(4 + 2 * D + FC, 1)

    def forward(self, history, cand, cand_to_user):
        image = history[cand_to_user].unsqueeze(1)  # [B, 1, L, D]
        h = F.max_pool1d(F.relu(self.horizontal(image)).squeeze(3), L - 2).squeeze(2)  # [B, 4]
        v = self.vertical(image).flatten(1)  # [B, 2·D]
        return self.net(torch.cat([h, v, cand], dim=1))


def test_convolutions_and_pooling_run_at_user_rows():
    check(ConvolvedHistory(), must=("row-wise ops run at U rows",))


class SequenceFirst(nn.Module):
    """A replication along dim 1 of a sequence-first history ([L, U, D] → [L, B, D]) by a pair of broadcast indices,
    which the pass does not recognise: the report says so instead of claiming nothing is left."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(D + FC, 1)

    def forward(self, history, cand, cand_to_user):
        seq = history.transpose(0, 1)[torch.arange(L)[:, None], cand_to_user]  # [L, B, D]
        return self.net(torch.cat([seq.mean(0), cand], dim=1))


def test_unrecognised_replication_is_reported():
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = SequenceFirst().eval()
    _, report = to_ikbo(model, args_for(model, request(*EXAMPLE, gen)), measure=False)
    assert report.replications_left >= 1, str(report)
    assert "does not recognise" in str(report) and "aten.index.Tensor" in str(report), str(report)


# U:B for sequence-first replications: ragged, users without candidates (11:5), U = B, one candidate
SEQUENCE_SIZES = [*SIZES, (11, 5), (6, 6), (4, 1)]


class SequenceFirstGRU(nn.Module):
    """GRU4Rec style: the history's item embeddings laid out sequence-first at U rows (`emb(ids).transpose(0, 1)`),
    replicated along dim 1 (`h[:, m]`), an nn.GRU (batch_first=False) over them; its final state joins the candidate
    in an MLP, its outputs (back to batch-first) are scored against the candidate elementwise."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, D)
        self.gru = nn.GRU(D, D)
        self.cand = nn.Linear(FC, D)
        self.mlp = nn.Sequential(nn.Linear(3 * D, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, ids, cand, cand_to_user):
        h = self.emb(ids).transpose(0, 1)  # [L, U, D]
        states, final = self.gru(h[:, cand_to_user])  # [L, B, D], [1, B, D]
        target = self.cand(cand)  # [B, D]
        scored = (states.transpose(0, 1) * target.unsqueeze(1)).mean(1)  # [B, D]
        return self.mlp(torch.cat([final[-1], scored, target], dim=-1))


def test_sequence_first_replication_into_a_gru():
    check(SequenceFirstGRU(), sizes=SEQUENCE_SIZES, row_dims=(0, 1),
          must=("x[:, cand_to_user] (sequence-first)", "GRU", "linear_rows"))  # fmt: skip


class SequenceFirstMHA(nn.Module):
    """Target attention with nn.MultiheadAttention (batch_first=False): the candidate's query [1, B, D], K/V the
    sequence-first history replicated along dim 1 (`hist[:, m]`), a key padding mask from `lengths[m]`."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(FC, D)
        self.mha = nn.MultiheadAttention(D, H, dropout=0.1)
        self.out = nn.Linear(D + FC, 1)

    def forward(self, history, lengths, cand, cand_to_user):
        hist = history.transpose(0, 1)  # [L, U, D]
        kv = hist[:, cand_to_user]  # [L, B, D]
        padding = torch.arange(L)[None, :] >= lengths[cand_to_user][:, None]  # [B, L]
        out, _ = self.mha(self.q(cand).unsqueeze(0), kv, kv, key_padding_mask=padding)  # [1, B, D]
        return self.out(torch.cat([out[0], cand], dim=-1))


def test_sequence_first_replication_into_multihead_attention():
    check(SequenceFirstMHA(), sizes=SEQUENCE_SIZES, row_dims=(0, 1),
          must=("x[:, cand_to_user] (sequence-first)", "ikbo_attention"))  # fmt: skip


class SequenceFirstSelect(nn.Module):
    """A sequence-first history replicated along dim 1 in another spelling, then batch-first again and pooled against
    the candidate elementwise."""

    SPELLINGS = {
        "method": lambda x, m: x.index_select(1, m),
        "function": lambda x, m: torch.index_select(x, 1, m),
        "negative_dim": lambda x, m: x.index_select(-2, m),
        "index_rest": lambda x, m: x[:, m, :],
        "index_ellipsis": lambda x, m: x[..., m, :],
    }

    def __init__(self, spell):
        super().__init__()
        self.spell = self.SPELLINGS[spell]
        self.q = nn.Linear(FC, D)
        self.out = nn.Linear(D + FC, 1)

    def forward(self, history, cand, cand_to_user):
        seq = self.spell(history.transpose(0, 1), cand_to_user)  # [L, B, D]
        pooled = (seq.transpose(0, 1) * self.q(cand).unsqueeze(1)).sum(1)  # [B, D]
        return self.out(torch.cat([pooled, cand], dim=-1))


@pytest.mark.parametrize("spell", list(SequenceFirstSelect.SPELLINGS))
def test_sequence_first_replication_spellings(spell):
    how = "index_select(1, cand_to_user)" if "index_" not in spell else "x[:, cand_to_user]"
    check(SequenceFirstSelect(spell), sizes=SEQUENCE_SIZES, row_dims=(0, 1), must=(how, "rows_join"))


class SequenceFirstElementwise(nn.Module):
    """GRU4Rec-style outputs kept sequence-first ([L, B, D], rows on dim 1) and scored against the candidate
    elementwise without a transpose back: products and activations with the candidate broadcast as `c[None]` or as
    [B, D] (aligned from the right), a softmax over time, then pooled over time."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, D)
        self.gru = nn.GRU(D, D)
        self.cand = nn.Linear(FC, D)
        self.out = nn.Linear(2 * D + FC, 1)

    def forward(self, ids, cand, cand_to_user):
        states, final = self.gru(self.emb(ids).transpose(0, 1)[:, cand_to_user])  # [L, B, D]
        target = self.cand(cand)  # [B, D]
        states = torch.tanh(states) * 2
        weights = torch.softmax((states * target[None]).sum(-1), dim=0)  # [L, B]
        pooled = (weights[..., None] * states).sum(0)  # [B, D]
        gated = (torch.sigmoid(states + target) * states).mean(0)  # [B, D] broadcast from the right
        return self.out(torch.cat([pooled, gated * final[-1], cand], dim=-1))


def test_elementwise_ops_of_sequence_first_replicas():
    check(SequenceFirstElementwise(), sizes=SEQUENCE_SIZES, row_dims=(0, 1), must=("GRU", "rows_join"))


class SequenceFirstRowwise(nn.Module):
    """A bidirectional LSTM (batch_first=False) over a history replicated along dim 1, its outputs [L, B, 2D] read
    sequence-first by ops that act on each candidate's column apart: a linear, a layer norm, a softmax over features,
    a cumulative sum over time, reductions over time (keepdim or not) and over features, the final states summed over
    directions ([2, B, D] → [B, D]); then joined with the candidate."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, D)
        self.lstm = nn.LSTM(D, D, bidirectional=True, batch_first=False)
        self.key = nn.Linear(2 * D, D)
        self.norm = nn.LayerNorm(D)
        self.cand = nn.Linear(FC, D)
        self.out = nn.Linear(3 * D + 2, 1)

    def forward(self, ids, cand, cand_to_user):
        states, (h, _) = self.lstm(self.emb(ids)[cand_to_user].transpose(0, 1))  # [L, B, 2D], [2, B, D]
        keys = self.norm(self.key(states))  # [L, B, D]
        soft = torch.softmax(keys, dim=-1)
        running = torch.cumprod(torch.sigmoid(keys), 0) + keys.cumsum(dim=0)
        target = self.cand(cand)
        weights = torch.softmax((keys * target[None]).sum(-1), dim=0)  # [L, B]: a join, over time
        pooled = (weights[..., None] * running).sum(0)
        peak = soft.amax(dim=(0, 2), keepdim=False)[:, None]  # [B, 1]
        level = torch.mean(keys, 0, keepdim=True).norm(2, -1).squeeze(0)[:, None]  # [B, 1]
        return self.out(torch.cat([pooled, h.sum(0) * target, target, peak, level], dim=-1))


def test_sequence_first_rowwise_ops():
    """Each op commutes with picking rows on dim 1, so it runs at U rows; nothing is replicated."""
    report = check(SequenceFirstRowwise(), sizes=SEQUENCE_SIZES, row_dims=(0, 1), must=("LSTM",))
    assert "sequence-first" not in "\n".join(report.left), str(report)


class SequenceFirstReadout(nn.Module):
    """An LSTM (batch_first=False) over a replicated history, read sequence-first: at each candidate's last position
    (`out[lengths[m] - 1, torch.arange(out.size(1))]`), its spread over time (`std(0)`, `var(dim=0, correction=0)`),
    its per-position means transposed (`.T`: [L, B] → [B, L]); a Caser-style max pool with its indices over the
    batch-first replica (`F.max_pool1d(..., return_indices=True)`)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, D)
        self.lstm = nn.LSTM(D, D)
        self.cand = nn.Linear(FC, D)
        self.out = nn.Linear(3 * D + L + 4, 1)

    def forward(self, ids, lengths, cand, cand_to_user):
        seq = self.emb(ids)[cand_to_user]  # [B, L, D]
        out, _ = self.lstm(seq.transpose(0, 1))  # [L, B, D]
        last = out[lengths[cand_to_user] - 1, torch.arange(out.size(1))]
        spread = out.std(0) + out.var(dim=0, correction=0)
        pooled, where = F.max_pool1d(seq.transpose(1, 2)[:, :4], L // 3, return_indices=True)  # [B, 4, 3]
        target = self.cand(cand)
        feats = [last * target, spread, target, out.mean(-1).T, pooled[..., 0] + where[..., -1]]
        return self.out(torch.cat(feats, dim=-1))


def test_sequence_first_readouts_and_pools_with_indices():
    check(SequenceFirstReadout(), sizes=SEQUENCE_SIZES, row_dims=(0, 1), must=("LSTM", "readout"))


class FromTheEnd(nn.Module):
    """A tower, a target attention and a GRU over replicated user rows: indexing reads a negative mapping entry −k as
    the k-th user from the end."""

    def __init__(self):
        super().__init__()
        self.user = nn.Linear(FU, D)
        self.cand = nn.Linear(FC, D)
        self.gru = nn.GRU(D, D, batch_first=True)

    def forward(self, user, history, cand, cand_to_user):
        target = self.cand(cand)
        h = history[cand_to_user]
        weights = torch.softmax((h @ target[:, :, None]).squeeze(-1), -1)
        pooled = (weights[..., None] * h).sum(1)
        return self.user(user)[cand_to_user] * target + pooled + self.gru(h)[1][0]


def test_mapping_counting_rows_from_the_end():
    """A call whose mapping has negative entries (rows from the end, as the original's indexing reads them) gives the
    original's outputs (it runs the original), not an error of the joins."""
    model = FromTheEnd().eval()
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    module, report = to_ikbo(model, args_for(model, request(*EXAMPLE, gen)), measure=False)
    assert report.replications_left == 0, str(report)
    for num_users, num_candidates in WITHOUT_CANDIDATES:
        inputs = request(num_users, num_candidates, gen)
        m = inputs["cand_to_user"]
        inputs["cand_to_user"] = torch.where(torch.rand(len(m), generator=gen) < 0.5, m - num_users, m)
        args = args_for(model, inputs)
        with torch.inference_mode():
            assert rel_err(module(*args), model(*args)) <= RTOL


class TimeDecayScans(nn.Module):
    """Survival-style decay weights over a replicated history by the functions `torch.cumprod` / `torch.cumsum`
    (not the methods), pooled against the candidate."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(D, 1)
        self.cand = nn.Linear(FC, D)

    def forward(self, history, cand, cand_to_user):
        h = history[cand_to_user]  # [B, L, D]
        keep = torch.cumprod(torch.sigmoid(self.gate(h)), dim=1)  # [B, L, 1]
        total = torch.cumsum(h, 1)[:, -1]
        return ((keep * h).sum(1) + total) * self.cand(cand)


def test_scan_functions_run_at_u_rows():
    check(TimeDecayScans())


class LastPositionReadout(nn.Module):
    """NARM / GRU4Rec style: a GRU over the replicated history, its output read at each candidate's last position
    (`out[torch.arange(out.size(0)), lengths[m] - 1]`) or at a per-candidate position (`out[arange(B), pos]`,
    with B from the candidates), then an attention of the outputs against that state."""

    def __init__(self, per_candidate=False):
        super().__init__()
        self.per_candidate = per_candidate
        self.gru = nn.GRU(D, D, batch_first=True)
        self.a1, self.a2 = nn.Linear(D, D, bias=False), nn.Linear(D, D, bias=False)
        self.v = nn.Linear(D, 1, bias=False)
        self.cand = nn.Linear(FC, D)

    def forward(self, history, lengths, cand, cand_to_user):
        out, _ = self.gru(history[cand_to_user])  # [B, L, D]
        if self.per_candidate:
            pos = (cand[:, 0].abs() * 7).long() % L - 1  # [B], negative positions too
            last = out[torch.arange(cand.shape[0]), pos, :]
        else:
            last = out[torch.arange(out.size(0)), lengths[cand_to_user] - 1]
        alpha = self.v(torch.sigmoid(self.a1(out) + self.a2(last).unsqueeze(1)))
        return torch.cat([(alpha * out).sum(1), last], 1) * self.cand(cand).repeat(1, 2)


@pytest.mark.parametrize("per_candidate", [False, True])
def test_readout_at_positions(per_candidate):
    report = check(LastPositionReadout(per_candidate), sizes=WITHOUT_CANDIDATES)
    assert ("at (m, j)" in str(report)) == per_candidate, str(report)


def test_readout_out_of_range_only_where_read():
    """An index out of range for a user without candidates is never read (no error, as in the original); for a user
    with candidates it raises IndexError, as the original does."""
    model = LastPositionReadout().eval()
    gen = torch.Generator().manual_seed(3)
    module, report = to_ikbo(model, args_for(model, request(*EXAMPLE, gen)), measure=False)
    assert report.replications_left == 0, str(report)
    inputs = request(6, 40, gen)
    inputs["cand_to_user"] = torch.randint(0, 5, (40,), generator=gen)  # user 5 has no candidates
    inputs["lengths"][5] = L + 3
    args = args_for(model, inputs)
    with torch.inference_mode():  # (with grad on the module runs the original)
        assert rel_err(module(*args), model(*args)) <= RTOL
        inputs["lengths"][int(inputs["cand_to_user"][0])] = L + 3
        for m in (model, module):
            with pytest.raises(IndexError):
                m(*args_for(model, inputs))
    # a per-candidate position: read from the flattened user rows; out of range raises, as x[m][arange(B), j] does
    x, m = torch.randn(6, L, D, generator=gen), inputs["cand_to_user"]
    for j in (torch.randint(-L, L, (40,), generator=gen), torch.zeros(0, dtype=torch.long)):
        rows = m[: len(j)]
        assert torch.equal(ops.readout_at(x, rows, j), x[rows][torch.arange(len(j)), j])
    for j in (torch.full((40,), L), torch.full((40,), -L - 1)):
        with pytest.raises(IndexError):
            x[m][torch.arange(40), j]
        with pytest.raises(IndexError):
            ops.readout_at(x, m, j)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("per_candidate", [False, True])
def test_cuda_readouts_read_no_values_on_the_host(per_candidate):
    """On a GPU a rewrite made for CUDA graphs (the readouts, Guarded's mapping check) syncs with the device nowhere
    (`set_sync_debug_mode("error")` raises on any sync) and matches the original."""
    model = LastPositionReadout(per_candidate).eval().cuda()
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    cuda = lambda inputs: {k: v.cuda() for k, v in inputs.items()}  # noqa: E731
    module, report = to_ikbo(model, args_for(model, cuda(request(*EXAMPLE, gen))), measure=False, cuda_graphs=True)
    assert report.replications_left == 0, str(report)
    args = args_for(model, cuda(request(7, 53, gen)))
    with torch.inference_mode():
        module(*args)  # the first call may compile or allocate
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = module(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert rel_err(got, model(*args)) <= RTOL, str(report)


class Interleaved(nn.Module):
    """Candidates sorted by user, the user rows repeated by count (repeat_interleave)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(FU + FC, 3)

    def forward(self, user, cand, cand_to_user):
        counts = torch.bincount(cand_to_user, minlength=user.shape[0])
        return self.net(torch.cat([user.repeat_interleave(counts, dim=0), cand], dim=1))


def test_repeat_interleave():
    check(Interleaved(), make=lambda u, b, g: request(u, b, g, sorted_mapping=True), must=("repeat_interleave",))


class PooledHistory(nn.Module):
    """YouTube-DNN style: the user's ids through an EmbeddingBag and the history mean-pooled under its
    mask, then a tower over [user, candidate]."""

    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(50, D, mode="mean")
        self.net = nn.Sequential(nn.Linear(2 * D + FC, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, ids, history, lengths, cand, cand_to_user):
        ids, history, lengths = ids[cand_to_user], history[cand_to_user], lengths[cand_to_user]
        valid = (torch.arange(history.shape[1]) < lengths[:, None]).float()
        pooled = (history * valid.unsqueeze(-1)).sum(1) / valid.sum(1, keepdim=True)
        return self.net(torch.cat([self.bag(ids), pooled, cand], dim=1))


def test_embedding_bag_and_masked_pooling():
    check(PooledHistory(), must=("embedding_bag", "linear_rows"))


class FlatAttention(nn.Module):
    """DIN's attention unit over the pair rows flattened before its MLP (FuxiCTR's `DIN_Attention`:
    `attention_input.view(-1, 4 * d)`, an MLP with BatchNorm1d, `.view(-1, L)`), in the spelling `flatten` picks."""

    FLATTEN = {
        "view": lambda x: x.view(-1, 4 * D),
        "reshape": lambda x: x.reshape(-1, x.size(-1)),
        "flatten": lambda x: torch.flatten(x, 0, 1),
        "flatten_end": lambda x: x.flatten(end_dim=1),
        "view_rows": lambda x: x.view(x.shape[0] * x.shape[1], -1),
        "dropout_after": lambda x: F.dropout(x.contiguous().view(-1, 4 * D), 0.1, False),
    }

    def __init__(self, flatten, heads=False):
        super().__init__()
        self.flatten, self.heads = self.FLATTEN[flatten], heads
        self.att = nn.Sequential(nn.Linear(4 * D, 24), nn.BatchNorm1d(24), nn.ReLU(), nn.Linear(24, 1))
        self.gate = nn.Linear(4 * D, 1)  # a second linear over the same flattened rows (merged with the first)
        self.item = nn.Linear(FC, D)
        self.out = nn.Linear(2 * D, 1)

    def forward(self, history, lengths, cand, cand_to_user):
        keys, lengths = history[cand_to_user], lengths[cand_to_user]
        seq_len = keys.size(1)
        target = self.item(cand)
        query = target.unsqueeze(1).expand(-1, seq_len, -1)
        pairs = self.flatten(torch.cat([query, keys, query - keys, query * keys], dim=-1))
        weight = self.att(pairs)
        if self.heads:
            weight = weight + torch.sigmoid(self.gate(pairs))
        weight = weight.view(-1, seq_len) * (torch.arange(seq_len) < lengths[:, None]).float()
        pooled = (weight.unsqueeze(-1) * keys).sum(dim=1)
        return self.out(torch.cat([target, pooled], dim=-1))


@pytest.mark.parametrize("flatten,heads", [*((f, False) for f in FlatAttention.FLATTEN), ("view", True)])
def test_pair_rows_flattened_before_an_mlp(flatten, heads):
    model = FlatAttention(flatten, heads)
    for bn in model.modules():
        if isinstance(bn, nn.BatchNorm1d):  # eval-mode statistics that are not the identity
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
    check(model, must=("linear_rows",))


class FlatOthers(nn.Module):
    """Pair rows flattened, then read by ops that act across rows or on a replica alone: the rewrite flattens
    them where it must and stays exact."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.proj, self.out, self.alone = nn.Linear(2 * D, 8), nn.Linear(8, 1), nn.Linear(D, 8)
        self.item = nn.Linear(FC, D)

    def forward(self, history, cand, cand_to_user):
        keys = history[cand_to_user]
        query = self.item(cand).unsqueeze(1).expand(-1, keys.size(1), -1)
        if self.kind == "replica_only":  # user rows alone: all of it runs at U rows, replicated as the output
            y = self.out(torch.relu(self.alone(keys.reshape(-1, D))))
        else:
            flat = torch.cat([query, keys], -1).view(-1, 2 * D)
            y = self.out(torch.relu(self.proj(flat)))
        if self.kind == "column_sums":
            y = y + flat.sum(0, keepdim=True)[:, :1]  # a reduction over the pair rows: flattened
        return (y.view(-1, keys.size(1)) * keys[..., 0]).sum(1)


@pytest.mark.parametrize("kind", ["column_sums", "replica_only"])
def test_pair_rows_flattened_then_read_whole(kind):
    report = check(FlatOthers(kind), expect_left=1)
    assert ("has no per-part form" if kind == "column_sums" else "at the output") in str(report)


class FlatMM(nn.Module):
    """generative-recommenders' HSTU projection: the replicated history flattened to rows, `torch.mm` (or `x.mm`) by a
    weight, viewed back, then scored against the candidate."""

    def __init__(self, method):
        super().__init__()
        self.method, self.uvqk = method, nn.Parameter(torch.randn(D, 2 * D) * 0.2)
        self.target = nn.Linear(FC, D)

    def forward(self, history, cand, cand_to_user):
        x = history[cand_to_user]
        flat = x.view(-1, D)
        uv = F.silu(flat.mm(self.uvqk) if self.method else torch.mm(flat, self.uvqk)).view(x.shape[0], L, 2 * D)
        u, v = uv.split(D, dim=-1)
        return ((u * v).sum(1) * self.target(cand)).sum(-1)


@pytest.mark.parametrize("method", [False, True])
def test_mm_by_a_weight_of_flattened_rows(method):
    """The product runs at U·L rows, as `matmul` would, and the view back to [B, L, ·] is the user rows viewed alike."""
    check(FlatMM(method), must=["row-wise ops run at U rows instead of B rows: matmul", "back to B rows"])


class FlatInPlace(nn.Module):
    """In-place ops on flattened pair rows whose storage other values read: a flattened difference or replica that
    a concat copied before, and two linears over flattened rows changed in place between them (not one merged
    GEMM)."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.item, self.l1, self.l2, self.l = (
            nn.Linear(FC, D),
            nn.Linear(4 * D, 8),
            nn.Linear(4 * D, 8),
            nn.Linear(D, 8),
        )

    def forward(self, history, ids, cand, cand_to_user):
        keys = history[cand_to_user]
        q = self.item(cand).unsqueeze(1).expand(-1, keys.size(1), -1)
        pad = (ids[cand_to_user] == 0).view(-1, 1)
        if self.kind == "difference":
            d = q - keys
            c = torch.cat([q, keys, d, q * keys], -1)  # a copy of d, before the change
            flat = d.view(-1, D)
            flat.masked_fill_(pad, 0.0)
            return self.l1(c).sum(1) + flat.view(cand.size(0), -1).sum(1, keepdim=True)
        if self.kind == "replica":
            c = torch.cat([q, keys], -1)
            flat = keys.view(-1, D)
            flat.masked_fill_(pad, 0.0)
            return self.l(flat).view(cand.size(0), -1).sum(1, keepdim=True) + c.cumsum(0).sum((1, 2))[:, None]
        flat = torch.cat([q, keys, q - keys, q * keys], -1).view(-1, 4 * D)
        a = self.l1(flat)
        flat.masked_fill_(pad, 0.0)
        return (a * self.l2(flat)).view(cand.size(0), -1).sum(1, keepdim=True)


@pytest.mark.parametrize("kind", ["difference", "replica", "siblings"])
def test_in_place_ops_on_flattened_rows(kind):
    """The example has no padding, the requests have: the in-place mask must act where the original's does."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = FlatInPlace(kind).eval()
    module, report = to_ikbo(model, args_for(model, request_without_padding(*EXAMPLE, gen)), measure=False)
    for num_users, num_candidates in SIZES:
        args = args_for(model, request(num_users, num_candidates, gen))
        with torch.inference_mode():
            assert rel_err(module(*[a.clone() for a in args]), model(*[a.clone() for a in args])) <= RTOL, str(report)


class ShapeCoincidence(nn.Module):
    """Views whose meaning the example's shapes cannot tell (history length 1, or equal to the feature width):
    the rewrite checks them on each call and runs the original where they mean another view."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.item, self.l1 = nn.Linear(FC, D), nn.Linear(4 * D, 8)

    def forward(self, history, ids, cand, cand_to_user):
        keys = history[cand_to_user]
        q = self.item(cand).unsqueeze(1).expand(-1, keys.size(1), -1)
        if self.kind == "rows_kept":  # [B, 1, d] on the example: the view keeps the rows there only
            return keys.view(keys.size(0), -1).sum(1, keepdim=True) * q[:, 0, :1]
        if self.kind == "width_as_length":  # L == d on the example
            f = keys.reshape(-1, keys.size(1))
            return f[:, :1].view(keys.size(0), -1).sum(1, keepdim=True) * q[:, 0, :1]
        if self.kind == "mask_rows":  # a [B, L] mask viewed as (-1, 1): B rows where L = 1
            mask = (ids[cand_to_user] != 0).view(-1, 1).float()
            y = self.l1(torch.cat([q, keys, q - keys, q * keys], -1).view(-1, 4 * D)) * mask
            return y.reshape(keys.size(0), keys.size(1), -1).sum(1)
        pairs = torch.cat([q, keys, q - keys, q * keys], -1)
        return self.l1(pairs.view(-1, 4 * D)).view(keys.size(0), -1).sum(1, keepdim=True)


@pytest.mark.parametrize(
    "kind,example_length", [("rows_kept", 1), ("width_as_length", D), ("mask_rows", 1), ("flat_mlp", 1)]
)
def test_views_checked_where_the_example_cannot_tell(kind, example_length):
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))

    def make(num_users, num_candidates, length):
        inputs = request(num_users, num_candidates, gen)
        inputs["history"] = torch.randn(num_users, length, D, generator=gen)
        inputs["ids"] = torch.randint(0, 5, (num_users, length), generator=gen)
        return inputs

    model = ShapeCoincidence(kind).eval()
    module, report = to_ikbo(model, args_for(model, make(*EXAMPLE, example_length)), measure=False)
    for (num_users, num_candidates), length in itertools.product(SIZES, [example_length, 3, L]):
        args = args_for(model, make(num_users, num_candidates, length))
        with torch.inference_mode():
            assert rel_err(module(*args), model(*args)) <= RTOL, f"L = {length}\n{report}"


class ReassignedAttribute(nn.Module):
    """RecBole's Dice: a plain tensor attribute reassigned in the forward (`self.alpha = self.alpha.to(x.device)`)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(FU + FC, 8)
        self.alpha = torch.full((8,), 0.3)

    def forward(self, user, cand, cand_to_user):
        score = self.lin(torch.cat([user[cand_to_user], cand], -1))
        self.alpha = self.alpha.to(score.device)
        p = torch.sigmoid(score)
        return self.alpha * (1 - p) * score + p * score


def test_forward_assigning_attributes_leaves_the_model_as_it_was():
    model = ReassignedAttribute().eval()
    alpha = model.alpha
    check(model, must=("linear_rows",))
    assert model.alpha is alpha and type(model.alpha) is torch.Tensor
    assert not [k for k in vars(model) if k.startswith("_tensor_constant")]


class ConstantRows(nn.Module):
    """A key mask from a position row of the model ([1, L]: a buffer, a plain attribute, or made in the forward)
    expanded or repeated to the candidates' rows by a traced size (RecBole's `mask_mat.repeat(B, 1)`, HF-style
    `position_ids.expand(B, -1)`)."""

    SPELLINGS = {
        "buffer_repeat": lambda s, x: s.pos.repeat(x.size(0), 1),
        "buffer_expand": lambda s, x: s.pos.expand(x.size(0), -1),
        "buffer_expand_sizes": lambda s, x: s.pos.expand(x.shape[0], x.shape[1]),
        "buffer_expand_size": lambda s, x: s.pos.expand(x.size()),
        "attribute_expand": lambda s, x: s.pos_attribute.expand(len(x), -1),
        "forward_repeat": lambda s, x: torch.arange(L).view(1, -1).repeat(x.size(0), 1),
        "forward_expand": lambda s, x: torch.arange(L).unsqueeze(0).expand(x.size(0), L),
    }

    def __init__(self, spelling):
        super().__init__()
        self.spell = self.SPELLINGS[spelling]
        self.register_buffer("pos", torch.arange(L).view(1, -1))
        self.pos_attribute = torch.arange(L).view(1, -1)
        self.item, self.out = nn.Linear(FC, D), nn.Linear(D, 1)

    def forward(self, history, lengths, cand, cand_to_user):
        keys, lengths = history[cand_to_user], lengths[cand_to_user]
        scores = (keys * self.item(cand).unsqueeze(1)).sum(-1)  # [B, L]
        scores = scores.masked_fill(self.spell(self, scores) >= lengths.unsqueeze(1), -1e9)
        return self.out((scores.softmax(-1).unsqueeze(-1) * keys).sum(1))


@pytest.mark.parametrize("spelling", list(ConstantRows.SPELLINGS))
def test_constant_rows_expanded_by_a_traced_size(spelling):
    check(ConstantRows(spelling), make=lambda u, b, g: request(u, b, g))


class ConcatIdLookups(nn.Module):
    """RecBole's item → category table read with the history and the target item's ids concatenated
    (`item_cate[cat((item_seq[m], next_items[:, None]), -1)]`), both lookups' embeddings concatenated."""

    LOOKUPS = {
        "index": lambda s, ids: s.item_cate[ids],
        "embedding": lambda s, ids: F.embedding(ids, s.item_cate[:, None]).squeeze(-1),
    }

    def __init__(self, lookup):
        super().__init__()
        self.lookup = self.LOOKUPS[lookup]
        self.register_buffer("item_cate", torch.randint(0, 10, (50,)))
        self.cate, self.item, self.out = nn.Embedding(10, D), nn.Embedding(50, D), nn.Linear(2 * D, 1)

    def forward(self, ids, cand, cand_to_user):
        next_items = (cand[:, 0].abs() * 10).long() % 50
        seq = torch.cat((ids[cand_to_user], next_items[:, None]), -1)  # [B, L + 1]
        x = torch.cat([self.item(seq), self.cate(self.lookup(self, seq))], -1)
        return self.out(x.mean(1))


@pytest.mark.parametrize("lookup", list(ConcatIdLookups.LOOKUPS))
def test_lookups_of_concatenated_ids(lookup):
    check(ConcatIdLookups(lookup), must=("embedding",))


class OneRowOrUsers(nn.Module):
    """`u.repeat(B, 1)` of a user tensor on an example with one user: one row there, U rows at other calls."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(FU + FC, 4)

    def forward(self, user, cand, cand_to_user):
        rows = cand.size(0)
        return self.lin(torch.cat([user.repeat(rows, 1)[:rows], cand], -1)) + cand_to_user[:, None] * 0


def test_one_row_on_the_example_is_checked_on_each_call():
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = OneRowOrUsers().eval()
    module, report = to_ikbo(model, args_for(model, request(1, 37, gen)), measure=False)
    for num_users, num_candidates in [(1, 20), *SIZES]:
        args = args_for(model, request(num_users, num_candidates, gen))
        with torch.inference_mode():
            assert rel_err(module(*args), model(*args)) <= RTOL, str(report)


class WidthsOfFlattenedParts(nn.Module):
    """A concat of [B, F, d] parts along F viewed as [B, F·d], or squeezed where F = 1 on the example: the parts'
    widths on the example (F·d, d) hold at each call or the original runs."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def forward(self, history, cand, cand_to_user):
        c = cand[:, None, : history.size(-1)].expand(-1, history.size(1), -1)
        x = torch.cat([history[cand_to_user], c], 1)
        if self.kind == "view":
            x = x.view(cand.size(0), -1)
            return x[:, 1:3] * torch.arange(2)
        return x.transpose(1, 2).squeeze(2).flatten(1)[:, 1:3] * 1.0


@pytest.mark.parametrize("kind", ["view", "squeeze"])
def test_widths_of_per_part_views_checked_on_each_call(kind):
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))

    def make(num_users, num_candidates, length, width):
        return dict(
            history=torch.randn(num_users, length, width, generator=gen),
            cand=torch.randn(num_candidates, 8, generator=gen),
            cand_to_user=torch.randint(0, num_users, (num_candidates,), generator=gen),
        )

    model = WidthsOfFlattenedParts(kind).eval()
    module, report = to_ikbo(model, args_for(model, make(*EXAMPLE, 1, 4)), measure=False)
    for (num_users, num_candidates), (length, width) in itertools.product(SIZES, [(1, 4), (1, 2), (2, 4), (1, 6)]):
        args = args_for(model, make(num_users, num_candidates, length, width))
        with torch.inference_mode():
            try:
                want = model(*args)
            except RuntimeError:
                continue  # the original itself cannot run these sizes
            assert rel_err(module(*args), want) <= RTOL, f"{length}, {width}\n{report}"


class Stateful(nn.Module):
    """Forwards that keep state: a running value in an attribute, a buffer counted in place, a list of sizes seen,
    a memo filled on the first call, a Python counter, a plain tensor attribute changed in place, a deque."""

    def __init__(self, kind):
        super().__init__()
        self.kind, self.lin = kind, nn.Linear(FU + FC, 1)
        self.prev, self.seen, self.memo, self.count, self.steps = torch.zeros(1), [], {}, 0, torch.zeros(1)
        self.recent = collections.deque(maxlen=4)
        self.register_buffer("calls", torch.zeros(1))

    def forward(self, user, cand, cand_to_user):
        out = self.lin(torch.cat([user[cand_to_user], cand], -1))
        if self.kind == "attribute":
            out, self.prev = out + self.prev, out.mean().detach().view(1)
        elif self.kind == "buffer":
            self.calls += 1
            out = out + self.calls
        elif self.kind == "list":
            self.seen.append(cand.size(0))
        elif self.kind == "counter":
            self.count += 1
            out = out + self.count
        elif self.kind == "tensor":
            self.steps.add_(1)
            out = out * self.steps
        elif self.kind == "deque":
            self.recent.append(out.mean())
        elif "two" not in self.memo:
            self.memo["two"] = torch.full((1,), 2.0)
        return out * self.memo.get("two", 1.0)


@pytest.mark.parametrize("kind", ["attribute", "buffer", "list", "memo", "counter", "tensor", "deque"])
def test_forwards_that_keep_state(kind):
    """Such a model comes back unchanged, with its state as it was before the pass."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = Stateful(kind).eval()
    module, report = to_ikbo(model, args_for(model, request(*EXAMPLE, gen)), measure=False)
    assert module is model and "keeps state" in str(report), str(report)
    assert float(model.calls) == 0 and float(model.prev) == 0 and float(model.steps) == 0 and model.count == 0
    assert model.seen == [] and model.memo == {} and len(model.recent) == 0


def test_a_rewritten_module_passed_again_comes_back_as_it_is():
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = Replicated("index").eval()
    module, _ = to_ikbo(model, args_for(model, request(*EXAMPLE, gen)), measure=False)
    assert module is not model and to_ikbo(module, args_for(model, request(*EXAMPLE, gen)))[0] is module


class CountBranch(nn.Module):
    """A Python branch on how many rows a mask keeps (DeepCTR-Torch's DIEN: `if masked_keys_length.shape[0] == 0:
    return zeros`), in the spellings that count values."""

    COUNTS = {
        "index": lambda x, keep: x[keep].shape[0],
        "len": lambda x, keep: len(x[keep]),
        "masked_select": lambda x, keep: torch.masked_select(x[:, 0], keep).numel(),
        "nonzero": lambda x, keep: torch.nonzero(keep).size(0),
    }

    def __init__(self, count):
        super().__init__()
        self.count, self.lin = self.COUNTS[count], nn.Linear(FU, FC)

    def forward(self, user, cand, cand_to_user):
        x = self.lin(user)[cand_to_user]
        if self.count(x, user[cand_to_user, 0] > 0) == 0:
            return cand.sum(1)
        return (x * cand).sum(1)


@pytest.mark.parametrize("count", list(CountBranch.COUNTS))
def test_branch_on_a_count_of_values_is_not_followed(count):
    """The example has users with user[:, 0] > 0; a call where none has must take the other branch."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = CountBranch(count).eval()
    module, report = to_ikbo(model, args_for(model, request(*EXAMPLE, gen)), measure=False)
    inputs = request(3, 41, gen)
    inputs["user"][:, 0] = -inputs["user"][:, 0].abs()  # no user kept: the original returns cand.sum(1)
    args = args_for(model, inputs)
    with torch.inference_mode():
        assert rel_err(module(*args), model(*args)) <= RTOL, str(report)


class RowKeepingViews(nn.Module):
    """DeepCTR-Torch's `combined_dnn_input`: [B, 1, d] embeddings concatenated, `view(B, -1)`, then `flatten(1)`:
    views that keep the rows, read by a linear."""

    def __init__(self):
        super().__init__()
        self.user, self.item, self.lin = nn.Linear(FU, D), nn.Linear(FC, D), nn.Linear(2 * D, 3)

    def forward(self, user, cand, cand_to_user):
        x = torch.cat([self.user(user)[cand_to_user].unsqueeze(1), self.item(cand).unsqueeze(1)], dim=-1)
        return self.lin(torch.flatten(x.view(x.size(0), -1), start_dim=1))


def test_row_keeping_views_of_a_concat():
    check(RowKeepingViews(), must=("linear_rows",))


class Masked(nn.Module):
    """Candidate queries attend to the user's history; the key mask in one of the spellings models use."""

    MASKS = {
        "arange_no_device": lambda k, n, ids: torch.arange(L) < n[:, None],
        "shape_derived": lambda k, n, ids: torch.arange(k.shape[1], device=k.device)[None, :] < n.unsqueeze(1),
        "negated": lambda k, n, ids: ~(torch.arange(L)[None, :] >= n[:, None]),
        "additive": lambda k, n, ids: torch.zeros(n.shape[0], L).masked_fill(torch.arange(L) >= n[:, None], -math.inf),
        "additive_finite": lambda k, n, ids: (torch.arange(L) >= n[:, None]).float() * -1e9,
        "ids_nonzero": lambda k, n, ids: ids != 0,
        "expanded_to_rows": lambda k, n, ids: torch.arange(k.size(1)).expand(len(n), k.size(1)) < n.unsqueeze(-1),
        "repeated_to_rows": lambda k, n, ids: torch.arange(L).repeat(n.shape[0], 1) < n[:, None],
    }

    def __init__(self, mask, replicate_first=True):
        super().__init__()
        self.mask, self.replicate_first = self.MASKS[mask], replicate_first
        self.q, self.k, self.v = nn.Linear(FC, D), nn.Linear(D, D), nn.Linear(D, D)
        self.out = nn.Linear(D, 1)

    def forward(self, history, lengths, ids, cand, cand_to_user):
        if self.replicate_first:
            history, lengths, ids = history[cand_to_user], lengths[cand_to_user], ids[cand_to_user]
            mask = self.mask(history, lengths, ids)
        else:
            mask = self.mask(history, lengths, ids)[cand_to_user]
            history = history[cand_to_user]
        q = self.q(cand).view(-1, H, 1, D // H)
        k, v = (f(history).unflatten(-1, (H, -1)).transpose(1, 2) for f in (self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
        return self.out(out.flatten(1))


@pytest.mark.parametrize("mask,first", list(itertools.product(Masked.MASKS, [True, False])))
def test_key_mask_spellings(mask, first):
    check(Masked(mask, first), must=("ikbo_attention",))


class MaskedScores(nn.Module):
    """Target attention written out (FuxiCTR's / DeepCTR's / RecBole's): scores, a key mask in one of the fills
    public code uses, softmax, values. Users whose keys are all masked get what the original gives them: the mean of
    the values for a fill that rounds the scores away, NaN for −inf; a call where the scores would not round away
    (−1e4 in fp32) runs the original."""

    FILLS = {
        "masked_fill_1e9": lambda s, keep: s.masked_fill(~keep, -1e9),
        "masked_fill_inf": lambda s, keep: s.masked_fill(keep == 0, float("-inf")),
        "masked_fill_in_place": lambda s, keep: s.masked_fill_(keep.float() == 0, -(2**32) + 1),
        "masked_fill_function": lambda s, keep: torch.masked_fill(s, ~keep, torch.finfo(torch.float32).min),
        "additive_1e9": lambda s, keep: s + (1.0 - keep.float()) * -1e9,
        "additive_inf": lambda s, keep: s + torch.where(keep, 0.0, float("-inf")),
        "bert_1e4": lambda s, keep: s + (1.0 - keep.float()) * -10000.0,
    }

    def __init__(self, fill, heads):
        super().__init__()
        self.fill, self.heads = self.FILLS[fill], heads
        self.q, self.out = nn.Linear(FC, D), nn.Linear(D, 1)

    def forward(self, history, ids, cand, cand_to_user):
        keys, keep = history[cand_to_user], (ids[cand_to_user] != 0).unsqueeze(1)  # [B, L, D], [B, 1, L]
        q = self.q(cand).unsqueeze(1)  # [B, 1, D]
        if self.heads:
            q, k = q.view(-1, 1, H, D // H).transpose(1, 2), keys.view(keys.size(0), -1, H, D // H).transpose(1, 2)
            keep = keep.unsqueeze(1)
        else:
            k = keys
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(k.size(-1))
        scores = self.fill(scores, keep)
        out = torch.matmul(scores.softmax(dim=-1), k)
        return self.out(out.transpose(1, 2).flatten(1) if self.heads else out.squeeze(1))


def request_with_empty_histories(num_users, num_candidates, gen):
    inputs = request(num_users, num_candidates, gen)
    inputs["ids"][0] = 0  # user 0 keeps no key
    return inputs


@pytest.mark.parametrize("fill,heads", [*((f, False) for f in MaskedScores.FILLS), ("masked_fill_1e9", True)])
def test_masked_scores_softmax_values_become_ikbo_attention(fill, heads):
    model = MaskedScores(fill, heads).eval()
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    module, report = to_ikbo(model, args_for(model, request(*EXAMPLE, gen)), measure=False)
    assert "ikbo_attention" in str(report), str(report)
    for num_users, num_candidates in SIZES:
        args = args_for(model, request_with_empty_histories(num_users, num_candidates, gen))
        with torch.inference_mode():
            want, got = model(*args), module(*args)
        assert torch.equal(want.isnan(), got.isnan()), str(report)
        assert rel_err(got.nan_to_num(), want.nan_to_num()) <= RTOL, str(report)


class BiasedScores(nn.Module):
    """Scores plus a per-user term that is no key mask: a boolean (+1 on its True keys) or one value per user
    broadcast over all keys (−1e9 for users with short histories, which evens out their softmax)."""

    def __init__(self, bias):
        super().__init__()
        self.bias, self.q = bias, nn.Linear(FC, D)

    def forward(self, history, lengths, ids, cand, cand_to_user):
        keys = history[cand_to_user]
        scores = self.q(cand)[:, None] @ keys.transpose(1, 2) / 4.0
        if self.bias == "bool":
            scores = scores + (ids[cand_to_user] != 0)[:, None]
        else:
            scores = scores + torch.where(lengths < 4, -1e9, 0.0)[cand_to_user][:, None, None]
        return (scores.softmax(-1) @ keys).squeeze(1)


@pytest.mark.parametrize("bias", ["bool", "per_user"])
def test_biased_scores_are_no_key_mask(bias):
    """A term added to the scores is a key mask only if it is float with one entry per key: a boolean or a value per
    user is computed as written (served: exact on the example too), also where the example's boolean holds no False."""

    def unpadded(num_users, num_candidates, gen):
        inputs = request(num_users, num_candidates, gen)
        inputs["ids"] = inputs["ids"].clamp(min=1)
        inputs["lengths"][0] = 2  # a user whose scores all get −1e9
        return inputs

    check(BiasedScores(bias), example=unpadded)


@pytest.mark.parametrize("fill", [-1e9, float("-inf"), torch.finfo(torch.float32).min, -1e4])
def test_sdpa_additive_masks_of_users_without_history(fill):
    """An additive SDPA mask: a user whose keys are all masked gets the mean of its values (a fill that rounds the
    scores away) or zeros (−inf), as SDPA gives; where the scores would not round away (−1e4 in fp32) such a call
    runs the original."""

    class Additive(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k = nn.Linear(FC, D), nn.Linear(D, D)

        def forward(self, history, ids, cand, cand_to_user):
            keys = self.k(history)[cand_to_user].view(-1, L, H, D // H).transpose(1, 2)
            bias = torch.zeros(ids.shape).masked_fill(ids == 0, fill)[cand_to_user][:, None, None, :]
            q = self.q(cand).view(-1, H, 1, D // H)
            return F.scaled_dot_product_attention(q, keys, keys, attn_mask=bias).flatten(1)

    model = Additive()
    rounds = fill != -1e4  # else calls with such a user run the original (no replication check for them)
    check(model, make=request_with_empty_histories, example=request, row_dims=(0,) if rounds else ())


class TargetMHA(nn.Module):
    """nn.MultiheadAttention target attention with key_padding_mask, sequence-first or batch-first."""

    def __init__(self, batch_first):
        super().__init__()
        self.batch_first = batch_first
        self.q = nn.Linear(FC, D)
        self.mha = nn.MultiheadAttention(D, H, batch_first=batch_first, dropout=0.1)
        self.out = nn.Linear(D, 1)

    def forward(self, history, lengths, cand, cand_to_user):
        kv = history[cand_to_user]
        padding = torch.arange(L)[None, :] >= lengths[cand_to_user].unsqueeze(1)
        q = self.q(cand).unsqueeze(1)
        if not self.batch_first:
            q, kv = q.transpose(0, 1), kv.transpose(0, 1)
        out, _ = self.mha(q, kv, kv, key_padding_mask=padding)
        return self.out(out.squeeze(1 if self.batch_first else 0))


@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_attention_key_padding_mask(batch_first):
    check(TargetMHA(batch_first), must=("ikbo_attention",))


def test_multihead_attention_of_users_without_history():
    """A user with every key padded: the module gives NaN (its weights path), and so does the rewrite."""
    model = TargetMHA(True).eval()
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    module, report = to_ikbo(model, args_for(model, request(*EXAMPLE, gen)), measure=False)
    inputs = request(7, 53, gen)
    inputs["lengths"][0] = 0
    args = args_for(model, inputs)
    with torch.inference_mode():
        want, got = model(*args), module(*args)
    assert want.isnan().any() and torch.equal(want.isnan(), got.isnan()), str(report)
    assert rel_err(got.nan_to_num(), want.nan_to_num()) <= RTOL


class Recurrent(nn.Module):
    """GRU (batch-first) and LSTM (sequence-first, final state) over the user's history, then the target."""

    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(D, D, batch_first=True)
        self.lstm = nn.LSTM(D, D, num_layers=2)
        self.out = nn.Linear(2 * D + FC, 1)

    def forward(self, history, cand, cand_to_user):
        seq = history[cand_to_user]
        states, _ = self.gru(seq)
        _, (h, c) = self.lstm(seq.transpose(0, 1))
        return self.out(torch.cat([states[:, -1], h[-1], cand], dim=-1))


def test_rnns_run_at_user_rows():
    check(Recurrent(), must=("GRU", "LSTM"))


class PackedRecurrent(nn.Module):
    """RNNs over packed histories (pack_padded_sequence by length, as GRU4Rec / DIEN code writes them): a GRU's final
    state (`nn.utils.rnn.pack_padded_sequence`), an LSTM's outputs padded back to L (`pad_packed_sequence` imported by
    name, total_length fixed) and mean-pooled; `fixed` False pads to the longest length instead."""

    def __init__(self, fixed=True):
        super().__init__()
        self.fixed = fixed
        self.gru = nn.GRU(D, D, batch_first=True)
        self.lstm = nn.LSTM(D, D)
        self.out = nn.Linear(2 * D + FC, 1)

    def forward(self, history, lengths, cand, cand_to_user):
        seq, n = history[cand_to_user], lengths[cand_to_user]
        packed = nn.utils.rnn.pack_padded_sequence(seq, n.cpu(), batch_first=True, enforce_sorted=False)
        _, h = self.gru(packed)
        steps, _ = self.lstm(pack_padded_sequence(seq.transpose(0, 1), n.cpu(), enforce_sorted=False))
        padded, _ = pad_packed_sequence(steps, batch_first=True, total_length=L if self.fixed else None)  # [B, T, D]
        pooled = padded.sum(1) / n[:, None]
        return self.out(torch.cat([h[-1], pooled, cand], dim=-1))


def _some_empty_histories(num_users, num_candidates, gen):
    """A request whose users without candidates have empty histories (length 0: no pack would take them)."""
    inputs = request(num_users, num_candidates, gen)
    without = torch.ones(num_users, dtype=torch.bool)
    without[inputs["cand_to_user"]] = False
    inputs["lengths"][without] = 0
    # the U-row pack holds sum(max(length, 1)) tokens: kept apart from B, the row count that tells replicas apart
    if int(inputs["lengths"].clamp(min=1).sum()) == num_candidates:
        user = int(inputs["cand_to_user"][0])
        inputs["lengths"][user] += 1 if inputs["lengths"][user] < L else -1
    return inputs


@pytest.mark.parametrize("fixed", [True, False], ids=["total_length", "longest"])
def test_packed_sequences_run_at_user_rows(fixed):
    """The packs, both RNNs and (with a fixed total_length) the padding run at U rows; padded to the longest length
    (which depends on which users have candidates) the LSTM's output is repacked at B rows, reported."""
    report = check(PackedRecurrent(fixed), make=_some_empty_histories, expect_left=0 if fixed else 1,
                   must=("pack_padded_sequence of replicated rows", "GRU", "LSTM"))  # fmt: skip
    assert fixed or "packed sequence replicated to B rows" in str(report), str(report)


class Encoder(nn.Module):
    """A transformer encoder (a layer, or the stack with a causal mask made in the forward from a traced size, float
    or boolean) over the replicated history (users' tokens only), then the target."""

    def __init__(self, causal=None):
        super().__init__()
        layer = nn.TransformerEncoderLayer(D, H, dim_feedforward=32, batch_first=True, norm_first=True)
        self.causal = causal
        self.layer = layer if causal is None else nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.q = nn.Linear(FC, D)

    def forward(self, history, lengths, cand, cand_to_user):
        padding = torch.arange(L)[None, :] >= lengths[:, None]
        tokens = history.size(1)
        if self.causal == "float":
            mask = nn.Transformer.generate_square_subsequent_mask(tokens, device=history.device)
        elif self.causal == "bool":
            mask = torch.triu(torch.ones(tokens, tokens, dtype=torch.bool), 1)
        kwargs = {} if self.causal is None else {"mask": mask}
        seq = self.layer(history[cand_to_user], src_key_padding_mask=padding[cand_to_user], **kwargs)
        return (self.q(cand)[:, None, :] * seq).sum(-1)


@pytest.mark.parametrize("causal", [None, "float", "bool"])
def test_transformer_layer_over_history(causal):
    check(Encoder(causal))


class NestedEncoder(nn.Module):
    """nn.TransformerEncoder with its nested-tensor fast path on (the default): kept whole, run at U rows."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(D, H, dim_feedforward=32, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2)
        self.q = nn.Linear(FC, D)

    def forward(self, history, lengths, cand, cand_to_user):
        padding = torch.arange(L)[None, :] >= lengths[:, None]
        seq = self.encoder(history[cand_to_user, ...], src_key_padding_mask=padding[cand_to_user])
        return (self.q(cand)[:, None, :] * seq).sum(-1)


def test_nested_tensor_encoder_kept_whole():
    check(NestedEncoder())


class Branchy(nn.Module):
    """Python control flow on ndims and on the history length: followed on the example, checked per call."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, D)
        self.out = nn.Linear(D + FC, 1)

    def forward(self, history, cand, cand_to_user):
        h = self.proj(history[cand_to_user])
        if h.dim() == 3:
            state = torch.zeros_like(h[:, 0])
            for t in range(h.shape[1]):
                state = torch.tanh(state + h[:, t])
        return self.out(torch.cat([state, cand], dim=-1))


def test_control_flow_followed_and_guarded():
    check(Branchy(), must=("tanh",))
    model = Branchy().eval()
    gen = torch.Generator().manual_seed(4)
    module, _ = to_ikbo(model, args_for(model, request(*EXAMPLE, gen)), measure=False)
    assert isinstance(module, Guarded) and module.fixed_sizes
    shorter = request(*SIZES[0], gen)
    shorter["history"] = shorter["history"][:, :5]  # another length: the loop the capture followed differs
    args = args_for(model, shorter)
    with torch.inference_mode():
        assert rel_err(module(*args), model(*args)) <= RTOL
    assert module.fallbacks == 1


class RowLoop(nn.Module):
    """Loops over its rows in Python (the capture cannot follow it) but acts row by row."""

    def forward(self, x):
        return torch.stack([row * 2 if bool(row.sum() > 0) else row for row in x])


class Centered(nn.Module):
    """Branches on values and mixes rows (subtracts the batch mean): not row-wise."""

    def forward(self, x):
        return x - x.mean(0) if bool(x.sum() != 0) else x


class ScaledWhenLarge(nn.Module):
    """Branches on a statistic of all its rows: row by row on small inputs (the example's), not on large ones."""

    def forward(self, x):
        return x / x.norm() if bool(x.abs().max() > 10) else x


class WithOpaque(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner, self.proj, self.out = inner, nn.Linear(FU, D), nn.Linear(D + FC, 1)

    def forward(self, user, cand, cand_to_user):
        return self.out(torch.cat([self.inner(self.proj(user[cand_to_user])), cand], dim=-1))


def test_opaque_module_runs_at_user_rows_where_row_wise():
    report = check(WithOpaque(RowLoop()), must=("kept whole, runs at U rows",))
    assert any("`inner` (RowLoop)" in k for k in report.kept), str(report)
    report = check(WithOpaque(Centered()), expect_left=1, must=("`inner` reads candidate rows",))
    check(WithOpaque(ScaledWhenLarge()), expect_left=1, must=("`inner` reads candidate rows",))


class DictInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(FU + FC, 2)

    def forward(self, features: dict):
        m = features["cand_to_user"]
        return self.net(torch.cat([features["user"][m], features["cand"]], dim=1))


def test_dict_inputs_and_clear_errors():
    gen = torch.Generator().manual_seed(5)
    model = DictInput().eval()
    module, report = to_ikbo(model, (request(*EXAMPLE, gen),), measure=False)
    assert report.replications_left == 0 and module is not model, str(report)
    features = request(*SIZES[1], gen)
    with torch.inference_mode():
        assert rel_err(module(features), model(features)) <= RTOL

    class TupleInput(nn.Module):
        def forward(self, pair):
            return pair[0][pair[1]]

    with pytest.raises(ValueError, match="cand_to_user.*tuple"):
        to_ikbo(TupleInput(), ((torch.randn(5, 3), torch.randint(0, 5, (37,))),))
    with pytest.raises(ValueError, match="eval mode"):
        to_ikbo(nn.Sequential(nn.Dropout(0.5)).train(), (torch.randn(3, 2),))


class DictLoop(nn.Module):
    """User features as a dict, replicated entry by entry in a loop over `.items()` and read back by `.values()`."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FU + L * D + FC, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, user: dict, cand, cand_to_user):
        rows = {name: x[cand_to_user] for name, x in user.items()}
        return self.net(torch.cat([x.flatten(1) for x in rows.values()] + [cand], dim=1))


def test_loops_over_dict_inputs():
    """A loop over a dict input is unrolled over the example's keys; inputs with other keys run the original."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = DictLoop().eval()

    def make(num_users, num_candidates, names=("user", "history")):
        r = request(num_users, num_candidates, gen)
        return {names[0]: r["user"], names[1]: r["history"]}, r["cand"], r["cand_to_user"]

    module, report = to_ikbo(model, make(*EXAMPLE), measure=False)
    assert module is not model and report.replications_left == 0, str(report)
    for num_users, num_candidates in SIZES:
        args = make(num_users, num_candidates)
        with torch.inference_mode():
            assert rel_err(module(*args), model(*args)) <= RTOL, str(report)
        if 1 < num_candidates != num_users:
            assert replications_in(module, args, num_users, num_candidates) == [], str(report)
    other = make(5, 40, names=("user", "long_history"))
    with torch.inference_mode():
        assert rel_err(module(*other), model(*other)) <= RTOL
    assert module.fallbacks == 1


class SessionIds(nn.Module):
    """DSIN-style: each user's history ids cut into sessions after the replication, so the rows become B · sessions
    and the embedding runs there."""

    def __init__(self, sessions=2):
        super().__init__()
        self.sessions = sessions
        self.emb = nn.Embedding(50, D)
        self.out = nn.Linear(D + FC, 1)

    def forward(self, ids, cand, cand_to_user):
        rows = ids[cand_to_user].reshape(cand.shape[0] * self.sessions, -1)  # [B·sessions, L / sessions]
        pooled = self.emb(rows).mean(1).view(cand.shape[0], self.sessions, D).mean(1)
        return self.out(torch.cat([pooled, cand], dim=1))


def test_replicated_ids_before_a_lookup_are_reported():
    """Integer ids replicated to B rows whose lookup then runs at B rows count as a replication left (the report
    must not say nothing is left); a crossed id (user and candidate ids mixed) is the candidate's own data."""
    report = check(SessionIds(), expect_left=1, must=("ids, torch.int64: the lookups they feed",))
    assert "nothing" not in str(report)


def test_equal_row_counts_warn_and_return_the_model():
    model = Replicated("index").eval()
    gen = torch.Generator().manual_seed(6)
    with pytest.warns(UserWarning, match="U = B = 8"):
        module, report = to_ikbo(model, args_for(model, request(8, 8, gen)))
    assert module is model and "U = B = 8" in str(report)


def test_slower_rewrite_is_not_served(monkeypatch):
    monkeypatch.setattr(
        cost, "compare", lambda original, rewritten, inputs, cuda_graphs=False: cost.Timing(1e-3, 2e-3, 0.5, 5)
    )
    model = Replicated("index").eval()
    module, report = to_ikbo(model, args_for(model, request(*EXAMPLE, torch.Generator().manual_seed(7))))
    assert module is model and "slower" in report.left[0] and report.speedup == 0.5


def test_multihead_attention_eval_form_matches_the_module():
    gen = torch.Generator().manual_seed(8)
    for batch_first, bias_kv, zero_attn, need, kpm, mask in itertools.product(
        [True, False], [False, True], [False, True], [True, False], [None, "bool", "float"], [None, "bool", "float"]
    ):
        m = nn.MultiheadAttention(D, H, add_bias_kv=bias_kv, add_zero_attn=zero_attn, batch_first=batch_first).eval()
        q, k = torch.randn(3, 4, D, generator=gen), torch.randn(3, 6, D, generator=gen)
        if not batch_first:
            q, k = q.transpose(0, 1), k.transpose(0, 1)
        padding = torch.arange(6)[None, :] >= torch.tensor([6, 3, 1])[:, None]
        kpm_value = {None: None, "bool": padding, "float": torch.zeros(3, 6).masked_fill(padding, -math.inf)}[kpm]
        attn = {None: None, "bool": torch.ones(4, 6, dtype=torch.bool).triu(1), "float": torch.randn(3 * H, 4, 6)}[mask]
        if attn is not None and attn.dtype == torch.bool:
            attn[:, 0] = False
        if kpm_value is not None and attn is not None and (kpm_value.dtype == torch.bool) != (attn.dtype == torch.bool):
            continue  # mixed mask kinds: deprecated in the module
        with torch.no_grad():
            expected = m(q, k, k, key_padding_mask=kpm_value, need_weights=need, attn_mask=attn)
            actual = multihead_attention(m, q, k, k, key_padding_mask=kpm_value, need_weights=need, attn_mask=attn)
        assert rel_err(actual[0], expected[0]) <= RTOL
        assert (actual[1] is None) == (expected[1] is None)
        if need:
            assert rel_err(actual[1], expected[1]) <= RTOL


class ChangedThroughUnnamedViews(nn.Module):
    """An in-place change through a function that returns a view of the user tensor without being named one
    (hsplit, ravel, atleast_2d, broadcast_tensors, positive), before or after the replication."""

    VIEWS = {
        "hsplit": lambda u: torch.hsplit(u, 2)[0],
        "ravel": lambda u: u.ravel(),
        "atleast_2d": torch.atleast_2d,
        "broadcast_tensors": lambda u: torch.broadcast_tensors(u, torch.ones(u.shape[1]))[0],
        "positive": torch.positive,
    }

    def __init__(self, view, after):
        super().__init__()
        self.view, self.after = self.VIEWS[view], after
        self.out = nn.Linear(FU + FC, 1)

    def forward(self, user, cand, cand_to_user):
        if not self.after:
            self.view(user).clamp_(-0.3, 0.3)
        u = user[cand_to_user]
        if self.after:
            self.view(user).clamp_(-0.3, 0.3)
        return self.out(torch.cat([u, cand], dim=-1)) + user.sum()


@pytest.mark.parametrize("after", [False, True], ids=["before", "after"])
@pytest.mark.parametrize("view", list(ChangedThroughUnnamedViews.VIEWS))
def test_in_place_change_through_a_view_known_by_its_storage(view, after):
    """A view is known by the storage its value shares on the example, whatever it is called: exact or refused."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = ChangedThroughUnnamedViews(view, after).eval()
    module, report = to_ikbo(model, args_for(model, request(*EXAMPLE, gen)), measure=False)
    for num_users, num_candidates in SIZES:
        args = args_for(model, request(num_users, num_candidates, gen))
        with torch.inference_mode():
            expected = model(*(a.clone() for a in args))
            assert rel_err(module(*args), expected) <= RTOL, str(report)


class ClampsInPlace(nn.Module):
    """Kept whole (a branch on values), and changes its input in place."""

    def forward(self, x):
        if bool(torch.isnan(x).any()):
            x = x.nan_to_num(0.0)
        return x.clamp_(-0.5, 0.5)


class OutlierGuard(nn.Module):
    """Kept whole: halves the batch where any value is an outlier (a statistic of all its rows)."""

    def forward(self, x):
        return x / 2 if bool(x.abs().max() > 3.5) else x


class UserTower(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner, self.out, self.tower = inner, nn.Linear(FU + FC, 1), nn.Linear(FU, 1)

    def forward(self, user, cand, cand_to_user):
        x = torch.cat([self.inner(user[cand_to_user]), cand], dim=-1)
        return self.out(x) + self.tower(user)[cand_to_user]


def _outlier_without_candidates(num_users, num_candidates, gen):
    """Users' features within ±3, but a user without candidates holds an outlier."""
    inputs = request(num_users + 1, num_candidates, gen)
    inputs["user"] = inputs["user"].clamp(-3, 3)
    inputs["cand_to_user"] %= num_users
    inputs["user"][num_users, 0] = 10.0
    return inputs


def test_modules_kept_whole_see_the_rows_the_original_gives_them():
    """A kept module that changes its input in place would change the user rows themselves at U rows: the model
    comes back, the caller's tensors untouched; one that branches on a statistic of its rows sees only rows of users
    with candidates (`ops.present_rows`), also with outliers in the others."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = UserTower(ClampsInPlace()).eval()
    module, report = to_ikbo(model, args_for(model, request(*EXAMPLE, gen)), measure=False)
    assert module is model and "changes its input in place" in str(report), str(report)
    check(UserTower(OutlierGuard()), make=_outlier_without_candidates, must=("kept whole, runs at U rows",))


class RenormedLookup(nn.Module):
    """nn.Embedding(max_norm=1) over replicated user ids, its table also read raw (a tied candidate table)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(60, D, max_norm=1.0)

    def forward(self, ids, cand, cand_to_user):
        u = self.emb(ids[:, 0][cand_to_user])
        c = self.emb.weight[(cand[:, 0].abs() * 10).long() % 60]
        return (u * c).sum(-1)


def test_max_norm_lookup_renormalizes_only_the_rows_the_original_reads():
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = RenormedLookup().eval()
    twin = RenormedLookup().eval()
    twin.load_state_dict(model.state_dict())
    example = args_for(model, request(*EXAMPLE, gen))
    module, report = to_ikbo(twin, example, measure=False)
    twin.load_state_dict(model.state_dict())
    for num_users, num_candidates in SIZES:
        inputs = request(num_users, num_candidates, gen)
        inputs["ids"][:, 0] = torch.randperm(60, generator=gen)[:num_users]
        inputs["cand_to_user"] %= max(num_users - 1, 1)  # the last user has no candidates
        args = args_for(model, inputs)
        with torch.no_grad():
            assert rel_err(module(*args), model(*args)) <= RTOL, str(report)
        assert torch.equal(twin.emb.weight, model.emb.weight)


class HistoryEncoder(nn.Module):
    """Self-attention over each user's history with a key padding mask (users with an empty history: every key
    masked), in the forms torch runs through its native fast path in inference."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        layer = nn.TransformerEncoderLayer(D, H, 32, dropout=0.0, batch_first=True)
        self.m = {
            "layer": layer,
            "encoder": nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
            "mha": nn.MultiheadAttention(D, H, batch_first=True),
        }[kind]
        self.q = nn.Linear(FC, D)

    def forward(self, history, lengths, cand, cand_to_user):
        padding = torch.arange(L)[None, :] >= lengths[:, None]
        if self.kind == "mha":
            h = self.m(history, history, history, key_padding_mask=padding, need_weights=False)[0]
        else:
            h = self.m(history, src_key_padding_mask=padding)
        return (h[:, -1][cand_to_user] * self.q(cand)).sum(-1)


@pytest.mark.parametrize("kind", ["layer", "encoder", "mha"])
def test_fast_path_rows_of_empty_histories(kind):
    """In inference torch's native fast path gives NaN for a user whose keys are all masked, its slow path numbers:
    the rewrite gives what the original gives in each mode."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = HistoryEncoder(kind).eval()
    module, report = to_ikbo(model, args_for(model, request(*EXAMPLE, gen)), measure=False)
    assert module is not model and report.replications_left == 0, str(report)
    for num_users, num_candidates in SIZES:
        inputs = request(num_users, num_candidates, gen)
        inputs["lengths"][inputs["cand_to_user"][:2]] = 0
        args = args_for(model, inputs)
        for mode in (torch.inference_mode, torch.no_grad, torch.enable_grad):
            with mode():
                expected, got = model(*args), module(*args)
            assert torch.equal(got.isnan(), expected.isnan()), (mode, str(report))
            assert expected.isnan().any() == (mode is not torch.enable_grad)
            keep = ~expected.isnan()
            assert rel_err(got[keep], expected[keep]) <= RTOL, str(report)


class FirstCandidateReference(nn.Module):
    """Each candidate's user features minus the first candidate's (a fixed number of candidate rows)."""

    def __init__(self):
        super().__init__()
        self.out = nn.Linear(FU, 1)

    def forward(self, user, cand, cand_to_user):
        return self.out(user[cand_to_user] - cand[:1, :FU])


def test_calls_without_candidates_run_the_original():
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = FirstCandidateReference().eval()
    module, report = to_ikbo(model, args_for(model, request(*EXAMPLE, gen)), measure=False)
    assert module is not model, str(report)
    args = args_for(model, request(4, 0, gen))
    with torch.inference_mode():
        assert module(*args).shape == model(*args).shape == (0, 1)
    assert module.fallbacks == 1


def test_forward_hooks_are_called_as_in_the_original():
    """A model with forward hooks comes back unchanged; a hook registered after the pass makes the module run the
    original (the rewritten graph calls no hooks)."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = Replicated("index").eval()
    seen = []
    handle = model.net[0].register_forward_hook(lambda m, a, out: seen.append(out.shape[0]))
    module, report = to_ikbo(model, args_for(model, request(*EXAMPLE, gen)), measure=False)
    assert module is model and "forward hooks on `net.0`" in str(report), str(report)
    handle.remove()
    module, report = to_ikbo(model, args_for(model, request(*EXAMPLE, gen)), measure=False)
    assert module is not model, str(report)
    model.net[2].register_forward_hook(lambda m, a, out: out * 0 + 1.0)
    args = args_for(model, request(*SIZES[0], gen))
    with torch.inference_mode():
        assert torch.equal(module(*args), model(*args))
        assert (model(*args) == 1.0).all()


def test_joins_follow_autocast():
    """Under torch.autocast a batched matmul join runs in the autocast dtype as the original's matmul does, also
    where it is computed a tile of candidates at a time."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))

    class Scores(nn.Module):
        def forward(self, history, cand, cand_to_user):
            return cand.view(-1, 1, FC)[..., :1].expand(-1, 2, D) @ history[cand_to_user].transpose(1, 2)

    model = Scores().eval()
    module, report = to_ikbo(model, args_for(model, request(*EXAMPLE, gen)), measure=False)
    assert "rows_matmul" in module.code, str(report)
    rows = ops.TILE_BYTES // (L * D * 4) + 7  # past one tile of user rows
    for num_candidates in (SIZES[0][1], rows):
        args = args_for(model, request(3, num_candidates, gen))
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            expected, got = model(*args), module(*args)
        assert got.dtype == expected.dtype == torch.bfloat16
        assert rel_err(got.float(), expected.float()) <= 1e-2


class AttentionOfMixedDtypes(nn.Module):
    """Target attention whose queries come from a linear and whose K/V are the history as given: under autocast the
    linear's output is bf16 and the history fp32, which the original's SDPA and matmuls cast alike; or all three
    fp32 inputs, which autocast computes (and returns) in bf16."""

    def __init__(self, chain):
        super().__init__()
        self.chain, self.q = chain, nn.Linear(FC, D)

    def forward(self, history, ids, cand, cand_to_user):
        keys, keep = history[cand_to_user], ids[cand_to_user] != 0  # [B, L, D], [B, L]
        if self.chain:
            scores = (self.q(cand)[:, None] @ keys.transpose(1, 2) / 4.0).masked_fill(~keep[:, None], -1e9)
            return (scores.softmax(-1) @ keys).squeeze(1)
        q = F.pad(cand, (0, D - FC))[:, None, None]
        return F.scaled_dot_product_attention(q, keys[:, None], keys[:, None], attn_mask=keep[:, None, None]).flatten(1)


@pytest.mark.parametrize("chain", [True, False])
def test_attention_follows_autocast(chain):
    """Under torch.autocast ikbo_attention takes q, k, v in the autocast dtype, as the original's SDPA / matmuls
    compute them: the op takes one dtype, and the output has the original's."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = AttentionOfMixedDtypes(chain).eval()
    module, report = to_ikbo(model, args_for(model, request(*EXAMPLE, gen)), measure=False)
    assert "ikbo_attention" in str(report), str(report)
    for sizes in SIZES:
        args = args_for(model, request(*sizes, gen))
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            expected, got = model(*args), module(*args)
        assert got.dtype == expected.dtype == torch.bfloat16
        assert rel_err(got.float(), expected.float()) <= 2e-2


class WithSettings(nn.Module):
    """Non-tensor arguments: a temperature, a top-k count, a task flag, a default left out of the example."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(FU + FC, 4)

    def forward(self, user, cand, cand_to_user, temperature, k, task, bias=0.0):
        scores = self.net(torch.cat([user[cand_to_user], cand], dim=1)) / temperature
        scores = scores.topk(k, dim=1).values
        return (scores * 2 if task == "ctr" else scores) + bias


def test_non_tensor_arguments_are_fixed_at_the_example_values():
    """The graph is traced with the example's values of non-tensor arguments; a call with the same values runs it,
    a call with others runs the original."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = WithSettings().eval()
    settings = (0.7, 2, "ctr")
    module, report = to_ikbo(model, (*args_for(Replicated("index"), request(*EXAMPLE, gen)), *settings), measure=False)
    assert module is not model and report.replications_left == 0, str(report)
    for num_users, num_candidates in SIZES:
        args = args_for(Replicated("index"), request(num_users, num_candidates, gen))
        before = module.fallbacks
        with torch.inference_mode():
            assert rel_err(module(*args, *settings), model(*args, *settings)) <= RTOL, str(report)
            assert module.fallbacks == before
            for other in ((1.3, 2, "ctr"), (0.7, 3, "ctr"), (0.7, 2, "cvr")):
                assert rel_err(module(*args, *other), model(*args, *other)) <= RTOL
            assert rel_err(module(*args, *settings, bias=1.0), model(*args, *settings, bias=1.0)) <= RTOL
        assert module.fallbacks == before + 4


class AlongFeatures(nn.Module):
    """An op along the feature dims of the replicated history (row by row), then pooled and joined."""

    OPS = {
        "median": lambda h: h.median(dim=1).values,
        "nanmedian": lambda h: torch.nanmedian(h, 1)[0],
        "mode": lambda h: h.round().mode(1).values,
        "kthvalue": lambda h: h.kthvalue(3, dim=1).values,
        "var_mean": lambda h: sum(torch.var_mean(h, dim=1)),
        "std_mean": lambda h: torch.std_mean(h, 1)[0],
        "aminmax": lambda h: torch.aminmax(h, dim=1).max,
        "cummax": lambda h: h.cummax(1).values.sum(1),
        "cummin": lambda h: torch.cummin(h, dim=2)[0].mean(1),
        "logcumsumexp": lambda h: h.logcumsumexp(1).amax(1),
        "nansum": lambda h: h.nansum(1),
        "nanmean": lambda h: torch.nanmean(h, dim=1),
        "renorm": lambda h: h.renorm(2, 0, 1.0).mean(1),
        "index_fill": lambda h: h.index_fill(2, torch.tensor([0, 3]), 0.5).sum(1),
        "bucketize": lambda h: torch.bucketize(h, torch.linspace(-2, 2, 9)).float().mean(1),
        "searchsorted": lambda h: torch.searchsorted(torch.linspace(-2, 2, 9), h.contiguous()).float().mean(1),
        "interpolate": lambda h: F.interpolate(h.transpose(1, 2), size=6, mode="linear").mean(2),
        "unfold": lambda h: F.unfold(h.unsqueeze(1), (3, 4), stride=(3, 4)).mean(1).repeat(1, 2)[:, :D],
    }

    def __init__(self, op):
        super().__init__()
        self.op = self.OPS[op]
        self.out = nn.Linear(D + FC, 1)

    def forward(self, history, cand, cand_to_user):
        return self.out(torch.cat([self.op(history[cand_to_user]), cand], dim=-1))


@pytest.mark.parametrize("op", list(AlongFeatures.OPS))
def test_ops_along_feature_dims_run_at_user_rows(op):
    check(AlongFeatures(op))


class GroupedQueryAttention(nn.Module):
    """SDPA with enable_gqa: 4 query heads share 2 K/V heads of each user's history, with a key padding mask."""

    def __init__(self):
        super().__init__()
        self.q, self.kv = nn.Linear(FC, 4 * 8), nn.Linear(D, 2 * 2 * 8)

    def forward(self, history, lengths, cand, cand_to_user):
        q = self.q(cand).view(-1, 4, 1, 8)
        k, v = self.kv(history).view(history.shape[0], L, 2, 2, 8).permute(2, 0, 3, 1, 4)
        keep = torch.arange(L)[None, :] < lengths[:, None]
        out = F.scaled_dot_product_attention(
            q, k[cand_to_user], v[cand_to_user], attn_mask=keep[cand_to_user][:, None, None, :], enable_gqa=True
        )
        return out.flatten(1).sum(-1)


def test_grouped_query_attention():
    check(GroupedQueryAttention(), must=("ikbo_attention",))


class HashMatches(nn.Module):
    """SimHash-style retrieval (ETA / SDIM): each history item's sign bits compared with the candidate's, bit
    matches counted; plus comparisons of float, integer and boolean user rows with candidate rows."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.register_buffer("planes", torch.randn(D, 8))
        self.q = nn.Linear(FC, D)

    def forward(self, history, ids, cand, cand_to_user):
        target = self.q(cand)
        if self.kind == "hash":
            bits = (history @ self.planes) > 0  # [U, L, 8] booleans at U rows
            match = bits[cand_to_user] == ((target @ self.planes) > 0)[:, None, :]
            return match.float().sum(-1).softmax(-1)
        if self.kind == "xor":
            bits = (history @ self.planes) > 0
            return (bits[cand_to_user] ^ ((target @ self.planes) > 0)[:, None, :]).sum((1, 2)).float()
        if self.kind == "ids":
            same = ids[cand_to_user] != (cand[:, :1].abs() * 20).long()  # integer user rows
            return same.float().mean(-1)
        closer = history.norm(dim=-1)[cand_to_user] < target.norm(dim=-1, keepdim=True)  # float user rows
        return closer.logical_and(history[:, :, 0][cand_to_user] >= 0).float().sum(-1)


@pytest.mark.parametrize("kind", ["hash", "xor", "ids", "float"])
def test_comparisons_with_candidate_rows_are_joins(kind):
    check(HashMatches(kind), must=("rows_join",))


class MaskFromCandidateCount(nn.Module):
    """An additive key mask made at B rows from the candidate count (`zeros(B, L)` / `full((B, L), …)` filled
    through the replicated key mask), as Hugging-Face-style code writes it."""

    def __init__(self, kind):
        super().__init__()
        self.kind, self.q = kind, nn.Linear(FC, D)

    def forward(self, history, lengths, cand, cand_to_user):
        keep = (torch.arange(L)[None, :] < lengths[:, None])[cand_to_user]
        if self.kind == "zeros":
            mask = torch.zeros(cand.shape[0], L).masked_fill(~keep, torch.finfo(torch.float32).min)
        else:
            mask = torch.full((len(cand_to_user), L), -math.inf).masked_fill(keep, 0.0)
        k = history[cand_to_user][:, None]
        out = F.scaled_dot_product_attention(self.q(cand)[:, None, None, :], k, k, attn_mask=mask[:, None, None, :])
        return out.flatten(1).sum(-1)


@pytest.mark.parametrize("kind", ["zeros", "full"])
def test_masks_made_at_candidate_count_are_per_user(kind):
    check(MaskFromCandidateCount(kind), must=("ikbo_attention",))


class FastPathCases(nn.Module):
    """Where torch takes the native fast path: a query through an eval Dropout (the same tensor, so still
    self-attention), `torch.no_grad()` entered by the forward itself, an input that requires grad."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.mha, self.drop = nn.MultiheadAttention(D, H, batch_first=True), nn.Dropout(0.1)
        self.layer = nn.TransformerEncoderLayer(D, H, 32, dropout=0.0, batch_first=True)
        self.lift = nn.Linear(D, D)
        self.q = nn.Linear(FC, D)

    def forward(self, history, lengths, cand, cand_to_user):
        h = history[cand_to_user]
        padding = torch.arange(L)[None, :] >= lengths[cand_to_user][:, None]
        if self.kind == "dropout":
            out = self.mha(self.drop(h), h, h, key_padding_mask=padding, need_weights=False)[0]
        elif self.kind == "no_grad":
            with torch.no_grad():
                out = self.layer(h, src_key_padding_mask=padding)
        else:  # a frozen layer over a trainable projection: its input requires grad where grad is on
            out = self.layer(self.lift(h), src_key_padding_mask=padding)
        return (out[:, -1] * self.q(cand)).sum(-1)


@pytest.mark.parametrize("kind", ["dropout", "no_grad", "input_requires_grad"])
def test_fast_path_decided_as_torch_decides_it(kind):
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = FastPathCases(kind).eval()
    model.layer.requires_grad_(False)
    module, report = to_ikbo(model, args_for(model, request(*EXAMPLE, gen)), measure=False)
    assert module is not model, str(report)
    for num_users, num_candidates in SIZES:
        inputs = request(num_users, num_candidates, gen)
        inputs["lengths"][inputs["cand_to_user"][:2]] = 0
        args = args_for(model, inputs)
        device_mode = lambda: torch.device("cpu")  # noqa: E731  (a torch function mode: torch's slow path)
        for mode in (torch.inference_mode, torch.enable_grad, device_mode):
            with torch.no_grad(), mode():
                expected, got = model(*args), module(*args)
            assert torch.equal(got.isnan(), expected.isnan()), (mode, str(report))
            keep = ~expected.isnan()
            assert rel_err(got[keep].detach(), expected[keep].detach()) <= RTOL, str(report)


class LargeBatchPath(nn.Module):
    """Kept whole (a branch on values) and a branch on its batch size."""

    def forward(self, x):
        if bool((x > 100).any()):
            x = x / 100
        return x * 2 if x.shape[0] > 3 * EXAMPLE[1] else x


def test_kept_module_branching_on_its_batch_size_runs_at_candidate_rows():
    check(UserTower(LargeBatchPath()), expect_left=1, sizes=[(7, 300), (3, 41)], must=("`inner` reads candidate rows",))


def test_a_model_changed_after_the_pass_runs_as_it_is_now():
    """Weights reloaded in place, a parameter rebound, training mode: the graph holds the model as it was, so the
    original runs (with one warning)."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = Replicated("index").eval()
    fresh = Replicated("index").state_dict()
    changes = (
        lambda: model.load_state_dict(fresh),
        lambda: setattr(model.net[2], "bias", nn.Parameter(torch.randn(1))),
        lambda: model.train(),
        lambda: model.net.__setitem__(1, nn.Tanh()),
        lambda: setattr(model, "spell", lambda x, m: x[m] * 2),
    )
    for change in changes:
        model.net[1], model.spell = nn.ReLU(), Replicated.SPELLINGS["index"]
        module, report = to_ikbo(model.eval(), args_for(model, request(*EXAMPLE, gen)), measure=False)
        assert module is not model, str(report)
        change()
        args = args_for(model, request(*SIZES[0], gen))
        with torch.inference_mode(), pytest.warns(UserWarning, match="changed after the pass"):
            got = module(*args)
        with torch.inference_mode():
            assert torch.equal(got, model(*args))
        assert module.fallbacks == 1


class Settings(enum.Enum):
    CTR = 1
    CVR = 2


class Tasks(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(FU + FC, 2)

    def forward(self, user, cand, cand_to_user, task, dtype, temperature):
        scores = self.net(torch.cat([user[cand_to_user], cand], dim=1)).to(dtype) / temperature
        return scores[:, :1] if task is Settings.CTR else scores[:, 1:]


def test_enum_dtype_and_signed_zero_settings_are_checked():
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = Tasks().eval()
    base = args_for(Replicated("index"), request(*EXAMPLE, gen))
    module, report = to_ikbo(model, (*base, Settings.CTR, torch.float32, 0.0), measure=False)
    assert module is not model, str(report)
    args = args_for(Replicated("index"), request(*SIZES[0], gen))
    for settings in (
        (Settings.CTR, torch.float32, 0.0),
        (Settings.CVR, torch.float64, -0.0),
        (Settings.CTR, torch.float32, -0.0),
    ):
        with torch.inference_mode():
            expected, got = model(*args, *settings), module(*args, *settings)
        assert got.dtype == expected.dtype and torch.equal(got.isinf(), expected.isinf())
        assert torch.equal(torch.signbit(got), torch.signbit(expected))
    assert module.fallbacks == 2

    class WithConfig(Tasks):
        def forward(self, user, cand, cand_to_user, config):
            return self.net(torch.cat([user[cand_to_user], cand], dim=1)) * config.weight

    model = WithConfig().eval()
    module, report = to_ikbo(model, (*base, types.SimpleNamespace(weight=2.0)), measure=False)
    assert module is model and "non-tensor arguments of other types" in str(report), str(report)


def test_grouped_query_heads_read_at_each_call():
    """The query heads a K/V head serves come from the call's shapes (here user K/V with another head count)."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))

    class Cached(nn.Module):
        def forward(self, k, cand, cand_to_user):
            q = cand[:, : 4 * 2].reshape(-1, 4, 1, 2)
            kv = k[cand_to_user]
            return F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True).flatten(1)

    model = Cached().eval()

    def make(u, b, heads):
        return (
            torch.randn(u, heads, L, 2, generator=gen),
            torch.randn(b, FC, generator=gen),
            torch.randint(0, u, (b,), generator=gen),
        )

    module, report = to_ikbo(model, make(*EXAMPLE, 2), measure=False)
    assert "ikbo_attention" in str(report), str(report)
    for heads in (1, 2, 4):
        args = make(*SIZES[0], heads)
        with torch.inference_mode():
            assert rel_err(module(*args), model(*args)) <= RTOL


def test_type_one_linear_follows_autocast():
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = Replicated("index").eval()
    module, report = to_ikbo(model, args_for(model, request(*EXAMPLE, gen)), measure=False)
    args = args_for(model, request(*SIZES[1], gen))
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected, got = model(*args), module(*args)
    assert got.dtype == expected.dtype == torch.bfloat16
    assert rel_err(got.float(), expected.float()) <= 2e-2


class HeadsBySizeTuple(nn.Module):
    """Heads split as Hugging Face / RecBole write it: `x.view(*(x.size()[:-1] + (H, d)))`, over the replicated
    history, then target attention of the candidate over those heads."""

    def __init__(self):
        super().__init__()
        self.kv, self.q = nn.Linear(D, 2 * D), nn.Linear(FC, D)

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (H, D // H)
        return x.view(*new_x_shape).permute(0, 2, 1, 3)

    def forward(self, history, cand, cand_to_user):
        k, v = self.kv(history[cand_to_user]).chunk(2, dim=-1)
        q = self.q(cand).view(-1, H, 1, D // H)
        out = F.scaled_dot_product_attention(q, self.transpose_for_scores(k), self.transpose_for_scores(v))
        return out.flatten(1).sum(-1)


def test_heads_split_by_a_size_tuple():
    check(HeadsBySizeTuple(), must=("ikbo_attention",))


class WithItsBatchSize(nn.Module):
    """Kept whole (a branch on values); returns its batch size beside its rows."""

    def forward(self, x):
        if bool((x > 100).any()):
            x = x / 2
        return x * 2, x.shape[0]


class SizeScaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner, self.out = WithItsBatchSize(), nn.Linear(FU + FC, 1)

    def forward(self, user, cand, cand_to_user):
        rows, count = self.inner(user[cand_to_user])
        return self.out(torch.cat([rows, cand], dim=-1)) * count


def test_kept_module_returning_a_size_runs_at_candidate_rows():
    check(SizeScaled(), expect_left=1, must=("`inner` reads candidate rows",))


class MeanGate(nn.Module):
    """Kept whole: squashes the batch where the mean of its rows is positive (weighs rows by their counts)."""

    def forward(self, x):
        return torch.tanh(x) if bool(x.mean() > 0) else x


def test_kept_module_branching_on_a_mean_runs_at_candidate_rows():
    check(UserTower(MeanGate()), expect_left=1, must=("`inner` reads candidate rows",))


class FirstRowGate(nn.Module):
    """Kept whole: a branch on its first row (the first candidate's user in the original)."""

    def forward(self, x):
        return x * 2 if bool(x[0, 0] > 0) else x - 1


def test_kept_module_reading_its_first_row_runs_at_candidate_rows():
    check(UserTower(FirstRowGate()), expect_left=1, must=("`inner` reads candidate rows",))


class ComparedInPlace(nn.Module):
    """An in-place comparison on a float replica keeps its float dtype (x.gt_(y) is 0. / 1.)."""

    def __init__(self):
        super().__init__()
        self.u, self.c = nn.Linear(FU, 4), nn.Linear(FC, 4)

    def forward(self, user, cand, cand_to_user):
        return self.u(user)[cand_to_user].gt_(self.c(cand)).mean(-1)


def test_in_place_comparison_keeps_the_dtype():
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = ComparedInPlace().eval()
    module, report = to_ikbo(model, args_for(model, request(*EXAMPLE, gen)), measure=False)
    args = args_for(model, request(*SIZES[0], gen))
    with torch.inference_mode():
        expected, got = model(*args), module(*args)
    assert got.dtype == expected.dtype == torch.float32 and torch.equal(got, expected), str(report)


class WithOptions(nn.Module):
    """Options the example leaves at their defaults, read in Python branches."""

    def __init__(self):
        super().__init__()
        self.net, self.aux = nn.Linear(FU + FC, 4), nn.Linear(FU, 2)

    def forward(self, user, cand, cand_to_user, return_aux=False, cfg=None, scale=1.0):
        out = self.net(torch.cat([user[cand_to_user], cand], dim=1)) * scale
        if cfg is not None:
            out = out * cfg
        return (out, self.aux(user)) if return_aux else out


def test_options_left_at_their_defaults_are_traced_with_them():
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = WithOptions().eval()
    module, report = to_ikbo(model, args_for(Replicated("index"), request(*EXAMPLE, gen)), measure=False)
    assert module is not model and report.replications_left == 0, str(report)
    args = args_for(Replicated("index"), request(*SIZES[0], gen))
    with torch.inference_mode():
        assert rel_err(module(*args), model(*args)) <= RTOL
        assert rel_err(module(*args, scale=1.0), model(*args, scale=1.0)) <= RTOL
        assert module.fallbacks == 0
        assert rel_err(module(*args, cfg=2.0), model(*args, cfg=2.0)) <= RTOL
        got, expected = module(*args, True), model(*args, True)
        assert all(rel_err(a, b) <= RTOL for a, b in zip(got, expected))
    assert module.fallbacks == 2


class FunctionalReshape(nn.Module):
    """torch.reshape (the function, sizes as one tuple) of a replica, sizes from its shape."""

    def __init__(self):
        super().__init__()
        self.kv, self.out = nn.Linear(D, D), nn.Linear(D + FC, 1)

    def forward(self, history, cand, cand_to_user):
        x = self.kv(history[cand_to_user])
        heads = torch.reshape(x, tuple(x.shape[:-1]) + (H, D // H)).permute(0, 2, 1, 3)
        return self.out(torch.cat([heads.mean((1, 2)).repeat(1, H), cand], dim=-1))


def test_functional_reshape_of_a_replica():
    check(FunctionalReshape())


class HeadsBySizeConcat(nn.Module):
    """Heads split with the sizes as one torch.Size concatenation (`x.view(x.shape[:-1] + torch.Size([H, d]))`) over a
    replica, then target attention of the candidate over those heads."""

    SPELLINGS = {
        "view": lambda x: x.view(x.shape[:-1] + torch.Size([H, D // H])),
        "reshape": lambda x: x.reshape(x.size()[:-1] + torch.Size((H, D // H))),
        "torch_reshape": lambda x: torch.reshape(x, x.shape[:-1] + torch.Size([H, D // H])),
    }

    def __init__(self, spell):
        super().__init__()
        self.spell, self.kv, self.q = self.SPELLINGS[spell], nn.Linear(D, 2 * D), nn.Linear(FC, D)

    def forward(self, history, cand, cand_to_user):
        k, v = self.kv(history[cand_to_user]).chunk(2, dim=-1)
        k, v = (self.spell(t).transpose(1, 2) for t in (k, v))
        out = F.scaled_dot_product_attention(self.q(cand).view(-1, H, 1, D // H), k, v)
        return out.flatten(1).sum(-1)


@pytest.mark.parametrize("spell", list(HeadsBySizeConcat.SPELLINGS))
def test_heads_split_by_a_torch_size_concatenation(spell):
    check(HeadsBySizeConcat(spell), must=("ikbo_attention",), sizes=WITHOUT_CANDIDATES)


class MaskedFills(nn.Module):
    """masked_fill of replicated user scores: by user ids replicated alike (padding), by a mask of candidate rows (a
    number or a 0-dim tensor as the value), and in place by the history items equal to the candidate's id."""

    def __init__(self, kind):
        super().__init__()
        self.kind, self.w, self.out = kind, nn.Linear(D, 1), nn.Linear(L + FC, 1)

    def forward(self, history, ids, cand, cand_to_user):
        scores = self.w(history).squeeze(-1)[cand_to_user]
        if self.kind == "user_mask":
            scores = scores.masked_fill(ids[cand_to_user] == 0, float("-inf"))
        elif self.kind == "candidate_mask":
            scores = torch.masked_fill(scores, cand[:, :1] > 0, torch.tensor(-1e9))
        elif self.kind == "candidate_number":
            scores = scores.masked_fill(cand[:, 1:2].expand(-1, L) > 0.5, -1e9)
        else:
            scores.masked_fill_(ids[cand_to_user] == (cand[:, :1].abs() * 20).long(), -1e9)
        return self.out(torch.cat([scores.softmax(-1), cand], dim=-1))


@pytest.mark.parametrize("kind", ["user_mask", "candidate_mask", "candidate_number", "target_in_history"])
def test_masked_fill_of_replicated_rows(kind):
    past_a_tile = (3, ops.TILE_BYTES // (L * 4) + 7)  # the join a tile of candidates at a time
    must = ("masked_fill",) if kind == "user_mask" else ("masked_fill of candidate rows", "rows_join")
    check(MaskedFills(kind), must=must, sizes=[*WITHOUT_CANDIDATES, past_a_tile])


class WeightedTasks(nn.Module):
    """Non-tensor arguments that are lists and tuples of numbers (task weights, reduction dims) and a default of
    nested tuples of settings."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(FU + FC, 2)

    def forward(self, user, cand, cand_to_user, weights, dims, options=((1.0, "mean"), None)):
        scores = self.net(torch.cat([user[cand_to_user], cand], dim=1)) * torch.tensor(weights)
        scores = scores.unsqueeze(-1).expand(-1, -1, len(dims) + 1) * options[0][0]
        return scores.mean(dims) if options[0][1] == "mean" else scores.sum(dims)


def test_lists_and_tuples_of_settings_are_fixed_at_the_example_values():
    """A list / tuple (nested too) of numbers, flags, strings is a setting: the graph is traced with the example's, a
    call with the same entries runs it, a call with others (or another container type) runs the original."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = WeightedTasks().eval()
    settings = ([0.3, 0.7], (1, 2))
    module, report = to_ikbo(model, (*args_for(Replicated("index"), request(*EXAMPLE, gen)), *settings), measure=False)
    assert module is not model and report.replications_left == 0, str(report)
    others = [
        ([0.5, 0.5], (1, 2)),
        ((0.3, 0.7), (1, 2)),
        ([0.3, 0.7], (2, 1)),
        ([0.3, 0.7], [1, 2]),
        ([0.3, 0.7], (1,)),
    ]
    for num_users, num_candidates in WITHOUT_CANDIDATES:
        args = args_for(Replicated("index"), request(num_users, num_candidates, gen))
        before = module.fallbacks
        with torch.inference_mode():
            assert rel_err(module(*args, *settings), model(*args, *settings)) <= RTOL, str(report)
            assert rel_err(module(*args, [0.3, 0.7], dims=(1, 2)), model(*args, *settings)) <= RTOL
            assert module.fallbacks == before
            for other in others:
                assert rel_err(module(*args, *other), model(*args, *other)) <= RTOL
            nested = ((2.0, "sum"), None)
            assert rel_err(module(*args, *settings, nested), model(*args, *settings, nested)) <= RTOL
        assert module.fallbacks == before + len(others) + 1


class KeyedWeights(nn.Module):
    """A dict of settings whose keys the forward reads: an offset per key, doubled for a flag (True == 1 as a key)."""

    def __init__(self):
        super().__init__()
        self.net = Replicated("index")

    def forward(self, user, cand, cand_to_user, weights):
        scores = self.net(user, cand, cand_to_user)
        for key, weight in weights.items():
            scores = scores * weight + (2.0 if type(key) is bool else 1.0) * key
        return scores


def test_dict_keys_of_settings_are_checked_by_type():
    """{1: w}, {True: w} and {1.0: w} are one dict to pytree's structure (keys compared by ==) but not to a forward
    that reads its keys: a call with keys of other types than the example's runs the original."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = KeyedWeights().eval()
    module, report = to_ikbo(model, (*args_for(Replicated("index"), request(*EXAMPLE, gen)), {1: 0.5}), measure=False)
    assert module is not model and report.replications_left == 0, str(report)
    for num_users, num_candidates in WITHOUT_CANDIDATES:
        args = args_for(Replicated("index"), request(num_users, num_candidates, gen))
        before = module.fallbacks
        with torch.inference_mode():
            assert rel_err(module(*args, {1: 0.5}), model(*args, {1: 0.5})) <= RTOL, str(report)
            assert module.fallbacks == before
            for other in ({True: 0.5}, {1.0: 0.5}):
                assert rel_err(module(*args, other), model(*args, other)) <= RTOL
        assert module.fallbacks == before + 2


class ArgumentNames(nn.Module):
    """Forward parameters named like what fx and its generated code use: `meta` (a node's field; here a dict of
    settings), `graph`, `_`, builtins (`input`, `getattr`), `torch`."""

    def __init__(self):
        super().__init__()
        self.net = Replicated("index")

    def forward(self, input, cand, cand_to_user, getattr, torch, meta, graph, _):
        scores = self.net(input, cand, cand_to_user) * getattr + torch[cand_to_user].sum(-1, keepdim=True) + graph * _
        return scores * meta["scale"] if meta["task"] == "ctr" else scores


def test_parameters_named_like_what_fx_uses():
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = ArgumentNames().eval()
    names = list(inspect.signature(model.forward).parameters)

    def make(num_users, num_candidates):
        user, cand, mapping = args_for(Replicated("index"), request(num_users, num_candidates, gen))
        rows = torch.randn(num_users, 3, generator=gen), torch.randn(num_candidates, 1, generator=gen)
        return user, cand, mapping, torch.tensor(1.5), rows[0], {"task": "ctr", "scale": 2.0}, rows[1], 0.5

    module, report = to_ikbo(model, make(*EXAMPLE), measure=False)
    assert module is not model and report.replications_left == 0, str(report)
    for num_users, num_candidates in WITHOUT_CANDIDATES:
        args = make(num_users, num_candidates)
        with torch.inference_mode():
            expected = model(*args)
            assert rel_err(module(*args), expected) <= RTOL, str(report)
            assert rel_err(module(**dict(zip(names, args))), expected) <= RTOL
        assert module.fallbacks == 0


class PassingOn(nn.Module):
    """A wrapper: its forward hands every argument on to `inner`."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


class CallsAWrapper(nn.Module):
    """A wrapper called as a submodule, with keywords."""

    def __init__(self):
        super().__init__()
        self.scorer = PassingOn(WithOptions())

    def forward(self, user, cand, cand_to_user):
        return self.scorer(user, cand, cand_to_user=cand_to_user, scale=2.0)


@pytest.mark.parametrize("kind", ["wrapper", "wrapper_of_wrapper", "submodule"])
def test_forwards_handing_their_arguments_on(kind):
    """A model whose forward is `forward(self, *args, **kwargs): return self.inner(*args, **kwargs)` is captured in
    `inner`, its arguments named by its parameters (passed by position or name); another `inner` assigned after the
    pass runs the original."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    models = {"wrapper": lambda: PassingOn(Replicated("index")), "submodule": CallsAWrapper}
    model = models.get(kind, lambda: PassingOn(PassingOn(WithOptions())))().eval()
    module, report = to_ikbo(model, args_for(Replicated("index"), request(*EXAMPLE, gen)), measure=False)
    assert module is not model and report.replications_left == 0, str(report)
    for num_users, num_candidates in WITHOUT_CANDIDATES:
        user, cand, mapping = args_for(Replicated("index"), request(num_users, num_candidates, gen))
        with torch.inference_mode():
            expected = model(user, cand, mapping)
            assert rel_err(module(user, cand, mapping), expected) <= RTOL, str(report)
            assert rel_err(module(user=user, cand=cand, cand_to_user=mapping), expected) <= RTOL
            assert rel_err(module(user, cand_to_user=mapping, cand=cand), expected) <= RTOL
    assert module.fallbacks == 0
    if kind == "wrapper":
        model.inner = Replicated("index").eval()
        with torch.inference_mode(), pytest.warns(UserWarning, match="changed after the pass"):
            assert torch.equal(module(user, cand, mapping), model(user, cand, mapping))


class PassingOnAndMore(nn.Module):
    """A wrapper whose forward does more than hand its positional arguments on: the pass cannot name them."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        return self.inner(*args).relu()


def test_arguments_the_pass_cannot_name_return_the_model():
    """forward(self, *args) that the pass cannot follow to named parameters: the model comes back unchanged, with a
    warning and the reason in the report (before: a ValueError that asked for an argument the caller cannot name)."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = PassingOnAndMore(Replicated("index")).eval()
    with pytest.warns(UserWarning, match=r"takes its arguments as \*args"):
        module, report = to_ikbo(model, args_for(Replicated("index"), request(*EXAMPLE, gen)), measure=False)
    assert module is model and "served unchanged" in str(report) and "*args" in str(report)


class MergedHeads(nn.Module):
    """Multi-head target attention written with bmm, the heads moved into the row dim: batch-major (rows b·h + j:
    `.transpose(1, 2).reshape(B * h, L, d)`, `.permute(0, 2, 1, 3).contiguous().view(-1, L, d)`, the mask by
    `repeat_interleave(h, 0)`) or head-major (rows j·B + b: `cat(split(x, d, dim=2), dim=0)` as DeepCTR's DSIN
    writes it, the mask by `repeat(h, 1, 1)`). "mixed" merges the query head-major and the keys batch-major (the
    original then pairs rows of other candidates: the rewrite must give the same)."""

    SPELLINGS = ("reshape", "permute", "stack", "mixed")

    def __init__(self, spell):
        super().__init__()
        self.spell = spell
        self.wq, self.wk, self.wv, self.out = nn.Linear(FC, D), nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, 1)

    def heads(self, x, spell):
        B, n, h, d = x.size(0), x.size(1), H, D // H
        if spell == "reshape":
            return x.view(B, n, h, d).transpose(1, 2).reshape(B * h, n, d)
        if spell == "permute":
            return x.view(B, n, h, d).permute(0, 2, 1, 3).contiguous().view(-1, n, d)
        return torch.cat(torch.split(x, d, dim=2), dim=0)

    def forward(self, history, ids, cand, cand_to_user):
        hist, B, h, d = history[cand_to_user], cand.size(0), H, D // H
        spell = "reshape" if self.spell == "mixed" else self.spell
        k, v = self.heads(self.wk(hist), spell), self.heads(self.wv(hist), spell)
        q = self.heads(self.wq(cand).unsqueeze(1), "stack" if self.spell == "mixed" else spell)
        scores = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(d)  # [B·h, 1, L]
        pad = (ids[cand_to_user] == 0).unsqueeze(1)
        pad = pad.repeat(h, 1, 1) if spell == "stack" else pad.repeat_interleave(h, dim=0)
        out = torch.bmm(scores.masked_fill(pad, -1e9).softmax(dim=-1), v)  # [B·h, 1, d]
        if spell == "stack":
            return self.out(torch.cat(torch.split(out, B, dim=0), dim=2).squeeze(1))
        return self.out(out.view(B, h, 1, d).transpose(1, 2).reshape(B, h * d))


@pytest.mark.parametrize("spell", MergedHeads.SPELLINGS)
def test_attention_with_heads_merged_into_rows(spell):
    """K/V projected and split into heads at U·h rows; the score and value bmm are joins (rows_matmul through the
    merged mapping); the mask's heads merged alike. Exact at other U:B (users without candidates, 1:1, U = B)."""
    mixed = spell == "mixed"
    report = check(
        MergedHeads(spell),
        sizes=[*WITHOUT_CANDIDATES, (1, 1), (6, 6)],
        expect_left=2 if mixed else 0,
        must=() if mixed else ("heads", "rows_matmul"),
    )
    if mixed:
        assert "mixes rows merged with heads with other rows" in str(report), str(report)


class _ContiguityBranch(nn.Module):
    """A branch on an input's contiguity that changes the values."""

    def forward(self, user, cand, cand_to_user):
        u = user if user.is_contiguous() else user * 2
        return (u[cand_to_user] * cand[:, :FU]).sum(-1)


class _SliceContiguityBranch(nn.Module):
    """A branch on the contiguity of a view of replicated rows: [B, 1] of [B, FU] is contiguous only where B = 1."""

    def forward(self, user, cand, cand_to_user):
        h = user[cand_to_user][:, :1]
        return cand[:, 0] * (2.0 if h.is_contiguous() else 1.0) + h[:, 0]


class _GradBranch(nn.Module):
    """A branch on whether an intermediate requires grad (grad mode and the parameters decide)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(FU, FU)

    def forward(self, user, cand, cand_to_user):
        h = self.proj(user)
        h = h if h.requires_grad else h * 3
        return (h[cand_to_user] * cand[:, :FU]).sum(-1)


@pytest.mark.parametrize("model", [_ContiguityBranch, _SliceContiguityBranch, _GradBranch])
def test_branches_on_tensor_flags_are_guarded(model):
    """The capture follows a branch on a tensor's flags (contiguity, requires_grad, ...) by the example's; a call whose
    flags would take the other branch (a transposed input, one row, grad mode on) runs the original."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = model().eval()

    def make(num_users, num_candidates):
        r = request(num_users, num_candidates, gen)
        return r["user"], r["cand"], r["cand_to_user"]

    module, _ = to_ikbo(model, make(*EXAMPLE), measure=False)
    assert isinstance(module, Guarded)
    for num_users, num_candidates in [*SIZES, (1, 1), (4, 1), (1, 9)]:
        user, cand, mapping = make(num_users, num_candidates)
        for u in (user, user.t().contiguous().t()):
            for grad in (False, True):
                with torch.set_grad_enabled(grad):
                    want, got = model(u, cand, mapping), module(u, cand, mapping)
                assert rel_err(got.detach(), want.detach()) <= RTOL, (num_users, num_candidates, grad)


def test_contiguity_branch_on_a_non_contiguous_example_is_served_unchanged():
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    r = request(*EXAMPLE, gen)
    user = r["user"].t().contiguous().t()
    module, report = to_ikbo(_ContiguityBranch().eval(), (user, r["cand"], r["cand_to_user"]), measure=False)
    assert not isinstance(module, Guarded) and "contiguity" in str(report)


GATE = {"scale": 1.0}  # a module-level setting the forward below reads


@dataclasses.dataclass
class GateConfig:
    scale: float = 1.0


class ReadsState(nn.Module):
    """A forward reading state the caller may change after the pass: a torch module's attribute, a private
    attribute, a class attribute, a dict, a list and a config object held by the model, a global, a closure cell,
    an environment variable and torch's global settings."""

    SCALE = 1.0

    def __init__(self, cell):
        super().__init__()
        self.lin, self.act, self.out = nn.Linear(FU + FC, D), nn.LeakyReLU(0.1), nn.Linear(D, 1)
        self._scale, self.weights, self.options, self.config = 1.0, [1.0], {"scale": 1.0}, GateConfig()
        self.cell = lambda: cell["scale"]

    def forward(self, user, cand, cand_to_user):
        h = self.act(self.lin(torch.cat([user[cand_to_user], cand], -1)))
        h = h * self._scale * self.SCALE * self.options["scale"] * self.config.scale * GATE["scale"] * self.cell()
        for w in self.weights:
            h = h * w
        if os.environ.get("IKBO_TEST_GATE") == "1" or torch.is_inference_mode_enabled():
            h = -h
        if torch.get_default_dtype() == torch.float64 or torch.are_deterministic_algorithms_enabled():
            h = h * 3
        return self.out(h)


@contextlib.contextmanager
def _default_float64():
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(torch.float32)


@contextlib.contextmanager
def _deterministic():
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize(
    "change",
    ["negative_slope", "private", "class", "dict", "list", "config", "global", "closure", "environ", "inference_mode",
     "default_dtype", "deterministic"],
)  # fmt: skip
def test_state_the_forward_read_is_checked_on_each_call(change, monkeypatch):
    """The graph holds what the forward read on the example; once that changes (in place too: a dict entry, a list
    appended to, a config's field) the original runs."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    cell = {"scale": 1.0}
    model = ReadsState(cell).eval()
    module, report = to_ikbo(model, args_for(model, request(*EXAMPLE, gen)), measure=False)
    assert isinstance(module, Guarded), str(report)
    monkeypatch.setattr(ReadsState, "SCALE", 1.0)
    monkeypatch.setitem(GATE, "scale", 1.0)
    context = {"inference_mode": torch.inference_mode, "default_dtype": _default_float64,
               "deterministic": _deterministic}.get(change, contextlib.nullcontext)  # fmt: skip
    changes = {
        "negative_slope": lambda: setattr(model.act, "negative_slope", 0.5),
        "private": lambda: setattr(model, "_scale", 2.0),
        "class": lambda: monkeypatch.setattr(ReadsState, "SCALE", 2.0),
        "dict": lambda: model.options.update(scale=2.0),
        "list": lambda: model.weights.append(2.0),
        "config": lambda: setattr(model.config, "scale", 2.0),
        "global": lambda: monkeypatch.setitem(GATE, "scale", 2.0),
        "closure": lambda: cell.update(scale=2.0),
        "environ": lambda: monkeypatch.setenv("IKBO_TEST_GATE", "1"),
    }
    changes.get(change, lambda: None)()
    for num_users, num_candidates in [*SIZES, (2, 90)]:
        args = args_for(model, request(num_users, num_candidates, gen))
        with torch.no_grad(), context():
            assert rel_err(module(*args), model(*args)) <= RTOL, change


class ListedRows(nn.Module):
    def forward(self, user, cand, cand_to_user):
        return user[cand_to_user].sum(-1) * cand.sum(-1) * sum(cand.sum(-1).tolist())


def test_lists_of_rows_are_not_unrolled():
    """`tolist()` of a tensor with a row count among its dims gives lists of that length: a loop over them (`sum`)
    is control flow on the row count, not followed (it was unrolled at the example's B)."""
    gen = torch.Generator().manual_seed(0)
    model = ListedRows().eval()
    module, report = to_ikbo(model, args_for(model, request(*EXAMPLE, gen)), measure=False)
    assert module is model and "number of users or candidates" in str(report), str(report)


class _FinfoMask(nn.Module):
    """Hugging Face's spelling of an additive key mask: (1 − keep) · torch.finfo(dtype).min (and iinfo beside it)."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(FC, D)

    def forward(self, history, lengths, cand, cand_to_user):
        kv = history[cand_to_user]
        q = self.q(cand)[:, None, None]
        keep = (torch.arange(kv.shape[1]) < lengths[cand_to_user][:, None]).to(q.dtype)
        mask = ((1.0 - keep) * torch.finfo(q.dtype).min)[:, None, None]
        out = F.scaled_dot_product_attention(q, kv[:, None], kv[:, None], attn_mask=mask)
        return out.flatten(1) * (torch.iinfo(cand_to_user.dtype).bits / 64)


def test_finfo_of_a_traced_dtype():
    """torch.finfo / iinfo of a traced tensor's dtype take the example's (dtypes are checked at each call)."""
    check(_FinfoMask(), must=("ikbo_attention",))


class _ProbsDropout(nn.Module):
    """Hugging Face's attention: heads split off, an additive (1 − keep) · finfo.min mask, and dropout between the
    softmax and the matmul by the values (`nn.Dropout` or `F.dropout(training=self.training)`: in eval, the identity)."""

    def __init__(self, functional):
        super().__init__()
        self.functional, self.dropout = functional, nn.Dropout(0.1)
        self.q, self.out = nn.Linear(FC, D), nn.Linear(D, 1)

    def forward(self, history, ids, cand, cand_to_user):
        keys, keep = history[cand_to_user], (ids[cand_to_user] != 0).float()
        q = self.q(cand).view(-1, 1, H, D // H).permute(0, 2, 1, 3)
        k = keys.view(keys.size()[:-1] + (H, D // H)).permute(0, 2, 1, 3)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(D // H)
        scores = scores + (1.0 - keep[:, None, None, :]) * torch.finfo(scores.dtype).min
        probs = F.softmax(scores, dim=-1)
        probs = F.dropout(probs, 0.1, training=self.training) if self.functional else self.dropout(probs)
        out = torch.matmul(probs, k).permute(0, 2, 1, 3).contiguous()
        return self.out(out.view(out.size()[:-2] + (D,)))


@pytest.mark.parametrize("functional", [False, True])
def test_dropout_in_eval_between_softmax_and_values(functional):
    """Dropout in eval between the softmax and the values is the identity: the chain still becomes ikbo_attention
    (users without history keys included)."""
    check(_ProbsDropout(functional), make=request_with_empty_histories, must=("ikbo_attention",))


class _ExpandedAsReplica(nn.Module):
    """RecBole's NARM on a replicated sequence: `mask.unsqueeze(2).expand_as(gru_out)` and
    `q2.unsqueeze(1).expand_as(q1)`, each a replica expanded to the shape of another replica."""

    def __init__(self):
        super().__init__()
        self.gru, self.a_1, self.a_2 = nn.GRU(D, D, batch_first=True), nn.Linear(D, D), nn.Linear(D, D)
        self.v_t, self.out = nn.Linear(D, 1, bias=False), nn.Linear(D + FC, 1)

    def forward(self, history, ids, cand, cand_to_user):
        gru_out, _ = self.gru(history[cand_to_user])
        mask = ids[cand_to_user].gt(0).unsqueeze(2).expand_as(gru_out)
        q1 = self.a_1(gru_out)
        q2_expand = self.a_2(gru_out[:, -1]).unsqueeze(1).expand_as(q1)
        alpha = self.v_t(mask * torch.sigmoid(q1 + q2_expand))
        return self.out(torch.cat([torch.sum(alpha.expand_as(gru_out) * gru_out, 1), cand], 1))


def test_replica_expanded_as_another_replica():
    check(_ExpandedAsReplica(), must=("GRU",))


class _Aliases(nn.Module):
    """Elementwise ops in less common spellings: aliases (`torch.clip`, `torch.multiply`, `torch.subtract`,
    `torch.true_divide`, `torch.special.expit`), pointwise ops outside the rule tables (`torch.lerp`, `torch.xlogy`,
    `torch.hypot`) and `F.glu` along the features."""

    def __init__(self):
        super().__init__()
        self.up, self.c, self.out = nn.Linear(FU, 2 * D), nn.Linear(FC, D), nn.Linear(2 * D, 1)

    def forward(self, user, cand, cand_to_user):
        u = torch.clip(F.glu(self.up(user[cand_to_user]), dim=-1), -2.0, 2.0)
        u = torch.lerp(u, torch.hypot(u, torch.xlogy(u.abs(), u.abs() + 1)), 0.3)
        g, c = torch.special.expit(torch.multiply(u, 0.5)), self.c(cand)
        return self.out(torch.cat([torch.multiply(g, c), torch.true_divide(torch.subtract(u, c), 2.0)], -1))


def test_elementwise_ops_known_by_what_they_run():
    check(_Aliases(), must=("mul of candidate rows with replicated user rows → rows_join", "add_user_rows"))


class _HardSearch(nn.Module):
    """SIM's hard search: the history positions whose category matches the candidate's, by recency; others get a
    constant (`torch.full_like` / `zeros_like` of the replicated recency) through `torch.where`, then top-k."""

    def __init__(self, fill):
        super().__init__()
        self.fill, self.out = fill, nn.Linear(D + FC, 1)

    def forward(self, history, ids, cand, cand_to_user):
        recency = torch.arange(1, L + 1).float().expand(ids.shape[0], L) * (ids > 0)
        hit = ids[cand_to_user] % 3 == (cand[:, :1] > 0).long()  # [B, L]: the candidate's category
        other = torch.full_like(recency[cand_to_user], -1.0) if self.fill else torch.zeros_like(recency[cand_to_user])
        top, idx = torch.where(hit, recency[cand_to_user], other).topk(3, dim=1)
        picked = torch.gather(history[cand_to_user], 1, idx[..., None].expand(-1, -1, D))
        return self.out(torch.cat([(picked * (top[..., None] > 0)).sum(1), cand], 1))


@pytest.mark.parametrize("fill", [True, False])
def test_where_between_a_replica_and_constant_rows(fill):
    check(_HardSearch(fill), must=("where of candidate rows with replicated user rows → rows_join",))


class _BmmAttention(nn.Module):
    """Target attention with `torch.bmm` (DeepCTR-Torch's and DSIN's spelling): scores [B, 1, L], a key mask by
    `masked_fill(-1e9)`, softmax, `bmm` by the values."""

    def __init__(self, method):
        super().__init__()
        self.method, self.q, self.out = method, nn.Linear(FC, D), nn.Linear(D, 1)

    def forward(self, history, ids, cand, cand_to_user):
        keys, q = history[cand_to_user], self.q(cand).unsqueeze(1)
        scores = q.bmm(keys.transpose(1, 2)) if self.method else torch.bmm(q, keys.transpose(1, 2))
        scores = (scores / math.sqrt(D)).masked_fill((ids[cand_to_user] == 0).unsqueeze(1), -1e9)
        weights = torch.softmax(scores, dim=-1)
        return self.out((weights.bmm(keys) if self.method else torch.bmm(weights, keys)).squeeze(1))


@pytest.mark.parametrize("method", [False, True])
def test_attention_spelled_with_bmm(method):
    check(_BmmAttention(method), make=request_with_empty_histories, must=("ikbo_attention",))


class _ModulesMadeInForward(nn.Module):
    """Modules without state made in the forward and called at once (RecBole's NextItNet `nn.ZeroPad2d(pad)(x)`,
    LightSANs' `nn.Softmax(dim=-1)(scores)`)."""

    def __init__(self):
        super().__init__()
        self.conv, self.out = nn.Conv1d(D, D, 3), nn.Linear(D + FC, 1)

    def forward(self, history, cand, cand_to_user):
        h = self.conv(nn.ConstantPad1d((2, 0), 0.0)(history[cand_to_user].transpose(1, 2)))  # [B, D, L]
        return self.out(torch.cat([(nn.Softmax(dim=-1)(h) * h).sum(-1), cand], 1))


def test_modules_made_in_the_forward():
    check(_ModulesMadeInForward(), must=("conv1d",))


@torch.jit.script
def _bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    y = x + bias
    return y * 0.5 * (1.0 + torch.erf(y / 1.41421))


class _ScriptedHelper(nn.Module):
    """A `@torch.jit.script` helper over replicated user rows (Megatron's fused bias + GeLU)."""

    def __init__(self):
        super().__init__()
        self.up, self.bias, self.out = nn.Linear(FU, D, bias=False), nn.Parameter(torch.randn(D)), nn.Linear(D + FC, 1)

    def forward(self, user, cand, cand_to_user):
        return self.out(torch.cat([_bias_gelu(self.up(user[cand_to_user]), self.bias), cand], 1))


def test_scripted_helper_functions():
    check(_ScriptedHelper(), must=("linear_rows",))


class _ParameterPieces(nn.Module):
    """Per-group weights held in one parameter and unbound along its dim 0 in a loop (FLEN's
    `zip(groups, self.r_fm.unbind(0))`)."""

    def __init__(self):
        super().__init__()
        self.w, self.out = nn.Parameter(torch.randn(2, FU // 2)), nn.Linear(FU // 2 + FC, 1)

    def forward(self, user, cand, cand_to_user):
        groups = torch.split(user[cand_to_user], FU // 2, dim=1)
        return self.out(torch.cat([sum(g * w for g, w in zip(groups, self.w.unbind(0))), cand], 1))


def test_pieces_of_a_parameter_along_dim_0():
    check(_ParameterPieces(), must=("linear_rows",))


class _FrequencyFilters(nn.Module):
    """FMLP-Rec's learnable filter (`torch.fft.rfft` over the sequence, a complex weight by `view_as_complex`,
    `irfft` back) on a replicated history; HFM's circular convolution of field pairs by FFT over a user + candidate
    concat."""

    def __init__(self):
        super().__init__()
        self.w, self.c = nn.Parameter(torch.randn(1, L // 2 + 1, D, 2)), nn.Linear(FC, D)
        self.out = nn.Linear(2 * D, 1)

    def forward(self, history, cand, cand_to_user):
        seq = history[cand_to_user]
        filtered = torch.fft.rfft(seq, dim=1, norm="ortho") * torch.view_as_complex(self.w)
        x = torch.fft.irfft(filtered, n=L, dim=1, norm="ortho") + seq
        spectra = torch.fft.rfft(torch.cat([seq[:, :3], self.c(cand).unsqueeze(1)], 1))  # [B, 4, D // 2 + 1]
        convolved = torch.fft.irfft(spectra[:, [0, 0, 1, 2]] * spectra[:, [1, 3, 3, 3]], n=D)
        return self.out(torch.cat([x.mean(1), convolved.sum(1)], -1))


def test_fourier_transforms_along_other_dims_than_the_rows():
    check(_FrequencyFilters(), must=("fft_rfft", "rows_join"))


class _WhereWithNumbers(nn.Module):
    """Per-candidate gating of user features by `torch.where` with a number or a 0-dim buffer on the other side."""

    def __init__(self):
        super().__init__()
        self.up, self.out = nn.Linear(FU, D), nn.Linear(D + FC, 1)
        self.register_buffer("fill", torch.tensor(-1.0))

    def forward(self, user, cand, cand_to_user):
        u = self.up(user)[cand_to_user]
        gated = torch.where(cand[:, :1] > 0, u, 0.0) + torch.where(cand[:, 1:2] > 1, self.fill, u)
        return self.out(torch.cat([gated, cand], 1))


def test_where_between_a_replica_and_a_number():
    check(_WhereWithNumbers(), must=("where of candidate rows with replicated user rows → rows_join",))


class TakesMore(nn.Module):
    """`Replicated("index")` whose forward also takes `*rest` or `**options` (a temperature the caller may pass)."""

    def __init__(self, kind):
        super().__init__()
        self.inner, self.kind = Replicated("index"), kind

    def forward(self, user, cand, cand_to_user, *rest, **options):
        out = self.inner(user, cand, cand_to_user) * options.get("temperature", 1.0)
        return out + sum(rest) if self.kind == "rest" else out


@pytest.mark.parametrize("kind", ["rest", "options"])
def test_forward_with_variadic_arguments_left_empty(kind):
    """A forward with `*rest` / `**options` the example leaves empty is traced with them empty: the graph takes the
    named arguments, and a call passing more runs the original (before: fx made a placeholder of `**options` that the
    rewritten graph then required positionally, and the pass raised TypeError on its own check)."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = TakesMore(kind).eval()
    module, report = to_ikbo(model, args_for(Replicated("index"), request(*EXAMPLE, gen)), measure=False)
    assert module is not model and report.replications_left == 0, str(report)
    for num_users, num_candidates in WITHOUT_CANDIDATES:
        args = args_for(Replicated("index"), request(num_users, num_candidates, gen))
        with torch.inference_mode():
            assert rel_err(module(*args), model(*args)) <= RTOL, str(report)
    assert module.fallbacks == 0
    more = (torch.tensor(2.0),) if kind == "rest" else ()
    with torch.inference_mode():
        assert torch.equal(module(*args, *more, temperature=0.5), model(*args, *more, temperature=0.5))
    assert module.fallbacks == 1
    if kind == "rest":  # an example that fills `*rest`: a tuple argument, its entries checked at each call
        example = (*args_for(Replicated("index"), request(*EXAMPLE, gen)), torch.tensor(2.0))
        module = to_ikbo(model, example, measure=False)[0]
        assert module is not model
        with torch.inference_mode():
            for more in [(torch.tensor(3.0),), (), (torch.tensor(1.0), torch.tensor(2.0))]:
                assert rel_err(module(*args, *more), model(*args, *more)) <= RTOL
        assert module.fallbacks == 2


class UnpacksATuple(nn.Module):
    """`Replicated("index")` called with its user features given as a tuple argument and unpacked (`f(*features)`),
    or iterated (`for x in features`)."""

    def __init__(self, loop):
        super().__init__()
        self.inner, self.loop = Replicated("index"), loop

    def forward(self, features, cand, cand_to_user):
        user = torch.cat([x for x in features], dim=1) if self.loop else torch.cat([*features], dim=1)
        return self.inner(user, cand, cand_to_user)


@pytest.mark.parametrize("loop", [False, True])
def test_tuple_arguments_unpacked(loop):
    """The length of a tuple or list argument is its structure, which `Guarded` checks on each call (before: unpacking
    or iterating it was taken for control flow on tensor values and the model came back unchanged)."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = UnpacksATuple(loop).eval()

    def args(num_users, num_candidates, container=tuple):
        user, cand, mapping = args_for(Replicated("index"), request(num_users, num_candidates, gen))
        return container(user.split([2, FU - 2], dim=1)), cand, mapping

    module, report = to_ikbo(model, args(*EXAMPLE), measure=False)
    assert module is not model and report.replications_left == 0, str(report)
    for num_users, num_candidates in WITHOUT_CANDIDATES:
        call = args(num_users, num_candidates)
        with torch.inference_mode():
            assert rel_err(module(*call), model(*call)) <= RTOL, str(report)
    assert module.fallbacks == 0
    features, cand, mapping = args(*SIZES[0], container=list)  # another container, another length: the original
    with torch.inference_mode():
        assert torch.equal(module(features, cand, mapping), model(features, cand, mapping))
        longer = (*features, features[0][:, :0])
        assert torch.equal(module(longer, cand, mapping), model(longer, cand, mapping))
    assert module.fallbacks == 2


@dataclasses.dataclass
class UserFeatures:
    dense: torch.Tensor


class TakesADataclass(nn.Module):
    """`Replicated("index")` with its user features inside an argument object (a dataclass, or another object)."""

    def __init__(self):
        super().__init__()
        self.inner = Replicated("index")

    def forward(self, user: UserFeatures, cand, cand_to_user):
        return self.inner(user.dense, cand, cand_to_user)


def test_unfollowed_argument_is_the_reason_given():
    """An argument the pass cannot follow (an object of tensors that is no dataclass) is the reason the model comes
    back unchanged (before: the tensors inside it went uncounted, and the report and a warning said that every tensor
    had B rows)."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = TakesADataclass().eval()
    user, cand, mapping = args_for(Replicated("index"), request(*EXAMPLE, gen))
    module, report = to_ikbo(model, (types.SimpleNamespace(dense=user), cand, mapping), measure=False)
    assert module is model and "`user` (SimpleNamespace)" in str(report) and "B = " not in str(report), str(report)


class GatedByUser(nn.Module):
    """Candidate features gated by their user's (a `rows_join` product), then a head."""

    def __init__(self):
        super().__init__()
        self.user, self.cand, self.head = nn.Linear(FU, D), nn.Linear(FC, D), nn.Linear(D, 1)

    def forward(self, user, cand, cand_to_user):
        return self.head(self.user(user)[cand_to_user].sigmoid() * self.cand(cand)).squeeze(-1)


def test_gradients_are_the_originals():
    """Called with grad on, where the model's parameters or an input require grad, the original runs: the gradients
    with respect to candidate features and parameters are the original's (before: the rewrite ran, and a backward
    through its tiled join raised "no autograd formula"); without grad the rewrite runs."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = GatedByUser().eval()
    module, report = to_ikbo(model, args_for(model, request(*EXAMPLE, gen)), measure=False)
    assert module is not model and report.replications_left == 0, str(report)
    for num_users, num_candidates in SIZES:
        user, cand, mapping = args_for(model, request(num_users, num_candidates, gen))
        cand.requires_grad_()
        grads = []
        for m in (model, module):
            model.zero_grad()
            cand.grad = None
            m(user, cand, mapping).square().sum().backward()
            grads.append([cand.grad, *(p.grad for p in model.parameters())])
        assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert module.warned_grad  # told once why the original ran
    with torch.no_grad():
        assert rel_err(module(user, cand, mapping), model(user, cand, mapping)) <= RTOL
    assert module.fallbacks == len(SIZES)


def test_deep_copies_of_a_rewrite():
    """`copy.deepcopy` of a rewrite (a weight split at the pass among its constants) serves the rewrite, watches its
    own copy of the model (new weights loaded into it run the original there only), and a copy made after the model
    changed runs the original (before: deepcopy raised, the split weight holding its parameter's autograd graph)."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = Replicated("index").eval()
    module, report = to_ikbo(model, args_for(model, request(*EXAMPLE, gen)), measure=False)
    assert module is not model and report.replications_left == 0, str(report)
    twin = copy.deepcopy(module)
    args = args_for(model, request(*SIZES[0], gen))
    with torch.inference_mode():
        assert rel_err(twin(*args), model(*args)) <= RTOL and twin.fallbacks == 0
    other = Replicated("index").eval()
    twin.original.load_state_dict(other.state_dict())
    with torch.inference_mode(), pytest.warns(UserWarning, match="changed after the pass"):
        assert torch.equal(twin(*args), other(*args))
    with torch.inference_mode():
        assert rel_err(module(*args), model(*args)) <= RTOL and module.fallbacks == 0
    stale = copy.deepcopy(twin)
    with torch.inference_mode():
        assert torch.equal(stale(*args), other(*args)) and stale.fallbacks == twin.fallbacks + 1


class GatedByUserDict(nn.Module):
    """GatedByUser over a dict of features, the mapping among them."""

    def __init__(self):
        super().__init__()
        self.inner = GatedByUser()

    def forward(self, features):
        return {"score": self.inner(features["user"], features["cand"], features["cand_to_user"])}


def test_saved_and_loaded_rewrites(tmp_path):
    """`torch.save` / `torch.load` and `pickle` of a rewrite (a GraphModule pickles as its code, which its loading
    traces again) serve the rewrite after loading, its outputs the model's, watching the loaded model (new weights
    loaded into it run the original); one saved after its model changed runs the original (before: saving raised
    "cannot pickle 'module' object", and a GraphModule saved alone failed to load: "Proxy object cannot be iterated")."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    for model, wrap in (
        (GatedByUser().eval(), lambda a: a),
        (GatedByUserDict().eval(), lambda a: (dict(zip(("user", "cand", "cand_to_user"), a)),)),
    ):
        make = lambda u, b: wrap(args_for(GatedByUser(), request(u, b, gen)))  # noqa: E731
        module, report = to_ikbo(model, make(*EXAMPLE), measure=False)
        assert isinstance(module, Guarded) and report.replications_left == 0, str(report)
        torch.save(module, tmp_path / "module.pt")
        for loaded in (torch.load(tmp_path / "module.pt", weights_only=False), pickle.loads(pickle.dumps(module))):
            for num_users, num_candidates in SIZES:
                args = make(num_users, num_candidates)
                with torch.inference_mode():
                    got, expected = loaded(*args), model(*args)
                assert rel_err(tree_flatten(got)[0][0], tree_flatten(expected)[0][0]) <= RTOL
            assert loaded.fallbacks == 0
            other = type(model)().eval()
            loaded.original.load_state_dict(other.state_dict())
            with torch.inference_mode(), pytest.warns(UserWarning, match="changed after the pass"):
                assert torch.equal(tree_flatten(loaded(*args))[0][0], tree_flatten(other(*args))[0][0])
            stale = pickle.loads(pickle.dumps(loaded))
            with torch.inference_mode():
                assert torch.equal(tree_flatten(stale(*args))[0][0], tree_flatten(other(*args))[0][0])
            assert stale.fallbacks == loaded.fallbacks + 1


def test_grad_mode_runs_the_original_without_reading_the_model():
    """Called with grad on and a parameter requiring grad, `Guarded` runs the original without first reading the
    model's state for changes (a per-call cost that grows with the modules, about 1.5 µs each on one CPU thread;
    before: read at every such call, though the original runs either way); without grad it reads it."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = GatedByUser().eval()
    module, _ = to_ikbo(model, args_for(model, request(*EXAMPLE, gen)), measure=False)
    args = args_for(model, request(*SIZES[0], gen))
    reads = []
    state = module._state
    module._state = lambda: reads.append(1) or state()
    with pytest.warns(UserWarning, match="grad enabled"):
        assert torch.equal(module(*args), model(*args))
    assert not reads and module.fallbacks == 1
    with torch.no_grad():
        assert rel_err(module(*args), model(*args)) <= RTOL
    assert reads and module.fallbacks == 1


def test_pass_under_autocast_judges_in_its_dtype():
    """A pass run under `torch.autocast` checks the rewrite within the autocast dtype's tolerance, as for a 16-bit
    model (before: fp32's 1e-3, so bf16 rounding of the re-associated sums read as a disagreement and the model came
    back unchanged with that reason); under autocast the rewrite gives the original's dtype and values to bf16 rounding,
    without it fp32's."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = Replicated("index").eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        module, report = to_ikbo(model, args_for(model, request(*EXAMPLE, gen)), measure=False)
    assert module is not model and report.replications_left == 0, str(report)
    for num_users, num_candidates in SIZES:
        args = args_for(model, request(num_users, num_candidates, gen))
        with torch.inference_mode():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                got, expected = module(*args), model(*args)
            assert got.dtype == expected.dtype and rel_err(got.float(), expected.float()) <= 2e-2
            assert rel_err(module(*args), model(*args)) <= RTOL
    assert module.fallbacks == 0


class HalfHead(nn.Module):
    """A head that runs under bf16 autocast (a decorated forward, a mixed-precision tower)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(D, 1)

    @torch.autocast("cpu", dtype=torch.bfloat16)
    def forward(self, x):
        return self.net(x).float()


class AutocastRegions(nn.Module):
    """`GatedByUser` with its head under autocast, or its whole forward in a `with torch.autocast` block."""

    def __init__(self, whole):
        super().__init__()
        self.inner, self.whole = GatedByUser(), whole
        self.inner.head = HalfHead()

    def forward(self, user, cand, cand_to_user):
        if not self.whole:
            return self.inner(user, cand, cand_to_user)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.inner(user, cand, cand_to_user)


@pytest.mark.parametrize("whole", [False, True])
def test_autocast_regions_are_kept(whole):
    """The graph would not keep a `torch.autocast` region the forward enters: a module entering one is kept whole (the
    rest rewritten), a model whose own forward does comes back unchanged, with that reason (before: the trace ran the
    region in bf16 but the graph had no autocast, the rewrite computed fp32 and disagreed, and the whole model came
    back unchanged, reported as a disagreement)."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = AutocastRegions(whole).eval()
    module, report = to_ikbo(model, args_for(model, request(*EXAMPLE, gen)), measure=False)
    assert "enters torch.autocast" in str(report) and "disagrees" not in str(report), str(report)
    assert (module is model) == whole, str(report)
    for num_users, num_candidates in SIZES:
        args = args_for(model, request(num_users, num_candidates, gen))
        with torch.inference_mode():
            assert rel_err(module(*args), model(*args)) <= RTOL, str(report)


class GraphModuleNames(nn.Module):
    """A meta-learner's `self.meta` making per-user weights, a `self.graph` tower over the candidates, a parameter
    named `code`: names a torch.fx GraphModule uses itself."""

    def __init__(self):
        super().__init__()
        self.meta = nn.Linear(FU, D * 4)
        self.graph = nn.Linear(FC, D)
        self.code = nn.Parameter(torch.randn(4))

    def forward(self, user, cand, cand_to_user):
        w = self.meta(user).view(-1, D, 4)[cand_to_user]
        return torch.bmm(self.graph(cand)[:, None], w)[:, 0] @ self.code


def test_submodules_named_like_graph_module_attributes():
    """Submodules and parameters called `meta`, `graph` or `code` are captured like any other (before: the capture's
    GraphModule copied them, then set its own `meta` / `graph` over them, the capture failed and the model came back
    unchanged)."""
    check(GraphModuleNames(), sizes=WITHOUT_CANDIDATES)


class PrependedToken(nn.Module):
    """A learned token prepended to every user's history (an attention sink, a CLS token): K / V are
    `cat([token.expand(B, 1, D), history[m]], 1)`, the key mask `cat([keep.new_ones(B, 1), keep], 1)`."""

    def __init__(self):
        super().__init__()
        self.sink_k = nn.Parameter(torch.randn(1, 1, D))
        self.sink_v = nn.Parameter(torch.randn(1, 1, D))
        self.q = nn.Linear(FC, D)

    def forward(self, history, lengths, cand, cand_to_user):
        h = history[cand_to_user]
        num_candidates = cand.shape[0]
        k = torch.cat([self.sink_k.expand(num_candidates, -1, -1), h], 1)
        v = torch.cat([self.sink_v.expand(num_candidates, -1, -1), h], 1)
        keep = (torch.arange(L)[None] < lengths[:, None])[cand_to_user]
        keep = torch.cat([keep.new_ones(num_candidates, 1), keep], 1)
        return F.scaled_dot_product_attention(self.q(cand)[:, None], k, v, attn_mask=keep[:, None])[:, 0]


def test_constant_token_prepended_to_a_replica():
    """One constant row expanded to B rows beside replicated user rows in a cat along another dim, and a mask made
    at the candidate count by `new_ones` of a replica, are constant user rows: the cat runs at U rows and the
    attention is `ikbo_attention` (before: the token was a Rep through its own expand mapping, the cat mixed two
    mappings, K, V and the mask were replicated, reported as attention over user and candidate tokens)."""
    check(PrependedToken(), sizes=WITHOUT_CANDIDATES)


class FieldsReshaped(nn.Module):
    """DHEN / HiFormer over a field matrix X = cat([user fields[m], candidate fields], 1): the row count unpacked from
    X's own shape (`B, nf, d = X.shape; X.reshape(B, -1)`), and a projection of the flattened fields viewed back
    as X (`composite(X.flatten(1)).view_as(X)`)."""

    def __init__(self, view_as):
        super().__init__()
        self.view_as = view_as
        self.user_fields = nn.Linear(FU, 3 * D)
        self.cand_fields = nn.Linear(FC, 2 * D)
        self.composite = nn.Linear(5 * D, 5 * D)
        self.head = nn.Linear(5 * D, 1)

    def forward(self, user, cand, cand_to_user):
        x = torch.cat([self.user_fields(user).view(-1, 3, D)[cand_to_user], self.cand_fields(cand).view(-1, 2, D)], 1)
        if self.view_as:
            x = x * torch.sigmoid(self.composite(x.flatten(1)).view_as(x))
        num_candidates, num_fields, width = x.shape
        return self.head(torch.relu(x).reshape(num_candidates, -1)).view(num_candidates, num_fields * 0 + 1)


@pytest.mark.parametrize("view_as", [False, True])
def test_view_of_a_field_concat_by_its_own_shape(view_as):
    """`x.shape[0]` of a user + candidate concat is a candidate count, so `x.reshape(B, -1)` with B unpacked from it
    flattens per part; `y.view_as(concat)` reads the concat's shape only (before: the shape's B was not known as a
    row count and `view_as` took the concat for an operand: both replicated the user fields, reported)."""
    check(FieldsReshaped(view_as), sizes=WITHOUT_CANDIDATES)


class ConstantKeyMask(nn.Module):
    """SDPA with a key mask that has no rows: a boolean buffer of [L] (positions never attended), or an additive
    [1, 1, 1, L] with −inf, the same for every candidate."""

    def __init__(self, additive):
        super().__init__()
        self.additive = additive
        valid = torch.arange(L) < L - 2
        valid[1] = False
        self.register_buffer("valid", valid)
        self.q = nn.Linear(FC, D)

    def forward(self, history, cand, cand_to_user):
        k, q = history[cand_to_user], self.q(cand)[:, None]
        if not self.additive:
            return F.scaled_dot_product_attention(q, k, k, attn_mask=self.valid)[:, 0]
        mask = torch.zeros(L).masked_fill(~self.valid, float("-inf")).view(1, 1, 1, L)
        return F.scaled_dot_product_attention(q[:, None], k[:, None], k[:, None], attn_mask=mask)[:, 0, 0]


@pytest.mark.parametrize("additive", [False, True])
def test_key_mask_without_rows(additive):
    """A key mask without rows is every user's one key mask: `ikbo_attention` with the kept keys moved first (before:
    not a per-user key mask, so K / V were replicated, reported)."""
    check(ConstantKeyMask(additive), sizes=WITHOUT_CANDIDATES, must=["ikbo_attention"])


def jagged_request(num_users, num_candidates, gen):
    """A user history as jagged values [N, D] (and ids [N]) with offsets [U + 1], nothing else at U rows; some users
    without history (a segment of length 0), candidates [B, FC] and an unsorted mapping; N ≠ U, B, D."""
    lengths = torch.randint(0, L + 1, (num_users,), generator=gen)
    lengths[torch.rand(num_users, generator=gen) < 0.2] = 0
    while int(lengths.sum()) in (num_users, num_candidates, D):  # rows tell tensors apart, and N ≠ the width D a
        lengths[lengths.argmin()] += 1  # branch reads
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    n = int(offsets[-1])
    return dict(
        values=torch.randn(n, D, generator=gen),
        ids=torch.randint(0, 50, (n,), generator=gen),
        offsets=offsets,
        cand=torch.randn(num_candidates, FC, generator=gen),
        cand_to_user=torch.randint(0, num_users, (num_candidates,), generator=gen),
    )


class JaggedOnly(nn.Module):
    """A user history that arrives only as jagged values + offsets [U + 1], in the spellings jagged code uses: pooled
    by segment ids (`repeat_interleave(arange(U), lengths)` + `index_add_`), by `segment_reduce`, by an `EmbeddingBag`
    over offsets, or padded to [U, L, D] by `index_put` and read by a target attention over `padded[cand_to_user]`;
    a branch on the values' width (a size other than the rows)."""

    def __init__(self, pool):
        super().__init__()
        self.pool = pool
        self.bag = nn.EmbeddingBag(50, D, mode="sum")
        self.user, self.q = nn.Linear(D, D), nn.Linear(FC, D)
        self.out = nn.Sequential(nn.Linear(D + FC, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, values, ids, offsets, cand, cand_to_user):
        if values.shape[-1] != D:
            raise ValueError("values: expected width D")
        num_users = offsets.shape[0] - 1
        lengths = offsets[1:] - offsets[:-1]
        if self.pool == "bag":
            pooled = self.user(self.bag(ids, offsets[:-1]))[cand_to_user]
        elif self.pool == "segment_reduce":
            pooled = self.user(torch.segment_reduce(values, "sum", offsets=offsets, axis=0))[cand_to_user]
        else:
            segment = torch.repeat_interleave(torch.arange(num_users), lengths)
            if self.pool == "index_add":
                sums = values.new_zeros(num_users, D).index_add_(0, segment, values)
                pooled = self.user(sums / lengths.clamp(min=1)[:, None])[cand_to_user]
            else:  # padded, then target attention over each candidate's user's history
                padded = values.new_zeros(num_users, L, D)
                padded[segment, torch.arange(values.shape[0]) - offsets[segment]] = values
                history = self.user(padded)[cand_to_user]
                keep = (torch.arange(L)[None, :] < lengths[:, None])[cand_to_user]
                scores = (history @ self.q(cand)[:, :, None]).squeeze(-1) / D**0.5
                weights = scores.masked_fill(~keep, -1e9).softmax(-1)
                pooled = (weights[:, :, None] * history).sum(1)
        return self.out(torch.cat([pooled, cand], 1))


@pytest.mark.parametrize("pool", ["index_add", "segment_reduce", "bag", "padded"])
def test_jagged_only_user_inputs(pool):
    """Nothing at U rows but the offsets [U + 1]: U is the offsets' count of segments, the values' count N counts for
    no rows (before: U was taken as N or U + 1, the model came back unchanged and the report named that U). Each
    call's N and U + 1 are free (the branch on the width checks the width alone)."""
    model = JaggedOnly(pool)
    report = check(model, make=jagged_request, sizes=WITHOUT_CANDIDATES, must=("U = 5", "jagged offsets `offsets`"))
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    module, _ = to_ikbo(model, args_for(model, jagged_request(*EXAMPLE, gen)), measure=False)
    for num_users, num_candidates in [*WITHOUT_CANDIDATES, (4, 0)]:
        args = args_for(model, jagged_request(num_users, num_candidates, gen))
        with torch.inference_mode():
            assert rel_err(module(*args), model(*args)) <= RTOL, str(report)
    assert module.fallbacks == 1, str(report)  # B = 0 only


def test_jagged_offsets_length_equal_to_a_width():
    """An example with U + 1 = D (15 users, the serving example's U, and values of width 16): the branch on the values'
    width reads no row count (it is read from the values, not computed from the offsets), so the model is rewritten."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = JaggedOnly("padded").eval()
    assert D == 15 + 1
    module, report = to_ikbo(model, args_for(model, jagged_request(15, 64, gen)), measure=False)
    assert isinstance(module, Guarded) and report.replications_left == 0, str(report)
    args = args_for(model, jagged_request(7, 53, gen))
    with torch.inference_mode():
        assert rel_err(module(*args), model(*args)) <= RTOL, str(report)
    assert module.fallbacks == 0


class JaggedLoop(nn.Module):
    """Jagged values pooled by a Python loop over the users' segments."""

    def __init__(self):
        super().__init__()
        self.out = nn.Linear(D + FC, 1)

    def forward(self, values, ids, offsets, cand, cand_to_user):
        pooled = torch.stack([values[offsets[i] : offsets[i + 1]].sum(0) for i in range(len(offsets) - 1)])
        return self.out(torch.cat([pooled[cand_to_user], cand], 1))


def test_jagged_only_left_names_u_and_why():
    """Where a jagged-only model cannot be rewritten (a loop over the users' segments: control flow on U + 1, the
    offsets' rows), the report names the U of the offsets and that reason (before: U taken as the values' count N and
    "nothing to rewrite")."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = JaggedLoop().eval()
    module, report = to_ikbo(model, args_for(model, jagged_request(*EXAMPLE, gen)), measure=False)
    assert module is model, str(report)
    assert f"U = {EXAMPLE[0]}, B = {EXAMPLE[1]}" in str(report), str(report)
    assert "control flow on the number of users" in str(report), str(report)


class FlatViewBack(nn.Module):
    """HSTU / DSIN-style: the replicated history x = history[cand_to_user] [B, L, D] flattened to B·L rows, row-wise
    work on them (a layer norm, `mm` by a weight, SiLU, a split), then viewed back to B rows in every common spelling
    (`view(B, L, …)`, `view(-1, L, …)`, `reshape(x.shape)`, `unflatten(0, (-1, L))`, `view(B, -1)`, [B, L, H, d]) and
    read with the candidate (an SDPA with candidate queries, a product, a gate)."""

    def __init__(self, spell):
        super().__init__()
        self.spell = spell
        self.uvk = nn.Parameter(torch.randn(D, 3 * D) * 0.2)
        self.q, self.o, self.out = nn.Linear(FC, D), nn.Linear(D, D), nn.Linear(D + FC, 1)

    def forward(self, history, cand, cand_to_user):
        x = history[cand_to_user]
        b, length, width = x.shape
        flat = x.flatten(0, 1) if self.spell == "flatten" else x.reshape(-1, width)
        u, v, k = F.silu(torch.mm(F.layer_norm(flat, [width]), self.uvk)).split(width, dim=1)
        if self.spell == "unflatten":  # v by the model's L: at another history length it groups other rows
            k, v, u = k.unflatten(0, (-1, length)), v.unflatten(0, (-1, L)), u.unflatten(0, (b, length))
        elif self.spell == "shape":
            k, v, u = k.reshape(x.shape), v.reshape(x.size()), u.reshape(b, length, width)
        else:
            k, v, u = k.view(b, length, width), v.view(-1, L, width), u.reshape(b, -1).view(b, length, width)
        heads = lambda t: t.reshape(b, length, H, width // H).transpose(1, 2)  # noqa: E731
        q = self.q(cand).view(b, H, 1, width // H)
        attended = F.scaled_dot_product_attention(q, heads(k), heads(v)).reshape(b, width)
        return self.out(torch.cat([self.o(attended * u.mean(1)), cand], 1))


@pytest.mark.parametrize("spell", ["view", "flatten", "shape", "unflatten"])
def test_flattened_replica_viewed_back(spell):
    """The flattened replica stays at U·L rows through the row-wise ops, and its view back to B rows is the replica of
    the user rows viewed alike (before: the view back materialized the replica at B·L rows: "it mixes rows merged
    with heads with other rows" / "view is not known to act row by row"). A call whose history has another length
    (L / 2, an even B) runs the rewrite where every view back reads the length from a shape, and the original where
    one views by the model's L (`v.view(-1, L, D)` then groups two candidates' rows in one: each call checks the
    view groups the rows by candidate)."""
    model = FlatViewBack(spell)
    check(model, sizes=WITHOUT_CANDIDATES, must=("back to B rows", "ikbo_attention"))
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    module, report = to_ikbo(model, args_for(model, request(*EXAMPLE, gen)), measure=False)
    r = request(8, 54, gen)
    r["history"] = torch.randn(8, L // 2, D, generator=gen)
    args = args_for(model, r)
    with torch.inference_mode():
        assert rel_err(module(*args), model(*args)) <= RTOL, str(report)
    assert module.fallbacks == (spell != "shape"), str(report)


class KeywordOnlyMapping(nn.Module):
    """`Replicated("index")` whose forward takes the mapping (and a scale before it, with a default) by keyword only."""

    def __init__(self):
        super().__init__()
        self.inner = Replicated("index")

    def forward(self, user, cand, *, scale=1.0, cand_to_user):
        return self.inner(user, cand, cand_to_user) * scale


def test_keyword_only_mapping():
    """A keyword-only mapping is given by name (`example_kwargs`) and the module is called as the model is (before:
    example inputs were positional only, so such a model could not be passed at all). A call with the scale away
    from its default, or the mapping passed by position (a TypeError in the original too), runs the original; an
    example without the mapping names the argument and where to pass it."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = KeywordOnlyMapping().eval()
    user, cand, mapping = args_for(Replicated("index"), request(*EXAMPLE, gen))
    module, report = to_ikbo(model, (user, cand), measure=False, example_kwargs={"cand_to_user": mapping})
    assert isinstance(module, Guarded) and report.replications_left == 0, str(report)
    for num_users, num_candidates in WITHOUT_CANDIDATES:
        user, cand, mapping = args_for(Replicated("index"), request(num_users, num_candidates, gen))
        with torch.inference_mode():
            assert rel_err(module(user, cand, cand_to_user=mapping), model(user, cand, cand_to_user=mapping)) <= RTOL
            by_name = module(cand_to_user=mapping, cand=cand, user=user)
            assert rel_err(by_name, model(user, cand, cand_to_user=mapping)) <= RTOL
        assert replications_in(lambda *a: module(*a[:2], cand_to_user=a[2]), (user, cand, mapping), num_users,
                               num_candidates) == []  # fmt: skip
    assert module.fallbacks == 0
    with torch.inference_mode():
        assert torch.equal(
            module(user, cand, cand_to_user=mapping, scale=2.0), model(user, cand, cand_to_user=mapping, scale=2.0)
        )
        with pytest.raises(TypeError):
            module(user, cand, mapping)
    assert module.fallbacks == 2
    with pytest.raises(ValueError, match="keyword-only `cand_to_user`: pass it by name, in example_kwargs"):
        to_ikbo(model, (user, cand, mapping), measure=False)


@dataclasses.dataclass(frozen=True)
class RankingRequest:
    """A request as a dataclass: user and candidate tensors, the mapping, a setting, a property and a method."""

    user: torch.Tensor
    cand: torch.Tensor
    cand_to_user: torch.Tensor
    temperature: float = 1.0

    @property
    def num_candidates(self):
        return self.cand.shape[0]

    def user_rows(self):
        return self.user[self.cand_to_user]


@dataclasses.dataclass(frozen=True)
class OtherRequest(RankingRequest):
    pass


class TakesARequest(nn.Module):
    """An MLP over a dataclass request, its mapping inside, read through the class's method and property."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FU + FC, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, req: RankingRequest):
        if not isinstance(req, RankingRequest):
            raise TypeError("req: expected a RankingRequest")
        return (self.net(torch.cat([req.user_rows(), req.cand], 1)) / req.temperature).view(req.num_candidates)


def test_dataclass_inputs():
    """Dataclass arguments holding tensors are followed as dicts of their fields: one with the mapping inside (read by
    the class's own method), and one holding user features beside a mapping argument (before: both came back
    unchanged, "non-tensor arguments of other types" / "has no argument named cand_to_user"). A call whose setting
    field differs from the example's, or of another class, runs the original."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = TakesARequest().eval()
    module, report = to_ikbo(
        model, (RankingRequest(*args_for(Replicated("index"), request(*EXAMPLE, gen))),), measure=False
    )
    assert isinstance(module, Guarded) and report.replications_left == 0 and "kept virtual" in str(report), str(report)
    for num_users, num_candidates in WITHOUT_CANDIDATES:
        req = RankingRequest(*args_for(Replicated("index"), request(num_users, num_candidates, gen)))
        with torch.inference_mode():
            assert rel_err(module(req), model(req)) <= RTOL, str(report)
            assert rel_err(module(req=req), model(req)) <= RTOL, str(report)
        assert replications_in(module, (req,), num_users, num_candidates) == [], str(report)
    assert module.fallbacks == 0
    with torch.inference_mode():
        other = dataclasses.replace(req, temperature=2.0)
        assert torch.equal(module(other), model(other))
        other = OtherRequest(req.user, req.cand, req.cand_to_user)
        assert torch.equal(module(other), model(other))
    assert module.fallbacks == 2

    model = TakesADataclass().eval()
    user, cand, mapping = args_for(Replicated("index"), request(*EXAMPLE, gen))
    module, report = to_ikbo(model, (UserFeatures(user), cand, mapping), measure=False)
    assert isinstance(module, Guarded) and report.replications_left == 0, str(report)
    for num_users, num_candidates in WITHOUT_CANDIDATES:
        user, cand, mapping = args_for(Replicated("index"), request(num_users, num_candidates, gen))
        with torch.inference_mode():
            assert rel_err(module(UserFeatures(user), cand, mapping), model(UserFeatures(user), cand, mapping)) <= RTOL
    assert module.fallbacks == 0


class MappingInKeywords(nn.Module):
    """`Replicated("index")` whose forward takes the mapping (and an optional temperature) through `**kwargs`, as
    request wrappers pass extra features: `kwargs["cand_to_user"]`, `kwargs.get("temperature", 1.0)`."""

    def __init__(self):
        super().__init__()
        self.inner = Replicated("index")

    def forward(self, user, cand, **kwargs):
        return self.inner(user, cand, kwargs["cand_to_user"]) / kwargs.get("temperature", 1.0)


@pytest.mark.parametrize("temperature", [None, 2.0])
def test_mapping_inside_keyword_arguments(temperature):
    """A mapping passed in `**kwargs` (example_kwargs) is followed as a dict's entry (before: fx's placeholder of
    `**kwargs` had no example value, and the model came back unchanged with "'NoneType' object is not
    subscriptable"); a call with other keys (one more, one less) runs the original."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = MappingInKeywords().eval()
    extra = {} if temperature is None else {"temperature": temperature}
    user, cand, mapping = args_for(Replicated("index"), request(*EXAMPLE, gen))
    module, report = to_ikbo(model, (user, cand), measure=False, example_kwargs={"cand_to_user": mapping, **extra})
    assert isinstance(module, Guarded) and report.replications_left == 0, str(report)
    for num_users, num_candidates in WITHOUT_CANDIDATES:
        user, cand, mapping = args_for(Replicated("index"), request(num_users, num_candidates, gen))
        with torch.inference_mode():
            got = module(user, cand, cand_to_user=mapping, **extra)
            assert rel_err(got, model(user, cand, cand_to_user=mapping, **extra)) <= RTOL
        assert replications_in(lambda *a: module(*a[:2], cand_to_user=a[2], **extra), (user, cand, mapping),
                               num_users, num_candidates) == []  # fmt: skip
    assert module.fallbacks == 0
    other = {"temperature": 3.0} if temperature is None else {}
    with torch.inference_mode():
        want = model(user, cand, cand_to_user=mapping, **other)
        assert torch.equal(module(user, cand, cand_to_user=mapping, **other), want)
    assert module.fallbacks == 1
