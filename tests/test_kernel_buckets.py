"""Kernel shape buckets (ikbo_backend/kernel_buckets.py): the enumeration finds the key of every (U, B) of a range,
each representative lies in its bucket, the served models warm up at every representative, and — on
a GPU only — no Triton kernel compiles during requests after the warm-up (counted with Triton's
jit_post_compile_hook in a fresh process, so no earlier test has filled the kernel caches)."""

import dataclasses
import multiprocessing
import secrets

import numpy as np
import pytest
import torch

from ikbo_backend import autotune, stages
from ikbo_backend.autotune import bucket_representatives
from ikbo_backend.kernel_buckets import KEYS, OPS, candidate_counts, kernel_buckets
from ikbo_backend.paths import load_shape_ranges
from ikbo_backend.ranker import RankerConfig, make_demo_weights
from ikbo_backend.requests import ShapeRanges
from ikbo_backend.stages import InteractionModel, warmup_sizes

SEED = secrets.randbits(32)
CFG = RankerConfig()
SERVED = load_shape_ranges()
GPUS = [(torch.float32, 132), (torch.bfloat16, 132), (torch.bfloat16, 78)]  # (model dtype, SMs): H200 and smaller


@pytest.mark.parametrize("dtype, sms", GPUS, ids=lambda x: str(x).replace("torch.", ""))
def test_every_shape_of_a_range_falls_in_an_enumerated_bucket(dtype, sms):
    """Exhaustive over a range that reaches past the exhaustive part of the enumeration (B > 1024)."""
    ranges = ShapeRanges(users=(1, 40), candidates=(1, 2100))
    buckets = kernel_buckets(CFG, ranges, dtype, sms)
    for op in OPS:
        keys = {KEYS[op](CFG, u, b, dtype, sms) for u in range(1, 41) for b in range(1, 2101)}
        assert keys == {bucket.key for bucket in buckets[op]}, op


@pytest.mark.parametrize("dtype, sms", GPUS, ids=lambda x: str(x).replace("torch.", ""))
def test_random_shapes_of_the_served_range_fall_in_a_bucket(dtype, sms):
    rng = np.random.default_rng(SEED)
    buckets = kernel_buckets(CFG, SERVED, dtype, sms)
    users = rng.integers(SERVED.users[0], SERVED.users[1] + 1, 5000)
    shapes = zip(users, rng.integers(SERVED.candidates[0], SERVED.candidates[1] + 1, 5000))
    for u, b in shapes:
        for op in OPS:
            assert KEYS[op](CFG, int(u), int(b), dtype, sms) in {bucket.key for bucket in buckets[op]}, (op, u, b, SEED)


def test_representatives_lie_in_their_bucket_and_range():
    for dtype, sms in GPUS:
        for op, buckets in kernel_buckets(CFG, SERVED, dtype, sms).items():
            for bucket in buckets:
                u, b = bucket.representative
                assert SERVED.users[0] <= u <= SERVED.users[1] and SERVED.candidates[0] <= b <= SERVED.candidates[1]
                assert KEYS[op](CFG, u, b, dtype, sms) == bucket.key


def test_served_fp32_model_buckets():
    """fp32 on the H200: LCE fused and persistent (U and B are not specialized); attention takes torch (fp32)."""
    buckets = kernel_buckets(CFG, SERVED, torch.float32, 132)
    assert sorted(b.key for b in buckets["lce"]) == [("fused",), ("persistent",)]
    assert [b.key for b in buckets["attention"]] == [("torch",)]
    assert len(bucket_representatives(CFG, SERVED, "cpu")) == 1  # a CPU: no Triton, one torch bucket per op


def test_candidate_counts():
    counts = candidate_counts(ShapeRanges((1, 1), (1, 1100)))
    assert counts[:1024] == list(range(1, 1025))
    assert counts[1024:] == [1025, 1039, 1040, 1041, 1055, 1056, 1057, 1071, 1072, 1073, 1087, 1088, 1089]
    assert candidate_counts(ShapeRanges((1, 1), (5, 9))) == [5, 6, 7, 8, 9]


def test_warm_up_runs_every_bucket_representative(monkeypatch):
    """With the SM count of an H200, the warm-up runs the range's ends and middle and every bucket's
    representative (here on the CPU: the shapes are what is checked)."""
    monkeypatch.setattr(autotune, "device_sms", lambda device: 132)
    model = InteractionModel(CFG, make_demo_weights(CFG, seed=1), SERVED, variant="ikbo")
    seen = []
    make_request = stages.make_request
    monkeypatch.setattr(
        stages, "make_request", lambda cfg, u, b, rng: seen.append((u, b)) or make_request(cfg, u, b, rng)
    )
    monkeypatch.setattr(
        stages, "warmup_sizes", lambda ranges: [(1, 1), (3, 40)]
    )  # the range's far end is slow on a CPU
    model.warm_up()
    representatives = [b.representative for op in OPS for b in kernel_buckets(CFG, SERVED, torch.float32, 132)[op]]
    assert set(seen) == {(1, 1), (3, 40)} | set(representatives) and len(seen) == len(set(seen))
    assert (SERVED.users[1], SERVED.candidates[1]) in warmup_sizes(SERVED)


