"""Load-time autotuning: time candidate kernel configurations, keep the fastest correct one, and keep
the choice on disk so that a restart reads it instead of timing again. What is tuned (per op and
shape bucket) lives in ikbo_backend/shape_spec.py (`tune_buckets`); this module holds what does not
depend on the op.

Two caches, both under <repo>/.cache (gitignored); clear them with `rm -rf .cache/ikbo-tuning .cache/triton`:
- `.cache/ikbo-tuning/tuned_configs.json` (the directory is $IKBO_TUNING_CACHE when set): one JSON
  object {"entries": {key: entry}}. A key names everything a choice depends on: device name, SMs and
  compute capability, Triton and torch versions, op, dtype, model dims, the bucket's key and how the model
  runs (eager, or CUDA-graph replays: timed as such); an entry
  holds the chosen config (null: no candidate launched correctly, the kernel's heuristics stay), the
  (U, B) it was timed at and every candidate's median ms (or why it was dropped). Writers take an
  exclusive lock (flock on `tuned_configs.json.lock`), read the file again, add their entries and
  replace it atomically (temp file + rename): model instances loading in parallel never see half a
  file nor lose each other's entries, and only the first one times (the others wait, then read). A
  file that does not parse is ignored with a warning and rewritten.
- `.cache/triton`: Triton's compiled-kernel cache (TRITON_CACHE_DIR, unless the environment sets
  it), so that a restart loads the chosen kernels' binaries instead of compiling them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import triton

REPO_ROOT = Path(__file__).resolve().parents[1]
TUNING_DIR_ENV = "IKBO_TUNING_CACHE"
CACHE_FILE = "tuned_configs.json"
FORMAT = 6  # of an entry and its candidates (3: the Gluon attention kernel; 4: its items from an atomic counter, so
# its times with kv_len changed; 5: keys name how the model runs, eager or CUDA-graph replays; 6: the attention
# TileConfig lost its loop options, which format-5 tiles name); part of every key, so a change tunes again
WARMUP_MS, REP_MS = 10, 40  # triton.testing.do_bench per candidate: ≥ 40 runs of a ≤ 1 ms kernel
ROUNDS = 2  # timings of each candidate (in alternating order); the best median counts


def default_cache_path() -> Path:
    return Path(os.environ.get(TUNING_DIR_ENV) or REPO_ROOT / ".cache" / "ikbo-tuning") / CACHE_FILE


def use_persistent_triton_cache(directory=None) -> str:
    """Point Triton's compiled-kernel cache at `directory` (default <repo>/.cache/triton) unless
    TRITON_CACHE_DIR is already set; returns the directory in use. Triton 3.6 reads the variable at
    each compilation (triton.knobs.cache.dir), so this must run before the first one."""
    os.environ.setdefault("TRITON_CACHE_DIR", str(directory or REPO_ROOT / ".cache" / "triton"))
    return os.environ["TRITON_CACHE_DIR"]


def median_ms(fn) -> float:
    """Median time of `fn` in ms (CUDA events, L2 flushed between runs): for a model that runs eagerly,
    where a call's host launch time counts whenever it exceeds the device time."""
    return triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")


def graph_median_ms(fn) -> float:
    """Median time of `fn` in ms as CUDA-graph replays: for a model that replays its kernels from CUDA
    graphs, where the host's launch time does not count (and `fn` runs as it does under capture)."""
    return triton.testing.do_bench_cudagraph(fn, rep=REP_MS, return_mode="median")


def device_description(device) -> str:
    """What a tuned choice depends on besides the op: the device and the compiler versions."""
    device = torch.device(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name = f"{props.name} ({props.multi_processor_count} SMs, sm_{props.major}{props.minor})"
    else:
        name = device.type  # only the Triton interpreter runs the kernels here
    return f"{name}|triton {triton.__version__}|torch {torch.__version__}"


@dataclass(frozen=True)
class Candidate:
    """One configuration to try: `check()` launches it on poisoned outputs and says whether the
    result matches the reference; `run()` is the launch that gets timed; `choice` is what the cache
    stores (JSON) when it wins."""

    label: str
    choice: dict
    check: Callable[[], bool]
    run: Callable[[], object]


def fastest(candidates, timer=median_ms, rounds: int = ROUNDS) -> dict:
    """→ {"choice": the fastest correct candidate's choice or None, "ms": {label: ms, or why dropped}}.
    A candidate that raises when checked (Triton OutOfResources, a compilation error, anything) is
    dropped, with the exception's type as its entry in "ms".
    All are checked (and so compiled) first, then timed back to back, `rounds` times in alternating
    order, each keeping its best median: no compilation pause between timings (the clocks stay up),
    and no candidate always comes first."""
    ms, correct = {}, []
    for candidate in candidates:
        try:
            passed = candidate.check()
        except Exception as e:
            ms[candidate.label] = f"dropped: {type(e).__name__}"
            continue
        if passed:
            correct.append(candidate)
        else:
            ms[candidate.label] = "dropped: wrong result"
    for round_ in range(rounds):
        for candidate in correct if round_ % 2 == 0 else correct[::-1]:
            ms[candidate.label] = min(float(timer(candidate.run)), ms.get(candidate.label, math.inf))
    best = min(correct, key=lambda c: ms[c.label], default=None)
    return {"choice": None if best is None else best.choice, "ms": ms}


class TuningCache:
    """The tuned choices on disk (see the module docstring): `read`, and `locked` + `write`."""

    def __init__(self, path=None):
        self.path = Path(path) if path is not None else default_cache_path()

    def read(self) -> dict:
        """key → entry; {} when the file is missing, and (with a warning) when it does not parse."""
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
                raise ValueError('no "entries" object')
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
            warnings.warn(
                f"tuning cache {self.path} ignored ({type(e).__name__}: {e}); it will be rewritten", stacklevel=2
            )
            return {}
        return data["entries"]

    @contextlib.contextmanager
    def locked(self):
        """Exclusive lock over read-modify-write, across processes."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def write(self, entries: dict) -> None:
        """Replace the file atomically: readers see the old file or the new one, never a part."""
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"format": FORMAT, "entries": entries}, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        finally:
            Path(tmp).unlink(missing_ok=True)


def cached_entries(cache: TuningCache, jobs: dict[str, Callable[[], dict]]) -> dict[str, dict]:
    """key → entry for every key of `jobs`: read from the cache where it holds the key, else made by
    the job (which times candidates) and written back. Without the lock no job runs, so a restart
    whose keys are all cached reads the file and nothing else. A cache that cannot be written (a
    read-only checkout) costs a warning: the choices then last for this process only."""
    entries = cache.read()
    if all(key in entries for key in jobs):
        return {key: entries[key] for key in jobs}
    try:
        with cache.locked():
            entries = cache.read()  # another process may have tuned while this one waited
            missing = [key for key in jobs if key not in entries]
            for key in missing:
                entries[key] = jobs[key]()
            cache.write(entries)
    except OSError as e:
        warnings.warn(
            f"tuning cache {cache.path} not written ({e}); tuned choices kept in this process only", stacklevel=2
        )
        for key in jobs:
            if key not in entries:
                entries[key] = jobs[key]()
    return {key: entries[key] for key in jobs}
