"""The online (dynamically batched) endpoints: batch isolation of good and bad one-user requests, and a
full queue answered 503."""

from __future__ import annotations

import threading
import time

import numpy as np

from ..client import client_module, infer_inputs
from . import CFG, CLIENT_ERRORS, PROTOCOLS

ONLINE_MODELS = ("ikbo_ranker_online", "baseline_ranker_online")


def _bad_online(kind: str, one: dict) -> tuple[str, dict]:
    """(input the message must name, a bad version of the online request `one`)."""
    if kind == "NaN dense":
        return "cand_dense", one | {
            "cand_dense": np.where(
                np.arange(one["cand_dense"].shape[1])[None, :, None] == 0, np.nan, one["cand_dense"]
            ).astype(np.float32)
        }
    if kind == "id outside table":
        return "cand_sparse_ids", one | {"cand_sparse_ids": one["cand_sparse_ids"] + CFG.cand_vocab_size}
    if kind == "history_len > L":
        return "user_history_len", one | {"user_history_len": np.full((1, 1), CFG.history_length + 1, np.int32)}
    if kind == "two users":
        return "user_dense", {k: np.concatenate([v, v]) for k, v in one.items()}
    if kind == "no candidates":
        return "cand_dense", one | {k: one[k][:, :0] for k in ("cand_dense", "cand_sparse_ids")}
    raise ValueError(f"kind: unknown {kind!r}")


BAD_ONLINE_KINDS = ("NaN dense", "id outside table", "history_len > L", "two users", "no candidates")


def _send_all(url_of, model, requests, protocol_of, workers=16):
    """Send concurrently (a client per thread); → list of (scores bytes | None, status, message, seconds)."""
    from concurrent.futures import ThreadPoolExecutor

    from tritonclient.utils import InferenceServerException

    local, opened = threading.local(), []

    def send(index):
        protocol = protocol_of(index)
        module = client_module(protocol)
        clients = local.__dict__.setdefault("clients", {})
        if protocol not in clients:
            clients[protocol] = module.InferenceServerClient(
                url_of(protocol), **({"network_timeout": 120} if protocol == "http" else {})
            )
            opened.append(clients[protocol])
        start = time.monotonic()
        try:
            result = clients[protocol].infer(
                model, infer_inputs(module, requests[index]), outputs=[module.InferRequestedOutput("scores")]
            )
            return result.as_numpy("scores").tobytes(), "OK", "", time.monotonic() - start
        except InferenceServerException as e:
            return None, str(e.status()), e.message() or str(e), time.monotonic() - start

    try:
        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(send, range(len(requests))))
    finally:
        for client in opened:
            client.close()


def _statistics(server, model) -> tuple[int, int]:
    import tritonclient.http as module

    connection = module.InferenceServerClient(server.http_url)
    try:
        stats = connection.get_inference_statistics(model)["model_stats"][0]
    finally:
        connection.close()
    return int(stats["inference_count"]), int(stats["execution_count"])


def _batch_invariant(server, model) -> bool:
    """Whether the served config of `model` sets the batch-invariant mode (parameter batch_invariant)."""
    import tritonclient.http as module

    connection = module.InferenceServerClient(server.http_url)
    try:
        parameters = connection.get_model_config(model).get("parameters", {})
    finally:
        connection.close()
    return parameters.get("batch_invariant", {}).get("string_value") == "yes"


