"""A repository with a broken model: the server refuses to start, with a message naming the model."""

from __future__ import annotations

import time

from ..tritonserver import TritonServerError, is_ready, running_tritonserver
from .repositories import rankers_repository


def broken(model: str = "ikbo_interaction") -> dict:
    """Start on a repository with one broken model: the server must refuse (exit before ready, or never
    ready) with a message naming the model."""
    start = time.monotonic()
    with rankers_repository(broken_model=model) as repo:
        try:
            with running_tritonserver(repo, timeout=120) as server:
                ready = is_ready(server.http_url)
                return {
                    "refused": False,
                    "ready": ready,
                    "failures": [f"server became ready={ready} with broken {model}"],
                }
        except TritonServerError as e:
            message = str(e)
    lines = [
        line for line in message.splitlines() if model in line and ("fail" in line.lower() or "error" in line.lower())
    ]
    failures = [] if lines else [f"no log line names {model}: {message[-1500:]}"]
    return {
        "refused": True,
        "seconds": round(time.monotonic() - start, 1),
        "message": lines[0][:300] if lines else None,
        "failures": failures,
    }
