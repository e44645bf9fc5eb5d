"""GPU configurations spread over a list of GPUs (issue 8), for `scripts/serve --gpus 0,1`.

For every model with a `configs/<base>.pbtxt` (base "gpu": the GPU configuration), write
`configs/<base>_gpus_<ids>.pbtxt` (e.g. `gpu_gpus_0_1.pbtxt`): the same ModelConfig except that
each KIND_GPU instance group lists those GPUs (`{ kind: KIND_GPU count: 1 gpus: [0, 1] }`: `count`
instances on each listed GPU). tritonserver then runs with `--model-config-name=<base>_gpus_<ids>`;
a model without that file (the ensembles under base "gpu") falls back to its config.pbtxt, as it
does under `--model-config-name=<base>`, so the served set differs from the base one only in
placement. Models whose base file has no KIND_GPU group (the ensembles of a profile such as "large")
get an unchanged copy, so they do not fall back to config.pbtxt.

Models on the `python_inprocess` backend (the GPU rankers and online endpoints) get `backend: "python"`
when spread over more than one GPU: in process every instance runs its Python under the one GIL of
tritonserver's process, so a second GPU added 18-26 % (two H200s, 2026-11-30, docs/perf.md); as python
backend stubs (a process per instance) the same instances scaled 1.89-1.95x from one GPU to two.
Faster still on a multi-GPU host: one tritonserver per GPU, in process (1.85-2.16x one GPU,
docs/scale-out.md). Since 2026-12-01 the graphed rankers' replays release the GIL once per request, and two
in-process instances on one GPU serve 1.58x one; over two GPUs that is not measured yet, so stubs stay the
default there and `keep_in_process` (`scripts/serve --keep-in-process`) serves the other way for that measurement.

Why explicit lists: a KIND_GPU group without `gpus` puts `count` instances on *every* GPU the server
sees ("By default, a single execution instance of the model is created for each GPU available",
Triton's model_configuration.md, Instance Groups), so the plain gpu.pbtxt cannot restrict a server
to some GPUs. With one GPU present and `--gpus 0` (or no flag) the plain base configuration is used.

Configs are read and written through protobuf text format with Triton's ModelConfig message
(`tritonclient.grpc.model_config_pb2`), never edited as strings; files are regenerated at every
start (atomic rename) and ignored by git (`.gitignore`: model_repository/*/configs/*_gpus_*.pbtxt).

GPU ids are CUDA ordinals as tritonserver sees them (after CUDA_VISIBLE_DEVICES), like
`model_instance_device_id` in the python backend.

    python -m ikbo_backend.instance_groups --gpus 0,1     # write, print the config name (for perf_sweep --config-name)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from .serving import MODEL_REPOSITORY

ModelConfig = model_config_pb2.ModelConfig
KIND_GPU = model_config_pb2.ModelInstanceGroup.KIND_GPU
GENERATED_GLOB = "*_gpus_*.pbtxt"  # under <model>/configs/; in .gitignore
INPROCESS_BACKEND = "python_inprocess"  # one interpreter in tritonserver's process (ikbo_backend/inprocess)


def visible_gpu_count() -> int:
    """CUDA devices this process (and a tritonserver started from it) sees: torch's count where torch
    has CUDA, else the GPUs `nvidia-smi -L` lists, capped by CUDA_VISIBLE_DEVICES when that is set."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
    except ImportError:
        pass
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    count = sum(line.startswith("GPU ") for line in listing.stdout.splitlines()) if listing.returncode == 0 else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return count if visible is None else min(count, len([d for d in visible.split(",") if d.strip()]))


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
    """The generated configuration's name: "gpu", [0, 1] → "gpu_gpus_0_1"."""
    return f"{base}_gpus_{'_'.join(map(str, gpus))}"


def read_config(path) -> ModelConfig:
    return text_format.Parse(Path(path).read_text(), ModelConfig())


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
    if on_gpus and len(gpus) > 1 and spread_config.backend == INPROCESS_BACKEND and not keep_in_process:
        spread_config.backend = "python"
    return spread_config


def write_gpu_configs(gpus: list[int], base: str = "gpu", model_repository=None, keep_in_process: bool = False) -> str:
    """Write configs/<base>_gpus_<ids>.pbtxt for every model with configs/<base>.pbtxt; return the
    name to pass as --model-config-name. ValueError when no model has a configs/<base>.pbtxt."""
    repository = Path(model_repository or MODEL_REPOSITORY)
    name = config_name(base, gpus)
    sources = sorted(repository.glob(f"*/configs/{base}.pbtxt"))
    if not sources:
        raise ValueError(f"base: no model in {repository} has configs/{base}.pbtxt")
    for source in sources:
        header = f"# Generated from {base}.pbtxt by ikbo_backend/instance_groups.py for GPUs {gpus}: do not edit, not in git.\n"
        text = header + text_format.MessageToString(spread(read_config(source), gpus, keep_in_process))
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=source.parent)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, source.with_name(f"{name}.pbtxt"))  # a server reading it never sees half a file
    return name


def serve_config_name(
    gpus: list[int] | None, available: int, base: str = "gpu", model_repository=None, keep_in_process: bool = False
) -> str:
    """The --model-config-name to serve with: `base` itself where at most one GPU is present and the
    list is the default (or [0]), else the configuration generated for `gpus` (default: every GPU
    present; check them first with parse_gpus(text, available))."""
    gpus = list(range(available)) if gpus is None else gpus
    if available <= 1 and gpus in ([], [0]):
        return base
    return write_gpu_configs(gpus, base, model_repository, keep_in_process)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", help="comma-separated GPU ids (default: every GPU present)")
    parser.add_argument("--base", default="gpu", help="configuration to spread (configs/<base>.pbtxt)")
    parser.add_argument("--model-repository", type=Path, default=MODEL_REPOSITORY)
    parser.add_argument(
        "--no-check", action="store_true", help="write for ids this machine does not have (e.g. on a CPU host)"
    )
    args = parser.parse_args(argv)
    try:
        if args.no_check:
            if args.gpus is None:
                raise ValueError("--gpus: required with --no-check")
            print(write_gpu_configs(parse_gpus(args.gpus), args.base, args.model_repository))
        else:
            available = visible_gpu_count()
            gpus = None if args.gpus is None else parse_gpus(args.gpus, available)
            print(serve_config_name(gpus, available, args.base, args.model_repository))
    except ValueError as e:
        parser.error(str(e))


if __name__ == "__main__":
    main()
