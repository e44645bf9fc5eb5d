"""The LCE benchmark's problems (scripts/bench_lce.py): shapes, inputs, the torch formulations the op is compared with,
the fp64 references of its output and its gradients, and the forward + backward case (`train_case`: providers side by
side for `harness.Bench`).

Import it after the benchmark has chosen Triton's interpreter or not: it imports `kernels`, which builds its kernels
at import.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from ikbo_backend.perf.harness import Case, Provider
from kernels import linear_compress as lce
from kernels.linear_compress import PackedLinearCompress

CHUNK = 1024  # candidates (or users) per fp64 step of the references: about 1 GB of fp64 at N·D = 131072
CHECKED_HEAD = 256  # candidates checked against fp64 in a sweep (S0 in fp64 at B = 16384 would take 51 GB)
TRAIN_BASELINE, DECOMPOSED, OURS = "S0 + autograd (baseline)", "S1 + autograd (decomposed torch)", "ours"


@dataclass(frozen=True)
class Shape:
    num_users: int  # U
    num_candidates: int  # B
    ku: int  # user tokens
    kc: int  # candidate tokens
    dim: int  # D
    rows: int  # N

    def flops(self) -> float:
        """The IKBO forward: 2·N·D·(U·Ku + B·Kc)."""
        return 2.0 * self.rows * self.dim * (self.num_users * self.ku + self.num_candidates * self.kc)

    def min_bytes(self, elem: int) -> float:
        """Each input read once, the output written once (the mapping in int32)."""
        users, cands = self.num_users * self.ku * self.dim, self.num_candidates * self.kc * self.dim
        weights, out = self.rows * (self.ku + self.kc + 1), self.num_candidates * self.rows * self.dim
        return float(elem * (users + cands + weights + out) + 4 * self.num_candidates)

    def train_flops(self) -> float:
        """Forward + backward: 3 × the IKBO forward (the input gradients and the weight gradients are one GEMM
        each per forward GEMM); the segment sums and the bias gradient (O(B·N·D) additions) are not counted."""
        return 3.0 * self.flops()

    def train_min_bytes(self, elem: int) -> float:
        """The forward's bytes, then dout read once, the inputs and weights read again and every gradient written
        once."""
        users, cands = self.num_users * self.ku * self.dim, self.num_candidates * self.kc * self.dim
        weights, grad_out = self.rows * (self.ku + self.kc + 1), self.num_candidates * self.rows * self.dim
        return self.min_bytes(elem) + elem * (grad_out + 2 * (users + cands + weights))


CANONICAL = Shape(num_users=15, num_candidates=1024, ku=1024, kc=500, dim=256, rows=512)
SMOKE_CANONICAL = Shape(num_users=3, num_candidates=12, ku=20, kc=13, dim=32, rows=24)
SMOKE_TRAIN = Shape(num_users=2, num_candidates=6, ku=9, kc=5, dim=16, rows=16)  # --backward --smoke: interpreted


def make_inputs(shape: Shape, device, dtype, seed: int):
    """Fresh random (user_emb [U, Ku, D], cand_emb [B, Kc, D], cand_to_user [B] int32 unsorted with unequal counts,
    weight [N, Ku + Kc], bias [N])."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*size):
        return torch.randn(*size, generator=gen, device=device, dtype=dtype)

    weights = torch.rand(shape.num_users, generator=gen, device=device) ** 2 + 0.05
    mapping = torch.multinomial(weights, shape.num_candidates, replacement=True, generator=gen).int()
    depth = shape.ku + shape.kc
    user_emb, cand_emb = randn(shape.num_users, shape.ku, shape.dim), randn(shape.num_candidates, shape.kc, shape.dim)
    return user_emb, cand_emb, mapping, randn(shape.rows, depth) / depth**0.5, randn(shape.rows)


def s0_materialized(user_emb, cand_emb, cand_to_user, weight, bias):
    """S0: user_emb replicated to B rows, concatenated along K, one batched matmul with the bias fused."""
    tokens = torch.cat([user_emb.index_select(0, cand_to_user), cand_emb], dim=1)  # [B, Ku + Kc, D]
    num_candidates, _, dim = tokens.shape
    bias = bias[None, :, None].expand(num_candidates, -1, dim)
    return torch.baddbmm(bias, weight.expand(num_candidates, -1, -1), tokens)


def s1_gather(user_emb, cand_emb, cand_to_user, user_weight, cand_weight, bias):
    """S1, decomposed torch: two GEMMs at natural batch sizes, then the gathered add of the [U, N, D] result (under
    autograd the gather's backward is an index_add of dout: the user gradients' segment sum)."""
    user_part = torch.matmul(user_weight, user_emb)  # [U, N, D]
    cand_part = torch.matmul(cand_weight, cand_emb)  # [B, N, D]
    return cand_part + bias[:, None] + user_part.index_select(0, cand_to_user)


