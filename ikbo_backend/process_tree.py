"""What a running tritonserver's process tree holds, read from /proc: its python backend stubs (and
which of them died), the /dev/shm segments they map, their resident memory. Linux only."""

from __future__ import annotations

from pathlib import Path


def _children(pid: int) -> list[int]:
    try:
        tasks = Path(f"/proc/{pid}/task").iterdir()
        return [int(c) for t in tasks for c in (t / "children").read_text().split()]
    except OSError:
        return []


def stub_states(pid: int) -> dict[int, tuple[str, str]]:
    """Python backend stubs of tritonserver `pid`: child pid → (instance name or "", state letter);
    a killed stub stays a zombie ("Z", no command line) until its server exits."""
    stubs = {}
    for child in _children(pid):
        try:
            stat = Path(f"/proc/{child}/stat").read_text()
            argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        comm, state = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2]
        if comm.startswith("triton_python_b"):
            name = argv[-3].decode() if len(argv) > 3 and state != "Z" else ""  # ... <instance> DEFAULT ""
            stubs[child] = (name, state)
    return stubs


def dead_stubs(pid: int) -> list[int]:
    """Stub pids of tritonserver `pid` that died (zombies): python backend 2.51 never restarts them,
    every later request to that model fails with "Stub process '<instance>' is not healthy."."""
    return [child for child, (_, state) in stub_states(pid).items() if state in "ZX"]


def shm_segments(pid: int) -> set[str]:
    """/dev/shm files mapped by `pid` and its children (the python backend's regions)."""
    segments = set()
    for p in (pid, *_children(pid)):
        try:
            maps = Path(f"/proc/{p}/maps").read_text()
        except OSError:
            continue
        segments.update(line.split()[-1] for line in maps.splitlines() if " /dev/shm/" in line)
    return {s.removesuffix(" (deleted)") for s in segments}


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of `pid` and its children (VmRSS), in bytes; 0 for a process that is gone."""
    total = 0
    for p in (pid, *_children(pid)):
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        total += next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return total
