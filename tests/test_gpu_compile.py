"""The GPU launch paths compiled on the CPU, as an H200 would compile them (skipped where CUDA is present: the GPU
tests compile for real there).

The real host code of `attention_ws.launch_ws` (the Gluon kernel, with and without self tiles), `attention._launch`
(the Triton kernel, both of `pick_config`'s tile configs) and the LCE variants fused and persistent (and
warp_specialized, which takes fused on CPU tensors: `linear_compress_ws.ws_supported` needs CUDA; its kernel
compiles in tests/test_linear_compress_ws.py) runs on CPU tensors under a stand-in Triton driver whose launcher does
nothing: the descriptors, Triton's binder and its specialization of every argument (an integer equal to 1 becomes
a constant, multiples of 16 are marked), the compile, and the wheel's ptxas for sm_90a. The problems are
tests/test_gpu_drawn.py's drawn specs, so the specializations that requests reach get compiled in CI (at L = 1
Triton would make seq_len a constant, on which ptxas fails: `attention._attention_kernel` keeps it unspecialized).
Nothing runs, so no result is checked here. The stand-in must not leak into other tests:
these run in a child pytest. Drawn examples per path: $IKBO_COMPILE_EXAMPLES (default 8).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from interpreted import run_child_tests
from test_gpu_drawn import AttentionSpec, LCESpec, attention_specs, lce_specs

STANDIN = os.environ.get("IKBO_STANDIN_DRIVER") == "1"
COMPILES = settings(max_examples=int(os.environ.get("IKBO_COMPILE_EXAMPLES", "8")), deadline=None,
                    suppress_health_check=list(HealthCheck), print_blob=True)  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests compile these kernels for real")
def test_gpu_paths_compile_on_cpu():
    try:
        from kernels.devtools import compile_attention_ws

        compile_attention_ws(has_kv_len=False)
    except Exception as exc:
        pytest.skip(f"cannot compile for sm_90a here: {type(exc).__name__}: {str(exc)[:200]}")
    run_child_tests(__file__, "standin_", {"IKBO_STANDIN_DRIVER": "1"}, timeout=1500)


@pytest.fixture(scope="module")
def standin_driver():
    """Triton's driver replaced for this child process (`kernels.devtools.install_standin_driver`: an H200, sm_90)."""
    from kernels.devtools import install_standin_driver

    install_standin_driver()


L1 = AttentionSpec(2, 3, 1, 1, 1, 64, None, "contiguous", "bf16", "int32", 0, "default", None, 0)  # L = 1


# S and L multiples of 64, contiguous: q, out, user_q and user_out rows by TMA (`rows_by_tma`, `self_rows_by_tma`)
ROWS_TMA = AttentionSpec(3, 5, 64, 128, 2, 128, "int32", "contiguous", "bf16", "int32", 0, "default", None, 1)


@pytest.mark.skipif(not STANDIN, reason="runs in test_gpu_paths_compile_on_cpu's child process")
@COMPILES
@given(spec=attention_specs())
@example(spec=ROWS_TMA)
def test_standin_gluon_attention_compiles(standin_driver, spec):
    """The Gluon kernel, target-only and with self tiles (rows gathered, and by TMA where they can be)."""
    from kernels.attention_ws import launch_ws

    q, user_q, k, v, cand_to_user, kv_len = spec.tensors("cpu", random=False)
    scale = 1 / math.sqrt(spec.head_dim)
    launch_ws(q, k, v, cand_to_user, kv_len, scale, out=torch.empty_like(q), num_programs=spec.num_programs)
    launch_ws(q, k, v, cand_to_user, kv_len, scale, out=torch.empty_like(q), user_q=user_q,
              user_out=torch.empty(user_q.shape, dtype=q.dtype), causal=spec.seed % 2 == 0)  # fmt: skip


@pytest.mark.skipif(not STANDIN, reason="runs in test_gpu_paths_compile_on_cpu's child process")
@COMPILES
@given(spec=attention_specs(any_head_dim=True))
@example(spec=L1)
def test_standin_triton_attention_compiles(standin_driver, spec):
    """The Triton attention kernel at both of `pick_config`'s tile configs and every head size it takes (16 and 32
    too: the demo model's d = 32 on a GPU), target-only and with self tiles."""
    from kernels import attention

    q, user_q, k, v, cand_to_user, kv_len = spec.tensors("cpu", random=False)
    scale = 1 / math.sqrt(spec.head_dim)
    for rows_per_user in (64, 65):
        config = attention.pick_config(rows_per_user, False)
        attention._launch(q, k, v, cand_to_user, kv_len, scale, config=config)
        attention._launch(q, k, v, cand_to_user, kv_len, scale, user_q, spec.seed % 2 == 0, config=config)


@pytest.mark.skipif(not STANDIN, reason="runs in test_gpu_paths_compile_on_cpu's child process")
@COMPILES
@given(spec=lce_specs() | lce_specs(any_shape=True))
@example(spec=LCESpec(1, 1, 1, 1, 8, 1, True, "bf16", "int32", 0, None, 0))
@example(spec=LCESpec(2, 3, 5, 0, 1, 1, True, "fp16", "int64", 1, None, 0))  # Kc = 0, D = N = 1
def test_standin_lce_compiles(standin_driver, spec):
    """warp_specialized (its fused fallback on CPU tensors), fused and persistent, in the warp-specialized kernel's
    domain and off it (D not a multiple of 8, Kc = 0)."""
    from kernels.linear_compress import PackedLinearCompress

    user_emb, cand_emb, cand_to_user, weight, bias = spec.tensors("cpu", random=False)
    packed = PackedLinearCompress.from_weight(weight, spec.num_user_tokens, bias)
    for variant in ("warp_specialized", "fused", "persistent"):
        packed._triton(user_emb, cand_emb, cand_to_user, variant)
