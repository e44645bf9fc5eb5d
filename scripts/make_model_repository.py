#!/usr/bin/env python3
"""Write model_repository/'s config files from the role templates of ikbo_backend/model_repository.py.

.venv/bin/python scripts/make_model_repository.py           # rewrite the configs that differ
.venv/bin/python scripts/make_model_repository.py --check   # exit 1, listing them, if any differs
"""

import argparse
import sys
from pathlib import Path

from ikbo_backend.model_repository import stale_files, write_repository
from ikbo_backend.serving import MODEL_REPOSITORY


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-repository", type=Path, default=MODEL_REPOSITORY)
    parser.add_argument("--check", action="store_true", help="compare without writing; exit 1 if a file differs")
    args = parser.parse_args(argv)
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
