"""The attention benchmark's problems (scripts/bench_attention.py): shapes, inputs, the formulations the ops are
compared with (K/V replicated to B rows + SDPA, packed equal-count SDPA, FlexAttention), their fp64 references, and
the cases (providers side by side for `harness.Bench`): the forward at the canonical shape, self + target, the
sweep; forward + backward (`train_cases`, `train_sweep_case`).

Import it after the benchmark has chosen Triton's interpreter or not: it imports `kernels`, which builds its kernels
at import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ikbo_backend.perf.harness import Case, Provider, nan_like
from kernels import attention, attention_ws, ikbo_attention, ikbo_self_target_attention
from kernels.configs import TileConfig


@dataclass(frozen=True)
class Shape:
    num_users: int  # U
    num_candidates: int  # B
    num_queries: int  # S
    seq_len: int  # L
    heads: int  # H
    head_dim: int  # d

    def flops(self, target=True, causal_self=False) -> float:
        """4·B·H·S·L·d of the target attention + 4·U·H·L(L+1)/2·d of the causal self-attention (where asked)."""
        pairs = target * self.num_candidates * self.num_queries * self.seq_len  # query-key pairs per head
        pairs += causal_self * self.num_users * self.seq_len * (self.seq_len + 1) / 2
        return 4.0 * self.heads * self.head_dim * pairs

    def min_bytes(self, itemsize: int, with_self=False) -> float:
        """q and out once, K/V once per user (and user_q, user_out with self-attention)."""
        rows = 2 * self.num_candidates * self.num_queries + (4 if with_self else 2) * self.num_users * self.seq_len
        return float(itemsize * self.heads * self.head_dim * rows)

    def train_flops(self, target=True, causal_self=False) -> float:
        """Forward + backward: (1 + BACKWARD_FACTOR) × the forward's FLOPs."""
        return (1 + BACKWARD_FACTOR) * self.flops(target, causal_self)

    def train_min_bytes(self, itemsize: int, with_self=False) -> float:
        """The forward's bytes, then q, out, dO read and dq written at B rows, K/V read and dK/dV written at U rows
        (and user_q, user_out, their gradients at U rows with self-attention)."""
        rows = 4 * self.num_candidates * self.num_queries + (8 if with_self else 4) * self.num_users * self.seq_len
        return self.min_bytes(itemsize, with_self) + float(itemsize * self.heads * self.head_dim * rows)


BACKWARD_FACTOR = 2.5  # backward FLOPs over the forward's (FlashAttention's count: 5 products against 2)
CANONICAL = Shape(15, 1024, 64, 1024, 4, 128)
SMOKE_CANONICAL = Shape(3, 10, 5, 40, 2, 16)
SWEEP_CANDIDATES = 1024
# (S, L, d, B/U) at B = SWEEP_CANDIDATES, H = 4; CORNERS: the sweep's extremes and its slowest points
SWEEP = [(s, n, d, r) for s in (1, 8, 64) for n in (256, 1024, 4096) for d in (64, 128) for r in (1, 16, 70, 256)]
CORNERS = [(1, 256, 64, 256), (8, 256, 64, 1), (8, 256, 64, 16), (64, 256, 64, 256), (1, 4096, 128, 1)]
CORNERS += [(64, 4096, 128, 70)]
SMOKE_SWEEP = [Shape(2, 8, 8, 20, 2, 32)]
CHECKED_HEAD = 256  # sweep: candidates checked against fp64
TOL = 1e-2
BASELINE, OURS, DISPATCHED = "baseline (index_select + SDPA)", "ours: public op", "ours: plan + kernel as dispatched"
APART = "apart: SDPA causal self + our target as dispatched"


