"""LCE variant s7 (Gluon, pingpong consumers) against an fp64 reference.

CPU (CI): `s7_config` keeps shared memory within one SM, and the kernel compiles for sm_90a with the
wheel's ptxas (two one-warpgroup consumers and a 1-warp producer with `setmaxnreg`, wgmma, TMA loads,
one TMA store per consumer, no spills where the wheel's cuobjdump is there); skipped where this
Triton cannot compile Gluon for CUDA. Gluon does not run under TRITON_INTERPRET.
GPU (skipped without a Hopper device): bf16 and fp16, outputs and Y_u poisoned with NaN before each
run, fresh random inputs: the canonical shape, U = 1 with odd Kc and D, users without candidates,
unsorted ragged mappings, N and D not multiples of the tile, one K tile (ring deeper than a tile),
Kc = 600 (more K steps than ring slots), Ku = 0, no bias; every config the benchmark times; 1–3
programs with many tiles each (ring, epilogue-buffer and order-barrier phases wrap many times, odd
tile counts leave consumer 1 a tile short); ten calls on the same inputs bit-identical; a CUDA-graph
capture. s7 is not dispatched by the public op (it measured no faster than s6, docs/notes/lce.md), so
the tests call `lce_s7`.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from kernels.linear_compress import PackedLinearCompress
from kernels.linear_compress_pingpong import PingPongConfig, _launch_pingpong, compile_s7, lce_s7, s7_config
from kernels.linear_compress_ws import SMEM_LIMIT, USER_GEMM_CONFIG, s6_supported
from test_linear_compress_ws import GPU_SHAPES, HAS_HOPPER, _check, _cuobjdump, _problem

CONFIGS = [  # the benchmark's s7 alternatives (scripts/bench_lce.py S7_EXTRA_CONFIGS)
    PingPongConfig(stages=4),
    PingPongConfig(epi_free_at=0),
    PingPongConfig(epi_free_at=2),
    PingPongConfig(block_m=64, block_d=256),
    PingPongConfig(block_k=32),
    PingPongConfig(producer_regs=24, consumer_regs=240),
]
CONFIG_IDS = ["st4", "free-at-0", "free-at-2", "bm64-bd256", "bk32", "regs-240-24"]


def test_s7_config_fits_shared_memory():
    cfg = s7_config(256, 2)
    assert (cfg.block_m, cfg.block_d, cfg.block_k, cfg.stages) == (128, 128, 64, 5)
    assert cfg.smem_bytes(2) <= SMEM_LIMIT
    wide = s7_config(256, 2, PingPongConfig(block_m=64, block_d=256))
    assert wide.stages == 4 and wide.smem_bytes(2) <= SMEM_LIMIT
    small = s7_config(64, 2)
    assert small.block_d == 64 and small.smem_bytes(2) <= SMEM_LIMIT
    for config in CONFIGS:
        assert s7_config(256, 2, config).smem_bytes(2) <= SMEM_LIMIT


@pytest.mark.parametrize(
    "kwargs",
    [
        {},  # canonical: bf16, D = 256, Kc = 500, Y_u and bias
        dict(dtype=torch.float16, dim=200, num_cand_tokens=37, rows=130, has_user=False, has_bias=False),
        dict(config=PingPongConfig(block_m=64, block_d=256)),
    ],
    ids=["canonical", "fp16-odd", "bm64-bd256"],
)
def test_compiles_for_sm90a(kwargs):
    """sm_90a without a GPU: three partitions with register reallocation, wgmma, TMA in and out, no spills."""
    try:
        kernel = compile_s7(**kwargs)
    except Exception as exc:  # a Triton build without the CUDA backend or ptxas
        pytest.skip(f"cannot compile Gluon for sm_90a here: {type(exc).__name__}: {str(exc)[:200]}")
    ptx = kernel.asm["ptx"]
    assert kernel.metadata.shared <= SMEM_LIMIT
    assert "wgmma.mma_async" in ptx and "setmaxnreg.inc" in ptx
    assert ptx.count("cp.async.bulk.tensor.3d.global.shared::cta") == 2  # one TMA store per consumer
    tool = _cuobjdump()
    if tool is None:
        return
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp, "s7.cubin")
        cubin.write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([tool, "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    assert "HGMMA.64x" in sass and sass.count("UTMASTG") == 2
    assert int(re.search(r"STACK:(\d+)", usage).group(1)) == 0, usage
    assert "LDL" not in sass and "STL" not in sass


GPU_SHAPES_S7 = GPU_SHAPES + [
    # (U, B, Ku, Kc, D, N, bias, users without candidates)
    (1, 1, 32, 40, 128, 128, True, 0),  # one candidate, one tile: consumer 1 idle
    (16, 2000, 48, 64, 256, 512, True, 3),  # one K tile, many tiles per program, unsorted ragged mapping
]


@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", GPU_SHAPES_S7, ids=lambda s: "U{}-B{}-Ku{}-Kc{}-D{}-N{}".format(*s[:6]))
def test_gpu_s7(shape, dtype):
    user_emb, cand_emb, cand_to_user, packed, ref = _problem(shape, dtype, hash((shape, str(dtype), "s7")) % 2**31)
    assert s6_supported(user_emb, cand_emb)
    num_users, num_candidates, ku, _, dim, rows = shape[:6]
    for _ in range(2):  # twice: cached descriptors must serve the second call
        out = torch.full((num_candidates, rows, dim), float("nan"), dtype=dtype, device="cuda")
        user_part = torch.full((num_users, rows, dim), float("nan"), dtype=dtype, device="cuda") if ku else None
        lce_s7(packed, user_emb, cand_emb, cand_to_user, out=out, user_part=user_part)
        _check(out, ref, dtype)


@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_gpu_s7_configs(config):
    for shape in (GPU_SHAPES[0], GPU_SHAPES[2], GPU_SHAPES[4]):
        user_emb, cand_emb, cand_to_user, packed, ref = _problem(shape, torch.bfloat16, 17)
        out = torch.full_like(ref, float("nan"), dtype=torch.bfloat16)
        lce_s7(packed, user_emb, cand_emb, cand_to_user, out=out, config=config)
        _check(out, ref, torch.bfloat16)


@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("num_programs", [1, 2, 3])
@pytest.mark.parametrize("kc", [200, 37], ids=["4-ktiles", "1-ktile"])
def test_gpu_s7_few_programs(num_programs, kc):
    """Few persistent programs, many tiles each (an odd count with 3 programs): ring, epilogue-buffer
    and order-barrier phases wrap many times; at one K tile the ring holds several tiles."""
    shape = (5, 41, 32, kc, 256, 256, True, 1)
    user_emb, cand_emb, cand_to_user, packed, ref = _problem(shape, torch.bfloat16, 23 + num_programs + kc)
    user_part = torch.full((5, 256, 256), float("nan"), dtype=torch.bfloat16, device="cuda")
    packed._launch_tile(packed.user_weight_padded, user_emb, user_part, None, False, True, USER_GEMM_CONFIG)
    out = torch.full_like(ref, float("nan"), dtype=torch.bfloat16)
    _launch_pingpong(packed, cand_emb, out, user_part, cand_to_user, packed.bias, s7_config(256, 2), num_programs)
    _check(out, ref, torch.bfloat16)


@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper GPU")
def test_gpu_s7_repeated_calls_stable():
    """The same inputs ten times into NaN-poisoned outputs: bit-identical results (a race would move them)."""
    user_emb, cand_emb, cand_to_user, packed, ref = _problem(GPU_SHAPES[0], torch.bfloat16, 29)
    first = None
    for _ in range(10):
        out = torch.full_like(ref, float("nan"), dtype=torch.bfloat16)
        lce_s7(packed, user_emb, cand_emb, cand_to_user, out=out)
        _check(out, ref, torch.bfloat16)
        if first is None:
            first = out
        assert torch.equal(out, first)


@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper GPU")
def test_gpu_s7_cuda_graph():
    """s7 captured in a CUDA graph (no per-call state): replays with new inputs copied in place are right."""
    shape = (15, 256, 128, 500, 256, 512, True, 0)
    user_emb, cand_emb, cand_to_user, packed, _ = _problem(shape, torch.bfloat16, 43)
    lce_s7(packed, user_emb, cand_emb, cand_to_user)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lce_s7(packed, user_emb, cand_emb, cand_to_user)
    for seed in (47, 48):
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
