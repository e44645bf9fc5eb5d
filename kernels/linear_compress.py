"""IKBO linear compression (LCE).

Math, per candidate b with user u = m[b]:
    out[b] = W @ cat(user_emb[u], cand_emb[b]) (+ bias[:, None])
           = W_u @ user_emb[u] + W_c @ cand_emb[b] (+ bias[:, None])          (Type I decomposition)
Shapes: user_emb [U, Ku, D], cand_emb [B, Kc, D], cand_to_user [B], W [N, Ku + Kc] (user columns
first), bias [N] → out [B, N, D].

The user GEMM runs at U rows and the candidate GEMM at B rows; the [U, N, D] user result Y_u joins the
candidate result through the mapping, never replicated. Per row g both GEMMs are
[N, K] @ [K, D]: a batched GEMM whose left operand (the weight) is shared by every row, so one
output tile is out[g, n0:n0+BLOCK_M, d0:d0+BLOCK_D] and the tiles of one row g are numbered next to
each other (they share X[g] in L2; the weight stays in L2 throughout).

Triton path, one variant per step of the IKBO co-design, each selectable (`variant=`):
    decomposed  user GEMM at U rows → Y_u, candidate GEMM at B rows → out, then a gather-add kernel
        out[b] += Y_u[m[b]] (+ bias). Plain pointer loads, unpadded weights. Three launches.
    aligned  weights split and K zero-padded to a multiple of 8 once, at pack time, so every weight
        row is 16-byte aligned; weight, activation and output tiles move through tensor descriptors
        (TMA). Still three launches.
    fused  epilogue fusion (Type II): the candidate GEMM's epilogue reads Y_u[m[b]] and the bias and
        adds them in registers; the [B, N, D] result is written once. Two launches.
    persistent  one launch: a persistent kernel runs the user tiles first, then the candidate tiles; a
        candidate tile's epilogue waits on its user tile's flag (set with release semantics after the
        tile is stored). Loops are software-pipelined across tiles (`flatten=True`). Inside a
        CUDA-graph capture the op takes `fused` (the per-call epoch would be frozen into the graph).
    warp_specialized  the candidate GEMM + fused epilogue as a warp-specialized persistent Gluon
        kernel, kernels/linear_compress_ws.py (Hopper, fp16/bf16; `fused` where it does not run).
With no `variant` (and nothing tuned), `default_variant(U, B, ws_runs)` picks warp_specialized where it
runs and B ≥ WS_MIN_CANDIDATES, else persistent or fused by B and B/U. The served model's shape buckets
are keyed on the fused/persistent choice, and its tuner times warp_specialized beside them on a Hopper
GPU (ikbo_backend/autotune.py), so a served model launches what its tuner chose. Triton's automatic warp
specialization of the K loop (`TileConfig.warp_specialize`; aligned and fused) is off by default: with
Triton 3.6 the kernel hangs on Hopper (docs/design/lce.md).
Y_u is kept in the output dtype. Activations whose rows are not 16-byte aligned (odd D) fall back
to masked pointer loads inside the same kernels. Ku = 0 skips the user GEMM; Kc = 0 leaves only
the user term and the bias. fp16 / bf16 inputs use the tensor cores with fp32 accumulation; fp32
inputs use tf32 (relative error near 3e-4); fp64 has no Triton path ("auto" takes torch for it).
Source: "In-Kernel Broadcast Optimization" (Meta, 2025), linear compression embedding; persistent
TMA GEMM after Triton's `python/tutorials/09-persistent-matmul.py`. Design: docs/design/lce.md.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ._common import (
    HostReadback,
    add_user_rows,
    check_mapping,
    check_mapping_shape,
    check_same,
    check_tensor,
    resolve_backend,
    tma_ok,
)
from ._interpreter import interpreting
from .configs import TileConfig, tuned_config

FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
TRITON_TYPES = (torch.float32, torch.float16, torch.bfloat16)
VARIANTS = ("decomposed", "aligned", "fused", "persistent")  # the Triton kernels of this file
WS_VARIANT = "warp_specialized"  # Gluon (kernels/linear_compress_ws.py): where ws_supported, else fused
_CONFIG_CHOICE: dict = {}  # (variant, dtype, D, device) → the first config of tile_configs that launched
PERSISTENT_MIN_CANDIDATES_PER_USER = 32  # default_variant: persistent from B/U ≥ 32
SMALL_BATCH = 256  # at most this many candidates: persistent from B/U ≥ 4 (one launch, less host time)
WS_MIN_CANDIDATES = 256  # default_variant: warp_specialized from this B up, where it runs
K_ALIGN = 8  # weight columns padded to a multiple of this at pack time (16 bytes in 16-bit types)


# ----------------------------------------------------------------------------- configs


def tile_configs(variant: str, dtype: torch.dtype, dim: int):
    """TileConfigs to try, best first: a [128, min(256, D)] tile with 128-byte K steps and the deepest
    pipeline that fits, then shallower ones, then a small tile; the first that launches is kept
    (shared memory decides, see `_triton`). Shared memory at 128 × 256 × 64, bf16 (sm_90a): fused at
    4 stages 192 KiB; persistent at 3 stages 208 KiB with the split epilogue (240 KiB whole: over 227 KiB).
    """
    if interpreting():
        yield TileConfig(16, 16, 16, num_warps=4, num_stages=1)
        return
    elem = torch.finfo(dtype).bits // 8
    block_d = max(16, min(256, triton.next_power_of_2(dim)))
    block_k = 128 // elem
    num_warps = 8 if block_d >= 128 else 4
    split = variant == "persistent" and block_d >= 64  # fused keeps the whole epilogue: it fits, and is faster
    stages = {"decomposed": (3, 2), "aligned": (4, 3), "fused": (4, 3), "persistent": (3, 2)}[variant]
    for num_stages in stages:
        yield TileConfig(128, block_d, block_k, num_warps=num_warps, num_stages=num_stages, epilogue_split=split)
    yield TileConfig(64, min(block_d, 128), block_k, num_warps=4, num_stages=2)


def _check_variant(variant) -> None:
    if variant not in VARIANTS + (WS_VARIANT,):
        raise ValueError(f"variant: expected one of {VARIANTS + (WS_VARIANT,)}, got {variant!r}")


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _tile_coords(tile, num_n_tiles, num_d_tiles, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """tile → (row g, n offset, d offset); the N tiles of one row are adjacent (they share X[g])."""
    n_tile = tile % num_n_tiles
    rest = tile // num_n_tiles
    d_tile = rest % num_d_tiles
    return rest // num_d_tiles, n_tile * BLOCK_M, d_tile * BLOCK_D


# fmt: off
@triton.jit
def _tile_mainloop(
    w_ptr, w_desc, stride_wn, x_ptr, x_desc, stride_xg, stride_xk, stride_xd, g, off_n, off_d, N, D, K,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, W_TMA: tl.constexpr, X_TMA: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    """acc[BLOCK_M, BLOCK_D] = W[off_n:, :K] @ X[g, :K, off_d:] in fp32; out-of-range entries are zeros."""
    rn = off_n + tl.arange(0, BLOCK_M)
    rd = off_d + tl.arange(0, BLOCK_D)
    rk = tl.arange(0, BLOCK_K)
    x_row = x_ptr + g.to(tl.int64) * stride_xg
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, warp_specialize=WARP_SPECIALIZE):
        if W_TMA:
            w = w_desc.load([off_n, k])  # [BLOCK_M, BLOCK_K], columns ≥ K are zero (padding / OOB fill)
        else:
            w_mask = (rn < N)[:, None] & (k + rk < K)[None, :]
            w = tl.load(w_ptr + rn[:, None] * stride_wn + (k + rk)[None, :], mask=w_mask, other=0.0)
        if X_TMA:
            x = x_desc.load([g, k, off_d]).reshape(BLOCK_K, BLOCK_D)  # rows ≥ K of row g: zero fill
        else:
            x_mask = (k + rk < K)[:, None] & (rd < D)[None, :]
            x = tl.load(x_row + (k + rk)[:, None] * stride_xk + rd[None, :] * stride_xd, mask=x_mask, other=0.0)
        acc = tl.dot(w, x, acc)
    return acc
# fmt: on


# fmt: off
@triton.jit
def _epilogue_part(
    acc, out_ptr, out_desc, y_ptr, m_ptr, bias_ptr, g, off_n, off_d, N, D, U, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr, FUSE_USER: tl.constexpr, HAS_BIAS: tl.constexpr, OUT_TMA: tl.constexpr,
):
    """out[g] tile = acc (+ Y_u[m[g]] tile) (+ bias); out and Y_u are contiguous [*, N, D]. m[g] is
    clamped to [0, U): a bad mapping reads no memory out of bounds (the op raises after the launch)."""
    rn = off_n + tl.arange(0, BLOCK_M)
    rd = off_d + tl.arange(0, BLOCK_D)
    mask = (rn < N)[:, None] & (rd < D)[None, :]
    tile_offsets = rn[:, None] * D + rd[None, :]
    if FUSE_USER:
        user = tl.minimum(tl.maximum(tl.load(m_ptr + g).to(tl.int64), 0), U - 1)
        y = tl.load(y_ptr + user * N * D + tile_offsets, mask=mask, other=0.0, cache_modifier=".cg")
        acc += y.to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[:, None]
    result = acc.to(out_ptr.dtype.element_ty)
    if OUT_TMA:
        out_desc.store([g, off_n, off_d], result.reshape(1, BLOCK_M, BLOCK_D))
    else:
        tl.store(out_ptr + g.to(tl.int64) * N * D + tile_offsets, result, mask=mask)
# fmt: on


# fmt: off
@triton.jit
def _tile_epilogue(
    acc, out_ptr, out_desc, y_ptr, m_ptr, bias_ptr, g, off_n, off_d, N, D, U, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr, FUSE_USER: tl.constexpr, HAS_BIAS: tl.constexpr, OUT_TMA: tl.constexpr, SPLIT: tl.constexpr,
):
    """The epilogue in one piece, or (SPLIT) in two [BLOCK_M, BLOCK_D / 2] halves: half the shared
    memory for the output staging and the layout conversions (after tutorial 09's EPILOGUE_SUBTILE)."""
    if SPLIT:
        left, right = acc.reshape(BLOCK_M, 2, BLOCK_D // 2).permute(0, 2, 1).split()
        _epilogue_part(
            left, out_ptr, out_desc, y_ptr, m_ptr, bias_ptr, g, off_n, off_d, N, D, U, BLOCK_M,
            BLOCK_D // 2,
            FUSE_USER,
            HAS_BIAS,
            OUT_TMA,
        )
        _epilogue_part(
            right, out_ptr, out_desc, y_ptr, m_ptr, bias_ptr, g, off_n,
            off_d + BLOCK_D // 2,
            N,
            D,
            U,
            BLOCK_M,
            BLOCK_D // 2,
            FUSE_USER,
            HAS_BIAS,
            OUT_TMA,
        )
    else:
        _epilogue_part(
            acc, out_ptr, out_desc, y_ptr, m_ptr, bias_ptr, g, off_n, off_d, N, D, U, BLOCK_M, BLOCK_D, FUSE_USER,
            HAS_BIAS, OUT_TMA,
        )
# fmt: on


# fmt: off
@triton.jit(do_not_specialize=["U"])
def _lce_tile_kernel(
    w_ptr,
    w_desc,
    stride_wn,  # weight [N, K] (decomposed: unpadded, pointers; else the padded copy, descriptor)
    x_ptr,
    x_desc,
    stride_xg,
    stride_xk,
    stride_xd,  # activations [G, K, D]
    out_ptr,
    out_desc,  # out [G, N, D], contiguous
    y_ptr,
    m_ptr,
    bias_ptr,  # FUSE_USER: Y_u [U, N, D] contiguous, cand_to_user [G]; bias [N]
    N, D, K, U, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, W_TMA: tl.constexpr,
    X_TMA: tl.constexpr, OUT_TMA: tl.constexpr, FUSE_USER: tl.constexpr, HAS_BIAS: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr, SPLIT: tl.constexpr,
):
    """One output tile per program: out[g] = W @ X[g] (decomposed, aligned), + Y_u[m[g]] + bias in the epilogue
    (fused)."""
    g, off_n, off_d = _tile_coords(tl.program_id(0), tl.cdiv(N, BLOCK_M), tl.cdiv(D, BLOCK_D), BLOCK_M, BLOCK_D)
    acc = _tile_mainloop(
        w_ptr, w_desc, stride_wn, x_ptr, x_desc, stride_xg, stride_xk, stride_xd, g, off_n, off_d, N, D, K, BLOCK_M,
        BLOCK_D, BLOCK_K, W_TMA, X_TMA, WARP_SPECIALIZE,
    )
    _tile_epilogue(
        acc, out_ptr, out_desc, y_ptr, m_ptr, bias_ptr, g, off_n, off_d, N, D, U, BLOCK_M, BLOCK_D, FUSE_USER, HAS_BIAS,
        OUT_TMA, SPLIT,
    )
# fmt: on


# fmt: off
@triton.jit(do_not_specialize=["U"])
def _lce_add_user_kernel(
    out_ptr,
    y_ptr,
    m_ptr,
    bias_ptr,  # out [B, N, D] (updated in place), Y_u [U, N, D], m [B], bias [N]
    N, D, U, HAS_USER: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):
    """decomposed / aligned gather-add: out[b] += Y_u[m[b]] (+ bias[:, None]), one [N·D] row chunk per program
    (m[b] clamped to [0, U))."""
    b = tl.program_id(0).to(tl.int64)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < N * D
    row = out_ptr + b * N * D + offsets
    value = tl.load(row, mask=mask).to(tl.float32)
    if HAS_USER:
        user = tl.minimum(tl.maximum(tl.load(m_ptr + b).to(tl.int64), 0), U - 1)
        value += tl.load(y_ptr + user * N * D + offsets, mask=mask).to(tl.float32)
    if HAS_BIAS:
        value += tl.load(bias_ptr + offsets // D, mask=mask).to(tl.float32)
    tl.store(row, value.to(out_ptr.dtype.element_ty), mask=mask)
# fmt: on


@triton.jit
def _wait_at_least(ptr, target, SPIN_ASM: tl.constexpr):
    """Spin until the int64 at `ptr` (gpu scope, acquire) is ≥ `target`.

    SPIN_ASM: a PTX loop, which keeps control flow out of the IR (Triton 3.6's Hopper warp
    specialization pass fails on any scf.while in the kernel); else a while loop (interpreter).
    """
    if SPIN_ASM:
        tl.inline_asm_elementwise(
            asm="""{
            .reg .pred not_yet;
            .reg .s64 seen;
            spin:
            ld.acquire.gpu.global.s64 seen, [$1];
            setp.lt.s64 not_yet, seen, $2;
            @not_yet bra spin;
            mov.b64 $0, seen;
            }""",
            constraints="=l,l,l",
            args=[ptr, target],
            dtype=tl.int64,
            is_pure=False,
            pack=1,
        )
    else:
        while tl.atomic_add(ptr, 0, sem="acquire", scope="gpu") < target:
            pass


# fmt: off
@triton.jit(do_not_specialize=["epoch", "U", "B", "NUM_PROGRAMS"])  # any U, B: one kernel per tile config
def _lce_persistent_kernel(
    wu_desc,
    xu_ptr,
    xu_desc,
    stride_xu_g,
    stride_xu_k,
    stride_xu_d,  # user side: W_u (padded), user_emb
    wc_desc,
    xc_ptr,
    xc_desc,
    stride_xc_g,
    stride_xc_k,
    stride_xc_d,  # candidate side: W_c (padded), cand_emb
    y_ptr,
    out_ptr,
    out_desc,
    m_ptr,
    bias_ptr,  # Y_u [U, N, D] scratch, out [B, N, D], m [B], bias [N]
    flag_ptr,
    epoch,  # int64 flag[user tile] ≥ epoch once that Y_u tile is stored
    U, B, N, D, KU, KC, NUM_PROGRAMS, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
    XU_TMA: tl.constexpr, XC_TMA: tl.constexpr, OUT_TMA: tl.constexpr, HAS_USER: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPIN_ASM: tl.constexpr, SPLIT: tl.constexpr,
):
    """persistent: user tiles, then candidate tiles, in one persistent launch (grid ≤ number of SMs, all resident).

    User tiles come first in every program's order, so no wait can block a user tile. A candidate
    tile runs its main loop first and waits for its own user tile's flag only in the epilogue.
    """
    pid = tl.program_id(0)
    num_n_tiles = tl.cdiv(N, BLOCK_M)
    num_d_tiles = tl.cdiv(D, BLOCK_D)
    tiles_per_row = num_n_tiles * num_d_tiles
    if HAS_USER:
        for tile in tl.range(pid, U * tiles_per_row, NUM_PROGRAMS, flatten=True):
            user, off_n, off_d = _tile_coords(tile, num_n_tiles, num_d_tiles, BLOCK_M, BLOCK_D)
            acc = _tile_mainloop(
                wu_desc,
                wu_desc,
                0,
                xu_ptr, xu_desc, stride_xu_g, stride_xu_k, stride_xu_d, user, off_n, off_d, N, D, KU, BLOCK_M, BLOCK_D,
                BLOCK_K, True, XU_TMA, False,
            )
            _tile_epilogue(
                acc, y_ptr, y_ptr, y_ptr, m_ptr, bias_ptr, user, off_n, off_d, N, D, U, BLOCK_M, BLOCK_D, False, False,
                False, SPLIT,
            )
            tl.debug_barrier()  # every thread's Y_u stores precede the flag's release
            tl.atomic_xchg(flag_ptr + tile, epoch, sem="release", scope="gpu")
    # Programs that ran user tiles take the candidate tiles at the end of each wave.
    user_tiles = U * tiles_per_row if HAS_USER else 0
    first = (pid + NUM_PROGRAMS - user_tiles % NUM_PROGRAMS) % NUM_PROGRAMS
    for tile in tl.range(first, B * tiles_per_row, NUM_PROGRAMS, flatten=True):
        cand, off_n, off_d = _tile_coords(tile, num_n_tiles, num_d_tiles, BLOCK_M, BLOCK_D)
        acc = _tile_mainloop(
            wc_desc,
            wc_desc,
            0,
            xc_ptr, xc_desc, stride_xc_g, stride_xc_k, stride_xc_d, cand, off_n, off_d, N, D, KC, BLOCK_M, BLOCK_D,
            BLOCK_K, True, XC_TMA, False,
        )
        if HAS_USER:
            user = tl.minimum(tl.maximum(tl.load(m_ptr + cand), 0), U - 1)  # a bad value waits on no missing flag
            _wait_at_least(flag_ptr + user * tiles_per_row + tile % tiles_per_row, epoch, SPIN_ASM)
        _tile_epilogue(
            acc, out_ptr, out_desc, y_ptr, m_ptr, bias_ptr, cand, off_n, off_d, N, D, U, BLOCK_M, BLOCK_D, HAS_USER,
            HAS_BIAS, OUT_TMA, SPLIT,
        )
# fmt: on


# ----------------------------------------------------------------------------- host side


def _pad_columns(weight: torch.Tensor, multiple: int) -> torch.Tensor:
    """weight [N, K] → [N, K'] with K' = max(K, 1) rounded up to `multiple`; new columns are zeros."""
    cols = triton.cdiv(max(weight.shape[1], 1), multiple) * multiple
    padded = weight.new_zeros(weight.shape[0], cols)
    padded[:, : weight.shape[1]] = weight
    return padded


def _activation_desc(x: torch.Tensor, cfg: TileConfig):
    """Descriptor over x [G, K, D] with [1, BLOCK_K, BLOCK_D] blocks, or None (pointer loads)."""
    if not tma_ok(x):
        return None
    return TensorDescriptor(x, list(x.shape), list(x.stride()), [1, cfg.block_k, cfg.block_n])


def _out_desc(out: torch.Tensor, cfg: TileConfig):
    if not tma_ok(out):
        return None
    block_d = cfg.block_n // 2 if cfg.epilogue_split else cfg.block_n
    return TensorDescriptor(out, list(out.shape), list(out.stride()), [1, cfg.block_m, block_d])


@functools.cache
def _num_programs(device: torch.device) -> int:
    # The interpreter runs programs one after another: a single persistent program keeps the persistent
    # variant's flag waits trivially satisfied there.
    if interpreting() or device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_variant(num_users: int, num_candidates: int, ws_runs: bool = False) -> str:
    """warp_specialized where it runs (`ws_runs`: linear_compress_ws.ws_supported) from B = WS_MIN_CANDIDATES up;
    else persistent (one launch) from B/U = PERSISTENT_MIN_CANDIDATES_PER_USER up and on small batches
    (B ≤ SMALL_BATCH, B/U ≥ 4); else fused (two launches).

    Why (the sweep is in docs/design/lce.md): below WS_MIN_CANDIDATES the warp-specialized kernel's two
    launches cost more host time than its kernel saves. Persistent runs its user phase (U·N/128 tiles of
    depth Ku) ahead of every candidate tile, which pays when each user has many candidates, and on small
    batches one launch instead of two halves the host's share; with few candidates per user fused is faster.
    """
    if ws_runs and num_candidates >= WS_MIN_CANDIDATES:
        return WS_VARIANT
    if num_candidates >= PERSISTENT_MIN_CANDIDATES_PER_USER * num_users:
        return "persistent"
    if num_candidates <= SMALL_BATCH and num_candidates >= 4 * num_users:
        return "persistent"
    return "fused"


# fmt: off
@dataclass(frozen=True)
class PackedLinearCompress:
    """Weights of one LCE layer, packed once at load time.

    user_weight [N, Ku], cand_weight [N, Kc], bias [N] or None (torch path, decomposed); user_weight_padded
    [N, Ku'] and cand_weight_padded [N, Kc'] with K' = max(K, 1) rounded up to 8, zero columns after
    K (the other variants: 16-byte aligned rows for tensor descriptors).
    """

    user_weight: torch.Tensor
    cand_weight: torch.Tensor
    bias: torch.Tensor | None
    user_weight_padded: torch.Tensor
    cand_weight_padded: torch.Tensor
    _flags: dict = field(default_factory=dict, compare=False, repr=False)  # persistent's flags per device, descriptors

    @classmethod
    def from_weight(cls, weight: torch.Tensor, num_user_tokens: int, bias: torch.Tensor | None = None):
        check_tensor("weight", weight, 2, FLOAT_TYPES)
        if not 0 <= num_user_tokens <= weight.shape[1]:
            raise ValueError(f"num_user_tokens: expected in [0, {weight.shape[1]}], got {num_user_tokens}")
        if bias is not None:
            check_tensor("bias", bias, 1, FLOAT_TYPES)
            check_same("bias", bias.shape[0], "N (rows of weight)", weight.shape[0])
        user_weight = weight[:, :num_user_tokens].contiguous()
        cand_weight = weight[:, num_user_tokens:].contiguous()
        return cls(
            user_weight,
            cand_weight,
            None if bias is None else bias.contiguous(),
            _pad_columns(user_weight, K_ALIGN),
            _pad_columns(cand_weight, K_ALIGN),
        )

    def __call__(self, user_emb, cand_emb, cand_to_user, backend: str = "auto", variant: str | None = None):
        """out [B, N, D]; `variant` picks the kernel (VARIANTS or WS_VARIANT; default: the tuned choice, else
        `default_variant`)."""
        check_tensor("user_emb", user_emb, 3, FLOAT_TYPES)
        check_tensor("cand_emb", cand_emb, 3, FLOAT_TYPES)
        num_users, num_user_tokens, dim = user_emb.shape
        num_candidates, num_cand_tokens, cand_dim = cand_emb.shape
        check_same("cand_emb", cand_dim, "D (last dim of user_emb)", dim)
        check_same("user_emb", num_user_tokens, "Ku (user columns of weight)", self.user_weight.shape[1])
        check_same("cand_emb", num_cand_tokens, "Kc (candidate columns of weight)", self.cand_weight.shape[1])
        for name, t in (("cand_emb", cand_emb), ("weight", self.user_weight), ("bias", self.bias)):
            if t is not None and (t.dtype != user_emb.dtype or t.device != user_emb.device):
                raise ValueError(
                    f"{name}: expected {user_emb.dtype} on {user_emb.device} like user_emb, got {t.dtype} on {t.device}"
                )
        check_mapping_shape(cand_to_user, num_candidates, user_emb.device)
        tuned = None  # (variant, TileConfig or None) from configs.set_tuned_configs
        if variant is None:
            dims = (num_user_tokens, num_cand_tokens, self.cand_weight.shape[0], dim)
            tuned = tuned_config("lce", user_emb.device, user_emb.dtype, dims, num_users, num_candidates)
        if tuned is not None:
            variant, config = tuned
        else:
            if variant is None:
                variant = default_variant(num_users, num_candidates, self._ws_runs(user_emb, cand_emb))
            config = None
        _check_variant(variant)
        chosen = resolve_backend(backend, user_emb.device, triton_available=True)
        if chosen == "triton" and backend == "auto" and user_emb.dtype not in TRITON_TYPES:
            chosen = "torch"  # fp64 on CUDA
        if chosen == "triton":
            if user_emb.dtype not in TRITON_TYPES:
                raise ValueError(f"user_emb: the Triton path takes float32/float16/bfloat16, got {user_emb.dtype}")
            if not interpreting() and user_emb.device.type != "cuda":
                raise ValueError(
                    f"user_emb: the Triton path needs CUDA tensors (or TRITON_INTERPRET=1), got {user_emb.device}"
                )
            # Launch first, then wait for the mapping's min and max (copied to the host ahead of the
            # kernels, which clamp bad values), so the device is not idle while the host launches.
            # Not while a CUDA graph is captured (no wait allowed) or without users (no value is valid).
            readback = None
            if user_emb.is_cuda and num_candidates and num_users and not torch.cuda.is_current_stream_capturing():
                readback = HostReadback(torch.stack(torch.aminmax(cand_to_user)))
            else:
                check_mapping(cand_to_user, num_candidates, num_users, user_emb.device)
            out = self._triton(user_emb, cand_emb, cand_to_user, variant, config)
            if readback is not None:
                lowest, highest = readback.values()
                if lowest < 0 or highest >= num_users:
                    check_mapping(cand_to_user, num_candidates, num_users, user_emb.device)  # raises, naming the value
            return out
        check_mapping(cand_to_user, num_candidates, num_users, user_emb.device)
        return _linear_compress_torch(user_emb, cand_emb, cand_to_user, self.user_weight, self.cand_weight, self.bias)

    @staticmethod
    def _ws_runs(user_emb, cand_emb) -> bool:
        """Whether the warp-specialized kernel would run these checked inputs (a Hopper GPU in 16 bit, TMA-able
        rows)."""
        if interpreting() or not cand_emb.is_cuda:
            return False
        from .linear_compress_ws import ws_supported  # Gluon (Hopper); imported on first use

        return ws_supported(user_emb, cand_emb)

    def _triton(
        self, user_emb, cand_emb, cand_to_user, variant: str, config: TileConfig | None = None, out=None, user_part=None
    ):
        """The Triton path for checked inputs.

        `variant` one of VARIANTS or WS_VARIANT; `config` fixes the tile config (benchmarks, tuned configs);
        `out` [B, N, D] and `user_part` [U, N, D] may be given pre-filled (tests poison them with NaN to catch
        unwritten elements).
        """
        _check_variant(variant)
        interpreted = interpreting()
        if config is not None and variant == WS_VARIANT:
            raise ValueError(
                f"config: a TileConfig applies to {VARIANTS}, not {WS_VARIANT} (kernels/linear_compress_ws.py has WSConfig)"
            )
        if config is not None and config.warp_specialize and variant in ("decomposed", "persistent"):
            raise ValueError(f"config: warp specialization applies to aligned and fused, not {variant}")
        if config is not None and config.block_k <= 0:
            raise ValueError(f"config: block_k (the K step) must be positive, got {config.block_k}")
        num_users, num_user_tokens, dim = user_emb.shape
        num_candidates = cand_emb.shape[0]
        rows = self.cand_weight.shape[0]
        if out is None:
            out = torch.empty(num_candidates, rows, dim, dtype=user_emb.dtype, device=user_emb.device)  # [B, N, D]
        if out.numel() == 0:
            return out
        if variant == WS_VARIANT:
            from .linear_compress_ws import launch_ws, ws_supported  # Gluon (Hopper); imported on first use

            if not interpreted and ws_supported(user_emb, cand_emb):
                return launch_ws(self, user_emb, cand_emb, cand_to_user, out=out, user_part=user_part)
            variant = (
                "fused"  # where it does not run: not Hopper, fp32, rows TMA cannot address, Kc = 0, the interpreter
            )
        if user_part is None:
            user_part = torch.empty(
                num_users if num_user_tokens else 0, rows, dim, dtype=out.dtype, device=out.device
            )  # Y_u
        if variant == "persistent" and out.is_cuda and torch.cuda.is_current_stream_capturing():
            variant = "fused"  # the per-call epoch would be frozen into a CUDA graph: take the graph-safe fused
        key = (variant, user_emb.dtype, dim, user_emb.device)
        if config is None and key in _CONFIG_CHOICE:
            self._launch(variant, user_emb, cand_emb, cand_to_user, out, user_part, _CONFIG_CHOICE[key])
            return out
        configs = [config] if config is not None else list(tile_configs(variant, user_emb.dtype, dim))
        for index, cfg in enumerate(configs):
            try:
                self._launch(variant, user_emb, cand_emb, cand_to_user, out, user_part, cfg)
            except triton.runtime.errors.OutOfResources:
                if index == len(configs) - 1:
                    raise
                continue
            if config is None:
                _CONFIG_CHOICE[key] = cfg
            return out

    def _launch(self, variant, user_emb, cand_emb, cand_to_user, out, user_part, cfg: TileConfig):
        num_candidates, rows, dim = out.shape
        has_user = user_emb.shape[1] > 0
        if variant == "persistent":
            self._launch_persistent(user_emb, cand_emb, cand_to_user, out, user_part, cfg)
            return
        padded = variant != "decomposed"
        fuse = variant == "fused"
        if has_user:
            self._launch_tile(
                self.user_weight_padded if padded else self.user_weight, user_emb, user_part, None, False, padded, cfg
            )
        cand_weight = self.cand_weight_padded if padded else self.cand_weight
        self._launch_tile(
            cand_weight, cand_emb, out, (user_part, cand_to_user) if fuse and has_user else None, fuse, padded, cfg
        )
        if not fuse and (has_user or self.bias is not None):
            block = min(4096, triton.next_power_of_2(rows * dim))
            _lce_add_user_kernel[(num_candidates, triton.cdiv(rows * dim, block))](
                out, user_part, cand_to_user, self.bias, rows, dim,
                max(user_part.shape[0], 1),
                HAS_USER=has_user,
                HAS_BIAS=self.bias is not None,
                BLOCK=block,
            )

    def _launch_tile(self, weight, x, out, fused_user, with_bias, tma, cfg: TileConfig):
        """out[g] = weight @ x[g] (+ Y_u[m[g]] when `fused_user` = (Y_u, m)) (+ bias when `with_bias`)."""
        rows, dim, depth = out.shape[1], out.shape[2], x.shape[1]
        w_desc = self._weight_desc(weight, cfg) if tma else None
        x_desc = _activation_desc(x, cfg) if tma else None
        out_desc = (
            _out_desc(out, cfg) if tma and not cfg.warp_specialize else None
        )  # WS splits the tile: pointer stores
        user_part, mapping = fused_user if fused_user is not None else (None, None)
        bias = self.bias if with_bias else None
        grid = (out.shape[0] * triton.cdiv(rows, cfg.block_m) * triton.cdiv(dim, cfg.block_n),)
        _lce_tile_kernel[grid](
            weight,
            w_desc,
            weight.stride(0),
            x,
            x_desc,
            x.stride(0),
            x.stride(1),
            x.stride(2),
            out, out_desc, user_part, mapping, bias, rows, dim, depth,
            max(user_part.shape[0], 1) if user_part is not None else 1,
            BLOCK_M=cfg.block_m, BLOCK_D=cfg.block_n, BLOCK_K=cfg.block_k, W_TMA=tma, X_TMA=x_desc is not None,
            OUT_TMA=out_desc is not None, FUSE_USER=fused_user is not None, HAS_BIAS=bias is not None,
            WARP_SPECIALIZE=cfg.warp_specialize, SPLIT=cfg.epilogue_split, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )

    def _weight_desc(self, weight: torch.Tensor, cfg: TileConfig) -> TensorDescriptor:
        """Descriptor over one of the packed (padded) weights, made once per block shape."""
        key = ("desc", weight.data_ptr(), cfg.block_m, cfg.block_k)
        if key not in self._flags:
            self._flags[key] = TensorDescriptor.from_tensor(weight, [cfg.block_m, cfg.block_k])
        return self._flags[key]

    def _sync_state(self, device: torch.device, num_user_tiles: int):
        """persistent's int64 flags (≥ num_user_tiles entries) on `device`, and this call's epoch.

        Flags are never cleared: epochs only grow, a call waits for flag ≥ its own epoch, so no
        memset runs before the launch. Calls of one module must run in stream order (not on two
        streams at once).
        """
        flags, epoch = self._flags.get(device, (None, 0))
        if flags is None or flags.numel() < num_user_tiles:
            flags = torch.zeros(max(num_user_tiles, 1024), dtype=torch.int64, device=device)
        epoch += 1
        self._flags[device] = (flags, epoch)
        return flags, epoch

    def _launch_persistent(self, user_emb, cand_emb, cand_to_user, out, user_part, cfg: TileConfig):
        num_users, num_user_tokens, dim = user_emb.shape
        num_candidates, num_cand_tokens, _ = cand_emb.shape
        rows = out.shape[1]
        tiles_per_row = triton.cdiv(rows, cfg.block_m) * triton.cdiv(dim, cfg.block_n)
        has_user = num_user_tokens > 0
        flags, epoch = self._sync_state(out.device, num_users * tiles_per_row * has_user)
        wu_desc = self._weight_desc(self.user_weight_padded, cfg)
        wc_desc = self._weight_desc(self.cand_weight_padded, cfg)
        xu_desc = _activation_desc(user_emb, cfg)
        xc_desc = _activation_desc(cand_emb, cfg)
        out_desc = _out_desc(out, cfg)
        num_tiles = (num_users * has_user + num_candidates) * tiles_per_row
        num_programs = min(_num_programs(out.device), num_tiles)
        _lce_persistent_kernel[(num_programs,)](
            wu_desc,
            user_emb,
            xu_desc,
            user_emb.stride(0),
            user_emb.stride(1),
            user_emb.stride(2),
            wc_desc,
            cand_emb,
            xc_desc,
            cand_emb.stride(0),
            cand_emb.stride(1),
            cand_emb.stride(2),
            user_part, out, out_desc, cand_to_user, self.bias, flags, epoch, num_users, num_candidates, rows, dim,
            num_user_tokens, num_cand_tokens, num_programs, BLOCK_M=cfg.block_m, BLOCK_D=cfg.block_n,
            BLOCK_K=cfg.block_k, XU_TMA=xu_desc is not None, XC_TMA=xc_desc is not None, OUT_TMA=out_desc is not None,
            HAS_USER=has_user, HAS_BIAS=self.bias is not None,
            SPIN_ASM=not interpreting(),
            SPLIT=cfg.epilogue_split,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
# fmt: on


def _linear_compress_torch(user_emb, cand_emb, cand_to_user, user_weight, cand_weight, bias):
    """Type I torch path: two GEMMs at natural batch sizes, combined through the mapping."""
    user_part = torch.matmul(user_weight, user_emb)  # [U, N, D]
    cand_part = torch.matmul(cand_weight, cand_emb)  # [B, N, D]
    if bias is not None:
        cand_part = cand_part + bias[:, None]
    return add_user_rows(cand_part, user_part, cand_to_user)


def ikbo_linear_compress(
    user_emb, cand_emb, cand_to_user, weight, bias=None, backend: str = "auto", variant: str | None = None
) -> torch.Tensor:
    """out[b] = weight @ cat(user_emb[m[b]], cand_emb[b]) (+ bias[:, None]) → [B, N, D].

    user_emb [U, Ku, D], cand_emb [B, Kc, D], cand_to_user [B] in [0, U), weight [N, Ku + Kc] (user
    columns first), bias [N] or None. `variant` picks the kernel (VARIANTS or WS_VARIANT). Splits and pads
    `weight` on every call; servers hold a `PackedLinearCompress` instead.
    """
    check_tensor("user_emb", user_emb, 3, FLOAT_TYPES)
    check_tensor("cand_emb", cand_emb, 3, FLOAT_TYPES)
    check_tensor("weight", weight, 2, FLOAT_TYPES)
    check_same("weight", weight.shape[1], "Ku + Kc (user + candidate tokens)", user_emb.shape[1] + cand_emb.shape[1])
    packed = PackedLinearCompress.from_weight(weight, user_emb.shape[1], bias)
    return packed(user_emb, cand_emb, cand_to_user, backend=backend, variant=variant)
