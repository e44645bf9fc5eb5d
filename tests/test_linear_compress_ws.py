"""LCE variant warp_specialized (Gluon, warp-specialized persistent candidate GEMM) against an fp64 reference.

CPU (CI): `ws_config` keeps shared memory within one SM, and the kernel compiles for sm_90a with the
wheel's ptxas (a 1-warp producer and the consumer warpgroups with `setmaxnreg`, wgmma, TMA loads and
a TMA store; no spills where the wheel's cuobjdump is there); skipped cleanly where this Triton cannot
compile Gluon for CUDA. Gluon does not run under TRITON_INTERPRET, so that is all the CPU can check.
GPU (skipped without a Hopper device): bf16 and fp16 outputs and Y_u poisoned with NaN, fresh random
inputs, the canonical shape, odd Kc, U = 1, unsorted ragged mappings, users without candidates,
D and N not multiples of the tile, one K tile, Ku = 0, no bias; each config the benchmark times; few
programs with many tiles each (the ring's phases wrap many times).
"""

from __future__ import annotations

import os
import re
from dataclasses import replace

import pytest
import torch
from sm90 import compiled_or_skip

import kernels.linear_compress_ws as ws
from kernels._hopper import SMEM_LIMIT
from kernels.devtools import compile_linear_compress_ws, disassemble
from kernels.linear_compress import PackedLinearCompress
from kernels.linear_compress_ws import WSConfig, _launch_kernel, launch_ws, user_gemm, ws_config, ws_supported
from kernels.reference import rel_err

BF16_TOL = 1e-2
FP16_TOL = 2e-3
HAS_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
# LCE_WS_DEFAULT="stages=3,epi_free_at=2": the GPU tests run with that WSConfig as the kernel's default,
# so a candidate default is checked on every test shape before it is made the default.
DEFAULT_OVERRIDE = os.environ.get("LCE_WS_DEFAULT", "")


def _parse_config(text: str) -> WSConfig:
    """ "name=value,…" (integer WSConfig fields) → WSConfig."""
    return WSConfig(**{name: int(value) for name, value in (item.split("=") for item in filter(None, text.split(",")))})


@pytest.fixture(autouse=True)
def _ws_default(monkeypatch):
    if DEFAULT_OVERRIDE:
        monkeypatch.setattr(ws, "DEFAULT_CONFIG", _parse_config(DEFAULT_OVERRIDE))
    ws_config.cache_clear()
    yield
    ws_config.cache_clear()


def test_ws_config_fits_shared_memory():
    cfg = ws_config(256, 2)
    assert (cfg.block_m, cfg.block_d, cfg.block_k) == (128, 256, 64)
    if not DEFAULT_OVERRIDE:  # 4 × 48 KiB ring + the 32 KiB half epilogue buffer; a 5th stage does not fit
        assert cfg.stages == 4 and cfg.smem_bytes(2) <= SMEM_LIMIT < replace(cfg, stages=5).smem_bytes(2)
    assert ws_config(256, 2, WSConfig(block_d=128, stages=0)).stages == 6  # MAX_STAGES
    small = ws_config(64, 2)
    assert small.block_d == 64 and small.smem_bytes(2) <= SMEM_LIMIT
    with pytest.raises(ValueError, match="block_m .* must be 2 · block_k"):  # a Y_u half fills one cand_emb slot
        ws_config(256, 2, WSConfig(block_k=32, stages=6))


def test_default_override_parser():
    """LCE_WS_DEFAULT as written for a candidate default (its fields that differ from WSConfig())."""
    assert _parse_config("stages=3,epi_free_at=2") == WSConfig(stages=3, epi_free_at=2)
    assert _parse_config("") == WSConfig()


