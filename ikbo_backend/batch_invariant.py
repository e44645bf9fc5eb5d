"""Batch-invariant CPU arithmetic: a row's result does not depend on which other rows share its batch.

The online endpoints coalesce one-user requests into one batch; with torch's CPU kernels a request's
scores then differ from its solo scores in the last bits (docs/reliability.md, batch isolation).
On torch's CPU kernels (MKL, AVX512) this project's ops have two sources of such differences, each
with its cure:
- GEMM rows depend on M (the row count of the call): MKL takes another path for small M (1, 2, 3, 5
  and 7 rows differ from the same rows inside a larger call). `rowwise_linear` computes
  x @ Wᵀ + b in chunks of exactly `ROWS` rows, the last one zero-padded: every GEMM call has
  M = ROWS, and inside such a call a row's result does not depend on its position.
- elementwise transcendental functions (sigmoid) round differently in the vectorized body and in
  the scalar tail of torch's CPU loop, and at::parallel_for cuts tensors of more than
  `GRAIN` elements at thread boundaries that start a new tail: which one an element meets depends
  on its offset in the batch. `vectorized_elementwise` pads the flattened tensor to a multiple of
  `VECTOR_ELEMENTS` and calls the op on slices of at most `GRAIN` elements (one thread each, no tail).
Invariant as they are (no change needed): embeddings, cat, add/mul/div, masked_fill, relu,
sum/mean over a dim, scaled_dot_product_attention over [rows, H, L, d], the LCE matmuls (they fold
to GEMMs of M = rows · D ≥ D, above the small-M paths) and the sparse Type I combine (`kernels.add_user_rows`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROWS = 64  # rows of every GEMM call
VECTOR_ELEMENTS = 64  # a multiple of the CPU loop's unrolled vector step (2 × 16 fp32 lanes on AVX512)
GRAIN = 32768  # at::internal::GRAIN_SIZE: tensors up to this many elements run on one thread


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, x [..., K] @ weight[N, K]ᵀ (+ bias [N]) → [..., N], in GEMM calls of `ROWS` rows
    of the flattened x (the last chunk zero-padded): row r's result is the same in any batch."""
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    out = torch.empty(
        rows.shape[0] + -rows.shape[0] % ROWS, weight.shape[0], dtype=x.dtype, device=x.device
    )  # [⌈M / ROWS⌉ · ROWS, N]
    for start in range(0, rows.shape[0], ROWS):
        chunk = rows[start : start + ROWS]
        chunk = F.pad(chunk, (0, 0, 0, ROWS - chunk.shape[0])) if chunk.shape[0] < ROWS else chunk  # [ROWS, K]
        if bias is None:
            torch.mm(chunk, weight.t(), out=out[start : start + ROWS])
        else:
            torch.addmm(bias, chunk, weight.t(), out=out[start : start + ROWS])
    return out[: rows.shape[0]].view(*x.shape[:-1], weight.shape[0])


def vectorized_elementwise(op, x: torch.Tensor) -> torch.Tensor:
    """op(x) for an elementwise op, with every element computed by the op's vectorized body: the
    flattened x is zero-padded to a multiple of `VECTOR_ELEMENTS` and fed in slices of ≤ `GRAIN`."""
    flat = x.reshape(-1)
    padded = F.pad(flat, (0, -flat.shape[0] % VECTOR_ELEMENTS))
    out = (
        torch.cat([op(padded[start : start + GRAIN]) for start in range(0, padded.shape[0], GRAIN)])
        if padded.numel()
        else padded
    )
    return out[: flat.shape[0]].view(x.shape)
