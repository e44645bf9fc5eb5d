"""The Gluon FA3-style target-attention kernel (kernels/attention_ws.py) against an fp64 reference.

CPU (CI): the kernel compiles for sm_90a with the wheel's ptxas (three partitions with register
reallocation: two consumer warpgroups issuing wgmma with P from registers, one TMA producer warp;
no spills where the wheel's cuobjdump is there), for each of CONFIGS; skipped cleanly where this
Triton cannot compile Gluon for CUDA. Gluon does not run under TRITON_INTERPRET, so that is all the
CPU can check. GPU (skipped without a Hopper device): bf16 and fp16 outputs
poisoned with NaN, fresh random inputs, ragged counts, kv_len < L and 0, L not a multiple of the
key block, users without candidates, S > 64 and S = 1, d = 64, through `launch_ws` for every
config (items handed out by the atomic counter or statically) and through the public op's dispatch
(the fp64 reference computed once per case and dtype); the counter left zero for the next launch.
"""

from __future__ import annotations

import functools
import math
import re

import pytest
import torch
from sm90 import compiled_or_skip

from kernels import attention
from kernels._hopper import SMEM_LIMIT
from kernels.attention_ws import (
    DEFAULT_CONFIG,
    WSAttentionConfig,
    launch_ws,
    rows_by_tma,
    self_rows_by_tma,
    self_target_ws_ok,
    ws_supported,
)
from kernels.devtools import compile_attention_ws, compile_backward_ws, disassemble
from kernels.reference import rel_err

HAS_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
DYNAMIC = WSAttentionConfig(dynamic=True)  # items from the atomic counter (the default's with kv_len or self tiles)
STATIC = WSAttentionConfig(dynamic=False)  # program p takes items p, p + programs, … (the default's otherwise)
CONFIGS = [DEFAULT_CONFIG, DYNAMIC, STATIC, WSAttentionConfig(block_n=64, stages=4)]
CONFIG_IDS = ["default", "dynamic", "static", "64-keys"]


def test_configs_fit_shared_memory():
    for cfg in CONFIGS:
        assert cfg.smem_bytes(128, 2) <= SMEM_LIMIT
        assert 128 * (2 * cfg.consumer_regs + cfg.producer_regs) <= 65536  # 3 warpgroups' registers after setmaxnreg


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        dict(dtype=torch.float16, head_dim=64, has_kv_len=False),
        dict(has_self=True),
        dict(has_self=True, causal=False, head_dim=64),
        dict(rows_tma=False),
        dict(has_self=True, rows_tma=False),
    ],
    ids=["bf16-d128", "fp16-d64", "self-causal", "self-d64", "gathered-rows", "self-gathered-rows"],
)
def test_compiles_for_sm90a(config, kwargs):
    """sm_90a without a GPU: producer + two consumer warpgroups with setmaxnreg, wgmma with P from
    registers, TMA loads of K/V, named barriers per partition, no spills."""
    kernel = compiled_or_skip(compile_attention_ws, config=config, **kwargs)
    ptx = kernel.asm["ptx"]
    assert kernel.metadata.shared <= SMEM_LIMIT
    assert "wgmma.mma_async" in ptx and "setmaxnreg.inc" in ptx and "setmaxnreg.dec" in ptx
    assert "cp.async.bulk.tensor.2d.shared::cluster.global" in ptx  # the TMA loads of K and V (and q rows)
    rows_tma = kwargs.get("rows_tma", True)
    assert ("cp.async.bulk.tensor.2d.global.shared" in ptx) == rows_tma  # out rows by TMA store
    assert ("cp.async.cg.shared.global" in ptx) != rows_tma  # q rows gathered by cp.async
    assert re.search(r"bar\.sync\s+0,\s*128", ptx)  # the default consumer's own barrier, not the CTA's
    disassembled = disassemble(kernel)
    if disassembled is None:
        return
    sass, usage = disassembled
    assert "HGMMA.64x" in sass and "UTMALDG" in sass
    assert re.search(r"HGMMA\.64x\d+x16\.F32(\.BF16)? R\d+, R\d+, gdesc", sass)  # P·V with P from registers
    assert int(re.search(r"STACK:(\d+)", usage).group(1)) == 0, usage
    assert "LDL" not in sass and "STL" not in sass
    # The key loop: q·k_jᵀ waited with P_{j-1}·V_{j-1} still in flight (at most one group left).
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in sass


