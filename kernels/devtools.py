"""Development tools: compile the GPU kernels for sm_90a on a machine without a GPU, disassemble them, and a
stand-in driver under which the real GPU launch paths compile on CPU tensors. For tests and benchmarks only; the
runtime modules import nothing from here.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
import triton


def compile_gluon_without_gpu(kernel, runtime_args: dict, constexprs: dict, options: dict, capability: int = 90):
    """Compile the Gluon (or plain Triton) `kernel` for CUDA sm_<capability> on a machine without a GPU:
    CPU tensors and host descriptors in `runtime_args` stand in for the arguments and the JIT's own
    specialization rules give the signature; `constexprs` by name. Returns the CompiledKernel
    (`.asm["ptx"]`, `.asm["cubin"]`, `.metadata.shared`; registers and spills from `disassemble`)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction

    signature, attrs, constants = {}, {}, {}
    for index, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            constants[(index,)] = constexprs[name]
            continue
        specialize = not kernel.params[index].do_not_specialize
        kind, key = native_specialize_impl(BaseBackend, runtime_args[name], False, specialize, True)
        signature[name] = kind
        if isinstance(key, str):
            attrs[(index,)] = BaseBackend.parse_attr(key)
    source = (GluonASTSource if isinstance(kernel, GluonJITFunction) else ASTSource)(
        kernel, signature, constants, attrs
    )
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)


