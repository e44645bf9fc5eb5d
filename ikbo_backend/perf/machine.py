"""What a measurement ran on: the CPU model, the GPU, the versions, in one line for a results table."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name() -> str:
    """The CPU model, and the GPU when torch sees one."""
    import torch

    cpu = f"CPU {cpu_model()}"
    return f"GPU {torch.cuda.get_device_name(0)}, {cpu}" if torch.cuda.is_available() else cpu


def package_version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def today() -> str:
    return f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}"


def environment() -> str:
    """Device, cores, torch and its threads, Python, today's date (UTC)."""
    import torch

    return (
        f"{device_name()}, {os.cpu_count()} cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), Python {platform.python_version()}, {today()}"
    )