def make_problem(shape: Shape, device, dtype, seed: int, counts=None, with_user_q=False) -> dict:
    """Fresh random q [B, H, S, d], k, v (and user_q) [U, H, L, d], never zeros, and a shuffled mapping with the
    given counts (default ragged: weights 1/(u+1)^0.7, every user at least one candidate when B ≥ U)."""
    if counts is None:
        weights = torch.tensor([1.0 / (u + 1) ** 0.7 for u in range(shape.num_users)])
        counts = torch.floor(weights / weights.sum() * shape.num_candidates).long()
        counts = counts.clamp(min=1) if shape.num_candidates >= shape.num_users else counts
        while counts.sum() > shape.num_candidates:
            counts[counts.argmax()] -= 1
        counts[0] += shape.num_candidates - counts.sum()
    cpu_gen, gen = torch.Generator().manual_seed(seed), torch.Generator(device=device).manual_seed(seed)
    mapping = torch.repeat_interleave(torch.arange(shape.num_users), counts)
    mapping = mapping[torch.randperm(mapping.shape[0], generator=cpu_gen)].to(device)
    user = (shape.num_users, shape.heads, shape.seq_len, shape.head_dim)
    sizes = dict(q=(mapping.shape[0], shape.heads, shape.num_queries, shape.head_dim), k=user, v=user)
    if with_user_q:
        sizes["user_q"] = user
    p = {name: torch.randn(*size, generator=gen, device=device, dtype=dtype) for name, size in sizes.items()}
    return dict(p, cand_to_user=mapping, counts=counts, scale=1 / math.sqrt(shape.head_dim))


def baseline(p: dict, head=None, dtype=None) -> torch.Tensor:
    """SDPA over K/V replicated to the (first `head`) candidates' rows, in `dtype` (the fp64 reference)."""
    rows, dtype = p["cand_to_user"][:head], dtype or p["q"].dtype
    k, v = (p[n].index_select(0, rows).to(dtype) for n in ("k", "v"))
    return F.scaled_dot_product_attention(p["q"][:head].to(dtype), k, v)


def dispatched(p: dict, out=None, plan=None) -> torch.Tensor:
    """Plan + target-attention kernel as the public op dispatches them, without its input checks; with `plan` (for
    the dispatched kernel's block rows) the kernel alone."""
    args = (p["q"], p["k"], p["v"], p["cand_to_user"], None, p["scale"])
    if plan is not None and attention_ws.prefer_ws(p["q"], p["k"]):
        return attention_ws.launch_ws(*args, out=out, plan=plan)[0]
    return attention._launch(*args, out=out, plan=plan)[0]


def triton_config(p: dict) -> attention.TileConfig:
    """The Triton kernel's tiles for the target attention of `p` (by query rows per user)."""
    return attention.pick_config(p["q"].shape[0] * p["q"].shape[2] / p["k"].shape[0], attention.interpreting())


def core_providers(p: dict) -> dict[str, Provider]:
    """The sweep's providers: the baseline, the public op, plan + kernel as dispatched."""
    q, k, v, m = p["q"], p["k"], p["v"], p["cand_to_user"]
    note = "input checks, no device wait; as served in CUDA graphs"
    return {
        BASELINE: Provider(lambda: baseline(p), graph=True, host=True, note="replication timed"),
        OURS: Provider(lambda: ikbo_attention(q, k, v, m, backend="triton"), graph=True, host=True, note=note),
        DISPATCHED: Provider(lambda: dispatched(p), lambda: dispatched(p, nan_like(q)), host=True),
    }


def packed_providers(shape: Shape, device, dtype) -> dict[str, Provider]:
    """SDPA over each user's candidates packed into one query sequence [U, H, c·S, d]: equal counts, own problem."""
    per_user = round(shape.num_candidates / shape.num_users)
    eq_shape = replace(shape, num_candidates=per_user * shape.num_users)
    eq = make_problem(eq_shape, device, dtype, 2, counts=torch.full((shape.num_users,), per_user))
    order = torch.argsort(eq["cand_to_user"], stable=True)
    packed_q = eq["q"][order].unflatten(0, (shape.num_users, per_user)).transpose(1, 2).flatten(2, 3)

    def run(backend):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(packed_q, eq["k"], eq["v"])

    def unpacked(fn):  # [U, H, c·S, d] → [B', H, S, d] in candidate order
        res = torch.empty_like(eq["q"])
        res[order] = fn().unflatten(2, (per_user, shape.num_queries)).transpose(1, 2).flatten(0, 1)
        return res

    ref = baseline(eq, dtype=torch.float64)
    backends = dict(flash=SDPBackend.FLASH_ATTENTION, cuDNN=SDPBackend.CUDNN_ATTENTION)
    fns = {f"packed SDPA, {name} ({per_user}/user)": partial(run, backend) for name, backend in backends.items()}
    return {name: Provider(fn, partial(unpacked, fn), ref, eq_shape.flops(), optional=True) for name, fn in fns.items()}