def disassemble(compiled) -> tuple[str, str] | None:
    """(SASS, resource usage) of a CompiledKernel's cubin from cuobjdump (the Triton wheel's, else one on PATH);
    None where there is none."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    tool = str(tool) if tool.exists() else shutil.which("cuobjdump")
    if tool is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp, "kernel.cubin")
        cubin.write_bytes(compiled.asm["cubin"])
        return tuple(
            subprocess.run([tool, flag, str(cubin)], capture_output=True, text=True, check=True).stdout
            for flag in ("-sass", "-res-usage")
        )


def install_standin_driver(multiprocessors: int = 132, capability: int = 90) -> None:
    """Make Triton's active driver a stand-in for an sm_<capability> GPU whose launcher does nothing, on a machine
    without one. Kernels launched on CPU tensors then go through Triton's real binder, argument specialization and
    compile (the wheel's ptxas included), and do not run. The Gluon kernels' device queries answer for that GPU.
    It is not undone: without a GPU, Triton's own driver cannot be made again (run it in a child process)."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    from . import _hopper

    class Utils:
        def load_binary(self, name, kernel, shared, device):
            return 1, 1, 128, 0, 1024  # module, function, registers, spills, max threads

        def get_device_properties(self, device):
            return {"max_shared_mem": _hopper.SMEM_LIMIT, "multiprocessor_count": multiprocessors}

    class StandIn:
        utils = Utils()

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", capability, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def launcher_cls(self, src, metadata):
            return lambda *args: None

    driver.set_active(StandIn())
    _hopper.device_info = lambda device: ((capability // 10, capability % 10), multiprocessors)


# fmt: off
def compile_attention_ws(
    dtype: torch.dtype = torch.bfloat16, head_dim: int = 128, has_kv_len: bool = True, config=None,
    capability: int = 90, has_self: bool = False, causal: bool = True, rows_tma: bool = True, write_lse: bool = False,
):
    """Compile `attention_ws._attention_ws_kernel` with `config` (a WSAttentionConfig, default DEFAULT_CONFIG) for a
    CUDA target without a GPU; `rows_tma` as launch_ws takes it where `rows_by_tma` (and with self tiles
    `self_rows_by_tma`) hold, else the gathered rows; `write_lse`: the forward of a call that needs the backward.
    Returns the CompiledKernel."""
    from . import attention_ws as ws

    cfg = config or ws.DEFAULT_CONFIG
    cfg = ws._for_self_tiles(cfg) if has_self else cfg
    num_users, heads, seq_len, num_queries = 15, 4, 1024, 64
    q = torch.zeros(4, heads, num_queries, head_dim, dtype=dtype)
    k = torch.zeros(num_users, heads, seq_len, head_dim, dtype=dtype)
    k_desc, v_desc, (s_u, s_h, s_l) = ws._kv_descriptors(k, k, cfg.block_n)
    ints = torch.zeros(64, dtype=torch.int32)
    runtime_args = dict(
        q_ptr=q,
        stride_qb=q.stride(0),
        stride_qh=q.stride(1),
        stride_qs=q.stride(2),
        out_ptr=q,
        stride_ob=q.stride(0),
        stride_oh=q.stride(1),
        stride_os=q.stride(2),
        k_desc=k_desc, v_desc=v_desc, stride_ku=s_u, stride_kh=s_h, stride_kl=s_l, kv_len_ptr=ints, order_ptr=ints,
        tile_ptr=ints, sched_ptr=ints, num_items=2108, num_tiles=527, seq_len=seq_len, num_queries=num_queries,
        qk_scale=0.12,
        uq_delta=-(2**33),
        stride_uqu=k.stride(0),
        stride_uqh=k.stride(1),
        stride_uql=k.stride(2),
        uo_delta=2**33,
        stride_uou=k.stride(0),
        stride_uoh=k.stride(1),
        stride_uol=k.stride(2),
        num_users=num_users,
        num_self_tiles=num_users * 8 if has_self else 0,
        lse_ptr=torch.zeros(64, dtype=torch.float32),
        ulse_offset=4 * heads * num_queries,
    )
    runtime_args["q_desc"], runtime_args["o_desc"] = ws._row_descriptors(q, q) if rows_tma else (k_desc, k_desc)
    runtime_args["uq_desc"], runtime_args["uo_desc"] = (
        ws._row_descriptors(k, k) if rows_tma and has_self else (runtime_args["q_desc"], runtime_args["o_desc"])
    )
    constexprs = dict(
        HAS_KV_LEN=has_kv_len, STAGES=cfg.stages, CONSUMER_REGS=cfg.consumer_regs, PRODUCER_REGS=cfg.producer_regs,
        HAS_SELF=has_self, CAUSAL=causal, DYNAMIC=cfg.dynamic if cfg.dynamic is not None else has_self or has_kv_len,
        ROWS_TMA=rows_tma, WRITE_LSE=write_lse,
    )
    options = {"num_warps": 4, "maxnreg": cfg.maxnreg}
    return compile_gluon_without_gpu(ws._attention_ws_kernel, runtime_args, constexprs, options, capability)
# fmt: on


# fmt: off
def compile_backward_ws(
    kernel: str = "dkdv", dtype: torch.dtype = torch.bfloat16, head_dim: int = 128, has_kv_len: bool = True,
    split: bool = False, config=None, capability: int = 90, has_self: bool = False,
):
    """Compile one of the attention backward's Gluon kernels, `attention_ws._dkdv_ws_kernel` (kernel "dkdv"; `split`:
    walks split, fp32 sums added into; `has_self`: the user's own rows walked too, causal) or `_dq_ws_kernel` ("dq"), with `config` (a WSBackwardConfig, default
    DEFAULT_BACKWARD_CONFIG) for a CUDA target without a GPU, with their launchers' arguments at the canonical U, H,
    L, S. Returns the CompiledKernel."""
    from . import attention_ws as ws

    cfg = config or ws.DEFAULT_BACKWARD_CONFIG
    num_users, heads, seq_len, num_queries = 15, 4, 1024, 64
    q = torch.zeros(4, heads, num_queries, head_dim, dtype=dtype)
    k = torch.zeros(num_users, heads, seq_len, head_dim, dtype=dtype)
    k_desc, v_desc, (s_u, s_h, s_l) = ws._kv_descriptors(k, k, 64 if kernel == "dkdv" else cfg.dq_block_n)
    q_desc, do_desc = ws._row_descriptors(q, q)
    ints, floats = torch.zeros(64, dtype=torch.int32), torch.zeros(64, dtype=torch.float32)
    runtime_args = dict(
        k_desc=k_desc, v_desc=v_desc, stride_ku=s_u, stride_kh=s_h, stride_kl=s_l, q_desc=q_desc, do_desc=do_desc,
        lse_ptr=floats, delta_ptr=floats, kv_len_ptr=ints, order_ptr=ints, seq_len=seq_len, num_queries=num_queries,
        qk_scale=0.12, scale=0.09,
    )
    constexprs = dict(HAS_KV_LEN=has_kv_len, CONSUMER_REGS=cfg.consumer_regs, PRODUCER_REGS=cfg.producer_regs)
    if kernel == "dkdv":
        grads = k.float() if split else k
        runtime_args.update(dk_ptr=grads, dv_ptr=grads, users_ptr=ints, num_users=num_users, heads=heads,
                            splits=2 if split else 1, uq_desc=q_desc, udo_desc=do_desc, self_lse_at=1 << 20)  # fmt: skip
        constexprs.update(RANK_USERS=64, STAGES=cfg.stages, SPLIT=split, HAS_SELF=has_self, CAUSAL=True)
        function = ws._dkdv_ws_kernel
    else:
        runtime_args.update(o_ptr=q, do_ptr=q, dq_ptr=q, tile_ptr=ints)
        constexprs.update(STAGES=cfg.dq_stages)
        function = ws._dq_ws_kernel
    options = {"num_warps": 4, "maxnreg": cfg.maxnreg}
    return compile_gluon_without_gpu(function, runtime_args, constexprs, options, capability)
# fmt: on


# fmt: off
def compile_linear_compress_ws(
    dtype: torch.dtype = torch.bfloat16, num_candidates: int = 1024, rows: int = 512, dim: int = 256,
    num_cand_tokens: int = 500, config=None, has_user: bool = True, has_bias: bool = True, capability: int = 90,
):
    """Compile `linear_compress_ws._lce_ws_kernel` with `config` (a WSConfig, fitted by `ws_config`) for a CUDA
    target without a GPU, with the runtime arguments of `_launch_kernel` (B, N, D, Kc as given). Returns the
    CompiledKernel."""
    from . import linear_compress_ws as ws
    from .linear_compress import PackedWeights

    cfg = ws.ws_config(dim, torch.finfo(dtype).bits // 8, config)
    weight = torch.zeros(rows, triton.cdiv(num_cand_tokens, 8) * 8, dtype=dtype)
    packed = PackedWeights(weight, weight, None, weight, weight)
    cand_emb = torch.zeros(2, num_cand_tokens, dim, dtype=dtype)
    out = torch.zeros(2, rows, dim, dtype=dtype)
    w_desc, x_desc, y_desc, out_desc = ws._descriptors(packed, cand_emb, out, out if has_user else None, cfg)
    runtime_args = dict(
        w_desc=w_desc,
        x_desc=x_desc,
        y_desc=y_desc,
        out_desc=out_desc,
        m_ptr=torch.zeros(16, dtype=torch.int32),
        bias_ptr=torch.zeros(16, dtype=dtype),
        B=num_candidates,
        N=rows,
        D=dim,
    )
    constexprs = dict(
        K_TILES=triton.cdiv(num_cand_tokens, cfg.block_k),
        STAGES=cfg.stages, HAS_USER=has_user, HAS_BIAS=has_bias, EPI_FREE_AT=cfg.epi_free_at,
        PRODUCER_REGS=cfg.producer_regs, num_warps=cfg.num_warps,
    )
    options = {"num_warps": cfg.num_warps, "maxnreg": cfg.maxnreg}
    return compile_gluon_without_gpu(ws._lce_ws_kernel, runtime_args, constexprs, options, capability)
# fmt: on
