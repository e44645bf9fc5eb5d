"""Our IKBO forward ops beside Meta's public stock-Triton IKBO kernels (scripts/bench_fbgemm.py), checked in fp64 and
timed in one run by the shared harness.

Theirs: pytorch/FBGEMM, fbgemm_gpu/experimental/ikbo (https://github.com/pytorch/FBGEMM/tree/main/fbgemm_gpu/experimental/ikbo),
`triton_ikbo_lce` (ikbo/ops/triton_ikbo_lce.py) and `triton_flash_attn_ikbo_tma` (ikbo/ops/triton_ikbo_fa.py); not
their TLX kernels, which need Meta's Triton fork. Their code is not in this tree: `load_fbgemm` imports it by file
path from a copy of that folder (default .cache/fbgemm_ikbo, whose README.txt lists the commits), as a package named
`fbgemm_ikbo`, without touching sys.path.

Their APIs, in our terms:
    LCE: triton_ikbo_lce(W_cand [M, Kc], W_user [M, Ku], E_cand [B, Kc, N], E_user [U, Ku, N], cand_to_user [B] int32)
        → [B, M, N] = W_cand @ E_cand[b] + (W_user @ E_user)[u(b)], no bias. Our layout with M = our N (rows) and
        N = our D: the activations go in as they are and our weight [N, Ku + Kc] is split once (a parameter). The user
        GEMM is torch's (cuBLAS) inside their call, then one Triton kernel autotuned over 64 configs (key M, N, K;
        the strides are constexpr). Any mapping order. Their benchmark zero-pads Ku and Kc to multiples of 8
        beforehand ("K-dim alignment"), here a row of its own where K needs it, the padding timed in another.
    attention: triton_flash_attn_ikbo_tma(query [B·S, H, d], key, value [U·L, H, d], cand_to_user [B] int32, S, L)
        → [B·S, H, d] = softmax(q·kᵀ/√d)·v over all L keys of the candidate's user (no lengths, non-causal): token-
        major rows, our [B, H, S, d] and [U, H, L, d] transposed. One kernel through host TMA descriptors (Hopper),
        autotuned over 320 configs keyed on S and the dtypes alone. Any mapping order; its grid runs candidates in
        index order, so a sorted mapping may share K/V in L2 better (rows of their own where the mapping is not).
    Both take fp16 in their tests and benchmarks; neither kernel is fp16-only, so bf16 is measured too.

One problem per op and shape (`Problem`): ours at the canonical shapes (ragged counts, shuffled mapping), then
FBGEMM's benchmark defaults (equal runs of candidates, sorted). Providers: the materialized baseline, our public op,
our kernel as dispatched, FBGEMM's Triton op (the × baseline column is over it) and the variants above. Inputs are
converted to each provider's layout outside the timed call; a conversion a caller holding the other layout would pay
on every call is timed in a row of its own. Every provider is checked against fp64 before it is timed.
Autotuning: their autotuner's choices are cleared at each problem (the attention key leaves out B, L and H), made in
the check call before the timing and printed under the table; on the GPU its configs are first compiled in worker
processes, a slice each (`warm_setups`), so that tuning in this process finds them in Triton's disk cache.
--smoke (Triton's interpreter, CPU): their autotuners keep their first config (tuning runs on a GPU), and the
attention kernel's Python bool argument `allow_tf32` goes in as a constexpr (`_ConstexprBools`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import importlib.util
import math
import os
import re
import sys
import types
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton.language as tl

from ikbo_backend.perf import attention_cases, lce_cases
from ikbo_backend.perf.harness import Bench, Case, Provider, Result, markdown, nan_like
from kernels import ikbo_attention
from kernels import linear_compress as lce
from kernels._interpreter import interpreting
from kernels.linear_compress import PackedLinearCompress

PACKAGE = "fbgemm_ikbo"  # the name their package `ikbo` is imported under
TLX = "triton.language.extra.tlx"
LCE_FILE, FA_FILE = "ikbo/ops/triton_ikbo_lce.py", "ikbo/ops/triton_ikbo_fa.py"
THEIRS = "FBGEMM Triton"  # the tables' baseline
OURS = attention_cases.OURS  # "ours: public op", both ops
DISPATCHED = {"lce": "ours: kernel as dispatched", "attention": attention_cases.DISPATCHED}
MATERIALIZED = "S0: user_emb replicated + one bmm"
TOL = 1e-2
K_ALIGN = 8  # FBGEMM's benchmark pads K to this (PAD_UNIT, fp16/bf16)
CONFIGS_PER_WARM = 16  # their configs compiled per worker task
CHECKED_HEAD = attention_cases.CHECKED_HEAD  # candidates checked against fp64 at FBGEMM's attention shapes
PADDED, PADDING = f"{THEIRS}, K padded beforehand", f"{THEIRS} + K padding"
THEIR_TORCH = "FBGEMM torch_decomposed_lce"


# ---------------------------------------------------------------------------------------------
# Their code
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fbgemm:
    """Their modules and autotuned kernels, and where they came from."""

    lce: types.ModuleType  # ikbo/ops/triton_ikbo_lce.py
    torch_lce: types.ModuleType  # ikbo/ops/torch_lce.py
    fa: types.ModuleType  # ikbo/ops/triton_ikbo_fa.py
    lce_kernel: Any  # their triton.autotune objects
    fa_kernel: Any
    files: dict  # path → {commit, blob}

    def kernel(self, op: str):
        return self.lce_kernel if op == "lce" else self.fa_kernel

    def source_line(self, directory: str) -> str:
        parts = [f"{path} @ {f['commit'][:12]} (blob {f['blob'][:12]})" for path, f in self.files.items()]
        return f"FBGEMM: pytorch/FBGEMM fbgemm_gpu/experimental/ikbo, from {directory}: " + ", ".join(parts)


@contextlib.contextmanager
def _tlx_stand_in():
    """triton_ikbo_lce.py imports `swizzle_tile` (a plain @triton.jit helper) from tlx_ikbo_lce.py, which imports TLX
    (Meta's Triton fork) first. With stock Triton an empty module stands in for TLX while that file is imported: its
    TLX kernel is defined and never compiled. Removed afterwards."""
    if importlib.util.find_spec(TLX) is not None:
        yield
        return
    sys.modules[TLX] = types.ModuleType(TLX)
    try:
        yield
    finally:
        del sys.modules[TLX]


class _ConstexprBools:
    """Their attention kernel behind `kernel[grid](...)`, its bool keyword arguments passed as constexprs: Triton 3.6's
    interpreter converts a Python bool argument to an int1 scalar through int32 and refuses it (`allow_tf32`)."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        return lambda *args, **kwargs: launch(
            *args, **{name: tl.constexpr(x) if isinstance(x, bool) else x for name, x in kwargs.items()}
        )


