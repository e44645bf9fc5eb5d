#!/usr/bin/env python3
"""Write model_repository/'s config files from the role templates of ikbo_backend/model_repository.py.

.venv/bin/python scripts/make_model_repository.py                      # rewrite the configs that differ
.venv/bin/python scripts/make_model_repository.py --check              # exit 1, listing them, if any differs
.venv/bin/python scripts/make_model_repository.py --gpus 0,1           # only the serve-time configs that
.venv/bin/python scripts/make_model_repository.py --backend python     # scripts/serve would derive; prints
                                                                       # the --model-config-name
"""

import argparse
import sys
from pathlib import Path

from ikbo_backend.instance_groups import (
    BACKENDS,
    parse_gpus,
    serve_config_name,
    write_backend_configs,
    write_gpu_configs,
)
from ikbo_backend.model_repository import stale_files, write_repository
from ikbo_backend.paths import MODEL_REPOSITORY
from ikbo_backend.tritonserver import visible_gpu_count


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-repository", type=Path, default=MODEL_REPOSITORY)
    parser.add_argument("--check", action="store_true", help="compare without writing; exit 1 if a file differs")
    derived = parser.add_argument_group(
        "serve-time configs (ikbo_backend.instance_groups, as scripts/serve writes them)"
    )
    derived.add_argument("--gpus", help="GPU ids to spread the configuration over, e.g. 0,1")
    derived.add_argument("--backend", choices=BACKENDS, default=BACKENDS[0], help="backend of the in-process models")
    derived.add_argument("--config", default="gpu", help="configuration to derive from (configs/<config>.pbtxt)")
    derived.add_argument("--keep-in-process", action="store_true", help="over several GPUs keep python_inprocess")
    derived.add_argument("--no-check", action="store_true", help="write for GPU ids this machine does not have")
    args = parser.parse_args(argv)
    if args.gpus is not None or args.backend != BACKENDS[0]:
        try:
            if args.no_check:
                if args.gpus is None:
                    raise ValueError("--gpus: required with --no-check")
                base = write_backend_configs(args.backend, args.config, args.model_repository)
                name = write_gpu_configs(parse_gpus(args.gpus), base, args.model_repository, args.keep_in_process)
            else:
                available = visible_gpu_count()
                gpus = None if args.gpus is None else parse_gpus(args.gpus, available)
                name = serve_config_name(
                    gpus, available, args.config, args.model_repository, args.keep_in_process, args.backend
                )
        except ValueError as e:
            parser.error(str(e))
        print(name)
        return
    if args.check:
        stale = stale_files(args.model_repository)
        for path in stale:
            print(f"{args.model_repository / path}: differs from its template (run scripts/make_model_repository.py)")
        sys.exit(1 if stale else 0)
    written = write_repository(args.model_repository)
    for path in written:
        print(f"wrote {args.model_repository / path}")
    print(f"{len(written)} config(s) written, the others were up to date")


if __name__ == "__main__":
    main()
