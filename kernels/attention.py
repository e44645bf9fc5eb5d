"""IKBO attention: candidate queries attend to their user's sequence, K/V never replicated.

Target attention, per candidate b with user u = m[b]:
    out[b] = softmax(scale · q[b] · k[u]ᵀ, keys j < kv_len[u]) · v[u]
q [B, H, S, d] candidate query tokens, k/v [U, H, L, d] user sequences, kv_len [U] valid lengths
(None = L), scale default 1/√d → out [B, H, S, d]. A user with kv_len 0 gives zeros.

Self + target attention shares k/v: each user's sequence attends to itself (causal by default,
keys < kv_len, query rows ≥ kv_len are zeros) and the candidates attend as above.

Torch path: groups candidates by user once per batch and runs one attention per user whose query
block holds all S tokens of all that user's candidates, so each user's K/V is read once.

Triton path (CUDA, bf16/fp16, d ∈ {16, 32, 64, 128}): two launches per call and one wait, for the
plan's range flag (copied to pinned memory between the launches, so the op returns while the
attention kernel runs), so that bad indices still raise the ValueError naming them.
  1. `_plan_kernel`, one program per user, segments `cand_to_user` by user: the candidates in
     user order (`order`, stable) and a table of query tiles. A user's candidates are laid out as
     count·S "virtual" query rows (candidate-major, S tokens each) cut into BLOCK_M-row tiles, so
     one tile packs the S tokens of BLOCK_M / S candidates (or part of one candidate when S > BLOCK_M).
  2. `_attention_kernel`, grid (tiles, H): each program gathers its tile's query rows, then streams
     the user's K/V once through TMA descriptors (FlashAttention-2 online softmax, exp2, fp32
     accumulators), and scatters the rows back to [B, H, S, d]. Tiles of one user are adjacent in
     the grid and heads are the slow axis, so programs sharing K/V[u, h] run together (L2 reuse).
     With self-attention fused, the users' causal query tiles (longest first) come before the
     candidate tiles in the same grid, over the same K/V.
Source: "In-Kernel Broadcast Optimization" (Meta, 2025), target attention; FlashAttention-2
(Dao, 2023, https://arxiv.org/abs/2307.08691) and Triton's tutorial 06-fused-attention.
Hopper: attention (no plan given, no tuned tile) goes to the warp-specialized Gluon kernel of
kernels/attention_ws.py at the shapes where it is the faster one (`attention_ws.prefer_ws`: bf16/fp16,
d ∈ {64, 128}, S ≥ 64, L ≥ 512, ≥ 256 query rows a user), self + target too where its rows are
16-byte aligned (`self_target_ws_ok`) and, with kv_len, from L = 1024; and wherever a tuned choice says
`WS_CHOICE`; the rest here. Design and measurements: docs/design/attention.md.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ._common import (
    HostReadback,
    check_kv_len,
    check_kv_len_shape,
    check_mapping,
    check_mapping_shape,
    check_same,
    check_tensor,
    group_by_user,
    resolve_backend,
)
from ._interpreter import interpreting
from .configs import TileConfig, tuned_config

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
    num_candidates, num_users, seq_len, num_queries, HAS_KV_LEN: tl.constexpr, BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Program u reads the whole mapping twice: first = #candidates of users in [0, u) and count = #of u,
    then writes its candidates to order[first, first + count) and its tiles to the slots
    [start(u), start(u + 1)), start(u) = first·S // BLOCK_M + u, which holds the cdiv(count·S,
    BLOCK_M) tiles it needs (unused slots get user -1); the last program also fills the slots up to
    B·S // BLOCK_M + U, so every slot is written whatever the mapping holds (the buffers need no
    zero-fill). No atomics, no cross-program traffic; O(U·B) loads, which the U programs share.
    Out-of-range values are never matched (their rows are left unwritten, and no tile refers to
    them); program 0 writes the flag (1 on such a value, on which the host raises the ValueError)
    and zeroes the two words after it (the Gluon kernel's item counter and finished-program count)."""
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
# fmt: on


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
    """softmax(q·Kᵀ)·V of one query tile over one (user, head) → [BLOCK_M, D] fp32 (0 for no keys)."""
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
    return acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
