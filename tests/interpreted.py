"""Run a test file's `interpreted_*` tests in a child pytest with TRITON_INTERPRET=1: the variable
must be set before Triton compiles anything, so those tests cannot run in the parent process."""

import os
import subprocess
import sys
from pathlib import Path


def run_interpreted(test_file: str, timeout: float = 600) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test_file, "-k", "interpreted_"]
    done = subprocess.run(cmd, env=env, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1], done.stdout[-2000:]