def reference(inputs, head: int) -> torch.Tensor:
    """S0 in fp64 over the first `head` candidates → [head, N, D]."""
    user_emb, cand_emb, cand_to_user, weight, bias = inputs
    users = user_emb.index_select(0, cand_to_user[:head]).double()  # one row a candidate: the replicated formula
    mapping = torch.arange(users.shape[0], device=users.device)
    return s0_materialized(users, cand_emb[:head].double(), mapping, weight.double(), bias.double())


def _chunks(count: int):
    return [slice(start, min(start + CHUNK, count)) for start in range(0, count, CHUNK)]


def weight_probes(shape: Shape, device, seed: int):
    """Fixed random vectors (r_u [Ku], r_c [Kc], fp64): the weight gradients are checked as dW_u r_u and dW_c r_c,
    whose fp64 references cost O(B·N·D) instead of a GEMM per candidate (a Freivalds-style check)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return tuple(torch.randn(k, generator=gen, device=device, dtype=torch.float64) for k in (shape.ku, shape.kc))


def project(d_user_weight, d_cand_weight, probes) -> torch.Tensor:
    """[dW_u r_u, dW_c r_c] → [2, N] in fp64."""
    return torch.stack([d_user_weight.double() @ probes[0], d_cand_weight.double() @ probes[1]])


def grad_reference(inputs, grad_out, head: int, probes) -> tuple:
    """fp64 references of (out, d_user_emb, d_cand_emb, projected weight gradients, d_bias): out and d_cand_emb over
    the first `head` candidates, d_user_emb over the first min(U, head) users, the weight gradients as `project`
    gives them, d_bias whole. Computed CHUNK rows at a time, never at B rows of fp64 user data."""
    user_emb, cand_emb, cand_to_user, weight, bias = inputs
    num_users, ku, _ = user_emb.shape
    user_weight, cand_weight = weight.double()[:, :ku], weight.double()[:, ku:]
    head_users = min(num_users, head)
    sums = grad_out.new_zeros((head_users, *grad_out.shape[1:]), dtype=torch.float64)  # dY_u of the head users
    user_proj = torch.cat([torch.matmul(probes[0], user_emb[s].double()) for s in _chunks(num_users)])  # [U, D]
    weight_proj = torch.zeros(2, weight.shape[0], dtype=torch.float64, device=weight.device)
    for s in _chunks(cand_emb.shape[0]):
        g, mapping = grad_out[s].double(), cand_to_user[s].long()
        weight_proj[0] += torch.einsum("bnd,bd->n", g, user_proj[mapping])
        weight_proj[1] += torch.einsum("bnd,bd->n", g, torch.matmul(probes[1], cand_emb[s].double()))
        head_rows = mapping < head_users
        sums.index_add_(0, mapping[head_rows], g[head_rows])
    return (
        reference(inputs, head),
        torch.matmul(user_weight.t(), sums),
        torch.matmul(cand_weight.t(), grad_out[:head].double()),
        weight_proj,
        grad_out.sum((0, 2), dtype=torch.float64),
    )


# The baseline's d_user_emb is index_select's backward: each candidate's gradient added into its user's row in bf16,
# whose rounding grows with the candidates a user has: it is timed against this looser bound, its error in the table.
BASELINE_TRAIN_TOL = 1e-1


def train_providers(inputs, grad_out, shape: Shape, ref, probes, canonical: bool) -> dict[str, Provider]:
    """Forward + backward, each returning (out, d_user_emb, d_cand_emb, d_user_weight, d_cand_weight, d_bias), checked
    with the weight gradients projected; at the canonical shape also ours in parts (each checked on its part)."""
    user_emb, cand_emb, cand_to_user, weight, bias = (
        t.detach().requires_grad_() if t.is_floating_point() else t for t in inputs
    )
    user_weight, cand_weight = (
        w.detach().clone().requires_grad_() for w in (weight[:, : shape.ku], weight[:, shape.ku :])
    )
    packed = PackedLinearCompress.from_weight(weight, shape.ku, bias)  # weight requires grad: so do its Parameters
    args, leaves = (user_emb, cand_emb, cand_to_user), (user_emb, cand_emb, *packed.parameters())

    def materialized():
        out = s0_materialized(*args, weight, bias)
        d_user, d_cand, d_weight, d_bias = torch.autograd.grad(out, (user_emb, cand_emb, weight, bias), grad_out)
        return out, d_user, d_cand, d_weight[:, : shape.ku], d_weight[:, shape.ku :], d_bias

    def decomposed():
        out = s1_gather(*args, user_weight, cand_weight, bias)
        return out, *torch.autograd.grad(out, (user_emb, cand_emb, user_weight, cand_weight, bias), grad_out)

    def ours():
        out = packed(*args, backend="triton")  # "triton": the interpreted kernels under --smoke too
        return out, *torch.autograd.grad(out, leaves, grad_out)

    table = {
        TRAIN_BASELINE: Provider(
            materialized, check=_checked(materialized, probes), note="user_emb replicated", tol=BASELINE_TRAIN_TOL
        ),
        DECOMPOSED: Provider(decomposed, check=_checked(decomposed, probes)),
        OURS: Provider(ours, check=_checked(ours, probes), host=True, note="PackedLinearCompress, the op's backward"),
    }
    if canonical:
        table.update(part_providers(packed, args, grad_out, shape, ref, probes))
    return table


def part_providers(packed, args, grad_out, shape: Shape, ref, probes) -> dict[str, Provider]:
    """Ours in parts: the forward, the backward (autograd on a kept graph, as dispatched), and the backward's kernels:
    d_user_emb with dY_u from a pass of its own, d_cand_emb by either kernel, d_cand_weight alone and with dY_u in the
    same pass (the dispatched choice, `kernels.linear_compress.FUSE_USER_SUMS`)."""
    user_emb, cand_emb, cand_to_user = (t.detach() for t in args)
    saved = packed(*args, backend="triton")
    leaves = (args[0], args[1], *packed.parameters())
    weights = packed._packed()  # the Parameters, detached
    cand_flops = 2.0 * shape.num_candidates * shape.kc * shape.rows * shape.dim

    def backward():
        return (saved.detach(), *torch.autograd.grad(saved, leaves, grad_out, retain_graph=True))

    def user_grad():
        sums = lce._user_gradients(grad_out, cand_to_user, shape.num_users)
        return lce._user_emb_grad(weights.user_weight, sums, torch.empty_like(user_emb))

    table = {
        "ours: forward": Provider(lambda: packed(*args, backend="triton").detach(), ref=ref[0], flops=shape.flops()),
        "ours: backward": Provider(backward, check=_checked(backward, probes), flops=2 * shape.flops(), host=True),
        "  d_user_emb: user sums (as dispatched), W_uᵀ GEMM": Provider(
            user_grad, ref=ref[1], flops=shape.flops() - cand_flops
        ),
    }
    for gemm in ("ws", "tile"):
        if gemm == "tile" or lce._ws_runs(grad_out, grad_out):
            run = partial(lce._input_grad, weights.cand_weight, grad_out, torch.empty_like(cand_emb), gemm=gemm)
            table[f"  d_cand_emb: W_cᵀ GEMM, {gemm}"] = Provider(run, ref=ref[2], flops=cand_flops)
    d_cand_weight = torch.empty_like(weights.cand_weight)
    sums = grad_out.new_empty(shape.num_users, shape.rows, shape.dim)  # dY_u
    for fused in (False, True):
        run = partial(
            lce._weight_grad, grad_out, cand_emb, d_cand_weight, user_sums=(cand_to_user, sums) if fused else None
        )
        check = partial(lambda run: run().double() @ probes[1], run)
        name = "  d_cand_weight + dY_u in one pass" if fused else "  d_cand_weight alone: split-K GEMM"
        table[name] = Provider(run, check=check, ref=ref[3][1], flops=cand_flops)
    return table


def _checked(fn, probes):
    def check():
        out, d_user, d_cand, d_user_weight, d_cand_weight, d_bias = fn()
        return out.detach(), d_user, d_cand, project(d_user_weight, d_cand_weight, probes), d_bias

    return check


def train_case(shape: Shape, device, dtype, seed: int, head: int, canonical: bool) -> Case:
    inputs = make_inputs(shape, device, dtype, seed)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    grad_out = torch.randn(shape.num_candidates, shape.rows, shape.dim, generator=gen, device=device, dtype=dtype)
    probes = weight_probes(shape, device, seed + 2)
    ref = grad_reference(inputs, grad_out, head, probes)
    table, elem = train_providers(inputs, grad_out, shape, ref, probes, canonical), inputs[0].element_size()
    title = f"Linear compression, forward + backward, {shape} (ragged, unsorted mapping), {str(dtype).removeprefix('torch.')}"
    return Case(table, ref, shape.train_flops(), shape.train_min_bytes(elem), TRAIN_BASELINE, title)