@pytest.mark.parametrize(
    "kwargs",
    [
        {},  # canonical: bf16, D = 256, Kc = 500, Y_u and bias
        dict(dtype=torch.float16, dim=200, num_cand_tokens=37, rows=130, has_user=False, has_bias=False),
        dict(dtype=torch.float16, dim=200, num_cand_tokens=37, rows=130),
        dict(config=WSConfig(block_d=128, stages=0)),  # 6 stages
        dict(config=WSConfig(stages=2)),
    ],
    ids=["canonical", "fp16-odd-no-user", "fp16-odd", "bd128", "st2"],
)
def test_compiles_for_sm90a(kwargs):
    """sm_90a without a GPU: two partitions with register reallocation, wgmma, TMA in and out, no spills."""
    kernel = compiled_or_skip(compile_linear_compress_ws, **kwargs)
    ptx = kernel.asm["ptx"]
    assert kernel.metadata.shared <= SMEM_LIMIT
    assert "wgmma.mma_async" in ptx and "setmaxnreg.inc" in ptx
    assert "cp.async.bulk.tensor.3d.global.shared::cta" in ptx  # the TMA store of the output tile
    counts = set(re.findall(r"mbarrier\.init\.shared::cta\.b64 \[%r\d+\], (\d+);", ptx))
    assert counts == {"1"}, counts  # one arrive per barrier phase (one consumer partition)
    disassembled = disassemble(kernel)
    if disassembled is None:
        return
    sass, usage = disassembled
    assert "HGMMA.64x" in sass and "UTMASTG" in sass
    assert int(re.search(r"STACK:(\d+)", usage).group(1)) == 0, usage
    assert "LDL" not in sass and "STL" not in sass


def _ragged_mapping(num_users: int, num_candidates: int, gen: torch.Generator, skip_users: int = 0):
    """Unsorted mapping with unequal counts; the last `skip_users` users get no candidate."""
    weights = torch.rand(num_users - skip_users, generator=gen) ** 2 + 0.05
    return torch.multinomial(weights, num_candidates, replacement=True, generator=gen).int()


def _problem(shape, dtype, seed):
    num_users, num_candidates, ku, kc, dim, rows, with_bias, skip_users = shape
    gen = torch.Generator().manual_seed(seed)
    cand_to_user = _ragged_mapping(num_users, num_candidates, gen, skip_users).cuda()
    user_emb = torch.randn(num_users, ku, dim, generator=gen).to("cuda", dtype)
    cand_emb = torch.randn(num_candidates, kc, dim, generator=gen).to("cuda", dtype)
    weight = (torch.randn(rows, ku + kc, generator=gen) / (ku + kc) ** 0.5).to("cuda", dtype)
    bias = torch.randn(rows, generator=gen).to("cuda", dtype) if with_bias else None
    tokens = torch.cat([user_emb.double()[cand_to_user.long()], cand_emb.double()], dim=1)  # test reference only
    ref = torch.matmul(weight.double(), tokens) + (0 if bias is None else bias.double()[:, None])
    return user_emb, cand_emb, cand_to_user, PackedLinearCompress.from_weight(weight, ku, bias), ref


def _check(out, ref, dtype):
    torch.cuda.synchronize()
    assert bool(torch.isfinite(out).all()), "unwritten (NaN) outputs"
    err = rel_err(out, ref)
    assert err <= (BF16_TOL if dtype == torch.bfloat16 else FP16_TOL), err


GPU_SHAPES = [
    # (U, B, Ku, Kc, D, N, bias, users without candidates)
    (15, 1024, 1024, 500, 256, 512, True, 0),  # canonical
    (1, 300, 64, 499, 200, 384, False, 0),  # U = 1, odd Kc, D not a multiple of the tile
    (40, 70, 96, 37, 64, 130, True, 25),  # one K tile, users without candidates, N not a multiple of 128
    (8, 500, 0, 72, 128, 96, True, 0),  # Ku = 0
    (3, 133, 16, 600, 256, 256, True, 0),  # Kc = 600: 10 K tiles
]
CONFIGS = [
    None,
    WSConfig(epi_free_at=2),
    WSConfig(epi_free_at=0),
    WSConfig(block_d=128, stages=0),
    WSConfig(stages=2),
    WSConfig(stages=3),
]
CONFIG_IDS = ["free-at-2", "free-at-0", "bd128", "st2", "st3"]


@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "U{}-B{}-Ku{}-Kc{}-D{}-N{}".format(*s[:6]))
def test_gpu_warp_specialized(shape, dtype):
    user_emb, cand_emb, cand_to_user, packed, ref = _problem(shape, dtype, hash((shape, str(dtype))) % 2**31)
    assert ws_supported(user_emb, cand_emb)
    num_users, num_candidates, ku, _, dim, rows = shape[:6]
    for _ in range(2):  # twice: cached descriptors must serve the second call
        out = torch.full((num_candidates, rows, dim), float("nan"), dtype=dtype, device="cuda")
        user_part = torch.full((num_users, rows, dim), float("nan"), dtype=dtype, device="cuda") if ku else None
        launch_ws(packed, user_emb, cand_emb, cand_to_user, out=out, user_part=user_part)
        _check(out, ref, dtype)