def _loop_sizes(sass: str) -> list[int]:
    """Instructions of each innermost loop with wgmma in a SASS listing (a backward branch's span), in order."""
    code = [(int(a, 16), text) for a, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    sizes = []
    for at, text in code:
        target = re.search(r"BRA\s+0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < at:
            body = [t for a, t in code if int(target.group(1), 16) <= a <= at]
            if 0 < sum("HGMMA" in t for t in body) <= 24:
                sizes.append(len(body))
    return sizes


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(kernel="dkdv"),
        dict(kernel="dkdv", dtype=torch.float16, head_dim=64, has_kv_len=False),
        dict(kernel="dkdv", split=True),
        dict(kernel="dkdv", has_self=True),
        dict(kernel="dq"),
        dict(kernel="dq", dtype=torch.float16, head_dim=64, has_kv_len=False),
    ],
    ids=["dkdv-bf16-d128", "dkdv-fp16-d64", "dkdv-split", "dkdv-self", "dq-bf16-d128", "dq-fp16-d64"],
)
def test_backward_kernels_compile_for_sm90a(kwargs):
    """The backward's Gluon kernels for sm_90a without a GPU: producer + two consumer warpgroups with setmaxnreg,
    TMA loads, the accumulating products with their A operand (Pᵀ, dSᵀ, dS) from registers, and the products not
    serialized by ptxas (a wait after every wgmma): S (Sᵀ) waited with dP (dPᵀ) still in flight. dK/dV adds into
    fp32 sums by atomics only when split; with self rows its causal diagonal has a loop of its own, which leaves
    the other steps' loop as without them; dQ spills nothing."""
    kernel = compiled_or_skip(compile_backward_ws, **kwargs)
    ptx = kernel.asm["ptx"]
    assert kernel.metadata.shared <= SMEM_LIMIT
    assert "wgmma.mma_async" in ptx and "setmaxnreg.inc" in ptx and "setmaxnreg.dec" in ptx
    assert "cp.async.bulk.tensor.2d.shared::cluster.global" in ptx
    assert ("red.global" in ptx or "atom.global" in ptx) == kwargs.get("split", False)
    disassembled = disassemble(kernel)
    if disassembled is None:
        return
    sass, usage = disassembled
    assert re.search(r"HGMMA\.64x\d+x16\.F32(\.BF16)? R\d+, R\d+, gdesc", sass)
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in sass
    assert sass.count("WARPGROUP.DEPBAR") <= (24 if kwargs.get("has_self") else 12), "wgmma serialized"
    if kwargs.get("has_self"):
        plain = compile_backward_ws(**{**kwargs, "has_self": False})
        assert _loop_sizes(sass)[0] <= _loop_sizes(disassemble(plain)[0])[0] + 8
    if kwargs["kernel"] == "dq":
        assert int(re.search(r"STACK:(\d+)", usage).group(1)) == 0, usage


def test_launch_ws_self_tiles_need_user_out_and_aligned_rows():
    """Self tiles without user_out, or on rows that are not 16-byte aligned, are refused with a ValueError
    before anything is launched (checked on CPU tensors)."""
    q = torch.zeros(4, 1, 64, 128, dtype=torch.bfloat16)
    user_q = torch.zeros(2, 1, 512, 128, dtype=torch.bfloat16)
    k = torch.zeros_like(user_q)
    mapping = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="user_out"):
        launch_ws(q, k, k, mapping, None, 0.1, user_q=user_q)
    wide = torch.zeros(2, 1, 512, 130, dtype=torch.bfloat16)[..., 1:129]  # rows 2 bytes off
    with pytest.raises(ValueError, match="16-byte aligned"):
        launch_ws(q, k, k, mapping, None, 0.1, user_q=wide, user_out=torch.zeros_like(user_q))
    assert not self_target_ws_ok(q[:0], q[:0], user_q, user_q)  # no candidate rows


def test_not_supported_on_cpu():
    q = torch.zeros(2, 1, 4, 128, dtype=torch.bfloat16)
    assert not ws_supported(q, torch.zeros(1, 1, 8, 128, dtype=torch.bfloat16))