def _commits(root: Path) -> dict[str, str]:
    """README.txt's `<commit>  <path>` lines → {path: commit}."""
    readme = root / "README.txt"
    lines = readme.read_text().splitlines() if readme.is_file() else []
    return {m[2]: m[1] for m in (re.fullmatch(r"([0-9a-f]{40})\s+(\S+)", line.strip()) for line in lines) if m}


def _blob_id(path: Path) -> str:
    """The file's git blob id (`git hash-object`): which version ran, whatever README.txt says."""
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@functools.cache
def load_fbgemm(directory: str) -> Fbgemm:
    """Import their ops from `directory` (a copy of fbgemm_gpu/experimental/ikbo: ikbo/__init__.py, ikbo/ops/...);
    under Triton's interpreter their autotuners keep their first config and `_ConstexprBools` wraps the attention
    kernel."""
    root = Path(directory)
    init = root / "ikbo" / "__init__.py"
    if not init.is_file():
        raise FileNotFoundError(f"--fbgemm-ikbo: expected a copy of fbgemm_gpu/experimental/ikbo at {root}, no {init}")
    spec = importlib.util.spec_from_file_location(PACKAGE, init, submodule_search_locations=[str(init.parent)])
    package = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = package  # their relative imports resolve through it
    spec.loader.exec_module(package)
    with _tlx_stand_in():
        lce_module = importlib.import_module(f"{PACKAGE}.ops.triton_ikbo_lce")
    fa = importlib.import_module(f"{PACKAGE}.ops.triton_ikbo_fa")
    fb = Fbgemm(
        lce_module,
        importlib.import_module(f"{PACKAGE}.ops.torch_lce"),
        fa,
        lce_module.triton_ikbo_lce_kernel,
        fa._attn_fwd_tma,
        {path: dict(commit=_commits(root).get(path, "?"), blob=_blob_id(root / path)) for path in (LCE_FILE, FA_FILE)},
    )
    if interpreting():
        for kernel in (fb.lce_kernel, fb.fa_kernel):
            kernel.configs = kernel.configs[:1]
        fa._attn_fwd_tma = _ConstexprBools(fb.fa_kernel)
    return fb


