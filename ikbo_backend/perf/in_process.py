"""The served model's own call, no server: the python model built from its config file the way the
python backend builds it (`from_triton_args`: weights, warm-up, CUDA graphs), timed on fresh requests;
and the cost of fixed host and device work right after idle gaps (a server's cadence).

A call ends with the scores in host memory, so it waits for the device, as `execute` does.
"""

from __future__ import annotations

import json
import statistics
import time

import numpy as np

from ..ranker import PROFILES
from ..synthetic import make_request


def load_served(model: str, config: str):
    """The python model `model` built from configs/<config>.pbtxt as the python backend builds it."""
    import torch
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    from ..paths import MODEL_REPOSITORY
    from ..stages import RankerModel

    path = MODEL_REPOSITORY / model / ("config.pbtxt" if config == "config" else f"configs/{config}.pbtxt")
    parsed = text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
    if parsed.backend not in ("python", "python_inprocess"):
        raise SystemExit(f"{path}: not a python model (an ensemble has no in-process call of its own)")
    gpu = any(g.kind == model_config_pb2.ModelInstanceGroup.KIND_GPU for g in parsed.instance_group)
    args = {
        "model_config": json.dumps(json_format.MessageToDict(parsed, preserving_proto_field_name=True)),
        "model_name": model, "model_repository": str(MODEL_REPOSITORY / model),
        "model_instance_kind": "GPU" if gpu and torch.cuda.is_available() else "CPU", "model_instance_device_id": "0",
    }  # fmt: skip
    return RankerModel.from_triton_args(args)


def in_process(
    model: str, config: str, users: int, candidates: int, repeats: int, seed: int | None, gap_ms: float = 0.0
) -> dict:
    """Wall ms of `model`'s python-model call in this process, with `gap_ms` of sleep between calls
    (a server's cadence: a host's idle states can slow the call's host work after a gap)."""
    import torch

    from ..synthetic import to_tensors

    cuda = torch.cuda.is_available()
    reserved = torch.cuda.memory_reserved() if cuda else 0
    start = time.perf_counter()
    served = load_served(model, config)
    load_s = time.perf_counter() - start
    load_mib = (torch.cuda.memory_reserved() - reserved) / 2**20 if cuda else float("nan")
    rng = np.random.default_rng(seed)
    pool = [to_tensors(make_request(served.cfg, users, candidates, rng)) for _ in range(8)]
    times = []
    with torch.inference_mode():
        for i in range(repeats + 5):
            begin = time.perf_counter()
            scores = served(pool[i % len(pool)])["scores"]
            if i >= 5:  # the first calls settle allocator and caches
                times.append((time.perf_counter() - begin) * 1e3)
            if gap_ms:
                time.sleep(gap_ms / 1e3)
    if scores.shape != (candidates, served.cfg.tasks) or not torch.isfinite(scores).all():
        raise RuntimeError(f"{model}: bad scores {tuple(scores.shape)}")
    return {
        "model": model,
        "p50_ms": statistics.median(times),
        "mean_ms": statistics.fmean(times),
        "load_s": load_s,
        "load_mib": load_mib,
        "repeats": repeats,
    }


def idle_cost(gaps_ms: list[float], repeats: int, profile: str, seed: int | None) -> list[dict]:
    """Fixed work right after `gap` ms of sleep, median ms per gap: host (validate_request of a fresh
    15:1024 request of `profile`: numpy, one thread) and, where there is CUDA, device (16 bf16
    2048³ matmuls on random operands, timed by CUDA events, enqueued right after the sleep)."""
    import torch

    from ..paths import load_shape_ranges
    from ..requests import validate_request
    from ..synthetic import to_tensors

    cfg, ranges, rng = PROFILES[profile], load_shape_ranges(), np.random.default_rng(seed)
    requests = [to_tensors(make_request(cfg, 15, 1024, rng)) for _ in range(4)]
    cuda = torch.cuda.is_available()
    if cuda:
        a, b = (torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rows = []
    for gap in gaps_ms:
        host, device = [], []
        for i in range(repeats + 3):
            time.sleep(gap / 1e3)
            start = time.perf_counter()
            validate_request(cfg, ranges, requests[i % len(requests)])
            host_ms = (time.perf_counter() - start) * 1e3
            if cuda:
                time.sleep(gap / 1e3)
                begin.record()
                for _ in range(16):
                    torch.mm(a, b)
                end.record()
                end.synchronize()
            if i >= 3:
                host.append(host_ms)
                device.append(begin.elapsed_time(end) if cuda else float("nan"))
        rows.append({"gap_ms": gap, "host_ms": statistics.median(host), "device_ms": statistics.median(device)})
    return rows
