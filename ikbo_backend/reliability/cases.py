"""Malformed requests drawn by hypothesis, every kind: what to send and what the answer must say."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..paths import load_shape_ranges
from ..requests import CAND_INPUTS, INPUT_DTYPES, INPUT_NAMES, USER_INPUTS
from ..synthetic import make_request
from . import CFG, RANKERS

RANGES = load_shape_ranges()

TORCH_TO_NP = {"float32": np.float32, "float64": np.float64, "int32": np.int32, "int64": np.int64}
NP_DTYPES = {name: TORCH_TO_NP[str(dtype).removeprefix("torch.")] for name, dtype in INPUT_DTYPES.items()}


@dataclass
class Case:
    """One malformed request: what to send and what the answer must say."""

    kind: str
    model: str
    request: dict  # name → array (what the client sends)
    name: str  # the input (or model) the message must name
    problem: tuple[str, ...]  # the message holds one of these (lower case)
    truncate: int = 0  # > 0: raw request whose binary header claims this many bytes more than sent


KINDS = (
    "dtype", "rank", "width", "user rows != U", "cand rows != B", "mapping >= U", "mapping negative",
    "B = 0", "U above range", "B above range", "id outside table", "NaN/Inf", "history_len outside [0, L]",
    "missing input", "unknown input", "truncated binary payload", "unknown model",
)  # fmt: skip


def _case_strategy(kind: str):
    from hypothesis import strategies as st

    @st.composite
    def cases(draw):
        model = draw(st.sampled_from(RANKERS))
        num_users, num_candidates = draw(st.integers(1, 8)), draw(st.integers(1, 48))
        seed = draw(st.integers(0, 2**32 - 1))
        rng = np.random.default_rng(seed)
        if kind == "U above range":
            num_users = RANGES.users[1] + draw(st.integers(1, 4))
        if kind == "B above range":
            num_candidates = RANGES.candidates[1] + draw(st.integers(1, 4))
        if kind in ("mapping >= U", "user rows != U"):
            num_users = max(num_users, 2)
        r = make_request(CFG, num_users, num_candidates, rng)
        pick = lambda names: draw(st.sampled_from(names))  # noqa: E731
        if kind == "dtype":
            name = pick(INPUT_NAMES)
            wrong = draw(
                st.sampled_from(
                    [d for d in (np.float32, np.float64, np.int32, np.int64, np.float16) if d != NP_DTYPES[name]]
                )
            )
            r[name] = r[name].astype(wrong)
            return Case(kind, model, r, name, ("data-type", "datatype", "dtype"))
        if kind == "rank":
            name = pick(INPUT_NAMES)
            r[name] = (
                r[name][..., None]
                if draw(st.booleans())
                else (r[name].reshape(-1) if r[name].ndim == 2 else r[name][None])
            )
            return Case(kind, model, r, name, ("shape", "rank"))
        if kind == "width":
            name = pick([n for n in INPUT_NAMES if r[n].ndim == 2])
            extra = draw(st.sampled_from([-1, 1, 3]))
            r[name] = r[name][:, :-1] if extra < 0 else np.concatenate([r[name]] + [r[name][:, :1]] * extra, axis=1)
            return Case(kind, model, r, name, ("shape", "columns"))
        if kind == "user rows != U":
            name = pick(USER_INPUTS[1:])
            r[name] = r[name][:-1] if draw(st.booleans()) else np.concatenate([r[name], r[name][:1]])
            return Case(kind, model, r, name, ("rows",))
        if kind == "cand rows != B":
            name = pick(CAND_INPUTS[1:])
            r[name] = r[name][:-1] if draw(st.booleans()) else np.concatenate([r[name], r[name][:1]])
            return Case(kind, model, r, name, ("rows",))
        if kind in ("mapping >= U", "mapping negative"):
            i = draw(st.integers(0, num_candidates - 1))
            r["cand_to_user"][i] = (
                num_users + draw(st.integers(0, 1000)) if kind == "mapping >= U" else -draw(st.integers(1, 2**31 - 1))
            )
            return Case(kind, model, r, "cand_to_user", ("outside",))
        if kind == "B = 0":
            r.update({n: r[n][:0] for n in CAND_INPUTS})
            return Case(kind, model, r, "cand_dense", ("b = 0",))
        if kind == "U above range":
            return Case(kind, model, r, "user_dense", ("outside the served range",))
        if kind == "B above range":
            return Case(kind, model, r, "cand_dense", ("outside the served range",))
        if kind == "id outside table":
            name, vocab = draw(
                st.sampled_from(
                    [
                        ("user_sparse_ids", CFG.user_vocab_size),
                        ("cand_sparse_ids", CFG.cand_vocab_size),
                        ("user_history_ids", CFG.item_vocab_size),
                    ]
                )
            )
            index = tuple(draw(st.integers(0, s - 1)) for s in r[name].shape)
            r[name][index] = draw(st.one_of(st.integers(vocab, 2**62), st.integers(-(2**62), -1)))
            return Case(kind, model, r, name, ("outside the table",))
        if kind == "NaN/Inf":
            name = pick(("user_dense", "cand_dense"))
            index = tuple(draw(st.integers(0, s - 1)) for s in r[name].shape)
            r[name][index] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
            return Case(kind, model, r, name, ("nan or inf",))
        if kind == "history_len outside [0, L]":
            i = draw(st.integers(0, num_users - 1))
            r["user_history_len"][i] = draw(
                st.one_of(st.integers(CFG.history_length + 1, 2**31 - 1), st.integers(-(2**31), -1))
            )
            return Case(kind, model, r, "user_history_len", ("outside",))
        if kind == "missing input":
            name = pick(INPUT_NAMES)
            del r[name]
            return Case(kind, model, r, name, ("missing",))
        if kind == "unknown input":
            name = draw(st.sampled_from(["user_densse", "scores", "candidates", "cand_to_users"]))
            r[name] = np.zeros((num_candidates,), np.int32)
            return Case(kind, model, r, name, ("unexpected", "expected 7 inputs"))
        if kind == "truncated binary payload":  # the body ends early: the last input (in a drawn order) is short
            order = draw(st.permutations(INPUT_NAMES))
            r, name = {n: r[n] for n in order}, order[-1]
            return Case(
                kind,
                model,
                r,
                name,
                ("size", "byte", "unexpected", "expected"),
                truncate=draw(st.integers(1, r[name].nbytes)),
            )
        name = draw(st.sampled_from(["ikbo_rankr", "ranker", "ikbo_ranker_v2", "IKBO_RANKER"]))
        return Case(kind, name, r, name, ("unknown model", "not found"))

    return cases()


def malformed_cases(count: int, seed: int) -> list[Case]:
    """`count` malformed requests drawn by hypothesis (reproducible from `seed`), every kind."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed

    drawn: list[Case] = []
    for i, kind in enumerate(KINDS):  # every kind, count/len(KINDS) examples each

        @hypothesis_seed(seed + i)
        @settings(
            max_examples=-(-count // len(KINDS)),
            database=None,
            deadline=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(_case_strategy(kind))
        def collect(case):
            drawn.append(case)

        collect()
    return drawn