# fmt: on


@triton.jit
def _kv_len(kv_len_ptr, user, seq_len, HAS_KV_LEN: tl.constexpr):
    """Valid keys of `user`, clamped to [0, L] (out-of-range values are reported by the plan)."""
    if HAS_KV_LEN:
        return tl.minimum(tl.maximum(tl.load(kv_len_ptr + user).to(tl.int32), 0), seq_len)
    return seq_len


# fmt: off
@triton.jit
def _self_tile(
    tile, head, uq_ptr, stride_uqu, stride_uqh, stride_uql, uo_ptr, stride_uou, stride_uoh, stride_uol, k_desc, v_desc,
    stride_ku, stride_kh, stride_kl, kv_len_ptr, num_users, seq_len, num_self_tiles, qk_scale, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_KV_LEN: tl.constexpr,
    NUM_STAGES: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    """One query tile of a user's own sequence; causal tiles are numbered longest first."""
    q_tiles = num_self_tiles // num_users
    user = tile % num_users
    q_tile = (q_tiles - 1 - tile // num_users) if CAUSAL else tile // num_users
    kv_len = _kv_len(kv_len_ptr, user, seq_len, HAS_KV_LEN)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # positions in the user's sequence
    q_rows = user.to(tl.int64) * stride_uqu + head * stride_uqh + tl.minimum(rows, seq_len - 1) * stride_uql
    q = tl.load(uq_ptr + (q_rows[:, None] + offs_d[None, :]))  # rows past L read row L-1, never stored
    if CAUSAL:
        row_limit = rows
        hi = tl.minimum(kv_len, q_tile * BLOCK_M + BLOCK_M)
        full_end = tl.minimum(kv_len // BLOCK_N, (q_tile * BLOCK_M) // BLOCK_N) * BLOCK_N
    else:
        row_limit = tl.full([BLOCK_M], 2147483647, tl.int32)
        hi = kv_len
        full_end = (kv_len // BLOCK_N) * BLOCK_N
    kv_offset = user.to(tl.int64) * stride_ku + head * stride_kh
    out = _softmax_pass(
        q, k_desc, v_desc, kv_offset, stride_kl, full_end, hi, kv_len, row_limit, qk_scale, BLOCK_M, HEAD_DIM, BLOCK_N,
        NUM_STAGES, WARP_SPECIALIZE,
    )
    out = tl.where((rows < kv_len)[:, None], out, 0.0)  # rows past the history are zeros
    o_rows = user.to(tl.int64) * stride_uou + head * stride_uoh + rows * stride_uol
    tl.store(
        uo_ptr + o_rows[:, None] + offs_d[None, :], out.to(uo_ptr.dtype.element_ty), mask=(rows < seq_len)[:, None]
    )
# fmt: on


# fmt: off
@triton.jit
def _target_tile(
    tile, head, q_ptr, stride_qb, stride_qh, stride_qs, out_ptr, stride_ob, stride_oh, stride_os, k_desc, v_desc,
    stride_ku, stride_kh, stride_kl, kv_len_ptr, order_ptr, tile_ptr, seq_len, num_queries, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_KV_LEN: tl.constexpr,
    NUM_STAGES: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    """BLOCK_M packed query rows of one user's candidates (virtual rows: candidate-major, S tokens)."""
    entry = tile_ptr + tile * 4
    entry_user = tl.load(entry)  # -1 past the last tile: no rows, no keys, nothing stored
    first_slot = tl.load(entry + 1)
    rows = tl.load(entry + 2) + tl.arange(0, BLOCK_M)
    row_ok = rows < tl.load(entry + 3)
    user = tl.maximum(entry_user, 0)
    kv_len = tl.where(entry_user >= 0, _kv_len(kv_len_ptr, user, seq_len, HAS_KV_LEN), 0)
    slot = rows // num_queries
    token = rows - slot * num_queries
    cand = tl.load(order_ptr + first_slot + slot, mask=row_ok, other=0).to(tl.int64)  # padding rows read candidate 0
    offs_d = tl.arange(0, HEAD_DIM)
    q_rows = cand * stride_qb + head * stride_qh + token * stride_qs
    q = tl.load(q_ptr + (q_rows[:, None] + offs_d[None, :]))
    row_limit = tl.full([BLOCK_M], 2147483647, tl.int32)
    kv_offset = user.to(tl.int64) * stride_ku + head * stride_kh
    out = _softmax_pass(
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
    HAS_KV_LEN: tl.constexpr, NUM_STAGES: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    """Grid (self tiles + candidate tiles, H): program (tile, head), self tiles first. Each tile type is a whole
    inlined function: values chosen in a branch and used after the K/V loop (output pointers,
    row offsets) lose their alignment facts, get 64-per-thread layouts and spill."""
    tl.static_assert(BLOCK_M % BLOCK_N == 0 or not (HAS_SELF and CAUSAL), "causal tiles need BLOCK_N | BLOCK_M")
    tile = tl.program_id(0)
    head = tl.program_id(1)
    if HAS_SELF and tile < num_self_tiles:
        _self_tile(
            tile, head, uq_ptr, stride_uqu, stride_uqh, stride_uql, uo_ptr, stride_uou, stride_uoh, stride_uol, k_desc,
            v_desc, stride_ku, stride_kh, stride_kl, kv_len_ptr, num_users, seq_len, num_self_tiles, qk_scale, HEAD_DIM,
            BLOCK_M, BLOCK_N, CAUSAL, HAS_KV_LEN, NUM_STAGES, WARP_SPECIALIZE,
        )
    else:
        _target_tile(
            tile - num_self_tiles,
            head, q_ptr, stride_qb, stride_qh, stride_qs, out_ptr, stride_ob, stride_oh, stride_os, k_desc, v_desc,
            stride_ku, stride_kh, stride_kl, kv_len_ptr, order_ptr, tile_ptr, seq_len, num_queries, qk_scale, HEAD_DIM,
            BLOCK_M, BLOCK_N, HAS_KV_LEN, NUM_STAGES, WARP_SPECIALIZE,
        )
# fmt: on


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
    out = torch.zeros_like(q)
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


def _kv_views(k, v, block_n):
    """TMA descriptors over the 2-D views of `kv_2d_views`, blocks [block_n, d] → (k_desc, v_desc, strides)."""
    k, v, rows, strides = kv_2d_views(k, v)
    descs = [TensorDescriptor(t, [rows, strides[2]], [strides[2], 1], [block_n, k.shape[3]]) for t in (k, v)]
    return descs[0], descs[1], strides


def plan_buffers(num_candidates: int, max_tiles: int, device):
    """(flag [1], order [B], tiles [max_tiles, 4]) int32 views of one allocation, each starting on a
    16-byte boundary for any B: Triton specializes pointers on 16-byte alignment, so parts whose
    offsets moved with B would compile the kernels again on the request path. Not initialized (no
    fill launch on the host's path): `_plan_kernel` writes the flag, the two words after it (the Gluon
    kernel's item counter and finished-program count, attention_ws DYNAMIC; each launch leaves them
    zero) and every tile slot, also when a mapping value is out of range (the attention kernel runs
    before the host sees the flag, and an unwritten slot would send it reading out of bounds). `order` entries of out-of-range candidates stay unwritten; no tile refers to them."""
    order_at = 4
    tiles_at = order_at + triton.cdiv(num_candidates, 4) * 4
    buf = torch.empty(tiles_at + 4 * max_tiles, dtype=torch.int32, device=device)
    return buf[:1], buf[order_at : order_at + num_candidates], buf[tiles_at:].view(max_tiles, 4)


def plan_tiles(cand_to_user, num_users: int, num_queries: int, block_m: int, kv_len=None, seq_len: int = 0):
    """Run `_plan_kernel` → (order [B] int32, tiles [max_tiles, 4] int32, max_tiles, flag [1] int32),
    with max_tiles = B·S // BLOCK_M + U, known without a device→host sync. flag is 1 when a
    mapping value lies outside [0, U) or a kv_len value outside [0, L]."""
    num_candidates = cand_to_user.shape[0]
    max_tiles = num_candidates * num_queries // block_m + num_users
    flag, order, tiles = plan_buffers(num_candidates, max_tiles, cand_to_user.device)
    _plan_kernel[(num_users,)](
        cand_to_user, cand_to_user if kv_len is None else kv_len, order, tiles, flag,
        num_candidates, num_users, seq_len, num_queries,
        HAS_KV_LEN=kv_len is not None, BLOCK_M=block_m, CHUNK=64 if interpreting() else 1024,
        num_warps=4,
    )  # fmt: skip
    return order, tiles, max_tiles, flag


# fmt: off
def _launch(
    q, k, v, cand_to_user, kv_len, scale, user_q=None, causal=True, config=None, out=None, user_out=None, plan=None,
    on_plan=None,
):
    """Triton path. q [B, H, S, d] (B may be 0), k/v [U, H, L, d] (U ≥ 1), kv_len [U] int32/int64 or
    None; with user_q [U, H, L, d] the self-attention tiles run in the same grid. `out` / `user_out`
    may be given (the tests poison them), and `plan` (from `plan_tiles` with the same BLOCK_M) when
    one batch's grouping serves several calls; `on_plan(flag)` is called between the two launches.
    Nothing here waits for the device.
    Returns (out, user_out or None, flag): flag [1] int32 is 1 when an index value was out of range."""
    num_candidates, heads, num_queries, head_dim = q.shape
    num_users, _, seq_len, _ = k.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
    if user_q is not None and user_out is None:
        user_out = torch.empty_like(user_q, memory_format=torch.contiguous_format)
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
                q, k, v, cand_to_user, kv_len, scale, out=out, on_plan=on_plan, user_q=user_q, user_out=user_out,
                causal=causal,
            )
            return out, user_out, flag
    if config == WS_CHOICE:
        config = None
    if config is None:
        rows_per_user = num_candidates * num_queries / num_users + (0 if user_q is None else seq_len)
        config = pick_config(rows_per_user, interpreting())
    if plan is None:
        plan = plan_tiles(cand_to_user, num_users, num_queries, config.block_m, kv_len, seq_len)
    order, tiles, max_tiles, flag = plan
    if on_plan is not None:
        on_plan(flag)
    if heads * seq_len == 0 or (num_candidates == 0 and user_q is None):
        out.zero_()
        return out, None if user_out is None else user_out.zero_(), flag
    q = q if q.stride(-1) == 1 else q.contiguous()  # queries are gathered by rows: any other stride
    if user_q is not None and user_q.stride(-1) != 1:
        user_q = user_q.contiguous()
    k_desc, v_desc, (stride_ku, stride_kh, stride_kl) = _kv_views(k, v, config.block_n)
    num_self_tiles = 0 if user_q is None else num_users * triton.cdiv(seq_len, config.block_m)
    num_target_tiles = max_tiles if num_candidates else 0  # empty slots read q[0]: needs a candidate
    num_tiles = num_self_tiles + num_target_tiles
    grid = (num_tiles, heads)
    uq, uo = (q, out) if user_q is None else (user_q, user_out)
    _attention_kernel[grid](
        q, q.stride(0), q.stride(1), q.stride(2),
        out, out.stride(0), out.stride(1), out.stride(2),
        uq, uq.stride(0), uq.stride(1), uq.stride(2),
        uo, uo.stride(0), uo.stride(1), uo.stride(2),
        k_desc, v_desc, stride_ku, stride_kh, stride_kl,
        order if kv_len is None else kv_len, order, tiles,
        num_users, seq_len, num_queries,
        num_self_tiles, scale * LOG2E,
        HEAD_DIM=head_dim, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        HAS_SELF=user_q is not None, CAUSAL=causal, HAS_KV_LEN=kv_len is not None,
        NUM_STAGES=config.num_stages, WARP_SPECIALIZE=config.warp_specialize,
        num_warps=config.num_warps, maxnreg=config.maxnreg,
    )  # fmt: skip
    return out, user_out, flag
# fmt: on


def _triton_op(q, k, v, cand_to_user, kv_len, scale, user_q=None, causal=True):
    # The checks that need no values (no device→host sync) before the launch; the value checks only when the plan
    # kernel flagged a value out of range, so a call waits for the device once.
    check_mapping_shape(cand_to_user, q.shape[0], k.device)
    if kv_len is not None:
        check_kv_len_shape(kv_len, k.shape[0], k.device)
    if k.shape[0] == 0:  # no users, so no candidates either (checked above)
        return torch.zeros_like(q), None if user_q is None else torch.zeros_like(user_q)
    # The one wait for the device (for the plan's flag), then the checks that name the bad value.
    # Not while a CUDA graph is being captured (no wait is allowed there): values are then the
    # caller's to check; the kernels still read nothing out of bounds (bad rows are left unwritten,
    # kv_len is clamped).
    capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
    # The flag's copy is enqueued right after the plan kernel, before the attention kernel: waiting for it
    # waits for the plan, so the op returns while the attention kernel runs.
    readback = []
    on_plan = (lambda flag: readback.append(HostReadback(flag))) if q.is_cuda and not capturing else None
    out, user_out, flag = _launch(q, k, v, cand_to_user, kv_len, scale, user_q, causal, on_plan=on_plan)
    if not capturing and (readback[0].values()[0] if readback else flag.item()):
        check_mapping(cand_to_user, q.shape[0], k.shape[0], k.device)
        check_kv_len(kv_len, k.shape[0], k.shape[2], k.device)
    return out, user_out


# ---------------------------------------------------------------------------------------------
# Public ops
# ---------------------------------------------------------------------------------------------


def ikbo_attention(q, k, v, cand_to_user, kv_len=None, scale=None, backend: str = "auto") -> torch.Tensor:
    """Target attention of candidate queries over their user's K/V → [B, H, S, d] (see module doc)."""
    _check_kv(k, v)
    _check_queries("q", q, k)
    chosen = _choose_backend(backend, k)
    scale = 1.0 / math.sqrt(k.shape[3]) if scale is None else float(scale)
    if chosen == "triton":
        return _triton_op(q, k, v, cand_to_user, kv_len, scale)[0]
    check_mapping(cand_to_user, q.shape[0], k.shape[0], k.device)
    kv_len = check_kv_len(kv_len, k.shape[0], k.shape[2], k.device)
    return _target_attention_torch(q, k, v, cand_to_user, kv_len, scale)


def ikbo_self_target_attention(
    user_q, cand_q, k, v, cand_to_user, kv_len=None, causal=True, scale=None, backend: str = "auto"
):
    """(user_out [U, H, L, d], cand_out [B, H, S, d]): self-attention of each user's sequence and
    target attention of its candidates, both over the same k/v [U, H, L, d] (see module doc)."""
    _check_kv(k, v)
    _check_queries("user_q", user_q, k, "L (dim 2 of k)", k.shape[2])
    check_same("user_q", user_q.shape[0], "U (rows of k)", k.shape[0])
    _check_queries("cand_q", cand_q, k)
    chosen = _choose_backend(backend, k)
    scale = 1.0 / math.sqrt(k.shape[3]) if scale is None else float(scale)
    if chosen == "triton":
        cand_out, user_out = _triton_op(cand_q, k, v, cand_to_user, kv_len, scale, user_q, causal)
        return user_out, cand_out
    check_mapping(cand_to_user, cand_q.shape[0], k.shape[0], k.device)
    kv_len = check_kv_len(kv_len, k.shape[0], k.shape[2], k.device)
    user_out = _self_attention_torch(user_q, k, v, kv_len, causal, scale)
    cand_out = _target_attention_torch(cand_q, k, v, cand_to_user, kv_len, scale)
    return user_out, cand_out