# ---------------------------------------------------------------------------------------------
# Problems
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    label: str
    shape: Any  # lce_cases.Shape or attention_cases.Shape
    per_user: int = 0  # 0: ragged counts, mapping shuffled (ours); else runs of per_user candidates, sorted (theirs)
    checked: int | None = None  # candidates checked against fp64 (None: all)

    def __post_init__(self):
        users = -(-self.shape.num_candidates // self.per_user) if self.per_user else self.shape.num_users
        if users != self.shape.num_users:
            raise ValueError(
                f"per_user: {self.per_user} candidates a user make {users} users, the shape has U = {self.shape.num_users}"
            )

    def mapping_note(self) -> str:
        if self.per_user:
            return f"sorted mapping, {self.per_user} candidates a user (FBGEMM's benchmark)"
        return "ragged counts, shuffled mapping"


# ikbo_lce_bench.py's defaults: B = 1024, M = 433, N = 256, K_USER = 1178, K_CAND = 866, 70 candidates a user.
# ikbo_fa_bench.py's: B = 2048, S = 64, H = 2, d = 128, 64 (or 65) candidates a user, L from 512 to 16384.
PROBLEMS = {
    "lce": {
        "canonical": [Problem("canonical", lce_cases.CANONICAL)],
        "fbgemm": [Problem("FBGEMM default", lce_cases.Shape(15, 1024, 1178, 866, 256, 433), per_user=70)],
    },
    "attention": {
        "canonical": [Problem("canonical", attention_cases.CANONICAL)],
        "fbgemm": [
            Problem(f"FBGEMM default, L={n}", attention_cases.Shape(32, 2048, 64, n, 2, 128), 64, CHECKED_HEAD)
            for n in (1024, 4096)
        ],
    },
}
SMOKE_PROBLEMS = {
    "lce": {
        "canonical": [Problem("canonical", lce_cases.SMOKE_CANONICAL)],
        "fbgemm": [Problem("FBGEMM default", lce_cases.Shape(2, 8, 11, 9, 16, 13), per_user=4)],
    },
    "attention": {
        "canonical": [Problem("canonical", attention_cases.SMOKE_CANONICAL)],
        "fbgemm": [Problem("FBGEMM default", attention_cases.Shape(2, 8, 4, 24, 1, 16), per_user=4)],
    },
}


def problems(op: str, shapes, smoke: bool) -> list[Problem]:
    """The problems of `op` in `shapes` ("canonical": ours; "fbgemm": their benchmarks' defaults; tiny with smoke)."""
    table = (SMOKE_PROBLEMS if smoke else PROBLEMS)[op]
    return [problem for name in shapes for problem in table[name]]


def _runs(num_candidates: int, per_user: int, device) -> torch.Tensor:
    return (torch.arange(num_candidates, device=device) // per_user).int()  # [B] int32, sorted


def lce_inputs(problem: Problem, device, dtype, seed: int = 1):
    """(user_emb [U, Ku, D], cand_emb [B, Kc, D], cand_to_user [B] int32, weight [N, Ku + Kc]); no bias."""
    user_emb, cand_emb, mapping, weight, _ = lce_cases.make_inputs(problem.shape, device, dtype, seed)
    if problem.per_user:
        mapping = _runs(problem.shape.num_candidates, problem.per_user, device)
    return user_emb, cand_emb, mapping, weight


def attention_inputs(problem: Problem, device, dtype, seed: int = 1) -> dict:
    """attention_cases.make_problem's q [B, H, S, d], k, v [U, H, L, d]; the mapping int32 (theirs takes int32)."""
    shape = problem.shape
    counts = None
    if problem.per_user:
        counts = torch.bincount(_runs(shape.num_candidates, problem.per_user, "cpu"), minlength=shape.num_users)
    p = attention_cases.make_problem(shape, device, dtype, seed, counts=counts)
    mapping = p["cand_to_user"].sort().values if problem.per_user else p["cand_to_user"]
    return {**p, "cand_to_user": mapping.int()}


def _pad_k(t: torch.Tensor, dim: int) -> torch.Tensor:
    """t zero-padded along `dim` (1 or -1: K) to a multiple of K_ALIGN; t itself where it is one."""
    extra = -t.shape[dim] % K_ALIGN
    if not extra:
        return t
    return F.pad(t, (0, extra) if dim == -1 else (0, 0, 0, extra))


# ---------------------------------------------------------------------------------------------
# Providers
# ---------------------------------------------------------------------------------------------


def _lce_calls(fb: Fbgemm, inputs, shape) -> dict[str, Any]:
    """Their LCE calls: the Triton op as given, and (where Ku or Kc is not a multiple of K_ALIGN) on activations
    zero-padded beforehand and in the call; their torch path. The weights, parameters, split and padded once."""
    user_emb, cand_emb, mapping, weight = inputs
    w_user, w_cand = (w.contiguous() for w in weight.split([shape.ku, shape.kc], dim=1))
    calls = {THEIRS: partial(fb.lce.triton_ikbo_lce, w_cand, w_user, cand_emb, user_emb, mapping)}
    if shape.ku % K_ALIGN or shape.kc % K_ALIGN:
        w_cand_p, w_user_p = _pad_k(w_cand, -1), _pad_k(w_user, -1)
        padded = (_pad_k(cand_emb, 1), _pad_k(user_emb, 1))
        calls[PADDED] = partial(fb.lce.triton_ikbo_lce, w_cand_p, w_user_p, *padded, mapping)
        calls[PADDING] = lambda: fb.lce.triton_ikbo_lce(
            w_cand_p, w_user_p, _pad_k(cand_emb, 1), _pad_k(user_emb, 1), mapping
        )
    calls[THEIR_TORCH] = partial(fb.torch_lce.torch_decomposed_lce, w_cand, w_user, cand_emb, user_emb, mapping)
    return calls


def lce_providers(fb: Fbgemm | None, inputs, shape) -> dict[str, Provider]:
    """S0, ours (public op, kernel as dispatched) and, with `fb`, theirs (`_lce_calls`)."""
    user_emb, cand_emb, mapping, weight = inputs
    args = (user_emb, cand_emb, mapping)
    packed = PackedLinearCompress.from_weight(weight, shape.ku)  # no bias: theirs has none
    zero_bias = weight.new_zeros(shape.rows)
    variant, config = lce._choose_variant(user_emb, cand_emb, shape.rows, None)
    out_shape, user_shape = (shape.num_candidates, shape.rows, shape.dim), (shape.num_users, shape.rows, shape.dim)

    def dispatched(out=None, user_part=None):
        return packed._triton(*args, variant, config, out, user_part)

    table = {
        MATERIALIZED: Provider(lambda: lce_cases.s0_materialized(*args, weight, zero_bias), note="bias zero"),
        OURS: Provider(lambda: packed(*args, backend="triton"), host=True, note="PackedLinearCompress, input checks"),
        DISPATCHED["lce"]: Provider(
            dispatched,
            check=lambda: dispatched(nan_like(cand_emb, out_shape), nan_like(cand_emb, user_shape)),
            host=True,
            note=f"variant {variant}, no input checks",
        ),
    }
    if fb is None:
        return table
    notes = {
        THEIRS: "cuBLAS user GEMM + their fused Triton kernel, autotuned before timing",
        PADDED: f"their benchmark's setting: K zero-padded to a multiple of {K_ALIGN} untimed",
        PADDING: "the activations' zero-padding timed: a caller whose embeddings come unpadded",
        THEIR_TORCH: "their torch path: two cuBLAS GEMMs + index_select add",
    }
    table.update({name: Provider(call, note=notes[name]) for name, call in _lce_calls(fb, inputs, shape).items()})
    return table


def _token_major(t: torch.Tensor) -> torch.Tensor:
    """[X, H, R, d] → their [X·R, H, d] (a copy)."""
    return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3])


