"""The per-op benchmarks' harness: providers checked against fp64, timed on the device, written up as tables.

A benchmark script (scripts/bench_lce.py, scripts/bench_attention.py) sets up a problem, names its providers
(name → `Provider`, a callable and how to check it) and hands them to a `Bench`, in the spirit of Liger-Kernel's
benchmark/scripts/utils.py (https://github.com/linkedin/Liger-Kernel).
- Check: a provider's output (written into NaN-poisoned buffers where the provider takes them, so an unwritten
  element shows) against an fp64 reference, `kernels.reference.rel_err` ≤ tol, before it is timed. A provider
  that fails is reported and not timed, and the run exits with status 1 after its tables are written.
- Time (ikbo_backend/perf/device_time.py): device busy ms (CUPTI, L2 flushed before each call: the ms column),
  device span ms and the SM clock after the call, do_bench ms (CUDA events: with the host's launch time where
  it outlasts the L2 flush), host µs per call and CUDA-graph replay ms where the provider asks for them.
- Floor: max(FLOPs / bf16 matmul rate, bytes / device copy bandwidth), both ceilings measured in the run.
- Report: the date, device and versions, the ceilings and markdown tables, printed and, with $OUT set, written
  to $OUT/<name>.md (the raw results to $OUT/<name>.json).
--smoke runs the same code on the CPU with tiny shapes and wall-clock times, under TRITON_INTERPRET=1, which the
script sets before it imports `kernels` (Triton builds the kernels at import): a check of the script, not a
measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import subprocess
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ikbo_backend.perf.device_time import device_times, event_ms, graph_ms, host_us

NAN = float("nan")


@dataclass
class Provider:
    """One way to compute a problem's output."""

    fn: Callable[[], Any]  # the timed call
    check: Callable[[], Any] | None = None  # the output to check, written into NaN-poisoned buffers; default fn()
    ref: Any = None  # fp64 reference (a tensor or a tuple of them) where it is not the case's
    flops: float | None = None  # where they are not the case's (another problem, a part of the work)
    graph: bool = False  # also time CUDA-graph replays
    host: bool = False  # also time the host's µs per call
    optional: bool = False  # an exception (not in this build or on this device) is a note, not a failure
    note: str = ""
    tol: float | None = None  # where the case's tolerance is not this provider's (a baseline less exact by design)


@dataclass
class Case:
    """A problem: its providers, the fp64 reference of their outputs, its FLOPs and the least bytes it moves; as a
    table, the provider the others are compared with and its title."""

    providers: dict[str, Provider]
    ref: Any
    flops: float
    min_bytes: float
    baseline: str = ""
    title: str = ""


@dataclass
class Result:
    name: str
    flops: float
    note: str = ""
    err: float = NAN  # rel err against fp64
    failed: str = ""
    ms: float = NAN  # device busy time
    span_ms: float = NAN
    sm_mhz: float = NAN
    do_bench_ms: float = NAN
    host_us: float = NAN
    graph_ms: float = NAN