def test_rows_by_tma_needs_contiguous_runs_of_64_rows():
    """q and out rows go by TMA only where every 64-row half of a tile is one contiguous, aligned run."""
    q = torch.randn(3, 2, 128, 64, dtype=torch.bfloat16)
    assert rows_by_tma(q, torch.empty_like(q))
    assert not rows_by_tma(q[:, :, :64], torch.empty_like(q[:, :, :64]))  # a strided view
    short = torch.randn(3, 2, 8, 64, dtype=torch.bfloat16)
    assert not rows_by_tma(short, torch.empty_like(short))  # S = 8: a half spans 8 candidates
    shifted = torch.randn(q.numel() + 1, dtype=torch.bfloat16)[1:].view(q.shape)
    assert shifted.is_contiguous() and not rows_by_tma(shifted, torch.empty_like(q))  # 2 bytes off 16-byte alignment


def test_self_rows_by_tma_needs_whole_64_row_halves():
    """Self tiles' rows go by TMA only where no 64-row half of a 128-row self tile crosses into the next (user, head):
    L a multiple of 64, user_q and user_out contiguous and aligned."""
    user_q = torch.randn(3, 2, 576, 64, dtype=torch.bfloat16)
    assert self_rows_by_tma(user_q, torch.empty_like(user_q))
    odd = torch.randn(3, 2, 520, 64, dtype=torch.bfloat16)
    assert not self_rows_by_tma(odd, torch.empty_like(odd))  # a half of the last tile would straddle L
    swapped = user_q.transpose(1, 2).contiguous().transpose(1, 2)  # [U, L, H, d] memory
    assert not self_rows_by_tma(swapped, torch.empty_like(user_q))


# ------------------------------------------------------------------------------------------ GPU

# (U, B, S, L, H, d, kv_len: None | "ragged", users without candidates)
GPU_CASES = [
    (15, 1024, 64, 1024, 4, 128, None, 0),  # canonical
    (15, 1024, 64, 1000, 4, 128, "ragged", 0),  # kv_len < L, 0 and < one block; L not a tile multiple
    (7, 300, 8, 777, 2, 128, "ragged", 2),  # S = 8, users without candidates
    (5, 37, 100, 300, 3, 64, None, 1),  # S > 64: warpgroups split candidates; d = 64
    (1, 3, 1, 129, 1, 128, "ragged", 0),  # one tile, mostly empty slots
    (40, 64, 64, 256, 2, 64, "ragged", 20),  # many users, half without candidates
]


@functools.cache
def _problem(case, dtype, seed):
    """Inputs and the fp64 reference of one case, drawn once (every config runs the same problem)."""
    num_users, num_candidates, num_queries, seq_len, heads, head_dim, kv_mode, empty = case
    gen = torch.Generator().manual_seed(seed)
    mapping = torch.randint(0, num_users - empty, (num_candidates,), generator=gen)
    kv_len = None
    if kv_mode == "ragged":
        kv_len = torch.randint(0, seq_len + 1, (num_users,), generator=gen)
        kv_len[0] = 0
        if num_users > 2:
            kv_len[1], kv_len[2] = 5, seq_len
        kv_len = kv_len.cuda()
    q = torch.randn(num_candidates, heads, num_queries, head_dim, generator=gen).to("cuda", dtype)
    k = torch.randn(num_users, heads, seq_len, head_dim, generator=gen).to("cuda", dtype)
    v = torch.randn(num_users, heads, seq_len, head_dim, generator=gen).to("cuda", dtype)
    ref = attention.ikbo_attention(q.double(), k.double(), v.double(), mapping.cuda(), kv_len, backend="torch")
    return q, k, v, mapping.cuda(), kv_len, ref


def _check(out, ref):
    torch.cuda.synchronize()
    assert bool(torch.isfinite(out).all()), "unwritten (NaN) outputs"
    err = rel_err(out, ref)
    assert err <= 1e-2, err


@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", GPU_CASES)
def test_cuda_launch_ws_matches_fp64(case, dtype, config):
    q, k, v, mapping, kv_len, ref = _problem(case, dtype, seed=hash((case, str(dtype))) % 1000)
    out = torch.full_like(q, float("nan"))
    launch_ws(q, k, v, mapping, kv_len, 1 / math.sqrt(q.shape[3]), config, out=out)
    _check(out, ref)