def _attention_calls(fb: Fbgemm, p: dict) -> dict[str, tuple]:
    """Their attention calls → (fn, check) with check's output in our [B, H, S, d] layout: on their layout converted
    beforehand; with the conversion both ways in the call; where the mapping is not sorted, on candidates sorted by
    user beforehand and with the sort (argsort, q gathered, out scattered back) in the call."""
    q, k, v, m = p["q"], p["k"], p["v"], p["cand_to_user"]
    num_candidates, heads, num_queries, head_dim = q.shape
    their = partial(fb.fa.triton_flash_attn_ikbo_tma, q_seq_len=num_queries, max_seq_len=k.shape[2])
    qf, kf, vf = (_token_major(t) for t in (q, k, v))

    def ours_layout(out):  # their [B·S, H, d] → [B, H, S, d] (a view)
        return out.view(num_candidates, num_queries, heads, head_dim).transpose(1, 2)

    def converted():
        return ours_layout(their(_token_major(q), _token_major(k), _token_major(v), m)).contiguous()

    calls = {
        THEIRS: (partial(their, qf, kf, vf, m), lambda: ours_layout(their(qf, kf, vf, m))),
        f"{THEIRS} + layout conversion": (converted, converted),
    }
    if bool((m[1:] < m[:-1]).any()):
        by_candidate = qf.view(num_candidates, -1)

        def unsorted(order, out):  # their output on sorted candidates → candidate order
            res = torch.empty_like(by_candidate)
            res[order] = out.view(num_candidates, -1)
            return res.view_as(qf)

        order = torch.argsort(m, stable=True)
        q_sorted, m_sorted = by_candidate[order].view_as(qf), m[order]

        def sorted_in_call():
            order = torch.argsort(m, stable=True)
            return unsorted(order, their(by_candidate[order].view_as(qf), kf, vf, m[order]))

        calls[f"{THEIRS}, sorted beforehand"] = (
            partial(their, q_sorted, kf, vf, m_sorted),
            lambda: ours_layout(unsorted(order, their(q_sorted, kf, vf, m_sorted))),
        )
        calls[f"{THEIRS} + sort"] = (sorted_in_call, lambda: ours_layout(sorted_in_call()))
    return calls


