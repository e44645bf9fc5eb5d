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
Autograd: `ikbo_linear_compress` and `PackedLinearCompress` check shapes, dtypes and devices on the host, then
call the custom op `ikbo::linear_compress` (torch.library, with a fake implementation for torch.compile and
torch.export); everything that reads device values or picks a kernel runs inside it. An eager call that autograd
will not differentiate (no tracing, no dispatch mode) runs the op's implementation without the dispatcher. Its backward,
`ikbo::linear_compress_backward`, reduces where the forward broadcasts. With g = dout [B, N, D]:
    d_cand[b] = W_cᵀ g[b]                 the forward's batched shared-weight GEMM, weight W_cᵀ
    dY_u[u] = Σ_{b: m[b]=u} g[b]          a device sort of the mapping + a segment sum: one pass over g
    d_user[u] = W_uᵀ dY_u[u]              the same GEMM at U rows
    dW_c = Σ_b g[b] cand_emb[b]ᵀ          a split-K GEMM over (b, d) into fp32 partials + their reduction
    dW_u = Σ_u dY_u[u] user_emb[u]ᵀ       the same at U rows
    d_bias = Σ_{u,d} dY_u[u, :, d]
No tensor holds user data at B rows, forward or backward; the torch path sums with index_add. An eager CUDA call
does not wait for the device: the mapping's range reaches the host later and is checked then
(`_common.check_mapping_values`).
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
    DEFERRED,
    HostFlag,
    add_user_rows,
    autocast_inputs,
    backward_call,
    check_mapping_shape,
    check_mapping_values,
    check_same,
    check_tensor,
    eager_function,
    functorch_function,
    poll_deferred,
    raise_bad_mapping,
    resolve_backend,
    route,
    tma_ok,
)
from ._interpreter import interpreting
from ._launch import NOW, CachedLaunch, Recording, call, fail, launch, named, remember, replayable
from .configs import TileConfig, tuned_config, tuned_version

FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
TRITON_TYPES = (torch.float32, torch.float16, torch.bfloat16)
VARIANTS = ("decomposed", "aligned", "fused", "persistent")  # the Triton kernels of this file
WS_VARIANT = "warp_specialized"  # Gluon (kernels/linear_compress_ws.py): where ws_supported, else fused
_CONFIG_CHOICE: dict = {}  # (variant, dtype, D, device) → the first config of tile_configs that launched
PERSISTENT_MIN_CANDIDATES_PER_USER = 32  # default_variant: persistent from B/U ≥ 32
SMALL_BATCH = 256  # at most this many candidates: persistent from B/U ≥ 4 (one launch, less host time)
WS_MIN_CANDIDATES = 256  # default_variant: warp_specialized from this B up, where it runs
K_ALIGN = 8  # weight columns padded to a multiple of this at pack time (16 bytes in 16-bit types)
# backward: the user sums dY_u in the dW_c pass (dout read once for both) instead of a segment-sum pass apart. Off:
# on the H200 at the canonical shape the fused pass (narrower K step) takes 0.536 ms against 0.197 ms for dW_c alone
# plus 0.142 ms for the sort, the segment sum and the W_uᵀ GEMM (docs/results.md)
FUSE_USER_SUMS = False
# backward, user sums apart: up to this many users dY_u = S·dout with S the [U, B] one-hot selection matrix, one GEMM
# that reads dout once at memory speed and needs no sort; beyond, its U·B·N·D products outgrow the read, and a sort
# plus a segment sum (`_user_grad_sum_kernel`) adds each row once
SELECTION_MAX_USERS = 64
FUSED_SPLIT_ROWS = 64  # rows per split of that pass at most: the split's candidate ids stay in registers


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


# ----------------------------------------------------------------------------- kernels: forward


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


_lce_tile_launch = CachedLaunch(_lce_tile_kernel)


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


_lce_add_user_launch = CachedLaunch(_lce_add_user_kernel)


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


_lce_persistent_launch = CachedLaunch(_lce_persistent_kernel)


# ----------------------------------------------------------------------------- kernels: backward


