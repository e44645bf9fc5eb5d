"""IKBO linear compression, variant warp_specialized: the fused candidate GEMM as a warp-specialized persistent
Gluon kernel for Hopper.

Math (as in kernels/linear_compress.py): out[b] = W_u @ user_emb[m[b]] + W_c @ cand_emb[b] + bias[:, None],
user_emb [U, Ku, D], cand_emb [B, Kc, D], W_c [N, Kc], bias [N] → out [B, N, D]. Two launches (`launch_ws`): the
user GEMM Y_u = W_u @ user_emb [U, N, D] as one cuBLAS batched GEMM (`user_gemm`), then `_lce_ws_kernel`, the
candidate GEMM with Y_u[m[b]] + bias fused into its epilogue.

Why: at the canonical shape each [128, 256] output tile has only 8 K steps of 64 (Kc = 500), so the per-tile fixed
costs (the first loads' latency, the epilogue: Y_u tile + bias, 64 KB out) weigh as much as the MMAs. This kernel
keeps the tile shape (128 × 256, 85 FLOP per operand byte) and takes the fixed costs off the MMA path.

Kernel `_lce_ws_kernel`, one persistent program per SM, tiles t = pid, pid + P, … in (b, n, d) order (the N tiles
of one candidate are adjacent, so cand_emb[b] comes from HBM once per wave):
    producer partition, 1 warp: for every tile, K_TILES TMA loads of a W_c tile [BLOCK_M, BLOCK_K] and a cand_emb
        tile [1, BLOCK_K, BLOCK_D] (rank-3 descriptor: rows past Kc of candidate b are zero-filled) into a
        STAGES-deep mbarrier ring (ready/empty barrier per slot); in the middle of each tile's loads, one TMA load of
        the first column half of the tile's Y_u[m[b]] block, [1, BLOCK_M, BLOCK_D / 2], into the half-size epilogue
        buffer; after the K loads, one more ring step: the second half into a cand_emb slot (a half block is
        exactly one [1, BLOCK_K, BLOCK_D] slot at BLOCK_M = 2 · BLOCK_K). The producer waits on the consumer's
        epilogue only for those buffers, so the next tile's operands stream in while the consumer finishes.
    consumer (default partition), num_warps warps (two warpgroups of 64 rows at 8 warps): async wgmma, one group in
        flight, releasing each slot as the next wgmma is issued; then the epilogue in two column halves (split in
        registers, no data moved): acc + Y_u half (read from shared memory) + bias, cast, written back over the
        same buffer (the epilogue buffer, the ring slot) and stored by TMA, so the epilogue costs shared-memory
        time and no LSU-queue time. The stores drain during the next tile's first K steps; then the buffer and the
        slot go back to the producer. Half the epilogue buffer in the ring gives the ring a 4th stage.
Cooperative, not pingpong: on Hopper the accumulator lives in registers, and one warpgroup holding a whole
128 × 256 fp32 tile needs more than 255 registers per thread, so pingpong would shrink each warpgroup's tile
(51 or 64 FLOP per operand byte instead of 85); double-buffered accumulators do not fit either.
Shared memory at 128 × 256 × 64, bf16: 4 stages × 48 KiB + the 32 KiB half epilogue buffer = 224 KiB.
Limits (`ws_supported`): CUDA capability 9.x, fp16/bf16, cand_emb and out TMA-able (D·2 bytes a multiple of 16),
Kc ≥ 1; elsewhere the op takes `fused`. Design and measurements: docs/design/lce.md.
Sources: Triton's Gluon tutorials `python/tutorials/gluon/08-warp-specialization.py` (partitions, ready/empty rings,
TMA-store epilogue), `07-persistence.py` and `05-wgmma.py` (async wgmma on Hopper); CUTLASS's
"KernelTmaWarpSpecializedCooperative" schedule for the partition roles.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from . import _hopper
from ._common import tma_ok
from ._hopper import GLUON_TYPES, SMEM_LIMIT, smem_layout
from ._launch import NOW, CachedLaunch, Recording, call, fail, launch, named
from .linear_compress import PackedWeights

MAX_STAGES = 6


@dataclass(frozen=True)
class WSConfig:
    """Tile shape, ring depth and partition sizes of `_lce_ws_kernel`."""

    block_m: int = 128  # W_c rows per tile (64 per consumer warpgroup at 8 warps)
    block_d: int = 256  # output columns per tile
    block_k: int = 64  # K step
    stages: int = 3  # operand ring depth (0: the deepest that fits, see `ws_config`)
    num_warps: int = 8  # consumer (default partition) warps
    producer_regs: int = 40  # registers per thread of the 1-warp producer partition
    maxnreg: int = 168  # kernel register cap: 12 warps × 32 × 168 ≤ 64 K registers (setmaxnreg moves them)
    epi_free_at: int = 1  # the consumer's K step at which the last tile's TMA stores are waited for

    def smem_bytes(self, elem: int) -> int:
        """stages × (W_c + cand_emb tile) + the [BLOCK_M, BLOCK_D / 2] epilogue buffer + 2 · stages + 2 mbarriers."""
        ring = self.stages * (self.block_m + self.block_d) * self.block_k * elem
        return ring + self.block_m * self.block_d // 2 * elem + 8 * (2 * self.stages + 2)


# What `launch_ws` runs without a config (stages 0: the deepest ring that fits; 4 at 128 × 256 × 64, bf16).
DEFAULT_CONFIG = WSConfig(stages=0)


@gluon.constexpr_function
def _mma_layout(block_d, num_warps):
    """wgmma accumulator layout: warps stacked along M (16 rows each), one instruction spans BLOCK_D."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, block_d, 16])