@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("config", CONFIGS[1:], ids=CONFIG_IDS)
def test_gpu_warp_specialized_configs(config):
    for shape in (GPU_SHAPES[0], GPU_SHAPES[2]):
        user_emb, cand_emb, cand_to_user, packed, ref = _problem(shape, torch.bfloat16, 7)
        out = torch.full_like(ref, float("nan"), dtype=torch.bfloat16)
        launch_ws(packed, user_emb, cand_emb, cand_to_user, out=out, config=config)
        _check(out, ref, torch.bfloat16)


@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("num_programs", [1, 3])
@pytest.mark.parametrize(
    "base",
    [None, WSConfig(block_d=128, stages=0), WSConfig(stages=2)],
    ids=["default", "bd128", "st2"],
)
def test_gpu_warp_specialized_few_programs(num_programs, base):
    """Few persistent programs, many tiles each: ring and epilogue-buffer phases wrap many times
    (39 candidates of 2 tiles, 4 at BLOCK_D = 128, on 1 or 3 programs)."""
    shape = (5, 39, 32, 200, 256, 256, True, 1)
    user_emb, cand_emb, cand_to_user, packed, ref = _problem(shape, torch.bfloat16, 11 + num_programs)
    user_part = torch.full((5, 256, 256), float("nan"), dtype=torch.bfloat16, device="cuda")
    user_gemm(packed, user_emb, user_part)
    out = torch.full_like(ref, float("nan"), dtype=torch.bfloat16)
    _launch_kernel(packed, cand_emb, out, user_part, cand_to_user, packed.bias, ws_config(256, 2, base), num_programs)
    _check(out, ref, torch.bfloat16)


def _check_graph_replays(shape, seed, call):
    """`call(packed, user_emb, cand_emb, cand_to_user)` captured in a CUDA graph (after one eager call
    that compiles), then replayed twice with new inputs copied in place and the output NaN-poisoned
    before each replay: against fp64 each time."""
    user_emb, cand_emb, cand_to_user, packed, _ = _problem(shape, torch.bfloat16, seed)
    call(packed, user_emb, cand_emb, cand_to_user)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call(packed, user_emb, cand_emb, cand_to_user)
    for new_seed in (seed + 10, seed + 11):
        new_user, new_cand, new_map, _, _ = _problem(shape, torch.bfloat16, new_seed)
        user_emb.copy_(new_user)
        cand_emb.copy_(new_cand)
        cand_to_user.copy_(new_map)
        out.fill_(float("nan"))
        graph.replay()
        tokens = torch.cat([user_emb.double()[cand_to_user.long()], cand_emb.double()], dim=1)
        weight = torch.cat([packed.user_weight, packed.cand_weight], dim=1).double()
        ref = torch.matmul(weight, tokens) + packed.bias.double()[:, None]
        _check(out, ref, torch.bfloat16)


@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper GPU")
def test_gpu_warp_specialized_not_supported():
    """What the kernel leaves to fused: fp32, Kc = 0, rows of D that TMA cannot address (D·2 bytes not a multiple of
    16)."""
    user = torch.randn(2, 8, 64, device="cuda", dtype=torch.bfloat16)
    assert not ws_supported(user.float(), torch.randn(4, 16, 64, device="cuda"))
    assert not ws_supported(user, torch.randn(4, 0, 64, device="cuda", dtype=torch.bfloat16))
    assert not ws_supported(user, torch.randn(4, 16, 100, device="cuda", dtype=torch.bfloat16))


