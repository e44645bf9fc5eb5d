"""Host-side pieces shared by the Gluon kernels for Hopper (kernels/linear_compress_ws.py, kernels/attention_ws.py).

The kernels modules call `_hopper.device_info(...)` through this module: kernels.devtools.install_standin_driver
replaces it to answer for a stand-in GPU.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental.gluon import language as gl

SMEM_LIMIT = 232448  # bytes of shared memory one block may take on sm_90 (227 KiB)
GLUON_TYPES = (torch.float16, torch.bfloat16)  # the element types the Gluon kernels take


@functools.cache
def device_info(device: torch.device) -> tuple[tuple[int, int], int]:
    """((major, minor) CUDA capability, multiprocessor count) of a CUDA device."""
    props = torch.cuda.get_device_properties(device)
    return (props.major, props.minor), props.multi_processor_count


def is_hopper(device: torch.device) -> bool:
    """A CUDA device of capability 9.x."""
    return device.type == "cuda" and device_info(device)[0][0] == 9


@functools.cache
def smem_layout(block: tuple[int, ...], dtype: torch.dtype):
    """The NVMMA shared-memory layout of a TMA block of `dtype` (fp16 or bf16): wgmma reads it as is."""
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)
