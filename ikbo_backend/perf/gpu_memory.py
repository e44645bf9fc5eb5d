"""GPU memory in use from nvidia-smi (this process opens no CUDA context): a sample now, and the summary of
a `nvidia-smi --query-gpu=timestamp,memory.used,... --format=csv -l N` log.

    python -m ikbo_backend.perf.gpu_memory LOG.csv     # prints the summary line
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys


def gpu_memory_used_mib() -> int | None:
    """Device memory in use on the GPUs of CUDA_VISIBLE_DEVICES (all when unset), summed, from
    nvidia-smi (this process opens no CUDA context); None without nvidia-smi or a GPU."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    argv = [
        "nvidia-smi",
        "--query-gpu=memory.used",
        "--format=csv,noheader,nounits",
        *([f"--id={visible}"] if visible else []),
    ]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    values = [int(v) for v in out.split() if v.strip().isdigit()]
    return sum(values) if values else None


def summary(csv_path) -> str:
    """Memory used over a nvidia-smi CSV log (several GPUs: summed per sample): start, max, mid-run,
    end and the growth from mid-run, MiB; "" when the log holds no sample."""
    by_time: dict[str, int] = {}
    with open(csv_path) as f:
        for row in list(csv.reader(f))[1:]:
            if len(row) > 1 and row[1].strip().split()[0].isdigit():
                by_time[row[0]] = by_time.get(row[0], 0) + int(row[1].split()[0])
    used = list(by_time.values())
    if not used:
        return ""
    half = used[len(used) // 2 :]
    return (
        f"GPU memory used (MiB, every 2 s): start {used[0]}, max {max(used)}, mid-run {half[0]}, end {used[-1]}, "
        f"growth from mid-run {used[-1] - half[0]}"
    )


if __name__ == "__main__":
    line = summary(sys.argv[1])
    if line:
        print(f"\n{line}")