def flex_provider(p: dict, shape: Shape) -> Provider:
    """FlexAttention over the flattened user-sorted queries [1, H, B·S, d] and all users' keys [1, H, U·L, d]."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    order = torch.argsort(p["cand_to_user"], stable=True)
    q_user = p["cand_to_user"][order].repeat_interleave(shape.num_queries).int()
    kv_user = torch.arange(shape.num_users, device=q_user.device).repeat_interleave(shape.seq_len).int()
    q, k, v = (t.transpose(0, 1).flatten(1, 2)[None] for t in (p["q"][order], p["k"], p["v"]))
    mask = create_block_mask(lambda b, h, i, j: q_user[i] == kv_user[j], None, None, q.shape[2], k.shape[2], q.device)
    run = partial(torch.compile(flex_attention), q, k, v, block_mask=mask)

    def unflattened():  # [1, H, B·S, d] → [B, H, S, d] in candidate order
        res = torch.empty_like(p["q"])
        res[order] = run()[0].unflatten(1, (-1, shape.num_queries)).transpose(0, 1)
        return res

    return Provider(run, unflattened, optional=True, note="block mask, ragged")


def canonical_cases(shape: Shape, device, dtype, with_flex: bool) -> list[Case]:
    """Target attention, then self + target, on one problem."""
    p = make_problem(shape, device, dtype, 1, with_user_q=True)
    q, k, v, m, user_q, scale = p["q"], p["k"], p["v"], p["cand_to_user"], p["user_q"], p["scale"]
    user_ref = F.scaled_dot_product_attention(*(t.double() for t in (user_q, k, v)), is_causal=True)
    cand_ref, itemsize = baseline(p, dtype=torch.float64), q.element_size()
    k_rep, v_rep = k.index_select(0, m), v.index_select(0, m)
    block_m = attention_ws.TILE_M if attention_ws.prefer_ws(q, k) else triton_config(p).block_m  # as dispatched
    plan = attention.plan_tiles(m, shape.num_users, shape.num_queries, block_m)
    triton = partial(attention._launch, q, k, v, m, None, scale, config=triton_config(p))  # a config: never Gluon
    target = {
        **core_providers(p),
        "SDPA on K/V replicated beforehand": Provider(lambda: F.scaled_dot_product_attention(q, k_rep, v_rep)),
        **packed_providers(shape, device, dtype),
        **({"FlexAttention": flex_provider(p, shape)} if with_flex else {}),
        "ours: kernel as dispatched, plan given": Provider(
            partial(dispatched, p, plan=plan), lambda: dispatched(p, nan_like(q), plan)
        ),
        "ours: plan + Triton kernel": Provider(lambda: triton()[0], lambda: triton(out=nan_like(q))[0]),
    }
    fused = partial(attention._launch, q, k, v, m, None, scale, user_q)
    self_sdpa = partial(F.scaled_dot_product_attention, user_q, k, v, is_causal=True)

    def poisoned(launch):  # (user_out, out) of a fused launch into NaN-filled buffers
        out, user_out, _ = launch(out=nan_like(q), user_out=nan_like(user_q))
        return user_out, out

    both = {
        "self: SDPA is_causal": Provider(self_sdpa, ref=user_ref, flops=shape.flops(False, True)),
        DISPATCHED: Provider(lambda: dispatched(p), lambda: dispatched(p, nan_like(q)), cand_ref, shape.flops()),
        APART: Provider(
            lambda: (self_sdpa(), dispatched(p)), lambda: (self_sdpa(), dispatched(p, nan_like(q))), graph=True
        ),
        "fused: plan + one launch, as dispatched": Provider(fused, lambda: poisoned(fused), graph=True),
        "fused: public op": Provider(
            partial(ikbo_self_target_attention, user_q, q, k, v, m, backend="triton"), host=True
        ),
    }
    runs = "the Gluon kernel" if attention_ws.prefer_ws(q, k) else "the Triton kernel"
    title = f"Target attention, {shape}, counts {p['counts'].tolist()}, non-causal; as dispatched: {runs}"
    self_title = f"Self (causal, U×L) + target attention, {shape}; × baseline: apart / fused"
    return [
        Case(target, cand_ref, shape.flops(), shape.min_bytes(itemsize), BASELINE, title),
        Case(both, (user_ref, cand_ref), shape.flops(True, True), shape.min_bytes(itemsize, True), APART, self_title),
    ]


def sweep_case(shape: Shape, device, dtype) -> Case:
    p = make_problem(shape, device, dtype, 4)
    ref = baseline(p, CHECKED_HEAD, torch.float64)
    return Case(core_providers(p), ref, shape.flops(), shape.min_bytes(p["q"].element_size()))


# ---------------------------------------------------------------------------------------------
# Forward + backward
# ---------------------------------------------------------------------------------------------

SMOKE_TRAIN = Shape(2, 6, 4, 24, 1, 16)  # --backward --smoke: interpreted
# the sweep: B × B/U at S = 64, L = 512, H = 4, d = 128 (U = B / ratio, points with U < 1 left out)
TRAIN_SWEEP_CANDIDATES, TRAIN_SWEEP_RATIOS = (64, 1024, 16384), (1, 16, 70, 256)
SMOKE_TRAIN_SWEEP = [Shape(3, 7, 4, 20, 1, 16)]
TRAIN_TOL = 2e-2
TRAIN_BASELINE, TRAIN_OURS = "baseline (index_select + SDPA), autograd", "ours: public op, autograd"
# The baseline's dK and dV are index_select's backward: an index_add of each candidate's gradient into its user's
# rows in bf16, whose rounding grows with the candidates a user has (rel. error 4e-2 at 256 a user on the H200): it is
# timed against this looser bound, its error in the table.
BASELINE_TRAIN_TOL = 1e-1
BASELINE_TRAIN_NOTE = "dK/dV summed in bf16 (index_add)"
TRAIN_KERNELS = "ours: kernels (plan + forward with LSE; plan, dQ, dK/dV)"
TRAIN_APART = "apart: SDPA causal self + our target, autograd"
# backward tiles (dQ, dK/dV) besides `attention.pick_backward_configs`' at the canonical shape: two programs an SM
BACKWARD_TILES = {
    "dK/dV 64 keys × 32 rows, 4 warps": (TileConfig(128, 64, num_warps=8, num_stages=2), TileConfig(32, 64, num_warps=4, num_stages=2)),
    "dQ 64 rows × 64 keys, 4 warps": (TileConfig(64, 64, num_warps=4, num_stages=2), TileConfig(64, 128, num_warps=8, num_stages=2)),
}  # fmt: skip


def train(forward, inputs, grads_out) -> tuple:
    """forward(*inputs) then autograd's backward → (outputs detached, gradients of the inputs)."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    outs = forward(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    return (*(o.detach() for o in outs), *torch.autograd.grad(outs, leaves, grads_out))


