"""Where an eager IKBO call's host time goes: per op at the canonical shapes, the host µs of calls enqueued back to
back against the call's device time, and a cProfile of those calls (the functions with the most own time). Forward
calls without autograd, forward calls that autograd records, and training steps (forward + `torch.autograd.grad`),
with a tiny torch step for autograd's own host time (its engine runs CUDA backward passes on a thread of its own).

    python scripts/profile_host.py [--calls 200] [--top 25]      # GPU; writes $OUT/host_profile.md

An eager call runs within its device time when its host µs (`device_time.host_us`) stay below it; the ops' target is
≤ 50 µs a forward call. Forward calls and training steps are timed as they run (a repeated signature replays its
launches, forward and backward, kernels._launch) and along the ordinary launch path ("no replay"). Raw launch costs
are timed too: an empty Triton kernel, the plan kernel, torch's index_select, so the op's time reads as launches plus
Python.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats

import torch
import triton
import triton.language as tl

from ikbo_backend.perf import attention_cases, lce_cases
from ikbo_backend.perf.device_time import host_us
from ikbo_backend.perf.machine import environment
from kernels import _launch


@triton.jit
def _empty_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n), mask=offsets < n)


def no_replay(fn):
    """fn with the ops' replayed launches off (kernels._launch.REPLAY): the ordinary launch path every call."""

    def call():
        _launch.REPLAY[0] = False
        try:
            return fn()
        finally:
            _launch.REPLAY[0] = True

    return call


STEP_CALLS = 20  # calls with autograd enqueued back to back: a step's ~15 launches each stay below the launch queue


def _cases(device) -> dict:
    """name → (a no-argument eager call, whether it runs with autograd)."""
    import kernels
    from kernels import attention

    dtype = torch.bfloat16
    p = attention_cases.make_problem(attention_cases.CANONICAL, device, dtype, seed=1, with_user_q=True)
    q, k, v, m = p["q"], p["k"], p["v"], p["cand_to_user"]
    user_emb, cand_emb, mapping, weight, bias = lce_cases.make_inputs(lce_cases.CANONICAL, device, dtype, seed=2)
    packed = kernels.PackedLinearCompress.from_weight(weight, lce_cases.CANONICAL.ku, bias)
    cand_part = torch.randn(1024, 512, device=device, dtype=dtype)
    user_part = torch.randn(15, 512, device=device, dtype=dtype)
    x = torch.randn(16, device=device)
    small = torch.randn(256, 256, device=device, requires_grad=True)
    leaves = [t.clone().requires_grad_() for t in (p["user_q"], q, k, v)]
    lce_leaves = [user_emb.clone().requires_grad_(), cand_emb.clone().requires_grad_()]
    trained = kernels.PackedLinearCompress.from_weight(weight.clone().requires_grad_(), lce_cases.CANONICAL.ku, bias)
    lce_leaves += [w for w in trained.parameters() if w.requires_grad]
    grads = {name: torch.randn_like(t) for name, t in (("user", p["user_q"]), ("q", q))}
    grads["lce"] = torch.randn(1024, 512, 256, device=device, dtype=dtype)

    def attention_step():
        return torch.autograd.grad(kernels.ikbo_attention(*leaves[1:], m), leaves[1:], grads["q"])

    def self_target_step():
        outs = kernels.ikbo_self_target_attention(*leaves, m)
        return torch.autograd.grad(outs, leaves, (grads["user"], grads["q"]))

    def lce_step():
        return torch.autograd.grad(trained(*lce_leaves[:2], mapping), lce_leaves, grads["lce"])

    return {
        "empty Triton kernel (1 launch)": (lambda: _empty_kernel[(1,)](x, 16, BLOCK=16), False),
        "torch index_select K to B rows (1 launch)": (lambda: k.index_select(0, m), False),
        "attention plan kernel": (lambda: attention.plan_tiles(m, 15, 64, 128), False),
        "ikbo_attention": (lambda: kernels.ikbo_attention(q, k, v, m), False),
        "ikbo_attention, ordinary path (no replay)": (no_replay(lambda: kernels.ikbo_attention(q, k, v, m)), False),
        "ikbo_self_target_attention": (lambda: kernels.ikbo_self_target_attention(p["user_q"], q, k, v, m), False),
        "ikbo_self_target_attention, no replay": (
            no_replay(lambda: kernels.ikbo_self_target_attention(p["user_q"], q, k, v, m)),
            False,
        ),
        "PackedLinearCompress": (lambda: packed(user_emb, cand_emb, mapping), False),
        "PackedLinearCompress, no replay": (no_replay(lambda: packed(user_emb, cand_emb, mapping)), False),
        "add_user_rows": (lambda: kernels.add_user_rows(cand_part, user_part, m), False),
        "torch step: 256 × 256 multiply, autograd.grad": (lambda: torch.autograd.grad(small * 2, small, small), True),
        "ikbo_attention, recorded by autograd": (lambda: kernels.ikbo_attention(*leaves[1:], m), True),
        "ikbo_attention, step (forward + autograd.grad)": (attention_step, True),
        "ikbo_attention, step, no replay": (no_replay(attention_step), True),
        "ikbo_self_target_attention, step": (self_target_step, True),
        "ikbo_self_target_attention, step, no replay": (no_replay(self_target_step), True),
        "PackedLinearCompress, recorded by autograd": (lambda: trained(*lce_leaves[:2], mapping), True),
        "PackedLinearCompress, step (gradients of inputs and Parameters)": (lce_step, True),
        "PackedLinearCompress, step, no replay": (no_replay(lce_step), True),
    }


def profile(calls: int, top: int) -> str:
    device = torch.device("cuda")
    lines = [f"# Host time of eager calls ({environment()})", ""]
    lines += ["| call | host µs a call (fewest of 3 rounds) | device ms (graph replay) |", "|---|---:|---:|"]
    reports = []
    for name, (fn, grad) in _cases(device).items():
        with torch.set_grad_enabled(grad):
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            device_ms = float("nan") if grad else triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")
            count = min(calls, STEP_CALLS) if grad else calls
            host = min(host_us(fn, calls=count) for _ in range(3))
            profiler = cProfile.Profile()
            torch.cuda.synchronize()
            profiler.enable()
            for _ in range(count):
                fn()
            profiler.disable()
            torch.cuda.synchronize()
            stream = io.StringIO()
            pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(top)
            lines.append(f"| {name} | {host:.1f} | {'–' if grad else f'{device_ms:.4f}'} |")
            reports += [f"## {name}", "", "```", stream.getvalue().strip(), "```", ""]
    return "\n".join(lines + [""] + reports)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    text = profile(args.calls, args.top)
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "host_profile.md"), "w") as f:
        f.write(text)
    print(text.split("\n## ")[0])
