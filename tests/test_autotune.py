"""Load-time tuning per shape bucket (ikbo_backend/autotune.py, its disk cache ikbo_backend/tuning_cache.py).

Three layers:
- the disk cache and the choice, on the CPU with a fake timer (fresh random times and data): a
  cached choice is reused without timing, a changed key tunes again, wrong or unlaunchable
  candidates never win, concurrent writers leave one valid file with every entry, a corrupt file is
  ignored with a warning and rewritten; on a CPU device tuning is a no-op;
- the real tuner and the kernels' hook under TRITON_INTERPRET=1 (in a child process, like
  tests/test_linear_compress.py): every bucket gets the fastest correct candidate by the fake timer,
  a restart reads them, and the public ops launch the tuned configuration of each (U, B)'s bucket
  (seen at the kernel launch) and still match the fp64 reference;
- on a GPU only: tune in a fresh process, then "restart" in another one with the same caches: no
  timing, no compilation (every kernel comes from Triton's disk cache), and the public ops on
  fresh random inputs match the fp64 torch path (bf16, relative error ≤ 1e-2).
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import secrets
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import triton
from interpreted import run_interpreted

from ikbo_backend import autotune, kernel_buckets
from ikbo_backend.autotune import ROUNDS, Candidate, fastest, median_ms
from ikbo_backend.ranker import RankerConfig
from ikbo_backend.requests import ShapeRanges
from ikbo_backend.tuning_cache import TuningCache, cached_entries
from kernels import attention as attention_op
from kernels import configs, ikbo_linear_compress, ikbo_self_target_attention
from kernels import linear_compress as lce_op
from kernels.configs import TileConfig, set_tuned_configs
from kernels.reference import rel_err

SEED = secrets.randbits(32)
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
HAS_CUDA = torch.cuda.is_available()
CFG = RankerConfig()
BF16_TOL = 1e-2


class FakeTimer:
    """A timer that runs nothing: fresh random ms per call, and a count of calls."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)
        self.calls = 0

    def __call__(self, fn) -> float:
        self.calls += 1
        return float(self.rng.uniform(0.01, 1.0))


def _never_timed(fn):
    raise AssertionError("timed although the choice was cached")


def _matmul_candidates(seed: int, wrong: tuple[str, ...] = ()) -> list[Candidate]:
    """Three ways to compute x @ w on fresh random data; the `wrong` ones add an error."""
    gen = torch.Generator().manual_seed(seed)
    x, w = torch.randn(33, 17, generator=gen), torch.randn(17, 9, generator=gen)
    ref = x.double() @ w.double()
    ways = {
        "mm": lambda: x @ w,
        "einsum": lambda: torch.einsum("ik,kj->ij", x, w),
        "bmm": lambda: torch.bmm(x[None], w[None])[0],
    }

    def candidate(label, way):
        def run():
            return way() + (1e-2 * ref.norm().item() / 17 if label in wrong else 0.0)

        return Candidate(label, {"way": label}, lambda: rel_err(run(), ref) <= 1e-5, run)

    return [candidate(label, way) for label, way in ways.items()]


def _jobs(seed: int, keys, timer, ran: list) -> dict:
    def job(key):
        ran.append(key)
        return fastest(_matmul_candidates(seed), timer)

    return {key: (lambda key=key: job(key)) for key in keys}


# ------------------------------------------------------------------ the cache, on the CPU


def test_cached_choice_is_reused_without_timing(tmp_path):
    timer, ran = FakeTimer(SEED), []
    keys = [f"v1|cpu|op|bucket {i}" for i in range(3)]
    first = cached_entries(TuningCache(tmp_path / "t.json"), _jobs(SEED, keys, timer, ran))
    assert timer.calls == 3 * 3 * ROUNDS and ran == keys, (timer.calls, ran)
    for entry in first.values():
        fastest_label = min(entry["ms"], key=entry["ms"].get)
        assert entry["choice"] == {"way": fastest_label}, (entry, SEED)
    restarted = cached_entries(TuningCache(tmp_path / "t.json"), _jobs(SEED + 1, keys, _never_timed, ran))
    assert restarted == first and ran == keys


