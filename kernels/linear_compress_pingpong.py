"""IKBO linear compression, variant s7: s6's fused candidate GEMM with pingpong consumers (Gluon, Hopper).

Math (as in `kernels/linear_compress.py`): out[b] = W_u @ user_emb[m[b]] + W_c @ cand_emb[b] + bias[:, None],
user_emb [U, Ku, D], cand_emb [B, Kc, D], W_c [N, Kc], bias [N] → out [B, N, D].

Status (H200, 2026-11-29, docs/notes/lce.md): correct (fp64 tests, NaN-poisoned outputs, CUDA-graph
capture, bit-identical repeats) and no faster than s6: canonical 0.275 / 0.288 ms eager (s6 0.281 /
0.289), 0.290 / 0.293 ms in CUDA graphs (s6 0.290 / 0.290); the kernel alone 0.2466 ms against
s6's 0.2479 although s7 hides its epilogue; 4–11 % slower than s6 at B = 16384. Not dispatched
(`PackedLinearCompress` does not take "s7"); reached through `lce_s7` and `scripts/bench_lce.py`.

Why: s6 (`kernels/linear_compress_ws.py`) is cooperative: its two consumer warpgroups share one
[128, 256] tile, so between a tile's last wgmma and the next tile's first one the tensor cores wait
for the whole epilogue (Y_u block + bias added, 64 KB through shared memory, TMA store). With
Kc = 500 a tile has only 8 K steps of 64, so that wait is a large share of each tile (s6 kernel with
the fused epilogue 0.279 ms, 8.7 µs per 128 × 256 tile on the busiest SMs against ~5.7 µs of wgmma
at the measured matmul rate; docs/notes/lce.md).

s7 gives each consumer warpgroup its own output tile, as CUTLASS's Hopper "KernelTmaWarpSpecializedPingpong"
schedule and FlashAttention-3 do: while one warpgroup runs its epilogue, the other runs its main loop,
so the tensor cores stay busy through the epilogues. A warpgroup holds its whole accumulator in
registers; at 128 × 256 that is 256 fp32 registers per thread (over the limit), so the per-warpgroup
tile is 128 × 128 (128 registers, 64 FLOP per operand byte instead of 85; s6 at 128 × 128 measured
within 4 % of 128 × 256) or 64 × 256 (51 FLOP per byte).

Kernel `_lce_pingpong_kernel`, one persistent program per SM, tiles t = pid, pid + P, … in (b, n, d)
order (s6's `_tile_coords`); the program's j-th tile goes to consumer j % 2:
    worker partition, 1 warp (the producer, s6's `_producer` with two epilogue buffers): the operands
        of every tile in program order into one STAGES-deep ready/empty ring, and each tile's Y_u[m[b]]
        block into the epilogue buffer of the consumer that owns it (j % 2). Because the ring is
        filled in tile order, consumer 1's tile starts when consumer 0's is loaded: the two consumers
        run their main loops one after the other and each one's epilogue overlaps the other's main
        loop (the pingpong needs no ordering barrier between them).
    default partition (4 warps) and a 4-warp worker partition: the two consumers, one warpgroup each:
        async wgmma over their own tiles' ring slots (one group in flight, each slot released after the
        next step's wait), then s6's `_epilogue` into their own buffer (acc + bias + Y_u block, cast,
        `stmatrix`, TMA store), the store waited for at K step EPI_FREE_AT of their next tile.
Shared memory at 128 × 128 × 64, bf16: STAGES × 32 KiB ring + 2 × 32 KiB epilogue buffers; 5 stages
fit (224 KiB). The user GEMM Y_u = W_u @ user_emb [U, N, D] runs first through s3's tile kernel, as for s6
(`run_fused`). Limits as s6 (`s6_supported`): a Hopper GPU, fp16/bf16, TMA-able cand_emb and rows.
Sources: CUTLASS `include/cutlass/gemm/kernel/sm90_gemm_tma_warpspecialized_pingpong.hpp`; PyTorch's
"Deep dive on CUTLASS ping-pong GEMM kernel" (2024); FlashAttention-3 (Shah et al., 2024), §3.1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from .linear_compress import PackedLinearCompress
from .linear_compress_ws import (
    _descriptors,
    _device_info,
    _epilogue,
    _init_barriers,
    _mma_layout,
    _producer,
    _tile_coords,
    compile_cpu,
    run_fused,
    ws_config,
)

NUM_CONSUMERS = gl.constexpr(2)  # consumer warpgroups, each with its own tile and epilogue buffer


@dataclass(frozen=True)
class PingPongConfig:
    """Per-warpgroup tile shape, ring depth and register split of the s7 kernel (field names as
    s6's WSConfig, so `ws_config` fits it to D and to shared memory)."""

    block_m: int = 128  # W_c rows per consumer tile
    block_d: int = 128  # output columns per consumer tile
    block_k: int = 64  # K step
    stages: int = 0  # operand ring depth (0: the deepest that fits, ≤ MAX_STAGES)
    num_warps: int = 4  # warps per consumer (one warpgroup: wgmma needs 4)
    consumer_regs: int = 232  # registers per thread of the worker consumer (setmaxnreg)
    producer_regs: int = 40  # registers per thread of the 1-warp producer partition
    maxnreg: int = 168  # kernel register cap: 12 warps × 32 × 168 ≤ 64 K registers
    epi_free_at: int = 1  # the consumer's K step at which its last TMA store is waited for

    def smem_bytes(self, elem: int) -> int:
        ring = self.stages * (self.block_m + self.block_d) * self.block_k * elem
        epilogue = NUM_CONSUMERS * self.block_m * self.block_d * elem
        return ring + epilogue + 8 * (2 * self.stages + 3 * NUM_CONSUMERS)


def s7_config(dim: int, elem: int, base: PingPongConfig | None = None) -> PingPongConfig:
    """`base` (default PingPongConfig()) with BLOCK_D fitted to D and, at stages 0, the deepest ring that fits."""
    return ws_config(dim, elem, base or PingPongConfig())


@gluon.jit
def _pingpong_consumer(w_bufs, x_bufs, epi_bufs, ready, empty, epi_ready, epi_free, order, out_desc, bias_ptr,
                       num_tiles, num_m_tiles, tiles_per_row, N,
                       WG: gl.constexpr, K_TILES: gl.constexpr, STAGES: gl.constexpr, HAS_USER: gl.constexpr,
                       HAS_BIAS: gl.constexpr, EPI_FREE_AT: gl.constexpr, WG_WARPS: gl.constexpr):
    """One warpgroup: the program's tiles j ≡ WG (mod 2), each wgmma over its ring slots (global
    ring step j·K_TILES + kt), then acc + bias + Y_u → epilogue buffer WG → TMA store.

    Order barrier (CUTLASS's MathWarpGroupOrderBarrier): tile j's main loop starts only after the
    other consumer has waited for every ring slot of tile j − 1 (order[WG], arrived by the other
    consumer at its last K step). Without it, a consumer skipping the other's steps could wait on a
    slot whose previous use (step − STAGES, in tile j − 1 when STAGES ≤ K_TILES) has not landed
    yet: the barrier would then be two phases behind, and a parity wait passes on a phase that
    is two behind (stale data). It also keeps the two main loops one after the other (the pingpong).
    """
    BLOCK_M: gl.constexpr = w_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = w_bufs.type.shape[2]
    BLOCK_D: gl.constexpr = x_bufs.type.shape[3]
    mma_layout: gl.constexpr = _mma_layout(BLOCK_D, WG_WARPS)
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    pid = gl.program_id(0)
    num_programs = gl.num_programs(0)
    epi_buf = epi_bufs.index(WG)
    epi_ready_wg = epi_ready.index(WG)
    epi_free_wg = epi_free.index(WG)
    acc = gl.zeros((BLOCK_M, BLOCK_D), dtype=gl.float32, layout=mma_layout)
    bias = gl.zeros((BLOCK_M,), dtype=gl.float32, layout=row_layout)
    i = 0  # this consumer's tile count (its epilogue barriers' phase)
    for tile in range(pid + WG * num_programs, num_tiles, NUM_CONSUMERS * num_programs):
        b, off_m, off_d = _tile_coords(tile, num_m_tiles, tiles_per_row, BLOCK_M, BLOCK_D)
        if HAS_BIAS:  # loaded before the K loop: its latency hides under the MMAs
            rows = off_m + gl.arange(0, BLOCK_M, layout=row_layout)
            bias = gl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(gl.float32)
        tile_index = NUM_CONSUMERS * i + WG  # the program's tile count
        if tile_index > 0:  # the other consumer has waited for all of tile_index − 1's slots
            mbarrier.wait(order.index(WG), (i + WG - 1) & 1)
        first = tile_index * K_TILES  # ring step of this tile's first K step
        for kt in gl.static_range(K_TILES):
            step = first + kt
            slot = step % STAGES
            mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
            x_tile = x_bufs.index(slot).reshape([BLOCK_K, BLOCK_D])
            acc = warpgroup_mma(w_bufs.index(slot), x_tile, acc, use_acc=kt > 0, is_async=True)
            if kt == K_TILES - 1:  # all of this tile's slots have landed: the other consumer may start
                mbarrier.arrive(order.index(1 - WG), count=1)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            if kt > 0:  # the previous step's wgmma has finished reading its slot
                mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), count=1)
            if kt == EPI_FREE_AT:  # this consumer's last TMA store has read its buffer: the producer may refill it
                tma.store_wait(0)
                mbarrier.arrive(epi_free_wg, count=1)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((first + K_TILES - 1) % STAGES), count=1)
        _epilogue(acc, bias, epi_buf, epi_ready_wg, out_desc, b, off_m, off_d, i, HAS_USER, HAS_BIAS)
        i += 1
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["B"])  # one binary for any batch size
def _lce_pingpong_kernel(
    w_desc,  # W_c padded [N, Kc'], blocks [BLOCK_M, BLOCK_K]
    x_desc,  # cand_emb [B, Kc, D], blocks [1, BLOCK_K, BLOCK_D]
    y_desc,  # Y_u [U, N, D], blocks [1, BLOCK_M, BLOCK_D] (any descriptor of that block when not HAS_USER)
    out_desc,  # out [B, N, D], blocks [1, BLOCK_M, BLOCK_D]
    m_ptr, bias_ptr,  # cand_to_user [B], bias [N]
    B, N, D,
    K_TILES: gl.constexpr, STAGES: gl.constexpr, HAS_USER: gl.constexpr, HAS_BIAS: gl.constexpr,
    EPI_FREE_AT: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr,
):
    """s7: out[b] tile = W_c tile row @ cand_emb[b] + Y_u[m[b]] + bias, persistent, two pingpong consumers."""
    gl.static_assert(STAGES >= 2, "the ring needs at least two slots")
    gl.static_assert(num_warps == 4, "each consumer is one warpgroup")
    BLOCK_M: gl.constexpr = w_desc.block_type.shape[0]
    BLOCK_D: gl.constexpr = x_desc.block_type.shape[2]
    dtype: gl.constexpr = w_desc.dtype
    # As in s6: the producer refills consumer c's epilogue buffer at K step Y_AT of c's tile, after the
    # consumer has passed step EPI_FREE_AT ≤ Y_AT of that tile (no wait on a consumer that waits on it).
    FREE_AT: gl.constexpr = min(EPI_FREE_AT, K_TILES - 1)
    Y_AT: gl.constexpr = min(FREE_AT + STAGES, K_TILES - 1)

    num_m_tiles = gl.cdiv(N, BLOCK_M)
    tiles_per_row = num_m_tiles * gl.cdiv(D, BLOCK_D)
    num_tiles = B * tiles_per_row

    w_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    x_bufs = gl.allocate_shared_memory(dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    epi_bufs = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS] + out_desc.block_type.shape, out_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    epi_ready = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    epi_free = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    order = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    _init_barriers(ready, empty, epi_ready, epi_free, STAGES, NUM_CONSUMERS)
    for c in gl.static_range(NUM_CONSUMERS):
        mbarrier.init(order.index(c), count=1)

    gl.warp_specialize([
        (_pingpong_consumer, (w_bufs, x_bufs, epi_bufs, ready, empty, epi_ready, epi_free, order, out_desc, bias_ptr,
                              num_tiles, num_m_tiles, tiles_per_row, N,
                              0, K_TILES, STAGES, HAS_USER, HAS_BIAS, FREE_AT, num_warps)),
        (_pingpong_consumer, (w_bufs, x_bufs, epi_bufs, ready, empty, epi_ready, epi_free, order, out_desc, bias_ptr,
                              num_tiles, num_m_tiles, tiles_per_row, N,
                              1, K_TILES, STAGES, HAS_USER, HAS_BIAS, FREE_AT, num_warps)),
        (_producer, (w_desc, x_desc, y_desc, m_ptr, w_bufs, x_bufs, epi_bufs, ready, empty, epi_ready, epi_free,
                     num_tiles, num_m_tiles, tiles_per_row,
                     K_TILES, STAGES, HAS_USER, Y_AT, NUM_CONSUMERS)),
    ], [num_warps, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ----------------------------------------------------------------------------- host side


def _constexprs(cfg: PingPongConfig, num_cand_tokens: int, has_user: bool, has_bias: bool) -> dict:
    return dict(
        K_TILES=triton.cdiv(num_cand_tokens, cfg.block_k), STAGES=cfg.stages, HAS_USER=has_user, HAS_BIAS=has_bias,
        EPI_FREE_AT=cfg.epi_free_at, CONSUMER_REGS=cfg.consumer_regs, PRODUCER_REGS=cfg.producer_regs,
        num_warps=cfg.num_warps,
    )


def _launch_pingpong(packed: PackedLinearCompress, cand_emb, out, user_part, cand_to_user, bias, cfg: PingPongConfig,
                     num_programs: int | None = None):
    """out[b] = W_c @ cand_emb[b] (+ user_part[cand_to_user[b]] when user_part is given) (+ bias)."""
    num_candidates, num_cand_tokens, dim = cand_emb.shape
    rows = out.shape[1]
    w_desc, x_desc, y_desc, out_desc = _descriptors(packed, cand_emb, out, user_part, cfg)
    num_tiles = num_candidates * triton.cdiv(rows, cfg.block_m) * triton.cdiv(dim, cfg.block_d)
    grid = min(num_programs or _device_info(out.device)[1], num_tiles)
    _lce_pingpong_kernel[(grid,)](
        w_desc, x_desc, y_desc, out_desc,
        cand_to_user, out if bias is None else bias,
        num_candidates, rows, dim,
        **_constexprs(cfg, num_cand_tokens, user_part is not None, bias is not None),
        maxnreg=cfg.maxnreg,
    )


def lce_s7(packed: PackedLinearCompress, user_emb, cand_emb, cand_to_user, out=None, user_part=None,
           config: PingPongConfig | None = None) -> torch.Tensor:
    """out [B, N, D] = packed(user_emb, cand_emb, cand_to_user) through s7, for inputs that passed
    PackedLinearCompress's checks and `s6_supported` (s7 runs where s6 runs). Two launches: the user
    GEMM (Y_u [U, N, D]) and `_lce_pingpong_kernel`. `config` overrides the tile config (benchmarks);
    `out` and `user_part` may be given pre-filled (tests poison them with NaN)."""
    cfg = s7_config(user_emb.shape[2], cand_emb.element_size(), config)
    return run_fused(packed, user_emb, cand_emb, cand_to_user, out, user_part, cfg, _launch_pingpong)


def compile_s7(dtype: torch.dtype = torch.bfloat16, num_candidates: int = 1024, rows: int = 512, dim: int = 256,
               num_cand_tokens: int = 500, config: PingPongConfig | None = None, has_user: bool = True,
               has_bias: bool = True, capability: int = 90):
    """Compile `_lce_pingpong_kernel` for a CUDA target without a GPU (s6's `compile_cpu`)."""
    cfg = s7_config(dim, torch.finfo(dtype).bits // 8, config)
    constexprs = _constexprs(cfg, num_cand_tokens, has_user, has_bias)
    return compile_cpu(_lce_pingpong_kernel, cfg, constexprs, dtype, num_candidates, rows, dim, num_cand_tokens,
                       has_user, capability)