@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "case",
    [
        (9, 200, 128, 500, 2, 128, "ragged", 1),  # S = 128: one candidate a tile, a half per warpgroup
        (6, 77, 192, 300, 3, 64, None, 2),  # S = 192: a candidate over 1.5 tiles; users without candidates
        (3, 5, 64, 129, 1, 128, "ragged", 0),  # odd counts: tiles whose second half is past the end
    ],
)
@pytest.mark.parametrize("num_programs", [None, 2])
@pytest.mark.parametrize("config", [DEFAULT_CONFIG, DYNAMIC, STATIC], ids=["default", "dynamic", "static"])
def test_cuda_rows_by_tma(case, dtype, num_programs, config):
    """q rows by TMA load (an item ahead, `_producer_rows_tma`) and out rows by TMA store (S a multiple of 64,
    contiguous q and out), NaN-poisoned outputs, items in both orders; the GPU_CASES with S = 64 take this path too,
    those with S = 1, 8, 100 the gathered rows."""
    q, k, v, mapping, kv_len, ref = _problem(case, dtype, seed=11)
    assert rows_by_tma(q, q)
    out = torch.full_like(q, float("nan"))
    launch_ws(q, k, v, mapping, kv_len, 1 / math.sqrt(q.shape[3]), config, out=out, num_programs=num_programs)
    _check(out, ref)


@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper GPU")
def test_cuda_few_programs_many_items():
    """Two programs loop over every work item: the ring's and the turns' phases wrap many times."""
    q, k, v, mapping, kv_len, ref = _problem(GPU_CASES[1], torch.bfloat16, seed=3)
    for config in (DYNAMIC, STATIC):
        out = torch.full_like(q, float("nan"))
        launch_ws(q, k, v, mapping, kv_len, 1 / math.sqrt(q.shape[3]), config, out=out, num_programs=2)
        _check(out, ref)


@functools.cache
def _growing_scores_problem(head_dim, dtype):
    """Scores that grow along the keys (key j scaled by 1 + 3·j/128) for half of the query rows and stay
    small for the other half (q scaled by 0.05): the running max of some rows of a thread jumps by far
    more than 2^8 in later key blocks while others barely move; kv_len ragged."""
    gen = torch.Generator().manual_seed(head_dim)
    num_users, num_candidates, num_queries, seq_len, heads = 3, 50, 64, 1024, 2
    mapping = torch.randint(0, num_users, (num_candidates,), generator=gen)
    q = torch.randn(num_candidates, heads, num_queries, head_dim, generator=gen)
    q[:, :, 1::2] *= 0.05
    growth = 1 + 3 * torch.arange(seq_len, dtype=torch.float32) / 128
    k = torch.randn(num_users, heads, seq_len, head_dim, generator=gen) * growth[:, None]
    v = torch.randn(num_users, heads, seq_len, head_dim, generator=gen)
    q, k, v = (t.to("cuda", dtype) for t in (q, k, v))
    kv_len = torch.tensor([seq_len, 700, 130]).cuda()
    ref = attention.ikbo_attention(q.double(), k.double(), v.double(), mapping.cuda(), kv_len, backend="torch")
    return q, k, v, mapping.cuda(), kv_len, ref


@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [128, 64])
def test_cuda_growing_scores(head_dim, dtype):
    """Rows whose max grows block after block next to rows whose max stays: a rescale of the wrong row
    or a missed one shows as an error far over 1e-2."""
    q, k, v, mapping, kv_len, ref = _growing_scores_problem(head_dim, dtype)
    for num_programs in (None, 2):
        out = torch.full_like(q, float("nan"))
        launch_ws(q, k, v, mapping, kv_len, 1 / math.sqrt(head_dim), out=out, num_programs=num_programs)
        _check(out, ref)