def batch_isolation(server, rounds: int, seed: int, users: int = 24) -> dict:
    """Good and bad one-user requests interleaved and sent concurrently (HTTP and gRPC alternating) to
    both online endpoints, `rounds` times in shuffled orders. Criterion for a good answer: bit-identical
    to the same request's answer sent alone where the served config has `batch_invariant: "yes"`,
    else rel err <= 1e-5 to it (a batch runs the matmuls at another M, which changes the last bits);
    the count of bit-identical answers and the max rel err are reported either way. Every bad request:
    a 400 naming its input."""
    from ikbo_backend.online import split_by_user
    from ikbo_backend.synthetic import make_online_batch

    rng = np.random.default_rng(seed)
    url_of = lambda protocol: server.http_url if protocol == "http" else server.grpc_url  # noqa: E731
    failures, sent, per_model = [], 0, {}
    for model in ONLINE_MODELS:
        invariant = _batch_invariant(server, model)
        good = split_by_user(make_online_batch(CFG, users, users * 40, rng))
        solo = [_send_all(url_of, model, [one], lambda i: "http", workers=1)[0][0] for one in good]
        bad = [(kind, *_bad_online(kind, good[i % len(good)])) for i, kind in enumerate(BAD_ONLINE_KINDS * 2)]
        before = _statistics(server, model)
        goods, identical, max_rel = 0, 0, 0.0
        for r in range(rounds):
            items = [("good", i, one) for i, one in enumerate(good)] + [
                ("bad", kind, (name, one)) for kind, name, one in bad
            ]
            order = rng.permutation(len(items))
            items = [items[i] for i in order]
            answers = _send_all(
                url_of, model, [it[2] if it[0] == "good" else it[2][1] for it in items], lambda i: PROTOCOLS[i % 2]
            )
            for (what, key, payload), (scores, status, message, _), index in zip(items, answers, range(len(items))):
                sent += 1
                protocol = PROTOCOLS[index % 2]
                if what == "good":
                    goods += 1
                    if scores is None:
                        failures.append(f"{model} round {r}: good request {key} failed: {status} {message[:160]}")
                        continue
                    identical += scores == solo[key]
                    got, want = np.frombuffer(scores, np.float32), np.frombuffer(solo[key], np.float32)
                    rel = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-12))
                    max_rel = max(max_rel, rel)
                    if invariant and scores != solo[key]:
                        failures.append(
                            f"{model} round {r}: good request {key} not bit-identical to its solo answer (rel err {rel:.2e})"
                        )
                    elif rel > 1e-5:
                        failures.append(f"{model} round {r}: good request {key}: rel err {rel:.2e} to its solo answer")
                if what == "bad" and (status not in CLIENT_ERRORS[protocol] or f"'{payload[0]}'" not in message):
                    failures.append(f"{model} round {r}: bad '{key}' answered {status}: {message[:200]}")
        inferences, executions = (a - b for a, b in zip(_statistics(server, model), before))
        per_model[model] = {
            "batch_invariant": invariant,
            "requests": inferences,
            "executions": executions,
            "good": goods,
            "bit_identical_to_solo": int(identical),
            "max_rel_err_to_solo": float(f"{max_rel:.2e}"),
        }
        if executions >= inferences:
            failures.append(f"{model}: {executions} executions for {inferences} requests: nothing was batched")
    return {
        "requests": sent,
        "good": sum(m["good"] for m in per_model.values()),
        "bit_identical_to_solo": sum(m["bit_identical_to_solo"] for m in per_model.values()),
        "max_rel_err_to_solo": max(m["max_rel_err_to_solo"] for m in per_model.values()),
        "per_model": per_model,
        "failures": failures,
    }


def queue_full(server, bursts: int, burst: int = 48, candidates: int = 512, p99_bound_s: float = 30.0) -> dict:
    """`bursts` bursts of `burst` simultaneous one-user requests (`candidates` each) to
    ikbo_ranker_online over HTTP: the overflow is answered 503 "Exceeds maximum queue size", the
    others succeed; p99 latency of the accepted ones stays below `p99_bound_s`."""
    from ikbo_backend.online import split_by_user
    from ikbo_backend.synthetic import make_online_batch

    model, rng = "ikbo_ranker_online", np.random.default_rng(0)
    requests = split_by_user(make_online_batch(CFG, burst, burst * candidates, rng))
    url_of = lambda protocol: server.http_url  # noqa: E731
    answers = []
    for _ in range(bursts):
        answers += _send_all(url_of, model, requests, lambda i: "http", workers=burst)
    accepted = [a for a in answers if a[1] == "OK"]
    rejected = [a for a in answers if a[1] != "OK"]
    wrong = [a for a in rejected if a[1] != "503" or "Exceeds maximum queue size" not in a[2]]
    p99 = float(np.percentile([a[3] for a in accepted], 99)) if accepted else None
    failures = []
    if not rejected:
        failures.append("no request was rejected: the queue never overflowed")
    if wrong:
        failures.append(
            f"{len(wrong)} rejections not 503 'Exceeds maximum queue size', e.g. {[(a[1], a[2][:150]) for a in wrong[:3]]}"
        )
    if p99 is None or p99 > p99_bound_s:
        failures.append(f"p99 of accepted requests {p99} s")
    return {
        "requests": len(answers),
        "accepted": len(accepted),
        "rejected_503": len(rejected) - len(wrong),
        "accepted_p50_s": round(float(np.percentile([a[3] for a in accepted], 50)), 2) if accepted else None,
        "accepted_p99_s": None if p99 is None else round(p99, 2),
        "failures": failures,
    }
