"""Value checks of request tensors on the device, in place, with one flag: no host sync, so a CUDA
graph can hold them (ikbo_backend.cuda_graphs.GraphedRanker checks each request inside its graph).

    clamp_flagged_(x, low, high, flag):  x ← clamp(x, low, high);  flag ← 1 if any x ∉ [low, high]
    flag_unbounded(x, abs_max, flag):    flag ← 1 if any |x| > abs_max or x is NaN/±Inf

x: an index tensor (int32/int64, any shape) or a float tensor; `high` an int or a 0-d tensor on x's
device (a bound that lives on the device: the request's U for `cand_to_user`); flag: float32 [1],
set to 1 and never cleared (one flag for all checks of a request: zero it first). Clamping keeps a
bad index from reaching a gather; the caller discards the results of a flagged request.

Backends: Triton on CUDA (one launch per tensor: a 1-D grid of BLOCK elements, flag by atomic max),
the torch reference on CPU (`backend="torch"`, also what the Triton path is tested against).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import resolve_backend
from ._interpreter import interpreting

BLOCK = 1024


# Sizes and bounds are not specialized on (n == 1, n % 16): one compile per dtype serves every shape
# bucket, so capturing the buckets' graphs compiles nothing after the first.
@triton.jit(do_not_specialize=["n", "low", "high"])
def _clamp_flagged_kernel(x_ptr, n, low, high, high_ptr, flag_ptr, HIGH_ON_DEVICE: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    x = tl.load(x_ptr + offsets, mask=inside, other=low)
    if HIGH_ON_DEVICE:
        high = tl.load(high_ptr)
    outside = inside & ((x < low) | (x > high))
    tl.store(x_ptr + offsets, tl.minimum(tl.maximum(x, low), high).to(x.dtype), mask=outside)
    if tl.max(outside.to(tl.int32), axis=0) > 0:
        tl.atomic_max(flag_ptr, 1.0)


@triton.jit(do_not_specialize=["n"])
def _flag_unbounded_kernel(x_ptr, n, abs_max, flag_ptr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    x = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    bad = inside & ~(tl.abs(x) <= abs_max)  # NaN fails every comparison
    if tl.max(bad.to(tl.int32), axis=0) > 0:
        tl.atomic_max(flag_ptr, 1.0)


def _check_args(x: torch.Tensor, flag: torch.Tensor, dtypes) -> None:
    if x.dtype not in dtypes:
        raise ValueError(
            f"x: expected dtype in {[str(d).replace('torch.', '') for d in dtypes]}, got {str(x.dtype).replace('torch.', '')}"
        )
    if not x.is_contiguous():
        raise ValueError("x: expected a contiguous tensor (clamped in place)")
    if flag.dtype != torch.float32 or flag.shape != (1,) or flag.device != x.device:
        raise ValueError(
            f"flag: expected float32 [1] on {x.device}, got {str(flag.dtype).replace('torch.', '')} {list(flag.shape)} on {flag.device}"
        )


def _use_triton(backend: str, x: torch.Tensor) -> bool:
    runnable = interpreting() or x.device.type == "cuda"
    return resolve_backend(backend, x.device if runnable else torch.device("cpu"), triton_available=True) == "triton"


def clamp_flagged_(x: torch.Tensor, low: int, high, flag: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """Clamp the index tensor x into [low, high] in place; flag[0] = 1 if a value was outside. Returns x."""
    _check_args(x, flag, (torch.int32, torch.int64))
    on_device = isinstance(high, torch.Tensor)
    if on_device and (high.dim() != 0 or high.device != x.device):
        raise ValueError(
            f"high: expected an int or a 0-d tensor on {x.device}, got shape {list(high.shape)} on {high.device}"
        )
    if not _use_triton(backend, x):
        high = high.to(x.dtype) if on_device else high
        outside = (x < low) | (x > high)
        flag.copy_(torch.maximum(flag, outside.any().to(flag.dtype).view(1)))
        return torch.minimum(x.clamp_(min=low), high, out=x) if on_device else x.clamp_(low, high)
    if x.numel():
        _clamp_flagged_kernel[(triton.cdiv(x.numel(), BLOCK),)](
            x, x.numel(), low, 0 if on_device else high,
            high if on_device else flag,  # high_ptr: read only when HIGH_ON_DEVICE
            flag,
            HIGH_ON_DEVICE=on_device, BLOCK=BLOCK,
        )  # fmt: skip
    return x


def flag_unbounded(x: torch.Tensor, abs_max: float, flag: torch.Tensor, backend: str = "auto") -> None:
    """flag[0] = 1 if any value of the float tensor x is NaN, ±Inf or above abs_max in magnitude."""
    _check_args(x, flag, (torch.float32, torch.float16, torch.bfloat16))
    if not _use_triton(backend, x):
        flag.copy_(torch.maximum(flag, (x.abs() <= abs_max).logical_not().any().to(flag.dtype).view(1)))
    elif x.numel():
        _flag_unbounded_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, x.numel(), abs_max, flag, BLOCK=BLOCK)
