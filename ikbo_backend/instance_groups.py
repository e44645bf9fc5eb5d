"""Serve-time configurations derived from a committed one (`scripts/serve --gpus 0,1`, `--backend python`).

From every model's `configs/<base>.pbtxt` (base "gpu" or "large"), written next to it and ignored by
git (`.gitignore`):
- `configs/<base>_python.pbtxt` (`backend_config_name`): the same ModelConfig on Triton's python
  backend where it names `python_inprocess` (a stub process per instance: no C compiler needed to
  build the in-process backend, and a crash in a model stays in its stub).
- `configs/<base>_gpus_<ids>.pbtxt` (`config_name`): the same ModelConfig except that each KIND_GPU
  instance group lists those GPUs (`{ kind: KIND_GPU count: 1 gpus: [0, 1] }`: `count` instances on
  each listed GPU), and, over more than one GPU, the python backend for the `python_inprocess` models
  unless `keep_in_process` (`scripts/serve --keep-in-process`): in process every instance runs its
  Python under the one GIL of tritonserver's process, as stubs each instance has its own
  (docs/scale-out.md; one tritonserver per GPU, in process, is faster still there).

tritonserver then runs with `--model-config-name=<name>`; a model without that file falls back to
its config.pbtxt, as under `--model-config-name=<base>`, so the served set differs from the base one
only in placement and backend. Models whose base file has no KIND_GPU group get an unchanged copy.

Why explicit GPU lists: a KIND_GPU group without `gpus` puts `count` instances on *every* GPU the
server sees ("By default, a single execution instance of the model is created for each GPU
available", Triton's model_configuration.md, Instance Groups), so the plain gpu.pbtxt cannot restrict
a server to some GPUs. With one GPU present and `--gpus 0` (or no flag) the base configuration is used.
GPU ids are CUDA ordinals as tritonserver sees them (after CUDA_VISIBLE_DEVICES), like
`model_instance_device_id` in the python backend.

Configs are read and written as ModelConfig messages (ikbo_backend.pbtxt), regenerated at every start.
"""

from __future__ import annotations

from pathlib import Path

from tritonclient.grpc import model_config_pb2

from .model_repository import INPROCESS_BACKEND
from .paths import MODEL_REPOSITORY
from .pbtxt import ModelConfig, read_config, render, write_text

KIND_GPU = model_config_pb2.ModelInstanceGroup.KIND_GPU
GENERATED_GLOBS = ("*_gpus_*.pbtxt", "*_python.pbtxt")  # under <model>/configs/; in .gitignore
BACKENDS = (INPROCESS_BACKEND, "python")  # for the python_inprocess models of the GPU configs


def parse_gpus(text: str, available: int | None = None) -> list[int]:
    """ "0,1" → [0, 1]. ValueError naming `--gpus` for anything but distinct non-negative integers, and,
    when `available` is given, for an id that is not below it."""
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or not all(item.isdigit() for item in items):
        raise ValueError(f"--gpus: expected comma-separated GPU ids such as 0,1, got {text!r}")
    gpus = [int(item) for item in items]
    if len(set(gpus)) != len(gpus):
        raise ValueError(f"--gpus: GPU ids must be distinct, got {text!r}")
    if available is not None:
        missing = [g for g in gpus if g >= available]
        if missing:
            present = f"GPUs {', '.join(map(str, range(available)))}" if available else "no GPU"
            raise ValueError(f"--gpus: GPU {', '.join(map(str, missing))} not present (this machine sees {present})")
    return gpus


def config_name(base: str, gpus: list[int]) -> str:
    """The GPU-list configuration's name: "gpu", [0, 1] → "gpu_gpus_0_1"."""
    return f"{base}_gpus_{'_'.join(map(str, gpus))}"


def backend_config_name(base: str, backend: str) -> str:
    """The configuration on `backend`: "gpu", "python" → "gpu_python"; `base` itself for python_inprocess."""
    return base if backend == INPROCESS_BACKEND else f"{base}_{backend}"


def on_backend(config: ModelConfig, backend: str) -> ModelConfig:
    """A copy of `config` with `backend` in place of python_inprocess (other backends unchanged)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    derived = ModelConfig()
    derived.CopyFrom(config)
    if derived.backend == INPROCESS_BACKEND:
        derived.backend = backend
    return derived


def spread(config: ModelConfig, gpus: list[int], keep_in_process: bool = False) -> ModelConfig:
    """A copy of `config` whose KIND_GPU instance groups list `gpus` (their `count` is per GPU), and,
    over more than one GPU, the `python_inprocess` backend replaced by `python` (a stub process per instance)
    unless `keep_in_process`; every other field, other groups included, unchanged."""
    if not gpus:
        raise ValueError("gpus: expected at least one GPU id, got []")
    spread_config = ModelConfig()
    spread_config.CopyFrom(config)
    on_gpus = False
    for group in spread_config.instance_group:
        if group.kind == KIND_GPU:
            del group.gpus[:]
            group.gpus.extend(gpus)
            on_gpus = True
    if on_gpus and len(gpus) > 1 and not keep_in_process:
        return on_backend(spread_config, "python")
    return spread_config


def _write_derived(base: str, name: str, derive, why: str, model_repository=None) -> str:
    """Write configs/<name>.pbtxt = derive(configs/<base>.pbtxt) for every model that has the base file;
    return `name`. ValueError when no model has a configs/<base>.pbtxt."""
    repository = Path(model_repository or MODEL_REPOSITORY)
    sources = sorted(repository.glob(f"*/configs/{base}.pbtxt"))
    if not sources:
        raise ValueError(f"base: no model in {repository} has configs/{base}.pbtxt")
    header = f"Generated from {base}.pbtxt by ikbo_backend/instance_groups.py {why}: do not edit, not in git."
    for source in sources:
        write_text(source.with_name(f"{name}.pbtxt"), render(derive(read_config(source)), header))
    return name


def write_gpu_configs(gpus: list[int], base: str = "gpu", model_repository=None, keep_in_process: bool = False) -> str:
    """Write configs/<base>_gpus_<ids>.pbtxt for every model with configs/<base>.pbtxt; return the
    name to pass as --model-config-name."""
    return _write_derived(
        base, config_name(base, gpus), lambda c: spread(c, gpus, keep_in_process), f"for GPUs {gpus}", model_repository
    )


def write_backend_configs(backend: str, base: str = "gpu", model_repository=None) -> str:
    """Write configs/<base>_<backend>.pbtxt for every model with configs/<base>.pbtxt (nothing for
    python_inprocess, the committed files' backend); return the name to pass as --model-config-name."""
    name = backend_config_name(base, backend)
    if name == base:
        return base
    return _write_derived(base, name, lambda c: on_backend(c, backend), f"on the {backend} backend", model_repository)


def serve_config_name(
    gpus: list[int] | None,
    available: int,
    base: str = "gpu",
    model_repository=None,
    keep_in_process: bool = False,
    backend: str = INPROCESS_BACKEND,
) -> str:
    """The --model-config-name to serve with: `base` on `backend` (`base` itself for python_inprocess)
    where at most one GPU is present and the list is the default (or [0]), else that configuration
    spread over `gpus` (default: every GPU present; check them first with parse_gpus(text, available))."""
    if backend not in BACKENDS:
        raise ValueError(f"--backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    base = write_backend_configs(backend, base, model_repository)
    gpus = list(range(available)) if gpus is None else gpus
    if available <= 1 and gpus in ([], [0]):
        return base
    return write_gpu_configs(gpus, base, model_repository, keep_in_process)