@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper GPU")
def test_cuda_unaligned_rows_go_through_copies():
    """q rows whose strides are not multiples of 8 elements, and an output whose rows start 4 bytes in:
    the producer copies rows 16 bytes at a time, so launch_ws works on aligned copies (and is right)."""
    q, k, v, mapping, kv_len, ref = _problem(GPU_CASES[3], torch.bfloat16, seed=5)
    wide = torch.randn(q.shape[0], q.shape[1], q.shape[2], q.shape[3] + 4, device="cuda").to(q.dtype)
    wide[..., : q.shape[3]] = q
    out = torch.full_like(q, float("nan"))
    launch_ws(wide[..., : q.shape[3]], k, v, mapping, kv_len, 1 / math.sqrt(q.shape[3]), out=out)
    _check(out, ref)
    out_wide = torch.full_like(wide, float("nan"))
    shifted = out_wide[..., 2 : 2 + q.shape[3]]
    launch_ws(q, k, v, mapping, kv_len, 1 / math.sqrt(q.shape[3]), out=shifted)
    _check(shifted, ref)


@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper GPU")
def test_cuda_item_counter_left_zero_for_the_next_launch():
    """The atomic item counter lives in the plan (words 1–2 after the flag): each launch leaves it zero, so
    one plan serves launch after launch (target, then self + target, on fewer programs than items), each
    right; a plan whose tickets are all taken computes nothing."""
    from kernels.attention_ws import TILE_M

    user_q, q, k, v, mapping, kv_len, causal, ref_user, ref_cand = _self_problem(SELF_CASES[1], torch.bfloat16, seed=7)
    plan = attention.plan_tiles(mapping, k.shape[0], q.shape[2], TILE_M, kv_len, k.shape[2])
    words = plan[3].as_strided((3,), (1,))  # [flag, next ticket, programs done] of the plan's buffer
    for num_programs in (None, 5, None):
        out, user_out = torch.full_like(q, float("nan")), torch.full_like(user_q, float("nan"))
        launch_ws(q, k, v, mapping, kv_len, 1 / math.sqrt(q.shape[3]), out=out, plan=plan, num_programs=num_programs)
        _check(out, ref_cand)
        out.fill_(float("nan"))
        launch_ws(
            q,
            k,
            v,
            mapping,
            kv_len,
            1 / math.sqrt(q.shape[3]),
            out=out,
            plan=plan,
            num_programs=num_programs,
            user_q=user_q,
            user_out=user_out,
            causal=causal,
        )
        _check(out, ref_cand)
        _check(user_out, ref_user)
        assert words[1:].tolist() == [0, 0]
    # the items really come from the counter: with every ticket already taken, nothing is computed (and the
    # counter is zero again after the launch)
    words[1] = 1 << 30
    out = torch.full_like(q, float("nan"))
    launch_ws(q, k, v, mapping, kv_len, 1 / math.sqrt(q.shape[3]), out=out, plan=plan)
    torch.cuda.synchronize()
    assert bool(torch.isnan(out).all())
    assert words[1:].tolist() == [0, 0]


def test_public_op_dispatch_rule():
    """The public op takes this kernel only on CUDA Hopper inputs of the measured shapes: S ≥ 64, L ≥ 512
    and at least MIN_ROWS_PER_USER query rows a user; self + target with kv_len from L = MIN_RAGGED_SELF_SEQ."""
    from kernels.attention_ws import MIN_ROWS_PER_USER, prefer_ws, preferred_shape

    q = torch.zeros(8, 1, 64, 128, dtype=torch.bfloat16)
    assert not prefer_ws(q, torch.zeros(1, 1, 1024, 128, dtype=torch.bfloat16))  # CPU tensors
    assert preferred_shape(1024, 15, 64, 1024)  # canonical: 4369 rows a user
    assert not preferred_shape(1024, 1024, 64, 1024)  # B/U = 1: 64 rows a user
    assert preferred_shape(MIN_ROWS_PER_USER // 64, 1, 64, 512) and not preferred_shape(
        MIN_ROWS_PER_USER // 64 - 1, 1, 64, 512
    )
    assert not preferred_shape(1024, 15, 8, 1024) and not preferred_shape(1024, 15, 64, 256)
    # self + target with kv_len below MIN_RAGGED_SELF_SEQ: the Triton kernel, whatever the device
    from kernels.attention_ws import MIN_RAGGED_SELF_SEQ

    short = torch.zeros(15, 1, MIN_RAGGED_SELF_SEQ - 1, 128, dtype=torch.bfloat16)
    assert not prefer_ws(q, short, torch.zeros(15, dtype=torch.int32), self_tiles=True)


