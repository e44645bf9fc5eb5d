"""IKBO attention: candidate queries attend to their user's sequence, K/V never replicated, forward or backward.

Target attention, per candidate b with user u = m[b]:
    out[b] = softmax(scale · q[b] · k[u]ᵀ, keys j < kv_len[u]) · v[u]
q [B, H, S, d] candidate query tokens, k/v [U, H, L, d] user sequences, kv_len [U] valid lengths
(None = L), scale default 1/√d → out [B, H, S, d]. A user with kv_len 0 gives zeros.

Self + target attention shares k/v: each user's sequence attends to itself (causal by default,
keys < kv_len, query rows ≥ kv_len are zeros) and the candidates attend as above.

Backward, with P the probabilities, Δ_i = Σ_d dO_i·O_i and dS = P ∘ (dO·Vᵀ − Δ): dQ = scale·dS·K per query row;
dV[u] = Σ Pᵀ·dO and dK[u] = scale·Σ dSᵀ·Q, summed over all of user u's candidates' query rows (and its own
self-attention rows): the in-kernel broadcast of the forward turned into an in-kernel reduction.

Both ops are torch.library custom ops (`ikbo::attention`, `ikbo::self_target_attention`) with fake
implementations and registered autograd, whose backward is a second op (`ikbo::attention_backward`,
`ikbo::self_target_attention_backward`). The public functions check shapes, dtypes and devices (no device values)
and call the op; the backend's kernels and every check of index values run inside it. An eager call that autograd
will not differentiate (no tracing, no dispatch mode) runs the op's implementation without the dispatcher.

Torch path: groups candidates by user once per batch and runs one attention per user whose query
block holds all S tokens of all that user's candidates, so each user's K/V is read once; its backward
computes the same blocks' gradients (explicit formulas, fp32), dK[u] and dV[u] summed in the block's products.

Triton path (CUDA, bf16/fp16, d ∈ {16, 32, 64, 128}): two launches per call, no wait for the device: the
plan kernel writes its range flag straight to pinned host memory (`HostFlag`) and its check (the ValueError
naming a bad index value) is deferred to a later IKBO call, `kernels.check_deferred()`, or made at once in
strict mode (`kernels.strict_checks()`); the kernels clamp or skip bad values.
  1. `_plan_kernel`, one program per user, segments `cand_to_user` by user: the candidates in
     user order (`order`, stable) and a table of query tiles. A user's candidates are laid out as
     count·S "virtual" query rows (candidate-major, S tokens each) cut into BLOCK_M-row tiles, so
     one tile packs the S tokens of BLOCK_M / S candidates (or part of one candidate when S > BLOCK_M).
  2. `_attention_kernel`, grid (tiles, H): each program gathers its tile's query rows, then streams
     the user's K/V once through TMA descriptors (FlashAttention-2 online softmax, exp2, fp32
     accumulators), and scatters the rows back to [B, H, S, d]. Tiles of one user are adjacent in
     the grid and heads are the slow axis, so programs sharing K/V[u, h] run together (L2 reuse).
     With self-attention fused, the users' causal query tiles (longest first) come before the
     candidate tiles in the same grid, over the same K/V. When autograd will need the backward, each
     row's log-sum-exp (base 2) is stored too (WRITE_LSE).
Backward (`_launch_backward`): the plan again (with each user's candidate range), `_attention_bwd_dq_kernel` over
the forward's tiles, self tiles and candidate tiles in launches of their own (Δ of its rows, stored, then dQ over
the user's keys, the probabilities recomputed from the stored log-sum-exp) and `_attention_bwd_dkdv_kernel`, one
program per (user, head, 128-key block): its K/V block stays in registers while it walks all of the user's
candidate query rows (copied by TMA where S is a multiple of the step) and its own causal rows, dK and dV
accumulated in fp32 and written once (or, for few users with long walks, the walks split in parts that add up
atomically); users with the most rows start first.
Source: "In-Kernel Broadcast Optimization" (Meta, 2025), target attention; FlashAttention-2
(Dao, 2023, https://arxiv.org/abs/2307.08691) and Triton's tutorial 06-fused-attention.
Hopper: attention (no plan given, no tuned tile) goes to the warp-specialized Gluon kernel of
kernels/attention_ws.py at the shapes where it is the faster one (`attention_ws.prefer_ws`: bf16/fp16,
d ∈ {64, 128}, S ≥ 64, L ≥ 512, ≥ 256 query rows a user), self + target too where its rows are
16-byte aligned (`self_target_ws_ok`) and, with kv_len, from L = 1024; and wherever a tuned choice says
`WS_CHOICE`; the rest here. It writes the log-sum-exp too. Design and measurements: docs/design/attention.md.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import _hopper
from ._common import (
    DEFERRED,
    HostFlag,
    autocast_inputs,
    backward_call,
    check_kv_len,
    check_kv_len_shape,
    check_mapping,
    check_mapping_shape,
    check_same,
    check_tensor,
    eager_function,
    functorch_function,
    group_by_user,
    poll_deferred,
    raise_bad_mapping,
    resolve_backend,
    route,
)
from ._interpreter import interpreting
from ._launch import NOW, CachedLaunch, Recording, call, fail, launch, named, remember, replayable
from .configs import TileConfig, tuned_config, tuned_version

FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
TRITON_TYPES = (torch.float16, torch.bfloat16)
TRITON_HEAD_DIMS = (16, 32, 64, 128)
LOG2E = 1.4426950408889634
# A tuned choice (configs.set_tuned_configs, `_launch(config=...)`): the Gluon warp-specialized kernel of
# kernels/attention_ws.py wherever it runs the inputs (not only at `prefer_ws`'s shapes), else `pick_config`.
WS_CHOICE = "warp_specialized"


# ---------------------------------------------------------------------------------------------
# Tile configurations
# ---------------------------------------------------------------------------------------------


def pick_config(rows_per_user: float, interpret: bool) -> TileConfig:
    """Tiles by packed query rows per user (B·S/U, plus L with self-attention). 128-row tiles with
    ≤ 128 registers, so that two 8-warp programs share an SM and one's softmax overlaps the other's
    matrix products (faster at the canonical shape than one program per SM); 64-row tiles when a user
    has few query rows (the K/V pass is then memory-bound and smaller tiles waste less). Causal self
    tiles need BLOCK_N | BLOCK_M, which both satisfy."""
    if interpret:
        return TileConfig(16, 16, num_warps=4, num_stages=1)
    if rows_per_user <= 64:
        return TileConfig(64, 64, num_warps=4, num_stages=2)
    return TileConfig(128, 64, num_warps=8, num_stages=2, maxnreg=128)


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


# fmt: off
@triton.jit(do_not_specialize=["num_candidates", "num_users"])  # any U, B: one compiled kernel
def _plan_kernel(
    cand_to_user_ptr,  # [B] int32/int64, expected in [0, U)
    kv_len_ptr,  # [U] int32/int64, expected in [0, L] (unused without HAS_KV_LEN)
    order_ptr,  # [B] int32 out: candidates grouped by user, in their original order within a user
    tile_ptr,  # [B·S // BLOCK_M + U, 4] int32 out: (user or -1, first candidate slot, first row, row end)
    flag_ptr,  # [3] int32 out: flag (1 when a mapping or kv_len value is out of range), then two zeros
    users_ptr,  # [U, 2] int32 out with HAS_USERS: (first candidate slot, candidate count) of each user
    host_flag_ptr,  # [1] int32 out with HOST_FLAG, in pinned host memory: 1 + the flag (kernels._common.HostFlag)
    num_candidates, num_users, seq_len, num_queries, HAS_KV_LEN: tl.constexpr, BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr, HAS_USERS: tl.constexpr, HOST_FLAG: tl.constexpr,
):
    """Program u reads the whole mapping twice: first = #candidates of users in [0, u) and count = #of u,
    then writes its candidates to order[first, first + count) and its tiles to the slots
    [start(u), start(u + 1)), start(u) = first·S // BLOCK_M + u, which holds the cdiv(count·S,
    BLOCK_M) tiles it needs (unused slots get user -1); the last program also fills the slots up to
    B·S // BLOCK_M + U, so every slot is written whatever the mapping holds (the buffers need no
    zero-fill). No atomics, no cross-program traffic; O(U·B) loads, which the U programs share.
    Out-of-range values are never matched (their rows are left unwritten, and no tile refers to
    them); program 0 writes the flag (1 on such a value, on which the host raises the ValueError)
    and zeroes the two words after it (the Gluon kernel's item counter and finished-program count).
    With HAS_USERS (the backward) it also writes its (first, count) to users[u]; with HOST_FLAG program 0 also
    writes 1 + the flag to the host's word, which the host reads without a copy or an event."""
    user = tl.program_id(0)
    offs = tl.arange(0, CHUNK)
    first = tl.full((), 0, tl.int32)
    count = tl.full((), 0, tl.int32)
    bad = tl.full((), 0, tl.int32)
    for i in range(0, num_candidates, CHUNK):
        ok = i + offs < num_candidates
        m = tl.load(cand_to_user_ptr + i + offs, mask=ok, other=0)
        first += tl.sum((ok & (m >= 0) & (m < user)).to(tl.int32), 0)
        count += tl.sum((ok & (m == user)).to(tl.int32), 0)
        bad = tl.maximum(bad, tl.max((ok & ((m < 0) | (m >= num_users))).to(tl.int32), 0))
    seen = tl.full((), 0, tl.int32)
    for i in range(0, num_candidates, CHUNK):
        ok = i + offs < num_candidates
        mine = ok & (tl.load(cand_to_user_ptr + i + offs, mask=ok, other=0) == user)
        slot = first + seen + tl.cumsum(mine.to(tl.int32), 0) - 1
        tl.store(order_ptr + slot, i + offs, mask=mine)
        seen += tl.sum(mine.to(tl.int32), 0)
    if HAS_USERS:
        tl.store(users_ptr + 2 * user, first)
        tl.store(users_ptr + 2 * user + 1, count)

    rows = count * num_queries
    tiles = (rows + BLOCK_M - 1) // BLOCK_M
    start = (first * num_queries) // BLOCK_M + user
    stop = ((first + count) * num_queries) // BLOCK_M + user + 1
    if user == num_users - 1:  # with out-of-range values the counts fall short of B: fill to the end
        stop = (num_candidates * num_queries) // BLOCK_M + num_users
    for j in range(0, stop - start, CHUNK):
        t = j + offs
        entry = tile_ptr + (start + t) * 4
        live = t < stop - start
        tl.store(entry + 0, tl.where(t < tiles, user, -1), mask=live)
        tl.store(entry + 1, tl.full([CHUNK], 0, tl.int32) + first, mask=live)
        tl.store(entry + 2, t * BLOCK_M, mask=live)
        tl.store(entry + 3, tl.full([CHUNK], 0, tl.int32) + rows, mask=live)

    if user == 0:
        if HAS_KV_LEN:
            for i in range(0, num_users, CHUNK):
                ok = i + offs < num_users
                kv = tl.load(kv_len_ptr + i + offs, mask=ok, other=0)
                bad = tl.maximum(bad, tl.max((ok & ((kv < 0) | (kv > seq_len))).to(tl.int32), 0))
        tl.store(flag_ptr, bad)
        tl.store(flag_ptr + 1, 0)
        tl.store(flag_ptr + 2, 0)
        if HOST_FLAG:
            tl.store(host_flag_ptr, bad + 1)
# fmt: on


_plan_launch = CachedLaunch(_plan_kernel)


@triton.jit
def _attend(
    acc,
    m_i,
    l_i,
    q,  # [BLOCK_M, D]
    k_desc,
    v_desc,  # 2-D views of k / v: key n of (u, h) is row kv_row + n, columns [kv_col, kv_col + D)
    kv_row,
    kv_col,
    lo,
    hi,  # key range [lo, hi), a multiple of BLOCK_N apart unless MASKED
    kv_len,
    row_limit,  # [BLOCK_M]: last key each query row may see (causal), else a large number
    qk_scale,  # scale · log2(e)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    """Online softmax over key blocks [lo, hi) (FlashAttention-2, base 2): m_i is the running row max."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES, warp_specialize=WARP_SPECIALIZE):
        k = k_desc.load([kv_row + start_n, kv_col])  # [BLOCK_N, D]
        qk = tl.dot(q, k.T)  # [BLOCK_M, BLOCK_N] fp32
        if MASKED:
            keys = start_n + offs_n
            valid = (keys[None, :] < kv_len) & (keys[None, :] <= row_limit[:, None])
            qk = tl.where(valid, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        if MASKED:
            qk = qk - m_new[:, None]
        else:
            qk = qk * qk_scale - m_new[:, None]
        p = tl.math.exp2(qk)
        v = v_desc.load([kv_row + start_n, kv_col])  # [BLOCK_N, D]
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, m_i, l_i


# fmt: off
@triton.jit
def _softmax_pass(
    q,  # [BLOCK_M, D]
    k_desc,
    v_desc,
    kv_offset,  # element offset of K/V[u, h] (int64)
    stride_kl,  # row stride of the K/V views
    full_end,  # keys [0, full_end) are seen by every row of the tile: no mask
    hi,  # keys [full_end, hi) need the kv_len / causal mask
    kv_len, row_limit, qk_scale, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    """softmax(q·Kᵀ)·V of one query tile over one (user, head) → ([BLOCK_M, D] fp32 (0 for no keys), the rows'
    log-sum-exp in base 2 of the scaled scores (+inf for no keys): the backward's softmax statistics)."""
    kv_row = (kv_offset // stride_kl).to(tl.int32)
    kv_col = (kv_offset % stride_kl).to(tl.int32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = _attend(
        acc, m_i, l_i, q, k_desc, v_desc, kv_row, kv_col,
        0,
        full_end, kv_len, row_limit, qk_scale, BLOCK_M, BLOCK_N, False, NUM_STAGES, WARP_SPECIALIZE,
    )
    acc, m_i, l_i = _attend(
        acc, m_i, l_i, q, k_desc, v_desc, kv_row, kv_col, full_end, hi, kv_len, row_limit, qk_scale, BLOCK_M, BLOCK_N,
        True, NUM_STAGES, False,
    )
    lse = tl.where(l_i > 0, m_i + tl.math.log2(tl.where(l_i > 0, l_i, 1.0)), float("inf"))
    return acc / tl.where(l_i > 0, l_i, 1.0)[:, None], lse
# fmt: on


@triton.jit
def _kv_len(kv_len_ptr, user, seq_len, HAS_KV_LEN: tl.constexpr):
    """Valid keys of `user`, clamped to [0, L] (out-of-range values are reported by the plan)."""
    if HAS_KV_LEN:
        return tl.minimum(tl.maximum(tl.load(kv_len_ptr + user).to(tl.int32), 0), seq_len)
    return seq_len


# fmt: off
@triton.jit
def _target_rows_q(
    tile, head, q_ptr, stride_qb, stride_qh, stride_qs, kv_len_ptr, order_ptr, tile_ptr, seq_len, num_queries,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, HAS_KV_LEN: tl.constexpr,
):
    """A plan tile's BLOCK_M packed query rows (candidate-major, S tokens each) → (user, its kv_len (0 past the last
    tile), row_ok, candidate, token, q [BLOCK_M, D]); padding rows read candidate 0 and are never stored."""
    entry = tile_ptr + tile * 4
    entry_user = tl.load(entry)  # -1 past the last tile: no rows, no keys, nothing stored
    first_slot = tl.load(entry + 1)
    rows = tl.load(entry + 2) + tl.arange(0, BLOCK_M)
    row_ok = rows < tl.load(entry + 3)
    user = tl.maximum(entry_user, 0)
    kv_len = tl.where(entry_user >= 0, _kv_len(kv_len_ptr, user, seq_len, HAS_KV_LEN), 0)
    slot = rows // num_queries
    token = rows - slot * num_queries
    cand = tl.load(order_ptr + first_slot + slot, mask=row_ok, other=0).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    q_rows = cand * stride_qb + head * stride_qh + token * stride_qs
    q = tl.load(q_ptr + (q_rows[:, None] + offs_d[None, :]))
    return user, kv_len, row_ok, cand, token, q
# fmt: on


# fmt: off
@triton.jit
def _self_rows_q(
    tile, head, uq_ptr, stride_uqu, stride_uqh, stride_uql, stride_ku, stride_kh, kv_len_ptr, num_users, seq_len,
    num_self_tiles, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_KV_LEN: tl.constexpr,
):
    """A self tile (causal tiles numbered longest first) → (user, its kv_len, rows (positions in the sequence),
    q [BLOCK_M, D] (rows past L read row L-1, never stored), the last key each row sees, the end of the keys every
    row sees (no mask before it), the end of the keys, the element offset of K/V[user, head])."""
    q_tiles = num_self_tiles // num_users
    user = tile % num_users
    q_tile = (q_tiles - 1 - tile // num_users) if CAUSAL else tile // num_users
    kv_len = _kv_len(kv_len_ptr, user, seq_len, HAS_KV_LEN)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    q_rows = user.to(tl.int64) * stride_uqu + head * stride_uqh + tl.minimum(rows, seq_len - 1) * stride_uql
    q = tl.load(uq_ptr + (q_rows[:, None] + offs_d[None, :]))
    if CAUSAL:
        row_limit = rows
        hi = tl.minimum(kv_len, q_tile * BLOCK_M + BLOCK_M)
        full_end = tl.minimum(kv_len // BLOCK_N, (q_tile * BLOCK_M) // BLOCK_N) * BLOCK_N
    else:
        row_limit = tl.full([BLOCK_M], 2147483647, tl.int32)
        hi = kv_len
        full_end = (kv_len // BLOCK_N) * BLOCK_N
    return user, kv_len, rows, q, row_limit, full_end, hi, user.to(tl.int64) * stride_ku + head * stride_kh
# fmt: on


# fmt: off
@triton.jit
def _self_tile(
    tile, head, uq_ptr, stride_uqu, stride_uqh, stride_uql, uo_ptr, stride_uou, stride_uoh, stride_uol, ulse_ptr,
    k_desc, v_desc, stride_ku, stride_kh, stride_kl, kv_len_ptr, num_users, seq_len, num_self_tiles, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_KV_LEN: tl.constexpr, WRITE_LSE: tl.constexpr, NUM_STAGES: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    """One query tile of a user's own sequence; causal tiles are numbered longest first. With WRITE_LSE the rows'
    log-sum-exp goes to ulse [U, H, L] (+inf past kv_len: those rows are zeros, their gradients too)."""
    user, kv_len, rows, q, row_limit, full_end, hi, kv_offset = _self_rows_q(
        tile, head, uq_ptr, stride_uqu, stride_uqh, stride_uql, stride_ku, stride_kh, kv_len_ptr, num_users, seq_len,
        num_self_tiles, HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, HAS_KV_LEN,
    )
    offs_d = tl.arange(0, HEAD_DIM)
    out, lse = _softmax_pass(
        q, k_desc, v_desc, kv_offset, stride_kl, full_end, hi, kv_len, row_limit, qk_scale, BLOCK_M, HEAD_DIM, BLOCK_N,
        NUM_STAGES, WARP_SPECIALIZE,
    )
    out = tl.where((rows < kv_len)[:, None], out, 0.0)  # rows past the history are zeros
    o_rows = user.to(tl.int64) * stride_uou + head * stride_uoh + rows * stride_uol
    tl.store(
        uo_ptr + o_rows[:, None] + offs_d[None, :], out.to(uo_ptr.dtype.element_ty), mask=(rows < seq_len)[:, None]
    )
    if WRITE_LSE:
        lse_rows = (user.to(tl.int64) * tl.num_programs(1) + head) * seq_len + rows
        tl.store(ulse_ptr + lse_rows, tl.where(rows < kv_len, lse, float("inf")), mask=rows < seq_len)
# fmt: on


# fmt: off
@triton.jit
def _target_tile(
    tile, head, q_ptr, stride_qb, stride_qh, stride_qs, out_ptr, stride_ob, stride_oh, stride_os, lse_ptr, k_desc,
    v_desc, stride_ku, stride_kh, stride_kl, kv_len_ptr, order_ptr, tile_ptr, seq_len, num_queries, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_KV_LEN: tl.constexpr,
    WRITE_LSE: tl.constexpr, NUM_STAGES: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    """BLOCK_M packed query rows of one user's candidates (virtual rows: candidate-major, S tokens). With WRITE_LSE
    the rows' log-sum-exp goes to lse [B, H, S]."""
    user, kv_len, row_ok, cand, token, q = _target_rows_q(
        tile, head, q_ptr, stride_qb, stride_qh, stride_qs, kv_len_ptr, order_ptr, tile_ptr, seq_len, num_queries,
        HEAD_DIM, BLOCK_M, HAS_KV_LEN,
    )
    offs_d = tl.arange(0, HEAD_DIM)
    row_limit = tl.full([BLOCK_M], 2147483647, tl.int32)
    kv_offset = user.to(tl.int64) * stride_ku + head * stride_kh
    out, lse = _softmax_pass(
        q,
        k_desc,
        v_desc,
        kv_offset,
        stride_kl,
        (kv_len // BLOCK_N) * BLOCK_N,
        kv_len, kv_len, row_limit, qk_scale, BLOCK_M, HEAD_DIM, BLOCK_N, NUM_STAGES, WARP_SPECIALIZE,
    )
    o_rows = cand * stride_ob + head * stride_oh + token * stride_os
    tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    if WRITE_LSE:
        tl.store(lse_ptr + (cand * tl.num_programs(1) + head) * num_queries + token, lse, mask=row_ok)
# fmt: on


# any U, B: one kernel per tile config; seq_len too: at L = 1 Triton would make it a constant, on which ptxas fails
# fmt: off
@triton.jit(do_not_specialize=["num_users", "seq_len", "num_self_tiles"])
def _attention_kernel(
    q_ptr,  # [B, H, S, D] candidate queries
    stride_qb,
    stride_qh,
    stride_qs,
    out_ptr,  # [B, H, S, D]
    stride_ob,
    stride_oh,
    stride_os,
    uq_ptr,  # [U, H, L, D] user queries (self part; unused without HAS_SELF)
    stride_uqu,
    stride_uqh,
    stride_uql,
    uo_ptr,  # [U, H, L, D] user output
    stride_uou,
    stride_uoh,
    stride_uol,
    lse_ptr,  # [B, H, S] fp32 out with WRITE_LSE: log-sum-exp (base 2) of each candidate row's scaled scores
    ulse_ptr,  # [U, H, L] fp32 out with WRITE_LSE and HAS_SELF: the same of each user row (+inf past kv_len)
    k_desc,
    v_desc,  # 2-D [rows, stride_kl] views of k / v, blocks [BLOCK_N, D]
    stride_ku,
    stride_kh,
    stride_kl,  # element strides of k and v [U, H, L, ·] (the same for both)
    kv_len_ptr,  # [U] int32/int64 (unused without HAS_KV_LEN: every key valid)
    order_ptr,  # [B] int32 from _plan_kernel
    tile_ptr,  # [max_tiles, 4] int32 from _plan_kernel
    num_users,
    seq_len,
    num_queries,
    num_self_tiles,  # U·cdiv(L, BLOCK_M) with HAS_SELF, else 0
    qk_scale,  # scale · log2(e)
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SELF: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_KV_LEN: tl.constexpr, WRITE_LSE: tl.constexpr, NUM_STAGES: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    """Grid (self tiles + candidate tiles, H): program (tile, head), self tiles first. Each tile type is a whole
    inlined function: values chosen in a branch and used after the K/V loop (output pointers,
    row offsets) lose their alignment facts, get 64-per-thread layouts and spill."""
    tl.static_assert(BLOCK_M % BLOCK_N == 0 or not (HAS_SELF and CAUSAL), "causal tiles need BLOCK_N | BLOCK_M")
    tile = tl.program_id(0)
    head = tl.program_id(1)
    if HAS_SELF and tile < num_self_tiles:
        _self_tile(
            tile, head, uq_ptr, stride_uqu, stride_uqh, stride_uql, uo_ptr, stride_uou, stride_uoh, stride_uol, ulse_ptr,
            k_desc, v_desc, stride_ku, stride_kh, stride_kl, kv_len_ptr, num_users, seq_len, num_self_tiles, qk_scale,
            HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, HAS_KV_LEN, WRITE_LSE, NUM_STAGES, WARP_SPECIALIZE,
        )
    else:
        _target_tile(
            tile - num_self_tiles,
            head, q_ptr, stride_qb, stride_qh, stride_qs, out_ptr, stride_ob, stride_oh, stride_os, lse_ptr, k_desc,
            v_desc, stride_ku, stride_kh, stride_kl, kv_len_ptr, order_ptr, tile_ptr, seq_len, num_queries, qk_scale,
            HEAD_DIM, BLOCK_M, BLOCK_N, HAS_KV_LEN, WRITE_LSE, NUM_STAGES, WARP_SPECIALIZE,
        )
# fmt: on


_attention_launch = CachedLaunch(_attention_kernel)


# ---------------------------------------------------------------------------------------------
# Backward kernels
# ---------------------------------------------------------------------------------------------


# fmt: off
@triton.jit
def _dq_blocks(
    dq, q, do, lse, delta, k_desc, v_desc, kv_row, kv_col, lo, hi, kv_len, row_limit, qk_scale, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """dq += Σ over key blocks [lo, hi) of dS·k, dS = P ∘ (dO·vᵀ − Δ), P = exp2(q·kᵀ·qk_scale − lse) (the forward's
    probabilities, from its log-sum-exp); MASKED: keys < kv_len and ≤ the row's row_limit."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
        k = k_desc.load([kv_row + start_n, kv_col])  # [BLOCK_N, D]
        v = v_desc.load([kv_row + start_n, kv_col])
        p = tl.math.exp2(tl.dot(q, k.T) * qk_scale - lse[:, None])  # [BLOCK_M, BLOCK_N] fp32
        if MASKED:
            keys = start_n + offs_n
            p = tl.where((keys[None, :] < kv_len) & (keys[None, :] <= row_limit[:, None]), p, 0.0)
        ds = p * (tl.dot(do, v.T) - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq
# fmt: on


# fmt: off
@triton.jit
def _dq_pass(
    q, do, lse, delta, k_desc, v_desc, kv_offset, stride_kl, full_end, hi, kv_len, row_limit, qk_scale,
    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """Σ_j dS_ij k_j of one query tile over one (user, head) → [BLOCK_M, D] fp32: keys [0, full_end) unmasked, then
    [full_end, hi) masked (as `_softmax_pass`)."""
    kv_row = (kv_offset // stride_kl).to(tl.int32)
    kv_col = (kv_offset % stride_kl).to(tl.int32)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    dq = _dq_blocks(
        dq, q, do, lse, delta, k_desc, v_desc, kv_row, kv_col, 0, full_end, kv_len, row_limit, qk_scale, BLOCK_N, False,
        NUM_STAGES,
    )
    return _dq_blocks(
        dq, q, do, lse, delta, k_desc, v_desc, kv_row, kv_col, full_end, hi, kv_len, row_limit, qk_scale, BLOCK_N, True,
        NUM_STAGES,
    )
# fmt: on


@triton.jit
def _row_grads(do_ptr, lse_ptr, delta_ptr, rows, row_ok, HEAD_DIM: tl.constexpr):
    """Rows `rows` of dO [·, D] (0 where not row_ok) with their log-sum-exp (+inf there: P = 0) and Δ, as the dK/dV
    walk reads them → (dO, lse, Δ)."""
    offs_d = tl.arange(0, HEAD_DIM)
    do = tl.load(do_ptr + (rows[:, None] * HEAD_DIM + offs_d[None, :]), mask=row_ok[:, None], other=0.0)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=float("inf"))
    delta = tl.load(delta_ptr + rows, mask=row_ok, other=0.0)
    return do, lse, delta


# fmt: off
@triton.jit
def _row_stats(o_ptr, do_ptr, lse_ptr, delta_ptr, rows, row_ok, HEAD_DIM: tl.constexpr):
    """Rows `rows` of the contiguous [·, D] output and its gradient: dO [BLOCK_M, D] (0 where not row_ok), the
    forward's log-sum-exp (+inf where not row_ok: P = 0 there) and Δ = Σ_d dO·O, which is stored for the dK/dV
    kernel → (dO, lse, Δ)."""
    offs_d = tl.arange(0, HEAD_DIM)
    at = rows[:, None] * HEAD_DIM + offs_d[None, :]
    do = tl.load(do_ptr + at, mask=row_ok[:, None], other=0.0)
    o = tl.load(o_ptr + at, mask=row_ok[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(delta_ptr + rows, delta, mask=row_ok)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=float("inf"))
    return do, lse, delta
# fmt: on


# fmt: off
@triton.jit
def _dq_self_tile(
    tile, head, uq_ptr, stride_uqu, stride_uqh, stride_uql, uo_ptr, udo_ptr, duq_ptr, ulse_ptr, udelta_ptr, k_desc,
    v_desc, stride_ku, stride_kh, stride_kl, kv_len_ptr, num_users, seq_len, num_self_tiles, qk_scale, scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_KV_LEN: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """dQ of one query tile of a user's own sequence (the forward's `_self_tile`; rows past kv_len have lse = +inf,
    so P = 0 and their dQ is 0)."""
    user, kv_len, rows, q, row_limit, full_end, hi, kv_offset = _self_rows_q(
        tile, head, uq_ptr, stride_uqu, stride_uqh, stride_uql, stride_ku, stride_kh, kv_len_ptr, num_users, seq_len,
        num_self_tiles, HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, HAS_KV_LEN,
    )
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = rows < seq_len
    at = (user.to(tl.int64) * tl.num_programs(1) + head) * seq_len + rows  # row of [U·H·L, D] / [U·H·L]
    do, lse, delta = _row_stats(uo_ptr, udo_ptr, ulse_ptr, udelta_ptr, at, row_ok, HEAD_DIM)
    dq = _dq_pass(
        q, do, lse, delta, k_desc, v_desc, kv_offset, stride_kl, full_end, hi, kv_len, row_limit, qk_scale, BLOCK_M,
        HEAD_DIM, BLOCK_N, NUM_STAGES,
    )
    tl.store(duq_ptr + at[:, None] * HEAD_DIM + offs_d[None, :], (dq * scale).to(duq_ptr.dtype.element_ty),
             mask=row_ok[:, None])
# fmt: on


# fmt: off
@triton.jit
def _dq_target_tile(
    tile, head, q_ptr, stride_qb, stride_qh, stride_qs, o_ptr, do_ptr, dq_ptr, lse_ptr, delta_ptr, k_desc, v_desc,
    stride_ku, stride_kh, stride_kl, kv_len_ptr, order_ptr, tile_ptr, seq_len, num_queries, qk_scale, scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_KV_LEN: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """dQ of BLOCK_M packed query rows of one user's candidates (the forward's `_target_tile`)."""
    user, kv_len, row_ok, cand, token, q = _target_rows_q(
        tile, head, q_ptr, stride_qb, stride_qh, stride_qs, kv_len_ptr, order_ptr, tile_ptr, seq_len, num_queries,
        HEAD_DIM, BLOCK_M, HAS_KV_LEN,
    )
    offs_d = tl.arange(0, HEAD_DIM)
    at = (cand * tl.num_programs(1) + head) * num_queries + token  # row of [B·H·S, D] / [B·H·S]
    do, lse, delta = _row_stats(o_ptr, do_ptr, lse_ptr, delta_ptr, at, row_ok, HEAD_DIM)
    row_limit = tl.full([BLOCK_M], 2147483647, tl.int32)
    kv_offset = user.to(tl.int64) * stride_ku + head * stride_kh
    dq = _dq_pass(
        q, do, lse, delta, k_desc, v_desc, kv_offset, stride_kl, (kv_len // BLOCK_N) * BLOCK_N, kv_len, kv_len,
        row_limit, qk_scale, BLOCK_M, HEAD_DIM, BLOCK_N, NUM_STAGES,
    )
    tl.store(dq_ptr + at[:, None] * HEAD_DIM + offs_d[None, :], (dq * scale).to(dq_ptr.dtype.element_ty),
             mask=row_ok[:, None])
# fmt: on


# fmt: off
@triton.jit(do_not_specialize=["num_users", "seq_len", "num_self_tiles"])
def _attention_bwd_dq_kernel(
    q_ptr, stride_qb, stride_qh, stride_qs,  # [B, H, S, D] candidate queries
    o_ptr, do_ptr, dq_ptr,  # [B, H, S, D] contiguous: the forward's output, its gradient, dQ (out)
    lse_ptr, delta_ptr,  # [B, H, S] fp32: the forward's log-sum-exp (base 2), Δ (out)
    uq_ptr, stride_uqu, stride_uqh, stride_uql,  # [U, H, L, D] user queries (unused without HAS_SELF)
    uo_ptr, udo_ptr, duq_ptr,  # [U, H, L, D] contiguous: user output, its gradient, dQ of user_q (out)
    ulse_ptr, udelta_ptr,  # [U, H, L] fp32
    k_desc, v_desc, stride_ku, stride_kh, stride_kl,  # as `_attention_kernel`
    kv_len_ptr, order_ptr, tile_ptr,  # kv_len [U] (unused without HAS_KV_LEN), the plan's order and tiles
    num_users, seq_len, num_queries, num_self_tiles, qk_scale, scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SELF: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_KV_LEN: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """Grid (tiles, H), the forward's tiles: HAS_SELF, the self tiles (num_self_tiles), else the candidate tiles.
    Each program computes Δ = rowsum(dO ∘ O) of its rows (stored for `_attention_bwd_dkdv_kernel`, launched after
    it) and their dQ over the user's keys."""
    tile = tl.program_id(0)
    head = tl.program_id(1)
    if HAS_SELF:
        _dq_self_tile(
            tile, head, uq_ptr, stride_uqu, stride_uqh, stride_uql, uo_ptr, udo_ptr, duq_ptr, ulse_ptr, udelta_ptr,
            k_desc, v_desc, stride_ku, stride_kh, stride_kl, kv_len_ptr, num_users, seq_len, num_self_tiles, qk_scale,
            scale, HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, HAS_KV_LEN, NUM_STAGES,
        )
    else:
        _dq_target_tile(
            tile, head, q_ptr, stride_qb, stride_qh, stride_qs, o_ptr, do_ptr, dq_ptr, lse_ptr, delta_ptr, k_desc,
            v_desc, stride_ku, stride_kh, stride_kl, kv_len_ptr, order_ptr, tile_ptr, seq_len, num_queries, qk_scale,
            scale, HEAD_DIM, BLOCK_M, BLOCK_N, HAS_KV_LEN, NUM_STAGES,
        )
# fmt: on


_attention_bwd_dq_launch = CachedLaunch(_attention_bwd_dq_kernel)


# fmt: off
@triton.jit
def _dkdv_step(
    dk, dv, k, v, q, do, lse, delta, keys, rows, kv_len, qk_scale, MASK_KEYS: tl.constexpr, MASK_CAUSAL: tl.constexpr,
):
    """One step of a K/V block's walk over BLOCK_M query rows, transposed (keys are the rows here):
    Pᵀ = exp2(k·qᵀ·qk_scale − lse), dV += Pᵀ·dO, dSᵀ = Pᵀ ∘ (v·dOᵀ − Δ), dK += dSᵀ·q (scaled by the caller)."""
    s_t = tl.dot(k, tl.trans(q))  # [BLOCK_N, BLOCK_M] fp32
    dp_t = tl.dot(v, tl.trans(do))  # issued beside s_t: the exponentials overlap it (3 % faster than after them)
    p_t = tl.math.exp2(s_t * qk_scale - lse[None, :])
    if MASK_KEYS:
        p_t = tl.where((keys < kv_len)[:, None], p_t, 0.0)
    if MASK_CAUSAL:
        p_t = tl.where(keys[:, None] <= rows[None, :], p_t, 0.0)
    dv = tl.dot(p_t.to(do.dtype), do, dv)
    ds_t = p_t * (dp_t - delta[None, :])
    dk = tl.dot(ds_t.to(q.dtype), q, dk)
    return dk, dv
# fmt: on


# fmt: off
@triton.jit
def _dkdv_target_rows(
    dk, dv, k, v, q_ptr, stride_qb, stride_qh, stride_qs, do_ptr, lse_ptr, delta_ptr, q_desc, do_desc, order_ptr,
    first, row_lo, row_end, head, heads, num_queries, keys, kv_len, qk_scale, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, MASK_KEYS: tl.constexpr, NUM_STAGES: tl.constexpr, ROWS_TMA: tl.constexpr,
):
    """A K/V block's walk over its user's candidate query rows [row_lo, row_end) (virtual rows: candidate-major, S
    tokens; candidates from order[first …]; row_lo a multiple of BLOCK_M), BLOCK_M at a time; rows past row_end load
    as zeros with lse = +inf. ROWS_TMA (BLOCK_M divides S; q and dO contiguous): each step is BLOCK_M consecutive
    rows of one candidate, which q_desc and do_desc (views [B·H·S, d]) copy by TMA."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    if ROWS_TMA:
        for r0 in tl.range(row_lo, row_end, BLOCK_M, num_stages=NUM_STAGES):
            slot = r0 // num_queries
            cand = tl.load(order_ptr + first + slot)
            row0 = (cand * heads + head) * num_queries + (r0 - slot * num_queries)  # < 2**31 (launch check)
            q = q_desc.load([row0, 0])
            do = do_desc.load([row0, 0])
            lse = tl.load(lse_ptr + row0 + offs_m)
            delta = tl.load(delta_ptr + row0 + offs_m)
            dk, dv = _dkdv_step(dk, dv, k, v, q, do, lse, delta, keys, offs_m, kv_len, qk_scale, MASK_KEYS, False)
        return dk, dv
    for r0 in tl.range(row_lo, row_end, BLOCK_M, num_stages=NUM_STAGES):
        rows = r0 + offs_m
        row_ok = rows < row_end
        slot = rows // num_queries
        token = rows - slot * num_queries
        cand = tl.load(order_ptr + first + slot, mask=row_ok, other=0).to(tl.int64)
        q_rows = cand * stride_qb + head * stride_qh + token * stride_qs
        q = tl.load(q_ptr + (q_rows[:, None] + offs_d[None, :]), mask=row_ok[:, None], other=0.0)
        do, lse, delta = _row_grads(do_ptr, lse_ptr, delta_ptr, (cand * heads + head) * num_queries + token, row_ok,
                                    HEAD_DIM)
        dk, dv = _dkdv_step(dk, dv, k, v, q, do, lse, delta, keys, rows, kv_len, qk_scale, MASK_KEYS, False)
    return dk, dv
# fmt: on


# fmt: off
@triton.jit
def _dkdv_self_rows(
    dk, dv, k, v, uq_ptr, stride_uqu, stride_uqh, stride_uql, udo_ptr, ulse_ptr, udelta_ptr, user, head, heads,
    seq_len, lo, hi, keys, kv_len, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, MASK_KEYS: tl.constexpr,
    MASK_CAUSAL: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """A K/V block's walk over its user's own query rows [lo, hi), BLOCK_M at a time (rows ≥ hi load as zeros with
    lse = +inf). (Copying these rows by TMA as the candidate rows are measured 1 % slower: the extra loops spill.)"""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    base = user.to(tl.int64) * stride_uqu + head * stride_uqh
    first_row = (user.to(tl.int64) * heads + head) * seq_len
    for r0 in tl.range(lo, hi, BLOCK_M, num_stages=NUM_STAGES):
        rows = r0 + offs_m
        row_ok = rows < hi
        q = tl.load(uq_ptr + (base + rows[:, None] * stride_uql + offs_d[None, :]), mask=row_ok[:, None], other=0.0)
        do, lse, delta = _row_grads(udo_ptr, ulse_ptr, udelta_ptr, first_row + rows, row_ok, HEAD_DIM)
        dk, dv = _dkdv_step(dk, dv, k, v, q, do, lse, delta, keys, rows, kv_len, qk_scale, MASK_KEYS, MASK_CAUSAL)
    return dk, dv
# fmt: on


@triton.jit
def _kv_lens(kv_len_ptr, idx, live, seq_len, HAS_KV_LEN: tl.constexpr):
    """Valid keys of users `idx` (where live), clamped to [0, L]."""
    if HAS_KV_LEN:
        return tl.minimum(tl.maximum(tl.load(kv_len_ptr + idx, mask=live, other=0).to(tl.int32), 0), seq_len)
    return tl.where(live, seq_len, 0)


@triton.jit
def _ranked_user(rank, users_ptr, kv_len_ptr, num_users, num_queries, seq_len, HAS_SELF: tl.constexpr,
                 HAS_KV_LEN: tl.constexpr, MAX_USERS: tl.constexpr):  # fmt: skip
    """The user of `rank` when users are ordered by the query rows their K/V blocks walk (most first, ties by user
    number): every program counts the ≤ MAX_USERS users' rows itself, so the longest walks start first."""
    idx = tl.arange(0, MAX_USERS)
    live = idx < num_users
    work = tl.load(users_ptr + 2 * idx + 1, mask=live, other=0) * num_queries
    if HAS_SELF:
        work += _kv_lens(kv_len_ptr, idx, live, seq_len, HAS_KV_LEN)
    work = tl.where(live, work, -1)
    ahead = (work[None, :] > work[:, None]) | ((work[None, :] == work[:, None]) & (idx[None, :] < idx[:, None]))
    ranks = tl.sum(ahead.to(tl.int32), 1)  # rank of each user
    return tl.sum(tl.where(live & (ranks == rank), idx, 0), 0)


# fmt: off
@triton.jit(do_not_specialize=["num_users", "seq_len"])
def _attention_bwd_dkdv_kernel(
    q_ptr, stride_qb, stride_qh, stride_qs,  # [B, H, S, D] candidate queries
    do_ptr, lse_ptr, delta_ptr,  # [B, H, S, D] contiguous gradient of the output, [B, H, S] fp32 lse and Δ
    uq_ptr, stride_uqu, stride_uqh, stride_uql,  # [U, H, L, D] user queries (unused without HAS_SELF)
    udo_ptr, ulse_ptr, udelta_ptr,  # [U, H, L, D] contiguous gradient of user_out, [U, H, L] fp32 lse and Δ
    k_desc, v_desc, stride_ku, stride_kh, stride_kl,  # as `_attention_kernel`, blocks [BLOCK_N, D]
    q_desc, do_desc,  # ROWS_TMA: [B·H·S, D] views of q and dO, blocks [BLOCK_M, D] (else stand-ins)
    dk_ptr, dv_ptr,  # [U, H, L, D] contiguous out (fp32 and zeroed where SPLIT)
    kv_len_ptr, order_ptr, users_ptr,  # kv_len [U] (unused without HAS_KV_LEN), the plan's order, users [U, 2]
    num_users, heads, seq_len, num_queries, splits, qk_scale, scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SELF: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_KV_LEN: tl.constexpr, RANK_USERS: tl.constexpr, NUM_STAGES: tl.constexpr,
    ROWS_TMA: tl.constexpr, SPLIT: tl.constexpr,
):
    """1-D grid over (user rank, split, head, key block), key blocks fastest: a program owns K/V[u, h] rows
    [BLOCK_N·j, BLOCK_N·j + BLOCK_N) in registers and walks its split's share of user u's candidate query rows (the
    first split also u's own rows that see the block, with HAS_SELF), accumulating dK and dV in fp32; each block is
    written once, zeros past kv_len, or with SPLIT (splits > 1) added atomically into fp32 dK, dV. The blocks of one
    (user, split, head) run side by side and read the same q / dO rows (L2). RANK_USERS > 0 (a power of two ≥ U):
    users with the longest walks first; 0: grid order."""
    num_blocks = tl.cdiv(seq_len, BLOCK_N)
    pid = tl.program_id(0)
    block = pid % num_blocks
    head = (pid // num_blocks) % heads
    split = (pid // (num_blocks * heads)) % splits
    rank = pid // (num_blocks * heads * splits)
    if RANK_USERS > 0:
        user = _ranked_user(rank, users_ptr, kv_len_ptr, num_users, num_queries, seq_len, HAS_SELF, HAS_KV_LEN,
                            RANK_USERS)  # fmt: skip
    else:
        user = rank
    kv_len = _kv_len(kv_len_ptr, user, seq_len, HAS_KV_LEN)
    start_n = block * BLOCK_N
    keys = start_n + tl.arange(0, BLOCK_N)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    if start_n < kv_len:
        kv_offset = user.to(tl.int64) * stride_ku + head * stride_kh
        kv_row = (kv_offset // stride_kl).to(tl.int32) + start_n
        kv_col = (kv_offset % stride_kl).to(tl.int32)
        k = k_desc.load([kv_row, kv_col])  # [BLOCK_N, D]
        v = v_desc.load([kv_row, kv_col])
        first = tl.load(users_ptr + 2 * user)
        row_end = tl.load(users_ptr + 2 * user + 1) * num_queries
        chunk = tl.cdiv(tl.cdiv(row_end, splits), BLOCK_M) * BLOCK_M
        row_lo = tl.minimum(split * chunk, row_end)
        row_end = tl.minimum(row_lo + chunk, row_end)
        if start_n + BLOCK_N <= kv_len:
            dk, dv = _dkdv_target_rows(
                dk, dv, k, v, q_ptr, stride_qb, stride_qh, stride_qs, do_ptr, lse_ptr, delta_ptr, q_desc, do_desc,
                order_ptr, first, row_lo, row_end, head, heads, num_queries, keys, kv_len, qk_scale, HEAD_DIM, BLOCK_M,
                False, NUM_STAGES, ROWS_TMA,
            )
        else:
            dk, dv = _dkdv_target_rows(
                dk, dv, k, v, q_ptr, stride_qb, stride_qh, stride_qs, do_ptr, lse_ptr, delta_ptr, q_desc, do_desc,
                order_ptr, first, row_lo, row_end, head, heads, num_queries, keys, kv_len, qk_scale, HEAD_DIM, BLOCK_M,
                True, NUM_STAGES, ROWS_TMA,
            )
        if HAS_SELF and split == 0:
            if CAUSAL:  # rows before the block see none of its keys; the first BLOCK_N rows from it, some
                diag_end = tl.minimum(start_n + tl.cdiv(BLOCK_N, BLOCK_M) * BLOCK_M, kv_len)
                dk, dv = _dkdv_self_rows(
                    dk, dv, k, v, uq_ptr, stride_uqu, stride_uqh, stride_uql, udo_ptr, ulse_ptr, udelta_ptr, user,
                    head, heads, seq_len, start_n, diag_end, keys, kv_len, qk_scale, HEAD_DIM, BLOCK_M, True, True,
                    NUM_STAGES,
                )
                lo = diag_end
            else:
                lo = 0
            if start_n + BLOCK_N <= kv_len:
                dk, dv = _dkdv_self_rows(
                    dk, dv, k, v, uq_ptr, stride_uqu, stride_uqh, stride_uql, udo_ptr, ulse_ptr, udelta_ptr, user,
                    head, heads, seq_len, lo, kv_len, keys, kv_len, qk_scale, HEAD_DIM, BLOCK_M, False, False,
                    NUM_STAGES,
                )
            else:
                dk, dv = _dkdv_self_rows(
                    dk, dv, k, v, uq_ptr, stride_uqu, stride_uqh, stride_uql, udo_ptr, ulse_ptr, udelta_ptr, user,
                    head, heads, seq_len, lo, kv_len, keys, kv_len, qk_scale, HEAD_DIM, BLOCK_M, True, False,
                    NUM_STAGES,
                )
    offs_d = tl.arange(0, HEAD_DIM)
    at = ((user.to(tl.int64) * heads + head) * seq_len + keys)[:, None] * HEAD_DIM + offs_d[None, :]
    key_ok = (keys < seq_len)[:, None]
    if SPLIT:
        if start_n < kv_len:  # the buffers start at zero
            tl.atomic_add(dk_ptr + at, dk * scale, mask=key_ok, sem="relaxed")
            tl.atomic_add(dv_ptr + at, dv, mask=key_ok, sem="relaxed")
    else:
        tl.store(dk_ptr + at, (dk * scale).to(dk_ptr.dtype.element_ty), mask=key_ok)
        tl.store(dv_ptr + at, dv.to(dv_ptr.dtype.element_ty), mask=key_ok)
# fmt: on


_attention_bwd_dkdv_launch = CachedLaunch(_attention_bwd_dkdv_kernel)


# ---------------------------------------------------------------------------------------------
# Host side: checks, torch paths, launches
# ---------------------------------------------------------------------------------------------


def _check_kv(k, v):
    check_tensor("k", k, 4, FLOAT_TYPES)
    check_tensor("v", v, 4, FLOAT_TYPES)
    check_same("v", list(v.shape), "k's shape [U, H, L, d]", list(k.shape))
    if v.dtype != k.dtype or v.device != k.device:
        raise ValueError(f"v: expected {k.dtype} on {k.device} like k, got {v.dtype} on {v.device}")


def _check_queries(name, q, k, expected_rows_name=None, expected_rows=None):
    check_tensor(name, q, 4, FLOAT_TYPES)
    check_same(name, q.shape[1], "H (dim 1 of k)", k.shape[1])
    check_same(name, q.shape[3], "d (dim 3 of k)", k.shape[3])
    if expected_rows is not None:
        check_same(name, q.shape[2], expected_rows_name, expected_rows)
    if q.dtype != k.dtype or q.device != k.device:
        raise ValueError(f"{name}: expected {k.dtype} on {k.device} like k, got {q.dtype} on {q.device}")


def _key_mask(kv_len, seq_len):
    """[U, 1, 1, L] bool: key j of user u is valid when j < kv_len[u]."""
    return (torch.arange(seq_len, device=kv_len.device) < kv_len[:, None])[:, None, None, :]


def _target_attention_torch(q, k, v, cand_to_user, kv_len, scale):
    num_candidates, heads, num_queries, head_dim = q.shape
    num_users, _, seq_len, _ = k.shape
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    if num_candidates == 0:
        return out
    order, counts, _ = group_by_user(cand_to_user, num_users)
    key_mask = _key_mask(kv_len, seq_len)
    start = 0
    for user, count in enumerate(counts.tolist()):
        if count == 0:
            continue
        rows = order[start : start + count]
        start += count
        if int(kv_len[user]) == 0:
            continue
        # all S query tokens of all this user's candidates in one query block: [1, H, count·S, d]
        block = q[rows].permute(1, 0, 2, 3).reshape(1, heads, count * num_queries, head_dim)
        attended = F.scaled_dot_product_attention(
            block, k[user : user + 1], v[user : user + 1], attn_mask=key_mask[user : user + 1], scale=scale
        )
        out[rows] = attended.reshape(heads, count, num_queries, head_dim).permute(1, 0, 2, 3)
    return out


def _self_attention_torch(user_q, k, v, kv_len, causal, scale):
    seq_len = k.shape[2]
    mask = _key_mask(kv_len, seq_len)
    if causal:
        mask = mask & torch.ones(seq_len, seq_len, dtype=torch.bool, device=k.device).tril()
    out = F.scaled_dot_product_attention(user_q, k, v, attn_mask=mask, scale=scale)
    valid_rows = torch.arange(seq_len, device=k.device) < kv_len[:, None]  # [U, L]
    return out.masked_fill(~valid_rows[:, None, :, None], 0.0)


def _softmax_grads(q, k, v, grad_out, scale, mask=None):
    """Gradients of softmax(scale·q·kᵀ)·v in fp32 (fp64 for fp64 inputs): q [..., M, d], k/v [..., N, d], grad_out
    [..., M, d], mask [..., M, N] bool or None; a row without a valid key has output 0 and gradient 0.
    → (dq, dk, dv) in the compute dtype."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v, grad_out = (t.to(compute) for t in (q, k, v, grad_out))
    scores = scale * q @ k.transpose(-1, -2)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    if mask is not None:
        p = p.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0)  # no valid key: NaN → 0
    dp = grad_out @ v.transpose(-1, -2)
    ds = p * (dp - (p * dp).sum(dim=-1, keepdim=True))  # Σ_j p·dp = Σ_d dO·O
    return scale * ds @ k, scale * ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ grad_out


def _target_attention_torch_backward(grad_out, q, k, v, cand_to_user, kv_len, scale):
    """(dq, dk, dv) of `_target_attention_torch`: per user, its candidates' queries as one block against its valid
    keys (one K/V read), so dK[u] and dV[u] come out summed over the user's candidates; nothing at B rows but q's."""
    num_candidates, heads, num_queries, head_dim = q.shape
    num_users = k.shape[0]
    dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    if num_candidates == 0:
        return dq, dk, dv
    order, counts, _ = group_by_user(cand_to_user, num_users)
    lengths = kv_len.tolist()
    start = 0
    for user, count in enumerate(counts.tolist()):
        rows = order[start : start + count]
        start += count
        keys = lengths[user]
        if count == 0 or keys == 0:
            continue
        # [H, count·S, d], as the forward's query block
        block, grad = (t[rows].permute(1, 0, 2, 3).reshape(heads, count * num_queries, head_dim) for t in (q, grad_out))
        block_dq, dk[user, :, :keys], dv[user, :, :keys] = _softmax_grads(
            block, k[user, :, :keys], v[user, :, :keys], grad, scale
        )
        dq[rows] = block_dq.reshape(heads, count, num_queries, head_dim).permute(1, 0, 2, 3).to(dq.dtype)
    return dq, dk, dv


def _self_attention_torch_backward(grad_user_out, user_q, k, v, kv_len, causal, scale):
    """(duser_q, dk, dv) of `_self_attention_torch`, all users at once at U rows; rows past kv_len (zeros in the
    forward) get no gradient."""
    seq_len = k.shape[2]
    positions = torch.arange(seq_len, device=k.device)
    valid = positions < kv_len[:, None]  # [U, L]
    mask = (valid[:, :, None] & valid[:, None, :])[:, None]  # [U, 1, L, L]: row and key within the history
    if causal:
        mask = mask & (positions[None, :] <= positions[:, None])
    duq, dk, dv = _softmax_grads(user_q, k, v, grad_user_out, scale, mask)
    return duq.to(user_q.dtype), dk, dv


def _choose_backend(backend, k) -> str:
    """ "auto" → Triton for CUDA bf16/fp16 with d ∈ TRITON_HEAD_DIMS, else torch; "triton" insists."""
    runnable = interpreting() or k.device.type == "cuda"
    chosen = resolve_backend(backend, k.device if runnable else torch.device("cpu"), triton_available=True)
    if backend == "auto" and chosen == "triton" and (k.dtype not in TRITON_TYPES or k.shape[3] not in TRITON_HEAD_DIMS):
        return "torch"
    if chosen == "triton":
        if not runnable:
            raise ValueError(f"backend: 'triton' needs CUDA tensors (or TRITON_INTERPRET=1), got k on {k.device}")
        if k.dtype not in TRITON_TYPES:
            raise ValueError(
                f"k: backend 'triton' expects dtype float16 or bfloat16, got {str(k.dtype).replace('torch.', '')}"
            )
        if k.shape[3] not in TRITON_HEAD_DIMS:
            raise ValueError(f"k: backend 'triton' expects d in {TRITON_HEAD_DIMS}, got {k.shape[3]}")
    return chosen


def kv_2d_views(k, v):
    """k and v as 2-D row views for TMA: key n of (u, h) is row (u·s_u + h·s_h) // s_l + n, columns
    from (u·s_u + h·s_h) % s_l, for strides s_u, s_h, s_l of [U, H, L, ·]. That covers contiguous
    [U, H, L, d] and [U, L, H, d] storage (also inside a wider fused-QKV row) without a copy; other
    layouts are copied once at U rows (never replicated). Returns (k, v, rows, (s_u, s_h, s_l)): the
    views are [rows, s_l] with strides [s_l, 1] over k's and v's storage."""
    num_users, heads, seq_len, head_dim = k.shape

    def viewable(t):
        s_u, s_h, s_l, s_d = t.stride()
        if s_d != 1 or s_l < head_dim or (s_l * t.element_size()) % 16 or t.data_ptr() % 16 or s_u % s_l:
            return False
        return s_h % s_l == 0 or (heads - 1) * s_h + head_dim <= s_l

    if k.stride() != v.stride() or not (viewable(k) and viewable(v)):
        k, v = k.contiguous(), v.contiguous()
    s_u, s_h, s_l, _ = k.stride()
    rows = ((num_users - 1) * s_u + (heads - 1) * s_h) // s_l + seq_len
    if rows >= 2**31:
        raise ValueError(f"k: {rows} rows of K/V exceed the int32 TMA coordinate range")
    return k, v, rows, (s_u, s_h, s_l)


def _kv_views(k, v, block_n, *more_block_ns, bind=NOW):
    """TMA descriptors over the 2-D views of `kv_2d_views`, blocks [block_n, d] → (k_desc, v_desc, strides), then a
    (k_desc, v_desc) pair for each of `more_block_ns` over the same views (`bind`: kernels._launch)."""
    k, v, rows, strides = kv_2d_views(k, v)
    pairs = [
        tuple(bind.desc(TensorDescriptor, t, [rows, strides[2]], [strides[2], 1], [n, k.shape[3]]) for t in (k, v))
        for n in (block_n, *more_block_ns)
    ]
    return (*pairs[0], strides, *pairs[1:])


def lse_size(q_shape, k_shape, with_self: bool) -> int:
    """Elements of the forward's log-sum-exp buffer: B·H·S candidate rows, then U·H·L user rows with self-attention."""
    return math.prod(q_shape[:3]) + (math.prod(k_shape[:3]) if with_self else 0)


def split_lse(lse, q_shape, k_shape, with_self: bool):
    """The forward's flat log-sum-exp buffer (or the backward's Δ buffer, laid out alike) → (candidate rows [B, H, S],
    user rows [U, H, L] or None)."""
    cand_rows = math.prod(q_shape[:3])
    user = lse[cand_rows:].view(k_shape[:3]) if with_self else None
    return lse[:cand_rows].view(q_shape[:3]), user


def plan_buffers(num_candidates: int, max_tiles: int, device, recording: Recording | None = None):
    """(flag [1], order [B], tiles [max_tiles, 4]) int32 views of one allocation (named "plan" in `recording`), each
    starting on a 16-byte boundary for any B: Triton specializes pointers on 16-byte alignment, so parts whose
    offsets moved with B would compile the kernels again on the request path. Not initialized (no
    fill launch on the host's path): `_plan_kernel` writes the flag, the two words after it (the Gluon
    kernel's item counter and finished-program count, attention_ws DYNAMIC; each launch leaves them
    zero) and every tile slot, also when a mapping value is out of range (the attention kernel runs
    before the host sees the flag, and an unwritten slot would send it reading out of bounds). `order` entries of out-of-range candidates stay unwritten; no tile refers to them."""
    order_at = 4
    tiles_at = order_at + triton.cdiv(num_candidates, 4) * 4
    buf = named(recording, "plan", torch.empty(tiles_at + 4 * max_tiles, dtype=torch.int32, device=device))
    return buf[:1], buf[order_at : order_at + num_candidates], buf[tiles_at:].view(max_tiles, 4)


def plan_tiles(
    cand_to_user,
    num_users: int,
    num_queries: int,
    block_m: int,
    kv_len=None,
    seq_len: int = 0,
    users=None,
    host_flag=None,
    recording: Recording | None = None,
):
    """Run `_plan_kernel` → (order [B] int32, tiles [max_tiles, 4] int32, max_tiles, flag [1] int32),
    with max_tiles = B·S // BLOCK_M + U, known without a device→host sync. flag is 1 when a
    mapping value lies outside [0, U) or a kv_len value outside [0, L]. With `users` ([U, 2] int32) each
    user's (first candidate slot in `order`, candidate count) is written there too (the backward's table); with
    `host_flag` (a pinned host word, `HostFlag.slot`) 1 + the flag too; with `recording` the launch is kept for
    replay (kernels._launch)."""
    num_candidates = cand_to_user.shape[0]
    max_tiles = num_candidates * num_queries // block_m + num_users
    flag, order, tiles = plan_buffers(num_candidates, max_tiles, cand_to_user.device, recording)

    def build(bind):
        return (
            bind.ptr(cand_to_user), bind.ptr(cand_to_user if kv_len is None else kv_len), bind.ptr(order),
            bind.ptr(tiles), bind.ptr(flag), bind.ptr(flag if users is None else users),
            bind.ptr(flag if host_flag is None else host_flag), num_candidates, num_users, seq_len, num_queries,
        )  # fmt: skip

    launch(
        _plan_launch, (num_users,), build, recording,
        HAS_KV_LEN=kv_len is not None, BLOCK_M=block_m, CHUNK=64 if interpreting() else 1024,
        HAS_USERS=users is not None, HOST_FLAG=host_flag is not None, num_warps=4,
    )  # fmt: skip
    return order, tiles, max_tiles, flag


# fmt: off
def _launch(
    q, k, v, cand_to_user, kv_len, scale, user_q=None, causal=True, config=None, out=None, user_out=None, plan=None,
    host_flag=None, lse=None, recording=None,
):
    """Triton path. q [B, H, S, d] (B may be 0), k/v [U, H, L, d] (U ≥ 1), kv_len [U] int32/int64 or
    None; with user_q [U, H, L, d] the self-attention tiles run in the same grid. `out` / `user_out`
    may be given (the tests poison them), and `plan` (from `plan_tiles` with the same BLOCK_M) when
    one batch's grouping serves several calls; with `host_flag` (a pinned host word) the plan writes 1 + its flag
    there too.
    With `lse` (fp32, `lse_size` elements) the rows' log-sum-exp for the backward goes there: the candidate rows
    [B, H, S] first, then the user rows [U, H, L] (`split_lse`); the Gluon kernel writes it where it runs, into
    contiguous outputs. With `recording` the launches are kept for replay (kernels._launch). Nothing here waits for
    the device.
    Returns (out, user_out or None, flag): flag [1] int32 is 1 when an index value was out of range."""
    num_candidates, heads, num_queries, head_dim = q.shape
    num_users, _, seq_len, _ = k.shape
    if out is None:
        out = named(recording, "out", torch.empty_like(q, memory_format=torch.contiguous_format))
    if user_q is not None and user_out is None:
        user_out = named(recording, "user_out", torch.empty_like(user_q, memory_format=torch.contiguous_format))
    if config is None:
        dims = (heads, seq_len, num_queries, head_dim, user_q is not None)
        config = tuned_config("attention", q.device, q.dtype, dims, num_users, num_candidates)
    if (config is None or config == WS_CHOICE) and plan is None and not interpreting():
        from .attention_ws import (  # here: attention_ws imports this module
            launch_ws,
            prefer_ws,
            self_target_ws_ok,
            ws_supported,
        )

        # Hopper, bf16/fp16, d ∈ {64, 128}: the shapes where it is the faster kernel (`prefer_ws`), or wherever
        # tuned; self tiles where rows align
        if config is None:
            takes_ws = prefer_ws(q, k, kv_len, user_q is not None)
        else:
            takes_ws = ws_supported(q, k)
        if takes_ws and (user_q is None or self_target_ws_ok(q, out, user_q, user_out)):
            out, flag = launch_ws(
                q, k, v, cand_to_user, kv_len, scale, out=out, host_flag=host_flag, user_q=user_q, user_out=user_out,
                causal=causal, lse=lse, recording=recording,
            )
            return out, user_out, flag
    if config == WS_CHOICE:
        config = None
    if config is None:
        rows_per_user = num_candidates * num_queries / num_users + (0 if user_q is None else seq_len)
        config = pick_config(rows_per_user, interpreting())
    if plan is None:
        plan = plan_tiles(
            cand_to_user, num_users, num_queries, config.block_m, kv_len, seq_len, host_flag=host_flag,
            recording=recording,
        )  # fmt: skip
    order, tiles, max_tiles, flag = plan
    if heads * seq_len == 0 or (num_candidates == 0 and user_q is None):
        fail(recording)
        out.zero_()
        if lse is not None:
            lse.fill_(float("inf"))
        return out, None if user_out is None else user_out.zero_(), flag
    q = q if q.stride(-1) == 1 else q.contiguous()  # queries are gathered by rows: any other stride
    if user_q is not None and user_q.stride(-1) != 1:
        user_q = user_q.contiguous()
    num_self_tiles = 0 if user_q is None else num_users * triton.cdiv(seq_len, config.block_m)
    num_target_tiles = max_tiles if num_candidates else 0  # empty slots read q[0]: needs a candidate
    num_tiles = num_self_tiles + num_target_tiles
    grid = (num_tiles, heads)
    uq, uo = (q, out) if user_q is None else (user_q, user_out)
    cand_lse, user_lse = (out, out) if lse is None else split_lse(lse, q.shape, k.shape, user_q is not None)

    def build(bind):
        k_desc, v_desc, (stride_ku, stride_kh, stride_kl) = _kv_views(k, v, config.block_n, bind=bind)
        return (
            bind.ptr(q), q.stride(0), q.stride(1), q.stride(2),
            bind.ptr(out), out.stride(0), out.stride(1), out.stride(2),
            bind.ptr(uq), uq.stride(0), uq.stride(1), uq.stride(2),
            bind.ptr(uo), uo.stride(0), uo.stride(1), uo.stride(2),
            bind.ptr(cand_lse), bind.ptr(cand_lse if user_lse is None else user_lse),
            k_desc, v_desc, stride_ku, stride_kh, stride_kl,
            bind.ptr(order if kv_len is None else kv_len), bind.ptr(order), bind.ptr(tiles),
            num_users, seq_len, num_queries,
            num_self_tiles, scale * LOG2E,
        )

    launch(
        _attention_launch, grid, build, recording,
        HEAD_DIM=head_dim, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        HAS_SELF=user_q is not None, CAUSAL=causal, HAS_KV_LEN=kv_len is not None, WRITE_LSE=lse is not None,
        NUM_STAGES=config.num_stages, WARP_SPECIALIZE=config.warp_specialize,
        num_warps=config.num_warps, maxnreg=config.maxnreg,
    )
    return out, user_out, flag
# fmt: on


def pick_backward_configs(rows_per_user: float, head_dim: int, interpret: bool) -> tuple[TileConfig, TileConfig]:
    """(dQ kernel tiles: BLOCK_M query rows × BLOCK_N keys a step, the forward's tiles with three products a step
    instead of two, so no register cap (190 registers at d = 128), three stages from 128 rows a user; dK/dV kernel
    tiles: BLOCK_M = 64 query rows a step × BLOCK_N = 128 keys a program, 8 warps, whose fp32 dK and dV [128, d]
    stay in registers for the whole walk (235 registers at d = 128 with the rows copied by TMA, 255 and a few
    spilled without); 32 rows a step measured 25 % slower, 64-key blocks 45 % (docs/design/attention.md).
    rows_per_user: the query rows a user's keys see (B·S / U for the candidate tiles, L for the self tiles)."""
    if interpret:
        return TileConfig(16, 16, num_warps=4, num_stages=1), TileConfig(16, 32, num_warps=4, num_stages=1)
    if rows_per_user <= 64:
        dq = TileConfig(64, 64, num_warps=4, num_stages=2)
    else:
        dq = TileConfig(128, 64, num_warps=8, num_stages=3)
    return dq, TileConfig(64, 128, num_warps=8, num_stages=2)


DKDV_ROWS_TMA = True  # the dK/dV walk copies q and dO rows by TMA where `rows_by_tma` allows
WS_BACKWARD = True  # target-only backward through attention_ws's warp-specialized dQ and dK/dV kernels where
# `attention_ws.dkdv_ws_ok` (Hopper, 16-bit, d ∈ {64, 128}, q / dO rows by TMA)


def rows_by_tma(t: torch.Tensor, other: torch.Tensor, block_rows: int) -> bool:
    """Whether t [·, H, R, d] and `other` (its output or gradient, same shape) can move by TMA as [·H·R, d] row
    views, block_rows rows at a time, each block one contiguous run of one (row, head): R a multiple of
    block_rows, both contiguous with 16-byte aligned base and rows, row numbers within TMA's int32 coordinates."""
    rows, heads, per_row, _ = t.shape
    return (
        per_row % block_rows == 0
        and all(x.is_contiguous() and x.data_ptr() % 16 == 0 and x.shape[-1] * x.element_size() % 16 == 0
                for x in (t, other))
        and rows * heads * per_row < 2**31
    )  # fmt: skip


def _row_views(q: torch.Tensor, grad_out: torch.Tensor, block_m: int, bind=NOW):
    """Descriptors over the [B·H·S, d] row views of q and dO, blocks [block_m, d] (`bind`: kernels._launch)."""
    head_dim = q.shape[3]
    return [
        bind.desc(TensorDescriptor, t, [t.numel() // head_dim, head_dim], [head_dim, 1], [block_m, head_dim])
        for t in (q, grad_out)
    ]


DKDV_WAVES = 2  # the dK/dV grid splits users' walks until it has this many programs an SM (where walks are long)
DKDV_MIN_STEPS = 64  # steps of BLOCK_M rows a part walks at least, on average (shorter: the zeroed fp32
# buffers and their copies cost more than the parallelism gains; on the H200 at U = 1, B = 64, S = 64, 16 parts
# were slower than one)


def dkdv_splits(programs: int, rows_per_user: float, kv_cfg: TileConfig, device: torch.device) -> int:
    """Into how many parts the dK/dV kernel splits each user's walk over its candidate rows: 1 (each block written
    once) where the (user, head, key block) programs fill DKDV_WAVES programs an SM, else enough parts for that,
    each walking DKDV_MIN_STEPS steps or more on average (few users with many candidates each)."""
    if interpreting() or device.type != "cuda" or programs == 0:
        return 1
    wanted = triton.cdiv(DKDV_WAVES * _hopper.device_info(device)[1], programs)
    return max(1, min(wanted, int(rows_per_user // (DKDV_MIN_STEPS * kv_cfg.block_m))))


RANKED_USERS = 64  # up to this many users, the dK/dV programs of the users with the most query rows start first


# fmt: off
def _launch_backward(
    grad_out, q, k, v, out, lse, cand_to_user, kv_len, scale, user_q=None, grad_user_out=None, user_out=None,
    causal=True, grads=None, config=None, recording=None,
):
    """Triton backward of `_launch`'s attention: out, lse from its forward (lse: `lse_size` fp32 elements), grad_out
    (and with user_q, grad_user_out) the gradients of its outputs. Launches: the plan (with each user's candidate
    range), `_attention_bwd_dq_kernel` (Δ = rowsum(dO ∘ O) and dQ, over the forward's tiles: once for the self
    tiles, once for the candidate tiles) and `_attention_bwd_dkdv_kernel` (dK, dV, each user's K/V blocks walking
    its query rows). `grads` (dq, dk, dv, duq) may be given, contiguous (the tests poison them); `config` (dQ tiles,
    dK/dV tiles) overrides `pick_backward_configs`. With `recording` the steps are kept for replay (kernels._launch;
    the gradients named "dq", "dk", "dv", "duq"). Nothing here waits for the device; bad index values read and
    write nothing out of bounds (their rows of dq are left unwritten). Returns (dq, dk, dv, duq or None)."""
    num_candidates, heads, num_queries, head_dim = q.shape
    num_users, _, seq_len, _ = k.shape
    with_self = user_q is not None
    if grads is None:
        grads = [named(recording, n, torch.empty(t.shape, dtype=t.dtype, device=t.device))
                 for n, t in (("dq", q), ("dk", k), ("dv", v))]  # fmt: skip
        duq = torch.empty(user_q.shape, dtype=q.dtype, device=q.device) if with_self else None
        grads.append(None if duq is None else named(recording, "duq", duq))
    else:
        fail(recording)
    dq, dk, dv, duq = grads
    if num_users * heads * seq_len == 0 or (num_candidates == 0 and not with_self):
        fail(recording)
        return dq.zero_(), dk.zero_(), dv.zero_(), None if duq is None else duq.zero_()
    dq_cfg, kv_cfg = config or pick_backward_configs(num_candidates * num_queries / num_users, head_dim, interpreting())
    self_cfg = config[0] if config else pick_backward_configs(seq_len, head_dim, interpreting())[0]
    users = named(recording, "users", torch.empty(num_users, 2, dtype=torch.int32, device=q.device))
    order, tiles, max_tiles, _ = plan_tiles(
        cand_to_user, num_users, num_queries, dq_cfg.block_m, kv_len, seq_len, users, recording=recording
    )
    delta = named(recording, "delta", torch.empty_like(lse))
    cand_lse, user_lse = split_lse(lse, q.shape, k.shape, with_self)
    cand_delta, user_delta = split_lse(delta, q.shape, k.shape, with_self)
    given = (q, grad_out, out) + ((user_q, grad_user_out, user_out) if with_self else ())
    q = q if q.stride(-1) == 1 else q.contiguous()  # gathered by rows: any other stride
    grad_out, out = grad_out.to(q.dtype).contiguous(), out.contiguous()  # rows of [B·H·S, d], as dq and lse
    if with_self:
        user_q = user_q if user_q.stride(-1) == 1 else user_q.contiguous()
        grad_user_out, user_out = grad_user_out.to(q.dtype).contiguous(), user_out.contiguous()
    else:  # the self arguments stand for themselves, unused
        user_q, grad_user_out, user_out, duq, user_lse, user_delta = q, grad_out, out, dq, cand_lse, cand_delta
    if any(a is not b for a, b in zip(given, (q, grad_out, out, user_q, grad_user_out, user_out), strict=False)):
        fail(recording)  # copies made for this call
    kv_len_arg = order if kv_len is None else kv_len
    num_self_tiles = num_users * triton.cdiv(seq_len, self_cfg.block_m) if with_self else 0
    num_target_tiles = max_tiles if num_candidates else 0  # empty slots read q[0]: needs a candidate
    qk_scale = scale * LOG2E
    ws = WS_BACKWARD and config is None and not interpreting()
    if ws:
        from . import attention_ws  # here: attention_ws imports this module

        ws = attention_ws.dkdv_ws_ok(q, grad_out, k)
    if ws and dq_cfg.block_m == attention_ws.TILE_M:  # the candidate tiles' dQ and Δ through the Gluon kernel
        attention_ws.launch_dq_ws(
            q, grad_out, out, k, v, cand_lse, cand_delta, kv_len, scale, order, tiles, num_target_tiles, dq,
            recording=recording,
        )  # fmt: skip
        num_target_tiles = 0
    # dQ and Δ: the self tiles and the candidate tiles in launches of their own (each its own stages and tiles)
    for has_self, num_tiles, cfg in ((True, num_self_tiles, self_cfg), (False, num_target_tiles, dq_cfg)):
        if num_tiles == 0:
            continue

        def build(bind, cfg=cfg):
            kd, vd, (stride_ku, stride_kh, stride_kl) = _kv_views(k, v, cfg.block_n, bind=bind)
            return (
                bind.ptr(q), q.stride(0), q.stride(1), q.stride(2), bind.ptr(out), bind.ptr(grad_out), bind.ptr(dq),
                bind.ptr(cand_lse), bind.ptr(cand_delta), bind.ptr(user_q), user_q.stride(0), user_q.stride(1),
                user_q.stride(2), bind.ptr(user_out), bind.ptr(grad_user_out), bind.ptr(duq), bind.ptr(user_lse),
                bind.ptr(user_delta), kd, vd, stride_ku, stride_kh, stride_kl, bind.ptr(kv_len_arg), bind.ptr(order),
                bind.ptr(tiles), num_users, seq_len, num_queries, num_self_tiles, qk_scale, scale,
            )

        launch(
            _attention_bwd_dq_launch, (num_tiles, heads), build, recording,
            HEAD_DIM=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HAS_SELF=has_self, CAUSAL=causal,
            HAS_KV_LEN=kv_len is not None, NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps, maxnreg=cfg.maxnreg,
        )
    num_blocks = triton.cdiv(seq_len, kv_cfg.block_n)
    splits = dkdv_splits(num_users * heads * num_blocks, num_candidates * num_queries / num_users, kv_cfg, q.device)
    acc = None  # fp32 dK, dV added into: where the walks are split, or the self rows are added by a second walk
    if splits > 1:
        acc = _zeroed_acc(dk, recording)
    if ws:  # dK, dV through the Gluon kernel: the self rows too where they move by TMA, else the Triton walk below
        self_rows = with_self and attention_ws.self_rows_by_tma(user_q, grad_user_out)
        if with_self and not self_rows and splits == 1:
            acc = _zeroed_acc(dk, recording)
        dk_acc, dv_acc = (dk, dv) if acc is None else (acc[0], acc[1])
        attention_ws.launch_dkdv_ws(
            q, grad_out, k, v, lse, delta, kv_len, scale, order, users, dk_acc, dv_acc, splits,
            accumulate=with_self and not self_rows, user_q=user_q if self_rows else None,
            grad_user_out=grad_user_out, causal=causal, recording=recording,
        )
        if not with_self or self_rows:
            if acc is not None:
                call(recording, _copy_out, acc, dk, dv)
            return dq, dk, dv, duq if with_self else None
        fail(recording)  # (the walk of the users' own rows below takes a zeroed users table)
        users, splits = torch.zeros_like(users), 1  # the walk below: each user's own rows only, added in
    dk_acc, dv_acc = (dk, dv) if acc is None else (acc[0], acc[1])
    rows_tma = DKDV_ROWS_TMA and num_candidates > 0 and rows_by_tma(q, grad_out, kv_cfg.block_m)

    def build_dkdv(bind):
        kv_k_desc, kv_v_desc, (stride_ku, stride_kh, stride_kl) = _kv_views(k, v, kv_cfg.block_n, bind=bind)
        q_desc, do_desc = _row_views(q, grad_out, kv_cfg.block_m, bind) if rows_tma else (kv_k_desc, kv_v_desc)
        return (
            bind.ptr(q), q.stride(0), q.stride(1), q.stride(2), bind.ptr(grad_out), bind.ptr(cand_lse),
            bind.ptr(cand_delta), bind.ptr(user_q), user_q.stride(0), user_q.stride(1), user_q.stride(2),
            bind.ptr(grad_user_out), bind.ptr(user_lse), bind.ptr(user_delta), kv_k_desc, kv_v_desc, stride_ku,
            stride_kh, stride_kl, q_desc, do_desc, bind.ptr(dk_acc), bind.ptr(dv_acc), bind.ptr(kv_len_arg),
            bind.ptr(order), bind.ptr(users), num_users, heads, seq_len, num_queries, splits, qk_scale, scale,
        )

    launch(
        _attention_bwd_dkdv_launch, (num_users * heads * num_blocks * splits,), build_dkdv, recording,
        HEAD_DIM=head_dim, BLOCK_M=kv_cfg.block_m, BLOCK_N=kv_cfg.block_n, HAS_SELF=with_self, CAUSAL=causal,
        HAS_KV_LEN=kv_len is not None, RANK_USERS=RANKED_USERS if num_users <= RANKED_USERS else 0,
        NUM_STAGES=kv_cfg.num_stages, ROWS_TMA=rows_tma, SPLIT=acc is not None, num_warps=kv_cfg.num_warps,
        maxnreg=kv_cfg.maxnreg,
    )
    if acc is not None:
        call(recording, _copy_out, acc, dk, dv)
    return dq, dk, dv, duq if with_self else None


def _zeroed_acc(dk: torch.Tensor, recording: Recording | None) -> torch.Tensor:
    """A zeroed fp32 [2, *dk.shape] buffer (dK, dV summed into it), named "acc" in `recording`."""
    acc = named(recording, "acc", torch.empty(2, *dk.shape, dtype=torch.float32, device=dk.device))
    return call(recording, torch.Tensor.zero_, acc)


def _copy_out(acc: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> None:
    """dK, dV ← the fp32 buffer of `_zeroed_acc`."""
    dk.copy_(acc[0])
    dv.copy_(acc[1])
# fmt: on


def _capturing(device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


_REPLAYS: dict = {}  # `_signature` → the Replay of `_triton_op`'s recorded launch path (kernels._launch)


def _signature(q, k, v, cand_to_user, kv_len, scale, user_q, causal, with_lse) -> tuple:
    """What `_launch`'s decisions depend on, the addresses aside: shapes, strides, dtypes and device, each input's
    address modulo 16 (Triton's pointer specialization, the TMA and row-copy paths), the options, the tuned
    configs' version."""
    inputs = (q, k, v, cand_to_user, kv_len, user_q)
    return (
        *(None if t is None else (t.shape, t.stride(), t.dtype, t.data_ptr() % 16) for t in inputs),
        k.device, scale, causal, with_lse, tuned_version(),
    )  # fmt: skip


def _triton_op(q, k, v, cand_to_user, kv_len, scale, user_q=None, causal=True, with_lse=False):
    """The Triton path of the forward ops → (out, user_out or None, lse: `lse_size` fp32 elements with_lse, else
    None). No wait for the device: on CUDA the plan kernel writes its range flag to pinned host memory and its
    check (the ValueError naming the bad value) is deferred (kernels._common.DEFERRED: raised by a later IKBO
    call, `check_deferred()`, or at once in strict mode). Not while a CUDA graph is being captured: values are
    then the caller's to check; the kernels still read nothing out of bounds (bad rows are left unwritten,
    kv_len is clamped). Under the interpreter (CPU tensors) the check is synchronous.
    A CUDA call whose `_signature` was seen before replays that call's launches (kernels._launch): the same kernels
    and integer arguments, this call's addresses (with_lse: a fresh lse too)."""
    num_candidates, num_users, seq_len, device = q.shape[0], k.shape[0], k.shape[2], k.device
    if num_users == 0:  # no users: every candidate's mapping value is out of range
        check_mapping(cand_to_user, num_candidates, num_users, device)
        user_out = None if user_q is None else user_q.new_zeros(user_q.shape)
        lse = None
        if with_lse:
            lse = torch.empty(lse_size(q.shape, k.shape, user_q is not None), dtype=torch.float32, device=device)
        return q.new_zeros(q.shape), user_out, lse
    capturing = _capturing(device)
    host_flag = HostFlag(device) if device.type == "cuda" and not capturing else None
    inputs = dict(q=q, k=k, v=v, cand_to_user=cand_to_user, kv_len=kv_len, user_q=user_q)
    key = entry = recording = None
    if host_flag is not None and replayable() and host_flag.device == torch.cuda.current_device():
        key = _signature(q, k, v, cand_to_user, kv_len, scale, user_q, causal, with_lse)
        entry = _REPLAYS.get(key)
    made = None if entry is None else entry(host_flag.stream, device, {**inputs, "host_flag": host_flag.address})
    if made is not None:
        out, user_out, lse = made["out"], made.get("user_out"), made.get("lse")
    else:
        if key is not None:
            recording = Recording(**inputs, host_flag=host_flag.slot)
        lse = None
        if with_lse:
            lse = torch.empty(lse_size(q.shape, k.shape, user_q is not None), dtype=torch.float32, device=device)
            named(recording, "lse", lse)
        slot = None if host_flag is None else host_flag.slot
        out, user_out, flag = _launch(
            q, k, v, cand_to_user, kv_len, scale, user_q, causal, host_flag=slot, lse=lse, recording=recording
        )
        replay = None if recording is None or "out" not in recording.fresh else recording.replay()
        if replay is not None:
            remember(_REPLAYS, key, replay)
    if host_flag is not None:
        DEFERRED.defer(host_flag, partial(raise_bad_mapping, cand_to_user, num_users, kv_len=kv_len, seq_len=seq_len))
    elif not capturing:
        raise_bad_mapping(cand_to_user, num_users, flag.tolist(), kv_len=kv_len, seq_len=seq_len)
    return out, user_out, lse


def _forward(q, k, v, cand_to_user, kv_len, scale, backend, with_lse, user_q=None, causal=True):
    """Both forward ops: (out, user_out or None, lse or None; None on the torch path, whose backward needs none)."""
    poll_deferred()
    if backend == "triton":
        return _triton_op(q, k, v, cand_to_user, kv_len, scale, user_q, causal, with_lse)
    check_mapping(cand_to_user, q.shape[0], k.shape[0], k.device)
    kv_len = check_kv_len(kv_len, k.shape[0], k.shape[2], k.device)
    out = _target_attention_torch(q, k, v, cand_to_user, kv_len, scale)
    user_out = None if user_q is None else _self_attention_torch(user_q, k, v, kv_len, causal, scale).contiguous()
    return out, user_out, None


def _backward(grad_out, q, k, v, out, lse, cand_to_user, kv_len, scale, backend, user_q=None, grad_user_out=None,
              user_out=None, causal=True):  # fmt: skip
    """Both backward ops → (dq, dk, dv, duser_q or None), fresh tensors; dK and dV sum the target and self terms."""
    poll_deferred()
    if backend == "triton":
        rows = lse_size(q.shape, k.shape, user_q is not None)
        if lse.numel() != rows:  # a forward called without with_lse: its statistics again
            lse = torch.empty(rows, dtype=torch.float32, device=k.device)
            _launch(q, k, v, cand_to_user, kv_len, scale, user_q, causal, lse=lse)
        return _backward_replayed(
            grad_out, q, k, v, out, lse, cand_to_user, kv_len, scale, user_q, grad_user_out, user_out, causal
        )
    kv_len = check_kv_len(kv_len, k.shape[0], k.shape[2], k.device)
    dq, dk, dv = _target_attention_torch_backward(grad_out, q, k, v, cand_to_user, kv_len, scale)
    if user_q is None:
        return dq, dk, dv, None
    duq, self_dk, self_dv = _self_attention_torch_backward(grad_user_out, user_q, k, v, kv_len, causal, scale)
    return dq, (dk + self_dk).to(k.dtype), (dv + self_dv).to(v.dtype), duq


# ---------------------------------------------------------------------------------------------
# Custom ops: torch.compile, torch.export and autograd see each op whole
# ---------------------------------------------------------------------------------------------


_BACKWARD_REPLAYS: dict = {}  # call signature → the Replay of `_launch_backward`'s recorded steps


def _backward_replayed(grad_out, q, k, v, out, lse, cand_to_user, kv_len, scale, user_q, grad_user_out, user_out,
                       causal):  # fmt: skip
    """`_launch_backward`, replaying the steps of an earlier call with the same signature (shapes, strides, dtypes,
    alignments, device, options, the dispatch settings) on the current CUDA device outside a graph capture: the same
    launches with this call's tensors (kernels._launch)."""
    inputs = dict(
        grad_out=grad_out, q=q, k=k, v=v, out=out, lse=lse, cand_to_user=cand_to_user, kv_len=kv_len, user_q=user_q,
        grad_user_out=grad_user_out, user_out=user_out,
    )  # fmt: skip
    args = (grad_out, q, k, v, out, lse, cand_to_user, kv_len, scale, user_q, grad_user_out, user_out, causal)
    device = k.device
    if not (
        device.type == "cuda" and replayable() and device.index == torch.cuda.current_device()
        and not _capturing(device) and q.shape[0] > 0
    ):  # fmt: skip
        return _launch_backward(*args)
    key = (
        *(None if t is None else (t.shape, t.stride(), t.dtype, t.data_ptr() % 16) for t in inputs.values()),
        device, scale, causal, WS_BACKWARD, DKDV_ROWS_TMA, RANKED_USERS,
    )  # fmt: skip
    replay = _BACKWARD_REPLAYS.get(key)
    if replay is not None:
        made = replay(torch._C._cuda_getCurrentRawStream(device.index), device, inputs)
        if made is not None:
            return made["dq"], made["dk"], made["dv"], made.get("duq")
    recording = Recording(**inputs)
    grads = _launch_backward(*args, recording=recording)
    replay = recording.replay()
    if replay is not None and all(name in recording.fresh for name in ("dq", "dk", "dv")):
        remember(_BACKWARD_REPLAYS, key, replay)
    return grads


def _no_lse(like):
    """The ops' lse output where the forward keeps none."""
    return like.new_empty(0, dtype=torch.float32)


def _attention_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cand_to_user: torch.Tensor,
    kv_len: torch.Tensor | None,
    scale: float,
    backend: str,
    with_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, S, d], lse): target attention on `backend` ("torch" or "triton"); lse (the backward's softmax
    statistics) only where with_lse and the backend is Triton, else [0]."""
    out, _, lse = _forward(q, k, v, cand_to_user, kv_len, scale, backend, with_lse)
    return out, _no_lse(q) if lse is None else lse


_attention_op = torch.library.custom_op("ikbo::attention", _attention_impl, mutates_args=())


@_attention_op.register_fake
def _(q, k, v, cand_to_user, kv_len, scale, backend, with_lse):
    rows = lse_size(q.shape, k.shape, False) if with_lse and backend == "triton" else 0
    return q.new_empty(q.shape), q.new_empty(rows, dtype=torch.float32)


def _attention_backward_impl(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cand_to_user: torch.Tensor,
    kv_len: torch.Tensor | None,
    scale: float,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of `ikbo::attention`: dK[u], dV[u] summed over user u's candidates, K/V never at B rows."""
    return _backward(grad_out, q, k, v, out, lse, cand_to_user, kv_len, scale, backend)[:3]


_attention_backward_op = torch.library.custom_op("ikbo::attention_backward", _attention_backward_impl, mutates_args=())


@_attention_backward_op.register_fake
def _(grad_out, q, k, v, out, lse, cand_to_user, kv_len, scale, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _attention_setup_context(ctx, inputs, output):
    q, k, v, cand_to_user, kv_len, scale, backend, _ = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, cand_to_user, kv_len, out, lse)
    ctx.scale, ctx.backend = scale, backend


def _attention_grad(ctx, grad_out, _grad_lse):
    q, k, v, cand_to_user, kv_len, out, lse = ctx.saved_tensors
    run = backward_call(ctx, _attention_backward_op, _attention_backward_impl, grad_out)
    grads = run(grad_out, q, k, v, out, lse, cand_to_user, kv_len, ctx.scale, ctx.backend)
    return *grads, None, None, None, None, None


_attention_op.register_autograd(_attention_grad, setup_context=_attention_setup_context)
_Attention = eager_function("_Attention", _attention_impl, _attention_setup_context, _attention_grad)
_AttentionFunc = functorch_function("_AttentionFunc", _attention_impl, _attention_setup_context, _attention_grad)


def _self_target_attention_impl(
    user_q: torch.Tensor,
    cand_q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cand_to_user: torch.Tensor,
    kv_len: torch.Tensor | None,
    causal: bool,
    scale: float,
    backend: str,
    with_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(user_out [U, H, L, d], cand_out [B, H, S, d], lse): self + target attention over the same K/V; lse (candidate
    rows, then user rows) only where with_lse and the backend is Triton, else [0]."""
    cand_out, user_out, lse = _forward(cand_q, k, v, cand_to_user, kv_len, scale, backend, with_lse, user_q, causal)
    return user_out, cand_out, _no_lse(k) if lse is None else lse


_self_target_attention_op = torch.library.custom_op(
    "ikbo::self_target_attention", _self_target_attention_impl, mutates_args=()
)


@_self_target_attention_op.register_fake
def _(user_q, cand_q, k, v, cand_to_user, kv_len, causal, scale, backend, with_lse):
    rows = lse_size(cand_q.shape, k.shape, True) if with_lse and backend == "triton" else 0
    return user_q.new_empty(user_q.shape), cand_q.new_empty(cand_q.shape), k.new_empty(rows, dtype=torch.float32)


def _self_target_attention_backward_impl(
    grad_user_out: torch.Tensor,
    grad_cand_out: torch.Tensor,
    user_q: torch.Tensor,
    cand_q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    user_out: torch.Tensor,
    cand_out: torch.Tensor,
    lse: torch.Tensor,
    cand_to_user: torch.Tensor,
    kv_len: torch.Tensor | None,
    causal: bool,
    scale: float,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(duser_q, dcand_q, dk, dv) of `ikbo::self_target_attention`: one backward, dK and dV summing the causal self
    and the target contributions."""
    dcand_q, dk, dv, duser_q = _backward(
        grad_cand_out, cand_q, k, v, cand_out, lse, cand_to_user, kv_len, scale, backend, user_q, grad_user_out,
        user_out, causal,
    )  # fmt: skip
    return duser_q, dcand_q, dk, dv


_self_target_attention_backward_op = torch.library.custom_op(
    "ikbo::self_target_attention_backward", _self_target_attention_backward_impl, mutates_args=()
)


@_self_target_attention_backward_op.register_fake
def _(grad_user_out, grad_cand_out, user_q, cand_q, k, v, user_out, cand_out, lse, cand_to_user, kv_len, causal, scale,
      backend):  # fmt: skip
    return user_q.new_empty(user_q.shape), cand_q.new_empty(cand_q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _self_target_setup_context(ctx, inputs, output):
    user_q, cand_q, k, v, cand_to_user, kv_len, causal, scale, backend, _ = inputs
    user_out, cand_out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(user_q, cand_q, k, v, cand_to_user, kv_len, user_out, cand_out, lse)
    ctx.causal, ctx.scale, ctx.backend = causal, scale, backend


def _self_target_grad(ctx, grad_user_out, grad_cand_out, _grad_lse):
    user_q, cand_q, k, v, cand_to_user, kv_len, user_out, cand_out, lse = ctx.saved_tensors
    run = backward_call(
        ctx, _self_target_attention_backward_op, _self_target_attention_backward_impl, grad_user_out, grad_cand_out
    )
    grads = run(
        grad_user_out, grad_cand_out, user_q, cand_q, k, v, user_out, cand_out, lse, cand_to_user, kv_len, ctx.causal,
        ctx.scale, ctx.backend,
    )  # fmt: skip
    return *grads, None, None, None, None, None, None


_self_target_attention_op.register_autograd(_self_target_grad, setup_context=_self_target_setup_context)
_SelfTargetAttention = eager_function(
    "_SelfTargetAttention", _self_target_attention_impl, _self_target_setup_context, _self_target_grad
)
_SelfTargetAttentionFunc = functorch_function(
    "_SelfTargetAttentionFunc", _self_target_attention_impl, _self_target_setup_context, _self_target_grad
)


# ---------------------------------------------------------------------------------------------
# Public ops
# ---------------------------------------------------------------------------------------------


def _scale_value(scale, head_dim: int) -> float:
    """The softmax scale as a float: 1/√d for None; ValueError naming `scale` unless a finite real number."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    try:
        value = float(scale)
    except (TypeError, ValueError, RuntimeError):
        value = math.nan
    if not math.isfinite(value):
        raise ValueError(f"scale: expected a finite real number or None, got {scale!r:.60}")
    return value


def _keeps_lse(*inputs) -> bool:
    """Whether autograd will ask for the backward: then the forward keeps the softmax statistics it needs."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in inputs)


def ikbo_attention(q, k, v, cand_to_user, kv_len=None, scale=None, backend: str = "auto") -> torch.Tensor:
    """Target attention of candidate queries over their user's K/V → [B, H, S, d] (see module doc); differentiable
    in q, k and v (`ikbo::attention`). Checks here read no device values (torch.compile traces this function); the
    index values are checked inside the op."""
    check_tensor("k", k, 4, FLOAT_TYPES)
    q, k, v = autocast_inputs(k.device, q, k, v)
    _check_kv(k, v)
    _check_queries("q", q, k)
    check_mapping_shape(cand_to_user, q.shape[0], k.device)
    if kv_len is not None:
        check_kv_len_shape(kv_len, k.shape[0], k.device)
    chosen = _choose_backend(backend, k)
    scale = _scale_value(scale, k.shape[3])
    way = route(q, k, v, cand_to_user, kv_len)
    if way == "direct":
        return _forward(q, k, v, cand_to_user, kv_len, scale, chosen, False)[0]
    args = (q, k, v, cand_to_user, kv_len, scale, chosen, _keeps_lse(q, k, v))
    op = {"autograd": _Attention.apply, "func": _AttentionFunc.apply}.get(way, torch.ops.ikbo.attention.default)
    return op(*args)[0]


def apart_in_training(user_q, cand_q, k, kv_len, backend: str) -> bool:
    """Whether an eager call of `ikbo_self_target_attention` that autograd differentiates runs as two ops, SDPA's
    causal self-attention and `ikbo_attention`: where the target rows' backward is the Gluon kernels' (Hopper,
    16-bit, d ∈ {64, 128}, S a multiple of 64, no kv_len) but the user's own rows cannot join their dK/dV walk
    (user_q not contiguous, or L not a multiple of 64): the Triton walk of those rows costs more than SDPA's backward
    (docs/design/attention.md). Elsewhere, and under torch.compile / export (one op in the graph), the fused op."""
    return (
        WS_BACKWARD
        and backend == "triton"
        and kv_len is None
        and k.dtype in (torch.float16, torch.bfloat16)
        and user_q.dtype == k.dtype
        and k.shape[3] in (64, 128)
        and cand_q.shape[0] > 0
        and cand_q.shape[2] % 64 == 0
        and not rows_by_tma(user_q, user_q, 64)
        and _hopper.is_hopper(k.device)
    )


def ikbo_self_target_attention(
    user_q, cand_q, k, v, cand_to_user, kv_len=None, causal=True, scale=None, backend: str = "auto"
):
    """(user_out [U, H, L, d], cand_out [B, H, S, d]): self-attention of each user's sequence and
    target attention of its candidates, both over the same k/v [U, H, L, d] (see module doc); differentiable in
    user_q, cand_q, k and v (`ikbo::self_target_attention`), one backward for both parts."""
    check_tensor("k", k, 4, FLOAT_TYPES)
    user_q, cand_q, k, v = autocast_inputs(k.device, user_q, cand_q, k, v)
    _check_kv(k, v)
    _check_queries("user_q", user_q, k, "L (dim 2 of k)", k.shape[2])
    check_same("user_q", user_q.shape[0], "U (rows of k)", k.shape[0])
    _check_queries("cand_q", cand_q, k)
    check_mapping_shape(cand_to_user, cand_q.shape[0], k.device)
    if kv_len is not None:
        check_kv_len_shape(kv_len, k.shape[0], k.device)
    chosen = _choose_backend(backend, k)
    scale = _scale_value(scale, k.shape[3])
    way = route(user_q, cand_q, k, v, cand_to_user, kv_len)
    if way == "direct":
        cand_out, user_out, _ = _forward(cand_q, k, v, cand_to_user, kv_len, scale, chosen, False, user_q, causal)
        return user_out, cand_out
    if way == "autograd" and apart_in_training(user_q, cand_q, k, kv_len, chosen):
        user_out = F.scaled_dot_product_attention(user_q, k, v, is_causal=bool(causal), scale=scale)
        return user_out, ikbo_attention(cand_q, k, v, cand_to_user, None, scale, chosen)
    args = (user_q, cand_q, k, v, cand_to_user, kv_len, bool(causal), scale, chosen, _keeps_lse(user_q, cand_q, k, v))
    op = {"autograd": _SelfTargetAttention.apply, "func": _SelfTargetAttentionFunc.apply}.get(
        way, torch.ops.ikbo.self_target_attention.default
    )
    user_out, cand_out, _ = op(*args)
    return user_out, cand_out
