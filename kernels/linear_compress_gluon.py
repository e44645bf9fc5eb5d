"""IKBO linear compression, variant s5: the candidate GEMM with the weight slice resident in shared memory (Gluon).

Math (as in `kernels/linear_compress.py`): out[b] = W_u @ user_emb[m[b]] + W_c @ cand_emb[b] + bias[:, None],
user_emb [U, Ku, D], cand_emb [B, Kc, D], W_c [N, Kc], bias [N] → out [B, N, D].

Status (H200, 2026-11-29): correct, but SLOWER than s4 at the canonical shape (0.42 vs 0.355 ms;
the kernel alone 0.356 ms vs s2's 0.287 ms for the same candidate GEMM); not dispatched by the
public op. docs/notes/lce.md has the numbers and what they point to (too few bytes in flight per
SM once 128 KiB of shared memory hold W_c; the pointer epilogue throttles the LSU queue).

Why it was tried: the candidate GEMM (134 of 138 GFLOP at the canonical shape) is a batched
[N, Kc] @ [Kc, D] whose left operand is the same for every b. s2–s4 reload a [128, 64] weight tile
from L2 for every [64, 256] activation tile: 85 FLOP per byte moved to the SM, and at ~5.5 TB/s of
L2→SM traffic that caps them near 467 TFLOP/s (docs/notes/lce.md). Here each program loads its W_c slice once
([BLOCK_M, Kc'] with Kc' = Kc rounded up to BLOCK_K: 128 × 512 bf16 = 128 KiB at Kc = 500) and
keeps it in shared memory while it streams the cand_emb tiles of its candidates: BLOCK_M FLOP per
byte (128). Triton's `tl` language cannot pin an operand in shared memory across a persistent loop;
Gluon (`triton.experimental.gluon`, Triton 3.6) exposes shared memory, mbarriers, TMA copies and
wgmma directly.

Kernel `_lce_resident_kernel`, one program per SM, 8 warps (two warpgroups, 64 rows each):
    programs = G lanes × T tiles, T = cdiv(N, BLOCK_M) · cdiv(D, BLOCK_D); program (tile t, lane j)
    owns output tile t of its lane's candidates: a contiguous run of the candidates sorted by user
    (`group_users`, one argsort of the mapping per call) or j, j + G, j + 2G, … The T programs of
    one lane walk the same candidates at about the same time, so each cand_emb tile comes from
    HBM once and from L2 for the other T - 1.
    1. TMA: W_c[off_m : off_m + BLOCK_M, :] → K_TILES shared tiles [BLOCK_M, BLOCK_K], one mbarrier.
    2. A STAGES-deep ring of [BLOCK_K, BLOCK_D] cand_emb tiles (TMA over the rank-3 [B, Kc, D]
       descriptor: rows past Kc of candidate b are zero-filled, never the next candidate's rows),
       one mbarrier per slot. Loads run STAGES - 1 steps ahead over the flattened (candidate, k)
       sequence, so the next candidate's first tiles arrive during this one's epilogue.
    3. `l2_prefetch` (off: measured slower): at the start of each candidate, one thread
       bulk-prefetches this program's 1/T share of the next candidate's cand_emb (contiguous Kc·D
       elements) into L2 (`cp.async.bulk.prefetch.L2`, inline PTX), meant to take HBM latency off
       the ring's loads.
    4. wgmma (async, one group in flight) into a [BLOCK_M, BLOCK_D] fp32 accumulator in registers.
    5. Epilogue in the MMA layout (no shared memory left for staging): + Y_u[m[b]] tile, + bias,
       cast, pointer store. The Y_u tile is loaded before the K loop (latency under the MMAs) and,
       with `group_users` (off: measured slower), only when the user changes. Candidate and user
       indices are loaded one iteration ahead, so no scalar load result is waited for on the MMA path.
The user GEMM Y_u = W_u @ user_emb [U, N, D] runs first through s3's tile kernel (one launch more).

Limits (`s5_supported`): CUDA capability 9.x, fp16/bf16, cand_emb TMA-able (D·2 bytes a multiple
of 16), 1 ≤ Kc with the resident slice and the ring within one SM's shared memory: Kc ≤ 512 with 3
stages of [64, 256], ≤ 640 with 2 (`resident_config`). Elsewhere callers take s3/s4.
Sources: Triton's Gluon tutorials `python/tutorials/gluon/05-wgmma.py`, `07-persistence.py`
(mbarrier ring, async wgmma); the resident-operand idea after "In-Kernel Broadcast Optimization"
(Meta, 2025), which shares one operand across candidates.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .linear_compress import PackedLinearCompress, TileConfig

SMEM_LIMIT = 232448  # bytes of shared memory one block may take on sm_90 (227 KiB)
GLUON_TYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class ResidentConfig:
    """Tile shape and pipeline depth of the s5 kernel."""

    block_m: int = 128  # W_c rows per program (resident), two warpgroups of 64
    block_d: int = 256  # output columns per program
    block_k: int = 64  # K step of the streamed cand_emb tiles
    stages: int = 3  # cand_emb ring depth
    num_warps: int = 8
    # Both off by default: on the H200 each made the canonical shape slower (docs/notes/lce.md, 2026-11-29).
    group_users: bool = False  # each program takes a contiguous run of the candidates sorted by user, Y_u tile reused
    l2_prefetch: bool = False  # bulk-prefetch the next candidate's cand_emb into L2 (contiguous cand_emb only)

    def smem_bytes(self, num_cand_tokens: int, elem: int) -> int:
        k_tiles = triton.cdiv(num_cand_tokens, self.block_k)
        resident = k_tiles * self.block_m * self.block_k * elem
        ring = self.stages * self.block_k * self.block_d * elem
        return resident + ring + 8 * (self.stages + 1)


# User GEMM config: [128, 128] tiles so that U · N/128 · D/128 programs (120 at the canonical shape)
# spread over the SMs; the user GEMM is 4 of the 138 GFLOP.
USER_GEMM_CONFIG = TileConfig(128, 128, 64, num_warps=4, num_stages=4)


@gluon.constexpr_function
def _mma_layout(block_m, block_d, num_warps):
    """wgmma accumulator layout: warps stacked along M (16 rows each), the widest instruction N."""
    instr_n = min(256, block_d)
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, instr_n, 16])


@gluon.jit
def _cand_at(order_ptr, lane, num_lanes, first, pos, valid, GROUP_USERS: gl.constexpr):
    """The candidate at position `pos` of this program's sequence: order[first + pos] (GROUP_USERS:
    a contiguous range of the candidates sorted by user), else lane + pos · num_lanes."""
    if GROUP_USERS:
        cand = gl.load(order_ptr + first + pos, mask=valid, other=0).to(gl.int32)
    else:
        cand = lane + pos * num_lanes
    return cand


@gluon.jit
def _issue_cand_load(x_desc, x_bufs, ready, step, total, cand, k, off_d, STAGES: gl.constexpr):
    """TMA of cand_emb[cand, k : k + BLOCK_K, off_d : off_d + BLOCK_D] into the ring slot of `step`."""
    pred = step < total
    slot = step % STAGES
    bar = ready.index(slot)
    mbarrier.expect(bar, x_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(x_desc, [cand, k, off_d], bar, x_bufs.index(slot), pred)


@gluon.jit
def _prefetch_cand_l2(x_ptr, cand, valid, tile, cand_elems, chunk_elems, ELEM: gl.constexpr):
    """Bulk-prefetch this program's share of cand_emb[cand] (chunk `tile` of the candidate's
    contiguous Kc·D elements) into L2, from one thread; nothing unless `valid`."""
    start = tile * chunk_elems
    size = gl.where(valid, gl.minimum(chunk_elems, cand_elems - start), 0) * ELEM
    ptr = x_ptr + cand.to(gl.int64) * cand_elems + start
    gl.inline_asm_elementwise(
        asm="""{
        .reg .pred leader, some;
        .reg .u32 tid;
        mov.u32 tid, %tid.x;
        setp.eq.u32 leader, tid, 0;
        setp.gt.s32 some, $2, 0;
        and.pred leader, leader, some;
        @leader cp.async.bulk.prefetch.L2.global [$1], $2;
        mov.u32 $0, 0;
        }""",
        constraints="=r,l,r",
        args=[ptr, size],
        dtype=gl.int32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def _lce_resident_kernel(
    w_desc,  # W_c padded [N, Kc'], blocks [BLOCK_M, BLOCK_K]
    x_desc,  # cand_emb [B, Kc, D], blocks [1, BLOCK_K, BLOCK_D]
    x_ptr, cand_elems, chunk_elems,  # cand_emb (contiguous) for the L2 prefetch: Kc·D, this program's share
    out_ptr, y_ptr, m_ptr, bias_ptr,  # out [B, N, D], Y_u [U, N, D] (contiguous), cand_to_user [B], bias [N]
    order_ptr,  # GROUP_USERS: [B] candidates sorted by user
    B, N, num_lanes,  # num_lanes: programs per output tile (G)
    D: gl.constexpr,  # compile-time, so the epilogue's per-element offsets fold into immediates
    BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_K: gl.constexpr, K_TILES: gl.constexpr,
    STAGES: gl.constexpr, HAS_USER: gl.constexpr, HAS_BIAS: gl.constexpr, EVEN: gl.constexpr,
    GROUP_USERS: gl.constexpr, L2_PREFETCH: gl.constexpr, num_warps: gl.constexpr,
):
    """s5: out[b] tile = W_c slice (resident) @ cand_emb[b] + Y_u[m[b]] + bias for this program's b.

    Scalars run ahead so that no load result is waited for on the MMA path: the candidate two
    positions ahead and the user one position ahead are loaded one iteration before use.
    """
    gl.static_assert(STAGES >= 2, "the ring needs at least two slots")
    gl.static_assert(STAGES - 1 <= K_TILES, "loads run at most one candidate ahead")
    dtype: gl.constexpr = x_desc.dtype
    ELEM: gl.constexpr = dtype.primitive_bitwidth // 8
    mma_layout: gl.constexpr = _mma_layout(BLOCK_M, BLOCK_D, num_warps)
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)

    pid = gl.program_id(0)
    tile = pid // num_lanes
    lane = pid % num_lanes
    num_d_tiles = gl.cdiv(D, BLOCK_D)
    off_m = (tile // num_d_tiles) * BLOCK_M
    off_d = (tile % num_d_tiles) * BLOCK_D
    if GROUP_USERS:  # positions [first, last) of the sorted order: runs of one user, Y_u tile reused
        first = (lane * B) // num_lanes
        num_cands = ((lane + 1) * B) // num_lanes - first
    else:  # candidates lane, lane + G, lane + 2G, ...
        first = 0
        num_cands = gl.cdiv(gl.maximum(B - lane, 0), num_lanes)
    total = num_cands * K_TILES

    # Shared memory: the resident W_c slice, the cand_emb ring, one barrier per slot + one for W.
    w_smem = gl.allocate_shared_memory(dtype, [K_TILES, BLOCK_M, BLOCK_K], w_desc.layout)
    x_bufs = gl.allocate_shared_memory(dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    w_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    mbarrier.init(w_bar, count=1)

    mbarrier.expect(w_bar, K_TILES * w_desc.block_type.nbytes)
    for kt in gl.static_range(K_TILES):
        tma.async_copy_global_to_shared(w_desc, [off_m, kt * BLOCK_K], w_bar, w_smem.index(kt))
    cand = _cand_at(order_ptr, lane, num_lanes, first, 0, num_cands > 0, GROUP_USERS)
    nxt = _cand_at(order_ptr, lane, num_lanes, first, 1, num_cands > 1, GROUP_USERS)
    for s in gl.static_range(STAGES - 1):  # the first candidate's first K tiles
        _issue_cand_load(x_desc, x_bufs, ready, s, total, cand, s * BLOCK_K, off_d, STAGES)

    rows = off_m + gl.arange(0, BLOCK_M, layout=row_layout)
    cols = off_d + gl.arange(0, BLOCK_D, layout=col_layout)
    tile_offsets = rows[:, None] * D + cols[None, :]  # [BLOCK_M, BLOCK_D] within one [N, D] row
    if EVEN:
        mask = None
    else:
        mask = (rows < N)[:, None] & (cols < D)[None, :]
    if HAS_BIAS:
        bias = gl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(gl.float32)
    if HAS_USER:
        user = gl.load(m_ptr + cand, mask=num_cands > 0, other=0).to(gl.int32)
        if GROUP_USERS:
            user_tile = gl.zeros((BLOCK_M, BLOCK_D), dtype=dtype, layout=mma_layout)
            prev_user = gl.to_tensor(-1)

    acc = gl.zeros((BLOCK_M, BLOCK_D), dtype=gl.float32, layout=mma_layout)
    mbarrier.wait(w_bar, 0)
    step = 0
    for i in range(num_cands):
        # Scalars for the next iterations; their results are used one iteration later.
        nxt2 = _cand_at(order_ptr, lane, num_lanes, first, i + 2, i + 2 < num_cands, GROUP_USERS)
        if HAS_USER:
            nxt_user = gl.load(m_ptr + nxt, mask=i + 1 < num_cands, other=0).to(gl.int32)
        if L2_PREFETCH:  # the next candidate's cand_emb → L2, so the ring's loads hit L2, not HBM
            _prefetch_cand_l2(x_ptr, nxt, i + 1 < num_cands, tile, cand_elems, chunk_elems, ELEM)
        if HAS_USER:  # the Y_u tile, loaded before the K loop: its latency hides under the MMAs
            if GROUP_USERS:
                if user != prev_user:
                    user_tile = gl.load(y_ptr + user.to(gl.int64) * N * D + tile_offsets, mask=mask)
                prev_user = user
            else:
                user_tile = gl.load(y_ptr + user.to(gl.int64) * N * D + tile_offsets, mask=mask)
        for kt in gl.static_range(K_TILES):
            slot = step % STAGES
            mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
            x_tile = x_bufs.index(slot).reshape([BLOCK_K, BLOCK_D])
            acc = warpgroup_mma(w_smem.index(kt), x_tile, acc, use_acc=kt > 0, is_async=True)
            # The previous step's wgmma is done: its slot takes the load STAGES - 1 steps ahead,
            # which belongs to this candidate or (near the end of its K loop) to the next.
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            if kt + STAGES - 1 < K_TILES:
                _issue_cand_load(x_desc, x_bufs, ready, step + STAGES - 1, total, cand,
                                 (kt + STAGES - 1) * BLOCK_K, off_d, STAGES)
            else:
                _issue_cand_load(x_desc, x_bufs, ready, step + STAGES - 1, total, nxt,
                                 (kt + STAGES - 1 - K_TILES) * BLOCK_K, off_d, STAGES)
            step += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        result = acc
        if HAS_USER:
            result = result + user_tile.to(gl.float32)
        if HAS_BIAS:
            result = result + bias[:, None]
        gl.store(out_ptr + cand.to(gl.int64) * N * D + tile_offsets, result.to(dtype), mask=mask)
        cand = nxt
        nxt = nxt2
        if HAS_USER:
            user = nxt_user

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
    mbarrier.invalidate(w_bar)


# ----------------------------------------------------------------------------- host side


@functools.lru_cache(maxsize=None)
def _device_info(device: torch.device):
    props = torch.cuda.get_device_properties(device)
    return (props.major, props.minor), props.multi_processor_count


def resident_config(dim: int, num_cand_tokens: int, elem: int, base: ResidentConfig | None = None):
    """`base` with BLOCK_D fitted to D and the deepest ring (base.stages, at most K tiles + 1, else 2)
    whose shared memory fits; None when even 2 stages do not fit (Kc too large for a resident slice)."""
    base = base or ResidentConfig()
    block_d = max(16, min(base.block_d, triton.next_power_of_2(dim)))
    most = min(base.stages, triton.cdiv(num_cand_tokens, base.block_k) + 1)  # loads run ≤ 1 candidate ahead
    for stages in sorted({most, 2}, reverse=True):
        cfg = replace(base, block_d=block_d, stages=stages)
        if cfg.smem_bytes(num_cand_tokens, elem) <= SMEM_LIMIT:
            return cfg
    return None


def s5_supported(user_emb: torch.Tensor, cand_emb: torch.Tensor) -> bool:
    """Whether s5 runs these (checked) inputs, else take s3/s4: a Hopper GPU, fp16/bf16, cand_emb
    TMA-able (unit last stride, 16-byte aligned base and strides), 1 ≤ Kc small enough for the
    resident slice (Kc ≤ 640 at BLOCK_M = 128 in 16-bit types)."""
    if not cand_emb.is_cuda or cand_emb.dtype not in GLUON_TYPES or user_emb.dtype != cand_emb.dtype:
        return False
    if _device_info(cand_emb.device)[0][0] != 9:
        return False
    _, num_cand_tokens, dim = cand_emb.shape
    elem = cand_emb.element_size()
    return (
        num_cand_tokens >= 1
        and cand_emb.stride(-1) == 1
        and cand_emb.data_ptr() % 16 == 0
        and all(s * elem % 16 == 0 for s in cand_emb.stride()[:-1])
        and resident_config(dim, num_cand_tokens, elem) is not None
    )


def _descriptors(packed: PackedLinearCompress, cand_emb: torch.Tensor, cfg: ResidentConfig):
    """W_c (packed, padded) descriptor, cached on the packed module; cand_emb rank-3 descriptor."""
    gl_dtype = gl.bfloat16 if cand_emb.dtype == torch.bfloat16 else gl.float16
    weight = packed.cand_weight_padded
    key = ("s5-desc", weight.data_ptr(), cfg.block_m, cfg.block_k)
    w_desc = packed._flags.get(key)
    if w_desc is None:
        w_layout = gl.NVMMASharedLayout.get_default_for([cfg.block_m, cfg.block_k], gl_dtype)
        w_desc = TensorDescriptor.from_tensor(weight, [cfg.block_m, cfg.block_k], w_layout)
        packed._flags[key] = w_desc
    x_block = [1, cfg.block_k, cfg.block_d]
    x_layout = gl.NVMMASharedLayout.get_default_for(x_block, gl_dtype)
    x_desc = TensorDescriptor(cand_emb, list(cand_emb.shape), list(cand_emb.stride()), x_block, x_layout)
    return w_desc, x_desc


def _launch_resident(packed: PackedLinearCompress, cand_emb, out, user_part, cand_to_user, bias, cfg: ResidentConfig):
    """out[b] = W_c @ cand_emb[b] (+ user_part[cand_to_user[b]] when user_part is given) (+ bias).
    With cfg.group_users, candidates are processed in user order (one argsort of the mapping)."""
    num_candidates, num_cand_tokens, dim = cand_emb.shape
    rows = out.shape[1]
    w_desc, x_desc = _descriptors(packed, cand_emb, cfg)
    tiles = triton.cdiv(rows, cfg.block_m) * triton.cdiv(dim, cfg.block_d)
    num_lanes = max(1, min(_device_info(out.device)[1] // tiles, num_candidates))  # programs per output tile
    cand_elems = num_cand_tokens * dim
    chunk_elems = triton.cdiv(cand_elems, tiles * 8) * 8  # 16-byte multiples in 16-bit types
    order = torch.argsort(cand_to_user) if cfg.group_users else cand_to_user  # [B] positions → candidates
    _lce_resident_kernel[(tiles * num_lanes,)](
        w_desc, x_desc,
        cand_emb, cand_elems, chunk_elems,
        out, out if user_part is None else user_part, cand_to_user, out if bias is None else bias,
        order,
        num_candidates, rows, num_lanes,
        D=dim, BLOCK_M=cfg.block_m, BLOCK_D=cfg.block_d, BLOCK_K=cfg.block_k,
        K_TILES=triton.cdiv(num_cand_tokens, cfg.block_k), STAGES=cfg.stages,
        HAS_USER=user_part is not None, HAS_BIAS=bias is not None,
        EVEN=rows % cfg.block_m == 0 and dim % cfg.block_d == 0, GROUP_USERS=cfg.group_users,
        L2_PREFETCH=cfg.l2_prefetch and cand_emb.is_contiguous(),
        num_warps=cfg.num_warps,
    )


def lce_s5(packed: PackedLinearCompress, user_emb, cand_emb, cand_to_user, out=None, user_part=None,
           config: ResidentConfig | None = None) -> torch.Tensor:
    """out [B, N, D] = packed(user_emb, cand_emb, cand_to_user) through s5, for inputs that passed
    PackedLinearCompress's checks and `s5_supported`. Two launches: the user GEMM (s3's tile
    kernel, Y_u [U, N, D]) and `_lce_resident_kernel`. `config` overrides the tile config
    (benchmarks); `out` and `user_part` may be given pre-filled (tests poison them with NaN)."""
    num_users, num_user_tokens, dim = user_emb.shape
    num_candidates, num_cand_tokens, _ = cand_emb.shape
    rows = packed.cand_weight.shape[0]
    cfg = config or resident_config(dim, num_cand_tokens, cand_emb.element_size())
    if cfg is None:
        raise ValueError(f"cand_emb: Kc = {num_cand_tokens} is too large for s5's resident weight slice")
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
    _launch_resident(packed, cand_emb, out, user_part, cand_to_user, packed.bias, cfg)
    return out


def compile_s5(dtype: torch.dtype = torch.bfloat16, num_candidates: int = 1024, rows: int = 512, dim: int = 256,
               num_cand_tokens: int = 500, config: ResidentConfig | None = None, has_user: bool = True,
               has_bias: bool = True, capability: int = 90):
    """Compile `_lce_resident_kernel` for a CUDA target without a GPU (CPU tensors stand in for the
    arguments; the JIT's own specialization rules give the signature). Returns the CompiledKernel:
    `.asm["ptx"]`, `.asm["cubin"]`, `.metadata.shared`, `.n_regs`/`.n_spills` are not set off-device,
    so read registers and spills from ptxas (`triton.knobs.nvidia.dump_ptxas_log`) or cuobjdump."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    cfg = config or resident_config(dim, num_cand_tokens, torch.finfo(dtype).bits // 8)
    weight = torch.zeros(rows, triton.cdiv(num_cand_tokens, 8) * 8, dtype=dtype)
    packed = PackedLinearCompress(weight, weight, None, weight, weight)
    cand_emb = torch.zeros(2, num_cand_tokens, dim, dtype=dtype)
    w_desc, x_desc = _descriptors(packed, cand_emb, cfg)
    out = torch.zeros(16, dtype=dtype)
    mapping = torch.zeros(16, dtype=torch.int32)
    num_lanes = 33
    runtime_args = dict(
        w_desc=w_desc, x_desc=x_desc, x_ptr=cand_emb, cand_elems=num_cand_tokens * dim,
        chunk_elems=triton.cdiv(num_cand_tokens * dim, 32) * 8, out_ptr=out, y_ptr=out, m_ptr=mapping, bias_ptr=out,
        order_ptr=torch.zeros(16, dtype=torch.int64),
        B=num_candidates, N=rows, num_lanes=num_lanes,
    )
    constexprs = dict(
        D=dim,
        BLOCK_M=cfg.block_m, BLOCK_D=cfg.block_d, BLOCK_K=cfg.block_k,
        K_TILES=triton.cdiv(num_cand_tokens, cfg.block_k), STAGES=cfg.stages, HAS_USER=has_user,
        HAS_BIAS=has_bias, EVEN=rows % cfg.block_m == 0 and dim % cfg.block_d == 0,
        GROUP_USERS=cfg.group_users, L2_PREFETCH=cfg.l2_prefetch, num_warps=cfg.num_warps,
    )
    names = list(_lce_resident_kernel.arg_names)
    signature, attrs, constants = {}, {}, {}
    for index, name in enumerate(names):
        if name in constexprs:
            signature[name] = "constexpr"
            constants[(index,)] = constexprs[name]
            continue
        kind, key = native_specialize_impl(BaseBackend, runtime_args[name], False, True, True)
        signature[name] = kind
        if isinstance(key, str):
            attrs[(index,)] = BaseBackend.parse_attr(key)
    source = GluonASTSource(_lce_resident_kernel, signature, constants, attrs)
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options={"num_warps": cfg.num_warps})