@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("case", [GPU_CASES[0], GPU_CASES[1]])
def test_cuda_public_op_dispatches_here(case, monkeypatch):
    """ikbo_attention (backend triton) at a preferred shape runs launch_ws, and is right."""
    from kernels import attention_ws

    calls = []
    original = attention_ws.launch_ws
    monkeypatch.setattr(attention_ws, "launch_ws", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    q, k, v, mapping, kv_len, ref = _problem(case, torch.bfloat16, seed=11)
    assert attention_ws.prefer_ws(q, k)
    out = attention.ikbo_attention(q, k, v, mapping, kv_len, backend="triton")
    assert calls == [1]
    _check(out, ref)


# Self + target in one launch: (U, B, S, L, H, d, kv_len mode, users without candidates, causal)
SELF_CASES = [
    (15, 1024, 64, 1024, 4, 128, None, 0, True),  # canonical
    (15, 600, 64, 1000, 4, 128, "ragged", 2, True),  # kv_len 0, 5, L and random; L not a tile multiple; empty users
    (6, 90, 64, 777, 2, 64, "ragged", 0, True),  # d = 64; the last self tile past L
    (4, 70, 64, 520, 2, 128, "ragged", 1, False),  # non-causal self-attention
    (9, 300, 64, 576, 2, 128, "ragged", 1, True),  # L = 4.5 self tiles, a multiple of 64: rows by TMA
    (5, 77, 64, 576, 3, 64, "ragged", 0, False),  # the same, non-causal, d = 64
]


@functools.cache
def _self_problem(case, dtype, seed):
    """Inputs and the fp64 references (user_out, cand_out) of one self + target case."""
    *target, causal = case
    num_users, num_candidates, num_queries, seq_len, heads, head_dim, kv_mode, empty = target
    q, k, v, mapping, kv_len, _ = _problem(tuple(target), dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    user_q = torch.randn(num_users, heads, seq_len, head_dim, generator=gen).to("cuda", dtype)
    ref_user, ref_cand = attention.ikbo_self_target_attention(
        user_q.double(), q.double(), k.double(), v.double(), mapping, kv_len, causal=causal, backend="torch"
    )
    return user_q, q, k, v, mapping, kv_len, causal, ref_user, ref_cand


@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("config", [DEFAULT_CONFIG, STATIC], ids=["default", "static"])
@pytest.mark.parametrize("num_programs", [None, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", SELF_CASES)
def test_cuda_self_target_matches_fp64(case, dtype, num_programs, config):
    """Self tiles (causal or not, longest first) and target tiles in one launch, outputs NaN-poisoned:
    user rows past kv_len are zeros, rows see keys ≤ their position, users without keys give zeros; on
    the full grid and on 3 programs (every ring, q-slot and turn phase wraps across item kinds); items from
    the counter (the default with self tiles) and in the static order."""
    user_q, q, k, v, mapping, kv_len, causal, ref_user, ref_cand = _self_problem(case, dtype, seed=hash(case) % 1000)
    out, user_out = torch.full_like(q, float("nan")), torch.full_like(user_q, float("nan"))
    assert self_target_ws_ok(q, out, user_q, user_out)
    launch_ws(
        q,
        k,
        v,
        mapping,
        kv_len,
        1 / math.sqrt(q.shape[3]),
        config,
        out=out,
        user_q=user_q,
        user_out=user_out,
        causal=causal,
        num_programs=num_programs,
    )
    _check(user_out, ref_user)
    _check(out, ref_cand)


@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper GPU")
def test_cuda_public_self_target_dispatches_here(monkeypatch):
    """ikbo_self_target_attention at a preferred shape runs launch_ws with the self tiles, without kv_len and
    with kv_len from L = MIN_RAGGED_SELF_SEQ, and is right; with kv_len below it, or with unaligned user_q rows,
    it takes the Triton kernel, also right."""
    from kernels import attention_ws
    from kernels.attention_ws import MIN_RAGGED_SELF_SEQ

    calls = []
    original = attention_ws.launch_ws
    monkeypatch.setattr(
        attention_ws, "launch_ws", lambda *a, **kw: calls.append(kw.get("user_q") is not None) or original(*a, **kw)
    )
    user_q, q, k, v, mapping, kv_len, causal, ref_user, ref_cand = _self_problem(SELF_CASES[0], torch.bfloat16, seed=3)
    assert kv_len is None
    user_out, cand_out = attention.ikbo_self_target_attention(
        user_q, q, k, v, mapping, kv_len, causal=causal, backend="triton"
    )
    assert calls == [True]
    _check(user_out, ref_user)
    _check(cand_out, ref_cand)
    # with kv_len (ragged histories) below L = MIN_RAGGED_SELF_SEQ the untuned op keeps the Triton kernel's fused grid
    ragged = _self_problem(SELF_CASES[1], torch.bfloat16, seed=3)
    assert ragged[2].shape[2] < MIN_RAGGED_SELF_SEQ
    user_out, cand_out = attention.ikbo_self_target_attention(*ragged[:6], causal=ragged[6], backend="triton")
    assert calls == [True]
    _check(user_out, ragged[7])
    _check(cand_out, ragged[8])
    long_ragged = _self_problem((15, 600, 64, MIN_RAGGED_SELF_SEQ, 2, 128, "ragged", 2, True), torch.bfloat16, seed=4)
    user_out, cand_out = attention.ikbo_self_target_attention(*long_ragged[:6], causal=True, backend="triton")
    assert calls == [True, True]
    _check(user_out, long_ragged[7])
    _check(cand_out, long_ragged[8])
    wide = torch.zeros(*user_q.shape[:3], user_q.shape[3] + 4, device="cuda", dtype=user_q.dtype)
    wide[..., : user_q.shape[3]] = user_q
    unaligned = wide[..., 2 : 2 + user_q.shape[3]]  # rows start 4 bytes in: not 16-byte aligned
    unaligned.copy_(user_q)
    assert not self_target_ws_ok(q, q, unaligned, user_q)
    user_out, cand_out = attention.ikbo_self_target_attention(
        unaligned, q, k, v, mapping, kv_len, causal=causal, backend="triton"
    )
    assert calls == [True, True]
    _check(user_out, ref_user)
    _check(cand_out, ref_cand)


@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("ragged", [False, True], ids=["all-keys", "kv_len"])
def test_cuda_self_target_graph_replays(ragged):
    """Self + target through the Gluon kernel captured in a CUDA graph, as the served model replays a tuned
    WS_CHOICE (with kv_len) or the untuned op takes it (without): replays on new values copied into the
    captured inputs (mapping and kv_len too), outputs NaN-poisoned, each against fp64."""
    num_users, num_candidates, num_queries, seq_len, heads, head_dim = 6, 400, 64, 512, 2, 128
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))

    def fresh():
        user_q, k, v = (
            torch.randn(num_users, heads, seq_len, head_dim, generator=gen).to("cuda", torch.bfloat16) for _ in range(3)
        )
        q = torch.randn(num_candidates, heads, num_queries, head_dim, generator=gen).to("cuda", torch.bfloat16)
        mapping = torch.randint(0, num_users, (num_candidates,), generator=gen).cuda()
        kv_len = torch.randint(0, seq_len + 1, (num_users,), generator=gen).cuda() if ragged else None
        return user_q, q, k, v, mapping, kv_len

    static = fresh()
    user_q, q, k, v, mapping, kv_len = static
    scale = 1 / math.sqrt(head_dim)

    def call():
        if ragged:  # a tuned choice: the Gluon kernel with kv_len
            cand_out, user_out, _ = attention._launch(
                q, k, v, mapping, kv_len, scale, user_q, True, config=attention.WS_CHOICE
            )
            return user_out, cand_out
        return attention.ikbo_self_target_attention(user_q, q, k, v, mapping, backend="triton")

    from kernels import attention_ws

    assert attention_ws.prefer_ws(q, k)
    call()  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        user_out, cand_out = call()
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(2):
        for dst, src in zip(static, fresh()):
            if dst is not None:
                dst.copy_(src)
        user_out.fill_(float("nan"))
        cand_out.fill_(float("nan"))
        graph.replay()
        ref_user, ref_cand = attention.ikbo_self_target_attention(
            user_q.double(), q.double(), k.double(), v.double(), mapping, kv_len, backend="torch"
        )
        _check(user_out, ref_user)
        _check(cand_out, ref_cand)
