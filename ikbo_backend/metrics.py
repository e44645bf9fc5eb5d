"""Custom Prometheus metrics of the ranking models, through the python backend's metrics API
(`pb_utils.MetricFamily`; shown on tritonserver's metrics port, /metrics). Labels: `model`, and
`device` of the model instance ("cpu", "cuda:1"), so that per-GPU rates can be read when a model has
instances on several GPUs (instance groups, scripts/gpu_throughput.py).

| metric                                 | kind      | per IKBO batch of U users, B candidates     |
|----------------------------------------|-----------|---------------------------------------------|
| ikbo_candidates_scored_total           | counter   | += B                                        |
| ikbo_users_scored_total                | counter   | += U                                        |
| ikbo_candidates_per_user               | histogram | observes B / U (buckets CANDIDATES_PER_USER_BUCKETS) |
| ikbo_broadcast_bytes_avoided_total     | counter   | += (B − U) · replicated_row_bytes(cfg)      |
| ikbo_triton_compilations_total         | counter   | Triton compilations in the model's process, |
|                                        |           | label phase: "warmup" (load), "request" (0) |
| ikbo_execute_seconds_total             | counter   | wall time inside the model's `execute` (per |
|                                        |           | call; with Triton's execution count: the    |
|                                        |           | python backend's IPC is compute infer − it) |

Batches are counted where they run: `ikbo_interaction` (the CPU batch ensemble's interaction step),
`ikbo_ranker` (one model in the GPU configs) and `ikbo_ranker_online` (a coalesced batch of online
requests); the in-process warm-up is not counted, Triton's `model_warmup` requests are. The bytes
avoided are those the baseline interaction materializes by replicating user rows to candidate rows
(`BaselineRanker`: user_tokens [Ku, D], history_tokens [L, D], history_len per row), less the U
rows it would hold anyway. `pb_utils` is passed in, so this module imports without a server.

Sending is off the request path. In python backend 2.51 every `increment` / `observe` is a
synchronous round trip to the tritonserver process (the stub waits on an interprocess condition
variable, holding the GIL): five per answered request. `record*` only add to pending sums and a list
of ratio observations; a daemon thread sends them every FLUSH_SECONDS (counters summed: one
increment each per flush; one observe per batch, the histogram's count stays per batch), yielding
the GIL between sends, and `close()` sends the rest. So the port shows a batch within about
FLUSH_SECONDS of its answer. `flush_seconds=0` sends at once, from the caller (unit tests).
"""

from __future__ import annotations

import threading
import time

import torch

from .ranker import RankerConfig

CANDIDATES_PER_USER_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
FLUSH_SECONDS = 0.1


