"""CUDA graphs for a served stage, one per (U, B) shape bucket.

On a GPU the IKBO ranker is host-bound: at U=15, B=1024 (large profile, bf16, H200) the interaction
took 1.9 ms of wall time for 0.25 ms of kernels (docs/perf.md, "GPU serving, H200"): Python, ~30
launches and the ops' index checks, each a device→host wait. A CUDA graph replays the whole call's
kernels with one launch. Graphs have fixed shapes, so requests are padded to a bucket:

- buckets: U up to the next power of two, B up to the next 2^k or 3·2^(k-1) (from 2 on: at most
  a third of the rows are padding), both capped at the declared maxima (`shape_buckets`);
- padding: candidates past B map to user 0 (every bucket has U ≥ 1) and users past U get history
  length 0; every per-candidate and per-user result is independent of the other rows, so the first
  B rows of the padded call's scores are the request's scores;
- static inputs: a bucket's graph reads views of buffers sized for the declared maxima. All graphs
  allocate from one memory pool and replay one at a time on the capturing stream, so their
  intermediates share memory (the pool holds about the largest bucket's);
- the index checks inside the ops are skipped while capturing (kernels/_common.py): the interaction
  stage's caller checks `cand_to_user` and the history lengths before a replay; the whole-ranker
  graph checks and clamps every value itself and raises a flag (`GraphedRanker`).

Two stages are graphed: `GraphedInteraction` (features → scores, the interaction models of the
ensembles) and `GraphedRanker` (raw request → scores: lookups and interaction in one graph, the
one-model rankers). Capture happens at load (`capture_all`, after the eager warm-up has compiled and
tuned the kernels), never on the request path; a shape outside every bucket runs eagerly. Used only
on CUDA; on a CPU `replay_eagerly=True` runs the same padding without graphs (tests).
"""

from __future__ import annotations

import logging
import math
import sys
import time

import torch

from .ranker import Features, RankerConfig
from .requests import CAND_INPUTS, INPUT_NAMES, USER_INPUTS, ShapeRanges, check_request_values, check_values_on_device

LOG = logging.getLogger(__name__)


def _ladder(high: int, steps: tuple[int, ...]) -> list[int]:
    """Sorted sizes m·2^k ≤ high for m in `steps`, plus `high` itself."""
    sizes, scale = {high}, 1
    while scale <= high:
        sizes.update(m * scale for m in steps if m * scale <= high)
        scale *= 2
    return sorted(sizes)


def shape_buckets(ranges: ShapeRanges) -> tuple[list[int], list[int]]:
    """(user sizes, candidate sizes) a request is padded up to: U to powers of two, B to 2^k and
    3·2^(k-1); both ladders end at the declared maxima."""
    (_, u_hi), (_, b_hi) = ranges.users, ranges.candidates
    return _ladder(u_hi, (1,)), _ladder(b_hi, (2, 3))


def _round_up(value: int, sizes: list[int]) -> int | None:
    return next((size for size in sizes if size >= value), None)