def test_changed_key_tunes_again(tmp_path):
    cache, timer, ran = TuningCache(tmp_path / "t.json"), FakeTimer(SEED), []
    cached_entries(cache, _jobs(SEED, ["v1|H200|triton 3.6.0|lce|fused"], timer, ran))
    changed = ["v1|H200|triton 3.6.0|lce|fused", "v1|H200|triton 3.7.0|lce|fused"]  # another Triton version
    cached_entries(cache, _jobs(SEED, changed, timer, ran))
    assert ran == ["v1|H200|triton 3.6.0|lce|fused", "v1|H200|triton 3.7.0|lce|fused"]
    assert set(cache.read()) == set(changed)  # the other entry is kept


def test_wrong_or_unlaunchable_candidates_never_win():
    timer = FakeTimer(SEED)
    candidates = _matmul_candidates(SEED, wrong=("mm",))

    def too_big():
        raise triton.runtime.errors.OutOfResources(300_000, 232_448, "shared memory")

    candidates.append(Candidate("huge", {"way": "huge"}, too_big, too_big))
    entry = fastest(
        candidates, lambda fn: 0.001 if fn is candidates[0].run else timer(fn)
    )  # the wrong one is "fastest"
    assert entry["ms"]["mm"] == "dropped: wrong result" and entry["ms"]["huge"] == "dropped: OutOfResources"
    assert entry["choice"]["way"] == min(("einsum", "bmm"), key=entry["ms"].get)
    assert fastest(_matmul_candidates(SEED, wrong=("mm", "einsum", "bmm")), timer)["choice"] is None


def test_corrupt_cache_is_ignored_with_a_warning_and_rewritten(tmp_path):
    path = tmp_path / "t.json"
    rng = np.random.default_rng(SEED)
    for garbage in (rng.bytes(64), b'{"entries": {"v1|cpu|op|bucket": {"choice"', b"[1, 2]"):
        path.write_bytes(garbage)
        timer, ran = FakeTimer(SEED), []
        with pytest.warns(UserWarning, match="ignored"):
            entries = cached_entries(TuningCache(path), _jobs(SEED, ["v1|cpu|op|bucket"], timer, ran))
        assert ran == ["v1|cpu|op|bucket"] and timer.calls == 3 * ROUNDS
        assert json.loads(path.read_text())["entries"] == entries  # rewritten, valid


def test_unwritable_cache_still_tunes(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    timer, ran = FakeTimer(SEED), []
    with pytest.warns(UserWarning) as warned:
        entries = cached_entries(TuningCache(tmp_path / "file" / "t.json"), _jobs(SEED, ["k"], timer, ran))
    assert any("not written" in str(w.message) for w in warned), [str(w.message) for w in warned]
    assert ran == ["k"] and entries["k"]["choice"] is not None


def _writer(path: str, index: int, seed: int) -> list:
    """One model instance loading: its own bucket and a shared one; jobs take a while (a slow timer)."""

    def slow_timer(fn):
        time.sleep(0.02)
        return FakeTimer(seed + index)(fn)

    ran = []
    cached_entries(TuningCache(path), _jobs(seed, [f"instance {index}", "shared"], slow_timer, ran))
    return ran


def test_concurrent_writers_leave_one_valid_file_with_every_entry(tmp_path):
    path = str(tmp_path / "t.json")
    with multiprocessing.get_context("spawn").Pool(6) as pool:
        ran = pool.starmap(_writer, [(path, i, SEED) for i in range(6)])
    entries = json.loads(Path(path).read_text())["entries"]
    assert set(entries) == {f"instance {i}" for i in range(6)} | {"shared"}
    assert sum(r.count("shared") for r in ran) == 1, ran  # tuned once, read by the others
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".t.json.")]  # no temp file left