@gluon.jit
def _tile_coords(tile, num_m_tiles, tiles_per_row, BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr):
    """Global tile id in (b, n, d) order → (candidate b, row offset, column offset); the N tiles of one
    candidate are adjacent."""
    b = tile // tiles_per_row
    rest = tile % tiles_per_row
    return b, (rest % num_m_tiles) * BLOCK_M, (rest // num_m_tiles) * BLOCK_D


# fmt: off
@gluon.jit
def _producer(
    w_desc, x_desc, y_desc, m_ptr, w_bufs, x_bufs, epi_buf, ready, empty, epi_ready, epi_free, num_tiles, num_m_tiles,
    tiles_per_row, K_TILES: gl.constexpr, STAGES: gl.constexpr, HAS_USER: gl.constexpr, Y_AT: gl.constexpr,
):
    """1 warp: TMA loads of every tile's operands into the ring; of its Y_u block's first column half into the
    epilogue buffer; and of the second half as one more ring step after the tile's K steps, into a cand_emb
    slot (without a user part that step loads nothing and only hands the slot to the consumer)."""
    BLOCK_M: gl.constexpr = w_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
    BLOCK_D: gl.constexpr = x_desc.block_type.shape[2]
    step = 0
    i = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        b, off_m, off_d = _tile_coords(tile, num_m_tiles, tiles_per_row, BLOCK_M, BLOCK_D)
        if HAS_USER:
            user = gl.load(m_ptr + b).to(gl.int32)
        for kt in gl.static_range(K_TILES):
            slot = step % STAGES
            # Slots start free: the first pass waits on the phase before the barrier's first (phase 1).
            mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, w_desc.block_type.nbytes + x_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(w_desc, [off_m, kt * BLOCK_K], bar, w_bufs.index(slot))
            tma.async_copy_global_to_shared(x_desc, [b, kt * BLOCK_K, off_d], bar, x_bufs.index(slot))
            step += 1
            if HAS_USER:
                if kt == Y_AT:  # the consumer has released the buffer by its step EPI_FREE_AT ≤ Y_AT - STAGES
                    mbarrier.wait(epi_free, i & 1)
                    mbarrier.expect(epi_ready, y_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(y_desc, [user, off_m, off_d], epi_ready, epi_buf)
        HALF: gl.constexpr = y_desc.block_type.shape[2]
        slot = step % STAGES
        mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)
        bar = ready.index(slot)
        if HAS_USER:
            mbarrier.expect(bar, y_desc.block_type.nbytes)
            half_buf = x_bufs.index(slot)._reinterpret(y_desc.dtype, y_desc.block_type.shape, y_desc.layout)
            tma.async_copy_global_to_shared(y_desc, [user, off_m, off_d + HALF], bar, half_buf)
        else:
            mbarrier.arrive(bar, count=1)
        step += 1
        i += 1
# fmt: on


@gluon.jit
def _epilogue_half(part, epi_buf, epi_ready, out_desc, b, off_m, off_d, i, HAS_USER: gl.constexpr):
    """Column half 0 of the tile: cast(part (+ the Y_u half that the producer put in epi_buf)), written over
    epi_buf and stored by TMA to out[b, off_m:, off_d:] (waited for by the consumer at EPI_FREE_AT)."""
    BLOCK_M: gl.constexpr = epi_buf.type.shape[1]
    HALF: gl.constexpr = epi_buf.type.shape[2]
    epi_tile = epi_buf.reshape([BLOCK_M, HALF])
    result = part
    if HAS_USER:
        mbarrier.wait(epi_ready, i & 1)
        result = result + epi_tile.load(part.type.layout).to(gl.float32)
    epi_tile.store(result.to(epi_buf.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(out_desc, [b, off_m, off_d], epi_buf)


@gluon.jit
def _ring_epilogue_half(
    part, x_bufs, ready, out_desc, b, off_m, off_d, step, STAGES: gl.constexpr, HAS_USER: gl.constexpr
):
    """Column half 1 of the tile: cast(part (+ the Y_u half the producer put in ring step `step`'s slot)),
    written over that slot and stored by TMA to out[b, off_m:, off_d + BLOCK_D / 2:]."""
    HALF: gl.constexpr = out_desc.block_type.shape[2]
    BLOCK_M: gl.constexpr = out_desc.block_type.shape[1]
    slot = step % STAGES
    mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
    buf = x_bufs.index(slot)._reinterpret(out_desc.dtype, out_desc.block_type.shape, out_desc.layout)
    tile = buf.reshape([BLOCK_M, HALF])
    if HAS_USER:
        part = part + tile.load(part.type.layout).to(gl.float32)
    tile.store(part.to(out_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(out_desc, [b, off_m, off_d + HALF], buf)


# fmt: off
@gluon.jit
def _epilogue(
    acc, bias, epi_buf, epi_ready, x_bufs, ready, out_desc, b, off_m, off_d, step, i, STAGES: gl.constexpr,
    HAS_USER: gl.constexpr, HAS_BIAS: gl.constexpr,
):
    """out[b] tile = cast(acc (+ bias) (+ Y_u[m[b]] block)) in two column halves: the first through the
    epilogue buffer, the second through ring step `step`'s slot; both released at the next tile's
    EPI_FREE_AT step. The halves lie in each thread's registers (wgmma layout): splitting moves no data."""
    BLOCK_M: gl.constexpr = acc.shape[0]
    HALF: gl.constexpr = acc.shape[1] // 2
    result = acc
    if HAS_BIAS:
        result = result + bias[:, None]
    lo, hi = gl.split(result.reshape([BLOCK_M, 2, HALF]).permute(0, 2, 1))  # columns [0, HALF), [HALF, 2 HALF)
    _epilogue_half(lo, epi_buf, epi_ready, out_desc, b, off_m, off_d, i, HAS_USER)
    _ring_epilogue_half(hi, x_bufs, ready, out_desc, b, off_m, off_d, step, STAGES, HAS_USER)
# fmt: on


# fmt: off
@gluon.jit
def _consumer(
    num_warps: gl.constexpr, w_bufs, x_bufs, epi_buf, ready, empty, epi_ready, epi_free, out_desc, bias_ptr, num_tiles,
    num_m_tiles, tiles_per_row, N, K_TILES: gl.constexpr, STAGES: gl.constexpr, HAS_USER: gl.constexpr,
    HAS_BIAS: gl.constexpr, EPI_FREE_AT: gl.constexpr,
):
    """num_warps warps: wgmma over the ring (one group in flight: the slot of step s is released at step
    s + 1, the last one after the tile's final wait), then acc + Y_u + bias → TMA stores (`_epilogue`,
    through the epilogue buffer and the tile's last ring step)."""
    BLOCK_M: gl.constexpr = w_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = w_bufs.type.shape[2]
    BLOCK_D: gl.constexpr = x_bufs.type.shape[3]
    mma_layout: gl.constexpr = _mma_layout(BLOCK_D, num_warps)
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    acc = gl.zeros((BLOCK_M, BLOCK_D), dtype=gl.float32, layout=mma_layout)
    bias = gl.zeros((BLOCK_M,), dtype=gl.float32, layout=row_layout)
    step = 0
    i = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        b, off_m, off_d = _tile_coords(tile, num_m_tiles, tiles_per_row, BLOCK_M, BLOCK_D)
        if HAS_BIAS:  # loaded before the K loop: its latency hides under the MMAs
            rows = off_m + gl.arange(0, BLOCK_M, layout=row_layout)
            bias = gl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(gl.float32)
        for kt in gl.static_range(K_TILES):
            slot = step % STAGES
            mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
            x_tile = x_bufs.index(slot).reshape([BLOCK_K, BLOCK_D])
            acc = warpgroup_mma(w_bufs.index(slot), x_tile, acc, use_acc=kt > 0, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            if kt >= 1:  # the wgmma of the previous step has finished reading its slot
                mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), count=1)
            if kt == EPI_FREE_AT:  # the last TMA stores have read the epilogue buffer: the producer may refill it
                tma.store_wait(0)
                mbarrier.arrive(epi_free, count=1)
                if i > 0:  # and the last tile's second half has read its slot (the ring step before kt = 0)
                    mbarrier.arrive(empty.index((step - kt + STAGES - 1) % STAGES), count=1)
            step += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), count=1)  # the tile's last slot
        _epilogue(
            acc, bias, epi_buf, epi_ready, x_bufs, ready, out_desc, b, off_m, off_d, step, i, STAGES, HAS_USER, HAS_BIAS
        )
        step += 1
        i += 1
    tma.store_wait(0)
# fmt: on


# fmt: off
@gluon.jit(do_not_specialize=["B"])  # one binary for any batch size (no compilation on a request's B)
def _lce_ws_kernel(
    w_desc,  # W_c padded [N, Kc'], blocks [BLOCK_M, BLOCK_K]
    x_desc,  # cand_emb [B, Kc, D], blocks [1, BLOCK_K, BLOCK_D]
    y_desc,  # Y_u [U, N, D], blocks [1, BLOCK_M, BLOCK_D / 2] (any descriptor of that block when not HAS_USER)
    out_desc,  # out [B, N, D], blocks [1, BLOCK_M, BLOCK_D / 2]
    m_ptr,
    bias_ptr,  # cand_to_user [B], bias [N]
    B, N, D, K_TILES: gl.constexpr, STAGES: gl.constexpr, HAS_USER: gl.constexpr, HAS_BIAS: gl.constexpr,
    EPI_FREE_AT: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr,
):
    """out[b] tile = W_c tile row @ cand_emb[b] + Y_u[m[b]] + bias, persistent, warp-specialized:
    tiles t = pid, pid + P, … of the (b, n, d) order; a consumer partition of num_warps warps, a 1-warp producer."""
    BLOCK_M: gl.constexpr = w_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
    BLOCK_D: gl.constexpr = x_desc.block_type.shape[2]
    gl.static_assert(STAGES >= 2, "the ring needs at least two slots")
    dtype: gl.constexpr = w_desc.dtype
    # A [1, BLOCK_M, BLOCK_D / 2] half block takes exactly one [1, BLOCK_K, BLOCK_D] cand_emb slot. The
    # second half's slot is released at the next tile's step FREE_AT, before the consumer waits on that
    # slot's next use (STAGES ring steps later) and with every slot the producer needs first released.
    gl.static_assert(BLOCK_M == 2 * BLOCK_K, "block_m = 2 · block_k: a Y_u half fills one cand_emb slot")
    gl.static_assert(out_desc.block_type.shape[2] * 2 == BLOCK_D, "out and Y_u blocks of BLOCK_D / 2 columns")
    FREE_AT: gl.constexpr = min(max(EPI_FREE_AT, 0), K_TILES - 1, STAGES - 2)
    # The producer refills the epilogue buffer after it has waited for the slot of step Y_AT, i.e.
    # after the consumer passed step Y_AT - STAGES ≥ EPI_FREE_AT (no wait on a consumer that waits on it).
    Y_AT: gl.constexpr = min(FREE_AT + STAGES, K_TILES - 1)

    num_m_tiles = gl.cdiv(N, BLOCK_M)
    tiles_per_row = num_m_tiles * gl.cdiv(D, BLOCK_D)
    num_tiles = B * tiles_per_row

    w_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    x_bufs = gl.allocate_shared_memory(dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    epi_buf = gl.allocate_shared_memory(dtype, out_desc.block_type.shape, out_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    epi_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    epi_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    mbarrier.init(epi_ready, count=1)
    mbarrier.init(epi_free, count=1)

    gl.warp_specialize(
        [
            (
                _consumer,
                (
                    num_warps, w_bufs, x_bufs, epi_buf, ready, empty, epi_ready, epi_free, out_desc, bias_ptr,
                    num_tiles, num_m_tiles, tiles_per_row, N, K_TILES, STAGES, HAS_USER, HAS_BIAS, FREE_AT,
                ),
            ),
            (
                _producer,
                (
                    w_desc, x_desc, y_desc, m_ptr, w_bufs, x_bufs, epi_buf, ready, empty, epi_ready, epi_free,
                    num_tiles, num_m_tiles, tiles_per_row, K_TILES, STAGES, HAS_USER, Y_AT,
                ),
            ),
        ],
        [1],
        [PRODUCER_REGS],
    )
# fmt: on


_lce_ws_launch = CachedLaunch(_lce_ws_kernel)


# ----------------------------------------------------------------------------- host side


@functools.cache
def ws_config(dim: int, elem: int, base: WSConfig | None = None) -> WSConfig:
    """`base` with BLOCK_D fitted to D and, where base.stages is 0, the deepest ring (≤ MAX_STAGES)
    that fits one SM's shared memory; a fixed base.stages is kept (the launch fails if it does not fit)."""
    base = base or DEFAULT_CONFIG
    if base.block_m != 2 * base.block_k:
        raise ValueError(
            f"WSConfig: block_m ({base.block_m}) must be 2 · block_k ({base.block_k}): the epilogue's "
            "second half block [block_m, block_d / 2] fills one [block_k, block_d] cand_emb slot"
        )
    block_d = max(16, min(base.block_d, triton.next_power_of_2(dim)))
    cfg = replace(base, block_d=block_d, stages=max(base.stages, 2))
    if base.stages == 0:
        while cfg.stages < MAX_STAGES and replace(cfg, stages=cfg.stages + 1).smem_bytes(elem) <= SMEM_LIMIT:
            cfg = replace(cfg, stages=cfg.stages + 1)
    return cfg


def ws_supported(user_emb: torch.Tensor, cand_emb: torch.Tensor) -> bool:
    """Whether `launch_ws` runs these (checked) inputs, else the op takes `fused`: a Hopper GPU, fp16/bf16, Kc ≥ 1,
    cand_emb TMA-able (non-empty, unit last stride, 16-byte aligned base and strides) and D·elem a multiple of
    16 bytes (the output and Y_u rows, written/read by TMA)."""
    if not cand_emb.is_cuda or cand_emb.dtype not in GLUON_TYPES or user_emb.dtype != cand_emb.dtype:
        return False
    if not _hopper.is_hopper(cand_emb.device):
        return False
    _, num_cand_tokens, dim = cand_emb.shape
    return num_cand_tokens >= 1 and dim * cand_emb.element_size() % 16 == 0 and tma_ok(cand_emb)


def _descriptor(t: torch.Tensor, block: list[int], bind=NOW) -> TensorDescriptor:
    return bind.desc(TensorDescriptor, t, list(t.shape), list(t.stride()), block, smem_layout(tuple(block), t.dtype))


def _descriptors(packed: PackedWeights, cand_emb, out, user_part, cfg: WSConfig, bind=NOW):
    """W_c (packed, padded; cached on the packed module for launches now), cand_emb, Y_u and out descriptors."""
    weight = packed.cand_weight_padded
    key = ("ws-desc", weight.data_ptr(), cfg.block_m, cfg.block_k)
    w_desc = packed._flags.get(key) if bind is NOW else None
    if w_desc is None:
        w_desc = _descriptor(weight, [cfg.block_m, cfg.block_k], bind)
        if bind is NOW:
            packed._flags[key] = w_desc
    x_desc = _descriptor(cand_emb, [1, cfg.block_k, cfg.block_d], bind)
    out_block = [1, cfg.block_m, cfg.block_d // 2]
    out_desc = _descriptor(out, out_block, bind)
    y_desc = out_desc if user_part is None else _descriptor(user_part, out_block, bind)
    return w_desc, x_desc, y_desc, out_desc


# fmt: off
def _launch_kernel(
    packed: PackedWeights, cand_emb, out, user_part, cand_to_user, bias, cfg: WSConfig,
    num_programs: int | None = None, recording=None,
):
    """out[b] = W_c @ cand_emb[b] (+ user_part[cand_to_user[b]] when user_part is given) (+ bias)."""
    num_candidates, num_cand_tokens, dim = cand_emb.shape
    rows = out.shape[1]
    num_tiles = num_candidates * triton.cdiv(rows, cfg.block_m) * triton.cdiv(dim, cfg.block_d)
    grid = min(num_programs or _hopper.device_info(out.device)[1], num_tiles)

    def build(bind):
        descriptors = _descriptors(packed, cand_emb, out, user_part, cfg, bind)
        return (*descriptors, bind.ptr(cand_to_user), bind.ptr(out if bias is None else bias), num_candidates, rows, dim)

    launch(
        _lce_ws_launch, (grid,), build, recording,
        K_TILES=triton.cdiv(num_cand_tokens, cfg.block_k),
        STAGES=cfg.stages, HAS_USER=user_part is not None, HAS_BIAS=bias is not None, EPI_FREE_AT=cfg.epi_free_at,
        PRODUCER_REGS=cfg.producer_regs, num_warps=cfg.num_warps, maxnreg=cfg.maxnreg,
    )
# fmt: on


# fmt: off
def launch_ws(
    packed: PackedWeights, user_emb, cand_emb, cand_to_user, out=None, user_part=None,
    config: WSConfig | None = None,
    num_programs: int | None = None,
    recording: Recording | None = None,
) -> torch.Tensor:
    """out [B, N, D] = packed(user_emb, cand_emb, cand_to_user) through this kernel, for inputs that passed
    PackedLinearCompress's checks and `ws_supported`; `packed` a PackedWeights (or a PackedLinearCompress, which
    exposes the same attributes). Two launches: the user GEMM (`user_gemm`, Y_u [U, N, D];
    skipped at Ku = 0) and `_lce_ws_kernel`. `config` overrides the tile config (benchmarks; stages 0 picks the
    deepest ring); `out` and `user_part` may be given pre-filled (tests poison them with NaN); `num_programs`
    overrides the persistent grid (tests); with `recording` the steps are kept for replay (kernels._launch)."""
    cfg = ws_config(user_emb.shape[2], cand_emb.element_size(), config)
    num_users, num_user_tokens, dim = user_emb.shape
    num_candidates = cand_emb.shape[0]
    rows = packed.cand_weight.shape[0]
    if out is None:
        out = named(recording, "out", torch.empty(num_candidates, rows, dim, dtype=cand_emb.dtype, device=cand_emb.device))
    if out.numel() == 0:
        fail(recording)
        return out
    if num_user_tokens > 0:
        if user_part is None:
            user_part = torch.empty(num_users, rows, dim, dtype=out.dtype, device=out.device)  # Y_u
            named(recording, "user_part", user_part)
        user_gemm(packed, user_emb, user_part, recording)
    else:
        user_part = None
    _launch_kernel(packed, cand_emb, out, user_part, cand_to_user, packed.bias, cfg, num_programs, recording)
    return out
# fmt: on


def user_gemm(packed: PackedWeights, user_emb, user_part, recording: Recording | None = None) -> None:
    """user_part [U, N, D] = W_u @ user_emb[u] for every user: one cuBLAS batched GEMM (W_u broadcast over the U
    users as a stride-0 view; nothing is copied), one Triton launch less on the host than a tile kernel."""
    call(recording, torch.matmul, packed.user_weight, user_emb, out=user_part)