# ------------------------------------------------------------------ GPU only


def _compilations(variant_class: str, seed: int) -> tuple[int, list[str]]:
    """In a fresh process: (kernels compiled by the warm-up, kernels compiled by requests after it)."""
    from triton import knobs

    from ikbo_backend.stages import OnlineModel
    from ikbo_backend.synthetic import make_request

    compiled = []
    knobs.runtime.jit_post_compile_hook = lambda *, fn, **kwargs: compiled.append(fn.name)
    cls = {"InteractionModel": InteractionModel, "OnlineModel": OnlineModel}[variant_class]
    model = cls(CFG, make_demo_weights(CFG, seed=seed % 1000), SERVED, "cuda", variant="ikbo")
    model.warm_up()
    at_warm_up = len(compiled)
    rng = np.random.default_rng(seed)
    shapes = [
        (u + du, b + db)
        for u, b in bucket_representatives(CFG, SERVED, "cuda")
        for du in (0, 1, 16)
        for db in (0, 1, 16, 17)
    ]
    shapes += [(15, 1020), (1, 1), (1, 8192), (256, 8192), (256, 256), (64, 64), (48, 1536)]
    shapes += list(zip(rng.integers(1, 257, 60).tolist(), rng.integers(1, 8193, 60).tolist()))
    with torch.inference_mode():
        for u, b in shapes:
            u, b = min(u, SERVED.users[1]), max(min(b, SERVED.candidates[1]), u)
            model(model.example(make_request(CFG, u, b, rng)))
    torch.cuda.synchronize()
    return at_warm_up, compiled[at_warm_up:]


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="Triton compiles kernels only for a GPU (CPU runs the torch path)"
)
@pytest.mark.parametrize("variant_class", ["InteractionModel", "OnlineModel"])
def test_no_triton_compilation_on_the_request_path(variant_class):
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        at_warm_up, during_requests = pool.apply(_compilations, (variant_class, SEED))
    assert at_warm_up > 0, "the hook saw no compilation during the warm-up: it does not count"
    assert during_requests == [], f"compiled on the request path: {during_requests} (seed {SEED})"


def test_gluon_attention_is_a_candidate_on_hopper_in_16_bit_and_its_choice_round_trips():
    """The Gluon warp-specialized attention kernel is tried only on a Hopper GPU for fp16/bf16 with
    d ∈ {64, 128}; its cached choice decodes to attention_op.WS_CHOICE, which `_launch` takes."""
    from ikbo_backend.autotune import _attention_label, _decode, attention_candidates
    from ikbo_backend.ranker import RankerConfig
    from kernels import attention as attention_op

    cfg = RankerConfig(embedding_dim=256, heads=2)  # d = 128
    for dtype in (torch.float16, torch.bfloat16):
        assert attention_candidates(cfg, ("triton",), dtype, hopper=True)[-1] == attention_op.WS_CHOICE
        assert attention_op.WS_CHOICE not in attention_candidates(cfg, ("triton",), dtype, hopper=False)
    assert attention_op.WS_CHOICE not in attention_candidates(cfg, ("triton",), torch.float32, hopper=True)
    assert attention_op.WS_CHOICE not in attention_candidates(
        RankerConfig(embedding_dim=96, heads=3), ("triton",), torch.bfloat16, hopper=True
    )
    assert _decode("attention", {"tile": None, "kernel": attention_op.WS_CHOICE}) == attention_op.WS_CHOICE
    assert attention_op.WS_CHOICE == "warp_specialized"
    assert _attention_label(attention_op.WS_CHOICE) == "warp_specialized (Gluon)"
    tile = attention_candidates(cfg, ("triton",))[0]
    assert _decode("attention", {"tile": dataclasses.asdict(tile)}) == tile


def test_warp_specialized_is_an_lce_candidate_on_hopper_in_16_bit_and_its_choice_round_trips():
    """warp_specialized (Gluon) is tried only on a Hopper GPU for fp16/bf16; its cached choice (tile None) decodes
    to what `set_tuned_configs` hands the op: ("warp_specialized", None), launched with its own config."""
    from ikbo_backend.autotune import _decode, _lce_label, lce_candidates
    from ikbo_backend.ranker import RankerConfig

    ws = ("warp_specialized", None)
    cfg = RankerConfig()
    for key in (("fused",), ("persistent",)):
        for dtype in (torch.float16, torch.bfloat16):
            assert lce_candidates(cfg, key, dtype, hopper=True)[-1] == ws
            assert ws not in lce_candidates(cfg, key, dtype, hopper=False)
        assert ws not in lce_candidates(cfg, key, torch.float32, hopper=True)
    assert _decode("lce", {"variant": "warp_specialized", "tile": None}) == ws
    assert _lce_label("warp_specialized", None) == "warp_specialized (Gluon)"
    variant, tile = _decode(
        "lce", {"variant": "fused", "tile": dataclasses.asdict(lce_candidates(cfg, ("fused",), torch.float16)[0][1])}
    )
    assert variant == "fused" and tile == lce_candidates(cfg, ("fused",), torch.float16)[0][1]