def test_on_a_cpu_tuning_is_a_no_op(tmp_path, monkeypatch):
    monkeypatch.setenv("IKBO_TUNING_CACHE", str(tmp_path))
    monkeypatch.setattr(configs, "_TUNED", {})  # an empty registry (GPU tests earlier in this process may have tuned)
    ranges = ShapeRanges((1, 4), (1, 50))
    assert autotune.tune_buckets(CFG, ranges, "cpu") == {}
    assert autotune.bucket_representatives(CFG, ranges, "cpu") == [(1, 1)]
    assert list(tmp_path.iterdir()) == [] and not configs._TUNED


def test_candidates_per_bucket():
    """fused bucket: fused configs; persistent bucket: persistent and fused configs; attention: BLOCK_N | BLOCK_M
    (causal self tiles)."""
    ranges = ShapeRanges((1, 256), (1, 8192))
    large = RankerConfig(history_length=512, embedding_dim=256, heads=2, compressed_tokens=32, query_tokens=8)
    for cfg in (CFG, large):
        for bucket in kernel_buckets.kernel_buckets(cfg, ranges, torch.bfloat16, 132)["lce"]:
            candidates = autotune.lce_candidates(cfg, bucket.key, torch.bfloat16)
            expected = {"persistent", "fused"} if bucket.key[0] == "persistent" else {"fused"}
            assert {v for v, _ in candidates} == expected, bucket
            graphed = autotune.lce_candidates(cfg, bucket.key, torch.bfloat16, hopper=True, graphs=True)
            # persistent runs as fused in a graph
            assert graphed == [c for c in candidates if c[0] != "persistent"] + [("warp_specialized", None)], bucket
        for bucket in kernel_buckets.kernel_buckets(cfg, ranges, torch.bfloat16, 132)["attention"]:
            tiles = autotune.attention_candidates(cfg, bucket.key)
            assert tiles and all(t.block_m % t.block_n == 0 for t in tiles)


def test_graph_replayed_models_are_tuned_apart_with_the_graph_timer(tmp_path, monkeypatch, clean_registry):
    """`graphs=True` times with `graph_median_ms` (unless a timer is given), tells the op tuners, and keys
    the cache apart from an eager model's: the two modes' entries live side by side, each read back
    by its own mode without timing. (Fake op tuners and timers: no kernel runs.)"""
    seen = []

    def fake_tuner(op):
        def tune(cfg, key, shape, dtype, device, timer, graphs):
            seen.append((op, graphs, timer))
            choice = (
                {"variant": "fused", "tile": None} if op == "lce" else {"tile": None, "kernel": attention_op.WS_CHOICE}
            )
            return {"choice": choice, "ms": {"fake": float(timer(lambda: None))}}

        return tune

    monkeypatch.setattr(autotune, "TUNERS", {op: fake_tuner(op) for op in kernel_buckets.OPS})
    graph_timer, eager_timer = FakeTimer(SEED), FakeTimer(SEED + 1)
    monkeypatch.setattr(autotune, "graph_median_ms", graph_timer)
    monkeypatch.setattr(autotune, "median_ms", eager_timer)
    ranges, cache = ShapeRanges((1, 3), (1, 40)), TuningCache(tmp_path / "t.json")

    def tune(graphs, **kw):
        return autotune.tune_buckets(CFG, ranges, "cpu", torch.float16, num_sms=132, cache=cache, graphs=graphs, **kw)

    graphed = tune(True)
    assert seen and all(graphs and timer is graph_timer for _, graphs, timer in seen) and eager_timer.calls == 0
    seen.clear()
    eager = tune(False)
    assert seen and all(not graphs and timer is eager_timer for _, graphs, timer in seen)
    keys = list(json.loads(cache.path.read_text())["entries"])
    assert len(keys) == 2 * sum(len(t) for t in graphed.values()) and {k.rsplit("|", 1)[1] for k in keys} == {
        "graphs",
        "eager",
    }
    assert tune(True, timer=_never_timed) == graphed and tune(False, timer=_never_timed) == eager


