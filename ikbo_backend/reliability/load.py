"""Valid requests as load: client threads in a closed loop or paced to a rate, the measured peak, one
probe request, and the HTTP client's silent resends counted."""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from ..client import infer_inputs
from ..ranker import RankerConfig
from ..synthetic import make_request
from . import CFG


@dataclass
class Load:
    """Threads sending valid requests to `model` over HTTP until stopped: closed loop, or paced to
    `rate` requests/s in total. `log` holds (start, end, error or None) per request, monotonic time.
    `new_connection`: each request on a connection of its own (the kernel spreads connections, not
    requests, over tritonservers sharing a port; a keep-alive client stays on one of them)."""

    url: str
    model: str = "ikbo_ranker"
    threads: int = 2
    sizes: tuple = ((4, 64), (15, 256), (32, 1024))
    rate: float | None = None
    max_seconds: float = 3600
    cfg: RankerConfig = CFG  # the served model's dims (PROFILES["large"] for the large GPU configs)
    new_connection: bool = False
    log: list = field(default_factory=list)

    def __post_init__(self):
        self.requests = [make_request(self.cfg, u, b, np.random.default_rng([u, b])) for u, b in self.sizes]
        self.stop_event = threading.Event()
        self.workers = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(self.threads)]

    def _run(self, index: int):
        import tritonclient.http as module
        from tritonclient.utils import InferenceServerException

        connection = module.InferenceServerClient(self.url, connection_timeout=120, network_timeout=120)
        deadline = time.monotonic() + self.max_seconds
        next_at = time.monotonic() + (index / self.rate if self.rate else 0)
        n = index
        try:
            while not self.stop_event.is_set() and time.monotonic() < deadline:
                if self.rate:
                    delay = next_at - time.monotonic()
                    if delay > 0 and self.stop_event.wait(delay):
                        break
                    next_at = max(next_at + self.threads / self.rate, time.monotonic() - 1.0)
                request = self.requests[n % len(self.requests)]
                n += 1
                start, broken = time.monotonic(), False
                try:
                    result = connection.infer(
                        self.model, infer_inputs(module, request), outputs=[module.InferRequestedOutput("scores")]
                    )
                    scores = result.as_numpy("scores")
                    error = (
                        None
                        if scores.shape == (len(request["cand_dense"]), self.cfg.tasks) and np.isfinite(scores).all()
                        else "bad scores"
                    )
                except InferenceServerException as e:
                    error = f"{e.status()}: {e.message()}"
                except Exception as e:
                    error, broken = f"{type(e).__name__}: {e}", True
                self.log.append((start, time.monotonic(), error))
                if broken or self.new_connection:
                    connection.close()
                    if broken and self.stop_event.wait(0.2):
                        break
                    connection = module.InferenceServerClient(self.url, connection_timeout=120, network_timeout=120)
        finally:
            connection.close()

    def __enter__(self):
        for worker in self.workers:
            worker.start()
        return self

    def stop(self):
        self.stop_event.set()
        for worker in self.workers:
            worker.join(timeout=180)

    def __exit__(self, *exc):
        self.stop()

    def errors(self, since=float("-inf")):
        return [entry for entry in self.log if entry[2] and entry[0] >= since]


def measure_peak(url: str, seconds: float = 10, threads: int = 4, cfg: RankerConfig = CFG) -> float:
    """Requests/s of a closed loop with `threads` clients (the 'measured peak')."""
    with Load(url, threads=threads, max_seconds=seconds + 5, cfg=cfg) as load:
        time.sleep(2)  # ramp up
        start, first = time.monotonic(), len(load.log)
        time.sleep(seconds)
        done = len(load.log) - first
        elapsed = time.monotonic() - start
    return done / elapsed


def probe(url: str, model: str = "ikbo_ranker", timeout: float = 60) -> str | None:
    """One small valid request on a connection of its own: None when it succeeds, else the error."""
    import tritonclient.http as module
    from tritonclient.utils import InferenceServerException

    request = make_request(CFG, 2, 16, np.random.default_rng(0))
    connection = module.InferenceServerClient(url, connection_timeout=timeout, network_timeout=timeout)
    try:
        connection.infer(model, infer_inputs(module, request))
        return None
    except InferenceServerException as e:
        return f"{e.status()}: {e.message()}"
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        connection.close()


@contextlib.contextmanager
def http_resends():
    """Yields a list that collects the monotonic times at which the HTTP client library resent a
    request because the server closed the connection without answering: geventhttpclient (under
    tritonclient.http) sends it again on a new connection, for any method, up to pool size + 1 times,
    and the caller sees only the second answer. A request in flight on a tritonserver that dies is
    resent so (with replicas the new connection reaches another one)."""
    import geventhttpclient.client as client

    times, original = [], client.HTTPSocketPoolResponse

    def counted(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        except client.HTTPConnectionClosed:
            times.append(time.monotonic())
            raise

    client.HTTPSocketPoolResponse = counted
    try:
        yield times
    finally:
        client.HTTPSocketPoolResponse = original