@triton.jit(do_not_specialize=["U", "B", "STEPS"])
def _user_offsets_kernel(sorted_ptr, offsets_ptr, U, B, STEPS, BLOCK: tl.constexpr):
    """offsets[u] = how many sorted mapping values lie below u, for 0 < u < U; offsets[0] = 0, offsets[U] = B. User
    u's candidates sit at sorted positions [offsets[u], offsets[u + 1]); a value below 0 falls into user 0's range
    and one ≥ U into user U - 1's (the forward's clamp). A binary search per user, STEPS ≥ log2(B + 1) halvings."""
    u = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    lo = tl.zeros([BLOCK], dtype=tl.int32)
    hi = tl.zeros([BLOCK], dtype=tl.int32) + B
    for _ in tl.range(0, STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        below = tl.load(sorted_ptr + mid, mask=active, other=0) < u
        lo = tl.where(active & below, mid + 1, lo)
        hi = tl.where(active & ~below, mid, hi)
    offsets = tl.where(u == 0, 0, tl.where(u >= U, B, lo))
    tl.store(offsets_ptr + u, offsets, mask=u <= U)


_user_offsets_launch = CachedLaunch(_user_offsets_kernel)


@triton.jit
def _user_grad_sum_kernel(g_ptr, order_ptr, offsets_ptr, sums_ptr, ND, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """sums[u, cols] = Σ g[order[i], cols] over i in [offsets[u], offsets[u + 1]), accumulated in fp32: the user
    gradients dY_u in one pass over dout (g [B, N·D] and sums [U, N·D], contiguous). A program owns one user and
    BLOCK columns and adds ROWS of its candidates a step, always in the same order (deterministic, no atomics); a
    user without candidates gets zeros."""
    u = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_mask = cols < ND
    start = tl.load(offsets_ptr + u)
    end = tl.load(offsets_ptr + u + 1)
    acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for i in tl.range(start, end, ROWS):
        pos = i + tl.arange(0, ROWS)
        row_mask = pos < end
        rows = tl.load(order_ptr + pos, mask=row_mask, other=0).to(tl.int64)
        mask = row_mask[:, None] & col_mask[None, :]
        acc += tl.load(g_ptr + rows[:, None] * ND + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    total = tl.sum(acc, axis=0).to(sums_ptr.dtype.element_ty)
    tl.store(sums_ptr + u.to(tl.int64) * ND + cols, total, mask=col_mask)


_user_grad_sum_launch = CachedLaunch(_user_grad_sum_kernel)


# fmt: off
@triton.jit
def _weight_grad_operands(
    a_ptr, a_desc, stride_ag, stride_am, stride_ad, x_ptr, x_desc, stride_xg, stride_xk, stride_xd, g, d, off_m,
    off_k, M, K, D, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, A_TMA: tl.constexpr,
    X_TMA: tl.constexpr,
):
    """(A[g, off_m:, d:] [BLOCK_M, BLOCK_D], X[g, off_k:, d:] [BLOCK_N, BLOCK_D]); entries out of range are zeros."""
    rd = d + tl.arange(0, BLOCK_D)
    if A_TMA:
        a = a_desc.load([g, off_m, d]).reshape(BLOCK_M, BLOCK_D)  # rows ≥ M and columns ≥ D: zero fill
    else:
        rm = off_m + tl.arange(0, BLOCK_M)
        a_offsets = g.to(tl.int64) * stride_ag + rm[:, None] * stride_am + rd[None, :] * stride_ad
        a = tl.load(a_ptr + a_offsets, mask=(rm < M)[:, None] & (rd < D)[None, :], other=0.0)
    if X_TMA:
        x = x_desc.load([g, off_k, d]).reshape(BLOCK_N, BLOCK_D)
    else:
        rk = off_k + tl.arange(0, BLOCK_N)
        x_offsets = g.to(tl.int64) * stride_xg + rk[:, None] * stride_xk + rd[None, :] * stride_xd
        x = tl.load(x_ptr + x_offsets, mask=(rk < K)[:, None] & (rd < D)[None, :], other=0.0)
    return a, x
# fmt: on


# fmt: off
@triton.jit
def _store_user_sum(
    total, sums_ptr, slots_ptr, offsets_ptr, user, first, last, split, off_m, d, M, D, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Store the sum [BLOCK_M, BLOCK_D] (rows off_m.. of M, columns d.. of D) of user `user`'s rows in the split of
    sorted rows [first, last): into sums[user] where all of the user's rows lie in the split; else into the split's
    slot 1 where the user continues after it, slot 0 where it began before (`_user_sum_fixup_kernel` adds them)."""
    rm = off_m + tl.arange(0, BLOCK_M)
    rd = d + tl.arange(0, BLOCK_D)
    mask = (rm < M)[:, None] & (rd < D)[None, :]
    tile = rm[:, None] * D + rd[None, :]
    user_end = tl.load(offsets_ptr + user + 1)
    if (tl.load(offsets_ptr + user) >= first) & (user_end <= last):
        tl.store(sums_ptr + user.to(tl.int64) * M * D + tile, total.to(sums_ptr.dtype.element_ty), mask=mask)
    else:
        slot = split * 2 + (user_end > last).to(tl.int32)
        tl.store(slots_ptr + slot.to(tl.int64) * M * D + tile, total, mask=mask)
# fmt: on


# fmt: off
@triton.jit(do_not_specialize=["G", "ROWS_PER_SPLIT", "U"])
def _lce_weight_grad_kernel(
    a_ptr, a_desc, stride_ag, stride_am, stride_ad,  # A [G, M, D]: dout (dW_c) or the user gradients dY_u (dW_u)
    x_ptr, x_desc, stride_xg, stride_xk, stride_xd,  # X [G, K, D]: cand_emb (dW_c) or user_emb (dW_u)
    part_ptr,  # [splits, M, K] fp32, contiguous: one partial sum per split
    order_ptr, users_ptr, offsets_ptr, sums_ptr, slots_ptr,  # FUSE_SUMS: see below
    G, M, K, D, ROWS_PER_SPLIT, U, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    A_TMA: tl.constexpr, X_TMA: tl.constexpr, FUSE_SUMS: tl.constexpr, MAX_ROWS: tl.constexpr,
):
    """part[s, off_m:, off_k:] = Σ over rows g of split s of A[g, off_m:, :] @ X[g, off_k:, :]ᵀ, in fp32: one
    [BLOCK_M, BLOCK_N] tile of a weight gradient Σ_g A[g] X[g]ᵀ, whose reduction runs over (g, d). Split-K over g:
    the output has few tiles (16 at N = 512, Kc = 500), so splits × tiles programs fill the SMs. The (g, d) steps
    run as one flat loop, so loads pipeline across rows. Both operands are K-major (D contiguous): A tile
    [BLOCK_M, BLOCK_D], X tile [BLOCK_N, BLOCK_D] used transposed. Programs of one split are numbered together
    (tiles fastest), so they read the same rows of A and X from L2 at about the same time.

    FUSE_SUMS (dW_c): the rows are candidates in user order (order [G] sorts them, users [G] are the sorted mapping
    values, offsets [U + 1] each user's range: `_user_ranges`), the steps run d-outer, and during D chunk j the
    programs of weight-column tile j mod (column tiles) also add the A tiles they load into the user sums
    dY_u = Σ_{b: m[b]=u} dout[b], one [BLOCK_M, BLOCK_D] segment at a time, stored when the user changes
    (`_store_user_sum`: sums [U, M, D], slots [splits, 2, M, D] fp32 for users that cross a split). dout is then read
    once for both, and the extra work is spread over every program. A split has at most MAX_ROWS rows here."""
    num_m_tiles = tl.cdiv(M, BLOCK_M)
    num_tiles = num_m_tiles * tl.cdiv(K, BLOCK_N)
    tile = tl.program_id(0) % num_tiles
    split = tl.program_id(0) // num_tiles
    off_m = (tile % num_m_tiles) * BLOCK_M
    off_k = (tile // num_m_tiles) * BLOCK_N
    first = split * ROWS_PER_SPLIT
    rows = tl.minimum(G - first, ROWS_PER_SPLIT)
    steps_per_row = tl.cdiv(D, BLOCK_D)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FUSE_SUMS:
        last = first + rows
        num_k_tiles = num_tiles // num_m_tiles
        segment = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        # The split's candidate ids in registers: a row id loaded inside the loop would keep Triton from pipelining
        # the TMA loads it addresses (ROWS_PER_SPLIT ≤ MAX_ROWS).
        positions = tl.arange(0, MAX_ROWS)
        order = tl.load(order_ptr + first + positions, mask=positions < rows, other=0).to(tl.int32)
        for step in tl.range(0, rows * steps_per_row):
            row = first + step % rows
            d = (step // rows) * BLOCK_D
            candidate = tl.sum(tl.where(positions == step % rows, order, 0))
            a, x = _weight_grad_operands(
                a_ptr, a_desc, stride_ag, stride_am, stride_ad, x_ptr, x_desc, stride_xg, stride_xk, stride_xd,
                candidate, d, off_m, off_k, M, K, D, BLOCK_M, BLOCK_N, BLOCK_D, A_TMA, X_TMA,
            )
            acc = tl.dot(a, x.T, acc)
            if (step // rows) % num_k_tiles == off_k // BLOCK_N:  # d-chunk j's sums: the programs of column tile j % n
                segment += a.to(tl.float32)
                user = tl.minimum(tl.maximum(tl.load(users_ptr + row), 0), U - 1)  # clamped, as `_user_ranges`
                following = tl.load(users_ptr + row + 1, mask=row + 1 < last, other=0)
                if (row + 1 == last) | (tl.minimum(tl.maximum(following, 0), U - 1) != user):
                    _store_user_sum(
                        segment, sums_ptr, slots_ptr, offsets_ptr, user, first, last, split, off_m, d, M, D, BLOCK_M,
                        BLOCK_D,
                    )
                    segment = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    else:
        for step in tl.range(0, rows * steps_per_row):
            a, x = _weight_grad_operands(
                a_ptr, a_desc, stride_ag, stride_am, stride_ad, x_ptr, x_desc, stride_xg, stride_xk, stride_xd,
                first + step // steps_per_row, (step % steps_per_row) * BLOCK_D, off_m, off_k, M, K, D, BLOCK_M,
                BLOCK_N, BLOCK_D, A_TMA, X_TMA,
            )
            acc = tl.dot(a, x.T, acc)
    rm = off_m + tl.arange(0, BLOCK_M)
    rk = off_k + tl.arange(0, BLOCK_N)
    part = part_ptr + split.to(tl.int64) * M * K
    tl.store(part + rm[:, None] * K + rk[None, :], acc, mask=(rm < M)[:, None] & (rk < K)[None, :])
# fmt: on


_lce_weight_grad_launch = CachedLaunch(_lce_weight_grad_kernel)


@triton.jit
def _user_sum_fixup_kernel(slots_ptr, sums_ptr, offsets_ptr, ROWS_PER_SPLIT, ND, BLOCK: tl.constexpr):
    """The user sums the fused weight-gradient kernel leaves: zeros for a user without candidates; for a user whose
    sorted rows span splits s0 … s1, slot 1 of s0 … s1 - 1 plus slot 0 of s1, added in that order (deterministic).
    slots [splits, 2, N·D] fp32, sums [U, N·D], contiguous; one program per (user, BLOCK columns)."""
    u = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < ND
    start = tl.load(offsets_ptr + u)
    end = tl.load(offsets_ptr + u + 1)
    first_split = start // ROWS_PER_SPLIT
    last_split = (end - 1) // ROWS_PER_SPLIT
    out = sums_ptr + u.to(tl.int64) * ND + cols
    if end == start:
        tl.store(out, tl.zeros([BLOCK], dtype=tl.float32).to(sums_ptr.dtype.element_ty), mask=mask)
    elif first_split != last_split:
        total = tl.zeros([BLOCK], dtype=tl.float32)
        slot = slots_ptr + (first_split * 2 + 1).to(tl.int64) * ND + cols  # slot 1 of the first split
        for _ in tl.range(first_split, last_split):
            total += tl.load(slot, mask=mask, other=0.0)
            slot += 2 * ND  # slot 1 of the next split
        total += tl.load(slot - ND, mask=mask, other=0.0)  # slot 0 of the last split
        tl.store(out, total.to(sums_ptr.dtype.element_ty), mask=mask)


_user_sum_fixup_launch = CachedLaunch(_user_sum_fixup_kernel)


@triton.jit
def _split_sum_kernel(part_ptr, out_ptr, SPLITS, NUMEL, BLOCK: tl.constexpr):
    """out[i] = Σ_s part[s, i] in fp32, cast to out's dtype: the split-K reduction of a weight gradient, in a fixed
    order (deterministic). part [SPLITS, NUMEL] fp32, out [NUMEL], contiguous."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < NUMEL
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    ptrs = part_ptr + offsets
    for _ in tl.range(0, SPLITS):
        acc += tl.load(ptrs, mask=mask, other=0.0)
        ptrs += NUMEL  # pointer arithmetic is 64-bit: no int32 overflow past 2³¹ elements
    tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)


_split_sum_launch = CachedLaunch(_split_sum_kernel)


# ----------------------------------------------------------------------------- host side: forward


def _pad_columns(weight: torch.Tensor, multiple: int) -> torch.Tensor:
    """weight [N, K] (any strides) → a contiguous [N, K'] tensor with K' = max(K, 1) rounded up to `multiple`; new
    columns are zeros. Where K' = K: `weight.contiguous()` (one copy launch, none for a contiguous weight)."""
    cols = triton.cdiv(max(weight.shape[1], 1), multiple) * multiple
    if cols == weight.shape[1]:
        return weight.contiguous()
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


def _launch_first_fitting(key, configs, launch) -> None:
    """Launch with the first of `configs` (an iterable, read only where `key` has no remembered config) that fits
    (shared memory decides) and remember it under `key`; a remembered config launches at once. `key` None remembers
    nothing (a config the caller fixed). Raises the last OutOfResources where none fits."""
    if key is not None and key in _CONFIG_CHOICE:
        launch(_CONFIG_CHOICE[key])
        return
    error = None
    for cfg in configs:
        try:
            launch(cfg)
        except triton.runtime.errors.OutOfResources as exc:
            error = exc
            continue
        if key is not None:
            _CONFIG_CHOICE[key] = cfg
        return
    raise error


# fmt: off
def _launch_tile(weight, w_desc, x, out, fused_user, bias, cfg: TileConfig) -> None:
    """out[g] = weight @ x[g] (+ Y_u[m[g]] when `fused_user` = (Y_u, m)) (+ bias) through `_lce_tile_kernel`.
    `w_desc`: a descriptor over the K-padded weight (x and out then move by TMA where they can), or None (pointer
    loads of the unpadded weight). out [G, M, D] contiguous."""
    tma = w_desc is not None
    rows, dim, depth = out.shape[1], out.shape[2], x.shape[1]
    x_desc = _activation_desc(x, cfg) if tma else None
    out_desc = _out_desc(out, cfg) if tma and not cfg.warp_specialize else None  # WS splits the tile: pointer stores
    user_part, mapping = fused_user if fused_user is not None else (None, None)
    grid = (out.shape[0] * triton.cdiv(rows, cfg.block_m) * triton.cdiv(dim, cfg.block_n),)
    _lce_tile_launch[grid](
        weight, w_desc, weight.stride(0), x, x_desc, x.stride(0), x.stride(1), x.stride(2), out, out_desc, user_part,
        mapping, bias, rows, dim, depth, max(user_part.shape[0], 1) if user_part is not None else 1,
        BLOCK_M=cfg.block_m, BLOCK_D=cfg.block_n, BLOCK_K=cfg.block_k, W_TMA=tma, X_TMA=x_desc is not None,
        OUT_TMA=out_desc is not None, FUSE_USER=fused_user is not None, HAS_BIAS=bias is not None,
        WARP_SPECIALIZE=cfg.warp_specialize, SPLIT=cfg.epilogue_split, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
# fmt: on


_PERSISTENT_STATE: dict = {}  # (device, stream) → persistent's int64 flags and the last call's epoch


def _persistent_state(device: torch.device, num_user_tiles: int):
    """persistent's int64 flags (≥ num_user_tiles entries) for the current stream of `device`, and this call's epoch.

    Flags are never cleared: epochs only grow and a call waits for flag ≥ its own epoch, so no memset runs before
    the launch. The protocol needs the calls that share flags to run in order: one set per stream does that.
    """
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    flags, epoch = _PERSISTENT_STATE.get((device, stream), (None, 0))
    if flags is None or flags.numel() < num_user_tiles:
        flags = torch.zeros(max(num_user_tiles, 1024), dtype=torch.int64, device=device)
    epoch += 1
    _PERSISTENT_STATE[(device, stream)] = (flags, epoch)
    return flags, epoch


def _ws_runs(user_emb, cand_emb) -> bool:
    """Whether the warp-specialized kernel would run these checked inputs (a Hopper GPU in 16 bit, TMA-able rows)."""
    if interpreting() or not cand_emb.is_cuda:
        return False
    from .linear_compress_ws import ws_supported  # Gluon (Hopper); imported on first use

    return ws_supported(user_emb, cand_emb)


# fmt: off
@dataclass(frozen=True)
class PackedWeights:
    """The weights of one LCE call as its kernels take them: user_weight [N, Ku] and cand_weight [N, Kc] (unit
    column stride), bias [N] or None (the torch path, decomposed); user_weight_padded [N, Ku'] and
    cand_weight_padded [N, Kc'] with K' = max(K, 1) rounded up to K_ALIGN, zero columns after K (the other variants:
    16-byte aligned rows for tensor descriptors). Plain tensors, no autograd: the op has its own backward.
    """

    user_weight: torch.Tensor
    cand_weight: torch.Tensor
    bias: torch.Tensor | None
    user_weight_padded: torch.Tensor
    cand_weight_padded: torch.Tensor
    _flags: dict = field(default_factory=dict, compare=False, repr=False)  # weight descriptors per block shape

    @classmethod
    def of(cls, user_weight, cand_weight, bias=None, user_weight_padded=None, cand_weight_padded=None):
        """From weights of any strides; pads the ones not given."""
        user_weight = user_weight if user_weight.stride(-1) == 1 else user_weight.contiguous()
        cand_weight = cand_weight if cand_weight.stride(-1) == 1 else cand_weight.contiguous()
        return cls(
            user_weight, cand_weight, bias,
            _pad_columns(user_weight, K_ALIGN) if user_weight_padded is None else user_weight_padded,
            _pad_columns(cand_weight, K_ALIGN) if cand_weight_padded is None else cand_weight_padded,
        )

    def _triton(
        self, user_emb, cand_emb, cand_to_user, variant: str, config: TileConfig | None = None, out=None, user_part=None,
        recording=None,
    ):  # fmt: skip
        """The Triton path for checked inputs.

        `variant` one of VARIANTS or WS_VARIANT; `config` fixes the tile config (benchmarks, tuned configs);
        `out` [B, N, D] and `user_part` [U, N, D] may be given pre-filled (tests poison them with NaN to catch
        unwritten elements); with `recording` the warp-specialized path's steps are kept for replay (kernels._launch;
        the other variants are not recorded).
        """
        _check_variant(variant)
        if config is not None and variant == WS_VARIANT:
            raise ValueError(
                f"config: a TileConfig applies to {VARIANTS}, not {WS_VARIANT} (kernels/linear_compress_ws.py has WSConfig)"
            )
        if config is not None and config.warp_specialize and variant in ("decomposed", "persistent"):
            raise ValueError(f"config: warp specialization applies to aligned and fused, not {variant}")
        if config is not None and config.block_k <= 0:
            raise ValueError(f"config: block_k (the K step) must be positive, got {config.block_k}")
        num_users, num_user_tokens, dim = user_emb.shape
        rows = self.cand_weight.shape[0]
        if out is None:
            out = torch.empty(cand_emb.shape[0], rows, dim, dtype=user_emb.dtype, device=user_emb.device)  # [B, N, D]
            named(recording, "out", out)
        if out.numel() == 0:
            fail(recording)
            return out
        if variant == WS_VARIANT:
            from .linear_compress_ws import launch_ws  # Gluon (Hopper); imported on first use

            if _ws_runs(user_emb, cand_emb):
                return launch_ws(self, user_emb, cand_emb, cand_to_user, out=out, user_part=user_part, recording=recording)
            variant = "fused"  # where it does not run: not Hopper, fp32, rows TMA cannot address, Kc = 0, the interpreter
        fail(recording)
        if user_part is None:
            user_part = torch.empty(num_users if num_user_tokens else 0, rows, dim, dtype=out.dtype, device=out.device)
        if variant == "persistent" and out.is_cuda and torch.cuda.is_current_stream_capturing():
            variant = "fused"  # the per-call epoch would be frozen into a CUDA graph: take the graph-safe fused
        configs = [config] if config is not None else tile_configs(variant, user_emb.dtype, dim)
        key = None if config is not None else (variant, user_emb.dtype, dim, user_emb.device)
        _launch_first_fitting(
            key, configs, lambda cfg: self._launch(variant, user_emb, cand_emb, cand_to_user, out, user_part, cfg)
        )
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
            weight = self.user_weight_padded if padded else self.user_weight
            _launch_tile(weight, self._weight_desc(weight, cfg) if padded else None, user_emb, user_part, None, None, cfg)
        weight = self.cand_weight_padded if padded else self.cand_weight
        fused_user = (user_part, cand_to_user) if fuse and has_user else None
        w_desc = self._weight_desc(weight, cfg) if padded else None
        _launch_tile(weight, w_desc, cand_emb, out, fused_user, self.bias if fuse else None, cfg)
        if not fuse and (has_user or self.bias is not None):
            block = min(4096, triton.next_power_of_2(rows * dim))
            _lce_add_user_launch[(num_candidates, triton.cdiv(rows * dim, block))](
                out, user_part, cand_to_user, self.bias, rows, dim, max(user_part.shape[0], 1), HAS_USER=has_user,
                HAS_BIAS=self.bias is not None, BLOCK=block,
            )

    def _weight_desc(self, weight: torch.Tensor, cfg: TileConfig) -> TensorDescriptor:
        """Descriptor over one of the packed (padded) weights, made once per block shape."""
        key = ("desc", weight.data_ptr(), cfg.block_m, cfg.block_k)
        if key not in self._flags:
            self._flags[key] = TensorDescriptor.from_tensor(weight, [cfg.block_m, cfg.block_k])
        return self._flags[key]

    def _launch_persistent(self, user_emb, cand_emb, cand_to_user, out, user_part, cfg: TileConfig):
        num_users, num_user_tokens, dim = user_emb.shape
        num_candidates, num_cand_tokens, _ = cand_emb.shape
        rows = out.shape[1]
        tiles_per_row = triton.cdiv(rows, cfg.block_m) * triton.cdiv(dim, cfg.block_n)
        has_user = num_user_tokens > 0
        flags, epoch = _persistent_state(out.device, num_users * tiles_per_row * has_user)
        wu_desc = self._weight_desc(self.user_weight_padded, cfg)
        wc_desc = self._weight_desc(self.cand_weight_padded, cfg)
        xu_desc = _activation_desc(user_emb, cfg)
        xc_desc = _activation_desc(cand_emb, cfg)
        out_desc = _out_desc(out, cfg)
        num_tiles = (num_users * has_user + num_candidates) * tiles_per_row
        num_programs = min(_num_programs(out.device), num_tiles)
        _lce_persistent_launch[(num_programs,)](
            wu_desc, user_emb, xu_desc, user_emb.stride(0), user_emb.stride(1), user_emb.stride(2),
            wc_desc, cand_emb, xc_desc, cand_emb.stride(0), cand_emb.stride(1), cand_emb.stride(2),
            user_part, out, out_desc, cand_to_user, self.bias, flags, epoch, num_users, num_candidates, rows, dim,
            num_user_tokens, num_cand_tokens, num_programs, BLOCK_M=cfg.block_m, BLOCK_D=cfg.block_n,
            BLOCK_K=cfg.block_k, XU_TMA=xu_desc is not None, XC_TMA=xc_desc is not None, OUT_TMA=out_desc is not None,
            HAS_USER=has_user, HAS_BIAS=self.bias is not None, SPIN_ASM=not interpreting(), SPLIT=cfg.epilogue_split,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
# fmt: on


def _linear_compress_torch(user_emb, cand_emb, cand_to_user, user_weight, cand_weight, bias):
    """Type I torch path: two GEMMs at natural batch sizes, combined through the mapping."""
    user_part = torch.matmul(user_weight, user_emb)  # [U, N, D]
    cand_part = torch.matmul(cand_weight, cand_emb)  # [B, N, D]
    if bias is not None:
        cand_part = cand_part + bias[:, None]
    return add_user_rows(cand_part, user_part, cand_to_user)


def _resolve(backend: str, user_emb: torch.Tensor) -> str:
    """The path for checked inputs, "torch" or "triton" ("auto": Triton on CUDA except fp64); ValueError for a Triton
    request that cannot run. Reads no device values."""
    chosen = resolve_backend(backend, user_emb.device, triton_available=True)
    if chosen == "triton" and backend == "auto" and user_emb.dtype not in TRITON_TYPES:
        return "torch"  # fp64 on CUDA
    if chosen == "triton":
        if user_emb.dtype not in TRITON_TYPES:
            raise ValueError(f"user_emb: the Triton path takes float32/float16/bfloat16, got {user_emb.dtype}")
        if not interpreting() and user_emb.device.type != "cuda":
            raise ValueError(
                f"user_emb: the Triton path needs CUDA tensors (or TRITON_INTERPRET=1), got {user_emb.device}"
            )
    return chosen


def _choose_variant(user_emb, cand_emb, rows: int, variant: str | None):
    """(variant, TileConfig or None): the caller's variant, else the tuner's choice for this (U, B), else
    `default_variant`."""
    if variant is not None:
        return variant, None
    num_users, num_user_tokens, dim = user_emb.shape
    num_candidates, num_cand_tokens, _ = cand_emb.shape
    dims = (num_user_tokens, num_cand_tokens, rows, dim)
    tuned = tuned_config("lce", user_emb.device, user_emb.dtype, dims, num_users, num_candidates)
    if tuned is not None:
        return tuned
    return default_variant(num_users, num_candidates, _ws_runs(user_emb, cand_emb)), None


# fmt: off
def _linear_compress(
    user_emb, cand_emb, cand_to_user, user_weight, cand_weight, bias, user_weight_padded, cand_weight_padded, backend,
    variant,
) -> torch.Tensor:
    """`ikbo::linear_compress` for checked inputs: the backend, variant and mapping check, then the launches.

    An eager CUDA call does not wait for the device: the mapping's [min, max] is copied to the host ahead of the
    kernels (which clamp bad values) and checked once it has arrived (`check_mapping_values`: at a later IKBO call,
    at `check_deferred()`, or at once in strict mode). Inside a CUDA-graph capture nothing is checked (the caller
    checks before each replay); the CPU checks at once.
    """
    poll_deferred()
    inputs = dict(
        user_emb=user_emb, cand_emb=cand_emb, cand_to_user=cand_to_user, user_weight=user_weight,
        cand_weight=cand_weight, bias=bias, user_weight_padded=user_weight_padded,
        cand_weight_padded=cand_weight_padded,
    )  # fmt: skip
    key = recording = None
    if _replays_here(user_emb, cand_emb):
        key = (*(None if t is None else (t.shape, t.stride(), t.data_ptr() % 16) for t in inputs.values()),
               user_emb.dtype, user_emb.device, backend, variant, tuned_version())  # fmt: skip
        replay = _REPLAYS.get(key)
        if replay is not None:
            flag = HostFlag(user_emb.device)
            made = replay(flag.stream, user_emb.device, {**inputs, "host_flag": flag.address})
            if made is not None:
                DEFERRED.defer(flag, functools.partial(raise_bad_mapping, cand_to_user, user_emb.shape[0]))
                return made["out"]
        recording = Recording(**inputs)
    check_mapping_values(cand_to_user, user_emb.shape[0], recording)
    if _resolve(backend, user_emb) == "torch":
        return _linear_compress_torch(user_emb, cand_emb, cand_to_user, user_weight, cand_weight, bias)
    weights = PackedWeights.of(user_weight, cand_weight, bias, user_weight_padded, cand_weight_padded)
    variant, config = _choose_variant(user_emb, cand_emb, cand_weight.shape[0], variant)
    out = weights._triton(user_emb, cand_emb, cand_to_user, variant, config, recording=recording)
    replay = None if recording is None or "out" not in recording.fresh else recording.replay()
    if replay is not None:
        remember(_REPLAYS, key, replay)
    return out


_REPLAYS: dict = {}  # call signature → the Replay of `_linear_compress`'s recorded path (kernels._launch)


def _replays_here(user_emb, cand_emb) -> bool:
    """Whether this eager call may replay (or record) its path: CUDA on the current device, not inside a graph
    capture, candidates and users present."""
    return (
        user_emb.is_cuda
        and replayable()
        and cand_emb.shape[0] > 0
        and user_emb.shape[0] > 0
        and user_emb.device.index == torch.cuda.current_device()
        and not torch.cuda.is_current_stream_capturing()
    )
# fmt: on


# ----------------------------------------------------------------------------- host side: backward


def _linear_compress_backward_torch(grad_out, user_emb, cand_emb, cand_to_user, user_weight, cand_weight, needs):
    """(d_user_emb, d_cand_emb, d_user_weight, d_cand_weight, d_bias), None where `needs` says no, in plain torch ops.
    The user gradients come from the segment sums dY_u = index_add over dout's rows (16-bit inputs summed in fp32):
    no tensor holds user data at B rows."""
    need_user, need_cand, need_user_weight, need_cand_weight, need_bias = needs
    num_users = user_emb.shape[0]
    user_sums = None  # dY_u [U, N, D]
    if need_user or need_user_weight:
        compute = torch.float32 if grad_out.dtype in (torch.float16, torch.bfloat16) else grad_out.dtype
        sums = grad_out.new_zeros((num_users, *grad_out.shape[1:]), dtype=compute)
        user_sums = sums.index_add_(0, cand_to_user, grad_out.to(compute)).to(grad_out.dtype)
    return (
        torch.matmul(user_weight.t(), user_sums) if need_user else None,  # [U, Ku, D]
        torch.matmul(cand_weight.t(), grad_out) if need_cand else None,  # [B, Kc, D]
        torch.einsum("und,ukd->nk", user_sums, user_emb) if need_user_weight else None,  # [N, Ku]
        torch.einsum("bnd,bkd->nk", grad_out, cand_emb) if need_cand_weight else None,  # [N, Kc]
        (grad_out if user_sums is None else user_sums).sum((0, 2)) if need_bias else None,  # [N]
    )


def weight_grad_configs(dtype: torch.dtype, dim: int, fused: bool = False):
    """TileConfigs of `_lce_weight_grad_kernel` to try, best first: block_m rows of N × block_n weight columns per
    tile, block_k the step along D (128 bytes; 64 with the fused user sums, whose [block_m, block_k] fp32 segment
    and register copy of the dout tile would spill at 128 × 256 × 64). Shared memory at 128 × 256 × 64, bf16:
    48 KiB a stage."""
    if interpreting():
        yield TileConfig(16, 16, 16, num_warps=4, num_stages=1)
        return
    step_bytes = 64 if fused else 128
    block_d = max(16, min(step_bytes // (torch.finfo(dtype).bits // 8), triton.next_power_of_2(dim)))
    yield TileConfig(128, 256, block_d, num_warps=8, num_stages=4)
    yield TileConfig(128, 256, block_d, num_warps=8, num_stages=3)
    yield TileConfig(128, 128, block_d, num_warps=8, num_stages=4)
    yield TileConfig(64, 128, block_d, num_warps=4, num_stages=2)


def _operand_desc(t: torch.Tensor, block_rows: int, block_d: int, bind=NOW):
    """Descriptor over t [G, R, D] with [1, block_rows, block_d] blocks, or None (pointer loads)."""
    if not tma_ok(t):
        return None
    return bind.desc(TensorDescriptor, t, t.shape, t.stride(), [1, block_rows, block_d])


# fmt: off
def _weight_grad(
    a, x, out, splits: int | None = None, config: TileConfig | None = None, user_sums=None,
    recording: Recording | None = None, name: str = "dW",
) -> torch.Tensor:
    """out [M, K] = Σ_g a[g] @ x[g]ᵀ for a [G, M, D], x [G, K, D] (a weight gradient): `_lce_weight_grad_kernel`
    split-K over g into fp32 partials, then `_split_sum_kernel`. `splits` fixes the number of splits (tests), else
    there are about as many programs as SMs. out contiguous. With `recording` the launches are kept for replay
    (kernels._launch), the partials named `name` + "_part".

    `user_sums` = (cand_to_user, sums [U, M, D]) for dW_c (a = dout): the same pass also writes the user sums
    dY_u (FUSE_SUMS, then `_user_sum_fixup_kernel`), so dout is read once for both."""
    num_rows, rows, dim = a.shape
    depth = x.shape[1]
    if out.numel() == 0:
        return out
    if num_rows == 0 or dim == 0:
        fail(recording)
        return out.zero_()
    sums = ranges = None
    if user_sums is not None:
        fail(recording)  # the sort of the mapping is not a recorded step
        cand_to_user, sums = user_sums
        ranges = _user_ranges(cand_to_user, sums.shape[0])  # (sorted users, order, offsets)

    def attempt(cfg: TileConfig) -> None:
        tiles = triton.cdiv(rows, cfg.block_m) * triton.cdiv(depth, cfg.block_n)
        wanted = splits or max(1, _num_programs(a.device) // tiles)
        if sums is not None:  # fused: at most FUSED_SPLIT_ROWS rows a split
            wanted = max(wanted, triton.cdiv(num_rows, FUSED_SPLIT_ROWS))
        per_split = triton.cdiv(num_rows, min(wanted, num_rows))
        count = triton.cdiv(num_rows, per_split)
        part = torch.empty(count, rows, depth, dtype=torch.float32, device=a.device)
        named(recording, name + "_part", part)
        slots = None if sums is None else torch.empty(count, 2, rows, dim, dtype=torch.float32, device=a.device)
        sorted_users, order, offsets = (None, None, None) if ranges is None else ranges
        a_tma, x_tma = tma_ok(a), tma_ok(x)

        def build(bind):
            a_desc = _operand_desc(a, cfg.block_m, cfg.block_k, bind)
            x_desc = _operand_desc(x, cfg.block_n, cfg.block_k, bind)
            return (
                bind.ptr(a), a_desc, a.stride(0), a.stride(1), a.stride(2),
                bind.ptr(x), x_desc, x.stride(0), x.stride(1), x.stride(2), bind.ptr(part),
                order, sorted_users, offsets, sums, slots, num_rows, rows, depth, dim, per_split,
                1 if sums is None else sums.shape[0],
            )

        launch(
            _lce_weight_grad_launch, (count * tiles,), build, recording,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=cfg.block_k, A_TMA=a_tma, X_TMA=x_tma,
            FUSE_SUMS=sums is not None, MAX_ROWS=FUSED_SPLIT_ROWS, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        block = 1024 if not interpreting() else 32
        if sums is not None:
            grid = (sums.shape[0], triton.cdiv(rows * dim, block))
            _user_sum_fixup_launch[grid](slots, sums, offsets, per_split, rows * dim, BLOCK=block)
        launch(
            _split_sum_launch, (triton.cdiv(rows * depth, block),),
            lambda bind: (bind.ptr(part), bind.ptr(out), count, rows * depth), recording, BLOCK=block,
        )

    configs = [config] if config is not None else weight_grad_configs(a.dtype, dim, sums is not None)
    key = None if config is not None else ("dW", sums is not None, a.dtype, dim, a.device)
    _launch_first_fitting(key, configs, attempt)
    return out
# fmt: on


def _shared_weight_gemm(weight_padded, x, out, config: TileConfig | None = None) -> torch.Tensor:
    """out[g] = weight @ x[g] for every row g: the forward's `_lce_tile_kernel` (aligned: TMA tiles), weight_padded
    [M, K'] (K zero-padded to K_ALIGN), x [G, K, D], out [G, M, D] contiguous."""
    if out.numel() == 0:
        return out
    if x.shape[1] == 0:
        return out.zero_()
    dim = x.shape[2]

    def launch(cfg: TileConfig) -> None:
        w_desc = TensorDescriptor.from_tensor(weight_padded, [cfg.block_m, cfg.block_k])
        _launch_tile(weight_padded, w_desc, x, out, None, None, cfg)

    configs = [config] if config is not None else tile_configs("aligned", x.dtype, dim)
    _launch_first_fitting(None if config is not None else ("gemm", x.dtype, dim, x.device), configs, launch)
    return out


def _fill_transposed(weight: torch.Tensor, out: torch.Tensor) -> None:
    """out [K, N'] = weightᵀ for weight [N, K], zero columns after N."""
    num_rows = weight.shape[0]
    out[:, :num_rows].copy_(weight.t())
    out[:, num_rows:].zero_()


def _input_grad(weight, g, out, gemm: str | None = None, recording: Recording | None = None) -> torch.Tensor:
    """out[r] = weightᵀ @ g[r] for every row r (d_cand_emb = W_cᵀ dout[b], d_user_emb = W_uᵀ dY_u[u]): the forward's
    batched shared-weight GEMM with the transposed weight. `gemm` "ws": the warp-specialized Gluon kernel of the
    forward (Hopper, 16 bit); "tile": `_lce_tile_kernel`; None: ws where it runs. With `recording` the ws path's
    steps are kept for replay (kernels._launch; the transposed weight named "weight_t")."""
    if out.numel() == 0:
        fail(recording)
        return out
    cols = triton.cdiv(max(weight.shape[0], 1), K_ALIGN) * K_ALIGN  # [K, N'] zero-padded: TMA-able rows
    weight_t = named(recording, "weight_t", weight.new_empty(weight.shape[1], cols))
    call(recording, _fill_transposed, weight, weight_t)
    if gemm is None:
        gemm = "ws" if g.shape[1] > 0 and _ws_runs(g, g) else "tile"
    if gemm == "ws":
        from .linear_compress_ws import _launch_kernel, ws_config  # Gluon (Hopper); imported on first use

        packed = PackedWeights(weight_t, weight_t, None, weight_t, weight_t)
        cfg = ws_config(g.shape[2], g.element_size())
        # no user part: the mapping argument is never read
        _launch_kernel(packed, g, out, None, out, None, cfg, recording=recording)
        return out
    fail(recording)
    return _shared_weight_gemm(weight_t, g, out)


def _user_emb_grad(user_weight, sums, out) -> torch.Tensor:
    """out [U, Ku, D] = W_uᵀ dY_u[u] for every user: one cuBLAS GEMM batched over the users, W_uᵀ a transposed
    stride-0 view (no copy; a small GEMM, U·Ku·N·D products)."""
    return torch.matmul(user_weight.t(), sums, out=out)


def _user_ranges(cand_to_user, num_users: int):
    """(sorted mapping values [B], order [B] int64, offsets [U + 1] int32): the mapping sorted on the device (stable),
    candidates order[offsets[u]:offsets[u + 1]] belong to user u (`_user_offsets_kernel`; a bad value counts for
    user 0 or U - 1, the forward's clamp). No host wait."""
    num_candidates = cand_to_user.shape[0]
    sorted_users, order = torch.sort(cand_to_user, stable=True)
    offsets = torch.empty(num_users + 1, dtype=torch.int32, device=cand_to_user.device)
    block = 128
    _user_offsets_launch[(triton.cdiv(num_users + 1, block),)](
        sorted_users, offsets, num_users, num_candidates, num_candidates.bit_length(), BLOCK=block
    )
    return sorted_users, order, offsets


def _selection_sums(g: torch.Tensor, cand_to_user: torch.Tensor, sums: torch.Tensor) -> None:
    """sums [U, N, D] = S·g with S [U, B] the one-hot selection matrix in g's dtype (`_user_gradients`)."""
    num_candidates, rows, dim = g.shape
    num_users = sums.shape[0]
    users = torch.arange(num_users, device=g.device, dtype=cand_to_user.dtype)
    selection = (users[:, None] == cand_to_user[None, :]).to(g.dtype)  # [U, B]: S[u, b] = 1 where m[b] = u
    torch.mm(selection, g.view(num_candidates, rows * dim), out=sums.view(num_users, rows * dim))


def _user_gradients(
    g, cand_to_user, num_users: int, out=None, method: str | None = None, recording: Recording | None = None
) -> torch.Tensor:
    """dY_u [U, N, D]: dout (g [B, N, D], contiguous) summed over each user's candidates, fp32 accumulation.

    `method` "selection": S·g with S [U, B] the one-hot selection matrix in g's dtype (one GEMM, no sort; a
    candidate whose mapping value is out of range adds to no user); "segment": `_user_grad_sum_kernel`, one pass over
    g in user order (`_user_ranges`; a bad value adds to user 0 or U - 1, the forward's clamp). None: selection on
    CUDA up to SELECTION_MAX_USERS users, else segment. Either reads and writes nothing out of bounds. With
    `recording` (kernels._launch) the selection's step is kept for replay (the segment sum's sort is not)."""
    num_candidates, rows, dim = g.shape
    sums = g.new_empty(num_users, rows, dim) if out is None else out
    if sums.numel() == 0 or num_candidates == 0:
        fail(recording)
        return sums if sums.numel() == 0 else sums.zero_()
    if method is None:
        method = "selection" if g.is_cuda and num_users <= SELECTION_MAX_USERS else "segment"
    if method == "selection":
        call(recording, _selection_sums, g, cand_to_user, sums)
        return sums
    if method != "segment":
        raise ValueError(f"method: expected 'selection', 'segment' or None, got {method!r}")
    fail(recording)
    _, order, offsets = _user_ranges(cand_to_user, num_users)
    numel = rows * dim
    block, step_rows = (32, 2) if interpreting() else (1024, 4)
    while block > 256 and num_users * triton.cdiv(numel, block) < 2 * _num_programs(g.device):
        block //= 2  # few users: narrower column blocks, so that every SM gets programs
    _user_grad_sum_launch[(num_users, triton.cdiv(numel, block))](
        g, order, offsets, sums, numel, BLOCK=block, ROWS=step_rows
    )
    return sums


# fmt: off
def _linear_compress_backward_triton(
    grad_out, user_emb, cand_emb, cand_to_user, user_weight, cand_weight, needs=(True,) * 5, grads=None,
    user_sums=None, splits: int | None = None, cand_gemm: str | None = None, fuse_sums: bool = FUSE_USER_SUMS,
    recording: Recording | None = None,
):
    """(d_user_emb, d_cand_emb, d_user_weight, d_cand_weight, d_bias), None where `needs` says no, by Triton kernels
    (fp32 accumulation; fp32 inputs as tf32):
        dY_u = Σ_{b: m[b]=u} dout[b]                 `_user_gradients` (one-hot GEMM or sort + segment sum), or with
                                                     `fuse_sums` in the dW_c pass (`_weight_grad` with user_sums)
        d_user_emb[u] = W_uᵀ dY_u[u]                 `_user_emb_grad` (cuBLAS, batched over the users)
        d_cand_emb[b] = W_cᵀ dout[b]                 `_input_grad` (the forward's ws kernel on Hopper, else tile)
        d_user_weight = Σ_u dY_u[u] user_emb[u]ᵀ     `_weight_grad` (split-K over users)
        d_cand_weight = Σ_b dout[b] cand_emb[b]ᵀ     `_weight_grad` (split-K over candidates)
        d_bias = Σ_{u,d} dY_u[u, :, d]               (Σ_{b,d} dout[b, :, d] where there is no dY_u)
    `grads` may hold pre-allocated contiguous buffers for any of the five and `user_sums` one for dY_u [U, N, D]
    (tests poison them with NaN); `splits` fixes the weight gradients' split count, `cand_gemm` ("ws", "tile") the
    kernel of d_cand_emb and `fuse_sums` whether dY_u comes from the dW_c pass (tests, benchmarks). With
    `recording` (kernels._launch) the steps are kept for replay: the gradients named "grad0" … "grad4", dY_u "sums"."""
    need_user, need_cand, need_user_weight, need_cand_weight, need_bias = needs
    num_users, num_user_tokens, _ = user_emb.shape
    num_candidates, num_cand_tokens, dim = cand_emb.shape
    given = list(grads) if grads is not None else [None] * 5
    shapes = (user_emb.shape, cand_emb.shape, user_weight.shape, cand_weight.shape, cand_weight.shape[:1])

    def buffer(index: int) -> torch.Tensor:
        if given[index] is not None:
            fail(recording)
            return given[index]
        return named(recording, f"grad{index}", grad_out.new_empty(shapes[index]))

    g = grad_out.contiguous()  # [B, N, D]
    if g is not grad_out or min(num_users, num_user_tokens, num_candidates, num_cand_tokens, dim) == 0:
        fail(recording)  # a copy, or a step that fills zeros: not replayed
    fuse = fuse_sums and need_cand_weight and num_cand_tokens > 0 and num_candidates > 0
    sums = None  # dY_u [U, N, D]
    if ((need_user or need_user_weight) and num_user_tokens) or (need_bias and fuse):
        if user_sums is None:
            sums = named(recording, "sums", g.new_empty(num_users, cand_weight.shape[0], dim))
        else:
            sums = user_sums
            fail(recording)
    result = [None] * 5
    if need_cand_weight:
        fused_sums = (cand_to_user, sums) if fuse and sums is not None else None
        result[3] = _weight_grad(g, cand_emb, buffer(3), splits, user_sums=fused_sums, recording=recording, name="dWc")
    if sums is not None and not fuse:
        _user_gradients(g, cand_to_user, num_users, sums, recording=recording)
    if need_user:
        result[0] = buffer(0)
        if sums is not None and num_user_tokens:
            call(recording, _user_emb_grad, user_weight, sums, result[0])
    if need_cand:
        result[1] = _input_grad(cand_weight, g, buffer(1), gemm=cand_gemm, recording=recording)
    if need_user_weight:
        result[2] = buffer(2)
        if sums is not None and num_user_tokens:
            _weight_grad(sums, user_emb, result[2], splits, recording=recording, name="dWu")
    if need_bias:  # one reduction, fp32 accumulation (torch's for 16-bit inputs)
        result[4] = call(recording, torch.sum, g if sums is None else sums, (0, 2), out=buffer(4))
    return tuple(result)
# fmt: on


# ----------------------------------------------------------------------------- the ops: ikbo::linear_compress


@torch.library.custom_op("ikbo::linear_compress", mutates_args=())
def _linear_compress_op(
    user_emb: torch.Tensor,
    cand_emb: torch.Tensor,
    cand_to_user: torch.Tensor,
    user_weight: torch.Tensor,
    cand_weight: torch.Tensor,
    bias: torch.Tensor | None,
    user_weight_padded: torch.Tensor | None,
    cand_weight_padded: torch.Tensor | None,
    backend: str,
    variant: str | None,
) -> torch.Tensor:
    """out [B, N, D] = W_u @ user_emb[m[b]] + W_c @ cand_emb[b] + bias for checked inputs (`_check_inputs`); the
    padded weights are optional copies (`PackedWeights`) the op makes itself where they are None."""
    weights = (user_weight, cand_weight, bias, user_weight_padded, cand_weight_padded)
    return _linear_compress(user_emb, cand_emb, cand_to_user, *weights, backend, variant)


@_linear_compress_op.register_fake
def _linear_compress_fake(user_emb, cand_emb, cand_to_user, user_weight, cand_weight, bias, *_):
    return user_emb.new_empty(cand_emb.shape[0], cand_weight.shape[0], user_emb.shape[2])


def _linear_compress_backward_impl(
    grad_out: torch.Tensor,
    user_emb: torch.Tensor,
    cand_emb: torch.Tensor,
    cand_to_user: torch.Tensor,
    user_weight: torch.Tensor,
    cand_weight: torch.Tensor,
    needs: list[bool],
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d_user_emb, d_cand_emb, d_user_weight, d_cand_weight, d_bias) of `ikbo::linear_compress`; an empty tensor
    where `needs` (the same five) says no. Not differentiable itself."""
    inputs = (grad_out, user_emb, cand_emb, cand_to_user, user_weight, cand_weight)
    if _resolve(backend, user_emb) == "torch":
        grads = _linear_compress_backward_torch(*inputs, needs)
    else:
        grads = _backward_triton_replayed(*inputs, needs)
    return tuple(grad_out.new_empty(0) if grad is None else grad.contiguous() for grad in grads)  # the fake's strides


_BACKWARD_REPLAYS: dict = {}  # call signature → the Replay of `_linear_compress_backward_triton`'s steps


def _backward_triton_replayed(grad_out, user_emb, cand_emb, cand_to_user, user_weight, cand_weight, needs):
    """`_linear_compress_backward_triton`, replaying the steps of an earlier call with the same signature (shapes,
    strides, alignments, dtype, device, `needs`, the dispatch settings) where `_replays_here`: the same launches and
    torch steps with this call's tensors (kernels._launch)."""
    inputs = dict(
        grad_out=grad_out, user_emb=user_emb, cand_emb=cand_emb, cand_to_user=cand_to_user, user_weight=user_weight,
        cand_weight=cand_weight,
    )  # fmt: skip
    if not _replays_here(user_emb, cand_emb):
        return _linear_compress_backward_triton(*inputs.values(), needs)
    key = (
        *((t.shape, t.stride(), t.dtype, t.data_ptr() % 16) for t in inputs.values()),
        user_emb.device, tuple(needs), FUSE_USER_SUMS, SELECTION_MAX_USERS,
    )  # fmt: skip
    replay = _BACKWARD_REPLAYS.get(key)
    if replay is not None:
        made = replay(torch._C._cuda_getCurrentRawStream(user_emb.device.index), user_emb.device, inputs)
        if made is not None:
            return tuple(made[f"grad{i}"] if need else None for i, need in enumerate(needs))
    recording = Recording(**inputs)
    grads = _linear_compress_backward_triton(*inputs.values(), needs, recording=recording)
    replay = recording.replay()
    if replay is not None and all(f"grad{i}" in recording.fresh for i, need in enumerate(needs) if need):
        remember(_BACKWARD_REPLAYS, key, replay)
    return grads


_linear_compress_backward_op = torch.library.custom_op(
    "ikbo::linear_compress_backward", _linear_compress_backward_impl, mutates_args=()
)


@_linear_compress_backward_op.register_fake
def _linear_compress_backward_fake(grad_out, user_emb, cand_emb, cand_to_user, user_weight, cand_weight, needs, _):
    shapes = (user_emb.shape, cand_emb.shape, user_weight.shape, cand_weight.shape, cand_weight.shape[:1])
    return tuple(grad_out.new_empty(shape if need else (0,)) for shape, need in zip(shapes, needs, strict=True))


def _setup_context(ctx, inputs, output) -> None:
    user_emb, cand_emb, cand_to_user, user_weight, cand_weight, bias, _, _, backend, _ = inputs
    ctx.save_for_backward(user_emb, cand_emb, cand_to_user, user_weight, cand_weight)
    ctx.has_bias = bias is not None
    ctx.backend = backend


def _backward(ctx, grad_out):
    """Gradients of the five float inputs (user_emb, cand_emb, user_weight, cand_weight, bias) that need one; None
    for the mapping, the padded copies and the options."""
    user_emb, cand_emb, cand_to_user, user_weight, cand_weight = ctx.saved_tensors
    wanted = ctx.needs_input_grad
    needs = [wanted[0], wanted[1], wanted[3], wanted[4], ctx.has_bias and wanted[5]]
    run = backward_call(ctx, _linear_compress_backward_op, _linear_compress_backward_impl, grad_out)
    grads = run(grad_out, user_emb, cand_emb, cand_to_user, user_weight, cand_weight, needs, ctx.backend)
    d_user, d_cand, d_user_weight, d_cand_weight, d_bias = (g if need else None for g, need in zip(grads, needs))
    return d_user, d_cand, None, d_user_weight, d_cand_weight, d_bias, None, None, None, None


_linear_compress_op.register_autograd(_backward, setup_context=_setup_context)
_LinearCompress = eager_function("_LinearCompress", _linear_compress, _setup_context, _backward)
_LinearCompressFunc = functorch_function("_LinearCompressFunc", _linear_compress, _setup_context, _backward)


def _call(args: tuple, tensors: tuple) -> torch.Tensor:
    """`ikbo::linear_compress` on `args`, the way `route` picks from `tensors` (the float inputs and the mapping)."""
    way = route(*tensors)
    if way == "direct":
        return _linear_compress(*args)
    if way == "autograd":
        return _LinearCompress.apply(*args)
    if way == "func":
        return _LinearCompressFunc.apply(*args)
    return _linear_compress_op(*args)


# ----------------------------------------------------------------------------- public API


def _check_inputs(user_emb, cand_emb, cand_to_user, user_weight, cand_weight, bias, backend, variant) -> str:
    """The public entries' checks: shapes, dtypes, devices, the backend and variant names; returns the path
    (`_resolve`). No device value is read (torch.compile traces them)."""
    check_tensor("user_emb", user_emb, 3, FLOAT_TYPES)
    check_tensor("cand_emb", cand_emb, 3, FLOAT_TYPES)
    num_users, num_user_tokens, dim = user_emb.shape
    num_candidates, num_cand_tokens, cand_dim = cand_emb.shape
    check_same("cand_emb", cand_dim, "D (last dim of user_emb)", dim)
    check_same("user_emb", num_user_tokens, "Ku (user columns of weight)", user_weight.shape[1])
    check_same("cand_emb", num_cand_tokens, "Kc (candidate columns of weight)", cand_weight.shape[1])
    dtype, device = user_emb.dtype, user_emb.device
    for name, t in (("cand_emb", cand_emb), ("weight", user_weight), ("weight", cand_weight), ("bias", bias)):
        if t is not None and (t.dtype != dtype or t.device != device):
            raise ValueError(f"{name}: expected {dtype} on {device} like user_emb, got {t.dtype} on {t.device}")
    check_mapping_shape(cand_to_user, num_candidates, device)
    if variant is not None:
        _check_variant(variant)
    return _resolve(backend, user_emb)


class PackedLinearCompress(torch.nn.Module):
    """One LCE layer: Parameters user_weight [N, Ku], cand_weight [N, Kc] and bias [N] (or None), which receive the
    gradients, and a cache of the copies its kernels take.

    `from_weight(weight, Ku, bias)` splits W [N, Ku + Kc] into copies; they require grad where `weight` (and `bias`)
    do: packed from an nn.Parameter, the module trains; packed from loaded inference weights, calls build no autograd
    graph (`requires_grad_()` turns it on). Gradients reach this module's Parameters, not the tensors it was packed
    from: an optimizer takes `packed.parameters()`.

    The cache (`PackedWeights`: user_weight_padded, cand_weight_padded, K zero-padded to a multiple of 8 so that every
    row is 16-byte aligned for TMA; weight descriptors) is keyed on each Parameter's data pointer, version counter,
    shape, dtype and device: an optimizer step (in place), `load_state_dict` or `.to()` refreshes it at the next call.
    A write the version counter does not see (through `.data`) needs `refresh()`. While torch.compile or
    torch.export traces the module no padded copy is passed: the op pads inside (one small copy per call).
    """

    def __init__(self, user_weight: torch.Tensor, cand_weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        check_tensor("user_weight", user_weight, 2, FLOAT_TYPES)
        check_tensor("cand_weight", cand_weight, 2, FLOAT_TYPES)
        check_same("cand_weight", cand_weight.shape[0], "N (rows of user_weight)", user_weight.shape[0])
        if bias is not None:
            check_tensor("bias", bias, 1, FLOAT_TYPES)
            check_same("bias", bias.shape[0], "N (rows of weight)", user_weight.shape[0])
        self.user_weight = torch.nn.Parameter(user_weight, requires_grad=user_weight.requires_grad)
        self.cand_weight = torch.nn.Parameter(cand_weight, requires_grad=cand_weight.requires_grad)
        bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=bias.requires_grad)
        self.register_parameter("bias", bias)  # None too: forward reads self._parameters["bias"]
        self._cache: PackedWeights | None = None
        self._cache_key = None

    @classmethod
    def from_weight(cls, weight: torch.Tensor, num_user_tokens: int, bias: torch.Tensor | None = None):
        """Copies of weight[:, :Ku], weight[:, Ku:] and bias, requiring grad where `weight` and `bias` do."""
        check_tensor("weight", weight, 2, FLOAT_TYPES)
        if not 0 <= num_user_tokens <= weight.shape[1]:
            raise ValueError(f"num_user_tokens: expected in [0, {weight.shape[1]}], got {num_user_tokens}")
        if bias is not None:
            check_tensor("bias", bias, 1, FLOAT_TYPES)
            check_same("bias", bias.shape[0], "N (rows of weight)", weight.shape[0])
        with torch.no_grad():
            user_weight = weight[:, :num_user_tokens].clone(memory_format=torch.contiguous_format)
            cand_weight = weight[:, num_user_tokens:].clone(memory_format=torch.contiguous_format)
            bias_copy = None if bias is None else bias.clone(memory_format=torch.contiguous_format)
        user_weight.requires_grad_(weight.requires_grad)
        cand_weight.requires_grad_(weight.requires_grad)
        if bias_copy is not None:
            bias_copy.requires_grad_(bias.requires_grad)
        return cls(user_weight, cand_weight, bias_copy)

    def forward(self, user_emb, cand_emb, cand_to_user, backend: str = "auto", variant: str | None = None):
        """out [B, N, D]; `variant` picks the kernel (VARIANTS or WS_VARIANT; default: the tuned choice, else
        `default_variant`)."""
        params = self._parameters
        weights = (params["user_weight"], params["cand_weight"], params["bias"])
        if isinstance(user_emb, torch.Tensor):
            user_emb, cand_emb, *weights = autocast_inputs(user_emb.device, user_emb, cand_emb, *weights)
        path = _check_inputs(user_emb, cand_emb, cand_to_user, *weights, backend, variant)
        cast = weights[0] is not params["user_weight"]  # autocast: the padded copies keep the Parameters' dtype
        padded = None if path == "torch" or cast or torch.compiler.is_compiling() else self._packed()
        args = (
            user_emb, cand_emb, cand_to_user, *weights,
            None if padded is None else padded.user_weight_padded,
            None if padded is None else padded.cand_weight_padded,
            backend, variant,
        )  # fmt: skip
        return _call(args, (user_emb, cand_emb, cand_to_user, *weights))

    def _packed(self) -> PackedWeights:
        """The Parameters as the kernels take them (detached, with padded copies), rebuilt after a Parameter changed."""
        params = self._parameters  # one lookup (nn.Module.__getattr__ costs a Python call per Parameter)
        weights = (params["user_weight"], params["cand_weight"], params["bias"])
        key = [
            None if p is None else (p.data_ptr(), -1 if p.is_inference() else p._version)  # inference: no version
            for p in weights
        ]  # a new dtype, device or shape comes with new storage (`.to()`, `load_state_dict` of another shape)
        if self._cache is None or key != self._cache_key:
            with torch.no_grad():
                self._cache = PackedWeights.of(*(None if p is None else p.detach() for p in weights))
            self._cache_key = key
        return self._cache

    def refresh(self) -> None:
        """Rebuild the padded copies at the next call (after a write the version counter does not see)."""
        self._cache, self._cache_key = None, None

    @property
    def user_weight_padded(self) -> torch.Tensor:
        return self._packed().user_weight_padded

    @property
    def cand_weight_padded(self) -> torch.Tensor:
        return self._packed().cand_weight_padded

    @property
    def _flags(self) -> dict:
        return self._packed()._flags  # weight descriptors (linear_compress_ws reads them from a packed module)

    def _triton(
        self, user_emb, cand_emb, cand_to_user, variant: str, config: TileConfig | None = None, out=None, user_part=None,
        recording=None,
    ):  # fmt: skip
        """`PackedWeights._triton` on this module's weights: the Triton path for checked inputs, no autograd, no
        mapping check (tuner, benchmarks, tests)."""
        return self._packed()._triton(user_emb, cand_emb, cand_to_user, variant, config, out, user_part)

    def extra_repr(self) -> str:
        rows, num_user_tokens = self.user_weight.shape
        return f"N={rows}, Ku={num_user_tokens}, Kc={self.cand_weight.shape[1]}, bias={self.bias is not None}"


def ikbo_linear_compress(
    user_emb, cand_emb, cand_to_user, weight, bias=None, backend: str = "auto", variant: str | None = None
) -> torch.Tensor:
    """out[b] = weight @ cat(user_emb[m[b]], cand_emb[b]) (+ bias[:, None]) → [B, N, D].

    user_emb [U, Ku, D], cand_emb [B, Kc, D], cand_to_user [B] in [0, U), weight [N, Ku + Kc] (user
    columns first), bias [N] or None. `variant` picks the kernel (VARIANTS or WS_VARIANT). Differentiable in
    user_emb, cand_emb, weight and bias: the op takes views of weight's two column blocks, so autograd reaches
    `weight`. Pads the weights on every call; servers hold a `PackedLinearCompress` instead.
    """
    check_tensor("user_emb", user_emb, 3, FLOAT_TYPES)
    user_emb, cand_emb, weight, bias = autocast_inputs(user_emb.device, user_emb, cand_emb, weight, bias)
    check_tensor("cand_emb", cand_emb, 3, FLOAT_TYPES)
    check_tensor("weight", weight, 2, FLOAT_TYPES)
    num_user_tokens = user_emb.shape[1]
    check_same("weight", weight.shape[1], "Ku + Kc (user + candidate tokens)", num_user_tokens + cand_emb.shape[1])
    if bias is not None:
        check_tensor("bias", bias, 1, FLOAT_TYPES)
        check_same("bias", bias.shape[0], "N (rows of weight)", weight.shape[0])
    user_weight, cand_weight = weight[:, :num_user_tokens], weight[:, num_user_tokens:]
    _check_inputs(user_emb, cand_emb, cand_to_user, user_weight, cand_weight, bias, backend, variant)
    args = (user_emb, cand_emb, cand_to_user, user_weight, cand_weight, bias, None, None, backend, variant)
    return _call(args, (user_emb, cand_emb, cand_to_user, weight, bias))