def test_request_shapes_do_not_specialize_the_kernels():
    """What a request's (U, B) sets reaches the kernels unspecialized (Triton 3.6 turns an integer
    equal to 1 into a constexpr and specializes on 16-divisibility), and the plan buffers start on
    16-byte boundaries for every B: so one compiled kernel per tile config serves any (U, B)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    from kernels import attention, attention_ws, linear_compress, linear_compress_ws

    unspecialized = {
        attention._plan_kernel: {"num_candidates", "num_users"},
        attention._attention_kernel: {"num_users", "num_self_tiles"},
        # the Gluon kernels; user_q / user_out reach attention_ws as offsets from q / out (their addresses)
        attention_ws._attention_ws_kernel: {
            "num_items",
            "num_tiles",
            "num_users",
            "num_self_tiles",
            "uq_delta",
            "uo_delta",
        },
        linear_compress._lce_persistent_kernel: {"U", "B", "NUM_PROGRAMS"},
        linear_compress_ws._lce_ws_kernel: {"B"},
    }
    for kernel, names in unspecialized.items():
        flags = {p.name: p.do_not_specialize for p in kernel.params}
        assert all(flags[name] for name in names), (kernel.fn.__name__, flags)
    for num_candidates in range(0, 40):
        keys = set()
        for part in attention.plan_buffers(num_candidates, 7, "cpu"):
            assert part.data_ptr() % 16 == 0, num_candidates
            keys.add(native_specialize_impl(BaseBackend, part, False, True, True))
        assert keys == {("*i32", "D")}


# ------------------------------------------------------------------ tuner and hook under the interpreter


@pytest.mark.skipif(INTERPRETING, reason="already interpreting: the interpreted tests run directly")
def test_triton_interpreted():
    """Run the `interpreted` tests below in a child process with TRITON_INTERPRET=1."""
    run_interpreted(__file__)


interpreted = pytest.mark.skipif(not INTERPRETING, reason="runs in test_triton_interpreted's child process")


@pytest.fixture
def launches(monkeypatch):
    """(kernel name, launch kwargs) of every interpreted kernel launch."""
    seen = []
    run = triton.runtime.interpreter.InterpretedFunction.run

    def spy(self, *args, **kwargs):
        seen.append((self.fn.__name__, kwargs))
        return run(self, *args, **kwargs)

    monkeypatch.setattr(triton.runtime.interpreter.InterpretedFunction, "run", spy)
    return seen


@pytest.fixture
def clean_registry():
    yield
    configs.clear_tuned_configs()


def _lce_inputs(cfg, num_users, num_candidates, dtype, gen, device="cpu"):
    ku, kc, n, d = cfg.user_tokens, cfg.cand_tokens, cfg.compressed_tokens, cfg.embedding_dim
    user_emb = torch.randn(num_users, ku, d, generator=gen).to(device, dtype)
    cand_emb = torch.randn(num_candidates, kc, d, generator=gen).to(device, dtype)
    cand_to_user = torch.randint(0, num_users, (num_candidates,), generator=gen, dtype=torch.int32).to(device)
    weight = (torch.randn(n, ku + kc, generator=gen) / math.sqrt(ku + kc)).to(device, dtype)
    bias = torch.randn(n, generator=gen).to(device, dtype)
    return user_emb, cand_emb, cand_to_user, weight, bias


def _attention_inputs(cfg, num_users, num_candidates, dtype, gen, device="cpu"):
    shape = (num_users, cfg.heads, cfg.history_length, cfg.head_dim)
    user_q, k, v = (torch.randn(shape, generator=gen).to(device, dtype) for _ in range(3))
    cand_q = torch.randn(num_candidates, cfg.heads, cfg.query_tokens, cfg.head_dim, generator=gen).to(device, dtype)
    cand_to_user = torch.randint(0, num_users, (num_candidates,), generator=gen, dtype=torch.int32).to(device)
    kv_len = torch.randint(0, cfg.history_length + 1, (num_users,), generator=gen, dtype=torch.int32).to(device)
    return user_q, cand_q, k, v, cand_to_user, kv_len


def _fp64_cpu(tensors):
    """The reference's inputs: floating tensors in fp64, all on the CPU."""
    return [(t.double() if t.is_floating_point() else t).cpu() for t in tensors]