def attention_providers(fb: Fbgemm | None, p: dict) -> dict[str, Provider]:
    """The baseline and ours (attention_cases.core_providers), ours on their token-major layout and, with `fb`, theirs
    (`_attention_calls`)."""
    q, k, v, m = p["q"], p["k"], p["v"], p["cand_to_user"]
    q_view, k_view, v_view = (
        _token_major(t).view(t.shape[0], t.shape[2], t.shape[1], t.shape[3]).transpose(1, 2) for t in (q, k, v)
    )  # [B, H, S, d] and [U, H, L, d] views of token-major storage
    table = attention_cases.core_providers(p)
    table[f"{OURS}, FBGEMM's layout"] = Provider(
        lambda: ikbo_attention(q_view, k_view, v_view, m, backend="triton"), note="strided views, no copy"
    )
    if fb is None:
        return table
    notes = {
        THEIRS: "their layout, converted beforehand; autotuned before timing",
        f"{THEIRS} + layout conversion": "q, k, v to token-major and out back, timed",
        f"{THEIRS}, sorted beforehand": "candidates sorted by user untimed",
        f"{THEIRS} + sort": "argsort, q gathered, out scattered back, timed",
    }
    calls = _attention_calls(fb, p)
    table.update({name: Provider(fn, check, note=notes[name]) for name, (fn, check) in calls.items()})
    return table


