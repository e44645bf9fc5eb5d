"""LCE variant s5 (Gluon, W_c slice resident in shared memory) against an fp64 reference.

CPU (CI): the module imports, `resident_config` keeps shared memory within one SM, and the kernel
compiles for sm_90a with the wheel's ptxas (wgmma in the PTX; HGMMA and bounded spills in the SASS
where the wheel's cuobjdump is there); skipped cleanly where this Triton cannot compile Gluon for
CUDA. GPU (skipped without a Hopper device): bf16 and fp16 outputs poisoned with NaN, fresh random
inputs, the canonical shape, odd Kc, U = 1, unsorted mappings, users without candidates, D and N
not multiples of the tile, Ku = 0, no bias, Kc = 600 (2 stages); each config option of the kernel.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from kernels.linear_compress import PackedLinearCompress
from kernels.linear_compress_gluon import (
    SMEM_LIMIT,
    ResidentConfig,
    compile_s5,
    lce_s5,
    resident_config,
    s5_supported,
)

BF16_TOL = 1e-2
FP16_TOL = 2e-3
HAS_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def test_resident_config_fits_shared_memory():
    cfg = resident_config(256, 500, 2)
    assert (cfg.block_d, cfg.stages) == (256, 3)
    assert cfg.smem_bytes(500, 2) <= SMEM_LIMIT
    assert resident_config(256, 600, 2).stages == 2  # 10 resident K tiles leave room for 2 slots
    assert resident_config(256, 700, 2) is None  # too large: callers take s3/s4
    assert resident_config(100, 33, 2).block_d == 128
    assert resident_config(100, 33, 2).stages == 2  # one K tile: loads run at most one candidate ahead


def _cuobjdump():
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(tool) if tool.exists() else shutil.which("cuobjdump")


@pytest.mark.parametrize(
    "dim, kc, config, max_stack",
    [
        (256, 500, None, 0),  # canonical
        # the Y_u tile kept across a user's candidates: ~80 B of spills
        (256, 500, ResidentConfig(group_users=True, l2_prefetch=True), 128),
        (200, 499, None, None),  # D not a multiple of the tile: the column mask spills (248 B)
    ],
)
def test_compiles_for_sm90a(dim, kc, config, max_stack):
    """sm_90a without a GPU: shared memory within the limit, wgmma issued, spills bounded."""
    try:
        kernel = compile_s5(num_cand_tokens=kc, dim=dim, config=config)
    except Exception as exc:  # a Triton build without the CUDA backend or ptxas
        pytest.skip(f"cannot compile Gluon for sm_90a here: {type(exc).__name__}: {str(exc)[:200]}")
    assert kernel.metadata.shared <= SMEM_LIMIT
    assert "wgmma.mma_async" in kernel.asm["ptx"]
    tool = _cuobjdump()
    if tool is None:
        return
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp, "s5.cubin")
        cubin.write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([tool, "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    assert "HGMMA.64x" in sass
    if max_stack is not None:
        stack = int(re.search(r"STACK:(\d+)", usage).group(1))
        assert stack <= max_stack, usage


def _ragged_mapping(num_users: int, num_candidates: int, gen: torch.Generator, skip_users: int = 0):
    """Unsorted mapping with unequal counts; the last `skip_users` users get no candidate."""
    active = num_users - skip_users
    weights = torch.rand(active, generator=gen) ** 2 + 0.05
    return torch.multinomial(weights, num_candidates, replacement=True, generator=gen).int()


GPU_SHAPES = [
    # (U, B, Ku, Kc, D, N, bias, users without candidates)
    (15, 1024, 1024, 500, 256, 512, True, 0),  # canonical
    (1, 300, 64, 499, 200, 384, False, 0),  # U = 1, odd Kc, D not a multiple of the tile
    (40, 70, 96, 37, 64, 130, True, 25),  # users without candidates, N not a multiple of 128
    (8, 500, 0, 72, 128, 96, True, 0),  # Ku = 0
    (3, 133, 16, 600, 256, 256, True, 0),  # Kc = 600: 2 stages
]


@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize(
    "dtype, group_users, l2_prefetch",
    [(torch.bfloat16, True, True), (torch.float16, True, True), (torch.bfloat16, False, True), (torch.bfloat16, False, False)],
    ids=["bf16", "fp16", "bf16-strided", "bf16-strided-no-l2"],
)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "U{}-B{}-Ku{}-Kc{}-D{}-N{}".format(*s[:6]))
def test_gpu_s5(shape, dtype, group_users, l2_prefetch):
    num_users, num_candidates, ku, kc, dim, rows, with_bias, skip_users = shape
    gen = torch.Generator().manual_seed(hash((shape, str(dtype), group_users, l2_prefetch)) % 2**31)
    cand_to_user = _ragged_mapping(num_users, num_candidates, gen, skip_users).cuda()
    user_emb = torch.randn(num_users, ku, dim, generator=gen).to("cuda", dtype)
    cand_emb = torch.randn(num_candidates, kc, dim, generator=gen).to("cuda", dtype)
    weight = (torch.randn(rows, ku + kc, generator=gen) / (ku + kc) ** 0.5).to("cuda", dtype)
    bias = torch.randn(rows, generator=gen).to("cuda", dtype) if with_bias else None
    tokens = torch.cat([user_emb.double()[cand_to_user.long()], cand_emb.double()], dim=1)  # test reference only
    ref = torch.matmul(weight.double(), tokens) + (0 if bias is None else bias.double()[:, None])
    packed = PackedLinearCompress.from_weight(weight, ku, bias)
    assert s5_supported(user_emb, cand_emb)
    tol = BF16_TOL if dtype == torch.bfloat16 else FP16_TOL
    base = ResidentConfig(group_users=group_users, l2_prefetch=l2_prefetch)
    config = resident_config(dim, kc, cand_emb.element_size(), base)
    for _ in range(2):  # twice: cached descriptors must serve the second call
        out = torch.full((num_candidates, rows, dim), float("nan"), dtype=dtype, device="cuda")
        user_part = torch.full((num_users, rows, dim), float("nan"), dtype=dtype, device="cuda") if ku else None
        lce_s5(packed, user_emb, cand_emb, cand_to_user, out=out, user_part=user_part, config=config)
        torch.cuda.synchronize()
        assert bool(torch.isfinite(out).all())
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err <= tol, err


@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper GPU")
def test_gpu_s5_not_supported():
    """What s5 leaves to s3/s4: fp32, Kc = 0, Kc too large for the resident slice."""
    user = torch.randn(2, 8, 64, device="cuda", dtype=torch.bfloat16)
    assert not s5_supported(user.float(), torch.randn(4, 16, 64, device="cuda"))
    assert not s5_supported(user, torch.randn(4, 0, 64, device="cuda", dtype=torch.bfloat16))
    assert not s5_supported(user, torch.randn(4, 700, 256, device="cuda", dtype=torch.bfloat16))