def replicated_row_bytes(cfg: RankerConfig, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of one user's row in the tensors the baseline replicates per candidate:
    user_tokens [Ku, D] and history_tokens [L, D] in `dtype`, history_len int32."""
    element = torch.finfo(dtype).bits // 8
    return (cfg.user_tokens + cfg.history_length) * cfg.embedding_dim * element + torch.iinfo(torch.int32).bits // 8


def broadcast_bytes_avoided(num_users: int, num_candidates: int, row_bytes: int) -> int:
    """(B − U) · row_bytes: what replicating U user rows to B candidate rows would have added."""
    return max(num_candidates - num_users, 0) * row_bytes


class RankerMetrics:
    """The metric families above, for one model instance (labels `model`, `device`). `record(U, B)`
    once per batch, `record_execute(seconds)` once per execute; `close()` when the model unloads."""

    def __init__(self, pb_utils, model_name: str, row_bytes: int, compilations=None, device=None, flush_seconds: float = FLUSH_SECONDS):
        """`compilations`: a shape_spec.CompileCounter installed before the model was built; `device`:
        the instance's torch device (label `device`; none when None). Instances of one model on
        different devices then count apart; with the same labels they share one counter."""
        family = pb_utils.MetricFamily
        labels = {"model": model_name} | ({} if device is None else {"device": str(device)})
        self.row_bytes = row_bytes
        self._families = [  # keep the families alive as long as their metrics
            family(name="ikbo_candidates_scored_total", description="Candidates scored", kind=family.COUNTER),
            family(name="ikbo_users_scored_total", description="Users scored", kind=family.COUNTER),
            family(name="ikbo_candidates_per_user", description="Candidates per user (B/U) of each batch", kind=family.HISTOGRAM),
            family(
                name="ikbo_broadcast_bytes_avoided_total",
                description="Bytes of user rows a broadcasting (baseline) model would have replicated: (B - U) * bytes per user row",
                kind=family.COUNTER,
            ),
            family(name="ikbo_execute_seconds_total", description="Wall time inside the python model's execute", kind=family.COUNTER),
        ]
        candidates, users, ratio, avoided, execute = self._families
        self.candidates = candidates.Metric(labels=labels)
        self.users = users.Metric(labels=labels)
        self.ratio = ratio.Metric(labels=labels, buckets=[float(b) for b in CANDIDATES_PER_USER_BUCKETS])
        self.avoided = avoided.Metric(labels=labels)
        self.execute_seconds = execute.Metric(labels=labels)
        self.compilations, self._compiled = compilations, {"warmup": 0, "request": 0}
        if compilations is not None:
            compiled = family(name="ikbo_triton_compilations_total", description="Triton kernel compilations", kind=family.COUNTER)
            self._families.append(compiled)
            self._compiled_metrics = {phase: compiled.Metric(labels={**labels, "phase": phase}) for phase in self._compiled}
        self._lock = threading.Lock()
        self._pending: dict[str, float] = {}  # counter attribute → sum not yet sent
        self._ratios: list[float] = []  # ratio observations not yet sent
        self._stop = threading.Event()
        self._sender = None
        self.flush()  # the warm-up's compilations
        if flush_seconds > 0:
            self._sender = threading.Thread(target=self._send_every, args=(flush_seconds,), name="ikbo-metrics", daemon=True)
            self._sender.start()

    def _add(self, counter: str, value: float) -> None:
        with self._lock:
            self._pending[counter] = self._pending.get(counter, 0.0) + value
        if self._sender is None:
            self.flush()

    def record_responses(self, pb_utils, requests, responses, users_input="user_tokens", candidates_input="cand_tokens") -> None:
        """`record` for each answered request of a batch model (U, B = rows of these two inputs)."""
        for request, response in zip(requests, responses):
            if not response.has_error():
                users = pb_utils.get_input_tensor_by_name(request, users_input).shape()[0]
                candidates = pb_utils.get_input_tensor_by_name(request, candidates_input).shape()[0]
                self.record(users, candidates)

    def record_execute(self, seconds: float) -> None:
        """Add one `execute` call's wall time."""
        self._add("execute_seconds", float(seconds))

    def record(self, num_users: int, num_candidates: int) -> None:
        with self._lock:
            for counter, value in (("candidates", num_candidates), ("users", num_users),
                                   ("avoided", broadcast_bytes_avoided(num_users, num_candidates, self.row_bytes))):  # fmt: skip
                self._pending[counter] = self._pending.get(counter, 0.0) + float(value)
            self._ratios.append(num_candidates / max(num_users, 1))
        if self._sender is None:
            self.flush()

    def flush(self) -> None:
        """Send what is pending: one increment per counter, one observe per batch, then the Triton
        compilations counted since the last flush. Between sends the GIL is yielded (`sleep(0)`), so
        a request arriving meanwhile waits for one send at most."""
        with self._lock:
            pending, ratios, self._pending, self._ratios = self._pending, self._ratios, {}, []
        sends = [(getattr(self, counter).increment, value) for counter, value in pending.items() if value]
        sends += [(self.ratio.observe, ratio) for ratio in ratios]
        if self.compilations is not None:
            for phase, metric in self._compiled_metrics.items():
                new = self.compilations.counts[phase] - self._compiled[phase]
                if new:
                    sends.append((metric.increment, float(new)))
                    self._compiled[phase] += new
        for send, value in sends:
            send(value)
            time.sleep(0)

    def _send_every(self, seconds: float) -> None:
        while not self._stop.wait(seconds):
            self.flush()

    def close(self) -> None:
        """Stop the sender thread and send what is left."""
        self._stop.set()
        if self._sender is not None:
            self._sender.join()
        self.flush()