def case(op: str, fb: Fbgemm, problem: Problem, device, dtype) -> Case:
    """One problem's providers, theirs the baseline, its fp64 reference; their autotuner's choices cleared."""
    fb.kernel(op).cache.clear()
    shape, dtype_name = problem.shape, str(dtype).removeprefix("torch.")
    if op == "lce":
        inputs = lce_inputs(problem, device, dtype)
        ref = lce_cases.reference((*inputs, inputs[3].new_zeros(shape.rows)), problem.checked or shape.num_candidates)
        flops, min_bytes = shape.flops(), shape.min_bytes(inputs[0].element_size())
        table, what = lce_providers(fb, inputs, shape), "LCE forward"
    else:
        p = attention_inputs(problem, device, dtype)
        ref = attention_cases.baseline(p, problem.checked, torch.float64)
        flops, min_bytes = shape.flops(), shape.min_bytes(p["q"].element_size())
        table, what = attention_providers(fb, p), f"Target attention (non-causal), counts {p['counts'].tolist()}"
    checked = f"first {problem.checked} checked" if problem.checked else "all checked"
    title = f"{what}, {problem.label}: {shape}, {problem.mapping_note()}, {dtype_name}, {checked}"
    title += f"; × baseline: over {THEIRS}"
    return Case(table, ref, flops, min_bytes, THEIRS, title)


# ---------------------------------------------------------------------------------------------
# Compiling first (GPU)
# ---------------------------------------------------------------------------------------------


def _with_config(kernel, config, call) -> None:
    """call() with their autotuner holding `config` alone (compiled into Triton's disk cache, not benchmarked); its
    configs back afterwards (a worker process runs several tasks)."""
    configs = kernel.configs
    kernel.configs, kernel.cache = [config], {}
    try:
        call()
    finally:
        kernel.configs, kernel.cache = configs, {}


def warm_fbgemm(directory: str, op: str, problem: Problem, device, dtype, start: int, stop: int) -> Case:
    """A precompile task (`Bench.precompile`): their configs [start, stop) of `op`, each launched alone on the problem
    (and on its K-padded variant), one provider each."""
    fb = load_fbgemm(directory)
    kernel = fb.kernel(op)
    if op == "lce":
        calls = _lce_calls(fb, lce_inputs(problem, device, dtype), problem.shape)
        calls = [calls[name] for name in (THEIRS, PADDED) if name in calls]  # PADDING launches PADDED's kernels
    else:
        calls = [_attention_calls(fb, attention_inputs(problem, device, dtype))[THEIRS][0]]
    providers = {
        f"config {i}, call {j}": Provider(partial(_with_config, kernel, kernel.configs[i], call))
        for i in range(start, min(stop, len(kernel.configs)))
        for j, call in enumerate(calls)
    }
    return Case(providers, None, 0.0, 0.0)


