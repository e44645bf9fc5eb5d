"""IKBO linear compression, variant s6: the fused candidate GEMM as a warp-specialized persistent Gluon kernel.

Math (as in `kernels/linear_compress.py`): out[b] = W_u @ user_emb[m[b]] + W_c @ cand_emb[b] + bias[:, None],
user_emb [U, Ku, D], cand_emb [B, Kc, D], W_c [N, Kc], bias [N] → out [B, N, D].

Status (H200, 2026-11-29, docs/notes/lce.md): correct (fp64 tests, NaN-poisoned outputs, CUDA-graph
capture); 0.283 ms at the canonical shape against s4's 0.359 ms (−21 %), the fastest variant at
every measured B ≥ 256 and, in CUDA-graph device time, at B = 64; eager at B = 64 slower than s3/s4
(host time of two launches). The 0.25 ms target is still missed: the K loop's steady state runs at
96 % of the matmul ceiling's step rate, but every tile pays ~2 µs of fixed cost, and ncu shows the
consumer waiting mostly for ring data (cand_emb from HBM, 3 slots = 2 steps of latency cover), not
for wgmma or barriers; the `WSConfig` knobs mma_depth, defer_epilogue / defer_user and
split_consumers were measured and are not faster (docs/notes/lce.md, 17:40 UTC); tile_order
"candidate" (one program runs all tiles of a candidate) measured 12–17 % slower (18:15 UTC); epi_chunk
(the output in 64-column chunks, Y_u read by the consumer, so a 4th ring stage fits: more bytes in
flight) is built and compiled; its one GPU run hung on a barrier count (fixed since), so it is not
yet measured or GPU-tested (docs/notes/lce.md, 19:40 UTC). Reached through
`PackedLinearCompress(..., variant="s6")`; the served model tries it as a tuning candidate of every
LCE bucket on Hopper in 16 bit (`ikbo_backend/shape_spec.py`), with `DEFAULT_CONFIG`.

Why: at the canonical shape each [128, 256] output tile has only 8 K steps of 64 (Kc = 500), so the
per-tile fixed costs — first loads' latency, the epilogue (Y_u tile + bias, 64 KB out) — weigh as
much as the MMAs. s2 (one tile per program, no overlap across tiles) spends ~9.2 µs per tile per SM
where its wgmmas need ~4.5 µs at the datasheet rate (docs/notes/lce.md). s6 keeps the tile shape
(128 × 256, 85 FLOP per operand byte) and takes the fixed costs off the MMA path:

Kernel `_lce_ws_kernel`, one persistent program per SM, tiles t = pid, pid + P, … in (b, n, d) order
(the N tiles of one candidate are adjacent, so cand_emb[b] comes from HBM once per wave):
    worker partition, 1 warp (the producer): for every tile, K_TILES TMA loads of a W_c tile
        [BLOCK_M, BLOCK_K] and a cand_emb tile [1, BLOCK_K, BLOCK_D] (rank-3 descriptor: rows past
        Kc of candidate b are zero-filled) into a STAGES-deep mbarrier ring (ready/empty barrier per
        slot); in the middle of each tile's loads, one TMA load of the tile's Y_u[m[b]] block
        [1, BLOCK_M, BLOCK_D] into the epilogue buffer. The producer never waits on the consumer's
        epilogue except for that buffer, so the next tile's operands stream in while the consumer
        finishes the current one.
    default partition, num_warps warps (the consumer, two warpgroups of 64 rows at 8 warps):
        async wgmma, one group in flight, releasing each slot as the next wgmma is issued; then the
        epilogue: acc + Y_u tile (read from shared memory) + bias, cast, written back into the same
        shared buffer and stored by TMA (`UTMASTG`), so the epilogue costs shared-memory time
        (~0.5 µs per tile) and no LSU-queue time (the pointer epilogue of s5, a removed variant: docs/notes/lce.md). The
        store drains during the next tile's first K step; then the buffer is handed back to the
        producer for the next Y_u block.
Why cooperative and not pingpong (CUTLASS's two consumer warpgroups alternating tiles): on Hopper the
accumulator lives in registers; one warpgroup holding a whole 128 × 256 fp32 tile needs 256
registers per thread (more than the 255 limit), so pingpong shrinks each warpgroup's tile to
64 × 256 or 128 × 128 (51 or 64 FLOP per operand byte instead of 85) and needs two epilogue buffers.
Double-buffered accumulators (the Blackwell recipe) do not fit in registers either. The cooperative
kernel overlaps loads with the epilogue, and the epilogue itself is made short instead of hidden.
Measured since: pingpong at 128 × 128 per warpgroup (this file's producer and epilogue) was built as s7,
hid the epilogue, ran no faster than s6 (kernel alone 0.2466 vs 0.2479 ms; so the epilogue is not what
limits s6) and was removed; its code is in git (docs/notes/lce.md).

Shared memory at 128 × 256 × 64, bf16: 3 stages × 48 KiB + 64 KiB epilogue buffer = 208 KiB; with
epi_chunk = 64, 4 stages × 48 KiB + 2 × 16 KiB chunk buffers = 224 KiB.
The user GEMM Y_u = W_u @ user_emb [U, N, D] runs first through s3's tile kernel (one launch more,
as the removed s5 did). Limits (`s6_supported`): CUDA capability 9.x, fp16/bf16, cand_emb and out TMA-able
(D·2 bytes a multiple of 16), Kc ≥ 1. Elsewhere callers take s3/s4.
Sources: Triton's Gluon tutorials `python/tutorials/gluon/08-warp-specialization.py` (partitions,
ready/empty rings, TMA-store epilogue), `07-persistence.py` and `05-wgmma.py` (async wgmma on Hopper);
CUTLASS's "KernelTmaWarpSpecializedCooperative" schedule for the partition roles.
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

from ._common import compile_gluon_without_gpu
from .linear_compress import PackedLinearCompress, TileConfig

SMEM_LIMIT = 232448  # bytes of shared memory one block may take on sm_90 (227 KiB)
GLUON_TYPES = (torch.float16, torch.bfloat16)
# User GEMM (Y_u, launched before s6): s3's tile kernel at [128, 128] tiles, so that U · N/128 · D/128
# programs (120 at the canonical shape) spread over the SMs; the user GEMM is 4 of the 138 GFLOP.
USER_GEMM_CONFIG = TileConfig(128, 128, 64, num_warps=4, num_stages=4)
MAX_STAGES = 6


@dataclass(frozen=True)
class WSConfig:
    """Tile shape, ring depth and partition sizes of the s6 kernel."""

    block_m: int = 128  # W_c rows per tile (64 per consumer warpgroup at 8 warps)
    block_d: int = 256  # output columns per tile
    block_k: int = 64  # K step
    stages: int = 3  # operand ring depth (0: the deepest that fits, see `ws_config`)
    num_warps: int = 8  # consumer (default partition) warps
    producer_regs: int = 40  # registers per thread of the 1-warp producer partition
    maxnreg: int = 168  # kernel register cap: 12 warps × 32 × 168 ≤ 64 K registers (setmaxnreg moves them)
    epi_free_at: int = 2  # the consumer's K step at which the last tile's TMA store is waited for
    # wgmma groups left in flight at each K step (`warpgroup_mma_wait(mma_depth)`); a ring slot is
    # released mma_depth steps after its wgmma was issued, so mma_depth < stages.
    mma_depth: int = 1
    # Tile i's output (acc + bias + Y_u, already cast) is written to shared memory and stored by TMA in
    # tile i + 1, right after that tile's second wgmma group is issued: the stmatrix / fence / store
    # issue run under the tensor cores. The cast tile is held in registers meanwhile (64 per thread
    # at 128 × 256, 8 warps), beside the new accumulator.
    defer_epilogue: bool = False
    # With defer_epilogue: the Y_u block is added there too (read from shared memory under tile i + 1's
    # first two wgmma groups), to acc + bias already cast: out = cast(cast(acc + bias) + Y_u), one rounding
    # more than cast(acc + bias + Y_u).
    defer_user: bool = False
    # The consumer as two partitions of num_warps / 2 warps, one per 64-row half of the tile, each with
    # its own epilogue half: each partition syncs only its own warps before an mbarrier wait or arrive
    # (`bar.sync id, 128` instead of one barrier over all consumer warps), and the two halves drift
    # apart instead of running in lockstep. Ring slots and the epilogue buffer are released by both.
    split_consumers: bool = False
    # Which tiles a persistent program runs. "row": tiles t = pid, pid + P, … in (b, n, d) order, so
    # every tile a program runs is a new candidate (P = 132 is a multiple of N / BLOCK_M = 4), its
    # cand_emb[b] slices fetched from HBM (the other programs of the wave read them at the same
    # time). "candidate": program p runs candidates p, p + P, …, all N / BLOCK_M · D / BLOCK_D tiles of
    # one candidate back to back (rows first), so cand_emb[b] comes from HBM for the first of them
    # and from L2 for the rest; taken only where it does not lengthen the busiest program
    # (`candidate_major`), else "row".
    tile_order: str = "row"
    # 0: the whole tile's epilogue goes through one [BLOCK_M, BLOCK_D] buffer (64 KiB at 128 × 256), the
    # Y_u block brought in by the producer's TMA. c > 0: the output goes out in c-column chunks through
    # two [BLOCK_M, c] buffers (32 KiB at c = 64), which frees shared memory for a 4th ring stage at
    # 128 × 256 × 64; the Y_u block is then loaded by the consumer itself (16-byte loads in a blocked
    # layout, issued before the K loop, 64 registers a thread at 128 × 256) and goes through the chunk
    # buffer into the accumulator layout. Not with defer_epilogue or split_consumers.
    epi_chunk: int = 0

    @property
    def chunk(self) -> int:
        """Columns of one epilogue buffer: BLOCK_D, or epi_chunk where it is smaller."""
        return min(self.epi_chunk, self.block_d) if self.epi_chunk else self.block_d

    @property
    def partition_warps(self) -> int:
        """Warps of each consumer partition (the kernel's num_warps)."""
        return self.num_warps // 2 if self.split_consumers else self.num_warps

    @property
    def consumer_regs(self) -> int:
        """Registers per thread of the second consumer partition (split only): what the first keeps after
        `setmaxnreg`, so that both consumer warpgroups and the producer's padded warpgroup share the file."""
        return (self.maxnreg * 3 - self.producer_regs) // 2 // 8 * 8

    def smem_bytes(self, elem: int) -> int:
        ring = self.stages * (self.block_m + self.block_d) * self.block_k * elem
        epilogue = (2 if self.epi_chunk else 1) * self.block_m * self.chunk * elem
        return ring + epilogue + 8 * (2 * self.stages + 2)


# What `lce_s6` runs without a config (stages 0: the deepest ring that fits; 3 at 128 × 256 × 64, bf16).
DEFAULT_CONFIG = WSConfig(stages=0)


@gluon.constexpr_function
def _mma_layout(block_d, num_warps):
    """wgmma accumulator layout: warps stacked along M (16 rows each), one instruction spans BLOCK_D."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, block_d, 16])


@gluon.jit
def _tile_range(num_tiles, tiles_per_row, CAND_MAJOR: gl.constexpr):
    """(start, stop, step) of this program's tile loop: global tile ids (row order) or, CAND_MAJOR,
    the program's own tile count (its candidates pid, pid + P, … times tiles_per_row)."""
    pid = gl.program_id(0)
    num_programs = gl.num_programs(0)
    if CAND_MAJOR:
        start = 0
        stop = gl.cdiv(num_tiles // tiles_per_row - pid, num_programs) * tiles_per_row
        step = 1
    else:
        start = pid
        stop = num_tiles
        step = num_programs
    return start, stop, step


@gluon.jit
def _tile_coords(tile, num_m_tiles, tiles_per_row, BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr, CAND_MAJOR: gl.constexpr):
    """tile (a value of `_tile_range`'s loop) → (candidate b, row offset, column offset); the N tiles of
    one candidate are adjacent (row order) or run back to back by one program (CAND_MAJOR)."""
    if CAND_MAJOR:
        b = gl.program_id(0) + (tile // tiles_per_row) * gl.num_programs(0)
    else:
        b = tile // tiles_per_row
    rest = tile % tiles_per_row
    return b, (rest % num_m_tiles) * BLOCK_M, (rest // num_m_tiles) * BLOCK_D


@gluon.jit
def _producer(w_desc, x_desc, y_desc, m_ptr, w_bufs, x_bufs, epi_bufs, ready, empty, epi_ready, epi_free,
              num_tiles, num_m_tiles, tiles_per_row,
              K_TILES: gl.constexpr, STAGES: gl.constexpr, HAS_USER: gl.constexpr, Y_AT: gl.constexpr,
              CAND_MAJOR: gl.constexpr):
    """1 warp: TMA loads of every tile's operands into the ring, and of its Y_u block into the epilogue
    buffer (one load per consumer partition's rows)."""
    BLOCK_M: gl.constexpr = w_desc.block_type.shape[0]
    PARTS: gl.constexpr = epi_bufs.type.shape[0]
    PART_M: gl.constexpr = y_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
    BLOCK_D: gl.constexpr = x_desc.block_type.shape[2]
    start, stop, stride = _tile_range(num_tiles, tiles_per_row, CAND_MAJOR)
    step = 0
    i = 0
    for tile in range(start, stop, stride):
        b, off_m, off_d = _tile_coords(tile, num_m_tiles, tiles_per_row, BLOCK_M, BLOCK_D, CAND_MAJOR)
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
                    mbarrier.expect(epi_ready, PARTS * y_desc.block_type.nbytes)
                    for h in gl.static_range(PARTS):
                        tma.async_copy_global_to_shared(y_desc, [user, off_m + h * PART_M, off_d], epi_ready, epi_bufs.index(h))
        i += 1


@gluon.jit
def _epilogue_values(acc, bias, epi_buf, epi_ready, i, HAS_USER: gl.constexpr, HAS_BIAS: gl.constexpr):
    """acc (+ bias) (+ the Y_u block that the producer put in epi_buf, where HAS_USER), cast to the output dtype."""
    BLOCK_M: gl.constexpr = epi_buf.type.shape[1]
    BLOCK_D: gl.constexpr = epi_buf.type.shape[2]
    result = acc
    if HAS_BIAS:
        result = result + bias[:, None]
    if HAS_USER:
        mbarrier.wait(epi_ready, i & 1)
        result = result + epi_buf.reshape([BLOCK_M, BLOCK_D]).load(acc.type.layout).to(gl.float32)
    return result.to(epi_buf.dtype)


@gluon.jit
def _epilogue_store(values, epi_buf, epi_ready, out_desc, b, off_m, off_d, i, ADD_USER: gl.constexpr):
    """out[b] tile = values (+ the Y_u block in epi_buf, where ADD_USER), through epi_buf and a TMA
    store (waited for by the consumer at EPI_FREE_AT)."""
    BLOCK_M: gl.constexpr = epi_buf.type.shape[1]
    BLOCK_D: gl.constexpr = epi_buf.type.shape[2]
    epi_tile = epi_buf.reshape([BLOCK_M, BLOCK_D])
    if ADD_USER:
        mbarrier.wait(epi_ready, i & 1)
        values = (values.to(gl.float32) + epi_tile.load(values.type.layout).to(gl.float32)).to(epi_buf.dtype)
    epi_tile.store(values)
    fence_async_shared()
    tma.async_copy_shared_to_global(out_desc, [b, off_m, off_d], epi_buf)


@gluon.jit
def _column_chunks(x, NUM: gl.constexpr):
    """x [M, NUM · C] → NUM tensors [M, C] (columns j·C … j·C + C − 1), NUM ∈ {1, 2, 4}. The chunk index
    lies in each thread's registers (wgmma layout; `_load_user_block`'s layout), so no data moves."""
    M: gl.constexpr = x.shape[0]
    C: gl.constexpr = x.shape[1] // NUM
    gl.static_assert(NUM == 1 or NUM == 2 or NUM == 4, "1, 2 or 4 column chunks")
    if NUM == 1:
        chunks = (x,)
    elif NUM == 2:
        lo, hi = gl.split(x.reshape([M, 2, C]).permute(0, 2, 1))
        chunks = (lo, hi)
    else:
        even, odd = gl.split(x.reshape([M, 2, 2, C]).permute(0, 3, 1, 2))  # chunks 0, 2 / 1, 3
        c0, c2 = gl.split(even)
        c1, c3 = gl.split(odd)
        chunks = (c0, c1, c2, c3)
    return chunks


@gluon.jit
def _load_user_block(y_ptr, user, off_m, off_d, N, D,
                     PART_M: gl.constexpr, BLOCK_D: gl.constexpr, CHUNK: gl.constexpr, num_warps: gl.constexpr):
    """Y_u[user, off_m : off_m + PART_M, off_d : off_d + BLOCK_D] (zero past N and D), Y_u [U, N, D]
    contiguous, by 16-byte loads: a warp reads 32 · 8 / CHUNK rows of CHUNK columns per load, and the
    BLOCK_D / CHUNK column chunks repeat in each thread's registers."""
    VEC: gl.constexpr = 8  # 16 bytes of fp16 / bf16
    COLS: gl.constexpr = CHUNK // VEC  # threads along a chunk's columns
    layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // COLS, COLS], [num_warps, 1], [1, 0])
    rows = off_m + gl.arange(0, PART_M, layout=gl.SliceLayout(1, layout))
    cols = off_d + gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, layout))
    base = y_ptr + user.to(gl.int64) * N * D
    mask = (rows < N)[:, None] & (cols < D)[None, :]
    return gl.load(base + rows[:, None] * D + cols[None, :], mask=mask, other=0.0)


@gluon.jit
def _epilogue_chunks(result, user_block, epi_bufs, out_desc, b, off_m, off_d, HAS_USER: gl.constexpr):
    """out[b] tile = cast(result + user_block) in column chunks: chunk j goes through buffer j % 2 (the
    user chunk stored in the blocked layout, read back in the accumulator's, the sum written over it,
    TMA-stored), once the store that last read that buffer (two stores back) is done."""
    BLOCK_M: gl.constexpr = epi_bufs.type.shape[2]
    CHUNK: gl.constexpr = epi_bufs.type.shape[3]
    NUM: gl.constexpr = result.shape[1] // CHUNK
    chunks = _column_chunks(result, NUM)
    if HAS_USER:
        users = _column_chunks(user_block, NUM)
    for j in gl.static_range(NUM):
        buf = epi_bufs.index(j % 2)
        tile = buf.reshape([BLOCK_M, CHUNK])
        tma.store_wait(1 if NUM > 1 else 0)  # the issuing thread's wait …
        gl.thread_barrier()  # … before any thread writes the buffer
        values = chunks[j]
        if HAS_USER:
            tile.store(users[j])
            values = values + tile.load(values.type.layout).to(gl.float32)
        tile.store(values.to(epi_bufs.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(out_desc, [b, off_m, off_d + j * CHUNK], buf)


@gluon.jit
def _consumer(epi_bufs, ROW0: gl.constexpr, num_warps: gl.constexpr,
              w_bufs, x_bufs, ready, empty, epi_ready, epi_free, out_desc, bias_ptr, m_ptr, y_ptr,
              num_tiles, num_m_tiles, tiles_per_row, N, D,
              K_TILES: gl.constexpr, STAGES: gl.constexpr, HAS_USER: gl.constexpr, HAS_BIAS: gl.constexpr,
              EPI_FREE_AT: gl.constexpr, MMA_DEPTH: gl.constexpr, DEFER: gl.constexpr, DEFER_USER: gl.constexpr,
              CAND_MAJOR: gl.constexpr, CHUNKED: gl.constexpr):
    """num_warps warps: wgmma over the ring, then acc + Y_u + bias → epilogue buffer → TMA store.

    MMA_DEPTH: wgmma groups left in flight after each K step; the slot of step s is released at
    step s + MMA_DEPTH (and the last ones after the tile's final wait).
    DEFER: tile i's cast output is stored in tile i + 1, right after that tile's second wgmma group is
    issued (first, with one K step), so the shared-memory writes and the store issue run under the
    tensor cores; DEFER_USER:
    the Y_u block is added there too (to the cast acc + bias).
    ROW0: the first of the tile's rows that this partition computes, stages and stores (epi_buf's rows;
    all BLOCK_M unless the consumer is split).
    CHUNKED: epi_bufs are two [BLOCK_M, CHUNK] column-chunk buffers (`WSConfig.epi_chunk`); Y_u[m[b]] is
    loaded by these warps before the K loop (`_load_user_block`) and added in `_epilogue_chunks`.
    """
    ADD_USER: gl.constexpr = HAS_USER and DEFER_USER
    BLOCK_M: gl.constexpr = w_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = w_bufs.type.shape[2]
    BLOCK_D: gl.constexpr = x_bufs.type.shape[3]
    PART_M: gl.constexpr = epi_bufs.type.shape[2]
    epi_buf = epi_bufs.index(0 if CHUNKED else ROW0 // PART_M)
    mma_layout: gl.constexpr = _mma_layout(BLOCK_D, num_warps)
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    start, stop, stride = _tile_range(num_tiles, tiles_per_row, CAND_MAJOR)
    acc = gl.zeros((PART_M, BLOCK_D), dtype=gl.float32, layout=mma_layout)
    bias = gl.zeros((PART_M,), dtype=gl.float32, layout=row_layout)
    if DEFER:  # the previous tile: its cast output and coordinates
        out_prev = acc.to(epi_buf.dtype)
        b_prev = 0
        m_prev = 0
        d_prev = 0
    step = 0
    i = 0
    for tile in range(start, stop, stride):
        b, off_m, off_d = _tile_coords(tile, num_m_tiles, tiles_per_row, BLOCK_M, BLOCK_D, CAND_MAJOR)
        off_m += ROW0
        if HAS_BIAS:  # loaded before the K loop: its latency hides under the MMAs
            rows = off_m + gl.arange(0, PART_M, layout=row_layout)
            bias = gl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(gl.float32)
        if CHUNKED and HAS_USER:  # issued here, used in the epilogue: the loads' latency hides under the MMAs
            user = gl.load(m_ptr + b)
            user_block = _load_user_block(y_ptr, user, off_m, off_d, N, D, PART_M, BLOCK_D,
                                          epi_bufs.type.shape[3], num_warps)
        else:
            user_block = bias  # not used
        for kt in gl.static_range(K_TILES):
            slot = step % STAGES
            mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
            x_tile = x_bufs.index(slot).reshape([BLOCK_K, BLOCK_D])
            w_tile = w_bufs.index(slot)
            if PART_M < BLOCK_M:
                w_tile = w_tile.slice(ROW0, PART_M, dim=0)
            acc = warpgroup_mma(w_tile, x_tile, acc, use_acc=kt > 0, is_async=True)
            if DEFER:
                if kt == min(1, K_TILES - 1):  # under two wgmma groups where the tile has two K steps
                    if i > 0:
                        _epilogue_store(out_prev, epi_buf, epi_ready, out_desc, b_prev, m_prev, d_prev, i - 1, ADD_USER)
            acc = warpgroup_mma_wait(num_outstanding=MMA_DEPTH, deps=(acc,))
            if kt >= MMA_DEPTH:  # the wgmma of step - MMA_DEPTH has finished reading its slot
                mbarrier.arrive(empty.index((step + STAGES - MMA_DEPTH) % STAGES), count=1)
            if kt == EPI_FREE_AT and not CHUNKED:  # the last TMA store has read the epilogue buffer: the producer may refill it
                tma.store_wait(0)
                mbarrier.arrive(epi_free, count=1)
            step += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        for j in gl.static_range(min(MMA_DEPTH, K_TILES)):  # the tile's last slots, oldest first
            mbarrier.arrive(empty.index((step + STAGES - min(MMA_DEPTH, K_TILES) + j) % STAGES), count=1)
        if CHUNKED:
            result = acc
            if HAS_BIAS:
                result = result + bias[:, None]
            _epilogue_chunks(result, user_block, epi_bufs, out_desc, b, off_m, off_d, HAS_USER)
            values = acc  # not used
        else:
            values = _epilogue_values(acc, bias, epi_buf, epi_ready, i, HAS_USER and not ADD_USER, HAS_BIAS)
        if DEFER:
            out_prev = values
            b_prev = b
            m_prev = off_m
            d_prev = off_d
        elif not CHUNKED:
            _epilogue_store(values, epi_buf, epi_ready, out_desc, b, off_m, off_d, i, False)
        i += 1
    if DEFER:
        if i > 0:
            _epilogue_store(out_prev, epi_buf, epi_ready, out_desc, b_prev, m_prev, d_prev, i - 1, ADD_USER)
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["B"])  # one binary for any batch size (no compilation on a request's B)
def _lce_ws_kernel(
    w_desc,  # W_c padded [N, Kc'], blocks [BLOCK_M, BLOCK_K]
    x_desc,  # cand_emb [B, Kc, D], blocks [1, BLOCK_K, BLOCK_D]
    y_desc,  # Y_u [U, N, D], blocks [1, BLOCK_M, BLOCK_D] (any descriptor of that block when not HAS_USER)
    out_desc,  # out [B, N, D], blocks [1, BLOCK_M, BLOCK_D]
    m_ptr, bias_ptr,  # cand_to_user [B], bias [N]
    B, N, D,
    y_ptr,  # Y_u [U, N, D] contiguous (CHUNKED: read by the consumer; any pointer when not HAS_USER)
    K_TILES: gl.constexpr, STAGES: gl.constexpr, HAS_USER: gl.constexpr, HAS_BIAS: gl.constexpr,
    EPI_FREE_AT: gl.constexpr, MMA_DEPTH: gl.constexpr, DEFER: gl.constexpr, DEFER_USER: gl.constexpr,
    SPLIT: gl.constexpr, CAND_MAJOR: gl.constexpr, CHUNKED: gl.constexpr,
    PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    num_warps: gl.constexpr,
):
    """s6: out[b] tile = W_c tile row @ cand_emb[b] + Y_u[m[b]] + bias, persistent, warp-specialized.
    SPLIT: two consumer partitions of num_warps warps, one per half of the tile's rows (y_desc and
    out_desc blocks of BLOCK_M / 2 rows); else one of num_warps warps.
    CAND_MAJOR: program p runs all tiles of candidates p, p + P, … back to back (`WSConfig.tile_order`).
    CHUNKED: the output in column chunks of out_desc's block [1, BLOCK_M, CHUNK] through two buffers, Y_u
    read by the consumer (`WSConfig.epi_chunk`)."""
    BLOCK_M: gl.constexpr = w_desc.block_type.shape[0]
    BLOCK_D: gl.constexpr = x_desc.block_type.shape[2]
    gl.static_assert(STAGES >= 2, "the ring needs at least two slots")
    gl.static_assert(MMA_DEPTH >= 1 and MMA_DEPTH < STAGES, "a slot is released MMA_DEPTH steps after its wgmma")
    gl.static_assert(DEFER or not DEFER_USER, "DEFER_USER needs DEFER")
    gl.static_assert(not (CHUNKED and (DEFER or SPLIT)), "CHUNKED: not with DEFER or SPLIT")
    dtype: gl.constexpr = w_desc.dtype
    # The producer refills the epilogue buffer after it has waited for the slot of step Y_AT, i.e.
    # after the consumer passed step Y_AT - STAGES ≥ EPI_FREE_AT (no wait on a consumer that waits on it).
    # DEFER: the last tile's store is issued at K step 1 (0 with one K step), so it is waited for no earlier.
    FREE_AT: gl.constexpr = min(max(EPI_FREE_AT, 1 if DEFER else 0), K_TILES - 1)
    Y_AT: gl.constexpr = min(FREE_AT + STAGES, K_TILES - 1)

    num_m_tiles = gl.cdiv(N, BLOCK_M)
    tiles_per_row = num_m_tiles * gl.cdiv(D, BLOCK_D)
    num_tiles = B * tiles_per_row

    w_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    x_bufs = gl.allocate_shared_memory(dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    PARTS: gl.constexpr = 2 if SPLIT or CHUNKED else 1  # epilogue buffers: row halves or column chunks
    PART_M: gl.constexpr = out_desc.block_type.shape[1]
    gl.static_assert(CHUNKED or PARTS * PART_M == BLOCK_M, "out_desc/y_desc blocks: BLOCK_M / PARTS rows")
    epi_bufs = gl.allocate_shared_memory(dtype, [PARTS] + out_desc.block_type.shape, out_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    epi_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    epi_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    CONSUMERS: gl.constexpr = 2 if SPLIT else 1  # consumer partitions: each arrives once to free a slot
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=CONSUMERS)
    mbarrier.init(epi_ready, count=1)
    mbarrier.init(epi_free, count=CONSUMERS)

    if SPLIT:
        gl.warp_specialize([
            (_consumer, (epi_bufs, 0, num_warps, w_bufs, x_bufs, ready, empty, epi_ready, epi_free, out_desc,
                         bias_ptr, m_ptr, y_ptr, num_tiles, num_m_tiles, tiles_per_row, N, D,
                         K_TILES, STAGES, HAS_USER, HAS_BIAS, FREE_AT, MMA_DEPTH, DEFER, DEFER_USER, CAND_MAJOR, CHUNKED)),
            (_consumer, (epi_bufs, PART_M, num_warps, w_bufs, x_bufs, ready, empty, epi_ready, epi_free, out_desc,
                         bias_ptr, m_ptr, y_ptr, num_tiles, num_m_tiles, tiles_per_row, N, D,
                         K_TILES, STAGES, HAS_USER, HAS_BIAS, FREE_AT, MMA_DEPTH, DEFER, DEFER_USER, CAND_MAJOR, CHUNKED)),
            (_producer, (w_desc, x_desc, y_desc, m_ptr, w_bufs, x_bufs, epi_bufs, ready, empty, epi_ready, epi_free,
                         num_tiles, num_m_tiles, tiles_per_row, K_TILES, STAGES, HAS_USER and not CHUNKED, Y_AT,
                         CAND_MAJOR)),
        ], [num_warps, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (epi_bufs, 0, num_warps, w_bufs, x_bufs, ready, empty, epi_ready, epi_free, out_desc,
                         bias_ptr, m_ptr, y_ptr, num_tiles, num_m_tiles, tiles_per_row, N, D,
                         K_TILES, STAGES, HAS_USER, HAS_BIAS, FREE_AT, MMA_DEPTH, DEFER, DEFER_USER, CAND_MAJOR, CHUNKED)),
            (_producer, (w_desc, x_desc, y_desc, m_ptr, w_bufs, x_bufs, epi_bufs, ready, empty, epi_ready, epi_free,
                         num_tiles, num_m_tiles, tiles_per_row, K_TILES, STAGES, HAS_USER and not CHUNKED, Y_AT,
                         CAND_MAJOR)),
        ], [1], [PRODUCER_REGS])


# ----------------------------------------------------------------------------- host side


@functools.lru_cache(maxsize=None)
def _device_info(device: torch.device):
    props = torch.cuda.get_device_properties(device)
    return (props.major, props.minor), props.multi_processor_count


@functools.lru_cache(maxsize=None)
def ws_config(dim: int, elem: int, base: WSConfig | None = None) -> WSConfig:
    """`base` with BLOCK_D fitted to D and, where base.stages is 0, the deepest ring (≤ MAX_STAGES)
    that fits one SM's shared memory; a fixed base.stages is kept (the launch fails if it does not fit)."""
    base = base or DEFAULT_CONFIG
    block_d = max(16, min(base.block_d, triton.next_power_of_2(dim)))
    cfg = replace(base, block_d=block_d, stages=max(base.stages, 2))
    if cfg.epi_chunk and (cfg.defer_epilogue or cfg.split_consumers or cfg.chunk < 16 or cfg.block_d // cfg.chunk > 4
                          or cfg.block_d % cfg.chunk):
        raise ValueError(f"epi_chunk: a power of two ≥ 16 giving 1, 2 or 4 chunks of BLOCK_D = {block_d}, "
                         f"without defer_epilogue or split_consumers; got {base}")
    if base.stages == 0:
        while cfg.stages < MAX_STAGES and replace(cfg, stages=cfg.stages + 1).smem_bytes(elem) <= SMEM_LIMIT:
            cfg = replace(cfg, stages=cfg.stages + 1)
    return cfg


def _tma_ok(t: torch.Tensor) -> bool:
    elem = t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s * elem % 16 == 0 for s in t.stride()[:-1])


def s6_supported(user_emb: torch.Tensor, cand_emb: torch.Tensor) -> bool:
    """Whether s6 runs these (checked) inputs, else take s3/s4: a Hopper GPU, fp16/bf16, Kc ≥ 1,
    cand_emb TMA-able (unit last stride, 16-byte aligned base and strides) and D·elem a multiple of
    16 bytes (the output and Y_u rows, written/read by TMA)."""
    if not cand_emb.is_cuda or cand_emb.dtype not in GLUON_TYPES or user_emb.dtype != cand_emb.dtype:
        return False
    if _device_info(cand_emb.device)[0][0] != 9:
        return False
    _, num_cand_tokens, dim = cand_emb.shape
    return num_cand_tokens >= 1 and dim * cand_emb.element_size() % 16 == 0 and _tma_ok(cand_emb)


def _gl_dtype(dtype: torch.dtype):
    return gl.bfloat16 if dtype == torch.bfloat16 else gl.float16


@functools.lru_cache(maxsize=None)
def _smem_layout(block: tuple[int, ...], dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for(list(block), _gl_dtype(dtype))


def _descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, _smem_layout(tuple(block), t.dtype))


def _descriptors(packed: PackedLinearCompress, cand_emb, out, user_part, cfg: WSConfig):
    """W_c (packed, padded; cached on the packed module), cand_emb, Y_u and out descriptors."""
    weight = packed.cand_weight_padded
    key = ("s6-desc", weight.data_ptr(), cfg.block_m, cfg.block_k)
    w_desc = packed._flags.get(key)
    if w_desc is None:
        w_desc = packed._flags[key] = _descriptor(weight, [cfg.block_m, cfg.block_k])
    x_desc = _descriptor(cand_emb, [1, cfg.block_k, cfg.block_d])
    part_m = cfg.block_m // 2 if cfg.split_consumers else cfg.block_m  # rows one consumer partition stores
    out_desc = _descriptor(out, [1, part_m, cfg.chunk])
    y_desc = out_desc if user_part is None or cfg.epi_chunk else _descriptor(user_part, [1, part_m, cfg.block_d])
    return w_desc, x_desc, y_desc, out_desc


def candidate_major(cfg: WSConfig, num_candidates: int, tiles_per_row: int, num_programs: int) -> bool:
    """Whether `cfg` runs in candidate order on num_programs programs: tile_order "candidate", and the
    busiest program gets no more tiles than in row order (the whole candidates, cdiv(B, P) · tiles_per_row,
    against cdiv(B · tiles_per_row, P); equal at the canonical shape: 8 · 4 = 32 = cdiv(4096, 132))."""
    if cfg.tile_order not in ("row", "candidate"):
        raise ValueError(f"tile_order: expected 'row' or 'candidate', got {cfg.tile_order!r}")
    busiest = triton.cdiv(num_candidates, num_programs) * tiles_per_row
    return cfg.tile_order == "candidate" and busiest <= triton.cdiv(num_candidates * tiles_per_row, num_programs)


def _launch_ws(packed: PackedLinearCompress, cand_emb, out, user_part, cand_to_user, bias, cfg: WSConfig,
               num_programs: int | None = None):
    """out[b] = W_c @ cand_emb[b] (+ user_part[cand_to_user[b]] when user_part is given) (+ bias)."""
    num_candidates, num_cand_tokens, dim = cand_emb.shape
    rows = out.shape[1]
    w_desc, x_desc, y_desc, out_desc = _descriptors(packed, cand_emb, out, user_part, cfg)
    tiles_per_row = triton.cdiv(rows, cfg.block_m) * triton.cdiv(dim, cfg.block_d)
    num_tiles = num_candidates * tiles_per_row
    programs = num_programs or _device_info(out.device)[1]
    cand_major = candidate_major(cfg, num_candidates, tiles_per_row, programs)
    grid = min(programs, num_candidates if cand_major else num_tiles)
    _lce_ws_kernel[(grid,)](
        w_desc, x_desc, y_desc, out_desc,
        cand_to_user, out if bias is None else bias,
        num_candidates, rows, dim, out if user_part is None else user_part,
        K_TILES=triton.cdiv(num_cand_tokens, cfg.block_k), STAGES=cfg.stages,
        HAS_USER=user_part is not None, HAS_BIAS=bias is not None,
        EPI_FREE_AT=cfg.epi_free_at, MMA_DEPTH=cfg.mma_depth, DEFER=cfg.defer_epilogue, DEFER_USER=cfg.defer_user,
        SPLIT=cfg.split_consumers, CAND_MAJOR=cand_major, CHUNKED=cfg.epi_chunk > 0,
        PRODUCER_REGS=cfg.producer_regs, CONSUMER_REGS=cfg.consumer_regs,
        num_warps=cfg.partition_warps, maxnreg=cfg.maxnreg,
    )


def lce_s6(packed: PackedLinearCompress, user_emb, cand_emb, cand_to_user, out=None, user_part=None,
           config: WSConfig | None = None) -> torch.Tensor:
    """out [B, N, D] = packed(user_emb, cand_emb, cand_to_user) through s6, for inputs that passed
    PackedLinearCompress's checks and `s6_supported`. Two launches: the user GEMM (s3's tile kernel,
    Y_u [U, N, D]) and `_lce_ws_kernel`. `config` overrides the tile config (benchmarks; stages 0
    picks the deepest ring); `out` and `user_part` may be given pre-filled (tests poison them with NaN)."""
    cfg = ws_config(user_emb.shape[2], cand_emb.element_size(), config)
    return run_fused(packed, user_emb, cand_emb, cand_to_user, out, user_part, cfg, _launch_ws)


def run_fused(packed: PackedLinearCompress, user_emb, cand_emb, cand_to_user, out, user_part, cfg, launch) -> torch.Tensor:
    """The two launches of s6: the user GEMM Y_u = W_u @ user_emb (s3's tile kernel, skipped
    at Ku = 0), then `launch(packed, cand_emb, out, Y_u or None, cand_to_user, bias, cfg)`, the
    candidate GEMM with Y_u[m[b]] + bias fused into its epilogue."""
    num_users, num_user_tokens, dim = user_emb.shape
    num_candidates = cand_emb.shape[0]
    rows = packed.cand_weight.shape[0]
    if out is None:
        out = torch.empty(num_candidates, rows, dim, dtype=cand_emb.dtype, device=cand_emb.device)
    if out.numel() == 0:
        return out
    if num_user_tokens > 0:
        if user_part is None:
            user_part = torch.empty(num_users, rows, dim, dtype=out.dtype, device=out.device)  # Y_u
        packed._launch_tile(packed.user_weight_padded, user_emb, user_part, None, False, True, USER_GEMM_CONFIG)
    else:
        user_part = None
    launch(packed, cand_emb, out, user_part, cand_to_user, packed.bias, cfg)
    return out


def compile_s6(dtype: torch.dtype = torch.bfloat16, num_candidates: int = 1024, rows: int = 512, dim: int = 256,
               num_cand_tokens: int = 500, config: WSConfig | None = None, has_user: bool = True,
               has_bias: bool = True, capability: int = 90):
    """Compile `_lce_ws_kernel` for a CUDA target without a GPU (CPU tensors stand in for the
    arguments; the JIT's own specialization rules give the signature). Returns the CompiledKernel:
    `.asm["ptx"]`, `.asm["cubin"]`, `.metadata.shared`; registers and spills from cuobjdump."""
    cfg = ws_config(dim, torch.finfo(dtype).bits // 8, config)
    constexprs = dict(
        K_TILES=triton.cdiv(num_cand_tokens, cfg.block_k), STAGES=cfg.stages, HAS_USER=has_user,
        HAS_BIAS=has_bias, EPI_FREE_AT=cfg.epi_free_at, MMA_DEPTH=cfg.mma_depth, DEFER=cfg.defer_epilogue,
        DEFER_USER=cfg.defer_user, SPLIT=cfg.split_consumers, CAND_MAJOR=cfg.tile_order == "candidate",
        CHUNKED=cfg.epi_chunk > 0, PRODUCER_REGS=cfg.producer_regs,
        CONSUMER_REGS=cfg.consumer_regs, num_warps=cfg.partition_warps,
    )
    return compile_cpu(_lce_ws_kernel, cfg, constexprs, dtype, num_candidates, rows, dim, num_cand_tokens, has_user, capability)


def compile_cpu(kernel, cfg, constexprs: dict, dtype: torch.dtype, num_candidates: int, rows: int, dim: int,
                num_cand_tokens: int, has_user: bool, capability: int):
    """Compile a Gluon kernel with s6's runtime arguments (w_desc, x_desc, y_desc, out_desc, m_ptr,
    bias_ptr, B, N, D) for a CUDA target without a GPU: CPU tensors stand in for the arguments, the
    JIT's own specialization rules give the signature. `constexprs` holds the rest (with num_warps)."""
    weight = torch.zeros(rows, triton.cdiv(num_cand_tokens, 8) * 8, dtype=dtype)
    packed = PackedLinearCompress(weight, weight, None, weight, weight)
    cand_emb = torch.zeros(2, num_cand_tokens, dim, dtype=dtype)
    out = torch.zeros(2, rows, dim, dtype=dtype)
    w_desc, x_desc, y_desc, out_desc = _descriptors(packed, cand_emb, out, out if has_user else None, cfg)
    runtime_args = dict(
        w_desc=w_desc, x_desc=x_desc, y_desc=y_desc, out_desc=out_desc,
        m_ptr=torch.zeros(16, dtype=torch.int32), bias_ptr=torch.zeros(16, dtype=dtype),
        B=num_candidates, N=rows, D=dim, y_ptr=out,
    )
    options = {"num_warps": constexprs["num_warps"], "maxnreg": cfg.maxnreg}
    return compile_gluon_without_gpu(kernel, runtime_args, constexprs, options, capability)