def train_fp64(forward, inputs, grads_out) -> tuple:
    """`train` in fp64: the reference."""
    return train(forward, [t.double() for t in inputs], [g.double() for g in grads_out])


def backward_only(forward, inputs, grads_out):
    """A forward kept with its graph → fn() running autograd's backward alone → the gradients of the inputs."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    outs = forward(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    return partial(torch.autograd.grad, outs, leaves, grads_out, retain_graph=True)


def materialized(cand_to_user):
    """The baseline's formula: K/V replicated to the candidates' rows (index_select), then SDPA → forward(q, k, v)."""
    return lambda q, k, v: F.scaled_dot_product_attention(
        q, k.index_select(0, cand_to_user), v.index_select(0, cand_to_user)
    )


def ours(cand_to_user):
    return lambda q, k, v: ikbo_attention(q, k, v, cand_to_user, backend="triton")  # the interpreter under --smoke


def self_apart(cand_to_user):
    """SDPA's causal self-attention and our target attention, two ops → forward(user_q, q, k, v)."""
    return lambda user_q, q, k, v: (
        F.scaled_dot_product_attention(user_q, k, v, is_causal=True),
        ikbo_attention(q, k, v, cand_to_user, backend="triton"),
    )


def self_fused(cand_to_user):
    return lambda user_q, q, k, v: ikbo_self_target_attention(user_q, q, k, v, cand_to_user, backend="triton")


def self_reference(cand_to_user):
    return lambda user_q, q, k, v: (
        F.scaled_dot_product_attention(user_q, k, v, is_causal=True),
        materialized(cand_to_user)(q, k, v),
    )


