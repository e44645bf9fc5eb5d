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

Batches are counted where they run (python_model.py, the ikbo variant): `ikbo_interaction` (the CPU
batch ensemble's interaction step), `ikbo_ranker` (one model in the GPU configs) and
`ikbo_ranker_online` (a coalesced batch of online requests); the in-process warm-up is not counted,
Triton's `model_warmup` requests are. The bytes
avoided are those the baseline interaction materializes by replicating user rows to candidate rows
(`BaselineRanker`: user_tokens [Ku, D], history_tokens [L, D], history_len per row), less the U
rows it would hold anyway. `pb_utils` is passed in, so this module imports without a server.

Under the python_inprocess backend (GPU configs) a worker thread makes the updates, off the request
path: `execute` appends (U, B) to a queue, and the worker pushes what gathered every PUSH_PERIOD_S
(counters once, the histogram once per batch), so values show on /metrics within 50 ms of the
response. Each update is a C call into the server, tens of µs per request if made in `execute`.
The worker is never woken by a request: woken from `execute`, it would take the GIL at the request's
next release and hold it while the request waits. Under the python backend's stub, updates are made
in place, per batch.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import torch

from .ranker import RankerConfig

PUSH_PERIOD_S = 0.05  # the worker's cadence (python_inprocess): updates show on /metrics within it
CANDIDATES_PER_USER_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


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
    once per batch; `close()` when the model is finalized."""

    def __init__(
        self, pb_utils, model_name: str, row_bytes: int, compilations=None, device=None, background: bool | None = None
    ):
        """`compilations`: a compile_counter.CompileCounter installed before the model was built; `device`:
        the instance's torch device (label `device`; none when None). Instances of one model on
        different devices then count apart; with the same labels they share one counter.
        `background`: updates on a worker thread (None: where pb_utils is the python_inprocess one)."""
        family = pb_utils.MetricFamily
        labels = {"model": model_name} | ({} if device is None else {"device": str(device)})
        self.row_bytes = row_bytes
        self._families = [  # keep the families alive as long as their metrics
            family(name="ikbo_candidates_scored_total", description="Candidates scored", kind=family.COUNTER),
            family(name="ikbo_users_scored_total", description="Users scored", kind=family.COUNTER),
            family(
                name="ikbo_candidates_per_user",
                description="Candidates per user (B/U) of each batch",
                kind=family.HISTOGRAM,
            ),
            family(
                name="ikbo_broadcast_bytes_avoided_total",
                description="Bytes of user rows a broadcasting (baseline) model would have replicated: (B - U) * bytes per user row",
                kind=family.COUNTER,
            ),
            family(
                name="ikbo_execute_seconds_total",
                description="Wall time inside the python model's execute",
                kind=family.COUNTER,
            ),
        ]
        candidates, users, ratio, avoided, execute = self._families
        self.candidates = candidates.Metric(labels=labels)
        self.users = users.Metric(labels=labels)
        self.ratio = ratio.Metric(labels=labels, buckets=[float(b) for b in CANDIDATES_PER_USER_BUCKETS])
        self.avoided = avoided.Metric(labels=labels)
        self.execute_seconds = execute.Metric(labels=labels)
        self.compilations, self._compiled = compilations, {"warmup": 0, "request": 0}
        if compilations is not None:
            compiled = family(
                name="ikbo_triton_compilations_total", description="Triton kernel compilations", kind=family.COUNTER
            )
            self._families.append(compiled)
            self._compiled_metrics = {
                phase: compiled.Metric(labels={**labels, "phase": phase}) for phase in self._compiled
            }
            self.sync_compilations()
        if background is None:
            background = getattr(pb_utils, "IN_SERVER_PROCESS", False)
        self._pending: deque[tuple] = (
            deque()
        )  # (U, B) of a batch, or (None, seconds) of an execute (append, popleft: atomic)
        self._push_lock = threading.Lock()
        self._worker = None
        if background:
            self._closing = False
            self._worker = threading.Thread(target=self._push_every_period, name=f"metrics {model_name}", daemon=True)
            self._worker.start()

    def _add(self, item: tuple) -> None:
        self._pending.append(item)
        if self._worker is None:
            self.flush()

    def _push_every_period(self) -> None:
        """Wake every PUSH_PERIOD_S and push what gathered. Never woken by a request: a worker woken
        from `execute` takes the GIL at the request's next release (a torch op, a copy) and holds it
        for its pushes while the request waits."""
        while not self._closing:
            time.sleep(PUSH_PERIOD_S)
            if self._pending:
                self.flush()

    def flush(self) -> None:
        """Make the pending updates now, on this thread: counters once per flush, one histogram
        observation per batch."""
        with self._push_lock:
            items = [self._pending.popleft() for _ in range(len(self._pending))]  # `_add` may append meanwhile
            batches = [item for item in items if item[0] is not None]
            seconds = sum(item[1] for item in items if item[0] is None)
            if batches:
                self.candidates.increment(float(sum(b for _, b in batches)))
                self.users.increment(float(sum(u for u, _ in batches)))
                for users, candidates in batches:
                    self.ratio.observe(candidates / max(users, 1))
                self.avoided.increment(float(sum(broadcast_bytes_avoided(u, b, self.row_bytes) for u, b in batches)))
                self.sync_compilations()
            if seconds:
                self.execute_seconds.increment(float(seconds))

    def close(self) -> None:
        """Make the pending updates and stop the worker (the model's finalize)."""
        if self._worker is not None and self._worker.is_alive():
            self._closing = True
            self._worker.join(10.0)
        self.flush()

    def sync_compilations(self) -> None:
        """Bring ikbo_triton_compilations_total up to the counter's numbers."""
        if self.compilations is None:
            return
        for phase, metric in self._compiled_metrics.items():
            new = self.compilations.counts[phase] - self._compiled[phase]
            if new:
                metric.increment(float(new))
                self._compiled[phase] += new

    def record_responses(
        self, pb_utils, requests, responses, users_input="user_tokens", candidates_input="cand_tokens"
    ) -> None:
        """`record` for each answered request of a batch model (U, B = rows of these two inputs)."""
        for request, response in zip(requests, responses):
            if not response.has_error():
                users = pb_utils.get_input_tensor_by_name(request, users_input).shape()[0]
                candidates = pb_utils.get_input_tensor_by_name(request, candidates_input).shape()[0]
                self.record(users, candidates)

    def record_execute(self, seconds: float) -> None:
        """Add one `execute` call's wall time."""
        self._add((None, float(seconds)))

    def record(self, num_users: int, num_candidates: int) -> None:
        self._add((num_users, num_candidates))