class _GraphedStage:
    """`stage(inputs) → scores [B, T]`, replayed from a CUDA graph of the request's bucket. Subclasses
    name the inputs with one row per user (`USER_ROWS`) and per candidate (`CAND_ROWS`), hold the
    static inputs (`_allocate`, `_views`, `_load`) and say how to call the stage on them (`_call`)."""

    USER_ROWS: tuple[str, ...]
    CAND_ROWS: tuple[str, ...]

    def __init__(self, ranges: ShapeRanges, device, replay_eagerly: bool = False):
        self.device = torch.device(device)
        self.user_sizes, self.cand_sizes = shape_buckets(ranges)
        self.replay_eagerly = replay_eagerly
        self.static = None  # the inputs' device memory, sized for the declared maxima
        self.staging = None  # its host mirror (pinned on CUDA) for host → device copies
        self.graphs: dict[tuple[int, int], tuple[object, torch.Tensor]] = {}  # bucket → (graph, scores)
        self.pool = self.stream = None
        self.replays = self.eager_calls = 0
        self.capture_error: str | None = None

    def _call(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def _shape(self, inputs: dict[str, torch.Tensor]) -> tuple[int, int]:
        return inputs[self.USER_ROWS[0]].shape[0], inputs[self.CAND_ROWS[0]].shape[0]

    def bucket(self, num_users: int, num_candidates: int) -> tuple[int, int] | None:
        users, cands = _round_up(num_users, self.user_sizes), _round_up(num_candidates, self.cand_sizes)
        return None if users is None or cands is None or num_users < 1 or num_candidates < 1 else (users, cands)

    def _rows(self, users: int, cands: int) -> dict[str, int]:
        """Rows of each input at U = users, B = cands."""
        return {name: users for name in self.USER_ROWS} | {name: cands for name in self.CAND_ROWS}

    def _allocate(self, example: dict[str, torch.Tensor]) -> None:
        """Create the static inputs (and host staging) from an example's dtypes and trailing dims."""
        raise NotImplementedError

    def _views(self, users: int, cands: int) -> dict[str, torch.Tensor]:
        """Bucket (users, cands)'s static inputs, the graph's arguments."""
        raise NotImplementedError

    def _load(self, inputs: dict[str, torch.Tensor], users: int, cands: int) -> dict[str, torch.Tensor]:
        """Copy a request into bucket (users, cands)'s static inputs, padded; return `_views`."""
        raise NotImplementedError

    def capture(self, users: int, cands: int, example: dict[str, torch.Tensor]) -> None:
        """Record the graph of bucket (users, cands); `example` (any valid request's features, at
        most the bucket's rows) supplies dtypes and trailing dims and the first run's values. The first
        capture runs the bucket eagerly before, on the capture stream (library handles and their
        workspaces are created there); the kernels were compiled and tuned by the warm-up."""
        if self.static is None:
            self._allocate(example)
        views = self._views(users, cands)
        if self.replay_eagerly:
            self.graphs[users, cands] = (None, None)
            return
        # torch.cuda.graph() would run gc.collect() and empty_cache() per capture (~0.1 s each over
        # hundreds of buckets): the lower-level calls instead, on a side stream as it does
        first = self.stream is None
        if first:
            self.pool, self.stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(self.device)
        graph = torch.cuda.CUDAGraph()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            if first:  # on the example (capture_all captures the largest bucket first: it fits)
                self._call(self._load(example, users, cands))
                self.stream.synchronize()
                torch.cuda.empty_cache()  # the eager run's blocks: not held beside the graphs' pool
            graph.capture_begin(pool=self.pool)
            try:
                scores = self._call(views)
            finally:
                graph.capture_end()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self.graphs[users, cands] = (graph, scores)

    def capture_all(self, example: dict[str, torch.Tensor]) -> int:
        """Capture every bucket, largest first (the pool grows once; smaller buckets reuse its
        blocks); returns the number captured. If a capture fails (an op that waits for the device,
        say), the stage stays eager: all graphs are dropped and the error logged."""
        if not self.replay_eagerly:
            torch.cuda.empty_cache()  # the eager warm-up's cached blocks
        start = time.perf_counter()
        try:
            for users in reversed(self.user_sizes):
                for cands in reversed(self.cand_sizes):
                    if (users, cands) not in self.graphs:
                        self.capture(users, cands, example)
        except Exception as e:  # noqa: BLE001 — serve eagerly rather than not at all
            self.graphs.clear()
            self.capture_error = f"{type(e).__name__}: {e}"
            LOG.warning("CUDA graph capture failed, the stage runs eagerly: %s", self.capture_error)
            print(f"ikbo_backend.cuda_graphs: capture failed, running eagerly: {self.capture_error}", file=sys.stderr, flush=True)
        else:
            reserved = torch.cuda.memory_reserved(self.device) / 2**20 if not self.replay_eagerly else 0.0
            print(f"ikbo_backend.cuda_graphs: {len(self.graphs)} graphs captured in {time.perf_counter() - start:.1f} s "
                  f"({reserved:,.0f} MiB reserved by torch in this process)", file=sys.stderr, flush=True)
        return len(self.graphs)

    def _replay(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The output of the request's bucket after loading the request and replaying its graph (the
        padded call without a graph with `replay_eagerly`); None if no bucket was captured for it."""
        bucket = self.bucket(*self._shape(inputs))
        if bucket is None or bucket not in self.graphs:
            return None
        views = self._load(inputs, *bucket)
        graph, output = self.graphs[bucket]
        self.replays += 1
        if graph is None:
            return self._call(views)
        graph.replay()
        return output


class GraphedInteraction(_GraphedStage):
    """`interaction(features) → scores [B, T]` from graphs. features: Features with user_tokens
    [U, Ku, D], cand_tokens [B, Kc, D], history_tokens [U, L, D], history_len [U], cand_to_user [B]
    (int32, already checked in range by the caller). Static inputs: one buffer per input at the
    declared maxima, a bucket reads leading slices; padding rows keep what an earlier request left
    (valid: inputs are checked) except lengths and the mapping (`ZERO_PADDED`), zeroed."""

    USER_ROWS = ("user_tokens", "history_tokens", "history_len")
    CAND_ROWS = ("cand_tokens", "cand_to_user")
    ZERO_PADDED = ("history_len", "cand_to_user")

    def __init__(self, interaction, ranges: ShapeRanges, device, replay_eagerly: bool = False):
        super().__init__(ranges, device, replay_eagerly)
        self.interaction = interaction

    def __getattr__(self, name):  # the wrapped interaction's attributes (dtype, transform report)
        if name == "interaction":
            raise AttributeError(name)
        return getattr(self.interaction, name)

    def _allocate(self, example: dict[str, torch.Tensor]) -> None:
        rows = self._rows(self.user_sizes[-1], self.cand_sizes[-1])
        self.static = {name: torch.zeros((rows[name], *t.shape[1:]), dtype=t.dtype, device=self.device) for name, t in example.items()}
        if self.device.type == "cuda":
            self.staging = {name: torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for name, t in self.static.items()}

    def _views(self, users: int, cands: int) -> dict[str, torch.Tensor]:
        """Bucket (users, cands)'s leading slices of the static inputs."""
        return {name: self.static[name][:size] for name, size in self._rows(users, cands).items()}

    def _load(self, inputs: dict[str, torch.Tensor], users: int, cands: int) -> dict[str, torch.Tensor]:
        """Copy the request into the static inputs, pad, and return the bucket's views of them.
        Padding users get history length 0, padding candidates user 0. From host memory the rows go
        through pinned staging buffers (asynchronous copies, no pageable-memory staging by the
        driver); the staging is reused only after the caller waited for the previous replay's scores."""
        rows, bucket_rows = self._rows(*self._shape(inputs)), self._rows(users, cands)
        for name, t in inputs.items():
            n, padded = rows[name], name in self.ZERO_PADDED
            if self.staging and t.device.type == "cpu" and t.dtype != torch.bfloat16:  # numpy: no torch op per copy
                host = self.staging[name].numpy()
                host[:n] = t.numpy()
                if padded:
                    host[n : bucket_rows[name]] = 0
                n = bucket_rows[name] if padded else n  # the zeroed rows travel in the same copy
                t = self.staging[name][:n]
            self.static[name][:n].copy_(t, non_blocking=True)
            if padded and n < bucket_rows[name]:
                self.static[name][n : bucket_rows[name]].zero_()
        return self._views(users, cands)

    def _call(self, inputs):
        return self.interaction(Features(**inputs))

    def capture_all(self, example: Features) -> int:
        return super().capture_all(vars(example))

    def __call__(self, f: Features) -> torch.Tensor:
        """scores [B, T] on the device."""
        scores = self._replay(vars(f))
        if scores is None:
            self.eager_calls += 1
            return self._call({name: t.to(self.device) for name, t in vars(f).items()})
        return scores[: self._shape(vars(f))[1]].clone()


class GraphedRanker(_GraphedStage):
    """`interaction(features(**request)) → scores [B, T]` from graphs: the embedding lookups and
    projections and the interaction in one graph, fed with the raw request (the 7 inputs of
    ikbo_backend.requests, shapes checked by the caller) straight from host memory.

    Per request, one copy each way. The request is packed into one pinned host buffer in its
    bucket's layout (a header with U - 1, then each input's rows, every padding row zeroed: zeros are a
    valid request) and crosses in one host → device copy; the graph's inputs are typed views of the
    device buffer at that bucket's offsets. The graph checks the values itself (`check_values_on_device`:
    indices clamped before any gather, one flag for any failed check) and writes [flag, scores...]
    to one output, which returns in one device → host copy. The host reads no value of a valid
    request; a flagged one is checked on the host (`check_request_values`), which names the input."""

    USER_ROWS = USER_INPUTS
    CAND_ROWS = CAND_INPUTS
    ALIGN = 256  # bytes: every input view starts on a 256-byte boundary

    def __init__(self, features, interaction, cfg: RankerConfig, ranges: ShapeRanges, device, replay_eagerly: bool = False):
        super().__init__(ranges, device, replay_eagerly)
        self.features, self.interaction, self.cfg = features, interaction, cfg
        self.row_specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}  # name → (trailing dims, dtype)
        self.host_output: torch.Tensor | None = None
        self._io: dict[tuple[int, int], tuple] = {}  # bucket → `_bucket_io`

    def _layout(self, users: int, cands: int) -> tuple[dict[str, tuple[int, int, int]], int]:
        """({name: (byte offset, bytes, rows)}, total bytes) of bucket (users, cands); the header
        (U - 1, int32) is at offset 0."""
        offsets, end = {}, self.ALIGN
        for name, rows in self._rows(users, cands).items():
            trailing, dtype = self.row_specs[name]
            size = rows * math.prod(trailing) * dtype.itemsize
            offsets[name] = (end, size, rows)
            end += -(-size // self.ALIGN) * self.ALIGN
        return offsets, end

    def _typed(self, buffer: torch.Tensor, users: int, cands: int) -> dict[str, torch.Tensor]:
        offsets, _ = self._layout(users, cands)
        views = {"last_user": buffer[:4].view(torch.int32)[0]}
        for name, (offset, size, rows) in offsets.items():
            trailing, dtype = self.row_specs[name]
            views[name] = buffer[offset : offset + size].view(dtype).view(rows, *trailing)
        return views

    def _allocate(self, example):
        self.row_specs = {name: (tuple(t.shape[1:]), t.dtype) for name, t in example.items()}
        _, total = self._layout(self.user_sizes[-1], self.cand_sizes[-1])
        self.static = torch.zeros(total, dtype=torch.uint8, device=self.device)
        pinned = self.device.type == "cuda"
        self.staging = torch.zeros(total, dtype=torch.uint8, pin_memory=pinned)
        self.host_output = torch.empty(1 + self.cand_sizes[-1] * self.cfg.tasks, dtype=torch.float32, pin_memory=pinned)

    def _bucket_io(self, users: int, cands: int):
        """(numpy views of the staging, torch views of the device buffer, the bucket's bytes of
        both) of bucket (users, cands): built once per bucket, at capture."""
        io = self._io.get((users, cands))
        if io is None:
            staged = {name: t.numpy() for name, t in self._typed(self.staging, users, cands).items()}
            total = self._layout(users, cands)[1]
            io = self._io[users, cands] = (staged, self._typed(self.static, users, cands), self.static[:total], self.staging[:total])
        return io

    def _views(self, users, cands):
        return self._bucket_io(users, cands)[1]

    def _load(self, inputs, users, cands):
        """Pack the request into the staging buffer in bucket (users, cands)'s layout, zero its
        padding rows, copy the bucket's bytes to the device (asynchronously: the staging is reused
        only after the caller waited for the previous replay's output). numpy on the host: no torch
        op per input."""
        staged, views, device_bytes, host_bytes = self._bucket_io(users, cands)
        staged["last_user"][...] = self._shape(inputs)[0] - 1
        for name, t in inputs.items():
            n, host = t.shape[0], staged[name]
            host[:n] = t.numpy(force=True)
            host[n:] = 0
        device_bytes.copy_(host_bytes, non_blocking=True)
        return views

    def _call(self, inputs):
        """[flag, scores [B, T] flattened] (float32) of the bucket's views; the views' indices are
        clamped in place first."""
        request, flag = {name: inputs[name] for name in INPUT_NAMES}, torch.zeros(1, dtype=torch.float32, device=self.device)
        check_values_on_device(self.cfg, request, inputs["last_user"], flag)
        scores = self.interaction(self.features(**request))
        return torch.cat([flag, scores.to(torch.float32).flatten()])

    @torch.inference_mode()
    def __call__(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """scores [B, T] in host memory; InvalidRequest (naming the input) for a value the checks
        refuse. Shapes must have passed `check_request_shapes`."""
        output = self._replay(inputs)
        if output is None:  # no graph for this shape: the host checks, then the eager call
            self.eager_calls += 1
            check_request_values(self.cfg, inputs)
            return self.interaction(self.features(**{name: t.to(self.device) for name, t in inputs.items()})).cpu()
        num_candidates = self._shape(inputs)[1]
        size = 1 + num_candidates * self.cfg.tasks
        self.host_output[:size].copy_(output[:size], non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        host = self.host_output.numpy()
        if host[0] != 0:
            check_request_values(self.cfg, inputs)  # raises InvalidRequest naming the input
            raise RuntimeError("the device's value checks flagged a request that the host's checks pass")
        return torch.from_numpy(host[1:size].reshape(num_candidates, self.cfg.tasks).copy())
