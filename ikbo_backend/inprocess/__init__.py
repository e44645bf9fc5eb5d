"""The `python_inprocess` Triton backend: a model.py (TritonPythonModel) run inside tritonserver's
process instead of a python backend stub process (backend.c starts the interpreter, driver.py calls
the model, pb_utils.py is its `triton_python_backend_utils`, triton_c.py the C API via ctypes).

Why: in python backend 2.51 every request costs two process wake-ups and copies through shared
memory between tritonserver and the stub, a third of the GPU ranker's server compute
(docs/design/serving.md). Here the model's `execute` reads Triton's input buffers and writes its
output buffers directly.

Self-contained: nothing here imports the model code (it shares only ikbo_backend/libc.py with it).

Limits: one interpreter for all instances of all models on this backend (their Python code runs under
one GIL; GPU work and host copies release it); host-memory inputs and outputs only; no BLS, no
decoupled models. A model config opts in with `backend: "python_inprocess"`; `build` puts the
library where tritonserver looks for it (`<backend directory>/python_inprocess/`)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

BACKEND = "python_inprocess"
SOURCE = Path(__file__).with_name("backend.c")


def libpython() -> str:
    """The shared libpython of the running Python (what the backend embeds), or its soname."""
    soname = sysconfig.get_config_var("INSTSONAME") or f"libpython{sysconfig.get_python_version()}.so.1.0"
    path = Path(sysconfig.get_config_var("LIBDIR") or "") / soname
    return str(path) if path.is_file() else soname


def build(backend_dir: Path) -> Path:
    """Compile backend.c into `backend_dir`/python_inprocess/libtriton_python_inprocess.so unless it is
    there, built from this very source for this libpython: a stamp written after the library holds
    both, so another checkout sharing the backend directory, older or newer, gets its own library, and
    one that replaced it (without writing this stamp) is found out by being newer than the stamp.
    Returns the library's path; raises RuntimeError (with the compiler's output) if there is no C
    compiler or compiling fails."""
    target = Path(backend_dir) / BACKEND / f"libtriton_{BACKEND}.so"
    stamp = target.with_suffix(".stamp")
    built_from = f"{libpython()}\n{hashlib.sha256(SOURCE.read_bytes()).hexdigest()}\n"
    if (
        target.exists() and stamp.exists() and stamp.read_text() == built_from
        and stamp.stat().st_mtime_ns >= target.stat().st_mtime_ns
    ):  # fmt: skip
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError(f"no C compiler (cc, gcc or $CC) to build the {BACKEND} backend")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}")
    command = [
        compiler,
        "-O2",
        "-shared",
        "-fPIC",
        f'-DIKBO_LIBPYTHON="{libpython()}"',
        str(SOURCE),
        "-ldl",
        "-pthread",
        "-o",
        str(tmp),
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(
            f"building the {BACKEND} backend failed: {' '.join(command)}\n{result.stdout}{result.stderr}"
        )
    os.replace(tmp, target)  # atomic: a server starting in parallel never loads half a library
    stamp.write_text(built_from)
    return target
