"""LCE variant s6 (Gluon, warp-specialized persistent candidate GEMM) against an fp64 reference.

CPU (CI): `ws_config` keeps shared memory within one SM, and the kernel compiles for sm_90a with the
wheel's ptxas (a 1-warp producer and the consumer warpgroups with `setmaxnreg`, wgmma, TMA loads and
a TMA store; no spills where the wheel's cuobjdump is there); skipped cleanly where this Triton cannot
compile Gluon for CUDA. Gluon does not run under TRITON_INTERPRET, so that is all the CPU can check.
GPU (skipped without a Hopper device): bf16 and fp16 outputs and Y_u poisoned with NaN, fresh random
inputs, the canonical shape, odd Kc, U = 1, unsorted ragged mappings, users without candidates,
D and N not multiples of the tile, one K tile, Ku = 0, no bias; each config the benchmark times; few
programs with many tiles each (the ring's phases wrap many times), in row and in candidate order; the
column-chunked epilogue (`epi_chunk`, 4 ring stages) on every shape.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

import kernels.linear_compress_ws as ws
from kernels.linear_compress import PackedLinearCompress
from kernels.linear_compress_ws import (
    SMEM_LIMIT,
    USER_GEMM_CONFIG,
    WSConfig,
    _launch_ws,
    candidate_major,
    compile_s6,
    lce_s6,
    s6_supported,
    ws_config,
)

BF16_TOL = 1e-2
CHUNKED = WSConfig(stages=0, epi_chunk=64)  # column-chunked epilogue, 4 ring stages at 128 × 256 × 64
FP16_TOL = 2e-3
HAS_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
# LCE_S6_DEFAULT="block_k=32,stages=6,epi_free_at=4" (or "tile_order=candidate"): the GPU tests run with that WSConfig as s6's
# default, so a candidate default is checked on every test shape before it is made the default.
DEFAULT_OVERRIDE = os.environ.get("LCE_S6_DEFAULT", "")


def _parse_config(text: str) -> WSConfig:
    fields = {}
    for item in filter(None, text.split(",")):
        name, value = item.split("=")
        if value in ("True", "False"):
            fields[name] = value == "True"
        else:
            fields[name] = int(value) if value.lstrip("-").isdigit() else value
    return WSConfig(**fields)


@pytest.fixture(autouse=True)
def _s6_default(monkeypatch):
    if DEFAULT_OVERRIDE:
        monkeypatch.setattr(ws, "DEFAULT_CONFIG", _parse_config(DEFAULT_OVERRIDE))
    ws_config.cache_clear()
    yield
    ws_config.cache_clear()


def test_ws_config_fits_shared_memory():
    cfg = ws_config(256, 2)
    assert (cfg.block_m, cfg.block_d, cfg.block_k, cfg.stages) == (128, 256, 64, 3)
    assert cfg.smem_bytes(2) <= SMEM_LIMIT
    assert ws_config(256, 2, WSConfig(block_d=128, stages=0)).stages == 6  # MAX_STAGES
    small = ws_config(64, 2)
    assert small.block_d == 64 and small.smem_bytes(2) <= SMEM_LIMIT
    assert ws_config(256, 2, WSConfig(block_k=32, stages=6)).smem_bytes(2) <= SMEM_LIMIT
    chunked = ws_config(256, 2, WSConfig(stages=0, epi_chunk=64))  # 2 × [128, 64] buffers free a 4th stage
    assert chunked.stages == 4 and chunked.chunk == 64 and chunked.smem_bytes(2) <= SMEM_LIMIT
    assert ws_config(256, 2, WSConfig(block_k=32, stages=8, epi_chunk=64)).smem_bytes(2) <= SMEM_LIMIT
    assert ws_config(48, 2, WSConfig(epi_chunk=64)).chunk == 64  # one chunk of BLOCK_D = 64
    for bad in (WSConfig(epi_chunk=32), WSConfig(epi_chunk=8, block_d=16), WSConfig(epi_chunk=48),
                WSConfig(epi_chunk=64, defer_epilogue=True), WSConfig(epi_chunk=64, split_consumers=True)):
        with pytest.raises(ValueError, match="^epi_chunk"):
            ws_config(256, 2, bad)


def test_candidate_major_only_where_balanced():
    """Candidate order where the busiest program gets no more tiles than in row order, else row order."""
    cand = WSConfig(tile_order="candidate")
    assert candidate_major(cand, 1024, 4, 132)  # canonical: 8 candidates · 4 = 32 = cdiv(4096, 132)
    assert not candidate_major(WSConfig(), 1024, 4, 132)
    assert not candidate_major(cand, 64, 4, 132)  # 4 tiles on one program against 2
    assert not candidate_major(cand, 40, 2, 3) and candidate_major(cand, 39, 2, 3)
    assert candidate_major(cand, 5, 7, 1)
    assert _parse_config("tile_order=candidate,stages=3") == WSConfig(tile_order="candidate", stages=3)
    with pytest.raises(ValueError, match="^tile_order"):
        candidate_major(WSConfig(tile_order="column"), 8, 1, 1)


def _cuobjdump():
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(tool) if tool.exists() else shutil.which("cuobjdump")


@pytest.mark.parametrize(
    "kwargs",
    [
        {},  # canonical: bf16, D = 256, Kc = 500, Y_u and bias
        dict(dtype=torch.float16, dim=200, num_cand_tokens=37, rows=130, has_user=False, has_bias=False),
        dict(config=WSConfig(stages=3, split_consumers=True, defer_epilogue=True, defer_user=True)),
        dict(config=WSConfig(tile_order="candidate")),
        dict(dtype=torch.float16, dim=200, num_cand_tokens=37, rows=130, has_user=False, has_bias=False,
             config=WSConfig(tile_order="candidate")),
        dict(config=CHUNKED),
        dict(dtype=torch.float16, dim=200, num_cand_tokens=37, rows=130, config=CHUNKED),
        dict(dtype=torch.float16, dim=200, num_cand_tokens=37, rows=130, has_user=False, has_bias=False, config=CHUNKED),
        dict(dim=128, config=CHUNKED),  # 2 chunks
        dict(dim=64, rows=130, num_cand_tokens=37, config=CHUNKED),  # 1 chunk
        dict(config=WSConfig(block_k=32, stages=8, epi_chunk=64)),
    ],
    ids=["canonical", "fp16-odd", "split-defer-user", "candidate", "candidate-fp16-odd", "chunk64",
         "chunk64-fp16-odd", "chunk64-fp16-odd-no-user", "chunk64-d128", "chunk64-d64", "chunk64-bk32"],
)
def test_compiles_for_sm90a(kwargs):
    """sm_90a without a GPU: two partitions with register reallocation, wgmma, TMA in and out, no spills."""
    try:
        kernel = compile_s6(**kwargs)
    except Exception as exc:  # a Triton build without the CUDA backend or ptxas
        pytest.skip(f"cannot compile Gluon for sm_90a here: {type(exc).__name__}: {str(exc)[:200]}")
    ptx = kernel.asm["ptx"]
    assert kernel.metadata.shared <= SMEM_LIMIT
    if kwargs.get("config") == CHUNKED and kwargs.get("dim", 256) == 256:
        assert ptx.count("cp.async.bulk.tensor.3d.global.shared::cta") == 4  # one TMA store per 64-column chunk
        assert ptx.count("ld.global.v4.b32") == 16  # the Y_u block, 16-byte loads (64 KiB over 256 threads)
    assert "wgmma.mma_async" in ptx and "setmaxnreg.inc" in ptx
    assert "cp.async.bulk.tensor.3d.global.shared::cta" in ptx  # the TMA store of the output tile
    config = kwargs.get("config") or WSConfig()
    counts = set(re.findall(r"mbarrier\.init\.shared::cta\.b64 \[%r\d+\], (\d+);", ptx))
    assert counts == ({"1", "2"} if config.split_consumers else {"1"}), counts  # one arrive per consumer partition
    tool = _cuobjdump()
    if tool is None:
        return
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp, "s6.cubin")
        cubin.write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([tool, "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
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
    err = ((out.double() - ref).norm() / ref.norm()).item()
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
    WSConfig(epi_free_at=1),
    WSConfig(block_k=32, stages=6, epi_free_at=4),
    WSConfig(block_d=128, stages=0),
    WSConfig(block_d=128, stages=0, defer_epilogue=True),
    WSConfig(block_k=32, stages=6, epi_free_at=4, mma_depth=2),
    WSConfig(stages=3, defer_epilogue=True),
    WSConfig(stages=3, defer_epilogue=True, defer_user=True),
    WSConfig(block_k=32, stages=6, epi_free_at=4, mma_depth=2, defer_epilogue=True, defer_user=True),
    WSConfig(stages=3, split_consumers=True),
    WSConfig(stages=3, split_consumers=True, defer_epilogue=True, defer_user=True),
    WSConfig(tile_order="candidate"),
    WSConfig(block_k=32, stages=6, epi_free_at=4, tile_order="candidate"),
    WSConfig(stages=3, defer_epilogue=True, defer_user=True, tile_order="candidate"),
    WSConfig(stages=3, epi_chunk=64),
    WSConfig(block_k=32, stages=8, epi_chunk=64),
    WSConfig(stages=0, epi_chunk=64, tile_order="candidate"),
]
CONFIG_IDS = ["free-at-1", "bk32-st6", "bd128", "bd128-defer", "bk32-depth2", "defer", "defer-user", "bk32-depth2-defer-user",
              "split", "split-defer-user", "candidate", "candidate-bk32", "candidate-defer-user", "chunk64-st3",
              "chunk64-bk32-st8", "chunk64-candidate"]


@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "U{}-B{}-Ku{}-Kc{}-D{}-N{}".format(*s[:6]))
def test_gpu_s6(shape, dtype):
    _run_shape(shape, dtype, None)


@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "U{}-B{}-Ku{}-Kc{}-D{}-N{}".format(*s[:6]))
def test_gpu_s6_chunk64(shape, dtype):
    """The column-chunked epilogue (Y_u read by the consumer, 4 ring stages) on every test shape."""
    _run_shape(shape, dtype, CHUNKED)


def _run_shape(shape, dtype, config):
    user_emb, cand_emb, cand_to_user, packed, ref = _problem(shape, dtype, hash((shape, str(dtype))) % 2**31)
    assert s6_supported(user_emb, cand_emb)
    num_users, num_candidates, ku, _, dim, rows = shape[:6]
    for _ in range(2):  # twice: cached descriptors must serve the second call
        out = torch.full((num_candidates, rows, dim), float("nan"), dtype=dtype, device="cuda")
        user_part = torch.full((num_users, rows, dim), float("nan"), dtype=dtype, device="cuda") if ku else None
        lce_s6(packed, user_emb, cand_emb, cand_to_user, out=out, user_part=user_part, config=config)
        _check(out, ref, dtype)


@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("config", CONFIGS[1:], ids=CONFIG_IDS)
def test_gpu_s6_configs(config):
    for shape in (GPU_SHAPES[0], GPU_SHAPES[2]):
        user_emb, cand_emb, cand_to_user, packed, ref = _problem(shape, torch.bfloat16, 7)
        out = torch.full_like(ref, float("nan"), dtype=torch.bfloat16)
        lce_s6(packed, user_emb, cand_emb, cand_to_user, out=out, config=config)
        _check(out, ref, torch.bfloat16)


@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("num_programs", [1, 3])
@pytest.mark.parametrize(
    "base",
    [None, WSConfig(block_d=128, stages=0, defer_epilogue=True),
     WSConfig(block_k=32, stages=6, epi_free_at=4, mma_depth=2, defer_epilogue=True, defer_user=True),
     WSConfig(stages=3, split_consumers=True, defer_epilogue=True, defer_user=True),
     WSConfig(tile_order="candidate"), WSConfig(stages=3, defer_epilogue=True, defer_user=True, tile_order="candidate"),
     CHUNKED],
    ids=["default", "bd128-defer", "bk32-depth2-defer-user", "split-defer-user", "candidate", "candidate-defer-user",
         "chunk64"],
)
def test_gpu_s6_few_programs(num_programs, base):
    """Few persistent programs, many tiles each: ring and epilogue-buffer phases wrap many times.
    39 candidates of 2 tiles: candidate order is balanced on 1 and on 3 programs (26 tiles each)."""
    shape = (5, 39, 32, 200, 256, 256, True, 1)
    user_emb, cand_emb, cand_to_user, packed, ref = _problem(shape, torch.bfloat16, 11 + num_programs)
    user_part = torch.full((5, 256, 256), float("nan"), dtype=torch.bfloat16, device="cuda")
    packed._launch_tile(packed.user_weight_padded, user_emb, user_part, None, False, True, USER_GEMM_CONFIG)
    out = torch.full_like(ref, float("nan"), dtype=torch.bfloat16)
    config = ws_config(256, 2, base)
    assert candidate_major(config, 39, 2, num_programs) == (config.tile_order == "candidate")
    _launch_ws(packed, cand_emb, out, user_part, cand_to_user, packed.bias, config, num_programs)
    _check(out, ref, torch.bfloat16)


@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper GPU")
def test_gpu_s6_not_supported():
    """What s6 leaves to s3/s4: fp32, Kc = 0, rows of D that TMA cannot address (D·2 bytes not a multiple of 16)."""
    user = torch.randn(2, 8, 64, device="cuda", dtype=torch.bfloat16)
    assert not s6_supported(user.float(), torch.randn(4, 16, 64, device="cuda"))
    assert not s6_supported(user, torch.randn(4, 0, 64, device="cuda", dtype=torch.bfloat16))
    assert not s6_supported(user, torch.randn(4, 16, 100, device="cuda", dtype=torch.bfloat16))


def test_public_variant_s6_on_cpu():
    """variant "s6" is accepted by the public op (torch path on the CPU); a TileConfig is refused for it."""
    from kernels.linear_compress import TileConfig, ikbo_linear_compress

    gen = torch.Generator().manual_seed(5)
    user_emb, cand_emb = torch.randn(2, 8, 16, generator=gen), torch.randn(5, 6, 16, generator=gen)
    cand_to_user = torch.tensor([1, 0, 1, 1, 0], dtype=torch.int32)
    weight, bias = torch.randn(12, 14, generator=gen), torch.randn(12, generator=gen)
    ref = ikbo_linear_compress(user_emb, cand_emb, cand_to_user, weight, bias, backend="torch")
    out = ikbo_linear_compress(user_emb, cand_emb, cand_to_user, weight, bias, backend="torch", variant="s6")
    torch.testing.assert_close(out, ref)
    packed = PackedLinearCompress.from_weight(weight, 8, bias)
    with pytest.raises(ValueError, match=r"^config:"):
        packed._triton(user_emb, cand_emb, cand_to_user, "s6", config=TileConfig(16, 16, 16))


@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper GPU")
def test_gpu_public_variant_s6_and_fallback():
    """The public op with variant "s6": s6 where supported, s3 otherwise (fp32, D·2 bytes not a multiple of 16)."""
    for dtype, dim in ((torch.bfloat16, 256), (torch.float32, 64), (torch.bfloat16, 100)):
        shape = (6, 90, 40, 33, dim, 128, True, 1)
        user_emb, cand_emb, cand_to_user, packed, ref = _problem(shape, dtype, 21)
        out = packed(user_emb, cand_emb, cand_to_user, backend="triton", variant="s6")
        tol = 1e-3 if dtype == torch.float32 else BF16_TOL
        assert ((out.double() - ref).norm() / ref.norm()).item() <= tol, (dtype, dim)


@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper GPU")
def test_gpu_s6_cuda_graph():
    """s6 captured in a CUDA graph (no per-call state): replays with new inputs copied in place are right."""
    shape = (15, 256, 128, 500, 256, 512, True, 0)
    user_emb, cand_emb, cand_to_user, packed, _ = _problem(shape, torch.bfloat16, 31)
    packed._triton(user_emb, cand_emb, cand_to_user, "s6")  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = packed._triton(user_emb, cand_emb, cand_to_user, "s6")
    for seed in (41, 42):
        new_user, new_cand, new_map, _, _ = _problem(shape, torch.bfloat16, seed)
        user_emb.copy_(new_user)
        cand_emb.copy_(new_cand)
        cand_to_user.copy_(new_map)
        out.fill_(float("nan"))
        graph.replay()
        tokens = torch.cat([user_emb.double()[cand_to_user.long()], cand_emb.double()], dim=1)
        weight = torch.cat([packed.user_weight, packed.cand_weight], dim=1).double()
        ref = torch.matmul(weight, tokens) + packed.bias.double()[:, None]
        _check(out, ref, torch.bfloat16)
