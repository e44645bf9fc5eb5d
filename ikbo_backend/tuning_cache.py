"""The on-disk caches of load-time tuning (ikbo_backend/autotune.py), so that a restart reads the tuned choices
and loads the chosen kernels' binaries instead of timing and compiling again.

Two caches, both under <repo>/.cache (gitignored); clear them with `rm -rf .cache/ikbo-tuning .cache/triton`:
- `.cache/ikbo-tuning/tuned_configs.json` (the directory is $IKBO_TUNING_CACHE when set): one JSON
  object {"entries": {key: entry}}. A key (`entry_key`) names everything a choice depends on: the cache
  FORMAT, device name, SMs and compute capability, Triton and torch versions, op, dtype, model dims, the
  bucket's key and how the model runs (eager, or CUDA-graph replays: timed as such); an entry
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
import os
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import triton

REPO_ROOT = Path(__file__).resolve().parents[1]
TUNING_DIR_ENV = "IKBO_TUNING_CACHE"
CACHE_FILE = "tuned_configs.json"
FORMAT = 7  # of keys, entries and choices; part of every key, so entries of another format are never read


def default_cache_path() -> Path:
    return Path(os.environ.get(TUNING_DIR_ENV) or REPO_ROOT / ".cache" / "ikbo-tuning") / CACHE_FILE


def use_persistent_triton_cache(directory=None) -> str:
    """Point Triton's compiled-kernel cache at `directory` (default <repo>/.cache/triton) unless
    TRITON_CACHE_DIR is already set; returns the directory in use. Triton 3.6 reads the variable at
    each compilation (triton.knobs.cache.dir), so this must run before the first one."""
    os.environ.setdefault("TRITON_CACHE_DIR", str(directory or REPO_ROOT / ".cache" / "triton"))
    return os.environ["TRITON_CACHE_DIR"]


def device_description(device) -> str:
    """What a tuned choice depends on besides the op: the device and the compiler versions."""
    device = torch.device(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name = f"{props.name} ({props.multi_processor_count} SMs, sm_{props.major}{props.minor})"
    else:
        name = device.type  # only the Triton interpreter runs the kernels here
    return f"{name}|triton {triton.__version__}|torch {torch.__version__}"


def entry_key(device, *parts) -> str:
    """The cache key of a choice on `device` that depends on `parts` (op, dtype, dims, bucket, mode) besides."""
    return "|".join([f"v{FORMAT}", device_description(device), *map(str, parts)])


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