def with_grads(p: dict, with_user_q=False) -> dict:
    """The problem's output gradients (random, like the outputs)."""
    gen = torch.Generator(device=p["q"].device).manual_seed(int(p["q"].shape[0]) + 11)
    grads = {"grad_out": torch.randn(p["q"].shape, generator=gen, device=p["q"].device, dtype=p["q"].dtype)}
    if with_user_q:
        user_q = p["user_q"]
        grads["grad_user_out"] = torch.randn(user_q.shape, generator=gen, device=user_q.device, dtype=user_q.dtype)
    return {**p, **grads}


def kernels_train(p: dict, poisoned=False, config=None) -> tuple:
    """Ours without autograd: the forward keeping its log-sum-exp, then the backward's launches → (out, dq, dk, dv);
    `poisoned`: every output and gradient written into NaN-filled buffers."""
    q, k, v, m, scale = p["q"], p["k"], p["v"], p["cand_to_user"], p["scale"]
    lse = torch.empty(attention.lse_size(q.shape, k.shape, False), device=q.device)
    out = attention._launch(q, k, v, m, None, scale, out=nan_like(q) if poisoned else None, lse=lse)[0]
    grads = ([nan_like(t) for t in (q, k, v)] + [None]) if poisoned else None
    return (out, *attention._launch_backward(p["grad_out"], q, k, v, out, lse, m, None, scale, grads=grads,
                                             config=config)[:3])  # fmt: skip


def packed_train_providers(shape: Shape, device, dtype) -> dict[str, Provider]:
    """SDPA over each user's candidates packed into one query sequence [U, H, c·S, d] (equal counts, own problem),
    forward + backward → (out, dq, dk, dv) in candidate order."""
    per_user = round(shape.num_candidates / shape.num_users)
    eq_shape = replace(shape, num_candidates=per_user * shape.num_users)
    eq = with_grads(make_problem(eq_shape, device, dtype, 2, counts=torch.full((shape.num_users,), per_user)))
    order = torch.argsort(eq["cand_to_user"], stable=True)

    def pack(t):  # [B', H, S, d] → [U, H, c·S, d]
        return t[order].unflatten(0, (shape.num_users, per_user)).transpose(1, 2).flatten(2, 3)

    def unpack(t):  # [U, H, c·S, d] → [B', H, S, d] in candidate order
        res = torch.empty_like(eq["q"])
        res[order] = t.unflatten(2, (per_user, shape.num_queries)).transpose(1, 2).flatten(0, 1)
        return res

    packed_q, packed_grad = pack(eq["q"]), pack(eq["grad_out"])

    def run(backend):
        with sdpa_kernel(backend):
            return train(F.scaled_dot_product_attention, (packed_q, eq["k"], eq["v"]), (packed_grad,))

    def unpacked(backend):
        out, dq, dk, dv = run(backend)
        return unpack(out), unpack(dq), dk, dv

    ref = train_fp64(materialized(eq["cand_to_user"]), (eq["q"], eq["k"], eq["v"]), (eq["grad_out"],))
    backends = dict(flash=SDPBackend.FLASH_ATTENTION, cuDNN=SDPBackend.CUDNN_ATTENTION)
    return {
        f"packed SDPA, {name}, autograd ({per_user}/user)": Provider(
            partial(run, backend), partial(unpacked, backend), ref, eq_shape.train_flops(), optional=True
        )
        for name, backend in backends.items()
    }