def _check_public_ops(cfg, shape, dtype, gen, tol, backend="auto", device="cpu"):
    """Both public ops at (U, B) on fresh random inputs on `device` against the fp64 torch path (CPU)."""
    user_emb, cand_emb, cand_to_user, weight, bias = _lce_inputs(cfg, *shape, dtype, gen, device)
    out = ikbo_linear_compress(user_emb, cand_emb, cand_to_user, weight, bias, backend=backend)
    err = rel_err(
        out, ikbo_linear_compress(*_fp64_cpu((user_emb, cand_emb, cand_to_user, weight, bias)), backend="torch")
    )
    assert err <= tol, ("lce", shape, err, SEED)
    inputs = _attention_inputs(cfg, *shape, dtype, gen, device)
    user_out, cand_out = ikbo_self_target_attention(*inputs, backend=backend)
    ref_user, ref_cand = ikbo_self_target_attention(*_fp64_cpu(inputs), backend="torch")
    err = max(rel_err(user_out, ref_user), rel_err(cand_out, ref_cand))
    assert err <= tol, ("attention", shape, err, SEED)


def _launched_config(launches, op: str):
    """What the last call of `op` launched: lce (variant, tile fields), attention tile fields."""
    if op == "lce":
        name, kw = next(x for x in reversed(launches) if x[0] in ("_lce_tile_kernel", "_lce_persistent_kernel"))
        variant = "persistent" if name == "_lce_persistent_kernel" else "fused"
        return variant, (kw["BLOCK_M"], kw["BLOCK_D"], kw["BLOCK_K"], kw["num_warps"], kw["num_stages"], kw["SPLIT"])
    kw = next(kw for name, kw in reversed(launches) if name == "_attention_kernel")
    return kw["BLOCK_M"], kw["BLOCK_N"], kw["num_warps"], kw["NUM_STAGES"], kw["maxnreg"]


def _expected_config(op: str, choice):
    if op == "lce":
        variant, t = choice
        return variant, (t.block_m, t.block_n, t.block_k, t.num_warps, t.num_stages, t.epilogue_split)
    return choice.block_m, choice.block_n, choice.num_warps, choice.num_stages, choice.maxnreg


@interpreted
def test_interpreted_hook_launches_the_tuned_config(launches, clean_registry):
    """A registered lookup overrides the heuristics of both ops (here: configs they would not pick,
    fused where default_variant says persistent), and outputs still match the fp64 torch path."""
    gen = torch.Generator().manual_seed(SEED)
    lce_tile = TileConfig(16, 32, 16, num_warps=4, num_stages=1, epilogue_split=True)
    attention_tile = TileConfig(64, 32, num_warps=4, num_stages=3)
    dims = kernel_buckets.op_dims(CFG, "lce"), kernel_buckets.op_dims(CFG, "attention")
    set_tuned_configs("lce", "cpu", torch.float16, dims[0], lambda u, b: ("fused", lce_tile) if b >= u else None)
    set_tuned_configs("attention", "cpu", torch.float16, dims[1], lambda u, b: attention_tile)
    shape = (2, 40)
    assert lce_op.default_variant(*shape) == "persistent"
    _check_public_ops(CFG, shape, torch.float16, gen, BF16_TOL, backend="triton")
    assert _launched_config(launches, "lce") == _expected_config("lce", ("fused", lce_tile))
    assert _launched_config(launches, "attention") == _expected_config("attention", attention_tile)
    set_tuned_configs("lce", "cpu", torch.float16, dims[0], None)  # removed: the heuristics again
    set_tuned_configs("attention", "cpu", torch.float16, dims[1], None)
    _check_public_ops(CFG, shape, torch.float16, gen, BF16_TOL, backend="triton")
    assert _launched_config(launches, "lce")[0] == "persistent" and _launched_config(launches, "attention")[:2] == (
        16,
        16,
    )