def argument_parser(doc: str) -> argparse.ArgumentParser:
    """A parser with the harness's options; the script adds its own."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under the interpreter")
    parser.add_argument("--only", default="", help="only providers whose names start with one of these (a,b,...)")
    return parser


def nan_like(t: torch.Tensor, shape=None) -> torch.Tensor:
    """A NaN-filled buffer like t (or of `shape` in t's dtype and device): an output that shows unwritten elements."""
    return torch.full(t.shape if shape is None else shape, NAN, dtype=t.dtype, device=t.device)


def max_rel_err(out, ref) -> float:
    """The largest rel_err over the parts of a (tuple) output; NaN where a part holds a NaN. A reference may
    cover only the first rows of the output (the head of a large batch)."""
    from kernels.reference import rel_err  # after the script has set TRITON_INTERPRET

    if isinstance(ref, (tuple, list)):
        errs = [max_rel_err(o, r) for o, r in zip(out, ref, strict=True)]
        return NAN if any(math.isnan(e) for e in errs) else max(errs)
    return rel_err(out[: ref.shape[0]], ref)


def _nan_source(out, ref) -> str:
    """Where a NaN error comes from: the reference, the output, or neither (an empty string)."""

    def has_nan(t) -> bool:
        parts = t if isinstance(t, (tuple, list)) else (t,)
        return any(isinstance(x, torch.Tensor) and bool(torch.isnan(x).any()) for x in parts)

    return "; NaN in the reference" if has_nan(ref) else "; NaN in the output" if has_nan(out) else ""


def measure_ceilings(on_gpu: bool) -> tuple[float, float]:
    """(bf16 matmul FLOP/s on random 8192³, device copy bytes/s counting read + write); tiny sizes on the CPU."""
    device = "cuda" if on_gpu else "cpu"
    size, numel = (8192, 2**30) if on_gpu else (256, 2**20)
    a, b = (torch.randn(size, size, device=device, dtype=torch.bfloat16) for _ in range(2))
    matmul_ms = device_times(lambda: a @ b, on_gpu)[0]
    src = torch.randn(numel, device=device, dtype=torch.bfloat16)  # 2 GiB on the GPU
    dst = torch.empty_like(src)
    copy_ms = device_times(lambda: dst.copy_(src), on_gpu)[0]
    return 2 * size**3 / (matmul_ms * 1e-3), 2 * src.numel() * src.element_size() / (copy_ms * 1e-3)


def versions(on_gpu: bool) -> str:
    """The date, the device (name, SMs, driver) and the versions of torch, CUDA, Triton and Python."""
    import triton

    if on_gpu:
        props = torch.cuda.get_device_properties(0)
        device = f"{props.name} ({props.multi_processor_count} SMs), driver {_driver_version()}"
    else:
        device = "CPU (--smoke: Triton's interpreter, wall-clock times; not a measurement)"
    return (
        f"{datetime.date.today()}, {device}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
        f"triton {triton.__version__}, Python {platform.python_version()}"
    )


def _driver_version() -> str:
    try:
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        return subprocess.run(query, capture_output=True, text=True, timeout=20).stdout.split()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        return "?"


def _call_providers(setup: Callable[[], Case | list[Case]]) -> None:
    """precompile's worker: one call of every provider of setup()'s case(s)."""
    cases = setup()
    for case in cases if isinstance(cases, list) else [cases]:
        for provider in case.providers.values():
            try:
                provider.fn()
            except Exception:  # the timing process reports it
                pass
    torch.cuda.synchronize()


def _num(value: float, digits: int = 4) -> str:
    return "" if math.isnan(value) else f"{value:.{digits}f}"


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else NAN


def markdown(head: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table; columns right-aligned except "provider" and "note"."""
    align = ["---" if name in ("provider", "note") else "---:" for name in head]
    return ["| " + " | ".join(line) + " |" for line in (head, align, *rows)]


class Bench:
    """One benchmark run: the device, the ceilings, the report's lines and the providers that failed."""

    def __init__(self, name: str, smoke: bool, only: str = ""):
        if smoke and os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit(f"{name} --smoke: TRITON_INTERPRET=1 must be set before kernels is imported")
        if not smoke and not torch.cuda.is_available():
            raise SystemExit(f"{name}: needs a CUDA device (or --smoke)")
        self.name, self.on_gpu = name, not smoke
        self.device = "cuda" if self.on_gpu else "cpu"
        self.only = tuple(prefix for prefix in only.split(",") if prefix)
        self.lines: list[str] = []
        self.raw: list[dict] = []
        self.failures: list[str] = []
        if os.environ.get("OUT"):  # the tables land there: make it rather than lose a finished run
            Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        self.emit(versions(self.on_gpu))
        self.flop_rate, self.copy_rate = measure_ceilings(self.on_gpu)
        self.emit(
            f"ceilings measured here: bf16 matmul 8192³ {self.flop_rate / 1e12:.0f} TFLOP/s, "
            f"device copy {self.copy_rate / 1e12:.2f} TB/s (read + write)",
            "",
        )

    def emit(self, *lines: str) -> None:
        for line in lines:
            print(line, flush=True)
            self.lines.append(line)

    def precompile(self, setups: list[Callable[[], Case | list[Case]]], workers: int = 8) -> None:
        """Call every provider of every setup() once in spawned processes (setups picklable: partials of the
        script's module-level functions), so that Triton's disk cache holds the kernels before this process
        launches them. Nothing on the CPU (the interpreter compiles nothing)."""
        if not self.on_gpu or not setups:
            return
        start = time.perf_counter()
        context = torch.multiprocessing.get_context("spawn")
        try:
            with ProcessPoolExecutor(min(workers, len(setups)), mp_context=context) as pool:
                list(pool.map(_call_providers, setups))
        except Exception as exc:  # a crashed worker breaks the pool: the rest compiles in this process
            print(f"precompile: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        self.emit(
            f"compiled first in {min(workers, len(setups))} worker processes: {time.perf_counter() - start:.0f} s", ""
        )

    def floor_ms(self, flops: float, min_bytes: float) -> float:
        return max(flops / self.flop_rate, min_bytes / self.copy_rate) * 1e3

    def measure(self, case: Case, tol: float, calls: int = 50, host: bool = True) -> dict[str, Result]:
        """Check every provider of `case`, then time those that passed (host µs only where `host`)."""
        results = {}
        for name, provider in case.providers.items():
            if self.only and not name.startswith(self.only):
                continue
            result = results[name] = Result(name, provider.flops or case.flops, provider.note)
            try:
                out, ref = (provider.check or provider.fn)(), case.ref if provider.ref is None else provider.ref
                result.err = max_rel_err(out, ref)
                limit = tol if provider.tol is None else provider.tol
                if not result.err <= limit:
                    result.failed = f"rel err {result.err:.1e} against fp64, over {limit:.0e}{_nan_source(out, ref)}"
                else:
                    result.ms, result.span_ms, result.sm_mhz = device_times(provider.fn, self.on_gpu, calls)
                    result.do_bench_ms = event_ms(provider.fn, self.on_gpu)
                    result.host_us = host_us(provider.fn, self.on_gpu) if provider.host and host else NAN
                    result.graph_ms = graph_ms(provider.fn, self.on_gpu) if provider.graph else NAN
            except Exception as exc:  # one provider's failure must not end the run
                why = f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}"
                if provider.optional:
                    result.note = f"unavailable: {why}"
                else:
                    result.failed = why
            if result.failed:
                self.failures.append(f"{name}: {result.failed}")
            print(f"  {name}: {_num(result.ms)} ms, rel err {result.err:.1e} {result.failed}", flush=True)
        return results

    def table(self, case: Case, tol: float) -> dict[str, Result]:
        """Check and time the providers of `case`, then one row each: times, TFLOP/s, speedups over its baseline."""
        results = self.measure(case, tol)
        floor = self.floor_ms(case.flops, case.min_bytes)
        base = results.get(case.baseline, Result(case.baseline, case.flops))
        head = ["provider", "ms", "TFLOP/s", "× baseline", "% of floor", "rel err (fp64)", "span ms", "SM MHz"]
        head += ["do_bench ms", "× baseline, do_bench", "host µs", "CUDA-graph ms", "× baseline, graph", "note"]
        rows = [
            [r.name, _num(r.ms), _num(r.flops / r.ms / 1e9, 0), _num(_ratio(base.ms, r.ms), 2)]
            + [_num(100 * floor * r.flops / case.flops / r.ms, 0), f"{r.err:.1e}", _num(r.span_ms), _num(r.sm_mhz, 0)]
            + [_num(r.do_bench_ms), _num(_ratio(base.do_bench_ms, r.do_bench_ms), 2), _num(r.host_us, 0)]
            + [
                _num(r.graph_ms),
                _num(_ratio(base.graph_ms, r.graph_ms), 2),
                f"FAILED: {r.failed}" if r.failed else r.note,
            ]
            for r in results.values()
        ]
        self.emit(
            case.title,
            f"floor {floor:.4f} ms = max({case.flops / 1e9:.1f} GFLOP / bf16 matmul rate, "
            f"{case.min_bytes / 1e6:.0f} MB / copy bandwidth); baseline: {case.baseline}",
            "",
            *markdown(head, rows),
            "",
        )
        self.raw.append(dict(table=case.title, results=[dataclasses.asdict(r) for r in results.values()]))
        return results

    def sweep(
        self, title: str, points: Iterable[tuple[dict, Callable[[], Case]]], names: list[str], tol: float
    ) -> None:
        """One row per point (its parameters, then `setup()`'s case checked and timed): each provider's device ms
        and speedup over names[0] (the baseline), the floor, the best provider's share of it, the largest rel err
        (of the providers other than the baseline; the baseline's own in a column),
        the best speedup by do_bench and, for providers timed as CUDA graphs, their replays; then the range of
        each speedup over the sweep."""
        measured = []
        for params, setup in points:
            print(f"sweep point {params}", flush=True)
            case = setup()
            measured.append(
                (params, self.floor_ms(case.flops, case.min_bytes), self.measure(case, tol, calls=30, host=False))
            )
            case = None  # the point's tensors go before the next point's
            if self.on_gpu:
                torch.cuda.empty_cache()
        if not measured:
            return
        names = [n for n in names if any(n in results for _, _, results in measured)]  # e.g. no s6 off Hopper
        baseline, others = names[0], names[1:]
        graphs = [n for n in names if any(not math.isnan(r[n].graph_ms) for _, _, r in measured if n in r)]
        head = [*measured[0][0], *(f"{n} ms" for n in names), *(f"× baseline, {n}" for n in others)]
        head += ["floor ms", "best % of floor", "max rel err", "baseline rel err", "best × baseline, do_bench"]
        head += [f"{n} graph ms" for n in graphs] + (["best × baseline, graph"] if graphs else [])
        rows, speedups = [], {key: [] for key in [*others, "do_bench", "graph"]}
        for params, floor, results in measured:
            base = results.get(baseline, Result(baseline, NAN))
            got = [results[n] for n in others if n in results and not math.isnan(results[n].ms)]
            ratios = {n: _ratio(base.ms, results[n].ms) if n in results else NAN for n in others}
            best = {key: max((_ratio(getattr(base, key), getattr(r, key)) for r in got), default=NAN)
                    for key in ("do_bench_ms", "graph_ms")}  # fmt: skip
            for key, value in [*ratios.items(), ("do_bench", best["do_bench_ms"]), ("graph", best["graph_ms"])]:
                if not math.isnan(value):
                    speedups[key].append(value)
            errs = [r.err for name, r in results.items() if name != baseline]
            rows.append(
                [str(value) for value in params.values()]
                + [_num(results[n].ms) if n in results else "" for n in names]
                + [_num(ratios[n], 2) for n in others]
                + [_num(floor), _num(100 * floor / min((r.ms for r in got), default=NAN), 0)]
                + [f"{NAN if any(map(math.isnan, errs)) else max(errs, default=NAN):.1e}", f"{base.err:.1e}"]
                + [_num(best["do_bench_ms"], 2)]
                + [_num(results[n].graph_ms) if n in results else "" for n in graphs]
                + ([_num(best["graph_ms"], 2)] if graphs else [])
            )
        ranges = ", ".join(f"{key} {min(v):.2f}–{max(v):.2f}×" for key, v in speedups.items() if v)
        self.emit(title, "", *markdown(head, rows), "", f"speedup over {baseline} in the sweep: {ranges}", "")
        self.raw.append(
            dict(
                table=title,
                points=[
                    dict(params=params, floor_ms=floor, results=[dataclasses.asdict(r) for r in results.values()])
                    for params, floor, results in measured
                ],
            )
        )

    def finish(self) -> None:
        """Write the report to $OUT (when set); exit with status 1 if a provider failed."""
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], f"{self.name}.md").write_text("\n".join(self.lines) + "\n")
            Path(os.environ["OUT"], f"{self.name}.json").write_text(json.dumps(self.raw, indent=1))
        if self.failures:
            raise SystemExit(f"{self.name}: {len(self.failures)} provider(s) failed:\n" + "\n".join(self.failures))
