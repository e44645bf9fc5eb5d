"""IKBO target attention as a warp-specialized FlashAttention-3-style Gluon kernel for Hopper.

Math (as `kernels.attention.ikbo_attention`): out[b] = softmax(scale · q[b] · k[u]ᵀ, keys j < kv_len[u]) · v[u],
u = cand_to_user[b]; q [B, H, S, d], k/v [U, H, L, d] → out [B, H, S, d]. K/V never replicated.

Why a second kernel: the Triton kernel of attention.py is FlashAttention-2: within a warpgroup the softmax (MUFU
exp2, row reductions) and the wgmmas run one after the other, and Triton 3.6 neither warp-specializes it nor keeps
a prefetched q·kᵀ in flight. Here the schedule is written out (FlashAttention-3, Shah et al. 2024,
https://arxiv.org/abs/2407.08608):

Kernel `_attention_ws_kernel`, persistent (one program per SM), work items (tile, head). Tiles come from
attention.py's `_plan_kernel` at BLOCK_M = 128 packed "virtual rows" of one user (candidate-major, S tokens each).
Items are handed out in one of two ways (`WSAttentionConfig.dynamic`):
    static: program p runs items p, p + programs, … in attention.py's grid order (tiles of one user adjacent, heads
        slow); the default where every item has the same length (no kv_len, no self tiles).
    dynamic: the producer asks an atomic counter in the plan's buffer for the next item's ticket (an item ahead, so
        it never waits for the answer), target items first, then the self tiles longest first; the last program to
        finish sets the counter back to zero. The default with kv_len or self tiles.
    producer partition, 1 warp: for each work item, its 128 q-row and output-row offsets into shared memory and the
        q rows themselves into a 2-slot buffer per warpgroup, with the item's (kv_len, keys to visit, first self row)
        for the consumers. Where each warpgroup's 64 rows are one contiguous run (ROWS_TMA: S a multiple of 64, q and
        out contiguous) they come by one TMA load per warpgroup, an item ahead: item i+1's during item i's K/V
        block 2 (`_producer_rows_tma`); else by cp.async (16-byte copies, gathered by pointer) before the item's
        first K/V block. Then TMA loads of the user's K and V blocks [BLOCK_N, d] into a STAGES-deep ring, K and V
        with their own ready/empty mbarriers, so a K slot is refilled as soon as both consumers' q·kᵀ has read it.
        After its last item it tells the consumers there are no more.
    two consumer warpgroups (the default partition and a 4-warp worker, the same code): warpgroup w owns rows
        [64·w, 64·w + 64) of each item's tile; per key block j it issues q·k_jᵀ (async wgmma) and P_{j-1}·V_{j-1}
        (async wgmma, P from registers), runs the online softmax of block j (base 2, fp32), waits for
        P_{j-1}·V_{j-1} and rescales. The two warpgroups take turns issuing their wgmmas (pingpong, an mbarrier per
        warpgroup), so one's softmax runs under the other's products. The output rows (acc · 1/l) go back by one
        TMA store from the warpgroup's own q buffer with ROWS_TMA, whose reading of the buffer is waited for under
        the next item's q·k₀ᵀ; else scattered by pointer (16-byte stores).
kv_len masking: blocks past kv_len are never loaded; the last partial block is masked in a branch.
A user with kv_len 0 gives zeros. Rows past a tile's end read a valid q row and are never stored.
WRITE_LSE (a forward that autograd will differentiate, `launch_ws(lse=...)`): each warpgroup's epilogue also stores
its rows' log-sum-exp (base 2) at the rows of contiguous out / user_out, as attention.py's kernel does.

Self + target (`launch_ws(user_q=..., user_out=...)`, as `ikbo_self_target_attention`): the users' own (causal)
self-attention tiles of 128 rows, over the same K/V ring: q rows from user_q, by TMA with the target rows where
`self_rows_by_tma` also holds (L a multiple of 64, user_q and user_out contiguous), else gathered (offsets from
q_ptr); keys ≤ the row's position and < kv_len (masked in the diagonal / last block only), rows past kv_len written
as zeros, rows past L not stored. Needs 16-byte aligned rows of q, out, user_q, user_out (`self_target_ws_ok`) and
128-key blocks.
Limits (`ws_supported`): CUDA capability 9.x, fp16/bf16, d ∈ {64, 128}. The public ops take it where `prefer_ws`
(self tiles: also `self_target_ws_ok`), the tuner where it times fastest (`attention.WS_CHOICE`). Where it loses:
with < 256 query rows a user (padded 128-row tiles), and with short items (block 0 and the last P·V of an item
overlap nothing). Design and measurements: docs/design/attention.md.
Patterns from kernels/linear_compress_ws.py and Triton's Gluon tutorials 05-wgmma, 08-warp-specialization.

Backward (`launch_dq_ws`, `launch_dkdv_ws`; `attention._launch_backward` takes them for the candidate rows where
`dkdv_ws_ok`): `_dq_ws_kernel` (Δ and dQ of 128-row plan tiles, the user's K/V blocks through a TMA ring) and
`_dkdv_ws_kernel` (each program's 128 keys as two warpgroups of 64, walking the user's candidate query rows 64 at
a time through a TMA ring, products transposed so Pᵀ and dSᵀ feed wgmma from registers); both a producer warp and
two consumer warpgroups. Design and measurements: docs/design/attention.md (Backward).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from . import _hopper
from . import attention as _attn
from ._hopper import GLUON_TYPES, smem_layout
from ._launch import NOW, CachedLaunch, Recording, fail, launch, named

WS_HEAD_DIMS = (64, 128)
WG_ROWS = 64  # query rows per consumer warpgroup (one wgmma M)
TILE_M = 2 * WG_ROWS  # rows per plan tile: two consumer warpgroups


@dataclass(frozen=True)
class WSAttentionConfig:
    """Key block, ring depth, item scheduling and register split of `_attention_ws_kernel`."""

    block_n: int = 128  # keys per step
    stages: int = 2  # K/V ring depth
    # items handed out by an atomic counter (else program p takes p, p + programs, …); None: where items differ
    # in length (self tiles or kv_len), the shapes where the counter is the faster order
    dynamic: bool | None = None
    consumer_regs: int = (
        224  # registers per thread of the worker consumer warpgroup (setmaxnreg; the default one gets the rest)
    )
    producer_regs: int = 56  # registers per thread of the producer warp
    maxnreg: int = 168  # at launch: 12 warps × 32 × 168 ≤ 64 K registers (setmaxnreg moves them)
    programs_per_sm: int = 1

    def smem_bytes(self, head_dim: int, elem: int) -> int:
        """Shared memory of the buffers and barriers (the epilogue's layout conversion adds scratch)."""
        ring = self.stages * 2 * self.block_n * head_dim * elem
        q_bufs = 4 * WG_ROWS * head_dim * elem
        return ring + q_bufs + 2 * 2 * 128 * 8 + 2 * 4 * 4 + 8 * (4 * self.stages + 10)


DEFAULT_CONFIG = WSAttentionConfig()


@gluon.constexpr_function
def _mma_layout(n):
    """wgmma accumulator layout of one warpgroup: 64 rows (4 warps × 16), instruction N = n."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.constexpr_function
def _io_layout(head_dim):
    """[64, d] rows for pointer loads/stores: 8 contiguous elements (16 bytes) per thread."""
    cols = head_dim // 8
    return gl.BlockedLayout([1, 8], [32 // cols, cols], [4, 1], [1, 0])


@gluon.jit
def _item_coords(item, num_tiles):
    """Work item → (tile, head): tiles fast, heads slow (attention.py's grid order)."""
    return item % num_tiles, item // num_tiles


@gluon.jit
def _ticket_coords(ticket, num_tiles, num_self_tiles, heads):
    """DYNAMIC: the item of ticket number `ticket` → (tile, head), longest first where it is known: the target
    items first (tiles fast, heads slow), then the self tiles of all heads, their longest (last rows) first."""
    num_target_tiles = num_tiles - num_self_tiles
    num_target_items = num_target_tiles * heads
    if ticket < num_target_items:
        tile = num_self_tiles + ticket % num_target_tiles
        head = ticket // num_target_tiles
    else:
        tile = (ticket - num_target_items) // heads
        head = (ticket - num_target_items) % heads
    return tile, head


_LANES = gl.constexpr(gl.BlockedLayout([1], [32], [1], [0]))  # one value per lane of the producer warp


@gluon.jit
def _request_ticket(sched_ptr):
    """DYNAMIC: ask the launch's counter (sched_ptr[1]) for a ticket, from lane 0; the answer is read by
    `_ticket_value` an item later (a tensor atomic: the warp waits for it only there)."""
    lane = gl.arange(0, 32, layout=_LANES)
    # masked lanes point elsewhere: with one address for the warp ptxas aggregates the atomic and waits for it at once
    ptrs = sched_ptr + gl.where(lane == 0, 1, 2)
    return gl.atomic_add(ptrs, gl.full([32], 1, gl.int32, _LANES), mask=lane == 0, sem="relaxed")


@gluon.jit
def _ticket_value(answer):
    """The ticket of a `_request_ticket` answer, in every lane."""
    lane = gl.arange(0, 32, layout=_LANES)
    return gl.max(gl.where(lane == 0, answer, -1), 0)


@gluon.jit
def _finish_tickets(sched_ptr):
    """DYNAMIC, after this program's last ticket: count it done (sched_ptr[2]); the last program to finish
    sets both counters back to zero for the next launch on the same plan (and the next CUDA-graph replay)."""
    done = gl.atomic_add(sched_ptr + 2, 1, sem="acq_rel")
    if done == gl.num_programs(0) - 1:
        gl.store(sched_ptr + 1, 0)
        gl.store(sched_ptr + 2, 0)


@gluon.jit
def _user_keys(tile_ptr, kv_len_ptr, tile, seq_len, HAS_KV_LEN: gl.constexpr):
    """(user ≥ 0, valid keys) of a tile; 0 keys for an unused slot (user -1). kv_len clamped to [0, L]."""
    return _entry_keys(gl.load(tile_ptr + tile * 4), kv_len_ptr, seq_len, HAS_KV_LEN)


@gluon.jit
def _entry_keys(entry_user, kv_len_ptr, seq_len, HAS_KV_LEN: gl.constexpr):
    """`_user_keys` from a loaded tile entry's user field."""
    user = gl.maximum(entry_user, 0)
    kv_len = seq_len
    if HAS_KV_LEN:
        kv_len = gl.minimum(gl.maximum(gl.load(kv_len_ptr + user).to(gl.int32), 0), seq_len)
    kv_len = gl.where(entry_user >= 0, kv_len, 0)
    return user, kv_len


# fmt: off
@gluon.jit
def _item_keys(
    tile_ptr, kv_len_ptr, tile, seq_len, num_users, num_self_tiles, HAS_KV_LEN: gl.constexpr, HAS_SELF: gl.constexpr,
    CAUSAL: gl.constexpr,
):
    """A work item's tile → (user, valid keys kv_len, keys to visit, first self row or -1).
    Target tiles (after the self tiles): `_user_keys`, all valid keys, -1. Self tiles (HAS_SELF, tile <
    num_self_tiles): user tile % U, rows [r0, r0 + TILE_M) of its own sequence (the longest first when
    CAUSAL); keys to visit min(kv_len, r0 + TILE_M) when CAUSAL, and none when r0 ≥ kv_len (rows past the
    history are zeros)."""
    if HAS_SELF:
        if tile < num_self_tiles:
            user = tile % num_users
            if CAUSAL:
                r0 = (num_self_tiles // num_users - 1 - tile // num_users) * 128
            else:
                r0 = (tile // num_users) * 128
            user, kv_len = _entry_keys(user, kv_len_ptr, seq_len, HAS_KV_LEN)
            if CAUSAL:
                hi = gl.minimum(kv_len, r0 + 128)
            else:
                hi = kv_len
            hi = gl.where(r0 < kv_len, hi, 0)
        else:
            user, kv_len = _user_keys(tile_ptr, kv_len_ptr, tile - num_self_tiles, seq_len, HAS_KV_LEN)
            hi = kv_len
            r0 = tile * 0 - 1
    else:
        user, kv_len = _user_keys(tile_ptr, kv_len_ptr, tile, seq_len, HAS_KV_LEN)
        hi = kv_len
        r0 = -1
    return user, kv_len, hi, r0
# fmt: on


_ROWS_LAYOUT = gl.constexpr(gl.BlockedLayout([4], [32], [1], [0]))  # a tile's 128 row offsets over the producer warp
# an item's (kv_len, hi, r0, ·), whole in every thread of the producer warp / of a consumer warpgroup (no lane
# arithmetic for LLVM to hoist into the kernel's entry, where it would be spilled across the register reallocation)
_INFO_PRODUCER = gl.constexpr(gl.BlockedLayout([4], [32], [1], [0]))
_INFO_CONSUMER = gl.constexpr(gl.BlockedLayout([4], [32], [4], [0]))
NO_ROW = gl.constexpr(
    -(2**62)
)  # output-row offset of a row that is not stored, with HAS_SELF (offsets may be negative)


# fmt: off
@gluon.jit
def _target_rows(
    stride_qb, stride_qh, stride_qs, stride_ob, stride_oh, stride_os, tile_ptr, order_ptr, tile, head, num_queries,
    no_row,
):
    """A target tile's 128 q-row and output-row offsets (int64, from q_ptr / out_ptr); `no_row` past its end."""
    entry = tile_ptr + tile * 4
    first_slot = gl.load(entry + 1)
    rows = gl.load(entry + 2) + gl.arange(0, 128, layout=_ROWS_LAYOUT)
    row_ok = rows < gl.load(entry + 3)
    slot = rows // num_queries
    token = rows - slot * num_queries
    cand = gl.load(order_ptr + first_slot + slot, mask=row_ok, other=0).to(gl.int64)  # padding rows: candidate 0
    q_rows = cand * stride_qb + head * stride_qh + token * stride_qs
    o_rows = gl.where(row_ok, cand * stride_ob + head * stride_oh + token * stride_os, no_row)
    return q_rows, o_rows
# fmt: on


@gluon.jit
def _self_rows(
    uq_delta, stride_uqu, stride_uqh, stride_uql, uo_delta, stride_uou, stride_uoh, stride_uol, user, head, r0, seq_len
):
    """A self tile's 128 q-row and output-row offsets, from q_ptr / out_ptr (user_q and user_out lie
    uq_delta / uo_delta elements from them); rows past L read row L - 1 and are not stored (NO_ROW)."""
    rows = r0 + gl.arange(0, 128, layout=_ROWS_LAYOUT)
    base_q = uq_delta + user.to(gl.int64) * stride_uqu + head * stride_uqh
    base_o = uo_delta + user.to(gl.int64) * stride_uou + head * stride_uoh
    q_rows = base_q + gl.minimum(rows, seq_len - 1).to(gl.int64) * stride_uql
    o_rows = gl.where(rows < seq_len, base_o + rows.to(gl.int64) * stride_uol, NO_ROW)
    return q_rows, o_rows


@gluon.jit
def _item_info(kv_len, hi, r0):
    """An item's (valid keys, keys to visit, first self row) as the vector the consumers read (hi < 0: no more items)."""
    idx = gl.arange(0, 4, layout=_INFO_PRODUCER)
    return gl.where(idx == 0, kv_len, gl.where(idx == 1, hi, r0))


@gluon.jit
def _gather_q(q_ptr, q_rows, o_rows, kv_len, hi, r0, q_bufs, row_bufs, item_info, q_empty, phase, QS: gl.constexpr):
    """Producer: once both warpgroups released slot QS, the item's `_item_info` into item_info[QS] and its 128
    q-row and output-row offsets into row_bufs[256·QS + (0 | 128) …], then cp.async of each warpgroup's 64 q
    rows into q_bufs[2·w + QS], 8 rows at a time (16-byte copies)."""
    HEAD_DIM: gl.constexpr = q_bufs.type.shape[2]
    chunk: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (HEAD_DIM // 8), HEAD_DIM // 8], [1, 1], [1, 0])
    mbarrier.wait(q_empty.index(QS), phase)
    mbarrier.wait(q_empty.index(2 + QS), phase)
    item_info.index(QS).store(_item_info(kv_len, hi, r0))
    row_bufs.slice(256 * QS, 128).store(q_rows)
    row_bufs.slice(256 * QS + 128, 128).store(o_rows)
    gl.thread_barrier()  # the warp's q-row offsets are in shared memory before its lanes read them back
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, chunk))
    for w in gl.static_range(2):
        for c in gl.static_range(8):
            offs = row_bufs.slice(256 * QS + 64 * w + 8 * c, 8).load(gl.SliceLayout(1, chunk))
            offs = gl.multiple_of(offs, 8)  # q's strides are multiples of 8 elements (launch_ws)
            async_copy.async_copy_global_to_shared(
                q_bufs.index(2 * w + QS).slice(8 * c, 8), q_ptr + (offs[:, None] + cols[None, :])
            )
    async_copy.commit_group()


# fmt: off
@gluon.jit
def _load_q_tma(
    q_desc, uq_desc, q_rows, o_rows, kv_len, hi, r0, q_bufs, row_bufs, item_info, q_ready, q_empty, phase,
    QS: gl.constexpr, HAS_SELF: gl.constexpr,
):
    """ROWS_TMA producer: as `_gather_q`, but each warpgroup's 64 q rows (one contiguous run) come by one TMA
    load of a [64, d] block of q_desc (of uq_desc for a self tile), which completes q_ready itself (no wait here,
    no `_publish_q`)."""
    HEAD_DIM: gl.constexpr = q_bufs.type.shape[2]
    mbarrier.wait(q_empty.index(QS), phase)
    mbarrier.wait(q_empty.index(2 + QS), phase)
    item_info.index(QS).store(_item_info(kv_len, hi, r0))
    row_bufs.slice(256 * QS + 128, 128).store(o_rows)
    gl.thread_barrier()  # info and output rows in shared memory before the arrives that publish them
    idx = gl.arange(0, 128, layout=_ROWS_LAYOUT)
    for w in gl.static_range(2):
        first = (gl.sum(gl.where(idx == 64 * w, q_rows, 0), 0) // HEAD_DIM).to(gl.int32)
        mbarrier.expect(q_ready.index(2 * w + QS), q_desc.block_type.nbytes)
        if HAS_SELF:  # a self tile's rows (r0 ≥ 0) are rows of user_q
            if r0 >= 0:
                tma.async_copy_global_to_shared(
                    uq_desc, [first, 0], q_ready.index(2 * w + QS), q_bufs.index(2 * w + QS)
                )
            else:
                tma.async_copy_global_to_shared(q_desc, [first, 0], q_ready.index(2 * w + QS), q_bufs.index(2 * w + QS))
        else:
            tma.async_copy_global_to_shared(q_desc, [first, 0], q_ready.index(2 * w + QS), q_bufs.index(2 * w + QS))
# fmt: on


@gluon.jit
def _publish_q(q_ready, qs):
    """Producer: wait for this item's q copies, make them visible to wgmma, signal both warpgroups."""
    async_copy.wait_group(0)
    fence_async_shared()
    mbarrier.arrive(q_ready.index(qs), count=1)
    mbarrier.arrive(q_ready.index(2 + qs), count=1)


@gluon.jit
def _stop_consumers(item_info, q_ready, q_empty, i):
    """Producer, after its last item (i items done): 'no more items' (hi = -1) in the next q slot."""
    qs = i % 2
    phase = ((i // 2) & 1) ^ 1
    mbarrier.wait(q_empty.index(qs), phase)
    mbarrier.wait(q_empty.index(2 + qs), phase)
    item_info.index(qs).store(_item_info(0, -1, -1))
    gl.thread_barrier()  # every lane's part is in shared memory before the arrive
    mbarrier.arrive(q_ready.index(qs), count=1)
    mbarrier.arrive(q_ready.index(2 + qs), count=1)


@gluon.jit
def _load_kv_block(
    k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, it, row, col, STAGES: gl.constexpr
):
    """Producer: K and V block rows [row, row + BLOCK_N) (columns from col) into ring position `it` by TMA, each once
    both consumers have released its slot."""
    slot = it % STAGES
    phase = ((it // STAGES) & 1) ^ 1
    mbarrier.wait(k_empty.index(slot), phase)
    mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [row, col], k_ready.index(slot), k_bufs.index(slot))
    mbarrier.wait(v_empty.index(slot), phase)
    mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [row, col], v_ready.index(slot), v_bufs.index(slot))


# fmt: off
@gluon.jit
def _produce_item(
    tile, head, it, i, k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, tile_ptr, kv_len_ptr,
    stride_ku, stride_kh, stride_kl, seq_len, q_ptr, stride_qb, stride_qh, stride_qs, stride_ob, stride_oh, stride_os,
    order_ptr, num_queries, q_bufs, row_bufs, item_info, q_ready, q_empty, uq_delta, stride_uqu, stride_uqh, stride_uql,
    uo_delta, stride_uou, stride_uoh, stride_uol, num_users, num_self_tiles, HAS_KV_LEN: gl.constexpr,
    STAGES: gl.constexpr, HAS_SELF: gl.constexpr, CAUSAL: gl.constexpr,
):
    """The producer's part of the i-th item of this program (ring position `it`): its q rows and info into
    q slot i % 2, then its K and V blocks into the ring. Returns the ring position after the item."""
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    user, kv_len, hi, r0 = _item_keys(
        tile_ptr, kv_len_ptr, tile, seq_len, num_users, num_self_tiles, HAS_KV_LEN, HAS_SELF, CAUSAL
    )
    kv_offset = user.to(gl.int64) * stride_ku + head * stride_kh
    kv_row = (kv_offset // stride_kl).to(gl.int32)
    kv_col = (kv_offset % stride_kl).to(gl.int32)
    num_blocks = gl.cdiv(hi, BLOCK_N)
    qs = i % 2
    if HAS_SELF:
        if r0 >= 0:
            q_rows, o_rows = _self_rows(
                uq_delta, stride_uqu, stride_uqh, stride_uql, uo_delta, stride_uou, stride_uoh, stride_uol, user, head,
                r0, seq_len,
            )
        else:
            q_rows, o_rows = _target_rows(
                stride_qb, stride_qh, stride_qs, stride_ob, stride_oh, stride_os, tile_ptr, order_ptr,
                tile - num_self_tiles, head, num_queries, NO_ROW,
            )
    else:
        q_rows, o_rows = _target_rows(
            stride_qb, stride_qh, stride_qs, stride_ob, stride_oh, stride_os, tile_ptr, order_ptr, tile, head,
            num_queries,
            -8,
        )
    if qs == 0:  # slot qs, unrolled: shared-memory slices take constant offsets
        _gather_q(q_ptr, q_rows, o_rows, kv_len, hi, r0, q_bufs, row_bufs, item_info, q_empty, ((i // 2) & 1) ^ 1, 0)
    else:
        _gather_q(q_ptr, q_rows, o_rows, kv_len, hi, r0, q_bufs, row_bufs, item_info, q_empty, ((i // 2) & 1) ^ 1, 1)
    for j in range(0, num_blocks):
        _load_kv_block(
            k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, it, kv_row + j * BLOCK_N, kv_col, STAGES
        )
        if j == 0:
            _publish_q(q_ready, qs)
        it += 1
    if num_blocks == 0:
        _publish_q(q_ready, qs)
    return it
# fmt: on


# fmt: off
@gluon.jit
def _producer(
    k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, tile_ptr, kv_len_ptr, num_items, num_tiles,
    stride_ku, stride_kh, stride_kl, seq_len, q_ptr, stride_qb, stride_qh, stride_qs, stride_ob, stride_oh, stride_os,
    order_ptr, num_queries, q_bufs, row_bufs, item_info, q_ready, q_empty, uq_delta, stride_uqu, stride_uqh, stride_uql,
    uo_delta, stride_uou, stride_uoh, stride_uol, num_users, num_self_tiles, sched_ptr, HAS_KV_LEN: gl.constexpr,
    STAGES: gl.constexpr, HAS_SELF: gl.constexpr, CAUSAL: gl.constexpr, DYNAMIC: gl.constexpr,
):
    """1 warp: every work item of this program (`_produce_item`; slots start free), then 'no more items'.
    Items: with DYNAMIC by ticket (`_ticket_coords`) while tickets last, each ticket asked for an item ahead,
    else p, p + programs, …"""
    it = 0
    i = 0
    if DYNAMIC:
        heads = num_items // num_tiles
        ticket = _ticket_value(_request_ticket(sched_ptr))
        answer = _request_ticket(sched_ptr)
    else:
        ticket = gl.program_id(0)
    while ticket < num_items:
        if DYNAMIC:
            tile, head = _ticket_coords(ticket, num_tiles, num_self_tiles, heads)
        else:
            tile, head = _item_coords(ticket, num_tiles)
        it = _produce_item(
            tile, head, it, i, k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, tile_ptr, kv_len_ptr,
            stride_ku, stride_kh, stride_kl, seq_len, q_ptr, stride_qb, stride_qh, stride_qs, stride_ob, stride_oh,
            stride_os, order_ptr, num_queries, q_bufs, row_bufs, item_info, q_ready, q_empty, uq_delta, stride_uqu,
            stride_uqh, stride_uql, uo_delta, stride_uou, stride_uoh, stride_uol, num_users, num_self_tiles, HAS_KV_LEN,
            STAGES, HAS_SELF, CAUSAL,
        )
        if DYNAMIC:
            ticket = _ticket_value(answer)
            answer = _request_ticket(sched_ptr)
        else:
            ticket += gl.num_programs(0)
        i += 1
    _stop_consumers(item_info, q_ready, q_empty, i)
    if DYNAMIC:
        if _ticket_value(answer) >= 0:  # the last answer in hand before this program counts itself done
            _finish_tickets(sched_ptr)
# fmt: on


# fmt: off
@gluon.jit
def _load_item_q(
    q_desc, uq_desc, q_rows, o_rows, kv_len, hi, r0, q_bufs, row_bufs, item_info, q_ready, q_empty, n,
    HAS_SELF: gl.constexpr,
):
    """`_producer_rows_tma`: the n-th item's q rows (TMA), output-row offsets and info into q slot n % 2."""
    phase = ((n // 2) & 1) ^ 1
    if n % 2 == 0:
        _load_q_tma(
            q_desc, uq_desc, q_rows, o_rows, kv_len, hi, r0, q_bufs, row_bufs, item_info, q_ready, q_empty, phase,
            0,
            HAS_SELF,
        )
    else:
        _load_q_tma(
            q_desc, uq_desc, q_rows, o_rows, kv_len, hi, r0, q_bufs, row_bufs, item_info, q_ready, q_empty, phase,
            1,
            HAS_SELF,
        )
# fmt: on


# fmt: off
@gluon.jit
def _rows_tma_item(
    ticket, num_items, num_tiles, tile_ptr, kv_len_ptr, seq_len, stride_qb, stride_qh, stride_qs, stride_ob, stride_oh,
    stride_os, order_ptr, num_queries, stride_uqu, stride_uqh, stride_uql, stride_uou, stride_uoh, stride_uol,
    num_users, num_self_tiles, HAS_KV_LEN: gl.constexpr, HAS_SELF: gl.constexpr, CAUSAL: gl.constexpr,
    DYNAMIC: gl.constexpr,
):
    """`_producer_rows_tma`: the item of `ticket` (clamped to a valid one) → (head, user, kv_len, keys to visit, first
    self row or -1, q-row and output-row offsets): a self tile's from user_q / user_out's own bases."""
    if HAS_SELF and DYNAMIC:
        tile, head = _ticket_coords(
            gl.minimum(ticket, num_items - 1), num_tiles, num_self_tiles, num_items // num_tiles
        )
    else:
        tile, head = _item_coords(gl.minimum(ticket, num_items - 1), num_tiles)
    user, kv_len, hi, r0 = _item_keys(
        tile_ptr, kv_len_ptr, tile, seq_len, num_users, num_self_tiles, HAS_KV_LEN, HAS_SELF, CAUSAL
    )
    if HAS_SELF:
        if r0 >= 0:
            q_rows, o_rows = _self_rows(
                0, stride_uqu, stride_uqh, stride_uql, 0, stride_uou, stride_uoh, stride_uol, user, head, r0, seq_len
            )
        else:
            q_rows, o_rows = _target_rows(
                stride_qb, stride_qh, stride_qs, stride_ob, stride_oh, stride_os, tile_ptr, order_ptr,
                tile - num_self_tiles, head, num_queries, NO_ROW,
            )
    else:
        q_rows, o_rows = _target_rows(
            stride_qb, stride_qh, stride_qs, stride_ob, stride_oh, stride_os, tile_ptr, order_ptr, tile, head,
            num_queries,
            -8,
        )
    return head, user, kv_len, hi, r0, q_rows, o_rows
# fmt: on


# fmt: off
@gluon.jit
def _producer_rows_tma(
    k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, tile_ptr, kv_len_ptr, num_items, num_tiles,
    stride_ku, stride_kh, stride_kl, seq_len, stride_qb, stride_qh, stride_qs, stride_ob, stride_oh, stride_os,
    order_ptr, num_queries, q_bufs, row_bufs, item_info, q_ready, q_empty, sched_ptr, q_desc, uq_desc, stride_uqu,
    stride_uqh, stride_uql, stride_uou, stride_uoh, stride_uol, num_users, num_self_tiles, HAS_KV_LEN: gl.constexpr,
    STAGES: gl.constexpr, DYNAMIC: gl.constexpr, HAS_SELF: gl.constexpr, CAUSAL: gl.constexpr,
):
    """ROWS_TMA, 1 warp: as `_producer`, with q rows by TMA (a self tile's from user_q) and a work item ahead: item i+1's
    tile entry and row offsets are read as item i starts, and its q rows are loaded right after item i's K/V block 2
    (after its last block when it has fewer), where the slot is free again (`_release_previous_slot`), so the loads
    overlap item i's blocks."""
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    it = 0
    i = 0
    if DYNAMIC:
        ticket = _ticket_value(_request_ticket(sched_ptr))
        answer = _request_ticket(sched_ptr)
    else:
        ticket = gl.program_id(0)
    head, user, kv_len, hi, r0, q_rows, o_rows = _rows_tma_item(
        ticket, num_items, num_tiles, tile_ptr, kv_len_ptr, seq_len, stride_qb, stride_qh, stride_qs, stride_ob,
        stride_oh, stride_os, order_ptr, num_queries, stride_uqu, stride_uqh, stride_uql, stride_uou, stride_uoh,
        stride_uol, num_users, num_self_tiles, HAS_KV_LEN, HAS_SELF, CAUSAL, DYNAMIC,
    )
    if ticket < num_items:
        _load_item_q(
            q_desc, uq_desc, q_rows, o_rows, kv_len, hi, r0, q_bufs, row_bufs, item_info, q_ready, q_empty, 0, HAS_SELF
        )
    while ticket < num_items:
        if DYNAMIC:
            next_ticket = _ticket_value(answer)
            answer = _request_ticket(sched_ptr)
        else:
            next_ticket = ticket + gl.num_programs(0)
        next_head, next_user, next_kv_len, next_hi, next_r0, q_rows, o_rows = _rows_tma_item(
            next_ticket, num_items, num_tiles, tile_ptr, kv_len_ptr, seq_len, stride_qb, stride_qh, stride_qs,
            stride_ob, stride_oh, stride_os, order_ptr, num_queries, stride_uqu, stride_uqh, stride_uql, stride_uou,
            stride_uoh, stride_uol, num_users, num_self_tiles, HAS_KV_LEN, HAS_SELF, CAUSAL, DYNAMIC,
        )
        kv_offset = user.to(gl.int64) * stride_ku + head * stride_kh
        kv_row = (kv_offset // stride_kl).to(gl.int32)
        kv_col = (kv_offset % stride_kl).to(gl.int32)
        num_blocks = gl.cdiv(hi, BLOCK_N)
        for j in range(0, num_blocks):
            _load_kv_block(
                k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, it,
                kv_row + j * BLOCK_N,
                kv_col,
                STAGES,
            )
            if j == 2:
                if next_ticket < num_items:
                    _load_item_q(
                        q_desc, uq_desc, q_rows, o_rows, next_kv_len, next_hi, next_r0, q_bufs, row_bufs, item_info,
                        q_ready, q_empty,
                        i + 1,
                        HAS_SELF,
                    )
            it += 1
        if num_blocks < 3:
            if next_ticket < num_items:
                _load_item_q(
                    q_desc, uq_desc, q_rows, o_rows, next_kv_len, next_hi, next_r0, q_bufs, row_bufs, item_info,
                    q_ready, q_empty,
                    i + 1,
                    HAS_SELF,
                )
        ticket = next_ticket
        head = next_head
        user = next_user
        hi = next_hi
        i += 1
    _stop_consumers(item_info, q_ready, q_empty, i)
    if DYNAMIC:
        if _ticket_value(answer) >= 0:
            _finish_tickets(sched_ptr)
# fmt: on


@gluon.jit
def _take_turn(turns, turn, WG: gl.constexpr):
    """Wait until it is this warpgroup's turn to issue wgmmas (warpgroup 0 goes first)."""
    mbarrier.wait(turns.index(WG), (turn & 1) ^ (1 - WG))


@gluon.jit
def _pass_turn(turns, WG: gl.constexpr):
    mbarrier.arrive(turns.index(1 - WG), count=1)


# fmt: off
@gluon.jit
def _block(
    j, it, turn, kv_len, dense_end, row_limit, qk_scale, acc, m_i, l_i, p_op, q_smem, k_bufs, v_bufs, k_ready, v_ready,
    k_empty, v_empty, turns, STAGES: gl.constexpr, WG: gl.constexpr, HAS_SELF: gl.constexpr,
):
    """Key block j ≥ 1 at ring position `it`: issue q·k_jᵀ and P_{j-1}·V_{j-1} (async), run the
    softmax of block j, wait for P_{j-1}·V_{j-1}, rescale. Returns (acc, m_i, l_i, P_j). (ptxas puts
    that wait before the softmax, P_j taking P_{j-1}'s registers: the softmax runs under the other
    warpgroup's products, not its own.) Keys below dense_end are seen by every row; past it the block
    is masked to keys < kv_len and, with HAS_SELF, keys ≤ the row's `row_limit` (causal self rows)."""
    BLOCK_N: gl.constexpr = k_bufs.type.shape[1]
    HEAD_DIM: gl.constexpr = k_bufs.type.shape[2]
    s_layout: gl.constexpr = _mma_layout(BLOCK_N)
    o_layout: gl.constexpr = _mma_layout(HEAD_DIM)
    slot = it % STAGES
    prev = (it - 1) % STAGES
    _take_turn(turns, turn, WG)
    mbarrier.wait(k_ready.index(slot), (it // STAGES) & 1)
    s_tok = warpgroup_mma(
        q_smem,
        k_bufs.index(slot).permute((1, 0)),
        gl.zeros([64, BLOCK_N], gl.float32, s_layout),
        use_acc=False,
        is_async=True,
    )
    mbarrier.wait(v_ready.index(prev), ((it - 1) // STAGES) & 1)
    acc_tok = warpgroup_mma(p_op, v_bufs.index(prev), acc, is_async=True)
    _pass_turn(turns, WG)
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
    mbarrier.arrive(k_empty.index(slot), count=1)
    if (j + 1) * BLOCK_N > dense_end:  # the last, partial block (or a causal self tile's diagonal)
        s = _mask_keys(s, j * BLOCK_N, kv_len, row_limit, HAS_SELF)
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    acc, p = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, p))
    mbarrier.arrive(v_empty.index(prev), count=1)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    p_op = gl.convert_layout(p.to(k_bufs.dtype), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
    return acc, m_new, l_i, p_op
# fmt: on


@gluon.jit
def _mask_keys(s, first_key, kv_len, row_limit, HAS_SELF: gl.constexpr):
    """Scores s [64, BLOCK_N] of keys first_key + … → -inf where key ≥ kv_len (or, with HAS_SELF, key > row_limit)."""
    BLOCK_N: gl.constexpr = s.type.shape[1]
    keys = first_key + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
    ok = (keys < kv_len)[None, :]
    if HAS_SELF:
        ok = ok & (keys[None, :] <= row_limit[:, None])
    return gl.where(ok, s, float("-inf"))


@gluon.jit
def _read_info(item_info, q_ready, i, WG: gl.constexpr):
    """Consumer WG: wait for its i-th item's q rows, then the item's (kv_len, hi, r0) from the producer."""
    qs = i % 2
    mbarrier.wait(q_ready.index(2 * WG + qs), (i // 2) & 1)
    idx = gl.arange(0, 4, layout=_INFO_CONSUMER)
    info = item_info.index(qs).load(_INFO_CONSUMER)
    lowest = -2147483648  # where idx is not the field
    kv_len = gl.max(gl.where(idx == 0, info, lowest), 0)
    hi = gl.max(gl.where(idx == 1, info, lowest), 0)
    r0 = gl.max(gl.where(idx == 2, info, lowest), 0)
    return kv_len, hi, r0


# fmt: off
@gluon.jit
def _consumer(
    out_ptr, k_bufs, v_bufs, q_bufs, row_bufs, item_info, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turns,
    qk_scale, o_desc, lse_ptr, uo_delta, ulse_offset, STAGES: gl.constexpr, WG: gl.constexpr, HAS_SELF: gl.constexpr,
    CAUSAL: gl.constexpr, ROWS_TMA: gl.constexpr, WRITE_LSE: gl.constexpr, uo_desc=None,
):
    """One warpgroup: rows [64·WG, 64·WG + 64) of each item the producer hands over (q rows, output-row
    offsets and info in q slot i % 2), each from block 0 (q·k_0ᵀ alone) to its last P·V (alone) and its
    epilogue (see module doc), until the producer says there are no more. With HAS_SELF, causal self rows
    see keys ≤ their position, and rows past the user's history are zeros."""
    BLOCK_N: gl.constexpr = k_bufs.type.shape[1]
    HEAD_DIM: gl.constexpr = k_bufs.type.shape[2]
    dtype: gl.constexpr = k_bufs.dtype
    s_layout: gl.constexpr = _mma_layout(BLOCK_N)
    o_layout: gl.constexpr = _mma_layout(HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)

    it = 0  # K/V blocks consumed (ring position)
    turn = 0  # wgmma turns taken
    i = 0  # work items done (q slot i % 2)
    kv_len, hi, r0 = _read_info(item_info, q_ready, i, WG)
    while hi >= 0:
        num_blocks = gl.cdiv(hi, BLOCK_N)
        dense_end = kv_len  # keys below it are seen by every row of this warpgroup
        row_limit = gl.full([64], 2147483647, gl.int32, s_rows)  # last key a row sees (causal self rows)
        if HAS_SELF:
            if CAUSAL:
                own_rows = r0 + 64 * WG + gl.arange(0, 64, layout=s_rows)
                row_limit = gl.where(r0 >= 0, own_rows, 2147483647)
                dense_end = gl.where(r0 >= 0, gl.minimum(kv_len, r0 + 64 * WG + 1), kv_len)
        qs = i % 2
        q_smem = q_bufs.index(2 * WG + qs)
        acc = gl.zeros([64, HEAD_DIM], gl.float32, o_layout)
        l_i = gl.full([64], 1.0, gl.float32, s_rows)
        m_i = gl.full([64], float("-inf"), gl.float32, s_rows)
        if num_blocks > 0:
            # block 0: q·k_0ᵀ alone
            slot = it % STAGES
            _take_turn(turns, turn, WG)
            mbarrier.wait(k_ready.index(slot), (it // STAGES) & 1)
            s_tok = warpgroup_mma(
                q_smem,
                k_bufs.index(slot).permute((1, 0)),
                gl.zeros([64, BLOCK_N], gl.float32, s_layout),
                use_acc=False,
                is_async=True,
            )
            _pass_turn(turns, WG)
            if ROWS_TMA:  # the previous item's output store reads its q slot under this q·k₀ᵀ
                _release_previous_slot(q_empty, i, WG)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
            mbarrier.arrive(k_empty.index(slot), count=1)
            if dense_end < BLOCK_N:
                s = _mask_keys(s, 0, kv_len, row_limit, HAS_SELF)
            m_i = gl.max(s, 1) * qk_scale
            p = gl.exp2(s * qk_scale - m_i[:, None])
            l_i = gl.sum(p, 1)
            p_a = gl.convert_layout(p.to(dtype), p_layout)
            for j in range(1, num_blocks):
                acc, m_i, l_i, p_a = _block(
                    j,
                    it + j,
                    turn + j,
                    kv_len, dense_end, row_limit, qk_scale, acc, m_i, l_i, p_a, q_smem, k_bufs, v_bufs, k_ready,
                    v_ready, k_empty, v_empty, turns, STAGES, WG, HAS_SELF,
                )
            # the last block's P·V
            it += num_blocks - 1
            turn += num_blocks
            slot = it % STAGES
            _take_turn(turns, turn, WG)
            mbarrier.wait(v_ready.index(slot), (it // STAGES) & 1)
            acc_tok = warpgroup_mma(p_a, v_bufs.index(slot), acc, is_async=True)
            _pass_turn(turns, WG)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok,))
            mbarrier.arrive(v_empty.index(slot), count=1)
            it += 1
            turn += 1
        elif ROWS_TMA:
            _release_previous_slot(q_empty, i, WG)
        # out rows = acc / l (zeros without keys; two divisions a thread, not one per element), back to [B, H, S, d]
        out = acc * gl.convert_layout(1.0 / l_i, o_rows)[:, None]
        if HAS_SELF:  # self rows past the user's history are zeros
            rows_here = r0 + 64 * WG + gl.arange(0, 64, layout=o_rows)
            out = gl.where(((r0 < 0) | (rows_here < kv_len))[:, None], out, 0.0)
        if WRITE_LSE:  # before the row offsets' slot goes back to the producer
            _store_lse(
                m_i, l_i, num_blocks, kv_len, r0, lse_ptr, uo_delta, ulse_offset, row_bufs, qs, HEAD_DIM, WG, HAS_SELF,
                ROWS_TMA,
            )
        if ROWS_TMA:
            if HAS_SELF:  # a self tile's rows go to user_out
                if r0 >= 0:
                    _store_rows_tma(out.to(dtype), uo_desc, q_smem, row_bufs, qs, WG)
                else:
                    _store_rows_tma(out.to(dtype), o_desc, q_smem, row_bufs, qs, WG)
            else:
                _store_rows_tma(out.to(dtype), o_desc, q_smem, row_bufs, qs, WG)
        else:
            _store_rows(out.to(dtype), out_ptr, row_bufs, qs, WG, HAS_SELF)
            mbarrier.arrive(q_empty.index(2 * WG + qs), count=1)  # q rows, output-row offsets and info read
        i += 1
        kv_len, hi, r0 = _read_info(item_info, q_ready, i, WG)
    if ROWS_TMA:
        tma.store_wait(0)  # the last item's store has read its q slot
# fmt: on


# fmt: off
@gluon.jit
def _store_lse(
    m_i, l_i, num_blocks, kv_len, r0, lse_ptr, uo_delta, ulse_offset, row_bufs, qs, HEAD_DIM: gl.constexpr,
    WG: gl.constexpr, HAS_SELF: gl.constexpr, ROWS_TMA: gl.constexpr,
):
    """WRITE_LSE: warpgroup WG's rows' log-sum-exp (base 2, m + log2 l: the backward's softmax statistics) into
    lse at the row of each output-row offset (out and user_out contiguous): a candidate row's offset / d, a self
    row's (offset − uo_delta) / d + ulse_offset, where its offset counts from out_ptr (`_producer`), or
    offset / d + ulse_offset with ROWS_TMA, whose self-row offsets count from user_out (`_rows_tma_item`);
    +inf for an item without keys and self rows past kv_len."""
    rows: gl.constexpr = m_i.type.layout
    if qs == 0:
        offsets = row_bufs.slice(128 + 64 * WG, 64).load(rows)
    else:
        offsets = row_bufs.slice(256 + 128 + 64 * WG, 64).load(rows)
    lse = gl.where(l_i > 0, m_i + gl.log2(l_i), float("inf"))
    lse = gl.where(num_blocks > 0, lse, float("inf"))
    if HAS_SELF:
        own = r0 + 64 * WG + gl.arange(0, 64, layout=rows)
        lse = gl.where((r0 < 0) | (own < kv_len), lse, float("inf"))
        if ROWS_TMA:
            self_at = offsets // HEAD_DIM + ulse_offset
        else:
            self_at = (offsets - uo_delta) // HEAD_DIM + ulse_offset
        at = gl.where(r0 >= 0, self_at, offsets // HEAD_DIM)
        gl.store(lse_ptr + at, lse, mask=offsets != NO_ROW)
    else:
        gl.store(lse_ptr + offsets // HEAD_DIM, lse, mask=offsets >= 0)
# fmt: on


@gluon.jit
def _release_previous_slot(q_empty, i, WG: gl.constexpr):
    """ROWS_TMA: once item i-1's output store has read its q slot, hand the slot (and its info) back to the producer."""
    if i > 0:
        tma.store_wait(0)
        mbarrier.arrive(q_empty.index(2 * WG + (i - 1) % 2), count=1)


@gluon.jit
def _store_rows(out, out_ptr, row_bufs, qs, WG: gl.constexpr, HAS_SELF: gl.constexpr):
    """Scatter warpgroup WG's output rows `out` [64, d] back to [B, H, S, d] (16-byte stores) at the
    producer's output-row offsets (row_bufs, slot qs; -8 past the tile's end, NO_ROW with HAS_SELF, whose
    user_out offsets may be negative)."""
    HEAD_DIM: gl.constexpr = out.type.shape[1]
    io: gl.constexpr = _io_layout(HEAD_DIM)
    out = gl.convert_layout(out, io)
    if qs == 0:  # (the alignment hint on each load: on the branches' result it is lost)
        rows = gl.multiple_of(row_bufs.slice(128 + 64 * WG, 64).load(gl.SliceLayout(1, io)), 8)
    else:
        rows = gl.multiple_of(row_bufs.slice(256 + 128 + 64 * WG, 64).load(gl.SliceLayout(1, io)), 8)
    if HAS_SELF:
        row_ok = rows != NO_ROW
    else:
        row_ok = rows >= 0
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, io))
    gl.store(out_ptr + (rows[:, None] + cols[None, :]), out, mask=row_ok[:, None])


@gluon.jit
def _store_rows_tma(out, o_desc, q_smem, row_bufs, qs, WG: gl.constexpr):
    """ROWS_TMA: warpgroup WG's output rows `out` [64, d] (one contiguous run, or all past the tile's end) through
    its own q buffer (read by its last q·kᵀ, which has completed) and one TMA store; waited for before the slot
    goes back to the producer, under the next item's first q·kᵀ (`_release_previous_slot`)."""
    HEAD_DIM: gl.constexpr = out.type.shape[1]
    one: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    q_smem.store(out)
    fence_async_shared()
    if qs == 0:
        first = gl.max(row_bufs.slice(128 + 64 * WG, 1).load(one), 0)
    else:
        first = gl.max(row_bufs.slice(256 + 128 + 64 * WG, 1).load(one), 0)
    if first >= 0:
        tma.async_copy_shared_to_global(o_desc, [(first // HEAD_DIM).to(gl.int32), 0], q_smem)


# any U, B (and any addresses of user_q / user_out): one compiled kernel
# fmt: off
@gluon.jit(
    do_not_specialize=["num_items", "num_tiles", "num_users", "num_self_tiles", "uq_delta", "uo_delta", "ulse_offset"]
)
def _attention_ws_kernel(
    q_ptr,
    stride_qb,
    stride_qh,
    stride_qs,  # q [B, H, S, d]
    out_ptr,
    stride_ob,
    stride_oh,
    stride_os,  # out [B, H, S, d]
    k_desc,
    v_desc,  # 2-D [rows, stride_kl] views of k / v (attention.kv_2d_views), blocks [BLOCK_N, d]
    stride_ku,
    stride_kh,
    stride_kl,
    kv_len_ptr,  # [U] int32/int64 (unused without HAS_KV_LEN)
    order_ptr,
    tile_ptr,  # from attention._plan_kernel at BLOCK_M = 128
    sched_ptr,  # the plan's int32 words [flag, next ticket, programs done]: the last two zero, and left zero (DYNAMIC)
    num_items,  # tile slots × H
    num_tiles,  # tile slots (self tiles first)
    seq_len,
    num_queries,
    qk_scale,  # L, S, scale · log2(e)
    # HAS_SELF: user_q / user_out [U, H, L, d] lie uq_delta / uo_delta elements from q_ptr / out_ptr
    uq_delta, stride_uqu, stride_uqh, stride_uql, uo_delta, stride_uou, stride_uoh, stride_uol, num_users,
    num_self_tiles,  # U, U · cdiv(L, 128) (0 without HAS_SELF)
    q_desc,
    o_desc,  # ROWS_TMA: 2-D [B·H·S, d] views of q and out, blocks [64, d] (else any descriptors)
    uq_desc,
    uo_desc,  # ROWS_TMA with HAS_SELF: 2-D [U·H·L, d] views of user_q and user_out (else any descriptors)
    lse_ptr,  # WRITE_LSE: fp32 out, a candidate row's log-sum-exp (base 2) at its row of [B·H·S, d] (out contiguous)
    ulse_offset,  # and a user row's at ulse_offset + its row of [U·H·L, d] (user_out contiguous)
    HAS_KV_LEN: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    HAS_SELF: gl.constexpr, CAUSAL: gl.constexpr, DYNAMIC: gl.constexpr, ROWS_TMA: gl.constexpr,
    WRITE_LSE: gl.constexpr,
):
    """Persistent: each program runs the work items the producer takes (see module doc)."""
    gl.static_assert(STAGES >= 2, "the ring needs at least two slots")
    dtype: gl.constexpr = k_desc.dtype
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    gl.static_assert(BLOCK_N == 128 or not HAS_SELF, "self tiles of 128 rows: one diagonal key block per tile")
    HEAD_DIM: gl.constexpr = k_desc.block_type.shape[1]
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    # q rows of warpgroup w in slot 2·w + s (s: the item's parity); row offsets of slot s: q rows at
    # row_bufs[256·s …], output rows at [256·s + 128 …]; the item's (kv_len, hi, r0) at item_info[s]
    q_bufs = gl.allocate_shared_memory(dtype, [4, 64, HEAD_DIM], k_desc.layout)
    row_bufs = gl.allocate_shared_memory(gl.int64, [512], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    item_info = gl.allocate_shared_memory(gl.int32, [2, 4], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    q_ready = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(k_empty.index(s), count=2)  # one arrival per consumer warpgroup
        mbarrier.init(v_empty.index(s), count=2)
    for w in gl.static_range(2):
        mbarrier.init(turns.index(w), count=1)
    for s in gl.static_range(4):
        mbarrier.init(q_ready.index(s), count=1)
        mbarrier.init(q_empty.index(s), count=1)

    WG0: gl.constexpr = 0
    WG1: gl.constexpr = 1
    # (the partitions written out twice: Gluon takes no list of them built in the kernel)
    if ROWS_TMA:
        gl.warp_specialize(
            [
                (
                    _consumer,
                    (
                        out_ptr, k_bufs, v_bufs, q_bufs, row_bufs, item_info, q_ready, q_empty, k_ready, v_ready,
                        k_empty, v_empty, turns, qk_scale, o_desc, lse_ptr, uo_delta, ulse_offset, STAGES, WG0, HAS_SELF,
                        CAUSAL, ROWS_TMA, WRITE_LSE, uo_desc,
                    ),
                ),
                (
                    _consumer,
                    (
                        out_ptr, k_bufs, v_bufs, q_bufs, row_bufs, item_info, q_ready, q_empty, k_ready, v_ready,
                        k_empty, v_empty, turns, qk_scale, o_desc, lse_ptr, uo_delta, ulse_offset, STAGES, WG1, HAS_SELF,
                        CAUSAL, ROWS_TMA, WRITE_LSE, uo_desc,
                    ),
                ),
                (
                    _producer_rows_tma,
                    (
                        k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, tile_ptr, kv_len_ptr,
                        num_items, num_tiles, stride_ku, stride_kh, stride_kl, seq_len, stride_qb, stride_qh, stride_qs,
                        stride_ob, stride_oh, stride_os, order_ptr, num_queries, q_bufs, row_bufs, item_info, q_ready,
                        q_empty, sched_ptr, q_desc, uq_desc, stride_uqu, stride_uqh, stride_uql, stride_uou, stride_uoh,
                        stride_uol, num_users, num_self_tiles, HAS_KV_LEN, STAGES, DYNAMIC, HAS_SELF, CAUSAL,
                    ),
                ),
            ],
            [4, 1],
            [CONSUMER_REGS, PRODUCER_REGS],
        )
    else:
        gl.warp_specialize(
            [
                (
                    _consumer,
                    (
                        out_ptr, k_bufs, v_bufs, q_bufs, row_bufs, item_info, q_ready, q_empty, k_ready, v_ready,
                        k_empty, v_empty, turns, qk_scale, o_desc, lse_ptr, uo_delta, ulse_offset, STAGES, WG0, HAS_SELF,
                        CAUSAL, ROWS_TMA, WRITE_LSE,
                    ),
                ),
                (
                    _consumer,
                    (
                        out_ptr, k_bufs, v_bufs, q_bufs, row_bufs, item_info, q_ready, q_empty, k_ready, v_ready,
                        k_empty, v_empty, turns, qk_scale, o_desc, lse_ptr, uo_delta, ulse_offset, STAGES, WG1, HAS_SELF,
                        CAUSAL, ROWS_TMA, WRITE_LSE,
                    ),
                ),
                (
                    _producer,
                    (
                        k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, tile_ptr, kv_len_ptr,
                        num_items, num_tiles, stride_ku, stride_kh, stride_kl, seq_len, q_ptr, stride_qb, stride_qh,
                        stride_qs, stride_ob, stride_oh, stride_os, order_ptr, num_queries, q_bufs, row_bufs, item_info,
                        q_ready, q_empty, uq_delta, stride_uqu, stride_uqh, stride_uql, uo_delta, stride_uou,
                        stride_uoh, stride_uol, num_users, num_self_tiles, sched_ptr, HAS_KV_LEN, STAGES, HAS_SELF,
                        CAUSAL, DYNAMIC,
                    ),
                ),
            ],
            [4, 1],
            [CONSUMER_REGS, PRODUCER_REGS],
        )
# fmt: on


_attention_ws_launch = CachedLaunch(_attention_ws_kernel)


# ----------------------------------------------------------------------------- host side


def ws_supported(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether `_attention_ws_kernel` runs these (checked) inputs: a Hopper GPU, fp16/bf16, d ∈ {64, 128}."""
    if not k.is_cuda or k.dtype not in GLUON_TYPES or k.shape[3] not in WS_HEAD_DIMS:
        return False
    return _hopper.is_hopper(k.device)


MIN_ROWS_PER_USER = 256  # candidate query rows (B·S / U) per user below which the Triton kernel is taken


def preferred_shape(num_candidates: int, num_users: int, num_queries: int, seq_len: int) -> bool:
    """The shapes where this kernel is faster than the Triton kernel (docs/design/attention.md): S ≥ 64 and
    L ≥ 512, and at least MIN_ROWS_PER_USER query rows per user (with fewer, most of every 128-row tile is
    padding)."""
    rows_per_user = num_candidates * num_queries / max(num_users, 1)
    return num_queries >= 64 and seq_len >= 512 and rows_per_user >= MIN_ROWS_PER_USER


MIN_RAGGED_SELF_SEQ = 1024  # L below which self + target with kv_len takes the Triton kernel


def prefer_ws(q: torch.Tensor, k: torch.Tensor, kv_len: torch.Tensor | None = None, self_tiles: bool = False) -> bool:
    """Where `kernels.attention`'s Triton path takes this kernel: `ws_supported` and `preferred_shape`; self +
    target with kv_len only from L = MIN_RAGGED_SELF_SEQ (below it the Triton kernel's fused grid is faster with
    ragged histories)."""
    if self_tiles and kv_len is not None and k.shape[2] < MIN_RAGGED_SELF_SEQ:
        return False
    return ws_supported(q, k) and preferred_shape(q.shape[0], k.shape[0], q.shape[2], k.shape[2])


def _kv_descriptors(k, v, block_n, bind=NOW):
    """Gluon TMA descriptors over attention.kv_2d_views → (k_desc, v_desc, strides) (`bind`: kernels._launch)."""
    k, v, rows, strides = _attn.kv_2d_views(k, v)
    block = [block_n, k.shape[3]]
    layout = smem_layout(tuple(block), k.dtype)
    descs = [bind.desc(TensorDescriptor, t, [rows, strides[2]], [strides[2], 1], block, layout) for t in (k, v)]
    return descs[0], descs[1], strides


def _rows_aligned(t: torch.Tensor) -> bool:
    """Rows of t [·, ·, ·, d] copied and stored 16 bytes at a time: unit last stride, 16-byte aligned base,
    other strides multiples of 8 elements."""
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(st % 8 == 0 for st in t.stride()[:3])


def rows_by_tma(q: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether launch_ws moves q and out rows by TMA (ROWS_TMA; with self tiles also `self_rows_by_tma`): every
    64-row half of a 128-row tile is then one contiguous run of q and out rows (`attention.rows_by_tma`)."""
    return _attn.rows_by_tma(q, out, 64)


def self_rows_by_tma(user_q: torch.Tensor, user_out: torch.Tensor) -> bool:
    """Whether the self tiles' rows can come and go by TMA beside the target rows (`rows_by_tma`): L a multiple of
    64, so no 64-row half of a self tile crosses into the next (user, head) (`attention.rows_by_tma`)."""
    return _attn.rows_by_tma(user_q, user_out, 64)


def _row_descriptors(q: torch.Tensor, out: torch.Tensor, bind=NOW):
    """[B·H·S, d] views of q and out with [64, d] blocks (the q buffers' layout)."""
    head_dim = q.shape[3]
    layout = smem_layout((64, head_dim), q.dtype)
    return [
        bind.desc(TensorDescriptor, t, [t.numel() // head_dim, head_dim], [head_dim, 1], [64, head_dim], layout)
        for t in (q, out)
    ]


def _for_self_tiles(cfg: WSAttentionConfig) -> WSAttentionConfig:
    """cfg fitted to self tiles: key blocks of TILE_M (one diagonal block per self tile; the default's
    ring depth where cfg had others)."""
    if cfg.block_n != TILE_M:
        cfg = replace(cfg, block_n=TILE_M, stages=DEFAULT_CONFIG.stages)
    return cfg


def self_target_ws_ok(q, out, user_q, user_out) -> bool:
    """Whether `launch_ws` can take self tiles with these tensors: candidate query rows present (q's base
    anchors the user_q offsets, and the launch is skipped without them), and every row 16-byte aligned
    (q rows are copied 16 bytes at a time; only target-only launches copy unaligned tensors)."""
    return q.shape[0] * q.shape[2] > 0 and all(_rows_aligned(t) for t in (q, out, user_q, user_out))


# fmt: off
def launch_ws(
    q, k, v, cand_to_user, kv_len, scale,
    config: WSAttentionConfig | None = None,
    out=None,
    plan=None,
    host_flag=None,
    num_programs: int | None = None,
    user_q=None,
    user_out=None,
    causal: bool = True,
    lse=None,
    recording: Recording | None = None,
):
    """Target attention through `_attention_ws_kernel` for inputs that passed ikbo_attention's checks
    and `ws_supported`. q [B, H, S, d], k/v [U, H, L, d] (U ≥ 1); `plan` from
    `attention.plan_tiles(..., block_m=TILE_M)` when one batch's grouping serves several calls (not by
    two launches at once: the kernel's item counter lives in it); `host_flag` (a pinned host word) gets 1 +
    the plan's flag; `num_programs` overrides the persistent grid (tests). With user_q [U, H, L, d] (and
    user_out, written in place; where `self_target_ws_ok`) the user's own (causal) self-attention tiles
    run in the same launch over the same K/V, as `attention.ikbo_self_target_attention`. q or out rows
    that are not 16-byte aligned go through aligned copies. With `lse` (fp32, `attention.lse_size` elements; out
    and user_out contiguous) the rows' log-sum-exp for the backward goes there, as `attention._launch` writes it.
    With `recording` (kernels._launch) the launches are kept for replay. Nothing here waits for the device.
    Returns (out, flag): flag [1] int32 is 1 when an index value was out of range."""
    cfg = config or DEFAULT_CONFIG
    if user_q is not None and user_out is None:
        raise ValueError("launch_ws: user_out [U, H, L, d] must be given with user_q (it is written in place)")
    if user_q is not None and not self_target_ws_ok(q, out if out is not None else q, user_q, user_out):
        raise ValueError("launch_ws: self tiles need candidates and 16-byte aligned rows of q, out, user_q, user_out")
    if lse is not None and not all(t is None or t.is_contiguous() for t in (out, user_out)):
        raise ValueError("launch_ws: lse is written at the rows of contiguous out and user_out")
    num_candidates, heads, num_queries, head_dim = q.shape
    num_users, _, seq_len, _ = k.shape
    if out is None:
        out = named(recording, "out", torch.empty_like(q, memory_format=torch.contiguous_format))
    if plan is None:
        plan = _attn.plan_tiles(
            cand_to_user, num_users, num_queries, TILE_M, kv_len, seq_len, host_flag=host_flag, recording=recording
        )
    order, tiles, max_tiles, flag = plan
    if heads * seq_len * num_candidates * num_queries == 0:
        fail(recording)
        if user_q is not None:
            user_out.zero_()
        if lse is not None:
            lse.fill_(float("inf"))
        return out.zero_(), flag
    if not _rows_aligned(q):
        q = q.clone(memory_format=torch.contiguous_format)
    dest = out if _rows_aligned(out) else torch.empty_like(q, memory_format=torch.contiguous_format)
    if user_q is not None:
        cfg = _for_self_tiles(cfg)
    num_self_tiles = 0 if user_q is None else num_users * triton.cdiv(seq_len, TILE_M)
    num_items = (num_self_tiles + max_tiles) * heads
    grid = (min(num_items, num_programs or cfg.programs_per_sm * _hopper.device_info(q.device)[1]),)
    uq, uo = (q, dest) if user_q is None else (user_q, user_out)
    elem = q.element_size()
    rows_tma = rows_by_tma(q, dest) and (user_q is None or self_rows_by_tma(user_q, user_out))

    def build(bind):
        k_desc, v_desc, (stride_ku, stride_kh, stride_kl) = _kv_descriptors(k, v, cfg.block_n, bind)
        q_desc, o_desc = _row_descriptors(q, dest, bind) if rows_tma else (k_desc, k_desc)
        uq_desc, uo_desc = (
            _row_descriptors(user_q, user_out, bind) if rows_tma and user_q is not None else (q_desc, o_desc)
        )
        return (
            bind.ptr(q), q.stride(0), q.stride(1), q.stride(2),
            bind.ptr(dest), dest.stride(0), dest.stride(1), dest.stride(2),
            k_desc, v_desc, stride_ku, stride_kh, stride_kl,
            bind.ptr(order if kv_len is None else kv_len), bind.ptr(order), bind.ptr(tiles), bind.ptr(flag),
            num_items, num_self_tiles + max_tiles, seq_len, num_queries, scale * _attn.LOG2E,
            bind.diff(uq, q, elem), uq.stride(0), uq.stride(1), uq.stride(2),
            bind.diff(uo, dest, elem), uo.stride(0), uo.stride(1), uo.stride(2),
            num_users, num_self_tiles, q_desc, o_desc, uq_desc, uo_desc,
            bind.ptr(flag if lse is None else lse), num_candidates * heads * num_queries,
        )  # fmt: skip

    launch(
        _attention_ws_launch, grid, build, recording,
        HAS_KV_LEN=kv_len is not None, STAGES=cfg.stages,
        CONSUMER_REGS=cfg.consumer_regs, PRODUCER_REGS=cfg.producer_regs,
        HAS_SELF=user_q is not None, CAUSAL=causal,
        DYNAMIC=cfg.dynamic if cfg.dynamic is not None else user_q is not None or kv_len is not None,
        ROWS_TMA=rows_tma, WRITE_LSE=lse is not None,
        num_warps=4, maxnreg=cfg.maxnreg,
    )  # fmt: skip
    if dest is not out:
        out.copy_(dest)
    return out, flag
# fmt: on


# ----------------------------------------------------------------------------- backward: dK / dV


@gluon.jit
def _dkdv_ranked_user(rank, users_ptr, num_users, num_queries, MAX_USERS: gl.constexpr):
    """The user of `rank` when users are ordered by their candidate query rows, most first (ties by user number),
    as attention.py's `_ranked_user` without self rows: the longest walks start first."""
    pairs: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [4, 1], [1, 0])
    mine = gl.arange(0, MAX_USERS, layout=gl.SliceLayout(1, pairs))
    other = gl.arange(0, MAX_USERS, layout=gl.SliceLayout(0, pairs))
    work_mine = gl.where(mine < num_users, gl.load(users_ptr + 2 * mine + 1, mask=mine < num_users, other=0), -1)
    work_other = gl.where(other < num_users, gl.load(users_ptr + 2 * other + 1, mask=other < num_users, other=0), -1)
    ahead = (work_other[None, :] > work_mine[:, None]) | (
        (work_other[None, :] == work_mine[:, None]) & (other[None, :] < mine[:, None])
    )
    ranks = gl.sum(ahead.to(gl.int32), 1)
    return gl.sum(gl.where((mine < num_users) & (ranks == rank), mine, 0), 0)


# fmt: off
@gluon.jit
def _dkdv_producer(
    k_desc, v_desc, q_desc, do_desc, uq_desc, udo_desc, kv_bufs, q_bufs, do_bufs, row_info, kv_ready, ready, empty,
    order_ptr, kv_row, kv_col, first, row_lo, num_steps, num_target, num_plain, plain_row0, diag_row0, self_lse_at,
    head, heads, num_queries, STAGES: gl.constexpr, HAS_SELF: gl.constexpr,
):
    """1 warp: the program's K and V block (two 64-key halves each) once, then for each step its 64 query rows of q
    and dO by TMA into ring slot step % STAGES (once both consumers released it), with the rows' first index into
    lse / Δ in row_info for the consumers. With HAS_SELF the num_target candidate steps are followed by the user's own
    rows (user_q and its output's gradient, rows of [U·H·L, d]; lse / Δ at self_lse_at + row): num_plain steps from
    plain_row0, then the rest (the causal diagonal) from diag_row0."""
    HALF: gl.constexpr = k_desc.block_type.shape[0]
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    if num_steps > 0:
        mbarrier.expect(kv_ready, 4 * k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [kv_row, kv_col], kv_ready, kv_bufs.index(0))
        tma.async_copy_global_to_shared(k_desc, [kv_row + HALF, kv_col], kv_ready, kv_bufs.index(1))
        tma.async_copy_global_to_shared(v_desc, [kv_row, kv_col], kv_ready, kv_bufs.index(2))
        tma.async_copy_global_to_shared(v_desc, [kv_row + HALF, kv_col], kv_ready, kv_bufs.index(3))
    for step in range(num_steps):
        slot = step % STAGES
        mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)
        if HAS_SELF and step >= num_target:
            own = step - num_target
            row0 = gl.where(own < num_plain, plain_row0 + own * BLOCK_M, diag_row0 + (own - num_plain) * BLOCK_M)
            row_info.index(slot).store(gl.full([4], self_lse_at + row0, gl.int32, _INFO_PRODUCER))
            gl.thread_barrier()  # every lane's part is in shared memory before the arrive
            mbarrier.expect(ready.index(slot), 2 * q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(uq_desc, [row0, 0], ready.index(slot), q_bufs.index(slot))
            tma.async_copy_global_to_shared(udo_desc, [row0, 0], ready.index(slot), do_bufs.index(slot))
        else:
            r0 = row_lo + step * BLOCK_M
            cand_slot = r0 // num_queries
            cand = gl.load(order_ptr + first + cand_slot)
            row0 = (cand * heads + head) * num_queries + (r0 - cand_slot * num_queries)  # < 2**31 (rows_by_tma)
            row_info.index(slot).store(gl.full([4], row0, gl.int32, _INFO_PRODUCER))
            gl.thread_barrier()
            mbarrier.expect(ready.index(slot), 2 * q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [row0, 0], ready.index(slot), q_bufs.index(slot))
            tma.async_copy_global_to_shared(do_desc, [row0, 0], ready.index(slot), do_bufs.index(slot))
# fmt: on


# fmt: off
@gluon.jit
def _dkdv_steps(
    k_smem, v_smem, q_bufs, do_bufs, row_info, ready, empty, lse_ptr, delta_ptr, dk, dv, first_step, end_step, keys,
    key_ok, diag_lo, qk_scale, STAGES: gl.constexpr, DIAGONAL: gl.constexpr,
):
    """Steps [first_step, end_step) of a consumer's walk (`_dkdv_consumer`) → (dk, dv). DIAGONAL: the steps are a
    user's own rows from position diag_lo (step first_step there) over the block's keys from diag_lo, causal: a row
    sees the keys up to its position. Rows past kv_len have lse = +inf (P = 0) from the forward. A loop of their own
    keeps the causal mask out of the other steps' loop (sharing one, its lane values spilled)."""
    BLOCK_M: gl.constexpr = q_bufs.type.shape[1]
    HEAD_DIM: gl.constexpr = q_bufs.type.shape[2]
    dtype: gl.constexpr = q_bufs.dtype
    s_layout: gl.constexpr = _mma_layout(BLOCK_M)
    o_layout: gl.constexpr = _mma_layout(HEAD_DIM)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    cols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    for step in range(first_step, end_step):
        slot = step % STAGES
        mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
        q_smem = q_bufs.index(slot)
        do_smem = do_bufs.index(slot)
        s_tok = warpgroup_mma(
            k_smem, q_smem.permute((1, 0)), gl.zeros([64, BLOCK_M], gl.float32, s_layout), use_acc=False,
            is_async=True,
        )
        dp_tok = warpgroup_mma(
            v_smem, do_smem.permute((1, 0)), gl.zeros([64, BLOCK_M], gl.float32, s_layout), use_acc=False,
            is_async=True,
        )
        info = row_info.index(slot).load(_INFO_CONSUMER)
        row0 = gl.max(info, 0)
        lse = gl.load(lse_ptr + row0 + cols)
        delta = gl.load(delta_ptr + row0 + cols)
        s, dk, dv = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, dk, dv))
        if step > 0:  # the previous step's products (issued before this Sᵀ) are done with its slot
            mbarrier.arrive(empty.index((step - 1) % STAGES), count=1)
        if DIAGONAL:
            pos = diag_lo + (step - first_step) * BLOCK_M + cols
            p = gl.where(key_ok & (keys[:, None] <= pos[None, :]), gl.exp2(s * qk_scale - lse[None, :]), 0.0)
        else:
            p = gl.where(key_ok, gl.exp2(s * qk_scale - lse[None, :]), 0.0)
        dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp_tok,))
        ds = p * (dp - delta[None, :])
        dv_tok = warpgroup_mma(gl.convert_layout(p.to(dtype), op_layout), do_smem, dv, is_async=True)
        dk_tok = warpgroup_mma(gl.convert_layout(ds.to(dtype), op_layout), q_smem, dk, is_async=True)
        dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv_tok, dk_tok))
    return dk, dv
# fmt: on


# fmt: off
@gluon.jit
def _dkdv_consumer(
    kv_bufs, q_bufs, do_bufs, row_info, kv_ready, ready, empty, lse_ptr, delta_ptr, dk_ptr, dv_ptr, num_steps, kv_len,
    out_row, start_n, seq_len, qk_scale, scale, num_unmasked, STAGES: gl.constexpr, WG: gl.constexpr,
    SPLIT: gl.constexpr, DIAGONAL: gl.constexpr,
):
    """One warpgroup: keys [start_n + 64·WG, + 64) of the program's block, transposed products (keys are the rows):
    per step Sᵀ = k·qᵀ and dPᵀ = v·dOᵀ (async wgmma, B from shared memory), Pᵀ = exp2(Sᵀ·qk_scale − lse), dV += Pᵀ·dO
    and dK += (Pᵀ ∘ (dPᵀ − Δ))·q (A from registers), each step waiting for its products (kept in flight across
    steps, ptxas serialized every wgmma); then dK·scale and dV stored at `out_row` + key (or added in fp32 with
    SPLIT). With DIAGONAL the steps from num_unmasked on are the causal diagonal of the user's own rows (from the
    block's first key)."""
    HEAD_DIM: gl.constexpr = q_bufs.type.shape[2]
    s_layout: gl.constexpr = _mma_layout(q_bufs.type.shape[1])
    o_layout: gl.constexpr = _mma_layout(HEAD_DIM)
    keys = start_n + 64 * WG + gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout))
    key_ok = (keys < kv_len)[:, None]
    dk = gl.zeros([64, HEAD_DIM], gl.float32, o_layout)
    dv = gl.zeros([64, HEAD_DIM], gl.float32, o_layout)
    if num_steps > 0:
        mbarrier.wait(kv_ready, 0)
    k_smem = kv_bufs.index(WG)
    v_smem = kv_bufs.index(2 + WG)
    dk, dv = _dkdv_steps(
        k_smem, v_smem, q_bufs, do_bufs, row_info, ready, empty, lse_ptr, delta_ptr, dk, dv, 0, num_unmasked, keys,
        key_ok, start_n, qk_scale, STAGES, False,
    )
    if DIAGONAL:
        dk, dv = _dkdv_steps(
            k_smem, v_smem, q_bufs, do_bufs, row_info, ready, empty, lse_ptr, delta_ptr, dk, dv, num_unmasked,
            num_steps, keys, key_ok, start_n, qk_scale, STAGES, True,
        )
    dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
    io_rows = gl.arange(0, 64, layout=gl.SliceLayout(1, o_layout))
    io_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    rows = start_n + 64 * WG + io_rows
    at = (out_row + rows.to(gl.int64))[:, None] * HEAD_DIM + io_cols[None, :]
    row_ok = (rows < seq_len)[:, None]
    if SPLIT:
        if num_steps > 0:  # the fp32 buffers start at zero
            gl.atomic_add(dk_ptr + at, dk * scale, mask=row_ok, sem="relaxed")
            gl.atomic_add(dv_ptr + at, dv, mask=row_ok, sem="relaxed")
    else:
        gl.store(dk_ptr + at, (dk * scale).to(dk_ptr.dtype.element_ty), mask=row_ok)
        gl.store(dv_ptr + at, dv.to(dv_ptr.dtype.element_ty), mask=row_ok)
# fmt: on


# fmt: off
@gluon.jit(do_not_specialize=["num_users", "heads", "seq_len", "splits"])
def _dkdv_ws_kernel(
    k_desc, v_desc, stride_ku, stride_kh, stride_kl,  # 2-D views of k / v (attention.kv_2d_views), blocks [64, d]
    q_desc, do_desc,  # [B·H·S, d] views of q and dO (contiguous), blocks [64, d]
    uq_desc, udo_desc,  # HAS_SELF: [U·H·L, d] views of user_q and its output's gradient, blocks [64, d]
    lse_ptr, delta_ptr,  # fp32: the forward's log-sum-exp (base 2), Δ = rowsum(dO ∘ O); [B·H·S] then [U·H·L]
    dk_ptr, dv_ptr,  # [U, H, L, d] contiguous out (fp32 and zeroed with SPLIT)
    kv_len_ptr, order_ptr, users_ptr,  # kv_len [U] (unused without HAS_KV_LEN), the plan's order, users [U, 2]
    num_users, heads, seq_len, num_queries, splits, qk_scale, scale, self_lse_at,
    HAS_KV_LEN: gl.constexpr, RANK_USERS: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, HAS_SELF: gl.constexpr, CAUSAL: gl.constexpr,
):
    """dK, dV of target attention, as attention.py's `_attention_bwd_dkdv_kernel` with ROWS_TMA: 1-D grid over (user
    rank, split, head, 128-key block), key blocks fastest; a program's two consumer warpgroups own 64 keys each and
    walk the split's share of the user's candidate query rows, 64 a step, which a producer warp copies by TMA into a
    STAGES-deep ring. With HAS_SELF the first split then walks the user's own rows that see the block (from the
    block's first key with CAUSAL, else from 0; up to kv_len); their lse and Δ lie at self_lse_at + row."""
    gl.static_assert(STAGES >= 2, "the ring needs at least two slots")
    dtype: gl.constexpr = k_desc.dtype
    HALF: gl.constexpr = k_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = k_desc.block_type.shape[1]
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    gl.static_assert(HALF == 64, "two consumer warpgroups of 64 keys")
    BLOCK_N: gl.constexpr = 2 * HALF
    num_blocks = gl.cdiv(seq_len, BLOCK_N)
    pid = gl.program_id(0)
    block = pid % num_blocks
    head = (pid // num_blocks) % heads
    split = (pid // (num_blocks * heads)) % splits
    rank = pid // (num_blocks * heads * splits)
    if RANK_USERS > 0:
        user = _dkdv_ranked_user(rank, users_ptr, num_users, num_queries, RANK_USERS)
    else:
        user = rank
    kv_len = seq_len
    if HAS_KV_LEN:
        kv_len = gl.minimum(gl.maximum(gl.load(kv_len_ptr + user).to(gl.int32), 0), seq_len)
    start_n = block * BLOCK_N
    first = gl.load(users_ptr + 2 * user)
    row_end = gl.load(users_ptr + 2 * user + 1) * num_queries
    chunk = gl.cdiv(gl.cdiv(row_end, splits), BLOCK_M) * BLOCK_M
    row_lo = gl.minimum(split * chunk, row_end)
    row_end = gl.minimum(row_lo + chunk, row_end)
    num_steps = gl.where(start_n < kv_len, gl.cdiv(row_end - row_lo, BLOCK_M), 0)
    num_target = num_steps
    num_plain = 0  # the user's own rows that see the whole block (all of them without CAUSAL)
    num_diag = 0  # with CAUSAL, the rows of the block's diagonal
    user_row0 = (user * heads + head) * seq_len  # < 2**31 (rows_by_tma)
    plain_row0 = user_row0
    if HAS_SELF:
        live = (split == 0) & (start_n < kv_len)
        if CAUSAL:
            num_diag = gl.where(live, gl.minimum(gl.cdiv(kv_len - start_n, BLOCK_M), BLOCK_N // BLOCK_M), 0)
            num_plain = gl.where(live, gl.cdiv(gl.maximum(kv_len - start_n - BLOCK_N, 0), BLOCK_M), 0)
            plain_row0 = user_row0 + start_n + BLOCK_N
        else:
            num_plain = gl.where(live, gl.cdiv(kv_len, BLOCK_M), 0)
        num_steps += num_plain + num_diag
    kv_offset = user.to(gl.int64) * stride_ku + head * stride_kh
    kv_row = (kv_offset // stride_kl).to(gl.int32) + start_n
    kv_col = (kv_offset % stride_kl).to(gl.int32)
    out_row = (user.to(gl.int64) * heads + head) * seq_len

    kv_bufs = gl.allocate_shared_memory(dtype, [4, HALF, HEAD_DIM], k_desc.layout)  # K halves, then V halves
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
    row_info = gl.allocate_shared_memory(gl.int32, [STAGES, 4], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # one arrival per consumer warpgroup

    WG0: gl.constexpr = 0
    WG1: gl.constexpr = 1
    gl.warp_specialize(
        [
            (
                _dkdv_consumer,
                (
                    kv_bufs, q_bufs, do_bufs, row_info, kv_ready, ready, empty, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
                    num_steps, kv_len, out_row, start_n, seq_len, qk_scale, scale, num_target + num_plain, STAGES,
                    WG0, SPLIT, HAS_SELF and CAUSAL,
                ),
            ),
            (
                _dkdv_consumer,
                (
                    kv_bufs, q_bufs, do_bufs, row_info, kv_ready, ready, empty, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
                    num_steps, kv_len, out_row, start_n, seq_len, qk_scale, scale, num_target + num_plain, STAGES,
                    WG1, SPLIT, HAS_SELF and CAUSAL,
                ),
            ),
            (
                _dkdv_producer,
                (
                    k_desc, v_desc, q_desc, do_desc, uq_desc, udo_desc, kv_bufs, q_bufs, do_bufs, row_info, kv_ready,
                    ready, empty, order_ptr, kv_row, kv_col, first, row_lo, num_steps, num_target, num_plain,
                    plain_row0, user_row0 + start_n, self_lse_at, head, heads, num_queries, STAGES, HAS_SELF,
                ),
            ),
        ],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )
# fmt: on


_dkdv_ws_launch = CachedLaunch(_dkdv_ws_kernel)


# fmt: off
@gluon.jit
def _dq_producer(
    k_desc, v_desc, q_desc, do_desc, q_bufs, do_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready, k_empty, v_empty,
    live, row0_a, row0_b, kv_row, kv_col, num_blocks, STAGES: gl.constexpr,
):
    """1 warp: each consumer warpgroup's 64 q and dO rows by TMA, then the user's K and V blocks into a STAGES-deep
    ring, K and V with their own ready / empty mbarriers."""
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    if live:
        mbarrier.expect(q_ready.index(0), 2 * q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [row0_a, 0], q_ready.index(0), q_bufs.index(0))
        tma.async_copy_global_to_shared(do_desc, [row0_a, 0], q_ready.index(0), do_bufs.index(0))
        mbarrier.expect(q_ready.index(1), 2 * q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [row0_b, 0], q_ready.index(1), q_bufs.index(1))
        tma.async_copy_global_to_shared(do_desc, [row0_b, 0], q_ready.index(1), do_bufs.index(1))
    for j in range(num_blocks):
        _load_kv_block(
            k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, j, kv_row + j * BLOCK_N, kv_col, STAGES
        )
# fmt: on


# fmt: off
@gluon.jit
def _dq_consumer(
    q_bufs, do_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready, k_empty, v_empty, o_ptr, do_ptr, dq_ptr, lse_ptr,
    delta_ptr, live, row0, valid, kv_len, num_blocks, qk_scale, scale, STAGES: gl.constexpr, WG: gl.constexpr,
):
    """One warpgroup: 64 query rows (one run of one candidate, from row0 of [B·H·S, d]). Δ = rowsum(dO ∘ O), stored
    for the dK/dV kernel; then per key block S = q·kᵀ and dP = dO·vᵀ (async wgmma), P = exp2(S·qk_scale − lse),
    dQ += (P ∘ (dP − Δ))·k (A from registers); dQ·scale stored where `valid` (a tile's second half may lie past
    its end: computed on the first half's rows, not stored)."""
    BLOCK_N: gl.constexpr = k_bufs.type.shape[1]
    HEAD_DIM: gl.constexpr = k_bufs.type.shape[2]
    dtype: gl.constexpr = k_bufs.dtype
    s_layout: gl.constexpr = _mma_layout(BLOCK_N)
    o_layout: gl.constexpr = _mma_layout(HEAD_DIM)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    io: gl.constexpr = _io_layout(HEAD_DIM)
    io_rows = gl.arange(0, 64, layout=gl.SliceLayout(1, io))
    io_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, io))
    at = (row0.to(gl.int64) + io_rows)[:, None] * HEAD_DIM + io_cols[None, :]
    o = gl.load(o_ptr + at).to(gl.float32)
    delta = gl.sum(o * gl.load(do_ptr + at).to(gl.float32), 1)
    gl.store(delta_ptr + row0 + io_rows, delta, mask=valid & (io_rows >= 0))
    delta = gl.convert_layout(delta, s_rows)
    lse = gl.load(lse_ptr + row0 + gl.arange(0, 64, layout=s_rows))
    dq = gl.zeros([64, HEAD_DIM], gl.float32, o_layout)
    if live:
        mbarrier.wait(q_ready.index(WG), 0)
    q_smem = q_bufs.index(WG)
    do_smem = do_bufs.index(WG)
    for j in range(num_blocks):
        slot = j % STAGES
        phase = (j // STAGES) & 1
        mbarrier.wait(k_ready.index(slot), phase)
        s_tok = warpgroup_mma(
            q_smem, k_bufs.index(slot).permute((1, 0)), gl.zeros([64, BLOCK_N], gl.float32, s_layout), use_acc=False,
            is_async=True,
        )
        mbarrier.wait(v_ready.index(slot), phase)
        dp_tok = warpgroup_mma(
            do_smem, v_bufs.index(slot).permute((1, 0)), gl.zeros([64, BLOCK_N], gl.float32, s_layout),
            use_acc=False, is_async=True,
        )
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
        p = gl.exp2(s * qk_scale - lse[:, None])
        if (j + 1) * BLOCK_N > kv_len:  # the last, partial block
            keys = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            p = gl.where((keys < kv_len)[None, :], p, 0.0)
        dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp_tok,))
        mbarrier.arrive(v_empty.index(slot), count=1)
        ds = p * (dp - delta[:, None])
        dq_tok = warpgroup_mma(gl.convert_layout(ds.to(dtype), op_layout), k_bufs.index(slot), dq, is_async=True)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq_tok,))
        mbarrier.arrive(k_empty.index(slot), count=1)
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    out_at = (row0.to(gl.int64) + rows)[:, None] * HEAD_DIM + cols[None, :]
    gl.store(dq_ptr + out_at, (dq * scale).to(dq_ptr.dtype.element_ty), mask=valid & (rows >= 0)[:, None])
# fmt: on


# fmt: off
@gluon.jit(do_not_specialize=["seq_len"])
def _dq_ws_kernel(
    k_desc, v_desc, stride_ku, stride_kh, stride_kl,  # 2-D views of k / v (attention.kv_2d_views), blocks [BLOCK_N, d]
    q_desc, do_desc,  # [B·H·S, d] views of q and dO (contiguous), blocks [64, d]
    o_ptr, do_ptr, dq_ptr,  # [B, H, S, d] contiguous: the forward's output, its gradient, dQ (out)
    lse_ptr, delta_ptr,  # [B·H·S] fp32: the forward's log-sum-exp (base 2), Δ (out)
    kv_len_ptr, order_ptr, tile_ptr,  # kv_len [U] (unused without HAS_KV_LEN), the plan's order and 128-row tiles
    seq_len, num_queries, qk_scale, scale,
    HAS_KV_LEN: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):
    """dQ and Δ of target attention (no self rows), as attention.py's `_attention_bwd_dq_kernel` over the candidate
    tiles with S a multiple of 64: grid (plan tiles of 128 rows, H); two consumer warpgroups own 64 rows each and
    walk the user's K/V blocks, which a producer warp copies by TMA into a STAGES-deep ring."""
    gl.static_assert(STAGES >= 2, "the ring needs at least two slots")
    dtype: gl.constexpr = k_desc.dtype
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = k_desc.block_type.shape[1]
    tile = gl.program_id(0)
    head = gl.program_id(1)
    heads = gl.num_programs(1)
    entry = tile_ptr + tile * 4
    user = gl.load(entry)
    live = user >= 0
    user = gl.maximum(user, 0)
    first_slot = gl.load(entry + 1)
    r_start = gl.load(entry + 2)
    r_end = gl.load(entry + 3)
    kv_len = seq_len
    if HAS_KV_LEN:
        kv_len = gl.minimum(gl.maximum(gl.load(kv_len_ptr + user).to(gl.int32), 0), seq_len)
    kv_len = gl.where(live, kv_len, 0)
    num_blocks = gl.cdiv(kv_len, BLOCK_N)
    valid_b = live & (r_start + 64 < r_end)
    slot_a = r_start // num_queries
    cand_a = gl.load(order_ptr + first_slot + slot_a, mask=live, other=0)
    row0_a = (cand_a * heads + head) * num_queries + (r_start - slot_a * num_queries)  # < 2**31 (rows_by_tma)
    r_b = gl.where(valid_b, r_start + 64, r_start)
    slot_b = r_b // num_queries
    cand_b = gl.load(order_ptr + first_slot + slot_b, mask=live, other=0)
    row0_b = (cand_b * heads + head) * num_queries + (r_b - slot_b * num_queries)
    kv_offset = user.to(gl.int64) * stride_ku + head * stride_kh
    kv_row = (kv_offset // stride_kl).to(gl.int32)
    kv_col = (kv_offset % stride_kl).to(gl.int32)

    q_bufs = gl.allocate_shared_memory(dtype, [2, 64, HEAD_DIM], q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [2, 64, HEAD_DIM], do_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for w in gl.static_range(2):
        mbarrier.init(q_ready.index(w), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(k_empty.index(s), count=2)  # one arrival per consumer warpgroup
        mbarrier.init(v_empty.index(s), count=2)

    WG0: gl.constexpr = 0
    WG1: gl.constexpr = 1
    gl.warp_specialize(
        [
            (
                _dq_consumer,
                (
                    q_bufs, do_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready, k_empty, v_empty, o_ptr, do_ptr,
                    dq_ptr, lse_ptr, delta_ptr, live, row0_a, live, kv_len, num_blocks, qk_scale, scale, STAGES, WG0,
                ),
            ),
            (
                _dq_consumer,
                (
                    q_bufs, do_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready, k_empty, v_empty, o_ptr, do_ptr,
                    dq_ptr, lse_ptr, delta_ptr, live, row0_b, valid_b, kv_len, num_blocks, qk_scale, scale, STAGES,
                    WG1,
                ),
            ),
            (
                _dq_producer,
                (
                    k_desc, v_desc, q_desc, do_desc, q_bufs, do_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready,
                    k_empty, v_empty, live, row0_a, row0_b, kv_row, kv_col, num_blocks, STAGES,
                ),
            ),
        ],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )
# fmt: on


_dq_ws_launch = CachedLaunch(_dq_ws_kernel)


@dataclass(frozen=True)
class WSBackwardConfig:
    """Ring depth and register split of `_dkdv_ws_kernel`."""

    stages: int = 3  # dK/dV: q / dO ring depth (32 KiB a slot at d = 128)
    dq_block_n: int = 128  # dQ: keys a step
    dq_stages: int = 2  # dQ: K / V ring depth
    consumer_regs: int = 240  # registers per thread of the worker consumer warpgroup (setmaxnreg)
    producer_regs: int = 24
    maxnreg: int = 168  # at launch: 12 warps × 32 × 168 ≤ 64 K registers (setmaxnreg moves them)


DEFAULT_BACKWARD_CONFIG = WSBackwardConfig()


def dkdv_ws_ok(q: torch.Tensor, grad_out: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether `launch_dkdv_ws` takes these (checked) tensors: `ws_supported`, and q / dO rows that move by TMA 64
    at a time (`attention.rows_by_tma`)."""
    return ws_supported(q, k) and q.shape[0] > 0 and _attn.rows_by_tma(q, grad_out, 64)


# fmt: off
def launch_dq_ws(
    q, grad_out, out, k, v, lse, delta, kv_len, scale, order, tiles, num_tiles, dq, config=None, recording=None
):
    """dQ and Δ of target attention through `_dq_ws_kernel` for tensors where `dkdv_ws_ok` (out contiguous too):
    lse of the candidate rows ([B·H·S] fp32), Δ written there; the plan's order and tiles at TILE_M rows
    (`attention.plan_tiles`, num_tiles slots); dq [B, H, S, d] contiguous, written. With `recording` the launch is
    kept for replay (kernels._launch). Nothing waits for the device."""
    cfg = config or DEFAULT_BACKWARD_CONFIG
    heads, num_queries = q.shape[1], q.shape[2]

    def build(bind):
        k_desc, v_desc, (stride_ku, stride_kh, stride_kl) = _kv_descriptors(k, v, cfg.dq_block_n, bind)
        q_desc, do_desc = _row_descriptors(q, grad_out, bind)
        return (
            k_desc, v_desc, stride_ku, stride_kh, stride_kl, q_desc, do_desc, bind.ptr(out), bind.ptr(grad_out),
            bind.ptr(dq), bind.ptr(lse), bind.ptr(delta), bind.ptr(order if kv_len is None else kv_len),
            bind.ptr(order), bind.ptr(tiles), k.shape[2], num_queries, scale * _attn.LOG2E, scale,
        )

    launch(
        _dq_ws_launch, (num_tiles, heads), build, recording,
        HAS_KV_LEN=kv_len is not None, STAGES=cfg.dq_stages, CONSUMER_REGS=cfg.consumer_regs,
        PRODUCER_REGS=cfg.producer_regs, num_warps=4, maxnreg=cfg.maxnreg,
    )
    return dq
# fmt: on


# fmt: off
def launch_dkdv_ws(
    q, grad_out, k, v, lse, delta, kv_len, scale, order, users, dk, dv, splits=1, accumulate=False, config=None,
    user_q=None, grad_user_out=None, causal=True, recording=None,
):
    """dK and dV of target attention through `_dkdv_ws_kernel` for tensors where `dkdv_ws_ok`: lse and Δ of the
    candidate rows ([B·H·S] fp32; with user_q, the user rows' [U·H·L] follow them, as `attention.split_lse` lays
    them out), the plan's order and users table (`attention.plan_tiles(users=...)`), dk / dv [U, H, L, d]
    contiguous, written (with splits > 1 or `accumulate`: fp32, added into). With user_q and grad_user_out [U, H,
    L, d] (where `self_rows_by_tma`) the user's own rows (causal or not) are walked too, by the first split. With
    `recording` the launch is kept for replay (kernels._launch). Nothing waits for the device."""
    cfg = config or DEFAULT_BACKWARD_CONFIG
    num_users, heads, seq_len, head_dim = k.shape
    num_queries = q.shape[2]

    def build(bind):
        k_desc, v_desc, (stride_ku, stride_kh, stride_kl) = _kv_descriptors(k, v, 64, bind)
        q_desc, do_desc = _row_descriptors(q, grad_out, bind)
        uq_desc, udo_desc = (q_desc, do_desc) if user_q is None else _row_descriptors(user_q, grad_user_out, bind)
        return (
            k_desc, v_desc, stride_ku, stride_kh, stride_kl, q_desc, do_desc, uq_desc, udo_desc, bind.ptr(lse),
            bind.ptr(delta), bind.ptr(dk), bind.ptr(dv), bind.ptr(order if kv_len is None else kv_len),
            bind.ptr(order), bind.ptr(users), num_users, heads, seq_len, num_queries, splits, scale * _attn.LOG2E,
            scale, q.numel() // head_dim,
        )

    launch(
        _dkdv_ws_launch, (num_users * heads * triton.cdiv(seq_len, 128) * splits,), build, recording,
        HAS_KV_LEN=kv_len is not None, RANK_USERS=_attn.RANKED_USERS if num_users <= _attn.RANKED_USERS else 0,
        STAGES=cfg.stages, SPLIT=splits > 1 or accumulate, CONSUMER_REGS=cfg.consumer_regs, PRODUCER_REGS=cfg.producer_regs,
        HAS_SELF=user_q is not None, CAUSAL=bool(causal), num_warps=4, maxnreg=cfg.maxnreg,
    )
    return dk, dv
# fmt: on