@interpreted
def test_interpreted_tune_buckets(tmp_path, launches, clean_registry):
    """The real tuner on the interpreter with a fake timer and an H200's SM count: every bucket of
    both ops gets the fastest correct candidate, a restart reads them without timing, and the public
    ops launch, for random (U, B) of the range, the choice of their bucket."""
    ranges, dtype, cache_path = ShapeRanges((1, 3), (1, 40)), torch.float16, tmp_path / "t.json"
    timer = FakeTimer(SEED)
    tables = autotune.tune_buckets(CFG, ranges, "cpu", dtype, num_sms=132, cache=TuningCache(cache_path), timer=timer)
    buckets = kernel_buckets.kernel_buckets(CFG, ranges, dtype, 132)
    assert {op: set(t) for op, t in tables.items()} == {op: {b.key for b in buckets[op]} for op in kernel_buckets.OPS}
    labels = {"lce": lambda c: autotune._lce_label(*c), "attention": autotune._attention_label}
    for op, table in tables.items():
        for key, tuned in table.items():
            times = {label: ms for label, ms in tuned.ms.items() if isinstance(ms, float)}
            assert times and labels[op](tuned.choice) == min(times, key=times.get), (op, key, tuned)
    timed = sum(isinstance(ms, float) for table in tables.values() for t in table.values() for ms in t.ms.values())
    assert timer.calls == ROUNDS * timed

    restarted = autotune.tune_buckets(
        CFG, ranges, "cpu", dtype, num_sms=132, cache=TuningCache(cache_path), timer=_never_timed
    )
    assert restarted == tables
    rng = np.random.default_rng(SEED)
    gen = torch.Generator().manual_seed(SEED)
    for _ in range(6):
        shape = int(rng.integers(1, 4)), int(rng.integers(1, 41))
        _check_public_ops(CFG, shape, dtype, gen, BF16_TOL, backend="triton")
        for op in kernel_buckets.OPS:
            key = kernel_buckets.KEYS[op](CFG, *shape, dtype, 132)
            assert _launched_config(launches, op) == _expected_config(op, tables[op][key].choice), (op, shape, key)


# ------------------------------------------------------------------ GPU only

GPU_RANGES = ShapeRanges((1, 2), (1, 40))  # 4 LCE + 2 attention buckets in bf16 on an H200: 31 candidates


def _tune_in_a_fresh_process(cache_dir: str, triton_dir: str, seed: int) -> dict:
    """In a fresh process with these caches: tune the bf16 ops over GPU_RANGES with the real timer,
    then run the public ops at every bucket's ends and at random (U, B) against the fp64 torch path.
    Returns the timer calls, fresh compilations (not from Triton's disk cache) while tuning and
    after, the largest error and the table."""
    os.environ["TRITON_CACHE_DIR"] = triton_dir
    from triton import knobs

    compiled = []
    knobs.compilation.listener = lambda **kw: (
        None if kw["cache_hit"] else compiled.append(getattr(kw["src"], "name", "?"))
    )
    timed = []

    def timer(fn):
        timed.append(1)
        return median_ms(fn)

    cache = TuningCache(Path(cache_dir) / "tuned_configs.json")
    tables = autotune.tune_buckets(CFG, GPU_RANGES, "cuda", torch.bfloat16, cache=cache, timer=timer)
    at_tuning = len(compiled)
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    buckets = kernel_buckets.kernel_buckets(CFG, GPU_RANGES, torch.bfloat16, kernel_buckets.device_sms("cuda"))
    shapes = [s for op in kernel_buckets.OPS for b in buckets[op] for s in (b.representative, b.largest)]
    shapes += [(int(u), int(b)) for u, b in zip(rng.integers(1, 3, 12), rng.integers(1, 41, 12))]
    for shape in shapes:
        _check_public_ops(CFG, shape, torch.bfloat16, gen, BF16_TOL, device="cuda")
    torch.cuda.synchronize()
    table = [
        f"{op} {key} at (U, B) = {t.shape}: {autotune._lce_label(*t.choice) if op == 'lce' else autotune._attention_label(t.choice)}"
        f" | "
        + ", ".join(f"{label} {ms:.4f}" if isinstance(ms, float) else f"{label} {ms}" for label, ms in t.ms.items())
        for op, rows in tables.items()
        for key, t in rows.items()
    ]
    choices = {f"{op} {key}": (t.choice, t.shape, t.ms) for op, rows in tables.items() for key, t in rows.items()}
    return {
        "timed": len(timed),
        "compiled_tuning": at_tuning,
        "compiled_after": compiled[at_tuning:],
        "table": table,
        "choices": choices,
    }


