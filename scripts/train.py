#!/usr/bin/env python3
"""Train the ranker on click data with a planted teacher (or MovieLens-100k) and write the weights `make serve` loads.

AdamW over the IKBO variant (`--variant baseline`: the replicating one, same function), bf16 autocast on a GPU,
held-out AUC and log-loss every --eval-every steps beside the data's reference (the teacher's; on MovieLens item
popularity's AUC), a checkpoint at each evaluation (`--resume` continues it), then the weights file (RankerConfig
in its metadata), OUT/metrics.json and OUT/curves.png (ikbo_backend/training.py; the data:
ikbo_backend/clicks.py, ikbo_backend/movielens.py).

    python scripts/train.py                                   # demo profile, CPU-sized: then `make serve`
    python scripts/train.py --steps 800 --resume              # continue the same run to 800 steps
    python scripts/train.py --data movielens                  # MovieLens-100k (in the recbole wheel)
    python scripts/train.py --profile large --steps 2000 --requests-per-step 8   # on a GPU, bf16
    python scripts/serve --config large                        # serves weights/ranker_large.safetensors
"""

import argparse
import sys

from ikbo_backend.paths import profile_weights_path
from ikbo_backend.ranker import PROFILES
from ikbo_backend.training import DATA, DEFAULT_LENGTH, DTYPES, VARIANTS, TrainConfig, held_out, train

DEFAULTS = TrainConfig.__dataclass_fields__


def parse_args(argv=None) -> TrainConfig:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    default = {name: field.default for name, field in DEFAULTS.items()}
    parser.add_argument("--profile", default=default["profile"], choices=sorted(PROFILES), help="model dims")
    parser.add_argument("--variant", default=default["variant"], choices=VARIANTS)
    parser.add_argument(
        "--data",
        dest="source",
        default=default["source"],
        choices=sorted(DATA),
        help="clicks: generated, labelled by a planted teacher; movielens: MovieLens-100k ratings",
    )
    cpu, gpu = DEFAULT_LENGTH["cpu"], DEFAULT_LENGTH["cuda"]
    parser.add_argument(
        "--steps",
        type=int,
        help=f"optimizer steps in all, with --resume too (default {cpu[0]} on the CPU, {gpu[0]} on a GPU)",
    )
    parser.add_argument(
        "--requests-per-step",
        type=int,
        help=f"requests of --users:--candidates a step (default {cpu[1]}; {gpu[1]} on a GPU)",
    )
    parser.add_argument("--users", type=int, default=default["users"], help="U per request")
    parser.add_argument("--candidates", type=int, default=default["candidates"], help="B per request")
    parser.add_argument("--lr", type=float, default=default["lr"], help="AdamW learning rate")
    parser.add_argument(
        "--final-lr",
        type=float,
        default=default["final_lr"],
        help="cosine decay to this fraction of --lr (1: constant)",
    )
    parser.add_argument("--weight-decay", type=float, default=default["weight_decay"])
    parser.add_argument("--eval-every", type=int, default=default["eval_every"], help="steps between evaluations")
    parser.add_argument("--heldout-requests", type=int, default=default["heldout_requests"])
    parser.add_argument("--seed", type=int, default=default["seed"], help="data set seed")
    parser.add_argument("--teacher-seed", type=int, default=default["teacher_seed"], help="clicks only")
    parser.add_argument("--init-seed", type=int, default=default["init_seed"], help="the student's initial weights")
    parser.add_argument("--device", default=default["device"], help="auto, cpu or cuda[:i]")
    parser.add_argument("--dtype", default=default["dtype"], choices=["auto", *DTYPES], help="autocast dtype")
    parser.add_argument("--backend", default=default["backend"], choices=["auto", "torch", "triton"])
    parser.add_argument(
        "--threads", type=int, default=default["threads"], help="torch CPU threads (0: one per core; 1 on a busy CPU)"
    )
    parser.add_argument(
        "--weights",
        default=None,
        help="weights file to write, relative to the project root (default: the one `make serve` loads for --profile)",
    )
    parser.add_argument(
        "--out", default=default["out"], help="folder of checkpoint.pt, metrics.json, curves.png (project-relative)"
    )
    parser.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        return TrainConfig(**vars(args))
    except ValueError as error:
        parser.error(str(error))


def main(argv=None) -> None:
    config = parse_args(argv)
    try:
        summary = train(config)
    except (ValueError, FileNotFoundError) as error:
        sys.exit(f"train.py: error: {error}")
    final = summary["final"]
    served = profile_weights_path(config.profile)
    if config.profile != "demo":
        serve = f"scripts/serve --config {config.profile}" + (
            "" if config.weights_path() == served else f" (loads {served}: copy the weights there)"
        )
    else:
        serve = "make serve" if config.weights_path() == served else f"IKBO_WEIGHTS={config.weights_path()} make serve"
    print(
        f"{summary['steps']} steps on {config.source} in {summary['seconds']:.0f} s on {summary['device']} "
        f"({summary['autocast']}): {held_out(final, summary['reference'])}\n"
        f"weights: {summary['weights']}\ncurves:  {config.out_dir() / 'curves.png'}\n"
        f"serve:   {serve}"
    )


if __name__ == "__main__":
    main()