def warm_ours(op: str, problem: Problem, device, dtype) -> Case:
    """A precompile task: our providers of the problem, unchecked."""
    if op == "lce":
        table = lce_providers(None, lce_inputs(problem, device, dtype), problem.shape)
    else:
        table = attention_providers(None, attention_inputs(problem, device, dtype))
    return Case({name: p for name, p in table.items() if name.startswith("ours")}, None, 0.0, 0.0)


def warm_setups(directory: str, ops, dtypes, shapes, device, smoke: bool) -> list:
    """Precompile tasks: ours per problem; theirs in slices of CONFIGS_PER_WARM configs, per problem for LCE (its
    strides are constexpr), at the first problem for attention (its specialization is the same at every shape here)."""
    fb = load_fbgemm(directory)
    setups = []
    for dtype in dtypes:
        for op in ops:
            for i, problem in enumerate(problems(op, shapes, smoke)):
                setups.append(partial(warm_ours, op, problem, device, dtype))
                if op == "lce" or i == 0:
                    count = len(fb.kernel(op).configs)
                    setups += [
                        partial(warm_fbgemm, directory, op, problem, device, dtype, start, start + CONFIGS_PER_WARM)
                        for start in range(0, count, CONFIGS_PER_WARM)
                    ]
    return setups


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


def _num(value: float, digits: int = 4) -> str:
    return "" if math.isnan(value) else f"{value:.{digits}f}"


def summary(rows: list[tuple[str, str, str, dict[str, Result]]]) -> list[str]:
    """Ours against theirs, one row per table: device ms (CUPTI busy) and the speedups, also by do_bench."""
    head = ["op", "problem", "dtype", f"{THEIRS} ms", f"{OURS} ms", "ours: as dispatched ms"]
    head += [f"{OURS} × {THEIRS}", f"as dispatched × {THEIRS}", f"{OURS} × {THEIRS}, do_bench"]
    lines = []
    for op, label, dtype_name, results in rows:
        nan = Result("", 0.0)
        theirs, ours, dispatched = (results.get(name, nan) for name in (THEIRS, OURS, DISPATCHED[op]))
        lines.append(
            [op, label, dtype_name, _num(theirs.ms), _num(ours.ms), _num(dispatched.ms)]
            + [_num(theirs.ms / ours.ms, 2), _num(theirs.ms / dispatched.ms, 2)]
            + [_num(theirs.do_bench_ms / ours.do_bench_ms, 2)]
        )
    return ["Summary: ours against FBGEMM's Triton op (× > 1: ours faster)", "", *markdown(head, lines), ""]


def run(directory: str, ops, dtypes, shapes, smoke: bool, only: str = "") -> None:
    """Check and time every problem of `ops` × `shapes` in each of `dtypes`; tables, the summary and the JSON to
    $OUT (harness.Bench)."""
    fb = load_fbgemm(directory)
    dtype_names = [str(d).removeprefix("torch.") for d in dtypes]
    bench = Bench("fbgemm_compare_" + "_".join([*ops, *dtype_names]), smoke, only)
    bench.emit(fb.source_line(directory), "")
    setups = warm_setups(directory, ops, dtypes, shapes, bench.device, smoke)
    bench.precompile(setups, workers=min(16, os.cpu_count() or 1))  # nothing on the CPU
    rows = []
    for dtype, dtype_name in zip(dtypes, dtype_names, strict=True):
        for op in ops:
            for problem in problems(op, shapes, smoke):
                results = bench.table(case(op, fb, problem, bench.device, dtype), TOL)
                kernel = fb.kernel(op)
                choices = "; ".join(f"{key}: {config}" for key, config in kernel.cache.items())
                choices = choices or f"its one config, {kernel.configs[0]}"
                bench.emit(f"FBGEMM autotuner's choices (key: config): {choices}", "")
                rows.append((op, problem.label, dtype_name, results))
                if bench.on_gpu:
                    torch.cuda.empty_cache()
    bench.emit(*summary(rows))
    bench.raw.append(dict(table="source", directory=directory, fbgemm=fb.files))
    bench.finish()
