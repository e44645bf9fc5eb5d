"""Copies of models of a model repository, for a server that must not see the others or must serve them
changed: instance counts set, the python backend instead of python_inprocess, a config edited.

    python -m ikbo_backend.perf.repository_copy DIR --models ikbo_ranker [--python-backend] \\
        [--config large --gpu-instances 2]

writes DIR/model_repository (the models, their ensemble steps are not followed, and shape_ranges.json).
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import tempfile
from pathlib import Path

from google.protobuf import text_format

from ..instance_groups import on_backend
from ..paths import MODEL_REPOSITORY, SHAPE_RANGES_FILE
from ..pbtxt import read_config


def served_config(model_dir: Path, config: str | None) -> Path:
    """The config file Triton serves for `--model-config-name=config` (None: config.pbtxt)."""
    path = model_dir / ("config.pbtxt" if config is None else f"configs/{config}.pbtxt")
    return path if path.exists() or config is None else model_dir / "config.pbtxt"  # Triton's fallback


def copy_models(
    source: Path, models, repository: Path, follow_steps: bool = False, config: str | None = None
) -> list[str]:
    """Copy `models` of the repository `source` (and its shape_ranges.json) into `repository`; with
    `follow_steps`, also the steps of every ensemble among them as served with `config`. Returns the
    names copied."""
    pending, copied = list(models), []
    while pending:
        name = pending.pop()
        if name in copied:
            continue
        if not (source / name).is_dir():
            raise FileNotFoundError(f"{source}: no model {name!r}")
        shutil.copytree(source / name, repository / name, ignore=shutil.ignore_patterns("__pycache__"))
        copied.append(name)
        if follow_steps:
            served = read_config(served_config(repository / name, config))
            pending += [step.model_name for step in served.ensemble_scheduling.step]
    if (source / SHAPE_RANGES_FILE).exists():
        shutil.copy2(source / SHAPE_RANGES_FILE, repository)
    return copied


def set_instances(path: Path, count: int, gpu_only: bool = False) -> None:
    """Every instance_group of config `path` (only the KIND_GPU ones with `gpu_only`) to `count` instances;
    a config without instance groups (an ensemble) takes 1 only, unless `gpu_only`."""
    config = read_config(path)
    if not config.instance_group and count != 1 and not gpu_only:
        raise ValueError(f"{path}: no instance_group to set to {count}")
    for group in config.instance_group:
        if not gpu_only or group.kind == group.KIND_GPU:
            group.count = count
    path.write_text(text_format.MessageToString(config))


def use_python_backend(path: Path) -> None:
    """Config `path` on Triton's python backend where it names python_inprocess."""
    path.write_text(text_format.MessageToString(on_backend(read_config(path), "python")))


@contextlib.contextmanager
def repository_copy(models, prefix: str = "model-repository-"):
    """A temporary model repository holding a copy of `models` of model_repository/ (and shape_ranges.json)."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        repository = Path(tmp) / "model_repository"
        repository.mkdir()
        copy_models(MODEL_REPOSITORY, models, repository)
        yield repository


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path, help="the copy goes to ROOT/model_repository")
    parser.add_argument("--models", nargs="+", required=True)
    parser.add_argument("--python-backend", action="store_true", help="python instead of python_inprocess")
    parser.add_argument("--config", help="the config --gpu-instances applies to: configs/<name>.pbtxt")
    parser.add_argument("--gpu-instances", type=int, help="instances per KIND_GPU group of --config")
    args = parser.parse_args(argv)
    if args.gpu_instances is not None and not args.config:
        parser.error("--gpu-instances needs --config")
    repository = args.root / "model_repository"
    repository.mkdir(parents=True)
    for name in copy_models(MODEL_REPOSITORY, args.models, repository):
        for path in sorted((repository / name / "configs").glob("*.pbtxt")):
            if args.python_backend:
                use_python_backend(path)
            if args.gpu_instances is not None and path.stem == args.config:
                set_instances(path, args.gpu_instances, gpu_only=True)
    print(repository)


if __name__ == "__main__":
    main()