def train_cases(shape: Shape, device, dtype) -> list[Case]:
    """Forward + backward at the canonical shape: target attention (its providers, then ours in parts: forward,
    backward, backward tiles), then self + target, fused against apart (forward + backward, and the backward alone)."""
    p = with_grads(make_problem(shape, device, dtype, 1, with_user_q=True), with_user_q=True)
    q, k, v, m, g = p["q"], p["k"], p["v"], p["cand_to_user"], p["grad_out"]
    target = (q, k, v)
    ref = train_fp64(materialized(m), target, (g,))
    flops, backward_flops, itemsize = shape.train_flops(), BACKWARD_FACTOR * shape.flops(), q.element_size()
    providers = {
        TRAIN_BASELINE: Provider(partial(train, materialized(m), target, (g,)), note="K/V replicated"),
        **packed_train_providers(shape, device, dtype),
        TRAIN_OURS: Provider(partial(train, ours(m), target, (g,)), host=True),
        TRAIN_KERNELS: Provider(partial(kernels_train, p), partial(kernels_train, p, True)),
        "ours: forward, keeping the LSE": Provider(
            lambda: ours(m)(*(t.detach().requires_grad_() for t in target)).detach(), ref=ref[0], flops=shape.flops()
        ),
        "baseline: backward (autograd on a kept graph)": Provider(
            backward_only(materialized(m), target, (g,)), ref=ref[1:], flops=backward_flops
        ),
        "ours: backward (autograd on a kept graph)": Provider(
            backward_only(ours(m), target, (g,)), ref=ref[1:], flops=backward_flops, host=True
        ),
    }
    for name, tiles in BACKWARD_TILES.items():
        providers[f"ours: kernels, {name}"] = Provider(partial(kernels_train, p, config=tiles), note="backward tiles")
    title = f"Target attention, forward + backward, {shape}, counts {p['counts'].tolist()}, non-causal"
    both = (p["user_q"], q, k, v)
    grads_out = (p["grad_user_out"], g)
    self_ref = train_fp64(self_reference(m), both, grads_out)
    self_flops = BACKWARD_FACTOR * shape.flops(True, True)
    fused = {
        TRAIN_APART: Provider(partial(train, self_apart(m), both, grads_out)),
        "fused: ours, autograd": Provider(partial(train, self_fused(m), both, grads_out), host=True),
        "apart: backward (autograd on a kept graph)": Provider(
            backward_only(self_apart(m), both, grads_out), ref=self_ref[2:], flops=self_flops
        ),
        "fused: backward (autograd on a kept graph)": Provider(
            backward_only(self_fused(m), both, grads_out), ref=self_ref[2:], flops=self_flops
        ),
    }
    self_title = f"Self (causal, U×L) + target attention, forward + backward, {shape}; × baseline: apart / fused"
    return [
        Case(providers, ref, flops, shape.train_min_bytes(itemsize), TRAIN_BASELINE, title),
        Case(fused, self_ref, shape.train_flops(True, True), shape.train_min_bytes(itemsize, True), TRAIN_APART,
             self_title),
    ]  # fmt: skip


def train_sweep_case(shape: Shape, device, dtype) -> Case:
    """Forward + backward, the baseline against ours, checked in fp64 on the sub-problem of the first users whose
    candidates number ≤ CHECKED_HEAD (at least one user): their candidates' out and dq, their dK and dV."""
    p = with_grads(make_problem(shape, device, dtype, 4))
    q, k, v, m, g = p["q"], p["k"], p["v"], p["cand_to_user"], p["grad_out"]
    counts = torch.cumsum(p["counts"], 0)
    checked_users = max(1, int((counts <= CHECKED_HEAD).sum()))
    rows = torch.nonzero(m < checked_users).flatten()
    ref = train_fp64(materialized(m[rows]), (q[rows], k[:checked_users], v[:checked_users]), (g[rows],))

    def checked(fn):
        def check():
            out, dq, dk, dv = fn()
            return out[rows], dq[rows], dk[:checked_users], dv[:checked_users]

        return check

    runs = {
        TRAIN_BASELINE: partial(train, materialized(m), (q, k, v), (g,)),
        TRAIN_OURS: partial(train, ours(m), (q, k, v), (g,)),
        TRAIN_KERNELS: partial(kernels_train, p),
    }
    providers = {name: Provider(fn, checked(fn)) for name, fn in runs.items()}
    providers[TRAIN_BASELINE].tol, providers[TRAIN_BASELINE].note = BASELINE_TRAIN_TOL, BASELINE_TRAIN_NOTE
    return Case(providers, ref, shape.train_flops(), shape.train_min_bytes(q.element_size()))


def train_sweep_shapes(smoke: bool) -> list[Shape]:
    if smoke:
        return SMOKE_TRAIN_SWEEP
    points = [(b, r) for b in TRAIN_SWEEP_CANDIDATES for r in TRAIN_SWEEP_RATIOS if b >= r]
    return [Shape(b // r, b, 64, 512, 4, 128) for b, r in points]