def test_public_variant_warp_specialized_on_cpu():
    """variant "warp_specialized" is accepted by the public op (torch path on the CPU), the old name "s6" is refused
    naming the valid ones, and a TileConfig is refused for it."""
    from kernels.configs import TileConfig
    from kernels.linear_compress import ikbo_linear_compress

    gen = torch.Generator().manual_seed(5)
    user_emb, cand_emb = torch.randn(2, 8, 16, generator=gen), torch.randn(5, 6, 16, generator=gen)
    cand_to_user = torch.tensor([1, 0, 1, 1, 0], dtype=torch.int32)
    weight, bias = torch.randn(12, 14, generator=gen), torch.randn(12, generator=gen)
    ref = ikbo_linear_compress(user_emb, cand_emb, cand_to_user, weight, bias, backend="torch")
    out = ikbo_linear_compress(
        user_emb, cand_emb, cand_to_user, weight, bias, backend="torch", variant="warp_specialized"
    )
    torch.testing.assert_close(out, ref)
    with pytest.raises(ValueError, match=r"^variant: expected one of .*'warp_specialized'.*got 's6'"):
        ikbo_linear_compress(user_emb, cand_emb, cand_to_user, weight, bias, backend="torch", variant="s6")
    packed = PackedLinearCompress.from_weight(weight, 8, bias)
    with pytest.raises(ValueError, match=r"^config:"):
        packed._triton(
            user_emb,
            cand_emb,
            cand_to_user,
            "warp_specialized",
            config=TileConfig(16, 16, 16, num_warps=4, num_stages=1),
        )


@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper GPU")
def test_gpu_public_variant_warp_specialized_and_fallback():
    """The public op with variant "warp_specialized": the kernel where supported, fused otherwise (fp32, D·2 bytes not
    a multiple of 16)."""
    for dtype, dim in ((torch.bfloat16, 256), (torch.float32, 64), (torch.bfloat16, 100)):
        shape = (6, 90, 40, 33, dim, 128, True, 1)
        user_emb, cand_emb, cand_to_user, packed, ref = _problem(shape, dtype, 21)
        out = packed(user_emb, cand_emb, cand_to_user, backend="triton", variant="warp_specialized")
        tol = 1e-3 if dtype == torch.float32 else BF16_TOL
        assert rel_err(out, ref) <= tol, (dtype, dim)


def test_default_variant_takes_warp_specialized_where_it_runs():
    """Untuned, the op takes warp_specialized where it runs from WS_MIN_CANDIDATES candidates up, else fused or
    persistent as without it."""
    from kernels.linear_compress import WS_MIN_CANDIDATES, default_variant

    for users, cands in ((15, 1024), (1, WS_MIN_CANDIDATES), (WS_MIN_CANDIDATES, WS_MIN_CANDIDATES), (241, 16384)):
        assert default_variant(users, cands, ws_runs=True) == "warp_specialized", (users, cands)
        assert default_variant(users, cands) in ("fused", "persistent"), (users, cands)
    for users, cands in ((1, WS_MIN_CANDIDATES - 1), (64, 64), (16, 64)):
        assert default_variant(users, cands, ws_runs=True) == default_variant(users, cands), (users, cands)


@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize(
    "dtype, num_candidates, dim, expect_ws",
    [
        (torch.bfloat16, 1024, 256, True),
        (torch.float16, 300, 128, True),
        (torch.bfloat16, 200, 256, False),  # under WS_MIN_CANDIDATES
        (torch.bfloat16, 600, 100, False),  # D·2 bytes not a multiple of 16: the kernel does not run
        (torch.float32, 600, 256, False),
    ],
)
def test_gpu_public_default_dispatch(monkeypatch, dtype, num_candidates, dim, expect_ws):
    """With no variant and nothing tuned the public op launches the warp-specialized kernel exactly where
    default_variant says so, and the result matches fp64 either way."""
    launched = []
    real = ws.launch_ws
    monkeypatch.setattr(ws, "launch_ws", lambda *a, **k: launched.append(1) or real(*a, **k))
    shape = (15, num_candidates, 96, 72, dim, 256, True, 1)
    user_emb, cand_emb, cand_to_user, packed, ref = _problem(shape, dtype, 41)
    out = packed(user_emb, cand_emb, cand_to_user, backend="triton")
    tol = 1e-3 if dtype == torch.float32 else BF16_TOL
    assert rel_err(out, ref) <= tol
    assert bool(launched) == expect_ws


@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper GPU")
def test_gpu_warp_specialized_cuda_graph():
    """The warp-specialized variant captured in a CUDA graph (no per-call state): replays with new inputs copied in
    place are right."""
    shape = (15, 256, 128, 500, 256, 512, True, 0)
    _check_graph_replays(shape, 31, lambda packed, *inputs: packed._triton(*inputs, "warp_specialized"))