@pytest.mark.skipif(not HAS_CUDA or INTERPRETING, reason="needs a CUDA GPU")
def test_gpu_tune_for_graph_replays(tmp_path, clean_registry):
    """A CUDA-graph-replayed model's tuning: every candidate timed as graph replays (a float for each,
    none dropped for being captured), no persistent among them, and the public ops captured in a CUDA graph
    with the choices give the fp64 torch path's results on fresh inputs copied in."""
    cache = TuningCache(tmp_path / "tuned_configs.json")
    tables = autotune.tune_buckets(CFG, GPU_RANGES, "cuda", torch.bfloat16, cache=cache, graphs=True)
    assert tables["lce"] and tables["attention"]
    for op, rows in tables.items():
        for key, tuned in rows.items():
            assert tuned.choice is not None and all(isinstance(ms, float) for ms in tuned.ms.values()), (
                op,
                key,
                tuned.ms,
            )
            assert op != "lce" or (
                tuned.choice[0] != "persistent" and not any(label.startswith("persistent") for label in tuned.ms)
            ), tuned
    gen = torch.Generator().manual_seed(SEED)
    buckets = kernel_buckets.kernel_buckets(CFG, GPU_RANGES, torch.bfloat16, kernel_buckets.device_sms("cuda"))
    for shape in [b.largest for op in kernel_buckets.OPS for b in buckets[op]]:
        static = _lce_inputs(CFG, *shape, torch.bfloat16, gen, "cuda")
        packed = lce_op.PackedLinearCompress.from_weight(static[3], CFG.user_tokens, static[4])
        packed(*static[:3])  # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = packed(*static[:3])
        fresh = _lce_inputs(CFG, *shape, torch.bfloat16, gen)
        for dst, src in zip(static[:3], fresh[:3]):
            dst.copy_(src)
        graph.replay()
        ref = ikbo_linear_compress(*_fp64_cpu(fresh[:3] + static[3:]), backend="torch")
        assert rel_err(out, ref) <= BF16_TOL, shape
        _check_public_ops(CFG, shape, torch.bfloat16, gen, BF16_TOL, device="cuda")  # and eagerly, both ops


@pytest.mark.skipif(not HAS_CUDA or INTERPRETING, reason="needs a CUDA GPU")
def test_gpu_tune_then_restart_times_and_compiles_nothing(tmp_path):
    args = (str(tmp_path / "tuning"), str(tmp_path / "triton"), SEED)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        first = pool.apply(_tune_in_a_fresh_process, args)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        second = pool.apply(_tune_in_a_fresh_process, args)
    print("\n".join(["", f"tuned (bf16, {GPU_RANGES}, seed {SEED}), ms = median of do_bench:"] + first["table"]))
    assert first["timed"] > 0 and first["compiled_tuning"] > 0, first
    assert first["compiled_after"] == [], f"tuned configs compiled again inside their bucket: {first['compiled_after']}"
    assert second["timed"] == 0, second
    assert second["compiled_tuning"] == 0 and second["compiled_after"] == [], second
    assert second["choices"] == first["choices"]  # read back, not timed again
